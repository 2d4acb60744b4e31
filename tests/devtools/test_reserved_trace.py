"""devtools/your_model/reserved_trace.py: a recorded allocator history without its stack frames, and the
GPU's reserved bytes read from it, on a small made-up snapshot (the shape torch.cuda.memory._snapshot()
writes)."""

from __future__ import annotations

import gzip
import pickle

from devtools.your_model import reserved_trace

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
