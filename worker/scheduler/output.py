"""The scheduler → executor contract: a plain description of one iteration (one micro-batch).

The scheduler never touches tensors; the executor never makes scheduling decisions.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ScheduledChunk:
    """`num_tokens` tokens of sequence `seq_id`, starting at position `start`.

    Invariants: `num_tokens >= 1`; `start` equals the sequence's `num_computed_tokens` before this
    iteration; `samples` is True iff the chunk ends at the sequence's last known token, so the
    iteration produces its next token (a decode, or the final chunk of a prefill).
    """

    seq_id: int
    start: int
    num_tokens: int
    samples: bool


@dataclass(frozen=True)
class SchedulerOutput:
    """One iteration's batch.

    Invariants: decodes (single-token chunks of sequences whose context is cached) come first, then
    prefill chunks; a sequence appears at most once; `num_tokens <= token_budget` and
    `len(chunks) <= max_batch_size` of the scheduler that produced it.
    `preempted` lists sequences evicted (blocks freed, back to waiting) while building this batch.
    """

    chunks: tuple[ScheduledChunk, ...]
    preempted: tuple[int, ...] = ()
    num_decodes: int = 0

    @property
    def is_empty(self) -> bool:
        return not self.chunks

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)

    @property
    def num_seqs(self) -> int:
        return len(self.chunks)

    @property
    def num_prefill_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks[self.num_decodes :])

    @property
    def seq_ids(self) -> tuple[int, ...]:
        return tuple(c.seq_id for c in self.chunks)
