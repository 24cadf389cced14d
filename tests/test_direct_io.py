"""O_DIRECT writes of data files: same bytes as buffered writes, used where the file
system allows it, buffered where it does not."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import asyncsave
from asyncsave import LocalFileSystem

pytestmark = pytest.mark.anyio


class SpyFS(LocalFileSystem):
    def __init__(self, refuse: bool = False) -> None:
        self.refuse = refuse
        self.direct_opens: list[str] = []

    def open_direct(self, path: Path) -> int | None:
        if self.refuse:
            return None  # as tmpfs does
        fd = super().open_direct(path)
        if fd is not None:
            self.direct_opens.append(path.name)
        return fd


def state_of() -> dict[str, Any]:
    g = torch.Generator().manual_seed(5)
    return {
        "big": torch.randn(300_001, generator=g),  # bulk + a partial last block
        "small": torch.randn(3, generator=g).to(torch.float16),
        "ints": torch.arange(1000),
        "empty": torch.zeros(0),
    }


def data_bytes(path: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(path.iterdir()) if p.suffix == ".safetensors"}


async def test_direct_and_buffered_writes_give_identical_files(tmp_path: Path) -> None:
    state = state_of()
    spy = SpyFS()
    async with asyncsave.Checkpointer(tmp_path / "d", filesystem=spy) as ckpt:
        await (await ckpt.save(1, state))
    async with asyncsave.Checkpointer(tmp_path / "b", direct_io=False) as ckpt:
        await (await ckpt.save(1, state))
    if not spy.direct_opens:
        pytest.fail(f"O_DIRECT was not used on {tmp_path} (file system refuses it?)")
    assert data_bytes(tmp_path / "d" / "step_1") == data_bytes(tmp_path / "b" / "step_1")
    out = asyncsave.load(tmp_path / "d" / "step_1")
    for k, v in state.items():
        assert torch.equal(out[k], v), k


async def test_a_file_system_without_o_direct_gets_buffered_writes(tmp_path: Path) -> None:
    state = state_of()
    spy = SpyFS(refuse=True)
    async with asyncsave.Checkpointer(tmp_path, filesystem=spy) as ckpt:
        await (await ckpt.save(1, state))
    assert spy.direct_opens == []
    asyncsave.verify(tmp_path / "step_1")
    assert torch.equal(asyncsave.load(tmp_path / "step_1")["big"], state["big"])


def test_data_starts_on_a_4096_byte_boundary_and_safetensors_reads_it(tmp_path: Path) -> None:
    import struct

    from safetensors import safe_open

    with asyncsave.SyncCheckpointer(tmp_path) as ckpt:
        ckpt.save(1, state_of()).result()
    f = next(p for p in (tmp_path / "step_1").iterdir() if p.suffix == ".safetensors")
    (n,) = struct.unpack("<Q", f.read_bytes()[:8])
    assert (8 + n) % 4096 == 0
    with safe_open(str(f), framework="pt") as st:
        assert torch.equal(st.get_tensor("big"), state_of()["big"])
