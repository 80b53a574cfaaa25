"""`shutdown` stops a local group the way its stages expect: stage 0 by SIGTERM, after which it tells
its downstream stages to exit, and those by themselves, a signal reaching them only if they outstay
the grace period (a downstream stage has no SIGTERM handler: one arriving while it tears down would
end it by the signal, not with code 0). Real processes; the stages stand in as small Python scripts."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from chariot.contracts.processes import Child, shutdown

LEADER = """
import signal, sys, time
from pathlib import Path
def stop(*_):
    Path(sys.argv[1]).write_text("stop")  # stands in for the stop message sent downstream
    sys.exit(0)
signal.signal(signal.SIGTERM, stop)
print("ready", flush=True)
while True:
    time.sleep(0.05)
"""

FOLLOWER = """
import sys, time
from pathlib import Path
while not Path(sys.argv[1]).exists():
    time.sleep(0.02)
time.sleep(0.8)  # tearing down: no handler for SIGTERM
"""

STUCK = "import time\ntime.sleep(600)\n"


def _child(name: str, script: str, *args: str) -> Child:
    proc = subprocess.Popen([sys.executable, "-c", script, *args], stdout=subprocess.PIPE, text=True)
    return Child(name, proc)


def test_downstream_stages_exit_on_their_own_after_stage_0(tmp_path: Path) -> None:
    told = tmp_path / "told"
    leader = _child("replica 0 stage 0", LEADER, str(told))
    assert leader.proc.stdout is not None and leader.proc.stdout.readline().strip() == "ready"
    followers = [_child(f"replica 0 stage {s}", FOLLOWER, str(told)) for s in (1, 2)]
    shutdown([leader, *followers], grace_s=10.0)
    assert [c.proc.returncode for c in (leader, *followers)] == [0, 0, 0]


def test_a_stage_that_outstays_the_grace_period_is_stopped(tmp_path: Path) -> None:
    told = tmp_path / "told"
    leader = _child("replica 0 stage 0", LEADER, str(told))
    assert leader.proc.stdout is not None and leader.proc.stdout.readline().strip() == "ready"
    stuck = _child("replica 0 stage 1", STUCK)
    shutdown([leader, stuck], grace_s=0.5)
    assert leader.proc.returncode == 0
    assert stuck.proc.returncode is not None and stuck.proc.returncode < 0


def test_without_a_stage_0_the_rest_are_signalled_at_once() -> None:
    stuck = _child("replica 0 stage 1", STUCK)
    shutdown([stuck], grace_s=5.0)
    assert stuck.proc.returncode == -15
