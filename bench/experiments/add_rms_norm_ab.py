"""The residual add fused into the next RMSNorm on the CPU (`add_rms_norm` in the layer kernels)
against the two ops it replaces (`add_` then `rms_norm`), in one process.

Why: each decoder layer adds a block's output into the residual stream twice and normalises the sum
right after; on a 512-token step in bf16 the separate `add_` is a pass over 3 MB of rows per call,
16 calls a forward, and on a decode step 16 more dispatched ops. The variant is switched in place
between rounds (`cpu_layer_ops.add_rms_norm` swapped for the two ops). Three measurements:

- one decode forward (4 sequences at 1,024 tokens of context) and one full 512-token forward (a
  prompt chunk beside decodes, from the offline trace), each captured from a real step and replayed
  (medians of `linear_dispatch_ab.forward_ms`, ROUNDS alternating rounds);
- the peer benchmark's offline trace through the engine (`offline_ab`, ROUNDS rounds each).

    .venv/bin/python -m chariot.bench.experiments.add_rms_norm_ab [DTYPE] [OUT_DIR]   # ~9 min, bf16

From the repository root (it loads `models/100m`); writes OUT_DIR/add_rms_norm_ab_<dtype>.json.
"""

from __future__ import annotations

import json
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from chariot.bench import offline_ab as ab
from chariot.bench.experiments.linear_dispatch_ab import captured_decode, forward_ms
from chariot.bench.linear_bench import cpu_record
from chariot.bench.peer import fresh_prompts
from chariot.bench.traces import TRACES, make_trace
from chariot.kernels import cpu_layer_ops
from chariot.worker import LLM, SamplingParams
from chariot.worker.model.llama import LlamaStage

ROUNDS = 8
FUSED = cpu_layer_ops.add_rms_norm


def two_ops(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
            eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """What the layers ran before: the residual add, then the norm kernel."""
    summed = x.add_(residual)
    return cpu_layer_ops.rms_norm(summed, weight, eps), summed


VARIANTS: dict[str, Callable[..., tuple[torch.Tensor, torch.Tensor]]] = {"fused": FUSED, "two_ops": two_ops}


def use(name: str) -> None:
    setattr(cpu_layer_ops, "add_rms_norm", VARIANTS[name])  # noqa: B010 (the module's function, switched)


def captured_full_step(llm: LLM) -> tuple[LlamaStage, tuple[Any, ...], dict[str, Any]]:
    """A 512-token forward of the offline trace that holds a prompt chunk beside decodes."""
    calls: list[tuple[LlamaStage, tuple[Any, ...], dict[str, Any]]] = []
    forward = LlamaStage.forward

    def capture(self: LlamaStage, *args: Any, **kwargs: Any) -> torch.Tensor:
        meta = args[2]
        if args[0].shape[0] == 512 and 0 < meta.num_decodes < meta.num_seqs and len(calls) < 20:
            calls.append((self, args, kwargs))
        return forward(self, *args, **kwargs)

    trace = make_trace(TRACES["chat"], 64, 1.0, seed=0, scale=0.25, max_len=2048)
    setattr(LlamaStage, "forward", capture)  # noqa: B010
    try:
        llm.generate(fresh_prompts([r.prompt_len for r in trace], 8192, "capture"),
                     [SamplingParams(max_tokens=r.decode_len, temperature=0.0, ignore_eos=True) for r in trace])
    finally:
        setattr(LlamaStage, "forward", forward)  # noqa: B010
    return calls[-1]


def main(dtype: str, out_dir: Path) -> None:
    llm = ab.load(dtype)
    cases = {"decode_4x1024": captured_decode(llm), "full_512": captured_full_step(llm)}
    forwards: dict[str, dict[str, list[float]]] = {case: {name: [] for name in VARIANTS} for case in cases}
    for r in range(ROUNDS):
        for name in ab.rotated(list(VARIANTS), r):
            use(name)
            for case, (stage, args, kwargs) in cases.items():
                forwards[case][name].append(forward_ms(stage, args, kwargs))
        print(f"round {r + 1}: " + "; ".join(f"{case} {({k: round(v[-1], 2) for k, v in t.items()})} ms"
                                             for case, t in forwards.items()), flush=True)

    walls, tokens = ab.run_variants(ab.switched(llm, use, VARIANTS), ROUNDS, "add-rms-norm-ab")
    use("fused")
    med, same = ab.medians(walls), ab.same_tokens(tokens, "fused", "two_ops")
    fwd = {case: {name: statistics.median(v) for name, v in t.items()} for case, t in forwards.items()}
    for case, m in fwd.items():
        print(f"{case} forward: two ops {m['two_ops']:.2f} ms, fused {m['fused']:.2f} ms "
              f"({m['two_ops'] / m['fused']:.3f}x)")
    print(f"offline trace: two ops {med['two_ops']:.1f} s, fused {med['fused']:.1f} s "
          f"({med['two_ops'] / med['fused']:.3f}x); greedy tokens identical in {same}/8 requests")
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"add_rms_norm_ab_{dtype}.json").write_text(json.dumps(
        {"machine": cpu_record(), "dtype": dtype, "rounds": ROUNDS, "forward_ms": forwards,
         "forward_median_ms": fwd, "wall_s": walls, "median_s": med, "greedy_identical": same}, indent=1))


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "bfloat16", Path(sys.argv[2]) if len(sys.argv) > 2 else Path("."))
