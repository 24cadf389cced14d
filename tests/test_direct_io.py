"""O_DIRECT writes of data files: same bytes as buffered writes, used where the file
system allows it, buffered where it does not."""

# Private imports: the writer's hashing threads and plan reuse are internals of the
# write path under test.
from __future__ import annotations

import os
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


# -- large files: hashed by a helper thread while written (_write._write_hashing_apart) --


def planned(sizes: list[int]) -> tuple[Any, Any, torch.Tensor]:
    """A one-file plan of uint8 tensors of ``sizes`` bytes, staged into a
    page-aligned buffer: (layout, entries, buffer)."""
    import anyio

    from asyncsave._replan import Planner, plan_off_loop

    g = torch.Generator().manual_seed(len(sizes))
    state = {
        f"t{i}": torch.randint(0, 256, (n,), generator=g, dtype=torch.uint8)
        for i, n in enumerate(sizes)
    }

    async def plan() -> Any:
        return await plan_off_loop(Planner(), state, allow_pickle=False, rank=0, max_files=1)

    p, layouts, nbytes = anyio.run(plan)
    raw = torch.empty(nbytes + 4096, dtype=torch.uint8)
    buf = raw[(-raw.data_ptr()) % 4096 :][:nbytes]
    for e in p.entries:
        buf[e.staging_offset : e.staging_offset + e.nbytes] = e.source.reshape(-1).view(torch.uint8)
    assert len(layouts) == 1
    return layouts[0], p.entries, buf


def hash_threads() -> list[str]:
    import threading

    return [t.name for t in threading.enumerate() if t.name == "asyncsave-hash"]


@pytest.fixture
def helpers_started(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The names of the threads ``asyncsave._write`` starts (its hashing helpers)."""
    import threading

    from asyncsave import _write

    started: list[str] = []

    class Spy(threading.Thread):
        def start(self) -> None:
            started.append(self.name)
            super().start()

    class Module:
        Thread = Spy

    monkeypatch.setattr(_write, "threading", Module)
    return started


MiB = 1 << 20
SIZES = [
    [5 * MiB, 7 * MiB + 3, 0, 20 * MiB, 1],  # entries across the 8 MiB chunks, an empty one
    [33 * MiB],  # one entry of several chunks
    [1] * 7 + [9 * MiB] + [0] * 3,  # empty entries at the end
]


@pytest.mark.parametrize("sizes", SIZES, ids=["across-chunks", "one-entry", "empty-at-end"])
@pytest.mark.parametrize("known", [False, True], ids=["all-hashed", "some-known"])
def test_hashing_apart_gives_the_inline_checksums_and_bytes(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    sizes: list[int],
    known: bool,
    helpers_started: list[str],
) -> None:
    """Every file hashed apart (threshold lowered) against the same file written
    buffered (hashed inline): the same bytes, the same checksums; digests given
    as known (an incremental save's) are taken as they are."""
    import xxhash

    from asyncsave import _write

    layout, entries, buf = planned(sizes)
    given = {layout.entries[0]: "0123456789abcdef"} if known else None
    spy = SpyFS()
    monkeypatch.setattr(_write, "HASH_APART_BYTES", 0)
    (tmp_path / "d").mkdir()
    (tmp_path / "b").mkdir()
    apart = _write.write_data_file(spy, tmp_path / "d", layout, entries, buf, direct=True, known=given)
    inline = _write.write_data_file(
        LocalFileSystem(), tmp_path / "b", layout, entries, buf, direct=False, known=given
    )
    if not spy.direct_opens:
        pytest.fail(f"O_DIRECT was not used on {tmp_path} (file system refuses it?)")
    assert helpers_started == ["asyncsave-hash"]  # the direct write only
    assert apart == inline
    assert (tmp_path / "d" / layout.name).read_bytes() == (tmp_path / "b" / layout.name).read_bytes()
    for i in layout.entries:
        e = entries[i]
        want = xxhash.xxh3_64_hexdigest(memoryview(buf.numpy())[e.staging_offset :][: e.nbytes])
        assert apart[i] == (given[i] if given and i in given else want)
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
                import errno
                import os

                raise OSError(errno.EIO, os.strerror(errno.EIO))
        return super().write(fd, data)


def test_a_failed_write_joins_the_hashing_thread_and_raises_the_write_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, helpers_started: list[str]
) -> None:
    import errno
    import time

    import xxhash

    from asyncsave import _write

    class SlowHasher:  # the helper is still hashing when the write fails
        def __init__(self) -> None:
            self.h = xxhash.xxh3_64()

        def update(self, data: Any) -> None:
            time.sleep(0.05)
            self.h.update(data)

        def hexdigest(self) -> str:
            return self.h.hexdigest()

    class Slow:
        xxh3_64 = SlowHasher
        xxh3_64_hexdigest = staticmethod(xxhash.xxh3_64_hexdigest)

    monkeypatch.setattr(_write, "xxhash", Slow)
    layout, entries, buf = planned([40 * MiB])
    fs = FailingDirectWrite()
    with pytest.raises(OSError) as caught:
        _write.write_data_file(fs, tmp_path, layout, entries, buf, direct=True)
    if not fs.direct_fds:
        pytest.fail(f"O_DIRECT was not used on {tmp_path} (file system refuses it?)")
    assert caught.value.errno == errno.EIO
    assert helpers_started == ["asyncsave-hash"]
    assert not hash_threads()


def test_a_failed_hash_is_raised_by_the_writer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, helpers_started: list[str]
) -> None:
    """The helper's error (here a MemoryError from the hasher) is the write's:
    raised in the writer's thread after the join, the file's descriptors closed."""
    from asyncsave import _write

    layout, entries, buf = planned([40 * MiB])

    class Broken:
        @staticmethod
        def xxh3_64(*args: Any) -> Any:
            raise MemoryError("hasher")

        xxh3_64_hexdigest = xxh3_64

    monkeypatch.setattr(_write, "xxhash", Broken)
    spy = SpyFS()
    with pytest.raises(MemoryError, match="hasher"):
        _write.write_data_file(spy, tmp_path, layout, entries, buf, direct=True)
    if not spy.direct_opens:
        pytest.fail(f"O_DIRECT was not used on {tmp_path} (file system refuses it?)")
    assert helpers_started == ["asyncsave-hash"]
    assert not hash_threads()
    fds = os.listdir("/proc/self/fd")
    assert not [f for f in fds if os.path.realpath(f"/proc/self/fd/{f}").startswith(str(tmp_path))]
