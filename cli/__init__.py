"""The `chariot` command: the top of the package stack. It imports every component's subcommand
registration (worker, router, operator, bench) and owns `chariot up`, which starts workers and a
router together; nothing imports it."""
