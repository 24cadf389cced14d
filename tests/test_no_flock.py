"""A file system without ``flock`` (Lustre mounted without ``-o flock``, some NFS
and FUSE mounts): every way asyncsave locks a root refuses with a typed error that
names the root and the way forward, leaves nothing behind, and ``lock="none"``
works end to end. And a root in use names the process that holds it.

Lock refusals are injected by replacing ``fcntl.flock`` (the stdlib call every
lock goes through), for every descriptor or only for those under one directory.
Sources: google/tensorstore#183, google-research/t5x#452.
"""

from __future__ import annotations

import errno
import fcntl
import os
import socket
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

import asyncsave
from asyncsave.dcp import StorageReader, StorageWriter
from asyncsave.testing import cli as cli_main

pytestmark = pytest.mark.anyio

# The errnos a refused flock comes back with: Lustre without -o flock (ENOSYS),
# NFS without a lock manager (ENOLCK), FUSE (EOPNOTSUPP, EINVAL), and an I/O error.
REFUSALS = [errno.ENOSYS, errno.ENOLCK, errno.EOPNOTSUPP, errno.EINVAL, errno.EIO]
TRACKER = "latest_checkpointed_iteration.txt"


def _refuse_flock(monkeypatch: pytest.MonkeyPatch, code: int, under: Path | None = None) -> None:
    """Make every exclusive ``flock`` (on a descriptor of a path under ``under``,
    if given) fail with ``code``; unlocking is left alone."""
    real = fcntl.flock
    under = None if under is None else under.resolve()

    def flock(fd: int, op: int) -> None:
        if op & fcntl.LOCK_UN:
            return real(fd, op)
        target = os.readlink(f"/proc/self/fd/{fd}")
        if under is None or target == str(under) or target.startswith(f"{under}/"):
            raise OSError(code, os.strerror(code))
        return real(fd, op)

    monkeypatch.setattr(fcntl, "flock", flock)


def _tree(root: Path) -> dict[str, bytes | None]:
    """Every entry under ``root`` with a file's bytes (``None`` for a directory)."""
    out: dict[str, bytes | None] = {}
    for dirpath, dirs, files in os.walk(root):
        for d in dirs:
            out[os.path.relpath(os.path.join(dirpath, d), root)] = None
        for f in files:
            p = os.path.join(dirpath, f)
            out[os.path.relpath(p, root)] = Path(p).read_bytes()
    return out


def _state(step: int) -> dict[str, Any]:
    return {"w": torch.full((64,), float(step)), "step": step}


def _assert_refusal(exc: BaseException, root: Path, code: int) -> None:
    assert isinstance(exc, asyncsave.LockUnavailableError), repr(exc)
    assert isinstance(exc, asyncsave.CheckpointError) and isinstance(exc, OSError)
    assert exc.path == str(root) and exc.errno == code
    text = str(exc)
    assert str(root) in text and errno.errorcode[code] in text
    assert 'lock="none"' in text and "-o flock" in text


def _only_failure(exc: CheckpointException) -> BaseException:
    """The one rank's error inside DCP's exception (DCP keeps it with its traceback)."""
    (failure,) = exc.failures.values()
    return failure[0] if isinstance(failure, tuple) else failure


async def _save_steps(root: Path, steps: list[int], **options: Any) -> None:
    async with asyncsave.Checkpointer(root, **options) as ckpt:
        for s in steps:
            await (await ckpt.save(s, _state(s)))


@pytest.fixture
def populated(tmp_path: Path) -> Path:
    """A root with two committed checkpoints (and the lock file of their saver)."""
    root = tmp_path / "run"
    anyio.run(_save_steps, root, [1, 2])
    return root


# -- every locking path: a typed error naming the root, nothing left behind ------------


@pytest.mark.parametrize("code", REFUSALS)
async def test_checkpointer_open_refused_lock_is_typed_and_changes_nothing(
    populated: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, code: int
) -> None:
    before = _tree(populated)
    _refuse_flock(monkeypatch, code)
    with pytest.raises(asyncsave.LockUnavailableError) as info:
        async with asyncsave.Checkpointer(populated):
            pass
    _assert_refusal(info.value, populated, code)
    assert _tree(populated) == before
    # A fresh root: the lock file the refused call created is gone again.
    fresh = tmp_path / "fresh"
    with pytest.raises(asyncsave.LockUnavailableError) as info:
        async with asyncsave.Checkpointer(fresh):
            pass
    _assert_refusal(info.value, fresh, code)
    assert _tree(fresh) == {}


@pytest.mark.parametrize("code", REFUSALS)
def test_sync_checkpointer_refused_lock_is_typed(
    populated: Path, monkeypatch: pytest.MonkeyPatch, code: int
) -> None:
    before = _tree(populated)
    _refuse_flock(monkeypatch, code)
    with pytest.raises(asyncsave.LockUnavailableError) as info:
        with asyncsave.SyncCheckpointer(populated):
            pass
    _assert_refusal(info.value, populated, code)
    assert _tree(populated) == before


@pytest.mark.parametrize("code", REFUSALS)
def test_dcp_save_refused_lock_is_typed_and_leaves_no_temporary_directory(
    populated: Path, monkeypatch: pytest.MonkeyPatch, code: int
) -> None:
    """The writer locks its temporary directory first: refused there, the
    directory it made is removed, and DCP's exception carries the typed error."""
    before = _tree(populated)
    _refuse_flock(monkeypatch, code)
    with pytest.raises(CheckpointException) as info:
        dcp.save({"w": torch.ones(8)}, storage_writer=StorageWriter(str(populated), step=3))
    _assert_refusal(_only_failure(info.value), populated, code)
    assert _tree(populated) == before


@pytest.mark.parametrize("code", REFUSALS)
def test_dcp_commit_refused_root_lock_is_typed_and_leaves_nothing(
    populated: Path, monkeypatch: pytest.MonkeyPatch, code: int
) -> None:
    """Only the root's lock file refuses (the temporary directory locks): the
    commit's lock is refused, every temporary directory goes."""
    before = _tree(populated)
    _refuse_flock(monkeypatch, code, under=populated / ".asyncsave.lock")
    with pytest.raises(CheckpointException) as info:
        dcp.save({"w": torch.ones(8)}, storage_writer=StorageWriter(str(populated), step=3))
    _assert_refusal(_only_failure(info.value), populated, code)
    assert _tree(populated) == before


@pytest.mark.parametrize("code", REFUSALS)
async def test_tier_root_refused_lock_is_typed_and_changes_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, code: int
) -> None:
    """The local root locks; the persistent tier's root refuses."""
    local, remote = tmp_path / "local", tmp_path / "remote"
    remote.mkdir()
    _refuse_flock(monkeypatch, code, under=remote)
    with pytest.raises(asyncsave.LockUnavailableError) as info:
        async with asyncsave.Checkpointer(local, persistent=asyncsave.Tier(remote)):
            pass
    _assert_refusal(info.value, remote, code)
    assert _tree(remote) == {}
    # The local root's lock was let go: it opens again.
    async with asyncsave.Checkpointer(local):
        pass


@pytest.mark.parametrize("code", REFUSALS)
def test_cli_prune_refused_lock_is_one_line_and_deletes_nothing(
    populated: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    code: int,
) -> None:
    before = _tree(populated)
    _refuse_flock(monkeypatch, code)
    assert cli_main(["prune", str(populated), "--keep-last", "1"]) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert str(populated) in err and "--lock none" in err and errno.errorcode[code] in err
    assert _tree(populated) == before


# -- lock="none": works end to end where flock does not ---------------------------------


def test_lock_option_is_validated() -> None:
    for bad in ("fcntl", "", None, True):
        with pytest.raises(ValueError, match="lock="):
            asyncsave.CheckpointOptions(lock=bad)  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="lock="):
            StorageWriter("runs/x", step=1, lock=bad)  # type: ignore[arg-type]


@pytest.mark.parametrize("code", [errno.ENOSYS, errno.ENOLCK])
async def test_checkpointer_without_lock_saves_resumes_and_prunes(
    populated: Path, monkeypatch: pytest.MonkeyPatch, code: int
) -> None:
    _refuse_flock(monkeypatch, code)
    opts: dict[str, Any] = {"lock": "none", "retention": asyncsave.KeepLast(2)}
    async with asyncsave.Checkpointer(populated, **opts) as ckpt:
        restored = await ckpt.load_latest()
        assert restored is not None and restored.info.step == 2
        for s in (3, 4):
            await (await ckpt.save(s, _state(s)))
    async with asyncsave.Checkpointer(populated, **opts) as ckpt:
        restored = await ckpt.load_latest()
        assert restored is not None and restored.info.step == 4
        assert torch.equal(restored.state["w"], _state(4)["w"])
    assert sorted(p.name for p in populated.iterdir() if p.name.startswith("step_")) == [
        "step_3",
        "step_4",
    ]
    assert (populated / TRACKER).read_text().strip() == "4"


async def test_fresh_root_without_lock_never_creates_a_lock_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _refuse_flock(monkeypatch, errno.ENOSYS)
    root = tmp_path / "run"
    await _save_steps(root, [1], lock="none")
    assert sorted(p.name for p in root.iterdir()) == sorted(["step_1", TRACKER])


async def test_tiers_without_lock_persist(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _refuse_flock(monkeypatch, errno.ENOSYS)
    local, remote = tmp_path / "local", tmp_path / "remote"
    async with asyncsave.Checkpointer(
        local, persistent=asyncsave.Tier(remote), lock="none"
    ) as ckpt:
        handle = await ckpt.save(1, _state(1))
        await handle.persisted()
    info = asyncsave.latest(remote)
    assert info is not None and info.step == 1
    assert not (remote / ".asyncsave.lock").exists()


@pytest.mark.parametrize("code", [errno.ENOSYS, errno.EOPNOTSUPP])
def test_dcp_save_without_lock_commits_and_loads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, code: int
) -> None:
    _refuse_flock(monkeypatch, code)
    root = tmp_path / "run"
    for step in (1, 2):
        state = {"w": torch.arange(16.0) * step}
        dcp.save(state, storage_writer=StorageWriter(str(root), step=step, lock="none"))
    out = {"w": torch.zeros(16)}
    dcp.load(out, storage_reader=StorageReader(str(root)))
    assert torch.equal(out["w"], torch.arange(16.0) * 2)
    assert sorted(p.name for p in root.iterdir()) == sorted(["step_1", "step_2", TRACKER])


def test_cli_prune_without_lock_prunes(
    populated: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    _refuse_flock(monkeypatch, errno.ENOSYS)
    assert cli_main(["prune", str(populated), "--keep-last", "1", "--lock", "none"]) == 0
    assert "deleted step_1" in capsys.readouterr().out
    assert sorted(p.name for p in populated.iterdir() if p.name.startswith("step_")) == ["step_2"]


# -- a root in use names its holder ------------------------------------------------------


async def test_root_in_use_names_the_holder_in_this_process(tmp_path: Path) -> None:
    root = tmp_path / "run"
    async with asyncsave.Checkpointer(root):
        with pytest.raises(asyncsave.RootInUseError) as info:
            async with asyncsave.Checkpointer(root):
                pass
    text = str(info.value)
    assert f"pid {os.getpid()} on host {socket.gethostname()} (this process)" in text, text
    # Released: the record goes with the lock, so nothing stale names it later.
    assert (root / ".asyncsave.lock").read_bytes() == b""


@pytest.fixture
def holder(tmp_path: Path) -> Iterator[tuple[Path, subprocess.Popen[str]]]:
    """Another process that holds ``run``'s saver lock (a Checkpointer opened on
    it) until its stdin closes."""
    root = tmp_path / "run"
    code = textwrap.dedent(
        f"""
        import sys, asyncsave
        with asyncsave.SyncCheckpointer({str(root)!r}):
            print("open", flush=True)
            sys.stdin.read()
        """
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "open"
        yield root, proc
    finally:
        assert proc.stdin is not None
        proc.stdin.close()
        proc.wait(timeout=60)
        if proc.stdout is not None:
            proc.stdout.close()


async def test_root_in_use_names_the_holder_in_another_process(
    holder: tuple[Path, subprocess.Popen[str]],
) -> None:
    root, proc = holder
    with pytest.raises(asyncsave.RootInUseError) as info:
        async with asyncsave.Checkpointer(root):
            pass
    assert f"pid {proc.pid} on host {socket.gethostname()}" in str(info.value), info.value


def test_dcp_commit_waiting_on_a_held_root_names_the_holder(
    holder: tuple[Path, subprocess.Popen[str]],
) -> None:
    root, proc = holder
    writer = StorageWriter(str(root), step=1, lock_timeout_s=0.2)
    with pytest.raises(CheckpointException) as info:
        dcp.save({"w": torch.ones(4)}, storage_writer=writer)
    failure = _only_failure(info.value)
    assert isinstance(failure, asyncsave.RootInUseError)
    assert f"pid {proc.pid} on host {socket.gethostname()}" in str(failure), failure
    assert not [p for p in root.iterdir() if p.name.startswith(".asyncsave-tmp-")]
