"""The `CHARIOT_*` environment knobs: every one the source names is declared in
`chariot.contracts.environment`, read through its readers (never `os.environ` directly), and read where
the registry says; the registry imports only the standard library and its readers behave as declared.
The kernels sit below `chariot.contracts`, so they read their five knobs through `chariot.kernels.knobs`
(standard library only), whose names and defaults must equal the registry's declarations."""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

import pytest

from chariot.contracts import environment as env
from chariot.kernels import knobs as kernel_knobs

ROOT = Path(__file__).resolve().parents[2]
SOURCE_DIRS = ("cli", "bench", "worker", "router", "operator", "contracts", "kernels", "proto", "tests")
REGISTRY = ROOT / "contracts" / "environment.py"
KERNEL_KNOBS = ROOT / "kernels" / "knobs.py"  # the only other reader: the kernels' five knobs
KERNEL_KNOB_NAMES = {kernel_knobs.ATTENTION_BACKEND, kernel_knobs.KERNEL_CACHE, kernel_knobs.KERNEL_BASELINE,
                     kernel_knobs.KERNEL_BUILD, kernel_knobs.CPU_LAYER_OPS}
# Names that look like knobs but are C preprocessor macros of the kernels' builds, not environment variables.
MACROS = {"CHARIOT_OPS_NAMESPACE", "CHARIOT_VECTOR_256"}
NAME = re.compile(r"\bCHARIOT_[A-Z0-9_]*[A-Z0-9]\b")  # a `CHARIOT_CPU_*` family is not a name


def python_files() -> list[Path]:
    """The repository's Python files, except generated code and this test (it names made-up knobs)."""
    return sorted(p for d in SOURCE_DIRS for p in (ROOT / d).rglob("*.py")
                  if "_pb2" not in p.name and p != Path(__file__).resolve())


def test_every_chariot_name_in_the_source_is_declared() -> None:
    declared = {k.name for k in env.KNOBS}
    undeclared = sorted({f"{path.relative_to(ROOT)}: {name}" for path in python_files()
                         for name in NAME.findall(path.read_text()) if name not in declared | MACROS})
    assert undeclared == []


def imports(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, module) of every absolute import; `from a import b` gives both `a` and `a.b`."""
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found += [(node.lineno, node.module)] + [(node.lineno, f"{node.module}.{a.name}") for a in node.names]
    return found


def knob_constant(node: ast.AST | None) -> bool:
    return isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.startswith("CHARIOT_")


def reads_a_knob(node: ast.AST) -> bool:
    """`os.environ.get("CHARIOT_X")` / `os.getenv(...)`, `os.environ["CHARIOT_X"]` read, `"CHARIOT_X" in ...`."""
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.args:
        return node.func.attr in ("get", "getenv") and knob_constant(node.args[0])
    if isinstance(node, ast.Subscript):
        return isinstance(node.ctx, ast.Load) and knob_constant(node.slice)
    return isinstance(node, ast.Compare) and knob_constant(node.left)


def environment_reads(tree: ast.AST) -> list[ast.AST]:
    """Reads that name a knob by its string instead of going through the registry."""
    return [node for node in ast.walk(tree) if reads_a_knob(node)]


def test_nothing_reads_a_knob_around_the_registry() -> None:
    """Code reads a knob with `chariot.contracts.environment.read` / `is_on` / `read_path` (writes, which
    set a knob for a child process or a test, may name it); the kernels' reader module is the only other
    one, and only for the kernels' five knobs."""
    bypassing = [f"{path.relative_to(ROOT)}:{node.lineno}"  # type: ignore[attr-defined]
                 for path in python_files() if path not in (REGISTRY, KERNEL_KNOBS)
                 for node in environment_reads(ast.parse(path.read_text()))]
    assert bypassing == []


def test_the_kernel_reader_reads_only_the_kernel_knobs() -> None:
    """`kernels/knobs.py` names no knob but the five the registry says the kernels read, and nothing
    outside the kernels reads a knob through it (the worker and everything above use the registry)."""
    kernel_side = {k.name for k in env.KNOBS if all(r.startswith("kernels/") for r in k.readers)}
    assert kernel_side == KERNEL_KNOB_NAMES
    assert set(NAME.findall(KERNEL_KNOBS.read_text())) == KERNEL_KNOB_NAMES
    outside = [f"{path.relative_to(ROOT)}:{line}" for path in python_files()
               if path.relative_to(ROOT).parts[0] not in ("kernels", "tests")
               for line, module in imports(ast.parse(path.read_text())) if module == "chariot.kernels.knobs"]
    assert outside == []


def test_the_kernel_side_names_and_defaults_equal_the_registry() -> None:
    """The kernels read their five knobs without the registry (they sit below `chariot.contracts`); what
    they read must be what the registry declares, so the two cannot drift."""
    pairs = [(env.ATTENTION_BACKEND, kernel_knobs.ATTENTION_BACKEND, kernel_knobs.ATTENTION_BACKEND_DEFAULT),
             (env.KERNEL_CACHE, kernel_knobs.KERNEL_CACHE, kernel_knobs.KERNEL_CACHE_DEFAULT),
             (env.KERNEL_BASELINE, kernel_knobs.KERNEL_BASELINE, kernel_knobs.KERNEL_BASELINE_DEFAULT),
             (env.KERNEL_BUILD, kernel_knobs.KERNEL_BUILD, kernel_knobs.KERNEL_BUILD_DEFAULT),
             (env.CPU_LAYER_OPS, kernel_knobs.CPU_LAYER_OPS, kernel_knobs.CPU_LAYER_OPS_DEFAULT)]
    for declared, name, default in pairs:
        assert (name, default) == (declared.name, declared.default)
    assert env.ATTENTION_BACKEND.values == " \\| ".join(f"`{c}`" for c in kernel_knobs.ATTENTION_BACKENDS)
    assert env.KERNEL_BUILD.values == " \\| ".join(f"`{c}`" for c in kernel_knobs.KERNEL_BUILDS)
    assert env.KERNEL_BUILD.choices == kernel_knobs.KERNEL_BUILDS


def test_the_kernel_readers(monkeypatch: pytest.MonkeyPatch) -> None:
    """The kernel-side readers behave like the registry's: empty is unset, unset is the default."""
    for name in KERNEL_KNOB_NAMES:
        monkeypatch.setenv(name, "")
    assert kernel_knobs.attention_backend() is None
    assert kernel_knobs.kernel_cache() == env.read_path(env.KERNEL_CACHE)
    assert kernel_knobs.kernel_baseline() == env.read_path(env.KERNEL_BASELINE)
    assert kernel_knobs.kernel_build() == env.read(env.KERNEL_BUILD) == "auto"
    assert kernel_knobs.cpu_layer_ops() is env.is_on(env.CPU_LAYER_OPS) is True
    monkeypatch.setenv(kernel_knobs.ATTENTION_BACKEND, " Triton ")
    assert kernel_knobs.attention_backend() == "triton"
    monkeypatch.setenv(kernel_knobs.ATTENTION_BACKEND, "flash")
    with pytest.raises(ValueError, match="CHARIOT_ATTENTION_BACKEND must be reference, triton or cpu, got 'flash'"):
        kernel_knobs.attention_backend()
    monkeypatch.setenv(kernel_knobs.KERNEL_CACHE, "~/k")
    assert kernel_knobs.kernel_cache() == Path.home() / "k"
    monkeypatch.setenv(kernel_knobs.CPU_LAYER_OPS, "0")
    assert not kernel_knobs.cpu_layer_ops()
    monkeypatch.setenv(kernel_knobs.KERNEL_BUILD, "native")
    assert kernel_knobs.kernel_build() == env.read(env.KERNEL_BUILD) == "native"
    monkeypatch.setenv(kernel_knobs.KERNEL_BUILD, "fast")
    for reader in (kernel_knobs.kernel_build, lambda: env.read(env.KERNEL_BUILD)):
        with pytest.raises(ValueError, match="CHARIOT_KERNEL_BUILD must be auto, native or baseline, got 'fast'"):
            reader()


def test_a_direct_read_is_caught() -> None:
    tree = ast.parse('import os\nos.environ.get("CHARIOT_X")\nos.environ["CHARIOT_Y"]\n"CHARIOT_Z" in os.environ\n'
                     'os.environ["CHARIOT_W"] = "1"\n')
    assert [n.lineno for n in environment_reads(tree)] == [2, 3, 4]  # type: ignore[attr-defined]


@pytest.mark.parametrize("knob", env.KNOBS, ids=lambda k: k.name)
def test_each_declared_reader_uses_the_knob(knob: env.Knob) -> None:
    attribute = next(name for name, value in vars(env).items() if value is knob)
    for reader in knob.readers:
        text = (ROOT / reader).read_text()
        assert re.search(rf"\b{attribute}\b", text), f"{reader} is declared to read {knob.name} but does not"


@pytest.mark.parametrize("reader", [REGISTRY, KERNEL_KNOBS], ids=lambda p: str(p.relative_to(ROOT)))
def test_the_readers_import_only_the_standard_library(reader: Path) -> None:
    imported = {module.split(".")[0] for _, module in imports(ast.parse(reader.read_text()))}
    assert imported - {"__future__"} <= set(sys.stdlib_module_names)


def test_knob_names_are_unique_and_documented() -> None:
    names = [k.name for k in env.KNOBS]
    assert len(names) == len(set(names))
    assert all(k.help and k.values and k.readers for k in env.KNOBS)


def test_readers(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(env.CPU_LAYER_OPS.name, raising=False)
    assert env.is_on(env.CPU_LAYER_OPS)  # default on
    monkeypatch.setenv(env.CPU_LAYER_OPS.name, "0")
    assert not env.is_on(env.CPU_LAYER_OPS)
    monkeypatch.setenv(env.STAGE_CPUS.name, "")
    assert env.read(env.STAGE_CPUS) is None  # empty counts as unset
    monkeypatch.setenv(env.KERNEL_CACHE.name, "~/k")
    assert env.read_path(env.KERNEL_CACHE) == Path.home() / "k"
    monkeypatch.setenv(env.CPU_SKINNY_LINEAR.name, "yes")
    with pytest.raises(ValueError, match="CHARIOT_CPU_SKINNY_LINEAR must be auto, 0 or 1, got 'yes'"):
        env.read(env.CPU_SKINNY_LINEAR)
    with pytest.raises(KeyError, match="not a declared environment knob"):
        env.knob("CHARIOT_NOPE")
