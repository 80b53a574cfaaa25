"""The panel kernel's prefill order with panels handed out in units from a shared counter, against one
range of panels per thread (the kernel as of commit 0bb3c1d), oneDNN on its packed weight (the
engine's other route, `CpuLinear.packed`) and PyTorch's default `F.linear` (MKL), at the `100m`
preset's four linear shapes, quiet and beside a process that takes a core in short bursts.

On a 2-core machine the engine's two threads share the cores with the server's other processes
(router, gRPC front, the benchmark's client) and, in a VM, with the hypervisor's other guests. With
one range per thread, a thread taken off its core holds up the whole call at its end; with units,
the other thread takes the rest of the work. Pairs interleaved (alternating order); the ratios are
medians of per-pair ratios.

    .venv/bin/python -m chariot.bench.experiments.panel_contention_ab [ROWS] [PAIRS] [BUSY_MS] [IDLE_MS]
    # defaults 512 40 1 9; prints one line per condition (~1 min); run from a checkout
"""

from __future__ import annotations

import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]  # the checkout (git history and kernels/csrc)
STATIC_COMMIT = "0bb3c1d"
SHAPES = ((1024, 1536), (1024, 1024), (1024, 5632), (2816, 1024))  # (K, N): qkv, o, gate_up, down
BURSTS = ("import time\nwhile True:\n t = time.perf_counter()\n"
          " while time.perf_counter() - t < {busy}: pass\n time.sleep({idle})\n")


def static_kernel() -> Callable[..., None]:
    from chariot.kernels.cpu_build import load_ops

    source = subprocess.run(["git", "-C", str(ROOT), "show", f"{STATIC_COMMIT}:kernels/csrc/panel_linear.cpp"],
                            check=True, capture_output=True, text=True).stdout
    path = Path(tempfile.mkdtemp()) / "panel_linear_static.cpp"
    path.write_text(source)
    for header in ("vec8.h",):
        (path.parent / header).write_text((ROOT / "kernels" / "csrc" / header).read_text())
    return load_ops(path, "cpu_panel_linear", f"panel linear kernel at {STATIC_COMMIT}")("panel_linear")


def main(rows: int, pairs: int, busy_ms: float, idle_ms: float) -> None:
    from chariot.bench.linear_bench import cpu_record
    from chariot.kernels import panel_linear as pl

    kernels = {"static": static_kernel(), "units": pl.load_kernels()[1]}
    gen = torch.Generator().manual_seed(0)
    weights = [torch.randn(n, k, generator=gen) * 0.02 for k, n in SHAPES]
    packed = [pl.pack(w) for w in weights]
    reordered = [torch.ops.mkldnn._reorder_linear_weight(w, None) for w in weights]
    xs = [torch.randn(rows, k, generator=gen) for k, _ in SHAPES]
    outs = [torch.empty(rows, n) for _, n in SHAPES]
    reps = max(1, 1024 // rows)

    def run(kind: str) -> float:
        t0 = time.perf_counter()
        for _ in range(reps):
            for x, w, r, p, o in zip(xs, weights, reordered, packed, outs, strict=True):
                if kind == "onednn":
                    torch.ops.mkldnn._linear_pointwise(x, r, None, "none", [], "")
                elif kind == "mkl":
                    torch.nn.functional.linear(x, w)
                else:
                    kernels[kind](x, p.panels, p.bias, o)
        return time.perf_counter() - t0

    machine = cpu_record()
    flags = machine["flags"]
    assert isinstance(flags, list)
    print(f"{machine['cpu']}, flags {' '.join(flags)}, {torch.get_num_threads()} threads, "
          f"torch {torch.__version__}; 'onednn': packed weight (mkldnn._linear_pointwise), 'mkl': F.linear")
    kinds = ("static", "units", "onednn", "mkl")
    for kind in kinds:
        run(kind)
    for noisy in (False, True):
        bursts = subprocess.Popen([sys.executable, "-c", BURSTS.format(busy=busy_ms / 1e3, idle=idle_ms / 1e3)]) \
            if noisy else None
        time.sleep(0.1)
        times: dict[str, list[float]] = {k: [] for k in kinds}
        for i in range(pairs):
            for kind in kinds if i % 2 else reversed(kinds):
                times[kind].append(run(kind))
        if bursts is not None:
            bursts.kill()
            bursts.wait()
        ratio = {k: statistics.median(a / b for a, b in zip(times[k], times["units"], strict=True)) for k in kinds}
        label = f"bursts {busy_ms:g}/{idle_ms:g} ms" if noisy else "quiet"
        print(f"rows {rows}, {label}: " + ", ".join(f"{k}/units {ratio[k]:.3f}" for k in kinds if k != "units")
              + "; "
              "median s " + ", ".join(f"{k} {statistics.median(v):.3f}" for k, v in times.items()), flush=True)


if __name__ == "__main__":
    args = sys.argv[1:]
    main(int(args[0]) if args else 512, int(args[1]) if len(args) > 1 else 40,
         float(args[2]) if len(args) > 2 else 1.0, float(args[3]) if len(args) > 3 else 9.0)
