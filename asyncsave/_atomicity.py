"""The commit protocol of a root: how a save becomes a checkpoint there.

The only place that knows what the root's storage can do. Chosen once, from the
root's I/O layer (:func:`strategy_for`), and asked by every writer and reader
instead of the storage (Orbax's ``_src/path/atomicity_types.py`` /
``atomicity.py``: a temporary path class per kind of storage, chosen once from the
path). Two kinds:

- :class:`RenameCommit` (a POSIX directory): files go into a temporary directory
  no resolver recognises; the commit is fsync of it, an atomic ``rename(2)`` to
  the final name, fsync of the parent (:func:`commit_dir`). An overwrite
  exchanges the two directories atomically.
- :class:`MarkerCommit` (object stores through fsspec): every rank uploads its
  files under the final prefix; rank 0 writes the manifest, then the commit
  marker last (``_marker``; Orbax's ``CommitFileTemporaryPath``). A prefix
  without the marker is never a checkpoint. Nothing is renamed, so nothing is
  overwritten, and files cannot move between directories in one step.

The methods do the I/O of one step each (blocking: callers run them in worker
threads); the properties say, by what a caller wants to do, what the protocol
allows. The helpers below the classes (temporary directories, the rename commit,
moving aside, discarding) are the rename protocol's steps.
"""

from __future__ import annotations

import errno
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

from . import _marker
from ._errors import CheckpointError, LockUnavailableError
from ._fs import LocalFileSystem
from ._paths import COMMIT_MARKER_NAME, MANIFEST_NAME, aside_dir_name, temp_dir_name, temp_file_name
from ._write import write_bytes

__all__ = [
    "CommitStrategy",
    "FileSink",
    "MarkerCommit",
    "RenameCommit",
    "commit_dir",
    "discard",
    "make_held_temp_dir",
    "make_temp_dir",
    "move_aside",
    "move_aside_durably",
    "move_files",
    "strategy_for",
]

logger = logging.getLogger(__name__)


class CommitStrategy:
    """The contract (see the module docstring). Call sequence of one save:

    1. the leader calls :meth:`begin`;
    2. every rank checks the leader's directory with :meth:`same_save` and writes
       its files into it (durable);
    3. the leader calls :meth:`publish` (manifest, then the commit point), or
       writes the manifest itself and calls :meth:`commit`.

    Readers and survivors ask :meth:`committed` (a whole checkpoint) or
    :meth:`passed_commit` (the commit point only); recovery at open asks
    :meth:`passed_commit` of each final-named entry and adopts
    (:meth:`mark_adopted`) or moves aside what has not.
    """

    #: Whether the commit renames a temporary directory (what the protocol does;
    #: callers ask the behavioural properties below).
    renames: bool = True

    @property
    def can_overwrite(self) -> bool:
        """Whether a committed step can be replaced by a new save of it (the
        rename protocol exchanges the two directories atomically; under the
        marker protocol the new files would replace the committed ones before
        the new commit)."""
        return self.renames

    @property
    def can_move_files(self) -> bool:
        """Whether files and directories move between names of the root in one
        step (``rename(2)``): a streamed rank's own directory, DCP's and
        Megatron's writers, ``update()``'s swap, moving a damaged checkpoint
        aside at resume, retention's retire-then-delete. On object stores a
        move is a copy of every object and a delete."""
        return self.renames

    @property
    def writes_in_place(self) -> bool:
        """Whether a save's files go under the final name before its commit point,
        so that a final-named entry may be uncommitted (a save in flight, or a
        copy made by a sync tool) and :meth:`passed_commit` must be asked."""
        return not self.renames

    @property
    def needs_tracker(self) -> bool:
        """Whether a layout must have a tracker on this root: where saves write in
        place (:attr:`writes_in_place`) the highest directory may be a save in
        flight; only a tracker says what is latest."""
        return self.writes_in_place

    #: Files the protocol itself adds to a checkpoint (counted in its size).
    protocol_files: tuple[str, ...] = ()

    def begin(self, fs: LocalFileSystem, root: Path, step: int, final: Path) -> Path:
        """Make the directory a save of ``step`` writes into (blocking).

        :raises FileExistsError: (marker) objects already exist under ``final``.
        """
        raise NotImplementedError

    def same_save(self, name: str, step: int, final: Path) -> bool:
        """Whether ``name`` (the leader's directory, broadcast) is one of a save
        of ``step`` (pure): ranks that called ``save()`` with different steps
        must not write into one directory."""
        raise NotImplementedError

    def commit(self, fs: LocalFileSystem, tmp: Path, final: Path, *, overwrite: bool) -> None:
        """The commit point (blocking): after this returns, ``final`` is a
        checkpoint. Every file under ``tmp``, the manifest last, is durable."""
        raise NotImplementedError

    def publish(
        self, fs: LocalFileSystem, tmp: Path, final: Path, manifest: bytes, *, overwrite: bool
    ) -> None:
        """Publish a save whose data files under ``tmp`` are durable (blocking):
        write ``manifest`` (the encoded ``manifest.json``) durably, then the
        commit point (:meth:`commit`). After this returns ``final`` is a
        checkpoint; a failure before the commit point leaves ``tmp`` for the
        caller to discard.

        :raises FileExistsError: ``final`` exists and not ``overwrite`` (rename).
        :raises CheckpointError: ``overwrite`` where it is impossible (refused
            before the manifest is written).
        """
        self._check_commit(fs, tmp, final, overwrite=overwrite)
        write_bytes(fs, tmp / MANIFEST_NAME, manifest)
        self.commit(fs, tmp, final, overwrite=overwrite)

    def _check_commit(
        self, fs: LocalFileSystem, tmp: Path, final: Path, *, overwrite: bool
    ) -> None:
        """Refuse a commit the protocol cannot make, before anything is written."""

    def passed_commit(self, fs: LocalFileSystem, path: Path) -> bool:
        """Whether the final-named ``path`` passed its commit point (blocking):
        under the rename protocol, being under a final name is the commit; under
        the marker protocol, its marker must be there. The manifest is not
        checked (:meth:`committed` does)."""
        raise NotImplementedError

    def committed(self, fs: LocalFileSystem, final: Path) -> bool:
        """Whether ``final`` holds a committed checkpoint (blocking): a rank that
        lost the leader after every rank's files were durable asks it."""
        return fs.exists(final / MANIFEST_NAME) and self.passed_commit(fs, final)

    def mark_adopted(self, fs: LocalFileSystem, path: Path) -> None:
        """Commit the final-named ``path`` that was verified completely and has
        not passed its commit point (adoption at open, ``asyncsave adopt``);
        nothing to do where the name is the commit (blocking)."""

    def check_overwrite(self, fs: LocalFileSystem, final: Path, step: int) -> None:
        """Refuse to replace the committed ``final`` where the protocol cannot.

        :raises CheckpointError: :attr:`can_overwrite` is false; names the step,
            the path and why.
        """
        if not self.can_overwrite:
            raise CheckpointError(
                f"cannot overwrite {final} on {fs!r}: without an atomic rename the new "
                "files would replace the committed ones before the new commit",
                step=step,
                path=final,
            )

    def replace_file(self, fs: LocalFileSystem, path: Path, data: bytes) -> None:
        """Replace the small file at ``path`` (the tracker) atomically: readers see
        the old bytes or the new ones; durable on return (blocking)."""
        raise NotImplementedError

    def replace_file_streamed(
        self, fs: LocalFileSystem, path: Path, produce: Callable[[FileSink], Any]
    ) -> None:
        """Replace the file at ``path`` by what ``produce`` writes into the
        :class:`FileSink` it is given (any size, never held whole in memory):
        readers see the old file or the whole new one; durable on return
        (blocking). Both strategies write a temporary name beside ``path`` first
        (renamed over it on a POSIX directory; copied over it on an object store,
        where a copy makes the object appear whole). A failure of ``produce`` or
        of the I/O removes the temporary file and propagates unchanged; ``path``
        keeps its old bytes."""
        raise NotImplementedError


class RenameCommit(CommitStrategy):
    """A local (or shared POSIX) directory: temp dir + fsync + atomic rename +
    fsync of the parent (:func:`commit_dir`)."""

    renames = True

    def begin(self, fs: LocalFileSystem, root: Path, step: int, final: Path) -> Path:
        return make_temp_dir(fs, root, step)

    def same_save(self, name: str, step: int, final: Path) -> bool:
        return name.startswith(temp_dir_name(step)[:-12])

    def commit(self, fs: LocalFileSystem, tmp: Path, final: Path, *, overwrite: bool) -> None:
        commit_dir(fs, tmp, final, overwrite=overwrite)

    def passed_commit(self, fs: LocalFileSystem, path: Path) -> bool:
        return True

    def replace_file(self, fs: LocalFileSystem, path: Path, data: bytes) -> None:
        _replace_through_temp(fs, path, lambda tmp: write_bytes(fs, tmp, data))

    def replace_file_streamed(
        self, fs: LocalFileSystem, path: Path, produce: Callable[[FileSink], Any]
    ) -> None:
        _replace_through_temp(fs, path, lambda tmp: _stream_to(fs, tmp, produce))

    def __repr__(self) -> str:
        return "RenameCommit()"


def _replace_through_temp(fs: LocalFileSystem, path: Path, write: Callable[[Path], Any]) -> None:
    """The tracker's sequence: ``write`` a temporary file beside ``path`` (written
    and fsynced), rename(2) it over the old one, fsync the directory. A failure
    removes the temporary file and leaves ``path`` as it was."""
    tmp = path.parent / temp_file_name(path.name)
    try:
        write(tmp)
        fs.replace(tmp, path)
    except BaseException:
        try:
            fs.unlink(tmp)
        except OSError as exc:
            if exc.errno != errno.ENOENT:
                logger.warning("could not remove %s", tmp, exc_info=True)
        raise
    fs.fsync_dir(path.parent)


class MarkerCommit(CommitStrategy):
    """An object store: files under the final prefix, the manifest, then the
    commit marker last (``_marker``)."""

    renames = False
    protocol_files = (COMMIT_MARKER_NAME,)

    def begin(self, fs: LocalFileSystem, root: Path, step: int, final: Path) -> Path:
        return _marker.begin(fs, final)

    def same_save(self, name: str, step: int, final: Path) -> bool:
        return name == final.name

    def _check_commit(
        self, fs: LocalFileSystem, tmp: Path, final: Path, *, overwrite: bool
    ) -> None:
        if tmp != final or overwrite:
            raise CheckpointError(
                f"{fs!r} has no atomic rename: a save is committed in place and never "
                "overwrites a committed checkpoint",
                path=final,
            )

    def commit(self, fs: LocalFileSystem, tmp: Path, final: Path, *, overwrite: bool) -> None:
        self._check_commit(fs, tmp, final, overwrite=overwrite)
        _marker.commit(fs, final)

    def passed_commit(self, fs: LocalFileSystem, path: Path) -> bool:
        return fs.exists(path / COMMIT_MARKER_NAME)

    def mark_adopted(self, fs: LocalFileSystem, path: Path) -> None:
        if not self.passed_commit(fs, path):
            _marker.commit(fs, path)

    def replace_file(self, fs: LocalFileSystem, path: Path, data: bytes) -> None:
        # One PUT: it replaces an object atomically on S3.
        write_bytes(fs, path, data)

    def replace_file_streamed(
        self, fs: LocalFileSystem, path: Path, produce: Callable[[FileSink], Any]
    ) -> None:
        # Uploaded under a temporary key, then copied over the final one (a
        # server-side copy: the object appears whole) and the temporary key
        # deleted. Streaming straight to the final key relied on a failed upload
        # being discarded, which not every fsspec file system does (``memory://``
        # publishes the object as it is opened): the previous file was lost.
        _replace_through_temp(fs, path, lambda tmp: _stream_to(fs, tmp, produce))

    def __repr__(self) -> str:
        return "MarkerCommit()"


class FileSink:
    """The writable file :meth:`CommitStrategy.replace_file_streamed` hands to its
    producer: ``write`` (all of ``data``, looping on short writes) and ``flush``
    (nothing: the strategy fsyncs), as ``torch.save`` needs of a file object.

    :param fs: the I/O layer; :param fd: a descriptor of ``fs.create``.
    """

    def __init__(self, fs: LocalFileSystem, fd: int) -> None:
        self.fs, self.fd = fs, fd
        self.nbytes = 0

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        done = 0
        while done < len(view):
            n = self.fs.write(self.fd, view[done:])
            if n <= 0:
                raise OSError(errno.EIO, f"write returned {n}")
            done += n
        self.nbytes += done
        return done

    def flush(self) -> None:
        """Nothing: the data is fsynced once the producer returns."""


def _stream_to(fs: LocalFileSystem, path: Path, produce: Callable[[FileSink], Any]) -> None:
    """Create ``path``, let ``produce`` write it, fsync and close it; closed from
    the ``except`` block on failure (an upload is then discarded)."""
    fd = fs.create(path)
    try:
        produce(FileSink(fs, fd))
        fs.fsync(fd)
    except BaseException:
        try:
            fs.close(fd)
        except OSError:
            logger.warning("closing %s after a failed write failed too", path, exc_info=True)
        raise
    fs.close(fd)


def strategy_for(fs: LocalFileSystem) -> CommitStrategy:
    """The commit protocol of a root on ``fs``: chosen once, when the root is
    opened (``fs.atomic_rename``: POSIX directories rename; object stores mark).
    The only question asked of the storage's capability outside the I/O layer."""
    return RenameCommit() if fs.atomic_rename else MarkerCommit()


def make_temp_dir(fs: LocalFileSystem, root: Path, step: int) -> Path:
    """Create a fresh temporary directory for a save of ``step`` under ``root``
    (the rename protocol; object stores write under the final prefix instead:
    ``_atomicity.MarkerCommit``)."""
    path = root / temp_dir_name(step)
    fs.mkdir(path)
    return path


def make_held_temp_dir(
    fs: LocalFileSystem, root: Path, step: int, *, lock: str = "flock"
) -> tuple[Path, int | None]:
    """:func:`make_temp_dir`, locked (``fs.lock_dir``) so that recovery at open
    (``_commit.recover``) in another thread or process leaves it alone until the writer releases it
    (``fs.unlock``) after its commit or removal. Used by writers that do not hold
    the root's lock while they write (the standalone DCP writer).

    A directory that recovery removed between its creation and the lock is made
    afresh.

    :param lock: ``"none"``: the directory is not locked (a recovery in another
        process may remove it: see ``CheckpointOptions.lock``).
    :returns: the directory and the descriptor holding its lock (``None`` with
        ``lock="none"``).
    :raises LockUnavailableError: the file system refused the lock (no ``flock``);
        the directory is removed again.
    :raises CheckpointError: no directory could be created and locked (recovery
        removed every one, 100 times).
    """
    for _ in range(100):
        path = make_temp_dir(fs, root, step)
        if lock == "none":
            return path, None
        try:
            fd = fs.lock_dir(path)
        except FileNotFoundError:
            continue  # removed before the lock: a fresh one
        except LockUnavailableError:
            discard(fs, path)
            raise
        if fd is not None:
            return path, fd
        # Recovery holds it and is removing it: a fresh one.
    raise CheckpointError(
        f"could not keep a temporary directory in {root}: each was removed before "
        "it could be locked",
        step=step,
        path=root,
    )


def commit_dir(fs: LocalFileSystem, tmp: Path, final: Path, *, overwrite: bool) -> None:
    """Steps 3 to 5 of the protocol: fsync ``tmp``, rename it to ``final``, fsync the
    parent.

    With ``overwrite``, an existing ``final`` is swapped out atomically
    (``renameat2(RENAME_EXCHANGE)``) so that a crash leaves either the old or the
    new checkpoint under the final name, never neither; the old one is then removed.
    :raises FileExistsError: ``final`` exists and ``overwrite`` is false.
    :raises CheckpointError: overwrite asked where the file system cannot exchange.

    The rename protocol only: object stores commit by marker
    (``_atomicity.MarkerCommit``).
    """
    fs.fsync_dir(tmp)
    if overwrite and fs.lexists(final):
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
        # ``tmp`` now holds the old checkpoint, or the symlink that stood under the
        # final name (unlinked; its target is not ours). Committed already: a
        # failure here leaves a temporary name that the next open removes.
        discard(fs, tmp)
    else:
        fs.rename(tmp, final)
    fs.fsync_dir(final.parent)


def move_files(
    fs: LocalFileSystem, src: Path, dst: Path, names: list[str], *, keep_src: bool = False
) -> None:
    """Move the files ``names`` of ``src`` into the save's temporary directory
    ``dst`` (same file system: renames; ``CommitStrategy.can_move_files``), make
    the renames durable, drop ``src``: a rank's files written before the save's
    turn (streamed rounds, files written while staged), or another rank's files
    gathered by DCP's writer. Both directories are fsynced: POSIX makes a rename
    durable only with both parents (the power-loss suite's model; without
    ``src``'s, a power cut after the commit could leave a committed checkpoint
    without the file).

    :param keep_src: leave the emptied ``src`` for the caller to remove after
        the commit (DCP's writer: another rank's directory, locked by that rank).
    """
    for name in names:
        fs.rename(src / name, dst / name)
    fs.fsync_dir(dst)
    fs.fsync_dir(src)
    if not keep_src:
        fs.remove_tree(src)


def move_aside(
    fs: LocalFileSystem,
    root: Path,
    path: Path,
    why: str,
    step: int,
    reason: str,
    *,
    quiet: bool = True,
) -> Path | None:
    """Rename the final-named ``path`` (a symlink: the link itself, never its
    target) to an aside name (``.asyncsave-<why>-<step>-<id>``), keeping its bytes,
    out of every resolver's way, so that its step can be saved again. The caller
    makes the rename durable (``fs.fsync_dir(root)``).

    :param why: the aside name's kind: ``"damaged"`` or ``"incomplete"``.
    :param reason: why it is moved, for the log line.
    :param quiet: log a failed rename and leave the entry where it is (retried at
        the next open) instead of raising it.
    :returns: the aside path, or ``None`` when there was nothing to move or the
        rename failed (``quiet``).
    :raises OSError: the rename failed and not ``quiet``.
    """
    if not fs.lexists(path):
        return None
    aside = root / aside_dir_name(why, step)
    logger.warning("moving %s aside to %s: %s", path, aside.name, reason)
    try:
        fs.rename(path, aside)
    except OSError as exc:
        if not quiet:
            raise
        logger.warning("could not move %s aside (retried at the next open): %r", path, exc)
        return None
    return aside


def move_aside_durably(
    fs: LocalFileSystem,
    root: Path,
    path: Path,
    why: str,
    step: int,
    reason: str,
    *,
    quiet: bool = True,
) -> Path | None:
    """:func:`move_aside`, then ``root`` fsynced so that the move is durable (a
    damaged or partial checkpoint set aside while a saver runs: its step can be
    saved again).

    :returns: the aside path, or ``None`` (see :func:`move_aside`).
    :raises OSError: the rename or the fsync failed and not ``quiet`` (a failed
        fsync is raised either way).
    """
    aside = move_aside(fs, root, path, why, step, reason, quiet=quiet)
    if aside is not None:
        fs.fsync_dir(root)
    return aside


def discard(
    fs: LocalFileSystem,
    path: Path,
    retry: str = "the next open removes it",
    *,
    by: str = "asyncsave",
) -> bool:
    """Remove ``path`` if it is there (never following a symlink: ``fs.remove_tree``);
    a failure is logged, never raised (over a failed save's own error, or so that
    one leftover never blocks the others: https://github.com/facebookresearch/PyTorch-BigGraph/pull/24).

    :param retry: when it is tried again, for the log line.
    :param by: who removes it, for the log line (``"retention"``).
    :returns: whether it is gone.
    """
    try:
        if fs.lexists(path):
            fs.remove_tree(path)
    except OSError as exc:
        logger.warning("%s failed to remove %s (%s): %r", by, path, retry, exc)
        return False
    return True
