"""What the op-cost collector says of how a kernel reads memory (planning/simulation/costs.py), and how the step
time model prices it (micro_batch_time.py): BatchNorm's statistics pass in training, strided elementwise ops,
matrix products on unaligned operands."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from torch import nn

from fabric_memory_recipes import planning
from fabric_memory_recipes.planning.simulation.costs import OpCosts, strided, unaligned
from fabric_memory_recipes.planning.your_model import step_time
from fabric_memory_recipes.planning.your_model.micro_batch_time import MicroBatch


def collected(model: nn.Module, batch: torch.Tensor) -> OpCosts:
    collector = OpCosts()
    plan = planning.Plan(device="cpu", optimizer_impl="foreach", micro_batch_size=batch.shape[0])
    planning.simulate(
        model,
        plan,
        make_batch=lambda: (torch.empty(batch.shape),),
        batch_fn=lambda m, b: (m(b[0]).float().pow(2).mean(),),
        op_costs=collector,
    )
    return collector


def test_batch_norm_in_training_reads_its_input_once_more_in_a_kernel_of_its_own():
    ops = collected(nn.Sequential(nn.Conv2d(3, 16, 3), nn.BatchNorm2d(16)), torch.empty(4, 3, 10, 10)).of(0)
    forward = [o for o in ops if "batch_norm" in o.name and not o.backward]
    backward = [o for o in ops if "batch_norm_backward" in o.name]
    assert len(forward) == 1 and len(backward) == 1
    activation = 4 * 16 * 8 * 8 * 4  # the convolution's fp32 output: BatchNorm's input
    assert forward[0].reduced_bytes == activation and forward[0].kernels == 2
    assert backward[0].reduced_bytes == 2 * activation and backward[0].kernels == 2  # grad_out and input
    assert not any(o.reduced_bytes for o in ops if "batch_norm" not in o.name)


def test_batch_norm_in_evaluation_has_no_statistics_pass():
    model = nn.Sequential(nn.Conv2d(3, 16, 3), nn.BatchNorm2d(16)).eval()
    ops = collected(model, torch.empty(4, 3, 10, 10)).of(0)
    assert [o.reduced_bytes for o in ops if "batch_norm" in o.name and not o.backward] == [0.0]


def test_strided_tensors_are_those_not_dense_in_one_order():
    x = torch.empty(8, 16, 32)
    assert not strided([x, torch.empty(8, 16, 32)], 3)  # both contiguous
    assert strided([x.permute(0, 2, 1), torch.empty(8, 32, 16)], 3)  # a permuted view beside a contiguous one
    assert strided([x[:, :, :16], torch.empty(8, 16, 16)], 3)  # a slice: not dense
    assert not strided([torch.empty(16, 32).expand(8, 16, 32), x], 3)  # a broadcast keeps the order
    cl = torch.empty(4, 8, 6, 6).to(memory_format=torch.channels_last)
    assert not strided([cl, cl], 4)  # channels-last throughout: dense in one order
    assert strided([cl, torch.empty(4, 8, 6, 6)], 4)


def test_unaligned_matrix_products_have_a_dimension_of_odd_vectors():
    bf16 = torch.bfloat16
    assert unaligned([torch.empty(64, 768, dtype=bf16), torch.empty(768, 50257, dtype=bf16)])
    assert not unaligned([torch.empty(64, 768, dtype=bf16), torch.empty(768, 50304, dtype=bf16)])
    assert not unaligned([torch.empty(64, 12), torch.empty(12, 20)])  # fp32: 4 elements make 16 bytes
    assert unaligned([torch.empty(64, 10), torch.empty(10, 20)])


def test_the_collector_marks_a_permuted_add_and_an_odd_linear():
    class Odd(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = nn.Linear(32, 50)  # 50 outputs: not whole 16-byte vectors of fp32

        def forward(self, x):
            return self.proj(x.transpose(1, 2) + 1.0)

    ops = collected(Odd(), torch.empty(4, 32, 6)).of(0)
    add = next(o for o in ops if o.name == "add" and not o.backward)
    assert not add.strided  # a transposed view plus a scalar: one tensor, one order
    linear = [o for o in ops if o.matmul and not o.backward]
    assert linear and all(o.unaligned for o in linear)
    assert not any(o.strided for o in ops if o.matmul)  # matmuls read their own layouts


def test_each_term_prices_only_its_own_ops_and_defaults_to_the_old_model():
    c, _ = step_time.ceilings("h100")
    mb = MicroBatch(
        flops=np.array([1e12, 0.0, 0.0]),
        bytes=np.array([1e6, 1e9, 1e9]),
        kernels=np.array([1.0, 1.0, 2.0]),
        matmul=np.array([True, False, False]),
        python=np.array([True, True, True]),
        recompute_starts=np.array([False, False, False]),
        module_calls=0,
        in_block=np.array([False, False, False]),
        reduced=np.array([0.0, 0.0, 5e8]),
        strided=np.array([False, True, False]),
        unaligned=np.array([True, False, False]),
    )
    old = dataclasses.replace(c, statistics_bandwidth=0.0, strided_bandwidth=0.0, unaligned_flops=0.0)
    new = dataclasses.replace(old, statistics_bandwidth=0.5e12, strided_bandwidth=1e12, unaligned_flops=1e14)
    g = old.graph_kernel_s or old.kernel_s
    plain = 1e12 / old.matmul_flops + (2e9 + 5e8) / old.bandwidth + 4 * g  # every term at F and B
    assert mb.seconds(old, "fast", graphs=True, fused=False) == pytest.approx(plain)
    priced = 1e12 / 1e14 + 1e9 / 1e12 + 1e9 / old.bandwidth + 5e8 / 0.5e12 + 4 * g
    assert mb.seconds(new, "fast", graphs=True, fused=False) == pytest.approx(priced)
