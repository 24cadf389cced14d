"""Lazy mode: save() returns before the snapshot, staged() and the optimizer hook.

To make "staging not finished yet" deterministic (no timing), an earlier eager
save holds the staging budget: its data-file write is paused on a gate, so the
lazy save behind it cannot stage until the test opens the gate.
"""

from __future__ import annotations

import errno
import threading
from pathlib import Path
from typing import Any

import anyio
import anyio.to_thread
import pytest
import torch
from faults import FaultyFS, pause, raise_errno

import asyncsave
from asyncsave.testing import on_early_copy

pytestmark = pytest.mark.anyio


def held_budget_fs() -> tuple[FaultyFS, threading.Event]:
    gate = threading.Event()
    return FaultyFS("write", pause(gate), where=lambda p: p.endswith(".safetensors")), gate


def model_and_opt() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.BatchNorm1d(64))
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(8, 64)).square().mean().backward()
    opt.step()
    return model, opt


def clone_tree(x: Any) -> Any:
    if isinstance(x, dict):
        return {k: clone_tree(v) for k, v in x.items()}
    if isinstance(x, list):
        return [clone_tree(v) for v in x]
    if isinstance(x, torch.Tensor):
        return x.detach().clone()
    return x


def assert_tree_equal(a: Any, b: Any) -> None:
    if isinstance(a, dict):
        assert set(a) == set(b), (set(a), set(b))
        for k in a:
            assert_tree_equal(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            assert_tree_equal(x, y)
    elif isinstance(a, torch.Tensor):
        assert torch.equal(a, b)
    else:
        assert a == b


async def test_lazy_save_returns_before_staging_and_mutation_after_staged_is_safe(
    tmp_path: Path,
) -> None:
    # S11 in lazy mode: mutate every tensor right after staged(); the checkpoint
    # holds the values at save time.
    fs, gate = held_budget_fs()
    state = {"w": torch.randn(256, 256), "b": torch.randn(100_000)}
    expect = clone_tree(state)
    async with asyncsave.Checkpointer(tmp_path, filesystem=fs) as ckpt:
        first = await ckpt.save(1, {"w": torch.zeros(256, 256), "b": torch.zeros(100_000)})
        handle = await ckpt.save(2, state, lazy=True)
        assert not handle.is_staged()  # the budget is still held by step 1
        gate.set()
        await handle.staged()
        for t in state.values():
            t.add_(1.0)
        info = await handle
        await first
    assert info is not None and info.blocked_s <= info.staged_s
    assert_tree_equal(expect, asyncsave.load(tmp_path / "step_2"))


async def test_lazy_save_without_contention_commits_the_values_at_save_time(
    tmp_path: Path,
) -> None:
    state = {"w": torch.randn(1 << 16), "i": torch.arange(10)}
    expect = clone_tree(state)
    async with asyncsave.Checkpointer(tmp_path) as ckpt:
        handle = await ckpt.save(1, state, lazy=True)
        await ckpt.staged()
        state["w"].zero_()
        state["i"].zero_()
        await handle
    assert_tree_equal(expect, asyncsave.load(tmp_path / "step_1"))


async def test_buffers_and_small_tensors_are_copied_before_a_lazy_save_returns(
    tmp_path: Path,
) -> None:
    # BatchNorm running stats change during forward, which lazy mode lets run
    # before staging: module buffers (any size) and small tensors are copied at
    # once. A big buffer on a module in the tree is covered too.
    fs, gate = held_budget_fs()
    model, _ = model_and_opt()
    model.register_buffer("big", torch.zeros(1 << 16))  # 256 KiB > the small limit
    plain_stats = {"running_mean": torch.zeros(64)}  # a plain state_dict's small stat
    before = clone_tree(model.state_dict())
    async with asyncsave.Checkpointer(tmp_path, filesystem=fs) as ckpt:
        first = await ckpt.save(1, {"x": torch.zeros(10)})
        handle = await ckpt.save(2, {"model": model, "plain": plain_stats}, lazy=True)
        assert not handle.is_staged()
        model.train()
        model(torch.randn(8, 64) + 5.0)  # forward: running stats move
        model.get_buffer("big").fill_(7.0)
        plain_stats["running_mean"].fill_(3.0)
        assert not torch.equal(model.state_dict()["1.running_mean"], before["1.running_mean"])
        gate.set()
        await handle
        await first
    loaded = asyncsave.load(tmp_path / "step_2")
    assert_tree_equal(before, dict(loaded["model"]))
    assert torch.equal(loaded["plain"]["running_mean"], torch.zeros(64))


def test_optimizer_hook_makes_step_wait_for_staging_from_a_sync_training_thread(
    tmp_path: Path,
) -> None:
    fs, gate = held_budget_fs()
    model, opt = model_and_opt()
    with asyncsave.SyncCheckpointer(tmp_path, filesystem=fs) as ckpt:
        hook = asyncsave.stage_before_step(opt, ckpt)
        first = ckpt.save(1, {"x": torch.zeros(10)})
        expect = clone_tree({"model": model.state_dict(), "optim": opt.state_dict()})
        handle = ckpt.save(2, {"model": model, "optim": opt}, lazy=True)
        model(torch.randn(8, 64)).square().mean().backward()  # forward/backward overlap
        stepped = threading.Event()

        def train_step() -> None:
            opt.step()
            stepped.set()

        trainer = threading.Thread(target=train_step)
        trainer.start()
        # Staging cannot finish while the gate is closed, so neither can the step.
        assert not stepped.wait(0.2)
        assert not handle.done()
        gate.set()
        trainer.join(30)
        assert stepped.is_set()
        handle.staged(30)
        assert handle.result(30) is not None
        first.result(30)
        hook.remove()
    loaded = asyncsave.load(tmp_path / "step_2")
    assert_tree_equal(expect["model"], dict(loaded["model"]))
    assert_tree_equal(expect["optim"]["state"], loaded["optim"]["state"])
    # The step did run after staging: the live parameters moved on.
    assert not torch.equal(model.state_dict()["0.weight"], expect["model"]["0.weight"])


async def test_optimizer_hook_on_the_event_loop_thread_raises_instead_of_deadlocking(
    tmp_path: Path,
) -> None:
    fs, gate = held_budget_fs()
    model, opt = model_and_opt()
    async with asyncsave.Checkpointer(tmp_path, filesystem=fs) as ckpt:
        hook = asyncsave.stage_before_step(opt, ckpt)
        first = await ckpt.save(1, {"x": torch.zeros(10)})
        handle = await ckpt.save(2, {"model": model, "optim": opt}, lazy=True)
        with pytest.raises(asyncsave.StagingPendingError) as info:
            opt.step()  # on the loop's thread: must not block the loop
        assert info.value.step == 2
        gate.set()
        await ckpt.staged()
        opt.step()  # staged: returns at once, on the loop's thread too
        hook.remove()
        await handle
        await first


async def test_optimizer_hook_in_a_worker_thread_next_to_the_loop_waits(tmp_path: Path) -> None:
    fs, gate = held_budget_fs()
    _model, opt = model_and_opt()
    async with asyncsave.Checkpointer(tmp_path, filesystem=fs) as ckpt:
        hook = asyncsave.stage_before_step(opt, ckpt)
        first = await ckpt.save(1, {"x": torch.zeros(10)})
        expect = clone_tree(opt.state_dict()["state"])
        handle = await ckpt.save(2, {"optim": opt}, lazy=True)
        done = anyio.Event()

        async def train() -> None:
            await anyio.to_thread.run_sync(opt.step)
            done.set()

        async with anyio.create_task_group() as tg:
            tg.start_soon(train)
            for _ in range(10):
                await anyio.sleep(0.01)
            assert not done.is_set()  # waiting for staging in its thread
            gate.set()
        hook.remove()
        await handle
        await first
    assert_tree_equal(expect, asyncsave.load(tmp_path / "step_2")["optim"]["state"])


async def test_a_lazy_save_that_fails_while_staging_is_never_lost(tmp_path: Path) -> None:
    # Streaming through a small budget: a write of an early round (inside the
    # lazy staging) fails.
    fs = FaultyFS("write", raise_errno(errno.EIO), n=2, where=lambda p: p.endswith(".safetensors"))
    state = {"w": torch.randn(1 << 18)}
    async with asyncsave.Checkpointer(tmp_path, budget_bytes=64 << 10, filesystem=fs) as ckpt:
        handle = await ckpt.save(1, state, lazy=True)
        with pytest.raises(asyncsave.SaveFailedError):
            await handle.staged()
        with pytest.raises(asyncsave.SaveFailedError):
            await handle
        with pytest.raises(asyncsave.SaveFailedError):
            await ckpt.save(2, state)
        with pytest.raises(asyncsave.SaveFailedError):
            await ckpt.aclose()
    assert asyncsave.latest(tmp_path) is None


def test_stage_before_step_refuses_what_is_not_a_checkpointer() -> None:
    _, opt = model_and_opt()
    with pytest.raises(TypeError, match="Checkpointer"):
        asyncsave.stage_before_step(opt, object())


@pytest.mark.parametrize("how", ["cancelled", "raises"])
async def test_a_lazy_save_that_fails_before_it_returns_leaves_the_checkpointer_usable(
    tmp_path: Path, how: str
) -> None:
    """The caller of a lazy ``save()`` is cancelled (or the copy of its small
    tensors fails) while still inside ``save()``, once its snapshot has been
    dispatched: the caller hears it (it is in ``save()``), so the checkpointer
    does not refuse later saves as it does for a lazy save that fails after
    returning (a fresh user's trial found every later save refused)."""
    armed = threading.Event()
    scopes: list[anyio.CancelScope] = []

    def fail_the_copy(num_tensors: int) -> None:
        if not armed.is_set():
            return
        if how == "cancelled":
            scopes.pop().cancel()  # delivered at the next checkpoint: the copy's
        else:
            raise MemoryError("no memory for the small tensors' copies")

    state = {"w": torch.randn(1 << 16), "b": torch.zeros(8)}
    with on_early_copy(fail_the_copy):
        async with asyncsave.Checkpointer(tmp_path) as ckpt:
            await (await ckpt.save(1, state, lazy=True))
            armed.set()
            if how == "cancelled":
                with anyio.CancelScope() as scope:
                    scopes.append(scope)
                    await ckpt.save(2, state, lazy=True)
                assert scope.cancelled_caught and not scopes
            else:
                with pytest.raises(MemoryError):
                    await ckpt.save(2, state, lazy=True)
            armed.clear()
            state["w"].add_(1.0)
            await (await ckpt.save(2, state, lazy=True))
            await ckpt.wait()
    info = asyncsave.latest(tmp_path)
    assert info is not None and info.step == 2
    assert torch.equal(asyncsave.load(tmp_path / "step_2")["w"], state["w"])


class _BigModule(torch.nn.Module):
    """Only entries over the small limit: a large parameter and a large buffer
    (a buffer forward may change, whatever its size)."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(1 << 15))  # 128 KiB
        self.register_buffer("stats", torch.zeros(1 << 15))


def _small_stat_state() -> dict[str, Any]:
    return {"w": torch.randn(1 << 16), "stat": torch.zeros(64)}  # a plain tree


def _module_state() -> dict[str, Any]:
    return {"model": _BigModule()}


def _mutate_in_forward(state: dict[str, Any]) -> None:
    if "model" in state:
        state["model"].get_buffer("stats").fill_(7.0)
    else:
        state["stat"].fill_(3.0)


@pytest.mark.parametrize("make", [_small_stat_state, _module_state], ids=["small", "buffer"])
async def test_a_reused_plan_still_copies_what_forward_changes_before_a_lazy_save_returns(
    tmp_path: Path, make: Any
) -> None:
    """A lazy save of the structure the last save planned (its plan reused, a
    small plain tree bound on the loop): the small tensor, or the large module
    buffer, is still copied before ``save()`` returns."""
    fs, gate = held_budget_fs()
    state = make()
    async with asyncsave.Checkpointer(tmp_path, filesystem=fs) as ckpt:
        first = await ckpt.save(1, state)  # the plan; its write holds the budget
        before = clone_tree(_plain(state))
        handle = await ckpt.save(2, state, lazy=True)
        assert not handle.is_staged() and ckpt._planner.reused == 1
        _mutate_in_forward(state)
        gate.set()
        await handle
        await first
    assert_tree_equal(before, _plain(asyncsave.load(tmp_path / "step_2")))


def _plain(state: Any) -> Any:
    """``state`` with its module as a plain dict of tensors (as loaded)."""
    model = state.get("model")
    if model is None:
        return state
    return {"model": dict(model if isinstance(model, dict) else model.state_dict())}


async def test_a_lazy_save_of_only_large_tensors_copies_nothing_before_it_returns(
    tmp_path: Path,
) -> None:
    """No module buffer and no entry of at most 64 KiB: a lazy ``save()`` makes
    no early copy (and takes no worker thread for one); with one small tensor
    more, it does. Both checkpoints hold the values at save time."""
    calls: list[int] = []
    large = {"a": torch.randn(1 << 15), "b": torch.randn(1 << 16)}
    mixed = {**large, "small": torch.arange(16)}
    with on_early_copy(calls.append):
        async with asyncsave.Checkpointer(tmp_path) as ckpt:
            for step, state in ((1, large), (2, large), (3, mixed), (4, mixed)):
                expect = clone_tree(state)
                handle = await ckpt.save(step, state, lazy=True)
                await ckpt.staged()
                for t in state.values():
                    t.add_(1)
                await handle
                assert_tree_equal(expect, asyncsave.load(tmp_path / f"step_{step}"))
    assert calls == [3, 3]


@pytest.mark.parametrize("new_rows", [1, 3, 256])
async def test_a_grown_tensor_of_an_incremental_lazy_save_has_its_new_rows_copied_early(
    tmp_path: Path, new_rows: int
) -> None:
    """Incremental saves cut a grown tensor in chunks after the plan (the
    old rows, the new ones): a new-rows chunk of at most 64 KiB is copied before
    a lazy ``save()`` returns, although every entry of the plan was large (from
    a review: the plan's smallest entry was kept from before the cut)."""
    fs, gate = held_budget_fs()
    async with asyncsave.Checkpointer(tmp_path, filesystem=fs, incremental=True) as ckpt:
        buf = torch.zeros(4096, 64)  # 1 MiB: rows are reused, new ones chunked
        gate.set()
        await (await ckpt.save(1, {"buf": buf}))
        gate.clear()
        buf[0].fill_(1.0)  # a change to write: save 2's write holds the budget
        held = await ckpt.save(2, {"buf": buf})
        buf = torch.cat([buf, torch.zeros(new_rows, 64)])
        expect = buf.clone()
        handle = await ckpt.save(3, {"buf": buf}, lazy=True)
        assert not handle.is_staged()
        buf[4096:].fill_(5.0)  # forward changes the small new rows
        gate.set()
        await handle
        await held
    assert torch.equal(asyncsave.load(tmp_path / "step_3")["buf"], expect)


def _many_small_state() -> dict[str, Any]:
    """Small tensors of several kinds (copied early by a lazy save), one large
    tensor (not), and a module with BatchNorm buffers."""
    g = torch.Generator().manual_seed(3)
    bn = torch.nn.BatchNorm1d(8)
    return {
        "f32": [
            torch.randn(int(n), generator=g) for n in torch.randint(1, 300, (120,), generator=g)
        ],
        "bf16": [torch.randn(64, generator=g).to(torch.bfloat16) for _ in range(30)],
        "i64": torch.arange(7),
        "t": torch.randn(6, 5, generator=g).t(),  # not contiguous
        "mask": torch.rand(40, generator=g) > 0.5,  # bool: cloned, not batched
        "empty": torch.zeros(0),
        "big": torch.randn(1 << 15, generator=g),  # 128 KiB: staged later
        "bn": bn,
    }


def _forward_changes(state: dict[str, Any]) -> None:
    """What forward and counters change before a lazy save is staged: every
    small tensor and the BatchNorm running stats (never the large tensor)."""
    with torch.no_grad():
        for t in [*state["f32"], *state["bf16"], state["i64"], state["t"]]:
            t.add_(1)
        state["mask"].logical_not_()
    state["bn"].train()
    state["bn"](torch.randn(4, 8) + 3.0)


async def test_repeated_lazy_saves_of_one_structure_copy_what_forward_changes_early(
    tmp_path: Path,
) -> None:
    """Lazy saves of one structure, each held from staging by an earlier eager
    save whose fsyncs wait on a gate (it holds the one staging arena until it
    is written), while every small tensor and the module's running stats
    change: each checkpoint holds the values at its ``save()``, bit for bit,
    from the structure's first lazy save (its early copies cloned), to later
    ones (copied into the structure's reused buffer), to two lazy saves made
    before either is staged (the second finds the buffer lent)."""

    class Held(asyncsave.LocalFileSystem):
        gate: threading.Event | None = None

        def fsync(self, fd: int) -> None:
            gate = self.gate
            if gate is not None:
                assert gate.wait(60)
            super().fsync(fd)

    fs = Held()
    state = _many_small_state()
    expected: dict[int, Any] = {}

    def snapshot() -> Any:
        return clone_tree({**state, "bn": dict(state["bn"].state_dict())})

    async with asyncsave.Checkpointer(tmp_path, filesystem=fs) as ckpt:
        step = 0
        for lazies in (1, 1, 1, 2, 1):
            fs.gate = gate = threading.Event()
            step += 1
            blocker = await ckpt.save(step, state)  # staged; its write waits
            handles = []
            for _ in range(lazies):
                step += 1
                expected[step] = snapshot()
                handle = await ckpt.save(step, state, lazy=True)
                handles.append(handle)
                _forward_changes(state)
            assert not any(h.is_staged() for h in handles)  # the arena is held
            fs.gate = None
            gate.set()
            await blocker
            for handle in handles:
                await handle
    for step, expect in expected.items():
        loaded = asyncsave.load(tmp_path / f"step_{step}")
        loaded["bn"] = dict(loaded["bn"])
        assert_tree_equal(expect, loaded)
