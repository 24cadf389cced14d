"""The handle of one save: an awaitable that resolves to the committed
:class:`~asyncsave.CheckpointInfo` or raises the save's :class:`SaveFailedError`.

Shared by the checkpointer (which admits saves) and the pipeline (which resolves
them); it knows nothing of either.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Generator
from typing import Any

import anyio

from ._errors import WaitTimeoutError
from ._types import CheckpointInfo, SaveProgress

__all__ = ["ProgressCounter", "SaveHandle", "persist_outcome", "wait_staged_blocking"]


class ProgressCounter:
    """The byte counters of one save, bumped from worker threads (stager and
    writers) and read from any thread (:attr:`SaveHandle.progress`)."""

    def __init__(self, total_bytes: int = 0) -> None:
        self._lock = threading.Lock()
        self.total_bytes = total_bytes
        self._staged = 0
        self._written = 0

    def add_staged(self, nbytes: int) -> None:
        with self._lock:
            self._staged = min(self.total_bytes, self._staged + nbytes)

    def add_written(self, nbytes: int) -> None:
        with self._lock:
            self._written = min(self.total_bytes, self._written + nbytes)

    def all_staged(self, total_bytes: int | None = None) -> None:
        """The snapshot is complete (a job that does not count as it goes, or
        that knows its size only once staged: ``total_bytes``)."""
        with self._lock:
            if total_bytes is not None:
                self.total_bytes = total_bytes
            self._staged = self.total_bytes

    def all_written(self, total_bytes: int | None = None) -> None:
        """This rank's files are written (a job that does not count as it goes)."""
        with self._lock:
            if total_bytes is not None:
                self.total_bytes = total_bytes
            self._staged = self._written = self.total_bytes

    def snapshot(self) -> SaveProgress:
        with self._lock:
            return SaveProgress(self._staged, self._written, self.total_bytes)


class SaveHandle:
    """An awaitable for one save. ``await handle`` returns the committed
    :class:`CheckpointInfo` once the checkpoint is committed and the tracker names
    it or a newer one durably, or raises :class:`SaveFailedError` (the original
    error as ``__cause__``).

    A skipped save (step 0 without ``save_step_zero``) resolves to ``None`` at once;
    ``skipped`` tells it apart. Awaiting a handle again returns (or raises) the same
    result. Awaiting is bounded by the save's ``save_timeout_s``.
    """

    def __init__(self, step: int, *, skipped: bool = False) -> None:
        self.step = step
        self.skipped = skipped
        self._staged = anyio.Event()
        # The same moment, for threads that are not the event loop's (the
        # optimizer pre-hook of a synchronous training thread waits on it).
        self._staged_thread = threading.Event()
        self._done = anyio.Event()
        self._info: CheckpointInfo | None = None
        self._error: BaseException | None = None
        self._staged_error: BaseException | None = None  # failed before the snapshot
        # The persistent tier (``asyncsave._tiers``): whether this save is due to be
        # copied there, and the outcome of that copy.
        self.due_to_persist = False
        self._persisted = anyio.Event()
        self._persisted_info: CheckpointInfo | None = None
        self._persist_error: BaseException | None = None
        self._progress = ProgressCounter()

    @classmethod
    def resolved(
        cls, step: int, info: CheckpointInfo | None, *, skipped: bool = False
    ) -> SaveHandle:
        handle = cls(step, skipped=skipped)
        handle._info = info
        if info is not None:
            handle._progress.total_bytes = info.nbytes
            handle._progress.all_written()
        handle._mark_staged()
        handle._done.set()
        return handle

    def __repr__(self) -> str:
        state = (
            "skipped"
            if self.skipped
            else "failed"
            if self._error
            else "committed"
            if self.done()
            else "pending"
        )
        return f"<SaveHandle step={self.step} {state}>"

    def __await__(self) -> Generator[Any, None, CheckpointInfo | None]:
        return self.wait().__await__()

    def done(self) -> bool:
        """Whether the save has committed, failed or been skipped."""
        return self._done.is_set()

    @property
    def progress(self) -> SaveProgress:
        """How many of this rank's tensor bytes are staged and written so far, of
        how many (a :class:`~asyncsave.SaveProgress` snapshot). Readable from any
        thread at any time, without waiting: a train pump can report a long save
        while it runs. A committed save reports every byte; a skipped one 0 of 0.
        Each rank of a save of several reports its own part.
        """
        return self._progress.snapshot()

    async def staged(self) -> None:
        """Return once the snapshot is in host memory: the caller may mutate the
        tensors it saved. In eager mode ``save()`` already returned after this; in
        lazy mode (``save(..., lazy=True)``) await it before mutating them.

        :raises SaveFailedError: the save ended before its snapshot was complete
            (the tensors were not captured; the caller may mutate them anyway).
        """
        await self._staged.wait()
        if self._staged_error is not None:
            raise self._staged_error

    def is_staged(self) -> bool:
        """Whether the snapshot is complete (or the save ended without one)."""
        return self._staged.is_set()

    def _mark_staged(self) -> None:
        self._staged.set()
        self._staged_thread.set()

    async def wait(self, timeout_s: float | None = None) -> CheckpointInfo | None:
        """Wait for the commit.

        :param timeout_s: an extra bound in seconds (the save's own
            ``save_timeout_s`` always applies).
        :raises SaveFailedError: the save failed; ``__cause__`` is the original.
        :raises WaitTimeoutError: ``timeout_s`` passed first (the save goes on; this is
            not a failure of the save).
        """
        if timeout_s is None:
            await self._done.wait()
        else:
            with anyio.move_on_after(timeout_s):
                await self._done.wait()
            if not self._done.is_set():
                raise WaitTimeoutError(
                    f"step {self.step} did not commit within {timeout_s} s (the save goes on)",
                    step=self.step,
                )
        return self.result()

    def result(self) -> CheckpointInfo | None:
        """The committed info, without waiting.

        :raises RuntimeError: the save is still in flight.
        :raises SaveFailedError: the save failed.
        """
        if not self._done.is_set():
            raise RuntimeError(f"the save of step {self.step} is still in flight")
        if self._error is not None:
            raise self._error
        return self._info

    async def persisted(self, timeout_s: float | None = None) -> CheckpointInfo | None:
        """Wait until the checkpoint is committed on the persistent tier as well
        (``Checkpointer(..., persistent=asyncsave.Tier(...))``): copied from the
        local tier's committed directory, committed there (rename, or the marker
        on object stores) and named by that tier's tracker. ``await handle`` (or
        :meth:`wait`) returns earlier, at the local commit.

        :param timeout_s: an extra bound in seconds.
        :returns: the persistent copy's :class:`CheckpointInfo` (its ``path`` is on
            the persistent tier), or ``None`` when this save is not due to persist
            (no persistent tier, or its policy skips this step; see
            ``due_to_persist``).
        :raises SaveFailedError: the local save or the copy failed; ``__cause__``
            is the original error.
        :raises WaitTimeoutError: ``timeout_s`` passed first (the copy goes on).
        """
        if not self.due_to_persist:
            return None
        with anyio.move_on_after(math.inf if timeout_s is None else timeout_s):
            await self._persisted.wait()
        if not self._persisted.is_set():
            raise WaitTimeoutError(
                f"step {self.step} was not persisted within {timeout_s} s (the copy goes on)",
                step=self.step,
            )
        if self._persist_error is not None:
            raise self._persist_error
        return self._persisted_info

    def _persist_done(self, info: CheckpointInfo | None, error: BaseException | None) -> None:
        if not self._persisted.is_set():
            self._persisted_info, self._persist_error = info, error
            self._persisted.set()

    def _commit(self, info: CheckpointInfo) -> None:
        self._info = info
        self._progress.all_written()
        self._mark_staged()
        self._done.set()

    def _fail(self, error: BaseException) -> None:
        if self._done.is_set():
            return  # resolved already (committed before a late cancellation): it stands
        self._error = error
        if not self._staged.is_set():
            self._staged_error = error
        self._mark_staged()
        self._done.set()


# Read from a thread that is not the event loop's (``asyncsave._sync``).
def wait_staged_blocking(handle: SaveHandle, timeout_s: float | None) -> bool:
    """Block the calling thread (never an event loop's) until ``handle``'s snapshot
    is complete; ``False`` if ``timeout_s`` (seconds) passed first.

    :raises SaveFailedError: the save ended before its snapshot was taken.
    """
    if not handle._staged_thread.wait(timeout_s):
        return False
    if handle._staged_error is not None:
        raise handle._staged_error
    return True


def persist_outcome(handle: SaveHandle) -> tuple[bool, CheckpointInfo | None]:
    """``(settled, info)`` of ``handle``'s copy to the persistent tier, read from
    any thread without waiting; ``(False, None)`` while it runs.

    :raises SaveFailedError: the copy settled and failed.
    """
    if not handle._persisted.is_set():
        return False, None
    if handle._persist_error is not None:
        raise handle._persist_error
    return True, handle._persisted_info
