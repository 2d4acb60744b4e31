"""Your model sharded, as its estimate plans it (planning/your_model/estimate.py): FSDP1 in eager mode,
FSDP2 with its mixed precision policy in fast mode, as training/your_model/sharding.py shards; the card of a
fast-mode run takes the compiled runs' overhead; ``--fit --devices N`` simulates each mode's own step."""

from __future__ import annotations

import json

import pytest

from fabric_memory_recipes.planning.your_model import estimate
from fabric_memory_recipes.planning.your_model.sets import UserPlanner
from fabric_memory_recipes.training.your_model import runner
from tests.tiny import causal_lm_config


@pytest.fixture(scope="module")
def lm(tmp_path_factory) -> str:
    """A 2-layer Qwen2 causal LM of width 32."""
    folder = tmp_path_factory.mktemp("sharded_lm")
    config = causal_lm_config(
        hidden_size=32, intermediate_size=64, num_attention_heads=2, num_key_value_heads=1, vocab_size=300
    )
    (folder / "config.json").write_text(json.dumps(config))
    return f"hf:{folder}"


def _cfg(lm: str, **flags):
    base = {"model": lm, "fsdp": True, "devices": 2, "accelerator": "cuda", "seq_len": 16, "batch_size": 2}
    return runner.default_config().with_flags(**{**base, **flags})


@pytest.mark.parametrize(
    ("compile", "precision", "planned"),
    [
        (True, "bf16-mixed", ("fsdp2", True)),  # fast mode: fully_shard, gathered in bf16
        (True, "32-true", ("fsdp2", False)),
        (True, "16-mixed", ("fsdp", False)),  # Lightning's ModelParallelStrategy refuses 16-mixed
        (False, "bf16-mixed", ("fsdp", False)),  # eager mode: FSDPStrategy
    ],
)
def test_the_plan_shards_as_the_runner_does_and_says_whether_it_compiles(lm, compile, precision, planned):
    cfg = _cfg(lm, compile=compile, precision=precision)
    plan = estimate.plan_of(cfg, ("Qwen2DecoderLayer",))
    assert (plan.sharding, plan.mixed_precision_policy) == planned
    assert plan.compile == compile and plan.world_size == 2
    assert estimate.plan_of(_cfg(lm, fsdp=False, devices=1, compile=compile), ()).sharding == "none"


def test_a_fast_text_runs_card_takes_the_compiled_overhead(lm):
    """Fast mode compiles a text model's blocks without CUDA graphs: the card overhead is the compiled runs'."""
    um, model, blocks, _ = estimate.meta_user_model(lm)
    cfg = _cfg(lm, compile=True, cuda_graphs=False, precision="bf16-mixed")
    est, card = estimate.for_user_run(model, um, cfg, blocks)
    assert est.error is None and est.plan.sharding == "fsdp2"
    assert card["mode"] == "compiled" and "compiled" in card["overhead_source"]
    _, eager = estimate.for_user_run(model, um, _cfg(lm, compile=False), blocks)
    assert eager["mode"] == "eager" and "eager" in eager["overhead_source"]


def test_fit_over_gpus_simulates_fast_and_eager_mode_apart(lm):
    """Sharded, the two modes run different steps (FSDP2, FSDP1): one simulation each, not a shared one."""
    planner = UserPlanner(lm, 2, 16, precision="bf16-mixed", devices=2)
    plain = [c for c in planner.choices if not c.techniques.used and not c.switched and not c.cpu_offload]
    fast = next(c for c in plain if c.mode == "fast" and c.rung.micro_batch_size == 2)
    eager = next(c for c in plain if c.mode == "eager" and c.rung.micro_batch_size == 2)
    assert fast.key != eager.key
    planner.predict(fast)
    planner.predict(eager)
    assert fast.key in planner.simulated and eager.key in planner.simulated
