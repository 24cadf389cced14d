"""The I/O layer over fsspec: checkpoints on object stores (``s3://`` through s3fs)
and any other fsspec URL (``memory://``, ``gcs://``, ...).

:class:`FsspecFileSystem` implements every call of :class:`~asyncsave.LocalFileSystem`
on an fsspec file system. Object stores have no atomic rename (an S3 "rename" is a
copy and a delete), so it reports ``atomic_rename = False`` and the engine commits by
marker instead (``_marker``): files are written under the final prefix and
``commit_success.txt`` is written last.

What the POSIX calls become here:

- ``create``/``write``/``close``: ``fs.open(path, "wb")``; s3fs uploads parts of its
  ``block_size`` (multipart upload) as the buffer fills, and completes the upload at
  ``close``: the object appears whole, or not at all. A file closed while an error
  propagates is discarded (the multipart upload is aborted), never completed.
- ``fsync``/``fsync_dir``: nothing; an object is durable once its PUT (or the
  completion of its multipart upload) returns.
- ``lock``: nothing (object stores have no advisory lock): **one saver per root** is
  the caller's duty there. See docs/decisions.md, "Object stores".
- ``remove_tree``: deletes the commit marker first, then the rest, so a deletion cut
  short never leaves a committed-looking prefix with missing files. Object stores
  have no symlinks; where the fsspec file system has them (``file://``), a symlink
  is unlinked and never followed, as by the local layer.
- reads: ``fs.open(path, "rb", cache_type="none")``: each read is one ranged GET.

:func:`open_root` turns what a user passes as ``root`` (a path, a URL, a
``upath.UPath``) into the I/O layer and the path the engine joins names onto.
"""

from __future__ import annotations

import errno
import io
import itertools
import os
import posixpath
import sys
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import IO, Any, cast

from ._fs import LocalFileSystem, ReadAhead
from ._paths import COMMIT_MARKER_NAME

__all__ = ["FsspecFileSystem", "check_root", "is_url", "open_root"]

_LOCAL_PROTOCOLS = ("file", "local")


class FsspecFileSystem(LocalFileSystem):
    """asyncsave's I/O layer on an fsspec file system (an object store or any other).

    Build it from an fsspec file system you configured yourself, or let
    ``Checkpointer("s3://bucket/prefix", storage_options={...})`` build one::

        import s3fs
        fs = asyncsave.FsspecFileSystem(s3fs.S3FileSystem(endpoint_url="http://127.0.0.1:9000"))
        async with asyncsave.Checkpointer("s3://bucket/run1", filesystem=fs) as ckpt: ...

    Methods are blocking and run in worker threads, like the local layer's; fsspec
    file systems are thread-safe (s3fs runs its own event loop in a thread of its own).
    Paths may be ``upath.UPath`` objects or URL strings; they are reduced to the
    file system's own paths with its ``_strip_protocol``.

    :param fs: an ``fsspec.AbstractFileSystem`` instance (``s3fs.S3FileSystem``,
        ``fsspec.filesystem("memory")``, ...).
    """

    #: Renaming is a copy and a delete on object stores: commit by marker instead.
    atomic_rename = False

    def __init__(self, fs: Any) -> None:
        self.fs = fs
        self._files: dict[int, IO[bytes]] = {}
        self._ids = itertools.count(1)
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        protocol = self.fs.protocol
        return f"FsspecFileSystem({protocol[0] if isinstance(protocol, tuple) else protocol})"

    def _p(self, path: Any) -> str:
        return cast(str, self.fs._strip_protocol(str(path))).rstrip("/")

    def url(self, path: str) -> str:
        """The URL of a path of this file system (``bucket/key`` -> ``s3://bucket/key``)."""
        return cast(str, self.fs.unstrip_protocol(path))

    # -- files -------------------------------------------------------------------
    def create(self, path: Path) -> int:
        """Open an object for writing (not exclusive: object stores have no
        ``O_EXCL`` that every one supports); returns a handle for the calls below."""
        f = self.fs.open(self._p(path), "wb")
        with self._lock:
            handle = next(self._ids)
            self._files[handle] = f
        return handle

    def write(self, fd: int, data: memoryview) -> int:
        n = self._files[fd].write(data)
        return len(data) if n is None else int(n)

    def fsync(self, fd: int) -> None:
        """Nothing: the object is durable once :meth:`close` has uploaded it."""

    def close(self, fd: int) -> None:
        """Upload what is left and complete the object. Called while an exception
        propagates (asyncsave's writers close a file that failed mid-way from their
        ``except`` block), it discards the object instead: a multipart upload is
        aborted, never completed with part of the data."""
        with self._lock:
            f = self._files.pop(fd)
        if sys.exc_info()[0] is not None and hasattr(f, "discard"):
            try:
                f.discard()
            finally:
                try:  # so that garbage collection never completes it either
                    f.closed = True  # type: ignore[misc]
                except AttributeError:
                    pass  # an in-memory file (BytesIO): nothing to complete
            return
        f.close()

    def read_bytes(self, path: Path) -> bytes:
        return cast(bytes, self.fs.cat_file(self._p(path)))

    def size(self, path: Path) -> int:
        return int(self.fs.size(self._p(path)))

    def open_direct(self, path: Path) -> int | None:
        return None  # no O_DIRECT on an object store: data files are written buffered

    def seek(self, fd: int, pos: int) -> None:
        # Only used on O_DIRECT descriptors, which an object store never hands out.
        raise io.UnsupportedOperation("an object store upload is written sequentially")

    def open_read(self, path: Path) -> io.RawIOBase:
        """Open for reading without read-ahead: each ``read``/``readinto`` is one
        ranged GET of the size asked for (an fsspec file: ``seek``, ``read``,
        ``readinto`` as a raw file has them)."""
        return cast(io.RawIOBase, self.fs.open(self._p(path), "rb", cache_type="none"))

    # -- directories (prefixes) --------------------------------------------------
    def makedirs(self, path: Path) -> None:
        self.fs.makedirs(self._p(path), exist_ok=True)

    def mkdir(self, path: Path) -> None:
        if self.exists(path):
            raise FileExistsError(errno.EEXIST, "already exists", str(path))
        self.fs.makedirs(self._p(path), exist_ok=True)

    def fsync_dir(self, path: Path) -> None:
        """Nothing: object stores have no directory entries to flush."""

    def listdir(self, path: Path) -> list[str]:
        """Names directly under ``path``; an empty prefix lists as empty."""
        p = self._p(path)
        self.fs.invalidate_cache(p)  # another process (a crashed saver) may have written
        try:
            entries = self.fs.ls(p, detail=False)
        except FileNotFoundError:
            return []
        names = {posixpath.basename(str(e).rstrip("/")) for e in entries if str(e).rstrip("/") != p}
        return sorted(n for n in names if n)

    def is_dir(self, path: Path) -> bool:
        p = self._p(path)
        self.fs.invalidate_cache(p)
        return bool(self.fs.isdir(p))

    def is_link(self, path: Path) -> bool:
        """Whether ``path`` is a symlink: never on an object store; asked of file
        systems that have them (fsspec's local one has ``islink``)."""
        islink = getattr(self.fs, "islink", None)
        return bool(islink(self._p(path))) if islink is not None else False

    def exists(self, path: Path) -> bool:
        p = self._p(path)
        self.fs.invalidate_cache(p)
        return bool(self.fs.exists(p))

    def lexists(self, path: Path) -> bool:
        """Whether there is an entry ``path``, a (dangling) symlink included."""
        return self.exists(path) or self.is_link(path)

    def rename(self, src: Path, dst: Path) -> None:
        """Copy the prefix ``src`` to ``dst``, then remove ``src`` (marker first). Not
        atomic: used only to move a damaged checkpoint aside at open. A symlink
        (file systems that have them) is moved as the link."""
        if self.lexists(dst):
            raise FileExistsError(errno.EEXIST, "destination exists", str(dst))
        if self.is_link(src):  # a file system with symlinks: move the link itself
            self.fs.mv(self._p(src), self._p(dst))
            return
        self.fs.copy(self._p(src), self._p(dst), recursive=True)
        self.remove_tree(src)

    def replace(self, src: Path, dst: Path) -> None:
        """Copy the object ``src`` over ``dst``, then delete ``src`` (not atomic; the
        marker protocol writes the tracker with one PUT instead)."""
        self.fs.copy(self._p(src), self._p(dst))
        self.fs.rm_file(self._p(src))

    def exchange(self, a: Path, b: Path) -> None:
        raise OSError(errno.ENOSYS, "object stores cannot swap two prefixes atomically", str(a))

    def remove_tree(self, path: Path) -> None:
        """Delete a prefix: its commit marker first (it is uncommitted from then on),
        then every other object under it. A symlink (file systems that have them)
        is unlinked alone: the marker behind it belongs to what it points to."""
        p = self._p(path)
        if self.is_link(path):
            self.fs.rm_file(p)
            return
        marker = f"{p}/{COMMIT_MARKER_NAME}"
        self.fs.invalidate_cache(p)
        if self.fs.exists(marker):
            self.fs.rm_file(marker)
        try:
            self.fs.rm(p, recursive=True)
        except FileNotFoundError:
            pass  # nothing was left under it
        self.fs.invalidate_cache(p)

    def link(self, src: Path, dst: Path) -> None:
        """A server-side copy: object stores have no hard links."""
        self.fs.copy(self._p(src), self._p(dst))

    def unlink(self, path: Path) -> None:
        self.fs.rm_file(self._p(path))

    # -- locking -----------------------------------------------------------------
    def lock(self, path: Path) -> int | None:
        """No lock: object stores have none that a crashed holder releases. Returns
        a dummy handle; one saver per root is the caller's duty."""
        return 0

    def lock_dir(self, path: Path) -> int | None:
        """No lock (see :meth:`lock`; no temporary directories here: the marker
        protocol writes under the final name). Returns a dummy handle."""
        return 0

    def unlock(self, fd: int) -> None:
        """Nothing to release (see :meth:`lock`)."""

    def hand_over(self, fd: int) -> None:
        """Nothing to hand over (see :meth:`lock`)."""

    def read_ahead(self, directory: Path) -> ReadAhead:
        """Nothing to read ahead (a :class:`ReadAhead` of no file): an object
        store's bytes are not cached on this host (each read is a ranged GET)."""
        return ReadAhead([])

    def lock_holder(self, path: Path) -> str | None:
        """``None``: no lock is taken on an object store (see :meth:`lock`), so no
        holder is recorded (and no local file is read for a remote path)."""
        return None


def is_url(root: Any) -> bool:
    """Whether ``root`` names a location by URL (``s3://``, ``memory://``) or is a
    ``upath.UPath``, rather than a local path."""
    protocol = getattr(root, "protocol", None)
    if isinstance(protocol, str) and hasattr(root, "storage_options"):  # a UPath
        return protocol not in ("", *_LOCAL_PROTOCOLS)
    return isinstance(root, (str, os.PathLike)) and "://" in os.fspath(root)


def check_root(root: Any, what: str = "root") -> None:
    """Refuse what cannot name a root or a checkpoint before anything uses it.

    :param what: how the caller calls it in the message (``"root"``, ``"Tier.root"``).
    :raises TypeError: ``root`` is not a ``str``, an ``os.PathLike`` of ``str``
        or a ``upath.UPath`` (an int, ``None``, ``bytes``).
    :raises ValueError: ``root`` is empty or only whitespace (``Path("")`` would
        silently be the current directory).
    """
    if hasattr(root, "protocol") and hasattr(root, "storage_options"):  # a UPath
        return
    text = os.fspath(root) if isinstance(root, os.PathLike) else root
    if not isinstance(text, str):
        raise TypeError(
            f"{what}={root!r} must be a path (str or os.PathLike) or a URL such as "
            f"s3://bucket/prefix, not {type(root).__name__}"
        )
    if text.lower().startswith("file://"):
        text = text[len("file://") :]
    if not text.strip():
        raise ValueError(f"{what}={root!r} is empty: name a directory ('.' for this one)")


def open_root(
    root: Any,
    *,
    filesystem: LocalFileSystem | None = None,
    storage_options: Mapping[str, Any] | None = None,
    what: str = "root",
) -> tuple[LocalFileSystem, Path]:
    """The I/O layer and the path for a ``root`` (or checkpoint path) a user gave;
    ``what`` is the caller's name for it in errors (``"path"`` for a checkpoint).

    - A local path (``str``, ``os.PathLike``, ``file://`` URL): ``pathlib.Path``
      and ``filesystem`` (default :class:`LocalFileSystem`).
    - Any other URL (``s3://bucket/prefix``, ``memory://x``) or a ``upath.UPath``:
      an ``upath.UPath`` and an :class:`FsspecFileSystem` built by
      ``fsspec.core.url_to_fs(root, **storage_options)`` (s3fs for ``s3://``), unless
      ``filesystem`` is an :class:`FsspecFileSystem` already. A ``UPath`` joins,
      names and prints like a path (``/``, ``.name``, ``.parent``, ``str`` gives the
      URL), which is all the engine does with paths, so it stands in for one.

    Needs ``universal-pathlib`` and the fsspec implementation of the protocol
    (``pip install 'asyncsave[s3]'`` for S3) for URL roots only.

    :raises TypeError: ``root`` is not a path or a URL (see :func:`check_root`).
    :raises ValueError: ``root`` is empty, ``storage_options`` for a local root,
        or a local ``filesystem`` for a URL root.
    """
    check_root(root, what)
    if not is_url(root):
        if hasattr(root, "protocol"):  # a local UPath (PosixUPath, file:// FilePath)
            root = Path(root.path)
        if storage_options:
            raise ValueError(f"storage_options apply to URL roots (s3://...), not to {root!r}")
        if isinstance(filesystem, FsspecFileSystem):
            return filesystem, _upath(filesystem.url(os.fspath(root)), filesystem.fs)
        return filesystem or LocalFileSystem(), Path(root)
    url = str(root)
    protocol = url.split("://", 1)[0]
    if protocol in _LOCAL_PROTOCOLS:
        return open_root(
            url.split("://", 1)[1],
            filesystem=filesystem,
            storage_options=storage_options,
            what=what,
        )
    if filesystem is not None and not isinstance(filesystem, FsspecFileSystem):
        raise ValueError(
            f"root {url!r} is a URL but filesystem={filesystem!r} is a local file system; "
            "pass an asyncsave.FsspecFileSystem or leave filesystem unset"
        )
    if filesystem is None:
        import fsspec.core

        options = dict(getattr(root, "storage_options", None) or {})
        options.update(storage_options or {})
        fs, _ = fsspec.core.url_to_fs(url, **options)
        filesystem = FsspecFileSystem(fs)
    elif storage_options:
        raise ValueError("pass storage_options or an FsspecFileSystem, not both")
    assert isinstance(filesystem, FsspecFileSystem)
    return filesystem, _upath(url, filesystem.fs)


def _upath(url: str, fs: Any) -> Path:
    try:
        from upath import UPath
    except ImportError as exc:  # an optional dependency of URL roots only
        raise ImportError(
            f"checkpoint roots given as URLs ({url}) need universal-pathlib: "
            "pip install 'asyncsave[s3]' (or universal-pathlib and the fsspec "
            "implementation of your store)"
        ) from exc
    # The engine only joins, names and prints paths; a UPath does all three and
    # keeps the URL (and the storage options, for callers who open files through it).
    return cast(Path, UPath(url, **(fs.storage_options or {})))
