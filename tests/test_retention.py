"""Retention: restart-safe, applied only after a commit, never deleting what resume
needs (S2, S3, S8)."""

from __future__ import annotations

import errno
import logging
import subprocess
import sys
import textwrap
import threading
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import pytest
import torch
from faults import FaultyFS, block, pause
from hypothesis import given
from hypothesis import strategies as st

import asyncsave

pytestmark = pytest.mark.anyio


def _steps(root: Path) -> list[int]:
    return sorted(int(p.name.split("_")[-1]) for p in root.iterdir() if p.name.startswith("step_"))


def _state(step: int) -> dict[str, Any]:
    return {"w": torch.full((64,), float(step)), "step": step}


# ``remove_tree`` (retention's delete) and ``exchange`` (an overwrite's commit) are
# operations of the fault-injecting file system like any other.
RetireFS = FaultyFS


# -- the rules on their own ------------------------------------------------------


@dataclass(frozen=True)
class Candidate:
    """A committed checkpoint as a rule's ``keep`` sees it: its ``step``, the
    ``training_info`` saved with it and its tensor bytes (what the engine passes:
    checked below)."""

    step: int
    training_info: Mapping[str, object]
    nbytes: int = 0


def _cands(*steps: int, **infos: dict[str, Any]) -> list[Any]:
    return [Candidate(s, infos.get(f"s{s}", {})) for s in steps]


class Recording(asyncsave.Retention):
    """A user's rule: keeps everything, and records what each pass showed it."""

    def __init__(self) -> None:
        self.passes: list[list[Any]] = []

    def keep(self, candidates: list[Any]) -> set[int]:
        self.passes.append(list(candidates))
        return {c.step for c in candidates}


async def test_a_rule_is_shown_every_committed_checkpoint_sorted_with_its_training_info(
    tmp_path: Path,
) -> None:
    rule = Recording()
    async with asyncsave.Checkpointer(tmp_path, retention=rule) as ckpt:
        for step in (2, 5, 3):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", asyncsave.CheckpointWarning)  # 3 below 5
                await (await ckpt.save(step, _state(step), training_info={"r": step / 10}))
    last = rule.passes[-1]
    assert [c.step for c in last] == [2, 3, 5]
    assert [dict(c.training_info) for c in last] == [{"r": 0.2}, {"r": 0.3}, {"r": 0.5}]
    # the rules below are fed candidates of the same shape
    assert asyncsave.KeepLast(2).keep(last) == asyncsave.KeepLast(2).keep(_cands(2, 3, 5))


def test_keep_last_keeps_the_highest_steps() -> None:
    assert asyncsave.KeepLast(2).keep(_cands(1, 2, 3, 4)) == {3, 4}
    assert asyncsave.KeepLast(9).keep(_cands(1, 2)) == {1, 2}


@given(
    st.lists(st.integers(min_value=0, max_value=100), min_size=1, max_size=12), st.integers(1, 400)
)
def test_keep_bytes_keeps_the_newest_within_the_budget(sizes: list[int], budget: int) -> None:
    cands = [Candidate(step, {}, nbytes) for step, nbytes in enumerate(sizes, start=1)]
    kept = asyncsave.KeepBytes(budget).keep(cands)
    newest_first = sorted(kept, reverse=True)
    # a run of the newest steps, adding up to at most the budget, and the next older would not fit
    assert newest_first == list(range(len(sizes), len(sizes) - len(kept), -1))
    assert sum(sizes[s - 1] for s in kept) <= budget
    older = len(sizes) - len(kept)
    assert older == 0 or sum(sizes[s - 1] for s in kept) + sizes[older - 1] > budget


def test_keep_bytes_sees_each_checkpoints_tensor_bytes(tmp_path: Path) -> None:
    async def run() -> list[int]:
        rule = asyncsave.KeepBytes(2 * 4 * 100)  # two saves of 100 float32
        async with asyncsave.Checkpointer(tmp_path, retention=rule) as ckpt:
            for step in (1, 2, 3, 4):
                await (await ckpt.save(step, {"w": torch.zeros(100)}))
        return sorted(int(p.name.split("_")[1]) for p in tmp_path.glob("step_*"))

    assert anyio.run(run) == [3, 4]
    with pytest.raises(ValueError, match="KeepBytes"):
        asyncsave.KeepBytes(0)


def test_keep_every_keeps_multiples() -> None:
    assert asyncsave.KeepEvery(5).keep(_cands(3, 5, 7, 10, 12)) == {5, 10}


def test_keep_best_ranks_by_metric_either_way_and_skips_unranked() -> None:
    c = _cands(
        1, 2, 3, 4, 5,
        s1={"r": 0.1}, s2={"r": 0.9}, s3={"r": float("nan")}, s4={"r": 0.5}, s5={},
    )  # fmt: skip
    assert asyncsave.KeepBest(2, metric="r").keep(c) == {2, 4}
    assert asyncsave.KeepBest(1, metric="r", mode="min").keep(c) == {1}
    assert asyncsave.KeepBest(9, metric="r").keep(c) == {1, 2, 4}  # NaN and missing: unranked


def test_rules_combine_as_a_union() -> None:
    rule = asyncsave.KeepLast(1) | asyncsave.KeepEvery(5) | asyncsave.KeepBest(1, metric="r")
    c = _cands(4, 5, 6, 7, s4={"r": 3.0}, s6={"r": 1.0})
    assert rule.keep(c) == {4, 5, 7}


@pytest.mark.parametrize(
    "make",
    [
        lambda: asyncsave.KeepLast(0),
        lambda: asyncsave.KeepLast(True),
        lambda: asyncsave.KeepEvery(-1),
        lambda: asyncsave.KeepBest(1, metric=""),
        lambda: asyncsave.KeepBest(1, metric="r", mode="best"),
        lambda: asyncsave.CheckpointOptions(retention="keep-last-2"),
        lambda: asyncsave.CheckpointOptions(retention=[asyncsave.KeepLast(1), 3]),
    ],
)
def test_bad_retention_arguments_are_value_errors(make: Any) -> None:
    with pytest.raises(ValueError):
        make()


def test_a_list_of_rules_means_any_of_them() -> None:
    opts = asyncsave.CheckpointOptions(retention=[asyncsave.KeepLast(1), asyncsave.KeepEvery(2)])
    assert opts.retention is not None
    assert opts.retention.keep(_cands(1, 2, 3)) == {2, 3}


# -- the engine applies them -------------------------------------------------------


async def test_keep_last_and_every_on_disk(tmp_path: Path) -> None:
    rule = asyncsave.KeepLast(2) | asyncsave.KeepEvery(5)
    async with asyncsave.Checkpointer(tmp_path, retention=rule) as ckpt:
        for step in range(1, 13):
            await (await ckpt.save(step, _state(step)))
    assert _steps(tmp_path) == [5, 10, 11, 12]
    assert asyncsave.latest(tmp_path).step == 12  # type: ignore[union-attr]


async def test_keep_best_reads_metrics_from_the_manifests(tmp_path: Path) -> None:
    rewards = {1: 0.2, 2: 0.9, 3: 0.1, 4: 0.8, 5: 0.3, 6: 0.05}
    rule = asyncsave.KeepBest(2, metric="eval/reward") | asyncsave.KeepLast(1)
    async with asyncsave.Checkpointer(tmp_path, retention=rule) as ckpt:
        for step, r in rewards.items():
            info = await (await ckpt.save(step, _state(step), training_info={"eval/reward": r}))
            assert info is not None and info.training_info == {"eval/reward": r}
    assert _steps(tmp_path) == [2, 4, 6]
    # a new process ranks from disk the same way
    async with asyncsave.Checkpointer(tmp_path, retention=rule) as ckpt:
        await (await ckpt.save(7, _state(7), training_info={"eval/reward": 0.85}))
    assert _steps(tmp_path) == [2, 7]


async def test_s3_retention_survives_a_restart(tmp_path: Path) -> None:
    """S3 (verl #7395): keep one; save step 1; a new checkpointer resumes and saves
    step 2: only step 2 remains."""
    async with asyncsave.Checkpointer(tmp_path, retention=asyncsave.KeepLast(1)) as ckpt:
        await (await ckpt.save(1, _state(1)))
    async with asyncsave.Checkpointer(tmp_path, retention=asyncsave.KeepLast(1)) as ckpt:
        restored = await ckpt.load_latest()
        assert restored is not None and restored.info.step == 1
        await (await ckpt.save(2, _state(2)))
    assert _steps(tmp_path) == [2]


async def test_the_resumed_checkpoint_stays_until_a_newer_one_commits(tmp_path: Path) -> None:
    async with asyncsave.Checkpointer(tmp_path) as ckpt:
        await (await ckpt.save(3, _state(3)))
    gate = threading.Event()  # step 4 pauses before its manifest: written, not committed
    fs = FaultyFS(
        "create", pause(gate), where=lambda p: ".asyncsave-tmp-4-" in p and "manifest" in p
    )
    async with asyncsave.Checkpointer(
        tmp_path, filesystem=fs, retention=asyncsave.KeepLast(1)
    ) as ckpt:
        assert (await ckpt.load_latest()) is not None
        h4 = await ckpt.save(4, _state(4))
        with anyio.fail_after(30):
            while not fs.fired.is_set():
                await anyio.sleep(0.01)
        with pytest.warns(asyncsave.CheckpointWarning, match="below the tracked step"):
            info2 = await (await ckpt.save(2, _state(2)))  # a late, older step commits
        assert info2 is not None and info2.path.exists()  # not retired by its own pass
        assert _steps(tmp_path) == [2, 3]
        gate.set()
        await h4
    assert _steps(tmp_path) == [4]


async def test_the_tracked_checkpoint_is_never_deleted(tmp_path: Path) -> None:
    """A late, older step commits after a newer one: the newer (tracked) one stays."""
    async with asyncsave.Checkpointer(tmp_path, retention=asyncsave.KeepEvery(4)) as ckpt:
        await (await ckpt.save(10, _state(10)))
        with pytest.warns(asyncsave.CheckpointWarning, match="below the tracked step 10"):
            await (await ckpt.save(8, _state(8)))
    assert _steps(tmp_path) == [8, 10]
    assert (tmp_path / "latest_checkpointed_iteration.txt").read_text().strip() == "10"


async def test_retention_waits_for_the_commit_s2(tmp_path: Path) -> None:
    """S2 (verl #4667): keep one; step 100 committed; step 200's writer hangs mid-file
    and the run dies: step 100 is still there and resumes bit-exact."""
    gate = threading.Event()
    fs = FaultyFS("write", block(gate), where=lambda p: ".asyncsave-tmp-200" in p)
    opts = asyncsave.CheckpointOptions(
        filesystem=fs, retention=asyncsave.KeepLast(1), close_timeout_s=0.5
    )
    state100 = _state(100)
    try:
        async with asyncsave.Checkpointer(tmp_path, opts) as ckpt:
            await (await ckpt.save(100, state100))
            await ckpt.save(200, _state(200))
            with anyio.fail_after(30):
                while not fs.fired.is_set():
                    await anyio.sleep(0.01)
            assert _steps(tmp_path) == [100]  # nothing retired before 200 commits
            assert ckpt.tracked_step == 100
    except asyncsave.CheckpointTimeoutError:
        pass  # the abandoned save: this is the "crash"
    finally:
        gate.set()
    async with asyncsave.Checkpointer(tmp_path, retention=asyncsave.KeepLast(1)) as ckpt:
        restored = await ckpt.load_latest()
    assert restored is not None and restored.info.step == 100
    assert torch.equal(restored.state["w"], state100["w"])
    assert _steps(tmp_path) == [100]


async def test_a_save_in_flight_is_never_deleted(tmp_path: Path) -> None:
    """An overwrite of step 3 is in flight while step 4 commits under KeepLast(1):
    step 3 stays until its own save is done."""
    gate = threading.Event()
    fs = FaultyFS(
        "create", pause(gate), where=lambda p: ".asyncsave-tmp-3-" in p and "manifest" in p
    )
    async with asyncsave.Checkpointer(tmp_path) as ckpt:
        await (await ckpt.save(3, _state(3)))
    async with asyncsave.Checkpointer(
        tmp_path, filesystem=fs, retention=asyncsave.KeepLast(1)
    ) as ckpt:
        h3 = await ckpt.save(3, _state(33), overwrite=True)
        with anyio.fail_after(30):
            while not fs.fired.is_set():
                await anyio.sleep(0.01)
        await (await ckpt.save(4, _state(4)))
        assert _steps(tmp_path) == [3, 4]
        gate.set()
        await h3  # its own pass never retires it; the next pass does
        assert _steps(tmp_path) == [3, 4]
        await (await ckpt.save(5, _state(5)))
    assert _steps(tmp_path) == [5]


async def test_a_failed_delete_never_fails_the_save_and_is_retried(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    def fail() -> None:
        raise OSError(errno.EIO, "injected")

    fs = RetireFS("remove_tree", fail, n=1)
    async with asyncsave.Checkpointer(
        tmp_path, filesystem=fs, retention=asyncsave.KeepLast(1)
    ) as ckpt:
        await (await ckpt.save(1, _state(1)))
        with caplog.at_level(logging.WARNING, logger="asyncsave"):
            info = await (await ckpt.save(2, _state(2)))
        assert info is not None and info.step == 2
        assert "retention failed" in caplog.text
        # step 1 was renamed aside before the failed delete: no partial final dir
        assert _steps(tmp_path) == [2]
        await (await ckpt.save(3, _state(3)))
    assert _steps(tmp_path) == [3]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".asyncsave-tmp")]


async def test_a_crash_between_retire_and_delete_leaves_only_temp_dirs(tmp_path: Path) -> None:
    """The retired checkpoint is renamed to a temp name before removal: a crash mid-
    removal never leaves a partial checkpoint under a final name."""
    gate = threading.Event()
    fs = RetireFS("remove_tree", block(gate), n=1)
    opts = asyncsave.CheckpointOptions(
        filesystem=fs, retention=asyncsave.KeepLast(1), close_timeout_s=0.5, save_timeout_s=60
    )
    try:
        async with asyncsave.Checkpointer(tmp_path, opts) as ckpt:
            await (await ckpt.save(1, _state(1)))
            await ckpt.save(2, _state(2))
            with anyio.fail_after(30):
                while not fs.fired.is_set():
                    await anyio.sleep(0.01)
            assert _steps(tmp_path) == [2]
            assert [p for p in tmp_path.iterdir() if p.name.startswith(".asyncsave-tmp-retired-1-")]
    except asyncsave.CheckpointTimeoutError:
        pass
    finally:
        gate.set()
    async with asyncsave.Checkpointer(tmp_path):
        pass
    assert _steps(tmp_path) == [2]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".asyncsave-tmp")]


async def test_bad_training_info_names_the_key_and_writes_nothing(tmp_path: Path) -> None:
    async with asyncsave.Checkpointer(tmp_path) as ckpt:
        for bad in ({"r": float("inf")}, {"r": [1]}, {3: 1}, {"": 1}, "r=1"):
            with pytest.raises(asyncsave.InvalidStateError, match="training_info") as info:
                await ckpt.save(1, _state(1), training_info=bad)  # type: ignore[arg-type]
            assert info.value.key == "training_info"
    assert _steps(tmp_path) == []


_RESTART_SCRIPT = textwrap.dedent(
    """
    import sys, anyio, torch, asyncsave

    async def main(root, first, last):
        rule = asyncsave.KeepLast(2) | asyncsave.KeepEvery(4)
        async with asyncsave.Checkpointer(root, retention=rule) as ckpt:
            restored = await ckpt.load_latest()
            start = 1 if restored is None else restored.state["step"] + 1
            assert start == first, (start, first)
            for step in range(start, last + 1):
                await ckpt.save(step, {"w": torch.full((8,), float(step)), "step": step})
            await ckpt.wait()

    anyio.run(main, sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))
    """
)


@pytest.mark.slow
def test_retention_keeps_its_promise_across_three_process_restarts(tmp_path: Path) -> None:
    root = tmp_path / "run"
    for first, last, expected in (
        (1, 5, [4, 5]),
        (6, 9, [4, 8, 9]),
        (10, 14, [4, 8, 12, 13, 14]),
    ):
        subprocess.run(
            [sys.executable, "-c", _RESTART_SCRIPT, str(root), str(first), str(last)],
            check=True,
            timeout=120,
        )
        assert _steps(root) == expected
        for step in expected:
            state = asyncsave.load(root / f"step_{step}")
            assert torch.equal(state["w"], torch.full((8,), float(step)))


@pytest.mark.parametrize("layout", ["asyncsave", "nemo-rl"])
@pytest.mark.filterwarnings("ignore::asyncsave.CheckpointWarning")  # older steps on purpose
async def test_a_late_older_step_is_retired_by_the_next_pass_and_can_be_saved_again(
    tmp_path: Path, layout: str
) -> None:
    """Without a tracker (nemo-rl) the newest step is what resume takes: never retired."""
    async with asyncsave.Checkpointer(
        tmp_path, layout=layout, retention=asyncsave.KeepLast(1)
    ) as ckpt:
        await (await ckpt.save(10, _state(10)))
        info = await (await ckpt.save(8, _state(8)))
        assert info is not None and info.path.exists() and _steps(tmp_path) == [8, 10]
        await (await ckpt.save(11, _state(11)))
        assert _steps(tmp_path) == [11]
        again = await (await ckpt.save(8, _state(88)))  # gone: a real save again
        assert again is not None and again.path.exists()
    assert torch.equal(asyncsave.load(tmp_path / "step_8")["w"], _state(88)["w"])


async def test_retention_spares_a_save_in_flight_and_the_newest_without_a_tracker(
    tmp_path: Path,
) -> None:
    """No tracker (nemo-rl): the newest committed step is what resume takes, so a
    rule that keeps nothing still leaves it when a late, older step commits; and a
    step whose overwrite is in flight stays until a pass after its save ends."""
    async with asyncsave.Checkpointer(tmp_path, layout="nemo-rl") as ckpt:
        for step in (1, 3, 5):
            await (await ckpt.save(step, _state(step)))
    gate = threading.Event()
    fs = FaultyFS(
        "create", pause(gate), where=lambda p: ".asyncsave-tmp-3-" in p and "manifest" in p
    )
    drop_all = asyncsave.KeepEvery(1000)  # keeps none of 1..6
    async with asyncsave.Checkpointer(
        tmp_path, layout="nemo-rl", filesystem=fs, retention=drop_all
    ) as ckpt:
        h3 = await ckpt.save(3, _state(33), overwrite=True)
        try:
            with anyio.fail_after(30):
                while not fs.fired.is_set():
                    await anyio.sleep(0.01)
            await (await ckpt.save(4, _state(4)))  # late: older than 5
            assert _steps(tmp_path) == [3, 4, 5]  # 3 in flight, 4 just committed, 5 the newest
        finally:
            gate.set()
        await h3
        await (await ckpt.save(6, _state(6)))
    assert _steps(tmp_path) == [6]
