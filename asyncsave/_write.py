"""Write: data files from the staging buffer, checksummed on the way, fsynced.

Runs in worker threads. A file is written straight from the staging buffer (no
intermediate copy) in large sequential chunks; each chunk is hashed with xxHash
(XXH3-64, the ``xxhash`` package, which releases the GIL) just before it is handed
to ``write(2)``, while it is still in cache.
"""

from __future__ import annotations

import logging
from pathlib import Path

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

    :param buffer: the staging buffer (``uint8``, host memory) holding the data.
    :returns: entry index -> XXH3-64 hex digest of the entry's bytes.
    :raises OSError: from any write, fsync or close; the partial file is left for
        the caller to remove with its temporary directory.
    """
    view = memoryview(buffer.numpy())  # type: ignore[arg-type]
    digests: dict[int, str] = {}
    fd = fs.create(directory / layout.name)
    try:
        _write_all(fs, fd, memoryview(layout.header))
        for i in layout.entries:
            e = entries[i]
            h = xxhash.xxh3_64()
            start, end = e.staging_offset, e.staging_offset + e.nbytes
            for pos in range(start, end, CHUNK_BYTES):
                chunk = view[pos : min(pos + CHUNK_BYTES, end)]
                h.update(chunk)
                _write_all(fs, fd, chunk)
            digests[i] = h.hexdigest()
        fs.fsync(fd)
    except BaseException:
        _close_quietly(fs, fd)
        raise
    fs.close(fd)
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
