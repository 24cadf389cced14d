"""Several ranks, one checkpoint: how the one pipeline runs on N ranks, and how a
rank reads back its own part.

The coordinator is :class:`asyncsave._coord.GlooGroup`; the phases below are those
of ``asyncsave._pipeline``, which a single process runs too (with collectives that
are identities).

When ``torch.distributed`` is initialised with a world size above 1 (or
``distributed=True``), :class:`~asyncsave.Checkpointer` creates, in ``__aenter__``,
a gloo group of its own (``dist.new_group(backend="gloo",
timeout=dist_timeout_s)``; every rank enters the checkpointer in the same order, as
``new_group`` needs). Every collective of asyncsave runs on that group, from a
worker thread (never on the event loop thread), never on the caller's process
group, so it cannot interleave with, or deadlock against, the caller's own
barriers and all-reduces.

Opening: rank 0 alone takes the root's saver lock and runs recovery; then it
broadcasts the committed steps (or its error) and the other ranks, which waited in
that broadcast, go on (or raise naming rank 0).

One save, on every rank, in the order of the ``save()`` calls (each rank must call
``save()`` for the same steps in the same order; the collectives of consecutive
saves are serialised by a ticket taken when the save is dispatched):

A. rank 0 creates the temporary directory; its name (or rank 0's error) is
   broadcast.
B. every rank writes and fsyncs its own files (``data-r<rank>-<i>.safetensors``)
   into it (or, for DTensor state, runs DCP's planner and writer on asyncsave's
   group into it); then an ``all_gather`` of every rank's outcome: its part of the
   manifest, or its error. If any rank failed, no rank commits: every rank raises
   :class:`RankFailedError` naming each failing rank and its cause, and rank 0
   removes the temporary directory.
C. rank 0 writes the merged ``manifest.json`` (every rank's files, entries and
   tree), fsyncs, renames to the final name, fsyncs the root and moves the
   tracker; then it broadcasts the outcome. Every rank's ``await handle``
   resolves only after this broadcast, i.e. after the commit and the tracker.

A rank that dies (SIGKILL) breaks the collective the others are in: gloo reports
the closed connection at once, or the op times out after ``dist_timeout_s``; the
others raise :class:`RankFailedError` and nothing is committed (the temporary
directory is removed at the next open). After any failure a checkpointer refuses
further saves, like a single-rank one.

The merged manifest's tree is a dict keyed by rank (``asyncsave.load`` of a
2-rank checkpoint returns ``{0: <rank 0's tree>, 1: <rank 1's tree>}``) and its
``ranks`` field records each rank's range of entries and tensors, so that
``Checkpointer.load_latest`` on rank ``r`` reads only rank ``r``'s bytes.
Per-rank state cannot be resharded; DTensor state saved through DCP can.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path
from typing import Any

import torch

from ._catalog import read_checkpoint, step_of_name
from ._coord import GlooGroup, wants_distributed
from ._decode import _build_tensors, _Decoder, _read_entries
from ._errors import CheckpointError, CorruptCheckpointError
from ._fs import LocalFileSystem
from ._jobs import Job, contains_dtensor, merge_parts
from ._load import refuse_other_format
from ._manifest import renumbered
from ._paths import MANIFEST_NAME

__all__ = [
    "DistContext",
    "ForeignJob",
    "contains_dtensor",
    "load_rank",
    "merge_parts",
    "wants_distributed",
]

logger = logging.getLogger(__name__)

DistContext = GlooGroup  # the coordinator of N ranks, under its first name
ForeignJob = Job  # an integration's job, under its first name


def load_rank(
    path: Path,
    rank: int,
    world_size: int,
    *,
    device: torch.device | str = "cpu",
    allow_pickle: bool = False,
    filesystem: LocalFileSystem | None = None,
) -> Any:
    """Read rank ``rank``'s tree of a checkpoint saved by ``world_size`` ranks,
    reading only that rank's bytes. A checkpoint of one rank loads whole on every
    rank (replicated state).

    :raises CheckpointError: saved by another number of ranks (per-rank state does
        not reshard: save DTensor state for that, or ``asyncsave.load`` the whole
        dict by rank).
    :raises UnsupportedFormatError: a DCP (DTensor) checkpoint (``load_latest``
        reads it through :mod:`asyncsave._dcp_read`) or another library's.
    """
    from ._load import _device, load

    fs = filesystem or LocalFileSystem()
    manifest = read_checkpoint(fs, path, expect_step=step_of_name(path))
    refuse_other_format(manifest, path)
    if manifest.world_size == 1:
        return load(path, device=device, allow_pickle=allow_pickle, filesystem=fs)
    if manifest.world_size != world_size:
        raise CheckpointError(
            f"{path} was saved by {manifest.world_size} ranks; this run has {world_size}. "
            "Per-rank state does not reshard: save DTensor (FSDP2) state for that, or "
            "read the whole checkpoint with asyncsave.load(path) (a dict keyed by rank)",
            path=path,
        )
    doc = json.loads(fs.read_bytes(path / MANIFEST_NAME))
    try:
        rec = doc["ranks"][rank]
        e0, e1 = rec["entries"]
        t0, t1 = rec["tensors"]
        tree = rec["tree"]
        assert all(type(x) is int for x in (e0, e1, t0, t1)) and isinstance(tree, dict)
        assert 0 <= e0 <= e1 <= len(manifest.entries) and 0 <= t0 <= t1 <= len(manifest.tensors)
    except (KeyError, IndexError, TypeError, ValueError, AssertionError) as exc:
        raise CorruptCheckpointError(
            f"damaged manifest {path / MANIFEST_NAME}: no valid ranks[{rank}]", path=path
        ) from exc
    tensors = [renumbered(t, lambda j: j - e0) for t in manifest.tensors[t0:t1]]
    if not all(0 <= j < e1 - e0 for t in tensors for j in t.get("chunks", [t["entry"]])):
        raise CorruptCheckpointError(f"damaged manifest {path}: rank {rank}'s tensors", path=path)
    sub = dataclasses.replace(manifest, entries=manifest.entries[e0:e1], tensors=tensors, tree=tree)
    raw = _read_entries(fs, path, sub, verify=True)
    built = _build_tensors(sub, raw, _device(device))
    return _Decoder(built, sub.tensors, path=path, allow_pickle=allow_pickle).node(tree)
