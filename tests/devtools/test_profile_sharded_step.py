"""scripts/gpu/profile_sharded_step.py: a trace's step split into compute, all-gather / reduce-scatter (and the
part no compute overlaps), copies and GPU idle; the tracer that replaces rank 0's recorder; the table."""

from __future__ import annotations

import importlib.util
import json
import types

import pytest
import torch

from fabric_memory_recipes.measurement import profiling
from tests.conftest import REPO

spec = importlib.util.spec_from_file_location(
    "profile_sharded_step", REPO / "scripts" / "gpu" / "profile_sharded_step.py"
)
prof = importlib.util.module_from_spec(spec)
spec.loader.exec_module(prof)


def _x(cat, name, ts, dur):
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur}


def test_a_trace_is_split_per_step_into_compute_exposed_communication_copies_and_idle():
    doc = {"baseTimeNanoseconds": 1_000_000, "traceEvents": [
        _x("user_annotation", "ProfilerStep#6", 0, 100), _x("user_annotation", "ProfilerStep#7", 100, 100),
        _x("kernel", "sm90_gemm", 0, 40), _x("kernel", "sm90_gemm", 50, 40),
        _x("kernel", "ncclDevKernel_AllGather_RING_LL", 30, 30),  # 40-50 has no compute beside it
        _x("kernel", "triton_fused_layer_norm", 140, 20),
        _x("kernel", "ncclDevKernel_ReduceScatter_Sum_f32_RING_LL", 150, 20),  # 160-170 exposed
        _x("gpu_memcpy", "Memcpy DtoH (Device -> Pinned)", 180, 10),
        _x("kernel", "sm90_gemm", 250, 10),  # after the recorded steps: not counted
        _x("cpu_op", "aten::mm", 0, 5),
    ]}  # fmt: skip
    phases = [
        ("forward", 1000 + 10, 0, 2.0, 1.0),
        ("optimizer", 1000 + 150, 0, 1.0, 0.5),
        ("forward", 1000 + 500, 0, 9.0, 9.0),
    ]
    s = prof.summarise(doc, phases)
    assert s["steps"] == 2 and s["step"] == pytest.approx(0.1)
    assert s["busy"] == pytest.approx(0.065) and s["idle"] == pytest.approx(0.035)
    assert s["compute"] == pytest.approx(0.05) and s["copies"] == pytest.approx(0.005)
    assert (s["all_gather"], s["all_gather_exposed"]) == pytest.approx((0.015, 0.005))
    assert (s["reduce_scatter"], s["reduce_scatter_exposed"]) == pytest.approx((0.01, 0.005))
    assert s["all_reduce"] == 0.0 and s["other_comm"] == 0.0
    assert (
        s["forward"] == pytest.approx(1.0) and s["optimizer"] == pytest.approx(0.5) and s["backward"] is None
    )
    assert s["top_kernels"][0] == {"name": "sm90_gemm", "ms": pytest.approx(0.04), "calls": 1.0}
    with pytest.raises(ValueError, match="ProfilerStep"):
        prof.summarise({"traceEvents": [_x("kernel", "k", 0, 1)]})


@pytest.mark.parametrize(("name", "kind"), [
    ("ncclDevKernel_AllGather_RING_LL(ncclDevKernelArgsStorage<4096ul>)", "all_gather"),
    ("ncclKernel_ReduceScatter_RING_SIMPLE_Sum_float", "reduce_scatter"),
    ("ncclDevKernel_AllReduce_Sum_f32_TREE_LL", "all_reduce"),
    ("ncclDevKernel_SendRecv", "other_comm"),
    ("void at::native::vectorized_elementwise_kernel<4>", None),
])  # fmt: skip
def test_nccl_kernels_are_named_by_their_collective(name, kind):
    assert prof.comm_kind(name) == kind


def test_rank_0_records_the_steps_after_the_wait_and_other_ranks_keep_the_usual_recorder(
    tmp_path, monkeypatch
):
    monkeypatch.setattr(
        profiling.Recorder, "for_run", profiling.Recorder.__dict__["for_run"]
    )  # put back after
    prof.install(tmp_path, wait=1, active=2)
    cfg = types.SimpleNamespace(recipe="08_fsdp2", mode="eager", memory_timeline=False, snapshot=False)
    results = types.SimpleNamespace(cfg=cfg)
    other = types.SimpleNamespace(is_global_zero=False, device=torch.device("cpu"), world_size=2)
    assert isinstance(profiling.Recorder.for_run(other, results), profiling.Recorder)
    zero = types.SimpleNamespace(is_global_zero=True, device=torch.device("cpu"), world_size=2)
    tracer = profiling.Recorder.for_run(zero, results).start()
    x = torch.randn(32, 32)
    for _ in range(6):
        with tracer.region("forward"):
            x = torch.tanh(x @ x)
        tracer.step()
    tracer.close()
    record = json.loads((tmp_path / "profile.json").read_text())
    assert record["label"] == "08_fsdp2 eager" and record["devices"] == 2
    assert record["summary"]["steps"] == 2 and record["summary"]["forward"] > 0
    assert (tmp_path / "trace.json.gz").is_file() and not (tmp_path / "trace.json").exists()


def test_the_table_sets_profiles_side_by_side_and_bad_input_exits_2(tmp_path, capsys):
    keys = [k for k, _ in prof.COLUMNS] + [
        f"{k}_exposed" for k in ("all_gather", "reduce_scatter", "all_reduce")
    ]
    for name, devices, step in (("x4", 4, 230.0), ("x1", 1, 190.0)):
        (tmp_path / name).mkdir()
        summary = {**dict.fromkeys(keys, 1.0), "step": step, "all_gather": 6.0, "all_gather_exposed": 2.5,
                   "backward": None, "top_kernels": [{"name": "sm90_gemm", "ms": 90.0, "calls": 96.0}]}  # fmt: skip
        record = {"label": "08_fsdp2 fast", "devices": devices, "summary": summary}
        (tmp_path / name / "profile.json").write_text(json.dumps(record))
    assert prof.main(["--table", str(tmp_path / "x4"), str(tmp_path / "x1")]) == 0
    text = (tmp_path / "profile_summary.md").read_text()
    assert (
        "| 08_fsdp2 fast | 4 | 230.0 | 1.0 | 1.0 | 6.0 (2.5) |" in text
        and "| 08_fsdp2 fast | 1 | 190.0 |" in text
    )
    assert "sm90_gemm 90.0 ms" in text
    assert prof.main(["--table", str(tmp_path / "missing")]) == 2
    assert prof.main(["--out", str(tmp_path), "--", str(tmp_path / "no_recipe.py")]) == 2
    assert "error" in capsys.readouterr().err
