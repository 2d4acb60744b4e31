"""Rung 11's overlapped offload (fabric_memory_recipes/training/techniques/offload.py), its mechanics on the CPU.

The CPU has no streams, so the tests give the hooks recording streams: every stream operation is logged
and a host synchronisation would fail (the stand-ins have none). They check:
- the gradients are the plain run's, whatever the window, the prefetch and the resident tail;
- the order that makes the copies safe without a host wait: a copy back waits for that slot's copy out,
  the compute stream waits for a tensor's copy before using it, and both side streams rejoin the
  compute stream at the end of every backward (which a CUDA graph capture requires);
- the window bounds what is kept waiting in forward and what is prefetched in backward, and prefetching
  brings a slot in before backward asks for it;
- tensors still waiting when backward starts, and the resident tail, never make the round trip.
"""

from __future__ import annotations

import contextlib
import itertools

import pytest
import torch
import torch.nn.functional as F

from fabric_memory_recipes import planning
from fabric_memory_recipes.measurement.results import RunResults
from fabric_memory_recipes.training import models
from fabric_memory_recipes.training.techniques import offload
from fabric_memory_recipes.training.techniques.offload import Streams, offload_activations
from tests.conftest import load_recipe_module


class Event:
    ids = itertools.count()

    def __init__(self, stream: str) -> None:
        self.id, self.stream = next(self.ids), stream


class RecordingStream:
    """Logs what a CUDA stream would be asked to do; it has no synchronize(), so a host wait fails."""

    def __init__(self, name: str, log: list) -> None:
        self.name, self.log = name, log

    def record_event(self) -> Event:
        event = Event(self.name)
        self.log.append((self.name, "record", event.id))
        return event

    def wait_event(self, event: Event) -> None:
        self.log.append((self.name, "wait", event.id))

    def wait_stream(self, other: RecordingStream) -> None:
        self.log.append((self.name, "wait_stream", other.name))


def recording(log: list):
    compute = RecordingStream("compute", log)
    return lambda device: Streams(
        lambda: compute,
        RecordingStream("out", log),
        RecordingStream("in", log),
        lambda _s: contextlib.nullcontext(),
    )


def model_and_batch():
    model = models.build_model("vit_tiny", None)
    torch.nn.init.normal_(model.heads.head.weight)  # a zero head would leave the blocks without gradients
    g = torch.Generator().manual_seed(0)
    return model, torch.randn(4, 3, 32, 32, generator=g), torch.tensor([1, 2, 3, 4])


def gradients(model, x, y, hooks=None, micro_batches: int = 1) -> list[torch.Tensor]:
    model.zero_grad(set_to_none=True)
    for _ in range(micro_batches):
        with hooks if hooks is not None else contextlib.nullcontext():
            loss = F.cross_entropy(model(x), y)
        loss.backward()
    return [p.grad.clone() for p in model.parameters()]


def slot_sizes(model, x, y) -> list[int]:
    probe = offload_activations(min_bytes=0, devices=("cpu",), window_bytes=0)
    gradients(model, x, y, probe)
    return list(probe._sizes)


@pytest.mark.parametrize("window_blocks", [0, 3])  # 0: one tensor in flight; 3: a few slots ahead
def test_offload_keeps_the_gradients_and_orders_every_copy_without_a_host_wait(window_blocks):
    torch.manual_seed(0)
    model, x, y = model_and_batch()
    plain = gradients(model, x, y)
    sizes = slot_sizes(model, x, y)
    window = window_blocks * max(sizes)
    log: list = []
    hooks = offload_activations(
        min_bytes=0, devices=("cpu",), window_bytes=window, make_streams=recording(log), record=True
    )
    for got, want in zip(gradients(model, x, y, hooks, micro_batches=2), plain, strict=True):
        torch.testing.assert_close(got, 2 * want)

    t = hooks.traffic  # the second micro-batch's
    assert t.copied_out == sum(sizes) and t.resident == 0
    assert t.copied_in + t.reused == t.copied_out and t.copied_in > 0
    assert t.most_waiting <= max(window, max(sizes))  # the window, or the newest tensor alone
    assert t.most_prefetched <= max(window, max(sizes))

    # the order, from the log of both micro-batches
    recorded_by = {}  # event id -> stream
    waited_by = {}  # event id -> streams that waited for it
    for stream, op, what in log:
        if op == "record":
            recorded_by[what] = stream
        elif op == "wait":
            waited_by.setdefault(what, []).append(stream)
    out_events = [e for e, s in recorded_by.items() if s == "out"]
    in_events = [e for e, s in recorded_by.items() if s == "in"]
    assert out_events and in_events
    assert all("in" in waited_by.get(e, []) or "compute" in waited_by.get(e, []) for e in out_events)
    assert all(waited_by.get(e) == ["compute"] for e in in_events)  # used only after its copy
    waited_for_its_copy_out = False
    for stream, op, what in log:  # each copy back waits for a copy out first (that slot's)
        if stream == "in" and op == "wait" and recorded_by[what] == "out":
            waited_for_its_copy_out = True
        elif stream == "in" and op == "record":
            assert waited_for_its_copy_out
            waited_for_its_copy_out = False
    joins = [entry for entry in log if entry[1] == "wait_stream" and entry[0] == "compute"]
    assert joins[-2:] == [("compute", "wait_stream", "out"), ("compute", "wait_stream", "in")]
    assert sum(1 for e in hooks.traffic.events if e == "joined") == 1  # the second backward's end

    # prefetch: with a window, most slots come in before backward asks for them
    events = hooks.traffic.events
    ins = [i for i, e in enumerate(events) if e.startswith("in ")]
    prefetched = [i for i in ins if events[i - 1] != "use " + events[i][3:]]  # not asked for just before
    if window_blocks:
        assert len(prefetched) >= len(ins) // 2
    else:
        assert not prefetched  # a window of 0 fetches only on demand
    # host buffers are reused from one micro-batch to the next: one per slot
    assert len(hooks.buffers) == len(sizes)


def test_tensors_still_waiting_and_the_resident_tail_skip_the_round_trip():
    torch.manual_seed(0)
    model, x, y = model_and_batch()
    plain = gradients(model, x, y)
    sizes = slot_sizes(model, x, y)

    log: list = []
    everything = offload_activations(
        min_bytes=0, devices=("cpu",), window_bytes=sum(sizes), make_streams=recording(log)
    )
    for got, want in zip(gradients(model, x, y, everything), plain, strict=True):
        torch.testing.assert_close(got, want)
    assert everything.traffic.copied_in == 0 and everything.traffic.reused == sum(sizes)
    # nothing was fetched, so the copy-in stream did no work: only the copy-out stream rejoins (a CUDA
    # graph capture fails on a wait for a stream that did no work in it: rung 11's shorter last group)
    joins = [entry for entry in log if entry[1] == "wait_stream" and entry[0] == "compute"]
    assert joins == [("compute", "wait_stream", "out")]
    assert not any(entry[0] == "in" for entry in log)

    tail = sum(sizes[-3:])  # the last three saved tensors: the first backward needs
    hooks = offload_activations(
        min_bytes=0, devices=("cpu",), window_bytes=0, resident_bytes=tail, record=True
    )
    for got, want in zip(gradients(model, x, y, hooks, micro_batches=2), plain, strict=True):
        torch.testing.assert_close(got, 2 * want)
    t = hooks.traffic
    assert t.resident == tail and t.copied_out == sum(sizes) - tail  # the first micro-batch offloaded all
    copied = {int(e.split()[1]) for e in t.events if e.startswith("out ")}
    assert copied == set(range(len(sizes) - 3))


def test_in_the_compute_streams_order_nothing_waits_and_no_side_stream_is_made():
    """window_bytes=None (rungs 14 and 16): every copy on the compute stream, each saved tensor copied
    out once and back once, the gradients the plain run's, the resident tail still kept."""
    torch.manual_seed(0)
    model, x, y = model_and_batch()
    plain = gradients(model, x, y)
    sizes = slot_sizes(model, x, y)
    log: list = []
    hooks = offload_activations(min_bytes=0, devices=("cpu",), make_streams=recording(log), record=True)
    for got, want in zip(gradients(model, x, y, hooks, micro_batches=2), plain, strict=True):
        torch.testing.assert_close(got, 2 * want)
    t = hooks.traffic
    assert t.copied_out == t.copied_in == sum(sizes) and t.reused == 0 and t.most_waiting == 0
    assert log == [] and not hooks._streams  # no side stream made, no event recorded or waited for
    assert [e for e in t.events if e.startswith("in ")] == []  # nothing prefetched
    assert len(hooks.buffers) == len(sizes)

    tail = sum(sizes[-3:])
    kept = offload_activations(min_bytes=0, devices=("cpu",), resident_bytes=tail)
    for got, want in zip(gradients(model, x, y, kept, micro_batches=2), plain, strict=True):
        torch.testing.assert_close(got, 2 * want)
    assert kept.traffic.resident == tail and kept.traffic.copied_in == sum(sizes) - tail


# ------------------------------------------------------------------------------- batched copies
def ordered_log(hooks, log: list) -> None:
    """Log, beside the streams' operations, which slots each batch copies out or in and when backward
    uses a slot (after its unpack returned)."""
    copy_out, copy_in, unpack = hooks._copy_out, hooks._copy_in, hooks.unpack_hook

    def logged_out(device):
        log.append(("copy_out", "slots", [slot for slot, _t, _host in hooks._pending]))
        copy_out(device)

    def logged_in(slots, *args):
        log.append(("copy_in", "slots", list(slots)))
        copy_in(slots, *args)

    def logged_unpack(packed):
        tensor = unpack(packed)
        if not isinstance(packed, torch.Tensor):
            log.append(("use", "slot", packed))
        return tensor

    hooks._copy_out, hooks._copy_in, hooks.unpack_hook = logged_out, logged_in, logged_unpack


def check_order(log: list) -> int:
    """Replay the log: a side stream waits for the compute stream before its batch's copies, a copy back
    waits for the copies out of every slot it brings in, and the compute stream waits for the copy that
    holds a slot (in, or still out) before backward uses it. Returns the number of batches copied out."""
    out_event, in_event = {}, {}
    batch, forked, waited_by_in, waited_by_compute, batches_out = None, False, set(), set(), 0
    for who, op, what in log:
        if who in ("copy_out", "copy_in"):
            batch, forked, waited_by_in = (who[5:], what), False, set()  # ("out"|"in", its slots)
        elif op == "wait_stream" and batch and who == batch[0]:
            forked = True
        elif op == "wait" and who == "in":
            waited_by_in.add(what)
        elif op == "wait" and who == "compute":
            waited_by_compute.add(what)
        elif op == "record" and batch and who == batch[0]:
            assert forked, "a side stream copied before waiting for the compute stream"
            if who == "out":
                batches_out += 1
                for slot in batch[1]:
                    out_event[slot] = what
                    in_event.pop(slot, None)  # a new micro-batch's tensor in this slot
            else:
                assert all(out_event[slot] in waited_by_in for slot in batch[1])
                in_event.update(dict.fromkeys(batch[1], what))
            batch = None
        elif who == "use":
            assert in_event.pop(what, out_event[what]) in waited_by_compute, f"slot {what} used too early"
    return batches_out


@pytest.mark.parametrize("window_blocks", [2, 8])
def test_batched_copies_keep_the_gradients_and_the_order_with_fewer_events(window_blocks):
    torch.manual_seed(0)
    model, x, y = model_and_batch()
    plain = gradients(model, x, y)
    sizes = slot_sizes(model, x, y)
    window = window_blocks * max(sizes)
    batches = {}
    for batched in (False, True):
        log: list = []
        hooks = offload_activations(min_bytes=0, devices=("cpu",), window_bytes=window,
                                    make_streams=recording(log), batched=batched)  # fmt: skip
        ordered_log(hooks, log)
        for got, want in zip(gradients(model, x, y, hooks, micro_batches=2), plain, strict=True):
            torch.testing.assert_close(got, 2 * want)
        batches[batched] = check_order(log)
        t = hooks.traffic
        assert t.copied_out == sum(sizes) and t.copied_in + t.reused == t.copied_out
        assert t.most_waiting <= window + max(sizes) and t.most_prefetched <= window
    assert batches[False] == 2 * len(sizes)  # one batch per tensor, both micro-batches
    assert batches[True] < batches[False] / 2


def test_rung_11_batches_its_copies_in_eager_mode_only(monkeypatch, tmp_path):
    """The recipe's window and batching reach offload_activations: batched in eager mode, one copy at a time
    under CUDA graphs (fast mode's replays make no host calls), and a window of 0 is the compute stream's
    order."""
    rung = load_recipe_module("11_activation_offload")
    calls = []

    class Stop(Exception):
        pass

    def recording(*args, **kwargs):
        calls.append((args, kwargs))
        raise Stop  # before the training loop, which needs CUDA for graphs

    monkeypatch.setattr(offload, "offload_activations", recording)
    monkeypatch.setattr(planning, "instrument", lambda *args, **kwargs: None)  # the estimate: not needed here
    for graphs, window in ((False, 64), (True, 64), (False, 0)):
        cfg = rung.RUNG.with_flags(accelerator="cpu", model="vit_tiny", data="synthetic", weights="none",
                                   mode="eager", compile=False, cuda_graphs=graphs, offload_window_mb=window,
                                   results_dir=str(tmp_path))  # fmt: skip
        with pytest.raises(Stop):
            rung.main(cfg, RunResults(cfg))
    assert calls == [((64 << 20, 0), {"batched": True}), ((64 << 20, 0), {"batched": False}),
                     ((None, 0), {"batched": True})]  # fmt: skip
