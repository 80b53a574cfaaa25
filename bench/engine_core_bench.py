"""Engine core in a thread vs in its own process: what the GIL costs the engine loop under many streams.

`chariot worker --engine-core thread` runs the engine loop in a thread of the gRPC server's process, so
every streamed token's serialisation and every RPC competes with the loop for the GIL;
`--engine-core process` (the default) moves the loop into a child process and ships token deltas over a
pipe. This benchmark starts a real stage-0 worker in each mode, alternately (rounds interleave the
modes so drift hits both alike), and drives it with C concurrent gRPC streams of N tokens each:

- streamed output tokens/s over the whole run,
- TBT (gap between a stream's consecutive chunks) median and P99 over every stream,
- engine iterations per second and mean iteration time (the worker's Stats RPC: `iterations`),
- the worker's CPU seconds (front + core, from /proc) per 1,000 tokens.

    python -m chariot.bench.engine_core_bench --model models/100m --streams 64 --tokens 64 --rounds 3

Writes the raw per-round numbers and the CPU record to `--out` (JSON).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import grpc

from chariot.bench.peer import parse_cpuinfo
from chariot.contracts.processes import ready_field
from chariot.contracts.proto_codec import request_to_proto
from chariot.contracts.sampling_params import SamplingParams
from chariot.proto.chariot.v1 import generation_pb2 as pb
from chariot.proto.chariot.v1 import generation_pb2_grpc

MODES = ("thread", "process")
CLK_TCK = 100
FLAG_NAMES = ("avx2", "fma", "avx512f", "avx512_bf16", "amx_bf16")


@dataclass(frozen=True)
class Round:
    mode: str
    round: int
    tokens: int
    seconds: float
    tokens_per_s: float
    tbt_median_ms: float
    tbt_p99_ms: float
    iterations: int
    iteration_ms: float
    worker_cpu_s_per_1k_tokens: float


def start_worker(model: str, mode: str, max_batch: int) -> tuple[subprocess.Popen[str], str]:
    cmd = [sys.executable, "-m", "chariot.cli", "worker", "--model", model, "--port", "0", "--metrics-port", "0",
           "--engine-core", mode, "--max-batch-size", str(max_batch), "--kv-cache-tokens", "65536"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    assert proc.stdout is not None
    for line in proc.stdout:
        if line.startswith("chariot worker ready"):
            found = ready_field(line, "grpc")
            if found:
                return proc, found
    raise RuntimeError(f"worker ({mode}) exited before becoming ready")


def tree_cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process and its live children (the engine core)."""
    total = 0.0
    children = Path(f"/proc/{pid}/task/{pid}/children")
    pids = [pid, *(int(c) for c in children.read_text().split())] if children.exists() else [pid]
    for p in pids:
        fields = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
        total += (int(fields[11]) + int(fields[12])) / CLK_TCK
    return total


async def stream(stub: generation_pb2_grpc.GenerationStub, prompt: str, n: int) -> list[float]:
    params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
    return [time.perf_counter() async for _ in stub.Generate(request_to_proto(prompt, params))]


async def load(target: str, streams: int, tokens: int) -> tuple[list[list[float]], int]:
    async with grpc.aio.insecure_channel(target) as ch:
        stub = generation_pb2_grpc.GenerationStub(ch)
        before = (await stub.Stats(pb.StatsRequest())).iterations
        prompts = [f"request {i}: tell me a story about the number {i * 7919 % 1000}" for i in range(streams)]
        runs = await asyncio.gather(*(stream(stub, p, tokens) for p in prompts))
        after = (await stub.Stats(pb.StatsRequest())).iterations
    return list(runs), after - before


def measure(model: str, mode: str, rnd: int, streams: int, tokens: int) -> Round:
    proc, target = start_worker(model, mode, max(streams, 1))
    try:
        asyncio.run(load(target, min(streams, 4), 4))  # warm-up
        cpu0, t0 = tree_cpu_seconds(proc.pid), time.perf_counter()
        runs, iterations = asyncio.run(load(target, streams, tokens))
        seconds, cpu = time.perf_counter() - t0, tree_cpu_seconds(proc.pid) - cpu0
    finally:
        proc.terminate()
        proc.wait(30)
    gaps = sorted(b - a for r in runs for a, b in itertools.pairwise(r))
    produced = sum(len(r) for r in runs)
    return Round(mode, rnd, produced, seconds, produced / seconds, 1e3 * statistics.median(gaps),
                 1e3 * gaps[min(len(gaps) - 1, int(0.99 * len(gaps)))], iterations,
                 1e3 * seconds / max(iterations, 1), 1e3 * cpu / max(produced, 1))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--streams", type=int, default=64)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", default="bench/results/engine_core.json")
    args = p.parse_args(argv)
    rounds = []
    for rnd in range(args.rounds):
        for mode in MODES if rnd % 2 == 0 else MODES[::-1]:
            r = measure(args.model, mode, rnd, args.streams, args.tokens)
            print(f"round {rnd} {mode:7s}: {r.tokens_per_s:7.1f} tok/s  TBT p50 {r.tbt_median_ms:6.1f} ms "
                  f"p99 {r.tbt_p99_ms:6.1f} ms  {r.iteration_ms:5.1f} ms/iteration", flush=True)
            rounds.append(r)
    cpu = parse_cpuinfo(Path("/proc/cpuinfo").read_text())
    print(f"\n{cpu.model}, {cpu.logical_cpus} CPUs, flags: {' '.join(f for f in FLAG_NAMES if f in cpu.flags)}")
    print(f"model={args.model} streams={args.streams} tokens={args.tokens} rounds={args.rounds} (medians)\n")
    print("| engine core | tokens/s | TBT p50 ms | TBT p99 ms | ms / iteration | worker CPU s / 1k tokens |")
    print("|---|---:|---:|---:|---:|---:|")
    med = {m: {k: statistics.median(getattr(r, k) for r in rounds if r.mode == m)
               for k in ("tokens_per_s", "tbt_median_ms", "tbt_p99_ms", "iteration_ms", "worker_cpu_s_per_1k_tokens")}
           for m in MODES}
    for m in MODES:
        v = med[m]
        print(f"| {m} | {v['tokens_per_s']:.1f} | {v['tbt_median_ms']:.1f} | {v['tbt_p99_ms']:.1f} | "
              f"{v['iteration_ms']:.1f} | {v['worker_cpu_s_per_1k_tokens']:.2f} |")
    print(f"\nprocess / thread tokens/s: {med['process']['tokens_per_s'] / med['thread']['tokens_per_s']:.2f}x")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({
        "cpu": {"model": cpu.model, "logical_cpus": cpu.logical_cpus,
                "flags": [f for f in FLAG_NAMES if f in cpu.flags]},
        "args": vars(args), "rounds": [asdict(r) for r in rounds], "medians": med}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
