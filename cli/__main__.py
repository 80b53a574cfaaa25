"""`python -m chariot.cli ...` is the `chariot` command."""

import sys

from chariot.cli.main import main

sys.exit(main())
