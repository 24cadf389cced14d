"""Rewriting one item of a committed checkpoint, atomically.

A trainer sometimes has to change a small part of a checkpoint it already wrote
(SkyRL's fully-async fix rewrites the trainer state after filtering data). Reading
and rewriting the whole checkpoint would cost its full size; instead a new
directory is built beside it whose data files are hard links to the committed
ones (never written again), plus one new data file for the item's tensors if it
has any, and a new self-checksummed manifest whose tree holds the new item. The new
directory replaces the old one with ``renameat2(RENAME_EXCHANGE)``, so a crash
leaves the old or the new checkpoint under the final name, never neither and never
a mix. The manifest is compacted: tensors, entries and files only the replaced item
used are dropped (a file shared with other items stays, its dead bytes with it,
until the checkpoint is saved again with ``overwrite=True``).
"""

from __future__ import annotations

import dataclasses
import json
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio
import anyio.to_thread

from ._atomicity import CommitStrategy, discard
from ._catalog import read_checkpoint
from ._errors import (
    CheckpointError,
    CheckpointNotFoundError,
    InvalidKeyError,
    MissingItemError,
    ProtectedCheckpointError,
    SaveFailedError,
    UnsupportedFormatError,
)
from ._format import FileLayout, layout_files, staging_nbytes
from ._fs import LocalFileSystem
from ._handle import SaveHandle
from ._manifest import (
    CHECKSUM,
    SELF_CHECKSUM,
    encode_manifest,
    format_version,
    record_entries,
    renumbered,
)
from ._paths import MANIFEST_NAME
from ._pipeline import Saver, as_save_error
from ._plan import Plan, make_plan
from ._stage import StagingPool, lease_and_stage
from ._types import CheckpointInfo
from ._write import write_bytes, write_data_file

__all__ = ["rewrite_item", "update"]


def _remap_leaves(node: Any, index: Callable[[int], int]) -> Any:
    """A copy of a tree node whose tensor/pickle leaf indices go through ``index``."""
    if isinstance(node, dict):
        out = {k: _remap_leaves(v, index) for k, v in node.items()}
        if node.get("type") in ("tensor", "pickle") and isinstance(node.get("index"), int):
            out["index"] = index(node["index"])
        return out
    if isinstance(node, list):
        return [_remap_leaves(v, index) for v in node]
    return node


def _leaf_indices(node: Any, found: set[int]) -> set[int]:
    if isinstance(node, dict):
        if node.get("type") in ("tensor", "pickle") and isinstance(node.get("index"), int):
            found.add(node["index"])
        for v in node.values():
            _leaf_indices(v, found)
    elif isinstance(node, list):
        for v in node:
            _leaf_indices(v, found)
    return found


def _compact(doc: dict[str, Any]) -> None:
    """Drop tensors, entries and files the tree no longer references (the replaced
    item's), renumbering what is left, so repeated updates do not grow the
    manifest or keep dead files alive."""
    tensors, entries, files = doc["tensors"], doc["entries"], doc["files"]
    used_t = sorted(_leaf_indices(doc["tree"], set()))
    used_e = sorted({j for i in used_t for j in record_entries(tensors[i])})
    used_f = sorted({entries[j]["file"] for j in used_e})
    t_map = {old: new for new, old in enumerate(used_t)}
    e_map = {old: new for new, old in enumerate(used_e)}
    f_map = {old: new for new, old in enumerate(used_f)}
    doc["tree"] = _remap_leaves(doc["tree"], t_map.__getitem__)
    doc["tensors"] = [renumbered(tensors[i], e_map.__getitem__) for i in used_t]
    doc["entries"] = [{**entries[j], "file": f_map[entries[j]["file"]]} for j in used_e]
    doc["files"] = [files[k] for k in used_f]


def rewrite_item(
    strategy: CommitStrategy,
    fs: LocalFileSystem,
    root: Path,
    final: Path,
    key: str,
    plan: Plan,
    layouts: list[FileLayout],
    buffer: Any,
) -> tuple[int, int]:
    """Replace top-level item ``key`` of the checkpoint at ``final`` by the item
    planned in ``plan`` (a plan of ``{key: value}``, staged into ``buffer``),
    published through the root's commit protocol ``strategy`` as an overwrite
    (an atomic exchange of the two directories).

    A final name that is a symlink (a checkpoint of another run linked in, https://github.com/facebookresearch/PyTorch-BigGraph/pull/24) is
    refused: the swap would put a new directory under the name and leave the
    link to be deleted, and update() rewrites only what this run wrote in place.

    :returns: the checkpoint's tensor bytes and tensor count after the update.
    :raises ProtectedCheckpointError: ``final`` is a symlink (nothing changes).
    :raises MissingItemError: the checkpoint has no top-level item ``key``.
    :raises CorruptCheckpointError: the committed checkpoint does not read.
    :raises OSError: an I/O step failed (the committed checkpoint is untouched).
    """
    step, doc, slot = _read_item(fs, final, key)
    old_data, kept_data = _splice(doc, slot, key, plan, layouts)
    tmp = strategy.begin(fs, root, step, final)
    try:
        for name in fs.listdir(final):
            # Data files still referenced, and files that are not data files (a
            # layout's training_info.json); the manifest is new.
            if name != MANIFEST_NAME and (name in kept_data or name not in old_data):
                fs.link(final / name, tmp / name)
        digests: dict[int, str] = {}
        for fl in layouts:
            if fl.name in kept_data:
                digests.update(write_data_file(fs, tmp, fl, plan.entries, buffer))
        _add_checksums(doc, plan, digests, old_data)
        write_bytes(fs, tmp / MANIFEST_NAME, encode_manifest(doc))
        read_checkpoint(fs, tmp, expect_step=step)  # the new manifest parses
        strategy.commit(fs, tmp, final, overwrite=True)
    except BaseException:
        discard(fs, tmp)
        raise
    return sum(e["nbytes"] for e in doc["entries"]), len(doc["tensors"])


def _read_item(fs: LocalFileSystem, final: Path, key: str) -> tuple[int, dict[str, Any], int]:
    """The committed checkpoint at ``final`` (validated first): its step, its
    manifest without the self-checksum, and the position of top-level item
    ``key`` in its tree.

    :raises ProtectedCheckpointError: ``final`` is a symlink.
    :raises MissingItemError: the checkpoint has no top-level item ``key``.
    :raises UnsupportedFormatError: it was written through DCP.
    """
    step = read_checkpoint(fs, final).step  # validates everything first
    if fs.is_link(final):
        raise ProtectedCheckpointError(
            f"{final} is a symlink: update() rewrites only a checkpoint this run wrote "
            "in place (the link and its target are left as they are); save the step "
            "with overwrite=True to replace the link by a directory of this run",
            path=final,
            step=step,
        )
    doc = json.loads(fs.read_bytes(final / MANIFEST_NAME))
    doc.pop(SELF_CHECKSUM, None)
    tree = doc["tree"]
    if tree.get("type") == "dcp":
        raise UnsupportedFormatError(
            f"{final} was written through torch.distributed.checkpoint: its items are "
            "DCP's (possibly in DCP's own compressed files), not a state tree update() "
            f"can splice {key!r} into; save the step again through DCP with "
            "overwrite=True instead",
            path=final,
            step=step,
            key=key,
        )
    items = tree.get("items") if tree.get("type") == "dict" else None
    slot = None
    for i, (k, _) in enumerate(items or []):
        if k == ["s", key]:
            slot = i
    if items is None or slot is None:
        raise MissingItemError(
            f"{final} has no top-level item {key!r} to update", path=final, step=step, key=key
        )
    return step, doc, slot


def _splice(
    doc: dict[str, Any], slot: int, key: str, plan: Plan, layouts: list[FileLayout]
) -> tuple[set[str], set[str]]:
    """Put the item planned in ``plan`` at ``slot`` of ``doc``'s tree, its files
    (named now), entries and tensors appended, then compact ``doc``.

    :returns: the names of the data files before, and of those kept after.
    """
    new_node = plan.tree["items"][0][1]
    n_entries, n_tensors, n_files = len(doc["entries"]), len(doc["tensors"]), len(doc["files"])
    for fl in layouts:
        fl.name = f"update-{uuid.uuid4().hex[:12]}.safetensors"
        doc["files"].append({"name": fl.name, "nbytes": fl.nbytes})
    for e in plan.entries:
        doc["entries"].append(
            {"name": e.name, "file": n_files + e.file, "offset": e.offset, "nbytes": e.nbytes}
        )
    for rec in plan.records:
        doc["tensors"].append(renumbered(rec, lambda j: j + n_entries))
    doc["tree"]["items"][slot] = [["s", key], _remap_leaves(new_node, lambda i: i + n_tensors)]
    old_data = {f["name"] for f in doc["files"][:n_files]}
    _compact(doc)
    doc["format_version"] = max(doc["format_version"], format_version(doc["tensors"]))
    return old_data, {f["name"] for f in doc["files"]}


def _add_checksums(
    doc: dict[str, Any], plan: Plan, digests: dict[int, str], old_data: set[str]
) -> None:
    """Give each entry of a new data file the checksum its write computed
    (``digests``, by index into ``plan.entries``)."""
    by_name = {e.name: i for i, e in enumerate(plan.entries)}
    new_files = {f["name"] for f in doc["files"]} - old_data
    for f_index, f in enumerate(doc["files"]):
        if f["name"] not in new_files:
            continue
        for e in doc["entries"]:
            if e["file"] == f_index and CHECKSUM not in e:
                e[CHECKSUM] = digests[by_name[e["name"]]]


async def update(saver: Saver, step: int, key: str, value: Any) -> CheckpointInfo:
    """The body of :meth:`asyncsave.Checkpointer.update` (see there)."""
    saver.check_usable()
    path = saver.root / saver.layout.dir_name(step)
    _refuse(saver, step, key, path)
    await saver.queue_behind(step, "update")
    old = await _written_here(saver, step, path)
    plan = make_plan({key: value}, allow_pickle=saver.options.allow_pickle)
    layouts = layout_files(plan.entries, rank=0, max_files=1)
    handle = SaveHandle(step)
    handle._staged.set()
    saver.pending[step] = handle
    pool = StagingPool(None)
    try:
        lease = await lease_and_stage(
            pool,
            staging_nbytes(layouts),
            plan.entries,
            poll_interval_s=saver.options.poll_interval_s,
            timeout_s=saver.options.save_timeout_s,
        )
        plan.release_sources()
        with anyio.CancelScope(shield=True), anyio.fail_after(saver.options.save_timeout_s):
            nbytes, num_tensors = await saver.run(
                saver.under_final_lock,
                rewrite_item,
                saver.strategy,
                saver.fs,
                saver.root,
                path,
                key,
                plan,
                layouts,
                lease.buffer,
            )
        info = dataclasses.replace(old, nbytes=nbytes, num_tensors=num_tensors)
        saver.committed[step] = info
        handle._commit(info)
        return info
    except (CheckpointError, anyio.get_cancelled_exc_class()) as exc:
        handle._fail(SaveFailedError(f"update of step {step} did not happen: {exc!r}"))
        raise
    except Exception as exc:
        error = as_save_error(exc, step, path, saver.options.save_timeout_s)
        saver.fail(handle, error)
        raise error from exc
    finally:
        if saver.pending.get(step) is handle:
            del saver.pending[step]
        with anyio.CancelScope(shield=True):
            await pool.aclose()


def _refuse(saver: Saver, step: int, key: Any, path: Path) -> None:
    """Refuse an update() this checkpointer can never make, before it waits.

    :raises CheckpointError: several ranks, or a root that cannot swap directories.
    :raises InvalidKeyError: ``key`` is not a ``str``.
    :raises ProtectedCheckpointError: ``step`` is the step this run resumed from.
    """
    if saver.coord.world_size > 1:
        raise CheckpointError(
            f"update() on several ranks is refused: the checkpoint's items are per rank "
            f"(its tree is keyed by rank), so replacing one would need every rank's new "
            f"value and a collective rewrite, which asyncsave does not do; save step "
            f"{step} again with overwrite=True instead",
            step=step,
            path=path,
        )
    if not saver.strategy.can_overwrite:
        raise CheckpointError(
            f"update() swaps directories atomically, which {saver.fs!r} cannot; "
            "save the step under a new number instead",
            step=step,
            path=path,
        )
    if type(key) is not str:
        raise InvalidKeyError(f"update() needs a str key, got {key!r}", key=repr(key))
    if step == saver.resumed_step:
        raise ProtectedCheckpointError(
            f"step {step} is the checkpoint this run resumed from; it is never rewritten",
            step=step,
            path=path,
        )


async def _written_here(saver: Saver, step: int, path: Path) -> CheckpointInfo:
    """The info of step ``step`` as this checkpointer committed it.

    :raises CheckpointNotFoundError: there is no checkpoint of ``step``.
    :raises ProtectedCheckpointError: this checkpointer did not save ``step``.
    """
    old = saver.committed.get(step)
    if old is None and not await anyio.to_thread.run_sync(saver.fs.exists, path):
        raise CheckpointNotFoundError(
            f"there is no checkpoint of step {step} to update ({path})", step=step, path=path
        )
    if old is None or old.committed_s is None:
        raise ProtectedCheckpointError(
            f"step {step} was not saved by this checkpointer; update() rewrites only "
            "checkpoints this run wrote",
            step=step,
            path=path,
        )
    return old
