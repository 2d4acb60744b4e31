"""Regional compilation's graphs (training/your_model/regions.py): blocks that read Python numbers of their
own (Swin's shift, torchvision's stochastic-depth probability) need a compiled graph each and stay eager;
alike blocks share one graph and compile as before; blocks of several shapes compile with static shapes."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from fabric_memory_recipes.training.techniques import checkpointing
from fabric_memory_recipes.training.your_model import models, regions


class Block(nn.Module):
    """A block whose forward reads a Python int and a float of its own, as Swin-V2's blocks do."""

    def __init__(self, width: int, shift: int, keep: float) -> None:
        super().__init__()
        self.norm, self.proj = nn.LayerNorm(width), nn.Linear(width, width)
        self.shift, self.keep = shift, keep

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.shift:
            x = torch.roll(x, self.shift, dims=1)
        return x + self.proj(self.norm(x)) * self.keep


class TinyImageModel(nn.Module):
    """Image in (``image_size``, as the runner's models), stages of :class:`Block`, a widening between."""

    image_size = 4

    def __init__(self, stages: list[list[tuple[int, int, float]]]) -> None:
        super().__init__()
        widths = [stage[0][0] for stage in stages]
        self.stem = nn.Linear(3, widths[0])
        self.stages = nn.ModuleList(nn.Sequential(*(Block(*b) for b in stage)) for stage in stages)
        self.widen = nn.ModuleList(nn.Linear(a, b) for a, b in zip(widths[:-1], widths[1:], strict=True))
        self.head = nn.Linear(widths[-1], 10)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = self.stem(images.flatten(2).transpose(1, 2))
        for i, stage in enumerate(self.stages):
            x = stage(self.widen[i - 1](x) if i else x)
        return self.head(x.mean(1))


@pytest.fixture
def compile_calls(monkeypatch):
    """The keyword arguments of each ``Module.compile`` call outside the count (which compiles its twin)."""
    calls: list[dict] = []
    original = nn.Module.compile

    def recorded(self, *args, **kwargs):
        if kwargs.get("backend") is None:
            calls.append(kwargs)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(nn.Module, "compile", recorded)
    return calls


def test_blocks_with_numbers_of_their_own_need_a_graph_each_and_stay_eager(dynamo_on, compile_calls, capsys):
    model = TinyImageModel([[(8, i % 2, 1.0 - 0.05 * i) for i in range(5)]])
    checkpointing.checkpoint_blocks(model, ("Block",))  # as the runner does before it compiles
    wrapped = [m for m in model.modules() if isinstance(m, checkpointing.CheckpointedBlock)]
    params = [p.detach().clone() for p in model.parameters()]
    rng = torch.get_rng_state()
    assert regions.distinct_graphs(model, wrapped) == 5
    assert torch.equal(rng, torch.get_rng_state())  # the count draws no random numbers
    assert all(
        p.device.type == "cpu" and torch.equal(p, q) for p, q in zip(model.parameters(), params, strict=True)
    )
    assert models.compile_repeated(model, ("Block",)) == 0 and compile_calls == []
    assert capsys.readouterr().out.count("need 5 distinct compiled graphs") == 1
    assert models.compilable(model, ("Block",)) == []  # the planner's speed model: not compiled


def test_alike_blocks_share_one_graph_and_compile_as_before(dynamo_on, compile_calls):
    model = TinyImageModel([[(8, 1, 0.9)] * 6])
    assert regions.distinct_graphs(model, list(model.stages[0])) == 1
    assert models.compile_repeated(model, ("Block",)) == 6
    assert len(compile_calls) == 6 and all(c.get("dynamic") is None for c in compile_calls)  # torch's default


def test_blocks_of_two_shapes_compile_with_static_shapes(dynamo_on, compile_calls):
    """With automatic dynamic shapes the second stage's blocks would recompile with symbolic sizes."""
    model = TinyImageModel([[(8, 1, 0.9)] * 3, [(16, 1, 0.9)] * 3])
    assert regions.distinct_graphs(model, [*model.stages[0], *model.stages[1]]) == 2
    assert models.compile_repeated(model, ("Block",)) == 6
    assert compile_calls == [{"dynamic": False}] * 6


def test_nothing_is_counted_with_dynamo_off_or_without_an_image_input(dynamo_on, monkeypatch):
    model = TinyImageModel([[(8, i % 2, 1.0) for i in range(4)]])
    monkeypatch.setattr(TinyImageModel, "image_size", None)  # a text model's batch is not built here
    assert regions.distinct_graphs(model, list(model.stages[0])) is None
    monkeypatch.setattr(TinyImageModel, "image_size", 4)
    monkeypatch.setenv("TORCHDYNAMO_DISABLE", "1")
    assert regions.distinct_graphs(model, list(model.stages[0])) is None
