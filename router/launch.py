"""The `chariot router` command line as a local deployment starts it (`chariot up`, the benchmarks),
so every launcher passes the same flags the same way."""

from __future__ import annotations

import sys
from collections.abc import Sequence

ROUTER_READY_PREFIX = "chariot router ready"


def router_command(model: str, served: str, replicas: Sequence[str], *, host: str = "127.0.0.1",
                   http_port: int = 0, grpc_port: int = 0, redis_url: str | None = None,
                   tbt_slo_ms: float | None = None, ttft_slo_ms: float | None = None) -> list[str]:
    """`chariot router` fronting `replicas` (`NAME=HOST:PORT` each) on the given ports (0 = free)."""
    cmd = [sys.executable, "-m", "chariot.router", "router", "--host", host, "--http-port", str(http_port),
           "--grpc-port", str(grpc_port), "--served-model-name", served, "--model", model]
    for replica in replicas:
        cmd += ["--replica", replica]
    if redis_url:
        cmd += ["--redis-url", redis_url]
    if tbt_slo_ms is not None:
        cmd += ["--tbt-slo-ms", str(tbt_slo_ms)]
    if ttft_slo_ms is not None:
        cmd += ["--ttft-slo-ms", str(ttft_slo_ms)]
    return cmd
