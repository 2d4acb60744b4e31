"""The multi-process path on CPU: FSDP2 with 2 gloo processes, distributed shards, FSDP1's configuration.

FSDP1 (Fabric's FSDPStrategy) refuses the CPU, so rungs 08/09 are checked by what reaches the strategy;
the FSDP2 variant (fully_shard through ModelParallelStrategy) really runs here with two processes.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from fabric_memory_recipes.config import RunConfig
from fabric_memory_recipes.training import cli, data
from tests.conftest import describe, free_port, load_recipe_module, result, submit_recipe

FSDP2_ARGS = (
    "--accelerator", "cpu", "--devices", "2", "--model", "vit_tiny", "--data", "synthetic",
    "--weights", "none", "--batch-size", "32", "--lr", "1e-3", "--max-steps", "30", "--eval-batches", "4",
)  # fmt: skip
BACKGROUND_PRIORITY = 10  # the longest job: start it first


def start_background_jobs() -> None:
    submit_recipe("fsdp2-gloo", "08_fsdp2", FSDP2_ARGS)


def test_fsdp2_two_gloo_processes_learn_and_report_per_rank_memory():
    proc, payload, _ = result("fsdp2-gloo")
    assert proc.returncode == 0, describe(proc)
    assert payload is not None and payload["status"] == "ok"
    assert payload["provenance"]["world_size"] == 2
    # the two processes share this host's cores: each gets half of them as torch threads, not all
    assert payload["extra"]["host_threads"] == max(1, len(os.sched_getaffinity(0)) // 2)
    per_rank = payload["memory"]["phases"]["train"]["per_rank"]
    assert [r["rank"] for r in per_rank] == [0, 1]
    assert all(r["allocated_gb"] > 0 for r in per_rank)
    assert payload["memory"]["peak_allocated_gb"] == max(r["allocated_gb"] for r in per_rank)
    t = payload["timing"]
    assert t["optimizer_steps"] == 30
    # images/s counts both ranks: effective batch x world size / median step time
    assert t["images_per_s"] == pytest.approx(32 * 2 / t["median_step_s"])
    assert t["images_seen"] == 30 * 32 * 2
    # learns: 10 classes, chance is 0.1
    assert payload["accuracy"]["val"] > 0.5, payload["accuracy"]
    assert payload["loss"]["last"] < payload["loss"]["first"]
    # one result file (rank 0), one notice line about the synthetic fallback (not one per rank)
    assert proc.stdout.count("== 08_fsdp2: OK") == 1, describe(proc)


def _indices(loader) -> list[int]:
    return list(iter(loader.sampler))


def test_distributed_sampler_gives_disjoint_train_shards_and_full_eval_coverage():
    splits = data.synthetic(sizes=(103, 21, 40))
    shards = [data.build_loaders(splits.datasets(), 4, 8, world_size=3, rank=r, seed=7) for r in range(3)]
    train = [_indices(s[0]) for s in shards]
    for a in range(3):
        for b in range(a + 1, 3):
            assert not set(train[a]) & set(train[b]), "train shards overlap"
    assert len({len(t) for t in train}) == 1, "ranks must run the same number of micro-batches"
    assert len(set().union(*map(set, train))) == 3 * (103 // 3)  # no repeats, tail dropped
    test = [_indices(s[2]) for s in shards]
    assert set().union(*map(set, test)) == set(range(40))  # every test sample is evaluated
    assert len({len(t) for t in test}) == 1
    # shuffled differently each epoch, identically on every rank for a given epoch
    sampler = shards[0][0].sampler
    sampler.set_epoch(1)
    assert _indices(shards[0][0]) != train[0]
    # batches carry the right samples
    x, y = next(iter(shards[1][0]))
    first = train[1][:4]
    assert torch.equal(x, torch.from_numpy(splits.train[0][first]))
    assert torch.equal(y, torch.from_numpy(np.asarray(splits.train[1][first])))


@pytest.mark.parametrize(("name", "offload"), [("08_fsdp", False)])
def test_fsdp1_configuration_reaches_the_strategy(name, offload):
    from torchvision.models.vision_transformer import EncoderBlock

    module = load_recipe_module(name)
    strategy = module.make_strategy(module.RUNG)
    wrap = strategy._fsdp_kwargs["auto_wrap_policy"]
    checkpointing = strategy._activation_checkpointing_kwargs["auto_wrap_policy"]
    assert set(wrap._module_classes) == {EncoderBlock}
    assert set(checkpointing._module_classes) == {EncoderBlock}
    assert (strategy.cpu_offload is not None and strategy.cpu_offload.offload_params) == offload
    assert module.RUNG.devices == 4 and module.RUNG.precision == "32-true" and module.RUNG.batch_size == 64
    assert module.RUNG.cpu_offload == offload  # what the estimate is told matches the strategy


@pytest.mark.parametrize(("name", "offload"), [("08_fsdp2", False), ("09_cpu_offload", True)])
def test_fsdp2_parallelize_shards_every_block_with_checkpointing(name, offload):
    """Run the recipe's parallelize function in a 1-process gloo group and inspect the result: every
    block checkpointed and its own unit, each unit asking for the next one's all-gather, the last block
    kept gathered between forward and backward, and (rung 09) the shards in host memory."""
    import torch.distributed as dist
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy
    from torch.distributed.tensor import DTensor

    from fabric_memory_recipes.training import models

    module = load_recipe_module(name)
    assert (
        module.RUNG.sharding == "fsdp2" and module.RUNG.cpu_offload == offload and module.RUNG.fused_attention
    )
    started = not dist.is_initialized()
    if started:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1, 1), mesh_dim_names=("data_parallel", "tensor_parallel"))
        model = module.parallelize(models.build_model("vit_tiny", None), mesh)
        layers = list(model.encoder.layers)
        assert all(isinstance(b, CheckpointWrapper) for b in layers)
        assert all(isinstance(p, DTensor) for p in model.parameters())
        states = [b._get_fsdp_state() for b in layers]
        for state, after in zip(states, states[1:], strict=False):
            assert state._states_to_forward_prefetch == [after]
            assert after._states_to_backward_prefetch == [state]
        groups = [s._fsdp_param_group for s in states]
        assert [g.post_forward_mesh_info is None for g in groups] == [False] * (len(groups) - 1) + [True]
        assert all(isinstance(g.offload_policy, CPUOffloadPolicy) == offload for g in groups)
        out = model(torch.randn(2, 3, 32, 32))
        out.sum().backward()
        assert all(p.grad is not None for p in model.parameters())
    finally:
        if started:
            dist.destroy_process_group()


@pytest.mark.parametrize("name", ["08_fsdp", "09_cpu_offload", "08_fsdp2"])
def test_bad_device_counts_exit_2_with_one_line(run_recipe, name):
    """In this interpreter: a refusal at parse time is SystemExit(2) and one line, as in a process."""
    # cores + 1, not a huge number: if the check ever broke, Fabric would launch that many processes
    too_many = str((os.cpu_count() or 1) + 1)
    proc, payload = run_recipe(name, "--accelerator", "cpu", "--devices", too_many, "--model", "vit_tiny")
    assert proc.returncode == 2, describe(proc)
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and f"--devices {too_many}" in lines[0], describe(proc)
    assert "Traceback" not in proc.stderr and payload is None


def test_fabric_run_settings_become_the_defaults_and_are_consumed(monkeypatch):
    env = {
        "LT_CLI_USED": "1",
        "LT_ACCELERATOR": "cpu",
        "LT_DEVICES": "2",
        "LT_NUM_NODES": "1",
        "LT_PRECISION": "bf16-true",
    }
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    cfg = cli.parse(RunConfig(devices=4), ["--model", "vit_tiny"])
    assert (cfg.accelerator, cfg.devices, cfg.num_nodes, cfg.precision) == ("cpu", 2, 1, "bf16-true")
    # consumed: Fabric must neither compare them with the recipe's values nor refuse launch()
    assert not any(key in os.environ for key in env)


@pytest.mark.parametrize(
    ("env", "argv", "message"),
    [
        ({"LT_DEVICES": "2"}, ["--devices", "1"], "conflicts with `fabric run --devices 2`"),
        ({"LT_STRATEGY": "ddp"}, [], "each recipe builds its own strategy"),
    ],
)
def test_fabric_run_conflicts_exit_2(monkeypatch, capsys, env, argv, message):
    monkeypatch.setenv("LT_CLI_USED", "1")
    monkeypatch.setenv("LT_ACCELERATOR", "cpu")
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(SystemExit) as exit_info:
        cli.parse(RunConfig(), ["--model", "vit_tiny", *argv])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0]
