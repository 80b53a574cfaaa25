"""`hf://` model sources: `chariot fetch-model` against a fake Hugging Face Hub on loopback.

The hub is a real HTTP server speaking the part of the Hub's protocol `huggingface_hub` uses (the
revision API with file sizes, the tree API, then HEAD + GET of each file under `resolve/`), serving a
real checkpoint (the `tiny` test model, as one file or as many shards with an index) as a private
repository: no internet, and the token check is real. A full download is then loaded by the engine and
must generate what the original does; a stage's download holds exactly the shards of its tensors and
loads that stage; a router's holds no weights; pods sharing one directory (a cache claim) fetch each
file once, at one commit, and once everything is there ask the hub nothing.
"""

from __future__ import annotations

import contextlib
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
from typing import Any

import pytest
import torch

from chariot.contracts.errors import ModelLoadError
from chariot.contracts.parallelism import split_layers
from chariot.contracts.tokenizer import Tokenizer
from chariot.operator import render
from chariot.operator.spec import parse_spec
from chariot.worker.model.fetch import INDEX_FILE, MARKER, METADATA_FILES, SINGLE_FILE, StagePart, fetch_model

REPO = "chariot-test/tiny"
TOKEN = "hf_test_token"
COMMIT = "0123456789abcdef0123456789abcdef01234567"


@dataclass
class FakeHub:
    """A private repository `REPO` whose files are those of `model_dir`, plus one Chariot does not need."""

    model_dir: Path
    downloads: list[str] = field(default_factory=list)
    auth_seen: list[str] = field(default_factory=list)
    api_calls: list[str] = field(default_factory=list)  # paths of the model API requests (revision, tree)

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
                if self.path.startswith("/api/models/"):
                    hub.api_calls.append(self.path)
                if self.path.split("?")[0].startswith(api):
                    if not self._authorised():
                        return
                    self._json({"id": REPO, "sha": COMMIT, "private": True,
                                "siblings": [{"rfilename": n, "size": len(d)} for n, d in sorted(hub.files().items())]})
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


@contextlib.contextmanager
def serving(model_dir: Path) -> Iterator[tuple[FakeHub, str]]:
    fake = FakeHub(model_dir)
    server = ThreadingHTTPServer(("127.0.0.1", 0), fake.handler())
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield fake, f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture
def hub(tiny_model_dir: Path) -> Iterator[tuple[FakeHub, str]]:
    """The tiny model as one `model.safetensors`."""
    with serving(tiny_model_dir) as served:
        yield served


@pytest.fixture(scope="module")
def sharded_dir(model_factory: Any) -> Path:
    """The tiny model (2 layers) in ~40 KB shards with an index."""
    path: Path = model_factory("tiny", max_shard_bytes=40_000)
    return path


@pytest.fixture
def sharded_hub(sharded_dir: Path) -> Iterator[tuple[FakeHub, str]]:
    with serving(sharded_dir) as served:
        yield served


def weight_map(model_dir: Path) -> dict[str, str]:
    value: dict[str, str] = json.loads((model_dir / INDEX_FILE).read_text())["weight_map"]
    return value


def expected_shards(model_dir: Path, stage: int, stages: int) -> set[str]:
    """The shards holding stage `stage`'s tensors, worked out here from the index: its layers' tensors,
    the embeddings on the first stage, the final norm and LM head on the last (tiny is untied)."""
    wm, layers = weight_map(model_dir), json.loads((model_dir / "config.json").read_text())["num_hidden_layers"]
    start, end = split_layers(layers, stages)[stage]
    names = [n for n in wm if any(n.startswith(f"model.layers.{i}.") for i in range(start, end))]
    names += ["model.embed_tokens.weight"] if start == 0 else []
    names += ["model.norm.weight", "lm_head.weight"] if end == layers else []
    return {wm[n] for n in names}


def metadata_of(model_dir: Path) -> set[str]:
    return {f for f in METADATA_FILES if (model_dir / f).is_file()}


def test_fetches_what_the_engine_loads_once_and_it_generates_like_the_original(
        hub: tuple[FakeHub, str], tiny_model_dir: Path, tmp_path: Path) -> None:
    fake, endpoint = hub
    target = tmp_path / "models" / "hf" / REPO
    assert fetch_model(f"hf://{REPO}@main", target, token=TOKEN, endpoint=endpoint) == target
    fetched = {p.name for p in target.iterdir() if p.is_file()}
    assert {"config.json", "model.safetensors", "tokenizer.json", MARKER} <= fetched
    assert "pytorch_model.bin" not in fetched and "pytorch_model.bin" not in fake.downloads
    marker = json.loads((target / MARKER).read_text())
    assert marker == {"repo_id": REPO, "revision": "main", "commit": COMMIT,
                      "files": sorted(metadata_of(tiny_model_dir) | {SINGLE_FILE})}
    assert all(a == f"Bearer {TOKEN}" for a in fake.auth_seen)

    # A second run of the same revision (a cache claim shared by pods) downloads nothing.
    fake.downloads.clear()
    fetch_model(f"hf://{REPO}@main", target, token=TOKEN, endpoint=endpoint)
    assert fake.downloads == []

    from chariot.worker import LLM, SamplingParams

    greedy = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    outs = [LLM(str(d), dtype="float32", max_model_len=64, kv_cache_tokens=256, block_size=16, progress=False)
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


# --- what each pod fetches -----------------------------------------------------------------------

def files_in(target: Path) -> set[str]:
    return {p.name for p in target.iterdir() if p.is_file()} - {MARKER}


@pytest.mark.parametrize("stage", [0, 1])
def test_a_stage_fetches_exactly_its_shards_and_loads_from_them(sharded_hub: tuple[FakeHub, str], sharded_dir: Path,
                                                                 tmp_path: Path, stage: int) -> None:
    from chariot.worker.model.loader import load_stage

    fake, endpoint = sharded_hub
    shards = expected_shards(sharded_dir, stage, 2)
    every = set(weight_map(sharded_dir).values())
    assert len(every) > 3 and 0 < len(shards) < len(every)
    target = tmp_path / "m"
    fetch_model(f"hf://{REPO}", target, token=TOKEN, endpoint=endpoint, part=StagePart(stage, 2))
    wanted = metadata_of(sharded_dir) | {INDEX_FILE} | shards
    assert sorted(fake.downloads) == sorted(wanted), "each needed file once, nothing else"
    assert files_in(target) == wanted
    layers = split_layers(2, 2)[stage]
    got = load_stage(target, layers, torch.float32, progress=False, cpu_linears=False).state_dict()
    full = load_stage(sharded_dir, layers, torch.float32, progress=False, cpu_linears=False).state_dict()
    assert got.keys() == full.keys() and all(torch.equal(got[k], full[k]) for k in got)


def test_a_router_fetches_the_config_and_tokenizer_but_no_weights(sharded_hub: tuple[FakeHub, str],
                                                                  sharded_dir: Path, tmp_path: Path) -> None:
    fake, endpoint = sharded_hub
    target = tmp_path / "router"
    fetch_model(f"hf://{REPO}", target, token=TOKEN, endpoint=endpoint, weights=False)
    assert set(fake.downloads) == metadata_of(sharded_dir) and "tokenizer.json" in fake.downloads
    assert not any(f.endswith(".safetensors") or f == INDEX_FILE for f in files_in(target))
    text = "a router only tokenizes"
    assert Tokenizer(target).encode(text) == Tokenizer(sharded_dir).encode(text)


def test_a_single_file_model_is_one_file_for_every_stage(hub: tuple[FakeHub, str], tiny_model_dir: Path,
                                                         tmp_path: Path) -> None:
    fake, endpoint = hub
    fetch_model(f"hf://{REPO}", tmp_path / "s1", token=TOKEN, endpoint=endpoint, part=StagePart(1, 2))
    assert set(fake.downloads) == metadata_of(tiny_model_dir) | {SINGLE_FILE}


def test_pods_sharing_a_cache_fetch_each_file_once_at_one_commit(sharded_hub: tuple[FakeHub, str],
                                                                 sharded_dir: Path, tmp_path: Path) -> None:
    """A cache claim: the router, then stage 1, then stage 0 fetch into one directory; each fetches only
    what the others have not, every later fetch asks for the commit the first one recorded, and once
    a pod's files are all there it asks the hub nothing at all."""
    fake, endpoint = sharded_hub
    cache = tmp_path / "cache"

    def fetch(**kwargs: Any) -> list[str]:
        fake.downloads.clear()
        fetch_model(f"hf://{REPO}@main", cache, token=TOKEN, endpoint=endpoint, **kwargs)
        return sorted(fake.downloads)

    metadata = metadata_of(sharded_dir)
    assert fetch(weights=False) == sorted(metadata)
    first_api = list(fake.api_calls)
    assert [c.split("?")[0] for c in first_api] == [f"/api/models/{REPO}/revision/main"]
    stage1 = expected_shards(sharded_dir, 1, 2)
    assert fetch(part=StagePart(1, 2)) == sorted({INDEX_FILE} | stage1)
    assert fake.api_calls[len(first_api)].split("?")[0] == f"/api/models/{REPO}/revision/{COMMIT}"  # pinned
    stage0 = expected_shards(sharded_dir, 0, 2)
    assert fetch(part=StagePart(0, 2)) == sorted(stage0 - stage1)
    marker = json.loads((cache / MARKER).read_text())
    assert marker["commit"] == COMMIT and set(marker["files"]) == metadata | {INDEX_FILE} | stage0 | stage1

    calls = len(fake.api_calls)
    for kwargs in ({"part": StagePart(0, 2)}, {"part": StagePart(1, 2)}, {"weights": False}, {}):
        assert fetch(**kwargs) == [], kwargs
    assert len(fake.api_calls) == calls, "a pod whose files are all there does not ask the hub"
    assert fetch(part=StagePart(0, 1)) == []  # one stage holding everything: the union is the whole model


def test_progress_and_sizes_are_logged(sharded_hub: tuple[FakeHub, str], sharded_dir: Path, tmp_path: Path,
                                       caplog: pytest.LogCaptureFixture) -> None:
    _, endpoint = sharded_hub
    caplog.set_level("INFO", logger="chariot.worker.model.fetch")
    fetch_model(f"hf://{REPO}", tmp_path / "m", token=TOKEN, endpoint=endpoint, part=StagePart(1, 2),
                progress_every_s=0.001)
    text = caplog.text
    n, total = len(expected_shards(sharded_dir, 1, 2)), len(set(weight_map(sharded_dir).values()))
    assert f"stage 1 of 2 (layers [1, 2) of 2): {n} of {total} weight files, " in text
    assert f"downloading {n} weight files, " in text and " KB" in text
    assert f"[{n}/{n}] model-" in text and "/s" in text
    assert "progress: " in text


def test_the_rendered_init_container_command_fetches_its_stage(sharded_hub: tuple[FakeHub, str], sharded_dir: Path,
                                                               tmp_path: Path) -> None:
    """The operator's init container command for stage 1 of 2, run as the pod runs it (the `chariot` CLI,
    `HF_ENDPOINT` and `HF_TOKEN` from the environment), into a local directory."""
    _, endpoint = sharded_hub
    spec = parse_spec({"model": {"uri": f"hf://{REPO}"}, "parallelism": {"pipeline": 2}}, "m")
    owner = render.Owner("m", "ns", "uid")
    (init,) = render.stage_pod(owner, spec, "img", 0, 1)["spec"]["initContainers"]
    command = init["command"]
    assert command[:2] == ["chariot", "fetch-model"] and command[3] == f"/models/hf/{REPO}"
    target = tmp_path / "pod" / "models"
    cmd = [sys.executable, "-m", "chariot.cli", *command[1:3], str(target), *command[4:]]
    env = {**os.environ, "HF_ENDPOINT": endpoint, "HF_TOKEN": TOKEN}
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert files_in(target) == metadata_of(sharded_dir) | {INDEX_FILE} | expected_shards(sharded_dir, 1, 2)
    assert "weight files" in done.stderr  # the log says what it fetched


def test_an_unreachable_hub_is_a_model_load_error_and_a_complete_old_marker_needs_no_hub(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match=r"hf://org/m: download failed: .*refused"):
        fetch_model("hf://org/m", tmp_path / "m", endpoint="http://127.0.0.1:1")
    old = tmp_path / "old"  # a marker written by a full download of an earlier version: no file list
    old.mkdir()
    (old / MARKER).write_text(json.dumps({"repo_id": "org/m", "revision": "main", "commit": COMMIT}))
    assert fetch_model("hf://org/m", old, endpoint="http://127.0.0.1:1", part=StagePart(0, 2)) == old
