"""asyncsave.dcp: DCP's save/async_save/load through asyncsave's writer and reader,
and FSDP2 on CPU (2 forked gloo ranks) resuming on 2 and on 1 rank."""

from __future__ import annotations

import errno
import io
import pickle
import sys
from pathlib import Path
from typing import Any

import anyio
import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

import asyncsave
from asyncsave import LocalFileSystem
from asyncsave.dcp import StorageReader, StorageWriter
from asyncsave.testing import cli as cli_main

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parent.parent / "examples"))
from distributed import resume_on_ranks, run_ranks, stop_dcp_background_process, values

TRACKER = "latest_checkpointed_iteration.txt"


def sample_state() -> dict[str, Any]:
    return {
        "w": torch.randn(16, 8),
        "half": torch.randn(5, dtype=torch.bfloat16),
        "ints": torch.arange(7, dtype=torch.int64),
        "cplx": torch.randn(3, dtype=torch.complex64),
        "flag": torch.tensor(True),
        "empty": torch.empty(0, 4),
        "extra": {"step": 5, "name": "run"},
    }


def zeros_like(state: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {k: torch.zeros_like(v) for k, v in state.items() if torch.is_tensor(v)}
    out["extra"] = {"step": 0, "name": ""}
    return out


def test_dcp_save_commits_in_finish_and_dcp_load_reads_it_back(tmp_path: Path) -> None:
    root = tmp_path / "run"
    state = sample_state()
    dcp.save(state, storage_writer=StorageWriter(root, step=5))
    assert (root / TRACKER).read_text().strip() == "5"
    assert [p.name for p in root.iterdir() if p.name.startswith(".asyncsave-tmp")] == []
    info = asyncsave.verify(root / "step_5")  # every byte against its checksum
    out = io.StringIO()
    assert cli_main(["inspect", str(root / "step_5")], out=out) == 0
    assert "torch.distributed.checkpoint" in out.getvalue()
    assert info.step == 5 and info.world_size == 1
    with pytest.raises(asyncsave.UnsupportedFormatError, match="StorageReader"):
        asyncsave.load(root / "step_5")
    # A resume on two ranks (a FakeGroup's, in this process): a typed error on
    # every rank that says how DCP state loads (into a template), nothing read.
    for error in anyio.run(resume_on_ranks, root, 2).values():
        assert isinstance(error, asyncsave.UnsupportedFormatError), error
        assert "torch.distributed.checkpoint" in str(error) and "template" in str(error)
    target = zeros_like(state)
    dcp.load(target, storage_reader=StorageReader(root))  # the root: its latest
    for k, v in state.items():
        if torch.is_tensor(v):
            assert target[k].dtype == v.dtype and torch.equal(target[k], v), k
    assert target["extra"] == {"step": 5, "name": "run"}


def test_dcp_save_of_an_existing_step_is_refused(tmp_path: Path) -> None:
    dcp.save(sample_state(), storage_writer=StorageWriter(tmp_path, step=1))
    with pytest.raises(CheckpointException, match="exists already"):
        dcp.save(sample_state(), storage_writer=StorageWriter(tmp_path, step=1))


class _FullDisk(LocalFileSystem):
    def write(self, fd: int, data: memoryview) -> int:
        raise OSError(errno.ENOSPC, "No space left on device (injected)")


def test_failed_dcp_write_leaves_no_final_directory(tmp_path: Path) -> None:
    dcp.save({"w": torch.ones(3)}, storage_writer=StorageWriter(tmp_path, step=1))
    with pytest.raises(CheckpointException, match="No space left"):
        dcp.save(
            sample_state(), storage_writer=StorageWriter(tmp_path, step=2, filesystem=_FullDisk())
        )
    assert not (tmp_path / "step_2").exists()
    assert (tmp_path / TRACKER).read_text().strip() == "1"
    assert asyncsave.latest(tmp_path).step == 1  # type: ignore[union-attr]


def test_damaged_item_is_a_checksum_error(tmp_path: Path) -> None:
    dcp.save({"w": torch.randn(64)}, storage_writer=StorageWriter(tmp_path, step=1))
    data = tmp_path / "step_1" / "data-r00000-000.safetensors"
    raw = bytearray(data.read_bytes())
    raw[-5] ^= 0xFF
    data.write_bytes(bytes(raw))
    with pytest.raises(CheckpointException, match="ChecksumMismatchError"):
        dcp.load({"w": torch.zeros(64)}, storage_reader=StorageReader(tmp_path / "step_1"))


def test_writer_and_reader_pickle() -> None:
    w = pickle.loads(pickle.dumps(StorageWriter("/r", 3)))
    assert (w.root, w.step) == ("/r", 3)
    assert pickle.loads(pickle.dumps(StorageReader("/r"))).path == "/r"


def _async_save_both_executors(rank: int, world: int, root: str) -> bool:
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

    state = {"w": torch.arange(10.0), "b": torch.ones(3, dtype=torch.bfloat16)}
    dcp.async_save(state, storage_writer=StorageWriter(root, 1)).result()
    try:
        dcp.async_save(
            state,
            storage_writer=StorageWriter(root, 2),
            async_checkpointer_type=AsyncCheckpointerType.PROCESS,
        ).result()
    finally:
        stop_dcp_background_process()
    ok = True
    for step in (1, 2):
        target = {"w": torch.zeros(10), "b": torch.zeros(3, dtype=torch.bfloat16)}
        dcp.load(target, storage_reader=StorageReader(Path(root) / f"step_{step}"))
        ok = ok and all(torch.equal(target[k], state[k]) for k in state)
    return ok


@pytest.mark.slow
def test_async_save_with_thread_and_process_executors(tmp_path: Path) -> None:
    root = tmp_path / "run"
    assert values(run_ranks(_async_save_both_executors, 1, tmp_path, str(root))) == [True]
    assert (root / TRACKER).read_text().strip() == "2"


@pytest.mark.slow
def test_fsdp2_two_ranks_save_async_and_resume_on_two_and_one(tmp_path: Path) -> None:
    import fsdp2_train as ex

    root = str(tmp_path / "run")
    trained = values(run_ranks(ex.train_and_save, 2, tmp_path, root))
    assert trained[0] == trained[1] and len(trained[0]) == ex.TOTAL_STEPS - ex.SAVE_STEP
    ckpt = Path(root) / f"step_{ex.SAVE_STEP}"
    assert asyncsave.verify(ckpt).world_size == 2
    assert (Path(root) / TRACKER).read_text().strip() == str(ex.SAVE_STEP)
    assert sorted(p.name for p in ckpt.iterdir()) == [
        ".metadata",
        "data-r00000-000.safetensors",
        "data-r00001-000.safetensors",
        "manifest.json",
    ]
    # Same world size: the same losses, bit for bit.
    on_two = values(run_ranks(ex.resume_and_train, 2, tmp_path, root))
    assert on_two[0] == trained[0]
    # One rank, unsharded model: DCP reshards; equal up to reduction order.
    (on_one,) = values(run_ranks(ex.resume_and_train, 1, tmp_path, root))
    assert on_one == pytest.approx(trained[0], rel=1e-5, abs=1e-6)
    # The copy written by dcp.async_save with asyncsave's writer resumes the same.
    (from_dcp,) = values(run_ranks(ex.resume_and_train, 1, tmp_path, root + "-dcp"))
    assert from_dcp == pytest.approx(trained[0], rel=1e-5, abs=1e-6)
