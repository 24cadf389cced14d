"""Snapshots in shared memory: the staging slots of the memory tier.

A *slot* is a file in a tmpfs directory (``/dev/shm``) of a fixed capacity,
created by the saver process (``asyncsave._saverproc``) and mapped
``MAP_SHARED`` by both processes (``mmap``, seen by torch through
``torch.frombuffer``): bytes the
trainer copies into it are the saver's bytes at once, and stay there if the
trainer dies. On CUDA hosts the trainer registers its mapping as pinned memory
(``cudaHostRegister``), so device-to-host copies go straight into it.

One save crosses in two parts:

- **the bytes**: every storage the state's tensors use is copied once (the span
  its tensors cover, 64-byte aligned), so tensors that share memory (tied
  weights, views) share it again on the other side;
- **the tree**: the state pickled with each tensor replaced by a reference into
  the slot (``persistent_id``), and each ``Stateful`` object (model, optimizer,
  dataloader) by its ``state_dict()`` taken now. The pickle only travels over the
  private socket between a trainer and the saver it started; nothing of it is
  stored: the saver saves the tree with the ordinary engine (no pickle unless
  ``allow_pickle``) and a restart reads the committed checkpoint, never a pickle.

The layout (where each storage goes in the slot, the tensor references) is
made once and reused by every later save whose tensors have the same
signatures (``_skeleton.tensor_signatures``: a list comprehension, not a
Python pass per tensor); it holds nothing of the caller's, so a dropped model
is freed. A storage holding exactly one contiguous tensor of a plain dtype is
copied as that tensor (one ``torch._foreach_copy_`` for all of them), others
through a byte view of their storage made at each save. The tree's references
and spans cross the socket once per layout (the saver keeps the last ones).

The pickle is the transport, not the format: a leaf asyncsave cannot store is
refused by the saver's ``save()`` (typed, naming the key), and its error is
raised by the trainer's ``save()``.
"""

from __future__ import annotations

import dataclasses
import io
import mmap
import os
import pickle
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import torch

from ._errors import InvalidStateError, UnsupportedTensorError
from ._plan import is_stateful
from ._skeleton import same_signature, tensor_signatures
from ._stage import PLAIN_DTYPES

__all__ = ["Layout", "Packed", "Slot", "copy_into", "pack", "unpack"]

_ALIGN = 64


def _aligned(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


class TensorRef(NamedTuple):
    """Where one tensor of the tree lies in a slot: a view of ``dtype`` into
    span ``span`` (one storage of the state) at element ``offset`` (of its
    dtype) with ``shape`` and ``stride``."""

    span: int
    offset: int
    dtype: torch.dtype
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    parameter: bool
    requires_grad: bool


@dataclasses.dataclass
class Layout:
    """Where a state's bytes go in a slot, reusable by every later save whose
    tensors have the same signatures; it holds nothing of the caller's (no
    tensor, no storage), so a dropped model is freed.

    ``refs`` (one per tensor reference in the tree), ``spans`` (slot offset,
    bytes) per storage, and the copies into the slot: ``copies[i]`` is
    ``(slot offset, tensor index, byte offset in its storage, bytes)``, with
    ``whole[i]`` when the copy is exactly that tensor (contiguous, of a plain
    dtype, from its first byte: copied as the tensor itself, no byte view)."""

    refs: list[TensorRef]
    spans: list[tuple[int, int]]
    nbytes: int
    copies: list[tuple[int, int, int, int]]
    whole: list[bool]
    host_only: bool  # every source is a CPU tensor
    #: The tensors' signatures (``_skeleton.tensor_signatures``), or ``None``
    #: when the layout cannot be reused (a conjugate or negative view is
    #: resolved into a copy at each save).
    signatures: list[Any] | None
    #: The destination views of each slot copied into, by ``id`` of the slot
    #: (kept with the slot, so the id stays its own).
    dsts: dict[int, tuple[Slot, list[torch.Tensor]]] = dataclasses.field(default_factory=dict)

    def destinations(self, slot: Slot, sources: list[torch.Tensor]) -> list[torch.Tensor]:
        """The views of ``slot`` the copies go to (made once per slot)."""
        known = self.dsts.get(id(slot))
        if known is not None and known[0] is slot:
            return known[1]
        dsts = []
        for (at, _, _, n), whole, src in zip(self.copies, self.whole, sources, strict=True):
            d = slot.buffer[at : at + n]
            dsts.append(d.view(src.dtype).view(src.shape) if whole else d)
        self.dsts[id(slot)] = (slot, dsts)
        return dsts


@dataclasses.dataclass
class Packed:
    """One state, ready to cross: ``tree`` (the pickle, without its
    ``numbers``: the int, float and bool leaves, in pickling order), its
    ``layout``, and this save's ``sources`` (one per copy of the layout: the
    caller's tensor itself, or a byte view of its storage)."""

    tree: bytes
    numbers: list[Any]
    layout: Layout
    sources: list[torch.Tensor]

    def structure(self) -> tuple[Any, ...]:
        """What the saver's ``save()`` decides on: the tree, the types of its
        numbers, the tensors' layout (equal structures: it cannot refuse one
        it accepted)."""
        return (self.tree, list(map(type, self.numbers)), self.layout.refs, self.layout.spans)

    @property
    def nbytes(self) -> int:
        return self.layout.nbytes


class Slot:
    """One slot file, mapped shared: ``view`` is a memoryview of the mapping and
    ``buffer`` a ``uint8`` CPU tensor of ``capacity`` bytes over it. The mapping
    lives as long as any tensor made over it.

    :param path: the file (created by the saver, at its full size).
    :param capacity: its size in bytes.
    :param pin: register the mapping as pinned memory (CUDA hosts).
    """

    def __init__(self, path: Path, capacity: int, *, pin: bool = False) -> None:
        self.path = path
        self.capacity = capacity
        fd = os.open(path, os.O_RDWR)
        try:
            self.map = mmap.mmap(fd, capacity, mmap.MAP_SHARED) if capacity else None
        finally:
            os.close(fd)
        view = memoryview(self.map) if self.map is not None else memoryview(bytearray())
        self.view = view
        self.buffer = (
            torch.frombuffer(view, dtype=torch.uint8)
            if capacity
            else torch.empty(0, dtype=torch.uint8)
        )
        self.pinned = False
        if pin and torch.cuda.is_available() and capacity:
            err = torch.cuda.cudart().cudaHostRegister(self.buffer.data_ptr(), capacity, 0)
            self.pinned = int(err) == 0

    def close(self) -> None:
        """Unregister the mapping (the pages go with the last tensor over it)."""
        if self.pinned:
            torch.cuda.cudart().cudaHostUnregister(self.buffer.data_ptr())
            self.pinned = False

    @staticmethod
    def create(path: Path, capacity: int) -> None:
        """Make the slot file ``path`` of ``capacity`` bytes (saver side), its
        pages reserved now (``posix_fallocate``) so that a full ``/dev/shm`` is an
        ``OSError`` here, never a ``SIGBUS`` in the middle of a copy."""
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            if capacity:
                os.posix_fallocate(fd, 0, capacity)
        finally:
            os.close(fd)


#: Leaves that change from save to save (a step, a counter, a learning rate)
#: without changing what the saver's ``save()`` can refuse: taken out of the
#: tree's pickle, so that the tree of an unchanged structure is the same bytes.
_NUMBERS = frozenset({int, float, bool})


class _Pickler(pickle.Pickler):
    def __init__(self, file: Any, call: Callable[[Callable[[], Any]], Any] | None) -> None:
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self.tensors: list[torch.Tensor] = []
        self.numbers: list[Any] = []
        self.call = call

    def persistent_id(self, obj: Any) -> Any:
        # Tensors by their index (>= 0), numbers by ~index (< 0).
        if type(obj) in _NUMBERS:
            self.numbers.append(obj)
            return ~(len(self.numbers) - 1)
        if isinstance(obj, torch.Tensor):
            self.tensors.append(obj)
            return len(self.tensors) - 1
        return None

    def reducer_override(self, obj: Any) -> Any:
        if not isinstance(obj, type) and is_stateful(obj):
            sd = obj.state_dict() if self.call is None else self.call(obj.state_dict)
            return (_same, (sd,))
        return NotImplemented


def _same(x: Any) -> Any:
    return x


def _refuse(t: torch.Tensor, i: int) -> UnsupportedTensorError:
    if type(t).__name__ == "DTensor":
        return UnsupportedTensorError(
            f"tensor #{i} of the state is a DTensor: a memory tier takes per-rank state "
            "(DTensor state goes through DCP's planner in the trainer's process group; "
            "save it without memory=)"
        )
    return UnsupportedTensorError(
        f"tensor #{i} of the state ({t.layout}, device {t.device}) is not a dense "
        "strided tensor; a memory tier stores dense tensors"
    )


def pack(
    state: Any,
    *,
    call: Callable[[Callable[[], Any]], Any] | None = None,
    last: Layout | None = None,
) -> Packed:
    """Pickle ``state`` with its tensors as slot references (see the module
    docstring). Run in a worker thread with ``call`` running each ``Stateful``
    object's ``state_dict()`` back on the caller's thread (the event loop's), as
    the core engine's planner does.

    When the tensors' signatures (type, dtype, shape, strides, device, storage
    offset, the storage's address and length: ``_skeleton.tensor_signatures``,
    about 1.5 us a tensor) equal ``last``'s, its layout is reused: the same
    sharing of storages, the same spans; only the byte views of the copies that
    are not whole tensors are made again. Otherwise one pass of Python per
    tensor (a dozen attribute reads, about 12 us a tensor): the state of a
    mixture of experts holds 100,000 of them.

    :raises InvalidStateError: an object that cannot be pickled (a lambda, a
        lock, a generator), named by its type.
    :raises UnsupportedTensorError: a DTensor, a sparse, quantized, nested or meta
        tensor.
    """
    buf = io.BytesIO()
    p = _Pickler(buf, call)
    try:
        p.dump(state)
    except (pickle.PicklingError, TypeError, AttributeError) as exc:
        raise InvalidStateError(
            f"the state cannot be handed to the memory tier's saver process: {exc}"
        ) from exc
    tensors = p.tensors
    try:
        signatures: list[Any] | None = tensor_signatures(tensors)
    except Exception:  # no strides or storage: refused below, typed
        signatures = None
    if (
        last is not None
        and signatures is not None
        and last.signatures is not None
        and same_signature(last.signatures, signatures)
    ):
        return Packed(buf.getvalue(), p.numbers, last, _sources(last, tensors))
    layout = _layout(tensors, signatures)
    return Packed(buf.getvalue(), p.numbers, layout, _sources(layout, tensors))


def _sources(layout: Layout, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """This save's source of each copy of ``layout``."""
    out = []
    for (_, ti, lo, n), whole in zip(layout.copies, layout.whole, strict=True):
        t = tensors[ti]
        if whole:
            out.append(t)  # copied under no_grad
            continue
        if t.is_conj() or t.is_neg():  # never reused: see Layout.signatures
            t = t.resolve_conj().resolve_neg()
        src = torch.empty(0, dtype=torch.uint8, device=t.device)
        out.append(src.set_(t.untyped_storage(), lo, (n,), (1,)))
    return out


def _layout(tensors: list[torch.Tensor], signatures: list[Any] | None) -> Layout:
    strided, parameter = torch.strided, torch.nn.Parameter
    spans: dict[
        Any, list[Any]
    ] = {}  # (device, storage pointer) -> [lo, hi, tensor index, span, count]
    metas = []
    for i, t in enumerate(tensors):
        if t.layout != strided or t.is_quantized or t.is_nested or type(t).__name__ == "DTensor":
            raise _refuse(t, i)
        device = t.device
        if device.type == "meta":
            raise _refuse(t, i)
        if t.is_conj() or t.is_neg():
            t = t.resolve_conj().resolve_neg()
            signatures = None  # a copy, made again at every save
        storage = t.untyped_storage()
        key = (device, storage.data_ptr())
        isz = t.element_size()
        lo = t.storage_offset() * isz
        shape, stride = t.shape, t.stride()
        if t.numel() == 0:
            hi = lo
        else:
            hi = lo + isz * (1 + sum((n - 1) * st for n, st in zip(shape, stride, strict=True)))
        span = spans.get(key)
        if span is None:
            spans[key] = [lo, hi, i, 0, 1]
        else:
            span[4] += 1
            if lo < span[0]:
                span[0] = lo
            if hi > span[1]:
                span[1] = hi
        metas.append(
            (key, lo, isz, t.dtype, tuple(shape), stride, isinstance(t, parameter), t.requires_grad)
        )
    placed: list[tuple[int, int]] = []  # (slot offset, bytes) per span
    copies: list[tuple[int, int, int, int]] = []
    whole: list[bool] = []
    at = 0
    for span in spans.values():
        start = span[0]
        lo = span[0] = start - start % _ALIGN
        span[3] = len(placed)
        n = span[1] - lo
        placed.append((at, n))
        if n:
            ti = span[2]
            t = tensors[ti]
            copies.append((at, ti, lo, n))
            whole.append(
                span[4] == 1
                and start == lo
                and t.dtype in PLAIN_DTYPES
                and not (t.is_conj() or t.is_neg())
                and t.is_contiguous()
                and t.numel() * t.element_size() == n
            )
        at = _aligned(at + n)
    refs = [
        TensorRef(span[3], (lo - span[0]) // isz, dtype, shape, stride, param, rg)
        for key, lo, isz, dtype, shape, stride, param, rg in metas
        for span in (spans[key],)
    ]
    host_only = all(key[0].type == "cpu" for key in spans)
    return Layout(refs, placed, at, copies, whole, host_only, signatures)


def copy_into(packed: Packed, slot: Slot) -> None:
    """Copy ``packed``'s bytes into ``slot`` (a worker thread). CPU sources in one
    ``torch._foreach_copy_``; CUDA sources as non-blocking copies on a side
    stream, then waited for (the mapping is pinned on CUDA hosts).

    :raises ValueError: the slot is smaller than the state.
    """
    if packed.nbytes > slot.capacity:
        raise ValueError(
            f"a state of {packed.nbytes} bytes does not fit a {slot.capacity}-byte slot"
        )
    dsts = packed.layout.destinations(slot, packed.sources)
    with torch.no_grad():  # a source may be a parameter: no graph for the copies
        if packed.layout.host_only:
            if dsts:
                torch._foreach_copy_(dsts, packed.sources)
        else:
            _copy(dsts, packed.sources)


def _copy(dsts: list[torch.Tensor], sources: list[torch.Tensor]) -> None:
    cpu = [(d, s) for d, s in zip(dsts, sources, strict=True) if s.device.type == "cpu"]
    other = [(d, s) for d, s in zip(dsts, sources, strict=True) if s.device.type != "cpu"]
    if cpu:
        torch._foreach_copy_([d for d, _ in cpu], [s for _, s in cpu])
    if other:
        streams: dict[torch.device, Any] = {}
        for d, s in other:
            stream = streams.get(s.device)
            if stream is None:
                stream = streams[s.device] = torch.cuda.Stream(s.device)
                stream.wait_stream(torch.cuda.current_stream(s.device))
            with torch.cuda.stream(stream):
                d.copy_(s, non_blocking=True)
        for stream in streams.values():
            stream.synchronize()


class _Unpickler(pickle.Unpickler):
    def __init__(
        self, file: Any, numbers: list[Any], refs: list[TensorRef], storages: list[Any]
    ) -> None:
        super().__init__(file)
        self.numbers = numbers
        self.refs = refs
        self.storages = storages

    def persistent_load(self, pid: Any) -> Any:
        if pid < 0:
            return self.numbers[~pid]
        r = self.refs[pid]
        storage = self.storages[r.span]
        t = torch.empty(0, dtype=r.dtype).set_(storage, r.offset, r.shape, r.stride)
        if r.parameter:
            return torch.nn.Parameter(t, requires_grad=r.requires_grad)
        return t.requires_grad_(r.requires_grad) if r.requires_grad else t


def unpack(
    tree: bytes, numbers: list[Any], refs: list[TensorRef], spans: list[tuple[int, int]], slot: Slot
) -> Any:
    """The state ``pack`` made, its tensors views into ``slot`` (saver side):
    one storage per storage of the trainer's state (``torch.frombuffer`` over
    its span of the mapping, no copy), so that tensors share memory exactly as
    they did, no more.

    :raises InvalidStateError: the tree names a class this process cannot import
        (one defined in the trainer's ``__main__``, say).
    """
    storages = [
        torch.frombuffer(slot.view[o : o + n], dtype=torch.uint8).untyped_storage()
        if n
        else torch.UntypedStorage(0)
        for o, n in spans
    ]
    try:
        return _Unpickler(io.BytesIO(tree), numbers, refs, storages).load()
    except (AttributeError, ImportError, ModuleNotFoundError) as exc:
        raise InvalidStateError(
            f"the memory tier's saver process cannot rebuild the state: {exc} (a class "
            "defined in the training script's __main__ cannot be imported by another "
            "process: define it in a module)"
        ) from exc
