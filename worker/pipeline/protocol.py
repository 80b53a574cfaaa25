"""Wire format of the stage-to-stage pipeline (docs/architecture.md §3 "Pipeline transport").

Every micro-batch is three tensors sent in order to the next stage:
1. a header: int64[HEADER_LEN] — kind, micro-batch id, the micro-batch's `Layout` (sizes), and
   per-stage busy/idle counters (each stage writes its own before forwarding, so stage 0 learns
   everyone's accounting);
2. the packed micro-batch payload, int64[layout.payload_len], exactly as stage 0's `InputBuilder`
   packed it (`chariot.worker.micro_batch`): ids, positions, slot mapping, query_start_loc,
   seq_lens, block tables, sample rows and the sampling parameters;
3. the hidden states [num_tokens, hidden] in the model dtype.
Heartbeat and shutdown messages are a header only. The last stage answers stage 0 with a result:
int64[result_len] — micro-batch id, count, logprob width, the stage counters, and the sampled token
ids — followed, when a row asked for logprobs (width K >= 0), by int64[N * (1 + 2K)]: the [N, 1 + K]
float32 logprobs (as float64 bit patterns) and the [N, K] token ids of `SamplerOutput`.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch

from chariot.worker.micro_batch import NO_LOGPROBS, Layout
from chariot.worker.sampler import SamplerOutput

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
    return Header(Kind(v[0]), v[1], Layout(*v[2:_FIXED]))


def counters_of(header: torch.Tensor) -> torch.Tensor:
    """The [2 * MAX_STAGES] busy/idle microsecond counters carried in a header or result."""
    return header[_FIXED:HEADER_LEN]


def result_len(max_batch_size: int) -> int:
    return _FIXED + 2 * MAX_STAGES + max_batch_size


def encode_result(mb_id: int, out: SamplerOutput, counters: torch.Tensor, max_batch_size: int) -> list[torch.Tensor]:
    """The tensors that carry a result to stage 0: the fixed-size result, then the logprobs if any."""
    tokens = out.token_ids
    res = torch.zeros(result_len(max_batch_size), dtype=torch.long)
    width = NO_LOGPROBS if out.top_ids is None else out.top_ids.shape[1]
    res[0], res[1], res[2] = mb_id, len(tokens), width
    res[_FIXED:HEADER_LEN] = counters
    res[HEADER_LEN : HEADER_LEN + len(tokens)] = tokens.to("cpu", torch.long)
    if out.logprobs is None or out.top_ids is None:
        return [res]
    bits = out.logprobs.to("cpu", torch.float64).view(torch.long).reshape(-1)
    return [res, torch.cat([bits, out.top_ids.to("cpu", torch.long).reshape(-1)])]


def logprobs_len(result: torch.Tensor) -> int:
    """Length of the logprobs tensor that follows `result` (0: none follows)."""
    n, width = int(result[1]), int(result[2])
    return 0 if width == NO_LOGPROBS else n * (1 + 2 * width)


def decode_result(t: torch.Tensor, logprobs: torch.Tensor | None = None) -> tuple[int, SamplerOutput, torch.Tensor]:
    """(micro-batch id, sampled tokens, stage counters) from a result and its logprobs tensor."""
    mb_id, n, width = int(t[0]), int(t[1]), int(t[2])
    out = SamplerOutput(t[HEADER_LEN : HEADER_LEN + n].clone())
    if logprobs is not None and width != NO_LOGPROBS:
        split = n * (1 + width)
        lps = logprobs[:split].view(torch.float64).reshape(n, 1 + width).float()
        out = SamplerOutput(out.token_ids, lps, logprobs[split:].reshape(n, width).clone())
    return mb_id, out, t[_FIXED:HEADER_LEN].clone()
