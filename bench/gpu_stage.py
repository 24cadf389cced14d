"""GPU staging check: pinned D2H limit, then asyncsave saves of a CUDA state.

Measures, in one run on one machine:
- the pinned device-to-host bandwidth limit (one copy into an exact-size page-locked
  buffer, timed with CUDA events);
- for several saves of the same CUDA state: the time ``save()`` blocked the caller
  (eager: until the snapshot is in host memory), the time to written and committed;
- the device memory peak during the saves (S12: must not grow);
- the largest gap of a 1 ms heartbeat task while the saves ran.

usage: python bench/gpu_stage.py --gib 1.5 --out results.json [--dir /tmp/ckpt]
"""

from __future__ import annotations

import argparse
import json
import shutil
import time
from pathlib import Path

import anyio
import torch

import asyncsave
from asyncsave._stage import _register, _unregister


def d2h_limit_gbps(nbytes: int) -> float:
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda").random_()
    dst = torch.empty(nbytes, dtype=torch.uint8)
    _register(dst)
    try:
        best = 0.0
        for _ in range(3):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            dst.copy_(src, non_blocking=True)
            end.record()
            end.synchronize()
            best = max(best, nbytes / (start.elapsed_time(end) / 1e3) / 1e9)
        return best
    finally:
        _unregister(dst)
        del src


async def run(gib: float, root: Path, saves: int) -> dict[str, object]:
    n_tensors = 24
    per = int(gib * (1 << 30)) // n_tensors // 4
    state = {f"layer{i}": torch.randn(per, device="cuda") for i in range(n_tensors)}
    nbytes = per * 4 * n_tensors
    torch.cuda.synchronize()
    limit = d2h_limit_gbps(nbytes)
    gaps: list[float] = []
    done = anyio.Event()

    async def heartbeat() -> None:
        last = time.perf_counter()
        while not done.is_set():
            await anyio.sleep(0.001)
            now = time.perf_counter()
            gaps.append(now - last)
            last = now

    torch.cuda.reset_peak_memory_stats()
    base_peak = torch.cuda.max_memory_allocated()
    rows = []
    async with anyio.create_task_group() as tg:
        tg.start_soon(heartbeat)
        async with asyncsave.Checkpointer(root) as ckpt:
            for step in range(1, saves + 1):
                t0 = time.perf_counter()
                handle = await ckpt.save(step, state)
                blocked = time.perf_counter() - t0
                info = await handle
                assert info is not None
                rows.append(
                    {
                        "step": step,
                        "blocked_s": blocked,
                        "written_s": info.written_s,
                        "committed_s": info.committed_s,
                        "d2h_bound_s": nbytes / (limit * 1e9),
                        "blocked_over_d2h_bound": blocked / (nbytes / (limit * 1e9)),
                        "write_gbps": info.write_gbps,
                    }
                )
        done.set()
    torch.cuda.synchronize()
    gaps.sort()
    return {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "state_bytes": nbytes,
        "pinned_d2h_limit_gbps": limit,
        "saves": rows,
        "device_peak_growth_bytes": torch.cuda.max_memory_allocated() - base_peak,
        "heartbeat_max_gap_ms": gaps[-1] * 1e3 if gaps else None,
        "heartbeat_p99_gap_ms": gaps[int(len(gaps) * 0.99)] * 1e3 if gaps else None,
    }


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--gib", type=float, default=1.5)
    p.add_argument("--saves", type=int, default=3)
    p.add_argument("--dir", type=Path, default=Path("/tmp/asyncsave-gpu-check"))
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()
    shutil.rmtree(args.dir, ignore_errors=True)
    result = anyio.run(run, args.gib, args.dir, args.saves)
    shutil.rmtree(args.dir, ignore_errors=True)
    args.out.write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
