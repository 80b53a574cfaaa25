"""Executor: turns a scheduler batch into a packed micro-batch and runs one forward pass over it.

`InputBuilder` (stage 0) packs a `SchedulerOutput` into a host `MicroBatch` (`micro_batch.py`) —
token ids, positions, slot mapping, block tables, sampling parameters — with vectorised numpy:
per sequence only the gathering of what it owns (its newest token for a decode, its block list, its
request's sampling row, kept from its first step), none per token. `ModelRunner` owns a model stage and its
KV cache, decodes a micro-batch for its device (the same decoding on every stage) and executes
it; on the last stage it also computes logits for the sampled rows only and samples.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Collection, Mapping
from typing import TYPE_CHECKING

import numpy as np
import torch

from chariot.kernels import AttentionMetadata
from chariot.worker.block_manager import BlockManager
from chariot.worker.graph_runner import (
    CudaGraphCapture,
    DecodeBuffers,
    DecodeGraphRunner,
    GraphMode,
    GraphPlan,
    PadTarget,
)
from chariot.worker.kv_cache import KVCache
from chariot.worker.micro_batch import (
    Layout,
    MicroBatch,
    ModelInput,
    TokenCarry,
    decode_batch,
    pack,
    request_row,
    sampling_sections,
)
from chariot.worker.model.llama import LlamaStage
from chariot.worker.sampler import LogitAdjustments, Sampler, SamplerOutput
from chariot.worker.scheduler.output import ScheduledChunk, SchedulerOutput
from chariot.worker.sequence import Sequence

if TYPE_CHECKING:
    from chariot.worker.pipeline.tensor import TensorTeam


_NOTHING_SAMPLED = SamplerOutput(torch.empty(0, dtype=torch.long))  # what a stage that does not sample returns


class InputBuilder:
    """Packs scheduler batches into host micro-batches (stage 0 only)."""

    def __init__(self, block_manager: BlockManager, eos_token_ids: Collection[int] = ()) -> None:
        self.blocks = block_manager
        self.block_size = block_manager.block_size
        self.eos_token_ids = frozenset(eos_token_ids)
        self._rows: dict[int, tuple[int, ...]] = {}  # seq_id -> its request's packed sampling values

    def build(self, batch: SchedulerOutput, seqs: Mapping[int, Sequence]) -> MicroBatch:
        chunks = batch.chunks
        rows = [seqs[c.seq_id] for c in chunks]
        q_lens = np.fromiter((c.num_tokens for c in chunks), dtype=np.int64, count=len(chunks))
        starts = np.fromiter((c.start for c in chunks), dtype=np.int64, count=len(chunks))
        seq_lens = starts + q_lens
        cu = np.zeros(len(chunks) + 1, dtype=np.int64)
        np.cumsum(q_lens, out=cu[1:])
        num_tokens = int(cu[-1])

        seq_index = np.repeat(np.arange(len(chunks)), q_lens)
        positions = np.arange(num_tokens, dtype=np.int64) - np.repeat(cu[:-1] - starts, q_lens)
        tables = self._block_tables(chunks, seq_lens)
        slots = tables[seq_index, positions // self.block_size] * self.block_size + positions % self.block_size

        sampled = [i for i, c in enumerate(chunks) if c.samples]
        sampled_seqs = [rows[i] for i in sampled]
        adjustments = self._adjustments(sampled_seqs)
        layout = Layout(num_tokens, len(chunks), tables.shape[1], batch.num_decodes, len(sampled), len(adjustments))
        steps = np.fromiter((_sampled_index(s) for s in sampled_seqs), dtype=np.int64, count=len(sampled))
        index: list[np.ndarray | list[int]] = [self._input_ids(batch, rows), positions, slots, cu, seq_lens, tables,
                                               cu[1:][sampled] - 1]
        sampling = sampling_sections(self._request_rows(sampled_seqs, seqs), steps, adjustments)
        return pack(layout, [*index, *sampling])

    @staticmethod
    def carry(batch: SchedulerOutput, seqs: Mapping[int, Sequence], previous: SchedulerOutput | None
              ) -> TokenCarry | None:
        """The decode rows whose input token `previous` (the batch in flight) samples, and where in
        its output that token is; None when every input token is on the host."""
        decodes = batch.chunks[: batch.num_decodes]
        rows = [i for i, c in enumerate(decodes) if c.start >= seqs[c.seq_id].num_known_tokens]
        if not rows:
            return None
        sampled = {} if previous is None else {c.seq_id: i for i, c in enumerate(c for c in previous.chunks
                                                                                  if c.samples)}
        missing = [decodes[r].seq_id for r in rows if decodes[r].seq_id not in sampled]
        if missing:
            raise RuntimeError(f"sequences {missing} decode a token that no batch in flight samples")
        return TokenCarry(tuple(rows), tuple(sampled[decodes[r].seq_id] for r in rows))

    @staticmethod
    def _input_ids(batch: SchedulerOutput, rows: list[Sequence]) -> list[int]:
        """Token ids of every chunk: a decode's is its sequence's newest token, no slice needed (0
        where that token is still pending on the device: `carry` says where it comes from)."""
        decodes = batch.num_decodes
        ids = [(s.output_token_ids or s.prompt_token_ids)[-1] if c.start < s.num_known_tokens else 0
               for c, s in zip(batch.chunks[:decodes], rows[:decodes], strict=True)]
        for c, seq in zip(batch.chunks[decodes:], rows[decodes:], strict=True):
            ids.extend(seq.token_slice(c.start, c.start + c.num_tokens))
        return ids

    def _request_rows(self, sampled: list[Sequence], live: Mapping[int, Sequence]) -> np.ndarray:
        """The sampled rows' packed sampling values [N, 5], each request's kept from its first step."""
        cache = self._rows
        if len(cache) > 2 * len(live) + 64:  # drop finished requests' rows now and then
            self._rows = cache = {sid: row for sid, row in cache.items() if sid in live}
        for seq in sampled:
            if seq.seq_id not in cache:
                cache[seq.seq_id] = request_row(seq.params)
        return np.array([cache[s.seq_id] for s in sampled], dtype=np.int64).reshape(len(sampled), 5)

    def _adjustments(self, seqs: list[Sequence]) -> LogitAdjustments:
        """logit_bias, penalties and the min_tokens ban of the sampled rows (empty when no row has any)."""
        if not any(s.params.logit_bias or s.params.penalized or s.params.min_tokens for s in seqs):
            return LogitAdjustments()
        return LogitAdjustments.for_rows([(s.params, s.output_token_ids) for s in seqs], self.eos_token_ids)

    def _block_tables(self, chunks: tuple[ScheduledChunk, ...], seq_lens: np.ndarray) -> np.ndarray:
        """[S, W] block tables, W the widest row's need (one row copy each: faster than a flat numpy
        gather at every batch size measured, 1 to 64 rows)."""
        width = max(1, -(-int(seq_lens.max()) // self.block_size))
        tables = np.zeros((len(chunks), width), dtype=np.int64)
        for row, chunk in enumerate(chunks):
            table = self.blocks.block_table(chunk.seq_id)[:width]
            tables[row, : len(table)] = table
        return tables


def _sampled_index(seq: Sequence) -> int:
    """The output index of the token a batch samples for `seq` (seeded sampling draws by it). A
    sequence the scheduler put in the batch counts that token as pending already; any other pending
    one is an earlier batch's, still in flight."""
    return len(seq.output_token_ids) + max(0, seq.num_pending - 1)


class ModelRunner:
    """Executes micro-batches on one model stage with its own KV cache; samples if it has a sampler
    (the last stage's leader). With tensor parallelism (`team`) the stage is this rank's shard, and
    `run` on the leader first hands the micro-batch to the followers (`pipeline/tensor.py`)."""

    def __init__(self, stage: LlamaStage, kv_cache: KVCache, sampler: Sampler | None,
                 device: torch.device, team: TensorTeam | None = None, graphs: GraphPlan | None = None,
                 split_horizon: int = 0) -> None:
        self.stage = stage
        self.split_horizon = split_horizon  # max_model_len: eager decodes split as the graphs do
        self.kv_cache = kv_cache
        self.sampler = sampler
        self.device = device
        self.team = team
        self.graphs = self._graph_runner(graphs) if graphs is not None and graphs.mode is not GraphMode.OFF else None

    def _graph_runner(self, plan: GraphPlan) -> DecodeGraphRunner:
        """The decode graph runner over this stage's layers, its pads in the cache's scratch block."""
        if self.kv_cache.scratch_block is None:
            raise ValueError("cuda_graphs needs a KV cache allocated with a scratch block for padded rows")
        pad = PadTarget(self.kv_cache.scratch_block, self.kv_cache.block_size)
        hidden = None if self.stage.is_first else (self.stage.config.hidden_size, plan.dtype)
        buffers = DecodeBuffers(plan.buckets[-1], plan.table_width, pad, self.device, hidden)
        return DecodeGraphRunner(plan, self._run_layers, buffers)

    @property
    def kv_caches(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return self.kv_cache.layers

    def decode(self, mb: MicroBatch) -> ModelInput:
        """This stage's device view of a micro-batch (sampling parameters only if it samples)."""
        return decode_batch(mb, self.device, with_sampling=self.sampler is not None, split_horizon=self.split_horizon)

    @torch.inference_mode()
    def forward(self, inp: ModelInput, hidden_states: torch.Tensor | None = None) -> torch.Tensor:
        """Run this stage's layers; returns hidden states [T, hidden], or on the last stage, when not
        every row samples, the sampled rows alone ([N, hidden], `LlamaStage.forward`'s
        `sampled_rows`). A decode-only batch that a graph bucket serves goes through the graph
        runner (`graph_runner.py`), on every rank alike."""
        if self.graphs is not None and (bucket := self.graphs.bucket(inp)) is not None:
            return self.graphs.run(inp, bucket, hidden_states)
        ids = inp.input_ids if hidden_states is None else None
        prune = self.stage.is_last and inp.sample_indices.numel() < inp.num_tokens
        return self.stage(inp.positions, self.kv_caches, inp.attn, input_ids=ids, hidden_states=hidden_states,
                          sampled_rows=inp.sample_indices if prune else None)

    def _run_layers(self, positions: torch.Tensor, meta: AttentionMetadata, input_ids: torch.Tensor | None,
                    hidden_states: torch.Tensor | None) -> torch.Tensor:
        return self.stage(positions, self.kv_caches, meta, input_ids=input_ids, hidden_states=hidden_states)

    def capture_graphs(self) -> float:
        """Capture the decode graphs (CUDA with cuda_graphs on; else nothing); returns the seconds taken."""
        if self.graphs is None:
            return 0.0
        with torch.inference_mode():
            return self.graphs.capture(CudaGraphCapture(self.device))

    def run(self, mb: MicroBatch, hidden_states: torch.Tensor | None = None, carry: TokenCarry | None = None,
            carried: torch.Tensor | None = None) -> tuple[ModelInput, torch.Tensor]:
        """Decode and run one micro-batch (a tensor-parallel leader shares it with its followers first).
        `carry` rows take their input token from `carried`, the previous batch's sampled token ids."""
        if self.team is not None:
            if carry is not None:
                raise ValueError("a tensor-parallel stage cannot take input tokens from the device: its "
                                 "followers receive the micro-batch alone")
            self.team.share(mb, hidden_states)
        inp = self.decode(mb)
        if carry is not None:
            if carried is None:
                raise ValueError("a TokenCarry needs the previous batch's sampled token ids")
            self._take_carried(inp, carry, carried)
        return inp, self.forward(inp, hidden_states)

    def _take_carried(self, inp: ModelInput, carry: TokenCarry, carried: torch.Tensor) -> None:
        """Write the pending tokens into the batch's input ids, device to device (no host sync)."""
        index = torch.tensor((carry.rows, carry.sampled_rows), dtype=torch.long)
        if self.device.type == "cuda":
            index = index.pin_memory().to(self.device, non_blocking=True)
        inp.input_ids.index_copy_(0, index[0], carried.index_select(0, index[1]))

    @torch.inference_mode()
    def sample(self, inp: ModelInput, hidden_states: torch.Tensor) -> SamplerOutput:
        """Last stage: logits for the sampled rows only, then token ids [N] (and logprobs if asked).

        Every rank of a tensor-parallel last stage computes its part of the logits (they are
        gathered); only the leader, which has the sampler, samples."""
        if not self.stage.is_last or inp.sample_indices.numel() == 0:
            return _NOTHING_SAMPLED
        # `forward` returned the sampled rows alone, or every row when every row samples (0..T-1)
        if len(hidden_states) != inp.sample_indices.numel():
            raise ValueError(f"expected the {inp.sample_indices.numel()} sampled rows' hidden states, "
                             f"got {len(hidden_states)} rows")
        logits = self.stage.compute_logits(hidden_states)
        if self.sampler is None or inp.sampling is None:
            return _NOTHING_SAMPLED
        return self.sampler(logits, inp.sampling)

    def execute(self, mb: MicroBatch, carry: TokenCarry | None = None, carried: torch.Tensor | None = None
                ) -> SamplerOutput:
        """Single-stage path: all layers here (shared with the tensor-parallel followers, if any);
        returns the sampled tokens."""
        return self.sample(*self.run(mb, carry=carry, carried=carried))


class LocalExecutor:
    """Executor for a single-stage engine: executed on submit (on a GPU, queued); results are awaited
    in submission order. One batch in flight, or two when the engine schedules ahead. `on_shutdown`
    (tensor parallelism) releases the followers and leaves the process group."""

    max_in_flight = 1
    failed: str | None = None

    def __init__(self, runner: ModelRunner, on_shutdown: Callable[[], None] | None = None) -> None:
        self.runner = runner
        self.on_shutdown = on_shutdown
        self._results: deque[SamplerOutput] = deque()

    def submit(self, mb: MicroBatch, carry: TokenCarry | None = None) -> None:
        """Run `mb` (on a GPU: queue its work) and start copying its sampled tokens back. `carry` rows
        take their input tokens from the newest batch submitted before it."""
        carried = self._results[-1].token_ids if carry is not None and self._results else None
        self._results.append(self.runner.execute(mb, carry, carried).prefetch())

    def wait(self) -> SamplerOutput:
        return self._results.popleft()

    def bubble_fraction(self) -> float:
        return 0.0

    def shutdown(self) -> None:
        self._results.clear()
        if self.on_shutdown is not None:
            self.on_shutdown()
            self.on_shutdown = None
