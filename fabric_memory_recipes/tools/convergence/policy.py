"""What the convergence benchmark's runs train with: the budget and learning-rate policy per model, the
rungs' own policies where one was tuned, the bf16 variants and the memory runs.

One policy for every rung (``PRESETS``): the epochs, a linear warm-up, one Adam and one SGD learning
rate, and the input size. ``TUNED`` holds what replaces it for a rung whose own policy was chosen on the
held-out validation split, never on the test split (the sweep: ``sweep.py``, docs/accuracy.md): per model,
per recipe, any of ``lr``, ``warmup_epochs`` and ``epochs``. A rung not in it runs the preset.
"""

from __future__ import annotations

from typing import Any

MODEL, CPU_MODEL = "vit_l_16", "vit_tiny"
# The training budget and learning-rate policy per model: the same for every rung of a run.
PRESETS: dict[str, dict[str, Any]] = {
    "vit_l_16": {"image_size": 64, "epochs": 30, "warmup_epochs": 2, "adam_lr": 1e-4, "sgd_lr": 0.03},
    "vit_b_16": {"image_size": 64, "epochs": 30, "warmup_epochs": 2, "adam_lr": 1e-4, "sgd_lr": 0.03},
    "vit_tiny": {"image_size": None, "epochs": 20, "warmup_epochs": 0, "adam_lr": 1e-3, "sgd_lr": 0.05},
}
POLICY_KEYS = ("lr", "warmup_epochs", "epochs")  # what a rung's tuned policy may set
# A rung's own policy, replacing the preset's values it names (--no-tuned: the preset for every rung).
# ViT-L/16's are the picks of the sweep on the validation split (results/published/h200/sgd-sweep/sweep.md:
# seed 0, one H200): the grid of rungs 06 and 10 also sets 07 and 11, which train as they do (07 is 06
# built in place, 11 is 10 with its saved tensors in host memory: the same precision, batch, SGD and
# cosine); rung 15 its own grid's. The benchmark's three seeds on the test split judge them.
SGD_AT_4X4 = {"lr": 0.06, "warmup_epochs": 2, "epochs": 30}  # rungs 06 and 10: 0.955 / 0.950
SGD_AT_4X4_RUNGS = ("06_sgd_cosine", "07_init_module", "10_activation_checkpointing", "11_activation_offload")
TUNED: dict[str, dict[str, dict[str, float]]] = {
    "vit_l_16": {
        **{recipe: dict(SGD_AT_4X4) for recipe in SGD_AT_4X4_RUNGS},
        "15_speed": {"lr": 2e-4, "warmup_epochs": 6, "epochs": 30},  # 0.933
    }
}
CURVE_POINTS = 60  # loss points per run: --log-every is chosen per rung to give about this many
LOST_POINTS = 20  # sampled steps for --lost-updates per run
LOST_RUNGS = ("01_baseline", "02_mixed_precision", "03_true_half_precision", "06_sgd_cosine")
# The other bf16 update rules, as variants of one Adam rung (03: plain by default) and one SGD rung (06:
# stochastic rounding by default): (tag, flags, flags on a CPU instead).
RULES = {r: ["--bf16-update", r] for r in ("plain", "stochastic", "kahan")}
VARIANTS: dict[str, list[tuple[str, list[str], list[str] | None]]] = {
    "03_true_half_precision": [("stochastic", RULES["stochastic"], None), ("kahan", RULES["kahan"], None)],
    "06_sgd_cosine": [
        ("plain", RULES["plain"], None),
        ("kahan", RULES["kahan"], None),
        ("mixed", ["--precision", "16-mixed"], ["--precision", "bf16-mixed"]),
    ],
}
# ViT-L/16 memory of the rules (GPU only): rung, variant, flags. Synthetic data: memory does not depend
# on the values, and 10 steps reach the steady state. Rung 14 shows what each rule costs at the floor.
OTHER_RULES = {"03_true_half_precision": ("stochastic", "kahan"), "06_sgd_cosine": ("plain", "kahan")}
OTHER_RULES["14_memory_floor"] = OTHER_RULES["06_sgd_cosine"]
MEMORY_RUNS = [
    ("02_mixed_precision", "default", []),
    ("06_sgd_cosine", "mixed", ["--precision", "16-mixed"]),
    *[(r, v, RULES.get(v, [])) for r, rules in OTHER_RULES.items() for v in ("default", *rules)],
]
MEMORY_PARALLEL = 3  # ViT-L/16 runs at once (up to ~16 GB each), in addition to --parallel
MEMORY_FLAGS = ["--model", "vit_l_16", "--data", "synthetic", "--weights", "none", "--max-steps", "10"]
MEMORY_FLAGS += ["--eval-batches", "1"]


def rung_policy(model: str, recipe: str, kind: str, common: dict[str, Any], tuned: bool = True) -> dict:
    """The lr, warm-up (epochs) and epochs one rung trains with: ``common`` (the preset, or the flags
    that replaced it: ``adam_lr``/``sgd_lr``, ``warmup_epochs``, ``epochs``) for its optimizer ``kind``
    ('adam' or 'sgd'), with the rung's ``TUNED`` entry over it unless ``tuned`` is False."""
    policy = {
        "lr": common[f"{kind}_lr"],
        "warmup_epochs": common["warmup_epochs"],
        "epochs": common["epochs"],
    }
    return policy | (TUNED.get(model, {}).get(recipe, {}) if tuned else {})
