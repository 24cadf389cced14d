"""Track: the tracker file that names the latest committed step.

The tracker holds the step as a bare decimal with no newline, the format Megatron
and verl write and read (``int(f.read().strip())``). It is replaced atomically
(temp file, fsync, ``rename(2)``, fsync of the directory) and only after the
checkpoint it names is committed; it never moves backwards. A
:class:`~asyncsave.Checkpointer` holds the root's saver lock for its whole life and
keeps the step it last wrote (:class:`TrackerWriter`); a writer that commits from
outside one (the standalone DCP writer) takes the same lock around its commit and
calls :func:`advance_tracker`, which reads the step on disk first. Both apply one
rule: write only a step above the highest one known.
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path

from ._atomicity import strategy_for
from ._errors import CorruptCheckpointError
from ._fs import LocalFileSystem

logger = logging.getLogger(__name__)

__all__ = [
    "MAX_TRACKER_BYTES",
    "TrackerWriter",
    "advance_tracker",
    "parse_tracker",
    "read_tracker",
    "write_tracker",
]

MAX_TRACKER_BYTES = 64
_MAX_STEP = 2**63 - 1


def parse_tracker(raw: bytes, path: Path) -> int:
    """The step in a tracker's bytes.

    Accepts what Megatron and verl accept: a decimal with surrounding whitespace.
    :raises CorruptCheckpointError: for anything else (garbage, a sign, a float,
        a step of 2**63 or more, more than 64 bytes).
    """
    if len(raw) > MAX_TRACKER_BYTES:
        raise CorruptCheckpointError(
            f"tracker {path} holds {len(raw)} bytes, not a step number", path=path
        )
    text = raw.decode("ascii", errors="replace").strip()
    if not text.isascii() or not text.isdigit():
        raise CorruptCheckpointError(
            f"tracker {path} holds {text[:32]!r}, not a non-negative decimal step",
            path=path,
        )
    step = int(text)
    if step > _MAX_STEP:
        raise CorruptCheckpointError(f"tracker {path} holds a huge step {text}", path=path)
    return step


def read_tracker(fs: LocalFileSystem, path: Path) -> int | None:
    """The step the tracker at ``path`` names; ``None`` if there is no tracker.

    :raises CorruptCheckpointError: if the tracker exists but is not a step.
    """
    try:
        raw = fs.read_bytes(path)
    except FileNotFoundError:
        return None
    except IsADirectoryError as exc:
        raise CorruptCheckpointError(f"tracker {path} is a directory", path=path) from exc
    return parse_tracker(raw, path)


def write_tracker(fs: LocalFileSystem, path: Path, step: int) -> None:
    """Atomically make the tracker at ``path`` name ``step``; durable on return.

    How is the root's commit protocol's (``CommitStrategy.replace_file``): a temp
    file, fsync, ``rename(2)``, fsync of the directory; on object stores one PUT,
    which replaces an object atomically there.
    """
    strategy_for(fs).replace_file(fs, path, str(step).encode("ascii"))


class TrackerWriter:
    """Moves one tracker forward only, from any number of worker threads.

    Writes are serialised by a thread lock and each re-checks the highest step
    written just before it replaces the file, so a write thread abandoned after a
    timeout that finishes late can never move the tracker backwards.

    :param highest: the step the tracker already names durably (or the newest
        committed step), or ``None``.
    """

    def __init__(self, fs: LocalFileSystem, path: Path, highest: int | None) -> None:
        self._fs = fs
        self._path = path
        self._lock = threading.Lock()
        self.highest = highest

    def advance(self, step: int) -> bool:
        """Make the tracker name ``step`` if that is forward; durable on return.

        :returns: whether the tracker was written.
        """
        with self._lock:
            if self.highest is not None and step <= self.highest:
                return False
            write_tracker(self._fs, self._path, step)
            self.highest = step
            return True


def advance_tracker(fs: LocalFileSystem, path: Path, step: int) -> bool:
    """Make the tracker at ``path`` name ``step`` if that is forward of the step it
    names now; durable on return.

    Read, compare and write are one step only if the caller holds the root's saver
    lock (``_commit.hold_root``): then writers finishing in any order, in any
    threads or processes, leave the tracker at the highest step (https://github.com/thinking-machines-lab/tinker-cookbook/pull/687). A tracker
    that is not a step is rewritten, with a warning.

    :returns: whether the tracker was written.
    :raises OSError: from reading or writing the tracker.
    """
    try:
        highest = read_tracker(fs, path)
    except CorruptCheckpointError as exc:
        logger.warning("%s; rewriting it", exc)
        highest = None
    return TrackerWriter(fs, path, highest).advance(step)
