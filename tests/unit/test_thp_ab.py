"""`bench/experiments/thp_ab.py`: the pair statistics it reports, and that the variable it turns on
really puts torch's large CPU tensors on huge pages (a fresh interpreter each way)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from chariot.bench.experiments import thp_ab

THP_SETTING = Path("/sys/kernel/mm/transparent_hugepage/enabled")
ALLOCATE = ("import torch; from chariot.bench.experiments.malloc_ab import huge_pages_kib; "
            "x = torch.ones(64 << 20, dtype=torch.uint8); print(huge_pages_kib())")


def test_pairs_are_compared_in_order(tmp_path: Path) -> None:
    rows = [{"thp": False, "ms": 12.0}, {"thp": True, "ms": 10.0},   # pair 1: huge pages 1.2x faster
            {"thp": True, "ms": 10.0}, {"thp": False, "ms": 9.0},    # pair 2: slower, 0.9x
            {"thp": False, "ms": 11.0}, {"thp": True, "ms": 10.0}]   # pair 3: 1.1x
    summary = thp_ab.summarise_pairs(rows, "ms", {"part": "gemm", "dtype": "float32"}, tmp_path)
    assert summary["off_over_on_by_pair"] == pytest.approx([1.2, 0.9, 1.1])
    assert summary["off_over_on_median"] == pytest.approx(1.1)
    assert (summary["pairs_faster_with_thp"], summary["pairs"]) == (2, 3)
    assert (summary["median_on"], summary["median_off"]) == (10.0, 11.0)
    written = json.loads((tmp_path / "thp_ab_gemm_float32.json").read_text())
    assert written["summary"] == summary and "flags" in written["machine"]


def test_the_variable_puts_large_tensors_on_huge_pages() -> None:
    """What the kernel's setting says should happen: `madvise` gives huge pages only with the
    variable, `always` with or without it, `never` not at all."""
    def huge_kib(on: bool) -> int:
        out = subprocess.run([sys.executable, "-c", ALLOCATE], env=thp_ab.with_thp(on), capture_output=True,
                             text=True, check=True)
        return int(out.stdout.strip().splitlines()[-1])

    setting = THP_SETTING.read_text()
    with_variable, without = huge_kib(True), huge_kib(False)
    if "[never]" in setting:
        assert with_variable == without == 0
        return
    assert with_variable >= 32 << 10  # most of the 64 MiB tensor
    if "[madvise]" in setting:  # without the advice, nothing asks for huge pages
        assert without < 32 << 10
