"""What makes ``--fit`` for your own model quicker must not change its answer: a simulated step is kept once per
plan it simulates (planning/your_model/sets.py), the worker processes that simulate ahead of the search
(planning/planner/workers.py) give the plan the search makes alone, and a long search says how far it is."""

from __future__ import annotations

import functools
import json
import os
import sys

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from fabric_memory_recipes.planning.__main__ import main as estimate_main
from fabric_memory_recipes.planning.planner import workers
from fabric_memory_recipes.planning.your_model import cli
from fabric_memory_recipes.planning.your_model.sets import UserPlanner
from tests.conftest import result, run_process, session_dir, submit, subprocess_env
from tests.tiny import causal_lm_config

LINUX = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="workers fork, on Linux only")


@functools.cache
def _lm() -> str:
    """A 2-layer Qwen2 causal LM of width 32, written once per session (the background job plans it too)."""
    folder = session_dir("workers_lm")
    fields = causal_lm_config(hidden_size=32, intermediate_size=64, num_attention_heads=2, vocab_size=300)
    (folder / "config.json").write_text(json.dumps({**fields, "num_key_value_heads": 1}))
    return f"hf:{folder}"


@pytest.fixture(scope="module")
def lm() -> str:
    return _lm()


def _simulated_step(planner: UserPlanner, c) -> str:
    """What decides ``c``'s simulated step besides the planner's model: its plan, with accumulation beyond
    two micro-batches as two (the simulation runs two: later ones repeat the second)."""
    plan = vars(planner.plan_of(c, compiled=False))
    return repr(sorted({**plan, "accumulation_steps": min(plan["accumulation_steps"], 2)}.items()))


@pytest.mark.parametrize("flags", [{"may_change": ("precision", "optimizer")}, {"devices": 2}])
def test_two_sets_share_a_simulation_only_when_they_simulate_the_same_step(lm, flags):
    """The search keeps each simulated step under Choice.key: sets of one key must simulate one step (else one
    set would be predicted from another's), and sets of one step one key (else it is simulated twice)."""
    planner = UserPlanner(lm, 2, 16, precision="bf16-mixed", **flags)
    step_of_key: dict[tuple, set] = {}
    key_of_step: dict[tuple, set] = {}
    for c in planner.choices:
        step = _simulated_step(planner, c)
        step_of_key.setdefault(c.key, set()).add(step)
        key_of_step.setdefault(step, set()).add(c.key)
    assert len(step_of_key) > 20
    if "devices" not in flags:  # on one GPU fast and eager mode simulate one step (FSDP: FSDP2 or FSDP1)
        assert len(planner.choices) == 2 * len(step_of_key)
    assert all(len(steps) == 1 for steps in step_of_key.values())
    assert all(len(keys) == 1 for keys in key_of_step.values())


# fmr-estimate in a process of its own (the test's process has run backward passes: workers forked from it
# cannot run autograd, and leave every set to the search), which says how many results it took from workers;
# it runs in the background from the start of the session (conftest.submit) while the in-process tests go on
COUNTED = """
import sys
from fabric_memory_recipes.planning.__main__ import main as estimate_main
from fabric_memory_recipes.planning.planner import workers
from fabric_memory_recipes.planning.__main__ import main
taken, take = [], workers.Workers.take
workers.Workers.take = lambda self, key, *feed: taken.append(take(self, key, *feed)) or taken[-1]
code = main(sys.argv[1:])
print(f"taken from workers: {sum(t[0] for t in taken)}", file=sys.stderr)
sys.exit(code)
"""


BACKGROUND_TESTS = {"test_workers_ahead_of_the_search_give_the_plan_it_makes_alone"}
BACKGROUND_PRIORITY = 20  # one process and its two workers, about 15 s


def _fit_argv() -> list[str]:
    argv = ["--model", _lm(), "--seq-len", "128", "--batch-size", "2", "--precision", "bf16-mixed"]
    return [*argv, "--fit", "0.943GB", "--top", "2", "--json"]  # eager sets fit, fast ones do not


def start_background_jobs() -> None:
    if sys.platform.startswith("linux"):
        env = subprocess_env(**{workers.WORKERS_ENV: "2", "CUDA_VISIBLE_DEVICES": ""})
        submit("fit-workers", run_process, [sys.executable, "-c", COUNTED, *_fit_argv()], env, 300)


@LINUX
def test_workers_ahead_of_the_search_give_the_plan_it_makes_alone(capsys, monkeypatch):
    monkeypatch.setenv(workers.WORKERS_ENV, "0")
    assert estimate_main(_fit_argv()) == 0
    alone = json.loads(capsys.readouterr().out)
    assert alone["fits"] and alone["rejected"]
    ahead = result("fit-workers")
    assert ahead.returncode == 0, ahead.stderr[-2000:]
    taken = int(ahead.stderr.strip().splitlines()[-1].split(": ")[1])
    assert taken > 0 and json.loads(ahead.stdout) == alone


def _double(x):
    if x == "die":
        os._exit(3)
    if x == "fail":
        raise ValueError("no")
    return 2 * x


def _backward(x):
    torch.ones(1, requires_grad=True).sum().backward()
    return x


@LINUX
def test_a_worker_answers_by_key_and_what_it_cannot_answer_is_left_to_the_search():
    pool = workers.Workers(_double, 2, autograd=False)
    try:
        assert len(pool) == 2 and pool.submit("a", 3) and pool.submit("b", "fail")
        assert not pool.submit("a", 3)  # already there
        assert pool.take("a")[:2] == (True, 6)
        assert pool.take("b") == (False, None, 0.0)  # its job raised: the search runs it itself
        assert pool.take("never") == (False, None, 0.0)
        assert pool.submit("c", "die") and pool.take("c") == (False, None, 0.0)  # its worker died
        assert pool.submit("d", 5) and pool.take("d")[:2] == (True, 10)  # the other one still answers
    finally:
        pool.close()


@LINUX
def test_workers_forked_after_a_backward_pass_leave_their_sets_to_the_search():
    """Autograd refuses to run in a process forked after its parent's engine started: such a worker's result
    would be a failed simulation, not the set's, so it answers nothing. The backward runs on fake tensors, as a
    simulated step's does: on a machine without a GPU a backward pass of real CPU tensors starts no thread of the
    engine (the test then held only after an earlier test had simulated in this process)."""
    with FakeTensorMode():
        torch.empty(1, requires_grad=True).sum().backward()
    pool = workers.Workers(_backward, 1)
    try:
        assert pool.submit("a", 1) and pool.take("a") == (False, None, 0.0)
    finally:
        pool.close()


@LINUX
def test_the_first_simulation_decides_whether_more_workers_start(monkeypatch):
    """A quick step (a tiny model's) runs in the search's process from its second simulation on; a slow one
    gets every worker, which simulate what the search will ask for next."""
    offered = [("b", (2,)), ("c", (3,))]
    monkeypatch.setattr(workers, "_autograd_works", lambda: True)  # _double runs none
    quick = workers.Ahead(_double, lambda: offered, 3, immediate=False)
    assert quick.run("a", (1,)) == 2 and len(quick) == 0 and not quick.forkable
    monkeypatch.setattr(workers, "SLOW_S", 0.0)
    slow = workers.Ahead(_double, lambda: offered, 3, immediate=False)
    try:
        assert slow.run("a", (1,)) == 2 and len(slow) == 3
        assert "b" in slow.workers and "c" in slow.workers  # simulated ahead
        assert slow.run("c", (3,)) == 6 and slow.run("z", (7,)) == 14  # taken; run in this process
    finally:
        slow.close()


@LINUX
def test_the_number_of_workers_is_the_environments_or_the_cores():
    assert workers.wanted({workers.WORKERS_ENV: "3"}) == (3, True)  # from the first simulation on
    assert workers.wanted({workers.WORKERS_ENV: "0"}) == (0, True)
    cores = len(os.sched_getaffinity(0))
    assert workers.wanted({}) == (
        (min(cores, workers.MOST) if cores > 1 else 0),
        False,
    )  # once a step is slow
    with pytest.raises(ValueError, match="FMR_PLAN_WORKERS='two'"):
        workers.wanted({workers.WORKERS_ENV: "two"})


def test_a_bad_number_of_workers_is_one_line_and_exit_2(lm, capsys, monkeypatch):
    monkeypatch.setenv(workers.WORKERS_ENV, "two")
    with pytest.raises(SystemExit) as e:
        estimate_main(["--model", lm, "--seq-len", "16", "--batch-size", "2", "--fit", "4GB"])
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and len(err.splitlines()) == 1 and "FMR_PLAN_WORKERS='two'" in err


def test_a_long_search_says_each_simulation_on_stderr_a_quick_one_nothing(lm, capsys):
    planner = UserPlanner(lm, 4, 16, precision="bf16-mixed")
    c = planner.predict(planner.choices[0])
    cli._progress(planner, c, cli.PROGRESS_S - 0.1)
    assert capsys.readouterr().err == ""
    cli._progress(planner, c, cli.PROGRESS_S + 7)
    line = capsys.readouterr().err
    assert line.startswith(f"[fit {cli.PROGRESS_S + 7:4.0f} s] 1 simulated: {c.label()}: ")
    assert line.endswith(" samples/s\n") and line.count("\n") == 1
