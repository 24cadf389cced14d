"""A train pump preempted by real signals, run as a child process by
tests/test_signals.py.

The pump saves every 10 steps under ``SaveEvery(10) | SaveOnSignal(sig)``. After
step 30, rank 0 writes ``ready`` into the marks directory and waits for the signal
(the parent sends it), so the signal's save is the one of step 31. The commit of
step 31 (the rename of its directory) is held until the parent writes ``go``:
before, rank 0 writes ``gate``, and each rank writes ``flushing<rank>`` once its
pump has left the loop and the checkpointer's close is next. The parent repeats
the signal in between, then opens the gate. The child prints one JSON line:
the step it stopped at, the repeats the policy counted, and whether the handler
in place at the end is the one from before the policy.

Usage: ``python signal_child.py ROOT MARKS NESTING SIGNAL [RANK WORLD STORE]``,
``NESTING`` one of ``inside`` (``with policy:`` inside ``async with Checkpointer``),
``outside``, ``sync`` (inside ``with SyncCheckpointer``), ``agreed``
(``ckpt.agree(policy)`` inside, on ``WORLD`` ranks joined through a file store), or
``plain``: no policy; step 5 is saved at once (its commit held), ``ready`` is
written and the body waits for Ctrl-C, then writes ``flushing0`` as it unwinds
into the close.
"""

from __future__ import annotations

import json
import signal
import sys
import time
from pathlib import Path
from typing import Any

import anyio
import torch

import asyncsave

SIGNAL_STEP = 30
WAIT_S = 60.0


def _wait_for(path: Path) -> None:
    deadline = time.monotonic() + WAIT_S
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} never appeared")
        time.sleep(0.01)


class GateFS(asyncsave.LocalFileSystem):
    """Holds the commit of ``step_<step>`` until ``marks/go`` exists."""

    def __init__(self, marks: Path, step: int) -> None:
        self.marks, self.step = marks, step

    def rename(self, src: Path, dst: Path) -> None:
        if Path(dst).name == f"step_{self.step}":
            (self.marks / "gate").touch()
            _wait_for(self.marks / "go")
        super().rename(src, dst)


class Pump:
    def __init__(self, marks: Path, sig: asyncsave.SaveOnSignal, rank: int) -> None:
        self.marks, self.sig, self.rank = marks, sig, rank
        self.model = torch.nn.Linear(4, 4)
        self.step = 0

    def train(self, policy: asyncsave.SavePolicy) -> bool:
        """One step; whether to save it (``self.step``)."""
        self.step += 1
        self.model.weight.data += 1
        return policy.should_save(self.step)

    def state(self) -> dict[str, Any]:
        return {"model": self.model, "step": self.step}

    def after(self, policy: asyncsave.SavePolicy) -> bool:
        """Whether to stop; rank 0 waits for the parent's signal after step 30."""
        if policy.stop_requested:
            return True
        if self.step == SIGNAL_STEP and self.rank == 0:
            (self.marks / "ready").touch()
            deadline = time.monotonic() + WAIT_S
            while self.sig.received is None:
                assert time.monotonic() < deadline, "no signal came"
                time.sleep(0.01)
        return False

    def flushing(self) -> None:
        (self.marks / f"flushing{self.rank}").touch()


async def run_async(root: Path, pump: Pump, policy: asyncsave.SavePolicy, nesting: str) -> None:
    fs = GateFS(pump.marks, SIGNAL_STEP + 1)
    if nesting == "outside":
        with policy:
            async with asyncsave.Checkpointer(root, filesystem=fs) as ckpt:
                while not pump.after(policy):
                    if pump.train(policy):
                        await ckpt.save(pump.step, pump.state())
                pump.flushing()
        return
    async with asyncsave.Checkpointer(root, filesystem=fs) as ckpt:
        if nesting == "agreed":
            policy = ckpt.agree(policy)
        with policy:
            while not pump.after(policy):
                if pump.train(policy):
                    await ckpt.save(pump.step, pump.state())
        pump.flushing()


async def run_plain(root: Path, marks: Path) -> None:
    async with asyncsave.Checkpointer(root, filesystem=GateFS(marks, 5)) as ckpt:
        await ckpt.save(5, {"x": torch.zeros(4)})
        (marks / "ready").touch()
        try:
            await anyio.sleep(WAIT_S)
        finally:
            (marks / "flushing0").touch()


def run_sync(root: Path, pump: Pump, policy: asyncsave.SavePolicy) -> None:
    fs = GateFS(pump.marks, SIGNAL_STEP + 1)
    with asyncsave.SyncCheckpointer(root, filesystem=fs) as ckpt:
        with policy:
            while not pump.after(policy):
                if pump.train(policy):
                    ckpt.save(pump.step, pump.state())
        pump.flushing()


def main(argv: list[str]) -> None:
    root, marks, nesting, name = Path(argv[0]), Path(argv[1]), argv[2], argv[3]
    if nesting == "plain":
        anyio.run(run_plain, root, marks)
        return
    rank = 0
    if nesting == "agreed":
        import torch.distributed as dist

        rank, world, store = int(argv[4]), int(argv[5]), argv[6]
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    signum = signal.Signals[name]
    before = signal.getsignal(signum)
    sig = asyncsave.SaveOnSignal(signum)
    pump = Pump(marks, sig, rank)
    policy = asyncsave.SaveEvery(10) | sig
    if nesting == "sync":
        run_sync(root, pump, policy)
    else:
        anyio.run(run_async, root, pump, policy, nesting)
    restored = signal.getsignal(signum) is before
    print(json.dumps({"stopped": pump.step, "repeats": sig.repeats, "restored": restored}))
    if nesting == "agreed":
        # Both ranks leave together and tear their groups down, as a trainer ends:
        # a rank exiting under a live gloo group whose peer already left can abort
        # in gloo's teardown ("terminate called without an active exception").
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1:])
