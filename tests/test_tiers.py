"""Two tiers (issue 15): a save commits to the local root first and is persisted
from that committed copy to the persistent tier behind it; per-tier policies and
retention; back-pressure; close flushes; resume from the nearest valid tier."""

from __future__ import annotations

import errno
import shutil
import threading
from pathlib import Path
from typing import Any

import anyio
import pytest
import torch
from faults import FaultyFS, block, pause, raise_errno
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import asyncsave
from asyncsave import Tier

pytestmark = pytest.mark.anyio


def state_of(step: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(step)
    return {"w": torch.randn(256, generator=g), "b": torch.arange(step, step + 8), "step": step}


def same(a: Any, b: Any) -> None:
    assert a.keys() == b.keys()
    for k in a:
        if isinstance(a[k], torch.Tensor):
            assert torch.equal(a[k], b[k]), k
        else:
            assert a[k] == b[k], k


def steps(root: Path) -> list[int]:
    if not root.exists():
        return []
    return sorted(int(p.name[5:]) for p in root.iterdir() if p.name.startswith("step_"))


def tracker(root: Path) -> int:
    return int((root / "latest_checkpointed_iteration.txt").read_text())


def flip_byte(ckpt: Path) -> None:
    data = max(
        (p for p in ckpt.iterdir() if p.name != "manifest.json"), key=lambda p: p.stat().st_size
    )
    raw = bytearray(data.read_bytes())
    raw[-3] ^= 0xFF
    data.write_bytes(bytes(raw))


async def test_a_save_commits_locally_then_persists_the_committed_copy(tmp_path: Path) -> None:
    local, remote = tmp_path / "local", tmp_path / "remote"
    async with asyncsave.Checkpointer(local, persistent=Tier(remote)) as ckpt:
        handle = await ckpt.save(10, state_of(10))
        assert handle.due_to_persist
        info = await handle
        assert info is not None and info.path == local / "step_10"
        persisted = await handle.persisted()
        assert persisted is not None and persisted.path == remote / "step_10"
        assert persisted.step == 10 and persisted.nbytes == info.nbytes
    assert steps(local) == steps(remote) == [10]
    assert tracker(local) == tracker(remote) == 10
    assert [p.name for p in remote.iterdir() if p.name.startswith(".")] in ([], [".asyncsave.lock"])
    same(asyncsave.load(remote / "step_10"), state_of(10))
    asyncsave.verify(remote / "step_10")


async def test_per_tier_policies_and_retention(tmp_path: Path) -> None:
    """Local every save, keep 2; persist every 4th, keep the best 2 by a metric."""
    local, remote = tmp_path / "local", tmp_path / "remote"
    tier = Tier(
        remote,
        policy=asyncsave.SaveEvery(4),
        retention=asyncsave.KeepBest(2, metric="loss", mode="min"),
    )
    losses = {4: 0.5, 8: 0.2, 12: 0.9, 16: 0.3}
    handles = []
    async with asyncsave.Checkpointer(
        local, retention=asyncsave.KeepLast(2), persistent=tier
    ) as ckpt:
        for step in range(1, 17):
            h = await ckpt.save(step, state_of(step), training_info={"loss": losses.get(step, 1.0)})
            handles.append(h)
            assert h.due_to_persist == (step % 4 == 0)
        for h in handles:
            if h.due_to_persist:
                assert (await h.persisted()) is not None
            else:
                assert await h.persisted() is None
    assert steps(local) == [15, 16]
    # Best two by loss (8, 16), plus the newest (16) and the tracked one (16).
    assert steps(remote) == [8, 16]
    assert tracker(remote) == 16


class _PausedFS(FaultyFS):
    """The persistent tier's file system, paused at its first ``rename`` (the
    commit of the first copy) until ``release`` is set."""

    def __init__(self) -> None:
        self.release = threading.Event()
        super().__init__("rename", pause(self.release))


async def test_a_local_checkpoint_due_to_persist_is_kept_until_its_copy_commits(
    tmp_path: Path,
) -> None:
    local, remote = tmp_path / "local", tmp_path / "remote"
    fs = _PausedFS()
    tier = Tier(remote, policy=asyncsave.SaveEvery(2), filesystem=fs, queue_size=4)
    async with asyncsave.Checkpointer(
        local, retention=asyncsave.KeepLast(1), persistent=tier
    ) as ckpt:
        h2 = await ckpt.save(2, state_of(2))
        await h2
        await anyio.to_thread.run_sync(fs.fired.wait, 30)  # the copy of 2 is committing
        for step in (3, 5, 7):  # not due: each commit runs retention (keep last 1)
            await (await ckpt.save(step, state_of(step)))
            assert 2 in steps(local), step  # still waiting for its persistent copy
        assert steps(remote) == []
        fs.release.set()
        assert (await h2.persisted()).path == remote / "step_2"  # type: ignore[union-attr]
        await (await ckpt.save(9, state_of(9)))
        assert steps(local) == [9]  # 2 is persisted now: retired like any other
    assert steps(remote) == [2]


async def test_back_pressure_save_waits_for_a_slot_in_the_persist_queue(tmp_path: Path) -> None:
    local, remote = tmp_path / "local", tmp_path / "remote"
    fs = _PausedFS()
    tier = Tier(remote, filesystem=fs, queue_size=1)
    returned = anyio.Event()
    async with asyncsave.Checkpointer(local, persistent=tier) as ckpt:
        h1 = await ckpt.save(1, state_of(1))
        await anyio.to_thread.run_sync(fs.fired.wait, 30)  # copy of 1 in progress

        async def second() -> None:
            await ckpt.save(2, state_of(2))
            returned.set()

        async with anyio.create_task_group() as tg:
            tg.start_soon(second)
            for _ in range(20):  # give it every chance to return early
                await anyio.sleep(0.01)
            assert not returned.is_set()
            assert ckpt.pending_steps == []  # waiting before its snapshot: not admitted
            fs.release.set()
        assert returned.is_set()
        await h1.persisted()
    assert steps(remote) == [1, 2]


async def test_close_flushes_persisting(tmp_path: Path) -> None:
    local, remote = tmp_path / "local", tmp_path / "remote"
    async with asyncsave.Checkpointer(local, persistent=Tier(remote, queue_size=3)) as ckpt:
        for step in (1, 2, 3):
            await ckpt.save(step, state_of(step))
    assert steps(remote) == [1, 2, 3] and tracker(remote) == 3
    for step in (1, 2, 3):
        same(asyncsave.load(remote / f"step_{step}"), state_of(step))


async def test_close_gives_up_on_a_stuck_copy_after_close_timeout(tmp_path: Path) -> None:
    local, remote = tmp_path / "local", tmp_path / "remote"
    release = threading.Event()
    fs = FaultyFS("rename", block(release))
    ckpt = asyncsave.Checkpointer(
        local, close_timeout_s=0.5, persistent=Tier(remote, filesystem=fs)
    )
    try:
        with pytest.raises(asyncsave.CheckpointTimeoutError) as err:
            async with ckpt:
                handle = await ckpt.save(1, state_of(1))
                await handle
                await anyio.to_thread.run_sync(fs.fired.wait, 30)
        assert err.value.step == 1 and "on the persistent tier" in str(err.value)
        with pytest.raises(asyncsave.CheckpointTimeoutError):
            await handle.persisted()
    finally:
        release.set()
    assert steps(local) == [1] and steps(remote) == []


async def test_a_failed_copy_is_raised_by_persisted_the_next_save_and_close(tmp_path: Path) -> None:
    local, remote = tmp_path / "local", tmp_path / "remote"
    fs = FaultyFS("create", raise_errno(errno.ENOSPC), where=lambda p: "manifest" in p)
    with pytest.raises(asyncsave.SaveFailedError) as at_close:
        async with asyncsave.Checkpointer(local, persistent=Tier(remote, filesystem=fs)) as ckpt:
            handle = await ckpt.save(1, state_of(1))
            assert (await handle).path == local / "step_1"  # type: ignore[union-attr]
            with pytest.raises(asyncsave.SaveFailedError) as err:
                await handle.persisted()
            assert isinstance(err.value.__cause__, OSError)
            assert err.value.__cause__.errno == errno.ENOSPC
            with pytest.raises(asyncsave.SaveFailedError):
                await ckpt.save(2, state_of(2))
    assert at_close.value is err.value
    assert steps(local) == [1]  # the local checkpoint is committed and kept
    assert steps(remote) == [] and [p.name for p in remote.iterdir()] == [".asyncsave.lock"]


def test_tier_options_are_validated() -> None:
    with pytest.raises(ValueError, match="queue_size"):
        Tier("/x", queue_size=0)
    with pytest.raises(ValueError, match="policy"):
        Tier("/x", policy=3)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="timeout_s"):
        Tier("/x", timeout_s=float("nan"))
    with pytest.raises(ValueError, match="persistent"):
        asyncsave.CheckpointOptions(persistent="/x")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="local tier"):
        asyncsave.Checkpointer("memory://local", persistent=Tier("/x"))


async def test_a_persistent_root_in_use_is_refused_and_the_local_root_released(
    tmp_path: Path,
) -> None:
    local, remote = tmp_path / "local", tmp_path / "remote"
    async with asyncsave.Checkpointer(remote):  # another saver holds the persistent root
        with pytest.raises(asyncsave.RootInUseError):
            async with asyncsave.Checkpointer(local, persistent=Tier(remote)):
                pass
    async with asyncsave.Checkpointer(local) as ckpt:  # not left locked
        await (await ckpt.save(1, state_of(1)))


# -- resume from the nearest valid tier ------------------------------------------------


async def _run(local: Path, remote: Path, saves: list[int], every: int = 2) -> None:
    tier = Tier(remote, policy=asyncsave.SaveEvery(every), queue_size=8)
    async with asyncsave.Checkpointer(local, persistent=tier) as ckpt:
        for step in saves:
            await ckpt.save(step, state_of(step))


async def _resume(local: Path, remote: Path) -> int | None:
    async with asyncsave.Checkpointer(local, persistent=Tier(remote)) as ckpt:
        restored = await ckpt.load_latest()
        if restored is None:
            return None
        same(restored.state, state_of(restored.info.step))
        assert ckpt.resumed_step == restored.info.step
        return restored.info.step


async def test_resume_prefers_the_newest_step_local_when_it_has_it(tmp_path: Path) -> None:
    local, remote = tmp_path / "local", tmp_path / "remote"
    await _run(local, remote, [1, 2, 3])
    assert steps(remote) == [2]
    assert await _resume(local, remote) == 3


async def test_a_wiped_local_tier_resumes_from_the_persistent_one(tmp_path: Path) -> None:
    local, remote = tmp_path / "local", tmp_path / "remote"
    await _run(local, remote, [1, 2, 3, 4, 5])
    shutil.rmtree(local)
    assert await _resume(local, remote) == 4


async def test_nothing_on_either_tier_resumes_none(tmp_path: Path) -> None:
    assert await _resume(tmp_path / "local", tmp_path / "remote") is None


@settings(
    max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    saved=st.sets(st.integers(1, 8), min_size=1, max_size=5),
    damaged=st.sets(st.tuples(st.sampled_from(["local", "remote"]), st.integers(1, 8)), max_size=4),
)
async def test_resume_takes_the_newest_step_that_verifies_on_the_nearest_tier(
    tmp_path_factory: pytest.TempPathFactory, saved: set[int], damaged: set[tuple[str, int]]
) -> None:
    """Any mix of steps on both tiers and damaged copies: the step resumed is the
    newest with a copy that verifies, local first."""
    tmp = tmp_path_factory.mktemp("tiers")
    local, remote = tmp / "local", tmp / "remote"
    await _run(local, remote, sorted(saved))
    roots = {"local": local, "remote": remote}
    for where, step in damaged:
        path = roots[where] / f"step_{step}"
        if path.exists():
            flip_byte(path)
    good = {s for where, root in roots.items() for s in steps(root) if (where, s) not in damaged}
    assert await _resume(local, remote) == max(good, default=None) if good else True
    if not good:
        with pytest.raises(asyncsave.CheckpointNotFoundError):
            await _resume(local, remote)


# -- an object store as the persistent tier (moto's S3 server) --------------------------
import test_objstore  # noqa: E402

s3_endpoint = test_objstore.s3_endpoint  # the fixtures, shared
s3 = test_objstore.s3


async def test_persisting_to_s3_and_resuming_from_it_after_the_local_tier_is_wiped(
    tmp_path: Path, s3: Any
) -> None:
    root, options, fs = s3
    local = tmp_path / "local"
    tier = Tier(root, storage_options=options, policy=asyncsave.SaveEvery(2), queue_size=4)
    async with asyncsave.Checkpointer(
        local, retention=asyncsave.KeepLast(1), persistent=tier
    ) as ckpt:
        handles = [await ckpt.save(step, state_of(step)) for step in (1, 2, 3, 4, 5)]
        persisted = [await h.persisted() for h in handles]
    assert [p is not None for p in persisted] == [False, True, False, True, False]
    assert str(persisted[3].path) == f"{root}/step_4"  # type: ignore[union-attr]
    assert steps(local) == [5]
    bucket_key = root.removeprefix("s3://")
    # Committed by marker, the tracker after it.
    assert fs.exists(f"{bucket_key}/step_4/commit_success.txt")
    assert fs.cat_file(f"{bucket_key}/latest_checkpointed_iteration.txt").strip() == b"4"
    assert asyncsave.latest(root, storage_options=options).step == 4  # type: ignore[union-attr]
    same(asyncsave.load(f"{root}/step_2", storage_options=options), state_of(2))
    shutil.rmtree(local)  # a replaced node
    async with asyncsave.Checkpointer(local, persistent=tier) as ckpt:
        restored = await ckpt.load_latest()
        assert restored is not None and restored.info.step == 4
        same(restored.state, state_of(4))
        # Saving on: the resumed step is on the persistent tier already.
        await (await ckpt.save(6, state_of(6))).persisted()
    assert asyncsave.latest(root, storage_options=options).step == 6  # type: ignore[union-attr]


# -- two ranks ---------------------------------------------------------------------------
def rank_state(rank: int, step: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(1000 * rank + step)
    return {"w": torch.randn(512, generator=g), "t": {"step": step, "rank": rank}}


def _ranks_save(rank: int, world: int, backend: str, local: Path, remote: str, opts: Any) -> Any:
    async def main() -> list[str | None]:
        tier = Tier(remote, policy=asyncsave.SaveEvery(2), queue_size=4, storage_options=opts)
        async with asyncsave.Checkpointer(local, persistent=tier) as ckpt:
            handles = [await ckpt.save(s, rank_state(rank, s)) for s in (1, 2, 3)]
            out = []
            for h in handles:
                p = await h.persisted()
                out.append(None if p is None else str(p.path))
            return out

    return anyio.run(main, backend=backend)


def _ranks_resume(
    rank: int, world: int, backend: str, locals_: list[Path], remote: str, opts: Any
) -> Any:
    async def main() -> int | None:
        tier = Tier(remote, policy=asyncsave.SaveEvery(2), storage_options=opts)
        async with asyncsave.Checkpointer(locals_[rank], persistent=tier) as ckpt:
            restored = await ckpt.load_latest()
            if restored is None:
                return None
            step = restored.info.step
            want = rank_state(rank, step)
            assert torch.equal(restored.state["w"], want["w"]), (rank, step)
            assert restored.state["t"] == want["t"]
            return step

    return anyio.run(main, backend=backend)


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_two_ranks_persist_and_agree_on_the_step_to_resume(tmp_path: Path, backend: str) -> None:
    from distributed import run_ranks, values

    local, remote = tmp_path / "local", str(tmp_path / "remote")
    out = values(run_ranks(_ranks_save, 2, tmp_path, backend, local, remote, None))
    assert out[0] == out[1] == [None, f"{remote}/step_2", None]
    assert steps(local) == [1, 2, 3] and steps(Path(remote)) == [2]
    # Every rank has the local tier: the newest step, 3, from it.
    both = [local, local]
    assert values(run_ranks(_ranks_resume, 2, tmp_path, backend, both, remote, None)) == [3, 3]
    # Rank 1's node was replaced and kept only step 1: local 3 is not on every rank,
    # so both resume the newest persistent step, 2 (not local 1, not local 3).
    other = tmp_path / "replaced"
    shutil.copytree(local, other)
    shutil.rmtree(other / "step_3")
    shutil.rmtree(other / "step_2")
    mixed = [local, other]
    assert values(run_ranks(_ranks_resume, 2, tmp_path, backend, mixed, remote, None)) == [2, 2]
    # Rank 0's copy of step 3 is damaged (rank 1's is fine): every rank drops it.
    flip_byte(local / "step_3")
    assert values(run_ranks(_ranks_resume, 2, tmp_path, backend, both, remote, None)) == [2, 2]
    # Every local tier wiped: the persistent tier.
    shutil.rmtree(local)
    assert values(run_ranks(_ranks_resume, 2, tmp_path, backend, both, remote, None)) == [2, 2]


def test_two_ranks_persist_to_s3(tmp_path: Path, s3: Any) -> None:
    from distributed import run_ranks, values

    root, options, _ = s3
    local = tmp_path / "local"
    out = values(run_ranks(_ranks_save, 2, tmp_path, "asyncio", local, root, options))
    assert out[0] == out[1] == [None, f"{root}/step_2", None]
    shutil.rmtree(local)
    both = [local, local]
    assert values(run_ranks(_ranks_resume, 2, tmp_path, "trio", both, root, options)) == [2, 2]


def test_the_synchronous_facade_persists_and_resumes_too(tmp_path: Path) -> None:
    local, remote = tmp_path / "local", tmp_path / "remote"
    with asyncsave.SyncCheckpointer(local, persistent=Tier(remote)) as ckpt:
        handle = ckpt.save(3, state_of(3))
        assert handle.result().path == local / "step_3"  # type: ignore[union-attr]
        assert handle.persisted().path == remote / "step_3"  # type: ignore[union-attr]
    assert handle.persisted().path == remote / "step_3"  # type: ignore[union-attr]
    shutil.rmtree(local)
    with asyncsave.SyncCheckpointer(local, persistent=Tier(remote)) as ckpt:
        restored = ckpt.load_latest()
        assert restored is not None and restored.info.step == 3
        same(restored.state, state_of(3))


@pytest.mark.parametrize("damaged", [False, True])
async def test_a_copy_an_earlier_run_left_undone_is_made_at_the_next_open(
    tmp_path: Path, damaged: bool
) -> None:
    """The run that saved step 2 failed to persist it (it could as well have been
    killed): the next run copies it (verified first) before the local rule may
    retire it; a leftover that no longer verifies is not copied."""
    local, remote = tmp_path / "local", tmp_path / "remote"
    broken = FaultyFS("rename", raise_errno(errno.EIO))
    keep1 = asyncsave.KeepLast(1)
    tier = Tier(remote, policy=asyncsave.SaveEvery(2), filesystem=broken)
    with pytest.raises(asyncsave.SaveFailedError):
        async with asyncsave.Checkpointer(local, retention=keep1, persistent=tier) as ckpt:
            await (await ckpt.save(2, state_of(2)))
    assert steps(local) == [2] and steps(remote) == []
    if damaged:
        flip_byte(local / "step_2")
    tier = Tier(remote, policy=asyncsave.SaveEvery(2))
    async with asyncsave.Checkpointer(local, retention=keep1, persistent=tier) as ckpt:
        await (await ckpt.save(3, state_of(3)))  # not due; keep last 1 locally
    if damaged:
        assert steps(remote) == [] and steps(local) == [3]
    else:
        assert steps(remote) == [2] and steps(local) == [3]
        same(asyncsave.load(remote / "step_2"), state_of(2))


async def test_close_flushes_a_save_waiting_for_a_slot_in_the_persist_queue(
    tmp_path: Path,
) -> None:
    """A save() already waiting for back-pressure when close begins was accepted:
    close waits for it, commits it on both tiers (S18)."""
    local, remote = tmp_path / "local", tmp_path / "remote"
    fs = _PausedFS()
    ckpt = asyncsave.Checkpointer(local, persistent=Tier(remote, filesystem=fs, queue_size=1))
    handles: list[asyncsave.SaveHandle] = []

    async def second() -> None:
        handles.append(await ckpt.save(2, state_of(2)))

    async def release_once_closing() -> None:
        while ckpt._state != "closing":
            await anyio.sleep(0.005)
        fs.release.set()

    async with anyio.create_task_group() as tg:
        async with ckpt:
            await (await ckpt.save(1, state_of(1)))
            await anyio.to_thread.run_sync(fs.fired.wait, 30)
            tg.start_soon(second)
            for _ in range(10):
                await anyio.sleep(0.005)
            assert handles == []  # waiting for the slot the copy of 1 holds
            tg.start_soon(release_once_closing)
    assert [h.step for h in handles] == [2]
    assert (await handles[0].persisted()).path == remote / "step_2"  # type: ignore[union-attr]
    assert steps(local) == steps(remote) == [1, 2]


async def test_the_resumed_step_is_retired_on_the_persistent_tier_once_newer_ones_commit(
    tmp_path: Path,
) -> None:
    """Persistent retention keeps the step a run resumed from only until a newer
    step commits there (as on the local tier), not for the whole run."""
    local, remote = tmp_path / "local", tmp_path / "remote"
    tier = Tier(remote, retention=asyncsave.KeepLast(2))
    async with asyncsave.Checkpointer(local, persistent=tier) as ckpt:
        for step in (1, 2, 3):
            await (await ckpt.save(step, state_of(step))).persisted()
    async with asyncsave.Checkpointer(local, persistent=tier) as ckpt:
        restored = await ckpt.load_latest()
        assert restored is not None and restored.info.step == 3
        for step in range(4, 9):
            await (await ckpt.save(step, state_of(step))).persisted()
    assert steps(remote) == [7, 8]


@pytest.mark.parametrize("same_data", [False, True])
async def test_a_step_persisted_by_another_run_is_never_taken_for_this_saves_copy(
    tmp_path: Path, same_data: bool
) -> None:
    """A replaced node (empty local tier) whose run did not resume saves a step the
    persistent tier already holds. Before: ``persisted()`` succeeded while the
    persistent step held the other run's state (found in review). Now: the same
    data is kept as this save's copy; other data is refused (typed, naming the
    path), left untouched, and this save counts as not persisted."""
    remote = tmp_path / "remote"
    theirs = {"w": torch.zeros(4), "step": 10}
    mine = dict(theirs) if same_data else {"w": torch.ones(4), "step": 10}
    async with asyncsave.Checkpointer(tmp_path / "nodeA", persistent=Tier(remote)) as ckpt:
        await (await ckpt.save(10, theirs)).persisted()
    if same_data:
        async with asyncsave.Checkpointer(tmp_path / "nodeB", persistent=Tier(remote)) as ckpt:
            handle = await ckpt.save(10, mine)
            assert (await handle.persisted()).path == remote / "step_10"  # type: ignore[union-attr]
    else:
        with pytest.raises(asyncsave.SaveFailedError) as at_close:
            async with asyncsave.Checkpointer(tmp_path / "nodeB", persistent=Tier(remote)) as ckpt:
                handle = await ckpt.save(10, mine)
                await handle  # committed locally
                with pytest.raises(asyncsave.SaveFailedError) as err:
                    await handle.persisted()
        assert at_close.value is err.value
        assert "other data" in str(err.value.__cause__ or err.value)
        assert str(remote / "step_10") in str(err.value.__cause__ or err.value)
    same(asyncsave.load(remote / "step_10"), theirs)  # never replaced
    same(asyncsave.load(tmp_path / "nodeB" / "step_10"), mine)


async def test_a_run_resumed_from_the_persistent_tier_may_save_that_step_again(
    tmp_path: Path,
) -> None:
    """The case the skip exists for: resumed from persistent step 10 (local tier
    wiped) and saved again at step 10, with a counter that moved: kept as is."""
    remote = tmp_path / "remote"
    async with asyncsave.Checkpointer(tmp_path / "nodeA", persistent=Tier(remote)) as ckpt:
        await (await ckpt.save(10, state_of(10))).persisted()
    async with asyncsave.Checkpointer(tmp_path / "nodeB", persistent=Tier(remote)) as ckpt:
        restored = await ckpt.load_latest()
        assert restored is not None and restored.info.step == 10
        again = {**restored.state, "step": 11}  # not the same tree
        persisted = await (await ckpt.save(10, again)).persisted()
        assert persisted is not None and persisted.path == remote / "step_10"
    same(asyncsave.load(remote / "step_10"), state_of(10))


@pytest.mark.parametrize("fault", ["EIO while reading", "damaged"])
async def test_a_local_copy_that_does_not_load_is_moved_aside_and_its_step_saved_again(
    tmp_path: Path, fault: str
) -> None:
    """Resume skips a local copy that does not load (damaged, or an I/O error),
    to the persistent one, and moves it aside (kept, never deleted), so that a
    later save of that step writes. (Leaving an EIO copy in place, tried once,
    kept its step committed: the re-save was a silent no-op; found in review.)"""
    local, remote = tmp_path / "local", tmp_path / "remote"
    await _run(local, remote, [2, 3], every=2)  # step 2 on both tiers, 3 local only
    manifest_3 = str(local / "step_3" / "manifest.json")
    # Step 3's manifest is read by the recovery at open, then by resume's load of
    # step 3: that second read fails with EIO (``fired`` checks it was reached).
    fs = FaultyFS(
        "read_bytes",
        raise_errno(errno.EIO),
        n=2,
        where=lambda p: fault != "damaged" and p == manifest_3,
    )
    if fault == "damaged":
        flip_byte(local / "step_3")
    tier = Tier(remote, policy=asyncsave.SaveEvery(2))  # step 3 is not due to persist
    async with asyncsave.Checkpointer(local, persistent=tier, filesystem=fs) as ckpt:
        restored = await ckpt.load_latest()
        assert fs.fired.is_set() == (fault != "damaged")
        assert restored is not None and restored.info.step == 2
        same(restored.state, state_of(2))
        redone = {**state_of(3), "b": torch.arange(100, 108)}
        await (await ckpt.save(3, redone))
    assert any(p.name.startswith(".asyncsave-damaged") for p in local.iterdir())
    same(asyncsave.load(local / "step_3"), redone)


@pytest.mark.parametrize(
    ("persistent", "refused"),
    [
        ("the local root", True),
        ("the same by another path", True),
        ("a step directory inside it", True),
        ("around it, named like a step", True),
        ("a plain directory inside it", False),
        ("around it, under a plain name", False),
    ],
)
def test_a_persistent_tier_that_is_or_clashes_with_the_local_root_is_refused(
    tmp_path: Path, persistent: str, refused: bool
) -> None:
    """Found by a new user: the same directory by another path was a misleading
    RootInUseError ("in use by another Checkpointer"), and a persistent root inside
    the local one failed the first save with a bare FileExistsError. Refused: the
    same directory, or one inside the other under a name the outer root's
    recovery, retention or listing acts on (a step's, a temporary or asyncsave
    name); a plain subdirectory is left alone by both (review: not refused)."""
    local = (
        tmp_path / "step_7" if persistent == "around it, named like a step" else (tmp_path / "run")
    )
    path = {
        "the local root": local,
        "the same by another path": tmp_path / "x" / ".." / local.name,
        "a step directory inside it": local / "step_1",
        "around it, named like a step": tmp_path,
        "a plain directory inside it": local / "persistent",
        "around it, under a plain name": tmp_path,
    }[persistent]
    if refused:
        with pytest.raises(ValueError, match="the two tiers must be separate") as err:
            asyncsave.Checkpointer(local, persistent=Tier(path))
        assert str(local) in str(err.value)
    else:
        asyncsave.Checkpointer(local, persistent=Tier(path))
