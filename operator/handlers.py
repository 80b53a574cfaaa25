"""kopf wiring: which events start a reconcile pass, and how its outcome maps to kopf's retries.

Handlers stay thin on purpose — the decisions are in `reconcile.py` (pure) and `controller.py`:
- spec created / changed / found at start-up → a pass; an invalid spec is a `PermanentError` (no
  retries until the spec changes; the message naming the field is already in `Ready=False`); a pass
  that is still waiting (pods starting, a rollout, a backoff) is a `TemporaryError` with the delay it
  asked for, so kopf drives the rollout to completion; API failures are `TemporaryError`s too;
- a resync timer, and any event of an owned stage pod or router Deployment → a pass (a pod that
  fails or vanishes triggers the gang restart at once); with `spec.autoscaling`, a faster timer too
  (`Settings.autoscale_s`), so the autoscaler looks at the load every few seconds;
- deletion → explicit cleanup of every owned object (no reliance on garbage collection); the
  finalizer stays until the stage pods are gone.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import kopf

from chariot.operator import crd
from chariot.operator.controller import Controller, Outcome, Settings
from chariot.operator.kube import ApiError
from chariot.operator.render import LABEL_COMPONENT, LABEL_DEPLOYMENT

log = logging.getLogger("chariot.operator")
RESOURCE = (crd.GROUP, crd.VERSION, crd.PLURAL)
API_RETRY_S = 5.0
WAIT_RETRY_S = 10.0
CLEANUP_RETRY_S = 2.0
DELETE_POLL_S = 0.5


def raise_for(outcome: Outcome) -> None:
    """Turn a pass's outcome into kopf's vocabulary (a converged pass returns normally)."""
    if outcome.invalid is not None:
        raise kopf.PermanentError(f"invalid spec: {outcome.invalid}")
    if not outcome.converged:
        raise kopf.TemporaryError(outcome.message, delay=outcome.requeue_after or WAIT_RETRY_S)


def _reconcile(controller: Controller, namespace: str, name: str) -> Outcome:
    try:
        return controller.reconcile(namespace, name)
    except ApiError as exc:
        if exc.transient:
            raise kopf.TemporaryError(f"API server: {exc}", delay=API_RETRY_S) from exc
        raise kopf.PermanentError(f"API server refused: {exc}") from exc


def configure(settings: kopf.OperatorSettings) -> None:
    """Keep kopf's bookkeeping out of `.status` (ours alone) and name the finalizer after us."""
    settings.persistence.finalizer = f"{crd.GROUP}/cleanup"
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=crd.GROUP)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=crd.GROUP, key="last-handled-configuration")
    settings.posting.level = logging.WARNING
    settings.watching.server_timeout = 300
    settings.watching.client_timeout = 330
    settings.networking.request_timeout = 60
    settings.execution.max_workers = 8
    # A deletion that lands while a resync tick is running (a sync timer in a thread cannot be
    # cancelled) re-checks the timer this often before dropping the finalizer; kopf's default of
    # 60 s held every such `kubectl delete` for a minute.
    settings.background.cancellation_polling = DELETE_POLL_S


def register(registry: kopf.OperatorRegistry, controller: Controller, settings: Settings) -> None:
    """Attach the handlers to `registry` (a fresh one per operator, so settings are not module globals)."""

    @kopf.on.startup(id="configure", registry=registry)
    def _startup(settings: kopf.OperatorSettings, **_: Any) -> None:
        configure(settings)

    @kopf.on.resume(*RESOURCE, id="reconcile", registry=registry)
    @kopf.on.create(*RESOURCE, id="reconcile", registry=registry)
    @kopf.on.update(*RESOURCE, id="reconcile", field="spec", registry=registry)
    def reconcile(*, namespace: str | None, name: str, **_: Any) -> None:
        raise_for(_reconcile(controller, namespace or "default", name))

    def look(namespace: str | None, name: str) -> None:
        try:
            outcome = controller.reconcile(namespace or "default", name)
        except ApiError as exc:  # the next tick retries
            log.warning("resync of %s/%s failed: %s", namespace, name, exc)
            return
        if outcome.invalid is None and not outcome.converged:
            log.debug("resync of %s/%s: %s", namespace, name, outcome.message)

    @kopf.timer(*RESOURCE, id="resync", interval=settings.resync_s, registry=registry)
    def resync(*, namespace: str | None, name: str, **_: Any) -> None:
        look(namespace, name)

    @kopf.timer(*RESOURCE, id="autoscale", interval=settings.autoscale_s, registry=registry,
                when=lambda spec, **_: bool(spec.get("autoscaling")))
    def autoscale(*, namespace: str | None, name: str, **_: Any) -> None:
        """A pass (which takes the autoscaler's look) more often than the resync, for deployments with
        spec.autoscaling: a held request or a load spike is acted on within seconds."""
        look(namespace, name)

    owned = {LABEL_DEPLOYMENT: kopf.PRESENT}

    @kopf.on.event("", "v1", "pods", id="stage-pod-changed", labels={**owned, LABEL_COMPONENT: "worker"},
                   registry=registry)
    @kopf.on.event("apps", "v1", "deployments", id="router-changed", labels={**owned, LABEL_COMPONENT: "router"},
                   registry=registry)
    def owned_object_changed(*, namespace: str | None, labels: Mapping[str, str], **_: Any) -> None:
        try:
            controller.reconcile(namespace or "default", labels[LABEL_DEPLOYMENT])
        except ApiError as exc:  # the resync timer catches up
            log.warning("reconcile of %s/%s after an owned-object event failed: %s", namespace,
                        labels[LABEL_DEPLOYMENT], exc)

    @kopf.on.delete(*RESOURCE, id="cleanup", registry=registry)
    def cleanup(*, namespace: str | None, name: str, **_: Any) -> None:
        try:
            remaining = controller.cleanup(namespace or "default", name)
        except ApiError as exc:
            raise kopf.TemporaryError(f"cleanup: {exc}", delay=API_RETRY_S) from exc
        if remaining:
            raise kopf.TemporaryError(f"waiting for {remaining} stage pod(s) to terminate", delay=CLEANUP_RETRY_S)
