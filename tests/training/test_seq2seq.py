"""Encoder-decoders in the your-model runner (training/data/seq2seq.py, training/your_model/): a tiny T5 learns
the synthetic pairs in a few steps, the runner trains on text pairs the test writes (real English from
scikit-learn's bundled descriptions, byte tokens offline) with checkpointed encoder and decoder blocks and the
fused loss, and bad pairs are one line."""

from __future__ import annotations

import csv
import itertools
import json

import pytest
import torch
from sklearn import datasets
from torch.utils.data import DataLoader, default_collate

from fabric_memory_recipes.config import UsageError
from fabric_memory_recipes.training.data import seq2seq
from fabric_memory_recipes.training.techniques import checkpointing, fused_loss
from fabric_memory_recipes.training.your_model import models

TINY = {
    "t5": dict(model_type="t5", vocab_size=512, d_model=64, d_ff=128, num_layers=2, num_heads=4, d_kv=16,
               dropout_rate=0.0),
    "bart": dict(model_type="bart", vocab_size=512, d_model=64, encoder_layers=2, decoder_layers=2,
                 encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=128,
                 max_position_embeddings=128, dropout=0.0),
}  # fmt: skip


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("seq2seq")
    for name, fields in TINY.items():
        (root / name).mkdir()
        (root / name / "config.json").write_text(json.dumps(fields))
    return {name: f"hf:{root / name}" for name in TINY}


def _token_accuracy(model, split) -> float:
    model.eval()
    with torch.no_grad():
        _, predicted, targets = seq2seq.seq2seq_lm(
            model, default_collate([split[i] for i in range(len(split))])
        )
    model.train()
    return (predicted == targets).float().mean().item()


def test_a_tiny_t5_learns_the_synthetic_pairs(tiny):
    """The first target token is the source's topic's (through the cross-attention), the rest follow a
    successor table: held-out token accuracy goes from chance to most tokens in 20 steps."""
    um = models.resolve(tiny["t5"])
    assert um.task == "seq2seq_lm"
    torch.manual_seed(0)
    model = models.build(um)
    ids, eos = models.token_ids(um), um.hf_config.eos_token_id
    train = seq2seq.SyntheticPairs(640, 24, 12, ids, eos, seed=0, split=0)
    held_out = seq2seq.SyntheticPairs(64, 24, 12, ids, eos, seed=0, split=1)
    source, target = held_out.sample(0)
    assert held_out.topics.tolist().count(source[0]) == 1 and len(target) < 12
    before = _token_accuracy(model, held_out)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for batch in itertools.islice(itertools.cycle(DataLoader(train, batch_size=16, shuffle=True)), 20):
        seq2seq.seq2seq_lm(model, batch)[0].backward()
        optimizer.step()
        optimizer.zero_grad()
    after = _token_accuracy(model, held_out)
    assert before < 0.1 and after > 0.5, (before, after)


def _pairs_from_scikit_learn(path) -> int:
    """Real English sentences (the bundled data sets' descriptions), each paired with itself in capitals."""
    loads = (datasets.load_iris, datasets.load_wine, datasets.load_diabetes, datasets.load_breast_cancer)
    text = " ".join(load().DESCR for load in loads)
    sentences = [s.strip() for s in text.replace("\n", " ").split(". ") if 20 < len(s.strip()) < 80]
    with open(path, "w", newline="", encoding="utf-8") as f:
        writer = csv.writer(f)
        writer.writerow(seq2seq.COLUMNS)
        writer.writerows((s, s.upper()) for s in sentences)
    return len(sentences)


def test_the_runner_trains_t5_on_text_pairs_with_its_levers(tiny, tmp_path, run_recipe):
    """Text pairs from a CSV, byte tokens (no tokenizer offline), every encoder and decoder block
    checkpointed, the loss fused through the decoder's output embeddings; the estimate recorded beside."""
    pairs = tmp_path / "pairs.csv"
    assert _pairs_from_scikit_learn(pairs) >= 20
    proc, result = run_recipe("your_model", "--model", tiny["t5"], "--accelerator", "cpu", "--data", "pairs",
                              "--data-dir", pairs, "--seq-len", "64", "--target-len", "64", "--batch-size", "4",
                              "--max-steps", "2", "--eval-batches", "1", "--checkpoint-blocks", "--fused-loss")  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert result["status"] == "ok" and result["extra"]["task"] == "seq2seq_lm"
    assert "ByteTokenizer" in proc.stderr + proc.stdout and result["provenance"]["data_source"] == "pairs"
    assert result["extra"]["checkpointed_blocks"] == 4  # 2 encoder + 2 decoder T5Blocks
    assert result["estimate"]["error"] is None and result["estimate"]["peak_allocated_gb"] > 0


def test_bart_blocks_checkpoint_and_compile_on_both_sides_and_its_bias_refuses_the_fused_loss(tiny):
    um = models.resolve(tiny["bart"])
    with torch.device("meta"):
        model = models.build(um)
    blocks, _ = models.repeated_blocks(model)
    assert set(blocks) == {"BartEncoderLayer", "BartDecoderLayer"}
    assert checkpointing.checkpoint_blocks(model, blocks) == 4
    assert models.compile_repeated(model, blocks) == 4  # fast mode: each block compiled inside its wrapper
    wrappers = [m for m in model.modules() if isinstance(m, checkpointing.CheckpointedBlock)]
    assert all(w._compiled_call_impl is None and w.block._compiled_call_impl is not None for w in wrappers)
    assert "bias" in fused_loss.refusal(model)


def test_the_byte_tokenizer_sits_after_the_special_ids(tiny):
    bart = models.resolve(tiny["bart"]).hf_config  # bos 0, pad 1, eos 2
    tok = seq2seq.ByteTokenizer(seq2seq.byte_offset(bart))
    ids = tok.encode("Iris, é")
    assert min(ids) >= 3 and len(tok) == 3 + 256 and tok.decode(ids) == "Iris, é"
    input_ids, mask, labels = seq2seq.example(ids, ids[:2], 4, 4, pad_id=1, eos=2)
    assert input_ids.tolist() == ids[:4] and mask.tolist() == [1] * 4
    assert labels.tolist() == [*ids[:2], 2, -100]


def test_bad_pairs_are_one_line(tmp_path):
    ids = models.TokenIds(pad=0, cls=None, sep=None, first_regular=8, vocab_size=512)
    with pytest.raises(UsageError, match="--data pairs") as e:
        seq2seq.load("pairs", str(tmp_path), 16, 8, ids, 1, seq2seq.ByteTokenizer)
    bad = tmp_path / "bad.csv"
    bad.write_text("question,answer\nwhat,that\n")
    with pytest.raises(UsageError, match="source and target") as f:
        seq2seq.load("auto", str(bad), 16, 8, ids, 1, seq2seq.ByteTokenizer)
    assert all(len(str(x.value).splitlines()) == 1 for x in (e, f))
