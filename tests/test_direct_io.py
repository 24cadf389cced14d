"""O_DIRECT writes of data files: same bytes as buffered writes, used where the file
system allows it, buffered where it does not."""

from __future__ import annotations

import errno
import json
import os
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import xxhash

import asyncsave
from asyncsave import LocalFileSystem
from asyncsave.testing import thresholds

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


# -- large files: hashed by a helper thread while written -------------------------

HASHER = "asyncsave-hash"  # the name of the thread that hashes a file written apart


def hash_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name == HASHER]


@pytest.fixture
def helpers_started(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The names of the hashing helpers started while the test runs."""
    started: list[str] = []
    real = threading.Thread.start

    def start(self: threading.Thread) -> None:
        if self.name == HASHER:
            started.append(self.name)
        real(self)

    monkeypatch.setattr(threading.Thread, "start", start)
    return started


def in_hasher(fn: Callable[..., Any], real: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` in the hashing helper's thread, ``real`` in every other."""

    def call(*args: Any) -> Any:
        return (fn if threading.current_thread().name == HASHER else real)(*args)

    return call


MiB = 1 << 20
SIZES = [
    [5 * MiB, 7 * MiB + 3, 0, 20 * MiB, 1],  # entries across the 8 MiB chunks, an empty one
    [33 * MiB],  # one entry of several chunks
    [1] * 7 + [9 * MiB] + [0] * 3,  # empty entries at the end
]


def bytes_state(sizes: list[int]) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(len(sizes))
    return {
        f"t{i}": torch.randint(0, 256, (n,), generator=g, dtype=torch.uint8)
        for i, n in enumerate(sizes)
    }


def checksums(step_dir: Path) -> dict[str, str]:
    """Each entry's checksum (of its bytes in its data file), as the manifest
    records it."""
    doc = json.loads((step_dir / "manifest.json").read_bytes())
    return {e["name"]: e["xxh3_64"] for e in doc["entries"]}


@pytest.fixture
def one_file() -> Iterator[None]:
    with thresholds(min_file_bytes=1 << 40):  # one data file, whatever the threads
        yield


@pytest.mark.usefixtures("one_file")
@pytest.mark.parametrize("sizes", SIZES, ids=["across-chunks", "one-entry", "empty-at-end"])
@pytest.mark.parametrize("incremental", [False, True], ids=["all-hashed", "some-known"])
def test_hashing_apart_gives_the_inline_checksums_and_bytes(
    tmp_path: Path, sizes: list[int], incremental: bool, helpers_started: list[str]
) -> None:
    """A file hashed apart (threshold lowered, ``O_DIRECT``) against the same
    state written buffered (hashed inline): the same bytes, the same manifest
    checksums; an incremental save's second step (whose checksums of unchanged
    tensors are known from staging) too."""
    state = bytes_state(sizes)
    spy = SpyFS()
    with thresholds(hash_apart_bytes=0):
        with asyncsave.SyncCheckpointer(
            tmp_path / "d", filesystem=spy, incremental=incremental
        ) as ckpt:
            ckpt.save(1, state).result()
            if incremental:
                state["t0"][:1] += 1
                ckpt.save(2, state).result()
    started_direct = len(helpers_started)
    with asyncsave.SyncCheckpointer(tmp_path / "b", direct_io=False) as ckpt:
        ckpt.save(1, state).result()
    if not spy.direct_opens:
        pytest.fail(f"O_DIRECT was not used on {tmp_path} (file system refuses it?)")
    assert started_direct >= 1 and len(helpers_started) == started_direct  # direct only
    final = tmp_path / "d" / f"step_{2 if incremental else 1}"
    if not incremental:
        assert data_bytes(final) == data_bytes(tmp_path / "b" / "step_1")
    assert checksums(final) == checksums(tmp_path / "b" / "step_1")
    asyncsave.verify(final)
    loaded = asyncsave.load(final)
    assert all(torch.equal(loaded[k], v) for k, v in state.items())
    assert not hash_threads()


class FailingDirectWrite(SpyFS):
    """O_DIRECT writes fail with EIO after the first one."""

    def __init__(self) -> None:
        super().__init__()
        self.direct_fds: set[int] = set()
        self.writes = 0

    def open_direct(self, path: Path) -> int | None:
        fd = super().open_direct(path)
        if fd is not None:
            self.direct_fds.add(fd)
        return fd

    def write(self, fd: int, data: memoryview) -> int:
        if fd in self.direct_fds:
            self.writes += 1
            if self.writes > 1:
                raise OSError(errno.EIO, os.strerror(errno.EIO))
        return super().write(fd, data)


def save_fails(root: Path, fs: LocalFileSystem, state: dict[str, Any]) -> BaseException:
    """The cause of the failure of a save of ``state`` into ``root``, hashed apart."""
    with thresholds(hash_apart_bytes=0), pytest.raises(asyncsave.SaveFailedError) as caught:
        with asyncsave.SyncCheckpointer(root, filesystem=fs) as ckpt:
            ckpt.save(1, state).result()
    cause = caught.value.__cause__
    assert cause is not None, caught.value
    return cause


@pytest.mark.usefixtures("one_file")
def test_a_failed_write_joins_the_hashing_thread_and_raises_the_write_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, helpers_started: list[str]
) -> None:
    real = xxhash.xxh3_64

    class SlowHasher:  # the helper is still hashing when the write fails
        def __init__(self, *args: Any) -> None:
            self.h = real(*args)

        def update(self, data: Any) -> None:
            time.sleep(0.05)
            self.h.update(data)

        def hexdigest(self) -> str:
            return str(self.h.hexdigest())

    monkeypatch.setattr(xxhash, "xxh3_64", in_hasher(SlowHasher, real))
    fs = FailingDirectWrite()
    cause = save_fails(tmp_path, fs, bytes_state([40 * MiB]))
    if not fs.direct_fds:
        pytest.fail(f"O_DIRECT was not used on {tmp_path} (file system refuses it?)")
    assert isinstance(cause, OSError) and cause.errno == errno.EIO, cause
    assert helpers_started == [HASHER]
    assert not hash_threads()


@pytest.mark.usefixtures("one_file")
def test_a_failed_hash_is_raised_by_the_writer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, helpers_started: list[str]
) -> None:
    """The helper's error (here a MemoryError from the hasher) is the write's:
    raised in the writer's thread after the join, the file's descriptors closed."""

    def broken(*args: Any) -> Any:
        raise MemoryError("hasher")

    monkeypatch.setattr(xxhash, "xxh3_64", in_hasher(broken, xxhash.xxh3_64))
    monkeypatch.setattr(xxhash, "xxh3_64_hexdigest", in_hasher(broken, xxhash.xxh3_64_hexdigest))
    spy = SpyFS()
    cause = save_fails(tmp_path, spy, bytes_state([40 * MiB]))
    if not spy.direct_opens:
        pytest.fail(f"O_DIRECT was not used on {tmp_path} (file system refuses it?)")
    assert isinstance(cause, MemoryError) and "hasher" in str(cause), cause
    assert helpers_started == [HASHER]
    assert not hash_threads()
    fds = os.listdir("/proc/self/fd")
    assert not [f for f in fds if os.path.realpath(f"/proc/self/fd/{f}").startswith(str(tmp_path))]
