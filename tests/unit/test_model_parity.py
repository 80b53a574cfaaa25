"""Logits of `LlamaStage` against Hugging Face `transformers` on the same random checkpoints.

Covers every supported architecture variant (Llama untied, Mistral, Qwen2 with qkv bias and tied
embeddings, Llama-3 rope scaling) through three paths: one whole-prompt prefill; chunked prefill
followed by decode steps through a paged cache with a shuffled, non-contiguous block table; and a
pipeline split into separately loaded stages.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from chariot.kernels import AttentionMetadata
from chariot.worker.config import ModelConfig
from chariot.worker.model.cpu_linear import ALL_ROWS, SKINNY_ROWS_ENV, CpuLinear
from chariot.worker.model.llama import LlamaStage, allocate_kv_caches
from chariot.worker.model.loader import load_stage, split_layers

transformers = pytest.importorskip("transformers")

LLAMA3_SCALING = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 16,  # small, so the short test prompts reach scaled frequencies
}
VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    "tiny-llama": ("tiny", {}),
    "small-llama": ("small", {}),
    "tiny-mistral": ("tiny", {"arch": "mistral"}),
    "tiny-qwen2-tied": ("tiny", {"arch": "qwen2"}),
    "small-qwen2-untied": ("small", {"arch": "qwen2", "tie_word_embeddings": False}),
    "tiny-llama-tied": ("tiny", {"tie_word_embeddings": True}),
    "tiny-llama3-rope": ("tiny", {"rope_scaling": LLAMA3_SCALING}),
}
PROMPT_LEN, DECODE_STEPS, BLOCK_SIZE, NUM_BLOCKS = 45, 4, 8, 24
CHUNKS = (17, 11, 17)  # prefill chunk sizes; sum == PROMPT_LEN
LONG_CHUNKS = (100, 50)  # more rows than the panel kernel streams (64): its blocked order


def make_meta(block_table: list[int], start: int, num_tokens: int, block_size: int) -> AttentionMetadata:
    """Metadata for one sequence computing tokens [start, start + num_tokens)."""
    table = torch.tensor(block_table, dtype=torch.int32)
    pos = torch.arange(start, start + num_tokens)
    seq_len = start + num_tokens
    return AttentionMetadata(
        query_start_loc=torch.tensor([0, num_tokens], dtype=torch.int32),
        seq_lens=torch.tensor([seq_len], dtype=torch.int32),
        block_tables=table.view(1, -1),
        slot_mapping=table[pos // block_size].long() * block_size + pos % block_size,
        query_lens=(num_tokens,),
        seq_lens_list=(seq_len,),
        num_decodes=1 if num_tokens == 1 else 0,
    )


class Runner:
    """Feeds one sequence through a chain of stages, chunk by chunk, with a shuffled block table."""

    def __init__(self, stages: list[LlamaStage], seed: int = 0, dtype: torch.dtype = torch.float32,
                 tokens: int = 60) -> None:
        self.stages = stages
        gen = torch.Generator().manual_seed(seed)
        blocks = max(NUM_BLOCKS, -(-tokens // BLOCK_SIZE))
        self.block_table = torch.randperm(blocks, generator=gen)[: -(-tokens // BLOCK_SIZE)].tolist()
        self.caches = [allocate_kv_caches(s.config, len(s.layers), blocks, BLOCK_SIZE, dtype) for s in stages]
        self.done = 0

    @torch.no_grad()
    def feed(self, ids: torch.Tensor, rows: list[int] | None = None) -> torch.Tensor:
        """Logits for every position of `ids`, the next tokens of the sequence; with `rows`, the
        last stage runs its last layer over those rows alone and gives theirs only."""
        meta = make_meta(self.block_table, self.done, len(ids), BLOCK_SIZE)
        positions = torch.arange(self.done, self.done + len(ids))
        hidden = None
        kept = None if rows is None else torch.tensor(rows, dtype=torch.long)
        for stage, caches in zip(self.stages, self.caches, strict=True):
            hidden = stage(positions, caches, meta, input_ids=ids if stage.is_first else None, hidden_states=hidden,
                           sampled_rows=kept if stage.is_last else None)
        self.done += len(ids)
        assert hidden is not None
        return self.stages[-1].compute_logits(hidden)


@pytest.fixture(scope="module", params=list(VARIANTS))
def variant(request: pytest.FixtureRequest, model_factory: Any) -> tuple[Path, torch.Tensor, torch.Tensor]:
    """(checkpoint dir, token ids, HF reference logits for every position)."""
    preset, kwargs = VARIANTS[request.param]
    model_dir = model_factory(preset, **kwargs)
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    vocab = hf.config.vocab_size
    ids = torch.randint(0, vocab, (PROMPT_LEN + DECODE_STEPS,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf(ids[None]).logits[0].float()
    return model_dir, ids, ref


def assert_logits_close(ours: torch.Tensor, ref: torch.Tensor) -> None:
    assert ref.std() > 1.0, "random model logits too flat for a meaningful comparison"
    torch.testing.assert_close(ours, ref, atol=1e-4 * float(ref.abs().max()), rtol=0)


def full_stage(model_dir: Path, cpu_linears: bool = True) -> LlamaStage:
    """The whole model as one stage; on this CPU its linear layers are packed for oneDNN (the
    serving path) unless `cpu_linears` is False."""
    return load_stage(model_dir, (0, _num_layers(model_dir)), torch.float32, progress=False,
                      cpu_linears=cpu_linears)


def _num_layers(model_dir: Path) -> int:
    return ModelConfig.from_dir(model_dir).num_layers


def test_single_prefill_matches_hf(variant: tuple[Path, torch.Tensor, torch.Tensor]) -> None:
    model_dir, ids, ref = variant
    logits = Runner([full_stage(model_dir)]).feed(ids)
    assert logits.dtype == torch.float32
    assert_logits_close(logits, ref)


def test_chunked_prefill_and_decode_match_hf(variant: tuple[Path, torch.Tensor, torch.Tensor]) -> None:
    model_dir, ids, ref = variant
    runner = Runner([full_stage(model_dir)], seed=2)
    pieces, pos = [], 0
    for size in (*CHUNKS, *([1] * DECODE_STEPS)):
        pieces.append(runner.feed(ids[pos : pos + size]))
        pos += size
    assert_logits_close(torch.cat(pieces), ref)


@pytest.mark.parametrize("split", ["whole", "halves", "layer-per-stage"])
def test_sampled_rows_alone_match_hf(variant: tuple[Path, torch.Tensor, torch.Tensor], split: str) -> None:
    """The last layer run over the sampled rows only (the serving path's prompt chunks): those rows'
    logits match HF, in the order asked, and the rows skipped still left their k, v for later chunks
    and decodes. With one layer per stage the last stage's first layer is its last (no residual in)."""
    model_dir, ids, ref = variant
    num_layers = _num_layers(model_dir)
    ranges = split_layers(num_layers, {"whole": 1, "halves": 2, "layer-per-stage": num_layers}[split])
    runner = Runner([load_stage(model_dir, r, torch.float32, progress=False) for r in ranges], seed=6)
    pieces, wanted, pos = [], [], 0
    for size, rows in zip((*CHUNKS, *([1] * DECODE_STEPS)), ([16], [], [16, 3, 0], *([[0]] * DECODE_STEPS)),
                          strict=True):
        pieces.append(runner.feed(ids[pos : pos + size], rows))
        wanted += [pos + r for r in rows]
        pos += size
    assert pieces[1].shape[0] == 0  # a chunk that samples nothing runs no row of the last layer's MLP
    assert_logits_close(torch.cat(pieces), ref[wanted])


def test_a_middle_stage_refuses_sampled_rows(tiny_model_dir: Path) -> None:
    first = load_stage(tiny_model_dir, (0, 1), torch.float32, progress=False)
    caches = allocate_kv_caches(first.config, 1, NUM_BLOCKS, BLOCK_SIZE, torch.float32)
    with pytest.raises(ValueError, match="not the last stage"):
        first(torch.arange(3), caches, make_meta([0], 0, 3, BLOCK_SIZE), input_ids=torch.arange(3),
              sampled_rows=torch.tensor([2]))


@pytest.mark.parametrize("split", ["halves", "layer-per-stage"])
def test_pipeline_stages_match_hf(variant: tuple[Path, torch.Tensor, torch.Tensor], split: str) -> None:
    model_dir, ids, ref = variant
    num_layers = _num_layers(model_dir)
    ranges = split_layers(num_layers, 2 if split == "halves" else num_layers)
    stages = [load_stage(model_dir, r, torch.float32, progress=False) for r in ranges]
    assert stages[0].is_first and not stages[0].is_last
    assert stages[-1].is_last and not stages[-1].is_first
    runner = Runner(stages, seed=3)
    prefill = runner.feed(ids[:PROMPT_LEN])
    decode = torch.cat([runner.feed(ids[i : i + 1]) for i in range(PROMPT_LEN, len(ids))])
    assert_logits_close(torch.cat([prefill, decode]), ref)


def test_bfloat16_close_to_float32(tiny_model_dir: Path) -> None:
    ids = torch.randint(0, 512, (PROMPT_LEN,), generator=torch.Generator().manual_seed(4))
    ref = Runner([full_stage(tiny_model_dir)]).feed(ids)
    stage = load_stage(tiny_model_dir, (0, 2), torch.bfloat16, progress=False)
    logits = Runner([stage], dtype=torch.bfloat16).feed(ids)
    assert logits.dtype == torch.float32
    agree = (logits.argmax(-1) == ref.argmax(-1)).float().mean()
    assert agree > 0.8
    torch.testing.assert_close(logits, ref, atol=0.15 * float(ref.abs().max()), rtol=0)


def test_batched_sequences_match_separate_runs(small_model_dir: Path) -> None:
    """A decode and a prefill chunk of two sequences in one batch equal running them alone."""
    stage = full_stage(small_model_dir)
    gen = torch.Generator().manual_seed(5)
    ids_a, ids_b = torch.randint(0, 2048, (20,), generator=gen), torch.randint(0, 2048, (13,), generator=gen)
    alone_a, alone_b = Runner([stage]), Runner([stage])
    alone_a.feed(ids_a[:19])
    want = torch.cat([alone_a.feed(ids_a[19:]), alone_b.feed(ids_b)])

    caches = allocate_kv_caches(stage.config, len(stage.layers), NUM_BLOCKS, BLOCK_SIZE, torch.float32)
    table_a, table_b = [5, 1, 9], [7, 2]
    with torch.no_grad():
        stage(torch.arange(19), caches, make_meta(table_a, 0, 19, BLOCK_SIZE), input_ids=ids_a[:19])
        meta = _two_sequence_meta(table_a, table_b)
        positions = torch.cat([torch.tensor([19]), torch.arange(13)])
        hidden = stage(positions, caches, meta, input_ids=torch.cat([ids_a[19:], ids_b]))
        got = stage.compute_logits(hidden)
    torch.testing.assert_close(got, want, atol=1e-4 * float(want.abs().max()), rtol=0)


def _two_sequence_meta(table_a: list[int], table_b: list[int]) -> AttentionMetadata:
    a = make_meta(table_a, 19, 1, BLOCK_SIZE)
    b = make_meta(table_b, 0, 13, BLOCK_SIZE)
    tables = torch.zeros(2, 3, dtype=torch.int32)
    tables[0, :3], tables[1, :2] = torch.tensor(table_a), torch.tensor(table_b)
    return AttentionMetadata(
        query_start_loc=torch.tensor([0, 1, 14], dtype=torch.int32),
        seq_lens=torch.tensor([20, 13], dtype=torch.int32),
        block_tables=tables,
        slot_mapping=torch.cat([a.slot_mapping, b.slot_mapping]),
        query_lens=(1, 13),
        seq_lens_list=(20, 13),
        num_decodes=1,
    )


def test_unpacked_linears_match_hf(variant: tuple[Path, torch.Tensor, torch.Tensor]) -> None:
    """The plain `nn.Linear` path (other devices, or both CPU fast paths off) against HF too."""
    model_dir, ids, ref = variant
    stage = full_stage(model_dir, cpu_linears=False)
    assert not any(isinstance(m, CpuLinear) for m in stage.modules())
    packed = full_stage(model_dir)
    assert not any(isinstance(m, torch.nn.Linear) for m in packed.modules())
    # the default stages (every other test here) take decode rows through the panel kernel, and keep
    # oneDNN's copy unless the panels beat it at prefill size too
    assert all(m.skinny and (m.packed_weight is not None or m.skinny_max_rows == ALL_ROWS)
               for m in packed.modules() if isinstance(m, CpuLinear))
    runner = Runner([stage], seed=4)
    pieces, pos = [], 0
    for size in (*CHUNKS, *([1] * DECODE_STEPS)):
        pieces.append(runner.feed(ids[pos : pos + size]))
        pos += size
    assert_logits_close(torch.cat(pieces), ref)


@pytest.mark.parametrize("route", ["0", "all"])
@pytest.mark.parametrize("name", ["small-llama", "small-qwen2-untied"])
def test_each_cpu_linear_route_matches_hf_on_long_chunks(model_factory: Any, monkeypatch: pytest.MonkeyPatch,
                                                        route: str, name: str) -> None:
    """Every linear call forced to oneDNN (`0`) or to the panel kernel (`all`), in chunks long enough
    for the panel kernel's blocked order (Qwen2: with biases)."""
    monkeypatch.setenv(SKINNY_ROWS_ENV, route)
    preset, kwargs = VARIANTS[name]
    model_dir = model_factory(preset, **kwargs)
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    ids = torch.randint(0, hf.config.vocab_size, (sum(LONG_CHUNKS),), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        ref = hf(ids[None]).logits[0].float()
    stage = full_stage(model_dir)
    layers = [m for m in stage.modules() if isinstance(m, CpuLinear)]
    assert layers and all(m.skinny_max_rows == (0 if route == "0" else ALL_ROWS) for m in layers)
    runner = Runner([stage], seed=7, tokens=sum(LONG_CHUNKS))
    assert_logits_close(torch.cat([runner.feed(ids[:LONG_CHUNKS[0]]), runner.feed(ids[LONG_CHUNKS[0]:])]), ref)
