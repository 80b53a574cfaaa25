"""A/B of the element-wise rewrites in `worker/model/llama.py` (RoPE with one output and one
half-size scratch, SiLU·mul, RMSNorm weight and residual adds in place) against the previous
out-of-place forms, on whole `LLM.generate` calls: 8 interleaved rounds (order alternating, a first
round dropped). Also checks that both give the same greedy tokens.

    .venv/bin/python docs/img/elementwise_ab.py     # writes /tmp/elementwise_ab.json

Historical (session 9): since session 12 the layer rotates q and k in place through
`cpu_layer_ops.rope_`, so `llama.apply_rope` (now `reference.rope`) is no longer what "new" swaps in.
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

import chariot.worker.model.llama as llama
from chariot.bench.linear_bench import cpu_record
from chariot.kernels import reference
from chariot.worker import LLM, SamplingParams

CASES = ("prefill 1536 tokens", "32 x 16-token prompts, 64 tokens each")


def rope_old(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


def mlp_old(self: Any, x: torch.Tensor) -> torch.Tensor:
    gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
    return self.tp.all_reduce(self.down_proj(F.silu(gate) * up))


def norm_old(self: Any, x: torch.Tensor) -> torch.Tensor:
    normed = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps)
    return self.weight * normed.to(x.dtype)


def layer_old(self: Any, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_cache: Any, meta: Any) -> Any:
    h = h + self.self_attn(self.input_layernorm(h), cos, sin, kv_cache, meta)
    return h + self.mlp(self.post_attention_layernorm(h))


IMPL = {"old": (rope_old, mlp_old, norm_old, layer_old),
        "new": (reference.rope, llama.MLP.forward, llama.RMSNorm.forward, llama.DecoderLayer.forward)}


def use(name: str) -> None:
    reference.rope, llama.MLP.forward, llama.RMSNorm.forward, llama.DecoderLayer.forward = IMPL[name]  # type: ignore[method-assign]


def main() -> None:
    gen = torch.Generator().manual_seed(0)
    llm = LLM("models/100m", dtype="float32", token_budget=512, max_model_len=2048, kv_cache_tokens=32768,
              prefix_caching=False, progress=False)
    check = [torch.randint(3, 8000, (n,), generator=gen).tolist() for n in (5, 300, 900)]
    tokens = []
    for name in IMPL:
        use(name)
        tokens.append([o.token_ids for o in llm.generate(check, SamplingParams(max_tokens=24, temperature=0.0,
                                                                              ignore_eos=True))])
    print("greedy tokens identical old/new:", tokens[0] == tokens[1])
    first = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    decode = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
    seconds: dict[tuple[str, str], list[float]] = {(n, c): [] for n in IMPL for c in CASES}
    for rep in range(9):
        long = torch.randint(3, 8000, (1536,), generator=gen).tolist()
        short = [torch.randint(3, 8000, (16,), generator=gen).tolist() for _ in range(32)]
        for name in ("old", "new") if rep % 2 == 0 else ("new", "old"):
            use(name)
            for case, prompts, params in ((CASES[0], [long], first), (CASES[1], short, decode)):
                start = time.perf_counter()
                llm.generate(prompts, params)
                if rep:
                    seconds[(name, case)].append(time.perf_counter() - start)
    rows = []
    for case in CASES:
        old, new = (statistics.median(seconds[(n, case)]) for n in ("old", "new"))
        rows.append({"case": case, "old_ms": old * 1e3, "new_ms": new * 1e3, "speedup": old / new,
                     "old_all_s": seconds[("old", case)], "new_all_s": seconds[("new", case)]})
        print(f"{case}: old {old * 1e3:.0f} ms, new {new * 1e3:.0f} ms, {old / new:.3f}x")
    Path("/tmp/elementwise_ab.json").write_text(json.dumps({"machine": cpu_record(), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
