"""`chariot bench routing`: what routing by cached prefix buys over routing by load alone and round
robin, on several replicas of one machine, at the same offered loads.

For each trace and each routing mode (`RouterConfig.routing`) it starts a fresh stack — R replicas
with prefix caching on and one router in that mode, the processes `chariot up --replicas R --routing
MODE` runs — and replays the trace at each load of a shared ladder, from the lowest up, until the
first load the mode fails. Per load it reports TTFT p50/p99, TBT p99, the prompt tokens the
replicas computed and those they served from cache. A mode's capacity under a median-TTFT target is
the highest load it served (see below) with its median TTFT within the target, below the first rung
that missed: a bracket up to that rung, or a bound when none or every rung met it.

Why it is built this way:
- The multi-turn trace is replayed closed loop per conversation: a turn is sent its think time after
  the previous turn's answer came back, and its prompt resends the conversation with the model's
  actual answer, as a chat client does. So a replica that served turn k holds turn k+1's whole
  history, answer included, and only routing decides whether the next turn finds it.
- Load is the offered turn rate: conversations start as a Poisson process at `qps / mean turns`.
  A closed loop sends a conversation's turns no faster than it is answered, so the rate actually
  sent (`sent_qps`, recorded per probe) reaches the offered one only when a probe holds many more
  conversations than run at once: use enough `--requests` for the loads asked.
- Every probe uses its own `salt` (see `traces.fold_symbols`), so nothing one probe cached serves a
  later one, while lengths, arrivals and think times stay identical across probes and modes.
- Probes run to completion (a mode's last rung is its first failure, kept whole so the loads all
  modes ran compare in full); only the drain limit cuts a run short.
- A load is served when no request failed, P99 TBT ≤ the SLO and median scheduling delay ≤ 2 s
  (Sarathi-Serve §5.1, as `chariot bench capacity`). A closed loop throttles itself (a slower answer
  delays the next turn), so past saturation TTFT grows more than TBT: capacity is judged against
  several median-TTFT targets, all from the same probes. A mode stops climbing after the first rung
  it does not serve or that misses the loosest target. The router's admission is opened wide so that
  it never sheds (a shed request would make the router, not the routing, decide capacity).

    chariot bench routing --model models/100m --replicas 2
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tqdm.auto import tqdm

from chariot.bench.capacity import MAX_SCHEDULING_DELAY_S, RequestTrace, percentile
from chariot.bench.capacity_cli import (
    NO_SHED_QUEUE,
    NO_SHED_TTFT_MS,
    STACK_READY_TIMEOUT_S,
    ready_address,
    wait_idle,
    warm_up,
)
from chariot.bench.driver import DriverResult, drive
from chariot.bench.peer import parse_cpuinfo
from chariot.bench.traces import TRACES, TraceSpec
from chariot.contracts.errors import ConfigError
from chariot.router.config import ROUTING_MODES
from chariot.worker.config import EngineConfig, ModelConfig

if TYPE_CHECKING:
    from chariot.contracts.processes import Child

DEFAULT_QPS = "0.5,1,1.5,2,3"
DEFAULT_TRACES = "multiturn,chat"
DEFAULT_TTFT_SLOS = "250,500,1000,2000"


@dataclass(frozen=True)
class RoutingRun:
    """Everything a run replays, but the mode and the load."""

    traces: tuple[str, ...]
    modes: tuple[str, ...]
    loads: tuple[float, ...]
    replicas: int
    requests: int
    scale: float
    max_len: int
    seed: int
    tbt_slo_ms: float
    ttft_slos_ms: tuple[float, ...]
    drain_s: float
    threads: int
    think_s: float | None = None  # the multi-turn trace's median think time (None: the trace's own)

    def spec(self, trace: str) -> TraceSpec:
        """The trace to replay, with this run's think time."""
        spec = TRACES[trace]
        if self.think_s is None or spec.multi_turn is None:
            return spec
        return replace(spec, multi_turn=replace(spec.multi_turn, think_s=self.think_s))

    def __post_init__(self) -> None:
        for trace in self.traces:
            if trace not in TRACES:
                raise ConfigError("traces", f"unknown trace {trace!r}; choose from {', '.join(sorted(TRACES))}")
        for mode in self.modes:
            if mode not in ROUTING_MODES:
                raise ConfigError("modes", f"unknown routing mode {mode!r}; choose from {', '.join(ROUTING_MODES)}")
        if not self.traces or not self.modes or not self.loads:
            raise ConfigError("traces", "need at least one trace, one mode and one load")
        if any(q <= 0 for q in self.loads) or list(self.loads) != sorted(set(self.loads)):
            raise ConfigError("qps", f"must be increasing positive loads, got {self.loads}")
        if self.replicas < 1 or self.requests < 1 or self.threads < 1:
            raise ConfigError("replicas", "replicas, requests and threads must be >= 1")
        if self.scale <= 0 or self.max_len < 2 or self.tbt_slo_ms <= 0 or self.drain_s <= 0:
            raise ConfigError("scale", "scale, tbt_slo_ms and drain_s must be > 0 and max_len >= 2")
        if not self.ttft_slos_ms or min(self.ttft_slos_ms) <= 0:
            raise ConfigError("ttft_slo_ms", f"must be positive numbers, got {self.ttft_slos_ms}")
        if self.think_s is not None and self.think_s <= 0:
            raise ConfigError("think_s", f"must be > 0, got {self.think_s}")


# ---- the stack -----------------------------------------------------------------------------------
@dataclass
class Replicas:
    router: str  # the router's gRPC address (what the driver targets)
    metrics: str  # the router's /metrics URL
    workers: list[str]  # each replica's stage-0 gRPC address (to wait for idleness)


@contextlib.contextmanager
def running_replicas(config: EngineConfig, replicas: int, routing: str, threads: int,
                     served: str = "bench") -> Iterator[Replicas]:
    """R replicas and a non-shedding router in `routing` mode, each worker with `threads` torch threads."""
    from chariot.contracts.processes import shutdown, spawn, wait_ready
    from chariot.router.launch import ROUTER_READY_PREFIX, router_command
    from chariot.worker.pipeline.launcher import start_group

    children: list[Child] = []
    saved = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = str(threads)  # the workers' intra-op threads
    try:
        stage0s = []
        for index in range(replicas):
            group, stage0 = start_group(index, config, served)
            children += group
            stage0s.append(stage0)
        workers = [ready_address(wait_ready(s, children, STACK_READY_TIMEOUT_S)) for s in stage0s]
        cmd = [*router_command(config.model, served, [f"g{i}={w}" for i, w in enumerate(workers)],
                               ttft_slo_ms=NO_SHED_TTFT_MS, routing=routing),
               "--max-queue-per-replica", str(NO_SHED_QUEUE)]
        router = spawn("router", cmd, dict(os.environ), ROUTER_READY_PREFIX)
        children.append(router)
        line = wait_ready(router, children, STACK_READY_TIMEOUT_S)
        yield Replicas(ready_address(line), f"http://{ready_address(line, 'http')}/metrics", workers)
    finally:
        if saved is None:
            os.environ.pop("OMP_NUM_THREADS", None)
        else:
            os.environ["OMP_NUM_THREADS"] = saved
        shutdown(children)


def routed_counts(metrics_url: str) -> dict[str, float]:
    """The router's routed-request counter by `replica/reason` (from its Prometheus exposition)."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(metrics_url, timeout=10) as resp:
        text = resp.read().decode()
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "chariot_router_routed_total":
                key = f"{sample.labels.get('replica', '?')}/{sample.labels.get('reason', '?')}"
                out[key] = out.get(key, 0.0) + sample.value
    return out


# ---- one probe -----------------------------------------------------------------------------------
def probe_row(trace: str, mode: str, result: DriverResult, routed: dict[str, float], slo_s: float,
              salt: int) -> dict[str, Any]:
    """One load of one mode: latencies, prefill work, routing, and whether it passed."""
    done = [t for t in result.traces if t.ok and t.token_times]
    ttfts = [t.ttft for t in done if t.ttft is not None]
    tbts = [g for t in done for g in t.tbt]
    delays = [t.scheduled - t.arrival for t in done if t.scheduled is not None]
    prompt = sum(t.prompt_tokens for t in done)
    cached = sum(t.cached_tokens for t in done)
    failed = len(result.traces) - len(done)
    p99_tbt = percentile(tbts, 99)
    delay = statistics.median(delays) if delays else math.nan
    passed = failed == 0 and result.gave_up is None and p99_tbt <= slo_s and delay <= MAX_SCHEDULING_DELAY_S
    sent = sorted(t.arrival for t in result.traces if t.token_times or t.ok)
    sent_qps = (len(sent) - 1) / (sent[-1] - sent[0]) if len(sent) > 1 and sent[-1] > sent[0] else None
    return {"trace": trace, "mode": mode, "qps": result.metrics.qps, "salt": salt, "requests": len(result.traces),
            "sent_qps": None if sent_qps is None else round(sent_qps, 3),
            "failed": failed, "ttft_p50_s": _num(percentile(ttfts, 50)), "ttft_p99_s": _num(percentile(ttfts, 99)),
            "tbt_p50_s": _num(percentile(tbts, 50)), "tbt_p99_s": _num(p99_tbt),
            "median_scheduling_delay_s": _num(delay), "prompt_tokens": prompt, "cached_tokens": cached,
            "prefill_tokens_computed": prompt - cached, "passed": passed, "wall_s": round(result.wall_s, 1),
            "cut_short": result.gave_up or "", "errors": list(result.errors)[:3], "routed": routed}


def _num(x: float) -> float | None:
    return round(x, 4) if math.isfinite(x) else None


def _diff(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    return {k: v - before.get(k, 0.0) for k, v in sorted(after.items()) if v - before.get(k, 0.0) > 0}


class Ladder:
    """Runs one mode's loads in order until the first failure; salts are unique across the run."""

    def __init__(self, run: RoutingRun, spec: TraceSpec, vocab_size: int, salts: Iterator[int]) -> None:
        self.run, self.spec, self.vocab_size, self.salts = run, spec, vocab_size, salts

    def climb(self, mode: str, stack: Replicas) -> tuple[list[dict[str, Any]], dict[str, list[RequestTrace]]]:
        rows: list[dict[str, Any]] = []
        traces: dict[str, list[RequestTrace]] = {}
        for qps in self.run.loads:
            salt = next(self.salts)
            before = routed_counts(stack.metrics)
            with tqdm(total=self.run.requests, desc=f"  {self.spec.name} {mode} @ {qps:g} QPS", unit="req",
                      leave=False, file=sys.stderr, disable=None) as bar:
                result = drive(stack.router, self.spec, qps, self.run.requests, self.vocab_size,
                               seed=self.run.seed, scale=self.run.scale, max_len=self.run.max_len,
                               drain_s=self.run.drain_s, on_done=lambda: bar.update(1), salt=salt,
                               closed_loop=self.spec.multi_turn is not None)
            for worker in stack.workers:
                wait_idle(worker)
            row = probe_row(self.spec.name, mode, result, _diff(routed_counts(stack.metrics), before),
                            self.run.tbt_slo_ms / 1e3, salt)
            rows.append(row)
            traces[f"{qps:g}"] = list(result.traces)
            tqdm.write(probe_line(row), file=sys.stderr)
            if not meets(row, max(self.run.ttft_slos_ms) / 1e3):
                break
        return rows, traces


def _ms(x: float | None) -> str:
    return "–" if x is None else f"{x * 1e3:.0f} ms"


def probe_line(row: dict[str, Any]) -> str:
    share = row["cached_tokens"] / row["prompt_tokens"] if row["prompt_tokens"] else 0.0
    return (f"{row['trace']:>9} {row['mode']:>11} {row['qps']:5.2f} QPS  TTFT p50 {_ms(row['ttft_p50_s'])} "
            f"p99 {_ms(row['ttft_p99_s'])}  TBT p99 {_ms(row['tbt_p99_s'])}  computed {row['prefill_tokens_computed']}"
            f" (cached {share:.0%})  failed {row['failed']}  {'pass' if row['passed'] else 'FAIL'}")


# ---- the run -------------------------------------------------------------------------------------
def meets(row: dict[str, Any], ttft_slo_s: float) -> bool:
    """Served (no failure, P99 TBT and median delay within limits) with median TTFT ≤ the target."""
    return bool(row["passed"]) and row["ttft_p50_s"] is not None and row["ttft_p50_s"] <= ttft_slo_s


def capacity(rows: Sequence[dict[str, Any]], ttft_slo_s: float) -> float:
    """The highest load that met the target before the first rung that did not (0: none did)."""
    best = 0.0
    for row in rows:
        if not meets(row, ttft_slo_s):
            break
        best = row["qps"]
    return best


def comparisons(rows: Sequence[dict[str, Any]], base: str = "load") -> list[dict[str, Any]]:
    """Per trace and load every mode ran, each mode's median and P99 TTFT against `base`'s (base / mode:
    above 1, the mode is faster)."""
    out = []
    keyed = {(r["trace"], r["mode"], r["qps"]): r for r in rows}
    for trace, mode, qps in sorted(keyed):
        ref = keyed.get((trace, base, qps))
        row = keyed[(trace, mode, qps)]
        if ref is None or mode == base:
            continue
        out.append({"trace": trace, "qps": qps, "mode": mode, "against": base,
                    "ttft_p50_ratio": _ratio(ref["ttft_p50_s"], row["ttft_p50_s"]),
                    "ttft_p99_ratio": _ratio(ref["ttft_p99_s"], row["ttft_p99_s"]),
                    "computed_ratio": _ratio(ref["prefill_tokens_computed"], row["prefill_tokens_computed"])})
    return out


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a is not None and b else None


def machine_record() -> dict[str, Any]:
    """The CPU (model, flags, count) and the code (the git commit, when run from a checkout)."""
    cpu = parse_cpuinfo(Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else "")
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                timeout=10, cwd=Path(__file__).parent).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        commit = ""
    return {"cpu_model": cpu.model, "cpu_flags": list(cpu.flags), "logical_cpus": cpu.logical_cpus,
            "machine": platform.machine(), "python": platform.python_version(), "commit": commit or None}


def run_routing(args: argparse.Namespace) -> int:
    """The `chariot bench routing` handler."""
    if args.redraw:
        return redraw(Path(args.redraw), parse_ms(args.ttft_slo_ms) if args.ttft_slo_ms else None)
    if not args.model:
        raise ConfigError("model", "is required (unless --redraw)")
    run = resolve(args)
    model = ModelConfig.from_dir(args.model)
    engine = EngineConfig(model=str(args.model), policy=args.policy, token_budget=args.token_budget,
                          max_model_len=run.max_len, kv_cache_tokens=args.kv_cache_tokens, prefix_caching=True)
    out = Path(args.out)
    setup = {"command": shlex.join([Path(sys.argv[0]).name, *sys.argv[1:]]), "model": str(args.model),
             "policy": args.policy, "token_budget": engine.token_budget, "kv_cache_tokens": args.kv_cache_tokens,
             **vars(run), "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
             **machine_record()}
    salts = iter(range(1, 1 << 20))
    rows: list[dict[str, Any]] = []
    traces: dict[str, Any] = {}
    for trace in tqdm(run.traces, desc="traces", unit="trace", file=sys.stderr):
        ladder = Ladder(run, run.spec(trace), model.vocab_size, salts)
        for mode in run.modes:
            with running_replicas(engine, run.replicas, mode, run.threads) as stack:
                warm_up(stack.router, model.vocab_size)
                mode_rows, mode_traces = ladder.climb(mode, stack)
            rows += mode_rows
            traces[f"{trace}/{mode}"] = {q: [t.to_json() for t in ts] for q, ts in mode_traces.items()}
            write_results(out, setup, rows, traces)
    plots = write_plots(out, rows)
    print(summary(rows))
    print()
    print(capacity_table(capacities(rows, run.ttft_slos_ms), rows))
    print(f"\nwrote {out / 'routing.json'}, traces.json, {', '.join(p.name for p in plots)}")
    return 0


def write_results(out: Path, setup: dict[str, Any], rows: list[dict[str, Any]], traces: dict[str, Any]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    caps = capacities(rows, setup["ttft_slos_ms"])
    doc = {"setup": setup, "capacity_qps": caps, "comparisons": comparisons(rows), "probes": rows}
    (out / "routing.json").write_text(json.dumps(doc, indent=2) + "\n")
    (out / "traces.json").write_text(json.dumps(traces) + "\n")


def capacities(rows: Sequence[dict[str, Any]], ttft_slos_ms: Sequence[float]) -> dict[str, dict[str, float]]:
    """Per `trace/mode`, the capacity under each median-TTFT target (ms, as a string key)."""
    out = {}
    for trace, mode in dict.fromkeys((r["trace"], r["mode"]) for r in rows):
        mine = [r for r in rows if r["trace"] == trace and r["mode"] == mode]
        out[f"{trace}/{mode}"] = {f"{t:g}": capacity(mine, t / 1e3) for t in ttft_slos_ms}
    return out


def capacity_table(caps: dict[str, dict[str, float]], rows: Sequence[dict[str, Any]]) -> str:
    """Markdown: one row per trace/mode, one column per target; `≥ x` when the top rung met it."""
    targets = list(next(iter(caps.values()))) if caps else []
    lines = ["| trace/mode | " + " | ".join(f"median TTFT ≤ {t} ms" for t in targets) + " |",
             "|---" + "|---:" * len(targets) + "|"]
    for key, by_target in caps.items():
        climbed = [r["qps"] for r in rows if f"{r['trace']}/{r['mode']}" == key]
        cells = []
        for t in targets:
            cap = by_target[t]
            above = [q for q in climbed if q > cap]
            cells.append(f"< {climbed[0]:g}" if cap == 0 else f"[{cap:g}, {above[0]:g})" if above else f"≥ {cap:g}")
        lines.append(f"| {key} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def redraw(out: Path, ttft_slos_ms: Sequence[float] | None = None) -> int:
    """Recompute a finished run's capacities, comparisons and plots (e.g. under other TTFT targets)."""
    doc = json.loads((out / "routing.json").read_text())
    setup, rows = doc["setup"], doc["probes"]
    if ttft_slos_ms or "ttft_slos_ms" not in setup:
        setup["ttft_slos_ms"] = list(ttft_slos_ms or parse_ms(DEFAULT_TTFT_SLOS))
    traces = json.loads((out / "traces.json").read_text()) if (out / "traces.json").exists() else {}
    write_results(out, setup, rows, traces)
    write_plots(out, rows)
    print(summary(rows))
    print()
    print(capacity_table(capacities(rows, setup["ttft_slos_ms"]), rows))
    return 0


def summary(rows: Sequence[dict[str, Any]]) -> str:
    lines = ["| trace | mode | QPS | TTFT p50 | TTFT p99 | TBT p99 | prefill computed | cached | served |",
             "|---|---|---:|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        share = r["cached_tokens"] / r["prompt_tokens"] if r["prompt_tokens"] else 0.0
        lines.append(f"| {r['trace']} | {r['mode']} | {r['qps']:g} | {_ms(r['ttft_p50_s'])} | {_ms(r['ttft_p99_s'])} | "
                     f"{_ms(r['tbt_p99_s'])} | {r['prefill_tokens_computed']:,} | {share:.0%} | "
                     f"{'yes' if r['passed'] else 'no'} |")
    return "\n".join(lines)


def write_plots(out: Path, rows: Sequence[dict[str, Any]]) -> list[Path]:
    """routing_<trace>.png: TTFT p50/p99 and prefill tokens computed per load, one line per mode."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    paths = []
    for trace in dict.fromkeys(r["trace"] for r in rows):
        fig = Figure(figsize=(13, 4), layout="constrained")
        axes = fig.subplots(1, 3)
        for mode in dict.fromkeys(r["mode"] for r in rows):
            mine = [r for r in rows if r["trace"] == trace and r["mode"] == mode]
            qps = [r["qps"] for r in mine]
            for ax, key in zip(axes[:2], ("ttft_p50_s", "ttft_p99_s"), strict=True):
                ax.plot(qps, [r[key] if r[key] is not None else math.nan for r in mine], marker="o", label=mode)
            axes[2].plot(qps, [r["prefill_tokens_computed"] for r in mine], marker="o", label=mode)
        loads = [r["qps"] for r in rows if r["trace"] == trace]
        for ax, title in zip(axes, ("median TTFT (s)", "P99 TTFT (s)", "prompt tokens computed"), strict=True):
            ax.set_title(title)
            ax.set_xlabel("offered load (requests/s)")
            if max(loads) >= 4 * min(loads):
                ax.set_xscale("log", base=2)
            ax.grid(alpha=0.3)
        axes[0].set_yscale("log")
        axes[1].set_yscale("log")
        axes[0].legend()
        fig.suptitle(f"routing modes, {trace} trace (each mode climbs the loads until one it does not serve)")
        path = out / f"routing_{trace}.png"
        FigureCanvasAgg(fig)
        fig.savefig(path, dpi=120)
        paths.append(path)
    return paths


# ---- command line --------------------------------------------------------------------------------
def add_routing_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("routing", help="prefix-aware routing vs load-only vs round robin on R local replicas",
                       description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--model", metavar="DIR", help="model directory (e.g. models/100m)")
    p.add_argument("--replicas", type=int, default=2, help="replicas (default 2)")
    p.add_argument("--modes", default=",".join(ROUTING_MODES), help="routing modes to compare (default all)")
    p.add_argument("--traces", default=DEFAULT_TRACES, help=f"traces (default {DEFAULT_TRACES})")
    p.add_argument("--qps", default=DEFAULT_QPS, help=f"increasing loads, each mode climbs them until it fails "
                                                      f"(default {DEFAULT_QPS})")
    p.add_argument("--requests", type=int, default=48, help="requests (turns) per probe (default 48)")
    p.add_argument("--scale", type=float, default=0.25, help="multiplies lengths (default 0.25)")
    p.add_argument("--max-len", type=int, default=2048, help="prompt + decode cap, the workers' max_model_len")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--think-s", type=float, default=None,
                   help="median think time between a conversation's turns (default: the multiturn trace's, 10 s)")
    p.add_argument("--tbt-slo-ms", type=float, default=200.0, help="P99 TBT SLO of the pass check (default 200)")
    p.add_argument("--ttft-slo-ms", default=None,
                   help=f"median-TTFT targets capacity is judged against (default {DEFAULT_TTFT_SLOS})")
    p.add_argument("--drain-s", type=float, default=120.0, help="a probe is cut off this long after its last "
                                                               "planned arrival (default 120)")
    p.add_argument("--threads", type=int, default=None,
                   help="torch threads per replica (default: the cores divided among the replicas)")
    p.add_argument("--policy", default="sarathi", help="scheduling policy of every replica (default sarathi)")
    p.add_argument("--token-budget", type=int, default=None, help="token budget (default: the policy's)")
    p.add_argument("--kv-cache-tokens", type=int, default=32768, help="KV capacity per replica (default 32768)")
    p.add_argument("--out", default="bench/results/routing", metavar="DIR")
    p.add_argument("--redraw", default=None, metavar="DIR",
                   help="only recompute a finished run's capacities, comparisons and plots (with --ttft-slo-ms)")
    p.set_defaults(handler=run_routing)


def parse_ms(text: str) -> tuple[float, ...]:
    try:
        return tuple(sorted({float(x) for x in text.split(",") if x.strip()}))
    except ValueError as exc:
        raise ConfigError("ttft_slo_ms", f"must be comma-separated numbers, got {text!r}") from exc


def resolve(args: argparse.Namespace) -> RoutingRun:
    try:
        loads = tuple(float(q) for q in args.qps.split(",") if q.strip())
    except ValueError as exc:
        raise ConfigError("qps", f"must be comma-separated numbers, got {args.qps!r}") from exc
    threads = args.threads or max(1, (os.cpu_count() or 1) // args.replicas)
    return RoutingRun(traces=tuple(t.strip() for t in args.traces.split(",") if t.strip()),
                      modes=tuple(m.strip() for m in args.modes.split(",") if m.strip()), loads=loads,
                      replicas=args.replicas, requests=args.requests, scale=args.scale, max_len=args.max_len,
                      seed=args.seed, tbt_slo_ms=args.tbt_slo_ms,
                      ttft_slos_ms=parse_ms(args.ttft_slo_ms or DEFAULT_TTFT_SLOS), drain_s=args.drain_s,
                      threads=threads, think_s=args.think_s)
