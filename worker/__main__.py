"""`python -m chariot.worker worker ...`: a stage worker alone, as local deployments start it."""

import sys

from chariot.contracts.commands import build_parser, run
from chariot.worker.cli import register

if __name__ == "__main__":
    sys.exit(run(build_parser("chariot", "Chariot worker", [register])))
