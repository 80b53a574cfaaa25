"""`chariot operator`: run the ModelDeployment operator (in a pod, or locally against KUBECONFIG).

`add_operator_parser(subparsers)` registers the subcommand on the `chariot` CLI; `run_operator(...)`
is the handler's body, usable from Python and tests. `python -m chariot.operator` runs the same.
`chariot operator drain` (the Helm chart's pre-delete hook) is in `operator/uninstall.py`.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import threading
from collections.abc import Sequence

import chariot.contracts.environment as env
from chariot.operator.controller import DEFAULT_IMAGE, Controller, Settings
from chariot.operator.reconcile import Backoff

IMAGE_ENV = env.IMAGE.name
REDIS_ENV = env.REDIS_URL.name


def add_operator_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "operator", help="run the Kubernetes operator (ModelDeployment → pods, services, router)",
        description="Reconcile chariot.dev/v1alpha1 ModelDeployments into stage pods, a headless Service, a "
                    "router Deployment + Service and a ConfigMap. Uses the in-cluster service account, else "
                    "KUBECONFIG; watches all namespaces unless --namespace is given.")
    add_operator_flags(p)
    p.set_defaults(handler=_handle)
    add_drain_parser(p.add_subparsers(dest="operator_command", metavar="{drain}"))
    return p


def add_drain_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    from chariot.operator.uninstall import DEFAULT_POLL_S, DEFAULT_TIMEOUT_S

    d = subparsers.add_parser(
        "drain", help="delete every ModelDeployment and wait for the operator's cleanup (helm uninstall hook)",
        description="Delete every ModelDeployment in the given namespaces (default: all) and wait until the "
                    "running operator has cleaned each one up and removed its finalizer. Exit 0 when none is "
                    "left, 1 on timeout. The Helm chart runs this as its pre-delete hook.")
    d.add_argument("--namespace", "-n", action="append", default=None,
                   help="only this namespace (repeatable); default: all namespaces")
    d.add_argument("--timeout-seconds", type=float, default=DEFAULT_TIMEOUT_S,
                   help="give up (exit 1) after this long")
    d.add_argument("--poll-seconds", type=float, default=DEFAULT_POLL_S, help="how often to look again")
    d.add_argument("--verbose", "-v", action="store_true", help="debug logging")
    d.set_defaults(handler=_handle_drain)
    return d


def _handle_drain(args: argparse.Namespace) -> int:
    from chariot.operator.uninstall import run_drain

    return run_drain(args.namespace, timeout_s=args.timeout_seconds, poll_s=args.poll_seconds, verbose=args.verbose)


def add_operator_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--namespace", "-n", action="append", default=None,
                   help="watch only this namespace (repeatable); default: all namespaces")
    p.add_argument("--image", default=env.read(env.IMAGE) or DEFAULT_IMAGE,
                   help=f"image for workers and routers when a spec sets none (env {IMAGE_ENV})")
    p.add_argument("--redis-url", default=env.read(env.REDIS_URL),
                   help=f"Redis for routers of deployments that set no spec.router.redis.url (env {REDIS_ENV})")
    p.add_argument("--resync-seconds", type=float, default=30.0, help="periodic full reconcile interval")
    p.add_argument("--autoscale-seconds", type=float, default=5.0,
                   help="how often deployments with spec.autoscaling look at their offered load")
    p.add_argument("--restart-backoff-seconds", type=float, default=5.0,
                   help="first delay before a failed group is recreated (doubles per restart)")
    p.add_argument("--max-restart-backoff-seconds", type=float, default=300.0, help="cap of that delay")
    p.add_argument("--health-port", type=int, default=8080, help="liveness endpoint /healthz (0 = off)")
    p.add_argument("--metrics-port", type=int, default=0,
                   help="Prometheus /metrics of the autoscaler's decisions (chariot_autoscaler_*; 0 = off)")
    p.add_argument("--verbose", "-v", action="store_true", help="debug logging")


def _handle(args: argparse.Namespace) -> int:
    backoff = Backoff(base_s=args.restart_backoff_seconds, max_s=args.max_restart_backoff_seconds,
                      reset_after_s=args.max_restart_backoff_seconds)
    return run_operator(args.namespace, image=args.image, redis_url=args.redis_url, resync_s=args.resync_seconds,
                        backoff=backoff, health_port=args.health_port, verbose=args.verbose,
                        autoscale_s=args.autoscale_seconds, metrics_port=args.metrics_port)


def run_operator(namespace: str | Sequence[str] | None = None, *, image: str = DEFAULT_IMAGE,
                 redis_url: str | None = None, resync_s: float = 30.0, backoff: Backoff | None = None,
                 health_port: int = 8080, verbose: bool = False, stop_flag: threading.Event | None = None,
                 ready_flag: threading.Event | None = None, autoscale_s: float = 5.0,
                 metrics_port: int = 0) -> int:
    """Run until SIGINT/SIGTERM (or `stop_flag`); returns the exit status.

    `namespace`: one name or several; None watches the whole cluster (needs the ClusterRole)."""
    import kopf

    from chariot.operator.handlers import register
    from chariot.operator.kube import Kube, load_api_client

    logging.basicConfig(level=logging.DEBUG if verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    namespaces = [namespace] if isinstance(namespace, str) else list(namespace or [])
    settings = Settings(default_image=image, default_redis_url=redis_url, backoff=backoff or Backoff(),
                        resync_s=resync_s, autoscale_s=autoscale_s)
    registry = kopf.OperatorRegistry()
    kopf.on.login(registry=registry)(kopf.login_via_client)  # same credentials as our own client
    telemetry = None
    if metrics_port:
        from chariot.contracts.telemetry import setup_telemetry

        telemetry = setup_telemetry("chariot-operator", "operator")
        telemetry.start_metrics_server("0.0.0.0", metrics_port)
    register(registry, Controller(Kube(load_api_client()), settings, telemetry=telemetry), settings)
    liveness = f"http://0.0.0.0:{health_port}/healthz" if health_port else None
    asyncio.run(kopf.operator(registry=registry, standalone=True, clusterwide=not namespaces,
                              namespaces=namespaces, liveness_endpoint=liveness, stop_flag=stop_flag,
                              ready_flag=ready_flag))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="chariot operator", description="Run the Chariot Kubernetes operator.")
    add_operator_flags(parser)
    return _handle(parser.parse_args(argv))
