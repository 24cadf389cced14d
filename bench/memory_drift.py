"""Resident memory over many saves while the trainer makes cyclic garbage.

A trainer loop of ``--saves`` x ``--every`` steps: every step makes
``--garbage-mib`` MiB of cyclic garbage (objects only Python's cyclic collector
frees, as frameworks and logging code make them) and touches a few tensors;
every ``--every`` steps it saves a state of ``--tensors`` small tensors (eager
``save()``, not awaited, so saves overlap the next steps; at most two in
flight). The resident set size (RSS) is read at every save; it swings by the
garbage made between two passes of the collector, so the drift compares medians:
``warm`` over the saves from 10 % to 20 % of the run (after the warm-up: staging
arena, allocator pools, plan), ``end`` over the last 10 %, and the drift is
``(end - warm) / warm``. A library that keeps the collector off while saves are
in flight makes it grow by the garbage (the report that motivated this:
https://github.com/marin-community/marin/issues/6774, +333 MiB over 300 steps).

Run: ``python bench/memory_drift.py`` (1,000 saves of 4,096 tensors, 1 MiB of
garbage a step), or ``--saves 100`` for a quick look. ``--max-rss-mib`` stops a
run whose memory runs away (reported as stopped). Writes
``bench/results/memory_drift.json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import gc
import json
import shutil
import statistics
import sys
import time
from collections import deque
from pathlib import Path
from typing import Any

import anyio
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import anyio.lowlevel
from harness import rss

import asyncsave

RESULTS = Path(__file__).resolve().parent / "results"
_MIB = 1 << 20


class _Cycle:
    """A reference cycle holding a payload: freed only by the cyclic collector."""

    def __init__(self, nbytes: int) -> None:
        self.payload = bytearray(nbytes)
        self.me = self


def _make_garbage(mib: float) -> None:
    for _ in range(max(1, round(mib * 16))):
        _Cycle(int(_MIB / 16))


def _state(n: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(n)
    return {f"experts.{i // 4}.w{i % 4}": torch.randn(16 + i % 48, generator=g) for i in range(n)}


async def run(args: argparse.Namespace) -> dict[str, Any]:
    root = args.dir
    shutil.rmtree(root, ignore_errors=True)
    state = _state(args.tensors)
    warm_at = max(1, args.saves // 10)
    samples: list[tuple[int, int]] = []  # (saves so far, RSS bytes)
    in_flight: deque[Any] = deque()
    stopped = False
    t0 = time.perf_counter()
    async with asyncsave.Checkpointer(root, retention=asyncsave.KeepLast(2)) as ckpt:
        for step in range(1, args.saves * args.every + 1):
            _make_garbage(args.garbage_mib)
            state["experts.0.w0"].add_(1)
            await anyio.lowlevel.checkpoint()
            if step % args.every:
                continue
            while len(in_flight) >= 2:
                await in_flight.popleft()
            in_flight.append(await ckpt.save(step, state))
            samples.append((step // args.every, rss()))
            if samples[-1][1] > args.max_rss_mib * _MIB:
                stopped = True
                break
        for handle in in_flight:
            await handle
    seconds = time.perf_counter() - t0
    shutil.rmtree(root, ignore_errors=True)
    done = samples[-1][0]
    window = [r for s, r in samples if warm_at < s <= 2 * warm_at] or [samples[0][1]]
    warm = statistics.median(window)
    end = statistics.median(r for s, r in samples if s > done - max(1, done // 10))
    return {
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "asyncsave": str(Path(asyncsave.__file__).parent),
        "saves": samples[-1][0],
        "saves_asked": args.saves,
        "every": args.every,
        "tensors": args.tensors,
        "garbage_mib_per_step": args.garbage_mib,
        "gc_enabled_at_end": gc.isenabled(),
        "warm_rss_mib": warm / _MIB,  # median, saves 10 %..20 %
        "end_rss_mib": end / _MIB,  # median, the last 10 % of the saves
        "peak_sampled_rss_mib": max(r for _, r in samples) / _MIB,
        "drift_pct": 100.0 * (end - warm) / warm,
        "stopped_at_max_rss": stopped,
        "seconds": seconds,
        "samples": [[s, r / _MIB] for s, r in samples[:: max(1, len(samples) // 100)]],
    }


def markdown(r: dict[str, Any]) -> str:
    met = "yes" if r["drift_pct"] <= 1.0 and not r["stopped_at_max_rss"] else "NO"
    return (
        f"Resident memory over {r['saves']:,} saves of {r['tensors']:,} tensors, one every "
        f"{r['every']} steps, {r['garbage_mib_per_step']} MiB of cyclic garbage a step "
        f"(python {r['python']}, torch {r['torch']}; {r['seconds']:.0f} s):\n\n"
        "| RSS after warm-up, median (MiB) | RSS at end, median (MiB) | peak (MiB) | drift | "
        "target | met |\n|---|---|---|---|---|---|\n"
        f"| {r['warm_rss_mib']:.1f} | {r['end_rss_mib']:.1f} | "
        f"{r['peak_sampled_rss_mib']:.1f} | {r['drift_pct']:+.2f} % | <= 1 % | {met} |\n"
        + ("\nStopped: RSS passed --max-rss-mib.\n" if r["stopped_at_max_rss"] else "")
    )


async def main(args: argparse.Namespace) -> None:
    result = await run(args)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "memory_drift.json").write_text(json.dumps(result, indent=1) + "\n")
    (args.out / "memory_drift.md").write_text(markdown(result))
    print(markdown(result))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--saves", type=int, default=1000)
    parser.add_argument("--every", type=int, default=5)
    parser.add_argument("--tensors", type=int, default=4096)
    parser.add_argument("--garbage-mib", type=float, default=1.0)
    parser.add_argument("--max-rss-mib", type=float, default=6144)
    parser.add_argument("--dir", type=Path, default=Path("/tmp/asyncsave-memory-drift"))
    parser.add_argument("--out", type=Path, default=RESULTS)
    anyio.run(main, parser.parse_args())
