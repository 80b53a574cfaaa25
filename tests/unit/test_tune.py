"""Token-budget tuner: fit, budget choice, profile file and the worker's `--tbt-slo-ms` resolution."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from chariot.contracts.errors import ConfigError
from chariot.worker.budget import (
    Assumptions,
    BatchShape,
    CostModel,
    budget_for_slo,
    budget_from_flags,
    default_profile_path,
    resolve_token_budget,
    worst_case_iteration_s,
)
from chariot.worker.tune import Grid, Profile, Sample, choose_budget, fit, main, profile

# 10 ms fixed, 1 ms per prefill token, 2 ms per decode, nothing else: a budget B with D decodes costs
# 10 + (B - D) + 2·D ms = 10 + B + D ms.
LINEAR = CostModel((0.010, 0.001, 0.002, 0.0, 0.0))


def test_budget_is_largest_tile_multiple_under_the_slo() -> None:
    # 10 + B + 8 <= 200  →  B <= 182  →  160 with 32-token tiles, 176 with 16
    assert choose_budget(LINEAR, 0.200, decode_batch=8, decode_context=512) == 160
    assert choose_budget(LINEAR, 0.200, decode_batch=8, decode_context=512, tile=16) == 176
    on_slo = worst_case_iteration_s(LINEAR, 192, Assumptions(decode_batch=8, decode_context=512, prefill_context=512))
    assert choose_budget(LINEAR, on_slo, decode_batch=8, decode_context=512) == 192  # exactly on the SLO
    assert choose_budget(LINEAR, 10.0, decode_batch=8, decode_context=512, max_budget=1024) == 1024


def test_budget_on_a_curved_cost() -> None:
    """With attention cost the worst case is the long-context chunk; check against brute force."""
    model = CostModel((0.008, 2e-4, 5e-4, 1e-7, 2e-6))
    a = Assumptions(decode_batch=16, decode_context=1024, prefill_context=4096, tile=64)
    budget = budget_for_slo(model, 0.150, a)
    assert budget % 64 == 0
    assert worst_case_iteration_s(model, budget, a) <= 0.150 < worst_case_iteration_s(model, budget + 64, a)
    chunk = budget - 16
    manual = model.predict(BatchShape(chunk, 16, chunk * 4096, 16 * 1024))
    assert worst_case_iteration_s(model, budget, a) == pytest.approx(manual)


def test_worst_case_counts_a_single_decode_when_prefill_is_dearer() -> None:
    model = CostModel((0.0, 0.002, 0.001, 0.0, 0.0))  # prefill tokens cost more than decodes
    a = Assumptions(decode_batch=64, decode_context=128, prefill_context=128, max_budget=512)
    assert worst_case_iteration_s(model, 256, a) == pytest.approx(1 * 0.001 + 255 * 0.002)


def test_unreachable_slo_raises_naming_the_flag() -> None:
    with pytest.raises(ConfigError, match=r"tbt_slo_ms.*32-token budget"):
        choose_budget(LINEAR, 0.030, decode_batch=8, decode_context=512)


def synthetic_samples(coef: tuple[float, ...], noise: float = 0.0, seed: int = 0) -> list[Sample]:
    rng = random.Random(seed)
    model = CostModel(coef)
    samples = []
    for p, d, c in Grid((0, 32, 128, 512), (0, 4, 16, 64), (128, 512, 2048)).points():
        t = model.predict(Sample(p, d, c, 1.0).shape)
        samples.append(Sample(p, d, c, t * (1 + rng.uniform(-noise, noise))))
    return samples


def test_fit_recovers_known_coefficients() -> None:
    coef = (0.012, 3e-4, 8e-4, 2e-8, 1.5e-6)
    model = fit(synthetic_samples(coef))
    assert model.coefficients == pytest.approx(coef, rel=1e-6)
    assert model.r2 == pytest.approx(1.0)


def test_fit_keeps_coefficients_non_negative_under_noise() -> None:
    coef = (0.012, 3e-4, 8e-4, 0.0, 1.5e-6)  # no attention term: noise must not make it negative
    model = fit(synthetic_samples(coef, noise=0.05))
    assert all(c >= 0 for c in model.coefficients)
    assert model.coefficients[1] == pytest.approx(3e-4, rel=0.1)
    assert model.r2 > 0.98


def test_profile_smoke_on_tiny_model(tiny_model_dir: Path, tmp_path: Path) -> None:
    prof = profile(tiny_model_dir, "float32", Grid((0, 32), (0, 2), (64,), repeats=1), progress=False)
    assert [(s.prefill_tokens, s.decode_batch, s.context) for s in prof.samples] == [(0, 2, 64), (32, 0, 64),
                                                                                      (32, 2, 64)]
    assert all(s.seconds > 0 for s in prof.samples)
    assert prof.dtype == "float32" and prof.hardware["torch_threads"] >= 1
    saved = json.loads(prof.save(tmp_path / "p.json").read_text())
    assert saved["samples"][0]["seconds"] > 0 and saved["table"]


def write_profile(model_dir: Path, path: Path, model: CostModel = LINEAR) -> Path:
    prof = Profile(str(model_dir), "float32", [], model, {"device": "cpu"},
                   Assumptions(decode_batch=8, decode_context=512, prefill_context=512))
    return prof.save(path)


def test_resolve_without_profile_names_flag_and_command(tiny_model_dir: Path, tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    with pytest.raises(ConfigError) as err:
        resolve_token_budget(tiny_model_dir, "auto", 200)
    assert err.value.field == "tbt_slo_ms"
    assert f"chariot tune --model {tiny_model_dir} --dtype auto" in str(err.value)
    assert str(tmp_path / "cache" / "chariot" / "tune" / f"{tiny_model_dir.name}-float32.json") in str(err.value)


def test_resolve_uses_the_tuned_model(tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    write_profile(tiny_model_dir, default_profile_path(tiny_model_dir, "float32"))
    assert resolve_token_budget(tiny_model_dir, "auto", 200) == 160  # tiny's torch_dtype is float32
    assert resolve_token_budget(tiny_model_dir, "float32", 1000.0) == 960
    other = write_profile(tiny_model_dir, tmp_path / "x.json", LINEAR.scaled(0.5))
    assert resolve_token_budget(tiny_model_dir, "float32", 200, profile_path=other) == 352
    with pytest.raises(ConfigError, match="tbt_slo_ms"):
        resolve_token_budget(tiny_model_dir, "float32", 5)


def test_shorter_max_model_len_bounds_the_worst_chunk(tiny_model_dir: Path, tmp_path: Path) -> None:
    attention_bound = CostModel((0.010, 0.001, 0.002, 1e-6, 0.0))  # chunk cost grows with its context
    path = write_profile(tiny_model_dir, tmp_path / "p.json", attention_bound)  # assumes prompts up to 512
    assumed = resolve_token_budget(tiny_model_dir, "float32", 200, path)
    assert resolve_token_budget(tiny_model_dir, "float32", 200, path, max_model_len=4096) == assumed
    shorter = resolve_token_budget(tiny_model_dir, "float32", 200, path, max_model_len=256)
    expected = budget_for_slo(attention_bound, 0.2, Assumptions(decode_batch=8, decode_context=512,
                                                                prefill_context=256))
    assert shorter == expected > assumed


def test_budget_from_flags(tiny_model_dir: Path, tmp_path: Path) -> None:
    path = str(write_profile(tiny_model_dir, tmp_path / "p.json"))
    assert budget_from_flags(str(tiny_model_dir), "auto", "sarathi", 256, None) == 256
    assert budget_from_flags(str(tiny_model_dir), "auto", "sarathi", None, 200, path) == 160
    with pytest.raises(ConfigError, match="not both"):
        budget_from_flags(str(tiny_model_dir), "auto", "sarathi", 256, 200, path)
    with pytest.raises(ConfigError, match="sarathi"):
        budget_from_flags(str(tiny_model_dir), "auto", "vllm", None, 200, path)


def test_stale_profile_of_another_model_is_refused(tiny_model_dir: Path, tmp_path: Path) -> None:
    path = write_profile(tiny_model_dir, tmp_path / "p.json")
    raw = json.loads(path.read_text())
    raw["model"]["shape"]["hidden_size"] = 4096
    path.write_text(json.dumps(raw))
    with pytest.raises(ConfigError, match="another shape"):
        resolve_token_budget(tiny_model_dir, "float32", 200, profile_path=path)


def test_cli_writes_profile_and_prints_table(tiny_model_dir: Path, tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
                                             ) -> None:
    import chariot.worker.tune as tune

    monkeypatch.setattr(tune, "QUICK_GRID", Grid((0, 32, 64), (0, 2, 4), (64, 128), repeats=1))
    out = tmp_path / "t.json"
    assert main(["--model", str(tiny_model_dir), "--dtype", "float32", "--quick", "--out", str(out),
                 "--tbt-slo-ms", "5", "10000", "--decode-batch", "4", "--decode-context", "128",
                 "--prefill-context", "128"]) == 0
    text = capsys.readouterr().out
    assert "| TBT SLO ms | token budget | predicted iteration ms |" in text and str(out) in text
    saved = json.loads(out.read_text())
    assert [r["tbt_slo_ms"] for r in saved["table"]] == [5, 10000]
    budget = resolve_token_budget(tiny_model_dir, "float32", 10000, profile_path=out)
    assert budget == saved["table"][1]["token_budget"] and budget % 32 == 0
