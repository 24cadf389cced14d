"""Lightning: a ``CheckpointIO`` plugin that writes real ``.ckpt`` files,
asynchronously and atomically.

::

    from lightning.pytorch import Trainer
    from lightning.pytorch.callbacks import ModelCheckpoint
    from asyncsave.lightning import AsyncsaveCheckpointIO

    trainer = Trainer(
        plugins=[AsyncsaveCheckpointIO()],
        callbacks=[ModelCheckpoint(dirpath="runs/exp1", save_last=True)],
    )
    trainer.fit(model, ckpt_path="last")   # resumes when runs/exp1 has a checkpoint
    Model.load_from_checkpoint("runs/exp1/last.ckpt")   # no asyncsave needed

The file at each path Lightning names is the checkpoint, in torch's own zip
format (what ``torch.save`` writes): ``LightningModule.load_from_checkpoint``,
``torch.load(path, weights_only=True)``, ``trainer.fit(ckpt_path=...)``,
copying or listing the folder all work without this plugin. How Lightning's
calls map onto asyncsave:

1. ``save_checkpoint(checkpoint, path)`` stages: every tensor of the dict is
   copied into host buffers the plugin keeps and reuses (one per position in the
   tree, page-locked for CUDA sources), the containers are rebuilt and the plain
   entries kept, so the call returns once that copy is made and training may
   change the tensors. One writer thread then serialises the staged tree with
   ``torch.save`` into a temporary file beside ``path`` (a name starting with
   ``.asyncsave-tmp-``, which Lightning's ``*.ckpt`` listing never sees), fsyncs
   it, renames it onto ``path`` and fsyncs the directory: the commit protocol's
   streamed file replacement (one upload, completed at close, on an object
   store). torch records a CRC-32 of every record of the zip; ``torch.load`` does
   not check them, this plugin's ``load_checkpoint`` does (and
   :func:`verify_ckpt` alone).

   Entries are those ``torch.load(weights_only=True)`` loads (what Lightning's
   ``load_from_checkpoint`` uses by default): tensors, ``dict``/``OrderedDict``
   (``AttributeDict`` and other dict subclasses become plain dicts), ``list``,
   ``tuple``, ``set``, ``int``, ``float``, ``complex``, ``str``, ``bytes``,
   ``bool``, ``None``, ``torch.dtype``/``device``/``Size``. Hyper-parameters are
   stored as the plain data Lightning writes to ``hparams.yaml`` (an OmegaConf
   container resolved, a ``Namespace`` as its attributes, a dataclass through
   ``dataclasses.asdict``; ``hparams_type`` by its qualified name). Anything else
   raises :class:`~asyncsave.UnsupportedTypeError` naming the entry
   (``hyper_parameters/config``) unless the plugin was made with
   ``allow_pickle=True`` (then it is pickled, and loading it needs
   ``weights_only=False``).

   A path that does not exist yet is created before the call returns, as a tiny
   *pending* file (JSON ``{"format": "asyncsave-lightning-pending",
   "global_step": N}``, which ``torch.load`` refuses) that the commit replaces: Lightning's
   ``ModelCheckpoint`` sees the name taken and gives the next save another
   (``model-v1.ckpt``). A path that exists (``last.ckpt``) keeps its previous
   checkpoint until the new one is whole. A failed save removes the pending file
   it created and raises at the next save, ``wait`` or ``teardown``. One global
   step is in flight at a time: a save of another step first waits until the
   earlier writes are committed (with saves some steps apart that wait is
   nothing), so a crash mid-save leaves every earlier path whole. Several paths
   saved at one ``global_step`` (the top-k file and ``last.ckpt``) share the
   staged copy of every tensor that has not changed since (no second copy while
   the first write runs); each path gets its own file with its own dict.
2. ``remove_checkpoint(path)`` deletes the file (a write still in flight for it
   is dropped, or its file deleted once written).
3. ``load_checkpoint(path, map_location, weights_only)`` verifies the CRC-32s,
   then ``torch.load`` s the file; ``weights_only=None`` means ``True`` unless the
   plugin has ``allow_pickle=True``. It also reads what the previous release
   wrote: a JSON pointer file, an asyncsave checkpoint directory
   (``runs/exp1/step_40``) or root (its latest committed step).
4. ``wait()`` blocks until every save so far is committed; ``teardown()``
   (called by the trainer at the end of ``fit``) does that and frees the
   staging buffers. Both raise a save's failure. The writer thread runs only
   while writes are queued (it is gone once ``wait`` returns).

Lightning calls the IO on global rank 0 only: the plugin writes from one process
(``distributed=True`` is refused), pickles (``strategy="ddp_spawn"``: the copy
starts its own writer at its first save), and a dict without ``global_step``
(the weights ``ddp_spawn`` hands to the launching process) is committed before
``save_checkpoint`` returns. Lightning is an optional extra (``pip install
asyncsave[lightning]``, tested with lightning 2.6.6).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import copy
import dataclasses
import json
import logging
import os
import pickle
import threading
import warnings
import zipfile
from argparse import Namespace
from collections import OrderedDict, deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from lightning.fabric.plugins.io.checkpoint_io import CheckpointIO

from ._atomicity import strategy_for
from ._bits import as_bits
from ._catalog import latest
from ._errors import (
    CheckpointError,
    CheckpointNotFoundError,
    CheckpointTimeoutError,
    CheckpointWarning,
    ChecksumMismatchError,
    SaveFailedError,
    StagingBudgetError,
    UnsafeLoadError,
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

__all__ = [
    "PENDING_FORMAT",
    "POINTER_FORMAT",
    "AsyncsaveCheckpointIO",
    "plugin_options",
    "read_pointer",
    "verify_ckpt",
]

logger = logging.getLogger(__name__)

#: What the previous release wrote at each path: a JSON pointer to a step directory.
POINTER_FORMAT = "asyncsave-lightning-pointer"
#: What a new path holds while its first save is in flight.
PENDING_FORMAT = "asyncsave-lightning-pending"
_MAX_POINTER_BYTES = 64 << 10
_ZIP_MAGIC = b"PK\x03\x04"
# The training info of a root the previous release saved whole: only such a
# root is deleted by remove_checkpoint.
_WHOLE = "lightning_whole"
# What the plugin means when a field is not given (see plugin_options).
_PLUGIN_DEFAULTS: dict[str, Any] = {"save_step_zero": True, "distributed": False}
# The checkpoint entries that hold hyper-parameters (LightningModule's and
# LightningDataModule's ``CHECKPOINT_HYPER_PARAMS_KEY``).
_HPARAMS_KEYS = ("hyper_parameters", "datamodule_hyper_parameters")
_HPARAMS_TYPE_KEYS = ("hparams_type", "datamodule_hparams_type")
# Leaves torch.load(weights_only=True) loads (torch.Size before tuple).
_LEAVES = (type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device, torch.Size)
_KEYS = (type(None), bool, int, float, str)


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
    fs = options.filesystem
    local = fs if fs is not None and not _is_url_fs(fs) else LocalFileSystem()
    return local, Path(os.path.abspath(os.fspath(path)))


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
    if isinstance(doc, dict) and doc.get("format") == PENDING_FORMAT:
        step = doc.get("global_step")
        raise CheckpointNotFoundError(
            f"{p} is the placeholder of a save of global step {step} that had not "
            "committed: if this process is still writing it, the plugin's wait() "
            "returns once it is whole; if the run stopped while saving it, resume "
            "from another checkpoint of its folder",
            path=p,
            step=step if type(step) is int else None,
        )
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

    :raises UnsupportedFormatError: ``path`` is not a pointer the previous
        release wrote (a ``torch.save`` ``.ckpt``).
    :raises CheckpointNotFoundError: ``path`` is a pending placeholder.
    :raises FileNotFoundError: no file at ``path``.
    """
    fs, p = _locate(path, CheckpointOptions(storage_options=storage_options))
    doc = _pointer_doc(fs, p)
    return _pointer_root(p, doc["root"], storage_options), doc["step"], doc["layout"]


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
    """The checkpoint dict with its hyper-parameters as plain data (see the module
    docstring); the caller's dict is not changed."""
    out = dict(checkpoint)
    for key in _HPARAMS_KEYS:
        if key in out:
            out[key] = _hparams(out[key])
    for key in _HPARAMS_TYPE_KEYS:
        if isinstance(out.get(key), type):
            out[key] = f"{out[key].__module__}.{out[key].__qualname__}"
    return out


class _Arena:
    """The host buffers a checkpoint's tensors are staged into: one per position
    in the tree (``state_dict/net.0.weight``), reused by the next save whose
    tensor there has the same shape, dtype and kind of memory, so a run whose
    state keeps its shapes allocates them once (Lightning's ``AsyncCheckpointIO``
    clones every tensor at every save instead). Copies move bits, never values
    (``as_bits``: every dtype round-trips exactly).

    A buffer is one tensor of its own (never a view of one large block): torch's
    zip format writes one record per storage, and loads each tensor over its
    storage, so a view of a shared block would write and load the whole block.

    Within one global step (Lightning saves the top-k file and ``last.ckpt`` one
    after the other), a CPU tensor whose bits equal its buffer's is not copied
    again, and the buffer is shared by both files; while a write still reads the
    buffers, a tensor that changed gets a buffer of its own for this save.

    :param budget_bytes: cap on the bytes of buffers held (``None``: none).
    """

    def __init__(self, budget_bytes: int | None) -> None:
        self.budget_bytes = budget_bytes
        self._buffers: dict[str, torch.Tensor] = {}
        self._step: int | None = None
        self._same_step = False
        self._busy = False
        self._devices: set[torch.device] = set()

    def begin(self, step: int | None, *, busy: bool) -> None:
        """Start staging a save of ``step``; ``busy``: a write still reads the
        buffers (only for a second save of the step being written)."""
        self._same_step = step is not None and step == self._step
        self._step, self._busy, self._devices = step, busy, set()

    def end(self) -> None:
        """Wait for the device-to-host copies of this save (one synchronize per
        CUDA device)."""
        for device in self._devices:
            torch.cuda.current_stream(device).synchronize()

    def clear(self) -> None:
        """Free every buffer (``teardown``)."""
        self._buffers.clear()
        self._step = None

    def tensor(self, key: str, t: torch.Tensor) -> torch.Tensor:
        """The staged copy of ``t``, found at ``key``: a CPU tensor of ``t``'s
        shape and dtype (contiguous), or a CPU clone for what has no plain
        strided memory (sparse, quantized, nested, meta, subclasses).

        :raises StagingBudgetError: a new buffer would exceed ``budget_bytes``.
        """
        if (
            type(t) not in (torch.Tensor, torch.nn.Parameter)
            or t.layout != torch.strided
            or t.is_quantized
            or t.is_nested
            or t.device.type == "meta"
        ):
            t = t.detach()
            return t.clone() if t.device.type == "meta" else t.to("cpu", copy=True)
        src = t.detach().resolve_conj().resolve_neg()
        pin = src.device.type == "cuda"
        buf = self._buffers.get(key)
        fits = buf is not None and (buf.shape, buf.dtype, buf.is_pinned()) == (
            src.shape,
            src.dtype,
            pin,
        )
        if buf is not None and fits and self._same_step and not pin:
            if torch.equal(as_bits(buf), as_bits(src)):
                return buf  # staged by this step's earlier save, unchanged since
        if buf is None or self._busy or not fits:
            buf = self._allocate(key, src, pin)
        as_bits(buf).copy_(as_bits(src), non_blocking=pin)
        if pin:
            self._devices.add(src.device)
        return buf

    def _allocate(self, key: str, t: torch.Tensor, pin: bool) -> torch.Tensor:
        held = sum(b.nbytes for k, b in self._buffers.items() if k != key)
        nbytes = t.numel() * t.element_size()
        if self.budget_bytes is not None and held + nbytes > self.budget_bytes:
            raise StagingBudgetError(
                f"staging {key!r} ({nbytes} bytes) would hold {held + nbytes} bytes of "
                f"host buffers, over budget_bytes={self.budget_bytes}: raise it, or "
                "leave it unset (the plugin keeps one copy of the state's tensors)",
                key=key,
            )
        buf = torch.empty(tuple(t.shape), dtype=t.dtype, pin_memory=pin)
        if not self._busy:
            self._buffers[key] = buf
        return buf


def _join(key: str, k: Any) -> str:
    return f"{key}/{k}" if key else str(k)


def _stage(obj: Any, key: str, arena: _Arena, allow_pickle: bool) -> Any:
    """``obj`` with every tensor replaced by its staged copy and every container
    rebuilt (dict subclasses as plain dicts, an ``OrderedDict`` with its
    ``_metadata``): nothing of the caller's is shared but immutable leaves.

    :raises UnsupportedTypeError: a leaf or key that
        ``torch.load(weights_only=True)`` refuses, named by its path, unless
        ``allow_pickle`` (then it is deep-copied and pickled by the writer).
    """
    if isinstance(obj, torch.Tensor):
        return arena.tensor(key, obj)
    t = type(obj)
    if t in _LEAVES:
        return obj
    if isinstance(obj, dict):
        out: dict[Any, Any] = OrderedDict() if t is OrderedDict else {}
        for k, v in obj.items():
            if type(k) not in _KEYS and not allow_pickle:
                _refuse(_join(key, repr(k)), k)
            out[k] = _stage(v, _join(key, k), arena, allow_pickle)
        meta = getattr(obj, "_metadata", None) if t is OrderedDict else None
        if meta is not None:
            out._metadata = copy.deepcopy(meta)  # type: ignore[attr-defined]
        return out
    if t in (list, tuple, set):
        return t(_stage(v, _join(key, i), arena, allow_pickle) for i, v in enumerate(obj))
    if allow_pickle:
        return copy.deepcopy(obj)
    _refuse(key, obj)


def _refuse(key: str, obj: Any) -> Any:
    raise UnsupportedTypeError(
        f"Lightning checkpoint entry {key!r} is a {type(obj).__qualname__}, not plain "
        "data: torch.load(weights_only=True), which load_from_checkpoint uses by "
        "default, refuses it. Convert it, or pass AsyncsaveCheckpointIO(allow_pickle=True) "
        "and load with weights_only=False (only checkpoints you trust)",
        key=key,
    )


def verify_ckpt(path: str | os.PathLike[str], storage_options: Any = None) -> None:
    """Check every record of a torch zip ``.ckpt`` against the CRC-32 torch wrote
    for it (``torch.load`` does not); reads the whole file once. ``path`` may be a
    local path or an fsspec URL.

    :raises ChecksumMismatchError: a record's bytes differ from its CRC-32 (named).
    :raises CheckpointNotFoundError: ``path`` is the pending placeholder of a save
        that has not committed (still being written, or the run stopped), with
        its ``step``.
    :raises UnsupportedFormatError: not a torch zip file.
    :raises FileNotFoundError: no file at ``path``.
    """
    fs, p = _locate(path, CheckpointOptions(storage_options=storage_options))
    with fs.open_read(p) as f:
        try:
            bad = zipfile.ZipFile(f).testzip()
        except zipfile.BadZipFile as exc:
            with contextlib.suppress(UnsupportedFormatError):
                _pointer_doc(fs, p)  # a pending placeholder raises, naming its step
            raise UnsupportedFormatError(
                f"{p} is not a torch zip checkpoint ({exc})", path=p
            ) from exc
    if bad is not None:
        raise ChecksumMismatchError(
            f"{p}: record {bad!r} does not match the CRC-32 torch wrote for it "
            "(the file was damaged after it was written)",
            path=p,
            key=bad,
        )


def _pending_bytes(step: int | None) -> bytes:
    # JSON, not torch.save: a placeholder is no checkpoint (torch.load refuses
    # it), and a save costs one torch.save call, as with Lightning's own IO.
    return json.dumps({"format": PENDING_FORMAT, "global_step": step}).encode()


# The writes queued or running in this process, by path: loading a path that
# is being written (by any plugin of this process) waits for that write.
_IN_FLIGHT: dict[str, concurrent.futures.Future[None]] = {}
_IN_FLIGHT_LOCK = threading.Lock()


def _await_write(path: Path, timeout_s: float | None) -> None:
    """Wait (at most ``timeout_s``) for this process's write of ``path``, if one
    is queued or running; its failure is its own plugin's to raise."""
    with _IN_FLIGHT_LOCK:
        future = _IN_FLIGHT.get(str(path))
    if future is not None:
        concurrent.futures.wait([future], timeout=timeout_s)


class _Writer:
    """Runs the plugin's writes one after the other on one thread, started by
    the first write and gone once none is queued: between saves no thread of
    the plugin runs (Lightning's tests check that a test leaves none)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._jobs: deque[tuple[concurrent.futures.Future[None], Callable[[], None]]] = deque()
        self._thread: threading.Thread | None = None

    def submit(self, job: Callable[[], None]) -> concurrent.futures.Future[None]:
        """Queue ``job``; its future resolves once it has run."""
        future: concurrent.futures.Future[None] = concurrent.futures.Future()
        with self._lock:
            self._jobs.append((future, job))
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="asyncsave-lightning")
                self._thread.start()
        return future

    def _run(self) -> None:
        while True:
            with self._lock:
                if not self._jobs:
                    self._thread = None
                    return
                future, job = self._jobs.popleft()
            if future.set_running_or_notify_cancel():
                try:
                    job()
                except BaseException as exc:
                    future.set_exception(exc)
                else:
                    future.set_result(None)

    def join(self, timeout_s: float | None) -> None:
        """Wait (at most ``timeout_s``) for the thread to leave, its queue empty."""
        with self._lock:
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout_s)

    def cancel(self) -> None:
        """Drop the writes not started yet (a timed-out teardown)."""
        with self._lock:
            jobs, self._jobs = list(self._jobs), deque()
        for future, _ in jobs:
            future.cancel()


class AsyncsaveCheckpointIO(CheckpointIO):
    """Lightning's ``CheckpointIO`` writing torch ``.ckpt`` files in the
    background (see the module docstring).

    :param root: accepted for the previous release's signature; unused (the
        file at each path Lightning names is the checkpoint), with a
        :class:`~asyncsave.CheckpointWarning`.
    :param options: a :class:`~asyncsave.CheckpointOptions`; keyword
        ``overrides`` replace single fields. Both are merged by one rule
        (:func:`plugin_options`). The plugin uses ``allow_pickle``,
        ``save_step_zero``, ``budget_bytes`` (cap on its staging buffers),
        ``save_timeout_s`` (bound of ``wait``), ``filesystem`` and
        ``storage_options`` (URL paths), and ``layout`` (reading a previous
        release's root).
    :raises UnsupportedCombinationError: ``distributed=True``.
    """

    def __init__(
        self,
        root: str | os.PathLike[str] | None = None,
        options: CheckpointOptions | None = None,
        **overrides: Any,
    ) -> None:
        self.options = plugin_options(options, **overrides)
        if root is not None:
            _locate(root, self.options)  # a bad one is still refused by name
            warnings.warn(
                "AsyncsaveCheckpointIO(root=...) is unused: each .ckpt path Lightning "
                "names is the checkpoint itself",
                CheckpointWarning,
                stacklevel=2,
            )
        self.root = root
        self._init_runtime()

    def _init_runtime(self) -> None:
        """The state that lives only while the writer runs (never pickled)."""
        self._lock = threading.Lock()
        self._arena = _Arena(self.options.budget_bytes)
        self._writer = _Writer()
        # (global step, write) in save order.
        self._futures: list[tuple[int | None, concurrent.futures.Future[None]]] = []
        self._live: dict[str, int] = {}  # path -> sequence number of its latest save
        self._pending: set[str] = set()  # paths created pending, not yet written
        self._seq = 0
        self._error: BaseException | None = None

    def __getstate__(self) -> dict[str, Any]:
        """The settings only: the writer, the buffers and the lock stay behind
        (the copy starts its own at its first save)."""
        return {"options": self.options, "root": self.root}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._init_runtime()

    # -- saving -----------------------------------------------------------------
    def save_checkpoint(
        self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None
    ) -> None:
        """Stage ``checkpoint`` and write it to ``path`` in the background (see
        the module docstring); returns once staged, with ``path`` existing (a
        pending file when it is new). A dict without ``global_step`` is
        committed before this returns.

        :raises TypeError: ``storage_options`` given (as Lightning's own IO).
        :raises UnsupportedTypeError: an entry is not plain data (named).
        :raises StagingBudgetError: the staging buffers would exceed ``budget_bytes``.
        :raises SaveFailedError: an earlier save failed.
        """
        if storage_options is not None:
            raise TypeError(
                f"Trainer.save_checkpoint(..., storage_options=...) is not supported by "
                f"{type(self).__name__}: pass asyncsave options to its constructor"
            )
        fs, target = _locate(path, self.options)
        step = checkpoint.get("global_step")
        if step is not None and type(step) is not int:
            raise UnsupportedFormatError(
                f"checkpoint for {target} has global_step={step!r}, not an int", path=target
            )
        if step == 0 and not self.options.save_step_zero:
            warnings.warn(
                f"not saving {target}: step 0 and save_step_zero=False",
                CheckpointWarning,
                stacklevel=2,
            )
            return
        # One global step in flight: a save of another step waits for the writes
        # before it (which also frees the staging buffers for reuse).
        self._drain(keep=step)
        self._raise_error()
        staged = self._stage(checkpoint, step)
        self._reserve(fs, target, step)
        key = str(target)
        with self._lock:
            self._seq += 1
            self._live[key] = self._seq
            seq = self._seq
        job = self._writer.submit(lambda: self._write(staged, fs, target, step, seq))
        # A write dropped before it ran (a teardown past save_timeout_s) leaves
        # no placeholder behind: Lightning would see the name taken for good.
        job.add_done_callback(lambda done: self._dropped(done, fs, target, seq))
        with _IN_FLIGHT_LOCK:
            _IN_FLIGHT[key] = job
        job.add_done_callback(lambda done: _forget(key, done))
        self._futures.append((step, job))
        if step is None:  # ddp_spawn's weights: the launching process loads them next
            self.wait()

    def _stage(self, checkpoint: dict[str, Any], step: int | None) -> Any:
        self._arena.begin(step, busy=bool(self._futures))
        try:
            staged = _stage(_storable(checkpoint), "", self._arena, self.options.allow_pickle)
        except UnsupportedTypeError as exc:
            exc.step = step
            raise
        finally:
            self._arena.end()
        return staged

    def _drain(self, keep: int | None = -1) -> None:
        """Wait for the writes in flight, except while they are of step ``keep``
        (a second path of the step being written), bounded by ``save_timeout_s``."""
        if self._futures and keep is not None and all(s == keep for s, _ in self._futures):
            return
        while self._futures:
            step, job = self._futures[0]
            try:
                job.result(timeout=self.options.save_timeout_s)
            except concurrent.futures.TimeoutError:
                raise CheckpointTimeoutError(
                    f"the save of global step {step} ran past save_timeout_s="
                    f"{self.options.save_timeout_s}",
                    step=step,
                ) from None
            self._futures.pop(0)
        self._writer.join(self.options.save_timeout_s)

    def _reserve(self, fs: LocalFileSystem, target: Path, step: int | None) -> None:
        """Create ``target`` as a pending file when it does not exist, so that
        Lightning's ``ModelCheckpoint.file_exists`` sees the name taken at once."""
        key = str(target)
        with self._lock:
            if key in self._pending or fs.exists(target):
                return
            fs.makedirs(target.parent)
            strategy_for(fs).replace_file(fs, target, _pending_bytes(step))
            self._pending.add(key)

    def _write(
        self, staged: Any, fs: LocalFileSystem, target: Path, step: int | None, seq: int
    ) -> None:
        """Writer thread: ``torch.save`` the staged tree to ``target`` through the
        commit protocol, unless a later save of the path or its removal came
        first; a failure is kept for the caller and its pending file removed."""
        key = str(target)
        try:
            with self._lock:
                if self._live.get(key) != seq:
                    return
            strategy_for(fs).replace_file_streamed(fs, target, lambda f: torch.save(staged, f))  # type: ignore[arg-type]
            with self._lock:
                removed = key not in self._live
                if self._live.get(key) == seq:
                    del self._live[key]
                    self._pending.discard(key)
            if removed:  # remove_checkpoint ran while it was written
                _unlink(fs, target)
        except BaseException as exc:
            logger.error(
                "asyncsave.lightning: saving %s (step %s) failed", target, step, exc_info=True
            )
            self._drop_pending(fs, target, seq)
            if self._error is None:
                error = SaveFailedError(
                    f"saving {target} (global step {step}) failed: {exc!r}", path=target, step=step
                )
                error.__cause__ = exc
                self._error = error

    def _dropped(
        self, done: concurrent.futures.Future[None], fs: LocalFileSystem, target: Path, seq: int
    ) -> None:
        """Done callback of a write: one cancelled before it ran removes its
        pending file."""
        if done.cancelled():
            self._drop_pending(fs, target, seq)

    def _drop_pending(self, fs: LocalFileSystem, target: Path, seq: int) -> None:
        key = str(target)
        with self._lock:
            if self._live.get(key) != seq:
                return
            del self._live[key]
            if key in self._pending:
                self._pending.discard(key)
                _unlink(fs, target)

    def remove_checkpoint(self, path: Any) -> None:
        """Delete the ``.ckpt`` at ``path`` (a write in flight for it is dropped,
        or its file deleted once written). A directory is removed only when it
        is a root the previous release saved whole (``ddp_spawn``'s weights);
        any other stays, with a warning. A previous release's pointer file goes;
        the step directory it named stays (``asyncsave prune`` removes those).

        :raises OSError: the file could not be removed (other than missing).
        """
        fs, target = _locate(path, self.options)
        if fs.is_dir(target):
            _remove_whole(fs, target)
            return
        with self._lock:
            self._live.pop(str(target), None)
            self._pending.discard(str(target))
            _unlink(fs, target)

    # -- loading ----------------------------------------------------------------
    def load_checkpoint(
        self, path: Any, map_location: Any | None = None, weights_only: bool | None = None
    ) -> dict[str, Any]:
        """Load a ``.ckpt`` (verified against its CRC-32s first), or what the
        previous release wrote: a pointer file, a checkpoint directory, a root's
        latest. A path this process is still writing (a ``trainer.save_checkpoint``
        just before) is loaded once that write is done (at most
        ``save_timeout_s``).

        :param map_location: as ``torch.load``'s (a pointer's or a directory's
            tensors land on it when it is a device or its name, else on the CPU).
        :param weights_only: as ``torch.load``'s; ``None``: ``True`` unless the
            plugin has ``allow_pickle=True``.
        :raises FileNotFoundError: nothing at ``path`` (as Lightning's own IO).
        :raises ChecksumMismatchError: a record does not match its CRC-32.
        :raises UnsafeLoadError: ``weights_only`` loading refused an object
            (saved with ``allow_pickle=True``).
        :raises CheckpointNotFoundError: a pending file (its save never
            committed), a root with no committed checkpoint, a pointer naming a
            step that is gone.
        :raises UnsupportedFormatError: a file that is neither.
        """
        fs, p = _locate(path, self.options)
        _await_write(p, self.options.save_timeout_s)
        if not fs.exists(p):  # Lightning's own message, with the path as given
            raise FileNotFoundError(f"Checkpoint file not found: {path}")
        if not fs.is_dir(p) and _head(fs, p) in (_ZIP_MAGIC, b"\x80\x02"):
            state = self._load_torch(fs, p, map_location, weights_only)
        else:
            state = _load_legacy(fs, p, map_location, self.options)
        if not isinstance(state, dict):
            raise UnsupportedFormatError(f"{p} does not hold a Lightning checkpoint", path=p)
        return state

    def _load_torch(
        self, fs: LocalFileSystem, p: Path, map_location: Any, weights_only: bool | None
    ) -> Any:
        if weights_only is None:
            weights_only = not self.options.allow_pickle
        if _head(fs, p) == _ZIP_MAGIC:
            verify_ckpt(p, self.options.storage_options) if is_url(p) else verify_ckpt(p)
        try:
            if is_url(p):
                with fs.open_read(p) as f:
                    state = torch.load(
                        f,  # type: ignore[arg-type]
                        map_location=map_location,
                        weights_only=weights_only,
                    )
            else:
                state = torch.load(p, map_location=map_location, weights_only=weights_only)
        except pickle.UnpicklingError as exc:
            if not weights_only:
                raise
            raise UnsafeLoadError(
                f"{p} holds objects torch.load(weights_only=True) refuses ({exc}); if you "
                "trust it, load with AsyncsaveCheckpointIO(allow_pickle=True) or "
                "weights_only=False",
                path=p,
            ) from exc
        return state

    # -- lifecycle --------------------------------------------------------------
    def wait(self) -> None:
        """Block until every save so far is committed at its path and the writer
        thread has left (each bounded by ``save_timeout_s``).

        :raises SaveFailedError: a save failed (the first failure, its cause as
            ``__cause__``); :class:`CheckpointTimeoutError` when one ran past
            ``save_timeout_s``.
        """
        self._drain()
        self._raise_error()

    def teardown(self) -> None:
        """Flush pending saves (the writer thread leaves once they are written)
        and free the staging buffers (a later save starts afresh). Idempotent.

        :raises SaveFailedError: a save failed (the first failure; the writer
            was stopped all the same); :class:`CheckpointTimeoutError` when one
            ran past ``save_timeout_s`` (its thread is not waited for).
        """
        try:
            self._drain()
        except BaseException:
            # After a timeout the stuck write is left to finish on its own (its
            # thread exits then): teardown never waits without a bound.
            self._writer.cancel()
            raise
        finally:
            self._futures.clear()
            self._arena.clear()
        self._raise_error()

    def _raise_error(self) -> None:
        error, self._error = self._error, None
        if error is not None:
            raise error


def _forget(key: str, done: concurrent.futures.Future[None]) -> None:
    with _IN_FLIGHT_LOCK:
        if _IN_FLIGHT.get(key) is done:
            del _IN_FLIGHT[key]


def _head(fs: LocalFileSystem, p: Path) -> bytes:
    with fs.open_read(p) as f:
        return _read_upto(f, 4)


def _read_upto(f: Any, n: int) -> bytes:
    raw = b""
    while len(raw) < n:
        chunk = f.read(n - len(raw))
        if not chunk:
            break
        raw += chunk
    return raw


def _unlink(fs: LocalFileSystem, path: Path) -> None:
    try:
        fs.unlink(path)
    except FileNotFoundError:
        pass
    except OSError as exc:
        logger.warning("could not remove %s: %r", path, exc)


def _load_legacy(
    fs: LocalFileSystem, p: Path, map_location: Any, options: CheckpointOptions
) -> Any:
    """What the previous release wrote: a pointer file, a checkpoint directory
    (``runs/exp1/step_40``) or a root (its latest committed checkpoint)."""
    device = map_location if isinstance(map_location, (str, torch.device)) else "cpu"
    where: dict[str, Any] = {
        "filesystem": fs,
        "allow_pickle": options.allow_pickle,
        "device": device,
    }
    if fs.exists(p) and not fs.is_dir(p):
        return _load_pointer(fs, p, where, options)
    if fs.exists(p / MANIFEST_NAME):
        return load(p, **where)
    if fs.is_dir(p):
        info = latest(p, layout=options.layout, filesystem=fs)
        if info is None:
            raise CheckpointNotFoundError(
                f"{p} holds no committed checkpoint (layout {options.layout!r})", path=p
            )
        return load(info.path, **where)
    raise FileNotFoundError(f"Checkpoint file not found: {p}")


def _load_pointer(
    fs: LocalFileSystem, p: Path, where: dict[str, Any], options: CheckpointOptions
) -> Any:
    doc = _pointer_doc(fs, p)
    root = _pointer_root(p, doc["root"], options.storage_options)
    if not is_url(root):
        where = {**where, "filesystem": None}
    elif not is_url(p):  # a local pointer to an object store's root
        where = {**where, "filesystem": None, "storage_options": options.storage_options}
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
