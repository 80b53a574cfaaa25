"""Chariot worker: model, paged KV cache, schedulers, executor, engine loop and the offline `LLM` API.

Exports resolve lazily so that light modules (scheduler, block manager, sampling params) can be
imported without loading torch and the model code.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from chariot.worker.errors import ConfigError, InvalidRequestError, ModelLoadError
    from chariot.worker.llm import LLM
    from chariot.worker.outputs import RequestOutput
    from chariot.worker.sampling_params import SamplingParams

_EXPORTS = {
    "LLM": "chariot.worker.llm",
    "RequestOutput": "chariot.worker.outputs",
    "SamplingParams": "chariot.worker.sampling_params",
    "ConfigError": "chariot.worker.errors",
    "InvalidRequestError": "chariot.worker.errors",
    "ModelLoadError": "chariot.worker.errors",
}

__all__ = ["LLM", "ConfigError", "InvalidRequestError", "ModelLoadError", "RequestOutput", "SamplingParams"]


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'chariot.worker' has no attribute {name!r}")
