"""Crashes with two tiers (issue 15, item 4): a run is SIGKILLed during the local
commit, during persisting, or has its local tier wiped, on 1 and 2 ranks, with the
persistent tier on a local directory and on moto's S3 server.

A run saves step 1, then step 2, each persisted (no policy: every save). A first
run records, on each rank, the mutating I/O calls of step 2 on both tiers (and the
collectives, on 2 ranks). Then a run is killed just before chosen calls: for each
tier and each kind of call, its first and its last (the data files, the manifest,
the rename or commit marker, the tracker). Afterwards:

1. a fresh run (same ranks) resumes a step at least as new as the newest save
   whose ``await handle`` returned, bit-exact for every rank, and its open leaves
   no temporary directory in either tier;
2. with the local tier wiped (a replaced node), a fresh run resumes a step at
   least as new as the newest save whose ``await handle.persisted()`` returned,
   bit-exact, from the persistent tier.
"""

from __future__ import annotations

import os
import shutil
import signal
import sys
from pathlib import Path
from typing import Any

import anyio
import pytest
import torch

import asyncsave
from asyncsave import FsspecFileSystem, LocalFileSystem, Tier
from asyncsave.testing import gloo_collectives

sys.path.insert(0, str(Path(__file__).parent))
import test_objstore
from distributed import run_ranks, values

pytestmark = pytest.mark.slow

s3_endpoint = test_objstore.s3_endpoint  # the fixtures, shared
s3 = test_objstore.s3

MUTATING = (
    "create",
    "write",
    "fsync",
    "close",
    "mkdir",
    "makedirs",
    "fsync_dir",
    "rename",
    "replace",
    "exchange",
    "remove_tree",
    "unlink",
)


def state_of(rank: int, step: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(7919 * rank + step)
    return {"w": torch.randn(2048, generator=g), "t": {"step": step, "rank": rank}}


class _Calls:
    """This rank's numbered calls once ``armed``: (tier, call name)."""

    def __init__(self, kill_at: int | None) -> None:
        self.kill_at = kill_at
        self.armed = False
        self.names: list[tuple[str, str]] = []

    def __call__(self, tier: str, what: str) -> None:
        if not self.armed:
            return
        self.names.append((tier, what))
        if len(self.names) == self.kill_at:
            os.kill(os.getpid(), signal.SIGKILL)


def _counting(base: type, tier: str, calls: _Calls) -> type:
    def wrap(name: str) -> Any:
        method = getattr(base, name)

        def counted(self: Any, *args: Any, **kwargs: Any) -> Any:
            calls(tier, name)
            return method(self, *args, **kwargs)

        return counted

    return type(
        f"Counting{base.__name__}",
        (base,),
        {n: wrap(n) for n in MUTATING if hasattr(base, n)},
    )


def _local(base: Path, rank: int, scope: str) -> Path:
    """The local root: shared by the ranks, or each rank's node's own."""
    return base / "local" if scope == "shared" else base / f"node{rank}"


def _tier(remote: str, opts: Any, calls: _Calls, scope: str) -> Tier:
    if opts is None:
        fs: LocalFileSystem = _counting(LocalFileSystem, "persistent", calls)()
    else:
        import s3fs

        fs = _counting(FsspecFileSystem, "persistent", calls)(s3fs.S3FileSystem(**opts))
    return Tier(remote, filesystem=fs, queue_size=2, local_scope=scope)


def _ack(base: Path, rank: int, what: str, step: int) -> None:
    with open(base / f"acks-{what}-{rank}", "a") as f:
        f.write(f"{step}\n")
        f.flush()
        os.fsync(f.fileno())


def _acked(base: Path, what: str) -> int:
    steps = {0}
    for path in base.glob(f"acks-{what}-*"):
        steps |= {int(x) for x in path.read_text().split()}
    return max(steps)


def _scenario(
    rank: int,
    world: int,
    base: Path,
    remote: str,
    opts: Any,
    victim: int,
    kill_at: int | None,
    backend: str,
    scope: str = "shared",
) -> list[tuple[str, str]]:
    calls = _Calls(kill_at if rank == victim else None)
    local_fs = _counting(LocalFileSystem, "local", calls)()

    async def main() -> None:
        try:
            async with asyncsave.Checkpointer(
                _local(base, rank, scope),
                filesystem=local_fs,
                dist_timeout_s=6,
                persistent=_tier(remote, opts, calls, scope),
            ) as ckpt:
                for step in (1, 2):
                    calls.armed = step == 2
                    handle = await ckpt.save(step, state_of(rank, step))
                    await handle
                    _ack(base, rank, "local", step)
                    await handle.persisted()
                    _ack(base, rank, "persistent", step)
                calls.armed = False
        except asyncsave.SaveFailedError:
            pass  # the peer died: this rank raised instead of hanging

    with gloo_collectives(lambda kind: calls("gloo", kind)):
        anyio.run(main, backend=backend)
    return calls.names


def _resume(
    rank: int, world: int, base: Path, remote: str, opts: Any, backend: str, scope: str
) -> Any:
    async def main() -> int | None:
        tier = Tier(remote, storage_options=opts, local_scope=scope)
        async with asyncsave.Checkpointer(_local(base, rank, scope), persistent=tier) as ckpt:
            restored = await ckpt.load_latest()
            if restored is None:
                return None
            step = restored.info.step
            want = state_of(rank, step)
            assert torch.equal(restored.state["w"], want["w"]), (rank, step)
            assert restored.state["t"] == want["t"]
            return step

    return anyio.run(main, backend=backend)


Pick = tuple[str, str, str]  # (tier, call name, "first" | "last" | "all")


def _points(recorded: list[tuple[str, str]], picks: list[Pick]) -> list[int]:
    """1-based kill points in ``recorded``: for each pick, the first, the last or
    every call of that name on that tier."""
    out: set[int] = set()
    for tier, name, which in picks:
        hits = [i for i, key in enumerate(recorded, 1) if key == (tier, name)]
        assert hits, (tier, name, recorded)
        out |= set(hits) if which == "all" else {hits[0] if which == "first" else hits[-1]}
    return sorted(out)


def _temp_left(base: Path, remote: str, opts: Any, scope: str) -> list[str]:
    roots = [base / "local"] if scope == "shared" else list(base.glob("node*/rank*"))
    left = [p.name for r in roots for p in r.iterdir() if p.name.startswith(".asyncsave-tmp")]
    if opts is None and Path(remote).exists():
        left += [p.name for p in Path(remote).iterdir() if p.name.startswith(".asyncsave-tmp")]
    return left


def _matrix(
    tmp: Path,
    world: int,
    remote_of: Any,
    opts: Any,
    picks: dict[int, list[Pick]],
    scope: str = "shared",
) -> None:
    """With ``scope="rank"`` each rank's local root is its node's own, and the
    replaced node is rank 1's alone."""
    rec = tmp / "rec"
    rec.mkdir()
    recorded = values(
        run_ranks(_scenario, world, rec, rec, remote_of(rec), opts, -1, None, "asyncio", scope)
    )
    assert ("local", "rename") in recorded[0]
    assert any(t == "persistent" for t, _ in recorded[0])
    failures = []
    cases = 0
    for victim, chosen in picks.items():
        for k in _points(recorded[victim], chosen):
            cases += 1
            base = tmp / f"r{victim}-{k}"
            base.mkdir()
            remote = remote_of(base)
            what = f"rank {victim} killed before {recorded[victim][k - 1]} #{k}"
            # The killed run and the resumes alternate between asyncio and trio.
            backend = "trio" if k % 2 else "asyncio"
            results = run_ranks(
                _scenario, world, base, base, remote, opts, victim, k, backend, scope, timeout_s=60
            )
            if results[victim] != ("exit", -signal.SIGKILL):
                failures.append(f"{what}: {results}")
                continue
            if world > 1 and results[1 - victim][0] != "ok":
                failures.append(f"{what}: the survivor: {results[1 - victim]}")
                continue
            acked_local, acked_remote = _acked(base, "local"), _acked(base, "persistent")
            resumed = values(run_ranks(_resume, world, base, base, remote, opts, backend, scope))
            if len(set(resumed)) != 1 or (resumed[0] or 0) < acked_local:
                failures.append(f"{what}: acknowledged {acked_local}, resumed {resumed}")
            left = _temp_left(base, remote, opts, scope)
            if left:
                failures.append(f"{what}: temporary directories left after reopening: {left}")
            shutil.rmtree(_local(base, world - 1, scope))  # a replaced node
            resumed = values(run_ranks(_resume, world, base, base, remote, opts, backend, scope))
            if len(set(resumed)) != 1 or (resumed[0] or 0) < acked_remote:
                failures.append(
                    f"{what}, local tier wiped: persisted {acked_remote}, resumed {resumed}"
                )
    assert cases >= 1
    assert failures == [], "\n".join(failures)


EVERY_KIND = [
    # The local commit (its every call is in tests/test_crash_matrix.py already):
    # a data file, the rename, the tracker.
    ("local", "write", "first"),
    ("local", "rename", "last"),
    ("local", "replace", "last"),
    # The copy: the first and the last call of each kind.
    *[
        ("persistent", name, which)
        for name in ("mkdir", "create", "write", "fsync", "close", "fsync_dir", "rename", "replace")
        for which in ("first", "last")
    ],
]


def test_one_rank_killed_at_each_kind_of_call_persistent_dir(tmp_path: Path) -> None:
    """The local commit (a data file, the rename, the tracker) and every kind of
    call of the copy, its first and its last (data files, manifest, rename,
    tracker on the other tier)."""
    _matrix(tmp_path, 1, lambda b: str(b / "remote"), None, {0: EVERY_KIND})


def test_one_rank_killed_while_persisting_to_s3(tmp_path: Path, s3: Any) -> None:
    """Before each object of the copy completes: data file, manifest, the commit
    marker, the tracker."""
    root, opts, _ = s3
    picks = {0: [("local", "rename", "last"), ("persistent", "close", "all")]}
    _matrix(tmp_path, 1, lambda b: f"{root}/{b.name}", opts, picks)


def test_two_ranks_killed_during_the_local_commit_and_persisting(tmp_path: Path) -> None:
    picks: dict[int, list[Pick]] = {
        0: [
            ("local", "rename", "last"),  # rank 0's local commit
            ("persistent", "rename", "last"),  # the copy's commit
        ],
    }
    _matrix(tmp_path, 2, lambda b: str(b / "remote"), None, picks)


def test_two_ranks_killed_while_persisting_to_s3(tmp_path: Path, s3: Any) -> None:
    root, opts, _ = s3
    picks = {0: [("persistent", "close", "first")]}  # the first object of the copy
    _matrix(tmp_path, 2, lambda b: f"{root}/{b.name}", opts, picks)


def test_two_nodes_killed_during_the_local_commit_and_persisting(tmp_path: Path) -> None:
    """``Tier(local_scope="rank")``: the ranks' local roots are different
    directories (two nodes); rank 1 killed during its own local commit and during
    its own copy to the persistent tier; then node 1 replaced. (The S3 copy of
    node-local parts is the same code with the marker commit: tested without a
    kill in tests/test_tiers_nodelocal.py, to keep the suite short.)"""
    picks: dict[int, list[Pick]] = {
        1: [("local", "rename", "last"), ("persistent", "write", "first")],
    }
    _matrix(tmp_path, 2, lambda b: str(b / "remote"), None, picks, "rank")
