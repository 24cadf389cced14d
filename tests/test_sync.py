"""The synchronous facade runs the same engine from a plain training loop."""

from __future__ import annotations

import errno
import threading
from pathlib import Path

import pytest
import torch
from faults import FaultyFS, pause, raise_errno

import asyncsave


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_sync_loop_saves_commits_and_resumes(tmp_path: Path, backend: str) -> None:
    model = torch.nn.Linear(8, 8)
    opt = torch.optim.AdamW(model.parameters())
    with asyncsave.SyncCheckpointer(tmp_path, backend=backend) as ckpt:
        assert ckpt.load_latest() is None
        handles = []
        for step in range(1, 4):
            model(torch.randn(2, 8)).sum().backward()
            opt.step()
            handles.append(ckpt.save(step, {"model": model, "optim": opt, "step": step}))
        infos = [h.result() for h in handles]
    assert [i.step for i in infos if i is not None] == [1, 2, 3]
    assert (tmp_path / "latest_checkpointed_iteration.txt").read_text() == "3"
    model2 = torch.nn.Linear(8, 8)
    opt2 = torch.optim.AdamW(model2.parameters())
    with asyncsave.SyncCheckpointer(tmp_path, backend=backend) as ckpt:
        restored = ckpt.load_latest({"model": model2, "optim": opt2})
    assert restored is not None and restored.state["step"] == 3
    assert torch.equal(model2.weight, model.weight)


def test_sync_save_returns_once_staged_and_snapshot_is_consistent(tmp_path: Path) -> None:
    gate = threading.Event()
    fs = FaultyFS("write", pause(gate), where=lambda p: p.endswith(".safetensors"))
    t = torch.arange(100.0)
    with asyncsave.SyncCheckpointer(tmp_path, filesystem=fs) as ckpt:
        handle = ckpt.save(1, {"t": t})
        t.zero_()  # after save() returned: must not reach the checkpoint
        assert fs.fired.wait(10) and not handle.done()
        gate.set()
        handle.result()
    assert torch.equal(asyncsave.load(tmp_path / "step_1")["t"], torch.arange(100.0))


def test_sync_errors_are_the_async_ones(tmp_path: Path) -> None:
    fs = FaultyFS("fsync", raise_errno(errno.EIO), where=lambda p: p.endswith(".safetensors"))
    with (
        pytest.raises(asyncsave.SaveFailedError),
        asyncsave.SyncCheckpointer(tmp_path, filesystem=fs) as ckpt,
    ):
        handle = ckpt.save(1, {"t": torch.ones(3)})
        with pytest.raises(asyncsave.SaveFailedError) as err:
            handle.result()
        assert isinstance(err.value.__cause__, OSError)
    e1 = RuntimeError("loss is NaN")
    fs2 = FaultyFS("fsync", raise_errno(errno.EIO), where=lambda p: p.endswith(".safetensors"))
    with (
        pytest.raises(RuntimeError) as caught,
        asyncsave.SyncCheckpointer(tmp_path / "b", filesystem=fs2) as ckpt,
    ):
        ckpt.save(1, {"t": torch.ones(3)})
        raise e1
    assert caught.value is e1
    assert any("SaveFailedError" in n for n in getattr(e1, "__notes__", []))


def test_sync_use_outside_with_is_a_closed_error(tmp_path: Path) -> None:
    ckpt = asyncsave.SyncCheckpointer(tmp_path)
    with pytest.raises(asyncsave.CheckpointerClosedError):
        ckpt.save(1, {"t": torch.ones(1)})


def test_result_after_the_block_returns_the_settled_save(tmp_path: Path) -> None:
    with asyncsave.SyncCheckpointer(tmp_path) as ckpt:
        handle = ckpt.save(1, {"t": torch.ones(2)})
    info = handle.result()
    assert info is not None and info.step == 1


def test_a_sync_checkpointer_never_exited_is_flushed_at_interpreter_exit(tmp_path: Path) -> None:
    import subprocess
    import sys
    import textwrap

    code = textwrap.dedent(
        f"""
        import torch, asyncsave
        ckpt = asyncsave.SyncCheckpointer({str(tmp_path)!r}).__enter__()
        ckpt.save(1, {{"t": torch.ones(3)}})
        print("leaving without exit", flush=True)
        """
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "never exited" in proc.stderr
    assert asyncsave.latest(tmp_path).step == 1  # type: ignore[union-attr]
