"""Fault-injecting file systems for tests (a shim over asyncsave's I/O layer)."""

from __future__ import annotations

import errno
import os
import signal
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from asyncsave import LocalFileSystem

PROCEED = object()  # an action returning this lets the real call go ahead

OPS = (
    "create",
    "write",
    "fsync",
    "close",
    "mkdir",
    "fsync_dir",
    "rename",
    "replace",
    "exchange",
    "remove_tree",
    "unlink",
)


class FaultyFS(LocalFileSystem):
    """Runs ``action`` instead of the ``n``-th call (1-based) of ``op`` whose path
    satisfies ``where``; every other call goes through.

    Actions: ``raise_errno(code)``, ``block(event)`` (waits until the event is set,
    like a hung NFS write, then fails), ``pause(event)`` (waits, then the call goes
    ahead), ``kill()`` (SIGKILL this process, for crash tests).
    """

    def __init__(
        self,
        op: str,
        action: Callable[[], Any],
        *,
        n: int = 1,
        where: Callable[[str], bool] = lambda p: True,
    ) -> None:
        assert op in OPS, op
        self.op, self.action, self.n, self.where = op, action, n, where
        self.seen = 0
        self.fired = threading.Event()
        self._fd_paths: dict[int, str] = {}

    def _hit(self, op: str, path: Any) -> bool:
        if op != self.op or not self.where(str(path)):
            return False
        self.seen += 1
        if self.seen == self.n:
            self.fired.set()
            return True
        return False

    def create(self, path: Path) -> int:
        if self._hit("create", path):
            r = self.action()
            if r is not PROCEED:
                return r
        fd = super().create(path)
        self._fd_paths[fd] = str(path)
        return fd

    def open_direct(self, path: Path) -> int | None:
        fd = super().open_direct(path)
        if fd is not None:
            self._fd_paths[fd] = str(path)
        return fd

    def write(self, fd: int, data: memoryview) -> int:
        if self._hit("write", self._fd_paths.get(fd, "")):
            r = self.action()
            if r is not PROCEED:
                return r
        return super().write(fd, data)

    def fsync(self, fd: int) -> None:
        if self._hit("fsync", self._fd_paths.get(fd, "")):
            r = self.action()
            if r is not PROCEED:
                return r
        super().fsync(fd)

    def close(self, fd: int) -> None:
        path = self._fd_paths.pop(fd, "")
        if self._hit("close", path):
            r = self.action()
            if r is not PROCEED:
                os.close(fd)
                return r
        super().close(fd)

    def mkdir(self, path: Path) -> None:
        if self._hit("mkdir", path):
            r = self.action()
            if r is not PROCEED:
                return r
        super().mkdir(path)

    def fsync_dir(self, path: Path) -> None:
        if self._hit("fsync_dir", path):
            r = self.action()
            if r is not PROCEED:
                return r
        super().fsync_dir(path)

    def rename(self, src: Path, dst: Path) -> None:
        if self._hit("rename", dst):
            r = self.action()
            if r is not PROCEED:
                return r
        super().rename(src, dst)

    def replace(self, src: Path, dst: Path) -> None:
        if self._hit("replace", dst):
            r = self.action()
            if r is not PROCEED:
                return r
        super().replace(src, dst)


def raise_errno(code: int) -> Callable[[], Any]:
    def action() -> Any:
        raise OSError(code, os.strerror(code))

    return action


def block(event: threading.Event) -> Callable[[], Any]:
    def action() -> Any:
        event.wait()
        raise OSError(errno.EIO, "released after blocking")

    return action


def pause(event: threading.Event, timeout_s: float = 60.0) -> Callable[[], Any]:
    """Wait until ``event`` is set (or ``timeout_s``), then let the call go ahead."""

    def action() -> Any:
        event.wait(timeout_s)
        return PROCEED

    return action


def kill() -> Callable[[], Any]:
    def action() -> Any:
        os.kill(os.getpid(), signal.SIGKILL)

    return action
