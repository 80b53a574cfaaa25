"""The detokenisation-placement benchmark on the tiny checkpoint: both loops produce the same tokens,
only the text-making one produces text, and the summary compares the two placements."""

from __future__ import annotations

from pathlib import Path

from chariot.bench.detok_placement import Round, run_round, summary, tokens_only
from chariot.contracts.sampling_params import SamplingParams
from chariot.worker.config import EngineConfig
from chariot.worker.engine import Engine


def test_token_only_deltas_keep_everything_but_the_text(tiny_model_dir: Path) -> None:
    engine = Engine(EngineConfig(model=str(tiny_model_dir), dtype="float32", max_model_len=64), progress=False)
    try:
        engine.add_request([5, 6, 7], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True), request_id="a")
        outs = [o for _ in range(3) for o in tokens_only(engine.step().outputs)]
    finally:
        engine.shutdown()
    assert [len(o.new_token_ids) for o in outs] == [1, 1, 1] and all(o.new_text == "" for o in outs)
    assert [o.num_output_tokens for o in outs] == [1, 2, 3] and outs[-1].finished
    assert all(o.num_prompt_tokens == 3 and len(o.times.token_times) == 1 for o in outs)


def test_rounds_time_decode_steps_of_both_placements(tiny_model_dir: Path) -> None:
    engine = Engine(EngineConfig(model=str(tiny_model_dir), dtype="float32", max_model_len=64), progress=False)
    try:
        rounds = [run_round(engine, placement, 0, streams=3, tokens=5, prompt_len=4)
                  for placement in ("text", "tokens")]
    finally:
        engine.shutdown()
    for r in rounds:
        assert r.steps == 4  # 5 tokens: the first comes from the prefill step, four decode steps follow
        assert r.loop_ms_median >= r.step_ms_median > 0 and r.process_ms_median > 0
    result = summary(rounds)
    assert result["text_over_tokens"] == rounds[0].loop_ms_median / rounds[1].loop_ms_median
    assert 0 < result["text_share_of_loop"] < 1


def test_summary_takes_medians_over_rounds() -> None:
    rounds = [Round("text", i, 10, 9.0, 1.0 + i, 10.0 + i) for i in range(3)]
    rounds += [Round("tokens", i, 10, 9.0, 0.5, 9.5 + 2 * i) for i in range(3)]
    result = summary(rounds)
    assert (result["loop_ms_text"], result["loop_ms_tokens"]) == (11.0, 11.5)
    assert result["text_share_of_loop"] == 2.0 / 11.0
