"""Plots of capacity runs, in the paper's terms (Sarathi-Serve Figures 10 and 1a).

- `plot_capacity`: capacity per policy under each TBT SLO as grouped bars (Figure 10: one group per
  SLO, one bar per scheduler), so the policies compare at a glance.
- `plot_tbt_cdf`: the distribution of time between tokens per policy at one common load — the tail
  is what the P99 SLO judges, and the CDF shows how far past the SLO each policy's tail reaches.
- `plot_token_timelines`: one row per request, a dot per token on the client's clock (Figure 1a).
  Generation stalls, a decode paused while another request's prefill runs, are the visible gaps;
  gaps longer than the SLO are drawn in red.

Only matplotlib's object-oriented API with the Agg canvas is used (no pyplot state, no display).
`python -m chariot.bench.plots RESULTS --qps X` redraws the CDF and timelines of a finished
`chariot bench capacity` run at another load it probed (the run picks the highest common load, which
may be one where the other policies' probes stopped early).
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from chariot.bench.capacity import RequestTrace

DPI = 120


def _save(fig: Figure, path: str | Path) -> Path:
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    FigureCanvasAgg(fig)
    fig.savefig(out, dpi=DPI)
    return out


def slo_label(slo_ms: float) -> str:
    return f"P99 TBT ≤ {slo_ms / 1000:g} s" if slo_ms >= 1000 else f"P99 TBT ≤ {slo_ms:g} ms"


def plot_capacity(capacity: Mapping[str, Mapping[float, float]], path: str | Path, title: str = "") -> Path:
    """Grouped bars: `capacity[policy][slo_ms]` = QPS; one group per SLO, one bar per policy."""
    policies = list(capacity)
    slos = sorted({slo for per_slo in capacity.values() for slo in per_slo})
    fig = Figure(figsize=(max(5.0, 1.6 + 0.9 * len(policies) * len(slos)), 3.8))
    ax = fig.add_subplot()
    width = 0.8 / max(1, len(policies))
    for i, policy in enumerate(policies):
        xs = [j + (i - (len(policies) - 1) / 2) * width for j in range(len(slos))]
        values = [capacity[policy].get(slo, 0.0) for slo in slos]
        bars = ax.bar(xs, values, width, label=policy)
        ax.bar_label(bars, labels=[f"{v:.2f}" for v in values], fontsize=8, padding=2)
    ax.set_xticks(range(len(slos)), [slo_label(s) for s in slos])
    ax.set_ylabel("capacity (queries/s)")
    ax.set_title(title or "Capacity under TBT SLO")
    ax.margins(y=0.15)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return _save(fig, path)


def tbt_values(traces: Sequence[RequestTrace]) -> list[float]:
    """Every time-between-tokens gap of the successful requests (seconds)."""
    return [gap for t in traces if t.ok for gap in t.tbt]


def plot_tbt_cdf(traces: Mapping[str, Sequence[RequestTrace]], path: str | Path, qps: float | None = None,
                 slos_ms: Sequence[float] = ()) -> Path:
    """CDF of TBT (ms, log scale) per policy, with the SLOs as vertical lines."""
    fig = Figure(figsize=(6.0, 4.0))
    ax = fig.add_subplot()
    for policy, runs in traces.items():
        gaps = sorted(max(g * 1e3, 1e-2) for g in tbt_values(runs))
        if gaps:
            ax.plot(gaps, [(i + 1) / len(gaps) for i in range(len(gaps))], label=policy)
    for slo in slos_ms:
        ax.axvline(slo, color="grey", linestyle="--", linewidth=1)
        ax.annotate(slo_label(slo), (slo, 0.02), rotation=90, fontsize=7, color="grey", ha="right")
    ax.axhline(0.99, color="grey", linestyle=":", linewidth=1)
    ax.set_xscale("log")
    ax.set_xlabel("time between tokens (ms)")
    ax.set_ylabel("fraction of gaps")
    ax.set_title("TBT CDF" + (f" at {qps:.2f} QPS" if qps is not None else ""))
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    return _save(fig, path)


def plot_token_timelines(traces: Mapping[str, Sequence[RequestTrace]], path: str | Path, *,
                         max_requests: int = 12, stall_s: float | None = None, qps: float | None = None) -> Path:
    """One panel per policy; in it one row per request (the first `max_requests`), a dot per token.

    A thin line runs from the request's arrival to its first token (queueing + prefill); gaps longer
    than `stall_s` are drawn in red (generation stalls)."""
    panels = list(traces.items()) or [("no data", [])]
    fig = Figure(figsize=(9.0, 1.0 + 0.28 * max_requests * len(panels)))
    axes = fig.subplots(len(panels), 1, squeeze=False, sharex=True)[:, 0]
    for ax, (policy, runs) in zip(axes, panels, strict=True):
        _timeline_panel(ax, list(runs)[:max_requests], stall_s)
        ax.set_title(policy + (f" at {qps:.2f} QPS" if qps is not None else ""), fontsize=9, loc="left")
    axes[-1].set_xlabel("time since the run started (s)")
    fig.tight_layout()
    return _save(fig, path)


def _timeline_panel(ax: Axes, runs: Sequence[RequestTrace], stall_s: float | None) -> None:
    for row, trace in enumerate(runs):
        times = trace.token_times
        end = times[0] if times else trace.arrival
        ax.plot([trace.arrival, end], [row, row], color="lightgrey", linewidth=1, zorder=1)
        if trace.scheduled is not None:
            ax.plot([trace.scheduled], [row], marker="|", color="grey", markersize=6, zorder=2)
        ax.scatter(times, [row] * len(times), s=4, color="tab:blue", zorder=3, linewidths=0)
        if stall_s is not None:
            for a, b in itertools.pairwise(times):
                if b - a > stall_s:
                    ax.plot([a, b], [row, row], color="tab:red", linewidth=2, zorder=2)
    ax.set_ylim(max(1, len(runs)) - 0.5, -0.5)
    ax.set_yticks(range(len(runs)), [f"req {i}" for i in range(len(runs))], fontsize=6)
    ax.grid(axis="x", linewidth=0.3)


# --- redrawing a finished run -----------------------------------------------------------------------
def load_traces(results: str | Path, qps: float) -> dict[str, list[RequestTrace]]:
    """Every policy's request timelines at `qps` from a results folder's traces.json (policies that
    never probed that load are left out)."""
    raw = json.loads((Path(results) / "traces.json").read_text())
    key = f"{qps:g}"
    return {policy: [RequestTrace.from_json(r) for r in runs[key]] for policy, runs in raw.items() if key in runs}


def replot(results: str | Path, qps: float) -> list[Path]:
    """tbt_cdf-<qps>.png and timelines-<qps>.png of a finished run, at one of its probed loads."""
    results = Path(results)
    traces = load_traces(results, qps)
    if not traces:
        raise ValueError(f"qps: no policy in {results / 'traces.json'} was probed at {qps:g} QPS")
    slos = json.loads((results / "capacity.json").read_text())["setup"]["tbt_slo_ms"]
    return [plot_tbt_cdf(traces, results / f"tbt_cdf-{qps:g}.png", qps, slos),
            plot_token_timelines(traces, results / f"timelines-{qps:g}.png", stall_s=min(slos) / 1e3, qps=qps)]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m chariot.bench.plots", description=__doc__.splitlines()[0])
    p.add_argument("results", help="folder written by `chariot bench capacity`")
    p.add_argument("--qps", type=float, required=True, help="a load the run probed")
    args = p.parse_args(argv)
    try:
        written = replot(args.results, args.qps)
    except (OSError, ValueError, KeyError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print("wrote " + ", ".join(str(w) for w in written))
    return 0


if __name__ == "__main__":
    sys.exit(main())
