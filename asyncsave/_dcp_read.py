"""Reading checkpoints written through ``torch.distributed.checkpoint`` (DCP): by
:class:`asyncsave.dcp.StorageWriter`, or by :meth:`asyncsave.Checkpointer.save` of
DTensor (FSDP2) state.

Three readers share one way in, :func:`read_dcp_metadata` (the manifest's record of
DCP's ``.metadata``, its size and checksum, then an unpickler that builds only
DCP's metadata classes, so a damaged or forged ``.metadata`` runs no code):

- :class:`asyncsave.dcp.StorageReader` (``dcp.load``);
- :func:`dcp_items`, what the ``asyncsave`` command lists (every saved key with
  its dtype and global shape);
- :class:`TemplateLoad`, the DTensor route of
  :meth:`asyncsave.Checkpointer.load_latest`: the template's tensors (DTensors
  sharded on this run's mesh, or plain tensors) say what this rank reads, and DCP's
  planner reshards, as ``dcp.load`` does; a checkpoint written by N ranks loads on
  M ranks.

The call sequence of :class:`TemplateLoad` (every rank, in this order):

1. (worker thread) :func:`read_dcp_metadata`;
2. (caller's thread) ``TemplateLoad(...)``: ``state_dict()`` of each ``Stateful``
   of the template (a fresh optimizer first gets its state, as DCP's
   ``get_state_dict`` gives it); every key checked against the checkpoint
   (missing, shape, dtype, ``required``) before anything is read; a shadow of
   every template tensor (``torch.empty_like``: same sharding) to read into;
3. (every rank agrees that every rank got here) :meth:`TemplateLoad.run` in a
   worker thread: ``dcp.load`` of the shadow on asyncsave's group through the
   integration's storage reader (named in ``asyncsave._jobs``: the core imports
   no integration), each item's checksum checked while reading; DCP's error on
   any rank comes back on every rank and is translated here;
4. :meth:`TemplateLoad.state`: the template's tree with the values read, which
   ``load_latest`` applies to the template in place (the same step as for any
   other checkpoint), so a damaged checkpoint changes nothing.
"""

from __future__ import annotations

import copy
import io
import json
import pickle
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import xxhash
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    Metadata,
    StorageMeta,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import ReadItem

from ._catalog import read_checkpoint
from ._errors import (
    CheckpointError,
    ChecksumMismatchError,
    CorruptCheckpointError,
    InvalidStateError,
    MissingItemError,
    UnsafeLoadError,
    UnsupportedFormatError,
)
from ._fs import LocalFileSystem
from ._load import _check_required
from ._manifest import CHECKSUM
from ._paths import MANIFEST_NAME
from ._plan import is_stateful, key_str

__all__ = ["DCP_METADATA_NAME", "TemplateLoad", "dcp_items", "read_dcp_metadata"]

DCP_METADATA_NAME = ".metadata"

# What DCP's pickled ``Metadata`` is made of (and nothing else is built).
_METADATA_CLASSES = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata",
        "MetadataIndex",
        "StorageMeta",
        "TensorProperties",
        "ChunkStorageMetadata",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "_MEM_FORMAT_ENCODING",
    },
    "torch": {"Size"},
    "torch.serialization": {"_get_layout"},
    "asyncsave.dcp": {"ItemLocation"},
    # DCP's own locations: a save through asyncsave.dcp.StorageWriter(_extensions=...).
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "collections": {"OrderedDict"},
}


class _MetadataUnpickler(pickle.Unpickler):
    """Builds DCP's metadata classes, torch dtypes and nothing else."""

    def find_class(self, module: str, name: str) -> Any:
        if name in _METADATA_CLASSES.get(module, ()):
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not part of DCP's metadata")


def read_dcp_metadata(fs: LocalFileSystem, path: Path) -> Metadata:
    """DCP's ``Metadata`` of the checkpoint directory ``path``, checked.

    :raises CheckpointNotFoundError: no manifest at ``path``.
    :raises UnsupportedFormatError: ``path`` was not written through DCP (read it
        with :func:`asyncsave.load`).
    :raises CorruptCheckpointError: damaged manifest, ``.metadata`` missing or
        holding anything but DCP's metadata; :class:`ChecksumMismatchError` when its
        size or checksum differs from the manifest's.
    """
    read_checkpoint(fs, path)  # validates the manifest and every file's size
    doc = json.loads(fs.read_bytes(path / MANIFEST_NAME))
    meta = doc.get("dcp_metadata")
    if not isinstance(meta, dict) or meta.get("name") != DCP_METADATA_NAME:
        raise UnsupportedFormatError(
            f"{path} was not written through torch.distributed.checkpoint; load it "
            "with asyncsave.load()",
            path=path,
        )
    mpath = path / DCP_METADATA_NAME
    try:
        blob = fs.read_bytes(mpath)
    except FileNotFoundError as exc:
        raise CorruptCheckpointError(f"{mpath} is missing", path=mpath) from exc
    if len(blob) != meta.get("nbytes") or xxhash.xxh3_64_hexdigest(blob) != meta.get(CHECKSUM):
        raise ChecksumMismatchError(
            f"{mpath} does not match the size and checksum in the manifest", path=mpath
        )
    try:
        metadata = _MetadataUnpickler(io.BytesIO(blob)).load()
    except Exception as exc:  # any unpickling failure: the bytes are not DCP's metadata
        raise CorruptCheckpointError(f"{mpath} holds no DCP Metadata: {exc}", path=mpath) from exc
    if not isinstance(metadata, Metadata):
        raise CorruptCheckpointError(f"{mpath} holds no DCP Metadata", path=mpath)
    if metadata.storage_meta is None:  # written before asyncsave recorded it
        metadata.storage_meta = StorageMeta()
    return metadata


def _key_paths(metadata: Metadata) -> dict[str, tuple[Any, ...]]:
    """Every saved item's key path (DCP's ``planner_data``; its dotted name when the
    save did not flatten)."""
    mapping = metadata.planner_data if isinstance(metadata.planner_data, dict) else {}
    return {
        fqn: tuple(mapping[fqn]) if isinstance(mapping.get(fqn), (tuple, list)) else (fqn,)
        for fqn in metadata.state_dict_metadata
    }


def dcp_items(fs: LocalFileSystem, path: Path) -> list[tuple[str, str | None, tuple[int, ...]]]:
    """What a DCP checkpoint holds: ``(key path, dtype name, global shape)`` per item,
    in saved order; ``dtype`` is ``None`` for a plain (pickled) value, whose shape
    is ``()``. Raises as :func:`read_dcp_metadata`."""
    metadata = read_dcp_metadata(fs, path)
    out: list[tuple[str, str | None, tuple[int, ...]]] = []
    for fqn, where in _key_paths(metadata).items():
        md = metadata.state_dict_metadata[fqn]
        if isinstance(md, TensorStorageMetadata):
            dtype = str(md.properties.dtype).removeprefix("torch.")
            out.append((key_str(where), dtype, tuple(md.size)))
        else:
            out.append((key_str(where), None, ()))
    return out


class _Planner(DefaultLoadPlanner):
    """DCP's planner over a flat dict (the shadow); plain values are unpickled as
    ``torch.load(weights_only=True)`` does (containers, numbers, strings, tensors)
    unless pickle is allowed."""

    def __init__(
        self, allow_pickle: bool, path: Path, where: Mapping[str, tuple[Any, ...]]
    ) -> None:
        # The shadow is flat already; FSDP2 state holds DTensors, never the
        # ShardedTensors of FSDP1 (whose flattening would copy the dict).
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.allow_pickle = allow_pickle
        self.path = path
        self.where = where

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        fqn = read_item.dest_index.fqn
        try:
            self.state_dict[fqn] = torch.load(value, weights_only=not self.allow_pickle)
        except pickle.UnpicklingError as exc:
            key = key_str(self.where[fqn])
            raise UnsafeLoadError(
                f"{key!r} in {self.path} is a pickled object that is not plain data; "
                "load it only from a checkpoint you trust, with allow_pickle=True in "
                f"the Checkpointer's options ({exc})",
                path=self.path,
                key=key,
            ) from exc


def _copy_tree(node: Any, init_optim: Any) -> Any:
    """The template as the state it stands for: ``Stateful`` objects by their
    ``state_dict()``, dicts and lists copied (leaves kept)."""
    if is_stateful(node):
        init_optim(node)
        node = node.state_dict()
    if isinstance(node, Mapping):
        out = copy.copy(node)  # keeps OrderedDict's ``_metadata`` (module versions)
        for k, v in node.items():
            out[k] = _copy_tree(v, init_optim)  # type: ignore[index]
        return out
    if isinstance(node, list):
        return [_copy_tree(v, init_optim) for v in node]
    return node


def _locate(tree: Any, dcp_path: tuple[Any, ...]) -> tuple[Any, Any, tuple[Any, ...]]:
    """The container, key and key path of the leaf DCP names ``dcp_path`` (DCP
    writes a dict key as ``str(key)``; ``optim/state/0`` has the int key 0)."""
    node, real = tree, []
    parent: Any = None
    key: Any = None
    for seg in dcp_path:
        parent = node
        if isinstance(node, Mapping) and seg not in node:
            seg = next(k for k in node if str(k) == seg)
        key = seg
        real.append(seg)
        node = node[seg]
    return parent, key, tuple(real)


class TemplateLoad:
    """One rank's load of a DCP checkpoint into a template (see the module's call
    sequence). Built on the caller's thread: ``state_dict()`` of the template's
    objects runs there.

    :param path: the checkpoint directory.
    :param metadata: its DCP metadata (:func:`read_dcp_metadata`).
    :param template: a tree of dicts and lists holding ``Stateful`` objects (a
        ``fully_shard``-ed model, its optimizer) and tensors (DTensors on this
        run's mesh, or plain tensors: DCP reshards to either), or their state
        dicts; plain leaves take the saved values.
    :param required: key paths that must exist in the checkpoint.
    :raises UnsupportedFormatError: no template (DTensor state loads into tensors
        that say how it is sharded on this run).
    :raises MissingItemError: a template or ``required`` key the checkpoint lacks.
    :raises InvalidStateError: a template tensor whose global shape or dtype differs
        from the saved one, or a tensor where a plain value was saved.
    """

    def __init__(
        self,
        path: Path,
        metadata: Metadata,
        template: Any,
        required: Iterable[str | Sequence[Any]] = (),
    ) -> None:
        self.path = path
        self.metadata = metadata
        where = _key_paths(metadata)
        skeleton: dict[Any, Any] = {}
        for full in where.values():
            node = skeleton
            for seg in full:
                node = node.setdefault(seg, {})
        _check_required(skeleton, required, path)
        if template is None:
            raise UnsupportedFormatError(
                f"{path} holds state saved through torch.distributed.checkpoint (DTensor "
                "state); it loads into the tensors of a template, which say how each is "
                "sharded in this run: pass the objects or state dicts you saved, e.g. "
                'load_latest({"model": model, "optim": optimizer})',
                path=path,
            )
        self.tree = _copy_tree(template, self._init_optim)
        if not isinstance(self.tree, Mapping):
            raise InvalidStateError(
                f"the template for {path} is a {type(self.tree).__name__}; DTensor state "
                "saved through torch.distributed.checkpoint loads into a dict",
                path=path,
            )
        self.shadow: dict[str, Any] = {}
        self.slots: dict[str, tuple[Any, Any]] = {}
        self.where: dict[str, tuple[Any, ...]] = {}
        self._plan()

    def _init_optim(self, obj: Any) -> None:
        """A fresh optimizer gets its state (zero moments, as DCP's
        ``get_state_dict`` does) when the checkpoint holds state for it."""
        if isinstance(obj, torch.optim.Optimizer) and not obj.state:
            from torch.distributed.checkpoint.state_dict import _init_optim_state

            _init_optim_state(obj)

    def _plan(self) -> None:
        """Check every template leaf against the checkpoint and make its shadow."""
        from torch.distributed.checkpoint._traverse import traverse_state_dict

        leaves: list[tuple[str, tuple[Any, ...]]] = []
        traverse_state_dict(
            self.tree, lambda p, _v: leaves.append((".".join(map(str, p)), tuple(p)))
        )
        missing = []
        for fqn, dcp_path in leaves:
            parent, key, real = _locate(self.tree, dcp_path)
            self.where[fqn] = real
            if fqn not in self.metadata.state_dict_metadata:
                missing.append(key_str(real))
                continue
            self.slots[fqn] = (parent, key)
            self.shadow[fqn] = self._shadow(fqn, parent[key], real)
        if missing:
            raise MissingItemError(
                f"checkpoint {self.path} has no item {', '.join(map(repr, missing))} that "
                "the template asks for",
                path=self.path,
                key=missing[0],
            )

    def _shadow(self, fqn: str, leaf: Any, real: tuple[Any, ...]) -> Any:
        md = self.metadata.state_dict_metadata[fqn]
        if isinstance(md, BytesStorageMetadata):
            if isinstance(leaf, torch.Tensor):
                raise InvalidStateError(
                    f"{key_str(real)!r}: the template holds a tensor, {self.path} a plain value",
                    path=self.path,
                    key=key_str(real),
                )
            return leaf  # replaced by the saved value
        assert isinstance(md, TensorStorageMetadata)
        if not isinstance(leaf, torch.Tensor):  # a plain leaf takes the saved tensor
            return torch.empty(md.size, dtype=md.properties.dtype)
        if tuple(leaf.shape) != tuple(md.size) or leaf.dtype != md.properties.dtype:
            raise InvalidStateError(
                f"{key_str(real)!r}: the template tensor is {leaf.dtype} "
                f"{tuple(leaf.shape)}, the checkpoint holds {md.properties.dtype} "
                f"{tuple(md.size)}",
                path=self.path,
                key=key_str(real),
            )
        return torch.empty_like(leaf)  # a DTensor keeps its mesh and placements

    def run(self, reader: Any, *, group: Any, rank: int, allow_pickle: bool = False) -> None:
        """Read this rank's part into the shadow through ``reader`` (an
        :class:`asyncsave.dcp.StorageReader` of :attr:`path`), blocking: call it
        from a worker thread, on every rank together. ``group=None``: this process
        alone, no collectives.

        :raises CorruptCheckpointError: the bytes some rank read are damaged, on
            every rank (the rank's own error where the damage is its own).
        :raises CheckpointError: another failure of some rank, on every rank.
        """
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.api import CheckpointException

        planner = _Planner(allow_pickle, self.path, self.where)
        try:
            dcp.load(
                self.shadow,
                storage_reader=reader,
                planner=planner,
                process_group=group,
                no_dist=group is None,
            )
        except CheckpointException as exc:  # derives from BaseException: translated here
            raise _translated(exc, self.path, rank) from exc

    def state(self) -> Any:
        """The template's tree with the values read (after :meth:`run`)."""
        for fqn, (parent, key) in self.slots.items():
            parent[key] = self.shadow[fqn]
        return self.tree


def _translated(exc: Any, path: Path, rank: int) -> CheckpointError:
    """DCP's error of a load (each failed rank's exception, the same on every rank)
    as one of asyncsave's."""
    causes = {r: f[0] if isinstance(f, tuple) else f for r, f in exc.failures.items()}
    mine = causes.get(rank)
    corrupt = sorted(r for r, c in causes.items() if isinstance(c, CorruptCheckpointError))
    if corrupt:
        if isinstance(mine, CorruptCheckpointError):
            if mine.rank is None:
                mine.rank = rank  # whose part it is
            return mine
        return CorruptCheckpointError(
            f"{path} is damaged in the part read by rank(s) {corrupt}: "
            + "; ".join(f"rank {r}: {causes[r]}" for r in corrupt),
            path=path,
            rank=corrupt[0],
        )
    if isinstance(mine, CheckpointError):
        return mine
    return CheckpointError(
        f"DCP's load of {path} failed on rank(s) {sorted(causes)}: "
        + "; ".join(f"rank {r}: {c!r}" for r, c in sorted(causes.items())),
        path=path,
        rank=min(causes),
    )
