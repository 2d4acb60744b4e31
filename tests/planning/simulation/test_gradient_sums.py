"""The gradient parts that reach one input of a backward node are summed in the simulation as the autograd
engine sums them on a GPU: in place when the engine holds the only reference to the first part, into a new
tensor otherwise (``Tracker.backward``; the engine under the simulation's dispatch modes always makes a new
tensor)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.profiler import ProfilerActivity, profile

from fabric_memory_recipes import planning
from fabric_memory_recipes.planning.simulation.tracking import FakeMode, Tracker

VOCAB, WIDTH, BATCH, TOKENS = 2048, 128, 2, 8
GRADIENT = VOCAB * WIDTH * 4  # one fp32 part of the shared weight's gradient: 1 MiB


class ReadTwice(nn.Module):
    """An embedding read twice, as T5's encoder and decoder read their shared embedding."""

    def __init__(self) -> None:
        super().__init__()
        self.embedding = nn.Embedding(VOCAB, WIDTH)

    def forward(self, first: torch.Tensor, second: torch.Tensor) -> torch.Tensor:
        return (self.embedding(first) * self.embedding(second)).sum()


class EverySum(nn.Module):
    """Each kind of sum: an embedding read twice (in place), a residual (in place), one tensor used twice by
    one op (the same part twice: a new tensor), a tied output projection (its part a transposed view whose
    base is alive: a new tensor, then in place into that new tensor)."""

    def __init__(self) -> None:
        super().__init__()
        self.embedding = nn.Embedding(64, 16)
        self.mix = nn.Linear(16, 16)

    def forward(self, first: torch.Tensor, second: torch.Tensor) -> torch.Tensor:
        h = self.embedding(first) + self.embedding(second)
        h = h + self.mix(h)
        h = h + h
        return F.linear(h, self.embedding.weight).logsumexp(-1).sum()


def tokens(vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return tuple(torch.randint(0, vocab, (BATCH, TOKENS), generator=g) for _ in range(2))


def test_a_weight_read_twice_has_its_gradient_parts_summed_in_place():
    """At the peak, the end of backward: the weight, the two parts of its gradient, and no third tensor for
    their sum. The rest (token ids, activations of 2 x 8 x 128, the loss) is under a twentieth of a part."""
    plan = planning.Plan(device="cpu", micro_batch_size=BATCH, optimizer="sgd", precision="32-true")
    estimate = planning.simulate(
        ReadTwice(), plan, make_batch=lambda: tokens(VOCAB), batch_fn=lambda m, b: (m(*b),)
    )
    weight_and_two_parts = 3 * GRADIENT
    assert weight_and_two_parts <= estimate.peak_gb * 1e9 < weight_and_two_parts + GRADIENT / 20


def engine_sums_without_modes(model: nn.Module, batch: tuple) -> list[tuple[bool, tuple[int, ...]]]:
    """(in place, shape) of each sum the engine makes in a real CPU backward with no dispatch mode active:
    its ``aten::add_`` or ``aten::add`` called by the engine itself, not by a node (the profiler records
    without a mode)."""
    loss = model(*batch)
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        loss.backward()
    sums = [
        e
        for e in prof.events()
        if e.name in ("aten::add", "aten::add_")
        and e.cpu_parent is not None
        and e.cpu_parent.name.startswith("autograd::engine::evaluate_function")
    ]
    return [
        (e.name == "aten::add_", tuple(e.input_shapes[0]))
        for e in sorted(sums, key=lambda e: e.time_range.start)
    ]


def test_the_simulated_sums_are_the_engines_sums_without_modes():
    torch.manual_seed(0)
    batch = tokens(64)
    expected = engine_sums_without_modes(EverySum(), batch)
    assert {in_place for in_place, _ in expected} == {True, False}, "the model must show both kinds of sums"
    with FakeMode(allow_non_fake_inputs=True):
        model = EverySum()
        loss = model(*batch)
        with Tracker() as tracker:
            tracker.backward(loss)
    assert tracker.gradient_sums == expected
