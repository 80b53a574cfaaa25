"""Where prompt chunks' attention runs, route against route, on whole engine runs in one process.

Why: on a CPU with AMX tiles the prompt chunks of a bf16 batch can take the C++ kernel's vector path
(`kernel`), PyTorch's flash SDPA over a copy of the context (`sdpa`), or the kernel's AMX tile path
(`amx`); `cpu_attention.prompt_route` picks one. Per call the routes differ by up to 2×
(`bench/cpu_attention_bench.py`); this measures what that is worth to an engine: the peer
benchmark's offline trace (64 chat requests ×0.25 at t=0, fresh prompts per round, `ignore_eos`)
through one `LLM`, the route switched between rounds (order rotating, ROUNDS each after a warm-up),
and the greedy tokens of the routes compared on one batch.

    .venv/bin/python -m chariot.bench.experiments.prompt_route_ab [DTYPE] [ROUTES] [ROUNDS] [OUT_DIR]
    # defaults: bfloat16 sdpa,amx 4 .   (~2 min a round on 2 cores)

Writes OUT_DIR/prompt_route_ab_<dtype>.json and prints each route's median wall time.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from chariot.bench import offline_ab as ab
from chariot.bench.linear_bench import cpu_record
from chariot.kernels import cpu_attention


def main(dtype: str, routes: tuple[str, ...], rounds: int, out_dir: Path) -> None:
    unknown = [r for r in routes if r not in cpu_attention.PROMPT_ROUTES]
    if unknown or len(routes) < 2:
        raise SystemExit(f"ROUTES: two or more of {', '.join(cpu_attention.PROMPT_ROUTES)}, got {','.join(routes)}")
    llm = ab.load(dtype)
    chosen = cpu_attention.prompt_route

    def route(name: str) -> None:
        cpu_attention.prompt_route = lambda *_: name

    walls, tokens = ab.run_variants(ab.switched(llm, route, routes), rounds, "prompt-route-ab")
    cpu_attention.prompt_route = chosen
    med = ab.medians(walls)
    same = {r: ab.same_tokens(tokens, routes[0], r) for r in routes[1:]}
    print("median wall: " + ", ".join(f"{r} {med[r]:.1f} s" for r in routes)
          + f"; {routes[0]}/{routes[-1]} {med[routes[0]] / med[routes[-1]]:.2f}x; greedy tokens identical to "
          + f"{routes[0]}'s: " + ", ".join(f"{r} {n}/8" for r, n in same.items()))
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"prompt_route_ab_{dtype}.json").write_text(json.dumps(
        {"machine": cpu_record(), "dtype": dtype, "routes": list(routes), "rounds": rounds, "wall_s": walls,
         "median_s": med, "greedy_identical_to_first": same, "amx_tiles": cpu_attention.amx_tiles()}, indent=1))


if __name__ == "__main__":
    args = sys.argv[1:]
    main(args[0] if args else "bfloat16", tuple(args[1].split(",")) if len(args) > 1 else ("sdpa", "amx"),
         int(args[2]) if len(args) > 2 else 4, Path(args[3]) if len(args) > 3 else Path("."))
