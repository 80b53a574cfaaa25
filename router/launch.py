"""The `chariot router` command line as a local deployment starts it (`chariot up`, the benchmarks),
so every launcher passes the same flags the same way."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

ROUTER_READY_PREFIX = "chariot router ready"


def add_security_flags(p: argparse.ArgumentParser) -> None:
    """`--api-keys`, `--tls-cert`, `--tls-key` (shared by `chariot router` and `chariot up`)."""
    p.add_argument("--api-keys", default=None, metavar="FILE",
                   help="YAML file of API keys bound to tenants (docs/api.md); every /v1/ call then needs "
                        "'Authorization: Bearer <key>'. Reloaded when it changes")  # fmt: skip
    p.add_argument("--tls-cert", default=None, metavar="FILE",
                   help="PEM certificate chain served on both fronts (with --tls-key); reloaded when it changes")
    p.add_argument("--tls-key", default=None, metavar="FILE", help="PEM private key of --tls-cert")


def security_args(args: argparse.Namespace) -> list[str]:
    """The `add_security_flags` flags of `args` as `chariot router` arguments (unset ones left out)."""
    cmd: list[str] = []
    for flag, value in (("--api-keys", args.api_keys), ("--tls-cert", args.tls_cert), ("--tls-key", args.tls_key)):
        if value:
            cmd += [flag, value]
    return cmd


def router_command(model: str, served: str, replicas: Sequence[str], *, host: str = "127.0.0.1",
                   http_port: int = 0, grpc_port: int = 0, redis_url: str | None = None,
                   tbt_slo_ms: float | None = None, ttft_slo_ms: float | None = None,
                   routing: str | None = None, replica_file: str | None = None,
                   offered_load_window_s: float | None = None) -> list[str]:
    """`chariot router` fronting `replicas` (`NAME=HOST:PORT` each), or the replicas listed in the
    watched `replica_file`, on the given ports (0 = free)."""
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
    if routing is not None:
        cmd += ["--routing", routing]
    if replica_file is not None:
        cmd += ["--replica-file", replica_file]
    if offered_load_window_s is not None:
        cmd += ["--offered-load-window-seconds", str(offered_load_window_s)]
    return cmd
