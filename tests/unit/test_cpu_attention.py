"""The opt-in C++ CPU attention backend against the PyTorch reference and fp32 SDPA, over decodes,
prefill chunks with and without cached context, mixed batches, GQA groups, block sizes and
NaN-poisoned unused cache slots. The kernel compiles on first use (about a minute, cached).

Both builds are checked wherever the tests run: the native one (16-lane one-token path and 28-
accumulator panels on an AVX-512 machine) and the 256-bit one an AVX2 machine gets
(`CHARIOT_VECTOR_256`, a wrapper source that includes the kernel)."""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from chariot.kernels import reference, select_backend
from chariot.kernels.attention import AttentionMetadata, empty_kv_cache
from chariot.kernels.cpu_attention import (
    SOURCE,
    amx_prompts,
    amx_tiles,
    bf16_dot_tiles,
    load_kernel,
    paged_attention,
    prompt_route,
)
from tests.kernel_builds import vector_256_source

pytestmark = pytest.mark.slow  # the first test in a fresh cache compiles the extension


@pytest.fixture(scope="module", params=["native", "256-bit"])
def kernel(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Callable[..., None]:
    """The kernel as built for this CPU, or as built for a 256-bit (AVX2) one."""
    if request.param == "native":
        return load_kernel()
    return load_kernel(vector_256_source(SOURCE, tmp_path_factory.mktemp("avx2")))


def make_case(q_lens: list[int], ctx: list[int], heads: int, kv_heads: int, dim: int, block: int,
              dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, AttentionMetadata]:
    gen = torch.Generator().manual_seed(seed)
    seq_lens = [c + q for c, q in zip(ctx, q_lens, strict=True)]
    blocks_per = [-(-s // block) for s in seq_lens]
    num_blocks = sum(blocks_per) + 3
    perm = torch.randperm(num_blocks, generator=gen)
    tables = torch.zeros(len(q_lens), max(blocks_per), dtype=torch.int32)
    used = 0
    for i, n in enumerate(blocks_per):
        tables[i, :n] = perm[used : used + n]
        used += n
    k_cache = torch.full((num_blocks, block, kv_heads, dim), float("nan"), dtype=dtype)
    v_cache = torch.full_like(k_cache, float("nan"))
    for i, s in enumerate(seq_lens):  # only real positions get data; the rest stays NaN
        for p in range(s):
            b, o = int(tables[i, p // block]), p % block
            k_cache[b, o] = torch.randn(kv_heads, dim, generator=gen).to(dtype)
            v_cache[b, o] = torch.randn(kv_heads, dim, generator=gen).to(dtype)
    query = torch.randn(sum(q_lens), heads, dim, generator=gen).to(dtype)
    starts = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    slots = [int(tables[i, p // block]) * block + p % block
             for i, (c, q) in enumerate(zip(ctx, q_lens, strict=True)) for p in range(c, c + q)]
    num_decodes = next((i for i, q in enumerate(q_lens) if q != 1), len(q_lens))
    meta = AttentionMetadata(starts, torch.tensor(seq_lens, dtype=torch.int32), tables, torch.tensor(slots),
                             tuple(q_lens), tuple(seq_lens), num_decodes)
    return query, k_cache, v_cache, meta


def sdpa_oracle(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                scale: float) -> torch.Tensor:
    """fp32 SDPA per sequence over its contiguous (unpaged) context."""
    out = torch.empty_like(query, dtype=torch.float32)
    block = k_cache.shape[1]
    group = query.shape[1] // k_cache.shape[2]
    for i, (q_len, s_len) in enumerate(zip(meta.query_lens, meta.seq_lens_list, strict=True)):
        pos = torch.arange(s_len)
        blocks, offsets = meta.block_tables[i].long()[pos // block], pos % block
        k = k_cache[blocks, offsets].float().repeat_interleave(group, 1).transpose(0, 1)
        v = v_cache[blocks, offsets].float().repeat_interleave(group, 1).transpose(0, 1)
        start = int(meta.query_start_loc[i])
        q = query[start : start + q_len].float().transpose(0, 1)
        mask = torch.arange(s_len).view(1, -1) <= torch.arange(s_len - q_len, s_len).view(-1, 1)
        attended = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
        out[start : start + q_len] = attended.transpose(0, 1)
    return out


CASES = {
    "decodes": ([1, 1, 1], [0, 15, 40]),
    "prefill-empty-context": ([23], [0]),
    "prefill-chunk-after-context": ([17, 5], [16, 33]),
    "mixed": ([1, 1, 9, 1], [7, 31, 0, 2]),  # decode lengths after a chunk exercise the general path
    "single-token-prompt": ([1], [0]),
    "long-chunk-across-tiles": ([40], [21]),
    "decodes-across-tiles": ([1, 1, 1], [63, 130, 257]),  # the next key tile is prefetched while one computes
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize(("heads", "kv_heads"), [(4, 4), (4, 2), (8, 2)])
@pytest.mark.parametrize(("dim", "block"), [(64, 16), (128, 8), (64, 32), (64, 128)])
def test_matches_reference_and_sdpa_fp32(case: str, heads: int, kv_heads: int, dim: int, block: int,
                                         kernel: Callable[..., None]) -> None:
    q_lens, ctx = CASES[case]
    query, k, v, meta = make_case(q_lens, ctx, heads, kv_heads, dim, block, torch.float32, seed=len(case) + dim)
    scale = 1 / math.sqrt(dim)
    ours = paged_attention(query, k, v, meta, scale, kernel=kernel)
    assert not ours.isnan().any()
    torch.testing.assert_close(ours, sdpa_oracle(query, k, v, meta, scale), atol=2e-5, rtol=1e-5)
    if meta.num_decodes == sum(1 for q in q_lens if q == 1):  # the reference wants decodes first
        torch.testing.assert_close(ours, reference.paged_attention(query, k, v, meta, scale), atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("case", ["decodes", "decodes-across-tiles", "mixed", "single-token-prompt"])
@pytest.mark.parametrize(("heads", "kv_heads", "dim"),
                         [(16, 2, 64), (6, 2, 72), (16, 1, 32), (4, 2, 20), (2, 2, 48), (32, 2, 64)])
def test_one_token_path_matches_sdpa(case: str, heads: int, kv_heads: int, dim: int,
                                     kernel: Callable[..., None]) -> None:
    """One-token tiles for GQA groups of 8, 3, 16, 1 and 16 (the group path where the group divides
    the vector width and head_dim is a multiple of it, else head_dim in 8 lanes), head_dims that are
    not a multiple of 32 or 16 (a tail of vectors: 72, 48), and head_dim 20, which takes the general
    path."""
    q_lens, ctx = CASES[case]
    query, k, v, meta = make_case(q_lens, ctx, heads, kv_heads, dim, 16, torch.float32, seed=dim + heads)
    ours = paged_attention(query, k, v, meta, 1 / math.sqrt(dim), kernel=kernel)
    assert not ours.isnan().any()
    torch.testing.assert_close(ours, sdpa_oracle(query, k, v, meta, 1 / math.sqrt(dim)), atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("case", list(CASES))
def test_head_major_cache_matches_sdpa(case: str) -> None:
    """The engine's CPU cache (`empty_kv_cache`: a permuted view, KV heads outermost in each block)
    gives the same attention, NaN-poisoned unused slots included."""
    q_lens, ctx = CASES[case]
    query, k, v, meta = make_case(q_lens, ctx, 8, 2, 64, 16, torch.float32, seed=len(case))
    hk, hv = (empty_kv_cache(*k.shape, torch.float32) for _ in range(2))
    hk.copy_(k), hv.copy_(v)
    assert hk.stride() != k.stride() and hk.stride(-1) == 1
    ours = paged_attention(query, hk, hv, meta, 0.125)
    assert not ours.isnan().any()
    torch.testing.assert_close(ours, sdpa_oracle(query, k, v, meta, 0.125), atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(ours, paged_attention(query, k, v, meta, 0.125), atol=1e-6, rtol=1e-6)


BF16_CASES = {
    **CASES,
    "odd-key-tiles": ([37], [98]),  # tiles of 64 and 71 keys: a key pair with one real key at each tile's end
    "rows-not-a-whole-vector": ([3, 5, 2], [0, 70, 9]),  # 3 × group rows: padded rows in the last vector
    "long-chunk-many-tiles": ([130], [200]),
}


@pytest.mark.parametrize("case", list(BF16_CASES))
@pytest.mark.parametrize(("heads", "kv_heads", "dim"), [(4, 4, 64), (8, 2, 64), (6, 2, 40), (4, 1, 80), (2, 2, 128)])
def test_bf16_tiles_match_fp32_sdpa(case: str, heads: int, kv_heads: int, dim: int,
                                    kernel: Callable[..., None]) -> None:
    """bf16 query and cache over every case, GQA groups of 1 to 4 and head_dims that are not a
    multiple of 16 or 32 (40, 80): on an AVX512-BF16 CPU the native build's multi-token tiles run on
    bf16 dot products with probabilities rounded to bf16. The error stays within a few roundings of
    the exact result to bf16 (fp32 SDPA over the same bf16 inputs), and NaN in unused slots never
    reaches the output."""
    q_lens, ctx = BF16_CASES[case]
    query, k, v, meta = make_case(q_lens, ctx, heads, kv_heads, dim, 16, torch.bfloat16, seed=dim + heads + len(case))
    scale = 1 / math.sqrt(dim)
    ours = paged_attention(query, k, v, meta, scale, kernel=kernel)
    assert ours.dtype == torch.bfloat16 and not ours.isnan().any()
    exact = sdpa_oracle(query, k, v, meta, scale)
    rounding = (exact.bfloat16().float() - exact).abs().max()
    assert (ours.float() - exact).abs().max() <= 3 * rounding
    torch.testing.assert_close(ours.float(), exact, atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize("case", list(BF16_CASES))
@pytest.mark.parametrize(("heads", "kv_heads", "dim"), [(4, 4, 64), (8, 2, 64), (4, 1, 80)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_prompt_chunks_through_flash_sdpa_match_fp32_sdpa(case: str, heads: int, kv_heads: int, dim: int,
                                                          dtype: torch.dtype) -> None:
    """The route an AMX machine takes for bf16/fp16 prompt chunks (`prompts="sdpa"`, forced here
    on any CPU): decodes on the kernel, each chunk through PyTorch's SDPA over its context gathered
    from the paged cache. Within a few roundings of fp32 SDPA, and NaN in unused slots (past a
    sequence's end in its last block, other sequences' blocks) never reaches the output."""
    q_lens, ctx = BF16_CASES[case]
    query, k, v, meta = make_case(q_lens, ctx, heads, kv_heads, dim, 16, dtype, seed=dim + heads + len(case))
    scale = 1 / math.sqrt(dim)
    ours = paged_attention(query, k, v, meta, scale, prompts="sdpa")
    assert ours.dtype == dtype and not ours.isnan().any()
    exact = sdpa_oracle(query, k, v, meta, scale)
    rounding = (exact.to(dtype).float() - exact).abs().max()
    assert (ours.float() - exact).abs().max() <= 4 * rounding
    kernel_only = paged_attention(query, k, v, meta, scale, prompts="kernel")
    decodes = int(meta.query_start_loc[meta.num_decodes])
    assert torch.equal(ours[:decodes], kernel_only[:decodes])  # decodes never leave the kernel


def test_prompt_chunks_leave_the_kernel_only_in_reduced_precision_on_amx_tiles() -> None:
    """float32 chunks stay on the kernel everywhere; on an AMX CPU bf16 chunks take the tile path
    where the shapes fit (head_dim a multiple of 32, blocks a multiple of 64 tokens) and flash SDPA where they do
    not, fp16 chunks flash SDPA; without AMX everything stays on the kernel."""
    amx = "amx_tile" in Path("/proc/cpuinfo").read_text()
    assert amx_tiles() == amx
    assert prompt_route(torch.float32, 64, 128) == "kernel"
    assert prompt_route(torch.float16, 64, 128) == ("sdpa" if amx else "kernel")
    assert prompt_route(torch.bfloat16, 64, 128) == ("amx" if amx else "kernel")
    assert prompt_route(torch.bfloat16, 64, 256) == ("amx" if amx else "kernel")
    assert prompt_route(torch.bfloat16, 64, 16) == ("sdpa" if amx else "kernel")  # not whole 64-key steps
    assert prompt_route(torch.bfloat16, 80, 128) == ("sdpa" if amx else "kernel")  # head_dim not a multiple of 32
    with pytest.raises(ValueError, match="prompts must be one of kernel, sdpa, amx"):
        paged_attention(*make_case([3], [0], 2, 2, 64, 16, torch.float32, seed=0), 0.125, prompts="tiles")


AMX_CASES = {
    **BF16_CASES,
    "chunk-512-after-1536": ([512], [1536]),  # an engine's late chunk: 28 key steps, the last on the diagonal
    "chunks-and-decodes": ([1, 1, 300, 64, 7], [500, 3, 0, 700, 129]),
    "chunk-ending-inside-a-step": ([45], [211]),  # the item's last key mid-step: V rows past it read as zeros
}


@pytest.mark.parametrize("case", list(AMX_CASES))
@pytest.mark.parametrize(("heads", "kv_heads", "dim"), [(16, 4, 64), (8, 2, 128), (4, 4, 64), (8, 1, 96)])
@pytest.mark.parametrize(("block", "layout"), [(128, "engine"), (128, "contiguous"), (64, "engine")])
def test_prompt_chunks_on_amx_tiles_match_fp32_sdpa(case: str, heads: int, kv_heads: int, dim: int, block: int,
                                                    layout: str) -> None:
    """The tile path for bf16 prompt chunks (`prompts="amx"`): within a few roundings of fp32 SDPA over
    the same bf16 inputs, on the engine's head-major cache and a contiguous one, GQA groups of 1 to 8,
    head_dims 64, 96 and 128; NaN in unused slots (past a sequence's end, other sequences' blocks)
    never reaches the output, and decodes, which stay on the kernel, are the kernel's bit for bit.
    Where this CPU or build has no tiles the route refuses a batch with prompt chunks with an error
    naming what it needs; a batch of decodes alone never reaches it and runs on the kernel."""
    q_lens, ctx = AMX_CASES[case]
    query, k, v, meta = make_case(q_lens, ctx, heads, kv_heads, dim, block, torch.bfloat16, seed=dim + heads)
    if layout == "engine":
        k, v = (empty_kv_cache(k.shape[0], block, kv_heads, dim, torch.bfloat16).copy_(t) for t in (k, v))
    scale = 1 / math.sqrt(dim)
    if not amx_prompts(torch.bfloat16, dim, block):
        assert not amx_tiles()  # on an AMX CPU every shape here is one the tile path takes
        if meta.num_decodes == meta.num_seqs:
            assert torch.equal(paged_attention(query, k, v, meta, scale, prompts="amx"),
                               paged_attention(query, k, v, meta, scale, prompts="kernel"))
            return
        with pytest.raises(RuntimeError, match="AMX tiles"):
            paged_attention(query, k, v, meta, scale, prompts="amx")
        return
    ours = paged_attention(query, k, v, meta, scale, prompts="amx")
    assert ours.dtype == torch.bfloat16 and not ours.isnan().any()
    exact = sdpa_oracle(query, k, v, meta, scale)
    rounding = (exact.bfloat16().float() - exact).abs().max()
    assert (ours.float() - exact).abs().max() <= 4 * rounding
    decodes = int(meta.query_start_loc[meta.num_decodes])
    assert torch.equal(ours[:decodes], paged_attention(query, k, v, meta, scale, prompts="kernel")[:decodes])


def test_the_amx_prompt_path_checks_its_metadata() -> None:
    """Bad metadata is refused before anything is read or written, on the tile path as on the kernel
    (checked first, so in every build)."""
    query, k, v, meta = make_case([20], [30], 4, 2, 64, 128, torch.bfloat16, seed=3)
    bad = AttentionMetadata(meta.query_start_loc, meta.seq_lens, torch.full_like(meta.block_tables, 999),
                            meta.slot_mapping, meta.query_lens, meta.seq_lens_list, meta.num_decodes)
    with pytest.raises(RuntimeError, match="out of range"):
        paged_attention(query, k, v, bad, 0.125, prompts="amx")


@pytest.mark.parametrize("case", ["decodes-across-tiles", "odd-key-tiles", "long-chunk-many-tiles", "mixed"])
@pytest.mark.parametrize(("heads", "kv_heads"), [(8, 1), (16, 1), (16, 4)])
@pytest.mark.parametrize("block", [5, 24])
def test_bf16_blocks_that_do_not_divide_a_key_tile(case: str, heads: int, kv_heads: int, block: int,
                                                   kernel: Callable[..., None]) -> None:
    """Block sizes that do not divide the 64-key tile, so tiles start and end inside blocks (the
    kernel walks (block, slot) from each tile's first key), with GQA groups of 8, 16 and 4 on the
    one-token group path (whole pairs of keys rounded to bf16 sixteen at a time, an odd key last)."""
    q_lens, ctx = BF16_CASES[case]
    query, k, v, meta = make_case(q_lens, ctx, heads, kv_heads, 64, block, torch.bfloat16, seed=heads + block)
    ours = paged_attention(query, k, v, meta, 0.125, kernel=kernel)
    assert ours.dtype == torch.bfloat16 and not ours.isnan().any()
    exact = sdpa_oracle(query, k, v, meta, 0.125)
    rounding = (exact.bfloat16().float() - exact).abs().max()
    assert (ours.float() - exact).abs().max() <= 3 * rounding


def test_bf16_dot_tiles_where_the_cpu_has_them() -> None:
    """The native build takes the bf16 dot-product path exactly when this CPU has AVX512-BF16 (so
    the test above covers it on such a machine); the 256-bit build, as an AVX2 machine gets, never."""
    flags = set(Path("/proc/cpuinfo").read_text().split()) if Path("/proc/cpuinfo").exists() else set()
    assert bf16_dot_tiles() == ("avx512_bf16" in flags and "avx512bw" in flags)


def test_the_256_bit_build_never_takes_bf16_dot_tiles(tmp_path: Path) -> None:
    assert not bf16_dot_tiles(vector_256_source(SOURCE, tmp_path))


BF16_DECODES = {
    "within-one-chunk": ([1, 1, 1], [0, 15, 200]),
    "tile-boundaries": ([1, 1, 1, 1], [62, 63, 64, 127]),  # 63, 64, 65 and 128 keys: 64-key tiles
    "long-and-short": ([1, 1], [1300, 3]),
    "decodes-then-a-chunk": ([1, 1, 20], [300, 40, 70]),
}


@pytest.mark.parametrize("case", list(BF16_DECODES))
@pytest.mark.parametrize(("heads", "kv_heads", "dim"),
                         [(4, 4, 64), (4, 2, 32), (16, 4, 64), (16, 2, 96), (16, 1, 128), (16, 16, 64)])
@pytest.mark.parametrize("block", [16, 128, 8])
def test_bf16_decodes_match_fp32_sdpa(case: str, heads: int, kv_heads: int, dim: int, block: int,
                                      kernel: Callable[..., None]) -> None:
    """bf16 decodes on the one-token paths: GQA groups of 1, 2, 4, 8 and 16, head_dims 32 to 128,
    contexts of up to 1,300 keys across many key tiles, block sizes 16 (a GPU engine's default), 128 (a
    CPU engine's) and 8, a batch with a prompt chunk after its decodes. Within three bf16 roundings of
    fp32 SDPA, and no NaN from unused slots."""
    q_lens, ctx = BF16_DECODES[case]
    query, k, v, meta = make_case(q_lens, ctx, heads, kv_heads, dim, block, torch.bfloat16,
                                  seed=heads + dim + block + len(case))
    scale = 1 / math.sqrt(dim)
    ours = paged_attention(query, k, v, meta, scale, kernel=kernel, prompts="kernel")
    assert ours.dtype == torch.bfloat16 and not ours.isnan().any()
    exact = sdpa_oracle(query, k, v, meta, scale)
    rounding = (exact.bfloat16().float() - exact).abs().max()
    assert (ours.float() - exact).abs().max() <= 3 * rounding


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_reduced_precision_matches_fp32_sdpa(dtype: torch.dtype) -> None:
    query, k, v, meta = make_case([1, 1, 12], [20, 3, 9], 8, 2, 64, 16, dtype, seed=7)
    ours = paged_attention(query, k, v, meta, 0.125)
    assert ours.dtype == dtype
    torch.testing.assert_close(ours.float(), sdpa_oracle(query, k, v, meta, 0.125), atol=3e-2, rtol=3e-2)


@pytest.mark.parametrize(("q_dtype", "kv_dtype"), [(torch.bfloat16, torch.float32), (torch.float16, torch.bfloat16),
                                                  (torch.float32, torch.bfloat16)])
@pytest.mark.parametrize("case", ["prefill-empty-context", "long-chunk-across-tiles", "mixed"])
def test_a_query_in_another_dtype_than_the_cache(q_dtype: torch.dtype, kv_dtype: torch.dtype, case: str,
                                                 kernel: Callable[..., None]) -> None:
    """A query whose dtype differs from the cache's takes the general tile path, whose query and output
    rows move 16 at a time through register transposes on AVX-512 (each dtype's own load and store),
    the rows that do not fill a vector one at a time: within a rounding or two of the query's dtype of
    fp32 SDPA over the same values, NaN in unused slots kept out."""
    q_lens, ctx = CASES[case]
    query, k, v, meta = make_case(q_lens, ctx, 8, 2, 64, 16, kv_dtype, seed=len(case))
    query = query.to(q_dtype)
    ours = paged_attention(query, k, v, meta, 0.125, kernel=kernel)
    assert ours.dtype == q_dtype and not ours.isnan().any()
    exact = sdpa_oracle(query, k, v, meta, 0.125)
    rounding = (exact.to(q_dtype).float() - exact).abs().max()
    assert (ours.float() - exact).abs().max() <= 2 * rounding + 1e-5


def test_selected_by_name(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CHARIOT_ATTENTION_BACKEND", raising=False)
    try:
        assert select_backend("cpu") == "cpu"
    finally:
        select_backend()
