"""`host_memory.keep_freed_memory`: once set, a forward pass's pattern of activations (allocated,
touched, freed, again) is served from memory the process already has, where glibc's thresholds as a
process starts with them (128 KiB each; glibc raises them later by a history of its own, which is
why the contrast fixes them) fault every iteration's pages in afresh. Each case runs in a fresh
interpreter: malloc's settings are process-wide and cannot be undone."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from chariot.worker import host_memory

# One iteration's activations, in KiB: the 100m preset's qkv, gate_up, SwiGLU and down outputs of a
# 512-token chunk (fp32 elements of 1 KiB = 256), for 8 layers, alive together, then all freed.
CHILD = """
import ctypes, json, resource, sys, torch
from chariot.worker import host_memory
if sys.argv[1] == "keep":
    why = host_memory.keep_freed_memory()
else:  # glibc's thresholds as a process starts, fixed here so the run does not depend on malloc's history
    libc = ctypes.CDLL("libc.so.6")
    libc.mallopt(host_memory.M_MMAP_THRESHOLD, 128 << 10)
    libc.mallopt(host_memory.M_TRIM_THRESHOLD, 128 << 10)
    why = "glibc's initial thresholds"
def iteration():
    live = [torch.ones(kib << 8) for _ in range(8) for kib in (1536, 5632, 2816, 1024)]
    del live
for _ in range(5):
    iteration()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(10):
    iteration()
print(json.dumps({"why": why, "faults": resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before}))
"""


def faults_per_run(mode: str) -> dict[str, object]:
    done = subprocess.run([sys.executable, "-c", CHILD, mode], capture_output=True, text=True, check=True,
                          cwd="/", timeout=120)
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


def test_kept_memory_serves_the_next_iteration_without_page_faults() -> None:
    kept, default = faults_per_run("keep"), faults_per_run("default")
    assert kept["why"] is None
    # 10 iterations of ~86 MiB: with the initial thresholds every one is mapped and faulted in afresh
    assert int(default["faults"]) > 10 * 20_000  # type: ignore[call-overload]
    assert int(kept["faults"]) < 1_000  # type: ignore[call-overload]


def test_it_can_be_turned_off_for_ab_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    host_memory.keep_freed_memory.cache_clear()
    monkeypatch.setenv(host_memory.ENV, "0")
    try:
        assert host_memory.keep_freed_memory() == f"{host_memory.ENV}=0"
    finally:
        host_memory.keep_freed_memory.cache_clear()
