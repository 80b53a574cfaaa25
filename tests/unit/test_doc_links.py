"""Every relative link in README.md and docs/*.md points to a file or folder in the repository, and
a link to a heading of a Markdown page (`page.md#heading`, `#heading`) names a heading that page has.

Why: the docs are how a newcomer finds their way (docs/BENCHMARKS.md's answers link to their raw
data under docs/img/), and a moved script, a compressed data file or a renamed section breaks such
a link silently. URLs are not checked (no network in the tests)."""

from __future__ import annotations

import re
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = sorted([ROOT / "README.md", *(ROOT / "docs").glob("*.md")])
# [text](target) and ![alt](target); a target has no spaces (titles in quotes are not used here).
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^\s*```")


def links(page: Path) -> list[tuple[int, str]]:
    """(line, target) of every Markdown link outside fenced code blocks."""
    found, in_code = [], False
    for lineno, line in enumerate(page.read_text().splitlines(), 1):
        if FENCE.match(line):
            in_code = not in_code
            continue
        if not in_code:
            found += [(lineno, t) for t in LINK.findall(re.sub(r"`[^`]*`", "", line))]
    return found


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"`|\*\*|\*|_(?=\w)|(?<=\w)_|\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip()).lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


@cache
def anchors(page: Path) -> frozenset[str]:
    seen: dict[str, int] = {}
    out = set()
    in_code = False
    for line in page.read_text().splitlines():
        if FENCE.match(line):
            in_code = not in_code
            continue
        match = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if match and not in_code:
            base = slug(match.group(1))
            n = seen.get(base, 0)
            seen[base] = n + 1
            out.add(base if n == 0 else f"{base}-{n}")
    return frozenset(out)


def broken(page: Path, target: str) -> str | None:
    """Why a link is broken, or None."""
    if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.IGNORECASE):
        return None  # a URL
    path, _, anchor = target.partition("#")
    file = (page.parent / path).resolve() if path else page
    if not file.exists():
        return "no such file"
    if not file.is_relative_to(ROOT):
        return "outside the repository"
    if anchor and file.suffix == ".md" and anchor not in anchors(file):
        return f"no heading #{anchor} in {file.relative_to(ROOT)}"
    return None


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(page: Path) -> None:
    bad = [f"{page.relative_to(ROOT)}:{lineno}: {target} ({why})"
           for lineno, target in links(page) if (why := broken(page, target))]
    assert not bad, "broken links:\n" + "\n".join(bad)


def test_slugs_follow_github() -> None:
    assert slug("Zen 4 EPYC, bfloat16 (2026-11-25)") == "zen-4-epyc-bfloat16-2026-11-25"
    assert slug("Engine core: process or thread") == "engine-core-process-or-thread"
    assert slug("`chariot up` flags") == "chariot-up-flags"
