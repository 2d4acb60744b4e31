"""Inference: generate() and a forward pass on fake tensors (planning/inference/), the estimate's components,
--infer --fit, the runner on a CPU and the check's table, with tiny configs written here (no network)."""

from __future__ import annotations

import json

import pytest
import torch

from fabric_memory_recipes.planning.inference import check, cli, simulate
from fabric_memory_recipes.planning.inference.estimate import CappedAllocator, OutOfMemory, estimate
from fabric_memory_recipes.planning.your_model.estimate import meta_user_model
from fabric_memory_recipes.training.your_model import inference, models, runner
from tests.conftest import run_estimate

LAYERS, HEADS, KV_HEADS, HEAD_DIM = 2, 4, 2, 16


def write_config(folder, **fields) -> str:
    folder.mkdir(exist_ok=True, parents=True)
    (folder / "config.json").write_text(json.dumps(fields))
    return f"hf:{folder}"


@pytest.fixture
def llama(tmp_path) -> str:
    """A 2-layer Llama with grouped key/value heads."""
    return write_config(tmp_path / "llama", model_type="llama", architectures=["LlamaForCausalLM"],
                        hidden_size=HEADS * HEAD_DIM, intermediate_size=128, num_hidden_layers=LAYERS,
                        num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, vocab_size=512,
                        max_position_embeddings=256)  # fmt: skip


@pytest.fixture
def bert(tmp_path) -> str:
    return write_config(tmp_path / "bert", model_type="bert", architectures=["BertForMaskedLM"], hidden_size=64,
                        intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, vocab_size=512)  # fmt: skip


@pytest.fixture
def t5(tmp_path) -> str:
    """A 2-layer T5: an encoder-decoder, whose generate() runs its encoder once and its decoder per token."""
    return write_config(tmp_path / "t5", model_type="t5", architectures=["T5ForConditionalGeneration"],
                        vocab_size=512, d_model=HEADS * HEAD_DIM, d_ff=128, num_layers=LAYERS, num_heads=HEADS,
                        d_kv=HEAD_DIM, is_encoder_decoder=True, decoder_start_token_id=0, pad_token_id=0,
                        eos_token_id=1)  # fmt: skip


def config(ref: str, **flags):
    return runner.default_config().with_flags(model=ref, infer=True, precision="bf16-true", **flags)


def test_the_components_add_up_and_the_kv_cache_is_its_arithmetic(llama):
    um, model, _, _ = meta_user_model(llama)
    batch, prompt, new = 8, 64, 20
    est = estimate(model, um, batch, prompt, new, "bf16-true")
    c = est.components_gb
    # keys and values of every layer for every token but the last one generated, in bf16
    assert c["kv_cache"] == pytest.approx(
        2 * LAYERS * batch * KV_HEADS * HEAD_DIM * (prompt + new - 1) * 2 / 1e9
    )
    values = sum(t.numel() for t in [*model.parameters(), *model.buffers()])
    assert c["weights"] == pytest.approx(values * 2 / 1e9)  # parameters and buffers, in bf16
    peak = max(c["weights"] + c["workspace"] + c["kv_cache"] + c["decode_working"],
               c["weights"] + c["workspace"] + c["prefill_working"] + 2 * LAYERS * batch * KV_HEADS * HEAD_DIM * prompt * 2 / 1e9)  # fmt: skip
    assert est.peak_allocated_gb == pytest.approx(peak, rel=1e-6)
    assert est.peak_reserved_gb >= est.peak_allocated_gb
    assert est.device_peak_gb == pytest.approx(est.peak_reserved_gb + est.overhead_gb)
    fp8 = estimate(model, um, batch, prompt, new, "bf16-true", "fp8")
    assert fp8.components_gb["kv_cache"] == pytest.approx(c["kv_cache"] / 2)  # one byte a value


def replay(events) -> tuple[int, int, int]:
    """The allocator model's peak allocated, peak reserved and what stays allocated after ``events``."""
    allocator = CappedAllocator()
    for kind, handle, nbytes in events:
        allocator.malloc(handle, nbytes) if kind == "alloc" else allocator.free(handle)
    return allocator.peak_allocated, allocator.peak_reserved, allocator.allocated


def test_later_decode_steps_written_from_two_recorded_ones_replay_as_if_recorded(llama):
    um, model, _, _ = meta_user_model(llama)
    new = 12
    short = simulate.record(model, um, 16, 64, new, "bf16-true")
    full = simulate.record(model, um, 16, 64, new, "bf16-true", forwards=new)
    assert len(short.starts) == simulate.RECORDED_FORWARDS and len(full.starts) == new

    written = list(simulate.decode_steps(short, new))
    assert len(written) == len(full.events)
    assert replay(written) == replay(full.events)


def test_the_capped_allocator_gives_back_free_segments_before_running_out():
    allocator = CappedAllocator(capacity=60 << 20)
    allocator.malloc("a", 20 << 20)
    allocator.free("a")  # a free 20 MiB segment, cached
    allocator.malloc("b", 40 << 20)  # 20 + 40: the card is full
    allocator.malloc("c", 5 << 20)  # the cached segment serves it
    allocator.free("c")
    with pytest.raises(OutOfMemory):  # 30 MiB fits no cached block: the free 20 go back, 40 + 30 > 60 still
        allocator.malloc("d", 30 << 20)
    assert allocator.released == 20 << 20 and allocator.reserved == 40 << 20
    allocator.malloc("e", 20 << 20)  # fits where the released segment was
    assert allocator.reserved == 60 << 20 and allocator.peak_reserved == 60 << 20


def test_encoders_and_vision_models_are_one_forward_pass(bert):
    um, model, _, _ = meta_user_model(bert)
    small, large = (estimate(model, um, b, 128, 1, "bf16-true") for b in (2, 16))
    assert small.new_tokens is None and small.peak_phase == "forward"
    assert large.components_gb["prefill_working"] > 4 * small.components_gb["prefill_working"]
    assert large.components_gb["weights"] == small.components_gb["weights"]
    um, model, _, _ = meta_user_model("timm:vit_tiny_patch16_224")
    vit = estimate(model, um, 2, 0, 1, "bf16-true")
    assert vit.task == "image_classification" and vit.kernels == ["flash"]


def test_an_encoder_decoder_generates_its_new_tokens_after_one_encoder_pass(t5):
    """generate() of an encoder-decoder, which once stopped the estimate with a traceback: its cache holds the
    decoder's keys and values for every token it read and the cross-attention's for the source, its later
    decode steps are written from two as a causal LM's are, and the runner's call writes the new tokens."""
    um, model, _, _ = meta_user_model(t5)
    batch, source, new = 4, 24, 7
    est = estimate(model, um, batch, source, new, "bf16-true")
    assert est.new_tokens == new and est.shape() == "batch 4 x (24 source tokens -> 7 new tokens)"
    # self-attention: the start token and the first new - 1 tokens; cross-attention: the source, in bf16
    per_token = 2 * LAYERS * batch * HEADS * HEAD_DIM * 2
    assert est.components_gb["kv_cache"] == pytest.approx(per_token * (new + source) / 1e9)
    short = simulate.record(model, um, batch, source, new, "bf16-true")
    full = simulate.record(model, um, batch, source, new, "bf16-true", forwards=new)
    assert len(short.starts) == simulate.RECORDED_FORWARDS and len(full.starts) == new
    assert replay(list(simulate.decode_steps(short, new))) == replay(full.events)
    real = models.build(um).eval()
    inputs = inference.model_inputs(um, real, 2, 8, torch.float32, "cpu")
    with torch.inference_mode():
        out = inference.infer(real, um, inputs, 5, "auto", torch.float32)
    assert list(out.shape) == [2, 1 + 5]  # the decoder's start token and exactly five new tokens


@pytest.fixture(scope="module")
def wide(tmp_path_factory) -> str:
    """A 2-layer Llama of width 512 with 1100 positions: a few MB a sequence at 1024 tokens (one per module:
    the fit's recordings are kept per model)."""
    return write_config(tmp_path_factory.mktemp("wide"), model_type="llama", architectures=["LlamaForCausalLM"],
                        hidden_size=512, intermediate_size=1024, num_hidden_layers=2, num_attention_heads=8,
                        vocab_size=512, max_position_embeddings=1100)  # fmt: skip


def test_fit_is_monotone_and_each_answer_fits_its_own_prediction(wide):
    cfg = config(wide, batch_size=2, seq_len=1024, new_tokens=16)
    answers = [cli.fit(cfg, budget, "h100") for budget in (1.05, 1.15)]
    batches = [a["largest_batch"] for a in answers]
    assert 1 < batches[0] < batches[1]
    assert answers[0]["most_new_tokens"] <= answers[1]["most_new_tokens"] <= 1100 - 1024
    for a in answers:
        capacity = a["budget_gb"] - a["at_largest_batch"]["overhead_gb"]
        best = cli.predict(cfg, batch_size=a["largest_batch"], capacity_gb=capacity)
        beyond = cli.predict(cfg, batch_size=a["largest_batch"] + 1, capacity_gb=capacity)
        assert best.out_of_memory is None and best.device_peak_gb <= a["budget_gb"]
        assert beyond.out_of_memory is not None


def test_a_run_on_an_emulated_card_records_the_replay_capped_as_its_allocator_is(wide):
    """A decode's growing KV cache asks for ever larger blocks: uncapped, the replay keeps every freed one
    cached (3 x the allocated peak here); on a card of --memory-budget-gb the run's allocator gives them back
    at its cap, and the prediction the run records must too (on an H100 it had said 200 GB for 23)."""
    cfg = config(wide, batch_size=64, seq_len=128, new_tokens=256)
    free = cli.predict(cfg)
    assert free.peak_reserved_gb > 2 * free.peak_allocated_gb
    capacity = cli.card_capacity_gb(1.1, "h100")
    assert free.peak_allocated_gb < capacity < free.peak_reserved_gb
    on_card = cli.for_run(cfg.with_flags(memory_budget_gb=1.1))
    assert on_card["capacity_gb"] == pytest.approx(capacity)
    assert on_card["out_of_memory"] is None and on_card["released_gb"] > 0
    assert on_card["peak_allocated_gb"] == pytest.approx(free.peak_allocated_gb)
    assert on_card["peak_reserved_gb"] <= capacity
    assert cli.for_run(cfg)["peak_reserved_gb"] == pytest.approx(free.peak_reserved_gb)


def test_largest_searches_a_monotone_answer():
    assert cli.largest(lambda n: n <= 37) == 37
    assert cli.largest(lambda n: n <= 5, most=4) == 4
    assert cli.largest(lambda n: False) == 0


@pytest.mark.parametrize("flags, says", [
    ("--precision bf16-mixed", "--infer runs the model in one dtype"),
    ("--precision bf16-true --kv-cache-dtype fp8 --model timm:vit_tiny_patch16_224", "--kv-cache-dtype goes with"),
    ("--precision bf16-true --fit 2GB --may-change precision", "--infer --fit predicts only"),
    ("--precision bf16-true --checkpoint-blocks", "--infer runs the model as built"),
    ("--precision bf16-true --seq-len 250 --new-tokens 10", "has 256 positions"),
    ("--precision bf16-true --kv-cache-dtype int3", "invalid choice"),
])  # fmt: skip
def test_bad_input_is_one_line_and_exit_2(llama, flags, says):
    model = "" if "--model" in flags else f"--model {llama}"
    tokens = "" if "--seq-len" in flags else "--seq-len 32 --new-tokens 8"
    code, out, err = run_estimate(f"fmr-estimate --infer {model} {tokens} {flags}")
    assert code == 2 and says in err and len(err.strip().splitlines()) == 1, err


def test_the_cli_prints_the_components_and_the_fit(llama, wide):
    code, out, err = run_estimate(f"fmr-estimate --model {llama} --infer --precision bf16-true --batch-size 4"
                                  " --seq-len 32 --new-tokens 8")  # fmt: skip
    assert code == 0, err
    for line in ("KV cache (last token)", "prefill working memory", "peak reserved", "whole-device peak"):
        assert line in out
    fit = f"fmr-estimate --model {wide} --infer --precision bf16-true --batch-size 2 --seq-len 1024 --new-tokens 16"
    code, out, err = run_estimate(f"{fit} --fit 1.05GB")
    assert code == 0, err
    assert "largest batch at 1024 prompt + 16 new tokens: " in out and "most new tokens at batch 2" in out
    code, out, err = run_estimate(f"{fit} --fit 0.75GB")  # the card overhead and cuBLAS's workspaces: no room
    assert code == 1 and "none (batch 1 does not fit)" in out, err


def test_the_runner_measures_on_a_cpu_and_the_check_reads_it(llama, run_recipe, tmp_path):
    proc, result = run_recipe("your_model", "--infer", "--accelerator", "cpu", "--model", llama, "--precision",
                              "bf16-true", "--batch-size", "2", "--seq-len", "16", "--new-tokens", "5", "--tag", "lm")  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert result["extra"]["inference_output_shape"] == [2, 21]
    predicted = result["extra"]["predicted_inference"]
    assert predicted["new_tokens"] == 5 and predicted["peak_allocated_gb"] > 0
    rows = check.collect(tmp_path / "results")
    assert [r["run"] for r in rows] == ["lm"] and rows[0]["predicted_device_gb"] == predicted[
        "device_peak_gb"
    ]
    assert "Whole-device peak within ±5 %: 0 of 1 rows." in check.render(rows)  # a CPU run has no device peak
