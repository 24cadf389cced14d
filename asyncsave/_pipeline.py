"""The one save pipeline: stage → write → gather → commit → track → retain.

Every save, of one process or of N ranks, runs here, parameterised by two roles:
a *coordinator* (``asyncsave._coord``: :class:`~asyncsave._coord.Solo`, the world
of one where collectives are identities, or asyncsave's gloo group) and a *job*
(``asyncsave._jobs``: a plain tree, whole or streamed; DTensor state through
DCP; a Megatron request). On every rank, in the order of the ``save()`` calls:

A. the leader (rank 0) creates the temporary directory; its name (or the
   leader's error) is broadcast;
B. every rank writes and fsyncs its own files into it; then every rank's outcome
   is gathered (its part of the manifest, or its error). If any rank failed, no
   rank commits: each raises naming every failed rank (one process raises its own
   error) and the leader removes the temporary directory;
C. the leader writes the merged manifest, fsyncs, renames to the final name (or
   writes the commit marker last, on object stores), moves the tracker, and
   broadcasts the outcome: committed, committed but the tracker failed, or not
   committed. Every rank's handle resolves after that broadcast. Retention
   follows on the leader, outside the save's deadline.

A save streamed through a small budget writes its files before its turn: one
process into the save's temporary directory (made then; phase A takes it as it
is), a rank of several into a directory of its own, whose files it moves into
the shared one in phase B. A save written while it is staged (``overlap_writes``:
``_jobs.FollowingJob``) writes into a directory of its own on every rank
(made by its writers' task, so that a hung file system never holds ``save()``),
moved in phase B too.

With ``Tier(local_scope="rank")`` (``Saver.per_rank``) every rank has a root of
its own (a node-local disk): in A and B each rank writes its own temporary
directory, in C each commits its own part as a checkpoint of one rank, tracks
and retains it, and the commit outcomes are gathered (``asyncsave._tiers``
persists the parts as one N-rank checkpoint).

Each pipeline runs shielded from the caller's cancellation, bounded by
``save_timeout_s``. Once the leader's commit thread may rename, the temporary
directory is never removed under it (a thread abandoned at the deadline leaves it
to the next open). Foreign errors (an ``OSError``, a worker that died) become a
:class:`SaveFailedError` in :func:`as_save_error`; a collective's error is
translated by the coordinator.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import logging
import math
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import anyio.abc
import anyio.to_thread
import torch

from ._atomicity import CommitStrategy, discard, strategy_for
from ._coord import Coordinator, Solo
from ._errors import (
    CheckpointerClosedError,
    CheckpointError,
    CheckpointTimeoutError,
    RankFailedError,
    SaveFailedError,
)
from ._fs import LocalFileSystem
from ._handle import SaveHandle
from ._jobs import Job
from ._manifest import encode_manifest
from ._options import CheckpointOptions
from ._paths import MANIFEST_NAME, Layout
from ._policy import signal_holds
from ._retention import apply_retention
from ._stage import StagingPool
from ._track import TrackerWriter
from ._types import CheckpointInfo
from ._write import write_bytes

__all__ = ["Saver", "WorkerDiedError", "as_save_error"]

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class _Save:
    """One save, from its admission to its pipeline."""

    handle: SaveHandle
    job: Job | BaseException  # an exception: this rank failed before its snapshot
    ticket: int
    t0: float
    ready: dict[torch.device, Any] | None
    overwrite: bool
    lazy: bool
    training_info: dict[str, Any]
    tmp: Path | None = None  # the temporary directory, if made before the turn
    private: Path | None = None  # this rank's own directory for streamed rounds
    stage_seq: int = 0  # staging runs one save at a time, in save() order
    blocked_s: float | None = None  # lazy: how long save() held the caller


class Saver:
    """What the saves of one checkpointer share: its root, roles and bookkeeping.

    The :class:`~asyncsave.Checkpointer` admits saves and owns the lifecycle; this
    object stages them (:meth:`dispatch`) and runs their pipeline.
    """

    strategy: CommitStrategy  # the root's commit strategy (set with ``fs``)

    def __init__(
        self, fs: LocalFileSystem, root: Path, layout: Layout, options: CheckpointOptions
    ) -> None:
        self.fs = fs  # and the root's commit strategy, chosen from it (see the setter)
        self.root = root
        self.layout = layout
        self.options = options
        self.coord: Coordinator = Solo()
        self.state = "new"
        self.pool: StagingPool | None = None
        self.limiter: anyio.CapacityLimiter | None = None
        self.tracker: TrackerWriter | None = None
        self.tg: anyio.abc.TaskGroup | None = None
        self.accepting = False  # whether the task group takes new pipelines
        self.gave_up = False  # close gave up after close_timeout_s (give_up)
        self.pending: dict[int, SaveHandle] = {}
        # Overwrites and updates admitted while an earlier save of their step is
        # pending (see queue_behind): each gate is set when it stops waiting.
        self.queued: dict[anyio.Event, int] = {}
        self.scopes: dict[int, anyio.CancelScope] = {}
        # Shielded scopes of accepted saves that are still staging (a lazy save's
        # staging task, a streamed round's write): cancelled only when close gives up.
        self.staging_scopes: set[anyio.CancelScope] = set()
        self.committed: dict[int, CheckpointInfo | None] = {}
        self.lazy: dict[int, SaveHandle] = {}  # lazy saves not yet staged
        # Saves due to persist whose persistent copy is not committed yet
        # (``asyncsave._tiers``): retention keeps them, close waits for them.
        self.held: dict[int, SaveHandle] = {}
        # Each rank's own root (``Tier(local_scope="rank")``): every rank commits
        # its own part as a checkpoint of one rank, tracks and retains it.
        self.per_rank = False
        self.failure: SaveFailedError | None = None
        self.resumed_step: int | None = None
        # Held inside worker threads by everything that renames or removes a final
        # directory (commit, retention, update, recovery at open): a thread abandoned
        # at a deadline keeps it until it finishes, so no later thread can race it,
        # not even one of a later checkpointer on the same root in this process.
        self.final_lock = _final_lock_for(root)
        # Staging order: saves stage (and lease the one arena) in the order of
        # their save() calls. A lazy save stages in the background, so a later
        # eager save could otherwise lease the arena first, and then wait for its
        # collective turn behind the lazy one, which waits for the arena.
        self._stage_next = 0
        self._stage_serving = 0
        self._stage_ended: set[int] = set()
        self._stage_changed = anyio.Event()

    @property
    def fs(self) -> LocalFileSystem:
        """The root's I/O layer."""
        return self._fs

    @fs.setter
    def fs(self, fs: LocalFileSystem) -> None:
        self._fs = fs
        # How a save commits on this root (rename, or a marker on object
        # stores): chosen once here; the pipeline asks it, never the storage.
        self.strategy = strategy_for(fs)

    @property
    def state(self) -> str:
        """The checkpointer's lifecycle: ``new``, ``open``, ``closing``, ``closed``."""
        return self._state

    @state.setter
    def state(self, state: str) -> None:
        self._state = state
        # A signal policy that caught its signal keeps its handlers until every
        # checkpointer open at the end of its block is closed, so flushed.
        if state == "open":
            signal_holds.opened(self)
        elif state == "closed":
            signal_holds.closed(self)

    # -- bookkeeping ----------------------------------------------------------------
    def check_usable(self) -> None:
        if self.state != "open":
            raise CheckpointerClosedError(
                f"the Checkpointer for {self.root} is {self.state}; use it inside `async with`",
                path=self.root,
            )
        if self.failure is not None:
            raise self.failure

    def check_flushing(self, step: int) -> None:
        """Raise if close gave up (``close_timeout_s``) while the accepted save of
        ``step`` was still before its pipeline: the task group takes no new task.

        Close stops taking pipelines only once every pending save has resolved, or
        once it gave up; an accepted save is pending until it resolves, so this
        raises only in the second case."""
        if not self.accepting:
            raise CheckpointerClosedError(
                f"the Checkpointer for {self.root} gave up on step {step} after "
                f"close_timeout_s={self.options.close_timeout_s}, before its snapshot "
                "was taken",
                step=step,
                path=self.root,
            )

    @contextlib.contextmanager
    def abandonable(self, scope: anyio.CancelScope) -> Iterator[None]:
        """Let a close that gives up after ``close_timeout_s`` cancel ``scope`` (a
        shielded part of an accepted save that runs before its pipeline)."""
        self.staging_scopes.add(scope)
        try:
            yield
        finally:
            self.staging_scopes.discard(scope)

    def busy(self, step: int) -> bool:
        """Whether a save or update of ``step`` is pending, or its committed
        directory is being copied to the persistent tier (``held``)."""
        return step in self.pending or step in self.held

    async def queue_behind(self, step: int, what: str) -> None:
        """Wait until no save (or update) of ``step`` is pending and no copy of it
        to the persistent tier is queued or running (``held``): an ``overwrite``
        save or an ``update()`` admitted while an earlier one of its step runs, or
        while the persistent tier copies the directory it would swap.

        Admitted already (the checkpointer was open when it was called): queued,
        so close waits for it and flushes it like a pending save, and no
        check after this asks whether close began or another save failed since.
        The caller registers its own pending handle before it next awaits, so
        close, woken by the gate, then finds it pending.

        :raises CheckpointerClosedError: close gave up after ``close_timeout_s``
            while this waited (the task group takes no new save).
        """
        gate = anyio.Event()
        self.queued[gate] = step
        try:
            while True:
                if (pending := self.pending.get(step)) is not None:
                    await pending._done.wait()
                elif (held := self.held.get(step)) is not None:
                    await held._persisted.wait()
                else:
                    break
            if not self.accepting:
                raise CheckpointerClosedError(
                    f"the Checkpointer for {self.root} gave up after close_timeout_s="
                    f"{self.options.close_timeout_s} while this {what} of step {step} "
                    "waited for the earlier save of its step",
                    step=step,
                    path=self.root,
                )
        finally:
            del self.queued[gate]
            gate.set()

    def give_up(self) -> None:
        """Close gave up (``close_timeout_s``): before its pipelines are
        cancelled, saves waiting for the staging memory are told so
        (``StagingPool.give_up``)."""
        self.gave_up = True
        if self.pool is not None:
            self.pool.give_up()

    def abandoned_error(self, step: int, path: Path | None) -> SaveFailedError:
        """The error of a save whose pipeline was cancelled before it committed:
        close gave up after ``close_timeout_s``, or the cancellation came from
        outside asyncsave (the event loop torn down during the close's flush, as a
        second Ctrl-C does under asyncio)."""
        if self.gave_up:
            return CheckpointTimeoutError(
                f"save of step {step} was abandoned when close_timeout_s="
                f"{self.options.close_timeout_s} ran out",
                step=step,
                path=path,
            )
        return SaveFailedError(
            f"save of step {step} was interrupted before it committed: it was cancelled "
            "from outside asyncsave (a second Ctrl-C or KeyboardInterrupt during the "
            "close's flush, or the event loop shut down); the last committed checkpoint is kept "
            "and this save's temporary directory is removed at the next open. To keep "
            "such a save, let the flush finish (at most close_timeout_s="
            f"{self.options.close_timeout_s} s), or stop the loop with "
            "asyncsave.SaveOnSignal(signal.SIGINT): Ctrl-C then saves at the next step "
            "and a repeat during the flush is absorbed",
            step=step,
            path=path,
        )

    def set_failure(self, error: SaveFailedError) -> None:
        if self.failure is None:
            self.failure = error

    def fail(self, handle: SaveHandle, error: SaveFailedError) -> None:
        self.set_failure(error)
        handle._fail(error)
        logger.error("%s", error, exc_info=error.__cause__)

    @property
    def owns_root(self) -> bool:
        """Whether this rank commits, tracks and retains in ``root``."""
        return self.coord.leader or self.per_rank

    @property
    def tracked_step(self) -> int | None:
        return None if self.tracker is None else self.tracker.highest

    # -- worker threads -----------------------------------------------------------
    async def run(
        self, func: Any, *args: Any, limiter: anyio.CapacityLimiter | None = None
    ) -> Any:
        """Blocking I/O in a worker thread (one of ``writer_threads``, or of
        ``limiter``); a thread stuck past the save's deadline is abandoned. Threads that rename or remove final directories (commit,
        retention, update) hold ``final_lock`` while they do, so an abandoned one
        finishes before any other can touch a final directory. A worker that dies
        (see :func:`_in_worker`) becomes an ordinary save failure."""
        return await anyio.to_thread.run_sync(
            _in_worker, func, *args, limiter=limiter or self.limiter, abandon_on_cancel=True
        )

    def start_soon(self, func: Any, *args: Any) -> None:
        """Run ``func(*args)`` as a task of the checkpointer's group (a job's
        background part: close waits for it; it bounds and shields itself)."""
        assert self.tg is not None
        self.tg.start_soon(func, *args)

    def under_final_lock(self, func: Any, *args: Any) -> Any:
        with self.final_lock:
            return func(*args)

    async def discard(self, tmp: Path | None) -> None:
        if tmp is None:
            return
        with anyio.CancelScope(shield=True), anyio.move_on_after(30):
            await anyio.to_thread.run_sync(
                _in_worker, discard, self.fs, tmp, abandon_on_cancel=True
            )

    async def make_tmp(self, step: int) -> Path:
        final = self.root / self.layout.dir_name(step)
        path: Path = await self.run(self.strategy.begin, self.fs, self.root, step, final)
        return path

    async def track(self, step: int) -> None:
        """Move the tracker to ``step`` unless it already names a newer one."""
        if self.tracker is not None:
            await self.run(self.tracker.advance, step)

    async def retain(self, step: int) -> None:
        """Apply the retention rule after the commit of ``step`` (never
        before: https://github.com/verl-project/verl/issues/4667, https://github.com/NovaSky-AI/SkyRL/pull/2145), bounded by ``save_timeout_s``.

        ``step`` itself is never retired by its own pass: its handle resolves to a
        directory that exists (a late, older step is retired by the next pass). A
        failure or a timeout is logged, not raised: the new checkpoint is committed
        and safe, nothing is lost, and the rule is re-applied from what is on disk
        after the next commit."""
        rule = self.options.retention
        if rule is None:
            return

        def protected() -> set[int]:
            # Read under the final-directory lock, in the worker thread: a save or
            # update that starts later commits under the same lock, after this pass.
            steps = {step, *self.pending, *self.held}
            if self.tracked_step is not None:
                steps.add(self.tracked_step)
            return steps

        removed: list[int] = []
        # Not shielded: close_timeout_s may abandon a slow pass (its thread holds the
        # final-directory lock until it finishes, so nothing races it).
        with anyio.move_on_after(self.options.save_timeout_s):
            try:
                removed = await self.run(
                    self.under_final_lock,
                    apply_retention,
                    self.fs,
                    self.root,
                    self.layout,
                    rule,
                    protected,
                )
            except OSError as exc:
                logger.warning("retention failed (re-applied after the next commit): %r", exc)
        for gone in removed:
            self.committed.pop(gone, None)

    # -- admission -----------------------------------------------------------------
    async def dispatch(
        self,
        step: int,
        job: Job | BaseException,
        *,
        t0: float,
        ready: dict[torch.device, Any] | None = None,
        overwrite: bool = False,
        lazy: bool = False,
        training_info: dict[str, Any] | None = None,
        ticket: int | None = None,
        tmp: Path | None = None,
    ) -> SaveHandle:
        """Stage ``job`` (eager: before this returns; lazy: in the background) and
        start its pipeline. ``job`` is an exception when this rank's ``save()``
        failed before a job existed: with several ranks it still takes part in the
        collectives, so that every rank raises naming it; the exception is raised
        here once they have heard it. ``ticket`` and ``tmp``: taken and made
        already (Megatron's ``prepare``)."""
        if isinstance(job, BaseException) and self.coord.world_size == 1:
            raise job
        handle = SaveHandle(step)
        if isinstance(job, Job):
            handle._progress.total_bytes = job.nbytes
            job.progress = handle._progress
            job.lazy = lazy
        self.pending[step] = handle
        if ticket is None:
            ticket = self.coord.take_ticket()
        save = _Save(handle, job, ticket, t0, ready, overwrite, lazy, training_info or {}, tmp)
        save.stage_seq, self._stage_next = self._stage_next, self._stage_next + 1
        if not lazy or isinstance(job, BaseException):
            await self._snapshot(save)
            return handle
        assert self.tg is not None
        try:
            where = job.eager_copies()
            if where == "thread":
                # Host clones of 1,000s of small tensors: in a worker thread, so the
                # loop keeps ticking (CUDA clones stay on the caller's stream). With
                # nothing to clone, no thread: its wake-ups cost ms on busy cores.
                await anyio.to_thread.run_sync(job.snapshot_eager, ready)
            elif where == "loop":
                job.snapshot_eager(ready)
        except BaseException as exc:
            # The caller is still in save(): it hears of it (a cancellation, too);
            # the checkpointer goes on.
            self._snapshot_failed(save, exc, heard=True)
            raise
        self.lazy[step] = handle
        save.blocked_s = time.perf_counter() - t0
        self.tg.start_soon(self._snapshot_in_background, save)
        return handle

    async def _snapshot_in_background(self, save: _Save) -> None:
        """A lazy save's staging, as a task of the checkpointer's group: its error
        goes to the handle (``staged()`` and ``await handle`` raise it) and makes
        the checkpointer refuse further saves, so it is never lost (invariant 3).

        Shielded: the save was accepted when ``save()`` returned its handle, so
        closing flushes it like any other pending save; only a close that
        gives up after ``close_timeout_s`` cancels it."""
        try:
            with anyio.CancelScope(shield=True) as scope, self.abandonable(scope):
                await self._snapshot(save)
        except Exception as exc:  # already the handle's and the checkpointer's failure
            logger.error("lazy save of step %d failed while staging: %r", save.handle.step, exc)
        finally:
            self.lazy.pop(save.handle.step, None)

    async def _snapshot(self, save: _Save) -> None:
        """Stage the job, then start the pipeline. On one process a failure fails
        the handle and is raised; on several ranks the pipeline still runs with the
        error, so that every rank hears of it, and then it is raised."""
        assert self.tg is not None
        job, step, handle = save.job, save.handle.step, save.handle
        try:
            try:
                while self._stage_serving != save.stage_seq:
                    await self._stage_changed.wait()
                if isinstance(job, BaseException):
                    raise job
                await job.stage(self, step, save.ready, functools.partial(self._early_tmp, save))
                handle._progress.all_staged(job.nbytes)
            finally:
                self._end_stage_turn(save.stage_seq)
            self.check_flushing(step)
        except BaseException as exc:
            if isinstance(job, Job):
                await job.settle()  # nothing of it runs under the clean-up below
            if (
                self.coord.world_size == 1
                or not isinstance(exc, Exception)
                or isinstance(exc, CheckpointerClosedError)
                or not self.accepting
            ):
                error = self._snapshot_failed(save, exc)
                if save.tmp is not None and self.owns_root:
                    await self.discard(save.tmp)
                await self.discard(save.private)
                if isinstance(exc, OSError):  # a streamed round's write: an I/O failure
                    raise error from exc
                raise
            # Several ranks: the pipeline reports it to the others; raised after.
            if isinstance(job, Job):
                if job.staging_lost():
                    self.set_failure(SaveFailedError(f"staging of step {step} was lost"))
                job.release()
                job.abandon()
            await self.discard(save.private)
            save.job = exc
            self.tg.start_soon(self._pipeline, save, time.perf_counter() - save.t0)
            await handle._done.wait()
            if isinstance(exc, OSError):  # a streamed round's write: an I/O failure
                raise as_save_error(exc, step, save.private, self.options.save_timeout_s) from exc
            raise
        self.tg.start_soon(self._pipeline, save, time.perf_counter() - save.t0)
        handle._mark_staged()

    async def _early_tmp(self, save: _Save, own: bool = False) -> Path:
        """Where streamed rounds go before the save's turn. One process: the save's
        temporary directory itself. A rank of several (or ``own``: files written
        while staged, whose directory is made while the copy runs): a temporary
        directory of its own (the shared one is agreed in the turn, phase A),
        whose files the job moves into the shared one at phase B; removed by this
        rank on failure, or by the next open after a crash."""
        if not own and (self.coord.world_size == 1 or self.per_rank):
            save.tmp = await self.make_tmp(save.handle.step)
            return save.tmp
        save.private = private = await self.make_tmp(save.handle.step)
        # Its own entry durable before files are renamed out of it: under POSIX a
        # rename out of a directory whose entry is lost is lost with it, and the
        # commit's rename could reach the disk without it (the power-loss
        # suite's model). Off the commit's path: while the copy runs.
        await self.run(self.fs.fsync_dir, private.parent)
        return private

    def _end_stage_turn(self, seq: int) -> None:
        if seq < self._stage_serving:
            return
        self._stage_ended.add(seq)
        if self._stage_serving in self._stage_ended:
            while self._stage_serving in self._stage_ended:
                self._stage_ended.remove(self._stage_serving)
                self._stage_serving += 1
            event, self._stage_changed = self._stage_changed, anyio.Event()
            event.set()

    def _snapshot_failed(
        self, save: _Save, exc: BaseException, *, heard: bool = False
    ) -> SaveFailedError:
        # Whoever shares this handle (a duplicate save() of the same step, or a
        # close waiting for it) must hear of it: nothing else will resolve it.
        step, handle, job = save.handle.step, save.handle, save.job
        error: SaveFailedError
        if not self.accepting:  # close gave up on it (see check_flushing)
            error = CheckpointTimeoutError(
                f"save of step {step} was abandoned when close_timeout_s="
                f"{self.options.close_timeout_s} ran out, before its snapshot was taken",
                step=step,
                path=self.root,
            )
        else:
            error = SaveFailedError(
                f"save() of step {step} ended before its snapshot was taken: {exc!r}",
                step=step,
            )
        error.__cause__ = exc
        if save.lazy and not heard:
            # Nobody is in save() to hear of it: the checkpointer refuses further
            # saves, so it is raised at the next save(), wait() or close.
            self.set_failure(error)
        handle._fail(error)
        if isinstance(job, Job):
            if job.staging_lost():
                self.set_failure(error)  # the staging memory is lost for good
            job.abandon()
            job.release()
        self.coord.end_turn(save.ticket)
        self._end_stage_turn(save.stage_seq)
        if self.pending.get(step) is handle:
            del self.pending[step]
        return error

    # -- the pipeline ----------------------------------------------------------------
    async def _pipeline(self, save: _Save, staged_s: float) -> None:
        coord, fs, handle, job = self.coord, self.fs, save.handle, save.job
        step, t0 = handle.step, save.t0
        blocked_s = staged_s if save.blocked_s is None else save.blocked_s
        final = self.root / self.layout.dir_name(step)
        tmp = save.tmp
        written_s = float("nan")
        committing = False  # the leader's commit thread may be renaming
        committed = False  # renamed (or marked): only what follows can fail
        with anyio.CancelScope(shield=True) as scope:
            self.scopes[step] = scope
            try:
                with anyio.fail_after(self.options.save_timeout_s):
                    await coord.wait_turn(save.ticket)
                    local_error = job if isinstance(job, BaseException) else None
                    outcomes: list[Any]
                    # A: the temporary directory (agreed before the turn for a
                    # streamed save and for Megatron's prepare).
                    name: str | None = None if tmp is None else tmp.name
                    if self.per_rank:  # every rank in its own root
                        tmp, outcomes, written_s, local_error = await self._write_own(
                            save, local_error
                        )
                    else:
                        if tmp is None:
                            if coord.leader and local_error is None:
                                try:
                                    tmp = await self.make_tmp(step)
                                    name = tmp.name
                                except Exception as exc:
                                    local_error = exc
                            if coord.leader and local_error is not None:
                                name = f"error: {local_error!r}"
                            name = await coord.broadcast("temp-dir", name, step)
                        assert isinstance(name, str)
                        if name.startswith("error: "):
                            outcomes = [name.removeprefix("error: ")] + [None] * (
                                coord.world_size - 1
                            )
                        else:
                            tmp = self.root / name
                            # B: this rank's files, then everyone's outcome.
                            if local_error is None and not self.strategy.same_save(
                                name, step, final
                            ):
                                local_error = CheckpointError(
                                    f"rank {coord.rank} saved step {step} while rank 0 saved "
                                    f"another step ({name}): every rank must call save() with "
                                    "the same steps in the same order",
                                    step=step,
                                    rank=coord.rank,
                                )
                            part: dict[str, Any] | None = None
                            if local_error is None:
                                assert isinstance(job, Job)
                                try:
                                    part = await job.write(self, coord, tmp)
                                    handle._progress.all_written(job.nbytes)
                                except Exception as exc:
                                    local_error = exc
                            written_s = time.perf_counter() - t0
                            outcomes = await coord.all_gather(
                                "files-durable",
                                repr(local_error) if local_error is not None else ("ok", part),
                                step,
                            )
                    _raise_failure(coord, "save of", step, outcomes, local_error, tmp)
                    assert isinstance(job, Job) and tmp is not None
                    parts: list[dict[str, Any]] = [o[1] for o in outcomes]
                    if type(job).finalize is not Job.finalize:
                        # The integration's own finishing steps, after every rank's
                        # files are durable and before the commit and the tracker.
                        try:
                            await job.finalize(self, coord, tmp, parts)
                        except Exception as exc:
                            local_error = exc
                        finalized = await coord.all_gather(
                            "finalized", None if local_error is None else repr(local_error), step
                        )
                        _raise_failure(coord, "finalizing", step, finalized, local_error, tmp)
                    # C: the leader commits and moves the tracker; everyone hears.
                    outcome: tuple[str, str, bool] | None = None
                    commit_error: Exception | None = None
                    if self.owns_root:
                        try:
                            costs = {"blocked_s": blocked_s, "staged_s": staged_s}
                            costs["written_s"] = written_s
                            own = [parts[coord.rank]] if self.per_rank else parts
                            doc = await self.run(job.manifest, tmp, step, own)
                            doc["costs"] = {k: v for k, v in costs.items() if math.isfinite(v)}
                            doc["training_info"] = save.training_info
                            if self.layout.info_name is not None:
                                info_doc = {**save.training_info, "step": step}
                                await self.run(
                                    write_bytes,
                                    fs,
                                    tmp / self.layout.info_name,
                                    json.dumps(info_doc, indent=1).encode(),
                                )
                            # Encoding is CPU work (about 60 ms for 10,000 tensors): in
                            # the worker thread with the write, never on the event loop.
                            await self.run(_write_manifest, fs, tmp / MANIFEST_NAME, doc)
                            # From here on a thread abandoned at the deadline may still
                            # rename: the temp dir is left to the next open, never
                            # removed under its feet.
                            committing = True
                            await self.run(
                                self.under_final_lock,
                                functools.partial(self.strategy.commit, overwrite=save.overwrite),
                                fs,
                                tmp,
                                final,
                            )
                            committing, committed, tmp = False, True, None
                            if not self.per_rank:  # per_rank: once every rank committed
                                await self.track(step)
                        except Exception as exc:
                            committing = False  # the thread finished: nothing runs on
                            commit_error = exc
                            outcome = (
                                "committed" if committed else "failed",
                                repr(exc),
                                isinstance(exc, TimeoutError),
                            )
                    if self.per_rank:
                        await self._agree_committed(outcome, step, commit_error)
                        # Only a step every rank committed is tracked: a part some
                        # ranks lack is moved aside at the next open.
                        await self.track(step)
                    elif coord.world_size > 1:
                        try:
                            outcome = await coord.broadcast("commit", outcome, step)
                        except RankFailedError:
                            if not coord.leader and await self._committed_on_disk(final, save):
                                committed = True
                            raise
                    if commit_error is not None and (coord.world_size == 1 or committed):
                        raise commit_error
                    if outcome is not None:
                        if outcome[0] == "committed":
                            committed = True
                            kind = CheckpointTimeoutError if outcome[2] else SaveFailedError
                            raise kind(f"rank 0: {outcome[1]}", step=step, rank=0)
                        # Not committed: the leader's error, named on every rank.
                        failed = RankFailedError(
                            f"rank 0 could not commit step {step}: {outcome[1]}",
                            step=step,
                            rank=0,
                            ranks={0: outcome[1]},
                        )
                        failed.__cause__ = commit_error
                        raise failed
                    committed, tmp = True, None
                info = CheckpointInfo(
                    step=step,
                    path=final,
                    nbytes=job.nbytes,
                    num_tensors=job.num_tensors,
                    world_size=coord.world_size,
                    blocked_s=blocked_s,
                    staged_s=staged_s,
                    written_s=written_s,
                    committed_s=time.perf_counter() - t0,
                    training_info=save.training_info,
                )
                self.committed[step] = info
                try:
                    if self.owns_root:
                        # Outside the save's deadline: the save is committed and
                        # tracked, a slow delete must not fail it (retention has
                        # its own bound).
                        await self.retain(step)
                finally:
                    handle._commit(info)  # committed, whatever became of retention
                logger.info(
                    "rank %d: saved step %d to %s (%d ranks): %d bytes, blocked %.3f s, "
                    "written %.3f s, committed %.3f s",
                    coord.rank,
                    step,
                    final,
                    coord.world_size,
                    info.nbytes,
                    blocked_s,
                    written_s,
                    info.committed_s,
                )
            except Exception as exc:
                error = as_save_error(exc, step, tmp, self.options.save_timeout_s)
                if committed and not isinstance(exc, RankFailedError):
                    # Renamed already: the directory is whole and the next open
                    # takes it as committed; only what follows (the tracker) failed.
                    error = type(error)(  # a timeout stays a CheckpointTimeoutError
                        f"step {step} was committed (its directory is final and "
                        f"complete) but updating the tracker failed: {exc!r}; the next "
                        "open moves the tracker to it",
                        step=step,
                        path=final,
                        rank=error.rank,
                    )
                    error.__cause__ = exc
                elif committed and not self.per_rank:
                    error = SaveFailedError(
                        f"step {step} was committed (its directory is final and complete) "
                        f"but rank 0 did not report the tracker: {exc}",
                        step=step,
                        path=final,
                        rank=0,
                    )
                    error.__cause__ = exc
                self.fail(handle, error)
                if self.owns_root and not committing and not committed:
                    await self.discard(tmp)
            except anyio.get_cancelled_exc_class():
                self.fail(handle, self.abandoned_error(step, tmp))
                if self.owns_root and not committing and not committed:
                    await self.discard(tmp)
                raise
            finally:
                coord.end_turn(save.ticket)
                part, outcomes = None, []
                parts = own = []
                if isinstance(job, Job):
                    # Writes started while staging, when write() never ran (a
                    # rank failed before): they read the arena and write into
                    # save.private, both released below.
                    await job.settle()
                    job.release()
                if save.private is not None:  # moved into tmp, or failed: gone either way
                    await self.discard(save.private)
                if self.pending.get(step) is handle:
                    del self.pending[step]
                self.scopes.pop(step, None)

    async def _write_own(
        self, save: _Save, local_error: BaseException | None
    ) -> tuple[Path | None, list[Any], float, BaseException | None]:
        """Phases A and B in a root of this rank's own (``per_rank``): its own
        temporary directory and files, then every rank's outcome (with its step,
        so that ranks saving different steps all fail). Returns the temporary
        directory (``None`` once removed after this rank's failure), the outcomes,
        the time written and this rank's error."""
        step, job, tmp = save.handle.step, save.job, save.tmp
        if local_error is None and not (isinstance(job, Job) and job.per_rank_root):
            local_error = CheckpointError(
                f"step {step}: Tier(local_scope='rank') saves plain state trees only; "
                f"a {type(job).__name__} (DTensor state, a Megatron request) needs a "
                "local root every rank shares (local_scope='shared')",
                step=step,
                rank=self.coord.rank,
            )
        part: dict[str, Any] | None = None
        try:
            if local_error is not None:
                raise local_error
            if tmp is None:
                tmp = await self.make_tmp(step)
            assert isinstance(job, Job)
            part = await job.write(self, self.coord, tmp)
            save.handle._progress.all_written(job.nbytes)
        except Exception as exc:
            local_error = exc
        written_s = time.perf_counter() - save.t0
        mine = repr(local_error) if local_error is not None else ("ok", part, step)
        outcomes = await self.coord.all_gather("files-durable", mine, step)
        outcomes = [
            f"saved step {o[2]}, not {step}: every rank must call save() with the same "
            "steps in the same order"
            if not isinstance(o, str) and o[2] != step
            else o
            for o in outcomes
        ]
        if local_error is not None:
            await self.discard(tmp)
            tmp = None
        return tmp, outcomes, written_s, local_error

    async def _agree_committed(
        self, outcome: tuple[str, str, bool] | None, step: int, error: Exception | None
    ) -> None:
        """Every rank committed its own part (``per_rank``), or raise naming those
        that did not (a part committed on some ranks only is never resumed: resume
        takes a local step only when every rank has it)."""
        views = await self.coord.all_gather("commit", outcome, step)
        failed = {r: o[1] for r, o in enumerate(views) if o is not None}
        if not failed:
            return
        if error is not None and self.coord.world_size == 1:
            raise error
        failure = RankFailedError(
            f"the local commit of step {step} failed on rank(s) {sorted(failed)}: "
            + "; ".join(f"rank {r}: {cause}" for r, cause in sorted(failed.items())),
            step=step,
            rank=min(failed),
            ranks=failed,
        )
        failure.__cause__ = error
        raise failure

    async def _committed_on_disk(self, final: Path, save: _Save) -> bool:
        """A rank that lost the leader after phase B: did the rename happen?
        (A shared POSIX root shows it; an overwrite cannot be told apart.)"""
        if save.overwrite:
            return False
        try:
            with anyio.move_on_after(5):
                return bool(
                    await anyio.to_thread.run_sync(
                        self.strategy.committed, self.fs, final, abandon_on_cancel=True
                    )
                )
        except OSError:
            return False
        return False


def _raise_failure(
    coord: Coordinator,
    what: str,
    step: int,
    outcomes: list[Any],
    local_error: BaseException | None,
    tmp: Path | None,
) -> None:
    """Raise if any rank's gathered outcome is a failure (a ``str``: the ``repr``
    of its exception). One process raises its own error; several ranks raise one
    :class:`RankFailedError` naming every failed rank, on every rank."""
    failed = {r: o for r, o in enumerate(outcomes) if isinstance(o, str)}
    if not failed:
        return
    if coord.world_size == 1 and local_error is not None:
        raise local_error
    error = RankFailedError(
        f"{what} step {step} failed on rank(s) {sorted(failed)}; no rank committed it: "
        + "; ".join(f"rank {r}: {cause}" for r, cause in sorted(failed.items())),
        step=step,
        rank=min(failed),
        ranks=failed,
        path=tmp,
    )
    if local_error is not None:
        error.__cause__ = local_error
    raise error


class WorkerDiedError(RuntimeError):
    """A worker thread ended with a ``BaseException`` that is not an ``Exception``
    (``SystemExit`` from a library, a thread-killing ``BaseException``); the
    original is ``__cause__``."""


def _in_worker(func: Any, *args: Any) -> Any:
    """Run ``func`` in a worker thread so that however the worker dies, the save
    fails with an ``Exception`` (a dead writer becomes an error, never a hang: https://github.com/NVIDIA/Megatron-LM/issues/6970). A
    ``BaseException`` raised in a worker thread would otherwise cross into the
    event loop as if raised there, crash the checkpointer's task group and cancel
    the caller's task instead of failing the save."""
    try:
        return func(*args)
    except Exception:
        raise
    except BaseException as exc:
        raise WorkerDiedError(f"a worker thread died running {func!r}: {exc!r}") from exc


_FINAL_LOCKS: dict[str, threading.Lock] = {}
_FINAL_LOCKS_GUARD = threading.Lock()


def _final_lock_for(root: Any) -> threading.Lock:
    """One lock per root in this process (see ``Saver.final_lock``)."""
    key = str(root)
    if "://" not in key:
        key = os.path.realpath(key)
    with _FINAL_LOCKS_GUARD:
        return _FINAL_LOCKS.setdefault(key, threading.Lock())


def as_save_error(exc: Exception, step: int, tmp: Path | None, timeout_s: float) -> SaveFailedError:
    """The one translation of a save's foreign error into asyncsave's: a
    ``SaveFailedError`` stays; a ``TimeoutError`` becomes a
    :class:`CheckpointTimeoutError`; anything else a :class:`SaveFailedError`
    naming the file (``OSError.filename``) or the temporary directory."""
    if isinstance(exc, SaveFailedError):
        return exc
    if isinstance(exc, TimeoutError) and not isinstance(exc, CheckpointError):
        error: SaveFailedError = CheckpointTimeoutError(
            f"save of step {step} did not commit within save_timeout_s={timeout_s}",
            step=step,
            path=tmp,
        )
    else:
        path = getattr(exc, "filename", None) or tmp
        error = SaveFailedError(f"save of step {step} failed: {exc!r}", step=step, path=path)
    error.__cause__ = exc
    return error


def _write_manifest(fs: Any, path: Path, manifest: dict[str, Any]) -> None:
    write_bytes(fs, path, encode_manifest(manifest))
    # Emptied here, in the worker (the pipeline does not read it again): its
    # 100,000s of dicts are freed off the event loop.
    manifest.clear()
