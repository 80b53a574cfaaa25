"""The repository stands on its own: no file refers to a path outside it, and no source comment or
docstring names the working session or benchmark run that measured something.

Why: a clone has only what is tracked, so a reference to a file beside the repository (a design note,
a scratch folder) is a dead end for every reader; and "session 17" or "run k" mean nothing to someone
who was not there: comments say what the code does and why, measurements live in the docs with their
date and machine.
"""

from __future__ import annotations

import io
import re
import subprocess
import tokenize
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SOURCE_PACKAGES = ("cli", "contracts", "worker", "kernels", "router", "operator", "proto", "bench")
C_SUFFIXES = (".c", ".cc", ".cpp", ".cu", ".h", ".hpp")
SCRIPT_SUFFIXES = (".sh",)
BINARY_SUFFIXES = (".gz", ".png", ".jpg", ".svg", ".pdf", ".so", ".pyc", ".safetensors", ".bin")
# Raw benchmark output (logs, JSON) records the command lines and paths of the machine it ran on:
# data about that run, not references a reader follows, so the outside-path check leaves it alone.
RECORDED_DATA = (Path("docs/img"), (".json", ".jsonl", ".log", ".txt", ".csv"))

# Spelled in pieces so that this file does not match itself.
OUTSIDE_PATH = re.compile("|".join((
    re.escape("../" + "shared"),
    re.escape("DESIGN" + ".md"),
    r"(?<![\w.])/" + "work/",
)))
MARKDOWN_LINK = re.compile(r"\]\(([^)\s]+)\)")
# "session 17", "Session 3", "session17", "session-15"; "run k" and "runs m and n" as the names of
# benchmark runs (a single letter b-z standing alone: "a" is an article, "Runs f(x)" a call).
SESSION = re.compile(r"\bsession[- _]?\d+", re.IGNORECASE)
RUN_NAME = re.compile(r"\bruns? [b-z](?: and [b-z])?(?=[\s,.;:)]|$)", re.IGNORECASE | re.MULTILINE)


@cache
def repository_files() -> tuple[Path, ...]:
    """Tracked files and new ones git does not ignore (so a file is checked before its commit)."""
    out = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT, check=True,
                         capture_output=True).stdout.decode()
    return tuple(ROOT / p for p in out.split("\0") if p and (ROOT / p).is_file())


def text_of(path: Path) -> str | None:
    """The file's text, or None for a binary file."""
    if path.suffix in BINARY_SUFFIXES:
        return None
    data = path.read_bytes()
    if b"\0" in data:
        return None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return None


def python_comments_and_strings(source: str) -> list[tuple[int, str]]:
    """(line, text) of every comment and string literal (docstrings included) of a Python file."""
    found = []
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type in (tokenize.COMMENT, tokenize.STRING):
            found.append((tok.start[0], tok.string))
    return found


def prose_of(path: Path, text: str) -> list[tuple[int, str]]:
    """The parts of a source file written for readers: comments and docstrings (for C, C++ and shell
    files the whole text, whose code never spells these patterns)."""
    if path.suffix == ".py":
        return python_comments_and_strings(text)
    return [(1, text)]


def source_files() -> list[Path]:
    suffixes = (".py", ".proto", *C_SUFFIXES, *SCRIPT_SUFFIXES)
    return [p for p in repository_files()
            if p.relative_to(ROOT).parts[0] in SOURCE_PACKAGES and p.suffix in suffixes
            and not p.name.endswith(("_pb2.py", "_pb2.pyi", "_pb2_grpc.py"))]


def is_recorded_data(path: Path) -> bool:
    folder, suffixes = RECORDED_DATA
    return path.relative_to(ROOT).is_relative_to(folder) and path.suffix in suffixes


def escapes_repository(markdown: Path, target: str) -> bool:
    """Whether a relative link of a Markdown file points above the repository's root."""
    if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.IGNORECASE) or target.startswith("#"):
        return False  # a URL or an anchor on the same page
    path = target.split("#", 1)[0]
    if path.startswith("/"):
        return True
    resolved = (markdown.parent / path).resolve()
    return not resolved.is_relative_to(ROOT)


def test_no_file_refers_to_a_path_outside_the_repository() -> None:
    offenders = []
    for path in repository_files():
        if path == Path(__file__).resolve() or is_recorded_data(path):
            continue
        text = text_of(path)
        if text is None:
            continue
        rel = path.relative_to(ROOT)
        for lineno, line in enumerate(text.splitlines(), 1):
            if OUTSIDE_PATH.search(line):
                offenders.append(f"{rel}:{lineno}: {line.strip()[:100]}")
            if path.suffix == ".md":
                offenders += [f"{rel}:{lineno}: link to {t}" for t in MARKDOWN_LINK.findall(line)
                              if escapes_repository(path, t)]
    assert not offenders, "references outside the repository:\n" + "\n".join(offenders)


def test_no_source_comment_names_a_session_or_a_run() -> None:
    offenders = []
    for path in source_files():
        text = text_of(path)
        if text is None:
            continue
        for first_line, prose in prose_of(path, text):
            for pattern in (SESSION, RUN_NAME):
                for match in pattern.finditer(prose):
                    lineno = first_line + prose.count("\n", 0, match.start())
                    offenders.append(f"{path.relative_to(ROOT)}:{lineno}: {match.group(0)!r}")
    assert not offenders, ("comments and docstrings say what the code does and why; measurements go to "
                           "the docs with their date and machine:\n" + "\n".join(offenders))


def test_the_checks_catch_what_they_are_for() -> None:
    assert SESSION.search("measured in session 17") and SESSION.search("(Session 3)")
    assert SESSION.search("session15's table") and SESSION.search("the session-16 kernel")
    assert RUN_NAME.search("peer run k, floor 0.40") and RUN_NAME.search("runs m and n meet both")
    assert RUN_NAME.search("(run j)")
    for fine in ("runs a program per split", "a run of the benchmark", "Runs f(begin, end) over",
                 "the test session", "run a warm-up pass", "runs the loop"):
        assert not SESSION.search(fine) and not RUN_NAME.search(fine), fine
    assert OUTSIDE_PATH.search("see ../" + "shared/x") and OUTSIDE_PATH.search("DESIGN" + ".md §3")
    assert not OUTSIDE_PATH.search("docs/architecture.md §3")
    docs = ROOT / "docs" / "x.md"
    assert escapes_repository(docs, "../../elsewhere/file.md") and escapes_repository(docs, "/etc/hosts")
    assert not escapes_repository(docs, "architecture.md#3-engine-contracts")
    assert not escapes_repository(docs, "../README.md") and not escapes_repository(docs, "https://example.com/a")
