"""`python -m chariot.operator` = `chariot operator` (usable before the subcommand is wired into the CLI)."""

import sys

from chariot.operator.cli import main

sys.exit(main())
