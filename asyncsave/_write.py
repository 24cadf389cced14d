"""Write: data files from the staging buffer, checksummed on the way, fsynced.

Runs in worker threads. A file is written straight from the staging buffer (no
intermediate copy) in large sequential chunks that ignore tensor boundaries (many
small tensors are coalesced into few ``write(2)`` calls); each chunk is hashed with
xxHash (XXH3-64, the ``xxhash`` package, which releases the GIL), entry by entry,
just before it is handed to ``write(2)``, while it is still in cache.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch
import xxhash

from ._format import FileLayout
from ._fs import LocalFileSystem
from ._plan import Entry

__all__ = ["CHUNK_BYTES", "write_bytes", "write_data_file"]

logger = logging.getLogger(__name__)

CHUNK_BYTES = 8 << 20


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
) -> dict[int, str]:
    """Write one data file and fsync it.

    The file's entries lie back to back in the staging buffer, so the data is
    written in :data:`CHUNK_BYTES` writes regardless of entry boundaries (a
    10,000-tensor replay buffer costs a handful of ``write(2)`` calls, not 10,000);
    each chunk is hashed, entry by entry, just before it is written, while it is
    in cache (one pass over memory).

    :param buffer: the staging buffer (``uint8``, host memory) holding the data.
    :returns: entry index -> XXH3-64 hex digest of the entry's bytes.
    :raises OSError: from any write, fsync or close; the partial file is left for
        the caller to remove with its temporary directory.
    """
    view = memoryview(buffer.numpy())  # type: ignore[arg-type]
    fd = fs.create(directory / layout.name)
    try:
        _write_all(fs, fd, memoryview(layout.header))
        start = layout.staging_offset
        digests = _write_hashed(
            fs, fd, view, start, start + layout.data_nbytes, layout.entries, entries
        )
        fs.fsync(fd)
    except BaseException:
        _close_quietly(fs, fd)
        raise
    fs.close(fd)
    return digests


def _write_hashed(
    fs: LocalFileSystem,
    fd: int,
    view: memoryview,
    start: int,
    end: int,
    order: list[int],
    entries: list[Entry],
) -> dict[int, str]:
    """Write ``view[start:end]`` (entries ``order``, back to back) in large chunks,
    hashing each entry's bytes from the chunk just before the chunk is written."""
    digests: dict[int, str] = {}
    k = 0  # the entry being hashed
    h: Any = None  # its running hasher, for an entry that spans chunks
    for pos in range(start, end, CHUNK_BYTES):
        stop = min(pos + CHUNK_BYTES, end)
        p = pos
        while k < len(order):
            e = entries[order[k]]
            e_end = e.staging_offset + e.nbytes
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
        _write_all(fs, fd, view[pos:stop])
    for i in order[k:]:  # empty entries at the end
        digests[i] = xxhash.xxh3_64_hexdigest(b"")
    return digests


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
