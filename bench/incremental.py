"""Incremental saves against full saves, in one run on one machine.

    python bench/incremental.py                 # 1.5 GB LoRA base (the size the targets were set for)
    python bench/incremental.py --base-mb 512   # a smaller base on a busy machine

Three workloads, each saved by two checkpointers on two roots of the same file
system, one full (``incremental=False``, the default) and one incremental, with
saves interleaved so both see the same disk weather:

1. **LoRA**: a frozen base (``--base-mb`` of float32 weight matrices, each 16 or
   32 MiB) plus rank-r adapters on every matrix and their AdamW state (exp_avg,
   exp_avg_sq, step), r chosen so that adapters and moments are about 3 % of the
   bytes. Between saves the adapters and moments change (in place), the base not.
2. **All changed**: the same state with every tensor changed before each save:
   what the hashing of an incremental save costs when nothing can be shared.
3. **Replay buffer**: a TensorDict (obs, action, reward, done) of ``--rb-mb``
   growing by 1 % of its rows per save (a new TensorDict each time, as
   ``torch.cat`` makes it).

Each row gives the median over ``--repeats`` saves after the first of: bytes the
save wrote (data files created, from the manifest's ``incremental`` report; a
full save writes every file), and seconds from ``save()`` to durable
(``CheckpointInfo.committed_s``: staged, written, fsynced, committed, tracked).
Results: ``bench/results/incremental.json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import json
import platform
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import anyio
import torch

import asyncsave

MiB = 1 << 20
RESULTS = Path(__file__).parent / "results"


def lora_state(base_bytes: int) -> dict[str, Any]:
    """A frozen base of float32 matrices (2048 x 2048 and 2048 x 4096, 16 and 32
    MiB, alternating: the layer sizes of a 1-3 B model) with LoRA adapters and
    AdamW moments (~3 % of the bytes)."""
    shapes: list[tuple[int, int]] = []
    total = 0
    while total < base_bytes:
        s = (2048, 4096) if len(shapes) % 2 else (2048, 2048)
        shapes.append(s)
        total += 4 * s[0] * s[1]
    gen = torch.Generator().manual_seed(0)
    # adapters + exp_avg + exp_avg_sq = 3 x adapter bytes ~ 3 % of the total
    numel = sum(a * b for a, b in shapes)
    r = max(1, round(0.0103 * numel / sum(a + b for a, b in shapes)))
    base, lora, state = {}, {}, {}
    for i, (a, b) in enumerate(shapes):
        base[f"layer{i}.weight"] = torch.randn(a, b, generator=gen)
        lora[f"layer{i}.lora_A"] = torch.randn(r, b, generator=gen) * 0.01
        lora[f"layer{i}.lora_B"] = torch.zeros(a, r)
    for j, (k, p) in enumerate(lora.items()):
        state[j] = {
            "step": torch.tensor(1.0),
            "exp_avg": torch.zeros_like(p),
            "exp_avg_sq": torch.zeros_like(p),
        }
        del k
    return {
        "model": {"base": base, "lora": lora},
        "optim": {"state": state, "param_groups": [{"lr": 1e-4, "params": list(range(len(lora)))}]},
        "rank": r,
    }


def train_step(state: dict[str, Any], everything: bool) -> None:
    """Change what a LoRA step changes (in place); ``everything``: the base too."""
    for p in state["model"]["lora"].values():
        p.add_(1e-3)
    for s in state["optim"]["state"].values():
        s["step"].add_(1)
        s["exp_avg"].add_(1e-4)
        s["exp_avg_sq"].add_(1e-8)
    if everything:
        for w in state["model"]["base"].values():
            w.add_(1e-6)


def replay_buffer(nbytes: int) -> Any:
    from tensordict import TensorDict

    row = 4 * 256 + 4 * 4 + 4 + 1
    n = nbytes // row
    gen = torch.Generator().manual_seed(1)
    return TensorDict(
        {
            "obs": torch.randn(n, 256, generator=gen),
            "action": torch.randn(n, 4, generator=gen),
            "reward": torch.randn(n, generator=gen),
            "done": torch.zeros(n, dtype=torch.bool),
        },
        batch_size=[n],
    )


def grow(rb: Any, fraction: float) -> Any:
    from tensordict import TensorDict

    k = max(1, int(rb.batch_size[0] * fraction))
    new = TensorDict(
        {
            "obs": torch.randn(k, 256),
            "action": torch.randn(k, 4),
            "reward": torch.randn(k),
            "done": torch.zeros(k, dtype=torch.bool),
        },
        batch_size=[k],
    )
    return torch.cat([rb, new])


def written(info: asyncsave.CheckpointInfo) -> tuple[int, int]:
    """(bytes the save wrote into data files, bytes of its data files)."""
    doc = json.loads((Path(info.path) / "manifest.json").read_bytes())
    total = sum(f["nbytes"] for f in doc["files"])
    report = doc.get("incremental")
    return (total if report is None else report["bytes_written"]), total


async def compare(work: Path, name: str, first: Any, step_fn: Any, repeats: int) -> dict[str, Any]:
    """Save ``first`` and then ``repeats`` states from ``step_fn(state)`` with a
    full and an incremental checkpointer, interleaved."""
    rows: dict[str, dict[str, list[float]]] = {}
    roots = {mode: work / f"{name}-{mode}" for mode in ("full", "incremental")}
    async with (
        asyncsave.Checkpointer(
            roots["full"], retention=asyncsave.KeepLast(1), save_step_zero=True
        ) as full,
        asyncsave.Checkpointer(
            roots["incremental"],
            incremental=True,
            retention=asyncsave.KeepLast(1),
            save_step_zero=True,
        ) as incr,
    ):
        state = first
        for ckpt in (full, incr):
            await (await ckpt.save(0, state))
        for step in range(1, repeats + 1):
            state = step_fn(state)
            order = [("full", full), ("incremental", incr)]
            if step % 2:
                order.reverse()
            for mode, ckpt in order:
                info = await (await ckpt.save(step, state))
                wrote, total = written(info)
                row = rows.setdefault(mode, {"wrote": [], "total": [], "durable_s": []})
                row["wrote"].append(wrote)
                row["total"].append(total)
                assert info.committed_s is not None
                row["durable_s"].append(info.committed_s)
    for root in roots.values():
        shutil.rmtree(root, ignore_errors=True)
    out: dict[str, Any] = {}
    for mode, row in rows.items():
        out[mode] = {
            "bytes_written": statistics.median(row["wrote"]),
            "bytes_total": statistics.median(row["total"]),
            "durable_s": statistics.median(row["durable_s"]),
            "durable_s_all": row["durable_s"],
            "written_fraction_all": [
                w / t for w, t in zip(row["wrote"], row["total"], strict=True)
            ],
        }
    f, i = out["full"], out["incremental"]
    out["written_fraction"] = i["bytes_written"] / i["bytes_total"]
    out["durable_ratio"] = i["durable_s"] / f["durable_s"]
    return out


async def run(args: argparse.Namespace) -> dict[str, Any]:
    torch.set_num_threads(2)
    result: dict[str, Any] = {
        "machine": {"platform": platform.platform(), "torch": torch.__version__},
        "args": vars(args),
    }
    with tempfile.TemporaryDirectory(prefix="asyncsave-incr-", dir=args.dir) as tmp:
        work = Path(tmp)
        state = lora_state(args.base_mb * MiB)
        result["lora_rank"] = state.pop("rank")
        t0 = time.perf_counter()

        def lora_step(s: Any) -> Any:
            train_step(s, everything=False)
            return s

        def all_step(s: Any) -> Any:
            train_step(s, everything=True)
            return s

        result["lora"] = await compare(work, "lora", state, lora_step, args.repeats)
        result["all_changed"] = await compare(work, "all", state, all_step, args.repeats)
        del state
        rb = replay_buffer(args.rb_mb * MiB)
        result["replay"] = await compare(
            work, "replay", {"rb": rb}, lambda s: {"rb": grow(s["rb"], 0.01)}, args.repeats
        )
        result["seconds"] = time.perf_counter() - t0
    return result


def markdown(r: dict[str, Any]) -> str:
    def row(label: str, w: dict[str, Any]) -> list[str]:
        f, i = w["full"], w["incremental"]
        return [
            f"| {label}, full save | {f['bytes_total'] / 1e6:,.0f} MB | "
            f"{f['bytes_written'] / 1e6:,.1f} MB (100 %) | {f['durable_s']:.3f} s | 1.00 |",
            f"| {label}, incremental | {i['bytes_total'] / 1e6:,.0f} MB | "
            f"{i['bytes_written'] / 1e6:,.1f} MB ({100 * w['written_fraction']:.2f} %) | "
            f"{i['durable_s']:.3f} s | {w['durable_ratio']:.2f} |",
        ]

    a = r["args"]
    lines = [
        f"LoRA base {a['base_mb']} MiB (rank {r['lora_rank']}), replay buffer {a['rb_mb']} MiB "
        f"growing 1 %/save; median of {a['repeats']} saves after the first.",
        "",
        "| workload | checkpoint size | written by the save | save() to durable | ratio |",
        "|---|---:|---:|---:|---:|",
        *row("LoRA (~3 % changes)", r["lora"]),
        *row("all tensors change", r["all_changed"]),
        *row("replay buffer +1 %", r["replay"]),
    ]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base-mb", type=int, default=1536)
    ap.add_argument("--rb-mb", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--dir", default=None, help="where the roots go (default: a temp dir)")
    ap.add_argument("--out", default=str(RESULTS / "incremental"))
    args = ap.parse_args()
    result = anyio.run(run, args)
    md = markdown(result)
    Path(args.out + ".json").write_text(json.dumps(result, indent=1))
    Path(args.out + ".md").write_text(md)
    print(md)


if __name__ == "__main__":
    main()
