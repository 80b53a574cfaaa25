"""`chariot tune`: profile iteration time on this hardware, fit a cost model, pick the token budget.

Sarathi-Serve (§4.3) sets the token budget by a one-time profiling of batches: the largest number
of tokens per iteration that keeps the iteration within the TBT SLO, rounded to the matmul tile
size. This module does that for the machine it runs on:

1. `profile()` times real `Engine` iterations over a grid of (prefill-chunk tokens × decode batch
   size × context length). For each point it puts the engine's scheduler in exactly that state —
   `decode_batch` sequences one token from the end of a `context`-token prompt, and one prompt whose
   last `prefill_tokens` tokens are still to run — so one `step()` runs exactly that composition.
   The KV cache holds zeros rather than real activations: timing does not depend on the values.
2. `fit()` fits `chariot.worker.budget.CostModel` (time = c0 + c1·prefill tokens + c2·decodes +
   c3·prefill tokens×context + c4·Σ decode contexts) by non-negative least squares on relative
   error, so cheap and expensive iterations count alike and every term stays physical.
3. `choose_budget()` picks the largest tile-aligned budget whose predicted worst-case hybrid
   iteration meets the SLO (the worst case is spelled out in `chariot.worker.budget`).

The profile (samples, coefficients, hardware, the assumptions and an SLO → budget table) is written
as JSON where `chariot worker --tbt-slo-ms X` finds it (`default_profile_path`).

It sits in the worker, beside the cost model it fits (`budget.py`): a deployment uses it (the CRD's
`scheduler.tuneProfile`), so the `chariot` command must not need the benchmarks to offer it.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from chariot.contracts.commands import build_parser, run
from chariot.contracts.errors import ConfigError
from chariot.worker.budget import (
    FEATURES,
    PROFILE_VERSION,
    Assumptions,
    BatchShape,
    CostModel,
    budget_for_slo,
    default_profile_path,
    model_dtype,
    model_shape,
    worst_case_iteration_s,
)

if TYPE_CHECKING:  # numpy, tqdm and the engine load lazily: `chariot --help` imports this module
    import numpy as np

    from chariot.worker.engine import Engine

DEFAULT_SLOS_MS = (50.0, 100.0, 200.0, 500.0, 1000.0)
RETIME_ERROR = 0.3  # relative fit error that gets a point re-timed
RETIME_RUNS = 3
POOR_FIT_HINT = "  <- poor fit: was the machine busy? re-run on an idle machine"
Point = tuple[int, int, int]  # (prefill tokens, decode batch, context)


@dataclass(frozen=True)
class Grid:
    """Profiled points: every (prefill tokens, decode batch, context) except the empty batch."""

    prefill_tokens: tuple[int, ...]
    decode_batches: tuple[int, ...]
    contexts: tuple[int, ...]
    repeats: int = 3

    def __post_init__(self) -> None:
        if min(self.contexts) < 2 or min(self.prefill_tokens) < 0 or min(self.decode_batches) < 0 or self.repeats < 1:
            raise ValueError(f"grid needs contexts >= 2, non-negative sizes and repeats >= 1: {self}")

    def points(self) -> list[Point]:
        grid = itertools.product(self.prefill_tokens, self.decode_batches, self.contexts)
        return [(p, d, c) for p, d, c in grid if p + d > 0]

    def clipped(self, limit: int) -> Grid:
        """Prefill chunks and contexts no longer than `limit` (the model's maximum length)."""
        return Grid(tuple(sorted({min(p, limit) for p in self.prefill_tokens})), self.decode_batches,
                    tuple(sorted({min(c, limit) for c in self.contexts})), self.repeats)

    @property
    def max_tokens(self) -> int:
        return max(self.prefill_tokens) + max(self.decode_batches)

    @property
    def max_context(self) -> int:
        return max(*self.contexts, *self.prefill_tokens)


FULL_GRID = Grid((0, 32, 64, 128, 256, 512, 1024), (0, 1, 8, 32, 64), (128, 512, 1024, 2048))
QUICK_GRID = Grid((0, 64, 256, 512), (0, 1, 8, 32), (128, 1024), repeats=3)


@dataclass(frozen=True)
class Sample:
    """Wall time of one engine step of this composition (median, or fastest, of its runs)."""

    prefill_tokens: int
    decode_batch: int
    context: int
    seconds: float

    @property
    def shape(self) -> BatchShape:
        """The prefill chunk is the last part of a max(context, chunk)-token prompt."""
        chunk_end = max(self.context, self.prefill_tokens)
        return BatchShape(self.prefill_tokens, self.decode_batch, self.prefill_tokens * chunk_end,
                          self.decode_batch * self.context)


@dataclass
class Profile:
    """Everything `chariot tune` learned; `to_json()` is what the worker loads."""

    model_dir: str
    dtype: str
    samples: list[Sample]
    cost_model: CostModel
    hardware: dict[str, Any] = field(default_factory=dict)
    assumptions: Assumptions = field(default_factory=Assumptions)
    slos_ms: tuple[float, ...] = DEFAULT_SLOS_MS
    statistic: str = "median"  # of each point's runs: "median" or "fastest"

    def table(self) -> list[dict[str, Any]]:
        """SLO → budget rows (budget None where the SLO cannot be met)."""
        rows = []
        for slo in self.slos_ms:
            try:
                budget: int | None = budget_for_slo(self.cost_model, slo / 1e3, self.assumptions)
            except ConfigError:
                budget = None
            ms = worst_case_iteration_s(self.cost_model, budget or self.assumptions.tile, self.assumptions) * 1e3
            rows.append({"tbt_slo_ms": slo, "token_budget": budget, "predicted_iteration_ms": round(ms, 3)})
        return rows

    def to_json(self) -> dict[str, Any]:
        return {
            "version": PROFILE_VERSION,
            "model": {"dir": str(Path(self.model_dir).resolve()), "name": Path(self.model_dir).resolve().name,
                      "shape": model_shape(self.model_dir)},
            "dtype": self.dtype,
            "hardware": self.hardware,
            "statistic": self.statistic,
            "cost_model": self.cost_model.to_dict(),
            "assumptions": asdict(self.assumptions),
            "table": self.table(),
            "samples": [asdict(s) for s in self.samples],
        }

    def save(self, path: str | Path) -> Path:
        out = Path(path)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(self.to_json(), indent=1))
        return out


# ---- profiling ------------------------------------------------------------------------------------
def hardware_info(device: str) -> dict[str, Any]:
    import torch

    info: dict[str, Any] = {"device": device, "torch": torch.__version__, "torch_threads": torch.get_num_threads(),
                            "cpu_count": os.cpu_count(), "machine": platform.machine(),
                            "processor": platform.processor(), "platform": platform.platform()}
    if device.startswith("cuda") and torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(torch.device(device))
    return info


def _make_engine(model_dir: str, dtype: str, grid: Grid, device: str) -> Engine:
    from chariot.contracts.engine_settings import default_block_size
    from chariot.worker.config import EngineConfig
    from chariot.worker.engine import Engine

    max_len = grid.max_context + 4  # room for the prompt plus the sampled tokens
    block = default_block_size(device)  # the block size the engine takes, as a served one would
    seq_tokens = (-(-max_len // block) + 1) * block  # whole blocks, one to spare
    kv_tokens = int((max(grid.decode_batches) + 1) * seq_tokens * 1.05) + seq_tokens
    cfg = EngineConfig(model=model_dir, policy="sarathi", token_budget=max(grid.max_tokens, 32),
                       max_batch_size=max(grid.decode_batches) + 1, dtype=dtype, kv_cache_tokens=kv_tokens,
                       max_model_len=max_len, device=device,
                       attention_aware_chunks=False,  # the profiler sets each chunk's size itself
                       prefix_caching=False)  # it measures compute: a cached prefix would skip it
    engine = Engine(cfg, progress=False)
    _zero_kv_cache(engine)
    return engine


def _zero_kv_cache(engine: Engine) -> None:
    """`torch.empty` caches may hold NaNs or denormals, which can slow CPU kernels: time on zeros."""
    runner = getattr(engine.executor, "runner", None)
    for k, v in getattr(runner, "kv_caches", ()):
        k.zero_()
        v.zero_()


def _place(engine: Engine, prompt_len: int, computed: int) -> str:
    """Add a request and put it straight into the running set with `computed` tokens cached."""
    from chariot.contracts.sampling_params import SamplingParams
    from chariot.worker.sequence import SequenceStatus

    rid = engine.add_request([7] * prompt_len, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    seq = engine.scheduler.waiting.pop()
    engine.blocks.allocate(seq.seq_id, prompt_len)
    seq.status = SequenceStatus.RUNNING
    seq.num_computed_tokens = computed
    engine.scheduler.running.append(seq)
    return rid


def time_iteration(engine: Engine, prefill_tokens: int, decode_batch: int, context: int) -> float:
    """One engine step of exactly this composition (seconds, schedule to postprocess)."""
    from chariot.contracts.requests import FinishReason

    rids = [_place(engine, context, context - 1) for _ in range(decode_batch)]
    if prefill_tokens:
        prompt = max(context, prefill_tokens)
        rids.append(_place(engine, prompt, prompt - prefill_tokens))
    result = engine.step()
    engine.finish_requests(rids, FinishReason.ABORT)
    batch = result.batch
    if batch is None or batch.num_decodes != decode_batch or batch.num_prefill_tokens != prefill_tokens:
        raise RuntimeError(f"profiler set up ({prefill_tokens} prefill, {decode_batch} decodes) but the engine "
                           f"ran {batch}")
    return float(result.times.total)


def profile(model_dir: str | Path, dtype: str = "auto", grid: Grid = FULL_GRID, progress: bool = True,
            device: str = "cpu", fastest: bool = False) -> Profile:
    """Time every grid point (median of `grid.repeats` steps) and fit the cost model.

    The repeats are passes over the whole grid, so a burst of load from another process hits one
    run of several points rather than every run of one; points the fit then misses by more than
    `RETIME_ERROR` are timed `RETIME_RUNS` more times and the model is refitted. `fastest` keeps
    each point's fastest run instead of the median: on a machine shared with other work, load only
    ever adds time, so the minimum is the better estimate of the hardware's own cost."""
    from chariot.worker.config import ModelConfig

    model_dir = str(model_dir)
    dtype = model_dtype(model_dir, dtype, device)
    grid = grid.clipped(ModelConfig.from_dir(model_dir).max_position_embeddings - 4)
    engine = _make_engine(model_dir, dtype, grid, device)
    try:
        points = grid.points()
        time_iteration(engine, *points[0])  # warm-up: first-call allocations and lazy initialisation
        runs: dict[Point, list[float]] = {pt: [] for pt in points}
        _time_points(engine, points * grid.repeats, runs, "tune: profiling iterations", progress)
        samples = _summarise(runs, fastest)
        model = fit(samples)
        suspects = [(s.prefill_tokens, s.decode_batch, s.context) for s in samples
                    if abs(model.predict(s.shape) - s.seconds) > RETIME_ERROR * s.seconds]
        if suspects:
            _time_points(engine, suspects * RETIME_RUNS, runs, "tune: re-timing outliers", progress)
            samples = _summarise(runs, fastest)
            model = fit(samples)
    finally:
        engine.shutdown()
    return Profile(model_dir, dtype, samples, model, hardware_info(device),
                   statistic="fastest" if fastest else "median")


def _time_points(engine: Engine, todo: list[Point], runs: dict[Point, list[float]], desc: str,
                 progress: bool) -> None:
    from tqdm.auto import tqdm

    for pt in tqdm(todo, desc=desc, disable=not progress, file=sys.stderr):
        runs[pt].append(time_iteration(engine, *pt))


def _summarise(runs: dict[Point, list[float]], fastest: bool) -> list[Sample]:
    stat = min if fastest else statistics.median
    return [Sample(p, d, c, stat(ts)) for (p, d, c), ts in runs.items()]


# ---- fitting --------------------------------------------------------------------------------------
def nnls(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """argmin ‖a·x − b‖ subject to x ≥ 0, exactly, by least squares on every support set.

    The optimum is the unconstrained solution on its own support, so the best non-negative
    subset solution is it. 2^k solves: fine for the handful of features here (no scipy needed)."""
    import numpy as np

    k = a.shape[1]
    best, best_err = np.zeros(k), float(np.sum(b * b))
    for r in range(1, k + 1):
        for cols in itertools.combinations(range(k), r):
            sol, *_ = np.linalg.lstsq(a[:, cols], b, rcond=None)
            if np.any(sol < 0):
                continue
            err = float(np.sum((a[:, cols] @ sol - b) ** 2))
            if err < best_err:
                best, best_err = np.zeros(k), err
                best[list(cols)] = sol
    return best


def fit(samples: Sequence[Sample]) -> CostModel:
    """Non-negative least squares on relative error; R² on the raw times.

    Fewer samples than features is allowed (smoke runs) but leaves the model underdetermined."""
    if not samples:
        raise ValueError("need at least one sample to fit")
    import numpy as np

    x = np.array([s.shape.features() for s in samples], dtype=np.float64)
    y = np.array([s.seconds for s in samples], dtype=np.float64)
    if np.any(y <= 0):
        raise ValueError("sample times must be positive")
    scale = x.max(axis=0)  # condition the columns (features span 1 … millions)
    scale[scale == 0] = 1.0
    coef = nnls(x / scale / y[:, None], np.ones_like(y)) / scale
    pred = x @ coef
    ss_tot = float(np.sum((y - y.mean()) ** 2))
    r2 = 1.0 - float(np.sum((y - pred) ** 2)) / ss_tot if ss_tot > 0 else 1.0
    return CostModel(tuple(float(c) for c in coef), r2)


def relative_errors(model: CostModel, samples: Sequence[Sample]) -> list[float]:
    return [abs(model.predict(s.shape) - s.seconds) / s.seconds for s in samples]


def choose_budget(model: CostModel, tbt_slo_s: float, decode_batch: int, decode_context: int, tile: int = 32,
                  prefill_context: int | None = None, max_budget: int = 8192) -> int:
    """Largest tile-aligned budget whose worst-case hybrid iteration meets `tbt_slo_s`.

    Worst case: 1 … `decode_batch` decodes at `decode_context` plus the rest of the budget as one
    prefill chunk ending at `prefill_context` (default `decode_context`). Raises ConfigError when
    even `tile` tokens miss the SLO."""
    a = Assumptions(decode_batch, decode_context, prefill_context or decode_context, tile, max_budget)
    return budget_for_slo(model, tbt_slo_s, a)


# ---- CLI ------------------------------------------------------------------------------------------
def add_tune_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register `chariot tune` on the `chariot` CLI's subparsers."""
    p = subparsers.add_parser(
        "tune", help="profile iteration time here and pick the token budget for a TBT SLO",
        description="Profile engine iterations on this hardware (prefill tokens × decode batch × context), "
                    "fit a cost model, and print the largest tile-aligned token budget per TBT SLO. The "
                    "profile is written where `chariot worker --tbt-slo-ms X` finds it.")
    p.add_argument("--model", required=True, help="Hugging Face model directory")
    p.add_argument("--dtype", default="auto", help="float32, float16, bfloat16 or auto (the checkpoint's)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--tbt-slo-ms", type=float, nargs="+", default=list(DEFAULT_SLOS_MS),
                   help="SLOs for the printed table (default: %(default)s)")
    p.add_argument("--quick", action="store_true", help="small grid (about 1 minute for the 100m preset on CPU)")
    p.add_argument("--fastest", action="store_true",
                   help="keep each point's fastest run, not the median (for a machine shared with other work)")
    p.add_argument("--out", default=None, help="profile JSON (default ~/.cache/chariot/tune/<model>-<dtype>.json)")
    defaults = Assumptions()
    p.add_argument("--decode-batch", type=int, default=defaults.decode_batch,
                   help="most decodes per iteration the budget must be safe for (default %(default)s)")
    p.add_argument("--decode-context", type=int, default=defaults.decode_context,
                   help="context length of those decodes (default %(default)s)")
    p.add_argument("--prefill-context", type=int, default=defaults.prefill_context,
                   help="longest prompt: context at the end of the worst prefill chunk (default %(default)s)")
    p.add_argument("--tile", type=int, default=defaults.tile, help="budget granularity (default %(default)s)")
    p.add_argument("--max-budget", type=int, default=defaults.max_budget)
    p.set_defaults(handler=run_tune)
    return p


def run_tune(args: argparse.Namespace) -> int:
    try:
        assumptions = Assumptions(args.decode_batch, args.decode_context, args.prefill_context, args.tile,
                                  args.max_budget)
    except ValueError as exc:
        raise ConfigError("tune", str(exc)) from exc
    started = time.perf_counter()
    prof = profile(args.model, args.dtype, QUICK_GRID if args.quick else FULL_GRID, device=args.device,
                   fastest=args.fastest)
    prof.assumptions = assumptions
    prof.slos_ms = tuple(args.tbt_slo_ms)
    out = prof.save(args.out or default_profile_path(args.model, prof.dtype))
    print(format_report(prof, time.perf_counter() - started))
    print(f"\nwrote {out}")
    return 0


def format_report(prof: Profile, elapsed_s: float) -> str:
    m, a = prof.cost_model, prof.assumptions
    errs = relative_errors(m, prof.samples)
    lines = [
        f"model={prof.model_dir} dtype={prof.dtype} device={prof.hardware.get('device')} "
        f"threads={prof.hardware.get('torch_threads')} samples={len(prof.samples)} ({elapsed_s:.0f} s)",
        "cost model: " + ", ".join(f"{n}={c:.3g}" for n, c in zip(FEATURES, m.coefficients, strict=True)),
        f"fit: R²={m.r2:.4f}, median error {100 * statistics.median(errs):.1f}%, max {100 * max(errs):.1f}%"
        + (POOR_FIT_HINT if m.r2 < 0.9 else ""),
        f"worst case: 1…{a.decode_batch} decodes at context {a.decode_context} + one prefill chunk ending at "
        f"{a.prefill_context}; budgets in multiples of {a.tile}",
        "",
        "| TBT SLO ms | token budget | predicted iteration ms |",
        "|---:|---:|---:|",
    ]
    for row in prof.table():
        budget = row["token_budget"] if row["token_budget"] is not None else "— (unreachable)"
        lines.append(f"| {row['tbt_slo_ms']:g} | {budget} | {row['predicted_iteration_ms']:.1f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser("python -m chariot.worker.tune", "", [add_tune_parser])
    return run(parser, ["tune", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.exit(main())
