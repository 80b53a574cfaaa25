"""Frozen, validated configuration: the model's shape (from a Hugging Face `config.json`) and the engine's knobs.

Both are validated once, here; everything downstream trusts them.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING, Any

from chariot.contracts import engine_settings as settings
from chariot.contracts.engine_settings import DTYPES, ENGINE_SETTINGS
from chariot.contracts.errors import ConfigError, ModelLoadError
from chariot.contracts.policies import get_policy
from chariot.worker.cpu_features import auto_cpu_dtype, cpu_flags

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)
SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")


@dataclass(frozen=True)
class RopeScaling:
    """Llama-3 style frequency scaling (`rope_scaling.rope_type == "llama3"`)."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@dataclass(frozen=True)
class ModelConfig:
    """The architecture of a Llama-family decoder, as read from `config.json`."""

    architecture: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    torch_dtype: str
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    rope_scaling: RopeScaling | None = None

    @property
    def attention_cost(self) -> float:
        """Token-equivalents of one (query, key) attention pair in a layer: its FLOPs (QKᵀ and PV,
        4·heads·head_dim) over one token's FLOPs in the layer's linear projections (2 per weight)."""
        q = self.num_heads * self.head_dim
        kv = self.num_kv_heads * self.head_dim
        linear_weights = self.hidden_size * (2 * q + 2 * kv) + 3 * self.hidden_size * self.intermediate_size
        return 4.0 * q / (2.0 * linear_weights)

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> ModelConfig:
        archs = raw.get("architectures") or []
        arch = archs[0] if archs else None
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ModelLoadError(
                f"config.json: unsupported architecture {arch!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        try:
            hidden = int(raw["hidden_size"])
            heads = int(raw["num_attention_heads"])
            cfg = cls(
                architecture=arch,
                hidden_size=hidden,
                num_layers=int(raw["num_hidden_layers"]),
                num_heads=heads,
                num_kv_heads=int(raw.get("num_key_value_heads") or heads),
                head_dim=int(raw.get("head_dim") or hidden // heads),
                intermediate_size=int(raw["intermediate_size"]),
                vocab_size=int(raw["vocab_size"]),
                rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
                rope_theta=float(raw.get("rope_theta") or _rope_params(raw).get("rope_theta") or 10000.0),
                max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
                tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
                qkv_bias=arch == "Qwen2ForCausalLM" or bool(raw.get("attention_bias", False)),
                torch_dtype=str(raw.get("torch_dtype") or raw.get("dtype") or "float32"),
                bos_token_id=raw.get("bos_token_id"),
                eos_token_ids=_eos_ids(raw.get("eos_token_id")),
                rope_scaling=_rope_scaling(raw.get("rope_scaling") or _rope_params(raw)),
            )
        except KeyError as exc:
            raise ModelLoadError(f"config.json: missing required field {exc.args[0]!r}") from exc
        except (TypeError, ValueError) as exc:
            raise ModelLoadError(f"config.json: malformed value ({exc})") from exc
        cfg._validate()
        return cfg

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> ModelConfig:
        path = Path(model_dir)
        if not path.is_dir():
            raise ModelLoadError(f"model directory not found: {path}")
        cfg_path = path / "config.json"
        if not cfg_path.is_file():
            raise ModelLoadError(f"{cfg_path}: missing config.json")
        try:
            raw = json.loads(cfg_path.read_text())
        except json.JSONDecodeError as exc:
            raise ModelLoadError(f"{cfg_path}: malformed JSON ({exc})") from exc
        if not isinstance(raw, dict):
            raise ModelLoadError(f"{cfg_path}: expected a JSON object")
        return cls.from_dict(raw)

    def _validate(self) -> None:
        for name in ("hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim",
                     "intermediate_size", "vocab_size", "max_position_embeddings"):
            if getattr(self, name) <= 0:
                raise ModelLoadError(f"config.json: {name} must be positive, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ModelLoadError(
                f"config.json: num_attention_heads ({self.num_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_kv_heads})"
            )
        if self.head_dim % 2:
            raise ModelLoadError(f"config.json: head_dim must be even for RoPE, got {self.head_dim}")

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim


def _eos_ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, list):
        return tuple(int(v) for v in value)
    return (int(value),)


def _rope_params(raw: dict[str, Any]) -> dict[str, Any]:
    """transformers >= 5 writes `rope_parameters` (theta + scaling) instead of `rope_theta`/`rope_scaling`."""
    value = raw.get("rope_parameters")
    return value if isinstance(value, dict) else {}


def _rope_scaling(value: Any) -> RopeScaling | None:
    if not value:
        return None
    kind = value.get("rope_type") or value.get("type")
    if kind in (None, "default"):
        return None
    if kind != "llama3":
        raise ModelLoadError(f"config.json: rope_scaling type {kind!r} is not supported (only 'llama3')")
    return RopeScaling(
        factor=float(value["factor"]),
        low_freq_factor=float(value["low_freq_factor"]),
        high_freq_factor=float(value["high_freq_factor"]),
        original_max_position_embeddings=int(value["original_max_position_embeddings"]),
    )


@dataclass(frozen=True)
class EngineConfig:
    """Knobs of one engine (one pipeline group); each field's default, bounds and help text are declared
    once in `chariot.contracts.engine_settings`.

    `token_budget=None` picks the policy's default: 512 for `sarathi`; `max_model_len` for the
    non-chunking policies, which must fit a whole prompt in one iteration.
    KV capacity comes from `kv_cache_tokens` if set, else from `kv_cache_memory_fraction` of the
    device's free memory (on the CPU, capped at what `max_batch_size` sequences of `max_model_len`
    tokens can use). `attention_aware_chunks` shrinks late chunks of long prompts by their
    attention work (`scheduler.base.chunk_tokens`); off, chunks are sized by tokens alone.
    `rendezvous_timeout_s` bounds how long the stages of a pipeline group wait for each other to join
    (on a cluster: node scale-up, image pulls, model downloads of the slowest stage).
    `tensor_parallel_size` shards every stage over that many ranks (`model/parallel.py`): a group
    is `pipeline_stages × tensor_parallel_size` processes, global rank = stage × T + shard.
    `prefix_caching` lets a prompt reuse the KV of full blocks another request already computed for the
    same leading tokens (`block_manager`); benchmarks that measure compute cost turn it off.
    `cuda_graphs` routes decode-only iterations through the graph runner (`graph_runner.py`).
    `async_scheduling` lets the engine build the next batch while the current one runs
    (`engine.schedules_ahead`, `SchedulerConfig.ahead`).
    `prefill_order` picks which prompts get the budget left after the decodes
    (`SchedulerConfig.prefill_order`).
    `block_size=None` picks the device's KV-cache block size (`block_tokens`).
    """

    model: str
    policy: str = settings.POLICY.default
    token_budget: int | None = settings.TOKEN_BUDGET.default
    prefill_order: str = settings.PREFILL_ORDER.default
    max_batch_size: int = settings.MAX_BATCH_SIZE.default
    pipeline_stages: int = settings.PIPELINE_STAGES.default
    tensor_parallel_size: int = settings.TENSOR_PARALLEL_SIZE.default
    dtype: str = settings.DTYPE.default
    block_size: int | None = settings.BLOCK_SIZE.default
    kv_cache_tokens: int | None = settings.KV_CACHE_TOKENS.default
    kv_cache_memory_fraction: float = settings.KV_CACHE_MEMORY_FRACTION.default
    max_model_len: int | None = settings.MAX_MODEL_LEN.default
    watermark: float = settings.WATERMARK.default
    device: str = settings.DEVICE.default
    seed: int = settings.SEED.default
    layer_split: tuple[int, ...] | None = settings.LAYER_SPLIT.default
    stage_timeout_s: float = settings.STAGE_TIMEOUT_S.default
    rendezvous_timeout_s: float = settings.RENDEZVOUS_TIMEOUT_S.default
    attention_aware_chunks: bool = settings.ATTENTION_AWARE_CHUNKS.default
    prefix_caching: bool = settings.PREFIX_CACHING.default
    cuda_graphs: str = settings.CUDA_GRAPHS.default
    async_scheduling: str = settings.ASYNC_SCHEDULING.default

    def __post_init__(self) -> None:
        """Every field against its declaration (`chariot.contracts.engine_settings`): type, bounds, choices."""
        for setting in ENGINE_SETTINGS:
            problem = setting.problem(getattr(self, setting.name))
            if problem is not None:
                raise ConfigError(setting.name, problem)

    @property
    def block_tokens(self) -> int:
        """The KV-cache block size: `block_size`, or when unset the device's default
        (`engine_settings.default_block_size`: 128 tokens on a CPU, 16 on a GPU)."""
        if self.block_size is not None:
            return self.block_size
        return settings.default_block_size(self.device)

    @property
    def world_size(self) -> int:
        """Processes in one group: every stage's tensor-parallel ranks."""
        return self.pipeline_stages * self.tensor_parallel_size

    def resolved_max_model_len(self, model: ModelConfig) -> int:
        if self.max_model_len is None:
            return model.max_position_embeddings
        if self.max_model_len > model.max_position_embeddings:
            raise ConfigError(
                "max_model_len",
                f"must be <= the model's max_position_embeddings ({model.max_position_embeddings}), "
                f"got {self.max_model_len}",
            )
        return self.max_model_len

    def resolved_token_budget(self, max_model_len: int) -> int:
        policy = get_policy(self.policy)
        if self.token_budget is None:
            return policy.default_budget(max_model_len)
        problem = policy.budget_problem(self.token_budget, max_model_len)
        if problem is not None:
            raise ConfigError("token_budget", f"{problem} ({max_model_len}), got {self.token_budget}")
        return self.token_budget

    def torch_dtype(self, model: ModelConfig) -> torch.dtype:
        """The compute dtype: explicit, or with `auto` the checkpoint's, except that on a CPU without
        native support for it `auto` picks float32 (and logs why, once)."""
        name = model.torch_dtype if self.dtype == "auto" else self.dtype
        if name not in DTYPES:
            raise ConfigError("dtype", f"model's torch_dtype {name!r} is not supported; pass dtype explicitly")
        if self.dtype == "auto" and self.device == "cpu":
            name, reason = auto_cpu_dtype(name, cpu_flags())
            if reason is not None:
                _log_once(f"dtype auto: {reason}")
        return to_torch_dtype(name)


@dataclass(frozen=True)
class ResolvedConfig:
    """An `EngineConfig` with everything derived from it and the checkpoint computed once, per process:
    the driver resolves it for its scheduler and its stage, a downstream stage for its stage; no
    code past this point re-reads `config.json` or re-derives a limit, the dtype or the layer split.

    `layer_ranges[r]` is pipeline stage r's half-open range of decoder layers (one range, all layers,
    for a single process).
    """

    engine: EngineConfig
    model: ModelConfig
    max_model_len: int
    token_budget: int
    dtype: torch.dtype
    device: torch.device
    layer_ranges: tuple[tuple[int, int], ...]

    @classmethod
    def resolve(cls, config: EngineConfig) -> ResolvedConfig:
        """Read the checkpoint's config and validate every derived value (raises ConfigError /
        ModelLoadError naming the field)."""
        import torch

        from chariot.contracts.parallelism import split_layers
        from chariot.worker.model.parallel import Shard

        model = ModelConfig.from_dir(config.model)
        Shard(0, config.tensor_parallel_size).check(model)
        max_len = config.resolved_max_model_len(model)
        split = list(config.layer_split) if config.layer_split and config.pipeline_stages > 1 else None
        ranges = split_layers(model.num_layers, config.pipeline_stages, split)
        return cls(config, model, max_len, config.resolved_token_budget(max_len), config.torch_dtype(model),
                   torch.device(config.device), tuple(ranges))

    @property
    def num_stages(self) -> int:
        return len(self.layer_ranges)

    @property
    def tensor_parallel_size(self) -> int:
        return self.engine.tensor_parallel_size


@cache
def _log_once(message: str) -> None:
    log.info("%s", message)


def to_torch_dtype(name: str) -> torch.dtype:
    """The torch dtype for one of `DTYPES`."""
    import torch

    dtype: torch.dtype = getattr(torch, name)
    return dtype
