"""FSDP's collectives in a sharded set's predicted step (planning/your_model/set_speed.py): what they cost,
how they scale, and that the plan says how they are priced."""

from __future__ import annotations

import pytest

from fabric_memory_recipes.planning.your_model.set_speed import (
    GATHER_EXPOSED_S_PER_GB,
    REDUCE_EXPOSED_S_PER_GB,
    collective_seconds,
)

NEOX_14B = 1_414_647_808  # GPT-NeoX 1.4 B (examples/configs/gpt-neox-1.4b), as the sharded runs counted it


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
