"""The `chariot` command line: one entry point, one subcommand per component.

Subcommands import their component lazily so `chariot --help` stays fast.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Callable, Sequence

from chariot.worker.errors import ConfigError
from chariot.worker.flags import add_engine_flags, config_from_args

Handler = Callable[[argparse.Namespace], int]


def _add_make_model(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("make-model", help="write a random-initialised checkpoint + trained BPE tokenizer",
                       description="Write a Hugging Face-format model directory with random weights and a "
                                   "byte-level BPE tokenizer trained locally.")
    p.add_argument("dir", help="output directory")
    p.add_argument("--preset", choices=["tiny", "small", "100m"], default="tiny")
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
    p.set_defaults(handler=_run_worker)


def _run_worker(args: argparse.Namespace) -> int:
    from chariot.worker.pipeline.stage import run_downstream_stage
    from chariot.worker.pipeline.transport import Topology

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    config = config_from_args(args)
    topo = Topology.from_env() if config.pipeline_stages > 1 or "RANK" in os.environ else None
    if topo is not None and topo.world_size != config.pipeline_stages:
        raise ConfigError("WORLD_SIZE", f"is {topo.world_size} but --stages is {config.pipeline_stages}")
    if topo is not None and topo.rank > 0:
        return run_downstream_stage(config, topo)
    raise ConfigError("RANK", "stage 0 serves requests over gRPC, which arrives with the router issue; "
                              "use `LLM(pipeline_stages=P)` for now")


def _add_generate(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="stream a completion (offline engine in this process)",
                       description="Load the model in this process and stream a completion to stdout.")
    p.add_argument("prompt")
    add_engine_flags(p)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)
    p.set_defaults(handler=_run_generate)


def _run_generate(args: argparse.Namespace) -> int:
    from chariot.worker.engine import Engine
    from chariot.worker.sampling_params import SamplingParams

    if args.stages != 1:
        raise ConfigError("stages", "`generate` runs a single-process engine; use --stages 1")
    engine = Engine(config_from_args(args))
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, seed=args.seed)
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
    _add_make_model(sub)
    _add_worker(sub)
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
