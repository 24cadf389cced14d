"""Listing: the committed checkpoints of a root, and loading one by its step.

What Orbax's ``CheckpointManager.all_steps()`` and ``restore(step)`` give, for
every layout preset (``asyncsave._paths.LAYOUTS``), without building directory
names by hand. Reading only: nothing here changes the root (no lock is taken, so
a root being saved to may be listed; an in-flight save is never listed).
"""

from __future__ import annotations

import logging
import operator
import os
import warnings
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from ._catalog import (
    check_not_one_checkpoint,
    layout_hint,
    moved_aside,
    read_checkpoint,
    scan_steps,
    stored_info,
)
from ._errors import (
    CheckpointNotFoundError,
    CorruptCheckpointError,
    InvalidStepError,
    UncommittedCheckpointError,
)
from ._fs import LocalFileSystem
from ._fsspec import open_root
from ._load import load
from ._paths import LAYOUTS, MANIFEST_NAME, Layout
from ._template import apply_template
from ._types import CheckpointInfo

__all__ = ["checkpoints", "layout_of", "load_step"]

logger = logging.getLogger(__name__)

_MAX_STEP = 2**63 - 1


def layout_of(name: str) -> Layout:
    """The layout preset called ``name``.

    :raises ValueError: no preset has that name (the message lists them).
    """
    try:
        return LAYOUTS[name]
    except (KeyError, TypeError):
        raise ValueError(
            f"layout={name!r} is not a layout preset; choose one of {sorted(LAYOUTS)}"
        ) from None


def checkpoints(
    root: str | os.PathLike[str],
    *,
    layout: str = "asyncsave",
    filesystem: LocalFileSystem | None = None,
    storage_options: Mapping[str, Any] | None = None,
) -> list[CheckpointInfo]:
    """The committed checkpoints under ``root``, oldest step first.

    A checkpoint is listed when its directory has the layout's final name
    (``step_40``, ``global_step_40``, ``iter_0000040``...) and its manifest (and,
    on an object store, its commit marker) reads and every data file has the size
    the manifest says; the checksums are not read (:func:`asyncsave.verify` does
    that). Temporary directories of saves in flight, final-named directories
    that never committed and other files are not listed. A damaged checkpoint, and
    on an object store files with a manifest but no commit marker (a copy made by
    a sync tool: :class:`~asyncsave.UncommittedCheckpointError` says how to adopt
    it), are skipped with a WARNING of logger ``asyncsave._listing`` that says why.

    Each :class:`CheckpointInfo` holds ``step``, ``path``, ``nbytes`` (tensor
    bytes), ``size_bytes`` (bytes in storage: data files and manifest, plus a
    ``training_info.json`` of the ``nemo-rl`` layout and an object store's commit
    marker), ``saved_unix_s`` (when its
    manifest was written, just before the commit), ``num_tensors``,
    ``world_size`` and ``training_info``.

    :param root: the directory (or URL, ``s3://bucket/exp1``) a
        :class:`~asyncsave.Checkpointer` saves to; a root that does not exist
        holds no checkpoint (``[]``).
    :param layout: the layout preset the checkpoints were saved with.
    :param filesystem: the I/O layer (default: chosen from ``root``).
    :param storage_options: as for :func:`asyncsave.load`.
    :raises ValueError: ``layout`` is not a preset.
    :raises CheckpointNotFoundError: ``root`` is not a directory, or is itself one
        checkpoint (a ``manifest.json`` in it), or it holds no
        checkpoint of ``layout`` but some of another preset (the message names the
        layout to pass).
    :raises OSError: the root cannot be listed.
    """
    lay = layout_of(layout)
    fs, path = open_root(root, filesystem=filesystem, storage_options=storage_options)
    if not fs.exists(path):
        return []
    if not fs.is_dir(path):
        raise CheckpointNotFoundError(f"{path} is not a directory", path=path)
    check_not_one_checkpoint(fs, path)
    found: list[CheckpointInfo] = []
    for step, p in sorted(scan_steps(fs, path, lay).items()):
        try:
            found.append(stored_info(fs, p, read_checkpoint(fs, p, expect_step=step)))
        except UncommittedCheckpointError as exc:
            # Object stores: a save in flight (INFO), or files with a manifest but no
            # marker (a copy by a sync tool): said, with how to adopt it.
            there = fs.exists(p / MANIFEST_NAME)
            logger.log(logging.WARNING if there else logging.INFO, "not listing %s", exc)
        except CheckpointNotFoundError:
            continue  # never committed
        except CorruptCheckpointError as exc:
            if fs.exists(p):  # else retired while it was being listed: not damage
                logger.warning("not listing %s: %s", p, exc)
        except FileNotFoundError:
            continue  # retired (retention, prune) while it was being listed
    if not found:
        hint = layout_hint(fs, path, lay)
        if hint:
            raise CheckpointNotFoundError(
                f"no {lay.name!r}-layout checkpoint in {path}{hint}", path=path
            )
    return found


def load_step(
    root: str | os.PathLike[str],
    step: int,
    template: Any = None,
    *,
    layout: str = "asyncsave",
    device: str | torch.device = "cpu",
    allow_pickle: bool = False,
    verify: bool = True,
    required: Iterable[str | Sequence[Any]] = (),
    strict: bool = True,
    filesystem: LocalFileSystem | None = None,
    storage_options: Mapping[str, Any] | None = None,
) -> Any:
    """Load the checkpoint of ``step`` under ``root`` (Orbax's ``restore(step)``).

    The directory is named by the layout preset (``root/step_40``,
    ``root/iter_0000040``); everything else is :func:`asyncsave.load`, with the
    same arguments, return value and errors.

    :param step: a committed step (a non-negative int; NumPy and 0-dim torch
        integers are accepted). :func:`checkpoints` lists them.
    :raises InvalidStepError: ``step`` is not a non-negative int.
    :raises ValueError: ``layout`` is not a preset.
    :raises CheckpointNotFoundError: no committed checkpoint of ``step`` (the
        message lists the steps that are there), or an uncommitted directory.
    :raises CorruptCheckpointError: as for :func:`asyncsave.load`; and every other
        error :func:`asyncsave.load` raises.
    """
    lay = layout_of(layout)
    if type(step) is not int and not isinstance(step, bool):
        try:
            step = operator.index(step)
        except TypeError:
            pass
    if type(step) is not int or not 0 <= step <= _MAX_STEP:
        raise InvalidStepError(f"step must be a non-negative int, got {step!r}")
    fs, path = open_root(root, filesystem=filesystem, storage_options=storage_options)
    target: Path = path / lay.dir_name(step)
    if not fs.is_dir(target):
        check_not_one_checkpoint(fs, path)
        there = sorted(scan_steps(fs, path, lay)) if fs.is_dir(path) else []
        shown = ", ".join(map(str, there[-10:])) or "none"
        asides = moved_aside(fs, path, step)
        gone = f"; step {step} was moved aside at open to {asides[-1]}" if asides else ""
        raise CheckpointNotFoundError(
            f"no checkpoint of step {step} in {path} (layout {lay.name!r}; "
            f"steps named there: {shown}){gone}"
            f"{layout_hint(fs, path, lay) if fs.is_dir(path) else ''}",
            path=target,
            step=step,
        )
    state = load(
        target,
        device=device,
        allow_pickle=allow_pickle,
        verify=verify,
        required=required,
        filesystem=fs,
    )
    state, note = apply_template(state, template, target, strict=strict)
    if note is not None:
        warnings.warn(note, stacklevel=2)
    return state
