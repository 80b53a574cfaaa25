"""The loop of a downstream pipeline stage (1..P-1), and the busy/idle clock every stage keeps.

A downstream stage only executes what it is told: receive header → packed micro-batch → hidden
states, decode the micro-batch like every stage does (`ModelRunner.decode`), run its layers against
its own KV cache, forward the packed buffer unchanged (or, on the last stage, sample and answer
stage 0). Its runtime is built by the same `build_stage_runtime` as stage 0's.
It keeps cumulative busy/idle time so the pipeline-bubble fraction can be reported.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from chariot.contracts.errors import PipelineError
from chariot.contracts.telemetry import Telemetry
from chariot.worker.config import EngineConfig, ResolvedConfig
from chariot.worker.micro_batch import MicroBatch
from chariot.worker.pipeline import protocol as wire
from chariot.worker.pipeline.transport import StageLink, Topology
from chariot.worker.runtime import StageRuntime, build_stage_runtime
from chariot.worker.sampler import SamplerOutput

log = logging.getLogger(__name__)


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


def run_downstream_stage(
    config: EngineConfig, topo: Topology, progress: bool = True, telemetry: Telemetry | None = None
) -> int:
    """Loop of every rank but the group's rank 0 until shutdown (exit 0) or a broken pipeline (exit 1):
    the leaders of stages 1..P-1 serve the pipeline, tensor-parallel followers their leader."""
    runtime = build_stage_runtime(ResolvedConfig.resolve(config), topo, progress)
    collectives = CollectiveReport(runtime, telemetry)
    if not runtime.is_leader:
        return _follow(runtime, collectives)
    link = runtime.pipeline_link()
    log.info("stage %d/%d ready: layers loaded, %d KV blocks", runtime.rank, runtime.resolved.num_stages,
             runtime.kv_cache.num_blocks)
    clock = StageClock(runtime.rank)
    try:
        while _serve_one(runtime, link, clock):
            collectives.report()
            if telemetry is not None:
                clock.report(telemetry)
    except PipelineError as exc:
        log.error("%s", exc)
        return 1
    runtime.close()
    return 0


class CollectiveReport:
    """Exports the time this rank spent in tensor-parallel collectives since the last report."""

    def __init__(self, runtime: StageRuntime, telemetry: Telemetry | None) -> None:
        self.tp, self.telemetry = runtime.runner.stage.tp, telemetry
        self.stage, self.shard = runtime.rank, self.tp.shard.rank
        self.seen = 0.0

    def report(self) -> None:
        total = self.tp.collective_s
        if self.telemetry is not None and total > self.seen:
            self.telemetry.add_collective_time(self.stage, self.shard, total - self.seen)
            self.seen = total


def _follow(runtime: StageRuntime, collectives: CollectiveReport) -> int:
    """A tensor-parallel follower: run every micro-batch its stage's leader shares, until shutdown."""
    team, runner = runtime.team, runtime.runner
    if team is None:
        raise RuntimeError("only a tensor-parallel follower follows a leader")
    log.info("stage %d tensor-parallel rank %d/%d ready", runtime.rank, team.place.shard + 1,
             team.place.tensor_parallel_size)
    try:
        while (message := team.receive()) is not None:
            mb, hidden = message
            inp = runner.decode(mb)
            out = runner.forward(inp, hidden)
            if runtime.is_last:
                runner.sample(inp, out)  # this rank's share of the gathered logits
            collectives.report()
    except PipelineError as exc:
        log.error("%s", exc)
        return 1
    runtime.close()
    return 0


def _serve_one(rt: StageRuntime, link: StageLink, clock: StageClock) -> bool:
    """Handle one message from upstream; False on shutdown."""
    rank = rt.rank
    t0 = time.perf_counter()
    raw = link.recv((wire.HEADER_LEN,), torch.long, rank - 1)
    waited = time.perf_counter() - t0
    header = wire.decode_header(raw.cpu())
    if header.kind is not wire.Kind.BATCH:
        clock.expecting = False  # heartbeats flow only while stage 0 has nothing in flight
        _relay_control(rt, link, header, raw)
        return header.kind is not wire.Kind.SHUTDOWN
    if clock.expecting:
        clock.idle_s += waited
    clock.expecting = True
    mb = MicroBatch(header.layout, link.recv((header.layout.payload_len,), torch.long, rank - 1))
    hidden = link.recv((header.layout.num_tokens, rt.resolved.model.hidden_size), rt.resolved.dtype, rank - 1)
    t1 = time.perf_counter()
    inp, hidden = rt.runner.run(mb, hidden.to(rt.resolved.device))
    max_batch = rt.resolved.engine.max_batch_size
    if rt.is_last:
        tokens = rt.runner.sample(inp, hidden)
        clock.busy_s += time.perf_counter() - t1
        counters = clock.stamp(wire.counters_of(raw.cpu()))
        link.send(wire.encode_result(header.mb_id, tokens, counters, max_batch), 0)
    else:
        clock.busy_s += time.perf_counter() - t1
        raw = raw.cpu()
        raw[wire.HEADER_LEN - 2 * wire.MAX_STAGES :] = clock.stamp(wire.counters_of(raw))
        link.send([raw, mb.payload, hidden], rank + 1)
    return True


def _relay_control(rt: StageRuntime, link: StageLink, header: wire.Header, raw: torch.Tensor) -> None:
    """Heartbeats travel to the last stage, which acknowledges to stage 0; shutdown travels down."""
    if rt.is_last:
        if header.kind is wire.Kind.HEARTBEAT:
            empty = SamplerOutput(torch.empty(0, dtype=torch.long))
            ack = wire.encode_result(wire.HEARTBEAT_ID, empty, wire.counters_of(raw.cpu()),
                                     rt.resolved.engine.max_batch_size)
            link.send(ack, 0)
    else:
        link.send([raw], rt.rank + 1)
    if header.kind is wire.Kind.SHUTDOWN:
        link.flush()
