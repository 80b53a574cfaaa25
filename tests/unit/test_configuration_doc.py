"""docs/configuration.md carries the engine settings and environment knobs as generated from their
declarations; this test fails when the doc is stale. `python -m tests.unit.test_configuration_doc`
rewrites the generated blocks."""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

from chariot.contracts import engine_settings, environment

DOC = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"
BLOCKS: dict[str, Callable[[], str]] = {
    "engine-settings": engine_settings.markdown_table,
    "environment": environment.markdown_table,
}


def block_pattern(name: str) -> re.Pattern[str]:
    return re.compile(rf"(<!-- {name}:begin -->\n)(.*?)(<!-- {name}:end -->)", re.DOTALL)


def generated(text: str) -> str:
    for name, render in BLOCKS.items():
        text = block_pattern(name).sub(lambda m, r=render: m.group(1) + r() + m.group(3), text)  # type: ignore[misc]
    return text


def test_configuration_doc_is_generated_from_the_declarations() -> None:
    text = DOC.read_text()
    for name in BLOCKS:
        assert block_pattern(name).search(text), f"docs/configuration.md lost its {name} block"
    assert text == generated(text), "stale docs/configuration.md: run `python -m tests.unit.test_configuration_doc`"


def test_the_readme_links_the_configuration_doc() -> None:
    assert "docs/configuration.md" in (DOC.parents[1] / "README.md").read_text()


if __name__ == "__main__":
    DOC.write_text(generated(DOC.read_text()))
