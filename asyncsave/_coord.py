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
translated here, once, into :class:`RankFailedError`. The rest of the package
talks across ranks only through two helpers (DCP's ``_DistWrapper.all_gather``
and ``broadcast``): :meth:`Coordinator.map_reduce` (a step every rank runs; one
error naming every failed rank, on every rank) and :meth:`Coordinator.from_leader`
(the leader's result, or its failure on every rank); both are identities on a
world of one. :class:`Turns` is the one ordered-turn primitive.
"""

from __future__ import annotations

import datetime
import functools
import logging
import math
import threading
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import anyio.to_thread
import torch.distributed as dist

from ._errors import CheckpointError, RankFailedError

__all__ = [
    "Coordinator",
    "GlooGroup",
    "Liveness",
    "Solo",
    "Turns",
    "rank_failure",
    "wants_distributed",
]

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


def rank_failure(
    failed: dict[int, str],
    *,
    doing: str,
    step: int | None,
    note: str = "",
    path: Path | None = None,
) -> RankFailedError:
    """The one error a failure of some ranks raises on every rank: "<doing> step
    <step> failed on rank(s) [r, ...]<note>: rank r: <cause>; ...", with
    ``ranks`` (rank -> cause) and ``rank`` (the lowest)."""
    at = f" step {step}" if step is not None else ""
    return RankFailedError(
        f"{doing}{at} failed on rank(s) {sorted(failed)}{note}: "
        + "; ".join(f"rank {r}: {cause}" for r, cause in sorted(failed.items())),
        step=step,
        rank=min(failed),
        ranks=failed,
        path=path,
    )


def _note_own_failure(exc: Exception, error: Exception | None) -> None:
    """A collective failed after this rank's own step had failed: the step's
    error is kept on the collective's (a note, and logged), never lost."""
    if error is not None:
        exc.add_note(f"this rank's own step had failed first: {error!r}")
        logger.error("this rank's step failed before its collective did", exc_info=error)


class Turns:
    """The ordered-turn primitive: tickets are taken in order, and turns are
    served in ticket order, one at a time.

    A turn ended before it came (a save abandoned while it waited) is skipped
    when it comes; ending a turn twice, or a stale ticket one already passed,
    changes nothing. Not thread-safe: one event loop uses it.
    """

    def __init__(self) -> None:
        self._next = 0
        self._serving = 0
        self._ended: set[int] = set()  # turns ended before theirs came
        self._changed = anyio.Event()

    def take(self) -> int:
        """The next ticket (a place in the order)."""
        ticket, self._next = self._next, self._next + 1
        return ticket

    async def wait(self, ticket: int) -> None:
        """Until every turn before ``ticket`` has ended (at once for a stale
        ticket, one already passed: never a wait that cannot end)."""
        while self._serving < ticket:
            await self._changed.wait()

    def end(self, ticket: int) -> None:
        """End ``ticket``'s turn (harmless twice, or for a stale ticket)."""
        if ticket < self._serving:
            return
        self._ended.add(ticket)
        if self._serving in self._ended:
            while self._serving in self._ended:
                self._ended.remove(self._serving)
                self._serving += 1
            event, self._changed = self._changed, anyio.Event()
            event.set()


class Coordinator:
    """The coordinator contract; this base is the world of one (see :class:`Solo`).

    ``broadcast`` returns rank 0's object on every rank, ``all_gather`` every
    rank's object by rank (what an implementation provides; callers use
    :meth:`map_reduce` and :meth:`from_leader`); ``take_ticket``/``wait_turn``/
    ``end_turn`` order the collectives of consecutive saves (a save's phases run
    inside its turn; :meth:`turn` for a body of its own).
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

    async def map_reduce(
        self,
        what: str,
        step: int | None,
        local: Callable[[], Awaitable[Any]],
        *,
        doing: str | None = None,
        note: str = "",
        path: Path | None = None,
        failure: Callable[[dict[int, str]], Exception] | None = None,
        own: bool = False,
    ) -> list[Any]:
        """The one way ranks agree on a step that each of them runs (DCP's
        ``_DistWrapper.all_gather``): ``local()`` runs on this rank, its
        ``Exception`` caught; one outcome per rank is gathered; if any rank
        failed, every rank raises one :class:`RankFailedError` naming every
        failed rank with its cause (:func:`rank_failure`; this rank's own
        exception as ``__cause__``). A world of one is the identity: the local
        exception itself is raised, unchanged.

        :param what: the collective's name, for errors of the collective itself.
        :param doing: what failed, for the message (``"save of"``: "save of step
            3 failed on rank(s) [1]..."); by default ``"the <what> of"``.
        :param note: appended after the failed ranks (``"; no rank committed it"``).
        :param path: the error's ``path``.
        :param failure: builds the error from the failed ranks' causes instead
            (a load's failure is no :class:`RankFailedError`, which is a save's).
        :param own: a failed rank raises its own exception instead; the others
            the failure (a typed error its caller must see).
        :returns: every rank's value of ``local()``, by rank.
        :raises RankFailedError: a rank's step failed, or the collective did
            (a rank died, or did not take part within ``dist_timeout_s``).
        """
        value: Any = None
        error: Exception | None = None
        try:
            value = await local()
        except Exception as exc:
            error = exc
        mine = (False, repr(error)) if error is not None else (True, value)
        try:
            outcomes = await self.all_gather(what, mine, step)
        except Exception as exc:
            _note_own_failure(exc, error)
            raise
        failed = {r: cause for r, (ok, cause) in enumerate(outcomes) if not ok}
        if not failed:
            return [v for _, v in outcomes]
        if error is not None and (self.world_size == 1 or own):
            raise error
        if failure is not None:
            raise failure(failed) from error
        doing = f"the {what} of" if doing is None else doing
        raise rank_failure(failed, doing=doing, step=step, note=note, path=path) from error

    async def from_leader(
        self,
        what: str,
        step: int | None,
        local: Callable[[], Awaitable[Any]],
        *,
        failure: Callable[[str], Exception] | None = None,
        own: bool = False,
    ) -> Any:
        """The leader's result on every rank (DCP's ``_DistWrapper.broadcast``):
        the leader runs ``local()`` (the others do not), its ``Exception``
        caught, and broadcasts its value or its failure. If it failed, every
        rank raises ``failure(cause)`` (by default a :class:`RankFailedError`
        naming rank 0), the leader with its own exception as ``__cause__``; with
        ``own``, the leader raises its own exception instead (a typed error of
        the root, such as :class:`~asyncsave.RootInUseError`, its caller must
        see). A world of one is the identity: the local exception itself.

        :raises RankFailedError: the leader failed, or the collective did.
        """
        value: Any = None
        error: Exception | None = None
        if self.leader:
            try:
                value = await local()
            except Exception as exc:
                error = exc
        if self.world_size == 1:
            if error is not None:
                raise error
            return value
        try:
            ok, payload = await self.broadcast(
                what, (True, value) if error is None else (False, repr(error)), step
            )
        except Exception as exc:
            _note_own_failure(exc, error)
            raise
        if ok:
            return payload
        if own and error is not None:
            raise error
        if failure is None:
            raise rank_failure({0: payload}, doing=f"the {what} of", step=step) from error
        raise failure(payload) from error

    def take_ticket(self) -> int:
        """The next save's place in the collective order (taken at dispatch)."""
        return 0

    async def wait_turn(self, ticket: int) -> None:
        """Wait until the saves dispatched before this one left their turn."""

    def end_turn(self, ticket: int) -> None:
        """Leave this save's turn."""

    @asynccontextmanager
    async def turn(self) -> AsyncIterator[None]:
        """A turn of its own in the collective order (its collectives never
        interleave with a save's), ended however the body leaves."""
        ticket = self.take_ticket()
        try:
            await self.wait_turn(ticket)
            yield
        finally:
            self.end_turn(ticket)

    async def open_root(
        self, open_fn: Callable[[], Awaitable[tuple[list[int], int | None]]], root: Path
    ) -> tuple[list[int], int | None]:
        """Rank 0 runs ``open_fn`` (lock + recovery); every rank gets its result
        (committed steps, tracked step). Rank 0 raises its own error; the others
        a :class:`CheckpointError` naming rank 0."""

        def failure(cause: str) -> Exception:
            return CheckpointError(
                f"rank 0 could not open the checkpoint root {root}: {cause}", path=root, rank=0
            )

        committed, tracked = await self.from_leader(
            "open", None, open_fn, failure=failure, own=True
        )
        return list(committed), tracked

    def vote(self, values: list[int]) -> list[list[int]]:
        """Every rank's ``values`` (a few ints), by rank, from the calling thread
        (blocking): the exchange of agreed save policies (here: ``[values]``)."""
        return [list(values)]

    async def watched(self, what: str, func: Callable[[], Any], step: int | None) -> Any:
        """``func()`` (another library's collectives on ``group``: DCP's save) in a
        thread; its result, or its own exception (whatever its type). Several
        ranks: a peer that dies meanwhile is named (:class:`RankFailedError`)."""
        box = await _boxed(func)
        if "error" in box:
            raise box["error"]
        return box["value"]

    def close(self) -> None:
        """This rank leaves (its checkpointer closed)."""


class Solo(Coordinator):
    """One process: the world of one. Collectives are identities; saves take no
    turns (without collectives nothing needs ordering, so saves overlap)."""


_WAKE_S = 0.25  # the longest a waiter of a daemon-thread call stays blocked at a time


async def _boxed(func: Callable[..., Any], *args: Any) -> dict[str, Any]:
    """``func(*args)`` in a daemon thread: ``{"value": ...}`` or ``{"error": exc}``
    (any ``BaseException`` it raised, DCP's ``CheckpointException`` included)."""
    box: dict[str, Any] = {}
    done = threading.Event()

    def target() -> None:
        try:
            box["value"] = func(*args)
        except BaseException as exc:  # handed to the caller's task
            box["error"] = exc
        finally:
            done.set()

    threading.Thread(target=target, name="asyncsave-collective", daemon=True).start()
    # Woken as soon as the call returns (a collective of a few hundred
    # microseconds is not paid for in polling delays): a worker thread waits on
    # the event, at most _WAKE_S at a time, so one whose wait was abandoned (a
    # cancelled collective) ends by itself within _WAKE_S and never holds the
    # interpreter's exit, which the daemon thread running ``func`` may. A
    # limiter of its own: the waiter never queues behind the caller's threads.
    limiter = anyio.CapacityLimiter(1)
    while not await anyio.to_thread.run_sync(
        done.wait, _WAKE_S, abandon_on_cancel=True, limiter=limiter
    ):
        pass
    return box


async def _in_daemon(func: Callable[..., Any], *args: Any) -> Any:
    """``func(*args)`` in a daemon thread of its own, awaited by polling: a call
    abandoned at a deadline (a collective whose peer died, a store whose host is
    gone) never holds the interpreter's exit, as a worker thread would."""
    box = await _boxed(func, *args)
    if "error" in box:
        raise box["error"]
    return box["value"]


#: The longest a rank's heartbeat may stand still before the peers name it dead
#: (seconds); the window is half of ``dist_timeout_s`` up to this.
HEARTBEAT_WINDOW_MAX_S = 10.0


class Liveness:
    """Each rank's heartbeat through the process group's store, so that a rank
    that died is *named* on the survivors, and they raise within
    ``dist_timeout_s`` instead of waiting for gloo's own timeout.

    A daemon thread adds 1 to ``asyncsave/<token>/hb/<rank>`` every ``interval``
    seconds; a rank whose counter has not moved for ``window`` seconds (half of
    ``dist_timeout_s``, at most ``HEARTBEAT_WINDOW_MAX_S``) is dead; a rank that closed its checkpointer
    sets ``closed/<rank>`` and is named as gone, not dead. ``token`` is agreed by
    rank 0 when the group is created.
    """

    def __init__(self, store: Any, token: str, rank: int, world_size: int, timeout_s: float):
        self.store = store
        self.prefix = f"asyncsave/{token}/"
        self.rank = rank
        self.world_size = world_size
        self.window = min(timeout_s / 2, HEARTBEAT_WINDOW_MAX_S)
        self.interval = self.window / 10
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, name="asyncsave-heartbeat", daemon=True)
        self._thread.start()

    def _beat(self) -> None:
        key = f"{self.prefix}hb/{self.rank}"
        while not self._stop.is_set():
            try:
                self.store.add(key, 1)
            except Exception:  # the store's host is gone: the peers will see it
                logger.debug("heartbeat to the store failed", exc_info=True)
            self._stop.wait(self.interval)
        try:
            self.store.set(f"{self.prefix}closed/{self.rank}", "1")
        except Exception:
            logger.debug("could not mark rank %d closed in the store", self.rank, exc_info=True)

    def close(self) -> None:
        self._stop.set()

    def _read(self) -> dict[int, tuple[int, bool]]:
        out = {}
        for r in range(self.world_size):
            if r != self.rank:
                beats = int(self.store.add(f"{self.prefix}hb/{r}", 0))
                closed = bool(self.store.add(f"{self.prefix}closed/{r}", 0))
                out[r] = (beats, closed)
        return out

    def _read_into(self, read: dict[str, Any], done: threading.Event) -> None:
        try:
            read["counts"] = self._read()
        except Exception:  # store unreachable: nothing can be told from it
            read["counts"] = {}
        finally:
            done.set()

    def _gone(
        self,
        counts: dict[int, tuple[int, bool]],
        seen: dict[int, tuple[int, bool]],
        since: dict[int, float],
        now: float,
    ) -> dict[int, str]:
        """Fold one reading of the counters into ``seen``/``since`` (when each
        last moved); the peers found gone, each mapped to what became of it."""
        for r, value in counts.items():
            if seen.get(r) != value:
                seen[r], since[r] = value, now
        return {
            r: f"rank {r} closed its Checkpointer (left asyncsave's group)"
            if value[1]
            else f"rank {r} died: no heartbeat through the store for {self.window:g} s"
            for r, value in seen.items()
            if value[1] or now - since[r] >= self.window
        }

    async def watch(self) -> dict[int, str]:
        """Return once a peer stopped beating for ``window`` s, or closed: its
        rank mapped to what became of it. Runs until then (or cancelled)."""
        seen: dict[int, tuple[int, bool]] = {}
        since: dict[int, float] = {}
        while True:
            try:
                with anyio.fail_after(self.window):
                    counts = await _in_daemon(self._read)
            except Exception:  # store unreachable: nothing can be told from it
                counts = {}
            gone = self._gone(counts, seen, since, anyio.current_time())
            if gone:
                return gone
            await anyio.sleep(self.interval)

    def watch_blocking(self, done: threading.Event, timeout_s: float = math.inf) -> dict[int, str]:
        """:meth:`watch` for a caller's thread (no event loop): blocks until
        ``done`` is set (returns ``{}``), a peer is gone (returned as by
        :meth:`watch`), or ``timeout_s`` passed (``{}``). Each reading of the store
        runs in a daemon thread, bounded by ``window``."""
        seen: dict[int, tuple[int, bool]] = {}
        since: dict[int, float] = {}
        deadline = time.monotonic() + timeout_s
        while not done.is_set() and time.monotonic() < deadline:
            read: dict[str, Any] = {}
            read_done = threading.Event()
            threading.Thread(
                target=self._read_into,
                args=(read, read_done),
                name="asyncsave-liveness",
                daemon=True,
            ).start()
            read_done.wait(self.window)
            gone = self._gone(read.get("counts", {}), seen, since, time.monotonic())
            if gone:
                return gone
            done.wait(min(self.interval, max(0.0, deadline - time.monotonic())))
        return {}


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
        self.liveness: Liveness | None = None
        self.policy_group: Any = None  # agreed save policies: a group of their own
        self._turns = Turns()  # the collective order of saves

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
        self = cls(group, timeout_s)
        # Save policies exchange their answers from the training thread at every
        # step: on a group of their own, so they never interleave with the save
        # collectives (worker threads) on ``group``.
        self.policy_group = await anyio.to_thread.run_sync(
            functools.partial(
                dist.new_group,
                backend="gloo",
                timeout=datetime.timedelta(seconds=timeout_s),
                group_desc="asyncsave-policy",
            ),
            abandon_on_cancel=True,
        )
        token = await self.broadcast("liveness", uuid.uuid4().hex[:16])
        try:
            store = dist.distributed_c10d._get_default_store()
        except Exception:  # no store to beat through: gloo's own errors only
            logger.warning("no process-group store: dead ranks are not named", exc_info=True)
        else:
            self.liveness = Liveness(store, token, self.rank, self.world_size, timeout_s)
        return self

    def close(self) -> None:
        if self.liveness is not None:
            self.liveness.close()

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
        """Run one collective in a daemon thread while the peers' heartbeats are
        watched: a peer that dies ends the wait (the thread is abandoned). Any
        failure is a :class:`RankFailedError` (:meth:`_translate`)."""
        box, gone = await self._race_liveness(func, obj)
        if "value" in box:
            return box["value"]
        error = box.get("error")
        if error is not None and not isinstance(error, Exception):
            raise error  # KeyboardInterrupt and the like: not a rank's failure
        raise self._translate(what, step, error, gone)

    async def watched(self, what: str, func: Callable[[], Any], step: int | None) -> Any:
        box, gone = await self._race_liveness(func)
        if "value" in box:
            return box["value"]
        if gone:
            raise self._translate(what, step, box.get("error"), gone)
        raise box["error"]

    async def _race_liveness(
        self, func: Callable[..., Any], *args: Any
    ) -> tuple[dict[str, Any], dict[int, str]]:
        """``func(*args)`` in a daemon thread (:func:`_boxed`) raced against the
        peers' heartbeats: its box, and the ranks found gone. When the call failed
        first (gloo saw a closed connection), the heartbeats are watched one window
        more, to tell the dead from the slow."""
        out: dict[str, Any] = {}
        liveness = self.liveness
        async with anyio.create_task_group() as tg:

            async def run() -> None:
                out["box"] = await _boxed(func, *args)
                tg.cancel_scope.cancel()

            async def watch() -> None:
                assert liveness is not None
                # Most collectives end within milliseconds: the store is read
                # only for one that lasts one heartbeat interval (a rank dead
                # meanwhile is named ``interval`` s later, well within the bound).
                await anyio.sleep(liveness.interval)
                out["gone"] = await liveness.watch()
                tg.cancel_scope.cancel()

            tg.start_soon(run)
            if liveness is not None:
                tg.start_soon(watch)
        box: dict[str, Any] = out.get("box", {})
        gone: dict[int, str] = out.get("gone", {})
        if "value" not in box and not gone and liveness is not None:
            with anyio.move_on_after(liveness.window + 2 * liveness.interval):
                gone = await liveness.watch()
        return box, gone

    def _translate(
        self, what: str, step: int | None, exc: BaseException | None, gone: dict[int, str]
    ) -> RankFailedError:
        """The one place a collective's foreign error becomes asyncsave's."""
        at = f" of step {step}" if step is not None else ""
        cause = f" ({exc})" if exc is not None else ""
        if gone:
            error = RankFailedError(
                f"rank {self.rank}: the {what} collective{at} on asyncsave's gloo group "
                f"failed: " + "; ".join(gone[r] for r in sorted(gone)) + cause,
                step=step,
                rank=min(gone),
                ranks=gone,
            )
        else:
            error = RankFailedError(
                f"rank {self.rank}: the {what} collective{at} on asyncsave's gloo group "
                f"failed: another rank died or did not reach it within "
                f"dist_timeout_s={self.timeout_s}{cause}",
                step=step,
                rank=None,
            )
        error.__cause__ = exc
        return error

    async def broadcast(self, what: str, obj: Any, step: int | None = None) -> Any:
        return await self._collective(what, self._broadcast, obj, step)

    async def all_gather(self, what: str, obj: Any, step: int | None = None) -> list[Any]:
        result: list[Any] = await self._collective(what, self._all_gather, obj, step)
        return result

    def vote(self, values: list[int]) -> list[list[int]]:
        """The exchange of agreed save policies, from the caller's thread: an
        ``all_gather`` on the policy group in a daemon thread, raced against the
        peers' heartbeats like every save collective (:meth:`_race_liveness`), so
        a rank that died before or during it is named on the survivors.

        :raises RankFailedError: a rank died (named in ``ranks``), or did not take
            part within ``dist_timeout_s``.
        """
        import torch

        mine = torch.tensor(values, dtype=torch.int64)
        out = [torch.empty_like(mine) for _ in range(self.world_size)]
        box: dict[str, Any] = {}
        done = threading.Event()

        def target() -> None:
            try:
                dist.all_gather(out, mine, group=self.policy_group)
                box["value"] = None
            except BaseException as exc:  # handed to the caller's thread
                box["error"] = exc
            finally:
                done.set()

        threading.Thread(target=target, name="asyncsave-policy-vote", daemon=True).start()
        liveness = self.liveness
        gone: dict[int, str] = {}
        if liveness is None:
            done.wait()  # bounded by the policy group's timeout (dist_timeout_s)
        elif not done.wait(liveness.interval):  # most exchanges end within ms
            gone = liveness.watch_blocking(done)
        if "value" not in box and not gone and liveness is not None:
            # gloo failed first (a closed connection): one window more, to tell
            # the dead from the slow.
            gone = liveness.watch_blocking(
                threading.Event(), liveness.window + 2 * liveness.interval
            )
        if "value" in box:
            return [t.tolist() for t in out]
        error = box.get("error")
        if error is not None and not isinstance(error, Exception):
            raise error  # KeyboardInterrupt and the like: not a rank's failure
        raise self._translate("save-policy", values[-1], error, gone)

    # -- ordering of saves ----------------------------------------------------------
    def take_ticket(self) -> int:
        return self._turns.take()

    async def wait_turn(self, ticket: int) -> None:
        await self._turns.wait(ticket)

    def end_turn(self, ticket: int) -> None:
        self._turns.end(ticket)
