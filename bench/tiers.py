"""Two tiers: what a save costs with a fast local tier in front of a
slow persistent one, and how much training a failure costs with and without it.

The persistent tier is a directory written through :class:`ThrottledFS`, an
asyncsave I/O layer that holds every write to ``--mbps`` MB/s (default 200, a
shared file system or an object store as one node sees it); the local tier is
``--local`` (``/dev/shm`` when it exists: node-local RAM disk). One run measures,
the median of ``--repeats`` saves of a ``--mib`` MiB state each:

- ``persistent only``: ``Checkpointer(persistent_root)``: ``blocked_s`` (``save()``
  returned) and ``durable_s`` (``await handle``: committed on the slow tier);
- ``two tiers``: ``Checkpointer(local, persistent=Tier(persistent_root))``:
  ``blocked_s``, ``local_durable_s`` (``await handle``) and
  ``persistent_durable_s`` (``await handle.persisted()``), all from ``save()``.

The model (printed and written to the JSON): training saves every
``--interval-s`` seconds of training; a failure strikes at a uniformly random
instant; the work lost is the training since the save the restart resumes from
became durable, so with saves at ``k*T`` durable ``D`` later (``D < T``), a failure
``u`` after a save loses ``u`` if ``u >= D`` else ``u + T``: on average ``T/2 + D``.
Each save also blocks training ``B`` seconds, every interval: ``B/T`` of the run.

- one tier: every save goes to the persistent tier: ``T/2 + D_p`` per failure
  (``D_p`` = ``durable_s``; if ``D_p > T`` the saves queue behind each other and
  the effective interval is ``D_p``);
- two tiers, saving locally every ``T`` and persisting every ``k``-th save (``k``
  the smallest with ``k*T >= copy time``, so copies never queue): a failure
  the node survives (a process crash, a NCCL hang, a preemption of the job) resumes
  from the local tier: ``T/2 + D_l``; one that loses the node resumes from the
  persistent tier: ``k*T/2 + D_p2`` (``D_p2`` = ``persistent_durable_s``). With a
  fraction ``--node-loss`` of failures losing the node the mean is the mix.

The model is given at the measured size and at ``--model-gib`` GiB per node (every
measured time scaled by the ratio of bytes: the bandwidths as measured).

usage: python bench/tiers.py [--mib 256] [--mbps 200] [--repeats 3] [--interval-s 60]
       [--node-loss 0.3] [--model-gib 64] [--local DIR] [--dir DIR]
       [--out bench/results/tiers.json]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import anyio
import torch

import asyncsave
from asyncsave import LocalFileSystem


class ThrottledFS(LocalFileSystem):
    """asyncsave's local I/O layer with writes held to ``mbps`` MB/s in total
    (all threads together): a token bucket, sleeping in the writing thread."""

    def __init__(self, mbps: float) -> None:
        self.rate = mbps * 1e6
        self._lock = threading.Lock()
        self._next = time.monotonic()  # when the bucket is empty again

    def write(self, fd: int, data: memoryview) -> int:
        # Reserve the bytes' time on the link first, then write: a write takes
        # the longer of the disk's time and the link's, not their sum.
        with self._lock:
            self._next = max(self._next, time.monotonic()) + len(data) / self.rate
            until = self._next
        n = super().write(fd, data)
        wait = until - time.monotonic()
        if wait > 0:
            time.sleep(wait)
        return n


def _state(mib: int) -> dict[str, Any]:
    n = 8
    numel = mib * (1 << 20) // 4 // n
    return {f"t{i}": torch.randn(numel) for i in range(n)}


async def _one_tier(state: dict[str, Any], root: Path, mbps: float, repeats: int) -> dict[str, Any]:
    blocked, durable = [], []
    async with asyncsave.Checkpointer(
        root, filesystem=ThrottledFS(mbps), retention=asyncsave.KeepLast(1)
    ) as ckpt:
        for step in range(1, repeats + 1):
            t0 = time.perf_counter()
            handle = await ckpt.save(step, state)
            blocked.append(time.perf_counter() - t0)
            await handle
            durable.append(time.perf_counter() - t0)
    return {"blocked_s": statistics.median(blocked), "durable_s": statistics.median(durable)}


async def _two_tiers(
    state: dict[str, Any], local: Path, remote: Path, mbps: float, repeats: int
) -> dict[str, Any]:
    blocked, local_d, remote_d = [], [], []
    tier = asyncsave.Tier(remote, filesystem=ThrottledFS(mbps), retention=asyncsave.KeepLast(1))
    async with asyncsave.Checkpointer(
        local, retention=asyncsave.KeepLast(1), persistent=tier
    ) as ckpt:
        for step in range(1, repeats + 1):
            t0 = time.perf_counter()
            handle = await ckpt.save(step, state)
            blocked.append(time.perf_counter() - t0)
            await handle
            local_d.append(time.perf_counter() - t0)
            await handle.persisted()
            remote_d.append(time.perf_counter() - t0)
    return {
        "blocked_s": statistics.median(blocked),
        "local_durable_s": statistics.median(local_d),
        "persistent_durable_s": statistics.median(remote_d),
    }


def model(
    one: dict[str, Any],
    two: dict[str, Any],
    interval_s: float,
    node_loss: float,
    scale: float = 1.0,
) -> dict[str, Any]:
    """Mean training seconds lost per failure, and the share of training time spent
    blocked in ``save()``, from the measured times (see the module docstring),
    each multiplied by ``scale`` (a state ``scale`` times larger, at the measured
    bandwidths)."""
    one = {k: v * scale for k, v in one.items()}
    two = {k: v * scale for k, v in two.items()}
    t = interval_s
    t_one = max(t, one["durable_s"])  # saves cannot start faster than they commit
    lost_one = t_one / 2 + one["durable_s"]
    copy_s = two["persistent_durable_s"] - two["local_durable_s"]
    k = max(1, math.ceil(copy_s / t))
    lost_local = t / 2 + two["local_durable_s"]
    lost_node = k * t / 2 + two["persistent_durable_s"]
    return {
        "interval_s": t,
        "state_gib": None,
        "node_loss_fraction": node_loss,
        "persist_every_kth_save": k,
        "one_tier_lost_s": lost_one,
        "one_tier_blocked_share": one["blocked_s"] / t_one,
        "two_tiers_lost_s_node_survives": lost_local,
        "two_tiers_lost_s_node_lost": lost_node,
        "two_tiers_lost_s_mean": (1 - node_loss) * lost_local + node_loss * lost_node,
        "two_tiers_blocked_share": two["blocked_s"] / t,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mib", type=int, default=256)
    ap.add_argument("--mbps", type=float, default=200.0)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--interval-s", type=float, default=60.0)
    ap.add_argument("--node-loss", type=float, default=0.3)
    ap.add_argument("--model-gib", type=float, default=64.0, help="state per node, modelled")
    ap.add_argument("--local", default="/dev/shm" if os.path.isdir("/dev/shm") else None)
    ap.add_argument("--dir", default=None, help="where the persistent tier goes (a disk)")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "tiers.json"))
    args = ap.parse_args()
    state = _state(args.mib)
    work = Path(tempfile.mkdtemp(prefix="asyncsave-tiers-", dir=args.dir))
    local = Path(tempfile.mkdtemp(prefix="asyncsave-tiers-local-", dir=args.local))
    try:
        one = anyio.run(_one_tier, state, work / "one", args.mbps, args.repeats)
        two = anyio.run(_two_tiers, state, local / "two", work / "two", args.mbps, args.repeats)
    finally:
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(local, ignore_errors=True)
    result = {
        "mib": args.mib,
        "persistent_mbps": args.mbps,
        "repeats": args.repeats,
        "local_dir": args.local or tempfile.gettempdir(),
        "persistent_only": one,
        "two_tiers": two,
        "model_at_measured_size": model(one, two, args.interval_s, args.node_loss),
        "model_at_model_size": model(
            one, two, args.interval_s, args.node_loss, args.model_gib * 1024 / args.mib
        ),
    }
    result["model_at_measured_size"]["state_gib"] = args.mib / 1024
    result["model_at_model_size"]["state_gib"] = args.model_gib
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
