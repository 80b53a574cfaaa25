"""Plot DIR/decode_splits_h100_before.json (from `gpu_decode_splits`): GPU time of each forced split
count per decode shape, with SDPA and the automatic choices before and after the retuning marked
(DIR/decode_splits_h100_after.json), into DIR/decode_splits_h100.png.

    .venv/bin/python -m chariot.bench.experiments.gpu_plot_decode_splits docs/img/gpu-h100
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def main(here: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    before = json.loads((here / "decode_splits_h100_before.json").read_text())["rows"]
    after = json.loads((here / "decode_splits_h100_after.json").read_text())["rows"]
    shapes = sorted({(r["b"], r["ctx"]) for r in before})
    fig, axes = plt.subplots(2, 3, figsize=(11, 6), sharex=True)
    for ax, (batch, ctx) in zip(axes.flat, shapes, strict=True):
        rows = [r for r in before if (r["b"], r["ctx"]) == (batch, ctx)]
        tri = [r for r in rows if r["method"].startswith("triton")]
        splits = [int(r["method"].split("=")[1].split()[0]) for r in tri]
        ax.plot(splits, [1e3 * r["graph_ms"] for r in tri], "o-", label="Triton, forced splits")
        sdpa = next(r for r in rows if r["method"] == "sdpa")
        ax.axhline(1e3 * sdpa["graph_ms"], color="grey", ls="--", label="flash SDPA (contiguous K/V)")
        old = next(r for r in tri if "auto" in r["method"])
        new = next(r for r in after if (r["b"], r["ctx"]) == (batch, ctx) and "auto" in r["method"])
        ax.plot(int(old["method"].split("=")[1].split()[0]), 1e3 * old["graph_ms"], "s", ms=10, mfc="none",
                color="tab:red", label="auto, old rule")
        ax.plot(int(new["method"].split("=")[1].split()[0]), 1e3 * new["graph_ms"], "^", ms=10, mfc="none",
                color="tab:green", label="auto, new rule (its own run)")
        ax.set_xscale("log", base=2)
        ax.set_title(f"batch {batch}, context {ctx}")
        ax.set_ylabel("GPU µs per call")
    axes.flat[0].legend(fontsize=7)
    for ax in axes[1]:
        ax.set_xlabel("KV splits")
    fig.suptitle("Split-KV decode on an H100 (Llama-3-8B heads, bf16; CUDA-graph replay)")
    fig.tight_layout()
    fig.savefig(here / "decode_splits_h100.png", dpi=110)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
