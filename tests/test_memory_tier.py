"""The memory tier (issue 28): a save survives the death of the training process
once ``save()`` has returned.

Kill matrices: the trainer SIGKILLed after ``save()`` returned while its saver
stands at each phase of the commit to memory (staging in the saver, writing,
committing, tracking), on 1 and 2 ranks: nothing returned is lost and the
restart resumes bit-exact from memory. The saver SIGKILLed at each phase: the
trainer's next call raises :class:`SaverDiedError` (no hang) and the last
committed checkpoint stays loadable. Around them: the round trip, the persist
interval, the byte budget, resume from memory or from the root (whichever is
newer), refusals, bad input, lazy saves, CUDA sources.
"""

from __future__ import annotations

import datetime
import errno
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import anyio
import psutil
import pytest
import torch

import asyncsave
from asyncsave import MemoryTier, SaverDiedError, UnsupportedCombinationError

sys.path.insert(0, str(Path(__file__).parent))
from distributed import run_ranks, start_ranks, values
from memtier_child import same, state_for

pytestmark = pytest.mark.slow

CHILD = Path(__file__).parent / "memtier_child.py"
PAUSE_ENV = "ASYNCSAVE_SAVER_PAUSE"  # asyncsave._saverproc.PAUSE_ENV
PHASES = ("staging", "writing", "committing", "tracking")


@pytest.fixture
def shm() -> Iterator[Path]:
    """A private directory in shared memory (``/dev/shm`` when there is one),
    removed afterwards with whatever a killed saver left there."""
    base = "/dev/shm" if os.path.isdir("/dev/shm") else None
    d = Path(tempfile.mkdtemp(prefix="asyncsave-test-", dir=base))
    yield d
    shutil.rmtree(d, ignore_errors=True)


def _gone(pid: int, timeout_s: float = 120.0) -> None:
    """Wait until ``pid`` exited (a zombie counts: its parent was killed)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return
        except psutil.NoSuchProcess:
            return
        time.sleep(0.05)
    os.kill(pid, signal.SIGKILL)
    raise AssertionError(f"process {pid} still alive after {timeout_s} s")


def _wait_file(path: Path, proc: Any = None, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"the trainer exited ({proc.returncode}) before {path.name}")
        if time.monotonic() > deadline:
            raise AssertionError(f"{path} did not appear within {timeout_s} s")
        time.sleep(0.02)


def _child(
    root: Path, shm: Path, steps: str, out: Path, *, hold: bool, pause: str | None = None
) -> Any:
    env = dict(os.environ)
    env.pop(PAUSE_ENV, None)
    if pause is not None:
        env[PAUSE_ENV] = f"{pause}:{out}"
    args = [sys.executable, str(CHILD), str(root), str(shm), steps, str(out)]
    return subprocess.Popen(args + (["hold"] if hold else []), env=env)


def _clean_save(root: Path, shm: Path, step: int, tmp: Path) -> None:
    out = tmp / f"clean{step}"
    out.mkdir()
    proc = _child(root, shm, str(step), out, hold=False)
    assert proc.wait(120) == 0


def _kill_after_return(root: Path, shm: Path, steps: str, tmp: Path, pause: str | None) -> int:
    """Run a trainer that saves ``steps`` (``"7,8"``); SIGKILL it once every
    ``save()`` returned (and its saver reached ``pause`` in the first save), let
    the saver go on; its pid."""
    out = tmp / f"kill{steps}-{pause}"
    out.mkdir()
    proc = _child(root, shm, steps, out, hold=True, pause=pause)
    try:
        _wait_file(out / "returned", proc)
        if pause is not None:
            _wait_file(out / "reached", proc)
    finally:
        proc.kill()
        proc.wait(30)
    (out / "release").touch()
    saver = json.loads((out / "returned").read_text())["saver_pid"]
    _gone(saver)
    return int(saver)


async def _resume(root: Path, shm: Path, template: Any = None) -> tuple[Any, Any]:
    async with asyncsave.Checkpointer(root, memory=MemoryTier(shm_dir=str(shm))) as ckpt:
        restored = await ckpt.load_latest(template)
        memory_root = ckpt.memory_root
    return restored, memory_root


@pytest.mark.parametrize("phase", [None, *PHASES])
def test_a_trainer_killed_after_save_returned_loses_nothing(
    tmp_path: Path, shm: Path, phase: str | None
) -> None:
    root = tmp_path / "root"
    _clean_save(root, shm, 3, tmp_path)
    # Step 7 stops at the phase; step 8 (the same structure) is answered on receipt.
    _kill_after_return(root, shm, "7,8", tmp_path, phase)
    # The saver committed both to memory, persisted both (every save), and the newest at its end.
    assert sorted(int(p.name.split("_")[1]) for p in root.glob("step_*")) == [3, 7, 8]
    for step in (7, 8):
        assert same(asyncsave.load(root / f"step_{step}"), state_for(step))
    restored, memory_root = anyio.run(_resume, root, shm)
    assert restored.info.step == 8
    assert same(restored.state, state_for(8))
    assert Path(restored.info.path).is_relative_to(memory_root)  # read from memory
    assert restored.state["model"]["emb"].data_ptr() == restored.state["model"]["head"].data_ptr()
    assert not any(shm.iterdir())  # a clean close removes the tier


@pytest.mark.parametrize("phase", PHASES)
def test_a_killed_saver_is_a_typed_error_and_the_last_commit_stays(
    tmp_path: Path, shm: Path, phase: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = tmp_path / "root"
    _clean_save(root, shm, 3, tmp_path)
    monkeypatch.setenv(PAUSE_ENV, f"{phase}:{tmp_path}")

    async def run() -> None:
        ckpt = asyncsave.Checkpointer(root, memory=MemoryTier(shm_dir=str(shm)))
        with pytest.raises(SaverDiedError, match="killed by SIGKILL"):
            async with ckpt:
                handle = await ckpt.save(7, state_for(7))
                await anyio.to_thread.run_sync(_wait_file, tmp_path / "reached")
                assert ckpt.saver_pid is not None
                os.kill(ckpt.saver_pid, signal.SIGKILL)
                with pytest.raises(SaverDiedError):
                    await handle
                with pytest.raises(SaverDiedError):
                    await ckpt.wait()
                with pytest.raises(SaverDiedError):
                    await ckpt.save(8, state_for(8))

    anyio.run(run)
    monkeypatch.delenv(PAUSE_ENV)
    restored, _ = anyio.run(_resume, root, shm)
    # Past the rename (tracking) step 7 is committed in memory; before it, step 3 stands.
    expected = 7 if phase == "tracking" else 3
    assert restored.info.step == expected
    assert same(restored.state, state_for(expected))


def _resume_rank(rank: int, world_size: int, root: str, shm: str) -> tuple[int, bool, bool]:
    async def run() -> tuple[int, bool, bool]:
        async with asyncsave.Checkpointer(root, memory=MemoryTier(shm_dir=shm)) as ckpt:
            restored = await ckpt.load_latest()
            assert ckpt.memory_root is not None
            from_memory = Path(restored.info.path).is_relative_to(ckpt.memory_root)
            step = restored.info.step
            return step, same(restored.state, state_for(step, rank)), from_memory

    return anyio.run(run)


@pytest.mark.parametrize("phase", [None, "writing", "committing"])
def test_two_ranks_killed_after_save_returned_lose_nothing(
    tmp_path: Path, shm: Path, phase: str | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    from memtier_child import rank_main

    root = tmp_path / "root"
    out = tmp_path / "out"
    out.mkdir()
    if phase is not None:
        monkeypatch.setenv(PAUSE_ENV, f"{phase}:{out}")
    ranks = start_ranks(
        rank_main, 2, tmp_path, str(root), str(shm), [7, 8], str(out), timeout_s=180
    )
    try:
        for r in range(2):
            _wait_file(out / f"returned{r}")
        if phase is not None:
            _wait_file(out / "reached")
    finally:
        for p in ranks.procs:
            if p.is_alive():
                os.kill(p.pid, signal.SIGKILL)
        results = ranks.collect()
    assert all(kind == "exit" for kind, _ in results.values()), results
    (out / "release").touch()
    monkeypatch.delenv(PAUSE_ENV, raising=False)
    for r in range(2):
        _gone(json.loads((out / f"returned{r}").read_text())["saver_pid"])
    assert asyncsave.latest(root).step == 8  # persisted by the savers alone
    got = values(run_ranks(_resume_rank, 2, tmp_path, str(root), str(shm), timeout_s=180))
    assert got == [(8, True, True), (8, True, True)]
    asyncsave.verify(root / "step_7")  # step 7 was persisted too, every byte of both ranks


def test_round_trip_persist_interval_and_clean_close(tmp_path: Path, shm: Path) -> None:
    root = tmp_path / "root"
    tier = MemoryTier(shm_dir=str(shm), persist=asyncsave.SaveEvery(3))

    async def run() -> list[Any]:
        handles = []
        async with asyncsave.Checkpointer(root, memory=tier) as ckpt:
            assert isinstance(ckpt, asyncsave.Checkpointer)
            for step in range(1, 8):
                handles.append(await ckpt.save(step, state_for(step)))
            infos = [await h for h in handles]
            assert ckpt.slots_pinned == torch.cuda.is_available()  # registered on CUDA hosts
            assert [h.due_to_persist for h in handles] == [s % 3 == 0 for s in range(1, 8)]
            assert (await handles[2].persisted()).step == 3
            assert ckpt.tracked_step == 7 and ckpt.pending_steps == []
            saver = psutil.Process(ckpt.saver_pid)
        assert not saver.is_running() or saver.status() == psutil.STATUS_ZOMBIE
        return infos

    infos = anyio.run(run)
    assert [i.step for i in infos] == list(range(1, 8))
    # SaveEvery(3) persisted 3 and 6; close persisted the newest, 7.
    assert sorted(int(p.name.split("_")[1]) for p in root.glob("step_*")) == [3, 6, 7]
    loaded = asyncsave.load(root / "step_7")
    assert same(loaded, state_for(7))
    assert loaded["model"]["emb"].data_ptr() == loaded["model"]["head"].data_ptr()
    assert not any(shm.iterdir())


def test_modules_and_optimizers_resume_in_place(tmp_path: Path, shm: Path) -> None:
    torch.manual_seed(0)

    def trainer() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16))
        return model, torch.optim.AdamW(model.parameters(), lr=0.1)

    model, opt = trainer()
    for _ in range(3):
        model(torch.randn(4, 8)).sum().backward()
        opt.step()
    tier = MemoryTier(shm_dir=str(shm))

    async def save() -> None:
        async with asyncsave.Checkpointer(tmp_path, memory=tier) as ckpt:
            await ckpt.save(3, {"model": model, "optim": opt, "rng": asyncsave.RNGState()})

    anyio.run(save)
    model2, opt2 = trainer()
    restored, _ = anyio.run(
        _resume, tmp_path, shm, {"model": model2, "optim": opt2, "rng": asyncsave.RNGState()}
    )
    assert restored.info.step == 3
    for a, b in zip(model.state_dict().values(), model2.state_dict().values(), strict=True):
        assert torch.equal(a, b)
    s1, s2 = opt.state_dict()["state"], opt2.state_dict()["state"]
    assert all(torch.equal(s1[k]["exp_avg_sq"], s2[k]["exp_avg_sq"]) for k in s1)


def test_resume_takes_the_root_when_it_is_newer_than_memory(tmp_path: Path, shm: Path) -> None:
    root = tmp_path / "root"
    _kill_after_return(root, shm, "7", tmp_path, None)  # memory keeps step 7

    async def newer() -> None:
        async with asyncsave.Checkpointer(root) as ckpt:  # another run, no memory tier
            await (await ckpt.save(9, state_for(9)))

    anyio.run(newer)
    restored, memory_root = anyio.run(_resume, root, shm)
    assert restored.info.step == 9 and same(restored.state, state_for(9))
    assert not Path(restored.info.path).is_relative_to(memory_root)


def test_snapshots_in_memory_stay_within_the_byte_budget(tmp_path: Path, shm: Path) -> None:
    nbytes = sum(
        t.numel() * t.element_size()
        for t in (
            state_for(1)["model"]["emb"],
            state_for(1)["model"]["bias"],
            state_for(1)["optim"]["exp_avg"],
            state_for(1)["optim"]["exp_avg_sq"],
        )
    )
    tier = MemoryTier(shm_dir=str(shm), budget_bytes=3 * nbytes)

    async def run() -> list[str]:
        async with asyncsave.Checkpointer(tmp_path / "root", memory=tier) as ckpt:
            for step in range(1, 9):
                await (await ckpt.save(step, state_for(step)))
            await ckpt.wait()
            assert ckpt.memory_root is not None
            for _ in range(100):  # retention runs after the commit is reported
                kept = sorted(p.name for p in ckpt.memory_root.glob("step_*"))
                if len(kept) <= 3:
                    break
                await anyio.sleep(0.05)
            return kept

    assert anyio.run(run) == ["step_6", "step_7", "step_8"]


def test_refused_combinations_say_why(tmp_path: Path, shm: Path) -> None:
    tier = MemoryTier(shm_dir=str(shm))
    with pytest.raises(UnsupportedCombinationError, match="persistent="):
        asyncsave.Checkpointer(tmp_path, memory=tier, persistent=asyncsave.Tier(tmp_path / "p"))
    with pytest.raises(UnsupportedCombinationError, match="incremental"):
        asyncsave.Checkpointer(tmp_path, memory=tier, incremental=True)
    with pytest.raises(UnsupportedCombinationError, match="SyncCheckpointer"):
        asyncsave.SyncCheckpointer(tmp_path, memory=tier)
    with pytest.raises(ValueError, match=r"MemoryTier\.budget_bytes"):
        MemoryTier(budget_bytes=0)
    with pytest.raises(ValueError, match="memory="):
        asyncsave.Checkpointer(tmp_path, memory="yes")

    class Local(asyncsave.SavePolicy):  # a class the saver process cannot import
        def should_save(self, step: int) -> bool:
            return True

    async def unpicklable() -> None:
        async with asyncsave.Checkpointer(
            tmp_path, memory=MemoryTier(shm_dir=str(shm), persist=Local())
        ):
            pass

    with pytest.raises(ValueError, match="cannot be sent to the memory tier's saver"):
        anyio.run(unpicklable)

    async def update() -> None:
        async with asyncsave.Checkpointer(tmp_path, memory=tier) as ckpt:
            await (await ckpt.save(1, {"w": torch.ones(2)}))
            with pytest.raises(UnsupportedCombinationError, match="update"):
                await ckpt.update(1, "w", torch.zeros(2))

    anyio.run(update)
    assert not any(shm.iterdir())


def test_bad_input_is_refused_by_save_and_the_checkpointer_goes_on(
    tmp_path: Path, shm: Path
) -> None:
    async def run() -> None:
        async with asyncsave.Checkpointer(tmp_path, memory=MemoryTier(shm_dir=str(shm))) as ckpt:
            with pytest.raises(asyncsave.InvalidStateError, match="saver process"):
                await ckpt.save(1, {"w": torch.ones(2), "f": lambda: 1})
            with pytest.raises(asyncsave.UnsupportedTypeError, match="weird"):
                await ckpt.save(1, {"w": torch.ones(2), "weird": {1, 2}})
            with pytest.raises(asyncsave.InvalidStepError):
                await ckpt.save(-1, {"w": torch.ones(2)})
            with pytest.warns(asyncsave.CheckpointWarning):  # step 0 is skipped
                skipped = await ckpt.save(0, {"w": torch.ones(2)})
            assert skipped.skipped
            info = await (await ckpt.save(1, {"w": torch.ones(2)}))
            assert info.step == 1
            with pytest.warns(asyncsave.CheckpointWarning, match="committed"):
                again = await ckpt.save(1, {"w": torch.zeros(2)})
            assert (await again).step == 1

    anyio.run(run)
    assert torch.equal(asyncsave.load(tmp_path / "step_1")["w"], torch.ones(2))


def test_a_lazy_save_snapshots_at_staged(tmp_path: Path, shm: Path) -> None:
    w = torch.arange(1 << 16, dtype=torch.float32)

    async def run() -> None:
        async with asyncsave.Checkpointer(tmp_path, memory=MemoryTier(shm_dir=str(shm))) as ckpt:
            handle = await ckpt.save(2, {"w": w}, lazy=True)
            await handle.staged()
            w.add_(1)  # after staged(): not in the snapshot
            await handle

    anyio.run(run)
    assert torch.equal(
        asyncsave.load(tmp_path / "step_2")["w"], torch.arange(1 << 16, dtype=torch.float32)
    )


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_state_goes_through_pinned_shared_memory(tmp_path: Path, shm: Path) -> None:
    state = {
        "w": torch.randn(1 << 20, device="cuda"),
        "b": torch.randn(7, device="cuda").bfloat16(),
    }

    async def run() -> None:
        async with asyncsave.Checkpointer(tmp_path, memory=MemoryTier(shm_dir=str(shm))) as ckpt:
            await (await ckpt.save(1, state))
            assert ckpt.slots_pinned

    anyio.run(run)
    loaded = asyncsave.load(tmp_path / "step_1")
    assert torch.equal(loaded["w"], state["w"].cpu()) and torch.equal(loaded["b"], state["b"].cpu())


def test_a_storage_outage_fails_the_next_save_and_memory_keeps_the_saves(
    small_fs: Path, shm: Path
) -> None:
    full_root = small_fs

    def state(step: int) -> dict[str, Any]:
        return {"w": torch.full((384 * 1024,), float(step))}  # 1.5 MiB: the third does not fit

    async def run() -> None:
        ckpt = asyncsave.Checkpointer(full_root, memory=MemoryTier(shm_dir=str(shm)))
        with pytest.raises(asyncsave.SaveFailedError):  # close raises the failed copy too
            async with ckpt:
                handles = [await ckpt.save(step, state(step)) for step in (1, 2)]
                for h in handles:
                    await h.persisted()
                third = await ckpt.save(3, state(3))
                assert (await third).step == 3  # committed in memory
                with pytest.raises(asyncsave.SaveFailedError) as failed:
                    await third.persisted()
                # the original error crossed the socket as the cause
                assert isinstance(failed.value.__cause__, OSError)
                assert failed.value.__cause__.errno == errno.ENOSPC
                with pytest.raises(asyncsave.SaveFailedError):
                    await (await ckpt.save(4, state(4)))
                assert ckpt.memory_root is not None
                in_memory = asyncsave.load(ckpt.memory_root / "step_3")
                assert torch.equal(in_memory["w"], state(3)["w"])
        assert asyncsave.latest(full_root).step == 2

    anyio.run(run)


# -- what a review broke (each test fails on the code before its fix) ----------------


def test_a_cancelled_exit_still_flushes_and_the_cancellation_propagates(
    tmp_path: Path, shm: Path
) -> None:
    async def run() -> bool:
        with anyio.CancelScope() as scope:
            async with asyncsave.Checkpointer(
                tmp_path, memory=MemoryTier(shm_dir=str(shm))
            ) as ckpt:
                for step in (1, 2, 3):
                    await ckpt.save(step, state_for(step))
                scope.cancel()  # a deadline, or a failed sibling task
                await anyio.sleep(60)  # cancelled here: leaving the block must still flush
        return scope.cancelled_caught

    assert anyio.run(run)
    assert asyncsave.latest(tmp_path).step == 3
    assert same(asyncsave.load(tmp_path / "step_3"), state_for(3))
    assert not any(shm.iterdir())


def test_an_answer_given_up_on_never_answers_another_request(
    tmp_path: Path, shm: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(PAUSE_ENV, f"writing:{tmp_path}")

    async def run() -> None:
        async with asyncsave.Checkpointer(
            tmp_path / "root", memory=MemoryTier(shm_dir=str(shm))
        ) as ckpt:
            handle = await ckpt.save(1, state_for(1))
            with anyio.move_on_after(0.5):
                await ckpt.wait()  # its answer comes late, after the pause
            (tmp_path / "release").touch()
            await handle
            restored = await ckpt.load_latest()
            assert restored is not None and restored.info.step == 1

    anyio.run(run)
    assert asyncsave.latest(tmp_path / "root").step == 1


def test_a_stalled_saver_is_a_timeout_not_a_hang(tmp_path: Path, shm: Path) -> None:
    async def run() -> None:
        ckpt = asyncsave.Checkpointer(
            tmp_path, memory=MemoryTier(shm_dir=str(shm)), save_timeout_s=2
        )
        with anyio.fail_after(60), pytest.raises(SaverDiedError):  # a guard: the bound is 2 s
            async with ckpt:
                await ckpt.wait()  # its start is over (a start is bounded by start_timeout_s)
                assert ckpt.saver_pid is not None
                os.kill(ckpt.saver_pid, signal.SIGSTOP)
                try:
                    with pytest.raises(asyncsave.CheckpointTimeoutError, match="save_timeout_s"):
                        await ckpt.save(1, state_for(1))
                    with pytest.raises(asyncsave.CheckpointTimeoutError):
                        await ckpt.save(2, state_for(2))  # the checkpointer refuses from now on
                finally:
                    os.kill(ckpt.saver_pid, signal.SIGKILL)

    anyio.run(run)


def test_a_memory_tier_of_a_removed_root_is_never_resumed_nor_copied_back(
    tmp_path: Path, shm: Path, caplog: pytest.LogCaptureFixture
) -> None:
    root = tmp_path / "root"
    _kill_after_return(root, shm, "7", tmp_path, None)  # memory keeps step 7
    shutil.rmtree(root)  # the user starts over

    async def run() -> Any:
        async with asyncsave.Checkpointer(root, memory=MemoryTier(shm_dir=str(shm))) as ckpt:
            restored = await ckpt.load_latest()
            await (await ckpt.save(1, state_for(1)))
        return restored

    assert anyio.run(run) is None
    assert sorted(p.name for p in root.glob("step_*")) == ["step_1"]
    assert [p.name for p in shm.glob("asyncsave-*/other-run-r0-*")]  # set aside, not deleted


def test_a_planted_memory_directory_is_refused(tmp_path: Path, shm: Path) -> None:
    root = tmp_path / "root"
    root.mkdir()
    digest = hashlib.sha256(str(root.resolve()).encode()).hexdigest()[:16]
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir(mode=0o777)
    (shm / f"asyncsave-{os.getuid()}-{digest}").symlink_to(elsewhere)

    async def run() -> None:
        async with asyncsave.Checkpointer(root, memory=MemoryTier(shm_dir=str(shm))):
            pass

    with pytest.raises(PermissionError, match="not a private directory"):
        anyio.run(run)
    assert not any(elsewhere.iterdir())


def test_a_refused_lazy_save_fails_its_handle_only(tmp_path: Path, shm: Path) -> None:
    async def run() -> None:
        async with asyncsave.Checkpointer(tmp_path, memory=MemoryTier(shm_dir=str(shm))) as ckpt:
            bad = await ckpt.save(
                1, {"w": torch.ones(2), "when": datetime.date(2026, 12, 3)}, lazy=True
            )
            with pytest.raises(asyncsave.UnsupportedTypeError, match="when"):
                await bad
            assert (await (await ckpt.save(2, {"w": torch.ones(2)}))).step == 2

    anyio.run(run)
    assert asyncsave.latest(tmp_path).step == 2


def test_a_second_checkpointer_of_the_root_is_refused_at_once(tmp_path: Path, shm: Path) -> None:
    async def run() -> None:
        tier = MemoryTier(shm_dir=str(shm), start_timeout_s=600)
        async with asyncsave.Checkpointer(tmp_path, memory=tier):
            with anyio.fail_after(60), pytest.raises(asyncsave.RootInUseError):  # not after 600 s
                async with asyncsave.Checkpointer(tmp_path, memory=tier):
                    pass

    anyio.run(run)


class _SeesSaver:
    """A template leaf restored in place that records, when it is restored,
    whether the checkpointer's saver process had started."""

    def __init__(self, ckpt: Any) -> None:
        self.ckpt = ckpt
        self.saver_pid: Any = "not restored"

    def state_dict(self) -> dict[str, Any]:
        return {"n": 0}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.saver_pid = self.ckpt.saver_pid


def test_a_restart_resumes_before_its_saver_starts_and_the_step_stays_protected(
    tmp_path: Path, shm: Path
) -> None:
    root = tmp_path / "root"
    _kill_after_return(root, shm, "7", tmp_path, None)
    before = {p.name: p.read_bytes() for p in (root / "step_7").iterdir()}  # persisted by the saver

    async def run() -> tuple[Any, Any, int | None]:
        async with asyncsave.Checkpointer(root, memory=MemoryTier(shm_dir=str(shm))) as ckpt:
            assert ckpt.saver_pid is None  # no saver of this root was alive: not started yet
            sees = _SeesSaver(ckpt)  # restored in place, in this process, saver-less
            restored = await ckpt.load_latest(
                {"model": None, "optim": sees, "loader": None, "step": None}
            )
            started = ckpt.saver_pid
            with pytest.raises(asyncsave.ProtectedCheckpointError, match="resumed from"):
                await ckpt.save(7, state_for(7), overwrite=True)
            again = await ckpt.save(7, state_for(7))  # the resumed step: a no-op, as without memory
            assert (await again).step == 7
            await (await ckpt.save(8, state_for(8)))
        return restored, started, sees.saver_pid, ckpt.resumed_step

    restored, started, seen, resumed = anyio.run(run)
    assert restored.info.step == 7 and resumed == 7
    assert "/tier/" in restored.info.path.as_posix()  # from memory
    assert seen is None and started is not None  # read before the saver; started right after
    assert same(restored.state["model"], state_for(7)["model"])
    assert asyncsave.latest(root).step == 8
    assert {p.name: p.read_bytes() for p in (root / "step_7").iterdir()} == before


def test_a_damaged_snapshot_is_left_to_the_saver_which_moves_it_aside(
    tmp_path: Path, shm: Path
) -> None:
    root = tmp_path / "root"
    _kill_after_return(root, shm, "7", tmp_path, None)
    snapshot = next(shm.glob("asyncsave-*/tier/step_7"))
    data = max(snapshot.glob("data-*"), key=lambda p: p.stat().st_size)
    raw = bytearray(data.read_bytes())
    raw[-5] ^= 0xFF  # a flipped bit in the last tensor's bytes
    data.write_bytes(bytes(raw))

    async def run() -> tuple[Any, list[str]]:
        async with asyncsave.Checkpointer(root, memory=MemoryTier(shm_dir=str(shm))) as ckpt:
            restored = await ckpt.load_latest()
            assert ckpt.memory_root is not None
            aside = [p.name for p in ckpt.memory_root.iterdir() if "damaged" in p.name]
        return restored, aside

    restored, aside = anyio.run(run)
    assert restored.info.step == 7 and same(restored.state, state_for(7))
    assert Path(restored.info.path).parent == root  # the persisted copy
    assert aside  # moved aside by the saver, bytes kept


@pytest.mark.parametrize("phase", ["writing", "tracking"])
def test_a_restart_waits_for_the_dead_trainers_saver(tmp_path: Path, shm: Path, phase: str) -> None:
    root = tmp_path / "root"
    _clean_save(root, shm, 3, tmp_path)
    out = tmp_path / "out"
    out.mkdir()
    proc = _child(root, shm, "7", out, hold=True, pause=phase)
    try:
        _wait_file(out / "returned", proc)
        _wait_file(out / "reached", proc)
    finally:
        proc.kill()
        proc.wait(30)
    saver = json.loads((out / "returned").read_text())["saver_pid"]

    async def run() -> Any:
        # Its saver is still committing step 7 (paused): a restart that read
        # memory now would resume step 3. This one waits for it (released below).
        async with asyncsave.Checkpointer(root, memory=MemoryTier(shm_dir=str(shm))) as ckpt:
            return await ckpt.load_latest()

    def release_soon() -> None:
        time.sleep(3)
        (out / "release").touch()

    t = threading.Thread(target=release_soon)
    t.start()
    try:
        restored = anyio.run(run)
    finally:
        t.join()
    _gone(saver)
    assert restored.info.step == 7 and same(restored.state, state_for(7))


def _bits(t: torch.Tensor) -> torch.Tensor:
    t = t.resolve_conj().resolve_neg().contiguous().reshape(-1)
    return t.view(torch.uint8)


def _same_bits(saved: dict[str, Any], state: dict[str, Any]) -> list[str]:
    """The keys whose saved tensor differs from the state's, bit for bit."""
    return [
        k
        for k, t in state.items()
        if not (
            saved[k].dtype == t.dtype
            and saved[k].shape == t.shape
            and torch.equal(_bits(saved[k]), _bits(t))
        )
    ]


def _base() -> dict[str, Any]:
    g = torch.Generator().manual_seed(5)
    big = torch.randn(64, generator=g)
    nan = torch.tensor([0x7FC00001, 0x7F800001], dtype=torch.int32).view(torch.float32)
    return {
        "w": torch.nn.Parameter(torch.randn(8, 4, generator=g)),
        "tied": None,  # set below: the same tensor as "w"
        "b16": torch.randn(33, generator=g).bfloat16(),
        "view": big[2:9],  # a view into a storage another key shows too
        "big": big,
        "odd": big[3:11],  # starts 12 bytes in: not 64-byte aligned
        "t": torch.randn(4, 6, generator=g).t(),  # not contiguous
        "zero_dim": torch.tensor(3.5),
        "empty": torch.empty(0, 3),
        "flags": torch.tensor([2, 0, 1, 255], dtype=torch.uint8).view(torch.bool),  # bytes not 0/1
        "nan": nan,  # NaN payloads
    }


def _changes() -> list[tuple[str, Callable[[dict[str, Any]], None]]]:
    def in_place(s: dict[str, Any]) -> None:
        with torch.no_grad():
            for k in ("w", "b16", "big", "t", "zero_dim"):
                s[k].add_(1)

    def same_size_new_storage(s: dict[str, Any]) -> None:
        del s["b16"]  # freed first: the allocator may hand the same address back
        s["b16"] = torch.full((33,), 7.0).bfloat16()

    def untie(s: dict[str, Any]) -> None:
        s["tied"] = s["w"].detach().clone() + 1

    def new_dtype(s: dict[str, Any]) -> None:
        s["zero_dim"] = torch.tensor(2.0, dtype=torch.float64)

    def conj(s: dict[str, Any]) -> None:
        s["c"] = torch.randn(5, dtype=torch.complex64).conj()

    def grad_off(s: dict[str, Any]) -> None:
        s["w"].requires_grad_(False)

    def resized(s: dict[str, Any]) -> None:
        s["empty"].resize_(2, 3).fill_(4.0)

    def regrown_view(s: dict[str, Any]) -> None:
        s["view"] = s["big"][1:40]

    return [
        ("in place", in_place),
        ("same size, new storage", same_size_new_storage),
        ("untied", untie),
        ("another dtype", new_dtype),
        ("a conjugate view", conj),
        ("requires_grad off", grad_off),
        ("a storage resized", resized),
        ("a view grown", regrown_view),
    ]


def test_a_reused_layout_saves_every_kind_of_change_bit_for_bit(tmp_path: Path, shm: Path) -> None:
    """Later saves reuse the packing of the last one when the tensors'
    signatures are unchanged (``_slots.pack``): every kind of change between
    saves, alone and after each other, is saved bit for bit, ties kept."""

    async def run() -> list[str]:
        wrong = []
        state = _base()
        state["tied"] = state["w"]
        step = 0
        async with asyncsave.Checkpointer(tmp_path, memory=MemoryTier(shm_dir=str(shm))) as ckpt:
            for name, change in [
                ("none", lambda s: None),
                *_changes(),
                ("none again", lambda s: None),
            ]:
                change(state)
                for _ in range(2):  # the change, then the same structure again
                    step += 1
                    info = await (await ckpt.save(step, state))
                    saved = asyncsave.load(info.path)
                    bad = _same_bits(saved, state)
                    tied = (
                        saved["tied"].untyped_storage().data_ptr()
                        == saved["w"].untyped_storage().data_ptr()
                    )
                    if bad or tied != (state["tied"] is state["w"]):
                        wrong.append(f"{name}, step {step}: {bad}, tied={tied}")
                    with torch.no_grad():
                        state["big"].mul_(-1)  # new bytes for the next save of the same layout
        return wrong

    assert anyio.run(run) == []


def test_a_saved_state_is_not_kept_alive_by_the_memory_tier(tmp_path: Path, shm: Path) -> None:
    import gc
    import weakref

    async def run() -> list[Any]:
        refs = []
        async with asyncsave.Checkpointer(tmp_path, memory=MemoryTier(shm_dir=str(shm))) as ckpt:
            for step in (1, 2, 3):
                state = {"model": torch.nn.Linear(64, 64), "x": torch.randn(100)}
                await (await ckpt.save(step, state))  # steps 2 and 3 reuse step 1's layout
                refs += [weakref.ref(state["model"].weight), weakref.ref(state["x"])]
                del state
                gc.collect()
                alive = [r for r in refs if r() is not None]
                assert alive == [], f"step {step}: {len(alive)} tensors kept alive"
        return refs

    anyio.run(run)


def test_a_save_whose_numbers_changed_is_handed_over_without_waiting(
    tmp_path: Path, shm: Path
) -> None:
    """Ints, floats and bools (a step, a counter, a learning rate) change at every
    save without changing what the saver's ``save()`` decides on: such a save
    returns once it is in the saver's socket, even with the saver stopped; the
    numbers arrive exactly (big ints, -0.0, NaN); a number that changed type
    waits for the saver's answer."""
    import math

    def state(step: int) -> dict[str, Any]:
        return {
            "w": torch.full((4,), float(step)),
            "step": step,
            "big": 2**70 + step,
            "neg": -step,
            "lr": [0.1 / step, -0.0 if step % 2 else math.nan],
            "flag": step % 2 == 0,
            "name": "run",
        }

    loaded: list[Any] = []

    async def run() -> None:
        ckpt = asyncsave.Checkpointer(
            tmp_path, memory=MemoryTier(shm_dir=str(shm)), save_timeout_s=5
        )
        with pytest.raises(
            asyncsave.CheckpointTimeoutError
        ):  # close too: the checkpointer is broken
            async with ckpt:
                await body(ckpt)

    async def body(ckpt: Any) -> None:
        await (await ckpt.save(1, state(1)))
        await (await ckpt.save(2, state(2)))
        with pytest.raises(asyncsave.InvalidStateError, match="training_info"):  # refused by save()
            await ckpt.save(3, state(3), training_info={"step": 4})
        assert ckpt.saver_pid is not None
        os.kill(ckpt.saver_pid, signal.SIGSTOP)
        try:
            with anyio.fail_after(4):  # returns while the saver is stopped
                handles = [await ckpt.save(s, state(s)) for s in (3, 4)]
        finally:
            os.kill(ckpt.saver_pid, signal.SIGCONT)
        infos = [await h for h in handles]
        loaded.extend(asyncsave.load(i.path) for i in infos)
        os.kill(ckpt.saver_pid, signal.SIGSTOP)
        changed = state(5)
        changed["neg"] = -5.0  # an int became a float: the saver decides
        try:
            with pytest.raises(asyncsave.CheckpointTimeoutError):
                await ckpt.save(5, changed)
        finally:
            os.kill(ckpt.saver_pid, signal.SIGCONT)
        with pytest.raises(asyncsave.CheckpointTimeoutError):
            await ckpt.wait()  # the checkpointer refuses from then on

    anyio.run(run)
    for step, got in zip((3, 4), loaded, strict=True):
        want = state(step)
        assert torch.equal(got["w"], want["w"])
        assert (got["step"], got["big"], got["neg"], got["flag"], got["name"]) == (
            step,
            2**70 + step,
            -step,
            step % 2 == 0,
            "run",
        )
        assert type(got["step"]) is int and type(got["flag"]) is bool
        assert got["lr"][0] == want["lr"][0]
        assert math.copysign(1.0, got["lr"][1]) == -1.0 if step % 2 else math.isnan(got["lr"][1])


def test_a_second_checkpointer_is_refused_while_the_first_ones_saver_starts(
    tmp_path: Path, shm: Path
) -> None:
    """The saver starts after ``load_latest()`` and takes over the memory tier's
    lock (and its beacon) from the trainer: there is no instant at which a
    second checkpointer finds the tier free."""

    async def run() -> None:
        tier = MemoryTier(shm_dir=str(shm), start_timeout_s=600)
        async with asyncsave.Checkpointer(tmp_path, memory=tier) as first:
            assert await first.load_latest() is None  # its saver starts now, behind
            with anyio.fail_after(60), pytest.raises(asyncsave.RootInUseError):
                async with asyncsave.Checkpointer(tmp_path, memory=tier):
                    pass
            await (await first.save(1, state_for(1)))  # the first one is unharmed

    anyio.run(run)
