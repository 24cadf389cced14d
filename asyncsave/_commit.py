"""Commit: publish a fully written temporary directory under its final name.

The protocol, in order (each step durable before the next):

1. every data file written and fsynced (``_write``);
2. ``manifest.json`` written last and fsynced;
3. the temporary directory fsynced (its entries are durable);
4. ``rename(2)`` to the final name: **this is the commit point**;
5. the parent directory fsynced (the rename is durable);
6. the tracker replaced atomically (``_track``), never backwards.

A crash before 4 leaves only a temporary directory, which the next
:func:`recover` removes; a crash between 5 and 6 leaves a committed checkpoint the
tracker does not name yet, and :func:`recover` moves the tracker forward to it.
Sources: the ALICE study (OSDI'14) of what crash-consistent update protocols need,
and verl-project/verl #4667 (tracker moved before the save finished).
"""

from __future__ import annotations

import dataclasses
import errno
import logging
from pathlib import Path

from ._errors import CheckpointError, CorruptCheckpointError
from ._fs import LocalFileSystem
from ._load import read_checkpoint, scan_steps
from ._paths import MANIFEST_NAME, Layout, is_temp_name, temp_dir_name
from ._track import read_tracker, write_tracker

__all__ = ["Recovered", "commit_dir", "discard", "make_temp_dir", "recover"]

logger = logging.getLogger(__name__)


def make_temp_dir(fs: LocalFileSystem, root: Path, step: int) -> Path:
    """Create a fresh temporary directory for a save of ``step`` under ``root``."""
    path = root / temp_dir_name(step)
    fs.mkdir(path)
    return path


def commit_dir(fs: LocalFileSystem, tmp: Path, final: Path, *, overwrite: bool) -> None:
    """Steps 3 to 5 of the protocol: fsync ``tmp``, rename it to ``final``, fsync the
    parent.

    With ``overwrite``, an existing ``final`` is swapped out atomically
    (``renameat2(RENAME_EXCHANGE)``) so that a crash leaves either the old or the
    new checkpoint under the final name, never neither; the old one is then removed.
    :raises FileExistsError: ``final`` exists and ``overwrite`` is false.
    :raises CheckpointError: overwrite asked where the file system cannot exchange.
    """
    fs.fsync_dir(tmp)
    if overwrite and fs.exists(final):
        try:
            fs.exchange(tmp, final)
        except OSError as exc:
            if exc.errno in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP):
                raise CheckpointError(
                    f"cannot overwrite {final} atomically on this file system "
                    "(renameat2 RENAME_EXCHANGE unsupported)",
                    path=final,
                ) from exc
            raise
        fs.fsync_dir(final.parent)
        fs.remove_tree(tmp)  # now holds the old checkpoint
    else:
        fs.rename(tmp, final)
    fs.fsync_dir(final.parent)


def discard(fs: LocalFileSystem, tmp: Path) -> None:
    """Remove a failed save's temporary directory; a failure here is logged (the
    next :func:`recover` removes it), never raised over the save's own error."""
    try:
        if fs.exists(tmp):
            fs.remove_tree(tmp)
    except OSError:
        logger.warning("could not remove %s; the next open removes it", tmp, exc_info=True)


@dataclasses.dataclass(frozen=True)
class Recovered:
    """What :func:`recover` found and did at open."""

    committed: dict[int, Path]  # verified committed checkpoints by step
    tracked: int | None  # the step the tracker names after recovery
    removed: list[Path]  # temporary and manifest-less directories removed
    damaged: list[Path]  # final-named directories with a damaged manifest (kept)


def recover(fs: LocalFileSystem, root: Path, layout: Layout) -> Recovered:
    """Bring ``root`` to a clean state when a checkpointer opens.

    Removes temporary files and directories of saves that never committed, and
    directories under a final name that hold no manifest (a partial directory from
    a non-atomic writer: NeMo-Automodel #3254); keeps damaged checkpoints that do
    have a manifest (they are skipped, with a warning, not deleted); moves the
    tracker forward to the newest committed checkpoint if a crash came between
    commit and tracker update. Assumes no other process is saving into ``root``.
    """
    fs.makedirs(root)
    removed: list[Path] = []
    for name in fs.listdir(root):
        if is_temp_name(name):
            path = root / name
            if fs.is_dir(path):
                fs.remove_tree(path)
            else:
                fs.unlink(path)
            removed.append(path)
    committed: dict[int, Path] = {}
    damaged: list[Path] = []
    for step, path in scan_steps(fs, root, layout).items():
        if not fs.exists(path / MANIFEST_NAME):
            logger.warning("removing %s: it has no manifest, so it never committed", path)
            fs.remove_tree(path)
            removed.append(path)
            continue
        try:
            read_checkpoint(fs, path)
        except CorruptCheckpointError as exc:
            logger.warning("skipping damaged checkpoint %s: %s", path, exc)
            damaged.append(path)
            continue
        committed[step] = path
    if removed:
        fs.fsync_dir(root)

    tracked: int | None = None
    if layout.tracker_name is not None:
        tracker = root / layout.tracker_name
        try:
            tracked = read_tracker(fs, tracker)
        except CorruptCheckpointError as exc:
            logger.warning("%s; it will be rewritten at the next commit", exc)
        newest = max(committed, default=None)
        if newest is not None and (tracked is None or tracked < newest):
            logger.warning(
                "tracker names step %s but step %d is committed; moving it forward",
                tracked,
                newest,
            )
            write_tracker(fs, tracker, newest)
            tracked = newest
    return Recovered(committed=committed, tracked=tracked, removed=removed, damaged=damaged)
