"""How much a system's capacity and offline throughput move with the machine's speed, fitted on the
committed peer runs; and each search's ratios with the two phases' speed difference taken out.

Why: on the shared 2-core VMs the machine runs at a different speed in each phase of a search (the
drift check flags every search on some kinds), and a capacity under a fixed TTFT SLO should move
more than the machine does: a machine s times faster serves every request s times sooner, so the
same 2 s of TTFT hold a queue s times longer in service time, on top of the s times higher service
rate. Rather than assume a rate, this fits one.

What: every `peer.json(.gz)` or `peer-summary.json` given (default: all under docs/img). For each
(file, system, variant) with two or more searches, each search's capacity (the geometric midpoint of
its bracket; a bracket without both ends is left out) and offline throughput, against the phase's
mean matmul speed (`PhaseSpeed.mean`: the uncontended calibrations), all in logs and centred on the
group's means, so a system's searches are compared only with each other (a fixed-effects fit). The
slope through the origin is the elasticity: a machine 10 % faster gives about e × 10 % more. Its
95 % interval comes from resampling the groups (bootstrap).

Then, per search of the files named with `--normalise`: the capacity ratio's range and the offline
ratio as measured, the phases' matmul speed ratio s (Chariot's / vLLM's), and the ratios divided by
s^e over the elasticity's interval: what the search would have shown with both phases at one speed,
if the fit holds. It reads a flagged search; it does not unflag it.

    .venv/bin/python -m chariot.bench.experiments.speed_elasticity [--out DIR] [--normalise FILE ...] [FILE ...]

Writes DIR/speed_elasticity.json (every point, both fits, the normalised ratios) and
speed_elasticity.png (both fits), and prints the normalised ratios as a Markdown table.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import sys
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from chariot.bench.experiments.iterations_from_traces import load
from chariot.bench.machine_speed import PhaseSpeed
from chariot.bench.peer import Bounds, format_span, ratio_range

BOOTSTRAP = 2000
INTERVAL = (0.025, 0.975)
DEFAULT_ROOT = Path("docs/img")


@dataclass(frozen=True)
class PhasePoint:
    """One system's phase in one search of one run."""

    run: str
    system: str
    variant: str
    search: int
    capacity_low: float | None
    capacity_high: float | None
    offline_tokens_per_s: float | None
    matmul_gflops: float

    @property
    def bounds(self) -> Bounds:
        """The capacity's bracket as the peer report keeps it (low 0: the floor failed; high None: no
        probe failed)."""
        return Bounds(self.capacity_low or 0.0, self.capacity_high)

    @property
    def capacity(self) -> float | None:
        """The bracket's geometric midpoint, or None when either end is missing (a bound, not a bracket)."""
        lo, hi = self.capacity_low, self.capacity_high
        return math.sqrt(lo * hi) if lo and hi and math.isfinite(hi) else None


Metric = Callable[[PhasePoint], float | None]
METRICS: dict[str, Metric] = {"capacity": lambda p: p.capacity, "offline": lambda p: p.offline_tokens_per_s}


def phase_points(doc: dict[str, Any], run: str) -> list[PhasePoint]:
    """Every phase of a peer document that has a machine record."""
    points = []
    for r in doc.get("runs", []):
        if not r.get("machine"):
            continue
        cap, offline = r["capacity"], r.get("offline") or {}
        points.append(PhasePoint(run, r["system"], r["variant"], r.get("search", 0), cap.get("low_qps"),
                                 cap.get("high_qps"), offline.get("output_tokens_per_s"),
                                 PhaseSpeed.from_json(r["machine"]).mean().matmul_gflops))
    return points


def groups_of(points: Sequence[PhasePoint]) -> list[list[PhasePoint]]:
    """Points by (run, system, variant), groups of two or more searches only."""
    by: dict[tuple[str, str, str], list[PhasePoint]] = {}
    for p in points:
        by.setdefault((p.run, p.system, p.variant), []).append(p)
    return [g for g in by.values() if len(g) >= 2]


def centred(groups: Sequence[Sequence[PhasePoint]], metric: Metric) -> list[tuple[float, float]]:
    """(log speed, log metric) of every point, each minus its group's mean; groups with fewer than two
    points that have the metric add nothing."""
    out: list[tuple[float, float]] = []
    for g in groups:
        pts = [(math.log(p.matmul_gflops), math.log(v)) for p in g if (v := metric(p))]
        if len(pts) < 2:
            continue
        mx, my = statistics.fmean(x for x, _ in pts), statistics.fmean(y for _, y in pts)
        out.extend((x - mx, y - my) for x, y in pts)
    return out


def slope(pairs: Sequence[tuple[float, float]]) -> float:
    """The least-squares slope through the origin."""
    sxx = sum(x * x for x, _ in pairs)
    if sxx == 0:
        raise ValueError("no spread in the machine's speed to fit against")
    return sum(x * y for x, y in pairs) / sxx


def bootstrap(groups: Sequence[Sequence[PhasePoint]], metric: Metric, n: int = BOOTSTRAP,
              seed: int = 0) -> tuple[float, float]:
    """The slope's interval over `n` resamplings of the groups (with replacement)."""
    rng = random.Random(seed)
    slopes = []
    for _ in range(n):
        pairs = centred([rng.choice(groups) for _ in groups], metric)
        if any(x for x, _ in pairs):
            slopes.append(slope(pairs))
    slopes.sort()
    return slopes[int(INTERVAL[0] * len(slopes))], slopes[min(int(INTERVAL[1] * len(slopes)), len(slopes) - 1)]


@dataclass(frozen=True)
class Fit:
    elasticity: float
    low: float
    high: float
    points: int
    correlation: float


def fit(groups: Sequence[Sequence[PhasePoint]], metric: Metric) -> Fit:
    pairs = centred(groups, metric)
    lo, hi = bootstrap(groups, metric)
    r = statistics.correlation([x for x, _ in pairs], [y for _, y in pairs])
    return Fit(round(slope(pairs), 3), round(lo, 3), round(hi, 3), len(pairs), round(r, 3))


def normalised(points: Sequence[PhasePoint], capacity: Fit, offline: Fit) -> list[dict[str, Any]]:
    """Per search with both systems: the ratios as measured, the speed ratio s, and the ratios over
    s^e for e across each fit's interval (the widest range those exponents give)."""
    rows = []
    for variant, search in sorted({(p.variant, p.search) for p in points}):
        by = {p.system: p for p in points if (p.variant, p.search) == (variant, search)}
        if "chariot" not in by or "vllm" not in by:
            continue
        c, v = by["chariot"], by["vllm"]
        s = c.matmul_gflops / v.matmul_gflops
        row: dict[str, Any] = {"variant": variant, "search": search + 1, "speed_ratio": round(s, 3)}
        lo, hi = ratio_range(c.bounds, v.bounds)
        if lo > 0:  # a lower end exists: both floors passed and vLLM's search found a failing probe
            row["capacity_ratio"] = _rounded(lo, hi)
            row["capacity_ratio_normalised"] = _rounded(min(lo / s**e for e in (capacity.low, capacity.high)),
                                                        max(hi / s**e for e in (capacity.low, capacity.high)))
        if c.offline_tokens_per_s and v.offline_tokens_per_s:
            ratio = c.offline_tokens_per_s / v.offline_tokens_per_s
            row["offline_ratio"] = round(ratio, 3)
            row["offline_ratio_normalised"] = _rounded(min(ratio / s**e for e in (offline.low, offline.high)),
                                                       max(ratio / s**e for e in (offline.low, offline.high)))
        rows.append(row)
    return rows


def _rounded(lo: float, hi: float) -> list[float | None]:
    """[lo, hi] to 3 decimals, an infinite end as None (the peer report's convention)."""
    return [round(lo, 3), round(hi, 3) if math.isfinite(hi) else None]


def markdown(run: str, rows: Sequence[dict[str, Any]]) -> list[str]:
    lines = [f"{run}:", "", "| search | matmul, Chariot's phase / vLLM's | capacity ratio | normalised | "
             "offline ratio | normalised |", "|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        offline = r.get("offline_ratio")
        lines.append(f"| {r['search']} | {r['speed_ratio']:.2f}× | {format_span(r.get('capacity_ratio'))} | "
                     f"{format_span(r.get('capacity_ratio_normalised'))} | "
                     f"{format_span(None if offline is None else [offline, offline])} | "
                     f"{format_span(r.get('offline_ratio_normalised'))} |")
    return [*lines, ""]


def plot(groups: Sequence[Sequence[PhasePoint]], fits: dict[str, Fit], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.5))
    for ax, (name, metric) in zip(axes, METRICS.items(), strict=True):
        for system, colour in (("chariot", "tab:blue"), ("vllm", "tab:orange")):
            pairs = centred([g for g in groups if g[0].system == system], metric)
            ax.scatter([x for x, _ in pairs], [y for _, y in pairs], s=18, color=colour, label=system, alpha=0.8)
        f = fits[name]
        xs = [x for x, _ in centred(groups, metric)]
        span = [min(xs), max(xs)]
        ax.plot(span, [f.elasticity * x for x in span], color="black",
                label=f"slope {f.elasticity:.2f} [{f.low:.2f}, {f.high:.2f}]")
        ax.plot(span, span, color="grey", linestyle=":", label="slope 1")
        ax.set_xlabel("log matmul speed of the phase, minus its system's mean over the run")
        ax.set_ylabel(f"log {name}, minus its system's mean over the run")
        ax.set_title(f"{name}: {f.points} phases, r = {f.correlation:.2f}")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def default_files(root: Path = DEFAULT_ROOT) -> list[Path]:
    return sorted([*root.rglob("peer.json.gz"), *root.rglob("peer.json"), *root.rglob("peer-summary.json")])


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("files", nargs="*", type=Path,
                   help="peer.json(.gz) / peer-summary.json files (default: all under docs/img)")
    p.add_argument("--normalise", nargs="*", type=Path, default=[], help="runs whose searches to normalise")
    p.add_argument("--out", type=Path, default=Path("."))
    args = p.parse_args(argv)
    files = args.files or default_files()
    points = [pt for f in files for pt in phase_points(load(f), str(f))]
    groups = groups_of(points)
    fits = {name: fit(groups, metric) for name, metric in METRICS.items()}
    runs = {str(f): normalised(phase_points(load(f), str(f)), fits["capacity"], fits["offline"])
            for f in args.normalise}
    args.out.mkdir(parents=True, exist_ok=True)
    doc = {"files": [str(f) for f in files], "groups": len(groups), "fits": {k: asdict(v) for k, v in fits.items()},
           "normalised": runs, "points": [asdict(pt) for pt in points]}
    (args.out / "speed_elasticity.json").write_text(json.dumps(doc, indent=1) + "\n")
    plot(groups, fits, args.out / "speed_elasticity.png")
    for name, f in fits.items():
        print(f"{name}: elasticity {f.elasticity:.2f} (95 % interval {f.low:.2f}-{f.high:.2f}), {f.points} phases "
              f"in {len(groups)} groups, r = {f.correlation:.2f}")
    for run, rows in runs.items():
        print("\n".join(markdown(run, rows)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
