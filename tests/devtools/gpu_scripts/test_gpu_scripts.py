"""scripts/gpu/*.sh: every script parses (bash -n), the functions of the preamble they share
(scripts/gpu/common.sh) do what its header says, and a sharded script's dry run lists its runs."""

from __future__ import annotations

import os
import re
import subprocess

import pytest

from tests.conftest import REPO

GPU = REPO / "scripts" / "gpu"
SCRIPTS = sorted(GPU.glob("*.sh"))


def bash(script: str, cwd, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", "-c", script], cwd=cwd, capture_output=True, text=True, timeout=60, env={**os.environ, **env}
    )


@pytest.mark.parametrize("path", SCRIPTS, ids=[p.name for p in SCRIPTS])
def test_every_gpu_script_parses(path):
    assert len(SCRIPTS) > 20 and (GPU / "common.sh") in SCRIPTS
    done = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def test_the_scripts_that_source_the_preamble_define_none_of_its_functions_again():
    functions = (
        "export_run_env",
        "install_wheels",
        "install_checkout",
        "record_machine",
        "mps_on",
        "mps_off",
        "start_clock",
    )
    sourcing = [p for p in SCRIPTS if 'common.sh"' in p.read_text()]
    assert len(sourcing) > 15
    again = [f"{p.name}: {f}" for p in sourcing for f in functions if f"{f}() {{" in p.read_text()]
    assert again == []


def test_install_wheels_puts_site_first_only_when_pip_succeeds(tmp_path):
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "python3").write_text('#!/bin/sh\necho "$@" > "$ARGS"; exit "$PIP_STATUS"\n')
    (fake / "python3").chmod(0o755)
    (tmp_path / ".whl").mkdir()
    (tmp_path / ".whl" / "a-1-py3-none-any.whl").write_text("")
    env = {"PATH": f"{fake}:{os.environ['PATH']}", "ARGS": str(tmp_path / "args"), "PYTHONPATH": "/checkout"}
    run = f'. {GPU}/common.sh; install_wheels; echo "status $? path $PYTHONPATH"'
    done = bash(run, tmp_path, PIP_STATUS="0", **env)
    assert done.stdout.strip() == "status 0 path /tmp/site:/checkout"
    assert "--target /tmp/site .whl/a-1-py3-none-any.whl" in (tmp_path / "args").read_text()
    done = bash(run, tmp_path, PIP_STATUS="1", **env)
    assert done.stdout.strip() == "status 1 path /checkout"


def test_record_machine_and_the_clock(tmp_path):
    out = tmp_path / "out"
    run = (
        f'. {GPU}/common.sh; DEADLINE=100; start_clock part; record_machine "$WORK"; '
        'say hello; echo "left $(left) work $WORK"'
    )
    done = bash(run, REPO, OUT=str(out), TMPDIR=str(tmp_path))
    assert done.returncode == 0, done.stderr
    said, last = done.stdout.strip().splitlines()
    # elapsed seconds, then the wall clock: a slow machine may cross a second between start_clock and say
    assert re.fullmatch(r"\[[01] s \d\d:\d\d:\d\d\] hello", said), said
    left, work = last.split()[1], last.split()[3]
    assert 98 <= int(left) <= 100 and work.endswith("/part")
    assert (out / "progress.log").read_text().endswith("] hello\n")
    head = subprocess.run(
        ["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True
    ).stdout.strip()
    assert open(f"{work}/commit.txt").read().startswith(head)
    assert os.path.isfile(f"{work}/gpu.csv")


def test_a_sharded_scripts_dry_run_lists_its_runs_under_its_run_folder(tmp_path):
    done = bash(
        "bash scripts/gpu/sharded_your_model_traces.sh",
        REPO,
        OUT=str(tmp_path),
        DRY_RUN="1",
        TMPDIR=str(tmp_path),
    )
    assert done.returncode == 0, done.stderr
    runs = [line for line in done.stdout.splitlines() if "dry run: " in line]
    assert len(runs) == 5 and all("/traces/" in line and "recipes/your_model.py" in line for line in runs)
    assert (tmp_path / "progress.log").read_text().count("dry run: ") == 5
    assert (tmp_path / "traces.tgz").is_file()


@pytest.mark.parametrize("sweep", ["", "host", "lm"])
def test_the_encdec_profiles_rows_are_commands_the_runner_accepts(sweep, tmp_path):
    """scripts/gpu/encdec_step_profile.sh's rows (LIST=1 prints them and runs nothing): each names a committed
    config and parses with recipes/your_model.py's flags, the mode and precision it says."""
    from fabric_memory_recipes.training import cli
    from fabric_memory_recipes.training.your_model import runner

    done = bash("bash scripts/gpu/encdec_step_profile.sh", REPO, SWEEP=sweep, LIST="1", OUT=str(tmp_path))
    assert done.returncode == 0, done.stderr
    rows = [line.split() for line in done.stdout.splitlines()]
    assert len(rows) == 4 and not list(tmp_path.iterdir())  # nothing run, nothing written
    for name, model, *flags in rows:
        assert (REPO / model.removeprefix("hf:") / "config.json").exists(), name
        parsed = cli.build_parser(runner.default_config()).parse_args(["--model", model, *flags])
        assert parsed.precision == "bf16-mixed", name
        assert parsed.mode == ("eager" if "eager" in name else "fast"), name  # each row's name says its mode


def test_the_vision_graph_profiles_rows_are_commands_the_runner_accepts(tmp_path):
    """scripts/gpu/vision_graph_profile.sh's rows (LIST=1 prints them and runs nothing): each parses with
    recipes/your_model.py's flags, with the mode its tag says (its results are committed under
    results/published/h200/your-model-speed/vision-graph-profile/)."""
    from fabric_memory_recipes.training import cli
    from fabric_memory_recipes.training.your_model import runner

    done = bash("bash scripts/gpu/vision_graph_profile.sh", REPO, LIST="1", OUT=str(tmp_path))
    assert done.returncode == 0, done.stderr
    rows = [line.split() for line in done.stdout.splitlines()]
    assert len(rows) == 9 and not list(tmp_path.iterdir())  # nothing run, nothing written
    for tag, *flags in rows:
        parsed = cli.build_parser(runner.default_config()).parse_args(flags)
        assert parsed.mode == ("eager" if tag.endswith("eager") else "fast"), tag
        assert parsed.checkpoint_blocks == ("ckpt" in tag or "pick" in tag), tag
