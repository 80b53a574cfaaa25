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
import statistics
import sys
import time
from pathlib import Path

import torch

from chariot.bench.linear_bench import cpu_record
from chariot.bench.peer import fresh_prompts
from chariot.bench.traces import TRACES, make_trace
from chariot.kernels import cpu_attention
from chariot.worker import LLM, SamplingParams

MODEL = Path("models/100m")
ROUNDS = 4
ROUTES = ("kernel", "sdpa")


def main(dtype: str, out_dir: Path) -> None:
    trace = make_trace(TRACES["chat"], 64, 1.0, seed=0, scale=0.25, max_len=2048)
    lengths, outputs = [r.prompt_len for r in trace], [r.decode_len for r in trace]
    llm = LLM(str(MODEL), dtype=dtype, token_budget=512, max_model_len=2048, kv_cache_tokens=65536,
              prefix_caching=False, progress=False)
    routed = cpu_attention.sdpa_prefills

    def route(name: str) -> None:
        cpu_attention.sdpa_prefills = lambda d: name == "sdpa" and d != torch.float32  # type: ignore[assignment]

    def params(n: int) -> SamplingParams:
        return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)

    tokens = {}
    for name in ROUTES:  # warm-up, and both routes' greedy tokens on the same prompts
        route(name)
        done = llm.generate(fresh_prompts(lengths[:8], 8192, "warm"), [params(16)] * 8)
        tokens[name] = [o.token_ids for o in done]
    walls: dict[str, list[float]] = {name: [] for name in ROUTES}
    for r in range(ROUNDS):
        for name in (ROUTES if r % 2 == 0 else ROUTES[::-1]):
            route(name)
            t0 = time.perf_counter()
            llm.generate(fresh_prompts(lengths, 8192, f"sdpa-ab/{r}"), [params(n) for n in outputs])
            walls[name].append(time.perf_counter() - t0)
            print(f"round {r + 1} {name}: {walls[name][-1]:.1f} s", flush=True)
    cpu_attention.sdpa_prefills = routed
    med = {name: statistics.median(w) for name, w in walls.items()}
    same = sum(a == b for a, b in zip(tokens["kernel"], tokens["sdpa"], strict=True))
    print(f"median wall: kernel {med['kernel']:.1f} s, sdpa {med['sdpa']:.1f} s ({med['kernel'] / med['sdpa']:.2f}x); "
          f"greedy tokens identical in {same}/8 requests")
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"sdpa_prefill_ab_{dtype}.json").write_text(json.dumps(
        {"machine": cpu_record(), "dtype": dtype, "rounds": ROUNDS, "wall_s": walls, "median_s": med,
         "greedy_identical": same, "amx_tiles": cpu_attention.amx_tiles()}, indent=1))


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "bfloat16", Path(sys.argv[2]) if len(sys.argv) > 2 else Path("."))
