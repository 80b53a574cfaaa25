"""Run a real `redis-server` for tests: loopback only, no persistence, never left behind.

    with RedisServer() as server:        # free port on 127.0.0.1, temp dir, waits for PING
        use(server.url)
        server.kill()                    # SIGKILL: an outage
        server.start()                   # same port again: the recovery
        server.pause(); server.resume()  # SIGSTOP / SIGCONT: a hung server (timeouts)

The binary is `$CHARIOT_REDIS_SERVER`, else `redis-server` on PATH (Debian's `redis-server` package
installs /usr/bin/redis-server). `find_redis_server()` returns None when there is none, so tests can
skip with a clear reason. Each server dies with the test process (`popen_tied`: PR_SET_PDEATHSIG, plus a
finalizer and `stop()` on exit from the `with` block). Start servers from the main thread: the
parent-death signal fires when the *thread* that started the server exits.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import weakref
from pathlib import Path
from types import TracebackType

import chariot.contracts.environment as env
from chariot.contracts.death_signal import popen_tied

START_TIMEOUT_S = 10.0


def find_redis_server() -> str | None:
    """The redis-server binary to use, or None."""
    explicit = env.read(env.REDIS_SERVER)
    if explicit:
        return explicit if os.access(explicit, os.X_OK) else None
    for candidate in (shutil.which("redis-server"), "/usr/bin/redis-server", "/usr/sbin/redis-server"):
        if candidate and os.access(candidate, os.X_OK):
            return candidate
    return None


def require_redis_server() -> str:
    """The redis-server binary, or the test fails (never skips) naming how to install one."""
    binary = find_redis_server()
    if binary is None:
        import pytest

        pytest.fail("redis-server not found: apt-get install redis-server (or set CHARIOT_REDIS_SERVER)", pytrace=False)
    return binary


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def ping(port: int, timeout_s: float = 0.5) -> bool:
    """True if a Redis answers PING on 127.0.0.1:port (raw RESP, no client library needed)."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=timeout_s) as sock:
            sock.sendall(b"PING\r\n")
            return sock.recv(64).startswith(b"+PONG")
    except OSError:
        return False


def _terminate(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.kill()
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=5)


class RedisServer:
    """One redis-server process on a fixed loopback port, restartable."""

    def __init__(self, binary: str | None = None, port: int | None = None) -> None:
        found = binary or find_redis_server()
        if found is None:
            raise FileNotFoundError("redis-server not found: apt-get install redis-server, or set CHARIOT_REDIS_SERVER")
        self.binary = found
        self.port = port or free_port()
        self._tmp = tempfile.TemporaryDirectory(prefix="chariot-redis-")
        self.dir = Path(self._tmp.name)
        self._proc: subprocess.Popen[bytes] | None = None
        self._finalizer: weakref.finalize | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def start(self) -> RedisServer:
        """Start (or restart, same port, empty data) and wait until it answers PING."""
        if self.running:
            return self
        args = [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
        args += ["--dir", str(self.dir), "--daemonize", "no", "--protected-mode", "yes"]
        with open(self.dir / "redis.log", "ab") as logfile:
            self._proc = popen_tied(args, death_signal=signal.SIGKILL, stdout=logfile, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL)
        self._finalizer = weakref.finalize(self, _terminate, self._proc)
        self._wait_ready()
        return self

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if ping(self.port):
                return
            if not self.running:
                break
            time.sleep(0.02)
        log = (self.dir / "redis.log").read_text(errors="replace")[-2000:]
        self.stop()
        raise RuntimeError(f"redis-server on port {self.port} did not start:\n{log}")

    def kill(self) -> None:
        """SIGKILL: the abrupt outage (no shutdown, connections reset)."""
        self._end(signal.SIGKILL)

    def stop(self) -> None:
        """SIGTERM and wait (SIGKILL past 5 s)."""
        self._end(signal.SIGTERM)

    def pause(self) -> None:
        """SIGSTOP: the server keeps its connections but answers nothing (a hung Redis)."""
        if self._proc is not None and self.running:
            self._proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        """SIGCONT after `pause`."""
        if self._proc is not None and self.running:
            self._proc.send_signal(signal.SIGCONT)

    def _end(self, sig: signal.Signals) -> None:
        proc, self._proc = self._proc, None
        if proc is None:
            return
        if proc.poll() is None:
            proc.send_signal(sig)
            if sig != signal.SIGKILL:
                proc.send_signal(signal.SIGCONT)  # a paused server must run to act on SIGTERM
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=5)
        if self._finalizer is not None:
            self._finalizer.detach()
            self._finalizer = None

    def close(self) -> None:
        self.stop()
        self._tmp.cleanup()

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()
