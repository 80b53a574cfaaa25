"""The `chariot` command line: one entry point, one subcommand per component.

Subcommands import their component lazily so `chariot --help` stays fast.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from chariot.worker.errors import ConfigError
from chariot.worker.flags import add_engine_flags, config_from_args

# `chariot make-model --preset` choices, spelled out so `chariot --help` need not import torch
# (tests/unit/test_make_model.py checks them against make_model.PRESETS).
PRESET_NAMES = ("tiny", "small", "100m", "llama3-8b")

if TYPE_CHECKING:
    from chariot.worker.config import EngineConfig
    from chariot.worker.pipeline.transport import Topology
    from chariot.worker.sampling_params import SamplingParams
    from chariot.worker.telemetry import Telemetry

Handler = Callable[[argparse.Namespace], int]


def _add_make_model(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("make-model", help="write a random-initialised checkpoint + trained BPE tokenizer",
                       description="Write a Hugging Face-format model directory with random weights and a "
                                   "byte-level BPE tokenizer trained locally.")
    p.add_argument("dir", help="output directory")
    p.add_argument("--preset", choices=PRESET_NAMES, default="tiny")
    p.add_argument("--arch", choices=["llama", "mistral", "qwen2"], default="llama")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(handler=_run_make_model)


def _run_make_model(args: argparse.Namespace) -> int:
    from chariot.worker.model.make_model import make_model

    make_model(args.dir, args.preset, seed=args.seed, arch=args.arch)
    print(f"wrote {args.preset} {args.arch} model to {args.dir}")
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
    p.set_defaults(handler=_run_worker)


def _run_worker(args: argparse.Namespace) -> int:
    from chariot.worker.pipeline.stage import run_downstream_stage
    from chariot.worker.pipeline.transport import Topology
    from chariot.worker.telemetry import setup_telemetry

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    config = config_from_args(args)
    topo = Topology.from_env() if config.pipeline_stages > 1 or "RANK" in os.environ else None
    if topo is not None and topo.world_size != config.pipeline_stages:
        raise ConfigError("WORLD_SIZE", f"is {topo.world_size} but --stages is {config.pipeline_stages}")
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

    from chariot.worker.engine import Engine
    from chariot.worker.observe import EngineMetrics
    from chariot.worker.server import serve

    bound: list[int] = []

    def announce() -> None:
        print(f"chariot worker ready grpc={args.host}:{bound[0]} metrics={args.metrics_host}:{metrics_port}",
              flush=True)

    return asyncio.run(serve(lambda: Engine(config, topology=topo), args.host, args.port, served,
                             ready=bound.append, observer=EngineMetrics(telemetry), on_ready=announce))


def _add_up(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("up", help="run router + stage workers as local processes (the embedded default)",
                       description="Start R replicas of P pipeline stages and one router on this machine, "
                                   "print the endpoints, and stop everything on Ctrl-C. With no --model, "
                                   "the tiny preset is made first.")
    add_engine_flags(p, model_required=False)
    p.set_defaults(stages=2)
    p.add_argument("--replicas", type=int, default=1, help="pipeline groups (default 1)")
    p.add_argument("--host", default="127.0.0.1", help="router bind address")
    p.add_argument("--http-port", type=int, default=8000)
    p.add_argument("--grpc-port", type=int, default=50051)
    p.add_argument("--redis-url", default=None, help="shared router state (optional)")
    p.add_argument("--ttft-slo-ms", type=float, default=None)
    p.add_argument("--served-model-name", default=None)
    p.set_defaults(handler=_run_up)


def _run_up(args: argparse.Namespace) -> int:
    from chariot.worker.up import ensure_model, run_up

    if args.replicas < 1:
        raise ConfigError("replicas", f"must be >= 1, got {args.replicas}")
    args.model = ensure_model(args.model)
    return run_up(args, config_from_args(args))


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
    from chariot.worker.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, seed=args.seed)
    if args.model is None:
        from chariot.worker.client import stream_completion

        return stream_completion(args.target, args.prompt, params)
    return _generate_offline(args, params)


def _generate_offline(args: argparse.Namespace, params: SamplingParams) -> int:
    from chariot.worker.engine import Engine

    if args.stages != 1:
        raise ConfigError("stages", "`generate` runs a single-process engine; use --stages 1")
    engine = Engine(config_from_args(args))
    engine.add_request(args.prompt, params)
    print(args.prompt, end="", flush=True)
    while engine.has_unfinished:
        for out in engine.step():
            print(out.new_text, end="", flush=True)
            if out.finished:
                ttft = out.times.ttft or 0.0
                print(f"\n[{len(out.token_ids)} tokens, finish={out.finish_reason.value if out.finish_reason else '-'}"
                      f", ttft={ttft * 1000:.1f} ms]", file=sys.stderr)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="chariot", description="Chariot: LLM serving with Sarathi-Serve scheduling")
    sub = parser.add_subparsers(dest="command", required=True)
    from chariot.bench.capacity_cli import add_bench_parser
    from chariot.bench.tune import add_tune_parser
    from chariot.operator.cli import add_operator_parser
    from chariot.router.app import add_router_parser

    _add_make_model(sub)
    _add_worker(sub)
    add_router_parser(sub)
    add_operator_parser(sub)
    add_bench_parser(sub)
    add_tune_parser(sub)
    _add_up(sub)
    _add_generate(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    from chariot.worker.errors import ChariotError

    try:
        handler: Handler = args.handler
        return handler(args)
    except ChariotError as exc:
        print(f"chariot {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
