"""Execute a notebook on this machine (CPU is enough) and write it back with its outputs.

    python -m devtools.execute_notebook docs/workshop.ipynb            # in place: the committed, executed copy
    python -m devtools.execute_notebook docs/workshop.ipynb --out X    # elsewhere (what the tests do)

The workshop notebook is committed executed, so a reader sees its outputs without running it; after a
change to it (or to what it calls), run this and commit the result. It runs from the repository root with
a time limit per cell, and fails (exit 1, the cell's error on stderr) if any cell raises.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import nbformat
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError

from fabric_memory_recipes.console import Parser

REPO = Path(__file__).resolve().parents[1]


def execute(path: str | Path, out: str | Path | None = None, timeout: int = 300) -> nbformat.NotebookNode:
    """Run every cell of ``path`` in a fresh python3 kernel started in the repository root; write the
    executed notebook to ``out`` (default: ``path`` itself) and return it."""
    nb = nbformat.read(path, as_version=4)
    client = NotebookClient(
        nb, timeout=timeout, kernel_name="python3", resources={"metadata": {"path": str(REPO)}}
    )
    client.execute()
    nbformat.write(nb, out or path)
    return nb


def main(argv: list[str] | None = None) -> int:
    p = Parser(
        prog="python -m devtools.execute_notebook",
        description=__doc__.splitlines()[0],
    )
    p.add_argument("notebook", help="the .ipynb to run")
    p.add_argument("--out", help="where the executed notebook goes (default: over the input)")
    p.add_argument("--timeout", type=int, default=300, help="seconds a cell may take")
    args = p.parse_args(argv)
    start = time.perf_counter()
    try:
        execute(args.notebook, args.out, args.timeout)
    except CellExecutionError as e:
        print(f"execute_notebook: a cell failed:\n{e}", file=sys.stderr)
        return 1
    print(f"execute_notebook: {args.out or args.notebook} executed in {time.perf_counter() - start:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
