"""The engine benchmark's decode roofline: bytes a decode iteration must read, and the bound column."""

from __future__ import annotations

import json
import math
from pathlib import Path

from chariot.bench.engine_bench import Row, Target, decode_bytes, make_engine, markdown_table
from chariot.worker.model.make_model import weight_shapes


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
