"""What one stage process runs on: its layers, its KV cache, its runner and, in a pipeline, its link.

Why a module of its own: the single-process engine, stage 0 of a pipeline and every downstream
stage build these the same way, from one `ResolvedConfig`, through `build_stage_runtime` — the
order matters (a stage that cannot size its cache or pin its cores fails before joining the group;
all stages agree on the block count before anyone allocates).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import torch

from chariot.contracts.errors import ConfigError
from chariot.kernels import active_backend
from chariot.worker.config import ResolvedConfig
from chariot.worker.executor import ModelRunner
from chariot.worker.kv_cache import KVCache
from chariot.worker.model.loader import load_stage
from chariot.worker.pipeline.transport import PeerCheck, StageLink, Topology
from chariot.worker.sampler import Sampler
from chariot.worker.warmup import warm_up

log = logging.getLogger(__name__)

STAGE_CPUS_ENV = "CHARIOT_STAGE_CPUS"


@dataclass(frozen=True)
class StageRuntime:
    """One stage's executable state; `link` is None for a single process."""

    resolved: ResolvedConfig
    rank: int
    runner: ModelRunner
    kv_cache: KVCache
    link: StageLink | None

    @property
    def is_last(self) -> bool:
        return self.rank == self.resolved.num_stages - 1

    def pipeline_link(self) -> StageLink:
        """The link to the neighbouring stages (a pipeline stage only)."""
        if self.link is None:
            raise RuntimeError("a single-process runtime has no pipeline link")
        return self.link


def build_stage_runtime(resolved: ResolvedConfig, topology: Topology | None, progress: bool = True,
                        peer_check: PeerCheck | None = None) -> StageRuntime:
    """Size the KV cache, join the pipeline group (if `topology`), agree on the block count, load
    this rank's layers, allocate its cache and run a warm-up forward pass (`warmup.py`: a broken
    backend fails here, before the stage reports ready, not in the first request).

    The attention backend is selected first, so that a kernel compiled on first use (the C++ CPU
    kernel, ~25 s) is built before the stages meet, not inside the first micro-batch where a peer
    would time out waiting for it."""
    rank = _rank(resolved, topology)
    log.info("stage %d attention backend: %s", rank, active_backend().name)
    if topology is not None:
        pin_stage_cpus(rank)
    first, last = resolved.layer_ranges[rank]
    local_blocks = KVCache.blocks_that_fit(resolved, last - first)
    link = None if topology is None else StageLink(topology, resolved.device, resolved.engine.stage_timeout_s,
                                                   peer_check, resolved.engine.rendezvous_timeout_s)
    num_blocks = local_blocks if link is None else KVCache.agree(local_blocks, link.device)
    stage = load_stage(resolved.engine.model, (first, last), resolved.dtype, resolved.device, progress=progress)
    kv_cache = KVCache.allocate(resolved, last - first, num_blocks)
    sampler = Sampler(resolved.engine.seed) if rank == resolved.num_stages - 1 else None
    runner = ModelRunner(stage, kv_cache, sampler, resolved.device)
    warm_up(runner, resolved, rank)
    return StageRuntime(resolved, rank, runner, kv_cache, link)


def _rank(resolved: ResolvedConfig, topology: Topology | None) -> int:
    """This process's stage; the topology must match the configured number of stages."""
    world = 1 if topology is None else topology.world_size
    if world != resolved.num_stages:
        raise ConfigError("pipeline_stages", f"is {resolved.num_stages} but the group has {world} stage(s)")
    return 0 if topology is None else topology.rank


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
