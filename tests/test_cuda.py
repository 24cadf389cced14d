"""CUDA staging: pinned exact-size host buffers, side-stream D2H copies, no device
memory. Runs where CUDA is present; skips cleanly elsewhere."""

# Private imports: checks which CUDA streams staging uses and lowers the read bounce
# buffer, internals with no public handle.
from __future__ import annotations

from pathlib import Path

import anyio
import pytest
import torch

import asyncsave

pytestmark = [
    pytest.mark.anyio,
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


async def test_cuda_tensors_round_trip_bit_exactly(tmp_path: Path) -> None:
    dev = torch.device("cuda")
    w = torch.randn(64, 48, device=dev)
    state = {
        "w": w,
        "tied": w,
        "w_t": w.t(),
        "slice": torch.randn(32, 32, device=dev)[:, ::2],  # lone non-contiguous view
        "bf16": torch.randn(1000, device=dev).to(torch.bfloat16),
        "f8": torch.randn(77, device=dev).to(torch.float8_e4m3fn),
        "cpu": torch.arange(5),
        "scalar": torch.tensor(3.5, device=dev),
    }
    async with asyncsave.Checkpointer(tmp_path) as ckpt:
        info = await (await ckpt.save(1, state))
    assert info is not None
    out = asyncsave.load(info.path)
    for k, v in state.items():
        assert out[k].device.type == "cpu"
        assert torch.equal(
            out[k].view(torch.uint8) if v.dtype == torch.float8_e4m3fn else out[k],
            (v.view(torch.uint8) if v.dtype == torch.float8_e4m3fn else v).cpu(),
        ), k
    assert out["w"].untyped_storage().data_ptr() == out["w_t"].untyped_storage().data_ptr()
    on_gpu = asyncsave.load(info.path, device="cuda")
    assert on_gpu["w"].is_cuda and torch.equal(on_gpu["w"], w)
    assert on_gpu["w"].untyped_storage().data_ptr() == on_gpu["tied"].untyped_storage().data_ptr()


async def test_staging_allocates_no_device_memory(tmp_path: Path) -> None:
    """S12: the snapshot goes to host memory; the device memory peak is unchanged."""
    dev = torch.device("cuda")
    state = {f"p{i}": torch.randn(1024, 1024, device=dev) for i in range(16)}  # 64 MiB
    state["view"] = torch.randn(2048, 2048, device=dev)[:, :1000]  # non-contiguous
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.max_memory_allocated()
    async with asyncsave.Checkpointer(tmp_path) as ckpt:
        for step in (1, 2):
            await (await ckpt.save(step, state))
    torch.cuda.synchronize()
    assert torch.cuda.max_memory_allocated() - before <= 1 << 20


async def test_pinned_pool_is_exact_size_and_reused(tmp_path: Path) -> None:
    state = {"a": torch.randn(3, 1000, 1001, device="cuda")}  # not a power of two
    async with asyncsave.Checkpointer(tmp_path) as ckpt:
        await (await ckpt.save(1, state))
        pool = ckpt.staging_pool
        assert pool is not None and pool.allocations == 1
        assert pool._arena is not None and pool._arena.is_pinned()
        nbytes = 3 * 1000 * 1001 * 4
        assert nbytes <= pool.capacity < nbytes + 128
        ptr = pool.arena_ptr
        await (await ckpt.save(2, state))
        assert pool.allocations == 1 and pool.arena_ptr == ptr


async def test_copies_see_kernels_queued_before_save_and_mutation_after(tmp_path: Path) -> None:
    """S11 on CUDA: the snapshot holds the value computed before save() (still queued
    on the current stream behind a long kernel) and not the in-place update made
    right after save() returns."""
    x = torch.randn(4096, 4096, device="cuda")
    expected = x.cpu() * 2 + 1
    torch.cuda._sleep(1_000_000_000)  # the producer stream is busy for a while
    y = x * 2 + 1  # queued behind it
    async with asyncsave.Checkpointer(tmp_path) as ckpt:
        handle = await ckpt.save(1, {"y": y})
        y.mul_(0)
        await handle
    assert torch.equal(asyncsave.load(tmp_path / "step_1")["y"], expected)


async def test_a_cancelled_cuda_save_never_leaks_into_the_next_checkpoint(tmp_path: Path) -> None:
    """Copies already queued when save() is cancelled must land before the staging
    buffer is reused; else they overwrite the next save's snapshot."""
    ones = torch.ones(64 << 20, device="cuda")  # 256 MiB
    async with asyncsave.Checkpointer(tmp_path) as ckpt:
        await (await ckpt.save(1, {"x": torch.full((64 << 20,), 7.0)}))  # sizes the pool
        torch.cuda._sleep(2_000_000_000)  # keep the producer stream busy (about 1 s)
        with anyio.move_on_after(0.05) as scope:
            await ckpt.save(2, {"x": ones})
        assert scope.cancelled_caught
        info = await (await ckpt.save(3, {"x": torch.full((64 << 20,), 7.0)}))
    assert info is not None
    assert torch.equal(asyncsave.load(info.path)["x"], torch.full((64 << 20,), 7.0))


async def test_a_hung_kernel_before_save_becomes_a_timeout_not_a_hang(tmp_path: Path) -> None:
    x = torch.ones(1 << 20, device="cuda")
    with pytest.raises(asyncsave.SaveFailedError):
        async with asyncsave.Checkpointer(tmp_path, save_timeout_s=0.2) as ckpt:
            torch.cuda._sleep(6_000_000_000)  # a few seconds: stands in for a stuck kernel
            with pytest.raises(asyncsave.CheckpointTimeoutError, match="device-to-host"):
                await ckpt.save(1, {"x": x})
            with pytest.raises(asyncsave.SaveFailedError):  # the staging memory is lost
                await ckpt.save(2, {"x": torch.ones(3)})
    torch.cuda.synchronize()
    assert not (tmp_path / "step_1").exists()


async def test_cuda_streams_are_created_and_copies_queued_off_the_event_loop(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Creating a stream or launching copies can block behind a busy device: never
    on the event loop thread (invariant 4)."""
    import threading

    from asyncsave import _stage

    threads: list[int] = []
    real_stream = torch.cuda.Stream

    def recording_stream(*args: object, **kwargs: object) -> object:
        if "stream_id" not in kwargs:  # a new stream, not a wrapper of an existing one
            threads.append(threading.get_ident())
        return real_stream(*args, **kwargs)

    monkeypatch.setattr(_stage, "_side_streams", {})
    monkeypatch.setattr(torch.cuda, "Stream", recording_stream)
    async with asyncsave.Checkpointer(tmp_path) as ckpt:
        await (await ckpt.save(1, {"x": torch.ones(1000, device="cuda")}))
    assert threads and threading.get_ident() not in threads


def test_sync_save_sees_kernels_queued_on_the_callers_own_stream(tmp_path: Path) -> None:
    """The current stream is per thread: the facade marks the caller's streams before
    the save crosses to the portal's thread."""
    x = torch.zeros(64 << 20, device="cuda")
    side = torch.cuda.Stream()
    with asyncsave.SyncCheckpointer(tmp_path) as ckpt, torch.cuda.stream(side):
        torch.cuda._sleep(1_000_000_000)
        x.fill_(1.0)  # queued on the caller's side stream, behind the sleep
        ckpt.save(1, {"x": x}).result()
    assert torch.equal(asyncsave.load(tmp_path / "step_1")["x"], torch.ones(64 << 20))


# -- issue 3: lazy mode, streaming through a small budget, the device load path ----


async def test_lazy_cuda_save_sees_queued_kernels_and_not_mutation_after_staged(
    tmp_path: Path,
) -> None:
    """S11 in lazy mode on CUDA: save() returns before the copies land; the snapshot
    holds the value queued before save(), not the update made after staged()."""
    x = torch.randn(4096, 4096, device="cuda")
    expected = x.cpu() * 2 + 1
    bn = torch.nn.BatchNorm1d(8).cuda()
    stats = bn.running_mean.clone().cpu()
    torch.cuda._sleep(1_000_000_000)
    y = x * 2 + 1
    async with asyncsave.Checkpointer(tmp_path) as ckpt:
        handle = await ckpt.save(1, {"y": y, "bn": bn}, lazy=True)
        bn(torch.randn(4, 8, device="cuda") + 3)  # forward: running stats move
        await handle.staged()
        y.mul_(0)
        await handle
    out = asyncsave.load(tmp_path / "step_1")
    assert torch.equal(out["y"], expected)
    assert torch.equal(out["bn"]["running_mean"], stats)


def test_optimizer_hook_with_a_cuda_model_from_a_sync_thread(tmp_path: Path) -> None:
    model = torch.nn.Linear(256, 256).cuda()
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(8, 256, device="cuda")).sum().backward()
    opt.step()
    before = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
    with asyncsave.SyncCheckpointer(tmp_path) as ckpt:
        hook = asyncsave.stage_before_step(opt, ckpt)
        handle = ckpt.save(1, {"model": model, "optim": opt}, lazy=True)
        model(torch.randn(8, 256, device="cuda")).sum().backward()
        opt.step()  # waits for staging first
        hook.remove()
        handle.result()
    out = asyncsave.load(tmp_path / "step_1")
    for k, v in before.items():
        assert torch.equal(out["model"][k], v), k


async def test_streaming_a_cuda_state_through_a_small_budget_uses_no_device_memory(
    tmp_path: Path,
) -> None:
    """S15 with CUDA sources and S12: a pinned budget of a quarter of the state."""
    state = {f"p{i}": torch.randn(1024, 1024, device="cuda") for i in range(16)}  # 64 MiB
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.max_memory_allocated()
    async with asyncsave.Checkpointer(tmp_path, budget_bytes=16 << 20) as ckpt:
        await (await ckpt.save(1, state))
        pool = ckpt.staging_pool
        assert pool is not None and pool.capacity == 16 << 20 and pool._pinned
    torch.cuda.synchronize()
    assert torch.cuda.max_memory_allocated() - before <= 1 << 20
    out = asyncsave.load(tmp_path / "step_1")
    for k, v in state.items():
        assert torch.equal(out[k], v.cpu()), k


async def test_device_loads_go_through_pinned_bounce_buffers_in_chunks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from asyncsave import _read

    monkeypatch.setattr(_read, "BOUNCE_BYTES", 1 << 20)  # many chunks per tensor
    state = {"a": torch.randn(3 << 20), "b": torch.randn(1000).to(torch.bfloat16), "n": 3}
    async with asyncsave.Checkpointer(tmp_path) as ckpt:
        info = await (await ckpt.save(1, state))
    assert info is not None
    out = asyncsave.load(info.path, device="cuda")
    assert out["a"].is_cuda and torch.equal(out["a"].cpu(), state["a"])
    assert torch.equal(out["b"].cpu(), state["b"]) and out["n"] == 3
    one = asyncsave.load_tensors(info.path, ["a"], device="cuda")
    assert one["a"].is_cuda and torch.equal(one["a"].cpu(), state["a"])
