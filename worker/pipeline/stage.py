"""One pipeline stage process: setup shared by every stage, and the loop of stages 1..P-1.

A downstream stage only executes what it is told: receive header → payload → hidden states, run
its layers against its own KV cache, forward (or, on the last stage, sample and answer stage 0).
It keeps cumulative busy/idle time so the pipeline-bubble fraction can be reported.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from chariot.contracts.errors import ConfigError, PipelineError
from chariot.contracts.telemetry import Telemetry
from chariot.worker.config import EngineConfig, ModelConfig
from chariot.worker.executor import ModelRunner
from chariot.worker.kv_cache import num_kv_blocks
from chariot.worker.model.llama import allocate_kv_caches
from chariot.worker.model.loader import load_stage, split_layers
from chariot.worker.pipeline import protocol as wire
from chariot.worker.pipeline.transport import PeerCheck, StageLink, Topology
from chariot.worker.sampler import Sampler

log = logging.getLogger(__name__)
STAGE_CPUS_ENV = "CHARIOT_STAGE_CPUS"


@dataclass
class StageClock:
    """Cumulative busy/idle seconds of this stage; idle counts only waits while work was expected."""

    rank: int
    busy_s: float = 0.0
    idle_s: float = 0.0
    expecting: bool = False  # a micro-batch was just processed, so the next wait is a bubble

    _reported: tuple[float, float] = (0.0, 0.0)

    def report(self, telemetry: Telemetry) -> None:
        """Export the busy/idle time accumulated since the previous report."""
        busy, idle = self._reported
        if self.busy_s > busy or self.idle_s > idle:
            telemetry.add_stage_time(self.rank, self.busy_s - busy, self.idle_s - idle)
            self._reported = (self.busy_s, self.idle_s)

    def stamp(self, counters: torch.Tensor) -> torch.Tensor:
        """Write this stage's counters (microseconds) into a header's counter slots."""
        out = counters.clone()
        out[2 * self.rank] = int(self.busy_s * 1e6)
        out[2 * self.rank + 1] = int(self.idle_s * 1e6)
        return out


@dataclass
class StageContext:
    """Everything one stage process needs, built identically on every rank."""

    config: EngineConfig
    model: ModelConfig
    topo: Topology
    link: StageLink
    runner: ModelRunner
    num_blocks: int
    max_model_len: int

    @classmethod
    def build(cls, config: EngineConfig, topo: Topology, progress: bool = True,
              peer_check: PeerCheck | None = None) -> StageContext:
        pin_stage_cpus(topo.rank)
        model = ModelConfig.from_dir(config.model)
        max_len = config.resolved_max_model_len(model)
        config.resolved_token_budget(max_len)  # validate on every rank, not just the driver
        dtype, device = config.torch_dtype(model), torch.device(config.device)
        split = list(config.layer_split) if config.layer_split else None
        start, end = split_layers(model.num_layers, topo.world_size, split)[topo.rank]
        local_blocks = num_kv_blocks(config, model, end - start, dtype, max_len)
        link = StageLink(topo, device, config.stage_timeout_s, peer_check)
        num_blocks = agree_num_blocks(local_blocks, link.device)
        stage = load_stage(config.model, (start, end), dtype, device, progress=progress)
        caches = allocate_kv_caches(model, end - start, num_blocks, config.block_size, dtype, device)
        sampler = Sampler(config.seed) if topo.is_last else None
        return cls(config, model, topo, link, ModelRunner(stage, caches, sampler), num_blocks, max_len)


def pin_stage_cpus(rank: int) -> None:
    """Optional CPU pinning for benchmarks on one machine: `CHARIOT_STAGE_CPUS="0,1"` gives stage r
    the r-th core set (`a+b` joins cores) and as many torch threads as cores."""
    spec = os.environ.get(STAGE_CPUS_ENV)
    if not spec:
        return
    sets = spec.split(",")
    if rank >= len(sets):
        raise ConfigError(STAGE_CPUS_ENV, f"names {len(sets)} core sets but stage {rank} needs one")
    cores = {int(c) for c in sets[rank].split("+")}
    os.sched_setaffinity(0, cores)
    torch.set_num_threads(len(cores))


def agree_num_blocks(local_blocks: int, device: torch.device) -> int:
    """Every stage must index the same blocks: take the smallest capacity over the group."""
    t = torch.tensor([local_blocks], dtype=torch.long, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return int(t.item())


def run_downstream_stage(
    config: EngineConfig, topo: Topology, progress: bool = True, telemetry: Telemetry | None = None
) -> int:
    """Loop of stages 1..P-1 until shutdown (exit 0) or a broken pipeline (exit 1)."""
    ctx = StageContext.build(config, topo, progress)
    log.info("stage %d/%d ready: layers loaded, %d KV blocks", topo.rank, topo.world_size, ctx.num_blocks)
    clock = StageClock(topo.rank)
    try:
        while _serve_one(ctx, clock):
            if telemetry is not None:
                clock.report(telemetry)
    except PipelineError as exc:
        log.error("%s", exc)
        return 1
    ctx.link.close()
    return 0


def _serve_one(ctx: StageContext, clock: StageClock) -> bool:
    """Handle one message from upstream; False on shutdown."""
    rank, link = ctx.topo.rank, ctx.link
    t0 = time.perf_counter()
    raw = link.recv((wire.HEADER_LEN,), torch.long, rank - 1)
    waited = time.perf_counter() - t0
    header = wire.decode_header(raw.cpu())
    if header.kind is not wire.Kind.BATCH:
        clock.expecting = False  # heartbeats flow only while stage 0 has nothing in flight
        _relay_control(ctx, header, raw)
        return header.kind is not wire.Kind.SHUTDOWN
    if clock.expecting:
        clock.idle_s += waited
    clock.expecting = True
    payload = link.recv((header.payload_len,), torch.long, rank - 1)
    hidden = link.recv((header.num_tokens, ctx.model.hidden_size), ctx.config.torch_dtype(ctx.model), rank - 1)
    inp = wire.decode_batch(header, payload.cpu(), torch.device(ctx.config.device))
    t1 = time.perf_counter()
    hidden = ctx.runner.forward(inp, hidden.to(ctx.config.device))
    if ctx.topo.is_last:
        tokens = ctx.runner.sample(inp, hidden)
        clock.busy_s += time.perf_counter() - t1
        counters = clock.stamp(wire.counters_of(raw.cpu()))
        link.send([wire.encode_result(header.mb_id, tokens, counters, ctx.config.max_batch_size)], 0)
    else:
        clock.busy_s += time.perf_counter() - t1
        raw = raw.cpu()
        raw[wire.HEADER_LEN - 2 * wire.MAX_STAGES :] = clock.stamp(wire.counters_of(raw))
        link.send([raw, payload, hidden], rank + 1)
    return True


def _relay_control(ctx: StageContext, header: wire.Header, raw: torch.Tensor) -> None:
    """Heartbeats travel to the last stage, which acknowledges to stage 0; shutdown travels down."""
    if ctx.topo.is_last:
        if header.kind is wire.Kind.HEARTBEAT:
            empty = torch.empty(0, dtype=torch.long)
            ack = wire.encode_result(wire.HEARTBEAT_ID, empty, wire.counters_of(raw.cpu()), ctx.config.max_batch_size)
            ctx.link.send([ack], 0)
    else:
        ctx.link.send([raw], ctx.topo.rank + 1)
    if header.kind is wire.Kind.SHUTDOWN:
        ctx.link.flush()
