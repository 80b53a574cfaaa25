"""Stalls of the engine loop, reported as they happen, with what they were made of.

Why: a client that sees a gap of a second between two tokens cannot tell where it came from — a
slow engine step, the engine loop busy with something else while requests waited, a garbage
collection, or the serving path in front of the engine. The worker can tell the first three apart,
so it says so in its log: a step that took `SLOW_STEP_FACTOR`× what the step-cost line predicts for
its batch (and at least `MIN_STALL_S`; with no prediction, as past the largest batch the line was
fitted to, `SLOW_STEP_FACTOR`× `MIN_STALL_S`), or a loop turn that spent `MIN_STALL_S` outside the step
with work queued, is a stall. The log line gives its parts (schedule, prepare, execute, postprocess;
or receive and send), the batch, the collector's pause inside it and, for a step, the process's CPU
time over it: about the threads' count times the wall when the step computed all along (the work or
the machine was slow), far less when it waited off the CPU (the host descheduled the VM, another
process had the cores, a device or a peer stage was late). At most one line per
`REPORT_INTERVAL_S`, counting the stalls it did not print, so a slow machine does not flood the log.
No stall logged while a client saw one points at the serving path (router, front, network).
"""

from __future__ import annotations

import gc
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

log = logging.getLogger(__name__)

SLOW_STEP_FACTOR = 3.0  # a step this many times its fitted cost is a stall
MIN_STALL_S = 0.25  # and it must be at least this long (a fast step three times over is no stall)
REPORT_INTERVAL_S = 10.0  # at most one stall line per this many seconds


class GcPauses:
    """Seconds this process has spent in garbage collections since `install()` (`gc.callbacks`)."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter) -> None:
        self.total_s = 0.0
        self._clock = clock
        self._started: float | None = None

    def __call__(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._started = self._clock()
        elif self._started is not None:
            self.total_s += self._clock() - self._started
            self._started = None

    def install(self) -> GcPauses:
        if self not in gc.callbacks:
            gc.callbacks.append(self)
        return self

    def uninstall(self) -> None:
        if self in gc.callbacks:
            gc.callbacks.remove(self)


@dataclass(frozen=True)
class Stall:
    """One stall: a `step` or a `loop` turn, its seconds, what was expected (0: nothing fitted yet),
    the collector's pause inside it, its parts in words, and the process's CPU seconds over it (every
    thread; None: not measured)."""

    kind: str
    seconds: float
    expected_s: float
    gc_s: float
    detail: str
    cpu_s: float | None = None

    def describe(self) -> str:
        expected = f", fitted {self.expected_s * 1e3:.0f} ms" if self.expected_s > 0 else ""
        cpu = ("" if self.cpu_s is None else
               f"; process CPU time {self.cpu_s * 1e3:.0f} ms ({self.cpu_s / self.seconds:.2f} cores busy)")
        return (f"engine {self.kind} stall: {self.seconds * 1e3:.0f} ms{expected}; {self.detail}; "
                f"garbage collection {self.gc_s * 1e3:.0f} ms of it{cpu}")


class StallWatch:
    """Decides what is a stall and logs it, rate-limited."""

    def __init__(self, factor: float = SLOW_STEP_FACTOR, min_s: float = MIN_STALL_S,
                 interval_s: float = REPORT_INTERVAL_S, clock: Callable[[], float] = time.monotonic) -> None:
        self.factor, self.min_s, self.interval_s, self._clock = factor, min_s, interval_s, clock
        self.count = 0
        self._unreported = 0
        self._last_report: float | None = None

    def step(self, seconds: float, expected_s: Callable[[], float], gc_s: float,
             detail: Callable[[], str], cpu_s: float | None = None) -> Stall | None:
        """A step of `seconds` whose batch the step-cost line puts at `expected_s()` (0 when unfitted:
        then only a step of `factor` × `min_s` counts), the process having used `cpu_s` CPU seconds
        meanwhile. The fit and the text are computed only for a step past `min_s`: this runs on every
        step."""
        if seconds < self.min_s:
            return None
        expected = expected_s()
        bar = max(self.min_s, self.factor * expected) if expected > 0 else self.factor * self.min_s
        return self._check("step", seconds, bar, expected, gc_s, detail, cpu_s)

    def loop_gap(self, seconds: float, gc_s: float, detail: Callable[[], str]) -> Stall | None:
        """Time a loop turn spent outside the step while requests were queued."""
        return self._check("loop", seconds, self.min_s, 0.0, gc_s, detail)

    def _check(self, kind: str, seconds: float, bar: float, expected_s: float, gc_s: float,
               detail: Callable[[], str], cpu_s: float | None = None) -> Stall | None:
        if seconds < bar:
            return None
        stall = Stall(kind, seconds, expected_s, gc_s, detail(), cpu_s)
        self.count += 1
        now = self._clock()
        if self._last_report is not None and now - self._last_report < self.interval_s:
            self._unreported += 1
            return stall
        more = f" ({self._unreported} more since the last report)" if self._unreported else ""
        log.warning("%s%s", stall.describe(), more)
        self._last_report, self._unreported = now, 0
        return stall
