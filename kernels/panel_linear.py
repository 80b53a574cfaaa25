"""`y = x Wᵀ + b` in float32 on the CPU (`csrc/panel_linear.cpp`), on a weight packed once into
panels of 16 outputs, for any number of rows.

Decode steps of 8-32 sequences are where the linear layers are furthest from the machine on an
AVX2 CPU: the skinny kernel (`skinny_linear.py`, which reduces along K inside the vector
registers) runs them at about half the FMA rate and oneDNN slower still (docs/kernels.md). This
kernel puts 16 outputs in the lanes of two vectors and broadcasts up to six rows of x against them,
so there is no reduction across lanes. Up to 64 rows (`kStreamRows` in the C++) W
streams once per thread, its next panels requested into L2 while the passes compute; from 1 to 8
rows that is as fast as the skinny kernel, so for float32 it replaces it: the panels take the place
of the plain copy. More rows (prefill chunks) take the classic blocked order, 256 steps of a panel held in L1
against blocks of 96 rows held in L2, which can beat oneDNN on whole prefill steps (docs/kernels.md);
where a stage measures that at load, its layers drop oneDNN's copy (`worker/model/cpu_linear.py`).

Built on first use and cached like the other CPU kernels (`cpu_build.py`). `worker/model/cpu_linear.py`
decides when a layer calls it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import torch

from chariot.kernels import cpu_build
from chariot.kernels.cpu_build import load_ops

__all__ = ["PANEL", "PanelWeight", "build_problem", "pack", "panel_linear", "supports"]

SOURCE = Path(__file__).parent / "csrc" / "panel_linear.cpp"
STEM = "cpu_panel_linear"
PANEL = 16  # outputs per panel

KernelFn = Callable[..., None]


@cache
def load_kernels(source: Path = SOURCE) -> tuple[KernelFn, KernelFn]:
    """(pack_panels, panel_linear), loaded from the cache or built first; raises when they cannot be built."""
    ops = load_ops(source, STEM, "CPU panel linear kernel")
    return ops("pack_panels"), ops("panel_linear")


@cache
def build_problem() -> str | None:
    """Why the kernel cannot be built or loaded here, or None when it can (decided once per process)."""
    return cpu_build.build_problem(load_kernels, "C++ panel linear kernel")


def supports(weight: torch.Tensor) -> bool:
    """Whether the kernel can multiply by this weight: a float32 [N, K] matrix on the CPU (any N, K),
    where the kernel builds."""
    return weight.device.type == "cpu" and weight.dim() == 2 and weight.dtype == torch.float32 \
        and build_problem() is None


@dataclass(frozen=True)
class PanelWeight:
    """A weight packed for `panel_linear`.

    Invariants: `panels` is [ceil(N/16), K, 16] float32, output n of step k at `panels[n // 16, k,
    n % 16]`, zero past N; `bias` is None or float32 [ceil(N/16) * 16], zero past N."""

    panels: torch.Tensor
    bias: torch.Tensor | None
    out_features: int

    @property
    def in_features(self) -> int:
        return int(self.panels.shape[1])


def pack(weight: torch.Tensor, bias: torch.Tensor | None = None) -> PanelWeight:
    """Pack a float32 `nn.Linear` weight [N, K] (and its bias [N]) into panels."""
    if not supports(weight):
        raise ValueError(f"the panel kernel needs a float32 [N, K] weight on the CPU, got {weight.dtype} "
                         f"{tuple(weight.shape)} on {weight.device}")
    n, k = weight.shape
    panels = torch.zeros(-(-n // PANEL), k, PANEL, dtype=torch.float32)
    load_kernels()[0](weight.detach().contiguous(), panels)
    padded = None
    if bias is not None:
        padded = torch.zeros(panels.shape[0] * PANEL, dtype=torch.float32)
        padded[:n] = bias.detach()
    return PanelWeight(panels, padded, int(n))


def panel_linear(x: torch.Tensor, weight: PanelWeight) -> torch.Tensor:
    """`x Wᵀ + b` for x [M, K] float32 (any M) with W packed by `pack`."""
    if x.dim() != 2 or x.shape[1] != weight.in_features or x.dtype != torch.float32:
        raise ValueError(f"x must be float32 [M, {weight.in_features}], got {x.dtype} {tuple(x.shape)}")
    out = torch.empty(x.shape[0], weight.out_features, dtype=torch.float32)
    if x.shape[0]:
        load_kernels()[1](x.contiguous(), weight.panels, weight.bias, out)
    return out
