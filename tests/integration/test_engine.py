"""Engine end to end on real checkpoints: greedy parity with Hugging Face `transformers` under every
policy, chunked prefills, preemption; stop conditions, streaming and bad input."""

from __future__ import annotations

import json

import pytest
import torch

from chariot.worker import LLM, ConfigError, InvalidRequestError, ModelLoadError, SamplingParams
from chariot.worker.config import EngineConfig
from chariot.worker.engine import Engine
from chariot.worker.output_processor import OutputProcessor, run_step
from chariot.worker.warmup import WARMUP_QUERY_LENGTHS

MAX_NEW = 12
PROMPT_LENS = (1, 3, 17, 33, 70)
# Each of these crosses a 16-token block boundary while generating MAX_NEW tokens.
PREEMPT_LENS = (10, 12, 14, 15, 20, 30)


def make_prompts(vocab: int, lengths: tuple[int, ...]) -> list[list[int]]:
    gen = torch.Generator().manual_seed(1234)
    return [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in lengths]


def hf_greedy(model_dir, prompts: list[list[int]], max_new: int) -> list[list[int]]:
    """Independent reference: HF model, full recompute every step, plain argmax."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    outs = []
    with torch.no_grad():
        for prompt in prompts:
            ids = list(prompt)
            for _ in range(max_new):
                logits = model(input_ids=torch.tensor([ids])).logits[0, -1]
                ids.append(int(logits.argmax()))
            outs.append(ids[len(prompt):])
    return outs


@pytest.fixture(scope="module", params=["tiny", "small"])
def model_and_reference(request, tiny_model_dir, small_model_dir):
    model_dir = tiny_model_dir if request.param == "tiny" else small_model_dir
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    cases = {}
    for name, lengths in (("mixed", PROMPT_LENS), ("preempt", PREEMPT_LENS)):
        prompts = make_prompts(vocab, lengths)
        cases[name] = (prompts, hf_greedy(model_dir, prompts, MAX_NEW))
    return model_dir, cases


GREEDY = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)

POLICY_CASES = [
    ("sarathi", 16), ("sarathi", 64), ("sarathi", 128), ("sarathi", None),
    ("vllm", None), ("orca", None), ("fastertransformer", None),
]


@pytest.mark.parametrize(("policy", "budget"), POLICY_CASES)
def test_greedy_matches_transformers(model_and_reference, policy, budget):
    model_dir, cases = model_and_reference
    prompts, expected = cases["mixed"]
    llm = LLM(str(model_dir), policy=policy, token_budget=budget, dtype="float32", max_model_len=256,
              kv_cache_tokens=4096, progress=False)
    outs = llm.generate(prompts, GREEDY)
    assert [o.token_ids for o in outs] == expected
    assert llm.engine.blocks.num_free_blocks == llm.engine.blocks.num_blocks
    if budget == 16:
        assert llm.engine.iterations >= MAX_NEW + 4  # the 70-token prompt needed 5 chunks before its first token


@pytest.mark.parametrize("policy", ["sarathi", "vllm", "orca", "fastertransformer"])
def test_output_identical_after_forced_preemption(model_and_reference, policy):
    model_dir, cases = model_and_reference
    prompts, expected = cases["preempt"]
    # 9 blocks of 16 tokens: the six requests are admitted with 8 blocks and each needs one more to decode.
    llm = LLM(str(model_dir), policy=policy, token_budget=128 if policy == "sarathi" else None,
              dtype="float32", max_model_len=128, kv_cache_tokens=9 * 16, block_size=16, progress=False)
    outs = llm.generate(prompts, GREEDY)
    assert [o.token_ids for o in outs] == expected
    assert llm.engine.scheduler.num_preemptions > 0
    assert sum(o.num_preemptions for o in outs) > 0
    assert llm.engine.blocks.num_free_blocks == llm.engine.blocks.num_blocks


@pytest.fixture(scope="module")
def tiny_llm(tiny_model_dir):
    return LLM(str(tiny_model_dir), dtype="float32", max_model_len=256, kv_cache_tokens=2048, progress=False)


def test_streamed_deltas_and_timestamps(tiny_llm):
    engine = tiny_llm.engine
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    processor = OutputProcessor(engine.tokenizer)
    rid = engine.add_request("Hello world, this is", params)
    processor.add_request(rid, params)
    deltas, tokens, times, final = [], [], [], None
    while engine.has_unfinished:
        for out in run_step(engine, processor)[1]:
            assert out.request_id == rid and out.num_output_tokens == len(tokens) + len(out.new_token_ids)
            assert len(out.times.token_times) == len(out.new_token_ids)  # a delta carries its own tokens' times
            deltas.append(out.new_text)
            tokens += out.new_token_ids
            times += out.times.token_times
            final = out
    assert final is not None and final.finished and final.finish_reason.value == "length"
    assert len(tokens) == 10 and len(processor) == 0
    assert "".join(deltas) == tiny_llm.tokenizer.decode(tokens)
    assert tiny_llm.generate("Hello world, this is", params)[0].text == "".join(deltas)
    t = final.times
    assert t.arrival <= t.first_scheduled <= t.first_token == times[0] <= times[-1] <= t.finished
    assert len(times) == 10 and times == sorted(times)


def test_stop_token_and_stop_string(tiny_llm):
    base = tiny_llm.generate("Once upon a time", SamplingParams(max_tokens=16, temperature=0.0,
                                                                 ignore_eos=True))[0]
    stop_tok = base.token_ids[4]
    first = base.token_ids.index(stop_tok)
    out = tiny_llm.generate("Once upon a time", SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True,
                                                                stop_token_ids=[stop_tok]))[0]
    assert out.token_ids == base.token_ids[: first + 1] and out.finish_reason.value == "stop"

    text = base.text
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    assert stop.strip(), "random model produced whitespace only"
    out = tiny_llm.generate("Once upon a time", SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True,
                                                                stop=[stop]))[0]
    assert out.finish_reason.value == "stop"
    assert out.text == text[: text.index(stop)]
    assert stop not in out.text


def test_eos_stops_unless_ignored(tiny_model_dir):
    llm = LLM(str(tiny_model_dir), dtype="float32", max_model_len=256, kv_cache_tokens=2048, progress=False)
    base = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))[0]
    eos = base.token_ids[2]
    llm.engine.eos_token_ids = frozenset({eos})  # pretend the third generated token is EOS
    out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=8, temperature=0.0))[0]
    assert out.token_ids == base.token_ids[: base.token_ids.index(eos) + 1]
    assert out.finish_reason.value == "stop"
    out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))[0]
    assert out.token_ids == base.token_ids


def test_seeded_sampling_reproducible_across_batches(tiny_llm):
    p = SamplingParams(max_tokens=10, temperature=0.9, top_p=0.9, top_k=50, seed=42, ignore_eos=True)
    alone = tiny_llm.generate("A seeded prompt", p)[0].token_ids
    other = SamplingParams(max_tokens=7, temperature=1.0, ignore_eos=True)
    mixed = tiny_llm.generate(["Something else", "A seeded prompt", "x"], [other, p, other])[1].token_ids
    assert alone == mixed
    reseeded = tiny_llm.generate("A seeded prompt", SamplingParams(
        max_tokens=10, temperature=0.9, top_p=0.9, top_k=50, seed=43, ignore_eos=True))[0].token_ids
    assert reseeded != alone


def test_bad_requests_are_rejected_and_others_keep_running(tiny_llm):
    engine = tiny_llm.engine
    good = engine.add_request([1, 2, 3, 4], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
    engine.step()
    cases = [
        ("", SamplingParams(), "prompt"),
        ([], SamplingParams(), "prompt"),
        ([1] * 256, SamplingParams(), "prompt"),
        ([1] * 250, SamplingParams(max_tokens=10), "max_tokens"),
        ([1, 10**7], SamplingParams(), "prompt"),
        ([1, -1], SamplingParams(), "prompt"),
    ]
    blocks_before = engine.blocks.num_free_blocks
    for prompt, params, field in cases:
        with pytest.raises(InvalidRequestError) as info:
            engine.add_request(prompt, params)
        assert info.value.field == field
    with pytest.raises(InvalidRequestError, match="request_id"):
        engine.add_request([1, 2], request_id=good)
    assert engine.blocks.num_free_blocks == blocks_before
    with pytest.raises(InvalidRequestError, match="top_p"):
        SamplingParams(top_p=0.0)
    final = None
    while engine.has_unfinished:
        for out in engine.step().outputs:
            final = out
    assert final.request_id == good and final.finished and final.num_output_tokens == 6
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks


def test_abort_frees_blocks(tiny_llm):
    engine = tiny_llm.engine
    rids = [engine.add_request([1] * 40, SamplingParams(max_tokens=50, ignore_eos=True)) for _ in range(3)]
    for _ in range(3):
        engine.step()
    assert engine.blocks.num_free_blocks < engine.blocks.num_blocks
    for rid in rids:
        out = engine.abort(rid)
        assert out is not None and out.finished and out.finish_reason.value == "abort"
    assert not engine.has_unfinished
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks
    assert engine.abort("unknown") is None


def test_generate_validates_all_prompts_before_queueing(tiny_llm):
    with pytest.raises(InvalidRequestError):
        tiny_llm.generate(["fine", ""], SamplingParams(max_tokens=2))
    assert not tiny_llm.engine.has_unfinished


def test_bad_model_directories(tmp_path, tiny_model_dir):
    with pytest.raises(ModelLoadError, match="not found"):
        LLM(str(tmp_path / "missing"), progress=False)
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match="malformed JSON"):
        LLM(str(bad), progress=False)
    cfg = json.loads((tiny_model_dir / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match="unsupported architecture"):
        LLM(str(bad), progress=False)


def test_bad_engine_config(tiny_model_dir):
    with pytest.raises(ConfigError, match="policy"):
        EngineConfig(model=str(tiny_model_dir), policy="magic")
    with pytest.raises(ConfigError, match="token_budget"):
        Engine(EngineConfig(model=str(tiny_model_dir), policy="vllm", token_budget=16, max_model_len=64,
                            kv_cache_tokens=1024), progress=False)
    with pytest.raises(ConfigError, match="kv_cache_tokens"):
        Engine(EngineConfig(model=str(tiny_model_dir), max_model_len=256, kv_cache_tokens=64), progress=False)


# ---- logit processing and logprobs, against Hugging Face `transformers` ---------------------------


def hf_penalized_greedy(model_dir, prompt: list[int], max_new: int, frequency: float, presence: float,
                        bias: dict[int, float]) -> tuple[list[int], list[torch.Tensor]]:
    """Independent reference: HF logits, OpenAI's penalty formula over the whole vocabulary, argmax.
    Also returns each step's raw log-softmax (what `logprobs` reports)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids, logps = list(prompt), []
    with torch.no_grad():
        for _ in range(max_new):
            logits = model(input_ids=torch.tensor([ids])).logits[0, -1].double()
            logps.append(logits.log_softmax(-1))
            counts = torch.bincount(torch.tensor(ids[len(prompt):], dtype=torch.long), minlength=len(logits))
            adjusted = logits - frequency * counts - presence * (counts > 0)
            for token, value in bias.items():
                adjusted[token] += value
            ids.append(int(adjusted.argmax()))
    return ids[len(prompt):], logps


def test_penalties_bias_and_logprobs_match_transformers(tiny_model_dir):
    llm = LLM(str(tiny_model_dir), dtype="float32", max_model_len=256, kv_cache_tokens=2048, progress=False)
    prompt = [5, 6, 7, 8, 9]
    plain = llm.generate([prompt], SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True))[0]
    bias = {plain.token_ids[3]: -100.0, 11: 2.5}
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True, frequency_penalty=1.5,
                            presence_penalty=0.5, logit_bias=bias, logprobs=5)
    out = llm.generate([prompt], params)[0]
    want, logps = hf_penalized_greedy(tiny_model_dir, prompt, MAX_NEW, 1.5, 0.5, bias)
    assert out.token_ids == want
    assert out.token_ids != plain.token_ids  # the processing changed something
    assert len(out.logprobs) == MAX_NEW
    for lp, ref, token in zip(out.logprobs, logps, want, strict=True):
        assert lp.token_id == token and abs(lp.logprob - float(ref[token])) < 1e-4
        top = ref.topk(5)
        assert [t for t, _ in lp.top] == top.indices.tolist()
        assert max(abs(v - float(r)) for (_, v), r in zip(lp.top, top.values, strict=True)) < 1e-4


def test_min_tokens_holds_off_eos_stop_ids_and_stop_strings(tiny_llm):
    eos = next(iter(tiny_llm.engine.eos_token_ids))
    forced = SamplingParams(max_tokens=10, temperature=0.0, logit_bias={eos: 100})
    assert tiny_llm.generate([[5, 6, 7]], forced)[0].token_ids == [eos]
    out = tiny_llm.generate([[5, 6, 7]], SamplingParams(max_tokens=10, temperature=0.0, logit_bias={eos: 100},
                                                        min_tokens=4))[0]
    assert len(out.token_ids) == 5 and out.token_ids[-1] == eos and eos not in out.token_ids[:4]
    assert out.finish_reason.value == "stop"
    base = tiny_llm.generate("Once upon a time", SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))[0]
    words = [tiny_llm.tokenizer.decode([t]) for t in base.token_ids[:8]]
    stop = next((w for w in words if w.strip().isalpha() and base.text.count(w) == 1), None)
    assert stop is not None, f"no early token with a unique word to stop on in {base.text!r}"
    assert tiny_llm.generate("Once upon a time", SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True,
                                                                 stop=[stop]))[0].finish_reason.value == "stop"
    held = tiny_llm.generate("Once upon a time", SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True,
                                                                 stop=[stop], min_tokens=12))[0]
    assert held.token_ids == base.token_ids and held.finish_reason.value == "length"


def test_out_of_vocabulary_logit_bias_is_rejected(tiny_llm):
    vocab = tiny_llm.engine.model_config.vocab_size
    with pytest.raises(InvalidRequestError) as err:
        tiny_llm.generate([[1, 2]], SamplingParams(max_tokens=2, logit_bias={vocab: 1.0}))
    assert err.value.field == "logit_bias" and str(vocab) in str(err.value)
    assert not tiny_llm.engine.has_unfinished


def test_prefix_cache_hits_keep_greedy_outputs_identical_to_transformers(model_and_reference):
    """Prompts sharing a 33-token prefix (2 full blocks) with earlier ones, one a full-block hit that
    leaves a single token, one repeated whole: every output still matches HF, blocks are shared and
    all come back."""
    model_dir, cases = model_and_reference
    prompts, expected = cases["mixed"]
    base = prompts[3]  # 33 tokens
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    tails = make_prompts(vocab, (5, 1))
    later = [base + tails[0], base[:32] + tails[1], list(base)]
    llm = LLM(str(model_dir), dtype="float32", token_budget=16, max_model_len=256, kv_cache_tokens=4096,
              block_size=16, progress=False)
    first = llm.generate([base], GREEDY)
    assert first[0].token_ids == expected[3]
    outs = llm.generate(later, GREEDY)
    assert [o.token_ids for o in outs] == hf_greedy(model_dir, later, MAX_NEW)
    sched = llm.engine.scheduler
    assert sched.prefix_hit_tokens == 32 * 3  # two full blocks of each later prompt came from the cache
    assert first[0].num_cached_tokens == 0 and [o.num_cached_tokens for o in outs] == [32, 32, 32]
    assert llm.engine.stats().prefix_cache_hits == sched.prefix_hit_tokens
    assert llm.engine.blocks.num_free_blocks == llm.engine.blocks.num_blocks
    llm.engine.blocks.check_invariants()


def test_prefix_caching_off_computes_every_prompt(tiny_model_dir):
    llm = LLM(str(tiny_model_dir), dtype="float32", max_model_len=256, kv_cache_tokens=2048, progress=False,
              prefix_caching=False)
    prompt = list(range(3, 40))
    a, b = llm.generate([prompt, prompt], GREEDY), llm.generate([prompt], GREEDY)
    assert a[0].token_ids == a[1].token_ids == b[0].token_ids
    assert a[0].num_cached_tokens == a[1].num_cached_tokens == b[0].num_cached_tokens == 0
    assert llm.engine.scheduler.prefix_hit_tokens == 0 and llm.engine.blocks.num_cached_blocks == 0


class _FailingAttention:
    """Stands in for a GPU backend that cannot run (a Triton kernel without a compiler, a bad CUDA
    arch): no GPU here, so the failure is injected where the real one would surface."""

    name = "broken-gpu-kernel"

    def write_kv(self, *args, **kwargs):
        return None

    def paged_attention(self, *args, **kwargs):
        raise RuntimeError("failed to compile the launcher: no C compiler found")


def test_a_backend_that_cannot_run_fails_the_warm_up_before_ready(tiny_model_dir, monkeypatch):
    import chariot.kernels as kernels
    from chariot.worker.warmup import WarmupError

    monkeypatch.setattr(kernels, "_active", _FailingAttention())
    with pytest.raises(WarmupError, match=r"stage 0: warm-up forward pass failed \(attention backend "
                                          r"broken-gpu-kernel.*no C compiler found"):
        LLM(str(tiny_model_dir), dtype="float32", max_model_len=256, kv_cache_tokens=2048, progress=False)


def test_warm_up_runs_every_query_tile_decode_only_and_long_context_and_leaves_no_trace(tiny_model_dir, monkeypatch):
    import chariot.kernels as kernels

    real = kernels.active_backend()
    seen: list[tuple[int, int]] = []
    longest: list[int] = []

    class Recording:
        name = real.name

        def write_kv(self, *args):
            return real.write_kv(*args)

        def paged_attention(self, query, k_cache, v_cache, meta, scale):
            seen.append((meta.num_decodes, query.shape[0]))
            longest.append(int(meta.seq_lens.max()))
            return real.paged_attention(query, k_cache, v_cache, meta, scale)

    monkeypatch.setattr(kernels, "_active", Recording())
    llm = LLM(str(tiny_model_dir), dtype="float32", max_model_len=256, kv_cache_tokens=2048, progress=False)
    layers = json.loads((tiny_model_dir / "config.json").read_text())["num_hidden_layers"]
    block = llm.engine.blocks.block_size
    prefills = [block + 3, *WARMUP_QUERY_LENGTHS]  # each beside one decode
    # then the decode-only batch, then the decode over max_model_len - 1 cached positions
    assert seen == [(1, 1 + n) for n in prefills for _ in range(layers)] + [(1, 1)] * (2 * layers)
    assert longest[-layers:] == [256] * layers  # the long decode attends max_model_len positions
    assert llm.engine.iterations == 0 and llm.engine.blocks.num_free_blocks == llm.engine.blocks.num_blocks
