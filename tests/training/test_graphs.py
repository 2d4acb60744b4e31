"""Fast mode's bookkeeping (fabric_memory_recipes/training/graphs.py) on a CPU, with a stand-in for the CUDA graph.

A CUDA graph cannot be captured without a GPU; ``devtools.check_equivalence`` compares real captures with
eager steps on one. What a CPU can check is everything around the capture: the warm-up, the static
input buffers filled slot by slot, one graph per group size (a short last group of an epoch), the
learning rates read from device tensors that follow the schedule, step counters moved off the host,
and the outputs the loop reads. The stand-in records the step body at capture and re-runs it at each
replay, so a run with it must give the eager run's parameters.
"""

from __future__ import annotations

import copy

import pytest
import torch

from fabric_memory_recipes.training import graphs, loop, loop_plumbing
from fabric_memory_recipes.training.techniques.step_in_backward import SchedulerGroup
from tests.tiny import batch_fn, loader, make_log, settings, tiny_data, tiny_model


class FakeGraph:
    """Records the step at capture; a replay runs it again and refreshes the captured outputs."""

    captures = 0

    def replay(self) -> None:
        self.outputs[:] = list(self.body())


def fake_capture(graph: FakeGraph, body):
    FakeGraph.captures += 1
    graph.body = body
    graph.outputs = [None, None, None]
    return graph.outputs


class FakeStepGraph(graphs.StepGraph):
    replays: list[list[float]] = []

    last = None

    def __init__(self, *args, **kwargs):
        super().__init__(*args, make_graph=FakeGraph, capture=fake_capture, **kwargs)
        FakeStepGraph.last = self

    def replay(self, group):
        out = super().replay(group)
        # what the captured kernels would read: the device vector, as synced before the replay
        FakeStepGraph.replays.append(self.lrs.values.tolist())
        return out


def _train(fab, model, opt_fn, sched_fn, dl, k, epochs, graphed, monkeypatch, max_steps=None, graph=None):
    model = copy.deepcopy(model)
    optimizer = opt_fn(model.parameters())
    model, optimizer = fab.setup(model, optimizer)
    scheduler = sched_fn(optimizer) if sched_fn else None
    log = make_log()
    if graphed:
        monkeypatch.setattr(loop_plumbing, "StepGraph", graph or FakeStepGraph)
    cfg = settings(accumulation_steps=k, epochs=epochs, log_every=1, max_steps=max_steps, cuda_graphs=graphed)
    loop.fit(fab, model, optimizer, dl, batch_fn, cfg, log, scheduler=scheduler)
    monkeypatch.undo()
    return model, log, optimizer


@pytest.mark.parametrize(
    ("opt", "num_micro", "k", "epochs", "graphs_captured"),
    [
        ("sgd", 16, 4, 1, 1),  # 4 steps: 2 eager warm-up steps, then 2 replays of one graph
        ("sgd", 10, 2, 2, 1),  # 5 steps per epoch, 2 epochs
        ("adam", 18, 4, 1, 2),  # groups of 4 and a last group of 2: a second graph
        ("adam", 14, 1, 1, 1),  # no accumulation: the whole step is one graph
    ],
)
def test_graphed_steps_equal_eager_steps(fabric, monkeypatch, opt, num_micro, k, epochs, graphs_captured):
    micro = 4
    x, y = tiny_data(num_micro * micro)
    model0 = tiny_model()
    if opt == "sgd":
        opt_fn = lambda p: torch.optim.SGD(p, lr=0.3, fused=True)  # noqa: E731
    else:
        opt_fn = lambda p: torch.optim.Adam(p, lr=0.02, fused=True)  # noqa: E731
    total = loop.planned_steps(num_micro, k, epochs)
    sched_fn = lambda o: torch.optim.lr_scheduler.CosineAnnealingLR(o, T_max=total)  # noqa: E731
    FakeGraph.captures, FakeStepGraph.replays = 0, []

    eager, log_e, _ = _train(
        fabric, model0, opt_fn, sched_fn, loader(x, y, micro), k, epochs, False, monkeypatch
    )
    fast, log_f, opt_f = _train(
        fabric, model0, opt_fn, sched_fn, loader(x, y, micro), k, epochs, True, monkeypatch
    )

    replayed = total - graphs.WARMUP_STEPS
    assert len(FakeStepGraph.replays) == replayed > 0
    assert FakeGraph.captures == graphs_captured  # one graph per group size that came after the warm-up
    assert log_f.optimizer_steps == log_e.optimizer_steps == total
    assert log_f.micro_batches == log_e.micro_batches
    for p, q in zip(fast.parameters(), eager.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
    assert log_f.loss["last"] == pytest.approx(log_e.loss["last"], rel=1e-5)
    assert log_f.accuracy["train"] == pytest.approx(log_e.accuracy["train"])
    # the schedule reached the graph: the lr read at each replay is the scheduler's (cosine, falling)
    assert FakeStepGraph.replays[0][0] > FakeStepGraph.replays[-1][0]
    # the free pages were returned once, before the optimizer's first step, and the hook is gone
    assert FakeStepGraph.last.released_before_first_step
    assert not getattr(opt_f, "optimizer", opt_f)._optimizer_step_pre_hooks
    # outside the capture the schedulers see floats again, and the parameters really moved
    assert isinstance(opt_f.param_groups[0]["lr"], float)
    assert not torch.allclose(next(fast.parameters()), next(model0.parameters()))


class RefusedCapture(FakeStepGraph):
    """A capture that fails as CUDA refuses one (a host tensor copied to the GPU inside the forward)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.capture = self._refuse

    def _refuse(self, graph, body):
        FakeGraph.captures += 1
        raise RuntimeError(self.error)


@pytest.mark.parametrize(
    "error", ["Cannot copy between CPU and CUDA tensors during CUDA graph capture\nmore", "bug"]
)
def test_a_step_that_cannot_be_captured_runs_eagerly_and_says_why(fabric, monkeypatch, capsys, error):
    """BLOOM stopped at its capture on an H200 (results/published/h200/ranking-check/unseen-call3/): such a
    step now runs as the warm-up ran it and trains as the eager run does; any other error stops the run."""
    x, y = tiny_data(10 * 4)
    model0 = tiny_model()
    opt_fn = lambda p: torch.optim.Adam(p, lr=0.02, fused=True)  # noqa: E731
    RefusedCapture.error, FakeGraph.captures, FakeStepGraph.replays = error, 0, []
    run = lambda graphed: _train(fabric, model0, opt_fn, None, loader(x, y, 4), 2, 1, graphed, monkeypatch,  # noqa: E731
                                 graph=RefusedCapture)  # fmt: skip
    if error == "bug":
        with pytest.raises(RuntimeError, match="bug"):  # not the capture's refusal: the run stops, as eagerly
            run(True)
        return
    eager, log_e, _ = run(False)
    fast, log_f, _ = run(True)
    assert FakeGraph.captures == 1 and len(FakeStepGraph.replays) == 5 - graphs.WARMUP_STEPS  # tried once
    for p, q in zip(fast.parameters(), eager.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
    assert log_f.optimizer_steps == log_e.optimizer_steps == 5
    assert log_f.extra["cuda_graphs"] == {"graphs": 0, "not_captured": error.splitlines()[0]}
    assert "the step could not be captured in a CUDA graph (Cannot copy" in capsys.readouterr().out
    assert not torch.allclose(next(fast.parameters()), next(model0.parameters()))  # it trained


def test_step_counters_move_to_the_device_and_capturable_is_set():
    p = torch.nn.Parameter(torch.randn(3))
    opt = torch.optim.Adam([p], lr=0.1)
    p.grad = torch.ones(3)
    opt.step()
    opt.state[p]["step"] = torch.tensor(1.0)  # as an optimizer that counts on the host keeps it
    device = torch.device("meta")  # any device other than the counter's
    graphs.move_step_state_to_device([opt], device)
    assert opt.state[p]["step"].device == device
    assert opt.param_groups[0]["capturable"] is True
    assert opt.state[p]["exp_avg"].device.type == "cpu"  # only 0-dim counters move


def test_optimizers_behind_a_scheduler_group_are_found():
    params = [torch.nn.Parameter(torch.randn(2)) for _ in range(3)]
    opts = [torch.optim.SGD([p], lr=0.1) for p in params]
    group = SchedulerGroup(torch.optim.lr_scheduler.StepLR(o, 1) for o in opts)
    assert graphs.base_optimizers(None, group) == opts
    single = torch.optim.SGD(params, lr=0.1)
    assert graphs.base_optimizers(single, torch.optim.lr_scheduler.StepLR(single, 1)) == [single]


def test_learning_rates_are_tensors_only_during_capture():
    opt = torch.optim.SGD([torch.nn.Parameter(torch.randn(2))], lr=0.5)
    lrs = graphs.LearningRates([opt], torch.device("cpu"))
    opt.param_groups[0]["lr"] = 0.25
    lrs.sync()
    with lrs.as_tensors():
        lr = opt.param_groups[0]["lr"]
        assert isinstance(lr, torch.Tensor) and lr.item() == 0.25
        assert lr.data_ptr() == lrs.values.data_ptr()  # a view: what a replay reads after the next sync
    assert opt.param_groups[0]["lr"] == 0.25
