"""The I/O layer: every file-system call asyncsave makes goes through here.

All methods are blocking and are called from worker threads, never from the event
loop. Tests substitute a subclass that injects faults (ENOSPC, EIO, a writer that
never returns, a process killed at the k-th operation) at any one of these calls;
the crash and power-loss suites record the sequence of calls.

Two rules hold for every call here (docs/decisions.md, "Shared roots and symlinks"):

- **Modes follow the umask.** Files are created with mode ``0o666`` and directories
  with ``0o777``, less the process umask, as ``open(2)``, ``mkdir(2)`` and every
  shell tool create them; nothing is ``chmod``-ed. Under ``umask 002`` in a setgid,
  group-writable directory every member of the group can use the root
  (huggingface/datasets #7900: a lock file made 0644 locked the group out).
- **Deleting never follows a symlink.** :meth:`LocalFileSystem.remove_tree` unlinks a
  symlink (to a directory, to a file, dangling) and leaves its target alone; inside a
  directory it removes links as links (facebookresearch/PyTorch-BigGraph PR #24).
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


def _drop(fd: int) -> None:
    """Unlock, then close (a child forked meanwhile may hold a copy of ``fd``)."""
    try:
        fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


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
        """Create ``path`` exclusively for writing; returns a raw file descriptor.

        The file's mode is ``0o666`` less the process umask (``open(2)``): 0664
        under ``umask 002``, 0644 under ``umask 022`` (https://github.com/huggingface/datasets/issues/7900)."""
        return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o666)

    def open_direct(self, path: Path) -> int | None:
        """Open the existing file ``path`` for ``O_DIRECT`` writes (bypassing the
        page cache), or ``None`` where the file system refuses ``O_DIRECT`` (tmpfs,
        some FUSE and network file systems)."""
        flag = getattr(os, "O_DIRECT", 0)
        if not flag:
            return None
        try:
            return os.open(path, os.O_WRONLY | os.O_CLOEXEC | flag)
        except OSError as exc:
            if exc.errno in (errno.EINVAL, errno.EOPNOTSUPP):
                return None
            raise

    def seek(self, fd: int, pos: int) -> None:
        os.lseek(fd, pos, os.SEEK_SET)

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
        """Create ``path`` and its missing parents, each ``0o777`` less the umask."""
        path.mkdir(mode=0o777, parents=True, exist_ok=True)

    def mkdir(self, path: Path) -> None:
        """Create the directory ``path`` (``0o777`` less the umask); it must not exist."""
        path.mkdir(mode=0o777)

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
        """Whether ``path`` is a directory or a symlink to one (a checkpoint
        directory may be a link to another run's, and loads through it)."""
        return path.is_dir()

    def is_link(self, path: Path) -> bool:
        """Whether ``path`` itself is a symlink (dangling or not)."""
        return path.is_symlink()

    def exists(self, path: Path) -> bool:
        return path.exists()

    def lexists(self, path: Path) -> bool:
        """Whether there is an entry ``path``: ``exists`` without following a
        symlink (a dangling one counts)."""
        return os.path.lexists(path)

    def rename(self, src: Path, dst: Path) -> None:
        """Rename ``src`` to ``dst`` (a symlink is renamed, not its target); refuses
        to replace anything under ``dst``, a dangling symlink included."""
        if os.path.lexists(dst):
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
        """Delete the entry ``path``, never following a symlink: a directory with
        everything under it (links inside are removed as links), or a symlink or
        file by unlinking it. A symlinked checkpoint is thereby retired without
        touching the checkpoint it points to (https://github.com/facebookresearch/PyTorch-BigGraph/pull/24).

        :raises OSError: the removal failed part-way (what is left stays under
            ``path``; callers retry later).
        """
        if path.is_symlink() or not path.is_dir():
            os.unlink(path)
        else:
            # rmtree refuses a top-level symlink (raced in after the check above)
            # rather than follow it, and never follows one below.
            shutil.rmtree(path)

    def link(self, src: Path, dst: Path) -> None:
        """Hard-link ``src`` as ``dst`` (files of a committed checkpoint are never
        written again, so a checkpoint derived from another shares them). A symlink
        is linked as the symlink, not as its target."""
        os.link(src, dst, follow_symlinks=False)

    def unlink(self, path: Path) -> None:
        path.unlink()

    # -- locking -----------------------------------------------------------------
    def lock(self, path: Path) -> int | None:
        """Take an exclusive advisory lock (``flock``) on ``path``, creating it
        (``0o666`` less the umask, like every file here).

        Needs only read permission on an existing lock file (https://github.com/huggingface/datasets/issues/7900: a lock file
        another member of the group created under ``umask 022``): it is opened
        read-write where allowed (NFS emulates ``flock`` with ``fcntl`` locks,
        whose exclusive kind needs a descriptor open for writing), read-only where
        not (a local ``flock`` works on any descriptor).

        :returns: the descriptor holding the lock, or ``None`` if another open
            file description holds it (this process or another).
        :raises PermissionError: the lock file cannot even be read (a umask of
            ``077`` when it was created), or the root is not writable and has none.
        """
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o666)
        except OSError as exc:
            if exc.errno not in (errno.EACCES, errno.EPERM, errno.EROFS):
                raise
            try:
                fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
            except FileNotFoundError:
                raise exc from None  # could not create it: the first error says why
        if not _flock_or_close(fd):
            return None
        _LOCK_FDS.add(fd)
        return fd

    def lock_dir(self, path: Path) -> int | None:
        """Take an exclusive advisory lock (``flock``) on the directory ``path``
        itself (its own descriptor; nothing is created inside it), without waiting.

        A writer holds it on its temporary directory from creation to commit or
        removal, and recovery takes it before removing one, so that recovery never
        removes a directory a live writer is using; a crashed writer's lock is gone
        with its process. The lock stays with the directory across a rename.

        :returns: the descriptor holding the lock (release with :meth:`unlock`), or
            ``None`` if another open file description holds it.
        :raises FileNotFoundError: ``path`` is gone, or was replaced by another
            entry between the open and the lock.
        :raises OSError: ``path`` is a symlink or no directory (``ELOOP``,
            ``ENOTDIR``), or cannot be opened.
        """
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        if not _flock_or_close(fd):
            return None
        try:
            now = os.stat(path, follow_symlinks=False)
        except BaseException:
            _drop(fd)
            raise
        held = os.fstat(fd)
        if (now.st_dev, now.st_ino) != (held.st_dev, held.st_ino):
            _drop(fd)
            raise FileNotFoundError(errno.ENOENT, "replaced while it was being locked", str(path))
        _LOCK_FDS.add(fd)
        return fd

    def unlock(self, fd: int) -> None:
        """Release a lock taken by :meth:`lock` or :meth:`lock_dir`.

        Unlocks explicitly before closing: a child forked a moment ago may still
        hold a copy of the descriptor (it closes it right after the fork), and a
        plain close would leave the lock held by that copy."""
        _LOCK_FDS.discard(fd)
        try:
            fcntl.flock(fd, fcntl.LOCK_UN)
        finally:
            os.close(fd)


def _flock_or_close(fd: int) -> bool:
    """Take an exclusive ``flock`` on ``fd`` without waiting; when it is held
    elsewhere (``False``) or fails (raised), ``fd`` is closed."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return False
    except BaseException:
        os.close(fd)
        raise
    return True
