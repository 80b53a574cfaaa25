"""Running a `chariot` subcommand: one way to dispatch a parsed command and map its errors to an exit
code, shared by the `chariot` CLI and each package's own `python -m chariot.<package>` entry point
(how local deployments start workers and routers)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence

from chariot.contracts.errors import ChariotError

Handler = Callable[[argparse.Namespace], int]
Register = Callable[["argparse._SubParsersAction[argparse.ArgumentParser]"], object]
"""Adds one package's subcommands; each sets `handler` (a `Handler`) in its defaults."""


def build_parser(prog: str, description: str, registers: Sequence[Register]) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description=description)
    sub = parser.add_subparsers(dest="command", required=True)
    for register in registers:
        register(sub)
    return parser


def run(parser: argparse.ArgumentParser, argv: Sequence[str] | None = None) -> int:
    """Parse `argv` and run the chosen subcommand's handler; `ChariotError` → exit 2 with its message."""
    args = parser.parse_args(argv)
    try:
        handler: Handler = args.handler
        return handler(args)
    except ChariotError as exc:
        print(f"chariot {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
