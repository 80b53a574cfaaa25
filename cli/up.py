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
import json
import os
import re
import signal
import ssl
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

from chariot.cli.groups import GroupSupervisor
from chariot.contracts.engine_settings import ENGINE_CORE
from chariot.contracts.errors import ConfigError
from chariot.contracts.processes import Child, shutdown, spawn, wait_ready
from chariot.operator.reconcile import Backoff
from chariot.router.config import ROUTING_MODES
from chariot.router.launch import ROUTER_READY_PREFIX, add_security_flags, router_command, security_args
from chariot.worker.config import EngineConfig
from chariot.worker.flags import add_engine_flags, add_setting_flag, config_from_args

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
    p.add_argument("--restart-backoff-seconds", type=float, default=5.0,
                   help="delay before a group whose stage died is recreated, doubled per restart (as the operator)")
    p.add_argument("--max-restart-backoff-seconds", type=float, default=300.0, help="cap of that delay")
    p.set_defaults(handler=_run_up)


def _run_up(args: argparse.Namespace) -> int:
    if args.replicas < 1:
        raise ConfigError("replicas", f"must be >= 1, got {args.replicas}")
    args.model = ensure_model(args.model)
    return run_up(args, config_from_args(args))


def ensure_model(model: str | None) -> str:
    if model:
        return model
    if not (DEFAULT_MODEL_DIR / "config.json").is_file():
        from chariot.worker.model.make_model import make_model

        print(f"no --model given: making the tiny preset in {DEFAULT_MODEL_DIR}", file=sys.stderr)
        make_model(DEFAULT_MODEL_DIR, "tiny")
    return str(DEFAULT_MODEL_DIR)


def run_up(args: argparse.Namespace, config_for: EngineConfig) -> int:
    """Start everything, print the endpoints, supervise until interrupted; the exit code."""
    served = args.served_model_name or Path(config_for.model).name
    supervisor = GroupSupervisor(config_for, served, args.engine_core,
                                 Backoff(base_s=args.restart_backoff_seconds, max_s=args.max_restart_backoff_seconds,
                                         reset_after_s=args.max_restart_backoff_seconds))
    router: Child | None = None
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        groups = supervisor.start(args.replicas)
        for group in groups:
            wait_ready(group.stage0, supervisor.children(), READY_TIMEOUT_S)
        replicas = [f"g{g.index}={g.address}" for g in groups]
        cmd = router_command(config_for.model, served, replicas, host=args.host, http_port=args.http_port,
                             grpc_port=args.grpc_port, redis_url=args.redis_url, tbt_slo_ms=args.tbt_slo_ms,
                             ttft_slo_ms=args.ttft_slo_ms, routing=args.routing)
        if args.max_queue_per_replica is not None:
            cmd += ["--max-queue-per-replica", str(args.max_queue_per_replica)]
        cmd += security_args(args)
        router = spawn("router", cmd, dict(os.environ), ROUTER_READY_PREFIX)
        line = wait_ready(router, [router, *supervisor.children()], READY_TIMEOUT_S)
        scheme = "https" if args.tls_cert else "http"
        wait_routable(line, len(replicas), READY_TIMEOUT_S, scheme)
        print_endpoints(line, served, replicas, config_for, scheme)
        return supervise_up(router, supervisor, stop)
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
    http = re.search(r"http=(\S+)", router_line)
    if http is None:
        return
    url, deadline, seen = f"{scheme}://{http.group(1)}/health", time.monotonic() + timeout_s, 0
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


def supervise_up(router: Child, supervisor: GroupSupervisor, stop: threading.Event) -> int:
    """Until interrupted: a dead stage fails (and later recreates) its own group only; the router
    exiting ends everything (nothing would serve)."""
    while not stop.wait(0.2):
        if router.proc.poll() is not None:
            print(f"chariot up: the router exited with code {router.proc.returncode}; shutting down", file=sys.stderr)
            return 1
        supervisor.check()
    return 0


def print_endpoints(router_line: str, served: str, replicas: list[str], config: EngineConfig,
                    scheme: str = "http") -> None:
    http = re.search(r"http=(\S+)", router_line)
    grpc = re.search(r"grpc=(\S+)", router_line)
    http_addr = http.group(1) if http else "?"
    grpc_addr = grpc.group(1) if grpc else "?"
    tp = f" x {config.tensor_parallel_size} tensor-parallel rank(s)" if config.tensor_parallel_size > 1 else ""
    print(f"model        {served} ({config.model}), {config.pipeline_stages} stage(s){tp} x {len(replicas)} "
          f"replica(s), policy {config.policy}")
    print(f"OpenAI HTTP  {scheme}://{http_addr}/v1   (e.g. curl {scheme}://{http_addr}/v1/completions "
          f"-d '{{\"model\": \"{served}\", \"prompt\": \"Hello\", \"max_tokens\": 16}}')")
    print(f"gRPC         {grpc_addr}   (chariot.v1.Generation; `chariot generate --target {grpc_addr} \"Hello\"`)")
    print(f"metrics      {scheme}://{http_addr}/metrics")
    print(f"chariot up ready http={http_addr} grpc={grpc_addr}", flush=True)


