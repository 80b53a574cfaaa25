# mypy: disable-error-code="no-untyped-def"
# (Triton reads the annotations of @triton.jit parameters itself; kernel arguments stay unannotated.)
"""Triton backend for the paged-attention contract (`attention.py`): the GPU fast path.

The PyTorch reference gathers every sequence's whole context into padded dense tensors and runs two
SDPA calls (decodes, then prefill chunks padded to the longest one), so each iteration copies the
context K/V once more and pays for the padding. These kernels read K/V straight out of the paged
cache through the block tables instead:

- `write_kv`: one launch scatters the new tokens' K/V into their slots (int64 slot arithmetic).
- `paged_attention`: one varlen launch serves decodes and prefill chunks together (bar split-KV
  decode, below: partial + reduce launches). A program owns (sequence, query tile, KV head); the
  query heads of that KV head's GQA group are folded into the tile's rows (M dimension), so each
  K/V tile is loaded once for the whole group, which is what decode (one query token, memory
  bound) needs. It walks the context in KV tiles with a flash-attention online softmax in fp32 and
  never touches a slot at a position >= seq_len, so whatever sits in unused cache slots (NaN
  included) cannot leak into the output.
- Split-KV (flash-decoding): a decode-only batch (every query length 1) with too few
  (sequence, KV head) programs to fill the GPU on a long context uses two launches instead
  (`decode_splits` decides). The partial launch runs a program per (sequence, KV head, split) over
  the split's range of positions, with the same GQA folding and inner loop (`_attend_range`), and
  stores unnormalised fp32 (acc, m, l) per query head. The reduce launch runs a program per
  (sequence, query head) and merges the splits by log-sum-exp rescaling. Splits past a context's
  end store (0, -inf, 0) and weigh nothing.

Sequence lookup stays on the device: program ids are laid out as `query_start_loc[i] // BLOCK_Q + i`
per sequence and each program binary-searches `query_start_loc`, so the host only needs its copies of
the query lengths to size the grid. On CPU the kernels run under the Triton interpreter, which needs
`TRITON_INTERPRET=1` in the environment before `triton` is first imported: Triton's own jit helpers
(`tl.max`, `tl.sum`, `tl.zeros`) take their mode then, this module's kernels when it is imported.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import triton
import triton.language as tl

from chariot.kernels.attention import AttentionBackend, AttentionMetadata, FunctionBackend

__all__ = [
    "BACKEND",
    "SUPPORTED_DTYPES",
    "TileConfig",
    "attention_grid",
    "choose_tiles",
    "decode_splits",
    "paged_attention",
    "split_chunk",
    "write_kv",
]

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_HEAD_DIM = 256
LOG2E = 1.4426950408889634
_INDEX_DTYPES = (torch.int32, torch.int64)


# --- tile selection (pure) ---------------------------------------------------------------------


@dataclass(frozen=True)
class TileConfig:
    """Launch shape of the attention kernel.

    `block_q` query tokens × `group` query heads fill `block_m` rows (padded to a power of two);
    `block_n` context positions are processed per online-softmax step.
    """

    block_q: int
    block_m: int
    block_n: int
    num_warps: int = 4
    num_stages: int = 2

    def __post_init__(self) -> None:
        for name in ("block_m", "block_n"):
            value = getattr(self, name)
            if value < 16 or not _is_pow2(value):
                raise ValueError(f"TileConfig.{name} must be a power of two >= 16, got {value}")
        if self.block_q < 1:
            raise ValueError(f"TileConfig.block_q must be >= 1, got {self.block_q}")


def _next_pow2(n: int) -> int:
    return 1 << (n - 1).bit_length()


def _is_pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def padded_head_dim(head_dim: int) -> int:
    """The power of two (>= 16, the smallest `tl.dot` K) the kernel tiles head_dim up to."""
    return max(16, triton.next_power_of_2(head_dim))


def query_tile(max_query_len: int, group: int, target_rows: int) -> tuple[int, int]:
    """(block_q, block_m): as many query tokens as fit `target_rows` rows with the group folded in.

    A decode-only batch gets block_q = 1 (its programs hold just the group's heads); a single-token
    tile still pads to 16 rows, the smallest `tl.dot` M.
    """
    rows = max(target_rows, triton.next_power_of_2(group))
    block_q = max(1, min(rows // group, triton.next_power_of_2(max(1, max_query_len))))
    block_m = max(16, triton.next_power_of_2(block_q * group))
    return block_q, block_m


def kv_tile(head_dim: int, dtype: torch.dtype = torch.bfloat16) -> int:
    """Context positions per online-softmax step, sized so K/V tiles and scores fit without spills on sm_90."""
    wide = padded_head_dim(head_dim) > 128
    if dtype == torch.float32:
        return 16 if wide else 64
    return 32 if wide else 64


def choose_tiles(max_query_len: int, group: int, head_dim: int, dtype: torch.dtype = torch.bfloat16) -> TileConfig:
    """Tiles for one launch: 16-row M for decode-only batches, 64 rows once a prefill chunk is present.

    fp32 dots run as FMA loops rather than tensor-core MMAs; at 64 rows they spill registers on sm_90,
    so fp32 (a checking path, not a serving one) always uses 16 rows. (Register counts from compiling
    for sm_90 ahead of time; the timings themselves are `chariot.bench.kernel_bench`'s job.)
    """
    target_rows = 16 if max_query_len <= 1 or dtype == torch.float32 else 64
    block_q, block_m = query_tile(max_query_len, group, target_rows)
    num_warps = 8 if block_m >= 128 else 4
    return TileConfig(block_q, block_m, kv_tile(head_dim, dtype), num_warps=num_warps, num_stages=2)


def attention_grid(num_tokens: int, num_seqs: int, num_kv_heads: int, block_q: int) -> tuple[int, int]:
    """Programs per launch: sequence i owns ids [qsl[i] // block_q + i, qsl[i+1] // block_q + i + 1).

    That range always holds ceil(query_len / block_q) tiles, and the ranges tile [0, num_tokens //
    block_q + num_seqs) exactly, so the grid needs only host totals; spare programs exit at once.
    """
    return num_tokens // block_q + num_seqs, num_kv_heads


# Tuned on an H100 by GPU time (CUDA-graph replay, docs/img/gpu-h100/decode_splits_h100.json): four
# programs per SM and splits of at least 128 positions were fastest or within 10 % of it on every
# measured decode shape (batch 1-32, context 1k-8k, Llama-3-8B heads).
SPLIT_TARGET_PROGRAMS = 4 * 132
MIN_SPLIT_POSITIONS = 128
MAX_SPLITS = 64


def decode_splits(
    max_query_len: int,
    num_seqs: int,
    num_kv_heads: int,
    max_seq_len: int,
    block_n: int,
    target_programs: int = SPLIT_TARGET_PROGRAMS,
) -> int:
    """KV splits per (sequence, KV head) for split-KV decode; 1 means the single varlen launch.

    Only batches whose every query length is 1 split (decodes; a single-token prompt attends the same
    way, so it may ride along); a prefill chunk of more tokens needs the varlen launch. The count is
    the largest power of two (<= `MAX_SPLITS`) that keeps num_seqs × num_kv_heads × splits within
    `target_programs` and gives the longest context (`max_seq_len`: a batch's, or the graphs'
    `split_horizon`) at least `MIN_SPLIT_POSITIONS` (and one KV tile) per split. Batch 1 × 8 KV heads
    gets 64 splits (512 programs) at 8k context and 8 at 1k; at 255 positions, or once num_seqs ×
    num_kv_heads exceeds half the target, it gets 1. num_seqs counts as the next power of two: every
    CUDA-graph bucket then gets the split count of the unpadded batches it serves, so a decode splits
    alike replayed or eager.
    """
    if max_query_len != 1 or num_seqs < 1 or num_kv_heads < 1:
        return 1
    limit = min(
        MAX_SPLITS,
        target_programs // (_next_pow2(num_seqs) * num_kv_heads),
        max_seq_len // max(MIN_SPLIT_POSITIONS, block_n),
    )
    return 1 << (limit.bit_length() - 1) if limit >= 2 else 1


def split_chunk(max_seq_len: int, splits: int, block_n: int) -> int:
    """Context positions per split: the longest context's KV tiles shared out, in whole tiles.

    Split s covers [s·chunk, (s+1)·chunk) ∩ [0, seq_len); splits past a sequence's end are empty.
    Whole tiles keep the longest split at ceil(tiles / splits) tiles, the least possible.
    """
    tiles = max(1, math.ceil(max_seq_len / block_n))
    return math.ceil(tiles / splits) * block_n


# --- kernels -----------------------------------------------------------------------------------

# Integer arguments that change from batch to batch (sequence count, block-table width, split chunk,
# split count) are `do_not_specialize`: Triton would otherwise compile a variant per value class
# (== 1, divisible by 16, other) inside whichever request first meets it (on an H100, 0.5-1.7 s). Only
# the tile sizes (constexprs) select variants, and the worker's warm-up compiles those (`warmup.py`).


@triton.jit
def _round_to_bf16(x):
    """fp32 → bf16 rounding to nearest even by integer arithmetic, NaN → 0x7FC0 (as torch does).

    Only used under the interpreter, whose fp32 → bf16 cast truncates; compiled kernels cast in hardware.
    """
    bits = x.to(tl.uint32, bitcast=True)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    rounded = tl.where((bits & 0x7FFFFFFF) > 0x7F800000, 0x7FC0, rounded)
    return rounded.to(tl.uint16).to(tl.bfloat16, bitcast=True)


@triton.jit
def _to_cache(x, cache_ptr, ROUND_BF16: tl.constexpr):
    if ROUND_BF16:
        return _round_to_bf16(x.to(tl.float32))
    return x.to(cache_ptr.dtype.element_ty)


@triton.jit
def _write_kv_kernel(
    key_ptr,
    value_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_ptr,
    num_kv_heads,
    head_dim,
    stride_kt,
    stride_kh,
    stride_kd,
    stride_vt,
    stride_vh,
    stride_vd,
    stride_kcb,
    stride_kcs,
    stride_kch,
    stride_kcd,
    stride_vcb,
    stride_vcs,
    stride_vch,
    stride_vcd,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    ROUND_BF16: tl.constexpr,
):
    """One program per new token: copy all its KV heads into cache slot `slot_mapping[token]`."""
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    heads = tl.arange(0, BLOCK_H)[:, None]
    dims = tl.arange(0, BLOCK_D)[None, :]
    mask = (heads < num_kv_heads) & (dims < head_dim)

    k = tl.load(key_ptr + token * stride_kt + heads * stride_kh + dims * stride_kd, mask=mask)
    k_dst = k_cache_ptr + block * stride_kcb + offset * stride_kcs + heads * stride_kch + dims * stride_kcd
    tl.store(k_dst, _to_cache(k, k_cache_ptr, ROUND_BF16), mask=mask)

    v = tl.load(value_ptr + token * stride_vt + heads * stride_vh + dims * stride_vd, mask=mask)
    v_dst = v_cache_ptr + block * stride_vcb + offset * stride_vcs + heads * stride_vch + dims * stride_vcd
    tl.store(v_dst, _to_cache(v, v_cache_ptr, ROUND_BF16), mask=mask)


@triton.jit
def _find_sequence(query_start_loc_ptr, tile_id, num_seqs, BLOCK_Q: tl.constexpr):
    """Largest i with query_start_loc[i] // BLOCK_Q + i <= tile_id (binary search on the device)."""
    lo: tl.int32 = 0
    hi: tl.int32 = num_seqs
    while lo + 1 < hi:
        mid = (lo + hi) // 2
        first_tile = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid
        if first_tile <= tile_id:
            lo = mid
        else:
            hi = mid
    return lo


@triton.jit
def _dot_operand(x, q_ptr, DOT_FP32: tl.constexpr):
    """Round to the query dtype (the reference casts K/V to it); widen to fp32 when `DOT_FP32`.

    The interpreter multiplies bf16 tiles as their raw uint16 bit patterns, so there bf16 dots run in
    fp32 on the bf16-rounded values: the same products the GPU's bf16 MMA with fp32 accumulation forms.
    """
    x = x.to(q_ptr.dtype.element_ty)
    if DOT_FP32:
        x = x.to(tl.float32)
    return x


@triton.jit
def _load_query(q_ptr, token, head, row_ok, head_dim, stride_qt, stride_qh, stride_qd, BLOCK_D: tl.constexpr,
                DOT_FP32: tl.constexpr):
    """The prologue both attention kernels share: the query tile of rows (token, head) × head dims,
    masked to valid rows and dims, as a dot operand; with the dims, their mask and the io mask."""
    dims = tl.arange(0, BLOCK_D)
    dim_ok = dims < head_dim
    io_mask = row_ok[:, None] & dim_ok[None, :]
    q_offs = token[:, None] * stride_qt + head[:, None] * stride_qh + dims[None, :] * stride_qd
    q = _dot_operand(tl.load(q_ptr + q_offs, mask=io_mask, other=0.0), q_ptr, DOT_FP32)
    return q, dims, dim_ok, io_mask


@triton.jit
def _attend_range(
    q,
    q_pos,
    kv_start_pos,
    kv_end,
    table,
    k_head,
    v_head,
    dims,
    dim_ok,
    qk_scale,
    stride_kb,
    stride_ks,
    stride_kd,
    stride_vb,
    stride_vs,
    stride_vd,
    q_ptr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    DOT_FP32: tl.constexpr,
):
    """Online softmax of the rows `q` over context positions [kv_start_pos, kv_end) in BLOCK_N tiles.

    Returns the unnormalised fp32 (acc, m, l): m is the running row max in log2 units (scores are
    pre-multiplied by `qk_scale` = scale·log2 e), l the running sum of exp2(score - m), acc the sum of
    exp2(score - m)·v. A row sees position p iff p <= q_pos[row]; every row sees `kv_start_pos`
    (callers guarantee it), so m is finite after the first tile. Nothing at or past `kv_end` is read,
    so unused cache slots cannot leak in. An empty range returns (acc, m, l) = (0, -inf, 0).
    """
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for kv_start in range(kv_start_pos, kv_end, BLOCK_N):
        pos = kv_start + tl.arange(0, BLOCK_N)
        pos_ok = pos < kv_end
        block = tl.load(table + pos // BLOCK_SIZE, mask=pos_ok, other=0).to(tl.int64)
        slot_in_block = (pos % BLOCK_SIZE).to(tl.int64)
        kv_mask = pos_ok[:, None] & dim_ok[None, :]
        k_offs = block[:, None] * stride_kb + slot_in_block[:, None] * stride_ks + dims[None, :] * stride_kd
        k = _dot_operand(tl.load(k_head + k_offs, mask=kv_mask, other=0.0), q_ptr, DOT_FP32)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
        visible = (pos[None, :] <= q_pos[:, None]) & pos_ok[None, :]
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))  # finite: the range's first position is visible to every row
        alpha = tl.math.exp2(m_i - m_new)
        p = tl.math.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v_offs = block[:, None] * stride_vb + slot_in_block[:, None] * stride_vs + dims[None, :] * stride_vd
        v = _dot_operand(tl.load(v_head + v_offs, mask=kv_mask, other=0.0), q_ptr, DOT_FP32)
        acc = acc * alpha[:, None] + tl.dot(_dot_operand(p, q_ptr, DOT_FP32), v, input_precision=DOT_PRECISION)
        m_i = m_new
    return acc, m_i, l_i


@triton.jit(do_not_specialize=("num_seqs", "stride_bt"))
def _paged_attention_kernel(
    out_ptr,
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    query_start_loc_ptr,
    seq_lens_ptr,
    block_tables_ptr,
    num_seqs,
    head_dim,
    qk_scale,
    stride_qt,
    stride_qh,
    stride_qd,
    stride_ot,
    stride_oh,
    stride_od,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_kd,
    stride_vb,
    stride_vs,
    stride_vh,
    stride_vd,
    stride_bt,
    GROUP: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    DOT_FP32: tl.constexpr,
):
    """Rows = BLOCK_Q query tokens × GROUP query heads of KV head `program_id(1)`; loop over KV tiles."""
    tile_id = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq = _find_sequence(query_start_loc_ptr, tile_id, num_seqs, BLOCK_Q)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    q_first = (tile_id - (q_start // BLOCK_Q + seq)) * BLOCK_Q  # first chunk index of this tile
    if q_first >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    ctx_before = seq_len - q_len  # cached tokens preceding the chunk

    rows = tl.arange(0, BLOCK_M)
    q_idx = q_first + rows // GROUP
    head = kv_head * GROUP + rows % GROUP
    row_ok = (rows < BLOCK_Q * GROUP) & (q_idx < q_len)
    q_pos = ctx_before + q_idx  # context position of each row's token; rows past the chunk see all
    token = (q_start + q_idx).to(tl.int64)
    q, dims, dim_ok, io_mask = _load_query(q_ptr, token, head, row_ok, head_dim, stride_qt, stride_qh, stride_qd,
                                           BLOCK_D, DOT_FP32)

    kv_end = ctx_before + tl.minimum(q_first + BLOCK_Q, q_len)  # <= seq_len: later slots are never read
    acc, _, l_i = _attend_range(
        q,
        q_pos,
        0,
        kv_end,
        block_tables_ptr + seq.to(tl.int64) * stride_bt,
        k_cache_ptr + kv_head.to(tl.int64) * stride_kh,
        v_cache_ptr + kv_head.to(tl.int64) * stride_vh,
        dims,
        dim_ok,
        qk_scale,
        stride_kb,
        stride_ks,
        stride_kd,
        stride_vb,
        stride_vs,
        stride_vd,
        q_ptr,
        BLOCK_SIZE,
        BLOCK_M,
        BLOCK_N,
        BLOCK_D,
        DOT_PRECISION,
        DOT_FP32,
    )
    out = acc / l_i[:, None]
    o_offs = token[:, None] * stride_ot + head[:, None] * stride_oh + dims[None, :] * stride_od
    tl.store(out_ptr + o_offs, out.to(out_ptr.dtype.element_ty), mask=io_mask)


@triton.jit(do_not_specialize=("stride_bt", "chunk"))
def _split_partial_kernel(
    acc_ptr,
    m_ptr,
    l_ptr,
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    query_start_loc_ptr,
    seq_lens_ptr,
    block_tables_ptr,
    head_dim,
    qk_scale,
    chunk,
    stride_qt,
    stride_qh,
    stride_qd,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_kd,
    stride_vb,
    stride_vs,
    stride_vh,
    stride_vd,
    stride_bt,
    stride_as,
    stride_ah,
    stride_ap,
    stride_ad,
    stride_ms,
    stride_mh,
    stride_mp,
    GROUP: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    DOT_FP32: tl.constexpr,
):
    """Split-KV pass 1: per (sequence, KV head, split), the partial attention of one query token.

    The query token's GROUP heads fill the rows, as in the varlen kernel; they attend to the split's
    positions and each stores the unnormalised (acc, m, l) of `_attend_range`. An empty split
    (starting at or past seq_len) reads no K/V and stores (0, -inf, 0).
    """
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    token = tl.load(query_start_loc_ptr + seq).to(tl.int64)  # decode-only: one query token per sequence
    seq_len = tl.load(seq_lens_ptr + seq)
    kv_start = split * chunk
    kv_end = tl.minimum(kv_start + chunk, seq_len)  # <= seq_len: later slots are never read

    rows = tl.arange(0, BLOCK_M)
    head = kv_head * GROUP + rows % GROUP
    row_ok = rows < GROUP
    tokens = token + tl.zeros([BLOCK_M], tl.int64)  # every row is that one token's (for one GQA head each)
    q, dims, dim_ok, io_mask = _load_query(q_ptr, tokens, head, row_ok, head_dim, stride_qt, stride_qh, stride_qd,
                                           BLOCK_D, DOT_FP32)
    q_pos = seq_len - 1 + tl.zeros([BLOCK_M], tl.int32)  # the query is the context's last token
    acc, m_i, l_i = _attend_range(
        q,
        q_pos,
        kv_start,
        kv_end,
        block_tables_ptr + seq.to(tl.int64) * stride_bt,
        k_cache_ptr + kv_head.to(tl.int64) * stride_kh,
        v_cache_ptr + kv_head.to(tl.int64) * stride_vh,
        dims,
        dim_ok,
        qk_scale,
        stride_kb,
        stride_ks,
        stride_kd,
        stride_vb,
        stride_vs,
        stride_vd,
        q_ptr,
        BLOCK_SIZE,
        BLOCK_M,
        BLOCK_N,
        BLOCK_D,
        DOT_PRECISION,
        DOT_FP32,
    )
    ml_offs = seq.to(tl.int64) * stride_ms + head * stride_mh + split * stride_mp
    tl.store(m_ptr + ml_offs, m_i, mask=row_ok)
    tl.store(l_ptr + ml_offs, l_i, mask=row_ok)
    acc_offs = seq.to(tl.int64) * stride_as + head[:, None] * stride_ah + split * stride_ap + dims[None, :] * stride_ad
    tl.store(acc_ptr + acc_offs, acc, mask=io_mask)


@triton.jit(do_not_specialize=("num_splits",))
def _split_reduce_kernel(
    out_ptr,
    acc_ptr,
    m_ptr,
    l_ptr,
    query_start_loc_ptr,
    head_dim,
    num_splits,
    stride_ot,
    stride_oh,
    stride_od,
    stride_as,
    stride_ah,
    stride_ap,
    stride_ad,
    stride_ms,
    stride_mh,
    stride_mp,
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """Split-KV pass 2: (sequence, query head) merges its splits by log-sum-exp rescaling.

    out = Σ_s 2^(m_s - M)·acc_s / Σ_s 2^(m_s - M)·l_s with M = max_s m_s, which is finite because
    split 0 holds position 0 of a non-empty context. Empty splits (m_s = -inf) get weight 0 and their
    acc is not even loaded, so nothing they hold can turn into NaN.
    """
    seq = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    parts = tl.arange(0, BLOCK_S)
    ml_offs = seq * stride_ms + head * stride_mh + parts * stride_mp
    m_s = tl.load(m_ptr + ml_offs, mask=parts < num_splits, other=float("-inf"))
    l_s = tl.load(l_ptr + ml_offs, mask=parts < num_splits, other=0.0)
    used = m_s > float("-inf")
    w = tl.where(used, tl.math.exp2(m_s - tl.max(m_s, 0)), 0.0)
    dims = tl.arange(0, BLOCK_D)
    dim_ok = dims < head_dim
    acc_offs = seq * stride_as + head * stride_ah + parts[:, None] * stride_ap + dims[None, :] * stride_ad
    acc = tl.load(acc_ptr + acc_offs, mask=used[:, None] & dim_ok[None, :], other=0.0)
    out = tl.sum(acc * w[:, None], 0) / tl.sum(w * l_s, 0)
    token = tl.load(query_start_loc_ptr + seq).to(tl.int64)
    o_offs = token * stride_ot + head * stride_oh + dims * stride_od
    tl.store(out_ptr + o_offs, out.to(out_ptr.dtype.element_ty), mask=dim_ok)


_INTERPRETED = not isinstance(_paged_attention_kernel, triton.runtime.JITFunction)
# TRITON_INTERPRET=1 set after `triton` was imported: our kernels interpreted, Triton's helpers compiled.
_MIXED_MODES = _INTERPRETED and isinstance(tl.max, triton.runtime.JITFunction)


# --- validation --------------------------------------------------------------------------------


def _check_device(name: str, tensor: torch.Tensor, device: torch.device) -> None:
    if tensor.device != device:
        raise ValueError(f"{name} is on {tensor.device} but k_cache is on {device}")


def _check_runnable(device: torch.device) -> None:
    if _MIXED_MODES:
        raise RuntimeError(
            "TRITON_INTERPRET=1 was set after `triton` was first imported, so Triton's standard library is "
            "compiled while these kernels are interpreted; set it before anything imports triton"
        )
    if device.type != "cuda" and not _INTERPRETED:
        raise ValueError(
            f"k_cache is on {device}: the Triton kernels need CUDA tensors, or TRITON_INTERPRET=1 set "
            "before triton is first imported to run them on CPU"
        )


def _check_dtype(name: str, tensor: torch.Tensor, allowed: tuple[torch.dtype, ...]) -> None:
    if tensor.dtype not in allowed:
        raise ValueError(f"{name} has dtype {tensor.dtype}; supported: {', '.join(map(str, allowed))}")


def _check_caches(k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    if k_cache.dim() != 4:
        raise ValueError(
            f"k_cache must be [num_blocks, block_size, num_kv_heads, head_dim], got shape {tuple(k_cache.shape)}"
        )
    if v_cache.shape != k_cache.shape:
        raise ValueError(f"v_cache shape {tuple(v_cache.shape)} differs from k_cache shape {tuple(k_cache.shape)}")
    _check_runnable(k_cache.device)
    _check_dtype("k_cache", k_cache, SUPPORTED_DTYPES)
    if v_cache.dtype != k_cache.dtype:
        raise ValueError(f"v_cache dtype {v_cache.dtype} differs from k_cache dtype {k_cache.dtype}")
    _check_device("v_cache", v_cache, k_cache.device)


def _check_write(
    key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    _check_caches(k_cache, v_cache)
    if slot_mapping.dim() != 1:
        raise ValueError(f"slot_mapping must be [num_tokens], got shape {tuple(slot_mapping.shape)}")
    want = (slot_mapping.shape[0], *k_cache.shape[2:])
    for name, tensor in (("key", key), ("value", value)):
        if tuple(tensor.shape) != want:
            raise ValueError(
                f"{name} must be [num_tokens, num_kv_heads, head_dim] = {want} to match slot_mapping and "
                f"k_cache, got shape {tuple(tensor.shape)}"
            )
        _check_dtype(name, tensor, SUPPORTED_DTYPES)
        _check_device(name, tensor, k_cache.device)
    _check_dtype("slot_mapping", slot_mapping, _INDEX_DTYPES)
    _check_device("slot_mapping", slot_mapping, k_cache.device)


def _check_metadata(meta: AttentionMetadata, num_tokens: int, device: torch.device) -> None:
    if meta.num_tokens != num_tokens:
        raise ValueError(f"query has {num_tokens} tokens but meta.query_lens sums to {meta.num_tokens}")
    if meta.block_tables.dim() != 2:
        raise ValueError(
            f"meta.block_tables must be [num_seqs, max_blocks], got shape {tuple(meta.block_tables.shape)}"
        )
    if meta.split_horizon and meta.split_horizon < meta.max_seq_len:
        raise ValueError(f"meta.split_horizon {meta.split_horizon} is shorter than the longest context "
                         f"{meta.max_seq_len}: the splits would not cover it")
    shapes = {
        "meta.query_start_loc": (meta.query_start_loc, meta.num_seqs + 1),
        "meta.seq_lens": (meta.seq_lens, meta.num_seqs),
        "meta.block_tables": (meta.block_tables, meta.num_seqs),
    }
    for name, (tensor, rows) in shapes.items():
        if tensor.shape[0] != rows:
            raise ValueError(f"{name} has {tensor.shape[0]} rows, expected {rows} for {meta.num_seqs} sequences")
        _check_dtype(name, tensor, _INDEX_DTYPES)
        _check_device(name, tensor, device)


def _check_attention(
    query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata
) -> None:
    _check_caches(k_cache, v_cache)
    if query.dim() != 3:
        raise ValueError(f"query must be [num_tokens, num_heads, head_dim], got shape {tuple(query.shape)}")
    _check_dtype("query", query, SUPPORTED_DTYPES)
    _check_device("query", query, k_cache.device)
    heads, head_dim = query.shape[1], query.shape[2]
    kv_heads = k_cache.shape[2]
    if head_dim != k_cache.shape[3]:
        raise ValueError(f"query head_dim {head_dim} differs from k_cache head_dim {k_cache.shape[3]}")
    if not 1 <= head_dim <= MAX_HEAD_DIM:
        raise ValueError(f"head_dim {head_dim} is unsupported: the Triton kernel handles 1..{MAX_HEAD_DIM}")
    if kv_heads == 0 or heads % kv_heads:
        raise ValueError(f"num_heads {heads} must be a multiple of num_kv_heads {kv_heads} (GQA)")
    _check_metadata(meta, query.shape[0], query.device)


# --- entry points ------------------------------------------------------------------------------


def write_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Scatter the new tokens' K/V into their cache slots (cast to the cache dtype), one launch.

    Slots are not range-checked (that would need a device sync); the caller owns their validity.
    """
    _check_write(key, value, k_cache, v_cache, slot_mapping)
    num_tokens, kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    _write_kv_kernel[(num_tokens,)](
        key,
        value,
        k_cache,
        v_cache,
        slot_mapping,
        kv_heads,
        head_dim,
        *key.stride(),
        *value.stride(),
        *k_cache.stride(),
        *v_cache.stride(),
        BLOCK_SIZE=k_cache.shape[1],
        BLOCK_H=triton.next_power_of_2(kv_heads),
        BLOCK_D=triton.next_power_of_2(head_dim),
        ROUND_BF16=_INTERPRETED and k_cache.dtype == torch.bfloat16,
    )


def paged_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    tiles: TileConfig | None = None,
    splits: int | None = None,
) -> torch.Tensor:
    """Attention of every new token over its sequence's cached context (see `attention.py`).

    Output is contiguous, in the query's dtype. `tiles` overrides the launch shape and `splits` the
    split-KV count (tests, tuning): by default `decode_splits` picks it, and splits > 1 (decode-only
    batches only) runs the partial + reduce launches instead of the single varlen one.
    """
    _check_attention(query, k_cache, v_cache, meta)
    if not math.isfinite(scale):
        raise ValueError(f"scale must be finite, got {scale}")
    _check_splits(splits, meta)
    num_tokens, heads, head_dim = query.shape
    out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    if num_tokens == 0:
        return out
    kv_heads = k_cache.shape[2]
    group = heads // kv_heads
    tiles = tiles or choose_tiles(meta.max_query_len, group, head_dim, query.dtype)
    if tiles.block_q * group > tiles.block_m:
        raise ValueError(f"tiles.block_m {tiles.block_m} cannot hold block_q {tiles.block_q} × {group} heads")
    horizon = meta.split_horizon or meta.max_seq_len
    if splits is None:
        splits = decode_splits(meta.max_query_len, meta.num_seqs, kv_heads, horizon, tiles.block_n)
    dot_fp32 = _INTERPRETED and query.dtype == torch.bfloat16
    kernel_args = {
        "GROUP": group,
        "BLOCK_SIZE": k_cache.shape[1],
        "BLOCK_M": tiles.block_m,
        "BLOCK_N": tiles.block_n,
        "BLOCK_D": padded_head_dim(head_dim),
        "DOT_PRECISION": "ieee" if query.dtype == torch.float32 or dot_fp32 else "tf32",
        "DOT_FP32": dot_fp32,
        "num_warps": tiles.num_warps,
        "num_stages": tiles.num_stages,
    }
    if splits > 1:
        chunk = split_chunk(horizon, splits, tiles.block_n)
        _split_kv_attention(out, query, k_cache, v_cache, meta, scale, splits, chunk, kernel_args)
        return out
    grid = attention_grid(num_tokens, meta.num_seqs, kv_heads, tiles.block_q)
    _paged_attention_kernel[grid](
        out,
        query,
        k_cache,
        v_cache,
        meta.query_start_loc,
        meta.seq_lens,
        meta.block_tables,
        meta.num_seqs,
        head_dim,
        float(scale) * LOG2E,
        *query.stride(),
        *out.stride(),
        *k_cache.stride(),
        *v_cache.stride(),
        meta.block_tables.stride(0),
        BLOCK_Q=tiles.block_q,
        **kernel_args,
    )
    return out


def _check_splits(splits: int | None, meta: AttentionMetadata) -> None:
    if splits is None:
        return
    if isinstance(splits, bool) or not isinstance(splits, int) or not _is_pow2(splits) or splits > MAX_SPLITS:
        raise ValueError(f"splits must be a power of two from 1 to {MAX_SPLITS}, got {splits!r}")
    if splits > 1 and meta.max_query_len > 1:
        raise ValueError(
            f"splits={splits} needs a decode-only batch (every query length 1), but it holds a prefill "
            f"chunk of {meta.max_query_len} tokens"
        )


def _split_kv_attention(
    out: torch.Tensor,
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    splits: int,
    chunk: int,
    kernel_args: dict[str, Any],
) -> None:
    """Flash-decoding: partials of every (sequence, KV head, split) into fp32 scratch, then a reduce.

    Scratch per (sequence, query head, split): the unnormalised acc [head_dim] and its m and l.
    """
    num_seqs, (_, heads, head_dim) = meta.num_seqs, query.shape
    acc = torch.empty((num_seqs, heads, splits, head_dim), dtype=torch.float32, device=query.device)
    row_max = torch.empty((num_seqs, heads, splits), dtype=torch.float32, device=query.device)
    row_sum = torch.empty_like(row_max)
    _split_partial_kernel[(num_seqs, k_cache.shape[2], splits)](
        acc,
        row_max,
        row_sum,
        query,
        k_cache,
        v_cache,
        meta.query_start_loc,
        meta.seq_lens,
        meta.block_tables,
        head_dim,
        float(scale) * LOG2E,
        chunk,
        *query.stride(),
        *k_cache.stride(),
        *v_cache.stride(),
        meta.block_tables.stride(0),
        *acc.stride(),
        *row_max.stride(),
        **kernel_args,
    )
    _split_reduce_kernel[(num_seqs, heads)](
        out,
        acc,
        row_max,
        row_sum,
        meta.query_start_loc,
        head_dim,
        splits,
        *out.stride(),
        *acc.stride(),
        *row_max.stride(),
        BLOCK_S=MAX_SPLITS,  # one compiled variant for every split count (masked by num_splits)
        BLOCK_D=kernel_args["BLOCK_D"],
        num_warps=4,
    )


BACKEND: AttentionBackend = FunctionBackend("triton", write_kv, paged_attention)
