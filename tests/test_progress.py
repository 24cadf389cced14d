"""Seeing a long save (issue 13, item 5): a pending save's progress is readable
from its handle (eager, lazy, streamed; sync facade too), and the INFO log says
when a save commits and when a resume finds nothing."""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest
import torch
from faults import FaultyFS, pause

import asyncsave
from asyncsave.testing import thresholds

pytestmark = pytest.mark.anyio

MIB = 1 << 20
# The bytes of one write call of a data file, pinned for every test (the forked
# ranks inherit it): progress moves chunk by chunk.
CHUNK_BYTES = 8 * MIB


@pytest.fixture(autouse=True)
def _chunks_of_chunk_bytes() -> Iterator[None]:
    with thresholds(chunk_bytes=CHUNK_BYTES):
        yield


# Two tensors of one chunk each, in one data file: the writes of that file are
# its header, then chunk 1, then chunk 2.
N = CHUNK_BYTES // 4


def _state() -> dict[str, Any]:
    return {"a": torch.ones(N), "b": torch.full((N,), 2.0), "step": 1}


TOTAL = 2 * CHUNK_BYTES


def _data_file(p: str) -> bool:
    return p.endswith(".safetensors")


async def _until(event: threading.Event) -> None:
    with anyio.fail_after(30):
        while not event.is_set():
            await anyio.sleep(0.005)


@pytest.mark.parametrize("lazy", [False, True], ids=["eager", "lazy"])
async def test_progress_of_a_pending_save(tmp_path: Path, lazy: bool) -> None:
    gate = threading.Event()
    # The third write of the data file: header and chunk 1 are written.
    fs = FaultyFS("write", pause(gate), n=3, where=_data_file)
    async with asyncsave.Checkpointer(tmp_path, filesystem=fs, writer_threads=1) as ckpt:
        handle = await ckpt.save(5, _state(), lazy=lazy)
        first = handle.progress
        assert first.total_bytes == TOTAL
        assert 0 <= first.written_bytes <= first.staged_bytes <= TOTAL
        await handle.staged()
        await _until(fs.fired)
        mid = handle.progress
        assert (mid.staged_bytes, mid.written_bytes, mid.total_bytes) == (
            TOTAL,
            CHUNK_BYTES,
            TOTAL,
        )
        assert mid.fraction_written == 0.5
        assert not handle.done()
        gate.set()
        info = await handle
    assert info is not None and info.nbytes == TOTAL
    end = handle.progress
    assert (end.staged_bytes, end.written_bytes, end.total_bytes) == (TOTAL, TOTAL, TOTAL)


async def test_progress_of_a_streamed_save(tmp_path: Path) -> None:
    """A state twice the staging budget streams in two rounds: while round 1's
    data is being written, half is staged and nothing of round 2."""
    gate = threading.Event()
    fs = FaultyFS("write", pause(gate), n=2, where=_data_file)  # round 1's first data write
    async with asyncsave.Checkpointer(
        tmp_path, filesystem=fs, writer_threads=1, budget_bytes=CHUNK_BYTES
    ) as ckpt:
        handle = await ckpt.save(5, _state(), lazy=True)
        await _until(fs.fired)
        mid = handle.progress
        assert (mid.staged_bytes, mid.written_bytes, mid.total_bytes) == (CHUNK_BYTES, 0, TOTAL)
        gate.set()
        await handle
    assert handle.progress.written_bytes == TOTAL
    assert torch.equal(asyncsave.load(tmp_path / "step_5")["b"], _state()["b"])


def test_progress_from_the_sync_facade(tmp_path: Path) -> None:
    gate = threading.Event()
    fs = FaultyFS("write", pause(gate), n=3, where=_data_file)
    with asyncsave.SyncCheckpointer(tmp_path, filesystem=fs, writer_threads=1) as ckpt:
        handle = ckpt.save(5, _state())
        assert fs.fired.wait(30)
        mid = handle.progress
        assert (mid.staged_bytes, mid.written_bytes) == (TOTAL, CHUNK_BYTES)
        gate.set()
        handle.result()
        assert handle.progress.written_bytes == TOTAL
        # A skipped save (step 0) and a no-op re-save of a committed step.
        with pytest.warns(asyncsave.CheckpointWarning, match="step 0"):
            skipped = ckpt.save(0, _state())
        assert skipped.progress == asyncsave.SaveProgress(0, 0, 0)
        with pytest.warns(asyncsave.CheckpointWarning):
            again = ckpt.save(5, _state())
        assert again.progress.written_bytes == again.progress.total_bytes == TOTAL


async def test_info_log_when_a_save_commits(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO, logger="asyncsave"):
        async with asyncsave.Checkpointer(tmp_path) as ckpt:
            await (await ckpt.save(3, {"w": torch.ones(16)}))
    commits = [
        r for r in caplog.records if r.levelno == logging.INFO and "saved step 3" in r.getMessage()
    ]
    assert len(commits) == 1
    message = commits[0].getMessage()
    assert str(tmp_path / "step_3") in message and "64 bytes" in message
    assert "committed" in message and " s" in message


@pytest.mark.parametrize("layout", ["asyncsave", "nemo-rl"])
async def test_info_log_when_a_resume_finds_nothing(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, layout: str
) -> None:
    root = tmp_path / "runs" / "typo"
    with caplog.at_level(logging.INFO, logger="asyncsave"):
        async with asyncsave.Checkpointer(root, layout=layout) as ckpt:
            assert await ckpt.load_latest({"w": torch.ones(2)}) is None
    found = [r for r in caplog.records if "no committed checkpoint" in r.getMessage()]
    assert len(found) == 1 and found[0].levelno == logging.INFO
    assert str(root) in found[0].getMessage() and repr(layout) in found[0].getMessage()


def _ranks_progress(rank: int, world: int, root: str) -> dict[str, Any]:
    # Each rank saves a state of its own size: its handle counts its own part.
    gate = threading.Event()
    fs = FaultyFS("write", pause(gate), n=3, where=_data_file)
    state = {"a": torch.ones(N), "b": torch.zeros(N * (rank + 1))}
    with asyncsave.SyncCheckpointer(
        root, filesystem=fs, writer_threads=1, dist_timeout_s=60
    ) as ckpt:
        handle = ckpt.save(1, state)
        assert fs.fired.wait(30)
        mid = handle.progress
        gate.set()
        handle.result()
        end = handle.progress
    return {"mid": mid, "end": end}


@pytest.mark.slow
def test_progress_on_two_ranks_counts_each_ranks_part(tmp_path: Path) -> None:
    from distributed import run_ranks, values

    for rank, seen in enumerate(
        values(run_ranks(_ranks_progress, 2, tmp_path, str(tmp_path / "run")))
    ):
        total = CHUNK_BYTES * (rank + 2)
        assert seen["mid"] == asyncsave.SaveProgress(total, CHUNK_BYTES, total)
        assert seen["end"] == asyncsave.SaveProgress(total, total, total)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
async def test_progress_of_a_save_of_device_tensors(tmp_path: Path) -> None:
    """Device tensors count as staged once their copies have landed."""
    gate = threading.Event()
    fs = FaultyFS("write", pause(gate), n=3, where=_data_file)
    state = {"a": torch.ones(N, device="cuda"), "b": torch.full((N,), 2.0, device="cuda")}
    async with asyncsave.Checkpointer(tmp_path, filesystem=fs, writer_threads=1) as ckpt:
        handle = await ckpt.save(5, state, lazy=True)
        await handle.staged()
        await _until(fs.fired)
        assert handle.progress == asyncsave.SaveProgress(TOTAL, CHUNK_BYTES, TOTAL)
        gate.set()
        await handle
    assert handle.progress == asyncsave.SaveProgress(TOTAL, TOTAL, TOTAL)
