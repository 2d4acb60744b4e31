"""The environment of a child process that runs this project's code (a recipe, a test run, a tool)."""

from __future__ import annotations

import os
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def project_env(code: Path | str = REPO, **extra: str) -> dict[str, str]:
    """This process's environment plus ``extra``, with ``code`` (a checkout whose package the child
    must import) first on ``PYTHONPATH`` and what was there kept after it: packages installed on
    ``PYTHONPATH`` (a carried torchao, say) stay importable in the child."""
    env = {**os.environ, **extra}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(code), os.environ.get("PYTHONPATH")) if p)
    return env
