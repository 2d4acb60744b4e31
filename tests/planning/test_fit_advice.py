"""Advice a user can follow: ``--fit`` for every model family the runner trains, the user's
precision and optimizer kept unless ``--may-change`` names them (each change with its measured accuracy
cost), bad input as one line and exit 2, ``--measure``'s ranking, and the planner data a wheel ships (that both
planners plan from them without the checkout: tests/test_wheel.py).

Tiny configs of each family are written here; the runner trains each for 2 steps on the CPU, in this
process (conftest's ``run_recipe``)."""

from __future__ import annotations

import json
import shlex
import sys
import types
from pathlib import Path

import pytest
import torch

from fabric_memory_recipes.planning.__main__ import main as estimate_main
from fabric_memory_recipes.planning.planner import advice, snapshot
from fabric_memory_recipes.planning.your_model import measure
from fabric_memory_recipes.training import cli
from fabric_memory_recipes.training.your_model import runner
from tests.conftest import result, run_process, session_dir, submit, subprocess_env

SMALL = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    max_position_embeddings=128,
)
FAMILIES = {
    "llama": dict(model_type="llama", architectures=["LlamaForCausalLM"], num_key_value_heads=2, **SMALL),
    "qwen2": dict(model_type="qwen2", architectures=["Qwen2ForCausalLM"], num_key_value_heads=2, **SMALL),
    "mistral": dict(model_type="mistral", architectures=["MistralForCausalLM"], num_key_value_heads=2, **SMALL),
    "gpt_neox": dict(model_type="gpt_neox", architectures=["GPTNeoXForCausalLM"], **SMALL),
    "gpt2": dict(model_type="gpt2", architectures=["GPT2LMHeadModel"], vocab_size=512, n_embd=64, n_layer=2,
                 n_head=4, n_positions=128, bos_token_id=0, eos_token_id=0),
    "bert": dict(model_type="bert", architectures=["BertForMaskedLM"], **SMALL),
}  # fmt: skip
TASKS = {"bert": "classification"}  # the rest are causal LMs


@pytest.fixture(scope="module")
def configs(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("families")
    out = {}
    for name, fields in FAMILIES.items():
        (root / name).mkdir()
        (root / name / "config.json").write_text(json.dumps(fields))
        out[name] = f"hf:{root / name}"
    return out


def _fit(capsys, argv: list[str]) -> dict:
    assert estimate_main([*argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_fit_and_train_every_family(configs, family, capsys, run_recipe):
    """--fit answers for each family (causal LMs included) with commands the runner accepts, keeping the
    user's precision and optimizer; the pick trains 2 steps on the CPU."""
    ref = configs[family]
    argv = [
        "--model",
        ref,
        "--seq-len",
        "32",
        "--batch-size",
        "4",
        "--precision",
        "bf16-mixed",
        "--optimizer",
        "adamw",
    ]
    answer = _fit(capsys, [*argv, "--fit", "4GB", "--top", "3"])
    assert answer["fits"] and answer["kept"] == {"precision": "bf16-mixed", "optimizer": "adamw"}
    for row in answer["fits"]:
        assert (
            row["precision"] == "bf16-mixed" and row["technique"].startswith("AdamW") and row["changes"] == []
        )
    pick = shlex.split(answer["fits"][0]["command"])
    parsed = cli.build_parser(runner.default_config()).parse_args(pick[2:])
    assert (parsed.model, parsed.precision, parsed.optimizer) == (ref, "bf16-mixed", "adamw")
    proc, result = run_recipe("your_model", *pick[2:], "--precision", "32-true", "--accelerator", "cpu",
                              "--max-steps", "2", "--eval-batches", "1", "--data", "synthetic")  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert result["status"] == "ok" and result["extra"]["task"] == TASKS.get(family, "causal_lm")
    assert result["timing"]["optimizer_steps"] == 2


# --may-change searches three precisions and three optimizers (40 s of CPU in this process): its plan and the one
# that keeps the user's precision and optimizer run in the background (planning/planner/workers.py may fork
# there), on a config written for them, in one process one after the other (fmr-estimate's main, each plan's
# output in its own file): the second plan's simulations are quicker after the first's (the fake mode's
# dispatch cache and the model are warm), and one interpreter starts instead of two.
BACKGROUND_TESTS = {"test_may_change_names_what_changes_with_its_measured_cost"}
MAY_CHANGE_ARGV = "--seq-len 32 --batch-size 1 --precision 32-true --fit 8GB --top 40 --json"
TWO_PLANS = """
import contextlib, sys
from fabric_memory_recipes.planning.__main__ import main
out, argv = sys.argv[1], sys.argv[2:]
codes = []
for name, extra in (("kept", []), ("free", ["--may-change", "precision,optimizer"])):
    with open(f"{out}/{name}.json", "w") as f, contextlib.redirect_stdout(f):
        codes.append(main([*argv, *extra]))
sys.exit(max(codes))
"""


def start_background_jobs() -> None:
    root = session_dir("may-change")
    (root / "config.json").write_text(json.dumps(FAMILIES["llama"]))
    argv = [sys.executable, "-c", TWO_PLANS, str(root), "--model", f"hf:{root}", *MAY_CHANGE_ARGV.split()]
    submit("may-change", lambda: (run_process(argv, subprocess_env()), root))


def test_may_change_names_what_changes_with_its_measured_cost():
    proc, root = result("may-change")
    assert proc.returncode == 0, proc.stderr[-2000:]
    kept, free = (json.loads((root / f"{name}.json").read_text()) for name in ("kept", "free"))
    assert {r["precision"] for r in kept["fits"]} == {"32-true"}
    assert {r["technique"].split(" + ")[0] for r in kept["fits"]} == {"AdamW"}
    assert {r["precision"] for r in free["fits"]} == {"32-true", "bf16-mixed", "bf16-true"}
    changed = [r for r in free["fits"] if r["precision"] == "bf16-true"]
    lines = [c["line"] for r in changed for c in r["changes"] if c["change"] == "precision bf16-true"]
    assert lines and len(lines) == len(changed)
    bf16 = advice.cost("precision", "bf16-true")
    assert bf16.delta is not None and bf16.delta < 0 and bf16.n >= 1  # the benchmark measured a loss
    assert "Kahan" in lines[0] and f"{bf16.delta:+.3f}" in lines[0]
    sgd = [c for r in free["fits"] for c in r["changes"] if c["change"] == "optimizer sgd"]
    assert sgd and sgd[0]["delta"] == pytest.approx(advice.cost("optimizer", "sgd").delta)


def test_accuracy_costs_come_from_the_benchmark_runs():
    """Each cost is the mean of the changed rung's finished seeds minus the compared rung's, as the
    committed run files give them."""
    rows = snapshot.accuracy_payload()["h100"]
    changed, compared, _ = advice.CHANGES[("precision", "bf16-true")]
    expect = rows[changed]["mean"] - rows[compared]["mean"]
    assert advice.cost("precision", "bf16-true").delta == pytest.approx(expect, abs=1e-6)
    assert advice.cost("precision", "bf16-mixed").note  # stands for 16-mixed's, and says so
    assert advice.cost("precision", "64-true").delta is None


def test_bad_input_is_one_line_and_exit_2(configs, capsys):
    gpt2 = ["--model", configs["gpt2"], "--seq-len", "32", "--batch-size", "4"]
    cases = {
        "is an encoder-decoder's": [*gpt2, "--target-len", "16", "--fit", "4GB"],
        "has 128 positions": [*gpt2[:3], "100000", "--fit", "4GB"],
        "weights alone": ["--model", "torchvision:resnet50", "--fit", "50MB"],
        "CUDA GPU": [*gpt2, "--fit", "4GB", "--measure"],
        "not a GPU kind": [*gpt2, "--fit", "4GB", "--gpu", "banana"],
        "expected a memory size": [*gpt2, "--fit", "-3GB"],
        "unknown model": ["--model", "torchvision:no_such_net", "--fit", "4GB"],
    }
    for words, argv in cases.items():
        with pytest.raises(SystemExit) as e:
            estimate_main(argv)
        err = capsys.readouterr().err.strip()
        assert e.value.code == 2 and len(err.splitlines()) == 1 and words in err, (words, err)


def test_hooks_slow_the_step_in_backward_in_the_ranking(capsys):
    """The step in backward pays its per-parameter hooks: never ranked above the same set without it."""
    answer = _fit(
        capsys, ["--model", "torchvision:resnet18", "--batch-size", "8", "--fit", "40GB", "--top", "30"]
    )
    by_set = {(r["accumulation_steps"], r["technique"]): r["predicted_samples_per_s"] for r in answer["fits"]}
    pairs = [
        (s, by_set.get((k, t.replace(" + step in backward", ""))))
        for (k, t), s in by_set.items()
        if "step in backward" in t
    ]
    assert pairs and all(other is not None and hooked < other for hooked, other in pairs)


def test_measure_ranks_by_what_ran(tmp_path, monkeypatch):
    """--measure's bookkeeping with a stand-in process runner: each set's measurement beside its
    prediction, the fitting sets ranked by measured speed, plan.json/plan.md written after every run."""
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)  # no setting of the user's: no line for it
    rows = [
        {
            "command": f"python recipes/your_model.py --batch-size {b}",
            "argv": ["--batch-size", str(b)],
            "label": f"set {b}",
            "predicted_samples_per_s": 100.0 - b,
            "predicted_device_peak_gb": 3.0,
        }
        for b in (1, 2, 3)
    ]
    outcomes = iter([("ok", 50.0, 3.5), ("ok", 80.0, 3.9), ("oom", None, None)])

    def stand_in(run, env, timeout):
        status, speed, device = next(outcomes)
        cmd, json_path = run.cmd, run.json
        json_path.parent.mkdir(parents=True, exist_ok=True)
        memory = {"device_peak_gb": device, "peak_reserved_gb": device and device - 0.9}
        json_path.write_text(
            json.dumps({"status": status, "memory": memory, "timing": {"images_per_s": speed}})
        )
        assert cmd[cmd.index("--memory-budget-gb") + 1] == "4"
        return {"status": status, "wall_s": 1.0}

    said = []
    original = measure.execute
    measure.execute = stand_in
    try:
        best = measure.measure(rows, 4.0, tmp_path, steps=5, say=said.append)
    finally:
        measure.execute = original
    assert [r["argv"][-1] for r in best] == ["2", "1"]  # measured order; the third ran out of memory
    plan = json.loads((tmp_path / "plan.json").read_text())
    assert plan["measured_pick"].endswith("2") and plan["predicted_pick"].endswith("1")
    assert [r["status"] for r in plan["sets"]] == ["ok", "ok", "oom"]
    assert "| 1 | 2 |" in (tmp_path / "plan.md").read_text() and len(said) == 6


def test_the_shipped_planner_data_match_the_checkout():
    """A wheel plans from package data; it must be what the committed runs, rungs and benchmark give
    (after new committed runs: python -m fabric_memory_recipes.planning.planner.snapshot --write)."""
    assert snapshot.stale() == []


def test_mixed_precision_recomputes_under_the_same_autocast_policy(capsys):
    """A checkpointed block recomputes in backward under the CUDA autocast policy its forward ran under
    (Swin-T's layer norms: fp32 both times), so --fit for a mixed-precision Swin-T plans instead of failing."""
    argv = [
        "--model",
        "torchvision:swin_t",
        "--batch-size",
        "2",
        "--precision",
        "bf16-mixed",
        "--checkpoint-blocks",
        "--json",
    ]
    assert estimate_main(argv) == 0
    assert json.loads(capsys.readouterr().out)["peak_allocated_gb"] > 0


def test_the_ladders_fit_keeps_its_sources_for_verbose(capsys):
    """--fit lists the calibration files it read only with --verbose."""
    estimate_main(["--fit", "8GB"])
    short = capsys.readouterr().out
    estimate_main(["--fit", "8GB", "--verbose"])
    long = capsys.readouterr().out
    assert "fixed_ms:" not in short and "--verbose" in short and "fixed_ms: " in long
    assert len(short.splitlines()) < len(long.splitlines()) and max(map(len, short.splitlines())) < 250


def test_several_gpus_plan_fsdp_sets_with_memory_per_gpu(configs, capsys, monkeypatch):
    """--devices N: every set is FSDP over the N GPUs (with checkpointing or without), kept to the user's
    precision and optimizer, eager, its memory per GPU below the same set's on one GPU and its samples/s
    above one GPU's."""
    argv = ["--model", configs["llama"], "--seq-len", "32", "--batch-size", "4", "--precision", "bf16-mixed",
            "--fit", "8GB", "--top", "40", "--gpu", "h100"]  # fmt: skip

    def key(r):
        return r["technique"], r["accumulation_steps"], r["mode"], r["fused_loss"], r["checkpoint_mode"]

    one = {key(r): r for r in _fit(capsys, argv)["fits"]}
    four = _fit(capsys, [*argv, "--devices", "4"])
    assert four["fits"] and four["kept"] == {"precision": "bf16-mixed", "optimizer": "adamw"}
    for row in four["fits"]:
        cmd = shlex.split(row["command"])
        assert cmd[cmd.index("--devices") + 1] == "4" and "--fsdp" in cmd and row["devices"] == 4
        assert "--activation-offload" not in cmd and "--optimizer-in-backward" not in cmd
        parsed = cli.build_parser(runner.default_config()).parse_args(cmd[2:])
        assert parsed.fsdp and parsed.devices == 4 and parsed.precision == "bf16-mixed"
        assert row["mode"] in ("eager", "fast")  # fast: FSDP2 with compiled blocks
        alone = one[key(row)]
        assert row["simulated_peak_allocated_gb"] < alone["simulated_peak_allocated_gb"]  # sharded state
        assert row["overhead_gb"] > alone["overhead_gb"]  # four processes' contexts and NCCL, measured
        # each GPU its own batch at the sharded step's predicted time, its collectives' exposed time added;
        # fast mode on one GPU replays the step in a CUDA graph (no host time), FSDP's fast mode does not: a
        # model this small, host-bound, can then train faster on one GPU, so only eager mode compares so
        speed = row["predicted_samples_per_s"]
        assert speed < 8 * alone["predicted_samples_per_s"]
        assert speed > alone["predicted_samples_per_s"] or row["mode"] == "fast"
    assert {r["technique"] for r in four["fits"]} <= {"AdamW", "AdamW + checkpointing"}
    assert {r["mode"] for r in four["fits"]} == {"eager", "fast"}  # both compared above
    # FSDP's CPU offload is a set of its own: shards, gradients and Adam on the host, its copies and CPU step
    # at the host rate rung 09 measured (said), so less memory per GPU and less speed than the same set kept on the GPUs
    offloaded = [r for r in four["fits"] if r["cpu_offload"]]
    assert offloaded and all(r["command"].endswith("--cpu-offload") for r in offloaded)
    assert all("rung 09_cpu_offload" in r["speed_source"] for r in offloaded)  # measured rate
    kept = {key(r): r for r in four["fits"] if not r["cpu_offload"]}
    pairs = [(kept[key(r)], r) for r in offloaded if key(r) in kept]
    assert pairs and all(
        on_gpu["simulated_peak_allocated_gb"] > off["simulated_peak_allocated_gb"]
        and on_gpu["predicted_samples_per_s"] > off["predicted_samples_per_s"]
        for on_gpu, off in pairs
    )
    # no h100 x4 eager run measured the overhead: the closest measurement (same mode and count) is assumed
    # and said to be, where "h200 x4 compiled" (the largest of all) was taken and called measured; the legend
    # names each mode the sets were planned in (several GPUs: eager, FSDP; fast, FSDP2 with compiled blocks)
    assert (
        "eager mode: a card overhead assumed for h100 x4 eager, which no run measured"
        in four["card_overhead"]
    )
    assert four["card_overhead"].count(" mode: ") == 2, four["card_overhead"]  # both modes
    assert {r["mode"] for r in four["fits"]} == {"eager", "fast"}
    assert "(h200 x4 eager, 2.09 GB per GPU" in four["card_overhead"], four["card_overhead"]
    assert "NCCL" in " ".join(four["speed"]) and "(or h100's)" not in " ".join(four["speed"])
    # the gathers and reduce-scatters are priced and the plan says how (set_speed.collective_seconds)
    assert "each step longer by its gathers (two per micro-batch)" in " ".join(four["speed"])
    assert all("rung 08_fsdp2's 4 x H200 profile" in r["speed_source"] for r in four["fits"])
    assert all("08_fsdp2" not in r["speed_source"] for r in one.values())  # one GPU: none
    # --measure runs each sharded set on N GPUs of the machine (each capped at the card): it needs N
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    with pytest.raises(SystemExit) as e:
        estimate_main([*argv, "--devices", "4", "--measure"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "runs each FSDP set on 4 GPUs" in err and "this machine has 2" in err


def test_the_fit_proof_shares_its_jobs_over_the_named_gpus(tmp_path, monkeypatch):
    """fit_proof runs each job once, one at a time per named GPU (CUDA_VISIBLE_DEVICES), and starts none
    after its deadline (processes.DeviceSlots, as the convergence benchmark shares its GPUs)."""
    from devtools import fit_proof

    ran = []

    def fake_run(cmd, cwd, env, stdout, stderr):
        ran.append((cmd[cmd.index("--measure-dir") + 1], env["CUDA_VISIBLE_DEVICES"]))
        return types.SimpleNamespace(returncode=0)

    monkeypatch.setattr(fit_proof.subprocess, "run", fake_run)
    fit_proof.run(tmp_path, ["2", "3"], 4, ("swin_t", "roberta-base"), deadline=1e9)
    assert sorted(Path(d).name for d, _ in ran) == [
        "roberta-base-6GB",
        "roberta-base-8GB",
        "swin_t-3GB",
        "swin_t-5GB",
    ]
    assert {gpu for _, gpu in ran} <= {"2", "3"}
    ran.clear()
    fit_proof.run(tmp_path, ["0"], 4, ("swin_t",), deadline=0)
    assert ran == []
