"""Linear layers on the CPU: PyTorch's default (MKL), oneDNN with pre-packed weights, and the skinny kernel.

The shapes are the `100m` preset's projections (fused qkv, o, fused gate/up, down, LM head) at the
row counts an iteration feeds them: single decodes, decode batches and prefill chunks. The paths
run interleaved, repetition by repetition, in one process, so drift hits them alike; medians are
reported with the CPU model and flags. Each row also gives the achieved GFLOPS and their share of the
machine's nominal fp32 peak (`peak_gflops`: threads × 2 FMA ports × SIMD lanes × 2 FLOPs × clock),
which says how much room a faster matmul kernel could still find.

A second table (`streamed`) times decode-sized row counts the way a model runs them: each call
multiplies by `STREAM_BYTES` worth of distinct copies of the layer, so the weights come from memory
rather than from a cache that a single small layer fits in; it reports the weight bytes read per
second against the memory bandwidth (`sum()` over a tensor of the same size, measured in the same run).

    python -m chariot.bench.linear_bench --out docs/img/linear_100m.json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import torch
from torch import nn

from chariot.kernels.skinny_linear import skinny_linear
from chariot.worker.cpu_features import cpu_flags
from chariot.worker.model.cpu_linear import CpuLinear

SHAPES = {"qkv": (1536, 1024), "o": (1024, 1024), "gate_up": (5632, 1024), "down": (1024, 2816),
          "lm_head": (8192, 1024)}
ROWS = (1, 8, 32, 128, 512)
STREAMED_ROWS = (1, 2, 4, 8, 16, 32)
STREAM_BYTES = 256 * 2**20
FLAG_NAMES = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "avx512_vnni")


def _cpuinfo(field: str) -> str | None:
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return None
    return next((line.split(":", 1)[1].strip() for line in lines if line.split(":", 1)[0].strip() == field), None)


def peak_gflops(threads: int, flags: frozenset[str], mhz: float) -> float:
    """Nominal fp32 peak: two FMA ports per core, 8 lanes with AVX2 (16 with AVX-512), 2 FLOPs per FMA."""
    lanes = 16 if "avx512f" in flags else 8 if "avx2" in flags else 4
    return threads * 2 * lanes * 2 * mhz / 1e3


def cpu_record() -> dict[str, object]:
    flags = cpu_flags()
    mhz = float(_cpuinfo("cpu MHz") or 0.0)
    threads = torch.get_num_threads()
    return {"cpu": _cpuinfo("model name") or platform.processor(), "flags": [f for f in FLAG_NAMES if f in flags],
            "all_flags": sorted(flags), "threads": threads, "torch": torch.__version__, "cpu_mhz": mhz,
            "peak_gflops": peak_gflops(threads, flags, mhz)}


def save_record(out: str | Path, record: Mapping[str, object]) -> None:
    """Write a benchmark's record (machine, arguments, rows) as JSON to `out`, creating its folder."""
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(json.dumps(record, indent=1))
    print(f"wrote {out}")


def time_interleaved(fns: Sequence[Callable[[], object]], reps: int) -> list[float]:
    """Median seconds of each of `fns`, run in turn (so drifts in machine speed hit all alike).

    The turn order changes every rep (`turn_order`), so each function follows each other one about
    equally often. In a fixed order, what one function leaves behind (cache contents, freed
    memory) favours or handicaps the next: an A/A run of two identical attention kernel builds
    after the PyTorch reference timed the second at 0.85-0.99x the first's time."""
    for _ in range(3):
        for fn in fns:
            fn()
    times: list[list[float]] = [[] for _ in fns]
    for rep in range(reps):
        for i in turn_order(len(fns), rep):
            t0 = time.perf_counter()
            fns[i]()
            times[i].append(time.perf_counter() - t0)
    return [statistics.median(samples) for samples in times]


def turn_order(n: int, rep: int) -> list[int]:
    """The order of `rep`: the n rotations of 0..n-1, then the n rotations of the reverse, repeated.
    Rotations alone keep each index's cyclic predecessor; the reversed cycle gives each the other."""
    if n == 0:
        return []
    cycle = list(range(n)) if (rep // n) % 2 == 0 else list(range(n - 1, -1, -1))
    start = rep % n
    return cycle[start:] + cycle[:start]


def time_pair(a: Callable[[], object], b: Callable[[], object], reps: int) -> tuple[float, float]:
    """Median seconds of `a` and `b`, run alternately."""
    ta, tb = time_interleaved([a, b], reps)
    return ta, tb


def measure(reps: int, peak: float) -> list[dict[str, object]]:
    rows = []
    with torch.inference_mode():
        for name, (out_f, in_f) in SHAPES.items():
            linear = nn.Linear(in_f, out_f, bias=False).eval()
            packed = CpuLinear(linear, packed=True, plain=False)
            for n in ROWS:
                x = torch.randn(n, in_f)
                default, onednn = time_pair(lambda: linear(x), lambda: packed(x), reps)  # noqa: B023
                gflop = 2 * n * out_f * in_f / 1e9
                best = gflop / min(default, onednn)
                rows.append({"layer": name, "shape": [out_f, in_f], "rows": n, "default_ms": default * 1e3,
                             "packed_ms": onednn * 1e3, "speedup": default / onednn,
                             "default_gflops": gflop / default, "packed_gflops": gflop / onednn,
                             "best_share_of_peak": best / peak if peak else None})
                print(f"{name:8s} {out_f}x{in_f} rows {n:4d}: default {default * 1e3:7.2f} ms, "
                      f"packed {onednn * 1e3:7.2f} ms, {default / onednn:4.2f}x; best {best:6.1f} GFLOPS"
                      + (f" ({best / peak:4.0%} of peak)" if peak else ""), flush=True)
    return rows


def measure_streamed(reps: int) -> list[dict[str, object]]:
    """Decode row counts over weights streamed from memory: default, packed and skinny, interleaved."""
    rows: list[dict[str, object]] = []
    with torch.inference_mode():
        bandwidth = _read_bandwidth(reps)
        print(f"memory read bandwidth (sum over {STREAM_BYTES >> 20} MiB): {bandwidth / 1e9:.1f} GB/s", flush=True)
        for name, (out_f, in_f) in SHAPES.items():
            copies = max(1, STREAM_BYTES // (out_f * in_f * 4))
            linears = [nn.Linear(in_f, out_f, bias=False).eval() for _ in range(copies)]
            packed = [CpuLinear(lin, packed=True, plain=False) for lin in linears]
            weights = [lin.weight.detach() for lin in linears]
            for n in STREAMED_ROWS:
                x = torch.randn(n, in_f)
                paths: dict[str, Callable[[], object]] = {
                    "default": lambda: [lin(x) for lin in linears],  # noqa: B023
                    "packed": lambda: [p(x) for p in packed],  # noqa: B023
                    "skinny": lambda: [skinny_linear(x, w) for w in weights],  # noqa: B023
                }
                times = dict(zip(paths, time_interleaved(list(paths.values()), reps), strict=True))
                gb = copies * out_f * in_f * 4 / 1e9
                row: dict[str, object] = {"layer": name, "shape": [out_f, in_f], "rows": n, "copies": copies,
                                          "bandwidth_gbs": bandwidth / 1e9}
                for path, t in times.items():
                    row[f"{path}_ms_per_layer"] = t * 1e3 / copies
                    row[f"{path}_weight_gbs"] = gb / t
                row["skinny_vs_packed"] = times["packed"] / times["skinny"]
                rows.append(row)
                print(f"{name:8s} {out_f}x{in_f} rows {n:3d}: " + ", ".join(
                    f"{path} {gb / t:5.1f} GB/s" for path, t in times.items())
                      + f"; skinny {times['packed'] / times['skinny']:4.2f}x packed", flush=True)
    return rows


def _read_bandwidth(reps: int) -> float:
    big = torch.randn(STREAM_BYTES // 4)
    return STREAM_BYTES / time_interleaved([big.sum], reps)[0]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--out", default="bench/results/linear.json")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    machine = cpu_record()
    peak = peak_gflops(torch.get_num_threads(), cpu_flags(), float(_cpuinfo("cpu MHz") or 0.0))
    print(f"{machine['cpu']}, {machine['threads']} threads, nominal fp32 peak {peak:.0f} GFLOPS", flush=True)
    record = {"machine": machine, "rows": measure(args.reps, peak), "streamed": measure_streamed(args.reps)}
    save_record(args.out, record)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
