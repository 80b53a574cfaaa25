"""How often the drift check flags on noise (bench/experiments/drift_chance.py): searches read from a
peer document's machine records, the verdict kept as the benchmark gave it, and a committed run read
end to end."""

from __future__ import annotations

import json
from pathlib import Path

from chariot.bench.experiments.drift_chance import main, searches_of
from chariot.bench.experiments.iterations_from_traces import load
from chariot.bench.machine_speed import PhaseSpeed, Speed

REPO = Path(__file__).resolve().parents[2]


def phase(matmuls: list[float]) -> PhaseSpeed:
    speeds = [Speed(m, 20.0, 0.0) for m in matmuls]
    return PhaseSpeed(speeds[0], Speed(150.0, 20.0, 0.0), 0.0, tuple(speeds[1:]))


def doc(chariot: PhaseSpeed, vllm: PhaseSpeed, interleaved: bool = True) -> dict[str, object]:
    runs = [{"system": s, "variant": "fresh", "search": 0, "interleaved": interleaved, "machine": p.to_json()}
            for s, p in (("chariot", chariot), ("vllm", vllm))]
    return {"setup": {"cpu_model": "AMD EPYC", "cpu_flags": ["avx2", "avx512f", "avx512_bf16"]}, "runs": runs}


def test_a_noisy_search_is_flagged_and_its_random_splits_say_so() -> None:
    noisy = doc(phase([175, 120, 172, 118, 170, 125, 168]), phase([121, 171, 119, 169, 116, 165, 124]))
    (row,) = searches_of(noisy, "run")
    assert row.flagged and row.drift > 0.05 and row.calibrations == (7, 7)
    assert row.beyond_tolerance > 0.5 and row.at_least_observed > 0.1  # even a 35 % drift is common by chance
    assert row.cpu == "AMD EPYC (avx512f, avx512_bf16)"


def test_a_slower_system_stands_out_from_its_random_splits() -> None:
    tilted = doc(phase([101, 100, 102, 99, 100, 101, 100]), phase([90, 91, 89, 90, 92, 90, 91]))
    (row,) = searches_of(tilted, "run")
    assert row.flagged and row.at_least_observed < 0.05  # few splits drift as far


def test_searches_one_after_the_other_or_with_one_system_are_left_out() -> None:
    a, b = phase([100, 101, 99]), phase([100, 98, 97])
    assert searches_of(doc(a, b, interleaved=False), "run") == []
    lone = doc(a, b)
    lone["runs"] = lone["runs"][:1]  # type: ignore[index]
    assert searches_of(lone, "run") == []


def test_a_committed_run_is_read_with_the_verdicts_its_benchmark_gave(tmp_path: Path) -> None:
    run = REPO / "docs/img/peer-zen4-bf16/peer.json.gz"
    assert main([str(run), "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "drift_chance.json").read_text())
    summary = load(run)["summary"][0]["searches"]
    assert [r["search"] for r in rows] == [0, 1, 2]
    assert [r["flagged"] for r in rows] == [s["flagged"] for s in summary] == [True] * 3  # as BENCHMARKS.md says
    assert [r["drift"] for r in rows] == [s["machine"]["drift"] for s in summary]
    assert all(0.0 <= r["beyond_tolerance"] <= 1.0 for r in rows)
    assert (tmp_path / "drift_chance.png").stat().st_size > 0
