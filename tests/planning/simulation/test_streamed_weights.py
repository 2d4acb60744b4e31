"""Rung 16's streamed weights in the simulated step (planning/simulation/streamed.py) against what
fabric_memory_recipes.training.techniques.weights_offload (WeightsOnCPU) itself does on a CPU: the same
blocks on the device at once, in the forward pass and in backward, and their copies on a stream of their
own, whose freed blocks wait for the compute stream."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torchvision.models.vision_transformer import VisionTransformer

from devtools.your_model import reserved_trace
from fabric_memory_recipes import planning
from fabric_memory_recipes.planning.plan import round_bytes
from fabric_memory_recipes.planning.simulation.allocator import COPY, CachingAllocator
from fabric_memory_recipes.training import data, models
from fabric_memory_recipes.training.techniques.checkpointing import CheckpointedBlock
from fabric_memory_recipes.training.techniques.weights_offload import WeightsOnCPU

GB = 1e9
LAYERS, BATCH = 4, 8


def _vit(hidden: int = 64) -> VisionTransformer:
    """A small ViT; ``hidden=1024``: ViT-L/16's blocks (only simulated: fake tensors cost no memory)."""
    torch.manual_seed(0)
    return VisionTransformer(
        32, 8, num_layers=LAYERS, num_heads=2, hidden_dim=hidden, mlp_dim=2 * hidden, num_classes=10
    )


def _blocks_on_the_device_per_pass() -> dict[str, int]:
    """Run one bf16 step of WeightsOnCPU (checkpointed blocks, as rung 16) and count the streamed blocks whose
    weights are on the device after every fetch, in the forward pass and in backward."""
    model = _vit()
    for i, block in enumerate(models.blocks(model)):
        model.encoder.layers[i] = CheckpointedBlock(block)
    adam = lambda params: torch.optim.Adam(params, lr=1e-3, fused=True)  # noqa: E731
    streamed = WeightsOnCPU(model, models.blocks(model), "cpu", adam, dtype=torch.bfloat16)
    blocks = [u.device_flat.untyped_storage() for u in streamed.units[1:]]
    most = {"forward": 0, "backward": 0}
    phase = ["forward"]
    fetch = streamed._fetch

    def counting_fetch(unit):
        fetch(unit)
        most[phase[0]] = max(most[phase[0]], sum(s.nbytes() > 0 for s in blocks))

    streamed._fetch = counting_fetch
    x = torch.randn(BATCH, 3, 32, 32).bfloat16()
    loss = F.cross_entropy(model(x), torch.zeros(BATCH, dtype=torch.long))
    phase[0] = "backward"
    loss.backward()
    streamed.close()
    return most


def _simulated(record_timeline: bool = False, hidden: int = 64) -> tuple[planning.Estimate, dict]:
    """The simulated step of the same model and set-up; the allocator events it logged."""
    with torch.device("meta"):
        model = _vit(hidden)
    plan = planning.Plan(
        precision="bf16-true",
        micro_batch_size=BATCH,
        activation_checkpointing=("EncoderBlock",),
        weights_offload=True,
        shard_units=("EncoderBlock",),
        optimizer_in_backward=True,
        device="cuda",
    )
    images = torch.zeros(BATCH, 32, 32, 3, dtype=torch.uint8)
    labels = torch.zeros(BATCH, dtype=torch.long)
    with reserved_trace.step_events() as caught:
        est = planning.simulate(
            model, plan, make_batch=lambda: (images, labels), batch_fn=data.image_classification(32),
            record_timeline=record_timeline,
        )  # fmt: skip
    return est, caught


def test_the_simulation_holds_the_blocks_the_technique_holds():
    """One block in the forward pass (the next is fetched when the current one is done), two in backward
    (the block and the one before it), and the root all along: what WeightsOnCPU keeps, not a fixed
    count of blocks."""
    real = _blocks_on_the_device_per_pass()
    assert real == {"forward": 1, "backward": 2}
    est, _ = _simulated(record_timeline=True)
    model = _vit()
    unit = round_bytes(sum(p.numel() for p in models.blocks(model)[0].parameters()) * 2)
    in_blocks = sum(p.numel() for b in models.blocks(model) for p in b.parameters())
    root = round_bytes((sum(p.numel() for p in model.parameters()) - in_blocks) * 2)
    for phase, blocks in real.items():
        held = max(c.get("gathered_parameters", 0) for name, c in est.timeline if name.startswith(phase))
        assert held * GB == pytest.approx(blocks * unit + root), phase
    assert est.components_gb["gathered_parameters"] * GB == pytest.approx(
        2 * unit + root
    )  # the peak: backward


def test_the_copies_have_their_own_segments_and_a_freed_block_waits_for_the_compute_stream():
    """Replayed, the copy stream holds the two blocks in use and the one just freed, which the compute
    stream may still be reading: three blocks of its own (ViT-L-sized: a segment each), none the compute
    stream can use; and every gradient, copied out on another stream, is freed after record_stream too."""
    _, caught = _simulated(hidden=1024)
    events, marks = caught["events"], caught["marks"]
    step = events[marks["step"] : marks["end"]]
    kinds = [kind for kind, _, _ in step]
    assert kinds.count("alloc_copy") == 2 * LAYERS  # each block fetched for its forward and its backward
    gradients = sum(p.numel() > 0 for p in _vit().parameters())
    assert kinds.count("free_later") == kinds.count("reuse") == 2 * LAYERS + gradients
    copies, waiting, most = set(), set(), 0
    for kind, handle, _ in step:
        if kind == "alloc_copy":
            copies.add(handle)
        elif kind == "free_later" and handle in copies:
            copies.remove(handle)
            waiting.add(handle)
        elif kind == "reuse":
            waiting.discard(handle)
        most = max(most, len(copies) + len(waiting))
    assert most == 3
    allocator = CachingAllocator()
    allocator.run(events[: marks["state"]], keep=marks["step"])
    for i in range(3):
        allocator.run(step, tag=i, keep=marks["step"])
    unit = max(n for kind, _, n in step if kind == "alloc_copy")
    assert unit > 10 << 20
    assert allocator.reserved_by_stream[COPY] == 3 * -(-unit // (2 << 20)) * (2 << 20)
