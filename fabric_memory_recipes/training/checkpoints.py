"""Checkpoint files: written atomically, pruned to the newest few, checked before they are trusted.

A checkpoint is ``<dir>/step-NNNNNN.ckpt``: one file (``torch.save``'s zip archive) or, for sharded
strategies (FSDP, FSDP2), a folder of shards with Fabric's ``meta.pt`` and the distributed checkpoint's
``.metadata``. What one holds is described in ``fabric_memory_recipes/training/loop.py:fit`` and docs/resume.md.

* **Atomic.** Fabric writes ``.step-NNNNNN.ckpt.partial`` first; once every process has written its
  part, rank 0 renames it. A process killed during a save leaves at most a ``.partial`` that nothing
  reads (the next save removes it): the newest ``step-*.ckpt`` is always a complete one.
* **Pruned.** After each save only the newest ``keep`` checkpoints stay (a ViT-L/16 checkpoint with
  Adam is GBs).
* **Checked.** :func:`problem` says why a path is not a usable checkpoint (missing, empty, truncated,
  another kind of file) without loading it: it reads the zip archive's directory, which a truncated
  file has lost. ``--resume auto`` takes the newest checkpoint that passes, saying which it skipped.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import zipfile

from fabric_memory_recipes.faults import BadInput

NAME = re.compile(r"^step-(\d+)\.ckpt$")
PARTIAL = re.compile(r"^\.step-\d+\.ckpt\.partial$")
SHARDED_METADATA = (".metadata", "meta.pt")  # torch.distributed.checkpoint's, and Fabric's own state


def file_name(step: int) -> str:
    return f"step-{step:06d}.ckpt"


def listing(directory: str) -> list[tuple[int, str]]:
    """(step, path) of every ``step-NNNNNN.ckpt`` in ``directory``, oldest first."""
    if not os.path.isdir(directory):
        return []
    found = [
        (int(m.group(1)), os.path.join(directory, n)) for n in os.listdir(directory) if (m := NAME.match(n))
    ]
    return sorted(found)


def _zip_problem(path: str) -> str | None:
    try:
        size = os.path.getsize(path)
        if size == 0:
            return "empty file"
        with zipfile.ZipFile(path) as archive:
            names = archive.namelist()
    except zipfile.BadZipFile:
        return (
            f"truncated, or not a checkpoint: not a complete zip archive as torch.save writes ({size} bytes)"
        )
    except OSError as e:
        return f"cannot be read ({e.strerror or e})"
    if not any(n.endswith("data.pkl") for n in names):
        return "a zip archive, but not one that torch.save wrote (no data.pkl)"
    return None


def contents(directory: str, most: int = 4) -> str:
    """What a folder of checkpoints holds, for a message: ``none``, ``no such folder``, or the names of
    its ``*.ckpt`` (the newest ``most``)."""
    if not os.path.isdir(directory):
        return "a file, not a folder" if os.path.exists(directory) else "no such folder"
    names = sorted(n for n in os.listdir(directory) if n.endswith(".ckpt") and not n.startswith("."))
    if not names:
        return "none"
    shown = ", ".join(names[-most:])
    return shown if len(names) <= most else f"{shown} (newest {most} of {len(names)})"


def problem(path: str) -> str | None:
    """Why ``path`` is not a usable checkpoint, or None when it looks complete. A path that does not
    exist is told with what its folder holds; a folder of checkpoints with its newest one."""
    if os.path.isdir(path):
        if not path.rstrip(os.sep).endswith(".ckpt") and (newest := latest(path)) is not None:
            return (
                f"a folder of checkpoints, not one (newest {os.path.basename(newest)}): pass a file, or"
                f" --resume auto --checkpoint-dir {path}"
            )
        missing = [n for n in SHARDED_METADATA if not os.path.isfile(os.path.join(path, n))]
        if missing:
            return f"an incomplete sharded checkpoint (no {', '.join(missing)})"
        return _zip_problem(os.path.join(path, "meta.pt"))
    if not os.path.exists(path):
        folder = os.path.dirname(path) or "."
        found = contents(folder)
        if found in ("no such folder", "a file, not a folder"):
            return f"no such file; {folder}: {found}"
        return f"no such file; {folder} holds " + ("no checkpoint (*.ckpt)" if found == "none" else found)
    return _zip_problem(path)


def latest(directory: str) -> str | None:
    """The newest ``step-NNNNNN.ckpt`` in ``directory``, whatever its state, or None."""
    found = listing(directory)
    return found[-1][1] if found else None


def latest_intact(directory: str, say=print) -> str | None:
    """The newest checkpoint in ``directory`` that :func:`problem` passes (what ``--resume auto``
    continues from); each newer one it skips is reported through ``say`` in one line."""
    for _, path in reversed(listing(directory)):
        reason = problem(path)
        if reason is None:
            return path
        say(f"[resume] skipping {path}: {reason}")
    return None


def _remove(path: str) -> None:
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(FileNotFoundError):
            os.remove(path)


def _fsync(path: str) -> None:
    """Flush a written file (or each file of a folder) to the disk before the rename publishes it."""
    paths = [os.path.join(path, n) for n in os.listdir(path)] if os.path.isdir(path) else [path]
    for p in paths:
        if os.path.isfile(p):
            fd = os.open(p, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)


def prune(directory: str, keep: int) -> list[str]:
    """Remove all but the newest ``keep`` checkpoints (``keep`` 0: remove none) and any ``.partial``
    left by a save that was killed. Returns what was removed."""
    removed = []
    if keep > 0:
        removed += [path for _, path in listing(directory)[:-keep]]
    if os.path.isdir(directory):
        removed += [os.path.join(directory, n) for n in os.listdir(directory) if PARTIAL.match(n)]
    for path in removed:
        _remove(path)
    return removed


def save(fabric, directory: str, step: int, state: dict, keep: int = 2) -> str:
    """``fabric.save`` to ``<directory>/step-NNNNNN.ckpt`` through a temporary name, then prune.

    Every process calls it (sharded strategies write one part per process); rank 0 publishes the
    checkpoint by renaming once all parts are written, then removes old ones. Returns the path.
    """
    final = os.path.join(directory, file_name(step))
    partial = os.path.join(directory, f".{file_name(step)}.partial")
    if fabric.is_global_zero:
        os.makedirs(directory, exist_ok=True)
        _remove(partial)  # left by a save that was killed
    fabric.barrier()
    fabric.save(partial, state)
    fabric.barrier()  # every process's part is written (Fabric writes a sharded folder's meta.pt last)
    if fabric.is_global_zero:
        _fsync(partial)
        if os.path.isdir(final):  # a folder cannot be renamed over another one
            _remove(final)
        os.replace(partial, final)
        prune(directory, keep)
    fabric.barrier()
    return final


def load(fabric, path: str, stateful: dict, total: int | None = None) -> dict:
    """``fabric.load`` (restores ``stateful`` in place, returns the rest), with a failure reported as
    one line naming the file (:class:`BadInput`), and one line saying where the run resumes."""
    reason = problem(path)
    if reason is not None:
        raise BadInput(f"--resume {path}: {reason}")
    try:
        saved = fabric.load(path, stateful)
    except Exception as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise BadInput(
            f"--resume {path}: cannot be loaded into this run ({type(e).__name__}: {first[:300]})"
        ) from None
    if fabric.is_global_zero:
        of = f" of {total}" if total else ""
        print(f"[resume] resuming at step {saved.get('step')}{of} from {path}", flush=True)
    return saved
