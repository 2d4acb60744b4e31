"""int8 weights for inference (training/techniques/inference/weights_quant.py, ``--infer --weights-quant int8``): what
the runner quantizes, what the estimate's fake-tensor model holds and allocates, and the refusals."""

from __future__ import annotations

import sys

import pytest
import torch
import torch.nn as nn
from torch._subclasses.fake_tensor import FakeTensorMode

from fabric_memory_recipes.config import UsageError
from fabric_memory_recipes.planning.inference import check, simulate
from fabric_memory_recipes.planning.inference.estimate import estimate
from fabric_memory_recipes.planning.your_model.estimate import meta_user_model
from fabric_memory_recipes.training.techniques.inference import weights_quant
from tests.conftest import run_estimate
from tests.planning.inference.test_inference import write_config

HIDDEN, INTER, LAYERS, VOCAB = 64, 128, 2, 512


def tiny_llama(folder, tied: bool) -> str:
    return write_config(folder, model_type="llama", architectures=["LlamaForCausalLM"], hidden_size=HIDDEN,
                        intermediate_size=INTER, num_hidden_layers=LAYERS, num_attention_heads=4,
                        num_key_value_heads=4, vocab_size=VOCAB, max_position_embeddings=256,
                        tie_word_embeddings=tied)  # fmt: skip


@pytest.mark.parametrize("tied", [True, False])
def test_int8_weights_are_their_values_a_scale_and_a_zero_point_per_row(tmp_path, tied):
    um, model, _, _ = meta_user_model(tiny_llama(tmp_path / "m", tied))
    plain = estimate(model, um, 2, 16, 4, "bf16-true").components_gb["weights"] * 1e9
    int8 = estimate(model, um, 2, 16, 4, "bf16-true", weights_quant="int8")
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    quantized = [m for m in linears if not (tied and m is model.lm_head)]
    bf16 = sum(m.weight.numel() for m in quantized) * 2
    int8_parts = sum(
        m.weight.numel() + m.out_features * (2 + 1) for m in quantized
    )  # values, scales, zero points
    assert int8.components_gb["weights"] * 1e9 == plain - bf16 + int8_parts
    assert (
        int8.weights_quant == "int8" and model.lm_head.weight.device.type == "meta"
    )  # the caller's model as it was


def test_a_quantized_linear_on_fake_tensors_allocates_what_it_does_on_real_ones():
    """torchao's int8 matmul (the weight cast to the activations' dtype, the product, its scaling) run on
    fake tensors under the estimate's tracker logs the allocations it logs on real ones."""

    def events(fake: bool) -> list[tuple[str, int]]:
        tracker = simulate._InferenceTracker()
        with FakeTensorMode() if fake else torch.device("cpu"), tracker:
            bf16 = torch.bfloat16
            mlp = nn.Sequential(nn.Linear(64, 256, dtype=bf16), nn.GELU(), nn.Linear(256, 64, dtype=bf16))
            weights_quant.quantize(mlp, "int8")
            with torch.inference_mode():
                mlp(torch.empty(8, 64, dtype=torch.bfloat16))
        return [(kind, tracker.raw.get(h, 0) if kind == "alloc" else 0) for kind, h, _ in tracker.events]

    real = events(fake=False)
    assert real == events(fake=True)
    assert ("alloc", 256 * 64 * 2) in real  # the first layer's weight, cast to bf16 for its matmul


def test_the_runner_quantizes_and_the_check_names_it(tmp_path, run_recipe):
    ref = tiny_llama(tmp_path / "m", tied=True)
    proc, result = run_recipe("your_model", "--infer", "--accelerator", "cpu", "--model", ref, "--precision",
                              "bf16-true", "--batch-size", "2", "--seq-len", "16", "--new-tokens", "3",
                              "--weights-quant", "int8", "--tag", "q")  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert result["extra"]["weights_quant"] == {"weights_quant": "int8", "quantized_layers": 7 * LAYERS,
                                                "kept": ["lm_head"]}  # fmt: skip
    assert result["extra"]["predicted_inference"]["weights_quant"] == "int8"
    rows = check.collect(tmp_path / "results")
    assert rows[0]["weights_quant"] == "int8" and "bf16-true, int8 weights" in check.render(rows)


@pytest.mark.parametrize("flags, says", [
    ("--precision bf16-true --batch-size 2 --weights-quant int8", "use it with --infer"),
    ("--infer --precision bf16-true --seq-len 16 --new-tokens 2 --weights-quant int4", "invalid choice"),
])  # fmt: skip
def test_bad_input_is_one_line_and_exit_2(tmp_path, flags, says):
    code, out, err = run_estimate(f"fmr-estimate --model {tiny_llama(tmp_path / 'm', True)} {flags}")
    assert code == 2 and says in err and len(err.strip().splitlines()) == 1, err


def test_without_torchao_the_flag_is_refused_in_one_line(monkeypatch):
    monkeypatch.setitem(sys.modules, "torchao.quantization", None)  # import fails as if not installed
    with pytest.raises(UsageError, match=r"--weights-quant int8 needs torchao .*0\.17"):
        weights_quant.quantize(nn.Linear(4, 4), "int8")
    assert weights_quant.quantize(nn.Linear(4, 4), "none") == {"weights_quant": "none"}  # nothing asked
