"""The host-step benchmark measures decode-only steps and records every part, the machine and the model."""

from __future__ import annotations

import json
from pathlib import Path

from chariot.bench.host_step import PARTS, main


def test_writes_every_part_for_each_batch_size(tiny_model_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "host_step.json"
    assert main(["--model", str(tiny_model_dir), "--batches", "1", "3", "--steps", "4", "--warmup", "1",
                 "--threads", "1", "--out", str(out)]) == 0
    record = json.loads(out.read_text())
    assert [r["batch"] for r in record["results"]] == [1, 3]
    for result in record["results"]:
        assert set(result["median_ms"]) == set(PARTS)
        assert all(v >= 0 for v in result["median_ms"].values())
        assert result["aten_ops_per_step"] > 0 and result["dtype"] == "float32"
    assert record["machine"]["torch_threads"] == 1 and record["model_config"]["hidden_size"] == 64
