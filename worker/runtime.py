"""What one stage process runs on: its layers, its KV cache, its runner and, in a pipeline, its link.

Why a module of its own: the single-process engine, stage 0 of a pipeline and every downstream
stage build these the same way, from one `ResolvedConfig`, through `build_stage_runtime` — the
order matters (a stage that cannot size its cache or pin its cores fails before joining the group;
all stages agree on the block count before anyone allocates).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, replace

import torch

from chariot.contracts.environment import STAGE_CPUS, read
from chariot.contracts.errors import ConfigError, PipelineError
from chariot.kernels import active_backend
from chariot.worker.config import ResolvedConfig
from chariot.worker.executor import ModelRunner
from chariot.worker.graph_runner import GraphPlan, graph_pool_bytes
from chariot.worker.host_memory import keep_freed_memory
from chariot.worker.kv_cache import KVCache
from chariot.worker.model.loader import load_stage
from chariot.worker.model.parallel import SINGLE, Shard
from chariot.worker.pipeline.tensor import RankPlace, TensorTeam
from chariot.worker.pipeline.transport import PeerCheck, StageLink, Topology
from chariot.worker.sampler import Sampler
from chariot.worker.warmup import warm_up

log = logging.getLogger(__name__)

STAGE_CPUS_ENV = STAGE_CPUS.name
LOCAL_RANK_ENV = "LOCAL_RANK"


@dataclass(frozen=True)
class StageRuntime:
    """One rank's executable state: `rank` is its pipeline stage; `link` is None for a single
    process, `team` None without tensor parallelism."""

    resolved: ResolvedConfig
    rank: int
    runner: ModelRunner
    kv_cache: KVCache
    link: StageLink | None
    team: TensorTeam | None = None

    @property
    def is_last(self) -> bool:
        return self.rank == self.resolved.num_stages - 1

    @property
    def is_leader(self) -> bool:
        """The rank of its stage that talks to the other stages (every rank, without tensor parallelism)."""
        return self.team is None or self.team.place.is_leader

    def pipeline_link(self) -> StageLink:
        """The link to the neighbouring stages (a pipeline stage only)."""
        if self.link is None:
            raise RuntimeError("a single-process runtime has no pipeline link")
        return self.link

    def close(self, release_followers: bool = True) -> None:
        """Leave the group: a leader first releases its tensor-parallel followers."""
        if self.team is not None and self.team.place.is_leader and release_followers:
            try:
                self.team.release()
            except PipelineError as exc:
                log.warning("releasing the tensor-parallel ranks: %s", exc)
        if self.link is not None:
            self.link.close()


def build_stage_runtime(resolved: ResolvedConfig, topology: Topology | None, progress: bool = True,
                        peer_check: PeerCheck | None = None) -> StageRuntime:
    """Size the KV cache, join the pipeline group (if `topology`), agree on the block count, load
    this rank's layers, allocate its cache and run a warm-up forward pass (`warmup.py`: a broken
    backend fails here, before the stage reports ready, not in the first request). On the CPU,
    malloc is first told to keep freed activation memory (`host_memory.py`).

    The attention backend is selected first, so that a kernel compiled on first use (the C++ CPU
    kernel, ~25 s) is built before the stages meet, not inside the first micro-batch where a peer
    would time out waiting for it."""
    place = _place(resolved, topology)
    resolved = _rank_device(resolved, place)
    rank, engine = place.stage, resolved.engine
    log.info("stage %d attention backend: %s", rank, active_backend().name)
    if resolved.device.type == "cpu" and (why := keep_freed_memory()) is not None:
        log.info("malloc left as it is: %s", why)
    if topology is not None:
        pin_stage_cpus(topology.rank)
    first, last = resolved.layer_ranges[rank]
    shard = Shard(place.shard, place.tensor_parallel_size)
    graphs = GraphPlan.for_config(resolved)
    pool = graph_pool_bytes(graphs, resolved.model, place.tensor_parallel_size)
    local_blocks = KVCache.blocks_that_fit(resolved, last - first, shard, reserved_bytes=pool)
    link = None if topology is None else StageLink(topology, resolved.device, engine.stage_timeout_s, peer_check,
                                                   engine.rendezvous_timeout_s, place.tensor_parallel_size)
    num_blocks = local_blocks if link is None else KVCache.agree(local_blocks, link.device)
    team = None
    if topology is not None and place.tensor_parallel_size > 1:
        team = TensorTeam.form(topology, place.tensor_parallel_size, resolved.device, engine.stage_timeout_s,
                               resolved.model.hidden_size, resolved.dtype)
    tp = team.collectives if team is not None else SINGLE
    stage = load_stage(engine.model, (first, last), resolved.dtype, resolved.device, progress=progress, tp=tp)
    kv_cache = KVCache.allocate(resolved, last - first, num_blocks, shard, scratch_block=graphs.needs_scratch_block)
    if team is not None:
        team.wait_for_peers()
    samples = rank == resolved.num_stages - 1 and place.is_leader
    runner = ModelRunner(stage, kv_cache, Sampler(engine.seed) if samples else None, resolved.device, team, graphs,
                         split_horizon=resolved.max_model_len)
    warm_up(runner, resolved, rank)
    return StageRuntime(resolved, rank, runner, kv_cache, link, team)


def _place(resolved: ResolvedConfig, topology: Topology | None) -> RankPlace:
    """This process's stage and shard; the topology must match the configured group size."""
    tp = resolved.tensor_parallel_size
    world = 1 if topology is None else topology.world_size
    if world != resolved.num_stages * tp:
        raise ConfigError("pipeline_stages", f"{resolved.num_stages} stage(s) × tensor_parallel_size {tp} need "
                                             f"{resolved.num_stages * tp} rank(s), but the group has {world}")
    return RankPlace.of(0 if topology is None else topology.rank, tp)


def _rank_device(resolved: ResolvedConfig, place: RankPlace) -> ResolvedConfig:
    """On GPUs each rank of a group takes its own device, since NCCL cannot put two ranks of one group
    on one GPU: `cuda:$LOCAL_RANK`, which the launchers set (the global rank on one machine, the shard
    inside a pod), else `cuda:<shard>`. A single-rank stage without `LOCAL_RANK` (a pod with one GPU)
    keeps `cuda`; an explicit `cuda:N` is kept. A rank whose device is not there fails here, naming it."""
    if resolved.device.type != "cuda" or resolved.device.index is not None:
        return resolved
    local_rank = os.environ.get(LOCAL_RANK_ENV)
    if local_rank is None and place.tensor_parallel_size == 1:
        return resolved
    index = int(local_rank) if local_rank is not None else place.shard
    visible = torch.cuda.device_count()
    if index >= visible:
        raise ConfigError("device", f"this rank needs cuda:{index} (one GPU per rank: NCCL cannot share a GPU "
                                    f"between the ranks of a group), but {visible} CUDA device(s) are visible")
    return replace(resolved, device=torch.device("cuda", index))


def pin_stage_cpus(rank: int) -> None:
    """Optional CPU pinning for benchmarks on one machine: `CHARIOT_STAGE_CPUS="0,1"` gives stage r
    the r-th core set (`a+b` joins cores) and as many torch threads as cores."""
    spec = read(STAGE_CPUS)
    if not spec:
        return
    sets = spec.split(",")
    if rank >= len(sets):
        raise ConfigError(STAGE_CPUS_ENV, f"names {len(sets)} core sets but stage {rank} needs one")
    cores = {int(c) for c in sets[rank].split("+")}
    os.sched_setaffinity(0, cores)
    torch.set_num_threads(len(cores))
