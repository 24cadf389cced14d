"""Load: resolve, verify and read checkpoints back into state trees.

Nothing here unpickles unless the caller passes ``allow_pickle=True``; every path
comes from a validated manifest and stays inside the checkpoint directory; every
byte read is checked against its XXH3-64 checksum (``verify=True``, the default).
"""

from __future__ import annotations

import base64
import dataclasses
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

from ._atomicity import strategy_for
from ._errors import (
    CheckpointNotFoundError,
    ChecksumMismatchError,
    CorruptCheckpointError,
    InvalidKeyError,
    MissingItemError,
    UncommittedCheckpointError,
    UnsafeLoadError,
    UnsupportedFormatError,
)
from ._format import SAFETENSORS_DTYPES
from ._fs import LocalFileSystem
from ._fsspec import FsspecFileSystem, open_root
from ._manifest import CHECKSUM, FORMAT, Manifest, parse_manifest, record_entries, torch_dtype
from ._paths import COMMIT_MARKER_NAME, LAYOUTS, MANIFEST_NAME, Layout, aside_dir_step
from ._plan import key_str
from ._read import read_entries
from ._template import apply_template
from ._track import read_tracker
from ._types import CheckpointInfo, Tagged, gc_paused

__all__ = [
    "latest",
    "load",
    "load_tensors",
    "read_checkpoint",
    "resolve",
    "scan_steps",
    "verify",
]

logger = logging.getLogger(__name__)

_MAX_MANIFEST_BYTES = 1 << 30
_ST_ITEMSIZE = {name: dtype.itemsize for dtype, name in SAFETENSORS_DTYPES.items()}
_READ_CHUNK = 8 << 20


def read_checkpoint(
    fs: LocalFileSystem,
    path: Path,
    *,
    expect_step: int | None = None,
    progress: Callable[[int, int], None] | None = None,
    uncommitted: bool = False,
) -> Manifest:
    """Read and validate the manifest of the checkpoint at ``path`` and check that
    every data file has the size the manifest says (no data is read).

    :param expect_step: the step the directory's name says; a manifest of another
        step (a copied or renamed directory) is refused.
    :param progress: called with ``(files checked, data files in all)`` after each
        data file's size is checked (one request each on an object store).
    :param uncommitted: read it even without its commit marker (object stores):
        to decide whether it can be adopted (``_commit.adopt_checkpoint``).
    :raises UncommittedCheckpointError: (object stores) no commit marker, unless
        ``uncommitted``.
    :raises CheckpointNotFoundError: ``path`` has no ``manifest.json`` (the message
        says where it went if it was moved aside at open).
    :raises CorruptCheckpointError: the manifest is damaged or a file is missing,
        truncated or too long.
    """
    if not uncommitted and not strategy_for(fs).passed_commit(fs, path):
        if not fs.exists(path):
            raise _no_manifest_error(fs, path)
        raise _uncommitted_error(fs, path)
    mpath = path / MANIFEST_NAME
    try:
        size = fs.size(mpath)
        if size > _MAX_MANIFEST_BYTES:
            raise CorruptCheckpointError(f"manifest {mpath} is {size} bytes", path=mpath)
        raw = fs.read_bytes(mpath)
    except (FileNotFoundError, NotADirectoryError) as exc:
        raise _no_manifest_error(fs, path) from exc
    except IsADirectoryError as exc:
        raise CorruptCheckpointError(f"{mpath} is a directory", path=mpath) from exc
    manifest = parse_manifest(raw, mpath)
    if expect_step is not None and manifest.step != expect_step:
        raise CorruptCheckpointError(
            f"{path} holds the manifest of step {manifest.step}, not {expect_step} "
            "(a copied or renamed directory?)",
            path=path,
            step=manifest.step,
        )
    for done, f in enumerate(manifest.files, 1):
        fpath = path / f["name"]
        try:
            actual = fs.size(fpath)
        except FileNotFoundError as exc:
            raise CorruptCheckpointError(
                f"data file {fpath} is missing", path=fpath, step=manifest.step
            ) from exc
        if actual != f["nbytes"]:
            raise CorruptCheckpointError(
                f"data file {fpath} is {actual} bytes, the manifest says {f['nbytes']} "
                "(truncated or altered)",
                path=fpath,
                step=manifest.step,
            )
        if progress is not None:
            progress(done, len(manifest.files))
    return manifest


def _uncommitted_error(fs: LocalFileSystem, path: Path) -> UncommittedCheckpointError:
    """Why a final-named prefix without its commit marker is not counted, and how to
    adopt it (object stores)."""
    there = fs.exists(path / MANIFEST_NAME)
    found = "its files and manifest are there" if there else "it has no manifest either"
    return UncommittedCheckpointError(
        f"{path} is not a committed checkpoint: it has no {COMMIT_MARKER_NAME} ({found}): "
        "a save in flight or one that never committed, or a checkpoint copied there by "
        "a sync tool (aws s3 sync, gsutil rsync, rclone copy no commit marker). Nothing "
        f"was deleted. Once no one writes there, `asyncsave adopt {path}` (or "
        "asyncsave.adopt(path)) verifies every byte and commits it; a Checkpointer "
        "opened on the root adopts it the same way, or moves it aside if it does not "
        "verify",
        path=path,
        step=step_of_name(path),
    )


def _no_manifest_error(fs: LocalFileSystem, path: Path) -> CheckpointNotFoundError:
    """``path`` holds no manifest: say where it went if it was moved aside at open
    (a damaged or incomplete checkpoint keeps its bytes under an aside name)."""
    step = step_of_name(path)
    if step is not None and not fs.lexists(path):
        asides = moved_aside(fs, path.parent, step)
        if asides:
            shown = ", ".join(str(a) for a in asides)
            return CheckpointNotFoundError(
                f"{path} does not exist: it was moved aside at open to {shown} by a "
                f"Checkpointer opened on {path.parent} (it did not check out: a file "
                "missing or of the wrong size, a damaged manifest, or no manifest; the "
                "WARNING of that open says which), its bytes kept for inspection; "
                f"`asyncsave verify {asides[-1]}` says what is wrong with it",
                path=path,
                step=step,
            )
    return CheckpointNotFoundError(
        f"{path} is not a checkpoint: it has no {MANIFEST_NAME}", path=path, step=step
    )


def moved_aside(fs: LocalFileSystem, root: Path, step: int) -> list[Path]:
    """The entries under ``root`` that recovery moved aside for ``step``
    (``.asyncsave-damaged-<step>-*``, ``.asyncsave-incomplete-<step>-*``)."""
    try:
        names = fs.listdir(root) if fs.is_dir(root) else []
    except OSError:
        return []
    return [root / n for n in sorted(names) if aside_dir_step(n) == step]


def check_not_one_checkpoint(fs: LocalFileSystem, root: Path) -> None:
    """Refuse a root of checkpoints that is itself one checkpoint (it holds an
    asyncsave ``manifest.json``: ``latest(root).path`` passed back as a root). A saver
    there would resume nothing and nest a root inside a committed checkpoint; a
    reader would find no step.

    :raises CheckpointNotFoundError: naming the checkpoint and its root.
    """
    if not (fs.is_dir(root) and fs.exists(root / MANIFEST_NAME)):
        return
    try:  # asyncsave's own manifest only: another tool's manifest.json is no checkpoint
        with fs.open_read(root / MANIFEST_NAME) as f:
            head = f.read(64)
    except OSError:
        return
    if head.startswith(b'{"format":"%s"' % FORMAT.encode()):
        raise CheckpointNotFoundError(
            f"{root} is one checkpoint (it holds {MANIFEST_NAME}), not a root of "
            f"checkpoints: its root is {root.parent}; asyncsave.load({str(root)!r}) "
            "reads it",
            path=root,
        )


def scan_steps(fs: LocalFileSystem, root: Path, layout: Layout) -> dict[int, Path]:
    """Final-named directories under ``root`` by step (not checked for content)."""
    found: dict[int, Path] = {}
    for name in fs.listdir(root):
        step = layout.parse_dir_name(name)
        if step is not None and fs.is_dir(root / name):
            found[step] = root / name
    return found


def stored_info(fs: LocalFileSystem, path: Path, manifest: Manifest) -> CheckpointInfo:
    """:func:`info_of` plus what the checkpoint takes in storage: ``size_bytes``
    (data files and manifest, plus a layout's info file such as the ``nemo-rl``
    ``training_info.json`` and an object store's commit marker, where present) and
    ``saved_unix_s`` (when its manifest was written). One home for every reader
    (:func:`latest`, :func:`verify`, :func:`asyncsave.checkpoints`).

    :raises FileNotFoundError: a file went away meanwhile (retention, prune).
    """
    size = sum(int(f["nbytes"]) for f in manifest.files) + fs.size(path / MANIFEST_NAME)
    extras = {lay.info_name for lay in LAYOUTS.values() if lay.info_name is not None}
    extras.update(strategy_for(fs).protocol_files)
    for extra in sorted(extras):
        if fs.exists(path / extra):
            size += fs.size(path / extra)
    return dataclasses.replace(
        info_of(path, manifest), size_bytes=size, saved_unix_s=manifest.created_unix_s
    )


def info_of(path: Path, manifest: Manifest) -> CheckpointInfo:
    costs = manifest.costs
    return CheckpointInfo(
        step=manifest.step,
        path=path,
        nbytes=manifest.nbytes,
        num_tensors=len(manifest.tensors),
        world_size=manifest.world_size,
        blocked_s=costs.get("blocked_s"),
        staged_s=costs.get("staged_s"),
        written_s=costs.get("written_s"),
        training_info=manifest.training_info,
    )


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
    manifest = read_checkpoint(fs, p, expect_step=_step_of_name(p))
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
    manifest = read_checkpoint(fs, p, expect_step=_step_of_name(p))
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


def step_of_name(path: Path) -> int | None:
    """The step a directory's name claims under any layout preset (``step_40``,
    ``global_step_40``, ``iter_0000040``): a copied or swapped directory must not
    load as another step silently."""
    for layout in LAYOUTS.values():
        step = layout.parse_dir_name(path.name)
        if step is not None:
            return step
    return None


_step_of_name = step_of_name


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


def resolve(
    fs: LocalFileSystem, root: Path, layout: Layout, *, fallback: bool, reader: bool = False
) -> CheckpointInfo | None:
    """The checkpoint to resume from: the one the tracker names, or a newer
    committed one.

    The rename is the commit, the tracker follows it: a committed checkpoint newer
    than the tracker (a crash between the two) wins, with a warning, which is also
    what the next :class:`~asyncsave.Checkpointer` open writes into the tracker. A
    missing or unreadable tracker falls back to the newest committed checkpoint,
    with a warning. A tracker naming a checkpoint that is missing or damaged is an
    error unless ``fallback`` (then: warning, newest committed checkpoint). Never
    ``None`` when a tracker names a step, nor when the only checkpoints there are
    uncommitted copies with a manifest (object stores: see
    :class:`UncommittedCheckpointError`): that would restart a trained run from
    scratch. Every final-named entry passed over is logged with the reason.

    ``reader``: called by a reader (:func:`latest`), which may run while a saver
    is between its rename and its tracker write: a committed step newer than the
    tracker (one step ahead of it), or no tracker beside the only committed step,
    is then logged at INFO (the saver's next open repairs a real crash and warns
    there); anything more is a warning, as for a saver.
    """
    if not fs.exists(root):
        return None
    if not fs.is_dir(root):
        raise CheckpointNotFoundError(f"{root} is not a directory", path=root)
    check_not_one_checkpoint(fs, root)
    tracked: int | None = None
    if layout.tracker_name is not None:
        tracker = root / layout.tracker_name
        try:
            tracked = read_tracker(fs, tracker)
        except CorruptCheckpointError as exc:
            logger.warning("%s; scanning for committed checkpoints instead", exc)
    found = scan_steps(fs, root, layout)
    if tracked is not None:
        info = _resolve_tracked(fs, root, layout, found, tracked, fallback=fallback, reader=reader)
        if info is not None:
            return info
    info = _newest_counted(fs, root, layout, found, reader=reader)
    if info is not None:
        return info
    if tracked is not None:
        raise CheckpointNotFoundError(
            f"the tracker in {root} names step {tracked} but no checkpoint there is "
            "loadable (damaged ones are moved aside to .asyncsave-damaged-*); not "
            f"starting from scratch{_layout_hint(fs, root, layout)}",
            path=root,
            step=tracked,
        )
    hint = _layout_hint(fs, root, layout)
    if hint:
        # Another preset's checkpoints are here: None would restart a trained run.
        raise CheckpointNotFoundError(
            f"no {layout.name!r}-layout checkpoint in {root}{hint}", path=root
        )
    _refuse_uncommitted_copies(fs, root, found)
    return None


def _counted(fs: LocalFileSystem, path: Path, step: int) -> CheckpointInfo:
    """The info of the committed checkpoint of ``step`` at ``path``.

    :raises CheckpointNotFoundError: (or :class:`UncommittedCheckpointError`) it is
        not one.
    :raises CorruptCheckpointError: it is damaged.
    """
    return stored_info(fs, path, read_checkpoint(fs, path, expect_step=step))


def _resolve_tracked(
    fs: LocalFileSystem,
    root: Path,
    layout: Layout,
    found: dict[int, Path],
    tracked: int,
    *,
    fallback: bool,
    reader: bool,
) -> CheckpointInfo | None:
    """A committed step newer than the tracker, else the tracked one; ``None`` to
    fall back to the newest (``fallback``, with a warning).

    :raises CheckpointNotFoundError: the tracked checkpoint is not loadable and not
        ``fallback``.
    """
    newer = sorted((s for s in found if s > tracked), reverse=True)
    # A saver commits, then moves the tracker: one step ahead of it may be a save
    # in flight; more cannot (saves commit and track one at a time).
    in_flight = reader and len(newer) == 1
    for step in newer:
        try:
            info = _counted(fs, found[step], step)
        except (CheckpointNotFoundError, CorruptCheckpointError) as exc:
            # One step ahead of the tracker without its marker: a save in flight.
            quiet = in_flight and isinstance(exc, UncommittedCheckpointError)
            logger.log(logging.INFO if quiet else logging.WARNING, "not counting %s", exc)
            continue
        logger.log(
            logging.INFO if in_flight else logging.WARNING,
            "the tracker in %s names step %d but step %d is committed (%s); resuming from %d",
            root,
            tracked,
            step,
            "a save moving the tracker now, or a crash between its commit and its tracker update"
            if in_flight
            else "a crash between commit and tracker update?",
            step,
        )
        return info
    path = root / layout.dir_name(tracked)
    try:
        return _counted(fs, path, tracked)
    except (CheckpointNotFoundError, CorruptCheckpointError) as exc:
        if not fallback:
            # Another preset's directories here (the tracker name is shared by
            # several presets): the layout is the fix, not the fallback.
            hint = _layout_hint(fs, root, layout)
            uncommitted = isinstance(exc, UncommittedCheckpointError)
            advice = hint or (
                ""  # its message says how to adopt it
                if uncommitted
                else "; pass fallback=True to resume from the newest committed checkpoint instead"
            )
            error = UncommittedCheckpointError if uncommitted else CheckpointNotFoundError
            raise error(
                f"the tracker in {root} names step {tracked}, but {path} is not a "
                f"loadable checkpoint ({exc}){advice}",
                path=path,
                step=tracked,
            ) from exc
        logger.warning("%s; falling back to the newest committed checkpoint", exc)
    return None


def _newest_counted(
    fs: LocalFileSystem, root: Path, layout: Layout, found: dict[int, Path], *, reader: bool
) -> CheckpointInfo | None:
    """The newest committed checkpoint of ``found`` (logging each one passed over
    and why), or ``None``."""
    for step in sorted(found, reverse=True):
        try:
            info = _counted(fs, found[step], step)
        except (CheckpointNotFoundError, CorruptCheckpointError) as exc:
            logger.warning("not counting %s", exc)
            continue
        if layout.tracker_name is not None:
            # A first save between its rename and its first tracker write: one
            # committed step, no tracker yet. A lost tracker beside more is a warning.
            missing = reader and len(found) == 1 and not fs.lexists(root / layout.tracker_name)
            logger.log(
                logging.INFO if missing else logging.WARNING,
                "no usable tracker in %s%s; resuming from the newest committed step %d",
                root,
                " (none yet: a first save moving it now, or a crash before it)" if missing else "",
                step,
            )
        return info
    return None


def _refuse_uncommitted_copies(fs: LocalFileSystem, root: Path, found: dict[int, Path]) -> None:
    """Nothing committed under ``root``: refuse rather than answer "nothing here"
    when final-named prefixes with a manifest lack only their commit marker (a run
    copied by a sync tool): a resume would start the trained run from scratch.

    :raises UncommittedCheckpointError: naming them and how to adopt them.
    """
    copies = [p for _, p in sorted(found.items()) if fs.exists(p / MANIFEST_NAME)]
    if not strategy_for(fs).writes_in_place or not copies:
        return
    shown = ", ".join(p.name for p in copies)
    raise UncommittedCheckpointError(
        f"no committed checkpoint in {root}, but {shown} hold files and a manifest "
        f"without their {COMMIT_MARKER_NAME} (copied by a sync tool, or saves that "
        f"stopped before their commit marker); nothing was deleted. `asyncsave adopt "
        f"{copies[-1]}` (or asyncsave.adopt) verifies every byte and commits one; a "
        "Checkpointer opened on the root adopts every one that verifies",
        path=copies[-1],
        step=step_of_name(copies[-1]),
    )


def _layout_hint(fs: LocalFileSystem, root: Path, layout: Layout) -> str:
    """A hint naming the other layout presets whose directories ``root`` holds
    (a root written with ``layout="verl"`` opened with the default), or ``""``."""
    others = [
        other.name
        for other in LAYOUTS.values()
        if other.dir_format != layout.dir_format and scan_steps(fs, root, other)
    ]
    if not others:
        return ""
    names = " or ".join(repr(n) for n in others)
    return f"; it holds checkpoints of the {names} layout: pass layout={others[0]!r}"


def older_committed(
    fs: LocalFileSystem, root: Path, layout: Layout, below: int
) -> CheckpointInfo | None:
    """The newest checkpoint under ``root`` older than step ``below`` whose manifest
    and file sizes check out, or ``None``."""
    found = scan_steps(fs, root, layout)
    for step in sorted((s for s in found if s < below), reverse=True):
        try:
            return info_of(found[step], read_checkpoint(fs, found[step], expect_step=step))
        except (CheckpointNotFoundError, CorruptCheckpointError) as exc:
            logger.warning("skipping %s: %s", found[step], exc)
    return None


def latest(
    root: str | os.PathLike[str],
    *,
    layout: str = "asyncsave",
    fallback: bool = False,
    filesystem: LocalFileSystem | None = None,
    storage_options: Mapping[str, Any] | None = None,
) -> CheckpointInfo | None:
    """The latest committed checkpoint under ``root``, or ``None`` if there is none.

    Reads the tracker; checks the manifest and file sizes of the checkpoint it names
    (not the checksums: :func:`verify` does that). ``root`` may be a URL
    (``s3://bucket/exp1``); ``filesystem`` and ``storage_options`` as for :func:`load`.

    :raises CheckpointNotFoundError: the tracker names a checkpoint that is missing
        or damaged and ``fallback`` is false, or ``root`` is itself one checkpoint.
    """
    fs, path = open_root(root, filesystem=filesystem, storage_options=storage_options)
    return resolve(fs, path, LAYOUTS[layout], fallback=fallback, reader=True)
