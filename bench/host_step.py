"""Host time per decode step: where a decode iteration's wall time goes when compute is negligible.

On a GPU the host must prepare step N+1 faster than the device runs step N, or the device waits. A
model as small as the `tiny` preset makes the forward pass nearly free on the CPU, so what is left of
an engine step is the host's own work. This benchmark runs decode-only steps of a single-process
engine at several batch sizes and splits each step into

- schedule, build (`InputBuilder.build`) and postprocess: the engine's own `IterationTimes`;
- decode (`decode_batch`: payload to device tensors), forward and sample: timed around the
  `ModelRunner`'s methods of those names;
- step: wall time of `Engine.step()` as a whole (the parts above plus the engine's bookkeeping),

reporting medians over many steps, plus the aten operations one step dispatches (a
`TorchDispatchMode` counter, in separate steps so its overhead stays out of the timings).

    python -m chariot.bench.host_step --model models/tiny --out docs/img/host_step/after.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from chariot.bench.peer import CpuInfo, parse_cpuinfo
from chariot.contracts.sampling_params import SamplingParams
from chariot.worker.config import EngineConfig
from chariot.worker.engine import Engine

BATCH_SIZES = (1, 8, 32, 64)
PROMPT_TOKENS = 32
RUNNER_PARTS = ("decode", "forward", "sample")
PARTS = ("schedule", "build", *RUNNER_PARTS, "postprocess", "step")
FLAG_NAMES = ("avx2", "fma", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile")


class OpCounter(TorchDispatchMode):
    """Counts the aten operations dispatched while it is active."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.count += 1
        return func(*args, **(kwargs or {}))


class RunnerClock:
    """Wall time of the runner's decode / forward / sample calls, per step (instance-level wrappers,
    so the engine's own code is measured unchanged)."""

    def __init__(self, runner: Any) -> None:
        self.seconds = dict.fromkeys(RUNNER_PARTS, 0.0)
        for name in RUNNER_PARTS:
            setattr(runner, name, self._timed(name, getattr(runner, name)))

    def _timed(self, name: str, method: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            t = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                self.seconds[name] += time.perf_counter() - t
        return timed

    def take(self) -> dict[str, float]:
        """The seconds since the last take, then zero."""
        taken, self.seconds = self.seconds, dict.fromkeys(RUNNER_PARTS, 0.0)
        return taken


def make_engine(model: str, dtype: str, batch: int, steps: int) -> Engine:
    max_len = PROMPT_TOKENS + steps + 64
    cfg = EngineConfig(model=model, policy="sarathi", token_budget=512, max_batch_size=max(batch, 1),
                       max_model_len=max_len, kv_cache_tokens=batch * max_len + 1024, device="cpu", dtype=dtype,
                       prefix_caching=False)
    return Engine(cfg, progress=False)


def start_decoding(engine: Engine, batch: int) -> None:
    """Queue `batch` greedy requests that outlast the run, and step until all are prefilled (only
    decodes are left)."""
    never_stop = SamplingParams(max_tokens=engine.max_model_len - PROMPT_TOKENS, temperature=0.0, ignore_eos=True)
    for i in range(batch):
        engine.add_request([3 + (i + j) % 200 for j in range(PROMPT_TOKENS)], never_stop)
    load = engine.stats()
    while load.num_waiting or load.queued_prefill_tokens:
        load = engine.step().stats


def timed_steps(engine: Engine, clock: RunnerClock, n: int) -> list[dict[str, float]]:
    """Per-step seconds of every part, for `n` decode steps."""
    rows = []
    for _ in range(n):
        clock.take()
        t = time.perf_counter()
        result = engine.step()
        step = time.perf_counter() - t
        if result.batch is None or result.batch.num_decodes != result.batch.num_seqs:
            raise RuntimeError("a measured step was not decode-only")
        times = result.times
        rows.append({"schedule": times.schedule, "build": times.prepare, **clock.take(),
                     "postprocess": times.postprocess, "step": step})
    return rows


def ops_per_step(engine: Engine, steps: int) -> float:
    counter = OpCounter()
    with counter:
        for _ in range(steps):
            engine.step()
    return counter.count / steps


@contextmanager
def threads(n: int | None) -> Iterator[None]:
    before = torch.get_num_threads()
    if n is not None:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def bench_batch(model: str, dtype: str, batch: int, steps: int, warmup: int) -> dict[str, Any]:
    engine = make_engine(model, dtype, batch, steps + warmup + 8)
    try:
        start_decoding(engine, batch)
        clock = RunnerClock(engine.executor.runner)  # type: ignore[attr-defined]  # single-process engine
        timed_steps(engine, clock, warmup)
        rows = timed_steps(engine, clock, steps)
        ops = ops_per_step(engine, 4)
    finally:
        engine.shutdown()
    medians = {part: statistics.median(r[part] for r in rows) * 1e3 for part in PARTS}
    steps_s = [r["step"] for r in rows]
    p90 = (statistics.quantiles(steps_s, n=10)[-1] if len(steps_s) > 1 else steps_s[0]) * 1e3
    return {"batch": batch, "steps": steps, "median_ms": medians, "step_p90_ms": p90, "aten_ops_per_step": ops,
            "dtype": str(engine.dtype).removeprefix("torch.")}


def machine() -> dict[str, Any]:
    try:
        cpu = parse_cpuinfo(Path("/proc/cpuinfo").read_text())
    except OSError:
        cpu = CpuInfo(platform.processor(), (), os.cpu_count() or 0)
    return {"cpu_model": cpu.model, "cpu_flags": [f for f in FLAG_NAMES if f in cpu.flags],
            "logical_cpus": cpu.logical_cpus, "torch": torch.__version__, "torch_threads": torch.get_num_threads(),
            "python": platform.python_version()}


def print_table(results: list[dict[str, Any]]) -> None:
    print("| batch | " + " | ".join(PARTS) + " | aten ops |")
    print("|---:|" + "---:|" * (len(PARTS) + 1))
    for r in results:
        cells = " | ".join(f"{r['median_ms'][p]:.3f}" for p in PARTS)
        print(f"| {r['batch']} | {cells} | {r['aten_ops_per_step']:.0f} |")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="models/tiny")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--batches", type=int, nargs="+", default=list(BATCH_SIZES))
    parser.add_argument("--steps", type=int, default=300, help="measured decode steps per batch size")
    parser.add_argument("--warmup", type=int, default=30)
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    parser.add_argument("--label", default="", help="free text stored with the results (e.g. before / after)")
    parser.add_argument("--out", type=Path, default=None, help="write the raw results here (JSON)")
    args = parser.parse_args(argv)
    with threads(args.threads):
        results = [bench_batch(args.model, args.dtype, b, args.steps, args.warmup) for b in args.batches]
        record = {"label": args.label, "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
                  "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
                  "model": args.model, "model_config": _model_config(Path(args.model)),
                  "machine": machine(), "parts": list(PARTS), "results": results}
    print_table(results)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(record, indent=1) + "\n")
    return 0


def _model_config(model_dir: Path) -> dict[str, Any]:
    raw = json.loads((model_dir / "config.json").read_text())
    keys = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "intermediate_size",
            "vocab_size", "torch_dtype")
    return {k: raw.get(k) for k in keys}


if __name__ == "__main__":
    raise SystemExit(main())
