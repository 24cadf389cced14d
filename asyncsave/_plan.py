"""Plan: flatten a state tree into tensor leaves, storage entries and a JSON tree.

The plan is made in the caller's thread at ``save()`` time (it calls the
``state_dict()`` of ``Stateful`` objects, which touch the caller's objects). Plain
leaves are encoded to JSON right here, so later mutation of the caller's dicts and
lists cannot leak into the checkpoint; tensors are captured by reference and copied
by the stager.

Tensors that share memory are grouped by *region*: tensors on one storage object
(tied weights, views of one buffer) and tensors whose bytes overlap in memory,
whatever storage objects hold them (a NumPy slice, ``torch.frombuffer``,
``torch.from_dlpack``, a storage that starts at the same address as another but is
shorter: https://github.com/huggingface/safetensors/pull/264, transformers PR #23871). A region's
covering byte range is stored once as a "blob" entry and each tensor is recorded as
a view (offset, shape, stride) into it, so they come back as views of one storage,
at the same distances from each other. Tied weights (a region whose tensors are
all one contiguous tensor) are stored as that tensor, dtype and shape kept, under
the first of their keys, so safetensors reads them by name. A tensor alone in its
region is stored as its own contiguous bytes.
"""

from __future__ import annotations

import base64
import dataclasses
import pickle
import sys
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import torch

from ._errors import (
    InvalidKeyError,
    InvalidStateError,
    UnsupportedTensorError,
    UnsupportedTypeError,
)
from ._types import Tagged, gc_paused

__all__ = [
    "Entry",
    "Plan",
    "TensorLeaf",
    "ViewCache",
    "flatten",
    "gc_paused",
    "group_plan",
    "is_stateful",
    "key_str",
    "make_plan",
    "storage_key",
    "tensor_signature",
]

MAX_DEPTH = 256
_QUANTIZED = {torch.qint8, torch.quint8, torch.qint32, torch.quint4x2, torch.quint2x4}
_BLOB_ALIGN = 16  # the largest element size torch has (complex128)
_PLAIN_TENSORS = (torch.Tensor, torch.nn.Parameter)
_UNSET = object()


@dataclasses.dataclass
class TensorLeaf:
    """One tensor leaf of the tree, before grouping."""

    key: str
    tensor: torch.Tensor | None  # dropped once staged (see Plan.release_sources)
    kind: str  # "tensor" | "parameter" | "ndarray"
    requires_grad: bool


@dataclasses.dataclass
class Entry:
    """A run of bytes in a data file: one tensor, or the covering span of a storage
    shared by several tensors (a blob: ``uint8``, or for tied weights the tensor
    they all are, with its dtype and shape).

    ``source`` is what the stager copies from: the tensor itself (copied through a
    same-size integer view, so every dtype is copied bit-exactly), or for a blob a
    ``uint8`` view of the storage span. ``nbytes`` may exceed the source's bytes for
    a blob (zero padding to a multiple of 16, which keeps the next entry aligned).

    ``parts`` (blobs only) says where a blob's bytes come from when that is not just
    ``source`` at offset 0: ``(offset in the entry, 1-D contiguous uint8 tensor)``,
    in offset order, not overlapping. A region of memory held by several storage
    objects has one part per storage, and leading alignment padding; bytes no part
    covers are zeros (see :meth:`segments`). ``source`` is then the first part.
    """

    name: str
    source: torch.Tensor | None  # dropped once staged (see Plan.release_sources)
    nbytes: int
    align: int
    is_blob: bool
    dtype: torch.dtype
    shape: tuple[int, ...]
    # Filled in by the file layout (``_format.layout_files``):
    file: int = -1
    offset: int = -1  # absolute offset in its data file
    staging_offset: int = -1  # offset in the save's staging buffer
    # Filled in by the writer:
    digest: str = ""  # XXH3-64 hex digest of the bytes written
    parts: tuple[tuple[int, torch.Tensor], ...] = ()  # dropped once staged
    # The other keys of tied weights stored under ``name`` (see _shared_entry).
    aliases: tuple[str, ...] = ()

    def segments(self) -> list[tuple[int, int, torch.Tensor | None]]:
        """A blob's bytes ``[0, nbytes)`` as runs ``(start, end, source)``, in
        order, covering every byte once; ``source`` is a ``uint8`` tensor of
        ``end - start`` bytes, or ``None`` for a run of zeros (padding)."""
        parts = self.parts or ((0, self.source),)
        out: list[tuple[int, int, torch.Tensor | None]] = []
        pos = 0
        for offset, src in parts:
            assert src is not None
            if offset > pos:
                out.append((pos, offset, None))
            out.append((offset, offset + src.numel(), src))
            pos = offset + src.numel()
        if pos < self.nbytes:
            out.append((pos, self.nbytes, None))
        return out

    def sources(self) -> list[torch.Tensor]:
        """Every tensor the entry copies from (none once released)."""
        if self.parts:
            return [src for _, src in self.parts]
        return [] if self.source is None else [self.source]


class ViewCache(dict[tuple[int, int], list[torch.Tensor]]):
    """Staging-arena views of a plan structure's entries, keyed by the arena's
    (address, length). The staging pool forgets them (weakly referenced) when it
    frees its arena, so they never keep an old arena alive."""

    __hash__ = object.__hash__  # type: ignore[assignment]  # by identity (a weak set holds them)

    # Whether every entry of the structure is one tensor of a plain dtype
    # (``_stage``: found once, then the views are the copy's destinations).
    all_plain: bool | None = None
    # The structure's host buffer for the early copies of lazy saves
    # (``_stage.EarlyCopies``), made at the structure's second lazy save.
    early: Any = None  # an EarlyCopies (_stage imports this module, not the reverse)

    def __eq__(self, other: object) -> bool:
        return self is other


@dataclasses.dataclass
class Plan:
    """Everything a save needs that is known before any byte is copied.

    ``records[i]`` describes tensor leaf ``i`` (JSON-ready, written to the
    manifest); ``tree`` is the JSON-ready tree whose ``{"type": "tensor"}`` nodes
    refer to leaves by index.
    """

    tree: dict[str, Any]
    leaves: list[TensorLeaf]
    entries: list[Entry]
    records: list[dict[str, Any]]
    # Storages of buffers of nn.Module objects in the tree ((device, data_ptr)):
    # forward may change them (BatchNorm running stats), so lazy saves copy
    # them before save() returns.
    buffer_storages: set[tuple[str, int]] = dataclasses.field(default_factory=set)
    # Typed views of the staging arena per entry, keyed by the arena's (address,
    # length); shared by the plans of one structure (``_replan``), filled by the
    # stager.
    staging_views: ViewCache = dataclasses.field(default_factory=lambda: ViewCache())
    _devices: set[torch.device] | None = dataclasses.field(default=None, repr=False)
    # The entries list and the bytes of its smallest entry, once known (see
    # smallest_entry).
    _smallest: tuple[list[Entry], int] | None = dataclasses.field(default=None, repr=False)
    # Whether ``tree`` shares nodes with the planner's template (a save matched
    # by ``_skeleton``): it must then never be changed or emptied in place.
    shares_tree: bool = False
    # Hands the entries back to the planner that lent them (see recycle).
    _give_back: Callable[[], None] | None = dataclasses.field(default=None, repr=False)
    # Hands the structure's early-copy buffer back (see release_sources).
    release_early: Callable[[], None] | None = dataclasses.field(default=None, repr=False)

    def recycle(self) -> bool:
        """The save is done with its entries (its manifest holds what it needs
        of them): a planner that lent them from its pool (``_replan``) may bind
        them to a later save. Call it at most once, from the thread that ends
        the save's use of the plan, after which ``entries`` is empty. Returns
        whether the entries and leaves lists were the planner's own (lent):
        then the caller must not empty them (``release_in_chunks``), as it
        does its own lists."""
        give_back, self._give_back = self._give_back, None
        self.entries = []
        if give_back is None:
            return False
        give_back()
        return True

    @property
    def nbytes(self) -> int:
        """Staging bytes the save needs (sum of entry sizes)."""
        return sum(e.nbytes for e in self.entries)

    @property
    def devices(self) -> set[torch.device]:
        """The devices of the tensor leaves (kept once computed while the leaves
        are held: a pass over 100,000 leaves is not repeated on the event loop)."""
        if self._devices is None:
            found = {leaf.tensor.device for leaf in self.leaves if leaf.tensor is not None}
            if self.leaves and self.leaves[0].tensor is None:
                return found  # released: not cached
            self._devices = found
        return set(self._devices)

    @property
    def smallest_entry(self) -> int | None:
        """Bytes of the smallest entry, if known for the current ``entries``
        (``None`` once that list is replaced, as incremental saves cut entries
        in chunks): a lazy save whose entries are all large and that holds no
        module buffers copies nothing before ``save()`` returns
        (``_stage.copies_early``)."""
        if self._smallest is None or self._smallest[0] is not self.entries:
            return None
        return self._smallest[1]

    def remember_smallest_entry(self, nbytes: int | None = None) -> int:
        """Keep :attr:`smallest_entry` for the current ``entries``: ``nbytes``
        (a template's, for the same entry sizes) or computed here (a pass over
        the entries: call it off the event loop)."""
        if nbytes is None:
            nbytes = min((e.nbytes for e in self.entries), default=0)
        self._smallest = (self.entries, nbytes)
        return nbytes

    def give_back_early(self) -> None:
        """Hand back the structure's early-copy buffer this save borrowed, if any
        (at most once)."""
        release, self.release_early = self.release_early, None
        if release is not None:
            release()

    def release_sources(self) -> None:
        """Drop every reference to the caller's tensors once they are staged, so
        that their memory (device memory too) is freed when the caller drops them,
        not when the save commits; a lazy save's early copies held in its
        structure's buffer (``_stage.EarlyCopies``) are handed back with them."""
        self.give_back_early()
        for e in self.entries:
            e.source = None
            e.parts = ()
        for leaf in self.leaves:
            leaf.tensor = None


def key_str(path: tuple[Any, ...]) -> str:
    """Human-readable key path, e.g. ``optim/state/0/exp_avg``."""
    return "/".join(map(str, path)) if path else "<root>"


def is_stateful(obj: Any) -> bool:
    """DCP's ``Stateful`` convention: ``state_dict()`` and ``load_state_dict()``."""
    if isinstance(obj, torch.Tensor) or _is_tensordict(obj):
        return False
    return callable(getattr(obj, "state_dict", None)) and callable(
        getattr(obj, "load_state_dict", None)
    )


def _is_tensordict(obj: Any) -> bool:
    # Never import tensordict here: if the caller holds a TensorDict, the module is
    # already imported.
    td = sys.modules.get("tensordict")
    return td is not None and isinstance(obj, td.TensorDictBase)


def make_plan(state: Any, *, allow_pickle: bool) -> Plan:
    """Flatten and validate ``state``, and group its tensors into entries.

    :raises InvalidStateError: (or a subclass) naming the offending key path.
    """
    return group_plan(flatten(state, allow_pickle=allow_pickle))


def flatten(
    state: Any,
    *,
    allow_pickle: bool,
    call: Callable[[Callable[[], Any]], Any] | None = None,
    signature: list[tuple[Any, ...]] | None = None,
    states: dict[int, list[Any]] | None = None,
) -> Plan:
    """Flatten and validate ``state``: a plan with its tree and leaves, no entries
    yet (see :func:`group_plan`).

    :param call: runs each ``Stateful`` object's bound ``state_dict`` and returns
        its result (a planner in a worker thread runs them on the event loop's
        thread); ``None``: called here.
    :param signature: if given, one tuple per tensor leaf is appended to it, in
        leaf order, naming everything a plan depends on (see
        :func:`leaf_signature`), built in the same pass as the leaf.
    :param states: what ``state_dict()`` already returned for this save, by the
        ``id`` of its object, one result (or the exception raised) per occurrence
        in walk order: used instead of calling again
        (``_skeleton.Skeleton.take_states``).
    :raises InvalidStateError: (or a subclass) naming the offending key path.
    """
    # A state of 10,000 tensors makes 100,000s of small objects: the cyclic GC's
    # generation-2 passes over everything alive would cost 5x the plan itself
    # (measured: 330 ms against 65 ms for a 10,000-tensor replay buffer). Nothing
    # here makes cycles, so it is paused for the plan.
    with gc_paused():
        flattener = _Flattener(
            allow_pickle=allow_pickle, call=call, signature=signature, states=states
        )
        tree = flattener.node(state, (), 0)
    return Plan(
        tree=tree,
        leaves=flattener.leaves,
        entries=[],
        records=[],
        buffer_storages=flattener.buffer_storages,
    )


def group_plan(plan: Plan) -> Plan:
    """``plan`` (from :func:`flatten`) with its entries and records filled in.

    :raises UnsupportedTensorError: overlapping tensors no storage holds as views.
    """
    with gc_paused():
        plan.entries, plan.records = _group(plan.leaves)
    return plan


class _Flattener:
    def __init__(
        self,
        *,
        allow_pickle: bool,
        call: Callable[[Callable[[], Any]], Any] | None = None,
        signature: list[tuple[Any, ...]] | None = None,
        states: dict[int, list[Any]] | None = None,
    ) -> None:
        self.allow_pickle = allow_pickle
        self.call = call
        self.signature = signature
        self.states = states or {}
        self.leaves: list[TensorLeaf] = []
        self.buffer_storages: set[tuple[str, int]] = set()
        self._on_path: set[int] = set()

    def node(self, obj: Any, path: tuple[Any, ...], depth: int) -> dict[str, Any]:
        if depth > MAX_DEPTH:
            raise InvalidStateError(
                f"state tree is nested deeper than {MAX_DEPTH} levels at {key_str(path)!r}",
                key=key_str(path),
            )
        t = type(obj)
        if t is torch.Tensor:  # the common leaf first (states of 100,000 tensors)
            return self.tensor(obj, path, "tensor")
        scalar = _scalar_node(obj, t)
        if scalar is not None:
            return scalar
        if isinstance(obj, torch.Tensor):
            return self.tensor(obj, path, "parameter" if t is torch.nn.Parameter else "tensor")
        if _is_numpy_array(obj):
            return self.ndarray(obj, path)
        if _is_numpy_scalar(obj):
            return np_scalar_node(obj)
        if t is Tagged:
            return {
                "type": "tagged",
                "kind": obj.kind,
                "value": self.node(obj.value, path, depth + 1),
            }
        if t in (dict, OrderedDict, list, tuple) or _is_tensordict(obj):
            return self.container(obj, path, depth)
        if is_stateful(obj):
            return self.stateful(obj, path, depth)
        if self.allow_pickle:
            return self.pickled(obj, path)
        raise UnsupportedTypeError(
            f"cannot store a leaf of type {t.__module__}.{t.__qualname__} at key "
            f"{key_str(path)!r}: supported leaves are tensors, TensorDicts, NumPy "
            "arrays and scalars, int, float, str, bool, None, bytes, torch.dtype, "
            "torch.device, torch.Size and objects with state_dict()/load_state_dict(); "
            "convert it, or pass allow_pickle=True to both save and load",
            key=key_str(path),
        )

    def stateful(self, obj: Any, path: tuple[Any, ...], depth: int) -> dict[str, Any]:
        """An object with ``state_dict()``: its class and the tree of its state
        (an ``nn.Module``'s buffers remembered: lazy saves copy them early)."""
        t = type(obj)
        cls = f"{t.__module__}.{t.__qualname__}"
        try:
            # One result per occurrence: an object reached twice was called twice.
            got = self.states.get(id(obj))
            sd = got.pop(0) if got else _UNSET
            if isinstance(sd, Exception):
                raise sd
            if sd is _UNSET:
                sd = obj.state_dict() if self.call is None else self.call(obj.state_dict)
        except Exception as exc:  # the object's own code: name where it failed
            raise InvalidStateError(
                f"{cls}.state_dict() at key {key_str(path)!r} raised {exc!r}",
                key=key_str(path),
            ) from exc
        if isinstance(obj, torch.nn.Module):
            self.buffer_storages.update(_storage_key(b) for b in obj.buffers())
        return {"type": "stateful", "class": cls, "state": self.node(sd, path, depth + 1)}

    def container(self, obj: Any, path: tuple[Any, ...], depth: int) -> dict[str, Any]:
        if id(obj) in self._on_path:
            raise InvalidStateError(
                f"state tree is recursive: the container at {key_str(path)!r} contains itself",
                key=key_str(path),
            )
        self._on_path.add(id(obj))
        try:
            if _is_tensordict(obj):
                return self.tensordict(obj, path, depth)
            if isinstance(obj, dict):
                items = []
                node, tensor = self.node, self.tensor
                # Tensor values (10,000s in a MoE's or a replay buffer's dict) go
                # straight to tensor(), their key made from this dict's once.
                fast = depth + 1 <= MAX_DEPTH
                prefix = key_str(path) + "/" if path else ""
                for k, v in obj.items():
                    key = ["s", k] if type(k) is str else _encode_key(k, path)
                    if fast and type(v) is torch.Tensor:
                        items.append([key, tensor(v, (), "tensor", prefix + str(k))])
                    else:
                        items.append([key, node(v, (*path, k), depth + 1)])
                out: dict[str, Any] = {"type": "dict", "items": items}
                if type(obj) is OrderedDict:
                    out["ordered"] = True
                    # nn.Module.state_dict() versions its submodules here, and
                    # load_state_dict() reads it back (BatchNorm, for one).
                    meta = getattr(obj, "_metadata", None)
                    if meta is not None:
                        out["metadata"] = self.node(meta, (*path, "_metadata"), depth + 1)
                return out
            kind = "list" if type(obj) is list else "tuple"
            return {
                "type": kind,
                "items": [self.node(v, (*path, i), depth + 1) for i, v in enumerate(obj)],
            }
        finally:
            self._on_path.discard(id(obj))

    def tensordict(self, td: Any, path: tuple[Any, ...], depth: int) -> dict[str, Any]:
        if type(td).__name__ != "TensorDict":
            raise UnsupportedTypeError(
                f"{type(td).__name__} at key {key_str(path)!r} is not a plain "
                "TensorDict; convert it with .to_tensordict() first",
                key=key_str(path),
            )
        items = []
        for k in td.keys():
            v = td.get(k)
            sub = (*path, k)
            if type(v).__name__ == "NonTensorData":
                node = {"type": "nontensor", "value": self.node(v.data, sub, depth + 1)}
            else:
                node = self.node(v, sub, depth + 1)
            items.append([k, node])
        names = list(td.names) if td._has_names() else None
        return {
            "type": "tensordict",
            "batch_size": list(td.batch_size),
            "device": None if td.device is None else str(td.device),
            "names": names,
            "items": items,
        }

    def tensor(
        self, t: torch.Tensor, path: tuple[Any, ...], kind: str, key: str | None = None
    ) -> dict[str, Any]:
        if key is None:
            key = key_str(path)
        if not (
            t.layout == torch.strided
            and (t.is_cpu or t.is_cuda)  # not meta, not another device
            and not t.is_quantized
            and t.dtype not in _QUANTIZED
            and not t.is_nested
            and type(t) in _PLAIN_TENSORS
        ):
            self.refuse(t, key)
        requires_grad = t.requires_grad
        # Detached (the plan must not hold an autograd graph); a tensor outside
        # autograd is its own detached view, minus 1-2 us per tensor.
        data = t.detach() if requires_grad else t
        if data.is_conj() or data.is_neg():
            # Lazy conjugate/negative views: their bytes are not their values.
            data = data.resolve_conj().resolve_neg()
        self.leaves.append(TensorLeaf(key, data, kind, requires_grad))
        if self.signature is not None:
            self.signature.append(tensor_signature(key, kind, requires_grad, data))
        return {"type": "tensor", "index": len(self.leaves) - 1}

    def refuse(self, t: torch.Tensor, key: str) -> None:
        """Raise the typed error for a tensor that cannot be stored."""
        if t.layout != torch.strided:
            raise UnsupportedTensorError(
                f"tensor at key {key!r} has layout {t.layout}; only strided (dense) "
                "tensors are stored: call .to_dense() first",
                key=key,
            )
        if t.is_quantized or t.dtype in _QUANTIZED:
            raise UnsupportedTensorError(
                f"tensor at key {key!r} is quantized ({t.dtype}); store its "
                "int_repr() and quantization parameters instead",
                key=key,
            )
        if t.is_meta or t.device.type not in ("cpu", "cuda"):
            raise UnsupportedTensorError(
                f"tensor at key {key!r} is on device {t.device}; only cpu and cuda "
                "tensors have bytes to save",
                key=key,
            )
        if type(t) not in (torch.Tensor, torch.nn.Parameter) or t.is_nested:
            raise UnsupportedTensorError(
                f"tensor at key {key!r} is a {type(t).__name__}; only plain tensors "
                "and nn.Parameter are stored",
                key=key,
            )
        raise AssertionError(f"tensor at key {key!r} refused without a reason")

    def ndarray(self, a: Any, path: tuple[Any, ...]) -> dict[str, Any]:
        try:
            t = torch.from_numpy(a)
        except (TypeError, ValueError) as exc:
            raise UnsupportedTensorError(
                f"NumPy array at key {key_str(path)!r} (dtype {a.dtype}, strides "
                f"{a.strides}) cannot be held by torch: {exc}; pass a native-endian, "
                "positively strided copy (np.ascontiguousarray)",
                key=key_str(path),
            ) from exc
        key = key_str(path)
        self.leaves.append(TensorLeaf(key, t, "ndarray", False))
        if self.signature is not None:
            self.signature.append(tensor_signature(key, "ndarray", False, t))
        return {"type": "tensor", "index": len(self.leaves) - 1}

    def pickled(self, obj: Any, path: tuple[Any, ...]) -> dict[str, Any]:
        try:
            data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as exc:  # pickling errors have no common base
            raise UnsupportedTypeError(
                f"cannot pickle the leaf at key {key_str(path)!r}: {exc}",
                key=key_str(path),
            ) from exc
        t = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        self.leaves.append(TensorLeaf(key_str(path), t, "pickle", False))
        if self.signature is not None:
            # A fresh buffer of its own at every save: named by key and size only.
            self.signature.append((key_str(path), "pickle", len(data)))
        return {"type": "pickle", "index": len(self.leaves) - 1}


def tensor_signature(key: str, kind: str, requires_grad: bool, t: torch.Tensor) -> tuple[Any, ...]:
    """Everything a plan depends on about one tensor leaf: key, kind,
    ``requires_grad``, dtype, shape, strides, device, its storage's address and
    length and its offset in that storage (with the storage's address: the
    tensor's address; ``storage_offset()`` is 4x cheaper to read than
    ``data_ptr()``). Compared as one tuple, in C."""
    s = t.untyped_storage()
    return (
        key,
        kind,
        requires_grad,
        t.dtype,
        t.shape,
        t.stride(),
        t.device,
        t.storage_offset(),
        s.data_ptr(),
        s.nbytes(),
    )


def _encode_key(k: Any, path: tuple[Any, ...]) -> list[Any]:
    if type(k) is str:
        return ["s", k]
    if type(k) is int:
        if -(2**63) <= k < 2**64:
            return ["i", k]
        return ["x", hex(k)]  # past 64 bits: hex has no digit limit
    raise InvalidKeyError(
        f"dict key {k!r} of type {type(k).__name__} under {key_str(path)!r} is not str or int",
        key=key_str((*path, k)),
    )


def _scalar_node(obj: Any, t: type) -> dict[str, Any] | None:
    """The node of a leaf stored as a JSON value (``t`` is ``type(obj)``), or
    ``None``. Exact type checks: a subclass of int or str (an Enum) would not
    come back as itself from JSON."""
    if obj is None:
        return {"type": "none"}
    if t is bool:
        return {"type": "bool", "v": obj}
    if t is int:
        if -(2**63) <= obj < 2**64:
            return {"type": "int", "v": obj}
        # Past 64 bits: hex, which has no digit limit (decimal str() does).
        return {"type": "bigint", "v": hex(obj)}
    if t is float:
        return {"type": "float", "v": obj.hex()}
    if t is str:
        return {"type": "str", "v": obj}
    if t is bytes:
        return {"type": "bytes", "v": base64.b64encode(obj).decode("ascii")}
    if t is torch.dtype:
        return {"type": "dtype", "v": str(obj).removeprefix("torch.")}
    if t is torch.device:
        return {"type": "device", "v": str(obj)}
    if t is torch.Size:
        return {"type": "size", "v": list(obj)}
    return None


def _is_numpy_array(obj: Any) -> bool:
    np = sys.modules.get("numpy")
    return np is not None and type(obj) is np.ndarray


def np_scalar_node(obj: Any) -> dict[str, Any]:
    """The tree node of a NumPy scalar: its dtype and its bytes (so
    ``np.float64(-0.0)`` and ``np.float32(0.1)`` come back exactly)."""
    return {
        "type": "np_scalar",
        "dtype": obj.dtype.str,
        "v": base64.b64encode(obj.tobytes()).decode("ascii"),
    }


def _is_numpy_scalar(obj: Any) -> bool:
    np = sys.modules.get("numpy")
    return np is not None and isinstance(obj, np.generic) and obj.dtype.kind in "biufc"


def storage_key(t: torch.Tensor) -> tuple[str, int]:
    """(device, storage data pointer): tensors with equal keys share a storage's
    first byte (not necessarily a storage: see ``_regions`` for how tensors that
    share memory are grouped)."""
    return (str(t.device), t.untyped_storage().data_ptr())


_storage_key = storage_key


@dataclasses.dataclass(slots=True)
class _Span:
    """The bytes ``[start, end)`` (absolute addresses) of one storage object that
    the tensors ``members`` on it can touch; ``device``: -1 for CPU, else the CUDA
    device index."""

    device: int
    start: int
    end: int
    storage: torch.UntypedStorage
    members: list[int]


def _regions(ts: list[torch.Tensor]) -> list[list[_Span]]:
    """Group the non-empty tensors ``ts`` by the memory they share.

    Tensors on one storage object (same device, address and length) form one span;
    spans whose byte ranges overlap are one region, whatever storage objects hold
    them. Sorting the spans by start address and sweeping once finds the regions
    (O(n log n) for n tensors): a span joins the current region when it starts
    before the region's end. Spans that only touch (one ends where the next starts)
    share no byte and stay apart. Each region's spans come in start order.
    """
    spans: dict[tuple[int, int, int], _Span] = {}
    for i, t in enumerate(ts):
        n = t.numel()
        if n == 0:
            continue
        storage = t.untyped_storage()
        key = (t.get_device(), storage.data_ptr(), storage.nbytes())
        lo = t.data_ptr()  # strides are never negative: the first element is lowest
        size = t.element_size()
        if t.is_contiguous():
            hi = lo + n * size
        else:
            hi = lo + size * (
                1 + sum((d - 1) * s for d, s in zip(t.shape, t.stride(), strict=True))
            )
        span = spans.get(key)
        if span is None:
            spans[key] = _Span(key[0], lo, hi, storage, [i])
        else:
            span.start = min(span.start, lo)
            span.end = max(span.end, hi)
            span.members.append(i)
    regions: list[list[_Span]] = []
    end = 0
    for span in sorted(spans.values(), key=_span_order):
        if regions and regions[-1][0].device == span.device and span.start < end:
            regions[-1].append(span)
            end = max(end, span.end)
        else:
            regions.append([span])
            end = span.end
    return regions


def _span_order(span: _Span) -> tuple[int, int]:
    return span.device, span.start


def _origin(leaves: list[TensorLeaf], ts: list[torch.Tensor], members: list[int], lo: int) -> int:
    """The address where a region's blob starts: at or before ``lo`` (the region's
    first byte), at a distance from every member's first element that is a
    multiple of the member's element size, so each member is a view of one
    ``uint8`` storage and lands aligned when the blob is loaded (blobs start at a
    multiple of 16 bytes in their file). Element sizes are powers of two, so
    checking every member against the widest one is enough.

    :raises UnsupportedTensorError: two members of the region sit at a distance
        that no such address allows (two ``float32`` views one byte apart): torch
        has no storage that holds both as views.
    """
    anchor = max(members, key=lambda i: ts[i].element_size())
    widest = ts[anchor].element_size()  # element sizes are powers of two
    ref = ts[anchor].data_ptr()
    for i in members:
        size = ts[i].element_size()
        if (ts[i].data_ptr() - ref) % size:
            key = leaves[i].key
            raise UnsupportedTensorError(
                f"tensor at key {key!r} ({ts[i].dtype}) shares memory with the tensor at "
                f"key {leaves[anchor].key!r} ({ts[anchor].dtype}) at a distance of "
                f"{ts[i].data_ptr() - ref} bytes, which is not a multiple of its element "
                f"size ({size}): no torch storage can hold both as views; save a .clone() "
                "of one of them",
                key=key,
            )
    return lo - (lo - ref) % widest


def _group(leaves: list[TensorLeaf]) -> tuple[list[Entry], list[dict[str, Any]]]:
    """Turn leaves into entries: one per lone tensor, one blob per shared region.

    :raises UnsupportedTensorError: overlapping tensors that no single storage can
        hold as views (see :func:`_origin`).
    """
    ts: list[torch.Tensor] = []
    for leaf in leaves:
        assert leaf.tensor is not None
        ts.append(leaf.tensor)

    entries: list[Entry] = []
    records: list[dict[str, Any]] = [{} for _ in leaves]
    names: set[str] = set()
    grouped: set[int] = set()
    for region in _regions(ts):
        if len(region) == 1:
            members = region[0].members  # in leaf order already
        else:
            members = sorted(i for span in region for i in span.members)
        lone = ts[members[0]]
        # A lone CUDA view that is not contiguous is staged as the raw span of its
        # storage: gathering it would allocate device memory (https://github.com/Lightning-AI/pytorch-lightning/issues/21630).
        if len(members) < 2 and not (lone.is_cuda and not lone.is_contiguous()):
            continue
        grouped.update(members)
        entry, origin = _shared_entry(leaves, ts, region, members, names)
        entries.append(entry)
        for i in members:
            t = ts[i]
            records[i] = _record(
                leaves[i],
                t,
                entry=len(entries) - 1,
                offset=t.data_ptr() - origin,
                stride=list(t.stride()),
            )
    for i, leaf in enumerate(leaves):
        if i in grouped:
            continue
        t = ts[i]
        entries.append(
            Entry(
                name=_unique(leaf.key, names),
                source=t,
                nbytes=t.numel() * t.element_size(),
                align=t.element_size(),
                is_blob=False,
                dtype=t.dtype,
                shape=tuple(t.shape),
            )
        )
        records[i] = _record(leaf, t, entry=len(entries) - 1, offset=0, stride=None)
    return entries, records


def _shared_entry(
    leaves: list[TensorLeaf],
    ts: list[torch.Tensor],
    region: list[_Span],
    members: list[int],
    names: set[str],
) -> tuple[Entry, int]:
    """The entry of a region of shared memory, and the address where it starts.

    Tied weights (every member the same contiguous tensor: one address, dtype,
    shape and strides) are stored as that tensor, with its dtype and shape, under
    the first of their keys (sorted, as ``safetensors.torch.save_model`` keeps one
    name), so ``safetensors`` alone reads them by name; the other keys are
    ``aliases`` (the header's metadata maps each to the kept name). Any other
    region is a ``uint8`` blob named ``<first key>#storage``.

    :raises UnsupportedTensorError: see :func:`_origin`.
    """
    lo, hi = region[0].start, max(span.end for span in region)
    origin = _origin(leaves, ts, members, lo)
    first = ts[members[0]]
    # One part per storage, each from where the previous one ended: the spans
    # come in start order and each starts before the bytes covered so far end.
    parts: list[tuple[int, torch.Tensor]] = []
    covered = lo
    for span in region:
        if span.end <= covered:
            continue
        base = span.storage.data_ptr()
        part = torch.empty(0, dtype=torch.uint8, device=first.device).set_(
            span.storage, covered - base, (span.end - covered,), (1,)
        )
        parts.append((covered - origin, part))
        covered = span.end
    if _tied(ts, members):
        keys = sorted(leaves[i].key for i in members)
        name = _unique(keys[0], names)
        entry = Entry(
            name=name,
            source=parts[0][1],
            nbytes=hi - origin,  # numel * element size: contiguous, origin = lo
            align=first.element_size(),
            is_blob=True,
            dtype=first.dtype,
            shape=tuple(first.shape),
            parts=tuple(parts),
            # Each other key once, never the kept name itself (two leaves may
            # share a key path: ``{"a/b": w, "a": {"b": w}}``).
            aliases=tuple(k for k in dict.fromkeys(keys[1:]) if k != name),
        )
        return entry, origin
    nbytes = -(-(hi - origin) // _BLOB_ALIGN) * _BLOB_ALIGN
    entry = Entry(
        name=_unique(leaves[members[0]].key + "#storage", names),
        source=parts[0][1],
        nbytes=nbytes,
        align=_BLOB_ALIGN,
        is_blob=True,
        dtype=torch.uint8,
        shape=(nbytes,),
        parts=tuple(parts),
    )
    return entry, origin


def _tied(ts: list[torch.Tensor], members: list[int]) -> bool:
    """Whether the tensors ``members`` of ``ts`` are all one contiguous tensor
    (same address, dtype, shape and strides): tied weights."""
    first = ts[members[0]]
    if not first.is_contiguous():
        return False
    extent = (first.data_ptr(), first.dtype, first.shape, first.stride())
    return all(
        (t.data_ptr(), t.dtype, t.shape, t.stride()) == extent for t in map(ts.__getitem__, members)
    )


def _record(
    leaf: TensorLeaf, t: torch.Tensor, *, entry: int, offset: int, stride: list[int] | None
) -> dict[str, Any]:
    return {
        "key": leaf.key,
        "entry": entry,
        "offset": offset,
        "dtype": str(t.dtype).removeprefix("torch."),
        "shape": list(t.shape),
        "stride": stride,
        "kind": leaf.kind,
        "requires_grad": leaf.requires_grad,
    }


def _unique(name: str, taken: set[str]) -> str:
    candidate, n = name, 1
    while candidate in taken or candidate == "__metadata__":
        n += 1
        candidate = f"{name}#{n}"
    taken.add(candidate)
    return candidate
