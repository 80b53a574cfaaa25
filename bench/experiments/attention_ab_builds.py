"""Two builds of the CPU attention kernel timed against each other, and nothing else in the loop.

`cpu_attention_bench --baseline-source` times the PyTorch reference in the same loop; what the
reference leaves behind (evicted caches, freed memory) skewed an A/A run of two identical builds by
up to 15 % (docs/kernels.md). Here the current build runs as A, B, A in turn over the benchmark's
shapes (`turn_order` varies the order every rep), so "A again / A" shows the noise floor of the run.

    .venv/bin/python -m chariot.bench.experiments.attention_ab_builds OTHER.cpp [bfloat16]

OTHER.cpp is the other build's `paged_attention.cpp`, with the headers it includes beside it.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from chariot.bench.cpu_attention_bench import SCALE, SHAPES, make_problem
from chariot.bench.linear_bench import cpu_record, time_interleaved
from chariot.kernels import cpu_attention

REPS = 31


def main(other_source: Path, dtype: torch.dtype) -> None:
    current = cpu_attention.load_kernel()
    other = cpu_attention.load_kernel(other_source)
    print({k: v for k, v in cpu_record().items() if k != "cpu_flags"}, dtype)
    with torch.inference_mode():
        for shape in SHAPES:
            q, k, v, meta = make_problem(shape, dtype)
            a, b, a2 = time_interleaved([
                lambda: cpu_attention.paged_attention(q, k, v, meta, SCALE, kernel=current),  # noqa: B023
                lambda: cpu_attention.paged_attention(q, k, v, meta, SCALE, kernel=other),  # noqa: B023
                lambda: cpu_attention.paged_attention(q, k, v, meta, SCALE, kernel=current),  # noqa: B023
            ], REPS)
            print(f"{shape.name:52s} current {a * 1e3:7.2f} ms  other {b * 1e3:7.2f} ms  current again "
                  f"{a2 * 1e3:7.2f} ms  other/current {b / a:.3f}  again/current {a2 / a:.3f}", flush=True)


if __name__ == "__main__":
    main(Path(sys.argv[1]), getattr(torch, sys.argv[2]) if len(sys.argv) > 2 else torch.float32)
