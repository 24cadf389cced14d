"""The manifest: the one file that makes a directory a checkpoint.

``manifest.json`` is written last, after every data file is durable; it names each
data file with its size, each entry (a run of bytes in a file) with its XXH3-64
checksum, each tensor with dtype, shape and the entry it lives in, and the state
tree. Parsing validates every field before anything is read through it, so a
damaged or hostile manifest is a :class:`~asyncsave.CorruptCheckpointError`, never
a path outside the checkpoint or a read past a file's end.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
import xxhash

from ._errors import CorruptCheckpointError, InvalidStateError, UnsupportedFormatError
from ._types import gc_paused

__all__ = [
    "FORMAT",
    "CHUNKS_VERSION",
    "FORMAT_VERSION",
    "NAMED_DTYPES_VERSION",
    "READ_VERSION",
    "Manifest",
    "check_training_info",
    "encode_manifest",
    "format_version",
    "parse_manifest",
    "record_entries",
    "StoredRecord",
    "stored_files",
    "torch_dtype",
]

FORMAT = "asyncsave"
FORMAT_VERSION = 1  # what saves write, unless they need a newer one
# Version 2 adds one thing: a tensor record may carry ``chunks`` (incremental
# saves store a growing tensor as row ranges, see ``asyncsave._incremental``);
# only a manifest that has such a record says 2, so older readers refuse it as
# a newer format (UnsupportedFormatError), never read it as damaged.
CHUNKS_VERSION = 2
# Version 3 adds one thing: data files may name the safetensors dtypes ``F8_E8M0``
# and ``F4`` (float8_e8m0fnu, float4_e2m1fn_x2; earlier saves stored them as
# ``U8``), which a reader of versions 1-2 refuses in a header. Only a manifest
# with a tensor of such a dtype says 3.
NAMED_DTYPES_VERSION = 3
READ_VERSION = NAMED_DTYPES_VERSION  # the newest this reads
# dtype names (as in tensor records) whose data files need NAMED_DTYPES_VERSION
_NEWER_NAMED = frozenset({"float8_e8m0fnu", "float4_e2m1fn_x2"})
CHECKSUM = "xxh3_64"
SELF_CHECKSUM = "manifest_xxh3_64"  # last field: XXH3-64 of the document without it
_HEX16 = re.compile(r"^[0-9a-f]{16}$")
_MAX_STEP = 2**63 - 1
_KINDS = {"tensor", "parameter", "ndarray", "pickle"}


@dataclasses.dataclass(frozen=True)
class Manifest:
    """A parsed, validated manifest."""

    step: int
    world_size: int
    files: list[dict[str, Any]]
    entries: list[dict[str, Any]]
    tensors: list[dict[str, Any]]
    tree: dict[str, Any]
    costs: dict[str, float]
    training_info: dict[str, Any] = dataclasses.field(default_factory=dict)
    # When the saver wrote the manifest, just before the commit (seconds since the
    # epoch); ``None`` when absent or not a finite number.
    created_unix_s: float | None = None
    # Files checked whole (size and XXH3-64 of their stored bytes), beside the
    # safetensors ``files``: a DCP save's ``.metadata`` and the files of DCP's own
    # format (``dcp_files``, written with stream transforms).
    whole_files: list[StoredRecord] = dataclasses.field(default_factory=list)

    @property
    def nbytes(self) -> int:
        """Bytes of tensor data (the sum of the entries)."""
        return sum(e["nbytes"] for e in self.entries)

    @property
    def whole_nbytes(self) -> int:
        """Bytes of the files checked whole (a DCP save's ``.metadata`` and
        ``dcp_files``), which :func:`asyncsave.verify` hashes besides the entries."""
        return sum(f.nbytes for f in self.whole_files)


@dataclasses.dataclass(frozen=True)
class StoredRecord:
    """One file a checkpoint stores beside its manifest, as the manifest records it:
    its plain name in the checkpoint directory, its size in bytes and, for a file
    checked whole, the XXH3-64 hex digest of its stored bytes (``None`` for a
    safetensors data file, whose entries carry the checksums)."""

    name: str
    nbytes: int
    checksum: str | None


def stored_files(manifest: Manifest) -> list[StoredRecord]:
    """Every file ``manifest`` names, each once: the safetensors data files, then
    the files checked whole (a DCP save's ``.metadata`` and ``dcp_files``). The one
    list that sizes, verification, copies between tiers and listings read."""
    out = [StoredRecord(f["name"], f["nbytes"], None) for f in manifest.files]
    return out + manifest.whole_files


_DTYPES: dict[str, torch.dtype | None] = {}  # name -> answer, for names seen (strs)


def torch_dtype(name: Any) -> torch.dtype | None:
    """The torch dtype named ``name`` (``"float32"``), or ``None``."""
    if type(name) is str:
        try:
            return _DTYPES[name]
        except KeyError:
            pass
    dtype = _torch_dtype(name)
    if type(name) is str and len(_DTYPES) < 1024:
        _DTYPES[name] = dtype
    return dtype


def _torch_dtype(name: Any) -> torch.dtype | None:
    if not isinstance(name, str) or not name.isidentifier():
        return None
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype) or dtype in (
        torch.qint8,
        torch.quint8,
        torch.qint32,
        torch.quint4x2,
        torch.quint2x4,
    ):
        return None
    return dtype


def format_version(tensors: list[dict[str, Any]]) -> int:
    """The manifest ``format_version`` a save of these tensor records writes: the
    oldest that reads it (1, unless a record is chunked or has a dtype whose
    safetensors name came later), so older asyncsave versions load what they can."""
    if any(rec["dtype"] in _NEWER_NAMED for rec in tensors):
        return NAMED_DTYPES_VERSION
    if any("chunks" in rec for rec in tensors):
        return CHUNKS_VERSION
    return FORMAT_VERSION


def _fail(path: Path, what: str) -> CorruptCheckpointError:
    return CorruptCheckpointError(f"damaged manifest {path}: {what}", path=path)


def _int(v: Any, lo: int = 0, hi: int = _MAX_STEP) -> bool:
    return type(v) is int and lo <= v <= hi


def _safe_file_name(name: Any) -> bool:
    return (
        isinstance(name, str)
        and 0 < len(name) <= 255
        and "/" not in name
        and "\\" not in name
        and "\x00" not in name
        and not name.startswith(".")
        and name != "manifest.json"
    )


def _info_problem(info: Any) -> str | None:
    """Why ``info`` is not a flat ``training_info`` mapping, or ``None``."""
    if not isinstance(info, dict):
        return f"is a {type(info).__name__}, not a dict"
    for key, value in info.items():
        if not isinstance(key, str) or not key:
            return f"has key {key!r}: keys must be non-empty str"
        if value is None or isinstance(value, (bool, str)):
            continue
        if isinstance(value, int):
            if not -(2**63) <= value < 2**63:
                return f"[{key!r}] = {value} does not fit 64 bits"
            continue
        if isinstance(value, float) and math.isfinite(value):
            continue
        return f"[{key!r}] = {value!r}: values must be int, finite float, str, bool or None"
    return None


def check_training_info(info: Any, step: int | None = None) -> dict[str, Any]:
    """Validate ``save(..., training_info=...)``: a flat mapping of counters and
    metrics (``{"consumed_samples": 640, "eval/reward": 0.71}``), whose
    ``"step"``, if any, is the save's ``step``.

    :raises InvalidStateError: naming the offending key.
    """
    if info is None:
        return {}
    if isinstance(info, Mapping):
        info = dict(info)
    problem = _info_problem(info)
    if problem is not None:
        raise InvalidStateError(f"training_info {problem}", key="training_info")
    doc = dict(info)
    if step is not None and doc.get("step", step) != step:
        raise InvalidStateError(
            f"training_info['step'] is {doc['step']!r} but this is step {step}",
            key="training_info",
            step=step,
        )
    return doc


_CHUNK_ITEMS = 256  # list items per json.dumps call in _canonical
# Nodes (containers and values) per json.dumps call at most (about 1 ms).
_WHOLE_NODES = 4096


def _canonical(doc: dict[str, Any]) -> bytes:
    """``json.dumps(doc, separators=(",", ":"))``, byte for byte, made in pieces:
    one call over a manifest of 10,000 tensors holds the GIL for about 50 ms (the
    C encoder never releases it), which stalls the event loop while a worker
    thread encodes; lists are encoded :data:`_CHUNK_ITEMS` items per call, so
    other threads run between the calls (see :func:`_pieces`)."""
    with gc_paused():
        return "".join(_pieces(doc)).encode("utf-8")


def _pieces(value: Any) -> list[str]:
    """The compact JSON of ``value`` in pieces, none from a ``json.dumps`` call
    over more than :data:`_WHOLE_NODES` nodes: a subtree that small is one
    call; a larger dict with str keys is split by its items, a larger list into
    runs of small items (at most :data:`_CHUNK_ITEMS`) and its large items split
    in turn, at any depth (a model's and an optimizer's trees under ``Stateful``
    nodes lie five and more levels down: one call over one of them held the GIL
    for 0.2 s at 100,000 tensors)."""
    if _nodes_within(value, _WHOLE_NODES) <= _WHOLE_NODES:
        return [json.dumps(value, separators=(",", ":"))]
    if type(value) is dict and all(type(k) is str for k in value):
        out = ["{"]
        for i, (k, v) in enumerate(value.items()):
            out.append(("," if i else "") + json.dumps(k) + ":")
            out.extend(_pieces(v))
        out.append("}")
        return out
    if type(value) is list:
        out = ["["]
        i = 0
        while i < len(value):
            run = value[i : i + _CHUNK_ITEMS]
            while len(run) > 1 and _nodes_within(run, _WHOLE_NODES) > _WHOLE_NODES:
                run = run[: len(run) // 2]
            sep = "," if i else ""
            if len(run) == 1 and _nodes_within(run[0], _WHOLE_NODES) > _WHOLE_NODES:
                out.append(sep)  # one large item: split in turn
                out.extend(_pieces(run[0]))
            else:
                out.append(sep + json.dumps(run, separators=(",", ":"))[1:-1])
            i += len(run)
        out.append("]")
        return out
    return [json.dumps(value, separators=(",", ":"))]


def _nodes_within(value: Any, limit: int) -> int:
    """The number of containers and values in ``value``, counted up to
    ``limit + 1`` (no further: the count of a large tree costs ``limit`` steps)."""
    n = 0
    stack = [value]
    while stack:
        x = stack.pop()
        n += 1
        if n > limit:
            return n
        t = type(x)
        if t is dict:
            stack.extend(x.values())
        elif t is list or t is tuple:
            stack.extend(x)
    return n


def encode_manifest(doc: dict[str, Any]) -> bytes:
    """The manifest's bytes: compact JSON whose last field is the XXH3-64 of the
    document without that field, so an edited manifest (a changed offset, step or
    dataloader position) is detected, not trusted."""
    # Piece by piece (the bytes of _canonical(doc), hashed as they are made):
    # one join at the end, no copy of the whole body for the hash or the tail.
    with gc_paused():
        pieces = [p.encode("utf-8") for p in _pieces(doc)]
    hasher = xxhash.xxh3_64()
    for piece in pieces:
        hasher.update(piece)
    assert pieces[-1].endswith(b"}")
    pieces[-1] = pieces[-1][:-1]
    pieces.append(f',"{SELF_CHECKSUM}":"{hasher.hexdigest()}"}}'.encode("ascii"))
    return b"".join(pieces)


def parse_manifest(raw: bytes, path: Path) -> Manifest:
    """Decode and validate a manifest.

    :param raw: the bytes of ``manifest.json``.
    :param path: where it was read from, for error messages.
    :raises CorruptCheckpointError: naming the first field that is wrong.
    """
    with gc_paused():  # a manifest of 100,000 tensors is 100,000s of objects
        return _parse(raw, path)


def _self_checksum_ok(raw: bytes, doc: dict[str, Any], digest: Any) -> bool:
    """Whether ``digest`` is the XXH3-64 of ``doc`` without it, in its canonical
    encoding. A manifest as :func:`encode_manifest` wrote it is that encoding with
    the field appended, so its bytes up to the field are hashed as they are (no
    re-encoding of 10,000s of entries); any other spelling is re-encoded."""
    if isinstance(digest, str):
        tail = f',"{SELF_CHECKSUM}":"{digest}"}}'.encode("ascii")
        if raw.endswith(tail) and digest == xxhash.xxh3_64_hexdigest(raw[: -len(tail)] + b"}"):
            return True
    return bool(digest == xxhash.xxh3_64_hexdigest(_canonical(doc)))


def _parse(raw: bytes, path: Path) -> Manifest:
    """Check a manifest's fields in the order they are read through: the header
    (format, version, own checksum, step), then files, entries, tensors and the
    tree; the first wrong field is the error."""
    doc = _decoded(raw, path)
    version = _check_header(raw, doc, path)
    step, world_size = doc.get("step"), doc.get("world_size")
    if not _int(step):
        raise _fail(path, f"step {step!r} is not a non-negative int")
    if not _int(world_size, 1, 1 << 24):
        raise _fail(path, f"world_size {world_size!r} is not a positive int")
    assert isinstance(step, int) and isinstance(world_size, int)
    files = _checked_files(doc.get("files"), path)
    entries = _checked_entries(doc.get("entries"), files, path)
    tensors = _checked_tensors(doc.get("tensors"), entries, version, path)
    tree = doc.get("tree")
    if not isinstance(tree, dict):
        raise _fail(path, "tree is not an object")
    costs = doc.get("costs", {})
    if not isinstance(costs, dict) or not all(
        isinstance(v, (int, float)) and math.isfinite(v) for v in costs.values()
    ):
        costs = {}
    training_info = doc.get("training_info", {})
    problem = _info_problem(training_info)
    if problem is not None:
        raise _fail(path, f"training_info {problem}")
    return Manifest(
        step=step,
        world_size=world_size,
        files=files,
        entries=entries,
        tensors=tensors,
        tree=tree,
        costs=costs,
        training_info=training_info,
        created_unix_s=_finite(doc.get("created_unix_s")),
        whole_files=_checked_whole_files(doc, {f["name"] for f in files}, path),
    )


def _decoded(raw: bytes, path: Path) -> dict[str, Any]:
    """The JSON object of ``raw``."""
    try:
        doc = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:  # JSONDecodeError too
        raise _fail(path, f"not JSON ({exc})") from exc
    if not isinstance(doc, dict):
        raise _fail(path, "top level is not an object")
    return doc


def _check_header(raw: bytes, doc: dict[str, Any], path: Path) -> int:
    """Check the format, its version (a newer one is :class:`UnsupportedFormatError`),
    the manifest's own checksum (popped from ``doc``) and the checksum algorithm.

    :returns: the format version."""
    if doc.get("format") != FORMAT:
        raise _fail(path, f"format is {doc.get('format')!r}, not {FORMAT!r}")
    version = doc.get("format_version")
    if type(version) is int and version > READ_VERSION:
        raise UnsupportedFormatError(
            f"{path} has format_version {version}; this asyncsave reads up to "
            f"{READ_VERSION}: upgrade asyncsave",
            path=path,
        )
    if type(version) is not int or not 1 <= version <= READ_VERSION:
        raise _fail(path, f"format_version {version!r} is not 1..{READ_VERSION}")
    digest = doc.pop(SELF_CHECKSUM, None)
    if not _self_checksum_ok(raw, doc, digest):
        raise _fail(path, "its own checksum does not match (edited or damaged)")
    if doc.get("checksum") != CHECKSUM:
        raise _fail(path, f"checksum algorithm {doc.get('checksum')!r} is unknown")
    return version


def _checked_files(files: Any, path: Path) -> list[dict[str, Any]]:
    """``files``: a list of objects, each a safe plain file name of its own and a size."""
    if not isinstance(files, list):
        raise _fail(path, "files is not a list")
    names = set()
    for i, f in enumerate(files):
        if not isinstance(f, dict) or not _safe_file_name(f.get("name")):
            raise _fail(path, f"files[{i}] has no safe plain file name")
        if not _int(f.get("nbytes")):
            raise _fail(path, f"files[{i}].nbytes is not a non-negative int")
        if f["name"] in names:
            raise _fail(path, f"files[{i}] repeats {f['name']!r}")
        names.add(f["name"])
    return files


_DCP_METADATA_NAME = ".metadata"  # torch.distributed.checkpoint's file name


def _checked_whole_files(doc: dict[str, Any], taken: set[str], path: Path) -> list[StoredRecord]:
    """``dcp_metadata`` (an object named ``.metadata``) and ``dcp_files`` (a list of
    objects with a safe plain name), each with a size and an XXH3-64 digest, no
    name repeated or shared with ``files``; both absent outside DCP saves."""
    records: list[tuple[str, Any]] = []
    meta = doc.get("dcp_metadata")
    if meta is not None:
        if not isinstance(meta, dict) or meta.get("name") != _DCP_METADATA_NAME:
            raise _fail(path, f"dcp_metadata is not an object named {_DCP_METADATA_NAME!r}")
        records.append(("dcp_metadata", meta))
    listed = doc.get("dcp_files", [])
    if not isinstance(listed, list):
        raise _fail(path, "dcp_files is not a list")
    for i, f in enumerate(listed):
        if not isinstance(f, dict) or not _safe_file_name(f.get("name")):
            raise _fail(path, f"dcp_files[{i}] has no safe plain file name")
        records.append((f"dcp_files[{i}]", f))
    out = []
    names = set(taken)
    for where, rec in records:
        if not _int(rec.get("nbytes")):
            raise _fail(path, f"{where}.nbytes is not a non-negative int")
        digest = rec.get(CHECKSUM)
        if not isinstance(digest, str) or not _HEX16.match(digest):
            raise _fail(path, f"{where}.{CHECKSUM} is not 16 hex digits")
        if rec["name"] in names:
            raise _fail(path, f"{where} repeats {rec['name']!r}")
        names.add(rec["name"])
        out.append(StoredRecord(rec["name"], rec["nbytes"], digest))
    return out


def _checked_entries(entries: Any, files: list[dict[str, Any]], path: Path) -> list[dict[str, Any]]:
    """``entries``: a list of objects, each a name, a run of bytes inside one of
    ``files`` and a checksum."""
    if not isinstance(entries, list):
        raise _fail(path, "entries is not a list")
    for i, e in enumerate(entries):
        if not isinstance(e, dict):
            raise _fail(path, f"entries[{i}] is not an object")
        if not isinstance(e.get("name"), str):
            raise _fail(path, f"entries[{i}] has no name")
        if not _int(e.get("file"), 0, len(files) - 1):
            raise _fail(path, f"entries[{i}].file is not an index into files")
        if not _int(e.get("offset")) or not _int(e.get("nbytes")):
            raise _fail(path, f"entries[{i}] offset/nbytes are not non-negative ints")
        if e["offset"] + e["nbytes"] > files[e["file"]]["nbytes"]:
            raise _fail(path, f"entries[{i}] runs past the end of its file")
        if not isinstance(e.get(CHECKSUM), str) or not _HEX16.match(e[CHECKSUM]):
            raise _fail(path, f"entries[{i}] has no {CHECKSUM} checksum")
    return entries


def _checked_tensors(
    tensors: Any, entries: list[dict[str, Any]], version: int, path: Path
) -> list[dict[str, Any]]:
    """``tensors``: a list of tensor records (:func:`_check_tensor`), chunked
    ones only in a manifest of :data:`CHUNKS_VERSION` or newer."""
    if not isinstance(tensors, list):
        raise _fail(path, "tensors is not a list")
    for i, t in enumerate(tensors):
        _check_tensor(path, i, t, entries)  # first: it checks that t is an object
        if "chunks" in t and version < CHUNKS_VERSION:
            raise _fail(path, f"tensors[{i}] has chunks in a format_version {version} manifest")
    return tensors


def _finite(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if math.isfinite(value) else None


def _check_tensor(path: Path, i: int, t: Any, entries: list[dict[str, Any]]) -> None:
    where = f"tensors[{i}]"
    if not isinstance(t, dict):
        raise _fail(path, f"{where} is not an object")
    dtype = torch_dtype(t.get("dtype"))
    if dtype is None:
        raise _fail(path, f"{where}.dtype {t.get('dtype')!r} is not a torch dtype")
    if not isinstance(t.get("kind"), str) or t["kind"] not in _KINDS:
        raise _fail(path, f"{where}.kind {t.get('kind')!r} is unknown")
    shape = t.get("shape")
    if not isinstance(shape, list) or len(shape) > 64 or not all(_int(n) for n in shape):
        raise _fail(path, f"{where}.shape is not a list of non-negative ints")
    if not _int(t.get("entry"), 0, len(entries) - 1) or not _int(t.get("offset")):
        raise _fail(path, f"{where} entry/offset are out of range")
    if not isinstance(t.get("requires_grad"), bool):
        raise _fail(path, f"{where}.requires_grad is not a bool")
    if t["requires_grad"] and not (dtype.is_floating_point or dtype.is_complex):
        raise _fail(path, f"{where} requires grad but has dtype {dtype}")
    itemsize = dtype.itemsize
    entry_nbytes = entries[t["entry"]]["nbytes"]
    if "stride" not in t:  # null for a contiguous tensor, never absent
        raise _fail(path, f"{where} has no stride")
    stride = t["stride"]
    numel = math.prod(shape)
    if "chunks" in t:
        _check_chunks(path, where, t, entries, numel * itemsize)
        return
    if stride is None:
        if t["offset"] != 0 or numel * itemsize != entry_nbytes:
            raise _fail(
                path,
                f"{where} ({t.get('key')!r}) needs {numel * itemsize} bytes but its "
                f"entry holds {entry_nbytes}",
            )
        return
    _check_strided(path, where, t, itemsize, entry_nbytes)


def _check_strided(
    path: Path, where: str, t: dict[str, Any], itemsize: int, entry_nbytes: int
) -> None:
    """A strided tensor (a view stored with its storage's bytes): a stride per
    dimension, an offset of whole elements, every element inside its entry."""
    shape, stride = t["shape"], t["stride"]
    if (
        not isinstance(stride, list)
        or len(stride) != len(shape)
        or not all(_int(s) for s in stride)
    ):
        raise _fail(path, f"{where}.stride does not match its shape")
    if t["offset"] % itemsize:
        raise _fail(path, f"{where}.offset is not a multiple of its element size")
    if math.prod(shape):
        last = sum((n - 1) * s for n, s in zip(shape, stride, strict=True))
        if t["offset"] + (last + 1) * itemsize > entry_nbytes:
            raise _fail(path, f"{where} ({t.get('key')!r}) reaches past its entry")


def record_entries(rec: dict[str, Any]) -> list[int]:
    """The entries that hold a tensor record's bytes, in order: its ``chunks``
    (a tensor stored as row ranges by an incremental save), else its one entry."""
    chunks = rec.get("chunks")
    return list(chunks) if chunks is not None else [rec["entry"]]


def renumbered(rec: dict[str, Any], entry: Callable[[int], int]) -> dict[str, Any]:
    """A copy of a tensor record whose entry (and ``chunks``) go through ``entry``
    (manifests merged from ranks, compacted by ``update()``, split per rank)."""
    out = {**rec, "entry": entry(rec["entry"])}
    if "chunks" in rec:
        out["chunks"] = [entry(j) for j in rec["chunks"]]
    return out


def _check_chunks(
    path: Path, where: str, t: dict[str, Any], entries: list[dict[str, Any]], nbytes: int
) -> None:
    """A chunked tensor: contiguous (no stride, offset 0), at least two distinct
    entries whose sizes are whole rows and add up to the tensor's bytes, the first
    being ``entry``."""
    chunks = t["chunks"]
    if (
        not isinstance(chunks, list)
        or not 2 <= len(chunks) <= 1 << 20
        or not all(_int(j, 0, len(entries) - 1) for j in chunks)
        or len(set(chunks)) != len(chunks)
        or chunks[0] != t["entry"]
    ):
        raise _fail(path, f"{where}.chunks is not a list of distinct entries starting at entry")
    shape = t["shape"]
    row = nbytes // shape[0] if shape and shape[0] else 0
    if t["stride"] is not None or t["offset"] != 0 or not row:
        raise _fail(path, f"{where} ({t.get('key')!r}) is chunked but not whole rows")
    sizes = [entries[j]["nbytes"] for j in chunks]
    if sum(sizes) != nbytes or any(n % row for n in sizes):
        raise _fail(
            path,
            f"{where} ({t.get('key')!r}) needs {nbytes} bytes in rows of {row} but its "
            f"chunks hold {sizes}",
        )
