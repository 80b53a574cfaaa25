"""The parts of `make gpu-check` that need the GPU, one per child process (`chariot.bench.gpu_check`
starts them, each with its own time limit, and kills a part that outruns it).

Why child processes: a part stuck in a CUDA call cannot be stopped from inside its own process, and a
part that ends frees all of its GPU memory (CUDA-graph pools included) for the next. Each part writes
its JSON after every measurement, so a part stopped at its limit still leaves what it measured.

    python -m chariot.bench.gpu_check_parts PART --out DIR --model-root DIR --layers N
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import shutil
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from chariot.bench.engine_bench import hybrid_tokens, prefill_all
from chariot.bench.gpu_check import (
    CAPACITY_SEARCHES,
    DECODE_BATCHES,
    DECODE_CONTEXT,
    DRY_RUN_CAPACITY,
    ENGINE_RUNS,
    FULL_LAYERS,
    GRAPHS_UNAVAILABLE,
    HEADLINE_BATCH,
    HYBRID_BUDGETS,
    PREFILL_TOKENS,
    PRESET,
    PROGRESS,
    STRICT,
    capacity_folder,
    capacity_plan,
    capacity_search,
    graphs_in_this_build,
    half_depth,
    is_cuda_event,
    kernel_busy,
    kernel_counts,
    read_json,
    write_json,
)
from chariot.contracts.requests import FinishReason
from chariot.contracts.sampling_params import SamplingParams
from chariot.worker.config import EngineConfig
from chariot.worker.engine import Engine
from chariot.worker.model.make_model import make_model

LOW_TOKEN_ID = 16  # random prompts avoid the special tokens
KV_CACHE_TOKENS = 128 * 1024  # the largest decode batch at its context, or 32+ chat requests at once
MAX_MODEL_LEN = 4096
WARM_STEPS, TIMED_STEPS, PROFILED_STEPS = 3, 20, 5
DECODE_TOKENS = 1 + WARM_STEPS + TIMED_STEPS + PROFILED_STEPS + 4  # a decode request outlives its measurement
PREFILL_REPS = 4  # timed, after one untimed
GREEDY_PROMPT_LENS, GREEDY_TOKENS = (9, 41, 130, 301), 24
BANDWIDTH_GIB, BANDWIDTH_REPS = 2, 10
SHARD_BYTES = 1 << 30


def progress(message: str) -> None:
    print(f"{PROGRESS}{message}", flush=True)


# ---- prepare: the checkpoint and the bandwidth ---------------------------------------------------
def model_dirs(root: Path, layers: int) -> tuple[Path, Path | None]:
    half = half_depth(layers)
    return root / f"{PRESET}-{layers}l", (root / f"{PRESET}-{half}l-of-{layers}" if half else None)


def link_half_depth(full: Path, half_dir: Path, layers: int) -> Path:
    """A checkpoint folder that reads only the first `layers` layers of `full`: its own config.json,
    links to everything else (the loader reads only the tensors a stage needs)."""
    shutil.rmtree(half_dir, ignore_errors=True)
    half_dir.mkdir(parents=True)
    for item in full.iterdir():
        if item.name == "config.json":
            config = json.loads(item.read_text())
            config["num_hidden_layers"] = layers
            (half_dir / item.name).write_text(json.dumps(config, indent=2) + "\n")
        else:
            (half_dir / item.name).symlink_to(item.resolve())
    return half_dir


def measure_bandwidth(gib: int = BANDWIDTH_GIB, reps: int = BANDWIDTH_REPS) -> dict[str, float]:
    """HBM bandwidth: a device-to-device copy (bytes read + written) and a read-only reduction."""
    n = gib << 30
    src = torch.ones(n, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    words = src.view(torch.bfloat16)
    copy_s = _cuda_seconds(lambda: dst.copy_(src), reps)
    read_s = _cuda_seconds(lambda: words.sum(dtype=torch.float32), reps)
    copy_gbs, read_gbs = 2 * n / copy_s / 1e9, n / read_s / 1e9
    return {"bytes": n, "copy_gbs": copy_gbs, "read_gbs": read_gbs, "floor_gbs": max(copy_gbs, read_gbs)}


def _cuda_seconds(fn: Callable[[], object], reps: int) -> float:
    """Seconds per call, by CUDA events around `reps` calls after three untimed ones."""
    for _ in range(3):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3 / reps


def prepare(args: argparse.Namespace) -> int:
    """The checkpoint (on the CPU, a dry run's: the small preset) and the HBM bandwidth."""
    out, root = Path(args.out), Path(args.model_root)
    full, half = model_dirs(root, args.layers)
    on_gpu = args.device.startswith("cuda")
    preset = PRESET if on_gpu else DRY_RUN_PRESET
    record: dict[str, Any] = {"gpu": torch.cuda.get_device_name(0) if on_gpu else "none (a dry run on the CPU)",
                              "torch": torch.__version__, "layers": args.layers, "model_root": str(root),
                              "preset": preset}
    progress(f"drawing {args.layers} layers of the {preset} preset on {args.device} into {full}")
    shutil.rmtree(full, ignore_errors=True)
    t0 = time.perf_counter()
    make_model(full, preset, seed=0, progress=False, num_layers=args.layers, device=args.device,
               tokenizer="synthetic", max_shard_bytes=SHARD_BYTES)
    record["make_s"] = round(time.perf_counter() - t0, 2)
    record["model"] = str(full)
    record["half_model"] = str(link_half_depth(full, half, half_depth(args.layers) or 0)) if half else None
    progress(f"checkpoint written in {record['make_s']} s")
    write_json(out / "prepare.json", record)
    if not on_gpu:
        return 0
    record["bandwidth"] = bw = measure_bandwidth()
    progress(f"bandwidth: copy {bw['copy_gbs']:.0f} GB/s, read {bw['read_gbs']:.0f} GB/s")
    write_json(out / "prepare.json", record)
    return 0


# ---- engine: decode, prefill, kernels, greedy ---------------------------------------------------
@dataclass(frozen=True)
class Sweep:
    """What the engine part measures and on what; the defaults are the GPU check's (tests shrink it)."""

    device: str = "cuda"
    dtype: str = "bfloat16"
    batches: tuple[int, ...] = DECODE_BATCHES
    context: int = DECODE_CONTEXT
    prefill_tokens: tuple[int, ...] = PREFILL_TOKENS
    hybrid_budgets: tuple[int, ...] = HYBRID_BUDGETS
    hybrid_decodes: int = HEADLINE_BATCH
    max_model_len: int = MAX_MODEL_LEN
    kv_cache_tokens: int = KV_CACHE_TOKENS

    def engine_config(self, model: str, mode: str) -> EngineConfig:
        """Budget of the largest prefill chunk or hybrid iteration, batches up to the largest decode batch
        (or the hybrid iterations' decodes and their prompt); `mode` is the
        CUDA-graphs setting (left out where this build has none), or `sync`: graphs on, the engine
        not scheduling ahead."""
        graphs: dict[str, Any] = {}
        if graphs_in_this_build():
            graphs = {"cuda_graphs": "on", "async_scheduling": "off"} if mode == "sync" else {"cuda_graphs": mode}
        return EngineConfig(model=model, policy="sarathi", token_budget=max(self.prefill_tokens + self.hybrid_budgets),
                            max_batch_size=max(*self.batches, self.hybrid_decodes + 1),
                            max_model_len=self.max_model_len,
                            kv_cache_tokens=self.kv_cache_tokens, device=self.device, dtype=self.dtype,
                            prefix_caching=False, attention_aware_chunks=False, **graphs)


DRY_RUN_PRESET = "small"  # a dry run on the CPU: every part's code on a checkpoint the CPU decodes quickly
DRY_RUN_SWEEP = Sweep(device="cpu", dtype="float32", batches=(1, 4, 16, HEADLINE_BATCH), context=64,
                      prefill_tokens=(64, 256), hybrid_budgets=(128, 256), max_model_len=MAX_MODEL_LEN,
                      kv_cache_tokens=16384)


def dtype_for(device: str) -> str:
    """bf16 on a GPU (Llama-3's own); float32 for a dry run of a part's code on the CPU."""
    return "bfloat16" if device.startswith("cuda") else "float32"


def timed_steps(engine: Engine, steps: int) -> list[float]:
    """Wall milliseconds of each of the next `steps` engine steps."""
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        engine.step()
        times.append((time.perf_counter() - t0) * 1e3)
    return times


def drain(engine: Engine, request_ids: Sequence[str]) -> None:
    engine.finish_requests(request_ids, FinishReason.ABORT)
    while engine.has_unfinished:
        engine.step()


def measure_decode(engine: Engine, batch: int, context: int, profile: bool) -> dict[str, Any]:
    """Median wall time of a decode iteration of `batch` sequences at about `context` tokens (and,
    with `profile`, the kernels it runs)."""
    params = SamplingParams(max_tokens=DECODE_TOKENS, temperature=0.0, ignore_eos=True)
    ids = [engine.add_request([7] * context, params) for _ in range(batch)]
    prefill_all(engine)
    timed_steps(engine, WARM_STEPS)
    times = timed_steps(engine, TIMED_STEPS)
    row: dict[str, Any] = {"batch": batch, "median_ms": statistics.median(times),
                           "p90_ms": sorted(times)[int(0.9 * len(times))], "iterations": len(times),
                           "mean_context": context + 1 + WARM_STEPS + (TIMED_STEPS - 1) / 2}
    if profile:
        row["kernels"] = profile_kernels(engine)
    drain(engine, ids)
    return row


def profile_kernels(engine: Engine) -> dict[str, float | None]:
    """Kernels and launch calls per decode iteration over `PROFILED_STEPS` steps, and the GPU's own
    time in them (`kernel_busy`; None on the CPU, where the profile has no CUDA events)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=activities) as prof:
        for _ in range(PROFILED_STEPS):
            engine.step()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
    events = list(prof.events())
    device = [e.name for e in events if is_cuda_event(e)]
    host = [e.name for e in events if str(e.device_type).endswith("CPU")]
    return {**kernel_counts(device, host, PROFILED_STEPS), **kernel_busy(events, PROFILED_STEPS)}


def measure_prefill(engine: Engine, tokens: int) -> dict[str, Any]:
    """Median wall time of an iteration that prefills a fresh prompt of `tokens` in one chunk."""
    once = SamplingParams(max_tokens=1, ignore_eos=True)
    times = []
    for rep in range(PREFILL_REPS + 1):
        engine.add_request([LOW_TOKEN_ID + rep] * tokens, once)
        (elapsed,) = timed_steps(engine, 1)
        while engine.has_unfinished:
            engine.step()
        if rep:
            times.append(elapsed)
    return {"tokens": tokens, "median_ms": statistics.median(times), "reps": len(times)}


def measure_hybrid(engine: Engine, decodes: int, context: int, budget: int) -> dict[str, Any]:
    """Median wall time of a Sarathi hybrid iteration: `decodes` decodes at about `context` tokens
    beside a fresh prompt's chunk filling the rest of `budget`. The step timed is the one whose
    completed batch held the chunk (with asynchronous scheduling a prompt runs a step after it is added)."""
    params = SamplingParams(max_tokens=DECODE_TOKENS, temperature=0.0, ignore_eos=True)  # outlives the reps
    ids = [engine.add_request([7] * context, params) for _ in range(decodes)]
    prefill_all(engine)
    timed_steps(engine, WARM_STEPS)
    once, chunk, times = SamplingParams(max_tokens=1, ignore_eos=True), budget - decodes, []
    for rep in range(PREFILL_REPS + 1):
        engine.add_request([LOW_TOKEN_ID + rep] * chunk, once)
        for _ in range(3):
            t0 = time.perf_counter()
            result = engine.step()
            elapsed = (time.perf_counter() - t0) * 1e3
            if hybrid_tokens(result, decodes) == budget:
                if rep:
                    times.append(elapsed)
                break
    drain(engine, ids)
    if not times:
        raise RuntimeError(f"no step ran {decodes} decodes beside a {chunk}-token chunk (budget {budget})")
    return {"budget": budget, "decodes": decodes, "median_ms": statistics.median(times), "reps": len(times)}


def greedy_prompts(vocab_size: int) -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(LOW_TOKEN_ID, vocab_size) for _ in range(n)] for n in GREEDY_PROMPT_LENS]


def greedy_tokens(engine: Engine) -> list[list[int]]:
    params = SamplingParams(max_tokens=GREEDY_TOKENS, temperature=0.0, ignore_eos=True)
    ids = [engine.add_request(p, params) for p in greedy_prompts(engine.model_config.vocab_size)]
    tokens: dict[str, list[int]] = {i: [] for i in ids}
    while engine.has_unfinished:
        for out in engine.step().outputs:
            tokens[out.request_id].extend(out.new_token_ids)
    return [tokens[i] for i in ids]


class EngineRecord:
    """engine.json, rewritten after every measurement."""

    def __init__(self, path: Path, context: int = DECODE_CONTEXT) -> None:
        """Start from what earlier runs of the engine part left in `path` (each run is its own process)."""
        self.path = path
        available = graphs_in_this_build()
        self.doc: dict[str, Any] = {"runs": {}, "kernels": {}, **(read_json(path) or {})}
        self.doc.update(graphs_available=available, graphs_note=None if available else GRAPHS_UNAVAILABLE,
                        decode_context=context)

    def run(self, key: str) -> dict[str, Any]:
        """The record of run `key`, started afresh (a rerun replaces what an earlier one left)."""
        fresh: dict[str, Any] = {"decode": [], "prefill": [], "hybrid": []}
        self.doc["runs"][key] = fresh
        return fresh

    def save(self) -> None:
        write_json(self.path, self.doc)


def measure_engine(record: EngineRecord, model: str, mode: str, key: str, full: bool, sweep: Sweep = Sweep()) -> None:
    """One engine (one depth, one graphs setting): decode batches, prefill chunks, and at full
    depth the greedy tokens and the kernel profile; each result saved as soon as it is measured."""
    run = record.run(key)
    t0 = time.perf_counter()
    engine = Engine(sweep.engine_config(model, mode), progress=False)
    run["setup_s"] = round(time.perf_counter() - t0, 2)
    progress(f"{key}: engine ready in {run['setup_s']} s")
    try:
        if full:
            run["greedy"] = greedy_tokens(engine)
            record.save()
        for batch in sweep.batches:
            row = measure_decode(engine, batch, sweep.context, profile=full and batch == HEADLINE_BATCH)
            if "kernels" in row:
                record.doc["kernels"][mode] = row.pop("kernels")
            run["decode"].append(row)
            record.save()
            progress(f"{key}: decode {batch}: {row['median_ms']:.2f} ms")
        for tokens in sweep.prefill_tokens if key != "sync" else ():  # a lone prefill has nothing to overlap
            run["prefill"].append(measure_prefill(engine, tokens))
            record.save()
            progress(f"{key}: prefill {tokens}: {run['prefill'][-1]['median_ms']:.2f} ms")
        for budget in sweep.hybrid_budgets if full and key in ("on", "off") else ():  # as the served worker runs them
            run["hybrid"].append(measure_hybrid(engine, sweep.hybrid_decodes, sweep.context, budget))
            record.save()
            progress(f"{key}: hybrid, budget {budget}: {run['hybrid'][-1]['median_ms']:.2f} ms")
    finally:
        engine.shutdown()
        del engine
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def engine(args: argparse.Namespace) -> int:
    """One engine run (`--run`: graphs on or off, full or half depth) into engine.json."""
    out = Path(args.out)
    prep = read_json(out / "prepare.json") or {}
    mode, _, depth = args.run.partition("_")
    model = prep["half_model"] if depth == "half" else prep["model"]
    sweep = Sweep() if args.device.startswith("cuda") else DRY_RUN_SWEEP
    measure_engine(EngineRecord(out / "engine.json"), model, mode, args.run, full=depth != "half", sweep=sweep)
    return 0


# ---- capacity under SLO --------------------------------------------------------------------------
def capacity(args: argparse.Namespace) -> int:
    """One capacity search (`--search`: sarathi under one SLO with that SLO's token budget, or vllm
    under both; each search is its own part, so that one running long cannot cost another its turn)
    into capacity-<search>/, as `chariot bench capacity` writes it."""
    from chariot.bench import capacity_cli as cc
    from chariot.bench.traces import TRACES

    out = Path(args.out)
    model = (read_json(out / "prepare.json") or {})["model"]
    dry_run: dict[str, Any] = {} if args.device.startswith("cuda") else DRY_RUN_CAPACITY
    plan = capacity_plan(read_json(out / "engine.json") or {}, **dry_run)
    write_json(out / "capacity_plan.json", plan)
    policy, budget, slos = capacity_search(args.search, plan)
    pc = cc.PolicyConfig(policy, budget)
    progress(f"capacity {args.search} ({pc.label}): SLO {', '.join(f'{s:g}' for s in slos)} ms, "
             f"probes from {plan['qps_low']} QPS")
    vocab = json.loads((Path(model) / "config.json").read_text())["vocab_size"]
    load = cc.Load(TRACES[plan["trace"]], plan["requests"], plan["scale"], plan["max_len"], 0, vocab, plan["drain_s"])
    search = cc.Search(slos, plan["qps_low"], plan["qps_high"], plan["tolerance"], plan["max_probes"])
    setup = {**plan, "search": args.search, "tbt_slo_ms": list(slos), "model": model, "model_name": Path(model).name,
             "plot_qps": None}
    config = EngineConfig(model=model, policy=pc.policy, token_budget=pc.token_budget,
                          max_batch_size=max(DECODE_BATCHES), max_model_len=plan["max_len"],
                          kv_cache_tokens=KV_CACHE_TOKENS, device=args.device, dtype=dtype_for(args.device),
                          prefix_caching=False)
    result = cc.measure_policy(pc, config, load, search, None)
    folder = out / capacity_folder(args.search)
    cc.write_results(folder, setup, [result])
    cc.write_plots(folder, setup, [result])
    found = ", ".join(f"{q:.3f} QPS @ {s:g} ms" for s, q in result.capacity.items())
    progress(f"capacity {args.search} ({pc.label}): {found}")
    return 0


# ---- vLLM side by side ---------------------------------------------------------------------------
def offline_workload(vocab_size: int) -> tuple[list[list[int]], list[int]]:
    """The capacity trace's requests (same lengths), all at once: prompts and output lengths."""
    from chariot.bench.gpu_check import CAPACITY_MAX_LEN, CAPACITY_REQUESTS, CAPACITY_SCALE, CAPACITY_TRACE
    from chariot.bench.traces import TRACES, make_trace

    trace = make_trace(TRACES[CAPACITY_TRACE], CAPACITY_REQUESTS, None, seed=0, scale=CAPACITY_SCALE,
                       max_len=CAPACITY_MAX_LEN)
    rng = random.Random(1)
    prompts = [[rng.randrange(LOW_TOKEN_ID, vocab_size) for _ in range(r.prompt_len)] for r in trace]
    return prompts, [r.decode_len for r in trace]


def run_chariot_offline(model: str, prompts: list[list[int]], outputs: list[int], budget: int) -> dict[str, Any]:
    from chariot.worker import LLM

    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in outputs]
    with LLM(model, policy="sarathi", token_budget=budget, max_batch_size=max(DECODE_BATCHES), dtype="bfloat16",
             kv_cache_tokens=KV_CACHE_TOKENS, device="cuda", max_model_len=MAX_MODEL_LEN, prefix_caching=False,
             progress=False) as llm:
        llm.generate(prompts[:2], params[:2])  # untimed: first shapes
        t0 = time.perf_counter()
        done = llm.generate(prompts, params)
        wall = time.perf_counter() - t0
    tokens = sum(len(o.token_ids) for o in done)
    return {"requests": len(done), "output_tokens": tokens, "wall_s": wall, "tokens_per_s": tokens / wall}


def run_vllm_offline(model: str, prompts: list[list[int]], outputs: list[int], budget: int) -> dict[str, Any]:
    from vllm import LLM as VllmLLM
    from vllm import SamplingParams as VllmParams

    llm = VllmLLM(model=model, dtype="bfloat16", max_model_len=MAX_MODEL_LEN, max_num_seqs=max(DECODE_BATCHES),
                  max_num_batched_tokens=budget, enable_prefix_caching=False, gpu_memory_utilization=0.5)
    params = [VllmParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in outputs]
    requests = [{"prompt_token_ids": p} for p in prompts]
    llm.generate(requests[:2], params[:2], use_tqdm=False)
    t0 = time.perf_counter()
    done = llm.generate(requests, params, use_tqdm=False)
    wall = time.perf_counter() - t0
    tokens = sum(len(o.outputs[0].token_ids) for o in done)
    return {"requests": len(done), "output_tokens": tokens, "wall_s": wall, "tokens_per_s": tokens / wall}


def vllm(args: argparse.Namespace) -> int:
    out = Path(args.out)
    model = (read_json(out / "prepare.json") or {})["model"]
    # both systems chunk prefills at sarathi's budget for the strict SLO
    budget = int(((read_json(out / "capacity_plan.json") or {}).get("token_budgets") or {}).get(STRICT, 512))
    vocab = json.loads((Path(model) / "config.json").read_text())["vocab_size"]
    prompts, outputs = offline_workload(vocab)
    record: dict[str, Any] = {"token_budget": budget, "systems": {}}
    for name, run in (("chariot", run_chariot_offline), ("vllm", run_vllm_offline)):
        record["systems"][name] = run(model, prompts, outputs, budget)
        write_json(out / "vllm.json", record)
        progress(f"vllm side by side: {name}: {record['systems'][name]['tokens_per_s']:.0f} output tokens/s")
        gc.collect()
        torch.cuda.empty_cache()
    return 0


PARTS: dict[str, Callable[[argparse.Namespace], int]] = {
    "prepare": prepare, "engine": engine, "capacity": capacity, "vllm": vllm}


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m chariot.bench.gpu_check_parts",
                                description=(__doc__ or "").splitlines()[0])
    p.add_argument("part", choices=sorted(PARTS))
    p.add_argument("--out", required=True)
    p.add_argument("--model-root", required=True)
    p.add_argument("--layers", type=int, required=True, choices=range(1, FULL_LAYERS + 1), metavar="N")
    p.add_argument("--run", choices=ENGINE_RUNS, default="on", help="engine part: which run (graphs, depth)")
    p.add_argument("--search", choices=tuple(CAPACITY_SEARCHES), default=next(iter(CAPACITY_SEARCHES)),
                   help="capacity part: which search (sarathi under one SLO with its budget, or vllm under both)")
    p.add_argument("--device", default="cuda", help="cuda; cpu: a dry run of the part's code on the small preset "
                                                    "(`gpu_check --dry-run`), no meaningful figures")
    args = p.parse_args(argv)
    return PARTS[args.part](args)


if __name__ == "__main__":
    sys.exit(main())
