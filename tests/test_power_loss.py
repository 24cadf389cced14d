"""Simulated power loss during saves (DESIGN invariant 1; issue 4, item 3).

Each scenario of the crash matrix runs once through the recording shim; then every
crash state the persistence model of ``tests/powerloss.py`` allows (un-fsynced
data dropped, truncated or zeroed, un-fsynced directory entries lost, operations
since the last persistence point reordered) is written out and checked with the
crash oracle: every final-named directory verifies, the tracker names a committed
checkpoint, resume finds one no older than the last acknowledged commit and loads
it bit-exactly, and a new checkpointer cleans up and resumes the same step.

``ASYNCSAVE_POWERLOSS_RANDOM`` (default 6) sets the random subsets sampled per
crash point; raise it for a longer local run.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest
from crashlab import (
    SCENARIOS,
    EventLog,
    Scenario,
    _ack,
    _save,
    check_root,
    make_base,
    small_own_files,
)
from fstrace import TracingFS
from powerloss import MarkLog, crash_states, events_before, materialise, volatile_and_forced
from reliability import record

import asyncsave
from asyncsave.testing import thresholds

pytestmark = pytest.mark.slow

N_RANDOM = int(os.environ.get("ASYNCSAVE_POWERLOSS_RANDOM", "6"))
MAX_WRITE = 512  # a data file takes five or six write calls: truncations in between


async def long_run(ckpt: asyncsave.Checkpointer, log: EventLog) -> None:
    """Sequential, overlapping and retiring saves in one life."""
    await _ack(await _save(ckpt, log, 2), log, 2)
    h3 = await _save(ckpt, log, 3)
    h4 = await _save(ckpt, log, 4)
    await _ack(h3, log, 3)
    await _ack(h4, log, 4)
    await _ack(await _save(ckpt, log, 5), log, 5)


async def one_incremental_save(ckpt: asyncsave.Checkpointer, log: EventLog) -> None:
    """The crash matrix's incremental state, its first save only (links made at
    write time, then retention deletes the base): links made while staging are
    the same operation into the same temporary directory."""
    await _ack(await _save(ckpt, log, 3), log, 3)


POWER_SCENARIOS = {
    **SCENARIOS,
    "incremental": Scenario(
        "incremental", [1, 2], one_incremental_save, SCENARIOS["incremental"].options
    ),
    "long_run_keep_last_2": Scenario(
        "long_run_keep_last_2", [1], long_run, {"retention": asyncsave.KeepLast(2)}
    ),
    # Files written while staged (overlap_writes): into a directory of the
    # save's own, moved into its temporary directory in its turn.
    "steady_state_overlap": Scenario(
        "steady_state_overlap", [1, 2], SCENARIOS["steady_state"].body, {"overlap_writes": True}
    ),
    "first_save_overlap": Scenario(
        "first_save_overlap", [], SCENARIOS["first_save"].body, {"overlap_writes": True}
    ),
}


@contextlib.contextmanager
def following(options: dict[str, Any]) -> Iterator[None]:
    """With ``overlap_writes``: every save follows, however small its state."""
    with thresholds(follow_min_bytes=0 if options.get("overlap_writes") else None):
        yield


def record_trace(root: Path, name: str) -> TracingFS:
    scen = POWER_SCENARIOS[name]
    with small_own_files(), following(scen.options):  # the crash lab's small state
        make_base(root, scen.base, scen.prepare, scen.options)
        fs = TracingFS(root, max_write=MAX_WRITE)

        async def go() -> None:
            async with asyncsave_checkpointer(root, fs, scen.options) as ckpt:
                await scen.body(ckpt, MarkLog(fs))

        anyio.run(go)
    return fs


def asyncsave_checkpointer(root: Path, fs: TracingFS, options: dict[str, Any]) -> Any:
    return asyncsave.Checkpointer(root, filesystem=fs, **{"writer_threads": 1, **options})


@pytest.fixture(scope="module")
def tally() -> Any:
    """States checked per scenario; when every scenario ran, at least 1,000 in all."""
    counts: dict[str, int] = {}
    yield counts
    if set(counts) == set(POWER_SCENARIOS):
        assert sum(counts.values()) >= 1000, counts


@pytest.mark.parametrize("name", list(POWER_SCENARIOS))
def test_every_power_loss_state_resumes_from_an_acknowledged_commit(
    tmp_path: Path, name: str, caplog: pytest.LogCaptureFixture, tally: dict[str, int]
) -> None:
    caplog.set_level(logging.CRITICAL, logger="asyncsave")
    scen = POWER_SCENARIOS[name]
    fs = record_trace(tmp_path / "recorded", name)
    base = dict.fromkeys(scen.base, 0)
    states = 0
    lost_something = 0
    for c, snap in crash_states(fs.base, fs.ops, seed=hash(name) & 0xFFFF, n_random=N_RANDOM):
        target = tmp_path / "state"
        if target.exists():
            shutil.rmtree(target)
        materialise(snap, target)
        events = events_before(fs.ops, c)
        try:
            check_root(target, events, base, {**scen.options}, "asyncio", scen.foreign)
        except AssertionError as exc:
            raise AssertionError(
                f"{name}: power cut after op {c} of {len(fs.ops)} "
                f"({fs.ops[c - 1][:3] if c else 'start'}); events {events}: {exc}"
            ) from exc
        states += 1
        lost_something += bool(volatile_and_forced(fs.ops, c)[1])
    record("power-loss states", states)
    tally[name] = states
    # The model really dropped operations (not only replayed clean prefixes).
    assert lost_something > states // 2
    assert states >= 40, states
