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
    token_ids: list[int] = field(default_factory=list)  # what was sampled (a closed loop's next turn resends it)
    cached_tokens: int = 0  # prompt tokens the replica served from its prefix cache

    def trace(self) -> RequestTrace:
        ok = self.done and self.error is None and self.arrival is not None
        return RequestTrace(arrival=self.arrival if self.arrival is not None else self.planned,
                            scheduled=self.scheduled, token_times=tuple(self.token_times),
                            prompt_tokens=self.prompt_tokens, ok=ok, cached_tokens=self.cached_tokens)


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


def prompt_ids(rng: random.Random, r: TraceRequest, vocab_size: int, salt: int = 0) -> list[int]:
    """The request's prompt: the trace's own contents folded into the vocabulary where it has them
    (shared prefixes stay shared; `salt`: see `fold_symbols`), else random tokens of its length."""
    if r.prompt_ids is not None:
        return fold_symbols(r.prompt_ids, vocab_size, LOW_TOKEN_ID, salt)
    return random_prompt(rng, r.prompt_len, vocab_size)


def conversations(requests: Sequence[TraceRequest]) -> list[list[int]]:
    """Indices into `requests` grouped by session, each group in turn order; a request without a
    session is a conversation of its own."""
    groups: dict[str, list[int]] = {}
    out: list[list[int]] = []
    for i, r in enumerate(requests):
        if r.session is None:
            out.append([i])
        elif r.session in groups:
            groups[r.session].append(i)
        else:
            groups[r.session] = [i]
            out.append(groups[r.session])
    for group in out:
        group.sort(key=lambda i: requests[i].turn)
    return out


def next_turn_prompt(previous: TraceRequest, sent: Sequence[int], answer: Sequence[int], turn: TraceRequest,
                     vocab_size: int, salt: int = 0) -> list[int]:
    """Turn k's prompt when turn k−1 was `sent` and answered `answer`: what was sent, the model's own
    answer, then turn k's new question (its symbols after turn k−1's prompt and answer), as a chat
    client resends a conversation. Same length as the trace's prompt when the answer has the trace's
    length."""
    if previous.prompt_ids is None or turn.prompt_ids is None:
        raise ValueError("a conversation's turns need the trace's prompt contents")
    question = turn.prompt_ids[len(previous.prompt_ids) + previous.decode_len:]
    return [*sent, *answer, *fold_symbols(question, vocab_size, LOW_TOKEN_ID, salt)]


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
    salt: int = 0,
    closed_loop: bool = False,
) -> DriverResult:
    """Send every request (streaming, greedy, ignore_eos, max_tokens = its decode length) and collect
    the client-side timelines. Shed (RESOURCE_EXHAUSTED) or failed calls count as failed; so do calls
    still running `drain_s` after the last planned arrival, or when `give_up` fires.

    Open loop (default): each request at its arrival time. `closed_loop`: a conversation's first turn
    at its arrival time, each later turn its think time (the gap between the two turns' arrivals in
    the trace) after the previous turn's answer has come, its prompt built from what was sent and
    the model's actual answer (`next_turn_prompt`); a failed turn fails the rest of its conversation.
    Requests with a session carry it as `x-session-id` metadata. `salt` makes every prompt differ
    from other salts' (`fold_symbols`; random prompts are drawn from another stream)."""
    rng = random.Random(seed + 1) if salt == 0 else random.Random(f"prompts-{seed}-{salt}")
    prompts = [prompt_ids(rng, r, vocab_size, salt) for r in requests]
    lives = [_Live(r.arrival_s, r.decode_len, r.prompt_len) for r in requests]
    t0 = time.perf_counter()

    def clock() -> float:
        return time.perf_counter() - t0

    send = _Sender(requests, lives, clock, model, on_done)
    groups = conversations(requests) if closed_loop else [[i] for i in range(len(requests))]
    async with grpc.aio.insecure_channel(target) as channel:
        send.stub = generation_pb2_grpc.GenerationStub(channel)
        tasks = [asyncio.create_task(_conversation(send, group, prompts, vocab_size, salt)) for group in groups]
        deadline = (max(r.arrival_s for r in requests) if requests else 0.0) + drain_s
        reason = await _monitor(tasks, lives, clock, give_up, deadline)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    wall = clock()
    traces = tuple(live.trace() for live in lives)
    errors = tuple(dict.fromkeys(live.error for live in lives if live.error is not None))
    return DriverResult(_metrics(qps, traces, wall, cut_short=reason is not None), traces, tuple(requests), wall,
                        reason, errors)


@dataclass
class _Sender:
    """What every request of a run is sent with."""

    requests: Sequence[TraceRequest]
    lives: Sequence[_Live]
    clock: Callable[[], float]
    model: str
    on_done: Callable[[], None] | None
    stub: Any = None


async def _conversation(send: _Sender, group: Sequence[int], prompts: list[list[int]], vocab_size: int,
                        salt: int) -> None:
    """The turns of one conversation in order (one request: just that request at its arrival)."""
    first = group[0]
    await asyncio.sleep(max(0.0, send.lives[first].planned - send.clock()))
    await _one(send, first, prompts[first])
    for prev, cur in itertools.pairwise(group):
        before, live = send.lives[prev], send.lives[cur]
        if before.error is not None:
            live.error, live.done = f"conversation broken ({before.error})", True
            if send.on_done is not None:
                send.on_done()
            continue
        previous, turn = send.requests[prev], send.requests[cur]
        prompts[cur] = next_turn_prompt(previous, prompts[prev], before.token_ids, turn, vocab_size, salt)
        live.planned = send.clock() + (turn.arrival_s - previous.arrival_s)
        await asyncio.sleep(max(0.0, live.planned - send.clock()))
        await _one(send, cur, prompts[cur])


def _metrics(qps: float, traces: Sequence[RequestTrace], wall: float, cut_short: bool) -> RunMetrics:
    """The run's summary. When it was cut short, latencies also cover what the unfinished requests
    had received (their stalls are why it was cut), and every unfinished request counts as failed."""
    if not cut_short:
        return RunMetrics.from_traces(qps, traces, wall)
    observed = [replace(t, ok=True) if t.token_times else t for t in traces]
    failed = sum(not t.ok for t in traces)
    return replace(RunMetrics.from_traces(qps, observed, wall), failed=failed, extra={"gave_up": 1.0})


def _request(prompt: list[int], r: TraceRequest, model: str) -> Any:
    params = SamplingParams(max_tokens=r.decode_len, temperature=0.0, ignore_eos=True)
    return request_to_proto(prompt, params, model=model)


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


async def _one(send: _Sender, index: int, prompt: list[int]) -> None:
    """Send request `index` now and record its stream."""
    request, live = send.requests[index], send.lives[index]
    metadata = (("x-session-id", request.session),) if request.session else ()
    live.arrival = send.clock()
    try:
        async for resp in send.stub.Generate(_request(prompt, request, send.model), metadata=metadata):
            _record(live, resp, send.clock())
    except grpc.aio.AioRpcError as err:
        live.error = f"{err.code().name}: {err.details()}"
    except asyncio.CancelledError:
        live.error = "cancelled (run cut short)"
        raise
    finally:
        live.done = True
        if send.on_done is not None:
            send.on_done()


def _record(live: _Live, resp: Any, now: float) -> None:
    t = resp.timing
    if live.scheduled is None and t.first_scheduled > 0 and live.arrival is not None:
        live.scheduled = live.arrival + max(0.0, t.first_scheduled - t.arrival)
    live.token_times.extend([now] * len(resp.token_ids))
    live.token_ids.extend(resp.token_ids)
    if resp.cached_prompt_tokens:
        live.cached_tokens = int(resp.cached_prompt_tokens)
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
    salt: int = 0,
    closed_loop: bool = False,
) -> DriverResult:
    """Replay `num_requests` requests of trace `spec` at `qps` against the router at `target` (blocking;
    `salt` and `closed_loop`: see `run_requests`)."""
    requests = trace_requests(spec, qps, num_requests, seed=seed, scale=scale, max_len=max_len)
    return asyncio.run(run_requests(target, requests, vocab_size, qps=qps, seed=seed, model=model,
                                    give_up=give_up, drain_s=drain_s, on_done=on_done, salt=salt,
                                    closed_loop=closed_loop))
