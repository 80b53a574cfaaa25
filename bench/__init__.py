"""Benchmarks: engine iteration times now; traces, capacity search and the tuner later."""
