"""The decode graph runner (`chariot.worker.graph_runner`) on the CPU: bucket choice, static buffers
filled in place, padded rows kept out of every real KV block, and a padded decode giving the same
hidden states as the unpadded eager one. Capture itself needs CUDA (the `gpu` test at the end)."""

from __future__ import annotations

import importlib
import itertools
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from types import ModuleType

import pytest
import torch

from chariot.contracts.errors import ConfigError
from chariot.contracts.sampling_params import SamplingParams
from chariot.kernels import AttentionMetadata, reference
from chariot.worker.block_manager import BlockManager
from chariot.worker.config import EngineConfig, ResolvedConfig
from chariot.worker.executor import InputBuilder, ModelRunner
from chariot.worker.graph_runner import (
    GRAPH_POOL_SLACK_BYTES,
    DecodeBuffers,
    DecodeGraphRunner,
    GraphMode,
    GraphPlan,
    PadTarget,
    batch_buckets,
    bucket_for,
    capture_problem,
    choose_mode,
    graph_pool_bytes,
)
from chariot.worker.micro_batch import ModelInput
from chariot.worker.runtime import StageRuntime, build_stage_runtime
from chariot.worker.scheduler.output import ScheduledChunk, SchedulerOutput
from chariot.worker.sequence import Sequence

SENTINEL = 0.5


# --- buckets and modes (pure) ------------------------------------------------------------------


def test_buckets_go_up_in_sixteens_after_32_and_end_at_the_batch_limit() -> None:
    assert batch_buckets(128) == (1, 2, 4, 8, 16, 24, 32, 48, 64, 80, 96, 112, 128)
    assert batch_buckets(40) == (1, 2, 4, 8, 16, 24, 32, 40)
    assert batch_buckets(5) == (1, 2, 4, 5)
    assert batch_buckets(1) == (1,)


@pytest.mark.parametrize("bad", [0, -3, True, 2.0])
def test_buckets_reject_a_bad_batch_limit(bad: object) -> None:
    with pytest.raises(ValueError, match="max_batch_size must be a positive integer"):
        batch_buckets(bad)  # type: ignore[arg-type]


def test_a_batch_takes_the_smallest_bucket_that_holds_it() -> None:
    buckets = batch_buckets(128)
    assert [bucket_for(n, buckets) for n in (1, 3, 5, 24, 25, 33, 127, 128)] == [1, 4, 8, 24, 32, 48, 128, 128]
    assert bucket_for(0, buckets) is None
    assert bucket_for(129, buckets) is None


def test_mode_follows_the_setting_and_what_the_machine_can_capture() -> None:
    def never_asked() -> str:
        raise AssertionError("the backend is asked only on CUDA")

    cpu = capture_problem("cpu", never_asked, 1)
    assert cpu is not None and "not CUDA" in cpu
    assert [choose_mode(s, cpu) for s in ("auto", "on", "off")] == [GraphMode.OFF, GraphMode.EAGER, GraphMode.OFF]
    assert capture_problem("cuda", lambda: "triton", 1) is None
    assert [choose_mode(s, None) for s in ("auto", "on", "off")] == [GraphMode.CAPTURE, GraphMode.CAPTURE,
                                                                     GraphMode.OFF]
    reference = capture_problem("cuda", lambda: "reference", 1)
    assert reference is not None and "'reference'" in reference
    tensor_parallel = capture_problem("cuda", lambda: "triton", 2)
    assert tensor_parallel is not None and "tensor-parallel" in tensor_parallel


def test_a_plan_rejects_unordered_buckets_and_empty_lengths() -> None:
    with pytest.raises(ValueError, match=r"GraphPlan\.buckets"):
        GraphPlan(GraphMode.EAGER, (4, 2), 128, 16, torch.float32)
    with pytest.raises(ValueError, match=r"GraphPlan\.max_model_len"):
        GraphPlan(GraphMode.EAGER, (1, 2), 0, 16, torch.float32)


def test_the_setting_is_validated_by_name() -> None:
    with pytest.raises(ConfigError) as err:
        EngineConfig(model="m", cuda_graphs="sometimes")
    assert err.value.field == "cuda_graphs"
    assert "auto, on, off" in str(err.value)


def test_graph_pool_is_reserved_only_when_capturing(tiny_model_dir: Path) -> None:
    resolved = ResolvedConfig.resolve(EngineConfig(model=str(tiny_model_dir), dtype="float32"))
    plan = GraphPlan(GraphMode.CAPTURE, batch_buckets(128), 256, 16, torch.float32)
    small = GraphPlan(GraphMode.CAPTURE, batch_buckets(8), 256, 16, torch.float32)
    eager = GraphPlan(GraphMode.EAGER, batch_buckets(128), 256, 16, torch.float32)
    assert graph_pool_bytes(eager, resolved.model) == 0
    assert graph_pool_bytes(plan, resolved.model) > graph_pool_bytes(small, resolved.model) > GRAPH_POOL_SLACK_BYTES


# --- static buffers ------------------------------------------------------------------------------


def decode_input(rows: list[tuple[int, int, list[int]]], width: int) -> ModelInput:
    """A decode-only ModelInput of (token, seq_len, block table) rows (tables padded to `width`)."""
    n = len(rows)
    tables = torch.zeros(n, width, dtype=torch.int32)
    for i, (_, _, table) in enumerate(rows):
        tables[i, : len(table)] = torch.tensor(table, dtype=torch.int32)
    seq_lens = [length for _, length, _ in rows]
    positions = torch.tensor([length - 1 for length in seq_lens])
    slots = torch.tensor([table[(length - 1) // 16] * 16 + (length - 1) % 16 for _, length, table in rows])
    attn = AttentionMetadata(torch.arange(n + 1, dtype=torch.int32), torch.tensor(seq_lens, dtype=torch.int32),
                             tables, slots, (1,) * n, tuple(seq_lens), n)
    return ModelInput(torch.tensor([token for token, _, _ in rows]), positions, attn, torch.arange(n), None)


def test_buffers_are_filled_in_place_and_emptied_rows_become_padding() -> None:
    pad = PadTarget(block=9, block_size=16)
    buffers = DecodeBuffers(rows=8, table_width=4, pad=pad, device=torch.device("cpu"))
    tensors = [buffers.input_ids, buffers.positions, buffers.slot_mapping, buffers.seq_lens, buffers.block_tables]
    addresses = [t.data_ptr() for t in tensors]

    buffers.fill(decode_input([(5, 20, [3, 4]), (6, 3, [1]), (7, 40, [2, 5, 6])], width=3))
    assert buffers.input_ids[:3].tolist() == [5, 6, 7]
    assert buffers.slot_mapping[:4].tolist() == [4 * 16 + 3, 16 + 2, 6 * 16 + 7, pad.slot]
    assert buffers.block_tables[2, :3].tolist() == [2, 5, 6]

    buffers.fill(decode_input([(8, 2, [7])], width=1))
    assert [t.data_ptr() for t in tensors] == addresses
    assert buffers.input_ids.tolist() == [8] + [0] * 7
    assert buffers.positions.tolist() == [1] + [0] * 7
    assert buffers.slot_mapping.tolist() == [7 * 16 + 1] + [pad.slot] * 7
    assert buffers.seq_lens.tolist() == [2] + [1] * 7
    assert (buffers.block_tables[1:] == pad.block).all()
    meta = buffers.metadata(2, (2, 1))
    assert meta.query_lens == (1, 1) and meta.num_decodes == 2
    assert meta.query_start_loc.tolist() == [0, 1, 2]


def test_buffers_refuse_a_batch_past_their_size() -> None:
    buffers = DecodeBuffers(rows=2, table_width=1, pad=PadTarget(9, 16), device=torch.device("cpu"))
    with pytest.raises(ValueError, match="does not fit the static buffers"):
        buffers.fill(decode_input([(5, 20, [3, 4])], width=2))


# --- graph-safe attention metadata ------------------------------------------------------------------


@pytest.fixture(scope="module")
def triton_attention() -> ModuleType:
    """The Triton backend, interpreted without a GPU (tests/conftest.py sets TRITON_INTERPRET=1 first)."""
    module = importlib.import_module("chariot.kernels.triton_attention")
    if not torch.cuda.is_available() and not module._INTERPRETED:
        module = importlib.reload(module)
    if module._MIXED_MODES:
        pytest.fail("triton was imported before TRITON_INTERPRET=1 was set; the interpreter cannot run the kernels")
    return module


@pytest.mark.parametrize("max_model_len", [128, 2048])  # one varlen launch; split-KV over 16 splits
def test_capture_metadata_gives_every_real_row_its_attention(triton_attention: ModuleType,
                                                             max_model_len: int) -> None:
    """Metadata whose host lists claim `max_model_len` for every row (what a graph is captured with)
    gives the real rows of a padded batch the attention the reference computes unpadded: the kernels
    read each length on the device, and the NaN-filled cache shows any read outside a row's context."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator().manual_seed(3)
    block_size, kv_heads, heads, head_dim, scratch = 16, 2, 4, 16, 12
    shape = (scratch + 1, block_size, kv_heads, head_dim)
    k_cache, v_cache = (torch.full(shape, float("nan")) for _ in range(2))
    lengths, tables = (20, 3, 33), ([4, 7], [0], [9, 2, 5])
    for length, table in zip(lengths, tables, strict=True):
        for pos in range(length):
            k_cache[table[pos // block_size], pos % block_size] = torch.randn(kv_heads, head_dim, generator=gen)
            v_cache[table[pos // block_size], pos % block_size] = torch.randn(kv_heads, head_dim, generator=gen)
    k_cache[scratch, 0], v_cache[scratch, 0] = torch.randn(2, kv_heads, head_dim, generator=gen)  # the pad's K/V
    k_cache, v_cache = k_cache.to(device), v_cache.to(device)
    query = torch.randn(4, heads, head_dim, generator=gen).to(device)

    rows = [(1, length, table) for length, table in zip(lengths, tables, strict=True)]
    real = decode_input(rows, width=3)
    want = reference.paged_attention(query[:3].cpu(), k_cache.cpu(), v_cache.cpu(), real.attn, 0.25)
    assert triton_attention.decode_splits(1, 4, kv_heads, max_model_len, 64) == (16 if max_model_len > 128 else 1)
    width = -(-max_model_len // block_size)
    buffers = DecodeBuffers(rows=8, table_width=width, pad=PadTarget(scratch, block_size), device=torch.device(device))
    buffers.fill(_on(real, device))
    got = triton_attention.paged_attention(query, k_cache, v_cache, buffers.metadata(4, (max_model_len,) * 4), 0.25)
    torch.testing.assert_close(got[:3].cpu(), want, rtol=1e-4, atol=1e-4)
    assert torch.isfinite(got[3]).all()  # the padded row attended to the scratch slot only


def test_an_eager_decode_splits_as_its_bucket_is_captured(triton_attention: ModuleType) -> None:
    """Graphs on or off, a decode gives the same bits: an unpadded batch whose metadata carries the
    graphs' `split_horizon` runs the split-KV launch its bucket was captured with, so each real row
    sums its context in the same order as in the padded, captured-style launch."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator().manual_seed(5)
    block_size, kv_heads, heads, head_dim, scratch, horizon = 16, 2, 4, 16, 12, 2048
    shape = (scratch + 1, block_size, kv_heads, head_dim)
    k_cache, v_cache = (torch.randn(shape, generator=gen).to(device) for _ in range(2))
    lengths, tables = (20, 3, 33), ([4, 7], [0], [9, 2, 5])
    query = torch.randn(4, heads, head_dim, generator=gen).to(device)
    real = decode_input([(1, n, t) for n, t in zip(lengths, tables, strict=True)], width=3)
    # Without the horizon the unpadded batch would take the single varlen launch, not the bucket's 16 splits.
    assert triton_attention.decode_splits(1, 3, kv_heads, max(lengths), 64) == 1
    assert triton_attention.decode_splits(1, 3, kv_heads, horizon, 64) == 16
    buffers = DecodeBuffers(rows=8, table_width=horizon // block_size, pad=PadTarget(scratch, block_size),
                            device=torch.device(device))
    buffers.fill(_on(real, device))
    captured = triton_attention.paged_attention(query, k_cache, v_cache,
                                                buffers.metadata(4, (horizon,) * 4, horizon), 0.25)
    eager = triton_attention.paged_attention(query[:3], k_cache, v_cache, _on(real, device, horizon).attn, 0.25)
    assert torch.equal(eager, captured[:3])
    with pytest.raises(ValueError, match="split_horizon 32 is shorter than the longest context 33"):
        triton_attention.paged_attention(query[:3], k_cache, v_cache, _on(real, device, 32).attn, 0.25)


@pytest.mark.parametrize("kv_heads", [1, 8])
def test_every_batch_size_splits_as_its_bucket(triton_attention: ModuleType, kv_heads: int) -> None:
    """The split count of an unpadded batch is its bucket's, at every size and horizon, also where
    the largest bucket is not a multiple of the stride."""
    for buckets, horizon in itertools.product((batch_buckets(100), batch_buckets(256)), (512, 4096, 131072)):
        for n in range(1, buckets[-1] + 1):
            bucket = bucket_for(n, buckets)
            assert bucket is not None
            assert (triton_attention.decode_splits(1, n, kv_heads, horizon, 64)
                    == triton_attention.decode_splits(1, bucket, kv_heads, horizon, 64)), (n, bucket, horizon)


def _on(inp: ModelInput, device: str, split_horizon: int = 0) -> ModelInput:
    a = inp.attn
    attn = AttentionMetadata(a.query_start_loc.to(device), a.seq_lens.to(device), a.block_tables.to(device),
                             a.slot_mapping.to(device), a.query_lens, a.seq_lens_list, a.num_decodes, split_horizon)
    return ModelInput(inp.input_ids.to(device), inp.positions.to(device), attn, inp.sample_indices, None)


# --- a stage's runner, eager buckets on the CPU -----------------------------------------------------


def runtime(model: Path, cuda_graphs: str) -> StageRuntime:
    config = EngineConfig(model=str(model), dtype="float32", max_model_len=128, kv_cache_tokens=32 * 16,
                          max_batch_size=8, cuda_graphs=cuda_graphs, block_size=16)  # a GPU's block size
    return build_stage_runtime(ResolvedConfig.resolve(config), None, progress=False)


@pytest.fixture(scope="module")
def runtimes(tiny_model_dir: Path) -> dict[str, StageRuntime]:
    return {mode: runtime(tiny_model_dir, mode) for mode in ("on", "off")}


def decode_batch_of(runner: ModelRunner, lengths: tuple[int, ...]) -> tuple[ModelInput, list[int]]:
    """A decode step of sequences of `lengths` tokens (blocks from a fresh block manager); also the
    slots the step writes."""
    blocks = BlockManager(runner.kv_cache.num_blocks, runner.kv_cache.block_size, watermark=0.0)
    seqs = {i: Sequence(i, f"r{i}", [3 + i] * (n - 1) + [7], SamplingParams(temperature=0.0))
            for i, n in enumerate(lengths)}
    for i, n in enumerate(lengths):
        blocks.allocate(i, n)
    chunks = tuple(ScheduledChunk(i, n - 1, 1, True) for i, n in enumerate(lengths))
    inp = runner.decode(InputBuilder(blocks).build(SchedulerOutput(chunks, (), len(chunks)), seqs))
    return inp, inp.attn.slot_mapping.tolist()


def fill_caches(runner: ModelRunner, value: float) -> None:
    for k, v in runner.kv_caches:
        k.fill_(value)
        v.fill_(value)


def written_slots(runner: ModelRunner) -> set[int]:
    """Slots of any layer's K or V cache that no longer hold the sentinel."""
    slots: set[int] = set()
    for k, v in runner.kv_caches:
        for cache in (k, v):
            changed = (cache != SENTINEL).flatten(2).any(-1).flatten()
            slots.update(changed.nonzero().flatten().tolist())
    return slots


def test_a_cpu_stage_runs_padded_decodes_eagerly(runtimes: dict[str, StageRuntime]) -> None:
    on, off = runtimes["on"].runner, runtimes["off"].runner
    assert off.graphs is None and off.kv_cache.scratch_block is None
    assert on.graphs is not None and on.graphs.plan.mode is GraphMode.EAGER and not on.graphs.captured
    assert on.kv_cache.scratch_block == on.kv_cache.num_blocks
    assert on.kv_caches[0][0].shape[0] == on.kv_cache.num_blocks + 1


def test_padded_rows_write_only_the_scratch_block(runtimes: dict[str, StageRuntime]) -> None:
    runner = runtimes["on"].runner
    assert runner.graphs is not None
    inp, real_slots = decode_batch_of(runner, (20, 3, 33))  # 3 rows in the bucket of 4
    fill_caches(runner, SENTINEL)
    runs = runner.graphs.eager_runs
    out = runner.forward(inp)
    assert runner.graphs.eager_runs == runs + 1
    assert out.shape[0] == 3
    scratch = runner.kv_cache.scratch_block
    assert scratch is not None
    bs = runner.kv_cache.block_size
    scratch_slots = set(range(scratch * bs, (scratch + 1) * bs))
    written = written_slots(runner)
    assert set(real_slots) <= written
    assert written - set(real_slots) <= scratch_slots
    assert written & scratch_slots  # the padded row did run, into the scratch block


def test_padded_decode_gives_the_unpadded_hidden_states(runtimes: dict[str, StageRuntime]) -> None:
    outputs = []
    for mode in ("on", "off"):
        runner = runtimes[mode].runner
        inp, _ = decode_batch_of(runner, (20, 3, 33, 17, 2))  # 5 rows in the bucket of 8
        fill_caches(runner, SENTINEL)
        outputs.append(runner.forward(inp))
    torch.testing.assert_close(outputs[0], outputs[1], rtol=1e-5, atol=1e-5)


def test_a_prefill_chunk_runs_unpadded(runtimes: dict[str, StageRuntime]) -> None:
    runner = runtimes["on"].runner
    assert runner.graphs is not None
    blocks = BlockManager(runner.kv_cache.num_blocks, runner.kv_cache.block_size, watermark=0.0)
    seq = Sequence(0, "p", [5] * 9, SamplingParams(temperature=0.0))
    blocks.allocate(0, 9)
    inp = runner.decode(InputBuilder(blocks).build(SchedulerOutput((ScheduledChunk(0, 0, 9, True),), (), 0),
                                                   {0: seq}))
    runs = runner.graphs.eager_runs
    assert runner.graphs.bucket(inp) is None
    assert runner.forward(inp).shape[0] == 1  # eager, and the last layer's MLP over the sampled row alone
    assert runner.graphs.eager_runs == runs


class RecordedGraph:
    """A CPU stand-in for a captured graph: replay reruns the captured work into the captured output."""

    def __init__(self, run: Callable[[], torch.Tensor], out: torch.Tensor) -> None:
        self.run, self.out = run, out

    def replay(self) -> None:
        self.out.copy_(self.run())


class RecordingCapture:
    """A CPU stand-in for `CudaGraphCapture`: what a graph would replay is the function captured, over
    the same static buffers and with the same (capture-time) metadata."""

    def pool(self) -> object:
        return None

    def synchronize(self) -> None:
        pass

    def reserved_bytes(self) -> int:
        return 0

    def capture(self, run: Callable[[], torch.Tensor], pool: object) -> tuple[RecordedGraph, torch.Tensor]:
        out = run()
        return RecordedGraph(run, out), out


def test_replays_with_capture_metadata_give_the_eager_hidden_states(tiny_model_dir: Path,
                                                                     triton_attention: ModuleType,
                                                                     triton_backend: None) -> None:
    """The capture path on the CPU: the Triton kernels (interpreted) run every bucket with the capture
    metadata (every row claiming max_model_len) over the static buffers, and replayed decodes of
    several batch sizes equal the unpadded eager ones."""
    on, off = runtime(tiny_model_dir, "on").runner, runtime(tiny_model_dir, "off").runner
    assert on.graphs is not None
    on.graphs = DecodeGraphRunner(replace(on.graphs.plan, mode=GraphMode.CAPTURE), on._run_layers,
                                  on.graphs.buffers)
    with torch.inference_mode():
        on.graphs.capture(RecordingCapture())
    assert on.graphs.captured == (1, 2, 4, 8)
    for lengths in ((20, 3, 33, 17, 2), (5,), (40, 9, 1)):
        outputs = []
        for runner in (on, off):
            inp, _ = decode_batch_of(runner, lengths)
            fill_caches(runner, SENTINEL)
            outputs.append(runner.forward(inp))
        torch.testing.assert_close(outputs[0], outputs[1], rtol=1e-5, atol=1e-5)
    assert on.graphs.replays == 3 and on.graphs.eager_runs == 0


@pytest.mark.gpu
def test_captured_graphs_replay_the_eager_decode(triton_backend: None, tiny_model_dir: Path) -> None:
    """On CUDA: every bucket is captured in the warm-up, and a replayed decode equals the eager one."""
    outputs = []
    for mode in ("on", "off"):
        config = EngineConfig(model=str(tiny_model_dir), dtype="float32", max_model_len=128,
                              kv_cache_tokens=32 * 16, max_batch_size=8, device="cuda", cuda_graphs=mode)
        runner = build_stage_runtime(ResolvedConfig.resolve(config), None, progress=False).runner
        inp, _ = decode_batch_of(runner, (20, 3, 33, 17, 2))
        fill_caches(runner, SENTINEL)
        outputs.append(runner.forward(inp).cpu())
        if mode == "on":
            assert runner.graphs is not None and runner.graphs.captured == (1, 2, 4, 8)
            assert runner.graphs.replays == 1
    torch.testing.assert_close(outputs[0], outputs[1], rtol=1e-4, atol=1e-4)
