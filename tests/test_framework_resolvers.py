"""The frameworks' own resume code, called for real on asyncsave's roots (issue 13,
item 2): verl's ``find_latest_ckpt_path`` (``verl.utils.checkpoint.checkpoint_manager``,
verl 0.9.1 installed with ``--no-deps`` from ``requirements-frameworks.txt``) lands
on asyncsave's last committed step at rest, while a later save is in flight, after
a crash before the commit, and after the next open recovered that crash.

``tests/test_layouts.py`` re-creates each preset's rule (Megatron-LM's, SkyRL's,
NeMo-RL's); the README says why those frameworks' own functions are not called
here. verl's module imports Ray, transformers and megatron-core (about 10-30 s), so
one child process imports it once and answers every query of this file; it runs
no Ray cluster and starts no thread of ours.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest
import torch
from faults import FaultyFS, kill, pause

import asyncsave

# The child: imports verl's module once, then answers one root per stdin line with
# find_latest_ckpt_path(root) (verl prints its own lines too: ours are tagged).
_CHILD = r"""
import json, sys, warnings
warnings.simplefilter("ignore")
from verl.utils.checkpoint.checkpoint_manager import find_latest_ckpt_path
print("READY", flush=True)
for line in sys.stdin:
    print("RESULT " + json.dumps(find_latest_ckpt_path(line.strip())), flush=True)
"""


class Verl:
    """verl's own ``find_latest_ckpt_path``, in a child process."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _CHILD],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            env={**os.environ, "RAY_DEDUP_LOGS": "0"},
        )
        self._read_until("READY")

    def _read_until(self, tag: str) -> str:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith(tag):
                return line[len(tag) :].strip()
        raise AssertionError(f"verl's child exited ({self.proc.wait()}) before {tag}")

    def find_latest_ckpt_path(self, root: Path) -> str | None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(f"{root}\n")
        self.proc.stdin.flush()
        result: str | None = json.loads(self._read_until("RESULT "))
        return result

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


@pytest.fixture(scope="module")
def verl() -> Iterator[Verl]:
    child = Verl()
    try:
        yield child
    finally:
        child.close()


def _state(step: int) -> dict[str, Any]:
    return {"w": torch.full((16,), float(step)), "step": step}


def _loads_as(path: str | None, step: int) -> None:
    assert path is not None
    state = asyncsave.load(path)
    assert state["step"] == step and torch.equal(state["w"], _state(step)["w"])


async def _save(root: Path, steps: list[int], fs: Any = None) -> None:
    async with asyncsave.Checkpointer(root, layout="verl", filesystem=fs) as ckpt:
        for step in steps:
            await (await ckpt.save(step, _state(step)))


@pytest.mark.slow
@pytest.mark.anyio
async def test_verl_finds_the_last_commit_at_rest_and_with_a_save_in_flight(
    tmp_path: Path, verl: Verl
) -> None:
    await _save(tmp_path, [1, 2])
    found = verl.find_latest_ckpt_path(tmp_path)
    assert found == str(tmp_path / "global_step_2")
    _loads_as(found, 2)

    gate = threading.Event()
    fs = FaultyFS("rename", pause(gate), where=lambda p: p.endswith("global_step_3"))
    async with asyncsave.Checkpointer(tmp_path, layout="verl", filesystem=fs) as ckpt:
        handle = await ckpt.save(3, _state(3))
        with anyio.fail_after(30):
            while not fs.fired.is_set():
                await anyio.sleep(0.01)
        # Step 3 is written and about to be renamed: verl still resumes step 2.
        found = await anyio.to_thread.run_sync(verl.find_latest_ckpt_path, tmp_path)
        assert found == str(tmp_path / "global_step_2")
        _loads_as(found, 2)
        gate.set()
        await handle
    found = verl.find_latest_ckpt_path(tmp_path)
    assert found == str(tmp_path / "global_step_3")
    _loads_as(found, 3)


def _crashing_saver(root: str) -> None:
    fs = FaultyFS("rename", kill(), where=lambda p: p.endswith("global_step_3"))
    anyio.run(_save, Path(root), [1, 2, 3], fs)


@pytest.mark.slow
def test_verl_finds_the_last_commit_after_a_crash_before_commit(tmp_path: Path, verl: Verl) -> None:
    child = mp.get_context("fork").Process(target=_crashing_saver, args=(str(tmp_path),))
    child.start()
    child.join(60)
    assert child.exitcode == -9  # SIGKILLed right before renaming step 3
    assert [p for p in tmp_path.iterdir() if p.name.startswith(".asyncsave-tmp-3-")]
    found = verl.find_latest_ckpt_path(tmp_path)
    assert found == str(tmp_path / "global_step_2")
    _loads_as(found, 2)
    # The next open removes the leftover; verl still lands on step 2, then on 3.
    anyio.run(_save, tmp_path, [3])
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".asyncsave-tmp")]
    found = verl.find_latest_ckpt_path(tmp_path)
    assert found == str(tmp_path / "global_step_3")
    _loads_as(found, 3)


@pytest.mark.slow
def test_verl_finds_nothing_in_a_fresh_root(tmp_path: Path, verl: Verl) -> None:
    assert verl.find_latest_ckpt_path(tmp_path) is None

    async def opened_only() -> None:
        async with asyncsave.Checkpointer(tmp_path, layout="verl"):
            pass

    anyio.run(opened_only)
    assert verl.find_latest_ckpt_path(tmp_path) is None
