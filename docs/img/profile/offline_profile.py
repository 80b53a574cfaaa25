import random
import time

from torch.profiler import ProfilerActivity, profile

from chariot.worker import LLM, SamplingParams

llm = LLM(model="models/100m", policy="sarathi", token_budget=512, dtype="float32")
rng = random.Random(0)
prompts = [[rng.randrange(8192) for _ in range(rng.randint(64, 600))] for _ in range(24)]
params = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
llm.generate(prompts[:2], params)
t = time.perf_counter()
with profile(activities=[ProfilerActivity.CPU]) as prof:
    out = llm.generate(prompts, params)
wall = time.perf_counter() - t
print(f"wall {wall:.1f}s tokens {sum(len(o.token_ids) for o in out)}")
print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=14, max_name_column_width=40))
