"""What rounding oneDNN's row counts saves under a served stream of row counts.

`cpu_linear.ONEDNN_ROW_STEP` rounds every call of oneDNN's packed route up to a multiple of 16 rows,
so that oneDNN builds one primitive per 16 rows instead of one per row count
(`onednn_new_rows`: a new count costs several repeats in bf16). This replays the row counts of a
served Chariot iteration log (its iterations of more than 32 tokens, the ones that reach oneDNN, in
order) through one layer pass of the `100m` shapes (qkv, o, gate_up, down as `CpuLinear`s holding
only oneDNN's copy), each run in a fresh process (a new primitive cache), rounded to STEP rows and
not (step 1), the two alternating for ROUNDS rounds. The whole model repeats each layer shape eight
times per step, so the saving per step is smaller than per pass here; what it shows is how many
primitives a stream builds and what they cost.

    .venv/bin/python -m chariot.bench.experiments.onednn_row_step_ab ITERATION_LOG [DTYPE] [PASSES] [OUT]   # ~2 min
    .venv/bin/python -m chariot.bench.experiments.onednn_row_step_ab --first-seen ITERATION_LOG ...

The second form reads served logs only: per log, how many iterations above 32 tokens ran a token
count the server had not run before, and their median forward time against the repeats', by size.

ITERATION_LOG: a Chariot iteration log (`.jsonl` or `.jsonl.gz`, e.g. under
docs/img/peer-xeon-amx-bf16/iteration-logs/iterations/). Writes OUT (default
onednn_row_step_ab_<dtype>.json in the current directory).
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

SHAPES = ((1536, 1024), (1024, 1024), (5632, 1024), (1024, 2816))  # (out, in): qkv, o, gate_up, down
STEPS = (1, 16)
ROUNDS = 2


def replay(log: Path, dtype: str, passes: int, step: int) -> dict[str, float]:
    """In this process: the log's first `passes` row counts above 32, one layer pass each, rows rounded
    to `step`; seconds in all."""
    import torch
    from torch import nn

    import chariot.worker.model.cpu_linear as cpu_linear
    from chariot.bench.server_iterations import chariot_records, read_log_lines

    cpu_linear.ONEDNN_ROW_STEP = step
    dt = getattr(torch, dtype)
    rows = [int(r["tokens"]) for r in chariot_records(read_log_lines(log)) if int(r["tokens"]) > 32][:passes]
    layers = [cpu_linear.CpuLinear(nn.Linear(k, n, bias=False).to(dt), packed=True, plain=False) for n, k in SHAPES]
    inputs = {k: torch.randn(max(rows), k).to(dt) for k in {k for _, k in SHAPES}}
    t0 = time.perf_counter()
    with torch.inference_mode():
        for r in rows:
            for layer in layers:
                layer(inputs[layer.in_features][:r])
    return {"seconds": time.perf_counter() - t0, "passes": len(rows), "distinct_rows": len(set(rows)),
            "distinct_calls": len({-(-r // step) * step for r in rows})}


def first_seen(log: Path) -> dict[str, object]:
    """A served log's iterations above 32 tokens: how many ran a token count for the first time, and
    the median forward ms of first-seen against repeated counts, by iteration size."""
    from chariot.bench.server_iterations import chariot_records, read_log_lines

    seen: set[int] = set()
    first: list[dict[str, float]] = []
    again: list[dict[str, float]] = []
    for r in chariot_records(read_log_lines(log)):
        if r["tokens"] > 32:
            (again if r["tokens"] in seen else first).append(r)
            seen.add(r["tokens"])
    sizes: dict[str, object] = {}
    for low, high in ((33, 199), (200, 399), (400, 512)):
        a = [r["exec_ms"] for r in first if low <= r["tokens"] <= high]
        b = [r["exec_ms"] for r in again if low <= r["tokens"] <= high]
        if a and b:
            sizes[f"{low}-{high}"] = {"first_seen": len(a), "repeats": len(b), "first_ms": statistics.median(a),
                                      "repeat_ms": statistics.median(b),
                                      "ratio": statistics.median(a) / statistics.median(b)}
    return {"log": log.name, "iterations_above_32": len(first) + len(again), "first_seen": len(first),
            "by_tokens": sizes}


def main(log: Path, dtype: str, passes: int, out: Path) -> None:
    from chariot.bench.linear_bench import cpu_record

    runs: dict[str, list[dict[str, float]]] = {str(s): [] for s in STEPS}
    for rnd in range(ROUNDS):
        for step in STEPS if rnd % 2 == 0 else STEPS[::-1]:
            done = subprocess.run([sys.executable, "-m", "chariot.bench.experiments.onednn_row_step_ab", "--one",
                                   str(log), dtype, str(passes), str(step)], check=True, capture_output=True, text=True)
            runs[str(step)].append(json.loads(done.stdout.strip().splitlines()[-1]))
            print(f"round {rnd + 1}, rows rounded to {step}: {runs[str(step)][-1]}", flush=True)
    out.write_text(json.dumps({"machine": cpu_record(), "log": str(log), "dtype": dtype, "shapes": SHAPES,
                               "runs": runs}, indent=1))


if __name__ == "__main__":
    args = sys.argv[1:]
    if args and args[0] == "--one":
        print(json.dumps(replay(Path(args[1]), args[2], int(args[3]), int(args[4]))))
    elif args and args[0] == "--first-seen":
        print(json.dumps([first_seen(Path(a)) for a in args[1:]], indent=1))
    else:
        dtype = args[1] if len(args) > 1 else "bfloat16"
        main(Path(args[0]), dtype, int(args[2]) if len(args) > 2 else 600,
             Path(args[3]) if len(args) > 3 else Path(f"onednn_row_step_ab_{dtype}.json"))
