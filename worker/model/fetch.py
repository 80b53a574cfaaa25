"""`hf://` model sources: download what one pod needs of a Hugging Face model repository, once.

Why: a ModelDeployment names `hf://<org>/<name>[@<revision>]` and every pod needs part of the
checkpoint on local disk before it starts. An init container runs `chariot fetch-model` into the pod's
model volume, and each pod fetches only what it reads:

- a router reads the tokenizer: `--no-weights` fetches the config and tokenizer files, no weights;
- a pipeline stage reads its own layers: `--stage S --stages P` reads the safetensors index and
  fetches only the shards holding the tensors of stage S's layers (the split is the worker's,
  `chariot.contracts.parallelism.split_layers`), plus the embeddings on the first stage and the final
  norm and LM head (the embeddings again, when tied) on the last
  (`chariot.contracts.parallelism.stage_weight_names`, the rule the loader reads them by); a
  single-file checkpoint is that one file;
- without either, every weight file.

On a large model this is what keeps one stage from waiting on the whole download while the others
time out at the rendezvous. Sizes and progress go to the log.

With a PersistentVolumeClaim as the model volume (`cacheClaim`), pods share the directory: a marker
(`.chariot-fetched.json`) records the repository, the revision, the commit it resolved to and every
file fetched so far, so a pod whose files are all there downloads nothing (without asking the hub),
and a pod that needs more fetches only the rest — at the recorded commit, so every stage of a shared
cache reads one snapshot even if the revision (a branch) has moved since.

Only what Chariot loads is fetched (config, safetensors weights and their index, tokenizer files), so a
repository that also carries `.bin`/`.gguf` copies costs no extra bandwidth. Authentication and the
hub address are `huggingface_hub`'s own: `HF_TOKEN` (the operator fills it from a Secret) and
`HF_ENDPOINT` (a mirror, or a fake hub in tests). Torch-free.
"""

from __future__ import annotations

import json
import logging
import os
import re
import threading
import time
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor, as_completed
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from chariot.contracts.errors import ModelLoadError
from chariot.contracts.parallelism import layer_prefix, split_layers, stage_weight_names

log = logging.getLogger(__name__)

SCHEME = "hf://"
# org/name as the Hub allows them; a revision is a branch, tag or commit (no spaces, no "..").
HF_URI = re.compile(r"^hf://(?P<repo>[A-Za-z0-9][\w.-]*/[\w.-]+)(?:@(?P<revision>[\w./-]+))?$")
CONFIG_FILE = "config.json"
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
# What every pod gets: the model's shape, generation defaults and tokenizer (the router reads these only).
METADATA_FILES = (CONFIG_FILE, "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                  "special_tokens_map.json")
MARKER = ".chariot-fetched.json"
PARALLEL_DOWNLOADS = 4
PROGRESS_EVERY_S = 15.0
LAYER_NAME = re.compile(r"^model\.layers\.(\d+)\.")


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


@dataclass(frozen=True)
class StagePart:
    """The pipeline stage a pod runs: stage `stage` (0-based, the pod's RANK) of `stages`, layers split
    evenly or by `layer_split` (per-stage layer counts), as the worker splits them."""

    stage: int
    stages: int
    layer_split: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if not 0 <= self.stage < self.stages:
            raise ModelLoadError(f"stage {self.stage} of {self.stages}: must be in [0, {self.stages})")

    def layer_range(self, num_layers: int) -> tuple[int, int]:
        split = list(self.layer_split) if self.layer_split and self.stages > 1 else None
        return split_layers(num_layers, self.stages, split)[self.stage]


# --- which weight files a pod needs (pure) -------------------------------------------------------

def stage_tensors(weight_map: dict[str, str], num_layers: int, tied: bool, part: StagePart) -> list[str]:
    """The checkpoint tensors stage `part` loads, by the loader's rule: its layers' tensors (every
    tensor of the index under `model.layers.<i>.`) and the embeddings / final norm / LM head its place
    in the pipeline needs. Raises `ModelLoadError` naming a tensor or layer the index lacks."""
    by_layer: dict[int, list[str]] = {}
    for name in weight_map:
        match = LAYER_NAME.match(name)
        if match:
            by_layer.setdefault(int(match[1]), []).append(name)
    start, end = part.layer_range(num_layers)
    missing = [i for i in range(start, end) if i not in by_layer]
    if missing:
        raise ModelLoadError(f"{INDEX_FILE}: no tensors of layer {missing[0]} ({layer_prefix(missing[0])}*) in "
                             f"weight_map, which stage {part.stage} of {part.stages} loads")
    names = stage_weight_names(start, end, num_layers, tied, lambda i: sorted(by_layer[i]))
    for name in names:
        if name not in weight_map:
            raise ModelLoadError(f"{INDEX_FILE}: missing tensor {name!r} in weight_map "
                                 f"(stage {part.stage} of {part.stages} loads it)")
    return names


def stage_weight_files(weight_map: dict[str, str], num_layers: int, tied: bool, part: StagePart) -> list[str]:
    """The shard files (sorted) holding the tensors stage `part` loads."""
    return sorted({weight_map[name] for name in stage_tensors(weight_map, num_layers, tied, part)})


def weight_files(config: dict[str, Any], index: dict[str, Any] | None, listing: Iterable[str],
                 part: StagePart | None, weights: bool = True) -> list[str]:
    """The weight files a pod fetches: none without `weights`; with a safetensors `index` those holding
    stage `part`'s tensors (every file of the index without a part); without an index the one
    `model.safetensors` of the repository `listing`. Raises `ModelLoadError` when there are no weights."""
    if not weights:
        return []
    if index is not None:
        weight_map = index.get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ModelLoadError(f"{INDEX_FILE}: missing field 'weight_map'")
        weight_map = {str(k): str(v) for k, v in weight_map.items()}
        if part is None:
            return sorted(set(weight_map.values()))
        num_layers = config.get("num_hidden_layers")
        if isinstance(num_layers, bool) or not isinstance(num_layers, int) or num_layers < 1:
            raise ModelLoadError(f"{CONFIG_FILE}: num_hidden_layers must be a positive integer, got {num_layers!r}")
        return stage_weight_files(weight_map, num_layers, bool(config.get("tie_word_embeddings", False)), part)
    if SINGLE_FILE in set(listing):
        return [SINGLE_FILE]  # one file holds every tensor: each stage needs it whole
    raise ModelLoadError(f"no safetensors weights (expected {SINGLE_FILE} or {INDEX_FILE})")


def describe(part: StagePart | None, weights: bool) -> str:
    if not weights:
        return "config and tokenizer only"
    return "all weights" if part is None else f"stage {part.stage} of {part.stages}"


def human_bytes(n: float | None) -> str:
    if n is None:
        return "? B"
    for unit in ("B", "KB", "MB", "GB"):
        if abs(n) < 1000:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"


# --- fetching ------------------------------------------------------------------------------------

def fetch_model(uri: str, target: str | Path, token: str | None = None, endpoint: str | None = None, *,
                part: StagePart | None = None, weights: bool = True,
                progress_every_s: float = PROGRESS_EVERY_S) -> Path:
    """Download what a pod needs of `uri` into `target` (created if needed); returns `target`.

    `part` (a pipeline stage) restricts the weights to the shards that stage loads, `weights=False` to
    none (config and tokenizer only, for routers). `endpoint` is the hub's address (default:
    huggingface_hub's, i.e. `HF_ENDPOINT` when it was set before huggingface_hub was imported). The
    marker records what is in `target`; when every needed file is there for the same repository and
    revision, nothing is downloaded and the hub is not asked. Raises `ModelLoadError` with the hub's
    reason when the download fails (unknown repository, gated model without a token, network)."""
    from huggingface_hub import HfApi
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError, RepositoryNotFoundError

    source = HfSource.parse(uri)
    target = Path(target)
    what = describe(part, weights)
    marker = _marker(target, source)
    have = _have(target, marker)
    if marker is not None and marker.get("files") is None:  # written by a full download of this revision
        log.info("%s@%s already in %s (commit %s)", source.repo_id, source.revision, target, marker.get("commit"))
        return target
    needed = _needed_locally(target, have, part, weights)
    if needed is not None and needed <= have:
        log.info("%s@%s (%s) already in %s (commit %s)", source.repo_id, source.revision, what, target,
                 marker.get("commit") if marker else None)
        return target
    target.mkdir(parents=True, exist_ok=True)
    api = HfApi(endpoint=endpoint or None, token=token or None)
    try:
        # A shared cache stays at the commit it was first fetched at, so its stages read one snapshot.
        pinned = marker.get("commit") if marker else None
        info = api.model_info(source.repo_id, revision=pinned or source.revision, files_metadata=True)
        commit = info.sha or pinned
        sizes = {s.rfilename: s.size for s in info.siblings or []}
        if pinned is None:
            have = set()  # nothing recorded at a known commit: fetch it all afresh
        log.info("fetching %s@%s (commit %s, %s) into %s", source.repo_id, source.revision, commit, what, target)
        if CONFIG_FILE not in sizes:
            raise ModelLoadError(f"{uri}: the repository has no {CONFIG_FILE} (not a Hugging Face model directory)")
        wanted = (*METADATA_FILES, INDEX_FILE) if weights else METADATA_FILES
        small = [f for f in wanted if f in sizes and f not in have]
        fetcher = _Fetcher(source.repo_id, commit, target, token, endpoint, progress_every_s)
        fetcher.download(small, sizes, "config, tokenizer and index files" if weights else "config and tokenizer files")
        config = _read_json(target / CONFIG_FILE)
        index = _read_json(target / INDEX_FILE) if weights and INDEX_FILE in sizes else None
        shards = weight_files(config, index, sizes, part, weights)
        _log_plan(what, shards, sizes, index, config, part)
        fetcher.download([f for f in shards if f not in have], sizes, "weight files")
    except ModelLoadError:
        raise
    except RepositoryNotFoundError as exc:
        raise ModelLoadError(f"{uri}: repository not found, or gated/private and no valid token "
                             f"(set HF_TOKEN; the ModelDeployment's spec.model.tokenSecret)") from exc
    except (HfHubHTTPError, LocalEntryNotFoundError, OSError) as exc:
        raise ModelLoadError(f"{uri}: download failed: {exc}") from exc
    except Exception as exc:  # the HTTP client's own (connection refused, TLS, timeouts): say why, exit 2
        raise ModelLoadError(f"{uri}: download failed: {type(exc).__name__}: {exc}") from exc
    _record(target, source, commit, {*have, *small, *shards})
    return target


def _log_plan(what: str, shards: list[str], sizes: dict[str, int | None], index: dict[str, Any] | None,
              config: dict[str, Any], part: StagePart | None) -> None:
    if not shards:
        log.info("%s: no weight files", what)
        return
    every = sorted(set(index["weight_map"].values())) if index is not None else shards
    layers = ""
    if part is not None and index is not None:
        start, end = part.layer_range(int(config["num_hidden_layers"]))
        layers = f" (layers [{start}, {end}) of {config['num_hidden_layers']})"
    log.info("%s%s: %d of %d weight files, %s of %s", what, layers, len(shards), len(every),
             human_bytes(_total(shards, sizes)), human_bytes(_total(every, sizes)))


def _total(files: Iterable[str], sizes: dict[str, int | None]) -> int | None:
    known = [sizes.get(f) for f in files]
    return None if any(s is None for s in known) else sum(s for s in known if s is not None)


class _Fetcher:
    """Downloads files of one commit into the target directory, a few at a time, logging each file's
    size when it lands and the bytes received so far every `progress_every_s` seconds."""

    def __init__(self, repo_id: str, commit: str | None, target: Path, token: str | None, endpoint: str | None,
                 progress_every_s: float) -> None:
        self.repo_id, self.commit, self.target = repo_id, commit, target
        self.token, self.endpoint, self.every = token or None, endpoint or None, progress_every_s
        self._lock = threading.Lock()
        self._received = 0

    def _count(self, n: int) -> None:
        with self._lock:
            self._received += n

    def download(self, files: list[str], sizes: dict[str, int | None], what: str) -> None:
        if not files:
            return
        total = _total(files, sizes)
        log.info("downloading %d %s, %s", len(files), what, human_bytes(total))
        self._received, started, done = 0, time.monotonic(), 0
        counter = _byte_counter(self._count)
        with ThreadPoolExecutor(max_workers=min(PARALLEL_DOWNLOADS, len(files))) as pool, \
                self._reporting(total, started):
            futures = {pool.submit(self._one, f, counter): f for f in files}
            for future in as_completed(futures):
                if future.exception() is not None:
                    for other in futures:
                        other.cancel()  # the files not started yet; the pod fails on this one anyway
                    future.result()
                done += 1
                name = futures[future]
                log.info("  [%d/%d] %s (%s), %s", done, len(files), name, human_bytes(sizes.get(name)),
                         self._rate(total, started))
        log.info("downloaded %d %s, %s in %.1f s", len(files), what, human_bytes(total), time.monotonic() - started)

    def _one(self, name: str, counter: type) -> None:
        from huggingface_hub import hf_hub_download

        hf_hub_download(self.repo_id, name, revision=self.commit, local_dir=str(self.target), token=self.token,
                        endpoint=self.endpoint, tqdm_class=counter)

    def _rate(self, total: int | None, started: float) -> str:
        elapsed = max(time.monotonic() - started, 1e-6)
        with self._lock:
            got = self._received
        share = f" ({100 * got / total:.0f}%)" if total else ""
        return f"{human_bytes(got)} of {human_bytes(total)}{share} at {human_bytes(got / elapsed)}/s"

    @contextmanager
    def _reporting(self, total: int | None, started: float) -> Iterator[None]:
        stop = threading.Event()

        def report() -> None:
            while not stop.wait(self.every):
                log.info("  progress: %s", self._rate(total, started))

        thread = threading.Thread(target=report, name="fetch-progress", daemon=True)
        thread.start()
        try:
            yield
        finally:
            stop.set()
            thread.join()


def _byte_counter(count: Any) -> type:
    """A silent tqdm class that hands every byte count huggingface_hub reports to `count`."""
    from tqdm import tqdm

    class Counter(tqdm):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            kwargs["disable"] = True
            super().__init__(*args, **kwargs)

        def update(self, n: float | None = 1) -> bool | None:
            count(int(n or 0))
            result: bool | None = super().update(n)
            return result

    return Counter


# --- the marker ----------------------------------------------------------------------------------

def _marker(target: Path, source: HfSource) -> dict[str, Any] | None:
    """The marker of `target` when it is for `source`'s repository and revision."""
    try:
        value = json.loads((target / MARKER).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(value, dict) or (value.get("repo_id"), value.get("revision")) != (source.repo_id,
                                                                                         source.revision):
        return None
    return value


def _have(target: Path, marker: dict[str, Any] | None) -> set[str]:
    """Files the marker records that are still in `target`."""
    files = (marker or {}).get("files") or []
    return {f for f in files if isinstance(f, str) and (target / f).is_file()}


def _needed_locally(target: Path, have: set[str], part: StagePart | None, weights: bool) -> set[str] | None:
    """What this pod needs, worked out from the files already fetched (None when the config or index
    is not among them, so only the hub can tell)."""
    if CONFIG_FILE not in have:
        return None
    try:
        config = _read_json(target / CONFIG_FILE)
        index = _read_json(target / INDEX_FILE) if INDEX_FILE in have else None
        shards = weight_files(config, index, have, part, weights)
    except ModelLoadError:
        return None
    metadata = {f for f in METADATA_FILES if f in have} | {CONFIG_FILE}
    return metadata | set(shards) | ({INDEX_FILE} if index is not None else set())


def _record(target: Path, source: HfSource, commit: str | None, files: set[str]) -> None:
    """Add `files` to the marker (written last, atomically; files other pods recorded at the same
    commit meanwhile are kept)."""
    current = _marker(target, source)
    if current is not None and current.get("commit") == commit:
        files |= {f for f in current.get("files") or [] if isinstance(f, str)}
    value = {"repo_id": source.repo_id, "revision": source.revision, "commit": commit, "files": sorted(files)}
    tmp = target / f"{MARKER}.{os.getpid()}.tmp"
    tmp.write_text(json.dumps(value))
    tmp.replace(target / MARKER)


def _read_json(path: Path) -> dict[str, Any]:
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"{path}: cannot read JSON ({exc})") from exc
    if not isinstance(value, dict):
        raise ModelLoadError(f"{path}: expected a JSON object")
    return value
