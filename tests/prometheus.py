"""A real Prometheus server on loopback for tests (docs/architecture.md §8: Debian's `prometheus`, started by hand).

Why a real one: dashboards and alerts are PromQL over what Chariot exposes, and only Prometheus itself
proves that the exposition parses, that names/labels are what the queries expect, and that
`histogram_quantile(rate(...))` over our buckets gives the resolution we claim.

Usage::

    with PrometheusServer(["127.0.0.1:8001"], scrape_interval_s=1) as prom:
        prom.wait_for_targets_up()
        prom.wait_for("up", lambda r: len(r) == 1)
        result = prom.query("sum(rate(x_total[1m]))")

The binary is `$PROMETHEUS_BIN`, else `prometheus` on PATH, else `/usr/bin/prometheus` (Debian package
`prometheus`; its service is never used — no systemd here — we pass every flag ourselves). Each server
gets a free loopback port, a temporary TSDB directory and config file, and is stopped on `stop()` /
context exit, at interpreter exit, and — on Linux — when the test process dies (parent-death signal),
so a failing or killed test leaves no process behind. Only the standard library and Chariot's
`popen_tied` (the parent-death signal, armed after exec) are used.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
import weakref
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from types import TracebackType
from typing import Any

from chariot.contracts.death_signal import popen_tied

__all__ = ["PrometheusError", "PrometheusServer", "PrometheusUnavailable", "find_prometheus", "sample_value"]

Result = list[dict[str, Any]]
Targets = Iterable[str] | Mapping[str, Iterable[str]]

_LIVE: weakref.WeakSet[PrometheusServer] = weakref.WeakSet()


class PrometheusUnavailable(RuntimeError):
    """No `prometheus` binary: install the Debian package (`apt-get install -y prometheus`)."""


class PrometheusError(RuntimeError):
    """Prometheus failed to start, or a query was rejected."""


def find_prometheus() -> str:
    candidates = [os.environ.get("PROMETHEUS_BIN"), shutil.which("prometheus"), "/usr/bin/prometheus"]
    for c in candidates:
        if c and os.path.isfile(c) and os.access(c, os.X_OK):
            return c
    raise PrometheusUnavailable("prometheus binary not found (set PROMETHEUS_BIN or `apt-get install -y prometheus`)")


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def sample_value(sample: Mapping[str, Any]) -> float:
    """The float value of one instant-vector sample (`{"metric": …, "value": [ts, "1.5"]}`)."""
    return float(sample["value"][1])


class PrometheusServer:
    """One Prometheus process scraping `targets` every `scrape_interval_s` seconds.

    `targets` is a list of `host:port` (one job, `chariot`) or a mapping job → list of `host:port`.
    """

    def __init__(
        self,
        targets: Targets = (),
        *,
        scrape_interval_s: float = 1.0,
        metrics_path: str = "/metrics",
        binary: str | None = None,
        startup_timeout_s: float = 30.0,
    ) -> None:
        self.binary = binary or find_prometheus()
        self.scrape_interval_s = scrape_interval_s
        self.metrics_path = metrics_path
        self.startup_timeout_s = startup_timeout_s
        self._jobs = self._normalise(targets)
        self._proc: subprocess.Popen[bytes] | None = None
        self._tmp: tempfile.TemporaryDirectory[str] | None = None
        self._log: Any = None
        self.port: int | None = None

    # ------------------------------------------------------------------------------------- lifecycle

    @staticmethod
    def _normalise(targets: Targets) -> dict[str, list[str]]:
        if isinstance(targets, Mapping):
            return {str(job): list(t) for job, t in targets.items()}
        return {"chariot": list(targets)}

    @property
    def url(self) -> str:
        if self.port is None:
            raise PrometheusError("Prometheus is not running")
        return f"http://127.0.0.1:{self.port}"

    @property
    def workdir(self) -> Path:
        if self._tmp is None:
            raise PrometheusError("Prometheus is not running")
        return Path(self._tmp.name)

    def _config(self) -> str:
        interval = f"{max(int(self.scrape_interval_s * 1000), 100)}ms"
        # JSON is valid YAML, so no YAML library is needed.
        config = {
            "global": {"scrape_interval": interval, "scrape_timeout": interval, "evaluation_interval": interval},
            "scrape_configs": [
                {"job_name": job, "metrics_path": self.metrics_path, "static_configs": [{"targets": targets}]}
                for job, targets in self._jobs.items()
            ],
        }
        return json.dumps(config, indent=2)

    def start(self) -> PrometheusServer:
        if self._proc is not None:
            return self
        self._tmp = tempfile.TemporaryDirectory(prefix="chariot-prometheus-")
        workdir = Path(self._tmp.name)
        (workdir / "prometheus.yml").write_text(self._config())
        last_error: Exception | None = None
        for _attempt in range(3):  # the free port can be taken between probing and binding
            try:
                self._launch(workdir)
                self._wait_ready()
                _LIVE.add(self)
                return self
            except PrometheusError as e:
                last_error = e
                self._terminate()
        self.stop()
        raise PrometheusError(f"Prometheus did not start: {last_error}")

    def _launch(self, workdir: Path) -> None:
        self.port = _free_port()
        self._log = open(workdir / "prometheus.log", "ab")  # noqa: SIM115 - closed in _terminate
        self._proc = popen_tied(
            [
                self.binary,
                f"--config.file={workdir / 'prometheus.yml'}",
                f"--storage.tsdb.path={workdir / 'data'}",
                f"--web.listen-address=127.0.0.1:{self.port}",
                "--web.enable-lifecycle",
                "--storage.tsdb.retention.time=1h",
                "--log.level=warn",
            ],
            stdin=subprocess.DEVNULL,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            cwd=workdir,
            death_signal=signal.SIGTERM,
        )

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.startup_timeout_s
        while time.monotonic() < deadline:
            assert self._proc is not None
            if self._proc.poll() is not None:
                raise PrometheusError(f"exited with {self._proc.returncode}:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(f"{self.url}/-/ready", timeout=2) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(0.1)
        raise PrometheusError(f"not ready after {self.startup_timeout_s}s:\n{self.log_tail()}")

    def _terminate(self) -> None:
        proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)
        if self._log is not None:
            self._log.close()
            self._log = None

    def stop(self) -> None:
        """Stop the process and delete its data. Idempotent."""
        self._terminate()
        _LIVE.discard(self)
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None
        self.port = None

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def log_tail(self, n: int = 40) -> str:
        try:
            lines = (self.workdir / "prometheus.log").read_text(errors="replace").splitlines()
        except (OSError, PrometheusError):
            return "(no log)"
        return "\n".join(lines[-n:])

    def __enter__(self) -> PrometheusServer:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    # ------------------------------------------------------------------------------------------- config

    def set_targets(self, targets: Targets) -> None:
        """Replace the scrape targets and hot-reload the config (`/-/reload`)."""
        self._jobs = self._normalise(targets)
        (self.workdir / "prometheus.yml").write_text(self._config())
        self._request("/-/reload", method="POST")

    # ------------------------------------------------------------------------------------------- queries

    def _request(self, path: str, params: Mapping[str, str] | None = None, method: str = "GET") -> Any:
        url = f"{self.url}{path}"
        data = None
        if params:
            encoded = urllib.parse.urlencode(params)
            if method == "GET":
                url = f"{url}?{encoded}"
            else:
                data = encoded.encode()
        req = urllib.request.Request(url, data=data, method=method)
        try:
            with urllib.request.urlopen(req, timeout=10) as r:
                body = r.read()
        except urllib.error.HTTPError as e:
            body = e.read()
            try:
                msg = json.loads(body).get("error", body.decode(errors="replace"))
            except ValueError:
                msg = body.decode(errors="replace")
            raise PrometheusError(f"{method} {path} {dict(params or {})}: HTTP {e.code}: {msg}") from None
        if not body or path.startswith("/-/"):
            return None
        payload = json.loads(body)
        if payload.get("status") != "success":
            raise PrometheusError(f"{path} {dict(params or {})}: {payload.get('error')}")
        return payload["data"]

    def query(self, promql: str, at: float | None = None) -> Result:
        """Instant query; returns `data.result` (for a vector: `[{"metric": {...}, "value": [t, "v"]}]`).

        A scalar or string result is returned as a one-element list `[{"metric": {}, "value": [t, v]}]`.
        """
        params = {"query": promql}
        if at is not None:
            params["time"] = f"{at:.3f}"
        data = self._request("/api/v1/query", params, method="POST")
        if data["resultType"] in ("scalar", "string"):
            return [{"metric": {}, "value": data["result"]}]
        return list(data["result"])

    def query_range(self, promql: str, start: float, end: float, step_s: float = 1.0) -> Result:
        params = {"query": promql, "start": f"{start:.3f}", "end": f"{end:.3f}", "step": f"{step_s}"}
        return list(self._request("/api/v1/query_range", params, method="POST")["result"])

    def value(self, promql: str) -> float | None:
        """The single value of a query expected to return at most one sample (None if empty)."""
        result = self.query(promql)
        if len(result) > 1:
            raise PrometheusError(f"{promql!r} returned {len(result)} series, expected at most one")
        return sample_value(result[0]) if result else None

    def wait_for(
        self,
        promql: str,
        predicate: Callable[[Result], bool] = bool,
        timeout: float = 20.0,
        interval: float = 0.25,
    ) -> Result:
        """Poll `promql` until `predicate(result)` is true; returns that result, or raises AssertionError."""
        deadline = time.monotonic() + timeout
        last: Result | None = None
        error: Exception | None = None
        while True:
            try:
                last = self.query(promql)
                error = None
                if predicate(last):
                    return last
            except PrometheusError as e:
                error = e
            if time.monotonic() >= deadline:
                break
            time.sleep(interval)
        raise AssertionError(
            f"timed out after {timeout}s waiting on {promql!r}; last result {last!r}"
            + (f"; last error {error}" if error else "")
        )

    def wait_for_scrape(self, since: float | None = None, timeout: float = 20.0) -> None:
        """Wait until every target has been scraped after wall-clock time `since` (default: now).

        Call after recording values in the scraped process: afterwards every query sees them.
        """
        since = time.time() if since is None else since
        expected = sum(len(t) for t in self._jobs.values())
        self.wait_for(
            "timestamp(up)",
            lambda r: len(r) == expected and all(sample_value(s) > since for s in r),
            timeout=timeout,
        )

    def targets(self) -> list[dict[str, Any]]:
        return list(self._request("/api/v1/targets")["activeTargets"])

    def wait_for_targets_up(self, timeout: float = 20.0) -> list[dict[str, Any]]:
        """Wait until every configured target has been scraped successfully at least once."""
        expected = sum(len(t) for t in self._jobs.values())
        deadline = time.monotonic() + timeout
        active: list[dict[str, Any]] = []
        while time.monotonic() < deadline:
            active = self.targets()
            if len(active) == expected and all(t.get("health") == "up" for t in active):
                return active
            time.sleep(0.2)
        summary = [(t.get("scrapeUrl"), t.get("health"), t.get("lastError")) for t in active]
        raise AssertionError(f"targets not all up after {timeout}s: {summary}")


@atexit.register
def _stop_all() -> None:
    for server in list(_LIVE):
        with contextlib.suppress(Exception):
            server.stop()
