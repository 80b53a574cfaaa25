"""Per-request state owned by stage 0: tokens so far, progress through the KV cache, and timestamps.

One `Sequence` per request (no beam search / n > 1). The scheduler moves it between WAITING and
RUNNING; the engine appends sampled tokens and decides when it is finished.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from chariot.contracts.requests import FinishReason, RequestTimes
from chariot.contracts.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Sequence:
    """Mutable state of one request.

    Invariants:
    - `0 <= num_computed_tokens <= num_tokens`; tokens `[0, num_computed_tokens)` have (or, while the
      sequence is in flight, will have) their KV in the cache.
    - A RUNNING sequence holds blocks covering at least `num_computed_tokens` tokens (its first blocks
      possibly shared with other sequences through the prefix cache, never written by it again).
    - `in_flight` counts the batches holding the sequence, from the moment the scheduler puts it in
      one until the engine has processed that batch's output. Without scheduling ahead it is 0 or 1
      and an in-flight sequence is never scheduled again; scheduling ahead
      (`SchedulerConfig.ahead`) may put it in the next batch too, so it reaches 2.
    - `num_pending` counts tokens sampled by scheduled batches whose output the engine has not yet
      processed: placeholders, counted in `num_tokens` (their positions are taken) but not yet in
      `output_token_ids`. A pending token's value lives on the device until then.
    """

    seq_id: int
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float = field(default_factory=time.time)
    output_token_ids: list[int] = field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed_tokens: int = 0
    in_flight: int = 0
    num_pending: int = 0
    num_preemptions: int = 0
    num_cached_tokens: int = 0
    """Prompt tokens whose KV came from the prefix cache instead of being computed (summed over
    admissions: a preempted sequence may hit its own blocks again)."""
    cached_prompt_tokens: int = 0
    """Prompt tokens found in the prefix cache when the sequence was first admitted (at most
    `prompt_len - 1`): what it reports as cached (OpenAI's `cached_tokens`). A re-admission after
    preemption hits blocks the request computed itself and leaves it unchanged."""
    finish_reason: FinishReason | None = None
    error: str | None = None
    times: RequestTimes = field(init=False)

    def __post_init__(self) -> None:
        self.times = RequestTimes(arrival=self.arrival_time)

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        """Prompt, output and pending tokens: the length the next scheduled chunk continues from."""
        return len(self.prompt_token_ids) + len(self.output_token_ids) + self.num_pending

    @property
    def num_known_tokens(self) -> int:
        """Prompt and output tokens whose values the host holds (pending ones excluded)."""
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_remaining(self) -> int:
        """Tokens still to run through the model before the next token can be sampled."""
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_decode(self) -> bool:
        """True once the whole context is cached and only the newest token is left to process."""
        return self.num_computed_tokens > 0 and self.num_remaining == 1

    def append_sampled(self, token: int) -> None:
        """The oldest pending token's value reached the host: it becomes the next output token."""
        if self.num_pending < 1:
            raise RuntimeError(f"sequence {self.seq_id} has no pending token for {token}")
        self.num_pending -= 1
        self.output_token_ids.append(token)

    def token_slice(self, start: int, stop: int) -> list[int]:
        """Tokens [start, stop) across prompt and output, copying only that range."""
        plen = self.prompt_len
        if start >= plen:
            return self.output_token_ids[start - plen : stop - plen]
        if stop <= plen:
            return self.prompt_token_ids[start:stop]
        return self.prompt_token_ids[start:] + self.output_token_ids[: stop - plen]
