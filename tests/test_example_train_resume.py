"""End-to-end check of examples/train_resume.py: a run SIGKILLed while a save is
being written resumes from the last committed step and reproduces the per-step
losses of an uninterrupted run bit for bit, on asyncio and on trio."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "examples" / "train_resume.py"
TRACKER = "latest_checkpointed_iteration.txt"
STEPS, SAVE_EVERY, CRASH_AT = 12, 3, 9

pytestmark = pytest.mark.slow


def run_example(run_dir: Path, *flags: str) -> subprocess.CompletedProcess[str]:
    cmd = [
        sys.executable, str(SCRIPT), "--tiny", "--run-dir", str(run_dir),
        "--steps", str(STEPS), "--save-every", str(SAVE_EVERY), *flags,
    ]  # fmt: skip
    return subprocess.run(cmd, capture_output=True, text=True, timeout=180, cwd=SCRIPT.parents[1])


def ok(proc: subprocess.CompletedProcess[str]) -> subprocess.CompletedProcess[str]:
    assert proc.returncode == 0, (
        f"exit {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    )
    return proc


def summary(run_dir: Path) -> dict[str, Any]:
    return json.loads((run_dir / "summary.json").read_text())


def losses(run_dir: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (run_dir / "losses.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An uninterrupted run of STEPS steps (asyncio)."""
    run_dir = tmp_path_factory.mktemp("reference")
    ok(run_example(run_dir))
    return run_dir


def test_uninterrupted_run(reference: Path) -> None:
    s = summary(reference)
    assert s["resumed_from"] is None
    assert s["steps_trained"] == STEPS
    assert s["checkpoints_committed"] == [3, 6, 9, 12]
    assert s["heartbeat"]["ticks"] > 0
    assert (reference / "checkpoints" / TRACKER).read_text().strip() == str(STEPS)
    rows = losses(reference)
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    assert all(float.fromhex(r["loss"]) > 0 for r in rows)


def test_sigkill_mid_save_then_resume_is_bit_exact(reference: Path, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    ckpts = run_dir / "checkpoints"

    crashed = run_example(run_dir, "--crash-at", str(CRASH_AT))
    assert crashed.returncode == -signal.SIGKILL, crashed.stderr
    assert "mid-write" in crashed.stderr, crashed.stderr  # killed before the commit
    assert (ckpts / TRACKER).read_text().strip() == "6"
    assert sorted(p.name for p in ckpts.glob("step_*")) == ["step_3", "step_6"]
    assert not (run_dir / "summary.json").exists()
    # The killed run had trained and logged through the crash step.
    assert [r["step"] for r in losses(run_dir)] == list(range(1, CRASH_AT + 1))

    ok(run_example(run_dir))
    s = summary(run_dir)
    assert s["resumed_from"] == 6
    assert s["steps_trained"] == STEPS - 6
    assert s["checkpoints_committed"] == [9, 12]
    assert not list(ckpts.glob(".asyncsave-tmp-*")), "the next open removes the torn save"
    assert (ckpts / TRACKER).read_text().strip() == str(STEPS)
    # Every step, the recomputed ones included, bit for bit (float.hex strings).
    assert losses(run_dir) == losses(reference)
    assert (run_dir / "losses.jsonl").read_bytes() == (reference / "losses.jsonl").read_bytes()

    # A finished run started again resumes at the end and trains nothing.
    ok(run_example(run_dir))
    s = summary(run_dir)
    assert (s["resumed_from"], s["steps_trained"], s["checkpoints_committed"]) == (STEPS, 0, [])
    assert losses(run_dir) == losses(reference)


def test_trio_backend_matches_asyncio(reference: Path, tmp_path: Path) -> None:
    ok(run_example(tmp_path, "--backend", "trio"))
    s = summary(tmp_path)
    assert s["backend"] == "trio"
    assert s["checkpoints_committed"] == [3, 6, 9, 12]
    assert losses(tmp_path) == losses(reference)
