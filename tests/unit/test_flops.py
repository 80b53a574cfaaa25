"""The FLOP accounting of a trace (`bench/flops.py`) against hand arithmetic and against PyTorch's
own FLOP counter over a Hugging Face forward pass of the same model."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from chariot.bench.flops import linear_flops_per_token, main, trace_flops
from chariot.bench.traces import TraceRequest
from chariot.worker.config import ModelConfig

transformers = pytest.importorskip("transformers")


def test_a_hand_computed_trace(tiny_model_dir: Path) -> None:
    cfg = ModelConfig.from_dir(tiny_model_dir)
    per_token = linear_flops_per_token(cfg)
    f = trace_flops(cfg, [TraceRequest(0.0, 3, 2)])  # 3 prompt tokens, 2 outputs: 4 tokens computed
    assert f.linear == 4 * per_token
    assert f.lm_head == 2 * 2 * cfg.hidden_size * cfg.vocab_size
    assert f.attention == 4 * cfg.num_heads * cfg.head_dim * cfg.num_layers * (1 + 2 + 3 + 4)
    assert f.floor_s(1.0) == pytest.approx(f.total / 1e9)


def test_linear_flops_match_torchs_counter_on_the_hf_model(tiny_model_dir: Path) -> None:
    """HF computes logits at every position, so its matmuls are n tokens x (projections + LM head)."""
    cfg = ModelConfig.from_dir(tiny_model_dir)
    hf: Any = transformers.AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    n = 9
    counter = FlopCounterMode(display=False)
    with counter, torch.no_grad():
        hf(torch.arange(n)[None], use_cache=False)
    counts = counter.get_flop_counts()["Global"]
    projections = ("aten.mm", "aten.addmm")  # not bmm or SDPA: attention is counted apart
    matmuls = sum(v for op, v in counts.items() if str(op).split(".default")[0] in projections)
    assert matmuls == n * linear_flops_per_token(cfg) + n * 2 * cfg.hidden_size * cfg.vocab_size


def test_the_cli_prints_the_floor(tiny_model_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--model", str(tiny_model_dir), "--requests", "4", "--gflops", "100"]) == 0
    out = capsys.readouterr().out
    assert '"floor_s_at_gflops"' in out and '"100"' in out
