"""A markdown table's lines, as the reports of runs on an emulated card write them: the fit table
(``fit_table.render``) and your model's ranked sets (``devtools.your_model.ranking_check.table``)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

RULES = {"<": "---", ">": "---:"}  # a column aligned left, or right (numbers)


def markdown_table(columns: Sequence[tuple[str, str]], rows: Iterable[Sequence[str]]) -> list[str]:
    """The heading of ``columns`` ((title, "<" or ">") each), its rule, then a line per row of cells."""
    lines = ["| " + " | ".join(title for title, _ in columns) + " |"]
    lines.append("|" + "|".join(RULES[align] for _, align in columns) + "|")
    for row in rows:
        if len(row) != len(columns):
            raise ValueError(f"a row of {len(row)} cells in a table of {len(columns)} columns: {row}")
        lines.append("| " + " | ".join(row) + " |")
    return lines
