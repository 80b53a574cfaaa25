"""Sampler semantics: greedy exactness, top-k/top-p sets, temperature, seeded reproducibility
independent of batch composition, and that draws follow the (filtered) softmax distribution.

Statistical tests use fixed seeds and generous bounds, so they are deterministic and not flaky.
"""

from __future__ import annotations

import math

import pytest
import torch

from chariot.contracts.sampling_params import SamplingParams
from chariot.worker.sampler import (
    LogitAdjustments,
    Sampler,
    SamplerOutput,
    SamplingBatch,
    SamplingColumns,
    apply_top_k_top_p,
    row_seed,
)

GREEDY = SamplingParams(temperature=0.0)
PLAIN = SamplingParams(temperature=1.0)


def _logits(n: int, vocab: int, seed: int = 0, scale: float = 3.0) -> torch.Tensor:
    return torch.randn(n, vocab, generator=torch.Generator().manual_seed(seed)) * scale


def _sample(
    logits: torch.Tensor, params: list[SamplingParams], steps: list[int] | None = None, seed: int = 0
) -> torch.Tensor:
    batch = SamplingBatch.from_params(params, steps or [0] * len(params), device="cpu")
    return Sampler(seed)(logits, batch).token_ids


def _counts(tokens: torch.Tensor, vocab: int) -> torch.Tensor:
    return torch.bincount(tokens, minlength=vocab).double()


def _chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson statistic over the tokens with nonzero expected probability."""
    expected = probs.double() * counts.sum()
    keep = expected > 0
    assert counts[~keep].sum() == 0, "a token with probability 0 was sampled"
    return float(((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum())


def _draws(probs_logits: torch.Tensor, params: SamplingParams, n: int, seed: int = 0) -> torch.Tensor:
    """`n` independent draws from one row of logits, as one batch of identical rows."""
    return _sample(probs_logits.expand(n, -1).contiguous(), [params] * n, seed=seed)


# --- greedy --------------------------------------------------------------------------------------


def test_all_greedy_is_argmax() -> None:
    logits = _logits(7, 50)
    out = _sample(logits, [GREEDY] * 7)
    assert out.dtype == torch.long
    assert torch.equal(out, logits.argmax(dim=-1))


def test_greedy_rows_exact_in_mixed_batch() -> None:
    logits = _logits(6, 300)
    params = [GREEDY, PLAIN, SamplingParams(temperature=0.7, top_k=5), GREEDY,
              SamplingParams(temperature=1.3, top_p=0.5, seed=4), GREEDY]
    for seed in range(5):
        out = _sample(logits, params, seed=seed)
        for i in (0, 3, 5):
            assert int(out[i]) == int(logits[i].argmax())


def test_top_k_one_equals_greedy() -> None:
    logits = _logits(16, 1000)
    out = _sample(logits, [SamplingParams(temperature=1.0, top_k=1)] * 16, seed=3)
    assert torch.equal(out, logits.argmax(dim=-1))


def test_tiny_temperature_is_greedy_and_finite() -> None:
    logits = _logits(4, 100)
    out = _sample(logits, [SamplingParams(temperature=1e-30)] * 4)
    assert torch.equal(out, logits.argmax(dim=-1))


def test_empty_batch() -> None:
    assert _sample(torch.empty(0, 10), []).shape == (0,)


# --- top-k / top-p ---------------------------------------------------------------------------------


def _fixed_probs_logits(probs: list[float]) -> torch.Tensor:
    return torch.tensor(probs).log()


def test_top_p_keeps_only_the_nucleus() -> None:
    # Sorted probs 0.4, 0.25, 0.15, 0.1, 0.06, 0.04 (shuffled in vocab order).
    probs = [0.1, 0.4, 0.04, 0.25, 0.06, 0.15]
    logits = _fixed_probs_logits(probs)
    # Mass before each rank: 0, 0.4, 0.65, 0.8, 0.9, 0.96 → top_p=0.7 keeps the first three.
    tokens = _draws(logits, SamplingParams(temperature=1.0, top_p=0.7), 20_000)
    counts = _counts(tokens, 6)
    nucleus = torch.tensor([0.0, 0.4, 0.0, 0.25, 0.0, 0.15]) / 0.8
    assert set(tokens.unique().tolist()) == {1, 3, 5}
    assert _chi_square(counts, nucleus) < 30  # df = 2


def test_top_p_always_keeps_top_token() -> None:
    logits = _fixed_probs_logits([0.2, 0.5, 0.3])
    tokens = _draws(logits, SamplingParams(temperature=1.0, top_p=0.01), 500)
    assert set(tokens.tolist()) == {1}


def test_top_k_keeps_only_the_k_most_likely() -> None:
    logits = _logits(1, 200, seed=5)[0]
    top3 = set(logits.topk(3).indices.tolist())
    tokens = _draws(logits, SamplingParams(temperature=5.0, top_k=3), 5_000)
    assert set(tokens.unique().tolist()) == top3


def test_top_k_larger_than_vocab_is_off() -> None:
    logits = torch.zeros(1, 4)
    filtered = apply_top_k_top_p(logits, torch.tensor([10]), torch.tensor([1.0]))
    assert torch.equal(filtered, logits)


def test_top_k_then_top_p_on_renormalised_mass() -> None:
    logits = _fixed_probs_logits([0.3, 0.3, 0.2, 0.2])
    # top_k=2 leaves {0, 1} at 0.5 each; top_p=0.4 then keeps only the first of them.
    filtered = apply_top_k_top_p(logits.unsqueeze(0), torch.tensor([2]), torch.tensor([0.4]))
    assert torch.isfinite(filtered).sum() == 1


def test_filter_rows_are_independent() -> None:
    logits = _logits(3, 50)
    filtered = apply_top_k_top_p(logits, torch.tensor([0, 5, 0]), torch.tensor([1.0, 1.0, 0.3]))
    assert torch.equal(filtered[0], logits[0])
    assert int(torch.isfinite(filtered[1]).sum()) == 5
    assert 1 <= int(torch.isfinite(filtered[2]).sum()) < 50


# --- temperature ------------------------------------------------------------------------------------


def test_temperature_sharpens_and_flattens() -> None:
    logits = _fixed_probs_logits([0.5, 0.3, 0.2])
    n = 6_000
    cold = _counts(_draws(logits, SamplingParams(temperature=0.2), n), 3) / n
    warm = _counts(_draws(logits, SamplingParams(temperature=1.0), n), 3) / n
    hot = _counts(_draws(logits, SamplingParams(temperature=50.0), n), 3) / n
    assert cold[0] > 0.9 > warm[0]
    assert abs(warm[0] - 0.5) < 0.05
    assert (hot - 1 / 3).abs().max() < 0.05


@pytest.mark.parametrize("temperature", [0.5, 2.0])
def test_temperature_distribution(temperature: float) -> None:
    logits = _logits(1, 8, seed=2, scale=1.0)[0]
    tokens = _draws(logits, SamplingParams(temperature=temperature), 20_000, seed=1)
    assert _chi_square(_counts(tokens, 8), (logits / temperature).softmax(-1)) < 40  # df = 7


# --- seeds ----------------------------------------------------------------------------------------------


def test_seeded_row_independent_of_batch_and_position() -> None:
    vocab = 5000
    target = torch.zeros(vocab)  # uniform: the token is decided by the noise alone
    seeded = SamplingParams(temperature=1.0, seed=1234)
    others = _logits(5, vocab, seed=9)
    alone = _sample(target.unsqueeze(0), [seeded], steps=[7], seed=0)
    batch_a = torch.stack([target, others[0], others[1]])
    a = _sample(batch_a, [seeded, PLAIN, GREEDY], steps=[7, 0, 3], seed=1)
    batch_b = torch.stack([others[2], others[3], others[4], target])
    params_b = [SamplingParams(top_k=3), SamplingParams(seed=5), SamplingParams(top_p=0.2), seeded]
    b = _sample(batch_b, params_b, steps=[1, 2, 3, 7], seed=2)
    assert int(alone[0]) == int(a[0]) == int(b[3])


def test_seeded_row_same_with_filtering_path() -> None:
    """Whether or not other rows force the sort path, a seeded row's token is the same."""
    logits = _logits(2, 3000, seed=4, scale=0.1)
    seeded = SamplingParams(temperature=0.9, seed=77)
    plain_path = _sample(logits, [seeded, PLAIN], steps=[3, 0])
    sort_path = _sample(logits, [seeded, SamplingParams(top_k=10)], steps=[3, 0])
    assert int(plain_path[0]) == int(sort_path[0])


def test_seeded_rows_differ_by_step_and_seed() -> None:
    target = torch.zeros(1, 5000)
    by_step = {int(_sample(target, [SamplingParams(seed=42)], steps=[s])[0]) for s in range(20)}
    by_seed = {int(_sample(target, [SamplingParams(seed=s)], steps=[0])[0]) for s in range(20)}
    assert len(by_step) > 15 and len(by_seed) > 15


def test_seeded_sampling_follows_distribution() -> None:
    """Across many (seed, step) pairs the seeded noise is a fair Exp(1) race."""
    logits = _logits(1, 6, seed=3, scale=1.0)[0]
    n = 6_000
    params = [SamplingParams(seed=s) for s in range(n)]
    tokens = _sample(logits.expand(n, -1).contiguous(), params, steps=list(range(n)))
    assert _chi_square(_counts(tokens, 6), logits.softmax(-1)) < 35  # df = 5


@pytest.mark.gpu
def test_seeded_reproducible_on_cuda() -> None:
    target = torch.zeros(5000, device="cuda")
    seeded = SamplingParams(seed=99)
    others = _logits(2, 5000).cuda()
    batch_a = SamplingBatch.from_params([seeded], [4], device="cuda")
    batch_b = SamplingBatch.from_params([PLAIN, GREEDY, seeded], [0, 0, 4], device="cuda")
    a = Sampler(0)(target.unsqueeze(0), batch_a).token_ids
    b = Sampler(1)(torch.cat([others, target.unsqueeze(0)]), batch_b).token_ids
    assert a.device.type == "cuda" and int(a[0]) == int(b[2])
    assert int(b[1]) == int(others[1].argmax())


def test_row_seed_is_63_bit_and_distinct() -> None:
    seeds = {row_seed(s, t) for s in (0, 1, (1 << 63) - 1) for t in range(100)}
    assert len(seeds) == 300
    assert all(0 <= s < (1 << 63) for s in seeds)


# --- unseeded -------------------------------------------------------------------------------------------


def test_unseeded_depends_on_sampler_seed() -> None:
    logits = torch.zeros(64, 1000)
    params = [PLAIN] * 64
    assert torch.equal(_sample(logits, params, seed=1), _sample(logits, params, seed=1))
    assert not torch.equal(_sample(logits, params, seed=1), _sample(logits, params, seed=2))


def test_unseeded_sampler_advances_between_calls() -> None:
    sampler = Sampler(0)
    batch = SamplingBatch.from_params([PLAIN] * 32, [0] * 32)
    logits = torch.zeros(32, 1000)
    assert not torch.equal(sampler(logits, batch).token_ids, sampler(logits, batch).token_ids)


@pytest.mark.parametrize(
    "params",
    [SamplingParams(), SamplingParams(top_k=20), SamplingParams(top_p=0.999), SamplingParams(seed=1)],
    ids=["plain", "top_k_off_effectively", "top_p_near_one", "seeded"],
)
def test_distribution_matches_softmax(params: SamplingParams) -> None:
    logits = _logits(1, 10, seed=11, scale=1.5)[0]
    n = 20_000
    if params.seed is None:
        tokens = _draws(logits, params, n, seed=5)
    else:
        rows = logits.expand(n, -1).contiguous()
        tokens = _sample(rows, [SamplingParams(seed=s) for s in range(n)], steps=[0] * n)
    probs = logits.softmax(-1)
    if params.top_p < 1.0:  # 0.999 may drop a tail token of mass < 0.001: compare on the kept set
        keep = apply_top_k_top_p(logits.unsqueeze(0), torch.tensor([0]), torch.tensor([params.top_p]))[0]
        probs = keep.softmax(-1)
    assert _chi_square(_counts(tokens, 10), probs) < 45  # df = 9, p ≈ 1e-6


# --- SamplingBatch --------------------------------------------------------------------------------------


def test_from_params_fields() -> None:
    params = [GREEDY, SamplingParams(temperature=0.5, top_k=4, top_p=0.9, seed=3), PLAIN]
    batch = SamplingBatch.from_params(params, [0, 5, 2])
    assert batch.sample_rows == (1, 2) and batch.filter_rows == (1,) and not batch.all_greedy
    assert batch.top_k_bound == 4 and batch.filter_index.tolist() == [0]
    assert batch.seeds == (None, 3, None) and batch.steps == (0, 5, 2)
    assert batch.temperatures.tolist() == [0.0, 0.5, 1.0]
    assert batch.top_ks.dtype == torch.int64 and batch.top_ks.tolist() == [0, 4, 0]
    assert math.isclose(batch.top_ps[1].item(), 0.9, rel_tol=1e-6)


def test_greedy_rows_do_not_trigger_sorting() -> None:
    batch = SamplingBatch.from_params([SamplingParams(temperature=0.0, top_k=5), PLAIN], [0, 0])
    assert batch.filter_rows == ()


def test_top_p_without_top_k_needs_full_sort() -> None:
    params = [SamplingParams(top_k=3), SamplingParams(top_p=0.5), PLAIN]
    batch = SamplingBatch.from_params(params, [0, 0, 0])
    assert batch.filter_rows == (0, 1) and batch.top_k_bound is None
    both = [params[0], SamplingParams(top_k=9, top_p=0.5)]
    assert SamplingBatch.from_params(both, [0, 0]).top_k_bound == 9


@pytest.mark.parametrize("top_p", [1.0, 0.6, 0.05])
def test_top_k_bound_matches_full_sort(top_p: float) -> None:
    logits = _logits(5, 400, seed=8, scale=1.0)
    ks = torch.tensor([1, 7, 30, 30, 12])
    ps = torch.full((5,), top_p)
    full = apply_top_k_top_p(logits, ks, ps)
    bounded = apply_top_k_top_p(logits, ks, ps, k_bound=30)
    assert torch.equal(full, bounded)
    assert torch.equal(torch.isfinite(full).sum(-1) <= ks, torch.ones(5, dtype=torch.bool))


def test_unfiltered_rows_untouched_by_filtered_neighbours() -> None:
    """A plain row next to top-k rows still samples from its whole distribution."""
    logits = torch.zeros(400, 4)
    params = [SamplingParams(top_k=1) if i % 2 else PLAIN for i in range(400)]
    out = _sample(logits, params)
    assert set(out[0::2].tolist()) == {0, 1, 2, 3}


def test_from_params_rejects_mismatch() -> None:
    with pytest.raises(ValueError, match="steps"):
        SamplingBatch.from_params([PLAIN], [0, 1])
    with pytest.raises(ValueError, match=">= 0"):
        SamplingBatch.from_params([PLAIN], [-1])


def test_logits_shape_mismatch_raises() -> None:
    with pytest.raises(ValueError, match="rows"):
        _sample(torch.zeros(3, 10), [PLAIN] * 2)


def test_huge_temperature_stays_finite() -> None:
    logits = _logits(200, 4)
    params = [SamplingParams(temperature=float(10**300))] * 200
    out = _sample(logits, params)
    assert out.min() >= 0 and out.max() < 4
    assert len(out.unique()) == 4  # effectively uniform


# ---- logit adjustments (logit_bias, penalties, min_tokens) and logprobs ----------------------------


def _run(logits: torch.Tensor, params: list[SamplingParams], outputs: list[list[int]], eos: tuple[int, ...] = (),
         seed: int = 0) -> SamplerOutput:
    adjust = LogitAdjustments.for_rows(list(zip(params, outputs, strict=True)), eos)
    cols = SamplingColumns.from_params(params, [len(o) for o in outputs], adjust)
    return Sampler(seed)(logits.clone(), SamplingBatch.from_columns(cols))


def _reference_adjusted(logits: torch.Tensor, p: SamplingParams, output: list[int],
                        eos: tuple[int, ...]) -> torch.Tensor:
    """OpenAI's documented formula, written out per token: the oracle for the sparse adjustments."""
    out = logits.clone()
    for token in range(logits.shape[-1]):
        count = output.count(token)
        out[token] -= count * p.frequency_penalty + (count > 0) * p.presence_penalty
        out[token] += dict(p.logit_bias).get(token, 0.0)
        if len(output) < p.min_tokens and (token in p.stop_token_ids or (token in eos and not p.ignore_eos)):
            out[token] = float("-inf")
    return out


def test_adjustments_match_the_documented_formula_for_every_token() -> None:
    logits = _logits(3, 40, seed=5)
    params = [SamplingParams(frequency_penalty=0.7, presence_penalty=-0.3, logit_bias={3: 5.0, 9: -100}),
              SamplingParams(min_tokens=4, stop_token_ids=[11], logit_bias={"2": 1.5}),
              SamplingParams(min_tokens=4, ignore_eos=True, presence_penalty=2.0)]
    outputs = [[1, 1, 1, 3, 7], [5, 5], [0, 0, 2]]
    adjust = LogitAdjustments.for_rows(list(zip(params, outputs, strict=True)), (0,))
    got = adjust.apply(logits.clone())
    for row in range(3):
        want = _reference_adjusted(logits[row], params[row], outputs[row], (0,))
        assert torch.allclose(got[row], want, equal_nan=False), row


def test_a_large_logit_bias_forces_its_token_greedy_and_sampled() -> None:
    logits = _logits(4, 64, seed=1)
    top3 = int(logits[3].argmax())
    params = [SamplingParams(temperature=0.0, logit_bias={17: 100}),
              SamplingParams(temperature=1.0, logit_bias={17: 100}), SamplingParams(temperature=0.0),
              SamplingParams(temperature=0.0, logit_bias={top3: -100})]
    tokens = _run(logits, params, [[], [], [], []]).token_ids.tolist()
    assert tokens[0] == tokens[1] == 17
    assert tokens[2] == int(logits[2].argmax())  # rows without adjustments are untouched
    assert tokens[3] != int(logits[3].argmax())


def test_frequency_penalty_steers_greedy_away_from_repeats() -> None:
    logits = torch.zeros(1, 8)
    logits[0, 4], logits[0, 5] = 3.0, 2.0
    assert _run(logits, [SamplingParams(temperature=0.0, frequency_penalty=0.4)], [[4, 4]]).token_ids.item() == 4
    assert _run(logits, [SamplingParams(temperature=0.0, frequency_penalty=0.6)], [[4, 4]]).token_ids.item() == 5
    assert _run(logits, [SamplingParams(temperature=0.0, presence_penalty=1.5)], [[4]]).token_ids.item() == 5


def test_min_tokens_bans_eos_and_stop_ids_only_until_reached() -> None:
    logits = torch.zeros(2, 8)
    logits[:, 2] = 50.0  # EOS by far the likeliest
    logits[:, 6] = 40.0  # then the request's stop token
    params = SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[6])
    tokens = _run(logits, [params, params], [[1], [1, 1]], eos=(2,)).token_ids.tolist()
    assert tokens[0] not in (2, 6)  # one token so far: neither EOS nor the stop token may come
    assert tokens[1] == 2  # two so far: EOS is allowed again


def test_logprobs_are_the_raw_log_softmax_with_the_top_alternatives() -> None:
    logits = _logits(3, 50, seed=9)
    params = [SamplingParams(temperature=0.0, logprobs=3), SamplingParams(temperature=0.7, seed=4, logprobs=0,
                                                                          logit_bias={8: 30}),
              SamplingParams(temperature=0.0)]
    out = _run(logits, params, [[], [], []])
    rows = [out.logprobs_of(i, k) for i, k in enumerate([3, 0, None])]
    ref = torch.log_softmax(logits.double(), dim=-1)
    first = rows[0]
    assert first is not None and first.token_id == int(logits[0].argmax())
    assert abs(first.logprob - float(ref[0, first.token_id])) < 1e-5
    top = ref[0].topk(3)
    assert [t for t, _ in first.top] == top.indices.tolist()
    assert all(abs(lp - float(v)) < 1e-5 for (_, lp), v in zip(first.top, top.values, strict=True))
    second = rows[1]
    assert second is not None and second.token_id == 8 and second.top == ()
    assert abs(second.logprob - float(ref[1, 8])) < 1e-5  # raw: before the bias that forced it
    assert rows[2] is None


def test_batches_without_logprobs_return_none() -> None:
    out = _run(_logits(2, 10), [GREEDY, PLAIN], [[], []])
    assert out.logprobs is None and out.top_ids is None and out.logprobs_of(0, 3) is None
