"""One rank's data files of a DCP save through :class:`asyncsave.dcp.StorageWriter`,
and the ``FileSystemWriter`` keywords the writer accepts.

Two file formats, chosen per writer:

- asyncsave's (the default): safetensors files, ``thread_count`` of them written
  by as many threads (one per item with ``single_file_per_rank=False``), an
  XXH3-64 checksum per item, fsynced. Other tools open and mmap them.
- DCP's own (``.distcp``), when stream transforms are asked for
  (``_extensions=[ZStandard()]``): written by torch's ``FileSystemWriter`` into the
  save's temporary directory, so that the bytes and their ``storage_data`` are
  exactly DCP's and ``FileSystemReader`` (and asyncsave's reader, which hands them
  to it) decodes them; asyncsave adds an XXH3-64 checksum of each stored (i.e.
  compressed) file, its commit and its tracker. What is lost against the default:
  the files are not safetensors (``safetensors.safe_open`` cannot read them; the
  tensors inside are ``torch.save`` records, read with ``weights_only=True``).

The call order is that of :class:`asyncsave.dcp.StorageWriter` (DCP's): these
functions run inside ``prepare_global_plan`` (coordinator) and ``write_data``
(every rank).
"""

from __future__ import annotations

import dataclasses
import errno
import json
import os
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
import xxhash
from torch.distributed.checkpoint.filesystem import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner
from torch.distributed.checkpoint.storage import WriteResult

from ._errors import ChecksumMismatchError, CorruptCheckpointError
from ._format import FileLayout, layout_buckets
from ._fs import LocalFileSystem
from ._manifest import CHECKSUM
from ._paths import MANIFEST_NAME

__all__ = [
    "StoredFile",
    "check_writer_options",
    "distcp_reader",
    "distcp_global_plan",
    "file_buckets",
    "hash_file",
    "lay_out",
    "verify_stored",
    "write_distcp_part",
    "write_layouts",
]

_HASH_CHUNK = 8 << 20

# DCP's stream transforms and serialization formats are newer than the oldest
# torch asyncsave supports (2.6): where they are missing, the keywords are
# accepted at their defaults only (checked in ``check_writer_options``).
try:
    from torch.distributed.checkpoint._extension import StreamTransformExtension
except ImportError:  # pragma: no cover - older torch
    StreamTransformExtension = None  # type: ignore[assignment,misc]
try:
    from torch.distributed.checkpoint.filesystem import SerializationFormat
except ImportError:  # pragma: no cover - older torch
    SerializationFormat = None  # type: ignore[assignment,misc]


@dataclasses.dataclass(frozen=True)
class StoredFile:
    """A data file of DCP's own format as stored: its name in the checkpoint
    directory, its size in bytes and the XXH3-64 hex digest of its (compressed)
    bytes."""

    name: str
    nbytes: int
    checksum: str


def check_writer_options(
    *,
    single_file_per_rank: Any,
    sync_files: Any,
    thread_count: Any,
    per_thread_copy_ahead: Any,
    cache_staged_state_dict: Any,
    overwrite: Any,
    extensions: Any,
    serialization_format: Any,
) -> tuple[Any, ...]:
    """Check ``FileSystemWriter``'s keywords as :class:`asyncsave.dcp.StorageWriter`
    takes them.

    :returns: the stream transforms as a tuple (``()`` for ``None``).
    :raises TypeError: a keyword of the wrong type (names it): a flag that is not a
        ``bool``, a count that is not an ``int``, a transform that is not one of
        DCP's ``StreamTransformExtension``, a format that is not ``None`` (DCP's
        default) or a ``SerializationFormat``.
    :raises ValueError: ``thread_count < 1`` or ``per_thread_copy_ahead < 0``; a
        stream transform or format where this torch has none; ``SAFETENSORS``
        with stream transforms (DCP's reader cannot read what DCP then writes).
    """
    flags = {
        "single_file_per_rank": single_file_per_rank,
        "sync_files": sync_files,
        "cache_staged_state_dict": cache_staged_state_dict,
        "overwrite": overwrite,
    }
    for name, value in flags.items():
        if type(value) is not bool:
            raise TypeError(f"StorageWriter {name}={value!r} must be a bool")
    for name, value, low in (
        ("thread_count", thread_count, 1),
        ("per_thread_copy_ahead", per_thread_copy_ahead, 0),
    ):
        if type(value) is not int:
            raise TypeError(f"StorageWriter {name}={value!r} must be an int")
        if value < low:
            raise ValueError(f"StorageWriter {name}={value!r} must be >= {low}")
    if serialization_format is not None and SerializationFormat is None:
        raise ValueError(
            f"StorageWriter serialization_format: torch {torch.__version__} has no "
            "DCP serialization formats; leave it None"
        )
    if serialization_format is not None and not isinstance(
        serialization_format, SerializationFormat
    ):
        raise TypeError(
            f"StorageWriter serialization_format={serialization_format!r} must be a "
            "torch.distributed.checkpoint.filesystem.SerializationFormat"
        )
    if not extensions:
        return ()
    if StreamTransformExtension is None:
        raise ValueError(
            f"StorageWriter _extensions: torch {torch.__version__} has no DCP stream "
            "transforms (torch.distributed.checkpoint._extension)"
        )
    if isinstance(extensions, (str, bytes)) or not isinstance(extensions, Sequence):
        raise TypeError(f"StorageWriter _extensions={extensions!r} must be a sequence")
    for ex in extensions:
        if not isinstance(ex, StreamTransformExtension):
            raise TypeError(
                f"StorageWriter _extensions: {ex!r} is not a DCP StreamTransformExtension "
                "(torch.distributed.checkpoint._extension: ZStandard, or a subclass)"
            )
    if serialization_format is not None and serialization_format.name == "SAFETENSORS":
        # FileSystemWriter writes them, but FileSystemReader reads each item with
        # torch.load (torch 2.13: "Unsupported operand", or a zstd frame error).
        raise ValueError(
            "StorageWriter serialization_format=SAFETENSORS with _extensions: DCP's "
            "FileSystemReader cannot read the files DCP then writes; leave it None "
            "(asyncsave's files without _extensions are safetensors already)"
        )
    return tuple(extensions)


def file_buckets(nbytes: Sequence[int], files: int) -> list[list[int]]:
    """Indices of items of ``nbytes`` each spread over at most ``files`` buckets of
    balanced size (largest first into the smallest bucket), empty ones dropped;
    ``[[]]`` for no items. Pure."""
    n = max(1, min(files, len(nbytes)))
    buckets: list[list[int]] = [[] for _ in range(n)]
    sizes = [0] * n
    for i in sorted(range(len(nbytes)), key=lambda i: -nbytes[i]):
        target = sizes.index(min(sizes))
        buckets[target].append(i)
        sizes[target] += nbytes[i]
    return [b for b in buckets if b] or [[]]


def write_layouts(layouts: list[FileLayout], threads: int, write_one: Any) -> list[Any]:
    """``write_one(layout)`` for every file, on up to ``threads`` threads (joined
    before this returns; the first error is raised after every write ended)."""
    if threads <= 1 or len(layouts) <= 1:
        return [write_one(fl) for fl in layouts]
    with ThreadPoolExecutor(min(threads, len(layouts)), "asyncsave-dcp-write") as pool:
        futures = [pool.submit(write_one, fl) for fl in layouts]
    return [f.result() for f in futures]


def lay_out(
    entries: list[Any], *, rank: int, thread_count: int, single_file_per_rank: bool
) -> list[FileLayout]:
    """The safetensors files of one rank: ``thread_count`` of balanced size, or one
    per item (``single_file_per_rank=False``, as ``FileSystemWriter`` does)."""
    if single_file_per_rank:
        buckets = file_buckets([e.nbytes for e in entries], thread_count)
    else:
        buckets = [[i] for i in range(len(entries))] or [[]]
    return layout_buckets(entries, buckets, rank=rank)


def hash_file(path: Path) -> StoredFile:
    """Size and XXH3-64 digest of the file at ``path``, read in 8 MiB chunks.

    :raises OSError: from the file system.
    """
    h = xxhash.xxh3_64()
    nbytes = 0
    with open(path, "rb") as f:
        while chunk := f.read(_HASH_CHUNK):
            h.update(chunk)
            nbytes += len(chunk)
    return StoredFile(path.name, nbytes, h.hexdigest())


def _distcp_writer(path: Path | str, options: dict[str, Any]) -> FileSystemWriter:
    extra: dict[str, Any] = {}
    if options["serialization_format"] is not None:
        extra["serialization_format"] = options["serialization_format"]
    return FileSystemWriter(
        path,
        single_file_per_rank=options["single_file_per_rank"],
        sync_files=True,  # asyncsave always fsyncs (see StorageWriter.sync_files)
        thread_count=options["thread_count"],
        per_thread_copy_ahead=options["per_thread_copy_ahead"],
        overwrite=True,  # a fresh temporary directory: nothing to overwrite
        _extensions=list(options["extensions"]),
        **extra,
    )


def distcp_reader(path: Path, registry: Any) -> FileSystemReader:
    """torch's reader of a checkpoint in DCP's own format at ``path``, with the
    stream transforms of ``registry`` (``None``: DCP's default)."""
    if registry is None:
        return FileSystemReader(path)
    return FileSystemReader(path, _extension_registry=registry)


def distcp_global_plan(plans: list[SavePlan]) -> list[SavePlan]:
    """DCP's global plan for its own files: each rank's file names prefixed
    ``__<rank>_`` (``FileSystemWriter.prepare_global_plan``, which touches no
    file), so that every rank's files keep their names in one directory."""
    return FileSystemWriter(os.devnull).prepare_global_plan(plans)


def write_distcp_part(
    tmp: Path,
    plan: SavePlan,
    planner: SavePlanner,
    *,
    is_coordinator: bool,
    rank: int,
    options: dict[str, Any],
) -> tuple[list[WriteResult], dict[str, StoredFile]]:
    """Write this rank's items into ``tmp`` in DCP's own format through torch's
    ``FileSystemWriter`` (stream transforms applied, every file fsynced), then
    checksum each stored file.

    :param options: the writer's ``FileSystemWriter`` keywords (``extensions``
        for ``_extensions``).
    :returns: DCP's write results (their ``storage_data`` DCP's own) and every file
        written, by name.
    :raises OSError: from the file system (partial files stay in ``tmp``); with
        ``EIO`` when an item got no write result (a writer thread of torch's
        failed), naming it.
    """
    inner = _distcp_writer(tmp, options)
    inner.set_up_storage_writer(is_coordinator, rank=rank)
    results: list[WriteResult] = inner.write_data(plan, planner).wait()
    _check_every_item_written(plan, results, tmp)
    names = sorted({wr.storage_data.relative_path for wr in results})
    return results, {n: hash_file(tmp / n) for n in names}


def _check_every_item_written(plan: SavePlan, results: list[WriteResult], tmp: Path) -> None:
    """torch's ``FileSystemWriter`` loses the exception of an extra writer thread
    (``thread_count > 1``: the thread dies, its items get no result) and returns
    the others' results: a save committed from them would lack those items.

    :raises OSError: (``EIO``) an item of ``plan`` has no write result, naming it.
    """
    done = {wr.index for wr in results}
    missing = [it.index.fqn for it in plan.items if it.index not in done]
    if missing:
        raise OSError(
            errno.EIO,
            f"DCP's FileSystemWriter returned no write result for {len(missing)} item(s) "
            f"(first: {missing[0]!r}): one of its writer threads failed (its error went "
            "to threading.excepthook); nothing of this save is committed",
            str(tmp),
        )


def verify_stored(fs: LocalFileSystem, directory: Path, names: Iterable[str]) -> None:
    """Check the stored files ``names`` of a checkpoint in DCP's own format
    (written with ``_extensions``) against their manifest records
    (``dcp_files``): size and XXH3-64 of the stored (compressed) bytes.

    :raises CorruptCheckpointError: a file has no entry in the manifest.
    :raises ChecksumMismatchError: a file's size or digest differs (names it).
    :raises OSError: from the file system.
    """
    doc = json.loads(fs.read_bytes(directory / MANIFEST_NAME))
    by_name = {e.get("name"): e for e in doc.get("dcp_files", [])}
    for name in sorted(names):
        path = directory / name
        rec = by_name.get(name)
        if rec is None:
            raise CorruptCheckpointError(f"{path} is not in the manifest", path=path)
        got = hash_file(path)
        if got.nbytes != rec.get("nbytes") or got.checksum != rec.get(CHECKSUM):
            raise ChecksumMismatchError(
                f"{path}: stored bytes do not match their checksum", path=path
            )
