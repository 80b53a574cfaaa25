"""Linear layers for inference on the CPU: own kernels for decode rows (and float32 prefill where they
win), oneDNN for the rest.

Why: PyTorch's default CPU matmul (MKL) is far from the machine on a decode batch. oneDNN with the
weight reordered once at load into its blocked layout is faster on most row counts (vLLM's CPU
backend takes the same route), but on a few rows (a decode step bound by streaming every weight from
memory) neither reaches the memory bandwidth; the package's kernels do: the panel kernel for float32
(`kernels/panel_linear.py`, which can also take prefill chunks in a blocked order) and the skinny
kernel for bf16 (`kernels/skinny_linear.py`: AVX512-BF16 dot products, or the AMX tiles where the CPU
has them).

What: `load_stage` calls `cpu_linears(stage)` once the weights are in; it swaps every `nn.Linear`
for a `CpuLinear` that routes each call by its number of rows. Where the routes cross depends on the
machine, so a stage that keeps both layouts times them over its own layers at load
(`calibrate_skinny_rows`) and routes to the kernel up to the largest row count where it won; when
the panels also win a prefill-sized call, the layers drop oneDNN's copy. Keeping both layouts costs a
second copy of the weights, kept only when it fits (a quarter of the machine's memory by default).
A bf16 stage on a CPU whose bf16 dot products run no faster than its float32 FMAs (AVX512-BF16
without AMX tiles) can pack oneDNN's copy in float32 instead: the rows go up to float32 exactly and
the result comes back to bf16 once, at the float32 GEMM's rate; `packed_dtype` times the two at load
and keeps the float32 copy where it wins. The `CHARIOT_CPU_*` environment knobs read here force or
turn off each route; docs/kernels.md has the measurements behind these choices.
"""

from __future__ import annotations

import logging
import math
import os
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
import torch.nn.functional as F
from torch import nn

import chariot.contracts.environment as env
from chariot.kernels import panel_linear as panel
from chariot.kernels import skinny_linear as skinny
from chariot.worker.cpu_features import cpu_flags

log = logging.getLogger(__name__)
L = TypeVar("L", bound=Any)  # a layer calibration_layers measures: a CpuLinear or an nn.Linear
PACKED_LINEAR_ENV = env.CPU_PACKED_LINEAR.name
SKINNY_LINEAR_ENV = env.CPU_SKINNY_LINEAR.name
SKINNY_ROWS_ENV = env.CPU_SKINNY_MAX_ROWS.name
PANEL_LINEAR_ENV = env.CPU_PANEL_LINEAR.name
ROW_CANDIDATES = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64)  # row counts the calibration may time, ascending
ALL_ROWS = sys.maxsize  # a row limit that takes every call
MANY_ROWS = 512  # a prefill chunk's rows: where the panel kernel beats oneDNN here too, it takes every call
CALIBRATION_PASSES = 3
CALIBRATION_BYTES = 256 << 20  # weights one timed pass reads: well past a CPU's last-level cache, bounded start-up
MANY_ROWS_BYTES = 64 << 20  # the same for MANY_ROWS, bound by the FMAs rather than by reading the weights
MANY_ROWS_PASSES = 5  # a pass over MANY_ROWS_BYTES is short, and this decision routes most of a prefill's time
SETTLED_ROWS = 32
"""How far the panel kernel's decode cut must reach before MANY_ROWS is timed. Above 32 rows the two
routes can run within a few percent of each other, so one noisy pass there would decide where every
prefill chunk goes; the chunks carry most of a busy stage's time (docs/kernels.md)."""
PANEL_TIE = 1.05
"""The panel kernel wins a row count unless oneDNN is more than 5 % faster: within that the start-up
measurement on a noisy 2-core machine goes either way (it did at 512 rows on an AVX2 EPYC), and the
panels alone keep one copy of the weights instead of two."""
MANY_ROWS_TIE = 1.10
"""The same margin at MANY_ROWS, wider, on a CPU without AVX-512: the start-up timing of 512 rows
moves by about 10 % on a small, busy machine, while paired runs on an AVX2 EPYC have the panels
ahead of oneDNN's packed route, more so when other processes share the cores: the panels hand out
their work in units, oneDNN splits it once per thread (docs/kernels.md,
`bench/experiments/panel_contention_ab.py`)."""
WIDE_VECTOR_FLAG = "avx512f"
"""Where the CPU has it, oneDNN's float32 GEMM runs 16-lane vectors in 32 registers and the panels
their 8-lane tiles, and paired runs have oneDNN ahead at 512 rows, quiet and beside a busy process
(Zen 4 EPYC; docs/kernels.md): a win at MANY_ROWS there counts within PANEL_TIE only."""


def many_rows_tie(flags: frozenset[str]) -> float:
    """How far oneDNN may lead at MANY_ROWS with the panels still taking every call, on a CPU with `flags`."""
    return PANEL_TIE if WIDE_VECTOR_FLAG in flags else MANY_ROWS_TIE


PACKABLE_DTYPES = (torch.float32, torch.bfloat16)
ONEDNN_ROW_STEP = 16
"""oneDNN's packed route runs row counts rounded up to a multiple of this (zero rows added, their
outputs dropped). oneDNN builds and JIT-compiles a primitive the first time it sees a row count: in
bf16 on AMX tiles that first call costs 2.4-6.5x a repeat (`bench/experiments/onednn_new_rows.py`),
and under fresh prompts the chunks' row counts rarely repeat, so rounding bounds the primitives to
one per step of rows."""
SKINNY_MEMORY_FRACTION = 0.25  # of physical memory, for the plain copy kept beside the packed one
UPCAST_ENV = env.CPU_BF16_UPCAST.name
UPCAST = (torch.bfloat16, torch.float32)
"""(weight dtype, packed dtype) of a layer whose oneDNN route computes in float32: exact, since every
bf16 value is a float32 one; the result is rounded to bf16 once, as the bf16 route rounds it."""
UPCAST_MEMORY_FRACTION = 0.25  # of physical memory, for the float32 copy (twice the bf16 weights' bytes)
UPCAST_TIE = 1.10
"""The float32 copy must be more than 10 % faster at MANY_ROWS to be kept: it costs twice the bf16
weights' memory, and the start-up timing of 512 rows moves by about that much on a small, busy machine
(MANY_ROWS_TIE). Where it is kept it was 1.25-1.54x faster per layer (docs/kernels.md)."""


class CpuLinear(nn.Module):
    """`y = x Wᵀ + b` for inputs of any number of rows, with W kept plain, packed for oneDNN, or both.

    Up to `skinny_max_rows` rows (at most `few_rows_cap`; set by `cpu_linears`) go to the few-rows
    route when it is kept (float32: the panel kernel, which takes any number of rows; else the skinny
    kernel on the plain weight); more rows go to oneDNN when the packed weight is kept, else to
    `F.linear`. At least one of the two is kept."""

    def __init__(self, linear: nn.Linear, packed: bool, plain: bool, packed_dtype: torch.dtype | None = None) -> None:
        super().__init__()
        if not (packed or plain):
            raise ValueError("a CpuLinear keeps the packed weight, the plain one, or both")
        self.in_features, self.out_features = linear.in_features, linear.out_features
        weight = linear.weight.detach()
        if packed_dtype not in (None, weight.dtype) and (weight.dtype, packed_dtype) != UPCAST:
            raise ValueError(f"packed_dtype {packed_dtype} for a {weight.dtype} weight: only a bfloat16 weight "
                             "takes a float32 packed copy")
        self.compute_dtype = packed_dtype or weight.dtype  # the oneDNN route's arithmetic
        self.packed_weight = torch.ops.mkldnn._reorder_linear_weight(weight.to(self.compute_dtype), None) \
            if packed else None
        self.bias = None if linear.bias is None else linear.bias.detach().contiguous()
        self.packed_bias = None if self.bias is None else self.bias.to(self.compute_dtype)
        # float32 takes the panel kernel in place of the plain copy (it takes any number of rows), bf16 on
        # a CPU with AMX tiles the tile path (up to 32 rows)
        panels = plain and env.is_on(env.CPU_PANEL_LINEAR) and panel.supports(weight)
        self.panels = panel.pack(weight, self.bias) if panels else None
        tiles = plain and not panels and skinny.amx_rows(weight)
        self.tiles = skinny.amx_pack(weight) if tiles else None
        self.weight = weight.contiguous() if plain and self.panels is None and self.tiles is None else None
        self.skinny = plain and (self.panels is not None or self.tiles is not None or skinny.supports(weight))
        self.weight_nbytes = weight.numel() * weight.element_size()  # what one call reads
        self.dtype = weight.dtype
        # the tiles' copy alone (oneDNN's refused) takes every row count, 32 at a time
        self.few_rows_cap = (ALL_ROWS if self.panels is not None or (self.tiles is not None and not packed)
                             else skinny.AMX_MAX_ROWS if self.tiles is not None else skinny.MAX_ROWS)
        self.skinny_max_rows = self.few_rows_cap

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # the model's activations are [tokens, features] already: no reshape or view to dispatch then
        flat, weight = (x if x.dim() == 2 else x.reshape(-1, self.in_features)), self.weight
        if self.skinny and flat.shape[0] <= self.skinny_max_rows:
            out = self.plain(flat)
        elif self.packed_weight is not None:
            out = self.packed(flat)
        elif weight is not None:
            out = F.linear(flat, weight, self.bias)
        else:  # the constructor keeps one of the two
            raise RuntimeError("CpuLinear holds no weight")
        return out if x.dim() == 2 else out.view(*x.shape[:-1], self.out_features)

    def packed(self, flat: torch.Tensor) -> torch.Tensor:
        """The oneDNN route for [rows, in_features] (the packed weight must be kept), the rows rounded up
        to a multiple of ONEDNN_ROW_STEP; a bf16 layer packed in float32 takes its rows up to float32
        and its result back down to bf16."""
        rows = flat.shape[0]
        extra = -rows % ONEDNN_ROW_STEP
        upcast = self.compute_dtype != self.dtype
        x = flat.to(self.compute_dtype) if upcast else flat
        if extra:
            x = F.pad(x, (0, 0, 0, extra))
        bias = self.packed_bias if upcast else self.bias
        out = torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, bias, "none", [], "")
        out = out[:rows] if extra else out
        return out.to(self.dtype) if upcast else out

    def plain(self, flat: torch.Tensor) -> torch.Tensor:
        """The few-rows route for [rows, in_features]: the panel kernel where the panels are kept
        (float32), the tile path where the tiles' copy is (bf16 on AMX), else the skinny kernel on the
        plain weight."""
        if self.panels is not None:
            return panel.panel_linear(flat, self.panels)
        if self.tiles is not None:
            if flat.shape[0] <= skinny.AMX_MAX_ROWS:  # a decode step's rows: one call, no split views
                return skinny.amx_linear(flat, self.tiles, self.bias, self.out_features)
            parts = flat.split(skinny.AMX_MAX_ROWS)
            return torch.cat([skinny.amx_linear(part, self.tiles, self.bias, self.out_features) for part in parts])
        if self.weight is None:
            raise RuntimeError("the skinny route needs the plain weight, which this layer does not keep")
        return skinny.skinny_linear(flat, self.weight, self.bias)

    def extra_repr(self) -> str:
        few = "panels" if self.panels is not None else "amx tiles" if self.tiles is not None else "skinny"
        rows = "all rows" if self.skinny_max_rows == ALL_ROWS else f"<={self.skinny_max_rows} rows"
        upcast = "" if self.compute_dtype == self.dtype else " " + str(self.compute_dtype).removeprefix("torch.")
        onednn = "packed=oneDNN" + upcast
        kept = [name for name, on in ((onednn, self.packed_weight is not None),
                                      (f"{few} {rows}", self.skinny)) if on]
        return f"in_features={self.in_features}, out_features={self.out_features}, {', '.join(kept) or 'plain'}"


@dataclass(frozen=True)
class LinearPlan:
    """Which weight layouts the stage's linear layers keep, and why a fast path is off (None when on)."""

    packing_problem: str | None
    skinny_problem: str | None

    @property
    def packed(self) -> bool:
        return self.packing_problem is None

    @property
    def plain(self) -> bool:
        return self.skinny_problem is None


def packing_problem(device: torch.device, dtype: torch.dtype) -> str | None:
    """Why linear layers will not be packed here, or None when they will."""
    if not env.is_on(env.CPU_PACKED_LINEAR):
        return f"{PACKED_LINEAR_ENV}=0"
    if device.type != "cpu":
        return f"device {device.type} is not the CPU"
    if dtype not in PACKABLE_DTYPES:
        return f"dtype {dtype} is not packed"
    if not torch.backends.mkldnn.is_available():
        return "this torch build has no oneDNN"
    try:  # oneDNN's bf16 path needs AVX-512 or AVX-NE-CONVERT; ask it rather than guess
        torch.ops.mkldnn._reorder_linear_weight(torch.zeros(8, 8, dtype=dtype), None)
    except RuntimeError as exc:
        return f"oneDNN cannot pack {dtype} on this CPU ({exc})"
    return None


def physical_memory_bytes() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def skinny_problem(device: torch.device, dtype: torch.dtype, weight_bytes: int, packed: bool,
                   memory_bytes: int | None = None) -> str | None:
    """Why the skinny path will not be used here, or None when it will.

    `weight_bytes`: the linear weights' size; when they are also packed, the plain copy is extra
    memory, allowed under `auto` up to `SKINNY_MEMORY_FRACTION` of `memory_bytes` (physical)."""
    mode = env.read(env.CPU_SKINNY_LINEAR)  # auto, 0 or 1 (anything else raises)
    if mode == "0":
        return f"{SKINNY_LINEAR_ENV}=0"
    if device.type != "cpu":
        return f"device {device.type} is not the CPU"
    if dtype not in (torch.float32, torch.bfloat16):
        return f"dtype {dtype} is neither float32 nor bfloat16"
    memory = physical_memory_bytes() if memory_bytes is None else memory_bytes
    if packed and mode == "auto" and weight_bytes > SKINNY_MEMORY_FRACTION * memory:
        return (f"a plain copy of the weights ({weight_bytes / 2**30:.1f} GiB) beside the packed one would take over "
                f"{SKINNY_MEMORY_FRACTION:.0%} of memory ({memory / 2**30:.1f} GiB); {SKINNY_LINEAR_ENV}=1 keeps it")
    problem = skinny.build_problem()
    if problem is None and dtype == torch.bfloat16 and not skinny.bf16_rows():
        return "dtype torch.bfloat16 needs AVX512-BF16 in the skinny kernel's build"
    return problem


def upcast_problem(dtype: torch.dtype, weight_bytes: int, packed: bool, memory_bytes: int | None = None) -> str | None:
    """Why the layers' oneDNN route keeps bf16 arithmetic here, or None when float32 on a float32 copy
    is a candidate (timed at start-up under `auto`, taken under `1`).

    `weight_bytes`: the bf16 weights' size; the float32 copy takes twice that, allowed under `auto` up
    to UPCAST_MEMORY_FRACTION of `memory_bytes` (physical). Under `auto` a CPU with AMX tiles is not
    timed: oneDNN's bf16 GEMMs run on the tiles there, several times its float32 rate."""
    mode = env.read(env.CPU_BF16_UPCAST)  # auto, 0 or 1 (anything else raises)
    if mode == "0":
        return f"{UPCAST_ENV}=0"
    if dtype != torch.bfloat16:
        return f"dtype {dtype} is not bfloat16"
    if not packed:
        return "the layers are not packed for oneDNN"
    if mode == "1":
        return None
    memory = physical_memory_bytes() if memory_bytes is None else memory_bytes
    if 2 * weight_bytes > UPCAST_MEMORY_FRACTION * memory:
        return (f"a float32 copy of the weights ({2 * weight_bytes / 2**30:.1f} GiB) would take over "
                f"{UPCAST_MEMORY_FRACTION:.0%} of memory ({memory / 2**30:.1f} GiB); {UPCAST_ENV}=1 keeps it")
    if torch.cpu._is_amx_tile_supported():
        return "oneDNN's bf16 GEMMs run on the AMX tiles here"
    return None


@dataclass(frozen=True)
class UpcastCalibration:
    """Seconds of one pass of `rows` rows over the leading layers on oneDNN (the fastest of a few),
    in bf16 and in float32 on a float32 copy."""

    rows: int
    bf16_s: float
    float32_s: float

    @property
    def float32_wins(self) -> bool:
        return self.float32_s * UPCAST_TIE < self.bf16_s

    def describe(self) -> str:
        return f"{self.rows} rows: float32 {self.float32_s * 1e3:.1f} vs bf16 {self.bf16_s * 1e3:.1f} ms"


def calibrate_upcast(linears: Sequence[nn.Linear], rows: int = MANY_ROWS, passes: int = MANY_ROWS_PASSES,
                     clock: Callable[[], float] = time.perf_counter) -> UpcastCalibration:
    """Time oneDNN's bf16 route against float32 on a float32 copy (both packed) over `linears`, the
    two interleaved pass by pass after one untimed pass each; each route's time is its fastest pass."""
    inputs = {m.in_features: torch.randn(rows, m.in_features, dtype=torch.bfloat16) for m in linears}
    routes = {name: [(CpuLinear(m, packed=True, plain=False, packed_dtype=dtype).packed, inputs[m.in_features])
                     for m in linears] for name, dtype in (("bf16", None), ("float32", torch.float32))}
    best = fastest_passes(routes, passes, clock)
    return UpcastCalibration(rows, best["bf16"], best["float32"])


def packed_dtype(linears: Sequence[nn.Linear], dtype: torch.dtype, packed: bool,
                 memory_bytes: int | None = None) -> torch.dtype | None:
    """float32 when the layers' oneDNN route should compute bf16 in float32 (forced, or measured
    faster on the leading MANY_ROWS_BYTES of `linears`), else None (the weights' own dtype)."""
    weight_bytes = sum(linear_nbytes(m) for m in linears)
    problem = upcast_problem(dtype, weight_bytes, packed, memory_bytes)
    if problem is not None:
        if dtype == torch.bfloat16 and packed:
            log.info("linear layers: oneDNN computes in bf16: %s", problem)
        return None
    if env.read(env.CPU_BF16_UPCAST) == "1":
        log.info("linear layers: oneDNN computes in float32 on a float32 copy of the weights (%s=1)", UPCAST_ENV)
        return torch.float32
    timed = calibrate_upcast(calibration_layers(linears, MANY_ROWS_BYTES, size=linear_nbytes))
    chosen = "float32 on a float32 copy of the weights" if timed.float32_wins else "bf16"
    log.info("linear layers: oneDNN computes in %s (measured per pass over the first %d MiB of the stage's "
             "layers, %s)", chosen, MANY_ROWS_BYTES >> 20, timed.describe())
    return torch.float32 if timed.float32_wins else None


def linear_nbytes(m: nn.Linear) -> int:
    return m.weight.numel() * m.weight.element_size()


def plan_linears(module: nn.Module, device: torch.device, dtype: torch.dtype) -> LinearPlan:
    linears = [m for m in module.modules() if isinstance(m, nn.Linear)]
    weight_bytes = sum(linear_nbytes(m) for m in linears)
    packing = packing_problem(device, dtype)
    return LinearPlan(packing, skinny_problem(device, dtype, weight_bytes, packing is None))


@dataclass(frozen=True)
class RowsCalibration:
    """Seconds of one pass over a stage's layers per row count (the fastest of a few), for each route."""

    rows: tuple[int, ...]
    skinny_s: tuple[float, ...]
    packed_s: tuple[float, ...]

    @property
    def max_rows(self) -> int:
        """The row count up to which the kernel takes the calls, a count won on any lead (0: none)."""
        return self.max_rows_within(1.0)

    def max_rows_within(self, tie: float) -> int:
        """The cut that minimises the sum, over the counts up to it, of log(kernel / (tie × oneDNN)):
        the kernel's relative wins below the cut outweigh its losses there by the most (0: no cut
        does better than none; an equal sum is not a win). One count a noisy pass lost between wins
        does not end the kernel's rows; a run of losses from some count on still does."""
        best, best_sum, running = 0, 0.0, 0.0
        for rows, fast, slow in zip(self.rows, self.skinny_s, self.packed_s, strict=True):
            running += math.log(fast / (tie * slow))
            if running < best_sum:
                best, best_sum = rows, running
        return best

    def describe(self) -> str:
        return ", ".join(f"{r} rows {s * 1e3:.1f} vs {p * 1e3:.1f} ms"
                         for r, s, p in zip(self.rows, self.skinny_s, self.packed_s, strict=True))


def calibrate_skinny_rows(layers: Sequence[CpuLinear], rows: Sequence[int] = ROW_CANDIDATES,
                          passes: int = CALIBRATION_PASSES,
                          clock: Callable[[], float] = time.perf_counter) -> RowsCalibration:
    """Time both routes over all `layers` (each keeping both weights) for every row count, the routes
    interleaved pass by pass after one untimed pass each (oneDNN builds a primitive per shape); each
    route's time is its fastest pass, since whatever else runs on the machine only adds time (with
    the median, start-ups on a 2-core EPYC routed 64 and 512 rows either way)."""
    skinny_s, packed_s = [], []
    for m in rows:
        inputs = {layer.in_features: torch.randn(m, layer.in_features, dtype=layer.dtype) for layer in layers}
        best = fastest_passes({route: [(getattr(layer, route), inputs[layer.in_features]) for layer in layers]
                               for route in ("plain", "packed")}, passes, clock)
        skinny_s.append(best["plain"])
        packed_s.append(best["packed"])
    return RowsCalibration(tuple(rows), tuple(skinny_s), tuple(packed_s))


TimedCall = tuple[Callable[[torch.Tensor], torch.Tensor], torch.Tensor]  # a layer's route and its input


def fastest_passes(routes: Mapping[str, Sequence[TimedCall]], passes: int,
                   clock: Callable[[], float]) -> dict[str, float]:
    """Each route's fastest timed pass over its (layer call, input) pairs: one untimed pass per route,
    then `passes` passes with the routes interleaved, since whatever else runs on the machine only adds
    time and a drift then hits every route alike."""
    def one_pass(calls: Sequence[TimedCall]) -> float:
        t0 = clock()
        for call, x in calls:
            call(x)
        return clock() - t0

    times: dict[str, list[float]] = {route: [] for route in routes}
    with torch.inference_mode():
        for calls in routes.values():
            one_pass(calls)
        for _ in range(passes):
            for route, calls in routes.items():
                times[route].append(one_pass(calls))
    return {route: min(t) for route, t in times.items()}


def configured_skinny_rows() -> int | None:
    """`CHARIOT_CPU_SKINNY_MAX_ROWS`: a row count (an integer >= 0) or `all` (`ALL_ROWS`); None when
    unset (measure it)."""
    text = (env.read(env.CPU_SKINNY_MAX_ROWS) or "").strip()
    if not text:
        return None
    if text == "all":
        return ALL_ROWS
    if not text.isdigit():
        raise ValueError(f"{SKINNY_ROWS_ENV} must be a row count (an integer >= 0) or 'all', got {text!r}")
    return int(text)


def calibration_layers(layers: Sequence[L], budget: int = CALIBRATION_BYTES,
                       size: Callable[[L], int] = lambda m: m.weight_nbytes) -> list[L]:
    """The leading layers whose weights (`size` bytes each) add up to `budget` bytes (at least one)."""
    chosen: list[L] = []
    total = 0
    for layer in layers:
        if chosen and total + size(layer) > budget:
            break
        chosen.append(layer)
        total += size(layer)
    return chosen


def measured_row_limit(layers: Sequence[CpuLinear]) -> int:
    """Up to how many rows the few-rows route takes the calls on `layers` (each keeping both weights):
    the cut `RowsCalibration.max_rows_within` picks over ROW_CANDIDATES up to the kernels' cap; for the
    panel kernel (whose wins count within PANEL_TIE), `ALL_ROWS` when that cut reaches SETTLED_ROWS
    and the panels win MANY_ROWS (within `many_rows_tie` of this CPU)."""
    cap = min(m.few_rows_cap for m in layers)
    tie = PANEL_TIE if cap == ALL_ROWS else 1.0
    few = calibrate_skinny_rows(calibration_layers(layers), [r for r in ROW_CANDIDATES if r <= cap])
    limit, timings = few.max_rows_within(tie), few.describe()
    if cap == ALL_ROWS and limit >= SETTLED_ROWS:
        many = calibrate_skinny_rows(calibration_layers(layers, MANY_ROWS_BYTES), [MANY_ROWS],
                                     passes=MANY_ROWS_PASSES)
        many_tie = many_rows_tie(cpu_flags())
        timings += (f"; over the first {MANY_ROWS_BYTES >> 20} MiB: {many.describe()}, "
                    f"a win within {round((many_tie - 1) * 100)} %")
        limit = ALL_ROWS if many.max_rows_within(many_tie) == MANY_ROWS else limit
    kernel = "panel" if layers[0].panels is not None else "amx tile" if layers[0].tiles is not None else "skinny"
    rows = "every row count" if limit == ALL_ROWS else f"up to {limit} rows, oneDNN above"
    log.info("linear layers: %s kernel for %s (measured per pass over the first %d MiB of the stage's layers, "
             "kernel vs oneDNN: %s)", kernel, rows, CALIBRATION_BYTES >> 20, timings)
    return limit


def route_rows(layers: Sequence[CpuLinear]) -> None:
    """Set how many rows the few-rows route takes: from the environment, else measured on `layers`
    when they keep both weights (with only the few-rows route, it takes up to its cap); never more
    than a layer's `few_rows_cap` (every row count for the panel kernel, 32 for the skinny one). A
    layer whose few-rows route takes every row count releases oneDNN's copy of its weight."""
    both = [m for m in layers if m.skinny and m.packed_weight is not None]
    limit = configured_skinny_rows()
    if limit is None and both:
        limit = measured_row_limit(both)
    for m in both:
        m.skinny_max_rows = m.few_rows_cap if limit is None else min(limit, m.few_rows_cap)
        if m.skinny_max_rows == ALL_ROWS:
            m.packed_weight = None


def cpu_linears(module: nn.Module, device: torch.device, dtype: torch.dtype) -> int:
    """Replace every `nn.Linear` under `module` with a `CpuLinear`; returns how many were replaced."""
    plan = plan_linears(module, device, dtype)
    for what, problem in (("packed for oneDNN", plan.packing_problem), ("skinny kernel", plan.skinny_problem)):
        if problem is not None:
            log.info("linear layers: no %s: %s", what, problem)
    if not (plan.packed or plan.plain):
        return 0
    targets = [(name, child) for name, child in module.named_modules() if isinstance(child, nn.Linear)]
    onednn_dtype = packed_dtype([linear for _, linear in targets], dtype, plan.packed)
    for name, linear in targets:
        parent_name, _, attr = name.rpartition(".")
        parent = module.get_submodule(parent_name) if parent_name else module
        with torch.inference_mode(False), torch.no_grad():
            setattr(parent, attr, CpuLinear(linear, packed=plan.packed, plain=plan.plain, packed_dtype=onednn_dtype))
    route_rows([m for m in module.modules() if isinstance(m, CpuLinear)])
    return len(targets)
