"""Resuming: the checkpoint the tracker names, read in a worker thread (this
rank's part only, on several ranks), falling back to older ones on request."""

from __future__ import annotations

import functools
import logging
from collections.abc import Iterable, Sequence
from typing import Any

import anyio.to_thread
import torch

from ._commit import move_aside
from ._dist import load_rank
from ._errors import CheckpointerClosedError, CheckpointNotFoundError, CorruptCheckpointError
from ._load import _apply_template, _check_required, load, older_committed, resolve
from ._pipeline import Saver
from ._types import Restored

__all__ = ["load_latest"]

logger = logging.getLogger(__name__)


async def load_latest(
    saver: Saver,
    template: Any,
    *,
    device: str | torch.device,
    fallback: bool,
    required: Iterable[str | Sequence[Any]],
) -> Restored | None:
    """The body of :meth:`asyncsave.Checkpointer.load_latest` (see there)."""
    if saver.state != "open":
        raise CheckpointerClosedError("load_latest() needs an open Checkpointer", path=saver.root)
    info = await anyio.to_thread.run_sync(
        lambda: resolve(saver.fs, saver.root, saver.layout, fallback=fallback)
    )
    if info is None:
        # A fresh run, or a mistyped root or layout: say which, where it shows.
        logger.info(
            "no committed checkpoint in %s (layout %r): starting from scratch",
            saver.root,
            saver.layout.name,
        )
        return None
    while True:
        path = info.path
        reader: Any = functools.partial(load, path)
        if saver.coord.world_size > 1:  # this rank's part only
            reader = functools.partial(load_rank, path, saver.coord.rank, saver.coord.world_size)
        try:
            state = await anyio.to_thread.run_sync(
                functools.partial(
                    reader,
                    device=device,
                    allow_pickle=saver.options.allow_pickle,
                    filesystem=saver.fs,
                )
            )
            break
        except CorruptCheckpointError as exc:
            if not fallback:
                raise
            logger.warning("cannot load %s (%s); falling back to an older checkpoint", path, exc)
            step = info.step
            # Not a checkpoint any more: a later save() of this step must write
            # it again, not find it "committed" (and never over damaged bytes).
            saver.committed.pop(step, None)
            if saver.coord.world_size == 1 and saver.fs.atomic_rename:
                await anyio.to_thread.run_sync(
                    saver.under_final_lock, _move_damaged_aside, saver, path, step, str(exc)
                )
            older = await anyio.to_thread.run_sync(
                older_committed, saver.fs, saver.root, saver.layout, step
            )
            if older is None:
                raise CheckpointNotFoundError(
                    f"no loadable checkpoint in {saver.root} at or below step {step}",
                    path=saver.root,
                ) from exc
            info = older
    _check_required(state, required, info.path)
    state = _apply_template(state, template, (), info.path)
    saver.resumed_step = info.step
    saver.committed.setdefault(info.step, info)
    return Restored(state, info)


def _move_damaged_aside(saver: Saver, path: Any, step: int, reason: str) -> None:
    """Move the damaged checkpoint ``path`` aside, durably (raises what fails)."""
    if move_aside(saver.fs, saver.root, path, "damaged", step, reason, quiet=False):
        saver.fs.fsync_dir(saver.root)
