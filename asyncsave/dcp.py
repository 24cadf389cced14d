"""A ``torch.distributed.checkpoint`` (DCP) storage backend that commits like asyncsave.

``dcp.save`` / ``dcp.async_save`` / ``dcp.load`` work unchanged with these classes;
what changes is where the bytes go and when they become a checkpoint::

    import torch.distributed.checkpoint as dcp
    from asyncsave.dcp import StorageReader, StorageWriter

    dcp.save(state, storage_writer=StorageWriter("runs/exp1", step=40))
    # runs/exp1/step_40/ committed (rename + tracker) inside finish()
    dcp.load(state, storage_reader=StorageReader("runs/exp1"))   # latest committed

The call sequence (DCP's, see ``torch.distributed.checkpoint.storage``) and who does
what:

1. (all ranks) ``set_up_storage_writer``: remember the rank.
2. (all ranks) ``prepare_local_plan``: unchanged.
3. (coordinator) ``prepare_global_plan``: create ``root`` and a fresh temporary
   directory under it (a name no resolver takes for a checkpoint), and tell every
   rank its name and rank through ``SavePlan.storage_data``.
4. (all ranks) ``write_data``: every item of the rank's plan into one safetensors
   file ``data-r<rank>-000.safetensors`` in the temporary directory, checksummed
   (XXH3-64) on the way and fsynced before the future resolves. Tensors keep their
   dtype in the safetensors header where safetensors has one; byte items (DCP's
   ``BytesIO`` entries) and other dtypes are ``U8`` runs.
5. (coordinator, after DCP gathered every rank's results, i.e. after every rank's
   files are durable) ``finish``: DCP's ``Metadata`` into ``.metadata`` (pickled,
   as DCP's own ``FileSystemWriter`` does), asyncsave's ``manifest.json`` (every data
   file with its size, every item with its checksum, and the size and checksum of
   ``.metadata``), then the commit: fsync, ``rename`` to ``step_<N>``, fsync the
   root, move the tracker forward. A crash at any point before the rename leaves
   only a temporary directory, which the next :class:`~asyncsave.Checkpointer`
   open removes; nothing half-written ever carries a final name.

Both classes are plain picklable dataclasses (paths and ints), so DCP's process
executor (``async_checkpointer_type=AsyncCheckpointerType.PROCESS``) can ship the
writer to its background process.

The standalone writer does not take the root's saver lock (that belongs to a
:class:`~asyncsave.Checkpointer`); do not run a ``Checkpointer`` that opens the same
root while a ``dcp.save`` into it is in flight: its recovery removes temporary
directories. To save DTensor / FSDP2 state from a ``Checkpointer`` instead, pass it
to :meth:`Checkpointer.save` (see ``asyncsave._dist``): it routes through DCP's
planner and this writer under asyncsave's own collective commit.

Reading: :class:`StorageReader` checks the manifest (and the checksum of
``.metadata`` before unpickling it) and every item's checksum while reading, then
hands tensors to DCP's planner, which reshards: a checkpoint written by N ranks
loads on M ranks.
"""

from __future__ import annotations

import dataclasses
import io
import json
import os
import pickle
import time
import uuid
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch
import xxhash
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, StorageMeta
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    SavePlan,
    SavePlanner,
    WriteItemType,
)
from torch.distributed.checkpoint.storage import StorageReader as _DcpStorageReader
from torch.distributed.checkpoint.storage import StorageWriter as _DcpStorageWriter
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from ._commit import commit_dir, make_temp_dir
from ._errors import (
    CheckpointError,
    CheckpointNotFoundError,
    ChecksumMismatchError,
    CorruptCheckpointError,
)
from ._format import SAFETENSORS_DTYPES, layout_files, staging_nbytes
from ._fs import LocalFileSystem
from ._load import latest, read_checkpoint
from ._manifest import CHECKSUM, FORMAT, FORMAT_VERSION, encode_manifest, torch_dtype
from ._paths import LAYOUTS, MANIFEST_NAME
from ._plan import Entry
from ._stage import _copy_cpu
from ._track import TrackerWriter, read_tracker
from ._write import write_bytes, write_data_file

__all__ = ["DCP_METADATA_NAME", "ItemLocation", "StorageReader", "StorageWriter"]

DCP_METADATA_NAME = ".metadata"
_BLOB_ALIGN = 16


@dataclasses.dataclass(frozen=True)
class ItemLocation:
    """Where one DCP item lives: ``WriteResult.storage_data`` and the values of
    ``Metadata.storage_data``.

    :param name: the item's name in the data file's safetensors header.
    :param file: data file name in the checkpoint directory.
    :param offset: absolute byte offset of the item in ``file``.
    :param nbytes: bytes of the item (a tensor chunk's raw bytes, or a byte item).
    :param entry_nbytes: bytes of the manifest entry (``nbytes`` padded to 16 for
        ``U8`` runs); ``checksum`` covers these.
    :param checksum: XXH3-64 hex digest of the entry's bytes.
    :param dtype: the tensor's dtype name (``"bfloat16"``), ``None`` for byte items.
    :param shape: the tensor chunk's shape, ``None`` for byte items.
    :param file_nbytes: the size of ``file``.
    """

    name: str
    file: str
    offset: int
    nbytes: int
    entry_nbytes: int
    checksum: str
    dtype: str | None
    shape: tuple[int, ...] | None
    file_nbytes: int


@dataclasses.dataclass(frozen=True)
class _Part:
    """``SavePlan.storage_data`` from the coordinator: the shared temporary
    directory (a name under ``root``) and the rank this plan belongs to."""

    tmp: str
    rank: int


def _entry_of(name: str, t: torch.Tensor) -> tuple[Entry, int]:
    """An asyncsave file entry for one item (a contiguous CPU tensor)."""
    if t.dtype in SAFETENSORS_DTYPES and t.dtype != torch.complex64:
        nbytes = t.numel() * t.element_size()
        return (
            Entry(name, t, nbytes, t.element_size(), False, t.dtype, tuple(t.shape)),
            nbytes,
        )
    raw = t.reshape(-1).view(torch.uint8) if t.numel() else torch.empty(0, dtype=torch.uint8)
    n = raw.numel()
    padded = -(-n // _BLOB_ALIGN) * _BLOB_ALIGN
    return Entry(name, raw, padded, _BLOB_ALIGN, True, torch.uint8, (padded,)), n


def write_part(
    fs: LocalFileSystem, tmp: Path, rank: int, items: list[tuple[str, torch.Tensor]]
) -> list[ItemLocation]:
    """Write one rank's items into ``tmp`` as one safetensors file, fsynced.

    :param items: ``(unique name, contiguous CPU tensor)``; byte items as ``uint8``.
    :returns: one :class:`ItemLocation` per item, in order.
    :raises OSError: from the file system (the partial file stays in ``tmp``).
    """
    entries: list[Entry] = []
    lengths: list[int] = []
    for name, t in items:
        entry, n = _entry_of(name, t)
        entries.append(entry)
        lengths.append(n)
    layouts = layout_files(entries, rank=rank, max_files=1)
    buffer = torch.empty(staging_nbytes(layouts), dtype=torch.uint8)
    _copy_cpu(buffer, entries)
    for fl in layouts:
        for i, digest in write_data_file(fs, tmp, fl, entries, buffer).items():
            entries[i].digest = digest
    out = []
    for (name, t), e, n in zip(items, entries, lengths, strict=True):
        fl = layouts[e.file]
        out.append(
            ItemLocation(
                name=name,
                file=fl.name,
                offset=e.offset,
                nbytes=n,
                entry_nbytes=e.nbytes,
                checksum=e.digest,
                dtype=str(t.dtype).removeprefix("torch.") if t is not None else None,
                shape=tuple(t.shape),
                file_nbytes=fl.nbytes,
            )
        )
    return out


def dcp_manifest_doc(
    step: int, results: list[list[WriteResult]], metadata_blob: bytes
) -> dict[str, Any]:
    """asyncsave's manifest of a DCP checkpoint: every data file with its size,
    every item as an entry with its checksum, ``.metadata``'s size and checksum,
    and a ``{"type": "dcp"}`` tree (``asyncsave.load`` refuses it, pointing here)."""
    files: list[dict[str, Any]] = []
    index: dict[str, int] = {}
    entries: list[dict[str, Any]] = []
    for rank_results in results:
        for wr in rank_results:
            loc = wr.storage_data
            if not isinstance(loc, ItemLocation):
                raise CheckpointError(f"write result {wr.index} has no asyncsave location")
            if loc.file not in index:
                index[loc.file] = len(files)
                files.append({"name": loc.file, "nbytes": loc.file_nbytes})
            entries.append(
                {
                    "name": loc.name,
                    "file": index[loc.file],
                    "offset": loc.offset,
                    "nbytes": loc.entry_nbytes,
                    CHECKSUM: loc.checksum,
                }
            )
    return {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "step": step,
        "world_size": max(1, len(results)),
        "checksum": CHECKSUM,
        "created_unix_s": time.time(),
        "files": files,
        "entries": entries,
        "tensors": [],
        "tree": {"type": "dcp"},
        "dcp_metadata": {
            "name": DCP_METADATA_NAME,
            "nbytes": len(metadata_blob),
            CHECKSUM: xxhash.xxh3_64_hexdigest(metadata_blob),
        },
        "costs": {},
    }


def _item_name(index: MetadataIndex) -> str:
    offset = "" if index.offset is None else ",".join(str(o) for o in index.offset)
    return f"{index.fqn}@{offset}"


def _resolve_item(planner: SavePlanner, item: Any) -> torch.Tensor:
    data = planner.resolve_data(item)
    if item.type == WriteItemType.BYTE_IO:
        raw = data.getvalue() if isinstance(data, io.BytesIO) else bytes(data)
        return (
            torch.frombuffer(bytearray(raw), dtype=torch.uint8)
            if raw
            else torch.empty(0, dtype=torch.uint8)
        )
    if not isinstance(data, torch.Tensor):
        raise CheckpointError(f"DCP item {item.index.fqn!r} resolved to {type(data).__name__}")
    t = data.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    return t.contiguous()


@dataclasses.dataclass
class StorageWriter(_DcpStorageWriter):
    """DCP storage writer: files into a temporary directory under ``root``,
    committed as ``<root>/step_<step>`` (rename + tracker) in :meth:`finish`.

    :param root: the checkpoint root (local or shared file system path).
    :param step: the training step this checkpoint is named after.
    :param layout: asyncsave layout preset of the final name and tracker.
    :param filesystem: the I/O layer (tests inject faults through it).
    :raises CheckpointError: from :meth:`finish` when ``step_<step>`` exists already
        (a checkpoint is never replaced by a DCP save); from ``set_up_storage_writer``
        for ``dcp.save(..., use_collectives=False)`` on several ranks (each rank would
        commit alone; DCP's own writer then writes per-rank metadata instead).
    """

    root: str
    step: int
    layout: str = "asyncsave"
    filesystem: LocalFileSystem = dataclasses.field(default_factory=LocalFileSystem)
    # Set by asyncsave's own collective commit (Checkpointer.save of DTensor state):
    # write into this existing temporary directory and do not commit in finish().
    _tmp: str | None = None
    _commit: bool = True
    rank: int = 0
    is_coordinator: bool = False
    manifest_doc: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        self.root = os.fspath(self.root)
        if type(self.step) is not int or self.step < 0:
            raise ValueError(f"step={self.step!r} must be a non-negative int")
        if self.layout not in LAYOUTS:
            raise ValueError(f"layout={self.layout!r} is not one of {sorted(LAYOUTS)}")

    # 0
    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        """A new save begins; a ``checkpoint_id`` given to ``dcp.save`` is the root."""
        if checkpoint_id is not None:
            self.root = os.fspath(checkpoint_id)
        self.manifest_doc = None

    # 1
    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.is_coordinator = is_coordinator
        self.rank = int(kwargs.get("rank", self.rank))
        if kwargs.get("use_collectives", True) is False and _several_ranks():
            # Without collectives every rank would plan, write and commit alone:
            # the first rank to finish would publish only its own items as step_N.
            raise CheckpointError(
                "asyncsave.dcp.StorageWriter commits one checkpoint for all ranks and "
                "needs dcp.save(..., use_collectives=True) when torch.distributed has "
                "several ranks",
                step=self.step,
                rank=self.rank,
            )

    # 2
    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        return plan

    # 3
    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        fs, root = self.filesystem, Path(self.root)
        if self._tmp is None:
            fs.makedirs(root)
            self._tmp = make_temp_dir(fs, root, self.step).name
        return [
            dataclasses.replace(p, storage_data=_Part(self._tmp, r)) for r, p in enumerate(plans)
        ]

    # 4
    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        part = plan.storage_data
        if not isinstance(part, _Part):
            raise CheckpointError("asyncsave.dcp.StorageWriter got a plan it did not prepare")
        self._tmp = part.tmp
        items = [
            (f"{i:06d}:{_item_name(it.index)}", _resolve_item(planner, it))
            for i, it in enumerate(plan.items)
        ]
        locs = write_part(self.filesystem, Path(self.root) / part.tmp, part.rank, items)
        results = []
        for it, loc in zip(plan.items, locs, strict=True):
            if it.type == WriteItemType.BYTE_IO:
                loc = dataclasses.replace(loc, dtype=None, shape=None)
            results.append(WriteResult(index=it.index, size_in_bytes=loc.nbytes, storage_data=loc))
        fut: Future[list[WriteResult]] = Future()
        fut.set_result(results)
        return fut

    # 5
    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        assert self._tmp is not None
        fs, root = self.filesystem, Path(self.root)
        tmp = root / self._tmp
        metadata.storage_data = {wr.index: wr.storage_data for rr in results for wr in rr}
        blob = pickle.dumps(metadata)
        write_bytes(fs, tmp / DCP_METADATA_NAME, blob)
        doc = dcp_manifest_doc(self.step, results, blob)
        if not self._commit:
            self.manifest_doc = doc
            return
        write_bytes(fs, tmp / MANIFEST_NAME, encode_manifest(doc))
        layout = LAYOUTS[self.layout]
        final = root / layout.dir_name(self.step)
        try:
            commit_dir(fs, tmp, final, overwrite=False)
        except FileExistsError as exc:
            raise CheckpointError(
                f"{final} exists already; a DCP save never replaces a checkpoint",
                step=self.step,
                path=final,
            ) from exc
        if layout.tracker_name is not None:
            tracker = root / layout.tracker_name
            try:
                highest = read_tracker(fs, tracker)
            except CorruptCheckpointError:
                highest = None
            TrackerWriter(fs, tracker, highest).advance(self.step)

    def storage_meta(self) -> StorageMeta | None:
        return StorageMeta(checkpoint_id=self.root)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return False  # never picked automatically: construct it explicitly


@dataclasses.dataclass
class StorageReader(_DcpStorageReader):
    """DCP storage reader of checkpoints written through :class:`StorageWriter` (or
    by :meth:`Checkpointer.save` of DTensor state).

    DCP's ``.metadata`` is a pickle (DCP's own format); it is unpickled only after
    its size and XXH3-64 match the manifest, which guards against damage, not
    against a forged checkpoint: read only checkpoints you trust, as with DCP.

    :param path: a checkpoint directory (``runs/exp1/step_40``), or a root, which
        resolves to the checkpoint its tracker names (:func:`asyncsave.latest`) each
        time a load begins (``read_metadata``), so a reader kept across loads follows
        new commits.
    :param verify: check every item's XXH3-64 checksum while reading.
    :param load_id: DCP's id of this load, recorded in
        ``read_metadata().storage_meta.load_id`` (as ``FileSystemReader`` does); a
        fresh UUID at construction and at every ``reset``.
    :raises CheckpointNotFoundError: (from ``read_metadata``) nothing committed there.
    :raises CorruptCheckpointError: damaged manifest, ``.metadata`` or data file;
        :class:`ChecksumMismatchError` for altered bytes.
    """

    path: str
    verify: bool = True
    filesystem: LocalFileSystem = dataclasses.field(default_factory=LocalFileSystem)
    _metadata: Metadata | None = None
    _dir: str | None = None
    load_id: str = dataclasses.field(default_factory=lambda: str(uuid.uuid4()))

    def __post_init__(self) -> None:
        self.path = os.fspath(self.path)

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        if checkpoint_id is not None:
            self.path = os.fspath(checkpoint_id)
        self._dir = None
        self._metadata = None
        self.load_id = str(uuid.uuid4())

    def checkpoint_dir(self) -> Path:
        """The checkpoint directory this reader reads (a root resolves to its latest)."""
        if self._dir is None:
            p = Path(self.path)
            if not self.filesystem.exists(p / MANIFEST_NAME):
                info = latest(p, filesystem=self.filesystem)
                if info is None:
                    raise CheckpointNotFoundError(f"no committed checkpoint in {p}", path=p)
                p = Path(info.path)
            self._dir = os.fspath(p)
        return Path(self._dir)

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        self._dir = None  # a load begins: a root resolves to its latest now
        fs, path = self.filesystem, self.checkpoint_dir()
        read_checkpoint(fs, path)  # validates the manifest and every file's size
        doc = json.loads(fs.read_bytes(path / MANIFEST_NAME))
        meta = doc.get("dcp_metadata")
        if not isinstance(meta, dict) or meta.get("name") != DCP_METADATA_NAME:
            raise CorruptCheckpointError(
                f"{path} was not written through torch.distributed.checkpoint; load it "
                "with asyncsave.load()",
                path=path,
            )
        mpath = path / DCP_METADATA_NAME
        try:
            blob = fs.read_bytes(mpath)
        except FileNotFoundError as exc:
            raise CorruptCheckpointError(f"{mpath} is missing", path=mpath) from exc
        if len(blob) != meta.get("nbytes") or xxhash.xxh3_64_hexdigest(blob) != meta.get(CHECKSUM):
            raise ChecksumMismatchError(
                f"{mpath} does not match the size and checksum in the manifest", path=mpath
            )
        # DCP's Metadata is a pickle (as with DCP's FileSystemReader); its bytes
        # are the ones the manifest's checksum names, so it is the one we wrote.
        metadata = pickle.loads(blob)
        if not isinstance(metadata, Metadata):
            raise CorruptCheckpointError(f"{mpath} holds no DCP Metadata", path=mpath)
        # As DCP's FileSystemReader: the reading side records its load id.
        if metadata.storage_meta is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def set_up_storage_reader(
        self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any
    ) -> None:
        self._metadata = metadata

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        assert self._metadata is not None and self._metadata.storage_data is not None
        path = self.checkpoint_dir()
        by_file: dict[str, list[Any]] = defaultdict(list)
        for req in plan.items:
            loc = self._metadata.storage_data[req.storage_index]
            by_file[loc.file].append((req, loc))
        for name, reqs in by_file.items():
            fpath = path / name
            with open(fpath, "rb") as f:
                for req, loc in reqs:
                    f.seek(loc.offset)
                    raw = f.read(loc.entry_nbytes)
                    if len(raw) != loc.entry_nbytes:
                        raise CorruptCheckpointError(f"{fpath} is truncated", path=fpath)
                    if self.verify and xxhash.xxh3_64_hexdigest(raw) != loc.checksum:
                        raise ChecksumMismatchError(
                            f"{fpath}: bytes of {req.storage_index.fqn!r} do not match "
                            "their checksum",
                            path=fpath,
                            key=req.storage_index.fqn,
                        )
                    if req.type == LoadItemType.BYTE_IO:
                        planner.load_bytes(req, io.BytesIO(raw[: loc.nbytes]))
                        continue
                    dtype = torch_dtype(loc.dtype)
                    if dtype is None or loc.shape is None:
                        raise CorruptCheckpointError(
                            f"{fpath}: item {req.storage_index.fqn!r} has no dtype", path=fpath
                        )
                    t = _from_bytes(raw[: loc.nbytes], dtype, loc.shape)
                    for dim, (off, length) in enumerate(
                        zip(req.storage_offsets, req.lengths, strict=True)
                    ):
                        t = t.narrow(dim, off, length)
                    target = planner.resolve_tensor(req).detach()
                    target.copy_(t)
                    planner.commit_tensor(req, target)
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return False


def _several_ranks() -> bool:
    """Whether this process is one of several ranks of an initialised process group."""
    dist = torch.distributed
    return bool(dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1)


def _from_bytes(raw: bytes, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    if not raw:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(dtype).reshape(shape)
