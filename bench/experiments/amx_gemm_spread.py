"""How far one bf16 GEMM's speed moves on this machine from one process to the next.

Why: on the Xeon AMX the peer runs' rows move with the machine (their fp32 calibration moves 5–15 %
within a search), and a full bf16 iteration is mostly oneDNN's GEMM on the AMX tiles, which the fp32
calibration does not exercise. This times that GEMM alone: the `100m` model's largest layer (gate and
up projections, 1024 → 5632) at a full iteration's 512 rows, through the oneDNN call the engine makes
(`mkldnn._linear_pointwise` on a packed weight), the median of `REPS` calls in each of `PROCESSES`
fresh processes started one after the other, each with its own copy of the weight. The spread of the
medians is what a comparison of two engines made minutes apart has to clear.

    .venv/bin/python -m chariot.bench.experiments.amx_gemm_spread [PROCESSES] [OUT_DIR]   # ~1 min

Writes OUT_DIR/amx_gemm_spread.json (each process's median ms and TFLOP/s, their min / median / max,
the CPU record with its flags).
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROWS, IN_FEATURES, OUT_FEATURES = 512, 1024, 5632
REPS = 20
WARMUP = 5


def one_process() -> float:
    """Median ms of REPS oneDNN calls (bf16, packed weight) in this process."""
    import torch

    weight = torch.randn(OUT_FEATURES, IN_FEATURES).bfloat16()
    packed = torch.ops.mkldnn._reorder_linear_weight(weight, None)
    x = torch.randn(ROWS, IN_FEATURES).bfloat16()
    times = []
    for i in range(WARMUP + REPS):
        start = time.perf_counter()
        torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
        if i >= WARMUP:
            times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def main(processes: int, out_dir: Path) -> None:
    from chariot.bench.linear_bench import cpu_record, save_record

    flops = 2 * ROWS * IN_FEATURES * OUT_FEATURES
    rows = []
    for i in range(processes):
        answer = subprocess.run([sys.executable, __file__, "--one"], capture_output=True, text=True, check=True)
        ms = float(answer.stdout.strip().splitlines()[-1])
        rows.append({"process": i, "median_ms": ms, "tflops": flops / ms / 1e9})
        print(f"process {i + 1}/{processes}: {ms:.2f} ms, {rows[-1]['tflops']:.2f} TFLOP/s", flush=True)
    ms_all = [r["median_ms"] for r in rows]
    save_record(out_dir / "amx_gemm_spread.json", {
        "machine": cpu_record(), "shape": {"rows": ROWS, "in": IN_FEATURES, "out": OUT_FEATURES},
        "dtype": "bfloat16", "reps": REPS, "processes": rows,
        "median_ms": {"min": min(ms_all), "median": statistics.median(ms_all), "max": max(ms_all)},
        "max_over_min": max(ms_all) / min(ms_all)})


if __name__ == "__main__":
    if sys.argv[1:] == ["--one"]:
        print(json.dumps(one_process()))
    else:
        main(int(sys.argv[1]) if len(sys.argv) > 1 else 12, Path(sys.argv[2]) if len(sys.argv) > 2 else Path())
