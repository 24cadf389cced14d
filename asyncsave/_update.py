"""Rewriting one item of a committed checkpoint, atomically.

A trainer sometimes has to change a small part of a checkpoint it already wrote
(SkyRL's fully-async fix rewrites the trainer state after filtering data). Reading
and rewriting the whole checkpoint would cost its full size; instead a new
directory is built beside it whose data files are hard links to the committed
ones (never written again), plus one new data file for the item's tensors if it
has any, and a new self-checksummed manifest whose tree holds the new item. The new
directory replaces the old one with ``renameat2(RENAME_EXCHANGE)``, so a crash
leaves the old or the new checkpoint under the final name, never neither and never
a mix. Bytes of the replaced item stay in the old files, unreferenced, until the
checkpoint is deleted or saved again with ``overwrite=True``.
"""

from __future__ import annotations

import json
import uuid
from pathlib import Path
from typing import Any

from ._commit import commit_dir, discard, make_temp_dir
from ._errors import MissingItemError
from ._format import FileLayout
from ._fs import LocalFileSystem
from ._load import read_checkpoint
from ._manifest import CHECKSUM, SELF_CHECKSUM, encode_manifest
from ._paths import MANIFEST_NAME
from ._plan import Plan
from ._write import write_bytes, write_data_file

__all__ = ["rewrite_item"]


def _shift_leaves(node: Any, by: int) -> Any:
    """A copy of a tree node whose tensor/pickle leaf indices are moved by ``by``."""
    if isinstance(node, dict):
        out = {k: _shift_leaves(v, by) for k, v in node.items()}
        if node.get("type") in ("tensor", "pickle") and isinstance(node.get("index"), int):
            out["index"] = node["index"] + by
        return out
    if isinstance(node, list):
        return [_shift_leaves(v, by) for v in node]
    return node


def rewrite_item(
    fs: LocalFileSystem,
    root: Path,
    final: Path,
    key: str,
    plan: Plan,
    layouts: list[FileLayout],
    buffer: Any,
) -> int:
    """Replace top-level item ``key`` of the checkpoint at ``final`` by the item
    planned in ``plan`` (a plan of ``{key: value}``, staged into ``buffer``).

    :returns: the checkpoint's new tensor byte count.
    :raises MissingItemError: the checkpoint has no top-level item ``key``.
    :raises CorruptCheckpointError: the committed checkpoint does not read.
    :raises OSError: an I/O step failed (the committed checkpoint is untouched).
    """
    step = read_checkpoint(fs, final).step  # validates everything first
    doc = json.loads(fs.read_bytes(final / MANIFEST_NAME))
    doc.pop(SELF_CHECKSUM, None)
    tree = doc["tree"]
    items = tree.get("items") if tree.get("type") == "dict" else None
    slot = None
    for i, (k, _) in enumerate(items or []):
        if k == ["s", key]:
            slot = i
    if items is None or slot is None:
        raise MissingItemError(
            f"{final} has no top-level item {key!r} to update", path=final, step=step, key=key
        )
    tmp = make_temp_dir(fs, root, step)
    try:
        for name in fs.listdir(final):
            if name != MANIFEST_NAME:
                fs.link(final / name, tmp / name)
        new_node = plan.tree["items"][0][1]
        n_entries, n_tensors, n_files = len(doc["entries"]), len(doc["tensors"]), len(doc["files"])
        for fl in layouts:
            fl.name = f"update-{uuid.uuid4().hex[:12]}.safetensors"
            for i, digest in write_data_file(fs, tmp, fl, plan.entries, buffer).items():
                plan.entries[i].digest = digest
            doc["files"].append({"name": fl.name, "nbytes": fl.nbytes})
        for e in plan.entries:
            doc["entries"].append(
                {
                    "name": e.name,
                    "file": n_files + e.file,
                    "offset": e.offset,
                    "nbytes": e.nbytes,
                    CHECKSUM: e.digest,
                }
            )
        for rec in plan.records:
            doc["tensors"].append({**rec, "entry": rec["entry"] + n_entries})
        items[slot] = [["s", key], _shift_leaves(new_node, n_tensors)]
        write_bytes(fs, tmp / MANIFEST_NAME, encode_manifest(doc))
        read_checkpoint(fs, tmp, expect_step=step)  # the new manifest parses
        commit_dir(fs, tmp, final, overwrite=True)
    except BaseException:
        discard(fs, tmp)
        raise
    return sum(e["nbytes"] for e in doc["entries"])
