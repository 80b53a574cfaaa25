"""Offline batch API (`LLM.generate`), the contract tests, benchmarks and outside checks use.

`generate` drives the engine through an `OutputProcessor` like the server does, and adds each
request's streamed deltas up into one `CompletionOutput` (whole token ids and text) at the end.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence as Seq
from typing import Any, cast

from tqdm.auto import tqdm

from chariot.contracts import engine_settings as settings
from chariot.contracts.errors import PipelineError
from chariot.contracts.outputs import CompletionOutput, RequestOutput
from chariot.contracts.sampling_params import SamplingParams
from chariot.worker.config import EngineConfig
from chariot.worker.engine import Engine, Prompt
from chariot.worker.output_processor import OutputProcessor, run_step
from chariot.worker.pipeline.launcher import LocalPipeline


class LLM:
    """Generate completions for a batch of prompts with one in-process engine.

    The keyword arguments are `EngineConfig`'s fields (the common ones named, the rest through
    `engine_kwargs`); their defaults come from `chariot.contracts.engine_settings`.
    """

    def __init__(
        self,
        model: str,
        policy: str = settings.POLICY.default,
        token_budget: int | None = settings.TOKEN_BUDGET.default,
        max_batch_size: int = settings.MAX_BATCH_SIZE.default,
        pipeline_stages: int = settings.PIPELINE_STAGES.default,
        tensor_parallel_size: int = settings.TENSOR_PARALLEL_SIZE.default,
        dtype: str = settings.DTYPE.default,
        block_size: int | None = settings.BLOCK_SIZE.default,
        kv_cache_tokens: int | None = settings.KV_CACHE_TOKENS.default,
        progress: bool = True,
        **engine_kwargs: Any,
    ) -> None:
        self.config = EngineConfig(
            model=str(model),
            policy=policy,
            token_budget=token_budget,
            max_batch_size=max_batch_size,
            pipeline_stages=pipeline_stages,
            tensor_parallel_size=tensor_parallel_size,
            dtype=dtype,
            block_size=block_size,
            kv_cache_tokens=kv_cache_tokens,
            **engine_kwargs,
        )
        self.pipeline = LocalPipeline(self.config) if self.config.world_size > 1 else None
        try:
            topology = self.pipeline.topology if self.pipeline else None
            check = self.pipeline.startup_problem if self.pipeline else None
            self.engine = Engine(self.config, progress=progress, topology=topology, peer_check=check)
        except BaseException:
            self._stop_pipeline()
            raise

    def close(self) -> None:
        """Shut the engine down; with a pipeline, stop every stage process."""
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.shutdown()
            del self.engine
        self._stop_pipeline()

    def _stop_pipeline(self) -> None:
        if self.pipeline is not None:
            self.pipeline.stop()
            self.pipeline = None

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.close()

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    def generate(
        self,
        prompts: Prompt | Seq[Prompt],
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
        use_tqdm: bool = False,
    ) -> list[CompletionOutput]:
        """Run every prompt to completion; outputs come back in prompt order.

        All prompts are validated (and text prompts encoded, once) before any is queued, so a bad
        one raises and queues nothing. Raises `PipelineError` if a pipeline stage fails (every
        request is failed with it).
        """
        batch = _as_prompt_list(prompts)
        params = _as_params_list(sampling_params, len(batch))
        token_ids = [self.engine.validate_prompt(prompt, p) for prompt, p in zip(batch, params, strict=True)]
        processor = OutputProcessor(self.engine.tokenizer)
        deltas: dict[str, list[RequestOutput]] = {}
        prompt_ids: dict[str, list[int]] = {}
        for ids, p in zip(token_ids, params, strict=True):
            rid = self.engine.add_request(ids, p)
            processor.add_request(rid, p)
            deltas[rid], prompt_ids[rid] = [], ids
        with tqdm(total=len(deltas), disable=not use_tqdm, desc="generate") as bar:
            while len(processor):
                for out in run_step(self.engine, processor)[1]:
                    deltas[out.request_id].append(out)
                    bar.update(int(out.finished))
                if self.engine.failed is not None:
                    raise PipelineError(self.engine.failed)
        return [CompletionOutput.from_deltas(d, prompt_ids[rid]) for rid, d in deltas.items()]


def _as_prompt_list(prompts: Prompt | Seq[Prompt]) -> list[Prompt]:
    if isinstance(prompts, str):
        return [prompts]
    items = list(prompts)
    if items and all(isinstance(t, int) for t in items):
        return [cast(list[int], items)]  # a single prompt given as token ids
    return cast(list[Prompt], items)


def _as_params_list(params: SamplingParams | Seq[SamplingParams] | None, n: int) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams()] * n
    if isinstance(params, SamplingParams):
        return [params] * n
    items = list(params)
    if len(items) != n:
        raise ValueError(f"sampling_params: got {len(items)} for {n} prompts")
    return items
