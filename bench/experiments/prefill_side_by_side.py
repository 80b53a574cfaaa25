"""Chariot's engine and vLLM-CPU's, one prefill at a time, alternating, on the same fresh prompts.

Each engine runs in its own process (vLLM in its venv under `build/`, in-process engine core;
Chariot's `LLM` in the project's venv), loaded once; the driver then asks them in turn for one
prefill (`max_tokens=1`) of the same random prompt, alternating which goes first, so both see the
same machine state. Then decodes the same way: a batch of B fresh L-token prompts, 64 tokens each
(time per step = wall / 64, the batch's prefill included). Afterwards it takes a torch.profiler
table of one 1,536-token prefill and of one decode run of 32 × 512-token prompts in each and
groups the self CPU time into linear layers, attention and the rest.

    .venv/bin/python -m chariot.bench.experiments.prefill_side_by_side [DTYPE] [OUT_DIR] [BUDGET]

From a checkout: it loads the checkout's `models/100m` and vLLM's venv under `build/`, both engines at
token budget BUDGET (default 512: a 1,536-token prefill is three iterations; at 2048 it is one), and
writes OUT_DIR/prefill_side_by_side.json (`_<dtype>` added for another DTYPE than float32, `_b<BUDGET>`
for another budget than 512; OUT_DIR defaults to the current directory).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from functools import partial
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]  # the checkout: this file is bench/experiments/<name>.py
MODEL = ROOT / "models" / "100m"
LENGTHS = (128, 432, 1024, 1536)
DECODE_CASES = ((1, 16), (8, 16), (32, 16), (32, 512))  # (batch, prompt tokens)
DECODE_STEPS = 64
ROUNDS = 7
PROFILE_TOKENS = 1536
BUDGET = 512
GROUPS = {"linear": ("onednn_mm", "_linear_pointwise", "skinny_linear", "amx_linear", "panel_linear", "aten::addmm",
                     "aten::mm"),
          "attention": ("paged_attention", "prompt_attention_amx", "scaled_dot_product", "cpu_attention_with_kv_cache")}


# ---- inside one engine's process ------------------------------------------------------------------
def load(system: str, dtype: str, budget: int = BUDGET) -> Any:
    """The engine under test (vLLM's `LLM` in its venv, or Chariot's): the `100m` weights, token budget
    `budget`, chunked prefill, no prefix caching. Also used by `trace_side_by_side`."""
    if system == "vllm":
        from vllm import LLM

        return LLM(model=str(MODEL), dtype=dtype, max_num_batched_tokens=budget, enable_chunked_prefill=True,
                   max_model_len=2048, enable_prefix_caching=False, seed=0)
    from chariot.worker import LLM as ChariotLLM

    return ChariotLLM(str(MODEL), dtype=dtype, token_budget=budget, max_model_len=2048, kv_cache_tokens=65536,
                      prefix_caching=False, progress=False)


def serve(system: str, dtype: str, budget: int = BUDGET) -> None:
    import torch
    from torch.profiler import ProfilerActivity, profile

    llm = load(system, dtype, budget)
    if system == "vllm":
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
        steps = SamplingParams(max_tokens=DECODE_STEPS, temperature=0.0, ignore_eos=True)

        def prefill(ids: list[int]) -> None:
            llm.generate([TokensPrompt(prompt_token_ids=ids)], params, use_tqdm=False)

        def decode(batch: list[list[int]]) -> None:
            llm.generate([TokensPrompt(prompt_token_ids=ids) for ids in batch], steps, use_tqdm=False)
    else:
        from chariot.worker import SamplingParams

        params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
        steps = SamplingParams(max_tokens=DECODE_STEPS, temperature=0.0, ignore_eos=True)

        def prefill(ids: list[int]) -> None:
            llm.generate([ids], params)

        def decode(batch: list[list[int]]) -> None:
            llm.generate(batch, steps)

    print("ready", flush=True)
    for line in sys.stdin:
        verb, n, seed, *prompt = line.split()
        gen = torch.Generator().manual_seed(int(seed))
        if verb.startswith("decode"):  # n prompts of `prompt` tokens, DECODE_STEPS tokens each
            size = (int(prompt[0]),)
            work = partial(decode, [torch.randint(3, 8000, size, generator=gen).tolist() for _ in range(int(n))])
        else:  # one prompt of n tokens, one token out
            work = partial(prefill, torch.randint(3, 8000, (int(n),), generator=gen).tolist())
        if not verb.endswith("profile"):
            t0 = time.perf_counter()
            work()
            print(json.dumps(time.perf_counter() - t0), flush=True)
        else:
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                work()
            rows = {e.key: e.self_cpu_time_total / 1e6 for e in prof.key_averages() if e.self_cpu_time_total > 0}
            print(json.dumps(rows), flush=True)


# ---- the driver -------------------------------------------------------------------------------------
def vllm_allocator() -> Path:
    """The tcmalloc library vLLM's process preloads (`chariot.bench.peer.find_tcmalloc`); an error naming
    the package when there is none, rather than a vLLM slower than its documented setup."""
    from chariot.bench.peer import TCMALLOC_PACKAGE, find_tcmalloc

    lib = find_tcmalloc()
    if lib is None:
        raise RuntimeError(f"vLLM-CPU runs with tcmalloc preloaded: apt-get install -y {TCMALLOC_PACKAGE}")
    return lib


class Engine:
    """One engine's process: `script serve SYSTEM DTYPE BUDGET` in that system's venv, talked to over stdin/stdout."""

    def __init__(self, system: str, dtype: str, script: Path = Path(__file__), budget: int = BUDGET) -> None:
        python = ROOT / ("build/vllm-venv/bin/python" if system == "vllm" else ".venv/bin/python")
        env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CPU_KVCACHE_SPACE="1",
                   VLLM_CPU_NUM_OF_RESERVED_CPU="0")
        self.allocator = vllm_allocator() if system == "vllm" else None
        if self.allocator is not None:  # vLLM as its CPU guide runs it, and as `chariot bench peer` does
            from chariot.bench.peer import compose_preload

            env["LD_PRELOAD"] = compose_preload(env.get("LD_PRELOAD"), self.allocator)
        command = [str(python), str(script.resolve()), "serve", system, dtype, str(budget)]
        self.proc = subprocess.Popen(command, cwd=tempfile.gettempdir(), env=env,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.system = system
        self._read_until("ready")

    def _read_until(self, word: str) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.strip() == word:
                return
        raise RuntimeError(f"{self.system} exited before '{word}'")

    def ask(self, verb: str, n: int, seed: int, prompt: int = 0) -> object:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(f"{verb} {n} {seed} {prompt}\n")
        self.proc.stdin.flush()
        while True:
            line = self.proc.stdout.readline()
            if not line:
                raise RuntimeError(f"{self.system} exited")
            if line.startswith(("{", "0", "1", "2", "3", "4", "5", "6", "7", "8", "9")):
                return json.loads(line)


def grouped(rows: dict[str, float]) -> dict[str, float]:
    out = {"linear": 0.0, "attention": 0.0, "other": 0.0}
    for name, seconds in rows.items():
        group = next((g for g, keys in GROUPS.items() if any(k in name for k in keys)), "other")
        out[group] += seconds
    return out


def drive(dtype: str, out_dir: Path, budget: int = BUDGET) -> None:
    from chariot.bench.linear_bench import cpu_record

    engines = [Engine("chariot", dtype, budget=budget), Engine("vllm", dtype, budget=budget)]
    for e in engines:  # warm-up: every length and batch once
        for n in LENGTHS:
            e.ask("run", n, 999)
        for b, length in DECODE_CASES:
            e.ask("decode", b, 999, length)
    times: dict[str, dict[int, list[float]]] = {e.system: {n: [] for n in LENGTHS} for e in engines}
    steps: dict[str, dict[str, list[float]]] = {e.system: {f"{b}x{n}": [] for b, n in DECODE_CASES} for e in engines}
    for rnd in range(ROUNDS):
        for n in LENGTHS:
            for e in engines if rnd % 2 == 0 else engines[::-1]:
                times[e.system][n].append(float(e.ask("run", n, 1000 * rnd + n)))  # type: ignore[arg-type]
        for b, length in DECODE_CASES:
            for e in engines if rnd % 2 == 0 else engines[::-1]:
                wall = float(e.ask("decode", b, 1000 * rnd + b, length))  # type: ignore[arg-type]
                steps[e.system][f"{b}x{length}"].append(wall / DECODE_STEPS)
        print(f"round {rnd + 1}/{ROUNDS}", file=sys.stderr, flush=True)
    rows = []
    for n in LENGTHS:
        c, v = statistics.median(times["chariot"][n]), statistics.median(times["vllm"][n])
        rows.append({"prompt_tokens": n, "chariot_ms": c * 1e3, "vllm_ms": v * 1e3, "chariot_over_vllm": c / v})
        print(f"{n:5d} tokens: Chariot {c * 1e3:7.1f} ms  vLLM {v * 1e3:7.1f} ms  ratio {c / v:.3f}")
    decode_rows = []
    for b, length in DECODE_CASES:
        key = f"{b}x{length}"
        c, v = statistics.median(steps["chariot"][key]), statistics.median(steps["vllm"][key])
        decode_rows.append({"batch": b, "prompt_tokens": length, "chariot_ms_per_step": c * 1e3,
                            "vllm_ms_per_step": v * 1e3, "chariot_over_vllm": c / v})
        print(f"decode {key:>6}: Chariot {c * 1e3:6.1f} ms/step  vLLM {v * 1e3:6.1f} ms/step  ratio {c / v:.3f}")
    profiles: dict[str, dict[str, object]] = {}
    batch, length = DECODE_CASES[-1]
    cases = (("prefill", "profile", PROFILE_TOKENS), (f"decode {batch}x{length}", "decode-profile", batch))
    for case, verb, n in cases:
        for e in engines:
            prof: dict[str, float] = e.ask(verb, n, 4242, length)  # type: ignore[assignment]
            top = dict(sorted(prof.items(), key=lambda kv: -kv[1])[:12])
            groups = grouped(prof)
            print(case, e.system, {k: round(v * 1e3, 1) for k, v in groups.items()}, "ms")
            profiles[f"{case}/{e.system}"] = {"groups_s": groups, "top_ops_s": top}
    for e in engines:
        e.proc.kill()
    name = "prefill_side_by_side" + ("" if dtype == "float32" else f"_{dtype}") + \
        ("" if budget == BUDGET else f"_b{budget}") + ".json"
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / name).write_text(json.dumps(
        {"machine": cpu_record(), "dtype": dtype, "token_budget": budget, "rounds": ROUNDS, "rows": rows,
         "times_s": times, "decode_rows": decode_rows, "decode_steps_s": steps, "profiles": profiles}, indent=1))


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "serve":
        serve(sys.argv[2], sys.argv[3], int(sys.argv[4]) if len(sys.argv) > 4 else BUDGET)
    else:
        drive(sys.argv[1] if len(sys.argv) > 1 else "float32", Path(sys.argv[2]) if len(sys.argv) > 2 else Path(),
              int(sys.argv[3]) if len(sys.argv) > 3 else BUDGET)
