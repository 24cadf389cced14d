"""Load: read checkpoints back into state trees (``load``, ``load_tensors``).

Which checkpoint is committed or latest, and its manifest, come from the catalog
(``_catalog``); the bytes are checked and decoded by ``_decode``.

Nothing here unpickles unless the caller passes ``allow_pickle=True``; every path
comes from a validated manifest and stays inside the checkpoint directory; every
byte read is checked against its XXH3-64 checksum (``verify=True``, the default).
"""

from __future__ import annotations

import logging
import os
import warnings
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from ._catalog import read_checkpoint, step_of_name
from ._decode import _build_tensors, _Decoder, _read
from ._errors import (
    InvalidKeyError,
    MissingItemError,
    UnsupportedFormatError,
)
from ._fs import LocalFileSystem, ReadAhead
from ._fsspec import open_root
from ._manifest import Manifest, record_entries
from ._plan import key_str
from ._template import apply_template
from ._types import Tagged, gc_paused

__all__ = ["load", "load_tensors"]

logger = logging.getLogger(__name__)


def _check_required(state: Any, required: Iterable[str | Sequence[Any]], path: Path) -> None:
    missing = []
    for req in required:
        parts: Sequence[Any] = req.split("/") if isinstance(req, str) else req
        node = state
        for p in parts:
            if isinstance(node, Tagged):
                node = node.value
            if isinstance(node, dict) and p not in node and isinstance(p, str):
                # "optim/state/0/exp_avg": a path segment may name an int key
                if p.lstrip("-").isdigit() and int(p) in node:
                    p = int(p)
            if isinstance(node, dict) and p in node:
                node = node[p]
            elif isinstance(node, (list, tuple)) and type(p) is int and 0 <= p < len(node):
                node = node[p]
            else:
                missing.append(key_str(tuple(parts)))
                break
    if missing:
        raise MissingItemError(
            f"checkpoint {path} lacks required item(s) {', '.join(map(repr, missing))}",
            path=path,
            key=missing[0],
        )


def refuse_other_format(manifest: Manifest, path: Path) -> None:
    """The readers of asyncsave's own tree (:func:`load`, :func:`load_tensors`, a
    rank's part) refuse a checkpoint whose files another library wrote, saying
    what reads it.

    :raises UnsupportedFormatError: a DCP (DTensor) or foreign checkpoint.
    """
    if manifest.tree.get("type") == "dcp":
        raise UnsupportedFormatError(
            f"{path} was saved through torch.distributed.checkpoint (DTensor state, or "
            "dcp.save with asyncsave's writer): resume it with "
            "Checkpointer.load_latest(template) where the template holds the model and "
            "optimizer (or their state dicts), or load it with "
            "dcp.load(state, storage_reader=asyncsave.dcp.StorageReader(path)); "
            "`asyncsave inspect` lists its keys",
            path=path,
        )
    if manifest.tree.get("type") == "foreign":
        raise UnsupportedFormatError(
            f"{path} holds files written by {manifest.tree.get('format')!r}, committed by "
            "asyncsave: load it with that library (e.g. megatron.core.dist_checkpointing.load)",
            path=path,
        )


def load(
    path: str | os.PathLike[str],
    template: Any = None,
    *,
    device: str | torch.device = "cpu",
    allow_pickle: bool = False,
    verify: bool = True,
    required: Iterable[str | Sequence[Any]] = (),
    strict: bool = True,
    filesystem: LocalFileSystem | None = None,
    storage_options: Mapping[str, Any] | None = None,
) -> Any:
    """Read the checkpoint at ``path`` back into its state tree.

    Structure and leaf types come back as saved: dicts (``OrderedDict`` with its
    ``_metadata``), lists, tuples, tensors of every dtype with their shapes,
    ``nn.Parameter`` with ``requires_grad``, NumPy arrays and scalars, TensorDicts
    (batch size, device, names), plain leaves, :class:`Tagged` items. Tensors that
    shared a storage at save time share one again. A lone non-contiguous tensor
    comes back contiguous with equal values.

    :param path: a checkpoint directory (``runs/exp1/step_40``), or its URL
        (``s3://bucket/exp1/step_40``, any fsspec URL; see ``storage_options``).
    :param template: optional tree mirroring the saved one. Where it holds an
        object with ``load_state_dict()`` (model, optimizer, dataloader), that
        object is restored in place and returned in the result; a tensor is
        filled in place; a :class:`Tagged` checks the kind. One rule for every
        form (module, optimizer, ``state_dict()``, nested dicts and lists):
        every key the template holds must be in the checkpoint, every saved
        tensor must have a place in the template, a tensor must have the
        template's shape and dtype (an optimizer's per-parameter state: its
        parameter's shape); plain values (numbers, strings, lists without
        tensors, whatever their length) take the saved value; ``None`` takes
        anything. The whole tree is checked before anything changes in place.
    :param strict: ``True`` (the default): a missing or unexpected item is an
        error. ``False``: load what matches, leave the rest of the template as it
        is, and issue one :class:`CheckpointWarning` naming what was not loaded.
        A tensor of another shape or dtype is an error either way.
    :param device: where tensors land (``"cpu"`` default; NumPy leaves stay host).
    :param allow_pickle: unpickle leaves saved with ``allow_pickle=True``. Only for
        checkpoints you trust: unpickling runs code.
    :param verify: check every byte against its XXH3-64 checksum while reading
        (the default). CPU loads are zero-copy: every tensor is a copy-on-write
        view of the memory-mapped data file, so hashing is the only pass over the
        bytes; with ``verify=False`` nothing is read until a tensor is touched.
        ``device="cuda"`` goes through two pinned bounce buffers (see
        ``asyncsave._read``). To read a few tensors of a large checkpoint, use
        :func:`load_tensors`.
    :param required: key paths that must exist: ``"dataloader"``,
        ``"trainer/rng"``, or tuples (``("data/loader",)`` for a key holding ``/``).
    :param filesystem: the I/O layer (default: chosen from ``path``).
    :param storage_options: for a URL ``path``: keyword arguments of its fsspec file
        system (``{"endpoint_url": ...}`` for s3fs); credentials may also come from
        the environment, as the fsspec implementation reads them.
    :raises CheckpointNotFoundError: ``path`` holds no manifest (or, on an object
        store, no commit marker).
    :raises CorruptCheckpointError: damaged manifest, missing/truncated file,
        header disagreeing with the manifest; :class:`ChecksumMismatchError` for
        altered bytes.
    :raises MissingItemError: a required item is absent, or (``strict``) the
        template holds items the checkpoint lacks, and nothing else differs.
    :raises TemplateMismatchError: the checkpoint does not fit the template
        (unexpected items, a tensor of another shape or dtype); raised before
        anything is changed in place, naming every offending key.
    :raises KindMismatchError: a :class:`Tagged` kind differs from the template's.
    :raises UnsafeLoadError: a pickled leaf without ``allow_pickle``.
    """
    fs, p, target = _open_root(path, device, filesystem, storage_options)
    manifest, raw = _read_all(fs, p, target, verify)
    with gc_paused():  # 10,000s of tensors and tree nodes made at once
        tensors = _build_tensors(manifest, raw, target)
        state = _Decoder(tensors, manifest.tensors, path=p, allow_pickle=allow_pickle).node(
            manifest.tree
        )
    _check_required(state, required, p)
    state, note = apply_template(state, template, p, strict=strict)
    if note is not None:
        warnings.warn(note, stacklevel=2)
    return state


def load_tensors(
    path: str | os.PathLike[str],
    keys: Iterable[str],
    *,
    device: str | torch.device = "cpu",
    verify: bool = True,
    filesystem: LocalFileSystem | None = None,
    storage_options: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """Read only some tensors of a checkpoint, without reading the rest of it.

    ``keys`` are key paths as :func:`load` would reach them (``"model/wte.weight"``;
    the separator is ``/``), or a prefix of whole segments (``"optim/state/3"``
    or ``"optim/state/3/"`` gives every tensor under it). A module's
    ``state_dict()`` keys are one segment each (``"model/h.0.attn.weight"``), so
    ``"model/h.0"`` is no prefix of them: the error for a key that names no
    tensor lists the key paths that begin with it (or its parent's, or the
    first ones). Only the bytes of the selected tensors are read (and, with
    ``verify``, checked against their checksums); a tensor that shares a storage
    with others brings that storage's bytes.

    :returns: ``{key path: tensor}`` (``nn.Parameter`` and NumPy arrays as saved),
        in the manifest's order.
    :raises MissingItemError: a key that names no tensor of the checkpoint.
    :raises CheckpointNotFoundError: no manifest at ``path``.
    :raises CorruptCheckpointError: (or :class:`ChecksumMismatchError`) the bytes
        read are damaged.

    ``path``, ``filesystem`` and ``storage_options`` as for :func:`load` (on an
    object store only the selected entries' bytes are read too).
    """
    fs, p, manifest, target = _open_checkpoint(path, device, filesystem, storage_options)
    chosen = _select_tensors(manifest, keys, p)
    entries = {j for ri in chosen for j in record_entries(manifest.tensors[ri])}
    raw = _read(fs, p, manifest, verify=verify, device=target, only=entries)
    tensors = _build_tensors(manifest, raw, target, only=chosen)
    return {manifest.tensors[ri]["key"]: tensors[ri] for ri in sorted(chosen)}


def _select_tensors(manifest: Manifest, keys: Iterable[str], p: Path) -> set[int]:
    """The indices of the tensor records that ``keys`` name (each key a record's
    key path or a prefix of some), in the manifest of the checkpoint at ``p``.

    :raises MissingItemError: a key that names no tensor.
    :raises InvalidKeyError: a key path that two records flatten to.
    """
    if isinstance(keys, str):
        raise TypeError("keys must be an iterable of key paths, not one str")
    chosen: set[int] = set()
    for asked in dict.fromkeys(keys):
        k = asked.rstrip("/") if asked.endswith("/") and asked.strip("/") else asked
        hit = {
            ri
            for ri, rec in enumerate(manifest.tensors)
            if rec["key"] == k or str(rec["key"]).startswith(k + "/")
        }
        if not hit:
            raise MissingItemError(
                f"checkpoint {p} has no tensor at {asked!r}{_near(manifest, k)}", path=p, key=asked
            )
        chosen |= hit
    seen: dict[str, int] = {}
    for ri in sorted(chosen):
        key = str(manifest.tensors[ri]["key"])
        if key in seen:
            # {"a/b": x, "a": {"b": y}} flatten to the same path: never guess.
            raise InvalidKeyError(
                f"key path {key!r} names two tensors of {p} (a key holding '/' and a "
                "nested key); load() the whole tree to tell them apart",
                path=p,
                key=key,
            )
        seen[key] = ri
    return chosen


def _near(manifest: Manifest, k: str, shown: int = 8) -> str:
    """A hint for a key path that names no tensor: the key paths that begin with
    it (``"model/h.0"`` -> ``"model/h.0.attn.weight"``), else those under its
    parent, else the first ones; at most ``shown``, then how many more."""
    keys = [str(rec["key"]) for rec in manifest.tensors]
    parent = k.rpartition("/")[0]
    near = [x for x in keys if x.startswith(k)] or (
        [x for x in keys if x.startswith(parent + "/")] if parent else []
    )
    near = near or keys
    if not near:
        return " (it holds no tensor)"
    more = f" and {len(near) - shown} more" if len(near) > shown else ""
    return f"; key paths near it: {', '.join(map(repr, near[:shown]))}{more}"


def _open_checkpoint(
    path: str | os.PathLike[str],
    device: str | torch.device,
    filesystem: LocalFileSystem | None,
    storage_options: Mapping[str, Any] | None,
) -> tuple[LocalFileSystem, Path, Manifest, torch.device]:
    """What :func:`load_tensors` reads first (:func:`load` too, in two parts,
    reading ahead in between): the checkpoint's file system and directory, its
    manifest (:func:`_manifest_of`) and the device to load to."""
    fs, p, target = _open_root(path, device, filesystem, storage_options)
    return fs, p, _manifest_of(fs, p), target


def _read_all(
    fs: LocalFileSystem, p: Path, target: torch.device, verify: bool
) -> tuple[Manifest, list[torch.Tensor | None]]:
    """The manifest and every entry's bytes (:func:`load`). When every byte is
    read (``verify``), the data files are read into the page cache while the
    manifest is parsed and checked (``fs.read_ahead``; 100,000 tensors: a
    second of work that the disk reads used to wait for), then the loader's
    threads go on from there."""
    with fs.read_ahead(p) if verify else ReadAhead([]) as ahead:
        manifest = _manifest_of(fs, p)
        ahead.stop()
        return manifest, _read(fs, p, manifest, verify=verify, device=target)


def _open_root(
    path: str | os.PathLike[str],
    device: str | torch.device,
    filesystem: LocalFileSystem | None,
    storage_options: Mapping[str, Any] | None,
) -> tuple[LocalFileSystem, Path, torch.device]:
    fs, p = open_root(path, filesystem=filesystem, storage_options=storage_options, what="path")
    return fs, p, _device(device)


def _manifest_of(fs: LocalFileSystem, p: Path) -> Manifest:
    """The checkpoint's manifest, from the catalog, checked against the step its
    name gives; a checkpoint of another format is refused here, before any data
    file is read by the load."""
    manifest = read_checkpoint(fs, p, expect_step=step_of_name(p))
    refuse_other_format(manifest, p)
    return manifest


def _device(device: str | torch.device) -> torch.device:
    try:
        target = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ValueError(f"device={device!r} is not a torch device") from exc
    if target.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device={device!r} asked for, but CUDA is not available")
    if target.type not in ("cpu", "cuda"):
        raise ValueError(f"device={device!r}: asyncsave loads to cpu or cuda")
    return target
