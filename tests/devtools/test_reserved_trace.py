"""devtools/your_model/reserved_trace.py: a recorded allocator history without its stack frames, and the
GPU's reserved bytes read from it, on a small made-up snapshot (the shape torch.cuda.memory._snapshot()
writes)."""

from __future__ import annotations

import gzip
import json
import pickle

from devtools.your_model import reserved_trace
from fabric_memory_recipes.planning.simulation import simulate
from tests.tiny import causal_lm_config

MiB = 1 << 20


def _snapshot() -> dict:
    frames = [{"filename": "x.py", "line": 1, "name": "f"}]
    segments = [  # one segment from before the recording (20 MiB, 4 MiB in use), one made during it
        {"address": 0, "total_size": 20 * MiB, "segment_type": "large", "frames": frames,
         "blocks": [{"size": 4 * MiB, "state": "active_allocated", "frames": frames},
                    {"size": 16 * MiB, "state": "inactive", "frames": frames}]},
        {"address": 1 << 30, "total_size": 40 * MiB, "segment_type": "large", "frames": frames,
         "blocks": [{"size": 40 * MiB, "state": "inactive", "frames": frames}]},
    ]  # fmt: skip
    trace = [
        {"action": "alloc", "addr": 4 * MiB, "size": 12 * MiB, "frames": frames},
        {"action": "segment_alloc", "addr": 1 << 30, "size": 40 * MiB, "frames": frames},
        {"action": "alloc", "addr": 1 << 30, "size": 40 * MiB, "frames": frames},
        {"action": "free_completed", "addr": 1 << 30, "size": 40 * MiB, "frames": frames},
        {"action": "free_completed", "addr": 4 * MiB, "size": 12 * MiB, "frames": frames},
    ]
    return {"segments": segments, "device_traces": [trace]}


def test_strip_keeps_sizes_and_order_without_frames(tmp_path):
    path = tmp_path / "run-snapshot.pickle"
    path.write_bytes(pickle.dumps(_snapshot()))
    out = reserved_trace.strip(path)
    with gzip.open(out) as f:
        stripped = pickle.load(f)
    assert out.name == "run-snapshot.pickle.gz"
    assert [e["size"] for e in stripped["device_traces"][0]] == [
        12 * MiB,
        40 * MiB,
        40 * MiB,
        40 * MiB,
        12 * MiB,
    ]
    assert "frames" not in repr(stripped)


def test_gpu_reserved_counts_the_segments_made_during_the_recording():
    start, peak, end = reserved_trace.gpu_reserved(_snapshot())
    assert round(start * 1e9 / MiB) == 20 and round(peak * 1e9 / MiB) == 60 and round(end * 1e9 / MiB) == 60


def test_strip_keeps_where_each_request_came_from():
    frames = [
        {"filename": "/usr/lib/python3/site-packages/torch/_tensor.py", "line": 5, "name": "to"},
        {
            "filename": "/x/torch/distributed/fsdp/_runtime_utils.py",
            "line": 880,
            "name": "_cast_grad_to_param_dtype",
        },
        {"filename": "/x/torch/distributed/fsdp/_runtime_utils.py", "line": 790, "name": "_reduce_grad"},
        {"filename": "/x/fabric_memory_recipes/training/step.py", "line": 56, "name": "train_step"},
    ]
    assert reserved_trace.where(frames) == (
        "fsdp/_runtime_utils.py:880 _cast_grad_to_param_dtype; fsdp/_runtime_utils.py:790 _reduce_grad"
    )
    assert reserved_trace.where(None) == ""


def test_each_streams_reserved_and_allocated_bytes_at_the_peak():
    """A side stream's segment (stream 7) made after the default stream's: both counted at the peak."""
    snapshot = _snapshot()
    for segment in snapshot["segments"]:
        segment["stream"] = 0
    snapshot["segments"][1]["stream"] = 7
    for event in snapshot["device_traces"][0]:
        event["stream"] = 0 if event["addr"] < 1 << 30 else 7
    reserved, allocated = reserved_trace.by_stream_at_peak(snapshot)
    assert {k: v // MiB for k, v in reserved.items()} == {0: 20, 7: 40}
    assert allocated[0] // MiB == 16 and not allocated.get(7)  # the peak: when the segment is made


def test_the_estimates_step_events_are_caught_for_its_flags(tmp_path, capsys):
    """``--estimate FLAGS``: the estimate runs in process and its simulated step's requests are caught where
    the simulation replays them (a step that allocates between its marks), the replay left as it was."""
    folder = tmp_path / "qwen"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(causal_lm_config()))
    replay = simulate.peaks_reserved
    events, marks = reserved_trace.simulated(
        ["--model", f"hf:{folder}", "--seq-len", "32", "--batch-size", "2"]
    )
    assert simulate.peaks_reserved is replay
    step = events[marks["step"] : marks["end"]]
    assert (
        sum(n for kind, _, n in step if kind == "alloc") > 0 and "predicted peak" in capsys.readouterr().out
    )
