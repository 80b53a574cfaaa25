"""`chariot`: one entry point whose subcommands are registered by the packages that own them.

Registration imports no torch: each handler loads its component when it runs, so `chariot --help`
stays fast. The benchmarks are not part of the product: `chariot bench ...` hands its arguments to
`chariot.bench` only when it runs, so no other command imports that package.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from chariot.cli import up
from chariot.contracts.commands import Register, build_parser, run
from chariot.operator.cli import add_operator_parser
from chariot.router.app import add_router_parser
from chariot.worker import cli as worker_cli
from chariot.worker.tune import add_tune_parser


def add_bench_parser(subparsers: argparse._SubParsersAction) -> None:
    """`chariot bench capacity|peer ...`: registered without importing `chariot.bench`; its own parser
    (and `--help`) comes with it when the subcommand runs."""
    p = subparsers.add_parser("bench", add_help=False, help="benchmarks: capacity under SLO (`capacity`), "
                              "Chariot against vLLM-CPU (`peer`); `chariot bench --help` lists them")
    p.add_argument("-h", "--help", dest="bench_help", action="store_true", help="the benchmarks' own help")
    p.add_argument("bench_args", nargs=argparse.REMAINDER, help="`capacity ...` or `peer ...`")
    p.set_defaults(handler=_run_bench)


def _run_bench(args: argparse.Namespace) -> int:
    from chariot.bench.capacity_cli import run_bench_command

    return run_bench_command(["--help"] if args.bench_help else args.bench_args)


REGISTERS: tuple[Register, ...] = (
    worker_cli.register,  # make-model, worker, generate
    add_router_parser,
    add_operator_parser,
    add_bench_parser,
    add_tune_parser,
    up.register,
)


def parser() -> argparse.ArgumentParser:
    return build_parser("chariot", "Chariot: LLM serving with Sarathi-Serve scheduling", REGISTERS)


def main(argv: Sequence[str] | None = None) -> int:
    return run(parser(), argv)


if __name__ == "__main__":
    sys.exit(main())
