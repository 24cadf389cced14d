"""The fast read path: memory-mapped, zero-copy entries, and pinned bounce buffers
for loads onto a CUDA device.

CPU: each data file is mapped once, copy-on-write (``MAP_PRIVATE``), and every entry
becomes a ``uint8`` tensor over its bytes in the mapping (``torch.frombuffer``): no
copy out of the page cache. Writing into a loaded tensor copies the touched pages
privately; the file never changes. With ``verify=True`` each entry's bytes are
hashed (XXH3-64) once, which is what reads them from disk (``MADV_SEQUENTIAL`` /
``MADV_WILLNEED`` ask the kernel to read ahead); with ``verify=False`` nothing is
read until a tensor is touched, so one tensor of a large checkpoint costs only its
own pages. A mapping holds no file descriptor: a file is opened, its header
checked, closed, and then mapped (``torch.UntypedStorage.from_file`` closes its
own descriptor right after ``mmap(2)``; Python's :class:`mmap.mmap` would keep a
duplicate open for as long as any tensor over it lives), so a checkpoint of any
number of files loads under the usual ``ulimit -n`` of 1024: at most one
descriptor per reading thread is open at a time. The open-file limit ran out on one file per
parameter in t5x (https://github.com/google-research/t5x/issues/447).
Committed data files are never rewritten or truncated by asyncsave (a
newer save of the same step swaps in a new directory, retention unlinks), so the
mappings stay valid; a file truncated by someone else under a live mapping makes
the process take ``SIGBUS`` on access, as with any mmap loader (safetensors,
``torch.load(mmap=True)``).

CUDA: each entry is copied from the mapping into one of two pinned host bounce
buffers (hashed on the way), and from there to the device with ``non_blocking``
copies on a side stream, double-buffered so the host copy of one chunk overlaps the
host-to-device copy of the previous one. Device memory is allocated once per entry
(its final tensor). Untested on hardware in this session (no GPU); the CUDA tests
in ``tests/test_cuda.py`` cover it where CUDA exists.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import errno
import os
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any, BinaryIO, cast

import torch
import xxhash

from ._errors import ChecksumMismatchError, CorruptCheckpointError
from ._manifest import CHECKSUM, Manifest
from ._types import gc_paused

__all__ = ["BOUNCE_BYTES", "read_entries"]

# Size of each of the two pinned bounce buffers of a CUDA load.
BOUNCE_BYTES = 64 << 20
_HASH_CHUNK = 8 << 20
_READ_THREADS = 4


def _mapped(fpath: Path, size: int, manifest: Manifest) -> memoryview:
    """The first ``size`` bytes of the data file ``fpath`` mapped copy-on-write
    (``MAP_PRIVATE``), as a writable byte view that holds no descriptor: the
    mapping lives as long as the view or any tensor made over it.

    :raises CorruptCheckpointError: the file changed since its size was read
        (truncated, removed or replaced by another process).
    :raises OSError: the mapping failed (``vm.max_map_count`` reached, no memory,
        no descriptor left).
    """
    if size == 0:
        return memoryview(bytearray())
    try:
        storage = torch.UntypedStorage.from_file(str(fpath), shared=False, nbytes=size)
    except RuntimeError as exc:
        try:
            now = os.stat(fpath).st_size
        except OSError:
            now = -1
        if now != size:
            raise CorruptCheckpointError(
                f"{fpath} changed while it was read (truncated, removed or replaced by "
                "another process)",
                path=fpath,
                step=manifest.step,
            ) from exc
        raise OSError(f"cannot map {fpath}: {exc}") from exc
    whole = torch.empty(0, dtype=torch.uint8).set_(cast(torch.UntypedStorage, storage))
    return memoryview(whole.numpy())  # type: ignore[arg-type]


def _check(fpath: Path, e: dict[str, Any], size: int, manifest: Manifest) -> tuple[int, int]:
    start, n = e["offset"], e["nbytes"]
    if start < 0 or start + n > size:
        raise CorruptCheckpointError(
            f"{fpath} ends inside {e['name']!r} (truncated)",
            path=fpath,
            key=e["name"],
            step=manifest.step,
        )
    return start, n


def _verify(fpath: Path, e: dict[str, Any], digest: str, manifest: Manifest) -> None:
    if digest != e[CHECKSUM]:
        raise ChecksumMismatchError(
            f"{fpath}: bytes of {e['name']!r} do not match their checksum "
            f"({digest} != {e[CHECKSUM]})",
            path=fpath,
            key=e["name"],
            step=manifest.step,
        )


def read_entries(
    path: Path,
    manifest: Manifest,
    *,
    verify: bool,
    device: torch.device,
    only: Iterable[int] | None = None,
    check_header: Any = None,
    progress: Callable[[int], None] | None = None,
) -> list[torch.Tensor | None]:
    """Read entries of a checkpoint as ``uint8`` tensors (index = entry index;
    ``None`` for entries not asked for).

    :param device: ``cpu``: zero-copy views of the mapped files; ``cuda``: device
        tensors filled through pinned bounce buffers.
    :param only: entry indices to read (default: all). The others are not read.
    :param check_header: ``(fpath, fileobj, manifest, file_index)`` callable that
        validates a file's safetensors header against the manifest.
    :param progress: called with each count of bytes just read (hashed, when
        ``verify``), from the reading threads (one per file, several at once).
    :raises CorruptCheckpointError: an entry past the end of its file, or a header
        that disagrees; :class:`ChecksumMismatchError` for altered bytes.
    """
    # Paused (see gc_paused): the manifest just parsed is 100,000s of young
    # objects and each entry read makes a tensor; a full pass over them landed
    # in this call (100,000 tensors: loads 4.6 -> 3.5 s, medians of 5).
    with gc_paused():
        return _read_entries(path, manifest, verify, device, only, check_header, progress)


def _read_entries(
    path: Path,
    manifest: Manifest,
    verify: bool,
    device: torch.device,
    only: Iterable[int] | None,
    check_header: Any,
    progress: Callable[[int], None] | None,
) -> list[torch.Tensor | None]:
    out: list[torch.Tensor | None] = [None] * len(manifest.entries)
    per_file, counts = _by_file(manifest, only)

    def read(fi: int, mine: list[tuple[int, dict[str, Any]]], bounce: _Bounce | None) -> None:
        _read_file(
            path, manifest, fi, mine, counts[fi], verify, out, bounce, check_header, progress
        )

    if device.type == "cuda":
        bounce = _Bounce(device) if per_file else None
        try:
            for fi, mine in per_file.items():
                read(fi, mine, bounce)
        finally:
            if bounce is not None:
                bounce.close()
        return out
    # CPU: the files are read (hashed) in parallel, one thread each, which keeps
    # more requests in flight on the device; xxhash releases the GIL.
    jobs = list(per_file.items())
    if len(jobs) <= 1:
        for fi, mine in jobs:
            read(fi, mine, None)
        return out
    with concurrent.futures.ThreadPoolExecutor(min(len(jobs), _READ_THREADS)) as pool:
        futures = [pool.submit(read, fi, mine, None) for fi, mine in jobs]
        for f in futures:
            f.result()  # the first failure, in file order
    return out


def _by_file(
    manifest: Manifest, only: Iterable[int] | None
) -> tuple[dict[int, list[tuple[int, dict[str, Any]]]], dict[int, int]]:
    """The entries to read grouped by data file (``only``: their indices; None:
    all), and the number of entries each file holds in all."""
    wanted = set(range(len(manifest.entries))) if only is None else set(only)
    per_file: dict[int, list[tuple[int, dict[str, Any]]]] = {}
    counts: dict[int, int] = {}
    for ei, e in enumerate(manifest.entries):
        counts[e["file"]] = counts.get(e["file"], 0) + 1
        if ei in wanted:
            per_file.setdefault(e["file"], []).append((ei, e))
    return per_file, counts


def _read_file(
    path: Path,
    manifest: Manifest,
    fi: int,
    mine: list[tuple[int, dict[str, Any]]],
    in_file: int,
    verify: bool,
    out: list[torch.Tensor | None],
    bounce: _Bounce | None,
    check_header: Any,
    progress: Callable[[int], None] | None = None,
) -> None:
    fpath = path / manifest.files[fi]["name"]
    with _opened(fpath) as f:
        if check_header is not None:
            check_header(fpath, f, manifest, fi)
        size = os.fstat(f.fileno()).st_size
        if verify and len(mine) * 2 > in_file and hasattr(os, "posix_fadvise"):
            # Most of the file will be read: ask for read-ahead.
            os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_WILLNEED)
    # Mapped once closed: one descriptor per reading thread at any time.
    mapped = _mapped(fpath, size, manifest)
    for ei, e in sorted(mine, key=lambda item: item[1]["offset"]):
        start, n = _check(fpath, e, size, manifest)
        view = mapped[start : start + n]
        if bounce is not None:
            t, digest = bounce.upload(view, verify, progress)
        else:
            # One storage per entry (not one per file): tensors that did not
            # share memory at save time do not share it now, and torch.save of
            # one loaded tensor writes only its own bytes.
            t = (
                torch.frombuffer(mapped, dtype=torch.uint8, count=n, offset=start)
                if n
                else torch.empty(0, dtype=torch.uint8)
            )
            digest = _hash(view, progress) if verify else ""
            if progress is not None and not verify:
                progress(n)
        del view
        if verify:
            _verify(fpath, e, digest, manifest)
        out[ei] = t
    if bounce is not None:
        bounce.finish()  # then the mapping goes with ``mapped``: no tensor holds it


@contextlib.contextmanager
def _opened(fpath: Path) -> Iterator[BinaryIO]:
    """``fpath`` open for reading, unbuffered; running out of descriptors is
    reported with what asyncsave holds and what to do."""
    try:
        f = open(fpath, "rb", buffering=0)
    except OSError as exc:
        if exc.errno in (errno.EMFILE, errno.ENFILE):
            exc.add_note(
                f"asyncsave keeps at most {_READ_THREADS} data files open while it reads "
                "a checkpoint, whatever its number of files: the rest of the process "
                "holds the other descriptors (raise the limit with `ulimit -n`, or "
                "close files the process no longer needs)"
            )
        raise
    with f:
        yield f


def _hash(view: memoryview, progress: Callable[[int], None] | None = None) -> str:
    if len(view) <= _HASH_CHUNK:
        digest = xxhash.xxh3_64_hexdigest(view)
        if progress is not None:
            progress(len(view))
        return digest
    h = xxhash.xxh3_64()
    for pos in range(0, len(view), _HASH_CHUNK):
        chunk = view[pos : pos + _HASH_CHUNK]
        h.update(chunk)
        if progress is not None:
            progress(len(chunk))
    return h.hexdigest()


class _Bounce:
    """Two pinned host buffers and a side stream for host-to-device copies."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device=device)
        # 64 MiB is a power of two: torch's pinned allocator wastes nothing on it.
        self.buffers = [
            torch.empty(BOUNCE_BYTES, dtype=torch.uint8, pin_memory=True) for _ in range(2)
        ]
        self.events: list[Any] = [None, None]
        self.turn = 0

    def upload(
        self, view: memoryview, verify: bool, progress: Callable[[int], None] | None = None
    ) -> tuple[torch.Tensor, str]:
        """Copy ``view`` to a new device tensor in bounce-buffer-sized chunks,
        hashing each chunk while it is copied into the bounce buffer."""
        n = len(view)
        with torch.cuda.device(self.device):
            dst = torch.empty(n, dtype=torch.uint8, device=self.device)
        h = xxhash.xxh3_64() if verify else None
        for pos in range(0, n, BOUNCE_BYTES):
            k = min(BOUNCE_BYTES, n - pos)
            i = self.turn
            self.turn ^= 1
            if self.events[i] is not None:
                self.events[i].synchronize()  # the buffer's previous upload is done
            buf = self.buffers[i]
            chunk = view[pos : pos + k]
            buf[:k].copy_(torch.frombuffer(chunk, dtype=torch.uint8))
            if h is not None:
                h.update(chunk)
            if progress is not None:
                progress(k)
            with torch.cuda.stream(self.stream):
                dst[pos : pos + k].copy_(buf[:k], non_blocking=True)
                event = torch.cuda.Event()
                event.record(self.stream)
            self.events[i] = event
        # The caller's stream must see the copies before it uses ``dst``, and the
        # allocator must not hand ``dst``'s memory out while they may still run.
        torch.cuda.current_stream(self.device).wait_stream(self.stream)
        dst.record_stream(self.stream)
        return dst, (h.hexdigest() if h is not None else "")

    def finish(self) -> None:
        for event in self.events:
            if event is not None:
                event.synchronize()

    def close(self) -> None:
        self.finish()
        self.buffers = []
