"""The checkpointer: admits saves, owns the lifecycle (``_lifecycle`` opens and
closes its root), resumes.

It orchestrates only. A save is admitted here (step, duplicates, overwrite), a
job (``_jobs``) snapshots the state, and the one pipeline (``_pipeline``) writes,
gathers and commits through a coordinator (``_coord``: one process, or asyncsave's
gloo group of N ranks); the tracker and retention follow. Integrations (DCP,
Megatron) are jobs; this module imports none of them.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import warnings
from collections.abc import Iterable, Sequence
from types import TracebackType
from typing import Any

import anyio
import anyio.abc
import anyio.to_thread
import torch

from . import _resume, _update
from ._admit import Admission
from ._coord import GlooGroup
from ._errors import (
    CheckpointerClosedError,
    CheckpointWarning,
    SaveFailedError,
)
from ._fsspec import open_root
from ._handle import SaveHandle
from ._incremental import Reuse
from ._jobs import engine_for
from ._lifecycle import Lifecycle
from ._options import CheckpointOptions
from ._paths import LAYOUTS
from ._pipeline import Saver, WorkerDiedError
from ._policy import AgreedPolicy, SavePolicy
from ._replan import Planner
from ._stage import StagingPool
from ._template import warned
from ._tiers import Persister
from ._types import CheckpointInfo, Phase, Restored

__all__ = [
    "Checkpointer",
    "SaveHandle",
    "WorkerDiedError",
    "admission_of",
    "load_latest_and_warning",
    "persist_newest",
    "retain",
]

logger = logging.getLogger(__name__)


async def _resume_from(
    saver: Saver,
    tiers: Persister | None,
    template: Any,
    device: str | torch.device,
    fallback: bool,
    required: Iterable[str | Sequence[Any]],
    strict: bool,
) -> tuple[Restored | None, CheckpointWarning | None]:
    """The body of :meth:`Checkpointer.load_latest`: from the nearest tier, or
    the tracked checkpoint."""
    if tiers is not None:
        return await _resume.load_nearest(
            saver, tiers, template, device=device, required=required, strict=strict
        )
    return await _resume.load_latest(
        saver, template, device=device, fallback=fallback, required=required, strict=strict
    )


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
    thread, has not returned yet; only the save's own failure fails it (a lazy
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

    Two tiers (``persistent=asyncsave.Tier(...)``): ``root`` is then a fast local
    tier (node-local disk, ``/dev/shm``) where every save commits first; the saves
    the tier's policy picks are copied from there to the tier's root in the
    background (``await handle.persisted()``), and ``load_latest()`` resumes from
    the nearest valid tier, agreed by every rank. When each node's ``root`` is
    private (a node-local disk other nodes cannot see), pass
    ``Tier(..., local_scope="rank")``: each rank then commits its own part under
    ``root/rank{r}``. See ``asyncsave._tiers``.

    :param root: directory holding the checkpoints and the tracker; or a URL
        (``s3://bucket/prefix``, any fsspec URL), where checkpoints are committed by
        a marker written last instead of a rename, and no lock guards the root (one
        saver per root is the caller's duty there). See ``storage_options``.
    :param options: a :class:`CheckpointOptions`; keyword ``overrides`` replace
        single fields (``Checkpointer(root, budget_bytes=2 << 30)``).
    """

    def __new__(cls, *args: Any, **kw: Any) -> Checkpointer:  # its engine: see _jobs.ENGINES
        options = args[1] if len(args) > 1 else kw.get("options")
        return object.__new__((cls is Checkpointer and engine_for(options, kw)) or cls)

    def __init__(
        self,
        root: str | os.PathLike[str],
        options: CheckpointOptions | None = None,
        **overrides: Any,
    ) -> None:
        options = options or CheckpointOptions()
        self.options = dataclasses.replace(options, **overrides) if overrides else options
        fs, self.root = open_root(
            root, filesystem=self.options.filesystem, storage_options=self.options.storage_options
        )
        self.layout = LAYOUTS[self.options.layout]
        self._saver = Saver(fs, self.root, self.layout, self.options)
        if self._saver.strategy.needs_tracker and self.layout.tracker_name is None:
            raise ValueError(
                f"layout={self.layout.name!r} has no tracker: its resolver takes the highest "
                f"directory, which on {fs!r} (commit by marker, files written under "
                "the final name) could be a save in flight; use a layout with a tracker"
            )
        tier = self.options.persistent
        self._tiers = None if tier is None else Persister(tier, self._saver)
        self._reuse = Reuse(self.root, self.layout)  # used by incremental saves
        self._life = Lifecycle(self._saver, self._tiers, self._reuse)  # opens, closes the root
        self._loop_thread: int | None = None  # the thread running the event loop
        self._planner = Planner()  # plans reused while the state's structure holds
        self._admission = Admission(
            self._saver, self._tiers, self.options, self.layout, self._planner, self._reuse
        )

    # The saver's state, under the names the integrations and tests know.
    _fs = property(lambda s: s._saver.fs, lambda s, v: setattr(s._saver, "fs", v))
    _state = property(lambda s: s._saver.state, lambda s, v: setattr(s._saver, "state", v))
    _resumed_step = property(
        lambda s: s._saver.resumed_step, lambda s, v: setattr(s._saver, "resumed_step", v)
    )
    _pending = property(lambda s: s._saver.pending)
    _committed = property(lambda s: s._saver.committed)
    _lazy = property(lambda s: s._saver.lazy)
    _pool = property(lambda s: s._saver.pool)
    _tg = property(lambda s: s._saver.tg)
    _failure = property(lambda s: s._saver.failure)
    _accepting = property(lambda s: s._saver.accepting)
    _queued = property(lambda s: s._saver.queued)
    _final_lock = property(lambda s: s._saver.final_lock)

    @property
    def _dist(self) -> GlooGroup | None:
        """The gloo coordinator when several ranks save, else ``None``."""
        coord = self._saver.coord
        return coord if isinstance(coord, GlooGroup) else None

    # -- lifecycle ---------------------------------------------------------------
    async def __aenter__(self) -> Checkpointer:
        saver = self._saver
        if saver.state is not Phase.NEW:
            raise CheckpointerClosedError("a Checkpointer can be entered only once", path=self.root)
        self._admission.lock = anyio.Lock()
        self._loop_thread = threading.get_ident()
        try:
            await self._life.open()
        finally:  # Tier(local_scope="rank"): this rank's own root, once its rank is known
            self.root = saver.root
        return self

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
        return await self._life.shutdown()

    def __del__(self) -> None:
        # Never block or raise here (https://github.com/NVIDIA/Megatron-LM/issues/6970): say that saves were abandoned, and let the
        # root go so that another checkpointer can open it.
        life = getattr(self, "_life", None)
        if life is not None:
            life.release_lock()
        # Compared by value: at interpreter exit the module's globals may be gone.
        if getattr(self, "_state", "closed") == "open" and self._pending:
            warnings.warn(
                f"Checkpointer({str(self.root)!r}) was garbage-collected with saves "
                f"{sorted(self._pending)} in flight; they never committed",
                ResourceWarning,
                stacklevel=1,
            )

    # -- saving ------------------------------------------------------------------
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
        at once (https://github.com/pytorch/pytorch/issues/144657). Waits first while an earlier save still holds the staging
        budget (backpressure). A state larger than an explicit ``budget_bytes``
        streams through it in rounds (stage a budget, write it, reuse it; https://github.com/meta-pytorch/torchsnapshot/issues/112):
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
        and every tensor of at most 64 KiB whose storage no larger saved tensor
        shares; a large buffer, or a small view of a large saved storage, mutated
        in forward and passed as a plain tensor needs ``staged()`` first.

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
            save of several ranks, this rank's state exceeds it and cannot stream
            (DTensor state; an object-store root).
        :raises ProtectedCheckpointError: overwrite of the resumed-from checkpoint.
        :raises SaveFailedError: an earlier save of this checkpointer failed.
        :raises CheckpointerClosedError: used outside ``async with``, or called
            after close began (a call admitted before is flushed by close and
            returns its handle; see the class docstring), or still staging when
            close gave up after ``close_timeout_s``.
        """
        admission = self._admission
        step, notes = admission.vet(step, overwrite)
        for note in notes:  # the caller's line (save() is a coroutine awaited there)
            warnings.warn(note, stacklevel=2)
        return await admission.submit(
            step, state, overwrite=overwrite, training_info=training_info, lazy=lazy
        )

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

    def agree(self, policy: SavePolicy) -> AgreedPolicy:
        """``policy`` with answers every rank agrees on: each ``should_save(step)``
        exchanges every rank's answer (save, stop) through this checkpointer's
        coordinator, so every rank saves the same step and stops after it when
        any rank's policy says so (a SIGTERM that reached one node, one rank's
        deadline estimate). With one process it answers as ``policy`` does.
        Call it inside ``async with``; see :class:`AgreedPolicy`.

        :raises CheckpointerClosedError: the checkpointer is not open.
        """
        if self._state is not Phase.OPEN:
            raise CheckpointerClosedError("agree() needs an open Checkpointer", path=self.root)
        return AgreedPolicy(policy, self._saver.coord.vote)

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
        return await _update.update(self._saver, step, key, value)

    async def wait(self) -> None:
        """Wait until every pending save has committed or failed.

        :raises SaveFailedError: a save of this checkpointer failed.
        :raises CheckpointerClosedError: the checkpointer is not open (never entered,
            or closed: closing already waited for every save).
        """
        if self._state is not Phase.OPEN:
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
        strict: bool = True,
    ) -> Restored | None:
        """Load the checkpoint the tracker names; ``None`` when nothing is committed.

        Reading runs in a worker thread; ``Stateful`` objects of ``template`` are
        restored on the caller's thread. The step loaded is protected: this run never
        rewrites it. See :func:`asyncsave.load` for ``template``, ``strict``,
        ``device``, ``required``; pickled leaves load only if the options allow
        pickle.

        :raises CheckpointNotFoundError: the tracker names a missing or damaged
            checkpoint and ``fallback`` is false (a missing or garbage tracker falls
            back to scanning, with a warning). With ``fallback``, a checkpoint whose
            bytes fail their checksums is skipped for the next older one.
        :raises CorruptCheckpointError: the checkpoint's bytes are damaged and
            ``fallback`` is false (the message says how to fall back).
        :raises TemplateMismatchError: the checkpoint does not fit ``template``
            (see :func:`asyncsave.load`); nothing was changed in place.

        Several ranks: every rank calls it (in the same order as its saves), each
        reads only its own part, and the ranks agree: all resume the same step; a
        part damaged on any rank makes every rank raise naming that rank, or, with
        ``fallback``, every rank fall back to the same older step while rank 0
        moves the damaged checkpoint aside.
        :raises CheckpointError: (several ranks) another rank could not resume, or
            the ranks found different checkpoints (storage they do not share).
        """
        return warned(await self._load_latest(template, device, fallback, required, strict), 3)

    async def _load_latest(self, *args: Any) -> tuple[Restored | None, CheckpointWarning | None]:
        """:meth:`load_latest` and the warning of a ``strict=False`` load that
        left something out, for the facades to issue on the caller's thread."""
        return await _resume_from(self._saver, self._tiers, *args)

    @property
    def resumed_step(self) -> int | None:
        """The step ``load_latest()`` resumed from, if any."""
        return self._resumed_step

    @property
    def tracked_step(self) -> int | None:
        """The step the tracker names, as far as this checkpointer knows."""
        return self._saver.tracked_step

    @property
    def pending_steps(self) -> list[int]:
        """Steps whose saves are in flight."""
        return sorted(self._pending)

    @property
    def staging_pool(self) -> StagingPool | None:
        """The staging pool (for inspection: capacity, allocations)."""
        return self._pool


# The internal entry points of the integrations and facades (``asyncsave._sync``,
# ``asyncsave.megatron``, ``asyncsave.lightning``): named functions, so that no
# module outside this one reaches into a checkpointer's private members.
def admission_of(ckpt: Checkpointer) -> Admission:
    """The admission through which every save of ``ckpt`` enters its pipeline."""
    return ckpt._admission


async def retain(ckpt: Checkpointer, step: int) -> None:
    """Run ``ckpt``'s retention pass as after the commit of ``step`` (bounded by
    ``save_timeout_s``; never deletes the tracked, an in-flight or the resumed-from
    checkpoint)."""
    await ckpt._saver.retain(step)


async def persist_newest(ckpt: Checkpointer) -> int | None:
    """Queue ``ckpt``'s newest committed checkpoint for its persistent tier if
    that tier lacks it (whatever the tier's policy); ``None`` without a tier or
    when nothing is due. See :meth:`asyncsave._tiers.Persister.persist_newest`."""
    if ckpt._tiers is None:
        return None
    return await ckpt._tiers.persist_newest()


async def load_latest_and_warning(
    ckpt: Checkpointer, *args: Any
) -> tuple[Restored | None, CheckpointWarning | None]:
    """:meth:`Checkpointer.load_latest` (same positional arguments) and the
    warning of a ``strict=False`` load that left something out, for a facade to
    issue on its caller's thread."""
    return await ckpt._load_latest(*args)
