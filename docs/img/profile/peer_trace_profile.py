"""The peer benchmark's offline trace (chat ×0.25, 64 requests at t=0, fresh prompts, float32 or bf16, budget
512, 1 GiB of KV) through `LLM.generate` in one process: wall time and engine overhead per iteration
kind, then the same run under torch.profiler. Ad hoc, for BENCHMARKS.md's peer section; run from the
repository root: python docs/img/profile/peer_trace_profile.py [DTYPE] > docs/img/profile/peer_trace_<machine>.txt
(DTYPE: float32, the default, or bfloat16)
"""

import collections
import json
import sys
import time

from torch.profiler import ProfilerActivity, profile

from chariot.bench.peer import fresh_prompts
from chariot.bench.traces import TRACES, make_trace
from chariot.worker import LLM, SamplingParams
from chariot.worker.output_processor import OutputProcessor, run_step

trace = make_trace(TRACES["chat"], 64, 1.0, seed=0, scale=0.25, max_len=2048)
params = [SamplingParams(max_tokens=r.decode_len, ignore_eos=True, temperature=0) for r in trace]
dtype = sys.argv[1] if len(sys.argv) > 1 else "float32"
llm = LLM("models/100m", policy="sarathi", token_budget=512, dtype=dtype, kv_cache_tokens=65536, progress=False)
llm.generate([[1] * 64], SamplingParams(max_tokens=4, ignore_eos=True))  # warm-up

engine, processor = llm.engine, OutputProcessor(llm.engine.tokenizer)
for prompt, p in zip(fresh_prompts([r.prompt_len for r in trace], 8192, "profile:0"), params, strict=True):
    processor.add_request(engine.add_request(prompt, p), p)
kinds: dict[str, list[float]] = collections.defaultdict(lambda: [0, 0.0, 0.0, 0])
t0 = time.perf_counter()
while len(processor):
    result, _ = run_step(engine, processor)
    if result.batch is None:
        continue
    decodes, tokens = result.batch.num_decodes, result.batch.num_tokens
    kind = f"{'decode-only' if tokens == decodes else 'prefill + decodes'}, {min(decodes // 16 * 16, 48)}+ decodes"
    k = kinds[kind]
    k[0] += 1
    k[1] += result.times.total
    k[2] += result.times.overhead
    k[3] += tokens
wall = time.perf_counter() - t0
print(json.dumps({"wall_s": round(wall, 2), "output_tokens": sum(r.decode_len for r in trace)}))
print("iteration kind | iterations | seconds | ms / iteration | tokens / iteration | engine overhead share")
for kind, (n, s, overhead, tokens) in sorted(kinds.items()):
    print(f"{kind} | {n} | {s:.1f} | {s / n * 1e3:.0f} | {tokens / n:.0f} | {overhead / s:.2%}")

prompts = fresh_prompts([r.prompt_len for r in trace], 8192, "profile:1")
t0 = time.perf_counter()
with profile(activities=[ProfilerActivity.CPU]) as prof:
    llm.generate(prompts, params)
print(f"under the profiler: wall {time.perf_counter() - t0:.1f} s")
print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=16, max_name_column_width=50))
