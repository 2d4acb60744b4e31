"""Is your model's fast mode correct, and is the fused loss the plain loss? ``recipes/your_model.py``
run twice from the same start (same seed, weights and batches), parameters compared after training, as
``devtools/check_equivalence.py`` does for the ladder's rungs (its tolerances: ``rel_l2`` at most 1 % of
the eager run's change over all parameters, the largest element difference at most half the largest
element change).

    python -m devtools.your_model.equivalence --out runs/your-model-equivalence     # on a CUDA GPU

Rows: one model of each family the runner trains (torchvision, timm, a Hugging Face encoder, a Hugging
Face causal LM), eager against fast (compiled repeated blocks; CUDA graphs too for image models; Swin-V2-T,
whose blocks need too many compiled graphs, in CUDA graphs with eager checkpointed blocks that draw
stochastic depth's random bits), in fp32 with TF32 off and dropout off so that only the fast machinery
differs; the image model also eager against eager (the run-to-run spread of its kernels), compiled only and
graphs only; the causal LM in CUDA graphs too (``--cuda-graphs``: its own loss, the fused loss with selective
checkpointing or accumulation, LoRA, activation offload); and the causal LMs with ``--fused-loss``
against their own loss, eager (the Llama and Qwen2 0.2 B: at 2 x 511 tokens both take the torch path's
256-token chunks, 8 and 32 times Liger's, so CUDA runs the torch path; Phi-1.5, whose output projection has a
bias, at 8 x 1024 tokens, where CUDA runs Liger's kernel).
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path

from devtools.check_equivalence import _run_recipe, compare
from fabric_memory_recipes.console import Parser

REPO = Path(__file__).resolve().parents[2]
RECIPE = REPO / "recipes" / "your_model.py"
FP32 = ["--precision", "32-true", "--no-tf32", "--data", "synthetic", "--eval-batches", "1"]
LM = "hf:examples/configs/llama-0.36b"
QWEN = "hf:examples/configs/qwen2-0.2b"
ROWS = [  # (name, common flags, flags of the reference run, flags of the run checked)
    ("torchvision resnet18", ["--model", "torchvision:resnet18", "--batch-size", "32"], ["--mode", "eager"], ["--mode", "fast"]),
    ("timm vit_small", ["--model", "timm:vit_small_patch16_224", "--batch-size", "16"], ["--mode", "eager"], ["--mode", "fast"]),
    ("torchvision resnet18, eager twice", ["--model", "torchvision:resnet18", "--batch-size", "32"], ["--mode", "eager"],
     ["--mode", "eager"]),
    ("torchvision resnet18, compiled only", ["--model", "torchvision:resnet18", "--batch-size", "32"], ["--mode", "eager"],
     ["--mode", "fast", "--no-cuda-graphs"]),
    ("torchvision resnet18, graphs only", ["--model", "torchvision:resnet18", "--batch-size", "32"], ["--mode", "eager"],
     ["--mode", "eager", "--cuda-graphs"]),
    ("torchvision swin_v2_t, checkpointing (stochastic depth on; fast mode: eager blocks, CUDA graphs)",
     ["--model", "torchvision:swin_v2_t", "--batch-size", "16", "--checkpoint-blocks"], ["--mode", "eager"], ["--mode", "fast"]),
    ("hf bert-base (dropout off)", ["--model", "hf:{bert}", "--batch-size", "8", "--seq-len", "128"],
     ["--mode", "eager"], ["--mode", "fast"]),
    ("hf llama-0.36b, fused loss + selective checkpointing", ["--model", LM, "--batch-size", "2", "--seq-len", "512",
     "--fused-loss", "--checkpoint-blocks", "--checkpoint-mode", "selective"], ["--mode", "eager"], ["--mode", "fast"]),
    ("hf llama-0.36b, its own loss, CUDA graphs", ["--model", LM, "--batch-size", "2", "--seq-len", "512"],
     ["--mode", "eager"], ["--mode", "fast", "--cuda-graphs"]),
    ("hf llama-0.36b, fused loss + selective checkpointing, CUDA graphs", ["--model", LM, "--batch-size", "2",
     "--seq-len", "512", "--fused-loss", "--checkpoint-blocks", "--checkpoint-mode", "selective"],
     ["--mode", "eager"], ["--mode", "fast", "--cuda-graphs"]),
    ("hf llama-0.36b, fused loss vs its own loss (eager)", ["--model", LM, "--batch-size", "2", "--seq-len", "512",
     "--mode", "eager"], [], ["--fused-loss"]),
    ("hf phi-1.5 (its head has a bias; 8 x 1024 tokens: Liger's kernel), fused loss vs its own loss (eager)",
     ["--model", "hf:examples/configs/phi-1.5", "--batch-size", "8", "--seq-len", "1024", "--mode", "eager"], [],
     ["--fused-loss"]),
    ("hf qwen2-0.2b (152 k vocabulary), fused loss vs its own loss (eager)", ["--model", QWEN, "--batch-size", "2",
     "--seq-len", "512", "--mode", "eager"], [], ["--fused-loss"]),
    # the sets a causal LM's graph would take by default (graphs/NOTES.md's probe ran them, not compared)
    ("hf llama-0.36b, LoRA rank 8, CUDA graphs", ["--model", LM, "--batch-size", "2", "--seq-len", "512",
     "--lora-rank", "8"], ["--mode", "eager"], ["--mode", "fast", "--cuda-graphs"]),
    ("hf llama-0.36b, fused loss, accumulation 2, CUDA graphs", ["--model", LM, "--batch-size", "2", "--seq-len",
     "512", "--fused-loss", "--accumulation-steps", "2"], ["--mode", "eager"], ["--mode", "fast", "--cuda-graphs"]),
    ("hf llama-0.36b, activation offload + checkpointing, CUDA graphs", ["--model", LM, "--batch-size", "2",
     "--seq-len", "512", "--activation-offload", "--checkpoint-blocks"], ["--mode", "eager"],
     ["--mode", "fast", "--cuda-graphs"]),
]  # fmt: skip


def main() -> int:
    p = Parser(prog="python -m devtools.your_model.equivalence", description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--out", default="runs/your-model-equivalence")
    p.add_argument("--only", default=None, help="rows whose name contains this")
    a = p.parse_args()
    os.makedirs(a.out, exist_ok=True)
    # dropout draws other random bits in compiled code than in eager: off, so that only the machinery differs
    bert = json.loads((REPO / "examples/configs/bert-base-uncased/config.json").read_text())
    bert.update(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    bert_path = Path(tempfile.mkdtemp()) / "config.json"
    bert_path.write_text(json.dumps(bert))
    rows, failed = [], 0
    for name, common, ref, checked in ROWS:
        if a.only and a.only not in name:
            continue
        argv = [c.format(bert=bert_path) for c in common] + [
            *FP32,
            "--max-steps",
            str(a.steps),
            "--seed",
            "0",
        ]
        try:
            with tempfile.TemporaryDirectory() as tmp:
                base = _run_recipe(RECIPE, [*argv, *ref], tmp)
                other = _run_recipe(RECIPE, [*argv, *checked], tmp)
            row = {"row": name, "steps": a.steps, **compare(base, other)}
        except Exception as e:
            row = {"row": name, "ok": False, "error": f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"}
        failed += not row["ok"]
        rows.append(row)
        print(json.dumps(row), flush=True)
        with open(os.path.join(a.out, "equivalence.json"), "w") as f:
            json.dump(rows, f, indent=1)
    print(f"{len(rows) - failed} of {len(rows)} rows equal", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
