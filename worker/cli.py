"""The `chariot` command line: one entry point, one subcommand per component.

Subcommands import their component lazily so `chariot --help` stays fast.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence

from chariot.worker.config import POLICIES

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


def _add_engine_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="Hugging Face model directory")
    p.add_argument("--policy", choices=POLICIES, default="sarathi")
    p.add_argument("--token-budget", type=int, default=None)
    p.add_argument("--max-batch-size", type=int, default=128)
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--kv-cache-tokens", type=int, default=None)
    p.add_argument("--max-model-len", type=int, default=None)


def _add_generate(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="stream a completion (offline engine in this process)",
                       description="Load the model in this process and stream a completion to stdout.")
    p.add_argument("prompt")
    _add_engine_flags(p)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)
    p.set_defaults(handler=_run_generate)


def _run_generate(args: argparse.Namespace) -> int:
    from chariot.worker.config import EngineConfig
    from chariot.worker.engine import Engine
    from chariot.worker.sampling_params import SamplingParams

    engine = Engine(EngineConfig(
        model=args.model, policy=args.policy, token_budget=args.token_budget,
        max_batch_size=args.max_batch_size, dtype=args.dtype, kv_cache_tokens=args.kv_cache_tokens,
        max_model_len=args.max_model_len,
    ))
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
