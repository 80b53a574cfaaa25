"""Chariot's shared contracts: what the router, the worker, the operator and the benchmarks agree on.

Errors and their status mapping, sampling parameters, request/response types and finish reasons,
the protobuf conversions, the gRPC server assembly and client, telemetry (metric names and
exporters), the tokenizer, the policy table and the local process contract. Torch-free, and it
imports nothing of Chariot but `chariot.proto`, so the router and the CLI start without torch.
"""
