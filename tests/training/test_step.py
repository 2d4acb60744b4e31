"""fabric_memory_recipes.training.step: the one training step every path runs, and the accumulation groups."""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
import torch.nn.functional as F

from fabric_memory_recipes.training.step import accumulation_groups, train_step
from tests.tiny import batch_fn, tiny_data, tiny_model


def _numbered(counts: list[int], pulled: list[tuple[int, int]]):
    """(epoch, index, batch) for epochs of ``counts`` micro-batches, noting each one as it is read."""
    for epoch, n in enumerate(counts):
        for i in range(n):
            pulled.append((epoch, i))
            yield epoch, i, f"b{epoch}.{i}"


@pytest.mark.parametrize(
    ("num_batches", "k", "sizes"),
    [(12, 4, [4, 4, 4]), (10, 4, [4, 4, 2]), (3, 4, [3]), (5, 1, [1] * 5)],
)
def test_groups_of_k_and_a_short_last_group_per_epoch(num_batches, k, sizes):
    pulled = []
    groups = []
    for group in accumulation_groups(_numbered([num_batches] * 2, pulled), k, num_batches):
        groups.append((group.epoch, group.first, group.last, list(group)))
    assert [len(g[3]) for g in groups] == sizes * 2
    for epoch, first, last, batches in groups:
        assert batches == [f"b{epoch}.{i}" for i in range(first, last + 1)]  # in order, none skipped
    assert len(pulled) == 2 * num_batches


def test_a_group_reads_its_micro_batches_only_as_the_step_needs_them():
    pulled = []
    group = next(accumulation_groups(_numbered([8], pulled), 4, 8))
    assert len(group) == 4 and pulled == [(0, 0)]  # the group's first micro-batch, no more
    batches = iter(group)
    next(batches)
    next(batches)
    assert pulled == [(0, 0), (0, 1)]  # one micro-batch at a time, as a loop over the loader


def test_one_step_over_a_group_is_one_step_over_the_big_batch(fabric):
    x, y = tiny_data(12)
    model0 = tiny_model()
    reference = copy.deepcopy(model0)
    model, optimizer = fabric.setup(model0, torch.optim.SGD(model0.parameters(), lr=0.5))
    phases, records = [], []

    @contextlib.contextmanager
    def region(name):
        phases.append(name)
        yield

    group = [(x[i : i + 4], y[i : i + 4]) for i in (0, 4, 8)]
    train_step(fabric, model, optimizer, batch_fn, group, lambda *r: records.append(r), region=region)

    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.5)
    F.cross_entropy(reference(x), y).backward()
    ref_opt.step()
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=0, atol=1e-6)
        assert p.grad is None  # freed after the step
    assert phases == ["forward", "backward"] * 3 + ["optimizer"]
    assert [r[1].shape[0] for r in records] == [4, 4, 4] and not records[0][1].requires_grad


def test_without_an_optimizer_the_step_only_runs_backward(fabric):
    """Rung 12: the update happened inside backward; the step leaves the gradients to the hooks."""
    model = fabric.setup(tiny_model())
    x, y = tiny_data(4)
    train_step(fabric, model, None, batch_fn, [(x, y)], free_gradients=False)
    assert all(p.grad is not None for p in model.parameters())
