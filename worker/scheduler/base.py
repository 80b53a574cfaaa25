"""Scheduler base: request queues, block accounting and preemption shared by every policy.

A policy only decides *which* sequences get *how many* tokens this iteration; the mechanics
(growing block tables for decodes, preempting by recompute, serving prompts in `prefill_order`,
in-flight exclusion for pipelining) live here once. `schedule()` never blocks and never touches tensors.
"""

from __future__ import annotations

import math
import time
from abc import ABC, abstractmethod
from collections import deque
from dataclasses import dataclass

from chariot.contracts.policies import get_policy
from chariot.worker.block_manager import BlockManager
from chariot.worker.scheduler.output import ScheduledChunk, SchedulerOutput
from chariot.worker.sequence import Sequence, SequenceStatus


@dataclass(frozen=True)
class SchedulerConfig:
    """Validated by `EngineConfig`; `token_budget` is already resolved for the policy."""

    policy: str
    token_budget: int
    max_batch_size: int
    max_model_len: int
    attention_cost: float = 0.0
    """Token-equivalents of one (query, key) pair of a prefill chunk's attention (`ModelConfig.
    attention_cost`); 0 sizes chunks by their tokens alone. See `chunk_tokens`. It applies only to
    iterations that hold decodes: the shrinking bounds their time between tokens, and an iteration of
    prompt chunks alone has no token to delay, so it takes the whole budget."""
    ahead: bool = False
    """Schedule ahead: a sequence in flight in one batch may join the next one too, which the engine
    builds while the first still runs. Its next prompt chunk is known; its next decode takes the
    token the first batch samples, still on the device (`ahead_ok` says when that is allowed)."""
    prefill_order: str = "fcfs"
    """Which prompts get the budget left after the decodes. `fcfs`: arrival order. `shortest`: the
    fewest prompt tokens left first, aged so nothing starves (`Scheduler.prefill_rank`)."""

    @property
    def max_running(self) -> int:
        """Cap on running sequences so every running decode always fits in one iteration."""
        return min(self.max_batch_size, self.token_budget)


class BatchBuilder:
    """Accumulates one iteration's chunks under the token budget and batch-size cap."""

    def __init__(self, token_budget: int, max_seqs: int) -> None:
        self.token_budget = token_budget
        self.max_seqs = max_seqs
        self.chunks: list[ScheduledChunk] = []
        self.num_tokens = 0
        self.num_decodes = 0
        self.preempted: list[int] = []
        self.seq_ids: set[int] = set()

    @property
    def tokens_left(self) -> int:
        return self.token_budget - self.num_tokens

    @property
    def has_room(self) -> bool:
        return self.tokens_left > 0 and len(self.chunks) < self.max_seqs

    def add(self, seq: Sequence, num_tokens: int, decode: bool = False) -> None:
        """Add a chunk; decodes (`decode=True`) must all come before the first prefill chunk. A
        prefill whose cached prefix leaves a single token is a one-token prefill chunk, not a decode."""
        if decode and self.num_decodes != len(self.chunks):
            raise ValueError("decodes must be added before prefill chunks")
        end = seq.num_computed_tokens + num_tokens
        self.chunks.append(ScheduledChunk(seq.seq_id, seq.num_computed_tokens, num_tokens, end == seq.num_tokens))
        self.num_tokens += num_tokens
        self.seq_ids.add(seq.seq_id)
        if decode:
            self.num_decodes += 1

    def build(self) -> SchedulerOutput:
        return SchedulerOutput(tuple(self.chunks), tuple(self.preempted), self.num_decodes)


class Scheduler(ABC):
    """Iteration-level scheduler over one block manager; subclasses implement `_fill`."""

    def __init__(self, config: SchedulerConfig, block_manager: BlockManager) -> None:
        self.config = config
        self.chunked_prefill = get_policy(config.policy).chunks_prefills
        self.blocks = block_manager
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # admission order, oldest first
        self.seqs: dict[int, Sequence] = {}
        self.num_preemptions = 0
        self.prefix_query_tokens = 0  # prompt tokens looked up in the prefix cache at admission
        self.prefix_hit_tokens = 0  # of those, tokens whose KV was found cached
        self.iteration = 0  # schedule() calls so far: the clock prompts age by
        self._queued_at: dict[int, int] = {}  # seq_id -> iteration it was added (kept through preemption)

    # ---- request lifecycle -------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        self.seqs[seq.seq_id] = seq
        self.waiting.append(seq)
        self._queued_at[seq.seq_id] = self.iteration

    def finish(self, seq: Sequence) -> None:
        """Retire a sequence (finished or aborted) and free its blocks."""
        seq.status = SequenceStatus.FINISHED
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.blocks.free(seq.seq_id)
        self.seqs.pop(seq.seq_id, None)
        self._queued_at.pop(seq.seq_id, None)

    @property
    def has_unfinished(self) -> bool:
        return bool(self.seqs)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def queued_prefill_tokens(self) -> int:
        """Prompt tokens not yet computed, over waiting and partially prefilled sequences."""
        return sum(s.num_remaining for s in self.seqs.values() if not s.is_decode and not s.in_flight)

    # ---- one iteration -----------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        """Pick the next batch; marks its sequences in flight and advances their progress."""
        builder = BatchBuilder(self.config.token_budget, self.config.max_batch_size)
        self._fill(builder)
        self.iteration += 1
        now = time.time()
        for chunk in builder.chunks:
            seq = self.seqs[chunk.seq_id]
            seq.num_computed_tokens += chunk.num_tokens
            seq.in_flight += 1
            seq.num_pending += chunk.samples
            if seq.times.first_scheduled is None:
                seq.times.first_scheduled = now
        return builder.build()

    def complete(self, output: SchedulerOutput) -> None:
        """The batch's results are processed: its sequences may be scheduled again, and the blocks it
        filled (their KV now written on every stage) may be shared through the prefix cache."""
        for chunk in output.chunks:
            seq = self.seqs.get(chunk.seq_id)
            if seq is not None:
                seq.in_flight -= 1
                self.blocks.register_computed(seq.seq_id, seq.token_slice, chunk.start + chunk.num_tokens)

    @abstractmethod
    def _fill(self, builder: BatchBuilder) -> None:
        """Add this iteration's chunks to `builder` (decodes first)."""

    # ---- shared mechanics --------------------------------------------------------------------
    def _idle_running(self) -> list[Sequence]:
        """Running sequences this batch may take: those in no batch, and, scheduling ahead, those in
        one batch whose next chunk may follow it at once."""
        if not self.config.ahead:
            return [s for s in self.running if not s.in_flight]
        return [s for s in self.running if not s.in_flight or (s.in_flight == 1 and self.ahead_ok(s))]

    def ahead_ok(self, seq: Sequence) -> bool:
        """Whether an in-flight sequence's next chunk may go into the next batch before its output is
        processed: always for a prompt chunk (its tokens are known); for a decode of the pending token,
        only if its request needs no output token values on the host to sample (penalties and the
        min_tokens ban read them), and that token cannot be its last by length (max_tokens,
        max_model_len), which would make the decode a step past its end."""
        if seq.num_pending == 0:
            return True
        params = seq.params
        if params.penalized or params.min_tokens:
            return False
        outputs = len(seq.output_token_ids) + seq.num_pending
        return outputs < params.max_tokens and seq.num_tokens < self.config.max_model_len

    def _schedule_decodes(self, builder: BatchBuilder) -> None:
        """Give every idle running decode one token, preempting the newest requests for room."""
        for seq in self._idle_running():
            if not seq.is_decode or seq.status is not SequenceStatus.RUNNING:
                continue  # preempted earlier in this loop, or still prefilling
            if not self._reserve_decode_slot(seq, builder):
                continue  # preempted itself
            builder.add(seq, 1, decode=True)

    def _reserve_decode_slot(self, seq: Sequence, builder: BatchBuilder) -> bool:
        if self.blocks.covers(seq.seq_id, seq.num_tokens):  # room in its last block: most decode steps
            return True
        if seq.in_flight:  # scheduled ahead: a sequence in flight is never preempted; it waits a step
            if not self.blocks.can_grow(seq.seq_id, seq.num_tokens):
                return False
            self.blocks.grow(seq.seq_id, seq.num_tokens)
            return True
        while not self.blocks.can_grow(seq.seq_id, seq.num_tokens):
            victim = self._preemption_victim(seq, builder)
            self._preempt(victim, builder)
            if victim is seq:
                return False
        self.blocks.grow(seq.seq_id, seq.num_tokens)
        return True

    def _preemption_victim(self, needy: Sequence, builder: BatchBuilder) -> Sequence:
        for cand in reversed(self.running):
            if cand is needy or not (cand.in_flight or cand.seq_id in builder.seq_ids):
                return cand
        return needy

    def _preempt(self, seq: Sequence, builder: BatchBuilder) -> None:
        """Preemption by recompute: drop the KV, requeue at the front of the waiting queue."""
        self.running.remove(seq)
        self.blocks.free(seq.seq_id)
        seq.status = SequenceStatus.WAITING
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)
        builder.preempted.append(seq.seq_id)

    def prefill_rank(self, seq: Sequence) -> tuple[int, int, int]:
        """Sort key of a prompt under `shortest` order: its tokens left, less one token budget for
        every iteration since it arrived; then arrival order.

        Why aged by the budget: an iteration moves at most one budget of work, so a prompt of L
        tokens is passed only by prompts that arrive within L / budget iterations after it: it waits
        behind at most about its own length of newer work and never starves. The ageing needs no
        clock, so the engine and the simulator rank the same queue the same way."""
        return (seq.num_remaining - self.iterations_waited(seq) * self.config.token_budget,
                self._queued_at[seq.seq_id], seq.seq_id)

    def iterations_waited(self, seq: Sequence) -> int:
        """Iterations scheduled since `seq` was added (its age on the clock `prefill_rank` ages by)."""
        return self.iteration - self._queued_at[seq.seq_id]

    def _schedule_prefills(self, builder: BatchBuilder) -> None:
        """Give the budget left after the decodes to prompts: ongoing ones, then new ones in arrival
        order (`fcfs`), or all of them by `prefill_rank` (`shortest`)."""
        if self.config.prefill_order == "fcfs":
            self._schedule_partial_prefills(builder)
            self._admit_waiting(builder)
            return
        ongoing = [s for s in self._idle_running() if not s.is_decode and s.seq_id not in builder.seq_ids]
        admitting = True
        for seq in sorted([*ongoing, *self.waiting], key=self.prefill_rank):
            if not builder.has_room:
                return
            if seq.status is SequenceStatus.RUNNING:
                self._add_prefill_chunk(seq, builder)
            elif admitting:  # a prompt that does not fit stops newer-ranked ones overtaking it for good
                admitting = self._admit(seq, builder)

    def _schedule_partial_prefills(self, builder: BatchBuilder) -> None:
        for seq in self._idle_running():
            if seq.is_decode or seq.seq_id in builder.seq_ids or not builder.has_room:
                continue
            self._add_prefill_chunk(seq, builder)

    def _admit_waiting(self, builder: BatchBuilder) -> None:
        """Admission in queue order (arrival, or `prefill_rank` under `shortest`): the first prompt
        that does not fit blocks the rest."""
        if self.config.prefill_order == "fcfs":
            queue = list(self.waiting)
        else:
            queue = sorted(self.waiting, key=self.prefill_rank)
        for seq in queue:
            if not (builder.has_room and self._admit(seq, builder)):
                return

    def _admit(self, seq: Sequence, builder: BatchBuilder) -> bool:
        """Move a waiting sequence to running with its blocks and first chunk; False if it does not fit."""
        if len(self.running) >= self.config.max_running:
            return False
        hit = self.blocks.cached_prefix(seq.token_slice(0, seq.num_tokens))
        if not self.chunked_prefill and seq.num_tokens - hit.num_tokens > builder.tokens_left:
            return False
        if not self.blocks.can_admit(seq.num_tokens, hit):
            return False
        self.waiting.remove(seq)
        self.blocks.allocate(seq.seq_id, seq.num_tokens, hit)
        seq.num_computed_tokens = hit.num_tokens
        seq.num_cached_tokens += hit.num_tokens
        if seq.num_preemptions == 0:  # first admission: nothing of it computed by the request itself
            seq.cached_prompt_tokens = hit.num_tokens
        self.prefix_query_tokens += seq.num_tokens
        self.prefix_hit_tokens += hit.num_tokens
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)
        self._add_prefill_chunk(seq, builder)
        return True

    def _add_prefill_chunk(self, seq: Sequence, builder: BatchBuilder) -> None:
        if self.chunked_prefill:  # shrunk by its attention only where decodes share the iteration
            cost = self.config.attention_cost if builder.num_decodes else 0.0
            room = chunk_tokens(builder.tokens_left, seq.num_computed_tokens, cost)
            size = min(seq.num_remaining, room)
        else:
            size = seq.num_remaining
        if size > 0 and size <= builder.tokens_left:
            builder.add(seq, size)


def chunk_tokens(room: int, start: int, attention_cost: float) -> int:
    """How many prompt tokens a chunk starting after `start` cached tokens may hold in `room` tokens
    of budget, so that it costs no more than a chunk of `room` tokens with no cached context.

    A chunk of c tokens at `start` computes c·(start + c) attention pairs besides its c tokens of
    linear layers: late chunks of long prompts cost more per token, and at a fixed token count the
    iterations holding them would exceed the time the budget was sized for (a TBT stall on every
    running decode). With ρ = `attention_cost`, c is the largest integer with
    c + ρ·c·(start + c) ≤ room + ρ·room², at least 1 so the prompt always progresses.
    """
    if attention_cost <= 0.0 or room <= 0 or start <= 0:
        return room
    limit = room + attention_cost * room * room
    b = 1.0 + attention_cost * start
    # the positive root of ρc² + bc - limit, in the form without cancellation: 2·limit / (b + √(b² + 4ρ·limit))
    c = min(room, int(2.0 * limit / (b + math.sqrt(b * b + 4.0 * attention_cost * limit))))
    while c > 1 and c + attention_cost * c * (start + c) > limit:  # the root's round-off, either way
        c -= 1
    while c < room and (c + 1) + attention_cost * (c + 1) * (start + c + 1) <= limit:
        c += 1
    return max(1, c)
