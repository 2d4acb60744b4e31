"""Your own model: --model torchvision:|timm:|hf: resolved, estimated, planned and trained on a CPU
with tiny models and tiny configs written here (no network)."""

from __future__ import annotations

import json
import shlex
import time

import pytest
import torch

from fabric_memory_recipes.config import UsageError
from fabric_memory_recipes.planning.__main__ import main as estimate_main
from fabric_memory_recipes.planning.plan import Plan
from fabric_memory_recipes.planning.simulation.allocator import RESIDUAL
from fabric_memory_recipes.planning.simulation.tracking import SavedTensorCounter, Tracker
from fabric_memory_recipes.planning.your_model import estimate
from fabric_memory_recipes.planning.your_model.sets import UserPlanner
from fabric_memory_recipes.techniques import FUSED_LOSS
from fabric_memory_recipes.training import cli
from fabric_memory_recipes.training.techniques import checkpointing
from fabric_memory_recipes.training.your_model import models, runner
from tests.tiny import HF_BERT, causal_lm_config

VOCAB = 150_000  # a large vocabulary: the logits dominate


def write_config(folder, **fields) -> str:
    folder.mkdir(exist_ok=True)
    path = folder / "config.json"
    path.write_text(json.dumps(fields))
    return str(path)


@pytest.fixture
def qwen(tmp_path) -> str:
    """A 2-layer Qwen2 causal LM of width 64 with a 150k vocabulary."""
    return "hf:" + write_config(tmp_path / "qwen", **causal_lm_config(vocab_size=VOCAB))


@pytest.fixture
def small_qwen(tmp_path) -> str:
    """The same Qwen2 with tests/tiny's 1000-token vocabulary: the CPU's fused loss takes 8 tokens per chunk,
    where 150k tokens take one (a 2-step run: 1 s against 13 s)."""
    return "hf:" + write_config(tmp_path / "small_qwen", **causal_lm_config())


@pytest.fixture
def bert(tmp_path) -> str:
    """A 2-layer BERT (its config says BertForMaskedLM: it becomes a sequence classifier), in a folder."""
    write_config(tmp_path / "bert", **HF_BERT)
    return f"hf:{tmp_path / 'bert'}"


def test_sources_task_and_repeated_blocks(qwen, bert):
    cases = {  # ref -> (task, blocks, how found)
        "torchvision:resnet18": ("image_classification", ("BasicBlock",), "ModuleList/Sequential"),
        "torchvision:vit_b_16": ("image_classification", ("EncoderBlock",), "encoder.layers"),
        "timm:test_vit": ("image_classification", ("Block",), "model.blocks"),
        qwen: ("causal_lm", ("Qwen2DecoderLayer",), "_no_split_modules"),
        bert: ("classification", ("BertLayer",), "_no_split_modules"),
    }
    for ref, (task, blocks, how) in cases.items():
        um, model, found, found_by = estimate.meta_user_model(ref)
        assert um.task == task and found == blocks and how in found_by, (ref, um.task, found, found_by)
        count = sum(type(m).__name__ in blocks for m in model.modules())
        assert count >= 2, ref
    assert estimate.meta_user_model("timm:test_vit")[1].image_size == 160  # timm's input size, not 224


@pytest.mark.parametrize(
    "ref, says",
    [
        ("torchvision:resnet5000", "unknown model (close: resnet50"),
        ("timm:no_such_net", "unknown model"),
        ("hf:/no/such/config.json", "no such file"),
        ("mmdet:yolo", "expected SOURCE:NAME"),
    ],
)
def test_unknown_models_are_refused_in_one_line(ref, says):
    with pytest.raises(UsageError, match="^--model") as e:
        models.resolve(ref)
    assert says in str(e.value) and "\n" not in str(e.value)


def test_malformed_configs_and_offline_hub(tmp_path, monkeypatch):
    (tmp_path / "broken.json").write_text('{"model_type": "qwen2", "hidden_size": ')
    (tmp_path / "untyped.json").write_text('{"hidden_size": 64}')
    for name, says in (("broken.json", "not a readable JSON config"), ("untyped.json", 'no "model_type"')):
        with pytest.raises(UsageError, match=says):
            models.resolve(f"hf:{tmp_path / name}")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(UsageError, match="hub is unreachable"):
        models.resolve("hf:some-org/some-model-never-cached")


def test_an_unknown_model_type_names_the_closest_ones_in_a_short_line(tmp_path):
    """transformers' own error listed every type it knows: a 10,067-character line."""
    (tmp_path / "config.json").write_text('{"model_type": "lamma", "architectures": ["LlamaForCausalLM"]}')
    with pytest.raises(UsageError) as e:
        models.resolve(f"hf:{tmp_path}")
    line = str(e.value)
    assert 'model_type "lamma" is not one this transformers knows (closest: llama' in line, line
    assert len(line) < 300 and "\n" not in line


def test_cli_bad_input_is_one_line_and_exit_2(tmp_path, capsys):
    (tmp_path / "broken.json").write_text("{")
    for argv in (
        ["--model", f"hf:{tmp_path / 'broken.json'}"],
        ["--model", "torchvision:nope"],
        ["--model", "timm:test_vit", "--fit", "3XB"],
    ):
        with pytest.raises(SystemExit) as e:
            estimate_main(argv)
        assert e.value.code == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and "error:" in err, err


def test_large_vocabulary_estimate(qwen, capsys):
    """The logits of one micro-batch are the largest block; reserved exceeds allocated (the replayed
    allocator cannot reuse every freed logits-sized block) and is the replay x the committed margin; the
    JSON has the card fields; checkpointing and FSDP lower what they should."""
    base = ["--model", qwen, "--seq-len", "64", "--batch-size", "4", "--precision", "bf16-true", "--json"]

    def run(*extra):
        assert estimate_main([*base, *extra]) == 0
        return json.loads(capsys.readouterr().out)

    plain, ckpt, fsdp = run(), run("--checkpoint-blocks"), run("--fsdp", "--devices", "4")
    logits_fp32 = 4 * 64 * VOCAB * 4 / 1e9
    assert plain["largest_temporary_gb"] >= logits_fp32 * 0.99
    assert plain["replayed_reserved_gb"] > plain["peak_allocated_gb"]
    assert plain["peak_reserved_gb"] == pytest.approx(plain["replayed_reserved_gb"] * RESIDUAL, abs=2e-6)
    assert plain["device_peak_gb"] > plain["peak_reserved_gb"] and plain["task"] == "causal_lm"
    assert {"weights", "gradients", "optimizer_state"} <= set(plain["static_gb"])
    assert plain["repeated_blocks"] == ["Qwen2DecoderLayer"]
    assert ckpt["activations_saved_gb"] < plain["activations_saved_gb"]
    assert ckpt["assumptions"]["activation_checkpointing"] == ["Qwen2DecoderLayer"]
    assert fsdp["components_gb"]["parameters"] == pytest.approx(
        plain["components_gb"]["parameters"] / 4, rel=1e-3
    )
    on_host = run("--fsdp", "--devices", "4", "--cpu-offload")  # FSDP's CPU offload: no state on the GPU
    assert (
        on_host["assumptions"]["cpu_offload"] is True
        and on_host["peak_allocated_gb"] < fsdp["peak_allocated_gb"]
    )
    assert on_host["components_gb"]["parameters"] == on_host["components_gb"]["optimizer_state"] == 0
    with pytest.raises(SystemExit) as e:
        estimate_main([*base, "--cpu-offload"])
    assert e.value.code == 2 and "--cpu-offload offloads FSDP's shards" in capsys.readouterr().err


def test_the_estimate_sees_the_fused_loss_and_selective_checkpointing(qwen, tmp_path, capsys):
    """Each lever's saving is predicted by running it on fake tensors: the fused loss drops the logits (a
    150k vocabulary: they are the step's peak); where the activations dominate (a small vocabulary, long
    sequences), selective checkpointing's peak lies between full checkpointing's and none's. The plan
    records both."""

    def peak(ref, seq, *extra):
        argv = [
            "--model",
            ref,
            "--seq-len",
            str(seq),
            "--batch-size",
            "4",
            "--precision",
            "bf16-mixed",
            "--json",
        ]
        assert estimate_main([*argv, *extra]) == 0
        got = json.loads(capsys.readouterr().out)
        return got["peak_allocated_gb"], got["assumptions"]

    plain, fused = peak(qwen, 32), peak(qwen, 32, "--fused-loss")
    logits_fp32 = 4 * 31 * VOCAB * 4 / 1e9
    assert plain[0] - fused[0] > logits_fp32 and fused[1]["fused_loss"] and not plain[1]["fused_loss"]
    small = "hf:" + write_config(
        tmp_path / "small", **causal_lm_config(intermediate_size=256, num_hidden_layers=4)
    )
    none, full = peak(small, 256, "--fused-loss"), peak(small, 256, "--fused-loss", "--checkpoint-blocks")
    selective = peak(small, 256, "--fused-loss", "--checkpoint-blocks", "--checkpoint-mode", "selective")
    assert full[0] < selective[0] < none[0] and selective[1]["checkpoint_mode"] == "selective"


def test_fit_combines_the_modes_and_the_causal_lm_levers(qwen):
    planner = UserPlanner(qwen, 2, 32, precision="bf16-mixed")
    found = {(c.mode, c.switched, c.checkpoint_mode) for c in planner.choices}
    fused = (FUSED_LOSS.name,)
    assert {("fast", fused, "selective"), ("eager", (), "full"), ("fast", (), "full")} <= found
    c = next(
        c for c in planner.choices if (c.switched, c.checkpoint_mode, c.mode) == (fused, "selective", "fast")
    )
    parsed = cli.build_parser(runner.default_config()).parse_args(c.argv())
    assert parsed.fused_loss and parsed.checkpoint_mode == "selective" and parsed.mode == "fast"
    assert "fused loss" in c.label() and "selective checkpointing" in c.label()
    fits, _ = planner.fit(64.0, top=2)
    assert len({c.family for c in fits}) == len(fits)  # each set once, at its fastest micro-batch
    assert all(c.mfu(989.4e12) > 0 for c in fits)


def test_fast_mode_compiles_the_repeated_blocks_but_not_batchnorm_ones():
    with torch.device("meta"):
        vit = models.build(models.resolve("timm:test_vit"))
        resnet = models.build(models.resolve("torchvision:resnet18"))
    blocks, _ = models.repeated_blocks(vit)
    assert models.compile_repeated(vit, blocks) >= 2
    assert models.compile_repeated(resnet, models.repeated_blocks(resnet)[0]) == 0  # not shown equal to eager


def test_simulated_activations_match_a_real_forward(bert):
    """The bytes the simulation says a BERT forward saves are what a real CPU forward saves."""
    um, meta, _, _ = estimate.meta_user_model(bert)
    est = estimate.estimate(meta, um, Plan(micro_batch_size=2, device="cpu"), seq_len=32)
    torch.manual_seed(0)
    model = models.build(um)
    make, batch_fn = estimate.text_batch(um, 2, 32)
    with SavedTensorCounter([*model.parameters(), *model.buffers()]) as saved:
        loss = batch_fn(model, make())[0]
        measured = saved.nbytes
    del loss
    # within 1 %: the simulated CPU attention kernel keeps the (batch, 1, seq, seq) mask, 2 KB here
    assert est.activations_saved_bytes == pytest.approx(measured, rel=0.01)


def test_fit_lists_commands_the_runner_accepts(bert, capsys):
    argv = ["--model", bert, "--seq-len", "32", "--batch-size", "4", "--may-change", "optimizer"]
    assert estimate_main([*argv, "--fit", "10GB", "--top", "2", "--json"]) == 0
    answer = json.loads(capsys.readouterr().out)
    assert 1 <= len(answer["fits"]) <= 2 and all(f["predicted_device_peak_gb"] <= 10 for f in answer["fits"])
    assert "not measured" in answer["speed"][0]
    speeds = [f["predicted_samples_per_s"] for f in answer["fits"]]
    assert speeds == sorted(speeds, reverse=True)
    for pick in answer["fits"]:
        words = shlex.split(pick["command"])
        assert words[:2] == ["python", "recipes/your_model.py"]
        parsed = cli.build_parser(runner.default_config()).parse_args(words[2:])
        assert parsed.model == bert and parsed.batch_size == 4
    # nothing fits: one line, the smallest peak, and what --may-change would add (every set is simulated to
    # find the smallest: the user's optimizer only, a third of the sets)
    assert estimate_main([*argv[:-2], "--fit", "1MB"]) == 1
    first, hint = capsys.readouterr().out.strip().splitlines()
    assert first.startswith("Nothing fits in 1MB = 0.001 GB: the smallest predicted peak is")
    assert hint.startswith("(--may-change precision,optimizer also tries")


@pytest.mark.parametrize(
    "model, extra",
    [("timm:test_vit", ["--checkpoint-blocks", "--optimizer", "sgd"]),
     ("bert", ["--seq-len", "32", "--optimizer-in-backward", "--data", "synthetic"]),
     ("small_qwen", ["--seq-len", "32", "--fused-loss", "--checkpoint-blocks", "--checkpoint-mode", "selective",
               "--data", "synthetic"])],
)  # fmt: skip
def test_runner_trains_on_cpu_with_the_estimate(run_recipe, request, model, extra):
    model = request.getfixturevalue(model) if model in ("bert", "small_qwen") else model
    proc, result = run_recipe("your_model", "--accelerator", "cpu", "--model", model, "--batch-size", "4",
                              "--max-steps", "2", "--eval-batches", "1", *extra)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert result["status"] == "ok" and result["config"]["model"] == model
    assert (
        result["estimate"]["peak_allocated_gb"] > 0
        and result["extra"]["predicted_card"]["peak_reserved_gb"] > 0
    )
    assert result["timing"] and result["memory"]["peak_allocated_gb"] is not None
    if "--checkpoint-blocks" in extra:
        assert (
            result["extra"]["checkpointed_blocks"] >= 2
            and result["estimate"]["assumptions"]["activation_checkpointing"]
        )
    assert result["provenance"]["data_source"] in ("digits", "synthetic")
    if "--fused-loss" in extra:  # no logits in training: no token accuracy; evaluation predicts in chunks
        assert result["accuracy"]["train"] is None and result["accuracy"]["test"] is not None
        assert result["loss"]["first"] > 0 and result["estimate"]["assumptions"]["fused_loss"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for a machine without a CUDA GPU")
def test_without_a_gpu_the_runner_refuses_in_one_line_with_a_cpu_command_that_runs(run_recipe, qwen):
    """The README's command on a CPU machine started a 4375-step run at 123 s a step; the ladder's rungs
    refuse in one line with a CPU command, and so does the runner: the same model and technique set,
    small shapes, and that command runs."""
    asked = ["--model", qwen, "--seq-len", "512", "--batch-size", "8", "--checkpoint-blocks"]
    proc, result = run_recipe("your_model", *asked)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and result is None and len(lines) == 1, proc.stderr[-2000:]
    assert lines[0].startswith("your_model.py: error: no CUDA GPU found:"), lines
    suggested = shlex.split(lines[0].split("a quick CPU run: ")[1].split(" (pass")[0])
    assert suggested[:2] == ["python", "recipes/your_model.py"]
    assert {"--accelerator", "cpu", qwen, "--checkpoint-blocks", "--max-steps"} <= set(suggested)
    proc, result = run_recipe("your_model", *suggested[2:])
    assert proc.returncode == 0 and result["status"] == "ok", proc.stderr[-2000:]
    assert result["timing"]["optimizer_steps"] == 2 and result["extra"]["evaluation"]["test"]["batches"] <= 2


def test_runner_refuses_what_cannot_run(run_recipe, bert):
    proc, _ = run_recipe(
        "your_model", "--accelerator", "cpu", "--model", bert, "--data", "digits", "--max-steps", "1"
    )
    assert proc.returncode == 2 and "does not fit" in proc.stderr
    proc, _ = run_recipe("your_model", "--accelerator", "cpu", "--model", "torchvision:resnet18", "--fsdp")
    assert proc.returncode == 2 and "--fsdp" in proc.stderr


def test_model_proof_rows_and_table_with_a_stand_in_runner(tmp_path, monkeypatch):
    """The GPU proof's bookkeeping on a CPU: each run's own prediction against its measurement, in rows
    and a table written after every run; a run that does not end as expected makes the exit code 1; a
    second call with the same --out runs only what the first left (here: stopped by its deadline)."""
    from devtools import model_proof

    sets = [["--batch-size", "4", "--precision", "bf16-true"], ["--batch-size", "2", "--checkpoint-blocks"]]
    monkeypatch.setattr(model_proof, "ROWS", [("timm:test_vit", sets)])
    measured = iter([(2.0, 2.8, "ok"), (1.0, None, "oom")])
    ran = []

    def stand_in(run, env, timeout):
        ran.append(run.cmd)
        time.sleep(0.6)  # the first call's deadline (0.5 s) passes during its first run
        reserved, device, status = next(measured)
        run.json.parent.mkdir(parents=True, exist_ok=True)
        run.json.write_text(
            json.dumps(
                {
                    "status": status,
                    "memory": {"peak_reserved_gb": reserved, "device_peak_gb": device},
                    "timing": {"images_per_s": 10.0},
                    "config": {},
                    "extra": {"predicted_card": {"peak_reserved_gb": 2.1, "device_peak_gb": 2.9}},
                }
            )
        )
        return {"status": status, "wall_s": 1.0}

    out = tmp_path / "proof"
    args = ["--out", str(out), "--parts", "estimate", "--deadline", "0.5"]
    assert model_proof.main(args, runner=stand_in) == 0  # the second run did not start: not a failure
    assert [r.get("status") for r in json.loads((out / "rows.json").read_text())] == ["ok", "not run"]
    assert model_proof.main(args[:-2], runner=stand_in) == 1  # goes on: the second ran out of memory
    assert len(ran) == 2 and "--max-steps" in ran[0] and ran[0][ran[0].index("--max-steps") + 1] == "4"
    rows = json.loads((out / "rows.json").read_text())
    assert [r["status"] for r in rows] == ["ok", "oom"]
    assert rows[0]["predicted_peak_gb"] == 2.1 and rows[0]["measured_peak_reserved_gb"] == 2.0
    table = (out / "table.md").read_text()
    assert "+5.0%" in table and "+3.6%" in table  # 2.1 vs 2.0 reserved, 2.9 vs 2.8 whole device


def test_model_proof_shares_the_gpu_between_estimate_runs_only(tmp_path, monkeypatch):
    """--jobs N: estimate runs (memory per process) go N at a time; every row is written."""
    import threading

    from devtools import model_proof

    sets = [["--batch-size", str(b)] for b in (2, 3, 4)]
    monkeypatch.setattr(model_proof, "ROWS", [("timm:test_vit", sets)])
    lock, active, most = threading.Lock(), [0], [0]

    def stand_in(run, env, timeout):
        with lock:
            active[0] += 1
            most[0] = max(most[0], active[0])
        time.sleep(0.3)
        run.json.parent.mkdir(parents=True, exist_ok=True)
        run.json.write_text(json.dumps({"status": "ok", "memory": {"peak_reserved_gb": 1.0}, "config": {}}))
        with lock:
            active[0] -= 1
        return {"status": "ok", "wall_s": 0.3}

    out = tmp_path / "proof"
    assert model_proof.main(["--out", str(out), "--parts", "estimate", "--jobs", "3"], runner=stand_in) == 0
    assert most[0] >= 2
    assert [r["status"] for r in json.loads((out / "rows.json").read_text())] == ["ok", "ok", "ok"]


def test_model_proof_rows_cover_the_targets():
    """Five or more models outside the ladder (two vision, two text, a causal LM with a vocabulary over
    100k), three or more technique sets each, every flag of a row given once."""
    from devtools import model_proof, planner_proof

    tasks, vocab = {}, {}
    for ref, sets in model_proof.ROWS:
        um = models.resolve(ref)
        tasks[ref], vocab[ref] = um.task, um.vocab_size or 0
        assert len(sets) >= 3, ref
    assert len(tasks) >= 5
    assert sum(t == "image_classification" for t in tasks.values()) >= 2
    assert sum(t != "image_classification" for t in tasks.values()) >= 2
    assert any(tasks[r] == "causal_lm" and vocab[r] > 100_000 for r in tasks)
    runs = model_proof.estimate_runs(None)
    assert all(not model_proof.repeated_flags(r["argv"]) for r in runs)
    assert len({planner_proof._slug(r) for r in runs}) == len(runs)  # each run its own results folder
    assert not any(set(planner_proof._slug(r)) & set(':\\/*?<>|"') for r in runs)  # portable folder names
    assert model_proof.repeated_flags(["--batch-size", "8", "--sgd", "--batch-size", "2"]) == ["--batch-size"]


def real_step_peak(model, optimizer, batch, fn) -> float:
    """Peak bytes of the tensors a real CPU step creates, counted by the simulation's own Tracker on real
    tensors (weights, optimizer state, then one steady step): the memory CUDA would hand out for them,
    without the CPU kernels' own buffers (im2col columns, oneDNN's reordered weights) that a CPU
    profiler adds and a GPU run does not have."""

    def step():
        fn(model, batch)[0].backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    step()  # the optimizer state exists from here on
    tracker = Tracker()
    for t in [*model.parameters(), *model.buffers()]:
        tracker.record(t, "parameters")
    for state in optimizer.state.values():
        for t in state.values():
            tracker.record(t, "optimizer_state")
    with tracker:
        step()
    return tracker.peak


@pytest.mark.parametrize("ref", ["torchvision:resnet18", "timm:test_convnext", "timm:test_vit"])
@pytest.mark.parametrize("checkpoint", [False, True])
def test_simulated_peak_is_a_real_cpu_steps_with_the_runners_checkpointing(ref, checkpoint):
    """Convolutional and ViT models, checkpointed by the runner's wrapper (the ladder's: checkpointing.checkpoint_blocks)
    around the blocks the estimator finds (one repeated_blocks list): the simulated peak, made on fake
    tensors with the estimator's wrapper, is the real step's to a few KB."""
    from fabric_memory_recipes.training import data

    um, meta, blocks, _ = estimate.meta_user_model(ref)
    plan = Plan(
        device="cpu",
        micro_batch_size=4,
        optimizer="sgd",
        activation_checkpointing=blocks if checkpoint else (),
    )
    torch.manual_seed(0)
    model = models.build(um)
    model.image_size = 96  # small images keep the CPU step quick
    images = torch.randint(0, 256, (4, 32, 32, 3), dtype=torch.uint8)
    batch, fn = (images, torch.randint(0, 10, (4,))), data.image_classification(96)
    est = estimate.simulate(model, plan, make_batch=lambda: batch, batch_fn=fn)
    if checkpoint:
        assert checkpointing.checkpoint_blocks(model, blocks) >= 2
    measured = real_step_peak(model, torch.optim.SGD(model.parameters(), lr=1e-3, fused=True), batch, fn)
    assert est.peak_gb * 1e9 == pytest.approx(measured, abs=16 * 1024)
    assert est.components_gb["activations"] > 0
