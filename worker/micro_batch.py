"""The packed micro-batch: one iteration's inputs as a single host int64 buffer, and its decoding.

Why a module of its own: a micro-batch is packed once, on the host, by stage 0's `InputBuilder`,
and every stage that runs it — the single-process executor, stage 0 of a pipeline and each
downstream stage — turns it into device tensors through the same `decode_batch`. A pipeline sends
the buffer as is; nothing is rebuilt on the way.

Layout of the payload (int64; `Layout` holds the sizes, T tokens, S sequences, W table width,
N sampled rows):

    input_ids[T] positions[T] slot_mapping[T] query_start_loc[S+1] seq_lens[S] block_tables[S*W]
    sample_indices[N] temperatures[N] top_ks[N] top_ps[N] seeds[N] steps[N] logprobs[N]
    adjust_rows[A] adjust_token_ids[A] adjust_deltas[A]

Temperatures, top-p and adjustment deltas travel as float64 bit patterns; a seed or logprobs of -1
means none (both are >= 0 when set). The A sparse logit adjustments (logit_bias, penalties,
min_tokens) are worked out by stage 0's `InputBuilder`, which holds every request's output so far.
The sampling columns are decoded only by a stage that samples.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import astuple, dataclass

import numpy as np
import torch

from chariot.contracts.sampling_params import SamplingParams
from chariot.kernels import AttentionMetadata
from chariot.worker.sampler import LogitAdjustments, SamplingBatch, SamplingColumns

NO_SEED = -1
NO_LOGPROBS = -1
_SAMPLING_COLUMNS = 6
_ADJUSTMENT_COLUMNS = 3


@dataclass(frozen=True)
class ModelInput:
    """One iteration's batch as device tensors. Rows of `sample_indices` are the last token of each
    chunk that samples, in chunk order; `sampling` has one row per sampled chunk (None on a stage
    that does not sample, or when no chunk samples)."""

    input_ids: torch.Tensor  # [T] long
    positions: torch.Tensor  # [T] long
    attn: AttentionMetadata
    sample_indices: torch.Tensor  # [N] long
    sampling: SamplingBatch | None

    @property
    def num_tokens(self) -> int:
        return len(self.positions)


@dataclass(frozen=True)
class Layout:
    """The sizes of a packed micro-batch (they travel in the pipeline header)."""

    num_tokens: int = 0
    num_seqs: int = 0
    table_width: int = 0
    num_decodes: int = 0
    num_sampled: int = 0
    num_adjustments: int = 0

    def sizes(self) -> list[int]:
        """Length of each payload section, in payload order."""
        t, s, n = self.num_tokens, self.num_seqs, self.num_sampled
        sampling = [n] * _SAMPLING_COLUMNS + [self.num_adjustments] * _ADJUSTMENT_COLUMNS
        return [t, t, t, s + 1, s, s * self.table_width, n, *sampling]

    @property
    def payload_len(self) -> int:
        return sum(self.sizes())

    def to_list(self) -> list[int]:
        return list(astuple(self))


@dataclass(frozen=True)
class MicroBatch:
    """A packed micro-batch: its layout and one int64 payload (on the host when packed; a downstream
    stage may receive it on its device)."""

    layout: Layout
    payload: torch.Tensor

    def __post_init__(self) -> None:
        if self.payload.dtype != torch.long or self.payload.shape != (self.layout.payload_len,):
            raise ValueError(f"payload must be int64[{self.layout.payload_len}], "
                             f"got {self.payload.dtype}{list(self.payload.shape)}")


@dataclass(frozen=True)
class TokenCarry:
    """Decode rows whose input token is still on the device when their batch is built: scheduling
    ahead, the previous batch, in flight, samples it. Row `rows[i]` of this batch takes token
    `sampled_rows[i]` of that batch's `SamplerOutput.token_ids`; the payload holds 0 in its place.
    Local to a single-rank stage 0: it never travels with the micro-batch."""

    rows: tuple[int, ...]
    sampled_rows: tuple[int, ...]

    def __post_init__(self) -> None:
        if len(self.rows) != len(self.sampled_rows) or not self.rows:
            raise ValueError(f"TokenCarry needs one sampled row per row, got {len(self.rows)} rows and "
                             f"{len(self.sampled_rows)} sampled rows")


def pack(layout: Layout, sections: Sequence[np.ndarray | Sequence[int]]) -> MicroBatch:
    """Pack every section, in payload order (the sampling ones as `sampling_sections` makes them),
    into one host buffer."""
    parts = [np.asarray(p, dtype=np.int64).reshape(-1) for p in sections]
    buf = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
    return MicroBatch(layout, torch.from_numpy(buf))


def decode_batch(mb: MicroBatch, device: torch.device, with_sampling: bool, split_horizon: int = 0) -> ModelInput:
    """Device tensors for one stage: one copy of the payload to `device` (none if it is there
    already; from pinned memory, asynchronously, onto a GPU), host facts from the host copy as
    numpy (no tensor operations); sampling columns only when `with_sampling`. Every device tensor,
    the sampling ones included, is a view or conversion of that one copy. A decode-only batch's
    metadata carries `split_horizon` (`AttentionMetadata`)."""
    layout, sizes = mb.layout, mb.layout.sizes()
    host = _numpy_sections(mb.payload, sizes)
    dev = _to_device(mb.payload, device).split_with_sizes(sizes)
    ids, positions, slots, qsl, seq_lens, tables, sample_rows = dev[:7]
    decode_only = layout.num_decodes == layout.num_seqs
    attn = AttentionMetadata(
        query_start_loc=qsl.to(torch.int32),
        seq_lens=seq_lens.to(torch.int32),
        block_tables=tables.view(layout.num_seqs, layout.table_width).to(torch.int32),
        slot_mapping=slots,
        query_lens=(1,) * layout.num_seqs if decode_only else tuple(np.diff(host[3]).tolist()),
        seq_lens_list=tuple(host[4].tolist()),
        num_decodes=layout.num_decodes,
        split_horizon=split_horizon if decode_only else 0,
    )
    sampled = with_sampling and layout.num_sampled > 0
    sampling = _sampling_batch(host[7:], dev[7:10]) if sampled else None
    return ModelInput(ids, positions, attn, sample_rows, sampling)


def _numpy_sections(payload: torch.Tensor, sizes: list[int]) -> list[np.ndarray]:
    """The payload's sections as host numpy views (a payload on a device is copied back once)."""
    host = (payload if payload.device.type == "cpu" else payload.cpu()).numpy()
    bounds = list(itertools.accumulate(sizes, initial=0))
    return [host[a:b] for a, b in itertools.pairwise(bounds)]


def _to_device(payload: torch.Tensor, device: torch.device) -> torch.Tensor:
    """The payload on `device`: a host payload goes to a GPU through pinned memory (PyTorch's caching
    host allocator, which keeps a block until its copy is done) without blocking the host."""
    if payload.device == device:
        return payload
    if device.type != "cuda" or payload.device.type != "cpu":
        return payload.to(device)
    return payload.pin_memory().to(device, non_blocking=True)


def sampling_sections(rows: np.ndarray, steps: np.ndarray, adjustments: LogitAdjustments) -> list[np.ndarray]:
    """The sampling sections of a payload, from one packed row per sampled chunk (`request_row`'s
    five values as an [N, 5] int64 array), their generation steps [N] and the batch's adjustments."""
    temps, top_ks, top_ps, seeds, logprobs = rows.reshape(-1, 5).T
    a = adjustments
    return [temps, top_ks, top_ps, seeds, steps, logprobs, np.asarray(a.rows, dtype=np.int64),
            np.asarray(a.token_ids, dtype=np.int64), _bits(a.deltas)]


def request_row(params: SamplingParams) -> tuple[int, int, int, int, int]:
    """A request's fixed sampling values as payload int64s: temperature and top-p as float64 bit
    patterns, top-k, seed and logprobs (-1: none). Constant for a request's life, so a caller may
    keep it."""
    temp_bits, top_p_bits = np.array([params.temperature, params.top_p], dtype=np.float64).view(np.int64).tolist()
    seed = NO_SEED if params.seed is None else params.seed
    logprobs = NO_LOGPROBS if params.logprobs is None else params.logprobs
    return temp_bits, params.top_k, top_p_bits, seed, logprobs


def _bits(values: Sequence[float]) -> np.ndarray:
    return np.asarray(values, dtype=np.float64).view(np.int64)


def _sampling_batch(host: Sequence[np.ndarray], dev: Sequence[torch.Tensor]) -> SamplingBatch:
    """The sampling batch: host columns (from the host payload) and temperature, top-k and top-p as
    the device payload's own sections."""
    temps, top_ks, top_ps, seeds, steps, logprobs, rows, token_ids, deltas = host
    cols = SamplingColumns(
        temperatures=tuple(temps.view(np.float64).tolist()),
        top_ks=tuple(top_ks.tolist()),
        top_ps=tuple(top_ps.view(np.float64).tolist()),
        seeds=_optional(seeds.tolist(), NO_SEED),
        steps=tuple(steps.tolist()),
        logprobs=_optional(logprobs.tolist(), NO_LOGPROBS),
        adjustments=LogitAdjustments(tuple(rows.tolist()), tuple(token_ids.tolist()),
                                     tuple(deltas.view(np.float64).tolist())),
    )
    return SamplingBatch.from_packed(cols, (dev[0], dev[1], dev[2]))


def _optional(values: list[int], none: int) -> tuple[int | None, ...]:
    """`values` with `none` (below every set value) as None; no per-row work when no row has one."""
    if max(values, default=none) == none:
        return (None,) * len(values)
    return tuple(None if x == none else x for x in values)
