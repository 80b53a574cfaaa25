"""The 256-bit build of a C++ CPU kernel, for tests that check both builds wherever they run.

An AVX-512 machine builds the kernels with 16-lane vectors; an AVX2 machine gets the 8-lane form.
A wrapper source that defines `CHARIOT_VECTOR_256` and includes the kernel builds that form here
too. Its first line carries a hash of the kernel and its headers, so the build cache (keyed by the
wrapper's bytes) rebuilds it whenever either changes."""

from __future__ import annotations

import hashlib
from pathlib import Path


def vector_256_source(source: Path, directory: Path) -> Path:
    """Write (into `directory`) and return a wrapper source building `source` with 8-lane vectors."""
    parts = [source, *sorted(source.parent.glob("*.h"))]
    version = hashlib.sha256(b"".join(p.read_bytes() for p in parts)).hexdigest()
    wrapper = directory / f"{source.stem}_256.cpp"
    wrapper.write_text(f"// kernel sources {version}\n#define CHARIOT_VECTOR_256 1\n#include \"{source}\"\n")
    return wrapper
