"""Writes the committed fuzz corpus that `make test` replays against a real router and real workers.

Why a committed corpus and not only property tests: a case that once broke the server (a lone
surrogate, an undecodable gRPC string, a number too large for a float) must be replayed on every run,
byte for byte, whatever the random generator of the day draws. The corpus is the hand-written cases
of issue 15 plus seeded mutations of valid requests; rerun this script only to extend it
(`python -m tests.fuzz.make_corpus`), and commit the result.

Each HTTP case is one JSON line `{"name", "path", "body"}` (or `"body_b64"` when the bytes are not
UTF-8); each gRPC case is `{"name", "method", "body_b64"}` with the raw request message bytes.
"""

from __future__ import annotations

import base64
import json
import random
from pathlib import Path
from typing import Any

from chariot.contracts.proto_codec import request_to_proto
from chariot.contracts.sampling_params import SamplingParams

HERE = Path(__file__).parent
SEED = 15
MUTATIONS_HTTP = 160
MUTATIONS_GRPC = 24
SERVED = "tiny"  # the served model name the corpus tests run the router under

NASTY: list[Any] = [
    None, True, False, 0, -1, 1, 2, 3, 2**31, 2**63, -(2**63), 10**400, 1e308, -1e308, 0.5, 1e-320, 2.0000001,
    "", "x", "\ud800", "\udc00abc", "a\x00b", "\u202e", "é" * 300, "9" * 400, [], [[]], [1, 2, 3], [-1],
    [2**40], ["\ud800"], [""], [None], {}, {"a": 1}, {"type": "json_object"}, [{"role": "user"}],
    [{"role": "user", "content": "\udc00"}], [{"role": "tool", "content": "x"}],
    [{"role": "user", "content": [{"type": "text", "text": "hi"}]}], [{"role": "user", "content": 7}],
]  # fmt: skip

COMPLETION_FIELDS = [
    "prompt", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "stop_token_ids", "stream",
    "stream_options", "ignore_eos", "n", "logprobs", "echo", "presence_penalty", "frequency_penalty",
    "logit_bias", "min_tokens", "user", "model", "suffix", "best_of",
]  # fmt: skip
CHAT_FIELDS = [
    "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "stop", "stream", "n",
    "logprobs", "top_logprobs", "response_format", "tools", "tool_choice", "functions", "user", "model", "seed",
]  # fmt: skip

HAND_WRITTEN_HTTP: list[tuple[str, str, bytes]] = [
    ("lone high surrogate prompt", "/v1/completions", b'{"prompt": "\\ud800abc", "max_tokens": 2}'),
    ("lone low surrogate stop", "/v1/completions", b'{"prompt": "hi", "stop": ["\\udc00"], "max_tokens": 2}'),
    ("lone surrogate in chat content", "/v1/chat/completions",
     b'{"messages": [{"role": "user", "content": "\\ud83d"}], "max_tokens": 2}'),
    ("lone surrogate in user", "/v1/completions", b'{"prompt": "hi", "user": "\\udfff", "max_tokens": 2}'),
    ("lone surrogate in model", "/v1/completions", b'{"prompt": "hi", "model": "\\ud800", "max_tokens": 2}'),
    ("invalid UTF-8 body", "/v1/completions", b'{"prompt": "\xff\xfe", "max_tokens": 2}'),
    ("not JSON", "/v1/completions", b"prompt=hi"),
    ("JSON array", "/v1/completions", b"[1, 2]"),
    ("JSON string", "/v1/chat/completions", b'"hello"'),
    ("empty body", "/v1/completions", b""),
    ("deep nesting", "/v1/completions", b'{"prompt": ' + b"[" * 5000 + b"]" * 5000 + b"}"),
    ("huge integer", "/v1/completions", b'{"prompt": "hi", "max_tokens": 1' + b"0" * 400 + b"}"),
    ("temperature 1e308", "/v1/completions", b'{"prompt": "hi", "temperature": 1e308, "max_tokens": 2}'),
    ("NaN temperature", "/v1/completions", b'{"prompt": "hi", "temperature": NaN, "max_tokens": 2}'),
    ("Infinity top_p", "/v1/completions", b'{"prompt": "hi", "top_p": Infinity, "max_tokens": 2}'),
    ("frequency_penalty string", "/v1/completions", b'{"prompt": "hi", "frequency_penalty": "x", "max_tokens": 2}'),
    ("presence_penalty out of range", "/v1/completions", b'{"prompt": "hi", "presence_penalty": 3, "max_tokens": 2}'),
    ("stop token out of vocabulary", "/v1/completions",
     b'{"prompt": "hi", "stop_token_ids": [99999999], "max_tokens": 2}'),
    ("prompt token out of vocabulary", "/v1/completions", b'{"prompt": [99999999], "max_tokens": 2}'),
    ("negative prompt token", "/v1/completions", b'{"prompt": [-1], "max_tokens": 2}'),
    ("empty prompt list", "/v1/completions", b'{"prompt": [], "max_tokens": 2}'),
    ("duplicate keys", "/v1/completions", b'{"prompt": "hi", "prompt": 5, "max_tokens": 2}'),
    ("unknown model", "/v1/completions", b'{"prompt": "hi", "model": "gpt-5", "max_tokens": 2}'),
    ("tools", "/v1/chat/completions",
     b'{"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function"}], "max_tokens": 2}'),
    ("json response_format", "/v1/chat/completions",
     b'{"messages": [{"role": "user", "content": "hi"}], "response_format": {"type": "json_object"}}'),
    ("max_tokens zero", "/v1/completions", b'{"prompt": "hi", "max_tokens": 0}'),
    ("max_tokens bool", "/v1/completions", b'{"prompt": "hi", "max_tokens": true}'),
    ("stream as string", "/v1/completions", b'{"prompt": "hi", "stream": "yes", "max_tokens": 2}'),
    ("NUL in prompt", "/v1/completions", b'{"prompt": "a\\u0000b", "max_tokens": 2}'),
    ("valid completion", "/v1/completions", b'{"prompt": "hello", "max_tokens": 2}'),
    ("valid streamed chat", "/v1/chat/completions",
     b'{"messages": [{"role": "user", "content": "hello"}], "max_tokens": 2, "stream": true}'),
]  # fmt: skip


def _valid_completion(rng: random.Random) -> dict[str, Any]:
    return {"prompt": rng.choice(["hello", "the cat", [1, 2, 3]]), "max_tokens": rng.randint(1, 4),
            "temperature": rng.choice([0, 0.7]), "stream": rng.random() < 0.5}  # fmt: skip


def _valid_chat(rng: random.Random) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": rng.choice(["hi", "tell me"])}], "max_tokens": rng.randint(1, 4),
            "stream": rng.random() < 0.5}  # fmt: skip


def http_cases(rng: random.Random) -> list[dict[str, Any]]:
    cases = [_http_case(name, path, body) for name, path, body in HAND_WRITTEN_HTTP]
    for i in range(MUTATIONS_HTTP):
        chat = rng.random() < 0.4
        body = _valid_chat(rng) if chat else _valid_completion(rng)
        for _ in range(rng.randint(1, 2)):
            body[rng.choice(CHAT_FIELDS if chat else COMPLETION_FIELDS)] = rng.choice(NASTY)
        path = "/v1/chat/completions" if chat else "/v1/completions"
        cases.append(_http_case(f"mutation {i}", path, json.dumps(body).encode()))
    return cases


def _http_case(name: str, path: str, body: bytes) -> dict[str, Any]:
    try:
        return {"name": name, "path": path, "body": body.decode("utf-8")}
    except UnicodeDecodeError:
        return {"name": name, "path": path, "body_b64": base64.b64encode(body).decode()}


def grpc_cases(rng: random.Random) -> list[dict[str, Any]]:
    valid = request_to_proto("héllo", SamplingParams(max_tokens=2, temperature=0.0), model=SERVED).SerializeToString()
    raw: list[tuple[str, bytes]] = [
        ("invalid UTF-8 in text", valid.replace("é".encode(), b"\xff\xfe")),
        ("truncated message", valid[:-1]),
        ("all 0xff", b"\xff" * 7),
        ("wrong wire type for field 1", b"\x08\x01"),
        ("unterminated varint", b"\x20\xff\xff\xff"),
        ("length beyond the end", b"\x12\x7fabc"),
        ("unknown field", valid + b"\xf8\x07\x01"),
        ("empty message", b""),
        ("valid", valid),
    ]
    for i in range(MUTATIONS_GRPC):
        data = bytearray(valid)
        for _ in range(rng.randint(1, 3)):
            data[rng.randrange(len(data))] = rng.randrange(256)
        raw.append((f"byte flips {i}", bytes(data)))
    return [{"name": n, "method": "/chariot.v1.Generation/Generate", "body_b64": base64.b64encode(b).decode()}
            for n, b in raw]  # fmt: skip


def write(path: Path, cases: list[dict[str, Any]]) -> None:
    path.write_text("".join(json.dumps(c, ensure_ascii=True) + "\n" for c in cases))


def main() -> None:
    rng = random.Random(SEED)
    write(HERE / "http_corpus.jsonl", http_cases(rng))
    write(HERE / "grpc_corpus.jsonl", grpc_cases(rng))


if __name__ == "__main__":
    main()
