"""Write: data files from the staging buffer, checksummed on the way, fsynced.

Runs in worker threads. A file is written straight from the staging buffer (no
intermediate copy) in large sequential chunks that ignore tensor boundaries (many
small tensors are coalesced into few ``write(2)`` calls); each chunk is hashed with
xxHash (XXH3-64, the ``xxhash`` package, which releases the GIL), entry by entry,
just before it is handed to ``write(2)``, while it is still in cache. A file of at
least :data:`HASH_APART_BYTES` written with ``O_DIRECT`` is hashed by a helper
thread while it is written instead: such a write keeps its thread waiting on the
device, so hashing inline would add the hashing time to the file's.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from pathlib import Path
from typing import Any

import torch
import xxhash

from ._format import DIRECT_ALIGN, FileLayout
from ._fs import LocalFileSystem
from ._plan import Entry

__all__ = ["CHUNK_BYTES", "write_bytes", "write_data_file"]

logger = logging.getLogger(__name__)

CHUNK_BYTES = 8 << 20
#: A file with at least this many bytes of data, written with ``O_DIRECT``, is
#: hashed by a helper thread while it is written (``_write_hashing_apart``).
HASH_APART_BYTES = 32 << 20


def _write_all(fs: LocalFileSystem, fd: int, data: memoryview) -> None:
    while data:
        n = fs.write(fd, data)
        if n <= 0:
            raise OSError(f"write returned {n}")
        data = data[n:]


def write_data_file(
    fs: LocalFileSystem,
    directory: Path,
    layout: FileLayout,
    entries: list[Entry],
    buffer: torch.Tensor,
    *,
    direct: bool = False,
    on_written: Any = None,
    known: dict[int, str] | None = None,
    ready: Any = None,
) -> dict[int, str]:
    """Write one data file and fsync it.

    The file's entries lie back to back in the staging buffer, so the data is
    written in :data:`CHUNK_BYTES` writes regardless of entry boundaries (a
    10,000-tensor replay buffer costs a handful of ``write(2)`` calls, not 10,000);
    each chunk is hashed, entry by entry, just before it is written, while it is
    in cache (one pass over memory).

    :param buffer: the staging buffer (``uint8``, host memory) holding the data.
    :param direct: write the 4096-aligned bulk of the data with ``O_DIRECT``
        (straight from the staging buffer to the device, no page-cache copy); the
        header and the last partial block go through the page cache. Falls back to
        buffered writes where the file system refuses ``O_DIRECT`` or the buffer is
        not page-aligned. The file is fsynced either way.
    :param on_written: called with the byte count of each data chunk once it is
        written (progress; from this worker thread).
    :param known: digests of some of the file's entries already computed from the
        same staging bytes (incremental saves hash before they decide to write):
        taken as they are, not hashed again.
    :param ready: for a file written while it is staged: ``ready(index, upto)``
        blocks until the file ``index``'s bytes are staged up to buffer offset
        ``upto`` (``_stage.StagedMark.wait``; raises if the staging failed). Every
        chunk is hashed and written only after it returns.
    :returns: entry index -> XXH3-64 hex digest of the entry's bytes.
    :raises OSError: from any write, fsync or close; the partial file is left for
        the caller to remove with its temporary directory.
    """
    view = memoryview(buffer.numpy())  # type: ignore[arg-type]
    path = directory / layout.name
    follow = None if ready is None else functools.partial(ready, layout.index)
    start = layout.staging_offset
    end = start + layout.data_nbytes
    fd = fs.create(path)
    try:
        _write_all(fs, fd, memoryview(layout.header))
        dfd = _open_direct(fs, path, layout, buffer) if direct else None
        if dfd is None:
            buffered = functools.partial(_write_all, fs, fd)
            digests = _write_hashed(
                view,
                start,
                end,
                layout.entries,
                entries,
                buffered,
                on_written=on_written,
                known=known,
                ready=follow,
            )
        else:
            digests = _write_direct(fs, fd, dfd, view, layout, entries, on_written, known, follow)
        fs.fsync(fd)
    except BaseException:
        _close_quietly(fs, fd)
        raise
    fs.close(fd)
    return digests


def _open_direct(
    fs: LocalFileSystem, path: Path, layout: FileLayout, buffer: torch.Tensor
) -> int | None:
    """A second descriptor of ``path`` opened with ``O_DIRECT`` for the
    4096-aligned bulk of ``layout``'s data, or ``None``: no whole block, a
    header or a staging offset that is not aligned, or a file system that
    refuses ``O_DIRECT``."""
    start = layout.staging_offset
    bulk = layout.data_nbytes // DIRECT_ALIGN * DIRECT_ALIGN
    if (
        bulk > 0
        and len(layout.header) % DIRECT_ALIGN == 0
        and (buffer.data_ptr() + start) % DIRECT_ALIGN == 0
    ):
        return fs.open_direct(path)
    return None


def _write_direct(
    fs: LocalFileSystem,
    fd: int,
    dfd: int,
    view: memoryview,
    layout: FileLayout,
    entries: list[Entry],
    on_written: Any,
    known: dict[int, str] | None,
    ready: Any,
) -> dict[int, str]:
    """Write ``layout``'s data after its header (already written through ``fd``):
    the aligned bulk through ``dfd`` (``O_DIRECT``), the last partial block
    through ``fd``; ``dfd`` is closed before this returns or raises (``fd`` is
    the caller's). A large file is hashed by a helper thread meanwhile."""
    start = layout.staging_offset
    end = start + layout.data_nbytes
    bulk_end = start + layout.data_nbytes // DIRECT_ALIGN * DIRECT_ALIGN
    try:
        fs.seek(dfd, len(layout.header))
        fs.seek(fd, len(layout.header) + (bulk_end - start))

        def sink(chunk: memoryview, pos: int) -> None:
            split = min(max(bulk_end - pos, 0), len(chunk))
            if split:
                _write_all(fs, dfd, chunk[:split])
            if split < len(chunk):
                _write_all(fs, fd, chunk[split:])

        if end - start >= HASH_APART_BYTES:
            digests = _write_hashing_apart(
                view, start, end, layout.entries, entries, sink, on_written, known, ready
            )
        else:
            digests = _write_hashed(
                view,
                start,
                end,
                layout.entries,
                entries,
                sink,
                with_pos=True,
                on_written=on_written,
                known=known,
                ready=ready,
            )
    except BaseException:
        _close_quietly(fs, dfd)
        raise
    fs.close(dfd)
    return digests


def _write_hashed(
    view: memoryview,
    start: int,
    end: int,
    order: list[int],
    entries: list[Entry],
    sink: Any,
    *,
    with_pos: bool = False,
    on_written: Any = None,
    known: dict[int, str] | None = None,
    ready: Any = None,
) -> dict[int, str]:
    """Hand ``view[start:end]`` (entries ``order``, back to back) to ``sink`` in
    large chunks, hashing each entry's bytes from the chunk just before the chunk
    is written. ``sink(chunk)``, or ``sink(chunk, pos)`` with ``with_pos``;
    ``ready(stop)`` first, if given (the chunk is staged)."""
    digests: dict[int, str] = {}
    k = 0  # the entry being hashed
    h: Any = None  # its running hasher, for an entry that spans chunks
    for pos in range(start, end, CHUNK_BYTES):
        stop = min(pos + CHUNK_BYTES, end)
        if ready is not None:
            ready(stop)
        p = pos
        while k < len(order):
            e = entries[order[k]]
            e_end = e.staging_offset + e.nbytes
            if known and order[k] in known:  # hashed already: skip its bytes
                if e_end > stop:
                    break
                digests[order[k]] = known[order[k]]
                p = e_end
                k += 1
                continue
            if h is None and e_end <= stop:  # whole entry in this chunk: one call
                digests[order[k]] = xxhash.xxh3_64_hexdigest(view[p:e_end])
                p = e_end
                k += 1
                continue
            if h is None:
                h = xxhash.xxh3_64()
            take = min(e_end, stop)
            h.update(view[p:take])
            p = take
            if p == e_end:
                digests[order[k]] = h.hexdigest()
                h = None
                k += 1
            else:
                break  # the rest of this entry is in the next chunk
        if with_pos:
            sink(view[pos:stop], pos)
        else:
            sink(view[pos:stop])
        if on_written is not None:
            on_written(stop - pos)
    for i in order[k:]:  # empty entries at the end
        digests[i] = xxhash.xxh3_64_hexdigest(b"")
    return digests


def _write_hashing_apart(
    view: memoryview,
    start: int,
    end: int,
    order: list[int],
    entries: list[Entry],
    sink: Any,
    on_written: Any,
    known: dict[int, str] | None,
    ready: Any = None,
) -> dict[int, str]:
    """``_write_hashed`` for a large file written with ``O_DIRECT``: the checksums
    are computed by a thread of its own while this one writes. An ``O_DIRECT``
    write holds its thread until the device has the bytes (the CPU is idle
    meanwhile), so hashing inline added the hashing time (~10 % at 1 GB/s) to the
    file's; apart, it overlaps. Both only read the staging bytes. The helper is
    joined before this returns or raises (it reads the arena, which the caller
    may reuse after)."""
    box: dict[str, Any] = {}

    def hash_all() -> None:
        try:
            if ready is not None:
                # Once the whole file is staged: while the snapshot is still
                # copied (the caller of an eager save() waits for it), the
                # hashing would take the CPU from the copy (2 cores, 2 ranks:
                # save() blocked 40 ms instead of 25); the writes take little.
                ready(end)
            box["digests"] = _write_hashed(
                view,
                start,
                end,
                order,
                entries,
                _yield_gil,
                with_pos=True,
                known=known,
            )
        except BaseException as exc:  # re-raised in the writer's thread
            box["error"] = exc

    helper = threading.Thread(target=hash_all, name="asyncsave-hash", daemon=True)
    helper.start()
    try:
        for pos in range(start, end, CHUNK_BYTES):
            stop = min(pos + CHUNK_BYTES, end)
            if ready is not None:
                ready(stop)
            sink(view[pos:stop], pos)
            if on_written is not None:
                on_written(stop - pos)
    finally:
        helper.join()
    if "error" in box:
        raise box["error"]
    digests: dict[int, str] = box["digests"]
    return digests


def _yield_gil(chunk: memoryview, pos: int) -> None:
    """The hashing helper's sink: nothing to write, but the GIL is let go
    after each chunk's entries are hashed (about 1 ms of Python per 8 MiB of
    small entries). Without it the helper ran the whole file's hashing loop
    between forced switches, and with two files hashed at once the event loop
    waited 15-22 ms for the GIL at a time (a save of 100,000 tensors, 2 cores)."""
    time.sleep(0)


def write_bytes(fs: LocalFileSystem, path: Path, data: bytes) -> None:
    """Create ``path`` exclusively, write ``data`` and fsync it."""
    fd = fs.create(path)
    try:
        _write_all(fs, fd, memoryview(data))
        fs.fsync(fd)
    except BaseException:
        _close_quietly(fs, fd)
        raise
    fs.close(fd)


def _close_quietly(fs: LocalFileSystem, fd: int) -> None:
    # The error already propagating is the one to report; a close error on the
    # way out is logged, never allowed to replace it.
    try:
        fs.close(fd)
    except OSError:
        logger.warning("closing fd %d after a failed write failed too", fd, exc_info=True)
