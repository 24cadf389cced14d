"""Hangs, dead workers and cancellation at every call of a save (S4, invariant 3;
issue 4, item 5). Extends tests/test_engine.py, which covers a hung data write,
close_timeout_s and a cancelled pump at one point: here the stuck or interrupted
call is each call of the save in turn (enumerated through the tracing shim).

Timeouts are short (0.3 s); each wait is also wrapped in a generous
``anyio.fail_after`` that only detects a hang (no wall-clock assertion).
"""

from __future__ import annotations

import functools
import logging
import threading
from pathlib import Path
from typing import Any

import anyio
import pytest
from crashlab import final_dirs, same_state, state_of
from fstrace import TracingFS
from reliability import record

import asyncsave
from asyncsave.testing import leftover_temp_names, thresholds

pytestmark = pytest.mark.anyio

HANG_GUARD_S = 30


class Died(BaseException):
    """A worker thread's death that is not an ``Exception`` (as ``SystemExit``)."""


class StuckFS(TracingFS):
    """Call number ``at`` waits on ``gate``; then, if ``then_fail``, it raises (a
    hung NFS call that errors once released), else the call goes ahead."""

    def __init__(self, root: Path, at: int, *, then_fail: bool) -> None:
        super().__init__(root, before=self._before, record=False)
        self.at, self.then_fail = at, then_fail
        self.gate = threading.Event()
        self.reached = threading.Event()
        self.fired: tuple[str, str] | None = None

    def _before(self, index: int, op: str, path: str) -> None:
        if index == self.at:
            self.fired = (op, path)
            self.reached.set()
            self.gate.wait(60)
            if self.then_fail:
                raise OSError(5, "released after hanging", path)


def save_calls(root: Path, **options: Any) -> tuple[int, int]:
    """(calls before step 2's save, calls of that save) in a clean run."""
    fs = TracingFS(root, record=False)

    async def go() -> tuple[int, int]:
        async with asyncsave.Checkpointer(root, filesystem=fs, **options) as ckpt:
            await (await ckpt.save(1, state_of(1)))
            before = fs.calls
            await (await ckpt.save(2, state_of(2)))
            return before, fs.calls - before

    return anyio.run(go)


def check_clean_after_reopen(root: Path, *, committed: bool = True) -> None:
    """Every final directory is whole, the latest resumes, no temporary name is
    left; ``committed``: step 1 or 2 was committed."""

    async def go() -> None:
        async with asyncsave.Checkpointer(root) as ckpt:
            restored = await ckpt.load_latest()
            if restored is None and not committed:
                return
            assert restored is not None and restored.info.step in (1, 2)
            assert same_state(restored.state, state_of(restored.info.step))

    for step, path in final_dirs(root).items():
        asyncsave.verify(path)
        assert same_state(asyncsave.load(path), state_of(step))
    anyio.run(go)
    assert not leftover_temp_names(root)


async def stuck_case(root: Path, at: int, timeout_s: float, options: dict[str, Any]) -> StuckFS:
    """Save steps 1 and 2 with call ``at`` stuck (then failing): ``save()``
    returns, the handle, the next save, ``wait()`` and close raise one
    ``CheckpointTimeoutError``, unless the stuck call was never reached
    (``fired`` is ``None``: the timeout ran out before it)."""
    fs = StuckFS(root, at, then_fail=True)
    at_handle: pytest.ExceptionInfo[asyncsave.CheckpointTimeoutError] | None = None
    try:
        with anyio.fail_after(HANG_GUARD_S):
            with pytest.raises(asyncsave.CheckpointTimeoutError) as at_close:
                async with asyncsave.Checkpointer(
                    root,
                    filesystem=fs,
                    save_timeout_s=timeout_s,
                    close_timeout_s=timeout_s,
                    **options,
                ) as ckpt:
                    await (await ckpt.save(1, state_of(1)))
                    handle = await ckpt.save(2, state_of(2))
                    # a bounded wait gives up first; the save goes on
                    with pytest.raises(asyncsave.WaitTimeoutError):
                        await handle.wait(timeout_s=timeout_s / 6)
                    with pytest.raises(asyncsave.CheckpointTimeoutError) as at_handle:
                        await handle
                    with pytest.raises(asyncsave.CheckpointTimeoutError):
                        await ckpt.save(3, state_of(3))
                    with pytest.raises(asyncsave.CheckpointTimeoutError):
                        await ckpt.wait()
    finally:
        fs.gate.set()  # the abandoned thread wakes and fails
    if fs.fired is not None:
        assert at_handle is not None and at_close.value is at_handle.value, fs.fired
    return fs


async def settle(fs: TracingFS) -> None:
    """Wait until the shim has seen no call for 0.2 s (abandoned threads done)."""
    last, quiet = -1, 0
    for _ in range(250):
        quiet = quiet + 1 if fs.calls == last else 0
        if quiet >= 10:
            return
        last = fs.calls
        await anyio.sleep(0.02)


async def test_a_worker_that_dies_fails_the_save_instead_of_cancelling_the_pump(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Regression: a BaseException in a writer thread used to escape into the
    checkpointer's task group, cancel the caller's task and leave the handle
    unresolved (found by this suite)."""
    caplog.set_level(logging.CRITICAL, logger="asyncsave")

    class DyingFS(TracingFS):
        def write(self, fd: int, data: memoryview) -> int:
            if "-tmp-2-" in self._fd_path.get(fd, ""):
                raise Died("the writer thread died")
            return super().write(fd, data)

    fs = DyingFS(tmp_path, record=False)
    with anyio.fail_after(HANG_GUARD_S):
        with pytest.raises(asyncsave.SaveFailedError) as at_close:
            async with asyncsave.Checkpointer(tmp_path, filesystem=fs) as ckpt:
                await (await ckpt.save(1, state_of(1)))
                handle = await ckpt.save(2, state_of(2))
                with pytest.raises(asyncsave.SaveFailedError) as at_handle:
                    await handle
                assert isinstance(at_handle.value.__cause__.__cause__, Died)
                with pytest.raises(asyncsave.SaveFailedError):
                    await ckpt.save(3, state_of(3))
                await anyio.sleep(0)  # the pump was not cancelled: it runs on
    assert at_close.value is at_handle.value
    assert sorted(final_dirs(tmp_path)) == [1]
    assert not leftover_temp_names(tmp_path)


@pytest.mark.slow  # every call of a save in turn (test_engine covers one point)
@pytest.mark.parametrize(
    ("anyio_backend", "overlap"),
    [("asyncio", False), ("trio", False), ("asyncio", True)],
    ids=["asyncio", "trio", "asyncio-overlap"],
)
async def test_a_call_stuck_forever_anywhere_in_a_save_times_out_everywhere(
    tmp_path: Path,
    anyio_backend: str,
    overlap: bool,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Each I/O call of step 2 in turn hangs: ``save()`` returns, the handle, the
    next save, ``wait()`` and close raise one ``CheckpointTimeoutError``. With
    ``overlap``, step 2's files are written while it is staged
    (``overlap_writes=True``): its temporary directory is made by the writers'
    task, so a hung ``mkdir`` does not hold ``save()`` either."""
    caplog.set_level(logging.CRITICAL, logger="asyncsave")
    options: dict[str, Any] = {"overlap_writes": True} if overlap else {}
    # with overlap, even this small state is written while it is staged
    with thresholds(follow_min_bytes=0 if overlap else None):
        before, n = await anyio.to_thread.run_sync(
            functools.partial(save_calls, tmp_path / "clean", **options)
        )
        for i in range(1, n + 1):
            # A case is inconclusive when the stuck call was never reached: the
            # clean part (step 1, or step 2's calls before call i) took longer
            # than the timeout on a loaded machine. It is run again with twice
            # the timeout; a case is never passed without its call hanging.
            for attempt in range(4):
                root = tmp_path / f"case-{i}-{attempt}"
                fs = await stuck_case(root, before + i, 0.3 * 2**attempt, options)
                reached = fs.fired is not None
                await anyio.to_thread.run_sync(
                    functools.partial(check_clean_after_reopen, root, committed=reached)
                )
                if reached:
                    break
            assert fs.fired is not None, f"call {i} was never reached in 4 attempts"
        record("hang points", n)


@pytest.mark.slow  # every call of a save in turn (test_engine covers one point)
@pytest.mark.parametrize("anyio_backend", ["asyncio", "trio"])
async def test_cancelling_the_pump_at_any_call_leaves_no_partial_final_directory(
    tmp_path: Path, anyio_backend: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The pump is cancelled while the save's call ``i`` is stuck and close gives
    up after close_timeout_s: what is left under a final name is whole, and the next
    open removes the rest. The stuck call is then let go, as a disk that answers
    late would."""
    caplog.set_level(logging.CRITICAL, logger="asyncsave")
    before, n = await anyio.to_thread.run_sync(save_calls, tmp_path / "clean")
    for i in range(1, n + 1):
        root = tmp_path / f"case-{i}"
        fs = StuckFS(root, before + i, then_fail=False)
        with anyio.fail_after(HANG_GUARD_S):
            with anyio.CancelScope() as scope:
                async with asyncsave.Checkpointer(root, filesystem=fs, close_timeout_s=0.2) as ckpt:
                    await (await ckpt.save(1, state_of(1)))
                    await ckpt.save(2, state_of(2))
                    await anyio.to_thread.run_sync(fs.reached.wait, 10)
                    scope.cancel()
                    await anyio.sleep(HANG_GUARD_S)
        assert scope.cancelled_caught
        fs.gate.set()
        await settle(fs)  # the late call, and what its abandoned thread does next
        for path in final_dirs(root).values():
            asyncsave.verify(path)
        await anyio.to_thread.run_sync(check_clean_after_reopen, root)
    record("cancellation points", n)
