"""SIGKILL in the middle of a save, at every step of the commit protocol.

A child process commits step 1, then dies (SIGKILL) at one file-system operation of
step 2's save. A fresh process must then resume the checkpoint the tracker names,
bit-exactly; see no final-named directory that fails verification; and clean up.
"""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import asyncsave

sys.path.insert(0, str(Path(__file__).parent))
from crash_child import state_of

pytestmark = pytest.mark.slow

HERE = Path(__file__).parent
TRACKER = "latest_checkpointed_iteration.txt"

# (operation, substrings of its path, which occurrence): the save of step 2 in order.
KILL_POINTS = [
    ("mkdir", ("-tmp-2-",), 1),
    ("create", ("-tmp-2-", ".safetensors"), 1),
    ("write", ("-tmp-2-", ".safetensors"), 1),  # the header
    ("write", ("-tmp-2-", ".safetensors"), 3),  # mid-data
    ("fsync", ("-tmp-2-", ".safetensors"), 1),
    ("create", ("-tmp-2-", "manifest.json"), 1),
    ("write", ("-tmp-2-", "manifest.json"), 1),
    ("fsync", ("-tmp-2-", "manifest.json"), 1),
    ("fsync_dir", ("-tmp-2-",), 1),
    ("rename", ("step_2",), 1),
    ("fsync_dir", (), 2),  # the root, after the rename: step 2 committed, not tracked
    ("create", ("-tmp-latest",), 1),  # the tracker's temp file
    ("fsync", ("-tmp-latest",), 1),
    ("replace", (TRACKER,), 1),
    ("fsync_dir", (), 3),  # the root, after the tracker replace
]
# Kill points after the rename of step 2: it is committed there (the rename is the
# commit), so resume takes it whether or not the tracker names it yet.
AFTER_RENAME = KILL_POINTS[[p[0] for p in KILL_POINTS].index("rename") + 1 :]


def assert_same(a: dict, b: dict) -> None:
    assert a["trainer"] == b["trainer"]
    for group in ("model", "optim"):
        for k, v in b[group].items():
            assert a[group][k].dtype == v.dtype and torch.equal(a[group][k], v), (group, k)


@pytest.mark.parametrize(
    ("op", "where", "n"), KILL_POINTS, ids=[f"{o}-{n}-{'+'.join(w)}" for o, w, n in KILL_POINTS]
)
@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_sigkill_mid_save_leaves_last_commit_loadable(
    tmp_path: Path, op: str, where: tuple[str, ...], n: int, backend: str
) -> None:
    root = tmp_path / "ckpt"
    proc = subprocess.run(
        [
            sys.executable,
            str(HERE / "crash_child.py"),
            str(root),
            op,
            str(n),
            ",".join(where),
            backend,
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr

    # 1. The tracker names a committed checkpoint, and it loads bit-exactly.
    info = asyncsave.latest(root)
    assert info is not None and info.step in (1, 2)
    assert_same(asyncsave.load(info.path), state_of(info.step))
    assert info.step == (2 if (op, where, n) in AFTER_RENAME else 1)

    # 2. Every directory under a final name is complete and verifiable.
    finals = sorted(p for p in root.iterdir() if p.name.startswith("step_"))
    for p in finals:
        asyncsave.verify(p)
    assert root / "step_1" in finals

    # 3. The next open removes temp dirs and moves the tracker to the newest commit.
    async def reopen() -> int | None:
        async with asyncsave.Checkpointer(root) as ckpt:
            restored = await ckpt.load_latest()
            assert restored is not None
            assert_same(restored.state, state_of(restored.info.step))
            return restored.info.step

    import anyio

    step = anyio.run(reopen)
    assert not [p for p in root.iterdir() if p.name.startswith(".asyncsave-tmp-")]
    newest = max(int(p.name.split("_")[1]) for p in root.iterdir() if p.name.startswith("step_"))
    assert step == newest == int((root / TRACKER).read_text())
