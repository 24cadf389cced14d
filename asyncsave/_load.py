"""Load: verify and read checkpoints back into state trees.

Which checkpoint is committed or latest, and its manifest, come from the catalog
(``_catalog``); this module reads the bytes.

Nothing here unpickles unless the caller passes ``allow_pickle=True``; every path
comes from a validated manifest and stays inside the checkpoint directory; every
byte read is checked against its XXH3-64 checksum (``verify=True``, the default).
"""

from __future__ import annotations

import base64
import json
import logging
import math
import os
import pickle
import struct
import warnings
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import xxhash

from ._catalog import read_checkpoint, step_of_name, stored_info
from ._errors import (
    ChecksumMismatchError,
    CorruptCheckpointError,
    InvalidKeyError,
    MissingItemError,
    UnsafeLoadError,
    UnsupportedFormatError,
)
from ._format import SAFETENSORS_DTYPES
from ._fs import LocalFileSystem
from ._fsspec import FsspecFileSystem, open_root
from ._manifest import CHECKSUM, Manifest, record_entries, torch_dtype
from ._plan import key_str
from ._read import read_entries
from ._template import apply_template
from ._types import CheckpointInfo, Tagged, gc_paused

__all__ = ["load", "load_tensors", "verify", "verify_data"]

logger = logging.getLogger(__name__)

_ST_ITEMSIZE = {name: dtype.itemsize for dtype, name in SAFETENSORS_DTYPES.items()}
_READ_CHUNK = 8 << 20


def _check_header(fpath: Path, f: Any, manifest: Manifest, file_index: int) -> None:
    """The safetensors header must be well formed and agree with the manifest.

    Every entry of the header (other than ``__metadata__``, a map of strings) is a
    tensor with a known safetensors dtype and a shape that fills its byte range
    exactly; every manifest entry of this file is there with the manifest's byte
    range. Entries the manifest no longer names are allowed (``update()`` hard-links
    files whose replaced item stays in them, unreferenced). Other tools read the
    file through this header, so a damaged one is refused even though asyncsave
    itself reads through the manifest.
    """
    prefix = f.read(8)
    if len(prefix) != 8:
        raise CorruptCheckpointError(f"{fpath} has no safetensors header", path=fpath)
    (n,) = struct.unpack("<Q", prefix)
    if n > 100 << 20:
        raise CorruptCheckpointError(f"{fpath} claims a {n}-byte header", path=fpath)
    try:
        header = json.loads(f.read(n))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise CorruptCheckpointError(f"{fpath} header is not JSON", path=fpath) from exc
    if not isinstance(header, dict):
        raise CorruptCheckpointError(f"{fpath} header is not an object", path=fpath)
    meta = header.get("__metadata__")
    if meta is not None and not (
        isinstance(meta, dict) and all(isinstance(v, str) for v in meta.values())
    ):
        raise CorruptCheckpointError(f"{fpath}: safetensors __metadata__ is damaged", path=fpath)
    for name, h in header.items():
        if name != "__metadata__" and not _well_formed(h):
            raise CorruptCheckpointError(
                f"{fpath}: safetensors header entry {name!r} is damaged", path=fpath, key=name
            )
    for e in manifest.entries:
        if e["file"] != file_index:
            continue
        h = header.get(e["name"])
        start = e["offset"] - 8 - n
        if not isinstance(h, dict) or h["data_offsets"] != [start, start + e["nbytes"]]:
            raise CorruptCheckpointError(
                f"{fpath}: safetensors header and manifest disagree on {e['name']!r}",
                path=fpath,
                key=e["name"],
            )


def _well_formed(h: Any) -> bool:
    """A safetensors tensor entry: known dtype, shape and byte range that agree."""
    if not isinstance(h, dict) or set(h) != {"dtype", "shape", "data_offsets"}:
        return False
    dtype, shape, offsets = h["dtype"], h["shape"], h["data_offsets"]
    itemsize = _ST_ITEMSIZE.get(dtype) if isinstance(dtype, str) else None
    return (
        itemsize is not None
        and isinstance(shape, list)
        and all(type(d) is int and d >= 0 for d in shape)
        and isinstance(offsets, list)
        and len(offsets) == 2
        and all(type(o) is int and o >= 0 for o in offsets)
        and offsets[1] - offsets[0] == math.prod(shape) * itemsize
    )


def _read_entries(
    fs: LocalFileSystem,
    path: Path,
    manifest: Manifest,
    *,
    verify: bool,
    only: set[int] | None = None,
    progress: Callable[[int], None] | None = None,
) -> list[torch.Tensor | None]:
    """Read entries (``only``: those indices) into fresh ``uint8`` CPU tensors
    through ``fs.open_read``, checking checksums: the path for file systems that
    cannot be memory-mapped (object stores through fsspec). ``progress`` is called
    with each count of bytes read."""
    out: list[torch.Tensor | None] = [None] * len(manifest.entries)
    for fi, finfo in enumerate(manifest.files):
        fpath = path / finfo["name"]
        with fs.open_read(fpath) as f:
            _check_header(fpath, f, manifest, fi)
            for ei, e in enumerate(manifest.entries):
                if e["file"] != fi or (only is not None and ei not in only):
                    continue
                buf = torch.empty(e["nbytes"], dtype=torch.uint8)
                view = memoryview(buf.numpy())  # type: ignore[arg-type]
                f.seek(e["offset"])
                h = xxhash.xxh3_64()
                pos = 0
                while pos < e["nbytes"]:
                    n = f.readinto(view[pos : pos + _READ_CHUNK])
                    if not n:
                        raise CorruptCheckpointError(
                            f"{fpath} ends inside {e['name']!r} (truncated)",
                            path=fpath,
                            key=e["name"],
                            step=manifest.step,
                        )
                    if verify:
                        h.update(view[pos : pos + n])
                    if progress is not None:
                        progress(n)
                    pos += n
                if verify and h.hexdigest() != e[CHECKSUM]:
                    raise ChecksumMismatchError(
                        f"{fpath}: bytes of {e['name']!r} do not match their checksum "
                        f"({h.hexdigest()} != {e[CHECKSUM]})",
                        path=fpath,
                        key=e["name"],
                        step=manifest.step,
                    )
                out[ei] = buf
    return out


def _build_tensors(
    manifest: Manifest,
    raw: list[torch.Tensor | None],
    device: torch.device,
    only: set[int] | None = None,
) -> list[Any]:
    """Tensors of every record (``only``: of those record indices; ``None`` for the
    others) over the entries' bytes in ``raw``."""

    on_device: dict[int, torch.Tensor] = {}
    tensors: list[Any] = []
    for ri, rec in enumerate(manifest.tensors):
        if only is not None and ri not in only:
            tensors.append(None)
            continue
        try:
            tensors.append(_build_tensor(rec, raw, on_device, device))
        except (RuntimeError, TypeError, ValueError) as exc:
            raise CorruptCheckpointError(
                f"cannot rebuild tensor {rec.get('key')!r} ({rec['dtype']} {rec['shape']}, "
                f"{rec['kind']}): {exc}",
                key=rec.get("key") if isinstance(rec.get("key"), str) else None,
                step=manifest.step,
            ) from exc
    return tensors


def _build_tensor(
    rec: dict[str, Any],
    raw: list[torch.Tensor | None],
    on_device: dict[int, torch.Tensor],
    device: torch.device,
) -> Any:
    dtype = torch_dtype(rec["dtype"])
    assert dtype is not None  # validated by parse_manifest
    kind = rec["kind"]
    buf = raw[rec["entry"]]
    assert buf is not None
    if "chunks" in rec:  # row ranges of one tensor (an incremental save): joined
        parts = [raw[j] for j in rec["chunks"]]
        buf = torch.cat([p.to(buf.device) for p in parts if p is not None])
    if kind in ("tensor", "parameter") and buf.device != device:
        if rec["entry"] not in on_device:
            on_device[rec["entry"]] = buf.to(device)
        buf = on_device[rec["entry"]]
    elif kind == "ndarray" and buf.device.type != "cpu":
        buf = buf.cpu()
    if rec["stride"] is None:
        t = buf.view(dtype).view(rec["shape"])
    else:
        # ``buf`` may be a view into a larger storage (a mapped data file): the
        # record's offset is relative to the entry's first byte.
        itemsize = dtype.itemsize
        t = torch.empty(0, dtype=dtype, device=buf.device).set_(
            buf.untyped_storage(),
            (buf.storage_offset() + rec["offset"]) // itemsize,
            rec["shape"],
            rec["stride"],
        )
    if kind == "parameter":
        t = torch.nn.Parameter(t, requires_grad=rec["requires_grad"])
    elif kind == "ndarray":
        t = t.numpy()
    elif rec["requires_grad"]:
        t.requires_grad_(True)
    return t


class _Decoder:
    def __init__(
        self,
        tensors: list[Any],
        records: list[dict[str, Any]],
        *,
        path: Path,
        allow_pickle: bool,
        unpickle: bool = True,
    ) -> None:
        self.tensors = tensors
        self.records = records
        self.path = path
        self.allow_pickle = allow_pickle
        self.unpickle = unpickle  # False: check the tree's shape, run no pickle

    def bad(self, where: tuple[Any, ...], what: str) -> CorruptCheckpointError:
        return CorruptCheckpointError(
            f"damaged manifest tree in {self.path} at {key_str(where)!r}: {what}",
            path=self.path,
            key=key_str(where),
        )

    def index(self, node: dict[str, Any], where: tuple[Any, ...]) -> int:
        i = node.get("index")
        if type(i) is not int or not 0 <= i < len(self.tensors):
            raise self.bad(where, "tensor index out of range")
        return i

    def node(self, node: Any, where: tuple[Any, ...] = ()) -> Any:
        if len(where) > 1000:
            raise self.bad(where, "nested too deep")
        if not isinstance(node, dict) or not isinstance(node.get("type"), str):
            raise self.bad(where, "node is not an object with a type")
        kind, v = node["type"], node.get("v")
        try:
            if kind == "none":
                return None
            if kind == "bool" and type(v) is bool:
                return v
            if kind == "int" and type(v) is int:
                return v
            if kind == "bigint" and type(v) is str and len(v) < 1 << 20:
                return int(v, 16)
            if kind == "float" and type(v) is str:
                return float.fromhex(v)
            if kind == "str" and type(v) is str:
                return v
            if kind == "bytes" and type(v) is str:
                return base64.b64decode(v, validate=True)
            if kind == "dtype" and torch_dtype(v) is not None:
                return torch_dtype(v)
            if kind == "device" and type(v) is str:
                return torch.device(v)
            if kind == "size" and isinstance(v, list) and all(type(n) is int for n in v):
                return torch.Size(v)
            if kind == "np_scalar" and type(v) is str:
                import numpy as np

                return np.frombuffer(
                    base64.b64decode(v, validate=True), dtype=np.dtype(node["dtype"])
                )[0]
        except (ValueError, TypeError, KeyError, IndexError, RuntimeError) as exc:
            raise self.bad(where, f"bad {kind} value") from exc
        if kind == "tensor":
            return self.tensors[self.index(node, where)]
        if kind == "pickle":
            i = self.index(node, where)
            if not self.unpickle:
                return None
            if not self.allow_pickle:
                raise UnsafeLoadError(
                    f"the leaf at {key_str(where)!r} in {self.path} is pickled; pass "
                    "allow_pickle=True to load() only if you trust this checkpoint",
                    path=self.path,
                    key=key_str(where),
                )
            return pickle.loads(self.tensors[i].numpy().tobytes())
        if kind == "dict":
            return self.mapping(node, where)
        if kind in ("list", "tuple"):
            items = node.get("items")
            if not isinstance(items, list):
                raise self.bad(where, f"{kind} without items")
            seq = [self.node(x, (*where, i)) for i, x in enumerate(items)]
            return seq if kind == "list" else tuple(seq)
        if kind == "tagged":
            if not isinstance(node.get("kind"), str) or not node["kind"]:
                raise self.bad(where, "tagged item without a kind")
            return Tagged(self.node(node.get("value"), where), node["kind"])
        if kind == "stateful":
            return self.node(node.get("state"), where)
        if kind == "tensordict":
            return self.tensordict(node, where)
        if kind == "dcp" and not self.unpickle and not where:
            return None  # verify(): a DCP checkpoint's entries are checked, no tree
        raise self.bad(where, f"unknown node type {kind!r}")

    def mapping(self, node: dict[str, Any], where: tuple[Any, ...]) -> Any:
        items = node.get("items")
        if not isinstance(items, list):
            raise self.bad(where, "dict without items")
        out: dict[Any, Any] = OrderedDict() if node.get("ordered") else {}
        for item in items:
            if (
                not isinstance(item, list)
                or len(item) != 2
                or not isinstance(item[0], list)
                or len(item[0]) != 2
                or (item[0][0], type(item[0][1])) not in (("s", str), ("i", int), ("x", str))
            ):
                raise self.bad(where, "malformed dict item")
            key = item[0][1]
            if item[0][0] == "x":
                try:
                    key = int(key, 16)
                except ValueError as exc:
                    raise self.bad(where, "malformed big int key") from exc
            out[key] = self.node(item[1], (*where, key))
        if "metadata" in node:
            if not isinstance(out, OrderedDict):
                raise self.bad(where, "metadata on a plain dict")
            out._metadata = self.node(node["metadata"], (*where, "_metadata"))  # type: ignore[attr-defined]
        return out

    def tensordict(self, node: dict[str, Any], where: tuple[Any, ...]) -> Any:
        from tensordict import TensorDict

        items = node.get("items")
        if not isinstance(items, list) or not all(
            isinstance(i, list) and len(i) == 2 and isinstance(i[0], str) for i in items
        ):
            raise self.bad(where, "tensordict without items")
        try:
            td = TensorDict({}, batch_size=node["batch_size"], device=node.get("device"))
            for key, sub in items:
                if isinstance(sub, dict) and sub.get("type") == "nontensor":
                    td.set_non_tensor(key, self.node(sub.get("value"), (*where, key)))
                else:
                    td.set(key, self.node(sub, (*where, key)))
            if node.get("names") is not None:
                td.names = node["names"]
        except (RuntimeError, ValueError, TypeError, KeyError) as exc:
            raise self.bad(where, f"cannot rebuild the TensorDict: {exc}") from exc
        return td


def _check_required(state: Any, required: Iterable[str | Sequence[Any]], path: Path) -> None:
    missing = []
    for req in required:
        parts: Sequence[Any] = req.split("/") if isinstance(req, str) else req
        node = state
        for p in parts:
            if isinstance(node, Tagged):
                node = node.value
            if isinstance(node, dict) and p not in node and isinstance(p, str):
                # "optim/state/0/exp_avg": a path segment may name an int key
                if p.lstrip("-").isdigit() and int(p) in node:
                    p = int(p)
            if isinstance(node, dict) and p in node:
                node = node[p]
            elif isinstance(node, (list, tuple)) and type(p) is int and 0 <= p < len(node):
                node = node[p]
            else:
                missing.append(key_str(tuple(parts)))
                break
    if missing:
        raise MissingItemError(
            f"checkpoint {path} lacks required item(s) {', '.join(map(repr, missing))}",
            path=path,
            key=missing[0],
        )


def refuse_other_format(manifest: Manifest, path: Path) -> None:
    """The readers of asyncsave's own tree (:func:`load`, :func:`load_tensors`, a
    rank's part) refuse a checkpoint whose files another library wrote, saying
    what reads it.

    :raises UnsupportedFormatError: a DCP (DTensor) or foreign checkpoint.
    """
    if manifest.tree.get("type") == "dcp":
        raise UnsupportedFormatError(
            f"{path} was saved through torch.distributed.checkpoint (DTensor state, or "
            "dcp.save with asyncsave's writer): resume it with "
            "Checkpointer.load_latest(template) where the template holds the model and "
            "optimizer (or their state dicts), or load it with "
            "dcp.load(state, storage_reader=asyncsave.dcp.StorageReader(path)); "
            "`asyncsave inspect` lists its keys",
            path=path,
        )
    if manifest.tree.get("type") == "foreign":
        raise UnsupportedFormatError(
            f"{path} holds files written by {manifest.tree.get('format')!r}, committed by "
            "asyncsave: load it with that library (e.g. megatron.core.dist_checkpointing.load)",
            path=path,
        )


def load(
    path: str | os.PathLike[str],
    template: Any = None,
    *,
    device: str | torch.device = "cpu",
    allow_pickle: bool = False,
    verify: bool = True,
    required: Iterable[str | Sequence[Any]] = (),
    strict: bool = True,
    filesystem: LocalFileSystem | None = None,
    storage_options: Mapping[str, Any] | None = None,
) -> Any:
    """Read the checkpoint at ``path`` back into its state tree.

    Structure and leaf types come back as saved: dicts (``OrderedDict`` with its
    ``_metadata``), lists, tuples, tensors of every dtype with their shapes,
    ``nn.Parameter`` with ``requires_grad``, NumPy arrays and scalars, TensorDicts
    (batch size, device, names), plain leaves, :class:`Tagged` items. Tensors that
    shared a storage at save time share one again. A lone non-contiguous tensor
    comes back contiguous with equal values.

    :param path: a checkpoint directory (``runs/exp1/step_40``), or its URL
        (``s3://bucket/exp1/step_40``, any fsspec URL; see ``storage_options``).
    :param template: optional tree mirroring the saved one. Where it holds an
        object with ``load_state_dict()`` (model, optimizer, dataloader), that
        object is restored in place and returned in the result; a tensor is
        filled in place; a :class:`Tagged` checks the kind. One rule for every
        form (module, optimizer, ``state_dict()``, nested dicts and lists):
        every key the template holds must be in the checkpoint, every saved
        tensor must have a place in the template, a tensor must have the
        template's shape and dtype (an optimizer's per-parameter state: its
        parameter's shape); plain values (numbers, strings, lists without
        tensors, whatever their length) take the saved value; ``None`` takes
        anything. The whole tree is checked before anything changes in place.
    :param strict: ``True`` (the default): a missing or unexpected item is an
        error. ``False``: load what matches, leave the rest of the template as it
        is, and issue one :class:`CheckpointWarning` naming what was not loaded.
        A tensor of another shape or dtype is an error either way.
    :param device: where tensors land (``"cpu"`` default; NumPy leaves stay host).
    :param allow_pickle: unpickle leaves saved with ``allow_pickle=True``. Only for
        checkpoints you trust: unpickling runs code.
    :param verify: check every byte against its XXH3-64 checksum while reading
        (the default). CPU loads are zero-copy: every tensor is a copy-on-write
        view of the memory-mapped data file, so hashing is the only pass over the
        bytes; with ``verify=False`` nothing is read until a tensor is touched.
        ``device="cuda"`` goes through two pinned bounce buffers (see
        ``asyncsave._read``). To read a few tensors of a large checkpoint, use
        :func:`load_tensors`.
    :param required: key paths that must exist: ``"dataloader"``,
        ``"trainer/rng"``, or tuples (``("data/loader",)`` for a key holding ``/``).
    :param filesystem: the I/O layer (default: chosen from ``path``).
    :param storage_options: for a URL ``path``: keyword arguments of its fsspec file
        system (``{"endpoint_url": ...}`` for s3fs); credentials may also come from
        the environment, as the fsspec implementation reads them.
    :raises CheckpointNotFoundError: ``path`` holds no manifest (or, on an object
        store, no commit marker).
    :raises CorruptCheckpointError: damaged manifest, missing/truncated file,
        header disagreeing with the manifest; :class:`ChecksumMismatchError` for
        altered bytes.
    :raises MissingItemError: a required item is absent, or (``strict``) the
        template holds items the checkpoint lacks, and nothing else differs.
    :raises TemplateMismatchError: the checkpoint does not fit the template
        (unexpected items, a tensor of another shape or dtype); raised before
        anything is changed in place, naming every offending key.
    :raises KindMismatchError: a :class:`Tagged` kind differs from the template's.
    :raises UnsafeLoadError: a pickled leaf without ``allow_pickle``.
    """
    fs, p = open_root(path, filesystem=filesystem, storage_options=storage_options, what="path")
    target = _device(device)
    manifest = read_checkpoint(fs, p, expect_step=step_of_name(p))
    refuse_other_format(manifest, p)
    raw = _read(fs, p, manifest, verify=verify, device=target)
    with gc_paused():  # 10,000s of tensors and tree nodes made at once
        tensors = _build_tensors(manifest, raw, target)
        state = _Decoder(tensors, manifest.tensors, path=p, allow_pickle=allow_pickle).node(
            manifest.tree
        )
    _check_required(state, required, p)
    state, note = apply_template(state, template, p, strict=strict)
    if note is not None:
        warnings.warn(note, stacklevel=2)
    return state


def load_tensors(
    path: str | os.PathLike[str],
    keys: Iterable[str],
    *,
    device: str | torch.device = "cpu",
    verify: bool = True,
    filesystem: LocalFileSystem | None = None,
    storage_options: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """Read only some tensors of a checkpoint, without reading the rest of it.

    ``keys`` are key paths as :func:`load` would reach them (``"model/wte.weight"``;
    the separator is ``/``), or a prefix of them (``"optim/state/3"`` gives every
    tensor under it). Only the bytes of the selected tensors are read (and, with
    ``verify``, checked against their checksums); a tensor that shares a storage
    with others brings that storage's bytes.

    :returns: ``{key path: tensor}`` (``nn.Parameter`` and NumPy arrays as saved),
        in the manifest's order.
    :raises MissingItemError: a key that names no tensor of the checkpoint.
    :raises CheckpointNotFoundError: no manifest at ``path``.
    :raises CorruptCheckpointError: (or :class:`ChecksumMismatchError`) the bytes
        read are damaged.

    ``path``, ``filesystem`` and ``storage_options`` as for :func:`load` (on an
    object store only the selected entries' bytes are read too).
    """
    fs, p = open_root(path, filesystem=filesystem, storage_options=storage_options, what="path")
    target = _device(device)
    manifest = read_checkpoint(fs, p, expect_step=step_of_name(p))
    refuse_other_format(manifest, p)
    if isinstance(keys, str):
        raise TypeError("keys must be an iterable of key paths, not one str")
    wanted = list(dict.fromkeys(keys))
    chosen: set[int] = set()
    for k in wanted:
        hit = {
            ri
            for ri, rec in enumerate(manifest.tensors)
            if rec["key"] == k or str(rec["key"]).startswith(k + "/")
        }
        if not hit:
            raise MissingItemError(f"checkpoint {p} has no tensor at {k!r}", path=p, key=k)
        chosen |= hit
    seen: dict[str, int] = {}
    for ri in sorted(chosen):
        key = str(manifest.tensors[ri]["key"])
        if key in seen:
            # {"a/b": x, "a": {"b": y}} flatten to the same path: never guess.
            raise InvalidKeyError(
                f"key path {key!r} names two tensors of {p} (a key holding '/' and a "
                "nested key); load() the whole tree to tell them apart",
                path=p,
                key=key,
            )
        seen[key] = ri
    entries = {j for ri in chosen for j in record_entries(manifest.tensors[ri])}
    raw = _read(fs, p, manifest, verify=verify, device=target, only=entries)
    tensors = _build_tensors(manifest, raw, target, only=chosen)
    return {manifest.tensors[ri]["key"]: tensors[ri] for ri in sorted(chosen)}


def _read(
    fs: LocalFileSystem,
    path: Path,
    manifest: Manifest,
    *,
    verify: bool,
    device: torch.device,
    only: set[int] | None = None,
    progress: Callable[[int], None] | None = None,
) -> list[torch.Tensor | None]:
    """Entries' bytes: memory-mapped (zero-copy; pinned bounce buffers to CUDA)
    for a local directory, streamed through ``fs.open_read`` for an object store
    (the tensors are moved to ``device`` when they are built)."""
    if isinstance(fs, FsspecFileSystem):
        return _read_entries(fs, path, manifest, verify=verify, only=only, progress=progress)
    return read_entries(
        path,
        manifest,
        verify=verify,
        device=device,
        only=only,
        check_header=_check_header,
        progress=progress,
    )


def _device(device: str | torch.device) -> torch.device:
    try:
        target = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ValueError(f"device={device!r} is not a torch device") from exc
    if target.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device={device!r} asked for, but CUDA is not available")
    if target.type not in ("cpu", "cuda"):
        raise ValueError(f"device={device!r}: asyncsave loads to cpu or cuda")
    return target


def verify(
    path: str | os.PathLike[str],
    *,
    filesystem: LocalFileSystem | None = None,
    storage_options: Mapping[str, Any] | None = None,
    progress: Callable[[int], None] | None = None,
) -> CheckpointInfo:
    """Check a checkpoint completely: manifest (and its own checksum), file sizes,
    safetensors headers, the checksum of every byte, and that every tensor and the
    state tree can be rebuilt (pickled leaves are not unpickled). Reads every byte
    once. ``path``, ``filesystem`` and ``storage_options`` as for :func:`load`.

    :param progress: called with each count of bytes just hashed (chunks of at
        most 8 MiB), possibly from several reading threads at once; the counts add
        up to ``CheckpointInfo.nbytes`` once the checkpoint verifies (none for
        another library's files, whose sizes only are checked). The
        ``asyncsave verify`` command feeds a progress bar with it.

    :returns: the checkpoint's :class:`CheckpointInfo`.
    :raises CheckpointNotFoundError: no manifest at ``path``.
    :raises CorruptCheckpointError: (or :class:`ChecksumMismatchError`) naming the
        file and entry that is wrong.
    """
    fs, p = open_root(path, filesystem=filesystem, storage_options=storage_options, what="path")
    manifest = read_checkpoint(fs, p, expect_step=step_of_name(p))
    verify_data(fs, p, manifest, progress)
    return stored_info(fs, p, manifest)


def verify_data(
    fs: LocalFileSystem,
    path: Path,
    manifest: Manifest,
    progress: Callable[[int], None] | None = None,
) -> None:
    """The checks of :func:`verify` after the manifest and the file sizes: every
    checksum, every tensor and the state tree rebuilt (nothing unpickled). Another
    library's files (a ``foreign`` tree) have only their sizes checked.

    :raises CorruptCheckpointError: (or :class:`ChecksumMismatchError`) naming the
        file and entry that is wrong.
    """
    if manifest.tree.get("type") == "foreign":
        return
    raw = _read(fs, path, manifest, verify=True, device=torch.device("cpu"), progress=progress)
    tensors = _build_tensors(manifest, raw, torch.device("cpu"))
    decoder = _Decoder(tensors, manifest.tensors, path=path, allow_pickle=False, unpickle=False)
    decoder.node(manifest.tree)


