"""The last layer over the sampled rows alone against over every row, on the peer benchmark's offline
trace through one engine, in one process.

Why: a prompt chunk that does not end its prompt samples nothing, and a chunk that does samples one
row, yet every layer used to run its o_proj and MLP over every row. The last layer's are read by
nothing but the LM head, so the last stage now runs them over the sampled rows alone
(`LlamaStage.forward`'s `sampled_rows`): 1 / num_layers of the linear work of those rows (the
`100m` preset has 8 layers). The variant "every_row" puts the old path back in place between rounds
(`LlamaStage.forward` wrapped: every row through the last layer, then the sampled rows picked), and
the greedy tokens of both are compared on the warm-up batch.

    .venv/bin/python -m chariot.bench.experiments.sampled_rows_ab [DTYPE] [OUT_DIR] [ROUNDS]   # ~8 min, fp32

From the repository root (it loads `models/100m`); writes OUT_DIR/sampled_rows_ab_<dtype>.json and
prints each variant's median wall time.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch

from chariot.bench import offline_ab as ab
from chariot.worker.model.llama import LlamaStage

ROUNDS = 4
SAMPLED_ROWS_ALONE = LlamaStage.forward


def every_row(self: LlamaStage, *args: Any, sampled_rows: torch.Tensor | None = None, **kwargs: Any) -> torch.Tensor:
    """The path before: every row through every layer, the sampled rows picked afterwards."""
    hidden = SAMPLED_ROWS_ALONE(self, *args, **kwargs)
    return hidden if sampled_rows is None else hidden.index_select(0, sampled_rows)


VARIANTS = {"sampled_rows": SAMPLED_ROWS_ALONE, "every_row": every_row}


def use(name: str) -> None:
    setattr(LlamaStage, "forward", VARIANTS[name])  # noqa: B010 (the class's method, switched)


def main(dtype: str, out_dir: Path, rounds: int) -> None:
    llm = ab.load(dtype)
    try:
        walls, tokens = ab.run_variants(ab.switched(llm, use, VARIANTS), rounds, "sampled-rows-ab")
    finally:
        use("sampled_rows")
    med, same = ab.medians(walls), ab.same_tokens(tokens, "sampled_rows", "every_row")
    ratio = med["every_row"] / med["sampled_rows"]
    print(f"median wall: every_row {med['every_row']:.1f} s, sampled_rows {med['sampled_rows']:.1f} s "
          f"({ratio:.3f}x); greedy tokens identical in {same}/8 requests")
    ab.save(out_dir / f"sampled_rows_ab_{dtype}.json", dtype, rounds, walls, every_row_over_sampled_rows=ratio,
            greedy_identical=same)


if __name__ == "__main__":
    args = sys.argv[1:]
    main(args[0] if args else "float32", Path(args[1]) if len(args) > 1 else Path("."),
         int(args[2]) if len(args) > 2 else ROUNDS)
