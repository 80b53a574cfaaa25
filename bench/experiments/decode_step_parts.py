"""Where a decode step's time goes outside the linear layers and attention, in Chariot's engine.

One process, Chariot's `LLM` on the `100m` weights (bf16 unless given), N sequences of about 300
prompt tokens decoding 200 tokens each (greedy, `ignore_eos`). For the decode-only steps after the
first 20 it reports the median of:
- the engine step's parts (`IterationTimes`: schedule, prepare, execute, postprocess);
- inside execute: building the device batch (`ModelRunner.decode`), the stage's forward, the final
  norm + LM head (`compute_logits`) and the sampler;
- then the stage's forward alone, repeated on the inputs of the last decode step that held all N
  sequences (the very last step holds fewer): as it is, with the linear
  layers replaced by a lookup of preallocated outputs, and with attention replaced too. What is left
  in the last is the Python around the ops plus the small ops (norms, RoPE, KV writes, SiLU·mul):
  the most a compiled layer could save.

    .venv/bin/python -m chariot.bench.experiments.decode_step_parts [float32|bfloat16] [N ...] > OUT.txt

About a minute per N.

Run from the repository root (it loads `models/100m`).
"""

from __future__ import annotations

import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

MODEL = Path("models/100m")
SKIP = 20


def load(dtype: str) -> Any:
    from chariot.worker import LLM

    return LLM(str(MODEL), dtype=dtype, token_budget=512, max_model_len=2048,
               kv_cache_tokens=65536, prefix_caching=False, progress=False)


def timed(spent: dict[str, list[float]], name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        t = time.perf_counter()
        out = fn(*args, **kwargs)
        spent[name].append(time.perf_counter() - t)
        return out
    return wrapper


def step_parts(llm: Any, seqs: int) -> tuple[dict[str, float], tuple[Any, tuple[Any, ...], dict[str, Any]]]:
    from chariot.worker import SamplingParams

    engine, runner = llm.engine, llm.engine.executor.runner
    spent: dict[str, list[float]] = defaultdict(list)
    for name in ("decode", "forward", "sample"):
        setattr(runner, name, timed(spent, name, getattr(runner, name)))
    runner.stage.compute_logits = timed(spent, "compute_logits", runner.stage.compute_logits)
    last: dict[str, Any] = {}
    forward = runner.forward

    def grab(inp: Any, hidden_states: Any = None) -> Any:
        if inp.input_ids.shape[0] == seqs:  # a decode step of all N sequences, not the last (fewer may be left)
            last["inp"] = inp
        return forward(inp, hidden_states)

    runner.forward = grab
    for i in range(seqs):
        engine.add_request(list(range(5, 300 + i)), SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True),
                           request_id=f"r{i}")
    steps: list[Any] = []
    while engine.has_unfinished:
        result = engine.step()
        if result.batch is not None and result.batch.num_decodes == len(result.batch.chunks):
            steps.append(result.times)
    decode_steps = len(steps)
    parts = {f"step {f}": statistics.median(getattr(t, f) for t in steps[SKIP:])
             for f in ("schedule", "prepare", "execute", "postprocess")}
    for name, values in spent.items():  # every step is a decode step after the prefill ones
        parts[f"execute: {name}"] = statistics.median(values[-(decode_steps - SKIP):])
    parts["execute: sampler"] = parts.pop("execute: sample") - parts["execute: compute_logits"]
    inp = last["inp"]
    return parts, (runner.stage, (inp.positions, runner.kv_caches, inp.attn), {"input_ids": inp.input_ids})


def forward_without(call: tuple[Any, tuple[Any, ...], dict[str, Any]], reps: int = 200) -> dict[str, float]:
    import chariot.worker.model.cpu_linear as cpu_linear
    import chariot.worker.model.llama as llama

    stage, args, kwargs = call

    def median_ms() -> float:
        times = []
        with torch.inference_mode():
            for _ in range(reps):
                t = time.perf_counter()
                stage(*args, **kwargs)
                times.append(time.perf_counter() - t)
        return statistics.median(times)

    outputs: dict[tuple[int, int], torch.Tensor] = {}

    def no_linear(self: Any, x: torch.Tensor) -> torch.Tensor:
        key = (x.shape[0], self.out_features)
        if key not in outputs:
            outputs[key] = torch.zeros(x.shape[0], self.out_features, dtype=x.dtype)
        return outputs[key]

    def no_attention(q: torch.Tensor, *_: Any, **__: Any) -> torch.Tensor:
        return torch.empty_like(q)

    linear, attention = cpu_linear.CpuLinear.forward, llama.paged_attention
    print(f"  (the repeated forward's batch: {kwargs['input_ids'].shape[0]} token(s))")
    out = {"forward, repeated": median_ms()}
    try:
        cpu_linear.CpuLinear.forward = no_linear  # type: ignore[method-assign]
        out["forward without linear layers"] = median_ms()
        llama.paged_attention = no_attention  # type: ignore[assignment]
        out["forward without linear layers and attention"] = median_ms()
    finally:
        cpu_linear.CpuLinear.forward = linear  # type: ignore[method-assign]
        llama.paged_attention = attention
    return out


def main(dtype: str, counts: list[int]) -> None:
    from chariot.bench.linear_bench import cpu_record

    record = cpu_record()
    print({k: v for k, v in record.items() if k != "all_flags"})
    for seqs in counts:
        llm = load(dtype)
        parts, call = step_parts(llm, seqs)
        parts.update(forward_without(call))
        print(f"\n{seqs} sequence(s), median ms per decode step:")
        for name, seconds in parts.items():
            print(f"  {name:48s} {seconds * 1e3:7.2f}")
        del llm


if __name__ == "__main__":
    args = sys.argv[1:]
    dtype = args.pop(0) if args and not args[0].isdigit() else "bfloat16"
    main(dtype, [int(a) for a in args] or [1, 16])
