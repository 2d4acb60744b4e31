"""Is fast mode correct? Each rung's fast and eager modes from the same start, parameters compared.

    python -m devtools.check_equivalence                      # every single-GPU rung, on the GPU
    FMR_PUBLISH=1 python -m devtools.check_equivalence --rungs 05,14 --steps 12 --out results/published/h100/compare

For every rung, one child process runs the recipe twice with the same seed, weights and batches: in
eager mode, then in fast mode (compiled blocks, one CUDA graph per optimizer step), each for ``--steps``
optimizer steps, and keeps the parameters before and after. Silently wrong gradients are the known
failure of CUDA graphs with accumulation (a micro-batch's gradient overwritten, learning rates or step
counters frozen at capture), so this compares results, not just that both ran.

Two checks:
- ``compile+graphs, fp32``: the rung in fp32 with TF32 off (``--precision 32-true --no-tf32``), so that
  the only difference between the runs is the fast machinery. Rungs 02 and 03 differ from 01 only in
  precision, so their fp32 copies are rung 01's and are not repeated; rung 15's batch is 64 here (its
  fp32 copy at 256 would not fit the GPU).
- ``graphs, <precision>``: rungs 02 (16-mixed: the gradient scaler is inside the graph), 03 and 05
  (bf16-true) in their own precision, CUDA graphs without compilation: replays run the same kernels as
  the eager steps, so any difference is the capture's.

Tolerance, two parts, both against what the eager run changed (``after - before``):
- ``rel_l2`` = ||fast - eager|| / ||eager change|| over all parameters must be at most 1%. A wrong step
  moves parameters by a large part of an update: a frozen learning rate or bias correction, a lost or
  doubled micro-batch (the control below: 59%). Reordered fp32 arithmetic moves them by ~1e-4 of it.
- ``max_abs_diff`` (largest |fast - eager| over all elements) must be at most ``tolerance`` = half of
  ``max_change`` (the eager run's largest element change). Element-wise the bound must be loose: Adam
  divides each gradient by its own running magnitude, so a parameter whose gradient is at rounding level
  moves by up to a full learning rate either way; compiled fp32 kernels round differently and flip a
  few of those (measured on an H100, rung 05 fp32: largest element 14% of the largest change, while
  rel_l2 was 1.5e-4; with SGD the largest element differed by 1e-5 of it).
A control row shows the check fails on a known bug: rung 06 in fast mode with the learning rates frozen
at capture (``expected_ok: false``).

Output: ``<out>/equivalence.json``, a list of rows ``{"rung", "check", "steps", "max_abs_diff",
"tolerance", "ok", "max_change", "rel_l2", "rel_l2_tolerance", "expected_ok"}``, and a table on stdout. Exit 1 if a row's
``ok`` differs from its ``expected_ok``.
"""

from __future__ import annotations

import argparse
import json
import runpy
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path

import torch

from fabric_memory_recipes.console import Parser
from fabric_memory_recipes.declarations import declared_rung
from fabric_memory_recipes.measurement.results_file import write_json_atomic
from fabric_memory_recipes.paths import output_folder
from fabric_memory_recipes.processes import project_env
from fabric_memory_recipes.tools.compare.plan import SINGLE_GPU_RUNGS
from fabric_memory_recipes.training import graphs, loop

REPO = Path(__file__).resolve().parents[1]
OWN_PRECISION = ("02", "03")  # graphs-only checks in the rung's own precision (and every compensated rung)
STOCHASTIC_TOO = ("03",)  # plain by default (it teaches the loss); stochastic one flag away
FP32_REDUNDANT = ("02", "03")  # their fp32 copies are rung 01's
REL_L2_TOLERANCE = 0.01  # of the eager run's change, over all parameters
ELEMENT_TOLERANCE = 0.5  # of the eager run's largest element change
# Known bugs the check must catch (rows expected to fail), on rung 06 (SGD + cosine)
CONTROLS = {
    "06": [
        ("lr", "learning rates frozen at capture"),
        ("rounding", "stochastic rounding draws other random bits than eager"),
    ]
}


def recipe_path(rung: str) -> Path:
    found = sorted((REPO / "recipes").glob(f"{rung}_*.py"))
    if not found:
        raise SystemExit(f"check_equivalence: no recipe for rung {rung}")
    return found[0]


# ----------------------------------------------------------------------------------------------- child
def _run_recipe(path: Path, argv: list[str], results_dir: str) -> dict:
    """Run the recipe as __main__ with ``argv``; return its parameters before and after training."""
    seen: dict = {}
    original_fit = loop.fit

    def fit(fabric, model, *args, **kwargs):
        seen["before"] = parameters_by_name(model)
        original_fit(fabric, model, *args, **kwargs)
        seen["after"] = parameters_by_name(model)

    loop.fit = fit
    sys.argv = [str(path), *argv, "--results-dir", results_dir]
    try:
        runpy.run_path(str(path), run_name="__main__")
    except SystemExit as e:
        if e.code not in (0, None):
            raise RuntimeError(f"{path.name} {' '.join(argv)} exited with {e.code}") from None
    finally:
        loop.fit = original_fit
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    if "after" not in seen:
        raise RuntimeError(f"{path.name} did not train")
    return seen


def parameter_name(name: str) -> str:
    """A parameter's name without the wrappers' segments: Fabric's ``_forward_module.`` and
    torch.compile's ``_orig_mod.`` (a rung that compiles the whole model in fast mode, like 15, names
    its parameters through both; the eager run through Fabric's only)."""
    return ".".join(part for part in name.split(".") if part not in ("_forward_module", "_orig_mod"))


def parameters_by_name(model) -> dict:
    """fp32 CPU copies of the model's parameters, keyed by :func:`parameter_name`."""
    return {parameter_name(n): p.detach().float().cpu().clone() for n, p in model.named_parameters()}


def compare(eager: dict, fast: dict) -> dict:
    """The numbers of one row: largest element difference, the eager change it is measured against."""
    diff = change = 0.0
    diff_sq = change_sq = 0.0
    if set(eager["after"]) != set(fast["after"]):
        missing = sorted(set(eager["after"]) ^ set(fast["after"]))[:3]
        raise RuntimeError(f"the two runs have different parameters ({', '.join(missing)})")
    for name, after in eager["after"].items():
        d = (fast["after"][name] - after).abs()
        c = (after - eager["before"][name]).abs()
        if not torch.equal(fast["before"][name], eager["before"][name]):
            raise RuntimeError(f"the two runs started from different parameters ({name})")
        diff, change = max(diff, d.max().item()), max(change, c.max().item())
        diff_sq += d.double().square().sum().item()
        change_sq += c.double().square().sum().item()
    tolerance = ELEMENT_TOLERANCE * change
    rel_l2 = (diff_sq**0.5) / (change_sq**0.5) if change_sq else None
    return {
        "max_abs_diff": diff,
        "tolerance": tolerance,
        "ok": bool(change > 0 and diff <= tolerance and rel_l2 <= REL_L2_TOLERANCE),
        "max_change": change,
        "rel_l2": rel_l2,
        "rel_l2_tolerance": REL_L2_TOLERANCE,
    }


def compensated(rung: str) -> bool:
    """Whether the rung's declared default stores bf16 updates with stochastic rounding (rungs 04-07, 10-15)."""
    return declared_rung(recipe_path(rung).stem)[0].bf16_update != "plain"


def checks_for(rung: str) -> list[tuple[str, list[str], list[str]]]:
    """The checks of one rung: (name, flags of both runs, flags of the fast run)."""
    checks = []
    if rung not in FP32_REDUNDANT:
        flags = ["--precision", "32-true", "--no-tf32"] + (["--batch-size", "64"] if rung == "15" else [])
        checks.append(("compile+graphs, fp32", flags, ["--mode", "fast"]))
    graphs_only = ["--mode", "fast", "--no-compile"]
    small = ["--batch-size", "64"] if rung == "15" else []  # its batch of 256 uncompiled: slow, for nothing
    if rung in OWN_PRECISION or compensated(rung):
        name = "graphs, own precision" + (", stochastic" if compensated(rung) else "")
        checks.append((name, small, graphs_only))
    if rung in STOCHASTIC_TOO:  # the compensated update one flag away
        checks.append(("graphs, own precision, stochastic", ["--bf16-update", "stochastic"], graphs_only))
    return checks


def _control(path: Path, patch: str, argv: list[str], tmp: str) -> dict:
    """The fast run with a known bug (``patch``): the learning rates frozen at capture, or the rounding's
    random bits drawn from another generator state than the eager run's (reseeded after the capture)."""
    if patch == "lr":
        name, real = "sync", graphs.LearningRates.sync

        def broken(self, real=real):  # the bug: learning rates stay as at capture
            if not getattr(self, "_synced_once", False):
                self._synced_once = True
                real(self)

        owner = graphs.LearningRates
    else:
        name, real, owner = "_capture", graphs.StepGraph._capture, graphs.StepGraph

        def broken(self, group_size, real=real):  # replays draw other random bits than eager steps
            real(self, group_size)
            torch.cuda.manual_seed(12345)

    setattr(owner, name, broken)
    try:
        return _run_recipe(path, argv, tmp)
    finally:
        setattr(owner, name, real)


def child(
    rung: str, steps: int, out: Path, accelerator: str | None, model: str | None, only: str = ""
) -> None:
    """Every check of one rung, in this process; rows written to ``out`` (JSON)."""
    path = recipe_path(rung)
    common = ["--data", "synthetic", "--weights", "none", "--max-steps", str(steps), "--eval-batches", "1"]
    if accelerator:
        common += ["--accelerator", accelerator]
    if model:
        common += ["--model", model]
    rows = []
    with tempfile.TemporaryDirectory(prefix="equivalence-") as tmp:
        for check, flags, fast_flags in [c for c in checks_for(rung) if only in c[0]]:
            eager = _run_recipe(path, common + flags + ["--mode", "eager", "--tag", "eager"], tmp)
            fast = _run_recipe(path, common + flags + fast_flags + ["--tag", "fast"], tmp)
            result = json.loads((Path(tmp) / f"{path.stem}-fast.json").read_text())
            precision, update = result["config"]["precision"], result["config"]["bf16_update"]
            row = {
                "rung": rung,
                "check": check.replace("own precision", precision),
                "steps": steps,
                "bf16_update": update,
                "cuda_graphs": result["config"]["cuda_graphs"],
                "compile": result["config"]["compile"],
            }
            rows.append(row | compare(eager, fast) | {"expected_ok": True})
            for patch, what in CONTROLS.get(rung, []):
                if check.startswith("compile") == (patch == "lr"):  # lr: fp32 row; rounding: its own row
                    broken = _control(path, patch, common + flags + fast_flags + ["--tag", "control"], tmp)
                    rows.append(
                        row
                        | {"check": f"control: {what} (must fail)"}
                        | compare(eager, broken)
                        | {"expected_ok": False}
                    )
    out.write_text(json.dumps(rows, indent=2) + "\n")


# ---------------------------------------------------------------------------------------------- parent
def _child_cmd(rung: str, steps: int, out: Path, args) -> list[str]:
    cmd = [sys.executable, "-m", "devtools.check_equivalence", "--child", rung, "--steps", str(steps),
           "--child-out", str(out)]  # fmt: skip
    if args.accelerator:
        cmd += ["--accelerator", args.accelerator]
    if args.model:
        cmd += ["--model", args.model]
    return cmd + (["--checks", args.checks] if args.checks else [])


def table(rows: list[dict]) -> str:
    lines = [
        "| rung | check | steps | max abs diff | tolerance | max change | rel. L2 (tolerance 0.01) | ok |",
        "|---|---|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        expected = "" if r.get("expected_ok", True) else " (expected: no)"
        num = lambda v: "-" if v is None else format(v, ".3g")  # noqa: E731
        lines.append(
            f"| {r['rung']} | {r['check']} | {r['steps']} | {num(r['max_abs_diff'])} | {num(r['tolerance'])} |"
            f" {num(r['max_change'])} | {num(r['rel_l2'])} | {'yes' if r['ok'] else 'no'}{expected} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = Parser(description=__doc__)
    p.add_argument(
        "--rungs",
        default=",".join(SINGLE_GPU_RUNGS),
        help="comma-separated rung numbers (default: %(default)s)",
    )
    p.add_argument(
        "--steps", type=int, default=12, help="optimizer steps per run, >= 10 (default: %(default)s)"
    )
    p.add_argument(
        "--out",
        default="runs/equivalence",
        type=output_folder("--out"),
        help="folder for equivalence.json (default: %(default)s)",
    )
    p.add_argument(
        "--parallel", type=int, default=3, help="rungs checked at once on the GPU (default: %(default)s)"
    )
    p.add_argument("--accelerator", help="passed to the recipes (tests: cpu)")
    p.add_argument("--model", help="passed to the recipes (tests: vit_tiny)")
    p.add_argument("--checks", default="", help="only the checks whose name contains this (e.g. stochastic)")
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--child-out", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        child(args.child, args.steps, Path(args.child_out), args.accelerator, args.model, args.checks)
        return 0
    rungs = [r.strip() for r in args.rungs.split(",") if r.strip()]
    unknown = [r for r in rungs if r not in SINGLE_GPU_RUNGS]
    if unknown:
        print(
            f"check_equivalence: unknown rung(s) {', '.join(unknown)}; choose from {', '.join(SINGLE_GPU_RUNGS)}",
            file=sys.stderr,
        )
        return 2
    if args.steps < 10:
        print(
            "check_equivalence: --steps must be >= 10 (the first 3 steps are warm-up and capture)",
            file=sys.stderr,
        )
        return 2
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    env = project_env()
    start = time.time()

    def run(rung: str) -> list[dict]:
        part = out_dir / f".equivalence-{rung}.json"
        log = out_dir / f"equivalence-{rung}.log"
        with open(log, "w") as f:
            proc = subprocess.run(
                _child_cmd(rung, args.steps, part, args),
                cwd=REPO,
                env=env,
                stdout=f,
                stderr=subprocess.STDOUT,
            )
        if proc.returncode != 0 or not part.exists():
            print(f"[equivalence] rung {rung}: child failed (exit {proc.returncode}), see {log}", flush=True)
            return [
                {
                    "rung": rung,
                    "check": "failed to run",
                    "steps": args.steps,
                    "max_abs_diff": None,
                    "tolerance": None,
                    "ok": False,
                    "max_change": None,
                    "rel_l2": None,
                    "expected_ok": True,
                    "log": str(log),
                }
            ]
        rows = json.loads(part.read_text())
        part.unlink()
        for r in rows:
            print(
                f"[equivalence] rung {rung} {r['check']}: rel. L2 {r['rel_l2']:.3g}, max diff"
                f" {r['max_abs_diff']:.3g} (tolerance {r['tolerance']:.3g}) -> {'ok' if r['ok'] else 'DIFFERENT'}"
                f" ({time.time() - start:.0f} s)",
                flush=True,
            )
        return rows

    path = out_dir / "equivalence.json"
    done: dict[str, list[dict]] = {}
    with ThreadPoolExecutor(max(1, args.parallel)) as pool:
        futures = {pool.submit(run, rung): rung for rung in rungs}
        for future in as_completed(futures):  # the file after every rung: a killed call keeps what it checked
            done[futures[future]] = future.result()
            rows = [r for rung in rungs for r in done.get(rung, [])]
            write_json_atomic(str(path), rows)  # type: ignore[arg-type]  # a reader never sees half a file
    print(table(rows))
    bad = [r for r in rows if r["ok"] != r.get("expected_ok", True)]
    print(f"{len(rows) - len(bad)} of {len(rows)} rows as expected; {path} ({time.time() - start:.0f} s)")
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
