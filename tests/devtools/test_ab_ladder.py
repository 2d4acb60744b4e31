"""devtools.ab_ladder on a CPU, with a stand-in for the recipe processes (the GPU call is what it is for)."""

from __future__ import annotations

import json
from pathlib import Path

from devtools import ab_ladder

REPO = Path(__file__).resolve().parents[2]


def _fake(speeds: dict[str, float], calls: list):
    """A runner that writes the recipe's results JSON as a run would: base and new differ only in img/s."""

    def runner(run, env, timeout):
        calls.append((run.cmd, env["PYTHONPATH"], timeout))
        side = "base" if "/base/" in str(run.json) else "new"
        run.json.parent.mkdir(parents=True, exist_ok=True)
        if speeds.get(side) is None:
            return {"status": "timeout", "wall_s": timeout, "exit_code": None}
        run.json.write_text(
            json.dumps(
                {
                    "status": "ok",
                    "memory": {"peak_reserved_gb": 2.0, "peak_allocated_gb": 1.9},
                    "timing": {"images_per_s": speeds[side]},
                }
            )
        )
        return {"status": "ok", "wall_s": 1.0, "exit_code": 0}

    return runner


def test_pairs_run_each_checkout_with_its_own_code_and_compare(tmp_path, monkeypatch):
    monkeypatch.delenv("PYTHONPATH", raising=False)
    calls: list = []
    base = tmp_path / "base"
    (base / "recipes").mkdir(parents=True)
    (base / "recipes" / "05_gradient_accumulation.py").write_text("")
    argv = ["--base", str(base), "--new", str(REPO), "--out", str(tmp_path / "out"), "--modes", "fast",
            "--rungs", "05", "--timeout", "7", "--", "--max-steps", "3"]  # fmt: skip
    assert ab_ladder.main(argv, runner=_fake({"base": 100.0, "new": 103.0}, calls)) == 0
    assert {c[1] for c in calls} == {str(base.resolve()), str(REPO.resolve())}
    assert all("--max-steps" in c[0] and c[0][-4:-1] == ["--mode", "fast", "--results-dir"] for c in calls)
    assert all(c[2] == 7 for c in calls)  # the per-run timeout reaches the runner
    rows = json.loads((tmp_path / "out" / "ab.json").read_text())
    assert rows[0]["pass"] and abs(rows[0]["images_per_s_ratio"] - 1.03) < 1e-9

    slower = ab_ladder.main(argv, runner=_fake({"base": 100.0, "new": 90.0}, calls))  # -10 % > 5 %
    assert slower == 1 and not json.loads((tmp_path / "out" / "ab.json").read_text())[0]["pass"]


def test_a_run_killed_at_its_timeout_fails_the_row_and_the_table_is_written(tmp_path):
    base = tmp_path / "base"
    (base / "recipes").mkdir(parents=True)
    (base / "recipes" / "14_memory_floor.py").write_text("")
    argv = ["--base", str(base), "--new", str(REPO), "--out", str(tmp_path / "out"), "--modes", "eager",
            "--rungs", "14"]  # fmt: skip
    assert ab_ladder.main(argv, runner=_fake({"base": 25.0, "new": None}, [])) == 1
    row = json.loads((tmp_path / "out" / "ab.json").read_text())[0]
    assert row["new"]["status"] == "timeout" and row["pass"] is False
    assert "| 14 | eager |" in (tmp_path / "out" / "ab.md").read_text()


def test_the_callers_pythonpath_stays_after_the_checkout(tmp_path, monkeypatch):
    """Optional packages installed on PYTHONPATH (torchao for rung 13) must stay importable in the runs."""
    monkeypatch.setenv("PYTHONPATH", "/opt/extra-site")
    calls: list = []
    base = tmp_path / "base"
    (base / "recipes").mkdir(parents=True)
    (base / "recipes" / "13_lowbit_optimizer.py").write_text("")
    argv = ["--base", str(base), "--new", str(REPO), "--out", str(tmp_path / "out"), "--modes", "eager",
            "--rungs", "13"]  # fmt: skip
    assert ab_ladder.main(argv, runner=_fake({"base": 30.0, "new": 30.0}, calls)) == 0
    assert sorted(c[1] for c in calls) == sorted(
        f"{checkout.resolve()}:/opt/extra-site" for checkout in (base, REPO)
    )


def test_project_env_puts_the_code_first_and_keeps_the_callers_path(monkeypatch, tmp_path):
    """Every tool's child processes: this checkout's (or a given one's) code first, then PYTHONPATH."""
    from fabric_memory_recipes.processes import REPO as TOOLS_REPO
    from fabric_memory_recipes.processes import project_env

    monkeypatch.setenv("PYTHONPATH", "/opt/extra-site")
    env = project_env(tmp_path, FMR_OFFLINE="1")
    assert env["PYTHONPATH"] == f"{tmp_path}:/opt/extra-site" and env["FMR_OFFLINE"] == "1"
    monkeypatch.delenv("PYTHONPATH")
    assert project_env()["PYTHONPATH"] == str(TOOLS_REPO) == str(REPO)
