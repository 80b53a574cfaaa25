"""Chariot's engine on the peer benchmark's offline trace, with and without `host_memory.keep_freed_memory`,
interleaved: page faults, system time and wall time per round.

Two processes, each Chariot's `LLM` on the `100m` weights (bf16 unless given, token budget 512, no
prefix caching), one with `CHARIOT_CPU_KEEP_FREED_MEMORY=0`; the driver sends each the same
64-request chat trace ×0.25 (fresh prompts per round, all at t=0, `ignore_eos`), alternating which
goes first. Each process reports its round's wall time, the minor page faults and system CPU time of
the round (`getrusage`) and its memory on transparent huge pages after it. Also a per-step breakdown
of one round of the kept process: steps by kind (decode-only or mixed, by rows), execute time, and
within it attention, the skinny kernel, oneDNN and the rest.

    .venv/bin/python -m chariot.bench.experiments.malloc_ab [ROUNDS] [DTYPE] [OUT_DIR]   # ~6 min

Run from the repository root (it loads `models/100m`); writes OUT_DIR/malloc_ab_<dtype>.json (OUT_DIR
defaults to the current directory).
"""

from __future__ import annotations

import json
import os
import resource
import statistics
import subprocess
import sys
import time
from collections import defaultdict
from collections.abc import Mapping
from pathlib import Path
from typing import Any, TypeVar

MODEL = Path("models/100m")
BUCKETS = (8, 24, 64, 128, 256, 512)


def load(dtype: str) -> Any:
    from chariot.worker import LLM

    return LLM(str(MODEL), dtype=dtype, token_budget=512, max_model_len=2048,
               kv_cache_tokens=65536, prefix_caching=False, progress=False)


def trace() -> tuple[list[int], list[int]]:
    from chariot.bench.traces import TRACES, make_trace

    reqs = make_trace(TRACES["chat"], 64, 1.0, seed=0, scale=0.25, max_len=2048)
    return [r.prompt_len for r in reqs], [r.decode_len for r in reqs]


def run(llm: Any, seed: str) -> None:
    from chariot.bench.peer import fresh_prompts
    from chariot.worker import SamplingParams

    lengths, outputs = trace()
    llm.generate(fresh_prompts(lengths, 8192, seed),
                 [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in outputs])


def timed_round(llm: Any, seed: str) -> dict[str, float]:
    r0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    run(llm, seed)
    wall, r1 = time.perf_counter() - t0, resource.getrusage(resource.RUSAGE_SELF)
    return {"wall_s": wall, "minor_faults": r1.ru_minflt - r0.ru_minflt, "sys_s": r1.ru_stime - r0.ru_stime,
            "huge_pages_kib": huge_pages_kib()}


def huge_pages_kib() -> int:
    """This process's anonymous memory on transparent huge pages (KiB; -1 where the kernel does not say)."""
    try:
        text = Path("/proc/self/smaps_rollup").read_text()
    except OSError:
        return -1
    for line in text.splitlines():
        if line.startswith("AnonHugePages:"):
            return int(line.split()[1])
    return -1


def step_breakdown(llm: Any, seed: str) -> dict[str, dict[str, float]]:
    """One round with every step timed: per kind of step, its count and seconds of execute time, and
    within it attention, the skinny kernel, oneDNN and the rest (wrappers around the calls)."""
    import chariot.worker.model.cpu_linear as cpu_linear
    import chariot.worker.model.llama as llama

    spent: dict[str, float] = defaultdict(float)
    attention, forward = llama.paged_attention, cpu_linear.CpuLinear.forward

    def timed_attention(*args: Any, **kwargs: Any) -> Any:
        t = time.perf_counter()
        out = attention(*args, **kwargs)
        spent["attention"] += time.perf_counter() - t
        return out

    def timed_linear(self: Any, x: Any) -> Any:
        t = time.perf_counter()
        out = forward(self, x)
        rows = x.reshape(-1, self.in_features).shape[0]
        spent["skinny" if self.skinny and rows <= self.skinny_max_rows else "onednn"] += time.perf_counter() - t
        return out

    kinds: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    engine, step = llm.engine, llm.engine.step

    def timed_step() -> Any:
        spent.clear()
        result = step()
        if result.batch is not None:
            chunks = result.batch.chunks
            rows = sum(c.num_tokens for c in chunks)
            kind = "decode-only" if result.batch.num_decodes == len(chunks) else "mixed"
            kind += f", rows <= {next(b for b in BUCKETS if rows <= b)}"
            k = kinds[kind]
            k["steps"] += 1
            k["execute_s"] += result.times.execute
            for name in ("attention", "skinny", "onednn"):
                k[f"{name}_s"] += spent[name]
            k["context_tokens"] += sum(c.start + c.num_tokens for c in chunks)
        return result

    llama.paged_attention = timed_attention
    cpu_linear.CpuLinear.forward = timed_linear  # type: ignore[method-assign]
    engine.step = timed_step
    try:
        run(llm, seed)
    finally:
        llama.paged_attention = attention
        cpu_linear.CpuLinear.forward = forward  # type: ignore[method-assign]
        engine.step = step
    out = {}
    for kind, k in sorted(kinds.items()):
        row = dict(k)
        row["rest_s"] = k["execute_s"] - k["attention_s"] - k["skinny_s"] - k["onednn_s"]
        out[kind] = row
    return out


def serve(dtype: str) -> None:
    llm = load(dtype)
    lengths, _ = trace()
    from chariot.bench.peer import fresh_prompts
    from chariot.worker import SamplingParams

    llm.generate(fresh_prompts(lengths[:8], 8192, "warm"), [SamplingParams(max_tokens=8, ignore_eos=True)] * 8)
    print("ready", flush=True)
    for line in sys.stdin:
        ask = json.loads(line)
        answer = step_breakdown(llm, ask["seed"]) if ask.get("breakdown") else timed_round(llm, ask["seed"])
        print(json.dumps(answer), flush=True)


K = TypeVar("K")


def start_servers(dtype: str, envs: Mapping[K, Mapping[str, str]]) -> dict[K, subprocess.Popen[str]]:
    """One `serve` process per environment in `envs`, each loaded and warm when this returns."""
    procs = {key: subprocess.Popen([sys.executable, __file__, "serve", dtype], stdin=subprocess.PIPE,
                                   stdout=subprocess.PIPE, text=True, env=dict(env)) for key, env in envs.items()}
    for p in procs.values():
        while (line := p.stdout.readline()) and line.strip() != "ready":  # type: ignore[union-attr]
            pass
    return procs


def ask(proc: subprocess.Popen[str], request: Mapping[str, Any]) -> dict[str, Any]:
    """Send one request line to a `serve` process and read its answer: a round's numbers, or with
    `breakdown` set, the step breakdown of one round."""
    proc.stdin.write(json.dumps(request) + "\n")  # type: ignore[union-attr]
    proc.stdin.flush()  # type: ignore[union-attr]
    return dict(json.loads(proc.stdout.readline()))  # type: ignore[union-attr]


def drive(rounds: int, dtype: str, out_dir: Path) -> None:
    from chariot.bench.linear_bench import cpu_record
    from chariot.worker.host_memory import ENV

    procs = start_servers(dtype, {"kept": {**os.environ, ENV: "1"}, "default": {**os.environ, ENV: "0"}})
    results: dict[str, list[dict[str, Any]]] = {name: [] for name in procs}
    try:
        for rnd in range(rounds):
            for name in (list(procs) if rnd % 2 == 0 else list(procs)[::-1]):
                results[name].append(ask(procs[name], {"seed": f"malloc-ab:{rnd}"}))
            last = {k: {m: round(x, 2) for m, x in v[-1].items()} for k, v in results.items()}
            print(f"round {rnd + 1}/{rounds}:", last, file=sys.stderr, flush=True)
        breakdown = ask(procs["kept"], {"seed": "malloc-ab:breakdown", "breakdown": True})
    finally:
        for p in procs.values():
            p.kill()
    med = {k: statistics.median(r["wall_s"] for r in v) for k, v in results.items()}
    pairs = [d["wall_s"] - k["wall_s"] for k, d in zip(results["kept"], results["default"], strict=True)]
    summary = {"median_wall_s": med, "default_over_kept": med["default"] / med["kept"],
               "paired_gain_s": pairs,
               "median_minor_faults": {k: statistics.median(r["minor_faults"] for r in v) for k, v in results.items()},
               "median_sys_s": {k: statistics.median(r["sys_s"] for r in v) for k, v in results.items()}}
    print(json.dumps(summary, indent=1))
    (out_dir / f"malloc_ab_{dtype}.json").write_text(json.dumps(
        {"machine": cpu_record(), "dtype": dtype, "rounds": results, "summary": summary,
         "step_breakdown_kept": breakdown}, indent=1))


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "serve":
        serve(sys.argv[2])
    else:
        drive(int(sys.argv[1]) if len(sys.argv) > 1 else 4, sys.argv[2] if len(sys.argv) > 2 else "bfloat16",
              Path(sys.argv[3]) if len(sys.argv) > 3 else Path())
