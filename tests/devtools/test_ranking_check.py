"""devtools/your_model/ranking_check.py's bookkeeping: each model's row from its CPU plan and its measured
sets, the targets and the table, without a GPU (the plans and measurements are written here)."""

from __future__ import annotations

import json
import tarfile
import threading
import time

import pytest

from devtools.capped_card.markdown import markdown_table
from devtools.your_model import ranking_check


def _fit(speeds: list[float]) -> dict:
    fits = [
        {
            "label": f"set {i}",
            "command": f"python recipes/your_model.py --set {i}",
            "predicted_samples_per_s": s,
            "predicted_device_peak_gb": 2.5,
        }
        for i, s in enumerate(speeds, 1)
    ]
    return {"fits": fits, "card": "3GB", "batch_size": 128, "seq_len": None, "plan_s": 12.0, "budget_gb": 3.0}


def _measured(fit: dict, outcomes: list[tuple[str, float | None, bool]]) -> dict:
    sets = [
        {**f, "status": status, "measured_samples_per_s": speed, "fits": fits, "measured_device_peak_gb": 2.4}
        for f, (status, speed, fits) in zip(fit["fits"], outcomes, strict=True)
    ]
    return {"sets": sets, "gpu": "NVIDIA H100 80GB HBM3"}


def test_the_targets_per_model():
    fit = _fit([100.0, 90.0, 80.0])
    met = ranking_check.check(
        "a", fit, _measured(fit, [("ok", 95.0, True), ("ok", 100.0, True), ("ok", 60.0, True)])
    )
    assert met["pick_over_fastest"] == 0.95 and met["ratio_met"] and met["all_fit"]
    assert abs(met["pick_error"] - (100 / 95 - 1)) < 1e-9 and met["error_met"]
    missed = ranking_check.check(
        "b", fit, _measured(fit, [("ok", 70.0, True), ("ok", 100.0, True), ("oom", None, False)])
    )
    assert missed["pick_over_fastest"] == 0.7 and not missed["ratio_met"] and not missed["error_met"]
    assert not missed["all_fit"] and missed["sets_fit"] == 2 and missed["statuses"][-1] == "oom"
    planned_only = ranking_check.check("c", fit, None)
    assert planned_only["measured"] is None and planned_only["pick"] == "set 1"


def test_report_reads_the_folders_and_counts_the_targets(tmp_path):
    for name, outcomes in {
        "a": [("ok", 95.0, True), ("ok", 100.0, True), ("ok", 60.0, True)],
        "b": [("oom", None, False), ("ok", 100.0, True), ("ok", 60.0, True)],
    }.items():
        fit = _fit([100.0, 90.0, 80.0])
        (tmp_path / name).mkdir()
        (tmp_path / name / "fit.json").write_text(json.dumps(fit))
        (tmp_path / name / "plan.json").write_text(json.dumps(_measured(fit, outcomes)))
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "fit.json").write_text(json.dumps(_fit([50.0])))
    rows = ranking_check.report([tmp_path])
    assert [r["model"] for r in rows] == ["a", "b", "c"]
    text = ranking_check.table(rows)
    assert (
        "| a (batch 128) | 3GB | set 1 | 100.0, 90.0, 80.0 | 95.0, 100.0, 60.0 | 0.95 ✓ | +5 % ✓ | 3 of 3 |"
        in text
    )
    assert "2 of 3 (oom, ok, ok)" in text and "not measured" in text
    assert text.rstrip().endswith(
        "Measured 2 of 3 models: first pick ≥ 0.90 of the fastest on 1, predicted within ±25 % on 1,"
        " every measured set within its card on 1; sets over the card or out of memory: 1."
    )


def test_a_plan_made_elsewhere_is_reused_only_for_the_same_command(tmp_path):
    plans, out = tmp_path / "plans", tmp_path / "out"
    (plans / "a").mkdir(parents=True)
    flags = ["--model", "torchvision:resnet50", "--batch-size", "128"]
    argv = [
        *flags,
        "--precision",
        "bf16-mixed",
        "--optimizer",
        "adamw",
        "--fit",
        "4GB",
        "--top",
        "3",
        "--gpu",
        "h100",
    ]
    (plans / "a" / "fit.json").write_text(json.dumps({**_fit([100.0]), "argv": argv}))
    answer = ranking_check.plan("a", flags, "4GB", out, 3, None, plans)
    assert answer["reused_from"] == str(plans / "a" / "fit.json") and answer["fits"][0]["label"] == "set 1"
    assert json.loads((out / "a" / "fit.json").read_text())["argv"] == argv
    assert ranking_check.reused(plans, "a", [*argv[:-1], "h200"]) is None  # another command: planned again
    assert ranking_check.reused(plans, "b", argv) is None


def test_the_markdown_table_aligns_numbers_right_and_refuses_a_row_of_another_width():
    lines = markdown_table([("model", "<"), ("samples/s", ">")], [["a", "1.0"]])
    assert lines == ["| model | samples/s |", "|---|---:|", "| a | 1.0 |"]
    with pytest.raises(ValueError, match="a row of 1 cells in a table of 2 columns"):
        markdown_table([("model", "<"), ("samples/s", ">")], [["a"]])


def test_measure_top_measures_only_each_plans_first_sets(tmp_path, monkeypatch):
    measured = []

    gpus = []

    def plan(name, flags, card, out, top, cpus, plans=None, gpu="h100"):
        (out / name).mkdir(parents=True, exist_ok=True)
        gpus.append(gpu)
        return {**_fit([30.0, 20.0, 10.0]), "name": name, "argv": flags, "exit": 0}

    monkeypatch.setattr(ranking_check, "plan", plan)
    monkeypatch.setattr(ranking_check.measure, "measure", lambda rows, *a, **k: measured.append(rows))
    monkeypatch.setattr(ranking_check.measure, "write", lambda *a, **k: None)
    monkeypatch.setattr(ranking_check.os, "sched_setaffinity", lambda *a: None)  # this process's cores stay
    ranking_check.main(["peft", "--out", str(tmp_path), "--only", "qwen2-0.5b-lora", "--measure-top", "1"])
    assert [[(r["label"], r["predicted_rank"]) for r in rows] for rows in measured] == [[("set 1", 1)]]
    measured.clear()
    ranking_check.main(["peft", "--out", str(tmp_path), "--only", "qwen2-0.5b-lora", "--gpu", "h200"])
    assert [len(rows) for rows in measured] == [3]  # by default every set the plan lists
    assert gpus == ["h100", "h200"]  # --gpu: the kind the plan is made for


def test_the_summary_is_written_by_one_thread_at_a_time_and_skips_files_being_written(tmp_path, monkeypatch):
    """The planners' threads and the measuring one all write the summary; a reused plan returns at once, so
    three wrote together and one thread's archive met another's vanished temporary file (a GPU call lost)."""
    out = tmp_path / "ranking"
    (out / "a").mkdir(parents=True)
    (out / "a" / "fit.json").write_text(json.dumps(_fit([100.0])))
    (out / "a" / ".tmp-half.json").write_text("{")  # a plan another thread is writing
    inside, most = [0], [0]
    report = ranking_check.report

    def slow_report(folders):
        inside[0] += 1
        most[0] = max(most[0], inside[0])
        time.sleep(0.05)
        inside[0] -= 1
        return report(folders)

    monkeypatch.setattr(ranking_check, "report", slow_report)
    archive = tmp_path / "ranking.tgz"
    threads = [threading.Thread(target=ranking_check.write_summary, args=(out, archive)) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert most[0] == 1
    with tarfile.open(archive) as tar:
        names = set(tar.getnames())
    assert {"ranking/a/fit.json", "ranking/summary.json", "ranking/summary.md"} <= names
    assert not any(".tmp-" in n for n in names)


@pytest.mark.parametrize("part", sorted(ranking_check.MATRIX))
def test_every_parts_plan_command_parses_and_names_a_model_the_runner_resolves(part):
    """The command each part's plans run (`fmr-estimate ... --fit CARD`, the --plan-only runs the results NOTES
    show) parses with the estimator's flags, and each model reference resolves here (no download)."""
    from fabric_memory_recipes.planning import arguments
    from fabric_memory_recipes.training.your_model import models

    for name, flags, card in ranking_check.jobs(part):
        argv = [*flags, "--precision", ranking_check.PRECISION, "--optimizer", ranking_check.OPTIMIZER]
        args = arguments.build().parse_args([*argv, "--fit", card, "--top", "3", "--gpu", "h200"])
        assert args.fit == card and args.model == flags[1], name
        assert models.resolve(args.model).ref, name
