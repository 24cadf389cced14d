"""Descriptors stay bounded whatever the number of files: a checkpoint of one file
per tensor (an incremental save) is saved, verified, loaded, inspected and resumed
under a low open-file limit (``RLIMIT_NOFILE``, what ``ulimit -n`` sets), on one and
two ranks; a load holds no descriptor per data file once it returns.

The open-file limit ran out on one file per parameter in t5x
(https://github.com/google-research/t5x/issues/447). Each scenario runs in a forked
child that lowers its own limit, so the test process keeps its own.
"""

from __future__ import annotations

import contextlib
import errno
import io
import multiprocessing as mp
import os
import resource
import shutil
import signal
import subprocess
import sys
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest
import torch

import asyncsave
from asyncsave import LocalFileSystem
from asyncsave.testing import cli as run_cli
from asyncsave.testing import thresholds

sys.path.insert(0, str(Path(__file__).parent))
from crashlab import small_own_files
from distributed import run_ranks, values

FD_LIMIT = 256
N_FILES = 2000  # data files of one checkpoint
READ_SPARE_FDS = 24  # a reader's descriptors (4 threads) and gloo's, with room to spare


def limit_descriptors(n: int) -> None:
    """Lower this process's open-file limit (soft) to ``n``."""
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (n, hard))


def open_descriptors() -> int:
    return len(os.listdir("/proc/self/fd"))


def _child(fn: Callable[..., Any], queue: Any, args: tuple[Any, ...]) -> None:
    try:
        queue.put(("ok", fn(0, 1, *args)))
    except BaseException:
        queue.put(("error", traceback.format_exc()))
    finally:
        queue.close()
        queue.join_thread()
        os._exit(0)


def run_alone(fn: Callable[..., Any], *args: Any, timeout_s: float = 300.0) -> Any:
    """``fn(0, 1, *args)`` in a forked child without a process group (one rank, as
    a plain training script); its value, or its traceback as an AssertionError."""
    ctx = mp.get_context("fork")
    queue = ctx.Queue()
    proc = ctx.Process(target=_child, args=(fn, queue, args))
    proc.start()
    try:
        kind, value = queue.get(timeout=timeout_s)
    except Exception:  # queue.Empty: the child died or hangs
        kind, value = "exit", proc.exitcode
    proc.join(30)
    if proc.is_alive():
        os.kill(proc.pid, signal.SIGKILL)  # type: ignore[arg-type]
        proc.join(5)
    if kind != "ok":
        raise AssertionError(f"the child failed ({kind}):\n{value}")
    return value


def run_on(world: int, tmp: Path, fn: Callable[..., Any], *args: Any) -> list[Any]:
    """Every rank's value of ``fn(rank, world, *args)``: one rank without a process
    group, several on a gloo group (``tests/distributed.py``)."""
    if world == 1:
        return [run_alone(fn, *args)]
    return values(run_ranks(fn, world, tmp, *args, timeout_s=300.0))


def state_of(rank: int, count: int, version: int) -> dict[str, Any]:
    """``count`` tensors of 64 bytes, named after the rank; ``version`` changes
    every other one."""
    return {
        "layers": {
            f"r{rank}w{i}": torch.full((16,), float(rank * 100_000 + i + (version if i % 2 else 0)))
            for i in range(count)
        },
        "trainer": {"rank": rank, "version": version},
    }


def same(a: Any, b: Any) -> bool:
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    return bool(a == b)


def cli(*argv: str) -> tuple[int, str]:
    out = io.StringIO()
    return run_cli(list(argv), out=out), out.getvalue()


# -- incremental saves: one file per tensor -------------------------------------------


def _incremental_under_the_limit(rank: int, world: int, root: str) -> dict[str, Any]:
    limit_descriptors(FD_LIMIT)
    count = N_FILES // world
    options = asyncsave.CheckpointOptions(incremental=True)

    async def saves() -> Any:
        async with asyncsave.Checkpointer(root, options=options) as ckpt:
            for step, version in ((1, 0), (2, 1)):  # the second shares half the files
                await (await ckpt.save(step, state_of(rank, count, version)))
        async with asyncsave.Checkpointer(root, options=options) as ckpt:
            restored = await ckpt.load_latest()
        return None if restored is None else restored.state

    with small_own_files():
        resumed = anyio.run(saves)
    out: dict[str, Any] = {"resumed": same(resumed, state_of(rank, count, 1))}
    if rank == 0:
        path = Path(root) / "step_2"
        out["files"] = len(list(path.glob("*.safetensors")))
        out["verify"] = asyncsave.verify(path).step
        whole = asyncsave.load(path)
        expected = [state_of(r, count, 1) for r in range(world)]
        out["load"] = (
            same(whole, expected[0])
            if world == 1
            else all(same(whole[r], expected[r]) for r in range(world))
        )
        last = world - 1  # the last rank's tensors, by key
        keys = [f"layers/r{last}w{i}" for i in range(count)]
        some = asyncsave.load_tensors(path, keys)
        out["load_tensors"] = same(
            {k.removeprefix("layers/"): t for k, t in some.items()},
            expected[last]["layers"],
        )
        out["cli"] = [cli("verify", str(path))[0], cli("inspect", str(path))[0]]
    return out


@pytest.mark.slow  # forked children with thousands of files or two ranks
def test_a_checkpoint_of_2000_files_saves_verifies_loads_and_resumes_under_256_descriptors(
    tmp_path: Path,
) -> None:
    # Incremental saves lay out one file per tensor on one rank (several ranks
    # write theirs in full); two ranks: the node-local tier test below.
    seen = run_alone(_incremental_under_the_limit, str(tmp_path / "root"))
    assert seen == {
        "resumed": True,
        "files": N_FILES,
        "verify": 2,
        "load": True,
        "load_tensors": True,
        "cli": [0, 0],
    }


@pytest.mark.slow  # forked children with thousands of files or two ranks
def test_the_asyncsave_command_verifies_and_inspects_2000_files_under_ulimit_256(
    tmp_path: Path,
) -> None:
    root = tmp_path / "root"
    run_alone(_incremental_under_the_limit, str(root))
    path = root / "step_2"
    for verb in ("verify", "inspect"):
        done = subprocess.run(
            [
                "bash",
                "-c",
                f'ulimit -n {FD_LIMIT} && exec "$0" -m asyncsave {verb} "$1"',
                sys.executable,
                str(path),
            ],
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert done.returncode == 0, done.stderr
        assert "Too many open files" not in done.stdout + done.stderr


def _tiers_under_the_limit(rank: int, world: int, local: str, remote: str) -> dict[str, Any]:
    limit_descriptors(FD_LIMIT)
    options = asyncsave.CheckpointOptions(incremental=True)
    tier = asyncsave.Tier(remote)

    async def run() -> Any:
        async with asyncsave.Checkpointer(local, options=options, persistent=tier) as ckpt:
            handle = await ckpt.save(1, state_of(rank, N_FILES, 0))
            await handle
            assert await handle.persisted() is not None
        shutil.rmtree(local)  # the node is gone: resume from the persistent tier
        async with asyncsave.Checkpointer(local, options=options, persistent=tier) as ckpt:
            restored = await ckpt.load_latest()
        return None if restored is None else restored.state

    with small_own_files():
        resumed = anyio.run(run)
    path = Path(remote) / "step_1"
    return {
        "resumed": same(resumed, state_of(rank, N_FILES, 0)),
        "files": len(list(path.glob("*.safetensors"))),
        "verify": asyncsave.verify(path).step,
    }


@pytest.mark.slow  # forked children with thousands of files or two ranks
def test_a_persistent_tier_copies_and_resumes_2000_files_under_256_descriptors(
    tmp_path: Path,
) -> None:
    local, remote = tmp_path / "local", tmp_path / "remote"
    seen = run_alone(_tiers_under_the_limit, str(local), str(remote))
    assert seen == {"resumed": True, "files": N_FILES, "verify": 1}


# -- DCP: one file per rank and save ----------------------------------------------------


def _dcp_under_the_limit(rank: int, world: int, root: str) -> bool:
    import torch.distributed.checkpoint as dcp

    from asyncsave.dcp import StorageReader, StorageWriter

    limit_descriptors(FD_LIMIT)
    mine = {f"r{rank}.w{i}": torch.full((16,), float(rank * 100_000 + i)) for i in range(500)}
    dcp.save(mine, storage_writer=StorageWriter(root, step=1))
    back = {k: torch.zeros_like(v) for k, v in mine.items()}
    before = open_descriptors()
    dcp.load(back, storage_reader=StorageReader(root))
    checked = asyncsave.verify(Path(root) / "step_1").step == 1
    return checked and open_descriptors() <= before and same(back, mine)


@pytest.mark.slow  # forked children with thousands of files or two ranks
def test_the_dcp_reader_and_verify_hold_no_descriptor_per_file_under_256(
    tmp_path: Path,
) -> None:
    assert run_on(2, tmp_path, _dcp_under_the_limit, str(tmp_path / "root")) == [True, True]


# -- plain saves: as many files as writer threads ---------------------------------------


def _plain_under_the_limit(rank: int, world: int, root: str) -> dict[str, Any]:
    limit_descriptors(FD_LIMIT)
    options = asyncsave.CheckpointOptions(writer_threads=64)
    state = state_of(rank, 500, 0)

    async def save() -> None:
        async with asyncsave.Checkpointer(root, options=options) as ckpt:
            await (await ckpt.save(1, state))

    async def resume() -> Any:
        async with asyncsave.Checkpointer(root, options=options) as ckpt:
            restored = await ckpt.load_latest()
        return None if restored is None else restored.state

    with small_files():
        anyio.run(save)
    # Reading needs a few descriptors whatever the files: fewer than the files here.
    limit_descriptors(open_descriptors() + READ_SPARE_FDS)
    out: dict[str, Any] = {"resumed": same(anyio.run(resume), state)}
    if rank == 0:
        path = Path(root) / "step_1"
        out["files"] = len(list(path.glob("*.safetensors")))
        out["verify"] = asyncsave.verify(path).step
        whole = asyncsave.load(path)
        parts = [whole] if world == 1 else [whole[r] for r in range(world)]
        out["load"] = all(same(parts[r], state_of(r, 500, 0)) for r in range(world))
    return out


@contextlib.contextmanager
def small_files() -> Iterator[None]:
    """A plain save spreads its tensors over up to ``writer_threads`` files of at
    least ``min_file_bytes``: lowered, so that a small state fills 64 files."""
    with thresholds(min_file_bytes=64):
        yield


@pytest.mark.slow  # forked children with thousands of files or two ranks
@pytest.mark.parametrize("world", [1, 2])
def test_a_plain_save_of_64_files_per_rank_saves_under_256_descriptors_and_loads_under_a_few(
    tmp_path: Path, world: int
) -> None:
    seen = run_on(world, tmp_path, _plain_under_the_limit, str(tmp_path / "root"))
    assert all(s["resumed"] for s in seen)
    assert seen[0] == {"resumed": True, "files": 64 * world, "verify": 1, "load": True}


# -- what a load leaves open ----------------------------------------------------------


def _saved(root: Path, state: Any, options: asyncsave.CheckpointOptions) -> Path:
    async def go() -> Path:
        async with asyncsave.Checkpointer(root, options=options) as ckpt:
            info = await (await ckpt.save(1, state))
        assert info is not None
        return info.path

    return anyio.run(go)


@pytest.mark.parametrize("incremental", [False, True])
@pytest.mark.parametrize("n_files", [8, 64])
def test_descriptors_open_after_a_load_do_not_grow_with_its_files(
    tmp_path: Path, incremental: bool, n_files: int
) -> None:
    options = asyncsave.CheckpointOptions(incremental=incremental, writer_threads=64)
    state = state_of(0, n_files, 0)
    with small_files(), small_own_files():
        path = _saved(tmp_path / "root", state, options)
    files = len(list(path.glob("*.safetensors")))
    assert files >= n_files
    asyncsave.load(path)  # whatever torch opens once per process
    before = open_descriptors()
    held = [
        asyncsave.load(path),
        asyncsave.load(path, verify=False),
        asyncsave.load_tensors(path, ["layers"]),
        asyncsave.verify(path),
    ]
    assert open_descriptors() <= before
    assert same(held[0], state) and same(held[1], state)
    # The tensors stay views of the files' mappings (zero-copy), and writable.
    w0 = held[0]["layers"]["r0w0"]
    w0.add_(1)
    assert torch.equal(asyncsave.load(path)["layers"]["r0w0"], state["layers"]["r0w0"])


# -- the reader's own bound -------------------------------------------------------------


@contextlib.contextmanager
def descriptors_left(n: int) -> Iterator[None]:
    """Every descriptor the process may still open taken (``/dev/null``), but
    ``n``; given back after."""
    taken: list[int] = []
    try:
        while True:
            try:
                taken.append(os.open(os.devnull, os.O_RDONLY))
            except OSError:
                break
        for _ in range(n):
            os.close(taken.pop())
        yield
    finally:
        for fd in taken:
            os.close(fd)


class ManifestReadAhead(LocalFileSystem):
    """A local file system that returns the manifest of ``path`` as read at
    construction: a load through it opens only data files, so that with no
    descriptor left it is the data files' opening that runs out."""

    def __init__(self, path: Path) -> None:
        super().__init__()
        self.manifest = path / "manifest.json"
        self.raw = self.manifest.read_bytes()

    def read_bytes(self, path: Path) -> bytes:
        return self.raw if Path(path) == self.manifest else super().read_bytes(path)


def _reads_with_few_descriptors(rank: int, world: int, root: str) -> dict[str, Any]:
    limit_descriptors(FD_LIMIT)
    state = state_of(0, 300, 0)
    with small_own_files():
        path = _saved(Path(root), state, asyncsave.CheckpointOptions(incremental=True))
    out: dict[str, Any] = {"files": len(list(path.glob("*.safetensors")))}
    with descriptors_left(4):  # one per reading thread
        out["verify"] = asyncsave.verify(path).step
        out["load"] = same(asyncsave.load(path), state)
        out["load_tensors"] = len(asyncsave.load_tensors(path, ["layers"])) == 300
    fs = ManifestReadAhead(path)
    with descriptors_left(0):
        try:
            asyncsave.load(path, filesystem=fs)
        except OSError as exc:
            out["none left"] = (exc.errno, "ulimit -n" in "".join(exc.__notes__))
    return out


def test_reads_of_300_files_need_one_descriptor_per_reading_thread(tmp_path: Path) -> None:
    seen = run_alone(_reads_with_few_descriptors, str(tmp_path / "root"))
    assert seen == {
        "files": 300,
        "verify": 1,
        "load": True,
        "load_tensors": True,
        "none left": (errno.EMFILE, True),
    }
