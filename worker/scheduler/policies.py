"""The four batching policies compared in the Sarathi-Serve paper, over one block manager; each serves
prompts in `SchedulerConfig.prefill_order` (arrival order by default)."""

from __future__ import annotations

from chariot.worker.block_manager import BlockManager
from chariot.worker.scheduler.base import BatchBuilder, Scheduler, SchedulerConfig


class SarathiScheduler(Scheduler):
    """Stall-free batching: all running decodes, then ongoing prefills, then new requests, chunked
    so the iteration never exceeds the token budget. A decode is never dropped for a prefill."""

    def _fill(self, builder: BatchBuilder) -> None:
        self._schedule_decodes(builder)
        self._schedule_prefills(builder)


class VLLMScheduler(Scheduler):
    """Prefill-prioritising: whenever whole prompts can be admitted, run a prefill-only iteration
    (running decodes pause: the generation stall); otherwise a decode-only iteration."""

    def _fill(self, builder: BatchBuilder) -> None:
        self._admit_waiting(builder)
        if not builder.chunks:
            self._schedule_decodes(builder)


class OrcaScheduler(Scheduler):
    """Iteration-level hybrid batches: running decodes plus whole prompts, no chunking."""

    def _fill(self, builder: BatchBuilder) -> None:
        self._schedule_decodes(builder)
        self._admit_waiting(builder)


class FasterTransformerScheduler(Scheduler):
    """Request-level batching: admit a batch, decode it until every request in it has finished."""

    def _fill(self, builder: BatchBuilder) -> None:
        if self.running:
            self._schedule_decodes(builder)
        else:
            self._admit_waiting(builder)


POLICY_CLASSES: dict[str, type[Scheduler]] = {
    "sarathi": SarathiScheduler,
    "vllm": VLLMScheduler,
    "orca": OrcaScheduler,
    "fastertransformer": FasterTransformerScheduler,
}


def make_scheduler(config: SchedulerConfig, block_manager: BlockManager) -> Scheduler:
    return POLICY_CLASSES[config.policy](config, block_manager)
