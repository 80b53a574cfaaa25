"""torch.profiler of one 1,536-token prefill on `models/100m` (output: prefill_profile.txt).

    .venv/bin/python docs/img/ttft/prefill_profile.py
"""

from __future__ import annotations

import time

import torch
from torch.profiler import ProfilerActivity, profile

from chariot.worker import LLM, SamplingParams


def main() -> None:
    first = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    gen = torch.Generator().manual_seed(1)
    llm = LLM("models/100m", dtype="float32", token_budget=512, max_model_len=2048, kv_cache_tokens=16384,
              prefix_caching=False, progress=False, attention_aware_chunks=False)

    def prompt() -> list[int]:
        return torch.randint(3, 8000, (1536,), generator=gen).tolist()

    llm.generate([prompt()], first)
    start = time.perf_counter()
    llm.generate([prompt()], first)
    print("unprofiled", time.perf_counter() - start)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        llm.generate([prompt()], first)
        print("profiled", time.perf_counter() - start)
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=22, max_name_column_width=50))


if __name__ == "__main__":
    main()
