"""The pure parts of the kernel and block-size experiments (`bench/experiments/kernel_revision_ab.py`,
`bench/offline_ab.py`, `decode_attention_side_by_side.py`): which revision's sources they build, the
order their rounds run in, and the rates they report."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from chariot.bench.experiments.decode_attention_side_by_side import kv_gb, summarize
from chariot.bench.experiments.kernel_revision_ab import revision_source
from chariot.bench.offline_ab import rotated

ROOT = Path(__file__).resolve().parents[2]


def test_a_revisions_kernel_comes_with_the_headers_beside_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(ROOT)
    source = revision_source("HEAD", tmp_path)
    committed = subprocess.run(["git", "show", "HEAD:kernels/csrc/paged_attention.cpp"], check=True,
                               capture_output=True).stdout
    assert source == tmp_path / "paged_attention.cpp" and source.read_bytes() == committed
    assert (tmp_path / "vecw.h").exists() and (tmp_path / "vec8.h").exists()


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
