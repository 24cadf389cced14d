"""``CheckpointWarning`` names the caller's line and obeys the caller's filters,
through both facades (review of issue 10, item 7).

``save()`` used to issue the warning from inside the engine with a fixed
``stacklevel``; through ``SyncCheckpointer`` the engine runs on the portal's
thread, so the warning named anyio's internals and was issued in that thread,
where ``warnings.catch_warnings`` and ``-W`` filters of the calling thread did not
apply. Each kind of warning (step 0 skipped, below the tracked step, a re-save of a
committed step, of a step in flight) is checked on asyncio and trio.
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio
import pytest
import torch
from faults import FaultyFS, pause

import asyncsave

KINDS = ["step-zero", "below-tracked", "committed", "in-flight"]
HANG_GUARD_S = 60


@pytest.fixture(params=["asyncio", "trio"])
def backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def state(v: float) -> dict[str, Any]:
    return {"w": torch.full((8,), v)}


def _setup(kind: str) -> tuple[int, str]:
    """(the step whose save warns, what its message says)."""
    return {
        "step-zero": (0, "saving step 0"),  # only that, not "below the tracked step 3"
        "below-tracked": (2, "below the tracked step 3"),
        "committed": (3, "already committed"),
        "in-flight": (5, "already in flight"),
    }[kind]


def _again(kind: str) -> str:
    """What a second save of the same step is warned about: one warning per call,
    for what happens to it, so a repeat of a step below the tracker is a no-op."""
    return "already (in flight|committed)" if kind == "below-tracked" else _setup(kind)[1]


def _check_recorded(record: pytest.WarningsRecorder, says: str) -> None:
    hits = [w for w in record if issubclass(w.category, asyncsave.CheckpointWarning)]
    assert [w for w in hits if says in str(w.message)], [str(w.message) for w in record]
    assert {w.filename for w in hits} == {__file__}  # the line that called save()


@pytest.mark.parametrize("kind", KINDS)
def test_async_save_warns_at_the_callers_line_under_the_callers_filters(
    tmp_path: Path, backend: str, kind: str
) -> None:
    step, says = _setup(kind)
    gate = threading.Event()
    fs = FaultyFS("write", pause(gate), where=lambda p: "-tmp-5-" in p)

    async def main() -> None:
        with anyio.fail_after(HANG_GUARD_S):
            async with asyncsave.Checkpointer(tmp_path, filesystem=fs) as ckpt:
                try:
                    await (await ckpt.save(3, state(3)))
                    if kind == "in-flight":  # its write waits for the gate (and holds
                        await ckpt.save(5, state(5))  # the staging buffer meanwhile)
                    with pytest.warns(asyncsave.CheckpointWarning) as record:
                        await ckpt.save(step, state(-1))
                    _check_recorded(record, says)
                    with warnings.catch_warnings():
                        warnings.simplefilter("error", asyncsave.CheckpointWarning)
                        with pytest.raises(asyncsave.CheckpointWarning, match=_again(kind)):
                            await ckpt.save(step, state(-2))
                finally:
                    gate.set()

    try:
        anyio.run(main, backend=backend)
    finally:
        gate.set()
    if kind == "below-tracked":  # the error filter stopped the second call's save
        assert asyncsave.load(tmp_path / "step_2")["w"][0].item() == -1.0


@pytest.mark.parametrize("kind", KINDS)
def test_sync_save_warns_in_the_callers_thread_at_the_callers_line(
    tmp_path: Path, backend: str, kind: str
) -> None:
    step, says = _setup(kind)
    gate = threading.Event()
    fs = FaultyFS("write", pause(gate), where=lambda p: "-tmp-5-" in p)
    try:
        with asyncsave.SyncCheckpointer(tmp_path, backend=backend, filesystem=fs) as ckpt:
            try:
                ckpt.save(3, state(3)).result()
                if kind == "in-flight":  # its write waits for the gate
                    ckpt.save(5, state(5))
                with pytest.warns(asyncsave.CheckpointWarning) as record:
                    ckpt.save(step, state(-1))
                _check_recorded(record, says)
                with warnings.catch_warnings():
                    warnings.simplefilter("error", asyncsave.CheckpointWarning)
                    with pytest.raises(asyncsave.CheckpointWarning, match=_again(kind)):
                        ckpt.save(step, state(-2))
            finally:
                gate.set()
    finally:
        gate.set()
    if kind == "below-tracked":
        assert asyncsave.load(tmp_path / "step_2")["w"][0].item() == -1.0


def test_a_sync_save_without_anything_to_warn_about_warns_nothing(
    tmp_path: Path, backend: str
) -> None:
    call: Callable[..., Any]
    with asyncsave.SyncCheckpointer(tmp_path, backend=backend) as ckpt:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            call = ckpt.save
            call(1, state(1)).result()
            call(1, state(2), overwrite=True).result()
    assert asyncsave.load(tmp_path / "step_1")["w"][0].item() == 2.0
