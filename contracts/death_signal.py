"""Local child processes that die with their parent, with no Python code between fork and exec.

Linux delivers a chosen signal to a child when its parent dies (`PR_SET_PDEATHSIG`), but the child
must arm it itself. Arming it from `subprocess.Popen(preexec_fn=...)` makes CPython use a plain
`fork()` instead of `vfork()`, and a plain fork of a process that runs a gRPC server or client
(grpcio 1.81 onward) runs gRPC's fork handlers, which restart its event-engine poller in the child;
`close_fds` then closes the poller's epoll descriptor and the child aborts before it execs
(`Epoll1Poller epoll_wait error: Bad file descriptor`, SIGABRT). So a tied child execs this
file first instead, as `python -I -S` (the standard library only: neither Chariot nor the caller's
`PYTHONPATH` is needed, and it starts in milliseconds). It arms the signal, makes sure the process
that started it is still its parent (that one may have died before the signal was armed), and
execs the real command in place: same PID, same descriptors, same environment and working directory.

    popen_tied(["redis-server", "--port", "0"], death_signal=signal.SIGKILL, stdout=log)
"""

from __future__ import annotations

import ctypes
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

SHIM = Path(__file__).resolve()
ORPHANED_EXIT = 70
"""The shim's exit status when the parent that started it was gone before the signal was armed."""
EXEC_FAILED_EXIT = 127
PR_SET_PDEATHSIG = 1


def tied_command(cmd: Sequence[str], death_signal: int, parent: int) -> list[str]:
    """`cmd` behind the shim: run by a child of `parent`, it gets `death_signal` when `parent` dies."""
    return [sys.executable, "-I", "-S", str(SHIM), str(parent), str(int(death_signal)), "--", *cmd]


def popen_tied(cmd: Sequence[str], death_signal: int = signal.SIGKILL, **popen_kwargs: Any) -> subprocess.Popen[Any]:
    """`subprocess.Popen(cmd, **popen_kwargs)` whose child gets `death_signal` when this process dies.
    The child's PID is the command's own (the shim execs it in place), so signals, `wait` and process
    groups work as with a plain Popen. Raises FileNotFoundError, as Popen would, when `cmd`'s program
    cannot be found (the shim would only find out after the exec)."""
    if "preexec_fn" in popen_kwargs:
        raise ValueError("popen_tied: preexec_fn would force a fork that gRPC's fork handlers abort; "
                         "pass the setting as a Popen argument (start_new_session, pass_fds, ...)")
    if isinstance(cmd, str) or not cmd:
        raise ValueError("popen_tied: cmd must be a non-empty list of arguments, program first")
    if popen_kwargs.get("shell") or "executable" in popen_kwargs:
        raise ValueError("popen_tied: shell and executable would apply to the shim, not to cmd")
    _check_runnable(cmd[0], popen_kwargs.get("env"), popen_kwargs.get("cwd"))
    return subprocess.Popen(tied_command(cmd, death_signal, os.getpid()), **popen_kwargs)


def _check_runnable(program: str, env: dict[str, str] | None, cwd: str | os.PathLike[str] | None) -> None:
    if os.sep in program:
        path = program if os.path.isabs(program) or cwd is None else os.path.join(cwd, program)
        found = os.access(path, os.X_OK) and not os.path.isdir(path)
    else:
        search = (env if env is not None else os.environ).get("PATH", os.defpath)
        found = shutil.which(program, path=search) is not None
    if not found:
        raise FileNotFoundError(2, "No such file or directory (or not executable)", program)


def arm(death_signal: int) -> None:
    """Ask the kernel to send this process `death_signal` when the thread that forked it exits."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, int(death_signal), 0, 0, 0) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"prctl(PR_SET_PDEATHSIG, {death_signal}): {os.strerror(err)}")


def main(argv: Sequence[str]) -> int:
    """`PARENT SIGNAL -- CMD...`: arm SIGNAL, then exec CMD unless PARENT is no longer the parent."""
    if len(argv) < 4 or argv[2] != "--":
        sys.stderr.write(f"usage: python -I -S {SHIM} PARENT_PID SIGNAL -- COMMAND [ARG...]\n")
        return 2
    parent, death_signal, cmd = int(argv[0]), int(argv[1]), list(argv[3:])
    arm(death_signal)
    if os.getppid() != parent:  # the parent died before the signal was armed: nobody would stop us
        return ORPHANED_EXIT
    try:
        os.execvp(cmd[0], cmd)
    except OSError as exc:
        sys.stderr.write(f"{SHIM.name}: cannot run {cmd[0]}: {exc}\n")
    return EXEC_FAILED_EXIT


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
