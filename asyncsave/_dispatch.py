"""The staging of admitted saves, in the order of their ``save()`` calls, and the
start of their pipelines.

:class:`Stager` serves :meth:`asyncsave._pipeline.Saver.dispatch`: it stages a
save's job (eager: before ``save()`` returns; lazy: as a task of the
checkpointer's group), then starts its :class:`~asyncsave._phases.Pipeline`. A
save that failed before its snapshot fails its handle once
(:meth:`Stager.snapshot_failed`); with several ranks it still runs its pipeline
with the error, so that every rank raises naming it.
"""

from __future__ import annotations

import functools
import logging
import time
from pathlib import Path
from typing import Any

import anyio
import anyio.to_thread
import torch

from ._coord import Turns
from ._errors import CheckpointerClosedError, CheckpointTimeoutError, SaveFailedError
from ._handle import SaveHandle
from ._jobs import Job
from ._phases import Host, Pipeline, Save, as_save_error

__all__ = ["Stager"]

logger = logging.getLogger(__name__)


class Stager:
    """Stages the saves of one checkpointer and starts their pipelines."""

    def __init__(self, saver: Host) -> None:
        self.saver = saver
        # Staging order: saves stage (and lease the one arena) in the order of
        # their save() calls. A lazy save stages in the background, so a later
        # eager save could otherwise lease the arena first, and then wait for its
        # collective turn behind the lazy one, which waits for the arena.
        self.order = Turns()

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
        """See :meth:`asyncsave._pipeline.Saver.dispatch`."""
        saver = self.saver
        if isinstance(job, BaseException) and saver.coord.world_size == 1:
            raise job
        handle = SaveHandle(step)
        if isinstance(job, Job):
            handle._progress.total_bytes = job.nbytes
            job.progress = handle._progress
            job.lazy = lazy
        saver.pending[step] = handle
        if ticket is None:
            ticket = saver.coord.take_ticket()
        save = Save(handle, job, ticket, t0, ready, overwrite, lazy, training_info or {}, tmp)
        save.stage_seq = self.order.take()
        if not lazy or isinstance(job, BaseException):
            await self.snapshot(save)
            return handle
        await self._copy_eagerly(save, job)
        saver.lazy[step] = handle
        save.blocked_s = time.perf_counter() - t0
        assert saver.tg is not None
        saver.tg.start_soon(self._snapshot_in_background, save)
        return handle

    async def _copy_eagerly(self, save: Save, job: Job) -> None:
        """A lazy save's copies that must happen before ``save()`` returns."""
        try:
            where = job.eager_copies()
            if where == "thread":
                # Host clones of 1,000s of small tensors: in a worker thread, so the
                # loop keeps ticking (CUDA clones stay on the caller's stream). With
                # nothing to clone, no thread: its wake-ups cost ms on busy cores.
                await anyio.to_thread.run_sync(job.snapshot_eager, save.ready)
            elif where == "loop":
                job.snapshot_eager(save.ready)
        except BaseException as exc:
            # The caller is still in save(): it hears of it (a cancellation, too);
            # the checkpointer goes on.
            self.snapshot_failed(save, exc, heard=True)
            raise

    async def _snapshot_in_background(self, save: Save) -> None:
        """A lazy save's staging, as a task of the checkpointer's group: its error
        goes to the handle (``staged()`` and ``await handle`` raise it) and makes
        the checkpointer refuse further saves, so it is never lost (invariant 3).

        Shielded: the save was accepted when ``save()`` returned its handle, so
        closing flushes it like any other pending save; only a close that
        gives up after ``close_timeout_s`` cancels it."""
        try:
            with anyio.CancelScope(shield=True) as scope, self.saver.abandonable(scope):
                await self.snapshot(save)
        except Exception as exc:  # already the handle's and the checkpointer's failure
            logger.error("lazy save of step %d failed while staging: %r", save.handle.step, exc)
        finally:
            self.saver.lazy.pop(save.handle.step, None)

    async def snapshot(self, save: Save) -> None:
        """Stage the job, then start the pipeline. On one process a failure fails
        the handle and is raised; on several ranks the pipeline still runs with the
        error, so that every rank hears of it, and then it is raised."""
        saver, job, step = self.saver, save.job, save.handle.step
        try:
            try:
                await self.order.wait(save.stage_seq)
                if isinstance(job, BaseException):
                    raise job
                await job.stage(saver, step, save.ready, functools.partial(self._early_tmp, save))
                save.handle._progress.all_staged(job.nbytes)
            finally:
                self.order.end(save.stage_seq)
            saver.check_flushing(step)
        except BaseException as exc:
            if isinstance(job, Job):
                await job.settle()  # nothing of it runs under the clean-up below
            await self._staging_failed(save, exc)
            raise
        self.start_pipeline(save)
        save.handle._mark_staged()

    def start_pipeline(self, save: Save) -> None:
        assert self.saver.tg is not None
        pipeline = Pipeline(self.saver, save, time.perf_counter() - save.t0)
        self.saver.tg.start_soon(pipeline.run)

    async def _staging_failed(self, save: Save, exc: BaseException) -> None:
        """Staging failed with ``exc`` (the caller raises it after this). One
        process, or a failure that is not the save's own (a cancellation, a close
        that gave up): the handle fails here. Several ranks: the pipeline reports
        it to the others, and the handle resolves there."""
        saver, job, step = self.saver, save.job, save.handle.step
        if (
            saver.coord.world_size == 1
            or not isinstance(exc, Exception)
            or isinstance(exc, CheckpointerClosedError)
            or not saver.accepting
        ):
            error = self.snapshot_failed(save, exc)
            if save.tmp is not None and saver.owns_root:
                await saver.discard(save.tmp)
            await saver.discard(save.private)
            if isinstance(exc, OSError):  # a streamed round's write: an I/O failure
                raise error from exc
            return
        # Several ranks: the pipeline reports it to the others; raised after.
        if isinstance(job, Job):
            if job.staging_lost():
                saver.set_failure(SaveFailedError(f"staging of step {step} was lost"))
            job.release()
            job.abandon()
        await saver.discard(save.private)
        save.job = exc
        self.start_pipeline(save)
        await save.handle._done.wait()
        if isinstance(exc, OSError):  # a streamed round's write: an I/O failure
            raise as_save_error(exc, step, save.private, saver.options.save_timeout_s) from exc

    async def _early_tmp(self, save: Save, own: bool = False) -> Path:
        """Where streamed rounds go before the save's turn. One process: the save's
        temporary directory itself. A rank of several (or ``own``: files written
        while staged, whose directory is made while the copy runs): a temporary
        directory of its own (the shared one is agreed in the turn, phase A),
        whose files the job moves into the shared one at phase B; removed by this
        rank on failure, or by the next open after a crash."""
        saver = self.saver
        if not own and (saver.coord.world_size == 1 or saver.per_rank):
            save.tmp = await saver.make_tmp(save.handle.step)
            return save.tmp
        save.private = private = await saver.make_tmp(save.handle.step)
        # Its own entry durable before files are renamed out of it: under POSIX a
        # rename out of a directory whose entry is lost is lost with it, and the
        # commit's rename could reach the disk without it (the power-loss
        # suite's model). Off the commit's path: while the copy runs.
        await saver.run(saver.fs.fsync_dir, private.parent)
        return private

    def snapshot_failed(
        self, save: Save, exc: BaseException, *, heard: bool = False
    ) -> SaveFailedError:
        """Fail ``save``'s handle before its snapshot was taken, and end its turns.

        Whoever shares this handle (a duplicate save() of the same step, or a
        close waiting for it) must hear of it: nothing else will resolve it."""
        saver, step, handle, job = self.saver, save.handle.step, save.handle, save.job
        error: SaveFailedError
        if not saver.accepting:  # close gave up on it (see check_flushing)
            error = CheckpointTimeoutError(
                f"save of step {step} was abandoned when close_timeout_s="
                f"{saver.options.close_timeout_s} ran out, before its snapshot was taken",
                step=step,
                path=saver.root,
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
            saver.set_failure(error)
        handle._fail(error)
        if isinstance(job, Job):
            if job.staging_lost():
                saver.set_failure(error)  # the staging memory is lost for good
            job.abandon()
            job.release()
        saver.coord.end_turn(save.ticket)
        self.order.end(save.stage_seq)
        if saver.pending.get(step) is handle:
            del saver.pending[step]
        return error
