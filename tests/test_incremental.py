"""Incremental saves (issue 14): bytes equal to the previous commit's are shared,
never written again, and a changed byte is never shared.

What is shared is decided from checksums of the staged bytes (never Python
identity): every test here changes tensors *in place* (the same objects), so
identity could not tell, and checks the result on disk (inode numbers, the
manifest's ``incremental`` report) and by loading bit-exact.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import anyio
import pytest
import torch
from hypothesis import given
from hypothesis import settings as hsettings
from hypothesis import strategies as st

import asyncsave

OWN = 1 << 20  # asyncsave._incremental.OWN_FILE_BYTES: a tensor this large has its own file


def lora_state(seed: int = 0) -> dict[str, Any]:
    """A small LoRA-shaped state: frozen base weights (own files), adapters and
    their optimizer moments (small, packed), a plain step."""
    g = torch.Generator().manual_seed(seed)
    return {
        "model": {
            "base.0": torch.randn(OWN // 4, generator=g),
            "base.1": torch.randn(OWN // 2, generator=g).to(torch.bfloat16).view(-1, 64),
            "base.2": torch.randint(0, 255, (OWN + 7,), generator=g, dtype=torch.uint8),
            "lora_A": torch.randn(16, 64, generator=g),
            "lora_B": torch.zeros(64, 16),
            "norm": torch.ones(64),
        },
        "optim": {"exp_avg": torch.zeros(16, 64), "step": torch.tensor(0.0)},
        "trainer": {"step": 0},
    }


def manifest(path: Path) -> dict[str, Any]:
    return json.loads((path / "manifest.json").read_bytes())


def inode_of(path: Path, key: str) -> int:
    """The inode of the data file holding the tensor ``key``."""
    m = manifest(path)
    rec = next(t for t in m["tensors"] if t["key"] == key)
    name = m["files"][m["entries"][rec["entry"]]["file"]]["name"]
    return os.stat(path / name).st_ino


def keys(state: dict[str, Any]) -> list[str]:
    return [f"model/{k}" for k in state["model"]] + [
        f"optim/{k}" for k in state["optim"] if isinstance(state["optim"][k], torch.Tensor)
    ]


def assert_equal_tree(a: Any, b: Any) -> None:
    if isinstance(b, dict):
        assert a.keys() == b.keys()
        for k in b:
            assert_equal_tree(a[k], b[k])
    elif isinstance(b, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
    else:
        assert a == b


@pytest.mark.anyio
async def test_unchanged_tensors_are_hard_linked_and_changed_ones_written(tmp_path: Path) -> None:
    state = lora_state()
    async with asyncsave.Checkpointer(tmp_path, incremental=True) as ckpt:
        await (await ckpt.save(1, state))
        # In place: the same tensor objects, new bytes in the adapters only.
        state["model"]["lora_A"].add_(1.0)
        state["optim"]["exp_avg"].add_(0.5)
        state["trainer"]["step"] = 2
        await (await ckpt.save(2, state))
        # One byte of one frozen weight flips: its file is written, not shared.
        state["model"]["base.2"][OWN // 2] ^= 1
        await (await ckpt.save(3, state))
    s1, s2, s3 = (tmp_path / f"step_{s}" for s in (1, 2, 3))
    for k in ("model/base.0", "model/base.1", "model/base.2"):
        assert inode_of(s1, k) == inode_of(s2, k)
    assert inode_of(s1, "model/lora_A") != inode_of(s2, "model/lora_A")
    assert inode_of(s2, "model/base.2") != inode_of(s3, "model/base.2")
    assert inode_of(s2, "model/base.0") == inode_of(s3, "model/base.0")
    report = manifest(s2)["incremental"]
    assert report["base"] == "step_1" and report["files_shared"] == 3
    total = sum(f["nbytes"] for f in manifest(s2)["files"])
    assert report["bytes_written"] + report["bytes_shared"] == total
    assert report["bytes_written"] < 0.02 * total
    for s in (s1, s2, s3):
        asyncsave.verify(s)
    assert_equal_tree(asyncsave.load(s3), state)


@pytest.mark.anyio
async def test_off_by_default_every_file_is_written(tmp_path: Path) -> None:
    state = lora_state()
    async with asyncsave.Checkpointer(tmp_path) as ckpt:
        await (await ckpt.save(1, state))
        await (await ckpt.save(2, state))
    assert "incremental" not in manifest(tmp_path / "step_2")
    assert inode_of(tmp_path / "step_1", "model/base.0") != inode_of(
        tmp_path / "step_2", "model/base.0"
    )


@pytest.mark.anyio
async def test_retention_deletes_the_base_and_the_later_checkpoint_loads_bit_exact(
    tmp_path: Path,
) -> None:
    state = lora_state()
    async with asyncsave.Checkpointer(
        tmp_path, incremental=True, retention=asyncsave.KeepLast(1)
    ) as ckpt:
        for step in (1, 2, 3):
            state["model"]["lora_B"].add_(1.0)
            await (await ckpt.save(step, state))
            assert sorted(p.name for p in tmp_path.glob("step_*")) == [f"step_{step}"]
    assert manifest(tmp_path / "step_3")["incremental"]["files_shared"] == 3
    asyncsave.verify(tmp_path / "step_3")
    assert_equal_tree(asyncsave.load(tmp_path / "step_3"), state)
    # A fresh process (nothing remembered) shares from it too, after reading it back.
    async with asyncsave.Checkpointer(tmp_path, incremental=True) as ckpt:
        assert (await ckpt.load_latest()) is not None
        await (await ckpt.save(4, state))
    report = manifest(tmp_path / "step_4")["incremental"]
    assert report["files_shared"] == 4 and report["bytes_verified"] > 3 * OWN
    assert_equal_tree(asyncsave.load(tmp_path / "step_4"), state)


def flip_byte(path: Path, offset: int, *, keep_mtime: bool) -> None:
    st = os.stat(path)
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x10]))
    if keep_mtime:  # a damage the file's identity does not show
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


@pytest.mark.anyio
@pytest.mark.parametrize("fresh", [False, True], ids=["same-checkpointer", "fresh-checkpointer"])
async def test_a_damaged_base_file_is_never_shared(tmp_path: Path, fresh: bool) -> None:
    state = lora_state()
    ckpt = asyncsave.Checkpointer(tmp_path, incremental=True)
    async with ckpt:
        await (await ckpt.save(1, state))
        m = manifest(tmp_path / "step_1")
        rec = next(t for t in m["tensors"] if t["key"] == "model/base.0")
        entry = m["entries"][rec["entry"]]
        damaged = tmp_path / "step_1" / m["files"][entry["file"]]["name"]
        flip_byte(damaged, entry["offset"] + 1000, keep_mtime=fresh)
        if not fresh:
            await (await ckpt.save(2, state))
    if fresh:
        async with asyncsave.Checkpointer(tmp_path, incremental=True) as ckpt:
            await (await ckpt.save(2, state))
    s2 = tmp_path / "step_2"
    assert os.stat(damaged).st_ino != inode_of(s2, "model/base.0")
    assert inode_of(tmp_path / "step_1", "model/base.1") == inode_of(s2, "model/base.1")
    asyncsave.verify(s2)  # the damage did not propagate
    assert_equal_tree(asyncsave.load(s2), state)
    with pytest.raises(asyncsave.CorruptCheckpointError):
        asyncsave.verify(tmp_path / "step_1")


@pytest.mark.anyio
async def test_new_removed_and_reshaped_tensors_are_written(tmp_path: Path) -> None:
    state = lora_state()
    async with asyncsave.Checkpointer(tmp_path, incremental=True) as ckpt:
        await (await ckpt.save(1, state))
        # Same bytes, another shape: its safetensors header differs, so a new file.
        state["model"]["base.1"] = state["model"]["base.1"].view(-1, 32)
        state["model"]["extra"] = torch.randn(OWN // 4)
        del state["model"]["base.2"]
        await (await ckpt.save(2, state))
    s1, s2 = tmp_path / "step_1", tmp_path / "step_2"
    assert inode_of(s1, "model/base.0") == inode_of(s2, "model/base.0")
    assert inode_of(s1, "model/base.1") != inode_of(s2, "model/base.1")
    assert inode_of(s1, "model/lora_A") == inode_of(s2, "model/lora_A")  # the small ones' pack
    assert manifest(s2)["incremental"]["files_shared"] == 2
    assert_equal_tree(asyncsave.load(s2), state)


@hsettings(max_examples=12, deadline=None)
@given(
    changes=st.lists(
        st.lists(
            st.tuples(st.integers(0, 6), st.integers(0, OWN - 1), st.integers(1, 255)),
            max_size=4,
        ),
        min_size=1,
        max_size=3,
    ),
    backend=st.sampled_from(["asyncio", "trio"]),
)
def test_a_changed_tensor_is_never_shared(
    tmp_path_factory: pytest.TempPathFactory,
    changes: list[list[tuple[int, int, int]]],
    backend: str,
) -> None:
    """Random subsets of tensors change between saves, down to one byte (XOR
    with a non-zero value, so the byte always differs); every tensor's file is
    shared exactly when its bytes did not change, and every save loads bit-exact.
    """
    root = tmp_path_factory.mktemp("incr")
    state = lora_state()
    names = keys(state)

    async def run() -> None:
        async with asyncsave.Checkpointer(root, incremental=True) as ckpt:
            await (await ckpt.save(1, state))
            for step, round_ in enumerate(changes, start=2):
                changed = set()
                for which, at, xor in round_:
                    key = names[which % len(names)]
                    group, name = key.split("/")
                    raw = state[group][name].view(-1).view(torch.uint8)
                    raw[at % raw.numel()] ^= xor
                    changed.add(key)
                await (await ckpt.save(step, state))
                prev, new = root / f"step_{step - 1}", root / f"step_{step}"
                for key in names:
                    if key in changed:
                        assert inode_of(prev, key) != inode_of(new, key), key
                    elif state[key.split("/")[0]][key.split("/")[1]].nbytes >= OWN:
                        assert inode_of(prev, key) == inode_of(new, key), key
                assert_equal_tree(asyncsave.load(new), state)

    anyio.run(run, backend=backend)
