"""`chariot up --max-replicas 2` end to end: real router and worker processes (tiny model, CPU), the
same autoscaler as the operator's. A burst that the router sheds starts a second replica, which then
serves; when the load stops, the replica is drained (out of the router's list) and stopped; no
request fails on the way (each is served or shed with 429)."""

from __future__ import annotations

import json
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
import pytest

from chariot.bench.autoscale_ramp import start_up, stop_up

pytestmark = pytest.mark.slow


def looks(log: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in log.read_text().splitlines() if line.strip()] if log.exists() else []


def wait_for(what: str, cond: Any, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"{what} not within {timeout}s"
        time.sleep(0.2)


def test_a_burst_starts_a_second_replica_and_its_end_stops_it(tiny_model_dir: Path, tmp_path: Path) -> None:
    log = tmp_path / "autoscale.jsonl"
    proc, url = start_up(str(tiny_model_dir), log, tmp_path / "up.stderr.log", [
        "--max-queue-per-replica", "2", "--target-utilization", "1.0", "--autoscale-interval-seconds", "0.5",
        "--scale-down-stabilization-seconds", "2", "--drain-grace-seconds", "30", "--offered-load-window-seconds", "5"])
    outcomes: Counter[str] = Counter()
    replicas: Counter[str] = Counter()
    stop = threading.Event()
    lock = threading.Lock()

    def client() -> None:
        with httpx.Client(base_url=url, timeout=60.0) as http:
            while not stop.is_set():
                body = {"model": tiny_model_dir.name, "prompt": "autoscale " * 8, "max_tokens": 48,
                        "ignore_eos": True, "stream": True}
                try:
                    with http.stream("POST", "/v1/completions", json=body) as resp:
                        text = "".join(resp.iter_text())
                        done = text.rstrip().endswith("data: [DONE]") and '"error"' not in text
                        ok = resp.status_code == 200 and done
                        outcome = "ok" if ok else str(resp.status_code) if resp.status_code != 200 else "broken"
                        replica = resp.headers.get("x-chariot-replica", "")
                except httpx.HTTPError as exc:
                    outcome, replica = type(exc).__name__, ""
                with lock:
                    outcomes[outcome] += 1
                    if outcome == "ok":
                        replicas[replica] += 1
                if outcome == "429":
                    time.sleep(0.1)

    threads = [threading.Thread(target=client, daemon=True) for _ in range(6)]
    try:
        for t in threads:
            t.start()
        wait_for("a second replica ready", lambda: any(row.get("ready", 0) >= 2 for row in looks(log)), 90)
        assert any(row["reason"] == "ScaleUp" for row in looks(log))
        wait_for("the second replica serving", lambda: replicas["g1"] > 0, 30)
        stop.set()
        for t in threads:
            t.join(60)
        wait_for("back to one replica", lambda: looks(log)[-1]["replicas"] == 1, 40)
        assert any(row["reason"] == "ScaleDown" for row in looks(log))
        assert max(row["replicas"] for row in looks(log)) == 2, "--max-replicas holds"
    finally:
        stop.set()
        stop_up(proc)
    assert outcomes["429"] > 0, "the burst was shed before the second replica came"
    assert set(outcomes) <= {"ok", "429"}, (outcomes, (tmp_path / "up.stderr.log").read_text()[-3000:])
    stderr = (tmp_path / "up.stderr.log").read_text()
    assert "replica 1 draining" in stderr and "replica 1 stopped (drained)" in stderr, stderr[-3000:]
