"""The `chariot` command needs only the product: importing it (every subcommand registered, `tune`
included) loads neither the benchmarks nor torch, and `chariot bench ...` still reaches the benchmarks'
own parser, help included, when it runs."""

from __future__ import annotations

import subprocess
import sys

import pytest

from chariot.cli.main import main


def test_the_command_imports_neither_the_benchmarks_nor_torch() -> None:
    code = ("import sys, chariot.cli.main as m; m.parser(); "
            "print(sorted(n for n in sys.modules if n == 'torch' or n.startswith('chariot.bench')))")
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert loaded.strip() == "[]"


@pytest.mark.parametrize(("argv", "usage"), [
    (["bench", "--help"], "usage: chariot bench [-h] {capacity,peer,routing}"),
    (["bench", "capacity", "--help"], "usage: chariot bench capacity"),
    (["bench", "peer", "--help"], "usage: chariot bench peer"),
    (["tune", "--help"], "usage: chariot tune"),
])
def test_help_reaches_each_parser(argv: list[str], usage: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as done:
        main(argv)
    assert done.value.code == 0
    assert capsys.readouterr().out.startswith(usage)


def test_a_bad_bench_command_is_the_benchmarks_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as done:
        main(["bench", "nope"])
    assert done.value.code == 2
    assert "chariot bench: error: argument bench_command: invalid choice: 'nope'" in capsys.readouterr().err
