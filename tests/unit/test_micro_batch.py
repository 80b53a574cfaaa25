"""The packed micro-batch built by `InputBuilder` and decoded by `decode_batch`: the vectorised paths
(block tables gathered in one pass, decode token ids, sampling rows kept per request, sampling
tensors as views of the payload) give what the per-row definitions say."""

from __future__ import annotations

import torch

from chariot.contracts.sampling_params import SamplingParams
from chariot.worker.block_manager import BlockManager
from chariot.worker.executor import InputBuilder
from chariot.worker.micro_batch import decode_batch
from chariot.worker.sampler import SamplingBatch
from chariot.worker.scheduler.output import ScheduledChunk, SchedulerOutput
from chariot.worker.sequence import Sequence

BLOCK = 4
CPU = torch.device("cpu")
PARAMS = (
    SamplingParams(temperature=0.0),
    SamplingParams(temperature=0.8, top_k=5, seed=7, logprobs=2),
    SamplingParams(temperature=1e40, top_p=0.9),
    SamplingParams(temperature=1e-7, seed=3),
)


def _sequences(blocks: BlockManager, extra_tokens: int = 0) -> dict[int, Sequence]:
    """Four sequences with 5, 9, 2 and 13 prompt tokens, each with one output token, and blocks for
    all of them (plus `extra_tokens` more)."""
    seqs = {}
    for sid, (length, params) in enumerate(zip((5, 9, 2, 13), PARAMS, strict=True)):
        seq = Sequence(sid, f"r{sid}", [10 * sid + i for i in range(length)], params)
        seq.output_token_ids.append(100 + sid)
        seq.num_computed_tokens = seq.num_tokens - 1
        blocks.allocate(sid, seq.num_tokens + extra_tokens)
        seqs[sid] = seq
    return seqs


def _decode_batch(seqs: dict[int, Sequence]) -> SchedulerOutput:
    chunks = tuple(ScheduledChunk(s.seq_id, s.num_tokens - 1, 1, True) for s in seqs.values())
    return SchedulerOutput(chunks, (), len(chunks))


def test_decode_rows_take_each_sequence_newest_token_and_its_blocks() -> None:
    blocks = BlockManager(64, BLOCK, watermark=0.0)
    seqs = _sequences(blocks, extra_tokens=3 * BLOCK)  # tables longer than this step needs
    inp = decode_batch(InputBuilder(blocks).build(_decode_batch(seqs), seqs), CPU, with_sampling=True,
                       split_horizon=4096)
    assert inp.attn.split_horizon == 4096  # laid out as the graphs' decodes are
    assert inp.input_ids.tolist() == [100, 101, 102, 103]
    assert inp.positions.tolist() == [s.num_tokens - 1 for s in seqs.values()]
    assert inp.attn.query_lens == (1, 1, 1, 1)
    assert inp.attn.seq_lens_list == tuple(s.num_tokens for s in seqs.values())
    width = -(-max(s.num_tokens for s in seqs.values()) // BLOCK)
    expected = [(blocks.block_table(sid) + [0] * width)[:width] for sid in seqs]
    assert inp.attn.block_tables.tolist() == expected
    slots = [blocks.block_table(s.seq_id)[(s.num_tokens - 1) // BLOCK] * BLOCK + (s.num_tokens - 1) % BLOCK
             for s in seqs.values()]
    assert inp.attn.slot_mapping.tolist() == slots


def test_mixed_batch_slices_prefill_tokens_after_the_decodes() -> None:
    blocks = BlockManager(64, BLOCK, watermark=0.0)
    seqs = _sequences(blocks)
    prompt = Sequence(9, "p", list(range(50, 61)), SamplingParams(temperature=0.0))
    blocks.allocate(9, prompt.num_tokens)
    seqs[9] = prompt
    chunks = (ScheduledChunk(1, seqs[1].num_tokens - 1, 1, True), ScheduledChunk(9, 3, 5, False))
    mb = InputBuilder(blocks).build(SchedulerOutput(chunks, (), 1), seqs)
    inp = decode_batch(mb, CPU, with_sampling=True, split_horizon=4096)
    assert inp.attn.split_horizon == 0  # a prefill chunk takes the varlen launch: no split layout
    assert inp.input_ids.tolist() == [101, 53, 54, 55, 56, 57]
    assert inp.attn.query_lens == (1, 5)
    assert inp.sample_indices.tolist() == [0]
    assert inp.sampling is not None and inp.sampling.num_rows == 1


def test_sampling_batch_from_the_payload_equals_the_one_built_from_params() -> None:
    blocks = BlockManager(64, BLOCK, watermark=0.0)
    seqs = _sequences(blocks)
    builder = InputBuilder(blocks)
    for _ in range(2):  # the second build reads the kept request rows
        got = decode_batch(builder.build(_decode_batch(seqs), seqs), CPU, with_sampling=True).sampling
        want = SamplingBatch.from_params(PARAMS, [1] * len(PARAMS), CPU)
        assert got is not None
        for name in ("temperatures", "top_ks", "top_ps", "sample_index", "filter_index"):
            a, b = getattr(got, name), getattr(want, name)
            assert a.dtype == b.dtype and torch.equal(a, b), name
        for name in ("columns", "sample_rows", "filter_rows", "top_k_bound"):
            assert getattr(got, name) == getattr(want, name), name


def test_all_greedy_rows_need_no_sample_index() -> None:
    blocks = BlockManager(64, BLOCK, watermark=0.0)
    seqs = {sid: Sequence(sid, f"g{sid}", [1, 2, 3], SamplingParams(temperature=0.0)) for sid in range(3)}
    for seq in seqs.values():
        seq.num_computed_tokens = 2
        blocks.allocate(seq.seq_id, 3)
    sampling = decode_batch(InputBuilder(blocks).build(_decode_batch(seqs), seqs), CPU, True).sampling
    assert sampling is not None and sampling.all_greedy
    assert sampling.seeds == (None, None, None) and sampling.columns.logprob_width is None
    assert sampling.sample_index.numel() == 0
