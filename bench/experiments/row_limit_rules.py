"""Where the start-up calibration's two rules for the few-rows route's limit part, on every calibration
the committed runs logged.

Why: at start-up each CPU stage times its few-rows kernel (panel, AMX tile or skinny) against oneDNN
at a handful of row counts and sends up to some count to the kernel (`cpu_linear.measured_row_limit`).
The rule used to be "the last count of an unbroken run of kernel wins", so one noisy count could end
the run early: a bf16 server on the Xeon AMX sent 13–32 rows to oneDNN after its calibration had the
tile kernel lose 16 rows by 7 % and win 24 and 32 rows by 1.5–1.8×. The rule now is the cut that
minimises the summed log time ratio below it (`RowsCalibration.max_rows_within`). This replays both
rules on the timings every committed log recorded (the calibration writes them into its log line)
and, where they differ, what the calibration itself measured at the counts between the two limits.

    .venv/bin/python -m chariot.bench.experiments.row_limit_rules [OUT_DIR] [LOG ...]   # seconds

Without LOGs it reads every `run.log` (and `*.log`) under docs/img. Writes OUT_DIR/row_limit_rules.json
(per calibration line: the log, the kernel, both limits, the timings, and the kernel-over-oneDNN time
ratio summed over the counts the rules route differently).
"""

from __future__ import annotations

import re
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from chariot.bench.linear_bench import save_record
from chariot.bench.server_iterations import read_log_lines
from chariot.worker.model.cpu_linear import PANEL_TIE, RowsCalibration

LINE = re.compile(r"linear layers: (?P<kernel>[\w ]+?) kernel for .*?kernel vs oneDNN: (?P<timings>[^;)]*)")
TIMING = re.compile(r"(?P<rows>\d+) rows (?P<kernel>[\d.]+) vs (?P<onednn>[\d.]+) ms")


def unbroken_run(calibration: RowsCalibration, tie: float) -> int:
    """The former rule: the last count of an unbroken run of kernel wins from the first count."""
    best = 0
    for rows, fast, slow in zip(calibration.rows, calibration.skinny_s, calibration.packed_s, strict=True):
        if fast >= tie * slow:
            break
        best = rows
    return best


def parse(line: str) -> tuple[str, RowsCalibration] | None:
    """The kernel and the decode row counts' timings of one calibration log line (None: not one)."""
    found = LINE.search(line)
    if found is None:
        return None
    timings = [(int(m["rows"]), float(m["kernel"]), float(m["onednn"])) for m in TIMING.finditer(found["timings"])]
    if not timings:
        return None
    rows, kernel, onednn = zip(*timings, strict=True)
    return found["kernel"], RowsCalibration(tuple(rows), tuple(kernel), tuple(onednn))


def replay(log: Path, kernel: str, calibration: RowsCalibration) -> dict[str, Any]:
    tie = PANEL_TIE if kernel == "panel" else 1.0
    old, new = unbroken_run(calibration, tie), calibration.max_rows_within(tie)
    between = [(r, k / o) for r, k, o in zip(calibration.rows, calibration.skinny_s, calibration.packed_s, strict=True)
               if min(old, new) < r <= max(old, new)]
    return {"log": str(log), "kernel": kernel, "unbroken_run": old, "best_cut": new,
            "timings_ms": [list(t) for t in zip(calibration.rows, calibration.skinny_s, calibration.packed_s,
                                                strict=True)],
            "kernel_over_onednn_between": between}


def main(out_dir: Path, logs: Sequence[Path]) -> None:
    rows = []
    for log in logs:
        for line in read_log_lines(log):
            parsed = parse(line)
            if parsed is not None:
                rows.append(replay(log, *parsed))
    differ = [r for r in rows if r["unbroken_run"] != r["best_cut"]]
    for r in differ:
        ratios = ", ".join(f"{n} rows {q:.2f}" for n, q in r["kernel_over_onednn_between"])
        print(f"{r['log']}: {r['kernel']}: {r['unbroken_run']} -> {r['best_cut']} rows (kernel / oneDNN: {ratios})")
    print(f"{len(differ)} of {len(rows)} calibrations differ")
    save_record(out_dir / "row_limit_rules.json", {"calibrations": len(rows), "differ": len(differ), "rows": rows})


if __name__ == "__main__":
    args = sys.argv[1:]
    out = Path(args[0]) if args else Path()
    given = [Path(a) for a in args[1:]]
    main(out, given or sorted(p for p in Path("docs/img").rglob("*.log") if p.is_file()))
