"""KV-cache block sizes side by side on whole engine runs, in one process.

Why: a decode's attention streams its sequences' K and V out of the cache, and on the CPU the
cache's blocks are head-major (one head's rows of a block are contiguous): a 16-token block is a
2 KiB run of one head's keys (`100m`, bf16), a 128-token block 16 KiB. On a cache larger than the
last-level cache, longer runs stream faster (`cpu_attention_bench`-style calls over a 390 MB cache:
docs/kernels.md). This measures what that is worth to the engine: the peer benchmark's offline trace
(64 chat requests ×0.25 at t=0, fresh prompts per round, `ignore_eos`) through one `LLM` per block
size on the `100m` weights, rounds rotating which goes first, and the greedy tokens of every block
size compared on one batch (the block size changes where K/V live, never what is computed).

    .venv/bin/python -m chariot.bench.experiments.block_size_ab [DTYPE] [SIZES] [ROUNDS] [OUT_DIR]
    # defaults: bfloat16 16,128 4 . (~4 min in bf16, ~8 min in fp32)

From the repository root (`models/100m`). Writes OUT_DIR/block_size_ab_<dtype>.json and prints each
block size's median wall time.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

from chariot.bench.linear_bench import cpu_record
from chariot.bench.peer import fresh_prompts
from chariot.bench.traces import TRACES, make_trace
from chariot.worker import LLM, SamplingParams

MODEL = Path("models/100m")


def rotated(sizes: list[int], r: int) -> list[int]:
    """Round r's order: each block size goes first in turn."""
    k = r % len(sizes)
    return sizes[k:] + sizes[:k]


def main(dtype: str, sizes: list[int], rounds: int, out_dir: Path) -> None:
    trace = make_trace(TRACES["chat"], 64, 1.0, seed=0, scale=0.25, max_len=2048)
    lengths, outputs = [r.prompt_len for r in trace], [r.decode_len for r in trace]
    llms = {b: LLM(str(MODEL), dtype=dtype, token_budget=512, max_model_len=2048, kv_cache_tokens=65536,
                   prefix_caching=False, progress=False, block_size=b) for b in sizes}

    def params(n: int) -> SamplingParams:
        return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)

    tokens = {b: [o.token_ids for o in llm.generate(fresh_prompts(lengths[:8], 8192, "warm"), [params(16)] * 8)]
              for b, llm in llms.items()}  # warm-up, and every size's greedy tokens on the same prompts
    walls: dict[int, list[float]] = {b: [] for b in sizes}
    for r in range(rounds):
        for b in rotated(sizes, r):
            t0 = time.perf_counter()
            llms[b].generate(fresh_prompts(lengths, 8192, f"block-ab/{r}"), [params(n) for n in outputs])
            walls[b].append(time.perf_counter() - t0)
            print(f"round {r + 1} block {b}: {walls[b][-1]:.1f} s", flush=True)
    med = {b: statistics.median(w) for b, w in walls.items()}
    same = {b: sum(x == y for x, y in zip(tokens[sizes[0]], tokens[b], strict=True)) for b in sizes}
    print("median wall: " + ", ".join(f"block {b} {med[b]:.1f} s ({med[sizes[0]] / med[b]:.2f}x)" for b in sizes)
          + f"; greedy tokens equal to block {sizes[0]}'s: {same}")
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"block_size_ab_{dtype}.json").write_text(json.dumps(
        {"machine": cpu_record(), "dtype": dtype, "block_sizes": sizes, "rounds": rounds,
         "wall_s": {str(b): w for b, w in walls.items()}, "median_s": {str(b): m for b, m in med.items()},
         "greedy_equal_to_first": {str(b): n for b, n in same.items()}}, indent=1))


if __name__ == "__main__":
    argv = sys.argv[1:]
    main(argv[0] if argv else "bfloat16", [int(x) for x in (argv[1] if len(argv) > 1 else "16,128").split(",")],
         int(argv[2]) if len(argv) > 2 else 4, Path(argv[3]) if len(argv) > 3 else Path("."))
