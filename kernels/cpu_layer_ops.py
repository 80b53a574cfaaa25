"""One-pass CPU kernels for a decoder layer's element-wise work (`csrc/layer_ops.cpp`).

Eager PyTorch spends several passes over memory on each of SiLU·mul and RMSNorm·weight, and
`index_put_` by (block, slot) writes new K/V into the paged cache single-threaded through generic
indexing; on a CPU prefill that element-wise work costs more than a compiled graph spends on it
(docs/kernels.md has the profile). These kernels do each in one pass, rows spread over torch's threads.

Each function here takes the fast path only where it applies (float32 or bfloat16 CPU tensors, and
the kernel built; bfloat16 is computed in float32 and rounded where eager PyTorch rounds) and
otherwise runs the PyTorch code it replaces, so callers never branch on the device.
`CHARIOT_CPU_LAYER_OPS=0` turns the kernels off (for A/B runs). Built on first use and cached like
the attention kernel (`cpu_build.py`).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import cache
from pathlib import Path

import torch
import torch.nn.functional as F

from chariot.kernels import cpu_build, knobs, reference
from chariot.kernels.cpu_build import load_ops

__all__ = ["ENV", "build_problem", "enabled", "load_kernel", "rms_norm", "rope_", "silu_and_mul", "write_kv"]

SOURCE = Path(__file__).parent / "csrc" / "layer_ops.cpp"
STEM = "cpu_layer_ops"
ENV = knobs.CPU_LAYER_OPS

KernelFn = Callable[..., None]


@cache
def load_kernel(source: Path = SOURCE) -> Callable[[str], KernelFn]:
    """op name -> compiled op (loaded from the cache, else built first); raises when it cannot be built."""
    return load_ops(source, STEM, "CPU layer kernels")


@cache
def build_problem() -> str | None:
    """Why the kernels cannot be built or loaded here, or None when they can (decided once per process)."""
    return cpu_build.build_problem(load_kernel, "C++ layer kernels")


def enabled() -> bool:
    """Whether the kernels run: not turned off by `CHARIOT_CPU_LAYER_OPS=0`, and built."""
    return knobs.cpu_layer_ops() and build_problem() is None


FAST_DTYPES = (torch.float32, torch.bfloat16)


def _fast(*tensors: torch.Tensor) -> bool:
    """All on the CPU in one dtype the kernels take (float32, bfloat16), and the kernels on."""
    dtype = tensors[0].dtype
    return dtype in FAST_DTYPES and all(t.device.type == "cpu" and t.dtype == dtype for t in tensors) and enabled()


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SwiGLU's `silu(gate) · up` for `gate_up` = [..., 2·I] (gate first): a fresh [..., I] tensor."""
    width = gate_up.shape[-1] // 2
    flat = _rows(gate_up)
    if not (_fast(gate_up) and flat.stride(-1) == 1):
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate).mul_(up)
    out = torch.empty(flat.shape[0], width, dtype=gate_up.dtype)
    load_kernel()("silu_and_mul")(flat, out)
    return out if gate_up.dim() == 2 else out.view(*gate_up.shape[:-1], width)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`x / sqrt(mean(x²) + eps) · weight` over the last dimension, computed in float32 (Hugging Face's
    order: normalise, round to x's dtype, then scale); a fresh tensor shaped like x."""
    flat = _rows(x)
    if not (_fast(x, weight) and flat.stride(-1) == 1 and weight.is_contiguous()):
        return F.rms_norm(x.float(), (x.shape[-1],), eps=eps).to(x.dtype).mul_(weight)
    out = torch.empty(flat.shape, dtype=x.dtype)
    load_kernel()("rms_norm")(flat, weight, float(eps), out)
    return out if x.dim() == 2 else out.view(x.shape)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """`x += residual` in place (rounded to x's dtype, as `add_` rounds), then `rms_norm` of the sum:
    returns (norm, x). One pass over the rows where the two ops make two, bit for bit the same."""
    if not (x.dim() == 2 and residual.shape == x.shape and _fast(x, residual, weight) and x.stride(-1) == 1
            and residual.stride(-1) == 1 and weight.is_contiguous()):  # the model's rows are 2-D
        summed = x.add_(residual)
        return rms_norm(summed, weight, eps), summed
    out = torch.empty(x.shape, dtype=x.dtype)
    load_kernel()("add_rms_norm")(x, residual, weight, float(eps), out)
    return out, x


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x [..., width] as [rows, width]; a 2-D x as it is (each reshape is one more dispatched op)."""
    return x if x.dim() == 2 else x.reshape(-1, x.shape[-1])


def rope_(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """Rotate q [T, heads, head_dim] and k [T, kv_heads, head_dim] in place by each token's angles
    (cos, sin [T, head_dim] or [T, 1, head_dim], q's dtype), bit for bit as `reference.rope` (Hugging
    Face's order of roundings). q and k may be strided views (of one fused projection): only head_dim
    must be contiguous."""
    cos2, sin2 = _rows(cos), _rows(sin)
    if _fast(q, k, cos2, sin2) and q.stride(-1) == 1 and k.stride(-1) == 1 and cos2.stride(-1) == 1 \
            and sin2.stride(-1) == 1:
        load_kernel()("rope")(q, k, cos2, sin2)
        return
    cos3, sin3 = cos2.unsqueeze(1), sin2.unsqueeze(1)  # one angle per token, broadcast over heads
    q.copy_(reference.rope(q, cos3, sin3))
    k.copy_(reference.rope(k, cos3, sin3))


def write_kv(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Scatter new K/V ([tokens, kv_heads, head_dim]) into their slots of the paged caches (the
    `AttentionBackend.write_kv` contract). A slot outside the cache raises and writes nothing."""
    same = key.dtype == k_cache.dtype and value.dtype == v_cache.dtype
    cpu = all(t.device.type == "cpu" for t in (key, value, k_cache, v_cache, slot_mapping))
    if not (same and cpu and key.stride(-1) == 1 and value.stride(-1) == 1 and enabled()):
        reference.write_kv(key, value, k_cache, v_cache, slot_mapping)
        return
    slots = slot_mapping if slot_mapping.dtype in (torch.int32, torch.int64) else slot_mapping.long()
    load_kernel()("write_kv")(key, value, k_cache, v_cache, slots.contiguous())
