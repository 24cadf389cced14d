"""Simulated power loss: every crash state the persistence model allows.

In the spirit of ALICE (Pillai et al., OSDI'14) and CrashMonkey (Mohan et al.,
OSDI'18): a save runs through :class:`fstrace.TracingFS`, which records its logical
operations; then, for every prefix of that trace (a power cut after operation *c*),
we rebuild states the disk may hold and check each with the crash oracle
(:func:`crashlab.check_root`).

The persistence model (deliberately weaker than ext4/xfs, i.e. closer to what POSIX
promises):

- The tree before the recorded window is durable.
- ``write`` data of a file is durable once a later ``fsync`` of *that file* is in
  the prefix. Before that it may be lost, kept, or kept as zeros (the size reached
  the disk, the data blocks did not), independently per ``write`` call; losing
  some calls and keeping later ones models reordering and truncation.
- A directory entry operation (``create``, ``mkdir``, ``unlink``, ``rmdir``,
  ``link``, ``rename``/``replace``, ``exchange``) is durable once a later ``fsync_dir`` of
  its parent directory (both parents for a rename) is in the prefix. ``fsync`` of
  a file does not make its name durable.
- Operations that are not yet durable may each persist or not, in any
  combination; those that persist apply in issue order (a rename whose source never
  reached the disk is a no-op; an entry in a directory that never reached the disk
  is unreachable; a persisted ``rmdir`` drops the entry with whatever is under it).

Not modelled (limits): torn sector writes inside one ``write`` call beyond
zero-filling, data corruption of durable blocks, metadata fsync semantics of
specific file systems (ext4 ``auto_da_alloc``, btrfs log trees), bugs in the file
system itself, and the saver lock file. The space of subsets is exponential, so
per crash point we take: all persisted, none persisted, each one dropped, each one
alone, each write zeroed, every subset when there are at most 6 volatile
operations, and seeded random subsets (with random zeroing); states are
deduplicated by their content.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from fstrace import ROOT_INO, Snapshot

STATE_OPS = ("mkdir", "create", "write", "rename", "exchange", "unlink", "rmdir", "link")


def volatile_and_forced(ops: list[tuple[Any, ...]], c: int) -> tuple[set[int], list[int]]:
    """For a power cut after ``ops[:c]``: the indices forced durable by a later
    fsync in the prefix, and the state operations that are not (volatile)."""
    synced_files: set[int] = set()
    synced_dirs: set[int] = set()
    forced: set[int] = set()
    volatile: list[int] = []
    for i in range(c - 1, -1, -1):
        op = ops[i]
        kind = op[0]
        if kind == "fsync":
            synced_files.add(op[1])
        elif kind == "fsync_dir":
            synced_dirs.add(op[1])
        elif kind == "write":
            (forced.add(i) if op[1] in synced_files else volatile.append(i))
        elif kind in ("create", "mkdir", "unlink", "rmdir", "link"):
            (forced.add(i) if op[1] in synced_dirs else volatile.append(i))
        elif kind in ("rename", "exchange"):
            durable = op[1] in synced_dirs and op[3] in synced_dirs
            (forced.add(i) if durable else volatile.append(i))
    volatile.reverse()
    return forced, volatile


def replay(
    base: Snapshot, ops: list[tuple[Any, ...]], c: int, applied: set[int], zeroed: set[int]
) -> Snapshot:
    """The tree after a power cut at ``c`` where exactly ``applied`` (of the state
    operations in ``ops[:c]``) reached the disk, ``zeroed`` writes as zeros."""
    snap = base.copy()
    dirs, files = snap.dirs, snap.files
    for i in range(c):
        if i not in applied:
            continue
        op = ops[i]
        kind = op[0]
        if kind in ("mkdir", "create"):
            _, parent, name, ino = op
            if parent in dirs and name not in dirs[parent]:
                dirs[parent][name] = ino
                if kind == "mkdir":
                    dirs[ino] = {}
                else:
                    files[ino] = bytearray()
        elif kind == "link":
            _, parent, name, ino = op
            if parent in dirs and name not in dirs[parent] and ino in files:
                dirs[parent][name] = ino
        elif kind == "write":
            _, ino, off, data = op
            if ino in files:
                buf = files[ino]
                if len(buf) < off:
                    buf.extend(bytes(off - len(buf)))
                buf[off : off + len(data)] = bytes(len(data)) if i in zeroed else data
        elif kind == "rename":
            _, sp, sn, dp, dn = op
            if sp in dirs and sn in dirs[sp] and dp in dirs:
                dirs[dp][dn] = dirs[sp].pop(sn)
        elif kind == "exchange":
            _, pa, na, pb, nb = op
            if pa in dirs and pb in dirs and na in dirs[pa] and nb in dirs[pb]:
                dirs[pa][na], dirs[pb][nb] = dirs[pb][nb], dirs[pa][na]
        elif kind in ("unlink", "rmdir"):
            _, parent, name = op
            if parent in dirs:
                dirs[parent].pop(name, None)
    return snap


def digest(snap: Snapshot) -> str:
    """A content hash of the tree reachable from the root."""
    h = hashlib.blake2b(digest_size=16)

    def walk(ino: int, prefix: str) -> None:
        for name in sorted(snap.dirs[ino]):
            child = snap.dirs[ino][name]
            if child in snap.dirs:
                h.update(f"d:{prefix}{name}\n".encode())
                walk(child, f"{prefix}{name}/")
            elif child in snap.files:
                h.update(f"f:{prefix}{name}:".encode())
                h.update(hashlib.blake2b(snap.files[child], digest_size=16).digest())

    walk(ROOT_INO, "")
    return h.hexdigest()


def materialise(snap: Snapshot, target: Path) -> None:
    """Write the tree into the (empty) directory ``target``."""

    def walk(ino: int, path: Path) -> None:
        for name, child in snap.dirs[ino].items():
            if child in snap.dirs:
                (path / name).mkdir()
                walk(child, path / name)
            elif child in snap.files:
                (path / name).write_bytes(snap.files[child])

    target.mkdir(parents=True)
    walk(ROOT_INO, target)


def subsets(
    forced: set[int], volatile: list[int], writes: set[int], rng: random.Random, n_random: int
) -> Iterator[tuple[set[int], set[int]]]:
    """(applied, zeroed) choices for one crash point (module docstring)."""
    every = set(volatile)
    yield forced | every, set()
    yield set(forced), set()
    for v in volatile:
        yield forced | (every - {v}), set()
        yield forced | {v}, set()
        if v in writes:
            yield forced | every, {v}
    if len(volatile) <= 6:
        for mask in range(1 << len(volatile)):
            yield forced | {v for b, v in enumerate(volatile) if mask >> b & 1}, set()
    for _ in range(n_random):
        chosen = {v for v in volatile if rng.random() < 0.5}
        yield forced | chosen, {v for v in chosen & writes if rng.random() < 0.3}


def crash_states(
    base: Snapshot, ops: list[tuple[Any, ...]], seed: int, n_random: int = 6
) -> Iterator[tuple[int, Snapshot]]:
    """Every distinct (crash point, tree) the model allows, by the sampling of
    :func:`subsets`; the crash point says which acknowledgements preceded it."""
    rng = random.Random(seed)
    seen: set[tuple[str, int]] = set()
    writes = {i for i, op in enumerate(ops) if op[0] == "write"}
    acks = 0
    for c in range(len(ops) + 1):
        if c and ops[c - 1][0] == "mark" and ops[c - 1][1] == "A":
            acks += 1
        forced, volatile = volatile_and_forced(ops, c)
        for applied, zeroed in subsets(forced, volatile, writes, rng, n_random):
            snap = replay(base, ops, c, applied, zeroed)
            key = (digest(snap), acks)
            if key in seen:
                continue
            seen.add(key)
            yield c, snap


def events_before(ops: list[tuple[Any, ...]], c: int) -> list[tuple[str, int, int]]:
    """The dispatch/ack markers in ``ops[:c]`` as :class:`crashlab.EventLog` rows."""
    return [(op[1], op[2], op[3]) for op in ops[:c] if op[0] == "mark"]


class MarkLog:
    """The :class:`crashlab.EventLog` interface, recorded into the trace instead."""

    def __init__(self, fs: Any) -> None:
        self.fs = fs

    def add(self, kind: str, step: int, ver: int) -> None:
        self.fs.mark(kind, step, ver)
