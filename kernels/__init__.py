"""Attention over the paged KV cache, behind one function pair the executor calls.

`write_kv` scatters new K/V into the cache; `paged_attention` attends every new token over its
sequence's cached context (contract in `attention.py`). Several backends implement that pair: the
PyTorch reference (`reference.py`) runs on any device and is the oracle for the others; the Triton
backend (`triton_attention.py`: GPU, or CPU under `TRITON_INTERPRET=1`) is the fast path on CUDA.

Each backend module exposes its pair as `BACKEND`, an `AttentionBackend` (protocol in
`attention.py`). This module picks one so the executor never changes when a backend is added: the env var
`CHARIOT_ATTENTION_BACKEND` (`reference` | `triton` | `cpu`) overrides the default, which is `triton` when
CUDA and the `triton` package are both present, else the C++ CPU kernel (`cpu_attention.py`, compiled on
first use), else — when no compiler can build it — `reference`, with a warning saying why.
An explicit request for a backend that cannot run raises `AttentionBackendError` naming the env var
instead of silently falling back, so a deployment never runs a slower path than it asked for.

The choice is made lazily on first use (importing this package never fails) and cached;
`select_backend()` re-selects (tests, or after changing the env var).
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import os

import torch

from chariot.kernels import knobs
from chariot.kernels.attention import AttentionBackend, AttentionMetadata, empty_kv_cache

__all__ = [
    "BACKENDS",
    "BACKEND_ENV",
    "AttentionBackend",
    "AttentionBackendError",
    "AttentionMetadata",
    "active_backend",
    "empty_kv_cache",
    "get_backend",
    "paged_attention",
    "select_backend",
    "write_kv",
]

BACKEND_ENV = knobs.ATTENTION_BACKEND
BACKENDS: dict[str, str] = {
    "reference": "chariot.kernels.reference",
    "triton": "chariot.kernels.triton_attention",
    "cpu": "chariot.kernels.cpu_attention",
}

_active: AttentionBackend | None = None
log = logging.getLogger(__name__)


class AttentionBackendError(RuntimeError):
    """The requested attention backend is unknown or cannot run on this machine."""


def _triton_problem() -> str | None:
    """Why the Triton backend cannot run here, or None when it can."""
    interpret = os.environ.get("TRITON_INTERPRET") == "1"
    if not torch.cuda.is_available() and not interpret:
        return "CUDA is not available (set TRITON_INTERPRET=1 to run Triton kernels on CPU)"
    if importlib.util.find_spec("triton") is None:
        return "the `triton` package is not installed (pip install 'chariot[triton]')"
    return None


def _cpu_problem() -> str | None:
    """Why the C++ CPU kernel cannot run here (it compiles on first use), or None."""
    from chariot.kernels.cpu_attention import build_problem

    return build_problem()


def _default_backend() -> str:
    if torch.cuda.is_available():
        return "triton" if _triton_problem() is None else "reference"
    problem = _cpu_problem()
    if problem is None:
        return "cpu"
    log.warning("attention falls back to the PyTorch reference (slower on CPU): %s", problem)
    return "reference"


def _resolve(name: str | None) -> str:
    """Validate an explicit backend name, or pick the default."""
    if name is None or name == "":
        return _default_backend()
    if name not in BACKENDS:
        raise AttentionBackendError(
            f"{BACKEND_ENV}={name!r} is not a known attention backend; choose one of {sorted(BACKENDS)}"
        )
    problem = {"triton": _triton_problem, "cpu": _cpu_problem}.get(name, lambda: None)()
    if problem is not None:
        raise AttentionBackendError(
            f"{BACKEND_ENV}={name!r} requested but that backend is unavailable: {problem}; "
            f"unset {BACKEND_ENV} or set it to 'reference'"
        )
    return name


def select_backend(name: str | None = None) -> str:
    """(Re)select the backend: `name`, else `$CHARIOT_ATTENTION_BACKEND`, else the default.

    Returns the chosen name. Raises `AttentionBackendError` for an unknown or unavailable backend.
    """
    global _active
    if name is None:
        try:
            name = knobs.attention_backend()
        except ValueError as e:
            raise AttentionBackendError(str(e)) from None
    chosen = _resolve(name.strip().lower() if name is not None else None)
    backend: AttentionBackend = importlib.import_module(BACKENDS[chosen]).BACKEND
    _active = backend
    return chosen


def active_backend() -> AttentionBackend:
    """The selected backend (selecting it on first call)."""
    if _active is None:
        select_backend()
    if _active is None:  # select_backend sets it or raises
        raise AttentionBackendError("no attention backend selected")
    return _active


def get_backend() -> str:
    """The name of the attention backend in use (selecting it on first call)."""
    return active_backend().name


def write_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Scatter the new tokens' K/V into their cache slots (selected backend)."""
    active_backend().write_kv(key, value, k_cache, v_cache, slot_mapping)


def paged_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """Attention of every new token over its sequence's cached context (selected backend)."""
    out: torch.Tensor = active_backend().paged_attention(query, k_cache, v_cache, meta, scale)
    return out
