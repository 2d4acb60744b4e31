"""Rungs 10-15 and resumable runs: each technique changes memory, never the numbers it computes.

- the optimizer step fused into backward gives the parameters the ordinary step gives (SGD);
- checkpointed blocks (reentrant or not) give the gradients of plain blocks, whatever their calls;
- offloaded activations give the gradients of the plain run, and the weights are never offloaded;
- a run interrupted and resumed from its checkpoint ends with the uninterrupted run's parameters;
- the new rungs run tiny on CPU and learn (in this interpreter: conftest.run_recipe_inprocess).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

from fabric_memory_recipes.config import RunConfig, UsageError
from fabric_memory_recipes.measurement.results import RunResults
from fabric_memory_recipes.training import checkpoints, loop, models
from fabric_memory_recipes.training.techniques import checkpointing, step_in_backward
from fabric_memory_recipes.training.techniques.offload import offload_activations
from tests.conftest import describe, run_recipe_inprocess

TINY = ("--accelerator", "cpu", "--model", "vit_tiny", "--data", "synthetic", "--weights", "none")
LEARN = {
    "10_activation_checkpointing": ("--lr", "0.05", "--max-steps", "40", "--eval-batches", "20", "--reentrant"),
    "11_activation_offload": ("--lr", "0.05", "--max-steps", "40", "--eval-batches", "20"),
    "12_optimizer_in_backward": ("--batch-size", "16", "--lr", "0.05", "--max-steps", "60", "--eval-batches", "20"),
    "13_lowbit_optimizer": ("--lr", "3e-3", "--max-steps", "40", "--eval-batches", "20"),
    "14_memory_floor": ("--batch-size", "16", "--lr", "0.05", "--max-steps", "60", "--eval-batches", "20"),
    "15_speed": ("--batch-size", "32", "--lr", "3e-3", "--max-steps", "40", "--eval-batches", "20"),
}  # fmt: skip


@pytest.mark.parametrize("name", sorted(LEARN))
def test_new_rungs_learn_on_cpu(name, tmp_path):
    proc, payload = run_recipe_inprocess(name, (*TINY, *LEARN[name]), tmp_path)
    assert proc.returncode == 0, describe(proc)
    assert payload["status"] == "ok"
    assert payload["loss"]["last"] < payload["loss"]["first"], payload["loss"]
    assert payload["accuracy"]["val"] > 0.3, payload["accuracy"]  # 10 classes: chance is 0.1


# ------------------------------------------------------------------------------------------ in-process
def make_log() -> RunResults:
    return RunResults(RunConfig(recipe="test", batch_size=8, results_dir="unused"))


@pytest.fixture
def fabric():
    import lightning as L

    return L.Fabric(accelerator="cpu", devices=1, precision="32-true")


def tiny_mlp(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(12, 32), nn.Tanh(), nn.Linear(32, 10))


def batch_fn(model, batch):
    x, y = batch
    logits = model(x)
    return F.cross_entropy(logits, y), logits, y


def data_loader(n: int = 64, batch: int = 8) -> DataLoader:
    g = torch.Generator().manual_seed(3)
    x, y = torch.randn(n, 12, generator=g), torch.randint(0, 10, (n,), generator=g)
    return DataLoader(TensorDataset(x, y), batch_size=batch, shuffle=False)


def test_optimizer_in_backward_equals_the_ordinary_step(fabric):
    plain, fused = tiny_mlp(), tiny_mlp()
    optimizer = torch.optim.SGD(plain.parameters(), lr=0.1)
    m1, optimizer = fabric.setup(plain, optimizer)
    six = RunConfig(recipe="test", max_steps=6)
    loop.fit(fabric, m1, optimizer, fabric.setup_dataloaders(data_loader()), batch_fn, six, make_log())

    m2 = fabric.setup(fused)
    step_in_backward.register(step_in_backward.per_parameter(m2, torch.optim.SGD, lr=0.1))  # rungs 12, 14
    seen_grads = []

    def count_gradients(_):  # runs after the step's own hook: the gradients that still exist
        seen_grads.append(sum(q.grad is not None for q in m2.parameters()))

    for p in m2.parameters():
        p.register_post_accumulate_grad_hook(count_gradients)
    log = make_log()
    loop.fit(fabric, m2, None, fabric.setup_dataloaders(data_loader()), batch_fn, six, log)

    assert log.optimizer_steps == 6
    assert max(seen_grads) <= 1, "gradients must be freed as soon as they are used"
    for a, b in zip(m1.parameters(), m2.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)


def test_optimizer_in_backward_rungs_refuse_accumulation(run_recipe):
    for name in ("12_optimizer_in_backward", "14_memory_floor"):
        proc, payload = run_recipe(name, *TINY, "--accumulation-steps", "2")
        assert proc.returncode == 2, describe(proc)
        assert "accumulation" in proc.stderr and payload is None


def _vit_grads(wrap: str | None, seed: int = 0) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    torch.manual_seed(seed)
    model = models.build_model("vit_tiny", None)
    if wrap is not None:
        assert (
            checkpointing.checkpoint_blocks(model, ("EncoderBlock",), use_reentrant=wrap == "reentrant") == 2
        )
    x = torch.randn(4, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    loss = F.cross_entropy(model(x), torch.tensor([0, 1, 2, 3]))
    loss.backward()
    grads = {n.replace("block.", ""): p.grad.clone() for n, p in model.named_parameters()}
    return loss.detach(), grads


@pytest.mark.parametrize("mode", ["non_reentrant", "reentrant"])
def test_checkpointed_blocks_give_the_same_gradients(mode):
    loss0, grads0 = _vit_grads(None)
    loss1, grads1 = _vit_grads(mode)
    torch.testing.assert_close(loss1, loss0)
    assert grads0.keys() == grads1.keys()
    for name in grads0:
        torch.testing.assert_close(grads1[name], grads0[name], rtol=1e-5, atol=1e-6)


def test_checkpointing_saves_fewer_activation_bytes():
    def saved_bytes(wrap):
        torch.manual_seed(0)
        model = models.build_model("vit_tiny", None)
        if wrap:
            checkpointing.checkpoint_blocks(model, ("EncoderBlock",))
        params = {p.data_ptr() for p in model.parameters()}
        total = 0

        def pack(t):
            nonlocal total
            if t.untyped_storage().data_ptr() not in params:
                total += t.numel() * t.element_size()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            model(torch.randn(8, 3, 32, 32)).sum()
        return total

    assert saved_bytes(True) < 0.5 * saved_bytes(False)


class _Layer(torch.nn.Module):
    """A block called with keyword arguments, whose model reads an attribute of it (as transformers' do)."""

    kind = "full_attention"

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(4, 4)

    def forward(self, x, *, scale=1.0):
        return torch.tanh(self.linear(x)) * scale


def test_checkpoint_blocks_wraps_every_named_block_once_and_keeps_its_calls():
    """The one checkpointing of the ladder and the your-model runner: every module of a named class, at any
    depth, keyword arguments passed on, the block's attributes read through, the same gradients; a model
    without such a block is refused in one line."""
    torch.manual_seed(0)
    plain = torch.nn.Sequential(_Layer(), torch.nn.Sequential(_Layer(), torch.nn.ReLU()))
    wrapped = copy.deepcopy(plain)
    assert checkpointing.checkpoint_blocks(wrapped, ("_Layer",)) == 2
    assert [type(m).__name__ for m in wrapped.modules()].count("CheckpointedBlock") == 2
    assert wrapped[0].kind == "full_attention" and isinstance(wrapped[1][0].block, _Layer)
    x = torch.randn(3, 4)
    for model in (plain, wrapped):
        model[1][0](model[0](x), scale=2.0).sum().backward()
    for a, b in zip(plain.parameters(), wrapped.parameters(), strict=True):
        torch.testing.assert_close(b.grad, a.grad)
    with pytest.raises(UsageError, match="no repeated blocks"):
        checkpointing.checkpoint_blocks(torch.nn.Linear(2, 2), ("EncoderBlock",))


def test_offloaded_activations_give_the_plain_gradients_and_skip_weights():
    torch.manual_seed(0)
    model = models.build_model("vit_tiny", None)
    x, y = torch.randn(4, 3, 32, 32), torch.tensor([1, 2, 3, 4])
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved = {"all": 0, "activations": 0}

    def count(t):
        size = t.numel() * t.element_size()
        saved["all"] += size
        saved["activations"] += 0 if t.untyped_storage().data_ptr() in params else size
        return t

    with torch.autograd.graph.saved_tensors_hooks(count, lambda t: t):
        F.cross_entropy(model(x), y).backward()
    plain = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)

    hooks = offload_activations(min_bytes=0, devices=("cpu",))  # exercise the mechanics on CPU
    with hooks:
        loss = F.cross_entropy(model(x), y)
    loss.backward()
    for a, p in zip(plain, model.parameters(), strict=True):
        torch.testing.assert_close(p.grad, a)
    # every saved activation went out, no weight did (weights are saved too: "all" is larger)
    assert hooks.offloaded_bytes == saved["activations"] < saved["all"]
    assert hooks.host_bytes() == saved["activations"]  # one micro-batch's buffers

    # Entered again, it reuses the same host buffers, in order (a CUDA graph keeps copying to them),
    # and the gradients are still the plain ones.
    buffers = [b.data_ptr() for b in hooks.buffers]
    model.zero_grad(set_to_none=True)
    with hooks:
        loss = F.cross_entropy(model(x), y)
    loss.backward()
    assert [b.data_ptr() for b in hooks.buffers] == buffers
    for a, p in zip(plain, model.parameters(), strict=True):
        torch.testing.assert_close(p.grad, a)


@pytest.mark.parametrize(
    ("checkpoint_every", "newest_step", "resume_epoch"),
    [(4, 8, 1), (3, 6, 1)],  # step 8: mid-epoch 2; step 6: the last step of epoch 1
)
def test_resume_reproduces_the_uninterrupted_run(
    fabric, tmp_path, checkpoint_every, newest_step, resume_epoch
):
    """fp32 on CPU: momentum SGD + cosine schedule, shuffled data over 2 epochs, accumulation k=2."""

    def setup(seed_data: bool = True):
        model = tiny_mlp(seed=5)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        model, optimizer = fabric.setup(model, optimizer)
        g = torch.Generator().manual_seed(11)
        ds = TensorDataset(torch.randn(50, 12, generator=g), torch.randint(0, 10, (50,), generator=g))
        train = fabric.setup_dataloaders(DataLoader(ds, batch_size=4, shuffle=True, drop_last=True))
        total = loop.planned_steps(len(train), 2, 2)
        scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=total)
        return model, optimizer, train, scheduler

    def run(resume=None, stop_after=None, checkpoint_every=None):
        torch.manual_seed(1234)  # the global RNG that shuffles each epoch
        model, optimizer, train, scheduler = setup()
        log = make_log()
        if stop_after is not None:
            original = log.step_done

            def step_done():
                original()
                if log.optimizer_steps == stop_after:
                    raise KeyboardInterrupt

            log.step_done = step_done
        try:
            cfg = RunConfig(
                recipe="test",
                accumulation_steps=2,
                epochs=2,
                checkpoint_every=checkpoint_every,
                checkpoint_dir=str(tmp_path),
                resume=resume,
            )
            loop.fit(fabric, model, optimizer, train, batch_fn, cfg, log, scheduler=scheduler)
        except KeyboardInterrupt:
            pass
        return model, log

    straight, _ = run()
    run(stop_after=9, checkpoint_every=checkpoint_every)  # 6 steps per epoch, killed at 9 (epoch 2)
    newest = checkpoints.latest(str(tmp_path))
    assert newest.endswith(f"step-{newest_step:06d}.ckpt")
    saved = torch.load(newest, weights_only=False)
    assert saved["epoch"] == resume_epoch  # an epoch-end checkpoint resumes at the next epoch ...
    assert saved["batch_in_epoch"] == (0 if newest_step == 6 else 4)  # ... with no batch to skip
    # The resumed process starts from a fresh RNG state (run() re-seeds as a new process would);
    # epoch 2's shuffle order must come from the checkpoint, not from that state.
    resumed, log = run(resume=newest)
    assert log.extra["resumed_from"]["step"] == newest_step
    assert log.optimizer_steps == loop.planned_steps(12, 2, 2)
    for a, b in zip(straight.parameters(), resumed.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)


def test_speed_rung_counts_model_flops():
    # ViT-L/16 on the meta device: ~370 GFLOP per image for forward + backward (3 x the forward's
    # 123.6 GFLOP, 2 per multiply-add: docs/15_speed.md)
    assert models.training_flops("vit_l_16", 1) == pytest.approx(370e9, rel=0.01)
    assert models.training_flops("vit_tiny", 4) == 4 * models.training_flops("vit_tiny", 1)
