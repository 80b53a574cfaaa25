"""Start a pipeline group's stages as local processes: the downstream stages of an in-process stage 0
(`LLM(pipeline_stages=P)`), or a whole group (`chariot up`, the benchmarks). They run the same
`chariot worker` entry point the operator runs in pods, with the same rendezvous environment
(`chariot.contracts.processes`)."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

from chariot.contracts.death_signal import popen_tied
from chariot.contracts.engine_settings import ENGINE_CORE, ITERATION_LOG
from chariot.contracts.errors import ConfigError
from chariot.contracts.processes import Child, Topology, reserve_rendezvous, spawn, stage_env
from chariot.worker.config import EngineConfig
from chariot.worker.flags import config_to_argv
from chariot.worker.iteration_log import iteration_log_path

WORKER_READY_PREFIX = "chariot worker ready"


def worker_command(config: EngineConfig) -> list[str]:
    """`chariot worker` with `config`'s engine flags, as this interpreter runs it."""
    return [sys.executable, "-m", "chariot.worker", "worker", *config_to_argv(config)]


def start_group(index: int, config: EngineConfig, served: str, engine_core: str = ENGINE_CORE.default, port: int = 0,
                iteration_log: str | None = ITERATION_LOG.default) -> tuple[list[Child], Child]:
    """Every stage of pipeline group `index` as supervised local processes (stage 0's gRPC on `port`,
    0 = a free one; metrics on free ports; rendezvous on loopback); returns (all its children, its
    stage 0). With `iteration_log`, stage 0 logs its iterations to that path with `index` before the
    suffix (`iteration_log_path`)."""
    check_local_devices(config)
    cmd = [*worker_command(config), "--port", str(port), "--metrics-port", "0", "--served-model-name", served,
           "--engine-core", engine_core]
    if iteration_log is not None:
        cmd += ["--iteration-log", str(iteration_log_path(iteration_log, index))]
    with reserve_rendezvous() as listener:  # stage 0 holds its own copy; this one closes once it is spawned
        topo = Topology(0, config.world_size, "127.0.0.1", listener.getsockname()[1], listener.fileno())
        children = [spawn(f"replica {index} {rank_name(config, rank)}", cmd, rank_env(config, topo, rank),
                          WORKER_READY_PREFIX, pass_fds=(listener.fileno(),) if rank == 0 else ())
                    for rank in range(config.world_size)]
    return children, children[0]


def rank_env(config: EngineConfig, topo: Topology, rank: int) -> dict[str, str]:
    """The rendezvous environment of global `rank`, and its device index on this machine
    (`LOCAL_RANK`: one GPU per rank when the group runs on CUDA)."""
    env = stage_env(topo, rank)
    env["LOCAL_RANK"] = str(rank)
    return env


def check_local_devices(config: EngineConfig, visible: int | None = None) -> None:
    """A group on one machine's GPUs needs one GPU per rank (NCCL cannot share a GPU between the
    ranks of a group): fail before starting anything, naming the fields, rather than in a rank.
    `visible` defaults to the CUDA devices torch sees (torch is imported only for a CUDA group)."""
    world, device = config.world_size, config.device
    if world == 1 or not device.startswith("cuda"):
        return
    shape = f"{config.pipeline_stages} stage(s) × tensor_parallel_size {config.tensor_parallel_size} = {world} ranks"
    if device != "cuda":
        raise ConfigError("device", f"{device!r} puts all {shape} on one GPU; NCCL needs one GPU per rank: "
                                    "pass 'cuda' to give rank r cuda:r")
    if visible is None:
        import torch  # deferred: `chariot up` on the CPU starts its children without importing torch

        visible = torch.cuda.device_count()
    if world > visible:
        raise ConfigError("pipeline_stages", f"{shape} need {world} GPUs on this machine, one per rank (NCCL cannot "
                                             f"share a GPU between ranks), but {visible} are visible")


def rank_name(config: EngineConfig, rank: int) -> str:
    """'stage S' for a stage's leader, 'stage S shard K' for a tensor-parallel follower (global `rank`)."""
    t = config.tensor_parallel_size
    return f"stage {rank // t}" if rank % t == 0 else f"stage {rank // t} shard {rank % t}"


def start_stage_shards(config: EngineConfig, stage_topo: Topology) -> tuple[Topology, list[subprocess.Popen[bytes]]]:
    """This process is stage `stage_topo.rank` of a group whose environment counts stages (one pod
    per stage on Kubernetes): start the stage's tensor-parallel followers as child processes and
    return this process's own place in the group of P × T ranks. Each rank's `LOCAL_RANK` is its
    shard, i.e. its GPU within the pod; the children die with this process."""
    t = config.tensor_parallel_size
    topo = Topology(stage_topo.rank * t, stage_topo.world_size * t, stage_topo.master_addr, stage_topo.master_port,
                    stage_topo.listen_fd)
    cmd = [*worker_command(config), "--metrics-port", "0"]
    children = []
    for shard in range(1, t):
        env = stage_env(topo, topo.rank + shard)
        env["LOCAL_RANK"] = str(shard)
        children.append(popen_tied(cmd, env=env))
    os.environ["LOCAL_RANK"] = "0"
    return topo, children


def stop_children(children: list[subprocess.Popen[bytes]], timeout: float = 10.0) -> None:
    """Wait for child ranks to exit (they follow their leader's shutdown), killing stragglers."""
    for child in children:
        try:
            child.wait(timeout)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()


def _spawn(cmd: list[str], env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    with log.open("wb") as err:  # the child keeps its own descriptor
        return popen_tied(cmd, env=env, stdout=subprocess.DEVNULL, stderr=err)


class LocalPipeline:
    """Ranks 1..P×T-1 of one group as child processes (downstream stages and tensor-parallel
    followers); the caller is rank 0 (stage 0's leader)."""

    def __init__(self, config: EngineConfig, host: str = "127.0.0.1") -> None:
        check_local_devices(config)
        self.config = config
        self.listener = reserve_rendezvous(host)  # adopted by this process's own stage 0 (rank 0)
        self.topology = Topology(0, config.world_size, host, self.listener.getsockname()[1], self.listener.fileno())
        cmd = [*worker_command(config), "--metrics-port", "0"]
        logdir, port = Path(tempfile.gettempdir()), self.topology.master_port
        self.logs = [logdir / f"chariot-{port}-rank{r}.log" for r in range(1, config.world_size)]
        self.procs = [_spawn(cmd, rank_env(config, self.topology, rank), log)
                      for rank, log in enumerate(self.logs, start=1)]

    def startup_problem(self) -> str | None:
        """Why the group cannot form (a stage exited), with the end of its log; None if all live."""
        for rank, (proc, log) in enumerate(zip(self.procs, self.logs, strict=True), start=1):
            code = proc.poll()
            if code is not None:
                tail = log.read_text(errors="replace").strip().splitlines()[-3:]
                return f"{rank_name(self.config, rank)} exited with code {code} ({' | '.join(tail)}; log: {log})"
        return None

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def stop(self, timeout: float = 10.0) -> list[int | None]:
        """Wait for the stages to exit (after a shutdown message), killing stragglers."""
        self.listener.close()
        codes: list[int | None] = []
        for p in self.procs:
            try:
                codes.append(p.wait(timeout))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
                codes.append(None)
        if all(c == 0 for c in codes):  # keep the logs of a group that failed
            for log in self.logs:
                log.unlink(missing_ok=True)
        return codes
