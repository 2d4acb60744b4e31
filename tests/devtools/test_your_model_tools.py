"""devtools/your_model/repredict.py and allocator_check.py on committed-style results of a tiny causal LM
(written here: a fast run inside a ``.tgz``, an eager run beside it, and files both must pass over): what
they print is what ``fmr-estimate --model ... --json`` simulates for the same flags."""

from __future__ import annotations

import contextlib
import io
import json
import os
import tarfile
from unittest import mock

import pytest

from devtools.your_model import allocator_check, repredict
from fabric_memory_recipes.config import Hardware
from fabric_memory_recipes.planning.__main__ import main as estimate_main
from fabric_memory_recipes.training.your_model import runner
from tests.tiny import causal_lm_config

FLAGS = {"fast": [], "eager": ["--mode", "eager"]}  # the runner's default on a GPU: fast mode


def result(lm: str, mode: str, **changes) -> dict:
    """What the runner records for a one-GPU run of the tiny model in ``mode`` (fast mode: expandable
    segments, the steps uncaptured: a text model), with made-up measurements."""
    cfg = runner.default_config().with_flags(
        model=lm, seq_len=32, batch_size=2, accelerator="cuda", mode=mode
    )
    with mock.patch.dict(os.environ):  # checked() sets fast mode's allocator for this process: not kept
        config = cfg.checked(Hardware.planned()).flags()
    payload = {
        "recipe": "your_model",
        "status": "ok",
        "config": config,
        "provenance": {
            "world_size": 1,
            "cuda_alloc_conf": "expandable_segments:True" if mode == "fast" else None,
        },
        "memory": {"kind": "cuda", "peak_allocated_gb": 0.05, "run_peak_reserved_gb": 0.08},
        "estimate": {"peak_allocated_gb": 0.04, "peak_reserved_simulated_gb": 0.07},  # as once recorded
    }
    return {**payload, **changes}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> tuple[str, dict[str, dict]]:
    """(the folder of the results, what fmr-estimate --json simulates for each mode's flags)."""
    folder = tmp_path_factory.mktemp("your_model_runs")
    (folder / "lm").mkdir()
    (folder / "lm" / "config.json").write_text(json.dumps(causal_lm_config()))  # not a result: passed over
    lm = f"hf:{folder / 'lm'}"
    (folder / "eager.json").write_text(json.dumps(result(lm, "eager")))
    (folder / "oom.json").write_text(json.dumps(result(lm, "eager", status="oom")))  # not a finished run
    gone = result(lm, "eager")  # a run of a model this checkout does not have: said, and passed over
    (folder / "gone.json").write_text(json.dumps({**gone, "config": {**gone["config"], "model": "hf:gone"}}))
    (folder / "fast.json").write_text(json.dumps(result(lm, "fast")))
    with tarfile.open(folder / "fast.tgz", "w:gz") as tar:
        tar.add(folder / "fast.json", arcname="call/fast.json")
    (folder / "fast.json").unlink()
    return str(folder), {mode: simulated(lm, extra) for mode, extra in FLAGS.items()}


def simulated(lm: str, extra: list[str]) -> dict:
    """fmr-estimate --json for the tiny model with these flags."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert estimate_main(["--model", lm, "--seq-len", "32", "--batch-size", "2", *extra, "--json"]) == 0
    return json.loads(out.getvalue())


def test_repredict_prints_the_simulated_peak_allocated_beside_the_measured_and_the_recorded(
    runs, tmp_path, capsys
):
    folder, want = runs
    assert repredict.main([folder, "--json", str(tmp_path / "rows.json")]) == 0
    rows = {
        r.pop("run").removeprefix(f"{folder}/"): r for r in json.loads((tmp_path / "rows.json").read_text())
    }
    assert sorted(rows) == ["eager.json", "fast.tgz:call/fast.json"]  # the oom run and the config passed over
    printed = capsys.readouterr().out
    assert f"{folder}/gone.json: not simulated (UsageError: --model hf:gone" in printed
    for name, mode in (("eager.json", "eager"), ("fast.tgz:call/fast.json", "fast")):
        again = want[mode]["peak_allocated_gb"]
        row = rows[name]
        assert row["measured_gb"]["allocated"] == 0.05 and row["recorded_gb"]["allocated"] == 0.04
        assert row["again_gb"]["allocated"] == pytest.approx(again, abs=1e-6)
        line = next(line for line in printed.splitlines() if line.split(" ", 1)[0].rstrip(":").endswith(name))
        error = f"{100 * (0.04 - 0.05) / 0.05:+.1f}% -> {100 * (again - 0.05) / 0.05:+.1f}%"
        assert f"allocated 0.05 / 0.04 -> {again:.2f} ({error})" in line


def test_allocator_check_replays_each_run_under_the_default_allocator_and_its_own(runs, capsys):
    folder, want = runs
    assert allocator_check.main([folder, "--json"]) == 0
    out, err = capsys.readouterr()
    rows = {r["mode"]: r for r in json.loads(out)}
    assert sorted(rows) == ["eager", "fast"]  # the oom run, the model's config and the gone model passed over
    assert "gone.json: not simulated (UsageError: --model hf:gone" in err
    fast, eager = rows["fast"], rows["eager"]
    assert (fast["allocator"], eager["allocator"]) == (
        "graphs",
        "default",
    )  # a causal LM's fast steps: a graph
    # the run's own setting replays to what the estimate predicts for the mode; the default allocator to
    # what it predicts for eager mode, the same step
    assert fast["own_gb"] == pytest.approx(want["fast"]["peak_reserved_simulated_gb"], abs=1e-6)
    for row in (fast, eager):
        assert row["default_gb"] == pytest.approx(want["eager"]["peak_reserved_simulated_gb"], abs=1e-6)
        assert (row["measured_gb"], row["recorded_gb"]) == (0.08, 0.07)
    assert eager["own_gb"] == eager["default_gb"] and fast["own_gb"] != fast["default_gb"]
    assert allocator_check.main([folder]) == 0
    table = capsys.readouterr().out
    for r in (fast, eager):  # the table's errors: each replay against the measured peak reserved
        assert f"{r['own_gb']:.3f} | {100 * (r['own_gb'] / 0.08 - 1):+.1f}% |" in table


def test_the_equivalence_rows_are_runs_the_runner_accepts():
    """Every row of devtools/your_model/equivalence.py (which runs on a GPU only) is two commands the runner's
    parser takes, its flags reaching the config; the causal LM's graph rows ask for the graph."""
    from devtools.your_model import equivalence
    from fabric_memory_recipes.training import cli

    parser = cli.build_parser(runner.default_config())
    graphs = 0
    for name, common, ref, checked in equivalence.ROWS:
        for flags in (ref, checked):
            argv = [c.format(bert="bert.json") for c in common] + [*equivalence.FP32, *flags]
            parsed = parser.parse_args(argv)
            assert parsed.model == argv[argv.index("--model") + 1], name
            assert bool(parsed.cuda_graphs) == ("--cuda-graphs" in flags), name
            assert (parsed.lora_rank == 8) == ("--lora-rank" in common), name
        graphs += "--cuda-graphs" in checked and "CUDA graphs" in name
    assert graphs >= 5  # own loss; fused + selective; LoRA; accumulation; offload
