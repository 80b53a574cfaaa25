"""Compile-on-first-use for the package's C++ CPU kernels, cached per source, torch and CPU.

Each kernel (`csrc/*.cpp`) is built against the installed torch (`torch.utils.cpp_extension.load`,
so no isolated build environment and no second torch) with `-O3 -march=native -fopenmp` into a
directory keyed by a hash of the source (and the headers beside it), the flags, torch's version and
this CPU's feature flags (`$CHARIOT_KERNEL_CACHE`, default `~/.cache/chariot/kernels`); later
processes load the cached library directly, without a compiler. Every build registers its ops
under its own namespace, so two revisions of one kernel can be loaded side by side (benchmarks time
one against the other).
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from chariot.kernels import knobs

__all__ = ["CACHE_ENV", "FLAGS", "build_dir", "build_problem", "load_ops"]

log = logging.getLogger(__name__)
CACHE_ENV = knobs.KERNEL_CACHE
FLAGS = ("-O3", "-march=native", "-fopenmp", "-ffp-contract=fast", "-fno-math-errno", "-fno-trapping-math")
COMPILE_SECONDS = 25  # measured on a 2-core AVX2 EPYC; shown when compiling


def _cpu_identity() -> str:
    """What `-march=native` depends on: the machine and the CPU's feature flags."""
    try:
        info = Path("/proc/cpuinfo").read_text()
        flags = next((line for line in info.splitlines() if line.startswith(("flags", "Features"))), "")
    except OSError:
        flags = platform.processor()
    return f"{platform.machine()} {flags}"


def digest(source: Path, stem: str) -> str:
    """Hash of what the build depends on: the source and the headers beside it, flags, torch, CPU."""
    h = hashlib.sha256(source.read_bytes())
    for header in sorted(source.parent.glob("*.h")):
        h.update(header.read_bytes())
    for part in (stem, *FLAGS, torch.__version__, _cpu_identity()):
        h.update(part.encode())
    return h.hexdigest()[:16]


def build_dir(source: Path, stem: str) -> Path:
    """Where a build lives: `$CHARIOT_KERNEL_CACHE` (default ~/.cache/chariot/kernels)/<stem>-<hash>."""
    root = knobs.kernel_cache()
    return root / f"{stem}-{digest(source, stem)}"


def _compile(source: Path, name: str, directory: Path, namespace: str, what: str) -> None:
    from torch.utils.cpp_extension import load

    directory.mkdir(parents=True, exist_ok=True)
    _put_venv_on_path()  # torch runs `ninja` from PATH; the `ninja` wheel puts it beside this Python
    log.warning("compiling the %s (first use, ~%d s) into %s ...", what, COMPILE_SECONDS, directory)
    t0 = time.perf_counter()
    load(name=name, sources=[str(source)], build_directory=str(directory), is_python_module=False,
         extra_cflags=[*FLAGS, f"-DCHARIOT_OPS_NAMESPACE={namespace}"], extra_ldflags=["-fopenmp"], verbose=False)
    log.warning("%s compiled in %.0f s", what, time.perf_counter() - t0)


def _put_venv_on_path() -> None:
    bin_dir = str(Path(sys.executable).parent)
    path = os.environ.get("PATH", "")
    if bin_dir not in path.split(os.pathsep):
        os.environ["PATH"] = os.pathsep.join([bin_dir, path]) if path else bin_dir


def load_ops(source: Path, stem: str, what: str) -> Callable[[str], Callable[..., None]]:
    """Load (building first when not cached) the library of `source`; returns op name -> op.

    `stem` names the build (`chariot_<stem>_<hash>`, ops in namespace `chariot_<stem>_<hash>`);
    `what` is how the log calls it. Raises when it cannot be built (no compiler, no ninja)."""
    h = digest(source, stem)
    name = namespace = f"chariot_{stem}_{h}"
    directory = build_dir(source, stem)
    try:
        torch.ops.load_library(str(directory / f"{name}.so"))  # a finished earlier build: no compiler needed
    except (OSError, RuntimeError):
        _compile(source, name, directory, namespace, what)  # loads the library too
    ops = getattr(torch.ops, namespace)
    return lambda op: getattr(ops, op)


def build_problem(load: Callable[[], object], what: str) -> str | None:
    """Why `load()` (a kernel's loader) cannot build or load it here, or None when it can."""
    try:
        load()
    except Exception as exc:  # a compiler error, a missing compiler or ninja: all mean "not here"
        lines = str(exc).strip().splitlines()
        return f"the {what} did not build ({type(exc).__name__}: {lines[-1] if lines else ''})"
    return None
