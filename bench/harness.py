"""The asyncsave benchmark harness: asyncsave against its peers and the machine.

One command, one run, one machine::

    python bench/harness.py --quick      # under 3 minutes on the 2-core dev machine
    python bench/harness.py              # the full run (its time is in the JSON)
    python bench/harness.py --render-readme   # docs/guides/benchmarks.md table from bench/results/harness.json

Workloads: a GPT-2-small-shaped model state with its AdamW state (124 M float32
parameters, ~1.49 GB), a size sweep (64 MiB..256 MiB quick; 64 MiB..4 GiB full) and
a replay buffer of 10,000 small tensors in one TensorDict.

Peers, in the same run, on the same state: asyncsave (eager and lazy), ``torch.save``
+ fsync, ``torch.distributed.checkpoint.save`` (1 and 2 writer threads, single
process, ``no_dist=True``), DCP ``async_save`` (default; and with a reused
``DefaultStager`` staging in the background, its fastest CPU configuration),
``safetensors.torch.save_file`` + fsync, TensorDict ``memmap`` + fsync. Each is
measured for the time the caller is blocked, the time until the bytes are durable,
GB/s to durable, peak RSS growth and the time of a cold load (in the last round
only: the first save after a load is slower, which would bias the save samples).

Limits, in the same run: host memcpy bandwidth into a reused buffer (and pinned
device-to-host bandwidth on a GPU), raw sequential write + fsync of the same bytes,
and raw read of them on the same file system. Cold reads: the files' pages are
dropped with ``posix_fadvise(POSIX_FADV_DONTNEED)`` after fsync (per file, so other
users of the machine keep their page cache; clean pages are dropped).

Event-loop health: a 1 ms heartbeat task runs during every asyncsave save; the
largest and p99 gaps are recorded, and a 2 GiB save is measured (background saving once stalled training
for 0.8 s: https://github.com/pytorch/pytorch/issues/94238). Memory: RSS after N saves against after the first (each async
save leaked host memory: https://github.com/pytorch/pytorch/issues/170163).

Every figure is the median of ``--repeats`` runs (peers interleaved in each
repeat; the disk here varies up to 2x between identical runs). Results go to
``bench/results/``: ``harness.json``, ``harness.md`` and ``harness.png``.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import importlib.util
import json
import mmap
import os
import platform
import resource
import shutil
import statistics
import sys
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import anyio
import anyio.to_thread
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import asyncsave

RESULTS = Path(__file__).resolve().parent / "results"
# The page whose table --render-readme rewrites (its name kept from when the README held it).
README = Path(__file__).resolve().parent.parent / "docs" / "guides" / "benchmarks.md"
MiB, GiB = 1 << 20, 1 << 30
CHUNK = 8 * MiB


# -- workloads -------------------------------------------------------------------


def gpt2_small_state(device: str) -> dict[str, Any]:
    """GPT-2 small's parameter shapes (124 M float32) and AdamW state (exp_avg,
    exp_avg_sq, step per parameter), as ``model.state_dict()`` and
    ``optimizer.state_dict()`` lay them out. Built directly (no module), so it
    takes seconds."""
    d, v, ctx, layers = 768, 50257, 1024, 12
    shapes: dict[str, tuple[int, ...]] = {"wte.weight": (v, d), "wpe.weight": (ctx, d)}
    for i in range(layers):
        p = f"h.{i}."
        shapes.update(
            {
                p + "ln_1.weight": (d,),
                p + "ln_1.bias": (d,),
                p + "attn.c_attn.weight": (d, 3 * d),
                p + "attn.c_attn.bias": (3 * d,),
                p + "attn.c_proj.weight": (d, d),
                p + "attn.c_proj.bias": (d,),
                p + "ln_2.weight": (d,),
                p + "ln_2.bias": (d,),
                p + "mlp.c_fc.weight": (d, 4 * d),
                p + "mlp.c_fc.bias": (4 * d,),
                p + "mlp.c_proj.weight": (4 * d, d),
                p + "mlp.c_proj.bias": (d,),
            }
        )
    shapes.update({"ln_f.weight": (d,), "ln_f.bias": (d,)})
    gen = torch.Generator().manual_seed(0)

    def t(shape: tuple[int, ...], scale: float = 0.02) -> torch.Tensor:
        return (torch.randn(shape, generator=gen) * scale).to(device)

    model = {k: t(s) for k, s in shapes.items()}
    optim_state = {
        i: {"step": torch.tensor(1.0), "exp_avg": t(s, 1e-3), "exp_avg_sq": t(s, 1e-6)}
        for i, s in enumerate(shapes.values())
    }
    groups = [
        {
            "lr": 6e-4,
            "betas": (0.9, 0.95),
            "eps": 1e-8,
            "weight_decay": 0.1,
            "amsgrad": False,
            "params": list(range(len(shapes))),
        }
    ]
    return {"model": model, "optim": {"state": optim_state, "param_groups": groups}}


def sized_state(nbytes: int, device: str) -> dict[str, Any]:
    """``nbytes`` of float32 in tensors of at most 64 MiB (a layer-sized shard)."""
    out: dict[str, Any] = {}
    left, i = nbytes, 0
    while left > 0:
        n = min(left, 64 * MiB)
        out[f"t{i:04d}"] = torch.empty(n // 4, device=device).fill_(float(i) + 0.5)
        left -= n
        i += 1
    return out


def replay_buffer(device: str, n: int = 10_000) -> Any:
    """A TensorDict replay buffer of ``n`` small tensors (8 KiB each, 82 MB); a
    plain dict of them where tensordict is not installed."""
    gen = torch.Generator().manual_seed(1)
    items = {f"k{i:05d}": torch.randn(2048, generator=gen).to(device) for i in range(n)}
    if importlib.util.find_spec("tensordict") is None:
        return items
    from tensordict import TensorDict

    return TensorDict(items, batch_size=[])


def flat(tree: Any, prefix: str = "") -> dict[str, torch.Tensor]:
    """Flatten a tree of dicts/lists into ``{"a.b.0": tensor}`` (for the peers that
    take a flat dict of tensors; no copies)."""
    out: dict[str, torch.Tensor] = {}
    if isinstance(tree, torch.Tensor):
        out[prefix] = tree
    elif isinstance(tree, dict) or type(tree).__name__ == "TensorDict":
        for k in tree.keys():
            out.update(flat(tree[k], f"{prefix}.{k}" if prefix else str(k)))
    elif isinstance(tree, (list, tuple)):
        for i, v in enumerate(tree):
            out.update(flat(v, f"{prefix}.{i}" if prefix else str(i)))
    return out


def nbytes_of(tree: Any) -> int:
    return sum(t.numel() * t.element_size() for t in flat(tree).values())


# -- measuring helpers -------------------------------------------------------------


def rss() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def reset_peak_rss() -> bool:
    """Reset VmHWM (Linux >= 4.0: ``5 > /proc/self/clear_refs``)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def peak_rss() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def files_under(path: Path) -> list[Path]:
    if path.is_file():
        return [path]
    return [p for p in path.rglob("*") if p.is_file()]


def fsync_tree(path: Path) -> None:
    """fsync every file and directory under ``path`` (for peers that do not)."""
    for p in files_under(path):
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    dirs = [path] if path.is_dir() else []
    dirs += [p for p in path.rglob("*") if p.is_dir()] if path.is_dir() else []
    for d in [*dirs, path.parent]:
        fd = os.open(d, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def drop_cache(path: Path) -> None:
    """Cold reads: drop the (clean, fsynced) pages of every file under ``path``."""
    for p in files_under(path):
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


class Heartbeat:
    """A task that sleeps 1 ms at a time and records the gaps between ticks."""

    def __init__(self) -> None:
        self.gaps: list[float] = []
        self.active = False
        self.last = time.perf_counter()

    async def run(self) -> None:
        self.last = time.perf_counter()
        while True:
            await anyio.sleep(0.001)
            now = time.perf_counter()
            if self.active:
                self.gaps.append(now - self.last)
            self.last = now

    @contextlib.contextmanager
    def measuring(self) -> Iterator[None]:
        self.gaps = []
        # Gaps count from here: whatever blocked the loop before (the harness's own
        # clean-up between runs) is not the save's.
        self.last = time.perf_counter()
        self.active = True
        try:
            yield
        finally:
            self.active = False

    def figures(self) -> dict[str, float]:
        g = sorted(self.gaps)
        if not g:
            return {"hb_max_ms": float("nan"), "hb_p99_ms": float("nan"), "hb_ticks": 0}
        return {
            "hb_max_ms": g[-1] * 1e3,
            "hb_p99_ms": g[min(len(g) - 1, int(len(g) * 0.99))] * 1e3,
            "hb_ticks": len(g),
        }


# -- limits --------------------------------------------------------------------------


def memcpy_gbps(nbytes: int, repeats: int) -> float:
    """Host memcpy into a reused (already faulted-in) buffer."""
    src = torch.empty(nbytes, dtype=torch.uint8).fill_(7)
    dst = torch.empty_like(src)
    dst.copy_(src)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - t0)
    return nbytes / median(times) / 1e9


def pinned_d2h_gbps(nbytes: int) -> float:
    """Device-to-host copy into exact-size page-locked memory (cudaHostRegister)."""
    from asyncsave._stage import _register, _unregister

    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda").random_()
    dst = torch.empty(nbytes, dtype=torch.uint8)
    _register(dst)
    try:
        best = 0.0
        for _ in range(3):
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            dst.copy_(src, non_blocking=True)
            end.record()
            end.synchronize()
            best = max(best, nbytes / (start.elapsed_time(end) / 1e3) / 1e9)
        return best
    finally:
        _unregister(dst)


def raw_write_fsync(path: Path, tensors: list[torch.Tensor]) -> float:
    """Sequential 8 MiB writes of the state's own bytes into one file, then fsync."""
    t0 = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        for t in tensors:
            view = memoryview(t.contiguous().view(-1).view(torch.uint8).numpy())
            for pos in range(0, len(view), CHUNK):
                os.write(fd, view[pos : pos + CHUNK])
        os.fsync(fd)
    finally:
        os.close(fd)
    return time.perf_counter() - t0


def raw_write_direct(path: Path, nbytes: int) -> float:
    """The same number of bytes written with O_DIRECT from one page-aligned 8 MiB
    buffer, then fsync: the disk's own limit without the page cache (asyncsave
    writes the bulk of its files this way). ``nan`` where O_DIRECT is refused."""
    buf = mmap.mmap(-1, CHUNK)
    buf.write(b"\x5a" * CHUNK)
    view = memoryview(buf)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o644)
    except OSError:
        return float("nan")
    t0 = time.perf_counter()
    try:
        left = -(-nbytes // 4096) * 4096
        while left > 0:
            n = min(left, CHUNK)
            os.write(fd, view[:n])
            left -= n
        os.fsync(fd)
    finally:
        os.close(fd)
        del view
        buf.close()
    return time.perf_counter() - t0


def raw_read(path: Path) -> float:
    """Cold sequential read of a file into a reused 8 MiB buffer (the disk's limit)."""
    drop_cache(path)
    buf = bytearray(CHUNK)
    view = memoryview(buf)
    t0 = time.perf_counter()
    with open(path, "rb", buffering=0) as f:
        while f.readinto(view):
            pass
    return time.perf_counter() - t0


# -- peers -----------------------------------------------------------------------------
# Each synchronous peer: save(state, path) -> {"blocked_s", "durable_s"[, "staged_s"]}
# and load(path, state) -> materialised state (every byte in memory).


def torch_save(state: Any, path: Path) -> dict[str, float]:
    t0 = time.perf_counter()
    with open(path, "wb") as f:
        torch.save(state if isinstance(state, dict) else flat(state), f)
        f.flush()
        os.fsync(f.fileno())
    fsync_tree(path.parent)
    d = time.perf_counter() - t0
    return {"blocked_s": d, "durable_s": d}


def torch_load(path: Path, state: Any) -> Any:
    return torch.load(path, weights_only=True)


def dcp_save(threads: int) -> Callable[[Any, Path], dict[str, float]]:
    def save(state: Any, path: Path) -> dict[str, float]:
        import torch.distributed.checkpoint as dcp

        t0 = time.perf_counter()
        dcp.save(
            flat(state),
            storage_writer=dcp.FileSystemWriter(path, thread_count=threads, sync_files=True),
            no_dist=True,
        )
        fsync_tree(path)
        d = time.perf_counter() - t0
        return {"blocked_s": d, "durable_s": d}

    return save


def dcp_load(path: Path, state: Any) -> Any:
    import torch.distributed.checkpoint as dcp

    out = {k: torch.empty_like(v, device="cpu") for k, v in flat(state).items()}
    dcp.load(out, checkpoint_id=path, no_dist=True)
    return out


class DcpAsync:
    """DCP ``async_save``: default (a thread; staging happens inside the call), or
    with one ``DefaultStager`` reused across saves (staging in the background;
    ``cache_staged_state_dict`` keeps its host copy between saves)."""

    def __init__(self, stager: bool) -> None:
        self.use_stager = stager
        self.stager: Any = None

    def save(self, state: Any, path: Path) -> dict[str, float]:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

        sd = flat(state)
        if not self.use_stager:
            t0 = time.perf_counter()
            fut = dcp.async_save(sd, storage_writer=dcp.FileSystemWriter(path), no_dist=True)
            blocked = time.perf_counter() - t0
            fut.result()
            fsync_tree(path)
            return {"blocked_s": blocked, "durable_s": time.perf_counter() - t0}
        if self.stager is None:
            self.stager = DefaultStager(
                StagingOptions(
                    use_pinned_memory=torch.cuda.is_available(),
                    use_shared_memory=False,
                    use_async_staging=True,
                    use_non_blocking_copy=torch.cuda.is_available(),
                )
            )
        t0 = time.perf_counter()
        resp = dcp.async_save(
            sd,
            storage_writer=dcp.FileSystemWriter(path, cache_staged_state_dict=True),
            async_stager=self.stager,
            no_dist=True,
        )
        blocked = time.perf_counter() - t0
        resp.staging_completion.result()
        staged = time.perf_counter() - t0
        resp.upload_completion.result()
        fsync_tree(path)
        return {"blocked_s": blocked, "staged_s": staged, "durable_s": time.perf_counter() - t0}

    def close(self) -> None:
        if self.stager is not None:
            self.stager.close()
            self.stager = None


def safetensors_save(state: Any, path: Path) -> dict[str, float]:
    from safetensors.torch import save_file

    t0 = time.perf_counter()
    sd = {k: v.contiguous() for k, v in flat(state).items()}
    save_file(sd, str(path))
    fsync_tree(path)
    d = time.perf_counter() - t0
    return {"blocked_s": d, "durable_s": d}


def safetensors_load(path: Path, state: Any) -> Any:
    from safetensors.torch import load_file

    return load_file(str(path))


def tensordict_save(state: Any, path: Path) -> dict[str, float]:
    from tensordict import TensorDict

    td = state if type(state).__name__ == "TensorDict" else TensorDict(flat(state), batch_size=[])
    t0 = time.perf_counter()
    td.memmap(path, num_threads=2)
    fsync_tree(path)  # memmap() does not fsync
    d = time.perf_counter() - t0
    return {"blocked_s": d, "durable_s": d}


def tensordict_load(path: Path, state: Any) -> Any:
    from tensordict import TensorDict

    # load_memmap maps the files; clone() reads every byte into memory.
    return TensorDict.load_memmap(path).clone()


def asyncsave_load(path: Path, state: Any) -> Any:
    return asyncsave.load(path)


SYNC_PEERS: dict[str, tuple[Any, Callable[[Path, Any], Any], str]] = {
    # name: (save, load, suffix of the checkpoint path)
    "torch.save": (torch_save, torch_load, "file"),
    "dcp.save (1 thread)": (dcp_save(1), dcp_load, "dir"),
    "dcp.save (2 threads)": (dcp_save(2), dcp_load, "dir"),
    "safetensors": (safetensors_save, safetensors_load, "file"),
    "tensordict memmap": (tensordict_save, tensordict_load, "dir"),
}
PEER_ORDER = [
    "asyncsave eager",
    "asyncsave lazy",
    "torch.save",
    "dcp.save (1 thread)",
    "dcp.save (2 threads)",
    "dcp.async_save",
    "dcp.async_save + DefaultStager",
    "safetensors",
    "tensordict memmap",
]


# -- one workload ------------------------------------------------------------------------


async def bench_workload(
    name: str,
    state: Any,
    root: Path,
    repeats: int,
    peers: list[str],
    *,
    hb: Heartbeat,
    writer_threads: int,
    loads: bool,
) -> dict[str, Any]:
    """Every peer ``repeats`` times; asyncsave keeps one checkpointer open (steady
    state; its first save is reported apart). Raw write+fsync and raw read of the
    state's bytes are measured ``repeats`` times first."""
    nbytes = nbytes_of(state)
    tensors = list(flat(state).values())
    # The raw limits write host bytes: a CUDA state's are copied to host first
    # (outside the timing).
    host = [t.cpu() if t.is_cuda else t for t in tensors]
    samples: dict[str, list[dict[str, float]]] = {p: [] for p in peers}
    limits: dict[str, list[float]] = {
        "raw_write_fsync_s": [],
        "raw_write_direct_s": [],
        "raw_read_s": [],
    }
    dcp_async = {
        "dcp.async_save": DcpAsync(False),
        "dcp.async_save + DefaultStager": DcpAsync(True),
    }
    first: dict[str, float] = {}
    ck_root = root / "asyncsave"
    step = 0
    root.mkdir(parents=True, exist_ok=True)
    for _ in range(repeats):
        raw = root / "raw.bin"
        limits["raw_write_fsync_s"].append(
            await anyio.to_thread.run_sync(raw_write_fsync, raw, host)
        )
        limits["raw_read_s"].append(await anyio.to_thread.run_sync(raw_read, raw))
        raw.unlink(missing_ok=True)
        limits["raw_write_direct_s"].append(
            await anyio.to_thread.run_sync(raw_write_direct, raw, nbytes)
        )
        raw.unlink(missing_ok=True)
    # Up to 1 GiB the peers are interleaved in every repeat (fair against the disk's
    # drift); above, each peer runs its repeats in turn, so that at most one peer
    # holds memory between saves (asyncsave's arena, the DefaultStager's copy): a
    # 4 GiB state would otherwise need 16 GiB.
    if nbytes <= GiB:
        groups = [peers]
    else:
        groups = [[p for p in peers if p.startswith("asyncsave")]]
        groups += [[p] for p in peers if not p.startswith("asyncsave")]
    for group in groups:
        uses_asyncsave = any(p.startswith("asyncsave") for p in group)
        ctx = (
            asyncsave.Checkpointer(ck_root, writer_threads=writer_threads)
            if uses_asyncsave
            else contextlib.nullcontext(None)
        )
        async with ctx as ckpt:
            rounds = repeats + (1 if uses_asyncsave else 0)
            for r in range(rounds):
                # The warm-up round: asyncsave's first save allocates its staging
                # arena (reported apart); the peers were warmed up on a small state.
                warm = uses_asyncsave and r == 0
                for peer in [p for p in group if p.startswith("asyncsave")] if warm else group:
                    gc.collect()
                    reset_peak_rss()
                    base = rss()
                    if peer.startswith("asyncsave"):
                        assert ckpt is not None
                        step += 1
                        lazy = peer.endswith("lazy")
                        cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
                        if cuda:  # staging must not grow device memory
                            torch.cuda.synchronize()
                            torch.cuda.reset_peak_memory_stats()
                            dev_base = torch.cuda.max_memory_allocated()
                        with hb.measuring():
                            t0 = time.perf_counter()
                            handle = await ckpt.save(step, state, lazy=lazy)
                            blocked = time.perf_counter() - t0
                            await handle.staged()
                            staged = time.perf_counter() - t0
                            info = await handle
                            durable = time.perf_counter() - t0
                        assert info is not None
                        row = {"blocked_s": blocked, "staged_s": staged, "durable_s": durable}
                        row.update(hb.figures())
                        if cuda:
                            torch.cuda.synchronize()
                            row["device_peak_growth_bytes"] = (
                                torch.cuda.max_memory_allocated() - dev_base
                            )
                        pool = ckpt.staging_pool
                        held = pool.capacity if pool is not None else 0
                        path = info.path
                        load_fn: Callable[[Path, Any], Any] = asyncsave_load
                    elif peer in dcp_async:
                        path = root / f"{peer.replace(' ', '_')}-{r}"
                        row = await anyio.to_thread.run_sync(dcp_async[peer].save, state, path)
                        held = nbytes if dcp_async[peer].use_stager else 0
                        load_fn = dcp_load
                    else:
                        save_fn, load_fn, kind = SYNC_PEERS[peer]
                        path = root / f"{peer.replace(' ', '_')}-{r}" / "ckpt"
                        path.parent.mkdir(parents=True)
                        if kind == "dir":
                            path = path.parent / "d"
                        row = await anyio.to_thread.run_sync(save_fn, state, path)
                        held = 0
                    row["peak_rss_extra_bytes"] = max(0, peak_rss() - base) + held
                    # Loads run in the last round only: a load maps ~the state's
                    # size of page cache, and the first save after one blocks longer
                    # (measured: 57 ms heartbeat gap, 1.5x blocked, once), which
                    # would otherwise bias every save sample after the first.
                    if loads and not warm and r == rounds - 1:
                        await anyio.to_thread.run_sync(drop_cache, path)
                        gc.collect()
                        t0 = time.perf_counter()
                        loaded = await anyio.to_thread.run_sync(load_fn, path, state)
                        row["load_s"] = time.perf_counter() - t0
                        del loaded
                    if warm:
                        first[peer] = row["blocked_s"]
                    else:
                        samples[peer].append(row)
                    if peer.startswith("asyncsave"):
                        shutil.rmtree(path)
                    else:
                        target = path.parent if path.name in ("ckpt", "d") else path
                        shutil.rmtree(target, ignore_errors=True)
                        if target.exists():
                            target.unlink()
                    gc.collect()
            for p in group:
                if p in dcp_async:
                    dcp_async[p].close()
    for d in dcp_async.values():
        d.close()
    del host
    shutil.rmtree(ck_root, ignore_errors=True)
    out: dict[str, Any] = {
        "workload": name,
        "nbytes": nbytes,
        "num_tensors": len(tensors),
        "repeats": repeats,
        "raw_write_fsync_s": median(limits["raw_write_fsync_s"]),
        "raw_write_direct_s": median(limits["raw_write_direct_s"]),
        "raw_read_s": median(limits["raw_read_s"]),
        "peers": {},
    }
    for peer, rows in samples.items():
        keys = {k: None for row in rows for k in row}  # load_s: the last round only
        fig = {k: median([row[k] for row in rows if k in row]) for k in keys} if rows else {}
        if fig:
            fig["gbps"] = nbytes / fig["durable_s"] / 1e9
            fig["samples"] = len(rows)
            if peer in first:
                fig["first_blocked_s"] = first[peer]
        out["peers"][peer] = fig
    return out


async def heartbeat_2gib(root: Path, hb: Heartbeat, device: str, saves: int) -> dict[str, Any]:
    """The largest heartbeat gap while a 2 GiB save stages, writes and commits."""
    state = sized_state(2 * GiB, device)
    rows = []
    async with asyncsave.Checkpointer(root) as ckpt:
        for step in range(1, saves + 2):
            with hb.measuring():
                t0 = time.perf_counter()
                handle = await ckpt.save(step, state)
                blocked = time.perf_counter() - t0
                info = await handle
            assert info is not None
            if step > 1:  # the first save allocates the arena
                rows.append({"blocked_s": blocked, **hb.figures()})
            shutil.rmtree(info.path)
    del state
    shutil.rmtree(root, ignore_errors=True)
    return {
        "nbytes": 2 * GiB,
        "saves": rows,
        "hb_max_ms": max(r["hb_max_ms"] for r in rows),
        "hb_p99_ms": max(r["hb_p99_ms"] for r in rows),
    }


async def budget_sweep(root: Path, nbytes: int, device: str) -> dict[str, Any]:
    """A state larger than ``budget_bytes`` streams through it. For budgets of
    1/8, 1/4 and 1/2 of the state and none: eager and lazy ``save()`` blocking
    time, lazy time to staged, and time to durable."""
    state = sized_state(nbytes, device)
    rows = []
    for frac in (8, 4, 2, None):
        budget = None if frac is None else nbytes // frac
        for lazy in (False, True):
            async with asyncsave.Checkpointer(root, budget_bytes=budget) as ckpt:
                await (await ckpt.save(1, state))  # sizes (or fills) the arena
                shutil.rmtree(root / "step_1")
                t0 = time.perf_counter()
                handle = await ckpt.save(2, state, lazy=lazy)
                blocked = time.perf_counter() - t0
                await handle.staged()
                staged = time.perf_counter() - t0
                info = await handle
                durable = time.perf_counter() - t0
                assert info is not None
                pool = ckpt.staging_pool
                arena = pool.capacity if pool is not None else 0
            shutil.rmtree(root, ignore_errors=True)
            rows.append(
                {
                    "budget_bytes": budget,
                    "lazy": lazy,
                    "blocked_s": blocked,
                    "staged_s": staged,
                    "durable_s": durable,
                    "arena_bytes": arena,
                }
            )
            print(
                f"budget {'none' if budget is None else fmt_bytes(budget)} "
                f"{'lazy ' if lazy else 'eager'}: blocked {fmt_s(blocked)}, staged "
                f"{fmt_s(staged)}, durable {fmt_s(durable)}, arena {fmt_bytes(arena)}",
                flush=True,
            )
    del state
    return {"state_bytes": nbytes, "rows": rows}


async def rss_over_saves(root: Path, nbytes: int, saves: int, device: str) -> dict[str, Any]:
    """RSS after the first save (committed) against after ``saves`` saves."""
    state = sized_state(nbytes, device)
    async with asyncsave.Checkpointer(root) as ckpt:
        after: list[int] = []
        for step in range(1, saves + 1):
            info = await (await ckpt.save(step, state))
            assert info is not None
            shutil.rmtree(info.path)
            if step == 1:
                gc.collect()
                after.append(rss())
        gc.collect()
        after.append(rss())
        pool = ckpt.staging_pool
        allocations = pool.allocations if pool is not None else -1
    shutil.rmtree(root, ignore_errors=True)
    return {
        "state_bytes": nbytes,
        "saves": saves,
        "rss_after_first": after[0],
        "rss_after_last": after[1],
        "ratio": after[1] / after[0],
        "arena_allocations": allocations,
    }


# -- the run -------------------------------------------------------------------------------


async def run(args: argparse.Namespace) -> dict[str, Any]:
    t_start = time.perf_counter()
    root = args.dir
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    device = args.device
    quick = args.quick
    # --quick: one repeat of every figure (a smoke run that fits in 3 minutes on
    # 2 shared cores); the full run takes medians of 3.
    repeats = args.repeats or (1 if quick else 3)
    sweep = [64 * MiB, 256 * MiB] if quick else [64 * MiB, 256 * MiB, GiB, 2 * GiB, 4 * GiB]
    if args.sizes:
        sweep = [int(float(s) * MiB) for s in args.sizes.split(",")]
    peers = list(PEER_ORDER)
    if args.peers:
        peers = [p for p in PEER_ORDER if any(s in p for s in args.peers.split(","))]
    # A GPU image may lack a peer's library: that peer is skipped, and the JSON says so.
    missing = {m for m in ("safetensors", "tensordict") if importlib.util.find_spec(m) is None}
    skipped = [p for p in peers if p.split()[0] in missing]
    peers = [p for p in peers if p not in skipped]
    result: dict[str, Any] = {
        "harness": "bench/harness.py",
        "mode": "quick" if quick else "full",
        "argv": sys.argv[1:],
        "machine": {
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "python": platform.python_version(),
            "torch": torch.__version__,
            "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
        },
        "cold_read_method": "posix_fadvise(POSIX_FADV_DONTNEED) per file after fsync",
        "peak_rss_method": (
            "VmHWM reset via /proc/self/clear_refs before each save, minus VmRSS before it, "
            "plus memory the peer keeps between saves (asyncsave's staging arena, the "
            "DefaultStager's cached host copy)"
        ),
        "repeats": repeats,
        "skipped_peers": {p: "library not installed" for p in skipped},
        "workloads": [],
    }
    hb = Heartbeat()
    async with anyio.create_task_group() as tg:
        tg.start_soon(hb.run)
        result["memcpy_gbps"] = await anyio.to_thread.run_sync(memcpy_gbps, GiB, 5)
        print(f"memcpy into a reused buffer: {result['memcpy_gbps']:.2f} GB/s", flush=True)
        if device == "cuda":
            result["pinned_d2h_gbps"] = pinned_d2h_gbps(GiB)
            print(f"pinned D2H: {result['pinned_d2h_gbps']:.1f} GB/s", flush=True)

        # Imports, thread pools and first-call costs of every peer, on 1 MiB.
        await bench_workload(
            "warm-up",
            sized_state(MiB, device),
            root / "warm",
            1,
            peers,
            hb=hb,
            writer_threads=args.writer_threads,
            loads=True,
        )
        workloads: list[tuple[str, Callable[[], Any]]] = []
        if not args.skip_gpt2:
            workloads.append(("gpt2-small + AdamW", lambda: gpt2_small_state(device)))
        workloads.append(("replay buffer 10k tensors", lambda: replay_buffer(device)))
        for size in sweep:
            workloads.append(
                (f"sweep {size // MiB} MiB", lambda size=size: sized_state(size, device))
            )
        for wname, make in workloads:
            t0 = time.perf_counter()
            state = make()
            reps = repeats
            if wname.startswith("sweep") and nbytes_of(state) > 2 * GiB:
                reps = min(repeats, 2)
            row = await bench_workload(
                wname,
                state,
                root / "w",
                reps,
                peers,
                hb=hb,
                writer_threads=args.writer_threads,
                loads=True,
            )
            del state
            gc.collect()
            row["wall_s"] = time.perf_counter() - t0
            result["workloads"].append(row)
            print_workload(row, result)
            save_json(result, args.out)

        if not args.skip_s14:
            result["s14_heartbeat_2gib"] = await heartbeat_2gib(
                root / "s14", hb, device, 1 if quick else 3
            )
            s = result["s14_heartbeat_2gib"]
            print(
                f"2 GiB save: heartbeat max gap {s['hb_max_ms']:.1f} ms, p99 {s['hb_p99_ms']:.2f} ms"
            )
        many = args.many_tensors or ("1000,10000" if quick else "1000,10000,100000")
        if many != "none":
            import many_tensors  # bench/many_tensors.py: the many-tensor rows and figure

            counts = [int(c) for c in many.split(",")]
            result["many_tensors"] = await many_tensors.bench(
                counts, root / "many", repeats, hb, device
            )
            many_tensors.write_results(result["many_tensors"], args.out)
        result["s9_rss"] = await rss_over_saves(
            root / "s9", (16 if quick else 64) * MiB, 50 if quick else 200, device
        )
        s9 = result["s9_rss"]
        print(f"RSS after {s9['saves']} saves / after the first: {s9['ratio']:.4f}")
        result["s15_budget"] = await budget_sweep(
            root / "s15", (256 if quick else 1024) * MiB, device
        )
        tg.cancel_scope.cancel()
    shutil.rmtree(root, ignore_errors=True)
    result["wall_s"] = time.perf_counter() - t_start
    result["targets"] = targets(result)
    return result


# -- targets, tables, plot -------------------------------------------------------------------


def raw_write_limit(w: dict[str, Any]) -> float:
    """The faster of buffered and O_DIRECT raw write + fsync of the same bytes."""
    times = [w["raw_write_fsync_s"], w.get("raw_write_direct_s", float("nan"))]
    return min(t for t in times if t == t)


def _workload(result: dict[str, Any], name: str) -> dict[str, Any] | None:
    for w in result["workloads"]:
        if w["workload"] == name:
            return w
    return None


def targets(result: dict[str, Any]) -> list[dict[str, Any]]:
    """Every target of the harness with its measured value (ratios from this run)."""
    rows: list[dict[str, Any]] = []

    def add(figure: str, target: str, value: float, limit: float, detail: str) -> None:
        rows.append(
            {
                "figure": figure,
                "target": target,
                "measured": value,
                "limit": limit,
                "met": bool(value <= limit),
                "detail": detail,
            }
        )

    g = _workload(result, "gpt2-small + AdamW")
    bw = result["memcpy_gbps"] * 1e9
    if g is not None:
        p = g["peers"]
        n = g["nbytes"]
        eager, lazy = p.get("asyncsave eager"), p.get("asyncsave lazy")
        if eager:
            bound = n / bw
            add(
                "eager save() blocking, 1.5 GB",
                "<= 1.2 x state/memcpy",
                eager["blocked_s"] / bound,
                1.2,
                f"{eager['blocked_s'] * 1e3:.0f} ms vs memcpy bound {bound * 1e3:.0f} ms",
            )
            add(
                "time to durable, 1.5 GB",
                "<= 1.15 x raw write+fsync (faster of buffered, O_DIRECT)",
                eager["durable_s"] / raw_write_limit(g),
                1.15,
                f"{eager['durable_s']:.2f} s vs raw {raw_write_limit(g):.2f} s",
            )
            if "load_s" in eager:
                add(
                    "load of the 1.5 GB state",
                    "<= 1.15 x raw read",
                    eager["load_s"] / g["raw_read_s"],
                    1.15,
                    f"{eager['load_s']:.2f} s vs raw read {g['raw_read_s']:.2f} s",
                )
        if eager and lazy:
            add(
                "lazy save() blocking",
                "<= 0.1 x eager",
                lazy["blocked_s"] / eager["blocked_s"],
                0.1,
                f"{lazy['blocked_s'] * 1e3:.1f} ms vs eager {eager['blocked_s'] * 1e3:.0f} ms",
            )
        stg = p.get("dcp.async_save + DefaultStager")
        if lazy and stg:
            add(
                "lazy blocking vs DCP async_save + DefaultStager blocking",
                "< 1",
                lazy["blocked_s"] / stg["blocked_s"],
                1.0,
                f"{lazy['blocked_s'] * 1e3:.1f} ms vs {stg['blocked_s'] * 1e3:.1f} ms",
            )
        if eager and stg and "staged_s" in stg:
            add(
                "eager blocking vs DefaultStager staged time",
                "< 1",
                eager["blocked_s"] / stg["staged_s"],
                1.0,
                f"{eager['blocked_s'] * 1e3:.0f} ms vs {stg['staged_s'] * 1e3:.0f} ms",
            )
        if eager:
            others = [
                k
                for k in (
                    "torch.save",
                    "dcp.save (1 thread)",
                    "dcp.save (2 threads)",
                    "dcp.async_save",
                )
                if p.get(k)
            ]
            if others:
                best = min(others, key=lambda k: p[k]["durable_s"])
                add(
                    "time to durable vs torch.save, dcp.save (1, 2 threads), async_save",
                    "< 1 x the fastest of them",
                    eager["durable_s"] / p[best]["durable_s"],
                    1.0,
                    f"{eager['durable_s']:.2f} s vs {best} {p[best]['durable_s']:.2f} s",
                )
    rb = _workload(result, "replay buffer 10k tensors")
    if rb is not None and rb["peers"].get("asyncsave eager"):
        e = rb["peers"]["asyncsave eager"]
        add(
            "time to durable, 10,000-tensor replay buffer",
            "<= 1.25 x raw",
            e["durable_s"] / raw_write_limit(rb),
            1.25,
            f"{e['durable_s'] * 1e3:.0f} ms vs raw {raw_write_limit(rb) * 1e3:.0f} ms",
        )
    s14 = result.get("s14_heartbeat_2gib")
    if s14:
        add(
            "largest heartbeat gap, 2 GiB save",
            "<= 10 ms",
            s14["hb_max_ms"],
            10.0,
            f"p99 {s14['hb_p99_ms']:.2f} ms (target <= 2 ms)",
        )
        add("p99 heartbeat gap, 2 GiB save", "<= 2 ms", s14["hb_p99_ms"], 2.0, "")
    s9 = result.get("s9_rss")
    if s9:
        add(
            f"RSS after {s9['saves']} saves vs after the first",
            "within 5 %",
            abs(s9["ratio"] - 1.0) * 100,
            5.0,
            f"ratio {s9['ratio']:.4f}, {s9['arena_allocations']} arena allocation(s)",
        )
    return rows


def fmt_s(x: float | None) -> str:
    if x is None or x != x:
        return "-"
    return f"{x * 1e3:.0f} ms" if x < 10 else f"{x:.1f} s"


def fmt_bytes(n: float) -> str:
    return f"{n / GiB:.2f} GiB" if n >= GiB else f"{n / MiB:.0f} MiB"


def markdown(result: dict[str, Any]) -> str:
    lines = [
        f"asyncsave harness, {result['mode']} run, {result['machine']['cpus']} CPUs, "
        f"device {result['machine']['device']}, torch {result['machine']['torch']}; "
        f"medians of {result['repeats']}; wall time {result.get('wall_s', float('nan')):.0f} s.",
        "",
        f"Limits: host memcpy {result['memcpy_gbps']:.2f} GB/s"
        + (
            f", pinned D2H {result['pinned_d2h_gbps']:.1f} GB/s"
            if "pinned_d2h_gbps" in result
            else ""
        )
        + ". Cold reads: "
        + result["cold_read_method"]
        + ".",
        "",
    ]
    for w in result["workloads"]:
        n = w["nbytes"]
        lines += [
            f"### {w['workload']}: {fmt_bytes(n)}, {w['num_tensors']} tensors",
            "",
            f"raw write+fsync {fmt_s(w['raw_write_fsync_s'])} "
            f"({n / w['raw_write_fsync_s'] / 1e9:.2f} GB/s), with O_DIRECT "
            f"{fmt_s(w.get('raw_write_direct_s'))}, raw read {fmt_s(w['raw_read_s'])}, "
            f"memcpy bound {fmt_s(n / (result['memcpy_gbps'] * 1e9))}",
            "",
            "| peer | blocked | staged | durable | GB/s | peak RSS + | load | heartbeat max / p99 |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for peer in PEER_ORDER:
            f = w["peers"].get(peer)
            if not f:
                continue
            hbm = f"{f['hb_max_ms']:.1f} / {f['hb_p99_ms']:.1f} ms" if "hb_max_ms" in f else "-"
            lines.append(
                f"| {peer} | {fmt_s(f['blocked_s'])} | {fmt_s(f.get('staged_s'))} | "
                f"{fmt_s(f['durable_s'])} | {f['gbps']:.2f} | "
                f"{fmt_bytes(f['peak_rss_extra_bytes'])} | {fmt_s(f.get('load_s'))} | {hbm} |"
            )
        lines.append("")
    s15 = result.get("s15_budget")
    if s15:
        lines += [
            f"### Budget sweep: a {fmt_bytes(s15['state_bytes'])} state through a smaller budget",
            "",
            "| budget | mode | save() blocked | staged | durable | arena |",
            "|---|---|---|---|---|---|",
        ]
        for r in s15["rows"]:
            b = "none (state-sized)" if r["budget_bytes"] is None else fmt_bytes(r["budget_bytes"])
            lines.append(
                f"| {b} | {'lazy' if r['lazy'] else 'eager'} | {fmt_s(r['blocked_s'])} | "
                f"{fmt_s(r['staged_s'])} | {fmt_s(r['durable_s'])} | {fmt_bytes(r['arena_bytes'])} |"
            )
        lines.append("")
    lines += ["### Targets", "", *targets_table(result), ""]
    return "\n".join(lines)


def targets_table(result: dict[str, Any]) -> list[str]:
    out = ["| figure | target | measured | met | detail |", "|---|---|---|---|---|"]
    for t in result.get("targets", []):
        out.append(
            f"| {t['figure']} | {t['target']} | {t['measured']:.3g} | "
            f"{'yes' if t['met'] else 'no'} | {t['detail']} |"
        )
    return out


def readme_table(result: dict[str, Any]) -> str:
    """The README's headline: the GPT-2 workload's peers, and every target."""
    g = _workload(result, "gpt2-small + AdamW")
    lines = [
        f"Generated by `python bench/harness.py --render-readme` from "
        f"`bench/results/harness.json` ({result['mode']} run, "
        f"{result['machine']['cpus']} CPUs, {result['machine']['device']}, medians of "
        f"{result['repeats']}, run took {result.get('wall_s', 0):.0f} s). Host memcpy "
        f"{result['memcpy_gbps']:.2f} GB/s.",
        "",
    ]
    if g is not None:
        n = g["nbytes"]
        lines += [
            f"GPT-2 small + AdamW state, {n / 1e9:.2f} GB, {g['num_tensors']} tensors; "
            f"raw write+fsync {g['raw_write_fsync_s']:.2f} s (O_DIRECT "
            f"{g.get('raw_write_direct_s', float('nan')):.2f} s), raw cold read "
            f"{g['raw_read_s']:.2f} s:",
            "",
            "| peer | blocked | durable | GB/s | peak RSS + | cold load |",
            "|---|---|---|---|---|---|",
        ]
        for peer in PEER_ORDER:
            f = g["peers"].get(peer)
            if f:
                lines.append(
                    f"| {peer} | {fmt_s(f['blocked_s'])} | {fmt_s(f['durable_s'])} | "
                    f"{f['gbps']:.2f} | {fmt_bytes(f['peak_rss_extra_bytes'])} | "
                    f"{fmt_s(f.get('load_s'))} |"
                )
        lines.append("")
    lines += targets_table(result)
    return "\n".join(lines)


BEGIN, END = "<!-- harness:begin -->", "<!-- harness:end -->"


def render_readme(json_path: Path, readme: Path = README) -> None:
    result = json.loads(json_path.read_text())
    text = readme.read_text()
    if BEGIN not in text or END not in text:
        raise SystemExit(f"{readme} has no {BEGIN} ... {END} section")
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    readme.write_text(head + BEGIN + "\n" + readme_table(result) + "\n" + END + tail)
    print(f"rendered the harness table into {readme}")


def plot(result: dict[str, Any], path: Path) -> None:
    if importlib.util.find_spec("matplotlib") is None:
        print("matplotlib is not installed: no plot")
        return
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sweep = sorted(
        (w for w in result["workloads"] if w["workload"].startswith("sweep")),
        key=lambda w: w["nbytes"],
    )
    if not sweep:
        return
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 5))
    xs = [w["nbytes"] / GiB for w in sweep]
    for peer in PEER_ORDER:
        ys = [w["peers"].get(peer, {}).get("blocked_s") for w in sweep]
        gs = [w["peers"].get(peer, {}).get("gbps") for w in sweep]
        if all(y is None for y in ys):
            continue
        style = "-o" if peer.startswith("asyncsave") else "--."
        ax1.plot(xs, ys, style, label=peer)
        ax2.plot(xs, gs, style, label=peer)
    ax1.plot(
        xs, [w["nbytes"] / (result["memcpy_gbps"] * 1e9) for w in sweep], "k:", label="memcpy bound"
    )
    ax2.plot(
        xs,
        [w["nbytes"] / raw_write_limit(w) / 1e9 for w in sweep],
        "k:",
        label="raw write+fsync",
    )
    ax1.set(
        xscale="log", yscale="log", xlabel="state size (GiB)", ylabel="save() blocking time (s)"
    )
    ax2.set(xscale="log", xlabel="state size (GiB)", ylabel="GB/s to durable")
    ax1.set_title("time the caller is blocked")
    ax2.set_title("throughput to durable")
    ax1.grid(True, which="both", alpha=0.3)
    ax2.grid(True, which="both", alpha=0.3)
    ax2.legend(fontsize=7)
    fig.suptitle(
        f"asyncsave vs peers ({result['mode']} run, {result['machine']['device']}, "
        f"{result['machine']['cpus']} CPUs)"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def print_workload(w: dict[str, Any], result: dict[str, Any]) -> None:
    print(f"\n{w['workload']}: {fmt_bytes(w['nbytes'])} ({w['wall_s']:.0f} s)", flush=True)
    print(
        f"  raw write+fsync {fmt_s(w['raw_write_fsync_s'])} (O_DIRECT "
        f"{fmt_s(w.get('raw_write_direct_s'))}), raw read {fmt_s(w['raw_read_s'])}",
        flush=True,
    )
    for peer in PEER_ORDER:
        f = w["peers"].get(peer)
        if f:
            print(
                f"  {peer:32s} blocked {fmt_s(f['blocked_s']):>8s}  durable "
                f"{fmt_s(f['durable_s']):>8s}  {f['gbps']:.2f} GB/s  load {fmt_s(f.get('load_s'))}",
                flush=True,
            )


def save_json(result: dict[str, Any], out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "harness.json").write_text(json.dumps(result, indent=1))


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--quick", action="store_true", help="small sweep; under 3 minutes here")
    p.add_argument("--repeats", type=int, default=0, help="repeats per figure (default 3)")
    p.add_argument("--sizes", help="sweep sizes in MiB, comma-separated (overrides the default)")
    p.add_argument("--peers", help="only peers whose name contains one of these (comma-separated)")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--writer-threads", type=int, default=2)
    p.add_argument("--skip-gpt2", action="store_true")
    p.add_argument("--skip-s14", action="store_true")
    p.add_argument(
        "--many-tensors",
        default=None,
        help="tensor counts of the many-tensor rows (bench/many_tensors.py), comma-separated; "
        "default 1000,10000,100000 (quick: 1000,10000); 'none' skips them",
    )
    p.add_argument("--dir", type=Path, default=Path("/tmp/asyncsave-harness"))
    p.add_argument(
        "--out",
        type=Path,
        default=None,
        help="results folder (default: bench/results, or bench/results/quick with --quick, "
        "so a quick run never replaces the full run the benchmarks page shows)",
    )
    p.add_argument("--render-readme", action="store_true", help="only rewrite the table of docs/guides/benchmarks.md")
    args = p.parse_args(argv)
    if args.out is None:
        args.out = RESULTS / "quick" if args.quick and not args.render_readme else RESULTS
    args.out.mkdir(parents=True, exist_ok=True)
    # The peers' deprecation chatter (DCP, TensorDict) is not a result.
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", category=UserWarning)
    if args.render_readme:
        render_readme(args.out / "harness.json")
        return
    result = anyio.run(run, args)
    save_json(result, args.out)
    (args.out / "harness.md").write_text(markdown(result))
    plot(result, args.out / "harness.png")
    print("\n" + "\n".join(targets_table(result)))
    print(f"\nwrote {args.out}/harness.json, harness.md, harness.png in {result['wall_s']:.0f} s")


if __name__ == "__main__":
    main()
