"""The commit strategy of a root: how a save becomes a checkpoint there.

Chosen once, from the root's I/O layer (:func:`strategy_for`), and asked by the
pipeline and the checkpointer instead of the storage (Orbax's
``_src/path/atomicity_types.py`` / ``atomicity.py``: a temporary path class per
kind of storage, chosen once from the path). Two kinds:

- :class:`RenameCommit` (a POSIX directory, ``fs.atomic_rename``): files go into
  a temporary directory no resolver recognises; the commit is fsync of it, an
  atomic ``rename(2)`` to the final name, fsync of the parent (``_commit``). An
  overwrite exchanges the two directories atomically.
- :class:`MarkerCommit` (object stores through fsspec): every rank uploads its
  files under the final prefix; rank 0 writes the manifest, then the commit
  marker last (``_marker``; Orbax's ``CommitFileTemporaryPath``). A prefix
  without the marker is never a checkpoint. Nothing is renamed, so nothing is
  overwritten or moved aside, and files cannot move between directories.

The methods do the I/O of one step each (blocking: callers run them in worker
threads); the attributes are what callers used to ask the storage.
"""

from __future__ import annotations

from pathlib import Path

from . import _marker
from ._commit import commit_dir, make_temp_dir
from ._errors import CheckpointError
from ._fs import LocalFileSystem
from ._paths import MANIFEST_NAME, temp_dir_name

__all__ = ["CommitStrategy", "MarkerCommit", "RenameCommit", "strategy_for"]


class CommitStrategy:
    """The contract (see the module docstring). Call sequence of one save: the
    leader calls :meth:`begin`; every rank checks the leader's directory with
    :meth:`same_save` and writes into it; the leader writes the manifest and
    calls :meth:`commit`. Readers and survivors ask :meth:`committed`."""

    #: Whether the commit renames a temporary directory: then files can be moved
    #: between directories of the root (a streamed rank's own directory, DCP's
    #: and Megatron's writers), a committed step can be overwritten (atomic
    #: exchange) and a damaged one moved aside. False: the commit is a marker.
    renames: bool = True

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

    def committed(self, fs: LocalFileSystem, final: Path) -> bool:
        """Whether ``final`` holds a committed checkpoint (blocking): a rank that
        lost the leader after every rank's files were durable asks it."""
        return fs.exists(final / MANIFEST_NAME) and _marker.is_committed(fs, final)


class RenameCommit(CommitStrategy):
    """A local (or shared POSIX) directory: temp dir + fsync + atomic rename +
    fsync of the parent (``_commit.commit_dir``)."""

    renames = True

    def begin(self, fs: LocalFileSystem, root: Path, step: int, final: Path) -> Path:
        return make_temp_dir(fs, root, step)

    def same_save(self, name: str, step: int, final: Path) -> bool:
        return name.startswith(temp_dir_name(step)[:-12])

    def commit(self, fs: LocalFileSystem, tmp: Path, final: Path, *, overwrite: bool) -> None:
        commit_dir(fs, tmp, final, overwrite=overwrite)

    def __repr__(self) -> str:
        return "RenameCommit()"


class MarkerCommit(CommitStrategy):
    """An object store: files under the final prefix, the manifest, then the
    commit marker last (``_marker``)."""

    renames = False

    def begin(self, fs: LocalFileSystem, root: Path, step: int, final: Path) -> Path:
        return _marker.begin(fs, final)

    def same_save(self, name: str, step: int, final: Path) -> bool:
        return name == final.name

    def commit(self, fs: LocalFileSystem, tmp: Path, final: Path, *, overwrite: bool) -> None:
        if tmp != final or overwrite:
            raise CheckpointError(
                f"{fs!r} has no atomic rename: a save is committed in place and never "
                "overwrites a committed checkpoint",
                path=final,
            )
        _marker.commit(fs, final)

    def __repr__(self) -> str:
        return "MarkerCommit()"


def strategy_for(fs: LocalFileSystem) -> CommitStrategy:
    """The commit strategy of a root on ``fs``: chosen once, when the root is
    opened (``fs.atomic_rename``: POSIX directories rename; object stores mark)."""
    return RenameCommit() if fs.atomic_rename else MarkerCommit()
