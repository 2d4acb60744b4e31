"""FSDP's collectives and CPU offload in a sharded set's predicted step (planning/your_model/set_speed.py):
what they cost, how they scale, and that the plan says how they are priced."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from fabric_memory_recipes.planning.your_model.set_speed import (
    FSDP1_HOST_GBPS,
    FSDP2_HOST_GBPS,
    GATHER_EXPOSED_S_PER_GB,
    GATHER_GBPS,
    REDUCE_EXPOSED_S_PER_GB,
    REDUCE_GBPS,
    collective_seconds,
    lines,
    offload_seconds,
)

NEOX_14B = 1_414_647_808  # GPT-NeoX 1.4 B (examples/configs/gpt-neox-1.4b), as the sharded runs counted it
VIT_L16 = 303_311_882  # rungs 08_fsdp2 and 09_cpu_offload's ViT-L/16


def test_one_gpu_has_no_collectives():
    assert collective_seconds(NEOX_14B, NEOX_14B, 1, "bf16-mixed", 8) == 0.0


def test_the_profiled_rung_is_what_the_constants_come_from():
    """Rung 08_fsdp2 on 4 GPUs (ViT-L/16, fp32, one micro-batch): 25.3 ms of exposed all-gather and 1.2 ms of
    exposed reduce-scatter per step in its profile (results/published/h200x4/sharded-spread/call3/)."""
    assert collective_seconds(303_300_000, 303_300_000, 4, "32-true", 1) == pytest.approx(26.5e-3, rel=1e-6)
    assert GATHER_EXPOSED_S_PER_GB > REDUCE_EXPOSED_S_PER_GB > 0


def test_each_micro_batch_gathers_again_and_the_step_reduces_once():
    one = collective_seconds(NEOX_14B, NEOX_14B, 2, "bf16-mixed", 1)
    eight = collective_seconds(NEOX_14B, NEOX_14B, 2, "bf16-mixed", 8)
    gathers = 2 * NEOX_14B * 2 * (1 / 2) / 1e9 * GATHER_EXPOSED_S_PER_GB  # two gathers of bf16 halves
    assert eight - one == pytest.approx(7 * gathers)
    # frozen parameters are gathered but not reduced (a LoRA set)
    lora = collective_seconds(NEOX_14B, NEOX_14B // 100, 2, "bf16-mixed", 1)
    assert one - lora == pytest.approx(
        0.99 * NEOX_14B * (1 / 2) * 2 / 1e9 * REDUCE_EXPOSED_S_PER_GB, rel=1e-2
    )


def test_the_bytes_follow_the_compute_dtype_and_the_share_each_rank_receives():
    bf16 = collective_seconds(NEOX_14B, NEOX_14B, 2, "bf16-mixed", 1)
    assert collective_seconds(NEOX_14B, NEOX_14B, 2, "32-true", 1) == pytest.approx(2 * bf16)
    assert collective_seconds(NEOX_14B, NEOX_14B, 2, "bf16-true", 1) == pytest.approx(bf16)
    # a rank receives (N - 1) / N of the whole: 4 GPUs move 1.5 x what 2 do
    assert collective_seconds(NEOX_14B, NEOX_14B, 4, "bf16-mixed", 1) == pytest.approx(1.5 * bf16)


def test_the_gathers_grow_with_the_parameters_and_fall_with_the_bandwidth():
    base = collective_seconds(NEOX_14B, NEOX_14B, 2, "bf16-mixed", 4)
    assert collective_seconds(2 * NEOX_14B, 2 * NEOX_14B, 2, "bf16-mixed", 4) == pytest.approx(2 * base)
    faster = collective_seconds(NEOX_14B, NEOX_14B, 2, "bf16-mixed", 4, gather_gbps=2 * GATHER_GBPS)
    assert faster < base
    # the gathers, 8 of them at 4 micro-batches, are most of it: doubling both bandwidths halves it all
    both = collective_seconds(NEOX_14B, NEOX_14B, 2, "bf16-mixed", 4, 2 * GATHER_GBPS, 2 * REDUCE_GBPS)
    assert both == pytest.approx(base / 2)
    assert faster - both < base - faster  # the reduce-scatter, once a step, is the smaller part


def test_the_offload_reproduces_its_rung_and_the_host_is_shared():
    """Rung 09_cpu_offload's step less rung 08_fsdp2's (ViT-L/16, fp32 AdamW): 111.8 ms, the median of the
    committed pairs on 2 and 4 H200s; the processes of one host share it, so the time follows the whole
    model whatever the number of GPUs."""
    assert offload_seconds(VIT_L16, 4, "adamw") == pytest.approx(111.8e-3)
    assert offload_seconds(VIT_L16, 2, "adamw") == pytest.approx(offload_seconds(VIT_L16, 4, "adamw"))
    assert offload_seconds(NEOX_14B, 2, "adamw") == pytest.approx(111.8e-3 * NEOX_14B / VIT_L16)
    # FSDP1 (eager mode's sharding) offloads slower: your model's runs with and without --cpu-offload
    fsdp1 = offload_seconds(NEOX_14B, 2, "adamw", fsdp2=False)
    assert fsdp1 == pytest.approx((1060.2e-3 + 1128.2e-3) / 2 - 270.8e-3)
    assert FSDP1_HOST_GBPS < FSDP2_HOST_GBPS
    # an optimizer with less state moves fewer bytes on the host
    assert offload_seconds(NEOX_14B, 2, "sgd") < offload_seconds(NEOX_14B, 2, "adamw")


def test_the_plan_says_the_collectives_and_the_offload_are_priced():
    planner = SimpleNamespace(gpu="h100", ceilings_source="(ceilings)", devices=2)
    text = " ".join(lines(planner))
    assert "not modelled" not in text and "each step longer by its gathers (two per micro-batch)" in text
    assert f"{GATHER_GBPS:.0f} and {REDUCE_GBPS:.0f} GB/s" in text and "--cpu-offload" in text
    assert "GB/s" not in " ".join(lines(SimpleNamespace(gpu="h100", ceilings_source="(c)", devices=1)))
