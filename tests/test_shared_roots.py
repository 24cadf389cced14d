"""Roots shared by a group (S21; huggingface/datasets #7900): every file and
directory asyncsave creates follows the process umask as ``open(2)``/``mkdir(2)``
do, and taking the root's lock needs no write permission on an existing lock file,
so a second member of the group opens, saves into, updates and retires checkpoints
in a root the first one created.

The second member is a real second user: throwaway users and a group are created
(``groupadd``/``useradd``, which needs root) and removed afterwards, and each user's
part runs in a child process that drops to that user's uid, gid and groups."""

from __future__ import annotations

import dataclasses
import grp
import json
import os
import pwd
import shutil
import stat
import subprocess
import sys
import tempfile
import textwrap
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import fsspec
import pytest
import torch
import torch.distributed.checkpoint as dcp

import asyncsave
from asyncsave import FsspecFileSystem
from asyncsave.dcp import StorageWriter

pytestmark = pytest.mark.anyio


def _state(step: int) -> dict[str, Any]:
    return {
        "model": {"w": torch.arange(2048, dtype=torch.float32) + step},
        "trainer": {"step": step, "ids": torch.tensor([step, 1, 2])},
    }


def _modes(top: Path) -> dict[str, tuple[str, int, int]]:
    """(kind, permission bits, gid) of ``top`` and everything under it."""
    out: dict[str, tuple[str, int, int]] = {}
    for p in [top, *sorted(top.rglob("*"))]:
        st = os.lstat(p)
        kind = "dir" if stat.S_ISDIR(st.st_mode) else "file"
        out[str(p.relative_to(top.parent))] = (kind, stat.S_IMODE(st.st_mode), st.st_gid)
    return out


def _expected(kind: str, umask: int) -> int:
    # A directory under a setgid directory inherits the setgid bit (mkdir(2)).
    return 0o666 & ~umask if kind == "file" else (0o777 & ~umask) | stat.S_ISGID


def _setgid_dir(path: Path) -> Path:
    path.mkdir()
    if os.geteuid() == 0:
        os.chown(path, -1, 4242)  # not the creator's group: files must take this one
    os.chmod(path, 0o2777)  # chmod: the mode of this test directory, not one asyncsave made
    return path


@pytest.fixture(params=[0o002, 0o022, 0o007, 0o077], ids=lambda m: f"umask{m:03o}")
def umask(request: pytest.FixtureRequest) -> Iterator[int]:
    old = os.umask(request.param)
    try:
        yield request.param
    finally:
        os.umask(old)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")
async def test_every_file_and_directory_follows_the_umask(tmp_path: Path, umask: int) -> None:
    shared = _setgid_dir(tmp_path / "shared")
    root = shared / "runs" / "exp"  # asyncsave creates both levels
    async with asyncsave.Checkpointer(root) as ckpt:
        await (await ckpt.save(1, _state(1)))
        await ckpt.update(1, "trainer", {"step": 10, "ids": torch.tensor([9])})
        await (await ckpt.save(2, _state(2)))
        await (await ckpt.save(2, _state(3), overwrite=True))
    (root / "step_7").mkdir()
    (root / "step_7" / "manifest.json").write_text("{")  # damaged: moved aside at open
    async with asyncsave.Checkpointer(root, budget_bytes=8 << 10) as ckpt:
        await (await ckpt.save(3, _state(3)))  # streamed through a small budget
    nemo = shared / "nemo"
    async with asyncsave.Checkpointer(nemo, layout="nemo-rl") as ckpt:
        await (await ckpt.save(1, _state(1), training_info={"reward": 0.5}))
    marker_root = shared / "fsspec"
    layer = FsspecFileSystem(fsspec.filesystem("file", auto_mkdir=True))
    async with asyncsave.Checkpointer(marker_root, filesystem=layer) as ckpt:
        await (await ckpt.save(1, _state(1)))
    dcp_root = shared / "dcp"
    await anyio.to_thread.run_sync(
        lambda: dcp.save({"w": torch.ones(64)}, storage_writer=StorageWriter(dcp_root, step=1))
    )

    modes = {**_modes(shared / "runs"), **_modes(nemo), **_modes(marker_root), **_modes(dcp_root)}
    names = {Path(k).name for k in modes}
    # Every creation site is represented: lock, tracker, temp dirs (now final),
    # data files (whole, streamed, update, DCP), manifests, training_info, marker.
    for name in (
        ".asyncsave.lock",
        "latest_checkpointed_iteration.txt",
        "manifest.json",
        "training_info.json",
        "commit_success.txt",
        "step_3",
    ):
        assert name in names, name
    assert any(n.startswith("update-") for n in names)
    assert any(n.startswith(".asyncsave-damaged-7-") for n in names)
    assert sum(k.endswith(".safetensors") for k in modes) >= 5
    wrong = {
        k: (kind, oct(mode), oct(_expected(kind, umask)))
        for k, (kind, mode, _) in modes.items()
        if mode != _expected(kind, umask)
    }
    assert not wrong, wrong
    if os.geteuid() == 0:
        assert {gid for _, _, gid in modes.values()} == {4242}  # the setgid dir's group


# -- a real second member of the group ------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _User:
    name: str
    uid: int
    gid: int
    groups: list[int]


@dataclasses.dataclass(frozen=True)
class _Team:
    base: Path  # removed afterwards
    shared: Path  # setgid, group-writable, owned by root and the team's group
    gid: int
    alice: _User
    bob: _User


def _admin(*argv: str) -> None:
    for _ in range(20):  # /etc/passwd may be locked for a moment by another tool
        proc = subprocess.run(argv, capture_output=True, text=True, check=False)
        if proc.returncode == 0:
            return
        if "lock" not in proc.stderr:
            break
        time.sleep(0.1)
    raise RuntimeError(f"{' '.join(argv)} failed: {proc.stderr.strip()}")


@pytest.fixture
def team() -> Iterator[_Team]:
    if os.geteuid() != 0:
        pytest.skip("creating throwaway users needs root")
    tag = uuid.uuid4().hex[:8]
    group, names = f"asg{tag}", [f"asa{tag}", f"asb{tag}"]
    made_users: list[str] = []
    made_group = False
    base = Path(tempfile.mkdtemp(prefix="asyncsave-s21-"))
    try:
        _admin("groupadd", group)
        made_group = True
        for name in names:
            _admin("useradd", "-M", "-U", "-G", group, "-s", "/usr/sbin/nologin", name)
            made_users.append(name)
        gid = grp.getgrnam(group).gr_gid
        users = []
        for name in names:
            pw = pwd.getpwnam(name)
            users.append(_User(name, pw.pw_uid, pw.pw_gid, os.getgrouplist(name, pw.pw_gid)))
        os.chmod(base, 0o755)  # mkdtemp makes it 0700: the users must reach the root
        shared = base / "project"
        shared.mkdir()
        os.chown(shared, 0, gid)
        os.chmod(shared, 0o2775)
        (base / "home").mkdir(mode=0o1777)
        os.chmod(base / "home", 0o1777)
        yield _Team(base, shared, gid, users[0], users[1])
    finally:
        shutil.rmtree(base)
        for name in made_users:
            _admin("userdel", name)  # removes the user's private group too
        if made_group:
            _admin("groupdel", group)


_CHILD = textwrap.dedent(
    """
    import json, logging, os, shutil, sys, tempfile
    import anyio, torch
    import asyncsave

    spec = json.loads(sys.argv[1])
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)

    def state(step):
        return {"model": {"w": torch.arange(2048, dtype=torch.float32) + step},
                "trainer": {"step": step, "ids": torch.tensor([step, 1, 2])}}

    async def run(root, ops):
        out = []
        try:
            rule = asyncsave.KeepLast(spec["keep"])
            async with asyncsave.Checkpointer(root, retention=rule) as ckpt:
                out.append(["open"])
                for op, step in ops:
                    if op == "load":
                        restored = await ckpt.load_latest()
                        out.append([op, None if restored is None else restored.info.step])
                    elif op == "save":
                        await (await ckpt.save(step, state(step)))
                        out.append([op, step])
                    elif op == "update":
                        await ckpt.update(step, "trainer", {"step": -step})
                        out.append([op, step])
        except asyncsave.CheckpointError as exc:
            out.append(["error", type(exc).__name__, str(exc)])
        return out

    def go(root, ops):
        return anyio.run(run, root, ops, backend=spec["backend"],
                         backend_options=spec["backend_options"])

    # The interpreter lives where the test users cannot read: everything a run
    # imports lazily is imported now, as root, by the same calls on a scratch root.
    scratch = tempfile.mkdtemp()
    try:
        go(os.path.join(scratch, "r"), [["save", 1], ["save", 2], ["save", 3],
                                        ["update", 3], ["load", 0]])
    finally:
        shutil.rmtree(scratch)
    os.setgroups(spec["groups"])
    os.setgid(spec["gid"])
    os.setuid(spec["uid"])
    os.umask(spec["umask"])
    print(json.dumps(go(spec["root"], spec["ops"])))
    """
)


async def _as_user(
    team: _Team,
    user: _User,
    root: Path,
    ops: list[tuple[str, int]],
    *,
    umask: int,
    backend: tuple[str, dict[str, Any]],
    keep: int = 2,
) -> tuple[list[list[Any]], str]:
    """Run ``ops`` on a Checkpointer of ``root`` as ``user``, in a child process."""
    spec = {
        "root": str(root),
        "ops": ops,
        "uid": user.uid,
        "gid": user.gid,
        "groups": user.groups,
        "umask": umask,
        "keep": keep,
        "backend": backend[0],
        "backend_options": backend[1],
    }
    env = {**os.environ, "HOME": str(team.base / "home")}
    with anyio.fail_after(300):
        proc = await anyio.run_process(
            [sys.executable, "-c", _CHILD, json.dumps(spec)],
            cwd=team.base,
            env=env,
            check=False,
        )
    stderr = proc.stderr.decode()
    assert proc.returncode == 0, stderr
    return json.loads(proc.stdout.decode().splitlines()[-1]), stderr


def _step_names(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir() if p.name.startswith("step_"))


def _leftovers(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir() if p.name.startswith(".asyncsave-tmp"))


@pytest.mark.slow
async def test_a_second_member_of_the_group_saves_into_the_root_s21(
    team: _Team, anyio_backend: tuple[str, dict[str, Any]]
) -> None:
    """The issue's case: a root in a setgid, group-writable directory, both users
    under ``umask 002``. One of Alice's runs used ``umask 022``: its checkpoint is
    not group-writable, so Bob can retire it but not empty it; that leftover is
    logged, never blocks the rest, and goes when Alice next opens the root."""
    root = team.shared / "exp1"
    be = anyio_backend
    out, _ = await _as_user(team, team.alice, root, [("save", 1)], umask=0o002, backend=be)
    assert out == [["open"], ["save", 1]]
    out, _ = await _as_user(team, team.alice, root, [("save", 2)], umask=0o022, backend=be)
    assert out == [["open"], ["save", 2]]
    # Bob opens Alice's root, resumes, saves, updates his own step; KeepLast(2)
    # retires Alice's steps 1 and 2.
    ops = [("load", 0), ("save", 3), ("update", 3), ("save", 4)]
    out, log = await _as_user(team, team.bob, root, ops, umask=0o002, backend=be)
    assert out == [["open"], ["load", 2], ["save", 3], ["update", 3], ["save", 4]], log
    assert _step_names(root) == ["step_3", "step_4"]
    assert [n for n in _leftovers(root) if n.startswith(".asyncsave-tmp-retired-2-")]
    assert len(_leftovers(root)) == 1 and "retention failed to remove" in log
    # Alice again: resumes Bob's step, and her open removes her leftover.
    out, _ = await _as_user(team, team.alice, root, [("load", 0)], umask=0o002, backend=be)
    assert out == [["open"], ["load", 4]]
    assert not _leftovers(root)
    state = asyncsave.load(root / "step_3")
    assert state["trainer"]["step"] == -3
    assert torch.equal(state["model"]["w"], _state(3)["model"]["w"])
    for rel, (kind, mode, gid) in _modes(root).items():
        assert mode == _expected(kind, 0o002), (rel, oct(mode))
        assert gid == team.gid, rel
    assert {p.stat().st_uid for p in (root / "step_4").iterdir()} == {team.bob.uid}
    assert (root / ".asyncsave.lock").stat().st_uid == team.alice.uid


@pytest.mark.slow
async def test_under_umask_022_a_second_member_resumes_but_cannot_save(
    team: _Team, anyio_backend: tuple[str, dict[str, Any]]
) -> None:
    """Under ``umask 022`` the root Alice created is not group-writable: Bob opens
    it (the lock needs no write permission) and resumes from it, and a save fails
    with a SaveFailedError naming the refusal, never claiming a commit; nothing of
    Alice's changes."""
    root = team.shared / "exp3"
    be = anyio_backend
    out, _ = await _as_user(
        team, team.alice, root, [("save", 1), ("save", 2)], umask=0o022, backend=be
    )
    assert out == [["open"], ["save", 1], ["save", 2]]
    before = _modes(root)
    out, log = await _as_user(
        team, team.bob, root, [("load", 0), ("save", 3)], umask=0o022, backend=be
    )
    assert out[:2] == [["open"], ["load", 2]], log
    assert out[2][:2] == ["error", "SaveFailedError"], out
    assert "Permission denied" in out[2][2] and "was committed" not in out[2][2], out
    assert _modes(root) == before and _step_names(root) == ["step_1", "step_2"]
    assert asyncsave.latest(root).step == 2  # type: ignore[union-attr]


@pytest.mark.slow
async def test_the_lock_excludes_a_second_member_without_write_permission_on_it(
    team: _Team, anyio_backend: tuple[str, dict[str, Any]]
) -> None:
    """The lock file was created 0644 by another user (under umask 022, or by an
    asyncsave that made it 0644 whatever the umask) in a group-writable root:
    taking it needs only read permission, and it still excludes a second saver
    while held."""
    root = team.shared / "exp2"
    root.mkdir(mode=0o775)  # group-writable; setgid from the parent
    os.chmod(root, 0o2775)
    old = os.umask(0o022)
    try:
        async with asyncsave.Checkpointer(root) as ckpt:
            await (await ckpt.save(1, _state(1)))
            lock = root / ".asyncsave.lock"
            assert stat.S_IMODE(lock.stat().st_mode) == 0o644 and lock.stat().st_uid == 0
            out, _ = await _as_user(team, team.bob, root, [], umask=0o022, backend=anyio_backend)
            assert out[0][:2] == ["error", "RootInUseError"], out
    finally:
        os.umask(old)
    out, log = await _as_user(
        team, team.bob, root, [("load", 0), ("save", 2)], umask=0o022, backend=anyio_backend
    )
    assert out == [["open"], ["load", 1], ["save", 2]], log
    assert asyncsave.latest(root).step == 2  # type: ignore[union-attr]
    # A lock file the others cannot even read (made under umask 077): a typed
    # error that names it.
    os.chmod(root / ".asyncsave.lock", 0o600)
    out, _ = await _as_user(team, team.bob, root, [], umask=0o022, backend=anyio_backend)
    assert out[0][:2] == ["error", "CheckpointError"] and ".asyncsave.lock" in out[0][2], out
