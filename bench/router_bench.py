"""Router overhead: what the router adds to TTFT and to each token, and how many requests per second
one router process sustains (loopback, small prompts, tiny model).

Starts a stage-0 worker and a router as real processes, then measures side by side in one run:
- sequential streamed requests straight to the worker's gRPC vs through the router's gRPC and its
  OpenAI HTTP (SSE) front: median TTFT and median gap between streamed tokens;
- a closed-loop load (C concurrent clients, 1-token completions) through the router: completed
  requests/s, and the router's CPU seconds per request (from /proc), i.e. the rate one core of router
  could sustain if it were the only bottleneck.

    python -m chariot.bench.router_bench --model models/tiny
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import re
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import grpc
import httpx

from chariot.contracts.proto_codec import request_to_proto
from chariot.contracts.sampling_params import SamplingParams
from chariot.proto.chariot.v1 import generation_pb2_grpc

CLK_TCK = 100


@dataclass(frozen=True)
class Latency:
    path: str
    ttft_ms: float
    tbt_ms: float


def start(cmd: list[str], ready: str) -> tuple[subprocess.Popen[str], str]:
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    assert proc.stdout is not None
    for line in proc.stdout:
        if line.startswith(ready):
            return proc, line
    raise RuntimeError(f"{cmd[4]} exited before becoming ready")


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


async def grpc_stream(stub: generation_pb2_grpc.GenerationStub, prompt: str, n: int) -> list[float]:
    """Arrival time of every streamed chunk, relative to the request start."""
    t0 = time.perf_counter()
    params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
    return [time.perf_counter() - t0 async for _ in stub.Generate(request_to_proto(prompt, params))]


async def http_stream(client: httpx.AsyncClient, url: str, model: str, prompt: str, n: int) -> list[float]:
    t0 = time.perf_counter()
    body = {"model": model, "prompt": prompt, "max_tokens": n, "temperature": 0, "ignore_eos": True, "stream": True}
    times = []
    async with client.stream("POST", f"{url}/v1/completions", json=body) as resp:
        async for line in resp.aiter_lines():
            if line.startswith("data: {"):
                times.append(time.perf_counter() - t0)
    return times


def summarize(path: str, runs: list[list[float]]) -> Latency:
    ttft = statistics.median(r[0] for r in runs)
    gaps = [b - a for r in runs for a, b in itertools.pairwise(r)]
    return Latency(path, ttft * 1e3, statistics.median(gaps) * 1e3)


async def latencies(worker: str, router_grpc: str, router_http: str, model: str, n: int, reps: int) -> list[Latency]:
    prompt = "Hello there, how are you"
    out: dict[str, list[list[float]]] = {"worker gRPC (direct)": [], "router gRPC": [], "router HTTP SSE": []}
    async with grpc.aio.insecure_channel(worker) as wch, grpc.aio.insecure_channel(router_grpc) as rch, \
            httpx.AsyncClient(timeout=60) as http:
        wstub, rstub = generation_pb2_grpc.GenerationStub(wch), generation_pb2_grpc.GenerationStub(rch)
        for i in range(reps + 2):  # interleave the paths so drift affects all alike; 2 warm-ups
            runs = [await grpc_stream(wstub, prompt, n), await grpc_stream(rstub, prompt, n),
                    await http_stream(http, router_http, model, prompt, n)]
            if i >= 2:
                for key, r in zip(out, runs, strict=True):
                    out[key].append(r)
    return [summarize(k, v) for k, v in out.items()]


async def closed_loop(target: str, clients: int, seconds: float) -> int:
    done = 0
    deadline = time.perf_counter() + seconds
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)

    async def client(stub: generation_pb2_grpc.GenerationStub) -> None:
        nonlocal done
        while time.perf_counter() < deadline:
            async for _ in stub.Generate(request_to_proto("Hi", params)):
                pass
            done += 1

    async with grpc.aio.insecure_channel(target) as ch:
        stub = generation_pb2_grpc.GenerationStub(ch)
        await asyncio.gather(*(client(stub) for _ in range(clients)))
    return done


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--clients", type=int, default=32)
    p.add_argument("--seconds", type=float, default=10.0)
    p.add_argument("--out", default="bench/results/router.json")
    args = p.parse_args(argv)
    py = [sys.executable, "-m", "chariot.cli"]
    worker, wline = start([*py, "worker", "--model", args.model, "--port", "0", "--metrics-port", "0",
                           "--kv-cache-tokens", "65536", "--max-batch-size", "256"], "chariot worker ready")
    waddr = re.search(r"grpc=(\S+)", wline).group(1)  # type: ignore[union-attr]
    router, rline = start([*py, "router", "--http-port", "0", "--grpc-port", "0", "--replica", f"g0={waddr}",
                           "--model", args.model, "--ttft-slo-ms", "60000", "--max-queue-per-replica", "100000"],
                          "chariot router ready")
    rgrpc = re.search(r"grpc=(\S+)", rline).group(1)  # type: ignore[union-attr]
    rhttp = "http://" + re.search(r"http=(\S+)", rline).group(1)  # type: ignore[union-attr]
    model = Path(args.model).name
    try:
        time.sleep(1.0)  # first Stats poll
        lat = asyncio.run(latencies(waddr, rgrpc, rhttp, model, args.tokens, args.reps))
        rates = {}
        for name, target, pid in (("worker direct", waddr, None), ("through router", rgrpc, router.pid)):
            cpu0 = cpu_seconds(pid) if pid else 0.0
            n = asyncio.run(closed_loop(target, args.clients, args.seconds))
            cpu = (cpu_seconds(pid) - cpu0) if pid else 0.0
            rates[name] = {"requests": n, "req_per_s": n / args.seconds,
                           "router_cpu_ms_per_request": 1e3 * cpu / n if pid else None}
    finally:
        for proc in (router, worker):
            proc.terminate()
            proc.wait(10)
    base = lat[0]
    print(f"model={args.model} tokens={args.tokens} reps={args.reps}\n")
    print("| path | median TTFT ms | added TTFT ms | median TBT ms | added per token ms |")
    print("|---|---:|---:|---:|---:|")
    for r in lat:
        print(f"| {r.path} | {r.ttft_ms:.2f} | {r.ttft_ms - base.ttft_ms:+.2f} | {r.tbt_ms:.3f} | "
              f"{r.tbt_ms - base.tbt_ms:+.3f} |")
    print(f"\nclosed loop, {args.clients} clients x {args.seconds:.0f} s, 1-token completions:\n")
    print("| path | requests/s | router CPU ms / request | one router core sustains (req/s) |")
    print("|---|---:|---:|---:|")
    for name, rate in rates.items():
        cpu = rate["router_cpu_ms_per_request"]
        print(f"| {name} | {rate['req_per_s']:.0f} | {'-' if cpu is None else f'{cpu:.2f}'} | "
              f"{'-' if not cpu else f'{1000 / cpu:.0f}'} |")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"latency": [asdict(x) for x in lat], "rates": rates}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
