"""The harness keeps each test independent of what ran before it (tests/conftest.py): what a test sets for
the whole process is put back after it, and the processes the tests start inherit the session's
environment, not what the in-process test running at that moment has set."""

from __future__ import annotations

import os
import signal

import torch

from tests.conftest import (
    _SESSION_ENV,
    KEPT_FOR_THE_SESSION,
    load_recipe_module,
    process_state_kept,
    session_setting_changed,
    subprocess_env,
)

SET_BY_A_TEST = "FMR_TEST_SET_BY_A_TEST"
ALLOC = "PYTORCH_CUDA_ALLOC_CONF"


def _state() -> tuple:
    return (
        dict(os.environ),
        os.getcwd(),
        torch.get_default_dtype(),
        torch.get_num_threads(),
        torch.get_float32_matmul_precision(),
        torch.is_grad_enabled(),
        signal.getsignal(signal.SIGHUP),
    )


def test_what_a_test_sets_for_the_process_is_put_back(tmp_path):
    before = _state()
    with process_state_kept():
        os.environ[SET_BY_A_TEST] = "1"  # as seed_everything exports PL_GLOBAL_SEED
        del os.environ["FMR_LOG_DIR"]
        os.environ["FMR_OFFLINE"] = "0"
        os.chdir(tmp_path)
        torch.set_default_dtype(torch.float64)
        torch.set_num_threads(torch.get_num_threads() + 1)  # as rung 09 does
        torch.set_float32_matmul_precision("medium" if before[4] != "medium" else "high")
        torch.set_grad_enabled(False)
        signal.signal(signal.SIGHUP, signal.SIG_IGN if before[6] != signal.SIG_IGN else signal.SIG_DFL)
        assert _state() != before
    assert _state() == before


def test_a_started_process_gets_the_sessions_environment_not_a_running_tests(monkeypatch):
    """Background jobs start their processes while in-process tests run: a test's FMR_PUBLISH=1 (or the
    seed Lightning exports) reached whichever process started meanwhile."""
    monkeypatch.setenv(SET_BY_A_TEST, "1")
    monkeypatch.setenv("FMR_PUBLISH", "1")
    env = subprocess_env()
    assert SET_BY_A_TEST not in env
    assert env.get("FMR_PUBLISH") == _SESSION_ENV.get("FMR_PUBLISH")  # unset, unless the session had it
    assert env["FMR_OFFLINE"] == "1" and env["OMP_NUM_THREADS"]


def test_a_recipe_loaded_as_a_module_leaves_the_allocator_setting_as_it_was(monkeypatch):
    """Rung 14 exports PYTORCH_CUDA_ALLOC_CONF at import; test_recipes.py loads every recipe while the tests
    are collected, outside any test, and every test after it found expandable segments set."""
    monkeypatch.delenv(ALLOC, raising=False)
    assert load_recipe_module("14_memory_floor").RUNG.recipe == "14_memory_floor"
    assert ALLOC not in os.environ


def test_a_setting_left_for_the_session_is_named_and_put_back(monkeypatch):
    assert ALLOC in KEPT_FOR_THE_SESSION and session_setting_changed("now") is None
    monkeypatch.setenv(ALLOC, "expandable_segments:True")
    problem = session_setting_changed("after this test")
    assert (
        problem
        == f"{ALLOC}='expandable_segments:True' after this test (the session began with {_SESSION_ENV.get(ALLOC)!r})"
    )
    assert os.environ.get(ALLOC) == _SESSION_ENV.get(ALLOC) and session_setting_changed("now") is None
