"""`y = x Wᵀ + b` for a few rows on the CPU (`csrc/skinny_linear.cpp`), on the weight's plain layout.

A decode iteration multiplies one row per running sequence by every weight matrix, so it streams
the whole model from memory for a handful of rows. oneDNN reaches the memory bandwidth for one row,
but for 2–32 rows it runs at a fraction of it; this kernel streams each weight row once and computes
it against every input row while it is in cache (numbers in docs/kernels.md, "CPU linear
kernel"). It reads `nn.Linear`'s own [out, in] weight, so nothing is packed or copied. bf16 weights
take the same route on CPUs with AVX512-BF16 (`bf16_rows`), on bf16 dot products with fp32 sums.

On a CPU with AMX tiles, bf16 layers take the tile path instead (`amx_pack`, `amx_linear`;
`csrc/linear_amx.h`): the weight is packed once into the tiles' order (the same size as the plain
weight, which it replaces) and up to 32 rows are multiplied on the tile unit, which keeps pace with
memory where dot products fall behind above 4 rows.

For float32 layers the serving path now takes the panel kernel instead (`panel_linear.py`, faster
from 4 rows on an AVX2 EPYC); this kernel serves bf16 rows and float32 where the panel kernel is
turned off. Built on first use and cached like the attention kernel (`cpu_build.py`).
`worker/model/cpu_linear.py` decides when a layer calls it.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import cache
from pathlib import Path

import torch

from chariot.kernels import cpu_build
from chariot.kernels.cpu_build import load_ops

__all__ = ["AMX_MAX_ROWS", "MAX_ROWS", "amx_linear", "amx_pack", "amx_rows", "bf16_rows", "build_problem",
           "load_kernel", "skinny_linear", "supports"]

SOURCE = Path(__file__).parent / "csrc" / "skinny_linear.cpp"
STEM = "cpu_linear"
LANES = 8
BF16_STEP = 32  # bf16 values of K per step of the AVX512-BF16 path (one cache line of a weight row)
MAX_ROWS = 32
"""The most rows it is ever used for. In fp32 oneDNN's packed GEMM was as fast from 16 rows in whole
decode iterations on an AVX2 machine (`bench/decode_linear_bench.py`, docs/kernels.md); in bf16 on
AVX512-BF16 the kernel won up to 24 rows and tied at 32 (`bench/experiments/skinny_kernel_ab.py`). Where
it crosses on a given machine and dtype is measured at load time (`worker/model/cpu_linear.py`)."""

AMX_MAX_ROWS = 32
"""The most rows the tile path takes (two row tiles of 16); where it crosses oneDNN is measured at load."""

KernelFn = Callable[..., None]


@cache
def load_kernel(source: Path = SOURCE) -> KernelFn:
    """The compiled op (loaded from the cache, else built first); raises when it cannot be built."""
    return load_ops(source, STEM, "CPU linear kernel")("skinny_linear")


@cache
def build_problem() -> str | None:
    """Why the kernel cannot be built or loaded here, or None when it can (decided once per process)."""
    return cpu_build.build_problem(load_kernel, "C++ linear kernel")


@cache
def bf16_rows(source: Path = SOURCE) -> bool:
    """Whether this build multiplies bf16 rows: on AVX512-BF16 dot products, which it has when the CPU
    it was built for does (elsewhere a bf16 model keeps oneDNN for every row count)."""
    return bool(load_ops(source, STEM, "CPU linear kernel")("bf16_rows")())


def supports(weight: torch.Tensor) -> bool:
    """Whether the kernel can multiply by this weight on the CPU: fp32 with an input size that is a
    multiple of 8, or bf16 with one that is a multiple of 32 where the build has `bf16_rows`."""
    if weight.device.type != "cpu" or weight.dim() != 2:
        return False
    if weight.dtype == torch.float32:
        return weight.shape[1] % LANES == 0
    return weight.dtype == torch.bfloat16 and weight.shape[1] % BF16_STEP == 0 and build_problem() is None \
        and bf16_rows()


def skinny_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                  kernel: KernelFn | None = None) -> torch.Tensor:
    """`x Wᵀ + b` for x [M, K] (any M; meant for M <= MAX_ROWS), W [N, K] contiguous, x and W of one
    dtype (float32, or bfloat16 where `bf16_rows()`)."""
    out = torch.empty(x.shape[0], weight.shape[0], dtype=weight.dtype)
    if x.shape[0]:
        (kernel or load_kernel())(x.contiguous(), weight, bias, out)
    return out


@cache
def _ops() -> Callable[[str], Callable[..., object]]:
    return load_ops(SOURCE, STEM, "CPU linear kernel")


def amx_rows(weight: torch.Tensor) -> bool:
    """Whether bf16 rows of this weight can go to the tile path here: a bf16 CPU weight [N, K] with N
    and K multiples of 32, on a CPU with AMX tiles (granted by Linux) and a build for it."""
    if weight.device.type != "cpu" or weight.dim() != 2 or weight.dtype != torch.bfloat16:
        return False
    if build_problem() is not None:
        return False
    return bool(_ops()("amx_rows")(weight.shape[0], weight.shape[1]))


def amx_pack(weight: torch.Tensor) -> torch.Tensor:
    """The weight [N, K] packed for `amx_linear` (N·K bf16 values in the tiles' order)."""
    return _ops()("amx_pack")(weight.contiguous())  # type: ignore[return-value]


def amx_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, out_features: int) -> torch.Tensor:
    """`x Wᵀ + b` for x [M, K] bf16, M <= AMX_MAX_ROWS, with W as `amx_pack` returned it."""
    out = torch.empty(x.shape[0], out_features, dtype=torch.bfloat16)
    _ops()("amx_linear")(x.contiguous(), packed, bias, out)
    return out
