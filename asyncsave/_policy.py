"""Save policies: small objects a train pump asks, once per trained step, whether
to save now and whether to stop.

::

    policy = asyncsave.SaveEvery(100) | asyncsave.SaveAtStep(total_steps) \\
        | asyncsave.SaveOnSignal(signal.SIGTERM)
    with policy:          # installs the handler (kept through the close's flush once caught)
        for step in range(start, total_steps + 1):
            train_one_step()
            if policy.should_save(step):
                await ckpt.save(step, state)
            if policy.stop_requested:
                break                             # preempted: saved, now stop

``step`` is the last trained step (the number the checkpoint is named after: never one past it, as in the SkyRL fully-async checkpoint fix);
call :meth:`SavePolicy.should_save` exactly once per step, after the step trained:
time-based policies measure the step time between calls.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import signal
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Iterable
from types import FrameType, TracebackType
from typing import Any

__all__ = [
    "AgreedPolicy",
    "SaveAtStep",
    "SaveBeforeDeadline",
    "SaveEvery",
    "SaveOnSignal",
    "SavePolicy",
]

logger = logging.getLogger("asyncsave")


class SavePolicy:
    """Base of the save policies; combine them with ``|`` (save when any says so,
    stop when any asks). Policies that install something (signal handlers) do it
    in ``__enter__`` / :meth:`install` and undo it in ``__exit__`` / :meth:`close`."""

    def should_save(self, step: int) -> bool:
        """Whether to save the state after trained step ``step``."""
        raise NotImplementedError

    @property
    def stop_requested(self) -> bool:
        """Whether the pump should stop after this step's save (preemption, a
        deadline reached)."""
        return False

    def install(self) -> None:
        """Install what the policy needs (nothing, by default)."""

    def close(self) -> None:
        """Undo :meth:`install`. Once the policy has caught a signal (or, agreed
        across ranks, a stop), its signal handlers stay installed until the
        checkpointers open at this call have closed, so that a repeated signal
        cannot kill the process while their close flushes the save it asked for
        (see :class:`SaveOnSignal`)."""
        self._close(hold=self._preempted())

    def _preempted(self) -> bool:
        """Whether this policy caught a signal (the process is being stopped)."""
        return False

    def _close(self, hold: bool) -> None:
        """Undo :meth:`install`; ``hold``: keep signal handlers until the flush."""

    def __enter__(self) -> SavePolicy:
        self.install()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def __or__(self, other: SavePolicy) -> SavePolicy:
        if not isinstance(other, SavePolicy):
            return NotImplemented
        return _AnyPolicy((*_parts(self), *_parts(other)))


def _close_part(p: SavePolicy, hold: bool) -> None:
    if type(p).close is SavePolicy.close:
        p._close(hold)
    else:
        p.close()  # a policy of the caller's own that undoes its install in close()


def _parts(p: SavePolicy) -> tuple[SavePolicy, ...]:
    return p.policies if isinstance(p, _AnyPolicy) else (p,)


def _check_step(step: object) -> int:
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"step must be a non-negative int, got {step!r}")
    return step


class _AnyPolicy(SavePolicy):
    def __init__(self, policies: tuple[SavePolicy, ...]) -> None:
        self.policies = policies

    def should_save(self, step: int) -> bool:
        # Every policy sees every step (time-based ones measure between calls).
        answers = [p.should_save(step) for p in self.policies]
        return any(answers)

    @property
    def stop_requested(self) -> bool:
        return any(p.stop_requested for p in self.policies)

    def install(self) -> None:
        done: list[SavePolicy] = []
        try:
            for p in self.policies:
                p.install()
                done.append(p)
        except BaseException:
            for p in reversed(done):
                p.close()
            raise

    def _preempted(self) -> bool:
        return any(p._preempted() for p in self.policies)

    def _close(self, hold: bool) -> None:
        for p in reversed(self.policies):
            _close_part(p, hold)

    def __repr__(self) -> str:
        return " | ".join(repr(p) for p in self.policies)


@dataclasses.dataclass
class SaveEvery(SavePolicy):
    """Save after every ``n``-th step (``step % n == 0``); never at step 0.

    :param n: the period in steps (a positive int).
    :raises ValueError: ``n`` is not a positive int.
    """

    n: int

    def __post_init__(self) -> None:
        if isinstance(self.n, bool) or not isinstance(self.n, int) or self.n < 1:
            raise ValueError(f"SaveEvery.n must be a positive int, got {self.n!r}")

    def should_save(self, step: int) -> bool:
        return _check_step(step) > 0 and step % self.n == 0


@dataclasses.dataclass
class SaveAtStep(SavePolicy):
    """Save after the given steps (typically the last one:
    ``SaveAtStep(total_steps)``).

    :param steps: one positive step or several.
    """

    steps: int | Iterable[int]

    def __post_init__(self) -> None:
        steps = [self.steps] if isinstance(self.steps, int) else list(self.steps)
        for s in steps:
            if _check_step(s) == 0:
                raise ValueError("SaveAtStep: step 0 holds an untrained model; use steps >= 1")
        self._set = frozenset(steps)

    def should_save(self, step: int) -> bool:
        return _check_step(step) in self._set


class SaveBeforeDeadline(SavePolicy):
    """Save once before a wall-clock deadline (a job's time limit), then ask the
    pump to stop.

    The step time is measured between calls of :meth:`should_save`; the policy
    fires at the first step after which another step (the slowest of the last
    ``window`` steps) plus ``reserve_s`` would no longer fit before ``deadline``.

    The first step is timed from :meth:`install` (``with policy:``), or from
    construction; ``expected_step_s`` is a floor under the measured step time (so
    a job resumed close to its deadline is safe before any step was measured).

    :param deadline: the time limit, in the units of ``clock`` (default: Unix
        seconds, ``time.time()``).
    :param reserve_s: seconds kept for the save itself and shutdown (time to
        durable of an earlier save is a good value).
    :param expected_step_s: the least step time to assume, in seconds.
    :param clock: returns the current time; tests pass a fake clock.
    :param window: how many recent step times to take the maximum of.
    :param stop: also request a stop once fired (default ``True``).
    """

    def __init__(
        self,
        deadline: float,
        *,
        reserve_s: float = 0.0,
        expected_step_s: float = 0.0,
        clock: Callable[[], float] = time.time,
        window: int = 8,
        stop: bool = True,
    ) -> None:
        for name, value in (
            ("deadline", deadline),
            ("reserve_s", reserve_s),
            ("expected_step_s", expected_step_s),
        ):
            if not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ValueError(f"SaveBeforeDeadline: {name}={value!r} must be a finite number")
        if reserve_s < 0 or expected_step_s < 0 or window < 1:
            raise ValueError("reserve_s and expected_step_s must be >= 0, window >= 1")
        self.deadline = float(deadline)
        self.reserve_s = float(reserve_s)
        self.clock = clock
        self.stop = stop
        self.expected_step_s = float(expected_step_s)
        self.fired = False
        self._last: float = clock()
        self._steps: deque[float] = deque(maxlen=window)

    def install(self) -> None:
        self._last = self.clock()  # the first step is timed from here

    def should_save(self, step: int) -> bool:
        _check_step(step)
        now = self.clock()
        self._steps.append(max(0.0, now - self._last))
        self._last = now
        if self.fired:
            return False
        step_s = max(*self._steps, self.expected_step_s)
        if now + step_s + self.reserve_s >= self.deadline:
            self.fired = True
            logger.info(
                "deadline in %.1f s, next step needs ~%.1f s (+%.1f s reserve): saving step %d",
                self.deadline - now,
                step_s,
                self.reserve_s,
                step,
            )
            return step > 0
        return False

    @property
    def stop_requested(self) -> bool:
        return self.stop and self.fired

    def __repr__(self) -> str:
        return f"SaveBeforeDeadline({self.deadline}, reserve_s={self.reserve_s})"


class _HandlerHolds:
    """The signal handlers of policies that caught a signal, kept installed past
    their block until every checkpointer open at that moment has closed (its close
    flushes the save the signal asked for), then restored in the order the blocks
    ended. Handlers are set and restored on the main thread (Python's rule), so
    only checkpointers entered there count: a :class:`SyncCheckpointer` counts for
    the engine it runs on its portal's thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._open: weakref.WeakSet[object] = weakref.WeakSet()
        self._held: list[tuple[SaveOnSignal, weakref.WeakSet[object]]] = []
        self._installed: weakref.WeakSet[SaveOnSignal] = weakref.WeakSet()

    def installed(self, policy: SaveOnSignal) -> None:
        """``policy``'s handlers are in place (until its :meth:`put_back`)."""
        with self._lock:
            self._installed.add(policy)

    def put_back(self, policy: SaveOnSignal, previous: dict[int, Any]) -> list[int]:
        """Put back the handlers ``policy`` replaced (main thread), on each signal
        where its own handler is still the one installed. Where another policy
        installed its handler over it, that one puts ``previous`` back in its turn;
        where anyone else did (the trainer's own handler, ``SIG_IGN``), theirs
        stays. :returns: the signals whose handler was left as it was."""
        left = []
        with self._lock:
            self._installed.discard(policy)
            for sig, handler in previous.items():
                if signal.getsignal(sig) == policy._handler:
                    # None: not installed from Python; the default is the closest.
                    signal.signal(sig, signal.SIG_DFL if handler is None else handler)
                    continue
                over = [p for p in self._installed if p._previous.get(sig) == policy._handler]
                if over:
                    over[0]._previous[sig] = handler
                else:
                    left.append(sig)
        return left

    def opened(self, owner: object) -> None:
        """``owner`` (a checkpointer) was entered: its close flushes saves."""
        if threading.current_thread() is threading.main_thread():
            with self._lock:
                self._open.add(owner)

    def closed(self, owner: object) -> None:
        """``owner``'s close has flushed: restore the handlers held for it alone."""
        with self._lock:
            self._open.discard(owner)
            for _, waits in self._held:
                waits.discard(owner)
            if threading.current_thread() is not threading.main_thread():
                return  # an owner never registered; restored at a later close
            due = self._due()
        for policy in due:
            policy._restore()

    def release(self, policy: SaveOnSignal, caught: bool) -> bool:
        """The block of ``policy`` ended: restore its handlers now, or hold them
        (``True``) until the checkpointers open now have closed, when it ``caught``
        a signal. A policy on a signal whose handler an earlier one holds is held
        behind it, so that the handlers go back in the order they were replaced."""
        with self._lock:
            self._held = [(p, w) for p, w in self._held if p is not policy]
            mine = set(policy.signals)
            behind = any(mine & set(p.signals) for p, _ in self._held)
            if behind or (caught and self._open):
                self._held.append((policy, weakref.WeakSet(self._open)))
                due = self._due()
            else:
                due = [policy]
        for p in due:
            p._restore()
        return policy not in due

    def _due(self) -> list[SaveOnSignal]:
        """Take the held policies whose checkpointers have all closed and that no
        earlier held policy on one of their signals still waits for."""
        due: list[SaveOnSignal] = []
        kept: list[tuple[SaveOnSignal, weakref.WeakSet[object]]] = []
        blocked: set[int] = set()
        for policy, waits in self._held:
            if waits or blocked & set(policy.signals):
                kept.append((policy, waits))
                blocked.update(policy.signals)
            else:
                due.append(policy)
        self._held = kept
        return due

    def drop(self, policy: SaveOnSignal) -> None:
        """``policy`` was entered again: its handlers are its own block's again."""
        with self._lock:
            self._held = [(p, w) for p, w in self._held if p is not policy]


class SaveOnSignal(SavePolicy):
    """Preemption: when one of ``signals`` arrives (SIGTERM from Slurm or
    Kubernetes, say), save at the next step boundary and ask the pump to stop.

    The handler only sets a flag (safe at any instant); the save happens in the
    pump, at a step boundary, so the checkpoint is never torn. Handlers are
    installed by ``with policy:`` / :meth:`install` (from the main thread, as
    Python requires) and the previous ones restored by :meth:`close`.

    The scope of the handlers: from ``with policy:`` to the end of the block; or,
    once a signal was caught, to the end of the close of every checkpointer
    (:class:`Checkpointer` or :class:`SyncCheckpointer` entered on the main thread)
    that was open when the block ended, so after the flush of the save the signal
    asked for. Schedulers repeat SIGTERM within their grace period and users press
    Ctrl-C twice: a repeat in that time (during the flush, or during the work the
    program does between the block and the close) is absorbed (counted in
    :attr:`repeats`, logged when the handlers are restored, saying when it came)
    instead of killing the process with the save uncommitted (Source:
    https://github.com/goodfire-ai/spd/issues/677). Nothing is re-delivered
    afterwards: the signal already made the pump stop, and the program ends as it
    does after a stop. The previous handler is put back for any later signal
    where the policy's own is still installed; a handler installed over it since
    (the trainer's own, ``SIG_IGN``) is left in place. SIGKILL still abandons the
    flush; a checkpointer closed already, or a policy block around the
    checkpointer's, needs no hold.

    :param signals: signal numbers (default ``SIGTERM``).
    """

    def __init__(self, *signals: int) -> None:
        self.signals = tuple(signals) or (signal.SIGTERM,)
        self.received: int | None = None
        self._saved = False
        self.repeats = 0  # signals caught after the first one (absorbed)
        self._previous: dict[int, Any] = {}
        self._repeats_in_block: int | None = None  # repeats when the block ended
        self._lock = threading.Lock()

    def _handler(self, signum: int, frame: FrameType | None) -> None:
        # Only flags: this runs between any two bytecodes of the main thread.
        if self.received is not None:
            self.repeats += 1
        self.received = signum

    def install(self) -> None:
        if self._previous:
            signal_holds.drop(self)  # entered again while its handlers were held
            self._repeats_in_block = None
            return
        self._repeats_in_block = None
        signal_holds.installed(self)
        try:
            for sig in self.signals:
                self._previous[sig] = signal.signal(sig, self._handler)
        except BaseException:
            self._restore()
            raise

    def _preempted(self) -> bool:
        return self.received is not None

    def _close(self, hold: bool) -> None:
        self._repeats_in_block = self.repeats
        if self._previous and signal_holds.release(self, hold) and hold:
            logger.warning(
                "%r caught a signal: its handlers stay installed until the open "
                "checkpointers have closed and flushed their saves (at most "
                "close_timeout_s); a repeated signal is absorbed until then, "
                "SIGKILL abandons the saves",
                self,
            )

    def _restore(self) -> None:
        """Put back the handlers :meth:`install` replaced (main thread only), where
        this policy's handler is still the one installed."""
        previous, self._previous = self._previous, {}
        left = signal_holds.put_back(self, previous)
        if left:
            logger.info(
                "%r: left the handler of %s as it is: it was installed after this "
                "policy's, by someone else",
                self,
                ", ".join(signal.Signals(s).name for s in left),
            )
        if previous:
            self._report_repeats()

    def _report_repeats(self) -> None:
        in_block = self.repeats if self._repeats_in_block is None else self._repeats_in_block
        after = self.repeats - in_block
        if in_block:
            logger.warning(
                "%r: the signal came %d more time(s) inside the policy's block; "
                "absorbed (the first one had already asked for a save and a stop)",
                self,
                in_block,
            )
        if after:
            logger.warning(
                "%r: the signal came %d more time(s) after the policy's block ended, "
                "before the checkpointers open then had closed; absorbed, because the "
                "save it asked for was pending until their close committed it (the "
                "work after the block went on; SIGKILL stops it)",
                self,
                after,
            )

    def trigger(self, signum: int = signal.SIGTERM) -> None:
        """Act as if ``signum`` arrived (for tests and for other notifiers)."""
        self.received = signum

    def should_save(self, step: int) -> bool:
        _check_step(step)
        with self._lock:
            if self.received is None or self._saved:
                return False
            self._saved = True
        logger.warning(
            "signal %s received: saving step %d, then stopping",
            signal.Signals(self.received).name,
            step,
        )
        return step > 0

    @property
    def stop_requested(self) -> bool:
        # Only once should_save() has seen the signal: a signal landing between a
        # pump's should_save() and its stop check is saved at the next boundary,
        # never dropped.
        return self._saved

    def __repr__(self) -> str:
        return f"SaveOnSignal({', '.join(signal.Signals(s).name for s in self.signals)})"


class AgreedPolicy(SavePolicy):
    """A policy whose answers every rank agrees on, at every step.

    Made by :meth:`Checkpointer.agree` (``policy = ckpt.agree(SaveEvery(100) |
    SaveOnSignal())``). Each call of :meth:`should_save` asks the wrapped policy
    on this rank, then exchanges ``(save, stop, step)`` with every rank (an
    ``all_gather`` of three integers on a gloo group of asyncsave's own, as
    Megatron's signal handler does every iteration): every rank saves when any
    rank's policy says so, and every rank stops after it when any rank's policy
    asks to stop. So a SIGTERM that reached one node, or one rank's deadline
    estimate, makes every rank save the same step and stop. With one process the
    exchange is the identity.

    The exchange blocks the calling thread (a few hundred microseconds when the
    ranks arrive together), bounded by ``dist_timeout_s``; every rank must call
    :meth:`should_save` once per step, at the same step.

    :raises CheckpointError: (from :meth:`should_save`) the ranks passed
        different steps.
    :raises RankFailedError: (from :meth:`should_save`) a rank did not take part
        within ``dist_timeout_s``; a rank that died before or during the exchange
        is named in ``ranks`` once its heartbeat has stopped for
        ``min(dist_timeout_s / 2, 10)`` s (as in a save's collectives).
    """

    def __init__(self, policy: SavePolicy, vote: Callable[[list[int]], list[list[int]]]) -> None:
        self.policy = policy
        self._vote = vote
        self._stop = False

    def should_save(self, step: int) -> bool:
        from ._errors import CheckpointError

        _check_step(step)
        save = self.policy.should_save(step)
        votes = self._vote([int(save), int(self.policy.stop_requested), step])
        steps = sorted({v[2] for v in votes})
        if len(steps) > 1:
            raise CheckpointError(
                f"the ranks asked their save policy about different steps ({steps}): "
                "every rank must call should_save() once per step, at the same step",
                step=step,
            )
        agreed = any(v[0] for v in votes)
        self._stop = self._stop or any(v[1] for v in votes)
        if agreed and not save:
            logger.info("saving step %d: another rank's policy asked for it", step)
        return agreed and step > 0

    @property
    def stop_requested(self) -> bool:
        return self._stop

    def install(self) -> None:
        self.policy.install()

    def _preempted(self) -> bool:
        # Every rank is stopping once any rank caught a signal: every rank keeps
        # its handlers through the flush (a rank killed then loses the save).
        return self._stop or self.policy._preempted()

    def _close(self, hold: bool) -> None:
        _close_part(self.policy, hold)

    def __repr__(self) -> str:
        return f"AgreedPolicy({self.policy!r})"


signal_holds = _HandlerHolds()
"""The process's holds; the checkpointers report their open and close here."""
