"""How fast this machine is right now: a fixed calibration workload timed around benchmark phases.

Why it exists: a shared VM's speed drifts by tens of percent within an hour (a neighbour on the memory
bus, a host that changes clocks), and a side-by-side benchmark that runs one system after the other turns
that drift into a difference between the systems. `chariot bench peer` times the same small workload
before, during (between probes, with the server idle) and after every phase (one system, one variant),
so a reported ratio says how much the machine itself changed between and within the two phases it
compares; /proc/stat's steal time says whether the hypervisor took the cores away meanwhile.

A calibration is only as good as the machine is quiet while it runs: a server that has just answered may
still spin (vLLM's workers poll their shared-memory message queue with sched_yield for a second after
each message before they block), so a calibration inside a phase waits `settle_s` first, and each
calibration records how much CPU time other processes took while it ran (`others_busy`); one above
`CONTENTION_LIMIT` is kept in the record but left out of the phase's speed and drift.

The workload mirrors what a serving iteration spends its time on: a float32 matmul of a prefill chunk's
shape (compute-bound) and a streaming read of a large tensor (memory-bound, as a decode step reading its
weights).
"""

from __future__ import annotations

import os
import random
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

DRIFT_TOLERANCE = 0.05  # a phase comparison is trusted when the machine changed by at most this much
CONTENTION_LIMIT = 0.10  # a calibration during which other processes used more of the CPU is left out
MATMUL_SHAPE = (512, 1024, 4096)  # rows x K x N: a 512-token chunk through a 1024 -> 4096 projection
READ_BYTES = 256 << 20  # far beyond any last-level cache
REPS = 9


@dataclass(frozen=True)
class Speed:
    """One calibration: medians over `REPS` repetitions, and the share of the machine's CPU time that
    other processes used meanwhile (None: unknown, not Linux)."""

    matmul_gflops: float
    read_gbps: float
    others_busy: float | None = None

    @property
    def contended(self) -> bool:
        return self.others_busy is not None and self.others_busy > CONTENTION_LIMIT

    def ratio(self, other: Speed) -> Speed:
        """Per metric self / other (> 1: self was the faster machine)."""
        return Speed(self.matmul_gflops / other.matmul_gflops, self.read_gbps / other.read_gbps)

    def values(self) -> tuple[float, float]:
        return self.matmul_gflops, self.read_gbps


def _median_seconds(work: Callable[[], object], reps: int) -> float:
    work()  # first touch, thread-pool start
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        work()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure_speed(reps: int = REPS, shape: tuple[int, int, int] = MATMUL_SHAPE,
                  read_bytes: int = READ_BYTES) -> Speed:
    """Time the calibration workload on every core torch uses (about a second)."""
    import torch

    rows, k, n = shape
    gen = torch.Generator().manual_seed(0)
    a, b = torch.randn(rows, k, generator=gen), torch.randn(k, n, generator=gen)
    out = torch.empty(rows, n)
    big = torch.ones(read_bytes // 4)
    machine, own = CpuTimes.read(), time.process_time()
    matmul_s = _median_seconds(lambda: torch.mm(a, b, out=out), reps)
    read_s = _median_seconds(big.sum, reps)
    others = others_busy(machine, CpuTimes.read(), time.process_time() - own)
    return Speed(round(2 * rows * k * n / matmul_s / 1e9, 2), round(read_bytes / read_s / 1e9, 2), others)


def others_busy(start: CpuTimes | None, end: CpuTimes | None, own_cpu_s: float,
                ticks_per_s: float = float(os.sysconf("SC_CLK_TCK"))) -> float | None:
    """The share of the machine's CPU time between two readings that went to processes other than this
    one (this one used `own_cpu_s` of CPU time, every thread counted)."""
    if start is None or end is None or end.total <= start.total:
        return None
    others_s = (end.busy - start.busy) / ticks_per_s - own_cpu_s
    return round(min(max(others_s / ((end.total - start.total) / ticks_per_s), 0.0), 1.0), 4)


@dataclass(frozen=True)
class CpuTimes:
    """The machine-wide counters of /proc/stat's `cpu` line (clock ticks)."""

    total: int
    steal: int
    busy: int = 0  # neither idle nor waiting for I/O (steal included: not ours to use either)

    @staticmethod
    def parse(text: str) -> CpuTimes:
        for line in text.splitlines():
            parts = line.split()
            if parts and parts[0] == "cpu":
                ticks = [int(x) for x in parts[1:]]
                # user nice system idle iowait irq softirq steal [guest guest_nice]: guests are already in user
                total = sum(ticks[:8])
                return CpuTimes(total, ticks[7] if len(ticks) > 7 else 0, total - ticks[3] - ticks[4])
        raise ValueError("no aggregate `cpu` line in /proc/stat")

    @staticmethod
    def read(path: Path = Path("/proc/stat")) -> CpuTimes | None:
        try:
            return CpuTimes.parse(path.read_text())
        except (OSError, ValueError):
            return None  # not Linux: no steal record


def steal_share(start: CpuTimes | None, end: CpuTimes | None) -> float | None:
    """The share of CPU time the hypervisor gave to others between two readings."""
    if start is None or end is None or end.total <= start.total:
        return None
    return round((end.steal - start.steal) / (end.total - start.total), 4)


@dataclass(frozen=True)
class PhaseSpeed:
    """The machine around one phase: calibrations right before it, between its measurements (`during`)
    and right after it, and the steal share over the phase. Contended calibrations (see
    `CONTENTION_LIMIT`) do not count while any other does."""

    before: Speed
    after: Speed
    steal: float | None
    during: tuple[Speed, ...] = ()

    @property
    def calibrations(self) -> tuple[Speed, ...]:
        """Every calibration of the phase, in time order."""
        return (self.before, *self.during, self.after)

    @property
    def samples(self) -> tuple[Speed, ...]:
        """The calibrations that count: the uncontended ones, or all when none is."""
        return tuple(s for s in self.calibrations if not s.contended) or self.calibrations

    def mean(self) -> Speed:
        columns = list(zip(*(s.values() for s in self.samples), strict=True))
        return Speed(*(sum(c) / len(c) for c in columns))

    @property
    def leading(self) -> tuple[Speed, ...]:
        """The calibrations right before the phase's measurements, every one but the closing one (which
        systems measured in one phase share): the uncontended ones, or all when none is."""
        own = (self.before, *self.during)
        return tuple(s for s in own if not s.contended) or own

    def median(self) -> Speed:
        """Per metric, the median of the `leading` calibrations: a calibration that lands on a
        sub-second slow spell moves it less than the mean (a probe of tens of seconds averages such a
        spell out)."""
        return median_speed(self.leading)

    def within(self) -> float:
        """How much the machine changed during the phase: the largest max/min - 1 of a metric over the
        phase's calibrations."""
        columns = zip(*(s.values() for s in self.samples), strict=True)
        return max(spread(c) for c in columns)

    def to_json(self) -> dict[str, Any]:
        return {"before": asdict(self.before), "during": [asdict(s) for s in self.during], "after": asdict(self.after),
                "steal_share": self.steal, "contended": sum(s.contended for s in self.calibrations),
                "counted": len(self.samples), "within_change": round(self.within(), 4)}

    @staticmethod
    def from_json(raw: Mapping[str, Any]) -> PhaseSpeed:
        """The phase `to_json` wrote (its derived fields are recomputed, not read)."""
        return PhaseSpeed(Speed(**raw["before"]), Speed(**raw["after"]), raw.get("steal_share"),
                          tuple(Speed(**s) for s in raw.get("during", ())))


def median_speed(speeds: Sequence[Speed]) -> Speed:
    """Per metric, the median of these calibrations."""
    return Speed(*(statistics.median(c) for c in zip(*(s.values() for s in speeds), strict=True)))


def spread(values: Sequence[float]) -> float:
    """max/min - 1: how far apart the slowest and the fastest of a metric's calibrations are."""
    return max(values) / min(values) - 1.0


def drift(a: PhaseSpeed, b: PhaseSpeed) -> float:
    """How far apart the machine was during two phases: the largest relative difference of their mean
    speeds, or the spread of either phase's calibrations, whichever is larger."""
    between = max(abs(r - 1.0) for r in a.mean().ratio(b.mean()).values())
    return max(between, a.within(), b.within())


def interleaved_drift(a: PhaseSpeed, b: PhaseSpeed) -> float:
    """How far apart the machine was for two systems whose measurements interleaved in one span: the
    largest relative difference of the medians of the calibrations right before each system's
    measurements (`PhaseSpeed.median`; the closing one, which both share, left out). A change within
    the span is not counted: both systems' measurements alternated through it."""
    return _median_drift(a.leading, b.leading)


CHANCE_DRAWS = 2000  # random splits per interleaved comparison (a share known to about ±1 %)


@dataclass(frozen=True)
class DriftChance:
    """What `interleaved_drift` would read if the same calibrations had fallen to the two systems at
    random (each system keeping its count): `beyond_tolerance`, the share of such splits whose drift
    is above `DRIFT_TOLERANCE` (how often the check flags a search on this machine's noise alone);
    `at_least_observed`, the share whose drift is at least the one measured (a permutation p-value: a
    small one says the systems' calibrations differ by more than the machine's noise gives)."""

    beyond_tolerance: float
    at_least_observed: float
    draws: int


def drift_chance(a: PhaseSpeed, b: PhaseSpeed, draws: int = CHANCE_DRAWS, seed: int = 0) -> DriftChance:
    """The drift of random splits of two systems' leading calibrations (see `DriftChance`); seeded, so
    a record reads the same every time."""
    rng = random.Random(seed)
    pooled, n = [*a.leading, *b.leading], len(a.leading)
    observed = interleaved_drift(a, b)
    beyond = at_least = 0
    for _ in range(draws):
        rng.shuffle(pooled)
        d = _median_drift(pooled[:n], pooled[n:])
        beyond += d > DRIFT_TOLERANCE
        at_least += d >= observed - 1e-12
    return DriftChance(round(beyond / draws, 3), round(at_least / draws, 3), draws)


def _median_drift(a: Sequence[Speed], b: Sequence[Speed]) -> float:
    return max(abs(r - 1.0) for r in median_speed(a).ratio(median_speed(b)).values())


class PhaseClock:
    """Brackets a phase: `start()` calibrates and reads the CPU counters, `mark()` calibrates between
    the phase's measurements, `stop()` calibrates and reads the counters again.

    When several systems' measurements interleave in one phase, each calls `mark(track)` with its own
    track and `stop_tracks()` gives each its own `PhaseSpeed`."""

    def __init__(self, measure: Callable[[], Speed] = measure_speed,
                 read_times: Callable[[], CpuTimes | None] = CpuTimes.read, settle_s: float = 0.0) -> None:
        self.measure, self.read_times, self.settle_s = measure, read_times, settle_s
        self._before: Speed | None = None
        self._times: CpuTimes | None = None
        self._during: dict[str, list[Speed]] = {}

    def start(self) -> Speed:
        self._before = self.measure()
        self._times = self.read_times()
        self._during = {}
        return self._before

    def mark(self, track: str = "") -> Speed:
        """One calibration inside the phase, between two measurements, `settle_s` after the last one
        ended (the server up and idle: contended if it still spins)."""
        if self._before is None:
            raise RuntimeError("PhaseClock.mark() outside a phase (call start() first)")
        time.sleep(self.settle_s)
        speed = self.measure()
        self._during.setdefault(track, []).append(speed)
        return speed

    def stop(self) -> PhaseSpeed:
        return self.stop_tracks([""])[""]

    def stop_tracks(self, tracks: Sequence[str]) -> dict[str, PhaseSpeed]:
        """Calibrate once more and give each track its phase: the first track's starts with the phase's
        start, every other track's with its own first mark (the calibration right before its first
        measurement); each ends with this calibration, the steal share is the phase's."""
        if self._before is None:
            raise RuntimeError("PhaseClock.stop() without start()")
        times = self.read_times()
        after, steal = self.measure(), steal_share(self._times, times)
        phases = {}
        for k, track in enumerate(tracks):
            marks = self._during.get(track, [])
            if k > 0 and not marks:
                raise RuntimeError(f"PhaseClock track {track!r} has no calibration of its own")
            first, rest = (self._before, marks) if k == 0 else (marks[0], marks[1:])
            phases[track] = PhaseSpeed(first, after, steal, tuple(rest))
        self._before, self._during = None, {}
        return phases
