"""run_all.sh: the CPU path end to end, its argument errors, and that a failing recipe neither stops the
ladder nor goes unnoticed in the exit code."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fabric_memory_recipes.measurement.report import render
from tests.conftest import REPO, describe, result, run_process, session_dir, submit, subprocess_env

SCRIPT = REPO / "run_all.sh"
HAVE_REPORT = (REPO / "fabric_memory_recipes" / "measurement" / "report" / "render.py").exists()


def run_all(*args: str, tmp: Path, **env: str) -> subprocess.CompletedProcess:
    return run_process([SCRIPT, *args], subprocess_env(tmp / "logs", PYTHON=sys.executable, **env))


BACKGROUND_PRIORITY = 10  # the longest chain (two recipes and the report, one after the other): first
BACKGROUND_TESTS = {
    "test_cpu_path_runs_the_selected_recipes",
    "test_cpu_path_exits_0_and_renders_the_report",
    "test_failing_recipe_makes_the_exit_code_non_zero",
}  # the tests that wait for the jobs


def _ladder(args: list[str]):
    tmp = session_dir("run_all")
    results = tmp / "results"
    cut = args.index("--") if "--" in args else len(args)  # after "--": the recipes' flags, not run_all.sh's
    return run_all(*args[:cut], "--results-dir", str(results), *args[cut:], tmp=tmp), results


def start_background_jobs() -> None:
    submit("run_all:ladder", _ladder, ["--cpu", "--only", "01,04"])
    submit(
        "run_all:bad-01",
        _ladder,
        ["--cpu", "--only", "01", "--", "--batch-size", "10", "--accumulation-steps", "3"],
    )


@pytest.fixture
def cpu_ladder():
    return result("run_all:ladder")


def test_cpu_path_runs_the_selected_recipes(cpu_ladder):
    proc, results = cpu_ladder
    first = proc.stdout.splitlines()[0]
    assert "CPU path" in first, describe(proc)
    for name in ("01_baseline", "04_lower_batch_size"):
        path = results / f"{name}.json"
        assert path.exists(), describe(proc)
        p = json.loads(path.read_text())
        assert p["status"] == "ok" and p["provenance"]["device"] == "cpu"
        assert p["config"]["max_steps"] == 15 and p["timing"]["optimizer_steps"] == 15
        assert p["timing"]["step_s"]["p10"] <= p["timing"]["median_step_s"] <= p["timing"]["step_s"]["p90"]
        assert p["provenance"]["data_source"] == "digits" and p["provenance"]["weights"] == "random"
    # --only selects: nothing else ran; the predicted ladder covers what ran
    assert sorted(f.name for f in results.glob("*.json")) == [
        "01_baseline.json",
        "04_lower_batch_size.json",
        "predicted.json",
        "run_all.json",
    ]
    manifest = json.loads((results / "run_all.json").read_text())
    assert manifest["recipes"] == ["01_baseline", "04_lower_batch_size"] and manifest["state"] == "finished"
    predicted = json.loads((results / "predicted.json").read_text())
    assert [r["recipe"] for r in predicted["rows"]] == ["01_baseline", "04_lower_batch_size"]
    assert not list(results.glob(".tmp-*"))
    summary = proc.stdout[proc.stdout.index("Summary (cpu path") :]
    assert "01_baseline" in summary and "04_lower_batch_size" in summary


@pytest.mark.skipif(
    not HAVE_REPORT, reason="fabric_memory_recipes/measurement/report/render.py is being written in parallel"
)
def test_cpu_path_exits_0_and_renders_the_report(cpu_ladder):
    proc, results = cpu_ladder
    assert proc.returncode == 0, describe(proc)
    readme, figure = results / "README.md", results / "ladder.png"
    assert readme.exists() and readme.stat().st_size > 0, describe(proc)
    assert figure.exists() and figure.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", describe(proc)
    text = readme.read_text()
    assert "01_baseline" in text and "04_lower_batch_size" in text
    assert "predicted (ViT-L/16, GPU config)" in text and "None" not in text
    assert "predicted ladder (ViT-L/16)" in proc.stdout and "total:" in proc.stdout


def test_only_without_match_exits_2(tmp_path):
    proc = run_all("--only", "zz", "--results-dir", str(tmp_path / "r"), tmp=tmp_path)
    assert proc.returncode == 2, describe(proc)
    assert "zz" in proc.stderr
    assert not (tmp_path / "r").exists() or not any((tmp_path / "r").iterdir())


def test_unknown_option_exits_2(tmp_path):
    proc = run_all("--bogus", tmp=tmp_path)
    assert proc.returncode == 2, describe(proc)
    assert "--bogus" in proc.stderr and len(proc.stderr.strip().splitlines()) == 1


def test_a_relative_results_dir_is_the_callers_not_the_checkouts(tmp_path):
    """fmr-ladder runs from any folder: ``--results-dir taken`` means the caller's ``taken`` (here a file,
    refused in one line naming it in full), not a folder of that name in the checkout."""
    (tmp_path / "taken").write_text("a file")
    proc = run_process(
        ["bash", str(REPO / "run_all.sh"), "--cpu", "--only", "01", "--results-dir", "taken"],
        subprocess_env(),
        cwd=tmp_path,
        timeout=60,
    )
    assert proc.returncode == 2, describe(proc)
    assert f"{tmp_path / 'taken'}: is a file" in proc.stderr and not (REPO / "taken").exists()


def test_help_exits_0(tmp_path):
    proc = run_all("--help", tmp=tmp_path)
    assert proc.returncode == 0, describe(proc)
    assert "--only" in proc.stdout and "--cpu" in proc.stdout
    assert "PYTHON=/path/to/python ./run_all.sh  the interpreter that runs the recipes" in proc.stdout


def test_failing_recipe_makes_the_exit_code_non_zero():
    proc, results = result("run_all:bad-01")
    assert proc.returncode != 0, describe(proc)
    assert "does not divide --batch-size 10" in proc.stderr, describe(proc)
    summary = proc.stdout[proc.stdout.index("Summary (cpu path") :].splitlines()
    line = next(ln for ln in summary if "01_baseline" in ln)
    assert "bad flags (exit 2)" in line
    assert not list(results.glob("01_baseline*.json"))


FAKE_PYTHON = """#!/usr/bin/env bash
# Stands in for python: records each recipe call, exits with the code the test chose for it.
if [ "$1" = -c ]; then echo "${FAKE_GPUS:-0}"; exit 0; fi   # run_all's "how many GPUs?" probe
if [ "$1" = -m ]; then echo "module $*" >> "$CALLS"; exit 0; fi
echo "$*" >> "$CALLS"
case "$1" in
  recipes/01_*) exit 3 ;;   # out of memory (recorded)
  recipes/04_*) exit 1 ;;   # crashed
  *) exit 0 ;;
esac
"""


def test_failures_do_not_stop_the_ladder(tmp_path):
    """With a stand-in interpreter: 01 'runs out of memory', 04 'crashes'; 02 and 05 still run, in order,
    with the CPU-path flags (02 gets bf16 autocast), the extra flags, and the report is rendered.
    Rungs that shard across GPUs are skipped (listed in the summary) on the CPU path, except 08_fsdp2
    and 09_cpu_offload (FSDP2), which shard across 2 CPU processes there."""
    fake = tmp_path / "fakepython"
    fake.write_text(FAKE_PYTHON)
    fake.chmod(0o755)
    calls = tmp_path / "calls.txt"
    results = tmp_path / "results"
    proc = run_process(
        [SCRIPT, "--cpu", "--only", "01,02,04,05,08,09", "--results-dir", results, "--", "--seed", "7"],
        subprocess_env(tmp_path / "logs", PYTHON=str(fake), CALLS=str(calls)),
        timeout=60,
    )
    assert proc.returncode == 1, describe(proc)
    lines = calls.read_text().splitlines()
    recipes = [ln.split()[0] for ln in lines if ln.startswith("recipes/")]
    assert [Path(r).stem for r in recipes][-2:] == ["08_fsdp2", "09_cpu_offload"], lines
    assert [Path(r).stem[:2] for r in recipes] == ["01", "02", "04", "05", "08", "09"], lines
    assert (
        lines[-2] == f"module -m fabric_memory_recipes.planning --ladder {results}"
    )  # the CPU track's predictions
    assert (
        lines[-1].startswith("module -m fabric_memory_recipes.measurement.report.render")
        and str(results) in lines[-1]
    )
    for ln in lines[:-2]:
        args = ln.split()
        for flag in ("--accelerator cpu", "--model vit_tiny", "--data digits", "--weights none"):
            assert flag in ln, (flag, ln)
        assert args[-2:] == ["--results-dir", str(results)]
        assert "--seed 7" in ln
        assert ("--precision bf16-mixed" in ln) == args[0].startswith("recipes/02_"), ln
    summary = proc.stdout[proc.stdout.index("Summary (cpu path") :].splitlines()

    def status(prefix):
        return next(ln for ln in summary if ln.strip().startswith(prefix))

    assert "out of memory (recorded)" in status("01_")
    assert "failed (exit 1)" in status("04_")
    assert " ok " in status("02_") + " " and " ok " in status("05_") + " "
    assert "skipped" in status("08_fsdp "), summary  # FSDP1 needs CUDA
    assert not any(ln.startswith("recipes/08_fsdp.py") for ln in lines)
    for name in ("08_fsdp2", "09_cpu_offload"):  # FSDP2 shards over CPU processes (gloo) too
        assert " ok " in status(name) + " "
        assert "--devices 2" in next(ln for ln in lines if ln.startswith(f"recipes/{name}.py"))
    assert os.path.isdir(results)


def test_quick_runs_the_single_gpu_ladder_with_few_steps_into_results_quick(tmp_path):
    """--quick on a (stand-in) 1-GPU machine: rungs 01-07 and 10-16 at full size with the quick flags,
    6 at a time with a GPU lock for their training loops, every multi-GPU rung skipped, no predicted
    ladder (the GPU measures), the report rendered and the time broken down by recipe."""
    fake = tmp_path / "fakepython"
    fake.write_text(FAKE_PYTHON.replace("exit 3 ;;", "exit 0 ;;").replace("exit 1 ;;", "exit 0 ;;"))
    fake.chmod(0o755)
    calls = tmp_path / "calls.txt"
    results = tmp_path / "quick"
    proc = run_process(
        [SCRIPT, "--quick", "--results-dir", results],
        subprocess_env(tmp_path / "logs", PYTHON=str(fake), CALLS=str(calls), FAKE_GPUS="1"),
        timeout=60,
    )
    assert proc.returncode == 0, describe(proc)
    assert "quick single-GPU ladder" in proc.stdout.splitlines()[0]
    lines = calls.read_text().splitlines()
    ran = [Path(ln.split()[0]).stem[:2] for ln in lines if ln.startswith("recipes/")]
    assert sorted(ran) == "01 02 03 04 05 06 07 10 11 12 13 14 15 16".split(), lines  # 6 at once: any order
    for ln in lines:
        if ln.startswith("recipes/"):
            for flag in ("--data synthetic", "--weights none", "--max-steps 20", "--eval-batches 1"):
                assert flag in ln, (flag, ln)
            assert "--accelerator cpu" not in ln and ln.endswith(f"--results-dir {results}")
    modules = [ln for ln in lines if ln.startswith("module")]
    assert modules[0] == f"module -m fabric_memory_recipes.measurement.report.render {results}"
    assert [m.split()[2] for m in modules[1:]] == ["fabric_memory_recipes.measurement.time_breakdown"]
    assert "Running up to 6 recipes at once" in proc.stdout
    summary = proc.stdout[proc.stdout.index("Summary (quick path") :]
    for name in ("08_fsdp ", "08_fsdp2", "09_cpu_offload"):
        assert "skipped (--quick: one GPU)" in next(ln for ln in summary.splitlines() if name in ln + " ")
    assert "total:" in summary


STOPPING_PYTHON = """#!/usr/bin/env bash
# Stands in for python: 01 writes an ok result; 04 crashes without writing (an earlier ok JSON of it is
# in the folder); 05 writes an ok result and then Ctrl-C reaches the process group, as it did when a
# signal came after a recipe had written its JSON; the report is the real one.
if [ "$1" = -c ]; then echo 0; exit 0; fi   # run_all's "how many GPUs?" probe
if [ "$1" = -m ]; then exec "$REAL_PYTHON" "$@"; fi
case "$1" in
  recipes/01_*) cp "$FRESH/01_baseline.json" "$RESULTS/"; exit 0 ;;
  recipes/04_*) exit 1 ;;
  recipes/05_*) cp "$FRESH/05_gradient_accumulation.json" "$RESULTS/"; kill -INT 0; exit 130 ;;
  *) exit 0 ;;
esac
"""


def _result_json(folder: Path, recipe: str, age_s: float = 0.0) -> Path:
    """A minimal ok results JSON of ``recipe`` in ``folder``, its file ``age_s`` seconds old."""
    folder.mkdir(parents=True, exist_ok=True)
    payload = {
        "schema_version": 1,
        "recipe": recipe,
        "tag": None,
        "status": "ok",
        "error": None,
        "config": {"precision": "32-true", "batch_size": 8},
        "provenance": {"device": "cpu", "world_size": 1},
        "memory": {"kind": "cpu_rss", "phases": {}},
        "timing": {"optimizer_steps": 5},
        "extra": {},
    }
    path = folder / f"{recipe}.json"
    path.write_text(json.dumps(payload, indent=2) + "\n")
    if age_s:
        os.utime(path, (time.time() - age_s, time.time() - age_s))
    return path


def test_ctrl_c_summary_and_report_tell_this_run_from_earlier_ones(tmp_path):
    """The summary takes a recipe's status from the JSON it wrote in this run (05: ok, though Ctrl-C came
    after it), not from an earlier JSON (04 crashed: its earlier ok JSON does not count); the report
    shows this run's rows in its table and the earlier ones (04, and 06 that never started) apart."""
    fake = tmp_path / "fakepython"
    fake.write_text(STOPPING_PYTHON)
    fake.chmod(0o755)
    results, fresh = tmp_path / "results", tmp_path / "fresh"
    for recipe in ("01_baseline", "05_gradient_accumulation"):
        _result_json(fresh, recipe)
    for recipe in ("04_lower_batch_size", "06_sgd_cosine"):  # a previous ladder's results
        _result_json(results, recipe, age_s=3600)
    env = subprocess_env(
        tmp_path / "logs",
        PYTHON=str(fake),
        REAL_PYTHON=sys.executable,
        FRESH=str(fresh),
        RESULTS=str(results),
    )
    proc = run_process([SCRIPT, "--cpu", "--only", "01,04,05,06", "--results-dir", results], env, timeout=120)
    assert proc.returncode == 130, describe(proc)
    summary = proc.stdout[proc.stdout.index("Summary (cpu path") :]
    assert re.search(r"01_baseline +ok ", summary), summary
    assert re.search(r"04_lower_batch_size +failed \(exit 1\)", summary), summary
    assert re.search(r"05_gradient_accumulation +ok \(stopped after: exit 130\)", summary), summary
    assert "stopped before: 06_sgd_cosine" in summary and "interrupted" not in summary, summary
    manifest = json.loads((results / "run_all.json").read_text())
    assert manifest["state"] == "stopped" and manifest["mode"] == "cpu"
    assert manifest["recipes"] == ["01_baseline", "04_lower_batch_size", "05_gradient_accumulation"]
    readme = (results / "README.md").read_text()
    table, _, earlier = readme.partition("## Earlier runs")
    rows = lambda text: re.findall(r"^\| (\d\d_\w+) \| ok \|", text, re.M)  # noqa: E731
    assert rows(table) == ["01_baseline", "05_gradient_accumulation"], readme
    assert rows(earlier) == ["04_lower_batch_size", "06_sgd_cosine"], readme
    assert "did not write" in earlier
    assert "report: 2 runs (and 2 earlier, apart)" in proc.stdout


def test_a_report_of_only_earlier_runs_says_so(tmp_path):
    """A ./run_all.sh stopped before any recipe wrote: every row is an earlier run, and the page says so."""
    _result_json(tmp_path, "01_baseline", age_s=3600)
    manifest = {"started": time.time() - 60, "mode": "cpu", "state": "stopped", "recipes": ["01_baseline"]}
    (tmp_path / "run_all.json").write_text(json.dumps(manifest))
    assert render.main([str(tmp_path)]) == 0
    readme = (tmp_path / "README.md").read_text()
    assert readme.splitlines()[2].startswith("> No run of the `./run_all.sh` of ")
    assert "| 01_baseline | ok |" in readme and "## Earlier runs" not in readme
    (tmp_path / "run_all.json").unlink()  # without the manifest: every row, no note
    assert render.main([str(tmp_path)]) == 0
    assert "No run of" not in (tmp_path / "README.md").read_text()


def test_a_report_of_only_the_last_runs_sets_nothing_apart(tmp_path):
    """Every result written by the last ./run_all.sh: no "did not write" note, no earlier section."""
    manifest = {"started": time.time() - 60, "mode": "cpu", "state": "finished", "recipes": ["01_baseline"]}
    (tmp_path / "run_all.json").write_text(json.dumps(manifest))
    _result_json(tmp_path, "01_baseline")
    assert render.main([str(tmp_path)]) == 0
    readme = (tmp_path / "README.md").read_text()
    assert "| 01_baseline | ok |" in readme
    assert "did not write" not in readme and "## Earlier runs" not in readme and "\n> " not in readme


def test_results_dir_inside_published_is_refused_unless_publishing(tmp_path):
    fake = tmp_path / "fakepython"
    fake.write_text(FAKE_PYTHON)
    fake.chmod(0o755)
    target = tmp_path / "results" / "published" / "cpu" / "ladder"
    env = subprocess_env(tmp_path / "logs", PYTHON=str(fake), CALLS=str(tmp_path / "calls.txt"))
    proc = run_process([SCRIPT, "--cpu", "--only", "02", "--results-dir", target], env, timeout=60)
    assert proc.returncode == 2, describe(proc)
    assert proc.stderr.strip() == (
        f"run_all.sh: --results-dir {target}: inside results/published/, the committed evidence; write to runs/"
        " instead, or set FMR_PUBLISH=1 to publish there on purpose"
    )
    assert not target.exists() and not (tmp_path / "calls.txt").exists()  # nothing ran
    proc = run_process(
        [SCRIPT, "--cpu", "--only", "02", "--results-dir", target], {**env, "FMR_PUBLISH": "1"}, timeout=60
    )
    assert proc.returncode == 0, describe(proc)
    assert (tmp_path / "calls.txt").read_text().startswith("recipes/02_mixed_precision.py ")


HANGING_UP_PYTHON = """#!/usr/bin/env bash
# Stands in for python: 01 writes an ok result; 04 is running when the terminal closes (SIGHUP to the
# process group) and ends by it; the report is the real one.
if [ "$1" = -c ]; then echo 0; exit 0; fi   # run_all's "how many GPUs?" probe
if [ "$1" = -m ]; then exec "$REAL_PYTHON" "$@"; fi
case "$1" in
  recipes/01_*) cp "$FRESH/01_baseline.json" "$RESULTS/"; exit 0 ;;
  recipes/04_*) kill -HUP 0; sleep 5; exit 0 ;;
  *) exit 0 ;;
esac
"""


def test_sighup_stops_the_ladder_with_its_summary_report_and_manifest(tmp_path):
    """A closed terminal (SIGHUP to the process group) killed ./run_all.sh with no summary and no report,
    leaving run_all.json at "running"."""
    fake = tmp_path / "fakepython"
    fake.write_text(HANGING_UP_PYTHON)
    fake.chmod(0o755)
    results, fresh = tmp_path / "results", tmp_path / "fresh"
    _result_json(fresh, "01_baseline")
    env = subprocess_env(
        tmp_path / "logs",
        PYTHON=str(fake),
        REAL_PYTHON=sys.executable,
        FRESH=str(fresh),
        RESULTS=str(results),
    )
    proc = run_process([SCRIPT, "--cpu", "--only", "01,04,05", "--results-dir", results], env, timeout=120)
    assert proc.returncode == 129, describe(proc)
    summary = proc.stdout[proc.stdout.index("Summary (cpu path") :]
    assert re.search(r"04_lower_batch_size +interrupted \(exit 129\)", summary), summary
    assert "stopped before: 05_gradient_accumulation" in summary, summary
    assert json.loads((results / "run_all.json").read_text())["state"] == "stopped"
    assert "| 01_baseline | ok |" in (results / "README.md").read_text()


STOPPED_STEP_PYTHON = """#!/usr/bin/env bash
# Stands in for python: every recipe succeeds; the module named by $STOP_IN is stopped by $SIGNAL sent
# to the process group (Ctrl-C or kill while it runs); the other modules succeed.
if [ "$1" = -c ]; then echo 0; exit 0; fi
if [ "$1" = -m ]; then
  case "$2" in "$STOP_IN") kill -"$SIGNAL" 0; sleep 5 ;; esac
  exit 0
fi
exit 0
"""


@pytest.mark.parametrize(
    ("module", "sig", "code", "line"),
    [
        ("fabric_memory_recipes.planning", "INT", 130, r"predicted ladder \(ViT-L/16\) +stopped \(SIGINT\)"),
        ("fabric_memory_recipes.measurement.report.render", "TERM", 143, r"report +stopped \(SIGTERM\)"),
    ],
)
def test_a_signal_after_the_recipes_is_a_stop_not_a_failure(tmp_path, module, sig, code, line):
    """SIGINT during the prediction was summarised as "failed"; SIGTERM while the report rendered left
    run_all.json at "finished" with exit 143."""
    fake = tmp_path / "fakepython"
    fake.write_text(STOPPED_STEP_PYTHON)
    fake.chmod(0o755)
    results = tmp_path / "results"
    env = subprocess_env(tmp_path / "logs", PYTHON=str(fake), STOP_IN=module, SIGNAL=sig)
    proc = run_process([SCRIPT, "--cpu", "--only", "04", "--results-dir", results], env, timeout=60)
    assert proc.returncode == code, describe(proc)
    summary = proc.stdout[proc.stdout.index("Summary (cpu path") :]
    assert re.search(line, summary) and "failed" not in summary, summary
    assert json.loads((results / "run_all.json").read_text())["state"] == "stopped"


@pytest.mark.parametrize(
    ("name", "said"),
    [("a" * 300, "a folder name is 300 bytes long"), ("x\udcff", "is not UTF-8 text")],
)
def test_a_results_dir_the_file_system_cannot_hold_is_refused_before_anything_runs(tmp_path, name, said):
    fake = tmp_path / "fakepython"
    fake.write_text(FAKE_PYTHON)
    fake.chmod(0o755)
    calls, target = tmp_path / "calls.txt", tmp_path / "out" / name
    env = subprocess_env(tmp_path / "logs", PYTHON=str(fake), CALLS=str(calls))
    proc = subprocess.run(
        [str(SCRIPT), "--cpu", "--only", "02", "--results-dir", os.fsencode(target)],
        env=env,
        capture_output=True,
        timeout=60,
    )
    err = proc.stderr.decode(errors="replace").strip()
    assert proc.returncode == 2 and len(err.splitlines()) == 1 and said in err, err
    assert err.startswith("run_all.sh: --results-dir ")
    assert not (tmp_path / "out").exists() and not calls.exists()


WAITING_PYTHON = """#!/usr/bin/env bash
# Stands in for python: every recipe records its call; 04 waits until the test opens the gate.
if [ "$1" = -c ]; then echo 0; exit 0; fi
echo "$*" >> "$CALLS"
case "$1" in recipes/04_*) while [ ! -e "$GATE" ]; do sleep 0.05; done ;; esac
exit 0
"""


def test_a_second_ladder_into_the_same_folder_is_refused_in_one_line(tmp_path):
    """Two ladders into one folder were not refused: the rungs each could not run (their own locks)
    were reported as "bad flags (exit 2)", and run_all.json kept one ladder's list."""
    fake = tmp_path / "fakepython"
    fake.write_text(WAITING_PYTHON)
    fake.chmod(0o755)
    results, calls, gate = tmp_path / "results", tmp_path / "calls.txt", tmp_path / "gate"
    env = subprocess_env(tmp_path / "logs", PYTHON=str(fake), CALLS=str(calls), GATE=str(gate))
    first = subprocess.Popen([str(SCRIPT), "--cpu", "--only", "04", "--results-dir", str(results)], env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while not (calls.exists() and "recipes/04_" in calls.read_text()) and time.monotonic() < deadline:
            time.sleep(0.05)
        second = run_process([SCRIPT, "--cpu", "--only", "01,05", "--results-dir", results], env, timeout=60)
        gate.touch()
        out, err = first.communicate(timeout=60)
    finally:
        gate.touch()
        if first.poll() is None:
            os.killpg(first.pid, 9)
    assert second.returncode == 2, describe(second)
    (line,) = second.stderr.strip().splitlines()
    assert line == (
        f"run_all.sh: another ./run_all.sh (pid {first.pid}) is writing to {results}: wait for it to end,"
        " or give this one another --results-dir"
    ), line
    assert first.returncode == 0, out + err
    assert not any(c.startswith(("recipes/01_", "recipes/05_")) for c in calls.read_text().splitlines())
    assert json.loads((results / "run_all.json").read_text())["recipes"] == ["04_lower_batch_size"]
    assert not (results / ".run_all.lock").exists(), "the lock goes with the ladder"
