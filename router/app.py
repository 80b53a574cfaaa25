"""The router process: both fronts, the replica watcher, the Stats poller and shared-state upkeep on one
event loop, and the `chariot router` subcommand (flags as in docs/cli-contract.md).

Why one event loop: the admission controller, the registry and the data plane are plain objects
without locks; running the gRPC server (grpc.aio), the HTTP server (uvicorn) and every background
task on the same loop makes each admission decision atomic with respect to the others for free.

Every setting, the process's own included, is a field of `RouterConfig` (`router/config.py`);
`run_router` takes that config and only the runtime hooks (a ready callback, a stop event).

Lifetime: `run_router` binds both ports first (a taken port is a `ConfigError`, exit code 2), starts
everything, prints `chariot router ready http=HOST:PORT grpc=HOST:PORT`, and serves until SIGTERM /
SIGINT (when on the main thread) or until `stop` is set; then health goes NOT_SERVING, both servers
give in-flight calls `grace_s` seconds, and every background task and connection is closed. It
returns 0 (a clean shutdown).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import socket
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import uvicorn

from chariot.contracts.errors import ConfigError
from chariot.contracts.grpc_server import SERVICE_NAME, host_port, stop_on_signals, stop_server
from chariot.contracts.telemetry import setup_telemetry
from chariot.contracts.tokenizer import Tokenizer
from chariot.router.admission import AdmissionController
from chariot.router.auth import KeyStore, RequestLimiter
from chariot.router.config import (
    DEFAULT_GRPC_PORT,
    DEFAULT_HOST,
    DEFAULT_HTTP_PORT,
    DEFAULT_SERVED_MODEL,
    ROUTING_MODES,
    RouterConfig,
    TenantLimit,
)
from chariot.router.dataplane import DataPlane
from chariot.router.grpc_front import NOT_SERVING, HealthReporter, bind_grpc, build_grpc_server
from chariot.router.http_front import build_http_app
from chariot.router.launch import add_security_flags
from chariot.router.offered_load import OfferedLoadPublisher
from chariot.router.registry import ReplicaRegistry
from chariot.router.state import make_state, upkeep_interval_s
from chariot.router.tls import CertificateFiles

log = logging.getLogger(__name__)

EXIT_OK = 0
DEFAULT_TENANT_WILDCARD = "*"
SERVICE = "chariot-router"

ReadyCallback = Callable[[int, int], None]


async def run_router(config: RouterConfig, ready: ReadyCallback | None = None,
                     stop: asyncio.Event | None = None) -> int:
    """Serve `config` until SIGTERM/SIGINT or `stop`; returns 0. `ready(http_port, grpc_port)` once listening.

    Port 0 picks a free port (for either front). Raises `ConfigError` for a bad replica list or file,
    a port that cannot be bound, and `ModelLoadError` for an unreadable `model_dir` tokenizer.
    """
    stop = stop or asyncio.Event()
    host, grace_s = config.host, config.grace_s
    tokenizer = Tokenizer(config.model_dir) if config.model_dir else None
    registry = ReplicaRegistry.from_config(config, config.replicas)
    keys, certs = _secrets(config)
    async with contextlib.AsyncExitStack() as stack:
        telemetry = setup_telemetry(SERVICE, "router", config.otlp_endpoint, model=config.served_model)
        stack.callback(telemetry.shutdown)
        state = make_state(config)
        stack.push_async_callback(state.aclose)
        state.start(upkeep_interval_s(config))
        admission = AdmissionController(config, registry, state)
        dataplane = DataPlane(config, registry, admission, telemetry, tokenizer, keys=keys,
                              request_limiter=RequestLimiter(state, config.max_retry_after_s))
        stack.push_async_callback(dataplane.aclose)
        dataplane.start()
        if config.redis_url is not None:
            publisher = OfferedLoadPublisher.from_url(config.redis_url, config.redis_key_prefix, dataplane.offered_load,
                                                      config.offered_load_publish_s)
            stack.push_async_callback(publisher.aclose)
            publisher.start()
        if config.replica_file:
            _cancel_on_exit(stack, registry.start_watching(config.replica_poll_s))
        if keys is not None:
            _cancel_on_exit(stack, keys.start_watching(config.secret_poll_s))
        bound_grpc = await stack.enter_async_context(_grpc_front(dataplane, host, config.grpc_port, grace_s, certs))
        bound_http = await stack.enter_async_context(
            _http_front(dataplane, host, config.http_port, grace_s, certs, config.secret_poll_s))
        print(f"chariot router ready http={host_port(host, bound_http)} grpc={host_port(host, bound_grpc)}", flush=True)
        log.info("router serving %s over %d replica(s)", config.served_model, len(registry.names()))
        if ready is not None:
            ready(bound_http, bound_grpc)
        with stop_on_signals(stop):
            await stop.wait()
        log.info("router shutting down")
    return EXIT_OK


def _secrets(config: RouterConfig) -> tuple[KeyStore | None, CertificateFiles | None]:
    """The API keys and the TLS certificate, loaded (a `ConfigError` at start for a bad file)."""
    keys = KeyStore(config.api_keys_file) if config.api_keys_file else None
    if keys is None:
        log.warning("no API keys configured (--api-keys): every caller is trusted and names its own tenant")
    certs = None
    if config.tls_cert_file and config.tls_key_file:
        certs = CertificateFiles(config.tls_cert_file, config.tls_key_file)
        certs.read()
    return keys, certs


@contextlib.asynccontextmanager
async def _grpc_front(dataplane: DataPlane, host: str, port: int, grace_s: float,
                      certs: CertificateFiles | None = None) -> AsyncIterator[int]:
    server, health_servicer = build_grpc_server(dataplane)
    bound = bind_grpc(server, host, port, certs.grpc_credentials() if certs is not None else None)
    await server.start()
    reporter = HealthReporter(health_servicer, dataplane)
    await reporter.update()
    task = asyncio.get_running_loop().create_task(reporter.run(), name="router-grpc-health")
    try:
        yield bound
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        for service in ("", SERVICE_NAME):
            await health_servicer.set(service, NOT_SERVING)
        await health_servicer.enter_graceful_shutdown()
        await stop_server(server, grace_s)


class _UvicornServer(uvicorn.Server):
    """uvicorn without its own signal handling: `run_router` owns SIGTERM/SIGINT (and `stop`)."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


@contextlib.asynccontextmanager
async def _http_front(dataplane: DataPlane, host: str, port: int, grace_s: float,
                      certs: CertificateFiles | None = None, poll_s: float = 2.0) -> AsyncIterator[int]:
    sock = bind_http(host, port)
    config = uvicorn.Config(
        build_http_app(dataplane),
        log_config=None,
        log_level="warning",
        access_log=False,
        lifespan="off",
        ws="none",
        timeout_graceful_shutdown=max(1, round(grace_s)),
    )
    watch: asyncio.Task[None] | None = None
    if certs is not None:
        config.load()
        config.ssl = certs.server_context()  # one context, reloaded in place (`chariot.router.tls`)
        watch = asyncio.get_running_loop().create_task(certs.watch_context(config.ssl, poll_s), name="router-tls")
    server = _UvicornServer(config)
    task = asyncio.get_running_loop().create_task(server.serve(sockets=[sock]), name="router-http")
    try:
        while not server.started:
            if task.done():
                task.result()  # re-raise why it stopped
                raise ConfigError("http_port", f"the HTTP server on {host_port(host, port)} did not start")
            await asyncio.sleep(0.01)
        yield int(sock.getsockname()[1])
    finally:
        server.should_exit = True
        if watch is not None:
            watch.cancel()
        with contextlib.suppress(Exception, SystemExit):
            await task
        sock.close()


def bind_http(host: str, port: int) -> socket.socket:
    """A listening TCP socket for the HTTP front (port 0: a free one); `ConfigError` if it cannot bind."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
        sock = socket.socket(family, kind, proto)
    except OSError as exc:
        raise ConfigError("host", f"cannot resolve {host!r}: {exc}") from exc
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(2048)
    except OSError as exc:
        sock.close()
        raise ConfigError("http_port", f"cannot listen on {host_port(host, port)}: {exc}") from exc
    return sock


def _cancel_on_exit(stack: contextlib.AsyncExitStack, task: asyncio.Task[Any]) -> None:
    async def cancel() -> None:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    stack.push_async_callback(cancel)


# ---- the `chariot router` subcommand ------------------------------------------------------------


def parse_rate_limits(values: Sequence[str]) -> tuple[TenantLimit | None, dict[str, TenantLimit]]:
    """`--rate-limit TENANT=RATE:BURST` flags → (default limit from tenant `*`, per-tenant limits)."""
    default: TenantLimit | None = None
    tenants: dict[str, TenantLimit] = {}
    for i, value in enumerate(values):
        tenant, sep, spec = value.partition("=")
        rate, sep2, burst = spec.partition(":")
        try:
            limit = TenantLimit(float(rate), float(burst))
        except ValueError:
            limit = None
        if not (sep and sep2 and tenant.strip()) or limit is None:
            raise ConfigError(f"rate_limit[{i}]", f"must be TENANT=RATE:BURST, got {value!r}")
        limit.validate(f"rate_limit[{i}]")
        if tenant.strip() == DEFAULT_TENANT_WILDCARD:
            default = limit
        else:
            tenants[tenant.strip()] = limit
    return default, tenants


def config_from_args(args: argparse.Namespace) -> RouterConfig:
    """The `RouterConfig` of parsed `chariot router` flags (unset flags keep the config defaults)."""
    default_limit, tenant_limits = parse_rate_limits(args.rate_limit)
    served = args.served_model_name or default_served_model(args.model)
    overrides: dict[str, Any] = {
        "ttft_slo_ms": args.ttft_slo_ms,
        "tbt_slo_ms": args.tbt_slo_ms,
        "max_queue_per_replica": args.max_queue_per_replica,
        "routing": args.routing,
        "redis_key_prefix": args.redis_key_prefix,
        "offered_load_window_s": args.offered_load_window_seconds,
        "hold_queue": args.hold_queue,
        "hold_timeout_s": args.hold_timeout_seconds,
    }
    return RouterConfig(
        host=args.host,
        http_port=args.http_port,
        grpc_port=args.grpc_port,
        replicas=tuple(args.replica),
        served_model=served,
        model_dir=args.model,
        otlp_endpoint=args.otlp_endpoint,
        redis_url=args.redis_url,
        replica_file=args.replica_file,
        api_keys_file=args.api_keys,
        tls_cert_file=args.tls_cert,
        tls_key_file=args.tls_key,
        default_rate_limit=default_limit,
        tenant_rate_limits=tenant_limits,
        **{k: v for k, v in overrides.items() if v is not None},
    )


def default_served_model(model_dir: str | None) -> str:
    """The served model name when `--served-model-name` is not given: the model directory's name."""
    return Path(model_dir).name if model_dir else DEFAULT_SERVED_MODEL


def add_router_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register `chariot router` (docs/cli-contract.md) on an `add_subparsers()` object; returns it."""
    p = subparsers.add_parser(
        "router",
        help="run a router: OpenAI HTTP + gRPC front, SLO admission control, load balancing",
        description="Serve the OpenAI-compatible HTTP API and the chariot.v1.Generation gRPC API, admitting "
        "each request to the replica with the lowest predicted time to first token (or shedding it with "
        "429 / RESOURCE_EXHAUSTED when the TTFT SLO cannot be met, queues are full, or the tenant's rate "
        "limit is exhausted). Prints 'chariot router ready http=HOST:PORT grpc=HOST:PORT' once serving.",
    )
    p.add_argument("--host", default=DEFAULT_HOST, help=f"address both fronts listen on (default {DEFAULT_HOST})")
    p.add_argument("--http-port", type=int, default=DEFAULT_HTTP_PORT, help="OpenAI HTTP port (0: any free one)")
    p.add_argument("--grpc-port", type=int, default=DEFAULT_GRPC_PORT, help="gRPC port (0: any free one)")
    p.add_argument(
        "--replica",
        action="append",
        default=[],
        metavar="NAME=HOST:PORT",
        help="a replica's stage-0 worker (repeatable); HOST:PORT alone names it by its address",
    )
    p.add_argument("--replica-file", default=None, metavar="FILE",
                   help='JSON {"replicas": [{"name": ..., "address": "host:port"}]}, watched for changes '
                        "(wins over --replica)")  # fmt: skip
    p.add_argument("--redis-url", default=None, help="share router state through Redis (several routers)")
    p.add_argument("--redis-key-prefix", default=None,
                   help="prefix of this deployment's Redis keys (default 'chariot'); routers of one deployment "
                        "share it, deployments sharing a Redis need their own")  # fmt: skip
    p.add_argument("--offered-load-window-seconds", type=float, default=None,
                   help="window of the offered load the autoscaler reads (GET /load, Redis; default 30)")
    p.add_argument("--hold-queue", type=int, default=None,
                   help="requests held while no replica is ready, e.g. scaled to zero (default 0: 503 at once)")
    p.add_argument("--hold-timeout-seconds", type=float, default=None,
                   help="how long a held request waits for a ready replica before its 503 (default 120)")
    p.add_argument("--ttft-slo-ms", type=float, default=None, help="time-to-first-token SLO (default 2000)")
    p.add_argument("--tbt-slo-ms", type=float, default=None, help="time-between-tokens SLO (default 200)")
    p.add_argument(
        "--max-queue-per-replica",
        type=int,
        default=None,
        help="admitted, unfinished requests one replica may hold (default 256)",
    )
    p.add_argument("--routing", choices=ROUTING_MODES, default=None,
                   help="replica choice among those meeting the SLO: prefix (cached prefix + load, session "
                        "affinity; the default), load (as if nothing were cached), round_robin (in turn)")
    p.add_argument("--rate-limit", action="append", default=[], metavar="TENANT=RATE:BURST",
                   help="token bucket per tenant, in tokens (prompt + max_tokens) per second and burst "
                        "(repeatable; tenant '*' is the default for every other tenant)")  # fmt: skip
    p.add_argument(
        "--served-model-name", default=None, help="model name clients send (default: the --model directory's name)"
    )
    p.add_argument(
        "--model",
        default=None,
        metavar="DIR",
        help="model directory for the tokenizer (exact prompt lengths, chat template)",
    )
    p.add_argument("--otlp-endpoint", default=None, help="OTLP gRPC endpoint for metrics and traces")
    add_security_flags(p)
    p.set_defaults(handler=run_router_command)
    return p


def run_router_command(args: argparse.Namespace) -> int:
    """The `chariot router` handler: flags → `run_router`; a `ConfigError` propagates (exit code 2)."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return asyncio.run(run_router(config_from_args(args)))
