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
import json
import logging
import os
import shutil
import socket
import stat
import threading
from pathlib import Path

from ._errors import LockUnavailableError
from ._paths import MANIFEST_NAME

logger = logging.getLogger(__name__)

__all__ = ["LOCK_MODES", "LocalFileSystem", "check_lock_mode", "holds_lock"]

#: The values of the ``lock`` option: ``"flock"`` (an exclusive ``flock(2)`` on the
#: root's lock file and on each temporary directory of a save in flight) or
#: ``"none"`` (no advisory lock; see ``CheckpointOptions.lock`` for the risk).
LOCK_MODES = ("flock", "none")
# Bytes of a holder record read back (a record is ~80 bytes; anything longer is
# not one of ours).
_HOLDER_MAX_BYTES = 4096

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


def holds_lock(fd: int) -> bool:
    """Whether ``fd`` is a lock descriptor this process still holds (not
    released, nor closed in a forked child)."""
    return fd in _LOCK_FDS


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

    def read_ahead(self, directory: Path) -> ReadAhead:
        """While the context is open, read the files of ``directory`` (not its
        manifest, not its subdirectories) into the page cache from a thread
        (:class:`ReadAhead`): a cold load's disk reads overlap the parse of its
        manifest. A hint only: nothing it reads is kept, and a file it cannot
        read is skipped (the load itself reports it)."""
        try:
            names = [n for n in os.listdir(directory) if n != MANIFEST_NAME]
        except OSError:
            names = []
        return ReadAhead(sorted(directory / n for n in names))

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
        (``0o666`` less the umask, like every file here), and record the holder
        (pid, host) in it for :meth:`lock_holder`.

        Needs only read permission on an existing lock file (https://github.com/huggingface/datasets/issues/7900: a lock file
        another member of the group created under ``umask 022``): it is opened
        read-write where allowed (NFS emulates ``flock`` with ``fcntl`` locks,
        whose exclusive kind needs a descriptor open for writing), read-only where
        not (a local ``flock`` works on any descriptor; the holder is then not
        recorded).

        :returns: the descriptor holding the lock, or ``None`` if another open
            file description holds it (this process or another).
        :raises LockUnavailableError: the file system refused the lock (no
            ``flock``: ``ENOSYS``, ``ENOLCK``, ``EOPNOTSUPP``...); a lock file this
            call created is removed again.
        :raises PermissionError: the lock file cannot even be read (a umask of
            ``077`` when it was created), or the root is not writable and has none.
        """
        fd, created = _open_lock_file(path)
        try:
            held = _flock_or_close(fd, path)
        except LockUnavailableError:
            if created:
                _unlink_quietly(path)
            raise
        if not held:
            return None
        _record_holder(fd)
        _LOCK_FDS.add(fd)
        return fd

    def lock_holder(self, path: Path) -> str | None:
        """Who holds the lock file ``path``, as its holder recorded it when it took
        the lock: ``"pid 4242 on host node7"`` (``"this process"`` for our own pid),
        or ``None`` when nothing readable is recorded (a holder that could open the
        file only for reading records nothing) or the recorded process is gone
        (same host)."""
        try:
            with open(path, "rb") as f:
                record = json.loads(f.read(_HOLDER_MAX_BYTES))
            pid, host = int(record["pid"]), str(record["host"])
        except (OSError, ValueError, TypeError, KeyError):
            return None
        if host == socket.gethostname():
            if pid == os.getpid():
                return f"pid {pid} on host {host} (this process)"
            if not _alive(pid):
                return None
        return f"pid {pid} on host {host}"

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
        :raises LockUnavailableError: the file system refused the lock (no
            ``flock``); ``path`` is left to the caller.
        :raises OSError: ``path`` is a symlink or no directory (``ELOOP``,
            ``ENOTDIR``), or cannot be opened.
        """
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        if not _flock_or_close(fd, path):
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

    def hand_over(self, fd: int) -> None:
        """Close this process's descriptor of a lock taken by :meth:`lock` that
        a child process inherited (``pass_fds``), without unlocking: an
        ``flock`` belongs to the open file description, so the child's copy
        holds it on, and releases it with :meth:`unlock` or by exiting."""
        _LOCK_FDS.discard(fd)
        os.close(fd)

    def unlock(self, fd: int) -> None:
        """Release a lock taken by :meth:`lock` or :meth:`lock_dir`.

        Unlocks explicitly before closing: a child forked a moment ago may still
        hold a copy of the descriptor (it closes it right after the fork), and a
        plain close would leave the lock held by that copy."""
        _LOCK_FDS.discard(fd)
        try:
            _clear_holder(fd)  # a later holder that cannot write leaves no stale record
            fcntl.flock(fd, fcntl.LOCK_UN)
        finally:
            os.close(fd)


# What the read-ahead thread reads per call. Large: the thread needs the GIL back
# after every call, and the manifest parse it overlaps holds the GIL in long
# stretches (one json.loads call of 0.4 s at 100,000 tensors). In 8 MiB reads it
# read 0.4-0.55 GB of a 1 GB checkpoint during a 1.1 s parse; in 64 MiB reads,
# all of it.
READ_AHEAD_CHUNK = 64 << 20
# How long the end of a load waits for the read-ahead's last step (seconds).
READ_AHEAD_JOIN_S = 30.0


class ReadAhead:
    """A thread that reads ``paths`` into the page cache, one
    :data:`READ_AHEAD_CHUNK` of each file in turn (the loader's threads start
    at every file's head at once), from ``__enter__`` until :meth:`stop` or the
    end of the files. The bytes go to ``/dev/null`` by ``sendfile(2)``: read
    into the page cache, never copied into this process.

    It is stopped by :meth:`stop` (no wait: it ends after the read under way)
    once the loader's own threads start reading, not left to read the rest: the
    page cache it fills is bounded by what the disk reads while the manifest is
    parsed (a checkpoint larger than memory is not read twice). ``__exit__``
    stops it and waits for it (at most :data:`READ_AHEAD_JOIN_S`). One file is
    open at a time, for one step (:func:`_send_step`). Regular files only; an
    ``OSError`` (a file system without ``sendfile`` into ``/dev/null``, a file
    gone) ends the reading of that file quietly: the load reports what matters.
    """

    def __init__(self, paths: list[Path]) -> None:
        self.paths = paths
        self.read_bytes = 0  # what was read (a test's and a benchmark's figure)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> ReadAhead:
        if self.paths:
            self._thread = threading.Thread(
                target=self._run, name="asyncsave-read-ahead", daemon=True
            )
            self._thread.start()
        return self

    def stop(self) -> None:
        """Read no further (the read under way ends first); returns at once."""
        self._stop.set()

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            # Bounded (invariant 3): the read under way ends within one step of
            # the disk; one stuck in the kernel (a hung network mount) is left
            # to end by itself, a daemon thread holding two descriptors.
            self._thread.join(READ_AHEAD_JOIN_S)
            if self._thread.is_alive():
                logger.warning(
                    "the read-ahead of %s is still in a read after %s s; left to end",
                    self.paths[0].parent,
                    READ_AHEAD_JOIN_S,
                )
            self._thread = None

    def _run(self) -> None:
        try:
            sink = os.open(os.devnull, os.O_WRONLY | os.O_CLOEXEC)
        except OSError:
            return
        try:
            offsets = dict.fromkeys(self.paths, 0)
            while offsets and not self._stop.is_set():
                for path, offset in list(offsets.items()):
                    if self._stop.is_set():
                        return
                    n = _send_step(sink, path, offset)
                    if n:
                        offsets[path] = offset + n
                        self.read_bytes += n
                    else:  # its end, not a regular file, or no sendfile here
                        del offsets[path]
        finally:
            os.close(sink)


def _send_step(sink: int, path: Path, offset: int) -> int:
    """Send one :data:`READ_AHEAD_CHUNK` of ``path`` from ``offset`` to ``sink``
    (``/dev/null``): the bytes sent, 0 at the end or on any ``OSError``. The
    file is open only for this step, so the read-ahead holds at most two
    descriptors whatever the number of files (a checkpoint of 2,000 files
    loads under a limit of a few dozen). Only a regular file is opened: a
    FIFO's open would block, a device's may act; ``O_NONBLOCK`` and
    ``O_NOFOLLOW`` cover a file swapped between the check and the open."""
    try:
        if not stat.S_ISREG(os.lstat(path).st_mode):
            return 0
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_NOCTTY)
    except OSError:
        return 0
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return 0
        return os.sendfile(sink, fd, offset, READ_AHEAD_CHUNK)
    except OSError:
        return 0
    finally:
        os.close(fd)


def _flock_or_close(fd: int, path: Path) -> bool:
    """Take an exclusive ``flock`` on ``fd`` (opened on ``path``) without waiting;
    when it is held elsewhere (``False``) or refused (raised), ``fd`` is closed.

    The one place a lock refusal is translated: any ``OSError`` but "held
    elsewhere" (``EWOULDBLOCK``) means the file system has no working ``flock``.

    :raises LockUnavailableError: the file system refused the lock.
    """
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return False
    except OSError as exc:
        writable = _writable(fd)
        os.close(fd)
        raise _lock_refused(path, exc, writable) from exc
    except BaseException:
        os.close(fd)
        raise
    return True


def _lock_refused(path: Path, exc: OSError, writable: bool) -> LockUnavailableError:
    """The typed error of a refused ``flock`` on ``path`` (a root's lock file or a
    temporary directory in it): names the root and the way forward."""
    root = path.parent
    code = errno.errorcode.get(exc.errno or 0, str(exc.errno))
    why = f"flock({path.name}) failed with {code} ({exc.strerror})"
    if exc.errno == errno.EBADF and not writable:
        hint = (
            "this file system (NFS) locks only files opened for writing, and the lock "
            f"file is not writable by this user: make {path} group-writable"
        )
    else:
        hint = (
            "its file system has no working advisory locks (Lustre mounted without "
            "-o flock, some NFS and FUSE mounts): mount it with lock support (Lustre: "
            "-o flock), or, if only one process at a time saves into this root, run "
            'without the lock: lock="none" (CheckpointOptions, '
            "asyncsave.dcp.StorageWriter; `asyncsave prune --lock none`); nothing was "
            "committed"
        )
    error = LockUnavailableError(f"cannot lock checkpoint root {root}: {why}; {hint}", path=root)
    error.errno, error.strerror, error.filename = exc.errno, exc.strerror, os.fspath(path)
    return error


def _open_lock_file(path: Path) -> tuple[int, bool]:
    """Open (or create) the lock file ``path``: read-write where allowed,
    read-only where not (see :meth:`lock`). :returns: the descriptor and whether this call
    created the file."""
    flags = os.O_RDWR | os.O_CLOEXEC
    try:
        return os.open(path, flags | os.O_CREAT | os.O_EXCL, 0o666), True
    except FileExistsError:
        pass
    except OSError as exc:
        if exc.errno not in (errno.EACCES, errno.EPERM, errno.EROFS):
            raise
        if not os.path.lexists(path):
            raise  # could not create it: this error says why
    try:
        return os.open(path, flags), False
    except OSError as exc:
        if exc.errno not in (errno.EACCES, errno.EPERM, errno.EROFS):
            raise
        return os.open(path, os.O_RDONLY | os.O_CLOEXEC), False


def _writable(fd: int) -> bool:
    try:
        return fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_ACCMODE != os.O_RDONLY
    except OSError:
        return False


def _record_holder(fd: int) -> None:
    """Write who holds the lock into the lock file (best effort: a descriptor open
    only for reading, or a full disk, records nothing)."""
    if not _writable(fd):
        return
    record = json.dumps({"pid": os.getpid(), "host": socket.gethostname()}).encode() + b"\n"
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, record, 0)
    except OSError:
        pass


def _clear_holder(fd: int) -> None:
    if _writable(fd) and stat.S_ISREG(os.fstat(fd).st_mode):
        try:
            os.ftruncate(fd, 0)
        except OSError:
            pass


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's process
    return True


def _unlink_quietly(path: Path) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def check_lock_mode(lock: object, field: str = "lock") -> None:
    """Refuse a ``lock`` option that is not one of :data:`LOCK_MODES`.

    :raises ValueError: naming ``field`` and the values allowed.
    """
    if not isinstance(lock, str) or lock not in LOCK_MODES:
        raise ValueError(f"{field}={lock!r} must be one of {', '.join(map(repr, LOCK_MODES))}")
