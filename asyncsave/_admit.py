"""Admission: the one entry point through which every save enters the pipeline.

:meth:`Checkpointer.save`, :class:`SyncCheckpointer`, :class:`MegatronSaver`, the
DTensor route and the Lightning plugin all submit here, so each rule of a save's
admission is decided in one place:

1. the checkpointer is open and usable (no earlier failure, not closing);
2. the step is a non-negative int (NumPy and 0-dim torch integers accepted);
3. what the call does, decided by :meth:`Admission.verdict`: save, skip (step 0
   unless ``save_step_zero``), no-op (a step committed or in flight, unless
   ``overwrite``), or save below the tracked step. :meth:`Admission.vet` turns
   the verdict into the caller's warning; :meth:`Admission.submit` acts on it,
   decided again under the admission lock (another task or thread may have
   saved the step in between);
4. the overwrite of the checkpoint this run resumed from is refused;
5. which job snapshots the state: a job an integration registered for it
   (``asyncsave._jobs.job_for``; DTensor state goes to ``asyncsave.dcp``'s), else
   a plain job planned off the event loop.

Nothing here serializes, names paths or commits: the job snapshots, the pipeline
(``asyncsave._pipeline.Saver.dispatch``) writes and commits.
"""

from __future__ import annotations

import enum
import logging
import operator
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyio
import torch

from ._catalog import info_of, read_checkpoint
from ._errors import (
    CheckpointError,
    CheckpointWarning,
    InvalidStepError,
    ProtectedCheckpointError,
    RankFailedError,
)
from ._format import FileLayout, staging_nbytes
from ._handle import SaveHandle
from ._incremental import Reuse, incremental_layout
from ._jobs import Job, job_for, plain_job
from ._manifest import check_training_info
from ._options import CheckpointOptions
from ._paths import Layout
from ._plan import Plan
from ._replan import Planner, admitting, plan_off_loop
from ._stage import producer_events
from ._types import CheckpointInfo

if TYPE_CHECKING:
    from ._pipeline import Saver
    from ._tiers import Persister

__all__ = ["Admission", "Verdict"]

logger = logging.getLogger(__name__)

MAX_STEP = 2**63 - 1


class Verdict(enum.Enum):
    """What a ``save()`` of a step does, decided from the checkpointer's state."""

    SAVE = "save"
    SKIP_STEP_ZERO = "skip step 0"
    IN_FLIGHT = "in flight"  # no-op: the first handle
    COMMITTED = "committed"  # no-op: the committed checkpoint's info
    RESUMED = "resumed"  # no-op, without a warning: the step this run resumed from
    BELOW_TRACKED = "below tracked"  # saved, but the tracker stays where it is


def _not_saved_again(step: int, state: str, path: Any) -> CheckpointWarning:
    """The warning of a ``save()`` of a step already ``state`` ("committed" or "in
    flight"): a no-op that drops the state it was given."""
    return CheckpointWarning(
        f"step {step} is already {state}: this save() is a no-op returning the first "
        "save's handle, and the state passed now is not written (pass overwrite=True to "
        "replace it; or does the step counter not advance between saves?)",
        step=step,
        path=path,
    )


class Admission:
    """The admission of one checkpointer's saves (see the module docstring).

    :param saver: the checkpointer's pipeline (its state, pending and committed
        steps, coordinator).
    :param tiers: the persister of a two-tier checkpointer, else ``None``.
    :param planner: plans reused while the state's structure holds.
    :param reuse: what incremental saves link from the last commit.
    """

    def __init__(
        self,
        saver: Saver,
        tiers: Persister | None,
        options: CheckpointOptions,
        layout: Layout,
        planner: Planner,
        reuse: Reuse,
    ) -> None:
        self.saver = saver
        self.tiers = tiers
        self.options = options
        self.layout = layout
        self.planner = planner
        self.reuse = reuse
        # One submit() at a time from its verdict to its dispatch (made on open:
        # an anyio lock belongs to the event loop that runs the checkpointer).
        self.lock: anyio.Lock | None = None

    def _path(self, step: int) -> Path:
        return self.saver.root / self.layout.dir_name(step)

    # -- checks that need no waiting -------------------------------------------------
    def check(self, step: Any) -> int:
        """The checkpointer is usable and ``step`` a valid step: the step as an int.

        :raises CheckpointerClosedError: not open, or closing.
        :raises SaveFailedError: an earlier save failed.
        :raises InvalidStepError: ``step`` is not a non-negative integer.
        """
        self.saver.check_usable()
        if type(step) is not int and not isinstance(step, bool):
            try:  # NumPy and 0-dim torch integers (anything with __index__)
                step = operator.index(step)
            except TypeError:
                pass
        if type(step) is not int or not 0 <= step <= MAX_STEP:
            raise InvalidStepError(f"step must be a non-negative int, got {step!r}")
        return step

    def verdict(self, step: int, overwrite: bool) -> Verdict:
        """What a save of ``step`` does now (the one home of this decision)."""
        saver = self.saver
        if step == 0 and not self.options.save_step_zero:
            return Verdict.SKIP_STEP_ZERO
        if not overwrite and step in saver.pending:
            return Verdict.IN_FLIGHT
        if not overwrite and step in saver.committed:
            return Verdict.RESUMED if step == saver.resumed_step else Verdict.COMMITTED
        tracked = saver.tracked_step
        if tracked is not None and step < tracked:
            return Verdict.BELOW_TRACKED
        return Verdict.SAVE

    def vet(self, step: Any, overwrite: bool) -> tuple[int, list[CheckpointWarning]]:
        """:meth:`check`, and the :class:`CheckpointWarning` the call deserves (one
        per call, for what happens to it: skipped, a no-op, or saved but never
        resumed).

        Nothing waits here. The facades issue the warnings in the caller's thread
        with the caller's line before :meth:`submit` (an error filter there stops
        the save); :meth:`submit` never warns: it may run on the portal's thread of
        :class:`SyncCheckpointer`, where a warning would name anyio's frames and
        escape the caller's filters.
        """
        step = self.check(step)
        verdict = self.verdict(step, overwrite)
        if verdict is Verdict.SKIP_STEP_ZERO:
            note = CheckpointWarning(
                "not saving step 0: a checkpoint of the untrained state is almost always "
                "an off-by-one (pass save_step_zero=True to save it)",
                step=0,
            )
        elif verdict in (Verdict.IN_FLIGHT, Verdict.COMMITTED):
            note = _not_saved_again(step, verdict.value, self._path(step))
        elif verdict is Verdict.BELOW_TRACKED:
            tracked = self.saver.tracked_step
            assert tracked is not None
            note = CheckpointWarning(
                f"saving step {step} below the tracked step {tracked}: the "
                f"tracker stays at {tracked} and resume loads that (did the "
                "run skip load_latest()?)",
                step=step,
                path=self._path(tracked),
            )
        else:
            return step, []
        return step, [note]

    # -- the entry point ------------------------------------------------------------
    async def submit(
        self,
        step: Any,
        state: Any,
        *,
        overwrite: bool = False,
        ready: dict[torch.device, Any] | None = None,
        training_info: dict[str, Any] | None = None,
        lazy: bool = False,
    ) -> SaveHandle:
        """Admit a save of ``state`` as ``step`` and dispatch it to the pipeline.

        ``ready``: CUDA events recorded by the caller's thread (the synchronous
        facade records them before crossing threads). Raises what
        :meth:`Checkpointer.save` documents; issues no warning (see :meth:`vet`).
        """
        t0 = time.perf_counter()
        step = self.check(step)
        info_doc = check_training_info(training_info, step)
        if self.verdict(step, overwrite) is Verdict.SKIP_STEP_ZERO:
            return SaveHandle.resolved(0, None, skipped=True)
        if step == self.saver.resumed_step and overwrite:
            raise ProtectedCheckpointError(
                f"step {step} is the checkpoint this run resumed from; it is never rewritten",
                step=step,
                path=self._path(step),
            )
        # One submit() at a time from here to its dispatch: planning awaits a worker
        # thread, and saves must still be admitted in the order of their calls (the
        # ranks' tickets) and a step only once. While it plans, the save counts as
        # admitted: a close begun meanwhile waits for it. Leaving the lock does not
        # yield, and dispatch() makes the save pending before it first yields.
        assert self.lock is not None
        async with self.lock, admitting(self.saver.queued, step):
            first = await self._first_of(step, overwrite)
            if first is not None:
                return first
            job: Job | BaseException
            try:
                job = await self.job_of(state)
            except Exception as exc:  # with several ranks, the others hear of it
                job = exc
            if isinstance(job, Job) and lazy and ready is None:
                cuda_devices = {d for d in job.devices() if d.type == "cuda"}
                if cuda_devices:
                    # The copies run later: they must see only what was queued before now.
                    ready = producer_events(cuda_devices)
            if self.tiers is not None:  # a slot in the persisting queue, in save() order
                await self.tiers.reserve(step)
        return await (self.tiers or self.saver).dispatch(
            step, job, t0=t0, ready=ready, overwrite=overwrite, lazy=lazy, training_info=info_doc
        )

    async def _first_of(self, step: int, overwrite: bool) -> SaveHandle | None:
        """Under the lock: the handle a no-op returns, else ``None`` (after an
        overwrite waited for the earlier save of its step)."""
        saver = self.saver
        verdict = self.verdict(step, overwrite)
        if verdict is Verdict.IN_FLIGHT:
            pending = saver.pending[step]
            # The first call may still be staging: the caller may mutate its
            # tensors once we return, so the snapshot must be taken by then.
            await pending._staged.wait()
            return pending
        if overwrite and saver.busy(step):  # one save (or copy) of a step at a time
            await saver.queue_behind(step, "overwrite")
        if verdict is Verdict.RESUMED:  # saving right after resuming: harmless
            logger.info("step %d is the checkpoint this run resumed from; kept as is", step)
        if verdict in (Verdict.RESUMED, Verdict.COMMITTED):
            return SaveHandle.resolved(step, await self.committed_info(step))
        if step in saver.committed and not saver.strategy.can_overwrite:
            raise CheckpointError(
                f"cannot overwrite step {step} on {saver.fs!r}: without an atomic rename "
                "the new files would replace the committed ones before the new commit",
                step=step,
                path=self._path(step),
            )
        return None

    async def committed_info(self, step: int) -> CheckpointInfo:
        """The info of the committed ``step`` (read from its manifest once)."""
        info = self.saver.committed.get(step)
        if info is None:
            path = self._path(step)
            info = info_of(
                path, await anyio.to_thread.run_sync(read_checkpoint, self.saver.fs, path)
            )
            self.saver.committed[step] = info
        return info

    # -- the job ----------------------------------------------------------------------
    async def job_of(self, state: Any) -> Job:
        """The job that snapshots ``state`` on this rank: the job an integration
        registered for such state (DTensor state: DCP's planner, so that
        ``load_latest`` reshards it to any world size), else a plain tree,
        planned in a worker thread (the plan of the previous save reused while
        the structure holds) and streamed through a smaller explicit budget."""
        registered = job_for(state)
        if registered is not None:
            job: Job = registered(state, self.saver)
            return job
        plan, layouts, nbytes = await plan_off_loop(
            self.planner,
            state,
            allow_pickle=self.options.allow_pickle,
            rank=self.saver.coord.rank,
            max_files=self.options.writer_threads,
        )
        return await self._plain_job(plan, layouts, nbytes, self.planner.payload_bytes)

    async def _plain_job(
        self, plan: Plan, layouts: list[FileLayout], nbytes: int, payload: int | None = None
    ) -> Job:
        # The staging mode is decided once, from the table of what combines.
        return await plain_job(
            plan,
            layouts,
            nbytes,
            payload_bytes=payload,
            options=self.options,
            root=self.saver.root,
            world_size=self.saver.coord.world_size,
            renames=not self.saver.strategy.writes_in_place,
            reuse=self.reuse,
            rounds=self.planner.rounds,
            relayout=self._incremental_layout,
        )

    def _incremental_layout(self, plan: Any) -> tuple[list[Any], int]:
        # In a worker thread: 100,000 entries take about a second to lay out.
        chunks = self.reuse.split_rows(plan)
        layouts = incremental_layout(plan.entries, rank=self.saver.coord.rank, own=chunks)
        return layouts, staging_nbytes(layouts)

    # -- a save whose temporary directory the caller writes into (Megatron) -----------
    async def prepare(self, step: Any) -> tuple[int, Path]:
        """Take the save's turn and agree on its temporary directory (rank 0 makes
        it, every rank hears its name): ``(ticket, tmp)`` for :meth:`submit_job`.

        :raises RankFailedError: rank 0 could not create it, or a rank died.
        """
        step = self.check(step)
        coord = self.saver.coord
        ticket = coord.take_ticket()

        async def make() -> str:
            return (await self.saver.make_tmp(step)).name

        def failure(reason: str) -> Exception:
            return RankFailedError(
                f"rank 0 could not create the temporary directory of step {step}: {reason}",
                step=step,
                rank=0,
                ranks={0: reason},
            )

        try:
            await coord.wait_turn(ticket)
            name: str = await coord.from_leader("temp-dir", step, make, failure=failure)
        except CheckpointError:
            coord.end_turn(ticket)
            raise
        except Exception as exc:  # a world of one: the leader's own error, typed
            coord.end_turn(ticket)
            raise failure(repr(exc)) from exc
        except BaseException:
            coord.end_turn(ticket)
            raise
        return ticket, self.saver.root / name

    async def submit_job(
        self, step: int, job: Job | BaseException, *, ticket: int, tmp: Path
    ) -> SaveHandle:
        """Dispatch a job built by the caller for the directory :meth:`prepare`
        agreed on (its turn taken there). ``job`` may be the exception that
        building it raised: the other ranks hear of it."""
        t0 = time.perf_counter()
        return await self.saver.dispatch(step, job, t0=t0, ticket=ticket, tmp=tmp)
