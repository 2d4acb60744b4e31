"""Rung 15: torchvision's ``nn.MultiheadAttention`` replaced by one fused-qkv projection and
``scaled_dot_product_attention``, the layout timm's ViT uses.

Why. torchvision's encoder block calls ``nn.MultiheadAttention(x, x, x, need_weights=False)``, which
goes through ``F.multi_head_attention_forward``: a general function (separate or packed projections,
masks, key padding, biases on k and v, head averaging of the weights) with shape checks and reshapes
around its matrix products. Compiled, those become extra copies and graph breaks' worth of glue that
a ViT never needs. :class:`FusedQKVAttention` does only what a ViT's self-attention does: one
``Linear(d, 3d)`` for q, k and v, a reshape into heads, ``F.scaled_dot_product_attention`` (flash
attention on a GPU in bf16), and the output projection.

The arithmetic is the same: ``in_proj_weight`` is already q, k and v's weights stacked in that order,
so :func:`fuse_attention` hands the very same parameter tensors to the new module (no copy, no extra
memory; pretrained weights loaded into the stock model are kept). A state dict saved from the stock
model still loads into the fused one: the old names are mapped to the new (``in_proj_weight`` ->
``qkv.weight``, ``out_proj.*`` -> ``proj.*``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

# stock name (under the attention module's prefix) -> fused name
STATE_DICT_NAMES = {
    "in_proj_weight": "qkv.weight",
    "in_proj_bias": "qkv.bias",
    "out_proj.weight": "proj.weight",
    "out_proj.bias": "proj.bias",
}


class FusedQKVAttention(nn.Module):
    """Self-attention as one qkv ``Linear`` + ``F.scaled_dot_product_attention`` + ``proj``.

    Called like the ``nn.MultiheadAttention`` it replaces in torchvision's encoder block, ``attn(x, x,
    x, need_weights=False)`` returning ``(output, None)``; self-attention only (key and value must be the
    query) and batch-first, as in a ViT."""

    def __init__(self, qkv: nn.Linear, proj: nn.Linear, num_heads: int, dropout: float = 0.0) -> None:
        super().__init__()
        if qkv.out_features != 3 * qkv.in_features or qkv.in_features % num_heads:
            raise ValueError(f"qkv {qkv.in_features}->{qkv.out_features} does not fit {num_heads} heads")
        self.qkv, self.proj = qkv, proj
        self.num_heads = num_heads
        self.dropout = dropout
        self._register_load_state_dict_pre_hook(_rename_stock_keys)

    @classmethod
    def from_multihead(cls, mha: nn.MultiheadAttention) -> FusedQKVAttention:
        """The same attention with ``mha``'s own parameters (the tensors are shared, not copied)."""
        if not mha._qkv_same_embed_dim or not mha.batch_first or mha.bias_k is not None:
            raise ValueError("only batch-first self-attention with one packed in-projection can be fused")
        d = mha.embed_dim
        has_bias = mha.in_proj_bias is not None
        with torch.device("meta"):  # the shells' own initialisation is never used
            qkv = nn.Linear(d, 3 * d, bias=has_bias)
            proj = nn.Linear(d, d, bias=mha.out_proj.bias is not None)
        qkv.weight = mha.in_proj_weight  # q, k, v stacked in that order: the qkv layout already
        qkv.bias = mha.in_proj_bias
        proj.weight, proj.bias = mha.out_proj.weight, mha.out_proj.bias
        return cls(qkv, proj, mha.num_heads, mha.dropout)

    def forward(self, query, key=None, value=None, need_weights: bool = False):
        if (key is not None and key is not query) or (value is not None and value is not query):
            raise ValueError("FusedQKVAttention is self-attention: key and value must be the query")
        if need_weights:
            raise ValueError("FusedQKVAttention never forms the attention weights (need_weights=False)")
        b, n, d = query.shape
        # (b, n, 3d) -> (3, b, heads, n, head_dim): q, k and v for every head from one matrix product
        qkv = self.qkv(query).view(b, n, 3, self.num_heads, d // self.num_heads).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)
        dropout = self.dropout if self.training else 0.0
        out = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout)  # flash attention on a GPU
        return self.proj(out.transpose(1, 2).reshape(b, n, d)), None


def _rename_stock_keys(state_dict, prefix, *_args) -> None:
    """A state dict of the stock ``nn.MultiheadAttention`` loads into the fused module."""
    for old, new in STATE_DICT_NAMES.items():
        if prefix + old in state_dict and prefix + new not in state_dict:
            state_dict[prefix + new] = state_dict.pop(prefix + old)


def fuse_attention(model: nn.Module) -> int:
    """Replace every ``nn.MultiheadAttention`` in ``model`` by a :class:`FusedQKVAttention` holding the
    same parameters; returns how many were replaced. Call it before the optimizer is built and before
    ``torch.compile`` (the parameters stay the same objects, so either order of the optimizer works)."""
    targets = [
        (parent, name, child)
        for parent in model.modules()
        for name, child in parent.named_children()
        if isinstance(child, nn.MultiheadAttention)
    ]
    for parent, name, child in targets:
        setattr(parent, name, FusedQKVAttention.from_multihead(child))
    return len(targets)
