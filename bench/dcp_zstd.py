"""DCP saves with and without DCP's ZStandard stream transform, in one run.

    python bench/dcp_zstd.py                  # one TinyLlama-1.1B decoder layer + its embedding
    python bench/dcp_zstd.py --layers 2 --repeats 3

What is saved, in the shapes of TinyLlama-1.1B (hidden 2048, intermediate 5632,
32 query heads and 4 key/value heads of 64, vocabulary 32,000):

- **weights**: bf16, every matrix drawn from N(0, 0.02) (the scale of trained LLM
  weights; no trained weights can be fetched here), norms at 1;
- **AdamW moments** (``exp_avg``, ``exp_avg_sq``, float32, as mixed-precision
  training keeps them) after ``--steps`` real ``torch.optim.AdamW`` steps on float32
  master weights, with gradients N(0, 1e-3) on the dense matrices and, on the
  embedding, only on the rows of ``--tokens`` token ids drawn from a Zipf law
  per step (the rows a batch touches; every other row's moments stay 0, as in
  real training of a large vocabulary).

Each group is saved by ``asyncsave.dcp.StorageWriter`` (safetensors, no
compression), by the same writer with ``_extensions=[ZStandard()]`` (DCP's own
``.distcp`` files, compressed), and by DCP's ``FileSystemWriter`` with
``ZStandard`` (the peer), ``--repeats`` times each, alternating, on one file
system. Each row: stored bytes of the data files, the ratio to the raw tensor
bytes, and the median seconds of ``dcp.save`` (to committed, fsynced) and of
``dcp.load``. Results: ``bench/results/dcp_zstd.json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import json
import platform
import shutil
import statistics
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint._extension import ZStandard

from asyncsave.dcp import StorageReader, StorageWriter

HIDDEN, INTER, HEADS, KV_HEADS, HEAD_DIM, VOCAB = 2048, 5632, 32, 4, 64, 32000


def model_shapes(layers: int) -> dict[str, tuple[int, ...]]:
    """Parameter shapes of the first ``layers`` decoder layers and the embedding."""
    shapes: dict[str, tuple[int, ...]] = {"embed_tokens.weight": (VOCAB, HIDDEN)}
    for i in range(layers):
        p = f"layers.{i}."
        shapes |= {
            p + "self_attn.q_proj.weight": (HEADS * HEAD_DIM, HIDDEN),
            p + "self_attn.k_proj.weight": (KV_HEADS * HEAD_DIM, HIDDEN),
            p + "self_attn.v_proj.weight": (KV_HEADS * HEAD_DIM, HIDDEN),
            p + "self_attn.o_proj.weight": (HIDDEN, HEADS * HEAD_DIM),
            p + "mlp.gate_proj.weight": (INTER, HIDDEN),
            p + "mlp.up_proj.weight": (INTER, HIDDEN),
            p + "mlp.down_proj.weight": (HIDDEN, INTER),
            p + "input_layernorm.weight": (HIDDEN,),
            p + "post_attention_layernorm.weight": (HIDDEN,),
        }
    return shapes


def build_state(layers: int, steps: int, tokens: int, seed: int) -> dict[str, dict[str, Any]]:
    """The three groups: bf16 weights, and AdamW's exp_avg / exp_avg_sq (float32)."""
    g = torch.Generator().manual_seed(seed)
    params: dict[str, torch.nn.Parameter] = {}
    for name, shape in model_shapes(layers).items():
        if len(shape) == 1:
            params[name] = torch.nn.Parameter(torch.ones(shape))
        else:
            params[name] = torch.nn.Parameter(torch.randn(shape, generator=g) * 0.02)
    opt = torch.optim.AdamW(list(params.values()), lr=1e-4, weight_decay=0.0)
    zipf = 1.0 / torch.arange(1, VOCAB + 1, dtype=torch.float64)
    for _ in range(steps):
        for name, p in params.items():
            if name == "embed_tokens.weight":
                rows = torch.multinomial(zipf, tokens, replacement=True, generator=g).unique()
                grad = torch.zeros_like(p)
                grad[rows] = torch.randn(len(rows), HIDDEN, generator=g) * 1e-3
            else:
                grad = torch.randn(p.shape, generator=g) * 1e-3
            p.grad = grad
        opt.step()
    emb = "embed_tokens.weight"
    groups: dict[str, dict[str, Any]] = {
        "weights (bf16)": {n: p.detach().to(torch.bfloat16) for n, p in params.items()}
    }
    for key in ("exp_avg", "exp_avg_sq"):
        state = {n: opt.state[p][key] for n, p in params.items()}
        dense = {n: t for n, t in state.items() if n != emb}
        groups[f"AdamW {key}, dense layers (fp32)"] = dense
        groups[f"AdamW {key}, embedding (fp32)"] = {emb: state[emb]}
    return groups


def zstd_mb_s(group: dict[str, torch.Tensor]) -> float:
    """MB/s of one thread compressing the group's bytes in memory (DCP's ZStandard
    uses ``zstandard.ZstdCompressor()``, level 3): the compressor's own speed,
    without the disk."""
    import zstandard

    raw = b"".join(t.contiguous().view(torch.uint8).numpy().tobytes() for t in group.values())
    t0 = time.perf_counter()
    zstandard.ZstdCompressor().compress(raw)
    return len(raw) / 1e6 / (time.perf_counter() - t0)


def stored_bytes(path: Path) -> int:
    names = {".metadata", "manifest.json"}
    return sum(f.stat().st_size for f in path.iterdir() if f.is_file() and f.name not in names)


def one(
    kind: str, group: dict[str, torch.Tensor], where: Path, step: int
) -> tuple[float, float, int]:
    """Save and load ``group`` once with ``kind``; seconds to save, to load, stored bytes."""
    if kind == "asyncsave":
        writer: Any = StorageWriter(where, step)
    elif kind == "asyncsave + zstd":
        writer = StorageWriter(where, step, _extensions=[ZStandard()])
    else:
        writer = FileSystemWriter(where / f"step_{step}", _extensions=[ZStandard()])
    t0 = time.perf_counter()
    dcp.save(group, storage_writer=writer, no_dist=True)
    saved = time.perf_counter() - t0
    final = where / f"step_{step}"
    reader: Any = StorageReader(final) if kind.startswith("asyncsave") else FileSystemReader(final)
    out = {k: torch.empty_like(v) for k, v in group.items()}
    t0 = time.perf_counter()
    dcp.load(out, storage_reader=reader, no_dist=True)
    loaded = time.perf_counter() - t0
    assert all(torch.equal(out[k], group[k]) for k in group), kind
    return saved, loaded, stored_bytes(final)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=1)
    ap.add_argument("--steps", type=int, default=3, help="AdamW steps before the save")
    ap.add_argument("--tokens", type=int, default=8192, help="token ids per step (embedding rows)")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dir", type=Path, default=None, help="where to write (default: a temp dir)")
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = ap.parse_args()
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")

    groups = build_state(args.layers, args.steps, args.tokens, args.seed)
    kinds = ["asyncsave", "asyncsave + zstd", "FileSystemWriter + zstd"]
    rows: list[dict[str, Any]] = []
    base = Path(tempfile.mkdtemp(prefix="dcp-zstd-", dir=args.dir))
    try:
        for gname, group in groups.items():
            raw = sum(t.numel() * t.element_size() for t in group.values())
            speed = zstd_mb_s(group)
            times: dict[str, list[tuple[float, float, int]]] = {k: [] for k in kinds}
            for r in range(args.repeats):
                for k in kinds:  # alternating: every kind sees the same disk weather
                    where = base / f"{len(rows)}-{k.replace(' ', '')}-{r}"
                    times[k].append(one(k, group, where, 1))
                    shutil.rmtree(where)
            for k in kinds:
                stored = times[k][-1][2]
                rows.append(
                    {
                        "group": gname,
                        "writer": k,
                        "raw_bytes": raw,
                        "stored_bytes": stored,
                        "ratio": raw / stored,
                        "save_s": statistics.median(t[0] for t in times[k]),
                        "load_s": statistics.median(t[1] for t in times[k]),
                        "zstd_in_memory_mb_s": speed,
                    }
                )
                print(json.dumps(rows[-1]), flush=True)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    report(rows, args)


def report(rows: list[dict[str, Any]], args: argparse.Namespace) -> None:
    args.out.mkdir(parents=True, exist_ok=True)
    env = {
        "torch": torch.__version__,
        "python": platform.python_version(),
        "cpus": torch.get_num_threads(),
        "layers": args.layers,
        "steps": args.steps,
        "tokens": args.tokens,
        "repeats": args.repeats,
    }
    (args.out / "dcp_zstd.json").write_text(json.dumps({"env": env, "rows": rows}, indent=2))
    lines = [
        "# DCP saves with and without ZStandard",
        "",
        f"`python bench/dcp_zstd.py` ({env}); medians of {args.repeats} saves. "
        "MB/s saved: raw bytes over seconds to committed (fsynced). zstd alone: one "
        "thread compressing the same bytes in memory (the compressor without the disk).",
        "",
        "| group | writer | raw MiB | stored MiB | ratio | save s | MB/s saved | load s "
        "| zstd alone, MB/s |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['group']} | {r['writer']} | {r['raw_bytes'] / 2**20:.1f} | "
            f"{r['stored_bytes'] / 2**20:.1f} | {r['ratio']:.2f} | {r['save_s']:.2f} | "
            f"{r['raw_bytes'] / 1e6 / r['save_s']:.0f} | {r['load_s']:.2f} | "
            f"{r['zstd_in_memory_mb_s']:.0f} |"
        )
    (args.out / "dcp_zstd.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
