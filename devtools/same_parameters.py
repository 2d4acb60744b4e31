"""Does a recipe train to the same parameters at two commits? Run it at both, compare its checkpoints.

    python -m devtools.same_parameters --base 89b2df1                      # 08_fsdp2, 2 gloo processes
    python -m devtools.same_parameters --base 89b2df1 --recipe 05 -- --accelerator cpu --model vit_tiny ...

The recipe runs once in a temporary ``git worktree`` of ``--base`` and once in this checkout, as
``python recipes/<recipe>.py`` with the same flags (each with its own checkout first on ``PYTHONPATH``), and
saves a checkpoint after ``--step`` optimizer steps. The parameters in the two checkpoints (a sharded one
is gathered from its shards) are compared tensor by tensor; so are the logged loss curves. It prints one
line per tensor that differs and a summary, writes ``--out`` (JSON), and exits 0 when every tensor is
equal (bit for bit, or within ``--atol`` when given), 1 otherwise. A refactoring that must not change
what a rung computes is checked this way on a CPU, several ranks included.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from fabric_memory_recipes.config import UsageError
from fabric_memory_recipes.console import Parser
from fabric_memory_recipes.paths import check_output_folder, name_type
from fabric_memory_recipes.processes import project_env

REPO = Path(__file__).resolve().parents[1]
DEFAULT_FLAGS = [
    "--accelerator", "cpu", "--devices", "2", "--model", "vit_tiny", "--data", "synthetic",
    "--weights", "none", "--batch-size", "8", "--lr", "1e-3", "--eval-batches", "1", "--log-every", "1",
]  # fmt: skip


def run(checkout: Path, recipe: str, flags: list[str], out: Path, step: int, data_dir: Path) -> dict:
    """The recipe at ``checkout``: ``step + 1`` optimizer steps, a checkpoint after ``step``."""
    script = next((checkout / "recipes").glob(f"{recipe}*.py"))
    argv = [sys.executable, str(script), *flags, "--data-dir", str(data_dir), "--max-steps", str(step + 1),
            "--checkpoint-every", str(step), "--checkpoint-dir", str(out / "ckpt"),
            "--results-dir", str(out / "results")]  # fmt: skip
    env = project_env(checkout, FMR_OFFLINE="1", FMR_LOG_DIR=str(out / "logs"))
    env.setdefault("TORCHDYNAMO_DISABLE", "1")
    proc = subprocess.run(argv, cwd=checkout, env=env, capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        raise SystemExit(f"same_parameters: {script} failed at {checkout}:\n{proc.stderr[-3000:]}")
    ckpt = out / "ckpt" / f"step-{step:06d}.ckpt"
    if ckpt.is_dir():  # sharded: gather the shards into one file
        gathered = out / "gathered.pt"
        dcp_to_torch_save(str(ckpt), str(gathered))
        ckpt = gathered
    state = torch.load(ckpt, map_location="cpu", weights_only=False)
    results = json.loads(next((out / "results").glob(f"{script.stem}*.json")).read_text())
    return {"model": state["model"], "loss": results["loss"]["curve"], "status": results["status"]}


def main(argv: list[str] | None = None) -> int:
    p = Parser(
        prog="python -m devtools.same_parameters",
        description=__doc__.splitlines()[0],
    )
    p.add_argument("--base", required=True, help="the commit to compare this checkout with")
    p.add_argument(
        "--recipe", default="08_fsdp2", type=name_type("--recipe"), help="a recipe name or its rung prefix"
    )
    p.add_argument("--step", type=int, default=3, help="compare the parameters after this many steps")
    p.add_argument(
        "--atol", type=float, default=0.0, help="largest difference allowed (default: bit for bit)"
    )
    p.add_argument(
        "--out", default="runs/same_parameters.json", type=Path, help="where the comparison is written"
    )
    p.add_argument("flags", nargs="*", help="the recipe's flags (after --); default: 2 CPU ranks, vit_tiny")
    args = p.parse_args(argv)
    try:
        check_output_folder(args.out.parent, "--out")
    except UsageError as e:
        p.error(str(e))
    flags = args.flags or DEFAULT_FLAGS
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True)
    tmp = Path(tempfile.mkdtemp(prefix="same-parameters-"))
    base = tmp / "base"
    subprocess.run(
        ["git", "worktree", "add", "--detach", str(base), args.base],
        cwd=REPO,
        check=True,
        capture_output=True,
    )
    try:
        data_dir = tmp / "data"  # one synthetic stand-in for both runs
        before = run(base, args.recipe, flags, tmp / "before", args.step, data_dir)
        after = run(REPO, args.recipe, flags, tmp / "after", args.step, data_dir)
    finally:
        subprocess.run(["git", "worktree", "remove", "--force", str(base)], cwd=REPO, capture_output=True)
        shutil.rmtree(tmp, ignore_errors=True)
    a, b = before["model"], after["model"]
    rows, worst = [], 0.0
    for key in sorted(set(a) | set(b)):
        if key not in a or key not in b or a[key].shape != b[key].shape:
            rows.append({"tensor": key, "difference": "missing or another shape"})
            worst = float("inf")
            continue
        diff = (a[key].float() - b[key].float()).abs().max().item() if a[key].numel() else 0.0
        worst = max(worst, diff)
        if diff > args.atol:
            rows.append({"tensor": key, "difference": diff})
    same_loss = before["loss"] == after["loss"]
    report = {
        "recipe": args.recipe,
        "flags": flags,
        "step": args.step,
        "base": args.base,
        "head": head.stdout.strip(),
        "tensors": len(set(a) | set(b)),
        "largest_difference": worst,
        "differing": rows,
        "same_loss_curve": same_loss,
        "loss_curve": after["loss"],
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    for row in rows:
        print(f"differs: {row['tensor']}: {row['difference']}")
    verdict = "the same" if not rows and same_loss else "NOT the same"
    print(
        f"same_parameters: {args.recipe} after {args.step} steps at {args.base} and {report['head']}: "
        f"{verdict} ({report['tensors']} tensors, largest difference {worst:g}, loss curves "
        f"{'equal' if same_loss else 'differ'}) -> {args.out}"
    )
    return 0 if not rows and same_loss else 1


if __name__ == "__main__":
    sys.exit(main())
