"""Both peers' full-budget iterations against the wall clock of one `chariot bench peer` run.

Why: under a prompt queue both systems run iterations that fill the token budget, and how long one
takes sets the rate prompts are prefilled at, so the capacity under a median-TTFT SLO. On a shared
VM that time moves with the machine; with the two systems' probes taking turns, plotting each
full iteration's forward time at the moment it ran shows whether one system's are slower than the
other's at the same moment, or whether both follow the machine. It reads both servers' per-iteration
logs whole (`bench/server_iterations.py`): Chariot's `--iteration-log` file(s) and vLLM's log with
`--enable-logging-iteration-details` (its lines carry the time to the second, in the machine's
local time, the year taken from Chariot's log); either may be gzipped.

    .venv/bin/python -m chariot.bench.experiments.full_iteration_timeline OUT_DIR VLLM_LOG ITERATION_LOG...

Writes OUT_DIR/full_iteration_timeline.json (per minute and system: full iterations and their median
forward time; the ratio of the two systems' medians over the minutes both ran some) and
full_iteration_timeline.png.
"""

from __future__ import annotations

import json
import re
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path

from chariot.bench.server_iterations import VLLM_ITERATION_LINE, chariot_records, read_log_lines

BUDGET_SHARE = 0.98  # an iteration at ≥ 98 % of the largest seen counts as full (the budget, less rounding)
VLLM_TIME = re.compile(r"INFO (\d\d)-(\d\d) (\d\d):(\d\d):(\d\d)")


def chariot_full(paths: Sequence[Path]) -> list[tuple[float, float, int]]:
    """(time, forward ms, tokens) of every Chariot iteration."""
    out = []
    for path in paths:
        out += [(float(r["t"]), float(r["exec_ms"]), int(r["tokens"])) for r in chariot_records(read_log_lines(path))]
    return out


def vllm_full(path: Path, year: int) -> list[tuple[float, float, int]]:
    """(time, forward ms, tokens) of every vLLM iteration (to the second; dummy ones left out)."""
    out = []
    for line in read_log_lines(path):
        found, stamp = VLLM_ITERATION_LINE.search(line), VLLM_TIME.search(line)
        if found is None or stamp is None or found["dummy"]:
            continue
        mo, d, h, mi, s = (int(x) for x in stamp.groups())
        t = time.mktime((year, mo, d, h, mi, s, 0, 0, -1))
        out.append((t, float(found["ms"]), int(found["ctx_tokens"]) + int(found["gen_tokens"])))
    return out


def full_only(its: Sequence[tuple[float, float, int]], budget: int) -> list[tuple[float, float]]:
    return [(t, ms) for t, ms, tokens in its if tokens >= BUDGET_SHARE * budget]


def per_minute(full: dict[str, list[tuple[float, float]]]) -> dict[str, dict[int, dict[str, float]]]:
    """Per system and minute (epoch // 60): full iterations and their median forward ms."""
    out: dict[str, dict[int, dict[str, float]]] = {}
    for system, pts in full.items():
        groups: dict[int, list[float]] = defaultdict(list)
        for t, ms in pts:
            groups[int(t // 60)].append(ms)
        out[system] = {m: {"n": len(v), "median_ms": statistics.median(v)} for m, v in sorted(groups.items())}
    return out


def plot(full: dict[str, list[tuple[float, float]]], out: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t0 = min(t for pts in full.values() for t, _ in pts)
    fig, ax = plt.subplots(figsize=(11, 4.5))
    for system, colour in (("chariot", "tab:blue"), ("vllm", "tab:orange")):
        pts = full.get(system, [])
        ax.scatter([(t - t0) / 60 for t, _ in pts], [ms for _, ms in pts], s=6, alpha=0.5, c=colour,
                   label=f"{system} ({len(pts)} full iterations)")
    ax.set_xlabel("minutes into the run")
    ax.set_ylabel("forward pass of a full-budget iteration (ms)")
    ax.set_title("full-budget iterations over the run, from both servers' per-iteration logs")
    ax.legend()
    fig.tight_layout()
    path = out / "full_iteration_timeline.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv: Sequence[str]) -> int:
    if len(argv) < 3:
        print(__doc__)
        return 2
    out, vllm_log, chariot_logs = Path(argv[0]), Path(argv[1]), [Path(p) for p in argv[2:]]
    out.mkdir(parents=True, exist_ok=True)
    ours = chariot_full(chariot_logs)
    theirs = vllm_full(vllm_log, time.localtime(ours[0][0]).tm_year if ours else time.localtime().tm_year)
    budget = max(tokens for _, _, tokens in [*ours, *theirs])
    full = {"chariot": full_only(ours, budget), "vllm": full_only(theirs, budget)}
    minutes = per_minute(full)
    shared = sorted(set(minutes["chariot"]) & set(minutes["vllm"]))
    ratios = [minutes["vllm"][m]["median_ms"] / minutes["chariot"][m]["median_ms"] for m in shared]
    doc = {"sources": [vllm_log.name, *(p.name for p in chariot_logs)], "budget": budget,
           "full_iterations": {s: len(p) for s, p in full.items()},
           "median_forward_ms": {s: statistics.median(ms for _, ms in p) if p else None for s, p in full.items()},
           "minutes_both_ran": len(shared),
           "vllm_over_chariot_by_minute": {"median": statistics.median(ratios) if ratios else None,
                                           "min": min(ratios, default=None), "max": max(ratios, default=None)},
           "per_minute": {s: {str(m): v for m, v in ms.items()} for s, ms in minutes.items()}}
    (out / "full_iteration_timeline.json").write_text(json.dumps(doc, indent=1) + "\n")
    print(json.dumps({k: v for k, v in doc.items() if k != "per_minute"}, indent=1))
    print(plot(full, out))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
