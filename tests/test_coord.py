"""The coordinator's helpers: one way to talk across ranks (``map_reduce``,
``from_leader``) and one ordered-turn primitive (``Turns``).

Several ranks are played by :class:`FakeRank` coordinators in one event loop:
each one's n-th collective meets the others' n-th, and every object crosses
through pickle, as through gloo.
"""

# Private imports: unit tests of the coordinator module, whose helpers are internal.
from __future__ import annotations

import pickle
from collections.abc import Awaitable, Callable
from typing import Any

import anyio
import pytest

from asyncsave import CheckpointError, RankFailedError
from asyncsave._coord import Coordinator, Solo, Turns

pytestmark = pytest.mark.anyio


class FakeRanks:
    """The rounds of collectives of ``n`` ranks in one event loop."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.rounds: list[tuple[list[Any], list[int], anyio.Event]] = []
        self.whats: list[str] = []


class FakeRank(Coordinator):
    def __init__(self, ranks: FakeRanks, rank: int) -> None:
        self.ranks, self.rank, self.world_size = ranks, rank, ranks.n
        self.seq = 0

    async def all_gather(self, what: str, obj: Any, step: int | None = None) -> list[Any]:
        i, self.seq = self.seq, self.seq + 1
        while len(self.ranks.rounds) <= i:
            self.ranks.rounds.append(([None] * self.world_size, [0], anyio.Event()))
            self.ranks.whats.append(what)
        values, count, done = self.ranks.rounds[i]
        values[self.rank] = pickle.dumps(obj)
        count[0] += 1
        if count[0] == self.world_size:
            done.set()
        await done.wait()
        return [pickle.loads(v) for v in values]

    async def broadcast(self, what: str, obj: Any, step: int | None = None) -> Any:
        return (await self.all_gather(what, obj, step))[0]


async def run_ranks(
    n: int, body: Callable[[Coordinator], Awaitable[Any]]
) -> tuple[list[Any], FakeRanks]:
    """``body(coord)`` on ``n`` fake ranks at once: each rank's value or exception."""
    ranks = FakeRanks(n)
    out: list[Any] = [None] * n

    async def one(rank: int) -> None:
        try:
            out[rank] = await body(FakeRank(ranks, rank))
        except Exception as exc:
            out[rank] = exc

    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            for rank in range(n):
                tg.start_soon(one, rank)
    return out, ranks


def step_failing_on(*bad: int) -> Callable[[Coordinator], Awaitable[Any]]:
    async def body(coord: Coordinator) -> Any:
        async def local() -> str:
            if coord.rank in bad:
                raise OSError(28, f"No space left on device (rank {coord.rank})")
            return f"part of rank {coord.rank}"

        return await coord.map_reduce("files-durable", 3, local, doing="save of")

    return body


# -- map_reduce ----------------------------------------------------------------------
async def test_map_reduce_in_a_world_of_one_returns_the_value_and_raises_the_error_itself() -> None:
    coord = Solo()

    async def ok() -> int:
        return 7

    assert await coord.map_reduce("x", 1, ok) == [7]
    error = OSError(5, "EIO")

    async def fails() -> None:
        raise error

    with pytest.raises(OSError) as info:
        await coord.map_reduce("x", 1, fails, doing="save of")
    assert info.value is error  # the identity: not wrapped, not copied


async def test_map_reduce_gives_every_rank_every_value_by_rank() -> None:
    out, ranks = await run_ranks(3, step_failing_on())
    assert out == [["part of rank 0", "part of rank 1", "part of rank 2"]] * 3
    assert ranks.whats == ["files-durable"]  # one collective


async def test_a_failing_rank_is_named_by_one_error_on_every_rank() -> None:
    out, _ = await run_ranks(2, step_failing_on(1))
    for error in out:
        assert isinstance(error, RankFailedError)
        assert error.ranks == {1: repr(OSError(28, "No space left on device (rank 1)"))}
        assert (error.rank, error.step) == (1, 3)
        assert str(error).startswith("save of step 3 failed on rank(s) [1]: rank 1: ")
    assert isinstance(out[1].__cause__, OSError)  # the failed rank keeps its own cause
    assert out[0].__cause__ is None


async def test_every_failed_rank_is_named_in_one_error() -> None:
    out, _ = await run_ranks(3, step_failing_on(0, 2))
    assert all(isinstance(e, RankFailedError) and sorted(e.ranks) == [0, 2] for e in out)
    assert all("failed on rank(s) [0, 2]" in str(e) for e in out)


async def test_map_reduce_with_own_raises_the_failed_ranks_own_error_and_the_failure_elsewhere() -> (
    None
):
    async def body(coord: Coordinator) -> Any:
        async def local() -> None:
            if coord.rank == 1:
                raise CheckpointError("no manifest", path="/r")

        def failure(failed: dict[int, str]) -> Exception:
            return CheckpointError(f"rank(s) {sorted(failed)} could not resume")

        return await coord.map_reduce("resume", None, local, failure=failure, own=True)

    out, _ = await run_ranks(2, body)
    assert type(out[0]) is CheckpointError and str(out[0]) == "rank(s) [1] could not resume"
    assert type(out[1]) is CheckpointError and str(out[1]) == "no manifest"


async def test_map_reduce_lets_a_cancellation_through() -> None:
    coord = Solo()

    async def cancelled() -> None:
        raise anyio.get_cancelled_exc_class()()

    with pytest.raises(anyio.get_cancelled_exc_class()):
        await coord.map_reduce("x", 1, cancelled)


# -- from_leader ---------------------------------------------------------------------
async def test_from_leader_in_a_world_of_one_is_the_identity() -> None:
    coord = Solo()

    async def name() -> str:
        return "tmp"

    assert await coord.from_leader("temp-dir", 1, name) == "tmp"
    error = FileExistsError("step_1")

    async def fails() -> str:
        raise error

    with pytest.raises(FileExistsError) as info:
        await coord.from_leader("temp-dir", 1, fails)
    assert info.value is error


async def test_from_leader_runs_the_step_on_the_leader_only_and_gives_its_value_to_all() -> None:
    ran: list[int] = []

    async def body(coord: Coordinator) -> Any:
        async def local() -> str:
            ran.append(coord.rank)
            return "tmp-of-rank-0"

        return await coord.from_leader("temp-dir", 2, local)

    out, _ = await run_ranks(3, body)
    assert out == ["tmp-of-rank-0"] * 3 and ran == [0]


@pytest.mark.parametrize("own", [False, True])
async def test_a_failing_leader_is_named_on_every_rank(own: bool) -> None:
    async def body(coord: Coordinator) -> Any:
        async def local() -> str:
            raise PermissionError(13, "EACCES")

        return await coord.from_leader("temp-dir", 2, local, own=own)

    out, _ = await run_ranks(2, body)
    assert isinstance(out[1], RankFailedError)
    assert out[1].ranks == {0: repr(PermissionError(13, "EACCES"))}
    assert out[1].rank == 0 and "failed on rank(s) [0]" in str(out[1])
    if own:
        assert type(out[0]) is PermissionError
    else:
        assert isinstance(out[0], RankFailedError) and str(out[0]) == str(out[1])
        assert isinstance(out[0].__cause__, PermissionError)


async def test_open_root_raises_the_leaders_own_error_there_and_names_rank_0_elsewhere() -> None:
    async def body(coord: Coordinator) -> Any:
        async def open_fn() -> tuple[list[int], int | None]:
            raise PermissionError(13, "root is read-only")

        return await coord.open_root(open_fn, root="/ckpt")  # type: ignore[arg-type]

    out, _ = await run_ranks(2, body)
    assert type(out[0]) is PermissionError
    assert type(out[1]) is CheckpointError and out[1].rank == 0
    assert str(out[1]).startswith("rank 0 could not open the checkpoint root /ckpt: ")


# -- Turns ---------------------------------------------------------------------------
async def test_turns_are_served_in_ticket_order_whatever_order_they_wait_in() -> None:
    turns, served = Turns(), []
    tickets = [turns.take() for _ in range(3)]

    async def one(ticket: int) -> None:
        await turns.wait(ticket)
        served.append(ticket)
        await anyio.sleep(0)
        turns.end(ticket)

    async with anyio.create_task_group() as tg:
        for ticket in reversed(tickets):
            tg.start_soon(one, ticket)
    assert served == [0, 1, 2]


async def test_a_turn_ended_before_it_came_is_skipped_and_a_stale_end_changes_nothing() -> None:
    turns = Turns()
    first, abandoned, third = turns.take(), turns.take(), turns.take()
    turns.end(abandoned)  # gave up while waiting
    turns.end(first)
    with anyio.fail_after(1):
        await turns.wait(third)  # served: the abandoned one is skipped
    turns.end(first)  # stale: must not end the turn being served
    fourth = turns.take()
    with anyio.move_on_after(0.05) as scope:
        await turns.wait(fourth)
    assert scope.cancelled_caught  # the third still holds its turn
    turns.end(third)
    with anyio.fail_after(1):
        await turns.wait(fourth)


class TurnTaking(Coordinator):
    """A coordinator whose collectives take turns, as a gloo group's do."""

    def __init__(self) -> None:
        self.turns = Turns()

    def take_ticket(self) -> int:
        return self.turns.take()

    async def wait_turn(self, ticket: int) -> None:
        await self.turns.wait(ticket)

    def end_turn(self, ticket: int) -> None:
        self.turns.end(ticket)


async def test_a_coordinators_turn_waits_for_the_earlier_one_and_ends_when_its_body_raises() -> (
    None
):
    coord, order = TurnTaking(), []
    earlier = coord.take_ticket()  # a save dispatched before

    async def resume() -> None:
        with pytest.raises(OSError):
            async with coord.turn():
                order.append("resume")
                raise OSError("in the turn")

    async with anyio.create_task_group() as tg:
        tg.start_soon(resume)
        await anyio.sleep(0.05)
        order.append("save")  # the resume has not begun: its turn is later
        coord.end_turn(earlier)
    with anyio.fail_after(1):
        async with coord.turn():  # the raising body's turn ended
            order.append("next")
    assert order == ["save", "resume", "next"]


async def test_waiting_on_a_stale_ticket_returns_at_once() -> None:
    """A ticket already passed (its turn ended, later ones too) is never a wait
    that cannot end."""
    turns = Turns()
    first, second = turns.take(), turns.take()
    turns.end(first)
    turns.end(second)
    with anyio.fail_after(5):
        await turns.wait(first)
        await turns.wait(second)


class BrokenCollective(Solo):
    """A world of two whose collectives fail (a peer died)."""

    world_size = 2

    async def all_gather(self, what: str, obj: Any, step: int | None = None) -> list[Any]:
        raise RankFailedError(f"{what}: rank 1 died", step=step, rank=1, ranks={1: "died"})

    async def broadcast(self, what: str, obj: Any, step: int | None = None) -> Any:
        return (await self.all_gather(what, obj, step))[0]


@pytest.mark.parametrize("helper", ["map_reduce", "from_leader"])
async def test_a_collective_that_fails_after_the_local_step_keeps_the_steps_error(
    helper: str, caplog: pytest.LogCaptureFixture
) -> None:
    """This rank's step failed, then the collective did (the peer died): the
    collective's error is raised, and the step's is on it (a note) and logged."""
    coord = BrokenCollective()

    async def local() -> None:
        raise OSError(28, "No space left on device")

    with pytest.raises(RankFailedError, match="rank 1 died") as caught:
        await getattr(coord, helper)("files-durable", 3, local)
    assert any("No space left on device" in note for note in caught.value.__notes__)
    assert "No space left on device" in caplog.text
