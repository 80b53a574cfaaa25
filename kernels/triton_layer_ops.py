# mypy: disable-error-code="no-untyped-def"
# (Triton reads the annotations of @triton.jit parameters itself; kernel arguments stay unannotated.)
"""Triton kernels for a decoder layer's element-wise work on the GPU: one launch per fused step.

Eager PyTorch spends several CUDA kernels on each of these steps (RoPE alone is about ten per layer:
multiplies, the rotate-half copies, adds, for q and for k), and each launch costs the host several
microseconds, so on a decode iteration the GPU waits for the host. Here each step is one launch:

- `rms_norm`: RMSNorm times the weight, one program per row (first layer's input norm, final norm).
- `add_rms_norm`: the residual add fused into the next norm, as vLLM's `fused_add_rms_norm`: x +
  residual is written back into x (the new residual stream) and its norm into a fresh tensor.
- `rope_write_kv`: RoPE applied to q and k in place (Hugging Face's rotate-half layout) and k, after
  rotation, and v written into the paged cache at `slot_mapping`, one program per token. The cache
  layout and semantics are `write_kv`'s (`attention.py`); a negative slot (padding rows of a
  padded batch) writes nothing to the cache.
- `silu_and_mul`: SwiGLU's `silu(gate) · up` over the fused gate/up projection's output.

Every kernel computes in float32 and rounds to the tensors' dtype exactly where eager PyTorch (and
Hugging Face's modules) round: the normalised row before the weight, `silu(gate)` before the
multiply, each RoPE product before the sum. So in bfloat16 and float16 they match eager PyTorch but
for the last bit of `exp` / `rsqrt` (and, compiled, multiply-adds the GPU may fuse).

On CPU they run under the Triton interpreter (`TRITON_INTERPRET=1` set before `triton` is first
imported, as for `triton_attention.py`), which is how the tests check them against PyTorch; the
model takes them on CUDA only, through `layer_ops.py`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from chariot.kernels.triton_attention import _INTERPRETED, _MIXED_MODES, _round_to_bf16

__all__ = ["MAX_HIDDEN", "SUPPORTED_DTYPES", "add_rms_norm", "rms_norm", "rope_write_kv", "silu_and_mul"]

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_HIDDEN = 65536  # one program holds a whole row of the norm
SILU_BLOCK = 1024  # columns per program of SiLU·mul
_INDEX_DTYPES = (torch.int32, torch.int64)


# --- rounding helpers --------------------------------------------------------------------------


@triton.jit
def _cast(x, ptr, ROUND_BF16: tl.constexpr):
    """fp32 `x` rounded to nearest even into `ptr`'s element type (the interpreter's bf16 cast truncates)."""
    if ROUND_BF16:
        return _round_to_bf16(x)
    return x.to(ptr.dtype.element_ty)


@triton.jit
def _rounded(x, ptr, ROUND_BF16: tl.constexpr):
    """fp32 `x` rounded to `ptr`'s element type and widened back: where eager PyTorch rounds a result."""
    return _cast(x, ptr, ROUND_BF16).to(tl.float32)


# --- kernels -----------------------------------------------------------------------------------


@triton.jit
def _rms_norm_kernel(
    out_ptr,
    x_ptr,
    residual_ptr,
    weight_ptr,
    hidden,
    eps,
    stride_xt,
    stride_rt,
    stride_ot,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
    ROUND_BF16: tl.constexpr,
):
    """One program per row: [x += residual, in place;] out = round(x · rsqrt(mean(x²) + eps)) · weight."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < hidden
    x = tl.load(x_ptr + row * stride_xt + cols, mask=ok, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        residual = tl.load(residual_ptr + row * stride_rt + cols, mask=ok, other=0.0).to(tl.float32)
        x = _rounded(x + residual, x_ptr, ROUND_BF16)
        tl.store(x_ptr + row * stride_xt + cols, _cast(x, x_ptr, ROUND_BF16), mask=ok)
    mean_square = tl.sum(x * x, 0) / hidden
    normed = _rounded(x * tl.math.rsqrt(mean_square + eps), x_ptr, ROUND_BF16)
    weight = tl.load(weight_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_ot + cols, _cast(normed * weight, out_ptr, ROUND_BF16), mask=ok)


@triton.jit
def _silu_and_mul_kernel(
    out_ptr, gate_up_ptr, width, stride_gt, stride_ot, BLOCK: tl.constexpr, ROUND_BF16: tl.constexpr
):
    """Program (row, column block): out = round(silu(gate)) · up, gate the first `width` columns."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < width
    gate = tl.load(gate_up_ptr + row * stride_gt + cols, mask=ok, other=0.0).to(tl.float32)
    up = tl.load(gate_up_ptr + row * stride_gt + width + cols, mask=ok, other=0.0).to(tl.float32)
    silu = _rounded(gate / (1.0 + tl.exp(-gate)), out_ptr, ROUND_BF16)
    tl.store(out_ptr + row * stride_ot + cols, _cast(silu * up, out_ptr, ROUND_BF16), mask=ok)


@triton.jit
def _rotate_heads(x_ptr, stride_h, num_heads, half, c1, c2, s1, s2, BLOCK_H: tl.constexpr,
                  BLOCK_HALF: tl.constexpr, ROUND_BF16: tl.constexpr):
    """Rotate one token's heads in place: [x1, x2] → [x1·c1 - x2·s1, x2·c2 + x1·s2], each product and
    each sum rounded to x's dtype (Hugging Face's `x·cos + rotate_half(x)·sin`). Returns the rotated
    halves (x's dtype)."""
    heads = tl.arange(0, BLOCK_H)[:, None]
    dims = tl.arange(0, BLOCK_HALF)[None, :]
    mask = (heads < num_heads) & (dims < half)
    first = x_ptr + heads * stride_h + dims
    x1 = tl.load(first, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(first + half, mask=mask, other=0.0).to(tl.float32)
    out1 = _cast(_rounded(x1 * c1, x_ptr, ROUND_BF16) - _rounded(x2 * s1, x_ptr, ROUND_BF16), x_ptr, ROUND_BF16)
    out2 = _cast(_rounded(x2 * c2, x_ptr, ROUND_BF16) + _rounded(x1 * s2, x_ptr, ROUND_BF16), x_ptr, ROUND_BF16)
    tl.store(first, out1, mask=mask)
    tl.store(first + half, out2, mask=mask)
    return out1, out2


@triton.jit
def _rope_write_kv_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    cos_ptr,
    sin_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_ptr,
    num_heads,
    num_kv_heads,
    half,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_ct,
    stride_st,
    stride_kcb,
    stride_kcs,
    stride_kch,
    stride_vcb,
    stride_vcs,
    stride_vch,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_HQ: tl.constexpr,
    BLOCK_HK: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    ROUND_Q: tl.constexpr,
    ROUND_CACHE: tl.constexpr,
):
    """One program per token: rotate its q and k heads in place, then write k and v at its slot."""
    token = tl.program_id(0).to(tl.int64)
    dims = tl.arange(0, BLOCK_HALF)[None, :]
    dim_ok = dims < half
    c1 = tl.load(cos_ptr + token * stride_ct + dims, mask=dim_ok, other=0.0).to(tl.float32)
    c2 = tl.load(cos_ptr + token * stride_ct + half + dims, mask=dim_ok, other=0.0).to(tl.float32)
    s1 = tl.load(sin_ptr + token * stride_st + dims, mask=dim_ok, other=0.0).to(tl.float32)
    s2 = tl.load(sin_ptr + token * stride_st + half + dims, mask=dim_ok, other=0.0).to(tl.float32)
    _rotate_heads(q_ptr + token * stride_qt, stride_qh, num_heads, half, c1, c2, s1, s2, BLOCK_HQ, BLOCK_HALF,
                  ROUND_Q)
    k1, k2 = _rotate_heads(k_ptr + token * stride_kt, stride_kh, num_kv_heads, half, c1, c2, s1, s2,
                                 BLOCK_HK, BLOCK_HALF, ROUND_Q)

    slot = tl.load(slot_ptr + token).to(tl.int64)
    block, offset = slot // BLOCK_SIZE, slot % BLOCK_SIZE
    heads = tl.arange(0, BLOCK_HK)[:, None]
    written_heads = tl.where(slot >= 0, num_kv_heads, 0)  # a padding row (negative slot) owns no slot
    mask = (heads < written_heads) & dim_ok
    k_dst = k_cache_ptr + block * stride_kcb + offset * stride_kcs + heads * stride_kch + dims
    tl.store(k_dst, _cast(k1.to(tl.float32), k_cache_ptr, ROUND_CACHE), mask=mask)
    tl.store(k_dst + half, _cast(k2.to(tl.float32), k_cache_ptr, ROUND_CACHE), mask=mask)
    v_src = v_ptr + token * stride_vt + heads * stride_vh + dims
    v_dst = v_cache_ptr + block * stride_vcb + offset * stride_vcs + heads * stride_vch + dims
    v1 = tl.load(v_src, mask=mask, other=0.0).to(tl.float32)
    v2 = tl.load(v_src + half, mask=mask, other=0.0).to(tl.float32)
    tl.store(v_dst, _cast(v1, v_cache_ptr, ROUND_CACHE), mask=mask)
    tl.store(v_dst + half, _cast(v2, v_cache_ptr, ROUND_CACHE), mask=mask)


# --- validation --------------------------------------------------------------------------------


def _check_runnable(name: str, tensor: torch.Tensor) -> None:
    if _MIXED_MODES:
        raise RuntimeError(
            "TRITON_INTERPRET=1 was set after `triton` was first imported, so Triton's standard library is "
            "compiled while these kernels are interpreted; set it before anything imports triton"
        )
    if tensor.device.type != "cuda" and not _INTERPRETED:
        raise ValueError(
            f"{name} is on {tensor.device}: the Triton kernels need CUDA tensors, or TRITON_INTERPRET=1 set "
            "before triton is first imported to run them on CPU"
        )


def _check_tensor(name: str, tensor: torch.Tensor, device: torch.device, dtypes: tuple[torch.dtype, ...]) -> None:
    """On `device`, of one of `dtypes`, last dimension contiguous."""
    if tensor.device != device:
        raise ValueError(f"{name} is on {tensor.device}, expected {device} like the other inputs")
    if tensor.dtype not in dtypes:
        raise ValueError(f"{name} has dtype {tensor.dtype}; supported: {', '.join(map(str, dtypes))}")
    if tensor.dim() > 0 and tensor.shape[-1] > 1 and tensor.stride(-1) != 1:
        raise ValueError(f"{name} must be contiguous in its last dimension, got strides {tensor.stride()}")


def _rows(name: str, x: torch.Tensor) -> torch.Tensor:
    """x [..., hidden] as [rows, hidden] without a copy (raises naming `name` when no view exists)."""
    if x.dim() < 1:
        raise ValueError(f"{name} must have a last dimension, got shape {tuple(x.shape)}")
    try:
        return x.view(-1, x.shape[-1])
    except RuntimeError:
        raise ValueError(f"{name} with strides {x.stride()} cannot be viewed as rows; pass a contiguous one") from None


def _check_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> None:
    _check_runnable("x", x)
    _check_tensor("x", x, x.device, SUPPORTED_DTYPES)
    _check_tensor("weight", weight, x.device, SUPPORTED_DTYPES)
    hidden = x.shape[-1] if x.dim() else 0
    if not 1 <= hidden <= MAX_HIDDEN:
        raise ValueError(f"x's last dimension {hidden} is outside 1..{MAX_HIDDEN}")
    if tuple(weight.shape) != (hidden,):
        raise ValueError(f"weight must be [{hidden}] to match x's last dimension, got shape {tuple(weight.shape)}")
    if not eps >= 0:
        raise ValueError(f"eps must be >= 0, got {eps}")


# --- entry points ------------------------------------------------------------------------------


def _norm_launch(out: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                 eps: float) -> None:
    rows, hidden = x.shape
    if rows == 0:
        return
    block = triton.next_power_of_2(hidden)
    _rms_norm_kernel[(rows,)](
        out, x, x if residual is None else residual, weight, hidden, float(eps),
        x.stride(0), x.stride(0) if residual is None else residual.stride(0), out.stride(0),
        HAS_RESIDUAL=residual is not None, BLOCK=block, ROUND_BF16=_INTERPRETED and x.dtype == torch.bfloat16,
        num_warps=min(16, max(1, block // 256)),
    )


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`x / sqrt(mean(x²) + eps) · weight` over the last dimension (fp32 sums, rounded to x's dtype
    before the weight, as Hugging Face's `LlamaRMSNorm`); a fresh tensor shaped like x, one launch."""
    _check_norm(x, weight, eps)
    rows = _rows("x", x)
    out = torch.empty_like(rows)
    _norm_launch(out, rows, None, weight, eps)
    return out.view(x.shape)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """`x += residual` in place (the new residual stream, rounded to x's dtype), then its RMSNorm:
    returns (norm, x), the norm a fresh tensor. One launch; `residual` is only read."""
    _check_norm(x, weight, eps)
    _check_tensor("residual", residual, x.device, (x.dtype,))
    if residual.shape != x.shape:
        raise ValueError(f"residual must have x's shape {tuple(x.shape)}, got {tuple(residual.shape)}")
    rows = _rows("x", x)
    out = torch.empty_like(rows)
    _norm_launch(out, rows, _rows("residual", residual), weight, eps)
    return out.view(x.shape), x


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SwiGLU's `silu(gate) · up` for `gate_up` = [..., 2·I] (gate first): a fresh [..., I] tensor."""
    _check_runnable("gate_up", gate_up)
    _check_tensor("gate_up", gate_up, gate_up.device, SUPPORTED_DTYPES)
    if gate_up.dim() < 1 or gate_up.shape[-1] % 2:
        raise ValueError(f"gate_up's last dimension must be even (gate then up), got shape {tuple(gate_up.shape)}")
    rows = _rows("gate_up", gate_up)
    width = rows.shape[1] // 2
    out = torch.empty(rows.shape[0], width, dtype=gate_up.dtype, device=gate_up.device)
    if out.numel():
        block = min(SILU_BLOCK, triton.next_power_of_2(width))
        _silu_and_mul_kernel[(rows.shape[0], triton.cdiv(width, block))](
            out, rows, width, rows.stride(0), out.stride(0), BLOCK=block,
            ROUND_BF16=_INTERPRETED and gate_up.dtype == torch.bfloat16, num_warps=4,
        )
    return out.view(*gate_up.shape[:-1], width)


def _angle_shape(angles: torch.Tensor, tokens: int, head_dim: int) -> tuple[int, ...]:
    """The shape cos / sin must have: [T, head_dim], or [T, 1, head_dim] when given with three dimensions."""
    return (tokens, 1, head_dim) if angles.dim() == 3 else (tokens, head_dim)


def _check_rope(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    _check_runnable("q", q)
    device = q.device
    if q.dim() != 3:
        raise ValueError(f"q must be [num_tokens, num_heads, head_dim], got shape {tuple(q.shape)}")
    tokens, _, head_dim = q.shape
    if head_dim % 2:
        raise ValueError(f"head_dim must be even (RoPE rotates halves), got {head_dim}")
    if k_cache.dim() != 4:
        raise ValueError(f"k_cache must be [num_blocks, block_size, kv_heads, head_dim], got {tuple(k_cache.shape)}")
    want = (tokens, k_cache.shape[2], head_dim)
    shapes = {"k": (k, want), "v": (v, want), "v_cache": (v_cache, tuple(k_cache.shape)),
              "cos": (cos, _angle_shape(cos, tokens, head_dim)), "sin": (sin, _angle_shape(sin, tokens, head_dim)),
              "slot_mapping": (slot_mapping, (tokens,)), "k_cache": (k_cache, (*k_cache.shape[:2], *want[1:]))}
    for name, (tensor, shape) in shapes.items():
        if tuple(tensor.shape) != shape:
            raise ValueError(f"{name} must have shape {shape} to match q and k_cache, got {tuple(tensor.shape)}")
    for name, tensor in (("q", q), ("k", k), ("v", v), ("cos", cos), ("sin", sin)):
        _check_tensor(name, tensor, device, (q.dtype,))
    for name, tensor in (("k_cache", k_cache), ("v_cache", v_cache)):
        _check_tensor(name, tensor, device, SUPPORTED_DTYPES)
    if v_cache.dtype != k_cache.dtype:
        raise ValueError(f"v_cache dtype {v_cache.dtype} differs from k_cache dtype {k_cache.dtype}")
    _check_tensor("slot_mapping", slot_mapping, device, _INDEX_DTYPES)


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
    """Rotate q [T, heads, head_dim] and k [T, kv_heads, head_dim] in place by each token's angles
    (cos, sin [T, head_dim] or [T, 1, head_dim], q's dtype), then write k and v [T, kv_heads, head_dim] into the
    paged caches at `slot_mapping` (cast to the cache dtype), in one launch.

    q, k and v may be strided views of one fused projection (head_dim contiguous). Slots are not
    range-checked (that needs a device sync); a negative slot writes nothing."""
    _check_rope(q, k, v, cos, sin, k_cache, v_cache, slot_mapping)
    tokens, heads, head_dim = q.shape
    if tokens == 0:
        return
    kv_heads = k.shape[1]
    _rope_write_kv_kernel[(tokens,)](
        q, k, v, cos, sin, k_cache, v_cache, slot_mapping, heads, kv_heads, head_dim // 2,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), cos.stride(0), sin.stride(0),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), v_cache.stride(0), v_cache.stride(1),
        v_cache.stride(2),
        BLOCK_SIZE=k_cache.shape[1], BLOCK_HQ=triton.next_power_of_2(heads), BLOCK_HK=triton.next_power_of_2(kv_heads),
        BLOCK_HALF=triton.next_power_of_2(head_dim // 2), ROUND_Q=_INTERPRETED and q.dtype == torch.bfloat16,
        ROUND_CACHE=_INTERPRETED and k_cache.dtype == torch.bfloat16, num_warps=4,
    )
