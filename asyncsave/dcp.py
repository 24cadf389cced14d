"""A ``torch.distributed.checkpoint`` (DCP) storage backend that commits like asyncsave.

``dcp.save`` / ``dcp.async_save`` / ``dcp.load`` work unchanged with these classes;
what changes is where the bytes go and when they become a checkpoint::

    import torch.distributed.checkpoint as dcp
    from asyncsave.dcp import StorageReader, StorageWriter

    dcp.save(state, storage_writer=StorageWriter("runs/exp1", step=40))
    # runs/exp1/step_40/ committed (rename + tracker) inside finish()
    dcp.load(state, storage_reader=StorageReader("runs/exp1"))   # latest committed

Saving while training goes on (FSDP2 on several ranks): use :func:`async_save`
(``asyncsave.dcp.async_save(state, storage_writer=StorageWriter(...))``), or pass
``process_group=asyncsave.dcp.side_group()`` to ``dcp.async_save``. DCP's
``async_save`` on the default group runs the save's collectives in a background
thread on the group the next training step's all-gathers use, and the ranks hang
or abort with gloo's "collective mismatch" (DCP's own ``FileSystemWriter`` does the
same); a side group of gloo keeps them apart. See ``examples/fsdp2_train.py``.

The call sequence (DCP's, see ``torch.distributed.checkpoint.storage``) and who does
what. DCP runs every call of one save in one thread (the caller's, or the
background thread of ``dcp.async_save``); the writer keeps each save's state per
thread, so one writer object serves saves one after another or overlapping.

0. (all ranks, only when ``dcp.save`` gets a ``checkpoint_id``) ``reset``: a final
   name under a root (``runs/exp1/step_40``) names this save's root and step; any
   other path is the root.
1. (all ranks) ``storage_meta``, ``set_up_storage_writer``: the save begins; its
   root, step and a fresh save id are fixed.
2. (all ranks) ``prepare_local_plan``: a step that is committed already is refused
   here, before anything is written.
3. (coordinator) ``prepare_global_plan``: unchanged. No plan carries anything of
   one save: DCP's plan caching (``DefaultSavePlanner(enable_plan_caching=True)``)
   hands a rank its first save's plan again in later saves.
4. (all ranks) ``write_data``: a rank with items creates a temporary directory of
   its own under ``root`` (a name no resolver takes for a checkpoint) and writes
   every item into one safetensors file ``data-r<rank>-000.safetensors`` there,
   checksummed (XXH3-64) on the way and fsynced before the future resolves. Tensors
   keep their dtype in the safetensors header where safetensors has one; byte items
   (DCP's ``BytesIO`` entries) and other dtypes are ``U8`` runs. The directory's
   name travels to the coordinator in the write results.
5. (coordinator, after DCP gathered every rank's results, i.e. after every rank's
   files are durable) ``finish``: the other ranks' files move (``rename``) into the
   coordinator's directory; DCP's ``Metadata`` (with ``storage_meta``: the final
   directory as ``checkpoint_id`` and the save id) into ``.metadata`` (pickled, as
   DCP's own ``FileSystemWriter`` does); asyncsave's ``manifest.json`` (every data
   file with its size, every item with its checksum, and the size and checksum of
   ``.metadata``); then the commit under the root's saver lock (``.asyncsave.lock``,
   the lock an open :class:`~asyncsave.Checkpointer` holds): refuse a final name
   that exists, fsync, ``rename`` to ``step_<N>``, fsync the root, and move the
   tracker forward only (read, compare, write, all under the lock: writers that
   finish in any order, in any threads or processes, leave it at the highest step).
   A refusal or failure before the rename removes every rank's temporary
   directory; a crash leaves only temporary directories, which the next
   :class:`~asyncsave.Checkpointer` open removes; nothing half-written ever carries
   a final name.

:class:`StorageWriter` takes every keyword of torch 2.13's ``FileSystemWriter``,
by keyword only (the argument after ``root`` is ``step``; a ``bool`` there, as in
``FileSystemWriter(path, False)``, is an ``InvalidStepError`` that says so):

- ``thread_count``: files per rank, each written by a thread of its own
  (items spread by size, as ``FileSystemWriter`` does).
- ``single_file_per_rank``: ``False``: one file per item.
- ``overwrite``: replace a committed ``step_<step>``: the new save is
  committed by the root's commit protocol with ``overwrite`` (an atomic
  ``RENAME_EXCHANGE``, as ``CheckpointOptions(overwrite=True)`` does for
  :meth:`Checkpointer.save`; readers see the old checkpoint or the new one,
  never neither). Default ``False``, unlike DCP's ``True``: a committed
  checkpoint is replaced only when asked (refused as DCP refuses with
  ``overwrite=False``).
- ``_extensions``: DCP's stream transforms (``[ZStandard()]``): the save is
  written in DCP's own ``.distcp`` format by torch's ``FileSystemWriter``
  into the temporary directory (each stored, compressed, file checksummed
  with XXH3-64), then committed and tracked as any other; it is no longer
  safetensors. :class:`StorageReader` and ``FileSystemReader`` read it. Its data
  files go through torch's file layer, not ``filesystem`` (which sees the commit).
- ``serialization_format``: ``None`` (default: DCP's, ``TORCH_SAVE``) or a
  ``SerializationFormat``, used with ``_extensions`` (DCP's files); the default
  files are safetensors whatever its value.
- ``sync_files``: accepted; every file is fsynced whatever its value (the
  commit's guarantees rest on it).
- ``per_thread_copy_ahead``: used with ``_extensions`` (DCP's GPU copy-ahead);
  otherwise accepted without effect: items are copied to host memory before
  the files are written.
- ``cache_staged_state_dict``: accepted without effect: this writer is no
  ``AsyncStager``; staging is DCP's stager's (``dcp.async_save(...,
  async_stager=...)``).

Both classes are plain picklable dataclasses (paths and ints), so DCP's process
executor (``async_checkpointer_type=AsyncCheckpointerType.PROCESS``) can ship the
writer to its background process.

The standalone writer holds the root's saver lock only for its commit: a ``finish``
while a :class:`~asyncsave.Checkpointer` has the same root open waits up to
``lock_timeout_s`` and then raises ``RootInUseError`` (nothing committed, nothing
left). A ``Checkpointer`` may be opened on the root while a ``dcp.save`` into it is
in flight (in any thread or process): every temporary directory the writer makes
is ``flock``-ed from its creation to its commit or removal, and recovery leaves
those it cannot lock (a crashed writer's lock is gone with it, so its leftovers are
removed). To save DTensor / FSDP2 state
from a ``Checkpointer`` instead, pass it to :meth:`Checkpointer.save` (see
``asyncsave._dist``): it routes through DCP's planner and this writer under
asyncsave's own collective commit (one shared temporary directory, committed by the
engine).

Reading: :class:`StorageReader` resolves a root with the writer's ``layout`` (a root
of another layout is a ``CheckpointNotFoundError`` naming the one to pass), checks
the manifest (and the checksum of ``.metadata`` before unpickling it) and every
item's checksum while reading, sets ``storage_meta.load_id``, then hands tensors to
DCP's planner, which reshards: a checkpoint written by N ranks loads on M ranks.

Sources: https://github.com/thinking-machines-lab/tinker-cookbook/pull/687 (an older async save that
finished late was recorded as the latest), and PyTorch's own DCP tests, run
against this backend (``tests/test_dcp_conformance.py``).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import io
import os
import pickle
import threading
import time
import uuid
import weakref
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import xxhash
from torch.distributed.checkpoint import filesystem as _dcp_filesystem
from torch.distributed.checkpoint.filesystem import _StorageInfo
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

from ._atomicity import (
    CommitStrategy,
    RenameCommit,
    discard,
    make_held_temp_dir,
    move_files,
    strategy_for,
)
from ._bits import clone_bits, flat_bytes
from ._catalog import latest
from ._commit import hold_root
from ._dcp_read import DCP_METADATA_NAME, read_dcp_metadata
from ._dcp_write import (
    StoredFile,
    check_writer_options,
    distcp_global_plan,
    distcp_reader,
    lay_out,
    verify_stored,
    write_distcp_part,
    write_layouts,
)
from ._errors import (
    CheckpointError,
    CheckpointNotFoundError,
    CheckpointTimeoutError,
    ChecksumMismatchError,
    CorruptCheckpointError,
    InvalidStepError,
    SaveFailedError,
)
from ._format import SAFETENSORS_DTYPES, staging_nbytes
from ._fs import LocalFileSystem, check_lock_mode, holds_lock
from ._fsspec import check_root, is_url
from ._jobs import Job, Services, register_job
from ._manifest import CHECKSUM, FORMAT, FORMAT_VERSION, encode_manifest, torch_dtype
from ._paths import LAYOUTS, MANIFEST_NAME
from ._plan import Entry
from ._stage import Lease, copy_cpu, destination
from ._track import advance_tracker
from ._write import write_bytes, write_data_file

__all__ = [
    "DCP_METADATA_NAME",
    "DTensorJob",
    "ItemLocation",
    "StorageReader",
    "StorageWriter",
    "async_save",
    "side_group",
]

_BLOB_ALIGN = 16


@dataclasses.dataclass(frozen=True)
class ItemLocation:
    """Where one DCP item lives: the values of ``Metadata.storage_data`` (and, with
    the rank's temporary directory, of ``WriteResult.storage_data``).

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


def _entry_of(name: str, t: torch.Tensor) -> tuple[Entry, int]:
    """An asyncsave file entry for one item (a contiguous CPU tensor)."""
    if t.dtype in SAFETENSORS_DTYPES and t.dtype != torch.complex64:
        nbytes = t.numel() * t.element_size()
        return (
            Entry(name, t, nbytes, t.element_size(), False, t.dtype, tuple(t.shape)),
            nbytes,
        )
    raw = flat_bytes(t)
    n = raw.numel()
    padded = -(-n // _BLOB_ALIGN) * _BLOB_ALIGN
    return Entry(name, raw, padded, _BLOB_ALIGN, True, torch.uint8, (padded,)), n


def write_part(
    fs: LocalFileSystem,
    tmp: Path,
    rank: int,
    items: list[tuple[str, torch.Tensor]],
    *,
    thread_count: int = 1,
    single_file_per_rank: bool = True,
) -> list[ItemLocation]:
    """Write one rank's items into ``tmp`` as safetensors files, fsynced:
    ``thread_count`` files of balanced size (fewer when there are fewer items),
    each written by a thread of its own, or one file per item
    (``single_file_per_rank=False``).

    :param items: ``(unique name, contiguous CPU tensor)``; byte items as ``uint8``.
    :returns: one :class:`ItemLocation` per item, in order.
    :raises OSError: from the file system (the partial files stay in ``tmp``).
    """
    entries: list[Entry] = []
    lengths: list[int] = []
    for name, t in items:
        entry, n = _entry_of(name, t)
        entries.append(entry)
        lengths.append(n)
    layouts = lay_out(
        entries, rank=rank, thread_count=thread_count, single_file_per_rank=single_file_per_rank
    )
    buffer = torch.empty(staging_nbytes(layouts), dtype=torch.uint8)
    copy_cpu(buffer, entries)
    written = write_layouts(
        layouts, thread_count, lambda fl: write_data_file(fs, tmp, fl, entries, buffer)
    )
    for digests in written:
        for i, digest in digests.items():
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
    step: int,
    results: list[list[WriteResult]],
    metadata_blob: bytes,
    *,
    stored: Sequence[StoredFile] = (),
) -> dict[str, Any]:
    """asyncsave's manifest of a DCP checkpoint: every data file with its size,
    every item as an entry with its checksum, ``.metadata``'s size and checksum,
    and a ``{"type": "dcp"}`` tree (``asyncsave.load`` refuses it, pointing here).

    :param stored: the files of DCP's own format (``_extensions``), recorded under
        ``dcp_files`` with their size and the checksum of their stored bytes
        (``files`` and ``entries`` list safetensors files only, which
        :func:`asyncsave.verify` opens); the results' locations are then DCP's.
    """
    files: list[dict[str, Any]] = []
    index: dict[str, int] = {}
    entries: list[dict[str, Any]] = []
    for rank_results in results if not stored else ():
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
        "dcp_files": [{"name": f.name, "nbytes": f.nbytes, CHECKSUM: f.checksum} for f in stored],
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
class _Save:
    """One save in flight through a :class:`StorageWriter`, kept per thread
    (``threading.local``): DCP runs every call of one save in the thread that called
    ``dcp.save`` (the background thread of ``dcp.async_save``), so saves that
    overlap through one writer object never share this state."""

    root: Path
    step: int
    save_id: str
    started: bool = False  # set_up_storage_writer ran: this save's calls follow
    rank: int = 0
    is_coordinator: bool = True
    tmp: str | None = None  # the temporary directory this rank wrote into
    # Locks held on this save's temporary directories (``lock_dir``), released
    # after the commit or the removal: recovery at a Checkpointer open skips them.
    held: list[int] = dataclasses.field(default_factory=list)


@dataclasses.dataclass(frozen=True)
class _Written:
    """``WriteResult.storage_data`` on its way from ``write_data`` (every rank) to
    ``finish`` (the coordinator): the item's location and the temporary directory
    the rank wrote it into (``None``: the shared one of asyncsave's own collective
    commit). Only ``loc`` is recorded in DCP's ``Metadata``."""

    loc: Any  # ItemLocation; DCP's own ``_StorageInfo`` with ``_extensions``
    tmp: str | None
    stored: StoredFile | None = None  # with ``_extensions``: the file ``loc`` is in


@dataclasses.dataclass
class StorageWriter(_DcpStorageWriter):
    """DCP storage writer: files into temporary directories under ``root``,
    committed as ``<root>/step_<step>`` (rename + tracker) in :meth:`finish`.

    One writer object may serve any number of saves, one after another or
    overlapping (``dcp.async_save``): name each save's step by setting :attr:`step`
    before a blocking ``dcp.save``, or (overlapping saves: the step travels with the
    call) by ``checkpoint_id=<root>/<final name>``, e.g. ``runs/exp1/step_40``.

    On several ranks, a save that runs while training goes on must not share the
    training's process group: use :func:`async_save` (or ``dcp.async_save(...,
    process_group=side_group())``), never ``dcp.async_save`` on the default group.

    :param root: the checkpoint root (local or shared file system path).
    :param step: the training step this checkpoint is named after.
    :param layout: asyncsave layout preset of the final name and tracker.
    :param filesystem: the I/O layer (tests inject faults through it).
    :param lock_timeout_s: how long :meth:`finish` waits for the root's saver lock
        (held for the rename and tracker update by each committing writer, and for
        its whole life by an open :class:`~asyncsave.Checkpointer`), in seconds.
    :param lock: ``"flock"`` (default): the root's saver lock around each commit
        and a lock on each temporary directory while it is written; a file system
        that refuses them raises :class:`~asyncsave.LockUnavailableError` (inside
        DCP's ``CheckpointException``), leaving nothing behind. ``"none"``: no
        lock, for file systems without ``flock`` (Lustre without ``-o flock``);
        the risk is that of ``CheckpointOptions.lock``: writers that commit into
        the root at the same moment may leave the tracker behind the newest step,
        and a :class:`~asyncsave.Checkpointer` opened meanwhile may remove this
        save's temporary directory. Use it where one process saves at a time.

    ``FileSystemWriter``'s keywords (``thread_count``, ``overwrite``,
    ``_extensions``...): keyword-only, see the module's documentation.

    :raises CheckpointError: (from ``prepare_local_plan``, before anything is
        written, or from :meth:`finish`) ``step_<step>`` exists already and not
        ``overwrite``: the message says DCP's words ("Checkpoint already exists
        and self.overwrite=False"). Nothing is left in ``root`` then.
    :raises TypeError: (on construction) a ``FileSystemWriter`` keyword of
        the wrong type (named); ``ValueError`` for one out of range.
    :raises RootInUseError: (from :meth:`finish`) the root's lock stayed held for
        ``lock_timeout_s``; nothing was committed, nothing is left in ``root``.
    :raises CheckpointError: (on construction) ``filesystem`` cannot move files
        (an object store), which the commit needs to gather every rank's files;
        ``root`` is a URL (``s3://``, ``memory://``; ``file://`` is a local path).
    :raises CheckpointError: (from ``set_up_storage_writer``) ``dcp.save(...,
        use_collectives=False)`` on several ranks (each rank would commit alone;
        DCP's own writer then writes per-rank metadata instead).
    """

    root: str
    step: int
    layout: str = "asyncsave"
    filesystem: LocalFileSystem = dataclasses.field(default_factory=LocalFileSystem)
    lock_timeout_s: float = 60.0
    lock: str = "flock"
    single_file_per_rank: bool = dataclasses.field(default=True, kw_only=True)
    sync_files: bool = dataclasses.field(default=True, kw_only=True)
    thread_count: int = dataclasses.field(default=1, kw_only=True)
    per_thread_copy_ahead: int = dataclasses.field(default=10_000_000, kw_only=True)
    cache_staged_state_dict: bool = dataclasses.field(default=False, kw_only=True)
    overwrite: bool = dataclasses.field(default=False, kw_only=True)
    _extensions: Sequence[Any] | None = dataclasses.field(default=None, kw_only=True)
    serialization_format: Any = dataclasses.field(default=None, kw_only=True)
    # Set by asyncsave's own collective commit (Checkpointer.save of DTensor state):
    # write into this existing temporary directory and do not commit in finish().
    _tmp: str | None = None
    _commit: bool = True
    manifest_doc: dict[str, Any] | None = None
    # This thread's save in flight (see _Save).
    _local: threading.local = dataclasses.field(
        default_factory=threading.local, init=False, repr=False, compare=False
    )

    # Locks of temporary directories this process wrote as a rank other than the
    # coordinator: held until the coordinator has moved the files out and removed
    # the directory, which no call of DCP tells this rank; released at this
    # writer's next save (those whose directory is gone) and when it is collected.
    _handed: dict[str, int] = dataclasses.field(
        default_factory=dict, init=False, repr=False, compare=False
    )
    _handed_lock: Any = dataclasses.field(
        default_factory=threading.Lock, init=False, repr=False, compare=False
    )
    _strategy: CommitStrategy = dataclasses.field(  # chosen once, from ``filesystem``
        default_factory=RenameCommit, init=False, repr=False, compare=False
    )

    def __post_init__(self) -> None:
        check_root(self.root, "StorageWriter root")
        self.root = os.fspath(self.root)
        if self.root.lower().startswith("file://"):
            self.root = self.root[len("file://") :]
        _check_step(self.step)
        if self.layout not in LAYOUTS:
            raise ValueError(f"layout={self.layout!r} is not one of {sorted(LAYOUTS)}")
        if not self.lock_timeout_s > 0:
            raise ValueError(f"lock_timeout_s={self.lock_timeout_s!r} must be > 0")
        check_lock_mode(self.lock)
        self._extensions = check_writer_options(**_options_of(self), extensions=self._extensions)
        self._strategy = _strategy_of(self.root, self.filesystem)
        weakref.finalize(self, _release_all, self.filesystem, self._handed)

    def __getstate__(self) -> dict[str, Any]:
        # Saves in flight and their locks stay with this process (DCP's process
        # executor pickles the writer to run the save in another process).
        skip = ("_local", "_handed", "_handed_lock")
        return {k: v for k, v in self.__dict__.items() if k not in skip}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._local = threading.local()
        self._handed = {}
        self._handed_lock = threading.Lock()
        weakref.finalize(self, _release_all, self.filesystem, self._handed)

    def _release(self, save: _Save) -> None:
        while save.held:
            self.filesystem.unlock(save.held.pop())

    def _hand_over(self, save: _Save) -> None:
        """Keep this rank's directory locked after its last call (see ``_handed``)."""
        if save.tmp is not None and save.held:
            with self._handed_lock:
                self._handed[os.fspath(save.root / save.tmp)] = save.held.pop()
        self._release(save)

    def _release_handed(self) -> None:
        """Release the locks of handed-over directories that are gone (committed or
        removed by the coordinator)."""
        with self._handed_lock:
            gone = [p for p in self._handed if not self.filesystem.exists(Path(p))]
            for p in gone:
                self.filesystem.unlock(self._handed.pop(p))

    # -- one save's state ---------------------------------------------------------
    def _final(self, save: _Save) -> Path:
        return save.root / LAYOUTS[self.layout].dir_name(save.step)

    def _fresh(self, root: str | None = None, step: int | None = None) -> _Save:
        """A new save of ``root`` and ``step`` (default: :attr:`root`, :attr:`step`)."""
        root = self.root if root is None else root
        step = self.step if step is None else step
        _check_step(step)
        return _Save(Path(root), step, str(uuid.uuid4()))

    def _upcoming(self) -> _Save:
        """This thread's save that has not begun yet (made by :meth:`reset` or
        :meth:`storage_meta`), or a new one from :attr:`root` and :attr:`step`
        (replacing one that began and failed)."""
        save: _Save | None = getattr(self._local, "save", None)
        if save is None or save.started:
            save = self._local.save = self._fresh()
        return save

    def _current(self) -> _Save:
        save: _Save | None = getattr(self._local, "save", None)
        if save is None or not save.started:
            raise CheckpointError(
                "asyncsave.dcp.StorageWriter: a write without set_up_storage_writer in "
                "this thread (use it through dcp.save / dcp.async_save)"
            )
        return save

    def _end(self) -> None:
        save: _Save | None = getattr(self._local, "save", None)
        if save is not None:
            self._local.last_id = save.save_id
        self._local.save = None

    @property
    def checkpoint_id(self) -> str:
        """The directory the current (or next) save of this thread commits."""
        save: _Save | None = getattr(self._local, "save", None)
        return os.fspath(self._final(save if save is not None else self._fresh()))

    @property
    def save_id(self) -> str:
        """The id (a UUID, fresh per save) of this thread's save in flight, else
        of its last one, else of its next one (fixed by this read); the
        coordinator's is ``Metadata.storage_meta.save_id``, as with DCP's writer."""
        save: _Save | None = getattr(self._local, "save", None)
        last: str | None = getattr(self._local, "last_id", None)
        if save is None and last is not None:
            return last
        return self._upcoming().save_id

    # 0
    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        """A new save begins (DCP calls this only when ``dcp.save`` is given a
        ``checkpoint_id``).

        :param checkpoint_id: a final name of :attr:`layout` under a root
            (``runs/exp1/step_40``: the root and the step of this save), or a root
            (the step stays :attr:`step`).
        """
        root, step = self.root, self.step
        if checkpoint_id is not None:
            check_root(checkpoint_id, "checkpoint_id")
            path = Path(os.fspath(checkpoint_id))
            parsed = LAYOUTS[self.layout].parse_dir_name(path.name)
            if parsed is None:
                root = os.fspath(path)
            else:
                root, step = os.fspath(path.parent), parsed
            # Kept for the saves that follow without a checkpoint_id (as DCP's own
            # writer does); this save's state is built from the parsed values,
            # never read back from these shared attributes, which another thread's
            # reset may have overwritten in between.
            self.root, self.step = root, step
        self.manifest_doc = None
        self._local.save = self._fresh(root, step)

    def storage_meta(self) -> StorageMeta | None:
        """What DCP records in ``Metadata.storage_meta``: ``checkpoint_id`` is the
        final directory of this save, ``save_id`` a fresh UUID per save."""
        save = self._upcoming()  # DCP asks before set_up_storage_writer
        return StorageMeta(checkpoint_id=os.fspath(self._final(save)), save_id=save.save_id)

    # 1
    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        """Begin this thread's save: its root and step are fixed from here on.

        :raises CheckpointError: ``use_collectives=False`` on several ranks (every
            rank would commit a checkpoint of its own items only).
        """
        save = self._upcoming()
        rank = kwargs.get("rank")
        if rank is None:
            rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        if not kwargs.get("use_collectives", True) and (rank != 0 or _several_ranks()):
            raise CheckpointError(
                "asyncsave.dcp.StorageWriter commits one checkpoint for all ranks: "
                "use_collectives=False is not supported on several ranks (each would "
                "commit its own items only); to save one process's state alone, pass "
                "no_dist=True and leave use_collectives at its default",
                rank=rank,
            )
        save.started, save.rank, save.is_coordinator = True, int(rank), is_coordinator
        self._release_handed()
        if self._commit:
            self.manifest_doc = None

    # 2
    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        """Refuse a step that is committed already, before anything is written."""
        save = self._current()
        final = self._final(save)
        if self._tmp is None and self.filesystem.exists(final):
            if not self.overwrite:
                raise _exists(final, save.step)
            self._strategy.check_overwrite(self.filesystem, final, save.step)
        return plan

    # 3
    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        """No plan carries anything of one save (DCP's plan caching replays a
        rank's first plan in later saves); with ``_extensions``, each rank's
        prefix of DCP's file names (``__<rank>_``), as ``FileSystemWriter`` sets."""
        return distcp_global_plan(plans) if self._extensions else plans

    # 4
    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        """This rank's items into one data file, fsynced, in a temporary directory
        of its own (or asyncsave's shared one); nothing when it has no items. A
        failure removes the directory."""
        save = self._current()
        try:
            if self._extensions:
                return _done(_write_distcp(self, save, plan, planner))
            items = [
                (f"{i:06d}:{_item_name(it.index)}", _resolve_item(planner, it))
                for i, it in enumerate(plan.items)
            ]
            locs: list[ItemLocation] = []
            if items:
                tmp = self._rank_dir(save)
                try:
                    locs = write_part(
                        self.filesystem,
                        tmp,
                        save.rank,
                        items,
                        thread_count=self.thread_count,
                        single_file_per_rank=self.single_file_per_rank,
                    )
                except BaseException:
                    self._drop_rank_dir(save, tmp)
                    raise
        finally:
            if not save.is_coordinator:
                self._hand_over(save)
                self._end()  # the coordinator's finish() is this save's last call
        results = []
        for it, loc in zip(plan.items, locs, strict=True):
            if it.type == WriteItemType.BYTE_IO:
                loc = dataclasses.replace(loc, dtype=None, shape=None)
            results.append(
                WriteResult(
                    index=it.index, size_in_bytes=loc.nbytes, storage_data=_Written(loc, save.tmp)
                )
            )
        return _done(results)

    def _rank_dir(self, save: _Save) -> Path:
        """The directory this rank writes into: asyncsave's shared one, or a
        temporary directory of its own, made and locked now."""
        if self._tmp is not None:
            return save.root / self._tmp
        self.filesystem.makedirs(save.root)
        tmp, fd = make_held_temp_dir(self.filesystem, save.root, save.step, lock=self.lock)
        if fd is not None:
            save.held.append(fd)
        save.tmp = tmp.name
        return tmp

    def _drop_rank_dir(self, save: _Save, tmp: Path) -> None:
        """A failed write: this rank's own directory goes (the shared one is the
        engine's)."""
        if save.tmp is not None:
            discard(self.filesystem, tmp)
            self._release(save)
            save.tmp = None

    # 5
    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """Commit: every rank's files into one directory, DCP's ``.metadata``, the
        manifest, then under the root's lock the rename and the tracker (forward
        only). A refusal or failure before the rename removes every rank's
        temporary directory.

        :raises CheckpointError: the step is committed already (by another writer
            since this save began).
        :raises RootInUseError: the root's lock stayed held for ``lock_timeout_s``.
        """
        save = self._current()
        try:
            self._finish(save, metadata, results)
        finally:
            self._release(save)  # committed (renamed) or removed by now
            self._end()

    def _finish(self, save: _Save, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        fs, root = self.filesystem, save.root
        # Every rank's own temporary directory (none in asyncsave's collective
        # commit, whose shared directory the engine owns and removes on failure).
        temps = sorted(
            {
                root / wr.storage_data.tmp
                for rank_results in results
                for wr in rank_results
                if isinstance(wr.storage_data, _Written) and wr.storage_data.tmp is not None
            }
        )
        try:
            self._commit_save(save, metadata, results, temps)
        except BaseException:
            # Before the rename: every rank's files go. After it (the tracker
            # failed) the checkpoint is under its final name, no temporary one.
            for path in temps:
                discard(fs, path)
            raise

    def _commit_save(
        self,
        save: _Save,
        metadata: Metadata,
        results: list[list[WriteResult]],
        temps: list[Path],
    ) -> None:
        """:meth:`finish` proper; appends the directory it creates to ``temps``."""
        fs, root, step = self.filesystem, save.root, save.step
        located, stored = _located(results)
        # DCP's Metadata version, as FileSystemWriter records it (None: torch has none)
        metadata.version = getattr(_dcp_filesystem, "CURRENT_DCP_VERSION", None)
        metadata.storage_data = {wr.index: wr.storage_data for rr in located for wr in rr}
        metadata.storage_meta = StorageMeta(
            checkpoint_id=os.fspath(self._final(save)), save_id=save.save_id
        )
        blob = pickle.dumps(metadata)
        doc = dcp_manifest_doc(step, located, blob, stored=stored)
        if not self._commit:
            assert self._tmp is not None
            write_bytes(fs, root / self._tmp / DCP_METADATA_NAME, blob)
            self.manifest_doc = doc
            return
        layout = LAYOUTS[self.layout]
        final = root / layout.dir_name(step)
        if fs.exists(final) and not self.overwrite:
            raise _exists(final, step)
        tmp = _gather(self, save, temps)
        write_bytes(fs, tmp / DCP_METADATA_NAME, blob)
        write_bytes(fs, tmp / MANIFEST_NAME, encode_manifest(doc))
        _publish(self, root, tmp, final, step)
        for other in temps:
            if other != tmp:
                discard(fs, other)  # another rank's, emptied above

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return False  # never picked automatically: construct it explicitly


def _write_distcp(
    writer: StorageWriter, save: _Save, plan: SavePlan, planner: SavePlanner
) -> list[WriteResult]:
    """``write_data`` with ``_extensions``: DCP's own files through torch's
    ``FileSystemWriter`` (see ``asyncsave._dcp_write``), each stored file
    checksummed."""
    if not plan.items:
        return []
    tmp = writer._rank_dir(save)
    try:
        results, stored = write_distcp_part(
            tmp,
            plan,
            planner,
            is_coordinator=save.is_coordinator,
            rank=save.rank,
            options={**_options_of(writer), "extensions": writer._extensions},
        )
    except BaseException:
        writer._drop_rank_dir(save, tmp)
        raise
    return [
        dataclasses.replace(
            wr,
            storage_data=_Written(wr.storage_data, save.tmp, stored[wr.storage_data.relative_path]),
        )
        for wr in results
    ]


def _gather(writer: StorageWriter, save: _Save, temps: list[Path]) -> Path:
    """The temporary directory that commits, every rank's files moved into it
    (made now if this rank wrote nothing, and appended to ``temps``)."""
    fs, root = writer.filesystem, save.root
    if save.tmp is None:  # this rank wrote nothing
        fs.makedirs(root)
        made, fd = make_held_temp_dir(fs, root, save.step, lock=writer.lock)
        if fd is not None:
            save.held.append(fd)
        temps.append(made)
    tmp = root / save.tmp if save.tmp is not None else temps[-1]
    for other in temps:
        if other != tmp:  # another rank's directory: its files move in, durably
            move_files(fs, other, tmp, fs.listdir(other), keep_src=True)
    return tmp


def _publish(writer: StorageWriter, root: Path, tmp: Path, final: Path, step: int) -> None:
    """Commit ``tmp`` (its manifest written, outside the lock) as ``final``
    through the root's commit protocol (``CommitStrategy.commit``, the call
    the engine's pipeline makes) and move the tracker forward, under the
    root's lock.

    :raises CheckpointError: ``final`` exists; or it is committed but its
        commit or the tracker could not be made durable (the next open
        finishes that).
    """
    fs, layout = writer.filesystem, LAYOUTS[writer.layout]
    with hold_root(fs, root, timeout_s=writer.lock_timeout_s, lock=writer.lock):
        if fs.exists(final) and not writer.overwrite:
            raise _exists(final, step)
        try:
            writer._strategy.commit(fs, tmp, final, overwrite=writer.overwrite)
        except OSError as exc:
            if fs.exists(tmp) or not fs.exists(final):
                raise  # before the rename: nothing committed, every directory goes
            raise CheckpointError(
                f"{final} is committed (renamed to its final name), but making the "
                f"rename durable (fsync of {root}) failed: {exc!r}; the tracker was "
                "not moved, the next Checkpointer open moves it",
                step=step,
                path=final,
            ) from exc
        if layout.tracker_name is not None:
            try:
                advance_tracker(fs, root / layout.tracker_name, step)
            except OSError as exc:
                raise CheckpointError(
                    f"{final} is committed, but moving the tracker failed: {exc!r}; "
                    "the next Checkpointer open moves it",
                    step=step,
                    path=final,
                ) from exc


def _strategy_of(root: str, fs: LocalFileSystem) -> CommitStrategy:
    """The commit protocol of the writer's ``root`` on ``fs``.

    :raises CheckpointError: it cannot move files between directories (an
        object store), which DCP's writer needs to gather every rank's files; or
        ``root`` is a URL on a local file system layer.
    """
    strategy = strategy_for(fs)
    if not strategy.can_move_files:
        raise CheckpointError(
            f"StorageWriter root {root!r}: {fs!r} cannot move files between "
            "directories (an object store), and DCP's writer moves every rank's "
            "files into one directory at the commit: write to a POSIX root",
            path=root,
        )
    if is_url(root):
        raise CheckpointError(
            f"StorageWriter root {root!r} is a URL: this writer commits by renaming "
            "on a local or shared POSIX file system (a URL would be written as a "
            "local directory of that name); save to a POSIX root and copy it to the "
            "object store with a persistent Tier (asyncsave.Tier)",
            path=root,
        )
    return strategy


def _located(
    results: list[list[WriteResult]],
) -> tuple[list[list[WriteResult]], list[StoredFile]]:
    """Every rank's write results with their location as storage data, and the
    files of DCP's own format they are in (none for asyncsave's files).

    :raises CheckpointError: a result was not written by this storage writer.
    """
    located: list[list[WriteResult]] = []
    stored: dict[str, StoredFile] = {}
    for rank_results in results:
        located.append([])
        for wr in rank_results:
            if not isinstance(wr.storage_data, _Written):
                raise CheckpointError(f"write result {wr.index} has no asyncsave location")
            if wr.storage_data.stored is not None:
                stored[wr.storage_data.stored.name] = wr.storage_data.stored
            located[-1].append(dataclasses.replace(wr, storage_data=wr.storage_data.loc))
    return located, [stored[n] for n in sorted(stored)]


def _options_of(writer: StorageWriter) -> dict[str, Any]:
    """The writer's ``FileSystemWriter`` keywords but ``_extensions``, as given."""
    return {name: getattr(writer, name) for name in _FSW_OPTIONS}


def _done(value: Any) -> Future[Any]:
    fut: Future[Any] = Future()
    fut.set_result(value)
    return fut


# FileSystemWriter's keywords (torch 2.13) but ``_extensions``.
_FSW_OPTIONS = (
    "single_file_per_rank",
    "sync_files",
    "thread_count",
    "per_thread_copy_ahead",
    "cache_staged_state_dict",
    "overwrite",
    "serialization_format",
)


def _release_all(fs: LocalFileSystem, handed: dict[str, int]) -> None:
    """Release every handed-over lock of a writer that is collected."""
    while handed:
        fd = handed.popitem()[1]
        if holds_lock(fd):  # not closed already (a forked child closes its copies)
            with contextlib.suppress(OSError):
                fs.unlock(fd)


def _check_step(step: Any) -> None:
    if isinstance(step, bool):
        raise InvalidStepError(
            f"StorageWriter step={step!r}: the argument after the root is the step (an "
            "int); FileSystemWriter's single_file_per_rank and its other options are "
            f"keywords here: StorageWriter(root, step, single_file_per_rank={step!r})"
        )
    if type(step) is not int or step < 0:
        raise ValueError(f"step={step!r} must be a non-negative int")


def _exists(final: Path, step: int) -> CheckpointError:
    return CheckpointError(
        f"Checkpoint already exists and self.overwrite=False: {final} exists already "
        "(pass overwrite=True to replace it atomically, or save under a new step)",
        step=step,
        path=final,
    )


@dataclasses.dataclass
class StorageReader(_DcpStorageReader):
    """DCP storage reader of checkpoints written through :class:`StorageWriter` (or
    by :meth:`Checkpointer.save` of DTensor state).

    DCP's ``.metadata`` is a pickle (DCP's own format); it is read only after its
    size and XXH3-64 match the manifest, by an unpickler that builds DCP's metadata
    classes and nothing else (``asyncsave._dcp_read``). Plain values (non-tensor
    items) are unpickled by DCP's planner as ``dcp.load`` does, with
    ``torch.load(weights_only=False)``: read only checkpoints you trust, as with
    DCP, or resume through :meth:`Checkpointer.load_latest`, which unpickles them
    as ``weights_only=True`` unless the options allow pickle.

    :param path: a checkpoint directory (``runs/exp1/step_40``), or a root, which
        resolves to the checkpoint its tracker names (:func:`asyncsave.latest`) each
        time a load begins (``read_metadata``), so a reader kept across loads follows
        new commits.
    :param verify: check every item's XXH3-64 checksum while reading.
    :param layout: the layout preset a root was written with (the writer's
        ``layout``); a checkpoint directory is read whatever its layout.
    :param fallback: as for :func:`asyncsave.latest`: a tracker naming a missing or
        damaged checkpoint resolves to the newest committed one instead of raising.
    :param load_id: DCP's id of this load, recorded in
        ``read_metadata().storage_meta.load_id`` (as ``FileSystemReader`` does); a
        fresh UUID at construction and at every ``reset``.
    :param _extension_registry: DCP's ``ExtensionRegistry`` for stream transforms
        (as ``FileSystemReader`` takes it; ``None``: DCP's default, which knows
        ``ZStandard``).

    Checkpoints in DCP's own format are read by torch's ``FileSystemReader``, to
    which this reader hands them: those written with ``_extensions`` (their stored
    files checked against the manifest's checksums first, with ``verify``), and a
    directory that ``FileSystemWriter`` wrote (``.metadata`` and ``*.distcp``, no
    asyncsave manifest: read as DCP reads it, its ``.metadata`` unpickled by
    DCP; nothing to verify it against). A root is resolved through asyncsave's
    tracker only: pass a ``FileSystemWriter`` directory itself.
    :raises ValueError: an unknown ``layout``.
    :raises CheckpointNotFoundError: (from ``read_metadata``) nothing committed
        there; a root holding another layout's checkpoints names the ``layout`` to
        pass (as :func:`asyncsave.latest` does: never read as empty).
    :raises CorruptCheckpointError: damaged manifest, ``.metadata`` or data file;
        :class:`ChecksumMismatchError` for altered bytes.
    """

    path: str
    verify: bool = True
    filesystem: LocalFileSystem = dataclasses.field(default_factory=LocalFileSystem)
    layout: str = "asyncsave"
    fallback: bool = False
    _metadata: Metadata | None = None
    _dir: str | None = None
    load_id: str = dataclasses.field(default_factory=lambda: str(uuid.uuid4()))
    _extension_registry: Any = None
    # DCP's own reader of a checkpoint in DCP's format (set per load).
    _inner: Any = dataclasses.field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        check_root(self.path, "StorageReader path")
        self.path = os.fspath(self.path)
        if self.layout not in LAYOUTS:
            raise ValueError(f"layout={self.layout!r} is not one of {sorted(LAYOUTS)}")

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        """A new load begins (a fresh ``load_id``); a ``checkpoint_id`` is the path."""
        if checkpoint_id is not None:
            check_root(checkpoint_id, "checkpoint_id")
            self.path = os.fspath(checkpoint_id)
        self._dir = None
        self._metadata = None
        self.load_id = str(uuid.uuid4())

    @property
    def checkpoint_id(self) -> str:
        """The path this reader was given (a checkpoint directory or a root)."""
        return self.path

    def checkpoint_dir(self) -> Path:
        """The checkpoint directory this reader reads (a root resolves to its latest)."""
        if self._dir is None:
            p = Path(self.path)
            if not self.filesystem.exists(p / MANIFEST_NAME) and not self._foreign(p):
                info = latest(
                    p, layout=self.layout, fallback=self.fallback, filesystem=self.filesystem
                )
                if info is None:
                    raise CheckpointNotFoundError(f"no committed checkpoint in {p}", path=p)
                p = Path(info.path)
            self._dir = os.fspath(p)
        return Path(self._dir)

    def _foreign(self, path: Path) -> bool:
        """Whether ``path`` is a directory ``FileSystemWriter`` wrote (DCP's
        ``.metadata``, no asyncsave manifest)."""
        fs = self.filesystem
        return fs.exists(path / DCP_METADATA_NAME) and not fs.exists(path / MANIFEST_NAME)

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        self._dir = None  # a load begins: a root resolves to its latest now
        self._inner = None
        path = self.checkpoint_dir()
        if self._foreign(path):
            self._inner = distcp_reader(path, self._extension_registry)
            self._inner.load_id = self.load_id
            foreign: Metadata = self._inner.read_metadata(*args, **kwargs)
            return foreign
        metadata = read_dcp_metadata(self.filesystem, path)
        metadata.storage_meta.load_id = self.load_id  # type: ignore[union-attr]
        return metadata

    def set_up_storage_reader(
        self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any
    ) -> None:
        self._metadata = metadata
        if self._inner is None and any(
            isinstance(v, _StorageInfo) for v in (metadata.storage_data or {}).values()
        ):  # written with _extensions: DCP's own files
            self._inner = distcp_reader(self.checkpoint_dir(), self._extension_registry)
        if self._inner is not None:
            self._inner.set_up_storage_reader(metadata, is_coordinator, *args, **kwargs)

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        assert self._metadata is not None and self._metadata.storage_data is not None
        path = self.checkpoint_dir()
        if self._inner is not None:
            if self.verify and not self._foreign(path):
                data = self._metadata.storage_data
                names = {data[req.storage_index].relative_path for req in plan.items}
                verify_stored(self.filesystem, path, names)
            fut: Future[None] = self._inner.read_data(plan, planner)
            return fut
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
        return _done(None)

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


def _walk(x: Any, fn: Any, depth: int = 0) -> Any:
    """``x`` rebuilt with ``fn`` applied to every leaf, dicts/lists/tuples kept."""
    if depth > 1000:
        raise CheckpointError("state nested over 1000 levels deep")
    if isinstance(x, dict):
        return type(x)((k, _walk(v, fn, depth + 1)) for k, v in x.items())
    if isinstance(x, (list, tuple)) and not hasattr(x, "_fields"):
        return type(x)(_walk(v, fn, depth + 1) for v in x)
    return fn(x)


class DTensorJob(Job):
    """The job of DTensor state saved by :meth:`asyncsave.Checkpointer.save` on
    several ranks: each DTensor's local shard (and every plain tensor) is staged
    in the rank's pool, then written through DCP's planner on asyncsave's group
    into the save's temporary directory, so that ``dcp.load`` reshards it. The
    core names this module by string (``asyncsave._jobs.DTENSOR_JOB``) and
    reaches this class through :func:`dtensor_job`, registered on import.

    A non-contiguous CUDA shard is made contiguous on its device first (FSDP2's
    shards are contiguous).
    """

    def __init__(self, state: Any) -> None:
        from torch.distributed.checkpoint.state_dict_saver import _stateful_to_state_dict
        from torch.distributed.tensor import DTensor

        # At save() time: the state_dict() of Stateful objects is taken now, and
        # the containers and plain leaves are copied (tensors are staged later).
        tree = _stateful_to_state_dict(state) if isinstance(state, dict) else state
        self.tree = _walk(tree, lambda x: x if isinstance(x, torch.Tensor) else copy.deepcopy(x))
        self.staged: Any = None
        self.lease: Lease | None = None
        self.step = -1
        self.entries: list[Entry] = []
        offset = 0

        def collect(x: Any) -> Any:
            nonlocal offset
            if isinstance(x, torch.Tensor):
                local = (x.to_local() if isinstance(x, DTensor) else x).detach()
                if not local.is_contiguous():
                    local = local.contiguous()
                nbytes = local.numel() * local.element_size()
                e = Entry(
                    str(len(self.entries)),
                    local,
                    nbytes,
                    local.element_size(),
                    False,
                    local.dtype,
                    tuple(local.shape),
                )
                e.staging_offset = offset
                offset += -(-nbytes // 64) * 64
                self.entries.append(e)
            return x

        _walk(self.tree, collect)
        self.staging_bytes = offset

    def devices(self) -> set[torch.device]:
        return {e.source.device for e in self.entries if e.source is not None}

    def snapshot_eager(self, ready: dict[torch.device, Any] | None) -> None:
        """Lazy mode: tensors of at most 64 KiB (norm statistics, counters) are
        cloned now, as for a plain tree."""
        from ._stage import LAZY_EAGER_MAX_BYTES

        for e in self.entries:
            if e.source is not None and e.nbytes <= LAZY_EAGER_MAX_BYTES:
                if e.source.is_cuda and ready and e.source.device in ready:
                    torch.cuda.current_stream(e.source.device).wait_event(ready[e.source.device])
                e.source = clone_bits(e.source)

    async def stage(
        self, saver: Services, step: int, ready: dict[torch.device, Any] | None, make_tmp: Any
    ) -> None:
        from torch.distributed.tensor import DTensor

        from ._stage import stage_entries

        assert saver.pool is not None
        self.step = step
        entries = self.entries
        pin = any(e.source is not None and e.source.is_cuda for e in entries)
        self.lease = lease = await saver.pool.acquire(self.staging_bytes, pin=pin)
        await stage_entries(
            lease,
            entries,
            poll_interval_s=saver.options.poll_interval_s,
            timeout_s=saver.options.save_timeout_s,
            ready=ready,
        )
        views = iter([destination(lease.buffer, e) for e in entries])

        def rebuild(x: Any) -> Any:
            if isinstance(x, DTensor):
                return DTensor(next(views), x._spec, requires_grad=False)
            if isinstance(x, torch.Tensor):
                return next(views)
            return x

        self.staged = _walk(self.tree, rebuild)
        for e in entries:
            e.source = None
        self.tree = None
        self.nbytes = sum(e.nbytes for e in entries)

    async def write(self, saver: Services, coord: Any, tmp: Path) -> dict[str, Any]:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.api import CheckpointException

        step = self.step
        writer = StorageWriter(
            str(saver.root),
            step,
            layout=saver.options.layout,
            filesystem=saver.fs,
            _tmp=tmp.name,
            _commit=False,
        )
        # DCP's own collectives (plans, write results) run here, on asyncsave's
        # group, inside this save's turn; a rank's write error comes back from DCP
        # on every rank.
        try:
            # Watched: a rank that dies inside DCP's collectives is named.
            await coord.watched(
                "DCP save",
                functools.partial(
                    dcp.save, self.staged, storage_writer=writer, process_group=coord.group
                ),
                step,
            )
        except CheckpointException as exc:
            # DCP's error derives from BaseException: translated here, at the boundary.
            causes = {
                r: repr(f[0]) if isinstance(f, tuple) else repr(f) for r, f in exc.failures.items()
            }
            raise SaveFailedError(
                f"DCP's save of step {step} failed on rank(s) {sorted(causes)}: "
                + "; ".join(f"rank {r}: {c}" for r, c in sorted(causes.items())),
                step=step,
                path=tmp,
            ) from exc
        self.release()  # written and fsynced: the pool is free for the next save
        if coord.rank == 0:
            assert writer.manifest_doc is not None
            return {"dcp": writer.manifest_doc}
        return {"dcp": None}

    def manifest(self, tmp: Path, step: int, parts: list[dict[str, Any]]) -> dict[str, Any]:
        return dict(parts[0]["dcp"])

    def release(self) -> None:
        if self.lease is not None:
            self.lease.release()


def dtensor_job(state: Any, saver: Any) -> DTensorJob:
    """The job of DTensor ``state`` saved through ``saver`` (the checkpointer's
    pipeline), registered with the core's job registry on import: the checks
    that belong to this route are made here, before anything is staged.

    :raises CheckpointError: the checkpointer does not span the ranks that hold
        the DTensors, or its root commits by marker (DCP's writer renames).
    """
    world = dist.get_world_size() if dist.is_initialized() else 1
    if saver.coord.world_size == 1 and world > 1:
        raise CheckpointError(
            f"DTensor state of {world} ranks is saved by a "
            "Checkpointer that spans them: open it with distributed=None (the "
            "default) or True on every rank",
            path=saver.root,
        )
    if not saver.strategy.can_move_files:
        raise CheckpointError(
            f"DTensor state goes through DCP's planner and asyncsave.dcp's writer, "
            f"which write into a temporary directory renamed at the commit; "
            f"{saver.root} is on {saver.fs!r} (commit by marker): save it to "
            "a shared POSIX file system root",
            path=saver.root,
        )
    return DTensorJob(state)


register_job(__name__, dtensor_job)


# -- async saves beside training ------------------------------------------------
# DCP's ``async_save`` runs the save's collectives (plans, write results) in a
# background thread on the group it is given, the default group when none is: the
# group whose collectives the training thread issues meanwhile (FSDP2's
# all-gathers, a loss all-reduce). Two threads issuing collectives on one group
# in an order that differs between ranks hang or abort gloo with "collective
# mismatch". The fix is a group of its own for the save's collectives.

_side_lock = threading.Lock()
_side: tuple[Any, Any] | None = None  # (the default group it was made under, the side group)
_previous: Any = None  # the upload future of the last async_save through this module


def side_group() -> Any:
    """The gloo group that :func:`async_save` gives DCP for a save's collectives:
    all ranks of the default group, made on the first call and cached (made again
    after the default group is destroyed and initialised anew).

    The first call is a collective on the default group (``dist.new_group``):
    every rank makes it at the same point of training, from the thread that runs
    training's collectives, with no save running. Pass it yourself to
    ``dcp.async_save(..., process_group=asyncsave.dcp.side_group())`` where you
    call DCP directly; use it for nothing else (one save at a time on it: see
    :func:`async_save`).

    :returns: the group, or ``None`` when ``torch.distributed`` is not initialised
        (one process: DCP then runs no collective).
    """
    global _side
    if not (dist.is_available() and dist.is_initialized()):
        return None
    world = dist.distributed_c10d._get_default_group()
    with _side_lock:
        if _side is None or _side[0] is not world:
            group = dist.new_group(backend="gloo", group_desc="asyncsave-dcp")
            _side = (world, group)
        return _side[1]


def async_save(
    state_dict: dict[str, Any],
    *,
    storage_writer: _DcpStorageWriter,
    process_group: Any = None,
    wait_previous_s: float = 3600.0,
    **dcp_kwargs: Any,
) -> Any:
    """``torch.distributed.checkpoint.async_save`` that never shares a group with
    training: the save's collectives run on :func:`side_group`, so the next
    training step (FSDP2's all-gathers on the default group) runs while the save
    is written, on any number of ranks::

        fut = asyncsave.dcp.async_save(
            {"model": msd, "optim": osd},
            storage_writer=asyncsave.dcp.StorageWriter("runs/exp1", step=step),
        )
        ...                      # train on; the save runs in DCP's background thread
        fut.result()             # committed (renamed, tracker moved) or raises

    Every rank calls it with the same steps in the same order. A save begins only
    once the previous one made through this function is done on this rank (waited
    here, up to ``wait_previous_s``): overlapping saves would issue their
    collectives on the side group from two threads, the same hazard again. Its
    outcome is not raised here; ``result()`` of its own future raises it.

    :param state_dict: as for ``dcp.async_save`` (``Stateful`` objects are called
        now, tensors are staged before this returns).
    :param storage_writer: the writer, normally :class:`StorageWriter`.
    :param process_group: ``None`` (default): :func:`side_group`. A group of your
        own is used as given: it must serve no other collective while the save runs.
    :param wait_previous_s: seconds to wait for the previous save (see above).
    :param dcp_kwargs: passed on to ``dcp.async_save`` (``checkpoint_id``,
        ``planner``, ``async_checkpointer_type``, ``async_stager``...).
    :returns: what ``dcp.async_save`` returns (a future, or DCP's
        ``AsyncSaveResponse`` with a custom stager).
    :raises CheckpointError: ``process_group`` is the default group (the one
        training uses), before any collective.
    :raises CheckpointTimeoutError: the previous save ran past ``wait_previous_s``.
    """
    import concurrent.futures

    import torch.distributed.checkpoint as dcp

    global _previous
    if process_group is not None and _is_default_group(process_group):
        raise CheckpointError(
            "asyncsave.dcp.async_save: process_group is the default process group, which "
            "the training step uses too: DCP's background collectives on it interleave "
            "with training's and hang or abort (gloo 'collective mismatch'). Leave "
            "process_group=None (a side group, asyncsave.dcp.side_group()) or pass a "
            "group used by nothing else"
        )
    group = process_group if process_group is not None else side_group()
    previous = _previous
    if previous is not None:
        done, _ = concurrent.futures.wait([previous], timeout=wait_previous_s)
        if not done:
            raise CheckpointTimeoutError(
                f"asyncsave.dcp.async_save: the previous save is still running after "
                f"wait_previous_s={wait_previous_s}; nothing of this one began"
            )
    result = dcp.async_save(
        state_dict, storage_writer=storage_writer, process_group=group, **dcp_kwargs
    )
    _previous = getattr(result, "upload_completion", result)
    return result


def _is_default_group(group: Any) -> bool:
    if not (dist.is_available() and dist.is_initialized()):
        return False
    return group is dist.group.WORLD or group is dist.distributed_c10d._get_default_group()
