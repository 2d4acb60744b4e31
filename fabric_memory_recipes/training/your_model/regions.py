"""Regional compilation's graphs: how many distinct compiled graphs a model's repeated blocks need.

Fast mode compiles each repeated block in place (``compile_repeated`` in models.py). That pays when the
blocks share one compiled graph, as ViT's and the causal LMs' do. ``torch.compile`` keeps one graph per
block only while its guards pass: a block whose parameters have other shapes (the next stage of a
hierarchical model) or whose forward reads other Python numbers (Swin's shift of 0 or 4, torchvision's
stochastic-depth probability, which grows block by block) needs a graph of its own, and each graph costs a
full inductor compile of its forward and of its backward in the first step. torchvision's Swin-V2-T
needs 12 graphs for its 12 blocks. On 2 shared CPU cores (one image of 256 x 256, checkpointed blocks,
inductor's C++ vectorization off: its code for the shifted windows did not build) the first step took
198 s with static shapes (4-6 s per forward graph, 5-10 s per backward), and with torch's default
automatic dynamic shapes (the second stage's blocks recompiled with symbolic sizes, 29-46 s per graph)
189 s for 8 graphs, 4 of its 16 compiles read from inductor's disk cache, before torch's recompile limit
(8) left the last 4 blocks uncompiled. On an H100 host its first step did not end within 170 s, and
inductor failed on one of the symbolic graphs' backwards (``CantSplit``).

:func:`distinct_graphs` counts the graphs before anything is compiled: the blocks of a meta-device twin of
the model are compiled with a backend that only counts (``dynamic=False``, nothing generated) and one
training forward runs on an empty meta batch, so the count is dynamo's own, guard for guard, in about a
second or two (no memory, no random numbers drawn). ``MAX_GRAPHS`` is where regional compilation stops
paying: a model whose blocks need more stays eager (on one GPU its step is still a CUDA graph); one whose
blocks need 2 to ``MAX_GRAPHS`` compiles them with static shapes (:func:`dynamic`).
"""

from __future__ import annotations

import copy
import itertools
import os

import torch
import torch.nn as nn

# Distinct compiled graphs that regional compilation may cost a first step: ViT's blocks need one or two
# (torchvision's first block reads its input with other strides), four bound the first step's compile to
# about a minute at the per-graph times above, and torch's own recompile limit (8) then still covers the
# evaluation's graphs (``training=False``) as well.
MAX_GRAPHS = 4


def distinct_graphs(model: nn.Module, modules: list[nn.Module]) -> int | None:
    """How many graphs ``torch.compile`` makes for ``modules`` (blocks of ``model``) in one training
    forward; None when it cannot be counted: dynamo is off, the model takes no images (a text model's
    batch is not built here), or the forward fails on the meta device."""
    size = getattr(model, "image_size", None)
    if not modules or not isinstance(size, int) or _dynamo_off():
        return None
    graphs: list[int] = []

    def count(gm: torch.fx.GraphModule, example_inputs) -> object:
        graphs.append(len(gm.graph.nodes))
        return gm.forward

    try:
        twin = meta_twin(model)
        names = {id(m): name for name, m in model.named_modules()}
        with torch._dynamo.config.patch(recompile_limit=len(modules) + 1):
            for name in (names[id(m)] for m in modules):
                twin.get_submodule(name).compile(backend=count, dynamic=False)
            first = next(itertools.chain(twin.parameters(), twin.buffers()))
            twin.train()(torch.empty(2, 3, size, size, device="meta", dtype=first.dtype))
    except Exception:  # a probe: a model it cannot run compiles as it did before (no count)
        return None
    finally:
        torch.compiler.reset()  # the twin's graphs and dynamo's per-code state, before the real compile
    return len(graphs) or None


def too_many(graphs: int | None) -> bool:
    """Whether regional compilation stops paying (more than :data:`MAX_GRAPHS` graphs counted)."""
    return graphs is not None and graphs > MAX_GRAPHS


def dynamic(graphs: int | None) -> bool | None:
    """``torch.compile``'s ``dynamic`` for blocks that need ``graphs`` graphs: False (static shapes) when they
    need several, so that blocks of other shapes get static graphs rather than symbolic ones; else torch's
    default (None: automatic dynamic shapes)."""
    return False if graphs is not None and graphs > 1 else None


def fallback_notice(model_name: str, graphs: int, blocks: int) -> str:
    """The one line a run prints when its blocks stay eager."""
    return (
        f"fast mode: {model_name}'s {blocks} repeated blocks need {graphs} distinct compiled graphs (they"
        f" differ in shapes or settings; at most {MAX_GRAPHS} pay for their compile), so they run eagerly"
    )


def meta_twin(model: nn.Module) -> nn.Module:
    """A deep copy of ``model`` whose parameters and buffers are empty tensors on the meta device (nothing
    of the original's memory is copied)."""
    memo: dict[int, object] = {}
    for t in itertools.chain(model.parameters(), model.buffers()):
        empty = torch.empty_like(t, device="meta")
        memo[id(t)] = nn.Parameter(empty, t.requires_grad) if isinstance(t, nn.Parameter) else empty
    return copy.deepcopy(model, memo)


def _dynamo_off() -> bool:
    """What ``torch.compile`` itself reads before it traces anything."""
    return os.environ.get("TORCHDYNAMO_DISABLE", "") == "1" or bool(torch._dynamo.config.disable)
