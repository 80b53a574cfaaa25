"""CPU backend: paged varlen attention that reads K/V blocks in place (`csrc/paged_attention.cpp`).

The PyTorch reference gathers every sequence's whole context out of the paged cache in every layer
of every iteration (`index_select`) and then runs SDPA over the copy; on CPU that copy is a quarter
of an offline run. This C++ kernel walks the block table instead: one call for decodes and prefill
chunks, work items of (sequence, query tile, KV head) shared out over torch's threads, GQA without
copies (a K/V row read once serves its whole group of query heads), register-blocked fp32
micro-kernels with an online softmax, and no read at or past a sequence's length.

It is compiled on first use against the installed torch (`torch.utils.cpp_extension.load`, so no
isolated build environment and no second torch) with `-O3 -march=native -fopenmp` into a cache
directory keyed by a hash of the source, the flags, torch's version and this CPU
(`$CHARIOT_KERNEL_CACHE`, default `~/.cache/chariot/kernels`); later processes load the cached
library directly, without a compiler. `write_kv` is the reference's (an `index_put_` by block and
slot: tens of microseconds per layer, against milliseconds of attention; see
`bench/cpu_attention_bench.py`). It is the default attention backend on a
machine without CUDA whenever it builds (`kernels/__init__.py`).
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import sys
import time
from collections.abc import Callable
from functools import cache
from pathlib import Path

import torch

from chariot.kernels.attention import AttentionBackend, AttentionMetadata, FunctionBackend
from chariot.kernels.reference import write_kv

__all__ = ["BACKEND", "CACHE_ENV", "build_problem", "cache_dir", "load_kernel", "paged_attention", "write_kv"]

log = logging.getLogger(__name__)
SOURCE = Path(__file__).parent / "csrc" / "paged_attention.cpp"
CACHE_ENV = "CHARIOT_KERNEL_CACHE"
FLAGS = ("-O3", "-march=native", "-fopenmp", "-ffp-contract=fast", "-fno-math-errno", "-fno-trapping-math")
COMPILE_SECONDS = 25  # measured on a 2-core AVX2 EPYC; shown when compiling

KernelFn = Callable[..., None]


def _cpu_identity() -> str:
    """What `-march=native` depends on: the machine and the CPU's feature flags."""
    try:
        info = Path("/proc/cpuinfo").read_text()
        flags = next((line for line in info.splitlines() if line.startswith(("flags", "Features"))), "")
    except OSError:
        flags = platform.processor()
    return f"{platform.machine()} {flags}"


def _digest(source: Path = SOURCE) -> str:
    h = hashlib.sha256(source.read_bytes())
    for part in (*FLAGS, torch.__version__, _cpu_identity()):
        h.update(part.encode())
    return h.hexdigest()[:16]


def cache_dir(source: Path = SOURCE) -> Path:
    """Where this build lives: `$CHARIOT_KERNEL_CACHE` (default ~/.cache/chariot/kernels)/cpu_attention-<hash>."""
    root = Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "chariot" / "kernels")
    return root / f"cpu_attention-{_digest(source)}"


def _compile(source: Path, name: str, build_dir: Path, namespace: str) -> None:
    from torch.utils.cpp_extension import load

    build_dir.mkdir(parents=True, exist_ok=True)
    _put_venv_on_path()  # torch runs `ninja` from PATH; the `ninja` wheel puts it beside this Python
    log.warning("compiling the CPU attention kernel (first use, ~%d s) into %s ...", COMPILE_SECONDS, build_dir)
    t0 = time.perf_counter()
    load(name=name, sources=[str(source)], build_directory=str(build_dir), is_python_module=False,
         extra_cflags=[*FLAGS, f"-DCHARIOT_OPS_NAMESPACE={namespace}"], extra_ldflags=["-fopenmp"], verbose=False)
    log.warning("CPU attention kernel compiled in %.0f s", time.perf_counter() - t0)


def _put_venv_on_path() -> None:
    bin_dir = str(Path(sys.executable).parent)
    path = os.environ.get("PATH", "")
    if bin_dir not in path.split(os.pathsep):
        os.environ["PATH"] = os.pathsep.join([bin_dir, path]) if path else bin_dir


@cache
def load_kernel(source: Path = SOURCE) -> KernelFn:
    """The compiled op (loaded from the cache, else built first); raises when it cannot be built.

    `source`: another revision of the kernel (the benchmark times one against the current kernel in
    the same process; each build gets its own op namespace)."""
    digest = _digest(source)
    name = f"chariot_cpu_attention_{digest}"
    namespace = f"chariot_cpu_{digest}"  # per build, so an edited source can load beside an old one
    build_dir = cache_dir(source)
    library = build_dir / f"{name}.so"
    try:
        torch.ops.load_library(str(library))  # a finished earlier build: no compiler or ninja needed
    except (OSError, RuntimeError):
        _compile(source, name, build_dir, namespace)  # loads the library too
    kernel: KernelFn = getattr(torch.ops, namespace).paged_attention
    return kernel


@cache
def build_problem() -> str | None:
    """Why the kernel cannot be built or loaded here, or None when it can (decided once per process)."""
    try:
        load_kernel()
    except Exception as exc:  # a compiler error, a missing compiler or ninja: all mean "not here"
        lines = str(exc).strip().splitlines()
        return f"the C++ kernel did not build ({type(exc).__name__}: {lines[-1] if lines else ''})"
    return None


def paged_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    kernel: KernelFn | None = None,
) -> torch.Tensor:
    """Attention of every new token over its sequence's cached context (see `attention.py`).

    Output is contiguous, in the query's dtype; K/V may be fp32, bf16 or fp16 (computed in fp32).
    `kernel`: a `load_kernel(source)` build to run instead of the current one.
    """
    out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    if query.shape[0] == 0:
        return out
    (kernel or load_kernel())(
        _unit_stride(query),
        _unit_stride(k_cache),
        _unit_stride(v_cache),
        _int32(meta.query_start_loc),
        _int32(meta.seq_lens),
        _int32(meta.block_tables),
        float(scale),
        out,
    )
    return out


def _unit_stride(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def _int32(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.int32).contiguous()


BACKEND: AttentionBackend = FunctionBackend("cpu", write_kv, paged_attention)
