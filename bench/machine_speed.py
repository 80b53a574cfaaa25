"""How fast this machine is right now: a fixed calibration workload timed around benchmark phases.

Why it exists: a shared VM's speed drifts by tens of percent within an hour (a neighbour on the memory
bus, a host that changes clocks), and a side-by-side benchmark that runs one system after the other turns
that drift into a difference between the systems. `chariot bench peer` times the same small workload
before, during (between probes, with the server idle) and after every phase (one system, one variant),
so a reported ratio says how much the machine itself changed between and within the two phases it
compares; /proc/stat's steal time says whether the hypervisor took the cores away meanwhile.

The workload mirrors what a serving iteration spends its time on: a float32 matmul of a prefill chunk's
shape (compute-bound) and a streaming read of a large tensor (memory-bound, as a decode step reading its
weights).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

DRIFT_TOLERANCE = 0.05  # a phase comparison is trusted when the machine changed by at most this much
MATMUL_SHAPE = (512, 1024, 4096)  # rows x K x N: a 512-token chunk through a 1024 -> 4096 projection
READ_BYTES = 256 << 20  # far beyond any last-level cache
REPS = 9


@dataclass(frozen=True)
class Speed:
    """One calibration: medians over `REPS` repetitions."""

    matmul_gflops: float
    read_gbps: float

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
    matmul_s = _median_seconds(lambda: torch.mm(a, b, out=out), reps)
    big = torch.ones(read_bytes // 4)
    read_s = _median_seconds(big.sum, reps)
    return Speed(round(2 * rows * k * n / matmul_s / 1e9, 2), round(read_bytes / read_s / 1e9, 2))


@dataclass(frozen=True)
class CpuTimes:
    """The machine-wide counters of /proc/stat's `cpu` line (clock ticks)."""

    total: int
    steal: int

    @staticmethod
    def parse(text: str) -> CpuTimes:
        for line in text.splitlines():
            parts = line.split()
            if parts and parts[0] == "cpu":
                ticks = [int(x) for x in parts[1:]]
                # user nice system idle iowait irq softirq steal [guest guest_nice]: guests are already in user
                return CpuTimes(sum(ticks[:8]), ticks[7] if len(ticks) > 7 else 0)
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
    and right after it, and the steal share over the phase."""

    before: Speed
    after: Speed
    steal: float | None
    during: tuple[Speed, ...] = ()

    @property
    def samples(self) -> tuple[Speed, ...]:
        return (self.before, *self.during, self.after)

    def mean(self) -> Speed:
        columns = list(zip(*(s.values() for s in self.samples), strict=True))
        return Speed(*(sum(c) / len(c) for c in columns))

    def within(self) -> float:
        """How much the machine changed during the phase: the largest max/min - 1 of a metric over the
        phase's calibrations."""
        columns = zip(*(s.values() for s in self.samples), strict=True)
        return max(max(c) / min(c) - 1.0 for c in columns)

    def to_json(self) -> dict[str, Any]:
        return {"before": asdict(self.before), "during": [asdict(s) for s in self.during], "after": asdict(self.after),
                "steal_share": self.steal, "within_change": round(self.within(), 4)}


def drift(a: PhaseSpeed, b: PhaseSpeed) -> float:
    """How far apart the machine was during two phases: the largest relative difference of their mean
    speeds, or of either phase's before/after, whichever is larger."""
    between = max(abs(r - 1.0) for r in a.mean().ratio(b.mean()).values())
    return max(between, a.within(), b.within())


class PhaseClock:
    """Brackets a phase: `start()` calibrates and reads the CPU counters, `mark()` calibrates between
    the phase's measurements, `stop()` calibrates and reads the counters again."""

    def __init__(self, measure: Callable[[], Speed] = measure_speed,
                 read_times: Callable[[], CpuTimes | None] = CpuTimes.read) -> None:
        self.measure, self.read_times = measure, read_times
        self._before: Speed | None = None
        self._times: CpuTimes | None = None
        self._during: list[Speed] = []

    def start(self) -> Speed:
        self._before = self.measure()
        self._times = self.read_times()
        self._during = []
        return self._before

    def mark(self) -> Speed:
        """One calibration inside the phase (the server idle between two measurements)."""
        if self._before is None:
            raise RuntimeError("PhaseClock.mark() outside a phase (call start() first)")
        speed = self.measure()
        self._during.append(speed)
        return speed

    def stop(self) -> PhaseSpeed:
        if self._before is None:
            raise RuntimeError("PhaseClock.stop() without start()")
        times = self.read_times()
        phase = PhaseSpeed(self._before, self.measure(), steal_share(self._times, times), tuple(self._during))
        self._before, self._during = None, []
        return phase
