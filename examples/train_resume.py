"""Crash-safe, bit-exact resume of a small GPT trained from an anyio pump.

What this example demonstrates:

* A decoder-only transformer (plain torch, ~11 M parameters by default) is trained
  with AdamW on byte-level tokens of the Python standard library's own sources,
  with dropout on, so the torch RNG state is part of what a resume must restore.
* The training loop is an anyio pump (``--backend asyncio`` or ``trio``): every
  optimizer step runs in a worker thread (``anyio.to_thread.run_sync``) so the event
  loop stays live, and a concurrent heartbeat task (a stand-in for evaluation,
  rollouts or an RPC server) ticks every 5 ms and records its largest gap.
* Every ``--save-every`` steps, ``await ckpt.save(step, state)`` returns as soon as
  the state is copied into host staging memory; the write, fsync and atomic commit
  happen in the background while training goes on. The handles are awaited at the
  end.
* The checkpoint holds the model, the optimizer, a data sampler (its epoch
  permutation, cursor and generator), the torch RNG state, the step and the loss
  history. ``--crash-at K`` waits for the earlier saves to commit, saves step K and
  SIGKILLs the process while that save is being written; running the same command without ``--crash-at`` resumes from the
  last committed step and produces per-step losses equal, bit for bit, to those of
  an uninterrupted run (compare ``<run-dir>/losses.jsonl``).

Usage::

    python examples/train_resume.py --run-dir runs/demo --steps 40 --save-every 10
    python examples/train_resume.py --run-dir runs/crash --crash-at 25  # killed
    python examples/train_resume.py --run-dir runs/crash                # resumes from 20
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import signal
import sys
import sysconfig
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import anyio
import anyio.lowlevel
import anyio.to_thread
import torch
import torch.nn.functional as F
from torch import nn

import asyncsave

VOCAB_SIZE = 256  # byte-level tokens
HEARTBEAT_S = 0.005
TEMP_PREFIX = ".asyncsave-tmp-"  # where an in-flight save writes before it commits


# ----------------------------------------------------------------------------- data
def load_corpus(max_bytes: int, holdout_every: int = 10) -> tuple[torch.Tensor, torch.Tensor]:
    """The standard library's ``.py`` sources as byte tokens: ``(train, held_out)``
    ``uint8`` tensors.

    Files are taken in sorted path order until ``max_bytes`` are read; every
    ``holdout_every``-th file goes to the held-out split. Installed packages, the
    test suites and the generated codec tables of ``encodings`` are left out, so the
    corpus depends on the Python version only.
    """
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    skip = {"site-packages", "dist-packages", "test", "tests", "encodings", "__pycache__"}
    files = sorted(
        (p for p in stdlib.rglob("*.py") if not skip.intersection(p.relative_to(stdlib).parts)),
        key=lambda p: p.relative_to(stdlib).as_posix(),
    )
    splits: tuple[list[bytes], list[bytes]] = ([], [])
    total = 0
    for i, path in enumerate(files):
        if total >= max_bytes:
            break
        blob = path.read_bytes()
        splits[i % holdout_every == holdout_every - 1].append(blob)
        total += len(blob)
    train, held_out = (b"".join(s) for s in splits)
    if len(train) < 100_000 or len(held_out) < 10_000:
        raise SystemExit(f"found too few Python sources under {stdlib}")
    return (
        torch.frombuffer(bytearray(train), dtype=torch.uint8),
        torch.frombuffer(bytearray(held_out), dtype=torch.uint8),
    )


class ChunkSampler:
    """Draws batches of training chunks, one random permutation per epoch.

    Chunk ``i`` is the token window starting at ``i * context``. Its position in the
    data stream (epoch, permutation, cursor, generator state) is its state, so a
    resumed run continues with exactly the batches the interrupted one would have
    drawn. It follows the ``state_dict()`` / ``load_state_dict()`` convention, so
    asyncsave saves it and restores it in place.
    """

    def __init__(self, num_chunks: int, batch_size: int, seed: int) -> None:
        if num_chunks < batch_size:
            raise ValueError(f"{num_chunks} chunks cannot fill a batch of {batch_size}")
        self.num_chunks = num_chunks
        self.batch_size = batch_size
        self.generator = torch.Generator().manual_seed(seed)
        self.epoch = 0
        self.cursor = 0
        self.perm = torch.randperm(num_chunks, generator=self.generator)

    def next_indices(self) -> torch.Tensor:
        if self.cursor + self.batch_size > self.num_chunks:
            self.epoch += 1
            self.cursor = 0
            self.perm = torch.randperm(self.num_chunks, generator=self.generator)
        batch = self.perm[self.cursor : self.cursor + self.batch_size]
        self.cursor += self.batch_size
        return batch

    def state_dict(self) -> dict[str, Any]:
        return {
            "num_chunks": self.num_chunks,
            "epoch": self.epoch,
            "cursor": self.cursor,
            "perm": self.perm,
            "generator": self.generator.get_state(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state["num_chunks"] != self.num_chunks:
            raise ValueError(
                f"the checkpoint's sampler has {state['num_chunks']} chunks, this run "
                f"{self.num_chunks} (different corpus or context?)"
            )
        self.epoch = int(state["epoch"])
        self.cursor = int(state["cursor"])
        self.perm = state["perm"].clone()
        self.generator.set_state(state["generator"])


def make_batch(
    data: torch.Tensor, chunks: torch.Tensor, context: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and next-byte targets, both ``(batch, context)`` int64."""
    offsets = chunks[:, None] * context + torch.arange(context + 1)
    windows = data[offsets].long()
    return windows[:, :-1], windows[:, 1:]


# ---------------------------------------------------------------------------- model
@dataclasses.dataclass(frozen=True)
class ModelConfig:
    d_model: int = 384
    layers: int = 6
    heads: int = 6
    context: int = 128
    dropout: float = 0.1
    vocab_size: int = VOCAB_SIZE


class CausalSelfAttention(nn.Module):
    causal: torch.Tensor

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        if cfg.d_model % cfg.heads:
            raise ValueError(f"d_model={cfg.d_model} is not divisible by heads={cfg.heads}")
        self.heads = cfg.heads
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)
        self.attn_drop = nn.Dropout(cfg.dropout)
        self.resid_drop = nn.Dropout(cfg.dropout)
        causal = torch.ones(cfg.context, cfg.context, dtype=torch.bool).tril()
        self.register_buffer("causal", causal, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = (
            z.view(b, t, self.heads, c // self.heads).transpose(1, 2)
            for z in self.qkv(x).split(c, dim=2)
        )
        att = (q @ k.transpose(-2, -1)) / math.sqrt(c // self.heads)
        att = att.masked_fill(~self.causal[:t, :t], float("-inf")).softmax(dim=-1)
        y = self.attn_drop(att) @ v
        return self.resid_drop(self.proj(y.transpose(1, 2).reshape(b, t, c)))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.mlp = nn.Sequential(
            nn.Linear(cfg.d_model, 4 * cfg.d_model),
            nn.GELU(),
            nn.Linear(4 * cfg.d_model, cfg.d_model),
            nn.Dropout(cfg.dropout),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """A minimal GPT-2-style decoder-only transformer over byte tokens."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos_emb = nn.Embedding(cfg.context, cfg.d_model)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=0.02)
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        x = self.drop(self.tok_emb(idx) + self.pos_emb(torch.arange(t)))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def lm_loss(model: GPT, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    logits = model(x)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


def learning_rate(step: int, peak: float, warmup: int) -> float:
    """Linear warm-up, then constant: a function of the step alone, so it needs no
    state of its own in the checkpoint."""
    return peak * min(1.0, (step + 1) / warmup)


# ------------------------------------------------------------------------ heartbeat
class Heartbeat:
    """Stand-in for work that shares the event loop with the pump (evaluation,
    rollouts, a metrics server): ticks every 5 ms and records the largest gap
    between ticks, overall and while a checkpoint save is in flight."""

    def __init__(self, saving: Callable[[], bool]) -> None:
        self._saving = saving
        self.ticks = 0
        self.max_gap_s = 0.0
        self.max_gap_saving_s = 0.0
        self.ticks_saving = 0

    async def run(self) -> None:
        last = time.perf_counter()
        saving_before = self._saving()
        while True:
            await anyio.sleep(HEARTBEAT_S)
            now = time.perf_counter()
            gap, last = now - last, now
            saving_now = self._saving()
            self.ticks += 1
            self.max_gap_s = max(self.max_gap_s, gap)
            if saving_before or saving_now:
                self.ticks_saving += 1
                self.max_gap_saving_s = max(self.max_gap_saving_s, gap)
            saving_before = saving_now


# ---------------------------------------------------------------------------- crash
def _has_data_file(directory: Path) -> bool:
    try:
        return any(
            n.startswith("data-") and n.endswith(".safetensors") for n in os.listdir(directory)
        )
    except (FileNotFoundError, NotADirectoryError):  # committed (renamed) meanwhile
        return False


async def kill_while_writing(root: Path, handle: asyncsave.SaveHandle) -> None:
    """SIGKILL this process as soon as the save of ``handle.step`` has a data file
    in its temporary directory, i.e. while it is being written and before it
    commits. If it commits before that is seen, SIGKILL anyway (and say so)."""
    prefix = f"{TEMP_PREFIX}{handle.step}-"
    while True:
        in_flight = [root / n for n in os.listdir(root) if n.startswith(prefix)]
        if any(_has_data_file(d) for d in in_flight):
            how = "mid-write: its temporary directory holds a data file"
            break
        if handle.done():
            how = "after it committed (the write finished before it was seen)"
            break
        await anyio.lowlevel.checkpoint()  # poll as fast as the event loop allows
    print(f"crash-at: SIGKILL at step {handle.step}, {how}", file=sys.stderr, flush=True)
    sys.stdout.flush()
    os.kill(os.getpid(), signal.SIGKILL)


# ---------------------------------------------------------------------------- pump
def _stats(values: Sequence[float]) -> dict[str, float | None]:
    if not values:
        return {"total": None, "mean": None, "max": None}
    return {"total": sum(values), "mean": sum(values) / len(values), "max": max(values)}


async def train(args: argparse.Namespace) -> dict[str, Any]:
    t_start = time.perf_counter()
    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)
    torch.use_deterministic_algorithms(True)

    cfg = ModelConfig(
        d_model=args.d_model, layers=args.layers, heads=args.heads, context=args.context
    )
    train_data, val_data = load_corpus(int(args.corpus_mb * 1e6))
    model = GPT(cfg)
    optim = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    sampler = ChunkSampler((len(train_data) - 1) // cfg.context, args.batch, args.seed)
    n_params = sum(p.numel() for p in model.parameters())
    # Fields that must match for a resume to reproduce the uninterrupted run.
    run_config = {
        **dataclasses.asdict(cfg),
        "batch": args.batch,
        "seed": args.seed,
        "lr": args.lr,
        "warmup": args.warmup,
        "corpus_bytes": len(train_data) + len(val_data),
    }

    run_dir = Path(args.run_dir)
    root = run_dir / "checkpoints"
    run_dir.mkdir(parents=True, exist_ok=True)
    losses: list[float] = []
    step = 0

    def train_step() -> float:
        """One optimizer step; runs in a worker thread."""
        model.train()
        x, y = make_batch(train_data, sampler.next_indices(), cfg.context)
        for group in optim.param_groups:
            group["lr"] = learning_rate(step, args.lr, args.warmup)
        loss = lm_loss(model, x, y)
        optim.zero_grad(set_to_none=True)
        loss.backward()
        nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optim.step()
        return float(loss.item())

    def evaluate() -> float:
        """Mean loss over the first ``--eval-batches`` batches of the held-out split."""
        model.eval()
        n_chunks = (len(val_data) - 1) // cfg.context
        batches = torch.arange(min(n_chunks, args.eval_batches * args.batch)).split(args.batch)
        with torch.no_grad():
            values = [float(lm_loss(model, *make_batch(val_data, c, cfg.context))) for c in batches]
        return sum(values) / len(values)

    def state() -> dict[str, Any]:
        return {
            "model": model,
            "optim": optim,
            "sampler": sampler,
            "step": step,
            "rng": torch.get_rng_state(),
            "losses": torch.tensor(losses, dtype=torch.float64),
            "config": run_config,
        }

    handles: list[asyncsave.SaveHandle] = []
    async with asyncsave.Checkpointer(root) as ckpt:
        restored = await ckpt.load_latest({"model": model, "optim": optim, "sampler": sampler})
        resumed_from: int | None = None
        if restored is not None:
            saved = restored.state
            if saved["config"] != run_config:
                raise SystemExit(
                    f"{root} was written with {saved['config']}, this run has {run_config}; "
                    "use the same flags or another --run-dir"
                )
            step = resumed_from = int(saved["step"])
            torch.set_rng_state(saved["rng"])
            losses = saved["losses"].tolist()
            print(f"resumed from step {resumed_from} ({restored.info.path})")
        start_step = step

        # The checkpoint's loss history is authoritative: rewrite the file from it,
        # dropping lines of steps that an interrupted run trained after that save.
        with (run_dir / "losses.jsonl").open("w") as loss_file:
            for k, value in enumerate(losses, start=1):
                loss_file.write(json.dumps({"step": k, "loss": value.hex()}) + "\n")
            loss_file.flush()

            heartbeat = Heartbeat(lambda: bool(ckpt.pending_steps))
            t_train = time.perf_counter()
            async with anyio.create_task_group() as tg:
                tg.start_soon(heartbeat.run)
                while step < args.steps:
                    loss = await anyio.to_thread.run_sync(train_step)
                    step += 1
                    losses.append(loss)
                    loss_file.write(json.dumps({"step": step, "loss": loss.hex()}) + "\n")
                    loss_file.flush()  # a SIGKILL keeps what was written
                    crash = step == args.crash_at
                    if step % args.save_every == 0 or step == args.steps or crash:
                        if crash:
                            # A reproducible demo: the earlier saves are committed,
                            # the crash tears only this one.
                            await ckpt.wait()
                        # Returns once the state is staged; the write goes on meanwhile.
                        handle = await ckpt.save(step, state())
                        handles.append(handle)
                        print(f"step {step:5d}  loss {loss:.4f}  save dispatched")
                        if crash:
                            await kill_while_writing(root, handle)
                train_s = time.perf_counter() - t_train
                infos = [info for info in [await h for h in handles] if info is not None]
                val_loss = await anyio.to_thread.run_sync(evaluate)
                tg.cancel_scope.cancel()  # stop the heartbeat

    blocked = [i.blocked_s for i in infos if i.blocked_s is not None]
    written = [i.written_s for i in infos if i.written_s is not None]
    committed = [i.committed_s for i in infos if i.committed_s is not None]
    return {
        "backend": args.backend,
        "params": n_params,
        "corpus_bytes": run_config["corpus_bytes"],
        "resumed_from": resumed_from,
        "start_step": start_step,
        "final_step": step,
        "steps_trained": step - start_step,
        "train_s": train_s,
        "wall_s": time.perf_counter() - t_start,
        "final_train_loss": losses[-1] if losses else None,
        "val_loss": val_loss,
        "checkpoints_committed": [i.step for i in infos],
        "bytes_per_checkpoint": infos[0].nbytes if infos else None,
        "tensors_per_checkpoint": infos[0].num_tensors if infos else None,
        "save_blocked_s": _stats(blocked),
        "write_s_mean": _stats(written)["mean"],
        "write_gbps": sum(i.nbytes for i in infos) / sum(written) / 1e9 if written else None,
        "commit_s_mean": _stats(committed)["mean"],
        "heartbeat": {
            "ticks": heartbeat.ticks,
            "max_gap_s": heartbeat.max_gap_s,
            "ticks_while_saving": heartbeat.ticks_saving,
            "max_gap_while_saving_s": heartbeat.max_gap_saving_s,
        },
    }


def _ms(seconds: float | None) -> str:
    return "n/a" if seconds is None else f"{seconds * 1e3:.1f} ms"


def print_summary(s: dict[str, Any]) -> None:
    blocked, hb = s["save_blocked_s"], s["heartbeat"]
    trained = f"{s['steps_trained']}"
    if s["steps_trained"]:
        trained += f" (steps {s['start_step'] + 1}..{s['final_step']})"
    size = (
        "n/a" if s["bytes_per_checkpoint"] is None else f"{s['bytes_per_checkpoint'] / 1e6:.1f} MB"
    )
    gbps = "n/a" if s["write_gbps"] is None else f"{s['write_gbps']:.2f} GB/s"
    lines = [
        f"backend {s['backend']}, {s['params'] / 1e6:.2f} M parameters, "
        f"corpus {s['corpus_bytes'] / 1e6:.2f} MB",
        f"steps trained      {trained}, resumed from {s['resumed_from']}, "
        f"{s['train_s']:.1f} s training, {s['wall_s']:.1f} s wall",
        f"loss               last train {s['final_train_loss']}, held-out {s['val_loss']:.4f}",
        f"checkpoints        {s['checkpoints_committed']} committed, {size} each",
        f"save() blocked     total {_ms(blocked['total'])}, mean {_ms(blocked['mean'])}, "
        f"max {_ms(blocked['max'])}",
        f"write              mean {_ms(s['write_s_mean'])}, {gbps}, "
        f"commit mean {_ms(s['commit_s_mean'])}",
        f"heartbeat          {hb['ticks']} ticks, largest gap {_ms(hb['max_gap_s'])}; "
        f"while saving {hb['ticks_while_saving']} ticks, largest gap "
        f"{_ms(hb['max_gap_while_saving_s'])}",
    ]
    print("\n".join(lines))


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--run-dir", default="runs/train_resume")
    p.add_argument("--steps", type=int, default=40, help="train until this many steps are done")
    p.add_argument(
        "--save-every", type=int, default=10, help="save every N steps and at the last step"
    )
    p.add_argument(
        "--crash-at", type=int, default=None, help="save this step, then SIGKILL mid-write"
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--backend", choices=["asyncio", "trio"], default="asyncio")
    p.add_argument(
        "--tiny", action="store_true", help="a tiny model for tests (size flags still win)"
    )
    p.add_argument("--d-model", type=int)
    p.add_argument("--layers", type=int)
    p.add_argument("--heads", type=int)
    p.add_argument("--context", type=int)
    p.add_argument("--batch", type=int)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument(
        "--corpus-mb", type=float, default=None, help="cap on the corpus (default 4, tiny 1)"
    )
    p.add_argument("--eval-batches", type=int, default=4)
    p.add_argument("--threads", type=int, default=2, help="torch intra-op threads")
    args = p.parse_args(argv)
    preset = (
        {"d_model": 64, "layers": 2, "heads": 2, "context": 32, "batch": 4, "corpus_mb": 1.0}
        if args.tiny
        else {
            "d_model": 384,
            "layers": 6,
            "heads": 6,
            "context": 128,
            "batch": 16,
            "corpus_mb": 4.0,
        }
    )
    for name, value in preset.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.save_every < 1 or args.steps < 0:
        p.error("--save-every must be >= 1 and --steps >= 0")
    return args


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    summary = anyio.run(train, args, backend=args.backend)
    print_summary(summary)
    path = Path(args.run_dir) / "summary.json"
    path.write_text(json.dumps(summary, indent=2) + "\n")


if __name__ == "__main__":
    main()
