"""The user guide (docs/*.md) fits its screen: at 1280 px the content column of
mkdocs-material shows about 88 monospace characters, and a code line longer than that
hides behind a sideways scroll; a table of more than 7 columns does not fit either
(docs/stylesheets/extra.css makes tables smaller and lets them scroll, it cannot make a
wide one readable). README.md is not part of the site and is not checked here."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

DOCS = Path(__file__).resolve().parent.parent / "docs"
DOCUMENTS = sorted(DOCS.glob("*.md"))

# Characters of a code line the content column shows at 1280 px.
CODE_WIDTH = 88
# Columns of a table that fit the content column.
TABLE_COLUMNS = 7

# A cell separator: a `|` that is not escaped (`\|` is a pipe inside a cell).
SEPARATOR = re.compile(r"(?<!\\)\|")


def code_lines(text: str) -> list[tuple[int, str]]:
    """(line number, line) of every line inside a fenced code block (between lines
    starting with ```, indented or not)."""
    out = []
    inside = False
    for number, line in enumerate(text.splitlines(), 1):
        if line.lstrip().startswith("```"):
            inside = not inside
            continue
        if inside:
            out.append((number, line))
    return out


def table_columns(line: str) -> int:
    """The number of cells of a Markdown table row (a line starting with `|`)."""
    row = line.strip()
    if row.endswith("|") and not row.endswith("\\|"):
        row = row[:-1]
    return len(SEPARATOR.split(row[1:]))


def test_code_lines_and_cells_are_counted() -> None:
    text = "a\n```python\nx = 1\n```\nb\n  ```text\n" + "y" * 89 + "\n  ```\nz\n"
    assert code_lines(text) == [(3, "x = 1"), (7, "y" * 89)]
    assert table_columns("| a | b | c |") == 3
    assert table_columns("|---|---|") == 2
    assert table_columns("| max \\|a - b\\| | 0 |") == 2


def test_the_guide_is_checked() -> None:
    assert len(DOCUMENTS) > 10
    assert DOCS / "performance.md" in DOCUMENTS


@pytest.mark.parametrize("document", DOCUMENTS, ids=lambda d: d.name)
def test_code_block_lines_fit_the_column(document: Path) -> None:
    long = [
        f"docs/{document.name}:{number}: {len(line)} characters"
        for number, line in code_lines(document.read_text())
        if len(line) > CODE_WIDTH
    ]
    assert not long, f"code lines over {CODE_WIDTH} characters:\n" + "\n".join(long)


@pytest.mark.parametrize("document", DOCUMENTS, ids=lambda d: d.name)
def test_tables_fit_the_column(document: Path) -> None:
    inside = False
    wide = []
    for number, line in enumerate(document.read_text().splitlines(), 1):
        if line.lstrip().startswith("```"):
            inside = not inside
        elif not inside and line.startswith("|") and table_columns(line) > TABLE_COLUMNS:
            wide.append(f"docs/{document.name}:{number}: {table_columns(line)} columns")
    assert not wide, f"table rows over {TABLE_COLUMNS} columns:\n" + "\n".join(wide)
