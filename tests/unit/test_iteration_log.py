"""The iteration log (`worker/iteration_log.py`) fed by a real engine on the tiny checkpoint: every
prompt token, decode and finished prompt is accounted for once, chunks respect the token budget, and
a reader picks up exactly the lines written since its last read."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from chariot.contracts.errors import ConfigError
from chariot.contracts.sampling_params import SamplingParams
from chariot.worker.config import EngineConfig
from chariot.worker.engine import Engine
from chariot.worker.iteration_log import (
    IterationLog,
    StepObservers,
    iteration_log_path,
    iteration_record,
    read_iterations,
)

BUDGET = 16
PROMPTS = {"long": list(range(3, 43)), "short": [7, 8, 9, 10, 11]}  # 40 and 5 prompt tokens
MAX_TOKENS = {"long": 4, "short": 6}


def run_engine(model: Path, observer: StepObservers) -> int:
    """Both requests to the end through `observer`; the number of steps that completed a batch."""
    engine = Engine(EngineConfig(model=str(model), dtype="float32", max_model_len=64, token_budget=BUDGET,
                                 prefix_caching=False), progress=False)
    steps = 0
    try:
        for rid, prompt in PROMPTS.items():
            engine.add_request(prompt, SamplingParams(max_tokens=MAX_TOKENS[rid], temperature=0.0, ignore_eos=True),
                               request_id=rid)
        while engine.has_unfinished:
            result = engine.step()
            steps += result.batch is not None
            observer(result, ())
    finally:
        engine.shutdown()
    return steps


def test_every_prompt_token_and_decode_is_logged_once(tiny_model_dir: Path, tmp_path: Path) -> None:
    path = tmp_path / "logs" / "iterations.jsonl"  # the folder is created
    log = IterationLog(path)
    before = time.time()
    steps = run_engine(tiny_model_dir, StepObservers(None, log))
    log.close()
    records, offset = read_iterations(path)
    assert len(records) == steps and offset == path.stat().st_size
    assert sum(r["prefill"] for r in records) == sum(len(p) for p in PROMPTS.values())
    assert sum(r["last"] for r in records) == len(PROMPTS)  # each prompt ends in exactly one chunk
    # the first token of each request comes from its last prompt chunk, every other from a decode
    assert sum(r["decodes"] for r in records) == sum(MAX_TOKENS.values()) - len(PROMPTS)
    for r in records:
        assert r["tokens"] == r["prefill"] + r["decodes"] <= BUDGET
        assert sum(r["chunks"]) == r["prefill"] and all(c >= 1 for c in r["chunks"])
        assert r["ms"] >= r["exec_ms"] > 0 and r["host_ms"] == pytest.approx(r["ms"] - r["exec_ms"], abs=0.02)
        assert 0.0 <= r["kv"] <= 1.0 and r["preempted"] == 0
    assert before <= records[0]["t"] <= records[-1]["t"] <= time.time()
    assert records[0]["waiting"] + records[0]["running"] == len(PROMPTS) and records[0]["queued_prefill"] > 0
    assert records[-1]["running"] == records[-1]["waiting"] == records[-1]["queued_prefill"] == 0


def test_a_record_is_none_for_a_step_without_a_batch(tiny_model_dir: Path) -> None:
    engine = Engine(EngineConfig(model=str(tiny_model_dir), dtype="float32", max_model_len=64), progress=False)
    try:
        assert iteration_record(engine.step()) is None  # nothing queued: no batch
    finally:
        engine.shutdown()


def test_a_reader_gets_whole_new_lines_only(tmp_path: Path) -> None:
    path = tmp_path / "it.jsonl"
    path.write_text(json.dumps({"tokens": 1}) + "\n" + json.dumps({"tokens": 2}) + "\n" + '{"tok')
    records, offset = read_iterations(path)
    assert [r["tokens"] for r in records] == [1, 2]
    with path.open("a") as f:
        f.write('ens": 3}\n')
    more, end = read_iterations(path, offset)
    assert [r["tokens"] for r in more] == [3] and end == path.stat().st_size
    assert read_iterations(path, end) == ([], end)


def test_each_replica_gets_its_own_file() -> None:
    assert iteration_log_path("/x/iterations.jsonl", 0) == Path("/x/iterations.0.jsonl")
    assert iteration_log_path("/x/log", 3) == Path("/x/log.3")


def test_an_unwritable_path_names_the_setting(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(ConfigError, match=r"iteration_log: cannot append to .*file/sub/it.jsonl"):
        IterationLog(blocker / "sub" / "it.jsonl")
