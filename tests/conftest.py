"""Shared fixtures: every async test runs on asyncio, asyncio+uvloop and trio.

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


@pytest.fixture(
    params=[
        pytest.param(("asyncio", {}), id="asyncio"),
        pytest.param(("asyncio", {"use_uvloop": True}), id="uvloop"),
        pytest.param(("trio", {}), id="trio"),
    ]
)
def anyio_backend(request: pytest.FixtureRequest) -> tuple[str, dict[str, object]]:
    return request.param


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
