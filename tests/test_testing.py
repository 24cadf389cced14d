"""``asyncsave.testing``: the helpers the suite uses instead of patching private
modules. Each helper is checked against what it promises, through the public API
only, so that a restructuring that moves the code a helper reaches into fails
here, by name, rather than as a silently weaker test elsewhere."""

from __future__ import annotations

import errno
import threading
from pathlib import Path
from typing import Any

import anyio
import pytest
import torch

import asyncsave
from asyncsave.testing import (
    INCREMENTAL_STEPS,
    INLINE_PLAN_MAX_NODES,
    LAYOUT_NAMES,
    NEWEST_FORMAT_VERSION,
    PHASES,
    FaultyFileSystem,
    background_tasks,
    block,
    checkpoint_dir_name,
    checkpoint_step,
    cli,
    early_copy_made,
    encode_manifest,
    fail_staging,
    gloo_collectives,
    incremental_steps,
    leftover_temp_names,
    listing_reads,
    on_early_copy,
    pause,
    pause_at,
    planning,
    raise_errno,
    snapshot_taken,
    staging_released,
    staging_steps,
    stream_rounds,
    thresholds,
    tracker_file_name,
)

pytestmark = pytest.mark.anyio

HANG_GUARD_S = 60


def state_of(step: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(step)
    return {f"t{i}": torch.randn(4096, generator=g) for i in range(4)} | {"step": step}


def committed(root: Path) -> list[int]:
    return [info.step for info in asyncsave.checkpoints(root)]


# -- the fault-injecting file system ------------------------------------------------

# The operations a plain local save makes, each with a path it makes it on.
SAVE_OPS = {
    "create": lambda p: p.endswith(".safetensors"),
    "write": lambda p: p.endswith(".safetensors"),
    "fsync": lambda p: p.endswith(".safetensors"),
    "mkdir": lambda p: True,
    "fsync_dir": lambda p: True,
    "rename": lambda p: p.endswith("step_1"),
    "replace": lambda p: p.endswith(".txt"),
}


@pytest.mark.parametrize("op", sorted(SAVE_OPS))
@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EIO])
async def test_a_fault_at_any_operation_fails_the_save_with_that_errno(
    tmp_path: Path, op: str, code: int
) -> None:
    fs = FaultyFileSystem(op, raise_errno(code), where=SAVE_OPS[op])
    with anyio.fail_after(HANG_GUARD_S), pytest.raises(asyncsave.SaveFailedError) as failed:
        async with asyncsave.Checkpointer(tmp_path, filesystem=fs) as ckpt:
            await (await ckpt.save(1, state_of(1)))
    assert fs.fired.is_set() and fs.seen >= 1
    cause = failed.value.__cause__
    assert isinstance(cause, OSError) and cause.errno == code
    assert leftover_temp_names(tmp_path) == []


async def test_only_the_nth_matching_call_fails(tmp_path: Path) -> None:
    """``n=2``: the first save's data file is created, the second save's is not
    (a small save writes one data file)."""
    fs = FaultyFileSystem(
        "create", raise_errno(errno.EIO), n=2, where=lambda p: p.endswith(".safetensors")
    )
    with anyio.fail_after(HANG_GUARD_S), pytest.raises(asyncsave.SaveFailedError):
        async with asyncsave.Checkpointer(tmp_path, filesystem=fs) as ckpt:
            await (await ckpt.save(1, state_of(1)))
            assert committed(tmp_path) == [1] and not fs.fired.is_set()
            await (await ckpt.save(2, state_of(2)))
    assert fs.fired.is_set() and committed(tmp_path) == [1]


async def test_a_read_fault_fails_the_manifest_read_of_a_load(tmp_path: Path) -> None:
    """``read_bytes``: the reads of small files (a manifest); a load through the
    file system raises the errno, the same load through a plain one does not."""
    async with asyncsave.Checkpointer(tmp_path) as ckpt:
        await (await ckpt.save(1, state_of(1)))
    manifest = str(tmp_path / "step_1" / "manifest.json")
    fs = FaultyFileSystem("read_bytes", raise_errno(errno.EIO), where=lambda p: p == manifest)
    with pytest.raises(OSError) as err:
        asyncsave.load(tmp_path / "step_1", filesystem=fs)
    assert err.value.errno == errno.EIO and fs.fired.is_set() and fs.seen == 1
    loaded = asyncsave.load(tmp_path / "step_1", filesystem=fs)  # only the first read
    assert torch.equal(loaded["t0"], state_of(1)["t0"]) and fs.seen == 2


async def test_a_blocked_call_holds_the_save_until_released_then_fails(tmp_path: Path) -> None:
    gate = threading.Event()
    fs = FaultyFileSystem("rename", block(gate), where=lambda p: p.endswith("step_1"))
    try:
        with anyio.fail_after(HANG_GUARD_S), pytest.raises(asyncsave.SaveFailedError) as failed:
            async with asyncsave.Checkpointer(tmp_path, filesystem=fs) as ckpt:
                handle = await ckpt.save(1, state_of(1))
                assert await anyio.to_thread.run_sync(fs.fired.wait, HANG_GUARD_S)
                assert not handle.done() and committed(tmp_path) == []
                gate.set()
                await handle
    finally:
        gate.set()
    assert isinstance(failed.value.__cause__, OSError)
    assert committed(tmp_path) == [] and leftover_temp_names(tmp_path) == []


async def test_a_paused_call_goes_ahead_once_released(tmp_path: Path) -> None:
    gate = threading.Event()
    fs = FaultyFileSystem("replace", pause(gate), where=lambda p: p.endswith(".txt"))
    try:
        with anyio.fail_after(HANG_GUARD_S):
            async with asyncsave.Checkpointer(tmp_path, filesystem=fs) as ckpt:
                handle = await ckpt.save(1, state_of(1))
                assert await anyio.to_thread.run_sync(fs.fired.wait, HANG_GUARD_S)
                assert not handle.done()
                gate.set()
                info = await handle
    finally:
        gate.set()
    assert info is not None and info.step == 1
    latest = asyncsave.latest(tmp_path)
    assert latest is not None and latest.step == 1


def test_bad_arguments_are_refused_naming_them() -> None:
    with pytest.raises(ValueError, match="read"):
        FaultyFileSystem("read", raise_errno(errno.EIO))
    with pytest.raises(ValueError, match="n=0"):
        FaultyFileSystem("write", raise_errno(errno.EIO), n=0)
    with pytest.raises(ValueError, match="flushing"), pause_at("flushing"):
        pass
    with pytest.raises(ValueError, match="chunk_bytes=0"), thresholds(chunk_bytes=0):
        pass
    with pytest.raises(ValueError, match=r"heartbeat_window_s=0\.05"):
        with thresholds(heartbeat_window_s=0.05):
            pass


# -- pausing a save at a phase ------------------------------------------------------


@pytest.mark.parametrize("phase", PHASES)
async def test_pause_at_each_phase_holds_one_save_until_released(
    tmp_path: Path, phase: str
) -> None:
    """Step 1 goes through (the pause is not armed yet); step 2 stops at ``phase``
    and is not finished until the pause is released; then it commits."""
    handles: list[asyncsave.SaveHandle] = []
    with pause_at(phase, armed=False, timeout_s=HANG_GUARD_S) as stop:
        options = dict(stop.options, retention=asyncsave.KeepLast(1))
        with anyio.fail_after(HANG_GUARD_S):
            async with asyncsave.Checkpointer(
                tmp_path, filesystem=stop.filesystem, **options
            ) as ckpt:
                await (await ckpt.save(1, state_of(1)))
                stop.arm()
                async with anyio.create_task_group() as tg:

                    async def second() -> None:
                        handles.append(await ckpt.save(2, state_of(2)))

                    tg.start_soon(second)
                    assert await stop.wait_reached()
                    await anyio.sleep(0.05)  # the paused save makes no progress meanwhile
                    if phase != "retiring":  # a handle is done once tracked
                        assert not any(h.done() for h in handles)
                    assert 2 not in committed(tmp_path) or phase in ("tracking", "retiring")
                    stop.release()
                info = await handles[0]
    assert info is not None and info.step == 2
    assert committed(tmp_path) == [2]
    restored = asyncsave.load(tmp_path / "step_2")
    assert all(torch.equal(restored[k], v) for k, v in state_of(2).items() if k != "step")


async def test_leaving_pause_at_releases_a_save_still_stopped(tmp_path: Path) -> None:
    with anyio.fail_after(HANG_GUARD_S):
        async with asyncsave.Checkpointer(tmp_path) as ckpt:
            with pause_at("staging") as stop:
                async with anyio.create_task_group() as tg:
                    tg.start_soon(ckpt.save, 1, state_of(1))
                    assert await stop.wait_reached()
                    stop.release()
            assert stop.released
            await ckpt.wait()
    assert committed(tmp_path) == [1]


# -- thresholds and leftovers -------------------------------------------------------


def data_files(step_dir: Path) -> int:
    return len(list(step_dir.glob("*.safetensors")))


async def test_thresholds_apply_inside_the_block_only(tmp_path: Path) -> None:
    """Below ``min_file_bytes`` per file a save writes one data file; with it
    lowered to one byte, one per writer thread; afterwards one again."""
    async with asyncsave.Checkpointer(tmp_path, writer_threads=4) as ckpt:
        with thresholds(min_file_bytes=1):
            await (await ckpt.save(1, state_of(1)))
        await (await ckpt.save(2, state_of(2)))
    assert data_files(tmp_path / "step_1") == 4
    assert data_files(tmp_path / "step_2") == 1


def test_leftover_temp_names_lists_only_temporary_entries(tmp_path: Path) -> None:
    assert leftover_temp_names(tmp_path / "missing") == []
    (tmp_path / "step_1").mkdir()
    (tmp_path / "notes.txt").write_text("mine")
    assert leftover_temp_names(tmp_path) == []
    (tmp_path / ".asyncsave-tmp-2-0123456789ab").mkdir()
    assert leftover_temp_names(tmp_path) == [".asyncsave-tmp-2-0123456789ab"]


# -- failing staging ----------------------------------------------------------------


class CopyFailed(RuntimeError):
    pass


async def test_fail_staging_fails_the_saves_staged_inside_the_block_only(tmp_path: Path) -> None:
    error = CopyFailed("the device copy failed")
    with pytest.raises(asyncsave.SaveFailedError) as failed:
        async with asyncsave.Checkpointer(tmp_path) as ckpt:
            with fail_staging(error):
                handle = await ckpt.save(1, state_of(1), lazy=True)
                with pytest.raises(asyncsave.SaveFailedError):
                    await handle
    assert failed.value.__cause__ is error
    assert committed(tmp_path) == [] and leftover_temp_names(tmp_path) == []
    async with asyncsave.Checkpointer(tmp_path) as ckpt:
        await (await ckpt.save(2, state_of(2), lazy=True))
    assert committed(tmp_path) == [2]
    with pytest.raises(TypeError, match="error="):
        with fail_staging(KeyboardInterrupt()):  # type: ignore[arg-type]
            pass


async def test_on_early_copy_is_called_per_lazy_save_with_an_early_copy_inside_the_block_only(
    tmp_path: Path,
) -> None:
    """Called with the save's number of tensors for a lazy save with a small
    tensor, not for an eager save nor a lazy one of only large tensors; what it
    raises is raised by ``save()``, and the checkpointer takes later saves."""
    small = {"w": torch.randn(1 << 16), "b": torch.zeros(8)}
    large = {"w": torch.randn(1 << 16)}
    calls: list[int] = []
    fail = threading.Event()

    def seen(num_tensors: int) -> None:
        calls.append(num_tensors)
        if fail.is_set():
            raise CopyFailed("the early copy failed")

    async with asyncsave.Checkpointer(tmp_path) as ckpt:
        with on_early_copy(seen):
            await (await ckpt.save(1, small, lazy=True))
            await (await ckpt.save(2, small))
            await (await ckpt.save(3, large, lazy=True))
            assert calls == [2]
            fail.set()
            with pytest.raises(CopyFailed):
                await ckpt.save(4, small, lazy=True)
        await (await ckpt.save(4, small, lazy=True))  # outside the block: not called
    assert calls == [2, 2] and committed(tmp_path) == [1, 2, 3, 4]
    with pytest.raises(TypeError, match="fn="):
        with on_early_copy(None):  # type: ignore[arg-type]
            pass


def test_listing_reads_runs_its_callbacks_around_each_manifest_read_inside_the_block_only(
    tmp_path: Path,
) -> None:
    with asyncsave.SyncCheckpointer(tmp_path) as ckpt:
        for step in (1, 2):
            ckpt.save(step, state_of(step)).result()
    (tmp_path / "step_2" / "manifest.json").write_bytes(b"{}")  # its read raises
    seen: list[tuple[str, str, bool]] = []

    def before(p: Path) -> None:
        seen.append(("before", p.name, (p / "manifest.json").exists()))

    def after(p: Path) -> None:
        seen.append(("after", p.name, p.is_dir()))

    with listing_reads(before=before, after=after):
        assert committed(tmp_path) == [1]
    assert seen == [
        ("before", "step_1", True),
        ("after", "step_1", True),
        ("before", "step_2", True),
        ("after", "step_2", True),  # the read of step 2 raised: after ran all the same
    ]
    assert committed(tmp_path) == [1] and len(seen) == 4  # outside the block: not called
    with pytest.raises(TypeError, match="after="):
        with listing_reads(after="step_1"):  # type: ignore[arg-type]
            pass


# -- the command, manifests, layouts' names -----------------------------------------


async def test_cli_runs_the_command_in_this_process(tmp_path: Path) -> None:
    import io

    async with asyncsave.Checkpointer(tmp_path) as ckpt:
        await (await ckpt.save(3, state_of(3)))
    out = io.StringIO()
    assert cli(["ls", str(tmp_path)], out=out) == 0
    assert "step_3" in out.getvalue()
    assert cli(["verify", str(tmp_path / "step_3")], out=io.StringIO()) == 0
    (tmp_path / "step_3" / "manifest.json").write_bytes(b"{}")
    assert cli(["verify", str(tmp_path / "step_3")], out=io.StringIO()) == 1


async def test_encode_manifest_writes_an_edit_that_is_checked_as_an_edit(tmp_path: Path) -> None:
    """An edited manifest re-encoded passes its self-checksum, so the loader
    judges the edited field itself; written as is, the old checksum refuses it."""
    import json

    async with asyncsave.Checkpointer(tmp_path) as ckpt:
        await (await ckpt.save(1, state_of(1)))
    path = tmp_path / "step_1" / "manifest.json"
    doc = json.loads(path.read_bytes())
    assert encode_manifest({k: v for k, v in doc.items() if k != "manifest_xxh3_64"}) == (
        path.read_bytes()
    )
    doc.pop("manifest_xxh3_64")
    doc["format_version"] = 10**6
    path.write_bytes(encode_manifest(doc))
    with pytest.raises(asyncsave.UnsupportedFormatError):
        asyncsave.load(tmp_path / "step_1")


def test_checkpoint_dir_name_follows_each_layout_preset() -> None:
    assert set(LAYOUT_NAMES) >= {"asyncsave", "megatron", "verl"}
    assert list(LAYOUT_NAMES) == sorted(LAYOUT_NAMES)
    assert checkpoint_dir_name("asyncsave", 7) == "step_7"
    assert checkpoint_dir_name("megatron", 7) == "iter_0000007"
    assert checkpoint_dir_name("verl", 7) == "global_step_7"
    with pytest.raises(ValueError, match="layout='nope'"):
        checkpoint_dir_name("nope", 1)


async def test_newest_format_version_is_read_and_one_above_is_not(tmp_path: Path) -> None:
    import json

    async with asyncsave.Checkpointer(tmp_path) as ckpt:
        await (await ckpt.save(1, state_of(1)))
    path = tmp_path / "step_1" / "manifest.json"
    doc = json.loads(path.read_bytes())
    doc.pop("manifest_xxh3_64")
    assert doc["format_version"] <= NEWEST_FORMAT_VERSION
    path.write_bytes(encode_manifest({**doc, "format_version": NEWEST_FORMAT_VERSION}))
    assert asyncsave.load(tmp_path / "step_1")["step"] == 1
    path.write_bytes(encode_manifest({**doc, "format_version": NEWEST_FORMAT_VERSION + 1}))
    with pytest.raises(asyncsave.UnsupportedFormatError):
        asyncsave.load(tmp_path / "step_1")


def test_checkpoint_step_and_tracker_file_name_follow_each_layout_preset() -> None:
    for layout in LAYOUT_NAMES:
        assert checkpoint_step(layout, checkpoint_dir_name(layout, 40)) == 40
    assert checkpoint_step("asyncsave", "step_x") is None
    assert checkpoint_step("asyncsave", "iter_0000007") is None  # another preset's name
    assert checkpoint_step("asyncsave", ".asyncsave-tmp-step_3-ab") is None
    assert tracker_file_name("asyncsave") == "latest_checkpointed_iteration.txt"
    assert tracker_file_name("megatron") == "latest_checkpointed_iteration.txt"
    with pytest.raises(ValueError, match="layout='nope'"):
        checkpoint_step("nope", "step_1")
    with pytest.raises(ValueError, match="layout='nope'"):
        tracker_file_name("nope")


def _collectives_of_a_save(rank: int, world: int, root: str) -> tuple[list[str], list[str]]:
    seen: list[str] = []

    async def save(step: int) -> None:
        async with asyncsave.Checkpointer(root, dist_timeout_s=30) as ckpt:
            await (await ckpt.save(step, {"w": torch.full((4,), float(rank))}))

    with gloo_collectives(seen.append):
        anyio.run(save, 1)
    inside = list(seen)
    anyio.run(save, 2)  # after the block: not seen
    return inside, seen


def test_gloo_collectives_sees_each_collective_of_a_gloo_save_inside_the_block_only(
    tmp_path: Path,
) -> None:
    import sys

    sys.path.insert(0, str(Path(__file__).parent))
    from distributed import run_ranks, values

    results = values(run_ranks(_collectives_of_a_save, 2, tmp_path, str(tmp_path / "run")))
    for inside, after in results:
        assert "all_gather" in inside and set(inside) <= {"broadcast", "all_gather"}
        assert after == inside
    assert [info.step for info in asyncsave.checkpoints(tmp_path / "run")] == [1, 2]
    with pytest.raises(TypeError, match="fn="):
        with gloo_collectives("all_gather"):  # type: ignore[arg-type]
            pass


class StepFailed(RuntimeError):
    pass


async def test_staging_steps_sees_each_step_of_a_followed_copy_inside_the_block_only(
    tmp_path: Path,
) -> None:
    """Each step of a copy that the writers follow calls it with the file it
    staged (both files of a two-file save, file 0 first); a save staged, then
    written, makes no call; what it raises fails that save."""
    state = {f"t{i}": torch.randn(1 << 17) for i in range(4)}  # 2 MiB
    steps: list[int] = []
    fail = threading.Event()

    def step(index: int) -> None:
        steps.append(index)
        if fail.is_set():
            raise StepFailed("a source tensor could not be read")

    sizes = thresholds(follow_min_bytes=0, follow_piece_bytes=64 << 10, min_file_bytes=1 << 20)
    with sizes:
        async with asyncsave.Checkpointer(tmp_path, overlap_writes=True, writer_threads=2) as ckpt:
            with staging_steps(step):
                await (await ckpt.save(1, state))
                assert steps[0] == 0 and set(steps) == {0, 1} and len(steps) >= 32
                n = len(steps)
                async with asyncsave.Checkpointer(tmp_path / "b", overlap_writes=False) as other:
                    await (await other.save(1, state))  # staged, then written
                assert len(steps) == n
                fail.set()
                with pytest.raises(StepFailed):
                    await ckpt.save(2, state)
            await (await ckpt.save(3, state))  # outside the block: not called
    assert len(steps) == n + 1 and committed(tmp_path) == [1, 3]
    with pytest.raises(TypeError, match="fn="):
        with staging_steps(None):  # type: ignore[arg-type]
            pass


async def test_staging_released_is_called_once_per_save_inside_the_block_only(
    tmp_path: Path,
) -> None:
    calls: list[int] = []
    async with asyncsave.Checkpointer(tmp_path) as ckpt:
        with staging_released(lambda: calls.append(1)):
            await (await ckpt.save(1, state_of(1)))
            await (await ckpt.save(2, state_of(2), lazy=True))
            assert len(calls) == 2
        await (await ckpt.save(3, state_of(3)))
    assert len(calls) == 2
    with pytest.raises(TypeError, match="fn="):
        with staging_released(None):  # type: ignore[arg-type]
            pass


def test_hash_apart_bytes_applies_inside_the_block_only(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A small file written with ``O_DIRECT`` is hashed by a helper thread only
    while the threshold is lowered."""
    started: list[str] = []
    real = threading.Thread.start

    def start(self: threading.Thread) -> None:
        started.append(self.name)
        real(self)

    monkeypatch.setattr(threading.Thread, "start", start)
    state = {"w": torch.randn(1 << 18)}  # 1 MiB
    with asyncsave.SyncCheckpointer(tmp_path, direct_io=True) as ckpt:
        with thresholds(hash_apart_bytes=0):
            ckpt.save(1, state).result()
        inside = started.count("asyncsave-hash")
        ckpt.save(2, state).result()
    assert inside == 1 and started.count("asyncsave-hash") == 1


async def test_planning_sees_each_walk_and_each_grouping_inside_the_block_only(
    tmp_path: Path,
) -> None:
    """A first save walks its tree and groups its tensors in a worker thread; a
    second of the same small plain structure only walks it, on the loop; a
    tree past the node limit is walked in a worker at every save (twice where
    its structure changed: the match against the last plan, then the flatten)."""
    loop = threading.get_ident()
    seen: list[tuple[str, bool]] = []
    small = {"w": torch.zeros(4), "n": 1}
    large = {f"t{i}": torch.zeros(1) for i in range(INLINE_PLAN_MAX_NODES + 1)}
    async with asyncsave.Checkpointer(tmp_path) as ckpt:
        with planning(lambda what: seen.append((what, threading.get_ident() == loop))):
            await (await ckpt.save(1, small))
            await (await ckpt.save(2, small))
            assert seen == [("flatten", False), ("group", False), ("flatten", True)]
            seen.clear()
            await (await ckpt.save(3, large))
            await (await ckpt.save(4, large))
            # Save 3: matched against the small tree's plan (no match), then walked
            # and grouped; save 4: matched.
            walk = ("flatten", False)
            assert seen == [walk, walk, ("group", False), walk]
        await (await ckpt.save(5, small))
    assert len(seen) == 4  # none outside the block
    with pytest.raises(TypeError, match="fn="):
        with planning(None):  # type: ignore[arg-type]
            pass


async def test_early_copy_made_is_called_in_the_copying_thread_inside_the_block_only(
    tmp_path: Path,
) -> None:
    loop = threading.get_ident()
    threads: list[int] = []
    small = {"w": torch.randn(1 << 16), "b": torch.zeros(8)}
    async with asyncsave.Checkpointer(tmp_path) as ckpt:
        with early_copy_made(lambda: threads.append(threading.get_ident())):
            await (await ckpt.save(1, small, lazy=True))
            await (await ckpt.save(2, small))  # eager: no early copy
        await (await ckpt.save(3, small, lazy=True))
    assert len(threads) == 1 and threads[0] != loop
    with pytest.raises(TypeError, match="fn="):
        with early_copy_made(None):  # type: ignore[arg-type]
            pass


async def test_incremental_steps_sees_the_base_hashing_and_writes_inside_the_block_only(
    tmp_path: Path,
) -> None:
    """An incremental save after two saves of one structure: the base is looked
    up, the unchanged file hashed in place, the changed one written; ``after``
    follows each ``before``; what ``before`` raises fails that step."""
    state = {"frozen": torch.randn(1 << 18), "lora": torch.randn(1 << 18)}  # 1 MiB each
    steps: list[tuple[str, str]] = []
    ends: list[str] = []
    fail = threading.Event()

    def before(what: str, name: str, nbytes: int) -> None:
        assert what in INCREMENTAL_STEPS and (nbytes > 0) == (what != "base")
        steps.append((what, name))
        if fail.is_set() and what == "base":
            raise StepFailed("no base")

    async with asyncsave.Checkpointer(tmp_path, incremental=True) as ckpt:
        for step in (1, 2):
            state["lora"].add_(1)
            await (await ckpt.save(step, state))
        with incremental_steps(before=before, after=lambda what, name, n: ends.append(what)):
            state["lora"].add_(1)
            await (await ckpt.save(3, state))
            kinds = sorted({what for what, _ in steps})
            assert kinds == ["base", "hash", "write"], steps
            assert sorted(ends) == sorted(what for what, _ in steps)
            fail.set()
            with pytest.raises(StepFailed):
                await ckpt.save(4, state)
        n = len(steps)
        await (await ckpt.save(4, state))
    assert len(steps) == n and committed(tmp_path) == [1, 2, 3, 4]
    with pytest.raises(TypeError, match="after="):
        with incremental_steps(after="x"):  # type: ignore[arg-type]
            pass


async def test_snapshot_taken_and_background_tasks_fail_a_save_inside_the_block_only(
    tmp_path: Path,
) -> None:
    calls: list[str] = []

    def staged() -> None:
        calls.append("staged")
        raise StepFailed("the last step of staging")

    def started() -> None:
        calls.append("started")
        raise StepFailed("task group closed")

    state = {f"t{i}": torch.randn(1 << 17) for i in range(4)}
    async with asyncsave.Checkpointer(tmp_path, overlap_writes=True) as ckpt:
        with snapshot_taken(staged), pytest.raises(StepFailed, match="last step"):
            await ckpt.save(1, state)
        with thresholds(follow_min_bytes=0), background_tasks(started):
            with pytest.raises(StepFailed, match="task group"):  # written while staged
                await ckpt.save(2, state)
        with thresholds(follow_min_bytes=0):
            await (await ckpt.save(3, state))
    assert calls == ["staged", "started"] and committed(tmp_path) == [3]
    for hook in (snapshot_taken, background_tasks):
        with pytest.raises(TypeError, match="fn="):
            with hook(None):  # type: ignore[arg-type]
                pass


async def test_stream_rounds_sees_the_rounds_of_a_streamed_save_inside_the_block_only(
    tmp_path: Path,
) -> None:
    """Called once per structure and budget, for a state over its budget only;
    its pieces cover the data of every file."""
    state = {f"t{i}": torch.randn(1 << 16) for i in range(4)}  # 1 MiB
    seen: list[tuple[int, int, int]] = []

    def rounds_of(budget: int, rounds: list[list[tuple[int, int, int, int, int]]]) -> None:
        seen.append((budget, len(rounds), sum(q[3] - q[2] for r in rounds for q in r)))

    async with asyncsave.Checkpointer(tmp_path, budget_bytes=256 << 10) as ckpt:
        with stream_rounds(rounds_of):
            await (await ckpt.save(1, state))
            await (await ckpt.save(2, state))  # the same rounds, reused
        await (await ckpt.save(3, {"w": torch.zeros(4)}))  # under the budget
    assert seen == [(256 << 10, 4, 1 << 20)], seen
    with pytest.raises(TypeError, match="fn="):
        with stream_rounds(None):  # type: ignore[arg-type]
            pass
