"""Chariot worker: model, paged KV cache, schedulers, executor, engine loop and the offline `LLM` API.

Exports resolve lazily so that the torch-free parts (scheduler, block manager, the CLI's subcommand
registration) import without loading torch and the model code.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from chariot.contracts.errors import ConfigError, InvalidRequestError, ModelLoadError
    from chariot.contracts.outputs import CompletionOutput, RequestOutput
    from chariot.contracts.sampling_params import SamplingParams
    from chariot.worker.llm import LLM

_EXPORTS = {
    "LLM": "chariot.worker.llm",
    "CompletionOutput": "chariot.contracts.outputs",
    "RequestOutput": "chariot.contracts.outputs",
    "SamplingParams": "chariot.contracts.sampling_params",
    "ConfigError": "chariot.contracts.errors",
    "InvalidRequestError": "chariot.contracts.errors",
    "ModelLoadError": "chariot.contracts.errors",
}

__all__ = [
    "LLM", "CompletionOutput", "ConfigError", "InvalidRequestError", "ModelLoadError", "RequestOutput",
    "SamplingParams",
]


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'chariot.worker' has no attribute {name!r}")
