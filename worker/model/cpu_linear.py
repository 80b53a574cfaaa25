"""Linear layers with weights pre-packed for oneDNN, for inference on the CPU.

PyTorch's default CPU matmul goes through MKL, which on this project's AVX2 EPYC machines reaches
only 27 GFLOP/s for a 32-row decode batch; oneDNN with the weight reordered once at load time into
its blocked layout runs the same product 2× faster (4× at 8 rows, 1.05–1.2× for 512-token prefill
chunks; numbers in docs/BENCHMARKS.md, "CPU linear layers"). vLLM's CPU backend takes the same route.

`load_stage` calls `pack_linears(stage)` once the weights are in: it swaps every `nn.Linear` of a
loaded stage for a `PackedLinear` that holds only the packed weight (the original is released, so
memory does not double). It is a no-op where oneDNN is unavailable or cannot pack the dtype
(bf16 needs AVX-512 or AVX-NE-CONVERT), on other devices, or with `CHARIOT_CPU_PACKED_LINEAR=0`.
"""

from __future__ import annotations

import logging
import os

import torch
from torch import nn

log = logging.getLogger(__name__)
PACKED_LINEAR_ENV = "CHARIOT_CPU_PACKED_LINEAR"
PACKABLE_DTYPES = (torch.float32, torch.bfloat16)


class PackedLinear(nn.Module):
    """`y = x W^T + b` with W in oneDNN's packed layout; inputs of any number of rows."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        weight = linear.weight.detach()
        self.packed_weight = torch.ops.mkldnn._reorder_linear_weight(weight, None)
        self.bias = None if linear.bias is None else linear.bias.detach().clone()
        self.weight_nbytes = weight.numel() * weight.element_size()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)
        out = torch.ops.mkldnn._linear_pointwise(flat, self.packed_weight, self.bias, "none", [], "")
        return out.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, packed=oneDNN"


def packing_problem(device: torch.device, dtype: torch.dtype) -> str | None:
    """Why linear layers will not be packed here, or None when they will."""
    if os.environ.get(PACKED_LINEAR_ENV, "1") == "0":
        return f"{PACKED_LINEAR_ENV}=0"
    if device.type != "cpu":
        return f"device {device.type} is not the CPU"
    if dtype not in PACKABLE_DTYPES:
        return f"dtype {dtype} is not packed"
    if not torch.backends.mkldnn.is_available():
        return "this torch build has no oneDNN"
    try:  # oneDNN's bf16 path needs AVX-512 or AVX-NE-CONVERT; ask it rather than guess
        torch.ops.mkldnn._reorder_linear_weight(torch.zeros(8, 8, dtype=dtype), None)
    except RuntimeError as exc:
        return f"oneDNN cannot pack {dtype} on this CPU ({exc})"
    return None


def pack_linears(module: nn.Module, device: torch.device, dtype: torch.dtype) -> int:
    """Replace every `nn.Linear` under `module` with a `PackedLinear`; returns how many were packed."""
    problem = packing_problem(device, dtype)
    if problem is not None:
        log.info("linear layers not packed: %s", problem)
        return 0
    targets = [(name, child) for name, child in module.named_modules() if isinstance(child, nn.Linear)]
    for name, linear in targets:
        parent_name, _, attr = name.rpartition(".")
        parent = module.get_submodule(parent_name) if parent_name else module
        with torch.inference_mode(False), torch.no_grad():
            setattr(parent, attr, PackedLinear(linear))
    return len(targets)
