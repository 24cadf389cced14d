"""Decode: a checkpoint's bytes back into tensors and its state tree, every check
on the way (safetensors headers against the manifest, XXH3-64 checksums, the tree's
nodes); and :func:`verify`, which runs every check without building a state.

Below both the read side (``_load``, ``_dist``) and the write side's full checks
(adoption at open, a tier checking what an earlier run left), so that neither
needs the other. Nothing here unpickles unless the caller passes
``allow_pickle=True``; every path comes from a validated manifest.
"""

from __future__ import annotations

import base64
import json
import math
import os
import pickle
import struct
from collections import OrderedDict
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
import xxhash

from ._catalog import read_checkpoint, step_of_name, stored_info
from ._errors import (
    ChecksumMismatchError,
    CorruptCheckpointError,
    UnsafeLoadError,
)
from ._format import SAFETENSORS_BITS
from ._fs import LocalFileSystem
from ._fsspec import FsspecFileSystem, open_root
from ._manifest import CHECKSUM, Manifest, stored_files, torch_dtype
from ._plan import key_str
from ._read import read_entries
from ._types import CheckpointInfo, Tagged

__all__ = ["verify", "verify_data"]

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
    """A safetensors tensor entry: known dtype, shape and byte range that agree.

    Any dtype name safetensors has is accepted, whatever the manifest's dtype:
    checkpoints written before asyncsave named ``F8_E8M0`` and ``F4`` hold
    those tensors as ``U8`` bytes, and the manifest says what they are."""
    if not isinstance(h, dict) or set(h) != {"dtype", "shape", "data_offsets"}:
        return False
    dtype, shape, offsets = h["dtype"], h["shape"], h["data_offsets"]
    bits = SAFETENSORS_BITS.get(dtype) if isinstance(dtype, str) else None
    return (
        bits is not None
        and isinstance(shape, list)
        and all(type(d) is int and d >= 0 for d in shape)
        and isinstance(offsets, list)
        and len(offsets) == 2
        and all(type(o) is int and o >= 0 for o in offsets)
        and 8 * (offsets[1] - offsets[0]) == math.prod(shape) * bits
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


# What :meth:`_Decoder.leaf` answers for a node that is not a plain leaf.
_NOT_A_LEAF = object()


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
        kind = node["type"]
        try:
            value = self.leaf(kind, node.get("v"), node)
        except (ValueError, TypeError, KeyError, IndexError, RuntimeError) as exc:
            raise self.bad(where, f"bad {kind} value") from exc
        return self.branch(kind, node, where) if value is _NOT_A_LEAF else value

    @staticmethod
    def leaf(kind: str, v: Any, node: dict[str, Any]) -> Any:
        """The value of a plain leaf (``v`` of the kind's type), or
        :data:`_NOT_A_LEAF` for any other node."""
        if kind == "none":
            return None
        if (kind == "bool" and type(v) is bool) or (kind == "int" and type(v) is int):
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

            raw = base64.b64decode(v, validate=True)
            return np.frombuffer(raw, dtype=np.dtype(node["dtype"]))[0]
        return _NOT_A_LEAF

    def branch(self, kind: str, node: dict[str, Any], where: tuple[Any, ...]) -> Any:
        """A node that is not a plain leaf: a tensor, a pickled leaf, a container."""
        if kind == "tensor":
            return self.tensors[self.index(node, where)]
        if kind == "pickle":
            return self.pickled(node, where)
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

    def pickled(self, node: dict[str, Any], where: tuple[Any, ...]) -> Any:
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


def verify(
    path: str | os.PathLike[str],
    *,
    filesystem: LocalFileSystem | None = None,
    storage_options: Mapping[str, Any] | None = None,
    progress: Callable[[int], None] | None = None,
) -> CheckpointInfo:
    """Check a checkpoint completely: manifest (and its own checksum), the size of
    every file it names, safetensors headers, the checksum of every byte (per
    entry in safetensors files; per file for a DCP save's ``.metadata`` and the
    files of DCP's own format written with ``_extensions``, which are never
    opened as safetensors), and that every tensor and the state tree can be
    rebuilt (pickled leaves are not unpickled). Reads every byte once. ``path``,
    ``filesystem`` and ``storage_options`` as for :func:`load`.

    :param progress: called with each count of bytes just hashed (chunks of at
        most 8 MiB), possibly from several reading threads at once; the counts add
        up to ``CheckpointInfo.nbytes`` plus the sizes of the files checked whole
        (a DCP save's ``.metadata`` and compressed files) once the checkpoint
        verifies (none for another library's files, whose sizes only are
        checked). The ``asyncsave verify`` command feeds a progress bar with it.

    :returns: the checkpoint's :class:`CheckpointInfo`.
    :raises CheckpointNotFoundError: no manifest at ``path``.
    :raises CorruptCheckpointError: (or :class:`ChecksumMismatchError`) naming the
        file and entry that is wrong, or the file that is missing.
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
    checksum (of each entry of a safetensors file; of each file recorded whole, as
    a DCP save's ``.metadata`` and ``dcp_files``, which are never opened as
    safetensors), every tensor and the state tree rebuilt (nothing unpickled). Another
    library's files (a ``foreign`` tree) have only their sizes checked.

    :raises CorruptCheckpointError: (or :class:`ChecksumMismatchError`) naming the
        file and entry that is wrong.
    """
    for rec in stored_files(manifest):
        if rec.checksum is not None:
            _verify_whole(fs, path / rec.name, rec.nbytes, rec.checksum, progress)
    if manifest.tree.get("type") == "foreign":
        return
    raw = _read(fs, path, manifest, verify=True, device=torch.device("cpu"), progress=progress)
    tensors = _build_tensors(manifest, raw, torch.device("cpu"))
    decoder = _Decoder(tensors, manifest.tensors, path=path, allow_pickle=False, unpickle=False)
    decoder.node(manifest.tree)


def _verify_whole(
    fs: LocalFileSystem,
    fpath: Path,
    nbytes: int,
    digest: str,
    progress: Callable[[int], None] | None,
) -> None:
    """Hash the stored bytes of ``fpath`` (8 MiB reads) against its manifest record.

    :raises ChecksumMismatchError: its size or XXH3-64 digest differs (names it).
    :raises CorruptCheckpointError: it is missing.
    """
    h = xxhash.xxh3_64()
    seen = 0
    try:
        with fs.open_read(fpath) as f:
            while chunk := f.read(_READ_CHUNK):
                h.update(chunk)
                seen += len(chunk)
                if progress is not None:
                    progress(len(chunk))
    except FileNotFoundError as exc:
        raise CorruptCheckpointError(f"data file {fpath} is missing", path=fpath) from exc
    if seen != nbytes or h.hexdigest() != digest:
        raise ChecksumMismatchError(
            f"{fpath}: stored bytes do not match their checksum in the manifest "
            f"({seen} bytes, {h.hexdigest()}; the manifest says {nbytes}, {digest})",
            path=fpath,
        )
