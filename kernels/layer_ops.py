"""One function per fused step of a decoder layer, choosing its kernel by the tensors' device.

The model (`worker/model/llama.py`) calls these and never branches on the device itself:

- on CUDA, with the `triton` package present: the Triton kernels of `triton_layer_ops.py`, one
  launch per step (norm with the residual add folded in, RoPE with the KV-cache write, SiLU·mul);
- elsewhere: the CPU path of before, step for step (`cpu_layer_ops.py`: the C++ kernels for float32
  and bfloat16 CPU tensors, PyTorch otherwise; the KV write through the selected attention backend),
  so CPU results are unchanged bit for bit.

`triton_layer_ops` is imported on the first CUDA call only: importing `triton` costs time, and a
CPU-only install may not have it.
"""

from __future__ import annotations

import importlib.util
from functools import cache
from types import ModuleType

import torch

from chariot.kernels import cpu_layer_ops
from chariot.kernels import write_kv as backend_write_kv

__all__ = ["add_rms_norm", "fused_on", "rms_norm", "rope_write_kv", "silu_and_mul"]

_FUSED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@cache
def _triton_installed() -> bool:
    return importlib.util.find_spec("triton") is not None


def fused_on(tensor: torch.Tensor) -> bool:
    """Whether steps over `tensor` take the Triton kernels: a CUDA tensor of a dtype they take, triton installed."""
    return tensor.device.type == "cuda" and tensor.dtype in _FUSED_DTYPES and _triton_installed()


@cache
def _triton() -> ModuleType:
    from chariot.kernels import triton_layer_ops

    return triton_layer_ops


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of x's rows times `weight` (Hugging Face's order of roundings): a fresh tensor."""
    if fused_on(x):
        out: torch.Tensor = _triton().rms_norm(x, weight, eps)
        return out
    return cpu_layer_ops.rms_norm(x, weight, eps)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """`x += residual` in place (x becomes the residual stream), then RMSNorm of it times `weight`:
    returns (norm, x). x must be a tensor the caller owns (a block's fresh output); residual is only read."""
    if fused_on(x):
        normed, summed = _triton().add_rms_norm(x, residual, weight, eps)
        return normed, summed
    return cpu_layer_ops.add_rms_norm(x, residual, weight, eps)


def rope_write_kv(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Rotate q and k in place by each token's angles, then write k and v into the paged caches at
    `slot_mapping` (the `write_kv` contract, `attention.py`)."""
    if fused_on(q) and k_cache.dtype in _FUSED_DTYPES:
        _triton().rope_write_kv(q, k, v, cos, sin, k_cache, v_cache, slot_mapping)
        return
    cpu_layer_ops.rope_(q, k, cos, sin)
    backend_write_kv(k, v, k_cache, v_cache, slot_mapping)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SwiGLU's `silu(gate) · up` for `gate_up` = [..., 2·I] (gate first): a fresh [..., I] tensor."""
    if fused_on(gate_up):
        out: torch.Tensor = _triton().silu_and_mul(gate_up)
        return out
    return cpu_layer_ops.silu_and_mul(gate_up)
