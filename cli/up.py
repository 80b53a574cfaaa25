"""`chariot up`: the embedded default — the same router and stage workers as a cluster deployment,
as local processes on this machine.

Starts R replicas × P pipeline stages (`chariot worker`, rendezvous on loopback) and one router
(`chariot router`), waits for each to print its ready line, prints the endpoints, and supervises:
a dead stage fails and recreates its own group only (`chariot.cli.groups`, the operator's gang-restart
semantics); Ctrl-C/SIGTERM or the router exiting tears everything down. Children die with this process.
It sits above the worker and router packages: it starts both.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import ssl
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path

from chariot.cli.autoscale import LocalAutoscaler, fetch_load, write_replica_file
from chariot.cli.groups import GroupSupervisor
from chariot.contracts.autoscaling import AutoscalingPolicy, OfferedLoad
from chariot.contracts.engine_settings import ENGINE_CORE, ITERATION_LOG
from chariot.contracts.errors import ConfigError
from chariot.contracts.processes import Child, ready_field, shutdown, spawn, wait_ready
from chariot.operator.reconcile import Backoff
from chariot.router.config import ROUTING_MODES
from chariot.router.launch import ROUTER_READY_PREFIX, add_security_flags, router_command, security_args
from chariot.worker.config import EngineConfig
from chariot.worker.flags import add_engine_flags, add_setting_flag, config_from_args
from chariot.worker.iteration_log import IterationLog, iteration_log_path

READY_TIMEOUT_S = 600.0
DEFAULT_MODEL_DIR = Path.home() / ".cache" / "chariot" / "models" / "tiny"


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("up", help="run router + stage workers as local processes (the embedded default)",
                       description="Start R replicas of P pipeline stages and one router on this machine, "
                                   "print the endpoints, and stop everything on Ctrl-C. With no --model, "
                                   "the tiny preset is made first.")
    add_engine_flags(p, model_required=False)
    p.set_defaults(stages=2)
    p.add_argument("--replicas", type=int, default=1, help="pipeline groups (default 1)")
    p.add_argument("--host", default="127.0.0.1", help="router bind address")
    p.add_argument("--http-port", type=int, default=8000)
    p.add_argument("--grpc-port", type=int, default=50051)
    p.add_argument("--redis-url", default=None, help="shared router state (optional)")
    p.add_argument("--ttft-slo-ms", type=float, default=None)
    p.add_argument("--max-queue-per-replica", type=int, default=None,
                   help="router admission: queued requests per replica before shedding (router default if unset)")
    p.add_argument("--served-model-name", default=None)
    add_security_flags(p)
    p.add_argument("--routing", choices=ROUTING_MODES, default=None,
                   help="router replica choice: prefix (default), load or round_robin (baselines)")
    add_setting_flag(p, ENGINE_CORE)
    add_setting_flag(p, ITERATION_LOG)
    p.add_argument("--restart-backoff-seconds", type=float, default=5.0,
                   help="delay before a group whose stage died is recreated, doubled per restart (as the operator)")
    p.add_argument("--max-restart-backoff-seconds", type=float, default=300.0, help="cap of that delay")
    add_autoscaling_flags(p)
    p.set_defaults(handler=_run_up)


def add_autoscaling_flags(p: argparse.ArgumentParser) -> None:
    """The operator's `spec.autoscaling`, for local replica processes (`chariot.cli.autoscale`)."""
    g = p.add_argument_group("autoscaling", "size the replicas from the router's offered load, as the operator's "
                                            "spec.autoscaling does (docs/kubernetes.md, Autoscaling)")
    g.add_argument("--max-replicas", type=int, default=None,
                   help="autoscale up to this many replicas (unset: a fixed --replicas)")
    g.add_argument("--min-replicas", type=int, default=1, help="autoscale down to this many (default 1)")
    g.add_argument("--target-utilization", type=float, default=0.7,
                   help="share of a replica's measured capacity to plan for (default 0.7)")
    g.add_argument("--scale-up-stabilization-seconds", type=float, default=0.0,
                   help="a rise must be asked for this long before a replica starts (default 0)")
    g.add_argument("--scale-down-stabilization-seconds", type=float, default=60.0,
                   help="replicas stop only down to the highest recommendation of this window (default 60)")
    g.add_argument("--drain-grace-seconds", type=float, default=60.0,
                   help="a replica chosen to stop is drained first, at most this long (default 60)")
    g.add_argument("--autoscale-interval-seconds", type=float, default=1.0, help="how often it looks (default 1)")
    g.add_argument("--offered-load-window-seconds", type=float, default=None,
                   help="the router's window over the offered load (default 30): shorter reacts sooner")
    g.add_argument("--autoscale-log", default=None, metavar="FILE",
                   help="append each look (offered load, capacity, replicas, reason) as JSON lines")


FLAG_OF_FIELD = {"minReplicas": "min_replicas", "maxReplicas": "max_replicas",
                 "targetUtilization": "target_utilization", "scaleUpStabilizationSeconds":
                 "scale_up_stabilization_seconds", "scaleDownStabilizationSeconds": "scale_down_stabilization_seconds",
                 "drainGracePeriodSeconds": "drain_grace_seconds"}


def autoscaling_policy(args: argparse.Namespace) -> AutoscalingPolicy | None:
    """The policy of `--max-replicas` and its flags (None without it); a `ConfigError` names the flag."""
    if args.max_replicas is None:
        return None
    if args.min_replicas < 1:
        raise ConfigError("min_replicas", f"must be >= 1 locally (scale to zero needs a Kubernetes deployment), "
                                          f"got {args.min_replicas}")
    try:
        return AutoscalingPolicy(min_replicas=args.min_replicas, max_replicas=args.max_replicas,
                                 target_utilization=args.target_utilization,
                                 scale_up_stabilization_s=args.scale_up_stabilization_seconds,
                                 scale_down_stabilization_s=args.scale_down_stabilization_seconds,
                                 drain_grace_s=args.drain_grace_seconds, field_prefix="")
    except ConfigError as exc:
        raise ConfigError(FLAG_OF_FIELD.get(exc.field.lstrip("."), exc.field), exc.message) from exc


def _run_up(args: argparse.Namespace) -> int:
    if args.replicas < 1:
        raise ConfigError("replicas", f"must be >= 1, got {args.replicas}")
    policy = autoscaling_policy(args)
    if policy is not None:
        args.replicas = policy.bound(args.replicas)
    args.model = ensure_model(args.model)
    return run_up(args, config_from_args(args), policy)


def ensure_model(model: str | None) -> str:
    if model:
        return model
    if not (DEFAULT_MODEL_DIR / "config.json").is_file():
        from chariot.worker.model.make_model import make_model

        print(f"no --model given: making the tiny preset in {DEFAULT_MODEL_DIR}", file=sys.stderr)
        make_model(DEFAULT_MODEL_DIR, "tiny")
    return str(DEFAULT_MODEL_DIR)


def run_up(args: argparse.Namespace, config_for: EngineConfig, policy: AutoscalingPolicy | None = None) -> int:
    """Start everything, print the endpoints, supervise until interrupted; the exit code. With a
    `policy`, the router reads its replicas from a file the autoscaler rewrites."""
    served = args.served_model_name or Path(config_for.model).name
    if args.iteration_log is not None:  # a path that cannot be written fails here, naming the setting
        IterationLog(iteration_log_path(args.iteration_log, 0)).close()
    supervisor = GroupSupervisor(config_for, served, args.engine_core,
                                 Backoff(base_s=args.restart_backoff_seconds, max_s=args.max_restart_backoff_seconds,
                                         reset_after_s=args.max_restart_backoff_seconds),
                                 iteration_log=args.iteration_log)
    router: Child | None = None
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        groups = supervisor.start(args.replicas)
        for group in groups:
            supervisor.wait_ready(group, READY_TIMEOUT_S)
        replicas = [f"g{g.index}={g.address}" for g in groups]
        replica_file = None
        if policy is not None:
            replica_file = Path(tempfile.mkdtemp(prefix="chariot-up-")) / "replicas.json"
            write_replica_file(replica_file, groups)
        cmd = router_command(config_for.model, served, [] if replica_file else replicas, host=args.host,
                             http_port=args.http_port, grpc_port=args.grpc_port, redis_url=args.redis_url,
                             tbt_slo_ms=args.tbt_slo_ms, ttft_slo_ms=args.ttft_slo_ms, routing=args.routing,
                             replica_file=str(replica_file) if replica_file else None,
                             offered_load_window_s=args.offered_load_window_seconds)
        if args.max_queue_per_replica is not None:
            cmd += ["--max-queue-per-replica", str(args.max_queue_per_replica)]
        cmd += security_args(args)
        router = spawn("router", cmd, dict(os.environ), ROUTER_READY_PREFIX)
        line = wait_ready(router, [router, *supervisor.children()], READY_TIMEOUT_S)
        scheme = "https" if args.tls_cert else "http"
        wait_routable(line, len(replicas), READY_TIMEOUT_S, scheme)
        print_endpoints(line, served, replicas, config_for, scheme)
        with contextlib.ExitStack() as stack:
            autoscaler = None
            if policy is not None and replica_file is not None:
                log = stack.enter_context(open(args.autoscale_log, "a")) if args.autoscale_log else None
                autoscaler = LocalAutoscaler(policy, supervisor, replica_file, load_fetcher(line, scheme),
                                             args.autoscale_interval_seconds, log)
                print(f"autoscaling  {policy.min_replicas}..{policy.max_replicas} replicas, target utilization "
                      f"{policy.target_utilization:g}", flush=True)
            return supervise_up(router, supervisor, stop, autoscaler)
    except RuntimeError as exc:
        print(f"chariot up: {exc}", file=sys.stderr)
        return 1
    finally:
        shutdown(([router] if router is not None else []) + supervisor.children())


def wait_routable(router_line: str, replicas: int, timeout_s: float, scheme: str = "http") -> None:
    """Until the router's /health counts every replica ready: its ready line comes when it serves,
    which can be a moment before its first load poll has marked the replicas ready (a request then
    would get 503). Raises RuntimeError past `timeout_s`. Over https the local probe does not verify the
    certificate (it only reads readiness from the router this command just started)."""
    http = ready_field(router_line, "http")
    if http is None:
        return
    url, deadline, seen = f"{scheme}://{http}/health", time.monotonic() + timeout_s, 0
    context = ssl._create_unverified_context() if scheme == "https" else None
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url, timeout=2.0, context=context) as resp:
                seen = int(json.load(resp).get("ready_replicas", 0))
        except urllib.error.HTTPError as exc:  # 503 while no replica is ready; its body still counts them
            seen = int(json.load(exc).get("ready_replicas", 0))
        except (OSError, ValueError):
            seen = 0
        if seen >= replicas:
            return
        time.sleep(0.1)
    raise RuntimeError(f"the router saw {seen} of {replicas} replica(s) ready after {timeout_s:g} s")


def supervise_up(router: Child, supervisor: GroupSupervisor, stop: threading.Event,
                 autoscaler: LocalAutoscaler | None = None) -> int:
    """Until interrupted: a dead stage fails (and later recreates) its own group only; the router
    exiting ends everything (nothing would serve); the autoscaler, if any, takes its looks."""
    while not stop.wait(0.2):
        if router.proc.poll() is not None:
            print(f"chariot up: the router exited with code {router.proc.returncode}; shutting down", file=sys.stderr)
            return 1
        supervisor.check()
        if autoscaler is not None:
            autoscaler.step()
    return 0


def load_fetcher(router_line: str, scheme: str) -> Callable[[], OfferedLoad | None]:
    """Reads the router's `GET /load` (over https without verifying: it is the router started here)."""
    url = f"{scheme}://{ready_field(router_line, 'http') or '127.0.0.1:0'}/load"
    context = ssl._create_unverified_context() if scheme == "https" else None
    return lambda: fetch_load(url, context=context)


def print_endpoints(router_line: str, served: str, replicas: list[str], config: EngineConfig,
                    scheme: str = "http") -> None:
    http_addr = ready_field(router_line, "http") or "?"
    grpc_addr = ready_field(router_line, "grpc") or "?"
    tp = f" x {config.tensor_parallel_size} tensor-parallel rank(s)" if config.tensor_parallel_size > 1 else ""
    print(f"model        {served} ({config.model}), {config.pipeline_stages} stage(s){tp} x {len(replicas)} "
          f"replica(s), policy {config.policy}")
    print(f"OpenAI HTTP  {scheme}://{http_addr}/v1   (e.g. curl {scheme}://{http_addr}/v1/completions "
          f"-d '{{\"model\": \"{served}\", \"prompt\": \"Hello\", \"max_tokens\": 16}}')")
    print(f"gRPC         {grpc_addr}   (chariot.v1.Generation; `chariot generate --target {grpc_addr} \"Hello\"`)")
    print(f"metrics      {scheme}://{http_addr}/metrics")
    print(f"chariot up ready http={http_addr} grpc={grpc_addr}", flush=True)


