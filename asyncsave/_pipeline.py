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

Three collaborators, one module each: :class:`Saver` (here) is what the saves of
one checkpointer share (root, roles, bookkeeping, worker threads, tracker and
retention); ``asyncsave._dispatch.Stager`` stages admitted saves in the order
of their ``save()`` calls and starts their pipelines; ``asyncsave._phases.Pipeline``
runs one save through the phases above.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import anyio.abc
import anyio.to_thread
import torch

from ._atomicity import CommitStrategy, discard, move_aside_durably, strategy_for
from ._coord import Coordinator, Solo
from ._dispatch import Stager
from ._errors import CheckpointerClosedError, CheckpointTimeoutError, SaveFailedError
from ._fs import LocalFileSystem
from ._handle import SaveHandle
from ._jobs import Job
from ._options import CheckpointOptions
from ._paths import Layout
from ._phases import as_save_error
from ._policy import signal_holds
from ._retention import apply_retention
from ._stage import StagingPool
from ._track import TrackerWriter
from ._types import CheckpointInfo, Phase

# ``as_save_error`` is the pipeline's translation of a foreign error (its home is
# ``asyncsave._phases``); ``update()`` translates through it too.
__all__ = ["Saver", "WorkerDiedError", "as_save_error"]

logger = logging.getLogger(__name__)


class Saver:
    """What the saves of one checkpointer share: its root, roles and bookkeeping.

    The :class:`~asyncsave.Checkpointer` admits saves and owns the lifecycle; this
    object hands them to its :class:`~asyncsave._dispatch.Stager`
    (:meth:`dispatch`), which stages them and runs their pipeline, served by this
    object (it is the pipeline's :class:`~asyncsave._phases.Host`).
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
        self.state = Phase.NEW
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
        # Stages admitted saves in the order of their save() calls and starts
        # their pipelines (``asyncsave._dispatch``).
        self.stager = Stager(self)

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
    def state(self) -> Phase:
        """The checkpointer's lifecycle (:class:`Phase`)."""
        return self._state

    @state.setter
    def state(self, state: Phase | str) -> None:
        self._state = state = Phase(state)
        # A signal policy that caught its signal keeps its handlers until every
        # checkpointer open at the end of its block is closed, so flushed.
        if state is Phase.OPEN:
            signal_holds.opened(self)
        elif state is Phase.CLOSED:
            signal_holds.closed(self)

    # -- bookkeeping ----------------------------------------------------------------
    def check_usable(self) -> None:
        if self.state is not Phase.OPEN:
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
    async def run(self, func: Any, *args: Any, limiter: anyio.CapacityLimiter | None = None) -> Any:
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

    async def move_aside(self, step: int, path: Path, kind: str, reason: str) -> None:
        """Forget the committed ``step`` and move its directory ``path`` aside
        durably, as ``.asyncsave-<kind>-...`` (bytes kept), under the final-name
        lock (raises what fails)."""
        self.committed.pop(step, None)
        await anyio.to_thread.run_sync(
            self.under_final_lock, move_aside_durably, self.fs, self.root, path, kind, step, reason
        )

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
        return await self.stager.dispatch(
            step,
            job,
            t0=t0,
            ready=ready,
            overwrite=overwrite,
            lazy=lazy,
            training_info=training_info,
            ticket=ticket,
            tmp=tmp,
        )


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
