"""The trainer's end of the memory tier's saver process: the process, its socket,
and the requests on it. One way to talk to the saver, used by
:class:`~asyncsave._memtier.MemoryCheckpointer`.

- **Nothing blocks the event loop.** Messages are posted to an outbox and sent by
  one task in a worker thread (a send of a 100,000-tensor save's tree, megabytes,
  waits for the saver to read it); the reader is another task, receiving in a
  worker thread. A posted message is sent whole and in order whatever happens to
  the task that posted it.
- **Every answer is matched to its question.** A request (``wait``, ``load``,
  ``slots``, ``close``) carries an id the saver echoes; an answer whose asker gave
  up (cancelled, timed out) is dropped.
- **Every wait is bounded.** :meth:`SaverLink.ask` takes a deadline; a saver that
  does not answer in time is a :class:`~asyncsave.CheckpointTimeoutError`, a
  dead one a :class:`~asyncsave.SaverDiedError` (its pid and how it ended).
- **Errors cross whole.** :func:`wire_error` sends an exception with its cause
  (each made picklable); :func:`unwire` rebuilds ``__cause__``.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import pickle
import re
import signal
import socket
import subprocess
import sys
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import anyio
import anyio.abc

from ._errors import CheckpointTimeoutError, SaverDiedError
from ._paths import LOCK_NAME

__all__ = [
    "SaverLink",
    "beacon_path",
    "check_home",
    "lock_beacon",
    "orphaned_saver",
    "other_run",
    "unwire",
    "wire_error",
]

logger = logging.getLogger("asyncsave")

#: The saver's answers to requests: ``(kind, request id, payload)``.
ANSWERS = frozenset({"slots", "waited", "loaded", "closed"})


def _picklable(exc: BaseException) -> BaseException:
    try:
        pickle.loads(pickle.dumps(exc))
        return exc
    except Exception:
        return RuntimeError(repr(exc))


def wire_error(exc: BaseException) -> tuple[str, BaseException, BaseException | None]:
    """``exc`` and its ``__cause__`` (or context), each one picklable (else a
    ``RuntimeError`` naming it), for :func:`unwire` on the other side."""
    cause = exc.__cause__ or exc.__context__
    return ("error", _picklable(exc), None if cause is None else _picklable(cause))


def unwire(value: Any) -> Any:
    """The exception :func:`wire_error` sent, its cause restored; any other
    value as it is."""
    if isinstance(value, tuple) and len(value) == 3 and value[0] == "error":
        exc: BaseException = value[1]
        if value[2] is not None and exc.__cause__ is None:
            exc.__cause__ = value[2]
        return exc
    return value


class SaverLink:
    """One saver process and the socket to it.

    :param root: the checkpointer's root (named in errors).
    :param on_message: called on the event loop's thread with each message that
        is not the answer to a request.
    :param on_lost: called once with the :class:`SaverDiedError` when the saver
        is gone (the socket's end, or a message that cannot be read).
    """

    def __init__(
        self,
        root: Any,
        on_message: Callable[[tuple[Any, ...]], None],
        on_lost: Callable[[SaverDiedError], None],
    ) -> None:
        self.root = root
        self.on_message = on_message
        self.on_lost = on_lost
        self.proc: subprocess.Popen[bytes] | None = None
        self.conn: Connection | None = None
        self.pid: int | None = None
        self.lost: SaverDiedError | None = None
        self.closing = False
        self._ids = itertools.count()
        self._answers: dict[int, Any] = {}
        self._waiting: dict[int, anyio.Event] = {}
        self._tasks: anyio.abc.TaskGroup | None = None
        self._scopes: list[anyio.CancelScope] = []
        self._outbox_in, self._outbox = anyio.create_memory_object_stream[Any](float("inf"))
        self._spawned = anyio.Event()

    # -- process ----------------------------------------------------------------
    def spawn(self, inherit: Sequence[int] = ()) -> None:
        """Start ``python -m asyncsave._saverproc FD`` with one end of a socket
        pair, and the descriptors ``inherit`` (locks it takes over), under the
        same numbers (blocking: call it from a worker thread). Its own session:
        a Ctrl-C at the trainer's terminal is the trainer's alone."""
        mine, theirs = socket.socketpair()
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "asyncsave._saverproc", str(theirs.fileno())],
                pass_fds=[theirs.fileno(), *inherit],
                start_new_session=True,
            )
        finally:
            theirs.close()
        self.conn = Connection(mine.detach())
        self.pid = self.proc.pid

    async def start(self, hello: Any, inherit: Sequence[int] = ()) -> None:
        """:meth:`spawn` the saver (in a worker thread) and send it ``hello``
        first; the reader and the sender (:meth:`run`, which may come first)
        start on the socket then, the messages posted meanwhile after ``hello``.
        Shielded from cancellation (a few ms): a saver is never left started
        without its hello."""
        with anyio.CancelScope(shield=True):
            await anyio.to_thread.run_sync(self.spawn, inherit)
            assert self.conn is not None
            self.conn.send(hello)
            self._spawned.set()

    async def died(self, when: str) -> SaverDiedError:
        """The error that names how the saver ended (waited for in a worker thread)."""
        code = None
        if self.proc is not None:
            proc = self.proc
            with contextlib.suppress(subprocess.TimeoutExpired):
                code = await anyio.to_thread.run_sync(lambda: proc.wait(timeout=5))
        how = (
            "is still running but closed its socket"
            if code is None
            else f"was killed by {signal.Signals(-code).name}"
            if code < 0
            else f"exited with code {code}"
        )
        return SaverDiedError(
            f"the memory tier's saver process (pid {self.pid}) {how} {when}; saves it had not "
            f"committed are lost, committed ones stay loadable under {self.root}",
            path=self.root,
        )

    # -- running ------------------------------------------------------------------
    async def run(self) -> None:
        """Start the reader and the sender (from the task that entered the
        checkpointer); :meth:`stop` ends them."""
        self._tasks = anyio.create_task_group()
        await self._tasks.__aenter__()
        self._tasks.start_soon(self._read)
        self._tasks.start_soon(self._send)

    def start_soon(self, func: Callable[[], Any]) -> None:
        """Run ``func()`` in the link's task group, shielded from the
        cancellation of the task that entered the checkpointer (a save handed
        over behind ``save()`` finishes; ``end_tasks()`` ends it)."""
        assert self._tasks is not None

        async def shielded() -> None:
            with anyio.CancelScope(shield=True) as scope:
                self._scopes.append(scope)
                await func()

        self._tasks.start_soon(shielded)

    def post(self, *msg: Any, sent: anyio.Event | None = None) -> None:
        """Queue ``msg`` for the saver; it is sent whole, in order. ``sent`` is
        set once the whole message is in the saver's socket (what the kernel
        delivers even if this process dies the next instant)."""
        if self.lost is not None:
            raise self.lost
        self._outbox_in.send_nowait((msg, sent))

    async def deliver(self, *msg: Any, timeout_s: float, what: str) -> None:
        """:meth:`post` ``msg`` and wait until it is in the saver's socket.

        :raises SaverDiedError: the saver is gone.
        :raises CheckpointTimeoutError: not sent within ``timeout_s`` (the
            saver stopped reading).
        """
        sent = anyio.Event()
        self.post(*msg, sent=sent)
        with anyio.move_on_after(timeout_s):
            while not sent.is_set():
                if self.lost is not None:
                    raise self.lost
                with anyio.move_on_after(0.05):
                    await sent.wait()
            return
        raise CheckpointTimeoutError(
            f"the memory tier's saver (pid {self.pid}) did not take {what} within "
            f"save_timeout_s={timeout_s}",
            path=self.root,
        )

    async def ask(self, kind: str, *args: Any, timeout_s: float, what: str) -> Any:
        """Send the request ``(kind, id, *args)`` and return the saver's answer
        (unwired: an exception is returned, not raised).

        :raises SaverDiedError: the saver is gone.
        :raises CheckpointTimeoutError: no answer within ``timeout_s`` (the
            checkpointer's ``save_timeout_s``).
        """
        rid = next(self._ids)
        event = self._waiting[rid] = anyio.Event()
        try:
            self.post(kind, rid, *args)
            with anyio.move_on_after(timeout_s):
                await event.wait()
            if self.lost is not None and rid not in self._answers:
                raise self.lost
            if rid not in self._answers:
                raise CheckpointTimeoutError(
                    f"the memory tier's saver (pid {self.pid}) did not answer {what} within "
                    f"save_timeout_s={timeout_s}",
                    path=self.root,
                )
            return unwire(self._answers.pop(rid))
        finally:
            self._waiting.pop(rid, None)
            self._answers.pop(rid, None)

    async def _send(self) -> None:
        # Shielded: a cancellation of the task that entered the checkpointer must
        # not end the link before close has used it; end_tasks() ends it.
        with anyio.CancelScope(shield=True) as scope:
            self._scopes.append(scope)
            await self._send_all()

    async def _send_all(self) -> None:
        await self._spawned.wait()
        conn = self.conn
        assert conn is not None
        async with self._outbox:
            async for msg, sent in self._outbox:
                try:
                    await anyio.to_thread.run_sync(conn.send, msg, abandon_on_cancel=True)
                except OSError:
                    self._lose(await self.died("before a message reached it"))
                    return
                if sent is not None:
                    sent.set()

    async def _read(self) -> None:
        with anyio.CancelScope(shield=True) as scope:  # as _send
            self._scopes.append(scope)
            await self._read_all()

    async def _read_all(self) -> None:
        await self._spawned.wait()
        conn = self.conn
        assert conn is not None
        while True:
            try:
                msg = await anyio.to_thread.run_sync(conn.recv, abandon_on_cancel=True)
            except (EOFError, OSError):
                if not self.closing:
                    self._lose(await self.died("during training"))
                return
            try:
                if msg[0] in ANSWERS:
                    if msg[1] in self._waiting:
                        self._answers[msg[1]] = msg[2]
                        self._waiting[msg[1]].set()
                else:
                    self.on_message(msg)
            except Exception as exc:  # a saver of another version, say: never a hang
                logger.exception("asyncsave: unreadable message from the memory tier's saver")
                self._lose(
                    SaverDiedError(
                        f"the memory tier's saver sent {msg[:1]!r}, unreadable: {exc!r}",
                        path=self.root,
                    )
                )
                return

    def _lose(self, error: SaverDiedError) -> None:
        if self.lost is None:
            self.lost = error
            for event in self._waiting.values():
                event.set()
            self.on_lost(error)

    async def stop_process(self, *, wait_s: float) -> None:
        """Close the socket and wait up to ``wait_s`` seconds for the process
        (which, told to close or seeing the socket's end, finishes what it holds
        and exits: past ``wait_s`` it is left to do so). Call it shielded."""
        self.closing = True
        if self.conn is not None:
            self.conn.close()
            self.conn = None
        proc = self.proc
        if proc is None or wait_s <= 0:
            return
        try:
            await anyio.to_thread.run_sync(lambda: proc.wait(timeout=wait_s))
        except subprocess.TimeoutExpired:
            logger.warning(
                "the memory tier's saver (pid %d) is still finishing after %.0f s; it exits on "
                "its own once done",
                proc.pid,
                wait_s,
            )

    async def end_tasks(self) -> None:
        """End the reader and the sender (from the task that entered the
        checkpointer, after :meth:`stop_process`; a cancellation of that task
        propagates from here, unchanged)."""
        tasks, self._tasks = self._tasks, None
        for scope in self._scopes:
            scope.cancel()
        if tasks is not None:
            tasks.cancel_scope.cancel()
            await tasks.__aexit__(None, None, None)

    def kill(self) -> None:
        """SIGKILL the saver (a start that failed half-way)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()


def beacon_path(home: Path, rank: int) -> Path:
    """The file every saver of ``rank`` holds a shared ``flock`` on for its whole
    life (the kernel drops it when the process ends, however it ends): a trainer
    that can lock it exclusively knows that no saver of that rank, a dead
    trainer's included, is still committing into the memory tier."""
    return home / f"saver-r{rank}.lock"


def lock_beacon(home: Path, rank: int, *, exclusive: bool) -> int | None:
    """A descriptor holding ``rank``'s beacon (:func:`beacon_path`) locked
    shared, or exclusively without waiting (no saver of the rank alive);
    ``None`` when it cannot be had (held by a saver, or no ``flock`` here)."""
    import fcntl

    try:
        fd = os.open(beacon_path(home, rank), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB if exclusive else fcntl.LOCK_SH)
    except OSError:
        os.close(fd)
        return None
    return fd


def other_run(home: Path, rank: int, tier: Path, lineage: str) -> tuple[bool, str | None]:
    """Whether ``tier`` (``rank``'s memory tier under ``home``) holds anything
    of another run of the root than ``lineage``, and the lineage it was last
    recorded with (``None``: none). Its lock file alone is nothing."""
    try:
        old: str | None = (home / f"lineage-r{rank}").read_text().strip()
    except FileNotFoundError:
        old = None
    if old == lineage:
        return False, old
    try:
        held = any(p.name != LOCK_NAME for p in tier.iterdir())
    except FileNotFoundError:
        held = False
    return held, old


def orphaned_saver(holder: str) -> bool:
    """Whether the lock holder named in ``holder`` ("pid 4242 on host node7") is
    a saver process on this host whose trainer is gone (Linux ``/proc``)."""
    match = re.search(r"pid (\d+) on host (\S+)", holder)
    if match is None or match.group(2).rstrip(")") != socket.gethostname():
        return False
    pid = int(match.group(1))
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        ppid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return False
    if b"asyncsave._saverproc" not in cmdline:
        return False
    try:
        parent = Path(f"/proc/{ppid}/cmdline").read_bytes()
    except OSError:
        return True  # its trainer is gone
    return ppid == 1 or b"asyncsave._saverproc" in parent or not parent


def check_home(home: Path) -> None:
    """Make ``home`` (mode 0700) and refuse it unless it is a real directory
    owned by this user with no access for others: ``/dev/shm`` is writable by
    everyone, and the name is predictable, so another user could plant a
    symlink or a directory there to read the snapshots or plant a checkpoint.

    :raises PermissionError: ``home`` is a symlink, another user's, or open to others.
    """
    import os
    import stat

    home.mkdir(parents=True, exist_ok=True, mode=0o700)
    st = os.lstat(home)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
        raise PermissionError(
            f"the memory tier's directory {home} is not a private directory of this user "
            f"(a symlink, another user's, or mode {oct(st.st_mode & 0o777)}): refusing to keep "
            "snapshots there; remove it or pass MemoryTier(shm_dir=...)"
        )
