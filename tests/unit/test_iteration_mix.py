"""The iteration-mix report (`bench/experiments/iteration_mix.py`) on a peer document shaped as the
harness writes it: a row per system and load with the server's own counts, offline rounds after the
probes, probes without a record left out, and the plotted load the lowest where Chariot failed."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from chariot.bench.experiments.iteration_mix import failing_load, main, report
from chariot.bench.server_iterations import summary


def iterations(source: str, tokens: list[int], waiting: int | None = None) -> dict[str, Any]:
    """A source's summary of iterations with these token counts (prompt tokens past a 32-decode batch)."""
    records = [{"tokens": t, "prefill": max(t - 32, 0), "decodes": min(t, 32), "forward_ms": t / 4,
                **({} if waiting is None else {"waiting": waiting})} for t in tokens]
    return {"source": source, **summary(records, 512)}


def probe(qps: float, verdict: str, its: dict[str, Any] | None) -> dict[str, Any]:
    return {"qps": qps, "verdict": verdict, "summary": {"wall_s": 10.0}, "iterations": its, "traces": []}


def doc() -> dict[str, Any]:
    chariot = {"waiting": 3}
    return {"runs": [
        {"system": "chariot", "variant": "fresh", "search": 0, "probes": [
            probe(1.0, "pass", iterations("chariot --iteration-log", [20, 512, 30], **chariot)),
            probe(1.5, "fail: median TTFT", iterations("chariot --iteration-log", [40, 300, 512, 35], **chariot)),
            probe(2.0, "fail: median TTFT", None)],  # an older run's probe: no record
         "offline": {"rounds": [{"wall_s": 20.0}],
                     "round_iterations": [iterations("chariot --iteration-log", [512] * 4)]}},
        {"system": "vllm", "variant": "fresh", "search": 0, "probes": [
            probe(1.0, "pass", iterations("vllm --enable-logging-iteration-details", [20, 512])),
            probe(1.5, "pass", iterations("vllm --enable-logging-iteration-details", [512, 512, 40]))],
         "offline": {}},
    ]}


def test_rows_per_system_and_load_with_the_servers_counts() -> None:
    rows = report(doc())
    assert [(r["system"], r["qps"]) for r in rows] == [("chariot", 1.0), ("chariot", 1.5), ("chariot", None),
                                                       ("vllm", 1.0), ("vllm", 1.5)]
    at_load = rows[1]
    assert at_load["iterations"] == 4 and at_load["tokens_mean"] == (40 + 300 + 512 + 35) / 4
    assert at_load["iterations_per_s"] == 0.4 and at_load["prefill"] == {"p50": (8 + 268) / 2, "p90": 480}
    assert at_load["waiting"] == {"p50": 3, "p90": 3} and at_load["forward_s"] == round(887 / 4 / 1e3, 3)
    assert rows[2]["verdict"] == "offline round 1" and rows[2]["iterations_per_s"] == 0.2
    assert "waiting" not in rows[4] and rows[4]["share_full"] == 2 / 3 and rows[4]["share_with_prompt"] == 1
    assert failing_load(rows) == 1.5


def test_writes_the_table_and_the_plot(tmp_path: Path) -> None:
    src = tmp_path / "peer.json"
    src.write_text(json.dumps(doc()))
    assert main([str(src), str(tmp_path / "out")]) == 0
    written = json.loads((tmp_path / "out" / "iteration_mix.json").read_text())
    assert written["source"] == "peer.json" and len(written["rows"]) == 5
    assert (tmp_path / "out" / "iteration_mix.png").stat().st_size > 10_000
