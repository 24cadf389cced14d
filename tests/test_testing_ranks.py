"""``asyncsave.testing.FakeGroup``: N ranks of one save in one process, through
the public API only (``Checkpointer(root, coordinator=group.rank(r))``). Each
test checks a promise of the fake: the ranks commit one checkpoint together, a
rank that dies or hangs at a named collective fails every rank the way a gloo
group does, a rank that left is named, collectives that do not match fail."""

from __future__ import annotations

import threading
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import anyio
import pytest
import torch

import asyncsave
from asyncsave.testing import FakeGroup, leftover_temp_names

pytestmark = pytest.mark.anyio

HANG_GUARD_S = 60


def part(rank: int, step: int) -> dict[str, Any]:
    return {"w": torch.full((8,), float(10 * step + rank)), "step": step}


async def on_every_rank(group: FakeGroup, body: Callable[[int], Awaitable[Any]]) -> dict[int, Any]:
    """``body(rank)`` for every rank of ``group`` as tasks of this loop: what each
    returned, or the exception it raised."""
    out: dict[int, Any] = {}

    async def one(rank: int) -> None:
        try:
            out[rank] = await body(rank)
        except Exception as exc:
            out[rank] = exc

    with anyio.fail_after(HANG_GUARD_S):
        async with anyio.create_task_group() as tg:
            for rank in range(group.world_size):
                tg.start_soon(one, rank)
    return out


async def test_the_ranks_commit_one_checkpoint_holding_every_rank_s_part(tmp_path: Path) -> None:
    group = FakeGroup(3)

    async def rank(r: int) -> asyncsave.CheckpointInfo:
        async with asyncsave.Checkpointer(tmp_path, coordinator=group.rank(r)) as ckpt:
            for step in (1, 2):
                handle = await ckpt.save(step, part(r, step))
            info: asyncsave.CheckpointInfo = await handle
            return info

    infos = await on_every_rank(group, rank)
    assert {info.step for info in infos.values()} == {2}
    assert infos[0].world_size == 3
    assert [i.step for i in asyncsave.checkpoints(tmp_path)] == [1, 2]
    assert asyncsave.latest(tmp_path).step == 2
    loaded = asyncsave.load(tmp_path / "step_2")
    assert sorted(loaded) == [0, 1, 2]
    for r in range(3):
        assert torch.equal(loaded[r]["w"], part(r, 2)["w"])
    assert leftover_temp_names(tmp_path) == []


async def test_every_rank_meets_the_same_collectives_in_the_same_order(tmp_path: Path) -> None:
    group = FakeGroup(2)

    async def rank(r: int) -> None:
        async with asyncsave.Checkpointer(tmp_path, coordinator=group.rank(r)) as ckpt:
            await (await ckpt.save(1, part(r, 1)))

    await on_every_rank(group, rank)
    by_rank = {r: [(what, step) for rr, what, step in group.log if rr == r] for r in range(2)}
    assert by_rank[0] == by_rank[1]
    assert by_rank[0][0] == ("open", None)
    assert ("commit", 1) in by_rank[0]


async def test_a_second_checkpointer_per_rank_resumes_what_the_first_committed(
    tmp_path: Path,
) -> None:
    group = FakeGroup(2)

    async def first(r: int) -> None:
        async with asyncsave.Checkpointer(tmp_path, coordinator=group.rank(r)) as ckpt:
            await (await ckpt.save(4, part(r, 4)))

    async def second(r: int) -> Any:
        async with asyncsave.Checkpointer(tmp_path, coordinator=group.rank(r)) as ckpt:
            restored = await ckpt.load_latest()
            await (await ckpt.save(5, part(r, 5)))
            return restored

    await on_every_rank(group, first)
    restored = await on_every_rank(group, second)
    for r in range(2):
        assert restored[r].info.step == 4
        assert torch.equal(restored[r].state["w"], part(r, 4)["w"])
    assert asyncsave.latest(tmp_path).step == 5


@pytest.mark.parametrize("at", ["temp-dir", "files-durable", "commit"])
async def test_a_rank_that_dies_at_a_collective_fails_every_rank_naming_it(
    tmp_path: Path, at: str
) -> None:
    group = FakeGroup(2)
    group.fail(1, at=at)

    async def rank(r: int) -> Any:
        async with asyncsave.Checkpointer(tmp_path, coordinator=group.rank(r)) as ckpt:
            await (await ckpt.save(1, part(r, 1)))

    outcomes = await on_every_rank(group, rank)
    for r in range(2):
        error = outcomes[r]
        # A RankFailedError, or (rank 0 past its commit) a SaveFailedError from one.
        assert isinstance(error, asyncsave.SaveFailedError), (r, error)
        ranked = isinstance(error, asyncsave.RankFailedError) and error.ranks
        failure = error if ranked else error.__cause__
        assert isinstance(failure, asyncsave.RankFailedError), (r, error)
        assert 1 in failure.ranks and "died" in failure.ranks[1], (r, failure)
        assert "within timeout_s" not in str(failure), (r, failure)  # named, not timed out
    # Rank 0 renames before it tells the others (the commit broadcast): a rank
    # lost there cannot undo the commit; before it, nothing is committed.
    assert (asyncsave.latest(tmp_path) is None) is (at != "commit")
    assert leftover_temp_names(tmp_path) == []


async def test_a_rank_that_never_answers_fails_the_others_after_timeout_s(tmp_path: Path) -> None:
    group = FakeGroup(2, timeout_s=0.5)
    group.hang(1, at="files-durable")

    async def rank(r: int) -> Any:
        async with asyncsave.Checkpointer(tmp_path, coordinator=group.rank(r)) as ckpt:
            await (await ckpt.save(1, part(r, 1)))

    outcomes = await on_every_rank(group, rank)
    for r in range(2):
        assert isinstance(outcomes[r], asyncsave.RankFailedError), (r, outcomes[r])
        assert "within timeout_s=0.5" in str(outcomes[r]), (r, outcomes[r])
    assert asyncsave.latest(tmp_path) is None


async def test_a_rank_that_closed_is_named_by_the_rank_still_saving(tmp_path: Path) -> None:
    group = FakeGroup(2)

    async def rank(r: int) -> Any:
        async with asyncsave.Checkpointer(tmp_path, coordinator=group.rank(r)) as ckpt:
            if r == 1:
                return None  # leaves without saving
            await anyio.sleep(0.05)
            await (await ckpt.save(1, part(r, 1)))

    outcomes = await on_every_rank(group, rank)
    assert outcomes[1] is None
    error = outcomes[0]
    assert isinstance(error, asyncsave.RankFailedError)
    assert error.rank == 1 and "closed its Checkpointer" in error.ranks[1]


async def test_collectives_that_do_not_match_fail_on_every_rank() -> None:
    group = FakeGroup(2)

    async def rank(r: int) -> Any:
        if r == 0:
            return await group.rank(0).broadcast("commit", "x", 3)
        return await group.rank(1).all_gather("files-durable", "y", 3)

    outcomes = await on_every_rank(group, rank)
    for r in range(2):
        assert isinstance(outcomes[r], asyncsave.RankFailedError)
        message = str(outcomes[r])  # whichever rank came first opened the round
        assert (
            "rank 1 called all_gather 'files-durable' where rank 0 called broadcast 'commit'"
            in message
            or "rank 0 called broadcast 'commit' where rank 1 called all_gather 'files-durable'"
            in message
        ), message


async def test_broadcast_hands_out_rank_0_s_object_and_all_gather_every_rank_s() -> None:
    group = FakeGroup(3)

    async def rank(r: int) -> Any:
        coord = group.rank(r)
        return await coord.broadcast("b", f"from {r}"), await coord.all_gather("g", r * r)

    outcomes = await on_every_rank(group, rank)
    assert outcomes == {r: ("from 0", [0, 1, 4]) for r in range(3)}


def test_vote_exchanges_every_rank_s_values_between_threads() -> None:
    group = FakeGroup(2, timeout_s=10)
    out: dict[int, Any] = {}

    def rank(r: int) -> None:
        out[r] = group.rank(r).vote([r, 1 - r, 7])

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(HANG_GUARD_S)
    assert out == {0: [[0, 1, 7], [1, 0, 7]], 1: [[0, 1, 7], [1, 0, 7]]}


def test_agreed_policies_of_sync_checkpointers_in_threads_answer_alike(tmp_path: Path) -> None:
    group = FakeGroup(2, timeout_s=10)
    answers: dict[int, list[bool]] = {}

    def rank(r: int) -> None:
        # Each rank asks its own policy: rank 1 wants every step, rank 0 none.
        policy = asyncsave.SaveEvery(1 if r == 1 else 1000)
        with asyncsave.SyncCheckpointer(tmp_path, coordinator=group.rank(r)) as ckpt:
            agreed = ckpt.agree(policy)
            answers[r] = [agreed.should_save(step) for step in (1, 2, 3)]

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(HANG_GUARD_S)
    assert answers == {0: [True, True, True], 1: [True, True, True]}


def test_bad_arguments_are_refused_naming_them(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="world_size=0"):
        FakeGroup(0)
    with pytest.raises(ValueError, match="timeout_s=0"):
        FakeGroup(2, timeout_s=0)
    group = FakeGroup(2)
    with pytest.raises(ValueError, match="rank=2"):
        group.rank(2)
    with pytest.raises(ValueError, match="fail: rank=-1"):
        group.fail(-1)
    with pytest.raises(ValueError, match="coordinator="):
        asyncsave.Checkpointer(tmp_path, coordinator=object())
    with pytest.raises(ValueError, match="distributed=False"):
        asyncsave.Checkpointer(tmp_path, coordinator=group.rank(0), distributed=False)
    with pytest.raises(ValueError, match="persistent="):
        asyncsave.Checkpointer(
            tmp_path / "local",
            coordinator=group.rank(0),
            persistent=asyncsave.Tier(tmp_path / "remote"),
        )
    assert group.rank(1) is group.rank(1)
