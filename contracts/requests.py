"""The request-level types every layer shares: what a prompt is, why a request finished, and when
each of its events happened. Torch-free, so the router, the worker and the benchmarks agree on them.
"""

from __future__ import annotations

import enum
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field

Prompt = str | Sequence[int]
"""A prompt as text, or as token ids that bypass the tokenizer."""


def new_request_id() -> str:
    """A fresh request id for a request whose client chose none (assigned at the front, so that every
    log line and response about the request carries the same id)."""
    return uuid.uuid4().hex


class FinishReason(str, enum.Enum):
    STOP = "stop"  # EOS, a stop token id or a stop string
    LENGTH = "length"  # max_tokens or max_model_len reached
    ABORT = "abort"  # cancelled by the client
    ERROR = "error"  # the engine failed this request (e.g. a pipeline stage died)


@dataclass
class RequestTimes:
    """Wall-clock timestamps (time.time()) of one request's life."""

    arrival: float
    first_scheduled: float | None = None
    first_token: float | None = None
    token_times: list[float] = field(default_factory=list)
    finished: float | None = None

    @property
    def ttft(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.arrival

    def latest(self, num_tokens: int) -> RequestTimes:
        """A copy with only the times of the last `num_tokens` tokens (what one delta carries)."""
        recent = self.token_times[len(self.token_times) - num_tokens:] if num_tokens > 0 else []
        return RequestTimes(self.arrival, self.first_scheduled, self.first_token, recent, self.finished)

    @property
    def tbt(self) -> list[float]:
        """Gaps between consecutive output tokens (time between tokens)."""
        return [b - a for a, b in zip(self.token_times, self.token_times[1:], strict=False)]
