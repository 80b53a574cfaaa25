"""peer_archive: a finished peer run's folder filed in one command. The run is the committed Xeon AMX
float32 run, unpacked as `chariot bench peer --out` leaves it; the archive must give back its raw files
byte for byte and the very analyses that were filed beside them by hand, and the full iterations'
medians BENCHMARKS quotes from it (465.2 against 500.5 ms pooled, vLLM's 1.05x Chariot's minute by minute)."""

from __future__ import annotations

import gzip
import json
import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from chariot.bench.experiments import peer_archive

COMMITTED = Path(__file__).resolve().parents[2] / "docs" / "img" / "peer-xeon-amx-fp32" / "row-step"


def unpack(dest: Path) -> Path:
    """The committed run as the harness leaves it: plain files, Chariot's logs under iterations/."""
    run = dest / "run"
    (run / "iterations").mkdir(parents=True)
    for gz in [COMMITTED / "peer.json.gz", COMMITTED / "vllm.log.gz", *COMMITTED.glob("iterations/*.gz")]:
        (run / gz.relative_to(COMMITTED).with_suffix("")).write_bytes(gzip.decompress(gz.read_bytes()))
    for png in COMMITTED.glob("*.png"):
        (run / png.name).write_bytes(png.read_bytes())
    return run


@pytest.fixture
def utc() -> Iterator[None]:
    """The process's local time zone set to UTC for one test, and the previous one restored after it
    (`time.tzset` again: the C library reads TZ only then)."""
    before = os.environ.get("TZ")
    os.environ["TZ"] = "UTC"
    time.tzset()
    yield
    if before is None:
        os.environ.pop("TZ", None)
    else:
        os.environ["TZ"] = before
    time.tzset()


@pytest.mark.slow
@pytest.mark.usefixtures("utc")  # vLLM's log lines carry local time: read in the zone the run was recorded in
def test_filing_a_run_reproduces_its_committed_analyses(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = unpack(tmp_path)
    console = tmp_path / "console.log"
    console.write_text("starting\nrc=0\n")
    dest = tmp_path / "filed"
    assert peer_archive.main([str(run), str(dest), str(console)]) == 0
    for name in ("peer.json", "vllm.log", "iterations/chariot-20261129T172219.0.jsonl"):
        assert gzip.decompress((dest / f"{name}.gz").read_bytes()) == (run / name).read_bytes()
    assert (dest / "run.log").read_text() == "starting\n"
    for name in ("iteration_cost.json", "first_seen.json", "iteration_mix.json"):
        assert json.loads((dest / name).read_text()) == json.loads((COMMITTED / name).read_text()), name
    full = json.loads((dest / "full_iterations.json").read_text())
    assert full["min_tokens"] == 500
    assert (full["chariot"]["iterations"], full["vllm"]["iterations"]) == (1700, 1823)
    assert round(full["chariot"]["median_forward_ms"], 1) == 465.2
    assert round(full["vllm"]["median_forward_ms"], 1) == 500.5
    timeline = json.loads((dest / "full_iteration_timeline.json").read_text())
    assert timeline["minutes_both_ran"] == 29 and (dest / "full_iteration_timeline.png").stat().st_size > 0
    assert round(timeline["vllm_over_chariot_by_minute"]["median"], 2) == 1.05
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ")]
    assert len(rows) == 3 and rows[0].startswith("| 1 (chariot) | [0.90625, 1) / [1.25, 1.375) | 0.66–0.80× |")
    assert "9.6 % **flagged**" in rows[0]


def test_filing_twice_gives_the_same_bytes(tmp_path: Path) -> None:
    src = tmp_path / "vllm.log"
    src.write_text("a line\n" * 100)
    first = peer_archive.gzip_copy(src, tmp_path / "a" / "vllm.log.gz").read_bytes()
    assert peer_archive.gzip_copy(src, tmp_path / "b" / "vllm.log.gz").read_bytes() == first
    assert gzip.decompress(first) == src.read_bytes()


def test_a_folder_without_the_run_names_what_is_missing(tmp_path: Path) -> None:
    (tmp_path / "peer.json").write_text("{}")
    with pytest.raises(SystemExit, match=r"vllm\.log not found"):
        peer_archive.main([str(tmp_path), str(tmp_path / "out")])


def test_full_iterations_need_most_of_the_budget() -> None:
    rows = {"chariot": [{"prefill": 480, "decodes": 20, "tokens": 500, "forward_ms": 100.0},
                        {"prefill": 480, "decodes": 19, "tokens": 499, "forward_ms": 1.0}],
            "vllm": [{"prefill": 500, "decodes": 0, "tokens": 500, "forward_ms": 200.0}]}
    full = peer_archive.full_iterations(rows, 512)
    assert full["chariot"]["iterations"] == 1 and full["chariot"]["median_forward_ms"] == 100.0
    assert full["chariot_over_vllm"] == 0.5


def test_a_search_whose_capacities_are_both_bounds_reads_unknown() -> None:
    """The committed Zen 4 bf16 offline-rounds run probed each system once, at 1 QPS, which both
    passed: each capacity is only a lower bound, so the row gives no capacity ratio, but still the
    offline medians and their ratio."""
    run = Path(__file__).resolve().parents[2] / "docs" / "img" / "peer-zen4-bf16" / "offline-rounds"
    summary = json.loads(gzip.decompress((run / "peer.json.gz").read_bytes()))["summary"]
    rows = peer_archive.search_rows(summary)
    assert len(rows) == 3
    assert rows[0].startswith("| 1 (chariot) | ≥ 1 / ≥ 1 | unknown | 224.0 / 192.4 | 1.17× |")
    assert all("| unknown |" in row for row in rows)
