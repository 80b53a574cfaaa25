"""Open-loop load generator: replays a Poisson trace against a running router's gRPC front.

Why through the router: capacity is what clients feel (docs/architecture.md §9), so every request takes the
public path (router admission, forwarding, streaming) and every time is taken on the client.
Open loop (one task per request, launched at its arrival time whatever the server is doing) is what
makes queueing visible: a closed loop would slow down with the server and hide overload.

Clocks. All times in a `RequestTrace` are seconds on the client's monotonic clock since the run
started. The worker's first-scheduling time is converted to that clock without comparing clocks
across processes or machines: `scheduled = client send time + (timing.first_scheduled -
timing.arrival)`, both worker timestamps from the same worker clock. So scheduling delay is the time
the request waited in the worker's queue; the router's forwarding (sub-millisecond on loopback) is
not in it but is in TTFT, which is measured entirely on the client.

Tokens. A streamed chunk carrying k tokens counts k tokens at its receive time (k − 1 zero gaps).

Giving up. An overloaded probe can take minutes to drain, yet its verdict is often certain early:
`GiveUp` aborts a run (cancelling every call, which frees the requests' KV blocks) as soon as it
must fail the capacity criterion — a request failed, more than half of the requests are already
known to wait longer than the scheduling-delay limit, or more TBT gaps than P99 allows already
exceeded the SLO. Every such verdict is exact for the given limits (never a guess).
"""

from __future__ import annotations

import asyncio
import itertools
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import grpc

from chariot.bench.capacity import MAX_SCHEDULING_DELAY_S, RequestTrace, RunMetrics
from chariot.bench.traces import TraceRequest, TraceSpec, fold_symbols, make_trace
from chariot.contracts.proto_codec import finish_reason_from_proto, request_to_proto
from chariot.contracts.requests import FinishReason
from chariot.contracts.sampling_params import SamplingParams
from chariot.proto.chariot.v1 import generation_pb2_grpc

LOW_TOKEN_ID = 16  # prompts avoid the low ids, where locally made tokenizers keep their special tokens
MONITOR_INTERVAL_S = 0.2
DEFAULT_DRAIN_S = 180.0  # how long a run may go on after its last arrival before it is cut off


@dataclass
class _Live:
    """The mutable record of one request while the run is going on."""

    planned: float
    max_tokens: int
    prompt_tokens: int
    arrival: float | None = None
    scheduled: float | None = None
    token_times: list[float] = field(default_factory=list)
    done: bool = False
    error: str | None = None

    def trace(self) -> RequestTrace:
        ok = self.done and self.error is None and self.arrival is not None
        return RequestTrace(arrival=self.arrival if self.arrival is not None else self.planned,
                            scheduled=self.scheduled, token_times=tuple(self.token_times),
                            prompt_tokens=self.prompt_tokens, ok=ok)


@dataclass(frozen=True)
class GiveUp:
    """Limits under which a run stops early because it cannot meet them any more (None: not checked)."""

    tbt_slo_s: float | None = None
    max_delay_s: float | None = MAX_SCHEDULING_DELAY_S

    def reason(self, lives: Sequence[_Live], now: float) -> str | None:
        """Why the run is certain to fail these limits, or None while it may still pass."""
        errors = [live.error for live in lives if live.error is not None]
        if errors:
            return f"a request failed ({errors[0]})"
        if self.max_delay_s is not None and 2 * _late(lives, now, self.max_delay_s) > len(lives):
            return f"median scheduling delay > {self.max_delay_s:g} s"
        if self.tbt_slo_s is not None and _slow_gaps(lives, now, self.tbt_slo_s) > _p99_allowance(lives):
            return f"P99 TBT > {self.tbt_slo_s * 1e3:g} ms"
        return None


def _late(lives: Sequence[_Live], now: float, limit: float) -> int:
    """Requests whose scheduling delay is known to exceed `limit` (scheduled late, or still waiting)."""
    n = 0
    for live in lives:
        if live.arrival is None:
            continue
        when = live.scheduled if live.scheduled is not None else now
        n += when - live.arrival > limit
    return n


def _slow_gaps(lives: Sequence[_Live], now: float, slo: float) -> int:
    """TBT gaps known to exceed `slo`: observed ones, plus a still-open gap already longer than it."""
    n = 0
    for live in lives:
        t = live.token_times
        n += sum(b - a > slo for a, b in itertools.pairwise(t))
        if t and not live.done and len(t) < live.max_tokens and now - t[-1] > slo:
            n += 1
    return n


def _p99_allowance(lives: Sequence[_Live]) -> int:
    """How many gaps may exceed the SLO with the nearest-rank P99 (`capacity.percentile`) still within it.

    Requests ignore EOS, so the run's gap count is known in advance: Σ (max_tokens − 1)."""
    gaps = sum(max(0, live.max_tokens - 1) for live in lives)
    rank = max(1, -(-gaps * 99 // 100))  # the same integer nearest rank as `percentile(…, 99)`
    return gaps - rank if gaps else 0


@dataclass(frozen=True)
class DriverResult:
    """One run: the summary the capacity search uses, the raw per-request traces, and how it ended."""

    metrics: RunMetrics
    traces: tuple[RequestTrace, ...]
    requests: tuple[TraceRequest, ...]
    wall_s: float
    gave_up: str | None = None  # why the run was cut short, None if it ran to completion
    errors: tuple[str, ...] = ()  # the distinct errors of failed requests (shed, unavailable, cut short)


def random_prompt(rng: random.Random, length: int, vocab_size: int) -> list[int]:
    """`length` random token ids (no special tokens): the model's output does not matter, its cost does."""
    return [rng.randrange(LOW_TOKEN_ID, vocab_size) for _ in range(length)]


def prompt_ids(rng: random.Random, r: TraceRequest, vocab_size: int) -> list[int]:
    """The request's prompt: the trace's own contents folded into the vocabulary where it has them
    (shared prefixes stay shared), else random tokens of its length."""
    if r.prompt_ids is not None:
        return fold_symbols(r.prompt_ids, vocab_size, LOW_TOKEN_ID)
    return random_prompt(rng, r.prompt_len, vocab_size)


def trace_requests(spec: TraceSpec, qps: float, num_requests: int, seed: int = 0, scale: float = 1.0,
                   max_len: int | None = None) -> list[TraceRequest]:
    """The arrivals and lengths of one run (deterministic per seed)."""
    return make_trace(spec, num_requests, qps, seed=seed, scale=scale, max_len=max_len)


async def run_requests(
    target: str,
    requests: Sequence[TraceRequest],
    vocab_size: int,
    *,
    qps: float,
    seed: int = 0,
    model: str = "",
    give_up: GiveUp | None = None,
    drain_s: float = DEFAULT_DRAIN_S,
    on_done: Callable[[], None] | None = None,
) -> DriverResult:
    """Send every request at its arrival time (streaming, greedy, ignore_eos, max_tokens = its decode
    length) and collect the client-side timelines. Shed (RESOURCE_EXHAUSTED) or failed calls count as
    failed; so do calls still running `drain_s` after the last arrival, or when `give_up` fires."""
    rng = random.Random(seed + 1)
    protos = [_request(rng, r, vocab_size, model) for r in requests]
    lives = [_Live(r.arrival_s, r.decode_len, r.prompt_len) for r in requests]
    t0 = time.perf_counter()

    def clock() -> float:
        return time.perf_counter() - t0

    async with grpc.aio.insecure_channel(target) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        tasks = [asyncio.create_task(_one(stub, proto, live, clock, on_done))
                 for proto, live in zip(protos, lives, strict=True)]
        deadline = (requests[-1].arrival_s if requests else 0.0) + drain_s
        reason = await _monitor(tasks, lives, clock, give_up, deadline)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    wall = clock()
    traces = tuple(live.trace() for live in lives)
    errors = tuple(dict.fromkeys(live.error for live in lives if live.error is not None))
    return DriverResult(_metrics(qps, traces, wall, cut_short=reason is not None), traces, tuple(requests), wall,
                        reason, errors)


def _metrics(qps: float, traces: Sequence[RequestTrace], wall: float, cut_short: bool) -> RunMetrics:
    """The run's summary. When it was cut short, latencies also cover what the unfinished requests
    had received (their stalls are why it was cut), and every unfinished request counts as failed."""
    if not cut_short:
        return RunMetrics.from_traces(qps, traces, wall)
    observed = [replace(t, ok=True) if t.token_times else t for t in traces]
    failed = sum(not t.ok for t in traces)
    return replace(RunMetrics.from_traces(qps, observed, wall), failed=failed, extra={"gave_up": 1.0})


def _request(rng: random.Random, r: TraceRequest, vocab_size: int, model: str) -> Any:
    params = SamplingParams(max_tokens=r.decode_len, temperature=0.0, ignore_eos=True)
    return request_to_proto(prompt_ids(rng, r, vocab_size), params, model=model)


async def _monitor(tasks: list[asyncio.Task[None]], lives: Sequence[_Live], clock: Callable[[], float],
                   give_up: GiveUp | None, deadline: float) -> str | None:
    """Wait for every task; the reason if the run had to be cut short."""
    while not all(task.done() for task in tasks):
        await asyncio.wait(tasks, timeout=MONITOR_INTERVAL_S)
        now = clock()
        reason = give_up.reason(lives, now) if give_up is not None else None
        if reason is None and now > deadline and not all(task.done() for task in tasks):
            reason = f"still running {deadline:.0f} s after the start"
        if reason is not None:
            return reason
    return None


async def _one(stub: generation_pb2_grpc.GenerationStub, proto: Any, live: _Live, clock: Callable[[], float],
               on_done: Callable[[], None] | None) -> None:
    await asyncio.sleep(max(0.0, live.planned - clock()))
    live.arrival = clock()
    try:
        async for resp in stub.Generate(proto):
            _record(live, resp, clock())
    except grpc.aio.AioRpcError as err:
        live.error = f"{err.code().name}: {err.details()}"
    except asyncio.CancelledError:
        live.error = "cancelled (run cut short)"
        raise
    finally:
        live.done = True
        if on_done is not None:
            on_done()


def _record(live: _Live, resp: Any, now: float) -> None:
    t = resp.timing
    if live.scheduled is None and t.first_scheduled > 0 and live.arrival is not None:
        live.scheduled = live.arrival + max(0.0, t.first_scheduled - t.arrival)
    live.token_times.extend([now] * len(resp.token_ids))
    if finish_reason_from_proto(resp.finish_reason) == FinishReason.ERROR:
        live.error = resp.error or "the replica failed the request"


def drive(
    target: str,
    spec: TraceSpec,
    qps: float,
    num_requests: int,
    vocab_size: int,
    *,
    seed: int = 0,
    scale: float = 1.0,
    max_len: int | None = None,
    model: str = "",
    give_up: GiveUp | None = None,
    drain_s: float = DEFAULT_DRAIN_S,
    on_done: Callable[[], None] | None = None,
) -> DriverResult:
    """Replay `num_requests` requests of trace `spec` at `qps` against the router at `target` (blocking)."""
    requests = trace_requests(spec, qps, num_requests, seed=seed, scale=scale, max_len=max_len)
    return asyncio.run(run_requests(target, requests, vocab_size, qps=qps, seed=seed, model=model,
                                    give_up=give_up, drain_s=drain_s, on_done=on_done))
