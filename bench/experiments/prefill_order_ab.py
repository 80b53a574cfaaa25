"""Prefill order side by side: Chariot with `--prefill-order fcfs` against `shortest`, the same probes.

Why: under the peer benchmark's SLO (P99 TBT ≤ 1 s, median TTFT ≤ 2 s) every failing probe of both
systems fails on median TTFT, and both serve prompts in arrival order; `shortest` (fewest prompt
tokens left first, aged by one token budget per iteration waited) is the scheduler's lever on that
median. This measures what it buys and what it costs (the TTFT of the longest prompts, the tail).

Each round starts one `chariot up` per order exactly as `chariot bench peer` starts Chariot, the
orders alternating (A B, B A, …), and sends each of them the same probes: the chat trace ×0.25 at
each QPS with the same fresh prompt contents, from the peer benchmark's streaming client, never cut
short. Per probe: TTFT p50/p90/p99/max, TTFT p50 of the longest quarter of prompts, TBT p50/p99.

    .venv/bin/python -m chariot.bench.experiments.prefill_order_ab --qps 1.25,1.5 --rounds 2 --out DIR

Writes DIR/prefill_order_ab.json and prints a Markdown table of each order's medians over rounds.
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
from chariot.bench.capacity import RequestTrace, percentile
from chariot.contracts.engine_settings import PREFILL_ORDER

ORDERS = PREFILL_ORDER.choices
STATS = ("ttft_p50", "ttft_p90", "ttft_p99", "ttft_max", "long_ttft_p50", "tbt_p50", "tbt_p99")


def probe_stats(traces: list[RequestTrace]) -> dict[str, float | int]:
    """Latencies of one probe in milliseconds; `long_ttft_p50` over the longest quarter of prompts."""
    done = [t for t in traces if t.ok and t.token_times]
    ttft = [t.ttft for t in done if t.ttft is not None]
    cut = sorted(t.prompt_tokens for t in done)[(3 * len(done)) // 4] if done else 0
    long_ttft = [t.ttft for t in done if t.ttft is not None and t.prompt_tokens >= cut]
    gaps = [g for t in done for g in t.tbt]
    ms = {"ttft_p50": percentile(ttft, 50), "ttft_p90": percentile(ttft, 90), "ttft_p99": percentile(ttft, 99),
          "ttft_max": max(ttft, default=float("nan")), "long_ttft_p50": percentile(long_ttft, 50),
          "tbt_p50": percentile(gaps, 50), "tbt_p99": percentile(gaps, 99)}
    return {**{k: round(v * 1e3, 1) for k, v in ms.items()}, "failed": len(traces) - len(done)}


def run_order(cfg: peer.PeerConfig, order: str, round_index: int, qps_list: list[float]) -> list[dict[str, Any]]:
    """One server with `order`, every probe of the round (prompts seeded by round and QPS, not by order)."""
    vocab = peer.vocab_size(cfg.model)
    trace = peer.trace_lengths(cfg, 0)
    rows = []
    with peer.chariot_server(replace(cfg, prefill_order=order)) as server:
        peer.warm_up(server, vocab)
        for qps in qps_list:
            seed = f"{cfg.seed}/order-ab/{round_index}/{qps}"
            prompts = peer.fresh_prompts([r.prompt_len for r in trace], vocab, seed)
            result = asyncio.run(peer.run_load(server.base_url, peer.SERVED_NAME,
                                               peer.planned_requests(trace, qps, prompts), drain_s=cfg.drain_s))
            peer.wait_idle(server)
            row = {"order": order, "round": round_index, "qps": qps, "wall_s": round(result.wall_s, 2),
                   **probe_stats(list(result.traces))}
            peer.log(f"round {round_index + 1} {order} @ {qps:g} QPS: " + "  ".join(f"{k} {row[k]}" for k in STATS))
            rows.append(row)
    return rows


def table(rows: list[dict[str, Any]], qps_list: list[float]) -> str:
    """Each order's medians over rounds per QPS (ms), and shortest / fcfs."""
    lines = ["| QPS | order | " + " | ".join(STATS) + " | failed |", "|---|---|" + "---:|" * (len(STATS) + 1)]
    for qps in qps_list:
        med = {o: {k: statistics.median(r[k] for r in rows if r["order"] == o and r["qps"] == qps)
                   for k in (*STATS, "failed")} for o in ORDERS}
        for o in ORDERS:
            lines.append(f"| {qps:g} | {o} | " + " | ".join(f"{med[o][k]:.0f}" for k in STATS)
                         + f" | {med[o]['failed']:g} |")
        lines.append(f"| {qps:g} | shortest / fcfs | " + " | ".join(
            f"{med['shortest'][k] / med['fcfs'][k]:.2f}×" if med["fcfs"][k] else "-" for k in STATS) + " | |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m chariot.bench.experiments.prefill_order_ab",
                                description=__doc__.splitlines()[0])
    p.add_argument("--qps", default="1.25,1.5", help="probe loads, comma separated (default 1.25,1.5)")
    p.add_argument("--rounds", type=int, default=2, help="rounds, the orders alternating (default 2)")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--out", type=Path, default=Path("."))
    args = p.parse_args(argv)
    cfg = peer.config_from_flags(["--dtype", args.dtype, "--systems", "chariot"])
    peer.ensure_model(cfg.model)
    qps_list = [float(q) for q in args.qps.split(",")]
    setup = {**peer.setup_record(cfg), "qps": qps_list, "rounds": args.rounds}
    rows: list[dict[str, Any]] = []
    for r in range(args.rounds):
        for order in (ORDERS if r % 2 == 0 else ORDERS[::-1]):
            rows += run_order(cfg, order, r, qps_list)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "prefill_order_ab.json").write_text(json.dumps({"setup": setup, "probes": rows}, indent=1))
    print(table(rows, qps_list))
    return 0


if __name__ == "__main__":
    sys.exit(main())
