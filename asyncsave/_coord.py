"""The coordinator role of the save pipeline: who takes part in a save, and the
collectives between them.

One pipeline (``asyncsave._pipeline``) serves one process and N ranks, the way
DCP's ``_DistWrapper`` does: every phase is a per-rank step plus a coordinator
step. :class:`Solo` is the world of one, where the collectives are identities
and saves need no turns; :class:`GlooGroup` is asyncsave's own gloo group of N
ranks (``dist.new_group(backend="gloo", timeout=dist_timeout_s)``, created by
every rank in the same order), whose collectives run in worker threads (never on
the event loop, never on the caller's process group) and are serialised by a
ticket taken when each save is dispatched.

Any foreign error of a collective (gloo's ``RuntimeError``, a timeout) is
translated here, once, into :class:`RankFailedError`.
"""

from __future__ import annotations

import datetime
import functools
import logging
import math
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import anyio
import anyio.to_thread
import torch.distributed as dist

from ._errors import CheckpointError, RankFailedError

__all__ = ["Coordinator", "GlooGroup", "Solo", "wants_distributed"]

logger = logging.getLogger(__name__)


def wants_distributed(flag: bool | None) -> bool:
    """Whether a checkpointer with ``distributed=flag`` coordinates ranks.

    :raises CheckpointError: ``flag`` is true but ``torch.distributed`` is not
        initialised.
    """
    initialised = dist.is_available() and dist.is_initialized()
    if flag is None:
        return initialised and dist.get_world_size() > 1
    if flag and not initialised:
        raise CheckpointError("distributed=True needs torch.distributed.init_process_group() first")
    return flag


class Coordinator:
    """The coordinator contract; this base is the world of one (see :class:`Solo`).

    ``broadcast`` returns rank 0's object on every rank, ``all_gather`` every
    rank's object by rank; ``take_ticket``/``wait_turn``/``end_turn`` order the
    collectives of consecutive saves (a save's phases run inside its turn).
    """

    rank = 0
    world_size = 1
    group: Any = None
    timeout_s = math.inf

    @property
    def leader(self) -> bool:
        """Whether this rank writes the manifest, commits and moves the tracker."""
        return self.rank == 0

    async def broadcast(self, what: str, obj: Any, step: int | None = None) -> Any:
        """Rank 0's ``obj`` on every rank (here: ``obj``)."""
        return obj

    async def all_gather(self, what: str, obj: Any, step: int | None = None) -> list[Any]:
        """Every rank's ``obj``, by rank (here: ``[obj]``)."""
        return [obj]

    def take_ticket(self) -> int:
        """The next save's place in the collective order (taken at dispatch)."""
        return 0

    async def wait_turn(self, ticket: int) -> None:
        """Wait until the saves dispatched before this one left their turn."""

    def end_turn(self, ticket: int) -> None:
        """Leave this save's turn."""

    async def open_root(
        self, open_fn: Callable[[], Awaitable[tuple[list[int], int | None]]], root: Path
    ) -> tuple[list[int], int | None]:
        """Rank 0 runs ``open_fn`` (lock + recovery); every rank gets its result
        (committed steps, tracked step)."""
        return await open_fn()

    def close(self) -> None:
        """This rank leaves (its checkpointer closed)."""


class Solo(Coordinator):
    """One process: the world of one. Collectives are identities; saves take no
    turns (without collectives nothing needs ordering, so saves overlap)."""


class GlooGroup(Coordinator):
    """asyncsave's gloo group on this rank, and the ordering of save collectives.

    :param group: the gloo group (all ranks of the default group).
    :param timeout_s: ``dist_timeout_s``: the bound of each collective.
    """

    def __init__(self, group: Any, timeout_s: float) -> None:
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.timeout_s = timeout_s
        self._tickets = 0
        self._serving = 0
        self._ended: set[int] = set()  # turns ended before theirs came
        self._turn_changed = anyio.Event()

    @classmethod
    async def create(cls, timeout_s: float) -> GlooGroup:
        """Create the gloo group (every rank, same order), from a worker thread."""
        group = await anyio.to_thread.run_sync(
            functools.partial(
                dist.new_group,
                backend="gloo",
                timeout=datetime.timedelta(seconds=timeout_s),
                group_desc="asyncsave",
            ),
            abandon_on_cancel=True,
        )
        return cls(group, timeout_s)

    # -- collectives (worker threads) ------------------------------------------
    def _broadcast(self, obj: Any) -> Any:
        box = [obj]
        dist.broadcast_object_list(box, group=self.group, group_src=0)
        return box[0]

    def _all_gather(self, obj: Any) -> list[Any]:
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self.group)
        return out

    async def _collective(
        self, what: str, func: Callable[[Any], Any], obj: Any, step: int | None
    ) -> Any:
        try:
            return await anyio.to_thread.run_sync(func, obj, abandon_on_cancel=True)
        except Exception as exc:  # gloo: connection closed by a dead peer, timeout
            raise self._translate(what, step, exc) from exc

    def _translate(self, what: str, step: int | None, exc: BaseException) -> RankFailedError:
        """The one place a collective's foreign error becomes asyncsave's."""
        at = f" of step {step}" if step is not None else ""
        return RankFailedError(
            f"rank {self.rank}: the {what} collective{at} on asyncsave's gloo group "
            f"failed: another rank died or did not reach it within "
            f"dist_timeout_s={self.timeout_s} ({exc})",
            step=step,
            rank=None,
        )

    async def broadcast(self, what: str, obj: Any, step: int | None = None) -> Any:
        return await self._collective(what, self._broadcast, obj, step)

    async def all_gather(self, what: str, obj: Any, step: int | None = None) -> list[Any]:
        result: list[Any] = await self._collective(what, self._all_gather, obj, step)
        return result

    async def open_root(
        self, open_fn: Callable[[], Awaitable[tuple[list[int], int | None]]], root: Path
    ) -> tuple[list[int], int | None]:
        """Rank 0 runs ``open_fn``; the others wait in the broadcast of its result,
        or raise naming rank 0."""
        result: tuple[list[int], int | None] | None = None
        error: BaseException | None = None
        if self.rank == 0:
            try:
                result = await open_fn()
            except Exception as exc:
                error = exc
        payload = await self.broadcast("open", result if error is None else f"error: {error!r}")
        if error is not None:
            raise error
        if isinstance(payload, str):
            raise CheckpointError(
                f"rank 0 could not open the checkpoint root {root}: {payload}", path=root, rank=0
            )
        committed, tracked = payload
        return list(committed), tracked

    # -- ordering of saves ----------------------------------------------------------
    def take_ticket(self) -> int:
        ticket = self._tickets
        self._tickets += 1
        return ticket

    async def wait_turn(self, ticket: int) -> None:
        while self._serving != ticket:
            await self._turn_changed.wait()

    def end_turn(self, ticket: int) -> None:
        if ticket < self._serving:
            return
        self._ended.add(ticket)
        if self._serving in self._ended:
            while self._serving in self._ended:
                self._ended.remove(self._serving)
                self._serving += 1
            event, self._turn_changed = self._turn_changed, anyio.Event()
            event.set()
