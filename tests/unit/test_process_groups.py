"""`group_members` and `end_group` on real process groups: a server started in a session of its own
and the children it leaves behind (the benchmark harness waits them out before it calibrates)."""

from __future__ import annotations

import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from chariot.contracts.processes import end_group, group_members

# A parent that starts two grandchildren and exits at once when asked to (SIGTERM), leaving them.
LEAVES_CHILDREN = "sleep 60 & sleep 60 & trap 'exit 0' TERM; wait"
# A parent whose children exit soon after it does (as an engine core finishes after its server).
CHILDREN_EXIT_SOON = "(sleep 0.5) & (sleep 0.5) & exit 0"


@pytest.fixture
def groups() -> Iterator[list[subprocess.Popen[bytes]]]:
    started: list[subprocess.Popen[bytes]] = []
    yield started
    for proc in started:  # never leave a group behind, whatever the test did
        end_group(proc.pid, grace_s=0.0)
        proc.wait()


def start_group(groups: list[subprocess.Popen[bytes]], script: str) -> subprocess.Popen[bytes]:
    proc = subprocess.Popen(["sh", "-c", script], start_new_session=True)
    groups.append(proc)
    return proc


def wait_for_members(pgid: int, count: int) -> list[int]:
    deadline = time.monotonic() + 10
    while len(members := group_members(pgid)) < count and time.monotonic() < deadline:
        time.sleep(0.02)
    return members


def test_members_are_the_group_and_only_it(groups: list[subprocess.Popen[bytes]]) -> None:
    proc = start_group(groups, LEAVES_CHILDREN)
    members = wait_for_members(proc.pid, 3)
    assert len(members) == 3 and proc.pid in members
    other = start_group(groups, LEAVES_CHILDREN)
    assert not set(wait_for_members(other.pid, 3)) & set(members)


def test_stragglers_are_killed_after_the_grace(groups: list[subprocess.Popen[bytes]]) -> None:
    proc = start_group(groups, LEAVES_CHILDREN)
    wait_for_members(proc.pid, 3)
    proc.terminate()
    proc.wait(10)
    left = group_members(proc.pid)
    assert len(left) == 2 and proc.pid not in left  # the grandchildren outlive their parent
    assert sorted(end_group(proc.pid, grace_s=0.2)) == left
    assert group_members(proc.pid) == []


def test_a_group_that_exits_on_its_own_is_waited_for_not_killed(groups: list[subprocess.Popen[bytes]]) -> None:
    proc = start_group(groups, CHILDREN_EXIT_SOON)
    proc.wait(10)
    assert group_members(proc.pid)  # the children still run after the parent has exited
    assert end_group(proc.pid, grace_s=10.0) == []
    assert group_members(proc.pid) == []


def test_a_zombie_is_not_a_member(groups: list[subprocess.Popen[bytes]]) -> None:
    proc = start_group(groups, "exit 0")
    deadline = time.monotonic() + 10
    while Path(f"/proc/{proc.pid}/stat").read_text().split(")")[-1].split()[0] != "Z":
        assert time.monotonic() < deadline, "the child did not exit"
        time.sleep(0.02)
    assert group_members(proc.pid) == []  # exited, not yet reaped by us
    assert end_group(proc.pid, grace_s=0.0) == []


def test_a_command_name_with_spaces_and_parentheses_is_read(tmp_path: Path,
                                                            groups: list[subprocess.Popen[bytes]]) -> None:
    odd = tmp_path / "a) b 1 2"
    sleep = shutil.which("sleep")
    assert sleep is not None
    shutil.copy(sleep, odd)
    proc = subprocess.Popen([str(odd), "60"], start_new_session=True)
    groups.append(proc)
    assert wait_for_members(proc.pid, 1) == [proc.pid]


def test_an_empty_group_ends_at_once() -> None:
    unused = max(int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit()) + 10_000_000
    assert group_members(unused) == [] and end_group(unused, grace_s=5.0) == []
