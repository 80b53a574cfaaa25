"""Where detokenisation runs: the engine loop's time per step with text in the loop, against without.

The engine loop (`EngineCore.step`) turns each step's token ids into text deltas and applies stop
strings before the next step is scheduled. The alternative, as in vLLM v1, is a loop that emits token
ids only and a front that detokenises (then a stop string reaches the engine one step late: the engine
computes a token past it, and its KV blocks are held a step longer). This benchmark measures what the
text work costs the loop under load, so the choice rests on data:

- C concurrent requests decode N tokens each through a real `EngineCore` on a real checkpoint;
- rounds alternate two loops over the same engine: `text` (the real output processor) and `tokens`
  (the same engine outputs turned into deltas without text, what the loop would do if the front
  detokenised);
- after one discarded warm-up round, each round records every decode step's wall time split into the
  engine step and the output processing, and reports per-step medians and the share of the loop's
  time that text takes.

    python -m chariot.bench.detok_placement --model models/100m --streams 64 --tokens 64 --rounds 3

Writes the per-round numbers, the CPU model and flags to `--out` (JSON).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from chariot.bench.peer import parse_cpuinfo
from chariot.contracts.outputs import RequestOutput
from chariot.contracts.sampling_params import SamplingParams
from chariot.worker.config import EngineConfig
from chariot.worker.engine import Engine
from chariot.worker.engine_output import EngineOutput, StepResult

PLACEMENTS = ("text", "tokens")


@dataclass(frozen=True)
class Round:
    placement: str
    round: int
    steps: int
    step_ms_median: float  # engine.step(): schedule, execute, sample
    process_ms_median: float  # engine outputs → RequestOutput deltas (with or without text)
    loop_ms_median: float  # the two together: one turn of the engine loop

    @property
    def process_share(self) -> float:
        return self.process_ms_median / self.loop_ms_median if self.loop_ms_median else 0.0


def tokens_only(outputs: tuple[EngineOutput, ...]) -> list[RequestOutput]:
    """The deltas a loop that leaves text to the front would send: token ids, counts and times."""
    return [RequestOutput(o.request_id, list(o.new_token_ids), "", len(o.prompt_token_ids), o.num_output_tokens,
                          o.finish_reason, o.times, o.num_preemptions, o.error, list(o.new_logprobs))
            for o in outputs]


def run_round(engine: Engine, placement: str, rnd: int, streams: int, tokens: int, prompt_len: int) -> Round:
    """`streams` requests of `tokens` greedy tokens each, to completion, timing every loop turn."""
    from chariot.worker.output_processor import OutputProcessor

    processor = OutputProcessor(engine.tokenizer)
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True, stop=("\n\n\n",))
    vocab = engine.model_config.vocab_size
    for i in range(streams):
        prompt = [(rnd * 7919 + i * 104729 + j * 31) % (vocab - 10) + 5 for j in range(prompt_len)]
        rid = engine.add_request(prompt, params, request_id=f"{placement}-{rnd}-{i}")
        processor.add_request(rid, params)
    step_ms, process_ms = [], []
    while engine.has_unfinished:
        t0 = time.perf_counter()
        result: StepResult = engine.step()
        t1 = time.perf_counter()
        if placement == "text":
            processor.process(result.outputs)
        else:
            tokens_only(result.outputs)
        t2 = time.perf_counter()
        if result.batch is not None and result.batch.num_prefill_tokens == 0:  # decode steps: the steady state
            step_ms.append((t1 - t0) * 1e3)
            process_ms.append((t2 - t1) * 1e3)
    loops = [a + b for a, b in zip(step_ms, process_ms, strict=True)]
    return Round(placement, rnd, len(loops), statistics.median(step_ms), statistics.median(process_ms),
                 statistics.median(loops))


def summary(rounds: list[Round]) -> dict[str, float]:
    """Per placement: the median over rounds of each round's median loop time, and the ratio."""
    loop = {p: statistics.median(r.loop_ms_median for r in rounds if r.placement == p) for p in PLACEMENTS}
    share = statistics.median(r.process_share for r in rounds if r.placement == "text")
    return {"loop_ms_text": loop["text"], "loop_ms_tokens": loop["tokens"],
            "text_over_tokens": loop["text"] / loop["tokens"], "text_share_of_loop": share}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--streams", type=int, default=64)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", default="bench/results/detok_placement.json")
    args = p.parse_args(argv)
    config = EngineConfig(model=args.model, dtype=args.dtype, max_batch_size=args.streams,
                          max_model_len=args.prompt_len + args.tokens + 16,
                          kv_cache_tokens=args.streams * (args.prompt_len + args.tokens + 32))
    engine = Engine(config, progress=False)
    run_round(engine, "tokens", -1, args.streams, args.tokens, args.prompt_len)  # warm-up: kernels, allocator
    rounds = []
    for rnd in range(args.rounds):
        for placement in PLACEMENTS if rnd % 2 == 0 else PLACEMENTS[::-1]:  # alternate: drift hits both
            rounds.append(run_round(engine, placement, rnd, args.streams, args.tokens, args.prompt_len))
            r = rounds[-1]
            print(f"round {rnd} {placement:6s}: loop {r.loop_ms_median:7.2f} ms/step (engine "
                  f"{r.step_ms_median:.2f}, deltas {r.process_ms_median:.3f}) over {r.steps} decode steps", flush=True)
    engine.shutdown()
    result = summary(rounds)
    print(f"text in the loop: {result['loop_ms_text']:.2f} ms/step, tokens only: {result['loop_ms_tokens']:.2f} "
          f"ms/step, ratio {result['text_over_tokens']:.4f}; text is {100 * result['text_share_of_loop']:.2f} % "
          f"of a loop turn")
    cpu = parse_cpuinfo(Path("/proc/cpuinfo").read_text())
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"args": vars(args), "cpu": asdict(cpu), "summary": result,
                               "rounds": [{**asdict(r), "process_share": r.process_share} for r in rounds]},
                              indent=1))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
