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

import sys
from pathlib import Path

from chariot.bench import offline_ab as ab


def main(dtype: str, sizes: list[int], rounds: int, out_dir: Path) -> None:
    llms = {str(b): ab.load(dtype, block_size=b) for b in sizes}
    walls, tokens = ab.run_variants({name: ab.as_is(llm) for name, llm in llms.items()}, rounds, "block-ab")
    med, first = ab.medians(walls), str(sizes[0])
    same = {name: ab.same_tokens(tokens, first, name) for name in llms}
    print("median wall: " + ", ".join(f"block {b} {med[b]:.1f} s ({med[first] / med[b]:.2f}x)" for b in llms)
          + f"; greedy tokens equal to block {first}'s: {same}")
    ab.save(out_dir / f"block_size_ab_{dtype}.json", dtype, rounds, walls, block_sizes=sizes,
            greedy_equal_to_first=same)


if __name__ == "__main__":
    argv = sys.argv[1:]
    main(argv[0] if argv else "bfloat16", [int(x) for x in (argv[1] if len(argv) > 1 else "16,128").split(",")],
         int(argv[2]) if len(argv) > 2 else 4, Path(argv[3]) if len(argv) > 3 else Path("."))
