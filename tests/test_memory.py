"""Memory over many saves: one staging buffer reused (S10), no growth of RSS (S9).

The harness measures S9 on 200 saves (``bench/harness.py``, ``s9_rss``); this test
is the small, fast version that can fail in CI.
"""

from __future__ import annotations

import gc
import shutil
from pathlib import Path

import pytest
import torch

import asyncsave

pytestmark = pytest.mark.anyio


def rss() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


async def test_a_hundred_saves_reuse_one_staging_buffer(tmp_path: Path) -> None:
    # S10: two, then a hundred saves on one engine reuse the same staging memory.
    state = {"w": torch.randn(256, 256), "b": torch.randn(256), "step": 0}
    async with asyncsave.Checkpointer(tmp_path) as ckpt:
        pool = ckpt.staging_pool
        assert pool is not None
        await (await ckpt.save(1, state))
        ptr, capacity = pool.arena_ptr, pool.capacity
        await (await ckpt.save(2, state))
        assert (pool.arena_ptr, pool.capacity, pool.allocations) == (ptr, capacity, 1)
        for step in range(3, 101):
            state["w"].add_(1.0)
            state["step"] = step
            await (await ckpt.save(step, state))
            if step % 10 == 0:
                for old in range(step - 9, step - 1):
                    shutil.rmtree(tmp_path / f"step_{old}", ignore_errors=True)
        assert (pool.arena_ptr, pool.capacity, pool.allocations) == (ptr, capacity, 1)
    out = asyncsave.load(tmp_path / "step_100")
    assert out["step"] == 100 and torch.equal(out["w"], state["w"])


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_rss_after_many_saves_stays_at_its_level_after_the_first(
    tmp_path: Path, anyio_backend: str
) -> None:
    # S9 (small): 40 saves of 16 MiB. A leak of one copy per save would add 640 MiB;
    # the bound is 5 % of the RSS after the first save.
    state = {"w": torch.randn(4 << 20)}
    async with asyncsave.Checkpointer(tmp_path) as ckpt:
        for step in range(1, 41):
            info = await (await ckpt.save(step, state))
            assert info is not None
            shutil.rmtree(info.path)
            if step == 1:
                gc.collect()
                after_first = rss()
        gc.collect()
        after_last = rss()
    assert abs(after_last - after_first) <= 0.05 * after_first, (after_first, after_last)
