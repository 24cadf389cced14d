"""Lightning: a ``CheckpointIO`` plugin that saves through asyncsave.

::

    from lightning.pytorch import Trainer
    from lightning.pytorch.callbacks import ModelCheckpoint
    from asyncsave.lightning import AsyncsaveCheckpointIO

    trainer = Trainer(
        plugins=[AsyncsaveCheckpointIO()],
        callbacks=[ModelCheckpoint(dirpath="runs/exp1", save_last=True)],
    )
    trainer.fit(model, ckpt_path="last")   # resumes when runs/exp1 has a checkpoint

How Lightning's calls map onto asyncsave (one adapter over the core, as
``asyncsave.dcp`` and ``asyncsave.megatron`` are):

1. ``save_checkpoint(checkpoint, path)``: the checkpoint dict is saved as the
   asyncsave checkpoint of its ``global_step`` under the plugin's root (the
   directory of the first path saved, ``ModelCheckpoint``'s ``dirpath``, unless
   ``root`` is given), through a :class:`~asyncsave.SyncCheckpointer`: it returns
   once the tensors are staged (training goes on, as with Lightning's
   ``AsyncCheckpointIO``, without its clone of every tensor); writing, the
   commit (atomic rename) and the tracker follow in the background. No tensor is
   pickled; Lightning's plain entries (epoch, loops, callback states, optimizer
   states, hyper-parameters made of plain values) are stored as JSON, dict
   subclasses (Lightning's ``AttributeDict``) as plain dicts. An entry that is
   not plain data raises :class:`~asyncsave.UnsupportedTypeError` naming it
   (``hyper_parameters/config``) unless the plugin was made with
   ``allow_pickle=True``. ``path`` itself becomes a small JSON *pointer* file
   (``{"root": ..., "step": N}``), written atomically once the step has
   committed: a ``.ckpt`` path never names an uncommitted checkpoint. One step
   is in flight at a time: a save of a later step first waits until the earlier
   steps have committed and their pointers are written (with saves some steps
   apart that wait is nothing), so a crash mid-save leaves ``last.ckpt`` naming
   the previous step, committed. Several
   paths saved at one ``global_step`` (the top-k file and ``last.ckpt``) point
   at one checkpoint, saved once (the first call's dict).
2. ``remove_checkpoint(path)``: the pointer goes at once; the checkpoint it
   named is deleted by asyncsave's retention pass (which never deletes the
   tracked step, a step in flight, or one any other pointer still names) right
   away when it is committed, else after its commit.
3. ``load_checkpoint(path)``: ``path`` may be a pointer file (what
   ``ckpt_path="last"`` and ``ModelCheckpoint.best_model_path`` give), an
   asyncsave checkpoint directory (``runs/exp1/step_40``), or a root
   (``runs/exp1``: its latest committed checkpoint, as the tracker names it).
   Lightning's ``LightningModule.load_from_checkpoint(path)`` does not ask the
   plugin (it calls ``torch.load`` on the path) and fails on a pointer with
   torch's ``UnpicklingError``: outside a Trainer, load with
   ``AsyncsaveCheckpointIO().load_checkpoint(path)["state_dict"]``.
4. ``teardown()``: flushes every pending save and pointer; raises a save's
   failure (also raised by the next ``save_checkpoint`` once known).

One process saves (rank 0 under Lightning's strategies): the checkpointer runs
with ``distributed=False``. Lightning is an optional extra
(``pip install asyncsave[lightning]``, tested with lightning 2.6.6).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import logging
import os
import threading
import warnings
from collections import OrderedDict
from pathlib import Path
from typing import Any

import torch
from lightning.fabric.plugins.io.checkpoint_io import CheckpointIO

from ._atomicity import strategy_for
from ._catalog import latest
from ._engine import retain
from ._errors import (
    CheckpointNotFoundError,
    CheckpointWarning,
    UnsupportedFormatError,
    UnsupportedTypeError,
)
from ._fs import LocalFileSystem
from ._fsspec import check_root
from ._listing import checkpoints, layout_of, load_step
from ._load import load
from ._options import CheckpointOptions
from ._paths import MANIFEST_NAME
from ._retention import Candidate, Retention
from ._sync import SyncCheckpointer, SyncSaveHandle, run_on_loop

__all__ = ["POINTER_FORMAT", "AsyncsaveCheckpointIO", "read_pointer"]

logger = logging.getLogger(__name__)

POINTER_FORMAT = "asyncsave-lightning-pointer"
_MAX_POINTER_BYTES = 64 << 10


def read_pointer(path: str | os.PathLike[str]) -> tuple[Path, int, str]:
    """The checkpoint a pointer file names: ``(root, step, layout)``.

    :raises UnsupportedFormatError: ``path`` is not a pointer this plugin wrote
        (a ``torch.save`` ``.ckpt`` of Lightning's own ``TorchCheckpointIO``).
    :raises FileNotFoundError: no file at ``path``.
    """
    p = Path(path)
    with open(p, "rb") as f:  # a torch.save .ckpt may be GBs: never read it whole
        raw = f.read(_MAX_POINTER_BYTES + 1)
    try:
        doc = json.loads(raw) if len(raw) <= _MAX_POINTER_BYTES else None
    except (UnicodeDecodeError, ValueError):
        doc = None
    if (
        not isinstance(doc, dict)
        or doc.get("format") != POINTER_FORMAT
        or type(doc.get("step")) is not int
        or not isinstance(doc.get("root"), str)
        or not isinstance(doc.get("layout"), str)
    ):
        raise UnsupportedFormatError(
            f"{p} is not a checkpoint pointer of asyncsave.lightning (a torch.save file "
            "of Lightning's TorchCheckpointIO? load it without this plugin)",
            path=p,
        )
    return (p.parent / doc["root"]).resolve(), doc["step"], doc["layout"]


def _plain(obj: Any) -> Any:
    """Lightning's dict subclasses (``AttributeDict``, ``hparams``) as plain dicts,
    recursively; everything else unchanged (the plan names what it cannot store)."""
    t = type(obj)
    if isinstance(obj, dict) and t is not OrderedDict:
        return {k: _plain(v) for k, v in obj.items()}
    if t is OrderedDict:
        out: OrderedDict[Any, Any] = OrderedDict((k, _plain(v)) for k, v in obj.items())
        meta = getattr(obj, "_metadata", None)
        if meta is not None:
            out._metadata = meta  # type: ignore[attr-defined]
        return out
    if t in (list, tuple):
        return t(_plain(v) for v in obj)
    return obj


class _Referenced(Retention):
    """Keeps every step a pointer names: the pointers of this run (in memory,
    also those whose save has not committed yet) and every pointer file in the
    directories this plugin writes to (on disk: a restarted run keeps them)."""

    def __init__(self, plugin: AsyncsaveCheckpointIO) -> None:
        self.plugin = plugin

    def keep(self, candidates: list[Candidate]) -> set[int]:
        steps = self.plugin._referenced_steps()
        # A pointer directory or file that could not be read may name any step:
        # this pass keeps every one (the next pass decides again).
        return {c.step for c in candidates} if steps is None else steps

    def __repr__(self) -> str:
        return "KeepReferencedByLightning()"


class AsyncsaveCheckpointIO(CheckpointIO):
    """Lightning's ``CheckpointIO`` over asyncsave (see the module docstring).

    :param root: where the checkpoints (``step_N`` directories and the tracker)
        live; default: the directory of the first path Lightning saves to.
    :param options: a :class:`~asyncsave.CheckpointOptions`; keyword
        ``overrides`` replace single fields (``budget_bytes=2 << 30``,
        ``allow_pickle=True``, ``layout="verl"``). ``retention`` keeps more
        (a step is kept if it or a pointer keeps it). ``save_step_zero``
        defaults to true (Lightning saves the untrained state on purpose) and
        ``distributed`` to false.
    """

    def __init__(
        self,
        root: str | os.PathLike[str] | None = None,
        options: CheckpointOptions | None = None,
        **overrides: Any,
    ) -> None:
        base = options or CheckpointOptions(save_step_zero=True, distributed=False)
        opts = dataclasses.replace(base, **overrides) if overrides else base
        rule: Retention = _Referenced(self)
        if opts.retention is not None:
            rule = opts.retention | rule
        self.options = dataclasses.replace(opts, retention=rule)
        if root is not None:
            check_root(root, "AsyncsaveCheckpointIO root")
        self.root = None if root is None else Path(root).resolve()
        self._ckpt: SyncCheckpointer | None = None
        self._lock = threading.Lock()
        self._live: dict[str, int] = {}  # pointer path -> step, this run
        self._dirs: set[Path] = set()  # where pointers are written
        self._on_disk: set[int] = set()  # committed when the checkpointer opened
        self._loaded: set[int] = set()  # global steps load_checkpoint() returned
        self._handles: dict[int, SyncSaveHandle] = {}  # saves of this checkpointer
        self._writer: concurrent.futures.ThreadPoolExecutor | None = None
        # (step, pointer write) in save order.
        self._futures: list[tuple[int, concurrent.futures.Future[None]]] = []
        self._error: BaseException | None = None

    # -- saving -----------------------------------------------------------------
    def save_checkpoint(
        self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None
    ) -> None:
        """Save ``checkpoint`` as the asyncsave checkpoint of its ``global_step``
        and point ``path`` at it once committed; returns once staged.

        :raises TypeError: ``storage_options`` given (as Lightning's own IO).
        :raises UnsupportedTypeError: an entry is not plain data (named).
        :raises SaveFailedError: an earlier save failed.
        """
        if storage_options is not None:
            raise TypeError(
                f"Trainer.save_checkpoint(..., storage_options=...) is not supported by "
                f"{type(self).__name__}: pass asyncsave options to its constructor"
            )
        target = _abs(path)
        step = checkpoint.get("global_step")
        if type(step) is not int:
            raise UnsupportedFormatError(
                f"checkpoint for {target} has global_step={step!r}, not an int", path=target
            )
        # One step in flight at a time: the pointers of earlier steps are written
        # (so their steps committed) before a later step is staged. A crash then
        # leaves every path Lightning saved naming a committed step, except the
        # step in flight; with saves some steps apart this waits for nothing.
        while self._futures and self._futures[0][0] < step:
            self._futures.pop(0)[1].result()
        self._raise_error()
        ckpt = self._open(Path(target).parent)
        with self._lock:
            self._live[target] = step
            self._dirs.add(Path(target).parent)
        # A step saved already (this run: its handle; the committed one this run
        # resumed from: nothing to wait for) is not saved again: the path points
        # at it. A committed step this run did not load (another run's, in the same
        # directory) is replaced, atomically, so the path names this run's state.
        handle = self._handles.get(step)
        replace = step in self._on_disk and step not in self._loaded
        if handle is None and (step not in self._on_disk or replace):
            if replace:
                warnings.warn(
                    f"step {step} in {self.root} is a checkpoint of an earlier run that "
                    f"this run did not resume from: replacing it (its older pointers "
                    "now name this run's state); use a fresh dirpath to keep both",
                    CheckpointWarning,
                    stacklevel=2,
                )
            try:
                handle = ckpt.save(
                    step,
                    _plain(checkpoint),
                    training_info={"epoch": _int(checkpoint, "epoch")},
                    overwrite=replace,
                )
            except BaseException as exc:
                with self._lock:
                    self._live.pop(target, None)
                if isinstance(exc, UnsupportedTypeError):
                    raise UnsupportedTypeError(
                        f"Lightning checkpoint entry {exc.key!r} is not plain data: "
                        f"{exc.message}. Convert it, or pass "
                        "AsyncsaveCheckpointIO(allow_pickle=True) (and trust the "
                        "checkpoints you load)",
                        key=exc.key,
                        step=step,
                    ) from exc
                raise
            self._handles[step] = handle
        assert self._writer is not None
        self._futures.append((step, self._writer.submit(self._point, handle, target, step)))

    def _point(self, handle: SyncSaveHandle | None, target: str, step: int) -> None:
        """Writer thread: once ``step`` has committed, make ``target`` name it
        (atomically), unless it was removed meanwhile. One thread writes in the
        order of the saves, so a path re-pointed to a newer step names each
        committed step in turn and never one that has not committed."""
        try:
            if handle is not None:
                handle.result()
            assert self.root is not None
            rel = os.path.relpath(self.root, Path(target).parent)
            doc = {
                "format": POINTER_FORMAT,
                "root": rel,
                "layout": self.options.layout,
                "step": step,
            }
            with self._lock:
                if target not in self._live:
                    return
                _write_atomic(Path(target), json.dumps(doc).encode())
        except BaseException as exc:
            logger.error("asyncsave.lightning: saving step %d for %s failed: %r", step, target, exc)
            if self._error is None:
                self._error = exc

    def remove_checkpoint(self, path: Any) -> None:
        """Drop the pointer ``path`` and run asyncsave's retention pass: the
        checkpoint it named is deleted once no pointer names it, never while it
        is the tracked step or in flight (then by the pass after a later commit).
        After a ``teardown`` this reopens the checkpointer (the next ``teardown``
        closes it)."""
        target = _abs(path)
        with self._lock:
            self._live.pop(target, None)
            try:
                os.unlink(target)
            except FileNotFoundError:
                pass
        ckpt = self._ckpt
        if ckpt is None and self.root is not None:
            ckpt = self._open(self.root)  # after a teardown: closed again by the next
        tracked = None if ckpt is None else ckpt.checkpointer.tracked_step
        if ckpt is not None and tracked is not None:
            # A retention pass now, under the checkpointer's own rules and locks
            # (the pointer's step may still be in flight: then after its commit).
            run_on_loop(ckpt, retain, ckpt.checkpointer, tracked)

    def _referenced_steps(self) -> set[int] | None:
        """The steps a pointer names, or ``None`` when a pointer directory or
        file could not be read (a missing one holds no pointer)."""
        with self._lock:
            steps = set(self._live.values())
            dirs = set(self._dirs)
        if self.root is not None:
            dirs.add(self.root)
        for d in dirs:
            try:
                names = os.listdir(d)
            except FileNotFoundError:
                continue
            except OSError as exc:
                logger.warning("cannot list %s (%r): this retention pass deletes nothing", d, exc)
                return None
            for name in names:
                if not name.endswith(".ckpt"):
                    continue
                try:
                    root, step, _ = read_pointer(d / name)
                except (
                    FileNotFoundError,
                    IsADirectoryError,
                    PermissionError,
                    UnsupportedFormatError,
                ):
                    # removed meanwhile, or not a pointer of asyncsave's (a torch.save
                    # file, a sharded checkpoint's directory, another user's file:
                    # the plugin's own pointers are readable by the process that wrote
                    # them). Other errors (EIO) below: keep everything this pass.
                    continue
                except OSError as exc:
                    logger.warning(
                        "cannot read %s (%r): this retention pass deletes nothing", d / name, exc
                    )
                    return None
                if root == self.root:
                    steps.add(step)
        return steps

    # -- loading ----------------------------------------------------------------
    def load_checkpoint(
        self, path: Any, map_location: Any | None = None, weights_only: bool | None = None
    ) -> dict[str, Any]:
        """Load a pointer file, a checkpoint directory or a root's latest.

        Tensors land on ``map_location`` when it is a device (or its name), else
        on the CPU. Nothing is unpickled unless the plugin has
        ``allow_pickle=True`` (``weights_only`` is accepted for Lightning's
        signature and changes nothing: tensors never go through pickle here).

        :raises FileNotFoundError: nothing at ``path`` (as Lightning's own IO).
        :raises CheckpointNotFoundError: a root with no committed checkpoint, or a
            pointer naming one that is gone; and every error of :func:`asyncsave.load`.
        """
        p = Path(_abs(path))
        device = map_location if isinstance(map_location, (str, torch.device)) else "cpu"
        allow = self.options.allow_pickle
        if p.is_file():
            root, step, layout = read_pointer(p)
            state = load_step(root, step, layout=layout, device=device, allow_pickle=allow)
        elif (p / MANIFEST_NAME).is_file():
            state = load(p, device=device, allow_pickle=allow)
        elif p.is_dir():
            info = latest(p, layout=self.options.layout)
            if info is None:
                raise CheckpointNotFoundError(
                    f"{p} holds no committed checkpoint (layout {self.options.layout!r})",
                    path=p,
                )
            state = load(info.path, device=device, allow_pickle=allow)
        else:
            raise FileNotFoundError(f"Checkpoint file not found: {p}")
        if not isinstance(state, dict):
            raise UnsupportedFormatError(f"{p} does not hold a Lightning checkpoint", path=p)
        if type(state.get("global_step")) is int:
            self._loaded.add(state["global_step"])  # saving it again keeps it as is
        return state

    # -- lifecycle --------------------------------------------------------------
    def _open(self, default_root: Path) -> SyncCheckpointer:
        if self._ckpt is not None:
            return self._ckpt
        if self.root is None:
            self.root = default_root.resolve()
        layout_of(self.options.layout)
        ckpt = SyncCheckpointer(self.root, self.options)
        ckpt.__enter__()
        try:
            found = checkpoints(
                self.root, layout=self.options.layout, filesystem=self.options.filesystem
            )
        except BaseException as exc:
            # Not half-open: the next save opens afresh and raises the same way
            # (found in review: it saved, then failed on a missing writer).
            ckpt.__exit__(type(exc), exc, exc.__traceback__)
            raise
        # Published only once whole.
        self._on_disk = {c.step for c in found}
        self._handles = {}
        self._writer = concurrent.futures.ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="asyncsave-lightning"
        )
        self._ckpt = ckpt
        return ckpt

    def teardown(self) -> None:
        """Flush pending saves and their pointers, apply the retention pass once
        more (a checkpoint whose pointer went while a save was in flight), close
        the checkpointer (a later ``fit`` opens a new one); raise a save's
        failure."""
        ckpt, self._ckpt = self._ckpt, None
        writer, self._writer = self._writer, None
        error: BaseException | None = None
        try:
            if ckpt is not None:
                try:
                    ckpt.wait()
                finally:
                    if writer is not None:
                        writer.shutdown(wait=True)
                tracked = ckpt.checkpointer.tracked_step
                if tracked is not None and self._error is None:
                    run_on_loop(ckpt, retain, ckpt.checkpointer, tracked)
        except BaseException as exc:
            error = exc
        finally:
            if writer is not None:
                writer.shutdown(wait=True)
            self._futures.clear()
            try:
                if ckpt is not None:
                    ckpt.__exit__(None, None, None)
            except BaseException as exc:
                error = error or exc
        if error is not None:
            self._error = None
            raise error
        self._raise_error()

    def _raise_error(self) -> None:
        error, self._error = self._error, None
        if error is not None:
            raise error


def _int(checkpoint: dict[str, Any], key: str) -> int | None:
    value = checkpoint.get(key)
    return value if type(value) is int else None


def _abs(path: Any) -> str:
    return os.path.abspath(os.fspath(path))


def _write_atomic(path: Path, data: bytes) -> None:
    """Replace ``path`` by ``data`` atomically and durably (temp file, fsync,
    rename, fsync of the directory), as the tracker is written: the commit
    protocol's own file replacement."""
    fs = LocalFileSystem()
    path.parent.mkdir(parents=True, exist_ok=True)
    strategy_for(fs).replace_file(fs, path, data)
