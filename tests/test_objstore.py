"""Object stores: s3:// roots against a real S3 server process (moto's server mode on
loopback, started once per session), and memory:// roots for fast coverage.

Where rename is not atomic the commit is ``commit_success.txt`` written last; a
prefix without it is uncommitted: not counted by any reader (they say why), and never
deleted: the next open adopts it if it verifies completely, else moves it aside.
"""

from __future__ import annotations

import contextlib
import errno
import io
import json
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import anyio
import fsspec
import pytest
import s3fs  # a dev dependency: the S3 tests run in CI, never skip
import torch

import asyncsave
from asyncsave import FsspecFileSystem, LocalFileSystem
from asyncsave.testing import cli as cli_main

TRACKER = "latest_checkpointed_iteration.txt"
MARKER = "commit_success.txt"
BLOCK = 5 << 20  # s3fs part size here: the smallest S3 allows, so saves use multipart


# -- the S3 server -------------------------------------------------------------------
@pytest.fixture(scope="session")
def s3_endpoint(moto_server: str) -> str:
    """The suite's moto S3 server (``moto_server`` in ``conftest.py``: one process for
    every module that uses S3, which take this fixture as ``test_objstore.s3_endpoint``)."""
    return moto_server


def _options(endpoint: str) -> dict[str, Any]:
    return {
        "key": "testing",  # moto takes any credentials
        "secret": "testing",
        "endpoint_url": endpoint,
        "client_kwargs": {"region_name": "us-west-2"},
        "default_block_size": BLOCK,
    }


@pytest.fixture
def s3(s3_endpoint: str) -> tuple[str, dict[str, Any], Any]:
    """A fresh bucket: (root URL, storage_options, an s3fs file system on it)."""
    options = _options(s3_endpoint)
    fs = s3fs.S3FileSystem(**options)
    bucket = f"ckpt-{uuid.uuid4().hex[:12]}"
    fs.mkdir(bucket)
    return f"s3://{bucket}/runs/exp1", options, fs


def state_of(step: int, big: bool = False) -> dict[str, Any]:
    g = torch.Generator().manual_seed(step)
    return {
        "model": {
            "w": torch.randn(3 * (BLOCK // 4) + 1000 if big else 1000, generator=g),
            "b": torch.randn(64, generator=g).half(),
        },
        "optim": {"m": torch.randn(32, 32, generator=g, dtype=torch.float64)},
        "trainer": {"step": step, "name": f"run-{step}"},
    }


def assert_same(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert a["trainer"] == b["trainer"]
    for group in ("model", "optim"):
        assert a[group].keys() == b[group].keys()
        for k, v in b[group].items():
            assert a[group][k].dtype == v.dtype and torch.equal(a[group][k], v), (group, k)


def key(url: str) -> str:
    return url.removeprefix("s3://")


# -- fault injection on the fsspec layer ------------------------------------------
class FaultyFsspecFS(FsspecFileSystem):
    """Runs ``action`` at the ``n``-th call of ``op`` whose path contains ``where``
    and records every create, close and delete in order."""

    def __init__(self, fs: Any, op: str = "", where: str = "", n: int = 1) -> None:
        super().__init__(fs)
        self.op, self.where, self.n = op, where, n
        self.action: Callable[[], None] = lambda: None
        self.seen = 0
        self.fired = threading.Event()
        self.paths: dict[int, str] = {}
        self.log: list[tuple[str, str]] = []

    def _hit(self, op: str, path: str) -> None:
        if op == self.op and self.where in path:
            self.seen += 1
            if self.seen == self.n:
                self.fired.set()
                self.action()

    def create(self, path: Path) -> int:
        self._hit("create", str(path))
        fd = super().create(path)
        self.paths[fd] = str(path)
        self.log.append(("create", str(path)))
        return fd

    def write(self, fd: int, data: memoryview) -> int:
        self._hit("write", self.paths[fd])
        return super().write(fd, data)

    def close(self, fd: int) -> None:
        path = self.paths.pop(fd)
        self._hit("close", path)
        super().close(fd)
        self.log.append(("closed", path))

    def remove_tree(self, path: Path) -> None:
        self.log.append(("remove_tree", str(path)))
        super().remove_tree(path)


def _sigkill() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


# -- S3: round trip, commit order, failures ---------------------------------------
@pytest.mark.anyio
async def test_s3_round_trip_commits_by_marker_and_resumes_bit_exact(s3: Any) -> None:
    root, options, fs = s3
    async with asyncsave.Checkpointer(root, storage_options=options) as ckpt:
        assert await ckpt.load_latest() is None
        for step in (1, 2):
            info = await (await ckpt.save(step, state_of(step, big=True)))
            assert info is not None and str(info.path) == f"{root}/step_{step}"
    prefix = key(root)
    names = sorted(p.rsplit("/", 1)[1] for p in fs.find(f"{prefix}/step_2"))
    assert names == [MARKER, "data-r00000-000.safetensors", "manifest.json"]
    data = fs.size(f"{prefix}/step_2/data-r00000-000.safetensors")
    assert data > 3 * BLOCK  # written as a multipart upload of several parts
    assert fs.cat_file(f"{prefix}/{TRACKER}") == b"2"
    assert not [p for p in fs.find(prefix) if "asyncsave-tmp" in p]  # no temp prefix: no copy

    latest = asyncsave.latest(root, storage_options=options)
    assert latest is not None and latest.step == 2
    assert_same(asyncsave.load(latest.path), state_of(2, big=True))  # the UPath carries options
    assert asyncsave.verify(f"{root}/step_1", storage_options=options).step == 1

    async with asyncsave.Checkpointer(root, storage_options=options) as ckpt:
        restored = await ckpt.load_latest()
        assert restored is not None and restored.info.step == 2
        assert_same(restored.state, state_of(2, big=True))


@pytest.mark.anyio
async def test_s3_tracker_moves_only_after_the_marker_and_readers_ignore_an_unmarked_prefix(
    s3: Any,
) -> None:
    root, options, fs = s3
    release = threading.Event()
    faulty = FaultyFsspecFS(s3fs.S3FileSystem(**options), "create", f"step_2/{MARKER}")
    faulty.action = lambda: release.wait(60) and None
    prefix = key(root)
    async with asyncsave.Checkpointer(root, filesystem=faulty) as ckpt:
        await (await ckpt.save(1, state_of(1)))
        handle = await ckpt.save(2, state_of(2))
        await anyio.to_thread.run_sync(faulty.fired.wait, 60)
        try:
            # Data and manifest are complete under the final prefix; no marker yet.
            present = {p.rsplit("/", 1)[1] for p in fs.find(f"{prefix}/step_2")}
            assert present == {"data-r00000-000.safetensors", "manifest.json"}
            assert fs.cat_file(f"{prefix}/{TRACKER}") == b"1"
            info = asyncsave.latest(root, storage_options=options)
            assert info is not None and info.step == 1
            with pytest.raises(asyncsave.CheckpointNotFoundError, match=MARKER):
                asyncsave.verify(f"{root}/step_2", storage_options=options)
            with pytest.raises(asyncsave.CheckpointNotFoundError, match=MARKER):
                asyncsave.load(f"{root}/step_2", storage_options=options)
            assert not handle.done()
        finally:
            release.set()
        info = await handle
    assert info is not None and info.step == 2
    assert fs.cat_file(f"{prefix}/{TRACKER}") == b"2"
    first = next(i for i, (_, p) in enumerate(faulty.log) if "step_2" in p)
    order = [(op, p.rsplit("/", 1)[1]) for op, p in faulty.log[first:]]
    assert order.index(("closed", MARKER)) < order.index(("create", TRACKER))
    assert order.index(("closed", "manifest.json")) < order.index(("create", MARKER))
    assert order.index(("closed", "data-r00000-000.safetensors")) < order.index(
        ("create", "manifest.json")
    )


@pytest.mark.anyio
async def test_s3_failed_upload_is_discarded_and_commits_nothing(s3: Any) -> None:
    root, options, fs = s3
    faulty = FaultyFsspecFS(s3fs.S3FileSystem(**options), "write", "step_2/data-", n=3)

    def eio() -> None:
        raise OSError(errno.EIO, "injected")

    faulty.action = eio
    async with asyncsave.Checkpointer(root, filesystem=faulty) as ckpt:
        await (await ckpt.save(1, state_of(1, big=True)))
        handle = await ckpt.save(2, state_of(2, big=True))
        with pytest.raises(asyncsave.SaveFailedError) as err:
            await handle
        assert isinstance(err.value.__cause__, OSError)
        with pytest.raises(asyncsave.SaveFailedError):
            await ckpt.aclose()
    prefix = key(root)
    assert not fs.exists(f"{prefix}/step_2")  # parts aborted, prefix discarded
    fs.invalidate_cache()
    uploads = fs.call_s3("list_multipart_uploads", Bucket=prefix.split("/")[0])
    assert not uploads.get("Uploads")  # the multipart upload was aborted, not completed
    assert fs.cat_file(f"{prefix}/{TRACKER}") == b"1"
    info = asyncsave.latest(root, storage_options=options)
    assert info is not None and info.step == 1


def test_s3_object_closed_while_an_error_propagates_is_aborted_not_completed(s3: Any) -> None:
    root, _, fs = s3
    layer = FsspecFileSystem(fs)
    path = f"{key(root)}/partial.bin"
    fd = layer.create(Path(path))
    layer.write(fd, memoryview(b"x" * (BLOCK + 1024)))  # one part uploaded already
    try:
        raise OSError(errno.EIO, "the writer failed")
    except OSError:
        layer.close(fd)  # as asyncsave's writers close a failed file
    fs.invalidate_cache()
    assert not fs.exists(path)
    uploads = fs.call_s3("list_multipart_uploads", Bucket=key(root).split("/")[0])
    assert not uploads.get("Uploads")
    fd = layer.create(Path(path))
    layer.write(fd, memoryview(b"y" * 10))
    layer.close(fd)  # no error: completed
    assert fs.cat_file(path) == b"y" * 10


@pytest.mark.anyio
async def test_s3_overwrite_of_a_committed_step_is_refused_and_keeps_it(s3: Any) -> None:
    root, options, _ = s3
    async with asyncsave.Checkpointer(root, storage_options=options) as ckpt:
        await (await ckpt.save(1, state_of(1)))
        with pytest.raises(asyncsave.CheckpointError, match="cannot overwrite step 1"):
            await ckpt.save(1, state_of(7), overwrite=True)
        # A plain duplicate stays a no-op; the checkpointer keeps working.
        with pytest.warns(asyncsave.CheckpointWarning, match="step 1 is already committed"):
            assert (await (await ckpt.save(1, state_of(7)))) is not None
        await (await ckpt.save(2, state_of(2)))
    assert_same(asyncsave.load(f"{root}/step_1", storage_options=options), state_of(1))


@pytest.mark.anyio
async def test_s3_retention_deletes_the_marker_first_and_keeps_what_it_promises(s3: Any) -> None:
    root, options, fs = s3
    layer = FaultyFsspecFS(s3fs.S3FileSystem(**options))
    async with asyncsave.Checkpointer(
        root, filesystem=layer, retention=asyncsave.KeepLast(1)
    ) as ckpt:
        for step in (1, 2, 3):
            await (await ckpt.save(step, state_of(step)))
    prefix = key(root)
    fs.invalidate_cache()
    assert sorted(n.rsplit("/", 1)[1] for n in fs.ls(prefix)) == sorted(["step_3", TRACKER])
    # Retired without a copy aside: remove_tree (marker first) on the final prefix.
    assert [p.rsplit("/", 1)[1] for op, p in layer.log if op == "remove_tree"] == [
        "step_1",
        "step_2",
    ]
    assert_same(asyncsave.load(f"{root}/step_3", storage_options=options), state_of(3))


@pytest.mark.anyio
async def test_s3_update_and_tracker_less_layouts_are_refused(s3: Any) -> None:
    root, options, _ = s3
    with pytest.raises(ValueError, match="has no tracker"):
        asyncsave.Checkpointer(root, storage_options=options, layout="nemo-rl")
    async with asyncsave.Checkpointer(root, storage_options=options) as ckpt:
        await (await ckpt.save(1, state_of(1)))
        with pytest.raises(asyncsave.CheckpointError, match="update"):
            await ckpt.update(1, "trainer", {"step": 1, "name": "edited"})
        await (await ckpt.save(2, state_of(2)))  # still usable
    assert_same(asyncsave.load(f"{root}/step_1", storage_options=options), state_of(1))


# -- S3: SIGKILL at every step of the marker protocol ------------------------------
# (operation, path substring, occurrence) in the save of step 2.
KILL_POINTS = [
    ("write", "step_2/data-", 3),  # mid-upload: parts sent, upload never completed
    ("create", "step_2/manifest.json", 1),  # data object complete
    ("create", f"step_2/{MARKER}", 1),  # data and manifest complete: just before the marker
    ("create", TRACKER, 2),  # marker written: committed, tracker not moved yet
]


def _crash_child(root: str, options: dict[str, Any], op: str, where: str, n: int) -> None:
    async def go() -> None:
        faulty = FaultyFsspecFS(s3fs.S3FileSystem(**options), op, where, n)
        faulty.action = _sigkill
        async with asyncsave.Checkpointer(root, filesystem=faulty) as ckpt:
            await (await ckpt.save(1, state_of(1, big=True)))
            await (await ckpt.save(2, state_of(2, big=True)))

    anyio.run(go)


@pytest.mark.slow  # a forked saver per kill point
@pytest.mark.parametrize(
    ("op", "where", "n"), KILL_POINTS, ids=[f"{o}-{w}" for o, w, _ in KILL_POINTS]
)
def test_s3_sigkill_mid_save_resumes_the_last_commit_bit_exact(
    s3: Any, op: str, where: str, n: int
) -> None:
    root, options, fs = s3
    pid = os.fork()  # torch is imported once, in this parent
    if pid == 0:  # pragma: no cover - the child dies by SIGKILL or exits
        try:
            _crash_child(root, options, op, where, n)
        finally:
            os._exit(3)  # not killed: the parent sees exit status 3
    deadline = time.monotonic() + 120
    while (waited := os.waitpid(pid, os.WNOHANG))[0] == 0:
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            pytest.fail("the child neither died at the kill point nor exited within 120 s")
        time.sleep(0.02)
    status = waited[1]
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL, status

    prefix = key(root)
    committed = op == "create" and where == TRACKER
    expect = 2 if committed else 1
    # 1. Readers see the last commit (a marked step 2 counts before the tracker moves).
    info = asyncsave.latest(root, storage_options=options)
    assert info is not None and info.step == expect
    assert_same(asyncsave.load(info.path), state_of(expect, big=True))
    if where == f"step_2/{MARKER}":  # the crash before the marker left a prefix
        assert fs.exists(f"{prefix}/step_2/manifest.json")
        assert not fs.exists(f"{prefix}/step_2/{MARKER}")
        out = io.StringIO()
        assert cli_main(["ls", root, "--storage-options", json.dumps(options)], out=out) == 0
        assert "not counted: no commit marker" in out.getvalue()
        assert "asyncsave adopt" in out.getvalue()
        # Data and manifest were whole: the next open adopts it after a full verify.
        expect = 2
    before = {p: fs.cat_file(p) for p in fs.find(f"{prefix}/step_2")}

    # 2. The next open adopts a whole unmarked prefix or moves a partial one aside
    #    (never deletes either), moves the tracker forward, and resumes bit-exact;
    #    saving step 2 then commits (a no-op where it was adopted).
    async def reopen() -> int:
        async with asyncsave.Checkpointer(root, storage_options=options) as ckpt:
            restored = await ckpt.load_latest()
            assert restored is not None
            assert_same(restored.state, state_of(restored.info.step, big=True))
            await (await ckpt.save(2, state_of(2, big=True)))
            return restored.info.step

    assert anyio.run(reopen) == expect
    fs.invalidate_cache()
    for path, data in before.items():  # every byte the crash left is kept somewhere
        name = path.rsplit("/", 1)[1]
        kept = [fs.cat_file(p) for p in fs.find(prefix) if p.endswith(f"/{name}")]
        assert data in kept, path
    assert fs.cat_file(f"{prefix}/{TRACKER}") == b"2"
    assert fs.exists(f"{prefix}/step_2/{MARKER}")
    asyncsave.verify(f"{root}/step_2", storage_options=options)


# -- S3: CLI ----------------------------------------------------------------------
@pytest.mark.slow  # the command line in subprocesses
def test_s3_cli_ls_verify_inspect_and_a_flipped_byte(s3: Any, s3_endpoint: str) -> None:
    root, options, fs = s3

    async def make() -> None:
        async with asyncsave.Checkpointer(root, storage_options=options) as ckpt:
            for step in (1, 2):
                await (await ckpt.save(step, state_of(step)))

    anyio.run(make)
    opts = ["--storage-options", json.dumps(options)]

    def run(*argv: str) -> tuple[int, str]:
        out = io.StringIO()
        return cli_main([*argv, *opts], out=out), out.getvalue()

    rc, text = run("ls", root)
    assert rc == 0 and "tracker -> step 2" in text and " * step_2" in text
    rc, text = run("verify", root)
    assert rc == 0 and text.count("ok ") == 2
    rc, text = run("inspect", f"{root}/step_1")
    assert rc == 0 and "'w': float32 [1000] 4000 B" in text

    data = f"{key(root)}/step_2/data-r00000-000.safetensors"
    raw = bytearray(fs.cat_file(data))
    raw[-1] ^= 0xFF
    fs.pipe_file(data, bytes(raw))
    rc, text = run("verify", f"{root}/step_2")
    assert rc == 1 and "FAIL" in text and "checksum" in text

    # The installed command, with the endpoint and credentials from the environment.
    env = {
        **os.environ,
        "AWS_ENDPOINT_URL": s3_endpoint,
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-west-2",
    }
    proc = subprocess.run(
        [sys.executable, "-m", "asyncsave", "ls", root],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert "tracker -> step 2" in proc.stdout and "step_1" in proc.stdout


# -- memory:// (fast) --------------------------------------------------------------
@pytest.fixture
def mem_root() -> Iterator[str]:
    name = f"/asyncsave-test-{uuid.uuid4().hex[:12]}"
    yield f"memory://{name}"
    mem = fsspec.filesystem("memory")
    with contextlib.suppress(FileNotFoundError):
        mem.rm(name, recursive=True)


@pytest.mark.anyio
async def test_memory_round_trip_and_resume(mem_root: str) -> None:
    async with asyncsave.Checkpointer(mem_root) as ckpt:
        assert isinstance(ckpt._fs, FsspecFileSystem) and not ckpt._fs.atomic_rename
        for step in (1, 2, 3):
            await (await ckpt.save(step, state_of(step)))
    async with asyncsave.Checkpointer(mem_root) as ckpt:
        restored = await ckpt.load_latest()
        assert restored is not None and restored.info.step == 3
        assert_same(restored.state, state_of(3))
    assert [i.step for i in [asyncsave.latest(mem_root)] if i] == [3]


def test_memory_root_through_the_synchronous_facade(mem_root: str) -> None:
    with asyncsave.SyncCheckpointer(mem_root) as ckpt:
        info = ckpt.save(1, state_of(1)).result(timeout_s=60)
    assert info is not None and str(info.path).endswith(f"{mem_root[len('memory:///') :]}/step_1")
    assert_same(asyncsave.load(info.path), state_of(1))


def _commit_steps(root: str, *steps: int) -> None:
    async def go() -> None:
        async with asyncsave.Checkpointer(root) as ckpt:
            for step in steps:
                await (await ckpt.save(step, state_of(step)))

    anyio.run(go)


def test_memory_unmarked_prefix_is_ignored_then_moved_aside_at_open(mem_root: str) -> None:
    _commit_steps(mem_root, 1, 2)
    mem = fsspec.filesystem("memory")
    path = mem_root.removeprefix("memory://")
    # A copy of step 2's files under step 3's name: not a checkpoint of step 3.
    mem.copy(f"{path}/step_2", f"{path}/step_3", recursive=True)
    mem.rm_file(f"{path}/step_3/{MARKER}")
    info = asyncsave.latest(mem_root)
    assert info is not None and info.step == 2
    out = io.StringIO()
    assert cli_main(["ls", mem_root], out=out) == 0
    assert "step_3" in out.getvalue() and "not counted: no commit marker" in out.getvalue()

    async def reopen() -> int | None:
        async with asyncsave.Checkpointer(mem_root) as ckpt:
            restored = await ckpt.load_latest()
            return None if restored is None else restored.info.step

    assert anyio.run(reopen) == 2
    assert not mem.exists(f"{path}/step_3")
    aside = [n for n in mem.ls(path, detail=False) if ".asyncsave-incomplete-3-" in n]
    assert len(aside) == 1 and mem.exists(f"{aside[0]}/manifest.json")  # moved, not deleted
    assert mem.exists(f"{path}/step_2/{MARKER}")


def test_memory_damaged_checkpoint_is_moved_aside_not_deleted(mem_root: str) -> None:
    _commit_steps(mem_root, 1, 2)
    mem = fsspec.filesystem("memory")
    path = mem_root.removeprefix("memory://")
    data = f"{path}/step_2/data-r00000-000.safetensors"
    mem.pipe_file(data, mem.cat_file(data)[:-10])  # truncated

    async def reopen() -> int | None:
        async with asyncsave.Checkpointer(mem_root) as ckpt:
            restored = await ckpt.load_latest(fallback=True)
            return None if restored is None else restored.info.step

    assert anyio.run(reopen) == 1
    aside = [n for n in mem.ls(path, detail=False) if ".asyncsave-damaged-2-" in n]
    assert len(aside) == 1 and not mem.exists(f"{path}/step_2")
    assert mem.exists(f"{aside[0]}/data-r00000-000.safetensors")


class _Recorder:
    """An fsspec file system proxy that records its delete calls, in order."""

    def __init__(self, fs: Any) -> None:
        self._fs = fs
        self.calls: list[tuple[str, str]] = []

    def rm_file(self, path: str) -> None:
        self.calls.append(("rm_file", path))
        self._fs.rm_file(path)

    def rm(self, path: str, recursive: bool = False) -> None:
        self.calls.append(("rm", path))
        self._fs.rm(path, recursive=recursive)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._fs, name)


def test_deleting_a_checkpoint_removes_its_marker_alone_first(mem_root: str) -> None:
    # Retention and discards go through remove_tree: a deletion cut short after its
    # first call leaves an uncommitted prefix, never a marked one missing files.
    _commit_steps(mem_root, 1)
    rec = _Recorder(fsspec.filesystem("memory"))

    async def retire_step_1() -> None:
        async with asyncsave.Checkpointer(
            mem_root, filesystem=FsspecFileSystem(rec), retention=asyncsave.KeepLast(1)
        ) as ckpt:
            await (await ckpt.save(2, state_of(2)))

    anyio.run(retire_step_1)
    path = mem_root.removeprefix("memory://")
    deletes = [c for c in rec.calls if c[1].startswith(f"{path}/step_1")]
    assert deletes == [("rm_file", f"{path}/step_1/{MARKER}"), ("rm", f"{path}/step_1")]
    assert not rec._fs.exists(f"{path}/step_1")
    assert [info.step for info in asyncsave.checkpoints(mem_root)] == [2]


def test_fsspec_layer_overrides_every_call_of_the_local_layer() -> None:
    # A call added to the local layer must not silently do local I/O on an object store.
    calls = {n for n, v in vars(LocalFileSystem).items() if callable(v) and not n.startswith("_")}
    missing = sorted(n for n in calls if n not in vars(FsspecFileSystem))
    assert not missing, f"FsspecFileSystem must implement {missing}"


# -- root resolution ----------------------------------------------------------------
async def _save_one(root: Any, **kwargs: Any) -> None:
    async with asyncsave.Checkpointer(root, **kwargs) as ckpt:
        await (await ckpt.save(1, state_of(1)))


def test_the_root_chooses_the_layer(tmp_path: Path) -> None:
    """A local path, a ``file://`` URL and a local ``UPath`` save through the local
    layer (files on this disk, published by rename: no commit marker); a URL of
    another protocol through fsspec (objects under that URL, with a marker)."""
    from upath import UPath

    for i, root in enumerate(
        [
            tmp_path / "p",
            f"file://{tmp_path}/u",
            UPath(tmp_path / "up"),
            UPath(f"file://{tmp_path}/uu"),
        ]
    ):
        anyio.run(_save_one, root)
        on_disk = tmp_path / ["p", "u", "up", "uu"][i] / "step_1"
        assert (on_disk / "manifest.json").is_file(), root
        assert not (on_disk / MARKER).exists(), root  # renamed into place, no marker
        info = asyncsave.latest(root)
        assert info is not None and info.step == 1
    mem = f"memory:///asyncsave-test-{uuid.uuid4().hex[:12]}/x/y"
    try:
        anyio.run(_save_one, mem)
        objects = fsspec.filesystem("memory")
        assert objects.exists(f"{mem.removeprefix('memory://')}/step_1/{MARKER}")
        info = asyncsave.latest(mem)
        assert info is not None and str(info.path).startswith("memory://") and info.step == 1
    finally:
        fsspec.filesystem("memory").rm(
            mem.removeprefix("memory://").rsplit("/", 2)[0], recursive=True
        )


def test_storage_options_and_filesystem_must_fit_the_root(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="storage_options"):
        anyio.run(lambda: _save_one(tmp_path, storage_options={"key": "k"}))
    with pytest.raises(ValueError, match="local file system"):
        anyio.run(lambda: _save_one("memory://x", filesystem=LocalFileSystem()))
    with pytest.raises(ValueError, match="storage_options"):
        asyncsave.CheckpointOptions(storage_options=["key"])  # type: ignore[arg-type]
    assert not (tmp_path / "step_1").exists()


def test_errors_name_url_paths() -> None:
    with pytest.raises(asyncsave.CheckpointNotFoundError) as caught:
        asyncsave.load("memory://x/y/step_9")
    assert caught.value.path == "memory://x/y/step_9"


# -- several ranks (issue 11) ---------------------------------------------------------
def _ranks_on_s3(rank: int, world: int, root: str, options: dict[str, Any]) -> dict[str, Any]:
    def mine(step: int) -> dict[str, Any]:
        s = state_of(step)
        s["model"]["w"] = s["model"]["w"] + rank  # each rank its own bytes
        return s

    async def main() -> dict[str, Any]:
        seen: dict[str, Any] = {}
        async with asyncsave.Checkpointer(
            root, storage_options=options, dist_timeout_s=120
        ) as ckpt:
            h1 = await ckpt.save(1, mine(1))
            h2 = await ckpt.save(2, mine(2), lazy=True)
            seen["world"] = [(await h).world_size for h in (h1, h2)]  # type: ignore[union-attr]
        async with asyncsave.Checkpointer(
            root, storage_options=options, dist_timeout_s=120
        ) as ckpt:
            restored = await ckpt.load_latest()
            assert restored is not None
            assert_same(restored.state, mine(2))
            seen["resumed"] = restored.info.step
        return seen

    return anyio.run(main)


@pytest.mark.slow
def test_two_ranks_round_trip_on_s3(s3: tuple[str, dict[str, Any], Any], tmp_path: Path) -> None:
    """Every rank uploads its own files under the final prefix; rank 0 writes the
    manifest, then the commit marker; a fresh 2-rank run resumes each rank's part,
    a reader at world size 1 loads both."""
    sys.path.insert(0, str(Path(__file__).parent))
    from distributed import run_ranks, values

    root, options, fs = s3
    seen = values(run_ranks(_ranks_on_s3, 2, tmp_path, root, options, timeout_s=240))
    assert seen == [{"world": [2, 2], "resumed": 2}] * 2
    names = sorted(p.rsplit("/", 1)[-1] for p in fs.ls(f"{key(root)}/step_2", refresh=True))
    assert names == [
        MARKER,
        "data-r00000-000.safetensors",
        "data-r00001-000.safetensors",
        "manifest.json",
    ]
    whole = asyncsave.load(f"{root}/step_2", storage_options=options)
    assert torch.equal(whole[1]["model"]["w"], state_of(2)["model"]["w"] + 1)
    assert asyncsave.latest(root, storage_options=options).step == 2  # type: ignore[union-attr]


# -- incremental saves (issue 14) ---------------------------------------------------
class CopyLoggingFS(FaultyFsspecFS):
    def link(self, src: Path, dst: Path) -> None:
        self.log.append(("copy", str(dst)))
        super().link(src, dst)


@pytest.mark.anyio
async def test_s3_incremental_save_copies_unchanged_objects_server_side(s3: Any) -> None:
    """Unchanged data files become server-side copies (no upload of their bytes);
    retention deletes the base and the later checkpoint loads bit-exact; a fresh
    checkpointer reads a base object back and checks it before it copies it."""
    root, options, fs = s3
    state = state_of(1, big=True)  # model/w: its own data file (over 1 MiB)
    replay = torch.randn(300, 1024)  # 1.2 MB that only grows: stored as row chunks
    state["trainer"]["replay"] = replay
    layer = CopyLoggingFS(s3fs.S3FileSystem(**options))
    async with asyncsave.Checkpointer(
        root, filesystem=layer, incremental=True, retention=asyncsave.KeepLast(1)
    ) as ckpt:
        await (await ckpt.save(1, state))
        state["optim"]["m"].add_(1.0)  # in place: only the small tensors' file changes
        state["trainer"]["step"] = 2
        state["trainer"]["replay"] = replay = torch.cat([replay, torch.randn(30, 1024)])
        await (await ckpt.save(2, state))
    prefix = key(root)
    copied = [p.rsplit("/", 2)[1:] for op, p in layer.log if op == "copy"]
    created = [p.rsplit("/", 2)[1:] for op, p in layer.log if op == "create"]
    assert len(copied) == 2 and not [c for c in copied if c in created]  # never uploaded
    doc = json.loads(fs.cat_file(f"{prefix}/step_2/manifest.json"))
    # model/w and the replay buffer's first 300 rows; its 30 new rows are uploaded
    assert doc["incremental"]["files_shared"] == 2
    assert doc["incremental"]["bytes_shared"] > 3 * BLOCK + 300 * 4096
    assert doc["incremental"]["bytes_written"] < 30 * 4096 + 3 * 4096 + 8192
    assert not fs.exists(f"{prefix}/step_1")  # retention deleted the base
    loaded = asyncsave.load(f"{root}/step_2", storage_options=options)
    assert torch.equal(loaded["trainer"].pop("replay"), replay)
    assert_same(loaded, {**state, "trainer": {"step": 2, "name": "run-1"}})
    assert asyncsave.verify(f"{root}/step_2", storage_options=options).step == 2

    async with asyncsave.Checkpointer(root, storage_options=options, incremental=True) as ckpt:
        state["model"]["b"].add_(1.0)
        await (await ckpt.save(3, state))
    doc = json.loads(fs.cat_file(f"{prefix}/step_3/manifest.json"))
    assert doc["incremental"]["files_shared"] == 3  # the chunks continue after the reopen
    assert doc["incremental"]["bytes_verified"] > 3 * BLOCK  # read back before the copy
    loaded = asyncsave.load(f"{root}/step_3", storage_options=options)
    assert torch.equal(loaded["trainer"].pop("replay"), replay)
    assert_same(loaded, {**state, "trainer": {"step": 2, "name": "run-1"}})


class ETagPerObject:
    """An fsspec file system whose objects' ETags name the object, as GCS and
    Azure give a server-side copy an ETag of its own (S3 and moto give a copy its
    source's ETag)."""

    def __init__(self, fs: Any) -> None:
        self._fs = fs

    def info(self, path: str, **kwargs: Any) -> dict[str, Any]:
        info = dict(self._fs.info(path, **kwargs))
        for field in ("ETag", "etag"):
            if info.get(field):
                info[field] = f"{info[field]}@{path}"
        return info

    def __getattr__(self, name: str) -> Any:
        return getattr(self._fs, name)


class SourceReplacedBeforeCopy(FaultyFsspecFS):
    """Overwrites each copy's source with other bytes (same size) just before the
    server-side copy, while ``armed``: a base object replaced between its check
    and its copy."""

    armed = False

    def link(self, src: Path, dst: Path) -> None:
        if self.armed:
            p = self._p(src)
            data = bytearray(self.fs.cat_file(p))
            data[-1] = (data[-1] + 1) % 256
            self.fs.pipe_file(p, bytes(data))
        super().link(src, dst)


@pytest.mark.anyio
@pytest.mark.parametrize("replaced", [False, True], ids=["untouched", "replaced-before-copy"])
async def test_s3_copies_are_checked_through_their_source_when_etags_differ(
    s3: Any, replaced: bool
) -> None:
    """A store may give a copy an ETag of its own (GCS, Azure): simulated here by
    identities that name the object. A copy of an object this process wrote is
    then taken as checked when the source's identity is the known one before and
    after the copy (nothing read back); a source overwritten just before the copy
    is caught (the copy is read back, differs) and the file is uploaded in full."""
    root, options, _ = s3
    state = state_of(1, big=True)  # model/w: its own data file (over 1 MiB)
    layer = SourceReplacedBeforeCopy(ETagPerObject(s3fs.S3FileSystem(**options)))
    async with asyncsave.Checkpointer(root, filesystem=layer, incremental=True) as ckpt:
        await (await ckpt.save(1, state))
        state["optim"]["m"].add_(1.0)
        layer.armed = replaced
        await (await ckpt.save(2, state))
    doc = json.loads(layer.fs.cat_file(f"{key(root)}/step_2/manifest.json"))
    report = doc["incremental"]
    if replaced:
        assert report["files_shared"] == 0 and report["bytes_verified"] > 0, report
    else:
        assert report["files_shared"] == 1 and report["bytes_verified"] == 0, report
    loaded = asyncsave.load(f"{root}/step_2", storage_options=options)
    assert_same(loaded, {**state, "trainer": {"step": 1, "name": "run-1"}})
    assert asyncsave.verify(f"{root}/step_2", storage_options=options).step == 2
