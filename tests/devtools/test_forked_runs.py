"""devtools/your_model/forked_runs.py: one child process per row, forked after the imports, its output in its log, its
exit code reported as it ends; no row after the stop file; a row whose forked child cannot use CUDA runs
again as a fresh process."""

from __future__ import annotations

import os
import sys

from devtools.your_model import forked_runs


def run(argv: list[str]) -> int:
    print("pid", os.getpid(), "args", *argv)
    if argv[0] == "raise":
        raise RuntimeError("a row that fails")
    if argv[0] == "exit":
        sys.exit(int(argv[1]))
    return int(argv[0])


def test_each_row_is_a_child_with_its_log_and_its_exit_code(tmp_path):
    said: list[str] = []
    rows = ["a 0", "# a comment", "b exit 2", "", "c raise"]
    codes = forked_runs.run_rows(rows, run, tmp_path, pid_file=tmp_path / "pid", say=said.append)
    assert codes == {"a": 0, "b": 2, "c": 1} and said == ["end a 0", "end b 2", "end c 1"]
    first = (tmp_path / "a.log").read_text().split()
    assert first[2:] == ["args", "0"] and int(first[1]) != os.getpid()  # another process
    assert "RuntimeError: a row that fails" in (tmp_path / "c.log").read_text()
    assert (tmp_path / "pid").read_text() == ""  # no row running


def test_no_row_starts_once_the_stop_file_exists(tmp_path):
    (tmp_path / "stop").touch()
    said: list[str] = []
    assert forked_runs.run_rows(["a 0"], run, tmp_path, stop_file=tmp_path / "stop", say=said.append) == {}
    assert said == ["skip a"] and not (tmp_path / "a.log").exists()


def test_a_row_whose_child_cannot_use_cuda_runs_again_fresh_and_so_do_the_rest(tmp_path):
    recipe = tmp_path / "recipe.py"
    recipe.write_text("import sys\nprint('fresh', *sys.argv[1:])\n")

    def no_cuda(argv: list[str]) -> int:
        print(forked_runs.CUDA_FORK_FAILURES[0])
        return 1

    said: list[str] = []
    codes = forked_runs.run_rows(["a x", "b y"], no_cuda, tmp_path, recipe=str(recipe), say=said.append)
    assert codes == {"a": 0, "b": 0} and said[0].startswith("note a a forked child could not use CUDA")
    assert (tmp_path / "a.log").read_text() == "fresh x\n" and (tmp_path / "b.log").read_text() == "fresh y\n"


def test_with_cuda_expected_a_child_that_finds_none_hands_its_row_to_a_fresh_process(tmp_path):
    recipe = tmp_path / "recipe.py"
    recipe.write_text("print('fresh')\n")
    said: list[str] = []
    codes = forked_runs.run_rows(
        ["a 0"], run, tmp_path, recipe=str(recipe), expect_cuda=True, say=said.append
    )
    assert codes == {"a": 0} and (tmp_path / "a.log").read_text() == "fresh\n"  # this CPU: no device
    assert said[0].startswith("note a a forked child could not use CUDA")
