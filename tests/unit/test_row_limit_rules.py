"""The replay of the start-up calibration's row-limit rules reads the timings back out of a real log
line and finds where the former rule (an unbroken run of kernel wins) and the current one part."""

from __future__ import annotations

from pathlib import Path

from chariot.bench.experiments.row_limit_rules import parse, replay, unbroken_run

LINE = ("2026-11-29 15:07:56,460 INFO chariot.worker.model.cpu_linear [core]: linear layers: amx tile kernel for "
        "up to 12 rows, oneDNN above (measured per pass over the first 256 MiB of the stage's layers, kernel vs "
        "oneDNN: 1 rows 13.2 vs 20.0 ms, 2 rows 12.3 vs 19.9 ms, 4 rows 12.9 vs 19.7 ms, 8 rows 13.2 vs 20.2 ms, "
        "12 rows 8.7 vs 11.7 ms, 16 rows 12.5 vs 11.7 ms, 24 rows 13.9 vs 24.9 ms, 32 rows 19.2 vs 28.4 ms)")


def test_a_logged_calibration_replays_under_both_rules() -> None:
    parsed = parse(LINE)
    assert parsed is not None
    kernel, calibration = parsed
    assert kernel == "amx tile" and calibration.rows == (1, 2, 4, 8, 12, 16, 24, 32)
    assert calibration.skinny_s[5] == 12.5 and calibration.packed_s[5] == 11.7
    assert unbroken_run(calibration, 1.0) == 12  # what that server ran with
    row = replay(Path("run.log"), kernel, calibration)
    assert row["unbroken_run"] == 12 and row["best_cut"] == 32
    assert [n for n, _ in row["kernel_over_onednn_between"]] == [16, 24, 32]
    assert parse("INFO chariot.worker: something else") is None
