"""Updating one item of a committed checkpoint: atomic, checksummed, cheap (the other
items' files are hard links), refused for checkpoints this run did not write."""

from __future__ import annotations

import errno
import multiprocessing
import os
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from faults import FaultyFS, kill, raise_errno
from tensordict import TensorDict

import asyncsave

pytestmark = pytest.mark.anyio


def _state() -> dict[str, Any]:
    return {
        "model": {"w": torch.arange(4096, dtype=torch.float32), "b": torch.ones(3)},
        "trainer": {"cursor": 10, "filtered": torch.tensor([1, 2, 3])},
        "step": 5,
    }


async def test_update_replaces_one_item_and_links_the_rest(tmp_path: Path) -> None:
    async with asyncsave.Checkpointer(tmp_path, layout="nemo-rl") as ckpt:
        await (await ckpt.save(5, _state(), training_info={"consumed": 3}))
        final = tmp_path / "step_5"
        data_before = {
            p.name: p.stat().st_ino for p in final.iterdir() if p.suffix == ".safetensors"
        }
        new = {
            "cursor": 7,
            "filtered": torch.tensor([1, 3]),
            "buf": TensorDict({"x": torch.zeros(2)}, [2]),
        }
        info = await ckpt.update(5, "trainer", new)
        assert info.step == 5 and info.training_info == {"consumed": 3}
    state = asyncsave.load(final)
    assert state["trainer"]["cursor"] == 7
    assert torch.equal(state["trainer"]["filtered"], torch.tensor([1, 3]))
    assert torch.equal(state["trainer"]["buf"]["x"], torch.zeros(2))
    assert torch.equal(state["model"]["w"], _state()["model"]["w"])  # untouched
    assert state["step"] == 5
    asyncsave.verify(final)  # every checksum, old files and the new one
    after = {p.name: p.stat().st_ino for p in final.iterdir() if p.suffix == ".safetensors"}
    for name, ino in data_before.items():
        assert after[name] == ino  # the same inode: hard-linked, not rewritten
    assert (final / "training_info.json").exists()  # the layout's extra file came along
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".asyncsave-tmp")]


async def test_update_of_a_plain_item_and_repeated_updates(tmp_path: Path) -> None:
    async with asyncsave.Checkpointer(tmp_path) as ckpt:
        await (await ckpt.save(5, _state()))
        for i in range(3):
            await ckpt.update(5, "step", 100 + i)
        await ckpt.update(5, "trainer", {"cursor": 1, "filtered": torch.tensor([9])})
    state = asyncsave.load(tmp_path / "step_5")
    assert state["step"] == 102 and state["trainer"]["cursor"] == 1
    assert torch.equal(state["trainer"]["filtered"], torch.tensor([9]))
    asyncsave.verify(tmp_path / "step_5")


async def test_update_is_refused_for_the_resumed_and_foreign_checkpoints(tmp_path: Path) -> None:
    async with asyncsave.Checkpointer(tmp_path) as ckpt:
        await (await ckpt.save(5, _state()))
        await (await ckpt.save(6, _state()))
    async with asyncsave.Checkpointer(tmp_path) as ckpt:
        assert (await ckpt.load_latest()) is not None  # resumed from 6
        with pytest.raises(asyncsave.ProtectedCheckpointError, match="resumed from"):
            await ckpt.update(6, "step", 1)
        with pytest.raises(asyncsave.ProtectedCheckpointError, match="not saved by this"):
            await ckpt.update(5, "step", 1)
        await (await ckpt.save(7, _state()))
        with pytest.raises(asyncsave.MissingItemError, match="nope"):
            await ckpt.update(7, "nope", 1)
        with pytest.raises(asyncsave.InvalidKeyError):
            await ckpt.update(7, 3, 1)  # type: ignore[arg-type]
        with pytest.raises(asyncsave.UnsupportedTypeError, match="trainer"):
            await ckpt.update(7, "trainer", {"x": threading.Lock()})
    assert asyncsave.load(tmp_path / "step_7")["step"] == 5


async def test_a_failed_update_leaves_the_committed_checkpoint_as_it_was(tmp_path: Path) -> None:
    fs = FaultyFS("write", raise_errno(errno.ENOSPC), where=lambda p: "update-" in p)
    with pytest.raises(asyncsave.SaveFailedError) as at_close:
        async with asyncsave.Checkpointer(tmp_path, filesystem=fs) as ckpt:
            await (await ckpt.save(5, _state()))
            with pytest.raises(asyncsave.SaveFailedError) as info:
                await ckpt.update(5, "trainer", {"cursor": 1, "filtered": torch.tensor([9])})
            assert isinstance(info.value.__cause__, OSError)
            assert info.value.__cause__.errno == errno.ENOSPC
            with pytest.raises(asyncsave.SaveFailedError):
                await ckpt.save(6, _state())  # like a failed save: refuses further saves
    assert at_close.value is info.value
    state = asyncsave.load(tmp_path / "step_5")
    assert state["trainer"]["cursor"] == 10
    asyncsave.verify(tmp_path / "step_5")
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".asyncsave-tmp")]


async def test_a_save_of_the_same_step_waits_for_the_update(tmp_path: Path) -> None:
    async with asyncsave.Checkpointer(tmp_path) as ckpt:
        await (await ckpt.save(5, _state()))
        await ckpt.update(5, "step", 55)
        with pytest.warns(asyncsave.CheckpointWarning, match="already committed"):
            h = await ckpt.save(5, _state())  # committed: a no-op returning its info
        assert (await h).step == 5  # type: ignore[union-attr]
        await (await ckpt.save(5, {**_state(), "step": 77}, overwrite=True))
    assert asyncsave.load(tmp_path / "step_5")["step"] == 77
    assert os.listdir(tmp_path / "step_5")


async def test_repeated_updates_keep_only_what_the_tree_references(tmp_path: Path) -> None:
    async with asyncsave.Checkpointer(tmp_path) as ckpt:
        await (await ckpt.save(5, _state()))
        for i in range(3):
            info = await ckpt.update(5, "trainer", {"cursor": i, "filtered": torch.arange(i + 1)})
    final = tmp_path / "step_5"
    updates = [p for p in final.iterdir() if p.name.startswith("update-")]
    assert len(updates) == 1  # the earlier updates' files are gone
    verified = asyncsave.verify(final)  # read from the manifest, every file checked
    assert verified.num_tensors == info.num_tensors == 3  # w, b, filtered
    assert info.nbytes == verified.nbytes
    state = asyncsave.load(final)
    assert torch.equal(state["trainer"]["filtered"], torch.arange(3))
    asyncsave.verify(final)


# (sees ``exchange`` and ``remove_tree`` too: every operation of the file layer)
_ExchangeFS = FaultyFS


def _update_then_die(root: str, op: str) -> None:
    import anyio

    where = {"write": lambda p: "update-" in p, "create": lambda p: "manifest" in p}
    fs = _ExchangeFS(op, kill(), where=where.get(op, lambda p: True))

    async def main() -> None:
        async with asyncsave.Checkpointer(root) as ckpt:
            await (await ckpt.save(5, _state()))
            ckpt._fs = fs  # faults only in the update, not in the first save
            await ckpt.update(5, "trainer", {"cursor": 99, "filtered": torch.tensor([7])})

    anyio.run(main)
    os._exit(3)  # not killed: the test fails


@pytest.mark.parametrize(
    "op, updated", [("write", False), ("create", False), ("exchange", False), ("remove_tree", True)]
)
def test_a_crash_in_the_middle_of_an_update_leaves_old_or_new_never_a_mix(
    tmp_path: Path, op: str, updated: bool
) -> None:
    child = multiprocessing.get_context("fork").Process(
        target=_update_then_die, args=(str(tmp_path), op)
    )
    child.start()
    child.join(60)
    assert child.exitcode == -9, child.exitcode
    final = tmp_path / "step_5"
    asyncsave.verify(final)
    state = asyncsave.load(final)
    assert state["trainer"]["cursor"] == (99 if updated else 10)
    assert torch.equal(state["model"]["w"], _state()["model"]["w"])

    async def reopen() -> None:
        async with asyncsave.Checkpointer(tmp_path):
            pass

    import anyio

    anyio.run(reopen)
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".asyncsave-tmp")]
    asyncsave.verify(final)
