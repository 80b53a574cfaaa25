"""Wire format of the stage-to-stage pipeline (DESIGN.md §3 "Pipeline transport").

Every micro-batch is three tensors sent in order to the next stage:
1. a header: int64[HEADER_LEN] — kind, micro-batch id, sizes, and per-stage busy/idle counters
   (each stage writes its own before forwarding, so stage 0 learns everyone's accounting);
2. a payload: int64[payload_len(header)] — positions, slot mapping, query_start_loc, seq_lens,
   block tables, sample rows, and the sampling parameters (floats bit-cast to int64);
3. the hidden states [num_tokens, hidden] in the model dtype.
Heartbeat and shutdown messages are a header only. The last stage answers stage 0 with a result:
int64[result_len] — micro-batch id, count, the stage counters, and the sampled token ids.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch

from chariot.contracts.sampling_params import SamplingParams
from chariot.kernels import AttentionMetadata
from chariot.worker.executor import ModelInput
from chariot.worker.sampler import SamplingBatch

MAX_STAGES = 16
_FIXED = 8
HEADER_LEN = _FIXED + 2 * MAX_STAGES
HEARTBEAT_ID = -1


class Kind(enum.IntEnum):
    BATCH = 1
    HEARTBEAT = 2
    SHUTDOWN = 3


@dataclass(frozen=True)
class Header:
    kind: Kind
    mb_id: int
    num_tokens: int = 0
    num_seqs: int = 0
    table_width: int = 0
    num_decodes: int = 0
    num_sampled: int = 0

    @property
    def payload_len(self) -> int:
        t, s, n = self.num_tokens, self.num_seqs, self.num_sampled
        return 2 * t + (s + 1) + s + s * self.table_width + n + 5 * n


def encode_header(h: Header, stage_counters: torch.Tensor | None = None) -> torch.Tensor:
    out = torch.zeros(HEADER_LEN, dtype=torch.long)
    out[:_FIXED - 1] = torch.tensor(
        [h.kind, h.mb_id, h.num_tokens, h.num_seqs, h.table_width, h.num_decodes, h.num_sampled]
    )
    if stage_counters is not None:
        out[_FIXED:] = stage_counters
    return out


def decode_header(t: torch.Tensor) -> Header:
    v = t[: _FIXED - 1].tolist()
    return Header(Kind(v[0]), *v[1:])


def counters_of(header: torch.Tensor) -> torch.Tensor:
    """The [2 * MAX_STAGES] busy/idle microsecond counters carried in a header or result."""
    return header[_FIXED:HEADER_LEN]


def encode_batch(inp: ModelInput, mb_id: int) -> tuple[Header, torch.Tensor]:
    a = inp.attn
    n = len(inp.sample_indices)
    header = Header(Kind.BATCH, mb_id, inp.num_tokens, a.num_seqs, a.block_tables.shape[1], a.num_decodes, n)
    parts = [inp.positions, a.slot_mapping, a.query_start_loc, a.seq_lens, a.block_tables.reshape(-1),
             inp.sample_indices]
    parts += _encode_sampling(inp.sampling)
    payload = torch.cat([p.to("cpu", torch.long) for p in parts])
    return header, payload


def _encode_sampling(s: SamplingBatch | None) -> list[torch.Tensor]:
    if s is None:
        return []
    seeds = torch.tensor([-1 if x is None else x for x in s.seeds], dtype=torch.long)
    steps = torch.tensor(s.steps, dtype=torch.long)
    temps = s.temperatures.to("cpu", torch.float64).view(torch.long)
    top_ps = s.top_ps.to("cpu", torch.float64).view(torch.long)
    return [s.top_ks.to("cpu", torch.long), seeds, steps, temps, top_ps]


def decode_batch(h: Header, payload: torch.Tensor, device: torch.device) -> ModelInput:
    t, s, w, n = h.num_tokens, h.num_seqs, h.table_width, h.num_sampled
    sizes = [t, t, s + 1, s, s * w, n] + ([n] * 5 if n else [])
    chunks = torch.split(payload, sizes)
    positions, slots, qsl, seq_lens, tables, sample_idx = chunks[:6]
    attn = AttentionMetadata(
        query_start_loc=qsl.to(device, torch.int32),
        seq_lens=seq_lens.to(device, torch.int32),
        block_tables=tables.view(s, w).to(device, torch.int32),
        slot_mapping=slots.to(device),
        query_lens=tuple((qsl[1:] - qsl[:-1]).tolist()),
        seq_lens_list=tuple(seq_lens.tolist()),
        num_decodes=h.num_decodes,
    )
    sampling = _decode_sampling(chunks[6:], device) if n else None
    return ModelInput(torch.empty(0, dtype=torch.long, device=device), positions.to(device), attn,
                      sample_idx.to(device), sampling)


def _decode_sampling(parts: tuple[torch.Tensor, ...], device: torch.device) -> SamplingBatch:
    top_ks, seeds, steps, temps, top_ps = parts
    params = [
        SamplingParams(temperature=float(tp), top_k=int(k), top_p=float(p), seed=None if sd < 0 else int(sd))
        for tp, k, p, sd in zip(temps.view(torch.float64).tolist(), top_ks.tolist(),
                                top_ps.view(torch.float64).tolist(), seeds.tolist(), strict=True)
    ]
    return SamplingBatch.from_params(params, steps.tolist(), device)


def result_len(max_batch_size: int) -> int:
    return _FIXED + 2 * MAX_STAGES + max_batch_size


def encode_result(mb_id: int, tokens: torch.Tensor, counters: torch.Tensor, max_batch_size: int) -> torch.Tensor:
    out = torch.zeros(result_len(max_batch_size), dtype=torch.long)
    out[0], out[1] = mb_id, len(tokens)
    out[_FIXED:HEADER_LEN] = counters
    out[HEADER_LEN : HEADER_LEN + len(tokens)] = tokens.to("cpu", torch.long)
    return out


def decode_result(t: torch.Tensor) -> tuple[int, list[int], torch.Tensor]:
    mb_id, n = int(t[0]), int(t[1])
    return mb_id, t[HEADER_LEN : HEADER_LEN + n].tolist(), t[_FIXED:HEADER_LEN].clone()
