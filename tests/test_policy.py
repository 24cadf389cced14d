"""Save policies, with a fake clock and real signals."""

from __future__ import annotations

import os
import signal
from typing import Any

import pytest

import asyncsave


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _run(policy: asyncsave.SavePolicy, steps: range, on_step: Any = None) -> tuple[list[int], int]:
    """A pump: returns the steps saved and the last step trained."""
    saved: list[int] = []
    last = steps.start - 1
    for step in steps:
        if on_step is not None:
            on_step(step)
        last = step
        if policy.should_save(step):
            saved.append(step)
        if policy.stop_requested:
            break
    return saved, last


def test_save_every_n_never_at_zero() -> None:
    assert _run(asyncsave.SaveEvery(3), range(0, 10)) == ([3, 6, 9], 9)


def test_save_at_the_last_step_combined_with_every() -> None:
    policy = asyncsave.SaveEvery(4) | asyncsave.SaveAtStep(10)
    assert _run(policy, range(1, 11)) == ([4, 8, 10], 10)


def test_deadline_saves_once_allowing_for_the_measured_step_time() -> None:
    clock = FakeClock()
    policy = asyncsave.SaveBeforeDeadline(100.0, reserve_s=5.0, clock=clock)

    def tick(step: int) -> None:
        clock.now = step * 7.0  # each step takes 7 s

    # after step 12 (t=84) another step + reserve ends at 96 < 100: go on;
    # after step 13 (t=91): 91 + 7 + 5 >= 100: save now and stop.
    assert _run(policy, range(1, 100), tick) == ([13], 13)
    assert policy.stop_requested


def test_deadline_uses_the_slowest_recent_step() -> None:
    """Steps speed up from 10 s to 5 s. Judging by the last
    step alone (5 s) it would wait for step 10 (t=75) and miss; the slowest of the
    last four (10 s) fires at step 9 (t=70: 70 + 10 >= 80)."""
    clock = FakeClock()
    policy = asyncsave.SaveBeforeDeadline(80.0, clock=clock, window=4)
    times = dict(zip(range(1, 12), [0, 10, 20, 30, 40, 50, 60, 65, 70, 75, 80], strict=True))

    def tick(step: int) -> None:
        clock.now = float(times[step])

    assert _run(policy, range(1, 12), tick) == ([9], 9)


def test_deadline_that_has_passed_fires_at_once_without_saving_step_zero() -> None:
    clock = FakeClock()
    clock.now = 500.0
    policy = asyncsave.SaveBeforeDeadline(100.0, clock=clock)
    assert not policy.should_save(0)
    assert policy.stop_requested
    assert not policy.should_save(1)  # once


def test_sigterm_saves_at_the_next_step_boundary_then_stops() -> None:
    policy = asyncsave.SaveEvery(100) | asyncsave.SaveOnSignal(signal.SIGTERM)
    previous = signal.getsignal(signal.SIGTERM)

    def tick(step: int) -> None:
        if step == 7:
            os.kill(os.getpid(), signal.SIGTERM)  # delivered to the handler at once

    with policy:
        assert signal.getsignal(signal.SIGTERM) is not previous
        assert _run(policy, range(1, 1000), tick) == ([7], 7)
    assert signal.getsignal(signal.SIGTERM) is previous


def test_signal_policy_saves_once_and_trigger_works_without_a_signal() -> None:
    policy = asyncsave.SaveOnSignal(signal.SIGUSR1)
    assert not policy.should_save(3) and not policy.stop_requested
    policy.trigger(signal.SIGUSR1)
    assert policy.should_save(4) and policy.stop_requested
    assert not policy.should_save(5)


@pytest.mark.parametrize(
    "make",
    [
        lambda: asyncsave.SaveEvery(0),
        lambda: asyncsave.SaveEvery(2.0),
        lambda: asyncsave.SaveAtStep(0),
        lambda: asyncsave.SaveAtStep([3, -1]),
        lambda: asyncsave.SaveBeforeDeadline(10, reserve_s=-1),
    ],
)
def test_bad_policy_arguments_are_value_errors(make: Any) -> None:
    with pytest.raises(ValueError):
        make()


def test_bad_steps_are_value_errors() -> None:
    with pytest.raises(ValueError):
        asyncsave.SaveEvery(2).should_save(-1)
    with pytest.raises(ValueError):
        asyncsave.SaveEvery(2).should_save(True)  # type: ignore[arg-type]


def test_a_signal_between_should_save_and_the_stop_check_is_not_dropped() -> None:
    """The signal lands after should_save(7) said no: the pump must not stop before
    the next boundary has saved."""
    sig = asyncsave.SaveOnSignal(signal.SIGUSR1)
    policy = asyncsave.SaveEvery(100) | sig
    assert not policy.should_save(7)
    sig.trigger(signal.SIGUSR1)
    assert not policy.stop_requested  # not yet: nothing saved since the signal
    assert policy.should_save(8) and policy.stop_requested


def test_deadline_times_the_first_step_from_install_and_honours_expected_step() -> None:
    clock = FakeClock()
    policy = asyncsave.SaveBeforeDeadline(100.0, clock=clock)
    clock.now = 50.0
    with policy:  # the run (re)starts at t=50
        clock.now = 95.0  # the first step took 45 s: another would end past 100
        assert policy.should_save(1) and policy.stop_requested
    for floor, fires in ((30.0, True), (0.0, False)):
        clock = FakeClock()
        policy = asyncsave.SaveBeforeDeadline(100.0, clock=clock, expected_step_s=floor)
        clock.now = 69.0
        with policy:
            clock.now = 70.0  # a quick first step (1 s); the floor says steps take 30 s
            assert policy.should_save(1) is fires
    with pytest.raises(ValueError):
        asyncsave.SaveBeforeDeadline(100.0, reserve_s=float("nan"))


def test_closing_restores_a_handler_not_installed_from_python(monkeypatch: Any) -> None:
    calls: list[Any] = []
    real = signal.signal

    def fake_signal(sig: int, handler: Any) -> Any:
        calls.append(handler)
        previous = real(sig, handler)
        return None if len(calls) == 1 else previous  # as for a C-installed handler

    monkeypatch.setattr(signal, "signal", fake_signal)
    policy = asyncsave.SaveOnSignal(signal.SIGUSR2)
    with policy:
        pass
    assert calls[-1] is signal.SIG_DFL
