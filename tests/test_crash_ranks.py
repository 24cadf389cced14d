"""The crash matrix on 2 ranks (issue 11, item 4).

A 2-rank run saves step 1 (awaited), then step 2. A first run records, on each
rank, every mutating I/O call and every collective of step 2's save. Then, for
each rank ``r`` and each recorded call ``k``, a run is SIGKILLed on rank ``r``
just before its call ``k``. Afterwards:

1. a reader (world size 1) resolves to a step at least as new as the newest
   save any rank acknowledged, and its bytes load bit-exact for both ranks;
2. a fresh 2-rank run resumes that same step, each rank its own part bit-exact,
   and its open leaves no temporary directory behind.

The survivor must return (the harness deadline is far below ``dist_timeout_s``
times the number of collectives): a dead peer is found through the store.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path
from typing import Any

import anyio
import pytest
import torch

import asyncsave
from asyncsave import LocalFileSystem
from asyncsave.testing import gloo_collectives

sys.path.insert(0, str(Path(__file__).parent))
from distributed import run_ranks, start_ranks, values

pytestmark = pytest.mark.slow

MUTATING = (
    "create",
    "write",
    "fsync",
    "close",
    "mkdir",
    "makedirs",
    "fsync_dir",
    "rename",
    "replace",
    "exchange",
    "remove_tree",
    "unlink",
    "link",
)


def state_of(rank: int, step: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(7919 * rank + step)
    return {"w": torch.randn(2048, generator=g), "t": {"step": step, "rank": rank}}


class _Calls:
    """This rank's numbered calls (I/O and collectives) once ``armed``."""

    def __init__(self, kill_at: int | None) -> None:
        self.kill_at = kill_at
        self.armed = False
        self.n = 0
        self.names: list[str] = []

    def __call__(self, what: str) -> None:
        if not self.armed:
            return
        self.n += 1
        self.names.append(what)
        if self.n == self.kill_at:
            os.kill(os.getpid(), signal.SIGKILL)


def _counting_fs(calls: _Calls) -> LocalFileSystem:
    class Counting(LocalFileSystem):
        pass

    def wrap(name: str) -> Any:
        base = getattr(LocalFileSystem, name)

        def method(self: Any, *args: Any, **kwargs: Any) -> Any:
            calls(name)
            return base(self, *args, **kwargs)

        return method

    for name in MUTATING:
        if hasattr(LocalFileSystem, name):
            setattr(Counting, name, wrap(name))
    return Counting()


def _scenario(rank: int, world: int, root: str, victim: int, kill_at: int | None) -> list[str]:
    calls = _Calls(kill_at if rank == victim else None)
    fs = _counting_fs(calls)
    acks = Path(root).parent / f"acks-{rank}"

    def ack(step: int) -> None:
        with open(acks, "a") as f:
            f.write(f"{step}\n")
            f.flush()
            os.fsync(f.fileno())

    async def main() -> None:
        try:
            async with asyncsave.Checkpointer(
                root, filesystem=fs, dist_timeout_s=6, save_timeout_s=60
            ) as ckpt:
                await (await ckpt.save(1, state_of(rank, 1)))
                ack(1)
                calls.armed = True
                await (await ckpt.save(2, state_of(rank, 2)))
                ack(2)
                calls.armed = False
        except asyncsave.SaveFailedError:
            pass  # the peer died: this rank raised instead of hanging

    with gloo_collectives(calls):  # "broadcast" or "all_gather", in this rank's process
        anyio.run(main)
    return calls.names


def _resume(rank: int, world: int, root: str) -> int | None:
    async def main() -> int | None:
        async with asyncsave.Checkpointer(root, dist_timeout_s=30) as ckpt:
            restored = await ckpt.load_latest()
            if restored is None:
                return None
            step = restored.info.step
            want = state_of(rank, step)
            assert torch.equal(restored.state["w"], want["w"]) and restored.state["t"] == want["t"]
            return step

    return anyio.run(main)


def _acked(root: Path) -> set[int]:
    steps: set[int] = set()
    for rank in (0, 1):
        path = root.parent / f"acks-{rank}"
        if path.exists():
            steps |= {int(x) for x in path.read_text().split()}
    return steps


def test_every_call_of_each_rank_killed_then_resume_on_two_and_one(tmp_path: Path) -> None:
    (tmp_path / "rec").mkdir()
    recorded = values(
        run_ranks(_scenario, 2, tmp_path / "rec", str(tmp_path / "rec" / "run"), -1, None)
    )
    assert "rename" in recorded[0] and "all_gather" in recorded[1]
    points = [(r, k) for r in (0, 1) for k in range(1, len(recorded[r]) + 1)]
    failures: list[str] = []
    # Two kill points run side by side (each its own group and store): a point
    # spends most of its time with the survivor waiting for the heartbeat window.
    for pair in (points[i : i + 2] for i in range(0, len(points), 2)):
        running = []
        for victim, k in pair:
            base = tmp_path / f"r{victim}-{k}"
            base.mkdir()
            running.append(
                (
                    victim,
                    k,
                    base,
                    start_ranks(_scenario, 2, base, str(base / "run"), victim, k, timeout_s=60),
                )
            )
        for victim, k, base, ranks in running:
            what = f"rank {victim} killed before {recorded[victim][k - 1]} #{k}"
            failures += _check_point(what, victim, base, ranks.collect())
    assert failures == [], "\n".join(failures)


def _check_point(
    what: str, victim: int, base: Path, results: dict[int, tuple[str, Any]]
) -> list[str]:
    """The oracle (module docstring) after one kill point."""
    root = base / "run"
    if results[victim] != ("exit", -signal.SIGKILL) or results[1 - victim][0] != "ok":
        return [f"{what}: {results}"]
    acked = _acked(root)
    info = asyncsave.latest(root)
    step = None if info is None else info.step
    if acked and (step is None or step < max(acked)):
        return [f"{what}: acknowledged {sorted(acked)}, latest is {step}"]
    if step is not None:
        whole = asyncsave.load(root / f"step_{step}")
        if not all(torch.equal(whole[r]["w"], state_of(r, step)["w"]) for r in (0, 1)):
            return [f"{what}: step {step} does not load bit-exact"]
    failures = []
    resumed = values(run_ranks(_resume, 2, base, str(root)))
    if resumed != [step, step]:
        failures.append(f"{what}: 2 ranks resumed {resumed}, the reader {step}")
    left = [p.name for p in root.iterdir() if p.name.startswith(".asyncsave-tmp")]
    if left:
        failures.append(f"{what}: temporary directories left after reopening: {left}")
    return failures
