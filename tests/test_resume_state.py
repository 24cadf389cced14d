"""Full resume state: RNG streams, a StatefulDataLoader position, counters and a
replay buffer restored in one snapshot; items that must be there; kind tags."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from tensordict import TensorDict
from torchdata.stateful_dataloader import StatefulDataLoader

import asyncsave

pytestmark = pytest.mark.anyio


def _draws(gen: torch.Generator, npgen: np.random.Generator) -> list[Any]:
    return [
        random.random(),
        float(np.random.rand()),
        torch.rand(3).tolist(),
        torch.randn(2, generator=gen).tolist(),
        float(npgen.random()),
    ]


async def test_rng_streams_continue_exactly_after_resume(tmp_path: Path) -> None:
    gen, npgen = torch.Generator().manual_seed(7), np.random.default_rng(3)
    random.seed(1)
    np.random.seed(2)
    torch.manual_seed(3)
    _draws(gen, npgen)  # advance everything a bit
    async with asyncsave.Checkpointer(tmp_path) as ckpt:
        await (await ckpt.save(1, {"rng": asyncsave.RNGState(sampler=gen, rollout=npgen)}))
    expected = _draws(gen, npgen)

    random.seed(99)  # a new process would start from other states
    np.random.seed(99)
    torch.manual_seed(99)
    gen2, npgen2 = torch.Generator().manual_seed(0), np.random.default_rng(0)
    template = {"rng": asyncsave.RNGState(sampler=gen2, rollout=npgen2)}
    async with asyncsave.Checkpointer(tmp_path) as ckpt:
        assert await ckpt.load_latest(template) is not None
    assert _draws(gen2, npgen2) == expected


async def test_rng_state_with_other_generators_is_a_typed_error(tmp_path: Path) -> None:
    async with asyncsave.Checkpointer(tmp_path) as ckpt:
        await (await ckpt.save(1, {"rng": asyncsave.RNGState(a=torch.Generator())}))
        with pytest.raises(asyncsave.InvalidStateError, match="generators"):
            await ckpt.load_latest({"rng": asyncsave.RNGState()})
    with pytest.raises(TypeError):
        asyncsave.RNGState(a=random.Random())  # type: ignore[arg-type]


async def test_stateful_dataloader_resumes_mid_epoch(tmp_path: Path) -> None:
    """torchdata's StatefulDataLoader, shuffled: the batches after resume are the ones
    an uninterrupted run would have seen."""

    def loader() -> StatefulDataLoader:
        return StatefulDataLoader(
            list(range(40)), batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(5)
        )

    reference = [b.tolist() for b in loader()]
    dl = loader()
    it = iter(dl)
    seen = [next(it).tolist() for _ in range(4)]
    assert seen == reference[:4]
    async with asyncsave.Checkpointer(tmp_path) as ckpt:
        await (await ckpt.save(4, {"loader": dl, "step": 4}))
    dl2 = loader()
    async with asyncsave.Checkpointer(tmp_path) as ckpt:
        restored = await ckpt.load_latest({"loader": dl2})
    assert restored is not None and restored.state["step"] == 4
    assert [b.tolist() for b in dl2] == reference[4:]


async def test_one_snapshot_holds_cursor_buffer_and_counters_s7(tmp_path: Path) -> None:
    """S7: the cursor and the replay buffer come from one snapshot: every sample id
    is either consumed by the cursor and in the buffer, or not yet produced."""
    buffer = TensorDict({"id": torch.arange(1000), "obs": torch.randn(1000, 4)}, batch_size=[1000])
    state = {"cursor": 1000, "buffer": buffer, "counters": {"episodes": 250, "tokens": 10**12}}
    async with asyncsave.Checkpointer(tmp_path) as ckpt:
        await (await ckpt.save(10, state))
        buffer["id"] += 1000  # mutated right after save() returned (S11)
        state["cursor"] = 2000
    restored = asyncsave.load(tmp_path / "step_10")
    assert restored["cursor"] == 1000
    assert torch.equal(restored["buffer"]["id"], torch.arange(1000))
    assert restored["counters"] == {"episodes": 250, "tokens": 10**12}


async def test_a_missing_required_item_is_named_s17(tmp_path: Path) -> None:
    async with asyncsave.Checkpointer(tmp_path) as ckpt:
        await (await ckpt.save(3, {"model": {"w": torch.ones(2)}}))
        with pytest.raises(asyncsave.MissingItemError, match="dataloader"):
            await ckpt.load_latest(required=["dataloader"])


async def test_a_replay_buffer_of_another_kind_is_refused_s17(tmp_path: Path) -> None:
    buf = TensorDict({"x": torch.zeros(8)}, batch_size=[8])
    async with asyncsave.Checkpointer(tmp_path) as ckpt:
        await (await ckpt.save(3, {"replay": asyncsave.Tagged(buf, kind="uniform-v1")}))
        with pytest.raises(asyncsave.KindMismatchError, match="prioritized-v1"):
            await ckpt.load_latest({"replay": asyncsave.Tagged(buf.clone(), kind="prioritized-v1")})
        restored = await ckpt.load_latest({"replay": asyncsave.Tagged(None, kind="uniform-v1")})
    assert restored is not None
