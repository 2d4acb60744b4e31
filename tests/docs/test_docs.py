"""The docs quote the code as it is: a rung page's diff is what ``diff`` of the two recipes gives
(devtools/docs_diff.py renders it), and every line of a Python excerpt on a page is a line of the
repository's code (the rung's recipe or fabric_memory_recipes/), so a change that is not carried to its page fails."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from devtools import docs_diff

REPO = Path(__file__).resolve().parents[2]
DOCS = REPO / "docs"
PYTHON_BLOCK = re.compile(r"^( *)```python\n(.*?)^\1```", re.M | re.S)


def test_every_rung_page_with_a_diff_section_is_found():
    pages = {page.stem for page, _, _ in docs_diff.pages()}
    assert {"02_mixed_precision", "05_gradient_accumulation", "12_optimizer_in_backward", "15_speed"} <= pages


@pytest.mark.parametrize(("page", "old", "new"), docs_diff.pages(), ids=lambda x: getattr(x, "stem", x))
def test_a_pages_diff_is_the_diff_of_the_recipes(page, old, new):
    start, end = docs_diff.block(page)
    quoted = page.read_text()[start:end]
    assert quoted == docs_diff.render(old, new), f"run: python -m devtools.docs_diff --write ({page.name})"


def _code_lines() -> set[str]:
    files = [*REPO.joinpath("fabric_memory_recipes").rglob("*.py"), *REPO.joinpath("recipes").glob("*.py")]
    return {line.strip() for f in files for line in f.read_text().splitlines() if line.strip()}


@pytest.mark.parametrize("page", sorted(DOCS.glob("*.md")), ids=lambda p: p.stem)
def test_python_excerpts_are_lines_of_the_code(page):
    code = _code_lines()
    missing = []
    for match in PYTHON_BLOCK.finditer(page.read_text()):
        for line in match.group(2).splitlines():
            text = line.strip()
            if text and text != "..." and text not in code:
                missing.append(text)
    assert not missing, (
        f"{page.name} quotes lines that are not in fabric_memory_recipes/ or recipes/: {missing}"
    )


def test_the_excerpt_check_can_fail():
    """Guard for the test above: a line that is not in the code is reported."""
    code = _code_lines()
    assert "optimizer.zero_grad(set_to_none=free_gradients)" in code
    assert (
        "optimizer.zero_grad(set_to_none=True)  # frees gradient memory before the next forward" not in code
    )


# ------------------------------------------------------------------------------- cited files exist
PATH_CITATION = re.compile(
    r"`((?:results|docs|fabric_memory_recipes|recipes|tests|experiments)/[^`\s*<>]*)`"  # a repository path
    r"|\]\((?!https?:|mailto:)([^)#\s]+)\)"  # a relative markdown link
)
# Paths a page names as what a command writes (the reader makes them), or results pending a GPU run.
# run_all.sh writes to runs/ now (not checked: not a repository path); README.md still names these two.
MADE_BY_A_COMMAND = (
    "results/cpu/",  # ./run_all.sh --cpu, before it wrote runs/cpu/
    "results/quick/",  # ./run_all.sh --quick on a GPU, before it wrote runs/quick/
)


def cited_paths(page: Path) -> list[tuple[int, str, Path]]:
    """(line, as written, resolved path) of every repository file or folder the page cites."""
    found = []
    for i, line in enumerate(page.read_text().splitlines(), 1):
        for m in PATH_CITATION.finditer(line):
            text = (m.group(1) or m.group(2)).rstrip(".,;")
            text = re.sub(
                r":[\w.:]*$", "", text
            )  # fabric_memory_recipes/training/loop.py:fit, tests/x.py::test_y name a part of the file
            base = REPO if m.group(1) else page.parent
            found.append((i, text, base / text))
    return found


def _pages() -> list[Path]:
    return [REPO / "README.md", *sorted(DOCS.glob("*.md")), *sorted((REPO / "results").rglob("README.md"))]


@pytest.mark.parametrize("page", _pages(), ids=lambda p: str(p.relative_to(REPO)))
def test_every_file_a_page_cites_is_in_the_repository(page):
    missing = [
        f"{page.name}:{i}: {text}"
        for i, text, path in cited_paths(page)
        if not path.exists() and not text.startswith(MADE_BY_A_COMMAND)
    ]
    assert not missing, missing


def test_the_citation_check_can_fail(tmp_path):
    page = tmp_path / "page.md"
    page.write_text(
        "See `results/no-such-run.json` and [a page](missing.md) and `fabric_memory_recipes/training/loop.py:fit`.\n"
    )
    cited = {text: path.exists() for _, text, path in cited_paths(page)}
    assert cited == {
        "results/no-such-run.json": False,
        "missing.md": False,
        "fabric_memory_recipes/training/loop.py": True,
    }
