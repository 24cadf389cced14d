"""The root's commit protocol answers, for its storage, every question a caller
used to ask the storage itself.

Imports the private ``asyncsave._atomicity``: the protocol is the seam under test
(one class per kind of storage, chosen once from the root), and it has no public
name; the behaviour it carries is tested through the public API elsewhere
(test_objstore.py, test_adopt.py, test_update.py, test_power_loss.py).
"""

# Private imports: unit tests of the private commit strategies (rename, marker) and the
# writes under them.
from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import fsspec
import pytest

import asyncsave
from asyncsave._atomicity import MarkerCommit, RenameCommit, strategy_for
from asyncsave._fs import LocalFileSystem
from asyncsave._fsspec import open_root
from asyncsave._paths import COMMIT_MARKER_NAME, MANIFEST_NAME
from asyncsave._write import write_bytes


@pytest.fixture(params=["local", "memory"])
def root(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[tuple[LocalFileSystem, Path]]:
    if request.param == "local":
        yield LocalFileSystem(), tmp_path
        return
    name = f"atomicity-{uuid.uuid4().hex}"
    try:
        yield open_root(f"memory://{name}")
    finally:
        mem = fsspec.filesystem("memory")
        if mem.exists(f"/{name}"):
            mem.rm(f"/{name}", recursive=True)


def test_the_protocol_is_chosen_from_the_storage(root: tuple[LocalFileSystem, Path]) -> None:
    fs, _ = root
    strategy = strategy_for(fs)
    local = isinstance(strategy, RenameCommit)
    assert local == (not isinstance(strategy, MarkerCommit))
    # What a caller may do follows from the protocol, in one place.
    assert strategy.can_overwrite == strategy.can_move_files == local
    assert strategy.writes_in_place == strategy.needs_tracker == (not local)
    assert strategy.protocol_files == (() if local else (COMMIT_MARKER_NAME,))


@pytest.mark.parametrize("step", [0, 7, 2**40])
def test_a_published_save_is_committed_and_nothing_else_is(
    root: tuple[LocalFileSystem, Path], step: int
) -> None:
    fs, base = root
    strategy = strategy_for(fs)
    final = base / f"step_{step}"
    tmp = strategy.begin(fs, base, step, final)
    assert strategy.same_save(tmp.name, step, final)
    assert not strategy.same_save(tmp.name, step + 1, base / f"step_{step + 1}")
    write_bytes(fs, tmp / "data.bin", b"x" * 8)
    assert not strategy.committed(fs, final)
    strategy.publish(fs, tmp, final, b'{"m": 1}', overwrite=False)
    assert strategy.committed(fs, final) and strategy.passed_commit(fs, final)
    assert fs.read_bytes(final / MANIFEST_NAME) == b'{"m": 1}'
    assert sorted(fs.listdir(base)) == [final.name]  # no temporary name left


def test_a_final_name_without_its_commit_point_is_adopted_by_the_protocol(
    root: tuple[LocalFileSystem, Path],
) -> None:
    """Under a final name without a marker: committed on a POSIX root (the name
    is the commit), uncommitted on an object store until adopted."""
    fs, base = root
    strategy = strategy_for(fs)
    final = base / "step_3"
    fs.makedirs(final)
    write_bytes(fs, final / MANIFEST_NAME, b"{}")
    assert strategy.passed_commit(fs, final) == strategy.can_move_files
    strategy.mark_adopted(fs, final)
    assert strategy.passed_commit(fs, final)
    strategy.mark_adopted(fs, final)  # idempotent
    assert fs.exists(final / COMMIT_MARKER_NAME) == strategy.writes_in_place


def test_an_overwrite_the_protocol_cannot_make_is_refused_naming_the_step(
    root: tuple[LocalFileSystem, Path],
) -> None:
    fs, base = root
    strategy = strategy_for(fs)
    final = base / "step_5"
    if strategy.can_overwrite:
        strategy.check_overwrite(fs, final, 5)
        return
    with pytest.raises(asyncsave.CheckpointError, match="cannot overwrite") as info:
        strategy.check_overwrite(fs, final, 5)
    assert info.value.step == 5 and str(info.value.path) == str(final)
    with pytest.raises(asyncsave.CheckpointError):
        strategy.publish(fs, final, final, b"{}", overwrite=True)
    assert not fs.exists(final / MANIFEST_NAME)  # nothing written before the refusal


@pytest.mark.parametrize("data", [b"0", b"17", b"9223372036854775807"])
def test_a_small_file_is_replaced_whole(root: tuple[LocalFileSystem, Path], data: bytes) -> None:
    fs, base = root
    fs.makedirs(base)
    strategy = strategy_for(fs)
    path = base / "latest_checkpointed_iteration.txt"
    strategy.replace_file(fs, path, b"old")
    strategy.replace_file(fs, path, data)
    assert fs.read_bytes(path) == data
    assert fs.listdir(base) == [path.name]  # no temporary file left
