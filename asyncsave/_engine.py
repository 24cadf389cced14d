"""The engine: orchestrates plan → stage → write → commit → track.

It does not serialise or name paths itself: ``_plan`` flattens, ``_format`` lays
out files, ``_stage`` copies, ``_write`` writes, ``_commit`` publishes, ``_track``
moves the tracker, ``_load`` reads. One anyio task group per checkpointer runs one
pipeline task per save; each pipeline is shielded from the caller's cancellation
(a pump cancelled by preemption still finishes the saves it dispatched) and bounded
by ``save_timeout_s``; closing waits at most ``close_timeout_s``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import logging
import math
import operator
import os
import threading
import time
import warnings
from collections.abc import Generator, Iterable, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

import anyio
import anyio.abc
import anyio.to_thread
import torch

from ._commit import commit_dir, discard, lock_root, make_temp_dir, move_aside, recover
from ._dist import (
    DcpJob,
    DistContext,
    PlainJob,
    contains_dtensor,
    load_rank,
    run_save,
    stage_dtensor_state,
    wants_distributed,
)
from ._errors import (
    CheckpointerClosedError,
    CheckpointError,
    CheckpointNotFoundError,
    CheckpointTimeoutError,
    CheckpointWarning,
    CorruptCheckpointError,
    InvalidKeyError,
    InvalidStateError,
    InvalidStepError,
    ProtectedCheckpointError,
    RootInUseError,
    SaveFailedError,
    WaitTimeoutError,
)
from ._format import FileLayout, layout_files, staging_nbytes
from ._fsspec import open_root
from ._load import (
    _apply_template,
    _check_required,
    info_of,
    load,
    older_committed,
    read_checkpoint,
    resolve,
)
from ._manifest import CHECKSUM, FORMAT, FORMAT_VERSION, check_training_info, encode_manifest
from ._options import CheckpointOptions
from ._paths import LAYOUTS, MANIFEST_NAME
from ._plan import Entry, Plan, make_plan
from ._retention import apply_retention
from ._stage import (
    Lease,
    StagingPool,
    lease_and_stage,
    producer_events,
    snapshot_eager_entries,
    stage_entries,
)
from ._stream import Piece, StreamWriter, piece_entries, plan_rounds
from ._track import TrackerWriter
from ._types import CheckpointInfo, Restored
from ._update import rewrite_item
from ._write import write_bytes, write_data_file

__all__ = ["Checkpointer", "SaveHandle"]

logger = logging.getLogger(__name__)

_MAX_STEP = 2**63 - 1


def _not_saved_again(step: int, state: str, path: Any) -> CheckpointWarning:
    """The warning of a ``save()`` of a step already ``state`` ("committed" or "in
    flight"): a no-op that drops the state it was given (decisions.md)."""
    return CheckpointWarning(
        f"step {step} is already {state}: this save() is a no-op returning the first "
        "save's handle, and the state passed now is not written (pass overwrite=True to "
        "replace it; or does the step counter not advance between saves?)",
        step=step,
        path=path,
    )


class SaveHandle:
    """An awaitable for one save. ``await handle`` returns the committed
    :class:`CheckpointInfo` once the checkpoint is committed and the tracker names
    it or a newer one durably, or raises :class:`SaveFailedError` (the original
    error as ``__cause__``).

    A skipped save (step 0 without ``save_step_zero``) resolves to ``None`` at once;
    ``skipped`` tells it apart. Awaiting a handle again returns (or raises) the same
    result. Awaiting is bounded by the save's ``save_timeout_s``.
    """

    def __init__(self, step: int, *, skipped: bool = False) -> None:
        self.step = step
        self.skipped = skipped
        self._staged = anyio.Event()
        # The same moment, for threads that are not the event loop's (the
        # optimizer pre-hook of a synchronous training thread waits on it).
        self._staged_thread = threading.Event()
        self._done = anyio.Event()
        self._info: CheckpointInfo | None = None
        self._error: BaseException | None = None
        self._staged_error: BaseException | None = None  # failed before the snapshot

    @classmethod
    def resolved(
        cls, step: int, info: CheckpointInfo | None, *, skipped: bool = False
    ) -> SaveHandle:
        handle = cls(step, skipped=skipped)
        handle._info = info
        handle._mark_staged()
        handle._done.set()
        return handle

    def __repr__(self) -> str:
        state = (
            "skipped"
            if self.skipped
            else "failed"
            if self._error
            else "committed"
            if self.done()
            else "pending"
        )
        return f"<SaveHandle step={self.step} {state}>"

    def __await__(self) -> Generator[Any, None, CheckpointInfo | None]:
        return self.wait().__await__()

    def done(self) -> bool:
        """Whether the save has committed, failed or been skipped."""
        return self._done.is_set()

    async def staged(self) -> None:
        """Return once the snapshot is in host memory: the caller may mutate the
        tensors it saved. In eager mode ``save()`` already returned after this; in
        lazy mode (``save(..., lazy=True)``) await it before mutating them.

        :raises SaveFailedError: the save ended before its snapshot was complete
            (the tensors were not captured; the caller may mutate them anyway).
        """
        await self._staged.wait()
        if self._staged_error is not None:
            raise self._staged_error

    def is_staged(self) -> bool:
        """Whether the snapshot is complete (or the save ended without one)."""
        return self._staged.is_set()

    def _mark_staged(self) -> None:
        self._staged.set()
        self._staged_thread.set()

    async def wait(self, timeout_s: float | None = None) -> CheckpointInfo | None:
        """Wait for the commit.

        :param timeout_s: an extra bound in seconds (the save's own
            ``save_timeout_s`` always applies).
        :raises SaveFailedError: the save failed; ``__cause__`` is the original.
        :raises WaitTimeoutError: ``timeout_s`` passed first (the save goes on; this is
            not a failure of the save).
        """
        if timeout_s is None:
            await self._done.wait()
        else:
            with anyio.move_on_after(timeout_s):
                await self._done.wait()
            if not self._done.is_set():
                raise WaitTimeoutError(
                    f"step {self.step} did not commit within {timeout_s} s (the save goes on)",
                    step=self.step,
                )
        return self.result()

    def result(self) -> CheckpointInfo | None:
        """The committed info, without waiting.

        :raises RuntimeError: the save is still in flight.
        :raises SaveFailedError: the save failed.
        """
        if not self._done.is_set():
            raise RuntimeError(f"the save of step {self.step} is still in flight")
        if self._error is not None:
            raise self._error
        return self._info

    def _commit(self, info: CheckpointInfo) -> None:
        self._info = info
        self._mark_staged()
        self._done.set()

    def _fail(self, error: BaseException) -> None:
        if self._done.is_set():
            return  # resolved already (committed before a late cancellation): it stands
        self._error = error
        if not self._staged.is_set():
            self._staged_error = error
        self._mark_staged()
        self._done.set()


@dataclasses.dataclass
class _Snapshot:
    """What one save carries from ``save()`` to its pipeline."""

    handle: SaveHandle
    plan: Plan
    layouts: list[FileLayout]
    nbytes: int  # staging bytes of the whole state
    rounds: list[list[Piece]] | None  # streamed through a smaller budget (S15)
    t0: float
    ready: dict[torch.device, Any] | None
    overwrite: bool
    lazy: bool
    training_info: dict[str, Any]
    blocked_s: float | None = None  # lazy: how long save() held the caller


class Checkpointer:
    """Saves training state asynchronously under ``root`` and resumes from it.

    Use it as an async context manager; it owns an anyio task group, so it works
    under asyncio (uvloop too) and trio::

        async with asyncsave.Checkpointer("runs/exp1") as ckpt:
            restored = await ckpt.load_latest(template)   # None on a fresh run
            ...
            handle = await ckpt.save(step, {"model": model, "optim": opt})
            ...                                          # training goes on
            info = await handle                          # committed

    Opening makes ``root`` (and parents), takes the root's saver lock (a second
    checkpointer on the same root raises :class:`RootInUseError`), removes temporary
    directories of saves that never committed and final-named directories without a
    manifest, moves damaged checkpoints aside, and moves the tracker forward to the
    newest committed checkpoint. Readers use :func:`asyncsave.latest` and
    :func:`asyncsave.load`, which change nothing.

    Enter and leave it with ``async with`` (or ``aclose()`` from the task that
    entered it): it holds a task group, whose scope belongs to that task.

    Leaving the block flushes pending saves (at most ``close_timeout_s``). If the
    body raised, that exception propagates unchanged and a flush failure is attached
    to it with ``add_note`` and logged (Source: NVIDIA-NeMo/RL PR #2828 review, where
    a bare ``finally`` replaced the training error by the flush error); on a clean
    exit a flush failure is raised.

    A save is *accepted* once ``save()`` has admitted it: the checkpointer was open
    and the step was not committed or pending, so it became a pending step (before
    ``save()`` first waits; every ``save()`` that returned a handle was accepted).
    Close flushes every accepted save, whatever phase it is in (waiting for the
    staging buffer, staging, a streamed round, writing, committing, tracking,
    retention), lazy or eager, also one whose ``save()`` call, in another task or
    thread, has not returned yet; only the save's own failure fails it (S18: a lazy
    save made just before leaving the block used to be refused by the closing
    checkpointer and lost). A ``save()`` call admitted after close began, including
    an ``overwrite`` still waiting for the earlier save of its step, raises
    :class:`CheckpointerClosedError` and leaves nothing behind. Past
    ``close_timeout_s`` close abandons what is left: those handles fail with
    :class:`CheckpointTimeoutError`, and a ``save()`` still running raises
    :class:`CheckpointerClosedError`.

    After any save fails, the checkpointer refuses further saves: ``save()``,
    ``wait()`` and close raise :class:`SaveFailedError`. A trainer never goes on
    believing it is checkpointing; open a new checkpointer to go on. Saves accepted
    before the failure still run to their own end.

    Several ranks (``torch.distributed`` initialised with a world size above 1, or
    ``distributed=True``): entering creates asyncsave's own gloo group (every rank,
    in the same order); only rank 0 locks and recovers the root; every rank calls
    ``save()`` with the same steps in the same order; rank 0 commits once every
    rank's files are durable and every rank's handle resolves after that; any
    rank's failure raises :class:`RankFailedError` on all ranks. DTensor (FSDP2)
    state goes through DCP's planner so that ``dcp.load`` reshards it. See
    ``asyncsave._dist``, ``asyncsave.dcp`` and ``asyncsave.megatron``.

    :param root: directory holding the checkpoints and the tracker; or a URL
        (``s3://bucket/prefix``, any fsspec URL), where checkpoints are committed by
        a marker written last instead of a rename, and no lock guards the root (one
        saver per root is the caller's duty there). See ``storage_options``.
    :param options: a :class:`CheckpointOptions`; keyword ``overrides`` replace
        single fields (``Checkpointer(root, budget_bytes=2 << 30)``).
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        options: CheckpointOptions | None = None,
        **overrides: Any,
    ) -> None:
        options = options or CheckpointOptions()
        self.options = dataclasses.replace(options, **overrides) if overrides else options
        self._fs, self.root = open_root(
            root, filesystem=self.options.filesystem, storage_options=self.options.storage_options
        )
        self.layout = LAYOUTS[self.options.layout]
        if not self._fs.atomic_rename and self.layout.tracker_name is None:
            raise ValueError(
                f"layout={self.layout.name!r} has no tracker: its resolver takes the highest "
                f"directory, which on {self._fs!r} (commit by marker, files written under "
                "the final name) could be a save in flight; use a layout with a tracker"
            )
        self._state = "new"
        self._pending: dict[int, SaveHandle] = {}
        # Overwrites and updates admitted while an earlier save of their step is
        # pending (see _queue_behind): each gate is set when it stops waiting.
        self._queued: dict[anyio.Event, int] = {}
        self._scopes: dict[int, anyio.CancelScope] = {}
        # Shielded scopes of accepted saves that are still staging (a lazy save's
        # staging task, a streamed round's write): cancelled only when close gives up.
        self._staging_scopes: set[anyio.CancelScope] = set()
        self._committed: dict[int, CheckpointInfo | None] = {}
        self._tracker: TrackerWriter | None = None
        self._lock_fd: int | None = None
        self._accepting = False  # whether the task group takes new pipelines
        self._resumed_step: int | None = None
        self._failure: SaveFailedError | None = None
        self._tg: anyio.abc.TaskGroup | None = None
        self._pool: StagingPool | None = None
        self._limiter: anyio.CapacityLimiter | None = None
        self._retention_lock = anyio.Lock()
        self._lazy: dict[int, SaveHandle] = {}  # lazy saves not yet staged
        self._loop_thread: int | None = None  # the thread running the event loop
        self._dist: DistContext | None = None  # several ranks: see asyncsave._dist
        # Held inside worker threads by everything that renames or removes a final
        # directory (commit, retention, update, recovery at open): a thread abandoned
        # at a deadline keeps it until it finishes, so no later thread can race it,
        # not even one of a later checkpointer on the same root in this process.
        self._final_lock = _final_lock_for(self.root)

    # -- lifecycle ---------------------------------------------------------------
    async def __aenter__(self) -> Checkpointer:
        if self._state != "new":
            raise CheckpointerClosedError("a Checkpointer can be entered only once", path=self.root)
        self._pool = StagingPool(self.options.budget_bytes)
        self._loop_thread = threading.get_ident()
        self._limiter = anyio.CapacityLimiter(self.options.writer_threads)
        if wants_distributed(self.options.distributed):
            if not self._fs.atomic_rename:
                raise CheckpointError(
                    f"several ranks save into a shared POSIX file system root; {self.root} "
                    f"is on {self._fs!r} (commit by marker), which asyncsave supports for "
                    "one process only",
                    path=self.root,
                )
            self._dist = await DistContext.create(self.options.dist_timeout_s)
            # Rank 0 alone locks and recovers; the others wait for its result.
            committed, tracked = await self._dist.open_root(self._open_root, self.root)
        else:
            committed, tracked = await self._open_root()
        self._committed = dict.fromkeys(committed)
        # Forward only, even past a tracker that names a checkpoint that is gone:
        # saves below it commit but do not move it (resume then needs fallback=True).
        steps = [s for s in (tracked, *committed) if s is not None]
        baseline = max(steps, default=None)
        if self.layout.tracker_name is not None and (self._dist is None or self._dist.rank == 0):
            self._tracker = TrackerWriter(self._fs, self.root / self.layout.tracker_name, baseline)
        tg = anyio.create_task_group()
        await tg.__aenter__()
        self._tg = tg
        self._accepting = True
        self._state = "open"
        return self

    async def _open_root(self) -> tuple[list[int], int | None]:
        """Take the saver lock and recover the root: (committed steps, tracked step)."""
        self._lock_fd = await anyio.to_thread.run_sync(lock_root, self._fs, self.root)
        try:
            recovered = await anyio.to_thread.run_sync(self._recover)
        except BaseException:
            with anyio.CancelScope(shield=True):
                await self._unlock()
            raise
        return list(recovered.committed), recovered.tracked

    def _recover(self) -> Any:
        if not self._final_lock.acquire(timeout=self.options.close_timeout_s):
            raise RootInUseError(
                f"a commit abandoned by an earlier Checkpointer on {self.root} in this "
                f"process is still running after close_timeout_s="
                f"{self.options.close_timeout_s}; try again once it finishes",
                path=self.root,
            )
        try:
            return recover(self._fs, self.root, self.layout)
        finally:
            self._final_lock.release()

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool:
        error = await self._shutdown()
        if exc is not None:
            if error is not None and error is not exc:
                exc.add_note(f"asyncsave: a checkpoint save also failed during shutdown: {error!r}")
                logger.error(
                    "checkpoint flush failed while %r was propagating", exc, exc_info=error
                )
            return False
        if error is not None:
            raise error
        return False

    async def aclose(self) -> None:
        """Flush pending saves and release staging memory; idempotent.

        :raises SaveFailedError: a save failed during this checkpointer's life and
            this is the first close.
        :raises CheckpointTimeoutError: pending saves outlasted ``close_timeout_s``.
        """
        error = await self._shutdown()
        if error is not None:
            raise error

    async def _shutdown(self) -> SaveFailedError | None:
        if self._state in ("closing", "closed"):
            return None
        if self._state == "new":
            self._state = "closed"
            return None
        self._state = "closing"
        with anyio.CancelScope(shield=True):
            with anyio.move_on_after(self.options.close_timeout_s):
                while self._pending or self._queued:
                    if self._pending:
                        await next(iter(self._pending.values()))._done.wait()
                    else:  # an admitted overwrite about to become pending
                        await next(iter(self._queued)).wait()
            if self._pending:
                steps = sorted(self._pending)
                self._set_failure(
                    CheckpointTimeoutError(
                        f"saves of steps {steps} were still running after "
                        f"close_timeout_s={self.options.close_timeout_s}; abandoned "
                        "uncommitted (their temporary directories are removed at the "
                        "next open)",
                        step=steps[0],
                        path=self.root,
                    )
                )
                for scope in [*self._scopes.values(), *self._staging_scopes]:
                    scope.cancel()
        # The task group's scope must be exited from outside any scope opened
        # after it; its pipelines are finished or cancelled by now, so this returns
        # as soon as their (shielded, bounded) clean-up is done.
        assert self._tg is not None and self._pool is not None
        self._accepting = False
        try:
            await self._tg.__aexit__(None, None, None)
        finally:
            with anyio.CancelScope(shield=True):
                await self._pool.aclose()
                await self._unlock()
            self._state = "closed"
        return self._failure

    async def _unlock(self) -> None:
        fd, self._lock_fd = self._lock_fd, None
        if fd is not None:
            await anyio.to_thread.run_sync(self._fs.unlock, fd)

    def __del__(self) -> None:
        # Never block or raise here (S4): say that saves were abandoned, and let the
        # root go so that another checkpointer can open it.
        fd = getattr(self, "_lock_fd", None)
        if fd is not None:
            self._lock_fd = None
            self._fs.unlock(fd)
        if getattr(self, "_state", "closed") == "open" and self._pending:
            warnings.warn(
                f"Checkpointer({str(self.root)!r}) was garbage-collected with saves "
                f"{sorted(self._pending)} in flight; they never committed",
                ResourceWarning,
                stacklevel=1,
            )

    # -- saving ------------------------------------------------------------------
    def _check_usable(self) -> None:
        if self._state != "open":
            raise CheckpointerClosedError(
                f"the Checkpointer for {self.root} is {self._state}; use it inside `async with`",
                path=self.root,
            )
        if self._failure is not None:
            raise self._failure

    def _set_failure(self, error: SaveFailedError) -> None:
        if self._failure is None:
            self._failure = error

    async def save(
        self,
        step: int,
        state: Any,
        *,
        overwrite: bool = False,
        training_info: dict[str, Any] | None = None,
        lazy: bool = False,
    ) -> SaveHandle:
        """Snapshot ``state`` as the checkpoint of ``step`` and write it in the
        background.

        Returns once the snapshot is consistent (eager): every tensor has been
        copied into the staging buffer, so the caller may mutate or free its tensors
        at once (S11). Waits first while an earlier save still holds the staging
        budget (backpressure). A state larger than an explicit ``budget_bytes``
        streams through it in rounds (stage a budget, write it, reuse it; S15):
        an eager ``save()`` then also waits while all but the last round are
        written (not fsynced), since every byte must be copied somewhere before
        the caller may mutate its tensors; a lazy one moves that wait to
        ``staged()``.

        Lazy mode (``lazy=True``; CheckFreq, FAST'21; DataStates-LLM, HPDC'24;
        TorchTitan's staging before ``optimizer.step()``) returns once the save is
        planned and its staging started (CUDA copies are ordered after the
        kernels queued before the call): training may run forward and backward,
        but must ``await handle.staged()`` (or ``ckpt.staged()``, or use
        :func:`asyncsave.stage_before_step`) before it mutates the saved tensors.
        Tensors that change during forward are copied before ``save()`` returns:
        buffers of ``nn.Module`` objects in ``state`` (BatchNorm running stats)
        and every tensor of at most 64 KiB (the same stats passed as a plain
        ``state_dict()``); a large buffer mutated in forward, passed as a plain
        tensor, needs ``staged()`` before the forward.

        :param step: the last trained step (a non-negative int). Step 0 is skipped
            unless ``save_step_zero``; a step already committed or in flight is a
            no-op returning the first handle, unless ``overwrite``. Both, and a step
            below the tracked one, issue a :class:`CheckpointWarning` (a re-save of
            the step this run resumed from is only logged at INFO).
        :param state: a tree of dicts (str/int keys), lists and tuples whose leaves
            are tensors (CPU or CUDA, any dtype), TensorDicts, NumPy arrays and
            scalars, plain values, :class:`Tagged` items and ``Stateful`` objects
            (their ``state_dict()`` is taken now).
        :param overwrite: replace a committed checkpoint of the same step
            atomically; refused for the checkpoint this run resumed from. Called
            while an earlier save of the step is pending, it waits for that save
            (queued: a close begun meanwhile flushes it too).
        :param training_info: flat counters and metrics describing the checkpoint
            (``{"consumed_samples": 640, "eval/reward": 0.71}``; values int,
            finite float, str, bool or None). Kept in the manifest
            (:attr:`CheckpointInfo.training_info`), ranked by :class:`KeepBest`,
            and written as ``training_info.json`` (with ``"step"``) by the
            ``nemo-rl`` layout.
        :param lazy: return before the snapshot is complete (see above).
        :raises InvalidStepError: ``step`` is not a non-negative integer (NumPy and
            0-dim torch integers are accepted).
        :raises InvalidStateError: (or a subclass) naming the key that cannot be
            stored; nothing is written.
        :raises StagingBudgetError: a non-contiguous CPU tensor (gathered whole) does
            not fit its data file's share of an explicit ``budget_bytes``, or, in a
            save of several ranks (which does not stream), this rank's state exceeds it.
        :raises ProtectedCheckpointError: overwrite of the resumed-from checkpoint.
        :raises SaveFailedError: an earlier save of this checkpointer failed.
        :raises CheckpointerClosedError: used outside ``async with``, or called
            after close began (a call admitted before is flushed by close and
            returns its handle; see the class docstring), or still staging when
            close gave up after ``close_timeout_s``.
        """
        step, notes = self._vet(step, overwrite)
        for note in notes:  # the caller's line (save() is a coroutine awaited there)
            warnings.warn(note, stacklevel=2)
        return await self._save(
            step, state, overwrite=overwrite, ready=None, training_info=training_info, lazy=lazy
        )

    def _vet(self, step: Any, overwrite: bool) -> tuple[int, list[CheckpointWarning]]:
        """The checks of :meth:`save` that need no waiting: the step as an int, and
        the :class:`CheckpointWarning` objects the call deserves (below the tracked
        step, step 0 skipped, already committed or in flight).

        Nothing waits here, so nothing changes between this and the ``_save`` that
        follows on the event loop. The facades issue the warnings in the caller's
        thread with the caller's line before calling ``_save`` (an error filter
        there stops the save); ``_save`` itself never warns: it may run on the
        portal's thread of :class:`SyncCheckpointer`, where a warning would name
        anyio's frames and escape the caller's filters (review of item 7).

        :raises CheckpointerClosedError: see :meth:`save`.
        :raises InvalidStepError: see :meth:`save`.
        """
        self._check_usable()
        if type(step) is not int and not isinstance(step, bool):
            try:  # NumPy and 0-dim torch integers (anything with __index__)
                step = operator.index(step)
            except TypeError:
                pass
        if type(step) is not int or not 0 <= step <= _MAX_STEP:
            raise InvalidStepError(f"step must be a non-negative int, got {step!r}")
        notes: list[CheckpointWarning] = []
        path = self.root / self.layout.dir_name(step)
        # One warning per call, for what happens to it: skipped (step 0), a no-op
        # (in flight or committed), or saved but never resumed (below the tracker).
        if step == 0 and not self.options.save_step_zero:
            notes.append(
                CheckpointWarning(
                    "not saving step 0: a checkpoint of the untrained state is almost always "
                    "an off-by-one (pass save_step_zero=True to save it)",
                    step=0,
                )
            )
        elif not overwrite and step in self._pending:
            notes.append(_not_saved_again(step, "in flight", path))
        elif not overwrite and step in self._committed and step != self._resumed_step:
            notes.append(_not_saved_again(step, "committed", path))
        elif self.tracked_step is not None and step < self.tracked_step:
            # The user's intent is likely wrong: a warning (decisions.md).
            notes.append(
                CheckpointWarning(
                    f"saving step {step} below the tracked step {self.tracked_step}: the "
                    f"tracker stays at {self.tracked_step} and resume loads that (did the "
                    "run skip load_latest()?)",
                    step=step,
                    path=self.root / self.layout.dir_name(self.tracked_step),
                )
            )
        return step, notes

    async def staged(self) -> None:
        """Wait until every lazy save of this checkpointer is staged: after this the
        caller may mutate the tensors it saved (call it before ``optimizer.step()``
        in an async pump, or use :func:`asyncsave.stage_before_step`).

        :raises SaveFailedError: a lazy save failed before its snapshot was taken.
        """
        while self._lazy:
            await next(iter(self._lazy.values()))._staged.wait()
        if self._failure is not None:
            raise self._failure

    async def _save(
        self,
        step: int,
        state: Any,
        *,
        overwrite: bool,
        ready: dict[torch.device, Any] | None,
        training_info: dict[str, Any] | None = None,
        lazy: bool = False,
    ) -> SaveHandle:
        """The body of :meth:`save`; ``ready`` are CUDA events recorded by the caller's
        thread (the synchronous facade records them before crossing threads)."""
        t0 = time.perf_counter()
        step, _ = self._vet(step, overwrite)  # the caller issued its warnings
        info_doc = check_training_info(training_info)
        if info_doc.get("step", step) != step:
            raise InvalidStateError(
                f"training_info['step'] is {info_doc['step']!r} but this is step {step}",
                key="training_info",
                step=step,
            )
        if step == 0 and not self.options.save_step_zero:
            return SaveHandle.resolved(0, None, skipped=True)
        if step == self._resumed_step and overwrite:
            raise ProtectedCheckpointError(
                f"step {step} is the checkpoint this run resumed from; it is never rewritten",
                step=step,
                path=self.root / self.layout.dir_name(step),
            )
        pending = self._pending.get(step)
        if pending is not None and not overwrite:
            # The first call may still be staging: the caller may mutate its
            # tensors once we return, so the snapshot must be taken by then.
            await pending._staged.wait()
            return pending
        if pending is not None:  # overwrite: one save of a step at a time
            await self._queue_behind(step, "overwrite")
        if step in self._committed and not overwrite:
            if step == self._resumed_step:  # saving right after resuming: harmless
                logger.info("step %d is the checkpoint this run resumed from; kept as is", step)
            return SaveHandle.resolved(step, await self._committed_info(step))
        if step in self._committed and not self._fs.atomic_rename:
            raise CheckpointError(
                f"cannot overwrite step {step} on {self._fs!r}: without an atomic rename "
                "the new files would replace the committed ones before the new commit",
                step=step,
                path=self.root / self.layout.dir_name(step),
            )
        if self._dist is not None:
            return await self._save_ranks(
                self._dist, step, state, overwrite=overwrite, t0=t0, training_info=info_doc
            )

        plan = make_plan(state, allow_pickle=self.options.allow_pickle)
        layouts = layout_files(plan.entries, rank=0, max_files=self.options.writer_threads)
        nbytes = staging_nbytes(layouts)
        assert self._pool is not None and self._tg is not None
        budget = self.options.budget_bytes
        # A state larger than an explicit budget streams through it (S15); the
        # rounds are planned (and a tensor that cannot be cut refused) up front.
        rounds = plan_rounds(plan.entries, layouts, budget) if budget and nbytes > budget else None
        cuda_devices = {d for d in plan.devices if d.type == "cuda"}
        if lazy and ready is None and cuda_devices:
            # The copies run later: they must see only what was queued before now.
            ready = producer_events(cuda_devices)
        handle = SaveHandle(step)
        self._pending[step] = handle
        job = _Snapshot(handle, plan, layouts, nbytes, rounds, t0, ready, overwrite, lazy, info_doc)
        if not lazy:
            await self._snapshot(job)
            return handle
        try:
            snapshot_eager_entries(plan, ready)
        except BaseException as exc:
            self._snapshot_failed(job, exc, None)
            raise
        self._lazy[step] = handle
        job.blocked_s = time.perf_counter() - t0
        self._tg.start_soon(self._snapshot_in_background, job)
        return handle

    async def _snapshot_in_background(self, job: _Snapshot) -> None:
        """A lazy save's staging, as a task of the checkpointer's group: its error
        goes to the handle (``staged()`` and ``await handle`` raise it) and makes
        the checkpointer refuse further saves, so it is never lost (invariant 3).

        Shielded: the save was accepted when ``save()`` returned its handle, so
        closing flushes it like any other pending save (S18); only a close that
        gives up after ``close_timeout_s`` cancels it."""
        try:
            with anyio.CancelScope(shield=True) as scope, self._abandonable(scope):
                await self._snapshot(job)
        except Exception as exc:  # already the handle's and the checkpointer's failure
            logger.error("lazy save of step %d failed while staging: %r", job.handle.step, exc)
        finally:
            self._lazy.pop(job.handle.step, None)

    @contextlib.contextmanager
    def _abandonable(self, scope: anyio.CancelScope) -> Generator[None, None, None]:
        """Let a close that gives up after ``close_timeout_s`` cancel ``scope`` (a
        shielded part of an accepted save that runs before its pipeline)."""
        self._staging_scopes.add(scope)
        try:
            yield
        finally:
            self._staging_scopes.discard(scope)

    async def _snapshot(self, job: _Snapshot) -> None:
        """Lease the staging arena, copy the snapshot into it (streaming through it
        in rounds when the state is larger than the budget), then start the
        background pipeline. Raises what went wrong, after failing the handle.

        The save was accepted before this runs (its handle is pending): neither a
        close that began meanwhile nor another save's failure stops it (S18); only
        its own staging error, or a close that gave up after ``close_timeout_s``."""
        assert self._pool is not None and self._tg is not None
        plan, handle, step = job.plan, job.handle, job.handle.step
        lease: Lease | None = None
        stream: StreamWriter | None = None
        try:
            pin = any(d.type == "cuda" for d in plan.devices)
            if job.rounds is None:
                lease = await self._pool.acquire(job.nbytes, pin=pin)
            else:
                assert self.options.budget_bytes is not None
                lease = await self._pool.acquire(self.options.budget_bytes, pin=pin)
            self._check_flushing(step)
            deadline = anyio.current_time() + self.options.save_timeout_s
            if job.rounds is None:
                await self._stage(lease, plan.entries, job, deadline)
            else:
                tmp = await self._run(
                    functools.partial(make_temp_dir, final=self.root / self.layout.dir_name(step)),
                    self._fs,
                    self.root,
                    step,
                )
                stream = StreamWriter(self._fs, tmp, job.layouts, plan.entries)
                for pieces in job.rounds[:-1]:
                    await self._stage(lease, piece_entries(plan.entries, pieces), job, deadline)
                    # Shielded (the arena is reused next round), bounded by the
                    # save's deadline: a writer stuck past it is abandoned, and then
                    # may still read the arena and use its descriptors, so the arena
                    # is never reused (poisoned) and the descriptors never closed.
                    with (
                        anyio.CancelScope(shield=True, deadline=deadline) as scope,
                        self._abandonable(scope),
                    ):
                        await self._write_round(stream, pieces, lease, finish=False)
                    if scope.cancelled_caught:
                        lease.poison()
                        stream.fds = [None] * len(stream.fds)
                        why = (
                            f"close_timeout_s={self.options.close_timeout_s} ran out"
                            if not self._accepting and anyio.current_time() < deadline
                            else f"save_timeout_s={self.options.save_timeout_s} passed"
                        )
                        raise CheckpointTimeoutError(
                            f"writing a streamed round of step {step} was abandoned: {why}",
                            step=step,
                            path=stream.directory,
                        )
                await self._stage(lease, piece_entries(plan.entries, job.rounds[-1]), job, deadline)
            self._check_flushing(step)
            plan.release_sources()
            staged_s = time.perf_counter() - job.t0
            self._tg.start_soon(self._pipeline, job, lease, staged_s, stream)
            handle._mark_staged()
        except BaseException as exc:
            error = self._snapshot_failed(job, exc, lease)
            if stream is not None:
                stream.close_quietly()
                await self._discard(stream.directory)
            if isinstance(exc, OSError):  # a streamed round's write: an I/O failure
                raise error from exc
            raise

    def _check_flushing(self, step: int) -> None:
        """Raise if close gave up (``close_timeout_s``) while the accepted save of
        ``step`` was still before its pipeline: the task group takes no new task.

        Close stops taking pipelines only once every pending save has resolved, or
        once it gave up; an accepted save is pending until it resolves, so this
        raises only in the second case."""
        if not self._accepting:
            raise CheckpointerClosedError(
                f"the Checkpointer for {self.root} gave up on step {step} after "
                f"close_timeout_s={self.options.close_timeout_s}, before its snapshot "
                "was taken",
                step=step,
                path=self.root,
            )

    async def _stage(
        self, lease: Lease, entries: list[Entry], job: _Snapshot, deadline: float
    ) -> None:
        await stage_entries(
            lease,
            entries,
            poll_interval_s=self.options.poll_interval_s,
            timeout_s=max(0.0, deadline - anyio.current_time()),
            ready=job.ready,
        )

    def _snapshot_failed(
        self, job: _Snapshot, exc: BaseException, lease: Lease | None
    ) -> SaveFailedError:
        # Whoever shares this handle (a duplicate save() of the same step, or a
        # close waiting for it) must hear of it: nothing else will resolve it.
        step, handle = job.handle.step, job.handle
        error: SaveFailedError
        if not self._accepting:  # close gave up on it (see _check_flushing)
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
        if job.lazy:
            # Nobody is in save() to hear of it: the checkpointer refuses further
            # saves, so it is raised at the next save(), wait() or close.
            self._set_failure(error)
        handle._fail(error)
        if lease is not None:
            if lease.poisoned:
                self._set_failure(error)  # the staging memory is lost for good
            lease.release()
        if self._pending.get(step) is handle:
            del self._pending[step]
        return error

    async def _save_ranks(
        self,
        ctx: DistContext,
        step: int,
        state: Any,
        *,
        overwrite: bool,
        t0: float,
        training_info: dict[str, Any],
    ) -> SaveHandle:
        """The body of :meth:`save` for one rank of several (see ``asyncsave._dist``).

        DTensor state is staged by DCP's ``DefaultStager`` (CPU copies) and written
        through DCP's planner; other state is staged into this rank's pool. A rank
        whose snapshot fails still takes part in the save's collectives, so that
        every rank raises naming it.
        """
        assert self._pool is not None and self._tg is not None
        handle = SaveHandle(step)
        self._pending[step] = handle
        job: PlainJob | DcpJob | BaseException
        lease: Lease | None = None
        try:
            if contains_dtensor(state):
                job = await stage_dtensor_state(self, state)
            else:
                plan = make_plan(state, allow_pickle=self.options.allow_pickle)
                layouts = layout_files(
                    plan.entries, rank=ctx.rank, max_files=self.options.writer_threads
                )
                nbytes = staging_nbytes(layouts)
                self._pool.check(nbytes)
                lease = await self._pool.acquire(
                    nbytes, pin=any(d.type == "cuda" for d in plan.devices)
                )
                # Accepted (pending) already: a close that began while this waited
                # flushes it (S18); it is not refused here, which would fail the
                # save on every rank and the close with it.
                await stage_entries(
                    lease,
                    plan.entries,
                    poll_interval_s=self.options.poll_interval_s,
                    timeout_s=self.options.save_timeout_s,
                )
                plan.release_sources()
                job = PlainJob(plan, layouts, lease)
                lease = None
        except Exception as exc:
            if lease is not None:
                if lease.poisoned:
                    self._set_failure(SaveFailedError(f"staging of step {step} was lost"))
                lease.release()
            job = exc
        if not self._accepting:  # close gave up (close_timeout_s) while this staged
            if isinstance(job, PlainJob):
                job.lease.release()
            closed = CheckpointerClosedError(
                f"the Checkpointer for {self.root} closed while step {step} was staging",
                step=step,
                path=self.root,
            )
            # As _snapshot_failed does: a duplicate save() of this step waiting on
            # the handle's staged event, and whoever awaits it, must hear of it.
            error = CheckpointTimeoutError(
                f"save of step {step} was abandoned when close_timeout_s="
                f"{self.options.close_timeout_s} ran out, before its snapshot was taken",
                step=step,
                path=self.root,
            )
            error.__cause__ = closed
            handle._fail(error)
            if self._pending.get(step) is handle:
                del self._pending[step]
            raise closed
        staged_s = time.perf_counter() - t0
        self._tg.start_soon(
            run_save,
            self,
            ctx,
            ctx.take_ticket(),
            handle,
            job,
            (t0, staged_s),
            overwrite,
            training_info,
        )
        if isinstance(job, BaseException):
            # The pipeline reports it to the other ranks; this rank raises now.
            await handle._done.wait()
            raise job
        handle._staged.set()
        return handle

    async def _committed_info(self, step: int) -> CheckpointInfo:
        info = self._committed.get(step)
        if info is None:
            path = self.root / self.layout.dir_name(step)
            info = info_of(path, await anyio.to_thread.run_sync(read_checkpoint, self._fs, path))
            self._committed[step] = info
        return info

    async def _run(self, func: Any, *args: Any) -> Any:
        """Blocking I/O in a worker thread; a thread stuck past the save's deadline
        is abandoned. Threads that rename or remove final directories (commit,
        retention, update) hold ``_final_lock`` while they do, so an abandoned one
        finishes before any other can touch a final directory. A worker that dies
        (see :func:`_in_worker`) becomes an ordinary save failure."""
        return await anyio.to_thread.run_sync(
            _in_worker, func, *args, limiter=self._limiter, abandon_on_cancel=True
        )

    async def _pipeline(
        self, job: _Snapshot, lease: Lease, staged_s: float, stream: StreamWriter | None
    ) -> None:
        handle, plan, layouts, t0, overwrite = (
            job.handle,
            job.plan,
            job.layouts,
            job.t0,
            job.overwrite,
        )
        step = handle.step
        blocked_s = staged_s if job.blocked_s is None else job.blocked_s
        tmp: Path | None = None if stream is None else stream.directory
        committing = False
        renamed = False  # under its final name: committed, whatever fails after
        with anyio.CancelScope(shield=True) as scope:
            self._scopes[step] = scope
            try:
                with anyio.fail_after(self.options.save_timeout_s):
                    final = self.root / self.layout.dir_name(step)
                    if stream is None:
                        tmp = await self._run(
                            functools.partial(make_temp_dir, final=final), self._fs, self.root, step
                        )
                        assert tmp is not None
                        await self._write_files(tmp, plan, layouts, lease)
                    else:
                        assert job.rounds is not None and tmp is not None
                        try:
                            await self._write_round(stream, job.rounds[-1], lease, finish=True)
                        except Exception:
                            # Not on cancellation: an abandoned writer thread may
                            # still use its descriptor.
                            stream.close_quietly()
                            raise
                        for i, digest in stream.digests().items():
                            plan.entries[i].digest = digest
                    lease.release()
                    written_s = time.perf_counter() - t0
                    manifest = _manifest_doc(step, plan, layouts, blocked_s, staged_s, written_s)
                    manifest["training_info"] = job.training_info
                    if self.layout.info_name is not None:
                        info_json = json.dumps({**job.training_info, "step": step}, indent=1)
                        await self._run(
                            write_bytes, self._fs, tmp / self.layout.info_name, info_json.encode()
                        )
                    # Encoding is CPU work (about 60 ms for 10,000 tensors): in the
                    # worker thread with the write, never on the event loop.
                    await self._run(_write_manifest, self._fs, tmp / MANIFEST_NAME, manifest)
                    # From here on a thread abandoned at the deadline may still
                    # rename: the temp dir is left to the next open, never removed
                    # under its feet.
                    committing = True
                    try:
                        await self._run(
                            self._under_final_lock,
                            functools.partial(commit_dir, overwrite=overwrite),
                            self._fs,
                            tmp,
                            final,
                        )
                    except Exception:
                        committing = False  # the thread finished: nothing runs on
                        raise
                    committing = False
                    renamed = True
                    tmp = None  # committed: nothing to discard any more
                    await self._track(step)
                info = CheckpointInfo(
                    step=step,
                    path=final,
                    nbytes=plan.nbytes,
                    num_tensors=len(plan.leaves),
                    blocked_s=blocked_s,
                    staged_s=staged_s,
                    written_s=written_s,
                    committed_s=time.perf_counter() - t0,
                    training_info=job.training_info,
                )
                self._committed[step] = info
                try:
                    # Outside the save's deadline: the save is committed and tracked,
                    # a slow delete must not fail it (retention has its own bound).
                    await self._retain(step)
                finally:
                    handle._commit(info)  # committed, whatever became of retention
                logger.info(
                    "saved step %d to %s: %d bytes, blocked %.3f s, written %.3f s, committed %.3f s",
                    step,
                    final,
                    info.nbytes,
                    blocked_s,
                    written_s,
                    info.committed_s,
                )
            except Exception as exc:
                error = _as_save_error(exc, step, tmp, self.options.save_timeout_s)
                if renamed and error is not exc:
                    # Renamed already: the directory is whole and the next open
                    # takes it as committed; only what follows (the tracker) failed.
                    error = type(error)(  # a timeout stays a CheckpointTimeoutError
                        f"step {step} was committed (its directory is final and "
                        f"complete) but updating the tracker failed: {exc!r}; the next "
                        "open moves the tracker to it",
                        step=step,
                        path=self.root / self.layout.dir_name(step),
                    )
                    error.__cause__ = exc
                self._fail(handle, error)
                if not committing:
                    await self._discard(tmp)
            except anyio.get_cancelled_exc_class():
                self._fail(
                    handle,
                    CheckpointTimeoutError(
                        f"save of step {step} was abandoned when close_timeout_s ran out",
                        step=step,
                        path=tmp,
                    ),
                )
                if not committing:
                    await self._discard(tmp)
                raise
            finally:
                lease.release()
                if self._pending.get(step) is handle:
                    del self._pending[step]
                self._scopes.pop(step, None)

    def _fail(self, handle: SaveHandle, error: SaveFailedError) -> None:
        self._set_failure(error)
        handle._fail(error)
        logger.error("%s", error, exc_info=error.__cause__)

    async def _discard(self, tmp: Path | None) -> None:
        if tmp is None:
            return
        with anyio.CancelScope(shield=True), anyio.move_on_after(30):
            await anyio.to_thread.run_sync(
                _in_worker, discard, self._fs, tmp, abandon_on_cancel=True
            )

    async def _write_files(
        self, tmp: Path, plan: Plan, layouts: list[FileLayout], lease: Lease
    ) -> None:
        errors: list[BaseException] = []

        async def write_one(fl: FileLayout) -> None:
            try:
                digests = await self._run(
                    functools.partial(write_data_file, direct=self.options.direct_io),
                    self._fs,
                    tmp,
                    fl,
                    plan.entries,
                    lease.buffer,
                )
            except Exception as exc:  # collected, raised below as the first failure
                errors.append(exc)
                return
            for i, digest in digests.items():
                plan.entries[i].digest = digest

        async with anyio.create_task_group() as tg:
            for fl in layouts:
                tg.start_soon(write_one, fl)
        if errors:
            raise errors[0]

    async def _write_round(
        self, stream: StreamWriter, pieces: list[Piece], lease: Lease, *, finish: bool
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
                await self._run(one, f)
            except Exception as exc:  # collected, raised below as the first failure
                errors.append(exc)

        async with anyio.create_task_group() as tg:
            for f in range(len(stream.layouts)):
                tg.start_soon(run_one, f)
        if errors:
            raise errors[0]

    async def _track(self, step: int) -> None:
        """Move the tracker to ``step`` unless it already names a newer one."""
        if self._tracker is not None:
            await self._run(self._tracker.advance, step)

    async def update(self, step: int, key: str, value: Any) -> CheckpointInfo:
        """Replace one top-level item of a checkpoint this run committed, atomically.

        For a small item next to a large state (a trainer state or dataloader
        position rewritten after filtering data, as in SkyRL's fully-async
        checkpointing fix): the other items are not read or rewritten; the new
        checkpoint directory hard-links their data files, adds one checksummed data
        file for the item's tensors (if any) and a new manifest, and replaces the
        old directory with ``renameat2(RENAME_EXCHANGE)`` (a crash leaves the old
        or the new checkpoint, never a mix). Runs like a save of that step: a
        ``save()`` of the same step waits for it, retention never deletes it
        meanwhile. ``value`` is copied before this returns.

        :param step: a step this checkpointer saved and committed.
        :param key: the top-level key of the item (a str) the checkpoint has.
        :param value: its new value (anything ``save()`` stores).
        :returns: the updated checkpoint's info.
        :raises ProtectedCheckpointError: ``step`` is the checkpoint this run
            resumed from, or one this run did not write.
        :raises MissingItemError: the checkpoint has no item ``key``.
        :raises CheckpointNotFoundError: the checkpoint is gone (retention) or does
            not read (:class:`CorruptCheckpointError`); the checkpointer stays usable.
        :raises InvalidKeyError: ``key`` is not a str.
        :raises InvalidStateError: ``value`` cannot be stored (nothing changes).
        :raises SaveFailedError: the rewrite failed (the committed checkpoint is
            unchanged); like a failed save, the checkpointer refuses further saves.
        """
        self._check_usable()
        path = self.root / self.layout.dir_name(step)
        if not self._fs.atomic_rename:
            raise CheckpointError(
                f"update() swaps directories atomically, which {self._fs!r} cannot; "
                "save the step under a new number instead",
                step=step,
                path=path,
            )
        if type(key) is not str:
            raise InvalidKeyError(f"update() needs a str key, got {key!r}", key=repr(key))
        if step == self._resumed_step:
            raise ProtectedCheckpointError(
                f"step {step} is the checkpoint this run resumed from; it is never rewritten",
                step=step,
                path=path,
            )
        await self._queue_behind(step, "update")
        old = self._committed.get(step)
        if old is None and not await anyio.to_thread.run_sync(self._fs.exists, path):
            raise CheckpointNotFoundError(
                f"there is no checkpoint of step {step} to update ({path})", step=step, path=path
            )
        if old is None or old.committed_s is None:
            raise ProtectedCheckpointError(
                f"step {step} was not saved by this checkpointer; update() rewrites only "
                "checkpoints this run wrote",
                step=step,
                path=path,
            )
        plan = make_plan({key: value}, allow_pickle=self.options.allow_pickle)
        layouts = layout_files(plan.entries, rank=0, max_files=1)
        handle = SaveHandle(step)
        handle._staged.set()
        self._pending[step] = handle
        pool = StagingPool(None)
        try:
            lease = await lease_and_stage(
                pool,
                staging_nbytes(layouts),
                plan.entries,
                poll_interval_s=self.options.poll_interval_s,
                timeout_s=self.options.save_timeout_s,
            )
            plan.release_sources()
            with anyio.CancelScope(shield=True), anyio.fail_after(self.options.save_timeout_s):
                nbytes, num_tensors = await self._run(
                    self._under_final_lock,
                    rewrite_item,
                    self._fs,
                    self.root,
                    path,
                    key,
                    plan,
                    layouts,
                    lease.buffer,
                )
            info = dataclasses.replace(old, nbytes=nbytes, num_tensors=num_tensors)
            self._committed[step] = info
            handle._commit(info)
            return info
        except (CheckpointError, anyio.get_cancelled_exc_class()) as exc:
            handle._fail(SaveFailedError(f"update of step {step} did not happen: {exc!r}"))
            raise
        except Exception as exc:
            error = _as_save_error(exc, step, path, self.options.save_timeout_s)
            self._fail(handle, error)
            raise error from exc
        finally:
            if self._pending.get(step) is handle:
                del self._pending[step]
            with anyio.CancelScope(shield=True):
                await pool.aclose()

    async def _queue_behind(self, step: int, what: str) -> None:
        """Wait until no save (or update) of ``step`` is pending: an ``overwrite``
        save or an :meth:`update` admitted while an earlier one of its step runs.

        Admitted already (the checkpointer was open when it was called): queued,
        so close waits for it and flushes it like a pending save (S18), and no
        check after this asks whether close began or another save failed since.
        The caller registers its own pending handle before it next awaits, so
        close, woken by the gate, then finds it pending.

        :raises CheckpointerClosedError: close gave up after ``close_timeout_s``
            while this waited (the task group takes no new save).
        """
        gate = anyio.Event()
        self._queued[gate] = step
        try:
            while (pending := self._pending.get(step)) is not None:
                await pending._done.wait()
            if not self._accepting:
                raise CheckpointerClosedError(
                    f"the Checkpointer for {self.root} gave up after close_timeout_s="
                    f"{self.options.close_timeout_s} while this {what} of step {step} "
                    "waited for the earlier save of its step",
                    step=step,
                    path=self.root,
                )
        finally:
            del self._queued[gate]
            gate.set()

    def _under_final_lock(self, func: Any, *args: Any) -> Any:
        with self._final_lock:
            return func(*args)

    def _move_damaged_aside(self, path: Path, step: int, reason: str) -> None:
        """Move the damaged checkpoint ``path`` aside, durably (raises what fails)."""
        if move_aside(self._fs, self.root, path, "damaged", step, reason, quiet=False):
            self._fs.fsync_dir(self.root)

    async def _retain(self, step: int) -> None:
        """Apply the retention rule after the commit of ``step`` (S2, S8: never
        before), bounded by ``save_timeout_s``.

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
            steps = {step, *self._pending}
            if self.tracked_step is not None:
                steps.add(self.tracked_step)
            return steps

        removed: list[int] = []
        # Not shielded: close_timeout_s may abandon a slow pass (its thread holds the
        # final-directory lock until it finishes, so nothing races it).
        with anyio.move_on_after(self.options.save_timeout_s):
            try:
                removed = await self._run(
                    self._under_final_lock,
                    apply_retention,
                    self._fs,
                    self.root,
                    self.layout,
                    rule,
                    protected,
                )
            except OSError as exc:
                logger.warning("retention failed (re-applied after the next commit): %r", exc)
        for gone in removed:
            self._committed.pop(gone, None)

    async def wait(self) -> None:
        """Wait until every pending save has committed or failed.

        :raises SaveFailedError: a save of this checkpointer failed.
        :raises CheckpointerClosedError: the checkpointer is not open (never entered,
            or closed: closing already waited for every save).
        """
        if self._state != "open":
            raise CheckpointerClosedError(
                f"wait() needs an open Checkpointer (this one is {self._state})", path=self.root
            )
        while self._pending:
            await next(iter(self._pending.values()))._done.wait()
        if self._failure is not None:
            raise self._failure

    # -- resuming ----------------------------------------------------------------
    async def load_latest(
        self,
        template: Any = None,
        *,
        device: str | torch.device = "cpu",
        fallback: bool = False,
        required: Iterable[str | Sequence[Any]] = (),
    ) -> Restored | None:
        """Load the checkpoint the tracker names; ``None`` when nothing is committed.

        Reading runs in a worker thread; ``Stateful`` objects of ``template`` are
        restored on the caller's thread. The step loaded is protected: this run never
        rewrites it. See :func:`asyncsave.load` for ``template``, ``device``,
        ``required``; pickled leaves load only if the options allow pickle.

        :raises CheckpointNotFoundError: the tracker names a missing or damaged
            checkpoint and ``fallback`` is false (a missing or garbage tracker falls
            back to scanning, with a warning). With ``fallback``, a checkpoint whose
            bytes fail their checksums is skipped for the next older one.
        :raises CorruptCheckpointError: the checkpoint's bytes are damaged and
            ``fallback`` is false.
        """
        if self._state != "open":
            raise CheckpointerClosedError(
                "load_latest() needs an open Checkpointer", path=self.root
            )
        info = await anyio.to_thread.run_sync(
            lambda: resolve(self._fs, self.root, self.layout, fallback=fallback)
        )
        if info is None:
            return None
        while True:
            path = info.path
            reader: Any = functools.partial(load, path)
            if self._dist is not None:  # this rank's part only
                reader = functools.partial(load_rank, path, self._dist.rank, self._dist.world_size)
            try:
                state = await anyio.to_thread.run_sync(
                    functools.partial(
                        reader,
                        device=device,
                        allow_pickle=self.options.allow_pickle,
                        filesystem=self._fs,
                    )
                )
                break
            except CorruptCheckpointError as exc:
                if not fallback:
                    raise
                logger.warning(
                    "cannot load %s (%s); falling back to an older checkpoint", path, exc
                )
                step = info.step
                # Not a checkpoint any more: a later save() of this step must write
                # it again, not find it "committed" (and never over damaged bytes).
                self._committed.pop(step, None)
                if self._dist is None and self._fs.atomic_rename:
                    await anyio.to_thread.run_sync(
                        self._under_final_lock, self._move_damaged_aside, path, step, str(exc)
                    )
                older = await anyio.to_thread.run_sync(
                    older_committed, self._fs, self.root, self.layout, step
                )
                if older is None:
                    raise CheckpointNotFoundError(
                        f"no loadable checkpoint in {self.root} at or below step {step}",
                        path=self.root,
                    ) from exc
                info = older
        _check_required(state, required, info.path)
        state = _apply_template(state, template, (), info.path)
        self._resumed_step = info.step
        self._committed.setdefault(info.step, info)
        return Restored(state, info)

    @property
    def resumed_step(self) -> int | None:
        """The step ``load_latest()`` resumed from, if any."""
        return self._resumed_step

    @property
    def tracked_step(self) -> int | None:
        """The step the tracker names, as far as this checkpointer knows."""
        return None if self._tracker is None else self._tracker.highest

    @property
    def pending_steps(self) -> list[int]:
        """Steps whose saves are in flight."""
        return sorted(self._pending)

    @property
    def staging_pool(self) -> StagingPool | None:
        """The staging pool (for inspection: capacity, allocations)."""
        return self._pool


class WorkerDiedError(RuntimeError):
    """A worker thread ended with a ``BaseException`` that is not an ``Exception``
    (``SystemExit`` from a library, a thread-killing ``BaseException``); the
    original is ``__cause__``."""


def _in_worker(func: Any, *args: Any) -> Any:
    """Run ``func`` in a worker thread so that however the worker dies, the save
    fails with an ``Exception`` (S4: a dead writer becomes an error). A
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
    """One lock per root in this process (see ``Checkpointer._final_lock``)."""
    key = str(root)
    if "://" not in key:
        key = os.path.realpath(key)
    with _FINAL_LOCKS_GUARD:
        return _FINAL_LOCKS.setdefault(key, threading.Lock())


def _as_save_error(
    exc: Exception, step: int, tmp: Path | None, timeout_s: float
) -> SaveFailedError:
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


def _manifest_doc(
    step: int,
    plan: Plan,
    layouts: list[FileLayout],
    blocked_s: float,
    staged_s: float,
    written_s: float,
) -> dict[str, Any]:
    entries = []
    for e in plan.entries:
        entries.append(
            {
                "name": e.name,
                "file": e.file,
                "offset": e.offset,
                "nbytes": e.nbytes,
                CHECKSUM: e.digest,
            }
        )
    return {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "step": step,
        "world_size": 1,
        "checksum": CHECKSUM,
        "created_unix_s": time.time(),
        "files": [{"name": fl.name, "nbytes": fl.nbytes} for fl in layouts],
        "entries": entries,
        "tensors": plan.records,
        "tree": plan.tree,
        "costs": {
            k: v
            for k, v in (("blocked_s", blocked_s), ("staged_s", staged_s), ("written_s", written_s))
            if math.isfinite(v)
        },
    }
