"""The checkpoint file predicted (planning/your_model/saved_file.py) against files written: torch.save of
states of many shapes, and checkpoints the runner saves through training/checkpoints.py on a CPU."""

from __future__ import annotations

import collections
import io
import json
from pathlib import Path

import pytest
import torch

from fabric_memory_recipes.planning.__main__ import main as estimate_main
from fabric_memory_recipes.planning.your_model import saved_file
from fabric_memory_recipes.training import checkpoints
from tests.planning.test_your_model import write_config
from tests.tiny import HF_LLAMA


def test_the_archive_size_of_a_state_is_what_torch_save_writes():
    """Storages of every size and dtype, a tied one, nested containers, a state_dict's _metadata: the size
    computed from meta tensors is the buffer torch.save fills, to a few bytes per tensor."""
    g = torch.Generator().manual_seed(0)
    sizes = torch.randint(1, 70_000, (300,), generator=g).tolist()
    dtypes = (torch.float32, torch.bfloat16, torch.int64, torch.uint8)
    weights = collections.OrderedDict(
        (f"layer.{i}.weight", torch.zeros(n, dtype=dtypes[i % 4])) for i, n in enumerate(sizes)
    )
    weights["tied.weight"] = weights["layer.0.weight"]  # one storage, saved once
    weights._metadata = {f"layer.{i}": {"version": 1} for i in range(300)}
    real = {
        "model": weights,
        "optimizer": {
            "state": {0: {"step": torch.tensor(1.0), "exp_avg": torch.zeros(3, 4)}},
            "param_groups": [{"lr": 1e-3, "params": [0]}],
        },
        "step": 7,
        "cuda_rng": None,
    }
    buffer = io.BytesIO()
    torch.save(real, buffer)

    def meta(x):
        if isinstance(x, dict):
            out = type(x)((k, meta(v)) for k, v in x.items())
            if hasattr(x, "_metadata"):
                out._metadata = x._metadata
            return out
        return x.to("meta") if isinstance(x, torch.Tensor) else x

    state = meta(real)
    state["model"]["tied.weight"] = state["model"]["layer.0.weight"]
    predicted, storages = saved_file.archive_bytes(state)
    assert len(storages) == 302
    assert predicted == pytest.approx(len(buffer.getvalue()), abs=8 * 302)


@pytest.fixture
def llama(tmp_path) -> str:
    return "hf:" + write_config(tmp_path / "llama", **HF_LLAMA)


def test_a_checkpoint_the_runner_saves_is_the_predicted_size(run_recipe, llama, tmp_path, capsys):
    """The runner (LoRA, bf16 weights, AdamW) records the checkpoint file's predicted size; the file
    training/checkpoints.py writes (--checkpoint-every 1) is within 1 % of it, and the estimate's command
    line says the same. The file holds every weight in bf16 and the adapters' optimizer state only."""
    extra = ["--lora-rank", "4", "--precision", "bf16-true"]
    folder = tmp_path / "ckpt"
    proc, result = run_recipe("your_model", "--accelerator", "cpu", "--model", llama, "--seq-len", "32",
                              "--batch-size", "2", "--max-steps", "2", "--eval-batches", "1", "--data", "synthetic",
                              "--checkpoint-every", "1", "--checkpoint-dir", str(folder), *extra)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    (path,) = [p for _, p in checkpoints.listing(str(folder))]
    predicted = result["extra"]["predicted_card"]["checkpoint_file"]
    assert predicted["total_bytes"] == pytest.approx(Path(path).stat().st_size, rel=0.01)
    saved = torch.load(path, weights_only=False)
    trainable = result["extra"]["trainable_parameters"]
    moments = [t for s in saved["optimizer"]["state"].values() for k, t in s.items() if k != "step"]
    assert (
        result["extra"]["lora"]["adapted_layers"] == 14
        and 0 < trainable < result["provenance"]["parameters"] / 5
    )
    assert sum(t.numel() for t in moments) == 2 * trainable  # no state for the frozen weights
    assert {t.dtype for t in saved["model"].values() if t.is_floating_point()} == {torch.bfloat16}
    assert predicted["weights_dtype"] == "bfloat16" and predicted["optimizer_saved"]
    assert estimate_main(["--model", llama, "--seq-len", "32", "--batch-size", "2", "--accelerator", "cpu",
                          *extra, "--json"]) == 0  # fmt: skip
    cli = json.loads(capsys.readouterr().out)["saved_checkpoint"]
    assert cli["total_bytes"] == pytest.approx(predicted["total_bytes"], rel=1e-3)
