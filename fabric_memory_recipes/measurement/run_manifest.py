"""``run_all.json``: which results in a folder the last ``./run_all.sh`` there wrote.

A results folder collects JSON over several invocations: a ladder stopped by Ctrl-C after rung 03
leaves rungs 04-15 of the previous ladder in place. ``./run_all.sh`` therefore writes
``<results_dir>/run_all.json`` as it goes::

    {"what": "...", "started": 1767225600, "mode": "cpu", "state": "running" | "finished" | "stopped",
     "recipes": ["01_baseline", "02_mixed_precision", ...]}

``started`` is the invocation's start (seconds since the epoch) and ``recipes`` the runs it started so
far (``<recipe>[-<tag>]``). The file is rewritten as each recipe starts, so its modification time is
the start of the newest one: ``run_all.sh`` reads a recipe's status from a results JSON newer than it.

A results file was written by the invocation when its run is one the invocation started and the file
is not older than the invocation's start (its modification time). The report
(``fabric_memory_recipes.measurement.report.render``) shows those files in its table and figure, and every
other results file of the folder in a separate section, "Earlier runs". A folder without the file (a
single recipe's runs, the committed evidence) is shown whole, as before.
"""

from __future__ import annotations

import datetime as _dt
import json
import sys
from dataclasses import dataclass
from pathlib import Path

MANIFEST_FILE = "run_all.json"


@dataclass(frozen=True)
class Invocation:
    """What ``run_all.json`` says about the last ``./run_all.sh`` in a folder."""

    started: float
    recipes: tuple[str, ...]
    state: str

    def wrote(self, path: Path) -> bool:
        """Whether results file ``path`` (``<run>.json``, ``<run>.<status>.json``, ``<run>.rankN.json``)
        was written by this invocation: a run it started, and not older than its start."""
        stem = path.name.removesuffix(".json")
        ran = any(stem == run or stem.startswith(run + ".") for run in self.recipes)
        return ran and path.stat().st_mtime >= self.started

    def did_not_write(self, path: Path) -> bool:
        return not self.wrote(path)

    @property
    def when(self) -> str:
        return _dt.datetime.fromtimestamp(self.started, _dt.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")

    def earlier_note(self, only_earlier: bool) -> str:
        """The sentence above the earlier runs' table."""
        head = f"`./run_all.sh` of {self.when} ({self.state})"
        if only_earlier:
            return f"No run of the {head} wrote results here: every row below is from an earlier run."
        return (
            f"Results in this folder that the {head} did not write (it did not start their recipe, or it"
            " stopped before their recipe wrote anything): they come from earlier runs, with other code or"
            " flags perhaps, and are not part of the table above."
        )


def load(results_dir: str | Path) -> Invocation | None:
    """The folder's ``run_all.json``; None when there is none (or it cannot be read: one line says so)."""
    path = Path(results_dir) / MANIFEST_FILE
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        return Invocation(
            float(data["started"]), tuple(str(r) for r in data["recipes"]), str(data.get("state", "?"))
        )
    except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError) as e:
        print(f"report: ignoring {path}: unreadable ({type(e).__name__}); every run shown", file=sys.stderr)
        return None
