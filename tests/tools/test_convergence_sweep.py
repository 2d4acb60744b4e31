"""The policy sweep (fabric_memory_recipes.tools.convergence.sweep, its grid in sweep_grid) and the rungs'
own policies (policy.TUNED): a grid is the product of its lists, its flags reach the recipe's optimizer and
schedule, the pick reads the validation split only, today's setting comes from the committed runs, and a
tuned rung is run again and reported with its own warm-up and epochs.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest

from fabric_memory_recipes.declarations import declared_rung
from fabric_memory_recipes.measurement import results as results_module
from fabric_memory_recipes.tools.convergence import benchmark, policy, report, run_plan, sweep, sweep_grid
from fabric_memory_recipes.training.data import digits
from tests.conftest import REPO, describe

N_TRAIN = len(digits.split_indices(digits.raw()[1])[0])
PUBLISHED = REPO / "results" / "published" / "h100" / "convergence"


def _steps_per_epoch(micro: int, k: int) -> int:
    return math.ceil((N_TRAIN // micro) / k)


def test_a_grid_is_the_product_of_its_lists_with_the_preset_for_what_it_leaves_out():
    grid = sweep_grid.parse_grid("06,10 lr=0.03,0.06 warmup=2,6", "vit_l_16")
    assert grid.rungs == ["06_sgd_cosine", "10_activation_checkpointing"] and grid.kind == "sgd"
    assert [s.name for s in grid.settings] == [
        "lr0.03-w2-e30",
        "lr0.06-w2-e30",
        "lr0.03-w6-e30",
        "lr0.06-w6-e30",
    ]
    assert grid.today == sweep_grid.Setting(0.03, 2, 30) and grid.today in grid.settings
    speed = sweep_grid.parse_grid("15 lr=1e-4,2e-4", "vit_l_16")
    assert speed.kind == "adam" and speed.today == sweep_grid.Setting(1e-4, 2, 30)
    [one] = sweep_grid.merged([speed, sweep_grid.parse_grid("15 epochs=90", "vit_l_16")])
    assert [s.name for s in one.settings] == ["lr0.0001-w2-e30", "lr0.0002-w2-e30", "lr0.0001-w2-e90"]


@pytest.mark.parametrize(
    "spec, says",
    [
        ("01,06 lr=0.1", "Adam and SGD rungs in one grid"),
        ("06 lr=fast", "not a number"),
        ("06 momentum=0.9", "is not lr=, warmup= or epochs="),
        ("06 lr=0", "values above 0"),
        ("99 lr=0.1", "names no rung"),
    ],
)
def test_a_bad_grid_is_one_line_and_exit_2(spec, says, capsys):
    with pytest.raises(SystemExit) as exc:
        sweep.parse_args(["--model", "vit_l_16", "--grid", spec])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and says in err and len(err.strip().splitlines()) == 1, err


def test_the_sweeps_runs_are_the_benchmarks_with_the_settings_flags():
    args = sweep.parse_args(
        ["--model", "vit_l_16", "--grid", "06 lr=0.06 warmup=6 epochs=20", "--seed-list", "0,1"]
    )
    [grid] = args.grids
    jobs = sweep_grid.setting_jobs(grid, sweep_grid.Setting(0.06, 6, 20), args, cuda=True)
    assert [j.tag for j in jobs] == ["lr0.06-w6-e20-s0", "lr0.06-w6-e20-s1"]
    for j in jobs:
        value = {f: v for f, v in zip(j.args, j.args[1:], strict=False) if f.startswith("--")}
        assert value["--lr"] == "0.06" and value["--epochs"] == "20" and value["--mode"] == "fast"
        assert value["--warmup-steps"] == str(
            6 * _steps_per_epoch(4, 4)
        )  # 4 x 4: 79 optimizer steps an epoch
        assert "--lost-updates" not in j.args and "--no-cuda-graphs" not in j.args, "CUDA graphs on"
        assert j.rule == "stochastic" and j.micro_batches == (N_TRAIN // 4) * 20


def test_the_flags_reach_the_optimizer_and_the_schedule(run_recipe):
    """Rung 06 with --lr and --warmup-steps: the learning rate it logged after each step is lr times the
    linear warm-up times its cosine, as the loop promises (tests/training/test_loop.py: the shape)."""
    lr, warm, steps = 0.08, 3, 6
    proc, payload = run_recipe(
        "06_sgd_cosine", "--accelerator", "cpu", "--model", "vit_tiny", "--data", "digits", "--weights", "none",
        "--max-steps", str(steps), "--eval-batches", "1", "--lr", str(lr), "--warmup-steps", str(warm),
        "--log-every", "1", "--tag", "sweep-flags",
    )  # fmt: skip
    assert proc.returncode == 0, describe(proc)
    assert payload["config"]["lr"] == lr and payload["config"]["warmup_steps"] == warm
    [csv] = Path(results_module.LOG_DIR).glob("06_sgd_cosine-sweep-flags/version_*/metrics.csv")
    rows = [line.split(",") for line in csv.read_text().splitlines()]
    logged = [float(r[rows[0].index("train/lr")]) for r in rows[1:]]
    ramp = [min(1.0, 1 / warm + (1 - 1 / warm) * s / warm) for s in range(1, steps + 1)]
    cosine = [(1 + math.cos(math.pi * s / steps)) / 2 for s in range(1, steps + 1)]
    assert logged == pytest.approx([lr * r * c for r, c in zip(ramp, cosine, strict=True)], abs=1e-6)


def _run_json(recipe, tag, val, test, lr, warmup_steps, epochs, steps, model="vit_l_16", rule="stochastic"):
    return {
        "recipe": recipe, "tag": tag, "status": "ok",
        "config": {"model": model, "lr": lr, "warmup_steps": warmup_steps, "epochs": epochs,
                   "seed": int(tag.rpartition("-s")[2])},
        "accuracy": {"val": val, "test": test},
        "loss": {"curve": [[steps, 0.01]], "last": 0.01},
        "timing": {"optimizer_steps": steps},
        "updates": {"rule": rule},
        "provenance": {"gpu_name": "GPU", "torch": "2.11"},
    }  # fmt: skip


def test_the_pick_reads_validation_accuracy_and_ties_go_to_todays_setting():
    today = sweep_grid.Setting(0.03, 2, 30)
    rows = [
        sweep._row(today, [{"val": 0.93}], today),
        sweep._row(sweep_grid.Setting(0.06, 2, 30), [{"val": 0.95}], today),
        sweep._row(sweep_grid.Setting(0.12, 6, 30), [{"val": 0.953}], today),
    ]
    margin = 1 / 179
    assert sweep.choose(rows, today, margin)["name"] == "lr0.06-w2-e30", "0.953 ties 0.95: the nearer lr"
    rows[0] = sweep._row(today, [{"val": 0.949}], today)
    assert sweep.choose(rows, today, margin)["name"] == today.name, "within one image: today's"
    rows.append(sweep._row(sweep_grid.Setting(0.03, 2, 90), [{"val": 0.99}], today))
    assert sweep.choose(rows, today, margin)["name"] == "lr0.03-w2-e90"


def test_the_sweep_runs_what_is_missing_reads_todays_from_the_reference_and_never_the_test_split(
    tmp_path, monkeypatch
):
    per_epoch = _steps_per_epoch(4, 4)
    ref = tmp_path / "published"
    (ref / "runs").mkdir(parents=True)
    for seed in (0, 1, 2):  # today's rung 06 (lr 0.03, 2 epochs of warm-up, 30 epochs) and the baseline
        name = f"default-s{seed}"
        run = _run_json("06_sgd_cosine", name, 0.90, 0.99, 0.03, 2 * per_epoch, 30, 30 * per_epoch)
        (ref / "runs" / f"06_sgd_cosine-{name}.json").write_text(json.dumps(run))
        base = _run_json("01_baseline", name, 0.95 + seed / 100, 0.9, 1e-4, 38, 30, 570, rule="plain")
        (ref / "runs" / f"01_baseline-{name}.json").write_text(json.dumps(base))
    ran: list[str] = []

    def fake_run(job, out, logs, env, extra, deadline):  # test accuracy says the opposite of validation
        ran.append(job.tag)
        lr = float(job.args[job.args.index("--lr") + 1])
        val, test = (0.96, 0.80) if lr == 0.06 else (0.92, 0.99)
        steps = 30 * per_epoch
        w = int(job.args[job.args.index("--warmup-steps") + 1])
        payload = _run_json(job.recipe, job.tag, val, test, lr, w, 30, steps)
        (out / "runs").mkdir(parents=True, exist_ok=True)
        (out / "runs" / f"{job.recipe}-{job.tag}.json").write_text(json.dumps(payload))
        job.returncode, job.wall_s = 0, 1.0
        return job

    monkeypatch.setattr(benchmark, "run_job", fake_run)
    out = tmp_path / "sweep"
    argv = [
        "--out",
        str(out),
        "--model",
        "vit_l_16",
        "--reference",
        str(ref),
        "--grid",
        "06 lr=0.03,0.06,0.12",
    ]
    assert sweep.main([*argv, "--", "--accelerator", "cpu"]) == 0
    assert sorted(ran) == ["lr0.06-w2-e30-s0", "lr0.12-w2-e30-s0"], "today's setting: the committed runs"
    record = json.loads((out / "sweep.json").read_text())
    [grid] = record["summary"]["grids"]
    assert grid["pick"] == "lr0.06-w2-e30", "the highest validation accuracy, whatever the test split says"
    today = next(r for r in grid["rows"] if r["today"])
    assert today["n"] == 3 and {r["source"] for r in today["runs"]} == {"reference"}
    assert record["summary"]["baseline"]["n"] == 3
    text = (out / "sweep.md").read_text()
    assert "0.960 (1)" in text and "0.900 (3)" in text and "**pick**" in text
    assert "0.99" not in text and "0.800" not in text and '"test"' not in json.dumps(record["summary"])
    kept = sorted(p.name for p in (out / "reference" / "runs").glob("*.json"))
    assert kept == sorted(p.name for p in (ref / "runs").glob("*.json")), "the committed runs read, kept"
    ran.clear()
    assert sweep.main([*argv, "--", "--accelerator", "cpu"]) == 0 and ran == [], "a second call: nothing left"
    (out / "sweep.md").unlink()
    assert sweep.main(["--report", str(out)]) == 0 and (out / "sweep.md").read_text() == text


def _args_list(args) -> list[str]:
    return [
        "--model",
        args.model,
        "--rungs",
        ",".join(args.rungs),
        "--seed-list",
        "0",
        "--no-variants",
        "--no-memory",
    ]


def test_a_tuned_rung_trains_its_own_policy_and_its_older_runs_run_again(tmp_path, monkeypatch):
    monkeypatch.setitem(
        policy.TUNED, "vit_tiny", {"06_sgd_cosine": {"lr": 0.2, "warmup_epochs": 1, "epochs": 3}}
    )
    args = benchmark.parse_args(
        ["--model", "vit_tiny", "--rungs", "01,06", "--seed-list", "0", "--no-variants", "--no-memory"]
    )
    jobs = {j.recipe: j for j in run_plan.plan(args, cuda=True)}
    value = {r: dict(zip(j.args, j.args[1:], strict=False)) for r, j in jobs.items()}
    assert value["06_sgd_cosine"]["--lr"] == "0.2" and value["06_sgd_cosine"]["--epochs"] == "3"
    assert value["06_sgd_cosine"]["--warmup-steps"] == str(_steps_per_epoch(4, 4))
    preset = policy.PRESETS["vit_tiny"]
    assert value["01_baseline"]["--lr"] == str(preset["adam_lr"]), "a rung not in TUNED: the preset"
    untuned = run_plan.plan(benchmark.parse_args([*_args_list(args), "--no-tuned"]), cuda=True)
    assert {j.args[j.args.index("--lr") + 1] for j in untuned if j.recipe == "06_sgd_cosine"} == {
        str(preset["sgd_lr"])
    }
    job, runs = jobs["06_sgd_cosine"], tmp_path / "runs"
    runs.mkdir()
    for lr, done in ((preset["sgd_lr"], False), (0.2, True)):  # a run at the old policy is not a finished one
        d = _run_json(job.recipe, job.tag, 0.9, 0.9, lr, _steps_per_epoch(4, 4), 3, 237, "vit_tiny")
        (runs / f"{job.recipe}-{job.tag}.json").write_text(json.dumps(d))
        assert run_plan.finished(job, tmp_path) is done


def test_the_committed_benchmark_is_finished_under_todays_plan_with_the_tuned_rungs_at_their_policy():
    """Every run of the published benchmark, rung 06's variants included, counts under today's plan (rule,
    learning rate, warm-up and epochs compared), the tuned rungs' (policy.TUNED) at their own policy
    (``scripts/gpu/sgd_sweep.sh rerun`` ran exactly those): a call with the same folder runs nothing. Under
    the preset's policy (``--no-tuned``) exactly the tuned rungs' runs would run again, 3 seeds each, at the
    preset's learning rate: the tuned runs replaced them."""
    argv = ["--model", "vit_l_16", "--seeds", "3", "--no-memory", "--lost-seeds", ""]
    jobs = run_plan.plan(benchmark.parse_args(argv), cuda=True)  # variants too
    assert [j.tag for j in jobs if not run_plan.finished(j, PUBLISHED)] == [], "today's plan"
    tuned = policy.TUNED["vit_l_16"]
    checked = 0
    for j in jobs:
        if j.recipe in tuned:
            value = dict(zip(j.args, j.args[1:], strict=False))
            rung, _ = declared_rung(j.recipe)
            own = tuned[j.recipe]
            assert float(value["--lr"]) == own["lr"] and value["--epochs"] == str(own["epochs"]), j.recipe
            warmup = round(
                own["warmup_epochs"] * _steps_per_epoch(rung.micro_batch_size, rung.accumulation_steps)
            )
            assert value["--warmup-steps"] == str(warmup), j.recipe
            checked += 1
    assert checked == 3 * (len(tuned) + 3)  # each tuned rung's default, and rung 06's three variants
    untuned = run_plan.plan(benchmark.parse_args([*argv, "--no-tuned"]), cuda=True)
    missing = [j for j in untuned if not run_plan.finished(j, PUBLISHED)]
    assert len(missing) == checked and {j.recipe for j in missing} == set(tuned)
    for j in missing:
        value = dict(zip(j.args, j.args[1:], strict=False))
        assert float(value["--lr"]) != tuned[j.recipe]["lr"], j.recipe


def test_tuned_holds_the_committed_sweeps_picks():
    """policy.TUNED is what the committed sweep (on the validation split) picked: each grid's pick for
    its rungs, and the SGD grid's (06, 10) for 07 and 11 too."""
    text = (REPO / "results" / "published" / "h200" / "sgd-sweep" / "sweep.md").read_text()
    picks = {}
    for rungs, table in re.findall(
        r"^`[^`]+` \((?:sgd|adam): ([^)]+)\)\n\n(.*?)(?:\n\n|\Z)", text, re.M | re.S
    ):
        [row] = [line for line in table.splitlines() if line.rstrip().endswith("**pick** |")]
        lr, warmup, epochs = (float(cell) for cell in row.split(" | ")[1:4])
        for recipe in rungs.split(", "):
            picks[recipe] = {"lr": lr, "warmup_epochs": warmup, "epochs": epochs}
    assert set(picks) == {"06_sgd_cosine", "10_activation_checkpointing", "15_speed"}, picks
    picks["07_init_module"] = picks["06_sgd_cosine"]
    picks["11_activation_offload"] = picks["10_activation_checkpointing"]
    assert policy.TUNED["vit_l_16"] == picks
    assert picks["06_sgd_cosine"] == {"lr": 0.06, "warmup_epochs": 2, "epochs": 30}
    assert picks["15_speed"] == {"lr": 2e-4, "warmup_epochs": 6, "epochs": 30}


def test_a_row_names_its_own_warmup_and_epochs_and_the_report_says_why():
    def run(recipe, seed, lr, warmup_steps, epochs, steps):
        d = _run_json(recipe, f"default-s{seed}", 0.9, 0.93 + seed / 100, lr, warmup_steps, epochs, steps)
        d["config"] |= {"precision": "bf16-true", "batch_size": 16, "micro_batch_size": 4}
        return d | {"updates": {"rule": "stochastic", "optimizer": "torch.optim.sgd.SGD"}}

    results = [run("01_baseline", s, 1e-4, 38, 30, 570) for s in range(3)]
    results += [run("06_sgd_cosine", s, 0.06, 474, 30, 2370) for s in range(3)]
    results += [run("07_init_module", s, 0.03, 158, 30, 2370) for s in range(3)]
    rows = {line.split(" | ")[0][2:]: line for line in report.render_table(results).splitlines()[2:]}
    assert "SGD 0.06, warm-up 6 epochs vs 2 |" in rows["06_sgd_cosine"]
    assert "warm-up" not in rows["07_init_module"], "2 epochs of warm-up, as the baseline"
    tuned = {"settings": {}, "later_calls": [{"settings": {"tuned": {"06_sgd_cosine": {"lr": 0.06}}}}]}
    assert "chosen on the validation split" in report.render_markdown(results, tuned, None)
    assert "chosen on the validation split" not in report.render_markdown(results, {"settings": {}}, None)
    assert "rungs with a policy of their own: 06_sgd_cosine lr 0.06" in report.render_markdown(
        results, tuned, None
    )
