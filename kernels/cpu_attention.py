"""CPU backend: paged varlen attention that reads K/V blocks in place (`csrc/paged_attention.cpp`).

The PyTorch reference gathers every sequence's whole context out of the paged cache in every layer
of every iteration (`index_select`), then runs SDPA over the copy. This C++/OpenMP kernel walks the
block table instead: one call for decodes and prefill chunks, work items of (sequence, 16-query
tile, KV head) in parallel, GQA without copies (a K/V row loaded once serves its whole group),
online softmax with fp32 accumulation, and no read at or past a sequence's length.

It is compiled on first use against the installed torch (`torch.utils.cpp_extension.load`, so no
isolated build environment and no second torch), with `-O3 -march=native`, into a cache keyed by
the source's hash (`$CHARIOT_KERNEL_CACHE`, default `~/.cache/chariot/kernels`); later processes
load the cached library in milliseconds. `write_kv` is the reference's scatter.
"""

from __future__ import annotations

import hashlib
import logging
import os
import time
from functools import cache
from pathlib import Path
from types import ModuleType

import torch

from chariot.kernels.attention import AttentionMetadata
from chariot.kernels.reference import write_kv

__all__ = ["build_problem", "load_extension", "paged_attention", "write_kv"]

log = logging.getLogger(__name__)
SOURCE = Path(__file__).parent / "csrc" / "paged_attention.cpp"
CACHE_ENV = "CHARIOT_KERNEL_CACHE"


def _cache_dir(digest: str) -> Path:
    root = Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "chariot" / "kernels")
    path = root / f"cpu_attention-{digest}-torch{torch.__version__.replace('+', '_')}"
    path.mkdir(parents=True, exist_ok=True)
    return path


@cache
def load_extension() -> ModuleType:
    """The compiled kernel (built on first use, then cached); raises on a failed build."""
    from torch.utils.cpp_extension import load

    digest = hashlib.sha256(SOURCE.read_bytes()).hexdigest()[:16]
    build_dir = _cache_dir(digest)
    fresh = not any(build_dir.glob("*.so"))
    if fresh:
        log.warning("compiling the CPU attention kernel (first use; about a minute) into %s", build_dir)
    t0 = time.perf_counter()
    flags = ["-O3", "-march=native", "-fopenmp", "-fno-math-errno", "-fno-trapping-math"]
    module = load(name=f"chariot_cpu_attention_{digest}", sources=[str(SOURCE)], build_directory=str(build_dir),
                  extra_cflags=flags, extra_ldflags=["-fopenmp"], verbose=False)
    if fresh:
        log.warning("CPU attention kernel compiled in %.0f s", time.perf_counter() - t0)
    return module


def build_problem() -> str | None:
    """Why the kernel cannot be built or loaded here, or None when it can."""
    try:
        load_extension()
    except Exception as exc:  # a compiler error, a missing compiler or ninja: all mean "not here"
        return f"the C++ kernel did not build ({type(exc).__name__}: {str(exc).strip().splitlines()[-1:]})"
    return None


def paged_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """Attention of every new token over its sequence's cached context (see `attention.py`)."""
    out: torch.Tensor = load_extension().paged_attention(
        query.contiguous(), k_cache, v_cache, meta.query_start_loc, meta.seq_lens, meta.block_tables, scale
    )
    return out
