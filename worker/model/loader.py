"""Load one pipeline stage from a Hugging Face checkpoint directory, reading only its own tensors.

A stage worker must not pay (in memory or I/O) for layers it does not run: the module is built on
the `meta` device, allocated once at its final dtype/device, and filled tensor by tensor from only
the safetensors files (shards) that hold its layer range. Every way a directory can be broken
surfaces as a `ModelLoadError` naming the file, field or tensor at fault.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from tqdm import tqdm

from chariot.contracts.errors import ModelLoadError
from chariot.contracts.parallelism import split_layers as split_layers  # re-exported: its old home
from chariot.worker.config import ModelConfig
from chariot.worker.model import cpu_linear
from chariot.worker.model.llama import LlamaStage
from chariot.worker.model.parallel import SINGLE, Collectives

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


def load_stage(
    model_dir: str | Path,
    layer_range: tuple[int, int],
    dtype: torch.dtype,
    device: torch.device | str = "cpu",
    progress: bool = True,
    cpu_linears: bool = True,
    tp: Collectives = SINGLE,
) -> LlamaStage:
    """Build the stage for layers [start, end) and fill it from the checkpoint in `model_dir`; with
    tensor parallelism (`tp`), this rank's shard of them, reading only that shard of each tensor.

    On the CPU its linear layers then become `CpuLinear`s (oneDNN-packed, plus the skinny decode
    kernel: `cpu_linear.py`) unless `cpu_linears` is False (the `nn.Linear` weights are what tests inspect)."""
    path = Path(model_dir)
    config = ModelConfig.from_dir(path)
    start, end = layer_range
    with torch.device("meta"):
        stage = LlamaStage(config, start, end, tp)
    stage = stage.to(dtype=dtype).to_empty(device=device)
    stage.tie_weights()
    plan = _plan_reads(path, stage.weight_names())
    _read_tensors(stage, plan, progress)
    if cpu_linears:
        cpu_linear.cpu_linears(stage, torch.device(device), dtype)
    return stage.eval()


def _plan_reads(path: Path, names: list[str]) -> dict[Path, list[str]]:
    """Group the needed tensor names by the file that holds them; check those files exist."""
    index_path, single_path = path / INDEX_FILE, path / SINGLE_FILE
    if index_path.is_file():
        weight_map = _read_index(index_path)
        plan: dict[Path, list[str]] = {}
        for name in names:
            if name not in weight_map:
                raise ModelLoadError(f"{index_path}: missing tensor {name!r} in weight_map")
            plan.setdefault(path / weight_map[name], []).append(name)
    elif single_path.is_file():
        plan = {single_path: list(names)}
    else:
        raise ModelLoadError(f"{path}: no weights found (expected {SINGLE_FILE} or {INDEX_FILE})")
    for file, wanted in plan.items():
        if not file.is_file():
            raise ModelLoadError(f"missing weight file {file} (holds {wanted[0]!r} and {len(wanted) - 1} more)")
    return plan


def _read_index(index_path: Path) -> dict[str, str]:
    try:
        raw: Any = json.loads(index_path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ModelLoadError(f"{index_path}: malformed JSON ({exc})") from exc
    weight_map = raw.get("weight_map") if isinstance(raw, dict) else None
    if not isinstance(weight_map, dict):
        raise ModelLoadError(f"{index_path}: missing field 'weight_map'")
    return {str(k): str(v) for k, v in weight_map.items()}


def _read_tensors(stage: LlamaStage, plan: dict[Path, list[str]], progress: bool) -> None:
    total = sum(len(names) for names in plan.values())
    desc = f"Loading layers [{stage.start}, {stage.end})"
    if stage.tp.size > 1:
        desc += f", tensor-parallel shard {stage.tp.shard.rank + 1}/{stage.tp.size}"
    with tqdm(total=total, desc=desc, unit="tensor", file=sys.stderr, disable=not progress) as bar:
        for file, names in plan.items():
            with _open_safetensors(file) as handle:
                available = set(handle.keys())
                for name in names:
                    if name not in available:
                        raise ModelLoadError(f"{file}: missing tensor {name!r}")
                    sharded = stage.tp.size > 1
                    stage.load_weight(name, handle.get_slice(name) if sharded else handle.get_tensor(name))
                    bar.update()


@contextmanager
def _open_safetensors(file: Path) -> Iterator[Any]:
    try:
        handle = safe_open(str(file), framework="pt", device="cpu")
    except Exception as exc:  # safetensors raises its own error type for corrupt headers
        raise ModelLoadError(f"{file}: cannot read safetensors file ({exc})") from exc
    with handle as opened:
        yield opened
