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
   ``root`` is given; a local path or an fsspec URL such as ``s3://bucket/run``
   or ``memory://run``), through a :class:`~asyncsave.SyncCheckpointer`: it
   returns once the tensors are staged (training goes on, as with Lightning's
   ``AsyncCheckpointIO``, without its clone of every tensor); writing, the
   commit and the tracker follow in the background. No tensor is pickled;
   Lightning's plain entries (epoch, loops, callback states, optimizer states)
   are stored as JSON, dict subclasses (Lightning's ``AttributeDict``) as plain
   dicts. Hyper-parameters are stored as the plain data Lightning writes to
   ``hparams.yaml``: an OmegaConf ``DictConfig``/``ListConfig`` as its resolved
   container, an ``argparse.Namespace`` as the dict of its attributes, a
   dataclass as ``dataclasses.asdict``; they load back as those dicts and lists
   (``hparams_type``, a class, is stored by its qualified name, which Lightning
   reads as ``AttributeDict``). Any other entry that is not plain data raises
   :class:`~asyncsave.UnsupportedTypeError` naming it
   (``hyper_parameters/config``) unless the plugin was made with
   ``allow_pickle=True``.

   ``path`` itself becomes a small JSON *pointer* file (``{"root": ..., "step":
   N}``). A new path is created before ``save_checkpoint`` returns, marked
   ``"pending"`` (loading it before the step commits raises
   :class:`~asyncsave.CheckpointNotFoundError`): Lightning's
   ``ModelCheckpoint`` sees the name taken and gives the next save another
   (``model-v1.ckpt``), so no two saves share a name. A path that exists
   already (``last.ckpt``) keeps naming its previous step until the new step
   has committed, then is replaced atomically. A save that fails removes the
   pending pointers it created; a save that did not happen (step 0 with
   ``save_step_zero=False``) writes none. One step is in flight at a time: a
   save of a later step first waits until the earlier steps have committed and
   their pointers are written (with saves some steps apart that wait is
   nothing), so a crash mid-save leaves ``last.ckpt`` naming the previous step,
   committed. Several paths saved at one ``global_step`` (the top-k file and
   ``last.ckpt``) point at one checkpoint, saved once (the first call's dict).
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
4. ``wait()`` and ``teardown()``, as Lightning's ``AsyncCheckpointIO``: ``wait``
   blocks until every save so far has committed and its paths name it;
   ``teardown`` (called by the trainer at the end of ``fit``) does that and
   closes the checkpointer (no thread of the plugin is left). Both raise a
   save's failure (also raised by the next ``save_checkpoint`` once known). A
   ``trainer.save_checkpoint(p)`` after ``fit`` reopens the checkpointer and
   returns once staged, as during ``fit``: call ``wait()`` before reading ``p``,
   ``teardown()`` when done. ``remove_checkpoint`` after a ``teardown`` opens
   and closes a checkpointer for that call only.

One process saves (rank 0 under Lightning's strategies): the checkpointer runs
with ``distributed=False``, and ``distributed=True`` is refused. The plugin
pickles (``torch.save(trainer)``, ``strategy="ddp_spawn"``): the copy holds the
settings and what this run's pointers name, and opens its own checkpointer at
its first save. Lightning is an optional extra (``pip install
asyncsave[lightning]``, tested with lightning 2.6.6).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import logging
import os
import threading
import warnings
from argparse import Namespace
from collections import OrderedDict
from pathlib import Path
from typing import Any

import torch
from lightning.fabric.plugins.io.checkpoint_io import CheckpointIO

from ._atomicity import strategy_for
from ._catalog import latest
from ._engine import retain
from ._errors import (
    CheckpointError,
    CheckpointNotFoundError,
    CheckpointWarning,
    UnsupportedCombinationError,
    UnsupportedFormatError,
    UnsupportedTypeError,
)
from ._fs import LocalFileSystem
from ._fsspec import FsspecFileSystem, check_root, is_url, open_root
from ._listing import checkpoints, layout_of, load_step
from ._load import load
from ._options import CheckpointOptions
from ._paths import LOCK_NAME, MANIFEST_NAME
from ._retention import Candidate, Retention
from ._sync import SyncCheckpointer, SyncSaveHandle, run_on_loop

__all__ = ["POINTER_FORMAT", "AsyncsaveCheckpointIO", "plugin_options", "read_pointer"]

logger = logging.getLogger(__name__)

POINTER_FORMAT = "asyncsave-lightning-pointer"
_MAX_POINTER_BYTES = 64 << 10
# The training info of a root the plugin saved whole (_save_whole): only such a
# root is deleted by remove_checkpoint.
_WHOLE = "lightning_whole"
# What the plugin means when a field is not given (see plugin_options).
_PLUGIN_DEFAULTS: dict[str, Any] = {"save_step_zero": True, "distributed": False}
# The checkpoint entries that hold hyper-parameters (LightningModule's and
# LightningDataModule's ``CHECKPOINT_HYPER_PARAMS_KEY``).
_HPARAMS_KEYS = ("hyper_parameters", "datamodule_hyper_parameters")
_HPARAMS_TYPE_KEYS = ("hparams_type", "datamodule_hparams_type")


def plugin_options(options: CheckpointOptions | None = None, **overrides: Any) -> CheckpointOptions:
    """The options an :class:`AsyncsaveCheckpointIO` runs with: one merge rule for
    ``options=`` and keywords.

    Start from :class:`~asyncsave.CheckpointOptions` with the plugin's defaults
    (``save_step_zero=True``: Lightning saves step 0 only when asked;
    ``distributed=False``: Lightning calls the IO on one rank). A field of
    ``options`` whose value differs from ``CheckpointOptions()``'s replaces it
    (a dataclass cannot tell a field left at its default from one set to it: to
    turn ``save_step_zero`` off, pass it as a keyword); then each keyword does.
    ``distributed=None`` (auto) means ``False`` here.

    :raises UnsupportedCombinationError: ``distributed=True``: Lightning's
        strategies call ``save_checkpoint`` on global rank 0 only, so the other
        ranks would never join asyncsave's collectives (a hang).
    :raises TypeError: a keyword that is not a field of ``CheckpointOptions``.
    """
    core = CheckpointOptions()
    given: dict[str, Any] = {}
    if options is not None:
        for field in dataclasses.fields(CheckpointOptions):
            value = getattr(options, field.name)
            if value is not getattr(core, field.name) and value != getattr(core, field.name):
                given[field.name] = value
    unknown = sorted(set(overrides) - {f.name for f in dataclasses.fields(CheckpointOptions)})
    if unknown:
        raise TypeError(f"AsyncsaveCheckpointIO got unknown option(s) {unknown}")
    merged = {**_PLUGIN_DEFAULTS, **given, **overrides}
    if merged["distributed"] is None:
        merged["distributed"] = False
    if merged["distributed"]:
        raise UnsupportedCombinationError(
            "AsyncsaveCheckpointIO(distributed=True): Lightning's strategies call "
            "save_checkpoint on global rank 0 only, so the other ranks would never join "
            "the save; leave distributed unset (the plugin saves from one process)"
        )
    return dataclasses.replace(core, **merged)


def _locate(path: Any, options: CheckpointOptions) -> tuple[LocalFileSystem, Path]:
    """The I/O layer and the absolute path of a path Lightning names: a local
    path (made absolute) or an fsspec URL (kept a URL: ``memory://``, ``s3://``)."""
    check_root(path, "checkpoint path")
    if is_url(path):
        return open_root(
            path,
            filesystem=options.filesystem if _is_url_fs(options.filesystem) else None,
            storage_options=options.storage_options,
            what="checkpoint path",
        )
    return LocalFileSystem(), Path(os.path.abspath(os.fspath(path)))


def _is_url_fs(fs: LocalFileSystem | None) -> bool:
    """Whether ``fs`` is an I/O layer of URLs."""
    return isinstance(fs, FsspecFileSystem)


def _pointer_doc(fs: LocalFileSystem, p: Path) -> dict[str, Any]:
    raw = b""
    with fs.open_read(p) as f:  # a torch.save .ckpt may be GBs: never read it whole
        while len(raw) <= _MAX_POINTER_BYTES:
            chunk = f.read(_MAX_POINTER_BYTES + 1 - len(raw))
            if not chunk:
                break
            raw += chunk
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
    return doc


def _pointer_root(p: Path, rel: str, storage_options: Any = None) -> Path:
    if is_url(rel):
        return open_root(rel, storage_options=storage_options)[1]
    if os.path.isabs(rel):
        return Path(rel)
    if is_url(p):
        return p.parent if rel == "." else open_root(f"{str(p.parent).rstrip('/')}/{rel}")[1]
    return (p.parent / rel).resolve()


def read_pointer(
    path: str | os.PathLike[str], storage_options: Any = None
) -> tuple[Path, int, str]:
    """The checkpoint a pointer file names: ``(root, step, layout)``. ``path``
    may be a local path or an fsspec URL (``storage_options`` for its file
    system); a URL pointer's root is a URL.

    :raises UnsupportedFormatError: ``path`` is not a pointer this plugin wrote
        (a ``torch.save`` ``.ckpt`` of Lightning's own ``TorchCheckpointIO``).
    :raises FileNotFoundError: no file at ``path``.
    """
    fs, p = _locate(path, CheckpointOptions(storage_options=storage_options))
    doc = _pointer_doc(fs, p)
    return _pointer_root(p, doc["root"], storage_options), doc["step"], doc["layout"]


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


def _is_omegaconf(obj: Any) -> bool:
    # Not imported unless a value is one: omegaconf is the user's dependency.
    return type(obj).__module__.startswith("omegaconf.") and hasattr(obj, "_get_node")


def _hparams(obj: Any) -> Any:
    """A hyper-parameter as the plain data Lightning writes to ``hparams.yaml``
    (``lightning.pytorch.core.saving.save_hparams_to_yaml``): OmegaConf
    containers resolved to dicts and lists, a ``Namespace`` as its attributes, a
    dataclass through ``dataclasses.asdict``; recursively."""
    if _is_omegaconf(obj):
        from omegaconf import OmegaConf

        return _hparams(OmegaConf.to_container(obj, resolve=True))
    if isinstance(obj, Namespace):
        return _hparams(vars(obj))
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return _hparams(dataclasses.asdict(obj))
    if isinstance(obj, dict):
        return {k: _hparams(v) for k, v in obj.items()}
    if type(obj) in (list, tuple):
        return type(obj)(_hparams(v) for v in obj)
    return obj


def _storable(checkpoint: dict[str, Any]) -> dict[str, Any]:
    """The checkpoint dict as asyncsave stores it without pickle (see the module
    docstring); the caller's dict is not changed."""
    out = dict(checkpoint)
    for key in _HPARAMS_KEYS:
        if key in out:
            out[key] = _hparams(out[key])
    for key in _HPARAMS_TYPE_KEYS:
        if isinstance(out.get(key), type):
            out[key] = f"{out[key].__module__}.{out[key].__qualname__}"
    return _plain(out)


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
        live, a local path or an fsspec URL; default: the directory of the first
        path Lightning saves to.
    :param options: a :class:`~asyncsave.CheckpointOptions`; keyword
        ``overrides`` replace single fields (``budget_bytes=2 << 30``,
        ``allow_pickle=True``, ``layout="verl"``). Both are merged by one rule
        (:func:`plugin_options`): the plugin's defaults ``save_step_zero=True``
        and ``distributed=False`` hold unless a field is given. ``retention``
        keeps more (a step is kept if it or a pointer keeps it).
    :raises UnsupportedCombinationError: ``distributed=True``.
    """

    def __init__(
        self,
        root: str | os.PathLike[str] | None = None,
        options: CheckpointOptions | None = None,
        **overrides: Any,
    ) -> None:
        opts = plugin_options(options, **overrides)
        rule: Retention = _Referenced(self)
        if opts.retention is not None:
            rule = opts.retention | rule
        self.options = dataclasses.replace(opts, retention=rule)
        self.root: Path | None = None
        if root is not None:
            _, where = _locate(root, self.options)
            self.root = where if is_url(where) else where.resolve()
        self._live: dict[str, int] = {}  # pointer path -> step, this run
        self._pending: set[str] = set()  # pointer paths created pending, not yet final
        self._dirs: set[str] = set()  # where pointers are written
        self._on_disk: set[int] = set()  # committed when the checkpointer opened
        self._loaded: set[int] = set()  # global steps load_checkpoint() returned
        self._saved: set[int] = set()  # global steps this plugin saved (any checkpointer)
        self._init_runtime()

    def _init_runtime(self) -> None:
        """The state that lives only while a checkpointer is open (never pickled)."""
        self._ckpt: SyncCheckpointer | None = None
        self._lock = threading.Lock()
        self._handles: dict[int, SyncSaveHandle] = {}  # saves of this checkpointer
        self._writer: concurrent.futures.ThreadPoolExecutor | None = None
        # (step, pointer write) in save order.
        self._futures: list[tuple[int, concurrent.futures.Future[None]]] = []
        self._error: BaseException | None = None

    def __getstate__(self) -> dict[str, Any]:
        """The settings and this run's pointers; the open checkpointer, its
        threads and the lock stay behind (the copy opens its own when it saves)."""
        state = dict(self.__dict__)
        for name in ("_ckpt", "_lock", "_handles", "_writer", "_futures", "_error"):
            state.pop(name, None)
        state["_on_disk"] = set()  # read again when the copy opens
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._init_runtime()

    # -- saving -----------------------------------------------------------------
    def save_checkpoint(
        self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None
    ) -> None:
        """Save ``checkpoint`` as the asyncsave checkpoint of its ``global_step``
        and point ``path`` at it once committed; returns once staged, with
        ``path`` existing (a pending pointer when it is new).

        :raises TypeError: ``storage_options`` given (as Lightning's own IO).
        :raises UnsupportedTypeError: an entry is not plain data (named).
        :raises SaveFailedError: an earlier save failed.
        """
        if storage_options is not None:
            raise TypeError(
                f"Trainer.save_checkpoint(..., storage_options=...) is not supported by "
                f"{type(self).__name__}: pass asyncsave options to its constructor"
            )
        fs, target = _locate(path, self.options)
        if "global_step" not in checkpoint:
            self._save_whole(checkpoint, target)
            return
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
        ckpt = self._open(target.parent)
        key = str(target)
        with self._lock:
            self._live[key] = step
            self._dirs.add(str(target.parent))
        try:
            handle = self._save_step(ckpt, checkpoint, step)
        except BaseException:
            with self._lock:
                self._live.pop(key, None)
            raise
        if handle is not None and handle.skipped:
            with self._lock:  # nothing is saved: no path may name it
                self._live.pop(key, None)
            return
        self._reserve(fs, target, step)
        assert self._writer is not None
        self._futures.append((step, self._writer.submit(self._point, handle, fs, target, step)))

    def _save_whole(self, state: dict[str, Any], target: Path) -> None:
        """A dict that is not a training checkpoint (no ``global_step``: the
        weights ``ddp_spawn`` hands from rank 0 to the launching process) is
        saved at once as a root of its own at ``target`` (its step 0, whole and
        committed on return): ``load_checkpoint(target)`` loads it,
        ``remove_checkpoint(target)`` removes it."""
        opts = dataclasses.replace(
            self.options,
            layout="asyncsave",
            retention=None,
            save_step_zero=True,
            persistent=None,
            incremental=False,
        )
        with SyncCheckpointer(target, opts) as ckpt:
            # overwrite: a root left at this path by an earlier run (a crash
            # before remove_checkpoint) is replaced atomically, never loaded
            # in place of this save.
            ckpt.save(0, _storable(state), overwrite=True, training_info={_WHOLE: True}).result()

    def _save_step(
        self, ckpt: SyncCheckpointer, checkpoint: dict[str, Any], step: int
    ) -> SyncSaveHandle | None:
        """The handle of ``step``'s save: started now, or the one of this run
        (several paths at one step), or ``None`` for the committed step this run
        resumed from (nothing to wait for)."""
        # A committed step this run did not load or save (another run's, in the
        # same directory) is replaced, atomically, so the path names this run's
        # state. One this plugin saved (before a teardown: a save after fit, a
        # second fit) is this run's own: never saved over.
        handle = self._handles.get(step)
        replace = step in self._on_disk and step not in self._loaded | self._saved
        if handle is not None or (step in self._on_disk and not replace):
            return handle
        if replace:
            warnings.warn(
                f"step {step} in {self.root} is a checkpoint of an earlier run that "
                f"this run did not resume from: replacing it (its older pointers "
                "now name this run's state); use a fresh dirpath to keep both",
                CheckpointWarning,
                stacklevel=3,
            )
        try:
            handle = ckpt.save(
                step,
                _storable(checkpoint),
                training_info={"epoch": _int(checkpoint, "epoch")},
                overwrite=replace,
            )
        except UnsupportedTypeError as exc:
            raise UnsupportedTypeError(
                f"Lightning checkpoint entry {exc.key!r} is not plain data: "
                f"{exc.message}. Convert it, or pass "
                "AsyncsaveCheckpointIO(allow_pickle=True) (and trust the "
                "checkpoints you load)",
                key=exc.key,
                step=step,
            ) from exc
        self._handles[step] = handle
        self._saved.add(step)
        return handle

    def _doc(self, target: Path, step: int, *, pending: bool = False) -> bytes:
        assert self.root is not None
        if is_url(self.root) or is_url(target):
            same = str(self.root).rstrip("/") == str(target.parent).rstrip("/")
            rel = "." if same else str(self.root)
        else:
            rel = os.path.relpath(self.root, target.parent)
        doc: dict[str, Any] = {
            "format": POINTER_FORMAT,
            "root": rel,
            "layout": self.options.layout,
            "step": step,
        }
        if pending:
            doc["pending"] = True
        return json.dumps(doc).encode()

    def _reserve(self, fs: LocalFileSystem, target: Path, step: int) -> None:
        """Create ``target`` as a pending pointer when it does not exist, so that
        Lightning's ``ModelCheckpoint.file_exists`` sees the name taken at once."""
        key = str(target)
        with self._lock:
            if key in self._pending or fs.exists(target):
                return
            _write_atomic(fs, target, self._doc(target, step, pending=True))
            self._pending.add(key)

    def _point(
        self, handle: SyncSaveHandle | None, fs: LocalFileSystem, target: Path, step: int
    ) -> None:
        """Writer thread: once ``step`` has committed, make ``target`` name it
        (atomically), unless it was removed meanwhile. One thread writes in the
        order of the saves, so a path re-pointed to a newer step names each
        committed step in turn and never one that has not committed. A failed
        save removes the pending pointer it created."""
        key = str(target)
        try:
            if handle is not None:
                handle.result()
            with self._lock:
                if self._live.get(key) != step:
                    return
                _write_atomic(fs, target, self._doc(target, step))
                self._pending.discard(key)
        except BaseException as exc:
            logger.error("asyncsave.lightning: saving step %d for %s failed: %r", step, target, exc)
            self._drop_pending(fs, target, step)
            if self._error is None:
                self._error = exc

    def _drop_pending(self, fs: LocalFileSystem, target: Path, step: int) -> None:
        key = str(target)
        with self._lock:
            if self._live.get(key) != step:
                return
            del self._live[key]
            if key in self._pending:
                self._pending.discard(key)
                try:
                    fs.unlink(target)
                except FileNotFoundError:
                    pass
                except OSError as exc:
                    logger.warning("could not remove the pending pointer %s: %r", target, exc)

    def remove_checkpoint(self, path: Any) -> None:
        """Drop the pointer ``path`` and run asyncsave's retention pass: the
        checkpoint it named is deleted once no pointer names it, never while it
        is the tracked step or in flight (then by the pass after a later commit).
        After a ``teardown`` the pass runs on a checkpointer opened and closed
        for this call.

        :raises SaveFailedError: a save of this plugin failed (raised by the
            closing ``teardown`` after a reopen).
        :raises RootInUseError: after a teardown, another process holds the root.
        :raises OSError: the pointer could not be removed (other than missing).
        """
        fs, target = _locate(path, self.options)
        if fs.is_dir(target):
            _remove_whole(fs, target)
            return
        with self._lock:
            self._live.pop(str(target), None)
            self._pending.discard(str(target))
            try:
                fs.unlink(target)
            except FileNotFoundError:
                pass
        ckpt, reopened = self._ckpt, False
        if ckpt is None and self.root is not None:
            ckpt, reopened = self._open(self.root), True
        try:
            tracked = None if ckpt is None else ckpt.checkpointer.tracked_step
            if ckpt is not None and tracked is not None:
                # A retention pass now, under the checkpointer's own rules and locks
                # (the pointer's step may still be in flight: then after its commit).
                run_on_loop(ckpt, retain, ckpt.checkpointer, tracked)
        finally:
            if reopened:
                self.teardown()

    def _referenced_steps(self) -> set[int] | None:
        """The steps a pointer names, or ``None`` when a pointer directory or
        file could not be read (a missing one holds no pointer)."""
        with self._lock:
            steps = set(self._live.values())
            dirs = set(self._dirs)
        if self.root is not None:
            dirs.add(str(self.root))
        for d in dirs:
            found = self._steps_named_in(d)
            if found is None:
                return None
            steps |= found
        return steps

    def _steps_named_in(self, directory: str) -> set[int] | None:
        fs, d = _locate(directory, self.options)
        try:
            names = fs.listdir(d)
        except FileNotFoundError:
            return set()
        except OSError as exc:
            logger.warning("cannot list %s (%r): this retention pass deletes nothing", d, exc)
            return None
        steps: set[int] = set()
        for name in names:
            if not name.endswith(".ckpt"):
                continue
            try:
                doc = _pointer_doc(fs, d / name)
            except (FileNotFoundError, IsADirectoryError, PermissionError, UnsupportedFormatError):
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
            named = _pointer_root(d / name, doc["root"], self.options.storage_options)
            if str(named) == str(self.root):
                steps.add(doc["step"])
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
        :raises CheckpointNotFoundError: a root with no committed checkpoint, a
            pending pointer whose save has not committed, or a pointer naming one
            that is gone; and every error of :func:`asyncsave.load`.
        """
        fs, p = _locate(path, self.options)
        device = map_location if isinstance(map_location, (str, torch.device)) else "cpu"
        where: dict[str, Any] = {
            "filesystem": fs,
            "allow_pickle": self.options.allow_pickle,
            "device": device,
        }
        if fs.exists(p) and not fs.is_dir(p):
            state = self._load_pointer(fs, p, where)
        elif fs.exists(p / MANIFEST_NAME):
            state = load(p, **where)
        elif fs.is_dir(p):
            info = latest(p, layout=self.options.layout, filesystem=fs)
            if info is None:
                raise CheckpointNotFoundError(
                    f"{p} holds no committed checkpoint (layout {self.options.layout!r})",
                    path=p,
                )
            state = load(info.path, **where)
        else:
            raise FileNotFoundError(f"Checkpoint file not found: {p}")
        if not isinstance(state, dict):
            raise UnsupportedFormatError(f"{p} does not hold a Lightning checkpoint", path=p)
        if type(state.get("global_step")) is int:
            self._loaded.add(state["global_step"])  # saving it again keeps it as is
        return state

    def _load_pointer(self, fs: LocalFileSystem, p: Path, where: dict[str, Any]) -> Any:
        doc = _pointer_doc(fs, p)
        root = _pointer_root(p, doc["root"], self.options.storage_options)
        if not is_url(root):
            where = {**where, "filesystem": None}
        elif not is_url(p):  # a local pointer to an object store's root
            where = {**where, "filesystem": None, "storage_options": self.options.storage_options}
        try:
            return load_step(root, doc["step"], layout=doc["layout"], **where)
        except CheckpointNotFoundError as exc:
            if not doc.get("pending"):
                raise
            raise CheckpointNotFoundError(
                f"{p} names step {doc['step']}, whose save had not committed when this "
                "pointer was written (the run may have stopped while saving it): resume "
                f"from the root ({root}) for its latest committed checkpoint",
                path=p,
                step=doc["step"],
            ) from exc

    # -- lifecycle --------------------------------------------------------------
    def _open(self, default_root: Path) -> SyncCheckpointer:
        if self._ckpt is not None:
            return self._ckpt
        if self.root is None:
            self.root = default_root if is_url(default_root) else default_root.resolve()
        layout_of(self.options.layout)
        ckpt = SyncCheckpointer(self.root, self.options)
        ckpt.__enter__()
        try:
            found = checkpoints(
                self.root,
                layout=self.options.layout,
                filesystem=self.options.filesystem,
                storage_options=self.options.storage_options,
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

    def wait(self) -> None:
        """Block until every save so far has committed and every path saved names
        its step (``trainer.save_checkpoint(p)`` then ``wait()``: ``p`` is
        loadable); the checkpointer stays open.

        :raises SaveFailedError: a save failed (its commit, or writing its
            pointer); :class:`CheckpointTimeoutError` when one ran past
            ``save_timeout_s``.
        """
        ckpt = self._ckpt
        try:
            if ckpt is not None:
                ckpt.wait()
        finally:
            while self._futures:
                self._futures.pop(0)[1].result()
        self._raise_error()

    def teardown(self) -> None:
        """Flush pending saves and their pointers, apply the retention pass once
        more (a checkpoint whose pointer went while a save was in flight), close
        the checkpointer (a later save opens a new one). Idempotent.

        :raises SaveFailedError: a save failed (the first failure; the close
            still ran).
        """
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


def _remove_whole(fs: LocalFileSystem, path: Path) -> None:
    """Remove a root that :meth:`AsyncsaveCheckpointIO._save_whole` made: only
    when it holds nothing but its step 0 (whose manifest says the plugin saved it
    whole), tracker and lock file; any other directory stays, with a warning (it
    may be a checkpoint of another kind, or a user's own root)."""
    lay = layout_of("asyncsave")
    names = set(fs.listdir(path))
    if lay.dir_name(0) in names and names <= {lay.dir_name(0), lay.tracker_name, LOCK_NAME}:
        try:
            info = checkpoints(path, filesystem=fs)
        except CheckpointError:
            info = []
        if [i.step for i in info] == [0] and info[0].training_info.get(_WHOLE) is True:
            # Where the storage renames, moved aside in one rename, then
            # deleted: a crash in between leaves a dot-name, never a partial
            # checkpoint under the path.
            if strategy_for(fs).can_move_files:
                aside = path.with_name(f".{path.name}.removing-{os.getpid()}")
                fs.rename(path, aside)
                path = aside
            fs.remove_tree(path)
            return
    logger.warning(
        "remove_checkpoint(%s): a directory that is not a checkpoint this plugin saved "
        "whole (it holds %s): left in place",
        path,
        sorted(names),
    )


def _write_atomic(fs: LocalFileSystem, path: Path, data: bytes) -> None:
    """Replace ``path`` by ``data`` atomically and durably, as the tracker is
    written: the commit protocol's own file replacement (temp file, fsync,
    rename, fsync of the directory locally; one PUT on an object store)."""
    fs.makedirs(path.parent)
    strategy_for(fs).replace_file(fs, path, data)
