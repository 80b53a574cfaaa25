"""`hf://` model sources: download a Hugging Face model repository into a local directory, once.

Why: a ModelDeployment names `hf://<org>/<name>[@<revision>]` and every pod (each stage, each router)
needs the same checkpoint on local disk before it starts. An init container runs
`chariot fetch-model` into the pod's model volume; with a PersistentVolumeClaim as that volume the
download happens once per claim, since a completed download leaves a marker naming the commit it
fetched and a second run for the same revision does nothing.

Only what Chariot loads is fetched (config, safetensors weights and their index, tokenizer files), so
a repository that also carries `.bin`/`.gguf` copies costs no extra bandwidth. Authentication and the
hub address are `huggingface_hub`'s own: `HF_TOKEN` (the operator fills it from a Secret) and
`HF_ENDPOINT` (a mirror, or a fake hub in tests).
"""

from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass
from pathlib import Path

from chariot.contracts.errors import ModelLoadError

log = logging.getLogger(__name__)

SCHEME = "hf://"
# org/name as the Hub allows them; a revision is a branch, tag or commit (no spaces, no "..").
HF_URI = re.compile(r"^hf://(?P<repo>[A-Za-z0-9][\w.-]*/[\w.-]+)(?:@(?P<revision>[\w./-]+))?$")
MODEL_FILES = ("config.json", "generation_config.json", "*.safetensors", "model.safetensors.index.json",
               "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
MARKER = ".chariot-fetched.json"


@dataclass(frozen=True)
class HfSource:
    """A parsed `hf://` URI."""

    repo_id: str
    revision: str = "main"

    @classmethod
    def parse(cls, uri: str) -> HfSource:
        match = HF_URI.match(uri)
        if match is None or ".." in uri:
            raise ModelLoadError(f"model uri {uri!r}: expected hf://<org>/<name>[@<revision>]")
        return cls(match["repo"], match["revision"] or "main")


def fetch_model(uri: str, target: str | Path, token: str | None = None, endpoint: str | None = None) -> Path:
    """Download `uri`'s model files into `target` (created if needed); returns `target`.

    `endpoint` is the hub's address (default: huggingface_hub's, i.e. `HF_ENDPOINT` when it was set
    before huggingface_hub was imported). A marker written last records the commit; if it is there for
    the same repository and revision, nothing is downloaded again. Raises `ModelLoadError` with the
    hub's reason when the download fails (unknown repository, gated model without a token, network)."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError, RepositoryNotFoundError

    source = HfSource.parse(uri)
    target = Path(target)
    done = _fetched(target)
    if done is not None and (done.get("repo_id"), done.get("revision")) == (source.repo_id, source.revision):
        log.info("%s@%s already in %s (commit %s)", source.repo_id, source.revision, target, done.get("commit"))
        return target
    target.mkdir(parents=True, exist_ok=True)
    log.info("fetching %s@%s into %s", source.repo_id, source.revision, target)
    try:
        snapshot_download(repo_id=source.repo_id, revision=source.revision, local_dir=str(target),
                          allow_patterns=list(MODEL_FILES), token=token or None, endpoint=endpoint or None)
    except RepositoryNotFoundError as exc:
        raise ModelLoadError(f"{uri}: repository not found, or gated/private and no valid token "
                             f"(set HF_TOKEN; the ModelDeployment's spec.model.tokenSecret)") from exc
    except (HfHubHTTPError, LocalEntryNotFoundError, OSError) as exc:
        raise ModelLoadError(f"{uri}: download failed: {exc}") from exc
    if not (target / "config.json").is_file():
        raise ModelLoadError(f"{uri}: the repository has no config.json (not a Hugging Face model directory)")
    commit = _commit_of(target)
    (target / MARKER).write_text(json.dumps({"repo_id": source.repo_id, "revision": source.revision,
                                             "commit": commit}))
    return target


def _fetched(target: Path) -> dict[str, str] | None:
    try:
        value = json.loads((target / MARKER).read_text())
    except (OSError, ValueError):
        return None
    return value if isinstance(value, dict) else None


def _commit_of(target: Path) -> str | None:
    """The commit `snapshot_download` recorded in its local-dir metadata, if any."""
    for meta in sorted((target / ".cache" / "huggingface" / "download").glob("*.metadata")):
        first = meta.read_text().splitlines()[:1]
        if first:
            return first[0].strip() or None
    return None
