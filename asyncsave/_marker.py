"""Commit by marker: the protocol on storage without an atomic rename (object stores).

An S3 "rename" of a prefix is a copy of every object and a delete, visible half-done
to every reader, so the rename protocol of ``_commit`` cannot commit there. On a file
system whose I/O layer says ``atomic_rename = False`` (:class:`FsspecFileSystem`),
the root's protocol is ``_atomicity.MarkerCommit``, which calls this module; a save of step ``N`` goes, in order (each step complete before the next):

1. every data file written directly under the final prefix (``step_N/``): one PUT,
   or a multipart upload completed at close (the object appears whole or not at all);
2. ``manifest.json``;
3. ``commit_success.txt`` (:data:`COMMIT_MARKER_NAME`), one PUT: **the commit point**;
4. the tracker, one PUT (a PUT replaces an object atomically on S3), never backwards.

A prefix under a final name without the marker is uncommitted: no reader
(``latest``, ``load``, ``verify``, the CLI, resume) counts it, and each says why
(:class:`~asyncsave.UncommittedCheckpointError`). It is never deleted: a save that
stopped just before its marker and a checkpoint a sync tool copied there look alike,
so the next :class:`~asyncsave.Checkpointer` open adopts it if it verifies
completely (``_commit.adopt_checkpoint``: every checksum, then the marker), and
moves it aside otherwise. Deleting a checkpoint deletes its marker first
(``FsspecFileSystem.remove_tree``), so a deletion cut short leaves an uncommitted
prefix, never a committed-looking one with missing files. Overwriting a
committed step is refused: the new files would replace the old ones before the new
marker could commit them.

Source: Orbax commits checkpoints on cloud storage the same way
(``orbax/checkpoint/_src/path/atomicity.py``, ``CommitFileTemporaryPath``: a
``commit_success.txt`` written last; directories without it are not checkpoints).
"""

from __future__ import annotations

import errno
from pathlib import Path

from ._fs import LocalFileSystem
from ._paths import COMMIT_MARKER_NAME
from ._write import write_bytes

__all__ = ["begin", "commit"]


def begin(fs: LocalFileSystem, final: Path) -> Path:
    """Where a save's files go under the marker protocol: the final prefix itself.

    :raises FileExistsError: something is already under ``final`` (a committed
        checkpoint, or another saver's files: one saver per root).
    """
    if fs.exists(final):
        raise FileExistsError(
            errno.EEXIST,
            "objects already exist under this final prefix (a committed checkpoint, or "
            "another saver writing into the same root)",
            str(final),
        )
    return final


def commit(fs: LocalFileSystem, final: Path) -> None:
    """Write the commit marker into ``final``: after this returns, the checkpoint is
    committed. Every other file of the checkpoint must be complete before."""
    write_bytes(fs, final / COMMIT_MARKER_NAME, f"committed {final}\n".encode())
