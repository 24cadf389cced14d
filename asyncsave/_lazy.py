"""Lazy snapshots: make ``optimizer.step()`` wait until a lazy save is staged.

``save(..., lazy=True)`` returns before the tensors are copied (CheckFreq, FAST'21;
DataStates-LLM, HPDC'24): forward and backward do not change parameters or
optimizer state, so the copies overlap them, and only the next
``optimizer.step()`` must wait. TorchTitan does the same by waiting for its
staging future before the optimizer step. :func:`stage_before_step` installs that
wait as an optimizer step pre-hook (``torch.optim.Optimizer.register_step_pre_hook``).
"""

from __future__ import annotations

import threading
from typing import Any

import torch

from ._engine import Checkpointer
from ._errors import CheckpointTimeoutError, StagingPendingError

__all__ = ["stage_before_step"]


def stage_before_step(
    optimizer: torch.optim.Optimizer,
    checkpointer: Any,
    *,
    timeout_s: float | None = None,
) -> Any:
    """Make every ``optimizer.step()`` first wait until the lazy saves of
    ``checkpointer`` are staged, so the step never mutates a tensor that is still
    being copied (in lazy mode, the torn checkpoint of https://github.com/pytorch/pytorch/issues/144657).

    The wait is a ``threading.Event`` wait, so the hook works from any thread that
    is not the checkpointer's event loop thread: a synchronous training loop with
    :class:`~asyncsave.SyncCheckpointer` (the loop runs in the portal's thread), or
    a training step run with ``anyio.to_thread.run_sync`` next to an async
    :class:`~asyncsave.Checkpointer`. On the event loop's own thread (a training
    step called directly inside an async pump) a blocking wait would deadlock the
    loop that finishes the staging, so there the hook never waits: if a lazy save
    is still staging it raises :class:`StagingPendingError` (``await
    ckpt.staged()`` before ``optimizer.step()`` instead); if staging is done it
    returns at once.

    A lazy save that failed before its snapshot does not stop the step (its
    tensors were never captured, so mutating them is safe); the failure is raised
    by the save's handle and the checkpointer's next ``save()``, ``wait()`` or
    close.

    :param optimizer: any ``torch.optim.Optimizer``.
    :param checkpointer: a :class:`~asyncsave.Checkpointer` or
        :class:`~asyncsave.SyncCheckpointer`.
    :param timeout_s: bound in seconds on one wait (default: the checkpointer's
        ``save_timeout_s``).
    :returns: a ``torch.utils.hooks.RemovableHandle``; ``.remove()`` uninstalls the
        hook.
    :raises StagingPendingError: (from ``step()``) see above.
    :raises CheckpointTimeoutError: (from ``step()``) staging outlasted the bound.
    """
    ckpt: Checkpointer = getattr(checkpointer, "checkpointer", checkpointer)
    if not isinstance(ckpt, Checkpointer):
        raise TypeError(
            f"stage_before_step needs a Checkpointer or SyncCheckpointer, got "
            f"{type(checkpointer).__name__}"
        )
    bound = ckpt.options.save_timeout_s if timeout_s is None else timeout_s

    def hook(opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        # A copy made in C under the GIL: the loop thread may change the dict.
        for handle in list(ckpt._lazy.values()):
            if handle._staged_thread.is_set():
                continue
            if threading.get_ident() == ckpt._loop_thread:
                raise StagingPendingError(
                    f"optimizer.step() was called on the event loop's thread while the "
                    f"lazy save of step {handle.step} is still staging; waiting here "
                    "would deadlock the loop that stages it. `await ckpt.staged()` "
                    "before optimizer.step(), or run the training step in a worker thread",
                    step=handle.step,
                    path=ckpt.root,
                )
            if not handle._staged_thread.wait(bound):
                raise CheckpointTimeoutError(
                    f"the lazy save of step {handle.step} was not staged within {bound} s",
                    step=handle.step,
                    path=ckpt.root,
                )

    return optimizer.register_step_pre_hook(hook)
