"""S7 and S16 end to end with examples/async_rl_pump.py: a real SIGTERM (and a
SIGKILL) to a subprocess mid-run; after resume no sample id is lost or trained
twice, training continues from the right step, and no checkpoint is named step 0
or past the last trained step."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

import asyncsave

SCRIPT = Path(__file__).resolve().parents[1] / "examples" / "async_rl_pump.py"
BATCH = 4

pytestmark = pytest.mark.slow


def _cmd(root: Path, steps: int, *extra: str) -> list[str]:
    return [
        sys.executable, str(SCRIPT), "--root", str(root), "--steps", str(steps),
        "--save-every", "5", "--batch", str(BATCH), "--keep", "3", *extra,
    ]  # fmt: skip


def _trained_steps(root: Path) -> int:
    log = root / "trained.jsonl"
    if not log.exists():
        return 0
    return sum(1 for line in log.read_text().splitlines() if '"step"' in line)


def _effective_history(root: Path) -> dict[int, list[int]]:
    """Step -> sample ids, where a resumed run's steps replace the steps the
    interrupted run trained after its last checkpoint."""
    history: dict[int, list[int]] = {}
    for line in (root / "trained.jsonl").read_text().splitlines():
        rec = json.loads(line)
        if "resume" in rec:
            start = rec["resume"] or 0
            history = {s: ids for s, ids in history.items() if s <= start}
        else:
            history[rec["step"]] = rec["ids"]
    return history


def _checkpoint_steps(root: Path) -> list[int]:
    return sorted(int(p.name[5:]) for p in root.iterdir() if p.name.startswith("step_"))


def _interrupt(root: Path, sig: int, backend: str) -> dict[str, Any] | None:
    proc = subprocess.Popen(
        _cmd(root, 10_000, "--step-sleep", "0.01", "--backend", backend),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 120
        while _trained_steps(root) < 23:
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline
            time.sleep(0.01)
        proc.send_signal(sig)
        out, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    if sig == signal.SIGKILL:
        assert proc.returncode == -signal.SIGKILL
        return None
    assert proc.returncode == 0, err
    assert "stopped by SIGTERM" in out
    return json.loads((root / "summary.json").read_text())


def _check_resume(root: Path, interrupted_at: int, expect_resume: int) -> None:
    total = interrupted_at + 12
    proc = subprocess.run(_cmd(root, total), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    summary = json.loads((root / "summary.json").read_text())
    assert summary["resumed_from"] == expect_resume
    assert summary["finished"] and summary["last_step"] == total
    history = _effective_history(root)
    assert sorted(history) == list(range(1, total + 1))  # every step once, in order
    ids = [i for step in sorted(history) for i in history[step]]
    assert ids == list(range(total * BATCH))  # no sample lost, none trained twice
    assert asyncsave.latest(root).step == total  # type: ignore[union-attr]


def test_sigterm_saves_at_the_step_boundary_and_resume_loses_nothing(tmp_path: Path) -> None:
    root = tmp_path / "rl"
    summary = _interrupt(root, signal.SIGTERM, "asyncio")
    assert summary is not None and summary["stopped_by_signal"]
    last = summary["last_step"]
    assert last >= 23 and summary["saves"][-1] == last  # saved the last trained step
    steps = _checkpoint_steps(root)
    assert steps and steps[-1] == last and 0 not in steps and max(steps) <= last
    assert asyncsave.latest(root).step == last  # type: ignore[union-attr]
    _check_resume(root, last, expect_resume=last)


def test_sigkill_resumes_from_the_last_committed_step_without_loss(tmp_path: Path) -> None:
    root = tmp_path / "rl"
    _interrupt(root, signal.SIGKILL, "trio")
    trained = _trained_steps(root)
    resumed = asyncsave.latest(root)
    assert resumed is not None and 0 < resumed.step <= trained
    assert 0 not in _checkpoint_steps(root) and max(_checkpoint_steps(root)) <= trained
    _check_resume(root, trained, expect_resume=resumed.step)
