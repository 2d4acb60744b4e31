"""Fast mode of the bonus after recipes on a CPU: what lets their steps be captured as CUDA graphs.

A CUDA graph cannot wait for the host. DistilBERT's step would, at the 2-D padding mask that Hugging Face
checks on the host (``text.sequence_classification_capturable`` hands it over as 4-D); BigBird's would, at
the random blocks copied from the host at every call (``hf_models.fix_random_blocks(..., on_device=True)``).
Here: each gives the loss and gradients of the path it replaces, reads nothing on the host, and the
after recipe's fast-mode step, replayed by fast mode's bookkeeping (the CUDA graph stood in for, as in
tests/training/test_graphs.py), trains as the eager step does on real-format IMDb.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from fabric_memory_recipes.config import Hardware, UsageError
from fabric_memory_recipes.training import data, hf_models, loop, loop_plumbing
from fabric_memory_recipes.training.data import text
from fabric_memory_recipes.training.techniques import checkpointing
from tests.conftest import load_recipe_module
from tests.recipes.test_bonus import write_aclimdb, write_vocab
from tests.tiny import make_log, settings
from tests.training.test_graphs import FakeGraph, FakeStepGraph

HOST_READS = ("aten._local_scalar_dense.default", "aten.is_nonzero.default", "aten.item.default")


class HostReads(TorchDispatchMode):
    """Counts the ops that copy a tensor's value to the host (``.item()``, ``bool(t)``, ``.all()`` tested)."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += str(func) in HOST_READS
        return func(*args, **(kwargs or {}))


def _no_dropout(model):
    """The two paths compared must draw no random bits (DistilBERT's attention reads its Dropout's p too)."""
    for m in model.modules():
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0
    return model


def loss_and_gradients(model, batch_fn, batch, reads_mode=HostReads):
    """(loss, the gradients, host reads counted by ``reads_mode``, the predictions) of one forward and backward."""
    model.zero_grad()
    reads = reads_mode()
    with reads:
        loss, predicted, _ = batch_fn(model, batch)
        loss.backward()
    grads = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    return loss.detach(), grads, reads.count, predicted


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_the_4d_padding_mask_gives_the_2d_masks_loss_and_gradients_without_host_reads(attn):
    torch.manual_seed(0)
    spec = hf_models.SPECS["distilbert-tiny"]
    model = _no_dropout(hf_models.build_model(spec, False, attn_implementation=attn)).train()
    ids = torch.randint(8, 1000, (3, 32))
    mask = torch.ones(3, 32, dtype=torch.long)
    mask[0, 20:] = 0
    mask[2, 5:] = 0
    for m in (mask, torch.ones_like(mask)):  # padded, and nothing padded (where a 2-D mask is dropped)
        batch = (ids, m, torch.tensor([0, 1, 1]))
        want = loss_and_gradients(model, text.sequence_classification, batch)
        got = loss_and_gradients(model, text.sequence_classification_capturable, batch)
        torch.testing.assert_close(got[0], want[0], rtol=1e-6, atol=1e-7)
        for a, b in zip(got[1], want[1], strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
        assert got[2] == 0  # nothing read on the host: capturable
        assert want[2] >= 1  # the 2-D mask is checked on the host


class TensorsFromArrays(TorchFunctionMode):
    """Counts the ``torch.tensor(numpy array)`` calls that reach torch: copies from the host."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.count += func is torch.tensor and bool(args) and isinstance(args[0], np.ndarray)
        return func(*args, **(kwargs or {}))


def _bigbird(seq: int = 128):
    torch.manual_seed(0)
    model = _no_dropout(hf_models.build_model(hf_models.SPECS["bigbird-tiny"], False)).train()
    ids = torch.randint(8, 1000, (2, seq))
    mask = torch.ones(2, seq, dtype=torch.long)
    mask[1, 90:] = 0
    return model, (ids, mask, torch.tensor([0, 1]))


def test_bigbird_blocks_kept_on_the_device_give_the_redrawn_blocks_results_with_no_host_copy():
    model, batch = _bigbird()
    kept = copy.deepcopy(model)
    assert hf_models.fix_random_blocks(kept, 128, on_device=True) == 2
    for _ in range(2):
        copies_redrawn, copies_kept = TensorsFromArrays(), TensorsFromArrays()
        with copies_redrawn:
            want = loss_and_gradients(model, text.sequence_classification, batch)
        with copies_kept:
            got = loss_and_gradients(kept, text.sequence_classification, batch)
        assert torch.equal(got[0], want[0])
        assert all(torch.equal(a, b) for a, b in zip(got[1], want[1], strict=True))
        assert (copies_redrawn.count, copies_kept.count) == (2, 0)  # one per layer; none kept on the device
        assert got[2] == 0  # and nothing else read on the host


def test_drawing_the_blocks_leaves_the_training_its_random_bits():
    """The pass that draws the blocks runs with dropout on; the training after it draws what it would have
    drawn without that pass (so a fast run's dropout masks are the eager run's)."""
    torch.manual_seed(0)
    model = hf_models.build_model(hf_models.SPECS["bigbird-tiny"], False)
    state = torch.get_rng_state()
    hf_models.fix_random_blocks(model, 128)
    assert torch.equal(torch.get_rng_state(), state)


def test_bigbird_blocks_on_the_device_refuse_a_length_that_falls_back_to_full_attention():
    model, _ = _bigbird()
    with pytest.raises(UsageError, match="--max-length 64: BigBird falls back to full attention"):
        hf_models.fix_random_blocks(model, 64, on_device=True)  # bigbird-tiny: block-sparse above 72 tokens


def _train(fabric, model, loader, batch_fn, graphed, monkeypatch):
    model = copy.deepcopy(model)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3, fused=True)
    model, optimizer = fabric.setup(model, optimizer)
    if graphed:
        monkeypatch.setattr(loop_plumbing, "StepGraph", FakeStepGraph)
    log = make_log()
    cfg = settings(accumulation_steps=4, max_steps=5, log_every=1, cuda_graphs=graphed)
    loop.fit(fabric, model, optimizer, loader, batch_fn, cfg, log, num_classes=text.NUM_LABELS)
    monkeypatch.undo()
    return model, log


def test_distilbert_after_fast_step_replayed_trains_as_the_eager_step_on_real_imdb(
    fabric, tmp_path, monkeypatch
):
    write_aclimdb(tmp_path, copies=4)
    spec = hf_models.SPECS["distilbert-tiny"]
    vocab = str(write_vocab(tmp_path))
    splits = text.load("imdb", str(tmp_path), 16, spec.ids, lambda: hf_models.load_tokenizer(spec, vocab))
    assert splits.source == "imdb"
    torch.manual_seed(0)
    model = hf_models.build_model(spec, False, num_labels=text.NUM_LABELS, vocab_size=splits.vocab_size)
    checkpointing.checkpoint_blocks(model, ("TransformerBlock",), "full")  # --checkpointing, recomputed too
    FakeGraph.captures, FakeStepGraph.replays = 0, []
    runs = {}
    for graphed, batch_fn in (
        (False, text.sequence_classification),
        (True, text.sequence_classification_capturable),
    ):
        torch.manual_seed(1)  # the same shuffle and dropout draws
        train, _, _ = data.build_loaders(splits.datasets(), 2, 2)
        runs[graphed] = _train(fabric, model, fabric.setup_dataloaders(train), batch_fn, graphed, monkeypatch)
    (eager, log_e), (fast, log_f) = runs[False], runs[True]
    assert FakeGraph.captures == 1 and len(FakeStepGraph.replays) == 5 - 2  # 2 warm-up steps, then replays
    assert log_f.optimizer_steps == log_e.optimizer_steps == 5 and log_f.micro_batches == 20
    for p, q in zip(fast.parameters(), eager.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
    assert log_f.loss["last"] == pytest.approx(log_e.loss["last"], rel=1e-5)
    assert not torch.equal(next(fast.parameters()), next(model.parameters()))  # it trained


def test_after_recipes_fast_mode_is_a_cuda_graph_on_one_gpu_compiled_for_distilbert_only():
    gpu, gpus = Hardware(cuda_devices=1, cpu_cores=2), Hardware(cuda_devices=4, cpu_cores=2)
    distilbert = load_recipe_module("bonus_distilbert_after").RUNG
    bigbird = load_recipe_module("bonus_bigbird_after").RUNG
    for rung, compiled in ((distilbert, True), (bigbird, False)):
        fast = rung.checked(gpu)
        assert (fast.mode, fast.compile, fast.cuda_graphs) == ("fast", compiled, True)
        eager = rung.with_flags(mode="eager").checked(gpu)
        assert (eager.compile, eager.cuda_graphs) == (False, False)
        assert (
            rung.with_flags(cuda_graphs=False).checked(gpu).compile is compiled
        )  # steps eager, blocks as before
        sharded = rung.with_flags(devices=4).checked(gpus)  # FSDP: eager units, no graph
        assert (sharded.compile, sharded.cuda_graphs) == (False, False)
        assert rung.checked(Hardware(cuda_devices=0, cpu_cores=2)).cuda_graphs is False  # CPU: eager
        assert (
            rung.checkpointing is None
            and rung.with_flags(checkpointing="full").checked(gpu).checkpointing == "full"
        )
    assert distilbert.micro_batch_size == 3 and bigbird.micro_batch_size == 1  # the memory lesson unchanged


def _fast_mode_on_the_cpu(module, monkeypatch) -> list[dict]:
    """The recipe's checks see one CUDA GPU, so its defaults resolve to fast mode (a CUDA graph per step);
    Fabric is then built on the CPU, and the graph stood in for (tests/training/test_graphs.py). Returns the
    keyword arguments the recipe gave Fabric."""
    import lightning

    from fabric_memory_recipes.training import cli

    gpu = Hardware(cuda_devices=1, cpu_cores=2, bf16_supported=lambda: True)
    monkeypatch.setattr(cli, "detect_hardware", lambda: gpu)
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "")  # fast mode would set the allocator's for this process
    seen: list[dict] = []
    fabric = lightning.Fabric  # the recipe's L.Fabric is this class: patched below

    def on_the_cpu(*args, **kwargs):
        seen.append(kwargs)
        return fabric(*args, **{**kwargs, "accelerator": "cpu"})

    monkeypatch.setattr(module.L, "Fabric", on_the_cpu)
    monkeypatch.setattr(loop_plumbing, "StepGraph", FakeStepGraph)
    FakeGraph.captures, FakeStepGraph.replays = 0, []
    return seen


def _results(folder) -> dict:
    import json

    (path,) = folder.glob("*.json")
    return json.loads(path.read_text())


def test_distilbert_after_fast_mode_replays_its_capturable_step(tmp_path, monkeypatch):
    from fabric_memory_recipes.training import lifecycle

    module = load_recipe_module("bonus_distilbert_after")
    seen = _fast_mode_on_the_cpu(module, monkeypatch)
    calls = {"capturable": 0, "plain": 0}

    def counted(fn, key):
        def batch_fn(model, batch):
            calls[key] += 1
            return fn(model, batch)

        return batch_fn

    monkeypatch.setattr(
        text,
        "sequence_classification_capturable",
        counted(text.sequence_classification_capturable, "capturable"),
    )
    monkeypatch.setattr(text, "sequence_classification", counted(text.sequence_classification, "plain"))
    argv = ["--model", "distilbert-tiny", "--max-length", "32", "--max-steps", "4", "--data", "synthetic",
            "--weights", "none", "--eval-batches", "1", "--results-dir", str(tmp_path)]  # fmt: skip
    assert lifecycle.run_recipe(module.main, module.RUNG, module.__doc__, argv=argv) == 0
    p = _results(tmp_path)
    assert p["status"] == "ok" and p["config"]["accelerator"] == "cuda"
    assert (p["mode"], p["config"]["compile"], p["config"]["cuda_graphs"]) == ("fast", True, True)
    assert seen[0]["precision"] == "bf16-true" and seen[0]["strategy"] == "auto" and seen[0]["devices"] == 1
    assert FakeGraph.captures == 1 and len(FakeStepGraph.replays) == 4 - 2  # warm-up 2, then replays
    assert calls["capturable"] == 4 * 4 + 2 and calls["plain"] == 0  # 4 steps of 4 micro-batches, 2 evaluated


def test_bigbird_after_fast_mode_keeps_its_blocks_on_the_device_and_compiles_nothing(tmp_path, monkeypatch):
    from fabric_memory_recipes.training import lifecycle

    module = load_recipe_module("bonus_bigbird_after")
    _fast_mode_on_the_cpu(module, monkeypatch)
    asked = []
    fix = hf_models.fix_random_blocks

    def recorded(*args, **kwargs):
        asked.append(kwargs)
        return fix(*args, **kwargs)

    monkeypatch.setattr(hf_models, "fix_random_blocks", recorded)
    argv = ["--model", "bigbird-tiny", "--max-length", "128", "--max-steps", "3", "--batch-size", "4",
            "--accumulation-steps", "2", "--data", "synthetic", "--weights", "none", "--eval-batches", "1",
            "--results-dir", str(tmp_path)]  # fmt: skip
    assert lifecycle.run_recipe(module.main, module.RUNG, module.__doc__, argv=argv) == 0
    p = _results(tmp_path)
    assert p["status"] == "ok" and (p["config"]["compile"], p["config"]["cuda_graphs"]) == (False, True)
    assert asked == [{"on_device": True}] and "compiled_blocks" not in p["extra"]
    assert FakeGraph.captures == 1 and len(FakeStepGraph.replays) == 3 - 2
