"""Files one `chariot bench peer` run where the docs can cite it, with the server-side analyses.

Why: BENCHMARKS commits the raw data of every table, and a peer run leaves it uncompressed under its
`--out` folder (`peer.json`, `vllm.log`, Chariot's `iterations/*.jsonl`, the TBT plots), while the
analyses its sections quote (`iteration_mix`, `iteration_cost`, `onednn_row_step_ab --first-seen`,
`full_iteration_timeline`, the full iterations' medians) were run one by one on the copies. This does
all of it in one order: copy and gzip the raw files into DEST, run the four analyses on the copies (so
what the docs cite is what is committed), write the full iterations' medians and print one markdown
row per search. The pooled medians compare the systems only where both ran their full iterations on
the same stretches of the machine's speed; `full_iteration_timeline`'s per-minute ratio compares
them minute by minute, which holds when the two ran their high-load probes at different minutes.

    .venv/bin/python -m chariot.bench.experiments.peer_archive RUN_DIR DEST [RUN_LOG]

RUN_LOG (optional): the run's console output, filed as `run.log` (it holds the workers' start-up
routing lines). Writes into DEST: the `*.png` files, `peer.json.gz`, `vllm.log.gz`,
`iterations/*.jsonl.gz`, `run.log`, `iteration_mix.{json,png}`, `iteration_cost.{json,png}`,
`full_iteration_timeline.{json,png}`, `first_seen.json` and `full_iterations.json`.
"""

from __future__ import annotations

import gzip
import json
import shutil
import statistics
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from chariot.bench.experiments import full_iteration_timeline, iteration_cost, iteration_mix, onednn_row_step_ab
from chariot.bench.peer import Bounds, format_capacity, format_span

FULL_SHARE = 500 / 512  # an iteration is full from this share of the token budget on (500 of 512)


def gzip_copy(src: Path, dest: Path) -> Path:
    """`src` gzipped to `dest` with no timestamp in the header, so that filing it twice gives the same bytes."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    with src.open("rb") as f, dest.open("wb") as raw, gzip.GzipFile(fileobj=raw, mode="wb", mtime=0) as out:
        shutil.copyfileobj(f, out)
    return dest


def file_raw(run: Path, dest: Path, run_log: Path | None) -> list[Path]:
    """Copies the run's raw files into `dest` (gzipping the large ones); returns Chariot's iteration logs."""
    for missing in [n for n in ("peer.json", "vllm.log") if not (run / n).is_file()]:
        raise SystemExit(f"{run / missing} not found: RUN_DIR must be a finished `chariot bench peer --out` folder")
    dest.mkdir(parents=True, exist_ok=True)
    for png in sorted(run.glob("*.png")):
        shutil.copy2(png, dest / png.name)
    gzip_copy(run / "peer.json", dest / "peer.json.gz")
    gzip_copy(run / "vllm.log", dest / "vllm.log.gz")
    logs = [gzip_copy(p, dest / "iterations" / f"{p.name}.gz") for p in sorted(run.glob("iterations/*.jsonl"))]
    if run_log is not None:
        lines = run_log.read_text(errors="replace").splitlines(keepends=True)
        (dest / "run.log").write_text("".join(line for line in lines if not line.startswith("rc=")))
    return logs


def full_iterations(records: Mapping[str, Sequence[Mapping[str, Any]]], token_budget: int) -> dict[str, Any]:
    """Per system, the iterations that filled the budget (at least FULL_SHARE of it): how many, their
    median forward ms, prompt tokens and decodes; and Chariot's median over vLLM's."""
    least = round(token_budget * FULL_SHARE)
    doc: dict[str, Any] = {"min_tokens": least}
    for system, rows in records.items():
        full = [r for r in rows if r["tokens"] >= least]
        doc[system] = {"iterations": len(full),
                       "median_forward_ms": statistics.median(r["forward_ms"] for r in full) if full else None,
                       "median_prefill": statistics.median(r["prefill"] for r in full) if full else None,
                       "median_decodes": statistics.median(r["decodes"] for r in full) if full else None}
    mine, peer = doc.get("chariot", {}).get("median_forward_ms"), doc.get("vllm", {}).get("median_forward_ms")
    doc["chariot_over_vllm"] = mine / peer if mine and peer else None
    return doc


def search_rows(summary: Sequence[Mapping[str, Any]]) -> list[str]:
    """One markdown row per search of the peer summary: capacities, ratio range, offline medians and
    rounds, one request's TBT, probes, the machine's lean and drift (and whether the run flagged it)."""
    rows = []
    for variant in summary:
        for s in variant["searches"]:
            c, v, m = s["systems"]["chariot"], s["systems"]["vllm"], s["machine"]
            mine, peer = (format_capacity(Bounds(*x["capacity_bounds"])) for x in (c, v))
            rounds = "; ".join(", ".join(f"{r['output_tokens_per_s']:.1f}" for r in x["offline"]["rounds"])
                               for x in (c, v))
            drift = f"{m['drift'] * 100:.1f} %" + (" **flagged**" if s["flagged"] else "")
            rows.append(
                f"| {s['search'] + 1} ({s['order'][0]}) | {mine} / {peer} | {format_span(s['capacity_ratio_range'])} | "
                f"{c['offline']['output_tokens_per_s']:.1f} / {v['offline']['output_tokens_per_s']:.1f} | "
                f"{s['offline_throughput_ratio']:.2f}× | {rounds} | {c['single']['tbt_p50_ms']:.1f} / "
                f"{v['single']['tbt_p50_ms']:.1f} ms | {c['probes']} / {v['probes']} | "
                f"{m['median_ratio']['matmul']:.2f}× ({m['speed_ratio']['matmul']:.2f}×) | {drift} |")
    return rows


def main(argv: Sequence[str]) -> int:
    if len(argv) not in (2, 3):
        print(__doc__)
        return 2
    run, dest = Path(argv[0]), Path(argv[1])
    logs = file_raw(run, dest, Path(argv[2]) if len(argv) == 3 else None)
    peer = json.loads(gzip.decompress((dest / "peer.json.gz").read_bytes()))
    iteration_mix.main([str(dest / "peer.json.gz"), str(dest)])
    records = iteration_cost.load(dest / "vllm.log.gz", logs)
    iteration_cost.write_report(dest, [dest / "vllm.log.gz", *logs], records)
    seen = [onednn_row_step_ab.first_seen(p) for p in logs]
    (dest / "first_seen.json").write_text(json.dumps(seen, indent=1) + "\n")
    full_iteration_timeline.main([str(dest), str(dest / "vllm.log.gz"), *map(str, logs)])
    full = full_iterations(records, int(peer["setup"]["token_budget"]))
    (dest / "full_iterations.json").write_text(json.dumps(full, indent=1) + "\n")
    print(json.dumps(full))
    print("\n".join(search_rows(peer["summary"])))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
