"""The tracker: atomic, forward-only, even across abandoned writer threads."""

# Private imports: unit tests of the private tracker writer and parser.
from __future__ import annotations

import threading
from pathlib import Path

import pytest
from faults import FaultyFS, pause

from asyncsave import CorruptCheckpointError, LocalFileSystem
from asyncsave._track import TrackerWriter, parse_tracker, read_tracker


def test_forward_only_even_when_an_older_write_finishes_last(tmp_path: Path) -> None:
    """A write of step 5 stalls inside replace (its thread later abandoned by a
    timeout); a write of 10 is asked meanwhile. The tracker must end at 10."""
    gate = threading.Event()
    path = tmp_path / "latest_checkpointed_iteration.txt"
    writer = TrackerWriter(FaultyFS("replace", pause(gate)), path, None)
    t5 = threading.Thread(target=writer.advance, args=(5,))
    t5.start()
    t10 = threading.Thread(target=writer.advance, args=(10,))
    t10.start()
    t10.join(0.2)
    gate.set()
    t5.join(10)
    t10.join(10)
    assert path.read_text() == "10" and writer.highest == 10
    assert writer.advance(7) is False and path.read_text() == "10"


def test_advance_writes_atomically_and_leaves_no_temp_file(tmp_path: Path) -> None:
    path = tmp_path / "latest_checkpointed_iteration.txt"
    writer = TrackerWriter(LocalFileSystem(), path, 3)
    assert writer.advance(3) is False and not path.exists()
    assert writer.advance(4) is True
    assert path.read_text() == "4"
    assert sorted(p.name for p in tmp_path.iterdir()) == [path.name]


@pytest.mark.parametrize(("raw", "step"), [(b"40", 40), (b" 40\n", 40), (b"0", 0)])
def test_trackers_as_megatron_and_verl_write_them_parse(raw: bytes, step: int) -> None:
    assert parse_tracker(raw, Path("t")) == step


@pytest.mark.parametrize("raw", [b"", b"-1", b"1.0", b"x", b"9" * 20, b"1 2", "٣".encode()])
def test_garbage_trackers_are_typed_errors(raw: bytes) -> None:
    with pytest.raises(CorruptCheckpointError):
        parse_tracker(raw, Path("t"))


def test_a_missing_tracker_reads_as_none(tmp_path: Path) -> None:
    assert read_tracker(LocalFileSystem(), tmp_path / "nope") is None
