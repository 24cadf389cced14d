"""bench/memory_tier.py's own logic: the failure-cost model and a tiny run of the
whole script (its child trainer, SIGKILLed after save() returned, included)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
import memory_tier

BENCH = Path(memory_tier.__file__).parent

pytestmark = pytest.mark.slow


@pytest.fixture
def shm() -> Iterator[Path]:
    base = "/dev/shm" if os.path.isdir("/dev/shm") else None
    d = Path(tempfile.mkdtemp(prefix="asyncsave-test-bench-", dir=base))
    yield d
    shutil.rmtree(d, ignore_errors=True)


def test_the_model_of_training_lost_per_failure() -> None:
    m = {
        "B_plain": 0.5, "D_plain": 20.0, "B_local": 0.5, "D_local": 2.0,
        "B_mem": 0.5, "C_mem": 1.5, "R_disk": 30.0, "R_local": 3.0, "R_mem": 2.0,
    }  # fmt: skip
    rows = {r["strategy"]: r for r in memory_tier.model(m, 3600.0, 1.0, 100)}
    fixed = rows["persistent only, every 100 steps"]
    # 100 steps of 1 s: half the interval + the save's 20 s to durable, 36 saves of 0.5 s.
    assert fixed["save_every_steps"] == 100
    assert fixed["total_s"] == pytest.approx(50 + 20 + 30 + 36 * 0.5)
    every = rows["memory tier, every step, persist every 100"]
    # The memory tier's saves cannot come faster than the saver commits them (1.5 s).
    assert every["save_every_steps"] == 2
    assert every["recompute_s"] == pytest.approx(1 + 0.5)  # safe once save() returned
    assert every["blocking_s"] == pytest.approx(1800 * 0.5)
    best = rows["memory tier, best interval, persist every 100"]
    # Young's interval sqrt(2 * 3600 * 0.5) = 60 s.
    assert best["save_every_steps"] == 60
    assert best["total_s"] == pytest.approx(30 + 0.5 + 2 + 30)
    assert rows["persistent only, best interval"]["save_every_steps"] == 60


def test_a_tiny_run_writes_every_table(tmp_path: Path, shm: Path) -> None:
    out = tmp_path / "memory_tier.md"
    cmd = [
        sys.executable, str(BENCH / "memory_tier.py"),
        "--d-model", "32", "--layers", "1", "--vocab", "64", "--ctx", "16",
        "--small-count", "20", "--small-numel", "16", "--repeats", "2", "--restart-repeats", "2",
        "--dir", str(tmp_path), "--shm", str(shm), "--out", str(out),
    ]  # fmt: skip
    subprocess.run(cmd, check=True, timeout=600)
    text = out.read_text()
    for heading in (
        "## 1. Trainer blocking per save",
        "## 2. Restart to restored",
        "## 3. Training lost",
    ):
        assert heading in text
    assert "| gpt | 0 | 27 | memory tier |" in text
    assert "| small | 0 | 20 | plain |" in text
    assert "| memory tier (its saver starts after the resume) |" in text
    assert "| 120 min | 10 s | memory tier, every step, persist every 100 |" in text
    assert "nan" not in text
    assert not any(shm.iterdir())  # the tiers, the child's and the restarts', are gone
    assert [p.name for p in tmp_path.iterdir()] == ["memory_tier.md"]
