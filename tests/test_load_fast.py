"""The fast read path: zero-copy mmap loads, copy-on-write, reading a few tensors of
a checkpoint without the rest."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
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


# -- reading ahead while the manifest is parsed ------------------------------------
class _Recording(asyncsave.LocalFileSystem):
    """Records the read-ahead it hands out and the manifest reads, in order."""

    def __init__(self) -> None:
        self.events: list[tuple[str, Path]] = []
        self.aheads: list[Any] = []

    def read_ahead(self, directory: Path) -> Any:
        self.events.append(("read_ahead", directory))
        ahead = super().read_ahead(directory)
        self.aheads.append(ahead)
        return ahead

    def read_bytes(self, path: Path) -> bytes:
        self.events.append(("read_bytes", path))
        return super().read_bytes(path)


def _read_ahead_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "asyncsave-read-ahead"]


def _wait_for(cond: Any, what: str) -> None:
    deadline = time.monotonic() + 30
    while not cond():
        assert time.monotonic() < deadline, f"never: {what}"
        time.sleep(0.005)


async def test_a_verified_load_reads_its_data_files_ahead_of_the_manifest_parse(
    tmp_path: Path,
) -> None:
    """The read-ahead starts before the manifest is read, covers the data files
    (not the manifest), and is over when the load returns; a load that verifies
    nothing, and ``load_tensors`` (a few tensors), read nothing ahead."""
    path = await saved(tmp_path, state_of())
    fs = _Recording()
    loaded = asyncsave.load(path, filesystem=fs)
    assert torch.equal(loaded["big"], state_of()["big"])
    kinds = [k for k, _ in fs.events]
    assert kinds[0] == "read_ahead" and fs.events[0][1] == path
    assert "read_bytes" in kinds[1:]
    (ahead,) = fs.aheads
    data = sorted(p for p in path.iterdir() if p.name.startswith("data-"))
    assert data and ahead.paths == data  # the manifest is not among them
    assert _read_ahead_threads() == []
    for kwargs, call in (
        ({"verify": False}, lambda fs: asyncsave.load(path, filesystem=fs, verify=False)),
        ({}, lambda fs: asyncsave.load_tensors(path, ["big"], filesystem=fs)),
    ):
        other = _Recording()
        call(other)
        assert "read_ahead" not in [k for k, _ in other.events], kwargs


def test_the_read_ahead_reads_each_regular_file_whole_and_nothing_else(tmp_path: Path) -> None:
    """Every regular file is read to its end; a FIFO (whose open would block), a
    directory and a symlink (to a large file elsewhere) are skipped, without a
    hang; ``__exit__`` leaves no thread."""
    d = tmp_path / "step_1"
    d.mkdir()
    sizes = {"data-a": 3 << 20, "data-b": 5000, "data-c": 0}
    for name, n in sizes.items():
        (d / name).write_bytes(os.urandom(n))
    os.mkfifo(d / "fifo")
    (d / "sub").mkdir()
    (d / "sub" / "inner").write_bytes(b"x" * 4096)
    (tmp_path / "far").write_bytes(b"y" * (1 << 20))
    (d / "link").symlink_to(tmp_path / "far")
    fs = asyncsave.LocalFileSystem()
    with fs.read_ahead(d) as ahead:
        _wait_for(lambda: ahead.read_bytes >= sum(sizes.values()), "every data file read")
        _wait_for(lambda: not _read_ahead_threads(), "the thread ends at the files' end")
    assert ahead.read_bytes == sum(sizes.values())
    assert _read_ahead_threads() == []


def test_a_stopped_read_ahead_reads_no_further(tmp_path: Path) -> None:
    """:meth:`stop` ends the reading at the next file step: stopped before it
    starts, it reads nothing; a directory that does not exist reads nothing."""
    d = tmp_path / "step_1"
    d.mkdir()
    (d / "data-a").write_bytes(os.urandom(1 << 20))
    fs = asyncsave.LocalFileSystem()
    ahead = fs.read_ahead(d)
    ahead.stop()
    with ahead:
        pass
    assert ahead.read_bytes == 0 and _read_ahead_threads() == []
    with fs.read_ahead(tmp_path / "missing") as none:
        pass
    assert none.paths == [] and none.read_bytes == 0


_FEW_DESCRIPTORS = r"""
import os, resource, sys, time, threading
from pathlib import Path
import asyncsave
d = Path(sys.argv[1])
limit = len(os.listdir("/proc/self/fd")) + 6  # the read-ahead needs two
resource.setrlimit(resource.RLIMIT_NOFILE, (limit, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
with asyncsave.LocalFileSystem().read_ahead(d) as ahead:
    deadline = time.monotonic() + 60
    while any(t.name == "asyncsave-read-ahead" for t in threading.enumerate()):
        assert time.monotonic() < deadline
        time.sleep(0.01)
print(ahead.read_bytes)
"""


def test_the_read_ahead_holds_two_descriptors_whatever_the_number_of_files(
    tmp_path: Path,
) -> None:
    """300 files read whole under a descriptor limit of the process's open
    ones plus 6 (a child process): one file is open at a time (opening them all
    first failed with ``EMFILE`` and skipped most of them)."""
    d = tmp_path / "step_1"
    d.mkdir()
    for i in range(300):
        (d / f"data-{i:03d}").write_bytes(b"x" * (4096 + i))
    out = subprocess.run(
        [sys.executable, "-c", _FEW_DESCRIPTORS, str(d)],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    assert int(out.stdout) == sum(4096 + i for i in range(300))


async def test_a_load_stops_its_read_ahead_once_the_manifest_is_read(tmp_path: Path) -> None:
    """The read-ahead is stopped between the manifest's read and the data's
    (the page cache it fills is bounded by the parse), not only at the end."""
    path = await saved(tmp_path, state_of())
    events: list[str] = []

    class Stopping(_Recording):
        def read_ahead(self, directory: Path) -> Any:
            ahead = super().read_ahead(directory)
            stop = ahead.stop

            def recorded() -> None:
                events.append("stop")
                stop()

            ahead.stop = recorded
            return ahead

        def read_bytes(self, p: Path) -> bytes:
            events.append(p.name)
            return super().read_bytes(p)

    asyncsave.load(path, filesystem=Stopping())
    assert events[-1] == "stop" and "manifest.json" in events[:-1]


async def test_load_tensors_takes_a_trailing_slash_and_names_the_key_paths_near_a_missing_one(
    tmp_path: Path,
) -> None:
    """``"model/"`` is the prefix ``"model"``; a module's ``state_dict()`` keys
    are one segment each, so ``"model/1"`` names no tensor of
    ``"model/1.weight"``: the error lists the key paths that begin with it; a
    key with no such path lists its parent's, else the first ones."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4))
    path = await saved(tmp_path, {"model": net, "opt": {"lr": torch.tensor(0.1)}})
    assert set(asyncsave.load_tensors(path, ["model/"])) == {f"model/{k}" for k in net.state_dict()}
    assert set(asyncsave.load_tensors(path, ["opt//"])) == {"opt/lr"}
    with pytest.raises(asyncsave.MissingItemError) as info:
        asyncsave.load_tensors(path, ["model/1"])
    assert info.value.key == "model/1"
    assert "'model/1.weight'" in str(info.value) and "'model/0.weight'" not in str(info.value)
    with pytest.raises(asyncsave.MissingItemError) as info:
        asyncsave.load_tensors(path, ["model/2.weight"])
    assert "'model/0.weight'" in str(info.value)  # the parent's paths
    with pytest.raises(asyncsave.MissingItemError) as info:
        asyncsave.load_tensors(path, ["nothing/here"])
    assert "'model/0.weight'" in str(info.value) and "'opt/lr'" in str(info.value)
    with pytest.raises(asyncsave.MissingItemError):
        asyncsave.load_tensors(path, ["/"])
