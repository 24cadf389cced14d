"""The root's commit protocol, chosen once from the root: on a POSIX root a save
is published by renaming its temporary directory (the final name is the commit,
and a committed step may be overwritten by an atomic exchange); on an object
store it is written in place and committed by a marker written last (no rename,
so no overwrite). Checked through saves on a local root and on a ``memory://``
root, whose fsspec layer behaves as an object store; the same behaviour on S3 is
in test_objstore.py, adoption in test_adopt.py, overwrites in test_update.py.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import fsspec
import pytest
import torch

import asyncsave
from asyncsave.testing import checkpoint_dir_name, leftover_temp_names, tracker_file_name

MARKER = "commit_success.txt"  # the object-store commit point
TRACKER = tracker_file_name("asyncsave")
assert TRACKER is not None


class Root:
    """A root of one kind, with what a test reads of it."""

    def __init__(self, kind: str, url: Any, local: Path | None) -> None:
        self.kind, self.url, self.local = kind, url, local
        self.mem = fsspec.filesystem("memory")

    @property
    def renames(self) -> bool:
        return self.kind == "local"

    def path(self, *parts: str) -> str:
        return "/".join([str(self.url).removeprefix("memory://"), *parts])

    def names(self) -> list[str]:
        if self.local is not None:
            return sorted(p.name for p in self.local.iterdir() if p.name != ".asyncsave.lock")
        return sorted(
            p.rsplit("/", 1)[-1]
            for p in self.mem.ls(self.path(), detail=False)
            if not p.endswith(".asyncsave.lock")
        )

    def exists(self, *parts: str) -> bool:
        if self.local is not None:
            return self.local.joinpath(*parts).exists()
        return bool(self.mem.exists(self.path(*parts)))

    def read(self, *parts: str) -> bytes:
        if self.local is not None:
            return self.local.joinpath(*parts).read_bytes()
        return bytes(self.mem.cat_file(self.path(*parts)))

    def remove(self, *parts: str) -> None:
        if self.local is not None:
            self.local.joinpath(*parts).unlink()
        else:
            self.mem.rm_file(self.path(*parts))


@pytest.fixture(params=["local", "memory"])
def root(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Root]:
    if request.param == "local":
        yield Root("local", tmp_path, tmp_path)
        return
    name = f"/atomicity-{uuid.uuid4().hex}"
    try:
        yield Root("memory", f"memory://{name}", None)
    finally:
        mem = fsspec.filesystem("memory")
        if mem.exists(name):
            mem.rm(name, recursive=True)


def state(value: float) -> dict[str, Any]:
    return {"w": torch.full((8,), value), "step": value}


def save(root: Root, *steps: int, overwrite: bool = False) -> None:
    async def go() -> None:
        async with asyncsave.Checkpointer(root.url, save_step_zero=True) as ckpt:
            for step in steps:
                await (await ckpt.save(step, state(float(step)), overwrite=overwrite))

    anyio.run(go)


def test_the_protocol_is_chosen_from_the_storage(root: Root) -> None:
    """A local root publishes by rename (no marker, no temporary name left); an
    object store commits in place with a marker; both keep a tracker."""
    save(root, 1)
    final = checkpoint_dir_name("asyncsave", 1)
    assert root.exists(final, "manifest.json")
    assert root.exists(final, MARKER) == (not root.renames)
    assert root.read(TRACKER) == b"1"
    if root.local is not None:
        assert leftover_temp_names(root.local) == []


@pytest.mark.parametrize("step", [0, 7, 2**40])
def test_a_published_save_is_committed_and_nothing_else_is(root: Root, step: int) -> None:
    save(root, step)
    final = checkpoint_dir_name("asyncsave", step)
    info = asyncsave.verify(f"{root.url}/{final}")
    assert info.step == step
    assert [i.step for i in asyncsave.checkpoints(root.url)] == [step]
    assert root.names() == sorted([final, TRACKER])  # no temporary name left


def test_a_final_name_without_its_commit_point_is_adopted_by_the_protocol(root: Root) -> None:
    """Under a final name without a marker: committed on a POSIX root (the name
    is the commit), uncommitted on an object store until adopted."""
    save(root, 3)
    final = f"{root.url}/{checkpoint_dir_name('asyncsave', 3)}"
    if not root.renames:
        root.remove(checkpoint_dir_name("asyncsave", 3), MARKER)
        with pytest.raises(asyncsave.UncommittedCheckpointError):
            asyncsave.load(final)
    assert asyncsave.adopt(final).step == 3
    assert asyncsave.load(final)["step"] == 3.0
    assert asyncsave.adopt(final).step == 3  # idempotent
    assert root.exists(checkpoint_dir_name("asyncsave", 3), MARKER) == (not root.renames)


def test_an_overwrite_the_protocol_cannot_make_is_refused_naming_the_step(root: Root) -> None:
    save(root, 5)
    final = checkpoint_dir_name("asyncsave", 5)
    before = root.read(final, "manifest.json")
    if root.renames:
        save(root, 5, overwrite=True)  # an atomic exchange
        assert root.read(final, "manifest.json") != before
        assert asyncsave.verify(f"{root.url}/{final}").step == 5
        return
    with pytest.raises(asyncsave.CheckpointError, match="cannot overwrite") as info:
        save(root, 5, overwrite=True)
    named = str(info.value.path)
    assert info.value.step == 5 and named.startswith("memory://"), named
    assert named.endswith(f"{root.path().strip('/')}/{final}"), named
    assert root.read(final, "manifest.json") == before  # nothing written before the refusal


@pytest.mark.parametrize("steps", [(1, 17), (2, 2**63 - 1)])
def test_the_tracker_is_replaced_whole(root: Root, steps: tuple[int, ...]) -> None:
    save(root, *steps)
    assert root.read(TRACKER) == str(steps[-1]).encode()
    assert [n for n in root.names() if TRACKER in n] == [TRACKER]  # no temporary file left
