"""The synchronous facade: the same engine, driven from a plain training loop.

An anyio blocking portal runs an event loop in a background thread; the
:class:`~asyncsave.Checkpointer` lives there, entered and exited by one task of the
portal (anyio's ``wrap_async_context_manager``), and every call from the caller's
thread is forwarded with ``portal.call``. No second engine, no second set of
semantics: saves, errors, timeouts and the exit behaviour are the async ones.
"""

from __future__ import annotations

import logging
import os
import threading
import warnings
from collections.abc import Iterable, Sequence
from contextlib import AbstractContextManager, ExitStack
from types import TracebackType
from typing import Any

import anyio.from_thread
import torch

from ._engine import Checkpointer, SaveHandle, admission_of, load_latest_and_warning
from ._errors import CheckpointerClosedError, CheckpointWarning, WaitTimeoutError
from ._handle import persist_outcome, wait_staged_blocking
from ._options import CheckpointOptions
from ._policy import AgreedPolicy, SavePolicy, signal_holds
from ._stage import producer_events
from ._template import warned
from ._types import CheckpointInfo, Restored, SaveProgress

__all__ = ["SyncCheckpointer", "SyncSaveHandle", "run_on_loop"]

logger = logging.getLogger(__name__)


class SyncSaveHandle:
    """A save in flight, seen from a synchronous caller (future-like)."""

    def __init__(self, portal: anyio.from_thread.BlockingPortal, handle: SaveHandle) -> None:
        self._portal = portal
        self._handle = handle
        self.step = handle.step
        self.skipped = handle.skipped

    def __repr__(self) -> str:
        return f"<SyncSaveHandle of {self._handle!r}>"

    def done(self) -> bool:
        """Whether the save has committed, failed or been skipped."""
        return self._handle.done()

    @property
    def progress(self) -> SaveProgress:
        """See :attr:`SaveHandle.progress` (read without the portal)."""
        return self._handle.progress

    def staged(self, timeout_s: float | None = None) -> None:
        """Block until the snapshot is complete (a lazy save's tensors may then be
        mutated); returns at once for an eager save. Waits on a thread event, never
        on the portal.

        :raises SaveFailedError: the save ended before its snapshot was taken.
        :raises WaitTimeoutError: ``timeout_s`` passed first.
        """
        if not wait_staged_blocking(self._handle, timeout_s):
            raise WaitTimeoutError(
                f"step {self.step} was not staged within {timeout_s} s", step=self.step
            )

    def persisted(self, timeout_s: float | None = None) -> CheckpointInfo | None:
        """Block until the checkpoint is committed on the persistent tier too; see
        :meth:`SaveHandle.persisted` for what is returned and raised. Works after
        the ``with`` block too (close flushed every copy by then)."""
        handle = self._handle
        if not handle.due_to_persist:
            return None
        settled, info = persist_outcome(handle)
        if not settled:
            return self._portal.call(handle.persisted, timeout_s)
        return info

    def result(self, timeout_s: float | None = None) -> CheckpointInfo | None:
        """Block until the checkpoint is committed and tracked; see
        :meth:`SaveHandle.wait` for what is raised. Works after the ``with`` block
        too (every save is settled by then)."""
        if self._handle.done():
            return self._handle.result()
        return self._portal.call(self._handle.wait, timeout_s)


class SyncCheckpointer(AbstractContextManager["SyncCheckpointer"]):
    """:class:`~asyncsave.Checkpointer` for synchronous code::

        with asyncsave.SyncCheckpointer("runs/exp1") as ckpt:
            restored = ckpt.load_latest({"model": model, "optim": opt})
            for step in ...:
                train_step()
                handle = ckpt.save(step, {"model": model, "optim": opt})  # returns once staged
            handle.result()

    :param root: as for :class:`~asyncsave.Checkpointer`.
    :param options: as for :class:`~asyncsave.Checkpointer`; keyword overrides too.
    :param backend: the event loop run in the background thread (``"asyncio"`` or
        ``"trio"``).

    Methods may be called from any thread but not from the portal's own event loop.
    ``state_dict()`` of the objects saved, and ``load_state_dict()`` of a template,
    run on the portal's thread while the caller's thread waits. CUDA kernels the
    calling thread queued before ``save()`` (on its current streams) are waited for
    by the copies. Leaving the block flushes pending saves with the async exit
    semantics: the body's exception propagates unchanged, a flush failure is
    attached as a note. A checkpointer never exited is flushed at interpreter exit.
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        options: CheckpointOptions | None = None,
        *,
        backend: str = "asyncio",
        **overrides: Any,
    ) -> None:
        memory = overrides["memory"] if "memory" in overrides else getattr(options, "memory", None)
        if memory is not None:
            from ._memtier import refusal

            raise refusal("`SyncCheckpointer`")
        self._ckpt = Checkpointer(root, options, **overrides)
        self._backend = backend
        self._stack: ExitStack | None = None
        self._entered = False
        self._portal: anyio.from_thread.BlockingPortal | None = None

    @property
    def checkpointer(self) -> Checkpointer:
        """The async engine underneath (for inspection)."""
        return self._ckpt

    def __enter__(self) -> SyncCheckpointer:
        if self._stack is not None or self._entered:
            raise CheckpointerClosedError("a SyncCheckpointer can be entered only once")
        self._entered = True
        stack = ExitStack()
        portal = stack.enter_context(anyio.from_thread.start_blocking_portal(self._backend))
        try:
            stack.enter_context(portal.wrap_async_context_manager(self._ckpt))
        except BaseException:
            stack.close()
            raise
        self._stack, self._portal = stack, portal
        signal_holds.opened(self)  # the engine's close runs on the portal's thread
        # The portal's thread is joined at interpreter exit, before atexit handlers:
        # a checkpointer never exited would hang the exit. Close it first, bounded by
        # close_timeout_s (threading's own exit hooks run before that join).
        register = getattr(threading, "_register_atexit", None)
        if register is not None:
            register(self._close_at_exit)
        return self

    def _close_at_exit(self) -> None:
        if self._stack is None or self._portal is None:
            return
        logger.warning(
            "SyncCheckpointer(%s) was never exited; flushing it at exit", self._ckpt.root
        )
        try:
            self.__exit__(None, None, None)
        except Exception:
            logger.exception("flushing SyncCheckpointer(%s) at exit failed", self._ckpt.root)

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool | None:
        assert self._stack is not None
        stack, self._portal = self._stack, None
        try:
            return stack.__exit__(exc_type, exc, tb)
        finally:
            self._stack = None
            signal_holds.closed(self)  # flushed: a policy's held handlers may go back

    def _running_portal(self) -> anyio.from_thread.BlockingPortal:
        portal = self._portal
        if portal is None:
            raise CheckpointerClosedError("use the SyncCheckpointer inside `with`")
        return portal

    def _call(self, func: Any, *args: Any) -> Any:
        return self._running_portal().call(func, *args)

    def save(
        self,
        step: int,
        state: Any,
        *,
        overwrite: bool = False,
        training_info: dict[str, Any] | None = None,
        lazy: bool = False,
    ) -> SyncSaveHandle:
        """Snapshot ``state`` and return once it is staged (or, ``lazy=True``, once
        staging started: call ``handle.staged()`` or install
        :func:`asyncsave.stage_before_step` before mutating the tensors); see
        :meth:`Checkpointer.save` for arguments and errors."""
        # The caller's CUDA streams are per thread: mark what this thread queued
        # before the call crosses to the portal's thread.
        ready = producer_events()
        # The portal of this call: another thread may begin the exit while this
        # save is in flight; the save, once accepted, is flushed by that exit
        # and its handle is returned all the same.
        portal = self._running_portal()
        admission = admission_of(self._ckpt)

        async def save(vetted: bool) -> SaveHandle | list[CheckpointWarning]:
            if not vetted:
                _, notes = admission.vet(step, overwrite)
                if notes:  # for the caller's thread to issue first
                    return notes
            return await admission.submit(
                step,
                state,
                overwrite=overwrite,
                ready=ready,
                training_info=training_info,
                lazy=lazy,
            )

        handle = portal.call(save, False)
        if isinstance(handle, list):
            # Issued here, not on the portal's thread: the caller's filters apply
            # (an error filter raises before anything is saved) and the warning
            # names the caller's line. submit() decides again (without warning):
            # a save of another thread in between may make these stale.
            for note in handle:
                warnings.warn(note, stacklevel=2)
            handle = portal.call(save, True)
        assert isinstance(handle, SaveHandle)
        return SyncSaveHandle(portal, handle)

    def wait(self) -> None:
        """Block until every pending save has committed or failed."""
        self._call(self._ckpt.wait)

    def agree(self, policy: SavePolicy) -> AgreedPolicy:
        """See :meth:`Checkpointer.agree`; its ``should_save`` runs on the calling
        (training) thread."""
        return self._ckpt.agree(policy)

    def staged(self) -> None:
        """Block until every lazy save is staged; see :meth:`Checkpointer.staged`."""
        self._call(self._ckpt.staged)

    def load_latest(
        self,
        template: Any = None,
        *,
        device: str | torch.device = "cpu",
        fallback: bool = False,
        required: Iterable[str | Sequence[Any]] = (),
        strict: bool = True,
    ) -> Restored | None:
        """See :meth:`Checkpointer.load_latest`. A ``strict=False`` warning is
        issued on the calling thread, naming the caller's line."""
        found = self._call(
            load_latest_and_warning, self._ckpt, template, device, fallback, required, strict
        )
        return warned(found, 3)


def run_on_loop(ckpt: SyncCheckpointer, func: Any, *args: Any) -> Any:
    """Run ``func(*args)`` (a coroutine function) on ``ckpt``'s event loop and
    return its result (an integration's call into the engine, e.g.
    :func:`asyncsave._engine.retain`).

    :raises CheckpointerClosedError: ``ckpt`` is not inside its ``with`` block.
    """
    return ckpt._call(func, *args)
