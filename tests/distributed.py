"""Run a function on several ranks of a gloo process group, in forked children.

The parent (pytest, torch already imported) forks one child per rank; a child
joins a gloo group through a ``FileStore`` and runs the function. A rank's outcome
comes back as ``("ok", value)``, ``("error", traceback text)`` or, for a child that
died (SIGKILL), ``("exit", exitcode)``. Everything is bounded: children still alive
at the deadline are killed and reported as ``("exit", None)``.

Ranks run with a heartbeat window of ``HEARTBEAT_WINDOW_S`` (the library's is up
to 10 s): a test that kills a rank hears it named within seconds, with
``dist_timeout_s`` still far beyond.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time
import traceback
import uuid
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import anyio

import asyncsave
from asyncsave.testing import FakeGroup, thresholds

#: Seconds a rank's heartbeat may stand still before its peers name it dead, in
#: every rank this harness runs (a beat every 0.3 s).
HEARTBEAT_WINDOW_S = 3.0


def _child(
    fn: Callable[..., Any],
    rank: int,
    world_size: int,
    store: str,
    queue: Any,
    args: tuple[Any, ...],
) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ["MASTER_ADDR"] = "127.0.0.1"  # DCP's process executor reads it
    try:
        dist.init_process_group(
            "gloo",
            init_method=f"file://{store}",
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=60),
        )
        with thresholds(heartbeat_window_s=HEARTBEAT_WINDOW_S):
            value = fn(rank, world_size, *args)
        queue.put((rank, ("ok", value)))
    except BaseException:
        queue.put((rank, ("error", traceback.format_exc())))
    finally:
        # No destroy_process_group: a peer may be dead; the process exits now,
        # once the result is through the pipe.
        queue.close()
        queue.join_thread()
        os._exit(0)


class Ranks:
    """Ranks started by :func:`start_ranks`; :meth:`collect` waits for them."""

    def __init__(self, procs: list[Any], queue: Any, deadline: float) -> None:
        self.procs, self.queue, self.deadline = procs, queue, deadline

    def collect(self) -> dict[int, tuple[str, Any]]:
        """Every rank's outcome; ranks alive at the deadline are killed."""
        procs, queue, deadline = self.procs, self.queue, self.deadline
        world_size = len(procs)
        results: dict[int, tuple[str, Any]] = {}
        while len(results) < world_size and time.monotonic() < deadline:
            try:
                rank, outcome = queue.get(timeout=0.2)
                results[rank] = outcome
            except Exception:  # queue.Empty
                if all(not p.is_alive() for p in procs) and queue.empty():
                    break
        for r, p in enumerate(procs):
            p.join(timeout=max(0.1, deadline - time.monotonic()))
            if p.is_alive():
                os.kill(p.pid, signal.SIGKILL)
                p.join(5)
                results.setdefault(r, ("exit", None))
            else:
                results.setdefault(r, ("exit", p.exitcode))
        return results


def start_ranks(
    fn: Callable[..., Any],
    world_size: int,
    tmp: Path,
    *args: Any,
    timeout_s: float = 120.0,
) -> Ranks:
    """Fork ``world_size`` ranks running ``fn(rank, world_size, *args)`` and
    return at once (several groups may run side by side: each has its own
    store under ``tmp``)."""
    ctx = mp.get_context("fork")
    queue = ctx.Queue()
    store = str(tmp / f"store-{uuid.uuid4().hex}")
    procs = [
        ctx.Process(target=_child, args=(fn, r, world_size, store, queue, args), daemon=False)
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    return Ranks(procs, queue, time.monotonic() + timeout_s)


def run_ranks(
    fn: Callable[..., Any],
    world_size: int,
    tmp: Path,
    *args: Any,
    timeout_s: float = 120.0,
) -> dict[int, tuple[str, Any]]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` forked ranks."""
    return start_ranks(fn, world_size, tmp, *args, timeout_s=timeout_s).collect()


def values(results: dict[int, tuple[str, Any]]) -> list[Any]:
    """Every rank's value; fails with the ranks' tracebacks if any rank did not
    return."""
    bad = {r: o for r, o in results.items() if o[0] != "ok"}
    if bad:
        text = "\n".join(f"--- rank {r}: {kind}\n{detail}" for r, (kind, detail) in bad.items())
        raise AssertionError(f"ranks failed:\n{text}")
    return [results[r][1] for r in sorted(results)]


def stop_dcp_background_process() -> None:
    """DCP's process executor keeps one spawned process per process for later saves
    and stops it only at interpreter exit, which a forked rank skips (``os._exit``):
    stop it here (DCP's own TERMINATE request) so no test leaves it running. The
    pipe to it was handed over by multiprocessing's resource sharer, whose
    listener socket lives in a ``pymp-*`` temporary directory removed only at
    interpreter exit too: stop the sharer and remove the directory."""
    import shutil
    from multiprocessing import process, resource_sharer

    from torch.distributed.checkpoint import _async_process_executor as executor

    background, executor._CHECKPOINT_PROCESS = executor._CHECKPOINT_PROCESS, None
    if background is not None:
        background.__del__()
    resource_sharer.stop(timeout=5)
    tempdir = process.current_process()._config.pop("tempdir", None)
    if tempdir is not None:
        shutil.rmtree(tempdir, ignore_errors=True)


async def resume_on_ranks(root: Path, world_size: int) -> dict[int, Any]:
    """``load_latest()`` on every rank of a :class:`FakeGroup` of ``world_size``
    ranks in this process: each rank's ``Restored``, or the error it raised."""
    group, out = FakeGroup(world_size), {}

    async def rank(r: int) -> None:
        try:
            async with asyncsave.Checkpointer(root, coordinator=group.rank(r)) as ckpt:
                out[r] = await ckpt.load_latest()
        except asyncsave.CheckpointError as exc:
            out[r] = exc

    async with anyio.create_task_group() as tg:
        for r in range(world_size):
            tg.start_soon(rank, r)
    return out
