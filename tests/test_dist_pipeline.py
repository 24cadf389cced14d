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
import json
import os
import shutil
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
from distributed import HEARTBEAT_WINDOW_S, run_ranks, values

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
        # the harness's window (asyncsave.testing.thresholds), not the 10 s default
        assert f"no heartbeat through the store for {HEARTBEAT_WINDOW_S:g} s" in ranks[victim]
    # A fresh run resumes from the last committed step, on 2 ranks and on 1.
    expected = 2 if committed else 1
    assert values(run_ranks(_resume, 2, tmp_path, str(root))) == [expected, expected]
    assert asyncsave.latest(root).step == expected  # type: ignore[union-attr]
    assert _temp_dirs(str(root), 2) == []


# -- item 2: everything a single process has, on N ranks ------------------------------


def _lazy_saves(rank: int, world: int, root: str, backend: str) -> dict[str, Any]:
    seen: dict[str, Any] = {}

    async def main() -> None:
        async with asyncsave.Checkpointer(root, dist_timeout_s=60) as ckpt:
            state = state_of(rank, 1)
            before = state["w"].clone()
            handle = await ckpt.save(1, state, lazy=True)
            # Lazy: save() returned before the snapshot (nothing yielded since).
            seen["staged_at_return"] = handle.is_staged()
            await ckpt.staged()
            state["w"].add_(1000)  # after staged(): not in step 1
            info = await handle
            seen["world"] = info.world_size if info else None
            restored = await ckpt.load_latest()
            assert restored is not None
            seen["saved_before"] = torch.equal(restored.state["w"], before)

    anyio.run(main, backend=backend)
    return seen


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_lazy_saves_on_two_ranks(tmp_path: Path, backend: str) -> None:
    root = tmp_path / "run"
    for s in values(run_ranks(_lazy_saves, 2, tmp_path, str(root), backend)):
        assert s == {"staged_at_return": False, "world": 2, "saved_before": True}


def _stage_before_step(rank: int, world: int, root: str) -> dict[str, Any]:
    torch.manual_seed(rank)
    model = torch.nn.Linear(64, 64)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    seen: dict[str, Any] = {}
    with asyncsave.SyncCheckpointer(root, dist_timeout_s=60) as ckpt:
        hook = asyncsave.stage_before_step(opt, ckpt)
        try:
            model(torch.randn(8, 64)).square().sum().backward()
            before = model.weight.detach().clone()
            handle = ckpt.save(1, {"model": model.state_dict()}, lazy=True)
            opt.step()  # the hook waits until the save is staged, then steps
            assert not torch.equal(model.weight, before)
            handle.result()
        finally:
            hook.remove()
        restored = ckpt.load_latest()
        assert restored is not None
        seen["saved_before_step"] = torch.equal(restored.state["model"]["weight"], before)
    return seen


def test_stage_before_step_on_two_ranks(tmp_path: Path) -> None:
    root = tmp_path / "run"
    assert (
        values(run_ranks(_stage_before_step, 2, tmp_path, str(root)))
        == [{"saved_before_step": True}] * 2
    )


def _lazy_dtensor(rank: int, world: int, root: str) -> dict[str, Any]:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from asyncsave.dcp import StorageReader

    mesh = init_device_mesh("cpu", (world,))
    full = torch.arange(256.0 * 64).reshape(256, 64)
    state = {"w": distribute_tensor(full, mesh, [Shard(0)]), "step": 3}
    seen: dict[str, Any] = {}

    async def main() -> None:
        async with asyncsave.Checkpointer(root, dist_timeout_s=60) as ckpt:
            handle = await ckpt.save(3, state, lazy=True)
            seen["staged_at_return"] = handle.is_staged()
            await handle.staged()
            state["w"].to_local().add_(1000)
            state["step"] = 99
            await handle

    anyio.run(main)
    out = {"w": distribute_tensor(torch.zeros(256, 64), mesh, [Shard(0)]), "step": 0}
    dcp.load(out, storage_reader=StorageReader(root))
    seen["loaded"] = torch.equal(out["w"].full_tensor(), full) and out["step"] == 3
    return seen


def test_lazy_dtensor_save_on_two_ranks(tmp_path: Path) -> None:
    root = tmp_path / "run"
    for s in values(run_ranks(_lazy_dtensor, 2, tmp_path, str(root))):
        assert s == {"staged_at_return": False, "loaded": True}


class _RoundFails(LocalFileSystem):
    """ENOSPC on the third data write of step 2 (a streamed round of save())."""

    def __init__(self) -> None:
        super().__init__()
        self.writes = 0

    def write(self, fd: int, data: memoryview) -> int:
        if "-tmp-2-" in os.readlink(f"/proc/self/fd/{fd}"):
            self.writes += 1
            if self.writes == 3:
                raise OSError(errno.ENOSPC, "No space left on device (injected)")
        return super().write(fd, data)


def big_state(rank: int, step: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(100 * rank + step)
    return {
        "big": torch.randn(300_000, generator=g),  # 1.2 MB: several rounds
        "half": torch.randn(1000, generator=g).half(),
        "trainer": {"step": step},
    }


def _streamed(rank: int, world: int, root: str, fail_rank: int) -> dict[str, Any]:
    fs: LocalFileSystem = _RoundFails() if rank == fail_rank else LocalFileSystem()
    seen: dict[str, Any] = {}

    async def main() -> None:
        try:
            async with asyncsave.Checkpointer(
                root, filesystem=fs, budget_bytes=256 << 10, dist_timeout_s=60
            ) as ckpt:
                s1 = big_state(rank, 1)
                h1 = await ckpt.save(1, s1)
                s1["big"].zero_()  # after save() returned: not in step 1 (S11)
                await h1
                seen["arena"] = ckpt.staging_pool.capacity  # type: ignore[union-attr]
                try:
                    await (await ckpt.save(2, big_state(rank, 2)))
                except asyncsave.SaveFailedError as exc:
                    seen["error"] = (type(exc).__name__, dict(getattr(exc, "ranks", {})))
        except asyncsave.SaveFailedError:
            pass
        async with asyncsave.Checkpointer(root, dist_timeout_s=60) as ckpt:
            restored = await ckpt.load_latest()
            assert restored is not None
            seen["resumed"] = restored.info.step
            want = big_state(rank, 1)
            seen["exact"] = all(torch.equal(restored.state[k], want[k]) for k in ("big", "half"))

    anyio.run(main)
    return seen


def test_a_state_larger_than_the_budget_streams_on_two_ranks(tmp_path: Path) -> None:
    root = tmp_path / "run"
    r0, r1 = values(run_ranks(_streamed, 2, tmp_path, str(root), 1))
    for s in (r0, r1):
        assert s["arena"] == 256 << 10 and s["resumed"] == 1 and s["exact"]
    # Rank 1's round failed inside its save(): it raises its own error, rank 0
    # names it; nothing of step 2 is left, not even rank 1's own directory.
    assert r1["error"][0] == "SaveFailedError"
    assert r0["error"] == ("RankFailedError", {1: r0["error"][1][1]})
    assert "No space left" in r0["error"][1][1]
    assert not (root / "step_2").exists() and _temp_dirs(str(root), 2) == []
    assert asyncsave.verify(root / "step_1").world_size == 2


def _marker_fs(kill: str | None = None) -> Any:
    """fsspec's local file system behind asyncsave's object-store layer: commit by
    marker (no rename), on a directory the forked ranks share. ``kill``: SIGKILL
    this rank when it creates a file of step 3 whose name contains it."""
    import fsspec

    from asyncsave import FsspecFileSystem

    class Killing(FsspecFileSystem):
        def create(self, path: Path) -> int:
            if kill is not None and "/step_3/" in str(path) and kill in str(path):
                os.kill(os.getpid(), signal.SIGKILL)
            return super().create(path)

    return Killing(fsspec.filesystem("file", auto_mkdir=True))


def _object_store(rank: int, world: int, root: str, victim: int, kill: str) -> dict[str, Any]:
    seen: dict[str, Any] = {}

    async def main() -> None:
        fs = _marker_fs(kill if rank == victim else None)
        try:
            async with asyncsave.Checkpointer(root, filesystem=fs, dist_timeout_s=600) as ckpt:
                for step in (1, 2):
                    info = await (await ckpt.save(step, state_of(rank, step)))
                    assert info is not None and info.world_size == 2
                seen["marker"] = (Path(root) / "step_2" / "commit_success.txt").exists()
                try:
                    await (await ckpt.save(3, state_of(rank, 3)))
                except asyncsave.SaveFailedError as exc:
                    seen["error"] = (type(exc).__name__, sorted(getattr(exc, "ranks", {})))
        except asyncsave.SaveFailedError:
            pass

    anyio.run(main)
    return seen


def _resume_marker(rank: int, world: int, root: str) -> int:
    async def main() -> int:
        async with asyncsave.Checkpointer(root, filesystem=_marker_fs()) as ckpt:
            restored = await ckpt.load_latest()
            assert restored is not None
            assert torch.equal(restored.state["w"], state_of(rank, restored.info.step)["w"])
            return restored.info.step

    return anyio.run(main)


@pytest.mark.parametrize(
    ("victim", "kill"),
    [(1, "data-r00001"), (0, "data-r00000"), (0, "manifest.json"), (0, "commit_success")],
)
def test_object_store_root_on_two_ranks(tmp_path: Path, victim: int, kill: str) -> None:
    """Every rank uploads its files under the final prefix; rank 0 writes the
    manifest, then the commit marker last. Whatever rank dies before the marker,
    the prefix is not a checkpoint for a reader, and the survivor names the dead
    rank. A fresh run on 2 ranks never deletes it: it resumes from step 2 with the
    partial prefix moved aside, or, when only the marker was missing (every
    rank's files and the manifest whole), adopts step 3 after a full verify."""
    root = tmp_path / "run"
    results = run_ranks(_object_store, 2, tmp_path, str(root), victim, kill, timeout_s=90)
    assert results[victim] == ("exit", -signal.SIGKILL)
    (survivor,) = values({1 - victim: results[1 - victim]})
    assert survivor["marker"] and survivor["error"] == ("RankFailedError", [victim])
    assert not (root / "step_3" / "commit_success.txt").exists()
    # A reader on the object-store layer does not take the prefix for a checkpoint.
    assert asyncsave.latest(root, filesystem=_marker_fs()).step == 2  # type: ignore[union-attr]
    whole = kill == "commit_success"
    expect = 3 if whole else 2
    left = {p.name: p.read_bytes() for p in (root / "step_3").glob("*")}
    assert values(run_ranks(_resume_marker, 2, tmp_path, str(root))) == [expect, expect]
    if whole:
        assert (root / "step_3" / "commit_success.txt").exists()
    else:  # what the dead save left is moved aside, its bytes kept
        assert not (root / "step_3").exists()
        asides = list(root.glob(".asyncsave-incomplete-3-*"))
        assert len(asides) == (1 if left else 0)
        for aside in asides:
            assert {p.name: p.read_bytes() for p in aside.glob("*")} == left
    whole = asyncsave.load(root / "step_2")
    assert torch.equal(whole[1]["w"], state_of(1, 2)["w"])


def _update_and_more(rank: int, world: int, root: str) -> dict[str, Any]:
    seen: dict[str, Any] = {}

    async def main() -> None:
        async with asyncsave.Checkpointer(
            root, layout="nemo-rl", retention=asyncsave.KeepLast(2), dist_timeout_s=60
        ) as ckpt:
            for step in (1, 2, 3):
                info = await (
                    await ckpt.save(step, state_of(rank, step), training_info={"loss": 1.0 / step})
                )
                assert info is not None and info.training_info == {"loss": 1.0 / step}
            # overwrite: every rank's new files swapped in at once by rank 0
            new = state_of(rank, 30)
            await (await ckpt.save(3, new, overwrite=True, training_info={"loss": 0.25}))
            try:
                await ckpt.update(3, "trainer", {"step": -1})
            except asyncsave.CheckpointError as exc:
                seen["update"] = (type(exc).__name__, "several ranks" in str(exc))
        async with asyncsave.Checkpointer(root, layout="nemo-rl") as ckpt:
            restored = await ckpt.load_latest()
            assert restored is not None
            seen["resumed"] = restored.info.step
            seen["overwritten"] = torch.equal(restored.state["w"], new["w"])
            seen["info"] = restored.info.training_info

    anyio.run(main)
    return seen


def test_update_is_refused_and_overwrite_retention_training_info_work_on_two_ranks(
    tmp_path: Path,
) -> None:
    root = tmp_path / "run"
    for s in values(run_ranks(_update_and_more, 2, tmp_path, str(root))):
        assert s == {
            "update": ("CheckpointError", True),
            "resumed": 3,
            "overwritten": True,
            "info": {"loss": 0.25},
        }
    # nemo-rl: no tracker file; retention kept the last 2 (run by rank 0 only).
    assert sorted(p.name for p in root.iterdir() if not p.name.startswith(".")) == [
        "step_2",
        "step_3",
    ]
    assert json_of(root / "step_3" / "training_info.json") == {"loss": 0.25, "step": 3}


def json_of(path: Path) -> Any:
    return json.loads(path.read_text())


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _agreed_policies(rank: int, world: int, root: str, trigger: str) -> dict[str, Any]:
    seen: dict[str, Any] = {"saved": [], "stopped_at": None}
    clock = _Clock()
    inner: asyncsave.SavePolicy = asyncsave.SaveEvery(4) | asyncsave.SaveOnSignal(signal.SIGUSR1)
    if trigger == "deadline" and rank == 0:
        # Only rank 0 estimates that step 5 is the last one to fit before its deadline.
        inner = inner | asyncsave.SaveBeforeDeadline(60.0, expected_step_s=10.0, clock=clock)

    async def main() -> None:
        async with asyncsave.Checkpointer(root, dist_timeout_s=60) as ckpt:
            with ckpt.agree(inner) as policy:
                for step in range(1, 20):
                    clock.now += 10.0  # one step of training
                    if trigger == "signal" and rank == 1 and step == 6:
                        os.kill(os.getpid(), signal.SIGUSR1)  # reached one node only
                    if policy.should_save(step):
                        await ckpt.save(step, state_of(rank, step))
                        seen["saved"].append(step)
                    if policy.stop_requested:
                        seen["stopped_at"] = step
                        break
            await ckpt.wait()

    anyio.run(main)
    return seen


@pytest.mark.parametrize(("trigger", "last"), [("signal", 6), ("deadline", 5)])
def test_one_ranks_signal_or_deadline_makes_every_rank_save_the_same_step(
    tmp_path: Path, trigger: str, last: int
) -> None:
    root = tmp_path / "run"
    for s in values(run_ranks(_agreed_policies, 2, tmp_path, str(root), trigger)):
        assert s == {"saved": [4, last], "stopped_at": last}
    assert asyncsave.latest(root).step == last  # type: ignore[union-attr]
    assert asyncsave.verify(root / f"step_{last}").world_size == 2


def _different_steps_policy(rank: int, world: int, root: str) -> str:
    async def main() -> str:
        async with asyncsave.Checkpointer(root, dist_timeout_s=60) as ckpt:
            policy = ckpt.agree(asyncsave.SaveEvery(2))
            try:
                policy.should_save(3 + rank)
            except asyncsave.CheckpointError as exc:
                return str(exc)
            return "agreed"

    return anyio.run(main)


def test_ranks_asking_about_different_steps_get_a_typed_error(tmp_path: Path) -> None:
    for text in values(run_ranks(_different_steps_policy, 2, tmp_path, str(tmp_path / "r"))):
        assert "different steps ([3, 4])" in text


def _dies_in_should_save(rank: int, world: int, root: str, victim: int) -> dict[str, Any]:
    seen: dict[str, Any] = {}

    async def main() -> None:
        # dist_timeout_s far beyond the harness deadline: only the heartbeat
        # through the store can end the survivor's exchange in time.
        try:
            async with asyncsave.Checkpointer(root, dist_timeout_s=600) as ckpt:
                policy = ckpt.agree(asyncsave.SaveEvery(2))
                for step in (1, 2, 3):
                    if rank == victim and step == 3:
                        os.kill(os.getpid(), signal.SIGKILL)  # dies in the exchange
                    try:
                        if policy.should_save(step):
                            await (await ckpt.save(step, state_of(rank, step)))
                    except asyncsave.RankFailedError as exc:
                        seen["error"] = (dict(exc.ranks), exc.step, str(exc))
                        return
        except asyncsave.CheckpointError:
            pass

    anyio.run(main)
    return seen


@pytest.mark.parametrize("victim", [0, 1])
def test_a_rank_dead_in_should_save_is_named_on_the_survivor(tmp_path: Path, victim: int) -> None:
    root = tmp_path / "run"
    results = run_ranks(_dies_in_should_save, 2, tmp_path, str(root), victim, timeout_s=60)
    assert results[victim] == ("exit", -signal.SIGKILL)
    (survivor,) = values({1 - victim: results[1 - victim]})
    ranks, step, text = survivor["error"]
    assert list(ranks) == [victim] and f"rank {victim} died" in ranks[victim], text
    assert step == 3 and "save-policy" in text
    assert asyncsave.latest(root).step == 2  # type: ignore[union-attr]


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_an_agreed_policy_of_one_process_answers_as_its_policy(
    tmp_path: Path, backend: str
) -> None:
    async def main() -> list[tuple[bool, bool]]:
        async with asyncsave.Checkpointer(tmp_path / "run") as ckpt:
            on_signal = asyncsave.SaveOnSignal(signal.SIGUSR1)
            policy = ckpt.agree(asyncsave.SaveEvery(2) | on_signal)
            out = []
            for step in (1, 2, 3):
                if step == 3:
                    on_signal.trigger(signal.SIGUSR1)
                out.append((policy.should_save(step), policy.stop_requested))
            return out

    assert anyio.run(main, backend=backend) == [(False, False), (True, False), (True, True)]


def _four_ranks(rank: int, world: int, root: str) -> dict[str, Any]:
    fs = LocalFileSystem()
    seen: dict[str, Any] = {}

    class Enospc(LocalFileSystem):
        def create(self, path: Path) -> int:
            if "-tmp-3-" in str(path) and path.suffix == ".safetensors":
                raise OSError(errno.ENOSPC, "No space left on device (injected)", str(path))
            return super().create(path)

    if rank == 2:
        fs = Enospc()

    async def main() -> None:
        try:
            async with asyncsave.Checkpointer(
                root, filesystem=fs, budget_bytes=512, dist_timeout_s=60
            ) as ckpt:
                h1 = await ckpt.save(1, state_of(rank, 1), lazy=True)  # lazy and streamed
                h2 = await ckpt.save(2, state_of(rank, 2))
                seen["infos"] = [(i.step, i.world_size) for i in (await h1, await h2) if i]
                try:
                    await (await ckpt.save(3, state_of(rank, 3)))
                except asyncsave.SaveFailedError as exc:
                    seen["failed"] = (type(exc).__name__, sorted(getattr(exc, "ranks", {})))
        except asyncsave.SaveFailedError:
            pass
        async with asyncsave.Checkpointer(root, dist_timeout_s=60) as ckpt:
            restored = await ckpt.load_latest()
            assert restored is not None
            seen["resumed"] = restored.info.step
            seen["own"] = torch.equal(restored.state["w"], state_of(rank, 2)["w"])

    anyio.run(main)
    return seen


def test_four_ranks(tmp_path: Path) -> None:
    root = tmp_path / "run"
    for rank, s in enumerate(values(run_ranks(_four_ranks, 4, tmp_path, str(root), timeout_s=180))):
        # Rank 2's streamed round failed inside its save(): its own error there;
        # every other rank names it.
        failed = ("SaveFailedError", []) if rank == 2 else ("RankFailedError", [2])
        assert s == {"infos": [(1, 4), (2, 4)], "failed": failed, "resumed": 2, "own": True}
    assert asyncsave.verify(root / "step_2").world_size == 4
    assert _temp_dirs(str(root), 3) == []


def _dtensor_rank_dies(rank: int, world: int, root: str) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    state = {"w": distribute_tensor(torch.arange(4096.0).reshape(64, 64), mesh, [Shard(0)])}
    fs: LocalFileSystem = _Dies("data") if rank == 1 else LocalFileSystem()
    seen: dict[str, Any] = {}

    async def main() -> None:
        try:
            async with asyncsave.Checkpointer(root, filesystem=fs, dist_timeout_s=600) as ckpt:
                await (await ckpt.save(1, state))
                try:
                    await (await ckpt.save(2, state))
                except asyncsave.SaveFailedError as exc:
                    seen["error"] = (type(exc).__name__, dict(getattr(exc, "ranks", {})))
        except asyncsave.SaveFailedError:
            pass

    anyio.run(main)
    return seen


def test_a_rank_dying_inside_dcps_save_is_named(tmp_path: Path) -> None:
    """DTensor state: DCP's own collectives run on asyncsave's group, watched the
    same way; the survivor names the dead rank well before dist_timeout_s."""
    root = tmp_path / "run"
    results = run_ranks(_dtensor_rank_dies, 2, tmp_path, str(root), timeout_s=90)
    assert results[1] == ("exit", -signal.SIGKILL)
    (survivor,) = values({0: results[0]})
    name, ranks = survivor["error"]
    assert name == "RankFailedError" and list(ranks) == [1] and "died" in ranks[1]
    assert (root / TRACKER).read_text().strip() == "1"


# -- item 2: load_latest agreed by every rank --------------------------------------------


def _save_steps(rank: int, world: int, root: str) -> None:
    async def main() -> None:
        async with asyncsave.Checkpointer(root, dist_timeout_s=60) as ckpt:
            for step in (1, 2):
                await (await ckpt.save(step, state_of(rank, step)))

    anyio.run(main)


def _damage_rank_part(step_dir: Path, rank: int) -> None:
    """Flip one data byte of a file rank ``rank`` wrote: its checksum fails."""
    doc = json.loads((step_dir / "manifest.json").read_text())
    lo = doc["ranks"][rank]["entries"][0]
    entry = doc["entries"][lo]
    path = step_dir / doc["files"][entry["file"]]["name"]
    data = bytearray(path.read_bytes())
    data[entry["offset"]] ^= 0xFF
    path.write_bytes(bytes(data))


def _resume_agreed(rank: int, world: int, root: str, fallback: bool) -> Any:
    async def main() -> Any:
        async with asyncsave.Checkpointer(root, dist_timeout_s=60) as ckpt:
            try:
                restored = await ckpt.load_latest(fallback=fallback)
            except asyncsave.CheckpointError as exc:
                corrupt = isinstance(exc, asyncsave.CorruptCheckpointError)
                return ("error", corrupt, exc.rank, str(exc))
            assert restored is not None
            step = restored.info.step
            assert torch.equal(restored.state["w"], state_of(rank, step)["w"])
            # The damaged step is not "committed" any more: saved afresh.
            info = await (await ckpt.save(2, state_of(rank, 2)))
            return ("resumed", step, info.step if info else None)

    return anyio.run(main)


@pytest.mark.parametrize("damaged_rank", [0, 1])
def test_every_rank_falls_back_together_when_one_ranks_part_is_damaged(
    tmp_path: Path, damaged_rank: int
) -> None:
    root = tmp_path / "run"
    values(run_ranks(_save_steps, 2, tmp_path, str(root)))
    _damage_rank_part(root / "step_2", damaged_rank)
    # Without fallback: every rank raises, naming the damaged rank's part.
    for kind, corrupt, rank, text in values(
        run_ranks(_resume_agreed, 2, tmp_path, str(root), False)
    ):
        assert kind == "error" and corrupt, text
        assert rank == damaged_rank or f"rank(s) [{damaged_rank}]" in text, text
    assert (root / "step_2").is_dir()  # nothing moved without fallback
    # With fallback: every rank resumes step 1; rank 0 moved step 2 aside (bytes
    # kept), and step 2 is saved again.
    assert values(run_ranks(_resume_agreed, 2, tmp_path, str(root), True)) == [
        ("resumed", 1, 2),
        ("resumed", 1, 2),
    ]
    assert [p for p in os.listdir(root) if p.startswith(".asyncsave-damaged-2-")]
    assert asyncsave.verify(root / "step_2").world_size == 2
    assert asyncsave.latest(root).step == 2  # type: ignore[union-attr]


def _resume_from(rank: int, world: int, roots: list[str]) -> Any:
    async def main() -> Any:
        async with asyncsave.Checkpointer(roots[rank], dist_timeout_s=60) as ckpt:
            try:
                restored = await ckpt.load_latest()
            except asyncsave.CheckpointError as exc:
                return ("error", str(exc))
            return ("resumed", restored.info.step if restored else None)

    return anyio.run(main)


def test_ranks_that_find_different_checkpoints_get_a_typed_error(tmp_path: Path) -> None:
    """Storage the ranks do not share: rank 1's copy of the root lacks step 2, so
    the ranks would resume different steps; every rank raises instead."""
    root = tmp_path / "run"
    values(run_ranks(_save_steps, 2, tmp_path, str(root)))
    other = tmp_path / "copy"
    shutil.copytree(root, other)
    shutil.rmtree(other / "step_2")
    (other / TRACKER).write_text("1")
    for kind, text in values(run_ranks(_resume_from, 2, tmp_path, [str(root), str(other)])):
        assert kind == "error" and "different checkpoints" in text and "[1, 2]" in text, text
