"""Several ranks, one checkpoint: asyncsave's own gloo group and the collective commit.

When ``torch.distributed`` is initialised with a world size above 1 (or
``distributed=True``), :class:`~asyncsave.Checkpointer` creates, in ``__aenter__``,
a gloo group of its own (``dist.new_group(backend="gloo",
timeout=dist_timeout_s)``; every rank enters the checkpointer in the same order, as
``new_group`` needs). Every collective of asyncsave runs on that group, from a
worker thread (never on the event loop thread), never on the caller's process
group, so it cannot interleave with, or deadlock against, the caller's own
barriers and all-reduces.

Opening: rank 0 alone takes the root's saver lock and runs recovery; then it
broadcasts the committed steps (or its error) and the other ranks, which waited in
that broadcast, go on (or raise naming rank 0).

One save, on every rank, in the order of the ``save()`` calls (each rank must call
``save()`` for the same steps in the same order; the collectives of consecutive
saves are serialised by a ticket taken when the save is dispatched):

A. rank 0 creates the temporary directory; its name (or rank 0's error) is
   broadcast.
B. every rank writes and fsyncs its own files (``data-r<rank>-<i>.safetensors``)
   into it (or, for DTensor state, runs DCP's planner and writer on asyncsave's
   group into it); then an ``all_gather`` of every rank's outcome: its part of the
   manifest, or its error. If any rank failed, no rank commits: every rank raises
   :class:`RankFailedError` naming each failing rank and its cause, and rank 0
   removes the temporary directory.
C. rank 0 writes the merged ``manifest.json`` (every rank's files, entries and
   tree), fsyncs, renames to the final name, fsyncs the root and moves the
   tracker; then it broadcasts the outcome. Every rank's ``await handle``
   resolves only after this broadcast, i.e. after the commit and the tracker.

A rank that dies (SIGKILL) breaks the collective the others are in: gloo reports
the closed connection at once, or the op times out after ``dist_timeout_s``; the
others raise :class:`RankFailedError` and nothing is committed (the temporary
directory is removed at the next open). After any failure a checkpointer refuses
further saves, like a single-rank one.

The merged manifest's tree is a dict keyed by rank (``asyncsave.load`` of a
2-rank checkpoint returns ``{0: <rank 0's tree>, 1: <rank 1's tree>}``) and its
``ranks`` field records each rank's range of entries and tensors, so that
``Checkpointer.load_latest`` on rank ``r`` reads only rank ``r``'s bytes.
Per-rank state cannot be resharded; DTensor state saved through DCP can.
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import json
import logging
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyio
import anyio.to_thread
import torch
import torch.distributed as dist

from ._commit import commit_dir, make_temp_dir
from ._errors import (
    CheckpointError,
    CorruptCheckpointError,
    RankFailedError,
    SaveFailedError,
    UnsupportedFormatError,
)
from ._fs import LocalFileSystem
from ._load import _build_tensors, _Decoder, _read_entries, _step_of_name, read_checkpoint
from ._manifest import encode_manifest
from ._paths import MANIFEST_NAME, temp_dir_name
from ._plan import is_stateful
from ._types import CheckpointInfo
from ._write import write_bytes

if TYPE_CHECKING:
    from ._engine import Checkpointer, SaveHandle
    from ._format import FileLayout
    from ._plan import Plan
    from ._stage import Lease

__all__ = [
    "DistContext",
    "ForeignJob",
    "contains_dtensor",
    "load_rank",
    "merge_parts",
    "wants_distributed",
]

logger = logging.getLogger(__name__)


def wants_distributed(flag: bool | None) -> bool:
    """Whether a checkpointer with ``distributed=flag`` coordinates ranks."""
    initialised = dist.is_available() and dist.is_initialized()
    if flag is None:
        return initialised and dist.get_world_size() > 1
    if flag and not initialised:
        raise CheckpointError("distributed=True needs torch.distributed.init_process_group() first")
    return flag


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


class DistContext:
    """asyncsave's gloo group on this rank, and the ordering of save collectives.

    :param group: the gloo group (all ranks of the default group).
    :param timeout_s: ``dist_timeout_s``: the bound of each collective.
    """

    def __init__(self, group: Any, timeout_s: float) -> None:
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.timeout_s = timeout_s
        self._tickets = 0
        self._serving = 0
        self._turn_changed = anyio.Event()

    @classmethod
    async def create(cls, timeout_s: float) -> DistContext:
        """Create the gloo group (every rank, same order), from a worker thread."""
        group = await anyio.to_thread.run_sync(
            functools.partial(
                dist.new_group,
                backend="gloo",
                timeout=datetime.timedelta(seconds=timeout_s),
                group_desc="asyncsave",
            ),
            abandon_on_cancel=True,
        )
        return cls(group, timeout_s)

    # -- collectives (worker threads) ------------------------------------------
    def _broadcast(self, obj: Any) -> Any:
        box = [obj]
        dist.broadcast_object_list(box, group=self.group, group_src=0)
        return box[0]

    def _all_gather(self, obj: Any) -> list[Any]:
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self.group)
        return out

    async def _collective(
        self, what: str, func: Callable[[Any], Any], obj: Any, step: int | None
    ) -> Any:
        try:
            return await anyio.to_thread.run_sync(func, obj, abandon_on_cancel=True)
        except Exception as exc:  # gloo: connection closed by a dead peer, timeout
            at = f" of step {step}" if step is not None else ""
            raise RankFailedError(
                f"rank {self.rank}: the {what} collective{at} on asyncsave's gloo group "
                f"failed: another rank died or did not reach it within "
                f"dist_timeout_s={self.timeout_s} ({exc})",
                step=step,
                rank=None,
            ) from exc

    async def broadcast(self, what: str, obj: Any, step: int | None = None) -> Any:
        """Rank 0's ``obj`` on every rank."""
        return await self._collective(what, self._broadcast, obj, step)

    async def all_gather(self, what: str, obj: Any, step: int | None = None) -> list[Any]:
        """Every rank's ``obj``, by rank."""
        result: list[Any] = await self._collective(what, self._all_gather, obj, step)
        return result

    # -- opening ------------------------------------------------------------------
    async def open_root(
        self, open_fn: Callable[[], Awaitable[tuple[list[int], int | None]]], root: Path
    ) -> tuple[list[int], int | None]:
        """Rank 0 runs ``open_fn`` (lock + recovery); every rank gets its result
        (committed steps, tracked step) or raises naming rank 0."""
        result: tuple[list[int], int | None] | None = None
        error: BaseException | None = None
        if self.rank == 0:
            try:
                result = await open_fn()
            except Exception as exc:
                error = exc
        payload = await self.broadcast("open", result if error is None else f"error: {error!r}")
        if error is not None:
            raise error
        if isinstance(payload, str):
            raise CheckpointError(
                f"rank 0 could not open the checkpoint root {root}: {payload}", path=root, rank=0
            )
        committed, tracked = payload
        return list(committed), tracked

    # -- ordering of saves ----------------------------------------------------------
    def take_ticket(self) -> int:
        """The next save's place in the collective order (taken at dispatch)."""
        ticket = self._tickets
        self._tickets += 1
        return ticket

    async def wait_turn(self, ticket: int) -> None:
        while self._serving != ticket:
            await self._turn_changed.wait()

    def end_turn(self, ticket: int) -> None:
        if self._serving == ticket:
            self._serving = ticket + 1
            event, self._turn_changed = self._turn_changed, anyio.Event()
            event.set()


# -- one save -------------------------------------------------------------------
@dataclasses.dataclass
class PlainJob:
    """A per-rank state tree, staged into the rank's lease."""

    plan: Plan
    layouts: list[FileLayout]
    lease: Lease


class ForeignJob:
    """A save whose files another library writes (Megatron's async request): the
    hooks the collective pipeline calls, in order, on every rank."""

    nbytes: int = 0

    async def write(self, ckpt: Checkpointer, ctx: DistContext, tmp: Path) -> dict[str, Any]:
        """Phase B: this rank's files, durable; returns this rank's part."""
        raise NotImplementedError

    async def finalize(
        self, ckpt: Checkpointer, ctx: DistContext, tmp: Path, parts: list[dict[str, Any]]
    ) -> None:
        """After every rank's files are durable, before the commit (every rank)."""

    def manifest(self, tmp: Path, step: int, parts: list[dict[str, Any]]) -> dict[str, Any]:
        """Rank 0: asyncsave's manifest of the finished directory (blocking)."""
        raise NotImplementedError

    def release(self) -> None:
        """Give back staging memory; idempotent."""


@dataclasses.dataclass
class DcpJob:
    """DTensor state whose tensors (each DTensor's local shard) are staged in the
    rank's pool; ``staged`` is the same tree over the staged copies."""

    staged: Any
    nbytes: int
    lease: Lease | None = None


def _walk(x: Any, fn: Callable[[Any], Any], depth: int = 0) -> Any:
    """``x`` rebuilt with ``fn`` applied to every leaf, dicts/lists/tuples kept."""
    if depth > 1000:
        raise CheckpointError("state nested over 1000 levels deep")
    if isinstance(x, dict):
        return type(x)((k, _walk(v, fn, depth + 1)) for k, v in x.items())
    if isinstance(x, (list, tuple)) and not hasattr(x, "_fields"):
        return type(x)(_walk(v, fn, depth + 1) for v in x)
    return fn(x)


async def stage_dtensor_state(ckpt: Checkpointer, state: Any) -> DcpJob:
    """Snapshot DTensor state into this rank's staging pool: every DTensor's local
    shard and every plain tensor copied (CUDA: pinned buffer, side stream, polled
    events); other leaves deep-copied. Returns once the snapshot is consistent.

    A non-contiguous CUDA shard is made contiguous on its device first (FSDP2's
    shards are contiguous).
    """
    import copy

    from torch.distributed.checkpoint.state_dict_saver import _stateful_to_state_dict
    from torch.distributed.tensor import DTensor

    from ._plan import Entry
    from ._stage import _destination, lease_and_stage

    assert ckpt._pool is not None
    tree = _stateful_to_state_dict(state) if isinstance(state, dict) else state
    entries: list[Entry] = []
    offset = 0

    def collect(x: Any) -> Any:
        nonlocal offset
        if isinstance(x, torch.Tensor):
            local = (x.to_local() if isinstance(x, DTensor) else x).detach()
            if not local.is_contiguous():
                local = local.contiguous()
            nbytes = local.numel() * local.element_size()
            e = Entry(
                str(len(entries)),
                local,
                nbytes,
                local.element_size(),
                False,
                local.dtype,
                tuple(local.shape),
            )
            e.staging_offset = offset
            offset += -(-nbytes // 64) * 64
            entries.append(e)
        return x

    _walk(tree, collect)
    lease = await lease_and_stage(
        ckpt._pool,
        offset,
        entries,
        poll_interval_s=ckpt.options.poll_interval_s,
        timeout_s=ckpt.options.save_timeout_s,
    )
    try:
        views = iter([_destination(lease.buffer, e) for e in entries])

        def rebuild(x: Any) -> Any:
            if isinstance(x, DTensor):
                return DTensor(next(views), x._spec, requires_grad=False)
            if isinstance(x, torch.Tensor):
                return next(views)
            return copy.deepcopy(x)

        staged = _walk(tree, rebuild)
    except BaseException:
        lease.release()
        raise
    for e in entries:
        e.source = None
    return DcpJob(staged, sum(e.nbytes for e in entries), lease)


async def run_save(
    ckpt: Checkpointer,
    ctx: DistContext,
    ticket: int,
    handle: SaveHandle,
    job: PlainJob | DcpJob | ForeignJob | BaseException,
    times: tuple[float, float],
    overwrite: bool,
    training_info: dict[str, Any],
    tmp_name: str | None = None,
) -> None:
    """The pipeline of one save of several ranks (see the module docstring).

    ``job`` is an exception when this rank's ``save()`` failed before its snapshot
    was taken: the rank still takes part in the collectives, so the others raise
    naming it instead of waiting for it. ``tmp_name``: the temporary directory was
    agreed already (phase A done by the caller, see ``asyncsave.megatron``).
    """
    step = handle.step
    t0, staged_s = times
    fs = ckpt._fs
    tmp: Path | None = None
    written_s = float("nan")
    with anyio.CancelScope(shield=True) as scope:
        ckpt._scopes[step] = scope
        try:
            with anyio.fail_after(ckpt.options.save_timeout_s):
                await ctx.wait_turn(ticket)
                # A: the shared temporary directory.
                name: str | None = tmp_name
                if tmp_name is not None:
                    tmp = ckpt.root / tmp_name
                elif ctx.rank == 0 and not isinstance(job, BaseException):
                    try:
                        name = (await ckpt._run(make_temp_dir, fs, ckpt.root, step)).name
                    except Exception as exc:
                        name = f"error: {exc!r}"
                elif ctx.rank == 0:
                    name = f"error: {job!r}"
                if tmp_name is None:
                    name = await ctx.broadcast("temp-dir", name, step)
                assert isinstance(name, str)
                local_error: BaseException | None = None
                part: dict[str, Any] | None = None
                if name.startswith("error: "):
                    local_error = job if isinstance(job, BaseException) else None
                    outcomes: list[Any] = [name.removeprefix("error: ")]
                    outcomes += [None] * (ctx.world_size - 1)
                else:
                    tmp = ckpt.root / name
                    # B: this rank's files, then everyone's outcome.
                    if isinstance(job, BaseException):
                        local_error = job
                    elif not name.startswith(temp_dir_name(step)[:-12]):
                        local_error = CheckpointError(
                            f"rank {ctx.rank} saved step {step} while rank 0 saved another "
                            f"step ({name}): every rank must call save() with the same "
                            "steps in the same order",
                            step=step,
                            rank=ctx.rank,
                        )
                    else:
                        try:
                            part = await _write_rank(ckpt, ctx, tmp, job, step)
                        except Exception as exc:
                            local_error = exc
                    written_s = time.perf_counter() - t0
                    outcomes = await ctx.all_gather(
                        "files-durable",
                        repr(local_error) if local_error is not None else ("ok", part),
                        step,
                    )
                error = _rank_failure("save of", step, outcomes, tmp)
                if error is not None:
                    if local_error is not None:
                        error.__cause__ = local_error
                    raise error
                if isinstance(job, ForeignJob):
                    # The other library's finalize steps, after every rank's files
                    # are durable and before the commit and the tracker.
                    assert tmp is not None
                    finalize_error: BaseException | None = None
                    try:
                        await job.finalize(ckpt, ctx, tmp, [o[1] for o in outcomes])
                    except Exception as exc:
                        finalize_error = exc
                    finalized = await ctx.all_gather(
                        "finalized", None if finalize_error is None else repr(finalize_error), step
                    )
                    error = _rank_failure("finalizing", step, finalized, tmp)
                    if error is not None:
                        error.__cause__ = finalize_error
                        raise error
                # C: rank 0 commits and moves the tracker; everyone hears the outcome.
                final = ckpt.root / ckpt.layout.dir_name(step)
                outcome: str | None = None
                commit_error: BaseException | None = None
                if ctx.rank == 0:
                    assert tmp is not None
                    try:
                        parts: list[dict[str, Any]] = [o[1] for o in outcomes if o is not None]
                        doc = await ckpt._run(
                            functools.partial(
                                _manifest, ckpt, job, parts, step, staged_s, written_s, tmp
                            )
                        )
                        doc["training_info"] = training_info
                        if ckpt.layout.info_name is not None:
                            info_json = json.dumps({**training_info, "step": step}, indent=1)
                            await ckpt._run(
                                write_bytes, fs, tmp / ckpt.layout.info_name, info_json.encode()
                            )
                        await ckpt._run(write_bytes, fs, tmp / MANIFEST_NAME, encode_manifest(doc))
                        await ckpt._run(
                            ckpt._under_final_lock,
                            functools.partial(commit_dir, overwrite=overwrite),
                            fs,
                            tmp,
                            final,
                        )
                        tmp = None
                        await ckpt._track(step)
                    except Exception as exc:
                        commit_error = exc
                        outcome = repr(exc)
                outcome = await ctx.broadcast("commit", outcome, step)
                if commit_error is not None:
                    raise commit_error
                if outcome is not None:
                    raise RankFailedError(
                        f"rank 0 could not commit step {step}: {outcome}",
                        step=step,
                        rank=0,
                        ranks={0: outcome},
                    )
                tmp = None
            info = CheckpointInfo(
                step=step,
                path=final,
                nbytes=job.plan.nbytes if isinstance(job, PlainJob) else getattr(job, "nbytes", 0),
                num_tensors=len(job.plan.leaves) if isinstance(job, PlainJob) else 0,
                world_size=ctx.world_size,
                blocked_s=staged_s,
                staged_s=staged_s,
                written_s=written_s,
                committed_s=time.perf_counter() - t0,
                training_info=training_info,
            )
            ckpt._committed[step] = info
            try:
                if ctx.rank == 0:
                    # Outside the save's deadline, as for one rank: the save is
                    # committed and tracked; a slow delete must not fail it.
                    await ckpt._retain(step)
            finally:
                handle._commit(info)
            logger.info(
                "rank %d: step %d committed to %s by %d ranks in %.3f s",
                ctx.rank,
                step,
                final,
                ctx.world_size,
                info.committed_s,
            )
        except Exception as exc:
            err = _as_error(exc, step, ckpt.options.save_timeout_s)
            ckpt._fail(handle, err)
            if ctx.rank == 0 and tmp is not None:
                await ckpt._discard(tmp)
        except anyio.get_cancelled_exc_class():
            from ._errors import CheckpointTimeoutError

            ckpt._fail(
                handle,
                CheckpointTimeoutError(
                    f"save of step {step} was abandoned when close_timeout_s ran out",
                    step=step,
                    path=tmp,
                ),
            )
            raise
        finally:
            ctx.end_turn(ticket)
            if isinstance(job, PlainJob):
                job.lease.release()
            elif isinstance(job, ForeignJob):
                job.release()
            elif isinstance(job, DcpJob) and job.lease is not None:
                job.lease.release()
            if ckpt._pending.get(step) is handle:
                del ckpt._pending[step]
            ckpt._scopes.pop(step, None)


def _as_error(exc: Exception, step: int, timeout_s: float) -> SaveFailedError:
    if isinstance(exc, SaveFailedError):
        return exc
    from ._engine import _as_save_error

    return _as_save_error(exc, step, None, timeout_s)


async def _write_rank(
    ckpt: Checkpointer,
    ctx: DistContext,
    tmp: Path,
    job: PlainJob | DcpJob | ForeignJob,
    step: int,
) -> dict[str, Any] | None:
    """Phase B on this rank: its files, durable. Returns its part of the manifest
    (plain state), or ``None`` (DCP: rank 0's writer holds the manifest)."""
    if isinstance(job, ForeignJob):
        return await job.write(ckpt, ctx, tmp)
    if isinstance(job, PlainJob):
        await ckpt._write_files(tmp, job.plan, job.layouts, job.lease)
        job.lease.release()
        from ._engine import _manifest_doc

        doc = _manifest_doc(step, job.plan, job.layouts, 0.0, 0.0, 0.0)
        return {k: doc[k] for k in ("files", "entries", "tensors", "tree")}
    import torch.distributed.checkpoint as dcp

    from .dcp import StorageWriter

    writer = StorageWriter(
        str(ckpt.root),
        step,
        layout=ckpt.options.layout,
        filesystem=ckpt._fs,
        _tmp=tmp.name,
        _commit=False,
    )
    # DCP's own collectives (plans, write results) run here, on asyncsave's group,
    # inside this save's turn; a rank's write error comes back from DCP on every rank.
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        await anyio.to_thread.run_sync(
            functools.partial(dcp.save, job.staged, storage_writer=writer, process_group=ctx.group),
            abandon_on_cancel=True,
        )
    except CheckpointException as exc:
        # DCP's error derives from BaseException: translated here, at the boundary.
        causes = {
            r: repr(f[0]) if isinstance(f, tuple) else repr(f) for r, f in exc.failures.items()
        }
        raise SaveFailedError(
            f"DCP's save of step {step} failed on rank(s) {sorted(causes)}: "
            + "; ".join(f"rank {r}: {c}" for r, c in sorted(causes.items())),
            step=step,
            path=tmp,
        ) from exc
    if job.lease is not None:
        job.lease.release()  # written and fsynced: the pool is free for the next save
    if ctx.rank == 0:
        assert writer.manifest_doc is not None
        return {"dcp": writer.manifest_doc}
    return {"dcp": None}


def _manifest(
    ckpt: Checkpointer,
    job: Any,
    parts: list[dict[str, Any]],
    step: int,
    staged_s: float,
    written_s: float,
    tmp: Path,
) -> dict[str, Any]:
    from ._engine import _manifest_doc

    costs = {"blocked_s": staged_s, "staged_s": staged_s, "written_s": written_s}
    if isinstance(job, ForeignJob):
        doc = job.manifest(tmp, step, parts)
        doc["costs"] = costs
        return doc
    if isinstance(job, DcpJob):
        doc = dict(parts[0]["dcp"])
        doc["costs"] = costs
        return doc
    assert isinstance(job, PlainJob)
    doc = _manifest_doc(step, job.plan, job.layouts, staged_s, staged_s, written_s)
    doc.update(merge_parts(parts))
    return doc


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
        tensors.extend(dict(t, entry=t["entry"] + e0) for t in part["tensors"])
        items.append([["i", r], _shift(part["tree"], t0)])
        ranks.append(
            {
                "entries": [e0, len(entries)],
                "tensors": [t0, len(tensors)],
                "tree": part["tree"],
            }
        )
    return {
        "world_size": len(parts),
        "files": files,
        "entries": entries,
        "tensors": tensors,
        "tree": {"type": "dict", "items": items},
        "ranks": ranks,
    }


def load_rank(
    path: Path,
    rank: int,
    world_size: int,
    *,
    device: torch.device | str = "cpu",
    allow_pickle: bool = False,
    filesystem: LocalFileSystem | None = None,
) -> Any:
    """Read rank ``rank``'s tree of a checkpoint saved by ``world_size`` ranks,
    reading only that rank's bytes. A checkpoint of one rank loads whole on every
    rank (replicated state).

    :raises CheckpointError: saved by another number of ranks (per-rank state does
        not reshard: save DTensor state for that, or ``asyncsave.load`` the whole
        dict by rank).
    :raises UnsupportedFormatError: a DCP checkpoint: load it with ``dcp.load`` and
        :class:`asyncsave.dcp.StorageReader`.
    """
    from ._load import _device, load

    fs = filesystem or LocalFileSystem()
    manifest = read_checkpoint(fs, path, expect_step=_step_of_name(path))
    if manifest.tree.get("type") == "dcp":
        raise UnsupportedFormatError(
            f"{path} was saved through torch.distributed.checkpoint (DTensor state): "
            "load it with dcp.load(state, storage_reader=asyncsave.dcp.StorageReader(path))",
            path=path,
        )
    if manifest.world_size == 1:
        return load(path, device=device, allow_pickle=allow_pickle, filesystem=fs)
    if manifest.world_size != world_size:
        raise CheckpointError(
            f"{path} was saved by {manifest.world_size} ranks; this run has {world_size}. "
            "Per-rank state does not reshard: save DTensor (FSDP2) state for that, or "
            "read the whole checkpoint with asyncsave.load(path) (a dict keyed by rank)",
            path=path,
        )
    doc = json.loads(fs.read_bytes(path / MANIFEST_NAME))
    try:
        rec = doc["ranks"][rank]
        e0, e1 = rec["entries"]
        t0, t1 = rec["tensors"]
        tree = rec["tree"]
        assert all(type(x) is int for x in (e0, e1, t0, t1)) and isinstance(tree, dict)
        assert 0 <= e0 <= e1 <= len(manifest.entries) and 0 <= t0 <= t1 <= len(manifest.tensors)
    except (KeyError, IndexError, TypeError, ValueError, AssertionError) as exc:
        raise CorruptCheckpointError(
            f"damaged manifest {path / MANIFEST_NAME}: no valid ranks[{rank}]", path=path
        ) from exc
    tensors = [dict(t, entry=t["entry"] - e0) for t in manifest.tensors[t0:t1]]
    if not all(0 <= t["entry"] < e1 - e0 for t in tensors):
        raise CorruptCheckpointError(f"damaged manifest {path}: rank {rank}'s tensors", path=path)
    sub = dataclasses.replace(manifest, entries=manifest.entries[e0:e1], tensors=tensors, tree=tree)
    raw = _read_entries(fs, path, sub, verify=True)
    built = _build_tensors(sub, raw, _device(device))
    return _Decoder(built, sub.tensors, path=path, allow_pickle=allow_pickle).node(tree)


def _rank_failure(
    what: str, step: int, outcomes: list[Any], tmp: Path | None
) -> RankFailedError | None:
    """The error naming every rank whose gathered outcome is a failure (a ``str``:
    the ``repr`` of its exception), or ``None`` when every rank succeeded."""
    failed = {r: o for r, o in enumerate(outcomes) if isinstance(o, str)}
    if not failed:
        return None
    return RankFailedError(
        f"{what} step {step} failed on rank(s) {sorted(failed)}; no rank committed it: "
        + "; ".join(f"rank {r}: {cause}" for r, cause in sorted(failed.items())),
        step=step,
        rank=min(failed),
        ranks=failed,
        path=tmp,
    )
