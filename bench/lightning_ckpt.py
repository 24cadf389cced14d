"""Lightning ``.ckpt`` save cost: asyncsave's plugin against Lightning's own IOs.

One process saves a Lightning-shaped checkpoint dict (``state_dict`` of
``--mib`` / 3 MiB of float32 in 16 tensors, Adam's ``exp_avg`` and
``exp_avg_sq`` of the same size, plus Lightning's plain entries: about ``--mib``
MiB in all) to a ``.ckpt`` path, ``--repeats`` rounds, with:

- ``asyncsave plugin``: ``AsyncsaveCheckpointIO`` (stages into its reused
  buffers, returns; ``torch.save`` into a temporary file, fsync, rename, fsync of
  the directory in its writer thread); durable = ``wait()`` returned;
- ``Lightning TorchCheckpointIO``: Lightning's synchronous IO (``torch.save``
  into memory, then the file written through fsspec; no fsync); durable = it
  returned, then the file and its directory fsynced by this script;
- ``Lightning AsyncCheckpointIO``: ``AsyncCheckpointIO(TorchCheckpointIO())``
  (clones every tensor on the caller's thread, saves in a thread); durable =
  ``teardown()`` returned (its only wait), then the fsyncs as above.

References in every round: a host memcpy of the tensor bytes (``memcpy``), and
``torch.save`` straight to the file plus fsync of it and of the directory
(``torch.save+fsync``). Between rounds every tensor is changed in place (a
training step). Reported: the median of the rounds of the seconds
``save_checkpoint`` blocked the caller and of the seconds until the file was
durable, and round 1 apart (the plugin allocates its buffers then). The order
of the rows rotates round by round. Two shared cores: compare within one run.

usage: python bench/lightning_ckpt.py [--mib 200] [--repeats 7] [--dir DIR] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch.plugins.io import AsyncCheckpointIO, TorchCheckpointIO

from asyncsave.lightning import AsyncsaveCheckpointIO


def _state(mib: int) -> dict[str, Any]:
    n = mib * (1 << 20) // 4 // 3 // 16  # float32 elements per tensor
    params = {f"layer{i}.weight": torch.randn(n) for i in range(16)}
    state = {
        i: {"step": torch.tensor(10.0), "exp_avg": torch.randn(n), "exp_avg_sq": torch.rand(n)}
        for i in range(16)
    }
    return {
        "epoch": 0,
        "global_step": 0,
        "pytorch-lightning_version": "2.6.6",
        "state_dict": params,
        "loops": {"fit_loop": {"state_dict": {}, "epoch_progress": {"total": {"completed": 0}}}},
        "callbacks": {"ModelCheckpoint{'monitor': None}": {"best_model_path": ""}},
        "optimizer_states": [
            {
                "state": state,
                "param_groups": [{"lr": 1e-3, "betas": (0.9, 0.999), "params": list(range(16))}],
            }
        ],
        "lr_schedulers": [],
        "hyper_parameters": {"lr": 1e-3},
    }


def _tensors(ckpt: dict[str, Any]) -> list[torch.Tensor]:
    out = list(ckpt["state_dict"].values())
    for s in ckpt["optimizer_states"][0]["state"].values():
        out += [s["exp_avg"], s["exp_avg_sq"]]
    return out


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    dfd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)


def _plugin(io: AsyncsaveCheckpointIO) -> Callable[[dict[str, Any], Path], tuple[float, float]]:
    def run(ckpt: dict[str, Any], path: Path) -> tuple[float, float]:
        t0 = time.perf_counter()
        io.save_checkpoint(ckpt, path)
        t1 = time.perf_counter()
        io.wait()
        return t1 - t0, time.perf_counter() - t0

    return run


def _torch_io(ckpt: dict[str, Any], path: Path) -> tuple[float, float]:
    io = TorchCheckpointIO()
    t0 = time.perf_counter()
    io.save_checkpoint(ckpt, path)
    t1 = time.perf_counter()
    _fsync(path)
    return t1 - t0, time.perf_counter() - t0


def _async_io(ckpt: dict[str, Any], path: Path) -> tuple[float, float]:
    io = AsyncCheckpointIO(TorchCheckpointIO())
    t0 = time.perf_counter()
    io.save_checkpoint(ckpt, path)
    t1 = time.perf_counter()
    io.teardown()
    _fsync(path)
    return t1 - t0, time.perf_counter() - t0


def _torch_save(ckpt: dict[str, Any], path: Path) -> tuple[float, float]:
    t0 = time.perf_counter()
    torch.save(ckpt, path)
    _fsync(path)
    t = time.perf_counter() - t0
    return t, t


def _memcpy(tensors: list[torch.Tensor]) -> Callable[[dict[str, Any], Path], tuple[float, float]]:
    dst = [torch.empty_like(t) for t in tensors]

    def run(ckpt: dict[str, Any], path: Path) -> tuple[float, float]:
        t0 = time.perf_counter()
        for d, s in zip(dst, tensors, strict=True):
            d.copy_(s)
        t = time.perf_counter() - t0
        return t, t

    return run


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mib", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--dir", type=Path, default=None)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    base = Path(tempfile.mkdtemp(prefix="lightning-ckpt-", dir=args.dir))
    ckpt = _state(args.mib)
    tensors = _tensors(ckpt)
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    plugin = AsyncsaveCheckpointIO()
    rows: dict[str, Callable[[dict[str, Any], Path], tuple[float, float]]] = {
        "asyncsave plugin": _plugin(plugin),
        "Lightning TorchCheckpointIO": _torch_io,
        "Lightning AsyncCheckpointIO": _async_io,
        "torch.save+fsync": _torch_save,
        "memcpy": _memcpy(tensors),
    }
    results: dict[str, list[tuple[float, float]]] = {name: [] for name in rows}
    names = list(rows)
    try:
        for r in range(args.repeats):
            ckpt["global_step"] = r + 1
            for i in range(len(names)):
                name = names[(i + r) % len(names)]
                path = base / f"{name.split()[0].lower()}-{r}.ckpt"
                results[name].append(rows[name](ckpt, path))
                if path.exists():
                    path.unlink()
            for t in tensors:  # a training step
                t.add_(1e-3)
    finally:
        plugin.teardown()
        shutil.rmtree(base, ignore_errors=True)
    report = {"bytes": nbytes, "repeats": args.repeats, "rows": {}}
    print(f"{nbytes / 2**20:.0f} MiB of tensors, {args.repeats} rounds (median; round 1 apart)")
    print(
        f"{'':30s} {'blocked s':>10s} {'durable s':>10s} {'GB/s':>6s} {'r1 blocked':>11s} {'r1 durable':>11s}"
    )
    for name, got in results.items():
        blocked = statistics.median(b for b, _ in got)
        durable = statistics.median(d for _, d in got)
        report["rows"][name] = {"blocked_s": blocked, "durable_s": durable, "rounds": got}
        print(
            f"{name:30s} {blocked:10.3f} {durable:10.3f} {nbytes / durable / 1e9:6.2f}"
            f" {got[0][0]:11.3f} {got[0][1]:11.3f}"
        )
    if args.out:
        args.out.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
