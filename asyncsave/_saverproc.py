"""The saver process of the memory tier (``python -m asyncsave._saverproc FD``).

Started by a trainer's :class:`~asyncsave._memtier.MemoryCheckpointer`, one per
rank, with one end of a socket pair as ``FD``. It owns everything that must
outlive the trainer: the slot files the trainer stages into, an ordinary
:class:`~asyncsave.Checkpointer` whose root is the memory tier (a tmpfs
directory) with the trainer's root as its persistent :class:`~asyncsave.Tier`,
and, on several ranks, a gloo group of the savers alone (rendezvous through a
``TCPStore`` that saver 0 serves), so that savers agree commits without any
trainer.

The loop takes the trainer's messages in order (``asyncsave._memtier`` lists
them). A save is answered once the saver's own ``save()`` returned (lazy: the
state planned and refused or accepted, the slot being copied); its slot is
given back once staged, its commit and persistence reported as they happen.
The end of the socket without a ``close`` message means the trainer died: every
save already received is still committed (and the newest persisted), then the
process exits. A ``close`` flushes, removes the memory tier (nobody will resume
from it: the newest save is persisted) and exits.

Every message that can fail carries the failure as a picklable exception.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import shutil
import socket
import sys
import threading
import time
import warnings
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import anyio

from ._saverlink import beacon_path, lock_beacon, orphaned_saver, other_run, wire_error

logger = logging.getLogger("asyncsave")

#: Environment variable of the kill matrices (``tests/test_memory_tier.py``):
#: ``PHASE:DIR`` stops the saver's first save at ``PHASE`` (one of
#: ``asyncsave.testing.PHASES``), creates ``DIR/reached`` when it stops there,
#: and lets it go on once ``DIR/release`` exists.
PAUSE_ENV = "ASYNCSAVE_SAVER_PAUSE"


class _Wire:
    """The socket to the trainer: sends from the event loop's thread only; a send
    to a dead trainer is dropped (``gone``)."""

    def __init__(self, conn: Connection) -> None:
        self.conn = conn
        self.gone = False

    def send(self, *msg: Any) -> None:
        if self.gone:
            return
        try:
            self.conn.send(msg)
        except OSError:
            self.gone = True


@contextlib.contextmanager
def _pause_from_env() -> Any:
    spec = os.environ.get(PAUSE_ENV)
    if not spec:
        yield None
        return
    from .testing import pause_at

    phase, where = spec.split(":", 1)
    folder = Path(where)
    with pause_at(phase, timeout_s=600) as p:

        def watch() -> None:
            if p.reached.wait(600):
                (folder / "reached").touch()
                while not (folder / "release").exists() and not p.released:
                    time.sleep(0.02)
                p.release()

        threading.Thread(target=watch, daemon=True).start()
        yield p


def _group(hello: dict[str, Any], wire: _Wire, conn: Connection) -> None:
    """Join the savers' own gloo group (several ranks): saver 0 serves a
    ``TCPStore`` on a free port and tells its trainer, which tells the others."""
    import datetime

    import torch.distributed as dist

    rank, world = hello["rank"], hello["world_size"]
    timeout = datetime.timedelta(seconds=hello["dist_timeout_s"])
    if rank == 0:
        store = dist.TCPStore("0.0.0.0", 0, world, True, timeout=timeout, wait_for_workers=False)
        wire.send("port", store.port)
    else:
        msg = conn.recv()
        assert msg[0] == "store", msg
        store = dist.TCPStore(msg[1], msg[2], world, False, timeout=timeout)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timeout)


async def _open(hello: dict[str, Any], pause: Any) -> Any:
    """The memory tier's checkpointer, entered; waits while the saver of a dead
    trainer still holds the root (``RootInUseError``) up to ``start_timeout_s``."""
    from ._engine import Checkpointer
    from ._errors import RootInUseError

    options = hello["options"]
    if pause is not None and pause.filesystem is not None:
        import dataclasses

        options = dataclasses.replace(options, filesystem=pause.filesystem)
    deadline = time.monotonic() + hello["start_timeout_s"]
    inherited = (hello.get("inherited") or {}).get("tier_lock")
    while True:
        ckpt = Checkpointer(hello["memory_root"], options)
        if inherited is not None:
            # The trainer's lock, held for this saver until now: let go of it
            # for the checkpointer's own (the same file, taken at once below).
            _drop_inherited(inherited)
            inherited = None
        try:
            await ckpt.__aenter__()
            return ckpt
        except RootInUseError as exc:
            # The saver of a trainer that died finishes its commits first; any
            # other holder (a live trainer's saver, a plain checkpointer) is refused now.
            if time.monotonic() > deadline or not orphaned_saver(str(exc)):
                raise
            await anyio.sleep(0.2)


def _drop_inherited(fd: int) -> None:
    import fcntl

    with contextlib.suppress(OSError):
        fcntl.flock(fd, fcntl.LOCK_UN)
    with contextlib.suppress(OSError):
        os.close(fd)


def _set_aside_other_runs(hello: dict[str, Any]) -> None:
    """Move this rank's memory tier aside if it belongs to another run of the
    root than ``hello["lineage"]`` (the root was removed or replaced since): it
    must never be resumed from, nor copied into the new run's root. Then record
    the lineage. Nothing is deleted (a reboot clears ``/dev/shm``)."""
    home, rank = Path(hello["memory_home"]), hello["rank"]
    mine = Path(hello["memory_root"])
    if hello["world_size"] > 1:
        mine = mine / f"rank{rank}"
    marker = home / f"lineage-r{rank}"
    other, old = other_run(home, rank, mine, hello["lineage"])
    if other:
        aside = home / f"other-run-r{rank}-{old or 'unknown'}-{int(time.time())}"
        os.rename(mine, aside)
        logger.warning(
            "the memory tier %s belongs to another run of this root (the root was removed or "
            "replaced): moved aside to %s, not resumed from; remove it to free the memory",
            mine,
            aside,
        )
    tmp = marker.with_name(marker.name + ".tmp")
    tmp.write_text(hello["lineage"])
    os.replace(tmp, marker)


class _Server:
    def __init__(self, wire: _Wire, conn: Connection, ckpt: Any, slot_dir: Path) -> None:
        self.wire = wire
        self.conn = conn
        self.ckpt = ckpt
        self.slot_dir = slot_dir
        self.slots: list[Any] = []
        self.refs: Any = None  # the layout of the last save message (sent once per layout)
        self.spans: Any = None

    def make_slots(self, count: int, capacity: int) -> list[str]:
        from ._slots import Slot

        for s in self.slots:
            s.close()
        self.slots = []
        for old in self.slot_dir.glob("slot*"):
            old.unlink()
        paths = []
        for i in range(count):
            path = self.slot_dir / f"slot{i}-{capacity}"
            Slot.create(path, capacity)
            self.slots.append(Slot(path, capacity))
            paths.append(str(path))
        return paths

    async def save(self, tg: Any, msg: tuple[Any, ...]) -> None:
        from ._slots import unpack

        _, seq, step, index, tree, numbers, refs, spans, overwrite, training_info, early = msg
        if refs is None:  # the layout of the last save message
            refs, spans = self.refs, self.spans
        self.refs, self.spans = refs, spans
        # An early save: the trainer's save() returned once this message was in
        # the socket; its admission (or failure) follows.
        try:
            state = unpack(tree, numbers, refs, spans, self.slots[index])
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                handle = await self.ckpt.save(
                    step, state, overwrite=overwrite, training_info=training_info, lazy=True
                )
        except Exception as exc:
            self.wire.send("failed" if early else "refused", seq, wire_error(exc))
            self.wire.send("free", index)
            return
        del state
        notes = [(w.category.__name__, str(w.message)) for w in caught]
        answer = "admitted" if early else "accepted"
        self.wire.send(answer, seq, notes, handle.skipped, handle.due_to_persist)
        if handle.skipped:  # step 0 without save_step_zero: nothing to follow
            self.wire.send("free", index)
        else:
            tg.start_soon(self._follow, seq, index, handle)

    async def _follow(self, seq: int, index: int, handle: Any) -> None:
        with contextlib.suppress(Exception):
            await handle.staged()
        self.wire.send("free", index)
        try:
            info = await handle
        except Exception as exc:
            self.wire.send("failed", seq, wire_error(exc))
            return
        self.wire.send("committed", seq, info)
        if handle.due_to_persist:
            try:
                pinfo = await handle.persisted()
            except Exception as exc:
                self.wire.send("persist_failed", seq, wire_error(exc))
            else:
                self.wire.send("persisted", seq, pinfo)

    async def wait(self, rid: int) -> None:
        try:
            await self.ckpt.wait()
        except Exception as exc:
            self.wire.send("waited", rid, wire_error(exc))
        else:
            self.wire.send("waited", rid, None)

    async def load(self, rid: int, fallback: bool, required: list[Any]) -> None:
        """Resume as the checkpointer does (nearest tier first, every byte
        verified, agreed by every rank, damaged copies moved aside), and tell the
        trainer which checkpoint to read: the bytes it reads are the ones just
        verified (committed files are never rewritten)."""
        try:
            restored = await self.ckpt.load_latest(None, fallback=fallback, required=required)
        except Exception as exc:
            self.wire.send("loaded", rid, wire_error(exc))
            return
        if restored is None:
            self.wire.send("loaded", rid, None)
            return
        info = restored.info
        del restored
        # A part of the memory tier is a checkpoint of one rank (its own); a
        # persistent checkpoint of several ranks is read by rank.
        whole = Path(info.path).is_relative_to(self.ckpt.root)
        self.wire.send("loaded", rid, {"info": info, "whole": whole})

    async def serve(self) -> int | None:
        """Take messages until ``close`` (its request id) or the trainer's end
        (``None``). Saves are taken in order; ``wait`` and ``load`` run as tasks,
        so that the socket is read meanwhile (the trainer's sends never block on
        a saver busy answering one of them)."""
        async with anyio.create_task_group() as tg:
            while True:
                try:
                    msg = await anyio.to_thread.run_sync(self.conn.recv, abandon_on_cancel=True)
                except (EOFError, OSError):
                    self.wire.gone = True
                    return None
                kind = msg[0]
                if kind == "save":
                    await self.save(tg, msg)
                elif kind == "slots":
                    try:
                        paths = await anyio.to_thread.run_sync(self.make_slots, msg[2], msg[3])
                        self.wire.send("slots", msg[1], paths)
                    except OSError as exc:
                        self.wire.send("slots", msg[1], wire_error(exc))
                elif kind == "wait":
                    tg.start_soon(self.wait, msg[1])
                elif kind == "load":
                    tg.start_soon(self.load, *msg[1:])
                elif kind == "close":
                    return int(msg[1])
                else:  # a trainer of another version: say so, go on
                    logger.error("asyncsave saver: unknown message %r", kind)
        return None  # not reached: the loop returns


def _hold_beacon(hello: dict[str, Any]) -> int | None:
    """This saver's beacon (``beacon_path``): the descriptor inherited from the
    trainer, or, from an older trainer, one taken now. Held until the process
    ends, however it ends."""

    inherited = (hello.get("inherited") or {}).get("beacon")
    if inherited is not None:
        return int(inherited)
    fd = lock_beacon(Path(hello["memory_home"]), hello["rank"], exclusive=False)
    if fd is None:  # no flock here: trainers then always wait for this saver
        logger.warning("asyncsave saver: cannot hold its beacon in %s", hello["memory_home"])
    return fd


def _let_go_of_beacon(hello: dict[str, Any], fd: int | None) -> None:
    """After a clean close: remove the beacon file unless another saver of the
    rank holds it too (a second checkpointer's, waiting): the upgrade to an
    exclusive lock succeeds only if this process is its only holder."""
    import fcntl

    if fd is None:
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return  # another saver holds it: it stays, and so does the memory directory
    with contextlib.suppress(OSError):
        beacon_path(Path(hello["memory_home"]), hello["rank"]).unlink()


async def _main(conn: Connection) -> int:
    from ._engine import persist_newest
    from ._resume import protect_resumed

    wire = _Wire(conn)
    hello = conn.recv()
    beacon = _hold_beacon(hello)  # released by the kernel when this process ends
    # The step the trainer resumed from by itself, before this saver started.
    resumed = hello.get("resumed")
    if hello["world_size"] > 1:
        _group(hello, wire, conn)
    slot_dir = Path(hello["slot_dir"])
    await anyio.to_thread.run_sync(functools.partial(slot_dir.mkdir, parents=True, exist_ok=True))
    with _pause_from_env() as pause:
        try:
            await anyio.to_thread.run_sync(_set_aside_other_runs, hello)
            ckpt = await _open(hello, pause)
        except Exception as exc:
            wire.send("ready", wire_error(exc))
            return 1
        if resumed is not None:
            protect_resumed(ckpt._saver, resumed[0], local=resumed[1] == "local")
        server = _Server(wire, conn, ckpt, slot_dir)
        wire.send("ready", {"pid": os.getpid(), "memory_root": str(ckpt.root)})
        close_id: int | None = None
        error: BaseException | None = None
        try:
            close_id = await server.serve()
            closing = close_id is not None
            if not closing:
                logger.warning(
                    "asyncsave saver %d: the trainer is gone; committing the saves it "
                    "handed over, then exiting",
                    os.getpid(),
                )
            with contextlib.suppress(Exception):
                await ckpt.wait()  # a failed save fails close too, below
            await persist_newest(ckpt)
        except BaseException as exc:
            error = exc
        try:
            await ckpt.aclose()
        except BaseException as exc:
            error = error or exc
        for s in server.slots:
            s.close()
        closing = close_id is not None
        tier = ckpt.root if closing and error is None else None
        await anyio.to_thread.run_sync(_tidy, hello, slot_dir, tier, beacon)
        if closing:
            wire.send("closed", close_id, None if error is None else wire_error(error))
        elif error is not None:  # nobody else will hear of it
            logger.error(
                "the saves handed over by the dead trainer did not all end well: %r", error
            )
    if hello["world_size"] > 1:
        import torch.distributed as dist

        with contextlib.suppress(Exception):
            dist.destroy_process_group()
    return 0 if error is None else 1


def _tidy(hello: dict[str, Any], slot_dir: Path, tier: Path | None, beacon: int | None) -> None:
    """Remove the slots (their snapshots are committed, or failed: nobody needs
    them) and, after a clean close, this rank's memory tier (its newest save is
    persisted: nobody resumes from memory after it), then the tier's folders once
    the last rank's saver of the node has emptied them."""
    shutil.rmtree(slot_dir, ignore_errors=True)
    if tier is None:
        return
    shutil.rmtree(tier, ignore_errors=True)
    with contextlib.suppress(OSError):
        (Path(hello["memory_home"]) / f"lineage-r{hello['rank']}").unlink()
    _let_go_of_beacon(hello, beacon)
    for folder in (hello["memory_root"], hello["memory_home"]):
        with contextlib.suppress(OSError):
            Path(folder).rmdir()


def main(argv: list[str]) -> int:
    logging.basicConfig(
        level=logging.WARNING, format="%(levelname)s %(name)s (memory tier's saver): %(message)s"
    )
    sock = socket.socket(fileno=int(argv[0]))
    conn = Connection(sock.detach())
    try:
        return anyio.run(_main, conn)
    finally:
        conn.close()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
