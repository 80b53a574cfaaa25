"""Executor: turns a scheduler batch into tensors and runs one forward pass over it.

`InputBuilder` (stage 0) flattens a `SchedulerOutput` into a `ModelInput` — token ids, positions,
slot mapping, block tables — with vectorised numpy, one row of Python work per *sequence*, none
per token. `ModelInput` is also what a pipeline micro-batch carries between stages.
`ModelRunner` owns a model stage and its KV cache and executes a `ModelInput`; on the last stage it
also computes logits for the sampled rows only and samples.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import torch

from chariot.kernels import AttentionMetadata
from chariot.worker.block_manager import BlockManager
from chariot.worker.model.llama import LlamaStage
from chariot.worker.sampler import Sampler, SamplingBatch
from chariot.worker.scheduler.output import SchedulerOutput
from chariot.worker.sequence import Sequence


@dataclass(frozen=True)
class ModelInput:
    """One iteration's flattened batch. Rows of `sample_indices` are the last token of each chunk
    that samples, in chunk order; `sampling` has one row per sampled chunk."""

    input_ids: torch.Tensor  # [T] long
    positions: torch.Tensor  # [T] long
    attn: AttentionMetadata
    sample_indices: torch.Tensor  # [N] long
    sampling: SamplingBatch | None

    @property
    def num_tokens(self) -> int:
        return len(self.positions)


class InputBuilder:
    """Builds `ModelInput`s from scheduler batches (stage 0 only)."""

    def __init__(self, block_manager: BlockManager, device: torch.device) -> None:
        self.blocks = block_manager
        self.block_size = block_manager.block_size
        self.device = device

    def build(self, batch: SchedulerOutput, seqs: Mapping[int, Sequence]) -> ModelInput:
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
        sample_rows = cu[1:][sampled] - 1
        sampled_seqs = [seqs[chunks[i].seq_id] for i in sampled]
        sampling = (
            SamplingBatch.from_params(
                [s.params for s in sampled_seqs], [len(s.output_token_ids) for s in sampled_seqs], self.device
            )
            if sampled_seqs
            else None
        )
        dev = self.device
        attn = AttentionMetadata(
            query_start_loc=torch.from_numpy(cu.astype(np.int32)).to(dev),
            seq_lens=torch.from_numpy(seq_lens.astype(np.int32)).to(dev),
            block_tables=torch.from_numpy(tables.astype(np.int32)).to(dev),
            slot_mapping=torch.from_numpy(slots).to(dev),
            query_lens=tuple(q_lens.tolist()),
            seq_lens_list=tuple(seq_lens.tolist()),
            num_decodes=batch.num_decodes,
        )
        return ModelInput(
            input_ids=torch.tensor(input_ids, dtype=torch.long, device=dev),
            positions=torch.from_numpy(positions).to(dev),
            attn=attn,
            sample_indices=torch.from_numpy(sample_rows).to(dev),
            sampling=sampling,
        )

    def _block_tables(self, batch: SchedulerOutput, seq_lens: np.ndarray) -> np.ndarray:
        width = max(1, -(-int(seq_lens.max()) // self.block_size))
        tables = np.zeros((len(batch.chunks), width), dtype=np.int64)
        for row, chunk in enumerate(batch.chunks):
            table = self.blocks.block_table(chunk.seq_id)[:width]
            tables[row, : len(table)] = table
        return tables


class ModelRunner:
    """Executes `ModelInput`s on one model stage with its own KV cache."""

    def __init__(
        self,
        stage: LlamaStage,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        sampler: Sampler | None,
    ) -> None:
        self.stage = stage
        self.kv_caches = kv_caches
        self.sampler = sampler

    @torch.inference_mode()
    def forward(self, inp: ModelInput, hidden_states: torch.Tensor | None = None) -> torch.Tensor:
        """Run this stage's layers; returns hidden states [T, hidden]."""
        ids = inp.input_ids if hidden_states is None else None
        return self.stage(inp.positions, self.kv_caches, inp.attn, input_ids=ids, hidden_states=hidden_states)

    @torch.inference_mode()
    def sample(self, inp: ModelInput, hidden_states: torch.Tensor) -> torch.Tensor:
        """Last stage: logits for the sampled rows only, then token ids [N]."""
        if inp.sampling is None or self.sampler is None:
            return torch.empty(0, dtype=torch.long)
        logits = self.stage.compute_logits(hidden_states[inp.sample_indices])
        return self.sampler(logits, inp.sampling)

    def execute(self, inp: ModelInput) -> torch.Tensor:
        """Single-process path: all layers here; returns sampled token ids."""
        return self.sample(inp, self.forward(inp))


class LocalExecutor:
    """Executor for a single-process engine: one batch at a time, executed on submit."""

    max_in_flight = 1
    failed: str | None = None

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self._results: deque[torch.Tensor] = deque()

    def submit(self, inp: ModelInput) -> None:
        self._results.append(self.runner.execute(inp))

    def wait(self) -> torch.Tensor:
        return self._results.popleft()

    def bubble_fraction(self) -> float:
        return 0.0

    def shutdown(self) -> None:
        self._results.clear()
