"""Keep freed activation memory in the process, so a CPU stage stops faulting pages in every iteration.

A forward pass on the CPU allocates its activations afresh in every iteration (a 512-token chunk
of the `100m` preset: about 86 MiB over its 8 layers' projections) and frees them at its end. glibc's
malloc hands the top of its heap back to the kernel once more than its trim threshold lies free
there, and that threshold adapts only to the largest block it has served by `mmap` (twice that
size, a few MiB here). So every iteration's activations come back as fresh pages, and the kernel
zeroes them in the middle of the matmuls and the attention kernel: on a long offline trace that is
about a million page faults and seconds of system time (docs/kernels.md).

`keep_freed_memory` fixes both of glibc's thresholds once per process: blocks under 32 MiB (the
most glibc allows) come from the heap, and the heap keeps up to 1 GiB free before it trims, so the
memory of one iteration serves the next. What a process keeps is its peak activation footprint,
which it needs again in the next prefill anyway. vLLM's CPU backend asks users to preload tcmalloc
for the same reason; this needs no preload. `CHARIOT_CPU_KEEP_FREED_MEMORY=0` leaves malloc as it
is (for A/B runs).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import platform
from functools import cache

from chariot.contracts.environment import CPU_KEEP_FREED_MEMORY, is_on

log = logging.getLogger(__name__)

ENV = CPU_KEEP_FREED_MEMORY.name
M_TRIM_THRESHOLD = -1  # mallopt parameters, from glibc's <malloc.h>
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_BYTES = 32 << 20  # glibc's ceiling for M_MMAP_THRESHOLD on 64-bit
TRIM_THRESHOLD_BYTES = 1 << 30


@cache
def keep_freed_memory() -> str | None:
    """Set glibc malloc's mmap and trim thresholds for this process (once); returns why it did not
    (turned off, not glibc, or glibc refused), else None."""
    if not is_on(CPU_KEEP_FREED_MEMORY):
        return f"{ENV}=0"
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return "malloc is not glibc's"
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    for name, param, value in (("M_MMAP_THRESHOLD", M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES),
                               ("M_TRIM_THRESHOLD", M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES)):
        if libc.mallopt(param, value) != 1:
            return f"glibc refused mallopt({name}, {value})"
    log.info("malloc keeps freed memory: heap blocks up to %d MiB, trimmed past %d MiB free",
             MMAP_THRESHOLD_BYTES >> 20, TRIM_THRESHOLD_BYTES >> 20)
    return None
