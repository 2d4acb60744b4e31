"""run_all.sh --jobs: the GPU lock that lets one recipe train at a time, and the time breakdown by recipe."""

from __future__ import annotations

import json
import threading
import time

from fabric_memory_recipes.measurement import gpu_lock, time_breakdown


def test_the_gpu_lock_lets_one_holder_in_at_a_time(tmp_path, monkeypatch):
    monkeypatch.setenv(gpu_lock.ENV, str(tmp_path / "gpu.lock"))
    events, waited = [], {}
    first_in = threading.Event()

    def first():
        with gpu_lock.exclusive():
            first_in.set()
            time.sleep(0.3)
            events.append("first out")

    def second():
        first_in.wait()
        with gpu_lock.exclusive(waited):
            events.append("second in")

    threads = [threading.Thread(target=first), threading.Thread(target=second)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert events == ["first out", "second in"]
    assert waited["gpu_lock_wait_s"] > 0.1


def test_without_the_variable_nothing_is_locked(monkeypatch):
    monkeypatch.delenv(gpu_lock.ENV, raising=False)
    waited = {}
    with gpu_lock.exclusive(waited), gpu_lock.exclusive(waited):  # would deadlock if it locked
        pass
    assert waited == {}


def test_the_breakdown_splits_a_process_into_its_parts(tmp_path, capsys):
    payload = {
        "memory": {
            "phases": {"model_load": {"wall_s": 4.0}, "train": {"wall_s": 10.0}, "eval": {"wall_s": 0.5}}
        },
        "timing": {"optimizer_steps": 20, "warmup_steps": 3, "median_step_s": 0.2},
        "extra": {"gpu_lock_wait_s": 6.0},
        "estimate": {"seconds": 1.5},
    }
    (tmp_path / "01_baseline.json").write_text(json.dumps(payload))
    parts = time_breakdown.row(payload, 30.0)
    assert parts["steps"] == 17 * 0.2 and parts["warm-up"] == 10.0 - 17 * 0.2
    assert parts["rest"] == 30.0 - (6.0 + 4.0 + 1.5 + 10.0 + 0.5)
    walls = tmp_path / "walls"
    walls.write_text("01_baseline 30\n02_mixed_precision 12\n")
    assert time_breakdown.main([str(tmp_path), str(walls)]) == 0
    out = capsys.readouterr().out
    assert "02_mixed_precision" in out and "(no results JSON)" in out
    assert out.splitlines()[-1].split()[:2] == ["sum", "42.0"]
