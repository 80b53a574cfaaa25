"""Variants of one engine side by side on the peer benchmark's offline trace, in one process: the loop
the A/B experiments share (`prompt_route_ab`, `kernel_revision_ab`, `block_size_ab`, `amx_linear_ab`,
`linear_dispatch_ab`, `add_rms_norm_ab`, `bf16_upcast_ab`, `sampled_rows_ab`) and the record they save.

The trace is 64 chat requests ×0.25, all at t=0, `ignore_eos`, fresh prompt contents per round. Each
variant is a function that puts it in place and returns the `LLM` to run; every variant first runs
one warm-up batch of 8 short requests (whose greedy tokens are kept, to compare the variants), then
ROUNDS rounds run every variant once, each variant going first in turn.

Not a script: the experiments that use it are (`python -m chariot.bench.experiments.<name>`).
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

from chariot.bench.peer import fresh_prompts
from chariot.bench.traces import TRACES, make_trace

MODEL = Path("models/100m")


def load(dtype: str, **settings: Any) -> Any:
    """An `LLM` on the `100m` weights with the peer benchmark's engine settings (and `settings` on top)."""
    from chariot.worker import LLM

    return LLM(str(MODEL), dtype=dtype, token_budget=512, max_model_len=2048, kv_cache_tokens=65536,
               prefix_caching=False, progress=False, **settings)


def as_is(llm: Any) -> Callable[[], Any]:
    """A variant that needs nothing put in place: its own `LLM`."""
    return lambda: llm


def switched(llm: Any, put_in_place: Callable[[str], object], names: Iterable[str]) -> dict[str, Callable[[], Any]]:
    """Variants of one `LLM` that differ in something switched in place: each calls
    `put_in_place(name)` (swapping a function or a kernel build) and returns `llm`."""
    def variant(name: str) -> Callable[[], Any]:
        def put() -> Any:
            put_in_place(name)
            return llm
        return put
    return {name: variant(name) for name in names}


def rotated(names: list[str], r: int) -> list[str]:
    """Round r's order: each variant goes first in turn."""
    k = r % len(names)
    return names[k:] + names[:k]


def run_variants(variants: Mapping[str, Callable[[], Any]], rounds: int, salt: str,
                 ) -> tuple[dict[str, list[float]], dict[str, list[list[int]]]]:
    """Every variant's wall times over the offline trace, and its greedy tokens on the warm-up batch."""
    from chariot.worker import SamplingParams

    trace = make_trace(TRACES["chat"], 64, 1.0, seed=0, scale=0.25, max_len=2048)
    lengths, outputs = [r.prompt_len for r in trace], [r.decode_len for r in trace]

    def params(n: int) -> SamplingParams:
        return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)

    tokens = {name: [o.token_ids for o in use().generate(fresh_prompts(lengths[:8], 8192, "warm"), [params(16)] * 8)]
              for name, use in variants.items()}
    walls: dict[str, list[float]] = {name: [] for name in variants}
    for r in range(rounds):
        for name in rotated(list(variants), r):
            llm = variants[name]()
            t0 = time.perf_counter()
            llm.generate(fresh_prompts(lengths, 8192, f"{salt}/{r}"), [params(n) for n in outputs])
            walls[name].append(time.perf_counter() - t0)
            print(f"round {r + 1} {name}: {walls[name][-1]:.1f} s", flush=True)
    return walls, tokens


def medians(walls: Mapping[str, list[float]]) -> dict[str, float]:
    return {name: statistics.median(w) for name, w in walls.items()}


def same_tokens(tokens: Mapping[str, list[list[int]]], a: str, b: str) -> int:
    """In how many warm-up requests variants a and b sampled the same greedy tokens."""
    return sum(x == y for x, y in zip(tokens[a], tokens[b], strict=True))


def save(path: Path, dtype: str, rounds: int, walls: Mapping[str, list[float]], **extra: Any) -> None:
    """One experiment's record: the machine (with its CPU flags), dtype, rounds, every variant's wall
    times and their medians, and what the experiment adds (`extra`), as JSON at `path`."""
    from chariot.bench.linear_bench import cpu_record

    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"machine": cpu_record(), "dtype": dtype, "rounds": rounds, "wall_s": walls,
                                "median_s": medians(walls), **extra}, indent=1))
