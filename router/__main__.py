"""`python -m chariot.router router ...`: the router alone, as local deployments start it."""

import sys

from chariot.contracts.commands import build_parser, run
from chariot.router.app import add_router_parser

if __name__ == "__main__":
    sys.exit(run(build_parser("chariot", "Chariot router", [add_router_parser])))
