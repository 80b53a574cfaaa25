"""`hf://` model sources: `chariot fetch-model` against a fake Hugging Face Hub on loopback.

The hub is a real HTTP server speaking the part of the Hub's protocol `huggingface_hub` uses for a
snapshot (the revision and tree APIs, then HEAD + GET of each file under `resolve/`), serving a real checkpoint
(the `tiny` test model) as a private repository: no internet, and the token check is real. The
downloaded directory is then loaded by the engine and must generate what the original does.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from chariot.contracts.errors import ModelLoadError
from chariot.worker.model.fetch import MARKER, fetch_model

REPO = "chariot-test/tiny"
TOKEN = "hf_test_token"
COMMIT = "0123456789abcdef0123456789abcdef01234567"


@dataclass
class FakeHub:
    """A private repository `REPO` whose files are those of `model_dir`, plus one Chariot does not need."""

    model_dir: Path
    downloads: list[str] = field(default_factory=list)
    auth_seen: list[str] = field(default_factory=list)

    def files(self) -> dict[str, bytes]:
        out = {p.name: p.read_bytes() for p in self.model_dir.iterdir() if p.is_file()}
        out["pytorch_model.bin"] = b"not needed: safetensors are loaded"
        return out

    def handler(self) -> type[BaseHTTPRequestHandler]:
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:
                pass

            def _authorised(self) -> bool:
                auth = self.headers.get("Authorization", "")
                hub.auth_seen.append(auth)
                if auth == f"Bearer {TOKEN}":
                    return True
                self.send_response(401)
                self.send_header("X-Error-Code", "RepoNotFound")
                self.send_header("X-Error-Message", "Repository not found")
                self.end_headers()
                return False

            def _file(self, head: bool) -> None:
                prefix = f"/{REPO}/resolve/"
                if not self.path.startswith(prefix) or not self._authorised():
                    if not self.path.startswith(prefix):
                        self.send_error(404)
                    return
                _revision, _, name = self.path[len(prefix):].partition("/")
                data = hub.files().get(name)
                if data is None:
                    self.send_response(404)
                    self.send_header("X-Error-Code", "EntryNotFound")
                    self.end_headers()
                    return
                self.send_response(200)
                self.send_header("X-Repo-Commit", COMMIT)
                self.send_header("ETag", f'"{hashlib.sha256(data).hexdigest()}"')
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                if not head:
                    hub.downloads.append(name)
                    self.wfile.write(data)

            def _json(self, value: object) -> None:
                body = json.dumps(value).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_HEAD(self) -> None:
                self._file(head=True)

            def do_GET(self) -> None:
                api = f"/api/models/{REPO}/revision/"
                if self.path.split("?")[0].startswith(api):
                    if not self._authorised():
                        return
                    self._json({"id": REPO, "sha": COMMIT, "private": True,
                                "siblings": [{"rfilename": n} for n in sorted(hub.files())]})
                    return
                tree = f"/api/models/{REPO}/tree/"
                if self.path.split("?")[0].startswith(tree):  # the file listing of a revision
                    if not self._authorised():
                        return
                    self._json([{"type": "file", "path": n, "size": len(d), "oid": hashlib.sha1(d).hexdigest()}
                                for n, d in sorted(hub.files().items())])
                    return
                if self.path.startswith("/api/"):
                    self.send_response(401)
                    self.send_header("X-Error-Code", "RepoNotFound")
                    self.end_headers()
                    return
                self._file(head=False)

        return Handler


@pytest.fixture
def hub(tiny_model_dir: Path) -> Iterator[tuple[FakeHub, str]]:
    fake = FakeHub(tiny_model_dir)
    server = ThreadingHTTPServer(("127.0.0.1", 0), fake.handler())
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield fake, f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def test_fetches_what_the_engine_loads_once_and_it_generates_like_the_original(
        hub: tuple[FakeHub, str], tiny_model_dir: Path, tmp_path: Path) -> None:
    fake, endpoint = hub
    target = tmp_path / "models" / "hf" / REPO
    assert fetch_model(f"hf://{REPO}@main", target, token=TOKEN, endpoint=endpoint) == target
    fetched = {p.name for p in target.iterdir() if p.is_file()}
    assert {"config.json", "model.safetensors", "tokenizer.json", MARKER} <= fetched
    assert "pytorch_model.bin" not in fetched and "pytorch_model.bin" not in fake.downloads
    marker = json.loads((target / MARKER).read_text())
    assert marker == {"repo_id": REPO, "revision": "main", "commit": COMMIT}
    assert all(a == f"Bearer {TOKEN}" for a in fake.auth_seen)

    # A second run of the same revision (a cache claim shared by pods) downloads nothing.
    fake.downloads.clear()
    fetch_model(f"hf://{REPO}@main", target, token=TOKEN, endpoint=endpoint)
    assert fake.downloads == []

    from chariot.worker import LLM, SamplingParams

    greedy = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    outs = [LLM(str(d), dtype="float32", max_model_len=64, kv_cache_tokens=256, progress=False)
            .generate(["a fetched model"], greedy)[0].token_ids for d in (tiny_model_dir, target)]
    assert outs[0] == outs[1]


def test_a_private_repository_without_the_token_fails_naming_hf_token(hub: tuple[FakeHub, str],
                                                                      tmp_path: Path) -> None:
    _, endpoint = hub
    with pytest.raises(ModelLoadError, match="HF_TOKEN"):
        fetch_model(f"hf://{REPO}", tmp_path / "m", token=None, endpoint=endpoint)
    assert not (tmp_path / "m" / MARKER).exists()


@pytest.mark.parametrize("uri", ["hf://just-a-name", "hf://org/name@", "hf://../etc@x", "s3://org/name"])
def test_malformed_uris_are_rejected(uri: str, tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="hf://<org>/<name>"):
        fetch_model(uri, tmp_path / "m")


def test_the_cli_is_what_the_init_container_runs(hub: tuple[FakeHub, str], tmp_path: Path) -> None:
    _, endpoint = hub
    env = {**os.environ, "HF_ENDPOINT": endpoint, "HF_TOKEN": TOKEN}
    cmd = [sys.executable, "-m", "chariot.cli", "fetch-model", f"hf://{REPO}", str(tmp_path / "m")]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "m" / "config.json").is_file()
    env.pop("HF_TOKEN")
    failed = subprocess.run([*cmd[:-1], str(tmp_path / "other")], env=env, capture_output=True, text=True,
                            timeout=120)
    assert failed.returncode == 2 and "HF_TOKEN" in failed.stderr
