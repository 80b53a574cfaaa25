"""Which Triton kernel variants a CUDA engine compiles after its warm-up (the H100 run of 2026-11-24).

    python -m chariot.bench.experiments.gpu_kernel_variants MODEL_DIR

Builds an `LLM` on CUDA (its warm-up runs), lists the compiled variants of the attention kernels,
then serves single prompts of growing length and one batch of 24, printing each one's time and the
variants it had to compile. After the warm-up the count should stay at zero.
"""

from __future__ import annotations

import sys
import time

import torch

import chariot.kernels.triton_attention as ta
from chariot.worker import LLM, SamplingParams

KERNELS = ("_paged_attention_kernel", "_split_partial_kernel", "_split_reduce_kernel", "_write_kv_kernel")
GREEDY = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)


def variants() -> set[tuple[str, str]]:
    """(kernel, specialization key) of every compiled variant (Triton 3.x `device_caches`)."""
    found = set()
    for name in KERNELS:
        for entry in getattr(getattr(ta, name), "device_caches", {}).values():
            found |= {(name, str(key)) for key in entry[0]}
    return found


def report(label: str, seconds: float, new: set[tuple[str, str]]) -> None:
    print(f"{label}: {seconds:.3f} s, {len(new)} new variants")
    for name, key in sorted(new):
        print("  ", name, key[:200])


def main(model: str) -> None:
    start = time.time()
    llm = LLM(model, dtype="bfloat16", device="cuda", token_budget=512, max_model_len=4096, kv_cache_tokens=65536,
              progress=False)
    seen = variants()
    report(f"LLM ready (warm-up included) in {time.time() - start:.1f} s", 0.0, seen)
    gen = torch.Generator().manual_seed(0)
    batches = [[torch.randint(3, 8000, (n,), generator=gen).tolist()] for n in (81, 401, 1001, 1100, 2001, 3001, 81)]
    batches.append([torch.randint(3, 8000, (40,), generator=gen).tolist() for _ in range(24)])
    for prompts in batches:
        start = time.time()
        llm.generate(prompts, GREEDY)
        new = variants() - seen
        seen |= new
        report(f"{len(prompts)} prompt(s) of {len(prompts[0])} tokens", time.time() - start, new)


if __name__ == "__main__":
    main(sys.argv[1])
