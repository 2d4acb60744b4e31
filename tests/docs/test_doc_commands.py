"""Every command the docs show works: README.md, docs/*.md and the workshop notebook, fenced shell blocks
and inline `commands` alike (a module path that no longer exists, shown four times in the README, did not run).

Each command found is checked by what it is:

* a recipe (``python recipes/X.py ...``, also under ``torchrun`` / ``fabric run``): the file exists and its
  flags pass the recipe's own validation. With ``--accelerator cpu`` they are checked on a machine without
  a GPU; otherwise on a machine with GPUs (the GPU-only form), and then the recipe must refuse it on a CPU
  with a CPU form that the recipe accepts, and committed results of that recipe must exist under
  ``results/published/`` (the evidence that the GPU form ran);
* a tool (``fmr-*``, ``python -m fabric_memory_recipes...``): the module exists and every flag it is
  shown with is one its ``--help`` lists; ``./run_all.sh``: every flag is in its ``--help``;
* set-up (pip, git, uv, SLURM, shell built-ins): the files it names (constraints, requirements, the
  SLURM script) and the extras it asks for exist;
* a template (``recipes/NN_*.py``, ``OUT``, ``<...>``): the program it names exists.

The commands of README.md's sections are also run on this CPU, in this interpreter (they share its
imports): :data:`RUN_ON_CPU`. A command that fails today because of a known bug is listed there with
its reason (xfail).
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import io
import json
import re
import runpy
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib

from fabric_memory_recipes.config import Hardware
from tests.conftest import REPO, load_recipe_module, result, run_estimate, submit_estimate

PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
NOTEBOOK = REPO / "docs" / "workshop.ipynb"
FENCE = re.compile(r"^( *)```(\w*)[^\n]*\n(.*?)^\1```", re.M | re.S)
INLINE = re.compile(r"(?<![`\w])`([^`]+?)`(?!`)")
STARTS = (
    "python ",
    "python3 ",
    "fmr-",
    "./run_all.sh",
    "torchrun ",
    "fabric run ",
    "sbatch ",
    "pip ",
    "uv ",
    "git clone ",
    "srun ",
)
SETUP = {
    "pip",
    "uv",
    "git",
    "sbatch",
    "srun",
    "scancel",
    "squeue",
    "cd",
    "cp",
    "ls",
    "cat",
    "diff",
    "export",
    "mkdir",
    "echo",
    "nvidia-smi",
    "jupyter",
    "tensorboard",
    "source",
    "scripts/lock.sh",
    "watch",
    "rm",
    "tar",
    "conda",
    "wget",
    "curl",
    "du",
    "time",
    "fabric",
}
PLACEHOLDER = re.compile(r"[<>*{}$\[\]|…]|\.\.\.|^[A-Z][A-Z_0-9]*$|NN")
SCRIPTS = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
REFUSED = "[refused] "  # a command the page shows being refused ("# exit 2" beside it)
NO_GPU = Hardware(cuda_devices=0, cpu_cores=2)
GPUS = Hardware(cuda_devices=8, cpu_cores=64)


# ------------------------------------------------------------------------------------------- finding
def _lines_of_block(text: str) -> list[str]:
    joined, out = text.replace("\\\n", " "), []
    for line in joined.splitlines():
        line = line.strip()
        if line.startswith("$ "):
            line = line[2:]
        if not line or line.startswith("#"):
            continue
        line, *comment = re.split(r"\s{2,}#\s|\s#\s(?=[a-z(])", line)
        refused = REFUSED if comment and "exit 2" in comment[0] else ""  # shown as a refusal
        out.extend(refused + part.strip() for part in line.strip().split("&&"))
    return [c for c in out if c]


def commands_of(text: str) -> list[tuple[int, str]]:
    """(line, command) of every fenced shell line and inline command in a markdown text."""
    found, spans = [], []
    for m in FENCE.finditer(text):
        spans.append(m.span())
        if m.group(2) in ("bash", "sh", "shell", "console", ""):
            line = text.count("\n", 0, m.start()) + 2
            found += [(line, c) for c in _lines_of_block(m.group(3)) if _looks_like_a_command(c)]
    for m in INLINE.finditer(text):
        if any(a <= m.start() < b for a, b in spans):
            continue
        command = " ".join(m.group(1).split())
        if command.startswith(STARTS) or re.match(r"[A-Z_]+=\S+ (python|fmr-|\./run_all)", command):
            found.append((text.count("\n", 0, m.start()) + 1, command))
    return found


def _looks_like_a_command(line: str) -> bool:
    try:
        words = _strip_env(shlex.split(line, comments=True))
    except ValueError:  # an unclosed quote: still checked (and reported) as a command if it starts like one
        words = line.split()
    return bool(words) and (
        line.startswith(STARTS) or words[0] in SETUP or words[0].startswith(("fmr-", "./"))
    )


def notebook_commands() -> list[tuple[int, str]]:
    cells = json.loads(NOTEBOOK.read_text())["cells"]
    found = []
    for i, cell in enumerate(cells):
        if cell["cell_type"] == "code":
            for line in "".join(cell["source"]).splitlines():
                if line.startswith("!"):
                    found += [(i, c) for c in _lines_of_block(line[1:])]
        else:
            found += [(i, c) for _, c in commands_of("".join(cell["source"]))]
    return found


def all_commands() -> list[tuple[str, int, str]]:
    out = [
        (p.name if p.parent == REPO else f"docs/{p.name}", n, c)
        for p in PAGES
        for n, c in commands_of(p.read_text())
    ]
    return out + [("docs/workshop.ipynb", n, c) for n, c in notebook_commands()]


def _strip_env(words: list[str]) -> list[str]:
    while words and re.match(r"^[A-Z_][A-Z_0-9]*=", words[0]):
        words = words[1:]
    return words


# ------------------------------------------------------------------------------------------ checking
@functools.cache
def _recipe(name: str):
    return load_recipe_module(name)


@functools.cache
def help_text(module: str) -> str:
    """``python -m module --help``, in this interpreter (fmr-ladder execs run_all.sh: its help)."""
    if module == "fabric_memory_recipes.tools.ladder":
        return run_all_help()
    if module == "fabric_memory_recipes.planning":  # its help is per mode: the ladder's, --fit's, --model's
        return "".join(_help(module, *a) for a in ([], ["--fit", "1GB"], ["--model", "torchvision:resnet18"]))
    return _help(module)


def _help(module: str, *args: str) -> str:
    out, saved = io.StringIO(), sys.argv
    sys.argv = [module, *args, "--help"]
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
            with contextlib.suppress(SystemExit):
                runpy.run_module(module, run_name="__main__", alter_sys=False)
    finally:
        sys.argv = saved
    return out.getvalue()


@functools.cache
def run_all_help() -> str:
    return subprocess.run(
        ["bash", str(REPO / "run_all.sh"), "--help"], capture_output=True, text=True, cwd=REPO, timeout=60
    ).stdout


def _parse(name: str, flags: list[str], hardware: Hardware) -> str | None:
    """None if the recipe accepts ``flags`` on ``hardware``, else the one line it prints."""
    from fabric_memory_recipes.training import cli

    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            cli.parse(_recipe(name).RUNG, flags, hardware=hardware)
    except SystemExit:
        return err.getvalue().strip() or "exit 2"
    return None


def _is_template(words: list[str]) -> bool:
    return any(PLACEHOLDER.search(w) for w in words)


def check_recipe(words: list[str]) -> str | None:
    script = next(w for w in words if w.startswith("recipes/") and w.endswith(".py"))
    args = words[words.index(script) + 1 :]
    if _is_template([script]):
        return None if list(REPO.glob(script.replace("NN", "[0-9][0-9]"))) else f"no file matches {script}"
    if not (REPO / script).exists():
        return f"{script} does not exist"
    name = Path(script).stem
    if _is_template(args):
        return None
    if "--help" in args or "-h" in args:
        return None
    if "cpu" in args or words[0] in ("torchrun", "fabric", "srun"):
        return _parse(name, args, NO_GPU if "cpu" in args else GPUS)
    if problem := _parse(name, args, GPUS):
        return f"refused on GPUs: {problem}"
    refusal = _parse(name, args, NO_GPU)
    if refusal is not None and "a quick CPU run: " in refusal:  # the CPU form the recipe declares
        cpu = shlex.split(refusal.split("a quick CPU run: ")[1].split(" (pass")[0])
        if problem := _parse(Path(cpu[1]).stem, cpu[2:], NO_GPU):
            return f"its CPU form is refused: {problem}"
    evidence = list((REPO / "results" / "published").rglob(f"{name}*.json"))
    return None if evidence else f"GPU-only, and no committed results of {name} under results/published/"


def check_tool(words: list[str]) -> str | None:
    if words[0].startswith("fmr-"):
        if words[0] not in SCRIPTS:
            return f"{words[0]} is not a console script of pyproject.toml"
        module, args = SCRIPTS[words[0]].split(":")[0], words[1:]
    else:
        module, args = words[words.index("-m") + 1], words[words.index("-m") + 2 :]
    if module.endswith(".__main__"):
        module = module[: -len(".__main__")]
    if module == "torch.distributed.run" and "-m" in args:  # torchrun's flags, then the module it starts
        inner = args.index("-m")
        return check_tool(["python", "-m", "torch.distributed.run", *args[:inner]]) or check_tool(
            ["python", "-m", *args[inner + 1 :]]
        )
    try:
        if importlib.util.find_spec(module) is None:
            return f"no module {module}"
    except ModuleNotFoundError:
        return f"no module {module}"
    shown = help_text(module)
    missing = [a.split("=")[0] for a in args if a.startswith("--") and a.split("=")[0] not in shown]
    return f"{module} --help does not list {missing}" if missing else None


def check_setup(words: list[str]) -> str | None:
    problems = []
    for flag, value in zip(words, words[1:], strict=False):
        if flag in ("-c", "-r") and not (REPO / value).exists():
            problems.append(f"{flag} {value}: no such file")
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    for w in words:
        if m := re.match(r"^[.\w-]*\[([\w,]+)\]$", w.strip("'\"")):
            problems += [f"no extra [{e}]" for e in m.group(1).split(",") if e not in extras]
    if words[0] == "sbatch" and not _is_template(words[-1:]) and not (REPO / words[-1]).exists():
        problems.append(f"{words[-1]}: no such file")
    return "; ".join(problems) or None


def check(command: str) -> str | None:
    """None when the command works as the docs show it; else what is wrong."""
    if command.startswith(REFUSED):
        words = shlex.split(command[len(REFUSED) :])
        script = next(w for w in words if w.startswith("recipes/"))
        args = words[words.index(script) + 1 :]
        refused = _parse(Path(script).stem, args, NO_GPU if "cpu" in args else GPUS)
        return None if refused else "shown as refused (exit 2), but the recipe accepts it"
    try:
        words = _strip_env(shlex.split(command))
    except ValueError as e:
        return f"cannot be split into words: {e}"
    if not words:
        return None
    if any(w.startswith("recipes/") and w.endswith(".py") for w in words):
        return check_recipe(words)
    if words[0].startswith("fmr-") or (words[0] in ("python", "python3") and "-m" in words[:3]):
        if words[0] in ("python", "python3") and words[words.index("-m") + 1] == "pip":
            return check_setup(words)
        if _is_template(words[:1]):
            return None
        return check_tool(words)
    if words[0] == "./run_all.sh":  # its own flags, then after `--` every recipe's
        own, recipe = (
            (words[1 : words.index("--")], words[words.index("--") + 1 :])
            if "--" in words
            else (words[1:], [])
        )
        missing = [w for w in own if w.startswith("--") and w not in run_all_help() + " --help"]
        if problem := _parse("01_baseline", [*recipe, "--accelerator", "cpu"], NO_GPU):
            missing.append(problem)
        return f"./run_all.sh: {missing}" if missing else None
    if words[0] in SETUP or words[0] in ("python", "python3"):
        return check_setup(words)
    return (
        f"not a command this test knows: declare how to check {words[0]!r} (tests/docs/test_doc_commands.py)"
    )


@pytest.mark.parametrize("page", [*[str(p.relative_to(REPO)) for p in PAGES], "docs/workshop.ipynb"])
def test_every_command_a_page_shows_works(page):
    wrong = [
        f"{p}:{n}: `{c}`: {problem}"
        for p, n, c in all_commands()
        if p == page
        for problem in [check(c)]
        if problem
    ]
    assert not wrong, "\n".join(wrong)


def test_the_check_finds_what_was_wrong():
    """What the check must find: a module that is not there, a flag a recipe does not have, an extra."""
    assert "no module nowhere.compare_reference" in check("python -m nowhere.compare_reference --reference X")
    assert "--no-such-flag" in check("python recipes/01_baseline.py --accelerator cpu --no-such-flag")
    assert "no extra [nope]" in check('python3 -m pip install -c constraints.txt -e ".[nope]"')
    assert check("python recipes/01_baseline.py --accelerator cpu --model vit_tiny --max-steps 2") is None
    found = commands_of(
        "Run `fmr-estimate --recipe 14_memory_floor` or\n\n```bash\n./run_all.sh --quick  # GPU\n```\n"
    )
    assert [c for _, c in found] == ["./run_all.sh --quick", "fmr-estimate --recipe 14_memory_floor"]


# --------------------------------------------------------------------------- README's commands, run
RUN_ON_CPU = {
    "fmr-estimate --recipe 14_memory_floor": None,
    "fmr-estimate --fit 8GB": None,
    "fmr-estimate --check results/published/h100/ladder": None,
    "fmr-estimate --model torchvision:resnet50 --batch-size 64 --precision bf16-mixed": None,
    "fmr-estimate --model hf:examples/configs/qwen2-0.5b --seq-len 512 --batch-size 8 --precision bf16-mixed --fit 16GB": None,
}


def test_readme_commands_that_run_on_cpu_are_the_ones_run_here():
    readme = {c for _, c in commands_of((REPO / "README.md").read_text()) if c.startswith("fmr-estimate")}
    assert readme == set(RUN_ON_CPU)


# The two slowest commands (the planner's search for Qwen2, the check of the committed ladder: together over
# two minutes of CPU in this process) run as processes in the background while the in-process tests run;
# a fresh process may also fork the planner's worker processes, which this one may not after a backward.
AS_PROCESSES = (
    "fmr-estimate --check results/published/h100/ladder",
    "fmr-estimate --model hf:examples/configs/qwen2-0.5b --seq-len 512 --batch-size 8 --precision bf16-mixed --fit 16GB",
)
BACKGROUND_TESTS = {"test_readme_estimate_commands_run_as_processes"}
BACKGROUND_PRIORITY = 10  # the planner's search is one of the longest jobs: start it first


def start_background_jobs() -> None:
    for command in AS_PROCESSES:
        submit_estimate(command)


@pytest.mark.parametrize("command", sorted(set(RUN_ON_CPU) - set(AS_PROCESSES)))
def test_readme_estimate_commands_run_on_a_cpu(command):
    if RUN_ON_CPU[command]:
        pytest.xfail(RUN_ON_CPU[command])
    code, out, err = run_estimate(command)
    assert code == 0 and out.strip() and "Traceback" not in err, err[-2000:]


@pytest.mark.parametrize("command", AS_PROCESSES)
def test_readme_estimate_commands_run_as_processes(command):
    assert command in RUN_ON_CPU
    if RUN_ON_CPU[command]:
        pytest.xfail(RUN_ON_CPU[command])
    proc = result(submit_estimate(command))
    assert proc.returncode == 0 and proc.stdout.strip() and "Traceback" not in proc.stderr, proc.stderr[
        -2000:
    ]
