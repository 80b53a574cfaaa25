"""The engine loop of one pipeline group's driver: `add_request / step / finish_requests`.

Each `step()` is schedule → prepare inputs → execute → postprocess and returns a `StepResult`
(`engine_output.py`): per-request token deltas plus the batch, times and load of that step. The
engine works on token ids only — EOS / stop token ids, max_tokens, max_model_len, aborts, errors;
text (detokenization, stop strings) is the `OutputProcessor`'s, which asks the engine to finish a
request through `finish_requests` when a stop string matches. Execution goes through an `Executor`
so the same loop drives a single process (`ModelRunner`) or a pipeline of stages. All request
validation happens in `add_request`; a bad request raises `InvalidRequestError` and leaves every
other request untouched. `validate_prompt` is the one place the worker encodes a text prompt.
"""

from __future__ import annotations

import functools
import itertools
import os
import socket
import time
import uuid
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import replace
from typing import Protocol

import torch

from chariot.contracts.errors import ConfigError, EngineDeadError, InvalidRequestError, PipelineError
from chariot.contracts.outputs import EngineStats, IterationTimes, TokenLogprobs
from chariot.contracts.requests import FinishReason, Prompt
from chariot.contracts.sampling_params import SamplingParams
from chariot.contracts.tokenizer import Tokenizer
from chariot.worker.block_manager import BlockManager
from chariot.worker.config import EngineConfig, ResolvedConfig
from chariot.worker.engine_output import NO_TIMES, EngineOutput, StageTime, StepResult
from chariot.worker.executor import InputBuilder, LocalExecutor
from chariot.worker.micro_batch import MicroBatch, TokenCarry
from chariot.worker.pipeline.driver import PipelineExecutor
from chariot.worker.pipeline.transport import PeerCheck, Topology, adopted_socket
from chariot.worker.runtime import build_stage_runtime
from chariot.worker.sampler import SamplerOutput
from chariot.worker.scheduler import SchedulerConfig, SchedulerOutput, make_scheduler
from chariot.worker.sequence import Sequence


class Executor(Protocol):
    """Runs batches; up to `max_in_flight` may be submitted before the oldest result is awaited.

    `wait()` returns the sampled token id of every sampling chunk of the oldest submitted batch, in
    chunk order (with logprobs for the rows that asked). A broken pipeline raises `PipelineError`
    from submit/wait and sets `failed`.
    """

    max_in_flight: int
    failed: str | None

    def submit(self, inp: MicroBatch, carry: TokenCarry | None = None) -> None:
        """Run (or queue) a batch; `carry` rows take their input token from the previous batch's
        sampled tokens on the device (only an executor that allows two batches of one engine
        scheduling ahead is given one)."""
        ...

    def wait(self) -> SamplerOutput: ...

    def bubble_fraction(self) -> float: ...

    def shutdown(self) -> None: ...


def schedules_ahead(config: EngineConfig, device: torch.device) -> bool:
    """Whether the engine builds batch N+1 while batch N runs (`async_scheduling`): `auto` does on a
    GPU, where the device would otherwise wait for the host between steps, for one rank alone (a
    pipeline already keeps several micro-batches in flight; tensor-parallel followers receive the
    micro-batch, not the device's tokens). `on` asks for it anywhere a single rank runs (on a CPU the
    host does the model's work too: nothing overlaps, the schedule is the same)."""
    single_rank = config.world_size == 1
    if config.async_scheduling == "on" and not single_rank:
        raise ConfigError("async_scheduling", f"'on' needs a single rank (pipeline_stages=1, tensor_parallel_size=1); "
                                              f"got {config.pipeline_stages} stage(s) × {config.tensor_parallel_size}; "
                                              f"use 'auto' or 'off'")
    if config.async_scheduling == "auto":
        return single_rank and device.type == "cuda"
    return config.async_scheduling == "on"


class Engine:
    """Single-driver LLM engine: scheduler + block manager on this process, model via an executor."""

    def __init__(self, config: EngineConfig, progress: bool = True, topology: Topology | None = None,
                 peer_check: PeerCheck | None = None) -> None:
        self.config = config
        self.resolved = r = ResolvedConfig.resolve(config)
        self.model_config, self.max_model_len, self.token_budget = r.model, r.max_model_len, r.token_budget
        self.device, self.dtype = r.device, r.dtype
        self.tokenizer = Tokenizer(config.model)
        self.eos_token_ids = frozenset(self.model_config.eos_token_ids) | frozenset(self.tokenizer.eos_token_ids)

        self.executor, num_blocks = self._make_executor(topology, progress, peer_check)
        self.ahead = schedules_ahead(config, self.device)
        self._depth = 2 if self.ahead else self.executor.max_in_flight  # batches in flight at once
        self.blocks = BlockManager(num_blocks, config.block_tokens, config.watermark, config.prefix_caching)
        self.scheduler = make_scheduler(
            SchedulerConfig(config.policy, self.token_budget, config.max_batch_size, self.max_model_len,
                            self.model_config.attention_cost if config.attention_aware_chunks else 0.0,
                            ahead=self.ahead, prefill_order=config.prefill_order),
            self.blocks,
        )
        self.inputs = InputBuilder(self.blocks, self.eos_token_ids)
        self.failed: str | None = None
        self._in_flight: deque[SchedulerOutput] = deque()
        self._seq_ids = itertools.count()
        self._by_request: dict[str, Sequence] = {}
        self.iterations = 0
        self.carried_tokens = 0  # decode inputs taken on the device from the batch before (scheduling ahead)
        self._last_iteration_s = 0.0
        self._stage_reported = (0.0, 0.0)  # stage 0's busy/idle seconds up to the previous step result

    def _make_executor(self, topology: Topology | None, progress: bool, peer_check: PeerCheck | None,
                       ) -> tuple[Executor, int]:
        stages, world = self.config.pipeline_stages, self.config.world_size
        if world > 1 and (topology is None or topology.rank != 0):
            raise ConfigError("pipeline_stages", f"a pipelined or tensor-parallel engine runs on rank 0 of its group "
                                                 f"of {world} ranks")
        runtime = build_stage_runtime(self.resolved, topology if world > 1 else None, progress, peer_check)
        self._collectives = runtime.runner.stage.tp
        executor: Executor
        if stages == 1:
            executor = LocalExecutor(runtime.runner, runtime.close if runtime.link is not None else None)
        else:
            executor = PipelineExecutor(runtime)
        return executor, runtime.kv_cache.num_blocks

    # ---- requests ----------------------------------------------------------------------------
    def add_request(
        self,
        prompt: Prompt,
        params: SamplingParams | None = None,
        request_id: str | None = None,
        arrival_time: float | None = None,
    ) -> str:
        """Validate and queue a request; returns its id. Raises InvalidRequestError on bad input."""
        if self.failed is not None:
            raise EngineDeadError(f"engine failed and accepts no requests: {self.failed}")
        params = params or SamplingParams()
        request_id = request_id or uuid.uuid4().hex
        if request_id in self._by_request:
            raise InvalidRequestError("request_id", f"{request_id!r} is already in use")
        token_ids = self.validate_prompt(prompt, params)
        seq = Sequence(next(self._seq_ids), request_id, token_ids, params, arrival_time or time.time())
        self._by_request[request_id] = seq
        self.scheduler.add(seq)
        return request_id

    def validate_prompt(self, prompt: Prompt, params: SamplingParams) -> list[int]:
        """Tokenize and check a prompt against the model's limits."""
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidRequestError("prompt", "must not be empty")
            token_ids = self.tokenizer.encode(prompt)
        else:
            token_ids = list(prompt)
            vocab = self.model_config.vocab_size
            if any(isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab for t in token_ids):
                raise InvalidRequestError("prompt", f"token ids must be integers in [0, {vocab})")
        if not token_ids:
            raise InvalidRequestError("prompt", "must contain at least one token")
        vocab = self.model_config.vocab_size
        for name, ids in (("stop_token_ids", params.stop_token_ids), ("logit_bias", [t for t, _ in params.logit_bias])):
            bad = next((t for t in ids if t >= vocab), None)
            if bad is not None:
                raise InvalidRequestError(name, f"token id {bad} is out of the vocabulary [0, {vocab})")
        if len(token_ids) >= self.max_model_len:
            raise InvalidRequestError(
                "prompt",
                f"is {len(token_ids)} tokens; max_model_len is {self.max_model_len} (prompt must leave room "
                "for at least one generated token)",
            )
        if len(token_ids) + params.max_tokens > self.max_model_len:
            raise InvalidRequestError(
                "max_tokens",
                f"prompt ({len(token_ids)} tokens) + max_tokens ({params.max_tokens}) exceeds max_model_len "
                f"({self.max_model_len}); max_tokens may be at most {self.max_model_len - len(token_ids)}",
            )
        return token_ids

    def finish_requests(self, request_ids: Iterable[str], reason: FinishReason) -> tuple[EngineOutput, ...]:
        """Finish live requests now (free their KV blocks) with `reason`; unknown ids are skipped.

        The output processor calls this with STOP when a stop string matched; `abort` with ABORT.
        Returns each finished request's last output (no new tokens). A request still in an in-flight
        micro-batch is finished too: that batch's token for it is dropped when it comes back.
        """
        outputs = []
        for request_id in request_ids:
            seq = self._by_request.get(request_id)
            if seq is not None:
                self._finish(seq, reason)
                outputs.append(self._output(seq, ()))
        return tuple(outputs)

    def abort(self, request_id: str) -> EngineOutput | None:
        """Cancel a request and free its KV blocks; returns its final output, or None if unknown."""
        outputs = self.finish_requests([request_id], FinishReason.ABORT)
        return outputs[0] if outputs else None

    @property
    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished

    # ---- the loop ----------------------------------------------------------------------------
    def step(self) -> StepResult:
        """Fill the pipeline (schedule → prepare → submit, up to `max_in_flight` batches; scheduling
        ahead, the next batch goes in before the one in flight is awaited), then wait for the oldest
        batch and postprocess it. Returns the token deltas of the requests that
        changed, with the completed batch, its times and the load after it."""
        if self.failed is not None:
            return self._result(())
        t0 = time.perf_counter()
        sched = prep = 0.0
        try:
            while len(self._in_flight) < self._depth:
                t = time.perf_counter()
                batch = self.scheduler.schedule()
                if batch.is_empty:
                    break
                t1 = time.perf_counter()
                seqs = self.scheduler.seqs
                inp = self.inputs.build(batch, seqs)
                carry = self.inputs.carry(batch, seqs, self._in_flight[-1] if self._in_flight else None)
                sched, prep = sched + t1 - t, prep + time.perf_counter() - t1
                self.carried_tokens += 0 if carry is None else len(carry.rows)
                self.executor.submit(inp, carry)
                self._in_flight.append(batch)
            if not self._in_flight:
                return self._result(())
            sampled = self.executor.wait()
        except PipelineError as exc:
            return self._result(self._fail_all(str(exc)))
        t2 = time.perf_counter()
        batch = self._in_flight.popleft()
        outputs = self.process_output(batch, sampled)
        times = IterationTimes(sched, prep, t2 - t0 - sched - prep, time.perf_counter() - t2)
        self._last_iteration_s = times.total
        self.iterations += 1
        return self._result(outputs, batch, times)

    def _result(self, outputs: Iterable[EngineOutput], batch: SchedulerOutput | None = None,
                times: IterationTimes = NO_TIMES) -> StepResult:
        return StepResult(tuple(outputs), batch, times, self.stats(), self._stage_time(), time.time())

    def _stage_time(self) -> StageTime | None:
        """Stage 0's busy/idle increment since the previous step result; None without a pipeline."""
        clock = getattr(self.executor, "clock", None)  # a pipeline's stage 0 keeps busy/idle time
        if clock is None:
            return None
        busy, idle = float(clock.busy_s), float(clock.idle_s)
        before_busy, before_idle = self._stage_reported
        self._stage_reported = (busy, idle)
        return StageTime(0, busy - before_busy, idle - before_idle)

    def check_health(self) -> tuple[EngineOutput, ...]:
        """Notice a pipeline failure detected while idle (heartbeats); fails all live requests."""
        if self.failed is None and self.executor.failed is not None:
            return self._fail_all(self.executor.failed)
        return ()

    def _fail_all(self, message: str) -> tuple[EngineOutput, ...]:
        """The group is broken: every live request finishes with an error, no new ones are taken."""
        self.failed = message
        self._in_flight.clear()
        for seq in self._by_request.values():
            seq.error = message
        return self.finish_requests(list(self._by_request), FinishReason.ERROR)

    def shutdown(self) -> None:
        """Stop the executor (and, for a pipeline, every downstream stage)."""
        self.executor.shutdown()

    def process_output(self, batch: SchedulerOutput, sampled: SamplerOutput) -> list[EngineOutput]:
        """Append sampled tokens (one per sampling chunk, in chunk order), apply token stop
        conditions, free finished requests' blocks."""
        self.scheduler.complete(batch)
        now = time.time()
        outputs = []
        sampled = sampled.to_host()  # one copy back per tensor, not one per row
        tokens = sampled.token_ids.tolist()
        live = self.scheduler.seqs
        sampling_chunks = [c for c in batch.chunks if c.samples]
        for row, (chunk, token) in enumerate(zip(sampling_chunks, tokens, strict=True)):
            seq = live.get(chunk.seq_id)
            if seq is None:  # finished (aborted, stopped) while in flight
                continue
            outputs.append(self._append_token(seq, token, now, sampled.logprobs_of(row, seq.params.logprobs)))
        return outputs

    def _append_token(self, seq: Sequence, token: int, now: float, logprob: TokenLogprobs | None = None,
                      ) -> EngineOutput:
        seq.append_sampled(token)
        if seq.times.first_token is None:
            seq.times.first_token = now
        seq.times.token_times.append(now)
        reason = self._stop_reason(seq, token)
        if reason is not None:
            self._finish(seq, reason)
        return self._output(seq, (token,), stop_token_id=token if reason is FinishReason.STOP else None,
                            logprobs=() if logprob is None else (logprob,))

    def _stop_reason(self, seq: Sequence, token: int) -> FinishReason | None:
        """The engine's own stop conditions (token ids and lengths; stop strings are not its business)."""
        params = seq.params
        if token in params.stop_token_ids or (not params.ignore_eos and token in self.eos_token_ids):
            return FinishReason.STOP
        if len(seq.output_token_ids) >= params.max_tokens or seq.num_known_tokens >= self.max_model_len:
            return FinishReason.LENGTH
        return None

    def _finish(self, seq: Sequence, reason: FinishReason) -> None:
        seq.finish_reason = reason
        seq.times.finished = time.time()
        self.scheduler.finish(seq)
        del self._by_request[seq.request_id]

    @staticmethod
    def _output(seq: Sequence, new_tokens: tuple[int, ...], stop_token_id: int | None = None,
                logprobs: tuple[TokenLogprobs, ...] = ()) -> EngineOutput:
        return EngineOutput(
            request_id=seq.request_id,
            new_token_ids=new_tokens,
            num_output_tokens=len(seq.output_token_ids),
            finish_reason=seq.finish_reason,
            prompt_token_ids=seq.prompt_token_ids,
            times=seq.times.latest(len(new_tokens)),
            stop_token_id=stop_token_id,
            num_preemptions=seq.num_preemptions,
            error=seq.error,
            new_logprobs=logprobs,
            num_cached_tokens=seq.cached_prompt_tokens,
        )

    # ---- reporting ---------------------------------------------------------------------------
    def stats(self) -> EngineStats:
        return EngineStats(
            num_waiting=self.scheduler.num_waiting,
            num_running=self.scheduler.num_running,
            queued_prefill_tokens=self.scheduler.queued_prefill_tokens(),
            kv_cache_usage=self.blocks.usage,
            num_free_blocks=self.blocks.num_free_blocks,
            num_blocks=self.blocks.num_blocks,
            token_budget=self.token_budget,
            max_batch_size=self.config.max_batch_size,
            num_preemptions=self.scheduler.num_preemptions,
            last_iteration_s=self._last_iteration_s,
            iterations=self.iterations,
            pipeline_stages=self.config.pipeline_stages,
            bubble_fraction=self.executor.bubble_fraction(),
            prefix_cache_queries=self.scheduler.prefix_query_tokens,
            prefix_cache_hits=self.scheduler.prefix_hit_tokens,
            tensor_parallel_size=self.config.tensor_parallel_size,
            collective_s=self._collectives.collective_s,
        )


def engine_factory(config: EngineConfig, topology: Topology | None) -> Callable[[], Engine]:
    """A picklable builder of stage 0's engine (the engine core may build it in a child process).

    A rendezvous socket reserved by the launcher (`Topology.listen_fd`) travels in it as a socket, not
    a number: pickled into the child, it arrives as a descriptor duplicated there, under a number of
    its own (multiprocessing's socket reduction)."""
    if topology is None or topology.listen_fd is None:
        return functools.partial(Engine, config, topology=topology)
    listener = adopted_socket(topology.listen_fd, topology.master_port)
    os.close(topology.listen_fd)  # the duplicate is the one copy this process keeps
    return functools.partial(_engine_on_reserved_socket, config, topology, listener)


def _engine_on_reserved_socket(config: EngineConfig, topology: Topology, listener: socket.socket) -> Engine:
    with listener:  # the store keeps a duplicate of its own
        return Engine(config, topology=replace(topology, listen_fd=listener.fileno()))
