"""asyncsave.dcp.StorageWriter across saves (issue 10, S20 and item 8).

- The tracker moves forward only, whatever the order in which overlapping writers
  finish: threads (``dcp.async_save``) and processes, with the order forced by
  pausing each writer's tracker update (``GatedFS``) and released in every order.
- One writer object commits step after step (as trainers keep one writer).
- DCP's plan caching, the reader's layout, ``Metadata.storage_meta``, and refusals
  that leave nothing behind.
"""

from __future__ import annotations

import errno
import multiprocessing as mp
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.distributed.checkpoint import DefaultSavePlanner
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.planner import SavePlanner

import asyncsave
from asyncsave import LocalFileSystem
from asyncsave.dcp import StorageReader, StorageWriter

sys.path.insert(0, str(Path(__file__).parent))
from distributed import run_ranks, values

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")

TRACKER = "latest_checkpointed_iteration.txt"
WAIT_S = 60.0  # bound of every wait in these tests (never reached when they pass)


def state_of(step: int) -> dict[str, Any]:
    return {"w": torch.full((8,), float(step)), "meta": {"step": step}}


def template() -> dict[str, Any]:
    return {"w": torch.zeros(8), "meta": {"step": -1}}


def tracked(root: Path, name: str = TRACKER) -> int:
    return int((root / name).read_text())


def leftovers(root: Path) -> list[str]:
    """Temporary directories and files asyncsave left in ``root``."""
    return sorted(p.name for p in root.iterdir() if p.name.startswith(".asyncsave-tmp-"))


def loaded_step(path: Path, **reader: Any) -> int:
    out = template()
    dcp.load(out, storage_reader=StorageReader(path, **reader), no_dist=True)
    assert torch.equal(out["w"], torch.full((8,), float(out["meta"]["step"])))
    return int(out["meta"]["step"])


class GatedFS(LocalFileSystem):
    """A writer's file system that pauses its tracker update until ``gate`` opens.

    ``arrived`` is set when the writer reaches the tracker update, or when it is
    refused the root's lock (another writer holds it); ``refused`` only then. The
    events are ``threading.Event`` or ``multiprocessing`` events."""

    def __init__(self, gate: Any, arrived: Any, refused: Any) -> None:
        self.gate, self.arrived, self.refused = gate, arrived, refused

    def replace(self, src: Path, dst: Path) -> None:
        if dst.name == TRACKER:
            self.arrived.set()
            if not self.gate.wait(WAIT_S):
                raise TimeoutError("the test never opened this writer's gate")
        super().replace(src, dst)

    def lock(self, path: Path) -> int | None:
        fd = super().lock(path)
        if fd is None:
            self.refused.set()
            self.arrived.set()
        return fd


def _wait_for(cond: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.002)


def release_in_order(
    order: list[int],
    gates: dict[int, Any],
    arrived: dict[int, Any],
    refused: dict[int, Any],
    done: Callable[[int], bool],
) -> None:
    """Wait until every writer is at its tracker update (or waits for the root's
    lock), then let them go one by one in ``order``: each one's update runs to its
    end (or the writer is known to wait for the lock) before the next is let go."""
    _wait_for(lambda: all(e.is_set() for e in arrived.values()), "every writer to arrive")
    for step in order:
        gates[step].set()
        _wait_for(lambda s=step: done(s) or refused[s].is_set(), f"writer {step}")  # type: ignore[misc]


# -- S20: threads ---------------------------------------------------------------


@settings(max_examples=40, deadline=None)
@given(
    steps=st.lists(st.integers(1, 60), min_size=2, max_size=4, unique=True),
    data=st.data(),
)
def test_tracker_moves_forward_only_whatever_order_async_saves_finish(
    tmp_path_factory: pytest.TempPathFactory, steps: list[int], data: st.DataObject
) -> None:
    root = tmp_path_factory.mktemp("root")
    order = data.draw(st.permutations(steps), label="order in which tracker updates go")
    gates = {s: threading.Event() for s in steps}
    arrived = {s: threading.Event() for s in steps}
    refused = {s: threading.Event() for s in steps}
    futures: dict[int, Future[Any]] = {}
    try:
        for s in steps:
            fs = GatedFS(gates[s], arrived[s], refused[s])
            futures[s] = dcp.async_save(
                state_of(s), storage_writer=StorageWriter(root, s, filesystem=fs), no_dist=True
            )
        release_in_order(order, gates, arrived, refused, lambda s: futures[s].done())
    finally:
        for g in gates.values():
            g.set()  # never leave a writer waiting (on failure too)
        for f in futures.values():
            f.exception(timeout=WAIT_S)
    for f in futures.values():
        f.result()
    assert tracked(root) == max(steps)
    assert asyncsave.latest(root).step == max(steps)  # type: ignore[union-attr]
    for s in steps:
        assert loaded_step(root / f"step_{s}") == s
    assert leftovers(root) == []


def test_overlapping_async_saves_of_steps_2_then_3_leave_the_tracker_at_3(tmp_path: Path) -> None:
    """The issue's scenario, unforced: 40 rounds of two overlapping async saves."""
    for r in range(40):
        root = tmp_path / f"round{r}"
        first = dcp.async_save(state_of(2), storage_writer=StorageWriter(root, 2), no_dist=True)
        second = dcp.async_save(state_of(3), storage_writer=StorageWriter(root, 3), no_dist=True)
        first.result(timeout=WAIT_S)
        second.result(timeout=WAIT_S)
        assert tracked(root) == 3, f"round {r}"
        assert loaded_step(root) == 3


# -- S20: processes ---------------------------------------------------------------


def _save_in_child(root: str, step: int, gate: Any, arrived: Any, refused: Any) -> None:
    torch.set_num_threads(1)
    writer = StorageWriter(root, step, filesystem=GatedFS(gate, arrived, refused))
    dcp.save(state_of(step), storage_writer=writer, no_dist=True)


@pytest.mark.slow
@pytest.mark.parametrize("order", [[2, 3], [3, 2]], ids=["2-then-3", "3-then-2"])
def test_processes_finishing_in_either_order_move_the_tracker_forward_only(
    tmp_path: Path, order: list[int]
) -> None:
    ctx = mp.get_context("spawn")
    gates = {s: ctx.Event() for s in order}
    arrived = {s: ctx.Event() for s in order}
    refused = {s: ctx.Event() for s in order}
    procs = {
        s: ctx.Process(
            target=_save_in_child, args=(str(tmp_path), s, gates[s], arrived[s], refused[s])
        )
        for s in order
    }
    try:
        for p in procs.values():
            p.start()
        release_in_order(order, gates, arrived, refused, lambda s: not procs[s].is_alive())
    finally:
        for g in gates.values():
            g.set()
        for p in procs.values():
            p.join(WAIT_S)
            if p.is_alive():
                p.kill()
                p.join(5)
    assert {s: p.exitcode for s, p in procs.items()} == dict.fromkeys(order, 0)
    assert tracked(tmp_path) == 3
    assert loaded_step(tmp_path) == 3 and loaded_step(tmp_path / "step_2") == 2
    assert leftovers(tmp_path) == []


# -- one writer, many saves -------------------------------------------------------


@pytest.mark.parametrize("layout", ["asyncsave", "megatron"])
@pytest.mark.parametrize("how", ["step attribute", "checkpoint_id", "overlapping async_save"])
def test_one_writer_commits_steps_1_2_3(tmp_path: Path, how: str, layout: str) -> None:
    from asyncsave.testing import checkpoint_dir_name

    def name(step: int) -> str:
        return checkpoint_dir_name(layout, step)

    writer = StorageWriter(tmp_path, 1, layout=layout)
    futures = []
    for s in (1, 2, 3):
        if how == "step attribute":
            writer.step = s
            dcp.save(state_of(s), storage_writer=writer, no_dist=True)
        elif how == "checkpoint_id":
            dcp.save(
                state_of(s), storage_writer=writer, checkpoint_id=tmp_path / name(s), no_dist=True
            )
        else:
            futures.append(
                dcp.async_save(
                    state_of(s),
                    storage_writer=writer,
                    checkpoint_id=tmp_path / name(s),
                    no_dist=True,
                )
            )
    for f in futures:
        f.result(timeout=WAIT_S)
    assert tracked(tmp_path) == 3
    for s in (1, 2, 3):
        assert loaded_step(tmp_path / name(s)) == s
    assert loaded_step(tmp_path, layout=layout) == 3
    assert leftovers(tmp_path) == []


def test_a_checkpoint_id_that_is_no_final_name_is_the_root(tmp_path: Path) -> None:
    writer = StorageWriter(tmp_path / "a", 4)
    dcp.save(state_of(4), storage_writer=writer, checkpoint_id=tmp_path / "b", no_dist=True)
    assert loaded_step(tmp_path / "b" / "step_4") == 4
    assert not (tmp_path / "a").exists()


# -- item 8 (a): DCP's plan caching -----------------------------------------------


@pytest.fixture
def plan_cache() -> Iterator[None]:
    """DCP's plan cache is class-level state: empty before and after the test."""
    names = [n for n in vars(SavePlanner) if n.startswith("_cached_")]
    for n in names:
        getattr(SavePlanner, n).clear()
    yield
    for n in names:
        getattr(SavePlanner, n).clear()


@pytest.mark.usefixtures("plan_cache")
@pytest.mark.parametrize("reuse", [False, True], ids=["fresh-writers", "one-writer"])
def test_plan_caching_saves_step_after_step(tmp_path: Path, reuse: bool) -> None:
    writer = StorageWriter(tmp_path, 1)
    for s in (1, 2, 3, 4):
        state = state_of(s)
        if s == 4:
            state["extra"] = torch.ones(2)  # a changed plan after cached ones
        if reuse:
            writer.step = s
        dcp.save(
            state,
            storage_writer=writer if reuse else StorageWriter(tmp_path, s),
            planner=DefaultSavePlanner(enable_plan_caching=True),
            no_dist=True,
        )
    for s in (1, 2, 3, 4):
        assert loaded_step(tmp_path / f"step_{s}") == s
    assert tracked(tmp_path) == 4
    assert leftovers(tmp_path) == []


def _cached_plans_on_two_ranks(rank: int, world: int, root: str) -> bool:
    for s in (1, 2, 3):
        # Each rank writes its own item, so rank 1's cached plan is used too.
        state = {f"w{rank}": torch.full((4,), float(10 * s + rank))}
        dcp.save(
            state,
            storage_writer=StorageWriter(root, s),
            planner=DefaultSavePlanner(enable_plan_caching=True),
        )
    return True


@pytest.mark.slow
@pytest.mark.usefixtures("plan_cache")
def test_plan_caching_on_two_ranks(tmp_path: Path) -> None:
    root = tmp_path / "run"
    assert values(run_ranks(_cached_plans_on_two_ranks, 2, tmp_path, str(root))) == [True, True]
    for s in (1, 2, 3):
        out = {"w0": torch.zeros(4), "w1": torch.zeros(4)}
        dcp.load(out, storage_reader=StorageReader(root / f"step_{s}"), no_dist=True)
        assert torch.equal(out["w0"], torch.full((4,), 10.0 * s))
        assert torch.equal(out["w1"], torch.full((4,), 10.0 * s + 1))
        assert asyncsave.verify(root / f"step_{s}").world_size == 2
    assert tracked(root) == 3
    assert leftovers(root) == []


# -- item 8 (b): the reader's layout --------------------------------------------------


@pytest.mark.parametrize("layout", ["megatron", "verl", "skyrl"])
def test_reader_of_a_root_of_another_layout(tmp_path: Path, layout: str) -> None:
    dcp.save(state_of(5), storage_writer=StorageWriter(tmp_path, 5, layout=layout), no_dist=True)
    assert loaded_step(tmp_path, layout=layout) == 5
    with pytest.raises(asyncsave.CheckpointNotFoundError, match=f"'{layout}'.*layout="):
        StorageReader(tmp_path).read_metadata()
    with pytest.raises(CheckpointException, match=f"'{layout}'.*layout="):
        loaded_step(tmp_path)


def test_reader_refuses_an_unknown_layout() -> None:
    with pytest.raises(ValueError, match="layout='nope'"):
        StorageReader("/r", layout="nope")


# -- item 8 (c): Metadata.storage_meta --------------------------------------------


def test_metadata_records_the_checkpoint_id_and_a_save_id(tmp_path: Path) -> None:
    writer = StorageWriter(tmp_path, 1)
    first = dcp.save(state_of(1), storage_writer=writer, no_dist=True)
    writer.step = 2
    second = dcp.save(state_of(2), storage_writer=writer, no_dist=True)
    third = dcp.save(state_of(3), storage_writer=StorageWriter(tmp_path, 3), no_dist=True)
    ids = []
    for s, md in ((1, first), (2, second), (3, third)):
        meta = md.storage_meta
        assert meta is not None and meta.checkpoint_id == str(tmp_path / f"step_{s}")
        assert meta.save_id
        ids.append(meta.save_id)
        stored = StorageReader(tmp_path / f"step_{s}").read_metadata().storage_meta
        assert stored is not None
        assert (stored.checkpoint_id, stored.save_id) == (meta.checkpoint_id, meta.save_id)
        assert stored.load_id
    assert len(set(ids)) == 3  # one save id per save, also through one writer


# -- item 8 (d): refusals leave nothing behind ------------------------------------


class _CommitsTheStepMeanwhile(LocalFileSystem):
    """While this writer writes its data, another writer commits the same step."""

    def __init__(self, root: Path, step: int) -> None:
        self.root, self.step, self.fired = root, step, False

    def create(self, path: Path) -> int:
        if not self.fired and path.name.startswith("data-"):
            self.fired = True
            other = threading.Thread(
                target=dcp.save,
                args=(state_of(self.step),),
                kwargs={"storage_writer": StorageWriter(self.root, self.step), "no_dist": True},
            )
            other.start()
            other.join(WAIT_S)
        return super().create(path)


class _FullDisk(LocalFileSystem):
    def write(self, fd: int, data: memoryview) -> int:
        raise OSError(errno.ENOSPC, "No space left on device (injected)")


@pytest.mark.parametrize(
    "case", ["step committed before", "step committed meanwhile", "root held", "disk full"]
)
def test_a_refused_or_failed_dcp_save_leaves_no_temporary_directory(
    tmp_path: Path, case: str
) -> None:
    dcp.save(state_of(1), storage_writer=StorageWriter(tmp_path, 1), no_dist=True)
    expect = "exists already"
    holder = None
    if case == "step committed before":
        dcp.save(state_of(2), storage_writer=StorageWriter(tmp_path, 2), no_dist=True)
        writer = StorageWriter(tmp_path, 2)
    elif case == "step committed meanwhile":
        writer = StorageWriter(tmp_path, 2, filesystem=_CommitsTheStepMeanwhile(tmp_path, 2))
    elif case == "root held":
        writer = StorageWriter(tmp_path, 2, lock_timeout_s=0.2)
        holder = asyncsave.SyncCheckpointer(tmp_path)
        holder.__enter__()
        expect = "RootInUseError"
    else:
        writer = StorageWriter(tmp_path, 2, filesystem=_FullDisk())
        expect = "No space left"
    try:
        with pytest.raises(CheckpointException, match=expect):
            dcp.save(
                {"w": torch.zeros(8), "meta": {"step": -2}}, storage_writer=writer, no_dist=True
            )
    finally:
        if holder is not None:
            holder.__exit__(None, None, None)
    assert leftovers(tmp_path) == []
    expected = 1 if case in ("root held", "disk full") else 2
    assert tracked(tmp_path) == expected
    assert loaded_step(tmp_path) == expected  # the committed step is untouched


def test_a_refusal_comes_before_anything_is_written(tmp_path: Path) -> None:
    dcp.save(state_of(1), storage_writer=StorageWriter(tmp_path, 1), no_dist=True)
    seen: list[str] = []

    class Recording(LocalFileSystem):
        def mkdir(self, path: Path) -> None:
            seen.append(path.name)
            super().mkdir(path)

    with pytest.raises(CheckpointException, match=r"exists already"):
        dcp.save(
            state_of(1),
            storage_writer=StorageWriter(tmp_path, 1, filesystem=Recording()),
            no_dist=True,
        )
    assert seen == []


def test_use_collectives_false_is_refused_on_several_ranks(tmp_path: Path) -> None:
    """Every rank would call finish() with its own items only: refused, typed."""
    with pytest.raises(asyncsave.CheckpointError, match="use_collectives=False") as info:
        StorageWriter(tmp_path, 1).set_up_storage_writer(False, rank=1, use_collectives=False)
    assert info.value.rank == 1
    # One process: nothing to coordinate, it commits.
    dcp.save(
        state_of(1), storage_writer=StorageWriter(tmp_path, 1), use_collectives=False, no_dist=True
    )
    assert loaded_step(tmp_path) == 1


# -- S20: one writer, resets of overlapping saves interleaved --------------------


class _PausingWriter(StorageWriter):
    """A writer whose ``reset`` in the thread ``pausing`` stops right after it sets
    the attribute ``pause_on`` until ``resume`` is set: the point where another
    thread's ``reset`` used to overwrite what this one's save then read back."""

    pause_on: Any = None
    pausing: Any = None
    paused: Any = None
    resume: Any = None

    def __setattr__(self, name: str, value: Any) -> None:
        super().__setattr__(name, value)
        if name == self.pause_on and threading.current_thread() is self.pausing:
            self.pausing = None  # once
            self.paused.set()
            if not self.resume.wait(WAIT_S):
                raise TimeoutError("the other save never ended")


@pytest.mark.parametrize(
    "ids",
    [
        ("a/step_2", "a/step_3"),  # the reviewer's: step 2's state committed as step_3
        ("a/step_2", "b/step_2"),  # same step, two roots
        ("a/step_7", "b/step_4"),  # both differ
        ("a", "b/step_4"),  # a root (the writer's step) against a final name
    ],
)
def test_resets_of_overlapping_saves_through_one_writer_keep_their_own_step_and_root(
    tmp_path: Path, ids: tuple[str, str]
) -> None:
    """S20: thread A's ``reset`` is paused after it set the writer's ``step`` (or
    ``root``, for a root); thread B's whole save (reset included) runs meanwhile; then A's save
    must still commit A's own root and step with A's own data."""
    writer = _PausingWriter(tmp_path / "default", 9)
    writer.paused, writer.resume = threading.Event(), threading.Event()
    errors: list[BaseException] = []

    def save(cid: str, value: float) -> None:
        try:
            state = {"w": torch.full((8,), value), "meta": {"step": value}}
            dcp.save(state, checkpoint_id=tmp_path / cid, storage_writer=writer, no_dist=True)
        except BaseException as exc:  # reported below
            errors.append(exc)

    a = threading.Thread(target=save, args=(ids[0], 1.0))
    b = threading.Thread(target=save, args=(ids[1], 2.0))
    writer.pausing, writer.pause_on = a, "step" if "step_" in ids[0] else "root"
    a.start()
    try:
        assert writer.paused.wait(WAIT_S), "thread A's reset never set root or step"
        b.start()
        b.join(WAIT_S)
    finally:
        writer.resume.set()
        a.join(WAIT_S)
    assert errors == []
    for cid, value in zip(ids, (1.0, 2.0), strict=True):
        path = tmp_path / cid
        if "step_" not in cid:
            path = path / "step_9"  # a root: the writer's step
        out = {"w": torch.zeros(8), "meta": {"step": -1.0}}
        dcp.load(out, storage_reader=StorageReader(path), no_dist=True)
        assert out["meta"]["step"] == value and torch.equal(out["w"], torch.full((8,), value))


def test_the_writer_refuses_a_root_that_cannot_move_files(tmp_path: Path) -> None:
    """Each rank writes into a directory of its own and the commit moves every
    rank's files into one: the root's commit protocol cannot do that on an
    object store, so the writer says so at construction, before any write."""
    import fsspec

    layer = asyncsave.FsspecFileSystem(fsspec.filesystem("memory"))
    with pytest.raises(asyncsave.CheckpointError, match="cannot move files") as info:
        asyncsave.dcp.StorageWriter("memory://ckpt", 1, filesystem=layer)
    assert info.value.path is not None and "ckpt" in str(info.value.path)
    asyncsave.dcp.StorageWriter(str(tmp_path), 1)  # a POSIX root: accepted


class _RecordsSync(LocalFileSystem):
    """Records, in order, each rename's source directory and each fsync'd one."""

    def __init__(self) -> None:
        super().__init__()
        self.events: list[tuple[str, str]] = []

    def rename(self, src: Path, dst: Path) -> None:
        super().rename(src, dst)
        self.events.append(("rename-from", str(Path(src).parent)))

    def fsync_dir(self, path: Path) -> None:
        super().fsync_dir(path)
        self.events.append(("fsync", str(path)))


def _gather_on_two_ranks(rank: int, world: int, root: str) -> Any:
    fs = _RecordsSync() if rank == 0 else LocalFileSystem()
    state = {f"w{rank}": torch.full((4,), float(rank))}
    dcp.save(state, storage_writer=StorageWriter(root, 1, filesystem=fs))
    return fs.events if isinstance(fs, _RecordsSync) else []


@pytest.mark.slow
def test_the_files_gathered_from_another_ranks_directory_are_moved_durably(
    tmp_path: Path,
) -> None:
    """Rank 0's commit moves rank 1's files into the directory it renames: both
    directories are fsynced after the moves and before the commit's rename (POSIX
    makes a rename durable only with both parents)."""
    root = tmp_path / "run"
    events, _ = values(run_ranks(_gather_on_two_ranks, 2, tmp_path, str(root)))
    moved_from = {d for kind, d in events if kind == "rename-from" and ".asyncsave-tmp" in d}
    commit = next(
        i for i, (kind, d) in enumerate(events) if kind == "rename-from" and d == str(root)
    )
    assert len(moved_from) == 1, events  # rank 1's own directory
    (other,) = moved_from
    last_move = max(i for i, (kind, d) in enumerate(events) if (kind, d) == ("rename-from", other))
    assert ("fsync", other) in events[last_move:commit], events
    assert leftovers(root) == []
