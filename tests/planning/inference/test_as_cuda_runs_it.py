"""What a CUDA run of inference allocates that the simulation must copy: one cuBLAS workspace, the fused
attention kernels' output layout, and the order in which the driver maps new segments (the replay's tie
between free blocks of one size), each checked against its evidence."""

from __future__ import annotations

import gzip
import pickle

import torch
import torch.nn.functional as F

from fabric_memory_recipes.planning.inference import check, simulate
from fabric_memory_recipes.planning.inference.estimate import CappedAllocator, estimate
from fabric_memory_recipes.planning.plan import CUBLAS_WORKSPACE_BYTES
from fabric_memory_recipes.planning.simulation.allocator import CachingAllocator
from fabric_memory_recipes.planning.your_model.estimate import meta_user_model
from tests.planning.inference.test_inference import llama  # noqa: F401 - the fixture
from tests.planning.simulation.test_allocator import TRACE

MiB = 1 << 20


def test_inference_holds_one_cublas_workspace(llama):  # noqa: F811
    """No autograd thread at inference: one 32 MiB workspace (the committed H100 runs allocated 33.5 MB
    less than two predicted, on every row)."""
    um, model, _, _ = meta_user_model(llama)
    est = estimate(model, um, 2, 16, 4, "bf16-true")
    assert est.components_gb["workspace"] == CUBLAS_WORKSPACE_BYTES / 1e9


def test_fused_attention_returns_its_output_transposed_from_batch_seq_heads():
    b, s, h, d = 2, 8, 4, 16
    per_head = (
        torch.empty(b, s, 3 * h * d)[..., : h * d].view(b, s, h, d).transpose(1, 2)
    )  # a projection's view
    contiguous = torch.empty(b, h, s, d)
    with simulate._sdpa_on_cuda(used := set()):
        flash = F.scaled_dot_product_attention(
            per_head.bfloat16(), contiguous.bfloat16(), contiguous.bfloat16()
        )
        kept = F.scaled_dot_product_attention(
            contiguous.bfloat16(), contiguous.bfloat16(), contiguous.bfloat16()
        )
        efficient = F.scaled_dot_product_attention(contiguous, contiguous, contiguous)  # fp32: not flash
    assert used == {"flash", "efficient"} and flash.shape == (b, h, s, d)
    assert flash.transpose(1, 2).is_contiguous()  # the caller's transpose(1, 2).contiguous() copies nothing
    assert kept.is_contiguous()  # flash keeps a dense query's layout: then the caller copies, as on CUDA
    assert efficient.transpose(1, 2).is_contiguous()


def _reserved_after_a_tie(allocator: CachingAllocator) -> int:
    """Two free 40 MiB blocks, a whole older segment and the front of a newer one: a 40 MiB request takes
    the one at the lower address, and a 60 MiB request then fits only if that was the older segment."""
    allocator.malloc("x", 40 * MiB)  # segment A
    allocator.malloc("t", 60 * MiB)  # segment B
    allocator.free("t")
    allocator.malloc("y1", 40 * MiB)  # the front of B
    allocator.malloc("y2", 20 * MiB)  # the rest of B
    allocator.free("x")
    allocator.free("y1")
    allocator.malloc("z", 40 * MiB)
    allocator.free("y2")
    allocator.malloc("w", 60 * MiB)
    return allocator.reserved


def test_the_replay_maps_new_segments_below_the_earlier_ones():
    assert _reserved_after_a_tie(CachingAllocator()) == 100 * MiB  # z in A: B whole again for w
    assert _reserved_after_a_tie(CappedAllocator()) == 160 * MiB  # z in B (the lower): w needs a segment


def test_the_committed_h100_trace_mapped_each_later_segment_below_every_earlier_one():
    with gzip.open(TRACE) as f:
        trace = pickle.load(f)["device_traces"][0]
    addresses = [e["addr"] for e in trace if e["action"] == "segment_alloc" and e["size"] > 2 * MiB]
    lower = [a < min(addresses[:i]) for i, a in enumerate(addresses) if i]
    assert len(lower) > 100 and all(lower[15:]) and not any(lower[:15])


def test_the_check_names_the_gpu_of_each_run(tmp_path):
    payload = {"extra": {"inference": True, "task": "causal_lm", "predicted_inference": {}},
               "provenance": {"gpu_name": "NVIDIA H100 80GB HBM3"}, "memory": {}, "config": {}}  # fmt: skip
    assert check.row(tmp_path / "a.json", payload)["gpu"] == "NVIDIA H100 80GB HBM3"
