"""Real learning on real data: a tiny ViT trained by rung 01 on digits scores >= 0.80 on the held-out test
split, the same pipeline with shuffled labels does not, and fabric_memory_recipes.tools.convergence.benchmark runs, records and reports.

The tool's run (rung 01 and rung 03, one seed, 10 epochs) starts in the background when the tests are
collected (see conftest): it is the test of both the recipe's accuracy and the benchmark's plumbing.
"""

from __future__ import annotations

import json
import math
import sys

import numpy as np
import torch

from fabric_memory_recipes.config import RunConfig
from fabric_memory_recipes.declarations import declared_rung
from fabric_memory_recipes.measurement.results import RunResults
from fabric_memory_recipes.tools.convergence import benchmark, policy, report, run_plan
from fabric_memory_recipes.training import data, loop, models
from fabric_memory_recipes.training.data import digits
from tests.conftest import REPO, describe, result, run_process, session_dir, submit, subprocess_env

BACKGROUND_PRIORITY = 15
BACKGROUND_TESTS = {
    "test_rung01_learns_digits_and_scores_on_the_whole_test_split",
    "test_benchmark_records_curves_lost_updates_and_renders_the_report",
}
EPOCHS = 10


def _benchmark():
    out = session_dir("convergence")
    cmd = [
        sys.executable, "-m", "fabric_memory_recipes.tools.convergence.benchmark", "--out", str(out), "--rungs", "01,03", "--seed-list", "0", "--model", "vit_tiny",
        "--epochs", str(EPOCHS), "--parallel", "2", "--no-variants",
    ]  # fmt: skip
    return run_process(cmd, subprocess_env(out / "fabric-logs")), out


def start_background_jobs() -> None:
    submit("convergence:tiny", _benchmark)


def _runs(out):
    return {p.stem: json.loads(p.read_text()) for p in (out / "runs").glob("*.json")}


def test_rung01_learns_digits_and_scores_on_the_whole_test_split():
    proc, out = result("convergence:tiny")
    assert proc.returncode == 0, describe(proc)
    p = _runs(out)["01_baseline-default-s0"]
    assert p["status"] == "ok" and p["provenance"]["data_source"] == "digits"
    assert p["config"]["eval_batches"] is None, "accuracy over the whole test split, not a few batches"
    assert p["config"]["epochs"] == EPOCHS and p["config"]["model"] == "vit_tiny"
    assert p["accuracy"]["test"] >= 0.80, p["accuracy"]


def test_shuffled_labels_score_chance_through_the_same_pipeline():
    """The control: with the training labels permuted, the loop and evaluation used above stay near
    chance on the test split, so the accuracy above comes from learning the real labels."""
    import lightning as L

    torch.manual_seed(0)
    splits = data.load("digits")
    labels = np.random.default_rng(0).permutation(splits.train[1])
    splits.train = (splits.train[0], labels)
    fabric = L.Fabric(accelerator="cpu", devices=1, precision="32-true")
    train, _, test = data.build_loaders(splits.datasets(), micro_batch_size=64, eval_batch_size=256)
    model = models.build_model("vit_tiny", None)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    model, opt = fabric.setup(model, opt)
    fn = data.image_classification(model.image_size)
    cfg = RunConfig(recipe="control", batch_size=64, epochs=EPOCHS, log_every=50)
    loop.fit(fabric, model, opt, train, fn, cfg, RunResults(cfg))
    assert loop.evaluate(fabric, model, test, fn) < 0.3


def test_benchmark_records_curves_lost_updates_and_renders_the_report():
    proc, out = result("convergence:tiny")
    assert proc.returncode == 0, describe(proc)
    runs = _runs(out)
    assert sorted(runs) == ["01_baseline-default-s0", "03_true_half_precision-default-s0"]
    for p in runs.values():
        curve = p["loss"]["curve"]
        assert len(curve) >= 10, "one point every --log-every optimizer steps"
        steps = [s for s, _ in curve]
        assert steps == sorted(steps) and steps[-1] == p["timing"]["optimizer_steps"]
        assert all(math.isfinite(v) for _, v in curve) and curve[-1][1] < curve[0][1]
        assert p["loss"]["last"] == curve[-1][1]
        lost = p["updates"]["lost"]
        assert lost["steps"] and all(0.0 <= f <= 1.0 for row in lost["steps"] for f in row[1:])
    assert runs["01_baseline-default-s0"]["updates"]["lost"]["mean_lost"] < 0.01  # fp32 weights
    assert runs["03_true_half_precision-default-s0"]["updates"]["rule"] == "plain"
    bench = json.loads((out / "benchmark.json").read_text())
    assert bench["settings"]["epochs"] == EPOCHS and len(bench["runs"]) == 2
    assert all(r["returncode"] == 0 for r in bench["runs"])
    readme = (out / "README.md").read_text()
    assert "| 01_baseline | default |" in readme and "baseline |" in readme
    assert "| 03_true_half_precision | default |" in readme and "vit_tiny" in readme
    assert (out / "loss_curves.png").read_bytes()[:4] == b"\x89PNG"
    # rendering again from the JSON alone gives the same report
    (out / "README.md").unlink()
    assert benchmark.main(["--report", str(out)]) == 0
    assert (out / "README.md").read_text() == readme
    # --readme PATH:BLOCK puts the table and the figure into a marked block; a missing block is one line
    doc = out.parent / "doc.md"
    doc.write_text(
        "before\n<!-- results:convergence:start -->\nold\n<!-- results:convergence:end -->\nafter\n"
    )
    assert benchmark.render(out, readme=f"{doc}:convergence") == 0
    text = doc.read_text()
    assert (
        "old" not in text
        and "| 01_baseline | default |" in text
        and "](" in text
        and text.endswith("after\n")
    )
    assert benchmark.render(out, readme=f"{doc}:nothing") == 2


def _result(recipe, seed, test, loss, steps, precision="32-true", lost=0.0):
    return {
        "recipe": recipe,
        "tag": f"default-s{seed}",
        "status": "ok",
        "config": {"precision": precision, "batch_size": 64, "micro_batch_size": 64, "lr": 1e-3},
        "accuracy": {"test": test},
        "loss": {"last": loss},
        "timing": {"optimizer_steps": steps},
        "updates": {"rule": "plain", "optimizer": "torch.optim.adam.Adam", "lost": {"mean_lost": lost}},
    }


def test_flags_and_causes_from_measured_differences():
    results = []
    for seed, acc in enumerate((0.90, 0.91, 0.92)):
        results.append(_result("01_baseline", seed, acc, 0.05, 380))
        results.append(_result("03_true_half_precision", seed, acc + 0.005, 0.06, 380, "bf16-true", 0.3))
        results.append(_result("15_speed", seed, 0.6, 0.6, 80))
    table = benchmark.render_table(results)
    rows = {line.split(" | ")[0][2:]: line for line in table.splitlines()[2:]}
    assert "within (+0.005)" in rows["03_true_half_precision"]
    assert "**outside ± 2 sd** (-0.310)" in rows["15_speed"]
    assert (
        "80 optimizer steps vs 380" in rows["15_speed"]
        and "final training loss 0.600 vs 0.050" in rows["15_speed"]
    )
    assert "0.910 ± 0.010 (n=3)" in rows["01_baseline"]


def test_tool_plans_every_single_gpu_rung_with_its_kind_of_learning_rate():
    args = benchmark.parse_args(["--seeds", "2", "--model", "vit_tiny"])
    jobs = run_plan.plan(args, cuda=False)
    rungs = sorted({j.recipe for j in jobs})
    assert [r[:2] for r in rungs] == "01 02 03 04 05 06 07 10 11 12 13 14 15".split()
    assert {j.seed for j in jobs} == {0, 1}
    lr = {j.recipe: j.args[j.args.index("--lr") + 1] for j in jobs}
    preset = policy.PRESETS["vit_tiny"]
    assert lr["01_baseline"] == lr["13_lowbit_optimizer"] == str(preset["adam_lr"])
    assert lr["06_sgd_cosine"] == lr["14_memory_floor"] == str(preset["sgd_lr"])
    for j in jobs:
        assert j.args[j.args.index("--data") + 1] == "digits" and "--eval-batches" not in j.args
    mixed = [j for j in jobs if j.recipe == "02_mixed_precision"][0]
    assert mixed.args[mixed.args.index("--precision") + 1] == "bf16-mixed", "fp16 autocast needs CUDA"
    assert {j.variant for j in jobs if j.recipe == "06_sgd_cosine"} == {"default", "plain", "kahan", "mixed"}
    rules = {(j.recipe[:2], j.variant): j.rule for j in jobs}
    assert (
        rules[("06", "default")] == rules[("12", "default")] == "stochastic"
        and rules[("03", "default")] == "plain"
    )
    assert rules[("14", "default")] == "stochastic"  # the floor too: its peak is plain rounding's (docs/14)
    assert rules[("06", "plain")] == rules[("06", "mixed")] == "plain" and rules[("03", "kahan")] == "kahan"
    assert not [j for j in jobs if j.seed is None], "no ViT-L/16 memory runs without CUDA"
    assert [j for j in run_plan.plan(args, cuda=True) if j.seed is None]
    assert REPO.joinpath("fabric_memory_recipes", "tools", "convergence", "benchmark.py").exists()


def test_a_later_call_that_added_runs_is_named_in_the_report():
    results = [_result("01_baseline", seed, 0.9 + seed / 100, 0.05, 380) for seed in range(3)]
    later = {
        "timestamp": "2026-11-23T16:00:00+00:00",
        "command": "convergence.py --seed-list 2",
        "wall_s": 176.4,
        "runs": [{"returncode": 0}, {"returncode": 0}, {"returncode": 1}],
        "note": "seed 2 of the rungs the first call's deadline skipped",
    }
    text = benchmark.render_markdown(results, {"wall_s": 306.6, "later_calls": [later]}, None)
    assert "- the first call took 307 s (wall)" in text
    assert (
        "- a later call (2026-11-23T16:00:00+00:00) added 2 runs in 176 s: `convergence.py --seed-list 2`;"
        " seed 2 of the rungs the first call's deadline skipped" in text
    )


def test_a_later_call_on_several_gpus_counts_each_gpu_and_names_them():
    """A call that spread its runs over 4 GPUs cost 4 x its wall time of GPU time, and its line says where."""
    later = {
        "timestamp": "t",
        "command": "convergence.py --gpus 4",
        "wall_s": 400.0,
        "runs": [{"returncode": 0}],
        "settings": {"gpus": 4, "gpu_name": "NVIDIA H200"},
    }
    summary = {"wall_s": 100.0, "later_calls": [later]}
    assert report.device_seconds(summary) == 100.0 + 4 * 400.0
    text = benchmark.render_markdown([], summary, None)
    assert "added 1 runs in 400 s on 4 × NVIDIA H200: `convergence.py --gpus 4`" in text
    assert "GPU time of the whole benchmark: 1700 s" in text


def test_gpu_plan_trains_vit_l_16_at_one_budget_and_measures_lost_updates_where_it_compares_precisions():
    args = benchmark.parse_args(["--seeds", "3", "--model", "vit_l_16", "--no-memory", "--no-tuned"])
    preset = policy.PRESETS["vit_l_16"]  # every rung's (the tuned rungs': test_convergence_sweep.py)
    jobs = run_plan.plan(args, cuda=True)
    assert args.mode == "fast" and len({j.recipe for j in jobs}) == 13
    assert len([j for j in jobs if j.variant == "default"]) == 13 * 3, "every rung, 3 seeds"
    n_train = len(digits.split_indices(digits.raw()[1])[0])
    for j in jobs:
        value = {
            flag: nxt for flag, nxt in zip(j.args, [*j.args[1:], ""], strict=True) if flag.startswith("--")
        }
        assert value["--model"] == "vit_l_16" and value["--image-size"] == str(preset["image_size"])
        assert value["--epochs"] == str(preset["epochs"]) and value["--mode"] == "fast"
        rung, _ = declared_rung(j.recipe)
        per_epoch = -(-(n_train // rung.micro_batch_size) // rung.accumulation_steps)  # optimizer steps
        assert value["--warmup-steps"] == str(round(preset["warmup_epochs"] * per_epoch)), j.recipe
        measured = "--lost-updates" in j.args
        assert measured == (j.recipe in policy.LOST_RUNGS and j.seed == 0), (j.recipe, j.seed)
        assert ("--no-cuda-graphs" in j.args) == measured, "lost updates read weights between steps"
    assert {j.variant for j in jobs if j.recipe == "03_true_half_precision"} == {
        "default",
        "stochastic",
        "kahan",
    }


def test_a_later_call_runs_only_what_is_missing_and_is_recorded(tmp_path, monkeypatch):
    out = tmp_path / "bench"
    (out / "runs").mkdir(parents=True)
    ran: list[str] = []

    def fake_run(job, out_, logs, env, extra, deadline):  # a recipe run: writes its JSON
        ran.append(job.tag)
        job.returncode, job.wall_s = 0, 1.0
        (out_ / "runs" / f"{job.recipe}-{job.tag}.json").write_text(json.dumps({"status": "ok"}))
        return job

    monkeypatch.setattr(benchmark, "run_job", fake_run)
    monkeypatch.setattr(benchmark, "render", lambda out, readme=None: 0)
    argv = [
        "--out",
        str(out),
        "--model",
        "vit_tiny",
        "--rungs",
        "01",
        "--no-variants",
        "--",
        "--accelerator",
        "cpu",
    ]
    assert benchmark.main([*argv[:4], "--seed-list", "0", *argv[4:]]) == 0
    assert ran == ["default-s0"]
    assert benchmark.main([*argv[:4], "--seed-list", "0,1", *argv[4:]]) == 0
    assert ran == ["default-s0", "default-s1"], "seed 0 finished in the first call"
    bench = json.loads((out / "benchmark.json").read_text())
    assert [r["tag"] for r in bench["runs"]] == ["default-s0"]
    assert [r["tag"] for r in bench["later_calls"][0]["runs"]] == ["default-s1"]
    text = benchmark.render_markdown([], bench, None)
    assert "GPU time of the whole benchmark" in text


def test_a_run_with_another_rule_is_run_again_and_gpus_share_out_the_runs(tmp_path, monkeypatch):
    """A rung's run from before its default became stochastic rounding is not a finished run of it; with
    --gpus N every run gets one of N GPUs (CUDA_VISIBLE_DEVICES), --parallel runs on each."""
    out = tmp_path / "bench"
    (out / "runs").mkdir(parents=True)
    for seed, rule in ((0, "plain"), (1, "stochastic")):
        run = {"status": "ok", "updates": {"rule": rule}}
        (out / "runs" / f"06_sgd_cosine-default-s{seed}.json").write_text(json.dumps(run))
    seen: list[tuple[str, str | None]] = []

    def fake_run(job, out_, logs, env, extra, deadline):
        seen.append((f"{job.recipe[:2]}-{job.tag}", env.get("CUDA_VISIBLE_DEVICES")))
        job.returncode, job.wall_s = 0, 1.0
        return job

    monkeypatch.setattr(benchmark, "run_job", fake_run)
    monkeypatch.setattr(benchmark, "render", lambda out, readme=None: 0)
    argv = [
        "--out",
        str(out),
        "--model",
        "vit_tiny",
        "--rungs",
        "06,07",
        "--no-variants",
        "--seed-list",
        "0,1",
    ]
    assert benchmark.main([*argv, "--gpus", "2", "--", "--accelerator", "cpu"]) == 0
    assert sorted(tag for tag, _ in seen) == ["06-default-s0", "07-default-s0", "07-default-s1"]
    assert {gpu for _, gpu in seen} <= {"0", "1"} and None not in {gpu for _, gpu in seen}


def test_image_size_keeps_the_blocks_and_shortens_the_position_embedding():
    import pytest

    from fabric_memory_recipes.config import UsageError

    own, small = models.build_model("vit_tiny", None), models.build_model("vit_tiny", None, 10, 64)
    assert (own.image_size, small.image_size) == (32, 64)
    assert small.encoder.pos_embedding.shape[1] == (64 // 8) ** 2 + 1
    blocks = [sum(p.numel() for p in m.encoder.layers.parameters()) for m in (own, small)]
    assert blocks[0] == blocks[1]
    assert small(torch.zeros(2, 3, 64, 64)).shape == (2, 10)
    with pytest.raises(UsageError, match="multiple of its patch size, 8"):
        models.build_model("vit_tiny", None, 10, 60)
    with pytest.raises(UsageError, match="pretrained vit_l_16 weights are for 224 px"):
        models.build_model("vit_l_16", object(), 10, 64)
