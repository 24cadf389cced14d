"""Writing while staging (``overlap_writes``, issue 11's time to durable).

A whole save of host tensors can have its data files written while its snapshot
is still copied into the staging memory: each file's writer follows the copy,
which takes a step of each file in turn (seen here through
``asyncsave.testing.staging_steps``). Lazy saves do it by default, eager ones with
``overlap_writes=True``. These tests pin what that must keep: the writes really
start before the snapshot is whole; no byte is written before it is staged (every
dtype, blobs, pieces of large tensors, on one process and on two ranks); a
failed, cancelled or timed-out staging is the save's error, stops the writers and
leaves nothing behind; a failed write is the save's error; and a save that an
earlier one is still ahead of is staged, then written, as before.

Small steps and chunks (``small_steps``) make a state of a few MiB take many
steps, so the overlap happens in every test.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import anyio.from_thread
import pytest
import torch
from distributed import run_ranks, values
from faults import FaultyFS, block, pause, raise_errno
from hypothesis import HealthCheck, given, settings
from test_aliasing import aliasing_layouts, assert_round_trip
from test_incremental import assert_equal_tree

import asyncsave
from asyncsave import LocalFileSystem
from asyncsave.testing import staging_released, staging_steps, thresholds

TRACKER = "latest_checkpointed_iteration.txt"
WAIT_S = 10.0  # how long a hook waits for what must happen concurrently
STEP = 64 << 10  # staging step and write chunk in these tests (bytes)


def small_sizes() -> contextlib.AbstractContextManager[None]:
    """Every save of host tensors follows, in steps and chunks of ``STEP``, in
    two data files (of about 1 MiB each)."""
    return thresholds(
        follow_min_bytes=0, follow_piece_bytes=STEP, chunk_bytes=STEP, min_file_bytes=1 << 20
    )


@pytest.fixture
def small_steps() -> Iterator[None]:
    with small_sizes():
        yield


@pytest.fixture
def hooks() -> Iterator[contextlib.ExitStack]:
    """Hooks of ``asyncsave.testing`` entered by a test, left at its end."""
    with contextlib.ExitStack() as stack:
        yield stack


def state_of(seed: int = 0) -> dict[str, Any]:
    """About 2.3 MiB: large tensors (copied in pieces), a bf16 matrix, a
    transposed view (not contiguous: copied whole), two views of one storage (a
    blob), bool, int8, complex, an empty tensor, a 0-d tensor, a plain int."""
    g = torch.Generator().manual_seed(seed)
    shared = torch.randn(40_000, generator=g)
    return {
        "big": torch.randn(300_000, generator=g),
        "bf16": torch.randn(512, 256, generator=g).to(torch.bfloat16),
        "t": torch.randn(128, 300, generator=g).t(),
        "a": shared[:30_000],
        "b": shared[10_000:],
        "mask": torch.rand(70_001, generator=g) > 0.5,
        "i8": torch.randint(-128, 127, (50_003,), dtype=torch.int8, generator=g),
        "c": torch.randn(9_000, dtype=torch.complex64, generator=g),
        "empty": torch.empty(0, 3),
        "scalar": torch.tensor(2.5),
        "step": 7,
    }


def temp_dirs(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir() if p.name.startswith(".asyncsave-"))


class DataWrites(LocalFileSystem):
    """Sets ``data`` at the first write of a data file's bytes (not its header)."""

    def __init__(self) -> None:
        self.data = threading.Event()
        self._writes: dict[int, int] = {}  # data file fd -> writes so far
        self._direct: set[int] = set()

    def create(self, path: Path) -> int:
        fd = super().create(path)
        if path.name.startswith("data-"):
            self._writes[fd] = 0
        return fd

    def open_direct(self, path: Path) -> int | None:
        fd = super().open_direct(path)
        if fd is not None:
            self._direct.add(fd)
        return fd

    def write(self, fd: int, data: memoryview) -> int:
        n = super().write(fd, data)
        if fd in self._direct:
            self.data.set()
        elif fd in self._writes:
            self._writes[fd] += 1
            if self._writes[fd] >= 2:  # the header is the first
                self.data.set()
        return n

    def close(self, fd: int) -> None:
        self._writes.pop(fd, None)
        self._direct.discard(fd)
        super().close(fd)


def hook_advance(hooks: contextlib.ExitStack, after: Any) -> list[int]:
    """Call ``after(n)`` after the n-th (1-based) step of any followed copy, in
    the copying thread; returns the list of files each step staged, in order."""
    advanced: list[int] = []

    def step(index: int) -> None:
        advanced.append(index)
        after(len(advanced))

    hooks.enter_context(staging_steps(step))
    return advanced


@pytest.mark.anyio
@pytest.mark.usefixtures("small_steps")
@pytest.mark.parametrize("apart", [False, True], ids=["hashed-inline", "hashed-apart"])
@pytest.mark.parametrize("lazy", [False, True], ids=["eager", "lazy"])
async def test_a_file_is_written_before_its_snapshot_is_whole(
    tmp_path: Path, hooks: contextlib.ExitStack, lazy: bool, apart: bool
) -> None:
    """After the copy's first step, the copy waits (in its thread) until a data
    file's bytes are written: that can only happen if a writer follows the copy.
    Eager saves need ``overlap_writes=True``, lazy ones follow by default. Both
    paths of the writer (checksums inline, or by a helper thread for a large
    ``O_DIRECT`` file) follow."""
    if apart:
        hooks.enter_context(thresholds(hash_apart_bytes=0))
    fs = DataWrites()
    seen: list[bool] = []

    def after(n: int) -> None:
        if n == 1:
            seen.append(fs.data.wait(WAIT_S))

    advanced = hook_advance(hooks, after)
    state = state_of()
    async with asyncsave.Checkpointer(
        tmp_path, filesystem=fs, overlap_writes=None if lazy else True
    ) as ckpt:
        info = await (await ckpt.save(1, state, lazy=lazy))
    assert seen == [True]
    assert set(advanced) == {0, 1}  # both files followed, in turns
    assert advanced[:2] == [0, 1]
    assert info is not None
    assert_equal_tree(asyncsave.load(info.path), state)
    asyncsave.verify(info.path)
    assert temp_dirs(tmp_path) == []


@pytest.mark.anyio
@pytest.mark.usefixtures("small_steps")
@pytest.mark.parametrize(
    ("overlap", "lazy", "follows"),
    [
        (None, False, False),
        (None, True, True),
        (True, False, True),
        (False, True, False),
        (False, False, False),
    ],
)
async def test_which_saves_follow(
    tmp_path: Path, hooks: contextlib.ExitStack, overlap: bool | None, lazy: bool, follows: bool
) -> None:
    """``overlap_writes``: ``None`` follows lazy saves only, ``True`` every save,
    ``False`` none; a save that does not follow is staged, then written, and the
    bytes are the same either way."""
    advanced = hook_advance(hooks, lambda n: None)
    state = state_of(1)
    async with asyncsave.Checkpointer(tmp_path, overlap_writes=overlap) as ckpt:
        info = await (await ckpt.save(1, state, lazy=lazy))
    assert bool(advanced) == follows
    assert info is not None
    assert_equal_tree(asyncsave.load(info.path), state)


@pytest.mark.anyio
async def test_small_states_gpu_states_streamed_and_object_store_saves_do_not_follow(
    tmp_path: Path, hooks: contextlib.ExitStack
) -> None:
    """Below ``FOLLOW_MIN_BYTES`` (the copy takes under 2 ms: nothing to
    overlap) and for a state streamed through a smaller budget, the save is
    staged, then written."""
    advanced = hook_advance(hooks, lambda n: None)
    state = state_of(2)  # 2.3 MiB, under the default 16 MiB
    async with asyncsave.Checkpointer(tmp_path / "a", overlap_writes=True) as ckpt:
        await (await ckpt.save(1, state))
    hooks.enter_context(thresholds(follow_min_bytes=0))
    async with asyncsave.Checkpointer(
        tmp_path / "b", overlap_writes=True, budget_bytes=1 << 20
    ) as ckpt:
        info = await (await ckpt.save(1, state))
    assert advanced == []
    assert info is not None
    assert_equal_tree(asyncsave.load(info.path), state)


@settings(
    max_examples=max(60, settings.default.max_examples // 3),
    deadline=None,
    suppress_health_check=[
        HealthCheck.too_slow,
        HealthCheck.data_too_large,
        HealthCheck.function_scoped_fixture,
    ],
)
@given(layout=aliasing_layouts())
def test_random_layouts_round_trip_when_written_while_staged(
    layout: tuple[dict[str, Any], dict[str, Any]],
) -> None:
    """The aliasing fuzzer's states (slices, strides, dtype reinterpretations,
    shared storages: blobs), written while staged in steps of 16 bytes, every
    step delayed a little so the writers would run ahead if they could: every
    byte comes back, and tensors that shared memory share it again."""
    state, how = layout
    with (
        thresholds(follow_min_bytes=0, follow_piece_bytes=16, chunk_bytes=4096),
        staging_steps(lambda index: threading.Event().wait(0.0005)),
        tempfile.TemporaryDirectory() as tmp,
    ):
        with asyncsave.SyncCheckpointer(
            Path(tmp), budget_bytes=how["budget_bytes"], overlap_writes=True
        ) as ckpt:
            info = ckpt.save(1, state, lazy=how["lazy"]).result()
        assert info is not None
        assert_round_trip(state, asyncsave.load(info.path))
        asyncsave.verify(info.path)


class CopyFails(RuntimeError):
    pass


@pytest.mark.anyio
@pytest.mark.usefixtures("small_steps")
@pytest.mark.parametrize("lazy", [False, True], ids=["eager", "lazy"])
async def test_a_failed_copy_is_the_saves_error_and_stops_the_writers(
    tmp_path: Path,
    hooks: contextlib.ExitStack,
    caplog: pytest.LogCaptureFixture,
    lazy: bool,
) -> None:
    """The copy fails after its third step, while the writers follow it: the
    save fails with the copy's error (not the writers' "staging ended early"),
    nothing is logged about the writers, no temporary directory is left, step 1
    is intact, and (eager) the checkpointer saves step 3."""
    state = state_of(3)
    ckpt = asyncsave.Checkpointer(tmp_path, overlap_writes=True)
    async with contextlib.AsyncExitStack() as stack:
        if lazy:  # a lazy save's staging failure is raised by close too (never lost)
            stack.enter_context(pytest.raises(asyncsave.SaveFailedError, match="step 2"))
        await stack.enter_async_context(ckpt)
        await (await ckpt.save(1, state))
        fail = [True]

        def after(n: int) -> None:
            if n == 3 and fail[0]:
                fail[0] = False
                raise CopyFails("a source tensor could not be read")

        hook_advance(hooks, after)
        caplog.set_level(logging.WARNING, logger="asyncsave")
        if lazy:
            handle = await ckpt.save(2, state, lazy=True)
            with pytest.raises(asyncsave.SaveFailedError) as info:
                await handle
            assert isinstance(info.value.__cause__, CopyFails)
        else:
            with pytest.raises(CopyFails):
                await ckpt.save(2, state)
            assert temp_dirs(tmp_path) == []  # eager: gone when save() raises
            await (await ckpt.save(3, state))
        assert not [r for r in caplog.records if "early writes" in r.getMessage()]
    assert temp_dirs(tmp_path) == []
    assert_equal_tree(asyncsave.load(tmp_path / "step_1"), state)
    assert not (tmp_path / "step_2").exists()
    if not lazy:
        asyncsave.verify(tmp_path / "step_3")


@pytest.mark.anyio
@pytest.mark.usefixtures("small_steps")
@pytest.mark.parametrize("op", ["write", "fsync", "create"])
async def test_a_failed_write_while_staging_is_the_saves_error(tmp_path: Path, op: str) -> None:
    """A data file's write, fsync or creation fails (disk full) while its save
    is still staged: ``save()`` returns (the snapshot is whole), the handle
    raises :class:`SaveFailedError` with the ``OSError`` as its cause, the
    checkpointer refuses further saves with that error (docs/decisions.md), no
    temporary directory is left, and a new one resumes step 1."""
    fs = FaultyFS(
        op,
        raise_errno(errno.ENOSPC),
        n=1 if op == "create" else 2,  # a write: the header is the first
        where=lambda p: ".asyncsave-tmp-2-" in p and "/data-" in p,
    )
    state = state_of(4)
    with pytest.raises(asyncsave.SaveFailedError) as at_close:
        async with asyncsave.Checkpointer(tmp_path, filesystem=fs, overlap_writes=True) as ckpt:
            await (await ckpt.save(1, state))
            handle = await ckpt.save(2, state)
            with pytest.raises(asyncsave.SaveFailedError) as info:
                await handle
            cause = info.value.__cause__
            assert isinstance(cause, OSError) and cause.errno == errno.ENOSPC, info.value
            with pytest.raises(asyncsave.SaveFailedError) as again:
                await ckpt.save(3, state)
            assert again.value is info.value
    assert at_close.value is info.value
    assert fs.fired.is_set()
    assert temp_dirs(tmp_path) == []
    assert not (tmp_path / "step_2").exists()
    async with asyncsave.Checkpointer(tmp_path, overlap_writes=True) as ckpt:
        restored = await ckpt.load_latest()
        assert restored is not None and restored.info.step == 1
        assert_equal_tree(restored.state, state)
        await (await ckpt.save(2, state))
    asyncsave.verify(tmp_path / "step_2")


@pytest.mark.anyio
@pytest.mark.usefixtures("small_steps")
async def test_a_save_cancelled_while_staging_leaves_nothing(
    tmp_path: Path, hooks: contextlib.ExitStack
) -> None:
    """The caller of an eager save is cancelled during the copy: the copy
    finishes (host copies are never abandoned), the writers stop at their next
    chunk instead of writing the cancelled save to its end (each chunk write is
    slowed here, so that they would still be writing), the temporary directory
    goes, and the checkpointer saves the same step after."""
    scope = anyio.CancelScope()
    token: list[Any] = []

    def after(n: int) -> None:
        if n == 2 and token:
            anyio.from_thread.run_sync(scope.cancel, token=token.pop())

    hook_advance(hooks, after)
    fs = SlowDataWrites()
    state = state_of(5)
    async with asyncsave.Checkpointer(tmp_path, filesystem=fs, overlap_writes=True) as ckpt:
        token.append(anyio.lowlevel.current_token())
        with scope:
            await ckpt.save(1, state)
        assert scope.cancelled_caught
        assert temp_dirs(tmp_path) == []
        stopped_after = fs.chunks
        fs.delay_s = 0.0
        info = await (await ckpt.save(1, state))
    total = fs.chunks - stopped_after  # the chunks of a whole save
    assert stopped_after < total / 2, (stopped_after, total)
    assert info is not None
    assert_equal_tree(asyncsave.load(info.path), state)


class SlowDataWrites(DataWrites):
    """Counts the chunk writes of data files (not headers), each delayed."""

    delay_s = 0.02

    def __init__(self) -> None:
        super().__init__()
        self.chunks = 0

    def write(self, fd: int, data: memoryview) -> int:
        data_chunk = fd in self._direct or self._writes.get(fd, 0) >= 1
        if data_chunk and len(data) >= 4096:
            threading.Event().wait(self.delay_s)
            self.chunks += 1
        return super().write(fd, data)


@pytest.mark.anyio
@pytest.mark.usefixtures("small_steps")
async def test_a_save_behind_a_pending_one_is_staged_then_written(
    tmp_path: Path, hooks: contextlib.ExitStack
) -> None:
    """While step 1's commit (its rename) hangs, step 2 is saved: it does not
    follow (its writes would compete with step 1's commit for the writer
    threads); both commit once step 1 goes on."""
    gate = threading.Event()
    fs = FaultyFS("rename", pause(gate), where=lambda p: p.endswith("step_1"))
    advanced = hook_advance(hooks, lambda n: None)
    state = state_of(6)
    async with asyncsave.Checkpointer(tmp_path, filesystem=fs, overlap_writes=True) as ckpt:
        try:
            first = await ckpt.save(1, state)
            assert await anyio.to_thread.run_sync(fs.fired.wait, WAIT_S)
            follows_first = len(advanced)
            second = await ckpt.save(2, state)
            assert len(advanced) == follows_first  # step 2 did not follow
        finally:
            gate.set()  # (before close waits for step 1)
        await first
        await second
    assert follows_first > 0
    for step in (1, 2):
        assert_equal_tree(asyncsave.load(tmp_path / f"step_{step}"), state)


@pytest.mark.anyio
@pytest.mark.usefixtures("small_steps")
async def test_a_stuck_write_while_staging_is_a_timeout_of_the_save(tmp_path: Path) -> None:
    """A data file's write hangs (a dead NFS server) while its save is staged:
    the save fails with :class:`CheckpointTimeoutError` naming step 2 once
    ``save_timeout_s`` passed after the staging, step 1 stays tracked, and the
    staging memory the abandoned thread may still read is never leased again
    (the next save fails, typed)."""
    release = threading.Event()
    fs = FaultyFS("write", block(release), n=2, where=lambda p: "-tmp-2-" in p and "/data-" in p)
    state = state_of(7)
    try:
        with pytest.raises(asyncsave.SaveFailedError):
            async with asyncsave.Checkpointer(
                tmp_path, filesystem=fs, save_timeout_s=1.0, overlap_writes=True
            ) as ckpt:
                await (await ckpt.save(1, state))
                handle = await ckpt.save(2, state)
                with (
                    anyio.fail_after(WAIT_S),
                    pytest.raises(asyncsave.CheckpointTimeoutError) as caught,
                ):
                    await handle
                assert caught.value.step == 2
                with pytest.raises(asyncsave.SaveFailedError):
                    await (await ckpt.save(3, state))
    finally:
        release.set()  # the abandoned writer thread ends (with EIO)
    assert fs.fired.is_set()
    assert not (tmp_path / "step_2").exists() and not (tmp_path / "step_3").exists()
    assert (tmp_path / TRACKER).read_text() == "1"


def test_overlap_writes_must_be_none_or_a_bool() -> None:
    with pytest.raises(ValueError, match="overlap_writes='yes'"):
        asyncsave.CheckpointOptions(overlap_writes="yes")  # type: ignore[arg-type]


# -- two ranks -----------------------------------------------------------------------


def _ranks_follow(rank: int, world: int, root: str, fail_rank: int | None) -> dict[str, Any]:
    advanced: list[int] = []
    fail_at: list[int | None] = [None]  # the step of the copy that fails (of step 2)

    def step(index: int) -> None:
        advanced.append(index)
        if len(advanced) == fail_at[0]:
            raise CopyFails(f"rank {rank}: a source tensor could not be read")

    state = state_of(10 + rank)
    seen: dict[str, Any] = {}

    async def main() -> None:
        ckpt = asyncsave.Checkpointer(root, dist_timeout_s=60)
        try:
            async with ckpt:
                await (await ckpt.save(1, state, lazy=True))
                followed = len(advanced)
                if rank == fail_rank:
                    fail_at[0] = followed + 3
                handle = await ckpt.save(2, state, lazy=True)
                try:
                    await handle
                    seen["step2"] = "committed"
                except asyncsave.RankFailedError as exc:
                    seen["step2"] = sorted(exc.ranks)
                except asyncsave.SaveFailedError as exc:
                    seen["step2"] = type(exc.__cause__).__name__
                # Step 2, saved as soon as step 1's handle resolved, followed too.
                seen["followed"] = followed > 0 and len(advanced) > followed
        except asyncsave.SaveFailedError as exc:  # a lazy save's failure: at close too
            seen["close"] = type(exc.__cause__).__name__
        async with asyncsave.Checkpointer(root, dist_timeout_s=60) as ckpt:
            restored = await ckpt.load_latest()
            assert restored is not None
            assert_equal_tree(restored.state, state)
            seen["resumed"] = restored.info.step

    with small_sizes(), staging_steps(step):
        anyio.run(main)
    return seen


@pytest.mark.parametrize("fail_rank", [None, 1], ids=["ok", "rank-1-copy-fails"])
def test_two_ranks_write_while_staging(tmp_path: Path, fail_rank: int | None) -> None:
    """Lazy saves on two ranks follow the staging, each rank into a directory of
    its own, moved into the shared temporary directory in the save's turn:
    every rank's bytes come back. A copy that fails on rank 1 fails step 2 on
    both ranks (rank 0 names rank 1) and leaves no directory behind."""
    root = tmp_path / "run"
    seen = values(run_ranks(_ranks_follow, 2, tmp_path, str(root), fail_rank))
    for rank, s in enumerate(seen):
        assert s["followed"] and s["resumed"] == (2 if fail_rank is None else 1), s
        if fail_rank is None:
            assert s["step2"] == "committed"
        elif rank == fail_rank:
            assert s["step2"] in ("CopyFails", [1]), s
        else:
            assert s["step2"] == [1], s
    assert temp_dirs(root) == []
    names = sorted(p.name for p in (root / "step_1").iterdir())
    assert [n for n in names if n.startswith("data-")] == [
        "data-r00000-000.safetensors",
        "data-r00000-001.safetensors",
        "data-r00001-000.safetensors",
        "data-r00001-001.safetensors",
    ]
    for step in (1, 2) if fail_rank is None else (1,):
        asyncsave.verify(root / f"step_{step}")
    assert (root / "step_2").exists() == (fail_rank is None)


class OpenDataFiles:
    """The data files a file system has open (created, not yet closed): a
    mixin over a ``LocalFileSystem`` class (:meth:`of`)."""

    open_data: set[int]

    @staticmethod
    def of(base: type) -> Any:
        class Tracked(base):  # type: ignore[misc, valid-type]
            def __init__(self, *args: Any, **kwargs: Any) -> None:
                super().__init__(*args, **kwargs)
                self.open_data: set[int] = set()

            def create(self, path: Path) -> int:
                fd = super().create(path)
                if path.name.startswith("data-"):
                    self.open_data.add(fd)
                return fd

            def open_direct(self, path: Path) -> int | None:
                fd = super().open_direct(path)
                if fd is not None:
                    self.open_data.add(fd)
                return fd

            def close(self, fd: int) -> None:
                super().close(fd)
                self.open_data.discard(fd)

        return Tracked


def _phase_a_fails(rank: int, world: int, root: str) -> dict[str, Any]:
    """Rank 0 cannot make step 2's shared temporary directory (phase A) while
    rank 1 still writes step 2's files into its own (slowed chunk writes)."""
    fs: LocalFileSystem
    if rank == 0:  # step 2's mkdirs: its own directory (staging), then the shared one
        fs = OpenDataFiles.of(FaultyFS)(
            "mkdir", raise_errno(errno.EIO), n=2, where=lambda p: "-tmp-2-" in p
        )
    else:
        fs = OpenDataFiles.of(SlowDataWrites)()
        fs.delay_s = 0.0
    released_while_writing: list[int] = []
    releases: list[int] = []

    def released() -> None:  # the staging memory goes back: no data file still written
        releases.append(len(fs.open_data))  # type: ignore[attr-defined]
        if fs.open_data:  # type: ignore[attr-defined]
            released_while_writing.append(rank)

    state = state_of(20 + rank)
    seen: dict[str, Any] = {}

    async def main() -> None:
        try:
            async with asyncsave.Checkpointer(root, dist_timeout_s=60, filesystem=fs) as ckpt:
                await (await ckpt.save(1, state, lazy=True))
                if isinstance(fs, SlowDataWrites):
                    fs.delay_s = 0.05
                try:
                    await (await ckpt.save(2, state, lazy=True))
                    seen["step2"] = "committed"
                except asyncsave.RankFailedError as exc:
                    seen["step2"] = sorted(exc.ranks)
        except asyncsave.SaveFailedError:
            pass  # the same failure, raised again at close
        seen["released_while_writing"] = released_while_writing
        seen["releases"] = len(releases)

    with small_sizes(), staging_released(released):
        anyio.run(main)
    return seen


def test_two_ranks_a_rank_failing_before_the_write_waits_for_the_early_writes(
    tmp_path: Path,
) -> None:
    """Step 2 fails in phase A (rank 0's shared temporary directory) while rank 1
    is still writing its files into its own directory: rank 1 stops them and
    waits for them before it releases the staging memory and removes its
    directory; both ranks name rank 0; nothing is left behind."""
    root = tmp_path / "run"
    seen = values(run_ranks(_phase_a_fails, 2, tmp_path, str(root)))
    assert [s["step2"] for s in seen] == [[0], [0]], seen
    assert [s["released_while_writing"] for s in seen] == [[], []], seen
    assert all(s["releases"] >= 2 for s in seen), seen  # steps 1 and 2 released
    assert temp_dirs(root) == []
    assert not (root / "step_2").exists()
    asyncsave.verify(root / "step_1")


@pytest.mark.anyio
@pytest.mark.usefixtures("small_steps")
async def test_a_later_save_does_not_keep_an_earlier_one_from_following(
    tmp_path: Path, hooks: contextlib.ExitStack
) -> None:
    """Two lazy saves back to back: step 2 is pending before step 1 stages.
    Step 1 follows (only saves dispatched before it count); step 2, behind an
    unfinished step 1, does not."""
    advanced = hook_advance(hooks, lambda n: None)
    state = state_of(9)
    async with asyncsave.Checkpointer(tmp_path) as ckpt:
        first = await ckpt.save(1, state, lazy=True)
        second = await ckpt.save(2, state, lazy=True)
        assert 2 in ckpt.pending_steps
        await first.staged()
        steps_of_first = len(advanced)
        await first
        await second
    assert steps_of_first > 0  # step 1 followed
    assert len(advanced) == steps_of_first  # step 2 did not
    for step in (1, 2):
        assert_equal_tree(asyncsave.load(tmp_path / f"step_{step}"), state)


class HeldDataWrites(LocalFileSystem):
    """Every write of a data file waits until ``gate`` is set."""

    def __init__(self) -> None:
        self.gate = threading.Event()
        self.waiting = threading.Event()
        self._data: set[int] = set()

    def create(self, path: Path) -> int:
        fd = super().create(path)
        if path.name.startswith("data-"):
            self._data.add(fd)
        return fd

    def open_direct(self, path: Path) -> int | None:
        fd = super().open_direct(path)
        if fd is not None:
            self._data.add(fd)
        return fd

    def write(self, fd: int, data: memoryview) -> int:
        if fd in self._data:
            self.waiting.set()
            self.gate.wait(60)
        return super().write(fd, data)

    def close(self, fd: int) -> None:
        self._data.discard(fd)
        super().close(fd)


@pytest.mark.anyio
@pytest.mark.usefixtures("small_steps")
@pytest.mark.parametrize("writer_threads", [1, 2, 3])
async def test_the_saves_turn_starts_while_its_files_are_written(
    tmp_path: Path, writer_threads: int
) -> None:
    """The writers of a save written while staged hold threads until their data
    is durable: not the pipeline's, so the save's turn (its temporary directory,
    agreed by the ranks) starts meanwhile, off the path to durable (it waited
    for the writes before: 5-10 ms per save on 2 ranks)."""
    fs = HeldDataWrites()
    state = state_of(3)
    async with asyncsave.Checkpointer(
        tmp_path, filesystem=fs, writer_threads=writer_threads
    ) as ckpt:
        handle = await ckpt.save(1, state, lazy=True)
        try:
            with anyio.fail_after(WAIT_S):
                await anyio.to_thread.run_sync(fs.waiting.wait)
                # the rank's own directory, then the save's, every write held
                while len(temp_dirs(tmp_path)) < 2:
                    await anyio.sleep(0.005)
            assert not handle.done()
        finally:
            fs.gate.set()
        info = await handle
    assert info is not None
    assert_equal_tree(asyncsave.load(info.path), state)
    assert temp_dirs(tmp_path) == []
