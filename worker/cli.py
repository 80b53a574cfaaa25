"""The worker's subcommands of the `chariot` CLI: `make-model`, `fetch-model` (an `hf://` model into a
directory), `worker` (one pipeline stage) and `generate` (stream a completion). Registered by
`chariot.cli`; `python -m chariot.worker` runs them alone. Handlers import the engine lazily so
`chariot --help` stays fast (no torch).
"""

from __future__ import annotations

import argparse
import atexit
import logging
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from chariot.contracts.engine_settings import ENGINE_CORE, ITERATION_LOG, LAYER_SPLIT
from chariot.contracts.errors import ConfigError
from chariot.worker.flags import add_engine_flags, add_setting_flag, config_from_args

# `chariot make-model --preset` choices, spelled out so `chariot --help` need not import torch
# (tests/unit/test_make_model.py checks them against make_model.PRESETS).
PRESET_NAMES = ("tiny", "small", "100m", "llama3-8b")

if TYPE_CHECKING:
    from chariot.contracts.sampling_params import SamplingParams
    from chariot.contracts.telemetry import Telemetry
    from chariot.worker.config import EngineConfig
    from chariot.worker.model.fetch import StagePart
    from chariot.worker.pipeline.transport import Topology

def _add_make_model(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("make-model", help="write a random-initialised checkpoint + trained BPE tokenizer",
                       description="Write a Hugging Face-format model directory with random weights and a "
                                   "byte-level BPE tokenizer trained locally.")
    p.add_argument("dir", help="output directory")
    p.add_argument("--preset", choices=PRESET_NAMES, default="tiny")
    p.add_argument("--arch", choices=["llama", "mistral", "qwen2"], default="llama")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-weights", dest="weights", action="store_false",
                   help="write the config and tokenizer only (what a router reads), no weights")
    p.set_defaults(handler=_run_make_model)


def _run_make_model(args: argparse.Namespace) -> int:
    from chariot.worker.model.make_model import make_model

    make_model(args.dir, args.preset, seed=args.seed, arch=args.arch, weights=args.weights)
    what = "model" if args.weights else "config and tokenizer (no weights)"
    print(f"wrote {args.preset} {args.arch} {what} to {args.dir}")
    return 0


def _add_fetch_model(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("fetch-model", help="download an hf:// model's config, tokenizer and the weights a pod needs",
                       description="Download hf://<org>/<name>[@<revision>] into DIR (what the operator's init "
                                   "container runs): the config and tokenizer files, and the weights — all of them, "
                                   "only the shards one pipeline stage loads (--stage/--stages), or none "
                                   "(--no-weights). HF_TOKEN authenticates, HF_ENDPOINT picks a mirror; files "
                                   "already fetched into DIR for the same revision are not downloaded again.")
    p.add_argument("uri", help="hf://<org>/<name>[@<revision>]")
    p.add_argument("dir", help="output directory")
    p.add_argument("--stage", type=int, default=None, help="fetch only the weights of this pipeline stage (0-based)")
    p.add_argument("--stages", type=int, default=None, help="pipeline stages the model is split into (with --stage)")
    add_setting_flag(p, LAYER_SPLIT)
    p.add_argument("--no-weights", dest="weights", action="store_false",
                   help="fetch the config and tokenizer files only (what a router reads)")
    p.set_defaults(handler=_run_fetch_model)


def fetch_part(args: argparse.Namespace) -> StagePart | None:
    """The pipeline stage `fetch-model`'s flags name (None: every weight file, or none with --no-weights)."""
    from chariot.worker.model.fetch import StagePart

    if (args.stage is None) != (args.stages is None):
        raise ConfigError("--stage", "--stage and --stages go together")
    if args.stage is None:
        if args.layer_split is not None:
            raise ConfigError("--layer-split", "only applies with --stage and --stages")
        return None
    if not args.weights:
        raise ConfigError("--no-weights", "fetches no weights, so it takes no --stage")
    if not 0 <= args.stage < args.stages:
        raise ConfigError("--stage", f"must be in [0, {args.stages}) (--stages), got {args.stage}")
    return StagePart(args.stage, args.stages, args.layer_split)


def _run_fetch_model(args: argparse.Namespace) -> int:
    from chariot.worker.model.fetch import fetch_model

    # What is fetched, its sizes and progress; not every HTTP request huggingface_hub makes.
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("chariot").setLevel(logging.INFO)
    path = fetch_model(args.uri, args.dir, token=os.environ.get("HF_TOKEN"), endpoint=os.environ.get("HF_ENDPOINT"),
                       part=fetch_part(args), weights=args.weights)
    print(f"fetched {args.uri} into {path}")
    return 0


def _add_worker(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("worker", help="run one pipeline stage (rank from RANK/WORLD_SIZE)",
                       description="Run one stage of a pipeline group. Rank and rendezvous come from the "
                                   "standard torch.distributed environment: RANK, WORLD_SIZE, MASTER_ADDR, "
                                   "MASTER_PORT. Stages 1..P-1 execute micro-batches sent by stage 0.")
    add_engine_flags(p)
    g = p.add_argument_group("serving")
    g.add_argument("--host", default="127.0.0.1", help="gRPC bind address of stage 0 (0.0.0.0 in pods)")
    g.add_argument("--port", type=int, default=50061, help="gRPC port of stage 0 (0 = pick a free one)")
    g.add_argument("--metrics-host", default="127.0.0.1", help="bind address of /metrics")
    g.add_argument("--metrics-port", type=int, default=9400, help="Prometheus /metrics port (0 = free one)")
    g.add_argument("--served-model-name", default=None, help="model name clients use (default: dir name)")
    g.add_argument("--otlp-endpoint", default=None, help="OTLP collector for metrics and traces")
    add_setting_flag(g, ENGINE_CORE)
    add_setting_flag(g, ITERATION_LOG)
    p.set_defaults(handler=_run_worker)


def _run_worker(args: argparse.Namespace) -> int:
    from chariot.contracts.telemetry import setup_telemetry
    from chariot.worker.pipeline.launcher import start_stage_shards, stop_children
    from chariot.worker.pipeline.stage import run_downstream_stage
    from chariot.worker.pipeline.transport import Topology

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    config = config_from_args(args)
    topo = Topology.from_env() if config.world_size > 1 or "RANK" in os.environ else None
    if topo is not None and config.tensor_parallel_size > 1 and topo.world_size == config.pipeline_stages:
        # One process per stage was started (a pod on Kubernetes): it starts its stage's other ranks.
        topo, shards = start_stage_shards(config, topo)
        atexit.register(stop_children, shards)
    if topo is not None and topo.world_size != config.world_size:
        raise ConfigError("WORLD_SIZE", f"is {topo.world_size} but --stages {config.pipeline_stages} × "
                                        f"--tensor-parallel-size {config.tensor_parallel_size} is {config.world_size}")
    served = args.served_model_name or Path(config.model).name
    telemetry = setup_telemetry("chariot-worker", "worker", args.otlp_endpoint, model=served)
    metrics_port = telemetry.start_metrics_server(args.metrics_host, args.metrics_port)
    try:
        if topo is not None and topo.rank > 0:
            return run_downstream_stage(config, topo, telemetry=telemetry)
        return _serve_stage0(args, config, topo, served, telemetry, metrics_port)
    finally:
        telemetry.shutdown()


def _serve_stage0(args: argparse.Namespace, config: EngineConfig, topo: Topology | None, served: str,
                  telemetry: Telemetry, metrics_port: int) -> int:
    import asyncio

    from chariot.worker.engine import engine_factory
    from chariot.worker.iteration_log import IterationLog, StepObservers
    from chariot.worker.observe import EngineMetrics
    from chariot.worker.server import serve

    bound: list[int] = []

    def announce() -> None:
        print(f"chariot worker ready grpc={args.host}:{bound[0]} metrics={args.metrics_host}:{metrics_port}",
              flush=True)

    factory = engine_factory(config, topo)  # picklable: the engine core builds it
    iterations = None if args.iteration_log is None else IterationLog(args.iteration_log)
    try:
        return asyncio.run(serve(factory, args.host, args.port, served, ready=bound.append,
                                 observer=StepObservers(EngineMetrics(telemetry), iterations), on_ready=announce,
                                 engine_core=args.engine_core))
    finally:
        if iterations is not None:
            iterations.close()


def _add_generate(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="stream a completion from a running router (or offline with --model)",
                       description="Stream a completion to stdout from the router at --target (started by "
                                   "`chariot up`), or, with --model, from an engine in this process.")
    p.add_argument("prompt")
    p.add_argument("--target", default="127.0.0.1:50051", help="router gRPC address")
    add_engine_flags(p, model_required=False)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)
    p.set_defaults(handler=_run_generate)


def _run_generate(args: argparse.Namespace) -> int:
    from chariot.contracts.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, seed=args.seed)
    if args.model is None:
        from chariot.contracts.client import stream_completion

        return stream_completion(args.target, args.prompt, params)
    return _generate_offline(args, params)


def _generate_offline(args: argparse.Namespace, params: SamplingParams) -> int:
    from chariot.worker.engine import Engine
    from chariot.worker.output_processor import OutputProcessor, run_step

    if args.stages != 1:
        raise ConfigError("stages", "`generate` runs a single-process engine; use --stages 1")
    engine = Engine(config_from_args(args))
    processor = OutputProcessor(engine.tokenizer)
    processor.add_request(engine.add_request(args.prompt, params), params)
    print(args.prompt, end="", flush=True)
    while len(processor):
        for out in run_step(engine, processor)[1]:
            print(out.new_text, end="", flush=True)
            if out.finished:
                ttft = out.times.ttft or 0.0
                reason = out.finish_reason.value if out.finish_reason else "-"
                print(f"\n[{out.num_output_tokens} tokens, finish={reason}, ttft={ttft * 1000:.1f} ms]",
                      file=sys.stderr)
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    """The worker's subcommands: `make-model`, `fetch-model`, `worker` and `generate`."""
    _add_make_model(sub)
    _add_fetch_model(sub)
    _add_worker(sub)
    _add_generate(sub)
