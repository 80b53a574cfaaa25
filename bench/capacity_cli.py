"""`chariot bench capacity`: serving capacity under a P99 TBT SLO, per scheduling policy, measured
through the real router (Sarathi-Serve §5.1, docs/architecture.md §9).

For each policy config (`sarathi:128`, `vllm`, …) it starts a fresh stack — stage workers and a
router as local processes, with the same helpers as `chariot up` — and binary-searches the highest
QPS whose Poisson trace meets P99 TBT ≤ SLO and median scheduling delay ≤ 2 s, for every SLO given.

Why it is built this way:
- Router admission must not shed during capacity runs (a shed request is a failure and would make
  the router, not the scheduler, set the capacity), so the router gets an hour of TTFT SLO and
  practically unbounded queues.
- Probes are memoised per load: one run at a QPS answers every SLO, so the relaxed-SLO search starts
  from the strict capacity and re-uses every probe it revisits. Every probe replays the same seeded
  trace (the same lengths; arrivals scaled by 1/QPS), so probes differ only in load.
- A probe stops as soon as its verdict is certain under the loosest SLO (see `driver.GiveUp`), and
  the next probe starts only once the worker is idle again.
- Results are rewritten after each policy, so a long run that is interrupted keeps what it measured.

    chariot bench capacity --model models/100m --quick
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import json
import math
import os
import platform
import random
import re
import shlex
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import grpc
from tqdm.auto import tqdm

from chariot.bench.capacity import RunMetrics, search_capacity
from chariot.bench.driver import DEFAULT_DRAIN_S, DriverResult, GiveUp, drive, random_prompt
from chariot.bench.peer import add_peer_parser
from chariot.bench.traces import TRACES, TraceSpec
from chariot.contracts.commands import build_parser, run
from chariot.contracts.errors import ConfigError
from chariot.contracts.policies import POLICIES
from chariot.contracts.proto_codec import request_to_proto
from chariot.contracts.sampling_params import SamplingParams
from chariot.proto.chariot.v1 import generation_pb2 as pb
from chariot.proto.chariot.v1 import generation_pb2_grpc
from chariot.worker.config import EngineConfig, ModelConfig

if TYPE_CHECKING:  # process management and plotting load torch/matplotlib: imported when a run starts
    from chariot.contracts.processes import Child

STACK_READY_TIMEOUT_S = 600.0

NO_SHED_TTFT_MS = 3_600_000.0  # router admission: an hour of TTFT SLO never sheds
NO_SHED_QUEUE = 1_000_000
IDLE_TIMEOUT_S = 120.0
DEFAULT_MAX_LEN = {"chat": 2048, "arxiv": 4096}


@dataclass(frozen=True)
class Defaults:
    """Search knobs; `--quick` swaps the full set for one that finishes in minutes."""

    requests: int
    qps_low: float
    qps_high: float
    tolerance: float
    max_probes: int


FULL = Defaults(requests=48, qps_low=0.25, qps_high=1.0, tolerance=0.1, max_probes=8)
QUICK = Defaults(requests=24, qps_low=0.5, qps_high=1.5, tolerance=0.25, max_probes=3)
# Default probe loads are per chat-like request; an arxiv-like request (≈3× the prompt) costs more.
TRACE_QPS_FACTOR = {"chat": 1.0, "arxiv": 0.4}
DEFAULT_POLICIES = "sarathi:128,vllm,orca,fastertransformer"


# ---- configuration -------------------------------------------------------------------------------
@dataclass(frozen=True)
class PolicyConfig:
    """One column of the comparison: a scheduling policy and, optionally, its token budget."""

    policy: str
    token_budget: int | None = None

    @property
    def label(self) -> str:
        return self.policy if self.token_budget is None else f"{self.policy}:{self.token_budget}"


def parse_policies(text: str) -> list[PolicyConfig]:
    """`sarathi:256,vllm` → configs; a budget is `policy:N`."""
    out = []
    for item in filter(None, (s.strip() for s in text.split(","))):
        name, _, budget = item.partition(":")
        if name not in POLICIES:
            raise ConfigError("policies", f"unknown policy {name!r}; choose from {', '.join(POLICIES)}")
        if budget and not budget.isdigit():
            raise ConfigError("policies", f"token budget of {name!r} must be a positive integer, got {budget!r}")
        out.append(PolicyConfig(name, int(budget) if budget else None))
    if not out:
        raise ConfigError("policies", "must name at least one policy")
    return out


def parse_slos(text: str) -> list[float]:
    """`200,1000` → sorted SLOs in ms (strictest first)."""
    try:
        slos = sorted({float(s) for s in text.split(",") if s.strip()})
    except ValueError as exc:
        raise ConfigError("tbt_slo_ms", f"must be comma-separated numbers, got {text!r}") from exc
    if not slos or slos[0] <= 0:
        raise ConfigError("tbt_slo_ms", f"must be positive numbers, got {text!r}")
    return slos


@dataclass(frozen=True)
class Load:
    """What every probe replays (all but the QPS)."""

    spec: TraceSpec
    requests: int
    scale: float
    max_len: int
    seed: int
    vocab_size: int
    drain_s: float = DEFAULT_DRAIN_S


@dataclass(frozen=True)
class Search:
    slos_ms: tuple[float, ...]
    qps_low: float
    qps_high: float
    tolerance: float
    max_probes: int


# ---- the stack -----------------------------------------------------------------------------------
@dataclass
class Stack:
    """A running router + one replica (its stages), for one policy."""

    children: list[Child]
    router: str  # router gRPC address (what the driver targets)
    worker: str  # stage-0 gRPC address (used only to wait for idleness)
    served: str


@contextlib.contextmanager
def running_stack(config: EngineConfig, served: str = "bench", timeout_s: float = STACK_READY_TIMEOUT_S,
                  ) -> Iterator[Stack]:
    """Start the workers of one replica and a non-shedding router; stop them all on exit."""
    from chariot.contracts.processes import shutdown, spawn, wait_ready
    from chariot.router.launch import ROUTER_READY_PREFIX
    from chariot.worker.pipeline.launcher import start_group

    children: list[Child] = []
    try:
        group, stage0 = start_group(0, config, served)
        children += group
        worker = ready_address(wait_ready(stage0, children, timeout_s))
        router = spawn("router", bench_router_cmd(config.model, served, worker), dict(os.environ),
                       ROUTER_READY_PREFIX)
        children.append(router)
        yield Stack(children, ready_address(wait_ready(router, children, timeout_s)), worker, served)
    finally:
        shutdown(children)


def bench_router_cmd(model: str, served: str, worker: str) -> list[str]:
    """`chariot router` on free ports whose admission control never sheds."""
    from chariot.router.launch import router_command

    return [*router_command(model, served, [f"g0={worker}"], ttft_slo_ms=NO_SHED_TTFT_MS),
            "--max-queue-per-replica", str(NO_SHED_QUEUE)]


def ready_address(ready_line: str, kind: str = "grpc") -> str:
    """The `kind=HOST:PORT` address (grpc, http) a worker's or router's ready line announces."""
    found = re.search(rf"{kind}=(\S+)", ready_line)
    if found is None:
        raise RuntimeError(f"no {kind}= address in ready line {ready_line!r}")
    return found.group(1)


def warm_up(router: str, vocab_size: int, timeout_s: float = 60.0) -> None:
    """Two short requests through the router, retried until it has a load report from the replica."""
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    prompt = random_prompt(random.Random(0), 32, vocab_size)
    deadline = time.monotonic() + timeout_s
    with grpc.insecure_channel(router) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        done = 0
        while done < 2:
            try:
                list(stub.Generate(request_to_proto(prompt, params), timeout=timeout_s))
                done += 1
            except grpc.RpcError as err:
                if err.code() != grpc.StatusCode.UNAVAILABLE or time.monotonic() > deadline:
                    raise
                time.sleep(0.5)


def wait_idle(worker: str, timeout_s: float = IDLE_TIMEOUT_S) -> None:
    """Block until the worker has no running or waiting request (aborted calls drain asynchronously)."""
    deadline = time.monotonic() + timeout_s
    with grpc.insecure_channel(worker) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        while time.monotonic() < deadline:
            stats = stub.Stats(pb.StatsRequest(), timeout=30)
            if stats.num_running == 0 and stats.num_waiting == 0:
                return
            time.sleep(0.2)
    raise RuntimeError(f"worker {worker} still busy {timeout_s:.0f} s after the probe")


# ---- probing -------------------------------------------------------------------------------------
class Prober:
    """`evaluate(qps)` for `search_capacity`, memoised so that the searches under several SLOs share
    probes. A probe gives up early only when it fails even the loosest SLO."""

    def __init__(self, stack: Stack, load: Load, label: str, loosest_slo_s: float) -> None:
        self.stack, self.load, self.label = stack, load, label
        self.give_up = GiveUp(tbt_slo_s=loosest_slo_s)
        self.runs: dict[float, DriverResult] = {}

    def __call__(self, qps: float) -> RunMetrics:
        return self.run(qps).metrics

    def run(self, qps: float) -> DriverResult:
        key = round(qps, 6)
        if key not in self.runs:
            self.runs[key] = self._probe(key)
        return self.runs[key]

    def _probe(self, qps: float) -> DriverResult:
        load = self.load
        with tqdm(total=load.requests, desc=f"  {self.label} @ {qps:.3f} QPS", unit="req", leave=False,
                  position=1, file=sys.stderr, disable=None) as bar:  # None: only on a terminal
            result = drive(self.stack.router, load.spec, qps, load.requests, load.vocab_size, seed=load.seed,
                           scale=load.scale, max_len=load.max_len, give_up=self.give_up, drain_s=load.drain_s,
                           on_done=lambda: bar.update(1))
        wait_idle(self.stack.worker)
        tqdm.write(probe_line(self.label, result), file=sys.stderr)
        return result


def probe_line(label: str, r: DriverResult) -> str:
    m = r.metrics
    end = f"gave up: {r.gave_up}" if r.gave_up else f"{m.throughput_tokens_per_s:.0f} tok/s"
    return (f"{label:>22} {m.qps:7.3f} QPS  P50 TTFT {_ms(m.p50_ttft)}  P99 TBT {_ms(m.p99_tbt)}  "
            f"median delay {m.median_scheduling_delay:6.2f} s  failed {m.failed}/{m.requests}  "
            f"{r.wall_s:5.0f} s  ({end})")


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:7.0f} ms" if math.isfinite(seconds) else "      - ms"


@dataclass
class PolicyResult:
    config: PolicyConfig
    capacity: dict[float, float] = field(default_factory=dict)  # SLO (ms) → QPS
    runs: dict[float, DriverResult] = field(default_factory=dict)  # QPS → probe
    wall_s: float = 0.0


def search_all_slos(prober: Prober, search: Search) -> dict[float, float]:
    """Capacity per SLO, strictest first; a looser SLO's search starts at the stricter capacity."""
    capacity: dict[float, float] = {}
    floor = 0.0
    for slo in search.slos_ms:
        low = floor if floor > 0 else search.qps_low
        high = max(search.qps_high, 2 * low)
        found = search_capacity(prober, slo / 1e3, low, high, search.tolerance, search.max_probes)
        capacity[slo] = floor = found.capacity_qps
    return capacity


def measure_policy(pc: PolicyConfig, engine: EngineConfig, load: Load, search: Search,
                   plot_qps: float | None) -> PolicyResult:
    """Start the stack for one policy, search its capacity under every SLO, stop it."""
    t0 = time.monotonic()
    with running_stack(engine) as stack:
        warm_up(stack.router, load.vocab_size)
        prober = Prober(stack, load, pc.label, max(search.slos_ms) / 1e3)
        capacity = search_all_slos(prober, search)
        if plot_qps is not None:
            prober.run(plot_qps)
    return PolicyResult(pc, capacity, dict(prober.runs), time.monotonic() - t0)


# ---- results -------------------------------------------------------------------------------------
def common_qps(results: Sequence[PolicyResult]) -> float | None:
    """The highest load every policy was probed at (where the CDFs and timelines compare)."""
    shared = set.intersection(*(set(r.runs) for r in results)) if results else set()
    return max(shared) if shared else None


def _finite(x: float) -> float | None:
    return x if math.isfinite(x) else None


def metrics_row(label: str, r: DriverResult, slos_ms: Sequence[float]) -> dict[str, Any]:
    row: dict[str, Any] = {"policy": label, **{k: v for k, v in asdict(r.metrics).items() if k != "extra"}}
    row = {k: _finite(v) if isinstance(v, float) else v for k, v in row.items()}
    row.update(wall_s=round(r.wall_s, 2), gave_up=r.gave_up or "", errors="; ".join(r.errors))
    row.update({f"meets_{slo:g}ms": r.metrics.meets(slo / 1e3) for slo in slos_ms})
    return row


def write_results(out: Path, setup: dict[str, Any], results: Sequence[PolicyResult]) -> None:
    """capacity.json (setup, capacities, every probe), capacity.csv, probes.csv and traces.json."""
    out.mkdir(parents=True, exist_ok=True)
    slos = setup["tbt_slo_ms"]
    policies: list[dict[str, Any]] = [
        {"label": r.config.label, "policy": r.config.policy, "token_budget": r.config.token_budget,
         "capacity_qps": {f"{slo:g}": cap for slo, cap in r.capacity.items()}, "wall_s": round(r.wall_s, 1),
         "probes": [metrics_row(r.config.label, run, slos) for _, run in sorted(r.runs.items())]}
        for r in results]
    doc = {"setup": setup, "common_qps": common_qps(results), "policies": policies}
    (out / "capacity.json").write_text(json.dumps(doc, indent=2) + "\n")
    _write_csv(out / "capacity.csv", [
        {"policy": r.config.label, "trace": setup["trace"], "scale": setup["scale"], "tbt_slo_ms": slo,
         "capacity_qps": cap, "below_range": cap == 0.0} for r in results for slo, cap in r.capacity.items()])
    _write_csv(out / "probes.csv", [row for p in policies for row in p["probes"]])
    traces = {r.config.label: {f"{qps:g}": [t.to_json() for t in run.traces] for qps, run in sorted(r.runs.items())}
              for r in results}
    (out / "traces.json").write_text(json.dumps(traces) + "\n")


def _write_csv(path: Path, rows: Sequence[dict[str, Any]]) -> None:
    if not rows:
        return
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)


def write_plots(out: Path, setup: dict[str, Any], results: Sequence[PolicyResult]) -> list[Path]:
    """capacity.png (as Figure 10), tbt_cdf.png and timelines.png (as Figure 1a) at the common load."""
    from chariot.bench.plots import plot_capacity, plot_tbt_cdf, plot_token_timelines

    title = f"{setup['model_name']}, {setup['trace']} trace ×{setup['scale']:g}"
    paths = [plot_capacity({r.config.label: r.capacity for r in results}, out / "capacity.png", title)]
    qps = round(setup["plot_qps"], 6) if setup.get("plot_qps") else common_qps(results)
    if qps is not None:
        traces = {r.config.label: r.runs[qps].traces for r in results if qps in r.runs}
        strict = min(setup["tbt_slo_ms"])
        paths.append(plot_tbt_cdf(traces, out / "tbt_cdf.png", qps, setup["tbt_slo_ms"]))
        paths.append(plot_token_timelines(traces, out / "timelines.png", stall_s=strict / 1e3, qps=qps))
    return paths


def summary_table(results: Sequence[PolicyResult], slos_ms: Sequence[float], qps_low: float) -> str:
    head = "| policy | " + " | ".join(f"capacity @ P99 TBT ≤ {s:g} ms (QPS)" for s in slos_ms) + " |"
    lines = [head, "|---" + "|---:" * len(slos_ms) + "|"]
    for r in results:
        cells = [f"{r.capacity[s]:.3f}" if r.capacity.get(s) else f"< {qps_low:g}" for s in slos_ms]
        lines.append(f"| {r.config.label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


# ---- command line --------------------------------------------------------------------------------
def add_capacity_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, metavar="DIR", help="model directory (e.g. models/100m)")
    p.add_argument("--trace", choices=sorted(TRACES), default="chat", help="length distribution (default chat)")
    p.add_argument("--scale", type=float, default=0.25, help="multiplies prompt and decode lengths (default 0.25)")
    p.add_argument("--max-len", type=int, default=None,
                   help="cap on prompt + decode tokens, also the workers' --max-model-len "
                        f"(default {DEFAULT_MAX_LEN['chat']} for chat, {DEFAULT_MAX_LEN['arxiv']} for arxiv)")
    p.add_argument("--requests", type=int, default=None,
                   help=f"requests per probe (default {FULL.requests}; --quick {QUICK.requests})")
    p.add_argument("--policies", default=DEFAULT_POLICIES,
                   help=f"comma-separated policy[:token_budget] configs, compared side by side "
                        f"(default {DEFAULT_POLICIES})")
    p.add_argument("--tbt-slo-ms", default="200,1000", help="P99 TBT SLOs, strict first (default 200,1000)")
    p.add_argument("--stages", type=int, default=1, help="pipeline stages per replica (default 1)")
    p.add_argument("--qps-low", type=float, default=None,
                   help=f"lowest probe (default {FULL.qps_low}, --quick {QUICK.qps_low}; ×{TRACE_QPS_FACTOR['arxiv']} "
                        "for arxiv)")
    p.add_argument("--qps-high", type=float, default=None,
                   help=f"first upper probe, doubled while it passes (default {FULL.qps_high}, --quick "
                        f"{QUICK.qps_high}; ×{TRACE_QPS_FACTOR['arxiv']} for arxiv)")
    p.add_argument("--tolerance", type=float, default=None, help=f"stop when the bracket is narrower than this "
                                                                  f"share of its top (default {FULL.tolerance}; "
                                                                  f"--quick {QUICK.tolerance})")
    p.add_argument("--max-probes", type=int, default=None, help=f"probes per SLO search (default {FULL.max_probes}; "
                                                                  f"--quick {QUICK.max_probes})")
    p.add_argument("--quick", action="store_true", help="few requests, loose tolerance (minutes, for `make bench`)")
    p.add_argument("--seed", type=int, default=0, help="trace seed (default 0)")
    p.add_argument("--plot-qps", type=float, default=None,
                   help="load of the TBT CDF and timelines plots (default: the highest load every policy ran)")
    p.add_argument("--kv-cache-tokens", type=int, default=65536, help="KV capacity per replica (default 65536)")
    p.add_argument("--max-batch-size", type=int, default=128)
    p.add_argument("--drain-s", type=float, default=DEFAULT_DRAIN_S,
                   help=f"a probe is cut off this long after its last arrival (default {DEFAULT_DRAIN_S:g})")
    p.add_argument("--out", default=None, metavar="DIR",
                   help="results folder (default bench/results/capacity-<trace>[-quick])")


def add_bench_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register `chariot bench` (subcommand `capacity`) on an `add_subparsers()` object; returns it."""
    p = subparsers.add_parser("bench", help="benchmarks: serving capacity under SLO, routing, the vLLM peer",
                              description="Benchmarks run against real local processes.")
    sub = p.add_subparsers(dest="bench_command", required=True)
    cap = sub.add_parser("capacity", help="capacity (QPS) under P99 TBT SLOs per scheduling policy",
                         description=(__doc__ or "").split("\n\n")[0])
    add_capacity_args(cap)
    cap.set_defaults(handler=run_capacity)
    add_peer_parser(sub)  # `chariot bench peer`: Chariot vs vLLM-CPU (bench/peer.py)
    from chariot.bench.routing_bench import add_routing_parser  # it builds on this module's stack helpers

    add_routing_parser(sub)  # `chariot bench routing`: prefix-aware vs load-only vs round-robin routing
    return p


def run_bench_command(argv: Sequence[str]) -> int:
    """`chariot bench ARGS`: the `chariot` command hands its remaining arguments here when `bench` runs,
    so nothing else it does imports the benchmarks."""
    return run(build_parser("chariot", "", [add_bench_parser]), ["bench", *argv])


def _resolve(args: argparse.Namespace) -> tuple[Load, Search, list[PolicyConfig], Path]:
    d = QUICK if args.quick else FULL
    model = ModelConfig.from_dir(args.model)
    max_len = pick(args.max_len, DEFAULT_MAX_LEN.get(args.trace, 2048))
    load = Load(TRACES[args.trace], pick(args.requests, d.requests), args.scale, max_len, args.seed,
                model.vocab_size, args.drain_s)
    factor = TRACE_QPS_FACTOR.get(args.trace, 1.0)
    search = Search(tuple(parse_slos(args.tbt_slo_ms)), pick(args.qps_low, d.qps_low * factor),
                    pick(args.qps_high, d.qps_high * factor), pick(args.tolerance, d.tolerance),
                    pick(args.max_probes, d.max_probes))
    _validate(load, search)
    out = Path(args.out or f"bench/results/capacity-{args.trace}{'-quick' if args.quick else ''}")
    return load, search, parse_policies(args.policies), out


def pick(value: Any, default: Any) -> Any:
    """The flag's value if it was given, else the (quick or full) default."""
    return default if value is None else value


def _validate(load: Load, search: Search) -> None:
    if load.requests < 1:
        raise ConfigError("requests", f"must be >= 1, got {load.requests}")
    if load.scale <= 0 or load.max_len < 2:
        raise ConfigError("scale", "scale must be > 0 and max_len >= 2")
    if not 0 < search.qps_low < search.qps_high:
        raise ConfigError("qps_low", f"need 0 < qps_low < qps_high, got {search.qps_low}, {search.qps_high}")
    if not 0 < search.tolerance < 1 or search.max_probes < 1:
        raise ConfigError("tolerance", "tolerance must be in (0, 1) and max_probes >= 1")


def engine_config(args: argparse.Namespace, pc: PolicyConfig, max_len: int) -> EngineConfig:
    return EngineConfig(model=str(args.model), policy=pc.policy, token_budget=pc.token_budget,
                        max_batch_size=args.max_batch_size, pipeline_stages=args.stages, max_model_len=max_len,
                        kv_cache_tokens=args.kv_cache_tokens,
                        prefix_caching=False)  # every probe replays the same prompt contents: no free hits


def setup_record(args: argparse.Namespace, load: Load, search: Search) -> dict[str, Any]:
    return {"command": shlex.join([Path(sys.argv[0]).name, *sys.argv[1:]]), "model": str(args.model),
            "model_name": Path(args.model).name,
            "trace": load.spec.name, "scale": load.scale, "max_len": load.max_len, "requests": load.requests,
            "seed": load.seed, "tbt_slo_ms": list(search.slos_ms), "qps_low": search.qps_low,
            "qps_high": search.qps_high, "tolerance": search.tolerance, "max_probes": search.max_probes,
            "stages": args.stages, "quick": args.quick, "plot_qps": args.plot_qps,
            "kv_cache_tokens": args.kv_cache_tokens, "max_batch_size": args.max_batch_size,
            "cpus": os.cpu_count(), "machine": platform.machine(), "started": time.strftime("%Y-%m-%dT%H:%M:%S%z")}


def run_capacity(args: argparse.Namespace) -> int:
    """The `chariot bench capacity` handler: measure every policy, write JSON/CSV/PNGs, print a table."""
    load, search, policies, out = _resolve(args)
    configs = [(pc, engine_config(args, pc, load.max_len)) for pc in policies]  # validate all before running
    setup = setup_record(args, load, search)
    t0 = time.monotonic()
    results: list[PolicyResult] = []
    for pc, engine in tqdm(configs, desc="policies", unit="policy", position=0, file=sys.stderr):
        results.append(measure_policy(pc, engine, load, search, args.plot_qps))
        tqdm.write(f"{pc.label}: capacity " + ", ".join(f"{c:.3f} QPS @ {s:g} ms" for s, c in
                                                        results[-1].capacity.items()), file=sys.stderr)
        setup["wall_s"] = round(time.monotonic() - t0, 1)
        write_results(out, setup, results)
    plots = write_plots(out, setup, results)
    print(summary_table(results, search.slos_ms, search.qps_low))
    print(f"\nwrote {out / 'capacity.json'}, capacity.csv, probes.csv, traces.json, "
          f"{', '.join(p.name for p in plots)} in {setup['wall_s']:.0f} s")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m chariot.bench.capacity_cli",
                                description=(__doc__ or "").split("\n\n")[0])
    add_capacity_args(p)
    try:
        return run_capacity(p.parse_args(argv))
    except ConfigError as exc:
        print(f"capacity: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
