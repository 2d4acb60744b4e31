"""Bytes a bonus model keeps for the backward pass, counted on the CPU: the activation term of a memory budget.

    python devtools/saved_activations.py --model distilbert-base-uncased --max-length 512
    python devtools/saved_activations.py --model Qwen/Qwen2-0.5B-Instruct --max-length 512 --batch-size 2 --attn sdpa

Builds the full-size model from its config (random init, no download), runs one training-mode forward
pass on synthetic tokens under ``torch.autograd.graph.saved_tensors_hooks`` and adds up the distinct
storages autograd saves, leaving out the parameters and buffers (``SavedTensorCounter.nbytes``: exact
bytes, not rounded to the CUDA allocator's 512-byte blocks). It also prints the exact bytes of weights,
gradients and Adam state for the chosen dtype, so the docs' back-of-envelope tables can be reproduced without a GPU.

Caveats: this is the CPU's view. On the CPU, attention with a padding mask takes the math path, which
saves the (sequence x sequence) score matrices; on a GPU, SDPA's fused kernels do not, and Hugging Face's
eager attention does on both. Temporaries that die inside the forward pass (and the caching allocator's
slack, i.e. reserved - allocated) are not counted: a GPU peak is higher than weights + grads + state +
saved activations. The measured GPU numbers are in results/published/h100/bonus/*.json.
"""

from __future__ import annotations

import time

from fabric_memory_recipes.console import Parser
from fabric_memory_recipes.planning import SavedTensorCounter
from fabric_memory_recipes.training import hf_models
from fabric_memory_recipes.training.data import text

GB = 1e9


def saved_bytes(model, batch: dict) -> int:
    """Exact bytes of the distinct storages autograd saves during ``model(**batch)``, leaving out the
    parameters and buffers (a Linear saves its weight; the weights are counted on their own line)."""
    with SavedTensorCounter([*model.parameters(), *model.buffers()]) as saved:
        out = model(**batch)  # keeps the graph, hence the saved storages, alive until counted
    nbytes = saved.nbytes
    del out
    return nbytes


def main(argv: list[str] | None = None) -> int:
    p = Parser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="distilbert-base-uncased", choices=sorted(hf_models.SPECS))
    p.add_argument("--max-length", type=int, default=512)
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32", help="weights and activations")
    p.add_argument(
        "--attn", choices=("eager", "sdpa"), help="attention implementation (default: the model's)"
    )
    args = p.parse_args(argv)

    import torch

    spec = hf_models.SPECS[args.model]
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    torch.set_default_dtype(dtype)
    model = hf_models.build_model(spec, False, attn_implementation=args.attn)
    torch.set_default_dtype(torch.float32)
    model.train()
    splits = text.synthetic(args.max_length, spec.ids, task=spec.task)
    items = [splits.train[i] for i in range(args.batch_size)]
    input_ids, mask, labels = (torch.stack([it[k] for it in items]) for k in range(3))
    batch = dict(input_ids=input_ids, attention_mask=mask, labels=labels)

    n = hf_models.count_parameters(model)
    width = torch.finfo(dtype).bits // 8
    start = time.perf_counter()
    acts = saved_bytes(model, batch)
    print(
        f"model {args.model}: {n / 1e6:.1f} M parameters, {args.dtype}, attention {model.config._attn_implementation}"
    )
    for name, nbytes in (
        ("weights", n * width),
        ("gradients", n * width),
        ("Adam state (m, v)", 2 * n * width),
    ):
        print(f"  {name:17} {nbytes / GB:7.3f} GB ({nbytes:,} bytes)")
    print(
        f"  saved activations {acts / GB:7.3f} GB ({acts:,} bytes, exact, weights excluded)"
        f" for batch {args.batch_size} x {args.max_length} tokens"
        f" ({acts / args.batch_size / GB:.3f} GB per sample; forward {time.perf_counter() - start:.0f} s on CPU)"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
