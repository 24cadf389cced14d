"""The phases of one save, on this rank: stage → write → gather → commit → track → retain.

:class:`Pipeline` runs one admitted and staged save (a :class:`Save`) through the
phases that ``asyncsave._pipeline`` describes, served by its checkpointer's
:class:`Host` (its root, its coordinator, its worker threads, its commit
strategy, its tracker and retention):

1. :meth:`Pipeline.write`: phase A (the temporary directory, made by the leader
   and agreed by every rank) and phase B (this rank's files, then every rank's
   outcome); in a root of each rank's own (``per_rank``) both in one step;
2. :meth:`Pipeline.finalize`: the job's own finishing steps, if it has any;
3. :meth:`Pipeline.commit`: phase C (manifest, then the commit protocol's rename
   or marker, then the tracker; every rank hears the outcome);
4. :meth:`Pipeline.record`: the committed info, retention, the handle resolved.

A failure at any phase fails the handle and the checkpointer once
(:meth:`Pipeline.failed`); whatever happens, :meth:`Pipeline.clean_up` ends the
save's turn and releases what it holds.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import math
import time
from pathlib import Path
from typing import Any, Protocol

import anyio
import anyio.abc
import torch

from ._atomicity import CommitStrategy
from ._coord import Coordinator, rank_failure
from ._errors import (
    CheckpointError,
    CheckpointTimeoutError,
    RankFailedError,
    SaveFailedError,
)
from ._handle import SaveHandle
from ._jobs import Job, Services
from ._manifest import encode_manifest
from ._paths import MANIFEST_NAME
from ._types import CheckpointInfo, release_nested
from ._write import write_bytes

__all__ = ["Host", "Pipeline", "Save", "as_save_error"]

logger = logging.getLogger(__name__)

# What the leader (or, with ``per_rank``, each rank) tells of its commit: None when
# it committed and tracked; else ("committed" or "failed", repr(error), timed out).
Outcome = tuple[str, str, bool] | None

_NONE_COMMITTED = "; no rank committed it"


class Host(Services, Protocol):
    """What a save's pipeline and its staging use of their checkpointer (the one
    implementation: ``asyncsave._pipeline.Saver``), beyond what a job uses."""

    coord: Coordinator
    strategy: CommitStrategy  # the root's commit protocol
    per_rank: bool  # every rank commits in a root of its own
    accepting: bool  # the task group takes new pipelines
    tg: anyio.abc.TaskGroup | None
    scopes: dict[int, anyio.CancelScope]  # step -> its pipeline's scope
    committed: dict[int, CheckpointInfo | None]
    lazy: dict[int, SaveHandle]  # lazy saves not yet staged

    @property
    def owns_root(self) -> bool: ...

    async def make_tmp(self, step: int) -> Path: ...

    async def discard(self, tmp: Path | None) -> None: ...

    async def track(self, step: int) -> None: ...

    async def retain(self, step: int) -> None: ...

    def under_final_lock(self, func: Any, *args: Any) -> Any: ...

    def set_failure(self, error: SaveFailedError) -> None: ...

    def fail(self, handle: SaveHandle, error: SaveFailedError) -> None: ...

    def abandoned_error(self, step: int, path: Path | None) -> SaveFailedError: ...


@dataclasses.dataclass
class Save:
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


class Pipeline:
    """One save's run through phases A to C and what follows, on this rank.

    Shielded from the caller's cancellation, bounded by ``save_timeout_s``. Once
    the commit thread may rename (``committing``), the temporary directory is
    never removed under it (a thread abandoned at the deadline leaves it to the
    next open).
    """

    def __init__(self, saver: Host, save: Save, staged_s: float) -> None:
        self.saver, self.save, self.coord = saver, save, saver.coord
        self.handle, self.job, self.step = save.handle, save.job, save.handle.step
        self.staged_s = staged_s
        self.blocked_s = staged_s if save.blocked_s is None else save.blocked_s
        self.final = saver.root / saver.layout.dir_name(self.step)
        self.tmp = save.tmp
        self.written_s = float("nan")
        self.committing = False  # the leader's commit thread may be renaming
        self.committed = False  # renamed (or marked): only what follows can fail
        # Every rank's part of the manifest from phase B: emptied at the end (a
        # manifest of 100,000s of tensors), before the job's settle releases what
        # holds the garbage collector.
        self.parts: list[dict[str, Any]] = []

    async def run(self) -> None:
        saver, step = self.saver, self.step
        with anyio.CancelScope(shield=True) as scope:
            saver.scopes[step] = scope
            try:
                with anyio.fail_after(saver.options.save_timeout_s):
                    await self.coord.wait_turn(self.save.ticket)
                    await self.write()
                    await self.finalize()
                    await self.commit()
                await self.record()
            except Exception as exc:
                await self.failed(self.error_of(exc))
            except anyio.get_cancelled_exc_class():
                await self.failed(saver.abandoned_error(step, self.tmp))
                raise
            finally:
                await self.clean_up()

    # -- phases A and B ---------------------------------------------------------------
    async def write(self) -> None:
        """Phases A and B; raise (on every rank) if any rank failed, and then the
        leader removes the temporary directory."""
        local_error = self.job if isinstance(self.job, BaseException) else None
        if self.saver.per_rank:  # every rank in its own root
            await self._write_own(local_error)
        else:
            await self._write_shared(local_error)
        assert isinstance(self.job, Job) and self.tmp is not None

    async def _agree_tmp(self, local_error: BaseException | None) -> str:
        """Phase A: the temporary directory's name, made by the leader (or agreed
        before the turn, for a streamed save and for Megatron's prepare).

        :raises RankFailedError: the leader failed (several ranks), naming it.
        """
        if self.tmp is not None:
            return self.tmp.name
        step = self.step

        async def make() -> str:
            if local_error is not None:
                raise local_error
            self.tmp = await self.saver.make_tmp(step)
            return self.tmp.name

        def failure(cause: str) -> Exception:
            return rank_failure({0: cause}, doing="save of", step=step, note=_NONE_COMMITTED)

        name: str = await self.coord.from_leader("temp-dir", step, make, failure=failure)
        return name

    async def _write_shared(self, local_error: BaseException | None) -> None:
        """Phases A and B in the root every rank shares."""
        coord, step = self.coord, self.step
        name = await self._agree_tmp(local_error)
        self.tmp = tmp = self.saver.root / name

        async def write() -> dict[str, Any] | None:
            # B: this rank's files, then everyone's outcome.
            try:
                if local_error is not None:
                    raise local_error
                if not self.saver.strategy.same_save(name, step, self.final):
                    raise CheckpointError(
                        f"rank {coord.rank} saved step {step} while rank 0 saved "
                        f"another step ({name}): every rank must call save() with "
                        "the same steps in the same order",
                        step=step,
                        rank=coord.rank,
                    )
                assert isinstance(self.job, Job)
                part = await self.job.write(self.saver, coord, tmp)
                self.handle._progress.all_written(self.job.nbytes)
                return part
            finally:
                self.written_s = time.perf_counter() - self.save.t0

        self.parts = await coord.map_reduce(
            "files-durable", step, write, doing="save of", note=_NONE_COMMITTED, path=tmp
        )

    async def _write_own(self, local_error: BaseException | None) -> None:
        """Phases A and B in a root of this rank's own (``per_rank``): its own
        temporary directory and files, then every rank's outcome (with its step,
        so that ranks saving different steps all fail). A failed rank's temporary
        directory is removed after it."""
        saver, step, job = self.saver, self.step, self.job

        async def write() -> tuple[dict[str, Any] | None, int]:
            try:
                if local_error is not None:
                    raise local_error
                if not (isinstance(job, Job) and job.per_rank_root):
                    raise CheckpointError(
                        f"step {step}: Tier(local_scope='rank') saves plain state trees "
                        f"only; a {type(job).__name__} (DTensor state, a Megatron "
                        "request) needs a local root every rank shares "
                        "(local_scope='shared')",
                        step=step,
                        rank=self.coord.rank,
                    )
                if self.tmp is None:
                    self.tmp = await saver.make_tmp(step)
                part = await job.write(saver, self.coord, self.tmp)
                self.handle._progress.all_written(job.nbytes)
                return part, step
            except Exception:
                failed_here[0] = True
                raise
            finally:
                self.written_s = time.perf_counter() - self.save.t0

        failed_here = [False]
        try:
            views = await self.coord.map_reduce(
                "files-durable", step, write, doing="save of", note=_NONE_COMMITTED, path=self.tmp
            )
        except Exception:
            # After the collective, not before: the others hear this rank's
            # error first, not a deadline passed while it deleted its files.
            if failed_here[0]:
                await saver.discard(self.tmp)
                self.tmp = None
            raise
        other = {
            r: f"saved step {s}, not {step}: every rank must call save() with the same "
            "steps in the same order"
            for r, (_, s) in enumerate(views)
            if s != step
        }
        if other:
            raise rank_failure(other, doing="save of", step=step, note=_NONE_COMMITTED)
        self.parts = [part for part, _ in views]

    async def finalize(self) -> None:
        """The integration's own finishing steps, after every rank's files are
        durable and before the commit and the tracker (a job without any skips)."""
        job = self.job
        assert isinstance(job, Job) and self.tmp is not None
        if type(job).finalize is Job.finalize:
            return
        tmp = self.tmp
        await self.coord.map_reduce(
            "finalized",
            self.step,
            functools.partial(job.finalize, self.saver, self.coord, tmp, self.parts),
            doing="finalizing",
            note=_NONE_COMMITTED,
            path=tmp,
        )

    # -- phase C ----------------------------------------------------------------------
    async def commit(self) -> None:
        """Phase C: the leader (every rank, ``per_rank``) commits and moves the
        tracker; everyone hears the outcome, and raises unless it committed."""
        outcome: Outcome = None
        commit_error: Exception | None = None
        if self.saver.owns_root:
            outcome, commit_error = await self._publish()
        if self.saver.per_rank:
            await self._agree_committed(outcome, commit_error)
            # Only a step every rank committed is tracked: a part some
            # ranks lack is moved aside at the next open.
            await self.saver.track(self.step)
        elif self.coord.world_size > 1:
            outcome = await self._hear_commit(outcome)
        self._raise_outcome(outcome, commit_error)
        self.committed, self.tmp = True, None

    async def _publish(self) -> tuple[Outcome, Exception | None]:
        """Manifest, then the commit strategy's rename or marker, then (one root)
        the tracker; returns what failed, if anything."""
        saver = self.saver
        assert isinstance(self.job, Job) and self.tmp is not None
        try:
            await self._write_manifest(self.job, self.tmp)
            # From here on a thread abandoned at the deadline may still
            # rename: the temp dir is left to the next open, never
            # removed under its feet.
            self.committing = True
            await saver.run(
                saver.under_final_lock,
                functools.partial(saver.strategy.commit, overwrite=self.save.overwrite),
                saver.fs,
                self.tmp,
                self.final,
            )
            self.committing, self.committed, self.tmp = False, True, None
            if not saver.per_rank:  # per_rank: once every rank committed
                await saver.track(self.step)
        except Exception as exc:
            self.committing = False  # the thread finished: nothing runs on
            failed = "committed" if self.committed else "failed"
            return (failed, repr(exc), isinstance(exc, TimeoutError)), exc
        return None, None

    async def _write_manifest(self, job: Job, tmp: Path) -> None:
        """The merged manifest (with the save's costs and training info), and the
        layout's info file if it has one."""
        saver, step, info = self.saver, self.step, self.save.training_info
        costs = {"blocked_s": self.blocked_s, "staged_s": self.staged_s}
        costs["written_s"] = self.written_s
        parts, self.parts = self.parts, []  # last read: freed by the worker below
        own = [parts[self.coord.rank]] if saver.per_rank else parts
        doc = await saver.run(job.manifest, tmp, step, own)
        del own
        doc["costs"] = {k: v for k, v in costs.items() if math.isfinite(v)}
        doc["training_info"] = info
        if saver.layout.info_name is not None:
            info_doc = {**info, "step": step}
            await saver.run(
                write_bytes,
                saver.fs,
                tmp / saver.layout.info_name,
                json.dumps(info_doc, indent=1).encode(),
            )
        # Encoding is CPU work (about 60 ms for 10,000 tensors): in
        # the worker thread with the write, never on the event loop.
        rows, tree = (parts if job.owns_manifest_rows else []), job.owns_manifest_tree
        await saver.run(_write_manifest, saver.fs, tmp / MANIFEST_NAME, doc, rows, tree)

    async def _hear_commit(self, outcome: Outcome) -> Outcome:
        """Every rank hears the leader's outcome."""

        async def told() -> Outcome:
            return outcome

        try:
            result: Outcome = await self.coord.from_leader("commit", self.step, told)
        except RankFailedError:
            if not self.coord.leader and await self._committed_on_disk():
                self.committed = True
            raise
        return result

    def _raise_outcome(self, outcome: Outcome, commit_error: Exception | None) -> None:
        step = self.step
        if commit_error is not None and (self.coord.world_size == 1 or self.committed):
            raise commit_error
        if outcome is None:
            return
        if outcome[0] == "committed":
            self.committed = True
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

    async def _agree_committed(self, outcome: Outcome, error: Exception | None) -> None:
        """Every rank committed its own part (``per_rank``), or raise naming those
        that did not (a part committed on some ranks only is never resumed: resume
        takes a local step only when every rank has it)."""

        async def committed() -> None:
            if error is not None:
                raise error
            assert outcome is None

        await self.coord.map_reduce("commit", self.step, committed, doing="the local commit of")

    async def _committed_on_disk(self) -> bool:
        """A rank that lost the leader after phase B: did the rename happen?
        (A shared POSIX root shows it; an overwrite cannot be told apart.)"""
        if self.save.overwrite:
            return False
        saver = self.saver
        try:
            with anyio.move_on_after(5):
                return bool(
                    await anyio.to_thread.run_sync(
                        saver.strategy.committed, saver.fs, self.final, abandon_on_cancel=True
                    )
                )
        except OSError:
            return False
        return False

    # -- after the commit -------------------------------------------------------------
    async def record(self) -> None:
        """Committed: the info is recorded, retention runs (on the leader, outside
        the save's deadline), the handle resolves and the save is logged."""
        saver, step, job, coord = self.saver, self.step, self.job, self.coord
        assert isinstance(job, Job)
        info = CheckpointInfo(
            step=step,
            path=self.final,
            nbytes=job.nbytes,
            num_tensors=job.num_tensors,
            world_size=coord.world_size,
            blocked_s=self.blocked_s,
            staged_s=self.staged_s,
            written_s=self.written_s,
            committed_s=time.perf_counter() - self.save.t0,
            training_info=self.save.training_info,
        )
        saver.committed[step] = info
        try:
            if saver.owns_root:
                # Outside the save's deadline: the save is committed and
                # tracked, a slow delete must not fail it (retention has
                # its own bound).
                await saver.retain(step)
        finally:
            self.handle._commit(info)  # committed, whatever became of retention
        logger.info(
            "rank %d: saved step %d to %s (%d ranks): %d bytes, blocked %.3f s, "
            "written %.3f s, committed %.3f s",
            coord.rank,
            step,
            self.final,
            coord.world_size,
            info.nbytes,
            self.blocked_s,
            self.written_s,
            info.committed_s,
        )

    def error_of(self, exc: Exception) -> SaveFailedError:
        """The save's error for ``exc``; once committed, it says so."""
        step, final = self.step, self.final
        error = as_save_error(exc, step, self.tmp, self.saver.options.save_timeout_s)
        if self.committed and not isinstance(exc, RankFailedError):
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
        elif self.committed and not self.saver.per_rank:
            error = SaveFailedError(
                f"step {step} was committed (its directory is final and complete) "
                f"but rank 0 did not report the tracker: {exc}",
                step=step,
                path=final,
                rank=0,
            )
            error.__cause__ = exc
        return error

    async def failed(self, error: SaveFailedError) -> None:
        """Fail the handle and the checkpointer; the temporary directory goes
        unless a commit thread may still rename it."""
        self.saver.fail(self.handle, error)
        if self.saver.owns_root and not self.committing and not self.committed:
            await self.saver.discard(self.tmp)

    async def clean_up(self) -> None:
        saver, save, job, step = self.saver, self.save, self.job, self.step
        self.coord.end_turn(save.ticket)
        self.parts = []
        if isinstance(job, Job):
            # Writes started while staging, when write() never ran (a
            # rank failed before): they read the arena and write into
            # save.private, both released below.
            await job.settle()
            job.release()
        if save.private is not None:  # moved into tmp, or failed: gone either way
            await saver.discard(save.private)
        if saver.pending.get(step) is self.handle:
            del saver.pending[step]
        saver.scopes.pop(step, None)


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


def _write_manifest(
    fs: Any, path: Path, manifest: dict[str, Any], parts: list[dict[str, Any]], own_tree: bool
) -> None:
    write_bytes(fs, path, encode_manifest(manifest))
    # Emptied here, in the worker (the pipeline does not read them again): their
    # 100,000s of dicts are freed off the event loop. ``parts`` is given only
    # where the job owns its manifest's rows (Job.owns_manifest_rows): its
    # entries and tree are then freed a slice at a time (the tensors' records
    # are the plan template's, and are only let go).
    owned: list[Any] = []
    if parts:
        owned = [manifest.get("entries")]
        if own_tree:  # not a tree sharing the planner's template (Job.owns_manifest_tree)
            owned.append(manifest.get("tree"))
        owned += [part.get("entries") for part in parts]
    manifest.clear()
    parts.clear()
    for rows in owned:
        release_nested(rows)
