"""Workload traces (bench/traces.py): deterministic per seed, the paper's medians × scale, Poisson
arrivals at the requested rate, and the length cap; the multi-turn trace's conversations (history
resent, shared system prompts per tenant, think time between turns)."""

from __future__ import annotations

import collections
import itertools
import random
import statistics

import pytest

from chariot.bench.traces import TRACES, fold_symbols, make_trace

N = 20_000


def test_same_seed_same_trace_other_seed_other_trace():
    a = make_trace(TRACES["chat"], 200, 2.0, seed=7, scale=0.25, max_len=2048)
    assert a == make_trace(TRACES["chat"], 200, 2.0, seed=7, scale=0.25, max_len=2048)
    assert a != make_trace(TRACES["chat"], 200, 2.0, seed=8, scale=0.25, max_len=2048)


@pytest.mark.parametrize("name", ["chat", "arxiv"])
@pytest.mark.parametrize("scale", [0.25, 1.0])
def test_medians_match_the_target_times_scale(name, scale):
    spec = TRACES[name]
    trace = make_trace(spec, N, 1.0, seed=1, scale=scale)
    prompt = statistics.median(r.prompt_len for r in trace)
    decode = statistics.median(r.decode_len for r in trace)
    assert prompt == pytest.approx(spec.median_prompt * scale, rel=0.03)
    assert decode == pytest.approx(spec.median_decode * scale, rel=0.03)


def test_paper_medians():
    """openchat_sharegpt4 (prompt 1730 / decode 415) and arxiv_summarization (7059 / ~200), §5."""
    assert (TRACES["chat"].median_prompt, TRACES["chat"].median_decode) == (1730, 415)
    assert (TRACES["arxiv"].median_prompt, TRACES["arxiv"].median_decode) == (7059, 200)


@pytest.mark.parametrize("qps", [0.3, 4.0])
def test_poisson_arrivals_at_the_requested_rate(qps):
    trace = make_trace(TRACES["chat"], N, qps, seed=2)
    gaps = [b.arrival_s - a.arrival_s for a, b in itertools.pairwise(trace)]
    assert min(gaps) >= 0
    mean = statistics.fmean(gaps)
    assert mean == pytest.approx(1 / qps, rel=0.03)
    assert statistics.pstdev(gaps) / mean == pytest.approx(1.0, abs=0.05)  # exponential: CV = 1


def test_arrivals_scale_with_qps_for_the_same_seed():
    """Common random numbers: probes at different loads replay the same requests, arrivals ∝ 1/QPS."""
    slow = make_trace(TRACES["chat"], 50, 1.0, seed=3, scale=0.25)
    fast = make_trace(TRACES["chat"], 50, 4.0, seed=3, scale=0.25)
    assert [(r.prompt_len, r.decode_len) for r in slow] == [(r.prompt_len, r.decode_len) for r in fast]
    assert [r.arrival_s / 4 for r in slow] == pytest.approx([r.arrival_s for r in fast])


def test_all_at_once_without_qps():
    assert {r.arrival_s for r in make_trace(TRACES["arxiv"], 20, None)} == {0.0}


@pytest.mark.parametrize("name", ["chat", "arxiv"])
def test_length_cap_holds(name):
    trace = make_trace(TRACES[name], 5_000, 1.0, seed=4, scale=1.0, max_len=512)
    assert all(r.prompt_len + r.decode_len <= 512 for r in trace)
    assert all(r.prompt_len >= 1 and r.decode_len >= 1 for r in trace)
    assert any(r.prompt_len + r.decode_len == 512 for r in trace)  # the cap was exercised


def test_bad_arguments():
    with pytest.raises(ValueError):
        make_trace(TRACES["chat"], 10, 0.0)
    with pytest.raises(ValueError):
        make_trace(TRACES["chat"], 10, 1.0, scale=0.0)


# ---- the multi-turn trace ------------------------------------------------------------------------
MT = TRACES["multiturn"]


def common_prefix(seqs) -> int:
    """Length of the longest prefix all of `seqs` share."""
    n = 0
    for column in zip(*seqs, strict=False):
        if any(x != column[0] for x in column):
            break
        n += 1
    return n


def conversations(trace):
    by_session = collections.defaultdict(list)
    for r in trace:
        by_session[r.session].append(r)
    return by_session


def test_multi_turn_is_registered_and_reproducible():
    assert MT.multi_turn is not None and MT.multi_turn.tenants > 1
    a = make_trace(MT, 300, 1.0, seed=5, scale=0.25, max_len=2048)
    assert len(a) == 300 and a == make_trace(MT, 300, 1.0, seed=5, scale=0.25, max_len=2048)
    assert a != make_trace(MT, 300, 1.0, seed=6, scale=0.25, max_len=2048)
    assert TRACES["chat"].multi_turn is None and make_trace(TRACES["chat"], 3, 1.0)[0].prompt_ids is None


def test_each_turn_resends_the_previous_prompt_and_its_answer():
    trace = make_trace(MT, 400, 2.0, seed=1, scale=0.25, max_len=2048)
    convs = conversations(trace)
    assert max(len(turns) for turns in convs.values()) >= 3
    for turns in convs.values():
        assert [r.turn for r in turns] == list(range(len(turns)))
        for r in turns:
            assert r.prompt_ids is not None and len(r.prompt_ids) == r.prompt_len
        for prev, cur in itertools.pairwise(turns):
            assert cur.prompt_ids[:prev.prompt_len] == prev.prompt_ids
            assert cur.prompt_len > prev.prompt_len + prev.decode_len  # its answer, then a new question
    # the answer a turn resends is the trace's own: the same tokens in every later turn
    for turns in convs.values():
        if len(turns) >= 3:
            first = turns[0]
            answer = turns[1].prompt_ids[first.prompt_len:first.prompt_len + first.decode_len]
            assert turns[2].prompt_ids[first.prompt_len:first.prompt_len + first.decode_len] == answer


def test_tenants_share_their_system_prompt_and_conversations_diverge_after_it():
    trace = make_trace(MT, 400, 2.0, seed=2, scale=0.25, max_len=2048)
    firsts = [turns[0] for turns in conversations(trace).values()]
    tenant = {r.session: r.session.split("/")[0] for r in firsts}
    assert len(set(tenant.values())) == MT.multi_turn.tenants
    for name in set(tenant.values()):
        prompts = [r.prompt_ids for r in firsts if tenant[r.session] == name]
        shared = common_prefix(prompts)
        assert len(prompts) >= 2 and shared > 0.25 * MT.multi_turn.system_prompt * 0.25
        assert all(len(p) > shared for p in prompts)  # each adds its own question
    others = [next(r.prompt_ids for r in firsts if tenant[r.session] == name) for name in sorted(set(tenant.values()))]
    assert common_prefix(others) < 3  # different tenants, different system prompts


def test_turns_arrive_after_think_time():
    mt = MT.multi_turn
    trace = make_trace(MT, 400, 1.0, seed=3, scale=0.25, max_len=2048)
    assert [r.arrival_s for r in trace] == sorted(r.arrival_s for r in trace)
    gaps = [cur.arrival_s - prev.arrival_s for turns in conversations(trace).values()
            for prev, cur in itertools.pairwise(turns)]
    assert min(gaps) > 0
    assert statistics.median(gaps) == pytest.approx(mt.think_s, rel=0.2)


def test_multi_turn_load_scales_conversation_starts_only():
    """The same seed gives the same conversations at any load; qps stretches their starts, and turns
    arrive at about qps overall."""
    slow = make_trace(MT, 2000, 1.0, seed=4, scale=0.25, max_len=2048)
    fast = make_trace(MT, 2000, 4.0, seed=4, scale=0.25, max_len=2048)
    key = sorted((r.session, r.turn, r.prompt_ids, r.decode_len) for r in slow)
    assert key == sorted((r.session, r.turn, r.prompt_ids, r.decode_len) for r in fast)
    starts = {r.session: r.arrival_s for r in slow if r.turn == 0}
    assert [fast_r.arrival_s * 4 for fast_r in fast if fast_r.turn == 0] == pytest.approx(
        [starts[r.session] for r in fast if r.turn == 0])
    assert len(slow) / slow[-1].arrival_s == pytest.approx(1.0, rel=0.15)
    assert {r.arrival_s for r in make_trace(MT, 30, None) if r.turn == 0} == {0.0}


@pytest.mark.parametrize("max_len", [3, 64, 512])
def test_multi_turn_length_cap_holds(max_len):
    trace = make_trace(MT, 1000, 1.0, seed=5, scale=1.0, max_len=max_len)
    assert len(trace) == 1000
    assert all(r.prompt_len + r.decode_len <= max_len and r.prompt_len >= 1 and r.decode_len >= 1 for r in trace)


def test_folding_into_a_vocabulary_keeps_shared_prefixes():
    trace = make_trace(MT, 50, 1.0, seed=6, scale=0.25, max_len=2048)
    turns = next(t for t in conversations(trace).values() if len(t) >= 2)
    a, b = (fold_symbols(r.prompt_ids, 512, 16) for r in turns[:2])
    assert b[:len(a)] == a and all(16 <= t < 512 for t in a + b)
    with pytest.raises(ValueError):
        fold_symbols([1], 16, 16)


def test_the_replay_sends_the_traces_own_tokens():
    """bench/driver.py: a multi-turn request's prompt is its folded symbols (so turns share their
    prefix on the wire too); a length-only request still gets random tokens."""
    from chariot.bench.driver import LOW_TOKEN_ID, prompt_ids

    rng = random.Random(0)
    trace = make_trace(MT, 40, 1.0, seed=7, scale=0.25, max_len=2048)
    turns = next(t for t in conversations(trace).values() if len(t) >= 2)
    first, second = (prompt_ids(rng, r, 512) for r in turns[:2])
    assert second[:len(first)] == first and len(second) == turns[1].prompt_len
    chat = make_trace(TRACES["chat"], 1, 1.0, scale=0.1)[0]
    fresh = prompt_ids(rng, chat, 512)
    assert len(fresh) == chat.prompt_len and min(fresh) >= LOW_TOKEN_ID


def test_salted_replays_share_no_token_at_any_position():
    symbols = list(range(0, 1 << 20, 997))
    plain, salted = fold_symbols(symbols, 8192, 16), fold_symbols(symbols, 8192, 16, salt=1)
    assert len(plain) == len(salted) and all(a != b for a, b in zip(plain, salted, strict=True))
    assert all(16 <= t < 8192 for t in salted)


def test_closed_loop_turns_resend_the_models_own_answer():
    """bench/driver.py: a later turn's prompt is what was sent, the model's actual answer, then the
    turn's new question, as long as the trace's prompt; conversations come in turn order."""
    from chariot.bench.driver import conversations as groups
    from chariot.bench.driver import next_turn_prompt, prompt_ids

    trace = make_trace(MT, 40, 1.0, seed=7, scale=0.25, max_len=2048)
    convs = groups(trace)
    assert sorted(i for g in convs for i in g) == list(range(len(trace)))
    group = next(g for g in convs if len(g) >= 2)
    assert [trace[i].turn for i in group] == list(range(len(group)))
    first, second = trace[group[0]], trace[group[1]]
    sent = prompt_ids(random.Random(0), first, 512, salt=3)
    answer = [7] * first.decode_len
    nxt = next_turn_prompt(first, sent, answer, second, 512, salt=3)
    assert len(nxt) == second.prompt_len and nxt[:len(sent) + len(answer)] == sent + answer
    assert nxt[len(sent) + len(answer):] == fold_symbols(second.prompt_ids[len(sent) + len(answer):], 512, 16, 3)
    with pytest.raises(ValueError):
        next_turn_prompt(make_trace(TRACES["chat"], 1, 1.0)[0], sent, answer, second, 512)
