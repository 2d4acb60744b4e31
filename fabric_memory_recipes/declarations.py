"""A recipe's declared rung, read from its source without running it.

A recipe declares its rung as ``RUNG = <SomeConfig>(...)`` (:class:`config.RunConfig`); the estimator, the
planners and the convergence tool read the keywords that are literals from the file (or, in a wheel,
from ``data/rungs.json``), without importing Lightning or the recipe's own imports.
"""

from __future__ import annotations

import ast
import dataclasses
import json
from pathlib import Path
from typing import Any

from fabric_memory_recipes.config import DATA_DIR, RECIPES_DIR, RENAMED_FIELDS, RunConfig


def _literals(call: ast.Call, known: set[str]) -> dict[str, Any]:
    """The literal keyword arguments of ``call`` that name a field in ``known`` (or a RENAMED_FIELDS key)."""
    values = {}
    for kw in call.keywords:
        if (name := RENAMED_FIELDS.get(kw.arg, kw.arg)) in known:
            try:
                values[name] = ast.literal_eval(kw.value)
            except ValueError:  # e.g. model_choices=hf_models.BIGBIRD: not needed without the recipe
                continue
    return values


def recipe_literals(path: Path) -> dict[str, Any]:
    """``{"values": the literal keywords of the RUNG = <SomeConfig>(...) in path, "doc": its docstring's
    first line}``, read from the source without running it."""
    tree = ast.parse(path.read_text())
    for node in tree.body:
        if (
            isinstance(node, ast.Assign)
            and [getattr(t, "id", None) for t in node.targets] == ["RUNG"]
            and isinstance(node.value, ast.Call)
        ):
            doc = (ast.get_docstring(tree) or "").splitlines()
            return {
                "values": _literals(node.value, {f.name for f in dataclasses.fields(RunConfig)}),
                "doc": doc[0] if doc else "",
            }
    raise ValueError(f"{path}: no `RUNG = RunConfig(...)` declaration")


def declared_rung(name: str, folder: Path = RECIPES_DIR) -> tuple[RunConfig, str]:
    """The ``RUNG = <SomeConfig>(...)`` of ``recipes/<name>.py`` (a unique prefix such as ``05`` is
    enough) and the first line of its docstring, read from the source without running it.

    The estimator and the convergence tool need a rung's configuration but neither Lightning nor the
    recipe's own imports (seconds per process); a rung's declaration is a call with keyword values,
    and those that are literals for :class:`RunConfig` fields make the configuration (a recipe's own
    flags, e.g. rung 10's ``reentrant``, do not change what is estimated). A wheel reads data/rungs.json."""
    shipped = json.loads((DATA_DIR / "rungs.json").read_text()) if not folder.is_dir() else None
    names = sorted(shipped) if shipped is not None else [m.stem for m in sorted(folder.glob(f"{name}*.py"))]
    matches = [name] if name in names else [n for n in names if n.startswith(name)]
    if len(matches) != 1:
        raise FileNotFoundError(
            f"recipe {name!r}: expected one match in {folder}, found {', '.join(matches) or 'none'}"
        )
    got = shipped[matches[0]] if shipped is not None else recipe_literals(folder / f"{matches[0]}.py")
    values = {
        RENAMED_FIELDS.get(k, k): tuple(v) if isinstance(v, list) else v for k, v in got["values"].items()
    }
    return RunConfig(**values), got["doc"]
