"""Models: ViT-L/16 (pretrained or random init) for the ladder, smaller ViTs for CPU runs and tests.

Every builder returns an ``nn.Module`` whose ``image_size`` attribute tells the data path which
resolution to resize to on the device, and whose classification head has ``num_classes`` outputs.
"""

from __future__ import annotations

import functools
import os

import torch
import torch.nn as nn
import torchvision.models as tvm
from torch.utils.flop_counter import FlopCounterMode
from torchvision.models.vision_transformer import VisionTransformer

from fabric_memory_recipes.config import VIT_MODELS, UsageError
from fabric_memory_recipes.console import notice
from fabric_memory_recipes.training.data.network import reachable
from fabric_memory_recipes.training.techniques import attention

MODEL_NAMES = VIT_MODELS
_PRETRAINED = {"vit_l_16": "ViT_L_16_Weights", "vit_b_16": "ViT_B_16_Weights"}


def _weights_available(name: str) -> object | None:
    """The torchvision weights enum for ``name`` if its file is cached or downloadable, else None."""
    enum = getattr(tvm, _PRETRAINED[name]).IMAGENET1K_V1
    cached = os.path.join(torch.hub.get_dir(), "checkpoints", os.path.basename(enum.url))
    if os.path.exists(cached) or reachable("download.pytorch.org"):
        return enum
    return None


def resolve_weights(name: str, weights: str) -> object | None:
    """Map --weights auto|pretrained|none to a torchvision weights enum (or None for random init).

    ``auto`` falls back to random init with one printed line; ``pretrained`` offline is an error.
    """
    if weights == "none" or name not in _PRETRAINED:
        if weights == "auto" and name not in _PRETRAINED:
            notice(f"[weights] {name} has no pretrained weights: random init")
        return None
    enum = _weights_available(name)
    if enum is None:
        if weights == "pretrained":
            raise UsageError(
                f"--weights pretrained: {name} weights are not cached and the network is unreachable"
            )
        notice(
            f"[weights] pretrained {name} weights unreachable (offline): random init of the same architecture"
        )
    return enum


def build_model(name: str, weights: object | None, num_classes: int = 10, image_size: int | None = None):
    """Build ``name`` with the given torchvision weights enum (None = random init) and a new head.

    ``image_size`` (``--image-size``): the input side in pixels, None for the model's own (224 for
    ViT-L/16, 32 for ``vit_tiny``). The blocks and their parameters do not depend on it; only the
    position embedding has one row per patch (and the class token). Pretrained weights are for 224 px.

    Allocation happens on the current default device/dtype, so calling this inside
    ``fabric.init_module()`` creates the model directly on the GPU in the target precision (rung 07).
    The small CPU/benchmark model (``vit_tiny``) is the exception, see :func:`_same_start`.
    """
    if image_size is not None:
        patch = 8 if name == "vit_tiny" else int(name.rsplit("_", 1)[-1])
        if image_size % patch:
            raise UsageError(f"--image-size {image_size}: {name} needs a multiple of its patch size, {patch}")
        if weights is not None and image_size != 224:
            raise UsageError(
                f"--image-size {image_size}: pretrained {name} weights are for 224 px (use --weights none)"
            )
    if name == "vit_tiny":
        # 32x32 input, 8x8 patches -> 16 tokens + class token; a few thousand parameters per block.
        return _same_start(
            lambda: VisionTransformer(
                image_size=image_size or 32,
                patch_size=8,
                num_layers=2,
                num_heads=2,
                hidden_dim=64,
                mlp_dim=128,
                num_classes=num_classes,
            )
        )
    builder = getattr(tvm, name)
    model = builder(weights=weights, **({"image_size": image_size} if image_size else {}))
    model.heads.head = nn.Linear(model.heads.head.in_features, num_classes)
    return model


def _same_start(make):
    """Build with ``make()`` so that every rung starts from the same weights for a given seed.

    The convergence benchmark (fabric_memory_recipes/tools/convergence/benchmark.py) compares rungs from the same initial weights, but
    rungs build their model in different ways: on the CPU (01-06), on the GPU in bf16 inside
    ``fabric.init_module()`` (07, 10-15, whose random numbers come from the CUDA generator), or twice
    (07). So the small model is always initialised on the CPU in fp32 from a generator reset to the
    run's seed (``torch.initial_seed()``, set by ``fabric.seed_everything``), then moved to the default
    device and dtype. The global random state is left as it was, so building it does not change the
    order in which the data is shuffled either. Cheap for a model of this size; the ladder's ViT-L/16
    keeps the rungs' own way of building.
    """
    device, dtype = torch.get_default_device(), torch.get_default_dtype()
    with torch.random.fork_rng(devices=[]), torch.device("cpu"):
        torch.manual_seed(torch.initial_seed())
        torch.set_default_dtype(torch.float32)
        try:
            model = make()
        finally:
            torch.set_default_dtype(dtype)
    return model.to(device=device, dtype=dtype)


def blocks(model) -> list:
    """The repeated transformer blocks (torchvision ViT: ``encoder.layers``), e.g. to compile or wrap each."""
    return list(model.encoder.layers)


def compile_blocks(model, enabled: bool) -> None:
    """Fast mode (``--compile``): ``torch.compile`` each block. All 24 blocks of ViT-L/16 share one
    compiled graph: fewer, fused kernel launches, and one compilation."""
    if enabled:
        for block in blocks(model):
            block.compile()


@functools.cache
def meta_ladder_model(
    name: str, num_classes: int = 10, fused_attention: bool = False, image_size: int | None = None
) -> nn.Module:
    """A ladder model (:func:`build_model`) on the meta device: shapes only, no memory, no
    initialisation cost.
    ``fused_attention``: as rung 15 runs it (fabric_memory_recipes/training/techniques/attention.py)."""
    with torch.device("meta"):
        model = build_model(name, None, num_classes, image_size)
    if fused_attention:
        attention.fuse_attention(model)
    return model


def training_flops(name: str, batch_size: int, num_classes: int = 10) -> int:
    """FLOPs of one forward+backward at ``batch_size``, counted by torch.utils.flop_counter on the meta
    device (shapes only, nothing allocated). Attention counts as its matrix products, the model's FLOPs;
    kernels that recompute (flash attention's backward) do more real work than this."""
    with torch.device("meta"):
        model = build_model(name, None, num_classes)
        size = getattr(model, "image_size", 224)
        x = torch.empty(batch_size, 3, size, size)
    with FlopCounterMode(display=False) as counter:
        model(x).sum().backward()
    return counter.get_total_flops()


def count_parameters(model, trainable_only: bool = False) -> int:
    return sum(p.numel() for p in model.parameters() if p.requires_grad or not trainable_only)
