"""The engine steps behind the peer benchmark's one-request decode TBT, from both servers' iteration logs.

Why: `chariot bench peer` reports one request's decode TBT as its client saw it (a 128-token prompt,
256 tokens out, on an idle server), which holds the engine's step and everything around it (the
serving path, the stream to the client). Both servers log every iteration, so the steps of that
request can be read back and the client's TBT split into the engine's part and the rest. On an idle
server the request is the only thing running: its prompt is one 128-token chunk with no decodes,
followed by one-decode iterations with no prompt tokens until it ends; this finds each such run of at
least `min_decodes` iterations (by default the benchmark's whole request: its first token comes
from the prompt's iteration) in log order and gives the median step of its decodes.

    .venv/bin/python -m chariot.bench.experiments.single_request_steps OUT.json VLLM_LOG[.gz] ITERATION_LOG[.gz]...

Writes OUT.json: per system, every window found (its place in the log, its decodes, their median
forward ms), in log order (one per search of the run).
"""

from __future__ import annotations

import json
import statistics
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from chariot.bench.experiments.iteration_cost import SYSTEMS, load
from chariot.bench.peer import SINGLE_OUTPUT_TOKENS, SINGLE_PROMPT_TOKENS


def single_request_windows(records: Sequence[Mapping[str, Any]], prompt_tokens: int = SINGLE_PROMPT_TOKENS,
                           min_decodes: int = SINGLE_OUTPUT_TOKENS - 1) -> list[dict[str, Any]]:
    """Each run of one prompt-only iteration of `prompt_tokens` followed by at least `min_decodes`
    one-decode iterations with no prompt tokens: where it starts, its decodes and their median ms."""
    windows, i = [], 0
    while i < len(records):
        if records[i]["prefill"] != prompt_tokens or records[i]["decodes"] != 0:
            i += 1
            continue
        end = i + 1
        while end < len(records) and records[end]["prefill"] == 0 and records[end]["decodes"] == 1:
            end += 1
        steps = [r["forward_ms"] for r in records[i + 1:end]]
        if len(steps) >= min_decodes:
            windows.append({"index": i, "decodes": len(steps), "median_ms": round(statistics.median(steps), 3)})
        i = end
    return windows


def main(argv: list[str]) -> int:
    if len(argv) < 3:
        print(__doc__, file=sys.stderr)
        return 2
    out, vllm_log, chariot_logs = Path(argv[0]), Path(argv[1]), [Path(p) for p in argv[2:]]
    records = load(vllm_log, chariot_logs)
    windows_by_system = {s: single_request_windows(records[s]) for s in SYSTEMS}
    doc = {"sources": [p.name for p in (vllm_log, *chariot_logs)], "windows": windows_by_system}
    out.write_text(json.dumps(doc, indent=1) + "\n")
    for system, windows in windows_by_system.items():
        print(system, [w["median_ms"] for w in windows])
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
