"""The engine loop of one pipeline group's driver: `add_request / step / abort`.

Each `step()` is schedule → prepare inputs → execute → postprocess. Execution goes through an
`Executor` so the same loop drives a single process (`ModelRunner`) or a pipeline of stages.
All request validation happens in `add_request`; a bad request raises `InvalidRequestError` and
leaves every other request untouched.
"""

from __future__ import annotations

import itertools
import time
import uuid
from collections import deque
from dataclasses import dataclass
from typing import Protocol

import torch

from chariot.contracts.errors import ConfigError, EngineDeadError, InvalidRequestError, PipelineError
from chariot.contracts.outputs import EngineStats, IterationTimes, RequestOutput
from chariot.contracts.requests import FinishReason, Prompt
from chariot.contracts.sampling_params import SamplingParams
from chariot.contracts.tokenizer import IncrementalDetokenizer, Tokenizer
from chariot.worker.block_manager import BlockManager
from chariot.worker.config import EngineConfig, ModelConfig
from chariot.worker.executor import InputBuilder, LocalExecutor, ModelInput, ModelRunner
from chariot.worker.kv_cache import num_kv_blocks
from chariot.worker.model.llama import allocate_kv_caches
from chariot.worker.model.loader import load_stage
from chariot.worker.pipeline.driver import PipelineExecutor
from chariot.worker.pipeline.stage import StageContext
from chariot.worker.pipeline.transport import PeerCheck, Topology
from chariot.worker.sampler import Sampler
from chariot.worker.scheduler import SchedulerConfig, SchedulerOutput, make_scheduler
from chariot.worker.sequence import Sequence


class Executor(Protocol):
    """Runs batches; up to `max_in_flight` may be submitted before the oldest result is awaited.

    `wait()` returns the sampled token id of every sampling chunk of the oldest submitted batch, in
    chunk order. A broken pipeline raises `PipelineError` from submit/wait and sets `failed`.
    """

    max_in_flight: int
    failed: str | None

    def submit(self, inp: ModelInput) -> None: ...

    def wait(self) -> torch.Tensor: ...

    def bubble_fraction(self) -> float: ...

    def shutdown(self) -> None: ...


@dataclass
class _Detok:
    """Streaming text state of one request."""

    stream: IncrementalDetokenizer
    emitted: int = 0  # characters of output_text already streamed


class Engine:
    """Single-driver LLM engine: scheduler + block manager on this process, model via an executor."""

    def __init__(self, config: EngineConfig, progress: bool = True, topology: Topology | None = None,
                 peer_check: PeerCheck | None = None) -> None:
        self.config = config
        self.model_config = ModelConfig.from_dir(config.model)
        self.max_model_len = config.resolved_max_model_len(self.model_config)
        self.token_budget = config.resolved_token_budget(self.max_model_len)
        self.device = torch.device(config.device)
        self.dtype = config.torch_dtype(self.model_config)
        self.tokenizer = Tokenizer(config.model)
        self.eos_token_ids = frozenset(self.model_config.eos_token_ids) | frozenset(self.tokenizer.eos_token_ids)

        self.executor, num_blocks = self._make_executor(topology, progress, peer_check)
        self.blocks = BlockManager(num_blocks, config.block_size, config.watermark)
        self.scheduler = make_scheduler(
            SchedulerConfig(config.policy, self.token_budget, config.max_batch_size, self.max_model_len),
            self.blocks,
        )
        self.inputs = InputBuilder(self.blocks, self.device)
        self.failed: str | None = None
        self._in_flight: deque[SchedulerOutput] = deque()
        self._seq_ids = itertools.count()
        self._by_request: dict[str, Sequence] = {}
        self._detok: dict[int, _Detok] = {}
        self.iterations = 0
        self.last_batch: SchedulerOutput | None = None
        self.last_times = IterationTimes(0.0, 0.0, 0.0, 0.0)

    def _make_executor(self, topology: Topology | None, progress: bool, peer_check: PeerCheck | None,
                       ) -> tuple[Executor, int]:
        if self.config.pipeline_stages > 1:
            if topology is None or topology.world_size != self.config.pipeline_stages or topology.rank != 0:
                raise ConfigError("pipeline_stages", "a pipelined engine runs on rank 0 of a group of "
                                                     f"{self.config.pipeline_stages} stages")
            ctx = StageContext.build(self.config, topology, progress, peer_check)
            return PipelineExecutor(ctx), ctx.num_blocks
        cfg = self.model_config
        num_blocks = num_kv_blocks(self.config, cfg, cfg.num_layers, self.dtype, self.max_model_len)
        stage = load_stage(self.config.model, (0, cfg.num_layers), self.dtype, self.device, progress=progress)
        caches = allocate_kv_caches(cfg, cfg.num_layers, num_blocks, self.config.block_size, self.dtype,
                                    self.device)
        return LocalExecutor(ModelRunner(stage, caches, Sampler(self.config.seed))), num_blocks

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
        self._detok[seq.seq_id] = _Detok(IncrementalDetokenizer(self.tokenizer))
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

    def abort(self, request_id: str) -> RequestOutput | None:
        """Cancel a request and free its KV blocks; returns its final output, or None if unknown."""
        seq = self._by_request.get(request_id)
        if seq is None:
            return None
        return self._finish(seq, FinishReason.ABORT)

    def fail(self, request_id: str, error: str) -> RequestOutput | None:
        """Finish a request with an error (e.g. its pipeline stage died)."""
        seq = self._by_request.get(request_id)
        if seq is None:
            return None
        seq.error = error
        return self._finish(seq, FinishReason.ERROR)

    @property
    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished

    # ---- the loop ----------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Fill the pipeline (schedule → prepare → submit, up to `max_in_flight` batches), then
        wait for the oldest batch and postprocess it. Returns the requests that changed."""
        if self.failed is not None:
            return []
        t0 = time.perf_counter()
        sched = prep = 0.0
        try:
            while len(self._in_flight) < self.executor.max_in_flight:
                t = time.perf_counter()
                batch = self.scheduler.schedule()
                if batch.is_empty:
                    break
                t1 = time.perf_counter()
                inp = self.inputs.build(batch, self.scheduler.seqs)
                sched, prep = sched + t1 - t, prep + time.perf_counter() - t1
                self.executor.submit(inp)
                self._in_flight.append(batch)
            if not self._in_flight:
                return []
            tokens = self.executor.wait()
        except PipelineError as exc:
            return self._fail_all(str(exc))
        t2 = time.perf_counter()
        batch = self._in_flight.popleft()
        outputs = self.process_output(batch, tokens.tolist())
        self.last_batch = batch
        self.last_times = IterationTimes(sched, prep, t2 - t0 - sched - prep, time.perf_counter() - t2)
        self.iterations += 1
        return outputs

    def check_health(self) -> list[RequestOutput]:
        """Notice a pipeline failure detected while idle (heartbeats); fails all live requests."""
        if self.failed is None and self.executor.failed is not None:
            return self._fail_all(self.executor.failed)
        return []

    def _fail_all(self, message: str) -> list[RequestOutput]:
        """The group is broken: every live request finishes with an error, no new ones are taken."""
        self.failed = message
        self._in_flight.clear()
        outputs = []
        for seq in list(self._by_request.values()):
            seq.error = message
            outputs.append(self._finish(seq, FinishReason.ERROR))
        return outputs

    def shutdown(self) -> None:
        """Stop the executor (and, for a pipeline, every downstream stage)."""
        self.executor.shutdown()

    def process_output(self, batch: SchedulerOutput, tokens: list[int]) -> list[RequestOutput]:
        """Append sampled tokens, apply stop conditions, free finished requests' blocks."""
        self.scheduler.complete(batch)
        now = time.time()
        outputs = []
        sampled = iter(tokens)
        for chunk in batch.chunks:
            if not chunk.samples:
                continue
            token = next(sampled)
            seq = self.scheduler.seqs.get(chunk.seq_id)
            if seq is None:  # aborted while in flight
                continue
            outputs.append(self._append_token(seq, token, now))
        return outputs

    def _append_token(self, seq: Sequence, token: int, now: float) -> RequestOutput:
        seq.output_token_ids.append(token)
        if seq.times.first_token is None:
            seq.times.first_token = now
        seq.times.token_times.append(now)
        reason = self._stop_reason(seq, token)
        if reason is not None:
            return self._finish(seq, reason, new_tokens=[token])
        return self._snapshot(seq, [token])

    def _stop_reason(self, seq: Sequence, token: int) -> FinishReason | None:
        params = seq.params
        if token in params.stop_token_ids or (not params.ignore_eos and token in self.eos_token_ids):
            return FinishReason.STOP
        detok = self._detok[seq.seq_id]
        before = len(seq.output_text)
        seq.output_text += detok.stream.step(token)
        if params.stop and self._truncate_at_stop(seq, before):
            return FinishReason.STOP
        if len(seq.output_token_ids) >= params.max_tokens or seq.num_tokens >= self.max_model_len:
            return FinishReason.LENGTH
        return None

    @staticmethod
    def _truncate_at_stop(seq: Sequence, before: int) -> bool:
        longest = max(len(s) for s in seq.params.stop)
        window_start = max(0, before - longest + 1)
        hits = [i for s in seq.params.stop if (i := seq.output_text.find(s, window_start)) >= 0]
        if not hits:
            return False
        seq.output_text = seq.output_text[: min(hits)]
        return True

    def _finish(self, seq: Sequence, reason: FinishReason, new_tokens: list[int] | None = None) -> RequestOutput:
        if reason is FinishReason.LENGTH:  # stopped mid-character? emit what the detokenizer held back
            seq.output_text += self._detok[seq.seq_id].stream.flush()
        seq.finish_reason = reason
        seq.times.finished = time.time()
        self.scheduler.finish(seq)
        out = self._snapshot(seq, new_tokens or [])
        del self._by_request[seq.request_id]
        del self._detok[seq.seq_id]
        return out

    def _snapshot(self, seq: Sequence, new_tokens: list[int]) -> RequestOutput:
        detok = self._detok[seq.seq_id]
        end = len(seq.output_text)
        if not seq.is_finished and seq.params.stop:
            end -= max(len(s) for s in seq.params.stop) - 1  # a stop string may still be forming
        end = max(end, detok.emitted)
        delta = seq.output_text[detok.emitted : end]
        detok.emitted = end
        return RequestOutput(
            request_id=seq.request_id,
            prompt_token_ids=seq.prompt_token_ids,
            new_token_ids=new_tokens,
            new_text=delta,
            token_ids=list(seq.output_token_ids),
            text=seq.output_text[:end],
            finished=seq.is_finished,
            finish_reason=seq.finish_reason,
            times=seq.times,
            num_preemptions=seq.num_preemptions,
            error=seq.error,
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
            last_iteration_s=self.last_times.total,
            iterations=self.iterations,
            pipeline_stages=self.config.pipeline_stages,
            bubble_fraction=self.executor.bubble_fraction(),
        )
