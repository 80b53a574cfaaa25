"""The one-pass C++ layer kernels (`kernels/csrc/layer_ops.cpp`) against independent references:
SiLU·mul against `F.silu(gate) * up`, RMSNorm against Hugging Face's `LlamaRMSNorm` (and the residual
add fused before it against `x + residual` then `LlamaRMSNorm`, bit for bit the two ops), RoPE against
Hugging Face's `apply_rotary_pos_emb` (bit for bit, in place on strided q/k views), and `write_kv`
against the PyTorch reference's `index_put_`, over widths with vector tails, strided rows, both
slot dtypes, the CPU cache layout and bf16 caches. In bfloat16, SiLU·mul and RMSNorm must round
where eager PyTorch rounds (bf16 `F.silu(gate).mul_(up)`, Hugging Face's bf16 `LlamaRMSNorm`), so
the kernel and the eager model give the same tokens. And the guard rails: a slot outside the cache
raises naming `slot_mapping` and writes nothing, mixed dtypes raise naming the tensor, and inputs
the kernels do not take (float16, mixed dtypes, `CHARIOT_CPU_LAYER_OPS=0`) run the PyTorch code.

Both builds are checked: the native one (16 lanes on an AVX-512 machine) and the 256-bit one an
AVX2 machine gets (`CHARIOT_VECTOR_256`, through a wrapper source that includes the kernel)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from transformers.models.llama.modeling_llama import LlamaRMSNorm, apply_rotary_pos_emb

from chariot.kernels import cpu_layer_ops, reference
from chariot.kernels.attention import empty_kv_cache
from chariot.kernels.cpu_layer_ops import SOURCE, load_kernel
from tests.kernel_builds import vector_256_source

pytestmark = pytest.mark.slow  # the first test in a fresh cache compiles the extension

Ops = Callable[[str], Callable[..., None]]


@pytest.fixture(scope="module", params=["native", "256-bit"])
def ops(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Ops:
    if request.param == "native":
        return load_kernel()
    return load_kernel(vector_256_source(SOURCE, tmp_path_factory.mktemp("avx2")))


@pytest.mark.parametrize("rows,width", [(1, 16), (7, 2816), (33, 40), (512, 2816), (3, 5)])
def test_silu_and_mul_matches_torch(ops: Ops, rows: int, width: int) -> None:
    gen = torch.Generator().manual_seed(rows * 1000 + width)
    wide = torch.randn(rows, 2 * width + 24, generator=gen) * 6  # rows strided inside a wider buffer
    wide[0, :4] = torch.tensor([-100.0, 100.0, -87.5, 0.0])[: min(4, width)]  # saturating ends of exp
    gate_up = wide[:, : 2 * width]
    out = torch.empty(rows, width)
    ops("silu_and_mul")(gate_up, out)
    expected = F.silu(gate_up[:, :width]) * gate_up[:, width:]
    torch.testing.assert_close(out, expected, rtol=2e-6, atol=1e-6)


@pytest.mark.parametrize("rows,width", [(1, 1024), (9, 72), (64, 4096), (5, 13)])
def test_rms_norm_matches_hugging_face(ops: Ops, rows: int, width: int) -> None:
    gen = torch.Generator().manual_seed(rows + width)
    hf = LlamaRMSNorm(width, eps=1e-5)
    with torch.no_grad():
        hf.weight.copy_(torch.randn(width, generator=gen))
    x = torch.randn(rows, width, generator=gen) * 3
    out = torch.empty_like(x)
    ops("rms_norm")(x, hf.weight.detach(), 1e-5, out)
    with torch.no_grad():
        torch.testing.assert_close(out, hf(x), rtol=2e-6, atol=2e-6)


def _mostly_identical(got: torch.Tensor, want: torch.Tensor) -> None:
    """bf16 results equal to eager's bit for bit, but for rare one-ulp differences where the fp32 value
    sits on a rounding boundary (exp2 and 1/sqrt are not libm's; RMSNorm rounds twice) and for values below
    1e-30 (silu(-100) is -3e-36 where eager's exp overflows to give -0); NaN where eager has NaN."""
    assert torch.equal(got.isnan(), want.isnan())
    finite = ~want.isnan()
    torch.testing.assert_close(got[finite].float(), want[finite].float(), rtol=1.6e-2, atol=1e-5)  # 1 ulp, twice
    counted = finite & ((got.float().abs() > 1e-30) | (want.float().abs() > 1e-30))
    assert (got[counted] != want[counted]).float().mean().item() < 2e-3


@pytest.mark.parametrize("rows,width", [(1, 16), (7, 2816), (33, 40), (3, 5)])
def test_bfloat16_silu_and_mul_rounds_like_eager(ops: Ops, rows: int, width: int) -> None:
    gen = torch.Generator().manual_seed(rows * 7 + width)
    wide = (torch.randn(rows, 2 * width + 24, generator=gen) * 6).bfloat16()
    wide[0, :3] = torch.tensor([float("nan"), 100.0, -100.0])[: min(3, width)]
    gate_up = wide[:, : 2 * width]
    out = torch.empty(rows, width, dtype=torch.bfloat16)
    ops("silu_and_mul")(gate_up, out)
    _mostly_identical(out, F.silu(gate_up[:, :width]).mul_(gate_up[:, width:]))


@pytest.mark.parametrize("rows,width", [(1, 1024), (9, 72), (64, 4096), (5, 13)])
def test_bfloat16_rms_norm_rounds_like_hugging_face(ops: Ops, rows: int, width: int) -> None:
    gen = torch.Generator().manual_seed(rows * 3 + width)
    hf = LlamaRMSNorm(width, eps=1e-5).to(torch.bfloat16)
    with torch.no_grad():
        hf.weight.copy_(torch.randn(width, generator=gen))
    x = (torch.randn(rows, width, generator=gen) * 3).bfloat16()
    out = torch.empty_like(x)
    ops("rms_norm")(x, hf.weight.detach(), 1e-5, out)
    with torch.no_grad():
        _mostly_identical(out, hf(x))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,width", [(1, 1024), (9, 72), (64, 4096), (5, 13)])
def test_add_rms_norm_is_the_residual_add_then_hugging_faces_norm(ops: Ops, dtype: torch.dtype, rows: int,
                                                                 width: int) -> None:
    """x += residual in place, rounded as eager `add_` rounds, and the norm of the sum: the same bits as
    `add_` followed by the `rms_norm` kernel, and Hugging Face's norm of `x + residual` to its precision.
    The residual's rows are strided inside a wider buffer."""
    gen = torch.Generator().manual_seed(rows * 11 + width)
    hf = LlamaRMSNorm(width, eps=1e-5).to(dtype)
    with torch.no_grad():
        hf.weight.copy_(torch.randn(width, generator=gen))
    x = (torch.randn(rows, width, generator=gen) * 3).to(dtype)
    residual = (torch.randn(rows, width + 8, generator=gen) * 3).to(dtype)[:, :width]
    weight = hf.weight.detach()
    summed = x.clone().add_(residual)
    two_ops = torch.empty_like(x)
    ops("rms_norm")(summed, weight, 1e-5, two_ops)
    out = torch.empty_like(x)
    ops("add_rms_norm")(x, residual, weight, 1e-5, out)
    assert torch.equal(x, summed) and torch.equal(out, two_ops)
    with torch.no_grad():
        if dtype == torch.float32:
            torch.testing.assert_close(out, hf(summed), rtol=2e-6, atol=2e-6)
        else:
            _mostly_identical(out, hf(summed))


def test_add_rms_norm_refuses_mismatched_shapes_and_an_aliased_out(ops: Ops) -> None:
    x, w = torch.randn(3, 32), torch.randn(32)
    before = x.clone()
    with pytest.raises(RuntimeError, match="residual and out must be shaped like x"):
        ops("add_rms_norm")(x, torch.randn(2, 32), w, 1e-5, torch.empty_like(x))
    with pytest.raises(RuntimeError, match="out must be a tensor of its own"):
        ops("add_rms_norm")(x, torch.randn(3, 32), w, 1e-5, x)
    with pytest.raises(RuntimeError, match="residual must have x's dtype"):
        ops("add_rms_norm")(x, torch.randn(3, 32).bfloat16(), w, 1e-5, torch.empty_like(x))
    assert torch.equal(x, before)  # refused before anything was written


def test_mixed_dtypes_raise_naming_the_tensor(ops: Ops) -> None:
    x = torch.randn(2, 32).bfloat16()
    with pytest.raises(RuntimeError, match="weight must have x's dtype"):
        ops("rms_norm")(x, torch.randn(32), 1e-5, torch.empty_like(x))
    with pytest.raises(RuntimeError, match="out must have gate_up's dtype"):
        ops("silu_and_mul")(x, torch.empty(2, 16))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens,heads,kv_heads,dim", [(1, 16, 4, 64), (7, 4, 4, 80), (300, 8, 2, 40), (5, 2, 1, 128)])
def test_rope_matches_hugging_face_bit_for_bit(ops: Ops, dtype: torch.dtype, tokens: int, heads: int, kv_heads: int,
                                               dim: int) -> None:
    gen = torch.Generator().manual_seed(tokens * 7 + dim)
    qkv = (torch.randn(tokens, (heads + 2 * kv_heads) * dim, generator=gen) * 4).to(dtype)  # q, k strided in it
    q = qkv[:, : heads * dim].view(tokens, heads, dim)
    k = qkv[:, heads * dim: (heads + kv_heads) * dim].view(tokens, kv_heads, dim)
    angles = torch.rand(tokens, dim // 2, generator=gen) * 2000
    cos, sin = torch.cat([angles, angles], -1).cos().to(dtype), torch.cat([angles, angles], -1).sin().to(dtype)
    want_q, want_k = apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1)
    value = qkv[:, (heads + kv_heads) * dim:].clone()
    ops("rope")(q, k, cos, sin)
    assert torch.equal(q, want_q) and torch.equal(k, want_k)
    assert torch.equal(qkv[:, (heads + kv_heads) * dim:], value)  # v, beside them, untouched


def test_rope_rejects_angles_of_the_wrong_shape(ops: Ops) -> None:
    q, k = torch.randn(3, 4, 64), torch.randn(3, 2, 64)
    with pytest.raises(RuntimeError, match=r"cos and sin must be \[tokens, head_dim\] = \[3, 64\]"):
        ops("rope")(q, k, torch.randn(3, 32), torch.randn(3, 32))
    with pytest.raises(RuntimeError, match="cos must have q's dtype"):
        ops("rope")(q, k, torch.randn(3, 64).bfloat16(), torch.randn(3, 64).bfloat16())


def test_rope_wrapper_takes_the_kernel_or_the_reference(monkeypatch: pytest.MonkeyPatch) -> None:
    gen = torch.Generator().manual_seed(5)
    cos, sin = torch.randn(6, 1, 32, generator=gen), torch.randn(6, 1, 32, generator=gen)
    for dtype in (torch.bfloat16, torch.float16):  # the kernel, then PyTorch (float16 is not taken)
        q, k = torch.randn(6, 4, 32, generator=gen).to(dtype), torch.randn(6, 2, 32, generator=gen).to(dtype)
        c, s = cos.to(dtype), sin.to(dtype)
        want_q, want_k = reference.rope(q, c, s), reference.rope(k, c, s)
        q2, k2 = q.clone(), k.clone()
        cpu_layer_ops.rope_(q, k, c, s)
        cpu_layer_ops.rope_(q2, k2, c.squeeze(1), s.squeeze(1))  # [T, head_dim] angles, as the model passes
        assert torch.equal(q, want_q) and torch.equal(k, want_k)
        assert torch.equal(q2, want_q) and torch.equal(k2, want_k)
    calls: list[str] = []
    kernel = cpu_layer_ops.load_kernel()
    monkeypatch.setattr(cpu_layer_ops, "load_kernel", lambda: lambda name: calls.append(name) or kernel(name))
    cpu_layer_ops.rope_(torch.randn(6, 4, 32), torch.randn(6, 2, 32), cos, sin)
    monkeypatch.setenv(cpu_layer_ops.ENV, "0")
    cpu_layer_ops.rope_(torch.randn(6, 4, 32), torch.randn(6, 2, 32), cos, sin)
    assert calls == ["rope"]


def _caches(blocks: int, block: int, heads: int, dim: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    return (empty_kv_cache(blocks, block, heads, dim, dtype).fill_(-1),
            empty_kv_cache(blocks, block, heads, dim, dtype).fill_(-2))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("slot_dtype", [torch.int64, torch.int32])
def test_write_kv_matches_reference(ops: Ops, dtype: torch.dtype, slot_dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(3)
    tokens, heads, dim, block, blocks = 77, 4, 64, 16, 12
    qkv = torch.randn(tokens, (2 + 2 * heads) * dim, generator=gen).to(dtype)  # k and v strided inside it
    key = qkv[:, 2 * dim: (2 + heads) * dim].view(tokens, heads, dim)
    value = qkv[:, (2 + heads) * dim:].view(tokens, heads, dim)
    slots = torch.randperm(blocks * block, generator=gen)[:tokens].to(slot_dtype)
    got, want = _caches(blocks, block, heads, dim, dtype), _caches(blocks, block, heads, dim, dtype)
    ops("write_kv")(key, value, *got, slots)
    reference.write_kv(key, value, *want, slots.long())
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_write_kv_slot_outside_the_cache_raises_and_writes_nothing() -> None:
    key = torch.randn(3, 2, 8)
    k_cache, v_cache = _caches(2, 4, 2, 8, torch.float32)
    before = (k_cache.clone(), v_cache.clone())
    with pytest.raises(RuntimeError, match=r"slot_mapping\[2\] = 8 is outside the cache's 8 slots"):
        cpu_layer_ops.write_kv(key, key, k_cache, v_cache, torch.tensor([0, 1, 8]))
    assert torch.equal(k_cache, before[0]) and torch.equal(v_cache, before[1])


def test_wrappers_take_the_kernels_for_float32(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(cpu_layer_ops.ENV, "1")
    assert cpu_layer_ops.enabled()
    gate_up = torch.randn(2, 3, 96)  # leading dims are flattened and restored
    out = cpu_layer_ops.silu_and_mul(gate_up)
    assert out.shape == (2, 3, 48)
    torch.testing.assert_close(out, F.silu(gate_up[..., :48]) * gate_up[..., 48:], rtol=2e-6, atol=1e-6)
    x, w = torch.randn(2, 3, 64), torch.randn(64)
    torch.testing.assert_close(cpu_layer_ops.rms_norm(x, w, 1e-6), F.rms_norm(x, (64,), eps=1e-6) * w,
                               rtol=2e-6, atol=2e-6)


def test_wrappers_take_the_kernels_for_bfloat16(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []
    kernel = cpu_layer_ops.load_kernel()
    monkeypatch.setattr(cpu_layer_ops, "load_kernel", lambda: lambda name: calls.append(name) or kernel(name))
    # enough values that the allowed share of one-ulp differences is several values, not less than one
    gate_up = torch.randn(2, 32, 96).bfloat16()
    _mostly_identical(cpu_layer_ops.silu_and_mul(gate_up), F.silu(gate_up[..., :48]).mul_(gate_up[..., 48:]))
    x, w = torch.randn(32, 64).bfloat16(), torch.randn(64).bfloat16()
    _mostly_identical(cpu_layer_ops.rms_norm(x, w, 1e-5), F.rms_norm(x.float(), (64,), eps=1e-5).bfloat16().mul_(w))
    residual = torch.randn(32, 64).bfloat16()
    summed = x.clone().add_(residual)
    normed, stream = cpu_layer_ops.add_rms_norm(x, residual, w, 1e-5)
    assert stream is x and torch.equal(x, summed)  # the residual stream, in place
    _mostly_identical(normed, F.rms_norm(summed.float(), (64,), eps=1e-5).bfloat16().mul_(w))
    assert calls == ["silu_and_mul", "rms_norm", "add_rms_norm"]


def test_float16_mixed_and_switched_off_run_pytorch(monkeypatch: pytest.MonkeyPatch) -> None:
    gate_up = torch.randn(5, 64).half()
    assert torch.equal(cpu_layer_ops.silu_and_mul(gate_up), F.silu(gate_up[:, :32]) * gate_up[:, 32:])
    x, w32 = torch.randn(4, 32).bfloat16(), torch.randn(32)  # a float32 weight on bf16 rows: PyTorch's promotion
    want = F.rms_norm(x.float(), (32,), eps=1e-5).to(x.dtype).mul_(w32)
    assert torch.equal(cpu_layer_ops.rms_norm(x, w32, 1e-5), want)
    x3, r3 = torch.randn(2, 2, 32), torch.randn(2, 2, 32)  # rows that are not 2-D: add_, then the norm
    want3 = x3 + r3
    normed, stream = cpu_layer_ops.add_rms_norm(x3, r3, torch.ones(32), 1e-5)
    assert stream is x3 and torch.equal(x3, want3) and normed.shape == (2, 2, 32)
    monkeypatch.setenv(cpu_layer_ops.ENV, "0")
    assert not cpu_layer_ops.enabled()
    x, w = torch.randn(4, 32), torch.randn(32)
    assert torch.equal(cpu_layer_ops.rms_norm(x, w, 1e-5), F.rms_norm(x, (32,), eps=1e-5).mul_(w))
    residual, summed = torch.randn(4, 32), x.clone()
    summed += residual
    normed, _ = cpu_layer_ops.add_rms_norm(x, residual, w, 1e-5)
    assert torch.equal(x, summed) and torch.equal(normed, F.rms_norm(summed, (32,), eps=1e-5).mul_(w))
    key = torch.randn(2, 1, 8)
    k_cache, v_cache = _caches(1, 4, 1, 8, torch.float32)
    cpu_layer_ops.write_kv(key, key, k_cache, v_cache, torch.tensor([3, 0]))
    assert torch.equal(k_cache[0, 3], key[0]) and torch.equal(v_cache[0, 0], key[1])
