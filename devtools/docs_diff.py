"""The diffs the rung pages quote: ``diff`` of two recipes, as the page "The diff from rung NN" shows it.

    python -m devtools.docs_diff 04 05          # print the diff of recipes/04_*.py and recipes/05_*.py
    python -m devtools.docs_diff --write        # rewrite the diff block of every docs/NN_*.md page

A rung page quotes the diff under "The diff from rung NN"; a page that names two recipes as
``diff recipes/A.py recipes/B.py`` quotes it in the block that follows. The docstrings differ on every
pair and are shown by their first line only; the rest of the diff is
every changed line, hunks separated by `` ...``. tests/docs/test_docs.py checks that every page's block is
what this prints, so a recipe change that is not carried to its page fails the suite.
"""

from __future__ import annotations

import difflib
import re
import sys
from pathlib import Path

from fabric_memory_recipes.console import Parser

REPO = Path(__file__).resolve().parents[1]
RECIPES, DOCS = REPO / "recipes", REPO / "docs"
HEADING = re.compile(r"^## The diff from rung (\d\d\w*)\s*$", re.M)  # a rung page: against rung NN
NAMED = re.compile(r"^`diff recipes/(\w+)\.py recipes/(\w+)\.py`", re.M)  # a page naming both recipes


def recipe(rung: str) -> Path:
    exact = RECIPES / f"{rung}.py"
    if exact.exists():
        return exact
    found = sorted(RECIPES.glob(f"{rung}_*.py"), key=lambda p: len(p.name))  # "08": 08_fsdp, not 08_fsdp2
    if not found:
        raise SystemExit(f"docs_diff: no recipe for rung {rung}")
    return found[0]


def _split_docstring(text: str) -> tuple[str, list[str]]:
    """(the docstring's first line, the lines after the docstring)."""
    lines = text.splitlines()
    end = next(i for i in range(1, len(lines)) if lines[i].rstrip().endswith('"""'))
    return lines[0], lines[end + 1 :]


def render(old: str, new: str) -> str:
    """The diff block (without the fences) from rung ``old`` to rung ``new``."""
    old_title, old_body = _split_docstring(recipe(old).read_text())
    new_title, new_body = _split_docstring(recipe(new).read_text())
    out = [f"-{old_title}", f"+{new_title}"]
    for group in difflib.SequenceMatcher(None, old_body, new_body, autojunk=False).get_grouped_opcodes(0):
        out.append(" ...")
        for tag, i1, i2, j1, j2 in group:
            if tag == "equal":
                continue
            out += [f"-{line}" for line in old_body[i1:i2]]
            out += [f"+{line}" for line in new_body[j1:j2]]
    return "\n".join(out)


def pages() -> list[tuple[Path, str, str]]:
    """(page, the rung it compares with, the rung it is about) of every page with a diff of recipes: a
    rung page's "The diff from rung NN", or a line naming both files (the bonus pages)."""
    found = []
    for page in sorted(DOCS.glob("*.md")):
        text = page.read_text()
        if match := HEADING.search(text):
            found.append((page, match.group(1), page.stem))
        elif match := NAMED.search(text):
            found.append((page, match.group(1), match.group(2)))
    return found


def block(page: Path) -> tuple[int, int] | None:
    """Start and end offsets of the content of the ```diff block after the page's diff heading."""
    text = page.read_text()
    match = HEADING.search(text) or NAMED.search(text)
    if not match:
        return None
    start = text.index("```diff\n", match.end()) + len("```diff\n")
    return start, text.index("\n```", start)


def main(argv: list[str] | None = None) -> int:
    p = Parser(prog="python -m devtools.docs_diff", description=__doc__.splitlines()[0])
    p.add_argument("rungs", nargs="*", help="two rungs, e.g. 04 05")
    p.add_argument("--write", action="store_true", help="rewrite the diff block of every rung page")
    args = p.parse_args(argv)
    if args.write:
        for page, old, new in pages():
            start, end = block(page)
            text = page.read_text()
            page.write_text(text[:start] + render(old, new) + text[end:])
            print(f"docs_diff: {page.relative_to(REPO)} <- diff {old} {new}")
        return 0
    if len(args.rungs) != 2:
        p.error("give two rungs, or --write")
    print(render(*args.rungs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
