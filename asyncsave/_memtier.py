"""The memory tier: saves that survive the death of the training process.

``Checkpointer(root, memory=MemoryTier(...))`` makes a :class:`MemoryCheckpointer`,
the trainer's side of the tier. It starts its saver process
(``asyncsave._saverproc``) on entry, or, when no saver of the root is alive,
once :meth:`~MemoryCheckpointer.load_latest` has resumed in the trainer itself
(see "The restart" below); ``save()`` copies the snapshot into a slot of shared
memory that the saver owns (``asyncsave._slots``) and returns once the saver
answered (the save accepted, or refused with the saver's typed error), or, for a
save of an unchanged structure at a newer step, once it is in the saver's socket;
the saver
commits it to the memory tier (a tmpfs root), persists it to ``root`` (its
``persistent`` tier) and reports each commit back. Everything past the copy runs
in the saver: if the trainer dies, the saver still commits every save it
received, persists the newest one and exits.

**One saver per rank, not per node.** A saver per rank is a process with one
parent, one socket and one part of the state, and the savers' own gloo group
(rendezvous through a ``TCPStore`` served by saver 0) agrees each commit
exactly as the ranks' checkpointers do; a saver per node would have to
multiplex several trainers, and its death would take every rank of the node.
The cost is a process and its interpreter per rank (about 150 MB of resident
memory with torch imported).

**Two slots.** The trainer stages into one slot while the saver still copies the
previous save out of the other (its lazy save: planned at once, staged in the
background); a slot comes back once its save is staged in the saver. A third
save waits for a slot, as a save waits for the staging buffer without a memory
tier. Slots are sized by the first save and grown (both at once, once both are
free) when a state outgrows them.

**The restart.** A saver's start is a new interpreter importing torch (one to
two seconds), far longer than reading a snapshot from memory. Every saver holds
a shared ``flock`` on its rank's beacon (``_saverlink.beacon_path``) for its
whole life. On entry, when every rank can take its beacon exclusively (no
saver of the root is alive: none of a dead trainer still committing), the
trainer holds the memory tier's lock and starts no saver yet; ``load_latest()``
then resumes with the checkpointer's own decision
(``asyncsave._resume.resume_nearest``, read-only: a candidate that fails is left
to the saver, which moves it aside), and starts the saver with the step it
resumed from (protected there); the saver inherits the tier's lock and its
beacon (``pass_fds``), so the tier is never free between the two. Otherwise the saver starts on entry, and its
open waits for a dead trainer's saver or refuses a live one's.

Messages (trainer to saver): ``save``, ``slots``, ``wait``, ``load``, ``close``
(and ``store`` on several ranks); saver to trainer: ``ready``, ``port``,
``accepted``/``refused``, ``free``, ``committed``/``failed``,
``persisted``/``persist_failed``, ``slots``, ``waited``, ``loaded``, ``closed``.

What combines with a memory tier is :data:`ROWS` (rendered in
``docs/guides/tiers.md``); a refused combination raises
:class:`UnsupportedCombinationError` when the checkpointer is made.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import json
import logging
import math
import operator
import os
import pickle
import socket
import uuid
import warnings
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import anyio
import torch

from ._atomicity import strategy_for
from ._engine import Checkpointer
from ._errors import (
    CheckpointerClosedError,
    CheckpointTimeoutError,
    CheckpointWarning,
    InvalidStepError,
    SaveFailedError,
    SaverDiedError,
    UnsupportedCombinationError,
    WaitTimeoutError,
)
from ._fsspec import open_root
from ._handle import SaveHandle
from ._manifest import check_training_info
from ._options import CheckpointOptions, MemoryTier, Tier
from ._paths import LAYOUTS
from ._resume import NearestTiers
from ._retention import KeepBytes, KeepLast
from ._saverlink import SaverLink, check_home, lock_beacon, orphaned_saver, other_run, unwire
from ._slots import Layout, Slot, copy_into, pack
from ._types import CheckpointInfo, Restored

__all__ = ["ROWS", "MemoryCheckpointer", "check_options", "markdown", "refusal"]

logger = logging.getLogger("asyncsave")

_MAX_STEP = 2**62
#: The file in the root naming the run its memory tiers belong to.
LINEAGE_FILE = "asyncsave-memory-tier.json"
_SLOTS = 2
_GROW = 1.25  # headroom of grown slots

#: What combines with ``memory=``: (option, how it behaves or why it is
#: refused). ``refused`` rows raise :class:`UnsupportedCombinationError`.
ROWS: tuple[tuple[str, str, str], ...] = (
    ("one rank", "supported", "one saver process"),
    (
        "several ranks",
        "supported",
        "one saver per rank; the savers agree each commit on a gloo group of their own, "
        "and each rank's snapshots live in its node's memory (`local_scope=\"rank\"`)",
    ),
    (
        "eager save",
        "supported",
        "returns once the snapshot is in shared memory and the saver has it",
    ),
    (
        "lazy save",
        "supported",
        "returns once planned; the copy into shared memory runs behind, "
        "`staged()` waits for it; a trainer that dies before it ends loses that save",
    ),
    (
        "CUDA tensors",
        "supported",
        "copied device-to-host into the slot, registered as pinned memory",
    ),
    ("`retention=`", "supported", "applies to `root` (the persistent tier)"),
    (
        "`layout=`, `save_step_zero=`, `allow_pickle=`, timeouts, `writer_threads=`",
        "supported",
        "passed to the saver's checkpointer",
    ),
    ("object-store `root`", "supported", "the saver persists there (commit marker)"),
    ("`budget_bytes=`", "supported", "the saver's own staging buffer"),
    (
        "`persistent=`",
        "refused",
        "the memory tier's persistent tier is `root` itself: a third tier behind it "
        "is not built yet; make `root` the shared file system or object store",
    ),
    (
        "`incremental=True`",
        "refused",
        "incremental saves hash against the previous checkpoint of the same root; "
        "with a memory tier that root is in memory, where sharing files saves nothing",
    ),
    ("`coordinator=`", "refused", "the saver processes need real ranks (torch.distributed)"),
    (
        "DTensor state",
        "refused",
        "DTensor state goes through DCP's planner in the trainer's process group; "
        "save per-rank state, or use asyncsave.dcp without a memory tier",
    ),
    (
        "`update()`",
        "refused",
        "rewriting one item happens in the saver's checkpointer; not exposed yet",
    ),
    (
        "`SyncCheckpointer`",
        "refused",
        "use `Checkpointer` (an async pump) with a memory tier; a synchronous facade is not built yet",
    ),
)


def markdown() -> str:
    """:data:`ROWS` as a Markdown table (``docs/guides/tiers.md``)."""
    lines = ["| with `memory=` | | how, or why not |", "|---|---|---|"]
    lines += [f"| {o} | {v} | {why} |" for o, v, why in ROWS]
    return "\n".join(lines)


def refusal(option: str) -> UnsupportedCombinationError:
    for o, verdict, why in ROWS:
        if o == option:
            assert verdict == "refused"
            return UnsupportedCombinationError(f"memory=MemoryTier(...) with {option}: {why}")
    raise AssertionError(option)


def check_options(options: CheckpointOptions) -> None:
    """Raise the refusal of :data:`ROWS` that ``options`` meets, if any."""
    if options.persistent is not None:
        raise refusal("`persistent=`")
    if options.incremental:
        raise refusal("`incremental=True`")
    if options.coordinator is not None:
        raise refusal("`coordinator=`")


def memory_home(root: Any, tier: MemoryTier) -> Path:
    """Where the memory tier of ``root`` lives on this node: one directory per
    user and root, so that a restarted trainer of the same root finds it."""
    key = str(root if not isinstance(root, Path) else root.resolve())
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    return Path(tier.shm_dir) / f"asyncsave-{os.getuid()}-{digest}"


def _no_saver_alive(home: Path, rank: int) -> bool:
    """Whether no saver process of ``rank`` holds its beacon in ``home`` (see
    ``asyncsave._saverlink.beacon_path``): an exclusive ``flock`` taken and
    dropped at once. ``False`` where ``flock`` fails (then the saver's own open
    decides, as it always may)."""
    import fcntl

    fd = lock_beacon(home, rank, exclusive=True)
    if fd is None:
        return False
    fcntl.flock(fd, fcntl.LOCK_UN)
    os.close(fd)
    return True


def _world() -> tuple[int, int]:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


class _Deferred(Exception):
    """A resume candidate failed on some rank: the saver decides instead."""


class _ReadOnlyTiers(NearestTiers):
    """The memory tier and ``root`` as a trainer sees them while its saver is
    still starting: it only reads; a failed candidate (the saver moves a
    damaged one aside) is the saver's to resume from."""

    chosen: tuple[int, str] | None = None  # (step, tier) resumed from

    async def failed(self, where: str, step: int, path: Path, own: str | None) -> None:
        raise _Deferred(f"step {step} of the {where} tier ({path}) did not load: {own}")

    def resumed(self, where: str, step: int) -> None:
        self.chosen = (step, where)


class _Handle(SaveHandle):
    """A save's handle on the trainer's side: whether it is due to persist is
    known once the saver admitted it (``persisted()`` waits for that, within
    its ``timeout_s``)."""

    def __init__(self, step: int) -> None:
        super().__init__(step)
        self._admitted = anyio.Event()

    async def persisted(self, timeout_s: float | None = None) -> CheckpointInfo | None:
        with anyio.move_on_after(math.inf if timeout_s is None else timeout_s):
            await self._admitted.wait()
        if not self._admitted.is_set():
            raise WaitTimeoutError(
                f"step {self.step} was not admitted within {timeout_s} s (the save goes on)",
                step=self.step,
            )
        return await super().persisted(timeout_s)

    def _fail(self, error: BaseException) -> None:
        super()._fail(error)
        self._admitted.set()


class MemoryCheckpointer(Checkpointer):
    """The trainer's side of a :class:`~asyncsave.MemoryTier` (see the module
    docstring); made by ``Checkpointer(root, memory=...)`` and used exactly like
    it (``save``, ``staged``, ``wait``, ``load_latest``, ``agree``, ``async
    with``). A subclass of :class:`~asyncsave.Checkpointer` that shares its
    interface, not its engine (the engine runs in the saver): every public
    method is its own.

    Leaving the block (or ``aclose()``) flushes: the saver commits and persists
    every save it has (the newest persisted whatever ``persist`` says), removes
    this rank's memory tier and exits. Shielded from cancellation and bounded by
    ``close_timeout_s``: past it, close raises :class:`CheckpointTimeoutError`
    and the saver goes on alone (it finishes its saves and exits). Exceptions
    chain as without a memory tier (the inherited ``__aexit__``).

    :raises UnsupportedCombinationError: an option :data:`ROWS` refuses.
    :raises ValueError: an option that cannot be sent to the saver process (a
        policy or retention rule that does not pickle).
    """

    def __init__(  # no super().__init__(): the engine is the saver's
        self,
        root: str | os.PathLike[str],
        options: CheckpointOptions | None = None,
        **overrides: Any,
    ) -> None:
        options = options or CheckpointOptions()
        self.options = dataclasses.replace(options, **overrides) if overrides else options
        assert self.options.memory is not None
        self.memory: MemoryTier = self.options.memory
        check_options(self.options)
        self._rootfs, self.root = open_root(
            root, filesystem=self.options.filesystem, storage_options=self.options.storage_options
        )
        self.layout = LAYOUTS[self.options.layout]
        self._home = memory_home(self.root, self.memory)
        self._phase = "new"
        self._link = SaverLink(self.root, self._take, self._lose_saver)
        self._coord: Any = None
        self._broken: SaveFailedError | None = None
        self._seq = 0
        self._handles: dict[int, _Handle] = {}  # handed over, not yet committed
        self._persisting: dict[int, _Handle] = {}  # due to persist, not yet persisted
        self._answers: dict[int, tuple[Any, ...]] = {}  # saves' answers, by seq
        self._slots: list[Slot] = []
        self._free: set[int] = set()
        self._changed = anyio.Event()
        self._order = anyio.Semaphore(1)
        self._behind: dict[int, _Handle] = {}
        self._resumed: int | None = None
        self._tracked: int | None = None
        self._last_shape: Any = None  # Packed.structure() of the last accepted save
        self._last_step = -1
        self._last_layout: Layout | None = None  # the last save's (reused: _slots.pack)
        self._sent_layout: Layout | None = None  # the last one whose refs the saver has
        self.memory_root: Path | None = None
        # The saver's start (see _start): what to send it, its answers.
        self._said: dict[str, Any] = {}  # "port", "ready"
        self._start_error: BaseException | None = None
        self._start_lock = anyio.Lock()
        self._hello: dict[str, Any] = {}
        self._up = False  # the saver is ready
        self._tier_locks: list[int] = []  # the memory tier's, held until the saver takes it over

    def __repr__(self) -> str:
        return f"Checkpointer({str(self.root)!r}, memory={self.memory!r})"

    @property
    def saver_pid(self) -> int | None:
        """The saver process's pid: ``None`` until it starts (at entry, or, when
        no saver of this root was alive, once :meth:`load_latest` resumed or the
        first call that needs it: ``save``, ``wait``, close)."""
        return self._link.pid

    # -- the saver process ----------------------------------------------------
    def _saver_options(self, world: int) -> CheckpointOptions:
        o = self.options
        tier = Tier(
            self.root,
            policy=self.memory.persist,
            retention=o.retention,
            filesystem=o.filesystem,
            storage_options=o.storage_options,
            local_scope="rank" if world > 1 else "shared",
            timeout_s=o.save_timeout_s,
        )
        keep = (
            KeepLast(2) if self.memory.budget_bytes is None else KeepBytes(self.memory.budget_bytes)
        )
        return dataclasses.replace(
            o,
            memory=None,
            persistent=tier,
            retention=keep,
            filesystem=None,
            storage_options=None,
            distributed=world > 1,
        )

    async def __aenter__(self) -> MemoryCheckpointer:
        if self._phase != "new":
            raise CheckpointerClosedError("a Checkpointer can be entered only once", path=self.root)
        self._phase = "opening"
        rank, world = _world() if self.options.distributed is not False else (0, 1)
        hello = {
            "rank": rank,
            "world_size": world,
            "options": self._saver_options(world),
            "memory_home": str(self._home),
            "memory_root": str(self._home / "tier"),
            "slot_dir": str(self._home / f"slots-r{rank}"),
            "start_timeout_s": self.memory.start_timeout_s,
            "dist_timeout_s": self.options.dist_timeout_s,
        }
        try:
            pickle.dumps(hello)
        except Exception as exc:
            raise ValueError(
                f"the options of Checkpointer({str(self.root)!r}) cannot be sent to the memory "
                f"tier's saver process (a policy or retention rule that does not pickle?): {exc}"
            ) from exc
        try:
            await self._start(hello, rank, world)
        except BaseException:
            with anyio.CancelScope(shield=True):
                self._unlock_tier()
                self._link.kill()
                await self._link.stop_process(wait_s=30)
                if self._coord is not None:
                    self._coord.close()
            self._phase = "closed"
            await self._link.end_tasks()
            raise
        self._phase = "open"
        return self

    async def _start(self, hello: dict[str, Any], rank: int, world: int) -> None:
        """Start the saver, or, when no saver of any rank is alive (none of a
        dead trainer still committing), only hold the memory tier's lock for
        it: this process may then resume by itself (:meth:`load_latest`) while
        nothing else touches the tier, and the saver starts afterwards
        (:meth:`_spawn`), its import of torch (a second or two, most of a
        restart) off the resume's path. Otherwise (a dead trainer's saver still
        at work, or another checkpointer's), the saver starts now and its open
        decides: it waits for the dead trainer's saver, and refuses another's
        with :class:`RootInUseError`."""
        from ._coord import GlooGroup, Solo

        if world > 1:
            self._coord = await GlooGroup.create(self.options.dist_timeout_s)
        else:
            self._coord = Solo()
        # The run this root holds (rank 0 reads it, or names a new one): a memory
        # tier of another run of the same path (the root removed, or replaced) is
        # set aside by the saver, never resumed from nor copied into this root.
        hello["lineage"] = await self._coord.from_leader("memory-tier-lineage", None, self._lineage)
        self._hello = hello
        self.memory_root = self._tier_of(rank, world)
        await anyio.to_thread.run_sync(check_home, self._home)
        await self._link.run()  # its tasks wait for the process

        async def alone() -> bool:
            return await anyio.to_thread.run_sync(_no_saver_alive, self._home, rank)

        if all(await self._coord.map_reduce("memory-tier-alone", None, alone)):
            # Held until the saver takes it over: a second checkpointer is refused.
            held = await self._coord.map_reduce(
                "memory-tier-lock",
                None,
                self._lock_tier,
                doing="lock of the memory tier by",
                own=True,
            )
            if all(held):
                return
            self._unlock_tier()  # a dead trainer's saver holds it (no beacon: an older one)
        await self._started()

    async def _lock_tier(self) -> bool:
        """Take this rank's memory tier's lock for the saver to come; ``False``
        when a dead trainer's saver holds it (the saver's open waits for it).

        :raises RootInUseError: a live checkpointer holds it.
        """
        from ._commit import lock_root
        from ._errors import RootInUseError
        from ._fs import LocalFileSystem

        assert self.memory_root is not None
        try:
            fd = await anyio.to_thread.run_sync(
                lock_root, LocalFileSystem(), self.memory_root, self.options.lock
            )
        except RootInUseError as exc:
            if orphaned_saver(str(exc)):
                return False
            raise
        if fd is not None:  # lock="none": nothing to hold
            self._tier_locks.append(fd)
        return True

    def _unlock_tier(self) -> None:
        from ._fs import LocalFileSystem

        while self._tier_locks:
            LocalFileSystem().unlock(self._tier_locks.pop())

    async def _spawn(self, resumed: tuple[int, str] | None) -> None:
        """Start the saver process (once), with the step this process resumed
        from by itself and its tier (the saver protects it). The saver
        inherits its beacon, taken here, and the memory tier's lock, held by
        this process until now: there is no instant at which a second
        checkpointer could find the tier free, nor the beacon."""
        from ._fs import LocalFileSystem

        if self._link.pid is not None:
            return
        beacon = await anyio.to_thread.run_sync(
            functools.partial(lock_beacon, self._home, self._coord.rank, exclusive=False)
        )
        locks = [fd for fd in self._tier_locks if fd is not None]
        inherit = [fd for fd in (beacon, *locks) if fd is not None]
        self._hello["resumed"] = resumed
        self._hello["inherited"] = {"beacon": beacon, "tier_lock": locks[0] if locks else None}
        try:
            await self._link.start(self._hello, inherit)
        finally:
            if beacon is not None:
                os.close(beacon)  # the saver's copy holds it (an flock is the open file's)
            if self._link.pid is not None:
                fs = LocalFileSystem()
                while self._tier_locks:
                    fs.hand_over(self._tier_locks.pop())

    async def _started(self) -> None:
        """Finish the saver's start (once; every later call returns at once or
        raises what the start raised): start the saver if it is not yet, on
        several ranks hand the savers the address of saver 0's store, and wait
        until it is ready
        (its memory tier opened), within ``start_timeout_s`` + 60 s.

        :raises SaverDiedError: the saver died, or did not answer in time.
        :raises RootInUseError: (and the other errors of a checkpointer's
            open) the saver could not open the memory tier.
        """
        async with self._start_lock:
            if self._start_error is not None:
                raise self._start_error
            if self._up:
                return
            try:
                await self._start_saver()
            except BaseException as exc:
                if isinstance(exc, Exception):
                    self._start_error = exc
                raise

    async def _start_saver(self) -> None:
        timeout_s = self.memory.start_timeout_s + 60
        await self._spawn(None)
        if self._coord.world_size > 1:

            async def served() -> tuple[str, int]:  # saver 0's store, on rank 0
                host = os.environ.get("MASTER_ADDR") or socket.gethostname()
                await self._answer("port", timeout_s, "with its port")
                return host, int(self._said["port"])

            where = await self._coord.from_leader("memory-tier-store", None, served)
            if self._coord.rank != 0:
                self._link.post("store", *where)
        await self._answer("ready", timeout_s, "that it is ready")
        ready = unwire(self._said["ready"])
        if isinstance(ready, BaseException):
            raise ready
        self.memory_root = Path(ready["memory_root"])
        self._up = True

    async def _answer(self, kind: str, timeout_s: float, what: str) -> None:
        """Wait for one of the saver's start answers (``port``, ``ready``)."""
        with anyio.move_on_after(timeout_s):
            while kind not in self._said:
                if self._link.lost is not None:
                    raise self._link.lost
                await self._changed.wait()
            return
        raise SaverDiedError(
            f"the memory tier's saver (pid {self.saver_pid}) did not answer {what} within {timeout_s} s",
            path=self.root,
        )

    async def _lineage(self) -> str:
        def run() -> str:
            marker = self.root / LINEAGE_FILE
            with contextlib.suppress(FileNotFoundError, OSError, ValueError, KeyError):
                return str(json.loads(self._rootfs.read_bytes(marker))["lineage"])
            lineage = uuid.uuid4().hex
            self._rootfs.makedirs(self.root)
            strategy_for(self._rootfs).replace_file(
                self._rootfs, marker, json.dumps({"lineage": lineage}).encode()
            )
            return lineage

        return await anyio.to_thread.run_sync(run)

    # -- messages -----------------------------------------------------------------
    def _take(self, msg: tuple[Any, ...]) -> None:
        kind = msg[0]
        if kind in ("port", "ready"):  # the start's answers (_start_saver)
            self._said[kind] = msg[1]
        elif kind in ("accepted", "refused"):
            self._answers[msg[1]] = msg
        elif kind == "admitted":  # an early save (in the saver's socket), now admitted
            handle = self._handles.get(msg[1])
            if handle is not None:
                for category, text in msg[2]:
                    logger.warning(
                        "asyncsave (save of step %d): %s: %s", handle.step, category, text
                    )
                self._admit(msg[1], handle, msg[3], msg[4])
        elif kind == "free":
            self._free.add(msg[1])
        elif kind == "committed":
            self._committed(msg[1], msg[2])
        elif kind == "failed":
            handle = self._handles.pop(msg[1], None)
            error = self._as_failure(unwire(msg[2]), handle.step if handle else None)
            if self._broken is None:
                self._broken = error
            if handle is not None:
                handle._fail(error)
        elif kind in ("persisted", "persist_failed"):
            handle = self._persisting.pop(msg[1], None)
            if handle is not None:
                if kind == "persisted":
                    handle._persist_done(msg[2], None)
                else:
                    handle._persist_done(None, self._as_failure(unwire(msg[2]), handle.step))
        self._wake()

    def _committed(self, seq: int, info: CheckpointInfo) -> None:
        handle = self._handles.pop(seq, None)
        if self._tracked is None or info.step > self._tracked:
            self._tracked = info.step
        if handle is not None:
            handle._commit(info)

    def _as_failure(self, exc: Any, step: int | None) -> SaveFailedError:
        if isinstance(exc, SaveFailedError):
            return exc
        error = SaveFailedError(
            f"the save of step {step} failed in the memory tier's saver: {exc}", step=step
        )
        error.__cause__ = exc if isinstance(exc, BaseException) else None
        return error

    def _wake(self) -> None:
        self._changed.set()
        self._changed = anyio.Event()

    def _lose_saver(self, error: SaverDiedError) -> None:
        if not isinstance(self._broken, SaverDiedError):
            self._broken = error
        for handles in (self._handles, self._persisting):
            for handle in handles.values():
                handle._fail(error)
                handle._persist_done(None, error)
            handles.clear()
        self._wake()

    async def _until(self, ready: Callable[[], bool], what: str) -> None:
        """Wait until ``ready()``, woken by each message, within ``save_timeout_s``.

        :raises SaverDiedError: the saver died meanwhile.
        :raises CheckpointTimeoutError: not ready in time (the checkpointer then
            refuses further saves: the saver is stuck).
        """
        with anyio.move_on_after(self.options.save_timeout_s):
            while not ready():
                if self._link.lost is not None:
                    raise self._link.lost
                await self._changed.wait()
            return
        error = CheckpointTimeoutError(
            f"the memory tier's saver (pid {self.saver_pid}) did not answer {what} within "
            f"save_timeout_s={self.options.save_timeout_s}",
            path=self.root,
        )
        self._broken = self._broken or error
        raise error

    # -- saving -----------------------------------------------------------------
    def _check_open(self) -> None:
        if self._phase != "open":
            raise CheckpointerClosedError(
                f"save() needs an open Checkpointer (this one is {self._phase})", path=self.root
            )
        if self._broken is not None:
            raise self._broken

    async def _slot(self, nbytes: int) -> int:
        """A free slot of at least ``nbytes``, (re)making the slots if they are
        too small (once both are free)."""
        while True:
            self._check_open()
            if self._slots and self._slots[0].capacity >= nbytes and self._free:
                return self._free.pop()
            if not self._slots or (self._slots[0].capacity < nbytes and len(self._free) == _SLOTS):
                await self._make_slots(nbytes)
                continue
            await self._until(
                lambda: bool(self._free) or self._broken is not None, "with a free slot"
            )

    async def _make_slots(self, nbytes: int) -> None:
        old = self._slots[0].capacity if self._slots else 0
        capacity = max(int(nbytes * _GROW), old, 1 << 20)
        capacity = (capacity + 4095) // 4096 * 4096
        for s in self._slots:
            s.close()
        self._slots, self._free = [], set()
        self._last_layout = None  # its destination views are into the old slots
        paths = await self._link.ask(
            "slots", _SLOTS, capacity, timeout_s=self.options.save_timeout_s, what="with slots"
        )
        if isinstance(paths, BaseException):
            raise SaveFailedError(
                f"the memory tier cannot make {_SLOTS} slots of {capacity} bytes in "
                f"{self.memory.shm_dir}: {paths}",
                path=self.root,
            ) from paths
        self._slots = [Slot(Path(p), capacity, pin=True) for p in paths]
        self._free = set(range(len(paths)))

    async def save(
        self,
        step: int,
        state: Any,
        *,
        overwrite: bool = False,
        training_info: dict[str, Any] | None = None,
        lazy: bool = False,
    ) -> SaveHandle:
        """:meth:`asyncsave.Checkpointer.save` through the memory tier: returns
        once the snapshot is in shared memory and the saver has accepted it (eager),
        or once it is planned (``lazy``; :meth:`staged` waits for the copy).
        Refusals of the saver (a bad step, an unstorable leaf, a protected
        overwrite) are raised here, as without a memory tier (a lazy save's by
        its handle). The state is pickled and copied in worker threads;
        ``state_dict()`` of ``Stateful`` objects is called on this thread.

        :raises SaverDiedError: the saver process died.
        :raises CheckpointTimeoutError: the saver did not answer within
            ``save_timeout_s``.
        """
        self._check_open()
        if type(step) is not int and not isinstance(step, bool):
            with contextlib.suppress(TypeError):
                step = operator.index(step)
        if type(step) is not int or not 0 <= step <= _MAX_STEP:
            raise InvalidStepError(f"step must be a non-negative int, got {step!r}")
        # What the saver's save() would refuse in it, refused here: an early
        # save (below) cannot be refused once handed over.
        check_training_info(training_info, step)
        await self._started()
        await self._order.acquire()
        try:

            def on_loop(func: Callable[[], Any]) -> Any:
                return anyio.from_thread.run_sync(func)

            packed = await anyio.to_thread.run_sync(
                functools.partial(pack, state, call=on_loop, last=self._last_layout)
            )
            self._last_layout = packed.layout
            index = await self._slot(packed.nbytes)
        except BaseException:
            self._order.release()
            raise
        self._seq += 1
        seq = self._seq
        handle = _Handle(step)
        handle._progress.total_bytes = packed.nbytes
        if not lazy:
            try:
                notes = await self._hand_over(
                    seq, step, index, packed, handle, overwrite, training_info
                )
            finally:
                self._order.release()
            for category, text in notes:
                cls = CheckpointWarning if category == "CheckpointWarning" else UserWarning
                warnings.warn(cls(text), stacklevel=2)
            return handle
        self._behind[seq] = handle

        async def behind() -> None:
            try:
                notes = await self._hand_over(
                    seq, step, index, packed, handle, overwrite, training_info
                )
                for category, text in notes:
                    logger.warning("asyncsave (lazy save of step %d): %s: %s", step, category, text)
            except SaveFailedError as exc:  # the saver broke: so does the checkpointer
                handle._fail(exc)
                self._broken = self._broken or exc
            except Exception as exc:  # refused (a bad leaf): this save only
                handle._fail(exc)
            finally:
                self._order.release()
                self._behind.pop(seq, None)

        self._link.start_soon(behind)
        return handle

    async def _hand_over(
        self,
        seq: int,
        step: int,
        index: int,
        packed: Any,
        handle: _Handle,
        overwrite: bool,
        training_info: dict[str, Any] | None,
    ) -> list[tuple[str, str]]:
        try:
            await anyio.to_thread.run_sync(copy_into, packed, self._slots[index])
        except BaseException:
            self._free.add(index)
            raise
        handle._progress.all_staged()
        # The same structure (tree, dtypes, shapes, storages) as the last save
        # the saver accepted, and a newer step: see below.
        shape = packed.structure()
        early = not overwrite and shape == self._last_shape and step > self._last_step
        # The refs and spans travel once per layout: the saver keeps the last ones.
        known = packed.layout is self._sent_layout
        self._sent_layout = packed.layout
        layout = (None, None) if known else (packed.layout.refs, packed.layout.spans)
        msg = (
            "save",
            seq,
            step,
            index,
            packed.tree,
            packed.numbers,
            *layout,
            overwrite,
            training_info,
            early,
        )
        if early:
            # The saver's save() cannot refuse it: once the message is in the
            # saver's socket (delivered even if this process dies now), the save
            # is the saver's; it is admitted behind (``admitted``).
            self._handles[seq] = handle
            try:
                await self._link.deliver(
                    *msg, timeout_s=self.options.save_timeout_s, what=f"the save of step {step}"
                )
            except BaseException as exc:
                self._handles.pop(seq, None)
                if isinstance(exc, SaveFailedError):
                    self._broken = self._broken or exc
                raise
            self._last_step = max(step, self._last_step)
            handle._mark_staged()
            return []
        self._link.post(*msg)
        try:
            await self._until(lambda: seq in self._answers, f"the save of step {step}")
        except BaseException:
            self._handles.pop(seq, None)
            raise
        answer = self._answers.pop(seq)
        if answer[0] == "refused":
            self._handles.pop(seq, None)
            raise unwire(answer[2])
        self._last_shape, self._last_step = shape, max(step, self._last_step)
        handle._mark_staged()
        _, _, notes, skipped, due = answer
        self._admit(seq, handle, skipped, due)
        return list(notes)

    def _admit(self, seq: int, handle: _Handle, skipped: bool, due: bool) -> None:
        handle.due_to_persist = bool(due)
        if skipped:
            handle.skipped = True
            handle._done.set()
            self._handles.pop(seq, None)
        else:
            self._handles[seq] = handle
            if due:
                self._persisting[seq] = handle
        handle._admitted.set()

    async def staged(self) -> None:
        """Wait until every lazy save is in shared memory (see
        :meth:`asyncsave.Checkpointer.staged`)."""
        while self._behind:
            await next(iter(self._behind.values()))._staged.wait()
        if self._broken is not None:
            raise self._broken

    async def wait(self) -> None:
        """Wait until every save handed to the saver has committed or failed
        (within ``save_timeout_s``).

        :raises SaveFailedError: a save failed (:class:`SaverDiedError` if the
            saver died; :class:`CheckpointTimeoutError` if it did not answer).
        :raises CheckpointerClosedError: not open.
        """
        if self._phase != "open":
            raise CheckpointerClosedError(
                f"wait() needs an open Checkpointer (this one is {self._phase})", path=self.root
            )
        await self.staged()
        await self._started()
        error = await self._link.ask("wait", timeout_s=self.options.save_timeout_s, what="wait()")
        if self._broken is not None:
            raise self._broken
        if error is not None:
            raise error

    def agree(self, policy: Any) -> Any:
        """:meth:`asyncsave.Checkpointer.agree`, on the trainers' gloo group."""
        from ._policy import AgreedPolicy

        if self._phase != "open":
            raise CheckpointerClosedError("agree() needs an open Checkpointer", path=self.root)
        return AgreedPolicy(policy, self._coord.vote)

    async def update(self, step: int, key: str, value: Any) -> CheckpointInfo:
        """Refused with a memory tier (see :data:`ROWS`).

        :raises UnsupportedCombinationError: always.
        """
        raise refusal("`update()`")

    # -- resuming ---------------------------------------------------------------
    async def load_latest(
        self,
        template: Any = None,
        *,
        device: str | torch.device = "cpu",
        fallback: bool = False,
        required: Iterable[str | Sequence[Any]] = (),
        strict: bool = True,
    ) -> Restored | None:
        """:meth:`asyncsave.Checkpointer.load_latest` from the nearest tier: the
        newest snapshot in this node's memory when it is at least as new as the
        newest persistent checkpoint and verifies (no disk read), else the
        persistent one; every rank the same step. The saver resolves and
        verifies (every byte against its checksum) with the checkpointer's own
        resume; this process then maps the files it verified (tmpfs pages,
        zero-copy on CPU) and copies them into ``template``.
        """
        from ._template import apply_template, warned

        if self._phase != "open":
            raise CheckpointerClosedError(
                "load_latest() needs an open Checkpointer", path=self.root
            )
        async with self._start_lock:  # a save() meanwhile waits: nothing starts the saver
            done = None
            if self._link.pid is None and self._start_error is None:
                # No saver is alive yet: resume here, before it starts (its import
                # of torch is most of a restart), with the checkpointer's own decision.
                done = await self._resume_here(template, device, required, strict)
        if done is not None:
            return warned(done, 3)
        await self._started()
        found = await self._link.ask(
            "load",
            fallback,
            list(required),
            timeout_s=self.options.save_timeout_s,
            what="load_latest()",
        )
        if isinstance(found, BaseException):
            raise found
        if found is None:
            return None
        info: CheckpointInfo = found["info"]
        state = await anyio.to_thread.run_sync(
            functools.partial(self._read_part, info.path, found["whole"], device)
        )
        state, note = apply_template(state, template, info.path, strict=strict)
        self._resumed = info.step
        return warned((Restored(state, info), note), 3)

    async def _resume_here(
        self, template: Any, device: Any, required: Iterable[Any], strict: bool
    ) -> tuple[Restored | None, Any] | None:
        """Resume from the nearest tier in this process, reading only (every
        byte verified): the same decision as the saver's checkpointer
        (``asyncsave._resume.resume_nearest``). ``None`` when the saver must
        decide instead (a candidate failed on some rank: the saver moves it
        aside; or this rank's memory tier belongs to another run); then the
        saver starts with nothing resumed, and is asked."""
        from ._fs import LocalFileSystem
        from ._resume import resume_nearest

        rank, world = self._coord.rank, self._coord.world_size
        tier = self._tier_of(rank, world)

        async def ours() -> bool:
            return await anyio.to_thread.run_sync(self._tier_is_this_runs, tier)

        if not all(await self._coord.map_reduce("memory-tier-ours", None, ours)):
            return None
        tiers = _ReadOnlyTiers(
            LocalFileSystem(),
            tier,
            self._rootfs,
            self.root,
            self.layout,
            per_rank=world > 1,
            allow_pickle=self.options.allow_pickle,
        )
        try:
            async with self._coord.turn():
                restored, note = await resume_nearest(
                    tiers, self._coord, template, device, list(required), strict=strict
                )
        except _Deferred:
            return None
        await self._spawn(tiers.chosen)
        if restored is not None:
            self._resumed = restored.info.step
        return restored, note

    def _tier_of(self, rank: int, world: int) -> Path:
        """This rank's memory tier (the saver's checkpointer's root)."""
        tier = self._home / "tier"
        return tier / f"rank{rank}" if world > 1 else tier

    def _tier_is_this_runs(self, tier: Path) -> bool:
        """Whether ``tier`` (this rank's memory tier) holds nothing of another
        run of the root (the saver would set it aside: ``_saverlink.other_run``)."""
        try:
            return not other_run(self._home, self._coord.rank, tier, self._hello["lineage"])[0]
        except OSError:
            return False

    def _read_part(self, path: Path, whole: bool, device: Any) -> Any:
        from ._dist import load_rank
        from ._load import load

        pickle_ok = self.options.allow_pickle
        if whole:  # a part of the memory tier: on the local file system
            return load(path, verify=False, device=device, allow_pickle=pickle_ok)
        rank, world = self._coord.rank, self._coord.world_size
        fs = self.options.filesystem
        if world > 1:
            return load_rank(
                path, rank, world, device=device, allow_pickle=pickle_ok, filesystem=fs
            )
        return load(  # read again from the root: verified again (cheap beside the I/O)
            path,
            device=device,
            allow_pickle=pickle_ok,
            filesystem=fs,
            storage_options=self.options.storage_options,
        )

    @property
    def resumed_step(self) -> int | None:
        """The step ``load_latest()`` resumed from, if any."""
        return self._resumed

    @property
    def tracked_step(self) -> int | None:
        """The newest step the saver reported committed in this run."""
        return self._tracked

    @property
    def pending_steps(self) -> list[int]:
        """Steps handed to the saver and not yet committed or failed."""
        return sorted({h.step for h in (*self._handles.values(), *self._behind.values())})

    @property
    def slots_pinned(self) -> bool:
        """Whether the shared-memory slots are registered as pinned memory in
        this process (CUDA hosts: device-to-host copies go straight into them)."""
        return bool(self._slots) and all(s.pinned for s in self._slots)

    @property
    def staging_pool(self) -> None:
        """``None``: the staging memory is the saver's shared slots."""
        return None

    # -- closing ----------------------------------------------------------------
    async def _shutdown(self) -> SaveFailedError | None:
        if self._phase in ("closed", "new"):
            self._phase = "closed"
            return None
        self._phase = "closing"
        error: BaseException | None = None
        waited = True
        with anyio.CancelScope(shield=True):
            try:
                with anyio.fail_after(self.options.close_timeout_s):
                    while self._behind:
                        await next(iter(self._behind.values()))._staged.wait()
                    started = True
                    try:
                        await self._started()  # a saver still holding opens, then closes
                    except Exception as exc:  # it exited: nothing to close
                        started, error = False, exc
                    if started and self._link.lost is None:
                        error = await self._link.ask("close", timeout_s=math.inf, what="close")
            except TimeoutError:
                waited = False
                error = CheckpointTimeoutError(
                    f"the memory tier's saver did not close within close_timeout_s="
                    f"{self.options.close_timeout_s}; it goes on alone and exits once its "
                    "saves are committed and persisted",
                    path=self.root,
                )
            except SaveFailedError as exc:
                error = exc
            self._phase = "closed"
            await self._link.stop_process(wait_s=30 if waited else 0)
            for s in self._slots:
                s.close()
            if self._coord is not None:
                self._coord.close()
        await self._link.end_tasks()  # a cancellation of this task goes on from here
        for handle in [*self._handles.values(), *self._persisting.values()]:
            closed = CheckpointerClosedError("the checkpointer closed first", path=self.root)
            handle._fail(closed)
            handle._persist_done(None, closed)
        failure = self._broken or error
        if failure is not None and not isinstance(failure, SaveFailedError):
            wrapped = SaveFailedError(
                f"closing the memory tier failed: {failure!r}", path=self.root
            )
            wrapped.__cause__ = failure if isinstance(failure, BaseException) else None
            failure = wrapped
        return failure

    def __del__(self) -> None:
        # The saver sees the socket's end, commits what it has and exits.
        link = getattr(self, "_link", None)
        if link is not None and link.conn is not None:
            with contextlib.suppress(Exception):
                link.conn.close()
