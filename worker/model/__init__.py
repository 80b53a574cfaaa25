"""The Llama-family model: stage modules, checkpoint loading by layer range, and preset checkpoints."""

from chariot.worker.model.llama import LlamaStage, allocate_kv_caches
from chariot.worker.model.loader import load_stage, split_layers
from chariot.worker.model.make_model import PRESETS, make_model

__all__ = ["PRESETS", "LlamaStage", "allocate_kv_caches", "load_stage", "make_model", "split_layers"]
