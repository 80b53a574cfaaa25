"""Warm-up before ready: one forward pass through everything a stage will run, before it serves.

Why: the first real batch must not be where a kernel is compiled or a backend turns out to be
broken. On CUDA the Triton kernels are JIT-compiled (and need a C compiler at run time); on the CPU
the C++ attention kernel and oneDNN's packed weights are first touched by a forward pass. Without a
warm-up a broken image reports Ready, the first request kills the worker, and the group
gang-restarts in a loop. With it, the stage fails before it is ready, with a message that names the
stage, the backend and the cause.

Each stage runs its own layers locally on synthetic input (stage 0 on token ids, later stages on
zero hidden states: no pipeline traffic), in two batches that cover every attention path: a mixed
batch (a decode and a prefill chunk that crosses a block boundary) and a decode-only batch (the
split-KV decode path). The last stage also samples one greedy and one seeded row. The synthetic
KV goes into the first blocks of the cache; no sequence reads a block before writing it (prefix
caching registers a block only after a real sequence computed it), so it leaves no trace.
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
        for batch, seqs, builder in _batches(runner):
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
    seconds = time.perf_counter() - started
    log.info("stage %d warmed up in %.2f s (attention backend %s)", rank, seconds, backend)
    return seconds


def _batches(runner: ModelRunner) -> list[tuple[SchedulerOutput, dict[int, Sequence], InputBuilder]]:
    """A mixed batch (decode + prefill chunk across a block boundary) and a decode-only batch."""
    block = runner.kv_cache.block_size
    blocks = BlockManager(runner.kv_cache.num_blocks, block, watermark=0.0)
    decode = Sequence(0, "warmup-decode", [1] * (block + 2), SamplingParams(max_tokens=2, temperature=0.8, seed=0))
    prefill = Sequence(1, "warmup-prefill", [2] * (block + 3), SamplingParams(max_tokens=1, temperature=0.0))
    seqs = {seq.seq_id: seq for seq in (decode, prefill)}
    need = decode.num_tokens + 1
    if blocks.blocks_for(need) + blocks.blocks_for(prefill.num_tokens) > blocks.num_blocks:
        raise WarmupError(f"the KV cache ({blocks.num_blocks} blocks of {block}) is too small to warm up")
    blocks.allocate(decode.seq_id, need)
    blocks.allocate(prefill.seq_id, prefill.num_tokens)
    builder = InputBuilder(blocks)
    mixed = SchedulerOutput((ScheduledChunk(0, decode.num_tokens - 1, 1, True),
                             ScheduledChunk(1, 0, prefill.num_tokens, True)), (), 1)
    decode.output_token_ids.append(3)
    decode_only = SchedulerOutput((ScheduledChunk(0, decode.num_tokens - 1, 1, True),), (), 1)
    return [(mixed, seqs, builder), (decode_only, seqs, builder)]
