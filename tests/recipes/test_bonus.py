"""The bonus recipes on CPU: tiny DistilBERT / BigBird / Qwen2 configs, synthetic and real-format IMDb.

Recipes run in-process as ``__main__`` (their own ``lifecycle.run_recipe`` call: parsing, checks, results JSON,
in one interpreter that has imported torch and transformers once); run_all.sh's bonus path runs as a background process while
they do. No network (conftest sets FMR_OFFLINE=1); the "real IMDb" tests write their own aclImdb folder
or CSV and a WordPiece vocabulary file.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

from fabric_memory_recipes.config import Hardware, UsageError
from fabric_memory_recipes.measurement import results
from fabric_memory_recipes.measurement.report import render
from fabric_memory_recipes.training import hf_models
from fabric_memory_recipes.training.data import text, text_samples
from fabric_memory_recipes.training.data.text import TextConfig
from fabric_memory_recipes.training.techniques.llm_toggles import ToggleConfig
from tests.conftest import (
    REPO,
    describe,
    load_recipe_module,
    result,
    run_process,
    run_recipe_inprocess,
    session_dir,
    submit,
    subprocess_env,
)

BACKGROUND_PRIORITY = 20  # run_all.sh --bonus: one recipe process and the report
BACKGROUND_TESTS = {"test_run_all_bonus_runs_a_row_of_the_llm_table"}


def _run_all_bonus():
    tmp = session_dir("run_all-bonus")
    results = tmp / "results"
    cmd = [REPO / "run_all.sh", "--bonus", "--cpu", "--only", "bonus_llm_finetune-half"]
    env = subprocess_env(tmp / "logs", PYTHON=sys.executable)
    return run_process([*cmd, "--results-dir", str(results)], env), results


def start_background_jobs() -> None:
    submit("run_all:bonus", _run_all_bonus)


WORDS = "the a movie film was is great good wonderful loved bad awful boring hated plot actor".split()
POSITIVE = ["a wonderful film", "great plot and a good actor", "i loved the movie", "good good great"]
NEGATIVE = ["an awful film", "boring plot and a bad actor", "i hated the movie", "bad bad awful"]


# --------------------------------------------------------------------------------------------- helpers
def _run(name: str, tmp_path: Path, args: tuple[str, ...], data: str):
    argv = ["--accelerator", "cpu", "--data", data, "--weights", "none", "--log-every", "5", *args]
    return run_recipe_inprocess(name, argv, tmp_path)


def run_in_process(name: str, tmp_path: Path, *args: str, data: str = "synthetic") -> dict:
    """Run ``recipes/<name>.py`` as ``__main__`` in this interpreter (conftest.run_recipe_inprocess:
    its own flags, checks and results JSON, as ``python recipes/<name>.py`` would) and return its
    results payload; the run must succeed."""
    proc, payload = _run(name, tmp_path, args, data)
    assert proc.returncode == 0 and payload is not None, describe(proc)
    return payload


def refused(name: str, tmp_path: Path, *args: str, data: str = "synthetic") -> list[str]:
    """The same run, which must be refused: exit code 2; returns its lines on stderr."""
    proc, payload = _run(name, tmp_path, args, data)
    assert proc.returncode == 2 and payload is None, describe(proc)
    assert "Traceback" not in proc.stderr, describe(proc)
    return proc.stderr.strip().splitlines()


@pytest.fixture(autouse=True)
def _logs_in_tmp(tmp_path, monkeypatch):
    monkeypatch.setattr(results, "LOG_DIR", str(tmp_path / "logs"))


def write_vocab(folder: Path) -> Path:
    path = folder / "vocab.txt"
    path.write_text(
        "\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "and", "i", "an"] + WORDS) + "\n"
    )
    return path


def write_aclimdb(folder: Path, copies: int = 3) -> None:
    for split in ("train", "test"):
        for name, reviews in (("pos", POSITIVE), ("neg", NEGATIVE)):
            d = folder / "aclImdb" / split / name
            d.mkdir(parents=True)
            for i in range(copies):
                for j, review in enumerate(reviews):
                    (d / f"{i}_{j}.txt").write_text(review)


# ------------------------------------------------------------------------------------- synthetic data
def test_synthetic_reviews_have_imdb_like_lengths_and_a_learnable_label():
    ids = hf_models.SPECS["distilbert-base-uncased"].ids
    ds = text_samples.SyntheticReviews(400, 512, ids, seed=3)
    lengths, labels = [], []
    for i in range(len(ds)):
        input_ids, mask, label = ds[i]
        n = int(mask.sum())
        assert input_ids.shape == mask.shape == (512,)
        assert input_ids[0] == ids.cls and input_ids[n - 1] == ids.sep
        assert (input_ids[n:] == ids.pad).all() and (mask[:n] == 1).all()
        lengths.append(n)
        labels.append(int(label))
        body = input_ids[1 : n - 1]
        mine = torch.isin(body, torch.from_numpy(ds.markers[label])).float().mean()
        other = torch.isin(body, torch.from_numpy(ds.markers[1 - label])).float().mean()
        assert mine > 0.03 and other < 0.01  # the label's markers, not the other label's
    lengths_t = torch.tensor(lengths, dtype=torch.float)
    assert 190 <= lengths_t.median() <= 270  # IMDb: median ~230 tokens
    assert 0.01 <= (lengths_t == 512).float().mean() <= 0.15  # the long tail is truncated
    assert 0.4 <= sum(labels) / len(labels) <= 0.6
    again = text_samples.SyntheticReviews(400, 512, ids, seed=3)[7][0]
    assert torch.equal(again, ds[7][0])  # made on demand, reproducibly


def test_sft_example_puts_minus_100_on_prompt_and_padding_only():
    input_ids, mask, labels = text_samples.sft_example([11, 12, 13], [21, 22], max_length=8, pad_id=0)
    assert input_ids.tolist() == [11, 12, 13, 21, 22, 0, 0, 0]
    assert mask.tolist() == [1, 1, 1, 1, 1, 0, 0, 0]
    assert labels.tolist() == [-100, -100, -100, 21, 22, -100, -100, -100]
    # too long: the end is cut, the prompt stays masked
    input_ids, mask, labels = text_samples.sft_example([11, 12, 13], [21, 22, 23, 24], max_length=5, pad_id=0)
    assert labels.tolist() == [-100, -100, -100, 21, 22] and mask.tolist() == [1] * 5


def test_synthetic_sft_completions_follow_the_rule():
    ids = hf_models.SPECS["qwen2-tiny"].ids
    ds = text_samples.SyntheticSFT(50, 64, ids, seed=1)
    successor = {int(ds.answers[j]): int(ds.answers[ds.successor[j]]) for j in range(len(ds.answers))}
    for i in range(len(ds)):
        prompt, completion = ds.sample(i)
        assert len(prompt) + len(completion) <= 64 and len(completion) >= 2
        assert completion[0] == int(ds.answers[prompt[-1] % len(ds.answers)])
        assert all(successor[a] == b for a, b in zip(completion, completion[1:], strict=False))
        assert not set(prompt) & set(successor)  # prompt and completion vocabularies are disjoint
        input_ids, mask, labels = ds[i]
        n_prompt = len(prompt)
        assert (labels[:n_prompt] == -100).all()
        assert labels[n_prompt : n_prompt + len(completion)].tolist() == completion
        assert (labels[n_prompt + len(completion) :] == -100).all()


# -------------------------------------------------------------------------------------- real IMDb text
def test_aclimdb_folder_is_read_split_and_tokenized_with_a_vocab_file(tmp_path):
    write_aclimdb(tmp_path)
    spec = hf_models.SPECS["distilbert-tiny"]
    vocab = write_vocab(tmp_path)
    splits = text.load(
        "imdb", str(tmp_path), 16, spec.ids, lambda: hf_models.load_tokenizer(spec, str(vocab)), seed=0
    )
    assert splits.source == "imdb" and "aclImdb" in splits.detail
    total = 2 * 2 * 3 * len(POSITIVE)  # {train,test} x {pos,neg} x copies x reviews
    assert (len(splits.train), len(splits.val), len(splits.test)) == (
        total - round(total * 0.1) - round(total * 0.2),
        round(total * 0.1),
        round(total * 0.2),
    )
    tokenizer = hf_models.load_tokenizer(spec, str(vocab))
    assert splits.vocab_size == len(tokenizer)
    for ds in (splits.train, splits.test):
        for i in range(len(ds)):
            input_ids, mask, label = ds[i]
            assert input_ids.shape == (16,)
            n = int(mask.sum())
            assert input_ids[0] == tokenizer.cls_token_id and input_ids[n - 1] == tokenizer.sep_token_id
            words = tokenizer.decode(input_ids[1 : n - 1].tolist())
            assert (words in POSITIVE) == (int(label) == 1) and (words in POSITIVE + NEGATIVE)


def test_csv_reviews_become_sft_pairs_with_the_answer_supervised(tmp_path):
    rows = [(r, "positive") for r in POSITIVE] + [(r, "negative") for r in NEGATIVE]
    with open(tmp_path / "imdb.csv", "w") as f:
        f.write("review,sentiment\n" + "".join(f'"{r}",{s}\n' for r, s in rows * 3))
    vocab = write_vocab(tmp_path)
    with open(vocab, "a") as f:
        f.write("positive\nnegative\nsentiment\nof\nthis\nreview\nor\nanswer\n:\n?\n")
    spec = hf_models.SPECS["qwen2-tiny"]
    splits = text.load(
        "auto",
        str(tmp_path),
        40,
        spec.ids,
        lambda: hf_models.load_tokenizer(spec, str(vocab)),
        task="causal_lm",
    )
    assert splits.source == "imdb" and "csv" in splits.detail
    tokenizer = hf_models.load_tokenizer(spec, str(vocab))
    for i in range(len(splits.train)):
        input_ids, mask, labels = splits.train[i]
        supervised = labels != -100
        n = int(mask.sum())
        assert supervised.sum() >= 1 and not supervised[n:].any()  # no padding supervised
        first = int(supervised.nonzero()[0])
        assert (labels[:first] == -100).all() and supervised[first:n].all()  # prompt masked, answer not
        answer = tokenizer.decode(input_ids[first:n].tolist())
        review = tokenizer.decode(input_ids[:first].tolist())
        assert answer in ("positive", "negative")
        assert any(r in review for r in (POSITIVE if answer == "positive" else NEGATIVE))


def test_imdb_missing_offline(tmp_path):
    ids = hf_models.SPECS["distilbert-tiny"].ids
    with pytest.raises(UsageError, match="--data imdb"):
        text.load("imdb", str(tmp_path), 32, ids, lambda: None)
    assert text.load("auto", str(tmp_path), 32, ids, lambda: None).source == "synthetic"
    write_aclimdb(tmp_path, copies=1)
    with pytest.raises(UsageError, match="tokenizer"):  # data there, but no tokenizer offline
        text.load("imdb", str(tmp_path), 32, ids, lambda: None)


# ---------------------------------------------------------------------------------- recipes, end to end
def test_distilbert_before_and_after_learn(tmp_path):
    common = ("--model", "distilbert-tiny", "--max-length", "128", "--lr", "1e-3", "--eval-batches", "8")
    before = run_in_process("bonus_distilbert_before", tmp_path, *common, "--max-steps", "25")
    after = run_in_process("bonus_distilbert_after", tmp_path, *common, "--max-steps", "25")
    for p in (before, after):
        assert p["status"] == "ok" and p["provenance"]["data_source"] == "synthetic"
        assert p["provenance"]["weights"] == "random" and p["provenance"]["tokens_per_sample"] == 128
        assert p["accuracy"]["val"] > 0.75, p["accuracy"]  # 2 labels: chance is 0.5
        t = p["timing"]
        assert t["images_per_s"] is None and t["tokens_per_s"] == pytest.approx(128 * t["samples_per_s"])
    assert before["config"]["precision"] == "32-true" and before["config"]["micro_batch_size"] == 12
    assert after["config"]["precision"] == "bf16-true"
    assert (after["config"]["micro_batch_size"], after["config"]["accumulation_steps"]) == (3, 4)
    assert after["timing"]["micro_batches"] == 4 * 25
    table = render.render_table([before, after])
    assert "samples/s" in table and "tokens/s" in table and "img/s" not in table


def test_bigbird_before_learns_and_after_runs_its_defaults(tmp_path):
    common = ("--model", "bigbird-tiny", "--max-length", "128", "--eval-batches", "8")
    before = run_in_process("bonus_bigbird_before", tmp_path, *common, "--lr", "1e-3", "--max-steps", "40")
    assert before["status"] == "ok" and before["accuracy"]["val"] > 0.75, before["accuracy"]
    after = run_in_process("bonus_bigbird_after", tmp_path, *common, "--max-steps", "3")
    assert after["status"] == "ok" and after["config"]["precision"] == "bf16-true"
    assert (after["config"]["micro_batch_size"], after["config"]["accumulation_steps"]) == (1, 12)
    assert after["timing"]["micro_batches"] == 36
    assert after["loss"]["last"] == after["loss"]["last"]  # not NaN


def test_real_imdb_through_a_recipe(tmp_path):
    write_aclimdb(tmp_path)
    vocab = write_vocab(tmp_path)
    p = run_in_process(
        "bonus_distilbert_before",
        tmp_path,
        *("--model", "distilbert-tiny", "--data-dir", str(tmp_path), "--tokenizer", str(vocab)),
        *("--max-length", "16", "--batch-size", "4", "--max-steps", "3"),
        data="imdb",
    )
    assert p["status"] == "ok" and p["provenance"]["data_source"] == "imdb"
    assert "aclImdb" in p["provenance"]["data_detail"]


def test_distilbert_after_with_checkpointing_trains_on_real_imdb(tmp_path):
    """--checkpointing reaches the model (each block wrapped) with a micro-batch of the whole batch."""
    write_aclimdb(tmp_path)
    vocab = write_vocab(tmp_path)
    p = run_in_process(
        "bonus_distilbert_after",
        tmp_path,
        *("--model", "distilbert-tiny", "--data-dir", str(tmp_path), "--tokenizer", str(vocab)),
        *("--max-length", "16", "--batch-size", "4", "--accumulation-steps", "1", "--max-steps", "3"),
        *("--checkpointing", "full"),
        data="imdb",
    )
    assert p["status"] == "ok" and p["provenance"]["data_source"] == "imdb"
    assert p["extra"]["checkpointed_blocks"] == 2 and p["config"]["checkpointing"] == "full"
    assert (p["config"]["micro_batch_size"], p["timing"]["micro_batches"]) == (4, 3)
    assert p["loss"]["last"] == p["loss"]["last"]  # not NaN


def test_bigbird_after_checkpoints_its_layers_at_micro_batches_of_two(tmp_path):
    p = run_in_process(
        "bonus_bigbird_after",
        tmp_path,
        *("--model", "bigbird-tiny", "--max-length", "128", "--eval-batches", "1", "--max-steps", "2"),
        *("--accumulation-steps", "6", "--checkpointing", "selective"),
    )
    assert p["status"] == "ok" and p["extra"]["checkpointed_blocks"] == 2
    assert (p["config"]["micro_batch_size"], p["timing"]["micro_batches"]) == (2, 12)


def test_before_recipes_have_no_checkpointing_flag(tmp_path):
    err = refused(
        "bonus_distilbert_before", tmp_path, "--model", "distilbert-tiny", "--checkpointing", "full"
    )
    assert len(err) == 1 and "unrecognized arguments: --checkpointing" in err[0], err


def test_after_recipes_shard_with_fsdp_and_offload_on_several_gpus():
    from lightning.fabric.strategies import FSDPStrategy
    from transformers.models.big_bird.modeling_big_bird import BigBirdLayer
    from transformers.models.distilbert.modeling_distilbert import TransformerBlock

    for name, block in (("bonus_distilbert_after", TransformerBlock), ("bonus_bigbird_after", BigBirdLayer)):
        module = load_recipe_module(name)
        assert module.make_strategy(module.RUNG) == "auto"
        strategy = module.make_strategy(dataclasses.replace(module.RUNG, devices=4))
        assert isinstance(strategy, FSDPStrategy)
        assert set(strategy._fsdp_kwargs["auto_wrap_policy"]._module_classes) == {block}
        assert strategy.cpu_offload is not None and strategy.cpu_offload.offload_params


def test_llm_vanilla_learns_the_synthetic_completions(tmp_path):
    p = run_in_process(
        "bonus_llm_finetune",
        tmp_path,
        *("--model", "qwen2-tiny", "--max-length", "64", "--lr", "3e-3", "--max-steps", "30"),
        *("--eval-batches", "5"),
    )
    assert p["status"] == "ok" and p["extra"]["toggles"]["attn_implementation"] == "eager"
    assert p["accuracy"]["val"] > 0.5, p["accuracy"]  # chance: 1/256 answer tokens
    assert p["loss"]["last"] < p["loss"]["first"]


def _lora_trainable(r: int) -> int:
    c = hf_models.SPECS["qwen2-tiny"].overrides
    head_dim = c["hidden_size"] // c["num_attention_heads"]
    q = r * (c["hidden_size"] + c["hidden_size"])
    v = r * (c["hidden_size"] + c["num_key_value_heads"] * head_dim)
    return c["num_hidden_layers"] * (q + v)


TOGGLES = {
    "vanilla": (
        (),
        dict(
            weights_dtype="torch.float32",
            autocast=False,
            checkpointing=False,
            attn="eager",
            checkpoint_mode=None,
            fused_loss=False,
        ),
    ),  # fmt: skip
    "half": (("--half",), dict(weights_dtype="torch.bfloat16", precision="bf16-true")),
    "mixed": (("--mixed",), dict(weights_dtype="torch.float32", autocast=True, precision="bf16-mixed")),
    "checkpointing": (("--grad-checkpointing",), dict(checkpointing=True, checkpoint_mode="full")),
    "lora": (("--lora",), dict(lora=True)),
    "sdpa": (("--attn", "sdpa"), dict(attn="sdpa")),
    "all": (
        ("--all",),
        dict(
            weights_dtype="torch.bfloat16",
            checkpointing=True,
            lora=True,
            attn="sdpa",
            checkpoint_mode="selective",
            fused_loss=True,
        ),
    ),  # fmt: skip
}


@pytest.mark.parametrize("row", list(TOGGLES))
def test_llm_toggles_change_the_model(tmp_path, row):
    flags, want = TOGGLES[row]
    if "--lora" in flags or "--all" in flags:
        pytest.importorskip("peft")
    p = run_in_process(
        "bonus_llm_finetune",
        tmp_path,
        *("--model", "qwen2-tiny", "--max-length", "32", "--max-steps", "2", "--eval-batches", "1"),
        *("--batch-size", "4", "--accumulation-steps", "2", "--tag", row),
        *flags,
    )
    assert p["status"] == "ok" and p["tag"] == row
    got = p["extra"]["toggles"]
    total = p["provenance"]["parameters"]
    assert got["weights_dtype"] == want.get("weights_dtype", "torch.float32")
    assert got["autocast"] == want.get("autocast", False)
    assert got["gradient_checkpointing"] == want.get("checkpointing", False)
    assert got["attn_implementation"] == want.get("attn", "eager")
    assert got["lora"] == want.get("lora", False)
    assert got["checkpoint_mode"] == want.get("checkpoint_mode")
    assert got["fused_loss"] == want.get("fused_loss", False)
    if got["lora"]:
        assert got["trainable_parameters"] == _lora_trainable(8)
        assert total > 30 * got["trainable_parameters"]  # adapters only: the base is frozen
    else:
        assert got["trainable_parameters"] == total
    if "precision" in want:
        assert p["config"]["precision"] == want["precision"]


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (("--half", "--mixed"), "exclude each other"),
        (("--mixed", "--all"), "--all includes --half"),
        (("--half", "--precision", "32-true"), "contradicts"),
        (("--attn", "flash_attention_2"), "flash"),
    ],
)
def test_llm_impossible_toggles_exit_2(tmp_path, flags, message):
    if "flash_attention_2" in flags and importlib.util.find_spec("flash_attn") is not None:
        pytest.skip("flash-attn is installed here")
    err = refused("bonus_llm_finetune", tmp_path, "--model", "qwen2-tiny", "--max-steps", "1", *flags)
    assert len(err) == 1 and message in err[0]


def _toggles(**flags) -> ToggleConfig:
    rung = ToggleConfig(recipe="bonus_llm_finetune", model="qwen2-tiny", model_choices=hf_models.QWEN2,
                        precision=None, batch_size=12, accumulation_steps=6, cuda_graphs=False)  # fmt: skip
    return rung.with_flags(**flags).checked(Hardware(cuda_devices=1, cpu_cores=2))


def test_llm_all_runs_fast_with_its_levers_and_a_single_toggle_eagerly():
    every = _toggles(all=True)
    assert (every.mode, every.compile, every.cuda_graphs) == ("fast", True, False)
    assert (every.checkpoint_mode, every.fused_loss, every.grad_checkpointing) == ("selective", True, True)
    assert (_toggles(half=True).mode, _toggles(half=True).compile) == (
        "eager",
        False,
    )  # a row changes one thing
    assert _toggles(grad_checkpointing=True).checkpoint_mode == "full"
    old = _toggles(
        all=True, mode="eager", checkpoint_mode="full", fused_loss=False
    )  # the "all" row as measured
    assert (old.compile, old.checkpoint_mode, old.fused_loss) == (False, "full", False)
    assert _toggles(half=True, mode="fast").compile  # any row may ask for fast mode
    assert _toggles(all=True, accelerator="cpu").compile is False  # the CPU's quick path stays eager


def test_llm_checkpoint_mode_without_checkpointing_is_one_line(tmp_path):
    err = refused("bonus_llm_finetune", tmp_path, "--model", "qwen2-tiny", "--checkpoint-mode", "selective")
    assert len(err) == 1 and "--checkpoint-mode selective goes with --grad-checkpointing" in err[0]


def test_after_recipes_compile_on_one_gpu_and_leave_fsdp_units_eager():
    rung = TextConfig(recipe="bonus_distilbert_after", model="distilbert-tiny", model_choices=hf_models.DISTILBERT,
                      precision="bf16-true", batch_size=12, accumulation_steps=4, cuda_graphs=False)  # fmt: skip
    gpus = Hardware(cuda_devices=4, cpu_cores=2)
    assert rung.checked(gpus).compile and not rung.with_flags(mode="eager").checked(gpus).compile
    assert rung.with_flags(devices=4).checked(gpus).compile is False
    with pytest.raises(UsageError, match="--compile works on one device"):
        rung.with_flags(devices=4, compile=True).checked(gpus)


def test_after_recipe_refuses_several_cpu_devices(tmp_path):
    err = refused("bonus_distilbert_after", tmp_path, "--model", "distilbert-tiny", "--devices", "2")
    assert len(err) == 1 and "FSDP" in err[0]


def test_run_all_bonus_runs_a_row_of_the_llm_table():
    proc, results = result("run_all:bonus")
    assert proc.returncode == 0, describe(proc)
    assert "bonus cases" in proc.stdout.splitlines()[0]
    payload = json.loads((results / "bonus_llm_finetune-half.json").read_text())
    assert payload["config"]["precision"] == "bf16-true" and payload["provenance"]["model"] == "qwen2-tiny"
    assert payload["tag"] == "half" and payload["config"]["max_length"] == 64
    assert sorted(p.name for p in results.glob("*.json")) == ["bonus_llm_finetune-half.json", "run_all.json"]
    assert "tokens/s" in (results / "README.md").read_text()


def test_saved_activations_tool_counts_bytes(capsys):
    spec = importlib.util.spec_from_file_location(
        "saved_activations", REPO / "devtools" / "saved_activations.py"
    )
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    args = ["--model", "distilbert-tiny", "--max-length", "64", "--batch-size", "2"]

    def exact(out, line):  # the "GB (1,234 bytes" on a line
        return int(out.split(line)[1].split("GB (")[1].split(" bytes")[0].replace(",", ""))

    assert tool.main(args) == 0
    out = capsys.readouterr().out
    model = hf_models.build_model(hf_models.SPECS["distilbert-tiny"], False)
    n = hf_models.count_parameters(model)
    weights = float(out.split("weights")[1].split("GB")[0])
    assert weights == pytest.approx(n * 4 / 1e9, abs=5e-4) and exact(out, "weights") == 4 * n  # fp32
    assert exact(out, "gradients") == 4 * n and exact(out, "Adam state") == 8 * n
    saved = float(out.split("saved activations")[1].split("GB")[0])
    assert saved > 0 and "batch 2 x 64 tokens" in out
    # Saved activations leave out the weights a Linear saves: count every saved storage here, then drop
    # the parameters' and buffers' storages by hand.
    model.train()
    splits = text.synthetic(64, hf_models.SPECS["distilbert-tiny"].ids, task="classification")
    items = [splits.train[i] for i in (0, 1)]  # the tool's batch
    batch = {
        k: torch.stack([it[j] for it in items])
        for j, k in enumerate(("input_ids", "attention_mask", "labels"))
    }
    seen = {}
    with torch.autograd.graph.saved_tensors_hooks(
        lambda t: seen.setdefault(t.untyped_storage().data_ptr(), (t.untyped_storage().nbytes(), t)),
        lambda packed: packed[1],
    ):
        loss = model(**batch).loss
    state = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers()]}
    inclusive = sum(nbytes for nbytes, _ in seen.values())
    saved_weights = sum(nbytes for ptr, (nbytes, _) in seen.items() if ptr in state)
    assert saved_weights > 0 and exact(out, "saved activations") == inclusive - saved_weights
    del loss
    assert tool.main([*args, "--dtype", "bf16"]) == 0
    out = capsys.readouterr().out
    assert "bf16" in out.splitlines()[0] and exact(out, "weights") == 2 * n  # bf16: 2 bytes per parameter
    assert 0 < exact(out, "saved activations") < inclusive - saved_weights


def test_imdb_asked_for_offline_is_one_line_and_exit_2(tmp_path):
    err = refused(
        "bonus_distilbert_before", tmp_path, "--model", "distilbert-tiny", "--data-dir", str(tmp_path / "empty"),
        data="imdb",
    )  # fmt: skip
    assert len(err) == 1 and "--data imdb" in err[0], err


@pytest.mark.parametrize("name", ["bonus_distilbert_before", "bonus_llm_finetune"])
def test_bonus_recipes_refuse_cifar10_in_one_line(tmp_path, name):
    err = refused(name, tmp_path, data="cifar10")
    assert len(err) == 1 and err[0].startswith(f"{name}.py: error:"), err
    assert "invalid choice: 'cifar10'" in err[0] and "imdb" in err[0], err
    assert not any(tmp_path.iterdir())
