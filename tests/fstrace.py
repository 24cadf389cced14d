"""A tracing shim over asyncsave's I/O layer, for the crash and power-loss suites.

:class:`TracingFS` is a :class:`~asyncsave.LocalFileSystem` whose every mutating or
durability call (``create``, ``write``, ``fsync``, ``close``, ``makedirs``,
``mkdir``, ``fsync_dir``, ``rename``, ``replace``, ``exchange``, ``remove_tree``,
``unlink``) is

1. numbered and offered to a ``before`` hook first (the crash suites SIGKILL the
   process at call number *i*, so any new code path of the engine is enumerated
   without naming it), and
2. recorded as a logical operation on a model of the tree under ``root`` (inodes,
   directory entries, file bytes), from which the power-loss suite rebuilds every
   state a crash may leave (see :mod:`powerloss`).

``remove_tree`` is performed file by file (an ``unlink`` per file, an ``rmdir`` per
directory, bottom-up), each a numbered call, so a crash in the middle of a delete
is enumerated too. ``max_write`` caps the bytes one ``write`` call takes (a short
write, which the engine must loop over), so crashes in the middle of a file are
enumerated as well.

Reads (``read_bytes``, ``size``, ``listdir``, ``exists``, ``is_dir``) and the
root's lock are neither numbered nor recorded: they change nothing on disk.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from asyncsave import LocalFileSystem

# The operations a crash can fall between (reads excluded).
MUTATING = (
    "create",
    "write",
    "fsync",
    "close",
    "makedirs",
    "mkdir",
    "fsync_dir",
    "rename",
    "replace",
    "exchange",
    "unlink",
    "rmdir",
    "link",
)

# Logical operations of the model (what ``ops`` holds):
#   ("mkdir", parent_ino, name, ino)      ("create", parent_ino, name, ino)
#   ("write", ino, offset, data)          ("fsync", ino)
#   ("fsync_dir", ino)                    ("rename", src_parent, src_name, dst_parent, dst_name)
#   ("exchange", pa, na, pb, nb)          ("unlink", parent_ino, name)
#   ("rmdir", parent_ino, name)           ("link", parent_ino, name, ino)  (a hard link)
#   ("mark", what, *values)  (test markers: dispatch/ack)
ROOT_INO = 0


@dataclass
class Snapshot:
    """A tree as the model sees it: directories by inode (name -> inode) and file
    bytes by inode. The inode of the root is :data:`ROOT_INO`."""

    dirs: dict[int, dict[str, int]] = field(default_factory=lambda: {ROOT_INO: {}})
    files: dict[int, bytearray] = field(default_factory=dict)

    def copy(self) -> Snapshot:
        return Snapshot(
            {k: dict(v) for k, v in self.dirs.items()},
            {k: bytearray(v) for k, v in self.files.items()},
        )

    @classmethod
    def of(cls, root: Path, ino_counter: list[int]) -> Snapshot:
        """Read the real tree under ``root`` (assumed durable)."""
        snap = cls()

        def walk(path: Path, ino: int) -> None:
            for entry in sorted(os.scandir(path), key=lambda e: e.name):
                if entry.name == ".asyncsave.lock":
                    continue
                ino_counter[0] += 1
                child = ino_counter[0]
                snap.dirs[ino][entry.name] = child
                if entry.is_dir(follow_symlinks=False):
                    snap.dirs[child] = {}
                    walk(Path(entry.path), child)
                else:
                    snap.files[child] = bytearray(Path(entry.path).read_bytes())

        walk(root, ROOT_INO)
        return snap


class TracingFS(LocalFileSystem):
    """Numbers every mutating call, optionally lets a hook act before it, caps
    write sizes, and records the logical operations under ``root``.

    :param root: the checkpoint root; paths outside it are numbered but not modelled.
    :param before: ``before(index, op, path)`` runs before call ``index`` (1-based);
        a crash test SIGKILLs the process there.
    :param max_write: most bytes one ``write`` call takes (``None``: no cap).
    :param record: keep the logical operations (the power-loss suite needs them).
    """

    def __init__(
        self,
        root: Path,
        *,
        before: Callable[[int, str, str], None] | None = None,
        max_write: int | None = None,
        record: bool = True,
    ) -> None:
        self.root = Path(root)
        self.before = before
        self.max_write = max_write
        self.record = record
        self.calls = 0
        self.ops: list[tuple[Any, ...]] = []
        self.log: list[tuple[str, str]] = []  # (op, path relative to root) per call
        self._lock = threading.RLock()
        self._ino = [ROOT_INO]
        self.base = Snapshot.of(self.root, self._ino) if self.root.exists() else Snapshot()
        self.live = self.base.copy()  # the model, kept in step with the real tree
        self._fd_ino: dict[int, int] = {}
        self._fd_pos: dict[int, int] = {}
        self._fd_path: dict[int, str] = {}

    # -- bookkeeping -------------------------------------------------------------
    def _rel(self, path: Any) -> str:
        try:
            return str(Path(path).relative_to(self.root))
        except ValueError:
            return f"<outside>/{Path(path).name}"

    def _call(self, op: str, path: Any) -> None:
        with self._lock:
            self.calls += 1
            index = self.calls
            self.log.append((op, self._rel(path)))
        if self.before is not None:
            self.before(index, op, self._rel(path))

    def _lookup(self, path: Path) -> tuple[int, str] | None:
        """(parent inode, name) of ``path`` in the live model, or None outside root."""
        try:
            parts = Path(path).relative_to(self.root).parts
        except ValueError:
            return None
        if not parts:
            return None
        ino = ROOT_INO
        for part in parts[:-1]:
            nxt = self.live.dirs.get(ino, {}).get(part)
            if nxt is None or nxt not in self.live.dirs:
                return None
            ino = nxt
        return ino, parts[-1]

    def _ino_of(self, path: Path) -> int | None:
        if Path(path) == self.root:
            return ROOT_INO
        loc = self._lookup(path)
        if loc is None:
            return None
        return self.live.dirs.get(loc[0], {}).get(loc[1])

    def _new_ino(self) -> int:
        self._ino[0] += 1
        return self._ino[0]

    def _op(self, *op: Any) -> None:
        if self.record:
            self.ops.append(op)

    def mark(self, *what: Any) -> None:
        """Record a test marker (``("dispatch", step, ver)``, ``("ack", step, ver)``)."""
        with self._lock:
            self._op("mark", *what)

    # -- files -------------------------------------------------------------------
    def create(self, path: Path) -> int:
        self._call("create", path)
        with self._lock:
            fd = super().create(path)
            self._fd_path[fd] = str(path)
            loc = self._lookup(path)
            if loc is not None:
                ino = self._new_ino()
                self.live.dirs[loc[0]][loc[1]] = ino
                self.live.files[ino] = bytearray()
                self._fd_ino[fd] = ino
                self._fd_pos[fd] = 0
                self._op("create", loc[0], loc[1], ino)
            return fd

    def write(self, fd: int, data: memoryview) -> int:
        self._call("write", self._fd_path.get(fd, f"fd{fd}"))
        if self.max_write is not None:
            data = data[: self.max_write]
        n = super().write(fd, data)
        with self._lock:
            ino = self._fd_ino.get(fd)
            if ino is not None and n > 0:
                pos = self._fd_pos[fd]
                chunk = bytes(data[:n])
                buf = self.live.files[ino]
                buf[pos : pos + n] = chunk
                self._fd_pos[fd] = pos + n
                self._op("write", ino, pos, chunk)
        return n

    def fsync(self, fd: int) -> None:
        self._call("fsync", self._fd_path.get(fd, f"fd{fd}"))
        super().fsync(fd)
        with self._lock:
            ino = self._fd_ino.get(fd)
            if ino is not None:
                self._op("fsync", ino)

    def close(self, fd: int) -> None:
        self._call("close", self._fd_path.get(fd, f"fd{fd}"))
        with self._lock:
            self._fd_ino.pop(fd, None)
            self._fd_pos.pop(fd, None)
            self._fd_path.pop(fd, None)
        super().close(fd)

    # -- directories -------------------------------------------------------------
    def makedirs(self, path: Path) -> None:
        self._call("makedirs", path)
        with self._lock:
            missing = []
            p = Path(path)
            while not p.exists():
                missing.append(p)
                p = p.parent
            super().makedirs(path)
            for p in reversed(missing):
                loc = self._lookup(p)
                if loc is not None:
                    ino = self._new_ino()
                    self.live.dirs[loc[0]][loc[1]] = ino
                    self.live.dirs[ino] = {}
                    self._op("mkdir", loc[0], loc[1], ino)

    def mkdir(self, path: Path) -> None:
        self._call("mkdir", path)
        with self._lock:
            super().mkdir(path)
            loc = self._lookup(path)
            if loc is not None:
                ino = self._new_ino()
                self.live.dirs[loc[0]][loc[1]] = ino
                self.live.dirs[ino] = {}
                self._op("mkdir", loc[0], loc[1], ino)

    def fsync_dir(self, path: Path) -> None:
        self._call("fsync_dir", path)
        super().fsync_dir(path)
        with self._lock:
            ino = self._ino_of(path)
            if ino is not None:
                self._op("fsync_dir", ino)

    def _move(self, op: str, src: Path, dst: Path, real: Callable[[Path, Path], None]) -> None:
        self._call(op, dst)
        with self._lock:
            real(src, dst)
            s, d = self._lookup(src), self._lookup(dst)
            if s is not None and d is not None:
                ino = self.live.dirs[s[0]].pop(s[1])
                self.live.dirs[d[0]][d[1]] = ino
                self._op("rename", s[0], s[1], d[0], d[1])

    def rename(self, src: Path, dst: Path) -> None:
        self._move("rename", src, dst, super().rename)

    def replace(self, src: Path, dst: Path) -> None:
        self._move("replace", src, dst, super().replace)

    def exchange(self, a: Path, b: Path) -> None:
        self._call("exchange", b)
        with self._lock:
            super().exchange(a, b)
            la, lb = self._lookup(a), self._lookup(b)
            if la is not None and lb is not None:
                da, db = self.live.dirs[la[0]], self.live.dirs[lb[0]]
                da[la[1]], db[lb[1]] = db[lb[1]], da[la[1]]
                self._op("exchange", la[0], la[1], lb[0], lb[1])

    def link(self, src: Path, dst: Path) -> None:
        self._call("link", dst)
        with self._lock:
            super().link(src, dst)
            ino, loc = self._ino_of(src), self._lookup(dst)
            if ino is not None and loc is not None:
                self.live.dirs[loc[0]][loc[1]] = ino
                self._op("link", loc[0], loc[1], ino)

    def unlink(self, path: Path) -> None:
        self._call("unlink", path)
        with self._lock:
            super().unlink(path)
            self._forget(path, "unlink")

    def _forget(self, path: Path, op: str) -> None:
        loc = self._lookup(path)
        if loc is not None:
            self.live.dirs[loc[0]].pop(loc[1], None)
            self._op(op, loc[0], loc[1])

    def remove_tree(self, path: Path) -> None:
        """Delete bottom-up, one numbered call per file and directory."""
        for dirpath, dirnames, filenames in os.walk(path, topdown=False):
            for name in sorted(filenames):
                p = Path(dirpath) / name
                self._call("unlink", p)
                with self._lock:
                    os.unlink(p)
                    self._forget(p, "unlink")
            for name in sorted(dirnames):
                p = Path(dirpath) / name
                self._call("rmdir", p)
                with self._lock:
                    os.rmdir(p)
                    self._forget(p, "rmdir")
        self._call("rmdir", path)
        with self._lock:
            os.rmdir(path)
            self._forget(Path(path), "rmdir")
