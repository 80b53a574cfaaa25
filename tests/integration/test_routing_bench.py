"""`chariot bench routing` and the closed-loop conversation replay it runs, against real local
replicas and a real router (the tiny model): a conversation's later turns resend the model's own
answers and find their whole history cached on the replica prefix routing sends them to; the command
writes its results and plot, and prefix routing computes fewer prompt tokens than round robin."""

from __future__ import annotations

import argparse
import itertools
import json
from dataclasses import replace

import pytest
from matplotlib.image import imread

from chariot.bench.capacity_cli import add_bench_parser, warm_up
from chariot.bench.driver import conversations, drive
from chariot.bench.routing_bench import routed_counts, running_replicas
from chariot.bench.traces import TRACES
from chariot.worker.config import EngineConfig

TINY_VOCAB = 512
BS = 16  # the replicas' block size: the short multi-turn histories here reuse whole 16-token blocks
QUICK_TURNS = replace(TRACES["multiturn"], multi_turn=replace(TRACES["multiturn"].multi_turn, think_s=0.3,
                                                             tenants=2))


@pytest.mark.slow
def test_follow_up_turns_find_their_whole_history_on_the_replica_they_are_routed_to(tiny_model_dir):
    config = EngineConfig(model=str(tiny_model_dir), max_model_len=512, kv_cache_tokens=8192, prefix_caching=True,
                          block_size=BS)
    with running_replicas(config, replicas=2, routing="prefix", threads=1) as stack:
        warm_up(stack.router, TINY_VOCAB)
        before = routed_counts(stack.metrics)
        result = drive(stack.router, QUICK_TURNS, 1.0, 12, TINY_VOCAB, scale=0.1, max_len=512, salt=5,
                       closed_loop=True)
        routed = {k: v - before.get(k, 0.0) for k, v in routed_counts(stack.metrics).items()}
    assert result.errors == () and result.gave_up is None
    requests, traces = result.requests, result.traces
    follow_ups = 0
    for group in conversations(requests):
        for prev, cur in itertools.pairwise(group):
            before_turn, turn = traces[prev], traces[cur]
            assert turn.arrival >= before_turn.token_times[-1]  # sent after the answer came back
            history = requests[prev].prompt_len + requests[prev].decode_len - 1  # the last token has no KV
            reusable = min(history // BS, (requests[cur].prompt_len - 1) // BS) * BS
            assert turn.cached_tokens >= reusable, (cur, turn.cached_tokens, reusable)
            follow_ups += 1
    assert follow_ups >= 4
    assert sum(n for key, n in routed.items() if key.endswith(("/prefix", "/affinity"))) >= follow_ups


@pytest.mark.slow
def test_bench_routing_command(tiny_model_dir, tmp_path):
    parser = argparse.ArgumentParser()
    add_bench_parser(parser.add_subparsers())
    args = parser.parse_args(["bench", "routing", "--model", str(tiny_model_dir), "--traces", "multiturn",
                              "--qps", "2", "--requests", "12", "--scale", "0.1", "--max-len", "512",
                              "--think-s", "0.3", "--kv-cache-tokens", "8192", "--out", str(tmp_path)])
    assert args.handler(args) == 0
    doc = json.loads((tmp_path / "routing.json").read_text())
    rows = {r["mode"]: r for r in doc["probes"]}
    assert set(rows) == {"prefix", "load", "round_robin"} and all(r["failed"] == 0 for r in rows.values())
    assert len({r["salt"] for r in rows.values()}) == 3  # no probe is served from another's cache
    assert all(r["prompt_tokens"] == rows["prefix"]["prompt_tokens"] for r in rows.values())  # the same replay
    assert rows["prefix"]["cached_tokens"] > 0
    assert rows["prefix"]["prefill_tokens_computed"] <= rows["round_robin"]["prefill_tokens_computed"]
    assert set(doc["capacity_qps"]) == {"multiturn/prefix", "multiturn/load", "multiturn/round_robin"}
    for mode, row in rows.items():  # one rung: capacity is that rung where its median TTFT met the target
        assert doc["capacity_qps"][f"multiturn/{mode}"] == {
            t: (2.0 if row["ttft_p50_s"] <= float(t) / 1e3 else 0.0) for t in ("250", "500", "1000", "2000")}
    assert {c["mode"] for c in doc["comparisons"]} == {"prefix", "round_robin"}
    assert doc["setup"]["cpu_flags"] and doc["setup"]["replicas"] == 2
    h, w, _ = imread(tmp_path / "routing_multiturn.png").shape
    assert h > 100 and w > 100
    # the same probes judged against other targets, without running anything
    loose = parser.parse_args(["bench", "routing", "--redraw", str(tmp_path), "--ttft-slo-ms", "0.001,60000"])
    assert loose.handler(loose) == 0
    again = json.loads((tmp_path / "routing.json").read_text())
    assert again["probes"] == doc["probes"]
    assert all(c == {"0.001": 0.0, "60000": 2.0} for c in again["capacity_qps"].values())
