"""`chariot operator drain`: delete every ModelDeployment and wait until the operator has released it.

Why: each ModelDeployment carries the operator's finalizer (`chariot.dev/cleanup`), which only a
running operator removes — after it has deleted the deployment's pods, Services, router and config.
`helm uninstall` would delete the operator first and strand those finalizers: the objects, and any
namespace holding one, could then never be deleted. The chart therefore runs this as a pre-delete
hook (charts/chariot/templates/uninstall-hook.yaml), before Helm deletes anything of the release, so
the operator is still there to clean up.

`drain(...)` is the whole procedure against a `Kube` client, with the clock and sleep injectable for
tests; it never removes a finalizer itself (that would strand the stage pods instead).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from chariot.operator import crd
from chariot.operator.kube import ApiError, Kube, Ref

log = logging.getLogger("chariot.operator.drain")
FINALIZER = f"{crd.GROUP}/cleanup"
DEFAULT_TIMEOUT_S = 240.0
DEFAULT_POLL_S = 2.0
PROGRESS_EVERY_S = 10.0

Manifest = dict[str, Any]


@dataclass
class DrainResult:
    """`deleted`: the `namespace/name`s this run asked to delete; `remaining`: those present at the last
    look, each with its finalizers; `error`: the API error of the last pass, if it failed;
    `crd_missing`: the API does not serve ModelDeployments at all (nothing to drain)."""

    deleted: list[str] = field(default_factory=list)
    remaining: dict[str, list[str]] = field(default_factory=dict)
    error: str | None = None
    crd_missing: bool = False

    @property
    def ok(self) -> bool:
        return not self.remaining and self.error is None


def collection_paths(namespaces: Sequence[str] | None) -> list[str]:
    """The ModelDeployment list URLs to read: one cluster-wide, or one per namespace (sorted, deduplicated)."""
    base = f"/apis/{crd.API_VERSION}"
    if not namespaces:
        return [f"{base}/{crd.PLURAL}"]
    return [Ref(crd.KIND, ns).path() for ns in sorted(set(namespaces))]


def key(obj: Manifest) -> str:
    meta = obj.get("metadata") or {}
    return f"{meta.get('namespace') or 'default'}/{meta.get('name')}"


def list_model_deployments(kube: Kube, namespaces: Sequence[str] | None) -> list[Manifest] | None:
    """Every ModelDeployment in `namespaces` (None/empty: all); None when the API does not serve the kind."""
    items: list[Manifest] = []
    missing = 0
    paths = collection_paths(namespaces)
    for path in paths:
        try:
            items += kube.request("GET", path).get("items") or []
        except ApiError as exc:
            if exc.status != 404:
                raise
            missing += 1  # no such resource (CRD absent); a namespace that is gone lists empty on a real server
    if missing == len(paths):
        return None
    return sorted(items, key=key)


def drain(kube: Kube, namespaces: Sequence[str] | None = None, *, timeout_s: float = DEFAULT_TIMEOUT_S,
          poll_s: float = DEFAULT_POLL_S, clock: Callable[[], float] = time.monotonic,
          sleep: Callable[[float], None] = time.sleep) -> DrainResult:
    """Delete every ModelDeployment in `namespaces` (None: all) and wait until all are gone.

    Each pass lists them again and deletes any not yet being deleted (one created meanwhile, too);
    API errors the server may recover from (no answer, 409, 429, 5xx) are retried until the
    deadline. Returns when none is left, or at `timeout_s` with `remaining` naming the stragglers."""
    result = DrainResult()
    deadline = clock() + timeout_s
    next_progress = clock()
    while True:
        try:
            if _pass(kube, namespaces, result):
                return result
            result.error = None
        except ApiError as exc:
            if not exc.transient:
                raise
            result.error = str(exc)
            log.warning("API server: %s (retrying)", exc)
        now = clock()
        if now >= deadline:
            return result
        if now >= next_progress and result.remaining:
            log.info("waiting for the operator to clean up %d ModelDeployment(s): %s", len(result.remaining),
                     describe(result.remaining))
            next_progress = now + PROGRESS_EVERY_S
        sleep(max(0.0, min(poll_s, deadline - now)))


def _pass(kube: Kube, namespaces: Sequence[str] | None, result: DrainResult) -> bool:
    """One look: record what is left, delete what is not being deleted yet; True when nothing is left."""
    items = list_model_deployments(kube, namespaces)
    if items is None:
        result.crd_missing, result.remaining, result.error = True, {}, None
        log.info("the API serves no %s: nothing to drain", crd.PLURAL)
        return True
    result.remaining = {key(i): list((i.get("metadata") or {}).get("finalizers") or []) for i in items}
    if not items:
        result.error = None
        log.info("no ModelDeployments left (%d deleted)", len(result.deleted))
        return True
    for item in items:
        meta = item.get("metadata") or {}
        if meta.get("deletionTimestamp"):
            continue  # already being deleted: the operator's finalizer is at work
        kube.delete(Ref(crd.KIND, meta.get("namespace") or "default", meta["name"]))
        if key(item) not in result.deleted:
            result.deleted.append(key(item))
            log.info("deleted ModelDeployment %s; the operator now cleans up its objects", key(item))
    return False


def describe(remaining: dict[str, list[str]]) -> str:
    return ", ".join(f"{name} (finalizers: {', '.join(fins) or 'none'})" for name, fins in remaining.items())


def timeout_message(result: DrainResult, timeout_s: float) -> str:
    if not result.remaining:
        return f"timed out after {timeout_s:g}s; the API server kept failing: {result.error}"
    return (f"timed out after {timeout_s:g}s; {len(result.remaining)} ModelDeployment(s) still present: "
            f"{describe(result.remaining)}. Is the operator running and healthy? Its log names what blocks "
            f"the cleanup (usually stage pods that do not terminate). Nothing was force-removed: the operator "
            f"is still installed, so fix the cause and run `helm uninstall` again.")


def run_drain(namespaces: Sequence[str] | None = None, *, timeout_s: float = DEFAULT_TIMEOUT_S,
              poll_s: float = DEFAULT_POLL_S, verbose: bool = False) -> int:
    """The `chariot operator drain` command: 0 when no ModelDeployment is left, 1 on timeout."""
    from chariot.operator.kube import load_api_client

    logging.basicConfig(level=logging.DEBUG if verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    scope = ", ".join(sorted(set(namespaces))) if namespaces else "all namespaces"
    log.info("draining ModelDeployments in %s (timeout %gs)", scope, timeout_s)
    try:
        result = drain(Kube(load_api_client()), namespaces, timeout_s=timeout_s, poll_s=poll_s)
    except ApiError as exc:  # e.g. 403: the hook's RBAC does not cover a namespace
        log.error("the API server refused: %s", exc)
        return 1
    if not result.ok:
        log.error("%s", timeout_message(result, timeout_s))
        return 1
    return 0
