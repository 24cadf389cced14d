"""Naming: final names of each layout preset, and the names a save gives what is
not (yet) a checkpoint (temporary, retired, moved aside), which no resolver of
the trainers asyncsave serves may mistake for one. The temporary names are read
off real saves held at a phase; the options need no disk."""

from __future__ import annotations

import re
import threading
from pathlib import Path

import anyio
import pytest
import torch

import asyncsave
from asyncsave.testing import (
    LAYOUT_NAMES,
    FaultyFileSystem,
    checkpoint_dir_name,
    checkpoint_step,
    is_temp_name,
    leftover_temp_names,
    pause,
    pause_at,
    thresholds,
    tracker_file_name,
)

pytestmark = pytest.mark.anyio

# Resolvers of the trainers asyncsave serves, as they match checkpoint directories.
RESOLVER_PATTERNS = [r"step_(\d+)", r"iter_(\d+)", r"global_step_(\d+)", r"checkpoint-(\d+)"]
WAIT_S = 30


def test_final_names_of_the_default_layout() -> None:
    assert checkpoint_dir_name("asyncsave", 40) == "step_40"
    assert checkpoint_step("asyncsave", "step_40") == 40
    assert checkpoint_step("asyncsave", "step_0") == 0
    for name in (
        "step_",
        "step_-1",
        "step_04",
        "step_4x",
        "xstep_4",
        ".asyncsave-tmp-4-abc",
        "step_1" + "0" * 30,
    ):
        assert checkpoint_step("asyncsave", name) is None, name
    assert tracker_file_name("asyncsave") == "latest_checkpointed_iteration.txt"


def assert_no_checkpoint_name(name: str) -> None:
    """``name`` is hidden, and no preset nor resolver takes it for a checkpoint."""
    assert name.startswith("."), name
    for pattern in RESOLVER_PATTERNS:
        assert re.search(pattern, name) is None, (pattern, name)
    for layout in LAYOUT_NAMES:
        assert checkpoint_step(layout, name) is None, (layout, name)
    assert not re.fullmatch(r"(global_)?step_\d+|iter_\d+", name)
    assert not Path(name).match("step_*") and not Path(name).match("global_step_*")


async def _names_while_held(root: Path, phase: str, step: int) -> list[str]:
    """The temporary names in ``root`` while a save of ``step`` is held at
    ``phase`` (a directory's with a trailing ``/``)."""
    with pause_at(phase) as stop:
        async with asyncsave.Checkpointer(
            root, filesystem=stop.filesystem, save_step_zero=True
        ) as ckpt:
            handle = await ckpt.save(step, {"w": torch.ones(4)})
            await anyio.to_thread.run_sync(stop.reached.wait, WAIT_S)
            names = [f"{n}/" if (root / n).is_dir() else n for n in leftover_temp_names(root)]
            stop.release()
            await handle
    return names


@pytest.mark.parametrize("step", [0, 7, 40, 2**40])
async def test_temp_names_match_no_resolver_pattern(tmp_path: Path, step: int) -> None:
    """The temporary directory of a save in flight, and the temporary tracker
    file of a tracker being replaced: asyncsave's temporary names, fresh for
    each save, that no resolver takes for a checkpoint."""
    (first,) = await _names_while_held(tmp_path / "a", "writing", step)
    (again,) = await _names_while_held(tmp_path / "b", "writing", step)
    tracker_temp = await _names_while_held(tmp_path / "c", "tracking", step)
    assert first != again  # a fresh name per save
    assert first.endswith("/") and again.endswith("/")  # directories
    assert [n for n in tracker_temp if "latest_checkpointed_iteration" in n], tracker_temp
    for name in (first.rstrip("/"), again.rstrip("/"), *tracker_temp):
        assert is_temp_name(name)
        assert_no_checkpoint_name(name)


async def test_data_file_names_are_plain_and_ordered(tmp_path: Path) -> None:
    """Sixteen files of one rank: ``data-r<rank, 5 digits>-<index, 3
    digits>.safetensors``, so that their names sort as (rank, index) do, in the
    manifest's order; none is a temporary name."""
    state = {f"t{i:02d}": torch.randn(1024) for i in range(16)}
    with thresholds(min_file_bytes=1):
        async with asyncsave.Checkpointer(tmp_path, writer_threads=16) as ckpt:
            info = await (await ckpt.save(1, state))
    names = sorted(p.name for p in info.path.iterdir() if p.name.startswith("data-"))
    assert len(names) == 16 and names[0] == "data-r00000-000.safetensors", names
    assert all(re.fullmatch(r"data-r\d{5}-\d{3}\.safetensors", n) for n in names), names
    assert [int(n[12:15]) for n in names] == list(range(16))
    assert not any(is_temp_name(n) for n in names)


@pytest.mark.parametrize(
    "field",
    [
        {"layout": "nope"},
        {"budget_bytes": 0},
        {"budget_bytes": True},
        {"writer_threads": 0},
        {"save_timeout_s": float("inf")},
        {"close_timeout_s": -1},
        {"poll_interval_s": "1"},
    ],
)
def test_bad_options_are_refused_naming_the_field(field: dict[str, object]) -> None:
    with pytest.raises(ValueError, match=next(iter(field))):
        asyncsave.CheckpointOptions(**field)  # type: ignore[arg-type]


def test_checkpointer_keyword_overrides_replace_fields() -> None:
    base = asyncsave.CheckpointOptions(writer_threads=3)
    ckpt = asyncsave.Checkpointer("/tmp/never-opened", base, save_timeout_s=5.0)
    assert ckpt.options.writer_threads == 3 and ckpt.options.save_timeout_s == 5.0


async def test_retired_and_aside_names_match_no_preset(tmp_path: Path) -> None:
    """A checkpoint retention is removing (renamed first, seen while its removal
    is held) and a damaged one moved aside at open: out of every resolver's way."""
    gate = threading.Event()
    fs = FaultyFileSystem("remove_tree", pause(gate))
    names: list[str] = []
    async with asyncsave.Checkpointer(
        tmp_path / "r", filesystem=fs, retention=asyncsave.KeepLast(1)
    ) as ckpt:
        await (await ckpt.save(1, {"w": torch.ones(4)}))
        handle = await ckpt.save(2, {"w": torch.ones(4)})
        await anyio.to_thread.run_sync(fs.fired.wait, WAIT_S)
        names += leftover_temp_names(tmp_path / "r")
        gate.set()
        await handle
    retired = [n for n in names if "retired" in n]
    assert retired, names
    damaged = tmp_path / "d" / "step_5"
    damaged.mkdir(parents=True)
    (damaged / "manifest.json").write_bytes(b"not json")
    async with asyncsave.Checkpointer(tmp_path / "d"):
        pass  # recovery moves it aside, every byte kept
    aside = [p.name for p in (tmp_path / "d").iterdir() if p.name != ".asyncsave.lock"]
    assert len(aside) == 1 and aside[0] != "step_5", aside
    assert (tmp_path / "d" / aside[0] / "manifest.json").read_bytes() == b"not json"
    for name in (*retired, aside[0]):
        assert_no_checkpoint_name(name)


def test_megatron_names_pad_to_seven_digits_and_parse_back() -> None:
    assert checkpoint_dir_name("megatron", 40) == "iter_0000040"
    assert checkpoint_dir_name("megatron", 123456789) == "iter_123456789"
    assert checkpoint_step("megatron", "iter_0000040") == 40
    assert checkpoint_step("megatron", "iter_123456789") == 123456789
    for bad in ("iter_40", "iter_01234567", "iter_-000001", "iter_000004a"):
        assert checkpoint_step("megatron", bad) is None
