"""docs/estimating_like_the_article.md cannot go stale silently: every ``fmr-estimate`` command it shows runs
here, in this process, once (a module fixture); every line it quotes from their output is a line they print;
every number its tables and sums take from the estimate is what the estimate prints (within rounding); the
GPU measurements it quotes are the committed files'; and the article's own arithmetic is as the page writes
it.

A number is checked where the page writes it: a fragment of the page with ``{}`` where a decimal number stands
(or ``{n}`` for a count written with commas), searched within the page's section, and compared with the
value it quotes, to half a unit of its last decimal plus the rounding of the printed numbers it comes from.
"""

from __future__ import annotations

import json
import re

import pytest

from fabric_memory_recipes.planning.simulation.allocator import RESIDUAL
from tests.conftest import REPO, run_estimate
from tests.docs.test_doc_commands import commands_of

PAGE = REPO / "docs" / "estimating_like_the_article.md"
TEXT = PAGE.read_text().replace("−", "-")  # the page's minus signs, as numbers are parsed
BLOCK = re.compile(r"^```(\w*)\n(.*?)^```", re.M | re.S)
PUBLISHED = REPO / "results" / "published" / "h100"
BERT = "fmr-estimate --model hf:examples/configs/bert-base-uncased --seq-len 10 --batch-size 32"
FULL = "fmr-estimate --model hf:examples/configs/mt5-base --seq-len 10 --batch-size 32 --mode eager"
LORA = f"{FULL} --lora-rank 8 --lora-targets q,v"
INFER = (
    "fmr-estimate --model hf:examples/configs/mt5-base --infer --seq-len 10 --new-tokens 10 --batch-size 1"
)
GIB = 2**30
PEAKS = ("predicted peak", "peak reserved", "whole-device peak")  # the estimate's, as the measured three


def _normal(line: str) -> str:
    return " ".join(line.split())


def values(out: str) -> dict[str, float]:
    """The numbers an estimate printed, by their label: each component's and peak's line, the static part,
    the trainable and total parameters, the saved activations, the replay, the checkpoint file's parts."""
    found: dict[str, float] = {}
    for line in out.splitlines():
        if m := re.match(r"\s*(\S.*?)\s{2,}(-?\d+\.\d+)(?: GB)?(?:\s|$)", line):
            found[m.group(1).strip()] = float(m.group(2))
        if line.strip().startswith("Static"):
            found.update({f"static {k}": float(v) for k, v in re.findall(r"(\w+) (\d+\.\d+)", line)})
            trainable, total = re.search(r"trainable ([\d,]+) of ([\d,]+)", line).groups()
            found.update(trainable=int(trainable.replace(",", "")), total=int(total.replace(",", "")))
        if m := re.search(r"forward pass: (\d+\.\d+) GB", line):
            found["saved activations"] = float(m.group(1))
        if m := re.search(r"the allocator replay's (\d+\.\d+) x", line):
            found["replay"] = float(m.group(1))
        if m := re.search(r"weights (\d+\.\d+) \(float32\) \+ optimizer state (\d+\.\d+)", line):
            found.update({"file weights": float(m.group(1)), "file state": float(m.group(2))})
    return found


@pytest.fixture(scope="module")
def printed() -> dict[str, str]:
    """What each command the page shows printed, run in this process."""
    out = {}
    for _, command in commands_of(PAGE.read_text()):
        if command.startswith("fmr-estimate"):
            code, text, err = run_estimate(command)
            assert code == 0 and "Traceback" not in err, (command, err[-2000:])
            out[command] = text
    assert set(out) == {BERT, FULL, LORA, INFER}, "a command the checks below do not know: give it its checks"
    return out


def test_every_quoted_line_is_a_line_the_commands_print(printed):
    """A ```text block quotes the output of the ```bash block before it; a line ending in "…" is a start."""
    blocks = list(BLOCK.finditer(PAGE.read_text()))
    pairs = [
        (a.group(2), b.group(2))
        for a, b in zip(blocks, blocks[1:], strict=False)
        if (a.group(1), b.group(1)) == ("bash", "text")
    ]
    assert len(pairs) == 4
    for commands, excerpt in pairs:
        lines = [
            _normal(x) for c in commands.splitlines() if c.strip() for x in printed[c.strip()].splitlines()
        ]
        for quoted in filter(None, map(_normal, excerpt.splitlines())):
            start = quoted.endswith(" …") and quoted[:-2]
            assert any(x.startswith(start) for x in lines) if start else quoted in lines, quoted


def section(heading: str) -> str:
    start = TEXT.index(f"\n## {heading}")
    end = TEXT.find("\n## ", start + 1)
    return TEXT[start : end if end > 0 else None]


def check(where: str, fragment: str, *expected: float) -> None:
    """The numbers at the ``{}`` (``{n}``) of ``fragment`` in ``where`` are ``expected``, within rounding."""
    pattern = re.escape(fragment).replace(r"\{\}", r"(-?\d+(?:\.\d+)?)").replace(r"\{n\}", r"([\d,]+)")
    m = re.search(pattern, " ".join(where.split()))
    assert m, f"not on the page: {fragment}"
    for text, want in zip(m.groups(), expected, strict=True):
        if "." not in text:  # a count: exact
            assert int(text.replace(",", "")) == want, (fragment, text, want)
            continue
        unit = 10.0 ** -len(text.split(".")[1])
        assert abs(float(text) - want) <= 0.5 * unit + 0.0011, (fragment, text, want)


def _measured(name: str) -> dict:
    rows = json.loads((PUBLISHED / "seq2seq-check" / "rows.json").read_text())["rows"]
    return next(r for r in rows if r["name"] == name)


def test_the_saved_files_numbers(printed):
    text, bert, mt5 = section("1. The saved file"), values(printed[BERT]), values(printed[FULL])
    check(
        text,
        "| BERT-base | 0.410 GiB (419.62 MiB) | about 420 MB | {} GB = {} MiB | {} GB |",
        bert["file weights"],
        bert["total"] * 4 / 2**20,
        bert["checkpoint file"],
    )
    check(
        text,
        "| mT5-base | 2.168 GiB | 2.16 GB | {} GB = {} GiB | {} GB |",
        mt5["file weights"],
        mt5["total"] * 4 / GIB,
        mt5["checkpoint file"],
    )
    check(text, "a 2-label head, {n} parameters", bert["total"])
    lora = next(
        r
        for r in json.loads((PUBLISHED / "lora-check" / "lora_check.json").read_text())
        if r["name"] == "bert-r8"
    )
    check(
        text,
        "{n} bytes on disk against {n} predicted",
        lora["checkpoint_bytes"],
        lora["predicted_checkpoint_bytes"],
    )


def test_full_trainings_numbers(printed):
    text, v, run = section("2. Full training"), values(printed[FULL]), _measured("mt5-article-b32")
    static = v["total"] * 16 / 1e9  # the article's four copies, in fp32, with the exact count
    rest, grads = v["whole-device peak"] - static, v["gradients"] - v["static gradients"]
    reserve, outside = v["peak reserved"] - v["predicted peak"], v["whole-device peak"] - v["peak reserved"]
    meas = [run[f"measured_{k}"] for k in ("peak_allocated_gb", "peak_reserved_gb", "device_peak_gb")]
    check(
        text,
        "| weights + gradients + Adam state | 8.672 GiB = 9.312 GB | {} ({n} × 16 bytes) | — |",
        static,
        v["total"],
    )
    check(text, "| peak allocated | — | {} | {} |", v["predicted peak"], meas[0])
    check(text, "| peak reserved | — | {} | {} |", v["peak reserved"], meas[1])
    check(text, "| whole device | 12.2 (13.10 GB if GiB) | {} | {} |", v["whole-device peak"], meas[2])
    check(text, "| the rest: total - the static part | 3.528 | {} | {} |", rest, meas[2] - static)
    check(text, "the estimate's {} GB above the static {}", rest, static)
    check(text, "The forward pass saves {} GB", v["saved activations"])
    check(text, "at the peak {} GB exist", v["gradients"])
    check(text, "*Gradients: {} GB.*", grads)
    check(text, "*The backward's temporaries: +{} GB.*", v["temporaries"])
    check(text, "*cuBLAS's workspace: +{} GB*", v["workspace"])
    check(text, "*The allocator's reserve: +{} GB.* Peak reserved ({})", reserve, v["peak reserved"])
    check(text, "reserves {}, and the estimate adds {} %", v["replay"], 100 * (RESIDUAL - 1))
    check(text, "*Outside the allocator: +{} GB*", outside)
    check(
        text, "{} + {} + {} + {} + {} = {}.", grads, v["temporaries"], v["workspace"], reserve, outside, rest
    )
    check(text, "measured {} GB allocated, {} reserved and {} for the whole device", *meas)
    errors = [100 * (p - m) / m for p, m in zip((v[k] for k in PEAKS), meas, strict=True)]
    check(text, "the estimate is {} GB under on allocated ({} %)", meas[0] - v["predicted peak"], errors[0])
    check(text, "over by {} % on reserved and {} % on the whole device", *errors[1:])
    check(
        text,
        "The run itself recorded {} GB (+{} %)",
        run["predicted_peak_allocated_gb"],
        run["error_peak_allocated_gb_pct"],
    )


def test_loras_numbers(printed):
    text, v, full = section("3. LoRA"), values(printed[LORA]), values(printed[FULL])
    static = (v["total"] + 3 * v["trainable"]) * 4 / 1e9  # K + N weights, N gradients, 2N Adam, in fp32
    rest, grads = v["whole-device peak"] - static, v["gradients"] - v["static gradients"]
    reserve, outside = v["peak reserved"] - v["predicted peak"], v["whole-device peak"] - v["peak reserved"]
    assert v["trainable"] == 884_736  # the article's N
    check(text, "72 projections × 8 × (768 + 768) = {n}", v["trainable"])
    check(text, "| weights + gradients + Adam state (K + 4N) | 2.18 GiB = 2.342 GB | {} |", static)
    check(text, "| peak allocated | — | {} |", v["predicted peak"])
    check(text, "| peak reserved | — | {} |", v["peak reserved"])
    check(text, "| whole device | 5.3 (5.69 GB if GiB) | {} |", v["whole-device peak"])
    check(text, "| the rest: total - the static part | 3.12 | {} |", rest)
    check(
        text,
        "| 3K - 4N = 6.49 GiB = 6.970 GB | {} - {} = {} |",
        full["whole-device peak"],
        v["whole-device peak"],
        full["whole-device peak"] - v["whole-device peak"],
    )
    check(text, "the estimate's {} GB above the static {}", rest, static)
    check(text, "*Activations: +{} GB", v["activations"])
    check(text, "*The backward's temporaries: +{} GB*", v["temporaries"])
    check(text, "*Gradients: {} GB*", grads)
    check(text, "the allocator's reserve +{} ({} - {})", reserve, v["peak reserved"], v["predicted peak"])
    check(text, "outside the allocator +{}*", outside)
    check(
        text,
        "{} + {} + {} + {} + {} + {} = {}.",
        grads,
        v["activations"],
        v["temporaries"],
        v["workspace"],
        reserve,
        outside,
        rest,
    )
    check(
        text,
        "what the static parts differ by ({} GB with the exact K)",
        (3 * full["total"] - 4 * v["trainable"]) * 4 / 1e9,
    )
    check(text, "the whole device differs by less ({})", full["whole-device peak"] - v["whole-device peak"])


def test_inferences_numbers(printed):
    text, v = section("4. Inference"), values(printed[INFER])
    rest = v["whole-device peak"] - v["weights"]
    reserve, outside = v["peak reserved"] - v["peak allocated"], v["whole-device peak"] - v["peak reserved"]
    check(text, "| weights | K + 4N = 2.18 GiB = 2.342 GB | {} |", v["weights"])
    check(text, "| peak allocated | — | {} |", v["peak allocated"])
    check(text, "| peak reserved | — | {} |", v["peak reserved"])
    check(text, "| whole device | 3.3 (3.54 GB if GiB) | {} |", v["whole-device peak"])
    check(text, "| the rest: total - the weights | 1.12 | {} |", rest)
    check(text, "the estimate's {} GB above the weights", rest)
    check(
        text,
        "*What a batch of one generates with: +{} GB.*",
        v["KV cache (last token)"] + v["decode step working memory"],
    )
    check(text, "the 10 source tokens ({} GB)", v["KV cache (last token)"])
    check(text, "working memory over it is {} GB", v["decode step working memory"])
    check(
        text,
        "*cuBLAS's workspace +{} (one, as docs/inference.md says), the allocator's reserve +{} ({} - {}),"
        " outside the allocator +{}.*",
        v["cuBLAS workspace"],
        reserve,
        v["peak reserved"],
        v["peak allocated"],
        outside,
    )
    check(
        text,
        "{} + {} + {} + {} + {} = {} ({} unrounded).",
        v["cuBLAS workspace"],
        v["KV cache (last token)"],
        v["decode step working memory"],
        reserve,
        outside,
        sum(
            round(x, 3)
            for x in (
                v["cuBLAS workspace"],
                v["KV cache (last token)"],
                v["decode step working memory"],
                reserve,
                outside,
            )
        ),
        rest,
    )


def test_the_summarys_numbers(printed):
    text, full, lora, infer = (
        section("What the formulas leave out"),
        values(printed[FULL]),
        values(printed[LORA]),
        values(printed[INFER]),
    )

    def reserve(v: dict[str, float], peak: str) -> float:
        return v["peak reserved"] - v[peak]

    check(text, "{} GB on an H100", full["whole-device peak"] - full["peak reserved"])
    check(
        text,
        "margin: {} GB in full training, {} with LoRA, {} at inference",
        reserve(full, "predicted peak"),
        reserve(lora, "predicted peak"),
        reserve(infer, "peak allocated"),
    )
    check(text, "before they are summed: {} GB in full training", full["temporaries"])
    check(text, "**cuBLAS's workspaces**: {} GB", full["workspace"])


def test_the_articles_arithmetic_is_as_the_page_writes_it():
    """The article's formulas with its own inputs (582,000,000 and 110,000,000 parameters, N = 884,736), and
    the unit conversions the page adds."""
    k, n = 582_000_000, 884_736
    check(
        section("1. The saved file"),
        "110,000,000 parameters × 4 bytes / 1024³ = {} ({} MB",
        110e6 * 4 / GIB,
        110e6 * 4 / 2**20,
    )
    check(section("1. The saved file"), "582,000,000 × 4 / 1024³ = {};", k * 4 / GIB)
    check(section("2. Full training"), "4 × 582,000,000 × 4 bytes / 1024³ = {}", 16 * k / GIB)
    check(section("2. Full training"), "| {} GiB = {} GB |", 16 * k / GIB, 16 * k / 1e9)
    check(section("3. LoRA"), "| {} GiB = {} GB | ", (k + 4 * n) * 4 / GIB, (k + 4 * n) * 4 / 1e9)
    check(
        section("3. LoRA"),
        "| 3K - 4N = {} GiB = {} GB |",
        (3 * k - 4 * n) * 4 / GIB,
        (3 * k - 4 * n) * 4 / 1e9,
    )
    for heading, figure in (("2. Full training", 12.2), ("3. LoRA", 5.3), ("4. Inference", 3.3)):
        check(section(heading), f"| {figure} ({{}} GB if GiB) |", figure * GIB / 1e9)


def test_the_number_check_can_fail():
    """Guard for the checks above: a number off by more than its rounding, or a fragment not on the page,
    fails."""
    text = section("2. Full training")
    check(text, "*The backward's temporaries: +{} GB.*", 1.5384)
    for wrong in (1.541, 1.535):
        with pytest.raises(AssertionError):
            check(text, "*The backward's temporaries: +{} GB.*", wrong)
    with pytest.raises(AssertionError, match="not on the page"):
        check(text, "*The forward's temporaries: +{} GB.*", 1.538)
