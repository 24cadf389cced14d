"""The fast read path: zero-copy mmap loads, copy-on-write, reading a few tensors of
a checkpoint without the rest."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

import asyncsave

pytestmark = pytest.mark.anyio


async def saved(tmp_path: Path, state: dict[str, Any]) -> Path:
    async with asyncsave.Checkpointer(tmp_path) as ckpt:
        info = await (await ckpt.save(1, state))
    assert info is not None
    return info.path


def state_of() -> dict[str, Any]:
    g = torch.Generator().manual_seed(0)
    w = torch.randn(64, 32, generator=g)
    return {
        "model": {"w": w, "tied": w, "b": torch.randn(32, generator=g)},
        "optim": {"state": {0: {"exp_avg": torch.randn(64, 32, generator=g)}}},
        "big": torch.randn(1 << 16, generator=g),
        "step": 3,
    }


def mapped_files() -> dict[tuple[int, int], str]:
    out = {}
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split()
            if len(parts) >= 6:
                lo, hi = (int(x, 16) for x in parts[0].split("-"))
                out[(lo, hi)] = parts[5]
    return out


def mapping_of(ptr: int) -> str | None:
    for (lo, hi), name in mapped_files().items():
        if lo <= ptr < hi:
            return name
    return None


def corrupt_entry(path: Path, name: str) -> None:
    """Flip a byte in the middle of entry ``name`` of the checkpoint at ``path``."""
    manifest = json.loads((path / "manifest.json").read_text())
    e = next(e for e in manifest["entries"] if e["name"] == name)
    fpath = path / manifest["files"][e["file"]]["name"]
    with open(fpath, "r+b") as f:
        f.seek(e["offset"] + e["nbytes"] // 2)
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ 0xFF]))


async def test_cpu_loads_are_views_of_the_mapped_data_file(tmp_path: Path) -> None:
    path = await saved(tmp_path, state_of())
    out = asyncsave.load(path)
    where = mapping_of(out["big"].data_ptr())
    assert where is not None and where.startswith(str(path)) and where.endswith(".safetensors")
    # One storage per entry: untied tensors do not share memory.
    assert out["big"].untyped_storage().data_ptr() != out["model"]["b"].untyped_storage().data_ptr()
    assert out["big"].untyped_storage().nbytes() == (1 << 16) * 4


async def test_writing_into_a_loaded_tensor_never_changes_the_file(tmp_path: Path) -> None:
    state = state_of()
    path = await saved(tmp_path, state)
    out = asyncsave.load(path)
    out["big"].fill_(0.0)
    out["model"]["w"].add_(1.0)
    assert torch.equal(out["model"]["tied"], state["model"]["w"] + 1.0)  # still tied
    asyncsave.verify(path)
    again = asyncsave.load(path)
    assert torch.equal(again["big"], state["big"])
    assert torch.equal(again["model"]["w"], state["model"]["w"])


async def test_load_tensors_reads_only_the_tensors_asked_for(tmp_path: Path) -> None:
    state = state_of()
    path = await saved(tmp_path, state)
    corrupt_entry(path, "big")  # a load that read it would fail its checksum
    with pytest.raises(asyncsave.ChecksumMismatchError):
        asyncsave.load(path)
    got = asyncsave.load_tensors(path, ["model/b", "optim/state/0"])
    assert set(got) == {"model/b", "optim/state/0/exp_avg"}
    assert torch.equal(got["model/b"], state["model"]["b"])
    assert torch.equal(got["optim/state/0/exp_avg"], state["optim"]["state"][0]["exp_avg"])
    with pytest.raises(asyncsave.ChecksumMismatchError) as info:
        asyncsave.load_tensors(path, ["big"])
    assert info.value.key == "big"
    unchecked = asyncsave.load_tensors(path, ["big"], verify=False)["big"]
    assert unchecked.shape == (1 << 16,) and not torch.equal(unchecked, state["big"])


async def test_load_tensors_keeps_tied_tensors_tied_and_names_missing_keys(
    tmp_path: Path,
) -> None:
    state = state_of()
    path = await saved(tmp_path, state)
    got = asyncsave.load_tensors(path, ["model/w", "model/tied"])
    assert (
        got["model/w"].untyped_storage().data_ptr()
        == got["model/tied"].untyped_storage().data_ptr()
    )
    assert torch.equal(got["model/tied"], state["model"]["w"])
    with pytest.raises(asyncsave.MissingItemError) as info:
        asyncsave.load_tensors(path, ["model/nope"])
    assert info.value.key == "model/nope"
    with pytest.raises(asyncsave.MissingItemError):
        asyncsave.load_tensors(path, ["step"])  # a plain leaf, not a tensor
    with pytest.raises(TypeError):
        asyncsave.load_tensors(path, "model/w")  # type: ignore[arg-type]


async def test_a_truncated_data_file_is_a_typed_error_on_the_mmap_path(tmp_path: Path) -> None:
    path = await saved(tmp_path, state_of())
    data = next(p for p in path.iterdir() if p.suffix == ".safetensors")
    with open(data, "r+b") as f:
        f.truncate(data.stat().st_size - 100)
    with pytest.raises(asyncsave.CorruptCheckpointError):
        asyncsave.load(path)
    with pytest.raises(asyncsave.CorruptCheckpointError):
        asyncsave.load_tensors(path, ["model/b"])
