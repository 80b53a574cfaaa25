"""Checkpoint loading by layer range: sharded indexes, reading only a stage's tensors, layer splits,
and a clear `ModelLoadError` for every way a model directory can be broken."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from chariot.contracts.errors import ConfigError, ModelLoadError
from chariot.worker.config import ModelConfig
from chariot.worker.model import loader
from chariot.worker.model.loader import load_stage, split_layers

SHARD_BYTES = 40_000  # the tiny preset (~0.8 MB) splits into many shards


@pytest.fixture(scope="module")
def sharded_dir(model_factory: Any) -> Path:
    return model_factory("tiny", max_shard_bytes=SHARD_BYTES)


@pytest.fixture
def broken(tmp_path: Path, tiny_model_dir: Path) -> Path:
    """A private copy of the tiny checkpoint to break."""
    return Path(shutil.copytree(tiny_model_dir, tmp_path / "model"))


def weight_map(model_dir: Path) -> dict[str, str]:
    return json.loads((model_dir / "model.safetensors.index.json").read_text())["weight_map"]


def test_sharded_checkpoint_loads_same_weights_as_single_file(sharded_dir: Path, tiny_model_dir: Path) -> None:
    assert len(set(weight_map(sharded_dir).values())) > 3
    assert not (sharded_dir / "model.safetensors").exists()
    a = load_stage(sharded_dir, (0, 2), torch.float32, progress=False, cpu_linears=False).state_dict()
    b = load_stage(tiny_model_dir, (0, 2), torch.float32, progress=False, cpu_linears=False).state_dict()
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name


def test_fused_parameters_hold_checkpoint_slices(tiny_model_dir: Path) -> None:
    stage = load_stage(tiny_model_dir, (1, 2), torch.float32, progress=False, cpu_linears=False)
    raw = load_file(str(tiny_model_dir / "model.safetensors"))
    qkv = stage.layers[0].self_attn.qkv_proj.weight
    expected = torch.cat([raw[f"model.layers.1.self_attn.{n}_proj.weight"] for n in "qkv"])
    assert torch.equal(qkv, expected)
    gate_up = stage.layers[0].mlp.gate_up_proj.weight
    assert torch.equal(
        gate_up, torch.cat([raw["model.layers.1.mlp.gate_proj.weight"], raw["model.layers.1.mlp.up_proj.weight"]])
    )


@pytest.mark.parametrize("layer_range", [(0, 1), (1, 2), (0, 2)])
def test_stage_reads_only_its_tensors(
    sharded_dir: Path, monkeypatch: pytest.MonkeyPatch, layer_range: tuple[int, int]
) -> None:
    opened: list[str] = []
    read: list[str] = []
    real_safe_open = loader.safe_open

    class Recording:
        def __init__(self, path: str, **kwargs: Any) -> None:
            opened.append(Path(path).name)
            self._inner = real_safe_open(path, **kwargs)

        def __enter__(self) -> Recording:
            self._handle = self._inner.__enter__()
            return self

        def __exit__(self, *exc: object) -> None:
            self._inner.__exit__(*exc)

        def keys(self) -> list[str]:
            return list(self._handle.keys())

        def get_tensor(self, name: str) -> torch.Tensor:
            read.append(name)
            return self._handle.get_tensor(name)

    monkeypatch.setattr(loader, "safe_open", Recording)
    stage = load_stage(sharded_dir, layer_range, torch.float32, progress=False)
    assert sorted(read) == sorted(stage.weight_names())
    assert len(read) == len(set(read))
    wmap = weight_map(sharded_dir)
    assert sorted(opened) == sorted({wmap[name] for name in read})
    start, end = layer_range
    for name in read:
        if name.startswith("model.layers."):
            assert start <= int(name.split(".")[2]) < end


def test_stage_loads_without_shards_of_other_layers(tmp_path: Path, sharded_dir: Path) -> None:
    model_dir = Path(shutil.copytree(sharded_dir, tmp_path / "model"))
    wmap = weight_map(model_dir)
    needed = {wmap[n] for n in load_stage(model_dir, (1, 2), torch.float32, progress=False).weight_names()}
    others = set(wmap.values()) - needed
    assert others
    for filename in others:
        (model_dir / filename).unlink()
    stage = load_stage(model_dir, (1, 2), torch.float32, progress=False)
    assert stage.is_last and not stage.is_first
    with pytest.raises(ModelLoadError, match=r"missing weight file"):
        load_stage(model_dir, (0, 1), torch.float32, progress=False)


def test_tied_last_stage_reads_embedding_as_lm_head(model_factory: Any) -> None:
    model_dir = model_factory("tiny", arch="qwen2")
    raw = load_file(str(model_dir / "model.safetensors"))
    assert "lm_head.weight" not in raw
    last = load_stage(model_dir, (1, 2), torch.float32, progress=False, cpu_linears=False)
    assert last.embed_tokens is None and last.lm_head is not None
    assert torch.equal(last.lm_head.weight, raw["model.embed_tokens.weight"])
    whole = load_stage(model_dir, (0, 2), torch.float32, progress=False, cpu_linears=False)
    assert whole.lm_head is not None and whole.embed_tokens is not None
    assert whole.lm_head.weight.data_ptr() == whole.embed_tokens.weight.data_ptr()


def test_load_casts_to_requested_dtype(tiny_model_dir: Path) -> None:
    stage = load_stage(tiny_model_dir, (0, 2), torch.bfloat16, progress=False)
    assert {p.dtype for p in stage.parameters()} == {torch.bfloat16}
    assert not any(p.requires_grad for p in stage.parameters())
    assert not any(p.is_meta for p in stage.parameters())


def test_progress_goes_to_stderr(tiny_model_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    load_stage(tiny_model_dir, (0, 2), torch.float32, progress=True)
    assert "Loading layers [0, 2)" in capsys.readouterr().err
    load_stage(tiny_model_dir, (0, 2), torch.float32, progress=False)
    captured = capsys.readouterr()
    assert captured.err == "" and captured.out == ""


@pytest.mark.parametrize(
    ("num_layers", "num_stages", "override", "expected"),
    [
        (8, 1, None, [(0, 8)]),
        (8, 2, None, [(0, 4), (4, 8)]),
        (8, 3, None, [(0, 3), (3, 6), (6, 8)]),
        (10, 4, None, [(0, 3), (3, 6), (6, 8), (8, 10)]),
        (2, 2, None, [(0, 1), (1, 2)]),
        (8, 3, [2, 5, 1], [(0, 2), (2, 7), (7, 8)]),
    ],
)
def test_split_layers(
    num_layers: int, num_stages: int, override: list[int] | None, expected: list[tuple[int, int]]
) -> None:
    assert split_layers(num_layers, num_stages, override) == expected


@pytest.mark.parametrize(
    ("num_stages", "override", "field", "text"),
    [
        (2, [4], "layer_split", "one layer count per stage"),
        (2, [8, 0], "layer_split", "at least 1 layer"),
        (2, [3, 4], "layer_split", "sum to num_layers"),
        (9, None, "pipeline_stages", "8"),
        (0, None, "pipeline_stages", "got 0"),
    ],
)
def test_split_layers_rejects(num_stages: int, override: list[int] | None, field: str, text: str) -> None:
    with pytest.raises(ConfigError, match=text) as info:
        split_layers(8, num_stages, override)
    assert info.value.field == field


@pytest.mark.parametrize("layer_range", [(0, 0), (1, 0), (-1, 1), (0, 3)])
def test_bad_layer_range(tiny_model_dir: Path, layer_range: tuple[int, int]) -> None:
    with pytest.raises(ConfigError, match=r"layer_range"):
        load_stage(tiny_model_dir, layer_range, torch.float32, progress=False)


def _edit_config(model_dir: Path, **changes: Any) -> None:
    path = model_dir / "config.json"
    raw = json.loads(path.read_text())
    for key, value in changes.items():
        if value is None:
            raw.pop(key)
        else:
            raw[key] = value
    path.write_text(json.dumps(raw))


def _drop_tensor(model_dir: Path, name: str) -> None:
    path = model_dir / "model.safetensors"
    tensors = load_file(str(path))
    del tensors[name]
    save_file(tensors, str(path))


def test_missing_directory(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match=r"model directory not found.*nope"):
        load_stage(tmp_path / "nope", (0, 1), torch.float32)


def test_missing_config(broken: Path) -> None:
    (broken / "config.json").unlink()
    with pytest.raises(ModelLoadError, match=r"missing config.json"):
        load_stage(broken, (0, 2), torch.float32)


def test_malformed_config_json(broken: Path) -> None:
    (broken / "config.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match=r"config.json: malformed JSON"):
        load_stage(broken, (0, 2), torch.float32)


@pytest.mark.parametrize("field", ["hidden_size", "num_hidden_layers", "vocab_size", "intermediate_size"])
def test_missing_config_field(broken: Path, field: str) -> None:
    _edit_config(broken, **{field: None})
    with pytest.raises(ModelLoadError, match=f"missing required field '{field}'"):
        load_stage(broken, (0, 2), torch.float32)


def test_unsupported_architecture(broken: Path) -> None:
    _edit_config(broken, architectures=["GPT2LMHeadModel"])
    with pytest.raises(ModelLoadError, match=r"unsupported architecture 'GPT2LMHeadModel'"):
        load_stage(broken, (0, 2), torch.float32)


def test_missing_weights_file(broken: Path) -> None:
    (broken / "model.safetensors").unlink()
    with pytest.raises(ModelLoadError, match=r"no weights found \(expected model.safetensors"):
        load_stage(broken, (0, 2), torch.float32)


def test_corrupt_weights_file(broken: Path) -> None:
    (broken / "model.safetensors").write_bytes(b"\x00" * 16)
    with pytest.raises(ModelLoadError, match=r"model.safetensors: cannot read safetensors"):
        load_stage(broken, (0, 2), torch.float32)


def test_missing_tensor(broken: Path) -> None:
    _drop_tensor(broken, "model.layers.1.mlp.up_proj.weight")
    with pytest.raises(ModelLoadError, match=r"missing tensor 'model.layers.1.mlp.up_proj.weight'"):
        load_stage(broken, (0, 2), torch.float32)
    load_stage(broken, (0, 1), torch.float32, progress=False)  # a stage without layer 1 does not care


def test_wrong_tensor_shape(broken: Path) -> None:
    path = broken / "model.safetensors"
    tensors = load_file(str(path))
    tensors["model.norm.weight"] = torch.ones(3)
    save_file(tensors, str(path))
    with pytest.raises(ModelLoadError, match=r"'model.norm.weight': expected shape \(64,\), got \(3,\)"):
        load_stage(broken, (0, 2), torch.float32)


def test_index_without_tensor(tmp_path: Path, sharded_dir: Path) -> None:
    model_dir = Path(shutil.copytree(sharded_dir, tmp_path / "model"))
    index_path = model_dir / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    del index["weight_map"]["model.layers.0.self_attn.k_proj.weight"]
    index_path.write_text(json.dumps(index))
    with pytest.raises(ModelLoadError, match=r"missing tensor 'model.layers.0.self_attn.k_proj.weight' in weight_map"):
        load_stage(model_dir, (0, 1), torch.float32)


def test_malformed_index(tmp_path: Path, sharded_dir: Path) -> None:
    model_dir = Path(shutil.copytree(sharded_dir, tmp_path / "model"))
    (model_dir / "model.safetensors.index.json").write_text('{"metadata": {}}')
    with pytest.raises(ModelLoadError, match=r"index.json: missing field 'weight_map'"):
        load_stage(model_dir, (0, 1), torch.float32)


def test_reads_transformers_v5_rope_parameters(broken: Path) -> None:
    scaling = {
        "rope_type": "llama3",
        "rope_theta": 5e5,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    }
    _edit_config(broken, rope_theta=None, rope_scaling=None, rope_parameters=scaling)
    config = ModelConfig.from_dir(broken)
    assert config.rope_theta == 5e5
    assert config.rope_scaling is not None and config.rope_scaling.factor == 8.0
