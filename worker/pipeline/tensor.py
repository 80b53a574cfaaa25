"""The tensor-parallel ranks of one stage: how the leader hands each micro-batch to its followers.

A stage of T ranks is one leader (shard 0: global rank stage × T), which alone talks to the other
stages and, on stage 0, schedules; and T - 1 followers, which run the same layers on their shards.
Before every forward pass the leader broadcasts what it is about to execute — the pipeline header,
the packed micro-batch and, downstream of stage 0, the hidden states it received — so every rank
decodes and runs the same batch, and the all-reduces inside the layers line up. Shutdown travels
the same way.

Two process groups per stage: a control group that carries only headers, with a long timeout (a
follower waits there while the deployment is idle), and the compute group, with the stage
timeout, that carries payloads, hidden states and the model's all-reduces. A rank that dies breaks
its peers' next collective (the connection closes), which fails the group as a dead stage does.
"""

from __future__ import annotations

import datetime
import logging
from dataclasses import dataclass

import torch
import torch.distributed as dist

from chariot.contracts.errors import PipelineError
from chariot.contracts.processes import Topology
from chariot.worker.micro_batch import MicroBatch
from chariot.worker.model.parallel import Collectives, Shard
from chariot.worker.pipeline import protocol as wire

log = logging.getLogger(__name__)
IDLE_TIMEOUT = datetime.timedelta(days=30)  # how long a follower may wait for the next micro-batch


@dataclass(frozen=True)
class RankPlace:
    """Where a global rank sits: its pipeline stage and its shard within that stage."""

    stage: int
    shard: int
    tensor_parallel_size: int

    @classmethod
    def of(cls, rank: int, tensor_parallel_size: int) -> RankPlace:
        return cls(rank // tensor_parallel_size, rank % tensor_parallel_size, tensor_parallel_size)

    @property
    def leader(self) -> int:
        """The global rank of this stage's leader."""
        return self.stage * self.tensor_parallel_size

    @property
    def is_leader(self) -> bool:
        return self.shard == 0


class TensorTeam:
    """This rank's view of its stage's tensor-parallel group (build with `form`, on every rank)."""

    def __init__(self, place: RankPlace, control: dist.ProcessGroup, compute: dist.ProcessGroup,
                 device: torch.device, hidden_size: int, dtype: torch.dtype) -> None:
        self.place, self.control, self.compute = place, control, compute
        self.device, self.hidden_size, self.dtype = device, hidden_size, dtype
        self.collectives = Collectives(Shard(place.shard, place.tensor_parallel_size), compute)

    @classmethod
    def form(cls, topo: Topology, tensor_parallel_size: int, device: torch.device, stage_timeout_s: float,
             hidden_size: int, dtype: torch.dtype) -> TensorTeam:
        """Create every stage's groups (each rank must create all of them, in the same order) and
        keep this rank's."""
        place = RankPlace.of(topo.rank, tensor_parallel_size)
        stages = topo.world_size // tensor_parallel_size
        mine: tuple[dist.ProcessGroup, dist.ProcessGroup] | None = None
        for stage in range(stages):
            ranks = [stage * tensor_parallel_size + s for s in range(tensor_parallel_size)]
            control = dist.new_group(ranks, timeout=IDLE_TIMEOUT, backend="gloo")
            compute = dist.new_group(ranks, timeout=datetime.timedelta(seconds=stage_timeout_s))
            if stage == place.stage:
                mine = (control, compute)
        if mine is None:
            raise PipelineError(f"rank {topo.rank} is in no stage of a {stages}-stage group")
        return cls(place, *mine, device, hidden_size, dtype)

    def wait_for_peers(self) -> None:
        """Every rank: return once all ranks of the stage got here (before the warm-up's first
        collective: loading a large shard may take one rank much longer than the stage timeout
        that bounds the compute group's collectives)."""
        try:
            dist.barrier(group=self.control)
        except RuntimeError as exc:
            raise PipelineError(f"stage {self.place.stage} tensor-parallel rank {self.place.shard}: a peer rank "
                                f"did not finish loading: {str(exc).splitlines()[0][:200]}") from exc

    # ---- leader ---------------------------------------------------------------------------------
    def share(self, mb: MicroBatch, hidden: torch.Tensor | None) -> None:
        """Leader: hand the micro-batch about to run (and its input hidden states) to the followers."""
        header = wire.encode_header(wire.Header(wire.Kind.BATCH, 0, mb.layout))
        self._broadcast(header, self.control, "send a micro-batch header to")
        self._broadcast(mb.payload.to(self.device), self.compute, "send a micro-batch to")
        if hidden is not None:
            self._broadcast(hidden.to(self.device).contiguous(), self.compute, "send hidden states to")

    def release(self) -> None:
        """Leader: tell the followers to exit."""
        self._broadcast(wire.encode_header(wire.Header(wire.Kind.SHUTDOWN, 0)), self.control, "stop")

    # ---- follower -------------------------------------------------------------------------------
    def receive(self) -> tuple[MicroBatch, torch.Tensor | None] | None:
        """Follower: the next micro-batch (and hidden states, past stage 0); None at shutdown."""
        raw = torch.empty(wire.HEADER_LEN, dtype=torch.long)
        self._broadcast(raw, self.control, "receive from")
        header = wire.decode_header(raw)
        if header.kind is wire.Kind.SHUTDOWN:
            return None
        payload = torch.empty(header.layout.payload_len, dtype=torch.long, device=self.device)
        self._broadcast(payload, self.compute, "receive a micro-batch from")
        hidden = None
        if self.place.stage > 0:
            hidden = torch.empty(header.layout.num_tokens, self.hidden_size, dtype=self.dtype, device=self.device)
            self._broadcast(hidden, self.compute, "receive hidden states from")
        return MicroBatch(header.layout, payload), hidden

    def _broadcast(self, t: torch.Tensor, group: dist.ProcessGroup, what: str) -> None:
        try:
            dist.broadcast(t, src=self.place.leader, group=group)
        except RuntimeError as exc:
            detail = str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__
            raise PipelineError(f"stage {self.place.stage} tensor-parallel rank {self.place.shard}: could not "
                                f"{what} its peers: {detail}") from exc
