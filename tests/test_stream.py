"""Streaming a state larger than the staging budget through it in rounds (S15)."""

from __future__ import annotations

import errno
import itertools
import json
import math
import threading
from pathlib import Path
from typing import Any

import anyio
import pytest
import torch
from faults import FaultyFS, pause, raise_errno

import asyncsave
from asyncsave.testing import StreamPiece, stream_rounds, thresholds

pytestmark = pytest.mark.anyio


def mixed_state() -> dict[str, Any]:
    g = torch.Generator().manual_seed(3)
    base = torch.randn(300, generator=g)
    return {
        "f32": torch.randn(1000, 7, generator=g),
        "f64": torch.randn(513, generator=g, dtype=torch.float64),
        "bf16": torch.randn(77, 3, generator=g).bfloat16(),
        "c64": torch.randn(129, generator=g, dtype=torch.complex64),
        "b": torch.rand(333, generator=g) > 0.5,
        "i8": torch.randint(-128, 127, (1001,), dtype=torch.int8, generator=g),
        "empty": torch.zeros(0, 5),
        "tied_a": base[:200],
        "tied_b": base[100:],  # shares base's storage: one blob entry
        "nc": torch.randn(20, 30, generator=g).t(),  # non-contiguous, gathered whole
        "meta": {"step": 7},
    }


def assert_same(a: Any, b: Any) -> None:
    if isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            assert_same(a[k], b[k])
    elif isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert torch.equal(
            a.contiguous().reshape(-1).view(torch.uint8),
            b.contiguous().reshape(-1).view(torch.uint8),
        )
    else:
        assert a == b


@pytest.mark.parametrize("budget", [12288, 12345, 30000])
@pytest.mark.parametrize("files", [1, 3])
def test_rounds_cover_every_byte_once_in_file_order_within_the_budget(
    tmp_path: Path, budget: int, files: int
) -> None:
    """A streamed save of a mixed state (about 38 KB) through ``budget`` bytes:
    each round gives each file at most its share of the arena (a multiple of 64
    bytes), the pieces of a file never overlap in the arena, and across the
    rounds each file's entries come in file order, every byte once."""
    seen: list[tuple[int, list[list[StreamPiece]]]] = []
    with thresholds(min_file_bytes=1024), stream_rounds(lambda b, r: seen.append((b, r))):
        with asyncsave.SyncCheckpointer(
            tmp_path, budget_bytes=budget, writer_threads=files
        ) as ckpt:
            info = ckpt.save(1, mixed_state()).result()
    assert len(seen) == 1 and seen[0][0] == budget, seen
    rounds = seen[0][1]
    doc = json.loads((info.path / "manifest.json").read_bytes())
    entries = doc["entries"]
    assert len(doc["files"]) == files
    file_entries = [  # each file's entries in file order (an empty one before its neighbour)
        sorted(
            (i for i, e in enumerate(entries) if e["file"] == f),
            key=lambda i: (entries[i]["offset"], entries[i]["nbytes"] > 0),
        )
        for f in range(files)
    ]
    covered: dict[int, int] = {}
    share = budget // files // 64 * 64
    for pieces in rounds:
        for f in range(files):
            mine = [q for q in pieces if q[0] == f]
            for _, _, start, end, at in mine:  # inside the file's share, no overlap
                assert f * share <= at and at + (end - start) <= (f + 1) * share
            spans = sorted((at, at + end - start) for _, _, start, end, at in mine)
            assert all(a[1] <= b[0] for a, b in itertools.pairwise(spans))
    # Per file, the pieces follow the file's order with no gap and no overlap.
    for f in range(files):
        order = [(i, start, end) for r in rounds for (g, i, start, end, _) in r if g == f]
        pos = {i: 0 for i in file_entries[f]}
        seen_entries: list[int] = []
        for i, start, end in order:
            assert start == pos[i]
            pos[i] = end
            if not seen_entries or seen_entries[-1] != i:
                seen_entries.append(i)
        assert seen_entries == file_entries[f]
        covered.update(pos)
    assert covered == {i: e["nbytes"] for i, e in enumerate(entries)}
    total = sum(e["nbytes"] for e in entries)
    assert budget < total and len(rounds) >= math.ceil(total / budget)
    assert_same(asyncsave.load(info.path), mixed_state())


async def test_state_four_times_the_budget_streams_and_loads_back_equal(tmp_path: Path) -> None:
    # S15: a budget of a quarter of the state. The save completes, bit-exactly, the
    # arena never grows past the budget and is allocated once.
    state = {"w": torch.randn(256, 1024), "v": torch.randn(1024, 256)}  # 2 MiB
    budget = 512 << 10
    async with asyncsave.Checkpointer(tmp_path, budget_bytes=budget) as ckpt:
        handle = await ckpt.save(1, state)
        pool = ckpt.staging_pool
        assert pool is not None and pool.capacity == budget and pool.allocations == 1
        info = await handle
        assert info is not None and info.nbytes == 2 << 20
        for step in (2, 3):
            await (await ckpt.save(step, state))
        assert pool.capacity == budget and pool.allocations == 1
    assert asyncsave.verify(tmp_path / "step_3").step == 3
    assert_same(state, asyncsave.load(tmp_path / "step_1"))


async def test_contiguous_tensors_with_odd_strides_on_size_one_dims_stream(
    tmp_path: Path,
) -> None:
    # Found by tests/test_aliasing.py: such a tensor is contiguous (so it is cut at
    # byte boundaries) but view(torch.uint8) refuses its last stride.
    t = torch.arange(8, dtype=torch.int16)
    state = {
        "one": t[::8],  # shape (1,), stride (8,)
        "col": torch.randn(3).as_strided((3, 1), (1, 5)),  # stride (1, 5)
        "f": torch.randn(300),
    }
    assert all(v.is_contiguous() for v in state.values())
    async with asyncsave.Checkpointer(tmp_path, budget_bytes=1024) as ckpt:
        await (await ckpt.save(1, state))
    loaded = asyncsave.load(tmp_path / "step_1")
    for k, v in state.items():
        assert loaded[k].dtype == v.dtype and torch.equal(loaded[k], v), k


@pytest.mark.parametrize("writer_threads", [1, 3])
async def test_every_dtype_and_shared_storage_stream_through_a_tiny_budget(
    tmp_path: Path, writer_threads: int
) -> None:
    state = mixed_state()
    with thresholds(min_file_bytes=1024):
        async with asyncsave.Checkpointer(
            tmp_path, budget_bytes=3 * 4096, writer_threads=writer_threads
        ) as ckpt:
            await (await ckpt.save(1, state))
    loaded = asyncsave.load(tmp_path / "step_1")
    assert_same(state, loaded)
    assert (
        loaded["tied_a"].untyped_storage().data_ptr()
        == loaded["tied_b"].untyped_storage().data_ptr()
    )
    asyncsave.verify(tmp_path / "step_1")
    files = [p for p in (tmp_path / "step_1").iterdir() if p.suffix == ".safetensors"]
    assert len(files) == writer_threads


async def test_mutation_right_after_an_eager_streamed_save_does_not_leak(tmp_path: Path) -> None:
    # S11 with streaming: save() returns only once every byte is copied (the last
    # round in the arena, the others already in the files).
    state = {"w": torch.arange(1 << 18, dtype=torch.float32)}  # 1 MiB
    expect = state["w"].clone()
    async with asyncsave.Checkpointer(tmp_path, budget_bytes=128 << 10) as ckpt:
        handle = await ckpt.save(1, state)
        state["w"].mul_(-1)
        await handle
    assert torch.equal(asyncsave.load(tmp_path / "step_1")["w"], expect)


async def test_a_write_failure_while_streaming_fails_the_save_and_leaves_no_temp_dir(
    tmp_path: Path,
) -> None:
    # The second write of the data file is in an early round, inside save().
    fs = FaultyFS("write", raise_errno(errno.EIO), n=2, where=lambda p: p.endswith(".safetensors"))
    state = {"w": torch.randn(1 << 18)}
    async with asyncsave.Checkpointer(tmp_path, budget_bytes=64 << 10, filesystem=fs) as ckpt:
        with pytest.raises(asyncsave.SaveFailedError) as info:
            await ckpt.save(1, state)
        assert isinstance(info.value.__cause__, OSError)
        assert not [p for p in tmp_path.iterdir() if p.name.startswith(".asyncsave-tmp")]
        # The snapshot was never taken: the engine goes on.
        await (await ckpt.save(2, state))
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("step_")) == ["step_2"]


async def test_a_streamed_save_waits_while_an_earlier_one_holds_the_budget(
    tmp_path: Path,
) -> None:
    gate = threading.Event()
    fs = FaultyFS("fsync", pause(gate), where=lambda p: True)
    state = {"w": torch.randn(1 << 17)}
    async with asyncsave.Checkpointer(tmp_path, budget_bytes=64 << 10, filesystem=fs) as ckpt:
        first = await ckpt.save(1, state)  # its last round holds the arena until fsync
        returned = anyio.Event()

        async def second() -> None:
            await ckpt.save(2, state)
            returned.set()

        async with anyio.create_task_group() as tg:
            tg.start_soon(second)
            await anyio.to_thread.run_sync(fs.fired.wait, 30)
            for _ in range(10):
                await anyio.sleep(0.01)
            assert not returned.is_set()  # backpressure
            gate.set()
        await first
    assert asyncsave.latest(tmp_path).step == 2


async def test_a_streamed_round_stuck_past_the_deadline_fails_and_never_reuses_the_arena(
    tmp_path: Path,
) -> None:
    from faults import block

    gate = threading.Event()
    fs = FaultyFS("write", block(gate), n=2, where=lambda p: p.endswith(".safetensors"))
    state = {"w": torch.randn(1 << 18)}
    try:
        with pytest.raises(asyncsave.SaveFailedError):
            async with asyncsave.Checkpointer(
                tmp_path, budget_bytes=64 << 10, filesystem=fs, save_timeout_s=0.5
            ) as ckpt:
                with pytest.raises(asyncsave.SaveFailedError) as info:
                    await ckpt.save(1, state)
                assert isinstance(info.value.__cause__, asyncsave.CheckpointTimeoutError)
                with pytest.raises(asyncsave.SaveFailedError):  # the arena is lost
                    await ckpt.save(2, state)
    finally:
        gate.set()  # let the abandoned writer thread go
    assert asyncsave.latest(tmp_path) is None
