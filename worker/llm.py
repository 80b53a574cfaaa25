"""Offline batch API (`LLM.generate`), the contract tests, benchmarks and outside checks use."""

from __future__ import annotations

import contextlib
from collections.abc import Sequence as Seq
from typing import Any, cast

from tqdm.auto import tqdm

from chariot.contracts.errors import PipelineError
from chariot.contracts.outputs import RequestOutput
from chariot.contracts.sampling_params import SamplingParams
from chariot.worker.config import EngineConfig
from chariot.worker.engine import Engine, Prompt
from chariot.worker.pipeline.launcher import LocalPipeline


class LLM:
    """Generate completions for a batch of prompts with one in-process engine."""

    def __init__(
        self,
        model: str,
        policy: str = "sarathi",
        token_budget: int | None = None,
        max_batch_size: int = 128,
        pipeline_stages: int = 1,
        dtype: str = "auto",
        block_size: int = 16,
        kv_cache_tokens: int | None = None,
        progress: bool = True,
        **engine_kwargs: Any,
    ) -> None:
        self.config = EngineConfig(
            model=str(model),
            policy=policy,
            token_budget=token_budget,
            max_batch_size=max_batch_size,
            pipeline_stages=pipeline_stages,
            dtype=dtype,
            block_size=block_size,
            kv_cache_tokens=kv_cache_tokens,
            **engine_kwargs,
        )
        self.pipeline = LocalPipeline(self.config) if pipeline_stages > 1 else None
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
    ) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in prompt order.

        All prompts are validated before any is queued, so a bad one raises and queues nothing.
        Raises `PipelineError` if a pipeline stage fails (every request is failed with it).
        """
        batch = _as_prompt_list(prompts)
        params = _as_params_list(sampling_params, len(batch))
        for prompt, p in zip(batch, params, strict=True):
            self.engine.validate_prompt(prompt, p)
        ids = [self.engine.add_request(prompt, p) for prompt, p in zip(batch, params, strict=True)]
        done: dict[str, RequestOutput] = {}
        with tqdm(total=len(ids), disable=not use_tqdm, desc="generate") as bar:
            while len(done) < len(ids):
                for out in self.engine.step():
                    if out.finished:
                        done[out.request_id] = out
                        bar.update(1)
                if self.engine.failed is not None:
                    raise PipelineError(self.engine.failed)
        return [done[i] for i in ids]


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
