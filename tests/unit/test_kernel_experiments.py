"""The pure parts of the kernel and block-size experiments (`bench/experiments/kernel_revision_ab.py`,
`bench/offline_ab.py`, `decode_attention_side_by_side.py`, `linear_dispatch_ab.py`): which revision's
sources they build, the order their rounds run in, the rates they report, and that an A/B's previous
variant computes what the current one does."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from chariot.bench.experiments import layer_ops_revision_calls, linear_dispatch_ab
from chariot.bench.experiments.decode_attention_side_by_side import kv_gb, summarize
from chariot.bench.experiments.kernel_revision_ab import revision_source
from chariot.bench.offline_ab import rotated, switched
from chariot.kernels import cpu_layer_ops
from chariot.worker.model.cpu_linear import CpuLinear

ROOT = Path(__file__).resolve().parents[2]


def test_a_revisions_kernel_comes_with_the_headers_beside_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(ROOT)
    source = revision_source("HEAD", tmp_path)
    committed = subprocess.run(["git", "show", "HEAD:kernels/csrc/paged_attention.cpp"], check=True,
                               capture_output=True).stdout
    assert source == tmp_path / "paged_attention.cpp" and source.read_bytes() == committed
    assert (tmp_path / "vecw.h").exists() and (tmp_path / "vec8.h").exists()


def test_the_layer_kernels_of_a_revision_come_out_of_git_too(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(ROOT)
    source = revision_source("HEAD", tmp_path, cpu_layer_ops)
    committed = subprocess.run(["git", "show", "HEAD:kernels/csrc/layer_ops.cpp"], check=True,
                               capture_output=True).stdout
    assert source == tmp_path / "layer_ops.cpp" and source.read_bytes() == committed


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 4, 40])
def test_the_previous_linear_dispatch_computes_what_the_current_one_does(dtype: torch.dtype, rows: int) -> None:
    torch.manual_seed(rows)
    fast = CpuLinear(nn.Linear(64, 96).to(dtype).eval(), packed=False, plain=True)
    x = torch.randn(rows, 64).to(dtype)
    try:
        with torch.inference_mode():
            current = [fast(x), fast(x.view(rows, 1, 64))]
            linear_dispatch_ab.use("previous")
            previous = [fast(x), fast(x.view(rows, 1, 64))]
    finally:
        linear_dispatch_ab.use("current")
    assert CpuLinear.forward is linear_dispatch_ab.CURRENT["forward"]
    for a, b in zip(current, previous, strict=True):
        assert a.shape == b.shape and torch.equal(a, b)


def test_switched_variants_put_their_own_state_in_place_before_handing_out_the_llm() -> None:
    placed: list[str] = []
    llm = object()
    variants = switched(llm, placed.append, ["a", "b"])
    assert variants["b"]() is llm and variants["a"]() is llm
    assert placed == ["b", "a"]


def test_per_call_rates_count_each_ops_elements() -> None:
    counts = {op: elements for op, (elements, _) in layer_ops_revision_calls.cases(torch.bfloat16).items()}
    assert counts == {"silu_and_mul": 16 * 2816, "rms_norm": 64 * 1024, "rope": 64 * (16 + 4) * 64}


def test_rounds_rotate_which_variant_goes_first() -> None:
    sizes = ["16", "64", "128"]
    firsts = [rotated(sizes, r)[0] for r in range(6)]
    assert firsts == ["16", "64", "128", "16", "64", "128"]
    assert all(set(rotated(sizes, r)) == set(sizes) for r in range(6))


def test_rates_are_the_kv_bytes_read_over_the_median_time() -> None:
    assert kv_gb(32, 512) == pytest.approx(32 * 512 * 4 * 64 * 2 * 2 / 1e9)
    summary = summarize({"k": {"32x512": [0.002, 0.001, 0.003]}})
    assert summary["k"]["32x512"]["ms"] == pytest.approx(2.0)
    assert summary["k"]["32x512"]["gb_per_s"] == pytest.approx(kv_gb(32, 512) / 0.002)


def test_the_systems_processes_take_turns_and_the_warm_up_is_dropped(tmp_path: Path) -> None:
    """Two real child processes speaking the side-by-side's protocol (`serve`): each reports the time
    it was asked at, so the order of the turns is visible in what comes back."""
    from chariot.bench.experiments import decode_attention_side_by_side as side

    child = tmp_path / "child.py"
    child.write_text(
        "import sys, time\n"
        "from chariot.bench.experiments.decode_attention_side_by_side import serve\n"
        "print('a library line on stdout', flush=True)\n"
        "serve(lambda rep: {sys.argv[1]: {'1x1': time.monotonic()}, 'rep': {'1x1': rep}})\n")
    procs = {name: side.start([sys.executable, str(child), name], dict(os.environ)) for name in ("a", "b")}
    try:
        times = side.take_turns(procs, reps=4, warmup=2)
    finally:
        for proc in procs.values():
            assert proc.stdin is not None
            proc.stdin.close()
            proc.wait(timeout=30)
    assert times["rep"]["1x1"] == [2, 2, 3, 3, 4, 4, 5, 5]
    a, b = times["a"]["1x1"], times["b"]["1x1"]
    assert a[0] < b[0] and b[1] < a[1] and a[2] < b[2] and b[3] < a[3]  # the first turn rotates
