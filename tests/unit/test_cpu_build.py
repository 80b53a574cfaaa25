"""Which build of a C++ CPU kernel a process loads: this CPU's from the cache, else a portable
(x86-64-v3) one an image carries where this CPU can run it, else a compile for this CPU; keys that
follow the CPU's flags and the source; a build never loaded on a CPU lacking a flag it was built for.

This machine has one CPU, so its flags are substituted (`cpu_build.cpu_flags`); the loading-order
tests substitute the compiler and the loader too. One slow test builds the baseline for real and
loads it in a fresh process with an empty cache."""

from __future__ import annotations

import json
import logging
import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from chariot.kernels import cpu_build, cpu_layer_ops, knobs
from chariot.kernels.cpu_build import BASELINE_ISA, BASELINE_REQUIRES, Build

AVX2 = BASELINE_REQUIRES | {"aes", "pclmulqdq", "rdrand"}
AVX512 = AVX2 | {"avx512f", "avx512bw", "avx512vl", "avx512_bf16"}
SOURCE = cpu_layer_ops.SOURCE
STEM = cpu_layer_ops.STEM
x86 = pytest.mark.skipif(platform.machine() != "x86_64", reason="the baseline build targets x86-64")


@pytest.fixture
def flags(monkeypatch: pytest.MonkeyPatch) -> dict[str, frozenset[str]]:
    """This CPU's flags as the tests set them (`flags["cpu"] = ...`)."""
    current = {"cpu": AVX2}
    monkeypatch.setattr(cpu_build, "cpu_flags", lambda: current["cpu"])
    return current


def copy_sources(directory: Path) -> Path:
    """The layer kernel's source and the headers beside it, copied into `directory`; returns the source."""
    directory.mkdir(parents=True, exist_ok=True)
    for path in [SOURCE, *SOURCE.parent.glob("*.h")]:
        (directory / path.name).write_bytes(path.read_bytes())
    return directory / SOURCE.name


def test_the_native_key_follows_the_cpu_flags_the_source_and_torch(
        flags: dict[str, frozenset[str]], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    source = copy_sources(tmp_path / "src")
    avx2 = cpu_build.digest(source, STEM), cpu_build.baseline_digest(source, STEM)
    flags["cpu"] = AVX512
    avx512 = cpu_build.digest(source, STEM), cpu_build.baseline_digest(source, STEM)
    assert avx512[0] != avx2[0], "another CPU's flags must give another native build"
    assert avx512[1] == avx2[1], "the baseline build does not depend on the CPU that looks for it"
    assert cpu_build.digest(source, STEM) == cpu_build.digest(SOURCE, STEM)  # bytes, not where they are
    keys = {avx512}
    source.write_text(source.read_text() + "\n// changed\n")
    keys.add((cpu_build.digest(source, STEM), cpu_build.baseline_digest(source, STEM)))
    (source.parent / "vec8.h").write_text((source.parent / "vec8.h").read_text() + "\n// changed\n")
    keys.add((cpu_build.digest(source, STEM), cpu_build.baseline_digest(source, STEM)))
    monkeypatch.setattr(torch, "__version__", "0.0.0")
    keys.add((cpu_build.digest(source, STEM), cpu_build.baseline_digest(source, STEM)))
    assert len({native for native, _ in keys}) == len({baseline for _, baseline in keys}) == 4
    assert cpu_build.digest(source, STEM) != cpu_build.baseline_digest(source, STEM)


def test_the_baseline_flags_target_the_portable_isa() -> None:
    assert f"-march={BASELINE_ISA}" in cpu_build.BASELINE_FLAGS and "-march=native" not in cpu_build.BASELINE_FLAGS
    assert [f for f in cpu_build.BASELINE_FLAGS if not f.startswith("-march")] == \
        [f for f in cpu_build.FLAGS if not f.startswith("-march")]
    assert {"avx2", "fma", "bmi2", "f16c"} <= BASELINE_REQUIRES and not any("512" in f for f in BASELINE_REQUIRES)


def finished(build: Build, requires: frozenset[str] | set[str], machine: str | None = None) -> Build:
    """A build on disk as a compile leaves it: a (stand-in) library and its record."""
    build.directory.mkdir(parents=True, exist_ok=True)
    build.library.write_bytes(b"")
    record = {**cpu_build._record(build), "requires": sorted(requires)}
    if machine is not None:
        record["machine"] = machine
    (build.directory / cpu_build.RECORD).write_text(json.dumps(record))
    return build


def test_a_build_needs_every_flag_it_was_built_for(flags: dict[str, frozenset[str]], tmp_path: Path) -> None:
    build = cpu_build.baseline_build(SOURCE, STEM, tmp_path)
    assert cpu_build.refusal(build) == "no finished build"
    finished(build, BASELINE_REQUIRES)
    assert cpu_build.refusal(build) is None
    flags["cpu"] = AVX2 - {"avx2", "movbe"}  # an older CPU: AVX without AVX2
    assert cpu_build.refusal(build) == "this CPU lacks flags it was built for: avx2 movbe"
    flags["cpu"] = AVX512
    assert cpu_build.refusal(build) is None
    finished(build, BASELINE_REQUIRES, machine="aarch64")
    assert cpu_build.refusal(build) == f"built for aarch64, this machine is {platform.machine()}"
    finished(build, set())
    assert "does not say which CPU flags" in (cpu_build.refusal(build) or "")
    (build.directory / cpu_build.RECORD).write_text(json.dumps({**cpu_build._record(build), "name": "other"}))
    assert cpu_build.refusal(build) == "no finished build"


class Fakes:
    """The compiler and the loader, recorded instead of run."""

    def __init__(self) -> None:
        self.compiled: list[str] = []
        self.loaded: list[str] = []

    def compile(self, source: Path, build: Build, what: str) -> None:
        build.directory.mkdir(parents=True, exist_ok=True)
        build.library.write_bytes(b"")
        cpu_build._write_record(build)
        self.compiled.append(build.target)

    def load(self, path: Path) -> None:
        self.loaded.append(path.parent.parent.name)


@pytest.fixture
def fakes(flags: dict[str, frozenset[str]], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Fakes:
    fake = Fakes()
    monkeypatch.setattr(cpu_build, "_compile", fake.compile)
    monkeypatch.setattr(cpu_build, "_load_library", fake.load)
    monkeypatch.setattr(cpu_build, "_told", set())
    monkeypatch.setenv(knobs.KERNEL_CACHE, str(tmp_path / "cache"))
    monkeypatch.setenv(knobs.KERNEL_BASELINE, str(tmp_path / "baseline"))
    monkeypatch.delenv(knobs.KERNEL_BUILD, raising=False)
    return fake


def baseline(requires: frozenset[str] = BASELINE_REQUIRES) -> Build:
    return finished(cpu_build.baseline_build(SOURCE, STEM), requires)


def test_auto_compiles_for_this_cpu_where_nothing_is_built(fakes: Fakes) -> None:
    assert cpu_build.select(SOURCE, STEM, "kernel").target == "native"
    assert fakes.compiled == ["native"]
    assert cpu_build.select(SOURCE, STEM, "kernel").target == "native"  # a later process: from the cache
    assert fakes.compiled == ["native"] and fakes.loaded == ["cache"]


@pytest.mark.parametrize(("cpu", "level", "says"), [
    (AVX512, logging.WARNING, "are faster (this CPU has AVX-512 and AVX512-BF16)"),
    (AVX2, logging.INFO, "may be a little faster"),
], ids=["avx512", "avx2"])
def test_auto_loads_a_baseline_this_cpu_can_run_without_compiling(
        fakes: Fakes, flags: dict[str, frozenset[str]], tmp_path: Path, caplog: pytest.LogCaptureFixture,
        cpu: frozenset[str], level: int, says: str) -> None:
    directory = baseline().directory
    flags["cpu"] = cpu
    with caplog.at_level(logging.INFO, logger=cpu_build.__name__):
        assert cpu_build.select(SOURCE, STEM, "kernel").target == BASELINE_ISA
        assert cpu_build.select(SOURCE, STEM, "kernel").target == BASELINE_ISA
    assert fakes.compiled == [] and fakes.loaded == ["baseline", "baseline"]
    assert not (tmp_path / "cache").exists()
    messages = [(r.levelno, r.getMessage()) for r in caplog.records]
    assert [m for _, m in messages if m.startswith("loaded the portable")] == \
        [f"loaded the portable {BASELINE_ISA} build of the kernel from {directory}"]
    [(hint_level, hint)] = [(lvl, m) for lvl, m in messages if "faster" in m]  # once per process
    assert hint_level == level and says in hint
    assert cpu_build.PREBUILD_NATIVE in hint and f"{knobs.KERNEL_BUILD}=native" in hint


def test_auto_prefers_this_cpus_cached_build(fakes: Fakes) -> None:
    baseline()
    finished(cpu_build.native_build(SOURCE, STEM), AVX2)
    assert cpu_build.select(SOURCE, STEM, "kernel").target == "native"
    assert fakes.compiled == [] and fakes.loaded == ["cache"]


def test_a_baseline_this_cpu_cannot_run_is_never_loaded(fakes: Fakes, flags: dict[str, frozenset[str]]) -> None:
    baseline()
    flags["cpu"] = AVX2 - {"avx2", "fma"}
    assert cpu_build.select(SOURCE, STEM, "kernel").target == "native"
    assert fakes.compiled == ["native"] and "baseline" not in fakes.loaded


def test_a_build_for_other_flags_under_this_cpus_key_is_not_loaded(fakes: Fakes) -> None:
    """A cache entry whose record needs flags this CPU lacks (copied from another node) is rebuilt."""
    finished(cpu_build.native_build(SOURCE, STEM), AVX512)
    assert cpu_build.select(SOURCE, STEM, "kernel").target == "native"
    assert fakes.compiled == ["native"]


def test_native_ignores_the_baseline(fakes: Fakes, monkeypatch: pytest.MonkeyPatch) -> None:
    baseline()
    monkeypatch.setenv(knobs.KERNEL_BUILD, "native")
    assert cpu_build.select(SOURCE, STEM, "kernel").target == "native"
    assert fakes.compiled == ["native"] and "baseline" not in fakes.loaded


def test_baseline_takes_only_the_baseline(fakes: Fakes, monkeypatch: pytest.MonkeyPatch,
                                          flags: dict[str, frozenset[str]]) -> None:
    monkeypatch.setenv(knobs.KERNEL_BUILD, "baseline")
    finished(cpu_build.native_build(SOURCE, STEM), AVX2)
    with pytest.raises(RuntimeError, match="CHARIOT_KERNEL_BUILD=baseline, but the kernel has no x86-64-v3 build"):
        cpu_build.select(SOURCE, STEM, "kernel")
    problem = cpu_build.build_problem(lambda: cpu_build.select(SOURCE, STEM, "kernel"), "C++ kernel")
    assert problem is not None and "no finished build" in problem
    baseline()
    assert cpu_build.select(SOURCE, STEM, "kernel").target == BASELINE_ISA
    flags["cpu"] = AVX2 - {"avx2"}
    with pytest.raises(RuntimeError, match="this CPU lacks flags it was built for: avx2"):
        cpu_build.select(SOURCE, STEM, "kernel")
    assert fakes.compiled == [] and fakes.loaded == ["baseline"]


def test_status_says_what_loads(fakes: Fakes) -> None:
    lines = cpu_build.status()
    assert lines[0] == "CHARIOT_KERNEL_BUILD=auto; this CPU's flags cover x86-64-v3: yes"
    assert any(line.startswith(f"{STEM}: loads native, compiled first") for line in lines)
    baseline()
    assert any(line.startswith(f"{STEM}: loads {BASELINE_ISA};") for line in cpu_build.status())


def test_the_table_holds_every_kernel_the_modules_load() -> None:
    from chariot.kernels import cpu_attention, panel_linear, skinny_linear

    modules = {(m.STEM, m.SOURCE) for m in (cpu_attention, cpu_layer_ops, panel_linear, skinny_linear)}
    assert {(k.stem, k.source) for k in cpu_build.KERNELS} == modules
    assert {k.source for k in cpu_build.KERNELS} == set(cpu_build.CSRC.glob("*.cpp"))


def test_no_baseline_off_x86(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    monkeypatch.setattr(platform, "machine", lambda: "aarch64")
    assert cpu_build.main(["prebuild", "--baseline", str(tmp_path / "out")]) == 0
    assert "no baseline build on aarch64" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
    with pytest.raises(RuntimeError, match="targets x86-64-v3"):
        cpu_build.prebuild_baseline(tmp_path / "out")


LOAD_IN_A_FRESH_PROCESS = """
import json, logging, sys
import torch
logging.basicConfig(level=logging.INFO, stream=sys.stderr)
from chariot.kernels import cpu_build, cpu_layer_ops
ops = cpu_build.load_ops(cpu_layer_ops.SOURCE, cpu_layer_ops.STEM, "CPU layer kernels")
x, gate_up, weight = torch.load(sys.argv[1])
norm, act = torch.empty_like(x), torch.empty(gate_up.shape[0], gate_up.shape[1] // 2)
ops("rms_norm")(x, weight, 1e-5, norm)
ops("silu_and_mul")(gate_up, act)
torch.save((norm, act), sys.argv[2])
print(json.dumps({"compiled": cpu_build.COMPILED, "loaded": [b.target for b in cpu_build.LOADED.values()]}))
"""


@x86
@pytest.mark.slow  # two compiles of the layer kernels where the cache has no native build yet
def test_a_prebuilt_baseline_loads_in_a_fresh_process_without_compiling(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    if not cpu_build.cpu_flags() >= BASELINE_REQUIRES:
        pytest.skip("this CPU cannot run the x86-64-v3 build")
    root = tmp_path / "baseline"
    assert cpu_build.main(["prebuild", "--baseline", str(root), "--kernel", STEM]) == 0
    build = cpu_build.baseline_build(SOURCE, STEM, root)
    assert sorted(p.name for p in root.iterdir()) == [build.directory.name]  # nothing left aside
    assert sorted(p.name for p in build.directory.iterdir()) == sorted([build.library.name, cpu_build.RECORD])
    record = json.loads((build.directory / cpu_build.RECORD).read_text())
    assert record["target"] == BASELINE_ISA and set(record["requires"]) == BASELINE_REQUIRES

    gen = torch.Generator().manual_seed(0)
    inputs = (torch.randn(37, 200, generator=gen), torch.randn(37, 2 * 136, generator=gen),
              torch.randn(200, generator=gen))
    torch.save(inputs, tmp_path / "in.pt")
    cache = tmp_path / "empty-cache"
    env = {**os.environ, knobs.KERNEL_CACHE: str(cache), knobs.KERNEL_BASELINE: str(root)}
    env.pop(knobs.KERNEL_BUILD, None)
    done = subprocess.run([sys.executable, "-c", LOAD_IN_A_FRESH_PROCESS, str(tmp_path / "in.pt"),
                           str(tmp_path / "out.pt")], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout.strip().splitlines()[-1]) == {"compiled": [], "loaded": [BASELINE_ISA]}
    assert f"loaded the portable {BASELINE_ISA} build of the CPU layer kernels" in done.stderr
    assert "compiling" not in done.stderr
    assert not cache.exists()

    monkeypatch.setenv(knobs.KERNEL_BUILD, "native")  # this CPU's build, from the session's cache
    [native] = cpu_build.prebuild_native([STEM])
    assert cpu_build.refusal(native) is None
    ops = cpu_build.load_ops(SOURCE, STEM, "CPU layer kernels")
    x, gate_up, weight = inputs
    norm, act = torch.empty_like(x), torch.empty(gate_up.shape[0], gate_up.shape[1] // 2)
    ops("rms_norm")(x, weight, 1e-5, norm)
    ops("silu_and_mul")(gate_up, act)
    baseline_norm, baseline_act = torch.load(tmp_path / "out.pt")
    torch.testing.assert_close(baseline_norm, norm)  # AVX-512 and AVX2 sum in other orders
    torch.testing.assert_close(baseline_act, act)
