"""The table of what combines (``asyncsave._combine``) and the job factory that
decides a save's staging mode from it.

Imports private modules for a reason: the table is data in the code, and each of
its rows is checked against the factory that reads it (``asyncsave._jobs.plain_job``)
in every context, several ranks and CUDA included, which a single CPU process
reaches only there. What a user sees (a refusal from ``save()``, the modes on
real saves) is tested through the public API below.
"""

# Private imports: unit tests of the private table of what combines and the rows it
# builds from a plan.
from __future__ import annotations

import contextlib
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import fsspec
import pytest
import torch

import asyncsave
from asyncsave import _combine, _jobs
from asyncsave._combine import Context, Row
from asyncsave._format import staging_nbytes
from asyncsave._incremental import Reuse, incremental_layout
from asyncsave._options import CheckpointOptions
from asyncsave._paths import LAYOUTS
from asyncsave._replan import Planner, plan_off_loop

DOCS = Path(__file__).resolve().parent.parent / "docs" / "guides" / "combinations.md"

# Options of CheckpointOptions that ask for each option of the table.
ASKS: dict[str, dict[str, Any]] = {
    "plain": {"overlap_writes": False, "direct_io": False},
    "overlap_writes=True": {"overlap_writes": True, "direct_io": False},
    "overlap_writes=None, lazy save": {"overlap_writes": None, "direct_io": False},
    "state over budget_bytes": {
        "overlap_writes": False,
        "direct_io": False,
        "budget_bytes": 8 << 20,
    },
    "incremental=True": {"overlap_writes": False, "direct_io": False, "incremental": True},
    "direct_io=True": {"overlap_writes": False, "direct_io": True},
}

JOB_OF_MODE = {
    "whole": _jobs.PlainJob,
    "following": _jobs.FollowingJob,
    "streamed": _jobs.StreamedJob,
    "incremental": _jobs.IncrementalJob,
}


def _concrete(row: Row) -> Context:
    """A context ``row`` matches (its first value where it says ``*``) that no
    earlier row of the same option answers."""
    for ctx in _combine.contexts():
        if _combine.lookup(row.option, ctx) is row:
            return ctx
    raise AssertionError(f"row {row} answers no context: an earlier row shadows it")


async def _factory(option: str, ctx: Context, tmp_path: Path) -> _jobs.PlainJob:
    """The job ``plain_job`` makes for a 32 MiB state asking ``option`` in ``ctx``."""
    state = {"w": torch.zeros(8 << 20), "b": torch.ones(4)}
    planner = Planner()
    plan, layouts, nbytes = await plan_off_loop(
        planner, state, allow_pickle=False, rank=0, max_files=2
    )
    if ctx.device == "cuda":  # what the factory reads of the plan's devices
        plan._devices = {torch.device("cuda", 0)}
    reuse = Reuse(tmp_path, LAYOUTS["asyncsave"])

    def relayout(p: Any) -> tuple[list[Any], int]:
        out = incremental_layout(p.entries, rank=0, own=reuse.split_rows(p))
        return out, staging_nbytes(out)

    return await _jobs.plain_job(
        plan,
        layouts,
        nbytes,
        options=CheckpointOptions(**ASKS[option]),
        root=tmp_path,
        world_size=2 if ctx.ranks == "several" else 1,
        renames=ctx.storage == "rename",
        reuse=reuse,
        rounds=planner.rounds,
        relayout=relayout,
    )


@pytest.mark.anyio
@pytest.mark.parametrize(
    "row", _combine.ROWS, ids=lambda r: f"{r.option}|{r.ranks}|{r.storage}|{r.device}"
)
async def test_every_row_of_the_table_is_what_the_factory_does(row: Row, tmp_path: Path) -> None:
    """Each row, in a context it answers: a supported row gives the job class of
    its mode (or, where the option picks no mode, a whole save); a refused row is
    a typed error that names the option and says why."""
    ctx = _concrete(row)
    if row.refused is not None:
        error = (
            asyncsave.StagingBudgetError
            if row.option == "state over budget_bytes"
            else asyncsave.CheckpointError
        )
        with pytest.raises(error) as info:
            await _factory(row.option, ctx, tmp_path)
        assert isinstance(info.value, ValueError)
        assert row.option in str(info.value) and row.refused in str(info.value)
        return
    job = await _factory(row.option, ctx, tmp_path)
    expected = JOB_OF_MODE[row.mode or "whole"]
    assert type(job) is expected, (row, type(job))
    assert job.mode == (row.mode or "whole")


def test_every_option_in_every_context_has_a_row() -> None:
    for option in _combine.OPTIONS:
        for ctx in _combine.contexts():
            row = _combine.lookup(option, ctx)
            assert row.mode in (None, *_combine.MODES)
            assert row.supported == (row.refused is None)
            assert row.supported or row.mode is None


def test_every_row_answers_some_context() -> None:
    for row in _combine.ROWS:
        _concrete(row)


def test_the_docs_page_is_the_table() -> None:
    """docs/guides/combinations.md is rendered from the table
    (``python docs/_tools/combinations.py`` writes it)."""
    assert DOCS.read_text() == _combine.markdown()


# -- what a user sees ---------------------------------------------------------------
@pytest.fixture
def mem_root() -> Iterator[str]:
    name = f"/asyncsave-combine-{uuid.uuid4().hex[:12]}"
    yield f"memory://{name}"
    mem = fsspec.filesystem("memory")
    with contextlib.suppress(FileNotFoundError):
        mem.rm(name, recursive=True)


@pytest.mark.anyio
@pytest.mark.parametrize("lazy", [False, True], ids=["eager", "lazy"])
async def test_overlap_writes_true_on_an_object_store_is_refused_and_nothing_is_lost(
    mem_root: str, lazy: bool
) -> None:
    """``overlap_writes=True`` cannot be honoured on a root that commits by marker
    (its files would be uploaded twice): save() says so, names the option, and the
    checkpointer goes on; the default (``None``) saves there as before."""
    state = {"w": torch.arange(1 << 16, dtype=torch.float32)}
    async with asyncsave.Checkpointer(mem_root, overlap_writes=True) as ckpt:
        with pytest.raises(asyncsave.CheckpointError, match="overlap_writes=True") as info:
            await ckpt.save(1, state, lazy=lazy)
        assert isinstance(info.value, ValueError)
        assert "commits by marker" in str(info.value)
        assert ckpt.pending_steps == []
    async with asyncsave.Checkpointer(mem_root) as ckpt:
        info2 = await (await ckpt.save(1, state, lazy=lazy))
    assert info2 is not None
    assert torch.equal(asyncsave.load(info2.path)["w"], state["w"])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.anyio
@pytest.mark.parametrize("lazy", [False, True], ids=["eager", "lazy"])
async def test_overlap_writes_true_with_cuda_tensors_is_refused(tmp_path: Path, lazy: bool) -> None:
    state = {"w": torch.ones(1 << 16, device="cuda")}
    async with asyncsave.Checkpointer(tmp_path, overlap_writes=True) as ckpt:
        with pytest.raises(asyncsave.CheckpointError, match="CUDA") as info:
            await ckpt.save(1, state, lazy=lazy)
        assert isinstance(info.value, ValueError)
    async with asyncsave.Checkpointer(tmp_path) as ckpt:
        assert await (await ckpt.save(1, state, lazy=lazy)) is not None


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("options", "mode"),
    [
        ({"overlap_writes": False}, "whole"),
        ({}, "following"),  # the default follows lazy saves only
        ({"overlap_writes": True}, "following"),
        ({"budget_bytes": 1 << 20}, "streamed"),
        ({"budget_bytes": 1 << 20, "overlap_writes": True}, "streamed"),
        ({"incremental": True}, "incremental"),
        ({"incremental": True, "overlap_writes": True}, "incremental"),
    ],
)
async def test_options_together_take_the_mode_of_the_precedence(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, options: dict[str, Any], mode: str
) -> None:
    """Several options on one save: the mode is the first of the precedence
    (streamed, incremental, following), and the bytes come back either way."""
    made: list[str] = []
    real = _jobs.plain_job

    async def recorded(*args: Any, **kwargs: Any) -> Any:
        job = await real(*args, **kwargs)
        made.append(job.mode)
        return job

    monkeypatch.setattr(_jobs, "FOLLOW_MIN_BYTES", 0)
    monkeypatch.setattr("asyncsave._admit.plain_job", recorded)
    state = {f"w{i}": torch.randn(1 << 17) for i in range(4)}
    async with asyncsave.Checkpointer(tmp_path, **options) as ckpt:
        info = await (await ckpt.save(1, state))
    assert made == [mode]
    assert info is not None
    loaded = asyncsave.load(info.path)
    assert all(torch.equal(loaded[k], v) for k, v in state.items())


def test_the_tiers_page_holds_the_table_of_what_combines_with_a_memory_tier() -> None:
    """docs/guides/tiers.md shows ``asyncsave._memtier.ROWS`` as they are, and
    every refused row is a refusal ``check_options`` or the facade raises
    (``tests/test_memory_tier.py`` makes each one)."""
    from asyncsave import _memtier

    page = (DOCS.parent / "tiers.md").read_text()
    assert _memtier.markdown() in page
    refused = [o for o, verdict, _ in _memtier.ROWS if verdict == "refused"]
    assert refused and all(
        isinstance(_memtier.refusal(o), asyncsave.UnsupportedCombinationError) for o in refused
    )
