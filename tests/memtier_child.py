"""A trainer of the memory-tier kill matrices (``tests/test_memory_tier.py``).

``python tests/memtier_child.py ROOT SHM STEPS OUT [hold]`` saves ``state_for(s)``
for each step of ``STEPS`` (``7,8``) through ``Checkpointer(ROOT,
memory=MemoryTier(shm_dir=SHM))``; once every ``save()`` returned it writes
``OUT/returned`` (the saver's pid, as JSON). With ``hold`` it
then blocks (the test SIGKILLs it); without, it leaves the block (a clean close).
The 2-rank matrix runs :func:`rank_main` in forked ranks instead.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

import anyio
import torch

import asyncsave


def _write(path: Path, doc: dict[str, Any]) -> None:
    """Write ``doc`` whole or not at all (the test reads it as soon as it exists)."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(doc))
    tmp.replace(path)


def state_for(step: int, rank: int = 0) -> dict[str, Any]:
    """The state a trainer of ``rank`` holds at ``step``: tied weights, a bf16
    tensor, a view, optimizer-like moments and plain counters, all a function of
    ``(step, rank)``."""
    g = torch.Generator().manual_seed(1000 * rank + step)
    emb = torch.randn(64, 32, generator=g)
    moments = torch.randn(3, 1000, generator=g)
    return {
        "model": {"emb": emb, "head": emb, "bias": torch.randn(32, generator=g).bfloat16()},
        "optim": {"exp_avg": moments[0], "exp_avg_sq": moments[1:]},
        "loader": {"epoch": step // 10, "position": step * 7, "rank": rank},
        "step": step,
    }


def same(a: Any, b: Any) -> bool:
    """Bit-exact equality of two states of :func:`state_for`'s shape."""
    if isinstance(a, torch.Tensor):
        return (
            isinstance(b, torch.Tensor)
            and a.dtype == b.dtype
            and a.shape == b.shape
            and torch.equal(
                a.view(torch.uint8) if a.dtype != torch.bool else a,
                b.view(torch.uint8) if b.dtype != torch.bool else b,
            )
        )
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    return bool(a == b)


async def save_steps(root: str, shm: str, steps: list[int], out: Path, hold: bool) -> None:
    tier = asyncsave.MemoryTier(shm_dir=shm)
    async with asyncsave.Checkpointer(root, memory=tier) as ckpt:
        for step in steps:
            await ckpt.save(step, state_for(step))
        _write(out / "returned", {"saver_pid": ckpt.saver_pid})
        if hold:
            time.sleep(600)  # the test kills this process


def rank_main(rank: int, world_size: int, root: str, shm: str, steps: list[int], out: str) -> None:
    """One rank of the 2-rank matrix: save ``steps`` and hold (killed by the test)."""

    async def run() -> None:
        tier = asyncsave.MemoryTier(shm_dir=shm)
        async with asyncsave.Checkpointer(root, memory=tier) as ckpt:
            for step in steps:
                await ckpt.save(step, state_for(step, rank))
            _write(Path(out, f"returned{rank}"), {"saver_pid": ckpt.saver_pid})
            time.sleep(600)

    anyio.run(run)


if __name__ == "__main__":
    root, shm, steps, out = sys.argv[1:5]
    anyio.run(
        save_steps,
        root,
        shm,
        [int(s) for s in steps.split(",")],
        Path(out),
        sys.argv[5:] == ["hold"],
    )
