"""Public value types: what a save returns and what a load gives back."""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Generic, NamedTuple, TypeVar

__all__ = ["CheckpointInfo", "GcHold", "Restored", "SaveProgress", "Tagged", "gc_paused"]


_gc_lock = threading.Lock()
_gc_pauses = 0  # threads inside gc_paused()
_gc_was_enabled = False


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """Pause the cyclic garbage collector while 100,000s of objects are made at
    once (a plan, a manifest of 10,000 tensors): its generation-2 passes over
    everything alive cost more than the work, and hold the GIL throughout (the
    event loop stalls). Counted across threads: the collector is re-enabled when
    the last pause ends, if it was enabled when the first began."""
    global _gc_pauses, _gc_was_enabled
    with _gc_lock:
        if _gc_pauses == 0:
            _gc_was_enabled = gc.isenabled()
            gc.disable()
        _gc_pauses += 1
    try:
        yield
    finally:
        with _gc_lock:
            _gc_pauses -= 1
            if _gc_pauses == 0 and _gc_was_enabled:
                gc.enable()


class GcHold:
    """A :func:`gc_paused` pause begun now and ended by :meth:`release` (from any
    thread, once; later calls do nothing): for objects that live from one
    thread's work to another's (a save's plan, from its planning to its
    manifest), so that they are freed young without a collector pass over them.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pause: contextlib.AbstractContextManager[None] | None = gc_paused()
        self._pause.__enter__()

    def release(self) -> None:
        with self._lock:
            pause, self._pause = self._pause, None
        if pause is not None:
            pause.__exit__(None, None, None)

    @property
    def held(self) -> bool:
        return self._pause is not None


T = TypeVar("T")


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
