"""Checkpoints copied under their final names by a tool: never deleted at open.

A local run's ``step_N/`` and tracker copied file by file into another root (as
``aws s3 sync``, ``gsutil rsync`` or ``rclone`` do: no ``commit_success.txt``) are
adopted after a full verify, or moved aside with every byte kept when the copy is
partial; readers say what they found and why they do not count it; ``asyncsave
adopt PATH`` commits one by hand. Sources: allenai/open-instruct #1299 and
google/orbax #394 (copied checkpoints deleted for lack of the commit marker).

Each test runs on a local root, ``memory://`` and the moto S3 server (the fixture
of ``test_objstore``).
"""

from __future__ import annotations

import contextlib
import errno
import io
import logging
import os
import shutil
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import anyio
import fsspec
import pytest
import s3fs
import test_objstore
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import asyncsave
from asyncsave.testing import cli as cli_main

s3_endpoint = test_objstore.s3_endpoint  # the fixture, shared

TRACKER = "latest_checkpointed_iteration.txt"
MARKER = "commit_success.txt"
DATA = "data-r00000-000.safetensors"


def state_of(step: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(step)
    return {
        "model": {"w": torch.randn(257, generator=g), "b": torch.randn(8, generator=g).half()},
        "trainer": {"step": step},
    }


def assert_state(got: dict[str, Any], step: int) -> None:
    want = state_of(step)
    assert got["trainer"] == want["trainer"]
    for k, v in want["model"].items():
        assert got["model"][k].dtype == v.dtype and torch.equal(got["model"][k], v), k


class Store:
    """A root on one kind of storage, seen as a tool sees it: files by relative name."""

    def __init__(self, url: str, fs: Any, base: str, options: dict[str, Any] | None) -> None:
        self.url, self.fs, self.base, self.options = url, fs, base, options

    def kw(self) -> dict[str, Any]:
        return {} if self.options is None else {"storage_options": self.options}

    def put(self, rel: str, data: bytes) -> None:
        self.fs.pipe_file(f"{self.base}/{rel}", data)

    def files(self) -> dict[str, bytes]:
        """Every file under the root by relative name (what a byte count checks)."""
        self.fs.invalidate_cache()
        found = self.fs.find(self.base)
        return {p[len(self.base.rstrip("/")) + 1 :]: self.fs.cat_file(p) for p in found}

    def cli(self, *argv: str) -> tuple[int, str, str]:
        extra = [] if self.options is None else ["--storage-options", _json(self.options)]
        out, err = io.StringIO(), io.StringIO()
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr("sys.stderr", err)
            rc = cli_main([*argv, *extra], out=out)
        return rc, out.getvalue(), err.getvalue()


def _json(options: dict[str, Any]) -> str:
    import json

    return json.dumps(options)


@pytest.fixture(params=["local", "memory", "s3"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Store]:
    kind = request.param
    if kind == "local":
        root = tmp_path / "copy"
        root.mkdir()
        yield Store(str(root), fsspec.filesystem("file", auto_mkdir=True), str(root), None)
    elif kind == "memory":
        name = f"/asyncsave-adopt-{uuid.uuid4().hex[:12]}"
        mem = fsspec.filesystem("memory")
        yield Store(f"memory://{name}", mem, name, None)
        with contextlib.suppress(FileNotFoundError):
            mem.rm(name, recursive=True)
    else:
        endpoint = request.getfixturevalue("s3_endpoint")
        options = test_objstore._options(endpoint)
        fs = s3fs.S3FileSystem(**options)
        bucket = f"adopt-{uuid.uuid4().hex[:12]}"
        fs.mkdir(bucket)
        yield Store(f"s3://{bucket}/runs/exp1", fs, f"{bucket}/runs/exp1", options)


@pytest.fixture
def local_run(tmp_path: Path) -> dict[str, bytes]:
    """A local run of steps 1 and 2 with its tracker, as a sync tool reads it."""
    src = tmp_path / "run"

    async def go() -> None:
        async with asyncsave.Checkpointer(src) as ckpt:
            for step in (1, 2):
                await (await ckpt.save(step, state_of(step)))

    anyio.run(go)
    files = {str(p.relative_to(src)): p.read_bytes() for p in src.rglob("*") if p.is_file()}
    shutil.rmtree(src)
    return files


def _sync(store: Store, files: dict[str, bytes]) -> None:
    for rel, data in files.items():
        store.put(rel, data)


async def _open_only(store: Store) -> None:
    async with asyncsave.Checkpointer(store.url, **store.kw()):
        pass


def _open_and_resume(store: Store, *, fallback: bool = False) -> int | None:
    async def go() -> int | None:
        async with asyncsave.Checkpointer(store.url, **store.kw()) as ckpt:
            restored = await ckpt.load_latest(fallback=fallback)
            if restored is None:
                return None
            assert_state(restored.state, restored.info.step)
            return restored.info.step

    return anyio.run(go)


def _kept(before: dict[str, bytes], after: dict[str, bytes]) -> None:
    """Every copied byte of a checkpoint is still under the root: at its own name,
    or under the same name in a directory moved aside (the tracker is no checkpoint:
    it moves forward to the newest committed step)."""
    moved: dict[tuple[str, str], list[bytes]] = {}
    for rel, data in after.items():
        if rel.startswith(".asyncsave-") and "/" in rel:
            aside, tail = rel.split("/", 1)
            step = aside.split("-")[2]  # .asyncsave-<why>-<step>-<id>
            moved.setdefault((step, tail), []).append(data)
    for rel, data in before.items():
        if "/" not in rel:
            continue  # the tracker, the lock file
        if rel in after:
            assert after[rel] == data, rel
        else:
            name, tail = rel.split("/", 1)
            assert data in moved.get((name.removeprefix("step_"), tail), []), f"{rel} was lost"


# -- a whole copy ---------------------------------------------------------------------
def test_a_run_copied_by_a_sync_tool_is_adopted_at_open_every_byte_kept(
    store: Store, local_run: dict[str, bytes], caplog: pytest.LogCaptureFixture
) -> None:
    _sync(store, local_run)
    object_store = not store.url.startswith("/")
    if object_store:
        # Readers: not counted, and they say why and how to adopt it.
        with pytest.raises(asyncsave.UncommittedCheckpointError, match="asyncsave adopt") as err:
            asyncsave.latest(store.url, **store.kw())
        assert "step_2" in str(err.value) and err.value.step == 2
        with caplog.at_level(logging.WARNING, logger="asyncsave"):
            assert asyncsave.checkpoints(store.url, **store.kw()) == []
        assert "step_1" in caplog.text and "asyncsave adopt" in caplog.text
        _, out, _ = store.cli("ls", store.url)
        assert "not counted: no commit marker" in out and out.count("asyncsave adopt") == 2
    assert _open_and_resume(store) == 2
    after = store.files()
    for rel, data in local_run.items():
        assert after[rel] == data, rel  # every byte in place
    if object_store:
        assert f"step_1/{MARKER}" in after and f"step_2/{MARKER}" in after
    assert [c.step for c in asyncsave.checkpoints(store.url, **store.kw())] == [1, 2]
    info = asyncsave.latest(store.url, **store.kw())
    assert info is not None and info.step == 2


def test_a_run_copied_without_its_tracker_is_not_taken_for_an_empty_root(
    store: Store, local_run: dict[str, bytes]
) -> None:
    _sync(store, {k: v for k, v in local_run.items() if k != TRACKER})
    if not store.url.startswith("/"):
        with pytest.raises(asyncsave.UncommittedCheckpointError, match="step_1, step_2"):
            asyncsave.latest(store.url, **store.kw())
    assert _open_and_resume(store) == 2


# -- a partial copy -------------------------------------------------------------------
def _without(files: dict[str, bytes], rel: str) -> dict[str, bytes]:
    return {k: v for k, v in files.items() if k != rel}


def _changed(files: dict[str, bytes], rel: str, fn: Callable[[bytes], bytes]) -> dict[str, bytes]:
    return {**files, rel: fn(files[rel])}


def _flip(data: bytes) -> bytes:
    return data[:-3] + bytes([data[-3] ^ 0x5A]) + data[-2:]


PARTIAL: dict[str, Callable[[dict[str, bytes]], dict[str, bytes]]] = {
    "data-missing": lambda f: _without(f, f"step_2/{DATA}"),
    "data-truncated": lambda f: _changed(f, f"step_2/{DATA}", lambda d: d[: len(d) // 2]),
    "manifest-missing": lambda f: _without(f, "step_2/manifest.json"),
    "manifest-truncated": lambda f: _changed(f, "step_2/manifest.json", lambda d: d[:40]),
    "byte-flipped": lambda f: _changed(f, f"step_2/{DATA}", _flip),
}


@pytest.mark.parametrize("cut", sorted(PARTIAL))
def test_a_partial_copy_is_moved_aside_with_every_byte_kept(
    store: Store, local_run: dict[str, bytes], cut: str
) -> None:
    object_store = not store.url.startswith("/")
    copied = PARTIAL[cut](local_run)
    _sync(store, copied)
    if cut == "byte-flipped" and not object_store:
        # A local directory under its final name is committed (the rename is the
        # commit; sizes are checked at open, checksums when read): kept in place.
        anyio.run(_open_only, store)
        assert store.files() == {**copied, TRACKER: b"2"}
        with pytest.raises(asyncsave.ChecksumMismatchError):
            asyncsave.verify(f"{store.url}/step_2")
        return
    if object_store:
        _, out, _ = store.cli("ls", store.url)
        line = next(ln for ln in out.splitlines() if "step_2" in ln)
        expect = "manifest and file sizes check out" if cut == "byte-flipped" else "moves it aside"
        assert expect in line
    assert _open_and_resume(store, fallback=True) == 1
    after = store.files()
    _kept(copied, after)
    assert not any(rel.startswith("step_2/") for rel in after)
    aside = {rel.split("/", 1)[0] for rel in after if rel.startswith(".asyncsave-")}
    assert len(aside) == 1 and aside.pop().startswith(
        (".asyncsave-incomplete-2-", ".asyncsave-damaged-2-")
    )


@settings(
    max_examples=15,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(data=st.data())
def test_any_partial_copy_on_memory_loses_no_byte(
    local_run: dict[str, bytes], data: st.DataObject
) -> None:
    """Any subset of the files copied, any one of them cut short: after an open,
    every copied byte is still under the root, and every whole step loads."""
    names = sorted(local_run)
    chosen = data.draw(st.lists(st.sampled_from(names), unique=True, min_size=1), label="files")
    copied = {k: local_run[k] for k in chosen}
    if data.draw(st.booleans(), label="cut one"):
        victim = data.draw(st.sampled_from(sorted(copied)), label="victim")
        keep = data.draw(st.integers(0, max(0, len(copied[victim]) - 1)), label="keep")
        copied[victim] = copied[victim][:keep]
    name = f"/asyncsave-adopt-h-{uuid.uuid4().hex[:12]}"
    mem = fsspec.filesystem("memory")
    store = Store(f"memory://{name}", mem, name, None)
    try:
        _sync(store, copied)
        with contextlib.suppress(asyncsave.CheckpointError):
            _open_and_resume(store, fallback=True)
        after = store.files()
        _kept(copied, after)
        for step in (1, 2):
            whole = all(
                copied.get(k) == v for k, v in local_run.items() if k.startswith(f"step_{step}/")
            )
            if whole:
                assert_state(asyncsave.load(f"{store.url}/step_{step}"), step)
    finally:
        with contextlib.suppress(FileNotFoundError):
            mem.rm(name, recursive=True)


# -- adopting by hand -----------------------------------------------------------------
def test_adopt_verb_commits_a_whole_copy_and_refuses_a_damaged_one(
    store: Store, local_run: dict[str, bytes]
) -> None:
    copied = _changed(local_run, f"step_1/{DATA}", _flip)
    _sync(store, copied)
    rc, out, err = store.cli("adopt", f"{store.url}/step_2")
    assert rc == 0, err
    assert "step 2" in out and "verified" in out
    info = asyncsave.latest(store.url, **store.kw())
    assert info is not None and info.step == 2
    assert_state(asyncsave.load(info.path), 2)
    rc, _, err = store.cli("adopt", f"{store.url}/step_1")
    assert rc == 1 and "not adopted, nothing written" in err and "checksum" in err
    with pytest.raises(asyncsave.ChecksumMismatchError):
        asyncsave.adopt(f"{store.url}/step_1", **store.kw())
    assert f"step_1/{MARKER}" not in store.files()
    assert store.files()[f"step_1/{DATA}"] == copied[f"step_1/{DATA}"]
    with pytest.raises(asyncsave.CheckpointError, match="not named like a checkpoint"):
        asyncsave.adopt(store.url, **store.kw())
    rc, _, err = store.cli("adopt", f"{store.url}/step_9")
    assert rc == 1 and "no such file" in err


# -- what readers say about a checkpoint moved aside ----------------------------------
def _truncate(path: Path) -> None:
    data = path / DATA
    data.write_bytes(data.read_bytes()[:-7])


def _bad_manifest(path: Path) -> None:
    (path / "manifest.json").write_bytes(b'{"format": "asyncsave", garbage')


def _no_data(path: Path) -> None:
    (path / DATA).unlink()


@pytest.mark.parametrize("damage", [_truncate, _bad_manifest, _no_data], ids=lambda f: f.__name__)
def test_a_checkpoint_moved_aside_at_open_is_later_reported_with_where_it_went(
    tmp_path: Path, damage: Callable[[Path], None]
) -> None:
    root = tmp_path / "run"

    async def save() -> None:
        async with asyncsave.Checkpointer(root) as ckpt:
            for step in (1, 2):
                await (await ckpt.save(step, state_of(step)))

    anyio.run(save)
    damage(root / "step_2")
    assert _open_and_resume(Store(str(root), None, str(root), None), fallback=True) == 1
    (aside,) = [p for p in root.iterdir() if p.name.startswith(".asyncsave-")]
    for call in (
        lambda: asyncsave.load(root / "step_2"),
        lambda: asyncsave.latest(root),
        lambda: asyncsave.load_step(root, 2),
    ):
        with pytest.raises(asyncsave.CheckpointNotFoundError) as err:
            call()
        assert "moved aside at open" in str(err.value) and aside.name in str(err.value)
        assert "has no manifest.json" not in str(err.value)
    out = io.StringIO()
    assert cli_main(["ls", str(root)], out=out) == 1
    assert f"moved aside at open to {aside.name}" in out.getvalue()


# -- what latest() and verify() say of a checkpoint's size ------------------------------
def _sizes_agree(url: str, layout: str, kw: dict[str, Any]) -> None:
    listed = asyncsave.checkpoints(url, layout=layout, **kw)[-1]
    assert listed.size_bytes is not None and listed.size_bytes > listed.nbytes
    assert listed.saved_unix_s is not None
    found = asyncsave.latest(url, layout=layout, **kw)
    verified = asyncsave.verify(listed.path, **kw)
    for info in (found, verified):
        assert info is not None and info.step == listed.step
        assert (info.size_bytes, info.saved_unix_s) == (listed.size_bytes, listed.saved_unix_s)


@pytest.mark.parametrize("layout", ["asyncsave", "verl"])
def test_latest_and_verify_fill_size_and_time_as_checkpoints_does(
    store: Store, layout: str
) -> None:
    async def save() -> None:
        async with asyncsave.Checkpointer(store.url, layout=layout, **store.kw()) as ckpt:
            for step in (1, 2):
                await (await ckpt.save(step, state_of(step), training_info={"loss": 0.5}))

    anyio.run(save)
    _sizes_agree(store.url, layout, store.kw())


def test_sizes_count_a_layouts_info_file_in_latest_and_verify(tmp_path: Path) -> None:
    async def save() -> None:
        async with asyncsave.Checkpointer(tmp_path, layout="nemo-rl") as ckpt:
            await (await ckpt.save(4, state_of(4), training_info={"loss": 0.5}))

    anyio.run(save)
    assert (tmp_path / "step_4" / "training_info.json").exists()
    _sizes_agree(str(tmp_path), "nemo-rl", {})


# -- the command line -----------------------------------------------------------------
@pytest.mark.parametrize(
    ("saved", "asked"), [("asyncsave", "megatron"), ("megatron", "asyncsave"), ("verl", "megatron")]
)
def test_ls_with_another_layout_names_the_layout_before_any_missing_step(
    tmp_path: Path, saved: str, asked: str
) -> None:
    async def save() -> None:
        async with asyncsave.Checkpointer(tmp_path, layout=saved) as ckpt:
            await (await ckpt.save(3, state_of(3)))

    anyio.run(save)
    out = io.StringIO()
    assert cli_main(["ls", str(tmp_path), "--layout", asked], out=out) == 1
    text = out.getvalue()
    assert f"pass --layout {saved}" in text
    assert "missing" not in text


def _three_steps(root: Path) -> None:
    async def save() -> None:
        async with asyncsave.Checkpointer(root) as ckpt:
            for step in (1, 2, 3):
                await (await ckpt.save(step, state_of(step)))

    anyio.run(save)


def _lock_is_a_directory(root: Path, mp: pytest.MonkeyPatch) -> None:
    (root / ".asyncsave.lock").unlink()
    (root / ".asyncsave.lock").mkdir()


def _read_only(root: Path, mp: pytest.MonkeyPatch) -> None:
    if os.geteuid() != 0:
        for p in (root, *root.iterdir()):
            p.chmod(0o555)
        return

    # root ignores permissions: the call a read-only mount refuses first.
    def refuse(self: Any, path: Path) -> int | None:
        raise OSError(errno.EROFS, "Read-only file system", str(path))

    mp.setattr(asyncsave.LocalFileSystem, "lock", refuse)


@pytest.mark.parametrize("make", [_lock_is_a_directory, _read_only], ids=lambda f: f.__name__)
def test_prune_on_a_root_it_cannot_lock_is_one_line_and_status_1(
    tmp_path: Path, make: Callable[[Path, pytest.MonkeyPatch], None]
) -> None:
    root = tmp_path / "run"
    _three_steps(root)
    out, err = io.StringIO(), io.StringIO()
    try:
        with pytest.MonkeyPatch.context() as mp:
            make(root, mp)
            mp.setattr("sys.stderr", err)
            rc = cli_main(["prune", str(root), "--keep-last", "1"], out=out)
    finally:
        for p in (root, *root.iterdir()):
            p.chmod(0o755)
    assert rc == 1
    lines = err.getvalue().strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err.getvalue(), err.getvalue()
    assert str(root) in lines[0]
    assert sorted(p.name for p in root.iterdir() if p.name.startswith("step_")) == [
        "step_1",
        "step_2",
        "step_3",
    ]
