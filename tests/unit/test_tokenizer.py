"""The model-directory tokenizer: round trips, BOS handling, streaming detokenization that never
splits a multi-byte character and always adds up to the full decode, and the chat format."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from chariot.contracts.errors import InvalidRequestError, ModelLoadError
from chariot.contracts.tokenizer import IncrementalDetokenizer, Tokenizer

TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "héllo 世界",
    "  leading spaces, tabs\tand\nnewlines  ",
    "emoji 😀🚀 and ünïcödé, Ωmega; 1234567890!",
    "",
]
MESSAGES = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "héllo 世界"},
]


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path) -> Tokenizer:
    return Tokenizer(tiny_model_dir)


@pytest.mark.parametrize("text", TEXTS)
def test_round_trip(tokenizer: Tokenizer, text: str) -> None:
    ids = tokenizer.encode(text)
    assert ids[0] == tokenizer.bos_token_id == 0
    assert tokenizer.decode(ids) == text
    assert tokenizer.decode(tokenizer.encode(text, add_special_tokens=False)) == text


def test_bos_added_exactly_once(tokenizer: Tokenizer, tiny_model_dir: Path) -> None:
    ids = tokenizer.encode("hello")
    assert ids.count(0) == 1
    assert 0 not in tokenizer.encode("hello", add_special_tokens=False)
    assert tokenizer.decode(ids, skip_special_tokens=False).startswith("<|bos|>")
    assert Tokenizer(tiny_model_dir, add_bos=False).encode("hello")[0] == 0  # the post-processor still adds it


def test_special_ids_and_vocab(tokenizer: Tokenizer) -> None:
    assert tokenizer.vocab_size == 512
    assert tokenizer.eos_token_ids == (1,)


def stream(tokenizer: Tokenizer, ids: list[int], prompt: list[int] | None = None) -> list[str]:
    detok = IncrementalDetokenizer(tokenizer, prompt_ids=prompt)
    deltas = [detok.step(i) for i in ids]
    return [*deltas, detok.flush()]


@pytest.mark.parametrize("text", TEXTS)
def test_incremental_equals_full_decode(tokenizer: Tokenizer, text: str) -> None:
    ids = tokenizer.encode(text, add_special_tokens=False)
    deltas = stream(tokenizer, ids)
    assert "".join(deltas) == tokenizer.decode(ids) == text
    assert deltas[-1] == ""  # valid text leaves nothing held back
    assert all("\ufffd" not in d for d in deltas)  # no delta splits a multi-byte character


def test_multibyte_characters_are_held_until_complete(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("世", add_special_tokens=False)
    assert len(ids) > 1  # the tiny vocabulary spells it in byte tokens
    deltas = stream(tokenizer, ids)
    assert deltas[:-2] == [""] * (len(ids) - 1) and deltas[-2] == "世"


def test_incremental_after_prompt(tokenizer: Tokenizer) -> None:
    prompt = tokenizer.encode("Say: ")
    ids = tokenizer.encode("héllo 世界 again", add_special_tokens=False)
    assert "".join(stream(tokenizer, ids, prompt)) == tokenizer.decode(ids)


@settings(max_examples=150, deadline=None)
@given(st.lists(st.integers(min_value=0, max_value=511), max_size=40))
def test_incremental_equals_full_decode_for_any_ids(tiny_model_dir: Path, ids: list[int]) -> None:
    """Random models emit arbitrary tokens (lone UTF-8 continuation bytes, specials): still exact."""
    tokenizer = _cached_tokenizer(tiny_model_dir)
    assert "".join(stream(tokenizer, ids)) == tokenizer.decode(ids)


_TOKENIZERS: dict[Path, Tokenizer] = {}


def _cached_tokenizer(model_dir: Path) -> Tokenizer:
    if model_dir not in _TOKENIZERS:
        _TOKENIZERS[model_dir] = Tokenizer(model_dir)
    return _TOKENIZERS[model_dir]


def test_chat_template(tokenizer: Tokenizer) -> None:
    text = tokenizer.apply_chat_template(MESSAGES)
    assert text == "<|system|>\nBe brief.\n<|user|>\nhéllo 世界\n<|assistant|>\n"
    assert tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=False).endswith("世界\n")
    ids = tokenizer.encode(text)
    for marker in ("<|system|>", "<|user|>", "<|assistant|>"):
        assert tokenizer.backend.token_to_id(marker) in ids


def test_chat_template_matches_transformers(tokenizer: Tokenizer, tiny_model_dir: Path) -> None:
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoTokenizer.from_pretrained(tiny_model_dir)
    assert hf.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True) == (
        tokenizer.apply_chat_template(MESSAGES)
    )
    assert hf("héllo 世界").input_ids == tokenizer.encode("héllo 世界")


@pytest.mark.parametrize("message", [{"role": "user"}, {"content": "hi"}, {"role": "user", "content": 3}])
def test_chat_template_rejects_bad_messages(tokenizer: Tokenizer, message: dict) -> None:
    with pytest.raises(InvalidRequestError, match=r"messages\[1\]"):
        tokenizer.apply_chat_template([MESSAGES[0], message])


def test_missing_tokenizer_json(tmp_path: Path, tiny_model_dir: Path) -> None:
    model_dir = Path(shutil.copytree(tiny_model_dir, tmp_path / "model"))
    (model_dir / "tokenizer.json").unlink()
    with pytest.raises(ModelLoadError, match=r"missing tokenizer.json"):
        Tokenizer(model_dir)


def test_malformed_tokenizer_files(tmp_path: Path, tiny_model_dir: Path) -> None:
    model_dir = Path(shutil.copytree(tiny_model_dir, tmp_path / "model"))
    (model_dir / "tokenizer_config.json").write_text("{oops")
    with pytest.raises(ModelLoadError, match=r"tokenizer_config.json: malformed JSON"):
        Tokenizer(model_dir)
    (model_dir / "tokenizer.json").write_text("{}")
    with pytest.raises(ModelLoadError, match=r"tokenizer.json: cannot parse"):
        Tokenizer(model_dir)
