"""Text ↔ token ids for a model directory, including streaming detokenization and chat formatting.

Wraps the Rust `tokenizers` library directly (no `transformers` at serving time). Streaming needs
care: a byte-level BPE token can end in the middle of a multi-byte UTF-8 character, so
`IncrementalDetokenizer` holds text back until it decodes cleanly and only ever emits deltas whose
concatenation equals the full decode.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as HFTokenizer

from chariot.contracts.errors import InvalidRequestError, ModelLoadError

DEFAULT_CHAT_FORMAT = {"message": "<|{role}|>\n{content}\n", "generation_prompt": "<|assistant|>\n"}
REPLACEMENT_CHAR = "\ufffd"


class Tokenizer:
    """The tokenizer of one model directory (`tokenizer.json`, `tokenizer_config.json`, `config.json`)."""

    def __init__(self, model_dir: str | Path, add_bos: bool | None = None) -> None:
        path = Path(model_dir)
        tok_path = path / "tokenizer.json"
        if not tok_path.is_file():
            raise ModelLoadError(f"{tok_path}: missing tokenizer.json")
        try:
            self._tk = HFTokenizer.from_file(str(tok_path))
        except Exception as exc:  # the Rust library raises a bare Exception on malformed files
            raise ModelLoadError(f"{tok_path}: cannot parse tokenizer ({exc})") from exc
        self._config = _read_json(path / "tokenizer_config.json")
        model_config = _read_json(path / "config.json")
        self.bos_token_id = self._token_id(self._config.get("bos_token"), model_config.get("bos_token_id"))
        self.add_bos = bool(self._config.get("add_bos_token", False)) if add_bos is None else add_bos
        self.eos_token_ids = self._eos_ids(model_config, _read_json(path / "generation_config.json"))

    @property
    def vocab_size(self) -> int:
        return int(self._tk.get_vocab_size(with_added_tokens=True))

    @property
    def backend(self) -> HFTokenizer:
        """The underlying `tokenizers.Tokenizer`."""
        return self._tk

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; with special tokens, BOS is present exactly once when `add_bos`."""
        ids: list[int] = self._tk.encode(text, add_special_tokens=add_special_tokens).ids
        bos = self.bos_token_id
        if add_special_tokens and self.add_bos and bos is not None and ids[:1] != [bos]:
            ids.insert(0, bos)
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return str(self._tk.decode(list(ids), skip_special_tokens=skip_special_tokens))

    def apply_chat_template(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        """Render chat messages as a prompt string using the model's simple chat format."""
        fmt = self._config.get("chariot_chat_format") or DEFAULT_CHAT_FORMAT
        parts = []
        for i, message in enumerate(messages):
            role, content = message.get("role"), message.get("content")
            if not isinstance(role, str) or not isinstance(content, str):
                raise InvalidRequestError(f"messages[{i}]", "needs string 'role' and 'content'")
            parts.append(fmt["message"].replace("{role}", role).replace("{content}", content))
        if add_generation_prompt:
            parts.append(fmt["generation_prompt"])
        return "".join(parts)

    def _token_id(self, token: Any, fallback: Any) -> int | None:
        if isinstance(token, dict):  # {"content": "<s>", ...} in older configs
            token = token.get("content")
        token_id = self._tk.token_to_id(token) if isinstance(token, str) else None
        if token_id is not None:
            return int(token_id)
        return int(fallback) if isinstance(fallback, int) else None

    def _eos_ids(self, model_config: dict[str, Any], generation_config: dict[str, Any]) -> tuple[int, ...]:
        ids: list[int] = []
        for value in (model_config.get("eos_token_id"), generation_config.get("eos_token_id")):
            ids += value if isinstance(value, list) else [value] if isinstance(value, int) else []
        tok_eos = self._token_id(self._config.get("eos_token"), None)
        if tok_eos is not None:
            ids.append(tok_eos)
        return tuple(dict.fromkeys(int(i) for i in ids))


class IncrementalDetokenizer:
    """Turns a stream of generated token ids into text deltas.

    Keeps two offsets into the ids: text up to `read` has been emitted, and decoding restarts at
    `prefix` (a little before `read`, so tokenizers that drop a leading space when decoding a
    fragment still see context). A delta is emitted only once the decoded window does not end in
    U+FFFD, i.e. no multi-byte character is left half-finished; `flush` emits whatever remains.
    """

    def __init__(
        self, tokenizer: Tokenizer, prompt_ids: list[int] | None = None, skip_special_tokens: bool = True
    ) -> None:
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self._ids: list[int] = list(prompt_ids or [])
        self._read = len(self._ids)
        self._prefix = max(self._read - 5, 0)

    def step(self, token_id: int) -> str:
        """Add one token; return the newly completed text (possibly empty)."""
        self._ids.append(token_id)
        prefix_text, new_text = self._decode_window()
        if len(new_text) <= len(prefix_text) or new_text.endswith(REPLACEMENT_CHAR):
            return ""
        self._prefix, self._read = self._read, len(self._ids)
        return new_text[len(prefix_text) :]

    def flush(self) -> str:
        """Emit any held-back text (e.g. an unfinished byte sequence at the end of generation)."""
        prefix_text, new_text = self._decode_window()
        self._prefix, self._read = self._read, len(self._ids)
        return new_text[len(prefix_text) :]

    def _decode_window(self) -> tuple[str, str]:
        prefix_text = self._tokenizer.decode(self._ids[self._prefix : self._read], self._skip)
        new_text = self._tokenizer.decode(self._ids[self._prefix :], self._skip)
        return prefix_text, new_text


def _read_json(path: Path) -> dict[str, Any]:
    """A JSON object file's content; {} if the optional file is absent."""
    if not path.is_file():
        return {}
    try:
        value = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ModelLoadError(f"{path}: malformed JSON ({exc})") from exc
    return value if isinstance(value, dict) else {}
