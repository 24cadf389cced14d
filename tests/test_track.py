"""The tracker: atomic, forward-only, even across abandoned writer threads; read
as Megatron and verl write it, and a damaged one is reported, never trusted."""

from __future__ import annotations

import logging
import threading
from pathlib import Path

import anyio
import pytest
import torch

import asyncsave
from asyncsave.testing import FaultyFileSystem, leftover_temp_names, pause, tracker_file_name

pytestmark = pytest.mark.anyio

TRACKER = tracker_file_name("asyncsave")
assert TRACKER is not None
HANG_GUARD_S = 60


def state(step: int) -> dict[str, object]:
    return {"w": torch.full((16,), float(step)), "step": step}


async def test_forward_only_even_when_an_older_write_finishes_last(tmp_path: Path) -> None:
    """The tracker write of step 5 stalls inside its replace; step 10 commits
    meanwhile and asks for its own. The tracker must end at 10, and a later save
    of an older step (7) must not move it back."""
    gate = threading.Event()
    fs = FaultyFileSystem("replace", pause(gate), where=lambda p: p.endswith(TRACKER))
    with anyio.fail_after(HANG_GUARD_S):
        async with asyncsave.Checkpointer(tmp_path, filesystem=fs) as ckpt:
            h5 = await ckpt.save(5, state(5))
            await anyio.to_thread.run_sync(fs.fired.wait)  # 5's replace is held
            h10 = await ckpt.save(10, state(10))
            await anyio.sleep(0.2)  # 10 may reach the tracker while 5 is held
            gate.set()
            assert (await h5).step == 5 and (await h10).step == 10
            assert (tmp_path / TRACKER).read_text() == "10"
            with pytest.warns(asyncsave.CheckpointWarning, match="below the tracked step 10"):
                await (await ckpt.save(7, state(7)))
            assert (tmp_path / TRACKER).read_text() == "10"
    info = asyncsave.latest(tmp_path)
    assert info is not None and info.step == 10


async def test_the_tracker_is_written_atomically_and_leaves_no_temp_file(tmp_path: Path) -> None:
    async with asyncsave.Checkpointer(tmp_path) as ckpt:
        await (await ckpt.save(3, state(3)))
        assert (tmp_path / TRACKER).read_text() == "3"  # a bare decimal, no newline
        with pytest.warns(asyncsave.CheckpointWarning, match="already committed"):
            await (await ckpt.save(3, state(3)))  # a no-op: the tracker stays
        await (await ckpt.save(4, state(4)))
    assert (tmp_path / TRACKER).read_text() == "4"
    assert leftover_temp_names(tmp_path) == []
    files = sorted(p.name for p in tmp_path.iterdir() if p.is_file())
    assert files == sorted([TRACKER, ".asyncsave.lock"]), files  # the saver lock stays


async def _root_with_steps(root: Path, *steps: int) -> None:
    async with asyncsave.Checkpointer(root, save_step_zero=True) as ckpt:
        for step in steps:
            await (await ckpt.save(step, state(step)))


@pytest.mark.parametrize(("raw", "step"), [(b"40", 40), (b" 40\n", 40), (b"0", 0)])
async def test_trackers_as_megatron_and_verl_write_them_parse(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, raw: bytes, step: int
) -> None:
    """A tracker naming a committed step, in any form those trainers write, is
    read as that step: no scan, nothing logged."""
    await _root_with_steps(tmp_path, step)
    (tmp_path / TRACKER).write_bytes(raw)
    with caplog.at_level(logging.INFO, logger="asyncsave"):
        info = asyncsave.latest(tmp_path)
    assert info is not None and info.step == step
    assert not [r for r in caplog.records if "tracker" in r.getMessage()], caplog.text


@pytest.mark.parametrize("raw", [b"", b"-1", b"1.0", b"x", b"9" * 20, b"1 2", "٣".encode()])
async def test_garbage_trackers_are_reported_and_the_root_scanned(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, raw: bytes
) -> None:
    """A tracker that is not a non-negative decimal step below 2**63 is never
    read as a step: the damage is logged naming the tracker, and the newest
    committed checkpoint is found by a scan."""
    await _root_with_steps(tmp_path, 1, 2)
    (tmp_path / TRACKER).write_bytes(raw)
    with caplog.at_level(logging.WARNING, logger="asyncsave"):
        info = asyncsave.latest(tmp_path)
    assert info is not None and info.step == 2
    damaged = [r.getMessage() for r in caplog.records if str(tmp_path / TRACKER) in r.getMessage()]
    assert damaged and (
        "not a non-negative decimal step" in damaged[0] or "huge step" in damaged[0]
    )


def test_a_missing_tracker_reads_as_nothing_committed(tmp_path: Path) -> None:
    assert asyncsave.latest(tmp_path) is None
    assert not (tmp_path / TRACKER).exists()
