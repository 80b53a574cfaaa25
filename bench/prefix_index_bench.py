"""What a prefix-aware routing decision costs the router: hashing a prompt's token ids into the block
chain once, then finding each replica's longest cached prefix (router/prefix_index.py).

Replicas are filled to their capacity with unrelated chains, plus the prompt's own prefix at
different depths (all of it, half, none), so each lookup walks as far as a real hit would.

    python -m chariot.bench.prefix_index_bench --tokens 4096 --replicas 4
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from collections.abc import Callable
from typing import Any

from chariot.contracts.prefix_hash import DEFAULT_BLOCK_SIZE
from chariot.router.prefix_index import PrefixIndex


def median_us(fn: Callable[[], object], reps: int) -> float:
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


def run(tokens: int, replicas: int, capacity: int, block_size: int, reps: int, seed: int = 0) -> dict[str, Any]:
    rng = random.Random(seed)
    prompt = [rng.randrange(16, 32_000) for _ in range(tokens)]
    index = PrefixIndex(block_size=block_size, capacity=capacity)
    hashes = index.hash_prompt(prompt).hashes
    names = [f"r{i}" for i in range(replicas)]
    for i, name in enumerate(names):
        filler = [rng.randbytes(16) for _ in range(capacity)]
        index.add_blocks(name, filler)
        depth = len(hashes) * (replicas - 1 - i) // max(1, replicas - 1)  # all, …, none
        index.add_blocks(name, hashes[:depth])
    prompt_hashes, cached = index.lookup(prompt)
    return {
        "tokens": tokens, "block_size": block_size, "replicas": replicas, "capacity_blocks": capacity,
        "cached_tokens": cached,
        "hash_prompt_us": round(median_us(lambda: index.hash_prompt(prompt), reps), 1),
        "cached_tokens_us": round(median_us(lambda: index.cached_tokens(prompt_hashes), reps), 1),
        "lookup_us": round(median_us(lambda: index.lookup(prompt), reps), 1),
        "index_blocks": index.num_blocks(),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--tokens", type=int, default=4096, help="prompt length (default 4096)")
    p.add_argument("--replicas", type=int, default=4)
    p.add_argument("--capacity", type=int, default=65536, help="blocks remembered per replica (default 65536)")
    p.add_argument("--block-size", type=int, default=DEFAULT_BLOCK_SIZE)
    p.add_argument("--reps", type=int, default=200)
    args = p.parse_args(argv)
    print(json.dumps(run(args.tokens, args.replicas, args.capacity, args.block_size, args.reps), indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
