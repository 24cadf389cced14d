"""Streaming a save through a staging budget smaller than the state (https://github.com/meta-pytorch/torchsnapshot/issues/112).

When the state does not fit in ``budget_bytes``, the save is cut into *rounds*:
each round stages at most one budget of bytes into the arena, writes them to the
data files, and the arena is reused by the next round. The budget is split evenly
between the save's data files, so every writer thread streams its own file in
every round. A tensor is cut at any byte boundary (copies are bit copies of its
bytes), except a non-contiguous CPU tensor, which is gathered whole and must fit
in its file's share of the budget.

Only the last round is still in the arena when the snapshot is complete: the
earlier rounds were written (not yet fsynced) while ``save()`` waited, because a
consistent snapshot needs every byte copied somewhere before the caller may
mutate its tensors. The files stay open across rounds; the last round is written,
and every file fsynced, in the background like an ordinary save.
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Any

import torch
import xxhash

from ._bits import flat_bytes
from ._errors import StagingBudgetError
from ._format import HEADER_ALIGN, FileLayout
from ._fs import LocalFileSystem
from ._plan import Entry
from ._write import CHUNK_BYTES, _close_quietly, _write_all

__all__ = ["Piece", "StreamWriter", "plan_rounds", "piece_entries"]

logger = logging.getLogger(__name__)

# Pieces start at a multiple of this in the arena (every dtype's element size
# divides it), so whole-tensor copies through typed views stay aligned.
_PIECE_ALIGN = 16


@dataclasses.dataclass(frozen=True)
class Piece:
    """Bytes ``[start, end)`` of entry ``entry`` (of data file ``file``), staged at
    ``arena_offset`` of the arena in their round."""

    file: int
    entry: int
    start: int
    end: int
    arena_offset: int


def _splittable(e: Entry) -> bool:
    return e.source is None or e.is_blob or e.source.is_contiguous()


def plan_rounds(entries: list[Entry], layouts: list[FileLayout], budget: int) -> list[list[Piece]]:
    """Cut the files' data into rounds of at most ``budget`` staging bytes.

    Pure: no I/O. Each file gets ``budget // len(layouts)`` bytes of the arena (a
    multiple of 64) in every round; a file's pieces come in file order across
    rounds, so each file is written sequentially.

    :raises StagingBudgetError: the budget is too small to split between the files,
        or a non-contiguous CPU tensor (which is gathered whole) is larger than its
        file's share; names the key.
    """
    share = budget // max(1, len(layouts)) // HEADER_ALIGN * HEADER_ALIGN
    if share < HEADER_ALIGN:
        raise StagingBudgetError(
            f"budget_bytes={budget} is too small to stream {len(layouts)} data file(s)"
        )
    # Per file: a cursor (entry position in file order, byte offset in it).
    cursors = [[0, 0] for _ in layouts]
    rounds: list[list[Piece]] = []
    while any(c[0] < len(fl.entries) for c, fl in zip(cursors, layouts, strict=True)):
        pieces: list[Piece] = []
        for f, (fl, cur) in enumerate(zip(layouts, cursors, strict=True)):
            base = f * share
            used = 0
            while cur[0] < len(fl.entries):
                i = fl.entries[cur[0]]
                e = entries[i]
                left = e.nbytes - cur[1]
                if left == 0:  # empty tensors take no room
                    pieces.append(Piece(f, i, cur[1], cur[1], base + used))
                    cur[0], cur[1] = cur[0] + 1, 0
                    continue
                room = share - used
                if not _splittable(e):
                    if e.nbytes > share:
                        raise StagingBudgetError(
                            f"tensor {e.name!r} is not contiguous and needs {e.nbytes} "
                            f"staging bytes in one piece, but each of the "
                            f"{len(layouts)} data files gets {share} of "
                            f"budget_bytes={budget}; raise budget_bytes or pass a "
                            "contiguous tensor",
                            key=e.name,
                        )
                    if e.nbytes > room:
                        break
                    take = e.nbytes
                else:
                    take = min(left, room)
                    if take <= 0:
                        break
                pieces.append(Piece(f, i, cur[1], cur[1] + take, base + used))
                used += -(-take // _PIECE_ALIGN) * _PIECE_ALIGN
                cur[1] += take
                if cur[1] == e.nbytes:
                    cur[0], cur[1] = cur[0] + 1, 0
                if used >= share:
                    break
        rounds.append(pieces)
    return rounds or [[]]


def piece_entries(entries: list[Entry], pieces: list[Piece]) -> list[Entry]:
    """The pieces of one round as entries the stager copies (``stage_entries``):
    a byte range of a contiguous source is a ``uint8`` blob; a non-contiguous
    source is the whole entry, gathered through its typed view."""
    out: list[Entry] = []
    for p in pieces:
        e = entries[p.entry]
        if p.end == p.start or e.source is None:
            continue
        if not _splittable(e):
            out.append(dataclasses.replace(e, staging_offset=p.arena_offset))
            continue
        # A blob's runs: its parts (several storages sharing memory) and zero padding.
        runs = e.segments() if e.is_blob else [(0, e.nbytes, flat_bytes(e.source))]
        for start, end, src in runs:
            a, b = max(start, p.start), min(end, p.end)
            if a >= b:
                continue
            n = b - a
            out.append(
                Entry(
                    name=e.name,
                    # copied as bytes; an empty source is n zero bytes
                    source=_NO_BYTES if src is None else flat_bytes(src)[a - start : b - start],
                    nbytes=n,
                    align=1,
                    is_blob=True,
                    dtype=torch.uint8,
                    shape=(n,),
                    staging_offset=p.arena_offset + a - p.start,
                )
            )
    return out


_NO_BYTES = torch.empty(0, dtype=torch.uint8)


class StreamWriter:
    """The open data files of a streamed save, written round by round.

    Not thread-safe across files' rounds: :meth:`write_file_round` of one file runs
    in one worker thread at a time (the engine runs each file's round in its own
    thread and waits for all before the next round reuses the arena).
    """

    def __init__(
        self, fs: LocalFileSystem, directory: Path, layouts: list[FileLayout], entries: list[Entry]
    ) -> None:
        self.fs = fs
        self.directory = directory
        self.layouts = layouts
        self.entries = entries
        self.fds: list[int | None] = [None] * len(layouts)
        self.hashers = {i: xxhash.xxh3_64() for fl in layouts for i in fl.entries}
        self.on_written: Any = None  # progress: called with each chunk's byte count

    def open_file(self, f: int) -> None:
        fl = self.layouts[f]
        fd = self.fs.create(self.directory / fl.name)
        self.fds[f] = fd
        _write_all(self.fs, fd, memoryview(fl.header))

    def write_file_round(self, f: int, pieces: list[Piece], arena: torch.Tensor) -> None:
        """Write file ``f``'s pieces of one round from the arena, hashing on the way."""
        if self.fds[f] is None:
            self.open_file(f)
        fd = self.fds[f]
        assert fd is not None
        view = memoryview(arena.numpy())  # type: ignore[arg-type]
        for p in pieces:
            if p.file != f:
                continue
            h = self.hashers[p.entry]
            n = p.end - p.start
            for pos in range(p.arena_offset, p.arena_offset + n, CHUNK_BYTES):
                chunk = view[pos : min(pos + CHUNK_BYTES, p.arena_offset + n)]
                h.update(chunk)
                _write_all(self.fs, fd, chunk)
                if self.on_written is not None:
                    self.on_written(len(chunk))

    def finish_file(self, f: int) -> None:
        """fsync and close file ``f`` (opened first if it had no pieces at all)."""
        if self.fds[f] is None:
            self.open_file(f)
        fd = self.fds[f]
        assert fd is not None
        self.fs.fsync(fd)
        self.fds[f] = None
        self.fs.close(fd)

    def digests(self) -> dict[int, str]:
        return {i: h.hexdigest() for i, h in self.hashers.items()}

    def close_quietly(self) -> None:
        """Close every file still open (after a failure; errors are logged)."""
        for f, fd in enumerate(self.fds):
            if fd is not None:
                self.fds[f] = None
                _close_quietly(self.fs, fd)
