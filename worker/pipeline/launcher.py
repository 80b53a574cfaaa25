"""Start a pipeline group's stages as local processes: the downstream stages of an in-process stage 0
(`LLM(pipeline_stages=P)`), or a whole group (`chariot up`, the benchmarks). They run the same
`chariot worker` entry point the operator runs in pods, with the same rendezvous environment
(`chariot.contracts.processes`)."""

from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path

from chariot.contracts.processes import Child, Topology, die_with_parent, free_port, spawn, stage_env
from chariot.worker.config import EngineConfig
from chariot.worker.flags import config_to_argv

WORKER_READY_PREFIX = "chariot worker ready"


def worker_command(config: EngineConfig) -> list[str]:
    """`chariot worker` with `config`'s engine flags, as this interpreter runs it."""
    return [sys.executable, "-m", "chariot.worker", "worker", *config_to_argv(config)]


def start_group(index: int, config: EngineConfig, served: str, engine_core: str = "process", port: int = 0,
                ) -> tuple[list[Child], Child]:
    """Every stage of pipeline group `index` as supervised local processes (stage 0's gRPC on `port`,
    0 = a free one; metrics on free ports; rendezvous on loopback); returns (all its children, its
    stage 0)."""
    topo = Topology(0, config.pipeline_stages, "127.0.0.1", free_port())
    cmd = [*worker_command(config), "--port", str(port), "--metrics-port", "0", "--served-model-name", served,
           "--engine-core", engine_core]
    children = [spawn(f"replica {index} stage {rank}", cmd, stage_env(topo, rank), WORKER_READY_PREFIX)
                for rank in range(config.pipeline_stages)]
    return children, children[0]


def _spawn(cmd: list[str], env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    with log.open("wb") as err:  # the child keeps its own descriptor
        return subprocess.Popen(cmd, env=env, preexec_fn=die_with_parent, stdout=subprocess.DEVNULL, stderr=err)


class LocalPipeline:
    """Stages 1..P-1 of one group as child processes; the caller is stage 0."""

    def __init__(self, config: EngineConfig, host: str = "127.0.0.1") -> None:
        self.topology = Topology(0, config.pipeline_stages, host, free_port(host))
        cmd = [*worker_command(config), "--metrics-port", "0"]
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
