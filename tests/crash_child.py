"""Child process of the crash tests: commits step 1, then is SIGKILLed inside the
save of step 2 at one chosen file-system operation.

usage: crash_child.py ROOT OP N WHERE[,WHERE...] BACKEND
"""

from __future__ import annotations

import sys

import anyio
import torch
from faults import FaultyFS, kill

import asyncsave


def state_of(step: int) -> dict[str, object]:
    g = torch.Generator().manual_seed(step)
    return {
        "model": {
            "w": torch.randn(2560, 1024, generator=g),
            "b": torch.randn(1024, generator=g).half(),
        },
        "optim": {"m": torch.randn(512, 512, generator=g, dtype=torch.float64)},
        "trainer": {"step": step, "name": f"run-{step}"},
    }


async def main(root: str, op: str, n: int, where: list[str]) -> None:
    fs = FaultyFS(op, kill(), n=n, where=lambda p: all(w in p for w in where))
    fs.op = "armed-later"  # step 1 must commit untouched
    async with asyncsave.Checkpointer(root, filesystem=fs) as ckpt:
        await (await ckpt.save(1, state_of(1)))
        fs.op = op
        await (await ckpt.save(2, state_of(2)))
    print("not killed", file=sys.stderr)
    sys.exit(3)


if __name__ == "__main__":
    root, op, n, where, backend = sys.argv[1:6]
    anyio.run(main, root, op, int(n), where.split(","), backend=backend)
