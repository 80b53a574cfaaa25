"""What a prompt chunk of a row count oneDNN has not seen before costs, against the same call again.

Chariot's large-row linear layers call `torch.ops.mkldnn._linear_pointwise` on weights packed once
at load. A prompt chunk's row count is the prompt's length (or the budget left after the decodes),
so under a stream of fresh prompts nearly every prefill step brings row counts the process has not
run before. If oneDNN builds (and JIT-compiles) a primitive for every new row count, that cost lands
on every such step, while a benchmark repeating a few lengths, or an offline trace whose chunks all
fill the budget, never sees it.

Per row count M (in a fresh order): the first call's time and the median of the next REPEATS calls,
over the `100m` layer shapes (qkv, o, gate_up, down), in the dtype given.

    .venv/bin/python -m chariot.bench.experiments.onednn_new_rows [DTYPE] [OUT]   # ~30 s
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

from chariot.bench.experiments.trace_side_by_side import SHAPES  # the 100m layers: qkv, o, gate_up, down

ROWS = (512, 446, 453, 221, 309, 374, 139, 356, 497, 480, 2, 17, 33)
REPEATS = 5


def main(dtype: str, out: Path) -> None:
    import torch

    from chariot.bench.linear_bench import cpu_record

    dt = getattr(torch, dtype)
    weights = [torch.ops.mkldnn._reorder_linear_weight(torch.randn(n, k, dtype=dt), None) for n, k in SHAPES]

    def one_pass(rows: int) -> float:
        inputs = [torch.randn(rows, k, dtype=dt) for _, k in SHAPES]
        t0 = time.perf_counter()
        for x, w in zip(inputs, weights, strict=True):
            torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")
        return time.perf_counter() - t0

    results = []
    for rows in ROWS:
        first = one_pass(rows)
        again = statistics.median(one_pass(rows) for _ in range(REPEATS))
        results.append({"rows": rows, "first_ms": round(1e3 * first, 2), "again_ms": round(1e3 * again, 2)})
        print(f"{rows:4d} rows: first {1e3 * first:7.2f} ms, again {1e3 * again:7.2f} ms "
              f"({first / again:.1f}x)", file=sys.stderr, flush=True)
    out.write_text(json.dumps({"machine": cpu_record(), "dtype": dtype, "shapes": SHAPES, "results": results},
                              indent=1))


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "float32",
         Path(sys.argv[2]) if len(sys.argv) > 2 else Path("onednn_new_rows.json"))
