"""devtools.speed.rung_profile's summary on a CPU: kernels sorted into kinds and phases from a Chrome trace
written here (the GPU call is what it is for), and the model's FLOPs by kind; devtools.speed.trace_kernels's
kernels, gaps and BatchNorm pass rates read from such a trace."""

from __future__ import annotations

import gzip
import json
import sys
import tarfile

import pytest
import torch
import torch._dynamo
import torch._inductor.config as inductor_config

from devtools.speed import host_components, rung_profile, trace_kernels

H100_KERNELS = {  # names as an H100 trace spells them -> kind
    "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x256x64_warpgroupsize2x1x1_execute_segment_k_off_kernel__5x_cublas": "linear matmul",
    "nvjet_tst_256x128_64x4_2x1_v_bz_coopA_TNT": "linear matmul",
    "void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<64, 128, 128, 4, false, false, cutlass::bfloat16_t>>": "attention",
    "cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_3_64x64x128_4x1x1_kernel0_0": "attention",
    "sm90_xmma_fprop_implicit_gemm_bf16bf16_bf16f32_f32_nhwckrsc_nhwc_tilesize128x128x64": "patch convolution",
    "triton_red_fused_add_native_layer_norm_3": "triton reduction (layernorm, softmax, loss)",
    "triton_poi_fused_gelu_view_4": "triton pointwise (gelu, adds, casts, copies)",
    "void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<float>>": "aten elementwise / reduce",
    "void at::native::multi_tensor_apply_kernel<FusedAdamMathFunctor<c10::BFloat16, 4>>": "optimizer (fused)",
}


@pytest.mark.parametrize("name", sorted(H100_KERNELS))
def test_kernels_are_sorted_by_kind(name):
    assert rung_profile.kind_of(name, "kernel") == H100_KERNELS[name]


def _trace(tmp_path, events) -> str:
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"traceEvents": [{"ph": "X", **e} for e in events]}))
    return str(path)


def test_the_summary_splits_a_step_by_kind_phase_and_idle_time(tmp_path):
    """Two steps of 10 ms on the GPU: a matrix product and an attention kernel launched in forward, a
    LayerNorm backward in backward, a copy launched outside the phases, and 2 ms of idle GPU per step."""
    events = []
    for step in range(2):
        t = 100_000 + 20_000 * step  # us; host ranges and GPU kernels on one clock, as kineto writes them
        events += [
            {"cat": "user_annotation", "name": "## forward ##", "ts": t, "dur": 1000},
            {"cat": "user_annotation", "name": "## backward ##", "ts": t + 1000, "dur": 1000},
            {"cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": t + 10, "dur": 5, "args": {"correlation": 10 * step + 1}},
            {"cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": t + 20, "dur": 5, "args": {"correlation": 10 * step + 2}},
            {"cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": t + 1500, "dur": 5, "args": {"correlation": 10 * step + 3}},
            {"cat": "cuda_runtime", "name": "cudaMemcpyAsync", "ts": t + 3000, "dur": 5, "args": {"correlation": 10 * step + 4}},
            {"cat": "kernel", "name": "nvjet_tst_256x128", "ts": t + 2000, "dur": 4000, "args": {"correlation": 10 * step + 1}},
            {"cat": "kernel", "name": "flash_fwd_kernel", "ts": t + 6000, "dur": 1000, "args": {"correlation": 10 * step + 2}},
            {"cat": "kernel", "name": "triton_red_fused_native_layer_norm_backward_0", "ts": t + 9000, "dur": 2000, "args": {"correlation": 10 * step + 3}},
            {"cat": "gpu_memcpy", "name": "Memcpy HtoD (Pinned -> Device)", "ts": t + 11000, "dur": 1000, "args": {"correlation": 10 * step + 4}},
            {"cat": "cpu_op", "name": "CompiledFunction", "ts": t, "dur": 900},
            {"cat": "cuda_runtime", "name": "cudaStreamSynchronize", "ts": t + 1100, "dur": 1500},  # .item()
        ]  # fmt: skip
    flops = {"linear matmul": 8e9, "attention": 1e9}
    text, data = rung_profile.summarise(_trace(tmp_path, events), 2, flops, "a test")
    # GPU span: the first step's first kernel to the second step's last: 20 + 10 ms = 30 ms over 2 steps
    assert data["step_ms"] == pytest.approx(15.0)
    assert data["busy_ms"] == pytest.approx(8.0)  # 4 + 1 + 2 + 1 ms of work per step
    assert data["idle_ms"] == pytest.approx(7.0)  # 2 ms inside each step, and the 10 ms between them
    assert data["ms_by_kind"] == pytest.approx({"linear matmul": 4.0, "attention": 1.0, "copies (memcpy)": 1.0,
                                                "triton reduction (layernorm, softmax, loss)": 2.0})  # fmt: skip
    phases = data["ms_by_kind_and_phase"]
    assert phases["linear matmul"] == {"forward": 4.0} and phases["attention"] == {"forward": 1.0}
    assert phases["triton reduction (layernorm, softmax, loss)"] == {"backward": 2.0}
    assert phases["copies (memcpy)"] == {"outside phases": 1.0}
    assert data["compiled_calls_per_step"] == 1.0
    assert data["kernel_launches_per_step"] == 3.0  # the copy is no kernel
    assert data["host_waits_per_step"] == 2.0  # the synchronisation and the copy
    assert data["host_wait_ms_per_step"] == pytest.approx(1.505)
    assert "Host: 3 kernel launches per step; 2.0 calls per step" in text
    assert "| linear matmul | 4.00 | 26.7 |" in text
    assert "| linear matmul | 0.01 | 4.00 | 2 |" in text  # 8 GFLOP in 4 ms: 2 TFLOP/s


def test_kernels_of_a_cuda_graph_are_the_graphs(tmp_path):
    events = [
        {"cat": "user_annotation", "name": "## forward ##", "ts": 0, "dur": 100},
        {"cat": "cuda_runtime", "name": "cudaGraphLaunch", "ts": 10, "dur": 5, "args": {"correlation": 7}},
        {"cat": "kernel", "name": "nvjet_tst", "ts": 50, "dur": 30, "args": {"correlation": 7}},
    ]
    _, data = rung_profile.summarise(_trace(tmp_path, events), 1, {}, "graph")
    assert data["ms_by_kind_and_phase"] == {"linear matmul": {"CUDA graph": 0.03}}


def test_the_models_flops_by_kind_add_up_to_the_recipes_count():
    kinds = rung_profile.model_flops("vit_tiny", 4)
    assert set(kinds) == {"linear matmul", "attention", "patch convolution"}
    assert kinds["linear matmul"] > kinds["attention"] > 0


def test_your_models_flops_are_left_out():
    """recipes/your_model.py's ``--model SOURCE:NAME``: no ladder model to count (the profile is still written)."""
    assert rung_profile.model_flops("hf:examples/configs/t5-small", 4) == {}


def test_a_knob_is_set_before_the_recipe_runs_with_its_own_flags(tmp_path, monkeypatch):
    monkeypatch.setattr(torch.backends.cudnn, "benchmark", False)
    monkeypatch.setattr("sys.argv", ["rung_profile"])
    monkeypatch.setattr("sys.path", list(sys.path))
    seen = tmp_path / "seen.json"
    recipe = tmp_path / "recipe.py"
    recipe.write_text(
        "import json, sys, torch, torch._inductor.config as c\n"
        f"json.dump([sys.argv[1:], torch.backends.cudnn.benchmark, c.coordinate_descent_tuning], open({str(seen)!r}, 'w'))\n"
    )
    # torch's own patch restores the setting: pytest's monkeypatch of a torch config module hides the entry
    # after the test, so that a later torch.compile fails (test_loop's evaluation test did)
    with inductor_config.patch(coordinate_descent_tuning=False):
        rung_profile.main(["--out", str(tmp_path), "--no-profile", "--knob", "cudnn-benchmark",
                           "--knob", "coordinate-descent", "--", str(recipe), "--max-steps", "3"])  # fmt: skip
    assert json.loads(seen.read_text()) == [["--max-steps", "3"], True, True]


def test_a_knob_leaves_torch_compile_working_for_later_tests():
    """The knob test above runs first in the suite's order; a compile afterwards must still work."""
    torch._dynamo.reset()
    assert inductor_config.get_config_copy()["coordinate_descent_tuning"] is False


def test_an_archive_with_a_json_list_beside_its_runs_is_read_past(tmp_path, capsys):
    """A committed probe archive holds an equivalence JSON (a list) beside its run: it is not a run."""
    (tmp_path / "probe").mkdir()
    (tmp_path / "probe" / "equivalence.json").write_text(json.dumps([{"step": 1}]))
    with tarfile.open(tmp_path / "probe.tgz", "w:gz") as tar:
        tar.add(tmp_path / "probe", arcname="probe")
    assert host_components.main([str(tmp_path / "probe.tgz")]) == 0
    assert capsys.readouterr().out == ""


# ----------------------------------------------------------------------- devtools.speed.trace_kernels
def _kernel(name, ts, dur):
    return {"cat": "kernel", "name": name, "ts": ts, "dur": dur}


TRACE = {
    "traceEvents": [
        {"cat": "cpu_op", "name": "aten::add", "ts": 0, "dur": 5},  # not the GPU's
        _kernel("void at::native::batch_norm_collect_statistics_channels_last_kernel<>", 10, 20),
        _kernel("void at::native::batch_norm_transform_input_channels_last_kernel<>", 31, 8),
        _kernel("nvjet_sm90_tst_192x128", 40, 30),
        {"cat": "gpu_memset", "name": "Memset", "ts": 1000, "dur": 2},  # after a host gap: not a short one
    ]
}


def test_summary_counts_busy_time_short_gaps_and_classes():
    events = trace_kernels.kernels(TRACE)
    assert [e["ts"] for e in events] == [10, 31, 40, 1000]
    s = trace_kernels.summary(events, steps=2)
    assert s["kernels"] == 2.0
    assert s["busy_ms"] == pytest.approx(60 / 1e3 / 2)
    assert s["short_gaps"] == 1.0  # two gaps of 1 us in two steps; the 930 us one is the host's
    assert s["mean_short_gap_us"] == pytest.approx(1.0)
    assert s["short_gap_ms"] == pytest.approx(2 / 1e3 / 2)
    assert s["by_class"]["matmul"] == {"kernels": 0.5, "ms": pytest.approx(0.015)}
    assert s["by_class"]["BatchNorm statistics"]["ms"] == pytest.approx(0.01)
    assert s["by_class"]["other"]["kernels"] == 0.5  # the fill
    assert list(s["by_class"])[0] == "matmul"  # longest first


def test_batch_norm_rates_pair_layers_with_their_kernels():
    rows = trace_kernels.batch_norm_rates(trace_kernels.kernels(TRACE), [40e6])
    assert rows == [
        {
            "input_mb": 40.0,
            "statistics_us": 20,
            "statistics_gb_s": pytest.approx(2000.0),  # 40 MB in 20 us
            "elementwise_us": 8,
            "elementwise_gb_s": pytest.approx(10000.0),  # read and written: 80 MB in 8 us
        }
    ]


def test_main_prints_each_trace(tmp_path, capsys):
    path = tmp_path / "trace-x.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump(TRACE, f)
    assert trace_kernels.main([str(path), "--steps", "1"]) == 0
    out = capsys.readouterr().out
    assert "3 kernels/step" not in out and "4 kernels/step" in out
    assert "BatchNorm statistics" in out and "mean 1.00 us" in out


def test_the_batch_norm_inputs_are_the_fits_simulation_of_the_run(tmp_path):
    """--results pairs a trace with the step-time fit's own simulation of the run: one input per forward
    BatchNorm layer, in order (ResNet-18: 20 layers; the stem's input is the largest)."""
    config = {
        "model": "torchvision:resnet18",
        "batch_size": 2,
        "mode": "fast",
        "compile": True,
        "cuda_graphs": True,
    }
    path = tmp_path / "your_model.json"
    path.write_text(json.dumps({"config": config}))
    inputs = trace_kernels.simulated_batch_norm_inputs(str(path))
    assert len(inputs) == 20 and all(b > 0 for b in inputs)
    assert inputs[0] == max(inputs)


def test_a_fit_without_some_runs_predicts_them_with_the_others_ceilings(monkeypatch, capsys, tmp_path):
    """devtools.speed.held_out_fit: the runs whose path holds the text are left out of the fit and predicted;
    here they ran 1.5x as long as the same step the fit saw, so each is predicted 50 % fast."""
    from devtools.speed import held_out_fit
    from fabric_memory_recipes import planning
    from fabric_memory_recipes.planning.simulation.costs import OpCosts
    from fabric_memory_recipes.planning.your_model import step_calibration as sc
    from fabric_memory_recipes.planning.your_model import step_time

    model = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.GELU(), torch.nn.Linear(32, 32))
    collector = OpCosts()
    plan = planning.Plan(device="cpu", optimizer_impl="foreach", micro_batch_size=4)
    planning.simulate(model, plan, make_batch=lambda: (torch.empty(4, 32),),
                      batch_fn=lambda m, b: (m(b[0]).pow(2).mean(),), op_costs=collector)  # fmt: skip
    costs = step_time.costs_of(collector, plan)
    truth, _ = step_time.ceilings("h100")

    def point(path: str, batch: int, slower: float) -> sc.Point:
        config = {"precision": "bf16-mixed", "batch_size": batch, "optimizer": "adamw"}
        seconds = sc.predicted_s(sc.Run(path, "your_model", "m", "eager", config, 1.0, 3), costs, truth)
        return sc.Point([sc.Run(path, "your_model", "m", "eager", config, seconds * slower, 3)], costs)

    pts = [point(f"runs/seen-{b}.json", b, 1.0) for b in (1, 2, 3)]
    pts += [point(f"runs/held-out-{b}.json", b, 1.5) for b in (4, 5)]
    result = held_out_fit.held_out_fit(pts, "held-out")
    assert [r["configuration"].split("batch_size=")[1][0] for r in result["predicted"]] == ["4", "5"]
    assert all(abs(r["error"]) < 1e-3 for r in result["fitted"])
    assert all(r["error"] == pytest.approx(0.5, abs=1e-3) for r in result["predicted"])
    assert result["summary"]["predicted"]["within_25_percent"] == 0
    with pytest.raises(ValueError, match="0 to predict"):
        held_out_fit.held_out_fit(pts, "nowhere")
    paths = [r.path for r in sc.read_runs("h200")]  # the docs' two commands find their committed runs
    assert all(any(text in path for path in paths) for text in ("held-out", "unseen"))
    monkeypatch.setattr(sc, "read_runs", lambda gpu: [p.first for p in pts])
    with pytest.raises(SystemExit) as e:
        held_out_fit.main(["--without", "nowhere"])
    assert e.value.code != 0 and "no committed h200 run's path holds 'nowhere'" in capsys.readouterr().err
    monkeypatch.setattr(sc, "points", lambda runs: pts)  # the command's simulations, stood in for
    assert held_out_fit.main(["--without", "held-out", "--json", str(tmp_path / "out.json")]) == 0
    assert "predicted: 2 configurations, median |error| 50%" in capsys.readouterr().out
    assert json.loads((tmp_path / "out.json").read_text())["summary"] == result["summary"]
