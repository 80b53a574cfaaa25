"""A load ramp against `chariot up --max-replicas`: does the autoscaler start a second replica when the
load rises, keep the SLO once it is ready, and stop it on the ramp down without a failed request?

    python -m chariot.bench.autoscale_ramp --model DIR --out docs/img/autoscale

Starts `chariot up` (tiny model by default, one stage per replica, `--max-replicas 2`,
`--autoscale-log`), then sends a `chat` trace (`chariot.bench.traces`, lengths scaled) open loop with
Poisson arrivals whose rate ramps from `--low-qps` to `--peak-qps`, holds, and ramps back down,
then idles while the autoscaler scales down. Each request streams (OpenAI completions with token
ids); its arrival, status, TTFT and replica are recorded. Writes `requests.csv`, the autoscaler's
`autoscale.jsonl`, `summary.json` and `autoscale_ramp.png` (offered load and capacity, replicas,
TTFT over time) to `--out`.

`--threads-per-replica N` gives each replica's torch N threads (`OMP_NUM_THREADS`), so that on a small
machine a second replica runs on cores of its own rather than sharing the first one's; pass
`-- --max-replicas 1` for the same ramp on one replica, the baseline the second replica is judged
against (`ttft_p99_at_peak_s`: requests that arrived during the hold at the peak).
"""

from __future__ import annotations

import argparse
import asyncio
import csv
import json
import math
import os
import random
import re
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx

from chariot.bench.driver import random_prompt
from chariot.bench.routing_bench import machine_record
from chariot.bench.traces import TRACES, make_trace

ENGINE_FLAGS = ["--dtype", "float32", "--max-model-len", "512", "--kv-cache-tokens", "8192"]


@dataclass(frozen=True)
class Ramp:
    """Arrival rate (requests/s) over time: low → peak over `up_s`, `hold_s` at peak, back to low over
    `down_s`, then `tail_s` with no requests (the scale-down window plays out)."""

    low_qps: float
    peak_qps: float
    up_s: float
    hold_s: float
    down_s: float
    tail_s: float

    @property
    def load_s(self) -> float:
        return self.up_s + self.hold_s + self.down_s

    def rate(self, t: float) -> float:
        if t < self.up_s:
            return self.low_qps + (self.peak_qps - self.low_qps) * t / self.up_s
        if t < self.up_s + self.hold_s:
            return self.peak_qps
        if t < self.load_s:
            return self.peak_qps - (self.peak_qps - self.low_qps) * (t - self.up_s - self.hold_s) / self.down_s
        return 0.0

    def arrivals(self, rng: random.Random) -> list[float]:
        """Poisson arrivals of the time-varying rate (thinning)."""
        out: list[float] = []
        t, top = 0.0, max(self.low_qps, self.peak_qps)
        while True:
            t += rng.expovariate(top)
            if t >= self.load_s:
                return out
            if rng.random() < self.rate(t) / top:
                out.append(t)


@dataclass
class Sent:
    arrival_s: float
    prompt_tokens: int
    max_tokens: int
    status: int = 0
    ttft_s: float | None = None
    duration_s: float | None = None
    replica: str = ""
    error: str = ""


async def _one(client: httpx.AsyncClient, sent: Sent, prompt: list[int], model: str) -> None:
    body = {"model": model, "prompt": prompt, "max_tokens": sent.max_tokens, "ignore_eos": True, "stream": True,
            "temperature": 0.0}
    start = time.monotonic()
    try:
        async with client.stream("POST", "/v1/completions", json=body) as resp:
            sent.status, sent.replica = resp.status_code, resp.headers.get("x-chariot-replica", "")
            async for line in resp.aiter_lines():
                if sent.ttft_s is None and line.startswith("data: {"):
                    sent.ttft_s = time.monotonic() - start
                if '"error"' in line and line.startswith("data: "):
                    sent.error = line[6:200]
        sent.duration_s = time.monotonic() - start
    except httpx.HTTPError as exc:
        sent.error = f"{type(exc).__name__}: {exc}"


async def send_ramp(url: str, model: str, ramp: Ramp, seed: int, scale: float,
                    vocab: int) -> tuple[list[Sent], float]:
    """Every request of the ramp, and the wall-clock time (epoch seconds) the ramp started."""
    rng = random.Random(seed)
    times = ramp.arrivals(rng)
    lengths = make_trace(TRACES["chat"], len(times), None, seed=seed, scale=scale, max_len=480)
    sent = [Sent(t, r.prompt_len, max(1, r.decode_len)) for t, r in zip(times, lengths, strict=True)]
    prompts = [random_prompt(rng, s.prompt_tokens, vocab) for s in sent]
    limits = httpx.Limits(max_connections=512, max_keepalive_connections=64)
    async with httpx.AsyncClient(base_url=url, timeout=120.0, limits=limits) as client:
        t0, wall0 = time.monotonic(), time.time()
        tasks = []
        for s, prompt in zip(sent, prompts, strict=True):
            await asyncio.sleep(max(0.0, t0 + s.arrival_s - time.monotonic()))
            tasks.append(asyncio.create_task(_one(client, s, prompt, model)))
        await asyncio.gather(*tasks)
        await asyncio.sleep(max(0.0, t0 + ramp.load_s + ramp.tail_s - time.monotonic()))
    return sent, wall0


def start_up(model: str, log: Path, stderr: Path, extra: list[str],
             threads: int | None = None) -> tuple[subprocess.Popen[str], str]:
    env = {**os.environ, **({"OMP_NUM_THREADS": str(threads)} if threads else {})}
    cmd = [sys.executable, "-m", "chariot.cli", "up", "--model", model, "--stages", "1", "--http-port", "0",
           "--grpc-port", "0", *ENGINE_FLAGS, "--min-replicas", "1", "--max-replicas", "2",
           "--autoscale-log", str(log), *extra]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=stderr.open("w"), text=True, env=env)
    assert proc.stdout is not None
    for line in proc.stdout:
        if line.startswith("chariot up ready"):
            match = re.search(r"http=(\S+)", line)
            assert match is not None
            return proc, f"http://{match.group(1)}"
    raise RuntimeError(f"chariot up exited ({proc.wait()}); see {stderr}")


def stop_up(proc: subprocess.Popen[str]) -> None:
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()


def summarize(sent: list[Sent], looks: list[dict[str, Any]], ttft_slo_s: float, ramp: Ramp) -> dict[str, Any]:
    ok = [s for s in sent if s.status == 200 and not s.error and s.ttft_s is not None]
    failed = [s for s in sent if s.status not in (200, 429) or (s.status == 200 and s.error)]
    two = [row["t"] for row in looks if row.get("ready", 0) >= 2]
    after = [s.ttft_s for s in ok if two and s.arrival_s >= two[0] and s.ttft_s is not None]
    at_peak = [s for s in sent if ramp.up_s <= s.arrival_s < ramp.up_s + ramp.hold_s]
    peak_ttft = [s.ttft_s for s in at_peak if s in ok and s.ttft_s is not None]
    return {"requests": len(sent), "ok": len(ok), "shed_429": sum(s.status == 429 for s in sent),
            "failed": len(failed), "max_replicas": max((row["replicas"] for row in looks), default=0),
            "second_replica_ready_at_s": two[0] if two else None,
            "replicas_at_end": looks[-1]["replicas"] if looks else None,
            "ttft_p50_s": _quantile([s.ttft_s for s in ok if s.ttft_s is not None], 0.5),
            "ttft_p50_after_second_ready_s": _quantile(after, 0.5),
            "ttft_p99_after_second_ready_s": _quantile(after, 0.99),
            "requests_at_peak": len(at_peak), "shed_at_peak": sum(s.status == 429 for s in at_peak),
            "ttft_p50_at_peak_s": _quantile(peak_ttft, 0.5), "ttft_p99_at_peak_s": _quantile(peak_ttft, 0.99),
            "ttft_slo_s": ttft_slo_s,
            "replicas_by_name": sorted({s.replica for s in ok})}


def _quantile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


def plot(sent: list[Sent], looks: list[dict[str, Any]], out: Path, ttft_slo_s: float) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2, ax3) = plt.subplots(3, 1, figsize=(10, 9), sharex=True)
    t = [row["t"] for row in looks]
    ax1.plot(t, [row["work_rate"] for row in looks], label="offered tokens/s (router window)")
    ax1.plot(t, [row["group_capacity"] * row.get("ready", 0) for row in looks], label="capacity of ready replicas")
    ax1.set_ylabel("tokens / s")
    ax1.legend(loc="upper left")
    ax2.step(t, [row["replicas"] for row in looks], where="post", label="replica processes")
    ax2.step(t, [row.get("ready", 0) for row in looks], where="post", label="ready (routed, measured)")
    ax2.step(t, [row["desired"] for row in looks], where="post", linestyle="--", label="desired")
    ax2.set_ylabel("replicas")
    ax2.set_ylim(0, 3)
    ax2.legend(loc="upper left")
    ok = [s for s in sent if s.ttft_s is not None and s.status == 200]
    ax3.scatter([s.arrival_s for s in ok], [s.ttft_s for s in ok], s=4, label="TTFT of each request")
    shed = [s.arrival_s for s in sent if s.status == 429]
    if shed:
        ax3.scatter(shed, [ttft_slo_s * 1.05] * len(shed), s=6, marker="x", color="red", label="shed (429)")
    ax3.axhline(ttft_slo_s, color="grey", linestyle=":", label="TTFT SLO")
    ax3.set_ylabel("TTFT (s)")
    ax3.set_xlabel("time since the ramp started (s)")
    ax3.legend(loc="upper left")
    fig.tight_layout()
    path = out / "autoscale_ramp.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m chariot.bench.autoscale_ramp", description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True, help="model directory (e.g. the tiny preset)")
    p.add_argument("--out", default="docs/img/autoscale", help="results folder")
    p.add_argument("--low-qps", type=float, default=1.0)
    p.add_argument("--peak-qps", type=float, default=12.0)
    p.add_argument("--up-seconds", type=float, default=40.0)
    p.add_argument("--hold-seconds", type=float, default=30.0)
    p.add_argument("--down-seconds", type=float, default=20.0)
    p.add_argument("--tail-seconds", type=float, default=40.0)
    p.add_argument("--scale", type=float, default=0.1, help="chat trace length scale")
    p.add_argument("--ttft-slo-ms", type=float, default=2000.0)
    p.add_argument("--seed", type=int, default=41)
    p.add_argument("--threads-per-replica", type=int, default=None,
                   help="torch threads of each replica (OMP_NUM_THREADS; default: torch's own choice)")
    p.add_argument("up_flags", nargs="*", help="more `chariot up` flags (after --)")
    args = p.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    log = out / "autoscale.jsonl"
    log.unlink(missing_ok=True)
    ramp = Ramp(args.low_qps, args.peak_qps, args.up_seconds, args.hold_seconds, args.down_seconds, args.tail_seconds)
    vocab = int(json.loads((Path(args.model) / "config.json").read_text())["vocab_size"])
    extra = ["--ttft-slo-ms", str(args.ttft_slo_ms), *args.up_flags]
    proc, url = start_up(args.model, log, out / "chariot_up.stderr.log", extra, args.threads_per_replica)
    try:
        sent, wall0 = asyncio.run(send_ramp(url, Path(args.model).name, ramp, args.seed, args.scale, vocab))
    finally:
        stop_up(proc)
    looks = [{**row, "t": round(row["wall"] - wall0, 3)}  # on the requests' clock: seconds since the ramp began
             for row in (json.loads(line) for line in log.read_text().splitlines() if line.strip())]
    with (out / "requests.csv").open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(asdict(sent[0]))) if sent else None
        if writer is not None:
            writer.writeheader()
            writer.writerows(asdict(s) for s in sent)
    shown = [a.replace(str(Path.home()), "~") for a in (argv or sys.argv[1:])]  # no machine paths in results
    summary = {"command": " ".join(["python -m chariot.bench.autoscale_ramp", *shown]),
               "ramp": asdict(ramp), "cpu": os.cpu_count(), "machine": machine_record(),
               **summarize(sent, looks, args.ttft_slo_ms / 1000.0, ramp)}
    (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    print(json.dumps(summary, indent=1))
    print(plot(sent, looks, out, args.ttft_slo_ms / 1000.0))
    return 0


if __name__ == "__main__":
    sys.exit(main())
