"""fabric_memory_recipes.training.loop in-process on a CPU Fabric: accumulation is exact, steps are counted right, it learns."""

from __future__ import annotations

import copy
import signal
import types

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

from fabric_memory_recipes import faults
from fabric_memory_recipes.training import data, loop, models
from fabric_memory_recipes.training.techniques.step_in_backward import SchedulerGroup
from tests.tiny import IN, OUT, batch_fn, loader, make_log, settings, tiny_data, tiny_model  # noqa: F401


def make_optimizer(kind: str, params, lr: float):
    if kind == "sgd":
        return torch.optim.SGD(params, lr=lr)
    if kind == "sgd_momentum":
        return torch.optim.SGD(params, lr=lr, momentum=0.9)
    return torch.optim.Adam(params, lr=lr)


def fit_with_fabric(fabric, model, optimizer, dl, log=None, **flags):
    model, optimizer = fabric.setup(model, optimizer)
    log = log or make_log()
    loop.fit(fabric, model, optimizer, dl, batch_fn, settings(**flags), log)
    return model, optimizer, log


# --------------------------------------------------------------------------------------- (a) exactness
@pytest.mark.parametrize("opt_kind,lr", [("sgd", 0.5), ("sgd_momentum", 0.1), ("adam", 1e-2)])
@pytest.mark.parametrize(
    "num_micro,k,epochs",
    [
        (12, 4, 1),  # three full groups
        (10, 4, 1),  # groups of 4, 4 and a final partial group of 2
        (10, 4, 2),  # the partial group in every epoch
        (6, 1, 1),  # no accumulation
    ],
)
def test_accumulation_equals_big_batch_steps(fabric, opt_kind, lr, num_micro, k, epochs):
    micro = 4
    x, y = tiny_data(num_micro * micro)
    model0 = tiny_model()
    reference = copy.deepcopy(model0)

    opt = make_optimizer(opt_kind, model0.parameters(), lr)
    trained, _, log = fit_with_fabric(
        fabric, model0, opt, loader(x, y, micro), accumulation_steps=k, epochs=epochs, log_every=1
    )

    # By hand: one optimizer step per group, on the whole group as one batch (mean loss over it).
    ref_opt = make_optimizer(opt_kind, reference.parameters(), lr)
    steps = 0
    for _ in range(epochs):
        for start in range(0, num_micro, k):
            stop = min(num_micro, start + k)
            xb, yb = x[start * micro : stop * micro], y[start * micro : stop * micro]
            ref_opt.zero_grad()
            F.cross_entropy(reference(xb), yb).backward()
            ref_opt.step()
            steps += 1

    assert log.optimizer_steps == steps
    assert log.micro_batches == num_micro * epochs
    for (name, p), q in zip(trained.named_parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=0, atol=1e-6, msg=name)
    # and the parameters really moved (the comparison is not trivially true)
    assert not torch.allclose(next(iter(reference.parameters())), next(iter(tiny_model().parameters())))


def test_stepping_after_first_micro_batch_would_be_detected(fabric):
    """Guard for the test above: an update after micro-batch 1 of 4 differs from the big-batch step."""
    micro, k = 4, 4
    x, y = tiny_data(k * micro)
    a, b = tiny_model(), tiny_model()
    oa, ob = torch.optim.SGD(a.parameters(), lr=0.5), torch.optim.SGD(b.parameters(), lr=0.5)
    F.cross_entropy(a(x), y).backward()
    oa.step()
    F.cross_entropy(b(x[:micro]), y[:micro]).backward()
    ob.step()
    assert not torch.allclose(a[0].weight, b[0].weight, atol=1e-6)


# ------------------------------------------------------------------------------------- (b) step count
class StepCounter:
    """Wraps an optimizer's step: counts calls and records the micro-batch count and lr at each call.

    Installed as a bound method (as torch's own hooks and LR schedulers expect ``optimizer.step`` to be).
    """

    def __init__(self, optimizer, log):
        self.calls = 0
        self.at_micro_batch: list[int] = []
        self.lrs: list[float] = []
        inner = optimizer.step
        counter = self

        def step(opt, *a, **kw):
            counter.calls += 1
            counter.at_micro_batch.append(log.micro_batches)
            counter.lrs.append(opt.param_groups[0]["lr"])
            return inner(*a, **kw)

        optimizer.step = types.MethodType(step, optimizer)


@pytest.mark.parametrize(
    "num_micro,k,epochs,max_steps,expected_at",
    [
        (10, 4, 1, None, [4, 8, 10]),
        (10, 4, 1, 2, [4, 8]),
        (10, 4, 2, None, [4, 8, 10, 14, 18, 20]),
        (10, 4, 2, 4, [4, 8, 10, 14]),
        (8, 4, 1, None, [4, 8]),
        (10, 1, 1, None, list(range(1, 11))),
        (10, 1, 1, 3, [1, 2, 3]),
        (10, 10, 1, None, [10]),
        (3, 4, 1, None, [3]),  # fewer micro-batches than one group: still one step
        (10, 5, 3, None, [5, 10, 15, 20, 25, 30]),
    ],
)
def test_optimizer_steps_after_the_kth_micro_batch(fabric, num_micro, k, epochs, max_steps, expected_at):
    x, y = tiny_data(num_micro * 2)
    model = tiny_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    log = make_log()
    counter = StepCounter(opt, log)  # patched on the wrapped optimizer: what Fabric's wrapper calls
    fit_with_fabric(
        fabric, model, opt, loader(x, y, 2), log, accumulation_steps=k, epochs=epochs, max_steps=max_steps
    )
    assert counter.calls == len(expected_at)
    assert counter.at_micro_batch == expected_at
    assert log.optimizer_steps == len(expected_at)
    assert len(log.step_marks) == len(expected_at)
    assert log.micro_batches == expected_at[-1]
    assert loop.planned_steps(num_micro, k, epochs, max_steps) == len(expected_at)


def test_gradients_are_cleared_after_each_step(fabric):
    x, y = tiny_data(16)
    model = tiny_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    fit_with_fabric(fabric, model, opt, loader(x, y, 2), accumulation_steps=4)
    assert all(p.grad is None for p in model.parameters())


def test_without_optimizer_the_loop_only_counts_steps(fabric):
    x, y = tiny_data(20)
    model = fabric.setup(tiny_model())
    before = [p.detach().clone() for p in model.parameters()]
    log = make_log()
    loop.fit(fabric, model, None, loader(x, y, 2), batch_fn, settings(accumulation_steps=4), log)
    assert log.optimizer_steps == 3 and log.micro_batches == 10
    for p, q in zip(model.parameters(), before, strict=True):
        assert torch.equal(p.detach(), q)


def test_empty_loader_is_an_error(fabric):
    x, y = tiny_data(3)
    model = tiny_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    model, opt = fabric.setup(model, opt)
    empty = DataLoader(TensorDataset(x, y), batch_size=4, drop_last=True)
    with pytest.raises(ValueError, match="empty"):
        loop.fit(fabric, model, opt, empty, batch_fn, settings(), make_log())


def test_loss_and_train_accuracy_are_logged(fabric):
    """With lr 0 the model never changes, so every logged number can be computed here. 10 micro-batches
    of 4, k=2, a window every 2 steps: windows of micro-batches 1-4, 5-8 and (the last, short) 9-10."""
    x, y = tiny_data(40)
    model = tiny_model()
    with torch.no_grad():
        losses = [F.cross_entropy(model(x[i : i + 4]), y[i : i + 4]).item() for i in range(0, 40, 4)]
        last_acc = (model(x[32:]).argmax(1) == y[32:]).float().mean().item()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    _, _, log = fit_with_fabric(fabric, model, opt, loader(x, y, 4), accumulation_steps=2, log_every=2)
    assert log.loss["first"] == pytest.approx(sum(losses[:4]) / 4, rel=1e-5)  # the first window's mean
    assert log.loss["last"] == pytest.approx(sum(losses[8:]) / 2, rel=1e-5)  # the last window's mean
    assert log.accuracy["train"] == pytest.approx(last_acc)  # over the last window only


# ------------------------------------------------------------------------------------ (c) planned_steps
@pytest.mark.parametrize(
    "num_batches,k,epochs,max_steps,expected",
    [
        (10, 4, 1, None, 3),
        (10, 4, 1, 2, 2),
        (10, 4, 2, None, 6),
        (10, 4, 2, 5, 5),
        (10, 4, 1, 100, 3),
        (8, 4, 1, None, 2),
        (8, 4, 3, None, 6),
        (9, 4, 1, None, 3),
        (3, 4, 1, None, 1),
        (1, 1, 1, None, 1),
        (703, 4, 1, None, 176),
        (2812, 1, 1, None, 2812),
        (2812, 4, 2, None, 1406),
    ],
)
def test_planned_steps(num_batches, k, epochs, max_steps, expected):
    assert loop.planned_steps(num_batches, k, epochs, max_steps) == expected


# ------------------------------------------------------------------------------------------ (d) learns
def test_vit_tiny_learns_synthetic_data(fabric):
    torch.manual_seed(0)
    splits = data.synthetic(sizes=(2000, 500, 500), seed=0)
    train, val, _ = data.build_loaders(splits.datasets(), micro_batch_size=16, eval_batch_size=250)
    model = models.build_model("vit_tiny", None, num_classes=data.NUM_CLASSES)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    model, opt = fabric.setup(model, opt)
    fn = data.image_classification(model.image_size)

    chance_before = loop.evaluate(fabric, model, val, fn)
    log = make_log()
    loop.fit(fabric, model, opt, train, fn, settings(accumulation_steps=2, epochs=3, log_every=20), log)
    assert log.micro_batches == 3 * (2000 // 16)  # 375 micro-batches
    assert log.optimizer_steps == 3 * 63
    acc = loop.evaluate(fabric, model, val, fn)
    assert acc > 0.5, f"val accuracy {acc:.3f} after training (before: {chance_before:.3f})"
    assert acc > chance_before + 0.2
    assert log.loss["last"] < log.loss["first"]
    assert model.training, "evaluate() must leave the model in train mode"
    # evaluate() honours max_batches: one batch of 250 is a multiple of 1/250
    one = loop.evaluate(fabric, model, val, fn, max_batches=1)
    assert abs(one * 250 - round(one * 250)) < 1e-3
    # a stop request ends it before the next batch, as training's does, and leaves the model training
    faults.request_stop(signal.SIGTERM)
    try:
        with pytest.raises(faults.Interrupted) as stopped:
            loop.evaluate(fabric, model, val, fn)
    finally:
        faults.request_stop(None)
    assert stopped.value.signum == signal.SIGTERM and "(0 of 2 batches)" in stopped.value.during
    assert model.training


# --------------------------------------------------------------------------------------- (e) scheduler
@pytest.mark.parametrize("num_micro,k,epochs,max_steps", [(10, 4, 1, None), (10, 4, 2, None), (10, 2, 1, 3)])
def test_scheduler_steps_once_per_optimizer_step(fabric, num_micro, k, epochs, max_steps):
    x, y = tiny_data(num_micro * 2)
    model = tiny_model()
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    log = make_log()
    counter = StepCounter(opt, log)  # before the scheduler, which wraps optimizer.step itself
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda epoch: 1.0 / (epoch + 1))
    model, opt = fabric.setup(model, opt)
    cfg = settings(accumulation_steps=k, epochs=epochs, max_steps=max_steps)
    loop.fit(fabric, model, opt, loader(x, y, 2), batch_fn, cfg, log, scheduler=sched)
    n = loop.planned_steps(num_micro, k, epochs, max_steps)
    assert counter.calls == n
    assert sched.last_epoch == n  # one scheduler step per optimizer step
    # the optimizer step j (0-based) used the lr after j scheduler steps: scheduler after optimizer
    assert counter.lrs == pytest.approx([1.0 / (j + 1) for j in range(n)])


@pytest.mark.parametrize("own", ["none", "cosine", "per-parameter"])
def test_warmup_multiplies_the_rungs_own_schedule(fabric, own):
    """--warmup-steps N: lr rises linearly from base/N to base over N steps, times the rung's schedule
    (none: Adam rungs; cosine: rung 06; one cosine per optimizer: rungs 12 and 14)."""
    import math

    x, y = tiny_data(24)
    model, warm, n, base = tiny_model(), 4, 12, 0.1
    opt = torch.optim.SGD(model.parameters(), lr=base)
    log = make_log()
    counter = StepCounter(opt, log)
    cosine = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=n) if own != "none" else None
    sched = SchedulerGroup([cosine]) if own == "per-parameter" else cosine
    model, opt = fabric.setup(model, opt)
    loop.fit(fabric, model, opt, loader(x, y, 2), batch_fn, settings(warmup_steps=warm), log, scheduler=sched)
    assert counter.calls == n
    ramp = [min(1.0, 1 / warm + (1 - 1 / warm) * j / warm) for j in range(n)]
    shape = [1.0 if cosine is None else (1 + math.cos(math.pi * j / n)) / 2 for j in range(n)]
    assert counter.lrs == pytest.approx([base * r * c for r, c in zip(ramp, shape, strict=True)], rel=1e-6)
    assert counter.lrs[0] == pytest.approx(base / warm)


def test_no_warmup_leaves_the_scheduler_alone():
    opt = torch.optim.SGD(tiny_model().parameters(), lr=0.1)
    assert loop.with_warmup(opt, None, 0) is None
    assert opt.param_groups[0]["lr"] == 0.1


@pytest.mark.parametrize("entry", ["evaluate", "evaluate_splits"])
def test_evaluation_runs_without_autograd_and_without_compiling(dynamo_on, entry):
    """Both evaluation entry points run a compiled model's original code (eval mode + no_grad would
    compile new graphs) and record no autograd graph: evaluate_splits once ran with gradients on, and
    rung 15's evaluation then held 82 GB against its training's 42 GB."""
    from torch._dynamo.utils import counters

    from fabric_memory_recipes.training import loop

    class _Fabric:
        device = torch.device("cpu")

    torch._dynamo.reset()
    counters.clear()
    model = torch.compile(torch.nn.Linear(4, 3))
    batches = [(torch.randn(5, 4), torch.randint(0, 3, (5,))) for _ in range(2)]
    grad_modes = []

    def batch_fn(m, batch):
        x, y = batch
        logits = m(x)
        grad_modes.append((torch.is_grad_enabled(), logits.requires_grad))
        return torch.nn.functional.cross_entropy(logits, y), logits, y

    if entry == "evaluate":
        acc = loop.evaluate(_Fabric(), model, batches, batch_fn, num_classes=3)
        assert 0.0 <= acc <= 1.0
    else:
        log = make_log()
        loop.evaluate_splits(_Fabric(), model, batches, batches, batch_fn, log, num_classes=3)
        assert 0.0 <= log.accuracy["val"] <= 1.0 and 0.0 <= log.accuracy["test"] <= 1.0
    assert grad_modes and set(grad_modes) == {(False, False)}, grad_modes
    assert counters["stats"]["unique_graphs"] == 0
    model(torch.randn(2, 4))  # outside evaluation the same model does compile
    assert counters["stats"]["unique_graphs"] == 1


# ------------------------------------------------------------------------------------ bounded evaluation
def _stop_after(batches: int, signum: int):
    """A batch function that records a stop request (what the signal handler does) after ``batches``."""
    from fabric_memory_recipes import faults

    seen = []

    def fn(model, batch):
        seen.append(1)
        if len(seen) == batches:
            faults.request_stop(signum)
        return batch_fn(model, batch)

    return fn, seen


def test_evaluation_stops_at_the_next_batch_keeping_what_it_measured(fabric, capsys):
    """A SIGTERM during evaluation used to wait for the whole test split (16 minutes seen): now the
    batch in hand finishes, the accuracy over the batches done is kept, and the run is interrupted."""
    import signal

    from fabric_memory_recipes import faults

    x, y = tiny_data(400)
    model = fabric.setup(tiny_model())
    fn, seen = _stop_after(3, signal.SIGTERM)
    log = make_log()
    log.optimizer_steps = 7
    try:
        with pytest.raises(faults.Interrupted) as exc:
            loop.evaluate_splits(fabric, model, loader(x, y, 10), loader(x, y, 10), fn, log)
    finally:
        faults.request_stop(None)
    stop = exc.value
    assert len(seen) == 3, "evaluation went on after the stop request"
    assert (stop.signum, stop.exit_code, stop.step, stop.checkpoint) == (signal.SIGTERM, 143, 7, None)
    assert log.extra["evaluation"]["val"]["batches"] == 3 and log.extra["evaluation"]["val"]["of"] == 40
    assert 0.0 <= log.extra["evaluation"]["val"]["accuracy"] <= 1.0
    assert log.accuracy["val"] is None, "a partial accuracy must not pass for the split's"
    line = faults.interrupted_line(stop, ["x.py"])
    assert "interrupted during val evaluation (3 of 40 batches) (SIGTERM), after all 7 training steps" in line
    assert model.training


def test_evaluation_shows_progress_and_is_bounded(fabric, capsys):
    x, y = tiny_data(400)
    model = fabric.setup(tiny_model())
    log = make_log()
    loop.evaluate_splits(fabric, model, loader(x, y, 10), loader(x, y, 10), batch_fn, log, max_batches=5)
    assert log.extra["evaluation"] == {
        "val": {"batches": 5, "of": 5, "accuracy": log.accuracy["val"]},
        "test": {"batches": 5, "of": 5, "accuracy": log.accuracy["test"]},
    }
    assert "val accuracy" in capsys.readouterr().err  # the progress bar (tqdm, on stderr)


def test_the_your_model_runner_bounds_evaluation_by_default():
    """A GPT-2 config at --seq-len 64 trained 2 steps in 2.5 s, then evaluated for over 10 minutes."""
    from fabric_memory_recipes.training import cli
    from fabric_memory_recipes.training.your_model import runner

    cfg = cli.parse(runner.default_config(), ["--accelerator", "cpu"])
    assert cfg.eval_batches == 20
    assert (
        cli.parse(runner.default_config(), ["--accelerator", "cpu", "--eval-batches", "3"]).eval_batches == 3
    )


def test_max_steps_beyond_the_epochs_says_it_is_cut(fabric, capsys):
    """--max-steps 200 ran 79 steps (one epoch) without a word."""
    x, y = tiny_data(40)
    model = tiny_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = fabric.setup(model, opt)
    log = make_log()
    loop.fit(fabric, model, opt, loader(x, y, 4), batch_fn, settings(max_steps=200), log)
    assert log.optimizer_steps == 10
    assert (
        "[steps] --max-steps 200: 1 epoch(s) hold 10 optimizer steps; running 10" in capsys.readouterr().out
    )


@pytest.mark.parametrize(("flags", "graphs"), [((), 0), (("--compile",), 1)])
def test_an_eager_cpu_run_compiles_nothing_a_library_compiles(dynamo_on, tmp_path, flags, graphs):
    """Eager, the CPU's default mode, compiled torchao's Adam step anyway (rung 05's CPU command: 33 s
    instead of 9.5 s, "No CUDA runtime is found", a Ctrl-C waiting for the compiler); only ./run_all.sh
    avoided it, with TORCHDYNAMO_DISABLE=1. A function compiled inside the run, as torchao compiles its
    step, runs eagerly now; --compile still compiles."""
    from torch._dynamo.utils import counters

    from fabric_memory_recipes.config import RunConfig
    from fabric_memory_recipes.training import lifecycle

    torch._dynamo.reset()
    counters.clear()

    def main(cfg, results) -> None:
        step = torch.compile(lambda x: x * 2 + 1, backend="eager", fullgraph=True)  # as a library would
        assert step(torch.ones(3)).tolist() == [3.0, 3.0, 3.0]

    argv = ["--accelerator", "cpu", "--model", "vit_tiny", "--results-dir", str(tmp_path), *flags]
    assert lifecycle.run_recipe(main, RunConfig(recipe="05_gradient_accumulation"), "doc", argv) == 0
    assert counters["stats"]["unique_graphs"] == graphs
