"""Whole decode iterations with the few-rows linear kernel on and off, interleaved in one engine.

`CpuLinear` keeps the oneDNN-packed weight beside the few-rows one (float32: the panel kernel's
panels; bf16: the skinny kernel's plain weight), so one loaded engine can route its
decode rows either way: steps alternate between the two routes (setting `CpuLinear.skinny_max_rows`) over
the same running sequences, so machine drift hits both alike. This is where
`kernels.skinny_linear.MAX_ROWS` came from (docs/kernels.md); the engine
measures the crossover below it when a stage loads (`cpu_linear.calibrate_skinny_rows`), and this
benchmark overrides that to time the kernel at every batch size. `--prefill-chunks N` times N
prefill steps of one token budget each (float32: the panel kernel's blocked order against oneDNN)
the same way, alternating step by step over long prompts.

    python -m chariot.bench.decode_linear_bench --model models/100m --out docs/img/decode_linear_100m.json
    python -m chariot.bench.decode_linear_bench --model models/100m --batches 0 --prefill-chunks 16
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys

from tqdm.auto import tqdm

from chariot.bench.engine_bench import NEVER_STOP, Target, make_engine, prefill_all
from chariot.bench.linear_bench import cpu_record, save_record
from chariot.worker.engine import Engine
from chariot.worker.model.cpu_linear import SKINNY_ROWS_ENV, CpuLinear


def route_skinny(engine: Engine, on: bool) -> None:
    """Send every row count up to the layers' cap to the few-rows route (float32: the panel kernel,
    else the skinny kernel on the plain weight), or none of them (oneDNN)."""
    runner = engine.executor.runner  # type: ignore[attr-defined]  # single-process engines only
    layers = [m for m in runner.stage.modules() if isinstance(m, CpuLinear)]
    if not layers or not all(m.skinny and m.packed_weight is not None for m in layers):
        raise SystemExit("the engine's linear layers do not keep both routes (packing or the few-rows kernel is off)")
    for m in layers:
        m.skinny_max_rows = m.few_rows_cap if on else 0


def alternate(engine: Engine, steps: int) -> dict[str, float]:
    """Median step time (ms) with the few-rows kernel and with oneDNN, `steps` each, step by step."""
    times: dict[bool, list[float]] = {True: [], False: []}
    for _ in range(steps):
        for on in (True, False):
            route_skinny(engine, on)
            times[on].append(engine.step().times.total * 1e3)
    skinny_ms, packed_ms = statistics.median(times[True]), statistics.median(times[False])
    return {"skinny_ms": skinny_ms, "packed_ms": packed_ms, "speedup": packed_ms / skinny_ms}


def measure(model: str, batch: int, context: int, steps: int, seed: int = 0, dtype: str = "float32",
            ) -> dict[str, object]:
    engine = make_engine(Target(model, "cpu", dtype), "sarathi", 4096, max(4096, context + 2 * steps + 64))
    rng = random.Random(seed)
    vocab = engine.model_config.vocab_size
    for _ in range(batch):
        engine.add_request([rng.randrange(vocab) for _ in range(context)], NEVER_STOP)
    prefill_all(engine)
    return {"batch": batch, "context": context, "steps": steps, **alternate(engine, steps)}


def measure_prefill(model: str, budget: int, chunks: int, seed: int = 0, dtype: str = "float32",
                    ) -> dict[str, object]:
    """Prefill steps of `budget` tokens each (chunks of prompts four budgets long), routes alternating."""
    engine = make_engine(Target(model, "cpu", dtype), "sarathi", budget, 4 * budget + 4096)
    rng = random.Random(seed)
    vocab = engine.model_config.vocab_size
    for _ in range(-(-2 * chunks // 4) + 1):
        engine.add_request([rng.randrange(vocab) for _ in range(4 * budget)], NEVER_STOP)
    engine.step()  # oneDNN builds its primitive for the shape
    return {"prefill_tokens": budget, "steps": chunks, **alternate(engine, chunks)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--batches", default="1,2,4,8,12,16,24,32,48,64", help="comma-separated decode batch sizes")
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--steps", type=int, default=12, help="steps per route and batch")
    parser.add_argument("--prefill-chunks", type=int, default=0, help="also time this many prefill steps per route")
    parser.add_argument("--budget", type=int, default=512, help="tokens per prefill step")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                        help="bfloat16: the few-rows route is the skinny kernel, or the AMX tile path where the CPU "
                             "has AMX")
    parser.add_argument("--out", default="bench/results/decode_linear.json")
    args = parser.parse_args(argv)
    os.environ[SKINNY_ROWS_ENV] = "0"  # both layouts stay loaded; `route_skinny` picks one per step
    rows = []
    if args.prefill_chunks:
        row = measure_prefill(args.model, args.budget, args.prefill_chunks, dtype=args.dtype)
        rows.append(row)
        tqdm.write(f"prefill {args.budget} tokens: few-rows kernel {row['skinny_ms']:7.1f} ms, "
                   f"packed {row['packed_ms']:7.1f} ms, {row['speedup']:4.2f}x", file=sys.stderr)
    for b in tqdm([int(x) for x in args.batches.split(",") if int(x)], desc="decode batches", file=sys.stderr):
        row = measure(args.model, b, args.context, args.steps, dtype=args.dtype)
        rows.append(row)
        tqdm.write(f"decode {b:3d} (ctx {args.context}): few-rows kernel {row['skinny_ms']:7.1f} ms, "
                   f"packed {row['packed_ms']:7.1f} ms, {row['speedup']:4.2f}x", file=sys.stderr)
    save_record(args.out, {"machine": cpu_record(), "model": args.model, "dtype": args.dtype, "rows": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
