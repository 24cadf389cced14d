"""S8 (SkyRL PR #2145): every file of a checkpoint lands before its single commit;
the tracker moves after the commit; retention deletes only afterwards. Checked on
the recorded order of file-system operations."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import asyncsave
from asyncsave.testing import checkpoint_dir_name

pytestmark = pytest.mark.anyio


class RecordingFS(asyncsave.LocalFileSystem):
    def __init__(self) -> None:
        self.ops: list[tuple[str, str]] = []
        self._fds: dict[int, str] = {}

    def create(self, path: Path) -> int:
        fd = super().create(path)
        self._fds[fd] = str(path)
        self.ops.append(("create", str(path)))
        return fd

    def fsync(self, fd: int) -> None:
        super().fsync(fd)
        self.ops.append(("fsync", self._fds.get(fd, "?")))

    def rename(self, src: Path, dst: Path) -> None:
        super().rename(src, dst)
        self.ops.append(("rename", f"{src.name}->{dst.name}"))

    def replace(self, src: Path, dst: Path) -> None:
        super().replace(src, dst)
        self.ops.append(("replace", dst.name))

    def remove_tree(self, path: Path) -> None:
        super().remove_tree(path)
        self.ops.append(("remove_tree", path.name))


def _index(ops: list[tuple[str, str]], pred: Any) -> list[int]:
    return [i for i, op in enumerate(ops) if pred(op)]


@pytest.mark.parametrize("layout", ["asyncsave", "nemo-rl", "megatron"])
async def test_s8_files_then_commit_then_tracker_then_retention(
    tmp_path: Path, layout: str
) -> None:
    fs = RecordingFS()
    state = {"w": torch.randn(256), "step": 0}
    async with asyncsave.Checkpointer(
        tmp_path, layout=layout, filesystem=fs, retention=asyncsave.KeepLast(1)
    ) as ckpt:
        await (await ckpt.save(1, state, training_info={"n": 1}))
        fs.ops.clear()
        await (await ckpt.save(2, state, training_info={"n": 2}))
    ops = fs.ops
    final = checkpoint_dir_name(layout, 2)
    [commit] = _index(ops, lambda op: op[0] == "rename" and op[1].endswith("->" + final))
    file_syncs = _index(ops, lambda op: op[0] == "fsync" and ".asyncsave-tmp-2-" in op[1])
    names = {Path(ops[i][1]).name for i in file_syncs}
    assert "manifest.json" in names and any(n.endswith(".safetensors") for n in names)
    if layout == "nemo-rl":
        assert "training_info.json" in names
    assert max(file_syncs) < commit  # every file durable before the single commit
    manifest_sync = max(i for i in file_syncs if ops[i][1].endswith("manifest.json"))
    assert all(i < manifest_sync for i in file_syncs if i != manifest_sync)  # manifest last
    retire = _index(ops, lambda op: op[0] == "rename" and ".asyncsave-tmp-retired-1-" in op[1])
    removed = _index(ops, lambda op: op[0] == "remove_tree" and "retired-1-" in op[1])
    assert len(retire) == 1 and len(removed) == 1
    if layout != "nemo-rl":
        [track] = _index(ops, lambda op: op[0] == "replace")
        assert commit < track < retire[0]  # tracker after commit, retention after tracker
    assert commit < retire[0] < removed[0]
    # nothing written into the checkpoint after its commit
    assert not _index(ops[commit + 1 :], lambda op: op[0] == "create" and final in op[1])
