"""Public value types: what a save returns and what a load gives back."""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import gc
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Generic, NamedTuple, TypeVar

__all__ = [
    "CheckpointInfo",
    "Restored",
    "SaveProgress",
    "Tagged",
    "gc_paused",
    "release_in_chunks",
    "release_nested",
]


# Held by the one call whose pause of the collector is in force (see gc_paused).
_gc_owner = threading.Lock()


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """Pause the cyclic garbage collector for one synchronous call of ours that
    makes 100,000s of short-lived objects at once (a plan, a manifest of 10,000
    tensors): its passes over them cost more than the work, and hold the GIL.

    The collector is process-wide state, so a pause never outlives the call
    that took it: it is never held across an ``await``, a thread hand-off or a
    save, and ends before the call returns, restoring what the call found (a
    collector the trainer switched off before the call stays off). A
    ``gc.disable()`` made by another thread while such a call runs is undone when
    the call returns: Python cannot tell it from the call's own pause, so a
    trainer that switches the collector off for good does it while no save or
    load is in progress (before the first save, say). Of calls that overlap in
    several threads, only the first pauses (it owns the pause); the others run
    with the collector as it is, and the pause ends with its owner's call, not
    with the last of them: overlapping saves cannot keep the collector off, and
    the trainer's cyclic garbage is collected between our calls (a trainer's
    memory grew without bound while overlapping saves kept it off:
    https://github.com/marin-community/marin/issues/6774). Nested pauses in one
    thread are one pause."""
    if not _gc_owner.acquire(blocking=False):
        yield  # another call's pause is in force, or none is needed
        return
    try:
        was_enabled = gc.isenabled()
        gc.disable()
        try:
            yield
        finally:
            if was_enabled:
                gc.enable()
    finally:
        _gc_owner.release()


# Items dropped per step by release_in_chunks: freeing 4,096 small objects
# holds the GIL for about a millisecond.
RELEASE_CHUNK = 4096


def release_in_chunks(items: list[Any] | None) -> None:
    """Empty ``items`` (a list only the caller holds: a save's entries, leaves,
    manifest rows) :data:`RELEASE_CHUNK` items at a time, from its end.

    Dropping a list of 100,000 objects frees them all in one C call that holds
    the GIL throughout (about 100 ms at 100,000 entries on a busy core, an
    event-loop stall even from a worker thread); freed a slice at a time, the
    interpreter can hand the GIL to the event loop between slices. Objects the
    list shares with others live on. Blocking: call it in a worker thread."""
    if items is None:
        return
    while items:
        del items[-RELEASE_CHUNK:]


def release_nested(obj: Any) -> None:
    """:func:`release_in_chunks` for every list longer than
    :data:`RELEASE_CHUNK` inside ``obj`` (nested dicts and lists: a manifest's
    tree), innermost first, so that no single drop frees 100,000s of objects.
    Walks every dict and list in ``obj`` (Python work per node, with the GIL
    handed on between bytecodes). ``obj`` and every container in it must be the
    caller's alone: the long lists are emptied in place. Blocking: call it in a
    worker thread."""
    long: list[list[Any]] = []
    stack = [obj]
    while stack:
        x = stack.pop()
        if type(x) is dict:
            stack.extend(v for v in x.values() if type(v) is dict or type(v) is list)
        elif type(x) is list:
            if len(x) > RELEASE_CHUNK:
                long.append(x)
            stack.extend(v for v in x if type(v) is dict or type(v) is list)
    for x in reversed(long):  # a list found later lies inside one found earlier, or apart
        release_in_chunks(x)


T = TypeVar("T")


class Phase(str, enum.Enum):
    """A checkpointer's lifecycle: ``new`` (made, not entered), ``open`` (entered:
    saves are admitted), ``closing`` (leaving: pending saves are flushed, none is
    admitted), ``closed``. A ``str``, so it compares and prints as its value."""

    NEW = "new"
    OPEN = "open"
    CLOSING = "closing"
    CLOSED = "closed"

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)


@dataclasses.dataclass(frozen=True)
class CheckpointInfo:
    """A committed checkpoint and, when this process saved it, what it cost.

    :param step: the training step the checkpoint holds (the last trained step).
    :param path: the checkpoint's final directory (a ``upath.UPath`` carrying the
        storage options for URL roots such as ``s3://bucket/prefix``).
    :param nbytes: bytes of tensor data (headers and manifest not counted).
    :param num_tensors: tensor leaves in the state tree.
    :param world_size: ranks that wrote it.
    :param blocked_s: seconds ``save()`` held the caller (plan + backpressure +
        staging in eager mode); ``None`` when not recorded.
    :param staged_s: seconds from ``save()`` until the snapshot was in host memory.
    :param written_s: seconds from ``save()`` until every data file was fsynced.
    :param committed_s: seconds from ``save()`` until the rename was durable and the
        tracker named this checkpoint (or a newer one). ``None`` for checkpoints
        found on disk, since the commit time is not part of the manifest.
    :param training_info: the flat counters and metrics given to ``save()``.
    :param size_bytes: bytes the checkpoint takes in storage: its data files (tensor
        data and safetensors headers) and manifest; ``None`` when not measured
        (:func:`asyncsave.checkpoints` measures it).
    :param saved_unix_s: when the saver finished writing it, just before the
        commit (the manifest's ``created_unix_s``, seconds since the epoch, the
        saver's clock); ``None`` when not known.
    """

    step: int
    path: Path
    nbytes: int
    num_tensors: int
    world_size: int = 1
    blocked_s: float | None = None
    staged_s: float | None = None
    written_s: float | None = None
    committed_s: float | None = None
    training_info: dict[str, Any] = dataclasses.field(default_factory=dict)
    size_bytes: int | None = None
    saved_unix_s: float | None = None

    @property
    def write_gbps(self) -> float | None:
        """Tensor bytes over ``written_s``, in GB/s (10**9 bytes per second)."""
        if not self.written_s:
            return None
        return self.nbytes / self.written_s / 1e9


@dataclasses.dataclass(frozen=True)
class SaveProgress:
    """How far one save has got, on this rank (:attr:`SaveHandle.progress`).

    Counts this rank's tensor bytes (``CheckpointInfo.nbytes`` of its part;
    safetensors headers and the manifest are not counted). Plain state trees are
    counted tensor by tensor while staging and in 8 MiB writes while writing;
    DTensor (DCP) and Megatron saves count each phase whole when it ends (their
    total is known once staged).

    :param staged_bytes: bytes copied into host staging memory so far.
    :param written_bytes: bytes written into this rank's data files so far (not
        yet durable until the save commits).
    :param total_bytes: bytes this rank stages and writes in all.
    """

    staged_bytes: int
    written_bytes: int
    total_bytes: int

    @property
    def fraction_written(self) -> float:
        """``written_bytes / total_bytes`` (1.0 for a save of no tensor bytes)."""
        return self.written_bytes / self.total_bytes if self.total_bytes else 1.0


class Restored(NamedTuple):
    """What :meth:`~asyncsave.Checkpointer.load_latest` returns."""

    state: Any
    info: CheckpointInfo


@dataclasses.dataclass(frozen=True)
class Tagged(Generic[T]):
    """An item of the state tree with a kind tag that is checked on load.

    Save ``{"replay": Tagged(buffer_state, kind="uniform-v1")}``; a loader that
    passes a template holding ``Tagged(buffer, kind="prioritized-v1")`` at the same
    key gets :class:`~asyncsave.KindMismatchError` instead of a buffer silently
    loaded from another sampler's state (Source: the NeMo-RL single-controller
    checkpointing change).

    :param value: any storable subtree, or a ``Stateful`` object.
    :param kind: a non-empty string naming what ``value`` is.
    """

    value: T
    kind: str

    def __post_init__(self) -> None:
        if not isinstance(self.kind, str) or not self.kind:
            raise ValueError(f"Tagged.kind must be a non-empty str, got {self.kind!r}")
