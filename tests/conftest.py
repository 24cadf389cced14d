"""Shared fixtures: every async test runs on asyncio, asyncio+uvloop and trio."""

from __future__ import annotations

import pytest
import torch


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
