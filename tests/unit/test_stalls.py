"""Engine stalls (`worker/stalls.py`): what counts as one, the rate-limited log line, the collector's
pauses, and a real engine step made slow inside its executor showing up with its parts."""

from __future__ import annotations

import gc
import logging
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from chariot.worker import SamplingParams
from chariot.worker.config import EngineConfig
from chariot.worker.engine import Engine
from chariot.worker.engine_core import EngineCore
from chariot.worker.stalls import GcPauses, StallWatch


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_a_step_is_a_stall_at_three_times_its_fitted_cost_and_never_under_the_floor() -> None:
    watch = StallWatch(factor=3.0, min_s=0.25, clock=Clock())
    fits: list[float] = []  # every fit the watch asked for

    def fitted(seconds: float) -> Callable[[], float]:
        def expected() -> float:
            fits.append(seconds)
            return seconds
        return expected

    assert watch.step(0.29, fitted(0.1), 0.0, str) is None  # under 3 × 100 ms
    assert watch.step(0.31, fitted(0.1), 0.0, str) is not None
    assert watch.step(0.7, fitted(0.0), 0.0, str) is None  # nothing fitted yet: only 3 × the floor counts
    assert watch.step(0.8, fitted(0.0), 0.0, str) is not None
    assert len(fits) == 4
    assert watch.step(0.2, fitted(0.01), 0.0, str) is None  # 20× a 10 ms step, but under the 250 ms floor
    assert len(fits) == 4, "a step under the floor must not pay for the fit"
    assert watch.loop_gap(0.24, 0.0, str) is None and watch.loop_gap(0.26, 0.0, str) is not None
    assert watch.count == 3


def test_stall_lines_are_rate_limited_and_count_what_they_left_out(caplog: pytest.LogCaptureFixture) -> None:
    clock = Clock()
    watch = StallWatch(interval_s=10.0, clock=clock)
    with caplog.at_level(logging.WARNING, logger="chariot.worker.stalls"):
        watch.step(1.3, lambda: 0.4, 0.3, lambda: "512 tokens")
        clock.now = 3.0
        watch.loop_gap(0.5, 0.0, lambda: "sending")
        watch.step(2.0, lambda: 0.4, 0.0, lambda: "400 tokens")
        clock.now = 11.0
        watch.step(1.5, lambda: 0.4, 0.0, lambda: "256 tokens")
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2 and watch.count == 4
    assert lines[0] == "engine step stall: 1300 ms, fitted 400 ms; 512 tokens; garbage collection 300 ms of it"
    assert lines[1].startswith("engine step stall: 1500 ms") and lines[1].endswith("(2 more since the last report)")
    with caplog.at_level(logging.WARNING, logger="chariot.worker.stalls"):
        watch.step(0.9, lambda: 0.1, 0.0, lambda: "1 tokens", cpu_s=1.75)  # held back: 11 s, as the last line
        clock.now = 30.0
        stall = watch.step(0.8, lambda: 0.1, 0.0, lambda: "1 tokens", cpu_s=0.04)
    assert stall is not None and stall.describe().endswith(
        "garbage collection 0 ms of it; process CPU time 40 ms (0.05 cores busy)")
    assert caplog.records[-1].getMessage().endswith("(0.05 cores busy) (1 more since the last report)")


def test_gc_pauses_add_up_the_collectors_time() -> None:
    clock = Clock()
    pauses = GcPauses(clock)
    pauses("start", {})
    clock.now = 0.04
    pauses("stop", {})
    pauses("stop", {})  # a stop without a start (installed mid-collection) adds nothing
    assert pauses.total_s == pytest.approx(0.04)
    real = GcPauses().install()
    try:
        gc.collect()
        assert real.total_s > 0
    finally:
        real.uninstall()
    assert real not in gc.callbacks


def test_a_slow_step_of_a_real_engine_is_logged_with_its_parts(tiny_model_dir: Path,
                                                               caplog: pytest.LogCaptureFixture) -> None:
    """The real engine on the tiny checkpoint; its executor's wait sleeps 0.8 s once (as a device
    or a descheduled thread would), so that step's measured execute time holds the stall."""
    engine = Engine(EngineConfig(model=str(tiny_model_dir), dtype="float32", kv_cache_tokens=2048,
                                 max_model_len=256), progress=False)
    waits = 0
    wait = engine.executor.wait

    def slow_once():  # type: ignore[no-untyped-def]
        nonlocal waits
        waits += 1
        if waits == 10:
            time.sleep(0.8)
        return wait()

    engine.executor.wait = slow_once  # type: ignore[method-assign]
    core = EngineCore(engine)
    try:
        core.add([1, 5, 9, 13], SamplingParams(max_tokens=24, temperature=0.0), "r")
        with caplog.at_level(logging.WARNING, logger="chariot.worker.stalls"):
            while core.has_unfinished:
                core.step()
    finally:
        core.shutdown()
    stalls = [r.getMessage() for r in caplog.records if "execute" in r.getMessage()]
    slow = [line for line in stalls if int(line.split("execute ")[1].split(",")[0]) >= 800]
    assert len(slow) == 1 and core.stalls.count >= 1
    assert slow[0].startswith("engine step stall: ") and "1 tokens (0 prompt, 1 decodes)" in slow[0]
    busy = float(slow[0].split("(")[-1].split(" cores busy")[0])
    assert busy < 0.5, "the step slept off the CPU: its process CPU time is a fraction of its wall"
