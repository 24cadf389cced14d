"""A save asked for by a signal survives the signal's repeats during the flush.

Schedulers repeat SIGTERM within their grace period and users press Ctrl-C twice
(https://github.com/goodfire-ai/spd/issues/677): a ``SaveOnSignal`` that caught a
signal keeps its handler until the checkpointers open at the end of its block have
flushed, in every nesting the docs show. The end-to-end tests send real signals
from this process to a child pump (``signal_child.py``), whose commit of the
signal's save is held by a gate until the repeats were sent.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import anyio
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import asyncsave

CHILD = Path(__file__).with_name("signal_child.py")
SAVED = 31  # the child's signal arrives after step 30


def _wait_for(paths: list[Path], procs: list[subprocess.Popen[str]]) -> None:
    deadline = time.monotonic() + 120
    while not all(p.exists() for p in paths):
        for proc in procs:
            assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, f"the child never wrote {paths}"
        time.sleep(0.01)


def _preempt(
    tmp_path: Path, nesting: str, sig: signal.Signals, repeats: int, world: int = 1
) -> list[dict[str, Any]]:
    """Run the child pump on ``world`` ranks; signal rank 0 after step 30, then
    every rank ``repeats`` times while the commit of step 31 is held; return what
    every rank printed."""
    root, marks = tmp_path / "ckpt", tmp_path / "marks"
    marks.mkdir()
    cmd = [sys.executable, str(CHILD), str(root), str(marks), nesting, sig.name]
    store = str(tmp_path / "store")
    procs = [
        subprocess.Popen(
            [*cmd, *([str(r), str(world), store] if nesting == "agreed" else [])],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in range(world)
    ]
    try:
        _wait_for([marks / "ready"], procs)
        procs[0].send_signal(sig)
        _wait_for([marks / "gate", *(marks / f"flushing{r}" for r in range(world))], procs)
        for _ in range(repeats):
            for proc in procs:
                proc.send_signal(sig)
            time.sleep(0.05)
        time.sleep(0.2)  # let every handler run before the commit goes ahead
        (marks / "go").touch()
        outs = [proc.communicate(timeout=120) for proc in procs]
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()
    for proc, (_, err) in zip(procs, outs, strict=True):
        assert proc.returncode == 0, f"rank exited {proc.returncode}:\n{err}"
    info = asyncsave.latest(root)
    assert info is not None and info.step == SAVED
    assert (root / "latest_checkpointed_iteration.txt").read_text().strip() == str(SAVED)
    return [json.loads(out.splitlines()[-1]) for out, _ in outs]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("nesting", "sig", "repeats"),
    [
        ("inside", signal.SIGTERM, 1),
        ("inside", signal.SIGINT, 3),
        ("outside", signal.SIGTERM, 2),
        ("sync", signal.SIGTERM, 3),
        ("sync", signal.SIGINT, 2),
    ],
)
def test_a_signal_repeated_during_the_exit_flush_keeps_the_save_it_asked_for(
    tmp_path: Path, nesting: str, sig: signal.Signals, repeats: int
) -> None:
    (child,) = _preempt(tmp_path, nesting, sig, repeats)
    assert child == {"stopped": SAVED, "repeats": repeats, "restored": True}


@pytest.mark.slow
def test_an_agreed_signal_save_on_two_ranks_survives_repeats_sent_to_every_rank(
    tmp_path: Path,
) -> None:
    """Rank 0 alone is signalled at first; both ranks save step 31, and both are
    signalled twice more while rank 0's commit is held: rank 1, which never saw
    the first signal, keeps its handler too (it is stopping by agreement)."""
    ranks = _preempt(tmp_path, "agreed", signal.SIGTERM, 2, world=2)
    assert [r["stopped"] for r in ranks] == [SAVED, SAVED]
    assert [r["repeats"] for r in ranks] == [2, 1]  # rank 1's first is no repeat
    assert all(r["restored"] for r in ranks)


class _CommitGate(asyncsave.LocalFileSystem):
    """Holds the commit of ``step_1`` until ``go`` is set; records the handlers
    of ``signals`` in place then (during the close's flush)."""

    def __init__(self, signals: Sequence[int]) -> None:
        self.signals, self.go = signals, threading.Event()
        self.at_commit: dict[int, Any] = {}

    def rename(self, src: Path, dst: Path) -> None:
        if Path(dst).name == "step_1":
            assert self.go.wait(60)
            self.at_commit = {s: signal.getsignal(s) for s in self.signals}
        super().rename(src, dst)


USER_SIGNALS = [signal.SIGUSR1, signal.SIGUSR2]


def _expected_at_commit(
    policies: list[asyncsave.SaveOnSignal], groups: list[list[int]], sent: set[int], s: int
) -> Any:
    """The handler on ``s`` during the flush: the innermost policy on ``s`` whose
    block caught a signal keeps its own (those outside it on ``s`` wait behind it);
    with none, the handler from before the blocks."""
    group_of = {i: g for g, members in enumerate(groups) for i in members}
    receivers = {max(i for i, p in enumerate(policies) if p.signals[0] == r) for r in sent}
    caught = {group_of[i] for i in receivers}
    inner_first = [i for i in reversed(range(len(policies))) if policies[i].signals[0] == s]
    held = [i for i in inner_first if group_of[i] in caught]
    return policies[held[0]]._handler if held else None


@settings(
    max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    signals=st.lists(st.sampled_from(USER_SIGNALS), min_size=1, max_size=3),
    send=st.sets(st.sampled_from(USER_SIGNALS)),
    joined=st.booleans(),
)
def test_caught_signals_keep_their_handlers_through_the_flush_then_every_one_goes_back(
    tmp_path: Path, signals: list[int], send: set[int], joined: bool
) -> None:
    """Stacked policy blocks (the same signal twice, or two signals; separate
    blocks or one ``|``) inside ``async with Checkpointer``, real signals sent to
    this process: a block that caught a signal leaves its handlers (and those of
    the blocks around it on the same signal) in place through the close's flush;
    a block that caught nothing restores at its end; after the close every
    handler from before is back, whatever the order of the blocks."""
    sent = send & set(signals)  # a user signal nobody handles would end pytest
    before = {s: signal.getsignal(s) for s in USER_SIGNALS}
    policies = [asyncsave.SaveOnSignal(s) for s in signals]
    n = len(policies)
    groups = [[0, 1], *([i] for i in range(2, n))] if joined and n > 1 else [[i] for i in range(n)]
    fs = _CommitGate(USER_SIGNALS)
    root = Path(tempfile.mkdtemp(dir=tmp_path))

    async def main() -> None:
        async with asyncsave.Checkpointer(root, filesystem=fs) as ckpt:
            with contextlib.ExitStack() as stack:
                for members in groups:
                    block: asyncsave.SavePolicy = policies[members[0]]
                    for i in members[1:]:
                        block = block | policies[i]
                    stack.enter_context(block)
                for s in sorted(sent):
                    os.kill(os.getpid(), s)
                assert all(any(p.received == s for p in policies) for s in sent)
                await ckpt.save(1, {"x": torch.zeros(2)})
            fs.go.set()

    anyio.run(main)
    for s in USER_SIGNALS:
        expected = _expected_at_commit(policies, groups, sent, s)
        assert fs.at_commit[s] == (before[s] if expected is None else expected), s
        assert signal.getsignal(s) == before[s]


@pytest.mark.slow
def test_a_second_ctrl_c_during_the_close_flush_is_reported_as_an_interruption(
    tmp_path: Path,
) -> None:
    """No policy: the first Ctrl-C ends the body, the second tears the event loop
    down while the close flushes step 5. The save's error says it was interrupted
    and how to keep such a save; it is no timeout (close_timeout_s never ran out)."""
    root, marks = tmp_path / "ckpt", tmp_path / "marks"
    marks.mkdir()
    cmd = [sys.executable, str(CHILD), str(root), str(marks), "plain", "SIGINT"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        _wait_for([marks / "ready", marks / "gate"], [proc])
        proc.send_signal(signal.SIGINT)
        _wait_for([marks / "flushing0"], [proc])
        proc.send_signal(signal.SIGINT)
        time.sleep(0.2)  # let the loop go down before the held commit goes ahead
        (marks / "go").touch()
        _, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
        proc.wait()
    assert "KeyboardInterrupt" in err
    assert "save of step 5 was interrupted before it committed" in err, err
    assert "SaveOnSignal(signal.SIGINT)" in err
    assert "ran out" not in err


def test_a_caught_signal_with_no_checkpointer_open_is_restored_at_the_end_of_the_block() -> None:
    """Nothing to flush (the policy outside every checkpointer, or after their
    close): the handler from before is back when the block ends."""
    before = signal.getsignal(signal.SIGUSR1)
    policy = asyncsave.SaveOnSignal(signal.SIGUSR1)
    with policy:
        os.kill(os.getpid(), signal.SIGUSR1)
        os.kill(os.getpid(), signal.SIGUSR1)
        assert policy.should_save(3) and policy.stop_requested
    assert signal.getsignal(signal.SIGUSR1) == before
    assert policy.repeats == 1


def test_a_policy_of_the_callers_own_is_closed_in_a_combination_and_by_agree(
    tmp_path: Path,
) -> None:
    """A policy that undoes its install in its own ``close()`` keeps being
    closed when combined with ``|`` or wrapped by ``ckpt.agree``."""

    class Counting(asyncsave.SavePolicy):
        def __init__(self) -> None:
            self.installed = 0

        def should_save(self, step: int) -> bool:
            return False

        def install(self) -> None:
            self.installed += 1

        def close(self) -> None:
            self.installed -= 1

    mine = Counting()
    with mine | asyncsave.SaveEvery(3):
        assert mine.installed == 1
    assert mine.installed == 0

    async def main() -> None:
        async with asyncsave.Checkpointer(tmp_path) as ckpt:
            with ckpt.agree(mine):
                assert mine.installed == 1
            assert mine.installed == 0

    anyio.run(main)


def _trainers_own(signum: int, frame: Any) -> None:
    """A handler the trainer installs for its own cleanup."""


@pytest.mark.parametrize(
    ("sig", "theirs"),
    [
        (signal.SIGUSR1, _trainers_own),
        (signal.SIGUSR2, signal.SIG_IGN),
        (signal.SIGINT, _trainers_own),
        (signal.SIGINT, signal.SIG_IGN),
    ],
    ids=["SIGUSR1 handler", "SIGUSR2 ignored", "SIGINT handler", "SIGINT ignored"],
)
@pytest.mark.parametrize("when", ["after the block", "inside the block"])
def test_a_handler_the_trainer_installs_later_is_left_in_place(
    tmp_path: Path, sig: signal.Signals, theirs: Any, when: str
) -> None:
    """The policy caught a signal and holds its handler through the close's flush;
    a handler the trainer installed since (after the block, or inside it) is the
    trainer's: the policy puts the one from before back only where its own is still
    installed."""
    before = signal.getsignal(sig)
    policy = asyncsave.SaveOnSignal(sig)

    async def main() -> None:
        async with asyncsave.Checkpointer(tmp_path) as ckpt:
            with policy:
                os.kill(os.getpid(), sig)
                assert policy.should_save(1)
                await ckpt.save(1, {"x": torch.zeros(2)})
                if when == "inside the block":
                    signal.signal(sig, theirs)
            if when == "after the block":
                assert signal.getsignal(sig) == policy._handler  # held through the flush
                signal.signal(sig, theirs)

    try:
        anyio.run(main)
        assert signal.getsignal(sig) == theirs
    finally:
        signal.signal(sig, before)


def test_a_second_policy_entered_after_a_held_one_puts_back_the_first_handler(
    tmp_path: Path,
) -> None:
    """The first policy's handler is held through the flush; a second block on the
    same signal replaces it and ends: after the close the handler from before both
    is back, not the first policy's (which would absorb every later signal)."""
    before = signal.getsignal(signal.SIGUSR1)
    first, second = asyncsave.SaveOnSignal(signal.SIGUSR1), asyncsave.SaveOnSignal(signal.SIGUSR1)

    async def main() -> None:
        async with asyncsave.Checkpointer(tmp_path) as ckpt:
            with first:
                os.kill(os.getpid(), signal.SIGUSR1)
                await ckpt.save(1, {"x": torch.zeros(2)})
            with second:
                assert signal.getsignal(signal.SIGUSR1) == second._handler

    try:
        anyio.run(main)
        assert signal.getsignal(signal.SIGUSR1) == before
    finally:
        signal.signal(signal.SIGUSR1, before)


@pytest.mark.parametrize(("inside", "after"), [(0, 3), (2, 0), (1, 2)])
def test_absorbed_repeats_are_reported_as_where_they_came(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, inside: int, after: int
) -> None:
    """Repeats inside the block, and repeats after it while the checkpointer is
    still open (no flush running yet: the trainer's work after the loop), are
    each reported as what they were; none is called a repeat during a flush."""
    before = signal.getsignal(signal.SIGINT)
    policy = asyncsave.SaveOnSignal(signal.SIGINT)

    async def main() -> None:
        async with asyncsave.Checkpointer(tmp_path) as ckpt:
            with policy:
                for _ in range(1 + inside):
                    os.kill(os.getpid(), signal.SIGINT)
                await ckpt.save(1, {"x": torch.zeros(2)})
            for _ in range(after):
                os.kill(os.getpid(), signal.SIGINT)

    try:
        with caplog.at_level(logging.WARNING, logger="asyncsave"):
            anyio.run(main)
    finally:
        signal.signal(signal.SIGINT, before)
    assert policy.repeats == inside + after
    text = caplog.text
    assert "while the saves were flushed" not in text
    assert (f"came {inside} more time(s) inside the policy's block" in text) == bool(inside)
    assert (f"came {after} more time(s) after the policy's block ended" in text) == bool(after)
    if after:
        assert "before the checkpointers open then had closed" in text
        assert "pending until their close committed it" in text
