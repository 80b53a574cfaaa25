"""How far two of the peer benchmark's machine calibrations disagree back to back, against how far the
machine moves over a probe, a phase and a search, with nothing else running.

Why: `chariot bench peer` flags a comparison whose calibrations (`machine_speed.measure_speed`) moved
by more than `DRIFT_TOLERANCE`. Whether a flag reports the machine or the instrument depends on the
instrument's own repeatability, which this measures: it times the calibration back to back for a
while on a quiet machine and reports, per metric (matmul GFLOP/s, read GB/s),
- `consecutive`: the change between one calibration and the next (max/min - 1, about a second
  apart): what the instrument alone contributes;
- `windows`: the spread (max/min - 1, the peer's `within`) over every window of 1, 5 and 10 minutes
  (about a probe, two probes, a phase of the peer run): what the machine contributes on that scale;
- `phase_like`: the spread of `PHASE_CALIBRATIONS` calibrations evenly spaced over every 10-minute
  window, as a peer phase takes them (before, between its probes and rounds, after): the spread
  the drift check would see for a phase on this machine with the systems taken away;
- `whole`: the spread over the run.
Calibrations during which other processes took more than `CONTENTION_LIMIT` of the CPU are kept in
the record and left out of the statistics, as the peer benchmark does.

    .venv/bin/python -m chariot.bench.experiments.calibration_repeatability [MINUTES] [OUT_DIR]   # 15 min

Writes OUT_DIR/calibration_repeatability.json (every calibration with its time, the statistics, the
CPU record) and calibration_repeatability.png (both metrics over time).
"""

from __future__ import annotations

import bisect
import itertools
import json
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from chariot.bench.machine_speed import CONTENTION_LIMIT, DRIFT_TOLERANCE, Speed, measure_speed, spread

MINUTES = 15.0
WINDOWS_S = (60.0, 300.0, 600.0)
METRICS = ("matmul_gflops", "read_gbps")
PHASE_S = 600.0  # about one phase of a peer run
PHASE_CALIBRATIONS = 9  # about as many as a peer phase takes


def consecutive_changes(values: Sequence[float]) -> list[float]:
    """The spread of each pair of neighbouring values."""
    return [spread(pair) for pair in itertools.pairwise(values)]


def window_spreads(times: Sequence[float], values: Sequence[float], window_s: float) -> list[float]:
    """The spread over every window [t, t + window_s] that starts at a sample and is covered by the
    run (the last sample at or past its end), with at least two samples in it."""
    out = []
    for i, start in enumerate(times):
        if times[-1] < start + window_s:
            break
        inside = [v for t, v in zip(times[i:], values[i:], strict=True) if t <= start + window_s]
        if len(inside) >= 2:
            out.append(spread(inside))
    return out


def phase_like_spreads(times: Sequence[float], values: Sequence[float], window_s: float = PHASE_S,
                       count: int = PHASE_CALIBRATIONS) -> list[float]:
    """For every window [t, t + window_s] starting at a sample and covered by the run, the spread of
    the `count` samples nearest to `count` evenly spaced times in it (the first at t, the last at its
    end)."""
    out = []
    for start in times:
        if times[-1] < start + window_s:
            break
        targets = [start + window_s * k / (count - 1) for k in range(count)]
        picked = [values[bisect.bisect_left(times, target) if target <= times[-1] else len(times) - 1]
                  for target in targets]
        out.append(spread(picked))
    return out


def summary(changes: Sequence[float]) -> dict[str, float] | None:
    """Median, 90th percentile and largest of a list of changes (None when it is empty)."""
    if not changes:
        return None
    ordered = sorted(changes)
    return {"median": round(statistics.median(ordered), 4),
            "p90": round(ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))], 4), "max": round(ordered[-1], 4),
            "count": len(ordered)}


def statistics_of(times: Sequence[float], speeds: Sequence[Speed]) -> dict[str, Any]:
    """Per metric: consecutive changes, window spreads and the whole run's spread, over the
    uncontended calibrations."""
    kept = [(t, s) for t, s in zip(times, speeds, strict=True) if not s.contended]
    ts = [t for t, _ in kept]
    out: dict[str, Any] = {"calibrations": len(speeds), "contended": len(speeds) - len(kept)}
    for metric in METRICS:
        values = [getattr(s, metric) for _, s in kept]
        out[metric] = {"consecutive": summary(consecutive_changes(values)),
                       "windows": {f"{w / 60:g} min": summary(window_spreads(ts, values, w)) for w in WINDOWS_S},
                       "phase_like": summary(phase_like_spreads(ts, values)),
                       "whole": round(spread(values), 4) if len(values) >= 2 else None,
                       "range": [min(values), max(values)] if values else None}
    return out


def run(minutes: float) -> tuple[list[float], list[Speed]]:
    """Calibrations back to back for `minutes`, each with its start time (s from the first)."""
    from tqdm.auto import tqdm

    times: list[float] = []
    speeds: list[Speed] = []
    t0 = time.monotonic()
    with tqdm(total=round(minutes * 60), unit="s", desc="calibrating", mininterval=5.0) as bar:
        while (now := time.monotonic() - t0) < minutes * 60:
            times.append(round(now, 3))
            speeds.append(measure_speed())
            bar.update(round(time.monotonic() - t0) - bar.n)
            bar.set_postfix(matmul=f"{speeds[-1].matmul_gflops:.0f}", read=f"{speeds[-1].read_gbps:.1f}")
    return times, speeds


def plot(times: Sequence[float], speeds: Sequence[Speed], path: Path) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(8.0, 4.5))
    FigureCanvasAgg(fig)
    axes = fig.subplots(2, 1, sharex=True)
    minutes = [t / 60 for t in times]
    for ax, metric, label in zip(axes, METRICS, ("matmul GFLOP/s", "read GB/s"), strict=True):
        clean = [(m, getattr(s, metric)) for m, s in zip(minutes, speeds, strict=True) if not s.contended]
        busy = [(m, getattr(s, metric)) for m, s in zip(minutes, speeds, strict=True) if s.contended]
        ax.plot(*zip(*clean, strict=True), ".-", markersize=3, linewidth=0.6, label="calibration")
        if busy:
            ax.plot(*zip(*busy, strict=True), "x", color="tab:red", label="contended (left out)")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    axes[0].set_title("The peer benchmark's calibration, back to back on a quiet machine")
    axes[0].legend(loc="lower right", fontsize=8)
    axes[1].set_xlabel("minutes")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(minutes: float, out_dir: Path) -> None:
    from chariot.bench.linear_bench import cpu_record

    times, speeds = run(minutes)
    stats = statistics_of(times, speeds)
    out_dir.mkdir(parents=True, exist_ok=True)
    record = {"machine": cpu_record(), "minutes": minutes, "drift_tolerance": DRIFT_TOLERANCE,
              "contention_limit": CONTENTION_LIMIT, "statistics": stats,
              "calibrations": [{"t_s": t, **vars(s)} for t, s in zip(times, speeds, strict=True)]}
    (out_dir / "calibration_repeatability.json").write_text(json.dumps(record, indent=1))
    plot(times, speeds, out_dir / "calibration_repeatability.png")
    for metric in METRICS:
        s = stats[metric]
        windows = "".join(f"{w} windows: median {v['median']:.1%} max {v['max']:.1%}; "
                          for w, v in s["windows"].items() if v)
        phase = s["phase_like"]
        phase_text = f"{PHASE_CALIBRATIONS} calibrations over {PHASE_S / 60:g} min: median {phase['median']:.1%}; " \
            if phase else ""
        print(f"{metric}: consecutive median {s['consecutive']['median']:.1%} p90 {s['consecutive']['p90']:.1%}; "
              f"{windows}{phase_text}whole run {s['whole']:.1%}")


if __name__ == "__main__":
    args = sys.argv[1:]
    main(float(args[0]) if args else MINUTES, Path(args[1]) if len(args) > 1 else Path("."))
