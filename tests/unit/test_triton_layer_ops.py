"""The fused Triton layer kernels (`chariot.kernels.triton_layer_ops`) against PyTorch references.

Without a GPU the kernels run under the Triton interpreter (tests/conftest.py sets `TRITON_INTERPRET=1`
before anything imports triton; see tests/unit/test_triton_attention.py); on a GPU machine the same
cases run compiled on CUDA. The references are eager PyTorch as the model ran it before these kernels:
`F.rms_norm` in fp32, rounded, times the weight (Hugging Face's `LlamaRMSNorm`); `F.silu(gate) * up`;
`reference.rope` (Hugging Face's `apply_rotary_pos_emb`) and `reference.write_kv`. Shapes stay small
(the interpreter runs numpy per program), with odd token counts, widths that are not powers of two and
GQA head counts. Triton is a test dependency: if it is missing, these tests fail rather than skip.
"""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch
import torch.nn.functional as F

from chariot.kernels import cpu_layer_ops, layer_ops, reference

MODULE = "chariot.kernels.triton_layer_ops"
CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
EPS = 1e-5
FILL = float("nan")


@pytest.fixture(scope="module")
def tlo() -> ModuleType:
    """The kernels' module, interpreted on CPU when there is no GPU."""
    attention = importlib.import_module("chariot.kernels.triton_attention")
    module = importlib.import_module(MODULE)
    if not CUDA and not (attention._INTERPRETED and module._INTERPRETED):  # imported earlier, compiled mode
        attention = importlib.reload(attention)
        module = importlib.reload(module)
    if attention._MIXED_MODES:
        pytest.fail("triton was imported before TRITON_INTERPRET=1 was set; the interpreter cannot run the kernels")
    return module


def assert_close(out: torch.Tensor, expected: torch.Tensor) -> None:
    """fp32 within 1e-5; 16-bit at most two units in the last place apart, on at most 1 % of the
    elements (rounding ties after an `exp` or `rsqrt` that differs from PyTorch's in the last fp32 bit;
    a rounded intermediate one unit off, as SiLU before the multiply, can move the result by two)."""
    assert out.dtype == expected.dtype and out.shape == expected.shape
    if out.dtype == torch.float32:
        torch.testing.assert_close(out.cpu(), expected.cpu(), atol=1e-5, rtol=1e-5)
        return
    ulp = torch.finfo(out.dtype).eps * expected.float().abs().clamp_min(torch.finfo(out.dtype).tiny)
    diff = (out.float() - expected.float()).abs()
    assert (diff <= 2.01 * ulp).all(), f"max error {diff.max().item():.3g} beyond two ulps"
    assert int((diff > 0).sum()) <= max(1, out.numel() // 100), "more than 1 % of the elements differ"


def eager_rms_norm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return F.rms_norm(x.float(), (x.shape[-1],), eps=EPS).to(x.dtype) * weight


def random(*shape: int, dtype: torch.dtype, seed: int, scale: float = 1.0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=gen) * scale).to(DEVICE, dtype)


# --- RMSNorm, plain and with the residual add --------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rows,hidden", [(1, 64), (7, 96), (3, 256)])
def test_rms_norm_matches_eager(tlo: ModuleType, dtype: torch.dtype, rows: int, hidden: int) -> None:
    x = random(rows, hidden, dtype=dtype, seed=rows, scale=3.0)
    weight = random(hidden, dtype=dtype, seed=1)
    assert_close(tlo.rms_norm(x, weight, EPS), eager_rms_norm(x, weight))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rows,hidden", [(1, 64), (5, 96)])
def test_add_rms_norm_adds_in_place_then_normalises(
    tlo: ModuleType, dtype: torch.dtype, rows: int, hidden: int
) -> None:
    x = random(rows, hidden, dtype=dtype, seed=2)
    residual = random(rows, hidden, dtype=dtype, seed=3)
    weight = random(hidden, dtype=dtype, seed=4)
    summed = x + residual  # rounded to the dtype, as the eager add_ was
    residual_before = residual.clone()
    normed, stream = tlo.add_rms_norm(x, residual, weight, EPS)
    assert stream.data_ptr() == x.data_ptr() and torch.equal(x, summed), "x holds x + residual, bit for bit"
    assert torch.equal(residual, residual_before), "residual is only read"
    assert_close(normed, eager_rms_norm(summed, weight))


def test_rms_norm_keeps_leading_dimensions_and_float32_weight(tlo: ModuleType) -> None:
    x = random(2, 3, 40, dtype=torch.bfloat16, seed=5)
    weight = random(40, dtype=torch.float32, seed=6)
    out = tlo.rms_norm(x, weight, EPS)
    expected = F.rms_norm(x.float(), (40,), eps=EPS).to(x.dtype).mul_(weight)  # the CPU path's in-place mul
    assert out.shape == x.shape
    assert_close(out, expected)


# --- SiLU·mul ----------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(1, 2 * 48), (5, 2 * 100), (2, 3, 2 * 1300)])  # 1300: two column blocks
def test_silu_and_mul_matches_eager(tlo: ModuleType, dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    gate_up = random(*shape, dtype=dtype, seed=shape[-1], scale=4.0)
    gate, up = gate_up.chunk(2, dim=-1)
    assert_close(tlo.silu_and_mul(gate_up), F.silu(gate) * up)


@pytest.mark.filterwarnings("ignore:overflow encountered in exp")  # exp(200) is inf: silu → -0
def test_silu_and_mul_saturates_like_eager(tlo: ModuleType) -> None:
    gate_up = torch.tensor([[-200.0, -30.0, 0.0, 30.0, 200.0, 1.0, 2.0, 3.0, 4.0, 5.0]], device=DEVICE)
    gate, up = gate_up.chunk(2, dim=-1)
    out = tlo.silu_and_mul(gate_up)
    assert torch.isfinite(out).all()
    assert_close(out, F.silu(gate) * up)


# --- RoPE fused with the KV-cache write --------------------------------------------------------


def assert_rotated_close(out: torch.Tensor, expected: torch.Tensor, x: torch.Tensor, cos: torch.Tensor,
                         sin: torch.Tensor, max_share: float = 0.01, ulps: float = 2.01) -> None:
    """RoPE's outputs against the reference, each within two units in the last place of the larger of
    the two products it sums (|x1·c1| or |x2·s1|; `ulps` of them): where those nearly cancel, one
    product rounded one unit apart (a fused multiply-add, say) moves a small result by many of its
    own units. At most `max_share` of the elements may differ at all."""
    if out.dtype == torch.float32:
        assert_close(out, expected)
        return
    half = x.shape[-1] // 2
    xf, c, s = x.float(), cos.float().unsqueeze(1), sin.float().unsqueeze(1)
    rotated = torch.cat([xf[..., half:], xf[..., :half]], dim=-1)
    terms = torch.maximum((xf * c).abs(), (rotated * s).abs())
    magnitude = torch.maximum(terms, expected.float().abs()).clamp_min(torch.finfo(out.dtype).tiny)
    ulp = torch.finfo(out.dtype).eps * magnitude
    diff = (out.float() - expected.float()).abs()
    assert (diff <= ulps * ulp).all(), f"max error {diff.max().item():.3g} beyond {ulps:g} ulps of the products"
    differing = int((diff > 0).sum())
    assert differing <= max(1, int(out.numel() * max_share)), f"{differing} of {out.numel()} elements differ"


def rope_case(tokens: int, heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype, seed: int = 0
              ) -> tuple[torch.Tensor, ...]:
    """q, k, v as strided views of one fused projection, and the model's cos/sin rows [T, head_dim]."""
    fused = random(tokens, (heads + 2 * kv_heads) * head_dim, dtype=dtype, seed=seed, scale=2.0)
    q, k, v = fused.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    angles = torch.rand(tokens, head_dim // 2, generator=torch.Generator().manual_seed(seed)) * 40
    angles = torch.cat([angles, angles], dim=-1)
    cos, sin = angles.cos().to(DEVICE, dtype), angles.sin().to(DEVICE, dtype)
    return (q.view(tokens, heads, head_dim), k.view(tokens, kv_heads, head_dim), v.view(tokens, kv_heads, head_dim),
            cos, sin)


def caches(kv_heads: int, head_dim: int, dtype: torch.dtype, blocks: int = 6, block_size: int = 4
           ) -> list[torch.Tensor]:
    return [torch.full((blocks, block_size, kv_heads, head_dim), FILL, dtype=dtype, device=DEVICE) for _ in range(2)]


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.view(torch.uint8), b.view(torch.uint8))  # NaN (never written) included


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("tokens,heads,kv_heads,head_dim", [(1, 4, 2, 16), (5, 6, 2, 40), (7, 3, 3, 64),
                                                             (3, 8, 1, 24)])
def test_rope_write_kv_rotates_as_reference_and_writes_as_write_kv(
    tlo: ModuleType, dtype: torch.dtype, tokens: int, heads: int, kv_heads: int, head_dim: int
) -> None:
    q, k, v, cos, sin = rope_case(tokens, heads, kv_heads, head_dim, dtype, seed=tokens)
    want_q, want_k = reference.rope(q, cos.unsqueeze(1), sin.unsqueeze(1)), reference.rope(k, cos.unsqueeze(1),
                                                                                            sin.unsqueeze(1))
    v_before, q_before, k_before = v.clone(), q.clone(), k.clone()
    slots = torch.tensor([17, 0, 23, 5, 4, 11, 12][:tokens], device=DEVICE)  # unordered, across blocks
    k_cache, v_cache = caches(kv_heads, head_dim, dtype)
    ref_k_cache, ref_v_cache = caches(kv_heads, head_dim, dtype)

    tlo.rope_write_kv(q, k, v, cos, sin, k_cache, v_cache, slots)

    assert_rotated_close(q, want_q, q_before, cos, sin)
    assert_rotated_close(k, want_k, k_before, cos, sin)
    assert torch.equal(v, v_before)
    reference.write_kv(k, v, ref_k_cache, ref_v_cache, slots)  # what write_kv makes of the rotated k
    assert same_bits(k_cache, ref_k_cache) and same_bits(v_cache, ref_v_cache)


def test_rope_write_kv_skips_negative_slots_and_casts_to_the_cache(tlo: ModuleType) -> None:
    q, k, v, cos, sin = rope_case(5, 4, 2, 32, torch.float32, seed=9)
    slots = torch.tensor([3, -1, 9, -1, 0], dtype=torch.int32, device=DEVICE)  # padding rows own no slot
    k_cache, v_cache = caches(2, 32, torch.bfloat16)
    ref_k_cache, ref_v_cache = caches(2, 32, torch.bfloat16)
    tlo.rope_write_kv(q, k, v, cos, sin.unsqueeze(1), k_cache, v_cache, slots)  # [T, 1, D] angles too
    kept = slots >= 0
    reference.write_kv(k[kept], v[kept], ref_k_cache, ref_v_cache, slots[kept].long())
    assert same_bits(k_cache, ref_k_cache) and same_bits(v_cache, ref_v_cache)


def test_rope_write_kv_matches_the_cpu_path_on_the_model_cache_layout(tlo: ModuleType) -> None:
    """The dispatcher's CPU path (C++ RoPE, then the backend's write) and the kernel agree on a
    head-major CPU cache (`empty_kv_cache`), bf16."""
    from chariot.kernels import empty_kv_cache

    q, k, v, cos, sin = rope_case(3, 4, 2, 64, torch.bfloat16, seed=11)
    q2, k2, v2 = q.clone(), k.clone(), v.clone()
    slots = torch.tensor([6, 1, 13], device=DEVICE)
    mine = [empty_kv_cache(4, 4, 2, 64, torch.bfloat16, DEVICE).fill_(0) for _ in range(2)]
    theirs = [empty_kv_cache(4, 4, 2, 64, torch.bfloat16, DEVICE).fill_(0) for _ in range(2)]
    tlo.rope_write_kv(q, k, v, cos, sin, *mine, slots)
    layer_ops.rope_write_kv(q2, k2, v2, cos, sin, *theirs, slots)
    assert torch.equal(q, q2) and torch.equal(k, k2)
    assert torch.equal(mine[0], theirs[0]) and torch.equal(mine[1], theirs[1])


# --- validation --------------------------------------------------------------------------------


def test_inputs_errors_name_the_field(tlo: ModuleType) -> None:
    x, weight = random(2, 8, dtype=torch.float32, seed=0), random(8, dtype=torch.float32, seed=1)
    with pytest.raises(ValueError, match="weight must be \\[8\\]"):
        tlo.rms_norm(x, weight[:4], EPS)
    with pytest.raises(ValueError, match="residual must have x's shape"):
        tlo.add_rms_norm(x, x[:1], weight, EPS)
    with pytest.raises(ValueError, match=r"x has dtype torch\.int64"):
        tlo.rms_norm(x.long(), weight, EPS)
    with pytest.raises(ValueError, match="gate_up's last dimension must be even"):
        tlo.silu_and_mul(random(2, 7, dtype=torch.float32, seed=2))
    q, k, v, cos, sin = rope_case(3, 4, 2, 16, torch.float32)
    k_cache, v_cache = caches(2, 16, torch.float32)
    slots = torch.arange(3, device=DEVICE)
    with pytest.raises(ValueError, match="slot_mapping must have shape \\(3,\\)"):
        tlo.rope_write_kv(q, k, v, cos, sin, k_cache, v_cache, slots[:2])
    with pytest.raises(ValueError, match=r"slot_mapping has dtype torch\.float32"):
        tlo.rope_write_kv(q, k, v, cos, sin, k_cache, v_cache, slots.float())
    with pytest.raises(ValueError, match="cos must have shape \\(3, 16\\)"):
        tlo.rope_write_kv(q, k, v, cos[:, :8], sin, k_cache, v_cache, slots)
    with pytest.raises(ValueError, match="k must have shape \\(3, 2, 16\\)"):
        tlo.rope_write_kv(q, k[:, :1], v, cos, sin, k_cache, v_cache, slots)


def test_empty_batches_launch_nothing(tlo: ModuleType) -> None:
    empty = torch.empty(0, 8, device=DEVICE)
    weight = torch.ones(8, device=DEVICE)
    assert tlo.rms_norm(empty, weight, EPS).shape == (0, 8)
    assert tlo.silu_and_mul(empty).shape == (0, 4)
    q, k, v, cos, sin = rope_case(0, 2, 1, 8, torch.float32)
    k_cache, v_cache = caches(1, 8, torch.float32)
    tlo.rope_write_kv(q, k, v, cos, sin, k_cache, v_cache, torch.empty(0, dtype=torch.int64, device=DEVICE))
    assert k_cache.isnan().all()


def test_cpu_tensors_keep_the_cpu_path() -> None:
    assert not layer_ops.fused_on(torch.zeros(2, 8))
    assert not layer_ops.fused_on(torch.zeros(2, 8, dtype=torch.bfloat16))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_cpu_add_rms_norm_is_the_add_then_the_norm_of_before(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(12)
    x, residual, weight = (torch.randn(*shape, generator=gen).to(dtype) for shape in ((5, 48), (5, 48), (48,)))
    want_sum = x + residual
    normed, summed = layer_ops.add_rms_norm(x, residual, weight, EPS)
    assert summed is x and torch.equal(x, want_sum)
    assert torch.equal(normed, cpu_layer_ops.rms_norm(want_sum, weight, EPS))


# --- compiled for a GPU, without one -----------------------------------------------------------

# Each kernel's argument types as the wrappers launch them (a pointer's element type is filled in per
# dtype), and one set of tile sizes of Llama-3-8B's shapes (hidden 4096, 32 + 8 heads of 128).
COMPILE_SCRIPT = """
import sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from chariot.kernels import triton_layer_ops as m

def compile_for_hopper(fn, args, constants):
    sig = dict(args, **{name: "constexpr" for name in constants})
    triton.compile(ASTSource(fn=fn, signature=sig, constexprs=constants), target=GPUTarget("cuda", 90, 32))

for dt in sys.argv[1:]:
    p = "*" + dt
    norm = dict(out_ptr=p, x_ptr=p, residual_ptr=p, weight_ptr=p, hidden="i32", eps="fp32", stride_xt="i32",
                stride_rt="i32", stride_ot="i32")
    for residual in (False, True):
        compile_for_hopper(m._rms_norm_kernel, norm, dict(HAS_RESIDUAL=residual, BLOCK=4096, ROUND_BF16=False))
    silu = dict(out_ptr=p, gate_up_ptr=p, width="i32", stride_gt="i32", stride_ot="i32")
    compile_for_hopper(m._silu_and_mul_kernel, silu, dict(BLOCK=1024, ROUND_BF16=False))
    rope = {name: p for name in ("q_ptr", "k_ptr", "v_ptr", "cos_ptr", "sin_ptr", "k_cache_ptr", "v_cache_ptr")}
    rope["slot_ptr"] = "*i64"
    rope.update({name: "i32" for name in ("num_heads", "num_kv_heads", "half", "stride_qt", "stride_qh", "stride_kt",
                 "stride_kh", "stride_vt", "stride_vh", "stride_ct", "stride_st", "stride_kcb", "stride_kcs",
                 "stride_kch", "stride_vcb", "stride_vcs", "stride_vch")})
    compile_for_hopper(m._rope_write_kv_kernel, rope, dict(BLOCK_SIZE=16, BLOCK_HQ=32, BLOCK_HK=8, BLOCK_HALF=64,
                                                           ROUND_Q=False, ROUND_CACHE=False))
    print("compiled", dt)
"""


def test_kernels_compile_for_hopper_without_a_gpu(tmp_path: Path) -> None:
    """The interpreter accepts code the compiler rejects (scalar and block types mixed, say): each
    kernel is compiled to a cubin for sm_90 in a process without the interpreter, in every dtype."""
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    env.update(TRITON_CACHE_DIR=str(tmp_path), TRITON_DEFAULT_FP_FUSION="1")
    dtypes = ["bf16", "fp16", "fp32"]
    proc = subprocess.run([sys.executable, "-c", COMPILE_SCRIPT, *dtypes], capture_output=True, text=True, env=env,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split("\n")[:3] == [f"compiled {dt}" for dt in dtypes]


# --- the model through the kernels ---------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_model_through_the_kernels_matches_the_cpu_path(
    tlo: ModuleType, tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype
) -> None:
    """`LlamaStage` with every layer step on the Triton kernels (interpreted here, as on CUDA they run
    compiled) against the CPU path: a 10-token prefill, then two decode steps."""
    from chariot.kernels import AttentionMetadata
    from chariot.worker.model.llama import allocate_kv_caches
    from chariot.worker.model.loader import load_stage

    stage = load_stage(tiny_model_dir, (0, 2), dtype, progress=False, cpu_linears=False)
    ids = torch.arange(5, 17)

    def run() -> torch.Tensor:
        caches = allocate_kv_caches(stage.config, 2, 3, 8, dtype)
        logits = []
        for start, end in ((0, 10), (10, 11), (11, 12)):
            pos = torch.arange(start, end)
            meta = AttentionMetadata(
                query_start_loc=torch.tensor([0, end - start], dtype=torch.int32),
                seq_lens=torch.tensor([end], dtype=torch.int32),
                block_tables=torch.tensor([[2, 0]], dtype=torch.int32),
                slot_mapping=torch.tensor([2, 0])[pos // 8] * 8 + pos % 8,
                query_lens=(end - start,), seq_lens_list=(end,), num_decodes=int(end - start == 1),
            )
            with torch.inference_mode():
                logits.append(stage.compute_logits(stage(pos, caches, meta, input_ids=ids[start:end])[-1:]))
        return torch.cat(logits)

    cpu_path = run()
    kernels_taken: list[str] = []
    monkeypatch.setattr(layer_ops, "fused_on", lambda tensor: kernels_taken.append(str(tensor.dtype)) or True)
    monkeypatch.setattr(layer_ops, "_triton", lambda: tlo)
    fused = run()
    assert len(kernels_taken) >= 3 * 2 * 4  # every step of every layer, in each of the three passes
    print("max |fused - cpu path|:", float((fused - cpu_path).abs().max()), "of", float(cpu_path.abs().max()))
    tolerance = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(fused, cpu_path, atol=tolerance * float(cpu_path.abs().max()), rtol=0)
    assert torch.equal(fused.argmax(-1), cpu_path.argmax(-1))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_llama3_8b_shapes_compiled_on_cuda(tlo: ModuleType, dtype: torch.dtype) -> None:
    """Each kernel at Llama-3-8B's widths (hidden 4096, MLP 14,336, 32 + 8 heads of 128), 37 tokens,
    compiled, against eager PyTorch on the GPU."""
    tokens, hidden, width, heads, kv_heads, head_dim = 37, 4096, 14336, 32, 8, 128
    x, residual = random(tokens, hidden, dtype=dtype, seed=20), random(tokens, hidden, dtype=dtype, seed=21)
    weight = random(hidden, dtype=dtype, seed=22)
    summed = x + residual
    normed, _ = tlo.add_rms_norm(x, residual, weight, EPS)
    assert torch.equal(x, summed)
    assert_close(normed, eager_rms_norm(summed, weight))
    gate_up = random(tokens, 2 * width, dtype=dtype, seed=23, scale=3.0)
    gate, up = gate_up.chunk(2, dim=-1)
    assert_close(tlo.silu_and_mul(gate_up), F.silu(gate) * up)
    q, k, v, cos, sin = rope_case(tokens, heads, kv_heads, head_dim, dtype, seed=24)
    want_q, want_k = (reference.rope(t, cos.unsqueeze(1), sin.unsqueeze(1)) for t in (q, k))
    k_cache, v_cache = caches(kv_heads, head_dim, dtype, blocks=8, block_size=16)
    ref_k_cache, ref_v_cache = caches(kv_heads, head_dim, dtype, blocks=8, block_size=16)
    slots = torch.randperm(8 * 16, generator=torch.Generator().manual_seed(25))[:tokens].to(DEVICE)
    q_before, k_before = q.clone(), k.clone()
    tlo.rope_write_kv(q, k, v, cos, sin, k_cache, v_cache, slots)
    # Compiled for the GPU, the kernel's products need not round as eager's separate multiplies do (the
    # compiler may fuse a multiply into the add): one product unrounded, then the result rounded, is
    # within three units of the larger product; any share of elements may differ by that much.
    assert_rotated_close(q, want_q, q_before, cos, sin, max_share=1.0, ulps=3.01)
    assert_rotated_close(k, want_k, k_before, cos, sin, max_share=1.0, ulps=3.01)
    reference.write_kv(k, v, ref_k_cache, ref_v_cache, slots)
    assert same_bits(k_cache, ref_k_cache) and same_bits(v_cache, ref_v_cache)
