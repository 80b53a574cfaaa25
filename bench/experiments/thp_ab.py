"""torch's CPU tensors on transparent huge pages (`THP_MEM_ALLOC_ENABLE=1`) against 4 KiB pages,
in processes taking turns: oneDNN's GEMMs at a full iteration's rows, then the engine's offline trace.

Why: a full iteration, the step that sets the capacity under the peer benchmark's SLO, is mostly
oneDNN's GEMM on packed weights, and on the Xeon AMX that GEMM's speed moved 2.5x from one fresh
process to the next (`amx_gemm_spread`). Where the kernel's `transparent_hugepage` setting is
`madvise` (the VMs this project runs on), a tensor gets huge pages only when its allocator asks;
torch's CPU allocator asks (2 MiB-aligned, `madvise(MADV_HUGEPAGE)`) for tensors of 2 MiB and more
when `THP_MEM_ALLOC_ENABLE=1` is in its environment at start-up. A packed weight streamed through on
4 KiB pages costs a TLB walk every 4 KiB.

- `gemm`: PAIRS pairs of fresh processes, one with the variable set and one without, which goes
  first alternating. Each packs the `100m` model's linear layers (8 layers of qkv, o, gate-up and
  down projections, each its own weight) for oneDNN in DTYPE and times passes over all of them at
  512 rows: the median of REPS passes, and the process's `AnonHugePages` (its huge pages in use).
- `engine`: two of `malloc_ab`'s engine processes (Chariot's `LLM`, token budget 512) on the peer
  benchmark's offline trace (64 chat requests ×0.25 at t=0, fresh prompts per round), one with the
  variable set, rounds alternating which goes first; wall time per round and each process's
  `AnonHugePages` after its rounds.

    .venv/bin/python -m chariot.bench.experiments.thp_ab gemm [PAIRS] [DTYPE] [OUT_DIR]     # ~2 min
    .venv/bin/python -m chariot.bench.experiments.thp_ab engine [ROUNDS] [DTYPE] [OUT_DIR]  # ~8 min

Run from the repository root (`engine` loads `models/100m`). Writes OUT_DIR/thp_ab_<part>_<dtype>.json
(each process's or round's numbers, the medians, the paired ratios, the CPU record with its flags).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

THP_ENV = "THP_MEM_ALLOC_ENABLE"
ROWS = 512
LAYERS = 8
SHAPES = ((1024, 1536), (1024, 1024), (1024, 5632), (2816, 1024))  # (in, out): qkv, o, gate-up, down
REPS = 15
WARMUP = 3


def gemm_process(dtype_name: str) -> dict[str, float]:
    """Median ms of REPS passes over the model's packed layers at ROWS rows, in this process."""
    import torch

    dtype = getattr(torch, dtype_name)
    inputs = {inp: torch.randn(ROWS, inp).to(dtype) for inp, _ in SHAPES}
    layers = [(inputs[inp], torch.ops.mkldnn._reorder_linear_weight(torch.randn(out, inp).to(dtype), None))
              for _ in range(LAYERS) for inp, out in SHAPES]
    times = []
    with torch.inference_mode():
        for i in range(WARMUP + REPS):
            start = time.perf_counter()
            for x, weight in layers:
                torch.ops.mkldnn._linear_pointwise(x, weight, None, "none", [], "")
            if i >= WARMUP:
                times.append((time.perf_counter() - start) * 1e3)
    from chariot.bench.experiments.malloc_ab import huge_pages_kib

    return {"median_ms": statistics.median(times), "huge_pages_kib": huge_pages_kib()}


def with_thp(on: bool) -> dict[str, str]:
    env = dict(os.environ)
    env.pop(THP_ENV, None)
    return {**env, THP_ENV: "1"} if on else env


def gemm(pairs: int, dtype: str, out_dir: Path) -> dict[str, Any]:
    flops = 2 * ROWS * LAYERS * sum(inp * out for inp, out in SHAPES)
    rows: list[dict[str, Any]] = []
    for pair in range(pairs):
        order = (False, True) if pair % 2 == 0 else (True, False)
        for on in order:
            answer = subprocess.run([sys.executable, __file__, "gemm-process", dtype], capture_output=True,
                                    text=True, check=True, env=with_thp(on))
            row = {"pair": pair, "thp": on, **json.loads(answer.stdout.strip().splitlines()[-1])}
            row["tflops"] = flops / row["median_ms"] / 1e9
            rows.append(row)
            print(f"pair {pair + 1}/{pairs} thp={'on' if on else 'off'}: {row['median_ms']:.1f} ms, "
                  f"{row['tflops']:.2f} TFLOP/s, {row['huge_pages_kib'] >> 10} MiB on huge pages", flush=True)
    return summarise_pairs(rows, "median_ms", {"part": "gemm", "dtype": dtype, "rows": ROWS, "layers": LAYERS,
                                                "shapes": SHAPES, "reps": REPS, "processes": rows}, out_dir)


def summarise_pairs(rows: list[dict[str, Any]], key: str, record: dict[str, Any], out_dir: Path) -> dict[str, Any]:
    """Medians of `key` with THP on and off, and the pair-by-pair ratio off / on (> 1: huge pages faster)."""
    from chariot.bench.linear_bench import cpu_record, save_record

    on = [r[key] for r in rows if r["thp"]]
    off = [r[key] for r in rows if not r["thp"]]
    ratios = [b / a for a, b in zip(on, off, strict=True)]
    summary = {"median_on": statistics.median(on), "median_off": statistics.median(off),
               "off_over_on_by_pair": ratios, "off_over_on_median": statistics.median(ratios),
               "pairs_faster_with_thp": sum(r > 1 for r in ratios), "pairs": len(ratios)}
    print(json.dumps(summary, indent=1), flush=True)
    save_record(out_dir / f"thp_ab_{record['part']}_{record['dtype']}.json",
                {"machine": cpu_record(), **record, "summary": summary,
                 "thp_setting": Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text().strip()})
    return summary


def engine(rounds: int, dtype: str, out_dir: Path) -> dict[str, Any]:
    from chariot.bench.experiments import malloc_ab

    procs = malloc_ab.start_servers(dtype, {on: with_thp(on) for on in (False, True)})
    rows: list[dict[str, Any]] = []
    try:
        for rnd in range(rounds):
            for on in ((False, True) if rnd % 2 == 0 else (True, False)):
                row = {"round": rnd, "thp": on, **malloc_ab.ask(procs[on], {"seed": f"thp-ab:{rnd}"})}
                rows.append(row)
                print(f"round {rnd + 1}/{rounds} thp={'on' if on else 'off'}: {row['wall_s']:.1f} s, "
                      f"{row['huge_pages_kib'] >> 10} MiB on huge pages", flush=True)
    finally:
        for p in procs.values():
            p.kill()
    rows.sort(key=lambda r: (r["round"], r["thp"]))
    return summarise_pairs(rows, "wall_s", {"part": "engine", "dtype": dtype, "rounds": rows}, out_dir)


def main(argv: list[str]) -> None:
    part = argv[0] if argv else "gemm"
    if part == "gemm-process":
        print(json.dumps(gemm_process(argv[1])))
        return
    if part not in ("gemm", "engine"):
        raise SystemExit(f"part must be gemm or engine, got {part!r}")
    count = int(argv[1]) if len(argv) > 1 else (6 if part == "gemm" else 4)
    dtype = argv[2] if len(argv) > 2 else "bfloat16"
    out_dir = Path(argv[3]) if len(argv) > 3 else Path()
    out_dir.mkdir(parents=True, exist_ok=True)
    (gemm if part == "gemm" else engine)(count, dtype, out_dir)


if __name__ == "__main__":
    main(sys.argv[1:])
