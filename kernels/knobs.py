"""The five `CHARIOT_*` environment knobs the kernels read, and their readers (standard library only).

Every knob is declared in the registry, `chariot.contracts.environment` (name, values, default, help,
readers), and every package at or above `chariot.contracts` reads its knobs through it. The kernels
sit below `chariot.contracts` in the package stack (`tests/unit/test_layering.py`), so they cannot
import the registry; they read their own five here instead, with the registry's semantics: an empty
variable counts as unset, an unset one means the declared default, and the backend must be one of its
choices. `tests/unit/test_environment.py` checks that the names and defaults below equal the
registry's declarations, so the two cannot drift, and that nothing else in the kernels reads a knob.

Knobs are read when used, not once at start-up: tests and benchmarks set them per run.
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = [
    "ATTENTION_BACKEND",
    "ATTENTION_BACKENDS",
    "ATTENTION_BACKEND_DEFAULT",
    "CPU_LAYER_OPS",
    "CPU_LAYER_OPS_DEFAULT",
    "KERNEL_BASELINE",
    "KERNEL_BASELINE_DEFAULT",
    "KERNEL_BUILD",
    "KERNEL_BUILDS",
    "KERNEL_BUILD_DEFAULT",
    "KERNEL_CACHE",
    "KERNEL_CACHE_DEFAULT",
    "attention_backend",
    "cpu_layer_ops",
    "kernel_baseline",
    "kernel_build",
    "kernel_cache",
]

ATTENTION_BACKEND = "CHARIOT_ATTENTION_BACKEND"
ATTENTION_BACKEND_DEFAULT: str | None = None  # unset: the kernels pick by what this machine can run
ATTENTION_BACKENDS = ("reference", "triton", "cpu")
KERNEL_CACHE = "CHARIOT_KERNEL_CACHE"
KERNEL_CACHE_DEFAULT = "~/.cache/chariot/kernels"
KERNEL_BASELINE = "CHARIOT_KERNEL_BASELINE"
KERNEL_BASELINE_DEFAULT = "/opt/chariot/kernels-baseline"
KERNEL_BUILD = "CHARIOT_KERNEL_BUILD"
KERNEL_BUILD_DEFAULT = "auto"
KERNEL_BUILDS = ("auto", "native", "baseline")
CPU_LAYER_OPS = "CHARIOT_CPU_LAYER_OPS"
CPU_LAYER_OPS_DEFAULT = "1"


def _read(name: str, default: str | None) -> str | None:
    """The variable's value (an empty one counts as unset), else `default`."""
    return os.environ.get(name) or default


def attention_backend() -> str | None:
    """`$CHARIOT_ATTENTION_BACKEND`, stripped and lower-cased, or None when unset (or blank); anything
    outside ATTENTION_BACKENDS raises ValueError naming the variable and what it takes."""
    value = _read(ATTENTION_BACKEND, ATTENTION_BACKEND_DEFAULT)
    value = value.strip().lower() if value is not None else None
    if not value:
        return None
    if value not in ATTENTION_BACKENDS:
        *first, last = ATTENTION_BACKENDS
        raise ValueError(f"{ATTENTION_BACKEND} must be {', '.join(first)} or {last}, got {value!r}")
    return value


def kernel_cache() -> Path:
    """`$CHARIOT_KERNEL_CACHE` as a path (`~` expanded): where the C++ CPU kernels are built and cached."""
    return Path(_read(KERNEL_CACHE, KERNEL_CACHE_DEFAULT) or KERNEL_CACHE_DEFAULT).expanduser()


def kernel_baseline() -> Path:
    """`$CHARIOT_KERNEL_BASELINE` as a path (`~` expanded): the read-only directory of portable (x86-64-v3)
    builds of the C++ CPU kernels that an image carries."""
    return Path(_read(KERNEL_BASELINE, KERNEL_BASELINE_DEFAULT) or KERNEL_BASELINE_DEFAULT).expanduser()


def kernel_build() -> str:
    """`$CHARIOT_KERNEL_BUILD`: which build of the C++ CPU kernels a process loads (`auto`, `native` or
    `baseline`); anything else raises ValueError naming the variable, as the registry's `read` does."""
    value = _read(KERNEL_BUILD, KERNEL_BUILD_DEFAULT) or KERNEL_BUILD_DEFAULT
    if value not in KERNEL_BUILDS:
        *first, last = KERNEL_BUILDS
        raise ValueError(f"{KERNEL_BUILD} must be {', '.join(first)} or {last}, got {value!r}")
    return value


def cpu_layer_ops() -> bool:
    """Whether the fused C++ layer kernels are on: `$CHARIOT_CPU_LAYER_OPS` is anything but `0`."""
    return _read(CPU_LAYER_OPS, CPU_LAYER_OPS_DEFAULT) != "0"
