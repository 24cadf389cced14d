"""Plan once, reuse: a save whose tree has the structure of the previous save's
reuses its grouping into entries, its file layout and its header bytes.

``make_plan`` groups tensors by the memory they share and ``layout_files`` lays
the entries out in files; for a state of 10,000 small tensors the two cost about
0.5 s, repeated at every save although nothing about the structure changed. A
training run saves the same structure again and again (a MoE model's experts, a
replay buffer of fixed size), so the :class:`Planner` keeps the last plan's
*template*: its entries and records without the caller's tensors, its layouts,
staging size and streamed rounds.

A save is first matched against the template's tree (:mod:`asyncsave._skeleton`):
a walk beside it that takes a dict of tensors by its key list, shares every
unchanged node, and compares one signature tuple per tensor; a match binds the
template's entries, lent from a pool (:meth:`Plan.recycle` hands them back), to
the save's tensors: no Python object per tensor at 100,000 tensors. A save that
does not match (or a template with NumPy or pickled leaves) is flattened as
before (the values of plain leaves change, ``Stateful`` objects return new
dicts: each one's ``state_dict()`` is still called once); then each tensor
leaf's *signature* is compared with the template's: key, kind, ``requires_grad``, dtype, shape, strides, device, the
tensor's offset in its storage and its storage's address and length (built by
``flatten`` in the same pass as the leaf, compared as tuples in C). Equal signatures mean
every tensor covers the same bytes of the same memory as last time, so tensors
share memory exactly as they did and the grouping, offsets and layout hold; the
template's entries are copied and bound to this save's tensors. Any difference
(a new or removed key, one shape, a storage re-allocated by offloading, https://github.com/NVIDIA-NeMo/RL/issues/3312, a
view that now aliases another tensor) makes a new plan and a new template. The
check is one tuple per tensor, built while flattening: about 10x cheaper than
planning.

Planning runs in a worker thread (:func:`plan_off_loop`) so the event loop keeps
ticking while ``save()`` awaits it; ``state_dict()`` of ``Stateful`` objects is
still called on the event loop's thread (``anyio.from_thread``), as before. One
exception: a small tree of plain containers, tensors and scalars (at most
:data:`INLINE_PLAN_MAX_NODES` nodes, no ``Stateful``) whose structure is the last
save's is bound to the template on the event loop, which takes microseconds,
where the two thread hops took milliseconds on busy cores (a lazy ``save()`` of
a Megatron or FSDP rank's few flat buffers blocked 5 ms on 4 ranks sharing 2
cores, against 2 ms).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import operator
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable
from typing import Any

import anyio
import anyio.from_thread
import anyio.to_thread
import torch

from . import _format
from ._format import FileLayout, layout_files, staging_nbytes
from ._plan import (
    Entry,
    Plan,
    TensorLeaf,
    ViewCache,
    flatten,
    gc_paused,
    group_plan,
    tensor_signature,
)
from ._skeleton import Matched, Skeleton, leaf_fast_signatures, same_signature
from ._stream import Piece, plan_rounds
from ._types import release_in_chunks

__all__ = [
    "INLINE_PLAN_MAX_NODES",
    "Planner",
    "admitting",
    "leaf_signature",
    "plan_off_loop",
    "same_signature",
]

# Nodes (containers and leaves) of a tree that may be re-planned on the event
# loop when its structure is the last save's (see the module's docstring).
INLINE_PLAN_MAX_NODES = 128

logger = logging.getLogger(__name__)

# (offset in the entry, leaf whose storage holds the part, byte offset in that
# storage, length in bytes)
_PartRef = tuple[int, int, int, int]


# Entry lists a template keeps for reuse (Plan.recycle): two saves in flight
# (one writing while the next stages) reuse theirs.
POOLED_ENTRY_SETS = 2


def leaf_signature(leaves: list[TensorLeaf]) -> list[tuple[Any, ...]]:
    """One tuple per tensor leaf naming everything the plan depends on (see
    :func:`~asyncsave._plan.tensor_signature`; a pickled leaf, always a fresh
    buffer of its own, by key and size only): what :func:`flatten` builds in
    its own pass when given a list."""
    out: list[tuple[Any, ...]] = []
    for leaf in leaves:
        t = leaf.tensor
        assert t is not None
        if leaf.kind == "pickle":
            out.append((leaf.key, "pickle", t.numel()))
        else:
            out.append(tensor_signature(leaf.key, leaf.kind, leaf.requires_grad, t))
    return out


@dataclasses.dataclass
class _Template:
    """A plan without the caller's tensors, and how to bind the next save's."""

    signature: list[tuple[Any, ...]]
    entries: list[Entry]  # sources dropped, digests empty
    records: list[dict[str, Any]]
    layouts: list[FileLayout]
    nbytes: int
    lone: list[tuple[int, int]]  # (entry, leaf) of entries that are one tensor
    blobs: list[tuple[int, list[_PartRef]]]  # (entry, its parts) of shared regions
    key: tuple[int, int, int]  # _key(): what the layout was made for
    devices: set[torch.device] = dataclasses.field(default_factory=set)
    smallest_entry: int | None = None  # bytes (see Plan.smallest_entry)
    payload: int = 0  # bytes: Plan.nbytes, the sum of the entries' bytes
    rounds: dict[int, list[list[Piece]]] = dataclasses.field(default_factory=dict)
    # Typed views of the staging arena, one per entry, keyed by the arena's
    # (address, length): built once per plan and arena (see _stage).
    views: ViewCache = dataclasses.field(default_factory=ViewCache)
    # The tree prepared for matching the next save without flattening it
    # (None: a leaf kind the skeleton does not match, such as a NumPy array).
    skeleton: Skeleton | None = None
    # The leaves without their tensors (kind, key, requires_grad), shared by
    # the plans bound through the skeleton.
    bare_leaves: list[TensorLeaf] = dataclasses.field(default_factory=list)
    # Entry lists handed back by finished saves (Plan.recycle), bound again
    # instead of copied: at most POOLED_ENTRY_SETS.
    free: list[list[Entry]] = dataclasses.field(default_factory=list)


def _bare(e: Entry) -> Entry:
    """A copy of ``e`` without its sources or digest (a template's entry)."""
    new = _copy(e)
    new.source, new.parts, new.digest = None, (), ""
    return new


# Every field of an Entry, in __init__'s order (a field added later is copied too).
_ENTRY_FIELDS = operator.attrgetter(*(f.name for f in dataclasses.fields(Entry)))


def _copy(e: Entry) -> Entry:
    # Through __init__, all fields read by one C call: 10x cheaper than
    # dataclasses.replace and cheaper than copying __dict__, which materialised a
    # dict per entry (Python keeps attributes inline until __dict__ is read):
    # 100,000 more objects for the collector's young pass after a reused plan.
    return Entry(*_ENTRY_FIELDS(e))


def _template(
    plan: Plan,
    layouts: list[FileLayout],
    nbytes: int,
    sig: list[tuple[Any, ...]],
    key: tuple[int, int, int],
) -> _Template:
    members: list[list[int]] = [[] for _ in plan.entries]
    for i, rec in enumerate(plan.records):
        members[rec["entry"]].append(i)
    lone: list[tuple[int, int]] = []
    blobs: list[tuple[int, list[_PartRef]]] = []
    for j, e in enumerate(plan.entries):
        if not e.is_blob:
            assert len(members[j]) == 1
            lone.append((j, members[j][0]))
            continue
        refs: list[_PartRef] = []
        for offset, part in e.parts or ((0, e.source),):
            assert part is not None
            storage = part.untyped_storage()
            owner = next(
                i
                for i in members[j]
                if (s := _leaf_tensor(plan, i).untyped_storage()).data_ptr() == storage.data_ptr()
                and s.nbytes() == storage.nbytes()
            )
            refs.append((offset, owner, int(part.storage_offset()), part.numel()))
        blobs.append((j, refs))
    fast = leaf_fast_signatures(plan.leaves)
    return _Template(
        signature=sig,
        entries=[_bare(e) for e in plan.entries],
        records=plan.records,
        layouts=layouts,
        nbytes=nbytes,
        lone=lone,
        blobs=blobs,
        key=key,
        skeleton=Skeleton.of(plan.tree, fast),
        bare_leaves=[TensorLeaf(x.key, None, x.kind, x.requires_grad) for x in plan.leaves],
    )


def _leaf_tensor(plan: Plan, i: int) -> torch.Tensor:
    t = plan.leaves[i].tensor
    assert t is not None
    return t


class Planner:
    """The plans of one checkpointer's saves (of one rank), reused while the
    structure holds. Used from one thread at a time (saves plan one by one).

    ``made`` and ``reused`` count the plans made and reused (for tests and logs).
    ``payload_bytes`` is the sum of the entries' bytes of the plan returned
    last (``Plan.nbytes``, summed once per structure, in the planning thread:
    read on the event loop instead of a pass over 100,000 entries there).
    """

    def __init__(self) -> None:
        self._last: _Template | None = None
        self.made = 0
        self.reused = 0
        self.payload_bytes = 0

    def plan(
        self,
        state: Any,
        *,
        allow_pickle: bool,
        rank: int,
        max_files: int,
        call: Callable[[Callable[[], Any]], Any] | None = None,
    ) -> tuple[Plan, list[FileLayout], int]:
        """Flatten ``state`` and plan its save: ``(plan, layouts, staging bytes)``.

        :param call: runs a ``Stateful`` object's ``state_dict`` (on the event
            loop's thread, from a worker); ``None``: here.
        :raises InvalidStateError: (or a subclass) naming the key, as
            :func:`~asyncsave._plan.make_plan`.
        """
        # A match first, the collector running: what it makes per tensor is the
        # callers' own (their state_dict()s' tensors and dicts), left to the
        # collector's usual small passes, where a pause ended by one young pass
        # over 100,000 of them (a model and its AdamW passed as objects) held
        # the GIL for 0.5 s. The signature check inside is paused (Skeleton.match).
        matched = self._match(state, rank, max_files, call)
        if matched is not None:
            out = matched
        else:
            # The cyclic GC paused for the plan (see make_plan): its passes over
            # the 100,000s of objects a large plan makes would cost more than it.
            with gc_paused():
                out = self._plan(state, allow_pickle, rank, max_files, call)
        plan = out[0]
        plan.devices  # noqa: B018  (computed here, in the worker, and kept)
        return out

    def reuse(
        self, state: Any, *, allow_pickle: bool, rank: int, max_files: int
    ) -> tuple[Plan, list[FileLayout], int] | None:
        """:meth:`plan` where it costs microseconds, on the caller's thread: for
        a small plain tree (:func:`_small_plain_tree`) of the last save's
        structure; ``None`` otherwise (plan it in a worker thread).

        :raises InvalidStateError: as :meth:`plan`.
        """
        last = self._last
        if last is None or last.key != _key(rank, max_files) or not _small_plain_tree(state):
            return None
        if last.skeleton is not None:
            matched = last.skeleton.match(state)  # a plain tree: no state_dict() to call
            if matched is None:
                return None
            self.reused += 1
            self.payload_bytes = last.payload
            return self._bind_matched(last, matched), last.layouts, last.nbytes
        sig: list[tuple[Any, ...]] = []
        flat = flatten(state, allow_pickle=allow_pickle, signature=sig)
        if not same_signature(last.signature, sig):
            return None
        self.reused += 1
        self.payload_bytes = last.payload
        return self._bind(last, flat), last.layouts, last.nbytes

    def _plan(
        self,
        state: Any,
        allow_pickle: bool,
        rank: int,
        max_files: int,
        call: Callable[[Callable[[], Any]], Any] | None,
    ) -> tuple[Plan, list[FileLayout], int]:
        key = _key(rank, max_files)
        last = self._last
        # What a failed match obtained: no state_dict() called twice.
        states = {} if last is None or last.skeleton is None else last.skeleton.take_states()
        sig: list[tuple[Any, ...]] = []
        flat = flatten(state, allow_pickle=allow_pickle, call=call, signature=sig, states=states)
        if last is not None and last.key == key and same_signature(last.signature, sig):
            release_in_chunks(sig)  # 100,000s of tuples: not freed in one call
            self.reused += 1
            self.payload_bytes = last.payload
            plan = self._bind(last, flat)
            if last.skeleton is not None:
                # The tree changed, not the tensors (a scalar's type, a module's
                # metadata, a class): later saves are matched against this tree,
                # not walked twice against the old one.
                last.skeleton = Skeleton.of(flat.tree, last.skeleton.signatures)
                plan.shares_tree = last.skeleton is not None
            return plan, last.layouts, last.nbytes
        self.made += 1
        if last is not None:
            logger.debug("state structure changed: planning again (%d leaves)", len(sig))
        self._last = None  # a failure below leaves no stale template
        plan = group_plan(flat)
        layouts = layout_files(plan.entries, rank=rank, max_files=max_files)
        nbytes = staging_nbytes(layouts)
        self._last = _template(plan, layouts, nbytes, sig, key)
        self._last.devices = plan.devices  # the signature names every leaf's device
        self._last.smallest_entry = plan.remember_smallest_entry()
        self.payload_bytes = self._last.payload = plan.nbytes
        plan.staging_views = self._last.views
        # The skeleton matches later saves against this tree: kept whole.
        plan.shares_tree = self._last.skeleton is not None
        return plan, layouts, nbytes

    def _match(
        self,
        state: Any,
        rank: int,
        max_files: int,
        call: Callable[[Callable[[], Any]], Any] | None,
    ) -> tuple[Plan, list[FileLayout], int] | None:
        """The last template bound to ``state`` if the skeleton matches it."""
        last = self._last
        if last is None or last.key != _key(rank, max_files) or last.skeleton is None:
            return None
        matched = last.skeleton.match(state, call=call)
        if matched is None:
            return None
        self.reused += 1
        self.payload_bytes = last.payload
        return self._bind_matched(last, matched), last.layouts, last.nbytes

    def rounds(self, plan: Plan, layouts: list[FileLayout], budget: int) -> list[list[Piece]]:
        """The streamed rounds of ``plan`` for ``budget`` (made once per template)."""
        last = self._last
        if last is None or last.layouts is not layouts:
            return plan_rounds(plan.entries, layouts, budget)
        rounds = last.rounds.get(budget)
        if rounds is None:
            rounds = last.rounds[budget] = plan_rounds(plan.entries, layouts, budget)
        return rounds

    @staticmethod
    def _bind(t: _Template, flat: Plan) -> Plan:
        """A plan of this save's tensors (flattened) on the template's entries."""
        tensors = [leaf.tensor for leaf in flat.leaves]
        entries = [_copy(e) for e in t.entries]
        _attach(t, entries, tensors)  # type: ignore[arg-type]
        return _bound(t, entries, flat.tree, flat.leaves, flat.buffer_storages)

    @staticmethod
    def _bind_matched(t: _Template, m: Matched) -> Plan:
        """A plan of this save's tensors (matched by the skeleton) on entries
        the template lends from its pool (or copies), handed back by
        :meth:`Plan.recycle` once the save is done with them: a steady run of
        saves makes no Python object per tensor."""
        pooled = t.free.pop() if t.free else [_copy(e) for e in t.entries]
        _attach(t, pooled, m.tensors)
        # The pooled list and the template's leaves themselves, not copies: two
        # young lists of 100,000 items fewer per save, each traversed by the
        # collector's next young pass (8-10 ms of held GIL at 100,000 tensors
        # for three such lists). Nothing changes them in place: the job that
        # ends the save leaves lent lists to the planner (Plan.recycle).
        plan = _bound(t, pooled, m.tree, t.bare_leaves, m.buffer_storages)
        plan.shares_tree = m.shares_tree
        plan._give_back = functools.partial(_give_back, t, pooled)
        return plan


def _give_back(t: _Template, pooled: list[Entry]) -> None:
    """Return ``pooled`` to ``t``'s pool, its per-save fields cleared (a pass
    over the entries: call it in a worker thread)."""
    for e in pooled:
        e.source, e.parts, e.digest = None, (), ""
    if len(t.free) < POOLED_ENTRY_SETS:
        t.free.append(pooled)
    else:  # a pool already full: freed a slice at a time, not in one call
        release_in_chunks(pooled)


def _attach(t: _Template, entries: list[Entry], tensors: list[torch.Tensor]) -> None:
    """Point ``entries`` (the template's, bound to one save) at ``tensors``,
    the save's leaf tensors in leaf order."""
    for j, i in t.lone:
        entries[j].source = tensors[i]
    for j, refs in t.blobs:
        e = entries[j]
        parts: list[tuple[int, torch.Tensor]] = []
        for offset, i, start, length in refs:
            src = tensors[i]
            part = torch.empty(0, dtype=torch.uint8, device=src.device).set_(
                src.untyped_storage(), start, (length,), (1,)
            )
            parts.append((offset, part))
        e.parts = tuple(parts)
        e.source = parts[0][1]


def _bound(
    t: _Template,
    entries: list[Entry],
    tree: dict[str, Any],
    leaves: list[TensorLeaf],
    buffer_storages: set[tuple[str, int]],
) -> Plan:
    plan = Plan(
        tree=tree,
        leaves=leaves,
        entries=entries,
        records=t.records,
        buffer_storages=buffer_storages,
        staging_views=t.views,
        _devices=set(t.devices),  # equal signatures: the same devices
    )
    if t.smallest_entry is not None:  # equal signatures: the same entry sizes
        plan.remember_smallest_entry(t.smallest_entry)
    return plan


async def plan_off_loop(
    planner: Planner, state: Any, *, allow_pickle: bool, rank: int, max_files: int
) -> tuple[Plan, list[FileLayout], int]:
    """:meth:`Planner.plan` in a worker thread, so the event loop keeps ticking
    while a large state is flattened and planned; each ``Stateful`` object's
    ``state_dict()`` is called back on the event loop's thread (the caller's
    objects are touched where they were before). The caller's tree must not be
    changed by other tasks while ``save()`` awaits this (as for an eager
    snapshot). A small plain tree of the last save's structure is bound on the
    event loop, with no thread (:meth:`Planner.reuse`)."""
    reused = planner.reuse(state, allow_pickle=allow_pickle, rank=rank, max_files=max_files)
    if reused is not None:
        return reused

    def on_loop(func: Callable[[], Any]) -> Any:
        return anyio.from_thread.run_sync(func)

    return await anyio.to_thread.run_sync(
        functools.partial(
            planner.plan,
            state,
            allow_pickle=allow_pickle,
            rank=rank,
            max_files=max_files,
            call=on_loop,
        )
    )


_PLAIN_SCALARS = frozenset({int, float, str, bool, type(None)})
_PLAIN_CONTAINERS = frozenset({dict, OrderedDict, list, tuple})


def _key(rank: int, max_files: int) -> tuple[int, int, int]:
    """What a template's file layout was made for: the rank, the most files, and
    the bytes per file below which fewer files are written (a template made under
    another threshold is not reused: its files would not be the ones asked for)."""
    return rank, max_files, _format.MIN_FILE_BYTES


def _small_plain_tree(state: Any) -> bool:
    """Whether ``state`` is a tree of at most :data:`INLINE_PLAN_MAX_NODES`
    nodes, each a dict, list or tuple, a tensor (not a lazily conjugated or
    negated view, which flattening copies), or a plain scalar: flattening
    it calls no user code (no ``state_dict()``) and takes microseconds. Looks
    at no more nodes than the limit, however large one container is (a
    recursive tree, too): it runs on the event loop."""
    stack, seen = [state], 0
    while stack:
        obj = stack.pop()
        seen += 1
        if seen > INLINE_PLAN_MAX_NODES:
            return False
        t = type(obj)
        if t is torch.Tensor or t is torch.nn.Parameter:
            if obj.is_conj() or obj.is_neg():  # flattening copies it (resolve_conj)
                return False
            continue
        if t in _PLAIN_SCALARS:
            continue
        if t not in _PLAIN_CONTAINERS:
            return False
        # Counted before they are pushed: the walk stays within the limit
        # however large one container is (a list holding itself 100,000 times).
        meta = getattr(obj, "_metadata", None) if t is OrderedDict else None
        if seen + len(stack) + len(obj) + (meta is not None) > INLINE_PLAN_MAX_NODES:
            return False
        if meta is not None:  # nn.Module.state_dict()'s versions
            stack.append(meta)
        if isinstance(obj, dict):
            stack.extend(obj.values())
        else:
            stack.extend(obj)
    return True


@contextlib.asynccontextmanager
async def admitting(queued: dict[anyio.Event, int], step: int) -> AsyncIterator[None]:
    """Count a save of ``step`` as admitted while it plans (before it is pending):
    a gate in the saver's ``queued``, which a close begun meanwhile waits for,
    set when the save is pending or failed."""
    gate = anyio.Event()
    queued[gate] = step
    try:
        yield
    finally:
        del queued[gate]
        gate.set()
