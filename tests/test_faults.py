"""Faults lose nothing: one test per row of the fault table (README, "Faults and preemption"), with real
signals sent to real recipe processes. Each asserts the exit code, the one line that explains it (no
traceback), and that earlier results and checkpoints are still there byte for byte.

``python devtools/fault_drill.py`` runs this module (the multi-node test included) and prints the table:
every test records its row, what is expected and what was observed (``record_property``).

Speed. The runs that receive signals are real processes (real handlers, real exit codes), started in
the background as soon as the tests are collected; the runs that need no signal (refusals at start,
resuming) run in this interpreter (conftest.run_recipe_inprocess). All of them train on a small
CIFAR-10 written in the real file format instead of 60,000 synthetic images. The multi-node test
(two torchrun launches) runs only with FMR_TEST_MULTINODE=1, as the drill sets it.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest
import torch

from fabric_memory_recipes import faults
from fabric_memory_recipes.config import Hardware, RunConfig
from fabric_memory_recipes.measurement.report import render
from fabric_memory_recipes.measurement.results import RunResults
from fabric_memory_recipes.training import checkpoints, cli, data, lifecycle, loop
from tests.conftest import (
    RECIPES_DIR,
    REPO,
    Started,
    background_priority,
    describe,
    free_port,
    from_a_terminal,
    load_recipe_module,
    result,
    run_recipe_inprocess,
    session_dir,
    submit,
    subprocess_env,
)
from tests.measurement.test_report import make_result
from tests.tiny import write_cifar

pytestmark = pytest.mark.faults
BACKGROUND_PRIORITY = 5  # the chains here wait for signals: start them first
MULTINODE = os.environ.get("FMR_TEST_MULTINODE", "") not in ("", "0")
TIMEOUT = 300
QUICK = ("--accelerator", "cpu", "--model", "vit_tiny", "--weights", "none", "--eval-batches", "1",
         "--lr", "1e-3")  # fmt: skip
UNTIL_STOPPED = ("--epochs", "100000", "--max-steps", "10000000")  # runs until a signal stops it
BAR = re.compile(r"^[\w.-]+: +\d+%\|")  # a tqdm progress line (redrawn with \r on stderr)
STEPS_DONE = re.compile(r"\| *([1-9]\d*)/\d+ \[")  # the bar after at least one optimizer step


# ------------------------------------------------------------------------------------------- helpers
class Drill:
    """The row of the fault table a test checks, for devtools/fault_drill.py (junit XML properties)."""

    def __init__(self, record_property, row: str, expected: str) -> None:
        self._record = record_property
        record_property("row", row)
        record_property("expected", expected)

    def observed(self, text: str) -> None:
        self._record("observed", text)

    def saw(self, proc: subprocess.CompletedProcess) -> None:
        """Record the exit code and the recipe's own lines on stderr (``<script>.py: ...``)."""
        lines = message_lines(proc.stderr)
        own = [ln for ln in lines if re.match(r"[\w.-]+\.py: ", ln)] or lines
        self.observed(f"exit {proc.returncode}; {' | '.join(own)}")


@pytest.fixture
def drill(record_property):
    return lambda row, expected: Drill(record_property, row, expected)


def message_lines(stderr: str) -> list[str]:
    """stderr as a person reads it: without the progress bar's redraws and blank lines."""
    return [ln for ln in stderr.replace("\r", "\n").splitlines() if ln.strip() and not BAR.match(ln)]


def one_line(proc: subprocess.CompletedProcess, starts: str, launcher_noise: bool = False) -> str:
    """The single message line on stderr (asserted: exactly one, no traceback) that starts so.
    ``launcher_noise``: with several processes, Lightning's own launch banner and warnings are on
    stderr too; then only the recipe's lines (``<recipe>.py: ...``) are counted."""
    lines = message_lines(proc.stderr)
    if launcher_noise:
        lines = [ln for ln in lines if ln.startswith(starts.split(":")[0] + ":")]
    assert "Traceback" not in proc.stderr + proc.stdout, describe(proc)
    assert len(lines) == 1 and lines[0].startswith(starts), describe(proc)
    return lines[0]


def snapshot(*folders: Path) -> dict[str, str]:
    """sha256 of every file below ``folders`` (hidden ones too), by path."""
    found = {}
    for folder in folders:
        for path in sorted(Path(folder).rglob("*")):
            if path.is_file():
                found[str(path)] = hashlib.sha256(path.read_bytes()).hexdigest()
    return found


def assert_intact(before: dict[str, str]) -> None:
    after = {
        p: hashlib.sha256(Path(p).read_bytes()).hexdigest() if Path(p).is_file() else None for p in before
    }
    changed = [p for p in before if after[p] != before[p]]
    assert not changed, f"changed or removed: {changed}"


def earlier_result(results: Path, recipe: str) -> Path:
    """An earlier successful results JSON of ``recipe`` in ``results`` (what a fault must not replace)."""
    results.mkdir(parents=True, exist_ok=True)
    payload = {
        "schema_version": 1,
        "recipe": recipe,
        "tag": None,
        "description": "an earlier run",
        "status": "ok",
        "error": None,
        "config": {"precision": "32-true", "batch_size": 8, "accumulation_steps": 1},
        "provenance": {"device": "cpu", "world_size": 1},
        "memory": {"kind": "cpu_rss", "phases": {}},
        "timing": {"optimizer_steps": 5},
        "accuracy": {"train": 0.5},
        "loss": {},
        "extra": {},
    }
    path = results / f"{recipe}.json"
    path.write_text(json.dumps(payload, indent=2) + "\n")
    return path


def tiny_cifar(folder: Path, files: int = 2, per_file: int = 60) -> list[str]:
    """CIFAR-10 in its on-disk format, small, and the flags that train on it."""
    write_cifar(folder, n_train_files=files, per_batch=per_file)
    return ["--data", "cifar10", "--data-dir", str(folder)]


class Running(Started):
    """A recipe process started now: watched through its output, signalled, waited for."""

    def __init__(self, name: str, args, log_dir: Path, fresh: bool = False) -> None:
        super().__init__(
            [RECIPES_DIR / f"{name}.py", *args], subprocess_env(log_dir), log_dir.parent / "runs", fresh
        )

    def wait_until(self, ready, timeout: float = TIMEOUT) -> bool:
        """Poll ``ready(stdout, stderr)`` until it holds (True) or the process ends or time is up."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and self.running():
            if ready(*self.read()):
                return True
            time.sleep(0.05)
        return bool(ready(*self.read()))

    def send(self, sig: int) -> None:
        os.kill(self.pid, sig)


def started(out: str, err: str) -> bool:
    return bool(STEPS_DONE.search(err))


# ------------------------------------------------------------------------------------ background jobs
def _sigint_and_a_second_run() -> dict:
    """Rung 01 trains until Ctrl-C; meanwhile a second run of the rung starts into the same folder."""
    tmp = session_dir("faults-sigint")
    results = tmp / "results"
    earlier = earlier_result(results, "01_baseline")
    before = snapshot(results)
    args = [*QUICK, *tiny_cifar(tmp / "data"), "--batch-size", "8", *UNTIL_STOPPED, "--results-dir", results]
    first = Running("01_baseline", args, tmp / "logs", fresh=True)  # the lock names its pid: this one's
    ok = first.wait_until(started)
    second = Running("01_baseline", args, tmp / "logs-2").wait() if ok else None
    first_pid = first.pid
    first.send(signal.SIGINT)
    return dict(
        proc=first.wait(), second=second, pid=first_pid, before=before, results=results, earlier=earlier
    )


def _sigusr1_prune_resume_and_truncated() -> dict:
    """SIGUSR1 (SLURM's warning) with periodic checkpoints; then a resume; then, on a copy of the
    checkpoints whose newest is truncated, --resume auto."""
    tmp = session_dir("faults-usr1")
    results, ckpt = tmp / "results", tmp / "ckpt"
    cifar = tiny_cifar(tmp / "data")
    common = [*QUICK, *cifar, "--batch-size", "8", "--epochs", "100000", "--checkpoint-dir", ckpt]
    run = Running(
        "01_baseline",
        [*common, "--max-steps", "10000000", "--checkpoint-every", "2", "--results-dir", results],
        tmp / "logs",
    )
    # three saves at least, so that one was pruned (the newest two are kept: poll the highest step)
    run.wait_until(lambda out, err: max((s for s, _ in checkpoints.listing(str(ckpt))), default=0) >= 6)
    run.send(signal.SIGUSR1)
    stopped = run.wait()
    out = dict(
        stopped=stopped, ckpt=ckpt, listing=sorted(p.name for p in ckpt.iterdir()) if ckpt.exists() else []
    )
    payload = results / "01_baseline.json"
    if stopped.returncode != 138 or not payload.exists():
        return out
    step = json.loads(payload.read_text())["extra"]["stopped"]["step"]
    copy = tmp / "ckpt-copy"
    shutil.copytree(ckpt, copy)
    return dict(out, step=step, tmp=tmp, results=results, common=common, cifar=cifar, copy=copy)


_USR1_AFTER: dict = {}


def _usr1_resumed() -> dict:
    """After the SIGUSR1 job: resume its run (in this interpreter; no signal is needed), then, on a
    copy of the checkpoints whose newest is truncated, --resume auto. Once for the tests that read it."""
    job = result("faults:usr1")
    if "step" not in job or _USR1_AFTER:
        return {**job, **_USR1_AFTER}
    tmp, step, ckpt, copy = job["tmp"], job["step"], job["ckpt"], job["copy"]
    before = snapshot(ckpt)
    resumed, _ = run_recipe_inprocess(
        "01_baseline", [*job["common"], "--max-steps", step + 2, "--resume", "auto"], job["results"]
    )
    newest = copy / checkpoints.file_name(step)
    newest.write_bytes(newest.read_bytes()[: newest.stat().st_size // 2])  # a save cut short
    copy_before = snapshot(copy)
    fallback, _ = run_recipe_inprocess(
        "01_baseline",
        [*QUICK, *job["cifar"], "--batch-size", "8", "--epochs", "100000", "--max-steps", step + 2,
         "--checkpoint-dir", copy, "--resume", "auto", "--no-checkpoint-on-stop"],
        tmp / "results-fallback",
    )  # fmt: skip
    _USR1_AFTER.update(
        resumed=resumed,
        before=before,
        fallback=fallback,
        copy_before=copy_before,
        fallback_results=tmp / "results-fallback",
        truncated=newest,
    )
    return {**job, **_USR1_AFTER}


def _second_ctrl_c() -> dict:
    """Long optimizer steps (128 micro-batches each): Ctrl-C, then Ctrl-C again within the step.

    Should the step end between the two (a machine much faster than this test expects), the first
    Ctrl-C stops the run normally and nothing about the second is shown: that attempt is repeated."""
    attempts = 0
    while attempts < 3:
        attempts += 1
        tmp = session_dir("faults-twice")
        results = tmp / "results"
        earlier_result(results, "01_baseline")
        before = snapshot(results)
        args = [*QUICK, *tiny_cifar(tmp / "data", files=5, per_file=1000), "--batch-size", "4096",
                "--accumulation-steps", "128", *UNTIL_STOPPED, "--results-dir", results]  # fmt: skip
        run = Running("01_baseline", args, tmp / "logs")
        run.wait_until(lambda out, err: re.search(r"01_baseline: +0%\|", err))  # the bar: step 1 begins
        run.send(signal.SIGINT)
        acknowledged = run.wait_until(lambda out, err: "[stop] SIGINT" in out)
        sent = time.monotonic()
        run.send(signal.SIGINT)
        proc = run.wait()
        if "interrupted at step" not in proc.stderr:
            break
    return dict(
        proc=proc,
        seconds=time.monotonic() - sent,
        acknowledged=acknowledged,
        before=before,
        results=results,
        attempts=attempts,
    )


def _sigterm_to_rank_0_of_two() -> dict:
    """08_fsdp2 with two gloo processes; SIGTERM reaches rank 0 only (``kill <pid>``)."""
    tmp = session_dir("faults-fsdp2")
    results, ckpt = tmp / "results", tmp / "ckpt"
    args = [*QUICK, *tiny_cifar(tmp / "data"), "--devices", "2", "--batch-size", "8", *UNTIL_STOPPED,
            "--checkpoint-on-stop", "--checkpoint-dir", ckpt, "--results-dir", results]  # fmt: skip
    run = Running("08_fsdp2", args, tmp / "logs")
    run.wait_until(started)
    run.send(signal.SIGTERM)
    return dict(proc=run.wait(), results=results, ckpt=ckpt)


def _sigterm_during_evaluation() -> dict:
    """Rung 01: two training steps, then a test split of 3000 images; SIGTERM once the evaluation's bar
    has moved."""
    tmp = session_dir("faults-sigterm-eval")
    write_cifar(tmp / "data", n_train_files=1, per_batch=40, n_test=3000)
    results = tmp / "results"
    args = ["--accelerator", "cpu", "--model", "vit_tiny", "--weights", "none", "--batch-size", "4",
            "--max-steps", "2", "--data", "cifar10", "--data-dir", tmp / "data", "--results-dir", results]  # fmt: skip
    run = Running("01_baseline", args, tmp / "logs")
    in_test = run.wait_until(
        lambda out, err: re.search(r"test accuracy: +\d+%\|.*\| *[1-9]\d*/", err) is not None
    )
    run.send(signal.SIGTERM)
    start = time.monotonic()
    proc = run.wait()
    return dict(proc=proc, in_test=in_test, seconds=time.monotonic() - start, results=results)


_REFUSED: dict = {}


def _quick_refusals() -> dict:
    """Runs refused before anything is built (in this interpreter, once): garbage --resume, an
    unwritable --results-dir, a truncated CIFAR-10 batch file."""
    if _REFUSED:
        return _REFUSED
    tmp = session_dir("faults-refused")
    results = tmp / "results"
    earlier_result(results, "01_baseline")
    garbage = tmp / "downloaded.ckpt"
    garbage.write_bytes(os.urandom(4096))
    cifar = tiny_cifar(tmp / "data")
    batch = tmp / "data" / "cifar-10-batches-py" / "data_batch_1"
    batch.write_bytes(batch.read_bytes()[:5000])  # a copy cut short
    blocker = tmp / "a-file"
    blocker.write_text("not a folder\n")
    before = snapshot(results)
    base = [*QUICK, "--batch-size", "8", "--max-steps", "2"]
    runs = {
        "garbage": [*base, *cifar, "--resume", garbage, "--results-dir", results],
        "unwritable": [*base, "--data", "synthetic", "--results-dir", blocker / "results"],
        "corrupt": [*base, *cifar, "--results-dir", results],
    }
    _REFUSED.update(
        {k: run_recipe_inprocess("01_baseline", v, results)[0] for k, v in runs.items()},
        before=before,
        garbage_file=garbage,
        blocker=blocker,
        batch=batch,
    )
    return _REFUSED


def _no_gpu() -> dict:
    """Rung 05 started bare on a machine without a GPU; then the command its refusal suggests (in
    this interpreter: the refusal comes from the flags, before anything is built)."""
    tmp = session_dir("faults-nogpu")
    refused, _ = run_recipe_inprocess("05_gradient_accumulation", [], tmp / "refused")
    suggested = re.search(r"python recipes/05_gradient_accumulation\.py( [^(]*?) \(", refused.stderr)
    ran = None
    if suggested:
        ran, _ = run_recipe_inprocess("05_gradient_accumulation", suggested.group(1).split(), tmp / "results")
    return dict(refused=refused, ran=ran, tmp=tmp)


FAKE_PYTHON = """#!/usr/bin/env bash
# Stands in for python in run_all.sh: rung 01 "ran" (its result is copied in), rung 04 runs for real
# until it is stopped, the report is the real one.
if [ "$1" = -c ]; then echo 0; exit 0; fi                 # run_all's "how many GPUs?" probe
case "$1" in
  recipes/01_*) cp "$EARLIER" "$RESULTS/01_baseline.json"; exit 0 ;;
  recipes/04_*) exec "$REAL_PYTHON" "$@" $EXTRA ;;
  *) exec "$REAL_PYTHON" "$@" ;;
esac
"""


def _run_all_ctrl_c() -> dict:
    tmp = session_dir("faults-run-all")
    results = tmp / "results"
    earlier = earlier_result(tmp / "earlier", "01_baseline")
    fake = tmp / "python"
    fake.write_text(FAKE_PYTHON)
    fake.chmod(0o755)
    extra = " ".join([*tiny_cifar(tmp / "data"), "--batch-size", "8", *UNTIL_STOPPED])
    env = subprocess_env(
        tmp / "logs",
        PYTHON=str(fake),
        REAL_PYTHON=sys.executable,
        EARLIER=str(earlier),
        RESULTS=str(results),
        EXTRA=extra,
    )
    out, err = tmp / "run_all.out", tmp / "run_all.err"
    with open(out, "w") as o, open(err, "w") as e:
        proc = subprocess.Popen(
            [str(REPO / "run_all.sh"), "--cpu", "--only", "01,04,05", "--results-dir", str(results)],
            cwd=REPO,
            env=env,
            stdout=o,
            stderr=e,
            start_new_session=True,
        )
    background_priority(proc)
    try:
        deadline = time.monotonic() + TIMEOUT
        while proc.poll() is None and time.monotonic() < deadline:
            if re.search(r"04_lower_batch_size: +\d+%.*\| *[1-9]\d*/", err.read_text(errors="replace")):
                break
            time.sleep(0.05)
        os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C in a terminal: the whole foreground process group
        proc.wait(TIMEOUT)
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    completed = subprocess.CompletedProcess(proc.args, proc.wait(), out.read_text(), err.read_text())
    return dict(proc=completed, results=results)


JOBS = {
    "faults:sigint": _sigint_and_a_second_run,
    "faults:usr1": _sigusr1_prune_resume_and_truncated,
    "faults:fsdp2": _sigterm_to_rank_0_of_two,
    "faults:twice": _second_ctrl_c,
    "faults:run_all": _run_all_ctrl_c,
    "faults:sigterm-eval": _sigterm_during_evaluation,
}
BACKGROUND_TESTS = {
    "test_sigint_stops_at_a_step_and_keeps_the_earlier_result",
    "test_a_second_run_of_a_rung_refuses_at_start",
    "test_sigterm_to_one_rank_stops_every_rank_at_the_same_step",
    "test_sigusr1_checkpoints_and_exits_138",
    "test_checkpoints_are_pruned_to_the_newest",
    "test_a_resumed_run_says_where_it_resumed",
    "test_truncated_newest_checkpoint_falls_back_to_the_intact_one",
    "test_a_second_ctrl_c_exits_at_once",
    "test_run_all_ctrl_c_prints_the_summary_and_renders_the_report",
    "test_sigterm_during_evaluation_stops_a_real_process_at_the_next_batch",
}
NEEDS = {  # test -> the job it waits for
    "test_sigint_stops_at_a_step_and_keeps_the_earlier_result": "faults:sigint",
    "test_a_second_run_of_a_rung_refuses_at_start": "faults:sigint",
    "test_sigterm_to_one_rank_stops_every_rank_at_the_same_step": "faults:fsdp2",
    "test_sigusr1_checkpoints_and_exits_138": "faults:usr1",
    "test_checkpoints_are_pruned_to_the_newest": "faults:usr1",
    "test_a_resumed_run_says_where_it_resumed": "faults:usr1",
    "test_truncated_newest_checkpoint_falls_back_to_the_intact_one": "faults:usr1",
    "test_a_second_ctrl_c_exits_at_once": "faults:twice",
    "test_run_all_ctrl_c_prints_the_summary_and_renders_the_report": "faults:run_all",
    "test_sigterm_during_evaluation_stops_a_real_process_at_the_next_batch": "faults:sigterm-eval",
}
assert set(NEEDS) == BACKGROUND_TESTS


def start_background_jobs(selected: list[str]) -> None:
    wanted = {NEEDS[name.split("[")[0]] for name in selected if name.split("[")[0] in NEEDS}
    for key, job in JOBS.items():  # in this order: the longest first
        if key in wanted:
            submit(key, job)


# ------------------------------------------------------------------------------------ signals, the rows
def test_sigint_stops_at_a_step_and_keeps_the_earlier_result(drill):
    row = drill(
        "Ctrl-C (SIGINT) in a recipe",
        "exit 130; one line 'interrupted at step N of M'; interrupted JSON beside the intact ok one",
    )
    job = result("faults:sigint")
    proc, results = job["proc"], job["results"]
    row.saw(proc)
    assert proc.returncode == 130, describe(proc)
    line = one_line(proc, "01_baseline.py: interrupted at step ")
    step, total = map(int, re.search(r"at step (\d+) of (\d+)", line).groups())
    assert "(SIGINT)" in line and "no checkpoint was saved" in line, line
    assert "[stop] SIGINT: stopping at the next optimizer-step boundary" in proc.stdout, describe(proc)
    assert_intact(job["before"])  # the earlier successful result, byte for byte
    beside = results / "01_baseline.interrupted.json"
    payload = json.loads(beside.read_text())
    assert payload["status"] == "interrupted" and payload["error"] == f"SIGINT at step {step} of {total}"
    assert payload["timing"]["optimizer_steps"] == step >= 1
    assert payload["extra"]["stopped"] == {
        "signal": "SIGINT",
        "step": step,
        "planned_steps": total,
        "checkpoint": None,
        "during": "training",
    }
    assert payload["loss"]["last"] is not None, "the measurements so far are recorded"
    assert sorted(p.name for p in results.iterdir()) == ["01_baseline.interrupted.json", "01_baseline.json"]


def test_a_second_run_of_a_rung_refuses_at_start(drill):
    row = drill(
        "two runs of one rung into one results directory",
        "the second exits 2 at its start with one line naming the first's pid; the first's results kept",
    )
    job = result("faults:sigint")
    second = job["second"]
    assert second is not None, "the first run never started training" + describe(job["proc"])
    row.saw(second)
    assert second.returncode == 2, describe(second)
    line = one_line(second, "01_baseline.py: error: another run of 01_baseline")
    assert f"(pid {job['pid']})" in line and "--tag" in line, line
    assert "[estimate]" not in second.stdout, "refused before the model was built"
    assert job["proc"].returncode == 130 and (job["results"] / "01_baseline.interrupted.json").exists()


def test_sigterm_to_one_rank_stops_every_rank_at_the_same_step(drill):
    row = drill(
        "SIGTERM (preemption) to rank 0 of 08_fsdp2 on 2 gloo processes, --checkpoint-on-stop",
        "exit 143; every rank stops after the same step; sharded checkpoint of both ranks; one line",
    )
    job = result("faults:fsdp2")
    proc, ckpt = job["proc"], job["ckpt"]
    row.saw(proc)
    assert proc.returncode == 143, describe(proc)
    line = one_line(proc, "08_fsdp2.py: interrupted at step ", launcher_noise=True)
    step = int(re.search(r"at step (\d+)", line).group(1))
    folder = ckpt / checkpoints.file_name(step)
    assert f"(SIGTERM); checkpoint {folder}; resume with: python recipes/08_fsdp2.py " in line, line
    assert line.endswith("--resume auto"), line
    payload = json.loads((job["results"] / "08_fsdp2.json").read_text())
    assert payload["status"] == "interrupted" and payload["provenance"]["world_size"] == 2
    assert payload["timing"]["optimizer_steps"] == step
    # Rank 1 got no signal: it stopped because the ranks agreed, took part in the gather ...
    assert [r["rank"] for r in payload["memory"]["phases"]["train"]["per_rank"]] == [0, 1]
    # ... and wrote its shard of the checkpoint at the same step.
    assert sorted(p.name for p in ckpt.iterdir()) == [folder.name], "atomic: no .partial left"
    names = sorted(p.name for p in folder.iterdir())
    assert {".metadata", "meta.pt"} <= set(names) and len([n for n in names if n.endswith(".distcp")]) == 2
    assert checkpoints.problem(str(folder)) is None


def test_sigusr1_checkpoints_and_exits_138(drill):
    row = drill(
        "SIGUSR1 (SLURM's warning before the time limit) with --checkpoint-every 2",
        "exit 138; checkpoint at the stop step; one line with the resume command",
    )
    job = result("faults:usr1")
    proc = job["stopped"]
    row.saw(proc)
    assert proc.returncode == 138, describe(proc)
    line = one_line(proc, "01_baseline.py: interrupted at step ")
    step = job["step"]
    assert f"at step {step} of " in line and "(SIGUSR1)" in line
    newest = job["ckpt"] / checkpoints.file_name(step)
    assert f"checkpoint {newest}; resume with: python recipes/01_baseline.py " in line, line
    assert "--resume auto" in line and "--checkpoint-every 2" in line, "the resume command keeps the flags"


def test_checkpoints_are_pruned_to_the_newest(drill):
    row = drill("checkpoints pile up (--keep-checkpoints, default 2)", "only the newest 2 step-*.ckpt stay")
    job = result("faults:usr1")
    row.observed(f"left: {', '.join(job['listing'])}")
    assert job["stopped"].returncode == 138, describe(job["stopped"])
    assert len(job["listing"]) == 2, job["listing"]
    assert (
        job["listing"][-1] == checkpoints.file_name(job["step"]) and "step-000002.ckpt" not in job["listing"]
    )


def test_a_resumed_run_says_where_it_resumed(drill):
    row = drill(
        "a successful resume (--resume auto)", "one line '[resume] resuming at step N'; counts the whole run"
    )
    job = _usr1_resumed()
    assert "resumed" in job, describe(job["stopped"])
    proc, step = job["resumed"], job["step"]
    said = [ln for ln in proc.stdout.splitlines() if ln.startswith("[resume]")]
    row.observed(f"exit {proc.returncode}; {' | '.join(said)}")
    assert proc.returncode == 0, describe(proc)
    assert said == [
        f"[resume] resuming at step {step} of {step + 2} from {job['ckpt'] / checkpoints.file_name(step)}"
    ]
    payload = json.loads((job["results"] / "01_baseline.json").read_text())
    assert payload["status"] == "ok" and payload["timing"]["optimizer_steps"] == step + 2
    assert payload["extra"]["resumed_from"]["step"] == step
    assert_intact(job["before"])  # resuming reads the checkpoints, it does not change them


def test_truncated_newest_checkpoint_falls_back_to_the_intact_one(drill):
    row = drill(
        "newest checkpoint truncated, --resume auto",
        "a line skipping it; resumes from the newest intact one; checkpoints untouched",
    )
    job = _usr1_resumed()
    assert "fallback" in job, describe(job["stopped"])
    proc = job["fallback"]
    said = [ln for ln in proc.stdout.splitlines() if ln.startswith("[resume]")]
    row.observed(f"exit {proc.returncode}; {' | '.join(said)}")
    assert proc.returncode == 0, describe(proc)
    assert said[0].startswith(f"[resume] skipping {job['truncated']}: truncated"), said
    older = int(re.search(r"resuming at step (\d+)", said[1]).group(1))
    assert older < job["step"] and len(said) == 2, said
    assert "Traceback" not in proc.stderr
    payload = json.loads((job["fallback_results"] / "01_baseline.json").read_text())
    assert payload["status"] == "ok" and payload["extra"]["resumed_from"]["step"] == older
    assert_intact(job["copy_before"])


def test_a_second_ctrl_c_exits_at_once(drill):
    row = drill(
        "Ctrl-C twice", "exit 130 at once (inside the step), one line; nothing written; earlier result intact"
    )
    job = result("faults:twice")
    proc = job["proc"]
    row.observed(
        f"exit {proc.returncode} {job['seconds']:.1f} s after the second; {' | '.join(message_lines(proc.stderr))}"
    )
    assert job["acknowledged"], describe(proc)
    assert proc.returncode == 130, describe(proc)
    one_line(proc, "01_baseline.py: interrupted again: exiting at once")
    assert job["seconds"] < 30, "it did not wait for a step to end"  # generous: a loaded CI machine
    assert "== 01_baseline" not in proc.stdout, "no results summary: nothing was written"
    assert_intact(job["before"])
    assert sorted(p.name for p in job["results"].iterdir() if not p.name.startswith(".")) == [
        "01_baseline.json"
    ]


def test_run_all_ctrl_c_prints_the_summary_and_renders_the_report(drill):
    row = drill(
        "Ctrl-C in ./run_all.sh",
        "exit 130; summary of finished rungs; report rendered from what exists; later rungs not started",
    )
    job = result("faults:run_all")
    proc, results = job["proc"], job["results"]
    summary = proc.stdout[proc.stdout.find("Summary (cpu path") :]
    row.observed(f"exit {proc.returncode}; " + " | ".join(ln.strip() for ln in summary.splitlines()[1:]))
    assert proc.returncode == 130, describe(proc)
    assert re.search(r"01_baseline +ok", summary) and re.search(
        r"04_lower_batch_size +interrupted \(exit 130\)", summary
    )
    assert "stopped before: 05_gradient_accumulation" in summary, summary
    assert "Traceback" not in proc.stderr, describe(proc)
    assert [ln for ln in message_lines(proc.stderr) if "interrupted" in ln][0].startswith(
        "04_lower_batch_size.py: interrupted at step "
    )
    assert json.loads((results / "04_lower_batch_size.json").read_text())["status"] == "interrupted"
    readme = (results / "README.md").read_text()
    assert "| 01_baseline | ok |" in readme and "| 04_lower_batch_size | interrupted |" in readme
    assert not (results / "05_gradient_accumulation.json").exists()


# ---------------------------------------------------------------------------------- refused at start
def test_garbage_resume_file_is_one_line(drill):
    row = drill("garbage file given to --resume", "exit 2; one line naming the file; no weights_only advice")
    job = _quick_refusals()
    proc = job["garbage"]
    row.saw(proc)
    assert proc.returncode == 2, describe(proc)
    line = one_line(
        proc, f"01_baseline.py: error: --resume {job['garbage_file']}: truncated, or not a checkpoint"
    )
    assert "weights_only" not in proc.stderr + proc.stdout, line
    assert_intact(job["before"])


def test_unwritable_results_dir_is_refused_before_training(drill):
    row = drill("--results-dir unwritable", "exit 2 before the model is built; one line naming the folder")
    job = _quick_refusals()
    proc = job["unwritable"]
    row.saw(proc)
    assert proc.returncode == 2, describe(proc)
    one_line(
        proc,
        f"01_baseline.py: error: --results-dir {job['blocker'] / 'results'}: {job['blocker']} is a file, not a folder",
    )
    assert "[estimate]" not in proc.stdout and "%|" not in proc.stderr, "nothing was built or trained"
    assert job["blocker"].read_text() == "not a folder\n"


def test_truncated_cifar_batch_file_is_one_line_naming_it(drill):
    row = drill(
        "corrupt or truncated extracted CIFAR-10 batch file",
        "exit 2; one line naming the file; earlier results untouched (no error JSON over them)",
    )
    job = _quick_refusals()
    proc = job["corrupt"]
    row.saw(proc)
    assert proc.returncode == 2, describe(proc)
    one_line(proc, f"01_baseline.py: error: {job['batch']}: not a readable CIFAR-10 batch file (")
    assert_intact(job["before"])
    assert not list(Path(next(iter(job["before"]))).parent.glob("01_baseline.*.json")), "no error JSON either"


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is present: the recipe would run on it")
def test_full_size_recipe_without_gpu_refuses_with_a_working_cpu_command(drill):
    row = drill(
        "full-size recipe started on a machine without a GPU",
        "exit 2; one line with a CPU command; that command runs (exit 0)",
    )
    job = _no_gpu()
    proc, ran = job["refused"], job["ran"]
    row.observed(
        f"exit {proc.returncode}, then the suggested command: exit {ran.returncode if ran else None}"
    )
    assert proc.returncode == 2, describe(proc)
    line = one_line(proc, "05_gradient_accumulation.py: error: no CUDA GPU found: ")
    assert "vit_l_16" in line and "--accelerator cpu" in line and "--model vit_tiny" in line, line
    assert not (job["tmp"] / "refused").exists(), "refused before anything was written"
    assert ran is not None and ran.returncode == 0, describe(ran) if ran else line
    assert (
        json.loads((job["tmp"] / "results" / "05_gradient_accumulation.json").read_text())["status"] == "ok"
    )


@pytest.mark.parametrize("name", [p.stem for p in sorted(RECIPES_DIR.glob("[0-9][0-9]_*.py"))])
def test_every_rung_suggests_flags_that_a_cpu_accepts(name, monkeypatch):
    """The suggested flags pass the recipe's own validation on a CPU (rung 02's fp16 becomes bf16-mixed;
    the FSDP1 rungs point at 08_fsdp2), and the CPU rungs' are really run above (rung 05) and by
    test_recipes (the same flags)."""
    no_gpu = Hardware(cuda_devices=0, cpu_cores=os.cpu_count() or 1)
    line = faults.wrong_machine(load_recipe_module(name).RUNG)
    command = re.search(r"python recipes/(\w+)\.py (.*?)(?: \(|$)", line)
    target, flags = command.group(1), command.group(2).split()
    parsed = cli.parse(load_recipe_module(target).RUNG, flags, hardware=no_gpu)
    assert parsed.accelerator == "cpu" and parsed.model == "vit_tiny"
    assert parsed.precision != "16-mixed"


def test_explicit_accelerator_cpu_runs_a_full_size_model():
    no_gpu = Hardware(cuda_devices=0, cpu_cores=os.cpu_count() or 1)
    cfg = cli.parse(load_recipe_module("01_baseline").RUNG, ["--accelerator", "cpu"], hardware=no_gpu)
    assert cfg.model == "vit_l_16" and cfg.accelerator == "cpu"


# ----------------------------------------------------------------------------------- the CIFAR archive
def _archive(tmp_path: Path) -> tuple[Path, Path]:
    """A small cifar-10-python.tar.gz (the real layout) in a data folder, and the folder it came from."""
    source = tmp_path / "source"
    write_cifar(source)
    data_dir = tmp_path / "data"
    data_dir.mkdir()
    with tarfile.open(data_dir / data.CIFAR_ARCHIVE, "w:gz") as tar:
        tar.add(source / data.CIFAR_FOLDER, arcname=data.CIFAR_FOLDER)
    return data_dir, source


def test_archive_placed_by_hand_is_verified_and_extracted(tmp_path, monkeypatch, drill):
    row = drill(
        "valid cifar-10-python.tar.gz placed in --data-dir offline",
        "MD5 checked, extracted, trained on (exit 0)",
    )
    monkeypatch.setenv("FMR_OFFLINE", "1")
    data_dir, source = _archive(tmp_path)
    md5 = hashlib.md5((data_dir / data.CIFAR_ARCHIVE).read_bytes()).hexdigest()
    monkeypatch.setattr(data, "CIFAR_MD5", md5)  # the test's archive stands in for the published one
    results = tmp_path / "results"
    argv = [*QUICK, "--data", "cifar10", "--data-dir", str(data_dir), "--batch-size", "8", "--max-steps", "2"]
    proc, payload = run_recipe_inprocess("01_baseline", argv, results)
    assert payload is not None, describe(proc)
    row.observed(f"exit {proc.returncode}; data_source {payload['provenance']['data_source']}")
    assert (
        proc.returncode == 0
        and payload["status"] == "ok"
        and payload["provenance"]["data_source"] == "cifar10"
    )
    for name in (*data.CIFAR_TRAIN_FILES[:2], data.CIFAR_TEST_FILE):
        extracted = data_dir / data.CIFAR_FOLDER / name
        assert extracted.read_bytes() == (source / data.CIFAR_FOLDER / name).read_bytes()
    assert sorted(p.name for p in data_dir.iterdir()) == [data.CIFAR_FOLDER, data.CIFAR_ARCHIVE], (
        "no scratch left"
    )


def test_archive_with_the_wrong_md5_is_one_line(tmp_path, monkeypatch, drill):
    row = drill(
        "cifar-10-python.tar.gz that is not the published archive", "exit 2; one line naming it and the MD5"
    )
    monkeypatch.setenv("FMR_OFFLINE", "1")
    data_dir, _ = _archive(tmp_path)  # its MD5 is not the published c58f30108f718f92721af3b95e74349a
    results = tmp_path / "results"
    before = snapshot(earlier_result(results, "01_baseline").parent)
    proc, _ = run_recipe_inprocess(
        "01_baseline", [*QUICK, "--data", "cifar10", "--data-dir", str(data_dir)], results
    )
    err = message_lines(proc.stderr)
    row.observed(f"exit {proc.returncode}; {' | '.join(err)}")
    assert proc.returncode == 2 and len(err) == 1 and err[0].startswith("01_baseline.py: error: "), err
    assert (
        str(data_dir / data.CIFAR_ARCHIVE) in err[0]
        and "is not the published c58f30108f718f92721af3b95e74349a" in err[0]
    )
    assert not (data_dir / data.CIFAR_FOLDER).exists()
    assert_intact(before)


def test_a_damaged_archive_is_one_line(tmp_path, monkeypatch):
    data_dir, _ = _archive(tmp_path)
    archive = data_dir / data.CIFAR_ARCHIVE
    archive.write_bytes(archive.read_bytes()[:300])
    monkeypatch.setattr(data, "CIFAR_MD5", hashlib.md5(archive.read_bytes()).hexdigest())
    with pytest.raises(faults.BadInput, match=f"{re.escape(str(archive))}: cannot be extracted"):
        data.load("cifar10", str(data_dir))
    assert not (data_dir / data.CIFAR_FOLDER).exists()
    assert sorted(p.name for p in data_dir.iterdir()) == [data.CIFAR_ARCHIVE], "no scratch left"


@pytest.mark.parametrize("damage", ["truncated", "garbage", "wrong keys", "empty"])
def test_a_damaged_batch_file_names_itself(tmp_path, damage):
    write_cifar(tmp_path)
    path = tmp_path / data.CIFAR_FOLDER / "data_batch_2"
    content = {
        "truncated": path.read_bytes()[:1000],
        "garbage": os.urandom(500),
        "empty": b"",
        "wrong keys": __import__("pickle").dumps({b"pixels": [1, 2]}),
    }[damage]
    path.write_bytes(content)
    with pytest.raises(faults.BadInput, match=f"^{re.escape(str(path))}: not a readable CIFAR-10 batch file"):
        data.read_cifar10(str(tmp_path))


# ------------------------------------------------------------------------------------------ checkpoints
def _fabric():
    import lightning as L

    return L.Fabric(accelerator="cpu", devices=1)


def test_a_save_killed_midway_never_leaves_a_truncated_newest_checkpoint(tmp_path, monkeypatch):
    fabric = _fabric()
    model = torch.nn.Linear(3, 2)
    checkpoints.save(fabric, str(tmp_path), 2, {"model": model, "step": 2})
    intact = snapshot(tmp_path)

    def killed(path, state, filter=None):
        Path(path).write_bytes(b"PK\x03\x04 half a checkpoint")
        raise KeyboardInterrupt  # the process dies here

    monkeypatch.setattr(fabric, "save", killed)
    with pytest.raises(KeyboardInterrupt):
        checkpoints.save(fabric, str(tmp_path), 4, {"model": model, "step": 4})
    assert checkpoints.latest(str(tmp_path)).endswith("step-000002.ckpt")
    assert checkpoints.latest_intact(str(tmp_path)).endswith("step-000002.ckpt")
    assert_intact(intact)
    monkeypatch.undo()
    checkpoints.save(fabric, str(tmp_path), 6, {"model": model, "step": 6})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-000002.ckpt", "step-000006.ckpt"], (
        "partial removed"
    )


def test_prune_keeps_the_newest(tmp_path):
    fabric = _fabric()
    for step in (1, 2, 3, 4):
        checkpoints.save(fabric, str(tmp_path), step, {"model": torch.nn.Linear(2, 2)}, keep=3)
    assert [s for s, _ in checkpoints.listing(str(tmp_path))] == [2, 3, 4]
    checkpoints.save(fabric, str(tmp_path), 5, {"model": torch.nn.Linear(2, 2)}, keep=0)  # 0 keeps all
    assert [s for s, _ in checkpoints.listing(str(tmp_path))] == [2, 3, 4, 5]


def test_problem_names_what_is_wrong(tmp_path):
    import zipfile

    good = tmp_path / "good.ckpt"
    torch.save({"step": 1}, good)
    assert checkpoints.problem(str(good)) is None
    cases = {
        "empty": (b"", "empty file"),
        "truncated": (good.read_bytes()[:-40], "truncated"),
        "text": (b"hello\n", "not a complete zip archive"),
    }
    for name, (content, words) in cases.items():
        (tmp_path / name).write_bytes(content)
        assert words in checkpoints.problem(str(tmp_path / name)), name
    with zipfile.ZipFile(tmp_path / "other.zip", "w") as z:
        z.writestr("readme.txt", "hi")
    assert "no data.pkl" in checkpoints.problem(str(tmp_path / "other.zip"))
    (tmp_path / "folder.ckpt").mkdir()
    assert "incomplete sharded checkpoint" in checkpoints.problem(str(tmp_path / "folder.ckpt"))
    assert checkpoints.problem(str(tmp_path / "missing")) == (
        f"no such file; {tmp_path} holds folder.ckpt, good.ckpt"  # what its folder holds instead
    )
    assert (
        checkpoints.problem(str(tmp_path / "no" / "x.ckpt"))
        == f"no such file; {tmp_path / 'no'}: no such folder"
    )
    (tmp_path / "run").mkdir()
    torch.save({"step": 2}, tmp_path / "run" / "step-000002.ckpt")
    assert checkpoints.problem(str(tmp_path / "run")) == (
        f"a folder of checkpoints, not one (newest step-000002.ckpt): pass a file, or --resume auto"
        f" --checkpoint-dir {tmp_path / 'run'}"
    )


def test_a_checkpoint_of_another_model_is_one_line(tmp_path):
    fabric = _fabric()
    path = checkpoints.save(fabric, str(tmp_path), 1, {"model": torch.nn.Linear(3, 2), "step": 1})
    with pytest.raises(faults.BadInput, match=r"cannot be loaded into this run \(RuntimeError: Error"):
        checkpoints.load(fabric, path, {"model": torch.nn.Linear(5, 2)})


def test_a_new_run_refuses_to_write_among_an_earlier_runs_checkpoints(tmp_path, capsys):
    torch.save({"step": 4}, tmp_path / "step-000004.ckpt")
    argv = ["--accelerator", "cpu", "--model", "vit_tiny", "--checkpoint-every", "2",
            "--checkpoint-dir", str(tmp_path)]  # fmt: skip
    rung = RunConfig(recipe="01_baseline")
    with pytest.raises(SystemExit) as exc:
        lifecycle.resolve_checkpoints(cli.parse(rung, argv))
    assert exc.value.code == 2
    assert "holds an earlier run's checkpoints (newest step-000004.ckpt)" in capsys.readouterr().err
    cfg = lifecycle.resolve_checkpoints(cli.parse(rung, [*argv, "--resume", "auto"]))  # continuing it is fine
    assert cfg.resume == str(tmp_path / "step-000004.ckpt") and cfg.checkpoint_on_stop is True


def test_resume_auto_with_only_an_unusable_checkpoint_starts_over_as_it_says(tmp_path, capsys):
    """It printed "no usable checkpoint ... starting from the beginning", then exited 2 telling the user
    to pass --resume auto, which they had."""
    (tmp_path / "step-000004.ckpt").write_bytes(b"PK\x03\x04 truncated")
    argv = [
        "--accelerator",
        "cpu",
        "--model",
        "vit_tiny",
        "--checkpoint-dir",
        str(tmp_path),
        "--resume",
        "auto",
    ]
    cfg = lifecycle.resolve_checkpoints(cli.parse(RunConfig(recipe="01_baseline"), argv))
    out = capsys.readouterr()
    assert cfg.resume is None and cfg.checkpoint_on_stop is True and "error" not in out.err, out.err
    assert "no usable checkpoint" in out.out and "starting from the beginning" in out.out, out.out
    assert (tmp_path / "step-000004.ckpt").exists(), "the unusable file is left for the user to look at"


# ---------------------------------------------------------------------------------- stop in the loop
def _train(fabric, tmp_path, stop_at: int | None, **kwargs):
    from torch.utils.data import DataLoader, TensorDataset

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(12, 10))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = fabric.setup(model, optimizer)
    ds = TensorDataset(torch.randn(40, 12), torch.randint(0, 10, (40,)))
    train = fabric.setup_dataloaders(DataLoader(ds, batch_size=4, shuffle=True, drop_last=True))
    log = RunResults(RunConfig(recipe="t", batch_size=4))
    log.attach(fabric)
    original = log.step_done

    def step_done():
        original()
        if log.optimizer_steps == stop_at:
            faults.request_stop(signal.SIGTERM)  # what the handler does when the signal arrives

    log.step_done = step_done

    def batch_fn(m, batch):
        x, y = batch
        logits = m(x)
        return torch.nn.functional.cross_entropy(logits, y), logits, y

    try:
        cfg = RunConfig(recipe="t", batch_size=4, epochs=3, checkpoint_dir=str(tmp_path), **kwargs)
        loop.fit(fabric, model, optimizer, train, batch_fn, cfg, log)
    finally:
        faults.request_stop(None)
    return log


@pytest.mark.parametrize("on_stop", [True, False])
def test_fit_stops_at_the_step_boundary(tmp_path, on_stop):
    fabric = _fabric()
    with pytest.raises(faults.Interrupted) as exc:
        _train(fabric, tmp_path, stop_at=4, checkpoint_on_stop=on_stop)
    stop = exc.value
    assert (stop.signum, stop.step, stop.total, stop.exit_code) == (signal.SIGTERM, 4, 30, 143)
    if on_stop:
        assert stop.checkpoint == str(tmp_path / "step-000004.ckpt")
        assert torch.load(stop.checkpoint, weights_only=False)["step"] == 4
    else:
        assert stop.checkpoint is None and not any(tmp_path.iterdir())


def test_a_stop_during_set_up_stops_before_the_first_step(tmp_path):
    faults.request_stop(signal.SIGINT)  # a signal while the data and the model were being built
    with pytest.raises(faults.Interrupted) as exc:
        _train(_fabric(), tmp_path, stop_at=None, checkpoint_on_stop=True)
    assert (exc.value.step, exc.value.total, exc.value.checkpoint) == (0, 30, None)
    assert not any(tmp_path.iterdir()), "nothing trained, nothing to save"


def test_a_stop_at_the_last_step_completes_the_run(tmp_path):
    log = _train(_fabric(), tmp_path, stop_at=30, checkpoint_on_stop=True)
    assert log.optimizer_steps == 30 and not any(tmp_path.iterdir())


def test_sighup_stops_a_run_at_the_step_boundary_like_sigterm(tmp_path):
    """A closed terminal (SIGHUP) killed a recipe with no line and no results JSON: now it is a stop
    request like SIGTERM's, acted on at the next step, exit 129. A real signal, sent to this process
    only once the run's handler holds it."""
    fabric = _fabric()
    # as a terminal starts a run: SIGHUP not ignored (a suite started under nohup ignores it, and the run
    # then rightly leaves it ignored: test_sighup_ignored_at_the_start_stays_ignored)
    before = signal.signal(signal.SIGHUP, signal.SIG_DFL)
    try:
        with faults.handling_signals():
            assert signal.getsignal(signal.SIGHUP) is faults._handle  # else the signal below ends pytest
            original = faults.request_stop
            try:  # _train requests SIGTERM at step 4; the real SIGHUP must be the request instead
                faults.request_stop = lambda signum: (
                    signal.raise_signal(signal.SIGHUP) if signum else original(None)
                )
                with pytest.raises(faults.Interrupted) as exc:
                    _train(fabric, tmp_path, stop_at=4, checkpoint_on_stop=False)
            finally:
                faults.request_stop = original
    finally:
        signal.signal(signal.SIGHUP, before)
    assert (exc.value.signum, exc.value.step, exc.value.exit_code) == (signal.SIGHUP, 4, 129)


def test_sighup_ignored_at_the_start_stays_ignored():
    """Under nohup a run goes on when the terminal closes."""
    before = signal.signal(signal.SIGHUP, signal.SIG_IGN)
    try:
        with faults.handling_signals():
            assert signal.getsignal(signal.SIGHUP) == signal.SIG_IGN
            assert signal.getsignal(signal.SIGTERM) is faults._handle
    finally:
        signal.signal(signal.SIGHUP, before)


def test_after_a_hangup_the_terminal_outputs_go_to_dev_null(tmp_path):
    """A closed terminal makes every write fail (EIO): the stop that follows must not fail with it."""
    from fabric_memory_recipes import console

    master, terminal = os.openpty()
    plain = os.open(tmp_path / "log", os.O_WRONLY | os.O_CREAT)
    try:
        console.detach_from_terminal((terminal, plain))
        null = os.stat(os.devnull)
        assert os.path.samestat(os.fstat(terminal), null) and not os.isatty(terminal)
        assert not os.path.samestat(os.fstat(plain), null), "a file or pipe is kept"
    finally:
        for fd in (master, terminal, plain):
            os.close(fd)


def test_interrupted_lines():
    stop = faults.Interrupted(signal.SIGUSR1, 7, 100, "ck/step-000007.ckpt")
    line = faults.interrupted_line(stop, ["recipes/05_x.py", "--max-steps", "100", "--resume", "ck/a.ckpt"])
    assert line.endswith(
        "interrupted at step 7 of 100 (SIGUSR1); checkpoint ck/step-000007.ckpt;"
        " resume with: python recipes/05_x.py --max-steps 100 --resume auto"
    )
    assert stop.exit_code == 138 and stop.record()["signal"] == "SIGUSR1"
    none = faults.interrupted_line(faults.Interrupted(signal.SIGINT, 0, 100, None), ["x.py"])
    assert "interrupted before the first of 100 steps (SIGINT); nothing to resume" in none


# -------------------------------------------------------------------------------- results beside results
@pytest.mark.parametrize(
    ("existing", "status", "expected"),
    [
        (None, "interrupted", "r.json"),
        ("ok", "ok", "r.json"),
        ("ok", "interrupted", "r.interrupted.json"),
        ("ok", "oom", "r.oom.json"),
        ("error", "interrupted", "r.json"),  # an unsuccessful result may be replaced
        ("not json", "error", "r.error.json"),  # a file that is not a results JSON is kept
    ],
)
def test_an_unsuccessful_run_never_replaces_a_successful_one(tmp_path, existing, status, expected):
    path = tmp_path / "r.json"
    if existing == "not json":
        path.write_text("{ half")
    elif existing:
        path.write_text(json.dumps({"schema_version": 1, "status": existing}))
    assert faults.results_file(str(path), status) == str(tmp_path / expected)


def test_the_report_shows_both(tmp_path):
    (tmp_path / "01_baseline.json").write_text(json.dumps(make_result("01_baseline")))
    stopped = make_result("01_baseline", status="interrupted")
    (tmp_path / "01_baseline.interrupted.json").write_text(json.dumps(stopped))
    assert render.main([str(tmp_path)]) == 0
    rows = [
        ln for ln in (tmp_path / "README.md").read_text().splitlines() if ln.startswith("| 01_baseline |")
    ]
    assert [r.split("|")[2].strip() for r in rows] == ["ok", "interrupted"]


def test_the_run_lock_admits_one_run(tmp_path):
    first = faults.RunLock(str(tmp_path), "01_baseline").acquire()
    with pytest.raises(faults.BadInput, match=rf"another run of 01_baseline \(pid {os.getpid()}\)"):
        faults.RunLock(str(tmp_path), "01_baseline").acquire()
    faults.RunLock(str(tmp_path), "01_baseline-tagged").acquire().release()  # another tag is another rung
    first.release()
    assert not any(tmp_path.iterdir()), "the lock file goes with the run"
    faults.RunLock(str(tmp_path), "01_baseline").acquire().release()


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only folders")
def test_a_read_only_results_dir_is_refused(tmp_path):
    tmp_path.chmod(0o555)
    try:
        with pytest.raises(faults.BadInput, match="cannot write there"):
            faults.check_writable(str(tmp_path / "results"), "--results-dir")
    finally:
        tmp_path.chmod(0o755)


# ----------------------------------------------------------------------------------------- multi-node
def _fsdp2(tmp: Path, name: str, launch: list[str], devices: int, nodes: int, batch: int) -> dict:
    """08_fsdp2 on the tiny CIFAR (3 steps an epoch at 32 images a step): 4 steps, a checkpoint after
    step 3 (parameters and Adam state)."""
    out = tmp / name
    recipe = [str(RECIPES_DIR / "08_fsdp2.py"), *QUICK, "--data", "cifar10", "--data-dir", str(tmp / "data"),
              "--devices", str(devices), "--num-nodes", str(nodes), "--batch-size", str(batch),
              "--epochs", "2", "--max-steps", "4", "--checkpoint-every", "3", "--checkpoint-dir", str(out / "ckpt"),
              "--results-dir", str(out / "results")]  # fmt: skip
    env = subprocess_env(out / "logs")
    procs = [
        subprocess.Popen(
            [sys.executable, *prefix, *recipe],
            cwd=REPO,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        for prefix in launch
    ]
    logs = []
    try:
        for proc in procs:
            logs.append(proc.communicate(timeout=TIMEOUT)[0])
    finally:
        for proc in procs:
            try:
                os.killpg(proc.pid, signal.SIGKILL)  # what each launch left behind
            except (ProcessLookupError, PermissionError):
                pass
    return dict(codes=[p.returncode for p in procs], logs=logs, out=out)


def _parameters(folder: Path) -> dict[str, torch.Tensor]:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    target = folder.parent / (folder.name + ".pt")
    dcp_to_torch_save(str(folder), str(target))
    state = torch.load(target, weights_only=False)
    return {k: v for k, v in state["model"].items()}


@pytest.mark.skipif(not MULTINODE, reason="two torchrun launches, ~1 min on 2 cores: FMR_TEST_MULTINODE=1")
def test_two_nodes_on_localhost_match_one_node(tmp_path, drill):
    """--num-nodes 2: two torchrun launches acting as two nodes on localhost (gloo), 2 processes each.

    Compared: the parameters after step 3 (the step-3 checkpoint, gathered from its shards) and the
    optimizer steps and images seen. Not the logged loss: it is rank 0's own micro-batch, and rank 0
    holds other samples in another world size. The reference is one node with 4 processes where the
    machine has 4 cores; with fewer, the recipes refuse 4 processes on one node (--devices may not
    exceed the cores), and the reference is one node with 2 processes at twice the batch per process.
    Both see the same samples at every step: DistributedSampler gives step j the samples
    perm[W*B*j : W*B*(j+1)] over all ranks, for any world size W with per-process batch B, and the
    gradient is their mean either way. What may differ is the order of the floating-point sums."""
    row = drill(
        "--num-nodes 2: two torchrun launches on localhost, 2 processes each",
        "world size 4; parameters after step 3 equal one node's within float tolerance",
    )
    write_cifar(tmp_path / "data", n_train_files=2, per_batch=60)
    port = free_port()
    torchrun = ["-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "2",
                "--master-addr", "127.0.0.1", "--master-port", str(port)]  # fmt: skip
    two = _fsdp2(tmp_path, "two-nodes", [[*torchrun, "--node-rank", str(r)] for r in (0, 1)], 2, 2, 8)
    if (os.cpu_count() or 1) >= 4:
        one = _fsdp2(tmp_path, "one-node", [[]], 4, 1, 8)
    else:
        one = _fsdp2(tmp_path, "one-node", [[]], 2, 1, 16)
    assert two["codes"] == [0, 0], "\n".join(two["logs"])[-6000:]
    assert one["codes"] == [0], one["logs"][0][-6000:]
    multi = json.loads((two["out"] / "results" / "08_fsdp2.json").read_text())
    single = json.loads((one["out"] / "results" / "08_fsdp2.json").read_text())
    a = _parameters(two["out"] / "ckpt" / "step-000003.ckpt")
    b = _parameters(one["out"] / "ckpt" / "step-000003.ckpt")
    compared = {}
    for key in a:
        x, y = a[key], b[key]
        if key.endswith(("self_attention.in_proj_bias", "self_attention.qkv.bias")):
            # The key bias (the middle third) adds the same q.b_k to every score of a query: softmax
            # ignores it and its true gradient is 0. Adam divides the rounding noise left there by its
            # own square root and moves it by up to lr a step, so it is compared with that bound only.
            third = len(x) // 3
            assert (x[third : 2 * third] - y[third : 2 * third]).abs().max() <= 3 * 1e-3, key
            x, y = torch.cat([x[:third], x[2 * third :]]), torch.cat([y[:third], y[2 * third :]])
        compared[key] = (x, y)
    worst = max((x - y).abs().max().item() for x, y in compared.values())
    row.observed(
        f"world size {multi['provenance']['world_size']}, nodes {multi['provenance']['num_nodes']};"
        f" parameters after step 3 differ by at most {worst:.1e}"
    )
    assert (
        multi["status"] == "ok"
        and multi["provenance"]["world_size"] == 4
        and multi["provenance"]["num_nodes"] == 2
    )
    assert multi["timing"]["optimizer_steps"] == single["timing"]["optimizer_steps"] == 4
    assert multi["timing"]["images_seen"] == single["timing"]["images_seen"] == 4 * 32
    assert sorted(a) == sorted(b)
    for key, (x, y) in compared.items():
        torch.testing.assert_close(x, y, rtol=1e-4, atol=1e-5, msg=key)


def test_the_slurm_script_parses():
    """docs/slurm_requeue.sbatch: valid shell, and the recipe accepts the flags it passes (as on a node
    with 4 GPUs: SLURM is not here, so its real run is not tested)."""
    script = REPO / "docs" / "slurm_requeue.sbatch"
    assert subprocess.run(["bash", "-n", str(script)], capture_output=True).returncode == 0
    text = script.read_text()
    command = re.search(r"srun python recipes/(\w+)\.py (.*?)\n(?!\s)", text.replace("\\\n", " "))
    flags = command.group(2).replace('"$CKPT"', "checkpoints/x").split()
    gpus = Hardware(cuda_devices=4, cpu_cores=os.cpu_count() or 1)
    cfg = cli.parse(load_recipe_module(command.group(1)).RUNG, flags, hardware=gpus)
    assert (cfg.devices, cfg.num_nodes, cfg.resume, cfg.accelerator) == (4, 2, "auto", "cuda")
    assert "--signal=USR1@" in text and "scontrol requeue" in text and "138|143)" in text


# ------------------------------------------------------------------------------- Ctrl-C during start-up
def test_every_recipe_imports_the_package_first():
    """The one-line Ctrl-C (fabric_memory_recipes/__init__.py) is installed by importing the package: a
    recipe must do that before torch and Lightning, which take most of a CPU rung's seconds."""
    import ast

    late = []
    for path in sorted(RECIPES_DIR.glob("*.py")):
        first = next(
            n for n in ast.parse(path.read_text()).body if isinstance(n, (ast.Import, ast.ImportFrom))
        )
        names = [a.name for a in first.names] if isinstance(first, ast.Import) else [first.module]
        if not all(n.split(".")[0] == "fabric_memory_recipes" for n in names):
            late.append(path.name)
    assert not late, late


def test_ctrl_c_while_a_recipe_imports_is_one_line_and_exit_130(tmp_path):
    """It printed a 68-85 line traceback. A fresh interpreter spends seconds importing torch and
    Lightning: a SIGINT 0.8 s after the start lands there (a fresh one: the zygote imported them already)."""
    started = Started([RECIPES_DIR / "01_baseline.py", "--help"], subprocess_env(), tmp_path, fresh=True)
    time.sleep(0.8)
    os.kill(started.pid, signal.SIGINT)
    proc = started.wait(60)
    if proc.returncode == 0:
        pytest.skip("the imports finished within 0.8 s: nothing to interrupt")
    assert proc.returncode == 130, describe(proc)
    assert proc.stderr.strip().splitlines() == ["01_baseline.py: interrupted (Ctrl-C)"], describe(proc)


def python_c(code: str) -> subprocess.CompletedProcess:
    """``python -c code``, started as from a terminal (SIGINT at its default): the Ctrl-C tests' child."""
    argv, terminal = from_a_terminal([sys.executable, "-c", code])
    return subprocess.run(argv, env=subprocess_env(), capture_output=True, text=True, timeout=60, **terminal)


def test_ctrl_c_in_a_tool_is_one_line_and_exit_130():
    code = "import fabric_memory_recipes, os, signal; os.kill(os.getpid(), signal.SIGINT); import time; time.sleep(30)"
    proc = python_c(code)
    assert proc.returncode == 130 and proc.stderr.strip() == "-c: interrupted (Ctrl-C)", describe(proc)


@pytest.mark.parametrize(("sig", "code"), [(signal.SIGTERM, 143), (signal.SIGHUP, 129)])
def test_sigterm_or_sighup_outside_a_run_is_one_line(sig, code):
    """In a recipe's first seconds (importing torch), after its results are written, or in a tool
    (fmr-estimate): the process ended with no line."""
    code_text = f"import fabric_memory_recipes, os, time; os.kill(os.getpid(), {int(sig)}); time.sleep(30)"
    proc = python_c(code_text)
    name = signal.Signals(sig).name
    assert proc.returncode == code and proc.stderr.strip() == f"-c: stopped by {name}", describe(proc)


def test_a_module_run_with_dash_m_is_named_while_its_package_imports(monkeypatch):
    """``python -m fabric_memory_recipes.planning`` stopped while its package imported said "-m: ...":
    Python's sys.argv[0] is "-m" until the module is found."""
    from fabric_memory_recipes import console

    monkeypatch.setattr(sys, "argv", ["-m", "--ladder", "runs/cpu"])
    monkeypatch.setattr(
        sys, "orig_argv", ["python3", "-m", "fabric_memory_recipes.planning", "--ladder", "runs/cpu"]
    )
    assert console.program() == "python -m fabric_memory_recipes.planning"


def test_sigterm_during_evaluation_stops_a_real_process_at_the_next_batch():
    """A SIGTERM sent while a run evaluates is not ignored until SIGKILL (it once was, for 16 minutes).
    A real process: two training steps, then a test split long enough to be mid-evaluation when the signal
    comes; it stops at the next batch, exits 143 and records where it stopped."""
    job = result("faults:sigterm-eval")
    proc = job["proc"]
    assert job["in_test"] and proc.returncode == 143, describe(proc)
    assert job["seconds"] < 60, "it went on evaluating"
    written = [json.loads(p.read_text()) for p in job["results"].glob("01_baseline*.json")]
    stopped = [d for d in written if d["status"] == "interrupted"]
    assert stopped and "evaluation" in stopped[0]["extra"]["stopped"]["during"], written
    test = stopped[0]["extra"]["evaluation"]["test"]
    assert 1 <= test["batches"] < test["of"] and stopped[0]["accuracy"]["test"] is None


CTRL_C_BREAKS_ON_ITS_WAY_OUT = {
    # a Ctrl-C landing inside a half-finished import (numpy's, in a fresh venv) left exit functions that
    # failed with a RecursionError: the traceback came back and the exit code was 1
    "an exit function fails": (
        "import atexit, os, signal, fabric_memory_recipes\n"
        "def broken(): raise RecursionError('maximum recursion depth exceeded')\n"
        "atexit.register(broken); os.kill(os.getpid(), signal.SIGINT); import time; time.sleep(30)"
    ),
    # a Ctrl-C inside numpy's import left it half-initialised, and what came out was a RecursionError, not
    # the KeyboardInterrupt (seen in the suite: 'interrupted' became a 900-frame traceback and exit 1)
    "an import breaks": (
        "import os, signal, fabric_memory_recipes\n"
        "try:\n    os.kill(os.getpid(), signal.SIGINT); import time; time.sleep(30)\n"
        "except KeyboardInterrupt:\n    raise RecursionError('maximum recursion depth exceeded')\n"
    ),
}


@pytest.mark.parametrize("case", sorted(CTRL_C_BREAKS_ON_ITS_WAY_OUT))
def test_a_ctrl_c_that_breaks_something_on_its_way_out_is_still_one_line(case):
    """Their failures are swallowed now: one line, exit 130."""
    proc = python_c(CTRL_C_BREAKS_ON_ITS_WAY_OUT[case])
    assert proc.returncode == 130 and proc.stderr.strip() == "-c: interrupted (Ctrl-C)", describe(proc)


def test_an_error_without_a_ctrl_c_keeps_its_traceback():
    code = "import fabric_memory_recipes\nraise RecursionError('no Ctrl-C: its own traceback')"
    proc = python_c(code)
    assert proc.returncode == 1 and "Traceback" in proc.stderr  # other errors keep their traceback
