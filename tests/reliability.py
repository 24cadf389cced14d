"""Counts the reliability suites report (kill points, random crash runs, power-loss
states, injected faults, bad inputs). Each suite records what it actually ran and
asserts its own minimum; ``conftest.py`` prints the totals at the end of the run
(and writes them as JSON to ``$ASYNCSAVE_RELIABILITY_JSON`` if set), which is where
the README's Reliability figures come from."""

from __future__ import annotations

COUNTS: dict[str, int] = {}


def record(name: str, n: int) -> None:
    COUNTS[name] = COUNTS.get(name, 0) + n
