"""Capacity under SLO (Sarathi-Serve §5.1, docs/architecture.md §9): latency metrics of one load level and the
binary search for the highest request rate that meets the SLO.

`RunMetrics` is what any load generator (the real router driver or the simulator) reports for one
QPS; `search_capacity` only sees a function QPS → RunMetrics, so the same search runs against real
servers, the simulator, or a synthetic latency model in tests.
"""

from __future__ import annotations

import itertools
import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

MAX_SCHEDULING_DELAY_S = 2.0


@dataclass(frozen=True)
class RequestTrace:
    """Client-side timeline of one request: arrival, the worker's first scheduling, token times."""

    arrival: float
    scheduled: float | None
    token_times: tuple[float, ...]
    prompt_tokens: int = 0
    ok: bool = True
    cached_tokens: int = 0  # prompt tokens the replica served from its prefix cache

    @property
    def ttft(self) -> float | None:
        return self.token_times[0] - self.arrival if self.token_times else None

    @property
    def tbt(self) -> list[float]:
        t = self.token_times
        return [b - a for a, b in itertools.pairwise(t)]

    def to_json(self) -> dict[str, Any]:
        """The traces.json form of a capacity run (times rounded to 0.1 ms)."""
        return {"arrival": round(self.arrival, 4),
                "scheduled": None if self.scheduled is None else round(self.scheduled, 4),
                "prompt_tokens": self.prompt_tokens, "cached_tokens": self.cached_tokens, "ok": self.ok,
                "token_times": [round(x, 4) for x in self.token_times]}

    @classmethod
    def from_json(cls, raw: Mapping[str, Any]) -> RequestTrace:
        return cls(arrival=raw["arrival"], scheduled=raw["scheduled"], token_times=tuple(raw["token_times"]),
                   prompt_tokens=raw["prompt_tokens"], ok=raw["ok"], cached_tokens=raw.get("cached_tokens", 0))


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (q in [0, 100]); NaN for no values."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    rank = max(1, -(-len(ordered) * q // 100))
    return ordered[int(rank) - 1]


@dataclass(frozen=True)
class RunMetrics:
    """Latency summary of one load level (seconds)."""

    qps: float
    requests: int
    failed: int
    p50_ttft: float
    p90_ttft: float
    p50_tbt: float
    p99_tbt: float
    median_scheduling_delay: float
    throughput_tokens_per_s: float
    extra: dict[str, float] = field(default_factory=dict)

    def meets(self, tbt_slo_s: float, max_delay_s: float = MAX_SCHEDULING_DELAY_S) -> bool:
        """The paper's capacity criterion: P99 TBT within the SLO and median scheduling delay ≤ 2 s."""
        return self.failed == 0 and self.p99_tbt <= tbt_slo_s and self.median_scheduling_delay <= max_delay_s

    @classmethod
    def from_traces(cls, qps: float, traces: Sequence[RequestTrace], duration_s: float) -> RunMetrics:
        done = [t for t in traces if t.ok and t.token_times]
        ttfts = [t.ttft for t in done if t.ttft is not None]
        tbts = [g for t in done for g in t.tbt]
        delays = [t.scheduled - t.arrival for t in done if t.scheduled is not None]
        tokens = sum(len(t.token_times) for t in done)
        return cls(
            qps=qps, requests=len(traces), failed=len(traces) - len(done),
            p50_ttft=percentile(ttfts, 50), p90_ttft=percentile(ttfts, 90),
            p50_tbt=percentile(tbts, 50), p99_tbt=percentile(tbts, 99),
            median_scheduling_delay=statistics.median(delays) if delays else float("nan"),
            throughput_tokens_per_s=tokens / duration_s if duration_s > 0 else 0.0,
        )


@dataclass(frozen=True)
class CapacityResult:
    capacity_qps: float  # highest QPS that met the SLO (0 if none did)
    probes: tuple[RunMetrics, ...]  # every load level tried, in order


def search_capacity(
    evaluate: Callable[[float], RunMetrics],
    tbt_slo_s: float,
    low: float,
    high: float,
    tolerance: float = 0.05,
    max_probes: int = 12,
    descend: bool = False,
) -> CapacityResult:
    """Binary search for the highest QPS in [low, high] whose run meets the SLO.

    Assumes latency grows with load (monotone pass → fail). `high` is doubled while it still passes
    (within `max_probes`); the search stops when the bracket is narrower than `tolerance` × its top.
    A failing `low` ends the search unless `descend`: then `low` is halved until a probe passes, so a
    system under the floor is searched with as many probes as one above it.
    """
    if not 0 < low < high:
        raise ValueError(f"need 0 < low < high, got low={low}, high={high}")
    probes: list[RunMetrics] = []

    def ok(qps: float) -> bool:
        m = evaluate(qps)
        probes.append(m)
        return m.meets(tbt_slo_s)

    passed = ok(low)
    high_failed = not passed  # a descent starts under a probe that failed: no doubling up
    if not passed and not descend:
        return CapacityResult(0.0, tuple(probes))
    while not passed and len(probes) < max_probes:
        low, high = low / 2, low
        passed = ok(low)
    if not passed:
        return CapacityResult(0.0, tuple(probes))
    while not high_failed and len(probes) < max_probes and ok(high):
        low, high = high, high * 2
    while len(probes) < max_probes and high - low > tolerance * high:
        mid = (low + high) / 2
        if ok(mid):
            low = mid
        else:
            high = mid
    return CapacityResult(low, tuple(probes))
