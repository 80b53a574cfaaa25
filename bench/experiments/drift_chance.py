"""How often the peer benchmark's drift check would flag a search on the machine's noise alone, over
every committed run whose probes took turns.

Why: with `--order probe` a search is flagged when the medians of the two systems' calibrations
differ by more than `DRIFT_TOLERANCE` (5 %). On a VM whose calibrations spread 50-100 % within a
search, the median of ten of them moves by about that much by chance, so a flag may report the
instrument's sampling rather than a machine that favoured one system. This re-reads each search's
own calibrations and asks, for random splits of them between the two systems (each keeping its
count; `machine_speed.drift_chance`), how often the drift passes the tolerance and how often it is
at least the one measured. It informs the reading of a verdict; it changes none.

    .venv/bin/python -m chariot.bench.experiments.drift_chance [--out DIR] [FILE ...]

FILE: peer.json(.gz) / peer-summary.json (default: every one under docs/img). Writes
DIR/drift_chance.json (one row per search) and drift_chance.png, and prints a Markdown table.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from chariot.bench.experiments.iterations_from_traces import load
from chariot.bench.experiments.speed_elasticity import default_files
from chariot.bench.machine_speed import DRIFT_TOLERANCE, PhaseSpeed, drift_chance, interleaved_drift


@dataclass(frozen=True)
class SearchChance:
    """One interleaved search of one run: the drift measured, whether the check flagged it, and what
    random splits of the same calibrations give (`DriftChance`)."""

    run: str
    variant: str
    search: int
    cpu: str
    calibrations: tuple[int, int]  # Chariot's, vLLM's leading ones
    drift: float
    flagged: bool
    beyond_tolerance: float
    at_least_observed: float


def searches_of(doc: dict[str, Any], run: str) -> list[SearchChance]:
    """Every search of a peer document whose two systems' probes took turns and have calibrations."""
    by: dict[tuple[str, int], dict[str, dict[str, Any]]] = {}
    for r in doc.get("runs", []):
        if r.get("interleaved") and r.get("machine"):
            by.setdefault((r["variant"], r.get("search", 0)), {})[r["system"]] = r
    cpu = " ".join(_cpu_kind(doc.get("setup", {})))
    out = []
    for (variant, search), systems in sorted(by.items()):
        if {"chariot", "vllm"} - systems.keys():
            continue
        c, v = (PhaseSpeed.from_json(systems[s]["machine"]) for s in ("chariot", "vllm"))
        d, chance = interleaved_drift(c, v), drift_chance(c, v)
        out.append(SearchChance(run, variant, search, cpu, (len(c.leading), len(v.leading)), round(d, 4),
                                d > DRIFT_TOLERANCE, chance.beyond_tolerance, chance.at_least_observed))
    return out


def _cpu_kind(setup: dict[str, Any]) -> tuple[str, ...]:
    """The CPU model and the ISA flags that tell this project's machine kinds apart."""
    flags = set(setup.get("cpu_flags", ()))
    isa = [f for f in ("avx512f", "avx512_bf16", "amx_tile") if f in flags] or (["avx2"] if "avx2" in flags else [])
    return (setup.get("cpu_model", "?"), f"({', '.join(isa)})")


def markdown(rows: Sequence[SearchChance]) -> list[str]:
    lines = ["| run | search | CPU | calibrations (Chariot, vLLM) | drift | verdict | random splits past 5 % | "
             "as far as measured |", "|---|---:|---|---|---:|---|---:|---:|"]
    for r in rows:
        lines.append(f"| {r.run} | {r.search + 1} | {r.cpu} | {r.calibrations[0]}, {r.calibrations[1]} | "
                     f"{r.drift:.1%} | {'flagged' if r.flagged else 'trusted'} | {r.beyond_tolerance:.0%} | "
                     f"{r.at_least_observed:.0%} |")
    return lines


def plot(rows: Sequence[SearchChance], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for flagged, colour in ((False, "tab:green"), (True, "tab:red")):
        chosen = [r for r in rows if r.flagged == flagged]
        ax.scatter([r.beyond_tolerance for r in chosen], [r.at_least_observed for r in chosen], color=colour,
                   label="flagged" if flagged else "trusted", s=24, alpha=0.8)
    ax.axhline(0.05, color="grey", linestyle=":", label="p = 0.05")
    ax.set_xlabel("share of random splits of the search's calibrations that drift past 5 %")
    ax.set_ylabel("share that drift at least as far as measured (p)")
    ax.set_title(f"drift check on the machine's noise: {len(rows)} interleaved searches")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("files", nargs="*", type=Path,
                   help="peer.json(.gz) / peer-summary.json files (default: all under docs/img)")
    p.add_argument("--out", type=Path, default=Path("."))
    args = p.parse_args(argv)
    rows = [row for f in (args.files or default_files()) for row in searches_of(load(f), str(f.parent))]
    if not rows:
        print("no interleaved search with calibrations in the files given", file=sys.stderr)
        return 1
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "drift_chance.json").write_text(json.dumps([asdict(r) for r in rows], indent=1) + "\n")
    plot(rows, args.out / "drift_chance.png")
    print("\n".join(markdown(rows)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
