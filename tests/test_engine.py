"""The engine: await a save, commit atomically, move the tracker, fail loudly."""

from __future__ import annotations

import errno
import logging
import threading
from pathlib import Path
from typing import Any, ClassVar

import anyio
import pytest
import torch
from faults import FaultyFS, block, pause, raise_errno

import asyncsave

pytestmark = pytest.mark.anyio

TRACKER = "latest_checkpointed_iteration.txt"


def tracker(root: Path) -> str:
    return (root / TRACKER).read_text()


def entries(root: Path) -> list[str]:
    """What is in ``root``, less the saver lock file."""
    return sorted(p.name for p in root.iterdir() if p.name != ".asyncsave.lock")


def temp_dirs(root: Path) -> list[str]:
    return [n for n in entries(root) if n.startswith(".asyncsave-tmp-")]


def small_state(value: float = 1.0) -> dict[str, Any]:
    return {"w": torch.full((64, 64), value), "meta": {"value": value}}


# -- commit and tracker ----------------------------------------------------------


async def test_await_handle_returns_after_commit_and_tracker(tmp_path: Path) -> None:
    async with asyncsave.Checkpointer(tmp_path) as ckpt:
        handle = await ckpt.save(3, small_state())
        info = await handle
        assert info is not None and info.step == 3 and info.path == tmp_path / "step_3"
        assert tracker(tmp_path) == "3"
        assert (info.path / "manifest.json").exists()
        assert temp_dirs(tmp_path) == []
        assert asyncsave.verify(info.path).step == 3
        assert info.nbytes == 64 * 64 * 4 and info.num_tensors == 1
        assert (
            info.blocked_s is not None
            and info.written_s is not None
            and info.committed_s is not None
        )
        assert 0 <= info.blocked_s <= info.written_s <= info.committed_s


async def test_write_runs_in_background_and_nothing_is_final_before_commit(tmp_path: Path) -> None:
    gate = threading.Event()
    fs = FaultyFS("write", pause(gate), where=lambda p: p.endswith(".safetensors"))
    async with asyncsave.Checkpointer(tmp_path, filesystem=fs) as ckpt:
        handle = await ckpt.save(1, small_state())
        await anyio.to_thread.run_sync(fs.fired.wait, 10)
        # save() returned while the data file is being written
        assert not handle.done()
        assert not (tmp_path / "step_1").exists() and not (tmp_path / TRACKER).exists()
        assert len(temp_dirs(tmp_path)) == 1
        gate.set()
        info = await handle
    assert info is not None and tracker(tmp_path) == "1"


async def test_tracker_never_moves_backwards_when_saves_finish_out_of_order(tmp_path: Path) -> None:
    gate = threading.Event()
    # Hold step 5 just before its manifest (its data is written and the staging
    # budget is free; commits are serialised, so not inside its rename), so step
    # 10 commits first.
    fs = FaultyFS(
        "create", pause(gate), where=lambda p: ".asyncsave-tmp-5-" in p and "manifest" in p
    )
    async with asyncsave.Checkpointer(tmp_path, filesystem=fs) as ckpt:
        h5 = await ckpt.save(5, small_state(5))
        await anyio.to_thread.run_sync(fs.fired.wait, 10)
        h10 = await ckpt.save(10, small_state(10))
        info10 = await h10
        assert info10 is not None and tracker(tmp_path) == "10"
        gate.set()
        info5 = await h5
        assert info5 is not None and info5.step == 5
        assert tracker(tmp_path) == "10"
    assert asyncsave.latest(tmp_path).step == 10  # type: ignore[union-attr]


async def test_saved_is_logged_at_commit_not_at_dispatch(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    gate = threading.Event()
    fs = FaultyFS("rename", pause(gate))
    caplog.set_level(logging.INFO, logger="asyncsave")
    async with asyncsave.Checkpointer(tmp_path, filesystem=fs) as ckpt:
        handle = await ckpt.save(2, small_state())
        await anyio.to_thread.run_sync(fs.fired.wait, 10)
        assert not any("saved step 2" in r.getMessage() for r in caplog.records)
        gate.set()
        await handle
        assert any("saved step 2" in r.getMessage() for r in caplog.records)


async def test_stale_temp_dirs_are_removed_when_a_checkpointer_opens(tmp_path: Path) -> None:
    stale = tmp_path / ".asyncsave-tmp-7-deadbeef0000"
    stale.mkdir()
    (stale / "data-r00000-000.safetensors").write_bytes(b"x" * 100)
    (tmp_path / ".asyncsave-tmp-latest_checkpointed_iteration.txt-abc").write_text("7")
    async with asyncsave.Checkpointer(tmp_path):
        assert temp_dirs(tmp_path) == []


# -- steps (S16, invariant 7) ----------------------------------------------------


async def test_steps_are_honest_no_step_zero_no_duplicates(tmp_path: Path) -> None:
    async with asyncsave.Checkpointer(tmp_path) as ckpt:
        with pytest.warns(asyncsave.CheckpointWarning, match="not saving step 0"):
            h0 = await ckpt.save(0, small_state(0))
        assert h0.skipped and await h0 is None
        h1 = await ckpt.save(1, small_state(1))
        h2 = await ckpt.save(2, small_state(2))
        with pytest.warns(asyncsave.CheckpointWarning, match="step 2 is already"):
            again = await ckpt.save(2, small_state(99))  # pending or committed: a no-op
        assert again is h2 or (await again) == (await h2)
        await h1
        info2 = await h2
        mtime = (tmp_path / "step_2" / "manifest.json").stat().st_mtime_ns
        with pytest.warns(asyncsave.CheckpointWarning, match="step 2 is already committed"):
            later = await ckpt.save(2, small_state(123))
        assert (await later) == info2
    assert [n for n in entries(tmp_path) if n.startswith("step_")] == ["step_1", "step_2"]
    assert (tmp_path / "step_2" / "manifest.json").stat().st_mtime_ns == mtime
    assert asyncsave.load(tmp_path / "step_2")["meta"]["value"] == 2


async def test_a_step_committed_by_an_earlier_process_is_not_rewritten(tmp_path: Path) -> None:
    async with asyncsave.Checkpointer(tmp_path) as ckpt:
        await (await ckpt.save(4, small_state(4)))
    async with asyncsave.Checkpointer(tmp_path) as ckpt:
        with pytest.warns(asyncsave.CheckpointWarning, match="step 4 is already committed"):
            info = await (await ckpt.save(4, small_state(40)))
    assert info is not None and info.step == 4
    assert asyncsave.load(tmp_path / "step_4")["meta"]["value"] == 4


async def test_step_zero_is_saved_when_asked(tmp_path: Path) -> None:
    async with asyncsave.Checkpointer(tmp_path, save_step_zero=True) as ckpt:
        info = await (await ckpt.save(0, small_state()))
    assert info is not None and tracker(tmp_path) == "0"


async def test_overwrite_replaces_a_committed_step_atomically(tmp_path: Path) -> None:
    async with asyncsave.Checkpointer(tmp_path) as ckpt:
        await (await ckpt.save(3, small_state(1)))
        info = await (await ckpt.save(3, small_state(2), overwrite=True))
    assert info is not None
    assert asyncsave.load(tmp_path / "step_3")["meta"]["value"] == 2
    assert temp_dirs(tmp_path) == []


async def test_the_resumed_checkpoint_is_never_rewritten(tmp_path: Path) -> None:
    async with asyncsave.Checkpointer(tmp_path) as ckpt:
        await (await ckpt.save(8, small_state(8)))
    async with asyncsave.Checkpointer(tmp_path) as ckpt:
        restored = await ckpt.load_latest()
        assert restored is not None and ckpt.resumed_step == 8
        with pytest.raises(asyncsave.ProtectedCheckpointError) as err:
            await ckpt.save(8, small_state(0), overwrite=True)
        assert err.value.step == 8
        info = await (await ckpt.save(8, small_state(0)))  # a no-op
        assert info is not None and info.step == 8
    assert asyncsave.load(tmp_path / "step_8")["meta"]["value"] == 8


@pytest.mark.parametrize("step", [-1, 1.5, True, "3", None, 2**63])
async def test_bad_steps_raise_invalid_step_error(tmp_path: Path, step: Any) -> None:
    async with asyncsave.Checkpointer(tmp_path) as ckpt:
        with pytest.raises(asyncsave.InvalidStepError):
            await ckpt.save(step, small_state())
        assert await (await ckpt.save(1, small_state())) is not None  # still usable


# -- snapshots (S10, S11) --------------------------------------------------------


async def test_mutating_tensors_after_save_returns_does_not_leak_into_checkpoint(
    tmp_path: Path,
) -> None:
    gate = threading.Event()
    fs = FaultyFS("write", pause(gate), where=lambda p: p.endswith(".safetensors"))
    model = torch.nn.Linear(16, 16)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(4, 16)).sum().backward()
    opt.step()
    buf = torch.arange(10.0)
    counters = {"seen": [1, 2, 3]}
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    expected_avg = opt.state[model.weight]["exp_avg"].clone()
    async with asyncsave.Checkpointer(tmp_path, filesystem=fs) as ckpt:
        handle = await ckpt.save(
            1, {"model": model, "optim": opt, "buf": buf, "counters": counters}
        )
        # Mutate everything in place while the write is still held back.
        with torch.no_grad():
            for p in model.parameters():
                p.add_(100.0)
        opt.state[model.weight]["exp_avg"].mul_(0)
        buf.zero_()
        counters["seen"].append(4)
        gate.set()
        await handle
    out = asyncsave.load(tmp_path / "step_1")
    for k, v in expected.items():
        assert torch.equal(out["model"][k], v), k
    assert torch.equal(out["optim"]["state"][0]["exp_avg"], expected_avg)
    assert torch.equal(out["buf"], torch.arange(10.0))
    assert out["counters"] == {"seen": [1, 2, 3]}


async def test_staging_buffers_are_reused_across_a_hundred_saves(tmp_path: Path) -> None:
    state = {"a": torch.randn(256, 256), "b": torch.randn(1000)}
    async with asyncsave.Checkpointer(tmp_path) as ckpt:
        await (await ckpt.save(1, state))
        pool = ckpt.staging_pool
        assert pool is not None and pool.allocations == 1
        ptr = pool.arena_ptr
        await (await ckpt.save(2, state))
        assert pool.allocations == 1 and pool.arena_ptr == ptr
        for step in range(3, 101):
            state["a"][0, 0] = step
            handle = await ckpt.save(step, state)
        await handle
        assert pool.allocations == 1 and pool.arena_ptr == ptr
    assert asyncsave.load(tmp_path / "step_100")["a"][0, 0] == 100


async def test_save_waits_while_the_budget_is_in_use(tmp_path: Path) -> None:
    gate = threading.Event()
    fs = FaultyFS("write", pause(gate), where=lambda p: p.endswith(".safetensors"))
    returned = anyio.Event()
    async with asyncsave.Checkpointer(tmp_path, filesystem=fs) as ckpt:
        await ckpt.save(1, small_state(1))
        await anyio.to_thread.run_sync(fs.fired.wait, 10)

        async def second() -> None:
            await ckpt.save(2, small_state(2))
            returned.set()

        async with anyio.create_task_group() as tg:
            tg.start_soon(second)
            for _ in range(20):
                await anyio.sleep(0.01)
            assert not returned.is_set()  # backpressure: step 1 still holds the budget
            gate.set()
        assert returned.is_set()
    assert tracker(tmp_path) == "2"


async def test_a_tensor_that_cannot_be_cut_larger_than_the_budget_is_a_typed_error(
    tmp_path: Path,
) -> None:
    # A state larger than the budget streams through it (tests/test_stream.py);
    # only a non-contiguous CPU tensor (gathered whole) larger than the budget
    # cannot, and is refused before anything is written, naming its key.
    async with asyncsave.Checkpointer(tmp_path, budget_bytes=1024) as ckpt:
        with pytest.raises(asyncsave.StagingBudgetError, match="w") as info:
            await ckpt.save(1, {"w": torch.zeros(64, 64).t()})
        assert info.value.key == "w"
        assert await (await ckpt.save(2, {"x": torch.zeros(10)})) is not None
    assert entries(tmp_path) == ["latest_checkpointed_iteration.txt", "step_2"]


async def test_event_loop_keeps_running_during_a_save(tmp_path: Path) -> None:
    ticks_during_save = 0
    state = {"big": torch.randn(32 << 20 // 4)}  # 32 MiB
    async with asyncsave.Checkpointer(tmp_path) as ckpt:
        handle = await ckpt.save(1, state)
        while not handle.done():
            await anyio.sleep(0.001)
            ticks_during_save += 1
        await handle
    assert ticks_during_save > 0


# -- errors (S4, S6, invariant 3) -----------------------------------------------


@pytest.mark.parametrize(
    ("op", "where", "n"),
    [
        ("write", ("-tmp-2-", ".safetensors"), 1),
        ("fsync", ("-tmp-2-", ".safetensors"), 1),
        ("create", ("-tmp-2-", "manifest.json"), 1),
        ("fsync_dir", ("-tmp-2-",), 1),
        ("rename", ("step_2",), 1),
        ("replace", (TRACKER,), 2),
    ],
)
async def test_a_failed_save_raises_at_handle_next_save_and_close(
    tmp_path: Path, op: str, where: tuple[str, ...], n: int
) -> None:
    """Each write site of step 2 fails in turn; step 1 stays intact."""
    fs = FaultyFS(op, raise_errno(errno.EIO), n=n, where=lambda p: all(w in p for w in where))
    ckpt = asyncsave.Checkpointer(tmp_path, filesystem=fs)
    with pytest.raises(asyncsave.SaveFailedError) as at_close:
        async with ckpt:
            await (await ckpt.save(1, small_state(1)))
            handle = await ckpt.save(2, small_state(2))
            with pytest.raises(asyncsave.SaveFailedError) as at_handle:
                await handle
            assert isinstance(at_handle.value.__cause__, OSError)
            assert at_handle.value.__cause__.errno == errno.EIO
            assert at_handle.value.step == 2
            with pytest.raises(asyncsave.SaveFailedError) as at_save:
                await ckpt.save(3, small_state(3))
            assert at_save.value is at_handle.value
            with pytest.raises(asyncsave.SaveFailedError):
                await ckpt.wait()
    assert at_close.value is at_handle.value
    # The previous checkpoint is intact and still the latest one; no temp dir left.
    assert asyncsave.verify(tmp_path / "step_1").step == 1
    assert tracker(tmp_path) == "1"
    assert temp_dirs(tmp_path) == []
    assert not (tmp_path / "step_3").exists()


async def test_a_hung_writer_becomes_a_timeout_error_everywhere(tmp_path: Path) -> None:
    gate = threading.Event()
    fs = FaultyFS("write", block(gate), where=lambda p: p.endswith(".safetensors"))
    try:
        with pytest.raises(asyncsave.CheckpointTimeoutError):
            async with asyncsave.Checkpointer(tmp_path, filesystem=fs, save_timeout_s=0.5) as ckpt:
                handle = await ckpt.save(1, small_state())
                with pytest.raises(asyncsave.CheckpointTimeoutError) as err:
                    await handle
                assert isinstance(err.value, asyncsave.SaveFailedError)
                with pytest.raises(asyncsave.CheckpointTimeoutError):
                    await ckpt.save(2, small_state())
    finally:
        gate.set()  # let the abandoned worker thread finish
    assert not (tmp_path / "step_1").exists() and not (tmp_path / TRACKER).exists()


async def test_close_is_bounded_by_close_timeout(tmp_path: Path) -> None:
    gate = threading.Event()
    fs = FaultyFS("write", block(gate), where=lambda p: p.endswith(".safetensors"))
    try:
        with pytest.raises(asyncsave.CheckpointTimeoutError) as err:
            async with asyncsave.Checkpointer(tmp_path, filesystem=fs, close_timeout_s=0.3) as ckpt:
                await ckpt.save(1, small_state())
        assert "close_timeout_s" in str(err.value)
    finally:
        gate.set()
    assert not (tmp_path / "step_1").exists()


async def test_training_error_propagates_unchanged_with_flush_error_attached(
    tmp_path: Path,
) -> None:
    fs = FaultyFS("write", raise_errno(errno.ENOSPC), where=lambda p: p.endswith(".safetensors"))
    e1 = KeyError("training blew up")
    with pytest.raises(KeyError) as caught:
        async with asyncsave.Checkpointer(tmp_path, filesystem=fs) as ckpt:
            await ckpt.save(1, small_state())
            raise e1
    assert caught.value is e1 and type(caught.value) is KeyError
    notes = getattr(caught.value, "__notes__", [])
    assert any("SaveFailedError" in n and "step 1" in n for n in notes)


async def test_flush_error_is_raised_on_a_clean_exit(tmp_path: Path) -> None:
    fs = FaultyFS("write", raise_errno(errno.ENOSPC), where=lambda p: p.endswith(".safetensors"))
    with pytest.raises(asyncsave.SaveFailedError) as caught:
        async with asyncsave.Checkpointer(tmp_path, filesystem=fs) as ckpt:
            await ckpt.save(1, small_state())
    assert (
        isinstance(caught.value.__cause__, OSError) and caught.value.__cause__.errno == errno.ENOSPC
    )


async def test_training_error_with_clean_flush_propagates_without_note(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="boom") as caught:
        async with asyncsave.Checkpointer(tmp_path) as ckpt:
            await ckpt.save(1, small_state())
            raise ValueError("boom")
    assert not getattr(caught.value, "__notes__", [])
    assert tracker(tmp_path) == "1"  # the pending save was flushed


async def test_cancelled_pump_still_commits_dispatched_save_and_leaves_no_partial_dir(
    tmp_path: Path,
) -> None:
    gate = threading.Event()
    fs = FaultyFS("write", pause(gate), where=lambda p: p.endswith(".safetensors"))
    timer = threading.Timer(0.3, gate.set)  # the disk answers after the cancellation
    with anyio.CancelScope() as scope:
        async with asyncsave.Checkpointer(tmp_path, filesystem=fs) as ckpt:
            await ckpt.save(1, small_state())
            timer.start()
            scope.cancel()  # the pump is cancelled while the save is in flight
            await anyio.sleep(30)
    timer.join()
    assert scope.cancelled_caught
    for name in entries(tmp_path):
        if name.startswith("step_"):
            asyncsave.verify(tmp_path / name)
    assert temp_dirs(tmp_path) == []
    assert tracker(tmp_path) == "1"


async def test_use_after_close_is_a_closed_error_and_close_is_idempotent(tmp_path: Path) -> None:
    ckpt = asyncsave.Checkpointer(tmp_path)
    with pytest.raises(asyncsave.CheckpointerClosedError):
        await ckpt.save(1, small_state())
    async with ckpt:
        pass
    with pytest.raises(asyncsave.CheckpointerClosedError):
        await ckpt.save(1, small_state())
    await ckpt.aclose()
    await ckpt.aclose()
    with pytest.raises(asyncsave.CheckpointerClosedError):
        await ckpt.wait()
    with pytest.raises(asyncsave.CheckpointerClosedError):
        async with ckpt:
            pass


async def test_bad_input_names_the_key_and_writes_nothing(tmp_path: Path) -> None:
    async with asyncsave.Checkpointer(tmp_path) as ckpt:
        with pytest.raises(asyncsave.UnsupportedTypeError) as err:
            await ckpt.save(1, {"model": {"layer": {"weird": object()}}})
        assert err.value.key == "model/layer/weird"
        assert "model/layer/weird" in str(err.value)
        assert isinstance(err.value, TypeError) and isinstance(err.value, asyncsave.CheckpointError)
        assert await (await ckpt.save(2, small_state())) is not None
    assert entries(tmp_path) == ["latest_checkpointed_iteration.txt", "step_2"]


def test_garbage_collection_with_saves_in_flight_only_warns(tmp_path: Path) -> None:
    """S4: nothing blocks or raises in ``__del__``."""
    ckpt = asyncsave.Checkpointer(tmp_path)
    ckpt._state = "open"  # as if abandoned mid-save without closing
    ckpt._pending[7] = object()  # type: ignore[assignment]
    with pytest.warns(ResourceWarning, match=r"saves \[7\] in flight"):
        ckpt.__del__()
    ckpt._state = "closed"


# -- concurrency and cancellation ------------------------------------------------


@pytest.mark.filterwarnings("ignore::asyncsave.CheckpointWarning")  # duplicates on purpose
async def test_a_shared_handle_fails_instead_of_hanging_when_its_owner_is_cancelled(
    tmp_path: Path,
) -> None:
    gate = threading.Event()
    fs = FaultyFS("write", pause(gate), where=lambda p: p.endswith(".safetensors"))
    try:
        async with asyncsave.Checkpointer(tmp_path, filesystem=fs) as ckpt:
            await ckpt.save(1, small_state(1))  # holds the staging budget
            await anyio.to_thread.run_sync(fs.fired.wait, 10)
            shared: list[asyncsave.SaveHandle] = []
            async with anyio.create_task_group() as tg:
                tg.start_soon(ckpt.save, 2, small_state(2))  # the owner: waits for budget
                await anyio.sleep(0.05)

                async def join() -> None:
                    shared.append(await ckpt.save(2, small_state(2)))

                tg.start_soon(join)  # joins the owner's pending handle
                await anyio.sleep(0.05)
                tg.cancel_scope.cancel()  # cancels the owner (and the joiner)
            assert ckpt.pending_steps == [1]
            gate.set()
            await ckpt.wait()  # returns: the cancelled owner left nothing pending
            assert await (await ckpt.save(2, small_state(2))) is not None  # still usable
    finally:
        gate.set()
    assert asyncsave.load(tmp_path / "step_2")["meta"]["value"] == 2


@pytest.mark.filterwarnings("ignore::asyncsave.CheckpointWarning")  # duplicates on purpose
async def test_a_duplicate_save_returns_only_once_the_snapshot_is_taken(tmp_path: Path) -> None:
    gate = threading.Event()
    fs = FaultyFS("write", pause(gate), where=lambda p: p.endswith(".safetensors"))
    t = torch.full((8,), 2.0)
    async with asyncsave.Checkpointer(tmp_path, filesystem=fs) as ckpt:
        await ckpt.save(1, small_state(1))  # holds the budget: step 2 must wait
        await anyio.to_thread.run_sync(fs.fired.wait, 10)
        async with anyio.create_task_group() as tg:
            tg.start_soon(ckpt.save, 2, {"t": t})
            await anyio.sleep(0.05)
            timer = threading.Timer(0.2, gate.set)
            timer.start()
            handle = await ckpt.save(2, {"t": t})  # a duplicate
            t.fill_(3.0)  # allowed in eager mode once save() returned
        timer.join()
        await handle
    assert torch.equal(asyncsave.load(tmp_path / "step_2")["t"], torch.full((8,), 2.0))


async def test_close_does_not_stall_on_a_save_cancelled_while_waiting(tmp_path: Path) -> None:
    gate = threading.Event()
    fs = FaultyFS("write", pause(gate), where=lambda p: p.endswith(".safetensors"))
    async with asyncsave.Checkpointer(tmp_path, filesystem=fs, close_timeout_s=120) as ckpt:
        await ckpt.save(1, small_state(1))
        await anyio.to_thread.run_sync(fs.fired.wait, 10)
        with anyio.move_on_after(0.1):
            await ckpt.save(2, small_state(2))  # cancelled while waiting for the budget
        assert ckpt.pending_steps == [1]
        threading.Timer(0.2, gate.set).start()
    # the exit returned once step 1 committed, and raised nothing
    assert tracker(tmp_path) == "1"


async def test_two_overwrites_of_one_step_run_one_after_the_other(tmp_path: Path) -> None:
    async with asyncsave.Checkpointer(tmp_path) as ckpt:
        await (await ckpt.save(3, small_state(1)))
        handles: list[asyncsave.SaveHandle] = []

        async def overwrite(v: float) -> None:
            handles.append(await ckpt.save(3, small_state(v), overwrite=True))

        async with anyio.create_task_group() as tg:
            tg.start_soon(overwrite, 2.0)
            tg.start_soon(overwrite, 3.0)
        await ckpt.wait()
        assert all(h.done() for h in handles) and ckpt.pending_steps == []
    assert asyncsave.load(tmp_path / "step_3")["meta"]["value"] in (2.0, 3.0)
    assert temp_dirs(tmp_path) == []


async def test_a_commit_abandoned_at_the_deadline_is_never_emptied(tmp_path: Path) -> None:
    """The rename thread outlives the save's deadline; the temp dir must not be
    removed under it, so what lands under the final name is whole."""
    gate = threading.Event()
    fs = FaultyFS("rename", pause(gate), where=lambda p: p.endswith("step_1"))
    with pytest.raises(asyncsave.CheckpointTimeoutError):
        async with asyncsave.Checkpointer(tmp_path, filesystem=fs, save_timeout_s=2.0) as ckpt:
            handle = await ckpt.save(1, small_state(1))
            await anyio.to_thread.run_sync(fs.fired.wait, 10)  # the rename is held
            with pytest.raises(asyncsave.CheckpointTimeoutError):
                await handle
            gate.set()  # the abandoned thread now renames
            for _ in range(200):
                if (tmp_path / "step_1").exists():
                    break
                await anyio.sleep(0.01)
    assert asyncsave.verify(tmp_path / "step_1").step == 1
    async with asyncsave.Checkpointer(tmp_path) as ckpt:  # rolls the tracker forward
        assert ckpt.tracked_step == 1


async def test_a_reopen_in_this_process_waits_for_an_abandoned_commit(tmp_path: Path) -> None:
    """A commit thread abandoned at close must not race the recovery of a new
    checkpointer on the same root in the same process: the reopen waits (bounded)
    for it, and then sees its commit."""
    gate = threading.Event()
    fs = FaultyFS("rename", pause(gate), where=lambda p: p.endswith("step_1"))
    with pytest.raises(asyncsave.CheckpointTimeoutError):
        async with asyncsave.Checkpointer(tmp_path, filesystem=fs, close_timeout_s=0.3) as ckpt:
            await ckpt.save(1, small_state(1))
            await anyio.to_thread.run_sync(fs.fired.wait, 10)  # the rename is held
    # the old checkpointer is closed, its commit thread still holds the rename
    with pytest.raises(asyncsave.RootInUseError, match="abandoned"):
        async with asyncsave.Checkpointer(tmp_path, close_timeout_s=0.3):
            pass
    assert not (tmp_path / "step_1").exists()
    gate.set()  # the abandoned thread renames; a reopen now waits for it
    async with asyncsave.Checkpointer(tmp_path, close_timeout_s=30) as ckpt:
        assert ckpt.tracked_step == 1
    assert asyncsave.verify(tmp_path / "step_1").step == 1


async def test_a_wait_timeout_is_not_a_failed_save(tmp_path: Path) -> None:
    gate = threading.Event()
    fs = FaultyFS("write", pause(gate), where=lambda p: p.endswith(".safetensors"))
    async with asyncsave.Checkpointer(tmp_path, filesystem=fs) as ckpt:
        handle = await ckpt.save(1, small_state())
        with pytest.raises(asyncsave.WaitTimeoutError) as err:
            await handle.wait(timeout_s=0.05)
        assert not isinstance(err.value, asyncsave.SaveFailedError)
        assert isinstance(err.value, TimeoutError)
        gate.set()
        assert (await handle) is not None


async def test_source_tensors_are_not_kept_alive_after_staging(tmp_path: Path) -> None:
    import gc
    import weakref

    gate = threading.Event()
    fs = FaultyFS("write", pause(gate), where=lambda p: p.endswith(".safetensors"))
    async with asyncsave.Checkpointer(tmp_path, filesystem=fs) as ckpt:
        big = torch.randn(1 << 16)
        ref = weakref.ref(big)
        handle = await ckpt.save(1, {"big": big})
        del big
        gc.collect()
        assert ref() is None  # freed while the write is still in flight
        gate.set()
        await handle


async def test_a_second_checkpointer_on_one_root_is_refused(tmp_path: Path) -> None:
    async with asyncsave.Checkpointer(tmp_path) as ckpt:
        await (await ckpt.save(1, small_state()))
        with pytest.raises(asyncsave.RootInUseError):
            async with asyncsave.Checkpointer(tmp_path):
                pass
        assert asyncsave.latest(tmp_path).step == 1  # type: ignore[union-attr]
    async with asyncsave.Checkpointer(tmp_path):  # released at close
        pass


async def test_a_file_as_root_is_a_typed_error(tmp_path: Path) -> None:
    (tmp_path / "root").write_text("x")
    with pytest.raises(asyncsave.CheckpointError, match="not a directory"):
        async with asyncsave.Checkpointer(tmp_path / "root"):
            pass
    with pytest.raises(asyncsave.CheckpointNotFoundError, match="not a directory"):
        asyncsave.latest(tmp_path / "root")


async def test_all_file_io_runs_off_the_event_loop_thread(tmp_path: Path) -> None:
    """Invariant 4: every file-system call is made from a worker thread."""

    class RecordingFS(asyncsave.LocalFileSystem):
        threads: ClassVar[set[int]] = set()

        def __getattribute__(self, name: str) -> Any:
            attr = super().__getattribute__(name)
            if not callable(attr) or name.startswith("_"):
                return attr

            def recorded(*args: Any, **kwargs: Any) -> Any:
                RecordingFS.threads.add(threading.get_ident())
                return attr(*args, **kwargs)

            return recorded

    fs = RecordingFS()
    loop_thread = threading.get_ident()
    async with asyncsave.Checkpointer(tmp_path, filesystem=fs) as ckpt:
        for step in (1, 2):
            await (await ckpt.save(step, small_state(step)))
        restored = await ckpt.load_latest()
        assert restored is not None
    assert RecordingFS.threads and loop_thread not in RecordingFS.threads


async def test_replaced_parameter_storages_are_saved_from_their_new_memory(tmp_path: Path) -> None:
    """S5: offloading reallocates parameter storages between saves; each checkpoint
    must hold the values of its own moment, never a cached old buffer."""
    model = torch.nn.Linear(32, 32)
    async with asyncsave.Checkpointer(tmp_path) as ckpt:
        expected = {}
        for step in (1, 2, 3):
            with torch.no_grad():
                for p in model.parameters():
                    p.data = torch.full_like(p, float(step))  # a new storage each time
            expected[step] = {k: v.clone() for k, v in model.state_dict().items()}
            await ckpt.save(step, {"model": model})
        await ckpt.wait()
    for step, sd in expected.items():
        out = asyncsave.load(tmp_path / f"step_{step}")["model"]
        for k, v in sd.items():
            assert torch.equal(out[k], v), (step, k)


async def test_a_forked_child_does_not_keep_the_root_locked(tmp_path: Path) -> None:
    import multiprocessing as mp

    ctx = mp.get_context("fork")
    async with asyncsave.Checkpointer(tmp_path):
        child = ctx.Process(target=__import__("time").sleep, args=(30,))
        child.start()  # a DataLoader worker, say, forked while the lock is held
    try:
        async with asyncsave.Checkpointer(tmp_path):  # the lock went with the parent
            pass
    finally:
        child.terminate()
        child.join()
