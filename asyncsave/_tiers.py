"""Two tiers: commit to fast local storage first, persist behind it, resume from
the nearest valid tier.

A :class:`~asyncsave.Checkpointer` given ``persistent=Tier(root, ...)`` saves as
always into its own (local) root: node-local disk or ``/dev/shm``, committed by
the usual protocol, and ``await handle`` returns at that local commit. A save that
the tier's policy marks as due is then *persisted* in the background by a
:class:`Persister`: the committed local directory (files, never the trainer's
memory) is copied to the persistent root (a shared file system or an object-store
URL) with the same commit protocol there: every file fsynced into a temporary
directory renamed last (or, on object stores, written under the final prefix with
``commit_success.txt`` last, ``_marker``), then that tier's tracker moved forward
and that tier's retention applied. ``await handle.persisted()`` returns then.

Rules (docs/decisions.md, "Tiers"):

- **Back-pressure.** At most ``Tier.queue_size`` saves are due to persist and not
  yet persisted (the one being copied included). A ``save()`` due to persist
  while that many are outstanding waits for a slot *before* its snapshot; the
  wait counts in its ``blocked_s``. It waits in ``save()``'s admission, so the
  ``save()`` calls after it wait behind it (save order is kept, a step is
  admitted once); saves not due to persist wait for the persistent tier only then.
- **One writer of a step.** An ``update()`` or an ``overwrite`` save of a step
  whose copy is queued or running waits for that copy (``Saver.queue_behind``);
  a copy reads the local manifest first and copies exactly what it names.
- **Abandoned copies.** The thread that copies, commits, tracks and retains holds
  the persistent root's in-process ``final_lock``, and so does recovery at open: a
  tier reopened in the same process while an abandoned copy still runs waits
  ``close_timeout_s`` for it, then raises :class:`RootInUseError`.
- **Retention.** A local checkpoint due to persist is protected from the local
  retention until its persistent copy is committed (``Saver.held``).
- **Order.** Copies run one at a time, in ``save()`` order.
- **Errors.** A failed copy fails ``handle.persisted()`` with a
  :class:`SaveFailedError` (the cause chained) and, like a failed save, makes the
  checkpointer refuse further saves and raise at ``wait()``/close (invariant 3).
- **Close** waits for outstanding copies within ``close_timeout_s``; past it they
  are cancelled (their temporary directories are removed at the next open of the
  persistent root) and close raises :class:`CheckpointTimeoutError`.
- **Resume** (``_resume.load_nearest``): the newest step that loads (every byte
  verified) wins; for one step, the local copy before the persistent one. On
  several ranks a local step counts only if every rank has it; every rank loads
  the same step, and if any rank's load fails the candidate is dropped on every
  rank and the next is tried.
- **Several ranks.** Rank 0 copies (the local root is shared by the ranks of a
  save, as without tiers) and broadcasts the outcome on a gloo group of the
  persister's own, so copies never interleave with the saves' collectives; every
  rank's ``persisted()`` resolves after that broadcast. The tier's policy must
  answer the same on every rank (a step-based policy such as ``SaveEvery``).
- **Node-local roots** (``Tier(local_scope="rank")``): rank ``r`` commits its own
  part under ``root/rank{r}/`` as a checkpoint of one rank (``Saver.per_rank``);
  at open the ranks agree on the local steps every rank has (the others are moved
  aside); every rank copies its own part and rank 0 commits the merged N-rank
  checkpoint (:meth:`Copier._copy_ranks`); resume loads each rank's own part.

Sources: Orbax's emergency checkpointing (local and persistent managers), NVIDIA
Resiliency Extension's local checkpointing, Gemini (SOSP'23): checkpoints kept
close to the trainer for frequent saves, persisted less often.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import json
import logging
import threading
import time
from collections.abc import Awaitable, Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import anyio
import anyio.to_thread

from ._atomicity import CommitStrategy, discard, strategy_for
from ._catalog import read_checkpoint
from ._commit import lock_root, recover
from ._coord import Coordinator, GlooGroup, Solo, Turns
from ._decode import verify
from ._errors import (
    CheckpointerClosedError,
    CheckpointError,
    CheckpointNotFoundError,
    CheckpointTimeoutError,
    CorruptCheckpointError,
    RootInUseError,
    SaveFailedError,
)
from ._fs import LocalFileSystem
from ._fsspec import open_root
from ._handle import SaveHandle
from ._jobs import check_visible, merge_parts
from ._manifest import CHECKSUM, SELF_CHECKSUM, encode_manifest, parse_manifest, stored_files
from ._options import Tier
from ._paths import COMMIT_MARKER_NAME, MANIFEST_NAME, Layout, is_temp_name
from ._pipeline import Saver, _final_lock_for
from ._retention import apply_retention
from ._track import TrackerWriter
from ._types import CheckpointInfo

__all__ = ["Persister", "copy_checkpoint"]

logger = logging.getLogger(__name__)

_CHUNK_BYTES = 8 << 20


def _files(fs: LocalFileSystem, directory: Path, prefix: str = "") -> list[str]:
    """Every file under ``directory``, as relative paths (subdirectories walked)."""
    out: list[str] = []
    for name in sorted(fs.listdir(directory)):
        path = directory / name
        if fs.is_link(path):
            raise CheckpointError(f"{path} is a symlink: not copied to a tier", path=path)
        if fs.is_dir(path):
            out.extend(_files(fs, path, f"{prefix}{name}/"))
        else:
            out.append(prefix + name)
    return out


def _copy_file(sfs: LocalFileSystem, src: Path, dfs: LocalFileSystem, dst: Path) -> int:
    """Copy one file in chunks of 8 MiB and fsync it; returns its bytes."""
    nbytes = 0
    fd = dfs.create(dst)
    try:
        view = memoryview(bytearray(_CHUNK_BYTES))
        with sfs.open_read(src) as f:
            while n := f.readinto(view):
                data = view[:n]
                while data:
                    w = dfs.write(fd, data)
                    if w <= 0:
                        raise OSError(f"write returned {w}")
                    data = data[w:]
                nbytes += n
        dfs.fsync(fd)
    except BaseException:
        dfs.close(fd)  # inside the except: an object-store upload is discarded
        raise
    dfs.close(fd)
    return nbytes


def copy_checkpoint(
    sfs: LocalFileSystem,
    src: Path,
    dfs: LocalFileSystem,
    root: Path,
    layout: Layout,
    step: int,
    *,
    overwrite: bool = False,
    threads: int = 1,
    strategy: CommitStrategy | None = None,
) -> Path:
    """Copy the committed checkpoint ``src`` into ``root`` as step ``step``, with
    the commit protocol of ``dfs`` (``strategy``, by default the one of ``dfs``):
    files into a temporary directory (or, without an atomic rename, under the
    final prefix), each fsynced, the manifest last, then the commit (rename and
    parent fsync, or the marker). Blocking (a worker thread). A failure removes
    what was written (nothing is committed).

    Self-consistent: the manifest is read first and its bytes are the ones
    written; every data file it names must be copied at the size it names, so a
    directory swapped under the copy (an ``update()``) fails it rather than
    committing one manifest with another save's files.

    ``threads`` data files are copied at a time (8 MiB chunks each).
    With ``overwrite``, a committed ``step`` is replaced atomically (rename
    exchange; refused where ``dfs`` has no atomic rename).

    :returns: the committed copy's path.
    :raises FileExistsError: step ``step`` exists under ``root`` and not ``overwrite``.
    :raises CheckpointError: ``overwrite`` on an object store; ``src`` changed
        while copied (a file its manifest names is missing or another size).
    :raises CorruptCheckpointError: ``src``'s manifest is damaged.
    :raises OSError: reading or writing failed.
    """
    final = root / layout.dir_name(step)
    if dfs.exists(final) and not overwrite:
        raise FileExistsError(f"{final} exists already")
    strategy = strategy or strategy_for(dfs)
    if overwrite:
        strategy.check_overwrite(dfs, final, step)
    raw = sfs.read_bytes(src / MANIFEST_NAME)
    named = {f.name: f.nbytes for f in stored_files(parse_manifest(raw, src / MANIFEST_NAME))}
    listed = [n for n in _files(sfs, src) if n not in (MANIFEST_NAME, COMMIT_MARKER_NAME)]
    names = sorted(set(listed) | set(named))  # one the listing lacks fails its copy
    tmp = strategy.begin(dfs, root, step, final)
    try:
        parents = sorted({n.rpartition("/")[0] for n in names} - {""})
        for parent in parents:
            dfs.makedirs(tmp / parent)
        # The data files in parallel (an object store's throughput grows with
        # concurrent uploads), then the manifest, then the commit.
        _copy_named(sfs, src, dfs, tmp, names, named, threads)
        for parent in reversed(parents):
            dfs.fsync_dir(tmp / parent)
        strategy.publish(dfs, tmp, final, raw, overwrite=overwrite)
    except BaseException:
        discard(dfs, tmp)
        raise
    return final


def _copy_named(
    sfs: LocalFileSystem,
    src: Path,
    dfs: LocalFileSystem,
    tmp: Path,
    names: Sequence[str],
    named: dict[str, int],
    threads: int,
) -> None:
    """Copy ``names`` from ``src`` into ``tmp``, ``threads`` at a time; each file
    the manifest read first names (``named``: name to bytes) must have its size.

    :raises CheckpointError: a named file changed size (``src`` was swapped).
    """
    with concurrent.futures.ThreadPoolExecutor(max(1, threads)) as pool:
        futures = {n: pool.submit(_copy_file, sfs, src / n, dfs, tmp / n) for n in names}
        for name, done in futures.items():
            nbytes = done.result()
            if name in named and nbytes != named[name]:
                raise CheckpointError(
                    f"{src / name} is {nbytes} bytes, not the {named[name]} its manifest "
                    "(read before the copy) names: the checkpoint changed while copied",
                    path=src / name,
                )


class Persister:
    """The persistent tier of one checkpointer: opens and closes its root,
    admits saves due to persist and hands them, in order, to its :class:`Copier`
    (``copier``). Created by the checkpointer; see the module docstring for the
    rules.

    Call sequence (the checkpointer's): :meth:`open` after the local root is
    open; :meth:`dispatch` around each ``save()``'s dispatch; close waits on
    ``saver.held`` and then calls :meth:`close`.
    """

    def __init__(self, tier: Tier, saver: Saver) -> None:
        self.tier = tier
        self.saver = saver
        self.layout = saver.layout
        if not saver.strategy.can_move_files:
            raise ValueError(
                f"the local tier {saver.root} must be a POSIX directory (node-local disk, "
                "/dev/shm); an object store is a persistent tier"
            )
        self.fs, self.root = open_root(
            tier.root, filesystem=tier.filesystem, storage_options=tier.storage_options
        )
        if isinstance(self.root, Path) and isinstance(saver.root, Path):
            mine, local = self.root.resolve(), saver.root.resolve()
            if (
                mine == local
                or _clashes(mine, local, self.layout)
                or _clashes(local, mine, self.layout)
            ):
                where = "" if mine == local else "inside or around "
                raise ValueError(
                    f"persistent=Tier({str(tier.root)!r}) is {where}the local root "
                    f"{str(saver.root)!r}: the two tiers must be separate "
                    "directories (a node-local disk and a shared file system or object "
                    "store); one may hold the other only under a plain directory name"
                )
        # How this tier commits (rename, or a marker on object stores): chosen once.
        self.strategy: CommitStrategy = strategy_for(self.fs)
        # The persistent root's in-process lock (``Saver.final_lock``): held by the
        # thread that copies, commits, tracks and retains, and by recovery at open,
        # so an abandoned copy finishes before a reopened tier touches the root.
        self.final_lock = _final_lock_for(self.root)
        if self.strategy.needs_tracker and self.layout.tracker_name is None:
            raise ValueError(
                f"layout={self.layout.name!r} has no tracker, which a persistent tier on "
                f"{self.fs!r} (commit by marker) needs"
            )
        # The copy to this root, its commit, tracker and retention.
        self.copier = Copier(tier, saver, self.fs, self.root, self.strategy, self.final_lock)
        self._lock_fd: int | None = None
        self._slots: anyio.Semaphore | None = None
        self._reserved: set[int] = set()  # slots taken by reserve(), for dispatch()
        self._turns = Turns()  # copies run one at a time, in admission order

    def __repr__(self) -> str:
        return f"Persister({str(self.root)!r})"

    # -- lifecycle ----------------------------------------------------------------
    def place_local(self) -> Path:
        """The local root this rank opens, once its rank is known: the
        checkpointer's root, or with ``local_scope="rank"`` its own
        ``root/rank{r}`` (a private root: this rank locks, recovers, commits,
        tracks and retains there)."""
        saver = self.saver
        if self.tier.local_scope == "rank" and not saver.per_rank:
            saver.per_rank = True
            saver.root = saver.root / f"rank{saver.coord.rank}"
            saver.final_lock = _final_lock_for(saver.root)
        return saver.root

    async def _agree_local(self) -> None:
        """``local_scope="rank"``, several ranks: the local steps every rank has
        committed. A step only some ranks have (a replaced node, a crash between
        the ranks' local commits) can never be resumed or persisted whole: it is
        moved aside to ``.asyncsave-partial-<step>-<id>`` (bytes kept, should a
        node's root only have been misconfigured), so that the step can be
        saved again."""
        saver = self.saver

        async def mine() -> list[int]:
            return sorted(saver.committed)

        views = await saver.coord.map_reduce("local-steps", None, mine)
        common = set(views[0]).intersection(*views[1:])
        partial = sorted(set(saver.committed) - common)
        for step in partial:
            await saver.move_aside(
                step,
                saver.root / self.layout.dir_name(step),
                "partial",
                "a local part of a step not every rank has committed",
            )

    async def open(self, unlock_local: Callable[[], Awaitable[None]]) -> None:
        """Lock and recover the persistent root (rank 0), as a checkpointer opens
        its own root; on several ranks, create the persister's gloo group. On
        failure, releases what is open: this tier, the local root's lock
        (``unlock_local``) and the checkpointer's coordinator, then raises."""
        try:
            await self._open()
        except BaseException:
            with anyio.CancelScope(shield=True):
                await unlock_local()
            self.saver.coord.close()
            self.close()
            raise

    async def _open(self) -> None:
        self._slots = anyio.Semaphore(self.tier.queue_size)
        if self.saver.per_rank and self.saver.coord.world_size > 1:
            await self._agree_local()
        if self.saver.coord.world_size > 1:
            # The other ranks wait in a broadcast while rank 0 copies: the bound is
            # the copy's (a dead rank 0 is still seen at once, by the heartbeats).
            timeout_s = max(self.saver.options.dist_timeout_s, self.tier.timeout_s)
            self.copier.coord = await GlooGroup.create(timeout_s)
        committed, tracked = await self.copier.coord.open_root(self._open_root, self.root)
        self.copier.committed = {s: self.root / self.layout.dir_name(s) for s in committed}
        if self.layout.tracker_name is not None and self.copier.coord.leader:
            baseline = max([s for s in (tracked, *committed) if s is not None], default=None)
            self.copier.tracker = TrackerWriter(
                self.fs, self.root / self.layout.tracker_name, baseline
            )

    async def persist_newest(self) -> int | None:
        """Queue the newest local checkpoint for the persistent tier, whatever
        the tier's policy says, when it is newer than the newest persistent one
        and not already being copied: the memory tier's last act, at close or
        when its trainer died (``asyncsave._saverproc``). Every rank decides from
        the same committed steps (commits are collective).

        :returns: the step queued, or ``None``.
        """
        committed = [s for s in self.saver.committed if s not in self.saver.held]
        newest = max(self.saver.committed, default=None)
        if newest is None or newest not in committed:
            return None
        if newest <= max(self.copier.committed, default=-1):
            return None
        assert self._slots is not None
        await self._slots.acquire()
        self._queue_committed(newest)
        logger.info("persisting the newest local step %d before the saver ends", newest)
        return newest

    def catch_up(self) -> list[int]:
        """Persist the local checkpoints a previous run left due but not persisted
        (it crashed, or its copy failed): the local steps newer than the newest
        persistent one that the tier's policy picks, the newest ``queue_size`` of
        them, in step order. Called once the checkpointer is open; every rank
        decides from the same lists (rank 0's, broadcast at open).

        :returns: the steps queued.
        """
        newest = max(self.copier.committed, default=-1)
        policy = self.tier.policy
        due = [
            s
            for s in sorted(self.saver.committed)
            if s > newest and (policy is None or policy.should_save(s))
        ][-self.tier.queue_size :]
        assert self._slots is not None
        for step in due:
            self._slots.acquire_nowait()
            self._queue_committed(step)
        if due:
            logger.info("persisting local steps %s left unpersisted by an earlier run", due)
        return due

    def _queue_committed(self, step: int) -> None:
        """Copy the committed local checkpoint of ``step`` behind, its queue slot
        taken by the caller; held from retention until it is persisted, checked
        against a persistent step of the same number (``check``)."""
        assert self.saver.tg is not None
        path = self.saver.root / self.layout.dir_name(step)
        handle = SaveHandle.resolved(step, _bare_info(step, path))
        handle.due_to_persist = True
        self.saver.held[step] = handle
        turn = self._turns.take()
        self.saver.tg.start_soon(self._persist, step, handle, turn, False, True)

    async def _open_root(self) -> tuple[list[int], int | None]:
        def run() -> tuple[list[int], int | None]:
            fd = lock_root(self.fs, self.root, lock=self.saver.options.lock)
            try:
                # A copy abandoned by an earlier checkpointer of this process (past
                # close_timeout_s) may still be writing: recovery would remove its
                # temporary directory (on object stores, the final prefix) under it.
                if not self.final_lock.acquire(timeout=self.saver.options.close_timeout_s):
                    raise RootInUseError(
                        f"a copy to {self.root} abandoned by an earlier Checkpointer in "
                        "this process is still running after close_timeout_s="
                        f"{self.saver.options.close_timeout_s}; try again once it finishes",
                        path=self.root,
                    )
                try:
                    recovered = recover(self.fs, self.root, self.layout)
                finally:
                    self.final_lock.release()
            except BaseException:
                if fd is not None:
                    self.fs.unlock(fd)
                raise
            self._lock_fd = fd
            return list(recovered.committed), recovered.tracked

        result: tuple[list[int], int | None] = await anyio.to_thread.run_sync(run)
        return result

    def close(self) -> None:
        """Release the persistent root's lock and the gloo group (idempotent)."""
        fd, self._lock_fd = self._lock_fd, None
        if fd is not None:
            self.fs.unlock(fd)
        self.copier.coord.close()

    # -- saving -------------------------------------------------------------------
    async def reserve(self, step: int) -> None:
        """If ``step`` is due to persist, take its slot in the persisting queue,
        waiting while ``queue_size`` copies are outstanding. Called by
        ``save()`` inside its planning lock, last before :meth:`dispatch` (which
        makes the save pending without yielding first): while a save waits for a
        slot no other ``save()`` is admitted, so the same step is never saved
        twice and later steps never take their turn first. The save counts as
        admitted meanwhile (the planning lock's gate in ``saver.queued``): a close
        begun meanwhile waits for it and flushes it.

        :raises CheckpointerClosedError: close gave up after ``close_timeout_s``
            while this waited.
        """
        policy = self.tier.policy
        if policy is not None and not policy.should_save(step):
            return
        assert self._slots is not None
        await self._slots.acquire()
        if not self.saver.accepting:
            self._slots.release()
            raise CheckpointerClosedError(
                f"the Checkpointer for {self.saver.root} gave up after close_timeout_s="
                f"{self.saver.options.close_timeout_s} while the save of step {step} "
                "waited for a slot in the persisting queue",
                step=step,
                path=self.saver.root,
            )
        self._reserved.add(step)

    async def dispatch(self, step: int, job: Any, **kwargs: Any) -> SaveHandle:
        """:meth:`Saver.dispatch` (same arguments); if :meth:`reserve` took a
        queue slot for ``step``, persist the save once it is committed locally."""
        overwrite = bool(kwargs.get("overwrite", False))
        start = functools.partial(self.saver.dispatch, step, job, **kwargs)
        if step not in self._reserved:
            return await start()
        self._reserved.discard(step)
        assert self._slots is not None
        try:
            handle = await start()
        except BaseException:
            self._slots.release()
            raise
        if handle.skipped or handle.due_to_persist:  # nothing (more) to copy
            self._slots.release()
            return handle
        handle.due_to_persist = True
        self.saver.held[step] = handle
        turn = self._turns.take()
        assert self.saver.tg is not None
        self.saver.tg.start_soon(self._persist, step, handle, turn, overwrite)
        return handle

    async def _persist(
        self, step: int, handle: SaveHandle, turn: int, overwrite: bool, check: bool = False
    ) -> None:
        scope = anyio.CancelScope(shield=True)  # only a close that gives up cancels it
        info: CheckpointInfo | None = None
        error: BaseException | None = None
        try:
            with scope, self.saver.abandonable(scope):
                try:
                    await handle._done.wait()
                    await self._turns.wait(turn)
                    local = handle.result()  # raises the local save's own error
                    assert local is not None
                    with anyio.fail_after(self.tier.timeout_s):
                        path = await self.copier.copy(step, local.path, overwrite, check)
                    if path is not None:
                        info = dataclasses.replace(local, path=path)
                except SaveFailedError as exc:
                    error = exc
                except TimeoutError as exc:
                    error = CheckpointTimeoutError(
                        f"persisting step {step} to {self.root} took over "
                        f"Tier.timeout_s={self.tier.timeout_s}",
                        step=step,
                        path=self.root,
                    )
                    error.__cause__ = exc
                except Exception as exc:
                    error = SaveFailedError(
                        f"persisting step {step} to {self.root} failed: {exc!r} (the local "
                        "checkpoint is committed and kept)",
                        step=step,
                        path=getattr(exc, "filename", None) or self.root,
                    )
                    error.__cause__ = exc
            if scope.cancelled_caught:
                error = CheckpointTimeoutError(
                    f"persisting step {step} was abandoned when close_timeout_s ran out",
                    step=step,
                    path=self.root,
                )
        finally:
            if error is not None and not handle._error:
                assert isinstance(error, SaveFailedError)
                self.saver.set_failure(error)
                logger.error("%s", error, exc_info=error.__cause__)
            handle._persist_done(info, error)
            if self.saver.held.get(step) is handle:
                del self.saver.held[step]
                if info is not None and self.saver.owns_root and not scope.cancel_called:
                    # Released: the local rule may retire it now, not only after
                    # the next local commit (a small /dev/shm tier).
                    with anyio.CancelScope(shield=True):
                        await self.saver.retain(self.saver.tracked_step or step)
            assert self._slots is not None
            self._slots.release()
            self._turns.end(turn)


class Copier:
    """The copy of committed local checkpoints to the persistent root, in the
    order the :class:`Persister` hands them over, and what follows each commit
    there: that tier's tracker and retention. One save at a time; rank 0 copies
    a checkpoint of a shared local root, every rank its own part of a node-local
    one (:meth:`_copy_ranks`); every rank hears the outcome.

    ``coord``, ``tracker`` and ``committed`` (the persistent steps) are set by
    :meth:`Persister.open`.
    """

    def __init__(
        self,
        tier: Tier,
        saver: Saver,
        fs: LocalFileSystem,
        root: Path,
        strategy: CommitStrategy,
        final_lock: threading.Lock,
    ) -> None:
        self.tier = tier
        self.saver = saver
        self.fs = fs
        self.root = root
        self.layout = saver.layout
        self.strategy = strategy
        self.final_lock = final_lock
        self.coord: Coordinator = Solo()
        self.tracker: TrackerWriter | None = None
        self.committed: dict[int, Path] = {}

    async def copy(self, step: int, src: Path, overwrite: bool, check: bool) -> Path | None:
        """Rank 0 copies and commits, moves the tracker, applies retention; every
        rank hears the outcome. ``None``: not copied (``check`` found ``src``
        damaged; logged)."""
        if self.saver.per_rank:
            return await self._copy_ranks(step, src, overwrite, check)
        t0 = time.perf_counter()
        final = self.root / self.layout.dir_name(step)

        async def copy() -> bool:
            copied: bool = await self._run(self._copy_sync, step, src, overwrite, check)
            return copied

        def failure(cause: str) -> Exception:
            return SaveFailedError(f"rank 0: {cause}", step=step, path=final, rank=0)

        if not await self.coord.from_leader("persisted", step, copy, failure=failure):
            return None
        self.committed[step] = final
        logger.info("persisted step %d to %s in %.3f s", step, final, time.perf_counter() - t0)
        return final

    async def _run(self, func: Any, *args: Any) -> Any:
        return await anyio.to_thread.run_sync(func, *args, abandon_on_cancel=True)

    def _copy_sync(self, step: int, src: Path, overwrite: bool, check: bool) -> bool:
        """Copy, track, retain; whether it copied. ``check``: verify every byte of
        ``src`` first, and copy nothing if it is damaged (a checkpoint an earlier
        run left, which may have rotted since; a save just committed is not
        checked twice)."""
        if check:
            try:
                verify(src, filesystem=self.saver.fs)
            except (CorruptCheckpointError, CheckpointNotFoundError) as exc:
                logger.warning("not persisting %s, left by an earlier run: %s", src, exc)
                return False
        # Copy, commit, track and retain under the root's lock: a thread abandoned
        # past close_timeout_s finishes before a reopened tier recovers the root.
        with self.final_lock:
            final = self.root / self.layout.dir_name(step)
            there = self.fs.exists(final) and self.strategy.passed_commit(self.fs, final)
            if there and not overwrite:
                # Resumed from this tier and saved again, or a copy a crash kept from
                # being recorded: the same checkpoint, kept as is. Another run's
                # step of the same number is refused (typed), never counted as this
                # save's persistent copy.
                self._check_same(step, src, final, rank=None)
                logger.info("step %d is on the persistent tier already: not copied again", step)
            else:
                copy_checkpoint(
                    self.saver.fs,
                    src,
                    self.fs,
                    self.root,
                    self.layout,
                    step,
                    overwrite=there,
                    threads=self.saver.options.writer_threads,
                    strategy=self.strategy,
                )
            self._after_commit(step)
        return True

    def _after_commit(self, step: int) -> None:
        """Move the persistent tracker to ``step``, apply the persistent retention."""
        if self.tracker is not None:
            self.tracker.advance(step)
        rule = self.tier.retention
        if rule is None:
            return

        def protected() -> Iterable[int]:
            steps = {step, *self.saver.held}
            if self.tracker is not None and self.tracker.highest is not None:
                steps.add(self.tracker.highest)
            resumed = self.saver.resumed_step
            if resumed is not None and resumed >= step:  # kept until a newer one commits
                steps.add(resumed)
            return steps

        try:
            for gone in apply_retention(self.fs, self.root, self.layout, rule, protected):
                self.committed.pop(gone, None)
        except OSError as exc:
            logger.warning("persistent retention failed (re-applied next time): %r", exc)

    # -- local_scope="rank": every rank copies its own part --------------------------
    async def _copy_ranks(self, step: int, src: Path, overwrite: bool, check: bool) -> Path | None:
        """The N-rank commit protocol on the persistent tier, from private local
        roots: rank 0 makes the temporary directory (on object stores: the final
        prefix) or finds the step committed there already; every rank copies its
        own committed local files into it (fsynced) and sends its part of the
        manifest; rank 0 checks every rank's files are there, writes the merged
        manifest (the one a save of N ranks into a shared root writes), commits,
        tracks and retains; every rank hears the outcome. ``None``: not copied
        (``check`` found a rank's local part damaged; logged)."""
        coord, t0 = self.coord, time.perf_counter()
        final = self.root / self.layout.dir_name(step)

        def failure(cause: str) -> Exception:
            return SaveFailedError(
                f"persisting step {step} failed: rank 0: {cause}", step=step, path=final, rank=0
            )

        begin = functools.partial(self._run, self._begin, step, overwrite)
        name, exchange = await coord.from_leader("persist-begin", step, begin, failure=failure)
        tmp = None if name is None else self.root / name
        views, raw = await self._upload_all(step, src, tmp, check)
        finish = functools.partial(self._run, self._finish, step, views, raw, tmp, exchange)
        if not await coord.from_leader("persisted", step, finish, failure=failure):
            return None
        self.committed[step] = final
        logger.info(
            "rank %d: persisted step %d to %s in %.3f s",
            coord.rank,
            step,
            final,
            time.perf_counter() - t0,
        )
        return final

    def _check_same(self, step: int, src: Path, final: Path, *, rank: int | None) -> None:
        """That the committed persistent ``final`` is the checkpoint at local
        ``src``: this run resumed from that step, or both hold the same data (each
        entry's size and checksum, and the tree; with ``rank``, ``src`` is that
        rank's local part, compared with that rank's range of ``final``).

        :raises CheckpointError: another checkpoint of the same step is there
            (another run's, say, after a replaced node started over): not
            replaced without ``overwrite=True``, and not reported as persisted.
        """
        if self.saver.resumed_step == step:
            return
        mine = read_checkpoint(self.saver.fs, src, expect_step=step)
        raw = self.fs.read_bytes(final / MANIFEST_NAME)
        theirs = parse_manifest(raw, final / MANIFEST_NAME)
        entries: list[dict[str, Any]] = theirs.entries
        tree: Any = theirs.tree
        if rank is not None and theirs.world_size > 1:
            ranks = json.loads(raw).get("ranks")
            try:
                first, end = ranks[rank]["entries"]
                entries, tree = entries[first:end], ranks[rank]["tree"]
            except (TypeError, KeyError, IndexError, ValueError):
                entries, tree = [], None  # not a checkpoint of this rank's part
        if _data_of(mine.entries) == _data_of(entries) and mine.tree == tree:
            return
        raise CheckpointError(
            f"{final} is a committed checkpoint of step {step} with other data than this "
            f"save's ({src}), from another run or an earlier life of this one: not "
            "replaced, and this save is not persisted. Resume from it (load_latest) "
            "or save that step with overwrite=True to replace it",
            step=step,
            path=final,
        )

    def _begin(self, step: int, overwrite: bool) -> tuple[str | None, bool]:
        """Rank 0: (the temporary directory's name, whether the commit replaces a
        committed step), or ``(None, False)``: committed there already, kept."""
        final = self.root / self.layout.dir_name(step)
        there = self.fs.exists(final) and self.strategy.passed_commit(self.fs, final)
        if there and not overwrite:
            # Every rank checks its part against it (_upload).
            logger.info("step %d is on the persistent tier already: not copied again", step)
            return None, False
        if there:
            self.strategy.check_overwrite(self.fs, final, step)
        return self.strategy.begin(self.fs, self.root, step, final).name, there

    def _upload(
        self, src: Path, tmp: Path | None, check: bool, step: int
    ) -> tuple[str, Any, bytes | None]:
        """This rank: copy its committed local part ``src`` into ``tmp`` (data
        files, and rank 0 the layout's info file); ``("ok", part, manifest)``, or
        ``("skipped", why, None)`` when ``check`` finds ``src`` damaged. With no
        ``tmp`` (the step is committed there already) it checks that its part is
        this rank's part of that checkpoint (:meth:`_check_same`). The
        manifest is read first and the files it names copied at its sizes (see
        :func:`copy_checkpoint`); rank 0 merges the bytes read then."""
        sfs = self.saver.fs
        if check:
            try:
                verify(src, filesystem=sfs)
            except (CorruptCheckpointError, CheckpointNotFoundError) as exc:
                logger.warning("not persisting %s, left by an earlier run: %s", src, exc)
                return "skipped", repr(exc), None
        if tmp is None:
            final = self.root / self.layout.dir_name(step)
            self._check_same(step, src, final, rank=self.coord.rank)
            return "ok", None, None
        raw = sfs.read_bytes(src / MANIFEST_NAME)
        manifest = parse_manifest(raw, src / MANIFEST_NAME)
        named = {f.name: f.nbytes for f in stored_files(manifest)}
        names = list(named)
        info = self.layout.info_name
        if self.coord.leader and info is not None and sfs.exists(src / info):
            names.append(info)
        threads = self.saver.options.writer_threads
        _copy_named(sfs, src, self.fs, tmp, names, named, threads)
        part = {k: getattr(manifest, k) for k in ("files", "entries", "tensors", "tree")}
        return "ok", part, raw

    async def _upload_all(
        self, step: int, src: Path, tmp: Path | None, check: bool
    ) -> tuple[list[tuple[str, Any]], bytes | None]:
        """Every rank uploads its part (:meth:`_upload`): every rank's outcome, by
        rank, and this rank's manifest as read (kept here: rank 0 merges its
        own); if any rank failed, rank 0 removes the temporary directory and
        every rank raises naming the failed ones."""
        raw: list[bytes | None] = [None]

        async def upload() -> tuple[str, Any]:
            kind, part, raw[0] = await self._run(self._upload, src, tmp, check, step)
            return kind, part

        try:
            views: list[tuple[str, Any]] = await self.coord.map_reduce(
                "persist-files",
                step,
                upload,
                doing="persisting",
                path=self.root / self.layout.dir_name(step),
            )
        except Exception:
            if self.coord.leader and tmp is not None:
                await self._run(discard, self.fs, tmp)
            raise
        return views, raw[0]

    def _finish(
        self,
        step: int,
        views: list[tuple[str, Any]],
        raw: bytes | None,
        tmp: Path | None,
        exchange: bool,
    ) -> bool:
        """Rank 0, once every rank copied: the merged manifest (from ``raw``, its
        own manifest as read before its copy), the commit, the tracker, the
        retention, under the persistent root's ``final_lock``. Whether it
        committed (not: a rank's part was ``"skipped"``)."""
        with self.final_lock:
            return self._finish_locked(step, views, raw, tmp, exchange)

    def _finish_locked(
        self,
        step: int,
        views: list[tuple[str, Any]],
        raw: bytes | None,
        tmp: Path | None,
        exchange: bool,
    ) -> bool:
        try:
            if any(v[0] == "skipped" for v in views):
                if tmp is not None:
                    discard(self.fs, tmp)
                return False
            if tmp is not None:
                parts = [v[1] for v in views]
                assert raw is not None
                own = json.loads(raw)
                own.pop(SELF_CHECKSUM, None)
                doc = {**own, **merge_parts(parts)} if len(parts) > 1 else own
                check_visible(self.fs, tmp, parts)
                final = self.root / self.layout.dir_name(step)
                self.strategy.publish(self.fs, tmp, final, encode_manifest(doc), overwrite=exchange)
                tmp = None
        except BaseException:
            if tmp is not None:
                discard(self.fs, tmp)
            raise
        self._after_commit(step)
        return True


def _bare_info(step: int, path: Path) -> CheckpointInfo:
    """The info of a committed checkpoint found on disk (its costs unknown)."""
    return CheckpointInfo(step=step, path=path, nbytes=0, num_tensors=0)


def _data_of(entries: list[dict[str, Any]]) -> list[tuple[int, str]]:
    """The sizes and checksums of manifest entries, sorted: the same data
    whatever the file layout."""
    return sorted((e["nbytes"], e[CHECKSUM]) for e in entries)


def _clashes(outer: Path, inner: Path, layout: Layout) -> bool:
    """Whether root ``inner`` lies inside root ``outer`` under a name that
    ``outer``'s recovery, retention or listing acts on (a step directory's, a
    temporary, retired or moved-aside one's, the tracker, the lock). A plain
    subdirectory (``exp1/persistent``) is left alone by both roots."""
    if not inner.is_relative_to(outer):
        return False
    first = inner.relative_to(outer).parts[0]
    return (
        layout.parse_dir_name(first) is not None
        or is_temp_name(first)
        or first.startswith(".asyncsave")
        or first in (layout.tracker_name, layout.info_name)
    )
