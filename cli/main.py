"""`chariot`: one entry point whose subcommands are registered by the packages that own them.

Registration imports no torch: each handler loads its component when it runs, so `chariot --help`
stays fast.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from chariot.bench.capacity_cli import add_bench_parser
from chariot.bench.tune import add_tune_parser
from chariot.cli import up
from chariot.contracts.commands import Register, build_parser, run
from chariot.operator.cli import add_operator_parser
from chariot.router.app import add_router_parser
from chariot.worker import cli as worker_cli

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
