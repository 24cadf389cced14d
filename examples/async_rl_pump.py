"""An async RL-style train pump: a rollout producer and a trainer consumer connected
by an anyio memory stream, a TensorDict replay buffer with sample ids, a prompt
cursor, saves by policy, and SIGTERM handling.

What this example demonstrates:

* The **producer** walks a prompt cursor and turns each prompt into a rollout
  sample (an id, an observation drawn from the current policy's noise, a reward)
  sent over a bounded memory stream. It runs ahead of the trainer.
* The **trainer** moves received samples into a FIFO TensorDict replay buffer and
  trains on the oldest ``--batch`` samples when enough are there: one optimizer
  step per batch. The ids it trains on are appended to ``trained.jsonl``.
* What is saved is **one snapshot** at a step boundary: the model, the optimizer,
  the replay buffer, the *consumed* prompt cursor (the prompts whose samples made it
  into the buffer — not the producer's own position, which runs ahead: samples in
  flight in the stream at save time are regenerated after resume, never lost,
  never duplicated), the RNG streams and the step (a cursor and a buffer captured at
  different moments skipped or replayed prompts after resume: https://github.com/NVIDIA-NeMo/RL/pull/3599).
* Saves follow a policy: every ``--save-every`` steps, at the last step, and on
  SIGTERM (preemption: save at the next step boundary, then stop). Checkpoints are
  named after the last trained step; nothing is saved at step 0 (as the SkyRL
  fully-async checkpoint fix settled). Once the policy has caught a SIGTERM, its
  handler stays installed past its ``with`` block until the checkpointer's close
  has flushed that save: a SIGTERM the scheduler repeats meanwhile is absorbed
  instead of killing the process with the save uncommitted.
* Retention keeps the last ``--keep`` checkpoints; the layout is selectable
  (``--layout verl``, ...).

Usage::

    python examples/async_rl_pump.py --root runs/rl --steps 200 --step-sleep 0.05  # kill -TERM it
    python examples/async_rl_pump.py --root runs/rl --steps 200                    # resumes

After a SIGTERM the process saves, prints a summary and exits 0; the rerun resumes
from that step. ``summary.json`` holds the run's steps, saves and resume point.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import anyio
import torch
from tensordict import TensorDict
from torch import nn

import asyncsave

OBS = 8


class PromptCursor:
    """A dataloader position (the ``StatefulDataLoader`` protocol): the index of
    the next prompt whose sample has not reached the replay buffer."""

    def __init__(self) -> None:
        self.position = 0

    def state_dict(self) -> dict[str, int]:
        return {"position": self.position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.position = int(state["position"])


def empty_buffer() -> TensorDict:
    return TensorDict(
        {
            "id": torch.zeros(0, dtype=torch.int64),
            "obs": torch.zeros(0, OBS),
            "reward": torch.zeros(0),
        },
        batch_size=[0],
    )


def rollout(policy: nn.Module, prompt_id: int, seed: int) -> dict[str, torch.Tensor]:
    """One sample for ``prompt_id``: deterministic in the prompt and the seed."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + prompt_id)
    obs = torch.randn(OBS, generator=g)
    with torch.no_grad():
        reward = -float((policy(obs) - obs.sum()).pow(2))
    return {"id": torch.tensor(prompt_id), "obs": obs, "reward": torch.tensor(reward)}


async def producer(
    send: anyio.abc.ObjectSendStream[dict[str, torch.Tensor]],
    policy: nn.Module,
    start: int,
    seed: int,
) -> None:
    async with send:
        prompt_id = start
        while True:
            await send.send(rollout(policy, prompt_id, seed))
            prompt_id += 1


class Trainer:
    """Moves samples into the FIFO replay buffer and trains on full batches."""

    def __init__(
        self,
        policy: nn.Module,
        optim: torch.optim.Optimizer,
        cursor: PromptCursor,
        buffer: TensorDict,
        step: int,
        log: Any,
        batch: int,
    ) -> None:
        self.policy, self.optim, self.cursor = policy, optim, cursor
        self.buffer, self.step, self.log, self.batch = buffer, step, log, batch

    async def consume(self, sample: dict[str, torch.Tensor]) -> bool:
        """Add ``sample`` to the buffer; train one step if a batch is full."""
        row = TensorDict(sample, batch_size=[]).unsqueeze(0)
        self.buffer = torch.cat([self.buffer, row])
        self.cursor.position = int(sample["id"]) + 1  # consumed into the buffer
        if self.buffer.batch_size[0] < self.batch:
            return False
        batch, self.buffer = self.buffer[: self.batch], self.buffer[self.batch :]
        loss = (self.policy(batch["obs"]) - batch["obs"].sum(-1)).pow(2).mean()
        loss = loss - 0.01 * batch["reward"].mean()
        self.optim.zero_grad()
        loss.backward()
        self.optim.step()
        self.step += 1
        self.log.write(json.dumps({"step": self.step, "ids": batch["id"].tolist()}) + "\n")
        self.log.flush()
        return True

    def state(self) -> dict[str, Any]:
        """One snapshot: model, optimizer, buffer and cursor at the same step."""
        return {
            "policy": self.policy,
            "optim": self.optim,
            "buffer": self.buffer,
            "cursor": self.cursor,
            "step": self.step,
        }


async def run(args: argparse.Namespace) -> dict[str, Any]:
    root = Path(args.root)
    torch.manual_seed(args.seed)
    policy = nn.Sequential(nn.Linear(OBS, 32), nn.Tanh(), nn.Linear(32, 1), nn.Flatten(0))
    optim = torch.optim.Adam(policy.parameters(), lr=1e-3)
    cursor = PromptCursor()
    rng = asyncsave.RNGState()
    saves: list[int] = []
    save_policy = (
        asyncsave.SaveEvery(args.save_every)
        | asyncsave.SaveAtStep(args.steps)
        | asyncsave.SaveOnSignal(signal.SIGTERM)
    )
    root.mkdir(parents=True, exist_ok=True)
    log = (root / "trained.jsonl").open("a")
    async with asyncsave.Checkpointer(
        root, layout=args.layout, retention=asyncsave.KeepLast(args.keep)
    ) as ckpt:
        restored = await ckpt.load_latest(
            {"policy": policy, "optim": optim, "cursor": cursor, "rng": rng},
            required=["policy", "optim", "cursor", "buffer", "step"],
        )
        step = 0 if restored is None else restored.state["step"]
        buffer = empty_buffer() if restored is None else restored.state["buffer"]
        resumed_from = None if restored is None else step
        # The log may hold steps trained after the checkpoint (lost with the crash):
        # they are trained again, so mark where this run's history starts.
        log.write(json.dumps({"resume": resumed_from}) + "\n")
        send, receive = anyio.create_memory_object_stream[dict[str, torch.Tensor]](args.stream)
        trainer = Trainer(policy, optim, cursor, buffer, step, log, args.batch)
        with save_policy, receive:
            async with anyio.create_task_group() as tg:
                tg.start_soon(producer, send, policy, cursor.position, args.seed)
                while trainer.step < args.steps:
                    if not await trainer.consume(await receive.receive()):
                        continue  # not a full batch yet
                    if args.step_sleep:
                        await anyio.sleep(args.step_sleep)
                    if save_policy.should_save(trainer.step):
                        state = {**trainer.state(), "rng": rng}
                        info = {"consumed_prompts": cursor.position}
                        await ckpt.save(trainer.step, state, training_info=info)
                        saves.append(trainer.step)
                    if save_policy.stop_requested:
                        break
                tg.cancel_scope.cancel()  # stop the producer: its samples are regenerated
        step = trainer.step
        await ckpt.wait()
    log.close()
    summary = {
        "resumed_from": resumed_from,
        "last_step": step,
        "saves": saves,
        "stopped_by_signal": save_policy.stop_requested,
        "finished": step >= args.steps,
    }
    (root / "summary.json").write_text(json.dumps(summary))
    return summary


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--root", default="runs/async_rl")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--save-every", type=int, default=25)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--stream", type=int, default=8, help="memory stream capacity (samples)")
    p.add_argument("--keep", type=int, default=2, help="retention: keep the last K")
    p.add_argument(
        "--layout",
        default="asyncsave",
        choices=["asyncsave", "verl", "megatron", "skyrl", "nemo-rl"],
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--step-sleep", type=float, default=0.0, help="seconds per step (demo pacing)")
    p.add_argument("--backend", choices=["asyncio", "trio"], default="asyncio")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    t0 = time.perf_counter()
    s = anyio.run(run, args, backend=args.backend)
    how = "stopped by SIGTERM" if s["stopped_by_signal"] else "finished"
    print(
        f"{how} at step {s['last_step']} (resumed from {s['resumed_from']}); "
        f"saved steps {s['saves']}; {time.perf_counter() - t0:.1f} s"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
