"""``fmr-ladder``: run ``./run_all.sh`` of the checkout this package was installed from, from any folder.

The recipes are scripts of the repository (``recipes/NN_*.py``), not modules of the package, so the
ladder needs the checkout: an editable install (``pip install -e .``, as the README says) has it beside
the package. Every argument goes to ``run_all.sh`` unchanged (``fmr-ladder --quick``, ``fmr-ladder --only
01,05``, ``fmr-ladder --help``); the runs' folders are relative to the checkout, as with ``./run_all.sh``.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from fabric_memory_recipes import processes
from fabric_memory_recipes.console import fail

CHECKOUT = Path(__file__).resolve().parents[2]


def run_all_script(checkout: Path = CHECKOUT) -> Path:
    """The checkout's ``run_all.sh``; one line and exit 2 when the package was installed without it."""
    script = checkout / "run_all.sh"
    if not (script.is_file() and (checkout / "recipes").is_dir()):
        fail(
            f"no run_all.sh and recipes/ beside the installed package ({checkout}): the ladder runs from a"
            " checkout of the repository; install it with: python3 -m pip install -e <checkout>"
        )
    return script


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if not processes.in_checkout(CHECKOUT) and {"-h", "--help"} & set(args):
        print(
            __doc__.strip()
            + f"\n\nThis install has no checkout beside it ({CHECKOUT}): clone the repository,"
            " then in it: python3 -m pip install -e . && fmr-ladder --help"
        )
        return 0
    script = run_all_script()
    env = {
        **os.environ,
        "PYTHON": os.environ.get("PYTHON", sys.executable),
    }  # the interpreter of this install
    os.execve("/bin/bash", ["bash", str(script), *args], env)
    return 0  # not reached: execve replaces this process


if __name__ == "__main__":
    raise SystemExit(main())
