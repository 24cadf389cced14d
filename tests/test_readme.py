"""Every Python block the README marks ``<!-- runnable -->`` runs as it is, in a
fresh interpreter and an empty directory, and prints what the README says."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"
BLOCKS = re.findall(r"<!-- runnable -->\n```python\n(.*?)```", README.read_text(), re.S)

pytestmark = pytest.mark.slow


def _expected_output(code: str) -> list[str]:
    """The ``print(...)  # value`` comments and ``# value`` lines right after a print."""
    out, lines = [], code.splitlines()
    for i, line in enumerate(lines):
        if "print(" not in line:
            continue
        m = re.search(r"\)\s+#\s*(.+)$", line)
        if m:
            out.append(m.group(1).split(" (")[0].strip())
        elif i + 1 < len(lines) and lines[i + 1].strip().startswith("# "):
            out.append(lines[i + 1].strip()[2:])
    return out


def test_the_readme_has_runnable_blocks() -> None:
    assert len(BLOCKS) >= 5


@pytest.mark.parametrize("code", BLOCKS, ids=[f"block{i}" for i in range(len(BLOCKS))])
def test_readme_block_runs_and_prints_what_it_says(tmp_path: Path, code: str) -> None:
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    for expected in _expected_output(code):
        assert expected in proc.stdout, (expected, proc.stdout)
