"""The step-time model: the op-cost collector (planning/simulation/costs.py) against hand-counted FLOPs
and bytes, checkpointing's recompute, fast against eager, and the stored calibration
(fabric_memory_recipes/data/step_time.json) against the committed runs it names
(planning/your_model/step_time.py, step_calibration.py)."""

from __future__ import annotations

import dataclasses
import json
import statistics
import tarfile

import pytest
import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from fabric_memory_recipes import planning
from fabric_memory_recipes.measurement import results_file
from fabric_memory_recipes.measurement.results_file import PEAK_BF16_FLOPS
from fabric_memory_recipes.planning.planner.calibration import REPO
from fabric_memory_recipes.planning.simulation.costs import OpCosts
from fabric_memory_recipes.planning.your_model import step_calibration, step_time
from fabric_memory_recipes.planning.your_model.estimate import meta_user_model
from tests.tiny import HF_BERT, causal_lm_config

F32 = 4


class Block(nn.Module):
    """A linear layer and a tail of pointwise ops (what fast mode fuses)."""

    def __init__(self, width: int = 64, pointwise: int = 0) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)
        self.pointwise = pointwise

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.linear(x)
        for _ in range(self.pointwise):
            x = torch.sigmoid(x) * x + 1.0
        return x


def simulated(model: nn.Module, batch: int = 8, width: int = 64, **plan) -> tuple[planning.Estimate, OpCosts]:
    collector = OpCosts(("Block",))  # fast mode compiles the Blocks: their ops fuse
    plan = planning.Plan(device="cpu", optimizer_impl="foreach", micro_batch_size=batch, **plan)
    est = planning.simulate(
        model,
        plan,
        make_batch=lambda: (torch.empty(batch, width),),
        batch_fn=lambda m, b: (m(b[0]).pow(2).mean(),),
        op_costs=collector,
    )
    return est, collector


def test_the_collector_counts_a_linears_flops_and_bytes():
    linear = nn.Linear(8, 16)
    collector = OpCosts()
    with FakeTensorMode(allow_non_fake_inputs=True), collector:
        x = torch.empty(4, 8)
        collector.section = (0, "forward")
        y = linear(x)
        collector.section = (0, "backward")
        y.backward(torch.ones_like(y))
    forward = [r for r in collector.ops[(0, "forward")] if r.kernels]
    assert [r.name for r in forward] == ["addmm"]  # the weight's transpose is a view: no kernel
    (addmm,) = forward
    assert addmm.flops == 2 * 4 * 8 * 16 and addmm.matmul and not addmm.low_precision
    assert addmm.bytes == F32 * (16 + 4 * 8 + 8 * 16 + 4 * 16)  # bias, input, weight read; output written
    backward = [r for r in collector.ops[(0, "backward")] if r.flops]
    assert [r.name for r in backward] == ["mm"]  # the input needs no gradient: only the weight's
    assert backward[0].flops == 2 * 4 * 8 * 16 and not backward[0].recompute
    assert collector.model_flops(0) == 2 * 2 * 4 * 8 * 16


def test_checkpointing_recomputes_the_forward_ops_in_backward_and_the_estimate_is_unchanged():
    model = nn.Sequential(Block(pointwise=2), Block(pointwise=2))
    plain_est, plain = simulated(model)
    ckpt_est, ckpt = simulated(model, activation_checkpointing=("Block",))
    block = [r.name for r in ckpt.ops[(0, "forward")] if r.kernels][:7]
    assert block == ["addmm", "sigmoid", "mul", "add", "sigmoid", "mul", "add"]
    runs, run = [], []  # the recomputed ops, block by block (backward meets the second block first)
    for r in ckpt.ops[(0, "backward")]:
        if r.recompute and r.kernels:
            run.append(r.name)
        elif run and r.kernels:
            runs, run = [*runs, run], []
    # each block runs its forward again up to the last tensor its backward needs (checkpoint's early stop)
    assert runs == [block[:5], block[:5]]
    recomputed = [r for r in ckpt.of(0) if r.recompute]
    assert sum(r.flops for r in recomputed) == 2 * 2 * 8 * 64 * 64  # each block's addmm again
    assert sum(r.flops for r in ckpt.of(0)) == sum(r.flops for r in plain.of(0)) + sum(
        r.flops for r in recomputed
    )
    assert ckpt.model_flops(0) == plain.model_flops(0) > 0  # model FLOPs leave the recompute out
    assert ckpt.module_calls(0) == plain.module_calls(0) + 2  # each block is called again
    assert not any(r.recompute for r in plain.of(0))
    # the collector changes no estimate
    for with_costs, plan in ((plain_est, {}), (ckpt_est, {"activation_checkpointing": ("Block",)})):
        without = planning.simulate(
            model,
            planning.Plan(device="cpu", optimizer_impl="foreach", micro_batch_size=8, **plan),
            make_batch=lambda: (torch.empty(8, 64),),
            batch_fn=lambda m, b: (m(b[0]).pow(2).mean(),),
        )
        assert (with_costs.peak_gb, with_costs.components_gb) == (without.peak_gb, without.components_gb)


def test_accumulation_records_a_later_micro_batch_and_the_optimizer_bytes():
    model = nn.Sequential(Block(), Block())
    _, collector = simulated(model, accumulation_steps=4, optimizer="adamw")
    costs = step_time.costs_of(collector, planning.Plan(accumulation_steps=4))
    assert len(costs.micro) == 2 and costs.model_flops == 4 * collector.model_flops(0)
    weights = sum(p.numel() for p in model.parameters()) * F32
    assert collector.optimizer == {
        "parameter_bytes": weights,
        "gradient_bytes": weights,
        "state_bytes": 2 * weights,
        "tensors": 4,
        "in_backward": False,
    }
    c, _ = step_time.ceilings("h100")
    one, _ = step_time.step_seconds(step_time.costs_of(collector, planning.Plan()), c)
    four, detail = step_time.step_seconds(costs, c)
    assert four == pytest.approx(
        detail["per_micro_batch_s"][0] + 3 * detail["per_micro_batch_s"][1] + detail["optimizer_s"]
    )
    assert four > one
    _, two = simulated(
        model, accumulation_steps=2, optimizer="adamw"
    )  # later micro-batches repeat the second
    again = step_time.costs_of(two, planning.Plan(accumulation_steps=2)).with_accumulation(4)
    assert (
        step_time.step_seconds(again, c)[0] == pytest.approx(four) and again.model_flops == costs.model_flops
    )
    with pytest.raises(ValueError, match="later micro-batch"):
        step_time.costs_of(collector, planning.Plan()).with_accumulation(2)


def test_fast_mode_is_faster_than_eager_for_a_pointwise_heavy_block():
    model = nn.Sequential(Block(width=256, pointwise=64))  # enough ops that eager's host outweighs 3 calls
    _, collector = simulated(model, batch=512, width=256)
    calls = step_time.fast_calls(model, ("Block",), checkpointed=False)
    assert calls == 3  # the block's region, its compiled autograd function, its backward
    costs = step_time.costs_of(collector, planning.Plan(), compiled_calls=calls)
    c, _ = step_time.ceilings("h100")
    eager, _ = step_time.step_seconds(costs, c, "eager")
    fast, _ = step_time.step_seconds(costs, c, "fast")
    graphs, _ = step_time.step_seconds(costs, c, "fast", graphs=True)
    assert graphs < fast < eager
    # with nothing to fuse and no launch cost fast and eager are the same
    free = dataclasses.replace(
        c, fusion=1.0, kernel_s=0.0, python_op_s=0.0, module_s=0.0, autograd_op_s=0.0, compiled_call_s=0.0
    )
    assert step_time.step_seconds(costs, free, "fast")[0] == pytest.approx(
        step_time.step_seconds(costs, free, "eager")[0]
    )
    # fast mode's host time is its compiled calls' (the GPU's share left out): calls x L_call
    host_only = dataclasses.replace(c, matmul_flops=1e30, bandwidth=1e30, kernel_s=0.0)
    micro = costs.micro[0]
    assert micro.host_times(host_only, "fast").sum() == pytest.approx(calls * c.compiled_call_s)
    assert step_time.step_seconds(costs, host_only, "fast")[1]["per_micro_batch_s"][0] == pytest.approx(
        calls * c.compiled_call_s
    )


def test_fast_calls_follow_the_blocks_and_an_encoder_decoders_recompute():
    """3 compiled calls a block (region, compiled function, backward); an encoder-decoder's checkpointed
    block enters its region again for the recompute: 5 (the profiled rows of
    results/published/h200/encdec-step-profile/: Llama 32 blocks 96, T5-small 12 blocks 60)."""
    from transformers import T5Config, T5ForConditionalGeneration

    with torch.device("meta"):
        t5 = T5ForConditionalGeneration(T5Config(vocab_size=64, d_model=16, d_kv=4, d_ff=32, num_layers=2,
                                                 num_heads=4))  # fmt: skip
    assert step_time.fast_calls(t5, ("T5Block",), checkpointed=True) == 4 * 5  # 2 encoder + 2 decoder blocks
    assert step_time.fast_calls(t5, ("T5Block",), checkpointed=False) == 4 * 3
    stack = nn.Sequential(Block(width=8, pointwise=1), Block(width=8, pointwise=1))
    assert step_time.fast_calls(stack, ("Block",), checkpointed=True) == 2 * 3  # not an encoder-decoder
    assert step_time.fast_calls(stack, (), checkpointed=True) == 0  # nothing compiled


def test_fast_mode_with_eager_blocks_and_no_graphs_runs_at_eager_speed():
    """Fast mode whose blocks are not compiled (too many distinct graphs, or BatchNorm) and whose step is not
    captured (the step in backward) issues every op as eager mode does: Swin-V2-T's such set measured 285.5
    samples/s where fast mode's per-op host cost predicted 671.9 (results/published/h200/ranking-check/)."""
    _, collector = simulated(nn.Sequential(Block(width=64, pointwise=8)), batch=8, width=64)
    costs = step_time.costs_of(collector, planning.Plan())
    c, _ = step_time.ceilings("h100")
    eager, _ = step_time.step_seconds(costs, c, "eager")
    unfused, _ = step_time.step_seconds(costs, c, "fast", graphs=False, fused=False)
    compiled, _ = step_time.step_seconds(costs, c, "fast", graphs=False, fused=True)
    assert unfused == pytest.approx(eager) and compiled < eager  # a small, host-bound step
    micro = costs.micro[0]
    assert micro.floor_seconds(c, "fast", False, fused=False) == pytest.approx(
        micro.floor_seconds(c, "eager", False)
    )
    # with CUDA graphs the host is out of the step whether the blocks were compiled or not
    graphs, _ = step_time.step_seconds(costs, c, "fast", graphs=True, fused=False)
    assert graphs < unfused


def test_the_step_in_backward_queues_its_hooks_with_the_backward_pass():
    """The step in backward issues each parameter's update from the backward pass: its hooks' host time joins
    that pass's queue, so a GPU-bound pass hides them and a host-bound one adds them whole (TinyLlama 1.1 B's
    such set on an H200 was predicted 47 % slow with the hooks added after the passes:
    results/published/h200/ranking-check/NOTES.md); the updates' GPU time stays after the pass."""
    model = nn.Sequential(Block(width=256, pointwise=2), Block(width=256, pointwise=2))
    _, collector = simulated(model, batch=64, width=256, optimizer="adamw", optimizer_in_backward=True)
    costs = step_time.costs_of(collector, planning.Plan(optimizer_in_backward=True))
    assert costs.optimizer["in_backward"] and costs.optimizer["tensors"] == 4
    c, _ = step_time.ceilings("h100")
    plain = dataclasses.replace(costs, optimizer={**costs.optimizer, "in_backward": False})
    for ceilings in (
        dataclasses.replace(c, matmul_flops=1e9, kernel_s=0.0),  # the GPU's matmuls outlast every hook
        dataclasses.replace(c, matmul_flops=1e30, bandwidth=1e30, kernel_s=0.0),  # the host alone
    ):
        hooked, detail = step_time.step_seconds(costs, ceilings)
        alone, other = step_time.step_seconds(plain, ceilings)
        updates, hooks = other["optimizer_s"], 4 * ceilings.hook_s
        assert detail["optimizer_s"] == pytest.approx(updates) and hooked >= alone
        assert hooked == pytest.approx(
            sum(detail["per_micro_batch_s"]) + updates + detail["step_in_backward_s"]
        )
        if ceilings.matmul_flops == 1e9:  # hidden under the backward pass's GPU work
            assert hooked == pytest.approx(alone) and detail["step_in_backward_s"] < hooks / 1e3
        else:  # issued between the backward pass's ops, each whole
            assert hooked == pytest.approx(alone + hooks)
    # under CUDA graphs the step is captured with the passes: no hooks on the host
    graphs, detail = step_time.step_seconds(costs, c, "fast", graphs=True)
    assert detail["step_in_backward_s"] == 0.0 and detail["optimizer_s"] > 0.0


def test_mfu_is_model_flops_over_time_against_the_datasheet_peak():
    assert step_time.mfu(PEAK_BF16_FLOPS["H100"] * 0.25, 0.5, "h100") == pytest.approx(0.5)
    assert step_time.mfu(1e12, 1.0, "no-such-gpu") is None


def test_predict_step_s_of_a_user_model_gives_its_flops_and_mfu():
    um, model, blocks, _ = meta_user_model("torchvision:resnet18")
    plan = planning.Plan(precision="bf16-mixed", micro_batch_size=32, optimizer="adamw")
    eager, detail = step_time.predict_step_s(model, um, plan, 0, "h100", "eager")
    fast, fast_detail = step_time.predict_step_s(model, um, plan, 0, "h100", "fast")
    assert 0 < fast < eager
    # a vision model: graphs, as the runner does; ResNet's blocks hold BatchNorm, so the runner compiles none
    assert fast_detail["mode"] == "fast (CUDA graphs) (blocks not compiled)"
    macs = 1.82e9  # ResNet-18's multiply-adds per 224 x 224 image (its model card)
    assert detail["model_flops_per_step"] == pytest.approx(
        32 * 3 * 2 * macs, rel=0.1
    )  # forward + 2 x backward
    assert detail["mfu"] == pytest.approx(step_time.mfu(detail["model_flops_per_step"], eager, "h100"))
    assert "fitted on" in detail["ceilings_source"]


# ---------------------------------------------------------------------------- the stored calibration
def stored() -> dict:
    return step_time.load_calibration()["kinds"]["h100"]


def test_the_stored_calibration_states_its_errors_and_holds_its_target_on_most_runs():
    entry = stored()
    core = [r for r in entry["runs"] if r["fitted"] and r["fitted_for"] != "host_bandwidth"]
    assert len(core) >= 40 and len({r["model"] for r in core}) >= 8  # 4 vision, 4 text models
    errors = sorted(abs(r["error"]) for r in core)
    summary = entry["summary"]["fitted"]
    assert summary["max_abs_error"] == pytest.approx(errors[-1], abs=1e-4)
    assert summary["within_25_percent"] == sum(e <= 0.25 for e in errors) >= 0.9 * len(core)
    assert summary["median_abs_error"] <= 0.15
    for row in entry["runs"]:  # every run it names is committed and measured what the table says
        medians = [json.loads((REPO / path).read_text())["timing"]["median_step_s"] for path in row["paths"]]
        assert row["measured_s"] == pytest.approx(statistics.median(medians))
        assert row["error"] == pytest.approx(row["measured_s"] / row["predicted_s"] - 1, abs=1e-3)


@pytest.mark.parametrize(
    "configuration",
    [
        "hf:examples/configs/bert-base-uncased eager your_model precision=bf16-true",
        "vit_l_16 graphs 12_optimizer_in_backward",
    ],
)
def test_the_stored_calibration_reproduces_its_predictions(configuration):
    entry = stored()
    (row,) = [r for r in entry["runs"] if r["configuration"].startswith(configuration)]
    runs = [r for r in step_calibration.read_runs("h100") if r.path in row["paths"]]
    costs = step_calibration.run_costs(runs[0])
    c = step_time.Ceilings(**entry["ceilings"])
    predicted = step_calibration.predicted_s(runs[0], costs, c)
    assert predicted == pytest.approx(row["predicted_s"], rel=1e-4)
    assert abs(row["measured_s"] / predicted - 1) <= entry["summary"]["fitted"]["max_abs_error"] + 1e-4


def test_step_times_docstring_shows_the_stored_table():
    """The accuracy table in planning/your_model/step_time.py's docstring is the stored one (after a
    ``step_calibration --write``, paste ``notes_lines`` there)."""
    doc = [line.strip() for line in step_time.__doc__.splitlines()]
    for line in step_calibration.notes_lines(stored()):
        assert line.strip() in doc, line
    summary = stored()["summary"]
    fitted, held_out = summary["fitted"], summary["leave_one_model_out"]
    assert f"median |error| {fitted['median_abs_error']:.0%}".replace("%", " %") in step_time.__doc__.replace(
        "\n", " "
    )
    assert f"max {held_out['max_abs_error']:.0%}".replace("%", " %") in step_time.__doc__


def test_the_calibration_without_runs_fails_in_one_line(monkeypatch, capsys):
    monkeypatch.setattr(step_calibration, "read_runs", lambda gpu: [])
    with pytest.raises(SystemExit) as stop:
        step_calibration.main(["--gpu", "h100"])
    err = capsys.readouterr().err
    assert stop.value.code == 2 and len(err.strip().splitlines()) == 1 and "from a checkout" in err


def test_the_calibration_reads_runs_committed_inside_archives(tmp_path):
    """A RUN_GLOBS entry ``ARCHIVE-GLOB:MEMBER-PATTERN`` reads the results JSONs the pattern names inside
    each archive, and only those (the h200 runs are committed as .tgz only)."""
    run = {
        "status": "ok",
        "recipe": "your_model",
        "config": {"model": "hf:examples/configs/t5-small", "compile": True},
        "timing": {"median_step_s": 0.1, "timed_intervals": 9},
        "provenance": {"gpu_name": "NVIDIA H200", "world_size": 1},
    }
    for member in ("runs/a-timed/your_model.json", "runs/a-profiled/your_model.json"):
        (tmp_path / member).parent.mkdir(parents=True)
        (tmp_path / member).write_text(json.dumps(run))
    (tmp_path / "published").mkdir()
    with tarfile.open(tmp_path / "published" / "runs.tgz", "w:gz") as tar:
        tar.add(tmp_path / "runs", arcname="runs")
    found = list(results_file.results_of("published/*.tgz:runs/*-timed/your_model.json", tmp_path))
    assert [name for name, _ in found] == ["published/runs.tgz:runs/a-timed/your_model.json"]
    assert found[0][1] == run
    assert [r.path for r in step_calibration.read_runs("h200", REPO)][-1].endswith(
        "swin_fast_probe.tgz:swin_fast_probe/runs/fast/your_model.json"
    )


def test_a_run_whose_step_was_not_captured_is_fitted_as_run_without_its_graph(tmp_path, monkeypatch):
    """BLOOM's graph sets ran without their graph (the capture refused: results ``cuda_graphs.not_captured``):
    the fit prices them as fast mode without CUDA graphs, as they ran."""
    base = {"status": "ok", "recipe": "your_model", "timing": {"median_step_s": 0.1},
            "config": {"model": "hf:examples/configs/bloom-560m", "compile": True, "cuda_graphs": True},
            "provenance": {"gpu_name": "NVIDIA H200", "world_size": 1}}  # fmt: skip
    refused = {**base, "extra": {"cuda_graphs": {"graphs": 0, "not_captured": "Cannot copy ... capture"}}}
    for name, run in (("a", base), ("b", refused)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "your_model.json").write_text(json.dumps(run))
    monkeypatch.setitem(step_calibration.RUN_GLOBS, "h200", ("*/your_model.json",))
    runs = step_calibration.read_runs("h200", tmp_path)
    assert [(r.mode, r.config["cuda_graphs"]) for r in runs] == [("graphs", True), ("fast", False)]


def test_the_stored_h200_kind_is_physical_and_plans_for_an_h200():
    """An h200 plan takes h200's ceilings, fitted on the committed H200 runs (vision and text, eager, compiled
    blocks and CUDA graphs) within the datasheet's peaks: fusion a share (at most 1, at least what a profile measured), the bandwidth and the
    matrix FLOP/s below an H200's 4.8 TB/s and 989 TFLOP/s (the unbounded fit went to 39 TB/s at fusion 9.2)."""
    entry = step_time.load_calibration()["kinds"]["h200"]
    c, source = step_time.ceilings("h200")
    assert c == step_time.Ceilings(**entry["ceilings"]) and source.startswith("h200: fitted on")
    assert step_calibration.LOWER["fusion"] <= c.fusion <= step_calibration.UPPER["fusion"]
    assert c.bandwidth < 4.8e12 and c.matmul_flops < 989e12
    core = [r for r in entry["runs"] if r["fitted"] and r["fitted_for"] != "host_bandwidth"]
    modes = {r["mode"] for r in core}
    assert len(core) >= 30 and modes == {"eager", "fast", "graphs"}
    assert any(r["model"].startswith("hf:") for r in core) and any(r["model"] == "vit_l_16" for r in core)
    # the kernel terms' rates below the plain ones, as the profile measured them (step_time.py's docstring)
    assert c.statistics_bandwidth < c.bandwidth and c.strided_bandwidth < c.bandwidth
    assert c.unaligned_flops < c.matmul_flops
    # 0.14 on 38 configurations; 0.152 on 55 (the ranking checks added); 0.083 with the kernel terms; 0.103 on 68
    # (the five held-out models fitted too: RegNetY's grouped convolutions +35 to +57 %, TinyLlama -21 to -27 %);
    # 0.132 on 89 (the second out-of-sample check's models, Phi-1.5, Qwen2-1.5B fitted too), 0.135 with the measured
    # matrix products (gemm_rates.py; their gain is out of sample: docs/your_model.md, "Matrix products by shape")
    assert entry["summary"]["fitted"]["median_abs_error"] <= 0.14
    assert c.gemm_table == "h200"  # its products' rates by shape, measured on an H200
    # 3.68 while Swin-V2-T was priced fused, 0.97 before the ranking checks were added, 0.66 after, 1.03 with
    # the kernel terms (Swin-V2-T held out: no other model's strided bytes set B_str), 1.08 on 89 (ShuffleNetV2)
    assert entry["summary"]["leave_one_model_out"]["max_abs_error"] <= 1.1
    assert step_time.ceilings("a100")[1].startswith("no a100 runs: h100")  # a kind without runs: h100's


@pytest.mark.parametrize("gpu", sorted(step_calibration.DATASHEET))
def test_every_stored_kinds_rates_are_within_its_datasheet(gpu):
    """The fit bounds each rate by its kind's datasheet (an unbounded h100 fit put B at 5.7 TB/s, above an
    H100 SXM's 3.35, trading it against fusion and g_graph); a kind without a datasheet entry is unbounded."""
    c, _ = step_time.ceilings(gpu)
    bandwidth, flops = step_calibration.DATASHEET[gpu]
    assert max(c.bandwidth, c.statistics_bandwidth, c.strided_bandwidth) <= bandwidth * (1 + 1e-6)
    assert max(c.matmul_flops, c.unaligned_flops) <= flops * (1 + 1e-6)
    upper = step_calibration.upper_of(gpu)
    assert upper["fusion"] == 1.0 and upper["strided_bandwidth"] == bandwidth
    unknown = step_calibration.upper_of("a100")
    assert unknown == step_calibration.upper_of(None) and unknown["bandwidth"] == float("inf")


@pytest.mark.parametrize(("model", "compiled"), [("torchvision:resnet18", False), ("timm:test_vit", True)])
def test_a_run_is_priced_as_the_runner_ran_its_fast_mode(model, compiled):
    """The fit prices a fast run's memory-bound ops at the fusion share only where the runner compiled its
    blocks (models.compilable): not ResNet's, which hold BatchNorm, nor Swin-V2-T's, whose 12 blocks would
    need 12 graphs; priced as fused, those held the h200 fit's share at its bound of 1."""
    config = {"model": model, "batch_size": 2, "mode": "fast", "compile": True, "cuda_graphs": True}
    run = step_calibration.Run("x.json", "your_model", model, "graphs", config, 0.01, 1)
    costs = step_calibration.run_costs(run)
    assert costs.compiled is compiled
    c = dataclasses.replace(step_time.ceilings("h100")[0], fusion=0.5)
    as_run = step_time.step_seconds(costs, c, "fast", graphs=True, fused=compiled)[0]
    assert step_calibration.predicted_s(run, costs, c) == as_run
    assert as_run != step_time.step_seconds(costs, c, "fast", graphs=True, fused=not compiled)[0]


def test_fast_mode_prices_a_causal_lms_step_in_cuda_graphs_and_a_classifiers_without(tmp_path):
    """As the runner captures them (runner.checked): a causal LM's fast step in one CUDA graph, a text
    classifier's compiled blocks alone (its batch reads its padding on the host)."""
    modes = {}
    for name, config in (("lm", causal_lm_config()), ("bert", HF_BERT)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps(config))
        um, model, blocks, _ = meta_user_model(f"hf:{tmp_path / name}")
        plan = planning.Plan(precision="bf16-mixed", micro_batch_size=2, optimizer="adamw")
        _, detail = step_time.predict_step_s(model, um, plan, 32, "h100", "fast", blocks=blocks)
        modes[um.task] = detail["mode"]
    assert modes == {"causal_lm": "fast (CUDA graphs)", "classification": "fast"}
