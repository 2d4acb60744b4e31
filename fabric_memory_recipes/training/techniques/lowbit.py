"""8-bit optimizer state (rung 13, and ``recipes/your_model.py --optimizer adamw8bit``).

torchao's ``AdamW8bit`` keeps Adam's two moments block-wise quantised to 8 bits (plus one scale per
block) and dequantises them inside the update. torchao is an optional dependency (the extra
``lowbit``): :func:`adamw8bit` returns the class, or refuses in one line (exit 2) where it is missing,
so a recipe can ask for it before it builds anything.
"""

from __future__ import annotations

from fabric_memory_recipes.config import UsageError


def adamw8bit(needed_by: str) -> type:
    """torchao's ``AdamW8bit`` class; without torchao, :class:`UsageError` naming ``needed_by`` (the rung
    or the flag that asked for it)."""
    try:
        from torchao.optim import AdamW8bit  # optional: only 8-bit Adam needs it
    except ImportError:
        raise UsageError(
            f"{needed_by} needs torchao (the extra 'lowbit': python3 -m pip install -e '.[lowbit]')"
        ) from None
    return AdamW8bit
