"""Shared fixtures: random-initialised preset checkpoints, made once per test session.

`model_factory(preset, **make_model_kwargs)` writes (and caches) a checkpoint directory; the named
fixtures are the common ones. Tests that modify a checkpoint must copy it first.
"""

from __future__ import annotations

import importlib
import json
import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

# Without a GPU the Triton kernels run under the Triton interpreter, which must be switched on before
# anything in the process imports `triton` (Triton fixes its jit helpers' mode at import). Set here,
# at the first import pytest makes, so test collection order cannot matter. Subprocesses inherit it
# harmlessly: without CUDA the default attention backend is the C++ CPU kernel, not Triton.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# One compiled CPU attention kernel for the whole session, pods of the e2e test kubelet included (it
# gives each pod its own HOME, which would otherwise mean one ~25 s compile per pod).
os.environ.setdefault("CHARIOT_KERNEL_CACHE", str(Path.home() / ".cache" / "chariot" / "kernels"))
# The kernel tests check the build for this CPU (its AVX-512 paths where it has them), also where an
# image carries the portable baseline build that `auto` would load instead.
os.environ.setdefault("CHARIOT_KERNEL_BUILD", "native")

import chariot.kernels as kernels
from chariot.worker.model.make_model import make_model


def import_installed(name: str) -> None:
    """Import the installed package `name`, if there is one, ahead of the repository's top folder of
    that name.

    pytest puts the repository root on sys.path (`pythonpath = ["."]`, for the `tests.*` helpers),
    and there the layout's top folders shadow installed packages with the same names. transformers
    (since 5.25) imports Hugging Face's `kernels` package, and got `kernels/__init__.py` instead.
    Chariot's code imports its folders only as `chariot.<folder>`, so the bare name is free for the
    installed package. Once it is in `sys.modules`, every later import gets it."""
    root = Path(__file__).resolve().parents[1]
    saved = sys.path[:]
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != root]
    try:
        importlib.import_module(name)
    except ImportError:
        pass  # not installed: nothing for the folder to shadow
    finally:
        sys.path[:] = saved


import_installed("kernels")

ModelFactory = Callable[..., Path]


@pytest.fixture(scope="session")
def model_factory(tmp_path_factory: pytest.TempPathFactory) -> ModelFactory:
    cache: dict[str, Path] = {}

    def make(preset: str = "tiny", **kwargs: Any) -> Path:
        key = json.dumps([preset, kwargs], sort_keys=True)
        if key not in cache:
            out = tmp_path_factory.mktemp(f"model-{preset}")
            cache[key] = make_model(out, preset, progress=False, **kwargs)
        return cache[key]

    return make


@pytest.fixture(scope="session")
def tiny_model_dir(model_factory: ModelFactory) -> Path:
    return model_factory("tiny")


@pytest.fixture(scope="session")
def small_model_dir(model_factory: ModelFactory) -> Path:
    return model_factory("small")


@pytest.fixture(scope="session")
def model_100m_dir(model_factory: ModelFactory) -> Path:
    return model_factory("100m")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """GPU tests are deselected (reported as such, not as skipped passes) where CUDA is absent; the
    files holding `slow` tests run first (`slow_files_first`)."""
    if not torch.cuda.is_available():
        gpu = [item for item in items if item.get_closest_marker("gpu")]
        if gpu:
            config.hook.pytest_deselected(items=gpu)
            items[:] = [item for item in items if not item.get_closest_marker("gpu")]
    slow_files_first(items)


def slow_files_first(items: list[pytest.Item]) -> None:
    """Reorder, stably, so that every test file holding a `slow` test comes before the others. With
    `make test`'s two processes taking whole files in this order, the long files start early and the
    short ones fill in at the end, instead of one process running a long file alone at the end."""
    slow = {item.path for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: item.path not in slow)


@pytest.fixture
def triton_backend() -> Iterator[None]:
    """The Triton attention backend, the engine's on CUDA and the one graphs are captured with (another
    may be selected by the process's environment); the process's own choice afterwards."""
    kernels.select_backend("triton")
    yield
    kernels.select_backend()
