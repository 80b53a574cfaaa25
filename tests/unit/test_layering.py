"""The package stack, enforced: every `chariot.*` import (top level, inside functions, under
TYPE_CHECKING) points down, and the packages meant to start without torch never import it.

    chariot.cli                                   the `chariot` command and `chariot up`
    chariot.bench                                 benchmarks: they drive the services
    chariot.worker  chariot.router  chariot.operator
    chariot.contracts                             torch-free shared contracts
    chariot.proto  chariot.kernels
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LEVEL = {"proto": 0, "kernels": 0, "contracts": 1, "worker": 2, "router": 2, "operator": 2, "bench": 3, "cli": 4}
TORCH_FREE = ("contracts", "router", "operator", "cli", "proto")
THIRD_PARTY_TORCH = ("torch", "triton", "numpy")


def imported_modules(path: Path) -> list[tuple[int, str]]:
    """(line, module) of every import in a file, wherever it stands."""
    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append((node.lineno, node.module))
    return found


def layering_violations(package: str, folder: Path) -> list[str]:
    """Imports in `folder` (package `chariot.<package>`) of a package at the same or a higher level."""
    bad = []
    for path in sorted(folder.rglob("*.py")):
        for line, module in imported_modules(path):
            parts = module.split(".")
            if parts[0] != "chariot" or len(parts) < 2 or parts[1] == package:
                continue
            target = parts[1]
            if LEVEL.get(target, 99) >= LEVEL[package]:
                bad.append(f"{path.relative_to(folder.parent)}:{line} imports {module}")
    return bad


def torch_imports(folder: Path) -> list[str]:
    return [f"{path.relative_to(folder.parent)}:{line} imports {module}"
            for path in sorted(folder.rglob("*.py"))
            for line, module in imported_modules(path)
            if module.split(".")[0] in THIRD_PARTY_TORCH]


@pytest.mark.parametrize("package", sorted(LEVEL))
def test_imports_point_down_the_stack(package: str) -> None:
    assert layering_violations(package, ROOT / package) == []


@pytest.mark.parametrize("package", TORCH_FREE)
def test_torch_free_packages_never_import_torch(package: str) -> None:
    assert torch_imports(ROOT / package) == []


def test_router_never_names_the_worker() -> None:
    hits = [f"{p.name}:{n}" for p in (ROOT / "router").rglob("*.py")
            for n, line in enumerate(p.read_text().splitlines(), 1) if "chariot.worker" in line]
    assert hits == []


def test_a_lower_package_importing_a_higher_one_is_caught(tmp_path: Path) -> None:
    contracts = tmp_path / "contracts"
    contracts.mkdir()
    (contracts / "bad.py").write_text(
        "from typing import TYPE_CHECKING\n"
        "from chariot.proto import chariot as _p\n"  # allowed: lower
        "if TYPE_CHECKING:\n    from chariot.worker.engine import Engine\n"
        "def f():\n    import chariot.router.app\n"
    )
    assert layering_violations("contracts", contracts) == [
        "contracts/bad.py:4 imports chariot.worker.engine",
        "contracts/bad.py:6 imports chariot.router.app",
    ]
    worker = tmp_path / "worker"
    worker.mkdir()
    (worker / "sideways.py").write_text("from chariot.router.launch import router_command\n")
    assert layering_violations("worker", worker) == ["worker/sideways.py:1 imports chariot.router.launch"]


def test_every_package_folder_is_in_the_stack() -> None:
    import tomllib

    mapping = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    assert {name.split(".")[1] for name in mapping} == set(LEVEL)
