"""What a non-editable install (`pip install .`, as the image does) ships besides Python modules:
the C++ kernel sources *and the headers they include*, which are compiled on first use. A header
left out of `package-data` makes every kernel build fail in the image, and the worker falls back to
the slow reference attention with only a warning."""

from __future__ import annotations

import fnmatch
import re
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[2]


def _kernel_globs() -> list[str]:
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    return list(data["chariot.kernels"])


def test_every_kernel_source_and_header_is_package_data() -> None:
    csrc = ROOT / "kernels" / "csrc"
    files = sorted(p.relative_to(ROOT / "kernels").as_posix() for p in csrc.iterdir() if p.is_file())
    globs = _kernel_globs()
    missing = [f for f in files if not any(fnmatch.fnmatch(f, g) for g in globs)]
    assert files and not missing, f"not shipped by package-data {globs}: {missing}"


def test_every_included_header_exists_beside_the_sources() -> None:
    csrc = ROOT / "kernels" / "csrc"
    for source in csrc.glob("*.cpp"):
        for header in re.findall(r'#include "([^"]+)"', source.read_text()):
            assert (csrc / header).is_file(), f"{source.name} includes {header}, which is not in kernels/csrc"
