"""What each call of the convergence benchmark ran, for its report: the GPU time of all its calls, a line
per later call (``benchmark.json``'s ``later_calls``), and whether a call ran rungs with their own policy."""

from __future__ import annotations

from typing import Any


def device_seconds(summary: dict[str, Any]) -> float | None:
    """The GPU time of the benchmark over all its calls (the first call's and ``later_calls``'): each
    call's wall time times the GPUs it spread its runs over (``--gpus``), each of which it had to itself."""
    calls = [summary, *(summary.get("later_calls") or [])]
    calls = [c for c in calls if isinstance(c.get("wall_s"), int | float)]
    return sum(c["wall_s"] * ((c.get("settings") or {}).get("gpus") or 1) for c in calls) if calls else None


def later_call(call: dict[str, Any]) -> str:
    """A provenance line for a call that added runs the first one did not finish (benchmark.json's
    ``later_calls``: each a later call's own summary)."""
    ran = [r for r in call.get("runs") or [] if r.get("returncode") == 0]
    wall = call.get("wall_s")
    took = f" in {wall:.0f} s" if isinstance(wall, int | float) else ""
    settings = call.get("settings") or {}
    where = f" on {settings.get('gpus') or 1} × {settings['gpu_name']}" if settings.get("gpu_name") else ""
    own = "; ".join(
        f"{recipe} " + ", ".join(f"{k} {v:g}" for k, v in policy.items())
        for recipe, policy in (settings.get("tuned") or {}).items()
    )  # the rungs that ran a policy of their own (policy.TUNED)
    return (
        f"- a later call ({call.get('timestamp')}) added {len(ran)} runs{took}{where}:"
        f" `{call.get('command')}`{'; ' + call['note'] if call.get('note') else ''}"
        + (f"; rungs with a policy of their own: {own}" if own else "")
    )


def own_policy_note(summary: dict[str, Any]) -> str:
    """The report's words for rungs that ran a policy of their own (a call's ``tuned`` settings), or ''."""
    calls = [summary, *(summary.get("later_calls") or [])]
    if not any((c.get("settings") or {}).get("tuned") for c in calls):
        return ""
    return (
        " (except the rungs whose optimizer column names a warm-up or epochs of their own, and their"
        " learning rate, chosen on the validation split, never the test split: docs/accuracy.md)"
    )
