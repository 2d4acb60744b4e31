"""The shape of the code, read from the source: what a reader of the repository is promised.

- ``fabric_memory_recipes/`` imports form a DAG: the graph is built from the import statements of every module and a
  cycle fails the test, naming it;
- imports sit at the top of a module; an import inside a function is allowed only for the optional or
  deliberately lazy dependencies listed in LAZY, each with its reason;
- ``fabric_memory_recipes/config.py`` imports nothing else from ``fabric_memory_recipes`` but ``techniques.py``
  (the names of what a run chooses), which imports nothing;
- no file in ``fabric_memory_recipes/`` (its tools included) or ``experiments/`` is over 400 lines; recipes
  01-15 are at most 80 lines, the bonus ones 120;
- the loop's teaching core (``fabric_memory_recipes.training.loop.fit``) is at most 60 lines;
- every numbered recipe declares its rung (``RUNG``) and marks its own technique with ``# rung NN``;
- every numbered recipe's docstring points at the code of its technique (``path/to/file.py: function``);
- a technique is its record (``techniques.py``), its module (``training/techniques/``) and its recipe;
- nothing cites the team's notes, which a reader of the repository does not have;
- ``results/`` holds no code (a script that made a result lives in ``scripts/`` or ``devtools/``), and every
  project module a script, tool, recipe, experiment or test imports exists;
- ``tests/`` folders, like the package's, hold at most 12 modules each.
"""

from __future__ import annotations

import ast
import dataclasses
import re
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
COMMON = REPO / "fabric_memory_recipes"
RECIPES = REPO / "recipes"
DEVTOOLS = REPO / "devtools"

# Imports that may stay inside a function in fabric_memory_recipes/, and why.
LAZY = {
    "huggingface_hub": "optional (comes with the 'hf' extra's transformers): an installed wheel plans without it",
    "liger_kernel": "optional, CUDA only: --fused-loss's kernel; the chunked torch path runs without it",
    "torchao": "optional (extra 'lowbit'/'bf16'): only rung 13, --bf16-update stochastic and --weights-quant need it",
    "optimi": "optional (extra 'bf16'): only --bf16-update kahan needs it",
    "peft": "optional (extras 'peft', 'bonus'): only --lora-rank needs it, and importing it imports transformers",
    "datasets": "optional: IMDb through the hub only; the GPU machines behind the results lack it",
    "matplotlib": "figures only; importing pyplot picks a backend, which a library must not do on import,"
    " and costs every recipe process that draws nothing",
    "pynvml": "the whole-device sampler's first method; NVML needs a driver, so it is loaded only for a CUDA run"
    " (without it the sampler falls back to torch.cuda.mem_get_info)",
    "timm": "optional (extra 'timm'): only --model timm:NAME needs it",
    "transformers": "only the text models need it; importing it takes seconds (and scikit-learn with it,"
    " when installed), which fmr-estimate for a torchvision or timm model must not pay (its target: < 30 s)",
    "sklearn": "only --data digits reads scikit-learn's bundled set; ~0.5 s per process otherwise",
    "lightning": "only a run's Fabric and strategy need it; fmr-estimate imports the runner's modules, and"
    " Lightning (torchmetrics, and transformers with it) would cost its every start ~4 s of CPU",
}


def module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def common_modules(tools: bool = False) -> dict[str, Path]:
    """The package's modules; its command-line tools (``fabric_memory_recipes/tools/``) only with
    ``tools``: they may import lazily so that ``--help`` answers fast."""
    return {
        module_name(p): p
        for p in sorted(COMMON.rglob("*.py"))
        if tools or "tools" not in p.relative_to(COMMON).parts
    }


def imported_common(node: ast.AST, modules: set[str]) -> set[str]:
    """The ``fabric_memory_recipes`` modules an import statement imports (``from fabric_memory_recipes.training import x`` names module x)."""
    found = set()
    if isinstance(node, ast.Import):
        for alias in node.names:
            if alias.name.startswith("fabric_memory_recipes"):
                found.add(alias.name)
    elif (
        isinstance(node, ast.ImportFrom)
        and node.module
        and node.module.startswith("fabric_memory_recipes")
        and not node.level
    ):
        for alias in node.names:
            sub = f"{node.module}.{alias.name}"
            found.add(sub if sub in modules else node.module)
    return {m for m in found if m in modules}


def import_graph() -> dict[str, set[str]]:
    modules = common_modules(tools=True)
    graph = {}
    for name, path in modules.items():
        tree = ast.parse(path.read_text())
        edges = set()
        for node in ast.walk(tree):
            edges |= imported_common(node, set(modules))
        graph[name] = edges - {name, "fabric_memory_recipes"}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph`` as a path that ends where it starts, or None."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt) :] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


# ------------------------------------------------------------------------------------------ imports
def test_the_cycle_finder_finds_a_cycle():
    """Guard for the test below: a graph with a cycle is reported, one without is not."""
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None


def test_common_imports_form_a_dag():
    graph = import_graph()
    assert {
        "fabric_memory_recipes.config",
        "fabric_memory_recipes.training.loop",
        "fabric_memory_recipes.planning.simulation.simulate",
    } <= set(graph)  # it read them
    assert "fabric_memory_recipes.training.data" in graph["fabric_memory_recipes.training.loop"]
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle in fabric_memory_recipes/: " + " -> ".join(cycle)


LAYERS = ("measurement", "training", "planning", "tools")  # each may import only those before it


def test_each_layer_imports_only_the_layers_above_it():
    def layer(module: str) -> int:
        part = module.split(".")[1] if "." in module else ""
        return LAYERS.index(part) if part in LAYERS else -1  # the top: config, console, faults, paths

    graph = import_graph()
    assert (
        "fabric_memory_recipes.measurement.card_overhead" in graph["fabric_memory_recipes.training.lifecycle"]
    )
    upward = [f"{m} -> {d}" for m, deps in graph.items() for d in deps if layer(d) > layer(m)]
    assert not upward, upward


def test_config_imports_only_the_names_of_what_a_run_chooses():
    graph = {k.removeprefix("fabric_memory_recipes."): v for k, v in import_graph().items()}
    assert (graph["config"], graph["techniques"]) == ({"fabric_memory_recipes.techniques"}, set())


def test_imports_are_at_the_top_and_lazy_ones_are_listed():
    late, inside = [], []
    for name, path in common_modules().items():
        tree = ast.parse(path.read_text())
        body = tree.body
        # the leading block: docstring, imports (and `if TYPE_CHECKING` / try-imports would go here)
        first_other = next(
            (
                i
                for i, n in enumerate(body)
                if not isinstance(n, ast.Import | ast.ImportFrom)
                and not (i == 0 and isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant))
            ),
            len(body),
        )
        for node in body[first_other:]:
            if isinstance(node, ast.Import | ast.ImportFrom):
                late.append(f"{name}:{node.lineno}")
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                for inner in ast.walk(node):
                    if isinstance(inner, ast.Import | ast.ImportFrom):
                        top = (
                            inner.module if isinstance(inner, ast.ImportFrom) else inner.names[0].name
                        ) or ""
                        if top.split(".")[0] not in LAZY:
                            inside.append(f"{name}:{inner.lineno} {top}")
    assert not late, f"imports after the first statement: {late}"
    assert not inside, f"imports inside functions (allowed only for {sorted(LAZY)}): {inside}"


def _project_imports_inside_functions(path: Path) -> list[str]:
    where = path.relative_to(REPO) if path.is_relative_to(REPO) else path.name
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            for inner in ast.walk(node):
                if isinstance(inner, ast.ImportFrom) and (inner.module or "").startswith(
                    ("fabric_memory_recipes", "devtools")
                ):
                    found.append(f"{where}:{inner.lineno} {inner.module}")
                elif isinstance(inner, ast.Import):
                    found += [
                        f"{where}:{inner.lineno} {a.name}"
                        for a in inner.names
                        if a.name.startswith(("fabric_memory_recipes", "devtools"))
                    ]
    return sorted(set(found))


def test_no_project_import_hides_inside_a_function():
    """The package, its tools, devtools/, the recipes and experiments/ import the project at the top,
    where a reader sees what a module depends on (and the layer test sees it too)."""
    files = [
        *COMMON.rglob("*.py"),
        *DEVTOOLS.glob("*.py"),
        *RECIPES.glob("*.py"),
        *(REPO / "experiments").glob("*.py"),
    ]
    assert len(files) > 100
    hidden = [hit for path in files for hit in _project_imports_inside_functions(path)]
    assert not hidden, hidden


def test_the_finder_finds_a_hidden_import(tmp_path):
    path = tmp_path / "probe.py"
    path.write_text("def f():\n    from fabric_memory_recipes.training import loop\n    return loop\n")
    assert _project_imports_inside_functions(path) == ["probe.py:2 fabric_memory_recipes.training"]


def test_the_installed_package_holds_no_devtools_and_never_imports_them():
    """Proof and maintenance tools live in devtools/, beside the package: not in a wheel (pyproject
    installs fabric_memory_recipes* only), and nothing in the package imports them."""
    pyproject = (REPO / "pyproject.toml").read_text()
    assert 'include = ["fabric_memory_recipes*"]' in pyproject
    assert (
        not (COMMON / "tools" / "check_equivalence.py").exists()
        and (DEVTOOLS / "check_equivalence.py").exists()
    )
    graph_targets = {d for deps in import_graph().values() for d in deps}
    assert not [d for d in graph_targets if d.startswith("devtools")]
    for path in COMMON.rglob("*.py"):
        tree = ast.parse(path.read_text())
        mods = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
        mods |= {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        assert not [m for m in mods if m.split(".")[0] == "devtools"], path


# ------------------------------------------------------------------------------------------- sizes
MAX_MODULES = 12  # per folder: more, and the folder is a bag that wants sub-folders


def test_no_folder_of_the_package_devtools_or_tests_holds_more_than_twelve_modules():
    tests = REPO / "tests"
    folders = [COMMON, DEVTOOLS, tests]
    folders += [p for r in (COMMON, tests) for p in r.rglob("*") if p.is_dir() and p.name != "__pycache__"]
    counts = {str(f.relative_to(REPO)): len(list(f.glob("*.py"))) for f in folders}
    assert (
        counts["fabric_memory_recipes/training"] >= 5 and "fabric_memory_recipes/planning/planner" in counts
    )
    assert counts["tests/training"] >= 5
    assert {f: n for f, n in counts.items() if n > MAX_MODULES} == {}


def test_no_file_in_the_package_its_tools_or_experiments_is_over_400_lines():
    files = [
        *common_modules(tools=True).values(),
        *DEVTOOLS.glob("*.py"),
        *(REPO / "experiments").glob("*.py"),
    ]
    sizes = {str(p.relative_to(REPO)): len(p.read_text().splitlines()) for p in files}
    assert len(sizes) > 20
    assert "fabric_memory_recipes/tools/compare/reference.py" in sizes and "experiments/harness.py" in sizes
    assert {p: n for p, n in sizes.items() if n > 400} == {}


def test_recipes_are_short_enough_to_read_in_one_sitting():
    sizes = {p.stem: len(p.read_text().splitlines()) for p in RECIPES.glob("*.py")}
    numbered = {k: n for k, n in sizes.items() if re.match(r"\d\d_", k)}
    assert len(numbered) >= 16
    assert {k: n for k, n in numbered.items() if n > 80} == {}
    assert {k: n for k, n in sizes.items() if k.startswith("bonus_") and n > 120} == {}


def _function(path: Path, name: str) -> tuple[ast.FunctionDef, str]:
    text = path.read_text()
    node = next(n for n in ast.parse(text).body if isinstance(n, ast.FunctionDef) and n.name == name)
    return node, ast.get_source_segment(text, node)


def test_the_loop_core_is_at_most_60_lines_and_marks_its_rungs():
    fit, loop = _function(COMMON / "training" / "loop.py", "fit")
    step, train_step = _function(COMMON / "training" / "step.py", "train_step")
    assert fit.end_lineno - fit.lineno + 1 <= 60 and step.end_lineno - step.lineno + 1 <= 40
    for rung in ("05", "06"):  # accumulation (the groups), the schedule
        assert f"# rung {rung}" in loop, rung
    for rung in ("05", "12"):  # accumulation (the loss divided, no sync), the step inside backward
        assert f"# rung {rung}" in train_step, rung
    assert "train_step(" in loop and "accumulation_groups(" in loop
    assert "fabric.no_backward_sync" in train_step and "fabric.backward" in train_step


def _calls(node: ast.AST) -> set[str]:
    """``a.b.backward(...)`` -> 'backward'; ``opt.step()`` -> 'opt.step' (the receiver's last name)."""
    found = set()
    for call in ast.walk(node):
        if isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute):
            receiver = call.func.value
            name = receiver.attr if isinstance(receiver, ast.Attribute) else getattr(receiver, "id", "")
            found.add(call.func.attr if call.func.attr == "backward" else f"{name}.{call.func.attr}")
    return found


def training_steps(paths, root: Path = REPO) -> list[str]:
    """Functions that write a training step: a backward and an optimizer's step in the same function."""
    found = []
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                calls = _calls(node)
                stepped = any(c.endswith(".step") and "opt" in c.split(".")[0] for c in calls)
                if "backward" in calls and stepped:
                    found.append(f"{path.relative_to(root)}:{node.name}")
    return found


def test_the_training_step_is_written_once():
    """Eager training, fast mode's graph, the experiments and the tools all call training/step.py's
    train_step: no second forward/backward/step sequence in the package, its tools or experiments."""
    paths = [*COMMON.rglob("*.py"), *(REPO / "experiments").glob("*.py")]
    assert training_steps(paths) == ["fabric_memory_recipes/training/step.py:train_step"]


def test_the_step_finder_finds_a_step(tmp_path):
    """Guard for the test above: a hand-written step is found, a hook that only steps is not."""
    (tmp_path / "x.py").write_text(
        "def step(model, optimizer, x):\n    model(x).sum().backward()\n    optimizer.step()\n"
        "def hook(p):\n    optimizers[p].step()\n"
    )
    assert training_steps([tmp_path / "x.py"], root=tmp_path) == ["x.py:step"]


# ------------------------------------------------------------------------------------------ recipes
@pytest.mark.parametrize("path", sorted(RECIPES.glob("[0-9][0-9]_*.py")), ids=lambda p: p.stem)
def test_a_recipe_declares_its_rung_and_marks_its_technique(path):
    from fabric_memory_recipes.declarations import declared_rung

    rung, description = declared_rung(path.stem)
    assert rung.recipe == path.stem and description.startswith("Rung ")
    number = path.stem[:2]
    assert f"# rung {number}" in path.read_text(), f"{path.name} marks no line with its rung"


# ``path/to/file.py: name``: where a recipe's docstring says its technique lives (a path from the repository root)
CODE_REFERENCE = re.compile(r"((?:fabric_memory_recipes|recipes|devtools)/[\w/]+\.py):\s+([A-Za-z_]\w*)")


def code_references(text: str) -> list[tuple[str, str]]:
    """The ``path/to/file.py: function_name`` references in ``text`` (a reference may wrap at the colon)."""
    return CODE_REFERENCE.findall(text)


def defines(path: Path, name: str) -> bool:
    """Whether the module at ``path`` defines a function or class ``name`` (at any depth)."""
    kinds = ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef
    return any(isinstance(n, kinds) and n.name == name for n in ast.walk(ast.parse(path.read_text())))


def test_the_reference_finder_reads_a_wrapped_reference():
    """Guard for the test below: references are found, also across a line break after the colon."""
    text = "lives in fabric_memory_recipes/training/step.py: train_step, and in\nrecipes/08_fsdp.py:\nmake_strategy."
    assert code_references(text) == [
        ("fabric_memory_recipes/training/step.py", "train_step"),
        ("recipes/08_fsdp.py", "make_strategy"),
    ]
    assert defines(COMMON / "training" / "step.py", "train_step")
    assert not defines(COMMON / "training" / "loop.py", "train_step")


@pytest.mark.parametrize("path", sorted(RECIPES.glob("[0-9][0-9]_*.py")), ids=lambda p: p.stem)
def test_a_recipe_docstring_points_at_the_code_of_its_technique(path):
    """Every numbered recipe names, in its docstring, at least one ``path/to/file.py: name`` that holds
    its technique, and every such reference names a file that exists and defines that function or class."""
    docstring = ast.get_docstring(ast.parse(path.read_text())) or ""
    found = code_references(docstring)
    assert found, f"{path.name}: its docstring names no `path/to/file.py: function_name`"
    wrong = [
        f"{file}: {name}"
        for file, name in found
        if not (REPO / file).is_file() or not defines(REPO / file, name)
    ]
    assert not wrong, f"{path.name} points at code that is not there: {wrong}"


# ------------------------------------------------------------------------------------- techniques
def test_a_technique_is_its_record_its_module_and_its_recipe():
    from fabric_memory_recipes.techniques import OPTIMIZERS, TECHNIQUES  # records: module, field, recipe, row
    from fabric_memory_recipes.training.your_model.runner import YourModelConfig

    fields = [*dataclasses.fields(YourModelConfig), *YourModelConfig.flag_fields()]
    names = {f.name for f in fields} | set(OPTIMIZERS)
    table = (REPO / "docs" / "architecture.md").read_text().split("## Where each technique lives")[1]
    folder = COMMON / "training" / "techniques"  # a sub-folder's module is named folder.module
    modules = {".".join(p.relative_to(folder).with_suffix("").parts) for p in folder.rglob("[!_]*.py")}
    assert modules == {t.module for t in TECHNIQUES} and len({t.name for t in TECHNIQUES}) == len(TECHNIQUES)
    for t in TECHNIQUES:
        recipe = (RECIPES / f"{t.rung}.py").read_text()
        package, _, leaf = f"techniques.{t.module}".rpartition(".")
        assert re.search(rf"{re.escape(package)}(\.| import [\w, ]*\b){leaf}\b", recipe), t  # imports it
        path = f"training/techniques/{t.module.replace('.', '/')}.py"
        assert (t.name in names or t.name in recipe) and path in table, t


def test_technique_code_is_in_training_techniques_or_the_estimates_model_only():
    calls = {
        "checkpoint",
        "checkpoint_wrapper",
        "create_selective_checkpoint_contexts",
        "register_post_accumulate_grad_hook",
        "save_on_cpu",
        "saved_tensors_hooks",
    }

    def found(paths) -> list[str]:
        return [
            f"{path.relative_to(REPO)}:{n.lineno}"
            for path in paths
            for n in ast.walk(ast.parse(path.read_text()))
            if (isinstance(n, ast.Call) and getattr(n.func, "attr", getattr(n.func, "id", "")) in calls)
            or (isinstance(n, ast.ImportFrom) and re.match(r"torch\..*checkpoint", n.module or ""))
        ]

    own = (COMMON / "training" / "techniques", COMMON / "planning" / "simulation")
    assert found([own[0] / "step_in_backward.py", own[0] / "checkpointing.py"])  # the finder finds
    assert found(p for p in COMMON.rglob("*.py") if not any(p.is_relative_to(o) for o in own)) == []


# -------------------------------------------------------------------------------------------- text
CITATIONS = re.compile(r"DESIGN\.md|TARGETS\.md|(?i:\bseed[ -]0\d\d\b|\bseed \d{3}\b|seed article)")


def test_nothing_cites_notes_the_repository_does_not_hold():
    tracked = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True).stdout
    found = []
    for rel in tracked.splitlines():
        path = REPO / rel
        if path.suffix not in (".py", ".md", ".sh", ".toml", ".sbatch") or not path.exists():
            continue
        for i, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            if CITATIONS.search(line) and path.name != "test_architecture.py":
                found.append(f"{rel}:{i}: {line.strip()[:100]}")
    assert not found, "\n".join(found)


# ------------------------------------------------------------------------------------------- code
def test_no_code_lives_under_results():
    """results/ is evidence; the script that made a result lives in scripts/ or devtools/ and the result's
    NOTES.md names it (a script kept beside its result stops running when the modules it imports move)."""
    assert (REPO / "results" / "published").is_dir()
    code = sorted(str(p.relative_to(REPO)) for p in (REPO / "results").rglob("*.py"))
    assert code == []


PROJECT = ("fabric_memory_recipes", "devtools")


def missing_project_modules(path: Path) -> list[str]:
    """The ``fabric_memory_recipes`` / ``devtools`` modules that ``path`` imports and the repository lacks."""
    where = path.relative_to(REPO) if path.is_relative_to(REPO) else path.name
    missing = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and not node.level:
            names = [node.module or ""]
        elif isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        else:
            continue
        for name in names:
            if name.split(".")[0] in PROJECT:
                module = REPO.joinpath(*name.split("."))
                if not (module.with_suffix(".py").is_file() or (module / "__init__.py").is_file()):
                    missing.append(f"{where}:{node.lineno} {name}")
    return missing


def test_the_module_finder_finds_a_module_that_moved(tmp_path):
    """Guard for the test below: an import of a module that is not there is reported, one that is is not."""
    path = tmp_path / "probe.py"
    path.write_text(
        "from fabric_memory_recipes.training.weights_offload import WeightsOnCPU\n"
        "from fabric_memory_recipes.training.techniques.weights_offload import WeightsOnCPU\n"
        "import devtools.check_equivalence\nimport torch\n"
    )
    assert missing_project_modules(path) == ["probe.py:1 fabric_memory_recipes.training.weights_offload"]


def test_every_project_module_a_script_imports_exists():
    """scripts/, devtools/, recipes/, experiments/ and tests/ import only project modules that exist
    (the package's own imports are checked by the import graph above)."""
    roots = ("scripts", "devtools", "recipes", "experiments", "tests")
    files = [p for root in roots for p in (REPO / root).rglob("*.py")]
    assert len(files) > 60 and REPO / "scripts" / "gpu" / "weights_offload_equivalence.py" in files
    missing = [hit for path in files for hit in missing_project_modules(path)]
    assert not missing, missing
