"""The runner for a model the user names (``recipes/your_model.py``): its flags (:class:`YourModelConfig`:
the shared ones plus the technique set as flags, which the estimator and ``--fit`` read too), its data
and batch function, and its optimizer. The techniques it applies are the ladder's own
(``training/techniques/``: checkpointing, offload, step_in_backward, lowbit), LoRA (lora), and for inference
int8 weights (weights_quant).

Data: ``--data auto`` trains an image model on scikit-learn's digits (real, offline) and a text model on
IMDb when present (training/data/text.py), else on the synthetic token stand-in of the same shape;
``--data synthetic`` always takes the stand-in (CIFAR-shaped images, IMDb-like token ids).
"""

from __future__ import annotations

import dataclasses
import functools
import os
from typing import Any, ClassVar

import torch

from fabric_memory_recipes import techniques
from fabric_memory_recipes.config import BOOL, RunConfig, UsageError, at_least, flag
from fabric_memory_recipes.training import data
from fabric_memory_recipes.training.data import seq2seq, text
from fabric_memory_recipes.training.techniques import lora, lowbit
from fabric_memory_recipes.training.techniques.inference import weights_quant
from fabric_memory_recipes.training.your_model import inference, models
from fabric_memory_recipes.training.your_model.models import UserModel

# What make_optimizer builds: SGD with momentum has no flag here, and no optimizer is --optimizer-in-backward's.
OPTIMIZERS = techniques.subset(techniques.OPTIMIZERS, "adamw", "adam", "sgd", techniques.LOWBIT_STATE.name)


@dataclasses.dataclass
class YourModelConfig(RunConfig):
    """The shared flags, ``--seq-len``, and the technique set as flags: one per record of
    ``techniques.flagged()`` (its ``flag``, ``help`` and ``field``), read when the flags are built, so that a new
    record is a flag with no field written here. A technique whose field is not one of :class:`RunConfig`'s
    is on when its name is in ``switched_on`` (``cfg.fused_loss`` reads it)."""

    seq_len: int = flag(
        256, "technique", "tokens per sequence (text models; an encoder-decoder's source)", type=at_least(8)
    )
    target_len: int | None = flag(
        None, "technique", "an encoder-decoder's target tokens (default: --seq-len)", type=at_least(2)
    )
    optimizer: str = flag("adamw", "technique", "optimizer (adamw8bit needs torchao)", choices=OPTIMIZERS)
    cuda_graphs: bool | None = flag(
        None,
        "hardware",
        "capture each optimizer step as a CUDA graph after a 2-step warm-up (default: on in fast mode for an"
        " image model or a causal LM on one CUDA device; docs/your_model.md)",
        action=BOOL,
    )
    checkpoint_mode: str = flag(
        techniques.CHECKPOINT_MODE.default,
        "technique",
        techniques.CHECKPOINT_MODE.help,
        choices=techniques.CHECKPOINT_MODE.choices,
    )
    fsdp: bool = flag(
        False,
        "technique",
        "shard with FSDP over --devices CUDA GPUs, one unit per repeated block (fast mode: FSDP2 with compiled"
        " blocks, as rung 08's FSDP2 variant)",
        action=BOOL,
    )
    cpu_offload: bool = flag(
        False,
        "technique",
        "with --fsdp: each GPU's shard of the parameters and gradients in host memory, the"
        " optimizer stepping there (FSDP's CPUOffload)",
        action=BOOL,
    )
    tokenizer: str | None = flag(None, "technique", "tokenizer folder for real text (default: the model's)")
    lora_rank: int = flag(
        0,
        "technique",
        "LoRA: freeze the weights and train rank-R adapters (and a classifier's"
        " head); 0: train every weight (training/techniques/lora.py)",
        type=at_least(0),
        metavar="R",
    )
    lora_targets: str | None = flag(
        None,
        "technique",
        "with --lora-rank: the layers adapted, comma-separated module"
        " names (default: chosen per architecture)",
        metavar="NAMES",
    )
    infer: bool = flag(
        False,
        "inference",
        "measure inference instead of training: a causal LM's generate() of"
        " --batch-size x --seq-len prompt tokens + --new-tokens (an encoder-decoder's: --seq-len"
        " source tokens, --new-tokens written), else one forward pass under"
        " torch.inference_mode (docs/inference.md)",
        action=BOOL,
    )
    new_tokens: int = flag(
        128,
        "inference",
        "tokens generate() adds to each prompt, or writes for each source (--infer)",
        type=at_least(1),
    )
    kv_cache_dtype: str = flag(
        "auto",
        "inference",
        "the KV cache's dtype (--infer; auto: the weights')",
        choices=tuple(inference.KV_CACHE_DTYPES),
    )
    weights_quant: str = flag(
        "none",
        "inference",
        "the frozen weights' storage (--infer): int8 keeps every"
        " Linear's weight in int8 with a scale per output row (torchao's weight-only int8;"
        " training/techniques/inference/weights_quant.py)",
        choices=weights_quant.KINDS,
    )
    switched_on: tuple[str, ...] = ()  # the flagged techniques on that have no field of RunConfig's, by name

    GROUPS: ClassVar[dict[str, str]] = {
        **RunConfig.GROUPS,
        "technique": "your model: the technique set",
        "inference": "your model: inference (--infer)",
    }
    DATA_CHOICES: ClassVar[tuple[str, ...]] = ("auto", "digits", "imdb", "pairs", "synthetic")
    HELP: ClassVar[dict[str, str]] = {
        "data": "auto: digits for image models; IMDb when present, else synthetic token ids, for text models;"
        " text pairs (a CSV) when present, else synthetic pairs, for encoder-decoders",
        "data_dir": "where IMDb is (aclImdb/ or imdb.csv); an encoder-decoder's pairs: a CSV (source,target) or a"
        " folder holding pairs.csv",
        "model": f"torchvision:NAME, timm:NAME or hf:ID_OR_PATH (e.g. {models.EXAMPLES})",
        "eval_batches": "limit validation/test to this many batches (default 20: a text model's test split"
        " can take longer than its training)",
    }

    # Without a GPU, `--accelerator auto` is refused (faults.wrong_machine) with the same model and
    # technique set at these small shapes, as the ladder's rungs suggest vit_tiny.
    CPU_QUICK: ClassVar[tuple[str, ...]] = ("--batch-size", "2", "--seq-len", "64", "--max-steps", "2",
                                            "--eval-batches", "2")  # fmt: skip

    @classmethod
    def flag_fields(cls) -> list[dataclasses.Field]:
        """RunConfig's flags, then the techniques' (each followed by its ``options``), then the runner's own."""
        own = [f for f in super().flag_fields() if f.name not in _technique_fields()]
        at = next(i for i, f in enumerate(own) if f.name == "seq_len")
        return own[:at] + [f for t in techniques.flagged() for f in _technique_flag(t)] + own[at:]

    def __getattr__(self, name: str) -> bool:
        """A flagged technique without a field of its own: whether it is on."""
        record = next((t for t in techniques.flagged() if t.field == name), None)
        if record is None or name.startswith("__"):
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        return record.name in self.__dict__.get("switched_on", ())

    def with_flags(self, **values: Any) -> YourModelConfig:
        """A copy with flag values changed; a flagged technique without a field goes into ``switched_on``."""
        fields = {f.name for f in dataclasses.fields(self)}
        on = set(self.switched_on)
        for t in techniques.flagged():
            if t.field in values and t.field not in fields:
                (on.add if values.pop(t.field) else on.discard)(t.name)
        switched = tuple(t.name for t in techniques.flagged() if t.name in on)
        return dataclasses.replace(self, **values, switched_on=switched)

    def uses(self, technique: techniques.Technique) -> bool:
        """Whether the technique's flag (``technique.flag``) is on."""
        return bool(getattr(self, technique.field))

    def technique_flags(self) -> list[str]:
        """The technique set as flags (what the CPU suggestion keeps of a refused command)."""
        flags = [t.flag for t in techniques.flagged() if self.uses(t)]
        flags += [techniques.LORA.flag, str(self.lora_rank)] if self.lora_rank else []
        flags += ["--lora-targets", self.lora_targets] if self.lora_rank and self.lora_targets else []
        flags += [f for t in techniques.flagged() for o in t.options for f in o.flags(getattr(self, o.field))]
        flags += ["--cpu-offload"] if self.cpu_offload else []
        return flags + (["--optimizer", self.optimizer] if self.optimizer != "adamw" else [])

    def checked(self, hardware) -> YourModelConfig:
        if self.infer and self.mode is None:  # inference compiles nothing and keeps the default allocator
            self = dataclasses.replace(self, mode="eager")
        graphs_asked = self.cuda_graphs  # None: fast mode decides
        c = super().checked(hardware)
        um = models.resolve(c.model)
        if c.cuda_graphs and not um.captured:
            if graphs_asked:
                raise UsageError(
                    f"--cuda-graphs: a {um.task.replace('_', ' ')} model's steps are not captured here (its"
                    " batch reads its padding on the host): fast mode compiles its blocks"
                )
            c.cuda_graphs = False  # a text classifier's, an encoder-decoder's: compiled blocks, eager steps
        if c.cuda_graphs and c.optimizer_in_backward:  # its per-parameter optimizers are not made capturable
            if graphs_asked:
                raise UsageError(
                    "--cuda-graphs: this runner's step in backward is not captured (its AdamW per"
                    " parameter is not capturable): fast mode compiles the blocks alone"
                )
            c.cuda_graphs = False
        for record, o in ((t, o) for t in techniques.flagged() for o in t.options):
            if getattr(c, o.field) != o.default and not c.uses(record):
                raise UsageError(f"{o.flag} {getattr(c, o.field)} goes with {record.flag}")
        if c.fsdp and (c.world_size < 2 or c.accelerator != "cuda"):
            raise UsageError("--fsdp shards over several CUDA GPUs: use it with --devices N (N >= 2) on CUDA")
        if c.lora_targets and not c.lora_rank:
            raise UsageError("--lora-targets goes with --lora-rank R")
        if c.lora_rank and c.fsdp:
            raise UsageError("--lora-rank trains on one GPU here: leave out --fsdp")
        if c.lora_rank:
            lora.require_peft()
        if c.weights_quant != "none" and not c.infer:
            raise UsageError(f"--weights-quant {c.weights_quant} quantizes frozen weights for inference: use it with"
                             " --infer")  # fmt: skip
        if c.weights_quant != "none":
            weights_quant.require_torchao(c.weights_quant)
        if c.cpu_offload and not c.fsdp:
            raise UsageError("--cpu-offload offloads FSDP's shards: use it with --fsdp --devices N")
        c.sharding = "fsdp" if c.fsdp else "none"
        return c


def _technique_fields() -> set[str]:
    return {name for t in techniques.flagged() for name in (t.field, *(o.field for o in t.options))}


def _technique_flag(t: techniques.Technique) -> list[dataclasses.Field]:
    """The flag of ``t`` (a boolean, off unless the rung says on) and its options' flags (their fields)."""
    f = flag(False, "technique", t.help, action=BOOL)
    f.name, f.type = t.field, "bool"
    options = {o.field for o in t.options}
    return [f, *(g for g in dataclasses.fields(YourModelConfig) if g.name in options)]


def default_config() -> YourModelConfig:
    """The runner's defaults (``recipes/your_model.py`` declares the same)."""
    return YourModelConfig(
        recipe="your_model",
        model="torchvision:resnet50",
        model_choices=models.SourcePrefixed(models.SOURCES),
        batch_size=32,
        lr=1e-4,
        eval_batches=20,
    )


def resolve(cfg: YourModelConfig) -> UserModel:
    """``--model`` resolved; a model of the wrong kind for ``--data`` is refused (exit 2)."""
    um = models.resolve(cfg.model)
    seq2seq = um.task == "seq2seq_lm"
    if (
        (cfg.data == "digits" and um.is_text)
        or (cfg.data == "imdb" and (not um.is_text or seq2seq))
        or (cfg.data == "pairs" and not seq2seq)
    ):
        raise UsageError(f"--data {cfg.data} does not fit {cfg.model} ({um.task.replace('_', ' ')})")
    models.check_seq_len(um, cfg.seq_len)
    if cfg.target_len is not None and not seq2seq:
        raise UsageError(f"--target-len is an encoder-decoder's; {cfg.model} is {um.task.replace('_', ' ')}")
    models.check_seq_len(um, target_len(cfg), "--target-len")
    for t in techniques.flagged():
        if cfg.uses(t) and not t.applies_to(um.task):
            raise UsageError(f"{t.flag}: {t.help}; {cfg.model} is {um.task.replace('_', ' ')}")
    return um


def load_data(cfg: YourModelConfig, um: UserModel):
    """(splits, batch_fn, num_classes) for the model's task."""
    if not um.is_text:
        splits = data.load("synthetic" if cfg.data == "synthetic" else "digits", cfg.data_dir)
        return splits, None, data.NUM_CLASSES  # batch_fn: data.image_classification(model.image_size)
    ids = models.token_ids(um)
    if um.task == "seq2seq_lm":
        return seq2seq_data(cfg, um, ids)
    choice = "synthetic" if cfg.data == "synthetic" else ("imdb" if cfg.data == "imdb" else "auto")
    splits = text.load(
        choice, cfg.data_dir, cfg.seq_len, ids, lambda: _tokenizer(cfg, um), task=um.task, seed=cfg.seed
    )
    if splits.vocab_size and splits.vocab_size > (um.vocab_size or 0):
        raise UsageError(
            f"the tokenizer's {splits.vocab_size} tokens exceed the model's vocabulary ({um.vocab_size})"
        )
    if um.task == "causal_lm":  # fast mode's graph: no token accuracy in training (text.causal_lm)
        return splits, functools.partial(text.causal_lm, train_accuracy=not cfg.cuda_graphs), um.vocab_size
    return splits, text.sequence_classification, text.NUM_LABELS


def target_len(cfg: YourModelConfig) -> int:
    """An encoder-decoder's target tokens: ``--target-len``, else ``--seq-len``."""
    return cfg.target_len or cfg.seq_len


def seq2seq_data(cfg: YourModelConfig, um: UserModel, ids):
    """(splits, batch_fn, num_classes) of an encoder-decoder: text pairs or the synthetic pairs
    (training/data/seq2seq.py), tokenized by the model's tokenizer when one is at hand, else by bytes."""
    config = um.hf_config

    def tokenizer():
        found = _tokenizer(cfg, um)
        if found is not None:
            return found
        bytes_ = seq2seq.ByteTokenizer(seq2seq.byte_offset(config))
        if len(bytes_) > (um.vocab_size or 0):
            raise UsageError(
                f"{cfg.model}: no tokenizer offline, and its {um.vocab_size} ids cannot hold the byte"
                f" tokenizer's {len(bytes_)}: pass --tokenizer DIR"
            )
        return bytes_

    splits = seq2seq.load(
        cfg.data,
        cfg.data_dir,
        cfg.seq_len,
        target_len(cfg),
        ids,
        config.eos_token_id,
        tokenizer,
        seed=cfg.seed,
    )
    if splits.vocab_size and splits.vocab_size > (um.vocab_size or 0):
        raise UsageError(
            f"the tokenizer's {splits.vocab_size} tokens exceed the model's vocabulary ({um.vocab_size})"
        )
    return splits, seq2seq.seq2seq_lm, um.vocab_size


TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "spiece.model",
    "vocab.json",
    "vocab.txt",
    "sentencepiece.bpe.model",
)


def _tokenizer(cfg: YourModelConfig, um: UserModel):
    """``--tokenizer``, else the tokenizer beside a local config (its folder), else the hub's; None offline."""
    from transformers import AutoTokenizer

    where = cfg.tokenizer or (um.name if os.path.isdir(um.name) else os.path.dirname(um.name) or None)
    holds = where and any(os.path.isfile(os.path.join(where, f)) for f in TOKENIZER_FILES)
    if where and os.path.isdir(where) and not cfg.tokenizer and not holds:  # a config's folder without one:
        return None  # transformers 5 would make an empty tokenizer of the config's type
    try:
        if where and os.path.isdir(where):
            tok = AutoTokenizer.from_pretrained(where)
        elif not os.path.exists(um.name):
            tok = AutoTokenizer.from_pretrained(um.name)
        else:
            return None
    except (OSError, ValueError):
        return None
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return tok


def make_optimizer(cfg: YourModelConfig, params: list) -> Any:
    """The optimizer the flags name (fused kernels where torch has them), over the trainable ``params``
    (LoRA's frozen weights get no state)."""
    params = [p for p in params if p.requires_grad]
    if cfg.optimizer == "adamw8bit":  # rung 13's 8-bit state
        return lowbit.adamw8bit("--optimizer adamw8bit")(params, lr=cfg.lr)
    if cfg.optimizer == "sgd":
        return torch.optim.SGD(params, lr=cfg.lr, fused=True)
    cls = torch.optim.AdamW if cfg.optimizer == "adamw" else torch.optim.Adam
    return cls(params, lr=cfg.lr, fused=True)
