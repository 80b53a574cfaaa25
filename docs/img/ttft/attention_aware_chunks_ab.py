"""Prefill time of one prompt (one output token) with attention-aware chunks on and off: two `LLM`s
in one process, interleaved, 4 rounds with the first dropped (output: attention_aware_chunks_ab.txt).

    .venv/bin/python docs/img/ttft/attention_aware_chunks_ab.py
"""

from __future__ import annotations

import statistics
import time

import torch

from chariot.worker import LLM, SamplingParams

FIRST_TOKEN = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
LENGTHS = (512, 1024, 1536, 2000)


def main() -> None:
    gen = torch.Generator().manual_seed(0)
    prompts = {n: torch.randint(3, 8000, (n,), generator=gen).tolist() for n in LENGTHS}
    llms = {aware: LLM("models/100m", dtype="float32", token_budget=512, max_model_len=2048, kv_cache_tokens=16384,
                       prefix_caching=False, progress=False, attention_aware_chunks=aware) for aware in (True, False)}
    runs: dict[tuple[bool, int], list[tuple[float, int]]] = {(a, n): [] for a in llms for n in LENGTHS}
    for rep in range(4):
        for n in LENGTHS:
            for aware, llm in llms.items():
                first = llm.engine.iterations
                start = time.perf_counter()
                llm.generate([prompts[n]], FIRST_TOKEN)
                if rep:
                    runs[(aware, n)].append((time.perf_counter() - start, llm.engine.iterations - first))
    for n in LENGTHS:
        on, off = (statistics.median(s for s, _ in runs[(a, n)]) for a in (True, False))
        print(f"prompt {n}: aware {on * 1e3:.0f} ms ({runs[(True, n)][0][1]} it), plain {off * 1e3:.0f} ms "
              f"({runs[(False, n)][0][1]} it), aware/plain {on / off:.3f}")


if __name__ == "__main__":
    main()
