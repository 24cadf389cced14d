"""Peak memory and time of ``asyncsave.export_hf``, by shard size.

A checkpoint of a model of ``--model-mib`` MiB of float32 weights (tensors of 8 MiB,
one tied pair) and an optimizer state twice that size (AdamW's two moments) is
saved once; then each export runs in a fresh child process, and the child's peak
resident set size (``VmHWM``; ``ru_maxrss`` would carry the parent's over ``exec``) is compared with the same child's RSS after its
imports and just before the export (the baseline). The export reads one shard at a
time, so the peak above the baseline should follow the shard size, not the
model or the checkpoint; the page cache of the memory-mapped data files is not resident memory
of the process unless touched, and only the shard's entries are touched.

Run: ``python bench/export_hf.py`` (256 MiB model; shards of 16, 64 MiB and one
file), or ``--model-mib 64`` for a quick look. Writes
``bench/results/export_hf.json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import anyio
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import asyncsave

RESULTS = Path(__file__).resolve().parent / "results"
_CHILD = """
import json, sys, time
import torch, safetensors.torch, asyncsave
def status_mib(field):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
base = status_mib("VmRSS")
t0 = time.perf_counter()
files = asyncsave.export_hf(sys.argv[1], sys.argv[2], max_shard_bytes=int(sys.argv[3]))
seconds = time.perf_counter() - t0
peak = status_mib("VmHWM")  # this process image's peak (ru_maxrss keeps the parent's)
print(json.dumps({"base_mib": base, "peak_mib": peak, "seconds": seconds, "files": len(files)}))
"""


def make_checkpoint(root: Path, model_mib: int) -> Path:
    n = max(2, model_mib // 8)
    weights = {f"layer{i}.weight": torch.randn(2048, 1024) for i in range(n)}  # 8 MiB each
    weights["lm_head.weight"] = weights["layer0.weight"]  # tied
    optim = {
        k: {"exp_avg": torch.randn_like(v), "exp_avg_sq": torch.rand_like(v)}
        for k, v in weights.items()
        if k != "lm_head.weight"
    }

    async def main() -> Path:
        async with asyncsave.Checkpointer(root) as ckpt:
            info = await (await ckpt.save(1, {"model": weights, "optim": optim, "step": 1}))
        return info.path

    return anyio.run(main)


def run(model_mib: int, shards_mib: list[int | None]) -> list[dict[str, float]]:
    rows = []
    with tempfile.TemporaryDirectory(dir=".") as tmp:
        path = make_checkpoint(Path(tmp) / "run", model_mib)
        for shard in shards_mib:
            out = Path(tmp) / f"hf-{shard}"
            limit = (shard << 20) if shard else 5 * 10**9
            child = subprocess.run(
                [sys.executable, "-c", _CHILD, str(path), str(out), str(limit)],
                check=True,
                capture_output=True,
                text=True,
            )
            row = json.loads(child.stdout.strip().splitlines()[-1])
            row.update(shard_mib=shard or 0, model_mib=model_mib)
            row["above_base_mib"] = row["peak_mib"] - row["base_mib"]
            rows.append(row)
            shutil.rmtree(out)
            print(
                f"shard {shard or 'one file'!s:>9} MiB: {row['files']:3d} files, "
                f"peak {row['peak_mib']:7.1f} MiB = base {row['base_mib']:6.1f} + "
                f"{row['above_base_mib']:6.1f}, {row['seconds']:.2f} s",
                flush=True,
            )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model-mib", type=int, default=256)
    args = parser.parse_args()
    t0 = time.perf_counter()
    rows = run(args.model_mib, [16, 64, None])
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "export_hf.json").write_text(json.dumps(rows, indent=2) + "\n")
    lines = [
        f"# export_hf peak memory ({args.model_mib} MiB model, {2 * args.model_mib} MiB optimizer)",
        "",
        "| shard MiB | files | base RSS MiB | peak RSS MiB | above base MiB | seconds |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['shard_mib'] or 'one file'} | {r['files']} | {r['base_mib']:.0f} | "
            f"{r['peak_mib']:.0f} | {r['above_base_mib']:.0f} | {r['seconds']:.2f} |"
        )
    (RESULTS / "export_hf.md").write_text("\n".join(lines) + "\n")
    print(f"done in {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
