"""How much of Chariot's offline trace is host time (Python between ops), profiled by cProfile.

torch.profiler (`trace_side_by_side`) records every op, and its own cost per op lands in the time
"outside ops", so an engine that dispatches more, smaller ops looks more host-bound under it than it
is. cProfile costs per Python call instead; the two bracket the host time. This runs the peer
benchmark's offline trace (64 chat requests ×0.25 at t=0, fresh prompts, `ignore_eos`) through
Chariot's `LLM` on the `100m` weights, token budget 512, once untimed, once timed, once under
cProfile, and splits the profiled time into torch ops (PyTorch's and Chariot's compiled ops: calls
into `torch._ops`, `torch.*` built-ins and tensor methods) and everything else. It prints the top
functions by own time.

    .venv/bin/python -m chariot.bench.experiments.host_profile [DTYPE] [OUT]   # ~2 min

Writes OUT (default host_profile_<dtype>.json in the current directory).
"""

from __future__ import annotations

import cProfile
import io
import json
import pstats
import sys
import time
from pathlib import Path

from chariot.bench.experiments import prefill_side_by_side as sbs
from chariot.bench.linear_bench import cpu_record
from chariot.bench.peer import fresh_prompts
from chariot.bench.traces import TRACES, make_trace

VOCAB = 8192


def is_op(func: tuple[str, int, str]) -> bool:
    """Whether a cProfile entry is a call into compiled torch code rather than Python."""
    file, _, name = func
    return file == "~" and ("torch._ops." in name or "built-in method torch." in name or "torch._C." in name)


def main(dtype: str, out: Path) -> None:
    from chariot.worker import SamplingParams

    llm = sbs.load("chariot", dtype)
    trace = make_trace(TRACES["chat"], 64, 1.0, seed=0, scale=0.25, max_len=2048)
    lengths, outputs = [r.prompt_len for r in trace], [r.decode_len for r in trace]
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in outputs]

    def run(tag: str) -> float:
        t0 = time.perf_counter()
        llm.generate(fresh_prompts(lengths, VOCAB, tag), params)
        return time.perf_counter() - t0

    run("warm")
    wall = run("timed")
    profiler = cProfile.Profile()
    profiler.enable()
    profiled_wall = run("profiled")
    profiler.disable()
    stats = pstats.Stats(profiler)
    entries = stats.stats  # type: ignore[attr-defined]
    ops = sum(v[2] for f, v in entries.items() if is_op(f))
    python = sum(v[2] for f, v in entries.items() if not is_op(f))
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(30)
    record = {"machine": cpu_record(), "dtype": dtype, "wall_s": wall, "profiled_wall_s": profiled_wall,
              "ops_s": ops, "python_s": python, "outside_ops_s": profiled_wall - ops,
              "top": text.getvalue().splitlines()}
    print(text.getvalue())
    print(f"wall {wall:.1f} s; under cProfile {profiled_wall:.1f} s: torch ops {ops:.1f} s, "
          f"outside them {profiled_wall - ops:.1f} s (Python's own time {python:.1f} s)")
    out.write_text(json.dumps(record, indent=1))


if __name__ == "__main__":
    argv = sys.argv[1:]
    dtype = argv[0] if argv else "bfloat16"
    main(dtype, Path(argv[1]) if len(argv) > 1 else Path(f"host_profile_{dtype}.json"))
