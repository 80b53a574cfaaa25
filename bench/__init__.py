"""Benchmarks: engine iteration times, traces, capacity search under SLO, the simulator, Chariot against
vLLM-CPU. Not part of the product: the `chariot` command imports this package only when `chariot bench`
runs (the tuner, which deployments use, is `chariot.worker.tune`)."""
