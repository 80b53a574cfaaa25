"""Workload traces as in the Sarathi-Serve paper (§5): Poisson arrivals, request lengths drawn to
match a dataset's medians, scaled down so CPU runs finish.

Lengths are lognormal around the published medians (openchat_sharegpt4: prompt 1730 / decode
415 tokens; arxiv_summarization: prompt 7059 / decode ~200), clipped to [min, cap]. Everything is
deterministic per seed.

Those traces give lengths only (the replay fills prompts with random tokens). The multi-turn trace
(`multiturn`, a spec with `multi_turn` set) gives token ids too, because what it measures is shared
prefixes: conversations whose every turn resends the whole history (the tenant's system prompt, the
earlier questions and answers) plus a new question, one after another with think time between them.
Its ids are vocabulary-free symbols; the replay folds them into the model's vocabulary
(`fold_symbols`), which keeps equal prefixes equal.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass

SYMBOLS = 1 << 20
"""Multi-turn token ids are symbols in [0, SYMBOLS), folded into a model's vocabulary by the replay."""


@dataclass(frozen=True)
class MultiTurn:
    """How a multi-turn trace's conversations are shaped (lengths in tokens before `scale`).

    Each tenant has one system prompt (lognormal around `system_prompt`) that begins every one of its
    conversations; a conversation belongs to a tenant drawn uniformly and has `min_turns` to
    `max_turns` turns (uniform). A turn's new question and its answer are lognormal around the spec's
    `median_prompt` and `median_decode`. Turn k+1 arrives a think time (lognormal around `think_s`,
    not scaled) after turn k arrived: the replay is open loop and does not wait for the answer, so the
    think time should exceed a turn's latency for the history to be cached when it comes back.
    """

    tenants: int = 4
    system_prompt: int = 1024
    sigma_system: float = 0.3
    min_turns: int = 2
    max_turns: int = 6
    think_s: float = 10.0
    sigma_think: float = 0.5

    @property
    def mean_turns(self) -> float:
        return (self.min_turns + self.max_turns) / 2


@dataclass(frozen=True)
class TraceSpec:
    """Lognormal lengths around `median_prompt` / `median_decode`; with `multi_turn`, conversations
    whose prompts grow by turn, `median_prompt` then being a turn's new question, not its whole prompt."""

    name: str
    median_prompt: int
    median_decode: int
    sigma_prompt: float
    sigma_decode: float
    multi_turn: MultiTurn | None = None


TRACES = {
    "chat": TraceSpec("chat", 1730, 415, 0.9, 0.9),
    "arxiv": TraceSpec("arxiv", 7059, 200, 0.5, 0.5),
    # Questions shorter than chat's prompts (those include their history), answers as long as chat's.
    "multiturn": TraceSpec("multiturn", 256, 415, 0.9, 0.9, MultiTurn()),
}


@dataclass(frozen=True)
class TraceRequest:
    """One request. `prompt_ids` (symbols, see `fold_symbols`) is set where the trace defines the
    prompt's contents, None where only its length matters; `session` names the conversation
    (`tenant<i>/conv<j>`) and `turn` counts from 0 within it."""

    arrival_s: float
    prompt_len: int
    decode_len: int
    prompt_ids: tuple[int, ...] | None = None
    session: str | None = None
    turn: int = 0


def make_trace(
    spec: TraceSpec, num_requests: int, qps: float | None, seed: int = 0, scale: float = 1.0,
    max_len: int | None = None,
) -> list[TraceRequest]:
    """`num_requests` requests; arrivals Poisson at `qps` (all at t=0 when qps is None).

    Lengths are multiplied by `scale`; prompt + decode is capped at `max_len` by shortening the
    prompt first (keeping at least one prompt token). A multi-turn spec: see `multi_turn_trace`."""
    if num_requests < 0 or (qps is not None and qps <= 0) or scale <= 0:
        raise ValueError("num_requests must be >= 0, qps and scale > 0")
    if spec.multi_turn is not None:
        return multi_turn_trace(spec, num_requests, qps, seed=seed, scale=scale, max_len=max_len)
    rng = random.Random(seed)
    t = 0.0
    out = []
    for _ in range(num_requests):
        if qps is not None:
            t += rng.expovariate(qps)
        prompt = _draw(rng, spec.median_prompt * scale, spec.sigma_prompt)
        decode = _draw(rng, spec.median_decode * scale, spec.sigma_decode)
        if max_len is not None and prompt + decode > max_len:
            decode = min(decode, max_len - 1)
            prompt = max(1, max_len - decode)
        out.append(TraceRequest(t, prompt, decode))
    return out


def multi_turn_trace(
    spec: TraceSpec, num_requests: int, qps: float | None, seed: int = 0, scale: float = 1.0,
    max_len: int | None = None,
) -> list[TraceRequest]:
    """`num_requests` turns of conversations (see `MultiTurn`), sorted by arrival.

    Conversations start as a Poisson process at `qps / mean_turns`, so turns arrive at about `qps` in
    the long run (all conversations start at t=0 when qps is None). Turn k's prompt is turn k−1's
    prompt + its answer + a new question; the answers are the trace's own symbols, standing in for
    what the model says. Every prompt + decode fits `max_len`: a system prompt takes at most half of
    it, a first turn too long is shortened (answer first), and a conversation whose next turn would
    not fit ends there.

    Content (tokens, lengths, think times) depends only on the seed, the scale and `max_len`; `qps`
    only stretches the conversations' start times (∝ 1/qps), not the think times.
    """
    mt = spec.multi_turn
    if mt is None:
        raise ValueError(f"trace {spec.name!r} is not multi-turn")
    if num_requests < 0 or (qps is not None and qps <= 0) or scale <= 0:
        raise ValueError("num_requests must be >= 0, qps and scale > 0")
    if mt.tenants < 1 or not 1 <= mt.min_turns <= mt.max_turns or mt.think_s <= 0:
        raise ValueError("need tenants >= 1, 1 <= min_turns <= max_turns and think_s > 0")
    if max_len is not None and max_len < 2:
        raise ValueError(f"max_len must be >= 2, got {max_len}")
    content = random.Random(f"multiturn-content-{seed}")  # str seeds: stable across processes
    starts = random.Random(f"multiturn-starts-{seed}")
    thinks = random.Random(f"multiturn-think-{seed}")
    cap = max_len if max_len is not None else math.inf
    systems = []
    for _ in range(mt.tenants):
        length = _draw(content, mt.system_prompt * scale, mt.sigma_system)
        if max_len is not None:
            length = max(0, min(length, max_len // 2, max_len - 2))
        systems.append(_symbols(content, length))
    out: list[TraceRequest] = []
    start = 0.0
    conversation = 0
    while len(out) < num_requests:
        if qps is not None:
            start += starts.expovariate(1.0) * mt.mean_turns / qps
        tenant = content.randrange(mt.tenants)
        turns = content.randint(mt.min_turns, mt.max_turns)
        session = f"tenant{tenant}/conv{conversation}"
        history, arrival = systems[tenant], start
        for turn in range(turns):
            if len(out) == num_requests:
                break
            question = _draw(content, spec.median_prompt * scale, spec.sigma_prompt)
            answer = _draw(content, spec.median_decode * scale, spec.sigma_decode)
            if turn > 0:
                arrival += math.exp(thinks.gauss(math.log(mt.think_s), mt.sigma_think))
            if len(history) + question + answer > cap:
                if turn > 0:
                    break  # the conversation has filled its context
                answer = min(answer, max(1, (int(cap) - len(history)) // 2))
                question = max(1, min(question, int(cap) - len(history) - answer))
            prompt = history + _symbols(content, question)
            out.append(TraceRequest(arrival, len(prompt), answer, prompt, session, turn))
            history = prompt + _symbols(content, answer)
        conversation += 1
    out.sort(key=lambda r: r.arrival_s)  # stable: ties keep the order they were made in
    return out


def fold_symbols(symbols: Sequence[int], vocab_size: int, low: int = 0, salt: int = 0) -> list[int]:
    """Token ids in [low, vocab_size) for trace symbols; equal symbol prefixes give equal id prefixes.

    `salt` shifts every id (modulo the span): replays with salts that differ modulo the span share no
    token at any position, so no prefix cached by one serves another, while lengths stay the same."""
    if vocab_size <= low:
        raise ValueError(f"vocab_size {vocab_size} leaves no ids at or above {low}")
    span = vocab_size - low
    return [low + (s + salt) % span for s in symbols]


def _symbols(rng: random.Random, n: int) -> tuple[int, ...]:
    return tuple(rng.randrange(SYMBOLS) for _ in range(n))


def _draw(rng: random.Random, median: float, sigma: float) -> int:
    return max(1, round(math.exp(rng.gauss(math.log(median), sigma))))
