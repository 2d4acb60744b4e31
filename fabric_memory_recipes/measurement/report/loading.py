"""The results JSON files of a directory, read for the report: the runs, sorted, and one line on stderr
for each file that is not one (the files beside the runs that are not runs are passed over quietly)."""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path

from fabric_memory_recipes.measurement import run_manifest
from fabric_memory_recipes.measurement.report.cells import sort_key
from fabric_memory_recipes.measurement.results_file import PREDICTED_FILE, SCHEMA_VERSION

# JSON beside the results that is not a run: other ranks' files, timelines, the prediction, run_all.json
COMPANION = re.compile(
    rf"\.rank\d+\.json$|-timeline\.json$|^({PREDICTED_FILE}|{run_manifest.MANIFEST_FILE})$"
)
JSON_TYPES = {
    dict: "an object without schema_version",
    list: "an array",
    str: "a string",
    bool: "a boolean",
    type(None): "null",
}


def load_results(results_dir: str | os.PathLike, select=None) -> list[dict]:
    """Read the schema-1 results JSON files directly inside `results_dir` (those ``select(path)`` keeps,
    when given), sorted by recipe then tag.

    The files beside the results that are not runs (``COMPANION``) are passed over; any other JSON that
    is unreadable, of the wrong shape or of another schema version is skipped with a line on stderr.
    """
    results = []
    for path in sorted(Path(results_dir).glob("*.json")):
        if COMPANION.search(path.name) or not path.is_file():
            continue
        if select is not None and not select(path):
            continue
        try:
            payload = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, ValueError) as exc:
            reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            print(f"report: skipping {path}: unreadable ({reason})", file=sys.stderr)
            continue
        if not isinstance(payload, dict) or "schema_version" not in payload:
            shape = JSON_TYPES.get(type(payload), "a number")
            print(f"report: skipping {path}: not a results file (wrong shape: {shape})", file=sys.stderr)
            continue
        if payload["schema_version"] != SCHEMA_VERSION or not payload.get("recipe"):
            print(f"report: skipping {path}: not a schema-{SCHEMA_VERSION} results file", file=sys.stderr)
            continue
        results.append(payload)
    return sorted(results, key=sort_key)
