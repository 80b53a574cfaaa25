"""Token budget from the TBT SLO (docs/architecture.md §3, Sarathi-Serve §4.3).

The paper sets the token budget once, from profiling: the largest number of tokens an iteration
may hold without its time exceeding the TBT SLO. `chariot tune` (`chariot.worker.tune`) profiles
iteration times on this hardware, fits the linear `CostModel` below and writes a JSON profile;
the worker turns `--tbt-slo-ms X` into a budget with `resolve_token_budget`, evaluating the same
cost model. The evaluation lives here (json + math only, no numpy, no bench code) so a serving
process needs nothing more than the profile file.

Worst case assumed (`worst_case_iteration_s`): an iteration of `budget` tokens holding between 1
and `decode_batch` decodes, each at `decode_context` tokens of context, with the rest of the budget
one prefill chunk ending at `prefill_context` (the longest prompt expected, or the chunk length if
the chunk is longer). Several smaller chunks, shorter prompts or shorter decode contexts only cost
less, because every fitted coefficient is non-negative. An iteration without decodes stalls no
generation, so it does not count against the TBT SLO.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from chariot.contracts.errors import ConfigError
from chariot.contracts.policies import get_policy
from chariot.worker.cpu_features import auto_cpu_dtype, cpu_flags

PROFILE_VERSION = 1
FEATURES = ("constant", "prefill_tokens", "decode_tokens", "prefill_attention", "decode_context")
DEFAULT_TILE = 32
# config.json fields that determine iteration time; a profile of another shape is stale.
SHAPE_FIELDS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                "intermediate_size", "vocab_size")


@dataclass(frozen=True)
class BatchShape:
    """What the cost model sees of one iteration.

    `prefill_attention` is Σ over prefill chunks of chunk tokens × context at the chunk's end (the
    size of its attention score matrix); `decode_context` is Σ over decodes of their context length.
    """

    prefill_tokens: int = 0
    decode_tokens: int = 0
    prefill_attention: int = 0
    decode_context: int = 0

    @classmethod
    def of(cls, chunks: Iterable[tuple[int, int]], num_decodes: int) -> BatchShape:
        """From (start, num_tokens) chunks, decodes first (the scheduler's batch order)."""
        pre = dec = attn = ctx = 0
        for i, (start, n) in enumerate(chunks):
            if i < num_decodes:
                dec, ctx = dec + n, ctx + start + n
            else:
                pre, attn = pre + n, attn + n * (start + n)
        return cls(pre, dec, attn, ctx)

    def features(self) -> tuple[float, ...]:
        return (1.0, float(self.prefill_tokens), float(self.decode_tokens), float(self.prefill_attention),
                float(self.decode_context))


@dataclass(frozen=True)
class CostModel:
    """Iteration time (seconds) = Σ coefficient × feature, features as in `FEATURES`."""

    coefficients: tuple[float, ...]
    r2: float = float("nan")

    def __post_init__(self) -> None:
        if len(self.coefficients) != len(FEATURES):
            raise ValueError(f"need {len(FEATURES)} coefficients ({', '.join(FEATURES)}), got {len(self.coefficients)}")
        if any(c < 0 for c in self.coefficients):
            raise ValueError(f"coefficients must be non-negative, got {self.coefficients}")

    def predict(self, shape: BatchShape) -> float:
        return sum(c * f for c, f in zip(self.coefficients, shape.features(), strict=True))

    def scaled(self, factor: float) -> CostModel:
        """The same hardware `factor` times slower (factor < 1: faster)."""
        return CostModel(tuple(c * factor for c in self.coefficients), self.r2)

    def to_dict(self) -> dict[str, Any]:
        return {"features": list(FEATURES), "coefficients": list(self.coefficients), "r2": self.r2}

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> CostModel:
        if list(raw.get("features", [])) != list(FEATURES):
            raise ValueError(f"cost model features {raw.get('features')} are not {list(FEATURES)}")
        return cls(tuple(float(c) for c in raw["coefficients"]), float(raw.get("r2", float("nan"))))


@dataclass(frozen=True)
class Assumptions:
    """The workload the budget must be safe for (see the module docstring)."""

    decode_batch: int = 32
    decode_context: int = 1024
    prefill_context: int = 2048
    tile: int = DEFAULT_TILE
    max_budget: int = 8192

    def __post_init__(self) -> None:
        for name, value in asdict(self).items():
            if value <= 0:
                raise ValueError(f"{name} must be positive, got {value}")


def worst_case_shape(budget: int, decodes: int, decode_context: int, prefill_context: int) -> BatchShape:
    """`decodes` decodes at `decode_context`, the rest of `budget` one chunk ending at `prefill_context`."""
    decodes = min(decodes, budget)
    chunk = budget - decodes
    return BatchShape(chunk, decodes, chunk * max(prefill_context, chunk), decodes * decode_context)


def worst_case_iteration_s(model: CostModel, budget: int, a: Assumptions) -> float:
    """Slowest predicted iteration with at least one decode; linear in the decode count, so the
    extremes (1 or `decode_batch` decodes) bound every mix in between."""
    return max(model.predict(worst_case_shape(budget, d, a.decode_context, a.prefill_context))
               for d in {1, a.decode_batch})


def budget_for_slo(model: CostModel, tbt_slo_s: float, a: Assumptions) -> int:
    """Largest multiple of `a.tile` (up to `a.max_budget`) whose worst case meets the SLO.

    Raises ConfigError (field `tbt_slo_ms`) when even one tile misses it."""
    best = 0
    for budget in range(a.tile, a.max_budget + 1, a.tile):
        if worst_case_iteration_s(model, budget, a) > tbt_slo_s:
            break  # predicted time only grows with the budget (non-negative coefficients)
        best = budget
    if best == 0:
        need = worst_case_iteration_s(model, a.tile, a)
        raise ConfigError("tbt_slo_ms", f"{tbt_slo_s * 1e3:g} ms cannot be met on this hardware: even a "
                                        f"{a.tile}-token budget is predicted at {need * 1e3:.1f} ms per iteration "
                                        f"({a.decode_batch} decodes at context {a.decode_context})")
    return best


# ---- profile files --------------------------------------------------------------------------------
def model_dtype(model_dir: str | Path, dtype_name: str, device: str = "cpu") -> str:
    """Resolve `auto` as the engine does (`EngineConfig.torch_dtype`): the checkpoint's `torch_dtype`,
    or float32 on a CPU that would only emulate it."""
    if dtype_name != "auto":
        return dtype_name
    raw = _read_config(model_dir)
    checkpoint = str(raw.get("torch_dtype") or raw.get("dtype") or "float32")
    return auto_cpu_dtype(checkpoint, cpu_flags())[0] if device == "cpu" else checkpoint


def model_shape(model_dir: str | Path) -> dict[str, Any]:
    raw = _read_config(model_dir)
    return {k: raw.get(k) for k in SHAPE_FIELDS}


def default_profile_path(model_dir: str | Path, dtype_name: str) -> Path:
    """`$XDG_CACHE_HOME/chariot/tune/<model-dir-name>-<dtype>.json` (default `~/.cache/...`)."""
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    name = Path(model_dir).resolve().name
    return cache / "chariot" / "tune" / f"{name}-{model_dtype(model_dir, dtype_name)}.json"


def tune_command(model_dir: str | Path, dtype_name: str, profile_path: str | Path | None = None) -> str:
    out = f" --out {profile_path}" if profile_path is not None else ""
    return f"chariot tune --model {model_dir} --dtype {dtype_name}{out}"


def load_profile(path: str | Path) -> dict[str, Any]:
    try:
        raw = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ConfigError("tbt_slo_ms", f"cannot read tune profile {path}: {exc}") from exc
    if not isinstance(raw, dict) or raw.get("version") != PROFILE_VERSION:
        raise ConfigError("tbt_slo_ms", f"{path} is not a version-{PROFILE_VERSION} tune profile")
    return raw


def resolve_token_budget(model_dir: str | Path, dtype_name: str, tbt_slo_ms: float,
                         profile_path: str | Path | None = None, max_model_len: int | None = None) -> int:
    """The tuned token budget for `tbt_slo_ms` on this model, dtype and (profiled) hardware.

    A deployment whose `max_model_len` is below the profile's assumed longest prompt can never see a
    chunk ending further out, so its worst case (and budget) uses `max_model_len` instead; a longer
    `max_model_len` keeps the profile's assumption (what `chariot tune --prefill-context` was told)."""
    if not tbt_slo_ms > 0:
        raise ConfigError("tbt_slo_ms", f"must be positive, got {tbt_slo_ms}")
    path = Path(profile_path) if profile_path is not None else default_profile_path(model_dir, dtype_name)
    if not path.is_file():
        raise ConfigError("tbt_slo_ms", f"needs a tune profile of this model and dtype, and there is none at {path}; "
                                        f"run `{tune_command(model_dir, dtype_name, profile_path)}` first "
                                        "(or pass --token-budget)")
    raw = load_profile(path)
    _check_model(raw, model_dir, path)
    try:
        model = CostModel.from_dict(raw["cost_model"])
        assumptions = Assumptions(**raw["assumptions"])
    except (KeyError, TypeError, ValueError) as exc:
        raise ConfigError("tbt_slo_ms", f"malformed tune profile {path}: {exc}") from exc
    if max_model_len is not None and 0 < max_model_len < assumptions.prefill_context:
        assumptions = replace(assumptions, prefill_context=max_model_len)
    return budget_for_slo(model, tbt_slo_ms / 1e3, assumptions)


def budget_from_flags(model_dir: str | None, dtype_name: str, policy: str, token_budget: int | None,
                      tbt_slo_ms: float | None, profile_path: str | None = None,
                      max_model_len: int | None = None) -> int | None:
    """The engine's `token_budget` from `--token-budget` / `--tbt-slo-ms` (at most one of them)."""
    if tbt_slo_ms is None:
        return token_budget
    if token_budget is not None:
        raise ConfigError("tbt_slo_ms", "give either --token-budget or --tbt-slo-ms, not both")
    problem = get_policy(policy).slo_budget_problem()
    if problem is not None:
        raise ConfigError("tbt_slo_ms", problem)
    if model_dir is None:
        raise ConfigError("tbt_slo_ms", "needs --model")
    return resolve_token_budget(model_dir, dtype_name, tbt_slo_ms, profile_path, max_model_len)


def _read_config(model_dir: str | Path) -> dict[str, Any]:
    path = Path(model_dir) / "config.json"
    try:
        raw = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ConfigError("model", f"cannot read {path}: {exc}") from exc
    if not isinstance(raw, dict):
        raise ConfigError("model", f"{path}: expected a JSON object")
    return raw


def _check_model(raw: Mapping[str, Any], model_dir: str | Path, path: Path) -> None:
    stored = raw.get("model", {}).get("shape")
    if stored is not None and stored != model_shape(model_dir):
        raise ConfigError("tbt_slo_ms", f"tune profile {path} was made for a model of another shape; "
                                        f"re-run `{tune_command(model_dir, raw.get('dtype', 'auto'), path)}`")
