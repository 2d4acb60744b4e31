"""Bad flags fail clearly (one line on stderr, exit 2, no traceback) through a real recipe run (in this
interpreter: conftest.run_recipe_inprocess), and good flags reach Fabric unchanged."""

from __future__ import annotations

import ast
import os
import sys

import pytest

from fabric_memory_recipes.config import FAST_ALLOCATOR, Hardware, RunConfig, UsageError
from fabric_memory_recipes.declarations import declared_rung
from fabric_memory_recipes.training import cli, lifecycle
from fabric_memory_recipes.training.data.text import TextConfig
from fabric_memory_recipes.training.your_model import runner
from tests.conftest import (
    CUDA_ONLY_RECIPES,
    REPO,
    describe,
    load_recipe_module,
    recipe_names,
    run_recipe_inprocess,
)

RECIPE = "01_baseline"
QUICK = ["--accelerator", "cpu", "--model", "vit_tiny", "--data", "synthetic", "--weights", "none",
         "--max-steps", "1", "--eval-batches", "1"]  # fmt: skip


# id -> (extra args, a word the error line must contain); later flags override QUICK's.
BAD = {
    "devices-0": (["--devices", "0"], "--devices"),
    # More devices than exist. Deliberately just one more than the cores, not 9999: were the check to
    # regress, Fabric would really launch that many processes (9999 would bring the machine down).
    "devices-too-many": (["--devices", str((os.cpu_count() or 1) + 1)], "--devices"),
    "batch-size-0": (["--batch-size", "0"], "--batch-size"),
    "accumulation-not-dividing": (
        ["--batch-size", "10", "--accumulation-steps", "3"],
        "--accumulation-steps",
    ),
    "precision-unknown": (["--precision", "17-weird"], "--precision"),
    "fp16-mixed-on-cpu": (["--accelerator", "cpu", "--precision", "16-mixed"], "16-mixed"),
    "cuda-without-gpu": (["--accelerator", "cuda"], "cuda"),
    "model-unknown": (["--model", "nope"], "nope"),
    "pretrained-tiny": (["--weights", "pretrained", "--model", "vit_tiny"], "pretrained"),
    "cifar10-offline-empty-dir": (["--data", "cifar10", "--data-dir", "{empty}"], "cifar10"),
}
RAISED_IN_MAIN = {"cifar10-offline-empty-dir"}


def _vit_b_16_weights_cached() -> bool:
    """Mirrors fabric_memory_recipes.training.models._weights_available: with the file cached the run would really train."""
    import torch
    import torchvision.models as tvm

    url = tvm.ViT_B_16_Weights.IMAGENET1K_V1.url
    return os.path.exists(os.path.join(torch.hub.get_dir(), "checkpoints", os.path.basename(url)))


def _skip_reason(case: str) -> str | None:
    if case == "cuda-without-gpu" and _has_cuda():
        return "this machine has a CUDA GPU"
    return None


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


_BAD_RUNS: dict = {}


@pytest.fixture
def bad_runs(tmp_path_factory):
    """The baseline recipe run with each bad flag (once per case: two tests read each)."""

    class Runs:
        def __getitem__(self, case):
            if case not in _BAD_RUNS:
                empty = tmp_path_factory.mktemp("empty-data-dir")
                results_dir = tmp_path_factory.mktemp("results")
                extra = [a.replace("{empty}", str(empty)) for a in BAD[case][0]]
                proc, payload = run_recipe_inprocess(RECIPE, QUICK + extra, results_dir)
                _BAD_RUNS[case] = (proc, payload, results_dir, empty)
            return _BAD_RUNS[case]

    return Runs()


def _stderr_lines(proc) -> list[str]:
    return [ln for ln in proc.stderr.splitlines() if ln.strip()]


@pytest.mark.parametrize("case", list(BAD))
def test_bad_flag_exits_2_without_traceback_or_results(case, bad_runs):
    if _skip_reason(case):
        pytest.skip(_skip_reason(case))
    proc, payload, results_dir, empty = bad_runs[case]
    assert proc.returncode == 2, describe(proc)
    assert "Traceback" not in proc.stderr + proc.stdout, describe(proc)
    assert payload is None and not any(results_dir.iterdir()), "bad flags must not write results"
    if case in RAISED_IN_MAIN:
        assert not any(empty.iterdir()), "a refused --data cifar10 must not create files in --data-dir"
    # the error line is there, names the recipe and the offending flag/value
    errors = [ln for ln in _stderr_lines(proc) if ln.startswith(f"{RECIPE}.py: error:")]
    assert len(errors) == 1, describe(proc)
    assert BAD[case][1] in errors[0], describe(proc)


@pytest.mark.parametrize("case", list(BAD))
def test_bad_flag_is_exactly_one_line_on_stderr(case, bad_runs):
    if _skip_reason(case):
        pytest.skip(_skip_reason(case))
    proc = bad_runs[case][0]
    assert proc.returncode == 2, describe(proc)
    lines = _stderr_lines(proc)
    assert len(lines) == 1, describe(proc)
    assert lines[0].startswith(f"{RECIPE}.py: error: "), describe(proc)
    assert proc.stdout.strip() == "", describe(proc)


# ------------------------------------------------------------------------------- flags reach Fabric
class FabricReached(Exception):
    """Raised by the fake Fabric so that nothing trains."""


@pytest.fixture
def fake_fabric(monkeypatch):
    import lightning

    seen: list[dict] = []

    class RecordingFabric:
        def __init__(self, *args, **kwargs):
            seen.append({"args": args, **kwargs})
            raise FabricReached

    monkeypatch.setattr(lightning, "Fabric", RecordingFabric)
    return RecordingFabric, seen


def _call_recipe_main(name, argv, fake, monkeypatch):
    mod = load_recipe_module(name)
    monkeypatch.setattr(mod.L, "Fabric", fake, raising=True)  # the recipe's `L.Fabric(...)`
    if hasattr(mod, "Fabric"):  # in case a recipe imports the class by name
        monkeypatch.setattr(mod, "Fabric", fake)
    with pytest.raises(FabricReached):
        lifecycle.run_recipe(mod.main, mod.RUNG, mod.__doc__, argv=argv)


def _pretend_gpus(monkeypatch, count: int = 8, bf16: bool = True) -> None:
    """Let the checks accept --accelerator cuda here: the fake Fabric stops the run before any CUDA call."""
    gpus = Hardware(cuda_devices=count, cpu_cores=os.cpu_count() or 1, bf16_supported=lambda: bf16)
    monkeypatch.setattr(cli, "detect_hardware", lambda: gpus)


@pytest.mark.parametrize("precision", ["bf16-true", "bf16-mixed", "32-true"])
@pytest.mark.parametrize("accelerator", ["cpu", "cuda"])
@pytest.mark.parametrize("name", recipe_names())
def test_flags_reach_fabric(name, accelerator, precision, fake_fabric, monkeypatch, tmp_path):
    if accelerator == "cpu" and name in CUDA_ONLY_RECIPES:
        pytest.skip("refuses the CPU (tested in test_recipes)")
    if accelerator == "cuda" and not _has_cuda():
        _pretend_gpus(monkeypatch)
    devices = 1 if accelerator == "cpu" else 2
    fake, seen = fake_fabric
    argv = ["--accelerator", accelerator, "--precision", precision, "--devices", str(devices),
            "--num-nodes", "2", "--model", "vit_tiny", "--data", "synthetic", "--weights", "none",
            "--results-dir", str(tmp_path)]  # fmt: skip
    _call_recipe_main(name, argv, fake, monkeypatch)
    assert len(seen) == 1
    kw = seen[0]
    assert kw["precision"] == precision
    assert kw["devices"] == devices
    assert kw["accelerator"] == accelerator
    assert kw["num_nodes"] == 2
    assert not any(tmp_path.iterdir()), "an exception before training writes no results"


def test_normalised_flags_reach_fabric(fake_fabric, monkeypatch, tmp_path):
    """'auto' resolves to the accelerator present, '32' means '32-true', devices up to the core count."""
    fake, seen = fake_fabric
    devices = min(2, os.cpu_count() or 1)
    argv = ["--accelerator", "auto", "--precision", "32", "--devices", str(devices), "--model", "vit_tiny",
            "--results-dir", str(tmp_path)]  # fmt: skip
    _call_recipe_main(RECIPE, argv, fake, monkeypatch)
    kw = seen[0]
    assert kw["accelerator"] == ("cuda" if _has_cuda() else "cpu")
    assert kw["precision"] == "32-true"
    assert kw["devices"] == devices
    assert kw["num_nodes"] == 1


@pytest.mark.parametrize("name", recipe_names())
def test_recipe_defaults_reach_fabric(name, fake_fabric, monkeypatch, tmp_path):
    """Without --precision/--devices each rung uses its own defaults (the lesson of rungs 02/03/08)."""
    fake, seen = fake_fabric
    rung = load_recipe_module(name).RUNG
    if not _has_cuda():
        _pretend_gpus(monkeypatch)
    argv = ["--accelerator", "cuda", "--model", "vit_tiny", "--results-dir", str(tmp_path)]
    _call_recipe_main(name, argv, fake, monkeypatch)
    assert seen[-1]["precision"] == rung.precision
    assert seen[-1]["devices"] == rung.devices


# ----------------------------------------------------------------------------------- parse_args units
def test_micro_batch_size_is_batch_over_accumulation():
    cfg = cli.parse(RunConfig(), ["--accelerator", "cpu", "--batch-size", "12", "--accumulation-steps", "3"])
    assert cfg.micro_batch_size == 4 and cfg.flags()["micro_batch_size"] == 4


def test_the_step_in_backward_refuses_accumulation_in_one_place():
    """Rungs 12 and 14 declare optimizer_in_backward; the config refuses accumulation for them."""
    rung = RunConfig(optimizer_in_backward=True, batch_size=8)
    hardware = Hardware(cuda_devices=0, cpu_cores=2)
    assert rung.with_flags(accelerator="cpu").checked(hardware).accumulation_steps == 1
    with pytest.raises(UsageError, match="accumulation"):
        rung.with_flags(accelerator="cpu", accumulation_steps=2).checked(hardware)
    RunConfig(batch_size=8, accumulation_steps=2, accelerator="cpu").checked(hardware)  # others may


def test_every_flag_has_a_default_a_help_and_a_group():
    for cls in (RunConfig, TextConfig):
        parser = cli.build_parser(cls())
        for f in cls.flag_fields():
            assert f.metadata["group"] in cls.GROUPS, f.name
            assert parser.get_default(f.name) == getattr(cls(), f.name), f.name


def test_usage_error_from_main_is_exit_2_one_line(capsys, tmp_path):
    def main(cfg, results):
        raise UsageError("something impossible")

    with pytest.raises(SystemExit) as exc:
        lifecycle.run_recipe(
            main, RunConfig(recipe="x"), "d", argv=["--accelerator", "cpu", "--results-dir", str(tmp_path)]
        )
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].endswith("error: something impossible")
    assert not any(tmp_path.iterdir())


def test_pretrained_weights_offline_is_exit_2(monkeypatch, capsys, tmp_path):
    """--weights pretrained with no cached file and no network: refused inside main (in-process run)."""
    if _vit_b_16_weights_cached():
        pytest.skip("ViT-B/16 weights are cached here: --weights pretrained would succeed")
    from fabric_memory_recipes.training.data import network

    network.reachable.cache_clear()
    monkeypatch.setenv("FMR_OFFLINE", "1")
    monkeypatch.setattr(sys, "argv", [f"{RECIPE}.py"])
    mod = load_recipe_module(RECIPE)
    # the data are not what is tested: skip generating 60k synthetic images
    from fabric_memory_recipes.training import data

    small = data.synthetic(sizes=(64, 16, 16))
    monkeypatch.setattr(data, "synthetic", lambda *a, **k: small)
    argv = ["--accelerator", "cpu", "--weights", "pretrained", "--model", "vit_b_16", "--data", "synthetic",
            "--results-dir", str(tmp_path)]  # fmt: skip
    with pytest.raises(SystemExit) as exc:
        lifecycle.run_recipe(mod.main, mod.RUNG, mod.__doc__, argv=argv)
    assert exc.value.code == 2
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith(f"{RECIPE}.py: error:")]
    assert len(err) == 1 and "--weights pretrained" in err[0] and "vit_b_16" in err[0], err
    assert not any(tmp_path.iterdir())


def _data_outcome(data: str, rung: RunConfig | None = None) -> str:
    """The parsed ``--data``, or the one-line error argparse refused it with."""
    import contextlib
    import io

    err = io.StringIO()
    rung = rung or RunConfig()
    argv = ["--accelerator", "cpu", "--data", data, "--model", rung.model_choices[-1]]
    try:
        with contextlib.redirect_stderr(err):
            return cli.parse(rung, argv).data
    except SystemExit as exc:
        assert exc.code == 2
        lines = err.getvalue().strip().splitlines()
        assert len(lines) == 1, lines
        return lines[0]


def test_data_choices_replace_the_image_choices():
    text_rung = TextConfig(
        model="distilbert-tiny", model_choices=("distilbert-base-uncased", "distilbert-tiny")
    )
    for data in ("auto", "cifar10", "synthetic"):  # the image recipes' choices
        assert _data_outcome(data) == data
    assert "invalid choice: 'imdb'" in _data_outcome("imdb")
    for data in TextConfig.DATA_CHOICES:  # what the bonus recipes' config declares
        assert _data_outcome(data, text_rung) == data
    refused = _data_outcome("cifar10", text_rung)
    assert "--data: invalid choice: 'cifar10'" in refused and "imdb" in refused


def test_help_overrides_replace_the_image_help():
    image = cli.build_parser(RunConfig()).format_help()
    assert "CIFAR-10" in image and "vit_l_16" in image and "{auto,cifar10,digits,synthetic}" in image
    bonus = cli.build_parser(TextConfig(model="distilbert-base-uncased")).format_help()  # as a bonus RUNG
    assert "CIFAR-10" not in bonus and "vit_l_16" not in bonus and "{auto,imdb,synthetic}" in bonus
    assert all(" ".join(h.split()) in " ".join(bonus.split()) for h in TextConfig.HELP.values())
    assert set(TextConfig.HELP) <= {f.name for f in RunConfig.flag_fields()}  # only existing flags reworded


# ---------------------------------------------------------------------- the LLM recipe's precision toggles
def _llm_outcome(*flags: str, accelerator: str = "cpu", hardware: Hardware | None = None) -> str:
    """bonus_llm_finetune's final precision after its toggles are resolved, or its UsageError."""
    rung = load_recipe_module("bonus_llm_finetune").RUNG
    argv = ["--accelerator", accelerator, "--model", "qwen2-tiny", *flags]
    ns = cli.build_parser(rung).parse_args(argv)
    try:
        return rung.with_flags(**vars(ns)).checked(hardware or Hardware(0, os.cpu_count() or 1)).precision
    except UsageError as e:
        return f"error: {e}"


@pytest.mark.parametrize("toggle", ["--half", "--mixed", "--all"])
@pytest.mark.parametrize("precision", [None, "32-true", "bf16-true", "bf16-mixed"])
def test_llm_precision_toggles_do_not_depend_on_flag_order(toggle, precision):
    if toggle == "--all":
        pytest.importorskip("peft")  # --all includes --lora
    given = ("--precision", precision) if precision else ()
    first, last = _llm_outcome(toggle, *given), _llm_outcome(*given, toggle)
    assert first == last
    wanted = "bf16-mixed" if toggle == "--mixed" else "bf16-true"
    if precision in (None, wanted):
        assert first == wanted
    else:  # an explicit --precision that the toggle contradicts is refused, never overridden
        assert first.startswith("error:") and "contradicts" in first and toggle in first


def test_llm_precision_without_toggles_is_the_flag_or_fp32():
    assert _llm_outcome() == "32-true"
    assert _llm_outcome("--precision", "bf16-mixed") == "bf16-mixed"


@pytest.mark.parametrize("toggle", ["--half", "--all"])
def test_llm_toggle_precision_is_validated(toggle):
    """The precision a toggle sets is checked like a --precision flag: a GPU without bf16 refuses it."""
    no_bf16 = Hardware(cuda_devices=1, cpu_cores=2, bf16_supported=lambda: False)
    assert _llm_outcome(accelerator="cuda", hardware=no_bf16) == "32-true"
    assert "does not support bfloat16" in _llm_outcome(toggle, accelerator="cuda", hardware=no_bf16)


# ------------------------------------------------------------------------------------------- fast mode
def test_mode_defaults_fast_on_cuda_and_eager_on_cpu(monkeypatch):
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    cpu = cli.parse(RunConfig(), ["--accelerator", "cpu"])
    assert (cpu.mode, cpu.compile, cpu.cuda_graphs) == ("eager", False, False)
    assert "PYTORCH_CUDA_ALLOC_CONF" not in os.environ
    _pretend_gpus(monkeypatch)
    gpu = cli.parse(RunConfig(), ["--accelerator", "cuda"])
    assert (gpu.mode, gpu.compile, gpu.cuda_graphs) == ("fast", True, True)
    # the graphs' allocator setting is in place before anything starts CUDA
    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == FAST_ALLOCATOR
    eager = cli.parse(RunConfig(), ["--accelerator", "cuda", "--mode", "eager"])
    assert (eager.compile, eager.cuda_graphs) == (False, False)
    # one flag overrides its part of the mode
    mixed = cli.parse(RunConfig(), ["--accelerator", "cuda", "--no-compile"])
    assert (mixed.mode, mixed.compile, mixed.cuda_graphs) == ("fast", False, True)


def test_cuda_graphs_only_where_they_can_run(monkeypatch):
    _pretend_gpus(monkeypatch)
    several = cli.parse(RunConfig(), ["--accelerator", "cuda", "--devices", "2"])
    assert several.cuda_graphs is False  # fast mode with several devices: compiled, no graphs
    profiled = cli.parse(RunConfig(), ["--accelerator", "cuda", "--memory-timeline"])
    assert profiled.cuda_graphs is False  # the profiler records the eager steps
    kahan = cli.parse(
        RunConfig(), ["--accelerator", "cuda", "--precision", "bf16-true", "--bf16-update", "kahan"]
    )
    assert (kahan.compile, kahan.cuda_graphs) == (True, False)  # optimi's Kahan step is not capturable
    gpus = Hardware(cuda_devices=8, cpu_cores=2)
    for argv, word in (
        (["--accelerator", "cpu", "--cuda-graphs"], "CUDA"),
        (["--accelerator", "cuda", "--devices", "2", "--cuda-graphs"], "one device"),
        (["--accelerator", "cuda", "--snapshot", "--cuda-graphs"], "--no-cuda-graphs"),
        (
            ["--accelerator", "cuda", "--precision", "bf16-true", "--bf16-update", "kahan", "--cuda-graphs"],
            "Kahan",
        ),
    ):
        ns = cli.build_parser(RunConfig()).parse_args(argv)
        with pytest.raises(UsageError, match=word):
            RunConfig().with_flags(**vars(ns)).checked(gpus)


def test_your_models_step_in_backward_is_not_captured(monkeypatch):
    """Fast mode for an image model captures the step in CUDA graphs, but the runner's step in backward
    (AdamW per parameter, not capturable) is left out of them: asked for, one line; by fast mode, none."""
    _pretend_gpus(monkeypatch)
    gpus = Hardware(cuda_devices=8, cpu_cores=2)
    base = ["--model", "torchvision:resnet18", "--accelerator", "cuda"]
    fast = cli.parse(runner.default_config(), base)
    assert (fast.compile, fast.cuda_graphs) == (True, True)
    hooked = cli.parse(runner.default_config(), [*base, "--optimizer-in-backward"])
    assert (hooked.compile, hooked.cuda_graphs) == (True, False)
    ns = cli.build_parser(runner.default_config()).parse_args(
        [*base, "--optimizer-in-backward", "--cuda-graphs"]
    )
    with pytest.raises(UsageError, match="step in backward"):
        runner.default_config().with_flags(**vars(ns)).checked(gpus)


# ------------------------------------------------------------------------------------------ --help
def test_help_shows_every_flags_default():
    """--help states each flag's default: the rung's value, 'not set' for an optional value, or the
    help's own words (--mode)."""
    text = " ".join(cli.build_parser(declared_rung("05_gradient_accumulation")[0]).format_help().split())
    for expected in (
        "(default: 16)",  # --batch-size, the rung's own value
        "(default: 4)",  # --accumulation-steps
        "(default: bf16-true)",
        "(default: runs)",  # --results-dir: a run folder, ignored by git
        "stop after this many optimizer steps (default: not set)",
        "(default: fast with CUDA, eager on CPU)",  # said by the help itself, not repeated
    ):
        assert expected in text, expected
    assert "(default: None)" not in text and "default: fast with CUDA, eager on CPU) (default" not in text


def test_every_command_line_parser_uses_the_formatter_that_shows_defaults():
    constructions, missing = [], []
    for folder in ("fabric_memory_recipes", "devtools", "experiments"):
        for path in sorted((REPO / folder).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                name = getattr(getattr(node, "func", None), "attr", None) or getattr(
                    getattr(node, "func", None), "id", None
                )
                if not isinstance(node, ast.Call) or name not in ("ArgumentParser", "Parser"):
                    continue
                keywords = {k.arg: k.value for k in node.keywords}
                if "add_help" in keywords:  # a pre-parser that never prints help
                    continue
                constructions.append(f"{path.name}:{node.lineno}")
                formatter = getattr(keywords.get("formatter_class"), "id", None)
                # fabric_memory_recipes.console.Parser uses HelpFormatter unless told otherwise
                if formatter != "HelpFormatter" and not (name == "Parser" and formatter is None):
                    missing.append(f"{path.name}:{node.lineno}")
    assert len(constructions) >= 10
    assert not missing, missing
