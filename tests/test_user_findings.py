"""Regressions from a fresh user's trial of the README (each failed before its fix)."""

from __future__ import annotations

import errno
import logging
import threading
import warnings
from pathlib import Path

import anyio
import anyio.to_thread
import numpy as np
import pytest
import torch
from faults import FaultyFS, pause, raise_errno

import asyncsave

pytestmark = pytest.mark.anyio


def _flip_a_data_bit(step_dir: Path) -> None:
    f = next(step_dir.glob("data-*.safetensors"))
    raw = bytearray(f.read_bytes())
    raw[-1] ^= 1
    f.write_bytes(bytes(raw))


async def test_a_step_skipped_by_fallback_is_written_again_when_saved(tmp_path: Path) -> None:
    async with asyncsave.Checkpointer(tmp_path) as ckpt:
        for step in (1, 2, 3):
            await ckpt.save(step, {"w": torch.full((64,), float(step))})
    _flip_a_data_bit(tmp_path / "step_3")
    async with asyncsave.Checkpointer(tmp_path) as ckpt:
        restored = await ckpt.load_latest(fallback=True)
        assert restored is not None and restored.info.step == 2
        info = await (await ckpt.save(3, {"w": torch.full((64,), 33.0)}))
        assert info is not None and info.committed_s is not None  # really written
    assert asyncsave.verify(tmp_path / "step_3").step == 3
    assert torch.equal(asyncsave.load(tmp_path / "step_3")["w"], torch.full((64,), 33.0))
    assert list(tmp_path.glob(".asyncsave-damaged-3-*"))  # the bad bytes kept aside


@pytest.mark.parametrize("written_as", ["skyrl", "verl", "megatron"])
async def test_opening_a_root_with_the_wrong_layout_never_starts_from_scratch(
    tmp_path: Path, written_as: str
) -> None:
    async with asyncsave.Checkpointer(tmp_path, layout=written_as) as ckpt:
        await ckpt.save(7, {"w": torch.ones(2)})
    with pytest.raises(asyncsave.CheckpointNotFoundError, match=f"layout='{written_as}'|layout"):
        asyncsave.latest(tmp_path)
    async with asyncsave.Checkpointer(tmp_path) as ckpt:
        with pytest.raises(asyncsave.CheckpointNotFoundError, match=written_as):
            await ckpt.load_latest()
    assert asyncsave.latest(tmp_path, layout=written_as).step == 7  # type: ignore[union-attr]


def test_load_tensors_refuses_an_ambiguous_key_path(tmp_path: Path) -> None:
    async def save() -> None:
        async with asyncsave.Checkpointer(tmp_path) as ckpt:
            await ckpt.save(1, {"a/b": torch.ones(1), "a": {"b": torch.zeros(1)}})

    anyio.run(save)
    with pytest.raises(asyncsave.InvalidKeyError, match="a/b"):
        asyncsave.load_tensors(tmp_path / "step_1", ["a/b"])
    state = asyncsave.load(tmp_path / "step_1")
    assert state["a/b"].item() == 1 and state["a"]["b"].item() == 0


async def test_a_tracker_failure_after_the_rename_says_the_step_is_committed(
    tmp_path: Path,
) -> None:
    fs = FaultyFS("replace", raise_errno(errno.ENOSPC))
    with pytest.raises(asyncsave.SaveFailedError):
        async with asyncsave.Checkpointer(tmp_path, filesystem=fs) as ckpt:
            with pytest.raises(asyncsave.SaveFailedError, match="was committed") as info:
                await (await ckpt.save(4, {"w": torch.ones(2)}))
            assert isinstance(info.value.__cause__, OSError)
    async with asyncsave.Checkpointer(tmp_path) as ckpt:
        assert ckpt.tracked_step == 4  # as the message says


async def test_integer_like_steps_and_a_warning_below_the_tracked_step(tmp_path: Path) -> None:
    async with asyncsave.Checkpointer(tmp_path) as ckpt:
        await (await ckpt.save(np.int64(4), {"w": torch.ones(2)}))  # type: ignore[arg-type]
        await (await ckpt.save(torch.tensor(6), {"w": torch.ones(2)}))  # type: ignore[arg-type]
        with pytest.warns(asyncsave.CheckpointWarning, match="below the tracked step 6") as w:
            await (await ckpt.save(5, {"w": torch.ones(2)}))
        assert w[0].filename == __file__  # points at the caller's save()
        assert w[0].message.step == 5  # type: ignore[union-attr]
        for bad in (True, 2.0, np.float32(3)):
            with pytest.raises(asyncsave.InvalidStepError):
                await ckpt.save(bad, {})  # type: ignore[arg-type]
        with pytest.raises(asyncsave.CheckpointNotFoundError, match="no checkpoint of step 99"):
            await ckpt.update(99, "w", torch.zeros(2))
    assert sorted(p.name for p in tmp_path.glob("step_*")) == ["step_4", "step_5", "step_6"]


# -- save() calls that do not do what was probably meant warn (issue 10, item 7) -------


async def test_a_save_of_a_step_committed_before_this_run_warns_and_keeps_the_old_bytes(
    tmp_path: Path,
) -> None:
    async with asyncsave.Checkpointer(tmp_path) as ckpt:
        await (await ckpt.save(3, {"w": torch.zeros(2)}))
    async with asyncsave.Checkpointer(tmp_path) as ckpt:  # a run that did not resume
        with pytest.warns(asyncsave.CheckpointWarning, match="step 3 is already committed") as w:
            info = await (await ckpt.save(3, {"w": torch.ones(2)}))
        assert w[0].filename == __file__
        assert info is not None and info.step == 3
    assert torch.equal(asyncsave.load(tmp_path / "step_3")["w"], torch.zeros(2))


async def test_a_second_save_of_a_step_in_this_run_warns_committed_or_in_flight(
    tmp_path: Path,
) -> None:
    gate = threading.Event()
    fs = FaultyFS("rename", pause(gate), where=lambda p: p.endswith("step_4"))
    async with asyncsave.Checkpointer(tmp_path, filesystem=fs) as ckpt:
        await (await ckpt.save(2, {"w": torch.zeros(2)}))
        with pytest.warns(asyncsave.CheckpointWarning, match="step 2 is already committed"):
            await ckpt.save(2, {"w": torch.ones(2)})  # the step counter did not advance
        first = await ckpt.save(4, {"w": torch.zeros(2)})
        await anyio.to_thread.run_sync(fs.fired.wait, 60)  # held before its rename
        with pytest.warns(asyncsave.CheckpointWarning, match="step 4 is already in flight"):
            again = await ckpt.save(4, {"w": torch.ones(2)})
        assert again is first
        gate.set()
        await first
        # overwrite=True is the way to replace it: no warning
        with warnings.catch_warnings():
            warnings.simplefilter("error", asyncsave.CheckpointWarning)
            await (await ckpt.save(4, {"w": torch.ones(2)}, overwrite=True))
    assert torch.equal(asyncsave.load(tmp_path / "step_2")["w"], torch.zeros(2))
    assert torch.equal(asyncsave.load(tmp_path / "step_4")["w"], torch.ones(2))


async def test_a_save_of_the_resumed_step_is_logged_not_warned(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    async with asyncsave.Checkpointer(tmp_path) as ckpt:
        await (await ckpt.save(5, {"w": torch.zeros(2)}))
    async with asyncsave.Checkpointer(tmp_path) as ckpt:
        restored = await ckpt.load_latest()
        assert restored is not None and restored.info.step == 5
        with warnings.catch_warnings(), caplog.at_level(logging.INFO, logger="asyncsave"):
            warnings.simplefilter("error", asyncsave.CheckpointWarning)
            await (await ckpt.save(5, restored.state))
        assert "step 5 is the checkpoint this run resumed from" in caplog.text


async def test_a_skipped_save_of_step_zero_warns(tmp_path: Path) -> None:
    async with asyncsave.Checkpointer(tmp_path) as ckpt:
        with pytest.warns(asyncsave.CheckpointWarning, match="save_step_zero=True"):
            await (await ckpt.save(0, {"w": torch.zeros(2)}))
    assert not (tmp_path / "step_0").exists()
    async with asyncsave.Checkpointer(tmp_path, save_step_zero=True) as ckpt:
        with warnings.catch_warnings():
            warnings.simplefilter("error", asyncsave.CheckpointWarning)
            await (await ckpt.save(0, {"w": torch.zeros(2)}))
    assert (tmp_path / "step_0").is_dir()


def test_the_sync_facade_warns_too(tmp_path: Path) -> None:
    with asyncsave.SyncCheckpointer(tmp_path) as ckpt:
        ckpt.save(3, {"w": torch.zeros(2)}).result()
        with pytest.warns(asyncsave.CheckpointWarning, match="step 3 is already committed"):
            ckpt.save(3, {"w": torch.ones(2)}).result()
        with pytest.warns(asyncsave.CheckpointWarning, match="below the tracked step 3"):
            ckpt.save(2, {"w": torch.ones(2)}).result()


def test_the_budget_bytes_doc_says_a_larger_state_streams(tmp_path: Path) -> None:
    doc = asyncsave.CheckpointOptions.__doc__ or ""
    budget = doc.split(":param budget_bytes:")[1].split(":param ")[0]
    assert "streams" in budget and "smaller than one save raises" not in budget
    # ... and it does: four times the budget, committed whole.
    state = {"w": torch.arange(4096, dtype=torch.float32)}
    with asyncsave.SyncCheckpointer(tmp_path, budget_bytes=4096) as ckpt:
        ckpt.save(1, state).result()
    assert torch.equal(asyncsave.load(tmp_path / "step_1")["w"], state["w"])


# -- second fresh-user trial (issue 10) ----------------------------------------------


async def test_each_save_call_gets_one_warning_for_what_happens_to_it(tmp_path: Path) -> None:
    """Step 0 after step 10 is skipped, not "saved below the tracked step"; a
    committed step below the tracker is a no-op, not a save below it."""
    async with asyncsave.Checkpointer(tmp_path) as ckpt:
        for step in (5, 10):
            await (await ckpt.save(step, {"w": torch.ones(2)}))
        cases = {0: "not saving step 0", 5: "step 5 is already committed", 7: "below the tracked"}
        for step, what in cases.items():
            with warnings.catch_warnings(record=True) as seen:
                warnings.simplefilter("always")
                await (await ckpt.save(step, {"w": torch.zeros(2)}))
            notes = [str(w.message) for w in seen if w.category is asyncsave.CheckpointWarning]
            assert len(notes) == 1 and what in notes[0], (step, notes)


@pytest.mark.parametrize("written_as", ["megatron", "verl", "skyrl"])
def test_a_tracked_root_of_another_layout_names_the_layout_not_the_fallback(
    tmp_path: Path, written_as: str
) -> None:
    """megatron and verl share the default's tracker name: the tracker names a step
    whose ``step_N`` is missing, and the fix is the layout, not ``fallback=True``."""

    async def go() -> None:
        async with asyncsave.Checkpointer(tmp_path, layout=written_as) as ckpt:
            await (await ckpt.save(7, {"w": torch.ones(2)}))

    anyio.run(go)
    with pytest.raises(asyncsave.CheckpointNotFoundError) as err:
        asyncsave.latest(tmp_path)
    assert f"pass layout={written_as!r}" in str(err.value) or (
        written_as in str(err.value) and "pass layout=" in str(err.value)
    )
    assert "fallback=True" not in str(err.value)
