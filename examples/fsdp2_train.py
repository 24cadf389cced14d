"""FSDP2 on CPU: 2 ranks shard a small transformer, save asynchronously through
asyncsave, and resume on 2 ranks and on 1 rank (resharded) with the same losses.

    python examples/fsdp2_train.py /tmp/fsdp2-run

What happens:

1. 2 processes (gloo) build a small transformer, shard every block and the root
   with ``torch.distributed.fsdp.fully_shard`` and train ``SAVE_STEP`` steps;
2. the DTensor state of ``get_state_dict(model, optim)`` goes straight to
   ``Checkpointer.save(..., lazy=True)``: ``save()`` returns at once, asyncsave
   stages every shard in the background while the next step's forward and
   backward run, and ``asyncsave.stage_before_step`` holds ``optimizer.step()``
   until the snapshot is complete (the training step runs in a worker thread, so
   the hook may wait there); it is written through DCP's planner and
   ``asyncsave.dcp.StorageWriter``, committed once both ranks' files are durable
   (collective on asyncsave's own gloo group); the same state also goes through
   ``asyncsave.dcp.async_save`` with asyncsave's writer, whose collectives run on
   a gloo side group (``asyncsave.dcp.side_group()``), never on the default group
   that FSDP2's all-gathers use: ``dcp.async_save`` on the default group hangs the
   next step or aborts with gloo's "collective mismatch";
3. training goes on to ``TOTAL_STEPS`` while both saves run, recording the
   losses; the DCP save's future is awaited at the end;
4. 2 fresh processes load the checkpoint (``dcp.load`` + ``asyncsave.dcp.
   StorageReader``), and so does 1 process with an unsharded model: DCP
   reshards. Both continue and must see the same losses as step 3.
"""

from __future__ import annotations

import functools
import sys
from pathlib import Path
from typing import Any

import anyio
import anyio.to_thread
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

import asyncsave
import asyncsave.dcp
from asyncsave.dcp import StorageReader, StorageWriter

SAVE_STEP = 3
TOTAL_STEPS = 6
VOCAB, DIM, SEQ, BATCH = 64, 32, 8, 8


class TinyTransformer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(
            nn.TransformerEncoderLayer(DIM, 4, 64, dropout=0.0, batch_first=True) for _ in range(2)
        )
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def build(world_size: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = TinyTransformer()
    if world_size > 1:
        from torch.distributed.fsdp import fully_shard

        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def batch(step: int, rank: int, world_size: int) -> torch.Tensor:
    """This rank's slice of the global batch of ``step`` (same global batch at any
    world size)."""
    g = torch.Generator().manual_seed(step)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g)
    per = BATCH // world_size
    return tokens[rank * per : (rank + 1) * per]


def train_step(model: nn.Module, opt: torch.optim.Optimizer, step: int) -> float:
    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    tokens = batch(step, rank, world)
    logits = model(tokens[:, :-1])
    loss = nn.functional.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))
    opt.zero_grad()
    loss.backward()
    opt.step()
    global_loss = loss.detach().clone()
    if world > 1:
        dist.all_reduce(global_loss, op=dist.ReduceOp.AVG)
    return global_loss.item()


def train_and_save(rank: int, world_size: int, root: str) -> list[float]:
    """Steps 1..TOTAL_STEPS on 2 ranks, saving at SAVE_STEP: losses after it."""
    model, opt = build(world_size)

    async def main() -> list[float]:
        losses = []
        async with asyncsave.Checkpointer(root, dist_timeout_s=60) as ckpt:
            hook = asyncsave.stage_before_step(opt, ckpt)  # optimizer.step() waits
            for step in range(1, TOTAL_STEPS + 1):
                # In a worker thread: the pre-step hook may block there, never on
                # the event loop that stages the lazy save.
                loss = await anyio.to_thread.run_sync(train_step, model, opt, step)
                if step > SAVE_STEP:
                    losses.append(loss)
                if step == SAVE_STEP:
                    msd, osd = get_state_dict(model, opt)
                    # The same state through DCP's async_save and our writer, on a
                    # side group (never the default group that training's
                    # all-gathers use). It stages a copy before returning; a worker
                    # thread keeps the event loop free meanwhile.
                    fut = await anyio.to_thread.run_sync(
                        functools.partial(
                            asyncsave.dcp.async_save,
                            {"model": msd, "optim": osd},
                            storage_writer=StorageWriter(root + "-dcp", step),
                        )
                    )
                    handle = await ckpt.save(step, {"model": msd, "optim": osd}, lazy=True)
            hook.remove()
            await handle  # committed by both ranks, tracker moved
            await anyio.to_thread.run_sync(fut.result)  # the DCP copy: committed
        return losses

    return anyio.run(main)


def resume_and_train(rank: int, world_size: int, root: str) -> list[float]:
    """Load the latest checkpoint under ``root`` into ``world_size`` ranks and train
    the remaining steps: their losses."""
    model, opt = build(world_size)
    msd, osd = get_state_dict(model, opt)
    state: dict[str, Any] = {"model": msd, "optim": osd}
    reader = StorageReader(root)
    dcp.load(state, storage_reader=reader)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    step = int(reader.checkpoint_dir().name.removeprefix("step_"))
    return [train_step(model, opt, s) for s in range(step + 1, TOTAL_STEPS + 1)]


def main(root: str) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    from distributed import run_ranks, values

    tmp = Path(root).parent
    tmp.mkdir(parents=True, exist_ok=True)
    trained = values(run_ranks(train_and_save, 2, tmp, root))
    print("trained on 2 ranks, losses after the save:", trained[0])
    on_two = values(run_ranks(resume_and_train, 2, tmp, root))
    print("resumed on 2 ranks:                       ", on_two[0])
    on_one = values(run_ranks(resume_and_train, 1, tmp, root))
    print("resumed on 1 rank (resharded):            ", on_one[0])
    from_dcp = values(run_ranks(resume_and_train, 1, tmp, root + "-dcp"))
    print("resumed on 1 rank from dcp.async_save:    ", from_dcp[0])


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "/tmp/asyncsave-fsdp2/run")
