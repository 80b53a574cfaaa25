"""single_request_steps: the one-request window (a 128-token prompt chunk, then one-decode
iterations) found in an iteration log among loaded iterations, and its median step, on synthetic
records whose steps are known."""

from __future__ import annotations

from chariot.bench.experiments.single_request_steps import single_request_windows


def record(prefill: int, decodes: int, ms: float) -> dict[str, float]:
    return {"prefill": prefill, "decodes": decodes, "forward_ms": ms}


def test_the_idle_request_is_found_and_its_decodes_medianed() -> None:
    loaded = [record(500, 12, 470.0), record(0, 30, 90.0)] * 5
    single = [record(128, 0, 120.0)] + [record(0, 1, 20.0 + (k % 3)) for k in range(255)]
    windows = single_request_windows([*loaded, *single, *loaded])
    assert windows == [{"index": len(loaded), "decodes": 255, "median_ms": 21.0}]


def test_a_short_run_or_a_batched_one_is_not_the_idle_request() -> None:
    short = [record(128, 0, 120.0)] + [record(0, 1, 20.0)] * 40
    beside_others = [record(128, 3, 130.0)] + [record(0, 1, 20.0)] * 300
    assert single_request_windows([*short, record(0, 2, 25.0), *beside_others]) == []


def test_each_search_gives_its_own_window_in_log_order() -> None:
    def run(ms: float) -> list[dict[str, float]]:
        return [record(128, 0, 120.0)] + [record(0, 1, ms)] * 255
    windows = single_request_windows([*run(27.0), record(400, 8, 450.0), *run(26.0)])
    assert [w["median_ms"] for w in windows] == [27.0, 26.0]
