"""Decode attention per call, Chariot's kernel against vLLM-CPU's, on a cache larger than the last-level
cache (as an engine's is), bf16, the `100m` attention shape (16 query heads, 4 KV heads, head_dim 64).

Why: in the engine, a decode step's attention streams its sequences' K and V from a cache of hundreds
of MB, so what matters is the rate a kernel streams scattered blocks at, not its speed on a cache that
fits in L3. Each system runs in its own process and venv on a 390 MB cache of its own layout
(Chariot: head-major blocks of 16 and of 128 tokens, `empty_kv_cache`; vLLM: its CPU layout, 128-token
blocks, K and V of a block and head side by side, AMX ISA where the CPU has it), with a fresh random
choice of blocks per call so every call reads cold blocks. Both processes stay up and take turns,
one repetition (every shape once) at a time, the first rotating, so the machine's moves (this kind of
VM's speed moves 2x within minutes) fall on both; timed one system after the other, the ratio moved
0.8-1.8x from run to run. Chariot runs the current build and, with `--baseline REV`, another
revision's (`kernel_revision_ab.revision_source`), interleaved in its process.

    .venv/bin/python -m chariot.bench.experiments.decode_attention_side_by_side [--baseline REV] [OUT_DIR]

From the repository root (vLLM's venv at build/vllm-venv, its allocator preloaded as the peer
benchmark does). Writes OUT_DIR/decode_attention_side_by_side.json: per shape and kernel, the median
milliseconds and the rate K and V were read at (GB/s), and the machine.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

SHAPES = ((32, 512), (48, 800), (32, 2048))  # (decodes, context tokens)
HEADS, KV_HEADS, DIM = 16, 4, 64
CACHE_TOKENS = 384_000  # 2 × 393 MB of bf16 K and V at the 100m shape
REPS = 15
PAUSE_S = 0.05  # before each turn: the other process's OpenMP threads stop spinning and sleep
VLLM_PYTHON = Path("build/vllm-venv/bin/python")
TCMALLOC = "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4"


def kv_gb(decodes: int, ctx: int) -> float:
    """The K and V bytes one call reads, in GB."""
    return decodes * ctx * KV_HEADS * DIM * 2 * 2 / 1e9


def summarize(times: dict[str, dict[str, list[float]]]) -> dict[str, dict[str, dict[str, float]]]:
    """Median ms and GB/s per kernel and shape."""
    out: dict[str, dict[str, dict[str, float]]] = {}
    for kernel, by_shape in times.items():
        out[kernel] = {}
        for shape, ts in by_shape.items():
            n, ctx = (int(x) for x in shape.split("x"))
            ms = statistics.median(ts) * 1e3
            out[kernel][shape] = {"ms": ms, "gb_per_s": kv_gb(n, ctx) / ms * 1e3}
    return out


# ---- vLLM's process -------------------------------------------------------------------------------
def vllm_timer() -> Callable[[int], dict[str, dict[str, float]]]:
    """Sets up vLLM's cache; returns a function timing one repetition (every shape once)."""
    import torch
    import vllm._custom_ops as ops

    torch.set_num_threads(os.cpu_count() or 1)
    amx = bool(torch.cpu._is_amx_tile_supported())
    if amx:
        torch._C._cpu._init_amx()
    block = 128
    num_blocks = CACHE_TOKENS // block
    kv = torch.randn(num_blocks, KV_HEADS, block, 2 * DIM).to(torch.bfloat16)
    k, v = kv.view(num_blocks, KV_HEADS, 2 * block, DIM).chunk(2, dim=2)

    def one_rep(rep: int) -> dict[str, dict[str, float]]:
        times: dict[str, float] = {}
        for n, ctx in SHAPES:
            g = torch.Generator().manual_seed(rep)
            width = -(-ctx // block)
            tables = torch.randperm(num_blocks, generator=g)[: n * width].view(n, width).int()
            q = torch.randn(n, HEADS, DIM, generator=g).bfloat16()
            out = torch.empty_like(q)
            starts = torch.arange(n + 1, dtype=torch.int32)
            lens = torch.full((n,), ctx, dtype=torch.int32)
            meta = ops.cpu_attn_get_scheduler_metadata(
                num_reqs=n, num_heads=HEADS, num_kv_heads=KV_HEADS, head_dim=DIM, seq_lens=lens,
                dtype=torch.bfloat16, query_start_loc=starts, causal=True, sliding_window_size=-1,
                isa="amx" if amx else "vec", enable_kv_split=True)
            t0 = time.perf_counter()
            ops.cpu_attention_with_kv_cache(
                query=q, key_cache=k, value_cache=v, output=out, query_start_loc=starts, seq_lens=lens, scale=0.125,
                causal=True, alibi_slopes=None, sliding_window=-1, block_table=tables, softcap=0.0,
                scheduler_metadata=meta, s_aux=None)
            times[f"{n}x{ctx}"] = time.perf_counter() - t0
        return {f"vllm (block {block})": times}

    return one_rep


# ---- Chariot's process ----------------------------------------------------------------------------
def chariot_timer(baseline: str | None) -> Callable[[int], dict[str, dict[str, float]]]:
    """Builds the kernels and caches; returns a function timing one repetition (every shape, block size
    and kernel once, the kernels' order rotating by repetition)."""
    import torch

    from chariot.bench.experiments.kernel_revision_ab import revision_source
    from chariot.kernels import cpu_attention
    from chariot.kernels.attention import AttentionMetadata, empty_kv_cache

    kernels = {"current": cpu_attention.load_kernel()}
    if baseline:
        with tempfile.TemporaryDirectory() as tmp:
            kernels[baseline] = cpu_attention.load_kernel(revision_source(baseline, Path(tmp)))
    caches = {}
    for block in (16, 128):
        k, v = (empty_kv_cache(CACHE_TOKENS // block, block, KV_HEADS, DIM, torch.bfloat16) for _ in range(2))
        k.normal_(), v.normal_()
        caches[block] = (k, v)

    def one_rep(rep: int) -> dict[str, dict[str, float]]:
        times: dict[str, dict[str, float]] = {}
        with torch.inference_mode():
            for n, ctx in SHAPES:
                for block, (k, v) in caches.items():
                    g = torch.Generator().manual_seed(rep)
                    width = -(-ctx // block)
                    tables = torch.randperm(k.shape[0], generator=g)[: n * width].view(n, width).int()
                    q = torch.randn(n, HEADS, DIM, generator=g).bfloat16()
                    meta = AttentionMetadata(torch.arange(n + 1, dtype=torch.int32),
                                             torch.full((n,), ctx, dtype=torch.int32), tables,
                                             torch.zeros(n, dtype=torch.long), (1,) * n, (ctx,) * n, n)
                    names = list(kernels)
                    for name in names[rep % len(names):] + names[: rep % len(names)]:
                        t0 = time.perf_counter()
                        cpu_attention.paged_attention(q, k, v, meta, 0.125, kernel=kernels[name], prompts="kernel")
                        times.setdefault(f"chariot {name} (block {block})", {})[f"{n}x{ctx}"] = \
                            time.perf_counter() - t0
        return times

    return one_rep


def serve(one_rep: Callable[[int], dict[str, dict[str, float]]]) -> None:
    """A system's process: `ready`, then per repetition number read from stdin one JSON line of times."""
    print("ready", flush=True)
    for line in sys.stdin:
        print(json.dumps(one_rep(int(line))), flush=True)


# ---- the driver -----------------------------------------------------------------------------------
def take_turns(procs: dict[str, subprocess.Popen[str]], reps: int,
               warmup: int = 2) -> dict[str, dict[str, list[float]]]:
    """Every repetition on every system, the systems taking turns (the first rotating by repetition), so
    the machine's moves fall on all of them; the first `warmup` repetitions are dropped."""
    times: dict[str, dict[str, list[float]]] = {}
    names = list(procs)
    for rep in range(reps + warmup):
        for name in names[rep % len(names):] + names[: rep % len(names)]:
            proc = procs[name]
            assert proc.stdin is not None and proc.stdout is not None
            time.sleep(PAUSE_S)
            proc.stdin.write(f"{rep}\n")
            proc.stdin.flush()
            line = proc.stdout.readline()
            while line and not line.startswith("{"):  # anything else the library printed
                line = proc.stdout.readline()
            if not line:
                raise RuntimeError(f"{name}'s process ended at repetition {rep}")
            result = json.loads(line)
            if rep >= warmup:
                for kernel, by_shape in result.items():
                    for shape, seconds in by_shape.items():
                        times.setdefault(kernel, {}).setdefault(shape, []).append(seconds)
    return times


def start(cmd: list[str], env: dict[str, str]) -> subprocess.Popen[str]:
    proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
    assert proc.stdout is not None
    while (line := proc.stdout.readline()) and line.strip() != "ready":
        pass
    if not line:  # its output ended before `ready`: it failed to start
        raise RuntimeError(f"{cmd[0]} exited with {proc.wait()} before it was ready")
    return proc


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--baseline", default=None, help="another revision's kernel to time beside the current")
    parser.add_argument("--system", choices=("driver", "chariot", "vllm"), default="driver", help=argparse.SUPPRESS)
    parser.add_argument("out_dir", nargs="?", type=Path, default=Path("."))
    args = parser.parse_args(argv)
    if args.system != "driver":
        serve(vllm_timer() if args.system == "vllm" else chariot_timer(args.baseline))
        return 0
    from chariot.bench.linear_bench import cpu_record

    this = Path(__file__).resolve()
    vllm_env = dict(os.environ, LD_PRELOAD=TCMALLOC) if Path(TCMALLOC).exists() else dict(os.environ)
    baseline = ["--baseline", args.baseline] if args.baseline else []
    print("starting both systems' processes ...", flush=True)
    procs = {"chariot": start([sys.executable, str(this), "--system", "chariot", *baseline], dict(os.environ)),
             "vllm": start([str(VLLM_PYTHON), str(this), "--system", "vllm"], vllm_env)}
    try:
        times = take_turns(procs, REPS)
    finally:
        for proc in procs.values():
            if proc.stdin:
                proc.stdin.close()
            proc.wait(timeout=60)
    summary = summarize(times)
    for kernel, by_shape in summary.items():
        cells = (f"{s}: {r['ms']:.2f} ms {r['gb_per_s']:.1f} GB/s" for s, r in by_shape.items())
        print(f"{kernel:32s} " + "  ".join(cells))
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / "decode_attention_side_by_side.json").write_text(json.dumps(
        {"machine": cpu_record(), "shapes": SHAPES, "cache_tokens": CACHE_TOKENS, "reps": REPS,
         "interleaved": True, "baseline_revision": args.baseline, "summary": summary, "seconds": times}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
