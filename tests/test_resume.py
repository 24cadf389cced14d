"""Resume: the right checkpoint, never silently from scratch (S1, S13, S17, inv. 8)."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch

import asyncsave

pytestmark = pytest.mark.anyio

TRACKER = "latest_checkpointed_iteration.txt"


class Cursor:
    """A dataloader-position stand-in with the Stateful convention."""

    def __init__(self, position: int = 0) -> None:
        self.position = position

    def state_dict(self) -> dict[str, Any]:
        return {"position": self.position}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.position = state["position"]


async def save_steps(root: Path, steps: list[int], **kw: Any) -> None:
    async with asyncsave.Checkpointer(root, **kw) as ckpt:
        for step in steps:
            await (await ckpt.save(step, {"w": torch.full((4,), float(step)), "step": step}))


def run_python(code: str) -> str:
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def test_async_saves_are_found_by_a_new_process(tmp_path: Path) -> None:
    """S1: async saves at 5 and 10 in one process; another process resolves 10."""
    run_python(
        f"""
        import anyio, torch, asyncsave
        async def main():
            async with asyncsave.Checkpointer({str(tmp_path)!r}) as ckpt:
                h5 = await ckpt.save(5, {{"w": torch.ones(3) * 5}})
                h10 = await ckpt.save(10, {{"w": torch.ones(3) * 10}})
                # leave without awaiting the handles: the exit flushes them
        anyio.run(main)
        """
    )
    out = run_python(
        f"""
        import asyncsave
        info = asyncsave.latest({str(tmp_path)!r})
        print(info.step, asyncsave.load(info.path)["w"].tolist())
        """
    )
    assert out.split() == ["10", "[10.0,", "10.0,", "10.0]"]
    assert (tmp_path / TRACKER).read_text() == "10"


async def test_load_latest_returns_none_when_nothing_is_committed(tmp_path: Path) -> None:
    async with asyncsave.Checkpointer(tmp_path / "fresh") as ckpt:
        assert await ckpt.load_latest() is None
    assert asyncsave.latest(tmp_path / "fresh") is None
    assert asyncsave.latest(tmp_path / "does-not-exist") is None


async def test_load_latest_returns_state_and_info(tmp_path: Path) -> None:
    await save_steps(tmp_path, [1, 2, 3])
    async with asyncsave.Checkpointer(tmp_path) as ckpt:
        restored = await ckpt.load_latest()
    assert restored is not None
    state, info = restored
    assert info.step == 3 and info.path == tmp_path / "step_3"
    assert state["step"] == 3 and torch.equal(state["w"], torch.full((4,), 3.0))


async def test_partial_directory_without_manifest_is_never_a_checkpoint(tmp_path: Path) -> None:
    """S13: a step directory with data files but no manifest (an interrupted,
    non-atomic writer) is removed at open and resume takes the last complete one."""
    await save_steps(tmp_path, [1, 2])
    partial = tmp_path / "step_3"
    partial.mkdir()
    (partial / "data-r00000-000.safetensors").write_bytes(b"\0" * 4096)
    (tmp_path / TRACKER).write_text("2")
    assert asyncsave.latest(tmp_path).step == 2  # type: ignore[union-attr]
    async with asyncsave.Checkpointer(tmp_path) as ckpt:
        assert not partial.exists()
        restored = await ckpt.load_latest()
    assert restored is not None and restored.info.step == 2


async def test_garbage_tracker_falls_back_to_scanning_with_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    await save_steps(tmp_path, [4, 8])
    (tmp_path / TRACKER).write_text("eight\n")
    with caplog.at_level(logging.WARNING, logger="asyncsave"):
        info = asyncsave.latest(tmp_path)
    assert info is not None and info.step == 8
    assert any("scanning" in r.getMessage() for r in caplog.records)


async def test_missing_tracker_falls_back_to_scanning_with_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    await save_steps(tmp_path, [4, 8])
    (tmp_path / TRACKER).unlink()
    with caplog.at_level(logging.WARNING, logger="asyncsave"):
        info = asyncsave.latest(tmp_path)
    assert info is not None and info.step == 8
    assert any("no usable tracker" in r.getMessage() for r in caplog.records)


async def test_tracker_naming_a_missing_checkpoint_is_an_error_unless_fallback(
    tmp_path: Path,
) -> None:
    await save_steps(tmp_path, [4, 8])
    (tmp_path / TRACKER).write_text("12")
    with pytest.raises(asyncsave.CheckpointNotFoundError) as err:
        asyncsave.latest(tmp_path)
    assert err.value.step == 12 and "fallback=True" in str(err.value)
    info = asyncsave.latest(tmp_path, fallback=True)
    assert info is not None and info.step == 8
    async with asyncsave.Checkpointer(tmp_path) as ckpt:
        with pytest.raises(asyncsave.CheckpointNotFoundError):
            await ckpt.load_latest()
        restored = await ckpt.load_latest(fallback=True)
        assert restored is not None and restored.info.step == 8


async def test_tracker_naming_a_damaged_checkpoint_is_an_error_unless_fallback(
    tmp_path: Path,
) -> None:
    await save_steps(tmp_path, [4, 8])
    (tmp_path / "step_8" / "manifest.json").write_text("{not json")
    with pytest.raises(asyncsave.CheckpointNotFoundError):
        asyncsave.latest(tmp_path)
    assert asyncsave.latest(tmp_path, fallback=True).step == 4  # type: ignore[union-attr]


async def test_a_commit_the_tracker_missed_is_rolled_forward_at_open(tmp_path: Path) -> None:
    """A crash between the rename and the tracker update leaves a committed, untracked
    checkpoint: the next open moves the tracker to it."""
    await save_steps(tmp_path, [5, 10])
    (tmp_path / TRACKER).write_text("5")
    async with asyncsave.Checkpointer(tmp_path) as ckpt:
        assert ckpt.tracked_step == 10
    assert (tmp_path / TRACKER).read_text() == "10"


async def test_a_missing_required_item_is_a_typed_error_naming_it(tmp_path: Path) -> None:
    """S17: a checkpoint missing its dataloader state never resumes silently."""
    async with asyncsave.Checkpointer(tmp_path) as ckpt:
        await (await ckpt.save(1, {"model": {"w": torch.ones(2)}, "trainer": {"step": 1}}))
    with pytest.raises(asyncsave.MissingItemError) as err:
        asyncsave.load(tmp_path / "step_1", required=["model", "dataloader"])
    assert err.value.key == "dataloader" and "dataloader" in str(err.value)
    with pytest.raises(asyncsave.MissingItemError) as err2:
        asyncsave.load(tmp_path / "step_1", required=[("trainer", "rng")])
    assert err2.value.key == "trainer/rng"
    # A template holding a Stateful object the checkpoint lacks is refused too.
    with pytest.raises(asyncsave.MissingItemError) as err3:
        asyncsave.load(tmp_path / "step_1", {"dataloader": Cursor()})
    assert err3.value.key == "dataloader"
    async with asyncsave.Checkpointer(tmp_path) as ckpt:
        with pytest.raises(asyncsave.MissingItemError):
            await ckpt.load_latest({"dataloader": Cursor()})
        with pytest.raises(asyncsave.MissingItemError):
            await ckpt.load_latest(required=["dataloader"])


async def test_kind_tags_are_checked_on_load(tmp_path: Path) -> None:
    """S17: a replay buffer saved by another sampler type is never loaded blindly."""
    cursor = Cursor(17)
    async with asyncsave.Checkpointer(tmp_path) as ckpt:
        await (
            await ckpt.save(
                1,
                {
                    "replay": asyncsave.Tagged({"ids": torch.arange(5)}, kind="uniform-v1"),
                    "data": asyncsave.Tagged(cursor, "cursor"),
                },
            )
        )
    path = tmp_path / "step_1"
    with pytest.raises(asyncsave.KindMismatchError) as err:
        asyncsave.load(path, {"replay": asyncsave.Tagged(None, kind="prioritized-v1")})
    assert (
        err.value.key == "replay"
        and "uniform-v1" in str(err.value)
        and "prioritized-v1" in str(err.value)
    )
    fresh = Cursor()
    out = asyncsave.load(
        path,
        {
            "replay": asyncsave.Tagged(None, kind="uniform-v1"),
            "data": asyncsave.Tagged(fresh, "cursor"),
        },
    )
    assert (
        torch.equal(out["replay"].value["ids"], torch.arange(5))
        and out["replay"].kind == "uniform-v1"
    )
    assert out["data"].value is fresh and fresh.position == 17
    # Untagged at save time, tagged expectation at load: refused.
    async with asyncsave.Checkpointer(tmp_path / "b") as ckpt:
        await (await ckpt.save(1, {"replay": {"ids": torch.arange(3)}}))
    with pytest.raises(asyncsave.KindMismatchError):
        asyncsave.load(
            tmp_path / "b" / "step_1", {"replay": asyncsave.Tagged(None, kind="uniform-v1")}
        )


async def test_template_tensors_are_filled_in_place_and_shape_mismatch_is_refused(
    tmp_path: Path,
) -> None:
    async with asyncsave.Checkpointer(tmp_path) as ckpt:
        await (await ckpt.save(1, {"buf": torch.arange(6.0)}))
    target = torch.zeros(6)
    out = asyncsave.load(tmp_path / "step_1", {"buf": target})
    assert out["buf"] is target and torch.equal(target, torch.arange(6.0))
    with pytest.raises(asyncsave.InvalidStateError) as err:
        asyncsave.load(tmp_path / "step_1", {"buf": torch.zeros(5)})
    assert err.value.key == "buf"


def test_resume_reads_the_manifest_not_the_directory_listing(tmp_path: Path) -> None:
    """A final-named directory is only a checkpoint through its manifest."""
    (tmp_path / "step_9").mkdir(parents=True)
    (tmp_path / "step_9" / "manifest.json").write_text(json.dumps({"format": "something-else"}))
    (tmp_path / TRACKER).write_text("9")
    with pytest.raises(asyncsave.CheckpointNotFoundError):
        asyncsave.latest(tmp_path)
    with pytest.raises(asyncsave.CheckpointNotFoundError, match="not starting from scratch"):
        asyncsave.latest(tmp_path, fallback=True)


async def test_damaged_checkpoint_is_moved_aside_and_its_step_can_be_saved_again(
    tmp_path: Path,
) -> None:
    await save_steps(tmp_path, [1, 2])
    (tmp_path / "step_2" / "manifest.json").write_text("{}")
    (tmp_path / TRACKER).write_text("1")
    async with asyncsave.Checkpointer(tmp_path) as ckpt:
        aside = [p for p in tmp_path.iterdir() if p.name.startswith(".asyncsave-damaged-2-")]
        assert len(aside) == 1 and (aside[0] / "manifest.json").read_text() == "{}"
        restored = await ckpt.load_latest()
        assert restored is not None and restored.info.step == 1
        info = await (await ckpt.save(2, {"w": torch.full((4,), 22.0), "step": 2}))
        assert info is not None
    assert asyncsave.latest(tmp_path).step == 2  # type: ignore[union-attr]


async def test_a_directory_without_manifest_is_moved_aside_not_deleted(tmp_path: Path) -> None:
    other = tmp_path / "step_100"
    other.mkdir(parents=True)
    (other / "model.pt").write_bytes(b"another tool's checkpoint")
    async with asyncsave.Checkpointer(tmp_path):
        pass
    assert not other.exists()
    aside = [p for p in tmp_path.iterdir() if p.name.startswith(".asyncsave-incomplete-100-")]
    assert len(aside) == 1 and (aside[0] / "model.pt").read_bytes() == b"another tool's checkpoint"


async def test_a_copied_checkpoint_directory_is_not_taken_for_another_step(tmp_path: Path) -> None:
    import shutil

    await save_steps(tmp_path, [30])
    shutil.copytree(tmp_path / "step_30", tmp_path / "step_35")
    (tmp_path / TRACKER).write_text("35")
    with pytest.raises(asyncsave.CheckpointNotFoundError) as err:
        asyncsave.latest(tmp_path)
    assert "step 30, not 35" in str(err.value.__cause__)
    assert asyncsave.latest(tmp_path, fallback=True).step == 30  # type: ignore[union-attr]


async def test_fallback_skips_a_checkpoint_whose_bytes_are_damaged(tmp_path: Path) -> None:
    await save_steps(tmp_path, [1, 2])
    data = sorted((tmp_path / "step_2").glob("*.safetensors"))[0]
    raw = bytearray(data.read_bytes())
    raw[-3] ^= 0x10
    data.write_bytes(bytes(raw))
    async with asyncsave.Checkpointer(tmp_path) as ckpt:
        with pytest.raises(asyncsave.ChecksumMismatchError):
            await ckpt.load_latest()
        restored = await ckpt.load_latest(fallback=True)
        assert restored is not None and restored.info.step == 1 and restored.state["step"] == 1


async def test_required_paths_reach_int_keys(tmp_path: Path) -> None:
    opt_state = {"state": {0: {"exp_avg": torch.ones(2)}}}
    async with asyncsave.Checkpointer(tmp_path) as ckpt:
        await (await ckpt.save(1, {"optim": opt_state}))
    asyncsave.load(tmp_path / "step_1", required=["optim/state/0/exp_avg"])
    with pytest.raises(asyncsave.MissingItemError):
        asyncsave.load(tmp_path / "step_1", required=["optim/state/1/exp_avg"])


async def test_a_template_object_that_refuses_its_state_is_a_typed_error(tmp_path: Path) -> None:
    async with asyncsave.Checkpointer(tmp_path) as ckpt:
        await (await ckpt.save(1, {"model": {"weight": torch.ones(2)}}))
    with pytest.raises(asyncsave.InvalidStateError) as err:
        asyncsave.load(tmp_path / "step_1", {"model": torch.nn.Linear(3, 3)})
    # A module is checked against its state_dict() before its own loader runs:
    # the error names the keys (tests/test_template_rule.py has the whole rule).
    assert err.value.key == "model/weight" and "'model/bias'" in str(err.value)


async def test_the_tracker_never_moves_back_past_a_checkpoint_that_is_gone(tmp_path: Path) -> None:
    """Invariant 2: a tracker naming a lost checkpoint (20) is not moved back to a
    newer save of an older step (11); resume then needs fallback=True."""
    import shutil

    await save_steps(tmp_path, [10, 20])
    shutil.rmtree(tmp_path / "step_20")
    async with asyncsave.Checkpointer(tmp_path) as ckpt:
        restored = await ckpt.load_latest(fallback=True)
        assert restored is not None and restored.info.step == 10
        with pytest.warns(asyncsave.CheckpointWarning, match="below the tracked step 20"):
            await (await ckpt.save(11, {"w": torch.ones(4), "step": 11}))
    assert (tmp_path / TRACKER).read_text() == "20"
    assert asyncsave.latest(tmp_path, fallback=True).step == 11  # type: ignore[union-attr]


async def test_fallback_never_restarts_from_scratch_when_training_ran(tmp_path: Path) -> None:
    import os

    await save_steps(tmp_path, [10])
    data = sorted((tmp_path / "step_10").glob("*.safetensors"))[0]
    os.truncate(data, 100)
    async with asyncsave.Checkpointer(tmp_path) as ckpt:  # moves step_10 aside
        with pytest.raises(asyncsave.CheckpointNotFoundError, match="not starting from scratch"):
            await ckpt.load_latest(fallback=True)
    with pytest.raises(asyncsave.CheckpointNotFoundError):
        asyncsave.latest(tmp_path, fallback=True)


async def test_every_reader_agrees_on_a_commit_newer_than_the_tracker(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    await save_steps(tmp_path, [10, 20, 30])
    (tmp_path / TRACKER).write_text("10")
    with caplog.at_level(logging.WARNING, logger="asyncsave"):
        assert asyncsave.latest(tmp_path).step == 30  # type: ignore[union-attr]
    assert any("step 30 is committed" in r.getMessage() for r in caplog.records)
    async with asyncsave.Checkpointer(tmp_path) as ckpt:
        restored = await ckpt.load_latest()
        assert restored is not None and restored.info.step == 30


async def test_swapped_step_directories_never_load_as_each_other(tmp_path: Path) -> None:
    from asyncsave.testing import cli as main

    await save_steps(tmp_path, [10, 20])
    (tmp_path / "step_10").rename(tmp_path / "tmp")
    (tmp_path / "step_20").rename(tmp_path / "step_10")
    (tmp_path / "tmp").rename(tmp_path / "step_20")
    for call in (asyncsave.load, asyncsave.verify):
        with pytest.raises(asyncsave.CorruptCheckpointError, match="not 20"):
            call(tmp_path / "step_20")
    assert main(["verify", str(tmp_path)], out=__import__("io").StringIO()) == 1
    assert main(["ls", str(tmp_path)], out=__import__("io").StringIO()) == 1


@pytest.mark.parametrize("case", ["one step ahead of the tracker", "first commit, no tracker yet"])
async def test_a_reader_in_a_savers_commit_gap_is_told_at_info_not_warned(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, case: str
) -> None:
    """What a reader polling ``latest()`` sees between a save's rename and its
    tracker write (every save has that gap): the new step, an INFO record, and no
    WARNING about a crash (before: one per poll). Two steps ahead, or no tracker
    beside two steps, stays a warning (tests above)."""
    if case == "one step ahead of the tracker":
        await save_steps(tmp_path, [10, 20])
        (tmp_path / TRACKER).write_text("10")
    else:
        await save_steps(tmp_path, [20])
        (tmp_path / TRACKER).unlink()
    with caplog.at_level(logging.INFO, logger="asyncsave"):
        info = asyncsave.latest(tmp_path)
    assert info is not None and info.step == 20
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.records
    assert any(r.levelno == logging.INFO and "moving" in r.getMessage() for r in caplog.records), (
        caplog.records
    )


@pytest.mark.parametrize("others", [(), (1,), (1, 3)])
async def test_a_tracker_naming_a_missing_step_says_what_can_be_done(
    tmp_path: Path, others: tuple[int, ...]
) -> None:
    """The fallback is offered only where another checkpoint is there to fall back
    to; otherwise, and when the fallback finds nothing loadable, the error says how
    to start from scratch on purpose (remove the tracker) instead."""
    if others:
        await save_steps(tmp_path, list(others))
    (tmp_path / TRACKER).write_text("7")
    with pytest.raises(asyncsave.CheckpointNotFoundError) as err:
        asyncsave.latest(tmp_path)
    message = str(err.value)
    if others:
        assert "pass fallback=True" in message
        assert asyncsave.latest(tmp_path, fallback=True).step == max(others)
    else:
        assert "pass fallback=True" not in message
        assert f"remove {tmp_path / TRACKER}" in message
        with pytest.raises(asyncsave.CheckpointNotFoundError, match="remove .*" + TRACKER):
            asyncsave.latest(tmp_path, fallback=True)
