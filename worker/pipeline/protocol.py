"""Wire format of the stage-to-stage pipeline (DESIGN.md §3 "Pipeline transport").

Every micro-batch is three tensors sent in order to the next stage:
1. a header: int64[HEADER_LEN] — kind, micro-batch id, the micro-batch's `Layout` (sizes), and
   per-stage busy/idle counters (each stage writes its own before forwarding, so stage 0 learns
   everyone's accounting);
2. the packed micro-batch payload, int64[layout.payload_len], exactly as stage 0's `InputBuilder`
   packed it (`chariot.worker.micro_batch`): ids, positions, slot mapping, query_start_loc,
   seq_lens, block tables, sample rows and the sampling parameters;
3. the hidden states [num_tokens, hidden] in the model dtype.
Heartbeat and shutdown messages are a header only. The last stage answers stage 0 with a result:
int64[result_len] — micro-batch id, count, the stage counters, and the sampled token ids.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch

from chariot.worker.micro_batch import Layout

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
    layout: Layout = field(default_factory=Layout)


def encode_header(h: Header, stage_counters: torch.Tensor | None = None) -> torch.Tensor:
    out = torch.zeros(HEADER_LEN, dtype=torch.long)
    fixed = [int(h.kind), h.mb_id, *h.layout.to_list()]
    out[: len(fixed)] = torch.tensor(fixed)
    if stage_counters is not None:
        out[_FIXED:] = stage_counters
    return out


def decode_header(t: torch.Tensor) -> Header:
    v = t[:_FIXED].tolist()
    return Header(Kind(v[0]), v[1], Layout(*v[2 : _FIXED - 1]))


def counters_of(header: torch.Tensor) -> torch.Tensor:
    """The [2 * MAX_STAGES] busy/idle microsecond counters carried in a header or result."""
    return header[_FIXED:HEADER_LEN]


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
