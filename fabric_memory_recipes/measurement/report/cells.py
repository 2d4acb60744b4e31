"""What the report and the comparison share: dotted look-ups in a results JSON, number cells, and
writing generated text into files (whole, or into a marked block of a document)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from fabric_memory_recipes.measurement.results_file import write_atomic

DASH = "—"


def get(d: Any, dotted: str, default: Any = None) -> Any:
    """Nested lookup that tolerates missing keys and nulls: a partial JSON renders, it does not crash."""
    for key in dotted.split("."):
        if not isinstance(d, dict) or d.get(key) is None:
            return default
        d = d[key]
    return d


def num(value: Any, decimals: int) -> str:
    return DASH if not isinstance(value, int | float) else f"{value:.{decimals}f}"


def write_text(path: Path, text: str) -> None:
    write_atomic(path, lambda f: f.write(text))


def update_block(document: str, block: str, content: str) -> str:
    """Replace the text between ``<!-- results:BLOCK:start -->`` and ``<!-- results:BLOCK:end -->``.

    This is how the top-level README shows measured tables without anyone copying numbers by hand.
    """
    start, end = f"<!-- results:{block}:start -->", f"<!-- results:{block}:end -->"
    i, j = document.find(start), document.find(end)
    if i < 0 or j < i:
        raise ValueError(f"markers {start} ... {end} not found")
    return document[: i + len(start)] + "\n" + content.rstrip() + "\n" + document[j:]


def sort_key(result: dict) -> tuple[str, str, bool, str]:
    """Recipe, then tag (untagged first): the order of the file names `<recipe>[-<tag>].json`; a run
    that did not succeed, kept beside a successful one (`<recipe>[-<tag>].<status>.json`), after it."""
    status = str(result.get("status") or "")
    return (str(result.get("recipe") or ""), str(result.get("tag") or ""), status != "ok", status)


def label(result: dict) -> str:
    tag = result.get("tag")
    return f"{result.get('recipe')} ({tag})" if tag else str(result.get("recipe"))


def mode_label(result: dict) -> str:
    """How the steps ran: "eager", "compiled" (torch.compile) and/or "graphs" (one CUDA graph per step)."""
    parts = [
        name
        for name, key in (("compiled", "config.compile"), ("graphs", "config.cuda_graphs"))
        if get(result, key)
    ]
    return " + ".join(parts) if parts else "eager"


def is_text(result: dict) -> bool:
    """Text runs (the bonus recipes) record their padded sequence length; images do not."""
    return get(result, "provenance.tokens_per_sample") is not None


def write_into_block(readme: str, content: str, what: str) -> int:
    """``--readme PATH:BLOCK``: put ``content`` into the marked block of the file; 0, or 2 with one line
    on stderr when the file or its markers are not there."""
    path, _, block = readme.rpartition(":")
    try:
        text = update_block(Path(path).read_text(), block, content)
    except (OSError, ValueError) as e:
        print(f"report: --readme {readme}: {e}", file=sys.stderr)
        return 2
    write_text(Path(path), text)
    print(f"report: {what} -> {path} (block {block})")
    return 0


def provenance_lines(results: list[dict]) -> list[str]:
    """One line per distinct (device, world size, versions, data, weights): what produced the numbers."""
    groups: dict[tuple, list[str]] = {}
    for r in results:
        p = r.get("provenance") or {}
        key = (
            p.get("gpu_name") or "CPU",
            *(p.get(k) for k in ("world_size", "torch", "lightning", "data_source", "weights")),
        )
        groups.setdefault(key, []).append(label(r))
    return [
        f"- **{device}** · world size {world if world is not None else '?'} · torch {torch_v} · lightning {lightning_v}"
        f" · data: {data} · weights: {weights} — {', '.join(labels)}"
        for (device, world, torch_v, lightning_v, data, weights), labels in groups.items()
    ]


def format_extra(value: Any) -> str:
    if isinstance(value, dict):
        return " · ".join(f"{k} {format_extra(v)}" for k, v in value.items())
    if isinstance(value, float):
        return f"{value:.2f}" if abs(value) >= 0.01 or value == 0 else f"{value:.3g}"
    return "n/a" if value is None else str(value)
