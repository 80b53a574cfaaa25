"""The output processor on the tiny model's real tokenizer: text deltas, stop strings with hold-back,
flushes, and agreement with the text the engine produced before detokenization moved out of it."""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Iterable
from pathlib import Path

import pytest

from chariot.contracts.outputs import CompletionOutput, RequestOutput
from chariot.contracts.requests import FinishReason, RequestTimes
from chariot.contracts.sampling_params import SamplingParams
from chariot.contracts.tokenizer import IncrementalDetokenizer, Tokenizer
from chariot.worker.engine_output import EngineOutput, StepResult
from chariot.worker.output_processor import OutputProcessor, forming_stop_len, run_step

TEXT = "Hello world, this is a test of stop strings."
RID = "r"


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path) -> Tokenizer:
    return Tokenizer(tiny_model_dir)


def engine_outputs(tokens: list[int], max_tokens: int | None = None, stop_token_ids: Iterable[int] = (),
                   rid: str = RID) -> list[EngineOutput]:
    """What the engine emits for `tokens`, one per step, with its own (token id / length) finishes."""
    limit = max_tokens or len(tokens)
    times, outs = RequestTimes(arrival=0.0), []
    for i, token in enumerate(tokens[:limit]):
        times.token_times.append(1.0 + i)  # as the engine does: each output carries its own token's time
        stop = token in set(stop_token_ids)
        reason = FinishReason.STOP if stop else FinishReason.LENGTH if i + 1 == limit else None
        outs.append(EngineOutput(rid, (token,), i + 1, reason, [1, 2], times.latest(1), token if stop else None))
        if reason is not None:
            break
    return outs


def run(tokenizer: Tokenizer, outs: list[EngineOutput], stop: tuple[str, ...] = ()
        ) -> tuple[list[RequestOutput], list[tuple[str, ...]]]:
    """Feed the engine outputs one step at a time until the request finishes."""
    proc = OutputProcessor(tokenizer)
    proc.add_request(outs[0].request_id, SamplingParams(stop=stop))
    results, stops = [], []
    for out in outs:
        processed = proc.process([out])
        results += processed.outputs
        stops.append(processed.stop_request_ids)
        if results[-1].finished:
            break
    assert results[-1].finished and len(proc) == 0
    return results, stops


def pieces(tokenizer: Tokenizer, tokens: list[int]) -> list[str]:
    detok = IncrementalDetokenizer(tokenizer)
    return [detok.step(t) for t in tokens]


def joined(results: list[RequestOutput]) -> str:
    return "".join(r.new_text for r in results)


def test_no_stop_strings_streams_each_token_at_once(tokenizer: Tokenizer) -> None:
    tokens = tokenizer.encode(TEXT, add_special_tokens=False)
    results, stops = run(tokenizer, engine_outputs(tokens))
    assert [r.new_text for r in results] == pieces(tokenizer, tokens)
    assert [t for r in results for t in r.new_token_ids] == tokens
    assert [r.num_output_tokens for r in results] == list(range(1, len(tokens) + 1))
    assert joined(results) == TEXT and results[-1].finish_reason is FinishReason.LENGTH
    assert not any(stops)


def test_stop_string_across_token_boundary(tokenizer: Tokenizer) -> None:
    tokens = tokenizer.encode(TEXT, add_special_tokens=False)
    ps = pieces(tokenizer, tokens)
    k = ps.index(" is")  # "this" + " is": stop "s i" spans two tokens
    results, stops = run(tokenizer, engine_outputs(tokens), stop=("s i",))
    assert len(results) == k + 1  # finished on the token that completed the stop string
    assert joined(results) == TEXT[: TEXT.index("s i")] == "Hello world, thi"
    last = results[-1]
    assert last.finished and last.finish_reason is FinishReason.STOP and last.num_output_tokens == k + 1
    assert last.times.finished is not None
    assert stops[-1] == (RID,) and not any(stops[:-1])  # the engine is told to finish it, once


def test_forming_stop_string_is_held_back_then_released(tokenizer: Tokenizer) -> None:
    tokens = tokenizer.encode(TEXT, add_special_tokens=False)
    ps = pieces(tokenizer, tokens)
    k = ps.index(" wor")
    results, _ = run(tokenizer, engine_outputs(tokens), stop=("worm",))
    assert results[k].new_text == " "  # "wor" may still become "worm"
    assert results[k + 1].new_text == "world"  # it did not: released with the next token's text
    assert joined(results) == TEXT and results[-1].finish_reason is FinishReason.LENGTH


def test_earliest_of_several_stop_strings_wins(tokenizer: Tokenizer) -> None:
    tokens = tokenizer.encode(TEXT, add_special_tokens=False)
    results, _ = run(tokenizer, engine_outputs(tokens), stop=("strings", "test", "a t"))
    assert joined(results) == "Hello world, this is "
    assert results[-1].num_output_tokens == pieces(tokenizer, tokens).index(" t") + 1
    # two stop strings completed by the same token: the text ends before the earlier one
    results, _ = run(tokenizer, engine_outputs(tokens), stop=("ld", "orld"))
    assert joined(results) == "Hello w" and results[-1].finish_reason is FinishReason.STOP


def test_stop_string_in_the_very_first_token(tokenizer: Tokenizer) -> None:
    tokens = tokenizer.encode(TEXT, add_special_tokens=False)
    (only,), stops = run(tokenizer, engine_outputs(tokens), stop=("H",))
    assert (only.new_text, only.new_token_ids, only.num_output_tokens) == ("", tokens[:1], 1)
    assert only.finish_reason is FinishReason.STOP and stops == [(RID,)]


def test_length_finish_flushes_a_cut_multibyte_character(tokenizer: Tokenizer) -> None:
    tokens = tokenizer.encode("你好", add_special_tokens=False)
    assert len(tokens) > 2 and pieces(tokenizer, tokens)[0] == ""  # "你" takes several byte tokens
    (first,), _ = run(tokenizer, engine_outputs(tokens, max_tokens=1))
    assert first.finish_reason is FinishReason.LENGTH
    assert first.new_text == tokenizer.decode(tokens[:1]) and "\ufffd" in first.new_text
    results, _ = run(tokenizer, engine_outputs(tokens, max_tokens=2), stop=("x",))
    assert results[0].new_text == "" and joined(results) == tokenizer.decode(tokens[:2])


def test_eos_and_stop_token_ids_are_not_text(tokenizer: Tokenizer) -> None:
    tokens = tokenizer.encode(TEXT, add_special_tokens=False)
    stop_tok = tokens[4]  # " wor"
    results, stops = run(tokenizer, engine_outputs(tokens, stop_token_ids=[stop_tok]), stop=("zz",))
    assert joined(results) == "Hello" and results[-1].new_token_ids == [stop_tok]
    assert results[-1].finish_reason is FinishReason.STOP and not any(stops)  # the engine finished it


def test_engine_length_and_stop_string_on_the_same_token_is_stop(tokenizer: Tokenizer) -> None:
    tokens = tokenizer.encode(TEXT, add_special_tokens=False)
    results, stops = run(tokenizer, engine_outputs(tokens, max_tokens=5), stop=("wor",))
    assert joined(results) == "Hello " and results[-1].finish_reason is FinishReason.STOP
    assert not any(stops)  # already finished in the engine


def test_outputs_of_untracked_requests_are_dropped(tokenizer: Tokenizer) -> None:
    proc = OutputProcessor(tokenizer)
    assert proc.process(engine_outputs([45, 74], rid="nobody")).outputs == ()
    proc.add_request(RID, SamplingParams())
    with pytest.raises(ValueError):
        proc.add_request(RID, SamplingParams())
    abort = EngineOutput(RID, (), 0, FinishReason.ABORT, [1], RequestTimes(0.0))
    (out,) = proc.process([abort, abort]).outputs  # the second is after the finish: dropped
    assert out.finished and out.finish_reason is FinishReason.ABORT and out.new_text == ""


def test_completion_output_adds_deltas_up(tokenizer: Tokenizer) -> None:
    tokens = tokenizer.encode(TEXT, add_special_tokens=False)
    results, _ = run(tokenizer, engine_outputs(tokens), stop=("stop",))
    assert [r.times.token_times for r in results] == [[1.0 + i] for i in range(len(results))]  # O(1) per delta
    assert all(r.num_prompt_tokens == 2 for r in results)
    whole = CompletionOutput.from_deltas(results, [1, 2])
    assert (whole.text, whole.token_ids) == (TEXT[: TEXT.index("stop")], tokens[: len(results)])
    assert whole.finished and whole.finish_reason is FinishReason.STOP and whole.prompt_token_ids == [1, 2]
    assert whole.times.token_times == [1.0 + i for i in range(len(results))]


def test_cached_tokens_are_reported_on_the_last_delta_only(tokenizer: Tokenizer) -> None:
    """The engine's count rides on every engine output; the request's deltas carry it once, on the
    last one, whether the engine or a stop string finished it."""
    tokens = tokenizer.encode(TEXT, add_special_tokens=False)
    for stop in ((), ("stop",)):
        outs = [dataclasses.replace(o, num_cached_tokens=16) for o in engine_outputs(tokens)]
        results, _ = run(tokenizer, outs, stop=stop)
        assert [r.num_cached_tokens for r in results] == [0] * (len(results) - 1) + [16]
        assert CompletionOutput.from_deltas(results, [1, 2]).num_cached_tokens == 16


def test_forming_stop_len() -> None:
    assert forming_stop_len("abc", ("cde",)) == 1
    assert forming_stop_len("abcd", ("bcdx", "dz")) == 3
    assert forming_stop_len("xab", ("abc",)) == 2
    assert forming_stop_len("abc", ("abc",)) == 0  # a whole stop string is a match, not a forming one
    assert forming_stop_len("xyz", ("abc",)) == 0


class _FakeEngine:
    """`step` replays engine outputs; `finish_requests` records what it was asked to finish."""

    def __init__(self, outs: list[EngineOutput], stats: object) -> None:
        self._outs, self._stats = list(outs), stats
        self.finished: list[tuple[list[str], FinishReason]] = []

    def step(self) -> StepResult:
        return StepResult((self._outs.pop(0),), None, None, self._stats)  # type: ignore[arg-type]

    def finish_requests(self, request_ids: Iterable[str], reason: FinishReason) -> tuple[EngineOutput, ...]:
        self.finished.append((list(request_ids), reason))
        return ()


def test_run_step_hands_stop_string_finishes_back_to_the_engine(tokenizer: Tokenizer) -> None:
    tokens = tokenizer.encode(TEXT, add_special_tokens=False)
    engine = _FakeEngine(engine_outputs(tokens), stats=None)
    proc = OutputProcessor(tokenizer)
    proc.add_request(RID, SamplingParams(stop=("wor",)))
    while len(proc):
        run_step(engine, proc)
    assert engine.finished == [([RID], FinishReason.STOP)]


# ---- agreement with the engine's text before the split ---------------------------------------------
def old_engine_text(tokenizer: Tokenizer, tokens: list[int], stop: tuple[str, ...], stop_ids: set[int],
                    ) -> tuple[str, int, FinishReason]:
    """The text, token count and finish reason the engine produced when it detokenized itself
    (the removed `Engine._stop_reason` / `_truncate_at_stop` / `_finish` / `_snapshot`)."""
    detok, text, streamed = IncrementalDetokenizer(tokenizer), "", ""
    emitted = 0
    for i, token in enumerate(tokens):
        reason = None
        if token in stop_ids:
            reason = FinishReason.STOP
        else:
            before = len(text)
            text += detok.step(token)
            longest = max((len(s) for s in stop), default=0)
            hits = [j for s in stop if (j := text.find(s, max(0, before - longest + 1))) >= 0]
            if hits:
                text, reason = text[: min(hits)], FinishReason.STOP
            elif i + 1 == len(tokens):
                reason = FinishReason.LENGTH
                text += detok.flush()
        end = len(text)
        if reason is None and stop:
            end -= max(len(s) for s in stop) - 1
        end = max(end, emitted)
        streamed += text[emitted:end]
        emitted = end
        if reason is not None:
            assert streamed == text
            return text, i + 1, reason
    raise AssertionError("unreachable: the last token finishes by length")


@pytest.mark.parametrize("seed", range(40))
def test_deltas_concatenate_to_the_old_engine_text(tokenizer: Tokenizer, seed: int) -> None:
    rng = random.Random(seed)
    words = ["Hello", " world", ",", " this", " is", " 你好", " é", " stop", " st", "op", "\n", " a"]
    tokens = tokenizer.encode("".join(rng.choices(words, k=12)), add_special_tokens=False)
    tokens += [rng.randrange(3, tokenizer.vocab_size) for _ in range(rng.randrange(0, 8))]
    text = tokenizer.decode(tokens)
    stop: tuple[str, ...] = ()
    if seed % 4 and len(text) > 4:
        starts = [rng.randrange(len(text) - 2) for _ in range(rng.randrange(1, 4))]
        stop = tuple(dict.fromkeys(text[a : a + rng.randrange(1, 4)] or "x" for a in starts))
        stop += ("never there",) if seed % 3 == 0 else ()
    stop_ids = {tokens[len(tokens) // 2]} if seed % 5 == 0 else set()
    expected_text, n, reason = old_engine_text(tokenizer, tokens, stop, stop_ids)

    results, _ = run(tokenizer, engine_outputs(tokens, stop_token_ids=stop_ids), stop=stop)
    assert joined(results) == expected_text
    assert results[-1].finish_reason is reason and results[-1].num_output_tokens == n
    assert [t for r in results for t in r.new_token_ids] == tokens[:n]
