"""The peer benchmark's offline trace through Chariot's engine, step by step: how many tokens each
engine step carried and how long it took, grouped by step size.

The offline trace (64 chat requests ×0.25, all at t=0, fresh prompt contents, `ignore_eos`) runs in
three regimes: full 512-token steps (decodes plus prefill chunks) while prompts are waiting, then
decode-only steps of a few dozen sequences, then the tail of the last few. The linear layers are
compute-bound at 512 rows and bound by streaming the weights (and the decodes' KV) at a few rows,
so the groups say where a faster GEMM, a faster attention or a faster weight stream would pay.

One process, Chariot's `LLM` on the `100m` weights (float32 unless given), token budget 512, no
prefix caching, after a short warm-up. Writes OUT (default `offline_steps_<dtype>.json` in the
current directory: every step's tokens, decodes and seconds, the groups, the machine) and prints the
groups. Run from the repository root (it loads `models/100m`):

    .venv/bin/python -m chariot.bench.experiments.offline_steps [float32|bfloat16] [OUT]   # ~2 min on 2 cores
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

MODEL = Path("models/100m")
GROUPS = ((1, 16), (16, 64), (64, 256), (256, 480), (480, 513))  # [low, high) tokens per step


def main(dtype: str, out: Path) -> None:
    from chariot.bench.linear_bench import cpu_record
    from chariot.bench.peer import fresh_prompts
    from chariot.bench.traces import TRACES, make_trace
    from chariot.worker import LLM, SamplingParams
    from chariot.worker.engine import Engine

    trace = make_trace(TRACES["chat"], 64, 1.0, seed=0, scale=0.25, max_len=2048)
    lengths, outputs = [r.prompt_len for r in trace], [r.decode_len for r in trace]
    llm = LLM(str(MODEL), dtype=dtype, token_budget=512, max_model_len=2048,
              kv_cache_tokens=65536, prefix_caching=False, progress=False)
    steps: list[tuple[int, int, float]] = []
    step = Engine.step

    def timed_step(self: Engine):  # type: ignore[no-untyped-def]
        t0 = time.perf_counter()
        result = step(self)
        if result.batch is not None:
            steps.append((result.batch.num_tokens, result.batch.num_decodes, time.perf_counter() - t0))
        return result

    Engine.step = timed_step  # type: ignore[method-assign]

    def params(n: int) -> SamplingParams:
        return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)

    llm.generate(fresh_prompts(lengths[:8], 8192, "warm"), [params(8)] * 8)
    steps.clear()
    t0 = time.perf_counter()
    llm.generate(fresh_prompts(lengths, 8192, "offline-steps"), [params(n) for n in outputs])
    wall = time.perf_counter() - t0
    groups: list[dict[str, Any]] = []
    for low, high in GROUPS:
        chosen = [s for s in steps if low <= s[0] < high]
        if chosen:
            seconds = sum(s[2] for s in chosen)
            groups.append({"tokens": [low, high], "steps": len(chosen), "seconds": seconds,
                           "tokens_total": sum(s[0] for s in chosen), "ms_per_step": 1e3 * seconds / len(chosen)})
    print(f"wall {wall:.1f} s, {len(steps)} steps")
    for g in groups:
        print(f"tokens [{g['tokens'][0]}, {g['tokens'][1]}): {g['steps']:4d} steps {g['seconds']:6.1f} s "
              f"{g['ms_per_step']:6.1f} ms/step, {g['tokens_total']} tokens")
    out.write_text(json.dumps(
        {"machine": cpu_record(), "dtype": dtype, "wall_s": wall, "groups": groups,
         "steps": [{"tokens": t, "decodes": d, "s": s} for t, d, s in steps]}, indent=1))


if __name__ == "__main__":
    dtype = sys.argv[1] if len(sys.argv) > 1 else "float32"
    main(dtype, Path(sys.argv[2]) if len(sys.argv) > 2 else Path(f"offline_steps_{dtype}.json"))
