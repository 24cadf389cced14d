"""I/O fault injection at every write site of a save (DESIGN invariant 3; issue 4,
item 4).

The sites are not listed by hand: a clean save of step 2 (after step 1) runs through
the tracing shim, which numbers every call it makes to the I/O layer (data files,
manifest, ``mkdir``, every ``fsync``, the directory fsyncs, the rename, the tracker's
temp file and ``replace``, ``close``); then each call in turn fails with ENOSPC,
EIO, EACCES and EROFS, and every ``write`` call also becomes a short write followed
by ENOSPC (what a full disk does). For each fault:

- ``await handle`` raises :class:`~asyncsave.SaveFailedError` whose ``__cause__`` is
  the ``OSError`` with that errno, and the next ``save()``, ``wait()`` and close
  raise the same error object: after a failed save the checkpointer refuses
  further saves (docs/decisions.md);
- step 1 still verifies; every final-named directory verifies; the tracker names
  a committed checkpoint; no temporary file or directory is left;
- a new checkpointer resumes bit-exactly and saves again.

Beside the shim, a real 4 MiB tmpfs is filled up (as root) to show ENOSPC end to end.
"""

from __future__ import annotations

import errno
import functools
import logging
import os
from pathlib import Path
from typing import Any

import anyio
import pytest
import torch
from crashlab import final_dirs, same_state, state_of
from fstrace import TracingFS
from reliability import record

import asyncsave
from asyncsave.testing import leftover_temp_names, pause_at

pytestmark = pytest.mark.anyio

TRACKER = "latest_checkpointed_iteration.txt"
ERRNOS = {
    "ENOSPC": errno.ENOSPC,
    "EIO": errno.EIO,
    "EACCES": errno.EACCES,
    "EROFS": errno.EROFS,
}


class FaultFS(TracingFS):
    """Fails call number ``at`` (of the numbering of :class:`TracingFS`) with
    ``OSError(code)``; with ``short=True``, ``at`` counts ``write`` calls only (the
    files written while staged interleave their calls in any order, their writes
    too, but the n-th write is a write): that write writes 7 bytes and returns, and
    the next ``write`` fails with ENOSPC."""

    def __init__(self, root: Path, at: int | None, code: int, *, short: bool = False) -> None:
        super().__init__(root, before=self._before, record=False)
        self.at, self.code, self.short = at, code, short
        self.fired: tuple[str, str] | None = None
        self._short_done = False
        self._writes = 0

    def _before(self, index: int, op: str, path: str) -> None:
        if self._short_done and op == "write":
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)
        if self.short:
            if op != "write":
                return
            with self._lock:  # writer threads write at once
                self._writes += 1
                index = self._writes
        if index != self.at:
            return
        self.fired = (op, path)
        if self.short:
            assert op == "write", op
            self.max_write = 7
            self._short_done = True
            return
        raise OSError(self.code, os.strerror(self.code), path)


def clean_calls(tmp: Path, **options: Any) -> tuple[int, list[tuple[str, str]], int]:
    """Calls made before step 2's save, the calls of that save, and the writes
    made before it."""
    fs = TracingFS(tmp, record=False)

    async def go() -> int:
        async with asyncsave.Checkpointer(tmp, filesystem=fs, **options) as ckpt:
            await (await ckpt.save(1, state_of(1)))
            before = fs.calls
            await (await ckpt.save(2, state_of(2)))
            return before

    before = anyio.run(go)
    return before, fs.log[before:], sum(op == "write" for op, _ in fs.log[:before])


def check_after_failure(root: Path, expect_cause_errno: int) -> None:
    for step, path in final_dirs(root).items():
        assert same_state(asyncsave.load(path), state_of(step)), path
        asyncsave.verify(path)
    assert 1 in final_dirs(root), "the previous checkpoint is gone"
    tracked = int((root / TRACKER).read_text())
    assert tracked in final_dirs(root)
    leftovers = leftover_temp_names(root)
    assert not leftovers, leftovers


async def fail_one(root: Path, at: int, code: int, short: bool, **options: Any) -> tuple[str, str]:
    fs = FaultFS(root, at, code, short=short)
    ckpt = asyncsave.Checkpointer(root, filesystem=fs, **options)
    with anyio.fail_after(60):  # a hang detector, not a timing assertion
        with pytest.raises(asyncsave.SaveFailedError) as at_close:
            async with ckpt:
                await (await ckpt.save(1, state_of(1)))
                handle = await ckpt.save(2, state_of(2))
                with pytest.raises(asyncsave.SaveFailedError) as at_handle:
                    await handle
                cause = at_handle.value.__cause__
                assert isinstance(cause, OSError), repr(cause)
                assert cause.errno == (errno.ENOSPC if short else code), cause
                assert at_handle.value.step == 2
                with pytest.raises(asyncsave.SaveFailedError) as at_save:
                    await ckpt.save(3, state_of(3))
                assert at_save.value is at_handle.value
                with pytest.raises(asyncsave.SaveFailedError) as at_wait:
                    await ckpt.wait()
                assert at_wait.value is at_handle.value
    assert at_close.value is at_handle.value
    assert fs.fired is not None
    return fs.fired


async def resume_and_save_again(root: Path) -> None:
    async with asyncsave.Checkpointer(root) as ckpt:
        restored = await ckpt.load_latest()
        assert restored is not None and restored.info.step in (1, 2)
        assert same_state(restored.state, state_of(restored.info.step))
        assert await (await ckpt.save(3, state_of(3))) is not None
    asyncsave.verify(root / "step_3")


@pytest.mark.parametrize("kind", [*ERRNOS, "short-write"])
@pytest.mark.parametrize("anyio_backend", ["asyncio", "trio"])
async def test_a_fault_at_every_write_site_is_raised_typed_and_loses_nothing(
    tmp_path: Path, kind: str, anyio_backend: str, caplog: pytest.LogCaptureFixture
) -> None:
    await fault_at_every_site(tmp_path, kind, caplog)


@pytest.mark.parametrize("kind", ["ENOSPC", "EIO", "short-write"])
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_a_fault_at_every_write_site_of_a_save_written_while_staged(
    tmp_path: Path, kind: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The same, with the data files written while the snapshot is copied
    (``overlap_writes=True``: the temporary directory made and the files'
    writers started before the copy; the state is small, so each file is one
    step of the copy)."""
    with pause_at("following") as followed:
        followed.release()  # only seen, never held
        await fault_at_every_site(tmp_path, kind, caplog, **followed.options)
    assert followed.reached.is_set()


async def fault_at_every_site(
    tmp_path: Path, kind: str, caplog: pytest.LogCaptureFixture, **options: Any
) -> None:
    caplog.set_level(logging.CRITICAL, logger="asyncsave")
    before, calls, writes_before = await anyio.to_thread.run_sync(
        functools.partial(clean_calls, tmp_path / "clean", **options)
    )
    short = kind == "short-write"
    code = errno.ENOSPC if short else ERRNOS[kind]
    # (a one-byte write, the tracker's, cannot be short: it is a site of the errnos)
    if short:  # the n-th write (see FaultFS)
        writes = [path for op, path in calls if op == "write"]
        sites = [writes_before + i + 1 for i, path in enumerate(writes) if TRACKER not in path]
    else:
        sites = [before + i + 1 for i in range(len(calls))]
    kinds_hit: set[str] = set()
    for n, at in enumerate(sites):
        root = tmp_path / f"case-{n}"
        fired = await fail_one(root, at, code, short, **options)
        try:
            check_after_failure(root, code)
            await resume_and_save_again(root)
        except AssertionError as exc:
            raise AssertionError(f"{kind} at call {at} {fired}: {exc}") from exc
        kinds_hit.add(fired[0])
    record("injected I/O faults", len(sites))
    if short:
        assert kinds_hit == {"write"}
    else:
        assert kinds_hit >= {
            "mkdir",
            "create",
            "write",
            "fsync",
            "close",
            "fsync_dir",
            "rename",
            "replace",
        }, kinds_hit
        # data, manifest and tracker each failed at their write
        written = {p.rsplit("/", 1)[-1].split("-")[0] for op, p in calls if op == "create"}
        assert {"data", "manifest.json", ".asyncsave"} <= written, written


async def test_a_failed_clean_up_leaves_the_temp_dir_to_the_next_open(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Second-order fault: the write fails, then removing the temp dir fails too."""

    class TwoFaults(TracingFS):
        def write(self, fd: int, data: memoryview) -> int:
            if "-tmp-2-" in self._fd_path.get(fd, ""):
                raise OSError(errno.EIO, "disk gone")
            return super().write(fd, data)

        def remove_tree(self, path: Path) -> None:
            raise OSError(errno.EROFS, "remounted read-only")

    fs = TwoFaults(tmp_path, record=False)
    with pytest.raises(asyncsave.SaveFailedError) as err:
        async with asyncsave.Checkpointer(tmp_path, filesystem=fs) as ckpt:
            await (await ckpt.save(1, state_of(1)))
            await ckpt.save(2, state_of(2))
    assert isinstance(err.value.__cause__, OSError) and err.value.__cause__.errno == errno.EIO
    assert any("the next open removes it" in r.message for r in caplog.records)
    assert [p for p in tmp_path.iterdir() if p.name.startswith(".asyncsave-tmp-2-")]
    async with asyncsave.Checkpointer(tmp_path) as ckpt:
        restored = await ckpt.load_latest()
        assert restored is not None and restored.info.step == 1
    assert not leftover_temp_names(tmp_path)


async def test_a_retention_delete_that_fails_keeps_the_save_and_retries(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Retention runs after the commit: its failure is logged, never turned into a
    failed save (the new checkpoint is safe), and the rule is applied again after
    the next commit."""

    class NoUnlink(TracingFS):
        broken = True

        def remove_tree(self, path: Path) -> None:
            if self.broken:
                raise OSError(errno.EACCES, "permission denied", str(path))
            super().remove_tree(path)

    fs = NoUnlink(tmp_path, record=False)
    async with asyncsave.Checkpointer(
        tmp_path, filesystem=fs, retention=asyncsave.KeepLast(1)
    ) as ckpt:
        await (await ckpt.save(1, state_of(1)))
        assert await (await ckpt.save(2, state_of(2))) is not None
        assert any("retention failed" in r.message for r in caplog.records)
        assert sorted(final_dirs(tmp_path)) == [2]  # step 1 left under a temp name
        fs.broken = False
        await (await ckpt.save(3, state_of(3)))
    assert sorted(final_dirs(tmp_path)) == [3]
    async with asyncsave.Checkpointer(tmp_path):
        pass
    assert not leftover_temp_names(tmp_path)


# -- a real full file system ------------------------------------------------------


def big_state(step: int) -> dict[str, Any]:
    s = state_of(step)
    g = torch.Generator().manual_seed(step)
    s["model"]["big"] = torch.randn(256 * 1024, generator=g)  # 1 MiB
    return s


async def test_a_full_tmpfs_is_enospc_end_to_end(small_fs: Path) -> None:
    root = small_fs / "ckpt"
    async with asyncsave.Checkpointer(root) as ckpt:
        await (await ckpt.save(1, big_state(1)))
    st = os.statvfs(small_fs)
    free = st.f_bavail * st.f_frsize
    filler = small_fs / "filler"
    with open(filler, "wb") as f:  # leave about half a save's worth
        f.write(b"\0" * max(0, free - 512 * 1024))
    with pytest.raises(asyncsave.SaveFailedError) as at_close:
        async with asyncsave.Checkpointer(root) as ckpt:
            restored = await ckpt.load_latest()
            assert restored is not None and restored.info.step == 1
            handle = await ckpt.save(2, big_state(2))
            with pytest.raises(asyncsave.SaveFailedError) as at_handle:
                await handle
            assert isinstance(at_handle.value.__cause__, OSError)
            assert at_handle.value.__cause__.errno == errno.ENOSPC
            with pytest.raises(asyncsave.SaveFailedError) as at_save:
                await ckpt.save(3, big_state(3))
            assert at_save.value is at_handle.value
    assert at_close.value is at_handle.value
    # the previous checkpoint is intact, the half-written save is gone
    assert same_state(asyncsave.load(root / "step_1"), big_state(1))
    assert (root / TRACKER).read_text() == "1"
    assert not leftover_temp_names(root)
    assert not (root / "step_2").exists()
    # free the space: a new checkpointer goes on from step 1
    filler.unlink()
    async with asyncsave.Checkpointer(root) as ckpt:
        restored = await ckpt.load_latest()
        assert restored is not None and restored.info.step == 1
        await (await ckpt.save(2, big_state(2)))
    assert same_state(asyncsave.load(root / "step_2"), big_state(2))
