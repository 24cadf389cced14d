"""Opening and closing the root of one :class:`~asyncsave.Checkpointer`.

Opening takes the root's lock and recovers the root (rank 0, or each rank its own
root with ``Tier(local_scope="rank")``), opens the persistent tier if there is
one, moves the tracker forward and starts the checkpointer's task group. Closing
flushes every accepted save within ``close_timeout_s``, abandons what is left
past it, and releases the task group, the staging pool, the root's lock, the
ranks' group and the persistent tier. The rules are the checkpointer's
(its class docstring); this module only carries them out.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import anyio
import anyio.to_thread

from ._commit import Recovered, lock_root, recover
from ._coord import GlooGroup, Solo, wants_distributed
from ._errors import CheckpointTimeoutError, RootInUseError, SaveFailedError
from ._incremental import Reuse
from ._pipeline import Saver
from ._stage import StagingPool
from ._track import TrackerWriter
from ._types import Phase

if TYPE_CHECKING:
    from ._tiers import Persister

__all__ = ["Lifecycle"]

logger = logging.getLogger(__name__)


class Lifecycle:
    """Opens and closes the root of one checkpointer (``saver``), with its
    persistent tier (``tiers``, or ``None``) and the memory of its incremental
    saves (``reuse``). Holds the root's lock between the two.

    Call sequence (the checkpointer's): :meth:`open` once, on entering;
    :meth:`shutdown` on leaving (idempotent); :meth:`release_lock` when the
    checkpointer is collected while open.
    """

    def __init__(self, saver: Saver, tiers: Persister | None, reuse: Reuse) -> None:
        self.saver = saver
        self.tiers = tiers
        self.reuse = reuse
        self.lock_fd: int | None = None

    async def open(self) -> None:
        """Open the root: the staging pool, the ranks' group, the root's lock and
        recovery, the persistent tier, the tracker, the task group. On failure
        what was opened is released (the error propagates)."""
        saver, options, tiers = self.saver, self.saver.options, self.tiers
        saver.pool = StagingPool(options.budget_bytes)
        saver.limiter = anyio.CapacityLimiter(options.writer_threads)
        if options.coordinator is not None:  # given (asyncsave.testing.FakeGroup)
            saver.coord = options.coordinator
        elif wants_distributed(options.distributed):
            saver.coord = await GlooGroup.create(options.dist_timeout_s)
        if tiers is not None:  # Tier(local_scope="rank"): this rank's own root
            tiers.place_local()
        # Rank 0 alone locks and recovers (each rank its own root); the others wait.
        opener = Solo() if saver.per_rank else saver.coord
        committed, tracked = await opener.open_root(self._open_root, saver.root)
        saver.committed.update(dict.fromkeys(committed))
        if tiers is not None:  # on failure, releases what is open already
            await tiers.open(self.unlock)
        await self._open_tracker(tracked)
        tg = anyio.create_task_group()
        await tg.__aenter__()
        saver.tg = tg
        saver.accepting = True
        saver.state = Phase.OPEN
        if tiers is not None:  # what an earlier run left unpersisted
            tiers.catch_up()

    async def _open_tracker(self, tracked: int | None) -> None:
        # Forward only, even past a tracker that names a checkpoint that is gone:
        # saves below it commit but do not move it (resume then needs fallback=True).
        # From the committed steps as the tier's open left them (node-local roots:
        # the steps only some ranks have are moved aside there).
        saver, layout = self.saver, self.saver.layout
        steps = [s for s in (tracked, *saver.committed) if s is not None]
        baseline = tracked if saver.per_rank else max(steps, default=None)
        if layout.tracker_name is not None and saver.owns_root:
            saver.tracker = TrackerWriter(saver.fs, saver.root / layout.tracker_name, baseline)
            if saver.per_rank and saver.committed:  # forward to a step every rank has
                await anyio.to_thread.run_sync(saver.tracker.advance, max(saver.committed))

    async def _open_root(self) -> tuple[list[int], int | None]:
        """Take the saver lock and recover the root: (committed steps, tracked step)."""
        saver = self.saver
        lock = saver.options.lock
        self.lock_fd = await anyio.to_thread.run_sync(lock_root, saver.fs, saver.root, lock)
        try:
            recovered = await anyio.to_thread.run_sync(self._recover)
        except BaseException:
            with anyio.CancelScope(shield=True):
                await self.unlock()
            raise
        if saver.options.incremental:  # growing tensors continue the last commit's chunks
            await anyio.to_thread.run_sync(self.reuse.seed, saver.fs)
        return list(recovered.committed), recovered.tracked

    def _recover(self) -> Recovered:
        saver = self.saver
        timeout_s = saver.options.close_timeout_s
        if not saver.final_lock.acquire(timeout=timeout_s):
            raise RootInUseError(
                f"a commit abandoned by an earlier Checkpointer on {saver.root} in this "
                f"process is still running after close_timeout_s="
                f"{timeout_s}; try again once it finishes",
                path=saver.root,
            )
        try:
            # Node-local roots: the tracker moves forward after the ranks agree.
            return recover(saver.fs, saver.root, saver.layout, forward=not saver.per_rank)
        finally:
            saver.final_lock.release()

    async def shutdown(self) -> SaveFailedError | None:
        """Flush and release (see the checkpointer's class docstring); idempotent.

        :returns: the checkpointer's failure, if a save failed (or close gave up
            after ``close_timeout_s``); ``None`` when closed already.
        """
        saver = self.saver
        if saver.state in (Phase.CLOSING, Phase.CLOSED):
            return None
        if saver.state is Phase.NEW:
            saver.state = Phase.CLOSED
            return None
        saver.state = Phase.CLOSING
        with anyio.CancelScope(shield=True):
            with anyio.move_on_after(saver.options.close_timeout_s):
                await self._flush()
            if saver.pending or saver.held:
                self._abandon()
        # The task group's scope must be exited from outside any scope opened
        # after it; its pipelines are finished or cancelled by now, so this returns
        # as soon as their (shielded, bounded) clean-up is done.
        assert saver.tg is not None and saver.pool is not None
        saver.accepting = False
        try:
            await saver.tg.__aexit__(None, None, None)
        finally:
            with anyio.CancelScope(shield=True):
                await saver.pool.aclose()
                await self.unlock()
            saver.coord.close()
            if self.tiers is not None:
                self.tiers.close()
            saver.state = Phase.CLOSED
        return saver.failure

    async def _flush(self) -> None:
        """Wait for every accepted save and every copy to the persistent tier."""
        saver = self.saver
        while saver.pending or saver.queued or saver.held:
            if saver.pending:
                await next(iter(saver.pending.values()))._done.wait()
            elif saver.queued:  # an admitted overwrite about to become pending
                await next(iter(saver.queued)).wait()
            else:  # a copy to the persistent tier (asyncsave._tiers)
                await next(iter(saver.held.values()))._persisted.wait()

    def _abandon(self) -> None:
        """Past ``close_timeout_s``: fail the checkpointer and cancel what runs."""
        saver = self.saver
        steps = sorted(saver.pending or saver.held)
        saver.set_failure(
            CheckpointTimeoutError(
                f"saves of steps {steps} were still running after "
                f"close_timeout_s={saver.options.close_timeout_s}; abandoned "
                f"uncommitted{'' if saver.pending else ' on the persistent tier'} "
                "(their temporary directories are removed at the next open)",
                step=steps[0],
                path=saver.root,
            )
        )
        saver.give_up()
        for scope in [*saver.scopes.values(), *saver.staging_scopes]:
            scope.cancel()

    async def unlock(self) -> None:
        """Release the root's lock (idempotent)."""
        fd, self.lock_fd = self.lock_fd, None
        if fd is not None:
            await anyio.to_thread.run_sync(self.saver.fs.unlock, fd)

    def release_lock(self) -> None:
        """Release the root's lock at once, never blocking (a checkpointer
        collected while open), so that another checkpointer can open the root."""
        fd, self.lock_fd = self.lock_fd, None
        if fd is not None:
            self.saver.fs.unlock(fd)
