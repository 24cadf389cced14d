"""Layout presets: each framework's own resume rule, re-created here as its code
documents it, lands on asyncsave's last committed step: at rest, while a later save
is in flight, and after a crash before the commit."""

from __future__ import annotations

import json
import multiprocessing as mp
import re
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio
import pytest
import torch
from faults import FaultyFS, kill, pause

import asyncsave

pytestmark = pytest.mark.anyio


def verl_resolve(root: Path) -> Path | None:
    """verl's find_latest_ckpt_path: read the tracker, int(), join
    ``global_step_{}``, the directory must exist."""
    tracker = root / "latest_checkpointed_iteration.txt"
    if not tracker.exists():
        return None
    step = int(tracker.read_text().strip())
    path = root / f"global_step_{step}"
    return path if path.exists() else None


def megatron_resolve(root: Path) -> Path | None:
    """Megatron-LM's read_metadata + get_checkpoint_name: tracker int, ``iter_{:07d}``."""
    tracker = root / "latest_checkpointed_iteration.txt"
    if not tracker.exists():
        return None
    text = tracker.read_text().strip()
    assert text != "release"
    path = root / f"iter_{int(text):07d}"
    return path if path.is_dir() else None


def skyrl_resolve(root: Path) -> Path | None:
    """SkyRL: ``latest_ckpt_global_step.txt`` then ``global_step_{N}``."""
    tracker = root / "latest_ckpt_global_step.txt"
    if not tracker.exists():
        return None
    path = root / f"global_step_{int(tracker.read_text().strip())}"
    return path if path.exists() else None


def nemo_rl_resolve(root: Path) -> Path | None:
    """NeMo-RL's CheckpointManager: the highest ``step_*`` directory, whose
    ``training_info.json`` it reads."""
    found = [
        (int(m.group(1)), p)
        for p in root.glob("step_*")
        if (m := re.fullmatch(r"step_(\d+)", p.name)) and p.is_dir()
    ]
    if not found:
        return None
    step, path = max(found)
    info = json.loads((path / "training_info.json").read_text())
    assert info["step"] == step
    return path


def asyncsave_resolve(root: Path) -> Path | None:
    info = asyncsave.latest(root)
    return None if info is None else info.path


RESOLVERS: dict[str, tuple[Callable[[Path], Path | None], Callable[[int], str]]] = {
    "asyncsave": (asyncsave_resolve, lambda n: f"step_{n}"),
    "verl": (verl_resolve, lambda n: f"global_step_{n}"),
    "megatron": (megatron_resolve, lambda n: f"iter_{n:07d}"),
    "skyrl": (skyrl_resolve, lambda n: f"global_step_{n}"),
    "nemo-rl": (nemo_rl_resolve, lambda n: f"step_{n}"),
}
PRESETS = sorted(RESOLVERS)


def _state(step: int) -> dict[str, Any]:
    return {"w": torch.full((32,), float(step)), "step": step}


def _assert_resolves(root: Path, layout: str, step: int) -> None:
    resolve, name = RESOLVERS[layout]
    path = resolve(root)
    assert path == root / name(step), (layout, path)
    state = asyncsave.load(path)
    assert state["step"] == step and torch.equal(state["w"], _state(step)["w"])
    info = asyncsave.latest(root, layout=layout)
    assert info is not None and info.step == step


@pytest.mark.parametrize("layout", PRESETS)
async def test_preset_names_and_resolve_rule(tmp_path: Path, layout: str) -> None:
    async with asyncsave.Checkpointer(tmp_path, layout=layout) as ckpt:
        for step in (1, 2, 12345678):
            await (await ckpt.save(step, _state(step), training_info={"consumed": step * 8}))
    _assert_resolves(tmp_path, layout, 12345678)
    names = sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith("."))
    _, name = RESOLVERS[layout]
    expected_dirs = [name(s) for s in (1, 2, 12345678)]
    assert set(expected_dirs) <= set(names)
    if layout == "nemo-rl":
        assert names == sorted(expected_dirs)  # no tracker at all
        info = json.loads((tmp_path / "step_2" / "training_info.json").read_text())
        assert info == {"consumed": 16, "step": 2}


@pytest.mark.parametrize("layout", PRESETS)
async def test_resolve_rule_ignores_a_save_in_flight(tmp_path: Path, layout: str) -> None:
    gate = threading.Event()
    fs = FaultyFS("rename", pause(gate), where=lambda p: p.endswith(RESOLVERS[layout][1](3)))
    async with asyncsave.Checkpointer(tmp_path, layout=layout, filesystem=fs) as ckpt:
        await (await ckpt.save(1, _state(1)))
        await (await ckpt.save(2, _state(2)))
        handle = await ckpt.save(3, _state(3))
        with anyio.fail_after(30):
            while not fs.fired.is_set():
                await anyio.sleep(0.01)
        # step 3 is fully written and about to be renamed: not visible yet
        _assert_resolves(tmp_path, layout, 2)
        gate.set()
        await handle
    _assert_resolves(tmp_path, layout, 3)


def _crashing_saver(root: str, layout: str) -> None:
    fs = FaultyFS("rename", kill(), where=lambda p: p.endswith(RESOLVERS[layout][1](3)))

    async def main() -> None:
        async with asyncsave.Checkpointer(root, layout=layout, filesystem=fs) as ckpt:
            for step in (1, 2, 3):
                await (await ckpt.save(step, _state(step)))

    anyio.run(main)


@pytest.mark.parametrize("layout", PRESETS)
def test_resolve_rule_after_a_crash_before_commit(tmp_path: Path, layout: str) -> None:
    child = mp.get_context("fork").Process(target=_crashing_saver, args=(str(tmp_path), layout))
    child.start()
    child.join(60)
    assert child.exitcode == -9  # SIGKILLed right before renaming step 3
    assert [p for p in tmp_path.iterdir() if p.name.startswith(".asyncsave-tmp-3-")]
    _assert_resolves(tmp_path, layout, 2)

    async def reopen() -> None:
        async with asyncsave.Checkpointer(tmp_path, layout=layout) as ckpt:
            restored = await ckpt.load_latest()
            assert restored is not None and restored.info.step == 2

    anyio.run(reopen)
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".asyncsave-tmp")]
    _assert_resolves(tmp_path, layout, 2)


async def test_a_renamed_preset_directory_does_not_load_as_another_step(tmp_path: Path) -> None:
    async with asyncsave.Checkpointer(tmp_path, layout="megatron") as ckpt:
        await (await ckpt.save(4, _state(4)))
    (tmp_path / "iter_0000004").rename(tmp_path / "iter_0000005")
    with pytest.raises(asyncsave.CorruptCheckpointError):
        asyncsave.load(tmp_path / "iter_0000005")
