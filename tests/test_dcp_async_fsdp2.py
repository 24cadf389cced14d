"""FSDP2 trains while ``asyncsave.dcp.async_save`` runs, on 2 gloo ranks.

DCP's ``async_save`` on the default group runs the save's collectives in a
background thread on the group FSDP2's all-gathers use, and the ranks hang or
abort with gloo's "collective mismatch" (the kind of pytorch/pytorch reports on
async_save deadlocks). ``asyncsave.dcp.async_save`` runs them on a gloo side group;
these tests hold the save inside its write (a gate in the writer's file system)
while training steps run, so the save's last collectives always overlap training.
"""

from __future__ import annotations

import sys
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_state_dict,
)

import asyncsave
import asyncsave.dcp
from asyncsave import LocalFileSystem
from asyncsave.dcp import StorageReader, StorageWriter

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parent.parent / "examples"))
import fsdp2_train as ex
from distributed import run_ranks, values

TRACKER = "latest_checkpointed_iteration.txt"


class _Gate(LocalFileSystem):
    """Holds every data file's creation (inside the save's ``write_data``, between
    its plan and its write collectives) until :attr:`open` is set."""

    def __init__(self) -> None:
        self.open = threading.Event()

    def create(self, path: Path) -> int:
        if not self.open.wait(timeout=120):
            raise TimeoutError("the gate was never opened")
        return super().create(path)


def _full(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The unsharded model state on CPU (a collective on the default group)."""
    opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
    full = get_model_state_dict(model, options=opts)
    return {k: v.clone() for k, v in full.items() if isinstance(v, torch.Tensor)}


def _save(model: Any, opt: Any, root: str, step: int, fs: LocalFileSystem) -> Any:
    msd, osd = get_state_dict(model, opt)
    return asyncsave.dcp.async_save(
        {"model": msd, "optim": osd}, storage_writer=StorageWriter(root, step, filesystem=fs)
    )


def _train_while_saving(rank: int, world_size: int, root: str) -> dict[str, Any]:
    """Two async saves (steps 2 and 6), each held in its write while the next
    training steps run; the second call waits for the first save."""
    model, opt = ex.build(world_size)
    step, seen, saved = 0, {}, {}
    for save_at in (2, 6):
        while step < save_at:
            step += 1
            ex.train_step(model, opt, step)
        saved[save_at] = _full(model)
        gate = _Gate()
        fut = _save(model, opt, root, save_at, gate)
        for _ in range(2):  # the save is held in its write: training runs meanwhile
            step += 1
            ex.train_step(model, opt, step)
        seen[save_at] = fut.done()
        gate.open.set()
        step += 1
        ex.train_step(model, opt, step)  # overlaps the save's write collectives
    fut.result(timeout=120)
    loaded = {}
    for s in (2, 6):
        fresh, fresh_opt = ex.build(world_size)
        msd, osd = get_state_dict(fresh, fresh_opt)
        dcp.load({"model": msd, "optim": osd}, storage_reader=StorageReader(f"{root}/step_{s}"))
        set_state_dict(fresh, fresh_opt, model_state_dict=msd, optim_state_dict=osd)
        full = _full(fresh)
        loaded[s] = all(torch.equal(full[k], saved[s][k]) for k in saved[s])
    return {"done_while_held": seen, "loaded_equal": loaded, "steps": step}


@pytest.mark.slow
def test_fsdp2_trains_while_async_saves_run_on_the_side_group(tmp_path: Path) -> None:
    root = str(tmp_path / "run")
    out = values(run_ranks(_train_while_saving, 2, tmp_path, root, timeout_s=300))
    for rank_out in out:
        assert rank_out["done_while_held"] == {2: False, 6: False}, rank_out
        assert rank_out["loaded_equal"] == {2: True, 6: True}, rank_out
        assert rank_out["steps"] == 9
    for s in (2, 6):
        assert asyncsave.verify(Path(root) / f"step_{s}").world_size == 2
    assert (Path(root) / TRACKER).read_text().strip() == "6"


def _default_group_refused(rank: int, world_size: int, root: str) -> list[str]:
    """Passing the default group is refused before any collective, however named."""
    from torch.distributed.distributed_c10d import _get_default_group

    messages = []
    for group in (dist.group.WORLD, _get_default_group()):
        try:
            asyncsave.dcp.async_save(
                {"w": torch.ones(4)}, storage_writer=StorageWriter(root, 1), process_group=group
            )
        except asyncsave.CheckpointError as exc:
            messages.append(str(exc))
    side = asyncsave.dcp.side_group()
    assert side is asyncsave.dcp.side_group() and side is not dist.group.WORLD
    assert dist.get_world_size(side) == world_size
    # Both ranks through the side group's setup before either exits: a rank that
    # exits while its peer still connects its gloo mesh fails the peer's
    # new_group ("Connection closed by peer").
    dist.barrier(group=side)
    return messages


def test_async_save_refuses_the_default_group_before_any_collective(tmp_path: Path) -> None:
    root = tmp_path / "run"
    out = values(run_ranks(_default_group_refused, 2, tmp_path, str(root)))
    for messages in out:
        assert len(messages) == 2
        assert all("default process group" in m and "side_group()" in m for m in messages)
    assert not root.exists()  # nothing was begun


def test_side_group_without_torch_distributed_is_none(tmp_path: Path) -> None:
    """One process: no group, and async_save saves (DCP runs no collective)."""
    assert not dist.is_initialized()
    assert asyncsave.dcp.side_group() is None
    root = tmp_path / "run"
    fut = asyncsave.dcp.async_save(
        {"w": torch.arange(4.0)}, storage_writer=StorageWriter(str(root), 3)
    )
    fut.result(timeout=60)
    out = {"w": torch.zeros(4)}
    dcp.load(out, storage_reader=StorageReader(str(root)))
    assert torch.equal(out["w"], torch.arange(4.0))
