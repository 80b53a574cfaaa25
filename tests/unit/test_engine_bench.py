"""The engine benchmark: the decode roofline (bytes a decode iteration must read, the bound column) and
which steps its hybrid rows time."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from chariot.bench.engine_bench import (
    Row,
    Target,
    bench_hybrid,
    decode_bytes,
    hybrid_tokens,
    make_engine,
    markdown_table,
    summarize,
)
from chariot.contracts.outputs import EngineStats, IterationTimes
from chariot.worker.engine_output import StepResult
from chariot.worker.model.make_model import weight_shapes
from chariot.worker.scheduler.output import ScheduledChunk, SchedulerOutput


def test_decode_bytes_counts_every_weight_but_the_embedding_and_the_batch_kv(tiny_model_dir: Path) -> None:
    engine = make_engine(Target(str(tiny_model_dir)), "sarathi", 64, 256)
    config = json.loads((tiny_model_dir / "config.json").read_text())
    params = sum(math.prod(shape) for _, shape in weight_shapes(config))
    embedding = config["vocab_size"] * config["hidden_size"]  # untied: gathered rows only, not read whole
    kv_per_token = config["num_hidden_layers"] * 2 * config["num_key_value_heads"] * config["head_dim"]
    elem = 4  # tiny is float32
    assert decode_bytes(engine, 3, 100) == (params - embedding + 3 * 100 * kv_per_token) * elem


def test_table_shows_the_bound_only_for_decode_rows() -> None:
    rows = [Row("decode batch 8 (ctx 512)", 8, 2.0, 0.1, 5.0, bytes_read=3_350_000_000),
            Row("prefill 512", 512, 10.0, 0.2, 2.0)]
    table = markdown_table(rows, peak_bw_gbs=3350.0).splitlines()
    assert table[0].endswith("bandwidth bound ms | % of bound |")
    assert table[2].endswith("| 1.00 | 50% |")  # 3.35 GB at 3350 GB/s = 1 ms, measured 2 ms
    assert table[3].endswith("| – | – |")
    assert "bound" not in markdown_table(rows, None)


def test_hybrid_rows_time_only_hybrid_iterations(tiny_model_dir: Path) -> None:
    """Every timed step completed the decodes beside a prompt chunk, read from the batch the step
    completed (on CUDA the load report runs one batch ahead, which once left the 512-token case with no
    step timed at all); the row names the chunk sizes it ran."""
    row = bench_hybrid(Target(str(tiny_model_dir)), decodes=4, budget=64, context=32, iters=5, prompt=1024,
                       max_len=2048)
    assert row.median_ms > 0 and 4 < row.tokens <= 64
    assert "budget 64: 4 decodes + prompt chunks (" in row.case


def test_hybrid_tokens_counts_only_steps_with_the_decodes_and_a_chunk() -> None:
    def step(decodes: int, prefill: list[int]) -> StepResult:
        chunks = tuple(ScheduledChunk(seq_id=i, start=0, num_tokens=1, samples=True) for i in range(decodes)) + tuple(
            ScheduledChunk(seq_id=100 + i, start=0, num_tokens=n, samples=False) for i, n in enumerate(prefill))
        batch = SchedulerOutput(chunks=chunks, num_decodes=decodes)
        return StepResult(outputs=(), batch=batch, times=IterationTimes(0, 0, 0, 0),
                          stats=EngineStats(0, 0, 0, 0.0, 0, 0, 0, 0, 0, 0.0, 0))

    assert hybrid_tokens(step(4, [60]), 4) == 64
    assert hybrid_tokens(step(4, [40, 20]), 4) == 64
    assert hybrid_tokens(step(4, []), 4) == 0  # decodes alone
    assert hybrid_tokens(step(3, [61]), 4) == 0  # not the benchmark's decodes


def test_a_case_with_no_timed_step_names_itself() -> None:
    with pytest.raises(RuntimeError, match="prefill 512: no step of this kind was timed"):
        summarize("prefill 512", 512, [])
