"""Many-tensor states: cost against the number of tensors.

States of 1,000 / 10,000 / 100,000 tensors of 256 B..64 KiB (float32 and
bfloat16, the same sizes in the same proportions at every count, so the bytes per
tensor are equal), flat keys ``experts.{i}.w{j}``, as a MoE model's experts or a
replay buffer lay them out. For each count, in one run, medians of ``--repeats``:

- ``foreach_copy_s``: one ``torch._foreach_copy_`` of every tensor into
  preallocated, already touched tensors (the floor of a snapshot: the reference
  of the eager target);
- ``copy_loop_s``: a Python loop of ``copy_`` into the same tensors (one Python
  call per tensor);
- ``eager_blocked_s`` / ``eager_durable_s`` / ``hb_max_ms``: asyncsave's eager
  ``save()`` on one checkpointer (a second save of the same structure: the plan
  is reused), the time until it is durable, and the largest gap of a 1 ms
  heartbeat task from the call until durable (``first_*``: the first save, which
  plans);
- ``lazy_blocked_s``: a lazy ``save()`` (another checkpointer, steady state);
- ``safetensors_durable_s``: ``safetensors.torch.save_file`` + fsync;
- ``raw_write_fsync_s``: the same bytes, concatenated beforehand, written in 8 MiB
  writes and fsynced (the disk's limit for these bytes);
- ``load_s`` / ``safetensors_load_s``: cold (pages dropped) verified
  ``asyncsave.load`` against ``safetensors.torch.load_file``;
- ``stateful_*``: the same count through the ``Stateful`` path: a model of
  ``n / 16`` experts (4 parameters each, float32, 8..1,024 elements) and its ``torch.optim.AdamW`` (``step``, ``exp_avg``, ``exp_avg_sq``
  per parameter: 4 tensors per parameter in all), passed as objects, so each
  save calls their ``state_dict()``: eager ``save()`` blocked, the largest
  heartbeat gap, and one ``_foreach_copy_`` of the same tensors.

Run alone (``python bench/many_tensors.py --counts 1000,10000``) or from
``bench/harness.py`` (``--many-tensors``). Writes ``bench/results/many_tensors.json``,
``.md`` and ``many_tensors.png`` (log-log: each time against the count).
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
import anyio.to_thread
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import CHUNK, Heartbeat, drop_cache, fsync_tree

import asyncsave

RESULTS = Path(__file__).resolve().parent / "results"
# Element counts of the tensors, cycled: 256 B .. 64 KiB for float32 (half that
# for bfloat16); a period of 18 (9 sizes x 2 dtypes) keeps every count's mix equal.
_NUMELS = [64 << k for k in range(9)]  # 64 .. 16,384 elements


def moe_state(n: int) -> dict[str, torch.Tensor]:
    """``n`` tensors ``experts.{i}.w{j}`` (4 per expert), float32 and bfloat16,
    256 B..64 KiB, random values."""
    g = torch.Generator().manual_seed(n)
    out: dict[str, torch.Tensor] = {}
    for i in range(n):
        numel = _NUMELS[i % len(_NUMELS)]
        dtype = torch.float32 if (i // len(_NUMELS)) % 2 == 0 else torch.bfloat16
        out[f"experts.{i // 4}.w{i % 4}"] = torch.randn(numel, generator=g).to(dtype)
    return out


class _Expert(torch.nn.Module):
    def __init__(self, i: int) -> None:
        super().__init__()
        a, b = 8 << (i % 3), 8 << ((i + 1) % 3)  # 8..32
        self.w1 = torch.nn.Parameter(torch.randn(a, b))
        self.w2 = torch.nn.Parameter(torch.randn(b, a))
        self.b1 = torch.nn.Parameter(torch.randn(a))
        self.b2 = torch.nn.Parameter(torch.randn(b))


def stateful_state(n: int) -> dict[str, Any]:
    """A MoE-like model of ``n // 16`` experts and its AdamW after one step:
    ``n`` tensors in their state dicts (parameters, steps and two moments)."""
    torch.manual_seed(n)
    model = torch.nn.ModuleList(_Expert(i) for i in range(max(1, n // 16)))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    opt.step()
    return {"model": model, "optim": opt}


def _stateful_tensors(state: dict[str, Any]) -> list[torch.Tensor]:
    model, opt = state["model"], state["optim"]
    moments = [t for s in opt.state_dict()["state"].values() for t in s.values()]
    return list(model.state_dict().values()) + moments


def _median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def _foreach_copy(state: dict[str, torch.Tensor], dst: list[torch.Tensor]) -> float:
    srcs = list(state.values())
    t0 = time.perf_counter()
    torch._foreach_copy_(dst, srcs)
    if torch.cuda.is_initialized():
        torch.cuda.synchronize()
    return time.perf_counter() - t0


def _copy_loop(state: dict[str, torch.Tensor], dst: list[torch.Tensor]) -> float:
    t0 = time.perf_counter()
    for d, s in zip(dst, state.values(), strict=True):
        d.copy_(s)
    if torch.cuda.is_initialized():
        torch.cuda.synchronize()
    return time.perf_counter() - t0


def _raw_write_fsync(path: Path, data: torch.Tensor) -> float:
    view = memoryview(data.numpy())  # type: ignore[arg-type]
    t0 = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        for pos in range(0, len(view), CHUNK):
            os.write(fd, view[pos : pos + CHUNK])
        os.fsync(fd)
    finally:
        os.close(fd)
    return time.perf_counter() - t0


def _safetensors_save(state: dict[str, torch.Tensor], path: Path) -> float:
    from safetensors.torch import save_file

    t0 = time.perf_counter()
    save_file(state, str(path))
    fsync_tree(path)
    return time.perf_counter() - t0


def _timed(func: Any, *args: Any) -> float:
    t0 = time.perf_counter()
    func(*args)
    return time.perf_counter() - t0


async def _save(
    ckpt: asyncsave.Checkpointer, step: int, state: Any, hb: Heartbeat, *, lazy: bool
) -> dict[str, float]:
    with hb.measuring():
        t0 = time.perf_counter()
        handle = await ckpt.save(step, state, lazy=lazy)
        blocked = time.perf_counter() - t0
        await handle
        durable = time.perf_counter() - t0
    return {"blocked_s": blocked, "durable_s": durable, **hb.figures()}


async def bench_count(
    n: int, root: Path, repeats: int, hb: Heartbeat, device: str = "cpu"
) -> dict[str, Any]:
    """Every figure of the module docstring for a state of ``n`` tensors on
    ``device`` (CUDA: the ``copy_`` loop copies to preallocated host tensors)."""
    from safetensors.torch import load_file

    host = moe_state(n)
    state = host if device == "cpu" else {k: v.to(device) for k, v in host.items()}
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    dst = [torch.empty_like(t, device="cpu") for t in state.values()]
    _copy_loop(state, dst)  # fault the destinations in
    flat_bytes = torch.cat([t.view(-1).view(torch.uint8) for t in host.values()])
    del host
    root.mkdir(parents=True, exist_ok=True)
    samples: dict[str, list[float]] = {}

    def add(name: str, value: float) -> None:
        samples.setdefault(name, []).append(value)

    first: dict[str, float] = {}
    eager_root, lazy_root = root / "eager", root / "lazy"
    async with (
        asyncsave.Checkpointer(eager_root) as eager,
        asyncsave.Checkpointer(lazy_root) as lazy,
    ):
        f = await _save(eager, 1, state, hb, lazy=False)
        first = {f"first_{k}": v for k, v in f.items()}
        await _save(lazy, 1, state, hb, lazy=True)
        for r in range(repeats):
            step = r + 2
            add("copy_loop_s", await anyio.to_thread.run_sync(_copy_loop, state, dst))
            add("foreach_copy_s", await anyio.to_thread.run_sync(_foreach_copy, state, dst))
            s = await _save(eager, step, state, hb, lazy=False)
            add("eager_blocked_s", s["blocked_s"])
            add("eager_durable_s", s["durable_s"])
            add("hb_max_ms", s["hb_max_ms"])
            add("hb_p99_ms", s["hb_p99_ms"])
            s = await _save(lazy, step, state, hb, lazy=True)
            add("lazy_blocked_s", s["blocked_s"])
            st_path = root / "st.safetensors"
            add(
                "safetensors_durable_s",
                await anyio.to_thread.run_sync(_safetensors_save, state, st_path),
            )
            add(
                "raw_write_fsync_s",
                await anyio.to_thread.run_sync(_raw_write_fsync, root / "raw.bin", flat_bytes),
            )
            ck = eager_root / f"step_{step}"
            drop_cache(ck)
            add("load_s", await anyio.to_thread.run_sync(_timed, asyncsave.load, ck))
            drop_cache(st_path)
            add(
                "safetensors_load_s",
                await anyio.to_thread.run_sync(_timed, load_file, str(st_path)),
            )
            st_path.unlink()
            (root / "raw.bin").unlink()
        del state, dst
        row_stateful = await _bench_stateful(n, root / "stateful", repeats, hb)
    shutil.rmtree(root, ignore_errors=True)
    row: dict[str, Any] = {
        "num_tensors": n,
        "nbytes": nbytes,
        "repeats": repeats,
        "load_avg_1min": os.getloadavg()[0],  # other jobs on the machine
        **first,
    }
    row.update({k: _median(v) for k, v in samples.items()})
    row.update(row_stateful)
    return row


async def _bench_stateful(n: int, root: Path, repeats: int, hb: Heartbeat) -> dict[str, Any]:
    """The ``stateful_*`` figures (see the module docstring)."""
    state = stateful_state(n)
    src = _stateful_tensors(state)
    dst = [torch.empty_like(t) for t in src]
    torch._foreach_copy_(dst, src)  # touched
    samples: dict[str, list[float]] = {}
    async with asyncsave.Checkpointer(root) as ckpt:
        await _save(ckpt, 1, state, hb, lazy=False)
        for r in range(repeats):
            t0 = time.perf_counter()
            await anyio.to_thread.run_sync(torch._foreach_copy_, dst, src)
            samples.setdefault("stateful_foreach_copy_s", []).append(time.perf_counter() - t0)
            s = await _save(ckpt, r + 2, state, hb, lazy=False)
            samples.setdefault("stateful_blocked_s", []).append(s["blocked_s"])
            samples.setdefault("stateful_hb_max_ms", []).append(s["hb_max_ms"])
    shutil.rmtree(root, ignore_errors=True)
    out: dict[str, Any] = {"stateful_tensors": len(src)}
    out.update({k: _median(v) for k, v in samples.items()})
    return out


def targets(row: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The many-tensor targets for one count: value, limit, met."""

    def t(value: float, limit: float) -> dict[str, Any]:
        return {"value": value, "limit": limit, "met": bool(value <= limit)}

    return {
        "eager blocked <= 1.2 x foreach_copy_ + 10 ms": t(
            row["eager_blocked_s"], 1.2 * row["foreach_copy_s"] + 0.010
        ),
        "largest heartbeat gap <= 10 ms": t(row["hb_max_ms"], 10.0),
        "lazy blocked <= 0.1 x eager blocked": t(
            row["lazy_blocked_s"], 0.1 * row["eager_blocked_s"]
        ),
        "durable <= 0.5 x safetensors + fsync": t(
            row["eager_durable_s"], 0.5 * row["safetensors_durable_s"]
        ),
        "cold verified load <= safetensors.load_file": t(row["load_s"], row["safetensors_load_s"]),
        "Stateful model + AdamW: eager blocked <= 1.2 x foreach_copy_ + 10 ms": t(
            row["stateful_blocked_s"], 1.2 * row["stateful_foreach_copy_s"] + 0.010
        ),
        "Stateful model + AdamW: largest heartbeat gap <= 10 ms": t(
            row["stateful_hb_max_ms"], 10.0
        ),
    }


def markdown(result: dict[str, Any]) -> str:
    cols = [
        ("foreach_copy_", "foreach_copy_s"),
        ("copy_ loop", "copy_loop_s"),
        ("eager blocked", "eager_blocked_s"),
        ("first eager blocked", "first_blocked_s"),
        ("heartbeat max (ms)", "hb_max_ms"),
        ("durable", "eager_durable_s"),
        ("safetensors+fsync", "safetensors_durable_s"),
        ("raw write+fsync", "raw_write_fsync_s"),
        ("load (cold, verified)", "load_s"),
        ("safetensors load", "safetensors_load_s"),
        ("lazy blocked", "lazy_blocked_s"),
        ("Stateful: foreach_copy_", "stateful_foreach_copy_s"),
        ("Stateful: eager blocked", "stateful_blocked_s"),
        ("Stateful: heartbeat max (ms)", "stateful_hb_max_ms"),
    ]
    loads = ", ".join(f"{r.get('load_avg_1min', float('nan')):.1f}" for r in result["rows"])
    lines = [
        f"Many-tensor states ({result['machine']}, medians of {result['repeats']}; times in ms;",
        f"1-minute load average after each row: {loads}):",
        "",
        "| tensors | MiB | " + " | ".join(c for c, _ in cols) + " |",
        "|" + "---|" * (len(cols) + 2),
    ]
    for row in result["rows"]:
        vals = []
        for _, k in cols:
            v = row.get(k, float("nan"))
            vals.append(f"{v:.1f}" if k.endswith("_ms") else f"{v * 1e3:.1f}")
        lines.append(
            f"| {row['num_tensors']:,} | {row['nbytes'] / (1 << 20):.0f} | "
            + " | ".join(vals)
            + " |"
        )
    lines += ["", "| tensors | target | value | limit | met |", "|---|---|---|---|---|"]
    for row in result["rows"]:
        for name, t in row["targets"].items():
            unit = 1.0 if "heartbeat" in name else 1e3
            lines.append(
                f"| {row['num_tensors']:,} | {name} | {t['value'] * unit:.1f} ms | "
                f"{t['limit'] * unit:.1f} ms | {'yes' if t['met'] else 'NO'} |"
            )
    return "\n".join(lines) + "\n"


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    xs = [r["num_tensors"] for r in rows]
    fig, ax = plt.subplots(figsize=(8, 5.5))
    series = [
        ("asyncsave eager save() blocked", "eager_blocked_s", "o-"),
        ("asyncsave time to durable", "eager_durable_s", "s-"),
        ("asyncsave lazy save() blocked", "lazy_blocked_s", "^-"),
        ("asyncsave cold verified load", "load_s", "D-"),
        ("foreach_copy_ (floor)", "foreach_copy_s", "o--"),
        ("copy_ loop (peer)", "copy_loop_s", "x--"),
        ("safetensors save + fsync (peer)", "safetensors_durable_s", "s--"),
        ("safetensors load_file (peer)", "safetensors_load_s", "D--"),
        ("raw write + fsync (limit)", "raw_write_fsync_s", "k:"),
    ]
    for label, key, style in series:
        ax.loglog(xs, [r[key] * 1e3 for r in rows], style, label=label)
    ax.loglog(xs, [r["hb_max_ms"] for r in rows], "x-", label="largest heartbeat gap (ms)")
    ax.set_xlabel("number of tensors (same bytes per tensor)")
    ax.set_ylabel("ms")
    ax.set_title("Cost vs number of tensors")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


async def bench(
    counts: list[int], root: Path, repeats: int, hb: Heartbeat, device: str = "cpu"
) -> dict[str, Any]:
    """Rows for every count (the heartbeat task ``hb`` must be running)."""
    where = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    result: dict[str, Any] = {
        "bench": "bench/many_tensors.py",
        "machine": f"{os.cpu_count()} CPUs, torch {torch.__version__}, state on {where}",
        "repeats": repeats,
        "rows": [],
    }
    for n in counts:
        row = await bench_count(n, root / f"n{n}", repeats, hb, device)
        row["targets"] = targets(row)
        result["rows"].append(row)
        print(
            f"{n:>7,} tensors: blocked {row['eager_blocked_s'] * 1e3:.1f} ms (foreach_copy_ "
            f"{row['foreach_copy_s'] * 1e3:.1f}), hb max {row['hb_max_ms']:.1f} ms, durable "
            f"{row['eager_durable_s'] * 1e3:.0f} ms (safetensors "
            f"{row['safetensors_durable_s'] * 1e3:.0f}, raw {row['raw_write_fsync_s'] * 1e3:.0f}), "
            f"load {row['load_s'] * 1e3:.0f} ms (safetensors "
            f"{row['safetensors_load_s'] * 1e3:.0f}), lazy {row['lazy_blocked_s'] * 1e3:.1f} ms",
            flush=True,
        )
    return result


def write_results(result: dict[str, Any], out: Path = RESULTS) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "many_tensors.json").write_text(json.dumps(result, indent=1) + "\n")
    (out / "many_tensors.md").write_text(markdown(result))
    plot(result, out / "many_tensors.png")


async def main(args: argparse.Namespace) -> None:
    hb = Heartbeat()
    async with anyio.create_task_group() as tg:
        tg.start_soon(hb.run)
        counts = [int(c) for c in args.counts.split(",")]
        result = await bench(counts, args.dir, args.repeats, hb, args.device)
        tg.cancel_scope.cancel()
    write_results(result, args.out)
    print(markdown(result))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--counts", default="1000,10000,100000")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--dir", type=Path, default=Path("/tmp/asyncsave-many-tensors"))
    parser.add_argument("--out", type=Path, default=RESULTS)
    anyio.run(main, parser.parse_args())
