"""Hugging Face models built for the your-model runner (training/your_model/hf_init.py): building one inside
``fabric.init_module()`` holds no tensor beyond its weights (``from_config`` on the device held mT5's embedding
three more times, a tied head's once), and the weights keep the model's own initialization."""

from __future__ import annotations

import json

import lightning as L
import pytest
import torch
import transformers

from fabric_memory_recipes.planning.simulation.tracking import Tracker
from fabric_memory_recipes.training.your_model import hf_init, models

VOCAB = 4096  # the embedding dominates the weights, as in mT5 (250112 x 768 of 582 M parameters)
TINY = {
    "mt5": dict(model_type="mt5", architectures=["MT5ForConditionalGeneration"], vocab_size=VOCAB, d_model=64,
                d_ff=64, d_kv=16, num_layers=1, num_decoder_layers=1, num_heads=4, feed_forward_proj="gated-gelu",
                is_encoder_decoder=True, tie_word_embeddings=False, pad_token_id=0, eos_token_id=1,
                decoder_start_token_id=0),
    "gpt2": dict(model_type="gpt2", architectures=["GPT2LMHeadModel"], vocab_size=VOCAB, n_embd=64, n_layer=1,
                 n_head=4, n_positions=64, bos_token_id=1, eos_token_id=1),
    "qwen2": dict(model_type="qwen2", architectures=["Qwen2ForCausalLM"], vocab_size=VOCAB, hidden_size=64,
                  intermediate_size=128, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                  tie_word_embeddings=True, pad_token_id=3, bos_token_id=1, eos_token_id=2),
    "bert": dict(model_type="bert", vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                 num_attention_heads=4, max_position_embeddings=64, pad_token_id=0),
}  # fmt: skip
# Embedding-sized tensors above the weights that from_config on the device held (mT5: shared, two stacks'
# embed_tokens and lm_head before tying, then lm_head untied again; a tied head: itself before tying).
EXTRA_EMBEDDINGS = {"mt5": 2, "gpt2": 1, "qwen2": 1, "bert": 0}


@pytest.fixture(scope="module")
def configs(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("hf_init")
    for name, fields in TINY.items():
        (root / f"{name}.json").write_text(json.dumps(fields))
    return {name: f"hf:{root / name}.json" for name in TINY}


class DeviceTracker(Tracker):
    """The live storages on the model's device (those on the meta device hold no memory)."""

    def record(self, t, category: str = "temporaries"):
        if isinstance(t, torch.Tensor) and t.device.type == "meta":
            return None
        return super().record(t, category)


def unique(model) -> list[torch.Tensor]:
    return list({id(t): t for t in [*model.parameters(), *model.buffers()]}.values())


def _from_config_on_the_device(um):
    """The model as ``from_config`` built it before (its own constructor on the device, tied at the end)."""
    keep = hf_init.supported
    hf_init.supported = lambda: False
    try:
        return models.build(um)
    finally:
        hf_init.supported = keep


def _build_peak(um, build) -> tuple[int, int]:
    """(the most bytes live while ``build(um)`` ran as the runner builds, the model's bytes after)."""
    fabric = L.Fabric(accelerator="cpu", devices=1, precision="bf16-true")
    tracker = DeviceTracker()
    with fabric.init_module(empty_init=False), tracker:
        model = build(um)
    assert {t.dtype for t in model.parameters()} == {torch.bfloat16}
    assert all(t.device.type == "cpu" for t in unique(model))
    return tracker.peak, sum(t.untyped_storage().nbytes() for t in unique(model))


@pytest.mark.parametrize("name", list(TINY))
def test_building_inside_init_module_holds_nothing_beyond_the_weights(configs, name):
    """As the runner builds (training/your_model/inference.py, recipes/your_model.py): the peak of live bytes
    while building is the weights' bytes; ``from_config`` on the device held EXTRA_EMBEDDINGS more."""
    embedding = VOCAB * 64 * 2  # bf16
    peak, weights = _build_peak(models.resolve(configs[name]), _from_config_on_the_device)
    assert abs(peak - weights - EXTRA_EMBEDDINGS[name] * embedding) < 0.05 * embedding, (peak, weights)
    peak, weights = _build_peak(models.resolve(configs[name]), models.build)
    assert peak - weights < 0.05 * embedding, (name, peak, weights)


def _tied_groups(model) -> list[tuple[str, ...]]:
    groups: dict[int, list[str]] = {}
    for n, p in model.named_parameters(remove_duplicate=False):
        groups.setdefault(id(p), []).append(n)
    return sorted(tuple(g) for g in groups.values() if len(g) > 1)


@pytest.mark.parametrize("name", list(TINY))
def test_the_weights_keep_the_models_own_initialization(configs, name):
    """Against ``from_config`` on the device: the same parameters, dtypes and tied pairs, equal buffers, every
    weight of the same distribution (mean and spread within sampling error, constants equal), a padding
    row zero as the embedding's init leaves it, and mT5's untied head starting as a copy of ``shared``."""
    um = models.resolve(configs[name])
    torch.manual_seed(0)
    before = _from_config_on_the_device(um)
    um = models.resolve(configs[name])
    torch.manual_seed(0)
    after = models.build(um)
    assert _tied_groups(after) == _tied_groups(before)
    old, new = dict(before.named_parameters()), dict(after.named_parameters())
    assert [(n, t.shape, t.dtype, t.requires_grad) for n, t in old.items()] == [
        (n, t.shape, t.dtype, t.requires_grad) for n, t in new.items()
    ]
    for (n, a), b in zip(
        dict(before.named_buffers()).items(), dict(after.named_buffers()).values(), strict=True
    ):
        assert torch.equal(a, b), n
    differs = 0
    for n, a in old.items():
        a, b = a.detach().float(), new[n].detach().float()
        assert torch.isfinite(b).all(), n
        if a.std() == 0 or a.numel() < 2:
            assert torch.equal(a, b), n
            continue
        differs += not torch.equal(a, b)
        tolerance = 6 / a.numel() ** 0.5
        assert abs(b.std() / a.std() - 1) < tolerance, (n, a.std(), b.std())
        assert abs(b.mean() - a.mean()) < tolerance * a.std(), (n, a.mean(), b.mean())
    assert differs  # the values are drawn again: same distribution, not the same numbers
    pad = um.hf_config.pad_token_id
    embedding = after.get_input_embeddings()
    if embedding.padding_idx is not None:
        assert not embedding.weight[pad].any()
    if name == "mt5":
        assert torch.equal(after.lm_head.weight, after.shared.weight)
        assert after.lm_head.weight.data_ptr() != after.shared.weight.data_ptr()


def test_a_model_its_initialization_misses_is_built_as_before(configs, monkeypatch):
    """A weight that the model's initialization leaves unwritten (still NaN) sends the build back to
    ``from_config`` on the device: the model comes back whole and finite."""
    calls = []
    real = transformers.AutoModelForCausalLM.from_config

    def counted(config, **kwargs):
        calls.append(torch.get_default_device().type)
        return real(config, **kwargs)

    monkeypatch.setattr(transformers.PreTrainedModel, "initialize_weights", lambda self: None)
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_config", counted)
    model = models.build(models.resolve(configs["gpt2"]))
    assert calls == ["meta", "cpu"]
    assert not hf_init.uninitialized(model)
    assert all(torch.isfinite(t).all() for t in model.parameters())


def test_on_the_meta_device_the_build_is_from_config_itself(configs):
    """The estimate's meta-device model (planning/your_model/estimate.py): shapes only, tied as built."""
    with torch.device("meta"):
        model = models.build(models.resolve(configs["qwen2"]))
    assert all(t.device.type == "meta" for t in unique(model))
    assert model.lm_head.weight is model.get_input_embeddings().weight
