"""Paged-attention kernel benchmark: are the Triton kernels near the GPU's roofline on real shapes?

Times the Triton backend against two baselines on Llama-3-8B attention shapes (32 query heads,
8 KV heads, head_dim 128, bf16, block size 16): torch SDPA with the flash backend on contiguous
(unpaged) K/V of the same sizes, i.e. what the hardware does without paging, and the PyTorch
reference backend, i.e. what the Triton backend replaces. Decode is memory bound, so it is reported
as achieved HBM bandwidth (K/V read + query/output); a prefill chunk is compute bound, so it is
reported as TFLOP/s (causal part counted once). Both also as a share of the peak given on the
command line (defaults: H200 HBM3e bandwidth, H100/H200 dense bf16 tensor-core peak).

    python -m chariot.bench.kernel_bench --out bench/results/kernels.json
    python -m chariot.bench.kernel_bench --check      # correctness vs the reference on these shapes

Times are medians of CUDA-event-timed runs (`triton.testing.do_bench`, L2 flushed between runs).
Needs a CUDA GPU.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
import triton.testing
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.bias import causal_lower_right
from tqdm.auto import tqdm

from chariot.kernels import reference, triton_attention
from chariot.kernels.attention import AttentionMetadata

HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE, DTYPE = 32, 8, 128, 16, torch.bfloat16
ELEM = torch.finfo(DTYPE).bits // 8
SCALE = HEAD_DIM**-0.5
CHECK_REL_TOL = 2e-2  # max |triton - reference| <= tol × max |reference| (bf16)


@dataclass(frozen=True)
class Case:
    kind: str  # "decode" | "prefill" | "write_kv"
    batch: int  # sequences (write_kv: tokens)
    query_len: int  # new tokens per sequence
    seq_len: int  # context attended, new tokens included

    @property
    def label(self) -> str:
        if self.kind == "decode":
            return f"decode b={self.batch} ctx={self.seq_len}"
        if self.kind == "prefill":
            return f"prefill chunk {self.query_len} ctx={self.seq_len - self.query_len}"
        return f"write_kv {self.batch} tokens"


@dataclass(frozen=True)
class Row:
    case: str
    method: str
    median_ms: float
    gbs: float  # achieved bandwidth (bytes the op must move / time)
    tflops: float
    pct_peak: float  # of bandwidth (decode, write_kv) or of bf16 compute (prefill)
    note: str = ""


@dataclass
class Inputs:
    query: torch.Tensor  # [tokens, heads, d]
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    meta: AttentionMetadata
    slots: torch.Tensor  # [batch, seq_len] cache slot of every context position


# --- cases and their cost model ------------------------------------------------------------------


def default_cases(args: argparse.Namespace) -> list[Case]:
    cases = [Case("prefill", 1, args.chunk, ctx + args.chunk) for ctx in args.prefill_contexts]
    cases += [Case("decode", b, 1, ctx) for ctx in args.decode_contexts for b in args.decode_batches]
    cases += [Case("write_kv", n, 1, 1) for n in args.write_tokens]
    return cases


def bytes_moved(case: Case) -> int:
    """HBM traffic the op cannot avoid: K/V context read once, query read, output written."""
    if case.kind == "write_kv":
        return 2 * 2 * case.batch * KV_HEADS * HEAD_DIM * ELEM  # K and V, read + write
    kv = 2 * case.batch * case.seq_len * KV_HEADS * HEAD_DIM * ELEM
    return kv + 2 * case.batch * case.query_len * HEADS * HEAD_DIM * ELEM


def flops(case: Case) -> float:
    """4·heads·d per attended (query, key) pair; the chunk's causal triangle counts half."""
    if case.kind == "write_kv":
        return 0.0
    cached = case.seq_len - case.query_len
    pairs = case.query_len * cached + case.query_len * (case.query_len + 1) / 2
    return 4.0 * HEADS * HEAD_DIM * pairs * case.batch


# --- inputs --------------------------------------------------------------------------------------


def make_inputs(case: Case, device: torch.device) -> Inputs:
    """A paged cache whose blocks are shuffled over the pool, as after many allocations and frees."""
    blocks_per_seq = -(-case.seq_len // BLOCK_SIZE)
    num_blocks = case.batch * blocks_per_seq
    tables = torch.randperm(num_blocks, device=device).view(case.batch, blocks_per_seq)
    pos = torch.arange(case.seq_len, device=device)
    slots = tables[:, pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE  # [batch, seq_len]
    shape = (num_blocks, BLOCK_SIZE, KV_HEADS, HEAD_DIM)
    k_cache = torch.randn(shape, device=device, dtype=DTYPE)
    v_cache = torch.randn(shape, device=device, dtype=DTYPE)
    q_lens = (case.query_len,) * case.batch
    seq_lens = (case.seq_len,) * case.batch
    meta = AttentionMetadata(
        query_start_loc=torch.arange(case.batch + 1, device=device, dtype=torch.int32) * case.query_len,
        seq_lens=torch.full((case.batch,), case.seq_len, device=device, dtype=torch.int32),
        block_tables=tables.to(torch.int32),
        slot_mapping=slots[:, case.seq_len - case.query_len :].reshape(-1),
        query_lens=q_lens,
        seq_lens_list=seq_lens,
        num_decodes=case.batch if case.query_len == 1 else 0,
    )
    query = torch.randn(case.batch * case.query_len, HEADS, HEAD_DIM, device=device, dtype=DTYPE)
    return Inputs(query, k_cache, v_cache, meta, slots)


def dense_kv(inputs: Inputs) -> tuple[torch.Tensor, torch.Tensor]:
    """The same context as contiguous [batch, kv_heads, seq_len, d] tensors (flash's native layout)."""
    k = inputs.k_cache.view(-1, KV_HEADS, HEAD_DIM)[inputs.slots].transpose(1, 2)
    v = inputs.v_cache.view(-1, KV_HEADS, HEAD_DIM)[inputs.slots].transpose(1, 2)
    return k, v


# --- methods -------------------------------------------------------------------------------------


def sdpa_method(case: Case, inputs: Inputs) -> tuple[Callable[[], object], str]:
    """Flash SDPA on unpaged K/V with native GQA; K/V heads repeated if this torch cannot do that."""
    k, v = dense_kv(inputs)
    q = inputs.query.view(case.batch, case.query_len, HEADS, HEAD_DIM).transpose(1, 2)
    mask = causal_lower_right(case.query_len, case.seq_len) if case.query_len > 1 else None

    def run(key: torch.Tensor, value: torch.Tensor, gqa: bool) -> torch.Tensor:
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            return F.scaled_dot_product_attention(q, key, value, attn_mask=mask, scale=SCALE, enable_gqa=gqa)

    try:
        run(k, v, True)
        return (lambda: run(k, v, True)), "flash, native GQA"
    except RuntimeError:
        group = HEADS // KV_HEADS
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        return (lambda: run(k, v, False)), "flash, K/V heads repeated (reads 4x the K/V bytes)"


def attention_methods(case: Case, inputs: Inputs, with_reference: bool) -> dict[str, tuple[Callable[[], object], str]]:
    i = inputs
    methods = {
        "triton": ((lambda: triton_attention.paged_attention(i.query, i.k_cache, i.v_cache, i.meta, SCALE)), ""),
        "sdpa": sdpa_method(case, inputs),
    }
    if with_reference:
        methods["reference"] = ((lambda: reference.paged_attention(i.query, i.k_cache, i.v_cache, i.meta, SCALE)), "")
    return methods


def write_inputs(case: Case, device: torch.device) -> tuple[Inputs, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """A cache of `batch` slots (rounded up to whole blocks), and new K/V scattered over them at random."""
    inputs = make_inputs(Case("prefill", 1, 1, case.batch), device)
    slots = inputs.slots.view(-1)[torch.randperm(case.batch, device=device)]
    key = torch.randn(case.batch, KV_HEADS, HEAD_DIM, device=device, dtype=DTYPE)
    return inputs, (key, torch.randn_like(key), slots)


def write_methods(case: Case, device: torch.device) -> dict[str, tuple[Callable[[], object], str]]:
    inputs, (key, value, slots) = write_inputs(case, device)
    k_cache, v_cache = inputs.k_cache, inputs.v_cache
    return {
        "triton": ((lambda: triton_attention.write_kv(key, value, k_cache, v_cache, slots)), ""),
        "reference": ((lambda: reference.write_kv(key, value, k_cache, v_cache, slots)), "index_copy_"),
    }


# --- timing and reporting ------------------------------------------------------------------------


def time_ms(fn: Callable[[], object], rep_ms: int) -> float:
    result = triton.testing.do_bench(fn, warmup=max(5, rep_ms // 4), rep=rep_ms, return_mode="median")
    return float(result)


def make_row(case: Case, method: str, ms: float, note: str, args: argparse.Namespace) -> Row:
    gbs = bytes_moved(case) / (ms * 1e-3) / 1e9
    tflops = flops(case) / (ms * 1e-3) / 1e12
    pct = 100 * (tflops / args.peak_tflops if case.kind == "prefill" else gbs / args.peak_bw_gbs)
    return Row(case.label, method, ms, gbs, tflops, pct, note)


def bench_case(case: Case, args: argparse.Namespace, device: torch.device) -> list[Row]:
    if case.kind == "write_kv":
        methods = write_methods(case, device)
    else:
        methods = attention_methods(case, make_inputs(case, device), not args.no_reference)
    rows = [make_row(case, name, time_ms(fn, args.rep_ms), note, args) for name, (fn, note) in methods.items()]
    del methods
    torch.cuda.empty_cache()
    return rows


def markdown(rows: list[Row]) -> str:
    lines = [
        "| case | method | median ms | GB/s | TFLOP/s | % of peak | note |",
        "|---|---|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        numbers = f"{r.median_ms:.4f} | {r.gbs:.0f} | {r.tflops:.1f} | {r.pct_peak:.1f}%"
        lines.append(f"| {r.case} | {r.method} | {numbers} | {r.note} |")
    return "\n".join(lines)


# --- correctness mode ----------------------------------------------------------------------------


def check_write(case: Case, device: torch.device) -> bool:
    """Triton write_kv is bitwise identical to the reference's index_copy_."""
    inputs, (key, value, slots) = write_inputs(case, device)
    mine = (inputs.k_cache.clone(), inputs.v_cache.clone())
    triton_attention.write_kv(key, value, *mine, slots)
    reference.write_kv(key, value, inputs.k_cache, inputs.v_cache, slots)
    return torch.equal(mine[0], inputs.k_cache) and torch.equal(mine[1], inputs.v_cache)


def check_case(case: Case, device: torch.device) -> tuple[float, bool]:
    """(max error relative to the reference's max magnitude, ok) on one shape; write_kv: bitwise."""
    if case.kind == "write_kv":
        same = check_write(case, device)
        return (0.0 if same else float("inf")), same
    i = make_inputs(case, device)
    out = triton_attention.paged_attention(i.query, i.k_cache, i.v_cache, i.meta, SCALE).float()
    expected = reference.paged_attention(i.query, i.k_cache, i.v_cache, i.meta, SCALE).float()
    rel = ((out - expected).abs().max() / expected.abs().max()).item()
    return rel, rel <= CHECK_REL_TOL


def run_check(cases: list[Case], device: torch.device) -> int:
    failed = 0
    print("| case | max rel error | ok |\n|---|---:|---|")
    for case in tqdm(cases, desc="check", file=sys.stderr):
        rel, ok = check_case(case, device)
        failed += not ok
        print(f"| {case.label} | {rel:.2e} | {'ok' if ok else 'FAIL'} |", flush=True)
        torch.cuda.empty_cache()
    print(f"\n{len(cases) - failed}/{len(cases)} shapes match the reference (tolerance {CHECK_REL_TOL:g})")
    return 1 if failed else 0


# --- CLI -----------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--decode-batches", type=int, nargs="+", default=[1, 8, 32, 64, 128, 256])
    p.add_argument("--decode-contexts", type=int, nargs="+", default=[1024, 4096, 8192])
    p.add_argument("--prefill-contexts", type=int, nargs="+", default=[0, 1024, 2048, 4096, 8192])
    p.add_argument("--write-tokens", type=int, nargs="+", default=[32, 256, 512, 4096])
    p.add_argument("--chunk", type=int, default=512, help="prefill chunk length")
    p.add_argument("--peak-bw-gbs", type=float, default=4800.0, help="HBM peak GB/s (H200: 4800, H100 SXM: 3350)")
    p.add_argument("--peak-tflops", type=float, default=989.0, help="dense bf16 peak TFLOP/s (H100/H200 SXM: 989)")
    p.add_argument("--rep-ms", type=int, default=100, help="time budget per measurement (do_bench rep)")
    p.add_argument("--no-reference", action="store_true", help="skip the (slow, memory-hungry) reference")
    p.add_argument("--check", action="store_true", help="only check correctness vs the reference, no timing")
    p.add_argument("--out", default="bench/results/kernels.json", help="JSON results path")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("kernel_bench needs a CUDA GPU (torch.cuda.is_available() is False); nothing was run", file=sys.stderr)
        return 2
    device = torch.device("cuda")
    torch.manual_seed(0)
    name = torch.cuda.get_device_name(device)
    print(f"device: {name}  peak {args.peak_bw_gbs:g} GB/s, {args.peak_tflops:g} TFLOP/s bf16\n")
    cases = default_cases(args)
    if args.check:
        return run_check(cases, device)
    rows: list[Row] = []
    for case in tqdm(cases, desc="kernel bench", file=sys.stderr):
        rows.extend(bench_case(case, args, device))
    print(markdown(rows))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    payload = {"device": name, "peak_bw_gbs": args.peak_bw_gbs, "peak_tflops": args.peak_tflops}
    out.write_text(json.dumps({**payload, "rows": [asdict(r) for r in rows]}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
