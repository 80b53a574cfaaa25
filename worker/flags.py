"""Engine flags: one definition shared by `chariot worker`, `chariot generate`, `chariot up` and the
local launcher, which turns an `EngineConfig` back into the same flags for child stage processes."""

from __future__ import annotations

import argparse

from chariot.contracts.policies import DEFAULT_POLICY, POLICIES
from chariot.worker.config import DTYPES, EngineConfig


def add_engine_flags(p: argparse.ArgumentParser, model_required: bool = True) -> None:
    g = p.add_argument_group("engine")
    g.add_argument("--model", required=model_required, help="Hugging Face model directory")
    g.add_argument("--policy", choices=POLICIES, default=DEFAULT_POLICY,
                   help=f"batching policy (default {DEFAULT_POLICY})")
    g.add_argument("--token-budget", type=int, default=None,
                   help="tokens per iteration (default: 512 for sarathi, max_model_len otherwise)")
    g.add_argument("--tbt-slo-ms", type=float, default=None,
                   help="derive sarathi's token budget from this P99 TBT SLO and the `chariot tune` profile "
                        "(instead of --token-budget)")
    g.add_argument("--tune-profile", default=None,
                   help="profile written by `chariot tune` (default ~/.cache/chariot/tune/<model>-<dtype>.json)")
    g.add_argument("--max-batch-size", type=int, default=128)
    g.add_argument("--dtype", default="auto", choices=["auto", *DTYPES],
                   help="compute dtype; auto = the checkpoint's, except float32 on a CPU without native "
                        "bf16/fp16 instructions (logged)")
    g.add_argument("--block-size", type=int, default=16, help="KV-cache block size in tokens")
    g.add_argument("--kv-cache-tokens", type=int, default=None, help="KV capacity in tokens")
    g.add_argument("--kv-cache-memory-fraction", type=float, default=0.3,
                   help="KV capacity as a fraction of free device memory (when --kv-cache-tokens is unset; on the CPU "
                        "capped at what --max-batch-size sequences of --max-model-len tokens can use)")
    g.add_argument("--max-model-len", type=int, default=None)
    g.add_argument("--stages", type=int, default=1, help="pipeline stages in this group")
    g.add_argument("--tensor-parallel-size", type=int, default=1,
                   help="ranks each stage is sharded over (one process and device each; default 1)")
    g.add_argument("--layer-split", default=None, help="layers per stage, comma separated (e.g. 5,3)")
    g.add_argument("--stage-timeout", type=float, default=15.0,
                   help="seconds before a silent pipeline stage is declared dead")
    g.add_argument("--rendezvous-timeout", type=float, default=180.0,
                   help="seconds the stages of a pipeline group wait for each other to join (default 180; "
                        "raise it where a stage may wait for a node to scale up or an image to pull)")
    g.add_argument("--no-attention-aware-chunks", dest="attention_aware_chunks", action="store_false",
                   help="size sarathi's prefill chunks by tokens alone (default: late chunks of long prompts "
                        "shrink by their attention work, so no iteration outgrows the budget's time)")
    g.add_argument("--no-prefix-caching", dest="prefix_caching", action="store_false",
                   help="compute every prompt in full (default: reuse the KV of cached full blocks of an "
                        "identical leading prefix, e.g. a shared system prompt)")
    g.add_argument("--device", default="cpu")
    g.add_argument("--engine-seed", type=int, default=0, help="seed of sampling for requests without a seed")


def config_from_args(args: argparse.Namespace) -> EngineConfig:
    """The engine configuration; `--tbt-slo-ms` is resolved into a token budget here, once, so child
    stages receive the resolved `--token-budget`."""
    from chariot.worker.budget import budget_from_flags

    split = tuple(int(x) for x in args.layer_split.split(",")) if args.layer_split else None
    budget = budget_from_flags(args.model, args.dtype, args.policy, args.token_budget, args.tbt_slo_ms,
                               args.tune_profile, args.max_model_len)
    return EngineConfig(
        model=args.model, policy=args.policy, token_budget=budget, max_batch_size=args.max_batch_size,
        pipeline_stages=args.stages, tensor_parallel_size=args.tensor_parallel_size, dtype=args.dtype,
        block_size=args.block_size,
        kv_cache_tokens=args.kv_cache_tokens, kv_cache_memory_fraction=args.kv_cache_memory_fraction,
        max_model_len=args.max_model_len, device=args.device, seed=args.engine_seed, layer_split=split,
        stage_timeout_s=args.stage_timeout, rendezvous_timeout_s=args.rendezvous_timeout,
        attention_aware_chunks=args.attention_aware_chunks,
        prefix_caching=args.prefix_caching,
    )


def config_to_argv(c: EngineConfig) -> list[str]:
    """The flags that reproduce `c` (inverse of `config_from_args`)."""
    argv = ["--model", c.model, "--policy", c.policy, "--max-batch-size", str(c.max_batch_size),
            "--dtype", c.dtype, "--block-size", str(c.block_size),
            "--kv-cache-memory-fraction", str(c.kv_cache_memory_fraction), "--stages", str(c.pipeline_stages),
            "--tensor-parallel-size", str(c.tensor_parallel_size),
            "--stage-timeout", str(c.stage_timeout_s), "--rendezvous-timeout", str(c.rendezvous_timeout_s),
            "--device", c.device, "--engine-seed", str(c.seed)]
    optional = {"--token-budget": c.token_budget, "--kv-cache-tokens": c.kv_cache_tokens,
                "--max-model-len": c.max_model_len}
    for flag, value in optional.items():
        if value is not None:
            argv += [flag, str(value)]
    if c.layer_split:
        argv += ["--layer-split", ",".join(map(str, c.layer_split))]
    if not c.attention_aware_chunks:
        argv.append("--no-attention-aware-chunks")
    if not c.prefix_caching:
        argv.append("--no-prefix-caching")
    return argv
