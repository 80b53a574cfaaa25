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

from collections.abc import Sequence
from dataclasses import astuple, dataclass

import numpy as np
import torch

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


def pack(
    layout: Layout,
    sections: Sequence[np.ndarray | Sequence[int]],
    sampling: SamplingColumns | None,
) -> MicroBatch:
    """Pack the index sections (input_ids … sample_indices, in payload order) and the sampling
    columns of the sampled rows into one host buffer."""
    parts = [np.asarray(p, dtype=np.int64).reshape(-1) for p in sections]
    if sampling is not None:
        parts += _sampling_sections(sampling)
    buf = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
    return MicroBatch(layout, torch.from_numpy(buf))


def decode_batch(mb: MicroBatch, device: torch.device, with_sampling: bool) -> ModelInput:
    """Device tensors for one stage: one copy of the payload to `device` (none if it is there
    already), host facts from the host copy; sampling columns only when `with_sampling`."""
    layout, sizes = mb.layout, mb.layout.sizes()
    host = torch.split(mb.payload.cpu(), sizes)
    dev = torch.split(mb.payload.to(device), sizes)
    ids, positions, slots, qsl, seq_lens, tables, sample_rows = dev[:7]
    attn = AttentionMetadata(
        query_start_loc=qsl.to(torch.int32),
        seq_lens=seq_lens.to(torch.int32),
        block_tables=tables.view(layout.num_seqs, layout.table_width).to(torch.int32),
        slot_mapping=slots,
        query_lens=tuple((host[3][1:] - host[3][:-1]).tolist()),
        seq_lens_list=tuple(host[4].tolist()),
        num_decodes=layout.num_decodes,
    )
    sampled = with_sampling and layout.num_sampled > 0
    sampling = SamplingBatch.from_columns(_sampling_columns(host[7:]), device) if sampled else None
    return ModelInput(ids, positions, attn, sample_rows, sampling)


def _sampling_sections(s: SamplingColumns) -> list[np.ndarray]:
    seeds = [NO_SEED if x is None else x for x in s.seeds]
    logprobs = [NO_LOGPROBS if x is None else x for x in s.logprobs]
    a = s.adjustments
    return [_bits(s.temperatures), np.asarray(s.top_ks, dtype=np.int64), _bits(s.top_ps),
            np.asarray(seeds, dtype=np.int64), np.asarray(s.steps, dtype=np.int64),
            np.asarray(logprobs, dtype=np.int64), np.asarray(a.rows, dtype=np.int64),
            np.asarray(a.token_ids, dtype=np.int64), _bits(a.deltas)]


def _bits(values: Sequence[float]) -> np.ndarray:
    return np.asarray(values, dtype=np.float64).view(np.int64)


def _sampling_columns(sections: Sequence[torch.Tensor]) -> SamplingColumns:
    temps, top_ks, top_ps, seeds, steps, logprobs, rows, token_ids, deltas = sections
    return SamplingColumns(
        temperatures=tuple(temps.view(torch.float64).tolist()),
        top_ks=tuple(top_ks.tolist()),
        top_ps=tuple(top_ps.view(torch.float64).tolist()),
        seeds=tuple(None if x == NO_SEED else x for x in seeds.tolist()),
        steps=tuple(steps.tolist()),
        logprobs=tuple(None if x == NO_LOGPROBS else x for x in logprobs.tolist()),
        adjustments=LogitAdjustments(tuple(rows.tolist()), tuple(token_ids.tolist()),
                                     tuple(deltas.view(torch.float64).tolist())),
    )
