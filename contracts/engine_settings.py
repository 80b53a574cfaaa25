"""Every engine setting, declared once: its name, type, default, bounds or choices, help text, command
line flag and, where a `ModelDeployment` exposes it, its CRD field.

Why one table: the same setting reaches an engine four ways — a `chariot worker` / `up` / `generate`
flag (`worker/flags.py`), an `LLM(...)` keyword (`worker/llm.py`), and on Kubernetes a CRD field
(`operator/crd.py`) that the operator parses into its spec (`operator/spec.py`) and renders back into
flags. Each of them takes its default and bounds from here, `EngineConfig` validates its fields against
the same bounds, and `tests/unit/test_engine_settings.py` fails when any of them disagree. The module is
torch-free so the operator, which must start without torch, reads the same table as the worker.

A CRD field may deliberately differ from the worker (a longer rendezvous timeout for a cluster, where a
stage may wait for a node to scale up); such a difference is declared here, with its reason, in
`CrdField.overrides`, never by writing another number somewhere else.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Generic, TypeVar

from chariot.contracts.policies import DEFAULT_POLICY, POLICIES

T = TypeVar("T")

# Names only: torch is imported where a dtype object is needed, so the CLI and the operator start without it.
DTYPES: tuple[str, ...] = ("float32", "float16", "bfloat16")
ENGINE_CORES: tuple[str, ...] = ("process", "thread")
CUDA_GRAPH_MODES: tuple[str, ...] = ("auto", "on", "off")
ASYNC_SCHEDULING_MODES: tuple[str, ...] = ("auto", "on", "off")
PREFILL_ORDERS: tuple[str, ...] = ("fcfs", "shortest")


@dataclass(frozen=True)
class CrdField:
    """Where a `ModelDeployment`'s `.spec` exposes a setting.

    `path` is dotted from `.spec` (`scheduler.maxBatchSize`); `description` is what `kubectl explain`
    shows. `overrides` are JSON-schema keys (`type`, `default`, `minimum`, `maximum`) where the cluster
    needs another value than a local engine, and `why` says why.
    """

    path: str
    description: str
    overrides: Mapping[str, Any] = field(default_factory=dict)
    why: str = ""

    def __post_init__(self) -> None:
        if self.overrides and not self.why:
            raise ValueError(f"CRD field {self.path}: overrides {sorted(self.overrides)} need a reason (`why`)")
        object.__setattr__(self, "overrides", MappingProxyType(dict(self.overrides)))


@dataclass(frozen=True)
class Setting(Generic[T]):
    """One engine setting. `kind` is the Python type of a set value; `optional` settings may be None
    (derived at start-up: see the help text). `minimum` / `maximum` are inclusive unless
    `exclusive_minimum` / `exclusive_maximum`. `flag` is the command line flag (None: no flag; a
    boolean that defaults to True has a `--no-...` flag that turns it off)."""

    name: str
    kind: type
    default: T
    help: str
    flag: str | None = None
    minimum: float | None = None
    maximum: float | None = None
    exclusive_minimum: bool = False
    exclusive_maximum: bool = False
    choices: tuple[str, ...] = ()
    optional: bool = False
    crd: CrdField | None = None

    @property
    def dest(self) -> str:
        """The argparse attribute the flag sets (a `--no-...` flag sets the setting's own name)."""
        if self.flag is None or self.kind is bool:
            return self.name
        return self.flag.removeprefix("--").replace("-", "_")

    def crd_default(self) -> Any:
        """The default a `ModelDeployment` gets (None: the field has none)."""
        if self.crd is not None and "default" in self.crd.overrides:
            return self.crd.overrides["default"]
        return self.default

    def problem(self, value: object) -> str | None:
        """Why `value` is not valid for this setting (the text after the field name), or None."""
        if value is None:
            return None if self.optional else f"must be set, got {value!r}"
        kind_problem = self._kind_problem(value)
        if kind_problem is not None:
            return kind_problem
        if self.choices and value not in self.choices:
            return f"must be one of {', '.join(self.choices)}, got {value!r}"
        if isinstance(value, int | float) and not self._in_bounds(value):
            return f"must be {self.bounds_text()}, got {value!r}"
        return None

    def bounds_text(self) -> str:
        """The allowed range in words or interval notation: `a positive integer`, `in (0, 1]`."""
        if self.kind is int and self.minimum == 1 and self.maximum is None:
            return "a positive integer"
        if self.maximum is None:
            return f"{'>' if self.exclusive_minimum else '>='} {self.minimum:g}"
        low = "(" if self.exclusive_minimum else "["
        high = ")" if self.exclusive_maximum else "]"
        return f"in {low}{self.minimum:g}, {self.maximum:g}{high}"

    def _kind_problem(self, value: object) -> str | None:
        if self.kind is int and (isinstance(value, bool) or not isinstance(value, int)):
            return f"must be {self.bounds_text() if self.minimum is not None else 'an integer'}, got {value!r}"
        if self.kind is float and (isinstance(value, bool) or not isinstance(value, int | float)
                                   or not math.isfinite(value)):
            return f"must be a finite number, got {value!r}"
        if self.kind in (str, bool) and not isinstance(value, self.kind):
            return f"must be a {self.kind.__name__}, got {value!r}"
        return None

    def _in_bounds(self, value: float) -> bool:
        low_ok = self.minimum is None or (value > self.minimum if self.exclusive_minimum else value >= self.minimum)
        high_ok = self.maximum is None or (value < self.maximum if self.exclusive_maximum else value <= self.maximum)
        return low_ok and high_ok


def parse_int_tuple(text: str) -> tuple[int, ...]:
    """`5,3` → (5, 3): the command line form of a per-stage list."""
    return tuple(int(part) for part in text.split(","))


POLICY: Setting[str] = Setting(
    "policy", str, DEFAULT_POLICY, "batching policy", flag="--policy", choices=POLICIES,
    crd=CrdField("scheduler.policy", "Scheduling policy; `sarathi` = chunked prefills + stall-free batching."))
TOKEN_BUDGET: Setting[int | None] = Setting(
    "token_budget", int, None, "tokens per iteration (default: 512 for sarathi, max_model_len otherwise)",
    flag="--token-budget", minimum=1, optional=True,
    crd=CrdField("scheduler.tokenBudget",
                 "Tokens per iteration. Unset: derived from `slo.tbtMs` and `tuneProfile` when both are set "
                 "(sarathi), else the policy's default (512 for sarathi, maxModelLen for the others, which must "
                 "fit a whole prompt)."))
PREFILL_ORDER: Setting[str] = Setting(
    "prefill_order", str, "fcfs",
    "which prompts get the token budget left after the decodes: fcfs = arrival order; shortest = the fewest "
    "prompt tokens left first, aged by one token budget per iteration waited so a long prompt is passed only by "
    "prompts that arrive within its own prefill time (lower median time to first token under load, higher for "
    "the longest prompts)", flag="--prefill-order", choices=PREFILL_ORDERS,
    crd=CrdField("scheduler.prefillOrder",
                 "Order prompts get the budget in: `fcfs` (arrival) or `shortest` (fewest prompt tokens left "
                 "first, aged so none starves)."))
MAX_BATCH_SIZE: Setting[int] = Setting(
    "max_batch_size", int, 128, "most sequences in one iteration", flag="--max-batch-size", minimum=1,
    crd=CrdField("scheduler.maxBatchSize", "Most sequences in one iteration."))
PIPELINE_STAGES: Setting[int] = Setting(
    "pipeline_stages", int, 1, "pipeline stages in this group", flag="--stages", minimum=1,
    crd=CrdField("parallelism.pipeline", "Pipeline stages per replica (pods per group).",
                 overrides={"maximum": 64}, why="a group's pods share one rendezvous; 64 bounds what it waits for"))
TENSOR_PARALLEL_SIZE: Setting[int] = Setting(
    "tensor_parallel_size", int, 1, "ranks each stage is sharded over (one process and device each)",
    flag="--tensor-parallel-size", minimum=1,
    crd=CrdField("parallelism.tensor",
                 "Tensor-parallel ranks per stage: they share the stage pod, one process and "
                 "`resources.gpusPerStage` GPUs each; must divide the model's attention heads.",
                 overrides={"maximum": 16}, why="the ranks of a stage share one pod, so one node's GPUs"))
DTYPE: Setting[str] = Setting(
    "dtype", str, "auto", "compute dtype; auto = the checkpoint's, except float32 on a CPU without native "
    "bf16/fp16 instructions (logged)", flag="--dtype", choices=("auto", *DTYPES),
    crd=CrdField("model.dtype", "Weights and activations dtype; `auto` takes the checkpoint's."))
BLOCK_SIZE_CPU = 128
BLOCK_SIZE_GPU = 16


def default_block_size(device: str) -> int:
    """The KV-cache block size an engine on `device` gets when none is set: 128 tokens on a CPU, where a
    decode's attention streams the cache and one head's keys in longer contiguous runs stream faster
    (docs/kernels.md), 16 on a GPU."""
    return BLOCK_SIZE_CPU if device == "cpu" else BLOCK_SIZE_GPU


BLOCK_SIZE: Setting[int | None] = Setting(
    "block_size", int, None,
    f"KV-cache block size in tokens (default: {BLOCK_SIZE_CPU} on a CPU, {BLOCK_SIZE_GPU} on a GPU); prefix "
    "caching reuses whole blocks", flag="--block-size", minimum=1, maximum=1024, optional=True,
    crd=CrdField("scheduler.blockSize", f"KV-cache block size in tokens; default: {BLOCK_SIZE_CPU} on a CPU, "
                                        f"{BLOCK_SIZE_GPU} on a GPU. Prefix caching reuses whole blocks."))
KV_CACHE_TOKENS: Setting[int | None] = Setting(
    "kv_cache_tokens", int, None, "KV capacity in tokens (default: from --kv-cache-memory-fraction)",
    flag="--kv-cache-tokens", minimum=1, optional=True)
KV_CACHE_MEMORY_FRACTION: Setting[float] = Setting(
    "kv_cache_memory_fraction", float, 0.3,
    "KV capacity as a fraction of free device memory (when --kv-cache-tokens is unset; on the CPU capped at "
    "what --max-batch-size sequences of --max-model-len tokens can use)",
    flag="--kv-cache-memory-fraction", minimum=0.0, maximum=1.0, exclusive_minimum=True)
MAX_MODEL_LEN: Setting[int | None] = Setting(
    "max_model_len", int, None, "longest prompt + output in tokens (default: the model's max_position_embeddings)",
    flag="--max-model-len", minimum=1, optional=True,
    crd=CrdField("model.maxModelLen", "Longest prompt + output in tokens; default: the model's "
                                      "max_position_embeddings."))
WATERMARK: Setting[float] = Setting(
    "watermark", float, 0.01, "share of KV blocks kept free when admitting a prompt (headroom for decodes)",
    minimum=0.0, maximum=1.0, exclusive_maximum=True)
DEVICE: Setting[str] = Setting("device", str, "cpu", "torch device: cpu, cuda or cuda:N", flag="--device")
SEED: Setting[int] = Setting("seed", int, 0, "seed of sampling for requests without a seed", flag="--engine-seed")
LAYER_SPLIT: Setting[tuple[int, ...] | None] = Setting(
    "layer_split", tuple, None, "layers per stage, comma separated (e.g. 5,3; default: an even split)",
    flag="--layer-split", optional=True)
STAGE_TIMEOUT_S: Setting[float] = Setting(
    "stage_timeout_s", float, 15.0, "seconds before a silent pipeline stage is declared dead",
    flag="--stage-timeout", minimum=0.0, maximum=3600.0, exclusive_minimum=True)
RENDEZVOUS_TIMEOUT_S: Setting[float] = Setting(
    "rendezvous_timeout_s", float, 180.0,
    "seconds the stages of a pipeline group wait for each other to join (raise it where a stage may wait for a "
    "node to scale up or an image to pull)", flag="--rendezvous-timeout", minimum=0.0, maximum=86400.0,
    exclusive_minimum=True,
    crd=CrdField("parallelism.rendezvousTimeoutSeconds",
                 "How long the stages of a group wait for each other to join before the group fails and is "
                 "recreated; long enough by default for a cold GPU node to scale up and pull the image.",
                 overrides={"type": "integer", "minimum": 10, "default": 1200},
                 why="on a cluster a stage may wait for a node to scale up and pull the image, which takes minutes"))
ATTENTION_AWARE_CHUNKS: Setting[bool] = Setting(
    "attention_aware_chunks", bool, True,
    "size sarathi's prefill chunks by tokens alone (default: beside decodes, late chunks of long prompts shrink "
    "by their attention work, so no iteration outgrows the budget's time)", flag="--no-attention-aware-chunks")
PREFIX_CACHING: Setting[bool] = Setting(
    "prefix_caching", bool, True,
    "compute every prompt in full (default: reuse the KV of cached full blocks of an identical leading prefix, "
    "e.g. a shared system prompt)", flag="--no-prefix-caching")

CUDA_GRAPHS: Setting[str] = Setting(
    "cuda_graphs", str, "auto",
    "decode-only iterations through the padded batch-size buckets of the graph runner: auto = on with CUDA "
    "(one CUDA graph captured per bucket at warm-up), off elsewhere; on = the same buckets and static buffers "
    "everywhere (run eagerly where nothing can be captured); off = every iteration eager, unpadded",
    flag="--cuda-graphs", choices=CUDA_GRAPH_MODES)

ASYNC_SCHEDULING: Setting[str] = Setting(
    "async_scheduling", str, "auto",
    "build the next batch while the current one runs on the device (its sampled tokens feed the next decode "
    "there, unseen by the host): auto = on for a single-rank engine on CUDA, where the device would otherwise "
    "wait for the host between steps; on = for any single-rank engine (on a CPU nothing overlaps; tests); "
    "off = every step waits for the last", flag="--async-scheduling", choices=ASYNC_SCHEDULING_MODES)

ENGINE_SETTINGS: tuple[Setting[Any], ...] = (
    POLICY, TOKEN_BUDGET, PREFILL_ORDER, MAX_BATCH_SIZE, PIPELINE_STAGES, TENSOR_PARALLEL_SIZE, DTYPE, BLOCK_SIZE,
    KV_CACHE_TOKENS, KV_CACHE_MEMORY_FRACTION, MAX_MODEL_LEN, WATERMARK, DEVICE, SEED, LAYER_SPLIT,
    STAGE_TIMEOUT_S, RENDEZVOUS_TIMEOUT_S, ATTENTION_AWARE_CHUNKS, PREFIX_CACHING, CUDA_GRAPHS, ASYNC_SCHEDULING,
)
"""The fields of `EngineConfig` beside `model`, in its order."""

ENGINE_CORE: Setting[str] = Setting(
    "engine_core", str, "process",
    "where stage 0 runs its engine loop: a child process (default: it never competes with the gRPC front for "
    "the GIL) or a thread of the server process", flag="--engine-core", choices=ENGINE_CORES)
"""A serving setting of stage 0 (not part of `EngineConfig`): `chariot worker`, `chariot up` and `serve()`."""

ITERATION_LOG: Setting[str | None] = Setting(
    "iteration_log", str, None,
    "append one JSON line per engine iteration to this file: its tokens, prompt tokens and chunks, decodes, "
    "step time and the queue after it (docs/observability.md); `chariot up` gives each replica its own file, "
    "the replica's index before the suffix (iterations.jsonl: iterations.0.jsonl, ...)",
    flag="--iteration-log", optional=True)
"""A serving setting of stage 0, like `ENGINE_CORE`: the step observer `worker/iteration_log.py`."""


def engine_setting(name: str) -> Setting[Any]:
    """The engine setting called `name`; KeyError naming the known ones otherwise."""
    for setting in ENGINE_SETTINGS:
        if setting.name == name:
            return setting
    raise KeyError(f"no engine setting {name!r}; known: {', '.join(s.name for s in ENGINE_SETTINGS)}")


def _range_text(setting: Setting[Any]) -> str:
    if setting.choices:
        return " \\| ".join(f"`{c}`" for c in setting.choices)
    if setting.minimum is None and setting.maximum is None:
        return ""
    return setting.bounds_text()


def _crd_text(setting: Setting[Any]) -> str:
    if setting.crd is None:
        return ""
    default = setting.crd_default()
    shown = "" if default is None or default == setting.default else f" (default `{default}`: {setting.crd.why})"
    return f"`spec.{setting.crd.path}`{shown}"


def markdown_table() -> str:
    """The engine settings as the Markdown table `docs/configuration.md` carries."""
    rows = ["| setting (`EngineConfig`, `LLM`) | flag | default | allowed | CRD field | help (the flag's) |",
            "|---|---|---|---|---|---|"]
    for s in ENGINE_SETTINGS:
        flag = "" if s.flag is None else f"`{s.flag}`"
        default = "unset" if s.default is None else f"`{s.default}`"
        rows.append(f"| `{s.name}` | {flag} | {default} | {_range_text(s)} | {_crd_text(s)} | {s.help} |")
    return "\n".join(rows) + "\n"
