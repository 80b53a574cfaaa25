"""oneDNN-packed linear layers (the CPU fast path) against `nn.Linear`, and when packing is refused."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from chariot.worker.model.cpu_linear import PACKED_LINEAR_ENV, PackedLinear, pack_linears, packing_problem


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 7, 64, 300])
def test_packed_linear_equals_nn_linear(bias: bool, rows: int) -> None:
    torch.manual_seed(rows)
    linear = nn.Linear(256, 384, bias=bias).eval()
    packed = PackedLinear(linear)
    x = torch.randn(rows, 256)
    with torch.inference_mode():
        torch.testing.assert_close(packed(x), linear(x), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(packed(x.view(rows, 1, 256)), linear(x).view(rows, 1, 384), atol=1e-5, rtol=1e-5)


def test_pack_linears_swaps_nested_layers_and_keeps_the_rest() -> None:
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Sequential(nn.Linear(16, 4, bias=False)))
    x = torch.randn(5, 8)
    with torch.inference_mode():
        before = model(x)
    assert pack_linears(model, torch.device("cpu"), torch.float32) == 2
    assert isinstance(model[0], PackedLinear) and isinstance(model[2][0], PackedLinear)
    assert isinstance(model[1], nn.ReLU)
    with torch.inference_mode():
        torch.testing.assert_close(model(x), before, atol=1e-5, rtol=1e-5)


def test_packing_is_refused_with_a_reason(monkeypatch: pytest.MonkeyPatch) -> None:
    assert packing_problem(torch.device("cpu"), torch.float32) is None
    assert "not the CPU" in (packing_problem(torch.device("meta"), torch.float32) or "")
    assert "float16" in (packing_problem(torch.device("cpu"), torch.float16) or "")
    monkeypatch.setenv(PACKED_LINEAR_ENV, "0")
    model = nn.Sequential(nn.Linear(8, 8))
    assert pack_linears(model, torch.device("cpu"), torch.float32) == 0
    assert isinstance(model[0], nn.Linear)
