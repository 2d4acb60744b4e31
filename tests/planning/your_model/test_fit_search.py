"""The order of ``--fit``'s search for your own model (planning/your_model/sets.py): every set's speed bound
comes from the step-time model that predicts its speed, so the first pick is the predicted fastest set that
fits, and the search still stops early."""

from __future__ import annotations

import dataclasses
import json

import pytest

from fabric_memory_recipes.planning.plan import Plan
from fabric_memory_recipes.planning.your_model import offload_bound, set_speed, sets, step_time
from fabric_memory_recipes.planning.your_model.sets import UserPlanner
from fabric_memory_recipes.techniques import (
    ACTIVATION_CHECKPOINTING,
    ACTIVATION_OFFLOAD,
    FUSED_LOSS,
    OPTIMIZER_IN_BACKWARD,
)
from fabric_memory_recipes.training.your_model import models
from tests.tiny import causal_lm_config


@pytest.fixture(scope="module")
def lm(tmp_path_factory) -> str:
    """A 2-layer Qwen2 causal LM of width 32."""
    folder = tmp_path_factory.mktemp("search_lm")
    (folder / "config.json").write_text(
        json.dumps(
            causal_lm_config(
                hidden_size=32,
                intermediate_size=64,
                num_attention_heads=2,
                num_key_value_heads=1,
                vocab_size=300,
            )
        )
    )
    return f"hf:{folder}"


@pytest.fixture(scope="module")
def t5(tmp_path_factory) -> str:
    """A 2-layer T5 of width 64 with an 8192-token vocabulary: with its 8-token targets the fused loss walks
    each micro-batch one token a chunk (fewer tokens than vocabulary / width), so a smaller micro-batch runs
    fewer of the loss's ops."""
    folder = tmp_path_factory.mktemp("search_t5")
    fields = dict(model_type="t5", vocab_size=8192, d_model=64, d_ff=128, num_layers=2, num_heads=4, d_kv=16)
    (folder / "config.json").write_text(json.dumps(fields))
    return f"hf:{folder}"


def test_a_plain_sets_bound_before_its_simulation_is_never_below_its_prediction(t5):
    """The bound --fit prunes a set by before its plain set is simulated (set_speed.optimistic: the floor of
    that set's step, scaled from the whole batch's) is an upper bound of the speed the simulation then
    predicts, with the fused loss and without: at micro-batch 1 some copies are views and some gradients
    need no sum over the batch, and the fused loss's chunks follow the tokens where they are fewer than
    vocabulary / width (this T5's 32 tokens at the whole batch, 16 at micro-batch 2). Eager mode: fast
    mode's floor counts the ops the same way."""
    planner = UserPlanner(t5, 4, 16, precision="bf16-mixed", target_len=8)
    planner.plains = {c.plain: c for c in planner.choices if not c.techniques.used and not c.cpu_offload}
    eager = [p for p in planner.plains.values() if p.mode == "eager"]
    assert {(p.rung.micro_batch_size, bool(p.switched)) for p in eager} == {
        (m, fused) for m in (1, 2, 4) for fused in (False, True)
    }
    for p in eager:
        bound = set_speed.optimistic(planner, p)  # p's whole batch simulated, p itself not yet
        assert planner.predict(p).images_per_s <= bound * (1 + 1e-9), p.label()


def stand_in(planner: UserPlanner):
    """A ``predict`` that simulates nothing: samples/s favour the small micro-batches (unlike the ladder's
    step model), each memory technique costs speed and saves memory; ``calls`` counts the predictions."""
    calls = []

    def predict(c):
        if c.predicted_gb is None:
            calls.append(c)
            r, used = c.rung, c.techniques
            slower = {ACTIVATION_CHECKPOINTING: 0.7, ACTIVATION_OFFLOAD: 0.8, OPTIMIZER_IN_BACKWARD: 0.9}
            speed = (
                1000.0
                / r.micro_batch_size
                * (1.3 if c.mode == "fast" else 1.0)
                * (1.1 if FUSED_LOSS.name in c.switched else 1)
            )
            for t, factor in slower.items():
                speed *= factor if used.uses(t) else 1.0
            speed *= 0.95 if c.checkpoint_mode == "selective" else 1.0
            memory = r.micro_batch_size * (0.4 if used.uses(ACTIVATION_CHECKPOINTING) else 1.0)
            memory *= 0.6 if used.uses(ACTIVATION_OFFLOAD) else 1.0
            c.images_per_s, c.predicted_gb, c.simulated_gb, c.offloaded_gb = speed, memory, memory, 0.0
        return c

    planner.predict = predict
    return calls


def test_the_first_picks_are_the_predicted_fastest_that_fit_whatever_the_speeds(lm):
    """The search visits the sets by a bound from the same prediction as their speed: the picks are the
    exhaustive answer even where the fastest sets take the smallest micro-batches."""
    planner = UserPlanner(lm, 8, 16, precision="bf16-mixed")
    stand_in(planner)
    budget = 2.5 + max(c.overhead_gb for c in planner.choices)
    fits, _ = planner.fit(budget, top=3)
    best = {}
    for c in planner.choices:
        planner.predict(c)
        if c.card_gb <= budget and c.images_per_s > best.get(c.family, (0.0,))[0]:
            best[c.family] = (c.images_per_s, c)
    expected = sorted(best.values(), key=lambda x: -x[0])[:3]
    assert [c.images_per_s for c in fits] == [speed for speed, _ in expected]
    assert (
        fits[0].rung.micro_batch_size == 1 and fits[0].mode == "fast" and FUSED_LOSS.name in fits[0].switched
    )


def test_the_search_stops_once_nothing_left_can_be_faster(lm):
    planner = UserPlanner(lm, 8, 16, precision="bf16-mixed")
    calls = stand_in(planner)
    fits, _ = planner.fit(100.0, top=1)
    plain = [c for c in planner.choices if not c.techniques.used]
    assert fits[0].rung.micro_batch_size == 1 and not fits[0].techniques.used
    # the bounds predict every plain set; the search itself then predicts nothing more
    assert len(calls) == len(plain) < len(planner.choices)


def test_a_memory_technique_never_predicts_faster_than_its_plain_set(lm):
    """The bound holds on the simulated step: checkpointing (full, selective), offload and the step in
    backward each only add to the time the step-time model sums, in both modes."""
    planner = UserPlanner(lm, 2, 16, precision="bf16-mixed")
    plain = {c.plain: c for c in planner.choices if not c.techniques.used}
    picked = [
        c
        for c in planner.choices
        if c.rung.accumulation_steps == 1 and FUSED_LOSS.name in c.switched and len(c.techniques.used) == 1
    ]
    ckpt, offload, hooks = ACTIVATION_CHECKPOINTING.name, ACTIVATION_OFFLOAD.name, OPTIMIZER_IN_BACKWARD.name
    assert {(c.techniques.used, c.checkpoint_mode) for c in picked} == {
        ((ckpt,), "full"),
        ((ckpt,), "selective"),
        ((offload,), "full"),
        ((hooks,), "full"),
    }
    for c in picked:
        bound = planner.predict(plain[c.plain]).images_per_s
        # (a host-bound fast set ties its plain one: the same compiled calls, summed in another order)
        assert 0 < planner.predict(c).images_per_s <= bound * (1 + 1e-12), c.label()


def test_fast_and_eager_share_one_simulation_each_with_its_allocators_replay(lm):
    """A causal LM's fast mode captures its steps in CUDA graphs under the expandable segments fast mode
    sets (config.FAST_ALLOCATOR): its replay is the graphs' one, eager mode's the default allocator's. A text
    classifier's fast mode leaves the graphs out but keeps the segments."""
    planner = UserPlanner(lm, 2, 16, precision="bf16-mixed")
    pair = [
        c
        for c in planner.choices
        if not c.techniques.used and c.rung.accumulation_steps == 1 and FUSED_LOSS.name not in c.switched
    ]
    assert sorted(c.mode for c in pair) == ["eager", "fast"]
    for c in pair:
        planner.predict(c)
    assert len(planner.simulated) == 1
    eager, fast = sorted(pair, key=lambda c: c.mode)
    reserved = next(iter(planner.simulated.values()))[1]
    assert (eager.predicted_gb, fast.predicted_gb) == (reserved["default"], reserved["graphs"])
    assert [sets.allocator_of_set(c, planner.um) for c in (eager, fast)] == ["default", "graphs"]
    for task, allocator in (("classification", "expandable"), ("seq2seq_lm", "expandable"),
                            ("image_classification", "graphs")):  # fmt: skip
        assert sets.allocator_of_set(fast, models.UserModel("m", "hf", "m", task)) == allocator
    assert eager.images_per_s != fast.images_per_s


def test_fast_mode_fuses_ops_only_where_it_compiles_blocks(lm):
    """Blocks holding BatchNorm stay uncompiled in fast mode (training/your_model/models.py): such a model's
    fast mode is its CUDA graphs alone, predicted without the compiled blocks' fusion."""
    assert not UserPlanner("torchvision:resnet18", 8, 0).compiled
    planner = UserPlanner(lm, 2, 16, precision="bf16-mixed")
    assert planner.compiled
    c = next(
        c
        for c in planner.choices
        if c.mode == "fast"
        and not c.techniques.used
        and FUSED_LOSS.name not in c.switched
        and c.rung.accumulation_steps == 1
    )
    planner.predict(c)
    costs = step_time.costs_of(planner.simulated[c.key][3], Plan())
    fused, detail = step_time.step_seconds(costs, planner.ceilings, "fast", True)
    unfused, plain = step_time.step_seconds(costs, planner.ceilings, "fast", True, fused=False)
    assert unfused > fused and plain["mode"] == "fast (CUDA graphs) (blocks not compiled)"


def test_a_set_whose_simulation_fails_is_left_out_and_said(lm, monkeypatch):
    """A set whose step fails on fake tensors (as Swin-V2-T's did under selective checkpointing while a kept
    tensor changed in place failed it): the other sets are still planned, and the failure is one line; a plain
    set's failure stops."""
    real = sets.estimate

    def estimate(model, um, plan, seq_len, op_costs=None, target_len=None):
        if plan.checkpoint_mode == "selective":
            raise RuntimeError("Tensor cached during selective activation checkpoint has been mutated")
        return real(model, um, plan, seq_len, op_costs=op_costs, target_len=target_len)

    monkeypatch.setattr(sets, "estimate", estimate)
    planner = UserPlanner(lm, 1, 16, precision="bf16-mixed")
    selective = next(c for c in planner.choices if c.checkpoint_mode == "selective")
    assert planner.predict(selective).images_per_s == 0.0 and selective.card_gb > 1e9
    assert [why.split(": ", 1)[0] for why in planner.failed.values()] == [selective.label()]
    assert "mutated" in next(iter(planner.failed.values()))
    fits, _ = planner.fit(100.0, top=1)
    assert fits and not fits[0].techniques.used
    monkeypatch.setattr(sets, "estimate", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("no")))
    with pytest.raises(RuntimeError, match="the simulation of .* failed: RuntimeError: no"):
        UserPlanner(lm, 1, 16, precision="bf16-mixed").fit(100.0)


def test_a_plain_sets_floor_bounds_it_and_spares_the_slow_micro_batches(lm):
    """Before a plain set is simulated, its bound is scaled from the whole batch's simulation: never below its
    prediction, and the search that stops early leaves the slowest micro-batches unsimulated."""
    planner = UserPlanner(lm, 4, 16, precision="bf16-mixed")
    planner.bound()
    plain = [c for c in planner.choices if not c.techniques.used]
    assert len({c.key for c in plain}) == 6 and len(planner.simulated) == 2  # the whole batch, fused or not
    fits, _ = planner.fit(100.0, top=1)
    assert fits and len(planner.simulated) < 6
    floors = {id(c): c.speed_bound for c in plain}
    for c in plain:
        assert planner.predict(c).images_per_s <= floors[id(c)] * (1 + 1e-9), c.label()


def test_an_offload_sets_bound_from_its_set_without_offload_holds_and_spares_its_simulation(lm):
    """Once the same set without activation offload is simulated, a set with it is bounded by that set's step
    plus the copies of the largest tensor it saves (the same tensors, with offload or without): never below its
    prediction. Where the copies make offload slower than the picks (a slow host link here), the search leaves
    the offload sets unsimulated, which their plain sets' bound, above the last pick, did not."""
    planner = UserPlanner(lm, 1, 128, precision="bf16-mixed")
    planner.ceilings = dataclasses.replace(  # a slow host link; and compiled calls cheap enough that this
        planner.ceilings,  # tiny model's fast sets are not all host-bound alike (tied, the plain set a pick)
        host_bandwidth=planner.ceilings.host_bandwidth / 1e3,
        compiled_call_s=planner.ceilings.compiled_call_s / 1e3,
    )
    fits, _ = planner.fit(100.0, top=3)
    assert len(fits) == 3 and not [key for key in planner.simulated if ACTIVATION_OFFLOAD.name in key[3]]
    picked = [c for c in planner.choices if c.techniques.uses(ACTIVATION_OFFLOAD) and c.mode == "fast"
              and not c.switched]  # fmt: skip
    assert len(picked) == 3  # alone, with full and with selective checkpointing
    for c in picked:
        used = tuple(n for n in c.key[3] if n != ACTIVATION_OFFLOAD.name)
        largest = planner.simulated[(*c.key[:3], used, *c.key[4:])][
            3
        ].largest_offloadable  # simulated: a pick
        assert planner.predict(planner.plains[c.plain]).images_per_s > fits[-1].images_per_s, c.label()
        bound = offload_bound.of(planner, c)
        assert largest > 0 and bound < fits[-1].images_per_s, c.label()
        assert planner.predict(c).images_per_s <= bound * (1 + 1e-9), c.label()
        _, _, host_gb, costs = planner.simulated[c.key]
        assert costs.largest_offloadable == largest <= host_gb * 1e9, c.label()
