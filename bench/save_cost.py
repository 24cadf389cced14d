"""What one save of the example's training state costs on this machine.

Builds the state ``examples/train_resume.py`` checkpoints (the 10.9 M-parameter GPT,
its AdamW state after one step, RNG and counters: 131 MB), then, in one run:

- ``save()`` blocking time (eager: until the snapshot is in host memory) against
  the host memcpy of the same bytes into a reused buffer (the physical bound);
- time to durable (``await handle``: written, fsynced, committed, tracked) against
  a raw sequential write + fsync of the same bytes;
- ``torch.save`` + fsync of the same state, for reference.

Each figure is the median of ``--repeats`` runs (the disk here is noisy). Prints a
table and writes JSON.

usage: python bench/save_cost.py [--repeats 5] [--dir /tmp/asyncsave-bench] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import anyio
import torch

import asyncsave

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
from train_resume import GPT, ModelConfig


def example_state() -> dict[str, Any]:
    torch.manual_seed(0)
    model = GPT(ModelConfig())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randint(0, 256, (2, 128))
    model(x).float().mean().backward()
    opt.step()
    return {"model": model, "optim": opt, "trainer": {"step": 1, "rng": torch.get_rng_state()}}


def raw_write_fsync(path: Path, buf: torch.Tensor) -> float:
    t0 = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        view = memoryview(buf.numpy())  # type: ignore[arg-type]
        for pos in range(0, len(view), 8 << 20):
            os.write(fd, view[pos : pos + (8 << 20)])
        os.fsync(fd)
    finally:
        os.close(fd)
    return time.perf_counter() - t0


def torch_save_fsync(path: Path, state: dict[str, Any]) -> float:
    t0 = time.perf_counter()
    with open(path, "wb") as f:
        torch.save(
            {
                "model": state["model"].state_dict(),
                "optim": state["optim"].state_dict(),
                "trainer": state["trainer"],
            },
            f,
        )
        f.flush()
        os.fsync(f.fileno())
    return time.perf_counter() - t0


async def asyncsave_runs(root: Path, state: dict[str, Any], repeats: int) -> list[dict[str, float]]:
    rows = []
    async with asyncsave.Checkpointer(root) as ckpt:
        for step in range(1, repeats + 2):  # the first save allocates the pool: reported apart
            t0 = time.perf_counter()
            handle = await ckpt.save(step, state)
            blocked = time.perf_counter() - t0
            info = await handle
            assert info is not None
            rows.append(
                {"blocked_s": blocked, "durable_s": time.perf_counter() - t0, "nbytes": info.nbytes}
            )
            shutil.rmtree(info.path)
    return rows


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--dir", type=Path, default=Path("/tmp/asyncsave-bench"))
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    shutil.rmtree(args.dir, ignore_errors=True)
    args.dir.mkdir(parents=True)
    state = example_state()
    rows = anyio.run(asyncsave_runs, args.dir / "ckpt", state, args.repeats)
    nbytes = rows[0]["nbytes"]
    src = torch.randn(nbytes // 4).view(torch.uint8)
    dst = torch.empty_like(src)
    dst.copy_(src)
    memcpy, raw, tsave = [], [], []
    for i in range(args.repeats):
        t0 = time.perf_counter()
        dst.copy_(src)
        memcpy.append(time.perf_counter() - t0)
        raw.append(raw_write_fsync(args.dir / f"raw{i}", src))
        (args.dir / f"raw{i}").unlink()
        tsave.append(torch_save_fsync(args.dir / f"ts{i}", state))
        (args.dir / f"ts{i}").unlink()
    med = statistics.median
    steady = rows[1:]
    result = {
        "state_bytes": nbytes,
        "repeats": args.repeats,
        "first_save_blocked_s": rows[0]["blocked_s"],
        "save_blocked_s": med(r["blocked_s"] for r in steady),
        "save_durable_s": med(r["durable_s"] for r in steady),
        "memcpy_s": med(memcpy),
        "raw_write_fsync_s": med(raw),
        "torch_save_fsync_s": med(tsave),
    }
    result["blocked_over_memcpy"] = result["save_blocked_s"] / result["memcpy_s"]
    result["durable_over_raw"] = result["save_durable_s"] / result["raw_write_fsync_s"]
    result["write_gbps"] = nbytes / result["save_durable_s"] / 1e9
    result["raw_write_gbps"] = nbytes / result["raw_write_fsync_s"] / 1e9
    shutil.rmtree(args.dir, ignore_errors=True)
    print(f"state {nbytes / 1e6:.1f} MB, medians of {args.repeats}")
    print(
        f"  save() blocked        {result['save_blocked_s'] * 1e3:8.1f} ms  ({result['blocked_over_memcpy']:.2f} x memcpy {result['memcpy_s'] * 1e3:.1f} ms; first save {result['first_save_blocked_s'] * 1e3:.1f} ms)"
    )
    print(
        f"  save durable          {result['save_durable_s'] * 1e3:8.1f} ms  ({result['durable_over_raw']:.2f} x raw write+fsync {result['raw_write_fsync_s'] * 1e3:.1f} ms)"
    )
    print(
        f"  write throughput      {result['write_gbps']:8.2f} GB/s (raw {result['raw_write_gbps']:.2f} GB/s)"
    )
    print(
        f"  torch.save + fsync    {result['torch_save_fsync_s'] * 1e3:8.1f} ms (blocks the caller throughout)"
    )
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
