"""Two tiers with node-local roots (issue 15, ``Tier(local_scope="rank")``): each
rank's local root is private (a node-local disk other nodes cannot see). Two gloo
ranks whose local roots are different directories (two simulated nodes): every
rank commits its own part locally, copies it to the persistent tier, where rank 0
commits one ordinary 2-rank checkpoint; resume agrees on a step every rank has
locally, else the newest persistent one."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path
from typing import Any

import anyio
import pytest
import torch

import asyncsave
from asyncsave import Tier

sys.path.insert(0, str(Path(__file__).parent))
import test_objstore
from distributed import run_ranks, values

s3_endpoint = test_objstore.s3_endpoint  # the fixtures, shared
s3 = test_objstore.s3


def rank_state(rank: int, step: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(1000 * rank + step)
    return {"w": torch.randn(512, generator=g), "t": {"step": step, "rank": rank}}


def steps(root: Path) -> list[int]:
    if not root.exists():
        return []
    return sorted(int(p.name[5:]) for p in root.iterdir() if p.name.startswith("step_"))


def _tier(remote: str, opts: Any) -> Tier:
    return Tier(
        remote,
        policy=asyncsave.SaveEvery(2),
        queue_size=4,
        storage_options=opts,
        local_scope="rank",
    )


def _save(
    rank: int, world: int, backend: str, base: Path, remote: str, opts: Any, todo: list[int]
) -> Any:
    """Resume (the step, or None), then save ``todo`` on this rank's own node."""

    async def main() -> tuple[int | None, list[str | None]]:
        async with asyncsave.Checkpointer(
            base / f"node{rank}", persistent=_tier(remote, opts)
        ) as ckpt:
            restored = await ckpt.load_latest()
            resumed = None
            if restored is not None:
                resumed = restored.info.step
                want = rank_state(rank, resumed)
                assert torch.equal(restored.state["w"], want["w"]), (rank, resumed)
                assert restored.state["t"] == want["t"]
            handles = [await ckpt.save(s, rank_state(rank, s)) for s in todo]
            out = []
            for h in handles:
                assert (await h).path == base / f"node{rank}" / f"rank{rank}" / f"step_{h.step}"
                p = await h.persisted()
                out.append(None if p is None else str(p.path))
            return resumed, out

    return anyio.run(main, backend=backend)


def _check_persistent(path: str, opts: Any, step: int) -> None:
    """An ordinary 2-rank checkpoint: loads with no tiers, whole and per rank."""
    whole = asyncsave.load(path, storage_options=opts)
    for r in (0, 1):
        want = rank_state(r, step)
        assert torch.equal(whole[r]["w"], want["w"]) and whole[r]["t"] == want["t"]
    assert asyncsave.verify(path, storage_options=opts).world_size == 2


def test_node_local_roots_save_persist_and_resume(tmp_path: Path) -> None:
    """The runs alternate between asyncio and trio."""
    remote = str(tmp_path / "remote")
    out = values(run_ranks(_save, 2, tmp_path, "asyncio", tmp_path, remote, None, [1, 2, 3]))
    assert out[0] == out[1] == (None, [None, f"{remote}/step_2", None])
    # Each node holds only its own rank's part, a checkpoint of one rank.
    for r in (0, 1):
        assert [p.name for p in (tmp_path / f"node{r}").iterdir()] == [f"rank{r}"]
        assert steps(tmp_path / f"node{r}" / f"rank{r}") == [1, 2, 3]
        assert asyncsave.verify(tmp_path / f"node{r}" / f"rank{r}" / "step_3").world_size == 1
    assert steps(Path(remote)) == [2]
    _check_persistent(f"{remote}/step_2", None, 2)
    assert asyncsave.latest(remote).step == 2  # type: ignore[union-attr]
    # Every node has step 3: both resume it from their own local part, and go on.
    out = values(run_ranks(_save, 2, tmp_path, "trio", tmp_path, remote, None, [4]))
    assert out[0] == out[1] == (3, [f"{remote}/step_4"])
    _check_persistent(f"{remote}/step_4", None, 4)
    # Node 1 was replaced (its local root empty): both resume persistent step 4,
    # and node 0's local parts no rank can complete are moved aside, so the steps
    # after the resumed one are saved again on both nodes.
    shutil.rmtree(tmp_path / "node1")
    out = values(run_ranks(_save, 2, tmp_path, "asyncio", tmp_path, remote, None, [5, 6]))
    assert out[0] == out[1] == (4, [None, f"{remote}/step_6"])
    assert steps(tmp_path / "node1" / "rank1") == [5, 6]
    assert steps(tmp_path / "node0" / "rank0") == [5, 6]
    partial = sorted(p.name[:20] for p in (tmp_path / "node0" / "rank0").glob(".asyncsave-*"))
    assert partial == [f".asyncsave-partial-{s}" for s in (1, 2, 3, 4)]
    _check_persistent(f"{remote}/step_6", None, 6)
    # Rank 1's local step 6 is damaged: every rank drops it; local 5 is older
    # than persistent 6, which wins.
    part = tmp_path / "node1" / "rank1" / "step_6"
    data = max((p for p in part.iterdir() if p.suffix != ".json"), key=lambda p: p.stat().st_size)
    raw = bytearray(data.read_bytes())
    raw[-3] ^= 0xFF
    data.write_bytes(bytes(raw))
    out = values(run_ranks(_save, 2, tmp_path, "trio", tmp_path, remote, None, []))
    assert out[0] == out[1] == (6, [])


def test_node_local_roots_persist_to_s3(tmp_path: Path, s3: Any) -> None:
    root, opts, _ = s3
    out = values(run_ranks(_save, 2, tmp_path, "asyncio", tmp_path, root, opts, [1, 2, 3]))
    assert out[0] == out[1] == (None, [None, f"{root}/step_2", None])
    _check_persistent(f"{root}/step_2", opts, 2)
    shutil.rmtree(tmp_path / "node0")  # node 0 replaced
    out = values(run_ranks(_save, 2, tmp_path, "trio", tmp_path, root, opts, [3, 4]))
    assert out[0] == out[1] == (2, [None, f"{root}/step_4"])
    _check_persistent(f"{root}/step_4", opts, 4)


def test_local_scope_is_validated() -> None:
    with pytest.raises(ValueError, match="local_scope"):
        Tier("/x", local_scope="node")


@pytest.mark.anyio
async def test_one_process_with_a_node_local_root(tmp_path: Path) -> None:
    """A world of one: ``root/rank0``, streamed and overwriting saves, resume
    from either tier."""
    local, remote = tmp_path / "node", tmp_path / "remote"
    tier = Tier(remote, policy=asyncsave.SaveEvery(2), local_scope="rank")
    big = {"w": torch.arange(4096, dtype=torch.float32)}  # streamed: over the budget
    async with asyncsave.Checkpointer(local, persistent=tier, budget_bytes=8192) as ckpt:
        for s in (1, 2, 3):
            await (await ckpt.save(s, rank_state(0, s))).persisted()
        h = await ckpt.save(4, big)
        assert (await h).path == local / "rank0" / "step_4"
        assert (await h.persisted()).path == remote / "step_4"  # type: ignore[union-attr]
        h = await ckpt.save(4, rank_state(0, 4), overwrite=True)
        await h.persisted()
    assert steps(local / "rank0") == [1, 2, 3, 4] and steps(remote) == [2, 4]
    assert torch.equal(asyncsave.load(remote / "step_4")["w"], rank_state(0, 4)["w"])
    async with asyncsave.Checkpointer(local, persistent=tier) as ckpt:
        restored = await ckpt.load_latest()
        assert restored is not None and restored.info.path == local / "rank0" / "step_4"
    shutil.rmtree(local)
    async with asyncsave.Checkpointer(local, persistent=tier) as ckpt:
        restored = await ckpt.load_latest()
        assert restored is not None and restored.info.path == remote / "step_4"
        assert torch.equal(restored.state["w"], rank_state(0, 4)["w"])


def _fail_one(rank: int, world: int, base: Path, remote: str, case: str) -> Any:
    """Rank 1 saves another step, or a state it cannot save, or both ranks save
    DTensor state: no rank commits."""

    async def main() -> str:
        if case == "dtensor":
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.tensor import Shard, distribute_tensor

            mesh = init_device_mesh("cpu", (2,))
            state: Any = {"w": distribute_tensor(torch.arange(4.0), mesh, [Shard(0)])}
        else:
            bad = {"step": rank_state(rank, 2 + rank), "state": {"x": object()}}[case]
            state = rank_state(rank, 2) if rank == 0 else bad
        try:
            async with asyncsave.Checkpointer(
                base / f"node{rank}", persistent=_tier(remote, None), dist_timeout_s=20
            ) as ckpt:
                await (await ckpt.save(2 + (case == "step") * rank, state))
        except asyncsave.CheckpointError as exc:
            return f"{type(exc).__name__}: {exc}"
        return "saved"

    return anyio.run(main, backend="trio" if case == "step" else "asyncio")


def test_dtensor_state_is_refused_with_node_local_roots(tmp_path: Path) -> None:
    """DCP's planner needs every rank's files in one directory: refused, on every
    rank, naming the option to use; nothing is committed."""
    out = values(run_ranks(_fail_one, 2, tmp_path, tmp_path, str(tmp_path / "r"), "dtensor"))
    assert all("Tier(local_scope='rank') saves plain state trees only" in o for o in out), out
    for r in (0, 1):
        assert steps(tmp_path / f"node{r}" / f"rank{r}") == []


@pytest.mark.parametrize("case", ["step", "state"])
def test_a_rank_that_cannot_save_its_part_fails_every_rank(tmp_path: Path, case: str) -> None:
    remote = str(tmp_path / "remote")
    out = values(run_ranks(_fail_one, 2, tmp_path, tmp_path, remote, case))
    # Rank 0 names rank 1; rank 1 raises its own error (its state), or, for steps
    # that differ, names rank 0 (no rank can tell which step was meant).
    assert out[0].startswith("RankFailedError: save of step 2 failed on rank(s) [1]"), out
    if case == "step":
        assert out[1].startswith("RankFailedError: save of step 3 failed on rank(s) [0]"), out
    else:
        assert out[1].startswith("UnsupportedTypeError"), out
    for r in (0, 1):
        left = [p.name for p in (tmp_path / f"node{r}" / f"rank{r}").iterdir()]
        assert not [n for n in left if n.startswith(("step_", ".asyncsave-tmp"))], left
    assert steps(Path(remote)) == []


class _NoSpace(asyncsave.LocalFileSystem):
    def create(self, path: Any) -> int:
        raise OSError(28, "No space left on device", str(path))


def _copy_fails_on_rank_1(rank: int, world: int, base: Path, remote: str) -> Any:
    async def main() -> tuple[str, str]:
        fs = _NoSpace() if rank == 1 else None
        tier = Tier(remote, filesystem=fs, local_scope="rank")
        try:
            async with asyncsave.Checkpointer(base / f"node{rank}", persistent=tier) as ckpt:
                handle = await ckpt.save(1, rank_state(rank, 1))
                await handle  # committed locally on both nodes
                try:
                    await handle.persisted()
                except asyncsave.SaveFailedError as exc:
                    persisted = str(exc)
        except asyncsave.SaveFailedError as exc:
            return persisted, type(exc).__name__
        return persisted, "closed"

    return anyio.run(main, backend="trio")


def test_a_rank_whose_copy_fails_fails_persisting_on_every_rank(tmp_path: Path) -> None:
    remote = tmp_path / "remote"
    out = values(run_ranks(_copy_fails_on_rank_1, 2, tmp_path, tmp_path, str(remote)))
    for persisted, closed in out:
        assert "rank 1:" in persisted and "No space left" in persisted, out
        # Raised again at close, as a failed save naming the failed rank (a
        # RankFailedError is a SaveFailedError).
        assert closed == "RankFailedError"
    assert [p.name for p in remote.iterdir()] == [".asyncsave.lock"]  # the temp dir discarded
    for r in (0, 1):  # the local parts stay committed
        assert steps(tmp_path / f"node{r}" / f"rank{r}") == [1]
