"""`chariot up`: the embedded default — the same router and stage workers as a cluster deployment,
as local processes on this machine.

Starts R replicas × P pipeline stages (`chariot worker`, rendezvous on loopback) and one router
(`chariot router`), waits for each to print its ready line, prints the endpoints, and supervises:
Ctrl-C/SIGTERM or any child exiting tears everything down. Children also die with this process.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from chariot.worker.config import EngineConfig
from chariot.worker.flags import config_to_argv
from chariot.worker.pipeline.launcher import die_with_parent, free_port, stage_env
from chariot.worker.pipeline.transport import Topology

READY_TIMEOUT_S = 600.0
DEFAULT_MODEL_DIR = Path.home() / ".cache" / "chariot" / "models" / "tiny"


@dataclass
class Child:
    """One supervised process and the ready line it printed."""

    name: str
    proc: subprocess.Popen[str]
    ready_line: str | None = None
    ready: threading.Event = field(default_factory=threading.Event)

    def pump(self, pattern: str) -> None:
        """Echo the child's stdout and remember its ready line (runs on a thread)."""
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if self.ready_line is None and line.startswith(pattern):
                self.ready_line = line.strip()
                self.ready.set()
            else:
                sys.stderr.write(f"[{self.name}] {line}")
        self.ready.set()  # EOF: the child exited


def spawn(name: str, cmd: list[str], env: dict[str, str], ready_prefix: str) -> Child:
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, text=True, bufsize=1,
                            preexec_fn=die_with_parent)
    child = Child(name, proc)
    threading.Thread(target=child.pump, args=(ready_prefix,), daemon=True).start()
    return child


def wait_ready(child: Child, others: list[Child], timeout: float) -> str:
    """The child's ready line; fails as soon as it or any other child exits first."""
    deadline = time.monotonic() + timeout
    while not child.ready.wait(0.2):
        for c in [child, *others]:
            if c.proc.poll() is not None:
                raise RuntimeError(f"{c.name} exited with code {c.proc.returncode} before {child.name} was ready")
        if time.monotonic() > deadline:
            raise RuntimeError(f"{child.name} did not become ready within {timeout:.0f}s")
    if child.ready_line is None:
        raise RuntimeError(f"{child.name} exited with code {child.proc.wait()} before it was ready")
    return child.ready_line


def ensure_model(model: str | None) -> str:
    if model:
        return model
    if not (DEFAULT_MODEL_DIR / "config.json").is_file():
        from chariot.worker.model.make_model import make_model

        print(f"no --model given: making the tiny preset in {DEFAULT_MODEL_DIR}", file=sys.stderr)
        make_model(DEFAULT_MODEL_DIR, "tiny")
    return str(DEFAULT_MODEL_DIR)


def worker_cmd(config: EngineConfig, served: str, port: int) -> list[str]:
    return [sys.executable, "-m", "chariot.worker.cli", "worker", *config_to_argv(config),
            "--port", str(port), "--metrics-port", "0", "--served-model-name", served]


def start_replica(index: int, config: EngineConfig, served: str) -> tuple[list[Child], Child]:
    """All stages of replica `index`; returns (children, its stage 0)."""
    topo = Topology(0, config.pipeline_stages, "127.0.0.1", free_port())
    children = [
        spawn(f"replica {index} stage {rank}", worker_cmd(config, served, 0), stage_env(topo, rank),
              "chariot worker ready")
        for rank in range(config.pipeline_stages)
    ]
    return children, children[0]


def router_cmd(args: argparse.Namespace, model: str, served: str, replicas: list[str]) -> list[str]:
    cmd = [sys.executable, "-m", "chariot.worker.cli", "router", "--host", args.host,
           "--http-port", str(args.http_port), "--grpc-port", str(args.grpc_port),
           "--served-model-name", served, "--model", model]
    for r in replicas:
        cmd += ["--replica", r]
    if args.redis_url:
        cmd += ["--redis-url", args.redis_url]
    if args.tbt_slo_ms is not None:
        cmd += ["--tbt-slo-ms", str(args.tbt_slo_ms)]
    if args.ttft_slo_ms is not None:
        cmd += ["--ttft-slo-ms", str(args.ttft_slo_ms)]
    return cmd


def run_up(args: argparse.Namespace, config_for: EngineConfig) -> int:
    """Start everything, print the endpoints, supervise until interrupted; the exit code."""
    served = args.served_model_name or Path(config_for.model).name
    children: list[Child] = []
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        addresses = []
        for r in range(args.replicas):
            group, stage0 = start_replica(r, config_for, served)
            children += group
            addresses.append((r, stage0))
        replicas = []
        for r, stage0 in addresses:
            grpc_addr = re.search(r"grpc=(\S+)", wait_ready(stage0, children, READY_TIMEOUT_S))
            assert grpc_addr is not None
            replicas.append(f"g{r}={grpc_addr.group(1)}")
        router = spawn("router", router_cmd(args, config_for.model, served, replicas), dict(os.environ),
                       "chariot router ready")
        children.append(router)
        line = wait_ready(router, children, READY_TIMEOUT_S)
        print_endpoints(line, served, replicas, config_for)
        return supervise(children, stop)
    except RuntimeError as exc:
        print(f"chariot up: {exc}", file=sys.stderr)
        return 1
    finally:
        shutdown(children)


def print_endpoints(router_line: str, served: str, replicas: list[str], config: EngineConfig) -> None:
    http = re.search(r"http=(\S+)", router_line)
    grpc = re.search(r"grpc=(\S+)", router_line)
    http_addr = http.group(1) if http else "?"
    grpc_addr = grpc.group(1) if grpc else "?"
    print(f"model        {served} ({config.model}), {config.pipeline_stages} stage(s) x {len(replicas)} replica(s), "
          f"policy {config.policy}")
    print(f"OpenAI HTTP  http://{http_addr}/v1   (e.g. curl http://{http_addr}/v1/completions "
          f"-d '{{\"model\": \"{served}\", \"prompt\": \"Hello\", \"max_tokens\": 16}}')")
    print(f"gRPC         {grpc_addr}   (chariot.v1.Generation; `chariot generate --target {grpc_addr} \"Hello\"`)")
    print(f"metrics      http://{http_addr}/metrics")
    print(f"chariot up ready http={http_addr} grpc={grpc_addr}", flush=True)


def supervise(children: list[Child], stop: threading.Event) -> int:
    while not stop.wait(0.2):
        for child in children:
            code = child.proc.poll()
            if code is not None:
                print(f"chariot up: {child.name} exited with code {code}; shutting down", file=sys.stderr)
                return 1
    return 0


def shutdown(children: list[Child], grace_s: float = 10.0) -> None:
    """SIGTERM the router and every stage 0 (which tell their downstream stages to exit), then the
    rest; SIGKILL whatever is still alive after the grace period."""
    leaders = [c for c in children if c.name == "router" or c.name.endswith("stage 0")]
    for wave in (leaders, [c for c in children if c not in leaders]):
        for child in wave:
            if child.proc.poll() is None:
                child.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for child in wave:
            try:
                child.proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                child.proc.kill()
                child.proc.wait()
