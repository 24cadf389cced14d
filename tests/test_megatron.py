"""asyncsave.megatron on CPU with megatron-core's real classes: a real
``AsyncRequest`` built by ``dist_checkpointing.save(..., async_sharded_save=True)``
(``TorchDistSaveShardedStrategy`` / ``FileSystemWriterAsync``) from real
``ShardedTensor`` state dicts on 2 forked gloo ranks.

megatron-core is imported once here, in the parent, so the forked ranks share it.
"""

from __future__ import annotations

import inspect
import sys
import threading
from pathlib import Path
from typing import Any

import anyio
import psutil
import pytest
import torch
import torch.distributed.checkpoint as dcp
from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing import ShardedTensor
from megatron.core.dist_checkpointing.strategies import filesystem_async as fs_async
from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy

import asyncsave
from asyncsave.megatron import MegatronSaver

sys.path.insert(0, str(Path(__file__).parent))
from distributed import run_ranks, values

pytestmark = pytest.mark.slow

TRACKER = "latest_checkpointed_iteration.txt"

# What changed between megatron-core 0.16 (CI, Python 3.11) and 0.17+ (Python 3.12;
# 0.19.2 run by hand, README): the results-queue getter lost its underscore, the
# default async strategy became NVRx (nvidia-resiliency-ext; mcore's own is kept
# with async_strategy="mcore"), and common.pt went into the torch_dist files.
GETTER = (
    "_get_write_results_queue"
    if hasattr(fs_async, "_get_write_results_queue")
    else "get_write_results_queue"
)
SAVE_KW: dict[str, Any] = (
    {"async_strategy": "mcore"}
    if "async_strategy" in inspect.signature(dist_checkpointing.save).parameters
    else {}
)
COMMON_FILES = {"common.pt"} if GETTER == "_get_write_results_queue" else set()


def weights(rank: int, device: str = "cpu") -> dict[str, torch.Tensor]:
    return {
        "w": (torch.arange(8.0).reshape(2, 4) + 100 * rank).to(device),
        "b": torch.full((3,), 7.0, device=device),
    }


def sharded(t: dict[str, torch.Tensor], rank: int, world: int) -> dict[str, Any]:
    return {
        "w": ShardedTensor.from_rank_offsets("w", t["w"], (0, rank, world)),
        "b": ShardedTensor.from_rank_offsets("b", t["b"], replica_id=rank),
    }


class _TrainersOwnQueue:
    """Stands for the results queue of a Manager the trainer started itself."""

    def __getattr__(self, name: str) -> Any:
        raise AssertionError(f"the saver used the trainer's queue ({name})")


def _children() -> list[str]:
    """This process's live descendants (zombies are already gone)."""
    return [
        " ".join(p.cmdline())
        for p in psutil.Process().children(recursive=True)
        if p.status() != psutil.STATUS_ZOMBIE
    ]


def _megatron_save(
    rank: int, world: int, root: str, fail_rank: int, device: str, trainers_queue: bool = False
) -> dict[str, Any]:
    seen: dict[str, Any] = {"finalize_saw": []}
    own = _TrainersOwnQueue()
    if trainers_queue:
        fs_async._results_queue = own

    def caller_finalize() -> None:
        # Runs after every rank's write is durable, before commit and tracker.
        final = Path(root) / "iter_0000010"
        tracker = Path(root) / TRACKER
        seen["finalize_saw"].append(
            (final.exists(), tracker.read_text().strip() if tracker.exists() else None)
        )
        if rank == fail_rank:
            raise RuntimeError("injected finalize failure")

    async def main() -> None:
        async with asyncsave.Checkpointer(
            root, layout="megatron", distributed=True, dist_timeout_s=60, save_timeout_s=120
        ) as ckpt:
            saver = MegatronSaver(ckpt)
            live = weights(rank, device)
            tmp = await saver.prepare(10)
            with saver.building(10):
                request = dist_checkpointing.save(
                    sharded(live, rank, world),
                    str(tmp),
                    TorchDistSaveShardedStrategy("torch_dist", 1),
                    async_sharded_save=True,
                    **SAVE_KW,
                )
            request.add_finalize_fn(caller_finalize)
            handle = await saver.save(10, request)
            for t in live.values():
                t.add_(1000)  # after save() returns: must not reach the checkpoint
            try:
                info = await handle
                seen["committed"] = (info.step, info.world_size)
                p = handle.progress  # counted whole per phase, this rank's bytes
                seen["progress"] = (p.staged_bytes, p.written_bytes, p.total_bytes, info.nbytes)
            except asyncsave.RankFailedError as exc:
                seen["error"] = dict(exc.ranks)
            seen["tracker"] = (
                (Path(root) / TRACKER).read_text().strip()
                if (Path(root) / TRACKER).exists()
                else None
            )
            # S23: megatron-core spawned no Manager for the saver, and its
            # process-wide queue is as it was before prepare().
            seen["children"] = _children()
            seen["global_queue"] = (
                "trainer's" if fs_async._results_queue is own else fs_async._results_queue
            )

    try:
        anyio.run(main)
    except asyncsave.RankFailedError:
        seen["close"] = "RankFailedError"
    return seen


def test_megatron_request_runs_on_the_engine_finalize_before_commit_and_tracker(
    tmp_path: Path,
) -> None:
    root = tmp_path / "run"
    seen = values(run_ranks(_megatron_save, 2, tmp_path, str(root), -1, "cpu", timeout_s=240))
    for s in seen:
        assert s["committed"] == (10, 2)
        assert s["tracker"] == "10"
        staged, written, total, nbytes = s["progress"]
        assert staged == written == total == nbytes > 0
        # Megatron's finalize ran before the rename and before the tracker.
        assert s["finalize_saw"] == [(False, None)]
        assert s["children"] == [] and s["global_queue"] is None
    final = root / "iter_0000010"
    names = sorted(p.name for p in final.iterdir())
    assert {".metadata", *COMMON_FILES, "metadata.json", "manifest.json"} <= set(names)
    assert any(n.endswith(".distcp") for n in names)
    assert asyncsave.verify(final).world_size == 2
    with pytest.raises(asyncsave.UnsupportedFormatError, match="megatron"):
        asyncsave.load(final)
    # Megatron's torch_dist format is DCP's: read it back, resharded to one
    # process, with the values at save() time (the later in-place add is absent).
    out = {"w": torch.zeros(4, 4), "b": torch.zeros(3)}
    dcp.load(out, storage_reader=dcp.FileSystemReader(str(final)), no_dist=True)
    assert torch.equal(out["w"], torch.cat([weights(0)["w"], weights(1)["w"]]))
    assert torch.equal(out["b"], weights(0)["b"])


def test_failed_megatron_finalize_on_one_rank_commits_nothing(tmp_path: Path) -> None:
    root = tmp_path / "run"
    seen = values(run_ranks(_megatron_save, 2, tmp_path, str(root), 1, "cpu", timeout_s=240))
    for s in seen:
        assert list(s["error"]) == [1] and "injected finalize failure" in s["error"][1]
        assert s["tracker"] is None and s["close"] == "RankFailedError"
        assert s["children"] == [] and s["global_queue"] is None
    assert not (root / "iter_0000010").exists()
    assert [p.name for p in root.iterdir() if p.name.startswith(".asyncsave-tmp")] == []


def test_a_results_queue_the_trainer_started_is_left_alone_and_unused(tmp_path: Path) -> None:
    root = tmp_path / "run"
    seen = values(run_ranks(_megatron_save, 2, tmp_path, str(root), -1, "cpu", True, timeout_s=240))
    for s in seen:
        assert s["committed"] == (10, 2) and s["tracker"] == "10"
        assert s["global_queue"] == "trainer's" and s["children"] == []
    assert asyncsave.verify(root / "iter_0000010").world_size == 2


def _prepare_then_fail(rank: int, world: int, root: str) -> dict[str, Any]:
    """prepare(), then a request build that fails, then a build that works and
    save(): megatron-core's results-queue globals are its own at every point
    outside ``building()``, and inside it only the building thread sees a change."""
    own = _TrainersOwnQueue()
    getter = getattr(fs_async, GETTER)
    seen: dict[str, Any] = {}

    def globals_now() -> tuple[bool, bool]:
        return (fs_async._results_queue is None, getattr(fs_async, GETTER) is getter)

    async def main() -> None:
        async with asyncsave.Checkpointer(
            root, layout="megatron", distributed=True, dist_timeout_s=60, save_timeout_s=120
        ) as ckpt:
            saver = MegatronSaver(ckpt)
            tmp = await saver.prepare(10)
            seen["after prepare"] = globals_now()
            other: list[Any] = []
            try:
                with saver.building(10):
                    # As if the trainer had started megatron-core's Manager (so
                    # megatron-core's getter spawns nothing here).
                    fs_async._results_queue = own
                    mine = getattr(fs_async, GETTER)()
                    t = threading.Thread(target=lambda: other.append(getattr(fs_async, GETTER)()))
                    t.start()
                    t.join()
                    fs_async._results_queue = None
                    seen["inside"] = (type(mine).__name__, other[0] is own)
                    raise RuntimeError("injected failure while building the request")
            except RuntimeError:
                pass
            seen["after a failed build"] = globals_now()
            with saver.building(10):
                request = dist_checkpointing.save(
                    sharded(weights(rank), rank, world),
                    str(tmp),
                    TorchDistSaveShardedStrategy("torch_dist", 1),
                    async_sharded_save=True,
                    **SAVE_KW,
                )
            seen["after the build"] = globals_now()
            info = await (await saver.save(10, request))
            seen["committed"] = info.step
            seen["children"] = _children()
        seen["after close"] = globals_now()

    try:
        anyio.run(main)
    finally:
        fs_async._results_queue = None
    return seen


def test_megatron_globals_are_left_as_they_were_when_a_request_build_fails(
    tmp_path: Path,
) -> None:
    """S23: prepare() touches no global of megatron-core; building() changes its
    results-queue getter only for the building thread and only inside the block,
    an exception included."""
    root = tmp_path / "run"
    seen = values(run_ranks(_prepare_then_fail, 2, tmp_path, str(root), timeout_s=240))
    for s in seen:
        for when in ("after prepare", "after a failed build", "after the build", "after close"):
            assert s[when] == (True, True), when
        assert s["inside"] == ("Queue", True)  # this thread in-process, others megatron's
        assert s["committed"] == 10 and s["children"] == []
    assert asyncsave.verify(root / "iter_0000010").world_size == 2


@pytest.mark.cuda
def test_megatron_request_of_cuda_tensors_one_rank(tmp_path: Path) -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    root = tmp_path / "run"
    (s,) = values(run_ranks(_megatron_save, 1, tmp_path, str(root), -1, "cuda", timeout_s=240))
    assert s["committed"] == (10, 1) and s["tracker"] == "10"
    out = {"w": torch.zeros(2, 4), "b": torch.zeros(3)}
    dcp.load(out, storage_reader=dcp.FileSystemReader(str(root / "iter_0000010")), no_dist=True)
    assert torch.equal(out["w"], weights(0)["w"]) and torch.equal(out["b"], weights(0)["b"])


def _prepare_on_a_full_disk(rank: int, world: int, root: str) -> dict[str, Any]:
    import errno

    from asyncsave.testing import FaultyFileSystem, raise_errno

    fs = FaultyFileSystem("mkdir", raise_errno(errno.ENOSPC), n=1)
    seen: dict[str, Any] = {}

    async def main() -> None:
        async with asyncsave.Checkpointer(
            root, layout="megatron", distributed=True, filesystem=fs
        ) as ckpt:
            saver = MegatronSaver(ckpt)
            try:
                await saver.prepare(10)
            except Exception as exc:
                cause = exc.__cause__
                seen["error"] = (type(exc).__name__, str(exc), getattr(cause, "errno", None))
            # the failed prepare's turn was ended: the next one takes its own
            seen["next"] = (await saver.prepare(10)).exists()

    anyio.run(main)
    return seen


def test_prepare_that_cannot_make_the_temporary_directory_raises_a_typed_error(
    tmp_path: Path,
) -> None:
    """One rank: a full disk at prepare() is a RankFailedError (a
    CheckpointError) naming the temporary directory, as on several ranks, with
    the OSError as its cause; the next prepare() is not held by the failed one."""
    import errno

    (seen,) = values(run_ranks(_prepare_on_a_full_disk, 1, tmp_path, str(tmp_path / "run")))
    name, text, cause_errno = seen["error"]
    assert name == "RankFailedError" and "temporary directory of step 10" in text
    assert cause_errno == errno.ENOSPC
    assert seen["next"] is True
