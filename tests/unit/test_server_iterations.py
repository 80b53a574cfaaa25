"""Per-probe iteration records of both peers (`bench/server_iterations.py`). Chariot's come from a real
engine's iteration log; vLLM is not installed by the test suite, so its log lines are written here in
the format of vLLM 0.32's `--enable-logging-iteration-details` (`vllm/v1/metrics/loggers.py`), mixed
with the other lines its log holds. Both come out as the same record and summary."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from chariot.bench.server_iterations import (
    ChariotIterations,
    VllmIterations,
    bucket_quantile,
    histogram,
    quantiles,
    token_bounds,
)
from chariot.contracts.sampling_params import SamplingParams
from chariot.worker.config import EngineConfig
from chariot.worker.engine import Engine
from chariot.worker.iteration_log import IterationLog

BUDGET = 256


def vllm_line(index: int, ctx_requests: int, ctx_tokens: int, gen: int, ms: float, dummy: bool = False) -> str:
    return (f"(APIServer pid=4242) INFO 11-29 08:19:49 [loggers.py:199] Iteration({index}): {ctx_requests} context "
            f"requests, {ctx_tokens} context tokens, {gen} generation requests, {gen} generation tokens, iteration "
            f"elapsed time: {ms:.2f} ms{' (dummy)' if dummy else ''}, CPU KV cache usage: 1.5%")


def test_bounds_are_per_token_to_64_then_every_16_to_the_budget() -> None:
    bounds = token_bounds(BUDGET)
    assert bounds[:64] == list(range(1, 65)) and bounds[64:] == list(range(80, 257, 16))
    assert token_bounds(100)[-2:] == [96, 100]  # the budget closes the list


def test_quantiles_read_the_bucket_bound() -> None:
    counts = histogram([1, 1, 3, 70, 256, 300], token_bounds(BUDGET))
    assert counts == {"1": 2, "3": 1, "80": 1, "256": 1, "+Inf": 1}
    assert bucket_quantile(counts, 0.1) == 1 and bucket_quantile(counts, 0.5) == 3
    assert bucket_quantile(counts, 0.8) == 256 and bucket_quantile(counts, 1.0) == math.inf
    assert bucket_quantile({}, 0.5) is None
    assert quantiles([5, 1, 3]) == {"p50": 3, "p90": 5} and quantiles([]) == {"p50": None, "p90": None}


def test_vllm_lines_between_two_takes_are_the_probe(tmp_path: Path) -> None:
    log = tmp_path / "vllm.log"
    log.write_text(vllm_line(0, 1, 300, 0, 99.0) + "\n")  # an earlier phase in the same log
    source = VllmIterations(log, BUDGET)
    with log.open("a") as f:
        f.write("(APIServer pid=4242) INFO 11-29 08:19:50 [api_server.py:1] Started server process\n")
        f.write(vllm_line(1, 1, 5, 0, 12.0) + "\n")  # warm-up, before the probe's first take
    assert source.take()["iterations"] == 1
    with log.open("a") as f:
        for line in (vllm_line(2, 1, 250, 6, 120.5), vllm_line(3, 0, 0, 7, 20.0), vllm_line(4, 0, 0, 0, 0.0, True),
                     vllm_line(5, 2, 256, 0, 130.0)):
            f.write(line + "\n")
        f.write(vllm_line(6, 0, 0, 7, 20.0)[:40])  # a line still being written: the next take's
    got = source.take()
    assert got["iterations"] == 3 and got["tokens"] == 256 + 7 + 256 and got["prefill_tokens"] == 506
    assert got["histogram"] == {"256": 2, "7": 1} and got["share_full"] == 2 / 3 and got["share_with_prompt"] == 2 / 3
    assert got["decodes"] == {"p50": 6, "p90": 7} and "waiting" not in got
    assert got["forward_s"] == pytest.approx(0.2705, abs=1e-3)
    assert got["full_forward_ms"] == {"p50": 125.25, "p90": 130.0} and got["decode_only_forward_ms"]["p50"] == 20.0
    with log.open("a") as f:
        f.write(vllm_line(6, 0, 0, 7, 20.0)[40:] + "\n")
    assert source.take()["tokens"] == 7


def test_a_log_not_written_yet_is_reported_not_raised(tmp_path: Path) -> None:
    assert "error" in ChariotIterations(tmp_path / "none.jsonl", BUDGET).take()


def test_chariot_records_from_a_real_engine_carry_the_same_fields(tiny_model_dir: Path, tmp_path: Path) -> None:
    path = tmp_path / "it.0.jsonl"
    log = IterationLog(path)
    engine = Engine(EngineConfig(model=str(tiny_model_dir), dtype="float32", max_model_len=64, token_budget=16,
                                 prefix_caching=False), progress=False)
    source = ChariotIterations(path, 16)
    try:
        engine.add_request(list(range(3, 30)), SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True),
                           request_id="a")
        while engine.has_unfinished:
            log(engine.step(), ())
    finally:
        engine.shutdown()
        log.close()
    got = source.take()
    assert got["source"] == "chariot --iteration-log" and got["log"] == "it.0.jsonl"
    assert got["iterations"] == 2 + 4  # 27 prompt tokens in chunks of 16 and 11, then four decodes
    assert got["prefill_tokens"] == 27 and got["tokens"] == 27 + 4 and got["histogram"] == {"16": 1, "11": 1, "1": 4}
    assert got["waiting"]["p50"] == 0 and got["forward_s"] > 0
    assert json.loads(path.read_text().splitlines()[0])["chunks"] == [16]
