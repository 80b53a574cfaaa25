"""`popen_tied` on real processes: the parent-death signal is armed in the command itself (same PID,
same descriptors), a tied child dies with its parent, the shim never runs a command whose parent is
already gone, and children started beside a busy gRPC server all run (a `preexec_fn` there forks,
and gRPC's fork handlers can abort the child before it execs)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from chariot.contracts.death_signal import EXEC_FAILED_EXIT, ORPHANED_EXIT, SHIM, popen_tied

PR_GET_PDEATHSIG = 2
READ_DEATH_SIGNAL = (
    "import ctypes, os\n"
    "sig = ctypes.c_int(0)\n"
    f"ctypes.CDLL(None).prctl({PR_GET_PDEATHSIG}, ctypes.byref(sig), 0, 0, 0)\n"
    "print(sig.value, os.getpid())\n"
)
SPAWNS_BESIDE_GRPC = 60


@pytest.mark.parametrize("death_signal", [signal.SIGKILL, signal.SIGTERM])
def test_the_signal_is_armed_in_the_command_itself(death_signal: signal.Signals) -> None:
    proc = popen_tied([sys.executable, "-c", READ_DEATH_SIGNAL], death_signal=death_signal,
                      stdout=subprocess.PIPE, text=True)
    out, _ = proc.communicate(timeout=30)
    armed, pid = map(int, out.split())
    assert proc.returncode == 0
    assert armed == death_signal
    assert pid == proc.pid  # the shim exec'd the command in place


def test_passed_descriptors_reach_the_command(tmp_path: Path) -> None:
    read_end, write_end = os.pipe()
    try:
        proc = popen_tied([sys.executable, "-c", f"import os; os.write({write_end}, b'through')"],
                          pass_fds=(write_end,))
        assert proc.wait(30) == 0
        assert os.read(read_end, 16) == b"through"
    finally:
        os.close(read_end)
        os.close(write_end)


def _alive(pid: int) -> bool:
    """Running (a zombie has exited: in a container nobody may reap an orphan)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat[stat.rindex(")") + 2] not in "ZX"


@pytest.fixture
def parent_of_a_tied_sleep() -> Iterator[tuple[subprocess.Popen[str], int]]:
    """A Python parent that starts a tied `sleep 60` and prints its PID, then waits to be killed."""
    script = ("import subprocess, sys, time\n"
              "from chariot.contracts.death_signal import popen_tied\n"
              "child = popen_tied(['sleep', '60'])\n"
              "print(child.pid, flush=True)\n"
              "time.sleep(60)\n")
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    assert parent.stdout is not None
    child_pid = int(parent.stdout.readline())
    yield parent, child_pid
    parent.kill()
    parent.wait()
    if _alive(child_pid):
        os.kill(child_pid, signal.SIGKILL)


def test_a_tied_child_dies_with_its_parent(parent_of_a_tied_sleep: tuple[subprocess.Popen[str], int]) -> None:
    parent, child_pid = parent_of_a_tied_sleep
    assert _alive(child_pid)
    parent.kill()  # SIGKILL: the parent runs no clean-up of its own
    parent.wait()
    deadline = time.monotonic() + 10
    while _alive(child_pid) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not _alive(child_pid)


def test_the_shim_runs_nothing_once_its_parent_is_gone(tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    not_our_parent = 1  # the shim's parent is this test process, never PID 1
    done = subprocess.run([sys.executable, "-I", "-S", str(SHIM), str(not_our_parent), str(int(signal.SIGKILL)), "--",
                           "touch", str(marker)], timeout=30)
    assert done.returncode == ORPHANED_EXIT
    assert not marker.exists()


def test_the_shim_reports_a_command_it_cannot_exec(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, "-I", "-S", str(SHIM), str(os.getpid()), str(int(signal.SIGKILL)), "--",
                           str(tmp_path / "missing")], capture_output=True, text=True, timeout=30)
    assert done.returncode == EXEC_FAILED_EXIT
    assert "cannot run" in done.stderr and "missing" in done.stderr


def test_a_missing_program_raises_before_anything_starts(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="no-such-program"):
        popen_tied(["no-such-program-for-chariot"])
    with pytest.raises(FileNotFoundError):
        popen_tied([str(tmp_path / "missing")])
    with pytest.raises(FileNotFoundError):  # found on PATH here, but not on the child's own PATH
        popen_tied(["sleep", "0"], env={"PATH": str(tmp_path)})


def test_what_would_not_reach_the_command_is_refused() -> None:
    with pytest.raises(ValueError, match="preexec_fn"):
        popen_tied(["true"], preexec_fn=os.setsid)
    for cmd in ([], "true"):
        with pytest.raises(ValueError, match="cmd"):
            popen_tied(cmd)
    with pytest.raises(ValueError, match="shell"):
        popen_tied(["true"], shell=True)
    with pytest.raises(ValueError, match="executable"):
        popen_tied(["true"], executable="/bin/true")


@pytest.fixture
def busy_grpc_server() -> Iterator[None]:
    """A real gRPC server with a client calling it without pause, as in a worker or router process."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    health_pb2_grpc.add_HealthServicer_to_server(health.HealthServicer(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    stop = threading.Event()

    def call() -> None:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            while not stop.is_set():
                stub.Check(health_pb2.HealthCheckRequest(), timeout=5)

    caller = threading.Thread(target=call, daemon=True)
    caller.start()
    yield
    stop.set()
    caller.join(10)
    server.stop(grace=None).wait()


@pytest.mark.usefixtures("busy_grpc_server")
def test_children_started_beside_a_busy_grpc_server_all_run() -> None:
    codes = [popen_tied(["true"]).wait(30) for _ in range(SPAWNS_BESIDE_GRPC)]
    assert codes == [0] * SPAWNS_BESIDE_GRPC
