"""Stage: copy a planned snapshot into reusable host memory.

The pool owns one host buffer (the "arena") sized by a byte budget, allocated once
and reused by every save; a save leases it and gives it back once its data files are
written, and the next save waits (backpressure) until then. For CUDA sources the
arena is page-locked with ``cudaHostRegister`` on an exact-size allocation (torch's
caching host allocator rounds pinned blocks up to a power of two, which wastes up to
half the budget), device-to-host copies run on one side stream per device, and the
event loop polls a CUDA event for completion instead of synchronizing. Host
copies that writers follow (``overlap_writes``) go through :func:`copy_following`,
which advances a :class:`StagedMark` per file as it goes.

Every entry is copied through a same-size integer view (complex: its real view), so
every dtype, NaN payloads and float8/float4/bits types included, is copied
bit-exactly by one ``copy_`` kernel.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import mmap
import operator
import threading
import weakref
from collections.abc import Iterable
from typing import Any

import anyio
import anyio.to_thread
import torch

from ._bits import as_bits, clone_bits, flat_bytes
from ._errors import (
    CheckpointerClosedError,
    CheckpointTimeoutError,
    SaveFailedError,
    StagingBudgetError,
)
from ._plan import Entry, Plan, ViewCache, storage_key
from ._types import gc_paused

__all__ = [
    "LAZY_EAGER_MAX_BYTES",
    "copies_early",
    "Lease",
    "StagedMark",
    "StagingAbandonedError",
    "StagingPool",
    "copy_cpu",
    "copy_following",
    "destination",
    "producer_events",
    "snapshot_eager_entries",
    "stage_entries",
]

logger = logging.getLogger(__name__)

_PAGE = 4096


class Lease:
    """A save's hold on the staging arena; ``release()`` is idempotent.

    A lease whose device-to-host copies could not be seen to finish is *poisoned*:
    the device may still write into it, so it is never handed to another save and
    its memory is never freed (leaked on purpose, with a warning).
    """

    def __init__(self, pool: StagingPool, buffer: torch.Tensor) -> None:
        self.buffer = buffer
        self._pool: StagingPool | None = pool
        self.poisoned = False

    def release(self) -> None:
        pool, self._pool = self._pool, None
        if pool is not None:
            pool._release()

    def poison(self) -> None:
        """Mark the arena lost: the pool never leases it again, and saves waiting
        for it wake up to an error instead of waiting forever."""
        if self._pool is not None:
            self._pool._poisoned = True
        self.poisoned = True
        self.release()


class StagingPool:
    """Host staging memory with a byte budget, allocated once and reused.

    :param budget_bytes: fixed capacity in bytes, or ``None`` to size the arena by
        the first save (and grow it, while idle, for a larger later save).

    Not thread-safe: used from the event loop only. ``aclose()`` frees the arena
    (and unregisters pinned memory) and is idempotent.
    """

    def __init__(self, budget_bytes: int | None) -> None:
        self.budget_bytes = budget_bytes
        self._arena: torch.Tensor | None = None
        self._pinned = False
        self._busy = anyio.Semaphore(1)
        self._poisoned = False
        self._closed = False
        self._gave_up = False  # see give_up()
        self.allocations = 0  # how many times an arena was allocated (https://github.com/pytorch/pytorch/issues/183413)
        # Plans' views of the arena (see _views): dropped with the arena.
        self.views: weakref.WeakSet[ViewCache] = weakref.WeakSet()

    @property
    def capacity(self) -> int:
        return 0 if self._arena is None else self._arena.numel()

    @property
    def arena_ptr(self) -> int | None:
        return None if self._arena is None else self._arena.data_ptr()

    def check(self, nbytes: int) -> None:
        """Raise :class:`StagingBudgetError` if a save of ``nbytes`` can never fit."""
        if self.budget_bytes is not None and nbytes > self.budget_bytes:
            raise StagingBudgetError(
                f"the save needs {nbytes} staging bytes but budget_bytes is "
                f"{self.budget_bytes}; raise budget_bytes or leave it None"
            )

    async def acquire(self, nbytes: int, *, pin: bool) -> Lease:
        """Wait until the arena is free, then lease its first ``nbytes`` bytes.

        Cancellation while waiting leaves the pool unchanged.

        :raises SaveFailedError: the arena was poisoned (see :class:`Lease`).
        :raises CheckpointerClosedError: the pool was closed while this waited (a
            checkpointer whose close gave up after ``close_timeout_s``): nothing is
            allocated after ``aclose()``.
        """
        self.check(nbytes)
        await self._busy.acquire()
        if self._gave_up:  # before the poison check: a writer abandoned by it poisons
            self._busy.release()
            raise CheckpointerClosedError(
                "the checkpointer's close gave up (close_timeout_s) while this save "
                "waited for the staging memory"
            )
        if self._poisoned:
            self._busy.release()  # wake the next waiter to the same error
            raise SaveFailedError(
                "the staging memory was lost: a device copy into it never finished, or "
                "a writer thread reading it was abandoned at save_timeout_s (or by a "
                "close that gave up); it is never reused, so this checkpointer saves "
                "no more (open a new one)"
            )
        if self._closed:
            self._busy.release()
            raise CheckpointerClosedError(
                "the staging pool was closed (the checkpointer's close gave up) while "
                "this save waited for it"
            )
        try:
            need = max(nbytes, self.budget_bytes or 0)
            if self._arena is None or self.capacity < nbytes or (pin and not self._pinned):
                await anyio.to_thread.run_sync(self._allocate, need, pin)
            assert self._arena is not None
            return Lease(self, self._arena[:nbytes])
        except BaseException:
            self._busy.release()
            raise

    def _allocate(self, nbytes: int, pin: bool) -> None:
        if self._arena is not None and self.capacity >= nbytes:
            # Same size, only pinning is missing: register the existing buffer.
            _register(self._arena)
            self._pinned = True
            return
        self._free()
        # Page-aligned, so data files can be written from it with O_DIRECT.
        self._arena = _page_aligned(max(nbytes, 1))
        self.allocations += 1
        logger.debug("staging arena of %d bytes allocated", nbytes)
        if pin:
            _register(self._arena)
            self._pinned = True

    def _release(self) -> None:
        self._busy.release()

    def _free(self) -> None:
        for cache in list(self.views):
            cache.clear()
        if self._arena is not None and self._pinned:
            _unregister(self._arena)
        self._arena = None
        self._pinned = False

    def give_up(self) -> None:
        """The checkpointer's close gave up (``close_timeout_s``): saves waiting
        for the arena, now or later, raise :class:`CheckpointerClosedError`, the
        close's error, even if a writer it abandoned poisons the arena first."""
        self._gave_up = True

    async def aclose(self) -> None:
        self._closed = True
        if self._busy.value == 0 and self._pinned and not self._poisoned:
            # A save still staging (close timed out): never unregister under it.
            self._poisoned = True
        if self._poisoned:
            logger.warning(
                "not freeing the %d-byte staging arena: a device copy into it never "
                "finished, or a thread given up on may still read it",
                self.capacity,
            )
            if self._arena is not None:
                _LEAKED.append(self._arena)  # the device may still write into it
            self._arena = None
            return
        await anyio.to_thread.run_sync(self._free)


def _page_aligned(nbytes: int) -> torch.Tensor:
    """``nbytes`` of host memory (``uint8``), page-aligned (a private anonymous
    mapping of its own, unmapped when the last view is dropped), in transparent
    huge pages where the kernel grants them (``MADV_HUGEPAGE``).

    :raises MemoryError: the mapping could not be made."""
    try:
        # Private: a shared anonymous mapping is shmem, whose huge pages follow
        # shmem_enabled (never, on the development VM), not MADV_HUGEPAGE.
        buf = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    except OSError as exc:  # ENOMEM: a memory error, not an I/O error of the save
        raise MemoryError(f"could not map {nbytes} bytes of staging memory: {exc}") from exc
    with contextlib.suppress(AttributeError, OSError):
        buf.madvise(mmap.MADV_HUGEPAGE)
    return torch.frombuffer(buf, dtype=torch.uint8)


def _register(buf: torch.Tensor) -> None:
    cudart: Any = torch.cuda.cudart()
    err = cudart.cudaHostRegister(buf.data_ptr(), buf.numel(), 0)
    if int(err) != 0:
        raise RuntimeError(f"cudaHostRegister of {buf.numel()} bytes failed: {err}")


def _unregister(buf: torch.Tensor) -> None:
    cudart: Any = torch.cuda.cudart()
    err = cudart.cudaHostUnregister(buf.data_ptr())
    if int(err) != 0:
        logger.warning("cudaHostUnregister failed: %s", err)


def destination(buffer: torch.Tensor, e: Entry) -> torch.Tensor:
    raw = buffer[e.staging_offset : e.staging_offset + e.nbytes]
    if e.is_blob:
        return raw
    return raw.view(e.dtype).view(e.shape)


def _copy_blob(dst: torch.Tensor, e: Entry, *, non_blocking: bool) -> None:
    """Copy a blob's parts into ``dst`` (``uint8``, ``e.nbytes``); zero the rest."""
    for start, end, src in e.segments():
        if src is None:
            dst[start:end].zero_()
        else:
            dst[start:end].copy_(src, non_blocking=non_blocking)


# Dtypes whose same-dtype copy_ moves bits unchanged (plain loads and stores, no
# arithmetic): their entries are copied as themselves, by one _foreach_copy_ for
# all of them. Others go through their integer view (as_bits), one by one: bool
# among them, whose copy_ normalises every non-zero byte to 1.
PLAIN_DTYPES = frozenset(
    {
        torch.float64,
        torch.float32,
        torch.float16,
        torch.bfloat16,
        torch.int64,
        torch.int32,
        torch.int16,
        torch.int8,
        torch.uint8,
    }
)
# Dtypes of the small CUDA entries gathered on the device (as bytes: any dtype
# whose elements are plain bytes would do).
_GATHER_DTYPES = PLAIN_DTYPES | {torch.bool}


#: Tensors per ``torch._foreach_copy_`` call of the host staging copy.
FOREACH_CHUNK = 4096


def _views(
    buffer: torch.Tensor,
    entries: list[Entry],
    cache: ViewCache | None,
) -> list[torch.Tensor]:
    """Every entry's destination in ``buffer`` (see :func:`destination`), made
    once per plan structure and arena when ``cache`` is the plan's
    ``staging_views`` (a 10,000-tensor state then costs no Python call per tensor
    to find its place)."""
    if cache is None:
        return [destination(buffer, e) for e in entries]
    key = (buffer.data_ptr(), buffer.numel())
    views = cache.get(key)
    if views is None or len(views) != len(entries):
        cache.clear()  # one arena at a time: an old one's views would keep it alive
        views = cache[key] = [destination(buffer, e) for e in entries]
    return views


def _copy_batched(
    buffer: torch.Tensor,
    entries: list[Entry],
    cache: ViewCache | None,
    *,
    non_blocking: bool,
) -> None:
    """Copy every entry's source into its place in ``buffer``: entries of plain
    dtypes by one ``torch._foreach_copy_`` (one call from Python for thousands of
    small tensors; its kernels run with the GIL released), blobs and other dtypes
    one by one."""
    views = _views(buffer, entries, cache)
    if cache is not None and _all_plain(cache, entries):
        # One plain tensor per entry (a MoE's 100,000 experts): the lists are
        # the cached views and the sources taken in C, no Python step per entry.
        dsts, srcs = views, list(map(_SOURCE, entries))
    else:
        dsts, srcs = _split(entries, views, non_blocking)
    # Slices of the lists per call: the call converts its lists with the GIL
    # held before it releases it to copy (100,000 tensors: a 50 ms hold).
    step = FOREACH_CHUNK
    for i in range(0, len(dsts), step):
        torch._foreach_copy_(dsts[i : i + step], srcs[i : i + step], non_blocking=non_blocking)


_SOURCE = operator.attrgetter("source")


def _all_plain(cache: ViewCache, entries: list[Entry]) -> bool:
    """Whether every entry is one tensor of a plain dtype (no blob), found once
    per plan structure (the cache is the structure's)."""
    if cache.all_plain is None:
        cache.all_plain = all(not e.is_blob and e.dtype in PLAIN_DTYPES for e in entries)
    return cache.all_plain


def _split(
    entries: list[Entry], views: list[torch.Tensor], non_blocking: bool
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Copy the blobs and the entries of other dtypes one by one; return the
    destinations and sources of the rest, for ``torch._foreach_copy_``."""
    dsts: list[torch.Tensor] = []
    srcs: list[torch.Tensor] = []
    for e, dst in zip(entries, views, strict=True):
        src = e.source
        assert src is not None
        if e.is_blob:
            _copy_blob(dst, e, non_blocking=non_blocking)
        elif e.dtype in PLAIN_DTYPES:
            dsts.append(dst)
            srcs.append(src)
        else:
            as_bits(dst).copy_(as_bits(src), non_blocking=non_blocking)
    return dsts, srcs


def copy_cpu(
    buffer: torch.Tensor,
    entries: list[Entry],
    cache: ViewCache | None = None,
    on_staged: Any = None,
) -> None:
    # 100,000 views and lists of tensors are GC-tracked objects: a generation-2
    # pass they trigger over a large state holds the GIL for ~1 s (measured at
    # 100,000 tensors), stalling the event loop.
    with gc_paused():
        _copy_batched(buffer, entries, cache, non_blocking=False)
    if on_staged is not None:  # progress: one count for the batch
        on_staged(sum(e.nbytes for e in entries))


def _copy_host(
    buffer: torch.Tensor,
    entries: list[Entry],
    views: ViewCache | None,
    on_staged: Any,
    host_only: bool,
) -> None:
    """:func:`copy_cpu` of the host entries among ``entries`` (worker thread;
    all of them where ``host_only``: the plan's devices say so, no pass)."""
    if host_only:
        cpu = entries
    else:
        cpu = [e for e in entries if e.source is not None and not e.source.is_cuda]
    copy_cpu(buffer, cpu, views if len(cpu) == len(entries) else None, on_staged)


class StagedMark:
    """How far each data file's bytes are staged, for writers that follow the
    staging (:func:`copy_following`): offsets into the staging buffer, one per
    file, that only grow. Thread-safe; writers wait in :meth:`wait`."""

    def __init__(self, layouts: Iterable[Any]) -> None:
        self._cond = threading.Condition()
        self._upto = {fl.index: fl.staging_offset for fl in layouts}
        self._error: BaseException | None = None

    def advance(self, index: int, upto: int) -> None:
        """File ``index``'s bytes are staged up to buffer offset ``upto``."""
        with self._cond:
            self._upto[index] = max(self._upto[index], upto)
            self._cond.notify_all()

    def fail(self, error: BaseException) -> None:
        """The save failed (its staging, or anything before its files were
        needed): writers raise at their next chunk."""
        with self._cond:
            if self._error is None:
                self._error = error
            self._cond.notify_all()

    def wait(self, index: int, upto: int) -> None:
        """Block until file ``index`` is staged up to buffer offset ``upto``.

        :raises StagingAbandonedError: the save failed (:meth:`fail`), whether or
            not the bytes are staged: its writers stop at their next chunk
            instead of writing a doomed save to its end; the save's own error is
            the one raised to the caller."""
        with self._cond:
            while True:
                if self._error is not None:
                    raise StagingAbandonedError(
                        f"the save this file's write belongs to failed: {self._error!r}"
                    )
                if self._upto[index] >= upto:
                    return
                self._cond.wait()


class StagingAbandonedError(RuntimeError):
    """A write that followed the staging (:class:`StagedMark`) stopped because the
    staging failed; the staging's error is the one raised to the caller."""


#: Host copies that writers follow (:func:`copy_following`) advance each file's
#: mark at least this many bytes at a time: an entry larger than it is copied in
#: pieces of this size (bytes; equal to the writer's chunk, ``_write.CHUNK_BYTES``).
FOLLOW_PIECE_BYTES = 8 << 20


def copy_following(
    buffer: torch.Tensor,
    entries: list[Entry],
    layouts: list[Any],
    views: ViewCache | None,
    mark: StagedMark,
    on_staged: Any = None,
) -> None:
    """Stage every entry (host sources, ``buffer``: the ``uint8`` arena) so that
    writers can follow: the files' bytes are copied in file order, in steps of
    about :data:`FOLLOW_PIECE_BYTES` taken from each file in turn, and
    ``mark`` advances after each step, so every file's writer starts after its
    first step instead of after the whole snapshot. Bit-exact as
    :func:`stage_entries`: plain dtypes by one ``torch._foreach_copy_`` per step,
    entries larger than a step (contiguous, not blobs) in byte pieces, blobs and
    other dtypes one by one. Blocking (a worker thread); on error or cancellation
    of the caller, ``mark`` is failed by the caller."""
    with gc_paused():  # 1,000s of views: see copy_cpu
        _copy_following(buffer, entries, layouts, views, mark, on_staged)


@dataclasses.dataclass
class _Step:
    """Part of one file's bytes, copied at once (see :func:`copy_following`)."""

    dsts: list[torch.Tensor] = dataclasses.field(default_factory=list)  # plain: one foreach
    srcs: list[torch.Tensor] = dataclasses.field(default_factory=list)
    others: list[int] = dataclasses.field(default_factory=list)  # entries copied one by one
    nbytes: int = 0
    upto: int = 0  # the file is staged up to this buffer offset once this step is copied


def _copy_following(
    buffer: torch.Tensor,
    entries: list[Entry],
    layouts: list[Any],
    views: ViewCache | None,
    mark: StagedMark,
    on_staged: Any,
) -> None:
    dst_of = _views(buffer, entries, views)
    plans = [_file_steps(buffer, entries, fl, dst_of) for fl in layouts]
    # A step of each file in turn: every file's writer starts early.
    for k in range(max((len(steps) for steps in plans), default=0)):
        for fl, steps in zip(layouts, plans, strict=True):
            if k >= len(steps):
                continue
            step = steps[k]
            _copy_step(step, entries, dst_of)
            mark.advance(fl.index, step.upto)
            if on_staged is not None:
                on_staged(step.nbytes)


def _file_steps(
    buffer: torch.Tensor, entries: list[Entry], fl: Any, dst_of: list[torch.Tensor]
) -> list[_Step]:
    """File ``fl``'s entries cut into steps of about :data:`FOLLOW_PIECE_BYTES`,
    each saying how far the file is staged once it is copied; one step for the
    whole file where its entries are not back to back from its start."""
    piece = FOLLOW_PIECE_BYTES
    steps = [_Step()]
    pos = fl.staging_offset
    in_order = True  # entries back to back from the file's start
    for i in fl.entries:
        e = entries[i]
        src = e.source
        in_order = in_order and e.staging_offset == pos
        pos = e.staging_offset + e.nbytes
        if src is None:  # nothing to copy (as stage_entries)
            continue
        step = steps[-1]
        if e.is_blob or e.dtype not in PLAIN_DTYPES:
            step.others.append(i)
            step.nbytes += e.nbytes
        elif e.nbytes > piece and src.is_contiguous():
            _add_in_pieces(steps, buffer[e.staging_offset : pos], flat_bytes(src), e.staging_offset)
            continue
        else:
            step.dsts.append(dst_of[i])
            step.srcs.append(src)
            step.nbytes += e.nbytes
        step.upto = pos
        if step.nbytes >= piece:
            steps.append(_Step())
    if len(steps) > 1 and not (steps[-1].dsts or steps[-1].others):
        steps.pop()
    if not in_order:  # no prefix is known to be staged before the last byte
        steps = [_merged(steps)]
    steps[-1].upto = fl.staging_offset + fl.data_nbytes
    return steps


def _add_in_pieces(
    steps: list[_Step], flat_dst: torch.Tensor, flat_src: torch.Tensor, offset: int
) -> None:
    """An entry larger than a step (its bytes ``flat_src`` to ``flat_dst``, at
    buffer ``offset``) added to ``steps`` in byte pieces: the writer of its file
    starts after the first."""
    piece = FOLLOW_PIECE_BYTES
    nbytes = flat_dst.numel()
    for lo in range(0, nbytes, piece):
        hi = min(lo + piece, nbytes)
        step = steps[-1]
        step.dsts.append(flat_dst[lo:hi])
        step.srcs.append(flat_src[lo:hi])
        step.nbytes += hi - lo
        step.upto = offset + hi
        if step.nbytes >= piece:
            steps.append(_Step())


def _merged(steps: list[_Step]) -> _Step:
    """One step that copies what ``steps`` do."""
    whole = _Step()
    for step in steps:
        whole.dsts += step.dsts
        whole.srcs += step.srcs
        whole.others += step.others
        whole.nbytes += step.nbytes
    return whole


def _copy_step(step: _Step, entries: list[Entry], dst_of: list[torch.Tensor]) -> None:
    """Copy one step: its other entries one by one, its plain ones by one
    ``torch._foreach_copy_``."""
    for i in step.others:
        e = entries[i]
        if e.is_blob:
            _copy_blob(dst_of[i], e, non_blocking=False)
        else:
            assert e.source is not None
            as_bits(dst_of[i]).copy_(as_bits(e.source))
    if step.dsts:
        torch._foreach_copy_(step.dsts, step.srcs)


# Lazy saves copy entries up to this size before save() returns (module buffers
# of any size too): BatchNorm running stats and counters change during forward.
LAZY_EAGER_MAX_BYTES = 64 << 10


def copies_early(plan: Plan) -> bool:
    """Whether :func:`snapshot_eager_entries` may copy anything: ``False`` only
    when the plan is known to hold no module buffers and no entry of at most
    :data:`LAZY_EAGER_MAX_BYTES` (then a lazy ``save()`` skips the call, and the
    worker thread it would take)."""
    if not plan.entries:
        return False
    return (
        bool(plan.buffer_storages)
        or plan.smallest_entry is None
        or plan.smallest_entry <= LAZY_EAGER_MAX_BYTES
    )


def snapshot_eager_entries(plan: Plan, ready: dict[torch.device, Any] | None) -> int:
    """For a lazy save: replace the source of every entry that forward may change
    (a buffer of an ``nn.Module`` in the tree, or any entry of at most
    :data:`LAZY_EAGER_MAX_BYTES`) by a private copy taken now, on the source's
    device. CUDA: a clone on the current stream, ordered after ``ready`` (the
    caller's producer events), which never blocks the caller; ``ready`` is then
    re-recorded after the clones, so the staging copies see them. It costs device
    memory of those entries' size (buffers and small tensors only, freed once
    staged). Returns the bytes copied."""
    with gc_paused():  # 1,000s of clones: see copy_cpu
        return _snapshot_eager(plan, ready)


def _snapshot_eager(plan: Plan, ready: dict[torch.device, Any] | None) -> int:
    cache = plan.staging_views
    early = cache.early
    if early is None or early.stale(plan):
        # The structure's first lazy save: its picks found, its copies cloned
        # (a buffer made now would be new memory, no faster than the clones).
        early = cache.early = EarlyCopies(plan)
        return _clone_early(plan, early.picks + early.others, ready)
    if not early.take(plan):  # an earlier lazy save still stages from it
        return _clone_early(plan, early.picks + early.others, ready)
    try:
        return early.copy(plan.entries) + _clone_early(plan, early.others, ready)
    except BaseException:
        plan.give_back_early()  # the save fails in save(): nothing will stage
        raise


class EarlyCopies:
    """The early copies of one plan structure's lazy saves, into one host buffer
    reused save after save (as the staging arena is), by one
    ``torch._foreach_copy_`` of every picked entry (the GIL released while it
    copies) instead of a clone per entry: 100,000 tensors of at most 64 KiB
    cost a copy into warm memory, not 100,000 allocations and their page faults.

    Picked: the entries :func:`snapshot_eager_entries` copies early that are one
    host tensor of a plain dtype; the others it copies early (CUDA sources,
    blobs, other dtypes) are still cloned. A save takes the buffer
    (:meth:`take`) and its plan hands it back when its sources are released
    (staged) or the plan is dropped; a lazy save made while an earlier one
    still stages from it clones its copies. Costs host memory of the picked
    entries' size for the life of the structure's template.
    """

    def __init__(self, plan: Plan) -> None:
        early = [i for i, e in enumerate(plan.entries) if _copies_early(plan, e)]
        self.picks = [i for i in early if _fits_buffer(plan.entries[i])]
        picked = set(self.picks)
        self.others = [i for i in early if i not in picked]
        self.entries = len(plan.entries)
        self._views: list[torch.Tensor] = []
        self._nbytes = 0
        self._buffer: torch.Tensor | None = None
        self._holder: object | None = None
        self._lock = threading.Lock()

    def stale(self, plan: Plan) -> bool:
        """Whether ``plan`` is not of the structure the picks were made for.
        The number of entries is enough: the cache holding this object is one
        template's (``_replan``: the plans bound to it have its entries, equal
        signatures, the same module buffers), and a plan with entries of its
        own (an incremental save's chunks) gets a cache of its own."""
        return len(plan.entries) != self.entries

    def take(self, plan: Plan) -> bool:
        """Lend the buffer to ``plan``'s save (``False``: it is lent): handed
        back by ``plan.release_sources()``, or when ``plan`` is collected."""
        token = object()
        with self._lock:
            if self._holder is not None:
                return False
            self._holder = token
        plan.release_early = weakref.finalize(plan, self._give_back, token)
        return True

    def _give_back(self, token: object) -> None:
        with self._lock:
            if self._holder is token:
                self._holder = None

    def copy(self, entries: list[Entry]) -> int:
        """Copy every picked entry's source into the buffer and make the entry's
        source its copy; returns the bytes copied."""
        picked = [entries[i] for i in self.picks]
        srcs = [e.source for e in picked]
        if not self._views:
            self._make(picked)
        step = FOREACH_CHUNK
        with torch.no_grad():  # the buffer never records a graph of the sources
            for i in range(0, len(srcs), step):
                torch._foreach_copy_(self._views[i : i + step], srcs[i : i + step])  # type: ignore[arg-type]
        for e, view in zip(picked, self._views, strict=True):
            e.source = view
        return self._nbytes

    def _make(self, picked: list[Entry]) -> None:
        offsets, end = [], 0
        for e in picked:
            end += -end % 64  # every view aligned for its dtype
            offsets.append(end)
            end += e.nbytes
        self._nbytes = sum(e.nbytes for e in picked)  # the same at every save
        self._buffer = buffer = torch.empty(max(end, 1), dtype=torch.uint8)
        self._views = [
            buffer[o : o + e.nbytes].view(e.dtype).view(e.shape)
            for o, e in zip(offsets, picked, strict=True)
        ]


def _copies_early(plan: Plan, e: Entry) -> bool:
    """Whether a lazy save copies ``e`` before ``save()`` returns (see
    :func:`snapshot_eager_entries`)."""
    return e.source is not None and (
        e.nbytes <= LAZY_EAGER_MAX_BYTES
        or any(storage_key(src) in plan.buffer_storages for src in e.sources())
    )


def _fits_buffer(e: Entry) -> bool:
    """Whether ``e`` is one host tensor of a plain dtype (copied into an
    :class:`EarlyCopies` buffer by ``_foreach_copy_``)."""
    src = e.source
    return (
        src is not None
        and not e.is_blob
        and not e.parts
        and e.dtype in PLAIN_DTYPES
        and src.device.type == "cpu"
        and src.dtype == e.dtype
        and tuple(src.shape) == tuple(e.shape)
    )


def _clone_early(plan: Plan, indices: Iterable[int], ready: dict[torch.device, Any] | None) -> int:
    """Clone the early copies among ``plan.entries[indices]``, each into new
    memory on its source's device (see :func:`snapshot_eager_entries`)."""
    copied = 0
    cloned_on: set[torch.device] = set()

    def clone(src: torch.Tensor) -> torch.Tensor:
        if not src.is_cuda:
            return clone_bits(src)
        device = src.device
        if device not in cloned_on and ready and device in ready:
            torch.cuda.current_stream(device).wait_event(ready[device])
        cloned_on.add(device)
        with torch.cuda.device(device):
            return clone_bits(src)

    entries = plan.entries
    for i in indices:
        e = entries[i]
        if e.source is None or not _copies_early(plan, e):
            continue
        if e.parts:  # a blob over several storages: each part
            e.parts = tuple((offset, clone(src)) for offset, src in e.parts)
            e.source = e.parts[0][1]
        else:
            e.source = clone(e.source)
        copied += e.nbytes
    if ready is not None:
        for device in cloned_on:
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(device))
            ready[device] = event
    return copied


_side_streams: dict[torch.device, Any] = {}
_streams_lock = threading.Lock()
# Arenas of poisoned pools: kept alive for the life of the process.
_LEAKED: list[torch.Tensor] = []


def producer_events(devices: Iterable[torch.device] | None = None) -> dict[torch.device, Any]:
    """Record, in the calling thread, a CUDA event on the current stream of each
    device (``None``: every device, if CUDA is initialised at all).

    The copies of a save wait on these events, so they see every kernel the caller
    queued before ``save()``. The current stream is per thread: this must run in the
    thread that queued the kernels (the event loop for :class:`Checkpointer`, the
    caller's thread for :class:`SyncCheckpointer`).
    """
    if not torch.cuda.is_initialized():
        return {}
    if devices is None:
        devices = [torch.device("cuda", i) for i in range(torch.cuda.device_count())]
    events = {}
    for device in devices:
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(device))
        events[device] = event
    return events


def _side_stream(device: torch.device) -> Any:
    with _streams_lock:
        stream = _side_streams.get(device)
        if stream is None:
            stream = _side_streams[device] = torch.cuda.Stream(device=device)
        return stream


# CUDA entries of plain dtypes up to GATHER_MAX_ENTRY bytes that lie back to back
# in the arena are gathered on the device (one cat kernel per batch) into at most
# GATHER_BYTES of scratch and copied to the host by one copy: 10,000 small tensors
# cost ~100s of copies instead of 10,000 (each a launch of several us).
# The scratch stays under 1 MiB of device memory (staging allocates none beyond it:
# https://github.com/Lightning-AI/pytorch-lightning/issues/21630).
GATHER_MAX_ENTRY = 64 << 10
GATHER_BYTES = 512 << 10


def gather_batches(entries: list[Entry]) -> tuple[list[list[Entry]], list[Entry]]:
    """Split ``entries`` into batches to gather (each of at least two entries of
    a plain dtype, contiguous, 1..``GATHER_MAX_ENTRY`` bytes, lying back to back in
    the arena in staging order, at most ``GATHER_BYTES`` in all) and the rest, to
    copy one by one. Every entry is in exactly one of the two."""
    small = sorted(
        (
            e
            for e in entries
            if not e.is_blob
            and e.dtype in _GATHER_DTYPES
            and 0 < e.nbytes <= GATHER_MAX_ENTRY
            and e.source is not None
            and e.source.is_contiguous()
        ),
        key=lambda e: e.staging_offset,
    )
    batches: list[list[Entry]] = []
    cur: list[Entry] = []
    end = size = 0
    for e in small:
        if cur and (e.staging_offset != end or size + e.nbytes > GATHER_BYTES):
            batches.append(cur)
            cur, size = [], 0
        cur.append(e)
        end, size = e.staging_offset + e.nbytes, size + e.nbytes
    if cur:
        batches.append(cur)
    batches = [b for b in batches if len(b) > 1]
    gathered = {id(e) for b in batches for e in b}
    return batches, [e for e in entries if id(e) not in gathered]


def gather_into(out: torch.Tensor, batch: list[Entry]) -> None:
    """Copy the bytes of a batch's sources (see :func:`gather_batches`), one after
    the other, into ``out`` (``uint8``, their total size, on their device): one
    ``cat`` kernel on the current stream, moving bits (see :mod:`asyncsave._bits`)."""
    torch.cat([flat_bytes(_source(e)) for e in batch], out=out)


def _source(e: Entry) -> torch.Tensor:
    assert e.source is not None
    return e.source


def _enqueue_cuda(
    buffer: torch.Tensor, entries: list[Entry], ready: dict[torch.device, Any], done: list[Any]
) -> None:
    """Enqueue device-to-host copies on a side stream per device, each stream first
    waiting for the producer's ``ready`` event; append one completion event per
    device to ``done`` (also when enqueuing fails part-way, so that copies already
    queued are waited for). Runs in a worker thread: creating a stream or launching
    copies may block behind a busy device. Small contiguous tensors are gathered
    on the device into a scratch buffer of at most :data:`GATHER_BYTES` (the only
    device memory staging allocates, reused batch after batch on the stream) and
    copied to the host by one copy per batch (see :func:`gather_batches`); every
    other source is either contiguous or staged as its raw storage span."""
    with gc_paused():  # see copy_cpu
        _enqueue_cuda_now(buffer, entries, ready, done)


def _enqueue_cuda_now(
    buffer: torch.Tensor, entries: list[Entry], ready: dict[torch.device, Any], done: list[Any]
) -> None:
    by_device: dict[torch.device, list[Entry]] = {}
    for e in entries:
        assert e.source is not None
        by_device.setdefault(e.source.device, []).append(e)
    for device, group in by_device.items():
        stream = _side_stream(device)
        if device in ready:
            stream.wait_event(ready[device])
        try:
            with torch.cuda.stream(stream):
                batches, rest = gather_batches(group)
                for batch in batches:
                    start = batch[0].staging_offset
                    total = batch[-1].staging_offset + batch[-1].nbytes - start
                    scratch = torch.empty(total, dtype=torch.uint8, device=device)
                    gather_into(scratch, batch)
                    buffer[start : start + total].copy_(scratch, non_blocking=True)
                    # Freed to the caching allocator in stream order: the next
                    # batch reuses the block after this copy (never two alive).
                    del scratch
                _copy_batched(buffer, rest, None, non_blocking=True)
        finally:
            event = torch.cuda.Event()
            event.record(stream)
            done.append(event)


async def _wait_events(events: list[Any], poll_interval_s: float, deadline: float) -> bool:
    """Poll CUDA events without blocking the loop; ``False`` if the deadline passed."""
    with anyio.move_on_after(max(0.0, deadline - anyio.current_time())):
        for event in events:
            # CUDA events have no awaitable completion: polling is the design.
            while not event.query():  # noqa: ASYNC110
                await anyio.sleep(poll_interval_s)
        return True
    return False


async def lease_and_stage(
    pool: StagingPool,
    nbytes: int,
    entries: list[Entry],
    *,
    poll_interval_s: float,
    timeout_s: float,
) -> Lease:
    """Lease ``nbytes`` of ``pool`` (pinned if any source is a CUDA tensor) and
    stage ``entries`` into it; the lease is released if staging fails.

    :raises StagingBudgetError: ``nbytes`` exceeds the pool's budget.
    """
    pin = any(e.source is not None and e.source.is_cuda for e in entries)
    lease = await pool.acquire(nbytes, pin=pin)
    try:
        await stage_entries(lease, entries, poll_interval_s=poll_interval_s, timeout_s=timeout_s)
    except BaseException:
        lease.release()
        raise
    return lease


async def stage_entries(
    lease: Lease,
    entries: list[Entry],
    *,
    poll_interval_s: float,
    timeout_s: float,
    ready: dict[torch.device, Any] | None = None,
    on_staged: Any = None,
    views: ViewCache | None = None,
    host_only: bool = False,
) -> None:
    """Copy every entry's source into the lease's buffer at its staging offset.

    CUDA copies are enqueued from a worker thread (shielded from cancellation, bounded
    by the deadline), host copies run in a worker thread (never abandoned: the
    buffer is not reused while a thread may still write into it), then CUDA events
    are polled with ``anyio.sleep``. Returns when the snapshot is complete.

    :param ready: CUDA events marking what the caller queued before ``save()`` (see
        :func:`producer_events`); recorded here, on the calling thread, if ``None``.
    :param on_staged: called with each host entry's byte count once it is copied
        (from the worker thread), and with the device entries' total once their
        copies have landed (progress).
    :param views: the plan's ``staging_views`` when ``entries`` are all of a
        plan's entries (CPU sources: their destinations are made once per plan).
    :param host_only: no source is a CUDA tensor (the plan's devices say so):
        the entries are then sorted in the worker thread that copies them, with
        no pass over them on the event loop.
    :raises CheckpointTimeoutError: the copies did not finish within ``timeout_s``
        (one deadline for enqueuing, copying and waiting). If the caller is
        cancelled, or the deadline passes, copies already queued are waited for
        (shielded, until the same deadline) before the buffer can be reused; copies
        that never land poison the lease (see :class:`Lease`).
    """
    deadline = anyio.current_time() + timeout_s
    buffer = lease.buffer
    cuda: list[Entry] = []
    if not host_only:
        cuda = [e for e in entries if e.source is not None and e.source.is_cuda]
    events: list[Any] = []
    try:
        if cuda:
            if ready is None:
                ready = producer_events({e.source.device for e in cuda if e.source is not None})
            with anyio.CancelScope(shield=True) as scope:
                scope.deadline = deadline
                await anyio.to_thread.run_sync(
                    _enqueue_cuda, buffer, cuda, ready, events, abandon_on_cancel=True
                )
            if scope.cancelled_caught:
                lease.poison()  # the abandoned thread may still be queueing copies
                raise CheckpointTimeoutError(
                    f"queueing device-to-host copies took over {timeout_s} s"
                )
        if len(cuda) < len(entries):  # host entries (or released ones) left
            if views is not None and lease._pool is not None:
                lease._pool.views.add(views)
            await anyio.to_thread.run_sync(_copy_host, buffer, entries, views, on_staged, host_only)
        if not await _wait_events(events, poll_interval_s, deadline):
            raise CheckpointTimeoutError(
                f"device-to-host copies did not finish within {timeout_s} s (a kernel "
                "queued before save() may be hung)"
            )
        if cuda and on_staged is not None:
            on_staged(sum(e.nbytes for e in cuda))
    except BaseException:
        if events and not lease.poisoned:
            with anyio.CancelScope(shield=True):
                landed = await _wait_events(events, poll_interval_s, deadline)
            if not landed:
                lease.poison()
        raise
