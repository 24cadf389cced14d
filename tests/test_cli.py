"""The asyncsave command: ls, verify, inspect."""

from __future__ import annotations

import io
import subprocess
import sys
from pathlib import Path

import anyio
import pytest
import torch

import asyncsave
from asyncsave._cli import main


def make_root(root: Path) -> None:
    async def go() -> None:
        async with asyncsave.Checkpointer(root) as ckpt:
            model = torch.nn.Linear(4, 2)
            for step in (1, 2):
                await (await ckpt.save(step, {"model": model, "trainer": {"step": step}}))

    anyio.run(go)


def run(*argv: str) -> tuple[int, str]:
    out = io.StringIO()
    rc = main(list(argv), out=out)
    return rc, out.getvalue()


def test_ls_lists_steps_the_tracked_one_and_stray_temp_dirs(tmp_path: Path) -> None:
    make_root(tmp_path)
    (tmp_path / ".asyncsave-tmp-3-0123456789ab").mkdir()
    rc, text = run("ls", str(tmp_path))
    assert rc == 0
    assert "tracker -> step 2" in text
    assert " * step_2" in text and "   step_1" in text
    assert ".asyncsave-tmp-3-0123456789ab" in text and "temporary" in text


def test_verify_passes_then_fails_on_a_flipped_byte(tmp_path: Path) -> None:
    make_root(tmp_path)
    rc, text = run("verify", str(tmp_path / "step_2"))
    assert rc == 0 and text.startswith("ok")
    rc, text = run("verify", str(tmp_path))
    assert rc == 0 and text.count("ok ") == 2
    data = sorted((tmp_path / "step_2").glob("*.safetensors"))[0]
    raw = bytearray(data.read_bytes())
    raw[-1] ^= 0xFF
    data.write_bytes(bytes(raw))
    rc, text = run("verify", str(tmp_path / "step_2"))
    assert rc == 1 and "FAIL" in text and "checksum" in text


def test_inspect_prints_the_tree_with_dtype_shape_and_bytes(tmp_path: Path) -> None:
    make_root(tmp_path)
    rc, text = run("inspect", str(tmp_path / "step_1"))
    assert rc == 0
    assert "'weight': float32 [2, 4] 32 B" in text
    assert "state_dict of torch.nn.modules.linear.Linear" in text
    assert "'step': int 1" in text


def test_inspect_of_a_non_checkpoint_fails_cleanly(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rc, _ = run("inspect", str(tmp_path))
    assert rc == 1
    assert "no manifest.json" in capsys.readouterr().err


def test_the_installed_command_runs(tmp_path: Path) -> None:
    make_root(tmp_path)
    proc = subprocess.run(
        [sys.executable, "-m", "asyncsave", "ls", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    assert "step_2" in proc.stdout
