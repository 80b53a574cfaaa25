"""CUDA-graph decode: decode-only iterations replayed from one graph per padded batch-size bucket.

Why: on a GPU an eager decode iteration is bound by the host, not the device: hundreds of kernel
launches at several microseconds of Python and driver time each (docs/BENCHMARKS.md, "The engine on
one H100"). A CUDA graph launches a stage's whole layer range as one replay. A graph fixes every
tensor address and shape and every host value that sized a launch, so this runner:

- pads a decode-only iteration (every sequence one query token) up to a batch-size bucket
  (`batch_buckets`: 1, 2, 4, 8, 16, 24, 32, then every 16, up to `max_batch_size`) and runs it over
  static input buffers sized for the largest bucket (`DecodeBuffers`), filled in place every step;
- makes padded rows harmless: each writes its K/V into a scratch block the KV cache keeps past the
  block manager's blocks (`KVCache.scratch_block`), attends to that one position, and its output is
  dropped (only real rows are sampled, outside the graph);
- fixes the attention launch per bucket: the captured metadata's host lists describe every row as one
  query token over `max_model_len` positions, so the Triton backend sizes its grid and split-KV count
  for the longest context (`split_horizon`; eager decodes split the same way, so a decode gives the
  same bits either way). Its kernels read each row's real length from the device `seq_lens`, and
  splits past it are empty (weight 0 in the reduce). Only backends that size launches from host
  totals alone may be captured (`GRAPH_SAFE_BACKENDS`).

Anything else (prefill chunks, mixed batches, more sequences than the largest bucket) runs eagerly, as
it does without graphs. Where nothing can be captured (a CPU with `cuda_graphs="on"`) the same buckets
and buffers run eagerly with the real host lists: that is how CPU tests check the padding
(`GraphMode.EAGER`). Capture itself happens in the stage's warm-up (`warmup.py`), before it reports
ready; the graphs of all buckets share one memory pool, which the KV-cache sizing sets aside
(`graph_pool_bytes`).
"""

from __future__ import annotations

import bisect
import enum
import functools
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from chariot.kernels import AttentionMetadata
from chariot.worker.config import ModelConfig, ResolvedConfig
from chariot.worker.micro_batch import ModelInput

log = logging.getLogger(__name__)

SMALL_BUCKETS: tuple[int, ...] = (1, 2, 4, 8, 16, 24, 32)
"""The first batch-size buckets; past the last one they go up in steps of `BUCKET_STRIDE`."""
BUCKET_STRIDE = 16
GRAPH_SAFE_BACKENDS = frozenset({"triton"})
"""Attention backends whose launches depend only on host totals that are fixed per bucket."""
GRAPH_POOL_SLACK_BYTES = 64 << 20
"""Set aside beyond the activation estimate: split-KV scratch, graph bookkeeping, allocator rounding."""

StageForward = Callable[[torch.Tensor, AttentionMetadata, torch.Tensor | None, torch.Tensor | None], torch.Tensor]
"""(positions, metadata, input_ids or None, hidden_states or None) → hidden states [T, hidden]."""


class GraphMode(enum.Enum):
    """How decode-only iterations run: unpadded and eager (`OFF`), padded into buckets over static
    buffers and eager (`EAGER`), or padded and replayed from captured CUDA graphs (`CAPTURE`)."""

    OFF = "off"
    EAGER = "eager"
    CAPTURE = "capture"


def batch_buckets(max_batch_size: int) -> tuple[int, ...]:
    """The padded batch sizes: `SMALL_BUCKETS`, then every `BUCKET_STRIDE`, capped at (and always
    ending with) `max_batch_size`, so every decode batch the scheduler can form has a bucket."""
    if isinstance(max_batch_size, bool) or not isinstance(max_batch_size, int) or max_batch_size < 1:
        raise ValueError(f"max_batch_size must be a positive integer, got {max_batch_size!r}")
    sizes = [b for b in SMALL_BUCKETS if b < max_batch_size]
    size = SMALL_BUCKETS[-1] + BUCKET_STRIDE
    while size < max_batch_size:
        sizes.append(size)
        size += BUCKET_STRIDE
    return (*sizes, max_batch_size)


def bucket_for(num_seqs: int, buckets: Sequence[int]) -> int | None:
    """The smallest bucket that holds `num_seqs` rows (None when none does, or for no rows)."""
    if num_seqs < 1:
        return None
    i = bisect.bisect_left(buckets, num_seqs)
    return buckets[i] if i < len(buckets) else None


def capture_problem(device_type: str, backend: Callable[[], str], tensor_parallel_size: int) -> str | None:
    """Why a stage cannot capture CUDA graphs, or None when it can. `backend` names the attention
    backend in use (asked only on CUDA)."""
    if device_type != "cuda":
        return f"the device is {device_type}, not CUDA"
    name = backend()
    if name not in GRAPH_SAFE_BACKENDS:
        return (f"attention backend {name!r} sizes its launches from per-step host lists "
                f"(graph-safe: {', '.join(sorted(GRAPH_SAFE_BACKENDS))})")
    if tensor_parallel_size > 1:
        return ("tensor-parallel stages are not captured yet: their collectives are timed by CUDA events "
                "recorded around each call, which a replay would not record")
    return None


def choose_mode(setting: str, problem: str | None) -> GraphMode:
    """The mode for a `cuda_graphs` setting, given why capture is impossible here (None: it is possible)."""
    if setting == "off":
        return GraphMode.OFF
    if problem is None:
        return GraphMode.CAPTURE
    return GraphMode.EAGER if setting == "on" else GraphMode.OFF


@dataclass(frozen=True)
class GraphPlan:
    """What one stage's graph runner serves: its mode, buckets, the widest block table (`max_model_len`
    tokens) and the hidden states' dtype."""

    mode: GraphMode
    buckets: tuple[int, ...]
    max_model_len: int
    block_size: int
    dtype: torch.dtype

    def __post_init__(self) -> None:
        if not self.buckets or list(self.buckets) != sorted(set(self.buckets)) or self.buckets[0] < 1:
            raise ValueError(f"GraphPlan.buckets must be distinct positive batch sizes, ascending, got {self.buckets}")
        for name in ("max_model_len", "block_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"GraphPlan.{name} must be a positive integer, got {getattr(self, name)}")

    @classmethod
    def for_config(cls, resolved: ResolvedConfig) -> GraphPlan:
        from chariot.kernels import get_backend

        setting = resolved.engine.cuda_graphs
        problem = capture_problem(resolved.device.type, get_backend, resolved.tensor_parallel_size)
        mode = choose_mode(setting, problem)
        if mode is GraphMode.EAGER:
            log.info("cuda_graphs=on: decode buckets run eagerly, nothing is captured (%s)", problem)
        return cls(mode, batch_buckets(resolved.engine.max_batch_size), resolved.max_model_len,
                   resolved.engine.block_tokens, resolved.dtype)

    @property
    def table_width(self) -> int:
        """Blocks of the longest sequence: the static block tables' width."""
        return -(-self.max_model_len // self.block_size)

    @property
    def needs_scratch_block(self) -> bool:
        return self.mode is not GraphMode.OFF


def graph_pool_bytes(plan: GraphPlan, model: ModelConfig, tensor_parallel_size: int = 1) -> int:
    """An upper estimate of the graph memory pool (0 without capture): twice the activations one layer
    of the largest bucket holds at once, every bucket's kept output, and `GRAPH_POOL_SLACK_BYTES`.

    Buckets are captured largest first into one pool, so the smaller ones reuse its blocks; a layer's
    intermediates are freed before the next layer's, so the peak is one layer's, not the stage's."""
    if plan.mode is not GraphMode.CAPTURE:
        return 0
    element = torch.empty(0, dtype=plan.dtype).element_size()
    tp = tensor_parallel_size
    qkv = (model.num_heads + 2 * model.num_kv_heads) * model.head_dim // tp
    per_row = 4 * model.hidden_size + 2 * qkv + 3 * model.intermediate_size // tp
    rows = plan.buckets[-1]
    outputs = sum(plan.buckets) * model.hidden_size
    return 2 * rows * per_row * element + outputs * element + GRAPH_POOL_SLACK_BYTES


@dataclass(frozen=True)
class PadTarget:
    """Where padded rows write and read their K/V: one scratch block no sequence owns."""

    block: int
    block_size: int

    @property
    def slot(self) -> int:
        return self.block * self.block_size


class DecodeBuffers:
    """The static inputs of the largest bucket. A step copies its rows into the leading slices of the
    same tensors (their addresses never change, which a replayed graph needs) and turns rows the
    previous step used, and this one does not, back into padding: token 0 at position 0, slot and
    block table in the scratch block, length 1. `query_start_loc` is 0..rows, fixed: one token a row."""

    def __init__(self, rows: int, table_width: int, pad: PadTarget, device: torch.device,
                 hidden: tuple[int, torch.dtype] | None = None) -> None:
        self.rows, self.table_width, self.pad = rows, table_width, pad
        self.input_ids = torch.zeros(rows, dtype=torch.long, device=device)
        self.positions = torch.zeros(rows, dtype=torch.long, device=device)
        self.slot_mapping = torch.full((rows,), pad.slot, dtype=torch.long, device=device)
        self.query_start_loc = torch.arange(rows + 1, dtype=torch.int32, device=device)
        self.seq_lens = torch.ones(rows, dtype=torch.int32, device=device)
        self.block_tables = torch.full((rows, table_width), pad.block, dtype=torch.int32, device=device)
        self.hidden_states = None if hidden is None else torch.zeros(rows, hidden[0], dtype=hidden[1], device=device)
        self.real_rows = 0

    def fill(self, inp: ModelInput, hidden_states: torch.Tensor | None = None) -> None:
        """Copy a decode-only batch's rows in; the rows after them hold padding."""
        attn, n = inp.attn, inp.attn.num_seqs
        if n > self.rows or attn.block_tables.shape[1] > self.table_width:
            raise ValueError(f"a batch of {n} rows × {attn.block_tables.shape[1]} blocks does not fit the "
                             f"static buffers ({self.rows} rows × {self.table_width} blocks)")
        self.input_ids[:n].copy_(inp.input_ids, non_blocking=True)
        self.positions[:n].copy_(inp.positions, non_blocking=True)
        self.slot_mapping[:n].copy_(attn.slot_mapping, non_blocking=True)
        self.seq_lens[:n].copy_(attn.seq_lens, non_blocking=True)
        self.block_tables[:n, : attn.block_tables.shape[1]].copy_(attn.block_tables, non_blocking=True)
        if hidden_states is not None:
            if self.hidden_states is None:
                raise ValueError("hidden states given to the buffers of a first stage")
            self.hidden_states[:n].copy_(hidden_states, non_blocking=True)
        self.pad_from(n)

    def pad_from(self, first: int) -> None:
        """Rows [first, rows) become padding (only those a previous step filled are written)."""
        if self.real_rows > first:
            rows = slice(first, self.real_rows)
            self.input_ids[rows] = 0
            self.positions[rows] = 0
            self.slot_mapping[rows] = self.pad.slot
            self.seq_lens[rows] = 1
            self.block_tables[rows] = self.pad.block
        self.real_rows = first

    def metadata(self, bucket: int, seq_lens_list: tuple[int, ...], split_horizon: int = 0) -> AttentionMetadata:
        """Attention metadata over the first `bucket` rows; `seq_lens_list` is the host copy a backend sizes
        its launch from (the real lengths when eager, the longest context for a capture), `split_horizon`
        the context its split-KV layout is fixed for (`AttentionMetadata`)."""
        return AttentionMetadata(
            query_start_loc=self.query_start_loc[: bucket + 1],
            seq_lens=self.seq_lens[:bucket],
            block_tables=self.block_tables[:bucket],
            slot_mapping=self.slot_mapping[:bucket],
            query_lens=(1,) * bucket,
            seq_lens_list=seq_lens_list,
            num_decodes=bucket,
            split_horizon=split_horizon,
        )


class Replayable(Protocol):
    """A captured graph: `replay` reruns its work on the tensors it was captured with."""

    def replay(self) -> None: ...


class GraphCapture(Protocol):
    """The device calls a capture makes (`CudaGraphCapture`; tests substitute a CPU stand-in). A pool
    is an opaque handle (torch's own type for it is private)."""

    def pool(self) -> Any: ...

    def synchronize(self) -> None: ...

    def reserved_bytes(self) -> int: ...

    def capture(self, run: Callable[[], torch.Tensor], pool: Any) -> tuple[Replayable, torch.Tensor]:
        """A graph of `run`'s work and the output tensor it writes on every replay."""
        ...


class CudaGraphCapture:
    """`GraphCapture` with CUDA graphs on one device."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def pool(self) -> Any:
        return torch.cuda.graph_pool_handle()

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.device)

    def reserved_bytes(self) -> int:
        """Memory the caching allocator holds once its free cached blocks are released: each capture
        empties the cache on entry, so only this difference isolates the graphs' private pool."""
        torch.cuda.empty_cache()
        return int(torch.cuda.memory_reserved(self.device))

    def capture(self, run: Callable[[], torch.Tensor], pool: Any) -> tuple[Replayable, torch.Tensor]:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            out = run()
        return graph, out


class DecodeGraphRunner:
    """Runs the decode-only iterations a `GraphPlan` serves: fill the buffers, then replay the bucket's
    graph (CUDA, after `capture`) or run the bucket eagerly. `replays` and `eager_runs` count them."""

    def __init__(self, plan: GraphPlan, forward: StageForward, buffers: DecodeBuffers) -> None:
        if plan.mode is GraphMode.OFF:
            raise ValueError("a graph runner needs cuda_graphs on (GraphMode.EAGER or CAPTURE)")
        self.plan, self.forward, self.buffers = plan, forward, buffers
        self._graphs: dict[int, tuple[Replayable, torch.Tensor]] = {}
        self.pool_bytes = 0
        self.replays = 0
        self.eager_runs = 0

    @property
    def captured(self) -> tuple[int, ...]:
        """The buckets with a captured graph, ascending."""
        return tuple(sorted(self._graphs))

    def bucket(self, inp: ModelInput) -> int | None:
        """The bucket that serves this batch, or None when it must run eagerly unpadded."""
        attn = inp.attn
        if attn.num_decodes != attn.num_seqs or inp.num_tokens != attn.num_seqs:
            return None
        if attn.block_tables.shape[1] > self.buffers.table_width:
            return None
        return bucket_for(attn.num_seqs, self.plan.buckets)

    def run(self, inp: ModelInput, bucket: int, hidden_states: torch.Tensor | None = None) -> torch.Tensor:
        """Hidden states [num_seqs, hidden] of one decode-only batch, padded to `bucket` on the way."""
        n = inp.attn.num_seqs
        self.buffers.fill(inp, hidden_states)
        graph = self._graphs.get(bucket)
        if graph is not None:
            replay, out = graph
            replay.replay()
            self.replays += 1
            return out[:n].clone()  # the graph's output is overwritten by the next replay
        self.eager_runs += 1
        lengths = inp.attn.seq_lens_list + (1,) * (bucket - n)
        meta = self.buffers.metadata(bucket, lengths, self.plan.max_model_len)
        return self._forward_bucket(bucket, meta)[:n]

    def capture(self, graphs: GraphCapture) -> float:
        """Capture one graph per bucket, largest first, into one shared memory pool; returns the seconds
        it took. Each bucket first runs once uncaptured, so that nothing is compiled or lazily allocated
        during its capture. Pads only: the buffers hold no real row while capturing."""
        if self.plan.mode is not GraphMode.CAPTURE:
            return 0.0
        started = time.perf_counter()
        self.buffers.pad_from(0)
        pool = graphs.pool()
        graphs.synchronize()
        reserved = graphs.reserved_bytes()
        longest = self.plan.max_model_len
        for bucket in reversed(self.plan.buckets):
            meta = self.buffers.metadata(bucket, (longest,) * bucket, longest)
            self._forward_bucket(bucket, meta)
            graphs.synchronize()
            self._graphs[bucket] = graphs.capture(functools.partial(self._forward_bucket, bucket, meta), pool)
        graphs.synchronize()
        self.pool_bytes = max(0, graphs.reserved_bytes() - reserved)
        return time.perf_counter() - started

    def _forward_bucket(self, bucket: int, meta: AttentionMetadata) -> torch.Tensor:
        b = self.buffers
        hidden = None if b.hidden_states is None else b.hidden_states[:bucket]
        ids = b.input_ids[:bucket] if hidden is None else None
        return self.forward(b.positions[:bucket], meta, ids, hidden)
