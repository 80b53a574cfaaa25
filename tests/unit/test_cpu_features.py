"""`--dtype auto` on CPUs: a reduced-precision checkpoint runs in float32 unless the CPU has the
instructions for it (flags parsed from a real /proc/cpuinfo layout)."""

from __future__ import annotations

from pathlib import Path

import pytest

from chariot.worker.cpu_features import auto_cpu_dtype, cpu_flags, native_on_cpu

AVX2_ONLY = frozenset({"fpu", "sse4_2", "avx", "avx2", "fma", "f16c"})
SAPPHIRE_RAPIDS = AVX2_ONLY | {"avx512f", "avx512_bf16", "amx_bf16", "amx_tile", "avx512_fp16"}


def test_flags_are_read_from_the_first_processor(tmp_path: Path) -> None:
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nmodel name\t: AMD EPYC\nflags\t\t: fpu avx2 fma\n\n"
                    "processor\t: 1\nflags\t\t: fpu\n")
    assert cpu_flags(info) == {"fpu", "avx2", "fma"}
    assert cpu_flags(tmp_path / "missing") == frozenset()


@pytest.mark.parametrize(("checkpoint", "flags", "expected"), [
    ("bfloat16", AVX2_ONLY, "float32"),
    ("float16", AVX2_ONLY, "float32"),
    ("float32", AVX2_ONLY, "float32"),
    ("bfloat16", SAPPHIRE_RAPIDS, "bfloat16"),
    ("float16", SAPPHIRE_RAPIDS, "float16"),
    ("float16", AVX2_ONLY | {"avx512_bf16"}, "float32"),
])
def test_auto_picks_a_native_dtype(checkpoint: str, flags: frozenset[str], expected: str) -> None:
    chosen, reason = auto_cpu_dtype(checkpoint, flags)
    assert chosen == expected
    assert (reason is None) == (chosen == checkpoint)
    if reason is not None:
        assert checkpoint in reason and "float32" in reason and f"--dtype {checkpoint}" in reason


def test_float32_is_always_native() -> None:
    assert native_on_cpu("float32", frozenset())
    assert not native_on_cpu("bfloat16", frozenset())


@pytest.mark.parametrize(("flags", "expected"), [(AVX2_ONLY, "float32"), (SAPPHIRE_RAPIDS, "bfloat16")])
def test_engine_config_auto_follows_the_cpu(tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                            flags: frozenset[str], expected: str) -> None:
    """The CPU's flags are substituted (this machine has one CPU model); the config file is real."""
    import json
    import shutil

    import torch

    from chariot.worker import budget, config

    model = tmp_path / "bf16"
    shutil.copytree(tiny_model_dir, model)
    raw = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**raw, "torch_dtype": "bfloat16"}))
    monkeypatch.setattr(config, "cpu_flags", lambda: flags)
    monkeypatch.setattr(budget, "cpu_flags", lambda: flags)
    cfg = config.EngineConfig(model=str(model))
    assert cfg.torch_dtype(config.ModelConfig.from_dir(model)) == getattr(torch, expected)
    assert budget.model_dtype(model, "auto") == expected  # the tuner's profile is named the same way
    explicit = config.EngineConfig(model=str(model), dtype="bfloat16")
    assert explicit.torch_dtype(config.ModelConfig.from_dir(model)) == torch.bfloat16
