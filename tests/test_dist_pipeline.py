"""One pipeline on N ranks (issue 11): the divergences of the old multi-rank copy.

- no clean-up of the temporary directory under a commit thread abandoned at the
  deadline, on any rank;
- a step committed by rank 0 is reported as committed on every rank, whatever
  fails after the rename (the tracker, rank 0 itself dying);
- a rank that dies is named in ``RankFailedError.ranks`` on the survivors (its
  heartbeat through the store stopped), and they raise long before
  ``dist_timeout_s`` (the harness deadline is shorter than it).

Every test forks 2 gloo ranks (``tests/distributed.py``).
"""

from __future__ import annotations

import errno
import os
import signal
import sys
import threading
from pathlib import Path
from typing import Any

import anyio
import pytest
import torch

import asyncsave
from asyncsave import LocalFileSystem

sys.path.insert(0, str(Path(__file__).parent))
from distributed import run_ranks, values

pytestmark = pytest.mark.slow

TRACKER = "latest_checkpointed_iteration.txt"


def state_of(rank: int, step: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(1000 * rank + step)
    return {"w": torch.randn(256, generator=g), "trainer": {"step": step, "rank": rank}}


def _temp_dirs(root: str, step: int) -> list[str]:
    return [p for p in os.listdir(root) if p.startswith(f".asyncsave-tmp-{step}-")]


class _HeldRename(LocalFileSystem):
    """Rank 0's rename of step 2 into place waits until ``release`` is set."""

    def __init__(self) -> None:
        super().__init__()
        self.release = threading.Event()
        self.entered = threading.Event()

    def rename(self, src: Path, dst: Path) -> None:
        if dst.name == "step_2":
            self.entered.set()
            self.release.wait(120)
        super().rename(src, dst)


def _commit_outlives_the_deadline(rank: int, world: int, root: str) -> dict[str, Any]:
    fs = _HeldRename() if rank == 0 else LocalFileSystem()
    seen: dict[str, Any] = {}

    async def main() -> None:
        ckpt = asyncsave.Checkpointer(root, filesystem=fs, save_timeout_s=8, dist_timeout_s=60)
        try:
            async with ckpt:
                await (await ckpt.save(1, state_of(rank, 1)))
                h2 = await ckpt.save(2, state_of(rank, 2))
                try:
                    await h2
                except asyncsave.SaveFailedError as exc:
                    seen["error"] = type(exc).__name__
        except asyncsave.SaveFailedError:
            pass  # close raises the failure again, once every pipeline has ended
        # The deadline passed while rank 0's commit thread may still rename, and
        # every pipeline's clean-up is over (closed): the temporary directory
        # must still be there.
        seen["temp_left"] = len(_temp_dirs(root, 2))
        if isinstance(fs, _HeldRename):
            seen["rename_entered"] = fs.entered.is_set()
            fs.release.set()  # the abandoned thread renames now
            with anyio.fail_after(60):
                while not (Path(root) / "step_2").exists():
                    await anyio.sleep(0.05)

    anyio.run(main)
    return seen


def test_no_rank_removes_the_temp_dir_under_an_abandoned_commit(tmp_path: Path) -> None:
    root = tmp_path / "run"
    r0, r1 = values(run_ranks(_commit_outlives_the_deadline, 2, tmp_path, str(root)))
    assert r0["rename_entered"] and r0["error"] == "CheckpointTimeoutError"
    assert r1["error"] == "CheckpointTimeoutError"
    assert r0["temp_left"] == 1
    # The late rename completed a whole checkpoint: every byte verifies.
    assert asyncsave.verify(root / "step_2").world_size == 2
    whole = asyncsave.load(root / "step_2")
    assert torch.equal(whole[1]["w"], state_of(1, 2)["w"])


class _TrackerFails(LocalFileSystem):
    """Rank 0: ENOSPC when the tracker is replaced after step 1's."""

    def __init__(self) -> None:
        super().__init__()
        self.replaced = 0

    def replace(self, src: Path, dst: Path) -> None:
        if dst.name == TRACKER:
            self.replaced += 1
            if self.replaced > 1:
                raise OSError(errno.ENOSPC, "No space left on device (injected)", str(dst))
        super().replace(src, dst)


def _tracker_fails(rank: int, world: int, root: str) -> dict[str, Any]:
    fs = _TrackerFails() if rank == 0 else LocalFileSystem()
    seen: dict[str, Any] = {}

    async def main() -> None:
        try:
            async with asyncsave.Checkpointer(root, filesystem=fs, dist_timeout_s=60) as ckpt:
                await (await ckpt.save(1, state_of(rank, 1)))
                try:
                    await (await ckpt.save(2, state_of(rank, 2)))
                except asyncsave.SaveFailedError as exc:
                    seen["error"] = (type(exc).__name__, str(exc))
        except asyncsave.SaveFailedError:
            pass
        async with asyncsave.Checkpointer(root, dist_timeout_s=60) as ckpt:
            restored = await ckpt.load_latest()
            assert restored is not None
            seen["resumed"] = restored.info.step
            seen["own"] = torch.equal(restored.state["w"], state_of(rank, 2)["w"])

    anyio.run(main)
    return seen


def test_a_tracker_failure_after_the_rename_is_committed_on_every_rank(tmp_path: Path) -> None:
    root = tmp_path / "run"
    for s in values(run_ranks(_tracker_fails, 2, tmp_path, str(root))):
        name, text = s["error"]
        # Not "rank 0 could not commit": it did, on every rank's report.
        assert name == "SaveFailedError" and "step 2 was committed" in text
        assert "No space left" in text
        assert s["resumed"] == 2 and s["own"]


class _Dies(LocalFileSystem):
    """SIGKILL this rank at one I/O call of step 2 (``where``)."""

    def __init__(self, where: str) -> None:
        super().__init__()
        self.where = where

    def _die(self) -> None:
        os.kill(os.getpid(), signal.SIGKILL)

    def write(self, fd: int, data: memoryview) -> int:
        if self.where == "data" and ".asyncsave-tmp-2-" in os.readlink(f"/proc/self/fd/{fd}"):
            self._die()
        return super().write(fd, data)

    def create(self, path: Path) -> int:
        if self.where == "manifest" and path.name == "manifest.json" and "-tmp-2-" in str(path):
            self._die()
        return super().create(path)

    def fsync_dir(self, path: Path) -> None:
        if self.where == "renamed" and (path / "step_2").exists():
            self._die()  # step 2 is in place; its tracker is never written
        super().fsync_dir(path)


def _dies_at(rank: int, world: int, root: str, victim: int, where: str) -> dict[str, Any]:
    fs: LocalFileSystem = _Dies(where) if rank == victim else LocalFileSystem()
    seen: dict[str, Any] = {}

    async def main() -> None:
        # dist_timeout_s far beyond the harness deadline: only the heartbeat
        # through the store can end the survivor's wait in time.
        ckpt = asyncsave.Checkpointer(root, filesystem=fs, dist_timeout_s=600)
        try:
            async with ckpt:
                await (await ckpt.save(1, state_of(rank, 1)))
                try:
                    await (await ckpt.save(2, state_of(rank, 2)))
                except asyncsave.SaveFailedError as exc:
                    seen["error"] = (type(exc).__name__, dict(getattr(exc, "ranks", {})), str(exc))
        except asyncsave.SaveFailedError:
            pass

    anyio.run(main)
    return seen


def _resume(rank: int, world: int, root: str) -> int:
    async def main() -> int:
        async with asyncsave.Checkpointer(root) as ckpt:
            restored = await ckpt.load_latest()
            assert restored is not None
            assert torch.equal(restored.state["w"], state_of(rank, restored.info.step)["w"])
            return restored.info.step

    return anyio.run(main)


@pytest.mark.parametrize(
    ("victim", "where", "committed"),
    [(1, "data", False), (0, "data", False), (0, "manifest", False), (0, "renamed", True)],
)
def test_a_dead_rank_is_named_on_the_survivor_before_dist_timeout(
    tmp_path: Path, victim: int, where: str, committed: bool
) -> None:
    root = tmp_path / "run"
    results = run_ranks(_dies_at, 2, tmp_path, str(root), victim, where, timeout_s=90)
    assert results[victim] == ("exit", -signal.SIGKILL)
    (survivor,) = values({1 - victim: results[1 - victim]})
    name, ranks, text = survivor["error"]
    if committed:
        # Rank 0 died after the rename: the survivor says the step is committed.
        assert name == "SaveFailedError" and "step 2 was committed" in text
        assert "rank 0 died" in text
    else:
        assert name == "RankFailedError"
        assert list(ranks) == [victim] and f"rank {victim} died" in ranks[victim]
    # A fresh run resumes from the last committed step, on 2 ranks and on 1.
    expected = 2 if committed else 1
    assert values(run_ranks(_resume, 2, tmp_path, str(root))) == [expected, expected]
    assert asyncsave.latest(root).step == expected  # type: ignore[union-attr]
    assert _temp_dirs(str(root), 2) == []
