"""Paged attention (`write_kv` + `paged_attention`) against PyTorch SDPA on unpaged data.

Hypothesis builds random iterations the way the executor does: decodes first, then prefill chunks
whose cached context may be empty or end anywhere inside a block, block tables shuffled over a
larger pool, MHA and GQA, fp32 and bf16. The cache starts filled with NaN so any read of a slot that
was never written (padding, other sequences' blocks) shows up in the output. The oracle is
per-sequence causal SDPA over the whole unpaged sequence with K/V heads repeated for GQA.
"""

from __future__ import annotations

import importlib
import math
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import chariot.kernels as kernels
from chariot.kernels import AttentionMetadata, empty_kv_cache, paged_attention, write_kv
from chariot.kernels.attention import AttentionBackend, FunctionBackend

HEADS = [(4, 4), (4, 2), (4, 1), (8, 2), (6, 3)]  # (num_heads, num_kv_heads)
FILL = float("nan")  # never-written cache slots; any read of them shows up as NaN
TOLERANCE = {torch.float32: (5e-5, 5e-5), torch.bfloat16: (3e-2, 3e-2)}  # (atol, rtol)


@dataclass(frozen=True)
class SeqCase:
    context: int  # tokens already in the cache
    query: int  # new tokens this iteration


@dataclass(frozen=True)
class Case:
    seqs: tuple[SeqCase, ...]  # decodes first
    num_decodes: int
    block_size: int
    heads: int
    kv_heads: int
    head_dim: int
    dtype: torch.dtype
    spare_blocks: int
    seed: int


@st.composite
def cases(draw: st.DrawFn) -> Case:
    num_decodes = draw(st.integers(0, 3))
    num_prefills = draw(st.integers(0 if num_decodes else 1, 6 - num_decodes))
    decodes = [SeqCase(draw(st.integers(0, 40)), 1) for _ in range(num_decodes)]
    prefills = [SeqCase(draw(st.integers(0, 40)), draw(st.integers(1, 40))) for _ in range(num_prefills)]
    heads, kv_heads = draw(st.sampled_from(HEADS))
    return Case(
        seqs=tuple(decodes + prefills),
        num_decodes=num_decodes,
        block_size=draw(st.sampled_from([1, 4, 16])),
        heads=heads,
        kv_heads=kv_heads,
        head_dim=draw(st.sampled_from([16, 64])),
        dtype=draw(st.sampled_from([torch.float32, torch.bfloat16])),
        spare_blocks=draw(st.integers(0, 5)),
        seed=draw(st.integers(0, 2**31 - 1)),
    )


def _block_tables(case: Case, gen: torch.Generator) -> list[list[int]]:
    """Each sequence's blocks drawn from a shuffled pool, so tables are non-contiguous."""
    needed = [math.ceil((s.context + s.query) / case.block_size) for s in case.seqs]
    pool = torch.randperm(sum(needed) + case.spare_blocks, generator=gen).tolist()
    tables, start = [], 0
    for n in needed:
        tables.append(pool[start : start + n])
        start += n
    return tables


def _slots(table: list[int], positions: range, block_size: int) -> list[int]:
    return [table[p // block_size] * block_size + p % block_size for p in positions]


def _metadata(case: Case, tables: list[list[int]], device: str = "cpu") -> AttentionMetadata:
    q_lens = tuple(s.query for s in case.seqs)
    seq_lens = tuple(s.context + s.query for s in case.seqs)
    width = max(len(t) for t in tables) + 1  # one extra padding column
    padded = [t + [0] * (width - len(t)) for t in tables]
    slots = [
        slot
        for s, t in zip(case.seqs, tables, strict=True)
        for slot in _slots(t, range(s.context, s.context + s.query), case.block_size)
    ]
    starts = [0]
    for q in q_lens:
        starts.append(starts[-1] + q)
    return AttentionMetadata(
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_tables=torch.tensor(padded, dtype=torch.int32, device=device),
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        query_lens=q_lens,
        seq_lens_list=seq_lens,
        num_decodes=case.num_decodes,
    )


def _oracle(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, query_len: int) -> torch.Tensor:
    """Causal SDPA over one whole unpaged sequence; returns the last `query_len` positions.

    q: [seq_len, heads, d]; k/v: [seq_len, kv_heads, d] (fp32).
    """
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True
    )
    return out.transpose(0, 1)[-query_len:]


def _run_case(case: Case, strided_query: bool = False, device: str = "cpu", engine_layout: bool = False) -> None:
    """`engine_layout`: caches from `empty_kv_cache` (head-major views on the CPU), else contiguous."""
    gen = torch.Generator().manual_seed(case.seed)
    tables = _block_tables(case, gen)
    num_blocks = max(max(t) for t in tables) + 1 + case.spare_blocks
    shape = (num_blocks, case.block_size, case.kv_heads, case.head_dim)
    if engine_layout:
        k_cache = empty_kv_cache(*shape, case.dtype, device).fill_(FILL)
        v_cache = empty_kv_cache(*shape, case.dtype, device).fill_(FILL)
    else:
        k_cache = torch.full(shape, FILL, dtype=case.dtype, device=device)
        v_cache = torch.full(shape, FILL, dtype=case.dtype, device=device)

    def rand(*size: int) -> torch.Tensor:
        return torch.randn(*size, generator=gen).to(case.dtype)

    full = []
    for s, table in zip(case.seqs, tables, strict=True):
        n = s.context + s.query
        seq = (rand(n, case.heads, case.head_dim), rand(n, case.kv_heads, case.head_dim))
        seq += (rand(n, case.kv_heads, case.head_dim),)
        full.append(seq)
        if s.context:  # earlier iterations already cached the context
            ctx_slots = torch.tensor(_slots(table, range(s.context), case.block_size), device=device)
            ctx_k, ctx_v = seq[1][: s.context].to(device), seq[2][: s.context].to(device)
            write_kv(ctx_k, ctx_v, k_cache, v_cache, ctx_slots)

    meta = _metadata(case, tables, device)
    new_q = torch.cat([q[s.context :] for s, (q, _, _) in zip(case.seqs, full, strict=True)])
    new_k = torch.cat([k[s.context :] for s, (_, k, _) in zip(case.seqs, full, strict=True)])
    new_v = torch.cat([v[s.context :] for s, (_, _, v) in zip(case.seqs, full, strict=True)])
    new_q, new_k, new_v = new_q.to(device), new_k.to(device), new_v.to(device)
    write_kv(new_k, new_v, k_cache, v_cache, meta.slot_mapping)
    if strided_query:  # as sliced out of a fused QKV projection
        fused = torch.cat([new_q, torch.zeros_like(new_q)], dim=-1)
        new_q = fused[..., : case.head_dim]
        assert not new_q.is_contiguous()
    out = paged_attention(new_q, k_cache, v_cache, meta, 1.0 / math.sqrt(case.head_dim))

    pairs = zip(case.seqs, full, strict=True)
    expected = torch.cat([_oracle(q.float(), k.float(), v.float(), s.query) for s, (q, k, v) in pairs])
    assert out.shape == new_q.shape and out.dtype == case.dtype
    atol, rtol = TOLERANCE[case.dtype]
    torch.testing.assert_close(out.float().cpu(), expected, atol=atol, rtol=rtol)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cases())
def test_paged_attention_matches_sdpa(case: Case) -> None:
    _run_case(case)


@pytest.mark.parametrize("engine_layout", [False, True], ids=["contiguous", "engine-layout"])
@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize(("heads", "kv_heads"), [(4, 4), (8, 2)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fixed_mixed_batch(block_size: int, heads: int, kv_heads: int, dtype: torch.dtype, engine_layout: bool) -> None:
    """A deterministic batch covering every shape class at once, for each block size, in a plain
    contiguous cache and in the engine's (`empty_kv_cache`)."""
    seqs = (
        SeqCase(context=1, query=1),  # decode with a one-token context
        SeqCase(context=37, query=1),  # decode spanning several blocks
        SeqCase(context=0, query=1),  # single-token prompt
        SeqCase(context=0, query=23),  # first chunk of a prompt
        SeqCase(context=13, query=20),  # later chunk starting mid-block, crossing blocks
        SeqCase(context=16, query=16),  # chunk aligned to block boundaries
    )
    case = Case(seqs, 2, block_size, heads, kv_heads, 64, dtype, spare_blocks=3, seed=block_size)
    _run_case(case, engine_layout=engine_layout)


def test_non_contiguous_query() -> None:
    seqs = (SeqCase(9, 1), SeqCase(3, 1), SeqCase(5, 12), SeqCase(0, 4))
    _run_case(Case(seqs, 2, 4, 8, 2, 16, torch.float32, spare_blocks=1, seed=5), strided_query=True)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reference_on_cuda(dtype: torch.dtype) -> None:
    seqs = (SeqCase(30, 1), SeqCase(0, 1), SeqCase(0, 40), SeqCase(21, 17))
    _run_case(Case(seqs, 1, 16, 8, 2, 64, dtype, spare_blocks=4, seed=11), device="cuda")


@pytest.mark.parametrize("seqs", [(SeqCase(5, 1),), (SeqCase(0, 7),), (SeqCase(0, 1),)])
def test_decode_only_or_prefill_only(seqs: tuple[SeqCase, ...]) -> None:
    num_decodes = 1 if seqs[0].query == 1 and seqs[0].context else 0
    _run_case(Case(seqs, num_decodes, 4, 4, 2, 16, torch.float32, spare_blocks=2, seed=3))


@pytest.mark.parametrize("engine_layout", [False, True], ids=["contiguous", "engine-layout"])
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16])
def test_write_kv_writes_exactly_the_given_slots(cache_dtype: torch.dtype, engine_layout: bool) -> None:
    gen = torch.Generator().manual_seed(0)
    num_blocks, block_size, kv_heads, head_dim = 6, 4, 2, 8
    shape = (num_blocks, block_size, kv_heads, head_dim)
    def make() -> torch.Tensor:
        return empty_kv_cache(*shape, cache_dtype) if engine_layout else torch.empty(shape, dtype=cache_dtype)

    k_cache, v_cache = make().fill_(-7.0), make().fill_(9.0)
    slots = torch.tensor([17, 0, 23, 5, 4, 11])  # unordered, across and inside blocks
    key = torch.randn(len(slots), kv_heads, head_dim, generator=gen)
    value = torch.randn(len(slots), kv_heads, head_dim, generator=gen)

    write_kv(key, value, k_cache, v_cache, slots)

    flat_k = k_cache.reshape(-1, kv_heads, head_dim)  # a copy for the head-major view: read-only use
    flat_v = v_cache.reshape(-1, kv_heads, head_dim)
    torch.testing.assert_close(flat_k[slots], key.to(cache_dtype), atol=0, rtol=0)
    torch.testing.assert_close(flat_v[slots], value.to(cache_dtype), atol=0, rtol=0)
    untouched = torch.ones(num_blocks * block_size, dtype=torch.bool)
    untouched[slots] = False
    assert bool((flat_k[untouched] == -7.0).all())
    assert bool((flat_v[untouched] == 9.0).all())


def test_write_kv_empty_batch_is_noop() -> None:
    k_cache = torch.zeros(2, 4, 1, 8)
    v_cache = torch.zeros(2, 4, 1, 8)
    empty = torch.empty(0, 1, 8)
    write_kv(empty, empty, k_cache, v_cache, torch.empty(0, dtype=torch.int64))
    assert not k_cache.any() and not v_cache.any()


# --- backend selection -------------------------------------------------------------------------


@pytest.fixture
def restore_backend(monkeypatch: pytest.MonkeyPatch):
    yield monkeypatch
    monkeypatch.undo()
    kernels.select_backend()


def test_default_backend_on_cpu_is_the_cpu_kernel(restore_backend: pytest.MonkeyPatch) -> None:
    """Without CUDA the C++ kernel is the default (`make test` installs a compiler and ninja)."""
    restore_backend.delenv(kernels.BACKEND_ENV, raising=False)
    restore_backend.setattr(torch.cuda, "is_available", lambda: False)
    assert kernels.select_backend() == "cpu"
    assert kernels.get_backend() == "cpu"


def test_default_falls_back_to_reference_when_the_kernel_cannot_build(
    restore_backend: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """No compiler (simulated: this machine has one) → the reference, with a warning saying why."""
    restore_backend.delenv(kernels.BACKEND_ENV, raising=False)
    restore_backend.setattr(torch.cuda, "is_available", lambda: False)
    restore_backend.setattr(kernels, "_cpu_problem", lambda: "the C++ kernel did not build (no g++)")
    with caplog.at_level("WARNING", logger="chariot.kernels"):
        assert kernels.select_backend() == "reference"
    assert "no g++" in caplog.text and "reference" in caplog.text


def test_explicit_cpu_request_raises_when_it_cannot_build(restore_backend: pytest.MonkeyPatch) -> None:
    restore_backend.setenv(kernels.BACKEND_ENV, "cpu")
    restore_backend.setattr(kernels, "_cpu_problem", lambda: "the C++ kernel did not build (no g++)")
    with pytest.raises(kernels.AttentionBackendError, match="no g\\+\\+"):
        kernels.select_backend()


def test_env_selects_reference(restore_backend: pytest.MonkeyPatch) -> None:
    restore_backend.setenv(kernels.BACKEND_ENV, "reference")
    assert kernels.select_backend() == "reference"


def test_unavailable_triton_raises_naming_env_var(restore_backend: pytest.MonkeyPatch) -> None:
    restore_backend.setenv(kernels.BACKEND_ENV, "triton")
    restore_backend.setattr(torch.cuda, "is_available", lambda: False)
    restore_backend.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(kernels.AttentionBackendError, match=kernels.BACKEND_ENV):
        kernels.select_backend()


def test_unknown_backend_raises(restore_backend: pytest.MonkeyPatch) -> None:
    with pytest.raises(kernels.AttentionBackendError, match="flash"):
        kernels.select_backend("flash")


def test_dispatch_follows_reselection(restore_backend: pytest.MonkeyPatch) -> None:
    """Functions imported before a re-selection still dispatch to the current backend."""
    calls: list[str] = []

    def fake_write_kv(*args: object) -> None:
        calls.append("write_kv")

    fake = FunctionBackend("fake", fake_write_kv, lambda *args: torch.empty(0))
    restore_backend.setattr(kernels, "_active", fake)
    write_kv(torch.empty(0), torch.empty(0), torch.empty(0), torch.empty(0), torch.empty(0))
    assert calls == ["write_kv"] and kernels.get_backend() == "fake"


@pytest.mark.parametrize("name", sorted(kernels.BACKENDS))
def test_every_backend_module_exposes_the_protocol(name: str) -> None:
    """Each backend module's `BACKEND` is an `AttentionBackend` named as `BACKENDS` names it, made of
    that module's own functions (importing a backend module needs no GPU and no compiler)."""
    module = importlib.import_module(kernels.BACKENDS[name])
    backend = module.BACKEND
    assert isinstance(backend, AttentionBackend) and backend.name == name
    assert backend.paged_attention is module.paged_attention and backend.write_kv is module.write_kv
