"""Outputs a user can trust: a run writes under runs/ by default, never into the committed evidence
(results/published/) unless asked to (FMR_PUBLISH=1), and every name or folder a user gives is checked
before anything is built (one line, exit 2, no traceback).

The clean-checkout test copies the working tree into a fresh git repository, runs a recipe and
``./run_all.sh`` there with their default folders, and asks git whether anything changed.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from devtools import check_equivalence, same_parameters
from fabric_memory_recipes import paths
from fabric_memory_recipes.config import RunConfig, UsageError
from fabric_memory_recipes.measurement import results_file
from fabric_memory_recipes.measurement.report import render
from fabric_memory_recipes.planning import __main__ as estimator
from fabric_memory_recipes.tools.compare import reference
from fabric_memory_recipes.tools.convergence import benchmark
from fabric_memory_recipes.training import cli, lifecycle
from tests.conftest import CPU_ARGS, REPO, describe, result, run_process, session_dir, submit, subprocess_env

BACKGROUND_TESTS = {"test_default_runs_leave_a_clean_checkout_clean"}
BACKGROUND_PRIORITY = 20  # a recipe, then run_all.sh (a recipe, the prediction, the report)
QUICK = [*CPU_ARGS[:-4], "--max-steps", "1", "--eval-batches", "1"]


def one_error_line(err: str, start: str) -> str:
    lines = [ln for ln in err.strip().splitlines() if ln.strip()]
    assert len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].startswith(start), lines[0]
    return lines[0]


# ----------------------------------------------------------------------------- runs/ by default
def _clean_checkout_runs() -> dict:
    """A copy of the working tree as a fresh repository; a recipe and ./run_all.sh with default folders."""
    copy = session_dir("checkout") / "repo"
    listed = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=REPO,
                            capture_output=True, check=True).stdout.decode().split("\0")  # fmt: skip
    for name in filter(None, listed):
        if (REPO / name).is_file():
            (copy / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / name, copy / name)
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-c", "commit.gpgsign=false"]
    for cmd in (["init", "-q"], ["add", "-A"], ["commit", "-q", "-m", "copy"]):
        subprocess.run([*git, *cmd], cwd=copy, check=True, capture_output=True)
    env = subprocess_env(PYTHONPATH=str(copy), PYTHON=sys.executable)
    del env["FMR_LOG_DIR"]  # the default log folder too
    recipe = run_process(
        [sys.executable, "recipes/01_baseline.py", "--accelerator", "cpu", "--model", "vit_tiny", "--data",
         "synthetic", "--weights", "none", "--max-steps", "2", "--checkpoint-every", "1"],
        env, cwd=copy,
    )  # fmt: skip
    ladder = run_process([copy / "run_all.sh", "--cpu", "--only", "01"], env, cwd=copy)
    status = subprocess.run(
        ["git", "status", "--porcelain", "--untracked-files=all"],
        cwd=copy,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return dict(copy=copy, recipe=recipe, ladder=ladder, status=status)


def start_background_jobs() -> None:
    submit("outputs:checkout", _clean_checkout_runs)


def test_default_runs_leave_a_clean_checkout_clean():
    job = result("outputs:checkout")
    copy, recipe, ladder = job["copy"], job["recipe"], job["ladder"]
    assert recipe.returncode == 0, describe(recipe)
    assert ladder.returncode == 0, describe(ladder)
    runs = copy / "runs"
    assert json.loads((runs / "01_baseline.json").read_text())["status"] == "ok"
    assert sorted(p.name for p in (runs / "checkpoints" / "01_baseline").glob("step-*.ckpt")) == [
        "step-000001.ckpt"
    ]  # the newest kept; the final step writes none
    assert (runs / "cpu" / "01_baseline.json").exists() and (runs / "cpu" / "README.md").exists()
    assert json.loads((runs / "cpu" / "run_all.json").read_text())["recipes"] == ["01_baseline"]
    assert f"Summary (cpu path, results in {runs / 'cpu'})" in ladder.stdout  # said in full
    assert job["status"] == "", f"a default run changed the checkout:\n{job['status']}"


def test_defaults_are_under_runs(tmp_path, monkeypatch, capsys):
    def said() -> str:
        return " ".join(capsys.readouterr().out.split())  # --help wraps its lines

    assert RunConfig().results_dir == "runs"
    cfg = lifecycle.resolve_checkpoints(cli.parse(RunConfig(recipe="05_x"), ["--accelerator", "cpu"]))
    assert cfg.checkpoint_dir == os.path.join("runs", "checkpoints", "05_x")
    assert benchmark.parse_args([]).out == Path("runs/convergence")
    with pytest.raises(SystemExit):
        check_equivalence.main(["--help"])
    assert "(default: runs/equivalence)" in said()
    with pytest.raises(SystemExit):
        same_parameters.main(["--help"])
    assert "(default: runs/same_parameters.json)" in said()
    with pytest.raises(SystemExit):
        reference.main(["--help"])
    assert "(default: runs/compare-<gpu>)" in said()
    monkeypatch.chdir(tmp_path)  # the report reads runs/ unless given a folder
    assert render.main([]) == 2
    assert capsys.readouterr().err.strip() == "report: runs is not a directory"


# --------------------------------------------------------------------------- committed evidence
def test_a_run_into_results_published_is_refused_unless_publishing(run_recipe, tmp_path, monkeypatch):
    target = tmp_path / "results" / "published" / "cpu" / "ladder"
    proc, payload = run_recipe("01_baseline", *QUICK, "--results-dir", target)
    assert proc.returncode == 2 and payload is None, describe(proc)
    one_error_line(
        proc.stderr,
        f"01_baseline.py: error: --results-dir {target}: inside results/published/, the committed evidence;"
        " write to runs/ instead, or set FMR_PUBLISH=1 to publish there on purpose",
    )
    assert not target.exists()
    monkeypatch.setenv("FMR_PUBLISH", "1")
    proc, payload = run_recipe("01_baseline", *QUICK, "--results-dir", target)
    assert proc.returncode == 0 and payload["status"] == "ok", describe(proc)


def test_the_writer_refuses_published_paths_through_links_too(tmp_path, monkeypatch):
    published = tmp_path / "results" / "published" / "h100"
    published.mkdir(parents=True)
    (tmp_path / "link").symlink_to(published)
    for path in (published / "a.json", tmp_path / "link" / "b.json"):
        with pytest.raises(UsageError, match="inside results/published/"):
            results_file.write_json_atomic(str(path), {"x": 1})
    assert list(published.iterdir()) == []
    results_file.write_json_atomic(str(tmp_path / "results" / "c.json"), {"x": 1})  # beside it: fine
    monkeypatch.setenv("FMR_PUBLISH", "1")
    results_file.write_json_atomic(str(published / "a.json"), {"x": 1})
    assert json.loads((published / "a.json").read_text()) == {"x": 1}


def test_tools_and_the_report_refuse_published_outputs(tmp_path, capsys):
    published = tmp_path / "results" / "published" / "h100" / "convergence"
    published.mkdir(parents=True)
    with pytest.raises(SystemExit) as exc:
        benchmark.parse_args(["--out", str(published)])
    assert exc.value.code == 2
    one_error_line(
        capsys.readouterr().err, f"{Path(sys.argv[0]).name}: error: argument --out: {published}: inside"
    )
    assert render.main([str(published)]) == 2
    one_error_line(
        capsys.readouterr().err, f"report: cannot render into {published}: inside results/published/"
    )
    with pytest.raises(SystemExit) as exc:
        estimator.main(["--ladder", str(published)])
    assert exc.value.code == 2
    assert "--ladder" in one_error_line(capsys.readouterr().err, f"{Path(sys.argv[0]).name}: error: --ladder")
    (tmp_path / "file").write_text("x")
    with pytest.raises(SystemExit):
        benchmark.parse_args(["--out", str(tmp_path / "file" / "sub")])
    assert f"{tmp_path / 'file'} is a file, not a folder" in capsys.readouterr().err


# ----------------------------------------------------------------------------------- user names
@pytest.mark.parametrize("tag", ["a/b", "../up", "..", ".", "", "two words"])
def test_a_tag_is_a_plain_name(tag, capsys):
    with pytest.raises(SystemExit) as exc:
        cli.parse(RunConfig(recipe="01_baseline"), ["--accelerator", "cpu", "--tag", tag])
    assert exc.value.code == 2
    line = one_error_line(capsys.readouterr().err, f"{Path(sys.argv[0]).name}: error: --tag {tag!r}: ")
    assert ("is not a name" in line) == (tag in ("", ".", ".."))


def test_a_recipe_run_with_a_path_as_tag_is_one_line(run_recipe):
    """It used to end in a FileNotFoundError traceback after the run, writing <results>/sub/x.json."""
    proc, _ = run_recipe("01_baseline", *QUICK, "--tag", "sub/x")
    assert proc.returncode == 2, describe(proc)
    one_error_line(
        proc.stderr,
        "01_baseline.py: error: --tag 'sub/x': a plain name holds only letters, digits, '.', '_' and '-'"
        " (this one has '/')",
    )


@pytest.mark.parametrize("name", ["a/b", "/etc/passwd", "", ".."])
def test_the_estimators_recipe_is_a_plain_name(name, capsys):
    with pytest.raises(SystemExit) as exc:
        estimator.main(["--recipe", name])
    assert exc.value.code == 2
    one_error_line(capsys.readouterr().err, f"{Path(sys.argv[0]).name}: error: --recipe {name!r}: ")


def test_a_plain_name_type_refuses_in_one_line(capsys):
    with pytest.raises(SystemExit) as exc:
        same_parameters.main(["--base", "HEAD", "--recipe", "../08"])
    assert exc.value.code == 2
    one_error_line(
        capsys.readouterr().err, f"{Path(sys.argv[0]).name}: error: argument --recipe: '../08': a plain name"
    )
    assert paths.name_problem("bonus_llm_finetune-lora.v2") is None


# ------------------------------------------------------------------------------- output folders
def test_output_folders_that_are_files_are_one_line(run_recipe, tmp_path):
    blocker = tmp_path / "blocker"
    blocker.write_text("a file")
    proc, _ = run_recipe("01_baseline", *QUICK, "--results-dir", blocker)
    assert proc.returncode == 2, describe(proc)
    one_error_line(proc.stderr, f"01_baseline.py: error: --results-dir {blocker}: is a file, not a folder")
    argv = [*QUICK, "--checkpoint-every", "1", "--checkpoint-dir", blocker / "ckpt"]
    proc, _ = run_recipe("01_baseline", *argv)
    assert proc.returncode == 2, describe(proc)
    one_error_line(
        proc.stderr,
        f"01_baseline.py: error: --checkpoint-dir {blocker / 'ckpt'}: {blocker} is a file, not a folder",
    )


LONG_PATHS = {
    "a folder name over 255 bytes": ("a" * 300, "a folder name is 300 bytes long"),
    "a path over 4096 bytes": ("/".join(["b" * 200] * 25), "bytes long: an output folder is at most 3840"),
    "undecodable bytes": ("x\udcff", "is not UTF-8 text"),
}


@pytest.mark.parametrize("case", sorted(LONG_PATHS))
def test_a_results_dir_the_file_system_cannot_hold_is_one_line_before_anything_is_made(
    run_recipe, tmp_path, case
):
    """They ended in a traceback (OSError: [Errno 36] File name too long, from the output folder's
    check and the run's lock); undecodable bytes made the folder, then failed on printing its name."""
    name, said = LONG_PATHS[case]
    proc, _ = run_recipe("01_baseline", *QUICK, "--results-dir", tmp_path / "out" / name)
    assert proc.returncode == 2, describe(proc)
    assert said in one_error_line(proc.stderr, "01_baseline.py: error: --results-dir "), proc.stderr
    assert not (tmp_path / "out").exists(), "nothing is created"


def test_a_300_character_tag_is_one_line(run_recipe, tmp_path):
    """A tag that long passed the name check and failed at the lock (File name too long)."""
    proc, _ = run_recipe("01_baseline", *QUICK, "--tag", "t" * 300, "--results-dir", tmp_path / "out")
    assert proc.returncode == 2, describe(proc)
    assert "a plain name is at most 100 characters (this one has 300)" in one_error_line(
        proc.stderr, "01_baseline.py: error: --tag "
    )
    assert not (tmp_path / "out").exists()


def test_a_lock_that_cannot_be_made_is_one_line(tmp_path):
    from fabric_memory_recipes import faults

    with pytest.raises(faults.BadInput, match="cannot create the lock .*File name too long"):
        faults.RunLock(str(tmp_path), "r" * 300).acquire()


# ---------------------------------------------------------------------------------------- resume
def test_resume_of_a_missing_file_says_what_is_there(tmp_path, capsys):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    torch.save({"step": 2}, ckpt / "step-000002.ckpt")
    rung = RunConfig(recipe="01_baseline")
    for missing, said in (
        (ckpt / "step-000040.ckpt", f"no such file; {ckpt} holds step-000002.ckpt"),
        (tmp_path / "nowhere" / "x.ckpt", f"no such file; {tmp_path / 'nowhere'}: no such folder"),
        (ckpt, "a folder of checkpoints, not one (newest step-000002.ckpt): pass a file, or --resume auto"),
    ):
        with pytest.raises(SystemExit) as exc:
            lifecycle.resolve_checkpoints(cli.parse(rung, ["--accelerator", "cpu", "--resume", str(missing)]))
        assert exc.value.code == 2
        one_error_line(
            capsys.readouterr().err, f"{Path(sys.argv[0]).name}: error: --resume {missing}: {said}"
        )


def test_resume_auto_without_a_checkpoint_says_what_it_found(tmp_path, capsys):
    empty, other = tmp_path / "empty", tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("not a checkpoint")
    rung = RunConfig(recipe="05_gradient_accumulation")
    for folder, found in ((empty, "no such folder"), (other, "none")):
        argv = ["--accelerator", "cpu", "--resume", "auto", "--checkpoint-dir", str(folder)]
        cfg = lifecycle.resolve_checkpoints(cli.parse(rung, argv))
        assert cfg.resume is None  # the same command line starts a first run
        assert capsys.readouterr().out.strip() == (
            f"[resume] --resume auto: no usable checkpoint of 05_gradient_accumulation in {folder}"
            f" (found: {found}): starting from the beginning"
        )
