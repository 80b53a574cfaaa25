"""Start a pipeline group's downstream stages as local processes (`LLM(pipeline_stages=P)`,
`chariot up`). They run the same `chariot worker` entry point the operator runs in pods, with the
same rendezvous environment; children die with their parent (PR_SET_PDEATHSIG), so none is
orphaned even if the parent is killed."""

from __future__ import annotations

import ctypes
import os
import signal
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

from chariot.worker.config import EngineConfig
from chariot.worker.flags import config_to_argv
from chariot.worker.pipeline.transport import Topology

PR_SET_PDEATHSIG = 1


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def die_with_parent() -> None:
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def stage_env(topo: Topology, rank: int) -> dict[str, str]:
    env = dict(os.environ)
    env.update(RANK=str(rank), WORLD_SIZE=str(topo.world_size), MASTER_ADDR=topo.master_addr,
               MASTER_PORT=str(topo.master_port))
    return env


def _spawn(cmd: list[str], env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    with log.open("wb") as err:  # the child keeps its own descriptor
        return subprocess.Popen(cmd, env=env, preexec_fn=die_with_parent, stdout=subprocess.DEVNULL, stderr=err)


class LocalPipeline:
    """Stages 1..P-1 of one group as child processes; the caller is stage 0."""

    def __init__(self, config: EngineConfig, host: str = "127.0.0.1") -> None:
        self.topology = Topology(0, config.pipeline_stages, host, free_port(host))
        cmd = [sys.executable, "-m", "chariot.worker.cli", "worker", *config_to_argv(config), "--metrics-port", "0"]
        logdir, port = Path(tempfile.gettempdir()), self.topology.master_port
        self.logs = [logdir / f"chariot-{port}-stage{r}.log" for r in range(1, config.pipeline_stages)]
        self.procs = [_spawn(cmd, stage_env(self.topology, rank), log)
                      for rank, log in enumerate(self.logs, start=1)]

    def startup_problem(self) -> str | None:
        """Why the group cannot form (a stage exited), with the end of its log; None if all live."""
        for rank, (proc, log) in enumerate(zip(self.procs, self.logs, strict=True), start=1):
            code = proc.poll()
            if code is not None:
                tail = log.read_text(errors="replace").strip().splitlines()[-3:]
                return f"stage {rank} exited with code {code} ({' | '.join(tail)}; log: {log})"
        return None

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def stop(self, timeout: float = 10.0) -> list[int | None]:
        """Wait for the stages to exit (after a shutdown message), killing stragglers."""
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
