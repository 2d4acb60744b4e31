"""fmr-estimate's one parser: every mode in one --help, the mode chosen from the parsed
namespace, no pre-parser or argv sniffing, and a flag the chosen mode ignores refused in one line."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from fabric_memory_recipes.planning import arguments
from fabric_memory_recipes.planning.__main__ import main as estimate_main

PLANNING = Path(arguments.__file__).parent
# the modules of fmr-estimate's command line: the entry point, its parser, and the modes it hands to
MODULES = ["__main__.py", "arguments.py", "planner/cli.py", "your_model/cli.py"]


def test_help_lists_every_mode_and_every_flag_with_its_default(capsys):
    for argv in (["--help"], ["--fit", "1GB", "--help"], ["--model", "hf:x", "--help"]):
        with pytest.raises(SystemExit) as e:
            estimate_main(argv)
        assert e.value.code == 0
        text = capsys.readouterr().out
        assert text.startswith("usage: ")
        for mode in ("--recipe NN", "--fit SIZE", "--check DIR", "--ladder DIR", "--model SOURCE:NAME"):
            assert f"fmr-estimate {mode}" in text, mode
        flat = " ".join(text.split())
        for flag in ("--top", "--precisions", "--results", "--no-cache", "--may-change", "--measure-dir",
                     "--seq-len", "--checkpoint-blocks", "--attention", "--plot", "--batch-size", "--gpu"):  # fmt: skip
            assert f"{flag} " in flat or f"{flag}," in flat, flag
        assert "default: the --recipe rung's, else 64; your model: 32; --fit: 16" in flat
        assert "(default: None)" not in text


def test_one_parser_and_no_argv_sniffing():
    constructions, sniffs = [], []
    for name in MODULES:
        source = (PLANNING / name).read_text()
        for node in ast.walk(ast.parse(source)):
            func = getattr(node, "func", None)
            called = getattr(func, "attr", None) or getattr(func, "id", None)
            if isinstance(node, ast.Call) and called in ("ArgumentParser", "Parser", "build_parser"):
                constructions.append(f"{name}:{node.lineno}")
            if isinstance(node, ast.Call) and called == "parse_known_args":
                sniffs.append(f"{name}:{node.lineno}")
        sniffs += [
            f"{name}: {m}"
            for m in re.findall(r'a == "--\w+"|startswith\("--\w+', source)
            if "--fit" not in m or name != "planner/cli.py"
        ]  # fmt: skip  (join_fit_value: a value, not a mode)
    assert (
        constructions == [c for c in constructions if c.startswith("arguments.py")]
        and len(constructions) == 1
    )
    assert not sniffs, sniffs


@pytest.mark.parametrize(
    ("argv", "mode"),
    [([], arguments.ESTIMATE), (["--recipe", "05"], arguments.ESTIMATE), (["--fit", "6GB"], arguments.FIT),
     (["--check", "a", "b"], arguments.CHECK), (["--ladder", "d"], arguments.LADDER),
     (["--model", "hf:x", "--fit", "6GB"], arguments.YOURS), (["--model", "torchvision:resnet18"], arguments.YOURS)],
)  # fmt: skip
def test_the_mode_comes_from_the_parsed_namespace(argv, mode):
    assert arguments.mode_of(arguments.build().parse_args(argv)) == mode


@pytest.mark.parametrize(
    ("argv", "says"),
    [(["--fit", "6GB", "--recipe", "05"], "--recipe does nothing with the ladder's --fit"),
     (["--check", "results", "--top", "3"], "--top does nothing with --check"),
     (["--recipe", "05", "--seq-len", "64"], "--seq-len does nothing with a rung's estimate"),
     (["--ladder", "x", "--check", "y"], "--check does nothing with --ladder"),
     (["--model", "torchvision:resnet18", "--precisions", "bf16-true"], "--precisions does nothing with --model"),
     (["--model", "torchvision:resnet18", "--optimizer", "none"], "invalid choice for your model"),
     (["--recipe", "05", "--data", "imdb"], "argument --data: invalid choice: 'imdb'"),
     (["--fit", "6GB", "--model", "resnet"], "--model 'resnet' is not one of: vit_l_16")],
)  # fmt: skip
def test_a_flag_the_mode_ignores_is_one_line_and_exit_2(argv, says, capsys):
    with pytest.raises(SystemExit) as e:
        estimate_main(argv)
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and len(err.splitlines()) == 1 and says in err, err


def test_run_flags_take_the_modes_defaults():
    args = arguments.build().parse_args(["--fit", "6GB"])
    arguments.ladder_model(args)
    assert (args.model, args.batch_size) == ("vit_l_16", arguments.FIT_BATCH)
    args = arguments.build().parse_args(["--batch-size", "8"])
    from_rung = arguments.filled(args, arguments.RunConfig(batch_size=3, lr=0.5))
    assert from_rung["batch_size"] == 8 and from_rung["lr"] == 0.5


def _imported_at_start(tree: ast.Module) -> set[str]:
    """The modules a module imports when it is imported: its top-level imports, not those inside a function
    or under ``if TYPE_CHECKING:``."""
    names = set()
    for node in tree.body:
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names |= {node.module} | {f"{node.module}.{alias.name}" for alias in node.names}
    return names


def test_the_estimator_starts_without_lightning():
    """fmr-estimate imports no Lightning when it starts (importing it costs every start ~4 s of CPU): no
    module it imports at start-up imports Lightning at its top (only a run's functions do)."""
    package = PLANNING.parent
    todo, seen, third_party = ["fabric_memory_recipes.planning.__main__"], set(), set()
    while todo:
        name = todo.pop()
        parts = name.split(".")[1:]
        module, init = package.joinpath(*parts).with_suffix(".py"), package.joinpath(*parts, "__init__.py")
        path = module if module.exists() else init
        if name in seen or not path.exists():  # a name imported from a module, not a module
            continue
        seen.add(name)
        for imported in _imported_at_start(ast.parse(path.read_text())):
            if imported.startswith("fabric_memory_recipes"):
                pieces = imported.split(".")  # a package's __init__ runs before its module
                todo += [".".join(pieces[:i]) for i in range(2, len(pieces) + 1)]
            else:
                third_party.add(imported.split(".")[0])
    assert "fabric_memory_recipes.planning.your_model.cli" in seen and "torch" in third_party  # it read them
    assert "lightning" not in third_party
