"""Triton paged-attention kernels against the PyTorch reference backend and SDPA on unpaged data.

Without a GPU the kernels run under the Triton interpreter (numpy on CPU). Triton fixes a jit
function's mode when it is decorated: its own helpers (`tl.max`, `tl.sum`, ...) when `triton` is first
imported, the backend's kernels when `chariot.kernels.triton_attention` is. tests/conftest.py sets
`TRITON_INTERPRET=1` (only where CUDA is absent) before anything imports triton; the module-scoped
`tt` fixture imports the backend lazily, re-imports it if something imported it earlier in compiled
mode, and fails with a clear message if `triton` itself was imported before the variable was set.
Triton is a test dependency: if it is missing, these tests fail rather than skip.
On a GPU machine the same small cases run compiled on CUDA (`DEVICE`), and `TestOnCuda` (marker
`gpu`, deselected without CUDA) adds Llama-3-8B-sized shapes and offsets beyond int32.

Every batch is built the way the executor builds one: decodes first, then prefill chunks whose
cached context may be empty or end anywhere inside a block; block tables drawn from a shuffled pool
(non-contiguous, with a padding column); the cache starts filled with NaN, so any read of a slot that
was never written (past seq_len in a sequence's last block, padding entries, other blocks) shows up.
"""

from __future__ import annotations

import importlib
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass, replace
from types import ModuleType

import pytest
import torch
import torch.nn.functional as F

import chariot.kernels as kernels
from chariot.kernels import reference
from chariot.kernels.attention import AttentionMetadata

MODULE = "chariot.kernels.triton_attention"
CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"  # the small cases run compiled on a GPU machine, interpreted elsewhere
FILL = float("nan")
# max |out - expected| must stay within tol × max |expected| (16-bit) or atol + rtol·|expected| (fp32)
REL_TOL = {torch.float16: 1e-2, torch.bfloat16: 2e-2}
FP32_TOL = 1e-4
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


@pytest.fixture(scope="module")
def tt() -> ModuleType:
    """The Triton backend module, interpreted on CPU when there is no GPU (see module docstring)."""
    module = importlib.import_module(MODULE)
    if not CUDA and not module._INTERPRETED:  # imported earlier without the interpreter
        module = importlib.reload(module)
    if module._MIXED_MODES:
        pytest.fail("triton was imported before TRITON_INTERPRET=1 was set; the interpreter cannot run the kernels")
    return module


# --- batch construction ------------------------------------------------------------------------


@dataclass(frozen=True)
class Spec:
    seqs: tuple[tuple[int, int], ...]  # (cached context, new tokens), decodes first
    num_decodes: int
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 64
    dtype: torch.dtype = torch.float32
    block_size: int = 16
    seed: int = 0


@dataclass
class Batch:
    query: torch.Tensor  # [num_tokens, heads, d]
    key: torch.Tensor  # new tokens' K [num_tokens, kv_heads, d]
    value: torch.Tensor
    k_cache: torch.Tensor  # context already written, new tokens not yet
    v_cache: torch.Tensor
    meta: AttentionMetadata
    full: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]  # per sequence: q (new), k, v (whole)


MIXED = ((1, 1), (37, 1), (0, 1), (0, 23), (13, 20), (16, 16))  # decodes, 1-token prompt, chunks
SCENARIOS: dict[str, tuple[tuple[tuple[int, int], ...], int]] = {
    "mixed": (MIXED, 2),
    "decode": (((63, 1), (16, 1), (1, 1), (30, 1)), 4),
    "prefill": (((0, 40), (24, 9), (7, 1)), 0),
    "first_chunks": (((0, 17), (0, 1), (0, 32)), 0),
}


def random_seqs(seed: int) -> tuple[tuple[tuple[int, int], ...], int]:
    gen = torch.Generator().manual_seed(seed)

    def draw(lo: int, hi: int) -> int:
        return int(torch.randint(lo, hi + 1, (1,), generator=gen))

    decodes = [(draw(1, 48), 1) for _ in range(draw(0, 2))]
    prefills = [(draw(0, 40), draw(1, 24)) for _ in range(draw(0 if decodes else 1, 2))]
    return tuple(decodes + prefills), len(decodes)


def _tables(spec: Spec, gen: torch.Generator) -> tuple[list[list[int]], int]:
    needed = [math.ceil((c + q) / spec.block_size) for c, q in spec.seqs]
    num_blocks = sum(needed) + 3  # spare blocks stay NaN
    pool = torch.randperm(num_blocks, generator=gen).tolist()
    tables, start = [], 0
    for n in needed:
        tables.append(pool[start : start + n])
        start += n
    return tables, num_blocks


def _slots(table: list[int], positions: range, block_size: int) -> list[int]:
    return [table[p // block_size] * block_size + p % block_size for p in positions]


def _metadata(spec: Spec, tables: list[list[int]], device: str) -> AttentionMetadata:
    q_lens = tuple(q for _, q in spec.seqs)
    seq_lens = tuple(c + q for c, q in spec.seqs)
    width = max(len(t) for t in tables) + 1  # padding column (0 = some other sequence's block)
    slots = [
        s for (c, q), t in zip(spec.seqs, tables, strict=True) for s in _slots(t, range(c, c + q), spec.block_size)
    ]
    starts = [0]
    for q in q_lens:
        starts.append(starts[-1] + q)

    def i32(values: Sequence[object]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int32, device=device)

    return AttentionMetadata(
        query_start_loc=i32(starts),
        seq_lens=i32(seq_lens),
        block_tables=i32([t + [0] * (width - len(t)) for t in tables]),
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        query_lens=q_lens,
        seq_lens_list=seq_lens,
        num_decodes=spec.num_decodes,
    )


def make_batch(spec: Spec, device: str = DEVICE) -> Batch:
    """Random Q/K/V per sequence; context K/V written to the NaN-filled cache, new tokens not yet."""
    gen = torch.Generator().manual_seed(spec.seed)
    tables, num_blocks = _tables(spec, gen)
    shape = (num_blocks, spec.block_size, spec.kv_heads, spec.head_dim)
    k_cache = torch.full(shape, FILL, dtype=spec.dtype, device=device)
    v_cache = torch.full(shape, FILL, dtype=spec.dtype, device=device)
    full = []
    for (ctx, q_len), table in zip(spec.seqs, tables, strict=True):
        n = ctx + q_len
        q, k, v = (
            torch.randn(rows, h, spec.head_dim, generator=gen).to(device, spec.dtype)
            for rows, h in ((q_len, spec.heads), (n, spec.kv_heads), (n, spec.kv_heads))
        )
        full.append((q, k, v))
        slots = torch.tensor(_slots(table, range(ctx), spec.block_size), dtype=torch.int64, device=device)
        reference.write_kv(k[:ctx], v[:ctx], k_cache, v_cache, slots)
    return Batch(
        query=torch.cat([q for q, _, _ in full]),
        key=torch.cat([k[c:] for (c, _), (_, k, _) in zip(spec.seqs, full, strict=True)]),
        value=torch.cat([v[c:] for (c, _), (_, _, v) in zip(spec.seqs, full, strict=True)]),
        k_cache=k_cache,
        v_cache=v_cache,
        meta=_metadata(spec, tables, device),
        full=full,
    )


def sdpa_oracle(batch: Batch) -> torch.Tensor:
    """fp32 SDPA per sequence on the unpaged K/V: the chunk's queries sit at the context's end."""
    outs = []
    for q, k, v in batch.full:
        ctx = k.shape[0] - q.shape[0]
        group = q.shape[1] // k.shape[1]
        k, v = (x.float().repeat_interleave(group, dim=1).transpose(0, 1) for x in (k, v))
        q_pos = torch.arange(q.shape[0], device=q.device).view(-1, 1) + ctx
        mask = torch.arange(k.shape[1], device=q.device).view(1, -1) <= q_pos
        o = F.scaled_dot_product_attention(q.float().transpose(0, 1), k, v, attn_mask=mask, scale=_scale(q))
        outs.append(o.transpose(0, 1))
    return torch.cat(outs)


def _scale(query: torch.Tensor) -> float:
    return 1.0 / math.sqrt(query.shape[-1])


def assert_close(out: torch.Tensor, expected: torch.Tensor) -> None:
    assert not out.isnan().any(), "NaN in output: an unused cache slot was read"
    if out.dtype == torch.float32:
        torch.testing.assert_close(out.cpu(), expected.float().cpu(), atol=FP32_TOL, rtol=FP32_TOL)
        return
    err = (out.float() - expected.float()).abs().max().item()
    bound = REL_TOL[out.dtype] * expected.float().abs().max().item()
    assert err <= bound, f"max abs error {err:.3g} > {bound:.3g}"


def check_attention(
    tt: ModuleType, batch: Batch, tiles: object | None = None, splits: int | None = None
) -> torch.Tensor:
    """Write the new K/V with the Triton kernel, attend, compare with the reference and with SDPA."""
    tt.write_kv(batch.key, batch.value, batch.k_cache, batch.v_cache, batch.meta.slot_mapping)
    scale = _scale(batch.query)
    out = tt.paged_attention(batch.query, batch.k_cache, batch.v_cache, batch.meta, scale, tiles=tiles, splits=splits)
    assert out.shape == batch.query.shape and out.dtype == batch.query.dtype
    assert_close(out, reference.paged_attention(batch.query, batch.k_cache, batch.v_cache, batch.meta, scale))
    assert_close(out, sdpa_oracle(batch))
    return out


# --- attention vs reference and SDPA -------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(("heads", "kv_heads"), [(4, 4), (4, 2), (4, 1)], ids=["mha", "gqa2", "gqa4"])
@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_scenarios(tt: ModuleType, scenario: str, heads: int, kv_heads: int, dtype: torch.dtype) -> None:
    seqs, num_decodes = SCENARIOS[scenario]
    check_attention(tt, make_batch(Spec(seqs, num_decodes, heads, kv_heads, 64, dtype, seed=heads + kv_heads)))


@pytest.mark.parametrize("seed", range(6))
def test_random_lengths(tt: ModuleType, seed: int) -> None:
    seqs, num_decodes = random_seqs(seed)
    heads, kv_heads = [(4, 4), (4, 2), (4, 1)][seed % 3]
    dtype = DTYPES[seed % 3]
    check_attention(tt, make_batch(Spec(seqs, num_decodes, heads, kv_heads, 64, dtype, seed=seed)))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_head_dim_128(tt: ModuleType, dtype: torch.dtype) -> None:
    check_attention(tt, make_batch(Spec(MIXED, 2, 4, 1, 128, dtype, seed=7)))


@pytest.mark.parametrize(
    ("block_size", "head_dim", "heads", "kv_heads"),
    [(1, 16, 4, 2), (4, 32, 6, 2), (8, 80, 4, 4), (32, 64, 8, 1), (5, 24, 6, 3)],
)
def test_other_block_sizes_head_dims_and_groups(
    tt: ModuleType, block_size: int, head_dim: int, heads: int, kv_heads: int
) -> None:
    """Non-power-of-two group/head_dim/block_size are padded or masked, not rejected."""
    check_attention(tt, make_batch(Spec(MIXED, 2, heads, kv_heads, head_dim, torch.float32, block_size, seed=3)))


@pytest.mark.parametrize(("block_q", "block_m", "block_n"), [(1, 16, 16), (3, 16, 16), (5, 32, 32), (16, 64, 16)])
def test_tile_shapes_agree(tt: ModuleType, block_q: int, block_m: int, block_n: int) -> None:
    """Several query tiles per chunk and several KV tiles per context (online softmax across tiles)."""
    tiles = tt.TileConfig(block_q, block_m, block_n)
    check_attention(tt, make_batch(Spec(MIXED, 2, 6, 2, 32, torch.float32, seed=block_q)), tiles=tiles)


@pytest.mark.parametrize("seqs", [((0, 5),), ((9, 1),), ((0, 1),)], ids=["prompt", "decode", "one-token"])
def test_single_sequence(tt: ModuleType, seqs: tuple[tuple[int, int], ...]) -> None:
    num_decodes = int(seqs[0][0] > 0 and seqs[0][1] == 1)
    check_attention(tt, make_batch(Spec(seqs, num_decodes, 4, 2, 16, torch.bfloat16, block_size=4)))


def test_empty_batch(tt: ModuleType) -> None:
    empty = torch.empty(0, dtype=torch.int32, device=DEVICE)
    start = torch.zeros(1, dtype=torch.int32, device=DEVICE)
    meta = AttentionMetadata(start, empty, empty.view(0, 1), empty.long(), (), (), 0)
    cache = torch.zeros(2, 4, 1, 16, device=DEVICE)
    out = tt.paged_attention(torch.empty(0, 2, 16, device=DEVICE), cache, cache, meta, 0.25)
    assert out.shape == (0, 2, 16)


def test_nan_in_unused_slots_of_used_blocks_is_ignored(tt: ModuleType) -> None:
    """The last block of every sequence holds NaN past seq_len; the kernel must never read those slots."""
    batch = make_batch(Spec(((5, 1), (0, 3), (14, 7)), 1, dtype=torch.bfloat16, seed=1))
    tt.write_kv(batch.key, batch.value, batch.k_cache, batch.v_cache, batch.meta.slot_mapping)
    for row, seq_len in enumerate(batch.meta.seq_lens_list):
        last_block = int(batch.meta.block_tables[row, (seq_len - 1) // 16])
        assert batch.k_cache[last_block, seq_len % 16 :].isnan().all()
    check_attention(tt, batch)


def test_strided_query_from_fused_projection(tt: ModuleType) -> None:
    batch = make_batch(Spec(MIXED, 2, 4, 2, 32, torch.float32, seed=9))
    fused = torch.cat([batch.query, torch.zeros_like(batch.query)], dim=-1)
    batch.query = fused[..., :32]
    assert not batch.query.is_contiguous()
    check_attention(tt, batch)


def test_query_dtype_differs_from_cache_dtype(tt: ModuleType) -> None:
    """Like the reference, K/V are cast to the query dtype; the output keeps the query dtype."""
    batch = make_batch(Spec(MIXED, 2, 4, 2, 32, torch.float32, seed=4))
    batch.query = batch.query.to(torch.bfloat16)
    tt.write_kv(batch.key, batch.value, batch.k_cache, batch.v_cache, batch.meta.slot_mapping)
    scale = _scale(batch.query)
    out = tt.paged_attention(batch.query, batch.k_cache, batch.v_cache, batch.meta, scale)
    assert out.dtype == torch.bfloat16
    assert_close(out, reference.paged_attention(batch.query, batch.k_cache, batch.v_cache, batch.meta, scale))


# --- split-KV decode (flash-decoding) -------------------------------------------------------------


def decode_seqs(seed: int) -> tuple[tuple[int, int], ...]:
    """Decodes (one of 128-200 positions, two shorter than a split) and a single-token prompt (seq_len 1).

    Every query length is 1, so the batch may split; the split count is forced, so the splits past the
    short sequences' ends (and, at 8 splits of whole 64-position tiles, past the long one's) are empty.
    """
    gen = torch.Generator().manual_seed(seed)

    def draw(lo: int, hi: int) -> int:
        return int(torch.randint(lo, hi + 1, (1,), generator=gen))

    return (draw(128, 200), 1), (draw(1, 40), 1), (draw(1, 40), 1), (0, 1)


SPLIT_CASES = {  # splits, heads, kv_heads, dtype, tiles (block_q, block_m, block_n) or None for the default
    "2-mha-bf16": (2, 4, 4, torch.bfloat16, None),
    "4-gqa2-fp32": (4, 4, 2, torch.float32, None),
    "8-gqa4-fp16": (8, 4, 1, torch.float16, None),
    "8-gqa2-fp32-n16": (8, 4, 2, torch.float32, (1, 16, 16)),  # 16-position tiles: 32-position splits
}


@pytest.mark.parametrize("case", list(SPLIT_CASES))
def test_forced_splits_match_reference_and_sdpa(tt: ModuleType, case: str) -> None:
    splits, heads, kv_heads, dtype, tiles = SPLIT_CASES[case]
    seqs = decode_seqs(splits + 10 * kv_heads)
    batch = make_batch(Spec(seqs, len(seqs) - 1, heads, kv_heads, 64, dtype, seed=splits))
    out = check_attention(tt, batch, tiles=tiles and tt.TileConfig(*tiles), splits=splits)
    unsplit = tt.paged_attention(batch.query, batch.k_cache, batch.v_cache, batch.meta, _scale(batch.query), splits=1)
    assert_close(out, unsplit)


def test_split_kv_never_reads_unused_slots_or_empty_splits(tt: ModuleType, monkeypatch: pytest.MonkeyPatch) -> None:
    """NaN past seq_len in the cache, and NaN in every scratch buffer before the partial pass writes it.

    Contexts end inside blocks and inside splits; the 8-split launch leaves most splits empty, whose
    acc the reducer must ignore (weight 0 and not loaded: 0 × NaN would still be NaN).
    """
    batch = make_batch(Spec(((37, 1), (5, 1), (20, 1)), 3, 4, 2, 32, torch.bfloat16, seed=2))
    for row, seq_len in enumerate(batch.meta.seq_lens_list):
        last_block = int(batch.meta.block_tables[row, (seq_len - 1) // 16])  # the new token's block
        assert batch.k_cache[last_block, seq_len % 16 :].isnan().all()
    empty = torch.empty

    def nan_empty(*size: object, **kwargs: object) -> torch.Tensor:
        t = empty(*size, **kwargs)
        return t.fill_(float("nan")) if t.is_floating_point() else t

    monkeypatch.setattr(torch, "empty", nan_empty)
    monkeypatch.setattr(torch, "empty_like", lambda t, **kw: nan_empty(t.shape, dtype=t.dtype, device=t.device))
    check_attention(tt, batch, tiles=tt.TileConfig(1, 16, 16), splits=8)


def test_long_decode_splits_by_default(tt: ModuleType, monkeypatch: pytest.MonkeyPatch) -> None:
    """One decode over 601 positions: `decode_splits` picks 4 splits; `splits=1` forces one launch."""
    calls: list[object] = []
    split_kv = tt._split_kv_attention

    def spy(*args: object) -> None:
        calls.append(args[6])  # the split count
        split_kv(*args)

    monkeypatch.setattr(tt, "_split_kv_attention", spy)
    batch = make_batch(Spec(((600, 1),), 1, 4, 1, 32, torch.float16, seed=6))
    out = check_attention(tt, batch)
    assert calls == [4]
    single = tt.paged_attention(batch.query, batch.k_cache, batch.v_cache, batch.meta, _scale(batch.query), splits=1)
    assert calls == [4]
    assert_close(out, single)


def test_decode_splits_choices(tt: ModuleType) -> None:
    assert tt.decode_splits(1, 1, 8, 8192, 64) == 64  # batch 1, Llama-3-8B KV heads: 512 programs
    assert tt.decode_splits(1, 1, 8, 1024, 64) == 8
    assert tt.decode_splits(1, 1, 8, 256, 64) == 2
    assert tt.decode_splits(1, 1, 8, 255, 64) == 1  # fewer than two splits' worth of positions
    assert tt.decode_splits(1, 16, 8, 8192, 64) == 4  # 128 pairs: only ×4 stays within the target
    assert tt.decode_splits(1, 32, 8, 4096, 64) == 2
    assert tt.decode_splits(1, 64, 8, 8192, 64) == 1  # 512 programs already fill the GPU
    assert tt.decode_splits(1, 1, 1, 1 << 20, 64) == tt.MAX_SPLITS
    assert tt.decode_splits(2, 1, 8, 8192, 64) == 1  # a prefill chunk: the varlen launch
    assert tt.decode_splits(512, 1, 8, 8192, 64) == 1
    assert tt.decode_splits(0, 0, 8, 0, 64) == 1  # empty batch


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("group", [1, 2, 4, 8, 16])
def test_warm_up_compiles_every_tile_a_batch_can_pick(tt: ModuleType, group: int, dtype: torch.dtype) -> None:
    """The worker's warm-up prefill lengths reach every tile configuration that any prefill chunk
    (up to 4,096 tokens) selects, and its long decode takes the split-KV path at Llama-3-8B's 8 KV
    heads (on a GPU anything else would be compiled inside a request)."""
    from chariot.worker.warmup import WARMUP_LONG_CONTEXT, WARMUP_QUERY_LENGTHS

    reachable = {tt.choose_tiles(n, group, 128, dtype) for n in range(2, 4097)}
    assert {tt.choose_tiles(n, group, 128, dtype) for n in WARMUP_QUERY_LENGTHS} == reachable
    assert tt.decode_splits(1, 1, 8, WARMUP_LONG_CONTEXT, tt.kv_tile(128, dtype)) >= 2


def test_decode_splits_bounded_and_chunks_cover_the_context(tt: ModuleType) -> None:
    for num_seqs in (1, 2, 5, 16, 33, 256):
        for kv_heads in (1, 2, 8):
            for max_seq_len in (1, 255, 512, 1000, 4100, 131072):
                for block_n in (16, 64):
                    splits = tt.decode_splits(1, num_seqs, kv_heads, max_seq_len, block_n)
                    assert 1 <= splits <= tt.MAX_SPLITS and splits & (splits - 1) == 0
                    if splits > 1:
                        assert num_seqs * kv_heads * splits <= tt.SPLIT_TARGET_PROGRAMS
                        assert max_seq_len // splits >= tt.MIN_SPLIT_POSITIONS
                    for forced in (1, 2, 8, 64):
                        chunk = tt.split_chunk(max_seq_len, forced, block_n)
                        assert chunk % block_n == 0 and chunk * forced >= max_seq_len
                        assert (chunk - block_n) * forced < max_seq_len  # the smallest such multiple


@pytest.mark.parametrize("splits", [0, -2, 3, 6, 128, True, 2.0])
def test_splits_must_be_a_small_power_of_two(tt: ModuleType, splits: object) -> None:
    with pytest.raises(ValueError, match="splits must be a power of two"):
        tt.paged_attention(*_decode_call(), 0.25, splits=splits)


def test_forced_splits_reject_prefill_chunks(tt: ModuleType) -> None:
    with pytest.raises(ValueError, match=r"splits=2 needs a decode-only batch"):
        tt.paged_attention(*_valid_call(), 0.25, splits=2)


def _decode_call() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, AttentionMetadata]:
    batch = make_batch(Spec(((3, 1), (9, 1)), 2, 4, 2, 16))
    return batch.query, batch.k_cache, batch.v_cache, batch.meta


# --- write_kv ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("src_dtype", "cache_dtype"),
    [
        *((dtype, dtype) for dtype in DTYPES),
        (torch.float32, torch.bfloat16),
        (torch.float32, torch.float16),
        (torch.bfloat16, torch.float32),
    ],
    ids=str,
)
@pytest.mark.parametrize("slot_dtype", [torch.int64, torch.int32], ids=str)
def test_write_kv_bitwise_equals_reference(
    tt: ModuleType, src_dtype: torch.dtype, cache_dtype: torch.dtype, slot_dtype: torch.dtype
) -> None:
    gen = torch.Generator().manual_seed(0)
    shape = (6, 4, 3, 24)  # 3 KV heads, head_dim 24: both padded to powers of two inside the kernel
    slots = torch.tensor([17, 0, 23, 5, 4, 11, 12], dtype=slot_dtype, device=DEVICE)  # unordered, across blocks
    fused = torch.randn(len(slots), 3, 72, generator=gen).to(DEVICE, src_dtype) * 100
    key, value = fused[..., :24], fused[..., 48:]  # strided views, as split out of a fused projection
    caches = [torch.full(shape, FILL, dtype=cache_dtype, device=DEVICE) for _ in range(4)]
    tt.write_kv(key, value, caches[0], caches[1], slots)
    reference.write_kv(key, value, caches[2], caches[3], slots.long())
    for mine, ref in ((caches[0], caches[2]), (caches[1], caches[3])):
        assert torch.equal(mine.view(torch.uint8), ref.view(torch.uint8))  # bitwise, NaN included


def test_write_kv_empty_batch_is_noop(tt: ModuleType) -> None:
    k_cache, v_cache = torch.zeros(2, 4, 1, 16, device=DEVICE), torch.zeros(2, 4, 1, 16, device=DEVICE)
    empty = torch.empty(0, 1, 16, device=DEVICE)
    tt.write_kv(empty, empty, k_cache, v_cache, torch.empty(0, dtype=torch.int64, device=DEVICE))
    assert not k_cache.any() and not v_cache.any()


# --- validation --------------------------------------------------------------------------------


def _valid_call() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, AttentionMetadata]:
    batch = make_batch(Spec(((3, 1), (0, 4)), 1, 4, 2, 16))
    return batch.query, batch.k_cache, batch.v_cache, batch.meta


ATTENTION_ERRORS = {
    "query dtype": (lambda q, k, v, m: (q.double(), k, v, m), "query"),
    "cache dtypes differ": (lambda q, k, v, m: (q, k, v.half(), m), "v_cache dtype"),
    "head_dim mismatch": (lambda q, k, v, m: (q[..., :8], k, v, m), "head_dim"),
    "head_dim too large": (
        lambda q, k, v, m: (q.new_zeros(5, 4, 512),) + (k.new_zeros(7, 16, 2, 512),) * 2 + (m,),
        "head_dim",
    ),
    "heads not a multiple": (lambda q, k, v, m: (q[:, :3], k, v, m), "num_heads 3"),
    "token count": (lambda q, k, v, m: (q[:4], k, v, m), "query_lens"),
    "cache rank": (lambda q, k, v, m: (q, k[0], v[0], m), "k_cache"),
    "seq_lens rows": (lambda q, k, v, m: (q, k, v, replace(m, seq_lens=m.seq_lens[:1])), "meta.seq_lens"),
    "block_tables dtype": (
        lambda q, k, v, m: (q, k, v, replace(m, block_tables=m.block_tables.float())),
        "block_tables",
    ),
}


@pytest.mark.parametrize("case", sorted(ATTENTION_ERRORS))
def test_attention_input_errors_name_the_field(tt: ModuleType, case: str) -> None:
    mutate, field = ATTENTION_ERRORS[case]
    args = mutate(*_valid_call())
    with pytest.raises(ValueError, match=field):
        tt.paged_attention(*args, 0.25)


WRITE_ERRORS = {
    "slot dtype": (lambda k, v, kc, vc, s: (k, v, kc, vc, s.float()), "slot_mapping"),
    "slot rank": (lambda k, v, kc, vc, s: (k, v, kc, vc, s.view(1, -1)), "slot_mapping"),
    "key shape": (lambda k, v, kc, vc, s: (k[:, :1], v, kc, vc, s), "key"),
    "value dtype": (lambda k, v, kc, vc, s: (k, v.double(), kc, vc, s), "value"),
    "cache dtype": (lambda k, v, kc, vc, s: (k, v, kc.double(), vc.double(), s), "k_cache"),
}


@pytest.mark.parametrize("case", sorted(WRITE_ERRORS))
def test_write_kv_input_errors_name_the_field(tt: ModuleType, case: str) -> None:
    mutate, field = WRITE_ERRORS[case]
    key = torch.zeros(3, 2, 16, device=DEVICE)
    caches = torch.zeros(2, 2, 4, 2, 16, device=DEVICE)
    args = mutate(key, key.clone(), caches[0], caches[1], torch.tensor([0, 5, 6], device=DEVICE))
    with pytest.raises(ValueError, match=field):
        tt.write_kv(*args)


# --- tile helpers (pure) -------------------------------------------------------------------------


@pytest.mark.parametrize("max_query_len", [1, 2, 7, 64, 512])
@pytest.mark.parametrize("group", [1, 3, 4, 8, 64])
def test_choose_tiles_fits_group_and_dot_minimums(tt: ModuleType, max_query_len: int, group: int) -> None:
    for dtype in DTYPES:
        tiles = tt.choose_tiles(max_query_len, group, 128, dtype)
        assert tiles.block_q * group <= tiles.block_m and tiles.block_m >= 16
        assert tiles.block_q <= triton_next_pow2(max_query_len)
        if max_query_len == 1:
            assert tiles.block_q == 1  # decode programs hold just the group's heads


def triton_next_pow2(n: int) -> int:
    return 1 << (n - 1).bit_length()


@pytest.mark.parametrize("q_lens", [(1,), (1, 1, 1), (5, 16, 17, 1), (0, 3), (40, 1, 33)])
@pytest.mark.parametrize("block_q", [1, 4, 16])
def test_grid_covers_every_query_tile(tt: ModuleType, q_lens: tuple[int, ...], block_q: int) -> None:
    """Program id → sequence as the kernel's binary search does; each tile is owned exactly once."""
    grid, _ = tt.attention_grid(sum(q_lens), len(q_lens), 1, block_q)
    starts = [sum(q_lens[:i]) for i in range(len(q_lens) + 1)]
    firsts = [starts[i] // block_q + i for i in range(len(q_lens))]
    owned: list[tuple[int, int]] = []
    for pid in range(grid):
        seq = max(i for i, f in enumerate(firsts) if f <= pid)
        tile = pid - firsts[seq]
        if tile * block_q < q_lens[seq]:
            owned.append((seq, tile))
    expected = [(s, t) for s, n in enumerate(q_lens) for t in range(math.ceil(n / block_q))]
    assert owned == expected


def test_tile_config_rejects_non_power_of_two(tt: ModuleType) -> None:
    with pytest.raises(ValueError, match="block_n"):
        tt.TileConfig(1, 16, 24)


# --- backend selection -------------------------------------------------------------------------


def test_backend_selection_dispatches_to_triton(tt: ModuleType) -> None:
    assert CUDA or os.environ.get("TRITON_INTERPRET") == "1"  # set by tests/conftest.py
    batch = make_batch(Spec(MIXED, 2, seed=5))
    previous = kernels.get_backend()
    try:
        assert kernels.select_backend("triton") == "triton"
        assert kernels.get_backend() == "triton"
        kernels.write_kv(batch.key, batch.value, batch.k_cache, batch.v_cache, batch.meta.slot_mapping)
        out = kernels.paged_attention(batch.query, batch.k_cache, batch.v_cache, batch.meta, 0.125)
        direct = tt.paged_attention(batch.query, batch.k_cache, batch.v_cache, batch.meta, 0.125)
        assert torch.equal(out, direct)
    finally:
        kernels.select_backend(previous)
    assert kernels.get_backend() == previous


# --- on a real GPU: larger shapes, compiled kernels ----------------------------------------------


@pytest.mark.gpu
class TestOnCuda:
    """Same checks with compiled kernels and Llama-3-8B-like heads (32 query, 8 KV, head_dim 128)."""

    @pytest.mark.parametrize("dtype", DTYPES, ids=str)
    @pytest.mark.parametrize("scenario", ["mixed", "decode", "prefill"])
    def test_llama_shapes(self, tt: ModuleType, scenario: str, dtype: torch.dtype) -> None:
        seqs = {
            "mixed": ((1, 1), (700, 1), (2047, 1), (0, 1), (0, 300), (129, 517), (512, 512)),
            "decode": tuple((n, 1) for n in (1, 15, 16, 17, 1000, 4095, 333, 64)),
            "prefill": ((0, 1024), (3000, 7), (31, 257)),
        }[scenario]
        num_decodes = sum(1 for c, q in seqs if q == 1 and c > 0)
        spec = Spec(seqs, num_decodes, 32, 8, 128, dtype, seed=11)
        check_attention(tt, make_batch(spec, device="cuda"))

    @pytest.mark.parametrize("seed", range(4))
    def test_random_lengths(self, tt: ModuleType, seed: int) -> None:
        seqs, num_decodes = random_seqs(seed)
        check_attention(tt, make_batch(Spec(seqs, num_decodes, 8, 2, 64, torch.bfloat16, seed=seed), "cuda"))

    def test_offsets_beyond_int32(self, tt: ModuleType) -> None:
        """Slots whose element offset exceeds 2**31: write_kv and attention must use int64 addressing."""
        block_size, kv_heads, head_dim = 16, 8, 128
        num_blocks = 2**31 // (block_size * kv_heads * head_dim) + 4  # ~4.3 GB per bf16 cache
        k_cache = torch.empty(num_blocks, block_size, kv_heads, head_dim, dtype=torch.bfloat16, device="cuda")
        v_cache = torch.empty_like(k_cache)
        table = [num_blocks - 1, num_blocks - 3]
        slots = torch.tensor(_slots(table, range(20), block_size), device="cuda")
        key, value = torch.randn(2, 20, kv_heads, head_dim, device="cuda", dtype=torch.bfloat16)
        tt.write_kv(key, value, k_cache, v_cache, slots)
        assert torch.equal(k_cache.view(-1, kv_heads, head_dim)[slots], key)
        meta = AttentionMetadata(
            query_start_loc=torch.tensor([0, 20], dtype=torch.int32, device="cuda"),
            seq_lens=torch.tensor([20], dtype=torch.int32, device="cuda"),
            block_tables=torch.tensor([table], dtype=torch.int32, device="cuda"),
            slot_mapping=slots,
            query_lens=(20,),
            seq_lens_list=(20,),
            num_decodes=0,
        )
        query = torch.randn(20, 32, head_dim, device="cuda", dtype=torch.bfloat16)
        out = tt.paged_attention(query, k_cache, v_cache, meta, head_dim**-0.5)
        assert_close(out, reference.paged_attention(query, k_cache, v_cache, meta, head_dim**-0.5))
