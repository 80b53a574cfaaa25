"""Warm-up before ready: one forward pass through everything a stage will run, before it serves.

Why: the first real batch must not be where a kernel is compiled or a backend turns out to be
broken. On CUDA the Triton kernels are JIT-compiled (and need a C compiler at run time); on the CPU
the C++ attention kernel and oneDNN's packed weights are first touched by a forward pass. Without a
warm-up a broken image reports Ready, the first request kills the worker, and the group
gang-restarts in a loop. With it, the stage fails before it is ready, with a message that names the
stage, the backend and the cause.

Each stage runs its own layers locally on synthetic input (stage 0 on token ids, later stages on
zero hidden states: no pipeline traffic), in batches that cover every attention path and, on CUDA,
every attention kernel variant that serving would otherwise compile inside a request (seen on an
H100: a first 1,001-token request took 2.4 s instead of 0.7 s while Triton compiled six kernels):
- a mixed batch (a decode and a prefill chunk that crosses a block boundary);
- a decode beside a prefill chunk of each power-of-two length up to 64 (one query tile each);
- a decode-only batch;
- a decode over a long context, which takes the split-KV path.
The Triton kernels do not specialise on the integers that vary from batch to batch, so the tile
sizes are all that is left to compile. The last stage also samples greedy and seeded rows. The
synthetic KV goes into the first blocks of the cache, and no sequence reads a block before writing
it (prefix caching registers a block only after a real sequence computed it), so the warm-up leaves
no trace. With CUDA graphs (`graph_runner.py`) the stage then captures one decode graph per
batch-size bucket, padded rows in the cache's scratch block, before it reports ready.
"""

from __future__ import annotations

import logging
import time

import torch

from chariot.contracts.errors import ChariotError
from chariot.contracts.sampling_params import SamplingParams
from chariot.kernels import active_backend
from chariot.worker.block_manager import BlockManager
from chariot.worker.config import ResolvedConfig
from chariot.worker.executor import InputBuilder, ModelRunner
from chariot.worker.graph_runner import GraphMode
from chariot.worker.scheduler.output import ScheduledChunk, SchedulerOutput
from chariot.worker.sequence import Sequence

log = logging.getLogger(__name__)


class WarmupError(ChariotError):
    """A stage's warm-up forward pass failed: the stage cannot serve."""


def warm_up(runner: ModelRunner, resolved: ResolvedConfig, rank: int) -> float:
    """Run the warm-up batches on stage `rank`; returns the seconds it took. Raises `WarmupError`."""
    backend = active_backend().name
    started = time.perf_counter()
    try:
        for batch, seqs, builder in _batches(runner, resolved):
            inp = runner.decode(builder.build(batch, seqs))
            hidden = None if rank == 0 else torch.zeros(
                inp.positions.shape[0], resolved.model.hidden_size, dtype=resolved.dtype, device=runner.device)
            out = runner.forward(inp, hidden)
            sampled = runner.sample(inp, out)
            if runner.sampler is not None and sampled.token_ids.shape[0] != sum(c.samples for c in batch.chunks):
                raise RuntimeError(f"sampled {sampled.token_ids.shape[0]} rows")
        if runner.device.type == "cuda":
            torch.cuda.synchronize(runner.device)
    except Exception as exc:  # any failure here means the stage cannot serve: say which and why
        raise WarmupError(f"stage {rank}: warm-up forward pass failed (attention backend {backend}, device "
                          f"{runner.device}): {type(exc).__name__}: {exc}") from exc
    _capture_graphs(runner, rank)
    seconds = time.perf_counter() - started
    log.info("stage %d warmed up in %.2f s (attention backend %s)", rank, seconds, backend)
    return seconds


def _capture_graphs(runner: ModelRunner, rank: int) -> None:
    """Capture the decode graphs of every bucket (`graph_runner.py`), after the warm-up batches
    compiled the kernels and before the stage reports ready; a failure fails the warm-up."""
    graphs = runner.graphs
    if graphs is None or graphs.plan.mode is not GraphMode.CAPTURE:
        return
    try:
        seconds = runner.capture_graphs()
    except Exception as exc:
        raise WarmupError(f"stage {rank}: capturing the decode CUDA graphs failed (device {runner.device}; "
                          f"--cuda-graphs off runs without them): {type(exc).__name__}: {exc}") from exc
    log.info("stage %d captured %d decode CUDA graphs (batch sizes %s) in %.2f s, memory pool %.1f MiB",
             rank, len(graphs.captured), ",".join(map(str, graphs.captured)), seconds, graphs.pool_bytes / 2**20)


WARMUP_QUERY_LENGTHS = (2, 4, 8, 16, 32, 64)
"""Prefill chunk lengths run beside a decode: the Triton backend compiles one attention kernel per
power-of-two query tile (`triton_attention.query_tile`, at most 64 rows), so all are compiled here."""

WARMUP_LONG_CONTEXT = 1024
"""Cached positions of the long decode, which takes the split-KV path (at least two splits of
`triton_attention.MIN_SPLIT_POSITIONS`) where `max_model_len` allows it."""

Batch = tuple[SchedulerOutput, dict[int, Sequence], InputBuilder]


def _batches(runner: ModelRunner, resolved: ResolvedConfig) -> list[Batch]:
    """A mixed batch (decode + prefill chunk across a block boundary), a decode beside a prefill
    chunk of each `WARMUP_QUERY_LENGTHS` that the token budget allows, a decode-only batch, and a
    decode over a long context (`WARMUP_LONG_CONTEXT`, or `max_model_len` - 1 if shorter) when
    the cache holds it. Only the first two batches are required to fit the cache."""
    block = runner.kv_cache.block_size
    blocks = BlockManager(runner.kv_cache.num_blocks, block, watermark=0.0)
    builder = InputBuilder(blocks)
    decode = Sequence(0, "warmup-decode", [1] * (block + 2), SamplingParams(max_tokens=2, temperature=0.8, seed=0))
    prefill = Sequence(1, "warmup-prefill", [2] * (block + 3), SamplingParams(max_tokens=1, temperature=0.0))
    seqs = {seq.seq_id: seq for seq in (decode, prefill)}
    need = decode.num_tokens + 1
    if blocks.blocks_for(need) + blocks.blocks_for(prefill.num_tokens) > blocks.num_blocks:
        raise WarmupError(f"the KV cache ({blocks.num_blocks} blocks of {block}) is too small to warm up")
    blocks.allocate(decode.seq_id, need)
    blocks.allocate(prefill.seq_id, prefill.num_tokens)
    decode_chunk = ScheduledChunk(0, decode.num_tokens - 1, 1, True)
    batches = [(SchedulerOutput((decode_chunk, ScheduledChunk(1, 0, prefill.num_tokens, True)), (), 1), seqs, builder)]
    for length in WARMUP_QUERY_LENGTHS:
        extra = _fresh_sequence(blocks, seqs, length, resolved.token_budget - 1)
        if extra is not None:
            chunks = (decode_chunk, ScheduledChunk(extra.seq_id, 0, length, True))
            batches.append((SchedulerOutput(chunks, (), 1), seqs, builder))
    decode.output_token_ids.append(3)
    batches.append((SchedulerOutput((ScheduledChunk(0, decode.num_tokens - 1, 1, True),), (), 1), seqs, builder))
    context = min(WARMUP_LONG_CONTEXT, resolved.max_model_len - 1)
    long = _fresh_sequence(blocks, seqs, context + 1, resolved.max_model_len)
    if long is not None:
        batches.append((SchedulerOutput((ScheduledChunk(long.seq_id, context, 1, True),), (), 1), seqs, builder))
    return batches


def _fresh_sequence(blocks: BlockManager, seqs: dict[int, Sequence], length: int, limit: int) -> Sequence | None:
    """A new synthetic sequence of `length` tokens with its blocks allocated (added to `seqs`), or
    None when `length` exceeds `limit` or the cache has no room."""
    if length > limit or blocks.blocks_for(length) > blocks.num_free_blocks:
        return None
    seq = Sequence(len(seqs), f"warmup-{length}", [4] * length, SamplingParams(max_tokens=1, temperature=0.0))
    blocks.allocate(seq.seq_id, length)
    seqs[seq.seq_id] = seq
    return seq
