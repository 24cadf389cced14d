"""The job role of the save pipeline: what one rank snapshots and writes.

A job is staged by ``save()`` (or an integration's own entry point) and then
driven by the one pipeline (``asyncsave._pipeline``) through four hooks, on
every rank:

- ``write(saver, coord, tmp)``: this rank's files, durable, under ``tmp``;
  returns this rank's part of the manifest (gathered by the coordinator);
- ``finalize(saver, coord, tmp, parts)``: after every rank's files are durable,
  before the commit (an integration's own finishing steps);
- ``manifest(tmp, step, parts)``: on the leader, asyncsave's manifest of the
  finished directory (blocking; runs in a worker thread);
- ``release()``: give staging memory back (idempotent).

:class:`PlainJob` is a state tree planned by ``_plan``, staged whole into the
pool; its subclasses are the other staging modes (written while staged, streamed
rounds, incremental), one class each, owning its staging and its writing.
:func:`plain_job` picks the mode once, from the table of what combines
(``asyncsave._combine``). Integrations plug in with their own jobs:
DTensor state through DCP's planner (``asyncsave.dcp.DTensorJob``, which the
core names by string and imports only when a DTensor is saved, as anyio names
its backends) and Megatron's async requests (``asyncsave.megatron``). The core
never imports an integration module statically (``tests/test_structure.py``).
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import importlib
import logging
import math
import operator
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

import anyio
import anyio.to_thread
import torch
import torch.distributed as dist

from ._atomicity import move_files
from ._combine import PRECEDENCE, Context, Row, lookup
from ._errors import (
    CheckpointError,
    CheckpointTimeoutError,
    StagingBudgetError,
    UnsupportedCombinationError,
)
from ._format import FileLayout
from ._fs import LocalFileSystem
from ._handle import ProgressCounter
from ._incremental import Base, Report, Reuse
from ._manifest import CHECKSUM, FORMAT, format_version, renumbered
from ._options import CheckpointOptions
from ._paths import Layout
from ._plan import Entry, Plan, ViewCache, is_stateful
from ._stage import (
    Lease,
    StagedMark,
    StagingAbandonedError,
    StagingPool,
    copies_early,
    copy_following,
    snapshot_eager_entries,
    stage_entries,
)
from ._stream import Piece, StreamWriter, piece_entries
from ._types import gc_paused, release_in_chunks
from ._write import write_data_file

__all__ = [
    "FollowingJob",
    "IncrementalJob",
    "Job",
    "PlainJob",
    "StreamedJob",
    "Services",
    "contains_dtensor",
    "dcp_reader_class",
    "dtensor_job_class",
    "engine_for",
    "job_for",
    "register_job",
    "manifest_doc",
    "merge_parts",
    "plain_job",
]

logger = logging.getLogger(__name__)

#: Threads that write an incremental save's files (at least ``writer_threads``):
#: its early writes, and the files that ``write()`` writes after its staging.
#: Its files are one per large tensor, each fsynced: with more fsyncs in flight the
#: file system commits its journal for several at once. A save where every
#: tensor changed (65 files of 16-32 MiB) took 1.24 x a full save's time with 2
#: threads and 1.00-1.03 x with 8 (two A/B runs, 2026-12-01); the threads wait on
#: the device, not the CPU.
EARLY_WRITE_THREADS = 8

#: A whole save of host tensors at least this large (staging bytes) is written
#: while it is staged (:class:`FollowingJob`); a smaller one is staged,
#: then written (its copy takes under 2 ms here: nothing to overlap).
FOLLOW_MIN_BYTES = 16 << 20

# The integration that saves DTensor state (named, imported lazily: the core
# does not depend on it, it depends on the core).
DTENSOR_JOB = "asyncsave.dcp:DTensorJob"
# The integration's reader of such state, through which ``load_latest`` reads it
# back (``asyncsave._dcp_read.TemplateLoad``).
DCP_READER = "asyncsave.dcp:StorageReader"


class Services(Protocol):
    """What a job may use of its checkpointer (see ``asyncsave._pipeline.Saver``)."""

    fs: LocalFileSystem
    root: Path
    layout: Layout
    options: CheckpointOptions
    pool: StagingPool | None
    pending: dict[int, Any]  # step -> SaveHandle of every save not yet cleaned up

    async def run(
        self, func: Any, *args: Any, limiter: anyio.CapacityLimiter | None = None
    ) -> Any: ...

    def start_soon(self, func: Any, *args: Any) -> None: ...

    def check_flushing(self, step: int) -> None: ...

    def abandonable(self, scope: anyio.CancelScope) -> contextlib.AbstractContextManager[None]: ...


class Job:
    """The job contract (see the module docstring)."""

    nbytes: int = 0
    num_tensors: int = 0
    # The save's byte counters (set by the pipeline; jobs that count as they go
    # bump them, the pipeline completes them after each phase).
    progress: ProgressCounter | None = None
    lazy: bool = False  # a lazy save's job (set by the pipeline)
    # The staging memory the job holds from the pool while it stages and writes.
    lease: Lease | None = None
    #: Whether the job can save into a root of this rank's own
    #: (``Tier(local_scope="rank")``): a plain tree can; DTensor state and
    #: Megatron's requests need a root every rank shares.
    per_rank_root: bool = False
    #: Whether the ``entries`` rows of the job's manifest and parts are lists of
    #: its own, made for this save (not shared with a writer or template that
    #: outlives it): the pipeline then frees them a slice at a time after
    #: writing the manifest (``_types.release_in_chunks``).
    owns_manifest_rows: bool = False

    @property
    def owns_manifest_tree(self) -> bool:
        """Whether the manifest's ``tree`` is the job's own as its rows are (see
        :attr:`owns_manifest_rows`); not where the plan shares nodes with the
        planner's template (``Plan.shares_tree``), which must stay whole."""
        return self.owns_manifest_rows

    def eager_copies(self) -> str:
        """Where a lazy save's :meth:`snapshot_eager` runs: ``"loop"`` (on the
        caller's thread: CUDA clones stay on the caller's stream), ``"thread"``
        (a worker thread: host clones of 1,000s of tensors, the loop keeps
        ticking) or ``"none"`` (nothing to copy: no call, no thread)."""
        return "loop"

    def snapshot_eager(self, ready: dict[torch.device, Any] | None) -> None:
        """Lazy mode, before ``save()`` returns: copy now what forward may change
        (see ``_stage.snapshot_eager_entries``)."""

    def devices(self) -> set[torch.device]:
        """The devices of the tensors to stage (CUDA producer events are recorded
        on the caller's thread for them)."""
        return set()

    async def stage(
        self, saver: Services, step: int, ready: dict[torch.device, Any] | None, make_tmp: Any
    ) -> None:
        """Snapshot into staging memory: eager, before ``save()`` returns; lazy, in
        the background. ``make_tmp()`` makes the temporary directory early."""

    async def settle(self) -> None:
        """Before the clean-up of a failure that ends the save before ``write``:
        wait for anything the job still runs in the background (by default,
        nothing)."""

    async def write(self, saver: Services, coord: Any, tmp: Path) -> dict[str, Any] | None:
        """This rank's files, durable, under ``tmp``; returns its part."""
        raise NotImplementedError

    async def finalize(
        self, saver: Services, coord: Any, tmp: Path, parts: list[dict[str, Any]]
    ) -> None:
        """After every rank's files are durable, before the commit (every rank)."""

    def manifest(self, tmp: Path, step: int, parts: list[dict[str, Any]]) -> dict[str, Any]:
        """The leader's manifest of the finished directory (blocking)."""
        raise NotImplementedError

    def release(self) -> None:
        """Give back staging memory; idempotent."""

    def abandon(self) -> None:
        """After a failure before the pipeline: close what the staging left open
        (by default, nothing)."""

    def staging_lost(self) -> bool:
        """Whether the staging memory is lost for good (an abandoned writer may
        still read it: never leased again)."""
        return self.lease is not None and self.lease.poisoned


ForeignJob = Job  # the name asyncsave.megatron used first


class PlainJob(Job):
    """A state tree, planned (``_plan``) and laid out in files (``_format``),
    staged whole into the pool, then written: the ``whole`` staging mode. The
    other modes of the table of what combines (``asyncsave._combine``) are its
    subclasses, each owning its staging and its writing; :func:`plain_job`
    picks one, once."""

    mode = "whole"
    per_rank_root = True
    owns_manifest_rows = True

    @property
    def owns_manifest_tree(self) -> bool:
        return not self.plan.shares_tree

    def __init__(self, plan: Plan, layouts: list[FileLayout], nbytes: int) -> None:
        self.plan = plan
        self.layouts = layouts
        self.staging_bytes = nbytes
        self.lease = None
        self.fs: LocalFileSystem | None = None
        self.report: Report | None = None  # an incremental save's
        self.early: _EarlyWrites | None = None  # files written while staging
        self.mark: StagedMark | None = None  # what the early writes follow
        self.nbytes = -1  # plan.nbytes, summed only if plain_job() was not told it
        self.num_tensors = len(plan.leaves)
        self._ready: dict[torch.device, Any] | None = None
        self._poll_s = 0.0
        self._doc: dict[str, Any] | None = None  # this rank's manifest, from write()
        self.deadline = math.inf

    # -- staging ------------------------------------------------------------------
    async def stage(
        self,
        saver: Services,
        step: int,
        ready: dict[torch.device, Any] | None,
        make_tmp: Any,
    ) -> None:
        """Lease the arena and copy the snapshot into it (:meth:`_stage_all`).
        Raises what went wrong; ``release()`` and ``abandon()`` clean up."""
        assert saver.pool is not None
        pin = any(d.type == "cuda" for d in self.plan.devices)
        self.lease = await saver.pool.acquire(self._lease_bytes(saver), pin=pin)
        saver.check_flushing(step)  # accepted: only a close that gave up stops it
        self.deadline = anyio.current_time() + saver.options.save_timeout_s
        self._ready, self._poll_s = ready, saver.options.poll_interval_s
        await self._stage_all(saver, step, make_tmp)
        # One pass over every entry and leaf (100,000s): off the event loop.
        await anyio.to_thread.run_sync(self.plan.release_sources)

    def _lease_bytes(self, saver: Services) -> int:
        return self.staging_bytes

    async def _stage_all(self, saver: Services, step: int, make_tmp: Any) -> None:
        await self.stage_entries(self.plan.entries, self.plan.staging_views)

    async def stage_entries(self, entries: list[Entry], views: Any = None) -> None:
        """Copy ``entries`` into the leased arena, within the save's deadline."""
        assert self.lease is not None
        progress = self.progress
        await stage_entries(
            self.lease,
            entries,
            poll_interval_s=self._poll_s,
            timeout_s=max(0.0, self.deadline - anyio.current_time()),
            ready=self._ready,
            on_staged=None if progress is None else progress.add_staged,
            views=views,
            host_only=all(d.type != "cuda" for d in self.plan.devices),
        )

    async def settle(self) -> None:
        """Before the clean-up of a failure that ends this save before
        :meth:`write`: wait for the early writes (they read the arena and write
        into the temporary directory, both released by that clean-up), shielded
        and bounded by their own deadline; never cancelled here, as host staging
        copies are not (a close that gives up cancels them). Their own error, if
        any, is logged: the failure being handled is the one raised. Writes
        that follow the staging (:class:`FollowingJob`) are stopped at their next
        chunk first (a cancelled save returns without writing its files to the
        end); those already done are not affected."""
        early = self.early
        if early is None:
            return
        if self.mark is not None:
            self.mark.fail(CheckpointError("the save failed before its files were needed"))
        if not early.done.is_set():  # (no checkpoint otherwise: see _pipeline's finally)
            with anyio.CancelScope(shield=True):
                await early.done.wait()
        if early.error is not None and not isinstance(early.error, StagingAbandonedError):
            logger.warning(
                "the early writes of this save failed too (not raised: the save "
                "failed before its files were needed): %r",
                early.error,
            )

    def write_early(
        self,
        saver: Services,
        step: int,
        tmp: Path | None,
        layouts: list[FileLayout],
        threads: anyio.CapacityLimiter | None,
        writer: Any,
        base: Base | None = None,
        what: str = "files",
        make_tmp: Any = None,
    ) -> None:
        """Start writing ``layouts`` (with ``writer``, as ``write_files`` does;
        staged, or followed by the writer while they are staged; an incremental
        save's are compared with ``base``) into ``tmp`` in the background, and
        every file handed on by ``early.add`` (staged) until ``early.finish()``,
        as the checkpointer's task: bounded by ``save_timeout_s`` from
        ``finish()`` (until then files are still staged or found, which is not a
        stuck write), cancelled by a close that gives up; the outcome is this
        save's, raised by :meth:`write`. ``what`` names the files in its
        timeout's message. With ``tmp`` ``None``, the task first makes it with
        ``make_tmp()`` (bounded as the writes are)."""
        assert self.lease is not None
        lease = self.lease
        more, incoming = anyio.create_memory_object_stream[FileLayout](math.inf)
        self.early = early = _EarlyWrites(
            {fl.index for fl in layouts},
            anyio.CancelScope(shield=True),
            base,
            more,
            saver.options.save_timeout_s,
            tmp,
        )
        # Cancellable by a close that gives up from now on, not only once the task
        # has started.
        registered = saver.abandonable(early.scope)
        registered.__enter__()

        async def write(dest: Path, batch: list[FileLayout]) -> None:
            await write_files(saver, dest, self.plan, batch, lease, self.progress, writer, threads)

        async def run() -> None:
            try:
                await early.run(step, what, saver.root, lease, write, layouts, incoming, make_tmp)
            finally:
                registered.__exit__(None, None, None)

        try:
            saver.start_soon(run)
        except BaseException:  # never started: nothing to wait for
            registered.__exit__(None, None, None)
            more.close()
            incoming.close()
            self.early = None
            raise

    # -- writing ------------------------------------------------------------------
    async def write(self, saver: Services, coord: Any, tmp: Path) -> dict[str, Any]:
        assert self.lease is not None
        self.fs = saver.fs
        await self._write_files(saver, tmp)
        self._release_lease()  # written and fsynced: the pool is free for the next save
        # A dict per entry and tensor: CPU work (10 ms per 10,000 tensors), in a
        # worker thread, not on the event loop; kept for manifest(), which
        # completes it instead of building it again.
        doc = self._doc = await saver.run(manifest_doc, 0, self.plan, self.layouts)
        return {k: doc[k] for k in ("files", "entries", "tensors", "tree")}

    async def _write_files(self, saver: Services, tmp: Path) -> None:
        """Every data file durable under ``tmp``: those the early writes did not
        take, written now; theirs moved in."""
        assert self.lease is not None
        layouts = await self._after_early_writes()
        if layouts:
            await write_files(saver, tmp, self.plan, layouts, self.lease, self.progress)
        await self._move_early_files(saver, tmp)

    async def _after_early_writes(self) -> list[FileLayout]:
        """Wait for the files started while staging (see :class:`FollowingJob`
        and :class:`IncrementalJob`): their threads are abandoned at this save's
        deadline, as the writers of :meth:`write` would be. Returns the files
        left to write."""
        early = self.early
        if early is None:
            return self.layouts
        try:
            await early.done.wait()
        except BaseException:
            early.scope.cancel()  # its threads are abandoned: it ends at once
            with anyio.CancelScope(shield=True):
                await early.done.wait()
            raise
        if not early.ok:
            raise early.error or CheckpointError(
                f"the early writes into {early.tmp} ended without writing",
                path=early.tmp,
            )
        return [fl for fl in self.layouts if fl.index not in early.files]

    async def _move_early_files(self, saver: Services, tmp: Path) -> None:
        early = self.early
        if early is not None and early.tmp != tmp:  # a rank's own directory (several ranks)
            names = [fl.name for fl in self.layouts if fl.index in early.files]
            await saver.run(move_files, saver.fs, early.tmp, tmp, names)

    def manifest(self, tmp: Path, step: int, parts: list[dict[str, Any]]) -> dict[str, Any]:
        doc, self._doc = self._doc, None
        if doc is None:
            doc = manifest_doc(step, self.plan, self.layouts)
        else:  # write()'s, whose digests are final: the step and time are this call's
            doc["step"], doc["created_unix_s"] = step, time.time()
        if self.report is not None:
            doc["incremental"] = self.report.as_doc()
        if len(parts) > 1:
            doc.update(merge_parts(parts))
            assert self.fs is not None
            check_visible(self.fs, tmp, parts)
        # The save's per-tensor objects (100,000s: entries, leaves, tree nodes) are
        # no longer needed: freed here, in this worker thread, not on the event
        # loop when the pipeline drops the job (~100 ms of deallocation per
        # 100,000 tensors), a slice at a time (release_in_chunks). The tree
        # lives on in ``doc`` (freed after writing).
        # Entries a planner lent from its pool go back to it (Plan.recycle).
        entries, leaves = self.plan.entries, self.plan.leaves
        self.plan.leaves, self.plan.tree = [], {}
        if not self.plan.recycle():  # lent lists live on in the planner
            release_in_chunks(entries)
            release_in_chunks(leaves)
        return doc

    def eager_copies(self) -> str:
        if not all(d.type == "cpu" for d in self.devices()):
            return "loop"
        return "thread" if copies_early(self.plan) else "none"

    def snapshot_eager(self, ready: dict[torch.device, Any] | None) -> None:
        snapshot_eager_entries(self.plan, ready)

    def devices(self) -> set[torch.device]:
        return set(self.plan.devices)

    def release(self) -> None:
        self._release_lease()

    def _release_lease(self) -> None:
        if self.lease is not None:
            self.lease.release()


class FollowingJob(PlainJob):
    """Written while staged (``overlap_writes``): every file's writer (on
    threads of its own) starts before the copy and follows it
    (``_stage.StagedMark``), the copy takes a step of each file in turn
    (``_stage.copy_following``), so the write and fsync of the data no longer
    wait for the whole snapshot (time to durable: about the copy shorter; the
    bound set for it is 1.15 x the raw write+fsync). ``save()`` still returns
    only once the snapshot is whole.

    :param always: ``overlap_writes=True`` (eager saves too); else lazy saves only.
    """

    mode = "following"

    def __init__(self, plan: Plan, layouts: list[FileLayout], nbytes: int, *, always: bool) -> None:
        super().__init__(plan, layouts, nbytes)
        self.always = always

    def follows(self, saver: Services, step: int) -> bool:
        """Whether this save follows its staging: a lazy save (or any, with
        ``overlap_writes=True``) when no save dispatched before it is still
        unresolved (its writes and commit would compete with these for the
        writer threads and the disk: it is staged, then written, as before)."""
        return (self.always or self.lazy) and _none_unfinished_before(saver.pending, step)

    async def _stage_all(self, saver: Services, step: int, make_tmp: Any) -> None:
        if not self.follows(saver, step):
            await super()._stage_all(saver, step, make_tmp)
            return
        # The files go into a temporary directory of this rank's own, made by the
        # writers' task before they start (never on ``save()``'s path: a hung
        # file system does not hold the caller; its failure or timeout is raised
        # by write(), through the handle, as without the overlap), and write()
        # moves them into the save's temporary directory in its turn.
        assert self.lease is not None
        self.mark = mark = StagedMark(self.layouts)
        writer = functools.partial(write_data_file, ready=mark.wait)
        own_tmp = functools.partial(make_tmp, own=True)
        # Threads of their own: on the pipeline's (writer_threads) they would hold
        # every one until the data is durable, and the save's turn (its temporary
        # directory, agreed by the ranks) would start only then, on the path to
        # durable (5-10 ms per save on 2 ranks).
        threads = anyio.CapacityLimiter(saver.options.writer_threads)
        self.write_early(saver, step, None, self.layouts, threads, writer, make_tmp=own_tmp)
        assert self.early is not None
        progress = self.progress
        try:
            await anyio.to_thread.run_sync(
                copy_following,
                self.lease.buffer,
                self.plan.entries,
                self.layouts,
                self.plan.staging_views,
                mark,
                None if progress is None else progress.add_staged,
            )
        except BaseException as exc:
            mark.fail(exc)  # the writers stop at their next chunk
            self.early.finish()
            await self.settle()  # before the failure's clean-up (see settle)
            raise
        self.early.finish()


class StreamedJob(PlainJob):
    """A state larger than an explicit ``budget_bytes``, streamed through the
    arena in rounds (``_stream.plan_rounds``): each round but the last is
    written (not fsynced) into ``make_tmp()``'s directory while the save goes
    on; :meth:`write` writes the last and fsyncs every file.

    :param rounds: the pieces of each round.
    """

    mode = "streamed"

    def __init__(
        self, plan: Plan, layouts: list[FileLayout], nbytes: int, rounds: list[list[Piece]]
    ) -> None:
        super().__init__(plan, layouts, nbytes)
        self.rounds = rounds
        self.stream: StreamWriter | None = None

    def _lease_bytes(self, saver: Services) -> int:
        budget = saver.options.budget_bytes
        assert budget is not None
        return budget

    async def _stage_all(self, saver: Services, step: int, make_tmp: Any) -> None:
        assert self.lease is not None
        lease = self.lease
        tmp = await make_tmp()
        self.stream = stream = StreamWriter(saver.fs, tmp, self.layouts, self.plan.entries)
        stream.on_written = None if self.progress is None else self.progress.add_written
        for pieces in self.rounds[:-1]:
            await self.stage_entries(piece_entries(self.plan.entries, pieces))
            # Shielded (the arena is reused next round), bounded by the
            # save's deadline: a writer stuck past it is abandoned, and then
            # may still read the arena and use its descriptors, so the arena
            # is never reused (poisoned) and the descriptors never closed.
            with (
                anyio.CancelScope(shield=True, deadline=self.deadline) as scope,
                saver.abandonable(scope),
            ):
                await write_round(saver, stream, pieces, lease, finish=False)
            if scope.cancelled_caught:
                lease.poison()
                stream.fds = [None] * len(stream.fds)
                raise self._abandoned(saver, step, stream)
        await self.stage_entries(piece_entries(self.plan.entries, self.rounds[-1]))

    def _abandoned(self, saver: Services, step: int, stream: StreamWriter) -> Exception:
        why = (
            f"close_timeout_s={saver.options.close_timeout_s} ran out"
            if anyio.current_time() < self.deadline
            else f"save_timeout_s={saver.options.save_timeout_s} passed"
        )
        return CheckpointTimeoutError(
            f"writing a streamed round of step {step} was abandoned: {why}",
            step=step,
            path=stream.directory,
        )

    def abandon(self) -> None:
        """After a failure before the pipeline: close the stream's open files."""
        if self.stream is not None:
            self.stream.close_quietly()

    async def _write_files(self, saver: Services, tmp: Path) -> None:
        assert self.lease is not None and self.stream is not None
        try:
            await write_round(saver, self.stream, self.rounds[-1], self.lease, finish=True)
        except Exception:
            # Not on cancellation: an abandoned writer thread may still use
            # its descriptor.
            self.stream.close_quietly()
            raise
        for i, digest in self.stream.digests().items():
            self.plan.entries[i].digest = digest
        if self.stream.directory != tmp:  # a rank's own directory (several ranks)
            names = [fl.name for fl in self.layouts]
            await saver.run(move_files, saver.fs, self.stream.directory, tmp, names)


class IncrementalJob(PlainJob):
    """An incremental save (one process): files equal to the previous
    checkpoint's are shared with it (``_incremental.Reuse``). On a root that
    renames, once this process knows files it wrote before, they are hashed in
    place while the rest is staged (:class:`_IncrementalStaging`); otherwise the
    state is staged whole and every file compared as it is written.

    :param renames: the root commits by atomic rename (the save's temporary
        directory is not its final name).
    """

    mode = "incremental"

    def __init__(
        self,
        plan: Plan,
        layouts: list[FileLayout],
        nbytes: int,
        *,
        reuse: Reuse,
        renames: bool,
    ) -> None:
        super().__init__(plan, layouts, nbytes)
        self.reuse = reuse
        self.renames = renames

    async def _stage_all(self, saver: Services, step: int, make_tmp: Any) -> None:
        if self.renames and self.reuse.knows_files():
            await _IncrementalStaging(self, saver, step, await make_tmp()).run()
        else:
            await super()._stage_all(saver, step, make_tmp)

    async def _write_files(self, saver: Services, tmp: Path) -> None:
        assert self.lease is not None
        layouts = await self._after_early_writes()
        early = self.early
        if early is not None:
            base = early.base
        else:
            base = await saver.run(self.reuse.find_base, saver.fs, tmp)
        self.report = self.report or Report()
        self.report.base = None if base is None else base.path.name
        writer = functools.partial(self.reuse.write_file, base, self.report)
        layouts = [fl for fl in layouts if fl.index not in self.report.prelinked]
        # One file per large tensor: as many threads as the early writes
        # (the first save, and files found changed while hashing).
        limiter = anyio.CapacityLimiter(max(saver.options.writer_threads, EARLY_WRITE_THREADS))
        if layouts:
            await write_files(
                saver, tmp, self.plan, layouts, self.lease, self.progress, writer, limiter
            )
        await self._move_early_files(saver, tmp)
        await saver.run(self.reuse.keep_only, self.layouts)


class _Running:
    """How many worker threads run a task, and a proper wait until none does
    (a condition variable: no polling)."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._n = 0

    def __enter__(self) -> None:
        with self._cond:
            self._n += 1

    def __exit__(self, *exc: object) -> None:
        with self._cond:
            self._n -= 1
            if not self._n:
                self._cond.notify_all()

    def any(self) -> bool:
        with self._cond:
            return self._n > 0

    def wait_none(self, timeout_s: float) -> bool:
        """Block until no thread runs (``True``) or ``timeout_s`` passed."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._n, timeout_s)


class _IncrementalStaging:
    """An incremental save's staging on a local root, three things at once:

    1. the files this process wrote before that did not change at their last
       try (a frozen base) are hashed in place and linked when equal
       (``Reuse.prelink``), by ``writer_threads`` workers that each take the
       next file until none is left; a file found changed is staged at once
       and handed to the early writes;
    2. meanwhile the files that will be written whatever the hashing finds
       (new ones, and those that changed at their last save: adapters,
       optimizer moments) are staged while the base checkpoint they are
       compared with is read, and their writes start in the background
       (``PlainJob.write_early``; ``write()`` waits for them);
    3. once the hashing is done, what is left (a file not linked for another
       reason) is staged, and written by ``write()``.

    The caller waits for 1-3 but not for the early writes: their write and
    fsync overlap the hashing instead of following the whole snapshot.
    A/B on 2 cores (the bench's LoRA state, medians of 8 and 12 saves,
    alternated): staging first and then one thread call per hashed file
    reached durable in 0.164 and 0.177 s, hashing by workers while staging
    in 0.137 and 0.147 s (a thread call per file costs the event loop ~0.3 ms,
    which competes with the hashing for the 2 cores; the staging copy of
    small tensors uses one core, the hashing workers the rest). A file found
    changed is written while the others are still hashed, so the first save
    after every tensor changed does not hash the whole state before its
    first write."""

    def __init__(self, job: IncrementalJob, saver: Services, step: int, tmp: Path) -> None:
        self.job, self.saver, self.step, self.tmp = job, saver, step, tmp
        self.reuse, self.entries = job.reuse, job.plan.entries
        job.report = self.report = Report()
        self.hashed = {
            fl.index for fl in job.layouts if self.reuse.worth_prelinking(fl, self.entries)
        }
        self.now = [fl for fl in job.layouts if fl.index not in self.hashed]
        self.todo = collections.deque(fl for fl in job.layouts if fl.index in self.hashed)
        self.by_file: dict[int, list[Entry]] = {}  # each file's entries
        for e in self.entries:
            self.by_file.setdefault(e.file, []).append(e)
        self.errors: list[Exception] = []
        self.stop = threading.Event()  # set on the first error, or when this ends
        self.running = _Running()  # worker threads in hash_files
        # Files found changed, from the hashing workers to the event loop, which
        # stages them (host copies, never abandoned) and hands them on.
        self.changed_send, self.changed_recv = anyio.create_memory_object_stream[FileLayout](
            math.inf
        )
        # Threads of their own, not the writer threads: a previous save's commit,
        # tracker and retention run on those, and do not wait for this hashing.
        self.workers = min(saver.options.writer_threads, len(self.todo))
        self.hashers = anyio.CapacityLimiter(max(1, self.workers))
        # The early writes' threads: more than the writer threads (see EARLY_WRITE_THREADS).
        self.threads = anyio.CapacityLimiter(max(saver.options.writer_threads, EARLY_WRITE_THREADS))
        # The base the early writes compare with, read while staging (10-15 ms
        # for the bench's state: its manifest), not before their first write.
        self.found: list[Base | None] = []
        self.based, self.started = anyio.Event(), anyio.Event()

    def _fail(self, exc: Exception, first: bool = False) -> None:
        if first:
            self.errors.insert(0, exc)
        else:
            self.errors.append(exc)
        self.stop.set()

    def hash_files(self) -> None:
        """A hashing worker (in a thread): takes the next file until none is left."""
        with self.running:
            while not self.stop.is_set():
                try:
                    fl = self.todo.popleft()  # atomic: workers never take the same file
                except IndexError:
                    return
                try:
                    linked = self.reuse.prelink(
                        self.saver.fs, self.tmp, fl, self.entries, self.report
                    )
                except Exception as exc:  # raised below as the first failure
                    self._fail(exc)
                    continue
                # Not linked (changed, or its link failed): staged at once and
                # written, or shared from the base if equal after all (the
                # writer hashes the staged copy).
                if not linked and not self.stop.is_set():
                    with contextlib.suppress(anyio.ClosedResourceError, RuntimeError):
                        anyio.from_thread.run_sync(self.changed_send.send_nowait, fl)

    async def hash_worker(self) -> None:
        try:
            await self.saver.run(self.hash_files, limiter=self.hashers)
        except Exception as exc:  # a worker that died (WorkerDiedError): as itself
            self._fail(exc)

    async def hashing(self) -> None:
        try:
            async with anyio.create_task_group() as tg:
                for _ in range(self.workers):
                    tg.start_soon(self.hash_worker)
        finally:
            self.changed_send.close()

    async def find_base(self) -> None:
        saver, deadline = self.saver, self.job.deadline
        try:
            with anyio.move_on_after(max(0.0, deadline - anyio.current_time())) as scope:
                self.found.append(
                    await saver.run(self.reuse.find_base, saver.fs, self.tmp, limiter=self.threads)
                )
            if scope.cancelled_caught:
                raise CheckpointTimeoutError(
                    f"looking up the base checkpoint of step {self.step} under "
                    f"{self.reuse.root} took over save_timeout_s="
                    f"{saver.options.save_timeout_s}",
                    step=self.step,
                    path=self.tmp,
                )
        except Exception as exc:  # raised below, as the hashing's errors are
            self._fail(exc)
        finally:
            self.based.set()

    async def stage_now(self) -> None:
        job = self.job
        try:
            await job.stage_entries([e for e in self.entries if e.file not in self.hashed])
            await self.based.wait()
            if self.found and not self.stop.is_set():  # not for a save that failed
                writer = functools.partial(self.reuse.write_file, self.found[0], self.report)
                job.write_early(
                    self.saver,
                    self.step,
                    self.tmp,
                    self.now,
                    self.threads,
                    writer,
                    self.found[0],
                    "changed files",
                )
        except Exception as exc:  # raised below as itself, before any hashing error
            self._fail(exc, first=True)
        finally:
            self.started.set()

    async def stage_changed(self) -> None:
        await self.started.wait()
        async with self.changed_recv:
            async for fl in self.changed_recv:
                early = self.job.early
                if early is None or self.stop.is_set():
                    continue  # left to the staging after the hashing, or failed
                try:
                    await self.job.stage_entries(self.by_file[fl.index])
                except Exception as exc:
                    self._fail(exc, first=True)
                    continue
                if not early.add(fl):  # given up on (a close): the save fails with it
                    self.stop.set()

    async def _workers_done(self) -> None:
        """Wait until no hashing worker thread runs (one abandoned by a
        cancellation stops after its file), shielded, bounded by the save's
        deadline: before the failure's clean-up removes the directory it links
        into."""
        deadline = self.job.deadline
        with anyio.CancelScope(shield=True, deadline=deadline):
            if self.running.any():
                await anyio.to_thread.run_sync(
                    self.running.wait_none,
                    max(0.0, deadline - anyio.current_time()),
                    abandon_on_cancel=True,
                )

    async def run(self) -> None:
        job = self.job
        try:
            try:
                async with anyio.create_task_group() as tg:
                    tg.start_soon(self.find_base)
                    tg.start_soon(self.hashing)
                    tg.start_soon(self.stage_changed)
                    await self.stage_now()
            finally:
                self.stop.set()
                await self._workers_done()
                if job.early is not None:
                    job.early.finish()  # no more files: it ends when they are written
            if self.errors:
                raise self.errors[0]
            # What neither the hashing linked nor the early writes took.
            done = set(self.report.prelinked) | (set() if job.early is None else job.early.files)
            await job.stage_entries(
                [e for e in self.entries if e.file in self.hashed and e.file not in done]
            )
        except BaseException:
            await job.settle()  # before the failure's clean-up (see settle)
            raise


def _none_unfinished_before(pending: dict[int, Any], step: int) -> bool:
    """Whether every save dispatched before ``step``'s (``pending`` is in
    dispatch order) has resolved its handle: one that resolved and is only
    cleaning up competes with nothing; later ones do not count."""
    for s, handle in pending.items():
        if s == step:
            return True
        if not handle.done():
            return False
    return True


@dataclasses.dataclass
class _EarlyWrites:
    """Data files written while their save still stages (an incremental save's
    files found changed; a whole save's files, following the staging)."""

    files: set[int]  # their layout indices
    scope: anyio.CancelScope  # theirs: shielded, with the deadline, cancellable
    base: Base | None  # the checkpoint they were compared with
    more: Any  # where further files are handed on (a memory object stream)
    timeout_s: float  # their deadline, from finish()
    tmp: Path | None  # where they write (a directory of their own: moved by write())
    done: anyio.Event = dataclasses.field(default_factory=anyio.Event)
    ok: bool = False  # every file written and fsynced
    error: Exception | None = None

    def add(self, fl: FileLayout) -> bool:
        """Write ``fl`` too (staged). From the event loop, before :meth:`finish`;
        ``False`` when the writes have ended already (given up on: the save fails
        with their error)."""
        try:
            self.more.send_nowait(fl)
        except (anyio.BrokenResourceError, anyio.ClosedResourceError):
            return False
        self.files.add(fl.index)
        return True

    def finish(self) -> None:
        """No more files: the writes end once those handed on are written, at
        most ``timeout_s`` from now (then abandoned: the save times out)."""
        self.more.close()
        self.scope.deadline = anyio.current_time() + self.timeout_s

    async def run(
        self,
        step: int,
        what: str,
        root: Path,
        lease: Lease,
        write: Any,
        layouts: list[FileLayout],
        incoming: Any,
        make_tmp: Any,
    ) -> None:
        """The writes' task: ``write(dest, batch)`` for ``layouts``, then for each
        file from ``incoming``; the outcome in :attr:`ok` / :attr:`error`,
        :attr:`done` set at the end."""
        try:
            errors: list[Exception] = []
            abandoned = False  # a write cancelled while its threads ran
            with self.scope:
                if self.tmp is None:
                    self.tmp = await make_tmp()
                dest = self.tmp

                async def one(batch: list[FileLayout]) -> None:
                    nonlocal abandoned
                    try:
                        await write(dest, batch)
                    except Exception as exc:  # raised below as the first failure
                        errors.append(exc)
                    except BaseException:
                        abandoned = True
                        raise

                async with anyio.create_task_group() as tg, incoming:
                    tg.start_soon(one, layouts)
                    async for fl in incoming:
                        tg.start_soon(one, [fl])
                if errors:
                    raise errors[0]
                self.ok = True
            if self.scope.cancelled_caught:
                if abandoned:  # their threads may still read the arena: never leased again
                    lease.poison()
                raise CheckpointTimeoutError(
                    f"writing the {what} of step {step} (started while it was "
                    f"staged) did not finish within save_timeout_s={self.timeout_s} "
                    "after its staging, or a close gave up on it",
                    step=step,
                    path=self.tmp or root,
                )
        except Exception as exc:  # this save's failure, raised by write()
            self.error = exc
        finally:
            self.done.set()


async def write_files(
    saver: Services,
    tmp: Path,
    plan: Plan,
    layouts: list[FileLayout],
    lease: Lease,
    progress: ProgressCounter | None = None,
    writer: Any = write_data_file,
    limiter: anyio.CapacityLimiter | None = None,
) -> None:
    """Write and fsync every data file from the arena, one worker thread each
    (of ``saver``'s writer threads, or of ``limiter``; counting the bytes written
    into ``progress``; ``writer``: ``_write.write_data_file`` or an incremental
    save's, which may share the file instead)."""
    errors: list[BaseException] = []

    def write(fl: FileLayout) -> None:
        digests = writer(
            saver.fs,
            tmp,
            fl,
            plan.entries,
            lease.buffer,
            direct=saver.options.direct_io,
            on_written=None if progress is None else progress.add_written,
        )
        for i, digest in digests.items():  # in the worker: one per entry
            plan.entries[i].digest = digest

    async def write_one(fl: FileLayout) -> None:
        try:
            await saver.run(write, fl, limiter=limiter)
        except Exception as exc:  # collected, raised below as the first failure
            errors.append(exc)

    async with anyio.create_task_group() as tg:
        for fl in layouts:
            tg.start_soon(write_one, fl)
    if errors:
        raise errors[0]


async def write_round(
    saver: Services, stream: StreamWriter, pieces: list[Piece], lease: Lease, *, finish: bool
) -> None:
    """Write one streamed round from the arena, one worker thread per data file
    (and fsync and close the files after the last round)."""
    errors: list[BaseException] = []

    def one(f: int) -> None:
        stream.write_file_round(f, pieces, lease.buffer)
        if finish:
            stream.finish_file(f)

    async def run_one(f: int) -> None:
        try:
            await saver.run(one, f)
        except Exception as exc:  # collected, raised below as the first failure
            errors.append(exc)

    async with anyio.create_task_group() as tg:
        for f in range(len(stream.layouts)):
            tg.start_soon(run_one, f)
    if errors:
        raise errors[0]


def check_visible(fs: LocalFileSystem, tmp: Path, parts: list[dict[str, Any]]) -> None:
    """On the leader, before the commit: every rank's files are there, whole.

    :raises CheckpointError: a rank's file is missing or short under the leader's
        view of the root: the ranks do not share the storage (a node-local disk, a
        per-process ``memory://``), and a commit would name bytes nobody can read.
    """
    for r, part in enumerate(parts):
        for f in part["files"]:
            path = tmp / f["name"]
            size = fs.size(path) if fs.exists(path) else None
            if size != f["nbytes"]:
                raise CheckpointError(
                    f"rank {r}'s file {f['name']} ({f['nbytes']} bytes) is "
                    f"{'missing' if size is None else f'{size} bytes'} under {tmp} as rank 0 "
                    "sees it: every rank must save into storage all ranks share (not a "
                    "node-local disk or a per-process memory:// root)",
                    path=path,
                    rank=r,
                )


def manifest_doc(
    step: int,
    plan: Plan,
    layouts: list[FileLayout],
    costs: dict[str, float] | None = None,
) -> dict[str, Any]:
    """The manifest of a plain state tree saved by one rank (pure)."""
    with gc_paused():  # a dict per entry: see gc_paused
        return _manifest_doc(step, plan, layouts, costs)


def _manifest_doc(
    step: int, plan: Plan, layouts: list[FileLayout], costs: dict[str, float] | None
) -> dict[str, Any]:
    entries = [
        {"name": e.name, "file": e.file, "offset": e.offset, "nbytes": e.nbytes, CHECKSUM: e.digest}
        for e in plan.entries
    ]
    return {
        "format": FORMAT,
        "format_version": format_version(plan.records),
        "step": step,
        "world_size": 1,
        "checksum": CHECKSUM,
        "created_unix_s": time.time(),
        "files": [{"name": fl.name, "nbytes": fl.nbytes} for fl in layouts],
        "entries": entries,
        "tensors": plan.records,
        "tree": plan.tree,
        "costs": {k: v for k, v in (costs or {}).items() if math.isfinite(v)},
    }


def _shift(node: Any, offset: int) -> Any:
    """A copy of a manifest tree whose tensor indices are moved by ``offset``."""
    if isinstance(node, list):
        return [_shift(x, offset) for x in node]
    if isinstance(node, dict):
        out = {k: _shift(v, offset) for k, v in node.items()}
        if node.get("type") in ("tensor", "pickle") and type(node.get("index")) is int:
            out["index"] = node["index"] + offset
        return out
    return node


def merge_parts(parts: list[dict[str, Any]]) -> dict[str, Any]:
    """The manifest fields of a save of ``len(parts)`` ranks from each rank's
    ``files``, ``entries``, ``tensors`` and ``tree``: concatenated, indices moved;
    the tree keyed by rank; ``ranks`` holds each rank's ranges and own tree.
    Pure: no I/O."""
    files: list[Any] = []
    entries: list[Any] = []
    tensors: list[Any] = []
    items: list[Any] = []
    ranks: list[Any] = []
    for r, part in enumerate(parts):
        f0, e0, t0 = len(files), len(entries), len(tensors)
        files.extend(part["files"])
        entries.extend(dict(e, file=e["file"] + f0) for e in part["entries"])
        tensors.extend(renumbered(t, functools.partial(operator.add, e0)) for t in part["tensors"])
        items.append([["i", r], _shift(part["tree"], t0)])
        ranks.append(
            {"entries": [e0, len(entries)], "tensors": [t0, len(tensors)], "tree": part["tree"]}
        )
    return {
        "format_version": format_version(tensors),
        "world_size": len(parts),
        "files": files,
        "entries": entries,
        "tensors": tensors,
        "tree": {"type": "dict", "items": items},
        "ranks": ranks,
    }


async def plain_job(
    plan: Plan,
    layouts: list[FileLayout],
    nbytes: int,
    *,
    options: CheckpointOptions,
    root: Path,
    world_size: int,
    renames: bool,
    reuse: Reuse,
    rounds: Any,
    relayout: Any,
    payload_bytes: int | None = None,
) -> PlainJob:
    """The job of a plain state tree on this rank, its staging mode decided once
    from the table of what combines (``asyncsave._combine``): every option of
    the save looked up in its context (``world_size``, whether the root
    ``renames`` at the commit, the devices of the plan), refusals raised, the
    mode picked by ``_combine.PRECEDENCE``.

    :param reuse: the checkpointer's incremental state (used when the mode is
        ``incremental``).
    :param rounds: ``rounds(plan, layouts, budget)``: the streamed rounds
        (``_replan.Planner.rounds``; a tensor that cannot be cut is refused).
    :param relayout: ``relayout(plan)``: an incremental save's own file layout
        and staging bytes (blocking: runs in a worker thread).
    :param payload_bytes: ``plan.nbytes`` if known (``_replan.Planner``'s,
        summed in its thread); ``None``: summed here.
    :raises UnsupportedCombinationError: an option refused in this context.
    :raises StagingBudgetError: a state over ``budget_bytes`` that cannot stream
        here (or cannot be cut into rounds).
    """
    ctx = Context(
        "several" if world_size > 1 else "one",
        "rename" if renames else "marker",
        "cpu" if all(d.type == "cpu" for d in plan.devices) else "cuda",
    )
    asked = {opt: lookup(opt, ctx) for opt in _options_asked(options)}
    _refuse(asked, ctx, root)
    modes = {row.mode for row in asked.values() if row.mode is not None}
    if "incremental" in modes:
        # Files of their own (one per large tensor, row chunks of grown ones):
        # the reused layout, and the staging views made for it, do not apply.
        plan.staging_views = ViewCache()
        layouts, nbytes = await anyio.to_thread.run_sync(relayout, plan)
    budget = options.budget_bytes
    if budget and nbytes > budget:
        row = lookup(_OVER_BUDGET, ctx)
        _refuse({_OVER_BUDGET: row}, ctx, root, f"{nbytes} bytes of staging over {budget=}")
        assert row.mode is not None
        modes.add(row.mode)
    mode = next((m for m in PRECEDENCE if m in modes), "whole")
    incremental = asked.get("incremental=True")
    if incremental is not None and mode != "incremental":
        reuse.written_in_full("several ranks" if incremental.warned else "streamed")
    job: PlainJob
    if mode == "streamed":
        assert budget is not None
        job = StreamedJob(plan, layouts, nbytes, rounds(plan, layouts, budget))
    elif mode == "incremental":
        job = IncrementalJob(plan, layouts, nbytes, reuse=reuse, renames=renames)
    elif mode == "following" and nbytes >= FOLLOW_MIN_BYTES:
        job = FollowingJob(plan, layouts, nbytes, always=options.overlap_writes is True)
    else:
        job = PlainJob(plan, layouts, nbytes)
    # A pass over every entry: not on the event loop when the planner summed it.
    job.nbytes = plan.nbytes if payload_bytes is None else payload_bytes
    return job


_OVER_BUDGET = "state over budget_bytes"


def _options_asked(options: CheckpointOptions) -> list[str]:
    """The options of the table that ``options`` sets (``"plain"`` always)."""
    asked = ["plain"]
    if options.overlap_writes is True:
        asked.append("overlap_writes=True")
    elif options.overlap_writes is None:
        asked.append("overlap_writes=None, lazy save")
    if options.incremental:
        asked.append("incremental=True")
    if options.direct_io:
        asked.append("direct_io=True")
    return asked


def _refuse(asked: dict[str, Row], ctx: Context, root: Path, detail: str = "") -> None:
    """Raise the first refusal among ``asked`` (option -> its row)."""
    for opt, row in asked.items():
        if row.refused is not None:
            error = StagingBudgetError if opt == _OVER_BUDGET else UnsupportedCombinationError
            raise error(
                f"{opt}{f' ({detail})' if detail else ''} is not supported on "
                f"{ctx.ranks} rank(s), a root that commits "
                f"by {ctx.storage}, {ctx.device} tensors: {row.refused} (the table: "
                "docs/guides/combinations.md)",
                path=root,
            )


def contains_dtensor(state: Any, _depth: int = 0) -> bool:
    """Whether ``state`` (dicts, lists, tuples, ``Stateful`` objects) holds a
    ``DTensor`` leaf: such state is saved through DCP's planner, so that
    ``dcp.load`` can reshard it."""
    if not (dist.is_available() and dist.is_initialized()) or _depth > 100:
        return False
    from torch.distributed.tensor import DTensor

    if isinstance(state, DTensor):
        return True
    if isinstance(state, dict):
        return any(contains_dtensor(v, _depth + 1) for v in state.values())
    if isinstance(state, (list, tuple)):
        return any(contains_dtensor(v, _depth + 1) for v in state)
    if is_stateful(state) and not isinstance(state, torch.Tensor):
        return contains_dtensor(state.state_dict(), _depth + 1)
    return False


def dtensor_job_class() -> Any:
    """The job class of DTensor state (``DTENSOR_JOB``), imported on first use."""
    return _named(DTENSOR_JOB)


#: ``factory(state, saver)``: the job that snapshots ``state`` on this rank; it may
#: refuse the save with a typed error saying why (``saver``: the checkpointer's
#: ``asyncsave._pipeline.Saver``).
JobFactory = Callable[[Any, Any], Job]

# The job registry: which integration saves which state. The module is imported
# when such state is first saved and registers its factory on import
# (``register_job``); the core names it by string only.
_PROVIDERS: list[tuple[Callable[[Any], bool], str]] = [
    (contains_dtensor, DTENSOR_JOB.partition(":")[0])
]
_FACTORIES: dict[str, JobFactory] = {}


def register_job(module: str, factory: JobFactory) -> None:
    """Register ``module``'s job factory (an integration calls it on import)."""
    _FACTORIES[module] = factory


def job_for(state: Any) -> JobFactory | None:
    """The factory of the integration that saves ``state``, or ``None`` for a
    plain tree (saved by :class:`PlainJob`)."""
    for matches, module in _PROVIDERS:
        if matches(state):
            importlib.import_module(module)  # registers its factory
            return _FACTORIES[module]
    return None


#: The engines other than the core's, by the option that selects them:
#: ``Checkpointer(root, memory=MemoryTier())`` makes a ``MemoryCheckpointer`` (a
#: subclass with the same interface, whose engine runs in a saver process).
ENGINES = {"memory": "asyncsave._memtier:MemoryCheckpointer"}


def engine_for(options: Any, overrides: dict[str, Any]) -> Any:
    """The checkpointer class an option of ``options`` (or of ``overrides``, which
    replace its fields) selects, imported on first use; ``None``: the core's."""
    for field, spec in ENGINES.items():
        value = overrides[field] if field in overrides else getattr(options, field, None)
        if value is not None:
            return _named(spec)
    return None


def dcp_reader_class() -> Any:
    """The DCP storage reader class (``DCP_READER``), imported on first use."""
    return _named(DCP_READER)


def _named(spec: str) -> Any:
    module, _, name = spec.partition(":")
    return getattr(importlib.import_module(module), name)
