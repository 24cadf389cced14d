"""The I/O layer: every file-system call asyncsave makes goes through here.

All methods are blocking and are called from worker threads, never from the event
loop. Tests substitute a subclass that injects faults (ENOSPC, EIO, a writer that
never returns, a process killed at the k-th operation) at any one of these calls;
the crash and power-loss suites record the sequence of calls.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import fcntl
import io
import os
import shutil
from pathlib import Path

__all__ = ["LocalFileSystem"]

_RENAME_EXCHANGE = 2

# Lock descriptors this process holds: a forked child (a DataLoader worker) must not
# keep the parent's saver lock alive after the parent lets it go.
_LOCK_FDS: set[int] = set()


def _close_locks_in_child() -> None:
    for fd in list(_LOCK_FDS):
        try:
            os.close(fd)
        except OSError:
            pass
    _LOCK_FDS.clear()


os.register_at_fork(after_in_child=_close_locks_in_child)
_AT_FDCWD = -100


class LocalFileSystem:
    """POSIX file-system operations with the durability calls made explicit.

    Nothing here fsyncs implicitly: the commit protocol (see ``_commit``) says when.
    """

    #: ``rename(2)`` is atomic here, so a save is committed by renaming its temporary
    #: directory. Layers without it (object stores, ``FsspecFileSystem``) commit by
    #: writing a marker last instead (``_marker``).
    atomic_rename = True

    # -- files -------------------------------------------------------------------
    def create(self, path: Path) -> int:
        """Create ``path`` exclusively for writing; returns a raw file descriptor."""
        return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)

    def write(self, fd: int, data: memoryview) -> int:
        """Write some of ``data`` at the current offset; returns bytes written
        (may be fewer than asked: callers loop)."""
        return os.write(fd, data)

    def fsync(self, fd: int) -> None:
        """Flush a file's data and metadata to stable storage."""
        os.fsync(fd)

    def close(self, fd: int) -> None:
        os.close(fd)

    def read_bytes(self, path: Path) -> bytes:
        return path.read_bytes()

    def size(self, path: Path) -> int:
        return os.stat(path).st_size

    def open_read(self, path: Path) -> io.RawIOBase:
        """Open ``path`` for unbuffered binary reads (``seek``, ``read``, ``readinto``)."""
        return open(path, "rb", buffering=0)

    # -- directories -------------------------------------------------------------
    def makedirs(self, path: Path) -> None:
        path.mkdir(parents=True, exist_ok=True)

    def mkdir(self, path: Path) -> None:
        path.mkdir()

    def fsync_dir(self, path: Path) -> None:
        """Make a directory's entries (creations, renames, deletions) durable."""
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def listdir(self, path: Path) -> list[str]:
        return sorted(os.listdir(path))

    def is_dir(self, path: Path) -> bool:
        return path.is_dir()

    def exists(self, path: Path) -> bool:
        return path.exists()

    def rename(self, src: Path, dst: Path) -> None:
        """Rename ``src`` to ``dst``; refuses to replace an existing directory."""
        if dst.exists():
            raise FileExistsError(errno.EEXIST, "destination exists", str(dst))
        os.rename(src, dst)

    def replace(self, src: Path, dst: Path) -> None:
        """Atomically replace the file ``dst`` by ``src`` (``rename(2)``)."""
        os.replace(src, dst)

    def exchange(self, a: Path, b: Path) -> None:
        """Atomically swap two directory entries (Linux ``renameat2`` with
        ``RENAME_EXCHANGE``). Raises ``OSError(ENOSYS)`` where unsupported."""
        libc_name = ctypes.util.find_library("c")
        libc = ctypes.CDLL(libc_name, use_errno=True)
        renameat2 = getattr(libc, "renameat2", None)
        if renameat2 is None:
            raise OSError(errno.ENOSYS, "renameat2 is not available", str(a))
        rc = renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE)
        if rc != 0:
            err = ctypes.get_errno()
            raise OSError(err, os.strerror(err), str(a), None, str(b))

    def remove_tree(self, path: Path) -> None:
        """Delete a directory and everything under it."""
        shutil.rmtree(path)

    def link(self, src: Path, dst: Path) -> None:
        """Hard-link ``src`` as ``dst`` (files of a committed checkpoint are never
        written again, so a checkpoint derived from another shares them)."""
        os.link(src, dst)

    def unlink(self, path: Path) -> None:
        path.unlink()

    # -- locking -----------------------------------------------------------------
    def lock(self, path: Path) -> int | None:
        """Take an exclusive advisory lock (``flock``) on ``path``, creating it.

        :returns: the descriptor holding the lock, or ``None`` if another open
            file description holds it (this process or another).
        """
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return None
        except BaseException:
            os.close(fd)
            raise
        _LOCK_FDS.add(fd)
        return fd

    def unlock(self, fd: int) -> None:
        """Release a lock taken by :meth:`lock`.

        Unlocks explicitly before closing: a child forked a moment ago may still
        hold a copy of the descriptor (it closes it right after the fork), and a
        plain close would leave the lock held by that copy."""
        _LOCK_FDS.discard(fd)
        try:
            fcntl.flock(fd, fcntl.LOCK_UN)
        finally:
            os.close(fd)
