"""`make gpu-check`: everything a GPU machine should measure, as one prepared command that ends in
about 8 minutes and leaves JSON, logs, plots and a short report in one folder.

Why one command: GPU machines reach this project now and then, for minutes, so a GPU check cannot
be a session of trial and error. It runs in parts, each a child process with its own time limit
inside one overall budget; a part that fails or runs out of time leaves what it measured, the parts
after it still run, and the report says what is missing and why. Parts, in order:

- `prepare`: random weights with Llama-3-8B's exact layer shapes (hidden 4096, 32 heads, 8 KV heads,
  intermediate 14336, vocabulary 128256, bf16), drawn on the GPU and written in seconds, with a
  reduced layer count (`--layers`, default 4 of 32; a copy that reads only half of them for the
  per-layer fit); then the HBM bandwidth (a large device-to-device copy and a read-only reduction).
- `engine`: decode iterations for 1, 16, 64 and 128 sequences (context 512) and prefill chunks of
  512 and 2,048 tokens, each with CUDA graphs on and off (`EngineConfig.cuda_graphs`); the kernels
  per decode iteration and the GPU's own busy time in it (torch.profiler), against the iteration's
  wall time: what is left is the host's share; greedy tokens of a few prompts under both settings;
  Sarathi's hybrid iterations (64 decodes beside a fresh prompt's chunk filling a token budget of
  128-2,048), graphs on and off, at the measured depth.
  Per-layer figures are scaled to 32 layers by a linear fit over the full and the half depth.
- `gpu_tests`: `pytest -m gpu` over the test files that carry the marker.
- `capacity`: `sarathi` against `vllm` under the paper's strict SLO (P99 TBT <= 5x a lone decode
  iteration, measured by `engine`) and a relaxed one (25x), with the capacity search of `chariot
  bench capacity` and few probes. Sarathi-Serve derives its token budget from the TBT SLO, so each
  SLO gets its own sarathi search with its own budget (`sarathi-strict`, `sarathi-relaxed`: the
  largest budget whose timed hybrid iteration fits 80 % of the SLO; from the prefill and decode
  times where an older `engine.json` has no hybrid rows); vllm has
  no budget and one search covers both SLOs. Each search is its own child process with its own limit,
  so one long search cannot cost another its turn.
- `vllm`: if this Python can `import vllm`, the same offline trace through vLLM and Chariot on the
  same weights; otherwise the reason it was skipped.

Then `summary.json`, `report.md`, `decode_iterations.png` (iteration time against batch size,
graphs on and off, beside the weight+KV-read floor: bytes one decode iteration must read over the
measured bandwidth) and `capacity.png` (each policy's capacity under each SLO; sarathi's bar under an
SLO is the search with that SLO's budget). `capacity_plan.json` holds the SLOs, the token budget per
SLO and the probe loads; the summary's capacity ratio under each SLO is the sarathi search for that
SLO against vllm's. A dry run's capacity searches make fewer and shorter probes, to end within their
limits on a CPU.

    make gpu-check OUT=build/gpu-check                   # = python -m chariot.bench.gpu_check --out build/gpu-check
    python -m chariot.bench.gpu_check --out /tmp/dry --dry-run    # every part's code on the CPU, before a GPU run

On the lent device machine the repository's venv does not travel (its torch is a CPU wheel), and make
may be missing: the machine's own `python3` has a CUDA torch, and `make gpu-wheels` (run here first)
downloads what it lacks. The later GPU session passes the device's `run` tool

    command: bash bench/gpu_check_device.sh      carry: ["build/gpu-wheels"]      timeout_s: 540

which installs the wheels, runs this check into build/gpu-check and copies summary.json, report.md,
the plot and an archive of the folder into the tool's `$OUT`. The check ends itself after
`--budget-s` (450 s), leaving device time for one shorter rerun of some parts, e.g.
`bash bench/gpu_check_device.sh --parts prepare,capacity --budget-s 280` (`capacity` selects all three
capacity searches). Without CUDA the check says so and exits 2.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

PARTS = ("prepare", "engine", "gpu_tests", "capacity", "vllm")
# Each engine run is its own process: a CUDA error in one (say, in graph capture) cannot cost the others.
# CUDA graphs on / off, at full and at half depth; `sync`: graphs on with async scheduling off (its share).
ENGINE_RUNS = ("on", "off", "sync", "on_half", "off_half")
RUN_LABELS = {"on": "on", "off": "off", "sync": "on, async scheduling off"}
DECODE_MODES = ("on", "sync", "off")
STRICT, RELAXED = "strict", "relaxed"
# The capacity searches: name → (policy, the SLOs it searches). Sarathi's token budget follows from the
# SLO, so sarathi runs once per SLO; vllm has no budget, so one search covers both. Each search is its
# own process and time limit. Order: the strict comparison (sarathi-strict, vllm) completes before the
# relaxed sarathi search, should the overall budget run out.
CAPACITY_SEARCHES: dict[str, tuple[str, tuple[str, ...]]] = {
    f"sarathi-{STRICT}": ("sarathi", (STRICT,)), "vllm": ("vllm", (STRICT, RELAXED)),
    f"sarathi-{RELAXED}": ("sarathi", (RELAXED,))}
# A single-SLO sarathi search makes at most CAPACITY_MAX_PROBES probes; both SLOs in one search took
# 78 s on an H200 at 32 layers, vllm's two-SLO search 95 s.
PART_LIMITS_S = {"prepare": 90, "engine-on": 90, "engine-off": 75, "engine-sync": 45, "engine-on_half": 45,
                 "engine-off_half": 45, "gpu_tests": 120, f"capacity-sarathi-{STRICT}": 80, "capacity-vllm": 100,
                 f"capacity-sarathi-{RELAXED}": 80, "vllm": 120}
MIN_PART_S = 20.0  # a part is not started with less time than this left in the budget
DEFAULT_BUDGET_S = 450.0
MAX_BUDGET_S = 3600.0
FULL_LAYERS = 32  # Llama-3-8B
DEFAULT_LAYERS = 4
PRESET = "llama3-8b"
DECODE_BATCHES = (1, 16, 64, 128)
DECODE_CONTEXT = 512
PREFILL_TOKENS = (512, 2048)
HEADLINE_BATCH = 64
STRICT_SLO_FACTOR, RELAXED_SLO_FACTOR = 5.0, 25.0  # Sarathi-Serve §5: strict and relaxed TBT SLOs
BUDGET_CANDIDATES = (64, 128, 256, 512, 1024, 2048)
HYBRID_BUDGETS = (128, 256, 512, 1024, 2048)  # hybrid iterations timed: HEADLINE_BATCH decodes + the rest a chunk
HYBRID_SHARE_OF_SLO = 0.8  # the share of its TBT SLO a Sarathi hybrid iteration may take
CAPACITY_TRACE, CAPACITY_SCALE, CAPACITY_MAX_LEN, CAPACITY_REQUESTS = "chat", 1.0, 4096, 24
CAPACITY_TOLERANCE, CAPACITY_MAX_PROBES, CAPACITY_DRAIN_S = 0.25, 3, 30.0
# A dry run's capacity searches on the CPU, where the probe loads are low: fewer requests, probes and
# seconds of drain, so that each search ends well within its limit (a probe lasts up to requests / QPS
# plus the drain).
DRY_RUN_CAPACITY: dict[str, Any] = {"requests": 4, "max_probes": 2, "drain_s": 10.0}
# The router and the load generator share the host with the worker: past tens of QPS of streamed
# tokens the host, not the GPU, would set the TBT, so the probes stay below this load.
MAX_PROBE_QPS = 40.0
MIN_PROBE_QPS = 0.2
PROGRESS = "» "  # lines of a part's output that the check echoes (the rest goes to the part's log)
NO_CUDA_EXIT = 2
GRAPHS_UNAVAILABLE = "graphs not available in this build"


# ---- arguments -----------------------------------------------------------------------------------
def parse_parts(text: str) -> tuple[str, ...]:
    """`engine,capacity` → the parts in run order; every name must be a known part."""
    names = [p.strip() for p in text.split(",") if p.strip()]
    unknown = [p for p in names if p not in PARTS]
    if unknown or not names:
        raise ValueError(f"--parts: unknown part(s) {', '.join(unknown) or '(none given)'}; "
                         f"choose from {', '.join(PARTS)}")
    return tuple(p for p in PARTS if p in names)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m chariot.bench.gpu_check",
                                description=(__doc__ or "").splitlines()[0])
    p.add_argument("--out", required=True, metavar="DIR", help="folder for JSON, logs, plots and report.md")
    p.add_argument("--layers", type=int, default=DEFAULT_LAYERS,
                   help=f"decoder layers of the Llama-3-8B-shaped model (1-{FULL_LAYERS}, default {DEFAULT_LAYERS}); "
                        "figures are scaled to 32 layers")
    p.add_argument("--budget-s", type=float, default=DEFAULT_BUDGET_S,
                   help=f"overall time limit in seconds (default {DEFAULT_BUDGET_S:g}); each part also has its own")
    p.add_argument("--parts", default=",".join(PARTS),
                   help=f"comma-separated parts to run (default all: {','.join(PARTS)})")
    p.add_argument("--dry-run", action="store_true",
                   help="run every part on the CPU with the small preset: checks the check itself, measures nothing")
    p.add_argument("--model-root", default=None, metavar="DIR",
                   help="where the random checkpoint is written (default /dev/shm if it has room, else build/)")
    return p


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    """The check's arguments; a bad value exits 2 with a message naming its flag."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if not 1 <= args.layers <= FULL_LAYERS:
        parser.error(f"--layers must be between 1 and {FULL_LAYERS}, got {args.layers}")
    if not 0 < args.budget_s <= MAX_BUDGET_S:
        parser.error(f"--budget-s must be in (0, {MAX_BUDGET_S:g}], got {args.budget_s:g}")
    try:
        args.parts = parse_parts(args.parts)
    except ValueError as exc:
        parser.error(str(exc))
    return args


def graphs_in_this_build() -> bool:
    """Whether this build's engine has the CUDA-graphs setting."""
    import dataclasses

    from chariot.worker.config import EngineConfig

    return "cuda_graphs" in {f.name for f in dataclasses.fields(EngineConfig)}


def engine_runs(graphs: bool, layers: int) -> list[str]:
    """The engine runs to make: graphs on and off where the build has them, each also at half depth
    where the per-layer fit needs it."""
    modes = ["on", "off"] if graphs else ["off"]
    return modes + (["sync"] if graphs else []) + ([f"{m}_half" for m in modes] if half_depth(layers) else [])


def cuda_problem() -> str | None:
    """Why this machine cannot run the check, or None when a CUDA device is usable."""
    try:
        import torch
    except ImportError as exc:
        return f"torch cannot be imported ({exc})"
    if torch.version.cuda is None:
        return (f"torch {torch.__version__} at {sys.executable} is a CPU-only build; run with a python whose torch "
                "has CUDA (make gpu-check GPU_PYTHON=...)")
    if not torch.cuda.is_available():
        return f"no CUDA device is visible to torch {torch.__version__} (CUDA {torch.version.cuda}) at {sys.executable}"
    return None


# ---- the model and its floor ---------------------------------------------------------------------
def model_config(layers: int) -> dict[str, Any]:
    """The checkpoint config of the Llama-3-8B preset cut to `layers` layers (same layer shapes)."""
    from chariot.worker.model.make_model import build_config

    config = build_config(PRESET)
    config["num_hidden_layers"] = layers
    return config


def dtype_bytes(config: Mapping[str, Any]) -> int:
    return {"float32": 4, "float16": 2, "bfloat16": 2}[str(config["torch_dtype"])]


def decode_read_bytes(config: Mapping[str, Any], batch: int, context: float) -> int:
    """Bytes one decode iteration of `batch` sequences at `context` tokens must read from memory:
    every weight once (the input embedding only for the batch's rows, unless tied to the LM head)
    and every cached K and V of every layer once."""
    from chariot.worker.model.make_model import weight_shapes

    elem = dtype_bytes(config)
    tied = bool(config["tie_word_embeddings"])
    weights = sum(math.prod(shape) for name, shape in weight_shapes(dict(config))
                  if tied or name != "model.embed_tokens.weight")
    embedded_rows = 0 if tied else batch * config["hidden_size"]
    kv_per_token = 2 * config["num_hidden_layers"] * config["num_key_value_heads"] * config["head_dim"]
    return int((weights + embedded_rows) * elem + batch * context * kv_per_token * elem)


def floor_ms(read_bytes: int, bandwidth_gbs: float) -> float:
    """The fastest a memory-bound iteration can be: its bytes over the measured bandwidth."""
    if bandwidth_gbs <= 0:
        raise ValueError(f"bandwidth must be positive, got {bandwidth_gbs}")
    return read_bytes / (bandwidth_gbs * 1e9) * 1e3


def scale_to_layers(full_ms: float, half_ms: float, layers: int, half_layers: int,
                    target: int = FULL_LAYERS) -> float | None:
    """A per-iteration time at `target` layers from two depths: t = fixed + layers × per_layer.
    None when the two points do not give a positive per-layer time (noise larger than a layer)."""
    if layers == target:
        return full_ms
    if half_layers >= layers:
        return None
    per_layer = (full_ms - half_ms) / (layers - half_layers)
    if per_layer <= 0:
        return None
    return full_ms + (target - layers) * per_layer


def half_depth(layers: int) -> int | None:
    """The second depth of the per-layer fit (None: one layer cannot be split, 32 need no fit)."""
    return None if layers < 2 or layers == FULL_LAYERS else layers // 2


# ---- the SLO, the budget and the probe loads -----------------------------------------------------
def slos_ms(lone_decode_ms: float) -> dict[str, float]:
    """The paper's TBT SLOs from the time of a decode iteration of one sequence."""
    if lone_decode_ms <= 0:
        raise ValueError(f"the lone decode iteration must take a positive time, got {lone_decode_ms}")
    return {STRICT: STRICT_SLO_FACTOR * lone_decode_ms, RELAXED: RELAXED_SLO_FACTOR * lone_decode_ms}


def prefill_ms_at(tokens: int, prefill_ms: Mapping[int, float]) -> float:
    """Prefill time of a chunk of `tokens`, linear through the two measured chunk sizes."""
    (n1, t1), (n2, t2) = sorted(prefill_ms.items())[:1] + sorted(prefill_ms.items())[-1:]
    if n1 == n2:
        return t1 * tokens / n1
    slope = (t2 - t1) / (n2 - n1)
    return max(0.0, t1 + slope * (tokens - n1))


def pick_token_budget(prefill_ms: Mapping[int, float], decode_ms: float, slo_ms: float,
                      candidates: Sequence[int] = BUDGET_CANDIDATES) -> int:
    """Sarathi's token budget for a TBT SLO: the largest candidate whose hybrid iteration (the chunk's
    prefill beside a decode batch) stays within `HYBRID_SHARE_OF_SLO` of it; the smallest candidate if
    none does."""
    if not prefill_ms:
        raise ValueError("need at least one measured prefill chunk")
    return measured_token_budget({c: decode_ms + prefill_ms_at(c, prefill_ms) for c in candidates}, slo_ms)


def measured_token_budget(hybrid_ms: Mapping[int, float], slo_ms: float) -> int:
    """Sarathi's token budget for a TBT SLO from timed hybrid iterations (budget → median ms): the
    largest budget whose iteration took at most `HYBRID_SHARE_OF_SLO` of the SLO; the smallest timed
    one if none did. Where hybrid iterations are bound by the host, a smaller chunk does not make them
    shorter, which a model from the prefill times alone misses."""
    if not hybrid_ms:
        raise ValueError("need at least one timed hybrid iteration")
    fitting = [b for b, ms in hybrid_ms.items() if ms <= HYBRID_SHARE_OF_SLO * slo_ms]
    return max(fitting) if fitting else min(hybrid_ms)


def token_budgets(prefill_ms: Mapping[int, float], decode_ms: float, slo_ms: Mapping[str, float]) -> dict[str, int]:
    """Sarathi's token budget per SLO (name → budget), each from its own SLO: a looser SLO leaves room
    for a larger chunk beside the decodes."""
    return {name: pick_token_budget(prefill_ms, decode_ms, slo) for name, slo in slo_ms.items()}


def capacity_search(name: str, plan: Mapping[str, Any]) -> tuple[str, int | None, tuple[float, ...]]:
    """What capacity search `name` runs under `plan`: its policy, its token budget (sarathi: the budget
    of the SLO it searches; vllm: none) and its SLOs in ms, strictest first."""
    if name not in CAPACITY_SEARCHES:
        raise ValueError(f"unknown capacity search {name!r}; choose from {', '.join(CAPACITY_SEARCHES)}")
    policy, slo_names = CAPACITY_SEARCHES[name]
    budget = int(plan["token_budgets"][slo_names[0]]) if policy == "sarathi" else None
    return policy, budget, tuple(sorted(float(plan["slo_ms"][s]) for s in slo_names))


def probe_qps_range(decode_batch_ms: float, batch: int, prefill_ms_per_token: float,
                    mean_prompt: float, mean_decode: float) -> tuple[float, float]:
    """(lowest, first upper) probe load of the capacity search, around a rough capacity estimate:
    a request keeps the GPU busy for its decode tokens at the full batch's per-token time plus its
    prompt at the prefill rate. Clamped to [MIN_PROBE_QPS, MAX_PROBE_QPS]."""
    if batch < 1 or decode_batch_ms <= 0:
        raise ValueError("need a measured decode batch")
    busy_ms = mean_decode * decode_batch_ms / batch + mean_prompt * prefill_ms_per_token
    estimate = 1e3 / busy_ms if busy_ms > 0 else MAX_PROBE_QPS
    low = min(max(0.1 * estimate, MIN_PROBE_QPS), MAX_PROBE_QPS / 4)
    high = min(max(0.5 * estimate, 2 * low), MAX_PROBE_QPS)
    return round(low, 3), round(high, 3)


def capacity_plan(engine: Mapping[str, Any], requests: int = CAPACITY_REQUESTS, max_probes: int = CAPACITY_MAX_PROBES,
                  drain_s: float = CAPACITY_DRAIN_S) -> dict[str, Any]:
    """How the capacity searches run, from the engine part's measurements (graphs on where available,
    as the served workers run): the SLOs from the lone decode iteration, Sarathi's token budget per
    SLO, the trace (`requests` per probe) and the probe loads (at most `max_probes` per SLO)."""
    from chariot.bench.traces import TRACES, make_trace

    runs = engine.get("runs", {})
    mode = "on" if runs.get("on", {}).get("decode") else "off"
    decode = {r["batch"]: r["median_ms"] for r in runs.get(mode, {}).get("decode", [])}
    prefill = {r["tokens"]: r["median_ms"] for r in runs.get(mode, {}).get("prefill", [])}
    if 1 not in decode or not prefill:
        raise ValueError(f"the engine part measured no lone decode iteration or no prefill (graphs {mode})")
    slo = {k: round(v, 1) for k, v in slos_ms(decode[1]).items()}
    hybrid = {r["budget"]: r["median_ms"] for r in runs.get(mode, {}).get("hybrid", [])}
    budgets = ({name: measured_token_budget(hybrid, ms) for name, ms in slo.items()} if hybrid else
               token_budgets(prefill, decode.get(HEADLINE_BATCH, decode[max(decode)]), slo))
    batch = max(decode)
    trace = make_trace(TRACES[CAPACITY_TRACE], requests, None, seed=0, scale=CAPACITY_SCALE,
                       max_len=CAPACITY_MAX_LEN)
    mean_prompt = statistics.mean(r.prompt_len for r in trace)
    mean_decode = statistics.mean(r.decode_len for r in trace)
    per_token = prefill_ms_at(max(prefill), prefill) / max(prefill)
    low, high = probe_qps_range(decode[batch], batch, per_token, mean_prompt, mean_decode)
    return {"graphs": mode, "lone_decode_ms": decode[1], "slo_ms": slo,
            "token_budgets": budgets, "budgets_from": "hybrid iterations" if hybrid else "prefill and decode times",
            "trace": CAPACITY_TRACE, "scale": CAPACITY_SCALE, "max_len": CAPACITY_MAX_LEN,
            "requests": requests, "mean_prompt": mean_prompt, "mean_decode": mean_decode,
            "qps_low": low, "qps_high": high, "tolerance": CAPACITY_TOLERANCE, "max_probes": max_probes,
            "drain_s": drain_s}


# ---- reading the parts' output -------------------------------------------------------------------
PYTEST_COUNT = re.compile(r"(\d+) (passed|failed|errors?|skipped|deselected|xfailed|xpassed)")
PYTEST_PROGRESS = re.compile(r"^([.FEsxX]+)\s*(?:\[\s*\d+%\])?\s*$", re.MULTILINE)


def parse_pytest_summary(text: str) -> dict[str, Any]:
    """Counts from pytest's last summary line ("21 passed, 262 deselected, 1 warning in 50.05s"); from
    its progress characters (`.FEsx`) when it was stopped before the summary (then `partial`)."""
    lines = [line for line in text.splitlines() if re.search(r"\b(passed|failed|errors?|deselected)\b", line)
             and " in " in line]
    counts: dict[str, Any] = {"passed": 0, "failed": 0, "errors": 0, "skipped": 0, "deselected": 0,
                              "partial": not lines}
    if lines:
        for number, word in PYTEST_COUNT.findall(lines[-1]):
            key = "errors" if word.startswith("error") else word
            counts[key] = counts.get(key, 0) + int(number)
        return counts
    progress = "".join(m.group(1) for m in PYTEST_PROGRESS.finditer(text))
    counts.update(passed=progress.count("."), failed=progress.count("F"), errors=progress.count("E"),
                  skipped=progress.count("s"))
    return counts


def gpu_test_files(tests_root: Path) -> list[str]:
    """Test files that carry the `gpu` marker (collecting only them keeps optional test-only
    packages, missing on a bare GPU machine, out of the run)."""
    marker = re.compile(r"pytest\.mark\.gpu\b")
    return sorted(str(p) for p in tests_root.rglob("test_*.py") if marker.search(p.read_text()))


LAUNCH_APIS = ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchCooperativeKernel", "cudaGraphLaunch",
               "cuGraphLaunch")
NOT_KERNELS = ("Memcpy", "Memset")


def kernel_counts(device_events: Sequence[str], host_events: Sequence[str], iterations: int) -> dict[str, float]:
    """Kernels executed and launch calls made per iteration, from a profile of `iterations` steps
    (device event names; host runtime-API event names). Graph replays count one launch each."""
    if iterations < 1:
        raise ValueError(f"iterations must be >= 1, got {iterations}")
    kernels = sum(not name.startswith(NOT_KERNELS) for name in device_events)
    launches = sum(name.startswith(LAUNCH_APIS) for name in host_events)
    graphs = sum(name.startswith(("cudaGraphLaunch", "cuGraphLaunch")) for name in host_events)
    return {"kernels_per_iteration": kernels / iterations, "launch_calls_per_iteration": launches / iterations,
            "graph_launches_per_iteration": graphs / iterations}


# A profiler event's own device time in µs; torch has named it differently across versions (the
# `cuda_*` names are the older, deprecated ones).
DEVICE_TIME_FIELDS = ("device_time_total", "self_device_time_total", "device_time", "cuda_time_total",
                      "self_cuda_time_total", "cuda_time")


def is_cuda_event(event: Any) -> bool:
    return str(getattr(event, "device_type", "")).endswith("CUDA")


def event_device_us(event: Any) -> float:
    """µs a device event (a kernel) ran: its device-time field where this torch has one that is
    positive, else the length of its time range."""
    for field in DEVICE_TIME_FIELDS:
        try:
            value = getattr(event, field)
        except (AttributeError, AssertionError):  # absent here, or not defined for this event type
            continue
        if isinstance(value, int | float) and value > 0:
            return float(value)
    span = getattr(event, "time_range", None)
    return max(0.0, float(span.end - span.start)) if span is not None else 0.0


def union_us(spans: Sequence[tuple[float, float]]) -> float:
    """Length of the union of (start, end) intervals: time during which at least one ran."""
    total, reach = 0.0, -math.inf
    for start, end in sorted(spans):
        if end <= reach:
            continue
        total += end - max(start, reach)
        reach = end
    return total


def kernel_busy(events: Sequence[Any], iterations: int) -> dict[str, float | None]:
    """The GPU's own time per iteration, from a profile of `iterations` steps (torch.profiler's
    FunctionEvents, or anything with their `name`, `device_type`, device-time and `time_range`
    attributes): `device_ms_per_iteration`, the kernels' durations summed, and
    `device_busy_ms_per_iteration`, the union of their time ranges (overlapping kernels counted once).
    Copies and memsets are not kernels and are left out. None where the profile has no kernels (no
    CUDA), or no time ranges for the union."""
    if iterations < 1:
        raise ValueError(f"iterations must be >= 1, got {iterations}")
    kernels = [e for e in events if is_cuda_event(e) and not str(e.name).startswith(NOT_KERNELS)]
    if not kernels:
        return {"device_ms_per_iteration": None, "device_busy_ms_per_iteration": None}
    total = sum(event_device_us(e) for e in kernels)
    spans = [(float(e.time_range.start), float(e.time_range.end)) for e in kernels
             if getattr(e, "time_range", None) is not None]
    busy = union_us(spans) if len(spans) == len(kernels) else None
    return {"device_ms_per_iteration": total / iterations / 1e3,
            "device_busy_ms_per_iteration": None if busy is None else busy / iterations / 1e3}


def compare_greedy(first: Sequence[Sequence[int]], second: Sequence[Sequence[int]]) -> dict[str, Any]:
    """Whether two runs' greedy tokens are identical, prompt by prompt (first differing position)."""
    if len(first) != len(second):
        return {"identical": False, "prompts": max(len(first), len(second)),
                "differences": [f"{len(first)} against {len(second)} outputs"]}
    differences = []
    for i, (a, b) in enumerate(zip(first, second, strict=True)):
        if list(a) != list(b):
            at = next((k for k, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
            differences.append(f"prompt {i}: first differs at token {at}")
    return {"identical": not differences, "prompts": len(first), "differences": differences}


def read_json(path: Path) -> dict[str, Any] | None:
    try:
        value = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None
    return value if isinstance(value, dict) else None


def write_json(path: Path, value: Mapping[str, Any]) -> None:
    """Write atomically, so a part killed mid-write leaves the previous version."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(value, indent=2, default=_json_default) + "\n")
    tmp.replace(path)


def _json_default(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return str(value)


# ---- summary ------------------------------------------------------------------------------------
def decode_rows(engine: Mapping[str, Any], layers: int, bandwidth_gbs: float | None) -> list[dict[str, Any]]:
    """One row per (graphs, batch): measured time, its floor and ratio at `layers`, and both
    scaled to 32 layers (from the half-depth run of the same setting)."""
    runs = engine.get("runs", {})
    half = half_depth(layers)
    rows = []
    for mode in DECODE_MODES:
        full = {r["batch"]: r for r in runs.get(mode, {}).get("decode", [])}
        halves = {r["batch"]: r for r in runs.get(f"{mode}_half", {}).get("decode", [])}
        for batch, r in sorted(full.items()):
            rows.append(_decode_row(mode, r, halves.get(batch), layers, half, bandwidth_gbs))
    return rows


def _decode_row(mode: str, full: Mapping[str, Any], half: Mapping[str, Any] | None, layers: int,
                half_layers: int | None, bandwidth_gbs: float | None) -> dict[str, Any]:
    batch, context = full["batch"], full["mean_context"]
    row: dict[str, Any] = {"graphs": mode, "batch": batch, "mean_context": context, "layers": layers,
                           "median_ms": full["median_ms"]}
    scaled = full["median_ms"] if layers == FULL_LAYERS else None
    if half is not None and half_layers is not None:
        scaled = scale_to_layers(full["median_ms"], half["median_ms"], layers, half_layers)
    row["scaled_32_ms"] = scaled
    if bandwidth_gbs:
        row["floor_ms"] = floor_ms(decode_read_bytes(model_config(layers), batch, context), bandwidth_gbs)
        row["x_floor"] = full["median_ms"] / row["floor_ms"]
        row["floor_32_ms"] = floor_ms(decode_read_bytes(model_config(FULL_LAYERS), batch, context), bandwidth_gbs)
        row["x_floor_32"] = None if scaled is None else scaled / row["floor_32_ms"]
    return row


def prefill_rows(engine: Mapping[str, Any], layers: int) -> list[dict[str, Any]]:
    runs, half, rows = engine.get("runs", {}), half_depth(layers), []
    for mode in ("on", "off"):
        halves = {r["tokens"]: r["median_ms"] for r in runs.get(f"{mode}_half", {}).get("prefill", [])}
        for r in runs.get(mode, {}).get("prefill", []):
            scaled = r["median_ms"] if layers == FULL_LAYERS else None
            if half is not None and r["tokens"] in halves:
                scaled = scale_to_layers(r["median_ms"], halves[r["tokens"]], layers, half)
            rows.append({"graphs": mode, "tokens": r["tokens"], "median_ms": r["median_ms"], "scaled_32_ms": scaled})
    return rows


def hybrid_rows(engine: Mapping[str, Any]) -> list[dict[str, Any]]:
    """Each run's timed hybrid iterations beside the same run's decode-only iteration of as many
    sequences (at the depth measured: a hybrid row has no half-depth run to scale from)."""
    rows = []
    for mode, run in engine.get("runs", {}).items():
        decode = {r["batch"]: r["median_ms"] for r in run.get("decode", [])}
        rows += [{"graphs": mode, **r, "decode_only_ms": decode.get(r["decodes"])} for r in run.get("hybrid", [])]
    return rows


def capacity_folder(search: str) -> str:
    """Where a capacity search leaves `chariot bench capacity`'s files, under the check's folder."""
    return f"capacity-{search}"


def capacity_summary(results: Mapping[str, Mapping[str, Any] | None],
                     plan: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """Each capacity search's result (search name → its capacity.json), the capacity per policy and SLO
    (sarathi's under each SLO from the search with that SLO's budget), and the sarathi/vllm ratio under
    each SLO, naming the sarathi budget it used (a bound when `vllm` did not pass even the lowest probe)."""
    searches = {name: {"policy": p.get("policy", name.partition("-")[0]), "label": p["label"],
                       "token_budget": p.get("token_budget"), "capacity_qps": dict(p["capacity_qps"])}
                for name, doc in results.items() if doc is not None for p in doc.get("policies", [])[:1]}
    if not searches:
        return None
    by_policy: dict[str, dict[str, float]] = {}
    sarathi_label: dict[str, str] = {}  # SLO → the label of the sarathi search that measured it
    for s in searches.values():
        by_policy.setdefault(s["policy"], {}).update(s["capacity_qps"])
        if s["policy"] == "sarathi":
            sarathi_label.update(dict.fromkeys(s["capacity_qps"], s["label"]))
    out: dict[str, Any] = {"capacity_qps": {p: dict(sorted(c.items(), key=lambda kv: float(kv[0])))
                                            for p, c in by_policy.items()},
                           "searches": searches, "plan": dict(plan or {}), "ratio": {}}
    sarathi, vllm = out["capacity_qps"].get("sarathi", {}), out["capacity_qps"].get("vllm", {})
    low = float((plan or {}).get("qps_low", 0.0))
    for slo, cap in vllm.items():
        if slo in sarathi:
            out["ratio"][slo] = {**capacity_ratio(sarathi[slo], cap, low), "sarathi": sarathi_label[slo]}
    return out


def probe_lines(log: Path) -> list[str]:
    """The probe lines a capacity search logged (`capacity_cli.probe_line`): what a search stopped at
    its limit still tells."""
    if not log.is_file():
        return []
    return [line.strip() for line in log.read_text(errors="replace").splitlines() if " QPS  P50 TTFT " in line]


def kernel_rows(kernels: Mapping[str, Mapping[str, Any]], decode: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """The kernel profile of each graphs setting beside the median wall time of the same decode batch
    (`wall_ms`), and the share of that wall time the GPU was not busy (`host_bound_share`, 1 - busy /
    wall; from the union of kernel time ranges where recorded, else from the summed durations; None
    without a GPU figure)."""
    wall = {r["graphs"]: r["median_ms"] for r in decode if r["batch"] == HEADLINE_BATCH}
    rows: dict[str, Any] = {}
    for mode, k in kernels.items():
        busy = k.get("device_busy_ms_per_iteration")
        busy = k.get("device_ms_per_iteration") if busy is None else busy
        ms = wall.get(mode)
        rows[mode] = {**k, "wall_ms": ms,
                      "host_bound_share": 1 - busy / ms if busy is not None and ms else None}
    return rows


def capacity_ratio(sarathi: float, vllm: float, qps_low: float) -> dict[str, Any]:
    if vllm > 0:
        return {"value": sarathi / vllm}
    if sarathi > 0:
        return {"at_least": sarathi / qps_low if qps_low else None,
                "note": f"vllm below the lowest probe, {qps_low:g} QPS"}
    return {"note": "neither policy passed the lowest probe"}


def summarize(out: Path, layers: int, statuses: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
    """The check's results from the part files in `out`, with the headline numbers."""
    prepare = read_json(out / "prepare.json") or {}
    engine = read_json(out / "engine.json") or {}
    bandwidth = prepare.get("bandwidth", {}).get("floor_gbs")
    decode = decode_rows(engine, layers, bandwidth)
    runs = engine.get("runs", {})
    on, off, sync = (runs.get(m, {}).get("greedy") for m in ("on", "off", "sync"))
    greedy = compare_greedy(on, off) if on is not None and off is not None else None
    greedy_sync = compare_greedy(on, sync) if on is not None and sync is not None else None
    summary = {
        "gpu": prepare.get("gpu"), "torch": prepare.get("torch"), "layers": layers, "full_layers": FULL_LAYERS,
        "dry_run": prepare.get("preset", PRESET) != PRESET, "decode_context": engine.get("decode_context"),
        "model": prepare.get("model"), "bandwidth": prepare.get("bandwidth"), "parts": dict(statuses),
        "graphs_available": engine.get("graphs_available"), "graphs_note": engine.get("graphs_note"),
        "decode": decode, "prefill": prefill_rows(engine, layers), "hybrid": hybrid_rows(engine),
        "kernels": kernel_rows(engine.get("kernels", {}), decode),
        "greedy": greedy, "greedy_async": greedy_sync, "gpu_tests": read_json(out / "gpu_tests.json"),
        "capacity": capacity_summary({s: read_json(out / capacity_folder(s) / "capacity.json")
                                      for s in CAPACITY_SEARCHES}, read_json(out / "capacity_plan.json")),
        "capacity_probes": {s: probe_lines(out / f"capacity-{s}.log") for s in CAPACITY_SEARCHES},
        "vllm": read_json(out / "vllm.json"),
    }
    summary["headline"] = headline(summary)
    return summary


def headline(summary: Mapping[str, Any]) -> dict[str, Any]:
    """The numbers issue 38 asks for: decode at 64 sequences with graphs against its floor (measured
    depth and scaled to 32 layers), greedy identity, the strict-SLO capacity ratio, the gpu tests."""
    rows = {(r["graphs"], r["batch"]): r for r in summary.get("decode", [])}
    best = rows.get(("on", HEADLINE_BATCH)) or rows.get(("off", HEADLINE_BATCH)) or {}
    capacity = summary.get("capacity") or {}
    tests = summary.get("gpu_tests") or {}
    return {"decode_batch": HEADLINE_BATCH, "graphs": best.get("graphs"), "decode_ms": best.get("median_ms"),
            "floor_ms": best.get("floor_ms"), "x_floor": best.get("x_floor"),
            "decode_32_ms": best.get("scaled_32_ms"), "floor_32_ms": best.get("floor_32_ms"),
            "x_floor_32": best.get("x_floor_32"),
            "greedy_identical": (summary.get("greedy") or {}).get("identical"),
            "greedy_identical_async": (summary.get("greedy_async") or {}).get("identical"),
            "capacity_ratio": capacity.get("ratio", {}),
            "gpu_tests": {k: tests.get(k) for k in ("passed", "failed", "errors")} if tests else None}


# ---- report -------------------------------------------------------------------------------------
def _num(value: Any, digits: int = 2, missing: str = "–") -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return missing
    return f"{value:.{digits}f}" if isinstance(value, float) else str(value)


def render_report(summary: Mapping[str, Any]) -> str:
    """report.md: the headline, then one short section per part."""
    sections = [_report_head(summary), _report_parts(summary), _report_tests(summary), _report_decode(summary),
                _report_prefill(summary), _report_hybrid(summary), _report_kernels(summary), _report_greedy(summary),
                _report_capacity(summary), _report_vllm(summary)]
    return "\n\n".join(s for s in sections if s) + "\n"


def _report_head(s: Mapping[str, Any]) -> str:
    layers, bw = int(s.get("layers") or FULL_LAYERS), s.get("bandwidth") or {}
    h = s.get("headline") or {}
    lines = [f"# GPU check: {s.get('gpu') or 'unknown GPU'} (torch {s.get('torch') or '?'})", "",
             f"Random weights with Llama-3-8B's layer shapes (hidden 4096, 32 heads, 8 KV heads, intermediate "
             f"14336, vocabulary 128256, bf16), **{layers} of {FULL_LAYERS} layers**. Figures \"at 32 layers\" are "
             f"scaled per layer from runs at {layers} and {half_depth(layers) or layers} layers."
             if layers != FULL_LAYERS else "Random weights with Llama-3-8B's shapes, all 32 layers, bf16.",
             "",
             *(["**A dry run on the CPU with the small preset: it checks the check; its figures mean nothing.**",
                ""] if s.get("dry_run") else []),
             f"HBM bandwidth measured: copy {_num(bw.get('copy_gbs'), 0)} GB/s (read + write), read "
             f"{_num(bw.get('read_gbs'), 0)} GB/s; the floors use {_num(bw.get('floor_gbs'), 0)} GB/s.",
             "",
             f"**Decode, {h.get('decode_batch')} sequences, graphs {h.get('graphs') or '–'}:** "
             f"{_num(h.get('decode_ms'))} ms against a floor of {_num(h.get('floor_ms'))} ms "
             f"({_num(h.get('x_floor'))}× floor) at {layers} layers; at 32 layers {_num(h.get('decode_32_ms'))} ms "
             f"against {_num(h.get('floor_32_ms'))} ms ({_num(h.get('x_floor_32'))}× floor; issue 38 asks ≤ 1.5×)."]
    return "\n".join(lines)


def _report_parts(s: Mapping[str, Any]) -> str:
    lines = ["## Parts", "", "| part | status | seconds | note |", "|---|---|---:|---|"]
    for name, st in (s.get("parts") or {}).items():
        lines.append(f"| {name} | {st.get('status')} | {_num(st.get('seconds'), 0)} | {st.get('note') or ''} |")
    return "\n".join(lines)


def _report_tests(s: Mapping[str, Any]) -> str:
    tests = s.get("gpu_tests")
    if not tests:
        return "## gpu tests\n\nNot run."
    counts = ", ".join(f"{tests.get(k, 0)} {k}" for k in ("passed", "failed", "errors", "skipped"))
    cut = " (stopped before its summary: counted from its progress)" if tests.get("partial") else ""
    return f"## gpu tests\n\n`pytest -m gpu`: {counts}{cut}; output in gpu_tests.log."


def _report_decode(s: Mapping[str, Any]) -> str:
    rows = s.get("decode") or []
    if not rows:
        return "## Decode iterations\n\nNot measured (see the engine part's log)."
    lines = [f"## Decode iterations (context {s.get('decode_context') or DECODE_CONTEXT}, median)", "",
             f"| graphs | batch | ms at {s.get('layers')} layers | floor ms | × floor | ms at 32 layers | "
             "floor ms (32) | × floor (32) |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        label = RUN_LABELS.get(r["graphs"], r["graphs"])
        lines.append(f"| {label} | {r['batch']} | {_num(r['median_ms'])} | {_num(r.get('floor_ms'))} | "
                     f"{_num(r.get('x_floor'))} | {_num(r.get('scaled_32_ms'))} | {_num(r.get('floor_32_ms'))} | "
                     f"{_num(r.get('x_floor_32'))} |")
    if s.get("graphs_note"):
        lines += ["", f"CUDA graphs: {s['graphs_note']}."]
    return "\n".join(lines)


def _report_prefill(s: Mapping[str, Any]) -> str:
    rows = s.get("prefill") or []
    if not rows:
        return ""
    lines = ["## Prefill chunks (a fresh prompt in one iteration, median)", "",
             f"| graphs | tokens | ms at {s.get('layers')} layers | ms at 32 layers |", "|---|---:|---:|---:|"]
    lines += [f"| {r['graphs']} | {r['tokens']} | {_num(r['median_ms'])} | {_num(r.get('scaled_32_ms'))} |"
              for r in rows]
    return "\n".join(lines)


def _report_hybrid(s: Mapping[str, Any]) -> str:
    rows = s.get("hybrid") or []
    if not rows:
        return ""
    lines = ["## Hybrid iterations (decodes beside a fresh prompt's chunk, median)", "",
             "Sarathi-Serve's stall-free batches; the capacity searches size sarathi's token budget from these "
             f"(the largest budget whose iteration fits {HYBRID_SHARE_OF_SLO:.0%} of the SLO).", "",
             f"| graphs | budget | decodes + chunk tokens | ms at {s.get('layers')} layers "
             "| decode-only iteration ms |",
             "|---|---:|---:|---:|---:|"]
    lines += [f"| {r['graphs']} | {r['budget']} | {r['decodes']} + {r['budget'] - r['decodes']} | "
              f"{_num(r['median_ms'])} | {_num(r.get('decode_only_ms'))} |" for r in rows]
    return "\n".join(lines)


def _report_kernels(s: Mapping[str, Any]) -> str:
    kernels = s.get("kernels") or {}
    if not kernels:
        return ""
    lines = [f"## Kernels per decode iteration ({HEADLINE_BATCH} sequences, torch.profiler)", "",
             "| graphs | kernels executed | launch calls | graph launches | kernel ms (sum) | GPU busy ms | "
             "wall ms (median) | host-bound share |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for mode, k in kernels.items():
        busy = k.get("device_busy_ms_per_iteration")
        busy = k.get("device_ms_per_iteration") if busy is None else busy
        share = k.get("host_bound_share")
        lines.append(f"| {RUN_LABELS.get(mode, mode)} | {_num(k.get('kernels_per_iteration'), 1)} | "
                     f"{_num(k.get('launch_calls_per_iteration'), 1)} | "
                     f"{_num(k.get('graph_launches_per_iteration'), 1)} | "
                     f"{_num(k.get('device_ms_per_iteration'), 3, '—')} | {_num(busy, 3, '—')} | "
                     f"{_num(k.get('wall_ms'), 3)} | {'—' if share is None else f'{share:.0%}'} |")
    lines += ["", "Kernel ms: the kernels' device durations summed; GPU busy: the union of their time ranges "
              "(overlaps counted once), both per profiled iteration; wall: the median of the same batch's timed "
              "iterations; host-bound share: 1 − busy / wall, the part of an iteration the GPU waits for the host "
              "(— without CUDA kernels in the profile)."]
    return "\n".join(lines)


def _report_greedy(s: Mapping[str, Any]) -> str:
    lines = ["## Greedy tokens", ""]
    for key, what in (("greedy", "graphs on and off"), ("greedy_async", "async scheduling on and off (graphs on)")):
        greedy = s.get(key)
        if not greedy:
            lines.append(f"- {what}: not compared (see the engine part).")
            continue
        verdict = "identical" if greedy["identical"] else "DIFFERENT: " + "; ".join(greedy["differences"])
        lines.append(f"- {what}: {greedy['prompts']} prompts, {verdict}.")
    return "\n".join(lines)


def _report_capacity(s: Mapping[str, Any]) -> str:
    cap = s.get("capacity")
    probes = [line for lines in (s.get("capacity_probes") or {}).values() for line in lines]
    seen = ["", "Probes, as the searches logged them:", "", "```", *probes, "```"] if probes else []
    if not cap:
        return "\n".join(["## Capacity under SLO", "", "No search finished (see the capacity parts).", *seen])
    plan = cap.get("plan") or {}
    slos, budgets = plan.get("slo_ms") or {}, plan.get("token_budgets") or {}
    lines = ["## Capacity under SLO (`sarathi` against `vllm`)", "",
             f"Lone decode iteration {_num(plan.get('lone_decode_ms'))} ms: strict SLO {_num(slos.get(STRICT))} ms "
             f"(5×), relaxed {_num(slos.get(RELAXED))} ms (25×); sarathi token budget per SLO (the largest "
             f"whose hybrid iteration fits {HYBRID_SHARE_OF_SLO:.0%} of it, from "
             f"{plan.get('budgets_from', 'prefill and decode times')}): {budgets.get(STRICT)} strict, "
             f"{budgets.get(RELAXED)} relaxed, each SLO its own sarathi search; trace {plan.get('trace')} "
             f"×{plan.get('scale')}, {plan.get('requests')} requests per probe, probes from {plan.get('qps_low')} QPS.",
             "", "| search | policy | capacity (QPS) by SLO (ms) |", "|---|---|---|"]
    searches = (cap.get("searches") or {}).items()
    for name, search in sorted(searches, key=lambda item: item[1]["policy"] != "sarathi"):  # sarathi's first
        lines.append(f"| {name} | {search['label']} | "
                     + ", ".join(f"{_num(q, 3)} @ {slo}" for slo, q in search["capacity_qps"].items()) + " |")
    for slo, ratio in (cap.get("ratio") or {}).items():
        lines.append(f"\n{ratio.get('sarathi', 'sarathi')} / vllm @ {slo} ms: {_ratio_text(ratio)}")
    lines += seen
    if s.get("layers") != FULL_LAYERS:
        lines.append(f"\nAt {s.get('layers')} layers the LM head and the host are a larger share of a decode "
                     "iteration than at 32, so prefill stalls weigh less against the SLO: `--layers 32` measures "
                     "Llama-3-8B's own balance.")
    return "\n".join(lines)


def _ratio_text(ratio: Mapping[str, Any]) -> str:
    if "value" in ratio:
        return f"{ratio['value']:.2f}×"
    if ratio.get("at_least"):
        return f"≥ {_num(ratio['at_least'])}× ({ratio['note']})"
    return str(ratio.get("note", ""))


def _report_vllm(s: Mapping[str, Any]) -> str:
    v = s.get("vllm")
    if not v:
        return "## vLLM side by side\n\nNot run."
    if v.get("skipped"):
        return f"## vLLM side by side\n\nSkipped: {v['skipped']}."
    lines = ["## vLLM side by side (offline, same weights and trace)", "",
             "| system | requests | output tokens | wall s | output tokens/s |", "|---|---:|---:|---:|---:|"]
    for name, r in (v.get("systems") or {}).items():
        lines.append(f"| {name} | {r.get('requests')} | {r.get('output_tokens')} | {_num(r.get('wall_s'))} | "
                     f"{_num(r.get('tokens_per_s'), 0)} |")
    return "\n".join(lines)


def plot_decode(summary: Mapping[str, Any], path: Path) -> Path | None:
    """Iteration time against batch size, graphs on and off, beside the floor; measured depth on the
    left, scaled to 32 layers on the right."""
    rows = summary.get("decode") or []
    if not rows:
        return None
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(11, 4.2))
    FigureCanvasAgg(fig)
    panels = [("median_ms", "floor_ms", f"{summary.get('layers')} layers (measured)"),
              ("scaled_32_ms", "floor_32_ms", "32 layers (scaled)")]
    for i, (key, floor_key, title) in enumerate(panels):
        ax = fig.add_subplot(1, 2, i + 1)
        for mode, style in (("on", "o-"), ("sync", "^-."), ("off", "s--")):
            pts = [(r["batch"], r[key]) for r in rows if r["graphs"] == mode and r.get(key) is not None]
            if pts:
                ax.plot(*zip(*pts, strict=True), style, label=f"graphs {RUN_LABELS[mode]}")
        floor = sorted({(r["batch"], r[floor_key]) for r in rows if r.get(floor_key) is not None})
        if floor:
            ax.plot(*zip(*floor, strict=True), ":", color="black", label="weight+KV-read floor")
        ax.set(xscale="log", xlabel="sequences per decode iteration", ylabel="iteration ms", title=title)
        ax.legend(fontsize=8)
    fig.suptitle(f"Decode iterations, Llama-3-8B shapes, {summary.get('gpu') or 'GPU'}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return path


def plot_capacities(summary: Mapping[str, Any], path: Path) -> Path | None:
    """Capacity per policy under each SLO, every search in one figure: sarathi's bar under each SLO
    is the search with that SLO's token budget (named in the legend)."""
    capacity = summary.get("capacity") or {}
    per_policy = capacity.get("capacity_qps") or {}
    if not per_policy:
        return None
    from chariot.bench.plots import plot_capacity

    budgets = {slo: s["token_budget"] for s in (capacity.get("searches") or {}).values() if s["policy"] == "sarathi"
               for slo in s["capacity_qps"]}

    def legend(policy: str) -> str:
        if policy != "sarathi" or not budgets:
            return policy
        per_slo = ", ".join(f"{budgets[slo]} @ {slo} ms" for slo in sorted(budgets, key=float))
        return f"sarathi (token budget {per_slo})"

    bars = {legend(policy): {float(slo): float(q) for slo, q in by_slo.items()}
            for policy, by_slo in per_policy.items()}
    return plot_capacity(bars, path, f"{summary.get('layers')} Llama-3-8B-shaped layers, {summary.get('gpu')}")


# ---- running the parts --------------------------------------------------------------------------
@dataclass
class PartStatus:
    status: str  # ok | failed | timeout | skipped
    seconds: float = 0.0
    note: str = ""


class Check:
    """Runs the parts as child processes within the overall budget and records how each ended."""

    def __init__(self, args: argparse.Namespace, python: str = sys.executable) -> None:
        self.args, self.python, self.out = args, python, Path(args.out)
        self.started = time.monotonic()
        self.statuses: dict[str, dict[str, Any]] = {}

    def elapsed(self) -> float:
        return time.monotonic() - self.started

    def say(self, message: str) -> None:
        print(f"[{self.elapsed():5.0f} s] {message}", flush=True)

    def run(self, name: str, cmd: list[str], cwd: Path | None = None) -> PartStatus:
        """Run one part's command, its output into `<name>.log`, within its limit and the budget left."""
        limit = min(PART_LIMITS_S[name], self.args.budget_s - self.elapsed())
        if limit < MIN_PART_S:
            return self.record(name, PartStatus("skipped", note=f"out of time ({limit:.0f} s of the budget left)"))
        self.say(f"{name}: started (limit {limit:.0f} s)")
        t0 = time.monotonic()
        code = run_logged(cmd, self.out / f"{name}.log", limit, cwd)
        seconds = time.monotonic() - t0
        if code is None:
            status = PartStatus("timeout", seconds, f"stopped after {limit:.0f} s; partial results kept")
        elif code == 0:
            status = PartStatus("ok", seconds)
        else:
            status = PartStatus("failed", seconds, f"exit code {code}; see {name}.log")
        return self.record(name, status)

    def skip(self, name: str, why: str) -> PartStatus:
        return self.record(name, PartStatus("skipped", note=why))

    def record(self, name: str, status: PartStatus) -> PartStatus:
        self.statuses[name] = asdict(status)
        self.say(f"{name}: {status.status}" + (f" ({status.note})" if status.note else "")
                 + (f" in {status.seconds:.0f} s" if status.seconds else ""))
        return status

    def part_cmd(self, part: str, *extra: str) -> list[str]:
        device = ("--device", "cpu") if self.args.dry_run else ()
        return [self.python, "-m", "chariot.bench.gpu_check_parts", part, "--out", str(self.out), *device, *extra]


def run_logged(cmd: list[str], log: Path, limit_s: float, cwd: Path | None = None) -> int | None:
    """Run `cmd` in its own process group with stdout+stderr into `log`, echoing progress lines;
    the exit code, or None when it ran past `limit_s` (then the whole group is killed)."""
    with log.open("w") as sink:
        sink.write(f"$ {' '.join(cmd)}\n")
        sink.flush()
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1,
                                start_new_session=True, cwd=cwd)
        pump = threading.Thread(target=_pump, args=(proc, sink), daemon=True)
        pump.start()
        try:
            code: int | None = proc.wait(timeout=limit_s)
        except subprocess.TimeoutExpired:
            code = None
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        pump.join(timeout=5)
        return code


def _pump(proc: subprocess.Popen[str], sink: Any) -> None:
    assert proc.stdout is not None
    for line in proc.stdout:
        sink.write(line)
        sink.flush()
        if line.startswith(PROGRESS):
            print(f"    {line.rstrip()}", flush=True)


def pick_model_root(candidates: Sequence[Path], need_bytes: int, free_bytes: Callable[[Path], int]) -> Path:
    """The first candidate folder with room for the checkpoint (a RAM disk first: loads are faster),
    else the last candidate."""
    for folder in candidates:
        try:
            if free_bytes(folder) > need_bytes:
                return folder
        except OSError:
            continue
    return candidates[-1]


def checkpoint_bytes(layers: int) -> int:
    from chariot.worker.model.make_model import weight_shapes

    config = model_config(layers)
    return sum(math.prod(shape) for _, shape in weight_shapes(config)) * dtype_bytes(config)


def default_model_root(layers: int) -> Path:
    def free(folder: Path) -> int:
        folder.mkdir(parents=True, exist_ok=True)
        return shutil.disk_usage(folder).free

    need = int(checkpoint_bytes(layers) * 1.2)
    return pick_model_root([Path("/dev/shm/chariot-gpu-check"), Path("build/gpu-check-model")], need, free)


def run_parts(check: Check) -> None:
    """Every selected part in order; a part whose input is missing is skipped with the reason."""
    args, out = check.args, check.out
    model_root = Path(args.model_root) if args.model_root else default_model_root(args.layers)
    model_args = ("--model-root", str(model_root), "--layers", str(args.layers))
    for name in args.parts:
        why = None if name in ("prepare", "gpu_tests") else missing_input(name, out)
        if name == "gpu_tests" and args.dry_run:
            check.skip(name, "a dry run: the gpu tests need CUDA")
        elif name == "gpu_tests":
            run_gpu_tests(check)
        elif name == "engine" and why is None:
            for run in engine_runs(graphs_in_this_build(), args.layers):
                check.run(f"engine-{run}", check.part_cmd("engine", *model_args, "--run", run))
        elif name == "capacity" and why is None:
            for search in CAPACITY_SEARCHES:
                check.run(f"capacity-{search}", check.part_cmd("capacity", *model_args, "--search", search))
        elif why is not None:
            check.skip(name, why)
            if name == "vllm":
                write_json(out / "vllm.json", {"skipped": why})
        else:
            check.run(name, check.part_cmd(name, *model_args))
    if args.model_root is None and model_root.is_relative_to("/dev/shm"):
        shutil.rmtree(model_root, ignore_errors=True)  # the checkpoint must not keep gigabytes of RAM


def missing_input(part: str, out: Path) -> str | None:
    """Why `part` cannot run with what the earlier parts left in `out` (None: it can)."""
    model = (read_json(out / "prepare.json") or {}).get("model")
    if not model:
        return "no checkpoint: the prepare part did not finish"
    if not Path(model).is_dir():
        return "checkpoint removed at the end of an earlier check: rerun the prepare part"
    if part == "capacity" and not (read_json(out / "engine.json") or {}).get("runs"):
        return "no engine measurements to derive the SLO from"
    if part == "vllm" and importlib.util.find_spec("vllm") is None:
        return f"`import vllm` fails for {sys.executable}"
    return None


def run_gpu_tests(check: Check) -> None:
    """`pytest -m gpu` on the marked files, from the repository's root; the counts into gpu_tests.json."""
    root = Path(__file__).resolve().parents[1]
    files = gpu_test_files(root / "tests")
    if not files:
        check.skip("gpu_tests", "no test file carries the gpu marker")
        return
    cmd = [check.python, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider", *files]
    status = check.run("gpu_tests", cmd, cwd=root)
    log = (check.out / "gpu_tests.log").read_text() if (check.out / "gpu_tests.log").is_file() else ""
    write_json(check.out / "gpu_tests.json", {**parse_pytest_summary(log), "status": status.status, "files": files})


def finish(check: Check) -> dict[str, Any]:
    """summary.json, report.md and the decode plot from whatever the parts left."""
    summary = summarize(check.out, check.args.layers, check.statuses)
    summary["elapsed_s"] = round(check.elapsed(), 1)
    summary["command"] = " ".join([Path(sys.executable).name, "-m", "chariot.bench.gpu_check", *sys.argv[1:]])
    summary["plots"] = {}
    for name, draw in (("decode_iterations.png", plot_decode), ("capacity.png", plot_capacities)):
        try:
            summary["plots"][name] = "written" if draw(summary, check.out / name) else "nothing to plot"
        except Exception as exc:  # a plot must not cost the report
            summary["plots"][name] = f"failed: {exc}"
    write_json(check.out / "summary.json", summary)
    (check.out / "report.md").write_text(render_report(summary))
    return summary


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    problem = None if args.dry_run else cuda_problem()
    if problem is not None:
        print(f"gpu-check: needs a CUDA GPU: {problem}", file=sys.stderr)
        return NO_CUDA_EXIT
    Path(args.out).mkdir(parents=True, exist_ok=True)
    check = Check(args)
    check.say(f"gpu-check: {args.layers} of {FULL_LAYERS} layers, parts {', '.join(args.parts)}, "
              f"budget {args.budget_s:.0f} s, results in {args.out}")
    try:
        run_parts(check)
    finally:  # whatever went wrong, the report says what was measured
        summary = finish(check)
    check.say(f"gpu-check: wrote {args.out}/summary.json and report.md")
    print(json.dumps(summary["headline"], indent=1, default=_json_default))
    return exit_code(check.statuses)


def exit_code(statuses: Mapping[str, Mapping[str, Any]]) -> int:
    """0 when every part ran or was skipped for a reason of this machine (no vLLM, no marked tests);
    1 when one failed, ran out of time, or could not run because an earlier part did not finish."""
    benign = ("`import vllm` fails", "no test file carries", "a dry run")
    for status in statuses.values():
        if status["status"] in ("failed", "timeout"):
            return 1
        if status["status"] == "skipped" and not str(status.get("note", "")).startswith(benign):
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
