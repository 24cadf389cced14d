"""Export: a checkpoint's model weights as a Hugging Face model directory.

:func:`export_hf` writes the tensors under one item of a checkpoint's state (the
model's state dict) as ``model.safetensors``, or past ``max_shard_bytes`` as
``model-00001-of-0000N.safetensors`` shards with ``model.safetensors.index.json``
(the names and index ``save_pretrained`` writes), plus ``config.json`` when given:
a directory that ``transformers``' ``from_pretrained`` loads. Each shard is
written by ``safetensors.torch.save_file``.

The checkpoint may be a plain save of one rank or of N ranks (rank 0's tensors:
replicated weights), or a save of DTensor (FSDP2) state through DCP on N ranks,
whose shards are consolidated into full tensors by DCP's own planner in this one
process. Memory stays bounded by one output shard: tensors are read one shard's
worth at a time (plain saves: only the selected entries, memory-mapped; DCP: full
tensors of that shard only), written, and dropped before the next shard is read.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from ._catalog import read_checkpoint, step_of_name
from ._decode import _build_tensors, _read
from ._errors import (
    CorruptCheckpointError,
    InvalidKeyError,
    MissingItemError,
    UnsupportedFormatError,
    UnsupportedTensorError,
)
from ._format import header_dtype
from ._fs import LocalFileSystem
from ._fsspec import open_root
from ._manifest import FORMAT, Manifest, record_entries, torch_dtype
from ._paths import MANIFEST_NAME
from ._plan import key_str

__all__ = ["CASTABLE_DTYPES", "DEFAULT_MAX_SHARD_BYTES", "export_hf", "parse_size"]

#: ``save_pretrained``'s default ``max_shard_size`` ("5GB": decimal units).
DEFAULT_MAX_SHARD_BYTES = 5 * 10**9
WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"
CONFIG_NAME = "config.json"
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}
_UNITS.update({"KIB": 1 << 10, "MIB": 1 << 20, "GIB": 1 << 30, "TIB": 1 << 40})
# The start of an asyncsave manifest (its first field; see _manifest.FORMAT).
_ASYNCSAVE_MANIFEST = re.compile(rb'^\s*\{\s*"format"\s*:\s*"' + FORMAT.encode() + rb'"')
#: What ``dtype=`` casts, from and to: the floating-point types weights are trained
#: in. The 8- and 4-bit floats hold quantized values whose meaning needs their
#: scales (an FP8 weight, an MX scale): a cast would change what they mean, or
#: overflow (an ``float8_e8m0fnu`` scale of 2**127 in float16), so they are
#: written as saved.
CASTABLE_DTYPES = frozenset({torch.float16, torch.bfloat16, torch.float32, torch.float64})


@dataclasses.dataclass(frozen=True)
class _Item:
    """One tensor to export: its Hugging Face name, its key path in the
    checkpoint, where to read it (a tensor record's index, or a DCP key path),
    and its stored dtype and shape."""

    name: str
    key: str
    ref: Any
    dtype: torch.dtype
    shape: tuple[int, ...]


def parse_size(text: str | int) -> int:
    """Bytes of a size given as an int or as ``"5GB"``, ``"500MB"``, ``"2GiB"``
    (``save_pretrained``'s ``max_shard_size`` spelling; KB/MB/GB decimal).

    :raises ValueError: not a positive size.
    """
    if isinstance(text, int) and not isinstance(text, bool):
        value = text
    else:
        m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]I?B|B)?\s*", str(text), re.IGNORECASE)
        if m is None:
            raise ValueError(f"size {text!r} is not a number of bytes or e.g. '5GB', '500MB'")
        value = int(float(m.group(1)) * _UNITS[(m.group(2) or "").upper()])
    if value < 1:
        raise ValueError(f"size {text!r} must be at least 1 byte")
    return value


def export_hf(
    path: str | os.PathLike[str],
    out_dir: str | os.PathLike[str],
    *,
    key: str | None = None,
    config: Any = None,
    max_shard_bytes: int | str = DEFAULT_MAX_SHARD_BYTES,
    dtype: torch.dtype | None = None,
    verify: bool = True,
    filesystem: LocalFileSystem | None = None,
    storage_options: Mapping[str, Any] | None = None,
) -> list[Path]:
    """Write a checkpoint's model weights as a Hugging Face model directory that
    ``from_pretrained(out_dir)`` loads.

    Each tensor under ``key`` is written under its name below ``key`` (a state
    dict's own names, ``transformer.h.0.attn.c_attn.weight``; deeper levels of
    nested dicts joined with ``.``). Tied weights are written under each of their
    names (``from_pretrained`` re-ties them; other readers find every weight by
    name), each name's bytes once per name. Memory: one output shard at a time,
    about ``max_shard_bytes`` (or the largest tensor) above what the process
    held, whatever the size of the checkpoint (measured: the Hugging Face guide).

    :param path: a committed checkpoint directory (``runs/exp1/step_40``) or URL;
        ``filesystem`` and ``storage_options`` as for :func:`asyncsave.load`.
    :param out_dir: the local directory to write (created if absent), holding
        no ``model*.safetensors`` or index yet, in no checkpoint directory. Each
        file is written under a temporary name, fsynced, renamed into place.
    :param key: the key path (``/``-separated) of the model's state dict in the
        saved tree. Default: the top-level item ``model`` if the state has one,
        else the whole state when every leaf of it is a tensor.
    :param config: written as ``config.json``: a ``transformers`` config (anything
        with ``to_dict()``), a dict, or the path of a JSON file.
    :param max_shard_bytes: bytes per shard file, or a size such as ``"5GB"``
        (the default, as ``save_pretrained``); a tensor larger than it is a shard
        of its own.
    :param dtype: cast the ``float16/bfloat16/float32/float64`` tensors to this
        one of the four; others (integers, quantized weights' 8- and 4-bit floats
        and scales) are written as saved. ``config.json`` then says this dtype
        (``"dtype"``, and ``"torch_dtype"`` where the config has it), as
        ``save_pretrained`` does, so ``from_pretrained`` loads the model in it.
    :param verify: check the XXH3-64 checksum of every byte read.
    :returns: the files written, weights first, then the index and config if any.
    :raises MissingItemError: ``key`` names no tensor, or no default applies.
    :raises InvalidKeyError: two key paths give one name (``a/b`` and ``a.b``
        are both ``a.b``), naming both.
    :raises UnsupportedTensorError: a tensor whose dtype safetensors cannot name
        (complex128, sub-byte types), naming its key.
    :raises UnsupportedFormatError: a checkpoint another library wrote (Megatron);
        a plain save of N ranks whose ranks hold different tensors under ``key``
        (pipeline stages, tensor-parallel shards: rank 0's would be a part of
        the model), naming the key and rank.
    :raises FileExistsError: ``out_dir`` holds model weights already.
    :raises ValueError: ``max_shard_bytes`` is not a size; ``dtype`` not one of
        the four; ``out_dir`` a URL, or in a checkpoint (retention would delete it).
    :raises TypeError: ``config`` is not a config, dict or path; ``dtype`` is
        not a ``torch.dtype``.
    :raises CorruptCheckpointError: (or :class:`ChecksumMismatchError`) the bytes
        read are damaged.
    :raises ImportError: ``safetensors`` is not installed (``pip install
        'asyncsave[hf]'``).
    """
    save_file = _safetensors_save_file()
    limit = parse_size(max_shard_bytes)
    _check_dtype(dtype)
    fs, p = open_root(path, filesystem=filesystem, storage_options=storage_options, what="path")
    source, items = _export_items(fs, p, key, dtype, verify)
    doc = None if config is None else _config_dict(config, dtype)
    out = _local_dir(out_dir)
    _check_out(out)
    written: list[Path] = []
    try:
        _write_shards(out, source, _shards(items, limit, dtype), dtype, save_file, written)
        if doc is not None:
            written.append(_write_json(out / CONFIG_NAME, doc))
    except BaseException:
        for f in written:  # an export that failed leaves no part of itself
            f.unlink(missing_ok=True)
        raise
    return written


def _safetensors_save_file() -> Any:
    """``safetensors.torch.save_file``, or the ``ImportError`` naming the extra."""
    try:
        from safetensors.torch import save_file
    except ImportError as exc:
        raise ImportError(
            "export_hf writes its files with safetensors: pip install 'asyncsave[hf]'"
        ) from exc
    return save_file


def _export_items(
    fs: LocalFileSystem, p: Path, key: str | None, dtype: torch.dtype | None, verify: bool
) -> tuple[Any, list[Any]]:
    """The checkpoint at ``p`` as a source of tensors, and the items of
    :func:`export_hf` under ``key``, each checked (replicated over ranks,
    nameable by safetensors in ``dtype``)."""
    manifest = read_checkpoint(fs, p, expect_step=step_of_name(p))
    source = _source(fs, p, manifest, verify=verify)
    prefix = _prefix(source.items, key, source.all_tensors, p)
    items = _selected(source.items, prefix, p)
    source.check_replicated(items, prefix)
    for item in items:
        _check_nameable(item, dtype, p)
    return source, items


def _write_shards(
    out: Path,
    source: Any,
    shards: list[list[_Item]],
    dtype: torch.dtype | None,
    save_file: Any,
    written: list[Path],
) -> None:
    """Read, write and drop one shard at a time (then the index, if sharded),
    appending each file to ``written`` once it is in place."""
    names = _shard_names(len(shards))
    weight_map: dict[str, str] = {}
    total = 0
    for shard, name in zip(shards, names, strict=True):
        tensors = _prepared(source.read(shard), dtype)
        total += sum(t.numel() * t.element_size() for t in tensors.values())
        written.append(
            _write_atomic(out / name, lambda f, t=tensors: save_file(t, f, {"format": "pt"}))
        )
        weight_map.update(dict.fromkeys(tensors, name))
        del tensors
    if len(shards) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        written.append(_write_json(out / INDEX_NAME, index))


class _PlainSource:
    """The tensors of an asyncsave tree (rank 0's, for a save of N ranks)."""

    def __init__(self, fs: LocalFileSystem, path: Path, manifest: Manifest, *, verify: bool):
        self.fs, self.path, self.manifest, self.verify = fs, path, manifest, verify
        ranges = [(manifest.tree, 0, len(manifest.tensors))]
        if manifest.world_size > 1:
            ranges = _rank_ranges(fs, path, manifest)
        tree, t0, t1 = ranges[0]
        self.ranks = [(t0, t1) for _, t0, t1 in ranges]
        self.all_tensors = _only_tensors(tree)
        self.items = []
        for ri in range(t0, t1):
            rec = manifest.tensors[ri]
            if rec["kind"] in ("tensor", "parameter"):
                dt = torch_dtype(rec["dtype"])
                assert dt is not None  # validated by parse_manifest
                self.items.append(_Item("", rec["key"], ri, dt, tuple(rec["shape"])))

    def check_replicated(self, items: list[_Item], prefix: str) -> None:
        """Every rank holds the tensors of ``items`` (rank 0's) under ``prefix``,
        and no other, with their dtypes and shapes: the replicas of DDP, whose
        rank 0 is the model. Ranks that hold different parts (pipeline stages,
        tensor-parallel shards) would export a part of the model.

        :raises UnsupportedFormatError: naming the first key and rank that differ.
        """
        ours = {it.key: (str(it.dtype).removeprefix("torch."), list(it.shape)) for it in items}
        for rank, (t0, t1) in enumerate(self.ranks[1:], start=1):
            theirs = {
                rec["key"]: (rec["dtype"], rec["shape"])
                for rec in self.manifest.tensors[t0:t1]
                if rec["kind"] in ("tensor", "parameter") and rec["key"].startswith(prefix)
            }
            if theirs == ours:
                continue
            key = min(k for k in ours.keys() | theirs.keys() if ours.get(k) != theirs.get(k))
            raise UnsupportedFormatError(
                f"{self.path}: rank {rank} holds {key!r} as {_held(theirs.get(key))}, rank 0 "
                f"as {_held(ours.get(key))}: the ranks hold different parts of the model "
                "(pipeline stages or tensor-parallel shards), and an export of a plain "
                "save of N ranks writes rank 0's replica; save the model as DTensor "
                "through asyncsave.dcp (consolidated on export), or gather it on rank 0",
                path=self.path,
                key=key,
                rank=rank,
            )

    def read(self, items: list[_Item]) -> dict[str, torch.Tensor]:
        chosen = {it.ref for it in items}
        entries = {j for ri in chosen for j in record_entries(self.manifest.tensors[ri])}
        cpu = torch.device("cpu")
        raw = _read(self.fs, self.path, self.manifest, verify=self.verify, device=cpu, only=entries)
        built = _build_tensors(self.manifest, raw, cpu, only=chosen)
        return {it.name: built[it.ref].detach() for it in items}


class _DcpSource:
    """The tensors of a DCP (DTensor) checkpoint, consolidated to full tensors."""

    def __init__(self, fs: LocalFileSystem, path: Path, *, verify: bool) -> None:
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        from ._dcp_read import _key_paths, read_dcp_metadata

        self.fs, self.path, self.verify = fs, path, verify
        self.metadata = read_dcp_metadata(fs, path)
        self.items = []
        self.all_tensors = True
        for fqn, where in _key_paths(self.metadata).items():
            md = self.metadata.state_dict_metadata[fqn]
            if not isinstance(md, TensorStorageMetadata):
                self.all_tensors = False
                continue
            shape = tuple(md.size)
            self.items.append(_Item("", key_str(where), where, md.properties.dtype, shape))

    def check_replicated(self, items: list[_Item], prefix: str) -> None:
        """Nothing to check: DCP's planner consolidates every rank's shards."""

    def read(self, items: list[_Item]) -> dict[str, torch.Tensor]:
        from ._dcp_read import TemplateLoad
        from ._jobs import dcp_reader_class  # the integration, named in one place

        template: dict[Any, Any] = {}
        for it in items:
            node = template
            for seg in it.ref[:-1]:
                node = node.setdefault(seg, {})
            node[it.ref[-1]] = None  # a plain leaf: DCP reads the full tensor into it
        load = TemplateLoad(self.path, self.metadata, template)
        reader = dcp_reader_class()(str(self.path), verify=self.verify, filesystem=self.fs)
        with warnings.catch_warnings():  # this one call: one process is the intent
            warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
            load.run(reader, group=None, rank=0)
        state = load.state()
        out: dict[str, torch.Tensor] = {}
        for it in items:
            node = state
            for seg in it.ref:
                node = node[seg]
            out[it.name] = node
        return out


def _source(fs: LocalFileSystem, path: Path, manifest: Manifest, *, verify: bool) -> Any:
    kind = manifest.tree.get("type")
    if kind == "dcp":
        return _DcpSource(fs, path, verify=verify)
    if kind == "foreign":
        raise UnsupportedFormatError(
            f"{path} holds files written by {manifest.tree.get('format')!r}: export its "
            "weights with that library's tools",
            path=path,
        )
    return _PlainSource(fs, path, manifest, verify=verify)


def _rank_ranges(fs: LocalFileSystem, path: Path, manifest: Manifest) -> list[tuple[Any, int, int]]:
    """Each rank's tree and range of tensor records in a save of N ranks."""
    doc = json.loads(fs.read_bytes(path / MANIFEST_NAME))
    out: list[tuple[Any, int, int]] = []
    try:
        assert len(doc["ranks"]) == manifest.world_size
        for rec in doc["ranks"]:
            t0, t1 = rec["tensors"]
            assert type(t0) is int and type(t1) is int
            assert 0 <= t0 <= t1 <= len(manifest.tensors)
            assert isinstance(rec["tree"], dict)
            out.append((rec["tree"], t0, t1))
    except (KeyError, IndexError, TypeError, ValueError, AssertionError) as exc:
        raise CorruptCheckpointError(
            f"damaged manifest {path / MANIFEST_NAME}: no valid ranks", path=path
        ) from exc
    return out


def _held(what: tuple[str, list[int]] | None) -> str:
    return "nothing" if what is None else f"{what[0]} {what[1]}"


def _only_tensors(node: Any) -> bool:
    """Whether every leaf of a manifest tree is a tensor."""
    kind = node.get("type") if isinstance(node, dict) else None
    if kind == "tensor":
        return True
    if kind == "stateful":
        return _only_tensors(node.get("state"))
    if kind == "dict":
        return all(_only_tensors(v) for _, v in node.get("items", []))
    if kind in ("list", "tuple"):
        return all(_only_tensors(v) for v in node.get("items", []))
    return False


def _prefix(items: list[_Item], key: str | None, all_tensors: bool, path: Path) -> str:
    """The key prefix (``"model/"``; ``""`` for the whole state) of the item
    ``key`` names (see :func:`export_hf`).

    :raises MissingItemError: no default applies.
    """
    if key is None:
        if any(it.key.startswith("model/") for it in items):
            key = "model"
        elif not all_tensors:
            raise MissingItemError(
                f"{path} has no top-level item 'model' and holds more than tensors: pass "
                "the key path of the model's state dict (key=..., --key)",
                path=path,
                key="model",
            )
        else:
            key = ""
    key = key.strip("/")
    return key + "/" if key else ""


def _selected(items: list[_Item], prefix: str, path: Path) -> list[_Item]:
    """The items under ``prefix``, named below it.

    :raises MissingItemError: ``prefix`` names no tensor.
    :raises InvalidKeyError: two of them get one name.
    """
    out = [
        dataclasses.replace(it, name=it.key[len(prefix) :].replace("/", "."))
        for it in items
        if it.key.startswith(prefix)
    ]
    if not out:
        key = prefix.removesuffix("/")
        raise MissingItemError(f"{path} has no tensor under {key!r}", path=path, key=key)
    first: dict[str, str] = {}
    for it in out:
        other = first.setdefault(it.name, it.key)
        if other != it.key:
            raise InvalidKeyError(
                f"{path}: the tensors at {other!r} and {it.key!r} would both be written as "
                f"{it.name!r} (levels below the item are joined with '.'): one would be "
                "lost; rename one of them before saving, or export one item at a time (key=)",
                path=path,
                key=it.key,
            )
    return out


def _check_dtype(dtype: Any) -> None:
    """``dtype=`` of :func:`export_hf`: ``None`` or one of :data:`CASTABLE_DTYPES`.

    :raises TypeError: not a ``torch.dtype``.
    :raises ValueError: a dtype it does not cast to.
    """
    if dtype is None:
        return
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"dtype={dtype!r} is not a torch.dtype: pass e.g. torch.bfloat16")
    if dtype not in CASTABLE_DTYPES:
        names = ", ".join(sorted(_dtype_name(d) for d in CASTABLE_DTYPES))
        raise ValueError(f"dtype={dtype} is not one the export casts to: {names}")


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _cast_to(saved: torch.dtype, dtype: torch.dtype | None) -> torch.dtype:
    """The dtype a tensor saved as ``saved`` is written in (see
    :data:`CASTABLE_DTYPES`)."""
    return dtype if dtype is not None and saved in CASTABLE_DTYPES else saved


def _target(item: _Item, dtype: torch.dtype | None) -> torch.dtype:
    return _cast_to(item.dtype, dtype)


def _check_nameable(item: _Item, dtype: torch.dtype | None, path: Path) -> None:
    if header_dtype(_target(item, dtype), item.shape) is None:
        raise UnsupportedTensorError(
            f"tensor {item.key!r} of {path} is {_target(item, dtype)} {list(item.shape)}, "
            "which safetensors has no dtype for: Hugging Face files cannot hold it",
            path=path,
            key=item.key,
        )


def _shards(items: list[_Item], limit: int, dtype: torch.dtype | None) -> list[list[_Item]]:
    """``items`` in order, cut into runs of at most ``limit`` bytes (a larger
    tensor alone)."""
    shards: list[list[_Item]] = [[]]
    size = 0
    for it in items:
        n = math.prod(it.shape) * _target(it, dtype).itemsize
        if shards[-1] and size + n > limit:
            shards.append([])
            size = 0
        shards[-1].append(it)
        size += n
    return shards


def _shard_names(n: int) -> list[str]:
    if n == 1:
        return [WEIGHTS_NAME]
    return [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]


def _prepared(
    tensors: dict[str, torch.Tensor], dtype: torch.dtype | None
) -> dict[str, torch.Tensor]:
    """Contiguous tensors of the target dtype, none sharing bytes with another
    (tied weights: each name its own copy), as ``save_file`` needs them."""
    out: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        out[name] = t.to(_cast_to(t.dtype, dtype)).contiguous()
    spans = sorted(
        (
            t.untyped_storage().data_ptr(),
            t.data_ptr(),
            t.data_ptr() + t.numel() * t.element_size(),
            name,
        )
        for name, t in out.items()
        if t.numel()
    )
    storage, end = None, 0
    for ptr, lo, hi, name in spans:
        if ptr != storage:
            storage, end = ptr, hi
        elif lo < end:
            out[name] = out[name].clone()  # overlaps a tensor already kept
        else:
            end = max(end, hi)
    return out


def _local_dir(out_dir: Any) -> Path:
    """``out_dir`` as a local path.

    :raises ValueError: a URL (``s3://bucket/out``): ``Path`` would make it a
        local ``s3:/bucket/out``, written without a word.
    """
    text = str(out_dir)
    if "://" in text:
        raise ValueError(
            f"out_dir {text!r} is a URL: the export writes a local directory; export "
            "there, then upload it (e.g. huggingface_hub.upload_folder)"
        )
    return Path(out_dir)


def _check_out(out: Path) -> None:
    """Refuse an ``out_dir`` that holds model weights or lies in a checkpoint,
    then create it.

    :raises ValueError: ``out_dir`` is a checkpoint directory or inside one.
    :raises FileExistsError: it is a file, or holds model weights already.
    """
    inside = _checkpoint_of(out)
    if inside is not None:
        raise ValueError(
            f"{out} is in the checkpoint {inside}: a committed checkpoint is never "
            "written to, and retention would delete the export with it; export into "
            "a directory of its own"
        )
    if out.exists() and not out.is_dir():
        raise FileExistsError(f"{out} exists and is not a directory")
    _make_dirs_durably(out)
    held = sorted(
        p.name
        for p in out.iterdir()
        if p.name == INDEX_NAME or (p.name.startswith("model") and p.name.endswith(".safetensors"))
    )
    if held:
        raise FileExistsError(
            f"{out} holds model weights already ({', '.join(held)}): export into an empty "
            "directory, or remove them first"
        )


def _checkpoint_of(out: Path) -> Path | None:
    """The asyncsave checkpoint directory that ``out`` is or lies in (a directory
    whose ``manifest.json`` says ``"format": "asyncsave"``), or ``None``."""
    for d in (out.resolve(), *out.resolve().parents):
        try:
            with open(d / MANIFEST_NAME, "rb") as f:
                head = f.read(4096)
        except OSError:  # none there (or unreadable: not one of ours to protect)
            continue
        if _ASYNCSAVE_MANIFEST.search(head):
            return d
    return None


def _make_dirs_durably(out: Path) -> None:
    """Create ``out`` and its missing parents, each made durable in its parent
    (fsync of the parent directory), so that files fsynced into ``out`` survive
    a power loss with the directory that names them."""
    missing: list[Path] = []
    d = out.absolute()
    while not d.exists():
        missing.append(d)
        d = d.parent
    fs = LocalFileSystem()
    fs.makedirs(out)
    for made in reversed(missing):  # the top one first: its parent existed
        fs.fsync_dir(made.parent)


def _write_atomic(target: Path, write: Any) -> Path:
    """Write ``target`` through ``write(temp path)``, fsync it, rename it in
    place: a reader never sees half a file."""
    tmp = target.with_name(f".{target.name}.partial")
    try:
        write(str(tmp))
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)
    LocalFileSystem().fsync_dir(target.parent)
    return target


def _write_json(target: Path, doc: Any) -> Path:
    def write(name: str) -> None:
        with open(name, "w", encoding="utf-8") as f:
            json.dump(doc, f, indent=2, sort_keys=True)
            f.write("\n")

    return _write_atomic(target, write)


def _config_dict(config: Any, dtype: torch.dtype | None) -> dict[str, Any]:
    """The ``config.json`` document of ``config`` (see :func:`export_hf`), saying
    ``dtype`` when the weights are cast to it: ``from_pretrained`` loads a model
    in the dtype its config names (transformers 5: ``"dtype"``; 4: ``"torch_dtype"``,
    set too where the config has it), which ``save_pretrained`` sets to the
    weights' dtype.

    :raises TypeError: not a config, dict or path.
    """
    doc = _config_doc(config)
    if dtype is not None:
        doc["dtype"] = _dtype_name(dtype)
        if "torch_dtype" in doc:
            doc["torch_dtype"] = _dtype_name(dtype)
    return doc


def _config_doc(config: Any) -> dict[str, Any]:
    if callable(getattr(config, "to_dict", None)):
        return dict(config.to_dict())
    if isinstance(config, Mapping):
        return dict(config)
    if isinstance(config, (str, os.PathLike)):
        doc = json.loads(Path(config).read_text(encoding="utf-8"))
        if not isinstance(doc, dict):
            raise TypeError(f"config file {config} does not hold a JSON object")
        return doc
    raise TypeError(
        f"config is a {type(config).__name__}: pass a transformers config, a dict or "
        "the path of a config.json"
    )
