"""Resuming: the checkpoint the tracker names, read in a worker thread (this
rank's part only, on several ranks), falling back to older ones on request; with
a persistent tier, the newest step that loads from either tier
(:func:`load_nearest`). Which steps are committed comes from the catalog."""

from __future__ import annotations

import functools
import logging
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyio.to_thread
import torch

from ._atomicity import move_aside_durably
from ._catalog import committed_steps, info_of, older_committed, read_checkpoint, resolve
from ._coord import Coordinator
from ._dist import load_rank
from ._errors import (
    CheckpointerClosedError,
    CheckpointError,
    CheckpointNotFoundError,
    CheckpointWarning,
    CorruptCheckpointError,
)
from ._fs import LocalFileSystem
from ._jobs import dcp_reader_class
from ._load import _check_required, load
from ._pipeline import Saver
from ._template import apply_template
from ._types import CheckpointInfo, Phase, Restored

if TYPE_CHECKING:
    from ._tiers import Persister

__all__ = ["NearestTiers", "load_latest", "load_nearest", "protect_resumed", "resume_nearest"]

logger = logging.getLogger(__name__)


async def load_latest(
    saver: Saver,
    template: Any,
    *,
    device: str | torch.device,
    fallback: bool,
    required: Iterable[str | Sequence[Any]],
    strict: bool = True,
) -> tuple[Restored | None, CheckpointWarning | None]:
    """The body of :meth:`asyncsave.Checkpointer.load_latest` (see there), and
    the warning of a ``strict=False`` load into ``template`` (for the caller's
    thread to issue), if anything was not loaded.

    Several ranks agree on the step, in the collective order of their saves
    (every rank calls it, as it calls ``save()``): after each attempt every
    rank's view (the step it resolved, its error, whether its part failed its
    checksums) is gathered, so that every rank resumes from the same step, falls
    back together (rank 0 moving the damaged checkpoint aside), or raises."""
    if saver.state is not Phase.OPEN:
        raise CheckpointerClosedError("load_latest() needs an open Checkpointer", path=saver.root)
    async with saver.coord.turn():
        found = await _agreed_load(
            saver, template, device=device, fallback=fallback, required=required
        )
    if found is None:
        # A fresh run, or a mistyped root or layout: say which, where it shows.
        logger.info(
            "no committed checkpoint in %s (layout %r): starting from scratch",
            saver.root,
            saver.layout.name,
        )
        return None, None
    state, info = found
    state, note = apply_template(state, template, info.path, strict=strict)
    saver.resumed_step = info.step
    saver.committed.setdefault(info.step, info)
    return Restored(state, info), note


async def _agreed_load(
    saver: Saver,
    template: Any,
    *,
    device: str | torch.device,
    fallback: bool,
    required: Iterable[str | Sequence[Any]],
) -> tuple[Any, CheckpointInfo] | None:
    """Resolve, read and agree, falling back on damage (see :func:`load_latest`).

    Each attempt: this rank reads its part (a DCP checkpoint: its metadata, and
    the template checked against it); every rank's view is gathered; then, for a
    DCP checkpoint only once every rank is ready, the collective read."""
    coord = saver.coord
    error: CheckpointError | None = None  # this rank cannot resume at all
    info: CheckpointInfo | None = None
    try:
        info = await anyio.to_thread.run_sync(
            lambda: resolve(saver.fs, saver.root, saver.layout, fallback=fallback)
        )
    except CheckpointError as exc:
        if coord.world_size == 1:
            raise
        error = exc
    while True:
        state: Any = None
        job: Any = None  # a DCP checkpoint's collective read, once every rank is ready
        damaged_here: CorruptCheckpointError | None = None
        if error is None and info is not None:
            try:
                state, job = await _read_part(saver, info, template, device, required)
            except CorruptCheckpointError as exc:
                damaged_here = exc
                if coord.world_size > 1 and exc.rank is None:
                    exc.rank = coord.rank  # whose part it is
            except CheckpointError as exc:
                if coord.world_size == 1:
                    raise
                error = exc
        damaged = await _agree(saver, info, error, damaged_here)
        if info is None:
            return None
        if not damaged and job is not None:
            try:  # every rank is ready: the collective read (DCP's planner reshards)
                state = await _read_collective(saver, job)
            except CorruptCheckpointError as exc:  # raised on every rank
                damaged_here = exc
                damaged = {exc.rank or 0: str(exc)}
        if not damaged:
            return state, info
        info, error = await _fall_back(saver, info, damaged, damaged_here, fallback)


async def _read_part(
    saver: Saver,
    info: CheckpointInfo,
    template: Any,
    device: str | torch.device,
    required: Iterable[str | Sequence[Any]],
) -> tuple[Any, Any]:
    """This rank's part of ``info``: ``(tree, None)``, the tree read in a worker
    thread (this rank's part only on several ranks), or, for DTensor state saved
    through DCP, ``(None, job)``: a :class:`~asyncsave._dcp_read.TemplateLoad`
    ready for the collective read (its ``state_dict()`` calls on the caller's
    thread). ``required`` is checked here,
    so that a rank that lacks an item fails with every rank."""
    coord = saver.coord
    manifest = await anyio.to_thread.run_sync(read_checkpoint, saver.fs, info.path)
    if manifest.tree.get("type") == "dcp":
        from ._dcp_read import TemplateLoad, read_dcp_metadata

        metadata = await anyio.to_thread.run_sync(read_dcp_metadata, saver.fs, info.path)
        return None, TemplateLoad(info.path, metadata, template, required)
    reader: Any = functools.partial(load, info.path)
    if coord.world_size > 1:  # this rank's part only
        reader = functools.partial(load_rank, info.path, coord.rank, coord.world_size)
    state = await anyio.to_thread.run_sync(
        functools.partial(
            reader,
            device=device,
            allow_pickle=saver.options.allow_pickle,
            filesystem=saver.fs,
        )
    )
    _check_required(state, required, info.path)
    return state, None


async def _read_collective(saver: Saver, job: Any) -> Any:
    """The collective read of a DCP checkpoint into the template's shadow, on
    asyncsave's group (watched: a rank that dies meanwhile is named); the tree."""
    coord = saver.coord
    group = coord.group if coord.world_size > 1 else None
    reader = dcp_reader_class()(str(job.path), filesystem=saver.fs)
    await coord.watched(
        "DCP load",
        functools.partial(
            job.run,
            reader,
            group=group,
            rank=coord.rank,
            allow_pickle=saver.options.allow_pickle,
        ),
        None,
    )
    return job.state()


async def _agree(
    saver: Saver,
    info: CheckpointInfo | None,
    error: CheckpointError | None,
    damaged_here: CorruptCheckpointError | None,
) -> dict[int, str]:
    """Every rank's view of this attempt (the step it resolved, its error, whether
    its part is damaged), gathered: raises on every rank when any rank failed or
    the ranks resolved different steps; else the damaged parts by rank."""

    async def view() -> tuple[int | None, str | None]:
        if error is not None:
            raise error
        return (
            None if info is None else info.step,
            None if damaged_here is None else str(damaged_here),
        )

    views = await saver.coord.map_reduce(
        "resume", None, view, failure=functools.partial(_resume_failure, saver.root), own=True
    )
    steps = sorted({v[0] for v in views}, key=lambda x: -1 if x is None else x)
    if len(steps) > 1:
        raise CheckpointError(
            f"the ranks found different checkpoints to resume from in {saver.root} "
            f"({steps}): every rank must resume from storage all ranks share",
            path=saver.root,
        )
    return {r: v[1] for r, v in enumerate(views) if v[1] is not None}


def _resume_failure(root: Path, failed: dict[int, str]) -> CheckpointError:
    """The error of the ranks that resume from ``root`` when ``failed`` (rank ->
    cause) could not (a rank that failed raises its own)."""
    return CheckpointError(
        f"rank(s) {sorted(failed)} could not resume from {root}: "
        + "; ".join(f"rank {r}: {why}" for r, why in sorted(failed.items())),
        path=root,
        rank=min(failed),
    )


async def _fall_back(
    saver: Saver,
    info: CheckpointInfo,
    damaged: dict[int, str],
    damaged_here: CorruptCheckpointError | None,
    fallback: bool,
) -> tuple[CheckpointInfo, CheckpointError | None]:
    """``info`` is damaged in the parts of ``damaged``: raise (no ``fallback``), or
    move it aside (rank 0) and return the next older committed checkpoint, with
    the error every rank raises at the next gather if moving it failed."""
    coord = saver.coord
    cause: CorruptCheckpointError = damaged_here or CorruptCheckpointError(
        f"step {info.step} in {saver.root} is damaged in the part of rank(s) "
        f"{sorted(damaged)}: " + "; ".join(f"rank {r}: {w}" for r, w in sorted(damaged.items())),
        path=info.path,
        step=info.step,
        rank=min(damaged),
    )
    if not fallback:
        raise _with_fallback_hint(cause, saver.root)
    path, step = info.path, info.step
    logger.warning("cannot load %s (%s); falling back to an older checkpoint", path, cause)
    # Not a checkpoint any more: a later save() of this step must write
    # it again, not find it "committed" (and never over damaged bytes).
    saver.committed.pop(step, None)
    moving: OSError | None = None
    if coord.leader and saver.strategy.can_move_files:
        try:
            await anyio.to_thread.run_sync(
                saver.under_final_lock, _move_damaged_aside, saver, path, step, str(cause)
            )
        except OSError as exc:
            if coord.world_size == 1:
                raise
            moving = exc
    older = await anyio.to_thread.run_sync(
        older_committed, saver.fs, saver.root, saver.layout, step
    )
    if older is None:
        raise CheckpointNotFoundError(
            f"no loadable checkpoint in {saver.root} at or below step {step}",
            path=saver.root,
        ) from cause
    error: CheckpointError | None = None
    if moving is not None:
        # Heard by every rank at the next gather: all raise it.
        error = CheckpointError(f"could not move {path} aside: {moving!r}", path=path)
        error.__cause__ = moving
    return older, error


def _with_fallback_hint(cause: CorruptCheckpointError, root: Any) -> CorruptCheckpointError:
    """``cause`` (same type and attributes) saying how to resume anyway, as the
    error of a tracker naming a missing checkpoint does."""
    hint = (
        f"; pass fallback=True to load_latest() to resume from the newest older "
        f"committed checkpoint in {root} instead (this one is then moved aside)"
    )
    error = type(cause)(
        f"{cause}{hint}", step=cause.step, path=cause.path, rank=cause.rank, key=cause.key
    )
    error.__cause__ = cause
    return error


def _move_damaged_aside(saver: Saver, path: Any, step: int, reason: str) -> None:
    """Move the damaged checkpoint ``path`` aside, durably (raises what fails)."""
    move_aside_durably(saver.fs, saver.root, path, "damaged", step, reason, quiet=False)


# -- resuming with a persistent tier -------------------------------------------
class NearestTiers:
    """The two tiers a resume from the nearest tier chooses between, and what
    happens when a candidate fails or one is chosen: the one seam of
    :func:`resume_nearest`, the single home of that decision.

    Two hosts use it: a checkpointer with a persistent tier (:class:`SaverTiers`:
    a damaged local checkpoint is moved aside, the step resumed from is
    protected), and the memory tier's trainer while its saver process is still
    starting (``asyncsave._memtier``: it only reads, and hands any damage to
    the saver).

    :param local_fs: the local (nearer) tier's file system and ``local_root``
        its root (this rank's own with ``per_rank``).
    :param remote_fs: the persistent tier's file system and ``remote_root`` its root.
    :param per_rank: a local checkpoint is one rank's alone (``local_scope="rank"``).
    """

    def __init__(
        self,
        local_fs: Any,
        local_root: Path,
        remote_fs: Any,
        remote_root: Path,
        layout: Any,
        *,
        per_rank: bool,
        allow_pickle: bool,
    ) -> None:
        self.local_fs, self.local_root = local_fs, local_root
        self.remote_fs, self.remote_root = remote_fs, remote_root
        self.layout = layout
        self.per_rank = per_rank
        self.allow_pickle = allow_pickle

    async def failed(self, where: str, step: int, path: Path, own: str | None) -> None:
        """A candidate did not load on some rank (every rank calls it: ``own``
        is this rank's failure, or ``None``); the next one is tried after it."""

    def resumed(self, where: str, step: int) -> None:
        """``step`` was loaded from the ``where`` tier (``"local"`` or
        ``"persistent"``)."""


class SaverTiers(NearestTiers):
    """A checkpointer's own tiers: a damaged local checkpoint is moved aside
    (by its rank alone when local checkpoints are per rank, else by the one
    rank that may), and the step resumed from is protected."""

    def __init__(self, saver: Saver, persister: Persister) -> None:
        super().__init__(
            saver.fs,
            saver.root,
            persister.fs,
            persister.root,
            saver.layout,
            per_rank=saver.per_rank,
            allow_pickle=saver.options.allow_pickle,
        )
        self.saver = saver

    async def failed(self, where: str, step: int, path: Path, own: str | None) -> None:
        saver = self.saver
        if where == "local" and (saver.coord.world_size == 1 or saver.per_rank) and own:
            await saver.move_aside(step, path, "damaged", own)

    def resumed(self, where: str, step: int) -> None:
        protect_resumed(self.saver, step, local=where == "local")


def protect_resumed(saver: Saver, step: int, *, local: bool) -> None:
    """Record that this run resumed from ``step`` (of the saver's own root when
    ``local``): it is never rewritten, and counts as committed."""
    saver.resumed_step = step
    if local:
        saver.committed.setdefault(step, None)


async def load_nearest(
    saver: Saver,
    persister: Persister,
    template: Any,
    *,
    device: str | torch.device,
    required: Iterable[str | Sequence[Any]],
    strict: bool = True,
) -> tuple[Restored | None, CheckpointWarning | None]:
    """Resume from the nearest valid tier (see the module docstring): the body of
    :meth:`asyncsave.Checkpointer.load_latest` with a persistent tier.

    :returns: the restored state, or ``None`` when neither tier holds a
        committed checkpoint; and the warning of a ``strict=False`` load into
        ``template`` that left something out (for the caller to issue), or ``None``.
    :raises CheckpointNotFoundError: committed checkpoints exist but none loads
        (the last failure is ``__cause__``).
    """
    if saver.state is not Phase.OPEN:
        raise CheckpointerClosedError("load_latest() needs an open Checkpointer", path=saver.root)
    # The collectives below run on the saves' group, in a turn of their own, so
    # that they never interleave with a save's (the copies use another group, and
    # go on meanwhile: resuming never waits for the slow tier).
    coord = saver.coord
    async with coord.turn():
        return await resume_nearest(
            SaverTiers(saver, persister), coord, template, device, required, strict=strict
        )


async def resume_nearest(
    tiers: NearestTiers,
    coord: Coordinator,
    template: Any,
    device: str | torch.device,
    required: Iterable[str | Sequence[Any]],
    *,
    strict: bool,
) -> tuple[Restored | None, CheckpointWarning | None]:
    """The newest step that loads from either tier, the local one first on a
    tie; every rank the same step (see :func:`load_nearest`)."""
    local_ok, remote_ok, anything = await _candidates(tiers, coord)
    failed_to_resume = functools.partial(_resume_failure, tiers.local_root)
    last_error: BaseException | None = None
    while local_ok or remote_ok:
        best_local = max(local_ok, default=-1)
        best_remote = max(remote_ok, default=-1)
        if best_local >= best_remote:
            step, where, fs, root = best_local, "local", tiers.local_fs, tiers.local_root
        else:
            step, where, fs, root = best_remote, "persistent", tiers.remote_fs, tiers.remote_root
        path = root / tiers.layout.dir_name(step)
        reader: Any = functools.partial(load, path)
        # A local part of local_scope="rank" is a checkpoint of one rank: its own.
        if coord.world_size > 1 and not (where == "local" and tiers.per_rank):
            reader = functools.partial(load_rank, path, coord.rank, coord.world_size)
        read: dict[str, Any] = {}  # this rank's state, or its error
        attempt = functools.partial(
            _try_read,
            functools.partial(
                reader, device=device, allow_pickle=tiers.allow_pickle, filesystem=fs
            ),
            read,
        )
        outcomes = await coord.map_reduce(
            "resume-load", step, attempt, failure=failed_to_resume, own=True
        )
        failures = [f for f in outcomes if f]
        state, failure = read.get("state"), outcomes[coord.rank]
        last_error = read.get("error", last_error)
        if not failures:
            _check_required(state, required, path)
            state, note = apply_template(state, template, path, strict=strict)
            tiers.resumed(where, step)
            info = await anyio.to_thread.run_sync(_info, fs, path)
            logger.info("resumed step %d from the %s tier (%s)", step, where, path)
            return Restored(state, info), note
        await tiers.failed(where, step, path, failure)  # the read-only host leaves here
        logger.warning(
            "cannot resume step %d from the %s tier (%s): %s; trying the next candidate",
            step,
            where,
            path,
            "; ".join(failures),
        )
        (local_ok if where == "local" else remote_ok).discard(step)
    if last_error is None and not anything:
        return None, None
    raise CheckpointNotFoundError(
        f"no checkpoint on the local tier {tiers.local_root} or the persistent tier "
        f"{tiers.remote_root} loads",
        path=tiers.local_root,
    ) from last_error


async def _candidates(tiers: NearestTiers, coord: Coordinator) -> tuple[set[int], set[int], bool]:
    """The steps to try: the local ones every rank has committed, the
    persistent ones (rank 0 lists them), and whether any rank found any."""

    async def steps_in(fs: LocalFileSystem, root: Path) -> list[int]:
        found = await anyio.to_thread.run_sync(committed_steps, fs, root, tiers.layout)
        return sorted(found)

    failed_to_resume = functools.partial(_resume_failure, tiers.local_root)
    views = await coord.map_reduce(
        "resume-local",
        None,
        functools.partial(steps_in, tiers.local_fs, tiers.local_root),
        failure=failed_to_resume,
    )
    remote_steps: list[int] = await coord.from_leader(
        "resume-persistent",
        None,
        functools.partial(steps_in, tiers.remote_fs, tiers.remote_root),
        failure=lambda cause: failed_to_resume({0: cause}),
        own=True,
    )
    local = set(views[0]).intersection(*views[1:])
    return local, set(remote_steps), any(views) or bool(remote_steps)


async def _try_read(reader: Any, out: dict[str, Any]) -> str | None:
    """This rank's read of a candidate, in a worker thread: the state in
    ``out["state"]``; a damaged or missing part is an outcome (its ``repr``, the
    exception in ``out["error"]``: every rank tries the next candidate), anything
    else raises."""
    try:
        out["state"] = await anyio.to_thread.run_sync(reader)
    except (CorruptCheckpointError, CheckpointNotFoundError, OSError) as exc:
        out["error"] = exc
        return repr(exc)
    return None


def _info(fs: LocalFileSystem, path: Path) -> CheckpointInfo:
    return info_of(path, read_checkpoint(fs, path))
