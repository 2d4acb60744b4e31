"""Experiment (b): LoRA embedded in every block vs a decoupled LoRA side tower.

Three variants of ViT-L/16 fine-tuning, trained identically (Adam, synthetic batches):

* ``full``: every parameter trains (the reference);
* ``embedded``: the backbone is frozen and every encoder block gets a LoRA branch beside it,
  ``block(x) + s * up(down(x))`` (rank r): each block's output, and so the next block's input, depends on a
  trainable parameter;
* ``tower``: the backbone is frozen and untouched; a tower of the same LoRA modules (same parameter
  count) runs beside it, fed by the backbone's block outputs: ``t_i = lora_i(h_i + t_{i-1})``, and the
  result is added to the backbone's final representation before the head.

Why the tower can free the backbone's activations. In the embedded form every block's input requires a
gradient (it depends on the LoRA branches below it), so autograd records every frozen block and keeps
what it needs to pass the gradient through: memory grows with depth, as for training the first block in
experiment (a). In the tower form no input of a backbone block ever requires a gradient: the backbone
runs without a graph, each of its intermediate tensors is freed as soon as it is consumed, and only the
tower's own inputs (one token tensor per block) are saved. Backward never enters the backbone, which is
also why it is faster.

    python experiments/lora_tower.py                         # full size on a GPU
    python experiments/lora_tower.py --accelerator cpu --model vit_tiny --batch-size 8 --steps 3

Writes ``<out>/lora_tower.json``, ``<out>/lora_tower.png`` and, with ``--timelines`` (default), one memory
timeline per variant.
"""

from __future__ import annotations

import math
from pathlib import Path

import harness
import torch
from torch import nn

VARIANTS = ("full", "embedded", "tower")


class LoRA(nn.Module):
    """x -> s * up(down(x)), rank r; ``up`` starts at zero, so the model starts as the backbone."""

    def __init__(self, dim: int, rank: int, alpha: float) -> None:
        super().__init__()
        self.down = nn.Linear(dim, rank, bias=False)
        self.up = nn.Linear(rank, dim, bias=False)
        self.scale = alpha / rank
        nn.init.kaiming_uniform_(self.down.weight, a=math.sqrt(5))
        nn.init.zeros_(self.up.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.up(self.down(x)) * self.scale


class EmbeddedBlock(nn.Module):
    """A frozen encoder block with a LoRA branch beside it: block(x) + lora(x)."""

    def __init__(self, block: nn.Module, dim: int, rank: int, alpha: float) -> None:
        super().__init__()
        self.block = block
        self.lora = LoRA(dim, rank, alpha)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.block(x) + self.lora(x)


class TowerViT(nn.Module):
    """A frozen torchvision ViT plus a LoRA tower fed by its block outputs."""

    def __init__(self, vit: nn.Module, rank: int, alpha: float) -> None:
        super().__init__()
        self.vit = vit
        self.image_size = vit.image_size
        dim = vit.hidden_dim
        self.tower = nn.ModuleList(LoRA(dim, rank, alpha) for _ in vit.encoder.layers)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        vit = self.vit
        x = vit._process_input(images)
        x = torch.cat([vit.class_token.expand(x.shape[0], -1, -1), x], dim=1)
        x = vit.encoder.dropout(x + vit.encoder.pos_embedding)
        outputs = []
        for block in vit.encoder.layers:  # the backbone: no input requires a gradient, no graph
            x = block(x)
            outputs.append(x)
        x = vit.encoder.ln(x)
        t = torch.zeros_like(outputs[0])
        for i, lora in enumerate(self.tower):
            t = lora(outputs[i] + t)
            outputs[i] = None  # the backbone's output is no longer needed once the tower consumed it
        return vit.heads(x[:, 0] + t[:, 0])


def build(model_name: str, variant: str, rank: int, alpha: float) -> nn.Module:
    """The variant, with requires_grad set: LoRA modules and the (new) head train, the backbone does not."""
    vit = harness.models.build_model(model_name, None, num_classes=harness.data.NUM_CLASSES)
    if variant == "full":
        return vit
    for p in vit.parameters():
        p.requires_grad_(False)
    for p in vit.heads.parameters():
        p.requires_grad_(True)
    if variant == "embedded":
        layers = vit.encoder.layers
        for i in range(len(layers)):
            layers[i] = EmbeddedBlock(layers[i], vit.hidden_dim, rank, alpha)
        return vit
    return TowerViT(vit, rank, alpha)


def main(argv: list[str] | None = None) -> int:
    p = harness.parser(__doc__.splitlines()[0], {"batch_size": 32, "steps": 8})
    p.add_argument("--rank", type=int, default=8, help="LoRA rank r")
    p.add_argument("--alpha", type=float, default=16.0, help="LoRA scale numerator (scale = alpha / r)")
    args = p.parse_args(argv)
    accelerator = harness.resolve_accelerator(args.accelerator)
    fabric = harness.make_fabric(accelerator, args.precision)
    out = Path(args.out)
    rows = []
    for variant in VARIANTS:
        print(f"[lora_tower] {variant} ...", flush=True)
        rows.append(
            harness.train_variant(
                variant,
                lambda variant=variant: build(args.model, variant, args.rank, args.alpha),
                fabric,
                args,
                out,
                "lora_tower",
            )
        )
        harness.release()
    payload = {
        "experiment": "lora_tower",
        "question": "embedded LoRA vs a decoupled LoRA tower: memory and phase times",
        "lora": {"rank": args.rank, "alpha": args.alpha},
        "provenance": harness.provenance(fabric, args),
        "variants": rows,
    }
    harness.results_file.write_json_atomic(out / "lora_tower.json", payload)
    harness.plot_rows(
        rows,
        out / "lora_tower.png",
        f"Embedded LoRA vs LoRA tower: {args.model}, {args.precision}, batch {args.batch_size}, r={args.rank}",
    )
    print(harness.summary_table(rows))
    print(f"[lora_tower] wrote {out / 'lora_tower.json'} and .png")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
