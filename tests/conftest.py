"""Shared fixtures.

Async tests run on asyncio; the modules whose subject is the event loop itself
(the engine, close and its flush, cancellation and hangs, ordering of saves, lazy
staging, writing while staging) run on asyncio, asyncio+uvloop and trio, where a
backend difference could change the outcome. ``ASYNCSAVE_ALL_BACKENDS=1`` runs
every async test on all three.

The ``leakcheck`` plugin fails the run when a process the suite started is still
alive at its end (S23; see ``tests/leakcheck.py``).
"""

from __future__ import annotations

import json
import os
from typing import Any

import pytest
import torch
from hypothesis import settings

pytest_plugins = ["leakcheck"]


_BACKENDS = [
    pytest.param(("asyncio", {}), id="asyncio"),
    pytest.param(("asyncio", {"use_uvloop": True}), id="uvloop"),
    pytest.param(("trio", {}), id="trio"),
]
# Test modules about the event loop: the engine, close, cancellation and hangs.
_ALL_BACKEND_MODULES = frozenset(
    {
        "test_engine",
        "test_close_flush",
        "test_hangs",
        "test_ordering",
        "test_lazy",
        "test_overlap_writes",
        "test_policy",
        "test_sync",
    }
)


@pytest.fixture
def anyio_backend() -> tuple[str, dict[str, object]]:
    """Overridden by the parametrization below (anyio's own fixture runs every backend)."""
    return ("asyncio", {})


def _parametrized_by_the_test(metafunc: pytest.Metafunc) -> bool:
    for mark in metafunc.definition.iter_markers("parametrize"):
        names = mark.args[0]
        if isinstance(names, str):
            names = [n.strip() for n in names.split(",")]
        if "anyio_backend" in names:
            return True
    return False


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "anyio_backend" not in metafunc.fixturenames or _parametrized_by_the_test(metafunc):
        return
    module = metafunc.module.__name__.rpartition(".")[2]
    every = module in _ALL_BACKEND_MODULES or os.environ.get("ASYNCSAVE_ALL_BACKENDS") == "1"
    metafunc.parametrize("anyio_backend", _BACKENDS if every else _BACKENDS[:1])


@pytest.fixture(autouse=True)
def _deterministic() -> None:
    torch.manual_seed(0)


def cuda_available() -> bool:
    return torch.cuda.is_available()


def pytest_terminal_summary(terminalreporter: Any) -> None:
    from reliability import COUNTS

    if not COUNTS:
        return
    terminalreporter.section("reliability counts")
    for name, n in sorted(COUNTS.items()):
        terminalreporter.write_line(f"{name:28s} {n}")
    out = os.environ.get("ASYNCSAVE_RELIABILITY_JSON")
    if out:
        with open(out, "w") as f:
            json.dump(COUNTS, f, indent=1, sort_keys=True)


# Hypothesis: bounded in CI; ASYNCSAVE_FUZZ_PROFILE=long for a longer local run.
settings.register_profile("ci", max_examples=200, deadline=None)
settings.register_profile("long", max_examples=20_000, deadline=None)
settings.load_profile(os.environ.get("ASYNCSAVE_FUZZ_PROFILE", "ci"))
