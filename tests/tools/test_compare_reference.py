"""fabric_memory_recipes.tools.compare.reference (with compare_plan, compare_rows) and reference_runner (with
reference_recorder, reference_substitutions): the article's scripts run offline with only the data and
weights swapped, stopped after N optimizer steps; comparison.json assembled from per-run JSON; the
comparison table and figure (fabric_memory_recipes.measurement.report.render); bad input.

No checkout of the article's repository is needed: the tests write small scripts with the same imports
and calls (``from local_utilities import get_dataloaders_cifar10``, ``from watermark import watermark``,
``vit_l_16(weights=ViT_L_16_Weights.IMAGENET1K_V1)``, Fabric). With FMR_REFERENCE_DIR set to a checkout
of rasbt/pytorch-memory-optim, one more test checks that its scripts are what the mapping expects.
"""

from __future__ import annotations

import ast
import json
import os
import statistics
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from fabric_memory_recipes import processes
from fabric_memory_recipes.measurement.report import comparison, render
from fabric_memory_recipes.tools.compare import plan
from fabric_memory_recipes.tools.compare import reference as cmp
from fabric_memory_recipes.tools.compare import rows as compare_rows
from tests.conftest import REPO, describe, result, run_process, session_dir, submit, subprocess_env

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
TINY_VIT = "image_size=32,patch_size=8,num_layers=1,num_heads=2,mlp_dim=64"

# The article's local_utilities.get_dataloaders_cifar10, reduced to what the fake scripts use.
LOCAL_UTILITIES = """
import torch
from torch.utils.data import DataLoader, SubsetRandomSampler
from torchvision import datasets


def get_dataloaders_cifar10(batch_size, num_workers=0, validation_fraction=None,
                            train_transforms=None, test_transforms=None):
    train_dataset = datasets.CIFAR10(root="data", train=True, transform=train_transforms, download=True)
    test_dataset = datasets.CIFAR10(root="data", train=False, transform=test_transforms)
    num = int(validation_fraction * 50000)
    train_loader = DataLoader(dataset=train_dataset, batch_size=batch_size, num_workers=num_workers,
                              drop_last=True, sampler=SubsetRandomSampler(torch.arange(0, 50000 - num)))
    test_loader = DataLoader(dataset=test_dataset, batch_size=batch_size, num_workers=num_workers)
    return train_loader, test_loader, test_loader
"""

# Like the article's 05_gradient-accum.py: micro-batch 4, 2 accumulation steps, stepping when
# batch_idx % k == 0 (after the 1st micro-batch, then every k-th), one DataLoader worker, on the CPU.
FAKE_SCRIPT = """
import os

import lightning as L
import torch
import torch.nn.functional as F
from lightning import Fabric
from PIL import Image
from torchvision import transforms
from torchvision.models import ViT_L_16_Weights, vit_l_16
from watermark import watermark

from local_utilities import get_dataloaders_cifar10


def train(model, optimizer, train_loader, fabric, accumulation_steps):
    for batch_idx, (features, targets) in enumerate(train_loader):
        model.train()
        loss = F.cross_entropy(model(features), targets) / accumulation_steps
        fabric.backward(loss)
        if batch_idx % accumulation_steps == 0:
            optimizer.step()
            optimizer.zero_grad()
        model.eval()
        with torch.no_grad():
            model(features[:1])  # an eval-mode forward: not counted as training images


if __name__ == "__main__":
    print(watermark(packages="torch,lightning", python=True))
    print("CWD=" + os.getcwd())
    fabric = Fabric(accelerator="cpu", devices=1)
    fabric.launch()
    L.seed_everything(123)
    BATCHSIZE = 8
    ACCUMULATION_STEPS = 2
    MICROBATCHSIZE = int(BATCHSIZE / ACCUMULATION_STEPS)
    tf = transforms.Compose([transforms.Resize((32, 32)), transforms.ToTensor()])
    train_loader, val_loader, test_loader = get_dataloaders_cifar10(
        batch_size=MICROBATCHSIZE, num_workers=1, train_transforms=tf, test_transforms=tf,
        validation_fraction=0.1)
    train_set, test_set = train_loader.dataset, test_loader.dataset
    assert (len(train_set), len(test_set)) == (50000, 10000)
    assert train_set.data.shape == (50000, 32, 32, 3) and str(train_set.data.dtype) == "uint8"
    assert set(train_set.targets) <= set(range(10))
    image = Image.fromarray(train_set.data[0])
    assert image.size == (32, 32) and image.mode == "RGB"
    train_loader, val_loader, test_loader = fabric.setup_dataloaders(train_loader, val_loader, test_loader)
    model = vit_l_16(weights=ViT_L_16_Weights.IMAGENET1K_V1)
    model.heads.head = torch.nn.Linear(in_features=1024, out_features=10)
    optimizer = torch.optim.Adam(model.parameters(), lr=5e-5)
    model, optimizer = fabric.setup(model, optimizer)
    train(model, optimizer, train_loader, fabric, ACCUMULATION_STEPS)
    raise SystemExit("the runner did not stop the script")
"""


# Like the article's 11_delay-allocation.py: Fabric(devices=4), FSDPStrategy(cpu_offload=True), launched by
# torchrun with 2 processes; on the CPU the strategy is only built (Fabric's FSDP refuses the CPU) and the
# model trains under DDP, so the test sees what the runner swaps in and that both ranks report.
FAKE_FSDP_SCRIPT = """
import lightning as L
import torch
import torch.nn.functional as F
from lightning import Fabric
from lightning.fabric.strategies import FSDPStrategy
from torchvision import transforms
from torchvision.models import ViT_L_16_Weights, vit_l_16

from local_utilities import get_dataloaders_cifar10

if __name__ == "__main__":
    strategy = FSDPStrategy(cpu_offload=True)
    print("CPU_OFFLOAD=" + str(bool(strategy.cpu_offload and strategy.cpu_offload.offload_params)))
    fabric = Fabric(accelerator="cpu", devices=4, strategy="ddp")
    fabric.launch()
    L.seed_everything(123)
    tf = transforms.Compose([transforms.Resize((32, 32)), transforms.ToTensor()])
    train_loader, _, _ = get_dataloaders_cifar10(
        batch_size=4, num_workers=0, train_transforms=tf, test_transforms=tf, validation_fraction=0.1)
    train_loader = fabric.setup_dataloaders(train_loader)
    model = vit_l_16(weights=ViT_L_16_Weights.IMAGENET1K_V1)
    model.heads.head = torch.nn.Linear(in_features=1024, out_features=10)
    optimizer = torch.optim.Adam(model.parameters(), lr=5e-5)
    model, optimizer = fabric.setup(model, optimizer)
    for features, targets in train_loader:
        loss = F.cross_entropy(model(features), targets)
        optimizer.zero_grad()
        fabric.backward(loss)
        optimizer.step()
    raise SystemExit("the runner did not stop the script")
"""


def write_reference(folder: Path, scripts: dict[str, str]) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "local_utilities.py").write_text(textwrap.dedent(LOCAL_UTILITIES))
    for name, text in scripts.items():
        (folder / name).write_text(textwrap.dedent(text))
    return folder


# ------------------------------------------------------------------------------- the runner, end to end
BACKGROUND_TESTS = {
    "test_runner_runs_the_script_offline_and_stops_it_after_n_steps",
    "test_runner_under_torchrun_sets_the_devices_and_the_offload_and_every_rank_reports",
    "test_tool_runs_everything_keeps_going_past_failures_and_exits_1",
}


def _runner_job():
    tmp = session_dir("reference-runner")
    ref = write_reference(tmp / "ref", {"05_fake.py": FAKE_SCRIPT})
    out = tmp / "run.json"
    argv = [
        str(REPO / "fabric_memory_recipes" / "tools" / "compare" / "runner.py"),
        str(ref / "05_fake.py"),
        "--steps",
        "6",
    ]
    argv += ["--out", str(out)]
    env = subprocess_env(tmp / "logs", REFERENCE_RUNNER_VIT_ARCH=TINY_VIT)
    return run_process([sys.executable, *argv], env), out  # its own process: it changes the working folder


def _torchrun_job():
    """The runner as compare_plan launches a multi-GPU script: torchrun, 2 processes, --devices 2."""
    tmp = session_dir("reference-runner-torchrun")
    ref = write_reference(tmp / "ref", {"11_fake.py": FAKE_FSDP_SCRIPT})
    mapping = {"09": plan.Reference("11_fake.py", devices=4, cpu_offload=False)}
    (run,) = plan.plan_runs(["09"], [], ref, tmp, steps=6, python=sys.executable, mapping=mapping, devices=2)
    env = subprocess_env(tmp / "logs", REFERENCE_RUNNER_VIT_ARCH=TINY_VIT)
    return run_process(run.cmd, env), run.json


def start_background_jobs() -> None:
    submit("compare:runner", _runner_job)
    submit("compare:runner-torchrun", _torchrun_job)
    submit("compare:tool", _tool_job)


def test_runner_runs_the_script_offline_and_stops_it_after_n_steps():
    proc, out = result("compare:runner")
    assert proc.returncode == 0, describe(proc)
    assert "the runner did not stop the script" not in proc.stdout + proc.stderr
    run = json.loads(out.read_text())
    assert run["status"] == "ok" and run["error"] is None, run
    # 6 optimizer steps -> 5 intervals; the first 3 are warm-up (fabric_memory_recipes.measurement.results_file.WARMUP_STEPS)
    assert run["steps"] == 6 and len(run["step_intervals_s"]) == 5
    assert run["warmup_steps"] == 3 and run["timed_intervals"] == 2
    # 2 micro-batches of 4 between steps; the eval-mode forwards are not counted
    assert run["images_per_interval"] == [8] * 5 and run["effective_batch"] == 8
    assert run["script_constants"] == {"BATCHSIZE": 8, "ACCUMULATION_STEPS": 2, "MICROBATCHSIZE": 4}
    median = statistics.median(run["step_intervals_s"][3:])
    assert run["median_step_s"] == pytest.approx(median)
    assert run["images_per_s"] == pytest.approx(8 / median)
    assert run["memory"]["kind"] == "cpu_rss" and run["peak_reserved_gb"] > 0
    assert run["memory"]["warmup"] and run["memory"]["steady"]
    notes = " | ".join(run["substitutions"])
    assert "CIFAR10" in notes and "ViT_L_16_Weights.IMAGENET1K_V1 -> random init" in notes
    assert ("watermark" in notes) == (not _installed("watermark"))
    cwd = next(line[4:] for line in proc.stdout.splitlines() if line.startswith("CWD="))
    assert Path(cwd) != REPO and Path(cwd) != out.parent / "ref" and not Path(cwd).exists()  # a temp dir
    assert not (out.parent / "ref" / "data").exists()  # the script's CIFAR-10 root: nothing downloaded
    assert run["provenance"]["torch"] and run["script"] == "05_fake.py"


def _installed(name: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(name) is not None


# --------------------------------------------------------------------------- the runner, in-process
def test_pretrained_builders_give_random_models_of_the_same_architecture(monkeypatch):
    """vit_l_16 / vit_h_14 with weights: the shapes those weights describe, nothing loaded, all undone."""
    import torch
    import torchvision
    import torchvision.models.vision_transformer as vt
    from torchvision.models import ViT_H_14_Weights, ViT_L_16_Weights, vit_h_14, vit_l_16

    from fabric_memory_recipes.tools.compare import recorder as reference_recorder
    from fabric_memory_recipes.tools.compare import substitutions as reference_substitutions

    def no_download(*args, **kwargs):
        raise AssertionError("pretrained weights must not be loaded")

    monkeypatch.setattr(torchvision.models._api.WeightsEnum, "get_state_dict", no_download)
    builder, cifar = vt._vision_transformer, torchvision.datasets.CIFAR10
    recorder = reference_recorder.StepRecorder(Path("script.py"), steps=5)
    with reference_substitutions.substitutions(recorder) as notes, torch.device("meta"):
        large = vit_l_16(weights=ViT_L_16_Weights.IMAGENET1K_V1)
        huge = vit_h_14(weights=ViT_H_14_Weights.IMAGENET1K_SWAG_E2E_V1)  # the article's FSDP scripts
        assert torchvision.datasets.CIFAR10 is reference_substitutions.RandomCIFAR10
    assert sum(p.numel() for p in large.parameters()) == 304_326_632  # ViT-L/16, 1000 classes
    assert (large.image_size, large.heads.head.out_features, huge.image_size) == (224, 1000, 518)
    assert any("IMAGENET1K_SWAG_E2E_V1 -> random init" in n for n in notes)
    assert recorder.counting
    assert vt._vision_transformer is builder and torchvision.datasets.CIFAR10 is cifar  # undone
    assert "watermark" not in sys.modules or _installed("watermark")


def test_recorder_counts_one_step_per_iteration_with_one_optimizer_per_parameter():
    """Per-parameter optimizers all step in one iteration: one mark, not one per optimizer."""
    import torch

    from fabric_memory_recipes.tools.compare.recorder import StepRecorder

    recorder = StepRecorder(Path("script.py"), steps=100)
    recorder.counting = True
    model, batch = torch.nn.Linear(2, 2), torch.zeros(4, 2)
    for _ in range(3):  # iterations
        recorder.count_forward(model, (batch,))
        for _ in range(5):  # optimizers
            recorder.after_step(None, (), {})
    assert len(recorder.marks) == 3 and recorder.images == [4, 4, 4]


def test_runner_reports_a_script_that_ends_before_n_steps(tmp_path, capsys):
    from fabric_memory_recipes.tools.compare import runner as rr

    script = tmp_path / "no_training.py"
    script.write_text("print('no optimizer here')\n")
    out = tmp_path / "run.json"
    assert rr.main([str(script), "--steps", "5", "--out", str(out)]) == 1
    run = json.loads(out.read_text())
    assert run["status"] == "error" and "ended after 0 of 5 optimizer steps" in run["error"]
    assert run["images_per_s"] is None
    script.write_text("import sys\nsys.exit(3)\n")
    assert rr.main([str(script), "--steps", "5", "--out", str(out)]) == 1
    assert "exited (3) after 0 of 5" in json.loads(out.read_text())["error"]
    with pytest.raises(SystemExit) as exc:
        rr.main([str(tmp_path / "missing.py"), "--out", str(out)])
    assert exc.value.code == 2
    assert len(capsys.readouterr().err.strip().splitlines()) == 1


# -------------------------------------------------------------------------- comparison.json from files
def _reference_json(reserved: float, speed: float, status: str = "ok", **extra) -> dict:
    return {
        "schema": "reference_run/1",
        "status": status,
        "error": None if status == "ok" else "boom",
        "steps": 25,
        "peak_reserved_gb": reserved,
        "peak_allocated_gb": reserved - 0.2,
        "images_per_s": speed,
        "effective_batch": 16,
        "world_size": 1,
        "memory": {"kind": "cuda", "warmup": {"peak_reserved_gb": reserved}, "steady": None},
        "substitutions": ["data", "weights"],
        "provenance": {"gpu_name": "NVIDIA H100 80GB HBM3", "torch": "2.11.0", "lightning": "2.6.0"},
        **extra,
    }


def _project_json(train: float, evaluation: float, speed: float, mode: str, status: str = "ok") -> dict:
    def phase(gb):
        return {"peak_allocated_gb": gb - 0.1, "peak_reserved_gb": gb}

    memory = {
        "kind": "cuda",
        "peak_reserved_gb": train,
        "peak_allocated_gb": train - 0.1,
        "phases": {"model_load": phase(0.7), "train": phase(train), "eval": phase(evaluation)},
    }
    if mode == "fast":
        memory.update(warmup={"peak_reserved_gb": train}, steady={"peak_reserved_gb": train - 0.3})
    return {
        "schema_version": 1,
        "recipe": "x",
        "status": status,
        "config": {"mode": mode},
        "memory": memory,
        "timing": {"images_per_s": speed, "optimizer_steps": 25, "median_step_s": 16 / speed},
        "provenance": {"gpu_name": "NVIDIA H100 80GB HBM3", "torch": "2.11.0"},
    }


def test_comparison_rows_from_per_run_json(tmp_path):
    ref_dir = tmp_path / "ref"
    out = tmp_path / "out"
    runs_dir = out / "runs"
    runs_dir.mkdir(parents=True)
    rungs, modes = ["05", "06", "07", "10"], ["eager", "fast"]
    runs = plan.plan_runs(rungs, modes, ref_dir, runs_dir, steps=25, python="python")
    references = [r for r in runs if r.kind == "reference"]
    assert [r.name for r in references] == ["05_gradient-accum.py", "06_sgd-with-scheduler.py"]
    assert references[1].rows == ["06", "07"]  # one run of the 06 script serves rung 07 too
    project = next(r for r in runs if r.kind == "project" and r.name == "05" and r.mode == "fast")
    assert project.cmd[1].endswith("recipes/05_gradient_accumulation.py")
    assert project.cmd[-4:] == ["--tag", "fast", "--mode", "fast"]
    assert project.cmd[project.cmd.index("--max-steps") + 1] == "25"

    files = {
        "reference-05_gradient-accum.json": _reference_json(3.33, 75.6),
        "reference-06_sgd-with-scheduler.json": _reference_json(2.02, 79.8),
        "05_gradient_accumulation-eager.json": _project_json(3.25, 3.5, 88.7, "eager"),  # eval peak > train
        "05_gradient_accumulation-fast.json": _project_json(3.30, 1.0, 442.0, "fast"),
        "06_sgd_cosine-eager.json": _project_json(2.04, 1.0, 75.2, "eager"),
        "07_init_module-eager.json": _project_json(2.04, 1.0, 80.0, "eager"),
        "07_init_module-fast.json": _project_json(2.00, 1.0, 400.0, "fast"),
        "10_activation_checkpointing-eager.json": _project_json(1.46, 1.0, 37.0, "eager"),
        "10_activation_checkpointing-fast.json": _project_json(1.50, 1.0, 120.0, "fast", status="oom"),
    }
    for name, payload in files.items():
        (runs_dir / name).write_text(json.dumps(payload))
    for run in runs:
        run.result = {"status": "ok", "exit_code": 0, "wall_s": 10.0, "error": None}
    six_fast = next(r for r in runs if r.name == "06" and r.mode == "fast")
    six_fast.result = {"status": "timeout", "exit_code": None, "wall_s": 300.0, "error": "killed after 300 s"}

    call = compare_rows.call_info(
        runs, "2025-01-01T00:00:00+00:00", 25, "python -m fabric_memory_recipes.tools.compare.reference ..."
    )
    rows = [compare_rows.build_row(r, runs, out, modes, call) for r in rungs]
    compare_rows.write_outputs(out, rows)
    saved = json.loads((out / "comparison.json").read_text())
    assert isinstance(saved, list) and [r["rung"] for r in saved] == rungs
    for row in saved:
        for side in ("reference", "eager", "fast"):
            if row[side] is not None:
                assert {"peak_reserved_gb", "images_per_s", "status"} <= set(row[side]), (row["rung"], side)
        assert row["call"]["gpu_name"] == "NVIDIA H100 80GB HBM3" and row["call"]["steps"] == 25
        assert "random" in row["call"]["substitution_note"]
    five, six, seven, ten = saved
    assert five["reference"]["peak_reserved_gb"] == 3.33 and five["reference"]["images_per_s"] == 75.6
    assert five["eager"]["peak_reserved_gb"] == 3.5  # the whole run: the eval phase peaked higher
    assert five["fast"]["warmup"] == {"peak_reserved_gb": 3.30} and five["fast"]["mode"] == "fast"
    assert five["ratios"]["speed_fast_vs_reference"] == pytest.approx(442.0 / 75.6)
    assert five["ratios"]["speed_fast_vs_eager"] == pytest.approx(442.0 / 88.7)
    assert five["ratios"]["reserved_fast_vs_reference"] == pytest.approx(3.30 / 3.33)
    assert six["fast"]["status"] == "timeout" and six["ratios"]["speed_fast_vs_eager"] is None
    assert seven["reference"]["script"] == "06_sgd-with-scheduler.py" and "07_0" in seven["reference_note"]
    assert ten["reference"] is None and ten["fast"]["status"] == "oom"
    assert (out / "comparison.md").read_text().count("\n| ") == 1 + len(rungs)  # header + one row each
    assert (out / "comparison.png").read_bytes()[:8] == PNG_MAGIC


def test_reference_with_several_ranks_reports_the_peak_per_gpu(tmp_path):
    path = tmp_path / "reference-09_fsdp-act-checkp.json"
    path.write_text(json.dumps(_reference_json(4.37, 358.0, world_size=4)))
    (tmp_path / "reference-09_fsdp-act-checkp.rank1.json").write_text(json.dumps(_reference_json(4.50, 90.0)))
    side = compare_rows.summarize_reference(path)
    assert side["peak_reserved_gb"] == 4.50 and side["images_per_s"] == 358.0 and side["world_size"] == 4


def test_sharded_rungs_run_the_articles_fsdp_script_with_and_without_offload_on_n_gpus(tmp_path):
    """08 and 08-fsdp2 share one run of 11_delay-allocation.py with cpu_offload off, 09 has the script as
    written; every multi-GPU run gets --devices N, the references under torchrun; rows are like for like."""
    runs = plan.plan_runs(
        ["08", "08-fsdp2", "09"], ["fast"], tmp_path, tmp_path / "runs", steps=25, python="python", devices=2
    )
    refs = [r for r in runs if r.kind == "reference"]
    assert [r.rows for r in refs] == [["08", "08-fsdp2"], ["09"]]
    torchrun = ["python", "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    for ref, offload in zip(refs, (["--fsdp-cpu-offload", "off"], []), strict=True):
        assert ref.cmd[:6] == torchrun and ref.cmd[6:8] == [
            "-m",
            "fabric_memory_recipes.tools.compare.runner",
        ]
        assert ref.cmd[8].endswith("11_delay-allocation.py") and ref.cmd[9:11] == ["--devices", "2"]
        assert ref.cmd[11 : 11 + len(offload)] == offload
    assert refs[0].json.name == "reference-11_delay-allocation-no-offload.json"
    assert refs[1].json.name == "reference-11_delay-allocation.json" and refs[0].label.endswith(
        "(cpu_offload=False)"
    )
    projects = [r for r in runs if r.kind == "project"]
    assert [Path(r.cmd[1]).stem for r in projects] == ["08_fsdp", "08_fsdp2", "09_cpu_offload"]
    assert all(r.cmd[r.cmd.index("--devices") + 1] == "2" for r in projects)
    assert all(plan.RUNGS[r].reference.like_for_like for r in plan.SHARDED_RUNGS)
    default = plan.plan_runs(["09"], [], tmp_path, tmp_path / "runs", steps=25, python="python")
    assert default[0].cmd[5] == "4" and "--fsdp-cpu-offload" not in default[0].cmd
    row = {"rung": "09", "like_for_like": True, "reference": {"status": "ok", "images_per_s": 1.0}}
    row["fast"] = {"status": "ok", "images_per_s": 3.5, "peak_reserved_gb": 1.0}
    assert comparison.comparison_ratios(row)["speed_fast_vs_reference"] == 3.5


def test_substitutions_set_fabric_devices_and_fsdp_offload_and_say_so():
    import lightning as L
    from lightning.fabric.strategies import FSDPStrategy

    from fabric_memory_recipes.tools.compare.recorder import StepRecorder
    from fabric_memory_recipes.tools.compare.substitutions import substitutions

    with substitutions(StepRecorder(Path("x.py"), 5), devices=2, cpu_offload=False) as notes:
        strategy = FSDPStrategy(cpu_offload=True)
        fabric = L.Fabric(accelerator="cpu", devices=4, strategy="ddp")
    assert not (strategy.cpu_offload and strategy.cpu_offload.offload_params)
    assert len(fabric._connector._parallel_devices) == 2
    said = " | ".join(notes)
    assert "devices=2" in said and "asked for 4" in said and "cpu_offload=False" in said
    assert FSDPStrategy(cpu_offload=True).cpu_offload.offload_params  # undone on exit


def test_runner_under_torchrun_sets_the_devices_and_the_offload_and_every_rank_reports():
    proc, out = result("compare:runner-torchrun")
    assert proc.returncode == 0, describe(proc)
    assert proc.stdout.count("CPU_OFFLOAD=False") == 2, describe(proc)
    ranks = [json.loads(out.read_text()), json.loads(out.with_name(f"{out.stem}.rank1.json").read_text())]
    assert [r["rank"] for r in ranks] == [0, 1] and all(r["world_size"] == 2 for r in ranks)
    assert all(r["status"] == "ok" and r["steps"] == 6 and r["effective_batch"] == 4 for r in ranks)
    assert ranks[0]["images_per_s"] == pytest.approx(4 * 2 / ranks[0]["median_step_s"])
    notes = " | ".join(ranks[0]["substitutions"])
    assert "Fabric(devices=...) -> devices=2" in notes and "cpu_offload=False" in notes
    side = compare_rows.summarize_reference(out)
    assert side["world_size"] == 2 and side["peak_reserved_gb"] == max(r["peak_reserved_gb"] for r in ranks)


# ---------------------------------------------------------------- the whole tool with a fake interpreter
FAKE_PYTHON = '''#!{python}
"""Stands in for the interpreter: writes what a run would write, fails or hangs where told to."""
import json, os, sys, time

argv = sys.argv[1:]
def opt(flag):
    return argv[argv.index(flag) + 1]

if argv[:2] == ["-m", "fabric_memory_recipes.tools.compare.runner"]:
    script = os.path.basename(argv[2])
    payload = {{"status": "ok", "steps": int(opt("--steps")), "peak_reserved_gb": 2.0, "images_per_s": 80.0,
               "peak_allocated_gb": 1.9, "provenance": {{"gpu_name": "Fake GPU", "torch": "0.0"}}}}
    json.dump(payload, open(opt("--out"), "w"))
    print("reference", script)
    sys.exit(0)
recipe = os.path.basename(argv[0])[:-3]
mode = opt("--tag")
if recipe.startswith("10_") and mode == "fast":
    print("RuntimeError: boom", file=sys.stderr)
    sys.exit(1)
if recipe.startswith("11_") and mode == "fast":
    time.sleep(60)
speed = 100.0 if mode == "eager" else 400.0
payload = {{"status": "ok", "memory": {{"phases": {{"train": {{"peak_reserved_gb": 2.1, "peak_allocated_gb": 2.0}}}}}},
           "timing": {{"images_per_s": speed, "optimizer_steps": int(opt("--max-steps"))}}}}
json.dump(payload, open(os.path.join(opt("--results-dir"), recipe + "-" + mode + ".json"), "w"))
'''


def _tool(*args: str) -> subprocess.CompletedProcess:
    return run_process(
        [sys.executable, "-m", "fabric_memory_recipes.tools.compare.reference", *args],
        subprocess_env(),
        timeout=120,
    )


def _tool_job() -> tuple:
    """The test below's two calls of the tool, in the background (the first waits out a --timeout), and the
    comparison (and the failed run's log) each left: ``(call, comparison, log, call, comparison)``."""
    tmp = session_dir("reference-tool")
    ref = write_reference(tmp / "ref", {"05_gradient-accum.py": "", "06_sgd-with-scheduler.py": ""})
    fake = tmp / "python"
    fake.write_text(FAKE_PYTHON.format(python=sys.executable))
    fake.chmod(0o755)
    out = tmp / "out"
    args = ["--reference", str(ref), "--rungs", "05,07,10,11", "--steps", "6", "--out", str(out)]
    read = [out / "comparison.json", out / "runs" / "10_activation_checkpointing-fast.log"]
    first = [_tool(*args, "--timeout", "3", "--python", str(fake))] + [p.read_text() for p in read]
    again = _tool(*args[:3], "05", *args[4:], "--modes", "eager", "--python", str(fake))
    return *first, again, read[0].read_text()


def test_tool_runs_everything_keeps_going_past_failures_and_exits_1():
    proc, comparison, log, again, comparison_again = result("compare:tool")
    assert proc.returncode == 1, describe(proc)
    lines = proc.stdout.splitlines()
    assert sum("started" in line for line in lines) == 2 + 4 * 2  # 05 and 06 scripts, 4 rungs x 2 modes
    assert any("05 fast: ok, 2.10 GB reserved, 400.0 img/s" in line for line in lines), describe(proc)
    assert (
        "only the data and the weights" in proc.stdout or "except for what needs the network" in proc.stdout
    )
    assert any(line.startswith("compare: 10 runs in ") for line in lines)
    assert "10 fast: error (RuntimeError: boom)" in proc.stderr and "11 fast: timeout" in proc.stderr
    rows = {r["rung"]: r for r in json.loads(comparison)}
    assert set(rows) == {"05", "07", "10", "11"}
    assert (
        rows["05"]["fast"]["images_per_s"] == 400.0 and rows["05"]["ratios"]["speed_fast_vs_reference"] == 5.0
    )
    assert rows["07"]["reference"]["script"] == "06_sgd-with-scheduler.py"
    assert rows["10"]["fast"]["status"] == "error" and rows["10"]["eager"]["status"] == "ok"
    assert rows["11"]["fast"]["status"] == "timeout" and rows["11"]["fast"]["wall_s"] < 30
    assert log.count("boom") == 1

    # a later call for other rungs keeps these rows
    assert again.returncode == 0, describe(again)
    rows = {r["rung"]: r for r in json.loads(comparison_again)}
    assert set(rows) == {"05", "07", "10", "11"} and rows["05"]["fast"] is None
    assert rows["11"]["fast"]["status"] == "timeout"


@pytest.mark.parametrize(
    "args, message",
    [
        (["--reference", "/nonexistent/pytorch-memory-optim"], "not a directory"),
        (["--reference", "{ref}", "--rungs", "05,99"], "unknown rung 99"),
        (["--reference", "{ref}", "--rungs", "04"], "lacks 04_lower-batchsize.py"),
        (["--reference", "{ref}", "--modes", "eager,slow"], "--modes"),
        (["--rungs", "05"], "--reference"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(tmp_path, capsys, args, message):
    ref = write_reference(tmp_path / "ref", {"05_gradient-accum.py": ""})
    with pytest.raises(SystemExit) as exc:
        cmp.main([a.format(ref=ref) for a in args])
    err = capsys.readouterr().err.strip()
    assert exc.value.code == 2 and len(err.splitlines()) == 1 and message in err, err


def test_bad_input_from_the_command_line(tmp_path):
    proc = _tool("--reference", str(tmp_path / "missing"))
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, describe(proc)
    assert "Traceback" not in proc.stderr


def test_dry_run_prints_the_commands(tmp_path, capsys):
    ref = write_reference(tmp_path / "ref", {"05_gradient-accum.py": ""})
    assert cmp.main(["--reference", str(ref), "--rungs", "05", "--out", str(tmp_path), "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert (
        "fabric_memory_recipes.tools.compare.runner" in out and "recipes/05_gradient_accumulation.py" in out
    )
    assert not (tmp_path / "runs").exists()


# --------------------------------------------------------------------------------------- the report
def _rows() -> list[dict]:
    def side(gb, speed, status="ok"):
        return {"status": status, "peak_reserved_gb": gb, "images_per_s": speed}

    call = {
        "gpu_name": "NVIDIA H100 80GB HBM3",
        "torch": "2.11.0",
        "steps": 25,
        "started": "t",
        "command": "python -m fabric_memory_recipes.tools.compare.reference --reference .ref/pytorch-memory-optim",
        "substitution_note": "data and weights swapped",
    }
    return [
        {"rung": "04", "recipe": "04_lower_batch_size", "reference": {**side(5.45, 236.8), "script": "04.py"},
         "eager": side(4.75, 311.8), "fast": side(4.70, 845.0), "like_for_like": True, "call": call},
        {"rung": "07", "recipe": "07_init_module", "reference": {**side(2.02, 79.8), "script": "06.py"},
         "eager": side(2.04, 80.0), "fast": side(None, None, "timeout"), "like_for_like": True,
         "reference_note": "the 06 script", "call": call},
        {"rung": "14", "recipe": "14_memory_floor", "reference": None, "eager": side(0.74, 28.0),
         "fast": side(0.78, 110.0), "like_for_like": None, "call": call},
    ]  # fmt: skip


def test_report_renders_the_comparison_into_the_readme(tmp_path, monkeypatch):
    monkeypatch.setenv("FMR_PUBLISH", "1")  # rendering committed evidence is publishing (paths.py)
    folder = tmp_path / "results" / "published" / "h100" / "compare"
    folder.mkdir(parents=True)
    (folder / "comparison.json").write_text(json.dumps(_rows()))
    readme = tmp_path / "README.md"
    readme.write_text(
        "intro\n<!-- results:comparison:start -->\nSTALE TABLE\n<!-- results:comparison:end -->\nend\n"
    )
    code = render.main(["--comparison", str(folder / "comparison.json"), "--readme", f"{readme}:comparison"])
    assert code == 0
    text = readme.read_text()
    assert "STALE TABLE" not in text and text.startswith("intro\n") and text.endswith("end\n")
    assert "](results/published/h100/compare/comparison.png)" in text
    row = next(line for line in text.splitlines() if line.startswith("| 04_lower_batch_size"))
    assert "5.45 / 236.8" in row and "845.0" in row and f"{845.0 / 236.8:.2f}×" in row
    assert f"{845.0 / 311.8:.2f}×" in row and f"{4.70 / 5.45:.2f}×" in row
    assert "| timeout |" in text and "¹ 07: the 06 script" in text
    assert "NVIDIA H100 80GB HBM3" in text and "25 optimizer steps" in text
    assert "Produced by `fmr-compare --reference .ref/pytorch-memory-optim`" in text  # as typed today
    assert (folder / "comparison.png").read_bytes()[:8] == PNG_MAGIC
    assert (folder / "comparison.md").exists()


def test_comparison_table_renders_without_matplotlib(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    path = tmp_path / "comparison.json"
    path.write_text(json.dumps(_rows()))
    assert render.main(["--comparison", str(path)]) == 0
    assert "figure skipped" in capsys.readouterr().err
    md = (tmp_path / "comparison.md").read_text()
    assert "| 14_memory_floor |" in md and "comparison.png" not in md
    assert not (tmp_path / "comparison.png").exists()


def test_report_refuses_a_file_that_is_not_a_comparison(tmp_path, capsys):
    path = tmp_path / "comparison.json"
    path.write_text(json.dumps({"rung": "05"}))
    assert render.main(["--comparison", str(path)]) == 2
    assert len(capsys.readouterr().err.strip().splitlines()) == 1


# ------------------------------------------------------- a real checkout of the article's repository
REFERENCE_DIR = os.environ.get("FMR_REFERENCE_DIR")


@pytest.mark.skipif(
    not REFERENCE_DIR, reason="set FMR_REFERENCE_DIR to a rasbt/pytorch-memory-optim checkout"
)
@pytest.mark.parametrize("rung", sorted(plan.RUNGS))
def test_checkout_matches_the_mapping(rung):
    """What the runner relies on, read from the script: it imports get_dataloaders_cifar10, builds a
    torchvision ViT with pretrained weights, steps an optimizer, and asks Fabric for the mapped devices."""
    ref = plan.RUNGS[rung].reference
    if ref is None:
        pytest.skip("no reference script for this rung")
    folder = Path(REFERENCE_DIR)
    assert "datasets.CIFAR10(" in (folder / "local_utilities.py").read_text()
    tree = ast.parse((folder / ref.script).read_text())
    calls = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            name = getattr(node.func, "id", None) or getattr(node.func, "attr", None)
            calls.setdefault(name, []).append(node)
    imported = {alias.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) for alias in n.names}
    assert "get_dataloaders_cifar10" in imported and "get_dataloaders_cifar10" in calls
    builders = [c for name in ("vit_l_16", "vit_h_14") for c in calls.get(name, [])]
    assert builders and all(any(k.arg == "weights" for k in c.keywords) for c in builders)
    assert "step" in calls and "Fabric" in calls
    devices = [k.value.value for c in calls["Fabric"] for k in c.keywords if k.arg == "devices"]
    assert devices == [ref.devices]  # a keyword: what --devices N swaps
    if ref.cpu_offload is not None:  # what --fsdp-cpu-offload swaps: a keyword of FSDPStrategy(...)
        assert any(k.arg == "cpu_offload" for c in calls["FSDPStrategy"] for k in c.keywords)


def test_the_comparison_page_shows_the_committed_comparison_exactly():
    """docs/compare_reference.md's comparison block is what the renderer makes of the committed
    comparison.json (the README links there), so its numbers cannot drift from the runs."""
    page = REPO / "docs" / "compare_reference.md"
    text = page.read_text()
    start, end = "<!-- results:comparison:start -->", "<!-- results:comparison:end -->"
    assert text.count(start) == 1 and text.count(end) == 1
    shown = text[text.index(start) + len(start) : text.index(end)].strip()
    rows = comparison.load_comparison(COMMITTED)
    expected = comparison.render_comparison_markdown(rows, "../results/published/h100/compare/comparison.png")
    assert shown == expected.strip()
    assert "docs/compare_reference.md" in (REPO / "README.md").read_text()


# ------------------------------------------------------------------------------------ rung docs pages
COMMITTED = REPO / "results" / "published" / "h100" / "compare" / "comparison.json"


def test_rung_pages_show_the_committed_comparison_exactly():
    """Every rung page's 'modes' block is what the renderer makes of the committed comparison.json, so a
    number on a page cannot drift from the run that measured it."""
    rows = comparison.load_comparison(COMMITTED)
    source = COMMITTED.relative_to(REPO).as_posix()
    assert {r["rung"] for r in rows} == {
        "01",
        "02",
        "03",
        "04",
        "05",
        "06",
        "07",
        "10",
        "11",
        "12",
        "13",
        "14",
        "15",
    }
    for row in rows:
        page = (REPO / "docs" / f"{row['recipe']}.md").read_text()
        block = page.split("<!-- results:modes:start -->\n")[1].split("<!-- results:modes:end -->")[0]
        assert block.strip() == comparison.render_rung_block(row, source).strip(), row["recipe"]


def test_docs_blocks_written_and_a_page_without_the_block_is_one_line(tmp_path, capsys):
    docs = tmp_path / "docs"
    docs.mkdir()
    row = {
        "rung": "05",
        "recipe": "05_gradient_accumulation",
        "reference": {"status": "ok", "peak_reserved_gb": 3.33, "images_per_s": 84.3},
        "eager": {"status": "ok", "peak_reserved_gb": 3.24, "images_per_s": 86.0},
        "fast": {"status": "timeout"},
    }
    page = docs / "05_gradient_accumulation.md"
    page.write_text("# 05\n<!-- results:modes:start -->\nold\n<!-- results:modes:end -->\ntail\n")
    assert comparison.write_docs_blocks([row], docs, "c.json") == 0
    text = page.read_text()
    assert "| the article's script | 3.33 | 84.3 |" in text and "| fast (default on CUDA) | timeout |" in text
    assert "old" not in text and text.endswith("tail\n") and "fast ÷" not in text  # no ratio without fast
    (docs / "06_sgd_cosine.md").write_text("# 06, no block\n")
    capsys.readouterr()
    assert comparison.write_docs_blocks([dict(row, rung="06", recipe="06_sgd_cosine")], docs, "c.json") == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "06_sgd_cosine.md" in err[0]


def test_execute_makes_the_logs_folder_and_records_the_exit(tmp_path):
    """A run whose log sits in a folder nobody made yet (planner_proof's layout) still runs."""
    log = tmp_path / "not" / "yet" / "made.log"
    cmd = [sys.executable, "-c", "print('hello from the run')"]
    proc = processes.execute(
        processes.Run("project", "05", "eager", cmd, tmp_path / "none.json", log), dict(os.environ), 60
    )
    assert proc["exit_code"] == 0 and proc["status"] != "timeout"
    assert "hello from the run" in log.read_text()
