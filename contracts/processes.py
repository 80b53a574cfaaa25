"""The local process contract: the rendezvous environment a pipeline stage reads, and the supervision
of local child processes that print a ready line.

`Topology` and `stage_env` are the standard torch.distributed variables (`RANK`, `WORLD_SIZE`,
`MASTER_ADDR`, `MASTER_PORT`) that the operator sets in pods and `chariot up` sets for local
processes, so both start stages the same way. Locally, stage 0's rendezvous socket is bound and
listening before its port is written into that environment (`reserve_rendezvous`) and is handed to
stage 0 as an open descriptor (`RENDEZVOUS_FD`): a port that is merely found free can be taken by
any other socket (another group's gloo connections, a server binding port 0) before stage 0 binds
it. `spawn`/`wait_ready`/`shutdown` run the `chariot` processes of a local deployment (`chariot up`,
the benchmarks); children die with their parent
(`death_signal.popen_tied`: PR_SET_PDEATHSIG, armed after exec), so none is orphaned even if the
parent is killed. `end_group` waits out a whole
process group (a server started in a session of its own and everything it started), so a benchmark's
next phase does not share the CPU with the last one's exit. Torch-free.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

from chariot.contracts import environment
from chariot.contracts.death_signal import popen_tied
from chariot.contracts.errors import ConfigError

RENDEZVOUS_FD = environment.RENDEZVOUS_FD.name
"""Environment variable: the descriptor of rank 0's rendezvous socket, already listening on
`MASTER_PORT`, when its parent reserved it (local groups only; pods bind their own)."""
LISTEN_BACKLOG = 128


@dataclass(frozen=True)
class Topology:
    """Where this process sits in its pipeline group (the standard torch.distributed env)."""

    rank: int
    world_size: int
    master_addr: str
    master_port: int
    listen_fd: int | None = None  # rank 0 only: its rendezvous socket, listening on master_port

    @classmethod
    def from_env(cls) -> Topology:
        try:
            topo = cls(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), os.environ["MASTER_ADDR"],
                       int(os.environ["MASTER_PORT"]))
        except KeyError as exc:
            raise ConfigError(exc.args[0], "must be set for a pipeline stage (RANK, WORLD_SIZE, "
                                           "MASTER_ADDR, MASTER_PORT)") from exc
        except ValueError as exc:
            raise ConfigError("RANK/WORLD_SIZE/MASTER_PORT", f"must be integers ({exc})") from exc
        if not 0 <= topo.rank < topo.world_size:
            raise ConfigError("RANK", f"must be in [0, WORLD_SIZE={topo.world_size}), got {topo.rank}")
        fd = environment.read(environment.RENDEZVOUS_FD)
        if fd is None or not topo.is_first:
            return topo
        if not fd.isdigit():
            raise ConfigError(RENDEZVOUS_FD, f"must be a file descriptor number, got {fd!r}")
        return replace(topo, listen_fd=int(fd))

    @property
    def is_first(self) -> bool:
        return self.rank == 0

    @property
    def is_last(self) -> bool:
        return self.rank == self.world_size - 1


def reserve_rendezvous(host: str = "127.0.0.1") -> socket.socket:
    """A socket listening on a free port of `host`, for a local group's rank 0 to adopt: the port is
    never free between being chosen and being served on."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    try:
        sock.bind((host, 0))
        sock.listen(LISTEN_BACKLOG)
    except OSError:
        sock.close()
        raise
    return sock


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def stage_env(topo: Topology, rank: int) -> dict[str, str]:
    env = dict(os.environ)
    env.pop(RENDEZVOUS_FD, None)  # a descriptor of this process's means nothing in another rank
    env.update(RANK=str(rank), WORLD_SIZE=str(topo.world_size), MASTER_ADDR=topo.master_addr,
               MASTER_PORT=str(topo.master_port))
    if rank == 0 and topo.listen_fd is not None:
        env[RENDEZVOUS_FD] = str(topo.listen_fd)
    return env


@dataclass
class Child:
    """One supervised process and the ready line it printed."""

    name: str
    proc: subprocess.Popen[str]
    ready_line: str | None = None
    ready: threading.Event = field(default_factory=threading.Event)

    def pump(self, pattern: str) -> None:
        """Echo the child's stdout and remember its ready line (runs on a thread)."""
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if self.ready_line is None and line.startswith(pattern):
                self.ready_line = line.strip()
                self.ready.set()
            else:
                sys.stderr.write(f"[{self.name}] {line}")
        self.ready.set()  # EOF: the child exited


def spawn(name: str, cmd: list[str], env: dict[str, str], ready_prefix: str, new_session: bool = False,
          pass_fds: tuple[int, ...] = ()) -> Child:
    """Start `cmd`; `new_session` puts it in a session and process group of its own (its PID is the
    group's ID) so `end_group` can wait out everything it starts; `pass_fds` stay open in the child
    under the same numbers."""
    proc = popen_tied(cmd, env=env, stdout=subprocess.PIPE, text=True, bufsize=1, start_new_session=new_session,
                      pass_fds=pass_fds)
    child = Child(name, proc)
    threading.Thread(target=child.pump, args=(ready_prefix,), daemon=True).start()
    return child


def ready_field(ready_line: str, key: str) -> str | None:
    """The `HOST:PORT` a ready line names under `key` (`chariot worker ready grpc=HOST:PORT ...`), if any."""
    match = re.search(rf"\b{re.escape(key)}=(\S+)", ready_line)
    return match.group(1) if match else None


def wait_ready(child: Child, others: list[Child], timeout: float) -> str:
    """The child's ready line; fails as soon as it or any other child exits first."""
    deadline = time.monotonic() + timeout
    while not child.ready.wait(0.2):
        for c in [child, *others]:
            if c.proc.poll() is not None:
                raise RuntimeError(f"{c.name} exited with code {c.proc.returncode} before {child.name} was ready")
        if time.monotonic() > deadline:
            raise RuntimeError(f"{child.name} did not become ready within {timeout:.0f}s")
    if child.ready_line is None:
        raise RuntimeError(f"{child.name} exited with code {child.proc.wait()} before it was ready")
    return child.ready_line


def shutdown(children: list[Child], grace_s: float = 10.0) -> None:
    """SIGTERM the router and every stage 0, which tell their downstream stages to exit; give those
    stages the grace period to do so on their own (a signal while they tear down would end them by
    it), then SIGTERM the rest; SIGKILL whatever is still alive after a wave's grace period."""
    leaders = [c for c in children if c.name == "router" or c.name.endswith("stage 0")]
    followers = [c for c in children if c not in leaders]
    _signal_and_reap(leaders, grace_s)
    _signal_and_reap(_reap_within(followers, grace_s) if leaders else followers, grace_s)


def _reap_within(children: list[Child], grace_s: float) -> list[Child]:
    """Wait up to `grace_s` in all for `children` to exit; the ones still running."""
    deadline = time.monotonic() + grace_s
    running = []
    for child in children:
        try:
            child.proc.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            running.append(child)
    return running


def _signal_and_reap(children: list[Child], grace_s: float) -> None:
    """SIGTERM `children`, then SIGKILL whichever has not exited within `grace_s`."""
    for child in children:
        if child.proc.poll() is None:
            child.proc.send_signal(signal.SIGTERM)
    for child in _reap_within(children, grace_s):
        child.proc.kill()
        child.proc.wait()


def group_members(pgid: int, proc_root: Path = Path("/proc")) -> list[int]:
    """The processes of process group `pgid` still running, from `/proc/<pid>/stat` (zombies left out:
    they have exited and only wait to be reaped)."""
    members = []
    for entry in proc_root.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:  # exited while we looked
            continue
        fields = stat[stat.rindex(")") + 2:].split()  # after `pid (comm)`, which may hold spaces
        if int(fields[2]) == pgid and fields[0] not in ("Z", "X"):
            members.append(int(entry.name))
    return sorted(members)


def end_group(pgid: int, grace_s: float = 20.0, kill_wait_s: float = 30.0, poll_s: float = 0.1) -> list[int]:
    """Wait up to `grace_s` for every process of group `pgid` to exit, SIGKILL those still running,
    and return once none runs; returns the PIDs it had to kill. Raises RuntimeError naming the PIDs
    that outlive SIGKILL by `kill_wait_s` (stuck in the kernel)."""
    killed = _wait_group(pgid, grace_s, poll_s)
    if not killed:
        return []
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)
    left = _wait_group(pgid, kill_wait_s, poll_s)
    if left:
        raise RuntimeError(f"processes {left} of group {pgid} still run {kill_wait_s:g}s after SIGKILL")
    return killed


def _wait_group(pgid: int, timeout_s: float, poll_s: float) -> list[int]:
    """The group's running members once none runs or `timeout_s` has passed."""
    deadline = time.monotonic() + timeout_s
    while (left := group_members(pgid)) and time.monotonic() < deadline:
        time.sleep(poll_s)
    return left
