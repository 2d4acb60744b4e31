"""fmr-estimate for encoder-decoders (T5, mT5, BART): the article's mT5 as the shipped config builds it, the
target's length and the fused loss seen by the estimate, --fit's commands, and bad input in one line."""

from __future__ import annotations

import collections
import json
import re
import tarfile
from pathlib import Path

import pytest
import torch

from devtools.speed import host_components
from fabric_memory_recipes.planning.__main__ import main as estimate_main
from fabric_memory_recipes.planning.plan import Plan
from fabric_memory_recipes.planning.simulation import saved
from fabric_memory_recipes.planning.simulation.compiled import partition
from fabric_memory_recipes.planning.simulation.modelled import STRIDED_FALLBACK
from fabric_memory_recipes.planning.your_model import set_speed, step_calibration, step_time
from fabric_memory_recipes.planning.your_model.estimate import estimate, meta_user_model
from fabric_memory_recipes.planning.your_model.sets import UserPlanner

H200_LOG = Path(__file__).parents[3] / "results/published/h200/t5-attention-backend/log.txt"
TINY = {
    "t5": dict(model_type="t5", vocab_size=8192, d_model=64, d_ff=128, num_layers=2, num_heads=4, d_kv=16),
    "t5-one": dict(model_type="t5", vocab_size=512, d_model=64, d_ff=128, num_layers=1, num_heads=4, d_kv=16),
    "bart": dict(model_type="bart", vocab_size=512, d_model=64, encoder_layers=2, decoder_layers=2,
                 encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=128,
                 max_position_embeddings=128),
    "bert": dict(model_type="bert", vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, max_position_embeddings=128),
}  # fmt: skip


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("seq2seq-configs")
    for name, fields in TINY.items():
        (root / name).mkdir()
        (root / name / "config.json").write_text(json.dumps(fields))
    return {name: f"hf:{root / name}" for name in TINY}


def _json(capsys, argv: list[str]) -> dict:
    assert estimate_main([*argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_the_shipped_mt5_is_the_articles_582_million_parameters():
    """transformers 5 ties mT5's output layer to its embeddings; the config says it is its own, as in the
    model the article counted (582,401,280 trainable parameters)."""
    um, model, blocks, _ = meta_user_model("hf:examples/configs/mt5-base")
    assert um.task == "seq2seq_lm" and blocks == ("MT5Block",)
    assert sum(p.numel() for p in model.parameters()) == 582_401_280
    assert model.get_output_embeddings().weight is not model.get_input_embeddings().weight


def test_the_estimate_sees_the_target_length_and_the_fused_loss(tiny, capsys):
    argv = ["--model", tiny["t5"], "--seq-len", "32", "--batch-size", "8", "--mode", "eager"]
    short, long = (_json(capsys, [*argv, "--target-len", n]) for n in ("8", "64"))
    assert short["task"] == "seq2seq_lm" and (short["target_len"], long["target_len"]) == (8, 64)
    assert long["peak_allocated_gb"] > short["peak_allocated_gb"]  # the logits: target tokens x 8192
    fused = _json(capsys, [*argv, "--target-len", "64", "--fused-loss"])
    assert fused["peak_allocated_gb"] < long["peak_allocated_gb"]


def test_t5_self_attention_runs_math_in_an_eager_cuda_step_and_fused_in_compiled_blocks(tiny):
    """T5's position bias (heads last) is a mask CUDA's fused kernels refuse: an eager step runs its
    self-attention on math, its cross-attention (a contiguous mask) on the efficient kernel; --fit
    simulates fast mode's compiled blocks on their own, smaller, and bounds fast sets from that step."""
    um, model, blocks, _ = meta_user_model(tiny["t5"])
    plan = Plan(precision="bf16-mixed", micro_batch_size=2)
    assert estimate(model, um, plan, 32, target_len=8).kernels == ["efficient", STRIDED_FALLBACK]
    # checkpointed blocks with offloaded activations: the recompute gets the position bias back in its layout
    # (offload.py copies with empty_like), so it runs the same kernel as the forward
    plan = Plan(
        precision="bf16-mixed",
        micro_batch_size=2,
        activation_checkpointing=blocks,
        activation_offload=True,
        offload_min_bytes=0,
    )
    assert estimate(model, um, plan, 32, target_len=8).kernels == ["efficient", STRIDED_FALLBACK]
    planner = UserPlanner(tiny["t5"], 2, 32, target_len=8)
    eager, fast = (
        next(c for c in planner.choices if c.mode == m and not c.techniques.used) for m in ("eager", "fast")
    )
    assert planner.predict(fast).simulated_gb < planner.predict(eager).simulated_gb
    assert len(planner.simulated) == 2
    # --fit's bound of a fast set not simulated yet is scaled from the whole batch's step that fast mode is
    # predicted from (its compiled blocks'), not from the eager step's: no bound under what it bounds
    planner.plains = {c.plain: c for c in planner.choices if not c.techniques.used and not c.cpu_offload}
    half = planner.plains[(*fast.plain[:5], 1, 2)]  # micro-batch 1 x 2
    bound = set_speed.optimistic(planner, half)
    assert half.predicted_gb is None and planner.predict(half).images_per_s <= bound * (1 + 1e-9)


def test_t5_small_eager_step_keeps_what_the_h200_measured():
    """T5-small at batch 32 x 256 -> 64, bf16-mixed, one H200 (scripts/gpu/t5_attention_backend.sh): the
    forward kept 3,770,105,956 bytes for backward, and so does the simulated step: CUDA's dropout keeps a
    bool mask (the CPU's a noise tensor of the input's dtype: 226 MB more), and CUDA's cross-entropy keeps
    the bf16 log-probabilities and nll_loss's fp32 copy of them (131.6 MB that CPU autocast does not make)."""
    measured = int(re.search(r"eager step 2 saved (\d+)", H200_LOG.read_text()).group(1))
    um, model, blocks, _ = meta_user_model("hf:examples/configs/t5-small")
    est = estimate(model, um, Plan(precision="bf16-mixed", micro_batch_size=32), 256, target_len=64)
    assert est.activations_saved_bytes == measured == 3_770_105_956


def test_compiled_t5_blocks_keep_what_inductors_partition_keeps(tiny, monkeypatch):
    """Fast mode's compiled T5 blocks (not checkpointed) run as inductor partitions them: where the eager
    graph keeps the ReLU's bf16 output, fp32 copies of the self-attention's q, k, v and its dropped-out
    weights in fp32, the compiled blocks keep a bool mask of the ReLU and q, k, v in bf16, and recompute the
    rest in backward (T5-small on an H200: 2.52 GB kept where the eager blocks keep 3.77,
    docs/your_model.md)."""
    kept: list[collections.Counter] = []
    pack = saved.SimulatedSaves._pack

    def counting(self, t):
        if id(t.untyped_storage()) not in self._exclude and t.untyped_storage() not in self._seen:
            kept[-1][(tuple(t.shape), t.dtype)] += 1
        return pack(self, t)

    monkeypatch.setattr(saved.SimulatedSaves, "_pack", counting)
    um, model, blocks, _ = meta_user_model(tiny["t5-one"])
    b, src, tgt, ff = 2, 32, 8, 128
    steps = []
    for compiled in ((), blocks):
        kept.append(collections.Counter())
        plan = Plan(
            precision="bf16-mixed", micro_batch_size=b, compile=bool(compiled), compiled_blocks=compiled
        )
        steps.append(estimate(model, um, plan, src, target_len=tgt))
    (eager, fast), (eager_kept, fast_kept) = steps, kept
    assert fast.activations_saved_bytes < 0.8 * eager.activations_saved_bytes
    for tokens in (src, tgt):  # the encoder's and the decoder's feed-forward
        assert (
            eager_kept[((b, tokens, ff), torch.bfloat16)] and not fast_kept[((b, tokens, ff), torch.bfloat16)]
        )
        assert fast_kept[((b, tokens, ff), torch.bool)] == eager_kept[((b, tokens, ff), torch.bool)] + 1
    heads, head_dim = 4, 16
    qkv = ((b * heads, src, head_dim), (b * heads, head_dim, src))  # the encoder's self-attention
    assert sum(eager_kept[(s, torch.float32)] for s in qkv) == 3 and not any(
        fast_kept[(s, torch.float32)] for s in qkv
    )
    assert sum(fast_kept[(s, torch.bfloat16)] for s in qkv) == 3
    assert eager_kept[((b * heads, src, src), torch.float32)] == 1  # the dropped-out weights
    assert not fast_kept[((b * heads, src, src), torch.float32)]
    assert fast.kernels == eager.kernels == ["efficient", STRIDED_FALLBACK]


def test_fit_answers_for_bart_with_commands_that_keep_the_target_length(tiny, capsys):
    argv = ["--model", tiny["bart"], "--seq-len", "32", "--target-len", "16", "--batch-size", "4"]
    answer = _json(capsys, [*argv, "--fit", "4GB", "--top", "1"])
    assert answer["fits"] and answer["repeated_blocks"] == ["BartDecoderLayer", "BartEncoderLayer"]
    for row in answer["fits"]:
        assert "--target-len 16" in row["command"] and not row["fused_loss"]  # BART's bias: never fused


def test_bad_input_is_one_line_and_exit_2(tiny, capsys):
    cases = {
        "is an encoder-decoder's": ["--model", tiny["bert"], "--seq-len", "16", "--target-len", "8"],
        "a bias after its output projection": ["--model", tiny["bart"], "--seq-len", "16", "--fused-loss"],
        "has 128 positions": ["--model", tiny["bart"], "--seq-len", "16", "--target-len", "1000"],
    }
    for words, argv in cases.items():
        with pytest.raises(SystemExit) as e:
            estimate_main(argv)
        err = capsys.readouterr().err.strip()
        assert e.value.code == 2 and len(err.splitlines()) == 1 and words in err, (words, err)


def test_fit_predicts_a_fast_set_as_the_estimate_of_its_command(tiny, capsys):
    """--fit simulates an encoder-decoder's fast sets with the compiled blocks as inductor partitions them, as
    the estimate of the set's own command (and the run's) does; it simulated them as the eager graph."""
    planner = UserPlanner(tiny["t5-one"], 4, 32, target_len=16)
    fast = next(
        c
        for c in planner.choices
        if c.mode == "fast" and not c.techniques.used and not c.switched and c.rung.accumulation_steps == 1
    )
    planner.predict(fast)
    alone = _json(capsys, [*fast.argv(), "--gpu", "h100"])
    assert alone["assumptions"]["compile_modelled"] and "--mode" in fast.argv()
    assert fast.simulated_gb == pytest.approx(alone["peak_allocated_gb"], rel=5e-4)


def test_the_simulation_that_traces_a_compiled_block_counts_as_a_later_one(tiny, capsys, monkeypatch):
    """A block's trace kept the step's own inputs it was traced on, so the simulation that traced it held
    them to its end (T5-small with the fused loss: 35 MB more at its peak than the same step simulated next)."""
    monkeypatch.setattr(partition, "_TRACED", {})  # nothing traced yet in this process
    argv = ["--model", tiny["t5-one"], "--seq-len", "32", "--target-len", "16", "--batch-size", "4",
            "--precision", "bf16-mixed", "--mode", "fast", "--fused-loss", "--gpu", "h100"]  # fmt: skip
    first, second = (_json(capsys, argv) for _ in range(2))
    assert first["assumptions"]["compile_modelled"]
    assert first["peak_allocated_gb"] == second["peak_allocated_gb"]


def test_the_speed_calibration_simulates_a_runs_target_length(tiny):
    """A committed encoder-decoder run is timed with its own target tokens (``--target-len``), as it trained:
    the step-time calibration and devtools/speed/host_components.py simulate those, not ``seq_len`` of them."""
    config = {"model": tiny["t5"], "precision": "bf16-mixed", "batch_size": 4, "seq_len": 32}
    flops = {}
    for target in (8, 32):
        run = step_calibration.Run(
            "run.json", "your_model", tiny["t5"], "fast", {**config, "target_len": target}, 0.1, 1
        )
        flops[target] = step_calibration.run_costs(run).model_flops
    assert flops[8] < 0.8 * flops[32]


def test_host_components_prints_a_runs_terms_which_add_up_to_its_prediction(tiny, tmp_path, capsys):
    """devtools/speed/host_components.py on a committed run inside an archive: its terms are the model's (the
    predicted step is the calibration's prediction, the queue at least the host's sum) and its measured step."""
    config = {"model": tiny["t5"], "precision": "bf16-mixed", "batch_size": 4, "seq_len": 32, "target_len": 8}
    config |= {"mode": "fast", "compile": True}
    payload = {"recipe": "your_model", "status": "ok", "config": config, "timing": {"median_step_s": 0.1}}
    payload["provenance"] = {"gpu_name": "NVIDIA H100 80GB HBM3"}
    (tmp_path / "runs" / "a").mkdir(parents=True)
    (tmp_path / "runs" / "a" / "your_model.json").write_text(json.dumps(payload))
    with tarfile.open(tmp_path / "runs.tgz", "w:gz") as tar:
        tar.add(tmp_path / "runs", arcname="runs")
    assert host_components.main([str(tmp_path / "runs.tgz")]) == 0
    title, line = capsys.readouterr().out.splitlines()
    assert title.endswith("runs/a/your_model.json (h100, fast)")
    terms = {k: float(v) for k, v in (t.split(" ") for t in line.strip().split(", "))}
    run = step_calibration.Run("run.json", "your_model", tiny["t5"], "fast", config, 0.1, 1)
    expected = step_calibration.predicted_s(
        run, step_calibration.run_costs(run), step_time.ceilings("h100")[0]
    )
    assert terms["predicted_ms"] == pytest.approx(1e3 * expected, abs=0.05) and terms["measured_ms"] == 100.0
    assert terms["mb0_kernels"] > 0 and terms["mb0_queue_ms"] >= terms["mb0_host_ms"] > 0


def test_host_components_adds_a_sharded_runs_collectives_and_its_fsdp1_offload(tiny, tmp_path, capsys):
    """A sharded run (``--fsdp --devices 2 --cpu-offload``, eager: FSDP1), as docs/your_model.md predicts the
    committed ones again: the step plus FSDP's collectives over the whole model's parameters (a sharded run
    records its shard's count) and the CPU offload at FSDP1's rate, as --fit prices them."""
    config = {"model": tiny["t5"], "precision": "bf16-mixed", "batch_size": 4, "seq_len": 32, "target_len": 8}
    config |= {"mode": "eager", "compile": False, "fsdp": True, "devices": 2, "cpu_offload": True}
    payload = {"recipe": "your_model", "status": "ok", "config": config, "timing": {"median_step_s": 0.1}}
    payload["provenance"] = {"gpu_name": "NVIDIA H100 80GB HBM3", "parameters": 1}
    (tmp_path / "your_model.json").write_text(json.dumps(payload))
    assert host_components.main([str(tmp_path / "your_model.json")]) == 0
    _, line = capsys.readouterr().out.splitlines()
    terms = {k: float(v) for k, v in (t.split(" ") for t in line.strip().split(", "))}
    _, model, _, _ = meta_user_model(tiny["t5"])
    n = sum(p.numel() for p in model.parameters())
    comms = set_speed.collective_seconds(n, n, 2, "bf16-mixed", 1)
    offload = set_speed.offload_seconds(n, 2, "adamw", fsdp2=False)
    assert offload > set_speed.offload_seconds(n, 2, "adamw", fsdp2=True)  # FSDP1's slower rate, not FSDP2's
    assert terms["collectives_ms"] == pytest.approx(1e3 * comms, abs=0.05)
    assert terms["cpu_offload_ms"] == pytest.approx(1e3 * offload, abs=0.05)
    run = step_calibration.Run("run.json", "your_model", tiny["t5"], "eager", config, 0.1, 1)
    step = step_calibration.predicted_s(run, step_calibration.run_costs(run), step_time.ceilings("h100")[0])
    assert terms["predicted_ms"] == pytest.approx(1e3 * (step + comms + offload), abs=0.1)
