"""Collective commit of several ranks on asyncsave's own gloo group.

Every test forks 2 ranks (torch imported once in the parent) joined through a gloo
``FileStore`` group; each rank runs a Checkpointer under anyio. Each test takes a
few seconds on 2 shared cores.
"""

from __future__ import annotations

import errno
import os
import signal
import sys
from pathlib import Path
from typing import Any

import anyio
import pytest
import torch
import torch.distributed as dist

import asyncsave
from asyncsave import LocalFileSystem, RankFailedError

sys.path.insert(0, str(Path(__file__).parent))
from distributed import resume_on_ranks, run_ranks, values

pytestmark = pytest.mark.slow

TRACKER = "latest_checkpointed_iteration.txt"


def state_of(rank: int, step: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(1000 * rank + step)
    return {
        "model": {"w": torch.randn(64, 32, generator=g), "b": torch.randn(32, generator=g)},
        "trainer": {"step": step, "rank": rank},
    }


def same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return a["trainer"] == b["trainer"] and all(
        torch.equal(a["model"][k], b["model"][k]) for k in b["model"]
    )


def _two_saves_between_barriers(rank: int, world: int, root: str, backend: str) -> dict[str, Any]:
    async def main() -> dict[str, Any]:
        seen: dict[str, Any] = {}
        async with asyncsave.Checkpointer(root, dist_timeout_s=30) as ckpt:
            assert ckpt._dist is not None
            seen["own_group"] = ckpt._dist.group is not dist.group.WORLD
            h1 = await ckpt.save(1, state_of(rank, 1))
            # The caller's own collectives between two saves whose collectives
            # are still in flight (nobody awaited the handles yet).
            dist.barrier()
            t = torch.ones(1) * (rank + 1)
            dist.all_reduce(t)
            h2 = await ckpt.save(2, state_of(rank, 2))
            dist.barrier()
            info1, info2 = await h1, await h2
            # Every rank's handle resolves after the commit and the tracker.
            seen["committed_on_disk"] = (Path(root) / "step_2" / "manifest.json").exists()
            seen["tracker"] = (Path(root) / TRACKER).read_text().strip()
            seen["world"] = (info1.world_size, info2.world_size)
            seen["allreduce"] = t.item()
        async with asyncsave.Checkpointer(root) as ckpt:
            restored = await ckpt.load_latest()
            assert restored is not None
            seen["resumed_own_part"] = same(restored.state, state_of(rank, 2))
            seen["resumed_step"] = restored.info.step
        return seen

    return anyio.run(main, backend=backend)


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_two_ranks_commit_one_checkpoint_between_caller_barriers(
    tmp_path: Path, backend: str
) -> None:
    root = tmp_path / "run"
    seen = values(run_ranks(_two_saves_between_barriers, 2, tmp_path, str(root), backend))
    for s in seen:
        assert s == {
            "own_group": True,
            "committed_on_disk": True,
            "tracker": "2",
            "world": (2, 2),
            "allreduce": 3.0,
            "resumed_own_part": True,
            "resumed_step": 2,
        }
    # World size 1 reads the whole checkpoint: a dict by rank, every byte verified.
    whole = asyncsave.load(root / "step_2")
    assert set(whole) == {0, 1}
    assert same(whole[0], state_of(0, 2)) and same(whole[1], state_of(1, 2))
    assert asyncsave.verify(root / "step_2").world_size == 2
    # Each rank's part alone, as load_latest() reads it on that rank (here on the
    # ranks of a FakeGroup), and a typed error on every rank at a world size
    # per-rank state cannot be resharded to.
    resumed = anyio.run(resume_on_ranks, root, 2)
    assert all(same(resumed[r].state, state_of(r, 2)) for r in range(2))
    for error in anyio.run(resume_on_ranks, root, 3).values():
        assert isinstance(error, asyncsave.CheckpointError), error
        assert "saved by 2 ranks" in str(error)
    assert sorted(p.name for p in root.iterdir() if not p.name.startswith(".")) == [
        "latest_checkpointed_iteration.txt",
        "step_1",
        "step_2",
    ]
    files = sorted(p.name for p in (root / "step_2").iterdir())
    assert files == ["data-r00000-000.safetensors", "data-r00001-000.safetensors", "manifest.json"]


class _FailingFS(LocalFileSystem):
    """ENOSPC when creating a data file of step 2 (on the rank that uses it)."""

    def create(self, path: Path) -> int:
        if ".asyncsave-tmp-2-" in str(path) and path.suffix == ".safetensors":
            raise OSError(errno.ENOSPC, "No space left on device (injected)", str(path))
        return super().create(path)


class _KillingFS(LocalFileSystem):
    """SIGKILL this process in the middle of writing step 2's data file."""

    def write(self, fd: int, data: memoryview) -> int:
        if os.readlink(f"/proc/self/fd/{fd}").find(".asyncsave-tmp-2-") >= 0:
            os.kill(os.getpid(), signal.SIGKILL)
        return super().write(fd, data)


def _save_with_faulty_rank(
    rank: int, world: int, root: str, fault: str, victim: int = 1
) -> dict[str, Any]:
    fs: LocalFileSystem = LocalFileSystem()
    if rank == victim:
        fs = _FailingFS() if fault == "enospc" else _KillingFS()

    async def main() -> dict[str, Any]:
        seen: dict[str, Any] = {}
        ckpt = asyncsave.Checkpointer(root, filesystem=fs, dist_timeout_s=20)
        try:
            async with ckpt:
                await (await ckpt.save(1, state_of(rank, 1)))
                h2 = await ckpt.save(2, state_of(rank, 2))
                try:
                    await h2
                except RankFailedError as exc:
                    seen["error"] = (type(exc).__name__, dict(exc.ranks), str(exc))
                seen["step2_exists"] = (Path(root) / "step_2").exists()
                seen["tracker"] = (Path(root) / TRACKER).read_text().strip()
        except RankFailedError as exc:  # close re-raises the failure
            seen["close_error"] = type(exc).__name__
        return seen

    return anyio.run(main)


def test_failing_rank_means_no_rank_commits_and_all_name_it(tmp_path: Path) -> None:
    root = tmp_path / "run"
    seen = values(run_ranks(_save_with_faulty_rank, 2, tmp_path, str(root), "enospc"))
    for s in seen:
        name, ranks, text = s["error"]
        assert name == "RankFailedError"
        assert list(ranks) == [1] and "No space left" in ranks[1]
        assert "rank 1" in text
        assert s["step2_exists"] is False and s["tracker"] == "1"
        assert s["close_error"] == "RankFailedError"
    assert not (root / "step_2").exists()
    assert [p.name for p in root.iterdir() if p.name.startswith(".asyncsave-tmp")] == []
    assert same(asyncsave.load(root / "step_1")[1], state_of(1, 1))


def _resume(rank: int, world: int, root: str) -> bool:
    async def main() -> bool:
        async with asyncsave.Checkpointer(root) as ckpt:
            restored = await ckpt.load_latest()
            assert restored is not None and restored.info.step == 1
            return same(restored.state, state_of(rank, 1))

    return anyio.run(main)


@pytest.mark.parametrize("victim", [1, 0], ids=["rank1-killed", "rank0-killed"])
def test_killed_rank_makes_the_other_raise_and_step_1_still_loads(
    tmp_path: Path, victim: int
) -> None:
    root = tmp_path / "run"
    results = run_ranks(
        _save_with_faulty_rank, 2, tmp_path, str(root), "kill", victim, timeout_s=90
    )
    assert results[victim] == ("exit", -signal.SIGKILL)
    (survivor,) = values({1 - victim: results[1 - victim]})
    name, ranks, text = survivor["error"]
    # The dead rank is named (issue 11): its heartbeat through the store stopped.
    # dist_timeout_s=20 and the harness deadline is 90 s: a survivor that hung
    # would have been killed there and returned no result.
    assert name == "RankFailedError" and "gloo" in text
    assert list(ranks) == [victim] and "died" in ranks[victim]
    assert survivor["step2_exists"] is False and survivor["tracker"] == "1"
    # The last committed checkpoint loads at world size 1 ...
    assert asyncsave.latest(root).step == 1  # type: ignore[union-attr]
    whole = asyncsave.load(root / "step_1")
    assert same(whole[0], state_of(0, 1)) and same(whole[1], state_of(1, 1))
    # ... and at world size 2, after the next open removed the dead save's temp dir.
    assert values(run_ranks(_resume, 2, tmp_path, str(root))) == [True, True]
    assert [p.name for p in root.iterdir() if p.name.startswith(".asyncsave-tmp")] == []


def _bad_state_on_rank_1(rank: int, world: int, root: str) -> tuple[str, dict[int, str]]:
    seen: dict[str, Any] = {}

    async def main() -> None:
        async with asyncsave.Checkpointer(root, dist_timeout_s=20) as ckpt:
            state: dict[Any, Any] = state_of(rank, 1)
            if rank == 1:
                state[("bad", "key")] = 1  # not a str/int key: refused at planning
            try:
                await (await ckpt.save(1, state))
            except Exception as exc:
                seen["error"] = (type(exc).__name__, dict(getattr(exc, "ranks", {})))

    try:
        anyio.run(main)
    except Exception as exc:  # close raises the failure again
        seen["close"] = type(exc).__name__
    return seen["error"]


def test_rank_whose_save_call_fails_is_named_on_every_rank(tmp_path: Path) -> None:
    root = tmp_path / "run"
    r0, r1 = values(run_ranks(_bad_state_on_rank_1, 2, tmp_path, str(root)))
    assert r0[0] == "RankFailedError" and list(r0[1]) == [1] and "key" in r0[1][1].lower()
    assert r1[0] == "InvalidKeyError"  # the rank's own error, raised by its save()
    assert not (root / "step_1").exists()


def _different_steps(rank: int, world: int, root: str) -> tuple[str, dict[int, str]]:
    seen: dict[str, Any] = {}

    async def main() -> None:
        async with asyncsave.Checkpointer(root, dist_timeout_s=20) as ckpt:
            try:
                await (await ckpt.save(3 + rank, state_of(rank, 3)))
            except RankFailedError as exc:
                seen["error"] = (type(exc).__name__, dict(exc.ranks))

    try:
        anyio.run(main)
    except RankFailedError:
        pass
    return seen["error"]


def test_ranks_saving_different_steps_commit_nothing(tmp_path: Path) -> None:
    root = tmp_path / "run"
    for name, ranks in values(run_ranks(_different_steps, 2, tmp_path, str(root))):
        assert name == "RankFailedError" and list(ranks) == [1]
        assert "same steps in the same order" in ranks[1]
    assert sorted(p.name for p in root.iterdir()) == [".asyncsave.lock"]


def _dtensor_save_with_failing_rank(rank: int, world: int, root: str) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    full = torch.arange(64.0).reshape(8, 8)
    state = {"w": distribute_tensor(full, mesh, [Shard(0)]), "step": 1}
    fs: LocalFileSystem = _FailingFS() if rank == 1 else LocalFileSystem()
    seen: dict[str, Any] = {}

    async def main() -> None:
        async with asyncsave.Checkpointer(root, filesystem=fs, dist_timeout_s=30) as ckpt:
            handle = await ckpt.save(1, state)  # DTensor: DCP's planner, asyncsave's commit
            state["w"].to_local().add_(1000)  # after save() returned: not in step 1 (S11)
            await handle
            try:
                await (await ckpt.save(2, state))
            except RankFailedError as exc:
                seen["error"] = dict(exc.ranks)

    try:
        anyio.run(main)
    except RankFailedError:
        seen["close"] = True
    return seen


def test_dtensor_save_failing_on_one_rank_commits_nothing(tmp_path: Path) -> None:
    import torch.distributed.checkpoint as dcp

    from asyncsave.dcp import StorageReader

    root = tmp_path / "run"
    for s in values(run_ranks(_dtensor_save_with_failing_rank, 2, tmp_path, str(root))):
        # DCP reports rank 1's write error to every rank; no rank commits.
        assert s["close"] and all("No space left" in c for c in s["error"].values())
    assert not (root / "step_2").exists()
    assert (root / TRACKER).read_text().strip() == "1"
    out = {"w": torch.zeros(8, 8), "step": 0}
    dcp.load(out, storage_reader=StorageReader(root), no_dist=True)  # resharded to 1
    assert torch.equal(out["w"], torch.arange(64.0).reshape(8, 8)) and out["step"] == 1


def test_rank_failed_error_keeps_its_ranks_across_pickle() -> None:
    import pickle

    err = RankFailedError("step 2 failed on rank 1", step=2, rank=1, ranks={1: "ENOSPC"})
    back = pickle.loads(pickle.dumps(err))
    assert (type(back), back.ranks, back.step, back.rank, str(back)) == (
        RankFailedError,
        {1: "ENOSPC"},
        2,
        1,
        "step 2 failed on rank 1",
    )


def _three_saves_keep_last(rank: int, world: int, root: str) -> int:
    async def main() -> int:
        async with asyncsave.Checkpointer(
            root, retention=asyncsave.KeepLast(1), dist_timeout_s=30
        ) as ckpt:
            for step in (1, 2, 3):
                await (await ckpt.save(step, state_of(rank, step)))
            restored = await ckpt.load_latest()
            assert restored is not None and same(restored.state, state_of(rank, 3))
            return restored.info.step

    return anyio.run(main)


def test_retention_after_a_collective_commit_keeps_only_the_last(tmp_path: Path) -> None:
    root = tmp_path / "run"
    assert values(run_ranks(_three_saves_keep_last, 2, tmp_path, str(root))) == [3, 3]
    assert sorted(p.name for p in root.iterdir() if not p.name.startswith(".")) == [
        TRACKER,
        "step_3",
    ]


def _sync_facade(rank: int, world: int, root: str) -> tuple[int, int, bool]:
    with asyncsave.SyncCheckpointer(root, dist_timeout_s=30) as ckpt:
        info = ckpt.save(4, state_of(rank, 4)).result()
        dist.barrier()  # the caller's own collective while nothing is pending
        assert info is not None
        restored = ckpt.load_latest()
        assert restored is not None
        return info.step, info.world_size, same(restored.state, state_of(rank, 4))


def test_sync_facade_commits_collectively(tmp_path: Path) -> None:
    root = tmp_path / "run"
    assert values(run_ranks(_sync_facade, 2, tmp_path, str(root))) == [(4, 2, True)] * 2


def _object_store_root(rank: int, world: int, root: str) -> tuple[str, dict[int, str]]:
    async def main() -> tuple[str, dict[int, str]]:
        try:
            async with asyncsave.Checkpointer(root, dist_timeout_s=30) as ckpt:
                await (await ckpt.save(1, state_of(rank, 1)))
                return ("committed", {})
        except RankFailedError as exc:
            return (str(exc), dict(exc.ranks))

    return anyio.run(main)


def test_several_ranks_need_storage_they_share(tmp_path: Path) -> None:
    """memory:// is one store per process: rank 1's files are not where rank 0
    commits. Object-store roots work on several ranks (issue 11); storage the
    ranks do not share is refused at the commit, naming the missing file."""
    for text, ranks in values(
        run_ranks(_object_store_root, 2, tmp_path, "memory://asyncsave-dist")
    ):
        assert list(ranks) == [0] and "data-r00001-000.safetensors" in ranks[0]
        assert "storage all ranks share" in text
