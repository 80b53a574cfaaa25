"""Executor: turns a scheduler batch into a packed micro-batch and runs one forward pass over it.

`InputBuilder` (stage 0) packs a `SchedulerOutput` into a host `MicroBatch` (`micro_batch.py`) —
token ids, positions, slot mapping, block tables, sampling parameters — with vectorised numpy,
one row of Python work per *sequence*, none per token. `ModelRunner` owns a model stage and its
KV cache, decodes a micro-batch for its device (the same decoding on every stage) and executes
it; on the last stage it also computes logits for the sampled rows only and samples.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Collection, Mapping
from typing import TYPE_CHECKING

import numpy as np
import torch

from chariot.worker.block_manager import BlockManager
from chariot.worker.kv_cache import KVCache
from chariot.worker.micro_batch import Layout, MicroBatch, ModelInput, decode_batch, pack
from chariot.worker.model.llama import LlamaStage
from chariot.worker.sampler import LogitAdjustments, Sampler, SamplerOutput, SamplingColumns
from chariot.worker.scheduler.output import SchedulerOutput
from chariot.worker.sequence import Sequence

if TYPE_CHECKING:
    from chariot.worker.pipeline.tensor import TensorTeam


class InputBuilder:
    """Packs scheduler batches into host micro-batches (stage 0 only)."""

    def __init__(self, block_manager: BlockManager, eos_token_ids: Collection[int] = ()) -> None:
        self.blocks = block_manager
        self.block_size = block_manager.block_size
        self.eos_token_ids = frozenset(eos_token_ids)

    def build(self, batch: SchedulerOutput, seqs: Mapping[int, Sequence]) -> MicroBatch:
        chunks = batch.chunks
        q_lens = np.fromiter((c.num_tokens for c in chunks), dtype=np.int64, count=len(chunks))
        starts = np.fromiter((c.start for c in chunks), dtype=np.int64, count=len(chunks))
        seq_lens = starts + q_lens
        cu = np.zeros(len(chunks) + 1, dtype=np.int64)
        np.cumsum(q_lens, out=cu[1:])
        num_tokens = int(cu[-1])

        seq_index = np.repeat(np.arange(len(chunks)), q_lens)
        positions = np.arange(num_tokens, dtype=np.int64) - np.repeat(cu[:-1] - starts, q_lens)
        tables = self._block_tables(batch, seq_lens)
        slots = tables[seq_index, positions // self.block_size] * self.block_size + positions % self.block_size

        input_ids: list[int] = []
        for c in chunks:
            input_ids.extend(seqs[c.seq_id].token_slice(c.start, c.start + c.num_tokens))
        sampled = [i for i, c in enumerate(chunks) if c.samples]
        sampled_seqs = [seqs[chunks[i].seq_id] for i in sampled]
        sampling = SamplingColumns.from_params([s.params for s in sampled_seqs],
                                               [len(s.output_token_ids) for s in sampled_seqs],
                                               self._adjustments(sampled_seqs))
        layout = Layout(num_tokens, len(chunks), tables.shape[1], batch.num_decodes, len(sampled),
                        len(sampling.adjustments))
        sections: list[np.ndarray | list[int]] = [input_ids, positions, slots, cu, seq_lens, tables,
                                                  cu[1:][sampled] - 1]
        return pack(layout, sections, sampling)

    def _adjustments(self, seqs: list[Sequence]) -> LogitAdjustments | None:
        """logit_bias, penalties and the min_tokens ban of the sampled rows (None when no row has any)."""
        if not any(s.params.logit_bias or s.params.penalized or s.params.min_tokens for s in seqs):
            return None
        return LogitAdjustments.for_rows([(s.params, s.output_token_ids) for s in seqs], self.eos_token_ids)

    def _block_tables(self, batch: SchedulerOutput, seq_lens: np.ndarray) -> np.ndarray:
        width = max(1, -(-int(seq_lens.max()) // self.block_size))
        tables = np.zeros((len(batch.chunks), width), dtype=np.int64)
        for row, chunk in enumerate(batch.chunks):
            table = self.blocks.block_table(chunk.seq_id)[:width]
            tables[row, : len(table)] = table
        return tables


class ModelRunner:
    """Executes micro-batches on one model stage with its own KV cache; samples if it has a sampler
    (the last stage's leader). With tensor parallelism (`team`) the stage is this rank's shard, and
    `run` on the leader first hands the micro-batch to the followers (`pipeline/tensor.py`)."""

    def __init__(self, stage: LlamaStage, kv_cache: KVCache, sampler: Sampler | None,
                 device: torch.device, team: TensorTeam | None = None) -> None:
        self.stage = stage
        self.kv_cache = kv_cache
        self.sampler = sampler
        self.device = device
        self.team = team

    @property
    def kv_caches(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return self.kv_cache.layers

    def decode(self, mb: MicroBatch) -> ModelInput:
        """This stage's device view of a micro-batch (sampling parameters only if it samples)."""
        return decode_batch(mb, self.device, with_sampling=self.sampler is not None)

    @torch.inference_mode()
    def forward(self, inp: ModelInput, hidden_states: torch.Tensor | None = None) -> torch.Tensor:
        """Run this stage's layers; returns hidden states [T, hidden]."""
        ids = inp.input_ids if hidden_states is None else None
        return self.stage(inp.positions, self.kv_caches, inp.attn, input_ids=ids, hidden_states=hidden_states)

    def run(self, mb: MicroBatch, hidden_states: torch.Tensor | None = None) -> tuple[ModelInput, torch.Tensor]:
        """Decode and run one micro-batch (a tensor-parallel leader shares it with its followers first)."""
        if self.team is not None:
            self.team.share(mb, hidden_states)
        inp = self.decode(mb)
        return inp, self.forward(inp, hidden_states)

    @torch.inference_mode()
    def sample(self, inp: ModelInput, hidden_states: torch.Tensor) -> SamplerOutput:
        """Last stage: logits for the sampled rows only, then token ids [N] (and logprobs if asked).

        Every rank of a tensor-parallel last stage computes its part of the logits (they are
        gathered); only the leader, which has the sampler, samples."""
        none = SamplerOutput(torch.empty(0, dtype=torch.long))
        if not self.stage.is_last or inp.sample_indices.numel() == 0:
            return none
        logits = self.stage.compute_logits(hidden_states[inp.sample_indices])
        if self.sampler is None or inp.sampling is None:
            return none
        return self.sampler(logits, inp.sampling)

    def execute(self, mb: MicroBatch) -> SamplerOutput:
        """Single-stage path: all layers here (shared with the tensor-parallel followers, if any);
        returns the sampled tokens."""
        return self.sample(*self.run(mb))


class LocalExecutor:
    """Executor for a single-stage engine: one batch at a time, executed on submit. `on_shutdown`
    (tensor parallelism) releases the followers and leaves the process group."""

    max_in_flight = 1
    failed: str | None = None

    def __init__(self, runner: ModelRunner, on_shutdown: Callable[[], None] | None = None) -> None:
        self.runner = runner
        self.on_shutdown = on_shutdown
        self._results: deque[SamplerOutput] = deque()

    def submit(self, mb: MicroBatch) -> None:
        self._results.append(self.runner.execute(mb))

    def wait(self) -> SamplerOutput:
        return self._results.popleft()

    def bubble_fraction(self) -> float:
        return 0.0

    def shutdown(self) -> None:
        self._results.clear()
        if self.on_shutdown is not None:
            self.on_shutdown()
            self.on_shutdown = None
