"""Symlinks under a root (S22; facebookresearch/PyTorch-BigGraph PR #24,
bit-team/backintime #1217): retention, recovery at open, overwrite and update()
never follow a symlink to delete. A retired symlink is unlinked and its target left
alone; a leftover that cannot be removed is logged and retried, and never blocks the
others. Loading through a symlinked checkpoint works."""

from __future__ import annotations

import errno
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import anyio
import fsspec
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import asyncsave
from asyncsave import FsspecFileSystem, LocalFileSystem

pytestmark = pytest.mark.anyio


def _state(step: int) -> dict[str, Any]:
    return {"w": torch.full((64,), float(step)), "trainer": {"step": step}}


def _steps(root: Path) -> list[int]:
    return sorted(int(p.name.split("_")[-1]) for p in root.iterdir() if p.name.startswith("step_"))


def _leftovers(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir() if p.name.startswith(".asyncsave-tmp"))


def _snapshot(path: Path) -> dict[str, Any]:
    """Everything under ``path`` (links as links, never followed), to compare."""
    out: dict[str, Any] = {}
    for dirpath, dirnames, filenames in os.walk(path):
        for name in dirnames + filenames:
            p = Path(dirpath) / name
            rel = str(p.relative_to(path))
            if p.is_symlink():
                out[rel] = ("link", os.readlink(p))
            elif p.is_dir():
                out[rel] = ("dir",)
            else:
                out[rel] = ("file", p.read_bytes())
    return out


async def _seed(root: Path, *steps: int) -> None:
    """Another run's checkpoints (the run symlinked from)."""
    async with asyncsave.Checkpointer(root) as ckpt:
        for step in steps:
            await (await ckpt.save(step, _state(step)))


async def test_a_symlinked_step_is_retired_by_unlinking_it_s22(tmp_path: Path) -> None:
    seed, root = tmp_path / "seed", tmp_path / "run"
    await _seed(seed, 5)
    before = _snapshot(seed)
    root.mkdir()
    (root / "step_5").symlink_to(seed / "step_5", target_is_directory=True)
    assert asyncsave.latest(root, fallback=True).step == 5  # type: ignore[union-attr]
    async with asyncsave.Checkpointer(root, retention=asyncsave.KeepLast(2)) as ckpt:
        restored = await ckpt.load_latest()
        assert restored is not None and restored.info.step == 5  # loads through the link
        assert torch.equal(restored.state["w"], _state(5)["w"])
        for step in (6, 7, 8, 9):
            await (await ckpt.save(step, _state(step)))
        assert _steps(root) == [8, 9]  # every pass deleted again after the link
    assert not _leftovers(root)
    assert _snapshot(seed) == before  # the other run's checkpoint is whole
    asyncsave.verify(seed / "step_5")
    async with asyncsave.Checkpointer(root, retention=asyncsave.KeepLast(2)) as ckpt:
        restored = await ckpt.load_latest()  # the next open is clean
        assert restored is not None and restored.info.step == 9


async def test_retired_links_to_files_and_dangling_links_at_open_are_unlinked(
    tmp_path: Path,
) -> None:
    """A symlink under a temporary or retired name (a leftover) is unlinked at open,
    whatever it points to; the target is left alone."""
    outside = tmp_path / "outside"
    (outside / "dir").mkdir(parents=True)
    (outside / "dir" / "keep.bin").write_bytes(b"x" * 100)
    (outside / "file.bin").write_bytes(b"y" * 10)
    before = _snapshot(outside)
    root = tmp_path / "run"
    await _seed(root, 1)
    (root / ".asyncsave-tmp-retired-3-0123456789ab").symlink_to(outside / "dir")
    (root / ".asyncsave-tmp-7-0123456789ab").symlink_to(outside / "dir")
    (root / ".asyncsave-tmp-8-0123456789ab").symlink_to(outside / "file.bin")
    (root / ".asyncsave-tmp-9-0123456789ab").symlink_to(tmp_path / "nowhere")
    async with asyncsave.Checkpointer(root, retention=asyncsave.KeepLast(1)) as ckpt:
        assert not _leftovers(root)
        await (await ckpt.save(2, _state(2)))
    assert _steps(root) == [2]
    assert _snapshot(outside) == before


async def test_links_under_final_names_that_are_not_checkpoints_are_moved_aside(
    tmp_path: Path,
) -> None:
    """A dangling link, a link to a file, a plain file and a link to a directory
    that holds no checkpoint under final names: moved aside at open (the links
    themselves, never their targets), so those steps can be saved."""
    outside = tmp_path / "outside"
    (outside / "notes").mkdir(parents=True)
    (outside / "notes" / "a.txt").write_text("not a checkpoint")
    (outside / "file.bin").write_bytes(b"z" * 10)
    before = _snapshot(outside)
    root = tmp_path / "run"
    root.mkdir()
    (root / "step_1").symlink_to(tmp_path / "nowhere")
    (root / "step_2").symlink_to(outside / "file.bin")
    (root / "step_3").write_bytes(b"a stray file")
    (root / "step_4").symlink_to(outside / "notes")
    async with asyncsave.Checkpointer(root, retention=asyncsave.KeepLast(2)) as ckpt:
        assert _steps(root) == []
        for step in (1, 2, 3, 4):
            await (await ckpt.save(step, _state(step)))
    assert _steps(root) == [3, 4]
    for step in (3, 4):
        assert asyncsave.load(root / f"step_{step}")["trainer"]["step"] == step
    aside = {p.name: p for p in root.iterdir() if p.name.startswith(".asyncsave-incomplete-")}
    links = {os.readlink(p) for p in aside.values() if p.is_symlink()}
    assert links == {str(tmp_path / "nowhere"), str(outside / "file.bin"), str(outside / "notes")}
    assert len(aside) == 4  # the stray file too, kept
    assert _snapshot(outside) == before


async def test_a_symlink_inside_a_checkpoint_is_never_followed(tmp_path: Path) -> None:
    """Deleting (retention) or replacing (overwrite) a checkpoint that holds a
    symlink to something outside removes the link, not what it points to."""
    outside = tmp_path / "outside"
    (outside / "data").mkdir(parents=True)
    (outside / "data" / "big.bin").write_bytes(b"q" * 1000)
    (outside / "one.bin").write_bytes(b"r" * 10)
    before = _snapshot(outside)
    root = tmp_path / "run"
    await _seed(root, 1, 2)
    for step in (1, 2):
        (root / f"step_{step}" / "extra-dir").symlink_to(outside / "data")
        (root / f"step_{step}" / "extra-file").symlink_to(outside / "one.bin")
    async with asyncsave.Checkpointer(root, retention=asyncsave.KeepLast(1)) as ckpt:
        await (await ckpt.save(2, _state(20), overwrite=True))
        await (await ckpt.save(3, _state(3)))
    assert _steps(root) == [3]
    assert not _leftovers(root)
    assert _snapshot(outside) == before


async def test_overwrite_of_a_symlinked_step_replaces_the_link_not_the_target(
    tmp_path: Path,
) -> None:
    seed, root = tmp_path / "seed", tmp_path / "run"
    await _seed(seed, 5)
    before = _snapshot(seed)
    root.mkdir()
    (root / "step_5").symlink_to(seed / "step_5")
    async with asyncsave.Checkpointer(root) as ckpt:
        info = await (await ckpt.save(5, _state(50), overwrite=True))
        assert info.step == 5
        await (await ckpt.save(6, _state(6)))  # the checkpointer is still usable
    assert not (root / "step_5").is_symlink() and (root / "step_5").is_dir()
    assert asyncsave.load(root / "step_5")["trainer"]["step"] == 50
    assert not _leftovers(root)
    assert _snapshot(seed) == before


async def test_update_of_a_symlinked_step_is_refused_and_changes_nothing(tmp_path: Path) -> None:
    """update() rewrites only a checkpoint this run wrote in place: a final name
    that is (or has become) a symlink is refused with ProtectedCheckpointError, the
    link and its target unchanged, and the checkpointer stays usable."""
    seed, root = tmp_path / "seed", tmp_path / "run"
    await _seed(seed, 4, 5)
    root.mkdir()
    (root / "step_4").symlink_to(seed / "step_4")
    async with asyncsave.Checkpointer(root) as ckpt:
        with pytest.raises(asyncsave.ProtectedCheckpointError):
            await ckpt.update(4, "trainer", {"step": -1})  # another run's checkpoint
        await (await ckpt.save(5, _state(5)))
        # The run's own step 5 is replaced by a link to a copy elsewhere (a user
        # deduplicating checkpoints by hand).
        shutil.rmtree(root / "step_5")
        (root / "step_5").symlink_to(seed / "step_5")
        before = _snapshot(seed)
        with pytest.raises(asyncsave.ProtectedCheckpointError, match="symlink") as info:
            await ckpt.update(5, "trainer", {"step": -1})
        assert info.value.step == 5 and info.value.path == str(root / "step_5")
        assert (root / "step_5").is_symlink()
        assert _snapshot(seed) == before
        await (await ckpt.save(6, _state(6)))  # not a failure of the checkpointer
    assert asyncsave.load(root / "step_5")["trainer"]["step"] == 5
    assert not _leftovers(root)


class _StuckFS(LocalFileSystem):
    """A leftover that cannot be removed (another user's directory, an immutable
    file): every removal of a path holding ``stuck`` fails with EACCES."""

    def __init__(self, stuck: str) -> None:
        self.stuck = stuck
        self.tries = 0

    def remove_tree(self, path: Path) -> None:
        if self.stuck in path.name:
            self.tries += 1
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(path))
        super().remove_tree(path)


async def test_a_leftover_that_cannot_be_removed_never_blocks_the_others(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    fs = _StuckFS("retired-1-")
    rule = asyncsave.KeepLast(1)
    with caplog.at_level(logging.WARNING, logger="asyncsave"):
        async with asyncsave.Checkpointer(tmp_path, filesystem=fs, retention=rule) as ckpt:
            for step in (1, 2, 3, 4):
                await (await ckpt.save(step, _state(step)))
            assert _steps(tmp_path) == [4]  # 2 and 3 went although 1's leftover stays
            assert [n for n in _leftovers(tmp_path) if "retired-1-" in n]
            assert fs.tries >= 3  # retried by every later pass
        # The next open does not fail on it either; it logs it and goes on.
        async with asyncsave.Checkpointer(tmp_path, filesystem=fs, retention=rule) as ckpt:
            restored = await ckpt.load_latest()
            assert restored is not None and restored.info.step == 4
    assert "retired-1-" in caplog.text
    async with asyncsave.Checkpointer(tmp_path):  # once removable, it is removed
        pass
    assert not _leftovers(tmp_path)
    assert _steps(tmp_path) == [4]


async def test_one_link_that_cannot_be_unlinked_leaves_the_other_steps_retired(
    tmp_path: Path,
) -> None:
    """Each retirement is independent: a rename that fails (here for step 1) leaves
    that step under its final name and the pass goes on to the next."""

    class _NoRename(LocalFileSystem):
        def rename(self, src: Path, dst: Path) -> None:
            if src.name == "step_1":
                raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(src))
            super().rename(src, dst)

    seed = tmp_path / "seed"
    await _seed(seed, 1, 2)
    root = tmp_path / "run"
    root.mkdir()
    for step in (1, 2):
        (root / f"step_{step}").symlink_to(seed / f"step_{step}")
    async with asyncsave.Checkpointer(
        root, filesystem=_NoRename(), retention=asyncsave.KeepLast(1)
    ) as ckpt:
        await (await ckpt.save(3, _state(3)))
    assert _steps(root) == [1, 3]  # 2 retired though 1 could not be
    assert not _leftovers(root)
    assert sorted(p.name for p in seed.iterdir() if p.name.startswith("step_")) == [
        "step_1",
        "step_2",
    ]


async def test_a_symlinked_step_on_an_fsspec_root_is_unlinked_marker_and_all_kept(
    tmp_path: Path,
) -> None:
    """The marker protocol deletes a checkpoint's commit marker first: through a
    symlink that would uncommit the other run's checkpoint. Object stores have no
    symlinks; fsspec's local file system does, and is treated like the local layer."""
    layer = FsspecFileSystem(fsspec.filesystem("file", auto_mkdir=True))
    seed, root = tmp_path / "seed", tmp_path / "run"
    async with asyncsave.Checkpointer(seed, filesystem=layer) as ckpt:
        await (await ckpt.save(5, _state(5)))
    before = _snapshot(seed)
    assert "step_5/commit_success.txt" in before
    root.mkdir()
    (root / "step_5").symlink_to(seed / "step_5")
    async with asyncsave.Checkpointer(
        root, filesystem=layer, retention=asyncsave.KeepLast(1)
    ) as ckpt:
        for step in (6, 7):
            await (await ckpt.save(step, _state(step)))
    assert _steps(root) == [7]
    assert _snapshot(seed) == before
    assert asyncsave.load(seed / "step_5", filesystem=layer)["trainer"]["step"] == 5


# -- any mix of entries under a root -------------------------------------------------

_FINAL_KINDS = ("absent", "ours", "link", "link_file", "dangling", "file", "link_plain_dir")
_TEMP_KINDS = ("link_dir", "link_file", "dangling", "dir")


def _build(root: Path, seed: Path, outside: Path, finals: list[str], temps: list[str]) -> None:
    root.mkdir()
    for step, kind in enumerate(finals, start=1):
        final = root / f"step_{step}"
        if kind == "ours":
            shutil.copytree(seed / f"step_{step}", final)
        elif kind == "link":
            final.symlink_to(seed / f"step_{step}")
        elif kind == "link_file":
            final.symlink_to(outside / "file.bin")
        elif kind == "dangling":
            final.symlink_to(outside / "nowhere")
        elif kind == "file":
            final.write_bytes(b"stray")
        elif kind == "link_plain_dir":
            final.symlink_to(outside / "dir")
    for i, kind in enumerate(temps):
        temp = root / f".asyncsave-tmp-{'retired-' if i % 2 else ''}{i}-0123456789ab"
        if kind == "link_dir":
            temp.symlink_to(outside / "dir")
        elif kind == "link_file":
            temp.symlink_to(outside / "file.bin")
        elif kind == "dangling":
            temp.symlink_to(outside / "nowhere")
        else:
            temp.mkdir()
            (temp / "part.bin").write_bytes(b"partial")


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_any_mix_of_links_and_leftovers_is_handled_without_following_one(
    tmp_path: Path, backend: str
) -> None:
    """Hypothesis over what a root may hold: real checkpoints, links to another
    run's, links to files and directories, dangling links, stray files, temporary
    names of every kind. Opening, saving with retention and reopening never raise,
    never touch anything outside the root, and leave only loadable checkpoints under
    final names and no temporary names."""
    n = len(_FINAL_KINDS)
    seed, outside = tmp_path / "seed", tmp_path / "outside"
    anyio.run(_seed, seed, *range(1, n + 1), backend=backend)
    (outside / "dir").mkdir(parents=True)
    (outside / "dir" / "a.bin").write_bytes(b"a" * 10)
    (outside / "file.bin").write_bytes(b"f" * 10)
    before = (_snapshot(seed), _snapshot(outside))

    @settings(max_examples=25, deadline=None)
    @given(
        finals=st.lists(st.sampled_from(_FINAL_KINDS), min_size=1, max_size=n),
        temps=st.lists(st.sampled_from(_TEMP_KINDS), max_size=4),
        keep=st.integers(1, 3),
    )
    def check(finals: list[str], temps: list[str], keep: int) -> None:
        with tempfile.TemporaryDirectory(dir=tmp_path) as scratch:
            root = Path(scratch) / "run"
            _build(root, seed, outside, finals, temps)
            new = n + 1

            async def run() -> None:
                rule = asyncsave.KeepLast(keep)
                async with asyncsave.Checkpointer(root, retention=rule) as ckpt:
                    await (await ckpt.save(new, _state(new)))
                async with asyncsave.Checkpointer(root, retention=rule):
                    pass

            anyio.run(run, backend=backend)
            committed = [s for s, k in enumerate(finals, start=1) if k in ("ours", "link")]
            assert _steps(root) == sorted([*committed, new])[-keep:]
            for step in _steps(root):
                assert asyncsave.load(root / f"step_{step}")["trainer"]["step"] == step
            assert not _leftovers(root)
            assert (_snapshot(seed), _snapshot(outside)) == before

    check()
