"""Where runs write, and the names a user gives them: checked before anything runs.

* **Runs go to ``runs/``.** A recipe's ``--results-dir``, ``./run_all.sh``'s folders, every tool's
  ``--out`` and the checkpoints default to folders under ``runs/`` (ignored by git), so a run never
  changes a tracked file.
* **Committed evidence is not overwritten by accident.** Nothing is written inside a folder
  ``results/published/`` (the GPU evidence the docs quote), wherever that folder is, unless the
  environment says ``FMR_PUBLISH=1``: each command refuses such an output at its start, in one line with
  exit code 2, and :func:`fabric_memory_recipes.measurement.results_file.write_atomic` refuses it again
  at the write.
* **A name is a name.** What becomes part of a file name (``--tag``, the estimator's ``--recipe``) is a
  plain name: letters, digits, ``.``, ``_`` and ``-``, not ``.`` or ``..``, at most 100 characters; a
  path separator would write outside the folder, or into one that does not exist, and a longer name
  would not fit the file names made from it (``.<recipe>-<tag>.lock``, ``<recipe>-<tag>.interrupted.json``).
* **A path fits the file system.** An output folder is UTF-8 text (a name with undecodable bytes cannot
  be printed in a message or a report), none of its folder names is over 255 bytes (``NAME_MAX``) and
  the whole is at most 3,840 bytes, which leaves room under the 4,096 of ``PATH_MAX`` for the files
  written in it; checked before anything is created.

Standard library only: the report, the tools and the estimator use it without torch.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from fabric_memory_recipes.config import UsageError

RUNS = "runs"  # a user's runs, below the working directory (the repository's /runs/ is ignored by git)
PUBLISHED = ("results", "published")  # committed evidence: written only with FMR_PUBLISH=1
PUBLISH_ENV = "FMR_PUBLISH"
NAME_CHARACTERS = "letters, digits, '.', '_' and '-'"
NAME_LENGTH = 100  # characters of a plain name: the file names made from it add a recipe and a suffix
NAME_MAX = 255  # bytes of one folder or file name (ext4, xfs, btrfs, tmpfs)
PATH_MAX = 4096  # bytes of a whole path (Linux)
FOLDER_MAX = PATH_MAX - NAME_MAX - 1  # an output folder leaves room for a file name inside it


def name_problem(text: str) -> str | None:
    """Why ``text`` is not a plain name (one file-name component), or None."""
    if text in ("", ".", ".."):
        return f"{text!r} is not a name"
    if len(text) > NAME_LENGTH:
        return f"a plain name is at most {NAME_LENGTH} characters (this one has {len(text)})"
    bad = sorted({c for c in text if not (c.isascii() and (c.isalnum() or c in "._-"))})
    if bad:
        return f"a plain name holds only {NAME_CHARACTERS} (this one has {' '.join(map(repr, bad))})"
    return None


def plain_name(text: str, flag: str) -> str:
    """``text`` if it is a plain name, else :class:`UsageError` naming ``flag``."""
    reason = name_problem(text)
    if reason is not None:
        raise UsageError(f"{flag} {text!r}: {reason}")
    return text


def name_type(flag: str):
    """An argparse ``type`` for a plain name (:func:`name_problem`): a bad one is the parser's one line."""

    def parse(text: str) -> str:
        reason = name_problem(text)
        if reason is not None:
            raise argparse.ArgumentTypeError(f"{text!r}: {reason}")
        return text

    return parse


def published(path: str | os.PathLike) -> bool:
    """Whether ``path`` lies inside a folder ``results/published`` (symbolic links followed)."""
    parts = Path(os.path.abspath(path)).resolve().parts
    return any(parts[i : i + 2] == PUBLISHED for i in range(len(parts) - 1))


def publishing() -> bool:
    """Whether this process may write committed evidence (``FMR_PUBLISH=1``)."""
    return os.environ.get(PUBLISH_ENV, "") == "1"


def check_not_published(path: str | os.PathLike, what: str) -> None:
    """:class:`UsageError` when ``path`` is inside ``results/published/`` and publishing is off."""
    if published(path) and not publishing():
        raise UsageError(
            f"{what} {path}: inside results/published/, the committed evidence; write to {RUNS}/ instead,"
            f" or set {PUBLISH_ENV}=1 to publish there on purpose"
        )


def refusal(path: str | os.PathLike, what: str) -> str | None:
    """:func:`check_not_published`'s message, or None: for commands that print their own refusals."""
    try:
        check_not_published(path, what)
    except UsageError as e:
        return str(e)
    return None


def shared_mode() -> int:
    """The mode an ordinary new file gets (0666 less the umask, e.g. 0644): for a file written through
    ``tempfile.mkstemp`` (0600) and renamed into place, which other users and jobs read like any output."""
    umask = os.umask(0)
    os.umask(umask)
    return 0o666 & ~umask


def shown(path: str | os.PathLike, limit: int = 120) -> str:
    """``path`` for a one-line message: printable (undecodable bytes as ``\\xNN``), and a long one cut
    in the middle."""
    text = os.fsencode(path).decode("utf-8", errors="backslashreplace")
    return (
        text
        if len(text) <= limit
        else f"{text[: limit // 2]}…{text[-(limit // 2) :]} ({len(text)} characters)"
    )


def path_problem(path: str | os.PathLike) -> str | None:
    """Why ``path`` cannot name an output folder on this system, from its text alone: not UTF-8, a
    folder name over ``NAME_MAX`` bytes, or the whole over ``FOLDER_MAX`` bytes; None if it can."""
    raw = os.fsencode(path)
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError:
        return "is not UTF-8 text (undecodable bytes in a folder name): choose a name in UTF-8"
    whole = os.fsencode(os.path.abspath(path))
    long = next((part for part in whole.split(b"/") if len(part) > NAME_MAX), None)
    if long is not None:
        start = long[:24].decode("utf-8", errors="ignore")
        return f"a folder name is {len(long)} bytes long ({start}…): at most {NAME_MAX} bytes each"
    if len(whole) > FOLDER_MAX:
        return (
            f"{len(whole)} bytes long: an output folder is at most {FOLDER_MAX}, to leave room for its files"
            f" under the {PATH_MAX} bytes of a path"
        )
    return None


def folder_problem(path: str | os.PathLike) -> str | None:
    """Why ``path`` cannot be an output folder without creating anything: a name the file system cannot
    hold (:func:`path_problem`), or it, or a parent, is a file."""
    reason = path_problem(path)
    if reason is not None:
        return reason
    here = Path(os.path.abspath(path))
    for folder in (here, *here.parents):
        try:
            if not folder.exists():
                continue
        except OSError as e:  # e.g. a parent that cannot be searched
            return f"cannot be looked up ({e.strerror or e})"
        if not folder.is_dir():
            return "is a file, not a folder" if folder == here else f"{shown(folder)} is a file, not a folder"
        return None
    return None


def check_output_folder(path: str | os.PathLike, what: str) -> None:
    """An output folder a command will write into: a path the file system can hold, not committed
    evidence, not a file."""
    reason = path_problem(path)
    if reason is None:
        check_not_published(path, what)
        reason = folder_problem(path)
    if reason is not None:
        raise UsageError(f"{what} {shown(path)}: {reason}")


def output_folder(flag: str):
    """An argparse ``type`` for a tool's output folder (``--out``): checked by :func:`check_output_folder`,
    so a bad one is the parser's one-line error."""

    def parse(text: str) -> Path:
        try:
            check_output_folder(text, flag)
        except UsageError as e:
            raise argparse.ArgumentTypeError(str(e).removeprefix(f"{flag} ")) from None
        return Path(text)

    return parse
