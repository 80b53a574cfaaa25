"""Generated checkpoints: deterministic per seed, HF-compatible config, exact vocabulary size,
sharding, and random weights that greedy-decode to varied tokens (not one repeated token)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from chariot.contracts.errors import ConfigError
from chariot.contracts.tokenizer import Tokenizer
from chariot.worker.cli import PRESET_NAMES
from chariot.worker.config import ModelConfig
from chariot.worker.model.loader import load_stage
from chariot.worker.model.make_model import (
    PRESETS,
    build_config,
    greedy_generate,
    make_model,
    synthetic_tokenizer,
    train_tokenizer,
    weight_shapes,
)

FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json", "model.safetensors")


def test_same_seed_gives_identical_files(tmp_path: Path, tiny_model_dir: Path) -> None:
    again = make_model(tmp_path / "again", "tiny", seed=0, progress=False)
    for name in FILES:
        assert (again / name).read_bytes() == (tiny_model_dir / name).read_bytes(), name


def test_without_weights_a_router_gets_the_same_config_and_tokenizer(tmp_path: Path, tiny_model_dir: Path) -> None:
    """What a router's init container makes (`chariot make-model --no-weights`): the same files as a stage's,
    for the same seed, minus the weights."""
    router = make_model(tmp_path / "router", "tiny", seed=0, progress=False, weights=False)
    assert sorted(p.name for p in router.iterdir()) == sorted(FILES[:-1])
    for name in FILES[:-1]:
        assert (router / name).read_bytes() == (tiny_model_dir / name).read_bytes(), name


def test_different_seed_gives_different_weights(tmp_path: Path, tiny_model_dir: Path) -> None:
    other = make_model(tmp_path / "other", "tiny", seed=1, progress=False)
    a, b = load_file(str(tiny_model_dir / "model.safetensors")), load_file(str(other / "model.safetensors"))
    assert a.keys() == b.keys()
    assert not torch.equal(a["model.layers.0.self_attn.q_proj.weight"], b["model.layers.0.self_attn.q_proj.weight"])


# Presets small enough to write in CI (llama3-8b is 16 GB of weights: its shape is checked without them).
WRITABLE = [name for name in PRESETS if name != "llama3-8b"]


def test_cli_offers_every_preset() -> None:
    assert tuple(PRESETS) == PRESET_NAMES


def test_llama3_8b_preset_has_llama3_8b_shape() -> None:
    config = build_config("llama3-8b", "llama", None, None, None)
    assert sum(math.prod(shape) for _, shape in weight_shapes(config)) == 8_030_261_248  # Meta's published count
    assert (config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]) == (32, 8, 128)


@pytest.mark.parametrize("preset", WRITABLE)
def test_config_matches_preset(model_factory: Any, preset: str) -> None:
    model_dir = model_factory(preset)
    raw = json.loads((model_dir / "config.json").read_text())
    p = PRESETS[preset]
    assert raw["architectures"] == ["LlamaForCausalLM"] and raw["model_type"] == "llama"
    assert raw["torch_dtype"] == p.dtype and raw["tie_word_embeddings"] is False
    config = ModelConfig.from_dir(model_dir)
    shape = (config.hidden_size, config.num_layers, config.num_heads, config.num_kv_heads)
    assert shape == (p.hidden_size, p.num_layers, p.num_heads, p.num_kv_heads)
    assert (config.intermediate_size, config.vocab_size) == (p.intermediate_size, p.vocab_size)
    assert config.max_position_embeddings == p.max_position_embeddings
    assert (config.bos_token_id, config.eos_token_ids) == (0, (1,))
    generation = json.loads((model_dir / "generation_config.json").read_text())
    assert generation["eos_token_id"] == 1


@pytest.mark.parametrize(
    ("arch", "architecture", "bias", "tied"),
    [
        ("llama", "LlamaForCausalLM", False, False),
        ("mistral", "MistralForCausalLM", False, False),
        ("qwen2", "Qwen2ForCausalLM", True, True),
    ],
)
def test_architectures(model_factory: Any, arch: str, architecture: str, bias: bool, tied: bool) -> None:
    model_dir = model_factory("tiny", arch=arch)
    config = ModelConfig.from_dir(model_dir)
    assert (config.architecture, config.qkv_bias, config.tie_word_embeddings) == (architecture, bias, tied)
    names = set(load_file(str(model_dir / "model.safetensors")))
    assert ("model.layers.0.self_attn.q_proj.bias" in names) == bias
    assert ("lm_head.weight" in names) == (not tied)


def test_rope_scaling_and_dtype_override(model_factory: Any) -> None:
    scaling = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 256,
    }
    model_dir = model_factory("tiny", rope_scaling=scaling, dtype="bfloat16")
    config = ModelConfig.from_dir(model_dir)
    assert config.rope_scaling is not None and config.rope_scaling.original_max_position_embeddings == 256
    assert config.torch_dtype == "bfloat16"
    tensors = load_file(str(model_dir / "model.safetensors"))
    assert {t.dtype for t in tensors.values()} == {torch.bfloat16}


@pytest.mark.parametrize("preset", WRITABLE)
def test_tokenizer_vocab_size_is_exact(model_factory: Any, preset: str) -> None:
    tokenizer = Tokenizer(model_factory(preset))
    assert tokenizer.vocab_size == PRESETS[preset].vocab_size
    assert tokenizer.backend.token_to_id("<|bos|>") == 0 and tokenizer.backend.token_to_id("<|eos|>") == 1
    assert tokenizer.backend.token_to_id("<|assistant|>") is not None


def test_tokenizer_training_is_deterministic() -> None:
    a = train_tokenizer(8192, seed=0)
    assert a.get_vocab_size() == 8192
    assert a.to_str() == train_tokenizer(8192, seed=0).to_str()


def test_100m_is_sharded_bf16(model_100m_dir: Path) -> None:
    index = json.loads((model_100m_dir / "model.safetensors.index.json").read_text())
    files = set(index["weight_map"].values())
    assert len(files) >= 2 and all((model_100m_dir / f).is_file() for f in files)
    sizes = sum((model_100m_dir / f).stat().st_size for f in files)
    assert 0.99 * sizes < index["metadata"]["total_size"] <= sizes
    assert 100e6 < index["metadata"]["total_size"] / 2 < 120e6  # ~100M bf16 parameters
    assert not (model_100m_dir / "model.safetensors").exists()


def test_writing_shows_progress(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    make_model(tmp_path / "m", "tiny", max_shard_bytes=100_000)
    err = capsys.readouterr().err
    assert "Generating weights" in err and "Writing shards" in err


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [({"preset": "huge"}, "preset"), ({"arch": "gpt2"}, "arch"), ({"dtype": "int8"}, "dtype")],
)
def test_rejects_unknown_options(tmp_path: Path, kwargs: dict[str, str], field: str) -> None:
    args: dict[str, Any] = {"preset": "tiny", **kwargs}
    with pytest.raises(ConfigError) as info:
        make_model(tmp_path / "m", progress=False, **args)
    assert info.value.field == field


@pytest.mark.parametrize("preset", WRITABLE)
def test_greedy_decoding_gives_varied_tokens(model_factory: Any, preset: str) -> None:
    model_dir = model_factory(preset)
    config = ModelConfig.from_dir(model_dir)
    dtype = torch.bfloat16 if config.torch_dtype == "bfloat16" else torch.float32
    stage = load_stage(model_dir, (0, config.num_layers), dtype, progress=False)
    tokenizer = Tokenizer(model_dir)
    for prompt in ("The quick brown fox", "Hello", "Once upon a time there was a model"):
        out = greedy_generate(stage, tokenizer.encode(prompt), 32)
        assert len(out) == 32
        assert len(set(out)) >= 8, (prompt, out)


def test_reduced_depth_checkpoint_with_synthetic_tokenizer_loads_and_decodes(tmp_path: Path) -> None:
    model_dir = make_model(tmp_path / "m", "small", num_layers=2, tokenizer="synthetic", progress=False)
    config = ModelConfig.from_dir(model_dir)
    assert config.num_layers == 2 and config.intermediate_size == PRESETS["small"].intermediate_size
    tokenizer = Tokenizer(model_dir)
    assert tokenizer.vocab_size == PRESETS["small"].vocab_size
    ids = tokenizer.encode("Hello, café 世界")
    assert ids[0] == 0 and tokenizer.decode(ids) == "Hello, café 世界"
    stage = load_stage(model_dir, (0, 2), torch.float32, progress=False)
    assert len(set(greedy_generate(stage, ids, 16))) >= 4


def test_synthetic_tokenizer_has_the_exact_vocabulary_without_training() -> None:
    vocab = PRESETS["llama3-8b"].vocab_size
    tokenizer = synthetic_tokenizer(vocab)
    assert tokenizer.get_vocab_size() == vocab and tokenizer.token_to_id("<|eos|>") == 1
    assert tokenizer.to_str() == synthetic_tokenizer(vocab).to_str()
    with pytest.raises(ConfigError) as info:
        synthetic_tokenizer(100)
    assert info.value.field == "vocab_size"


@pytest.mark.parametrize(("kwargs", "field"), [({"tokenizer": "bpe"}, "tokenizer"), ({"num_layers": 0}, "num_layers")])
def test_rejects_bad_depth_or_tokenizer_kind(tmp_path: Path, kwargs: dict[str, Any], field: str) -> None:
    with pytest.raises(ConfigError) as info:
        make_model(tmp_path / "m", "tiny", progress=False, **kwargs)
    assert info.value.field == field
