"""The lab scripts in `chariot.bench.experiments` stay importable (their imports of the engine, the
kernels and the benchmarks still resolve) and importing one runs nothing: the work is under `main()`
behind `if __name__ == "__main__"`. Each must also be listed as a package in pyproject.toml, or a
non-editable install would leave it out."""

from __future__ import annotations

import importlib
import pkgutil
from pathlib import Path

import pytest
import tomllib

import chariot.bench.experiments as experiments

ROOT = Path(__file__).resolve().parents[2]
FOLDER = ROOT / "bench" / "experiments"
MODULES = sorted(p.stem for p in FOLDER.glob("*.py") if p.stem != "__init__")


def test_every_file_is_found_as_a_module() -> None:
    found = sorted(m.name for m in pkgutil.iter_modules(experiments.__path__))
    assert MODULES and found == MODULES


@pytest.mark.parametrize("name", MODULES)
def test_importing_runs_nothing(name: str, capsys: pytest.CaptureFixture[str]) -> None:
    module = importlib.import_module(f"chariot.bench.experiments.{name}")
    assert module.__doc__, f"{name} needs a docstring that says what it measures and how to run it"
    assert "__main__" in (FOLDER / f"{name}.py").read_text(), f"{name} has no `if __name__ == \"__main__\"`"
    out = capsys.readouterr()
    assert out.out == "" and out.err == "", f"importing {name} printed something"


def test_the_package_is_shipped() -> None:
    packages = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]
    assert "chariot.bench.experiments" in packages
