"""Experiment (a): the same number of trainable parameters, very different activation memory.

Three variants of ViT-L/16 fine-tuning, trained identically (Adam, synthetic batches):

* ``full``: every parameter trains;
* ``first block``: only ``encoder.layers[0]`` (and the new classification head) trains;
* ``last block``: only ``encoder.layers[-1]`` (and the head) trains: as many trainable parameters as
  ``first block``.

Why they differ. Autograd records an operation, and saves tensors for it, only if one of its inputs
requires a gradient. With only the last block trainable, nothing before that block requires a gradient:
blocks 0-22 run as if under ``torch.no_grad()``, and their intermediate tensors are freed as soon as the
next op has consumed them. With only the first block trainable, the loss's gradient has to travel back
through all 23 frozen blocks to reach it, so they are all recorded. They save less than in full fine-tuning
though: a frozen ``Linear`` needs its weight to pass the gradient to its input, but not its input
(that is only needed for the weight's own gradient), so the inputs of the frozen matrix products are not
kept. This is why that drop happens.

    python experiments/trainable_position.py                        # full size on a GPU
    python experiments/trainable_position.py --accelerator cpu --model vit_tiny --batch-size 8 --steps 3

Writes ``<out>/trainable_position.json``, ``<out>/trainable_position.png`` and, with ``--timelines``
(default), one memory timeline per variant (``<out>/trainable_position-<variant>-timeline.png``).
"""

from __future__ import annotations

from pathlib import Path

import harness

VARIANTS = ("full", "first block", "last block")


def build(model_name: str, variant: str):
    """The model with ``requires_grad`` set for the variant (the head always trains: it is new)."""
    model = harness.models.build_model(model_name, None, num_classes=harness.data.NUM_CLASSES)
    if variant != "full":
        for p in model.parameters():
            p.requires_grad_(False)
        block = harness.models.blocks(model)[0 if variant == "first block" else -1]
        for p in [*block.parameters(), *model.heads.parameters()]:
            p.requires_grad_(True)
    return model


def main(argv: list[str] | None = None) -> int:
    args = harness.parser(__doc__.splitlines()[0], {"batch_size": 32, "steps": 8}).parse_args(argv)
    accelerator = harness.resolve_accelerator(args.accelerator)
    fabric = harness.make_fabric(accelerator, args.precision)
    out = Path(args.out)
    rows = []
    for variant in VARIANTS:
        print(f"[trainable_position] {variant} ...", flush=True)
        rows.append(
            harness.train_variant(
                variant.replace(" ", "_"),
                lambda variant=variant: build(args.model, variant),
                fabric,
                args,
                out,
                "trainable_position",
            )
        )
        harness.release()
    payload = {
        "experiment": "trainable_position",
        "question": "same trainable count, first vs last block: how much activation memory?",
        "provenance": harness.provenance(fabric, args),
        "variants": rows,
    }
    harness.results_file.write_json_atomic(out / "trainable_position.json", payload)
    harness.plot_rows(
        rows,
        out / "trainable_position.png",
        f"Where the trainable parameters sit: {args.model}, {args.precision}, batch {args.batch_size}",
    )
    print(harness.summary_table(rows))
    print(f"[trainable_position] wrote {out / 'trainable_position.json'} and .png")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
