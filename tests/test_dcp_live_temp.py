"""A standalone DCP writer and a Checkpointer on one root (issue 10, S20 kind).

The writer does not hold the root's lock while it writes, so a ``Checkpointer``
opened meanwhile (an eval job, a restart) runs recovery over the root while the
writer's temporary directory is in use. Recovery must leave a directory a live
writer holds (``flock`` on the directory) and still remove a crashed writer's.
Also: a failure after the commit's rename is reported as committed, typed.
"""

from __future__ import annotations

import errno
import multiprocessing as mp
import os
import sys
from pathlib import Path
from typing import Any

import anyio
import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

import asyncsave
from asyncsave import LocalFileSystem
from asyncsave.dcp import StorageReader, StorageWriter

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")

WAIT_S = 60.0  # bound of every wait here (never reached when the tests pass)
TMP = ".asyncsave-tmp-"


def leftovers(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir() if p.name.startswith(TMP))


def state_of(step: int) -> dict[str, Any]:
    return {"w": torch.full((8,), float(step)), "meta": {"step": step}}


def assert_committed(root: Path, step: int, *, empty: bool = False) -> None:
    out: dict[str, Any] = {} if empty else {"w": torch.zeros(8), "meta": {"step": -1}}
    dcp.load(out, storage_reader=StorageReader(root / f"step_{step}"), no_dist=True)
    if not empty:
        assert out["meta"]["step"] == step and torch.equal(out["w"], state_of(step)["w"])
    assert (root / "latest_checkpointed_iteration.txt").read_text().strip() == str(step)
    assert leftovers(root) == []


def _matches(path: Path, at: str) -> bool:
    return path.name.startswith(at) if at == "data-" else path.name == at


class OpenMidSave(LocalFileSystem):
    """Opens (and closes) a Checkpointer on ``root`` when the writer creates the
    file ``at``: the writer's temporary directory exists and is in use then."""

    def __init__(self, root: Path, at: str, backend: str) -> None:
        self.root, self.at, self.backend = root, at, backend
        self.seen: list[list[str]] = []

    def _open(self) -> None:
        before = leftovers(self.root)

        async def open_close() -> None:
            # distributed=False: a lone process (an eval job), also on a rank.
            async with asyncsave.Checkpointer(self.root, distributed=False):
                pass

        anyio.run(open_close, backend=self.backend)
        self.seen = [before, leftovers(self.root)]

    def create(self, path: Path) -> int:
        if not self.seen and _matches(path, self.at):
            self._open()
        return super().create(path)

    def mkdir(self, path: Path) -> None:
        super().mkdir(path)
        if not self.seen and self.at == "mkdir" and path.name.startswith(TMP):
            self._open()  # before the writer could lock it: recovery removes it


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
@pytest.mark.parametrize(
    "at",
    [
        "data-",  # write_data: the data file is being written
        ".metadata",  # finish begins (the reviewer's)
        "manifest.json",  # finish, just before the commit
        "empty",  # a rank with no items: finish makes its directory
        "mkdir",  # between the directory's creation and its lock
    ],
)
def test_a_checkpointer_opened_mid_save_leaves_the_writers_directory(
    tmp_path: Path, at: str, backend: str
) -> None:
    fs = OpenMidSave(tmp_path, ".metadata" if at == "empty" else at, backend)
    state: dict[str, Any] = {} if at == "empty" else state_of(4)
    dcp.save(state, storage_writer=StorageWriter(tmp_path, 4, filesystem=fs), no_dist=True)
    assert fs.seen, "the Checkpointer was never opened"
    before, after = fs.seen
    if at == "mkdir":
        # Created but not locked yet: recovery removed it, the writer made another.
        assert len(before) == 1 and after == []
    else:
        assert len(before) == 1 and after == before  # the live writer's directory stayed
    assert_committed(tmp_path, 4, empty=at == "empty")


def test_recovery_still_removes_leftovers_next_to_a_live_writers_directory(tmp_path: Path) -> None:
    """A crashed save's directory (nobody holds it) goes; the live one stays."""
    dcp.save(state_of(1), storage_writer=StorageWriter(tmp_path, 1), no_dist=True)
    stale = tmp_path / f"{TMP}3-crashed"
    stale.mkdir()
    (stale / "data-r0-000.safetensors").write_bytes(b"partial")
    fs = OpenMidSave(tmp_path, ".metadata", "asyncio")
    dcp.save(state_of(2), storage_writer=StorageWriter(tmp_path, 2, filesystem=fs), no_dist=True)
    before, after = fs.seen
    assert stale.name in before and stale.name not in after and len(after) == 1
    assert_committed(tmp_path, 2)


# -- a second process ---------------------------------------------------------------


class _PauseAt(LocalFileSystem):
    def __init__(self, arrived: Any, gate: Any, crash: bool) -> None:
        self.arrived, self.gate, self.crash = arrived, gate, crash

    def create(self, path: Path) -> int:
        if path.name == ".metadata":
            self.arrived.set()
            if self.crash:
                os._exit(3)  # the writer dies with its directory in place
            if not self.gate.wait(WAIT_S):
                raise TimeoutError("the test never opened the gate")
        return super().create(path)


def _save_in_child(root: str, arrived: Any, gate: Any, crash: bool) -> None:
    fs = _PauseAt(arrived, gate, crash)
    dcp.save(state_of(5), storage_writer=StorageWriter(root, 5, filesystem=fs), no_dist=True)


@pytest.mark.parametrize("crash", [False, True])
def test_a_checkpointer_in_another_process_than_the_writer(tmp_path: Path, crash: bool) -> None:
    """A live writer in another process keeps its directory across a Checkpointer
    open; a writer that died there (its lock gone with it) has it removed."""
    ctx = mp.get_context("spawn")
    arrived, gate = ctx.Event(), ctx.Event()
    child = ctx.Process(target=_save_in_child, args=(str(tmp_path), arrived, gate, crash))
    child.start()
    try:
        assert arrived.wait(WAIT_S), "the writer never reached finish"
        if crash:
            child.join(WAIT_S)
        assert len(leftovers(tmp_path)) == 1
        with asyncsave.SyncCheckpointer(tmp_path):
            assert len(leftovers(tmp_path)) == (0 if crash else 1)
    finally:
        gate.set()
        child.join(WAIT_S)
        if child.is_alive():
            child.kill()
            child.join(5)
    if crash:
        assert child.exitcode == 3 and leftovers(tmp_path) == []
        assert not (tmp_path / "step_5").exists()
    else:
        assert child.exitcode == 0
        assert_committed(tmp_path, 5)


# -- a failure after the rename ------------------------------------------------------


class _FsyncFails(LocalFileSystem):
    """``fsync`` of the root after the rename (``after``) or of the temporary
    directory before it fails with EIO."""

    def __init__(self, root: Path, after: bool) -> None:
        self.root, self.after, self.renamed = root, after, False

    def rename(self, src: Path, dst: Path) -> None:
        super().rename(src, dst)
        if dst.name.startswith("step_"):
            self.renamed = True

    def fsync_dir(self, path: Path) -> None:
        if self.after and self.renamed and path == self.root:
            raise OSError(errno.EIO, "Input/output error (injected)", str(path))
        if not self.after and path.name.startswith(TMP):
            raise OSError(errno.EIO, "Input/output error (injected)", str(path))
        super().fsync_dir(path)


def _cause(info: pytest.ExceptionInfo[CheckpointException]) -> BaseException:
    (failure,) = info.value.failures.values()
    return failure[0] if isinstance(failure, tuple) else failure


def test_a_failed_fsync_after_the_rename_says_the_step_is_committed(tmp_path: Path) -> None:
    dcp.save(state_of(1), storage_writer=StorageWriter(tmp_path, 1), no_dist=True)
    fs = _FsyncFails(tmp_path, after=True)
    with pytest.raises(CheckpointException) as info:
        dcp.save(
            state_of(2), storage_writer=StorageWriter(tmp_path, 2, filesystem=fs), no_dist=True
        )
    err = _cause(info)
    assert isinstance(err, asyncsave.CheckpointError), repr(err)
    assert "is committed" in str(err) and err.step == 2
    assert isinstance(err.__cause__, OSError)
    assert leftovers(tmp_path) == []
    out = {"w": torch.zeros(8), "meta": {"step": -1}}
    dcp.load(out, storage_reader=StorageReader(tmp_path / "step_2"), no_dist=True)
    assert out["meta"]["step"] == 2
    with asyncsave.SyncCheckpointer(tmp_path):  # the next open moves the tracker
        pass
    assert_committed(tmp_path, 2)


def test_a_failed_fsync_before_the_rename_commits_nothing(tmp_path: Path) -> None:
    dcp.save(state_of(1), storage_writer=StorageWriter(tmp_path, 1), no_dist=True)
    fs = _FsyncFails(tmp_path, after=False)
    with pytest.raises(CheckpointException, match="Input/output error") as info:
        dcp.save(
            state_of(2), storage_writer=StorageWriter(tmp_path, 2, filesystem=fs), no_dist=True
        )
    assert "is committed" not in str(_cause(info))
    assert not (tmp_path / "step_2").exists()
    assert_committed(tmp_path, 1)


# -- two ranks: the other rank's directory -----------------------------------------


def _two_ranks_open_mid_save(rank: int, world: int, root: str) -> list[list[str]]:
    """Rank 0 opens a Checkpointer when its ``finish`` begins: rank 1's
    ``write_data`` has returned by then (DCP gathered its results), and rank 1's
    directory must still be there for ``finish`` to move its files."""
    fs = OpenMidSave(Path(root), ".metadata", "asyncio") if rank == 0 else LocalFileSystem()
    for step in (1, 2):  # the second save releases rank 1's first lock
        state = {f"w{rank}": torch.full((4,), float(10 * step + rank))}
        dcp.save(state, storage_writer=StorageWriter(root, step, filesystem=fs))
    return fs.seen if isinstance(fs, OpenMidSave) else []


@pytest.mark.slow
def test_a_checkpointer_opened_mid_save_leaves_every_ranks_directory(tmp_path: Path) -> None:
    sys.path.insert(0, str(Path(__file__).parent))
    from distributed import run_ranks, values

    root = tmp_path / "run"
    seen, _ = values(run_ranks(_two_ranks_open_mid_save, 2, tmp_path, str(root)))
    before, after = seen
    assert len(before) == 2 and after == before  # both ranks' directories stayed
    for step in (1, 2):
        out = {"w0": torch.zeros(4), "w1": torch.zeros(4)}
        dcp.load(out, storage_reader=StorageReader(root / f"step_{step}"), no_dist=True)
        assert torch.equal(out["w0"], torch.full((4,), 10.0 * step))
        assert torch.equal(out["w1"], torch.full((4,), 10.0 * step + 1))
    assert leftovers(root) == []
