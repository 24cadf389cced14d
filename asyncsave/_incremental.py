"""Incremental saves: a data file whose bytes equal a file of the previous
committed checkpoint of the root is shared with it, not written again.

Shared means a hard link (``os.link``) on a local file system and a server-side
copy on an object store (``FsspecFileSystem.link``), made into the save's
temporary directory before its commit, so every checkpoint stays whole: readers,
``verify`` and retention see plain files, and deleting any checkpoint (the base
included) leaves the others intact. A committed checkpoint's files are never
written again (``update()`` links them too), so sharing an inode is safe.

What decides, per data file of the new save (see ``docs/decisions.md``):

1. the file holds the same entries as one file of the base (names, offsets,
   sizes, and so the same file size);
2. the XXH3-64 of every entry's *staged* bytes equals the base manifest's
   checksum of that entry; never Python identity and never a user's flag;
3. the base file itself is intact: its header bytes equal the new header, and
   its data hashes to the base manifest's checksums. That is read and hashed,
   unless this process wrote or verified that very file before and its identity
   is unchanged since (local: device, inode, size, ``mtime_ns``; object store:
   ETag and size): a damaged base is never propagated, it is written in full.

Anything else, or any error while linking, is a full write of that file; the
digests hashed for the decision are handed to the writer, so a save where every
tensor changed hashes each byte once, as a full save does.

The file layout makes whole-file reuse effective: a tensor of at least
:data:`OWN_FILE_BYTES` gets a file of its own, smaller ones are packed in plan
order into shared files (:func:`incremental_layout`), deterministically across
saves of the same tree.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import os
import re
import threading
from pathlib import Path
from typing import Any

import torch
import xxhash

from ._bits import flat_bytes, host_bytes
from ._catalog import read_checkpoint, scan_steps
from ._errors import CheckpointError
from ._format import FileLayout, layout_buckets
from ._fs import LocalFileSystem
from ._manifest import CHECKSUM, Manifest, record_entries, torch_dtype
from ._paths import Layout
from ._plan import Entry, Plan
from ._write import write_data_file

__all__ = ["OWN_FILE_BYTES", "Base", "Reuse", "incremental_layout"]

logger = logging.getLogger(__name__)

#: A tensor at least this large is stored in a data file of its own, so that it
#: is shared whole when it did not change (a frozen weight under LoRA).
OWN_FILE_BYTES = 1 << 20
#: Smaller tensors are packed, in plan order, into files of up to this size.
PACK_FILE_BYTES = 64 << 20
_READ_CHUNK = 8 << 20


def incremental_layout(
    entries: list[Entry],
    *,
    rank: int,
    own: set[int] = frozenset(),  # type: ignore[assignment]
) -> list[FileLayout]:
    """The data files of an incremental save: one per entry of at least
    :data:`OWN_FILE_BYTES` and per entry in ``own`` (the row chunks of growing
    tensors, whatever their size), the rest packed in plan order into files of
    up to :data:`PACK_FILE_BYTES`; files in the plan order of their first entry.
    Pure, and the same for the same tree, so an unchanged tensor lands in a file
    equal to the previous save's."""
    buckets: list[list[int]] = []
    pack: list[int] = []
    packed = 0
    for i, e in enumerate(entries):
        if e.nbytes >= OWN_FILE_BYTES or i in own:
            buckets.append([i])
            continue
        if pack and packed + e.nbytes > PACK_FILE_BYTES:
            pack, packed = [], 0  # the full pack is in buckets already
        if not pack:
            buckets.append(pack)  # placed where its first entry is, filled in place
        pack.append(i)
        packed += e.nbytes
    return layout_buckets(entries, buckets or [[]], rank=rank)


@dataclasses.dataclass
class Base:
    """The previous committed checkpoint: where a new save's files may come from."""

    path: Path
    manifest: Manifest
    # entry name -> (file index, absolute offset, nbytes, checksum)
    by_name: dict[str, tuple[int, int, int, str]]
    # file index -> the indices of its entries in the manifest
    file_entries: dict[int, list[int]]

    @classmethod
    def of(cls, path: Path, manifest: Manifest) -> Base:
        by_name: dict[str, tuple[int, int, int, str]] = {}
        file_entries: dict[int, list[int]] = {}
        for j, e in enumerate(manifest.entries):
            by_name[e["name"]] = (e["file"], e["offset"], e["nbytes"], e[CHECKSUM])
            file_entries.setdefault(e["file"], []).append(j)
        return cls(path, manifest, by_name, file_entries)

    def digests(self, f: int) -> tuple[str, ...]:
        """The checksums of file ``f``'s entries, in file order."""
        entries = self.manifest.entries
        order = sorted(self.file_entries[f], key=lambda j: entries[j]["offset"])
        return tuple(entries[j][CHECKSUM] for j in order)

    def match(self, layout: FileLayout, entries: list[Entry]) -> int | None:
        """The base file holding exactly the entries of ``layout`` at the same
        offsets and sizes (so a file of the same size), or ``None``."""
        if not layout.entries:
            return None
        f: int | None = None
        for i in layout.entries:
            e = entries[i]
            got = self.by_name.get(e.name)
            if got is None or got[1] != e.offset or got[2] != e.nbytes:
                return None
            if f is None:
                f = got[0]
            elif got[0] != f:
                return None
        assert f is not None
        if len(self.file_entries.get(f, ())) != len(layout.entries):
            return None
        if self.manifest.files[f]["nbytes"] != layout.nbytes:
            return None
        return f


@dataclasses.dataclass
class Report:
    """What one incremental save wrote and shared (the manifest's ``incremental``).
    Counted from the save's writer threads (the ``count_*`` methods are
    thread-safe)."""

    base: str | None = None
    bytes_written: int = 0
    bytes_shared: int = 0
    files_written: int = 0
    files_shared: int = 0
    bytes_verified: int = 0  # base bytes read back to check them before sharing
    prelinked: list[int] = dataclasses.field(default_factory=list)  # files shared at staging
    _lock: threading.Lock = dataclasses.field(
        default_factory=threading.Lock, repr=False, compare=False
    )

    def count_written(self, nbytes: int) -> None:
        with self._lock:
            self.bytes_written += nbytes
            self.files_written += 1

    def count_shared(self, nbytes: int, *, at_staging: int | None = None) -> None:
        """One file of ``nbytes`` shared; ``at_staging``: its index, shared
        while the save was staged (:meth:`Reuse.prelink`)."""
        with self._lock:
            self.bytes_shared += nbytes
            self.files_shared += 1
            if at_staging is not None:
                self.prelinked.append(at_staging)

    def count_verified(self, nbytes: int) -> None:
        with self._lock:
            self.bytes_verified += nbytes

    def as_doc(self) -> dict[str, Any]:
        doc = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "_lock"}
        doc["files_shared_at_staging"] = len(doc.pop("prelinked"))
        return doc


#: A growing tensor is stored as at most this many row chunks; past it, the next
#: save writes it whole again (one chunk) and starts over.
MAX_CHUNKS = 64


def _chunkable(e: Entry) -> bool:
    src = e.source
    return (
        not e.is_blob
        and not e.parts
        and src is not None
        and src.dim() >= 1
        and src.is_contiguous()
        and e.nbytes >= OWN_FILE_BYTES
    )


class RowChunks:
    """Growing tensors: the row chunks of each tensor of the last save planned
    (see :meth:`split`). Used at plan time, in the caller's thread."""

    def __init__(self) -> None:
        # entry name -> ((dtype, row shape), row boundaries) of the last save planned
        self._rows: dict[str, tuple[tuple[Any, ...], list[int]]] = {}

    def split(self, plan: Plan) -> set[int]:
        """Store each tensor that grew along its first dimension since the last
        save planned here as row chunks (see :meth:`Reuse.split_rows`).

        :returns: the indices (in the new ``plan.entries``) of the chunks.
        """
        rows_of: dict[str, tuple[tuple[Any, ...], list[int]]] = {}
        names = {e.name for e in plan.entries}
        entries: list[Entry] = []
        moved: dict[int, list[int]] = {}
        for idx, e in enumerate(plan.entries):
            if not _chunkable(e):
                moved[idx] = [len(entries)]
                entries.append(e)
                continue
            src = e.source
            assert src is not None
            rows = int(src.shape[0])
            sig = (src.dtype, tuple(src.shape[1:]))
            bounds = self._bounds(self._rows.get(e.name), sig, rows)
            cut = [f"{e.name}#rows={a}:{b}" for a, b in itertools.pairwise(bounds[1:])]
            if any(n in names for n in cut):  # a key that looks like a chunk: keep it whole
                bounds, cut = [0, rows], []
            rows_of[e.name] = (sig, bounds)
            moved[idx] = []
            for k, (a, b) in enumerate(itertools.pairwise(bounds)):
                moved[idx].append(len(entries))
                entries.append(
                    e
                    if len(bounds) == 2
                    else dataclasses.replace(
                        e,
                        name=e.name if k == 0 else cut[k - 1],
                        source=src[a:b],
                        nbytes=(b - a) * (e.nbytes // rows),
                        shape=(b - a, *src.shape[1:]),
                    )
                )
        self._rows = rows_of
        if len(entries) == len(plan.entries):
            return set()
        _replace_entries(plan, entries, moved)
        return {j for new in moved.values() if len(new) > 1 for j in new}

    def seed(self, manifest: Manifest) -> None:
        """Take the row chunks of the checkpoint of ``manifest`` as the last save
        planned."""
        rows_of: dict[str, tuple[tuple[Any, ...], list[int]]] = {}
        entries = manifest.entries
        for rec in manifest.tensors:
            dtype = torch_dtype(rec["dtype"])
            shape = rec["shape"]
            if dtype is None or rec["stride"] is not None or not shape or not shape[0]:
                continue
            chunks = record_entries(rec)
            row = sum(entries[j]["nbytes"] for j in chunks) // shape[0]
            if not row:
                continue
            bounds = [0]
            for j in chunks:
                bounds.append(bounds[-1] + entries[j]["nbytes"] // row)
            rows_of[entries[chunks[0]]["name"]] = ((dtype, tuple(shape[1:])), bounds)
        self._rows = rows_of

    @staticmethod
    def _bounds(
        prev: tuple[tuple[Any, ...], list[int]] | None, sig: tuple[Any, ...], rows: int
    ) -> list[int]:
        if prev is None or prev[0] != sig or rows < prev[1][-1]:
            return [0, rows]
        bounds = list(prev[1])
        if rows > bounds[-1]:
            bounds.append(rows)
        if len(bounds) - 1 > MAX_CHUNKS:
            return [0, rows]
        return bounds


def _replace_entries(plan: Plan, entries: list[Entry], moved: dict[int, list[int]]) -> None:
    """Give ``plan`` the entries of its tensors cut into chunks: ``moved`` maps
    each old entry index to its new ones."""
    plan.entries = entries
    plan.remember_smallest_entry()  # a new-rows chunk may be small (lazy saves)
    # New record dicts: a reused plan's records are its template's, shared with
    # every save of the same structure (one still writing its manifest, too).
    plan.records = [
        {**rec, "entry": new[0], **({"chunks": new} if len(new) > 1 else {})}
        for rec in plan.records
        for new in (moved[rec["entry"]],)
    ]


#: What a remembered data file holds: (header hash, entry checksums in file order).
Contents = tuple[str, tuple[str, ...]]


class KnownFiles:
    """The data files this process wrote, shared or checked: per file identity
    (see :func:`_identity`) its header hash and entry checksums, and per header
    hash (one per data file of a tree: it names the file's tensors, shapes and
    offsets) the latest such file. Bounded by the files of one state: a file's
    newer content replaces the older one. Thread-safe."""

    def __init__(self) -> None:
        self._known: dict[tuple[Any, ...], Contents] = {}
        self._by_header: dict[str, tuple[tuple[str, ...], Path, tuple[Any, ...]]] = {}
        # Header hashes whose file changed at the last save: not hashed while
        # staging (the caller waits for that) until a save shares them again.
        self._changing: set[str] = set()
        self._lock = threading.Lock()

    def any(self) -> bool:
        with self._lock:
            return bool(self._by_header)

    def remember(
        self, fs: LocalFileSystem, path: Path, header: bytes, digests: tuple[str, ...]
    ) -> None:
        """Record that the file at ``path`` holds ``header`` and entries of
        ``digests`` (in file order): it was just written from staged bytes, or
        read back and checked."""
        try:
            ident = _identity(fs, path)
        except OSError:
            return
        if ident is not None:
            header_hash = xxhash.xxh3_64_hexdigest(header)
            with self._lock:
                old = self._by_header.get(header_hash)
                if old is not None and old[2] != ident:
                    self._known.pop(old[2], None)
                self._by_header[header_hash] = (digests, path, ident)
                self._known[ident] = (header_hash, digests)

    def keep_only(self, layouts: list[FileLayout]) -> None:
        """Forget the files of headers that ``layouts`` does not have."""
        keep = {xxhash.xxh3_64_hexdigest(fl.header) for fl in layouts}
        with self._lock:
            for header_hash in [h for h in self._by_header if h not in keep]:
                del self._by_header[header_hash]
            live = {ident for _, _, ident in self._by_header.values()}
            for ident in [i for i in self._known if i not in live]:
                del self._known[ident]
            self._changing &= keep

    def holds(self, fs: LocalFileSystem, path: Path, want: Contents) -> bool:
        """Whether the file at ``path`` is one remembered with contents ``want``,
        its identity unchanged."""
        return self.identity_holding(fs, path, want) is not None

    def identity_holding(
        self, fs: LocalFileSystem, path: Path, want: Contents
    ) -> tuple[Any, ...] | None:
        """The identity of the file at ``path`` if it is one remembered with
        contents ``want``, else ``None``."""
        ident = _identity(fs, path)
        if ident is None:
            return None
        with self._lock:
            return ident if self._known.get(ident) == want else None

    def settled(self, header_hash: str) -> bool:
        """Whether a file of ``header_hash`` is remembered and did not change at
        its last try."""
        with self._lock:
            return header_hash in self._by_header and header_hash not in self._changing

    def latest(self, header_hash: str) -> tuple[tuple[str, ...], Path] | None:
        """The checksums and path of the latest file of ``header_hash``, or
        ``None`` where there is none or it changed at its last try."""
        with self._lock:
            known = self._by_header.get(header_hash)
            if known is None or header_hash in self._changing:
                return None
            return known[0], known[1]

    def changed(self, header_hash: str) -> None:
        """The file of ``header_hash`` changed: not hashed at staging from now."""
        with self._lock:
            self._changing.add(header_hash)

    def shared(self, header_hash: str) -> None:
        """A file of ``header_hash`` was shared: hashed at staging again."""
        with self._lock:
            self._changing.discard(header_hash)

    def moved(
        self, header_hash: str, digests: tuple[str, ...], path: Path, ident: tuple[Any, ...]
    ) -> None:
        """The latest file of ``header_hash`` is now found at ``path`` (a link of
        the remembered one, identity ``ident``)."""
        with self._lock:
            self._by_header[header_hash] = (digests, path, ident)


def _identity(fs: LocalFileSystem, path: Path) -> tuple[Any, ...] | None:
    """What changes whenever the file's bytes may have: (device, inode, size,
    mtime_ns) locally; (ETag, size) on an object store; ``None`` when the
    store gives nothing to tell (the file is then always read and hashed)."""
    inner = getattr(fs, "fs", None)
    if inner is None:
        st = os.stat(path)
        return ("local", st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
    p = fs._p(path)  # type: ignore[attr-defined]
    inner.invalidate_cache(p)
    info = inner.info(p)
    etag = info.get("ETag") or info.get("etag")
    if not etag:
        return None
    return ("object", etag, info.get("size"))


def _base_file_intact(
    fs: LocalFileSystem, path: Path, base: Base, f: int, header: bytes, report: Report
) -> bool:
    """Read the file at ``path`` (base file ``f`` or a link to it) and compare
    its header and each entry's checksum with the base manifest's."""
    name = base.path / base.manifest.files[f]["name"]  # what the logs name
    entries = sorted(
        (base.manifest.entries[j] for j in base.file_entries[f]), key=lambda e: e["offset"]
    )
    mv = memoryview(bytearray(_READ_CHUNK))
    with fs.open_read(path) as fh:
        got = fh.read(len(header))
        if got != header:
            logger.info("incremental save: %s has another header: not shared", name)
            return False
        pos = len(header)
        for e in entries:
            if e["offset"] != pos:
                return False
            digest = _hash_read(fh, mv, e["nbytes"])
            if digest is None:
                return False
            pos += e["nbytes"]
            report.count_verified(e["nbytes"])
            if digest != e[CHECKSUM]:
                logger.warning(
                    "incremental save: %s entry %r does not match its checksum "
                    "(damaged base): written in full",
                    name,
                    e["name"],
                )
                return False
    return True


def _hash_read(fh: Any, mv: memoryview, nbytes: int) -> str | None:
    """XXH3-64 of the next ``nbytes`` of ``fh``, read through ``mv``; ``None``
    where the file ends first."""
    h = xxhash.xxh3_64()
    left = nbytes
    while left:
        n = fh.readinto(mv[: min(left, _READ_CHUNK)])
        if not n:
            return None
        h.update(mv[:n])
        left -= n
    return h.hexdigest()


def _same_as_base(
    layout: FileLayout,
    entries: list[Entry],
    buffer: torch.Tensor,
    base: Base,
    digests: dict[int, str],
) -> bool:
    """Whether each of ``layout``'s entries, hashed (XXH3-64) from its staged
    bytes in ``buffer`` into ``digests``, equals the base manifest's checksum of
    its name; stops at the first that differs (``digests`` keeps what was
    hashed: the writer takes it as it is)."""
    view = memoryview(buffer.numpy())  # type: ignore[arg-type]
    for i in layout.entries:
        e = entries[i]
        if i not in digests:
            digests[i] = xxhash.xxh3_64_hexdigest(
                view[e.staging_offset : e.staging_offset + e.nbytes]
            )
        if digests[i] != base.by_name[e.name][3]:
            return False
    return True


class Reuse:
    """The incremental state of one checkpointer: the row chunks of growing
    tensors (:class:`RowChunks`) and the data files this process wrote or
    verified (:class:`KnownFiles`); it decides per data file whether a save
    shares it or writes it.

    Methods are blocking (worker threads) and thread-safe, but for
    :meth:`split_rows` (plan time, the caller's thread).
    """

    def __init__(self, root: Path, layout: Layout) -> None:
        self.root = root
        self.layout = layout
        self.rows = RowChunks()
        self.files = KnownFiles()
        self._told: set[str] = set()

    # -- growing tensors (plan time, in the caller's thread) ----------------------------
    def split_rows(self, plan: Plan) -> set[int]:
        """Store each tensor that grew along its first dimension since the last
        save planned here as row chunks: the previous save's chunks, then one
        chunk of the new rows. The first chunk keeps the tensor's own entry name,
        so a tensor saved whole last time shares its file with the first chunk;
        each further chunk is an entry ``<key>#rows=<start>:<end>`` in a file of
        its own, whatever its size. Unchanged chunks are then shared like any
        unchanged file, a rewritten row makes its chunk written again, a
        reordered tensor has every chunk written, and a tensor that shrank or
        changed dtype or row shape is written whole (one chunk); past
        :data:`MAX_CHUNKS` chunks the tensor is written whole once. Pure
        bookkeeping: no bytes are read here (the checksums of the staged chunks
        decide what is shared).

        :returns: the indices (in the new ``plan.entries``) of the chunks.
        """
        return self.rows.split(plan)

    def seed(self, fs: LocalFileSystem) -> None:
        """At open: take the row chunks of the newest committed checkpoint as the
        last save planned, so that the first save after a restart continues them
        (a replay buffer resumed from it writes only its new rows). Best effort:
        a root without a readable checkpoint seeds nothing."""
        base = self.find_base(fs, None)
        if base is not None:
            self.rows.seed(base.manifest)

    def written_in_full(self, why: str) -> None:
        """Say once per reason that ``incremental=True`` does not apply to a save:
        ``"streamed"`` (a state larger than ``budget_bytes``) or ``"several
        ranks"`` (not supported yet)."""
        if why not in self._told:
            self._told.add(why)
            logger.warning(
                "incremental=True: saves of %s write every byte (only whole saves of "
                "one process share files with the previous checkpoint)",
                "a state streamed through budget_bytes" if why == "streamed" else why,
            )

    # -- the base --------------------------------------------------------------------
    def find_base(self, fs: LocalFileSystem, tmp: Path | None) -> Base | None:
        """The newest committed checkpoint of the root (not ``tmp`` itself: on an
        object store a save writes under its final name), or ``None``. A
        directory that does not read as committed and whole is passed over."""
        try:
            steps = scan_steps(fs, self.root, self.layout)
        except OSError as exc:
            logger.warning("incremental save: cannot list %s (%r): full write", self.root, exc)
            return None
        tried = 0
        for step in sorted(steps, reverse=True):
            path = steps[step]
            if tmp is not None and str(path).rstrip("/") == str(tmp).rstrip("/"):
                continue
            tried += 1
            try:
                return Base.of(path, read_checkpoint(fs, path, expect_step=step))
            except (CheckpointError, OSError) as exc:
                logger.info("incremental save: %s is no base (%r)", path, exc)
            if tried >= 3:
                break
        return None

    def keep_only(self, layouts: list[FileLayout]) -> None:
        """Forget the files of headers that ``layouts`` (the save just written)
        does not have, so that what is remembered stays the size of one state's
        files over any number of saves (a growing tensor's new chunk, or a packed
        small tensor that grew, has a new header at every save)."""
        self.files.keep_only(layouts)

    # -- one data file -------------------------------------------------------------------
    def write_file(
        self,
        base: Base | None,
        report: Report,
        fs: LocalFileSystem,
        directory: Path,
        layout: FileLayout,
        entries: list[Entry],
        buffer: torch.Tensor,
        *,
        direct: bool = False,
        on_written: Any = None,
    ) -> dict[int, str]:
        """Share ``layout``'s file from ``base`` when its bytes are equal, else
        write it (``_write.write_data_file``). Blocking; same contract (a shared
        file counts as written for ``on_written``, the save's progress).

        :returns: entry index -> XXH3-64 hex digest of the entry's staged bytes.
        """
        # Hashed here from the staged bytes (prelink keeps no checksum of a file it
        # did not link): what the manifest records is what the file holds.
        digests: dict[int, str] = {}
        f = None if base is None else base.match(layout, entries)
        if (
            base is not None
            and f is not None
            and _same_as_base(layout, entries, buffer, base, digests)
            and self._shared(base, f, report, fs, directory, layout)
        ):
            if on_written is not None:
                on_written(layout.nbytes)
            return digests
        digests = write_data_file(
            fs,
            directory,
            layout,
            entries,
            buffer,
            direct=direct,
            on_written=on_written,
            known=digests,
        )
        self.files.remember(
            fs, directory / layout.name, layout.header, tuple(digests[i] for i in layout.entries)
        )
        report.count_written(layout.nbytes)
        return digests

    def _shared(
        self,
        base: Base,
        f: int,
        report: Report,
        fs: LocalFileSystem,
        directory: Path,
        layout: FileLayout,
    ) -> bool:
        """Link base file ``f`` as ``layout``'s file if it is intact; ``False``
        (nothing left behind) where it is not or linking failed.

        Linked first, then checked: what is checked is the file the new
        checkpoint holds (the same inode, or the object store's copy), so a base
        file replaced between a check and the link (an ``overwrite=True`` commit
        of its step, a retention pass) can never be shared unchecked."""
        src = base.path / base.manifest.files[f]["name"]
        dst = directory / layout.name
        header_hash = xxhash.xxh3_64_hexdigest(layout.header)
        want = (header_hash, base.digests(f))
        try:
            # On an object store the copy gets an identity of its own (an ETag a
            # store may make anew): the source's, known before the copy and the
            # same after it, says the copy read that object.
            copied_known = getattr(fs, "fs", None) is not None and self.files.holds(fs, src, want)
            fs.link(src, dst)
            intact = (
                self.files.holds(fs, dst, want)
                or (copied_known and self.files.holds(fs, src, want))
                or _base_file_intact(fs, dst, base, f, layout.header, report)
            )
            if intact:
                self.files.remember(fs, dst, layout.header, base.digests(f))
            else:
                _unlink_quietly(fs, dst)
                return False
        except OSError as exc:
            # A base retired meanwhile (a previous save's retention: one process's
            # saves overlap) is no fault; anything else is worth a warning.
            level = logging.INFO if isinstance(exc, FileNotFoundError) else logging.WARNING
            logger.log(level, "incremental save: sharing %s failed (%r): written in full", src, exc)
            _unlink_quietly(fs, dst)  # else the create below fails, and the save with it
            return False
        report.count_shared(layout.nbytes)
        self.files.shared(header_hash)
        return True

    # -- at staging time: files equal to one this process wrote --------------------------
    def knows_files(self) -> bool:
        return self.files.any()

    def worth_prelinking(self, layout: FileLayout, entries: list[Entry]) -> bool:
        """Whether :meth:`prelink` would hash ``layout``'s sources: host tensors,
        contiguous, of a header this process wrote before that did not change at
        its last try. The others are staged and written at once, while these are
        hashed (see ``_jobs.IncrementalJob``). Cheap: no byte is read."""
        if not layout.entries or not all(_host_contiguous(entries[i]) for i in layout.entries):
            return False
        return self.files.settled(xxhash.xxh3_64_hexdigest(layout.header))

    def prelink(
        self,
        fs: LocalFileSystem,
        tmp: Path,
        layout: FileLayout,
        entries: list[Entry],
        report: Report,
    ) -> bool:
        """Before staging, on a local root: link ``layout``'s file into ``tmp`` if
        its bytes equal the latest file of the same header this process wrote (or
        shared, or checked) and that file is unchanged since. A file that changed
        at its last try is left to the writer (which shares it from the base if it
        is unchanged after all) until a save shares it again, so a save where
        everything changes does not hash while the caller waits. The *sources* (host
        tensors, contiguous) are hashed in place instead of staged copies; a
        linked file's entries are neither copied into staging memory nor written.
        A file that is not linked keeps no checksum from here: its staged copy is
        hashed by the writer, so that the checksums a checkpoint records are
        those of the bytes it holds even when a caller changes a tensor during
        its save (against the contract of ``save()`` and ``staged()``; a fresh
        user's trial committed checkpoints that failed ``verify`` that way, where
        full saves stayed verifiable). That costs the changed files of a save a
        second hashing, overlapped with their writes.

        The file linked need not be committed: it was fsynced whole before it was
        remembered (:meth:`KnownFiles.remember`), its identity (inode, size,
        ``mtime_ns``) is unchanged since, and the link keeps its bytes whatever
        becomes of the save that wrote it. Blocking (a worker thread).

        :returns: whether the file was linked.
        """
        if not self.worth_prelinking(layout, entries):
            return False
        header_hash = xxhash.xxh3_64_hexdigest(layout.header)
        known = self.files.latest(header_hash)
        if known is None:
            return False
        digests = tuple(_hash_source(entries[i]) for i in layout.entries)
        if digests != known[0]:
            self.files.changed(header_hash)
            return False
        src = self._located(fs, known[1])
        if src is None:
            return False
        dst = tmp / layout.name
        ident = self._link_known(fs, src, dst, (header_hash, digests))
        if ident is None:
            return False
        for i, digest in zip(layout.entries, digests, strict=True):
            entries[i].digest = digest  # the linked file's bytes: the manifest's checksums
        report.count_shared(layout.nbytes, at_staging=layout.index)
        # Found here from now on: the save that wrote it may be retired first.
        self.files.moved(header_hash, digests, dst, ident)
        return True

    def _link_known(
        self, fs: LocalFileSystem, src: Path, dst: Path, want: Contents
    ) -> tuple[Any, ...] | None:
        """Link ``src`` as ``dst`` and return the link's identity if it is a file
        remembered with contents ``want``; else ``None``, nothing left behind.
        Linked first, then the link's identity checked: a file put in ``src``'s
        place meanwhile (an overwrite of its step) is never taken."""
        try:
            fs.link(src, dst)
            ident = self.files.identity_holding(fs, dst, want)
        except OSError as exc:
            logger.info("incremental save: sharing %s while staging failed (%r)", src, exc)
            _unlink_quietly(fs, dst)
            return None
        if ident is None:
            _unlink_quietly(fs, dst)
        return ident

    def _located(self, fs: LocalFileSystem, path: Path) -> Path | None:
        """Where a remembered file is now: where it was written, or (its save
        committed since) the same name in the final directory of its step."""
        if fs.lexists(path):
            return path
        match = _TEMP_STEP.match(path.parent.name)
        if match is None:
            return None
        final = self.root / self.layout.dir_name(int(match.group(1))) / path.name
        return final if fs.lexists(final) else None


_TEMP_STEP = re.compile(r"^\.asyncsave-tmp-([0-9]+)-")


def _unlink_quietly(fs: LocalFileSystem, path: Path) -> None:
    try:
        if fs.lexists(path):
            fs.unlink(path)
    except OSError:
        pass


def _host_contiguous(e: Entry) -> bool:
    src = e.source
    return (
        not e.is_blob
        and not e.parts
        and src is not None
        and not src.is_cuda
        and src.is_contiguous()
        and src.numel() * src.element_size() == e.nbytes
    )


def _hash_source(e: Entry) -> str:
    """XXH3-64 of a host tensor's bytes, read in place (the GIL is released)."""
    src = e.source
    assert src is not None
    raw = flat_bytes(src.detach())
    # Not raw.numpy(): the storage is the caller's (see host_bytes).
    return xxhash.xxh3_64_hexdigest(host_bytes(raw))
