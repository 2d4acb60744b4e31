"""``fmr-estimate --model SOURCE:NAME --fit SIZE --measure``: run the planner's top technique sets on the GPU at
hand, a few steps each on the emulated card, and rank them by what they did.

Each set runs as its own ``recipes/your_model.py`` process, one after another (a clean GPU for each, so
their speeds compare), with ``--memory-budget-gb SIZE``: the caching allocator is capped at the card less
the measured card overhead, as the planner assumes (config.py). ``--data synthetic --weights none
--eval-batches 1``: memory and speed do not depend on the values. A set fits when it finished and its
whole-device peak (NVML, the process's own) is within the card; the measured ranking is the fitting sets by
measured samples/s (the median between optimizer steps after the warm-up).

Each run starts from the user's environment, ``PYTORCH_CUDA_ALLOC_CONF`` as the user set it or unset (the
planner's own resolved configuration leaves it as it was: cli.py), and the runner sets its own set's
allocator before CUDA starts (config.py): expandable segments for a fast set, the default for an eager one,
as each set's prediction assumed (sets.py ``allocator_of_set``). A setting of the user's is kept for every
set, as fast mode keeps it (said once: the predictions assumed the runner's own settings).

Writes ``DIR/plan.json`` (every set: the command, predicted and measured peak and speed, status, the
run's results JSON) after each run, so a stopped call keeps what finished, and ``DIR/plan.md``, the table.
"""

from __future__ import annotations

import json
import shlex
import sys
import time
from pathlib import Path
from typing import Any

from fabric_memory_recipes.measurement.results_file import write_atomic, write_json_atomic
from fabric_memory_recipes.processes import REPO, Run, execute, run_env

RUNNER = REPO / "recipes" / "your_model.py"
RUN_ARGS = ("--data", "synthetic", "--weights", "none", "--eval-batches", "1")


def run_argv(choice_argv: list[str], budget_gb: float, steps: int, results_dir: Path) -> list[str]:
    return [sys.executable, str(RUNNER), *choice_argv, *RUN_ARGS, "--max-steps", str(steps),
            "--memory-budget-gb", f"{budget_gb:g}", "--results-dir", str(results_dir)]  # fmt: skip


def _read(path: Path) -> dict[str, Any]:
    """What a run's results JSON says: status, whole-run peak reserved, whole device, samples/s."""
    try:
        d = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    memory, timing = d.get("memory") or {}, d.get("timing") or {}
    reserved = [
        v for v in (memory.get("run_peak_reserved_gb"), memory.get("peak_reserved_gb")) if v is not None
    ]
    return {
        "status": d.get("status"),
        "error": d.get("error"),
        "peak_reserved_gb": max(reserved, default=None),
        "device_peak_gb": memory.get("device_peak_gb"),
        "images_per_s": timing.get("images_per_s"),
        "cuda_alloc_conf": (d.get("provenance") or {}).get("cuda_alloc_conf"),
    }


def measure(
    rows: list[dict[str, Any]],
    budget_gb: float,
    out: Path,
    steps: int = 15,
    timeout: float = 300.0,
    say=print,
) -> list[dict[str, Any]]:
    """Run each row's ``argv`` (the planner's order) and fill in what it measured; rank them."""
    out.mkdir(parents=True, exist_ok=True)
    env = run_env(str(out / "logs"))
    if users := env.get("PYTORCH_CUDA_ALLOC_CONF"):
        say(
            f"PYTORCH_CUDA_ALLOC_CONF={users} (yours) is kept for every set; the predictions assumed the"
            " runner's own settings (fast mode: expandable segments; eager: the default)"
        )
    start = time.perf_counter()
    for i, row in enumerate(rows, 1):
        folder = out / "runs" / f"{i:02d}"
        cmd = run_argv(row["argv"], budget_gb, steps, folder)
        say(f"[measure {i}/{len(rows)}, {time.perf_counter() - start:.0f} s] {row['label']} ...")
        run = Run("project", "your_model", None, cmd, folder / "your_model.json", folder.with_suffix(".log"))
        proc = execute(run, env, timeout)  # removes an older run's results JSON first
        got = _read(folder / "your_model.json")
        status = got.get("status") or proc["status"]
        device = got.get("device_peak_gb")
        row.update(
            {
                "status": status,
                "run_command": shlex.join(cmd),
                "wall_s": round(proc["wall_s"], 1),
                "error": got.get("error") or proc.get("error"),
                "measured_peak_reserved_gb": got.get("peak_reserved_gb"),
                "measured_device_peak_gb": device,
                "cuda_alloc_conf": got.get("cuda_alloc_conf"),  # the allocator's settings the run had
                "measured_samples_per_s": got.get("images_per_s") if status == "ok" else None,
                "fits": status == "ok" and device is not None and device <= budget_gb,
                "result_json": str((folder / "your_model.json").relative_to(out)) if got else None,
            }
        )
        say("    " + _outcome(row))
        write(out, rows, budget_gb)
    return ranked(rows)


def ranked(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The sets that fit, fastest measured first."""
    return sorted((r for r in rows if r.get("fits")), key=lambda r: -r["measured_samples_per_s"])


def _outcome(row: dict[str, Any]) -> str:
    if row["status"] != "ok":
        return f"{row['status']}: {row.get('error') or 'no results JSON'} ({row['wall_s']:.0f} s)"
    device = row["measured_device_peak_gb"]
    return (
        f"{row['measured_samples_per_s']:.1f} samples/s (predicted {row['predicted_samples_per_s']:.1f}),"
        f" whole device {_gb(device)} GB (predicted {row['predicted_device_peak_gb']:.2f})"
        + ("" if row["fits"] else ": over the card")
        + f" ({row['wall_s']:.0f} s)"
    )


def _gb(value: float | None) -> str:
    return "—" if value is None else f"{value:.2f}"


def render(rows: list[dict[str, Any]], budget_gb: float) -> str:
    order = {id(r): i for i, r in enumerate(ranked(rows), 1)}
    lines = [
        f"| measured rank | predicted rank | technique set | predicted samples/s | measured | predicted device GB"
        f" | measured (card {budget_gb:g} GB) | status |",
        "|---:|---:|---|---:|---:|---:|---:|---|",
    ]
    for i, r in enumerate(rows, 1):
        speed = r.get("measured_samples_per_s")
        lines.append(
            f"| {order.get(id(r), '—')} | {i} | `{r['command']}` | {r['predicted_samples_per_s']:.1f}"
            f" | {'—' if speed is None else f'{speed:.1f}'} | {r['predicted_device_peak_gb']:.2f}"
            f" | {_gb(r.get('measured_device_peak_gb'))} | {r.get('status', 'not run')} |"
        )
    return "\n".join(lines) + "\n"


def write(
    out: Path, rows: list[dict[str, Any]], budget_gb: float, extra: dict[str, Any] | None = None
) -> None:
    best = ranked(rows)
    write_json_atomic(
        str(out / "plan.json"),
        {
            **(extra or {}),
            "budget_gb": budget_gb,
            "sets": rows,
            "measured_pick": best[0]["command"] if best else None,
            "predicted_pick": rows[0]["command"] if rows else None,
        },
    )
    write_atomic(out / "plan.md", lambda f: f.write(render(rows, budget_gb)))
