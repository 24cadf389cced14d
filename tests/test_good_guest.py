"""asyncsave is a good guest in the trainer's process: it changes no process-wide
state (the cyclic garbage collector, signal handlers, the thread switch
interval, the environment, torch's thread counts) for longer than one call of
its own, so a trainer's cyclic garbage is collected while saves are in flight
(https://github.com/marin-community/marin/issues/6774: host memory grew save
after save until the trainer was OOM-killed)."""

# Private imports: a unit test of the private garbage-collector pause (gc_paused).
from __future__ import annotations

import gc
import os
import signal
import sys
import threading
import time
import weakref
from pathlib import Path
from typing import Any

import anyio
import anyio.to_thread
import pytest
import torch
from faults import FaultyFS, pause
from hypothesis import given, settings
from hypothesis import strategies as st

import asyncsave
from asyncsave._types import gc_paused

pytestmark = pytest.mark.anyio

# A save of at least this many tensors used to keep the collector off until the
# save was done (1,024 in the release); the tests use twice that.
_MANY = 2048


class _Node:
    """A node of a reference cycle: only the cyclic collector frees it."""

    def __init__(self) -> None:
        self.me = self


def _cyclic_garbage(n: int) -> list[int]:
    """``n`` unreachable reference cycles; the returned list grows by one as each
    is freed."""
    freed: list[int] = []
    for _ in range(n):
        weakref.finalize(_Node(), freed.append, 1)
    return freed


def _allocate(rounds: int) -> None:
    """Objects the collector counts, alive at once (its count drops as they are
    freed): more than its first threshold, so that it runs, if it is on."""
    for _ in range(rounds):
        alive: list[list[int]] = [[] for _ in range(2 * gc.get_threshold()[0])]
        del alive


async def _collected_while_in_flight(freed: list[int], n: int) -> bool:
    """Whether the collector, on its own, frees ``n`` cycles while this loop
    allocates (bounded: 2,000 rounds, each letting other threads run)."""
    for _ in range(2000):
        if len(freed) == n:
            return True
        _allocate(5)
        await anyio.sleep(0.001)
    return len(freed) == n


def _process_state() -> dict[str, Any]:
    """The process-wide settings a library must leave as it found them (the
    collector's on/off switch is checked on its own: see the tests)."""
    handlers = {}
    for sig in signal.valid_signals():
        try:
            handlers[sig] = signal.getsignal(sig)
        except (OSError, ValueError):
            continue
    return {
        "gc.threshold": gc.get_threshold(),
        "gc.frozen": gc.get_freeze_count(),
        "switchinterval": sys.getswitchinterval(),
        "recursionlimit": sys.getrecursionlimit(),
        "environ": dict(os.environ),
        "signals": handlers,
        "torch.threads": torch.get_num_threads(),
        "torch.default_dtype": torch.get_default_dtype(),
        "torch.deterministic": torch.are_deterministic_algorithms_enabled(),
    }


def _state(n: int) -> dict[str, torch.Tensor]:
    return {f"experts.{i // 4}.w{i % 4}": torch.randn(1 + i % 7) for i in range(n)}


def _held_writes() -> tuple[FaultyFS, threading.Event]:
    """A file system whose first write of a data file waits for the gate."""
    gate = threading.Event()
    fs = FaultyFS("write", pause(gate), where=lambda p: p.endswith(".safetensors"))
    return fs, gate


@pytest.mark.parametrize(
    ("n", "lazy", "saves"),
    [(16, False, 1), (_MANY, False, 1), (_MANY, True, 1), (_MANY, False, 3), (_MANY, True, 3)],
    ids=["few-eager", "many-eager", "many-lazy", "many-overlapping", "many-lazy-overlapping"],
)
async def test_cyclic_garbage_is_collected_while_saves_are_in_flight(
    tmp_path: Path, n: int, lazy: bool, saves: int
) -> None:
    """While a save (eager or lazy) is held in its writes, and later saves wait
    behind it, the trainer's cyclic garbage is freed by the collector on its
    own, and every process-wide setting is as it was; the saves then commit."""
    assert gc.isenabled()
    before = _process_state()
    fs, gate = _held_writes()
    state = _state(n)
    handles: dict[int, Any] = {}

    async def save(*steps: int) -> None:
        for step in steps:
            handles[step] = handle = await ckpt.save(step, state, lazy=lazy)
            await handle.staged()

    async with asyncsave.Checkpointer(tmp_path, filesystem=fs) as ckpt:
        try:
            await save(1)
            assert await anyio.to_thread.run_sync(fs.fired.wait, 30)
            async with anyio.create_task_group() as tg:
                tg.start_soon(save, *range(2, saves + 1))  # planned, then wait for 1
                try:
                    freed = _cyclic_garbage(50)
                    assert await _collected_while_in_flight(freed, 50)
                    assert _process_state() == before
                    assert not handles[1].done()  # still held
                finally:
                    gate.set()
        finally:
            gate.set()
        for handle in handles.values():
            await handle
    assert gc.isenabled()
    assert _process_state() == before
    info = asyncsave.latest(tmp_path)
    assert info is not None and info.step == saves


def test_sync_checkpointer_saves_leave_the_collector_on(tmp_path: Path) -> None:
    """:class:`SyncCheckpointer` (its event loop in a thread of its own): cyclic
    garbage made while a save of many tensors is held in its write is freed by
    the collector on its own; nothing process-wide changes."""
    before = _process_state()
    fs, gate = _held_writes()
    with asyncsave.SyncCheckpointer(tmp_path, filesystem=fs) as ckpt:
        try:
            handle = ckpt.save(1, _state(_MANY))
            assert fs.fired.wait(30) and not handle.done()
            freed = _cyclic_garbage(50)
            for _ in range(2000):
                if len(freed) == 50:
                    break
                _allocate(5)
                time.sleep(0.001)
            assert len(freed) == 50
            assert _process_state() == before
        finally:
            gate.set()
        handle.result()
    assert gc.isenabled()
    assert _process_state() == before


async def test_a_collector_the_trainer_switched_off_stays_off(tmp_path: Path) -> None:
    """A trainer that runs with the collector off (as some do, collecting by
    hand at chosen steps) finds it off during and after overlapping saves of
    many tensors, eager and lazy, and after a failed one."""
    gc.disable()
    try:
        fs, gate = _held_writes()
        state = _state(_MANY)
        handles: list[Any] = []

        async def save_lazy() -> None:
            handles.append(await ckpt.save(2, state, lazy=True))

        async with asyncsave.Checkpointer(tmp_path, filesystem=fs) as ckpt:
            try:
                handles.append(await ckpt.save(1, state))
                assert await anyio.to_thread.run_sync(fs.fired.wait, 30)
                async with anyio.create_task_group() as tg:
                    tg.start_soon(save_lazy)  # planned, then waits for the first
                    await anyio.sleep(0.05)
                    assert not gc.isenabled()
                    gate.set()
            finally:
                gate.set()
            for handle in handles:
                await handle
            assert not gc.isenabled()
            with pytest.raises(asyncsave.CheckpointError):
                await ckpt.save(3, {**state, "bad": object()})
            assert not gc.isenabled()
        assert not gc.isenabled()
    finally:
        gc.enable()


def _save_from_threads(roots: list[Path], state: dict[str, torch.Tensor]) -> None:
    """Three saves (eager, lazy, eager) to each root, each root from its own
    thread and :class:`SyncCheckpointer`, all at once."""
    errors: list[BaseException] = []

    def saves(root: Path) -> None:
        try:
            with asyncsave.SyncCheckpointer(root) as ckpt:
                for step in (1, 2, 3):
                    ckpt.save(step, state, lazy=step == 2)
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=saves, args=(root,)) for root in roots]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors and not any(t.is_alive() for t in threads)


def test_sync_saves_from_several_threads_restore_the_collector(tmp_path: Path) -> None:
    """Saves of many tensors from several threads at once: when all are done
    the collector is as the trainer left it (on; then off), whatever the
    overlap of their calls."""
    state = _state(_MANY)
    _save_from_threads([tmp_path / f"on-{i}" for i in range(3)], state)
    assert gc.isenabled()
    gc.disable()
    try:
        _save_from_threads([tmp_path / f"off-{i}" for i in range(3)], state)
        assert not gc.isenabled()
    finally:
        gc.enable()


@settings(max_examples=200, deadline=None)
@given(
    enabled=st.booleans(),
    order=st.lists(st.integers(min_value=0, max_value=3), min_size=1, max_size=24),
)
def test_a_collector_pause_never_outlives_the_call_that_took_it(
    enabled: bool, order: list[int]
) -> None:
    """Pauses of up to four calls, opened and closed in any interleaving (as
    calls in several threads overlap): the collector is off only while the call
    that switched it off is open, it is on again as that call ends (if it was on
    before), and a collector that was off is never switched on."""
    if not enabled:
        gc.disable()
    try:
        open_calls: dict[int, Any] = {}
        culprit: int | None = None  # the call that switched the collector off
        for c in order:
            if c in open_calls:
                open_calls.pop(c).__exit__(None, None, None)
                if c == culprit:
                    culprit = None
                    assert gc.isenabled(), "the pause outlived the call that took it"
            else:
                was_on = gc.isenabled()
                open_calls[c] = cm = gc_paused()
                cm.__enter__()
                if was_on and not gc.isenabled():
                    culprit = c
            if enabled and not gc.isenabled():
                assert culprit in open_calls
            assert enabled or not gc.isenabled()
        for cm in open_calls.values():
            cm.__exit__(None, None, None)
        assert gc.isenabled() is enabled
    finally:
        gc.enable()


def test_long_lists_inside_a_tree_are_emptied_and_shared_objects_kept() -> None:
    """``release_nested`` empties every list longer than one slice inside a tree
    of dicts and lists (a manifest's), however deep, leaves shorter lists as
    they are, and frees nothing another holder still refers to;
    ``release_in_chunks`` empties one list."""
    from asyncsave._types import RELEASE_CHUNK, release_in_chunks, release_nested

    shared = {"kept": [1]}
    inner = [[i] for i in range(RELEASE_CHUNK + 1)]
    outer = [[i] for i in range(2 * RELEASE_CHUNK)] + [{"items": [1, inner]}, shared]
    short = [shared, 2]
    release_nested({"tree": {"items": outer}, "short": short})
    assert outer == [] and inner == []
    assert short == [shared, 2] and shared == {"kept": [1]}
    one = [object() for _ in range(3 * RELEASE_CHUNK + 7)]
    release_in_chunks(one)
    assert one == []
    release_in_chunks(None)  # nothing to free


@pytest.mark.parametrize("collector_on", [True, False])
def test_reading_a_checkpoint_pauses_the_collector_and_restores_it(
    tmp_path: Path, collector_on: bool
) -> None:
    """The reading threads of a load (here ``verify``, whose progress callback
    runs in them) make a tensor per entry right after the manifest's 100,000s
    of objects were parsed: the collector is paused while they read (a full
    pass landed there: loads of 100,000 tensors 4.6 -> 3.5 s), and the load
    returns with it as the caller left it."""
    state = _state(_MANY)
    with asyncsave.SyncCheckpointer(tmp_path) as ckpt:
        ckpt.save(1, state).result()
    seen: list[bool] = []
    if not collector_on:
        gc.disable()
    try:
        asyncsave.verify(tmp_path / "step_1", progress=lambda n: seen.append(gc.isenabled()))
        assert seen and not any(seen)
        assert gc.isenabled() is collector_on
        out = asyncsave.load(tmp_path / "step_1")
        assert gc.isenabled() is collector_on
        assert all(torch.equal(out[k], v) for k, v in state.items())
    finally:
        gc.enable()
