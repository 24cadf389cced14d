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
Where the storage has no atomic rename (object stores), ``_marker`` commits
instead: files go under the final name and a marker written last is the commit.
The protocol's steps live in ``_atomicity`` (chosen once per root); this module
holds the root's lock and recovery at open, which asks the protocol whether each
final-named entry passed its commit point.
Sources: the ALICE study (OSDI'14) of what crash-consistent update protocols need,
and verl-project/verl #4667 (tracker moved before the save finished).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from ._atomicity import discard, move_aside, strategy_for
from ._catalog import (
    check_not_one_checkpoint,
    read_checkpoint,
    scan_steps,
    step_of_name,
    stored_info,
)
from ._decode import verify_data
from ._errors import (
    CheckpointError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    LockUnavailableError,
    RootInUseError,
    UnsupportedFormatError,
)
from ._fs import LocalFileSystem
from ._fsspec import open_root
from ._manifest import Manifest
from ._paths import (
    COMMIT_MARKER_NAME,
    LOCK_NAME,
    MANIFEST_NAME,
    Layout,
    is_temp_name,
)
from ._track import read_tracker, write_tracker
from ._types import CheckpointInfo

__all__ = [
    "Recovered",
    "adopt",
    "adopt_checkpoint",
    "hold_root",
    "lock_root",
    "recover",
]

logger = logging.getLogger(__name__)


def lock_root(fs: LocalFileSystem, root: Path, lock: str = "flock") -> int | None:
    """Create ``root`` (and parents, durably) and take its saver lock.

    :param lock: ``"flock"`` (the saver lock), or ``"none"``: the root is created
        and checked, no lock is taken (see ``CheckpointOptions.lock``).
    :returns: the lock's descriptor (release with ``fs.unlock``); ``None`` with
        ``lock="none"``.
    :raises RootInUseError: another checkpointer holds the root (named, as its
        holder recorded itself: ``fs.lock_holder``).
    :raises LockUnavailableError: the file system refused the lock (no ``flock``);
        a lock file this call created is removed.
    :raises CheckpointNotFoundError: ``root`` is itself one checkpoint.
    """
    if fs.exists(root) and not fs.is_dir(root):
        raise CheckpointError(f"checkpoint root {root} is not a directory", path=root)
    check_not_one_checkpoint(fs, root)
    try:
        if not fs.exists(root):
            fs.makedirs(root)
            fs.fsync_dir(root.parent)
        if lock == "none":
            return None
        fd = fs.lock(root / LOCK_NAME)
    except LockUnavailableError:
        raise
    except OSError as exc:
        raise CheckpointError(f"cannot use {root} as a checkpoint root: {exc}", path=root) from exc
    if fd is None:
        raise RootInUseError(
            f"{root} is in use by another Checkpointer ({_holder(fs, root)} holds "
            f"{LOCK_NAME}); one saver per root. To read while it saves, use "
            "asyncsave.latest() and asyncsave.load()",
            path=root,
        )
    return fd


def _holder(fs: LocalFileSystem, root: Path) -> str:
    """Who holds ``root``'s saver lock, for a message."""
    return fs.lock_holder(root / LOCK_NAME) or "a process that did not record itself"


@contextlib.contextmanager
def hold_root(
    fs: LocalFileSystem, root: Path, *, timeout_s: float, lock: str = "flock"
) -> Iterator[None]:
    """Hold the root's saver lock (:func:`lock_root`) for one commit made outside a
    :class:`~asyncsave.Checkpointer` (the standalone DCP writer's ``finish``).

    A checkpointer holds this lock for its whole life; a standalone writer holds it
    only around its rename and tracker update, so that "does the final name exist,
    rename, read the tracker, write it if forward" is one step for every thread and
    process committing into ``root`` (two writers that read the tracker before
    either wrote it moved it back: https://github.com/thinking-machines-lab/tinker-cookbook/pull/687). Waits for the lock, polling (a ``flock`` has no
    timed wait), at most ``timeout_s`` seconds. With ``lock="none"`` nothing is
    held (see ``CheckpointOptions.lock``).

    :raises RootInUseError: the lock stayed held for ``timeout_s`` (a checkpointer
        has the root open, or another writer's commit is stuck); names the holder.
    :raises LockUnavailableError: the file system refused the lock (no ``flock``).
    :raises CheckpointError: ``root`` cannot be created or locked.
    """
    deadline = time.monotonic() + timeout_s
    delay_s = 0.001
    while True:
        try:
            fd = lock_root(fs, root, lock=lock)
            break
        except RootInUseError as exc:
            left_s = deadline - time.monotonic()
            if left_s <= 0:
                raise RootInUseError(
                    f"{root} stayed locked ({LOCK_NAME}, held by {_holder(fs, root)}) for "
                    f"{timeout_s} s: a Checkpointer has it open (one saver per root), or "
                    "another commit into it is stuck",
                    path=root,
                ) from exc
            time.sleep(min(delay_s, left_s))
            delay_s = min(2 * delay_s, 0.05)
    try:
        yield
    finally:
        if fd is not None:
            fs.unlock(fd)


def _remove_unless_held(fs: LocalFileSystem, path: Path) -> bool:
    """Remove a temporary entry unless a live writer holds its lock
    (``_atomicity.make_held_temp_dir``: a standalone DCP writer that does not hold the
    root's lock while it writes); that one is logged and left to its writer.

    :returns: whether it was removed.
    """
    fd: int | None = None
    if fs.is_dir(path) and not fs.is_link(path):
        try:
            fd = fs.lock_dir(path)
        except FileNotFoundError:
            return False  # gone meanwhile (its writer committed or removed it)
        except OSError as exc:
            logger.debug("could not lock %s before removing it: %r", path, exc)
        else:
            if fd is None:
                logger.info("leaving %s: a live writer is using it", path)
                return False
    try:
        return discard(fs, path, "retried at the next open")
    finally:
        if fd is not None:
            fs.unlock(fd)


def adopt_checkpoint(fs: LocalFileSystem, path: Path, step: int) -> Manifest:
    """Adopt the final-named ``path`` as the committed checkpoint of ``step``: its
    manifest, the size of each file and every checksum are verified (every byte is
    read once), then its commit marker is written where the root's protocol has one
    (object stores, ``_marker``; under the rename protocol a directory under its
    final name is committed already, and nothing is written).

    :returns: its manifest.
    :raises CheckpointNotFoundError: it has no manifest.
    :raises CorruptCheckpointError: (or :class:`ChecksumMismatchError`) a file is
        missing, of the wrong size or altered, or the manifest is of another step.
    :raises UnsupportedFormatError: written by a newer asyncsave.
    :raises OSError: reading or writing the marker failed.
    """
    manifest = read_checkpoint(fs, path, expect_step=step, uncommitted=True)
    verify_data(fs, path, manifest)
    strategy_for(fs).mark_adopted(fs, path)
    return manifest


def adopt(
    path: str | os.PathLike[str],
    *,
    filesystem: LocalFileSystem | None = None,
    storage_options: Mapping[str, Any] | None = None,
) -> CheckpointInfo:
    """Commit a checkpoint that was copied under its final name without its commit
    marker (``asyncsave adopt PATH`` on the command line).

    Sync tools (``aws s3 sync``, ``gsutil rsync``, ``rclone``) copy a local run's
    ``step_N/`` into an object store file by file, without the
    ``commit_success.txt`` that commits a checkpoint there; readers then do not
    count it (:class:`~asyncsave.UncommittedCheckpointError`). This verifies it
    completely, as :func:`asyncsave.verify` does (manifest, sizes, every checksum:
    every byte is read once), then writes its marker. On a local directory (the
    rename protocol) being under its final name is the commit already: it is
    verified, and nothing is written. Nothing is deleted or moved either way. The
    tracker is not moved: the next :class:`~asyncsave.Checkpointer` open on the root
    moves it forward to the newest committed step. Adopt only once the copy is
    complete and no save writes there (one saver per root). Sources:
    allenai/open-instruct #1299, google/orbax #394.

    :param path: the checkpoint directory (``s3://bucket/run/step_2``), named as a
        layout preset names it (``step_N``, ``global_step_N``, ``iter_NNNNNNN``).
    :param filesystem: the I/O layer (default: chosen from ``path``).
    :param storage_options: as for :func:`asyncsave.load`.
    :returns: its :class:`~asyncsave.CheckpointInfo`.
    :raises CheckpointError: ``path`` is not named like a checkpoint.
    :raises CheckpointNotFoundError: no manifest there (a partial copy: copy the
        rest, or let a ``Checkpointer`` open move it aside).
    :raises CorruptCheckpointError: (or :class:`~asyncsave.ChecksumMismatchError`)
        a file is missing, of the wrong size or altered: nothing is written.
    """
    fs, p = open_root(path, filesystem=filesystem, storage_options=storage_options, what="path")
    step = step_of_name(p)
    if step is None:
        raise CheckpointError(
            f"{p} is not named like a checkpoint (step_N, global_step_N, iter_NNNNNNN): "
            f"give the checkpoint's directory; `asyncsave ls {p}` lists those of a root",
            path=p,
        )
    was = strategy_for(fs).passed_commit(fs, p)
    manifest = adopt_checkpoint(fs, p, step)
    logger.info("%s: step %d verified%s", p, step, "" if was else "; commit marker written")
    return stored_info(fs, p, manifest)


def _adopt_or_move_aside(fs: LocalFileSystem, root: Path, path: Path, step: int) -> Path | None:
    """At open: a final-named ``path`` without its commit marker (object stores).
    Adopted when it verifies completely (:func:`adopt_checkpoint`), else moved aside
    (``.asyncsave-incomplete-<step>-*``, bytes kept); never deleted: asyncsave
    cannot tell its own save that stopped before the marker from a checkpoint a
    sync tool copied there. Left in place (logged, tried again at the next open)
    when it is of a newer format or cannot be read or moved now.

    :returns: ``path`` when adopted, the aside path when moved, else ``None``.
    """
    try:
        adopt_checkpoint(fs, path, step)
    except UnsupportedFormatError as exc:
        logger.warning("leaving %s uncommitted where it is: %s", path, exc)
        return None
    except (CheckpointNotFoundError, CorruptCheckpointError) as exc:
        reason = f"it has no {COMMIT_MARKER_NAME} and is not a whole checkpoint ({exc})"
        return move_aside(fs, root, path, "incomplete", step, reason)
    except OSError as exc:
        logger.warning("could not check %s (retried at the next open): %r", path, exc)
        return None
    logger.warning(
        "adopted %s as the committed checkpoint of step %d: it had no %s (copied by a "
        "sync tool, or a save that stopped just before its marker); every byte verified, "
        "marker written",
        path,
        step,
        COMMIT_MARKER_NAME,
    )
    return path


@dataclasses.dataclass(frozen=True)
class Recovered:
    """What :func:`recover` found and did at open."""

    committed: dict[int, Path]  # verified committed checkpoints by step
    tracked: int | None  # the step the tracker names after recovery
    removed: list[Path]  # temporary directories removed; entries moved aside
    damaged: list[Path]  # damaged checkpoints, moved aside (kept for inspection)


def recover(fs: LocalFileSystem, root: Path, layout: Layout, *, forward: bool = True) -> Recovered:
    """Bring ``root`` to a clean state when a checkpointer opens.

    Removes temporary files and directories of saves that never committed (its own
    temporary names only), except a directory a live writer holds locked
    (``_atomicity.make_held_temp_dir``: the standalone DCP writer, which writes without the
    root's lock), which is logged and left to it. Nothing under a final name is
    deleted: on object stores a final-named prefix without its commit marker (a
    save that stopped before it, or a checkpoint copied by a sync tool) is adopted
    if it verifies completely (:func:`adopt_checkpoint`), else moved aside; moves
    directories under a final name that hold no manifest (a partial directory from
    a non-atomic writer: NeMo-Automodel #3254, or another tool's files) and damaged
    checkpoints (a manifest that fails to parse, a file of the wrong size) aside
    under names no resolver matches, so their bytes are kept and their step can be
    saved again;
    moves the tracker forward to the newest committed checkpoint if a crash came
    between commit and tracker update (``forward``; node-local roots of several
    ranks move it after the ranks agree on their steps, ``asyncsave._tiers``).
    The caller holds the root's lock (:func:`lock_root`).

    Symlinks are never followed to delete (https://github.com/facebookresearch/PyTorch-BigGraph/pull/24): a symlink under a temporary name is
    unlinked; a symlink under a final name that points to a checkpoint is one (it
    loads through the link); a file, a dangling symlink or a symlink to a file under
    a final name is moved aside like a directory without a manifest. Each entry is
    handled on its own: one that cannot be removed or moved is logged and retried at
    the next open, and never stops the others.

    :raises CheckpointError: the root cannot be listed, or the tracker cannot be
        moved forward (the I/O error is ``__cause__``).
    :raises CorruptCheckpointError: the tracker is a directory.
    """
    try:
        return _recover(fs, root, layout, forward)
    except OSError as exc:
        raise CheckpointError(f"cannot recover checkpoint root {root}: {exc!r}", path=root) from exc


def _recover(fs: LocalFileSystem, root: Path, layout: Layout, forward: bool) -> Recovered:
    fs.makedirs(root)
    names = fs.listdir(root)
    removed = _remove_temps(fs, root, names)
    steps = scan_steps(fs, root, layout)
    removed += _move_non_directories(fs, root, layout, names, steps)
    committed, damaged = _check_steps(fs, root, steps, removed)
    if removed or damaged:
        fs.fsync_dir(root)
    tracked = _track_forward(fs, root, layout, committed, forward)
    return Recovered(committed=committed, tracked=tracked, removed=removed, damaged=damaged)


def _remove_temps(fs: LocalFileSystem, root: Path, names: list[str]) -> list[Path]:
    """Remove what is under a temporary name (unless a live writer holds it);
    the paths removed."""
    removed: list[Path] = []
    for name in names:
        # Files, directories and symlinks alike: a symlink is unlinked, never
        # followed. One that cannot be removed is logged and left for the next open.
        if is_temp_name(name) and _remove_unless_held(fs, root / name):
            removed.append(root / name)
    return removed


def _move_non_directories(
    fs: LocalFileSystem, root: Path, layout: Layout, names: list[str], steps: dict[int, Path]
) -> list[Path]:
    """Move aside what is under a final name and not a step directory; the paths moved."""
    removed: list[Path] = []
    for name in names:
        step = layout.parse_dir_name(name)
        if step is not None and step not in steps and fs.lexists(root / name):
            # A file, a dangling symlink or a symlink to a file under a final name:
            # never a checkpoint, and it would make a save of its step fail. Moved
            # aside (the link itself, never its target), like a partial step directory.
            if move_aside(fs, root, root / name, "incomplete", step, "it is not a directory"):
                removed.append(root / name)
    return removed


def _check_steps(
    fs: LocalFileSystem, root: Path, steps: dict[int, Path], removed: list[Path]
) -> tuple[dict[int, Path], list[Path]]:
    """The committed steps among ``steps`` (by step), and where the damaged ones
    were moved; what is not a checkpoint is moved aside and added to ``removed``."""
    committed: dict[int, Path] = {}
    damaged: list[Path] = []
    strategy = strategy_for(fs)
    for step, path in steps.items():
        if not strategy.passed_commit(fs, path):
            # Object stores: a save that stopped before its marker, or a copy made
            # by a sync tool: the two look alike, and neither is deleted.
            kept = _adopt_or_move_aside(fs, root, path, step)
            if kept == path:
                committed[step] = path
            elif kept is not None:
                removed.append(path)
            continue
        if not fs.exists(path / MANIFEST_NAME):
            # Never a checkpoint (a partial step directory); maybe another tool's files: moved, not deleted.
            if move_aside(fs, root, path, "incomplete", step, "it has no manifest"):
                removed.append(path)
            continue
        try:
            read_checkpoint(fs, path, expect_step=step)
        except CorruptCheckpointError as exc:
            aside = move_aside(fs, root, path, "damaged", step, str(exc))
            if aside is not None:
                damaged.append(aside)
            continue
        committed[step] = path
    return committed, damaged


def _track_forward(
    fs: LocalFileSystem, root: Path, layout: Layout, committed: dict[int, Path], forward: bool
) -> int | None:
    """The step the tracker names, moved forward to the newest of ``committed``
    first if it names an older one or none (``forward``)."""
    if layout.tracker_name is None:
        return None
    tracked: int | None = None
    tracker = root / layout.tracker_name
    if fs.is_dir(tracker):
        raise CorruptCheckpointError(
            f"tracker {tracker} is a directory; move it away to save here", path=tracker
        )
    try:
        tracked = read_tracker(fs, tracker)
    except CorruptCheckpointError as exc:
        logger.warning("%s; it will be rewritten at the next commit", exc)
    newest = max(committed, default=None)
    if forward and newest is not None and (tracked is None or tracked < newest):
        logger.warning(
            "%s but step %d is committed; moving it forward",
            "there is no tracker" if tracked is None else f"the tracker names step {tracked}",
            newest,
        )
        write_tracker(fs, tracker, newest)
        tracked = newest
    return tracked
