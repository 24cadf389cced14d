"""Run megatron-core's ``dist_checkpointing`` async save requests on asyncsave.

Megatron builds an ``AsyncRequest`` (``megatron.core.dist_checkpointing.strategies.
async_utils``): a write function with its arguments, a *preload* function that
copies the tensors to host memory, and *finalize* functions that must run on all
ranks after every rank's write. Megatron's own caller runs them in a forked worker
and finalizes at a later training step. :class:`MegatronSaver` runs the same request
on an open, distributed :class:`~asyncsave.Checkpointer` instead::

    saver = asyncsave.megatron.MegatronSaver(ckpt)          # ckpt: distributed
    tmp = await saver.prepare(step)                         # every rank
    with saver.building(step):                              # no Manager process
        request = dist_checkpointing.save(sharded_state_dict, tmp,
                                          sharded_strategy, async_sharded_save=True)
    handle = await saver.save(step, request)                # returns once staged
    ...                                                     # training goes on
    await handle                                            # committed, tracked

The order, on every rank (each step finishes on every rank before the next):

1. ``prepare``: rank 0 creates the shared temporary directory; its name is
   broadcast on asyncsave's gloo group. Megatron writes ``common.pt`` there.
2. ``save``: the request's tensors are staged into asyncsave's staging pool
   (pinned host memory and a side stream for CUDA tensors, polled events) *in place
   of* the request's ``preload_fn``; ``save`` returns when the snapshot is taken.
3. background: the request's write function (Megatron's
   ``write_preloaded_data_multiproc``: forked writers, every file fsynced) on the
   staged buckets, from a worker thread; then an all-gather of every rank's write
   results on asyncsave's group: any failure and no rank goes on.
4. Megatron's finalize functions, in order: ``.metadata`` (DCP metadata of every
   rank's write results, written by rank 0), ``metadata.json``, then any finalize
   function the caller added; then an all-gather of their outcomes.
5. asyncsave's commit (``manifest.json``, fsync, rename to the layout's final name,
   e.g. ``iter_0000040`` with ``layout="megatron"``) and only then the tracker.
   The tracker can never name a checkpoint whose finalize did not run on every rank
   (the bug of the SkyRL and verl reports, where the tracker moved first).

Where the CPU line is (megatron-core 0.16.1): building the request works on CPU
with gloo. Three of its pieces call CUDA or the caller's process group, so the
saver does not call them; it does their work itself:

* ``preload_fn`` (``FileSystemWriterAsync.preload_tensors``) ends with
  ``torch.cuda.synchronize()``: replaced by asyncsave's staging (step 2).
* the strategy's finalize function (``save_state_dict_async_finalize``) puts its
  failure flag in a tensor on ``torch.cuda.current_device()`` and broadcasts it on
  the planning group (the caller's default group): replaced by the same steps
  (``retrieve_write_results``, gather, ``FileSystemWriterAsync.finish`` on rank 0)
  with the gather and the failure check on asyncsave's group (steps 3-4). It is
  recognised by its qualified name; its writer and metadata come from its closure.
* ``save()``'s ``metadata_finalize_fn`` ends with ``torch.distributed.barrier()``
  on the default group, which in the background would race the trainer's own
  collectives: replaced by ``save_config`` on rank 0 (step 4) under asyncsave's
  collective.

Finalize functions added by the caller (``request.add_finalize_fn``) run as they
are, in order, from a worker thread: they must not use the trainer's process group.

Processes. megatron-core 0.16.1 can leave three kinds of process behind:

* ``FileSystemWriterAsync`` collects write results in a ``multiprocessing``
  ``Manager().Queue()`` (``filesystem_async._get_write_results_queue``): a server
  process *spawned* (about 270 MB, plus its resource tracker) at the first request
  built in a process and kept in a module global for the life of that process. Only
  ``multiprocessing``'s exit hook shuts it down, so a rank that ends by
  ``os._exit``, a signal or a crash leaves it running with parent 1.
* ``AsyncCallsQueue(persistent=True)`` spawns a persistent worker
  (``PersistentAsyncCaller``) that lives until ``AsyncCallsQueue.close()``.
* ``write_preloaded_data_multiproc`` forks one writer per bucket for each write and
  joins them before it returns.

:class:`MegatronSaver` starts no long-lived process. It runs the write function in
this process (a worker thread), so it needs no queue between processes. Inside
:meth:`~MegatronSaver.building` (the ``with`` block around the request build, and
nothing longer) megatron-core's ``_get_write_results_queue`` is replaced by one
that gives the building thread an in-process queue, so megatron-core spawns no
``Manager`` for it, and gives every other thread megatron-core's own answer;
megatron-core's getter is back on every way out of the block, an exception
included, and its ``_results_queue`` global is never written. (megatron-core
0.16.1 takes no queue from the caller: ``FileSystemWriterAsync`` is made inside
``TorchDistSaveShardedStrategy.async_save`` and calls the module's getter in
``prepare_write_data``.) Every request then reports its write results through a
queue of its own. It never creates an
``AsyncCallsQueue``. The forked writers are megatron-core's and end with each
write. A ``Manager`` or persistent worker that the trainer started by using
megatron-core's own async caller in the same process is the trainer's: the saver
neither uses nor stops it (close the caller with ``AsyncCallsQueue.close()``, and
end the process with ``sys.exit`` rather than ``os._exit`` so that the ``Manager``
is shut down).
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import inspect
import logging
import os
import queue
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import anyio.to_thread

from ._coord import GlooGroup
from ._engine import Checkpointer, admission_of
from ._errors import CheckpointError
from ._handle import SaveHandle
from ._jobs import Job, Services
from ._manifest import CHECKSUM, FORMAT, FORMAT_VERSION
from ._plan import Entry
from ._stage import Lease, destination, lease_and_stage

__all__ = ["MegatronSaver"]

logger = logging.getLogger(__name__)

_ALIGN = 64
_STRATEGY_FINALIZE = "_get_save_and_finalize_callbacks.<locals>.finalize_fn"
_METADATA_FINALIZE = "save.<locals>.metadata_finalize_fn"
_FS_ASYNC = "megatron.core.dist_checkpointing.strategies.filesystem_async"


class MegatronSaver:
    """Runs megatron-core async save requests on a distributed ``Checkpointer``.

    :param ckpt: an open :class:`~asyncsave.Checkpointer` with ranks coordinated
        (``torch.distributed`` initialised with several ranks, or
        ``distributed=True`` for one); pick ``layout="megatron"`` for Megatron's
        ``iter_%07d`` directories and ``latest_checkpointed_iteration.txt``.
    :raises CheckpointError: ``ckpt`` is not open or not distributed.
    """

    def __init__(self, ckpt: Checkpointer) -> None:
        admission = admission_of(ckpt)
        saver = admission.saver
        if not isinstance(saver.coord, GlooGroup):
            raise CheckpointError(
                "MegatronSaver needs a distributed Checkpointer (init_process_group, "
                "and distributed=True for a single rank)",
                path=ckpt.root,
            )
        if not saver.strategy.can_move_files:
            raise CheckpointError(
                "megatron-core's writers do local file I/O into the directory prepare() "
                f"returns; {ckpt.root} is on {saver.fs!r} (commit by marker): use a "
                "shared POSIX file system root",
                path=ckpt.root,
            )
        self.ckpt = ckpt
        self._admission = admission
        self._prepared: tuple[int, int, Path] | None = None

    async def prepare(self, step: int) -> Path:
        """Agree on the temporary directory of ``step`` (every rank, same order as
        the checkpointer's other saves): pass it as ``checkpoint_dir`` to
        ``dist_checkpointing.save(..., async_sharded_save=True)``.

        The save's turn on asyncsave's group starts here; call :meth:`save` for the
        same step next.

        :raises RankFailedError: rank 0 could not create it, or a rank died.
        """
        if self._prepared is not None:
            raise CheckpointError(f"prepare({self._prepared[0]}) was never followed by save()")
        ticket, tmp = await self._admission.prepare(step)
        self._prepared = (step, ticket, tmp)
        return tmp

    @contextlib.contextmanager
    def building(self, step: int) -> Iterator[None]:
        """Build the request of ``step`` inside this ``with`` block (after
        :meth:`prepare`, before :meth:`save`)::

            with saver.building(step):
                request = dist_checkpointing.save(..., async_sharded_save=True)

        While it lasts, megatron-core's ``FileSystemWriterAsync`` gets an in-process
        results queue in this thread instead of spawning its ``Manager`` process;
        other threads, and this one after the block, get megatron-core's own
        behaviour. Nothing of megatron-core is left changed on any way out of the
        block, an exception included; a failed build leaves the prepared save as
        it was (build again, then :meth:`save`). A request built outside the block
        works too, but megatron-core then starts its ``Manager`` (the process's,
        not the saver's to stop).

        :raises CheckpointError: no :meth:`prepare` of ``step`` came first.
        """
        if self._prepared is None or self._prepared[0] != step:
            raise CheckpointError(f"building({step}) needs prepare({step}) first", step=step)
        with _in_process_results_queue():
            yield

    async def save(self, step: int, request: Any) -> SaveHandle:
        """Stage ``request``'s tensors and run it in the background (see the module
        docstring for the order). Returns once the snapshot is taken; ``await`` the
        handle for the commit.

        :param request: a megatron-core ``AsyncRequest`` built for the directory
            :meth:`prepare` returned.
        :raises CheckpointError: no :meth:`prepare` of ``step`` came first.
        :raises StagingBudgetError: the tensors exceed an explicit ``budget_bytes``.
        """
        if self._prepared is None or self._prepared[0] != step:
            raise CheckpointError(f"save({step}) needs prepare({step}) first", step=step)
        _, ticket, tmp = self._prepared
        self._prepared = None
        job: MegatronJob | BaseException
        try:
            job = MegatronJob(request)
        except Exception as exc:
            job = exc
        return await self._admission.submit_job(step, job, ticket=ticket, tmp=tmp)


class MegatronJob(Job):
    """One Megatron request, its tensors staged in asyncsave's pool."""

    def __init__(self, request: Any) -> None:
        self.request = request
        self.buckets: list[Any] = []
        self.lease: Lease | None = None
        self.steps = _finalize_steps(request.finalize_fns)
        # The write runs in this process: its results come back through a queue
        # of this request's own, never through megatron-core's process-wide one.
        self.results: queue.Queue[Any] = queue.Queue()
        for kind, *rest in self.steps:
            if kind == "strategy" and getattr(rest[0], "results_queue", None) is not None:
                if not isinstance(rest[0].results_queue, queue.Queue):
                    logger.warning(
                        "a megatron request built outside MegatronSaver.building(): "
                        "megatron-core started its results Manager process for it"
                    )
                rest[0].results_queue = self.results  # None: nothing to write on this rank

    async def stage(
        self, saver: Services, step: int, ready: dict[Any, Any] | None, make_tmp: Any
    ) -> None:
        """Copy every tensor of the request's write buckets into the staging pool
        (the request's ``preload_fn`` is not called: it needs CUDA)."""
        assert saver.pool is not None
        request = self.request
        args = list(request.async_fn_args)
        buckets = args[1] if request.async_fn is not None else []
        entries: list[Entry] = []
        offset = 0
        for bucket in buckets:
            _, _, (_, tensor_data) = bucket
            for _, t in tensor_data:
                nbytes = t.numel() * t.element_size()
                e = Entry(
                    f"{len(entries)}", t, nbytes, t.element_size(), False, t.dtype, tuple(t.shape)
                )
                e.staging_offset = offset
                offset += -(-nbytes // _ALIGN) * _ALIGN
                entries.append(e)
        self.buckets = buckets
        if not entries:
            return
        self.lease = lease = await lease_and_stage(
            saver.pool,
            offset,
            entries,
            poll_interval_s=saver.options.poll_interval_s,
            timeout_s=saver.options.save_timeout_s,
        )
        staged = []
        it = iter(entries)
        for file_name, storage_key, (bytes_data, tensor_data) in buckets:
            staged_tensors = [
                (item, destination(lease.buffer, next(it))) for item, _ in tensor_data
            ]
            staged.append((file_name, storage_key, (bytes_data, staged_tensors)))
        self.buckets = staged
        self.nbytes = sum(e.nbytes for e in entries)

    def release(self) -> None:
        if self.lease is not None:
            self.lease.release()

    async def write(self, saver: Services, coord: Any, tmp: Path) -> dict[str, Any]:
        req = self.request
        if req.async_fn is not None:
            args = list(req.async_fn_args)
            args[1] = self.buckets
            args[2] = self.results
            await anyio.to_thread.run_sync(
                functools.partial(req.async_fn, *args, **req.async_fn_kwargs),
                abandon_on_cancel=True,
            )
        self.release()
        part: dict[str, Any] = {}
        for kind, *rest in self.steps:
            if kind == "strategy":
                from torch.distributed.checkpoint.utils import _is_wrapped_exception

                results = rest[0].retrieve_write_results()
                if _is_wrapped_exception(results):
                    raise CheckpointError(f"megatron writer failed: {results}")
                part["write_results"] = results
        return part

    async def finalize(
        self, saver: Services, coord: Any, tmp: Path, parts: list[dict[str, Any]]
    ) -> None:
        for kind, *rest in self.steps:
            if kind == "strategy":
                writer, metadata = rest
                if coord.rank == 0:
                    if metadata is None:
                        raise CheckpointError("megatron's plan left no global metadata on rank 0")
                    results = [p["write_results"] for p in parts]
                    await anyio.to_thread.run_sync(writer.finish, metadata, results)
            elif kind == "config":
                strategy, checkpoint_dir = rest
                if coord.rank == 0:
                    from megatron.core.dist_checkpointing.core import (
                        CheckpointingConfig,
                        save_config,
                    )

                    config = CheckpointingConfig(strategy.backend, strategy.version)
                    await anyio.to_thread.run_sync(save_config, config, checkpoint_dir)
            else:
                await anyio.to_thread.run_sync(rest[0])

    def manifest(self, tmp: Path, step: int, parts: list[dict[str, Any]]) -> dict[str, Any]:
        files: list[dict[str, Any]] = []
        dot_files: list[dict[str, Any]] = []
        for name in sorted(os.listdir(tmp)):
            path = tmp / name
            if not path.is_file():
                continue
            record = {"name": name, "nbytes": path.stat().st_size}
            (dot_files if name.startswith(".") else files).append(record)
        return {
            "format": FORMAT,
            "format_version": FORMAT_VERSION,
            "step": step,
            "world_size": len(parts),
            "checksum": CHECKSUM,
            "created_unix_s": time.time(),
            "files": files,
            "dot_files": dot_files,
            "entries": [],
            "tensors": [],
            "tree": {"type": "foreign", "format": "megatron-core dist_checkpointing"},
        }


def _finalize_steps(fns: list[Any]) -> list[tuple[Any, ...]]:
    """Megatron's finalize functions as steps the saver runs (see the module
    docstring): ``("strategy", writer, metadata)``, ``("config", strategy, dir)``
    or ``("call", fn)``."""
    steps: list[tuple[Any, ...]] = []
    for fn in fns:
        qualname = getattr(fn, "__qualname__", "")
        if qualname.endswith(_STRATEGY_FINALIZE):
            writer, metadata, _ = inspect.getclosurevars(fn).nonlocals["save_state_dict_ret"]
            steps.append(("strategy", writer, metadata))
        elif qualname.endswith(_METADATA_FINALIZE):
            nonlocals = inspect.getclosurevars(fn).nonlocals
            steps.append(("config", nonlocals["sharded_strategy"], nonlocals["checkpoint_dir"]))
        else:
            steps.append(("call", fn))
    return steps


# The threads inside MegatronSaver.building() (by thread id, how deep), and the
# getter of megatron-core they replace, while any is: under _scope_lock.
_scope_lock = threading.Lock()
_builders: dict[int, int] = {}
_megatron_getter: Any = None


# megatron-core's getter of its write-results queue: ``_get_write_results_queue``
# up to 0.16, ``get_write_results_queue(mp_mode)`` from 0.17 on.
_GETTER_NAMES = ("_get_write_results_queue", "get_write_results_queue")
_megatron_getters: dict[str, Any] = {}


def _scoped_results_queue(*args: Any, **kwargs: Any) -> Any:
    """Stands for megatron-core's ``_get_write_results_queue`` while some thread is
    inside :meth:`MegatronSaver.building`: that thread gets an in-process queue,
    every other thread what megatron-core's own getter gives (its ``Manager``
    queue), as if nothing were in place."""
    if threading.get_ident() in _builders:
        return queue.Queue()
    return _megatron_getter(*args, **kwargs)


@contextlib.contextmanager
def _in_process_results_queue() -> Iterator[None]:
    """Put :func:`_scoped_results_queue` in megatron-core's place for the ``with``
    block only, and take megatron-core's getter back on every way out (exceptions
    included) once no thread is inside any more. Its ``_results_queue`` (the
    ``Manager`` queue, or ``None``) is never touched."""
    global _megatron_getter
    try:
        fs_async = importlib.import_module(_FS_ASYNC)
    except ImportError:
        yield
        return
    me = threading.get_ident()
    with _scope_lock:
        if not _builders:
            _megatron_getter = None
            for name in _GETTER_NAMES:
                getter = getattr(fs_async, name, None)
                if getter is None:  # not this release's name: nothing to scope
                    continue
                _megatron_getters[name] = getter
                _megatron_getter = getter
                setattr(fs_async, name, _scoped_results_queue)
        _builders[me] = _builders.get(me, 0) + 1
    try:
        yield
    finally:
        with _scope_lock:
            _builders[me] -= 1
            if not _builders[me]:
                del _builders[me]
            if not _builders:
                for name, getter in _megatron_getters.items():
                    if getattr(fs_async, name, None) is _scoped_results_queue:
                        setattr(fs_async, name, getter)
                _megatron_getters.clear()
                _megatron_getter = None
