"""asyncsave.dcp as a drop-in for DCP's FileSystemWriter / FileSystemReader.

Each test here mirrors a behaviour that a test file of PyTorch's DCP suite
(``test/distributed/checkpoint/`` for torch 2.13) checks with DCP's own file-system
backend, and checks it through DCP's public API (``dcp.save``, ``dcp.async_save``,
``dcp.load``, the default planners, ``checkpoint_id``, ``Metadata``) with
:class:`asyncsave.dcp.StorageWriter` / :class:`~asyncsave.dcp.StorageReader` instead.
Where the outcome does not depend on the backend, the same flow also runs through
``FileSystemWriter`` / ``FileSystemReader`` and the two results must be equal.

PyTorch's test files are not vendored (their code stays out of this repository);
these tests are written from the behaviours. ``docs/dcp_conformance.md`` maps every
PyTorch test to the test here that mirrors it and lists each intended difference
with its reason (a step names the directory, an existing step is refused, no
``use_collectives=False`` on several ranks, ...).

Tests of several ranks run on 2 forked gloo ranks (``tests/distributed.py``). Forking
and joining a group is the slow part, so one module-scoped run executes every
two-rank case (each in its own root) and each test asserts on its own case.
"""

from __future__ import annotations

import errno
import io
import sys
import threading
import time
import traceback
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn
from torch.distributed.checkpoint import (
    DefaultLoadPlanner,
    DefaultSavePlanner,
    FileSystemReader,
    FileSystemWriter,
)
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

import asyncsave
from asyncsave import LocalFileSystem
from asyncsave.dcp import StorageReader, StorageWriter
from asyncsave.testing import LAYOUT_NAMES, checkpoint_dir_name

sys.path.insert(0, str(Path(__file__).parent))
from distributed import run_ranks, stop_dcp_background_process, values

pytestmark = [
    pytest.mark.filterwarnings("ignore:torch.distributed is disabled"),
    pytest.mark.filterwarnings("ignore:torch.distributed is unavailable or uninitialized"),
    pytest.mark.filterwarnings("ignore:`save_state_dict` is deprecated:FutureWarning"),
    pytest.mark.filterwarnings("ignore:`load_state_dict` is deprecated:FutureWarning"),
    pytest.mark.filterwarnings("ignore:Detected an existing checkpoint"),
]

TRACKER = "latest_checkpointed_iteration.txt"


# --------------------------------------------------------------------- helpers


def save(state: dict[str, Any], root: Path, step: int, **kwargs: Any) -> Any:
    return dcp.save(state, storage_writer=StorageWriter(root, step), **kwargs)


def load(state: dict[str, Any], path: Path, **kwargs: Any) -> None:
    dcp.load(state, storage_reader=StorageReader(path), **kwargs)


def temp_dirs(root: Path) -> list[str]:
    if not root.exists():
        return []
    return sorted(p.name for p in root.iterdir() if p.name.startswith(".asyncsave-tmp"))


def tracked(root: Path) -> int:
    return int((root / TRACKER).read_text().strip())


def assert_same(a: Any, b: Any, where: str = "") -> None:
    """Equal trees; tensors equal bit for bit and in dtype."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), where
        assert a.dtype == b.dtype and a.shape == b.shape, where
        flat_a = a.detach().contiguous().reshape(-1).view(torch.uint8)
        flat_b = b.detach().contiguous().reshape(-1).view(torch.uint8)
        assert torch.equal(flat_a, flat_b), where
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), where
        for k in a:
            assert_same(a[k], b[k], f"{where}/{k}")
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same(x, y, f"{where}/{i}")
    elif isinstance(a, io.BytesIO):
        assert isinstance(b, io.BytesIO) and a.getvalue() == b.getvalue(), where
    else:
        assert a == b, where


Backend = Callable[[Path], tuple[Any, Any]]


def _asyncsave_backend(root: Path) -> tuple[Any, Any]:
    return StorageWriter(root, 1), StorageReader(root)


def _filesystem_backend(root: Path) -> tuple[Any, Any]:
    return FileSystemWriter(root), FileSystemReader(root)


def _outcome(flow: Callable[[Any, Any], Any], writer: Any, reader: Any) -> tuple[str, Any]:
    """``("ok", value)``, or ``("raised", {rank: (type name, message)})`` for DCP's
    ``CheckpointException`` (its traceback text names each backend's files)."""
    try:
        return "ok", flow(writer, reader)
    except CheckpointException as exc:
        return "raised", {r: (type(e).__name__, str(e)) for r, (e, _tb) in exc.failures.items()}


def on_both_backends(
    tmp_path: Path, flow: Callable[[Any, Any], Any], *, may_raise: bool = False
) -> Any:
    """Run ``flow(writer, reader)`` with DCP's file-system backend and with
    asyncsave's; the outcomes (values, or the errors DCP raised on each rank when
    ``may_raise``) must be equal. Returns asyncsave's value."""
    fs_kind, fs_value = _outcome(flow, *_filesystem_backend(tmp_path / "filesystem"))
    ours_kind, ours_value = _outcome(flow, *_asyncsave_backend(tmp_path / "asyncsave"))
    assert ours_kind == fs_kind, (ours_value, fs_value)
    if ours_kind == "raised":
        assert may_raise, ours_value
        assert ours_value == fs_value
        return None
    assert_same(ours_value, fs_value)
    return ours_value


def caching_planner() -> DefaultSavePlanner:
    """A plan-caching planner with caches of its own: DCP keys its class-level plan
    caches by the planner's class name, so each test gets a class of its own."""
    cls = type(f"CachingPlanner{uuid.uuid4().hex}", (DefaultSavePlanner,), {})
    planner: DefaultSavePlanner = cls(enable_plan_caching=True)
    return planner


class Net(nn.Module):
    """A small MLP with a buffer (the model the DCP tests train a step or two)."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.inp = nn.Linear(8, 16)
        self.mid = nn.Linear(16, 16)
        self.out = nn.Linear(16, 4)
        self.register_buffer("scale", torch.rand(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.inp(x))
        return self.out(torch.relu(self.mid(h))) * self.scale


def train(model: nn.Module, optim: torch.optim.Optimizer, steps: int, seed: int) -> list[float]:
    gen = torch.Generator().manual_seed(seed)
    losses = []
    for _ in range(steps):
        loss = model(torch.rand(6, 8, generator=gen)).pow(2).mean()
        loss.backward()
        optim.step()
        optim.zero_grad()
        losses.append(loss.item())
    return losses


class Counters:
    """A Stateful object (``state_dict`` / ``load_state_dict``) with a tensor and a
    byte item (a ``BytesIO``, as training loops keep their loss history)."""

    def __init__(self, step: int = 0, history: list[float] | None = None) -> None:
        self.step = step
        self.history = list(history or [])
        self.loaded = False

    def state_dict(self) -> dict[str, Any]:
        blob = io.BytesIO()
        torch.save(self.history, blob)
        return {"step": torch.tensor(self.step), "history": blob}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.loaded = True
        self.step = int(state["step"])
        state["history"].seek(0)
        self.history = torch.load(state["history"])


# ------------------------------------------ test_file_system_checkpoint_cpu.py


@pytest.mark.parametrize("api", ["save", "save_state_dict"])
def test_module_state_dict_round_trips(tmp_path: Path, api: str) -> None:
    saved = Net(seed=1).state_dict()
    target = Net(seed=2).state_dict()
    assert not torch.equal(saved["inp.weight"], target["inp.weight"])
    if api == "save":
        save(saved, tmp_path, 1)
        load(target, tmp_path)
    else:  # the deprecated pair, single process (no_dist=True)
        from torch.distributed.checkpoint import load_state_dict, save_state_dict

        save_state_dict(saved, StorageWriter(tmp_path, 1), no_dist=True)
        load_state_dict(target, StorageReader(tmp_path), no_dist=True)
    assert_same(target, saved)


@pytest.mark.parametrize(
    ("saved_dtype", "template_dtype"),
    [
        (torch.float32, torch.bfloat16),
        (torch.bfloat16, torch.float32),
        (torch.float64, torch.float16),
    ],
)
def test_load_casts_to_the_dtype_of_the_template(
    tmp_path: Path, saved_dtype: torch.dtype, template_dtype: torch.dtype
) -> None:
    w = torch.rand(4, 3, dtype=saved_dtype)

    def flow(writer: Any, reader: Any) -> torch.Tensor:
        dcp.save({"w": w}, storage_writer=writer)
        target = {"w": torch.zeros(4, 3, dtype=template_dtype)}
        dcp.load(target, storage_reader=reader)
        return target["w"]

    got = on_both_backends(tmp_path, flow)
    assert got.dtype == template_dtype and torch.equal(got, w.to(template_dtype))


class Blob:
    """A Stateful object holding one ``bytes`` value."""

    def __init__(self, value: bytes) -> None:
        self.state = {"blob": value}

    def state_dict(self) -> dict[str, Any]:
        return self.state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.state = state


def test_stateful_blob_and_tensors_round_trip(tmp_path: Path) -> None:
    state: dict[str, Any] = dict(Net(seed=1).state_dict())
    state["blob"] = Blob(b"\x00some bytes for testing\xff" * 100)
    save(state, tmp_path, 1)
    target: dict[str, Any] = dict(Net(seed=2).state_dict())
    target["blob"] = Blob(b"")
    load(target, tmp_path)
    assert target["blob"].state == state["blob"].state
    assert_same(
        {k: v for k, v in target.items() if k != "blob"},
        {k: v for k, v in state.items() if k != "blob"},
    )


def test_dtypes_and_memory_layouts_round_trip_bit_exactly(tmp_path: Path) -> None:
    """What ``FileSystemWriter`` gets from ``torch.save``: any dtype, views,
    non-contiguous tensors, 0-dim tensors, parameters."""
    gen = torch.Generator().manual_seed(3)
    base = torch.rand(4, 6, generator=gen) * 100
    state: dict[str, Any] = {
        str(dt): base.to(dt)
        for dt in (
            torch.float8_e4m3fn,
            torch.float8_e5m2,
            torch.bfloat16,
            torch.float16,
            torch.float64,
            torch.uint16,
            torch.uint32,
            torch.uint64,
            torch.int8,
            torch.int16,
            torch.uint8,
            torch.bool,
        )
    }
    state["complex64"] = torch.randn(3, 5, dtype=torch.complex64, generator=gen)
    state["complex128"] = torch.randn(3, dtype=torch.complex128, generator=gen)
    state["transposed"] = base.t()
    state["strided_view"] = torch.arange(100.0)[10:40:3]
    state["scalar"] = torch.tensor(2.5)
    state["empty"] = torch.empty(0, 3)
    state["param"] = nn.Parameter(torch.rand(5, generator=gen))

    def flow(writer: Any, reader: Any) -> dict[str, Any]:
        dcp.save(state, storage_writer=writer)
        target = {k: torch.zeros_like(v.detach()) for k, v in state.items()}
        dcp.load(target, storage_reader=reader)
        return target

    got = on_both_backends(tmp_path, flow)
    assert_same(got, {k: v.detach() for k, v in state.items()})


# ------------------------------------------------------ test_save_load_api.py


def test_checkpoint_id_is_the_root_and_the_step_names_the_directory(tmp_path: Path) -> None:
    state = {"w": torch.arange(6.0)}
    # checkpoint_id given to dcp.save replaces the writer's root (its reset()).
    dcp.save(state, checkpoint_id=tmp_path / "run", storage_writer=StorageWriter(tmp_path / "x", 3))
    assert (tmp_path / "run" / "step_3").is_dir() and not (tmp_path / "x").exists()
    target = {"w": torch.zeros(6)}
    dcp.load(target, checkpoint_id=tmp_path / "run", storage_reader=StorageReader(tmp_path / "y"))
    assert torch.equal(target["w"], state["w"])
    # Never picked by DCP's auto-detection: a path alone means DCP's own backend.
    assert not StorageWriter.validate_checkpoint_id(tmp_path / "run")
    assert not StorageReader.validate_checkpoint_id(tmp_path / "run")


# ------------------------------------------- test_planner.py (plan caching)


def test_plan_caching_commits_every_step_with_its_own_data(tmp_path: Path) -> None:
    """``DefaultSavePlanner(enable_plan_caching=True)``, a fresh writer per save:
    the second save reuses the cached plan (DCP scatters empty, unusable plans),
    the third changes a shape (a new plan), the fourth reuses that one."""
    planner = caching_planner()
    states = {
        1: {"w": torch.full((4,), 1.0), "b": torch.arange(3)},
        2: {"w": torch.full((4,), 2.0), "b": torch.arange(3) + 10},
        3: {"w": torch.full((6,), 3.0), "b": torch.arange(3) + 20},
        4: {"w": torch.full((6,), 4.0), "b": torch.arange(3) + 30},
    }
    for step, state in states.items():
        save(state, tmp_path, step, planner=planner)
    assert tracked(tmp_path) == 4 and temp_dirs(tmp_path) == []
    for step, state in states.items():
        target = {k: torch.zeros_like(v) for k, v in state.items()}
        load(target, tmp_path / f"step_{step}")
        assert_same(target, state, f"step {step}")


# ------------------------------------------------------ test_compatibility.py


def test_metadata_records_the_checkpoint_id_and_a_save_id(tmp_path: Path) -> None:
    """DCP's writer sets ``Metadata.storage_meta`` (checkpoint id, a save id new
    for every save); readers see it in ``read_metadata()``."""
    first = save({"w": torch.ones(2)}, tmp_path, 1)
    second = save({"w": torch.ones(2)}, tmp_path, 2)
    for step, md in ((1, first), (2, second)):
        meta = md.storage_meta
        assert meta is not None, f"step {step}: no storage_meta"
        assert isinstance(meta.save_id, str) and meta.save_id
        assert str(meta.checkpoint_id) in (str(tmp_path), str(tmp_path / f"step_{step}"))
        stored = StorageReader(tmp_path / f"step_{step}").read_metadata().storage_meta
        assert stored is not None
        assert (stored.save_id, stored.checkpoint_id) == (meta.save_id, meta.checkpoint_id)
    assert first.storage_meta.save_id != second.storage_meta.save_id


def test_reader_records_its_load_id_in_storage_meta(tmp_path: Path) -> None:
    save({"w": torch.ones(2)}, tmp_path, 1)
    reader = StorageReader(tmp_path)
    meta = reader.read_metadata().storage_meta
    assert meta is not None and meta.load_id == reader.load_id
    reader.reset()  # a new load (dcp.load calls it when given a checkpoint_id)
    again = reader.read_metadata().storage_meta
    assert again is not None and again.load_id == reader.load_id != meta.load_id


def test_read_metadata_lists_what_is_stored(tmp_path: Path) -> None:
    """``list_stored_state_dict`` (newer than 2.13) reads this same metadata."""
    save({"weight": torch.rand(4, 4), "epoch": io.BytesIO(b"TrainingEpoch:4")}, tmp_path, 1)
    md = StorageReader(tmp_path).read_metadata().state_dict_metadata
    assert isinstance(md["weight"], TensorStorageMetadata)
    assert md["weight"].size == torch.Size([4, 4])
    assert md["weight"].properties.dtype == torch.float32
    assert isinstance(md["epoch"], BytesStorageMetadata)


# -------------------------------------------- e2e/test_e2e_save_and_load.py


def _async_save(state: dict[str, Any], writer: StorageWriter, with_stager: bool) -> None:
    if not with_stager:
        dcp.async_save(state, storage_writer=writer).result()
        return
    stager = DefaultStager(StagingOptions(False, False, False, False))  # CPU: no pinning
    try:
        response = dcp.async_save(state, storage_writer=writer, async_stager=stager)
        future = getattr(response, "upload_completion", response)
        future.result()
    finally:
        stager.close()


@pytest.mark.parametrize("mode", ["save", "async_save", "async_save_with_stager"])
def test_train_save_load_and_continue_like_the_uninterrupted_run(tmp_path: Path, mode: str) -> None:
    model = Net(seed=0)
    optim = torch.optim.Adam(model.parameters(), lr=0.1)
    counters = Counters()
    for loss in train(model, optim, 2, seed=5):
        counters.step += 1
        counters.history.append(loss)
    msd, osd = get_state_dict(model, optim)  # keyed by parameter names
    state = {"model": msd, "optim": osd, "counters": counters}
    writer = StorageWriter(tmp_path, counters.step)
    if mode == "save":
        dcp.save(state, storage_writer=writer)
    else:
        _async_save(state, writer, with_stager=mode == "async_save_with_stager")

    model2 = Net(seed=9)
    optim2 = torch.optim.Adam(model2.parameters(), lr=0.1)
    counters2 = Counters()
    msd, osd = get_state_dict(model2, optim2)
    loaded = {"model": msd, "optim": osd, "counters": counters2}
    load(loaded, tmp_path)
    set_state_dict(model2, optim2, model_state_dict=msd, optim_state_dict=osd)
    assert (counters2.loaded, counters2.step, counters2.history) == (
        True,
        counters.step,
        counters.history,
    )
    # One more step on both: the same loss, bit for bit, and the same state.
    assert train(model2, optim2, 1, seed=7) == train(model, optim, 1, seed=7)
    assert_same(get_state_dict(model2, optim2), get_state_dict(model, optim))


def test_stateful_loads_in_place_and_plain_entries_are_replaced(tmp_path: Path) -> None:
    class Recording(dict):  # type: ignore[type-arg]
        assigned = False

        def __setitem__(self, key: Any, value: Any) -> None:
            self.assigned = True
            super().__setitem__(key, value)

    counters = Counters(step=3, history=[0.5])
    state = Recording(counters=counters)
    state.assigned = False
    save(state, tmp_path, 1)
    load(state, tmp_path)
    assert counters.loaded and state["counters"] is counters and not state.assigned

    plain = Recording(x={"t": torch.rand(3, 3), "items": [1, 2, 3]})
    plain.assigned = False
    save(plain, tmp_path, 2)
    load(plain, tmp_path)
    assert plain.assigned


def test_empty_state_dict_saves_and_loads(tmp_path: Path) -> None:
    def flow(writer: Any, reader: Any) -> dict[str, Any]:
        md = dcp.save({}, storage_writer=writer)
        target: dict[str, Any] = {}
        dcp.load(target, storage_reader=reader)
        return {"keys": sorted(md.state_dict_metadata), "loaded": target}

    on_both_backends(tmp_path, flow)
    assert asyncsave.verify(tmp_path / "asyncsave" / "step_1").step == 1


def test_partial_load_by_state_dict_and_by_keys(tmp_path: Path) -> None:
    """A checkpoint of model and optimizer; load the model alone, then only some
    keys with DCP's ``_load_state_dict_from_keys`` (no template needed)."""
    model = Net(seed=0)
    optim = torch.optim.Adam(model.parameters(), lr=0.1)
    train(model, optim, 2, seed=1)
    saved = {
        "model": get_model_state_dict(model),
        "optimizer": get_optimizer_state_dict(model, optim),
    }

    def flow(writer: Any, reader: Any) -> dict[str, Any]:
        dcp.save(saved, storage_writer=writer)
        only_model = {"model": get_model_state_dict(Net(seed=4))}
        dcp.load(only_model, storage_reader=reader)
        by_key = _load_state_dict_from_keys("model", storage_reader=reader)
        optim_state = _load_state_dict_from_keys("optimizer.state", storage_reader=reader)
        everything = _load_state_dict_from_keys(storage_reader=reader)  # dcp_to_torch_save's way
        return {
            "only_model": only_model,
            "by_key": by_key,
            "optim_state": optim_state,
            "everything": everything,
        }

    got = on_both_backends(tmp_path, flow)
    assert_same(got["only_model"]["model"], saved["model"])
    assert_same(got["by_key"], {"model": saved["model"]})
    assert "param_groups" not in got["optim_state"]["optimizer"]
    assert_same(got["optim_state"]["optimizer"]["state"], saved["optimizer"]["state"])
    assert_same(got["everything"], saved)


def _refusal(load: Callable[[], Any]) -> dict[int, tuple[str, str]]:
    """The errors DCP raised on each rank of a ``load`` that must fail."""
    with pytest.raises(CheckpointException) as info:
        load()
    return {r: (type(e).__name__, str(e)) for r, (e, _tb) in info.value.failures.items()}


def test_load_planner_refuses_missing_keys_and_other_sizes_unless_partial(
    tmp_path: Path,
) -> None:
    """``DefaultLoadPlanner``'s checks against the stored metadata: an entry the
    checkpoint lacks loads with ``allow_partial_load=True`` (the rest is read), is
    "Missing key in checkpoint" without it; another shape is "Size mismatch". The
    same refusals, word for word, on both backends."""
    torch.manual_seed(0)
    original = nn.Linear(2, 2)

    def flow(writer: Any, reader: Any) -> dict[str, Any]:
        dcp.save({"module": original}, storage_writer=writer)
        torch.manual_seed(1)  # the same untouched entry on both backends
        extra = nn.Linear(2, 2)
        extra.extra_param = nn.Parameter(torch.randn(2, 2))
        partial = DefaultLoadPlanner(allow_partial_load=True)
        dcp.load({"module": extra}, storage_reader=reader, planner=partial)
        strict = DefaultLoadPlanner(allow_partial_load=False)
        return {
            "partial": {k: v.detach().clone() for k, v in extra.state_dict().items()},
            "missing": _refusal(
                lambda: dcp.load({"module": extra}, storage_reader=reader, planner=strict)
            ),
            "size": _refusal(lambda: dcp.load({"module": nn.Linear(3, 2)}, storage_reader=reader)),
        }

    got = on_both_backends(tmp_path, flow)
    assert_same(got["partial"]["weight"], original.weight.detach())
    assert_same(got["partial"]["bias"], original.bias.detach())
    assert "Missing key in checkpoint" in str(got["missing"])
    assert "Size mismatch" in str(got["size"])


def test_a_saved_step_is_refused_and_the_root_is_left_as_it_was(tmp_path: Path) -> None:
    """DCP's writer overwrites a checkpoint (``overwrite=True``, with a warning);
    asyncsave never replaces a committed step: the save fails, the committed
    checkpoint, the tracker and the root stay as they were. A new step is the way
    to save again."""
    first, second = torch.randn(10), torch.randn(10)
    save({"random": first}, tmp_path, 1)
    before = sorted(p.name for p in tmp_path.iterdir())
    with pytest.raises(CheckpointException, match="exists already"):
        save({"random": second}, tmp_path, 1)
    assert temp_dirs(tmp_path) == []
    assert sorted(p.name for p in tmp_path.iterdir()) == before
    assert tracked(tmp_path) == 1
    target = {"random": torch.zeros(10)}
    load(target, tmp_path)
    assert torch.equal(target["random"], first)
    save({"random": second}, tmp_path, 2)
    load(target, tmp_path)
    assert torch.equal(target["random"], second)


def test_load_is_in_place_and_restores_param_groups(tmp_path: Path) -> None:
    model = Net(seed=0)
    optim = torch.optim.Adam(model.parameters(), lr=0.1)
    train(model, optim, 1, seed=2)
    save(
        {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, optim)},
        tmp_path,
        1,
    )
    model2 = Net(seed=0)
    optim2 = torch.optim.Adam(model2.parameters(), lr=0.2)  # not a tensor: a byte item
    msd, osd = get_model_state_dict(model2), get_optimizer_state_dict(model2, optim2)
    target = {"model": msd, "optim": osd}
    load(target, tmp_path)
    assert target["model"] is msd and target["optim"] is osd
    set_state_dict(model2, optim2, model_state_dict=msd, optim_state_dict=osd)
    assert optim2.param_groups[0]["lr"] == 0.1
    assert_same(get_model_state_dict(model2), get_model_state_dict(model))
    assert_same(get_optimizer_state_dict(model2, optim2), get_optimizer_state_dict(model, optim))


# ------------------------------------ test_state_dict.py (single process parts)


@pytest.mark.parametrize(
    "make_optim",
    [
        lambda p: torch.optim.Adam(p, lr=1e-2),
        lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.1),
        lambda p: torch.optim.SGD(p, lr=1e-2, momentum=0.9),
    ],
    ids=["Adam", "AdamW", "SGD"],
)
def test_get_state_dict_save_load_set_state_dict(
    tmp_path: Path, make_optim: Callable[[Any], torch.optim.Optimizer]
) -> None:
    model = Net(seed=0)
    optim = make_optim(model.parameters())
    train(model, optim, 3, seed=4)
    msd, osd = get_state_dict(model, optim)
    save({"model": msd, "optim": osd}, tmp_path, 3)

    fresh = Net(seed=8)
    fresh_optim = make_optim(fresh.parameters())
    msd2, osd2 = get_state_dict(fresh, fresh_optim)  # initialises optimizer state
    load({"model": msd2, "optim": osd2}, tmp_path)
    set_state_dict(fresh, fresh_optim, model_state_dict=msd2, optim_state_dict=osd2)
    assert_same(get_state_dict(fresh, fresh_optim), get_state_dict(model, optim))
    assert_same(fresh_optim.state_dict(), optim.state_dict())


# ------------------------------- test_nested_dict.py, test_traverse.py (flows)


@pytest.mark.parametrize("flatten", [True, False])
def test_nested_containers_load_as_with_dcps_backend(tmp_path: Path, flatten: bool) -> None:
    def tree(fill: float) -> dict[str, Any]:
        return {
            "k0": 1 if fill else 0,
            "k1": [1, 2] if fill else [],
            "k2": {1: 2, 2: 3} if fill else {},
            "k3": torch.full((2,), fill),
            "k4": [[torch.full((3,), fill), "x" if fill else ""], [1, 2, 3], {"k6": [44]}],
            "k5": {"a": {"b": torch.arange(4) * int(fill), "c": (torch.full((1,), fill), 7)}},
        }

    def flow(writer: Any, reader: Any) -> dict[str, Any]:
        dcp.save(tree(1.5), storage_writer=writer, planner=DefaultSavePlanner(flatten))
        target = tree(0.0)
        dcp.load(target, storage_reader=reader, planner=DefaultLoadPlanner(flatten))
        return target

    got = on_both_backends(tmp_path, flow)
    assert torch.equal(got["k3"], torch.full((2,), 1.5))
    if flatten:
        assert torch.equal(got["k4"][0][0], torch.full((3,), 1.5))
        assert torch.equal(got["k5"]["a"]["b"], torch.arange(4))


_DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.int8, torch.bool]


@st.composite
def _tensors(draw: st.DrawFn) -> torch.Tensor:
    dtype = draw(st.sampled_from(_DTYPES))
    shape = draw(st.lists(st.integers(0, 4), max_size=3))
    seed = draw(st.integers(0, 2**31 - 1))
    t = torch.rand(shape, generator=torch.Generator().manual_seed(seed)) * 50
    if draw(st.booleans()) and t.dim() == 2:
        t = t.t()  # non-contiguous
    return t.to(dtype)


_leaves = st.one_of(_tensors(), st.integers(-5, 5), st.text(max_size=4))
_trees = st.dictionaries(
    st.text("abc", min_size=1, max_size=3),
    st.recursive(
        _leaves,
        lambda inner: st.one_of(
            st.lists(inner, max_size=3),
            st.dictionaries(st.text("xy", max_size=2), inner, max_size=3),
        ),
        max_leaves=6,
    ),
    max_size=4,
)


def _template(tree: Any) -> Any:
    """The load target: the same structure, tensors zeroed, other leaves emptied."""
    if isinstance(tree, torch.Tensor):
        return torch.zeros_like(tree)
    if isinstance(tree, dict):
        return {k: _template(v) for k, v in tree.items()}
    if isinstance(tree, list):
        return [_template(v) for v in tree]
    return type(tree)()


@settings(
    max_examples=20,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(tree=_trees)
def test_random_state_trees_load_as_with_dcps_backend(tmp_path: Path, tree: dict[str, Any]) -> None:
    """Any tree of tensors (dtypes, shapes incl. empty, strides) and plain values
    loads the same through asyncsave's writer and reader as through DCP's own."""
    case = tmp_path / uuid.uuid4().hex

    def flow(writer: Any, reader: Any) -> Any:
        dcp.save(tree, storage_writer=writer)
        target = _template(tree)
        dcp.load(target, storage_reader=reader)
        return target

    on_both_backends(case, flow, may_raise=True)  # DCP refuses some templates


# ----------------------------------- use_collectives=False (single process)


def test_save_without_collectives_on_one_process_commits(tmp_path: Path) -> None:
    save({"w": torch.arange(3.0)}, tmp_path, 1, use_collectives=False)
    target = {"w": torch.zeros(3)}
    load(target, tmp_path)
    assert torch.equal(target["w"], torch.arange(3.0)) and tracked(tmp_path) == 1


# ---------------------------------- asyncsave's own rules under DCP (issue 10)


@pytest.mark.parametrize("layout", LAYOUT_NAMES)
def test_reader_of_a_root_finds_the_checkpoint_of_any_layout(tmp_path: Path, layout: str) -> None:
    """``StorageReader(root, layout=...)`` reads the latest checkpoint of the layout
    the writer used (issue 10 item 8); the reader never guesses the layout: without
    it, a root of another layout is an error naming the ``layout`` to pass, never an
    empty root (docs/dcp_conformance.md)."""
    state = {"w": torch.arange(5.0)}
    dcp.save(state, storage_writer=StorageWriter(tmp_path, 7, layout=layout))
    assert (tmp_path / checkpoint_dir_name(layout, 7)).is_dir()
    target = {"w": torch.zeros(5)}
    dcp.load(target, storage_reader=StorageReader(tmp_path, layout=layout))
    assert torch.equal(target["w"], state["w"])
    if checkpoint_dir_name(layout, 7) != checkpoint_dir_name("asyncsave", 7):
        with pytest.raises(
            (CheckpointException, asyncsave.CheckpointError), match=f"{layout!r}.*pass layout="
        ):
            load({"w": torch.zeros(5)}, tmp_path)


def test_reader_of_a_root_kept_across_loads_reads_the_latest_each_time(tmp_path: Path) -> None:
    """A root resolves when a load begins (``read_metadata``), not once per reader:
    a reader kept by an evaluation loop follows the checkpoints as they commit."""
    reader = StorageReader(tmp_path)
    for step in (1, 2, 3):
        save({"w": torch.full((3,), float(step))}, tmp_path, step)
        target = {"w": torch.zeros(3)}
        dcp.load(target, storage_reader=reader)
        assert torch.equal(target["w"], torch.full((3,), float(step))), step


@pytest.mark.parametrize("use_async", [False, True], ids=["save", "async_save"])
def test_writer_reused_for_the_next_steps_commits_each(tmp_path: Path, use_async: bool) -> None:
    """Trainers keep one writer and move its step (issue 10, S20)."""
    writer = StorageWriter(tmp_path, 1)
    for step in (1, 2, 3):
        writer.step = step
        state = {"w": torch.full((4,), float(step))}
        if use_async:
            dcp.async_save(state, storage_writer=writer).result()
        else:
            dcp.save(state, storage_writer=writer)
    assert tracked(tmp_path) == 3 and temp_dirs(tmp_path) == []
    for step in (1, 2, 3):
        target = {"w": torch.zeros(4)}
        load(target, tmp_path / f"step_{step}")
        assert torch.equal(target["w"], torch.full((4,), float(step)))


class _HoldAfterTrackerRead(LocalFileSystem):
    """Runs ``hold`` once, right after this writer read the tracker: a later save
    can commit while this one sits between reading and writing the tracker."""

    def __init__(self, hold: Callable[[], None]) -> None:
        super().__init__()
        self._hold: Callable[[], None] | None = hold

    def read_bytes(self, path: Path) -> bytes:
        data = super().read_bytes(path)
        if path.name == TRACKER and self._hold is not None:
            hold, self._hold = self._hold, None
            hold()
        return data


HOLD_S = 3.0  # bounded: a writer that locks the tracker keeps the later one out


def test_overlapping_async_saves_never_move_the_tracker_back(tmp_path: Path) -> None:
    """S20: ``dcp.async_save`` of step 2, then of step 3, and step 2's ``finish``
    reads the tracker before step 3 commits and writes it after."""
    save({"w": torch.zeros(2)}, tmp_path, 1)
    in_window, later_done = threading.Event(), threading.Event()

    def hold() -> None:
        in_window.set()
        later_done.wait(HOLD_S)

    slow = StorageWriter(tmp_path, 2, filesystem=_HoldAfterTrackerRead(hold))
    f2 = dcp.async_save({"w": torch.full((2,), 2.0)}, storage_writer=slow)
    while not (in_window.wait(0.05) or f2.done()):
        pass
    f3 = dcp.async_save({"w": torch.full((2,), 3.0)}, storage_writer=StorageWriter(tmp_path, 3))
    try:
        f3.result(timeout=120)
    finally:
        later_done.set()
    f2.result(timeout=120)
    assert tracked(tmp_path) == 3
    assert asyncsave.latest(tmp_path).step == 3  # type: ignore[union-attr]
    target = {"w": torch.zeros(2)}
    load(target, tmp_path / "step_2")
    assert torch.equal(target["w"], torch.full((2,), 2.0))


class _NoSpace(LocalFileSystem):
    """Every data write fails as on a full disk (picklable: DCP's process executor
    ships the writer to its background process)."""

    def write(self, fd: int, data: memoryview) -> int:
        raise OSError(errno.ENOSPC, "No space left on device (injected)")


def _process_executor_fails_then_serves(rank: int, world: int, root: str) -> dict[str, Any]:
    try:
        return _fail_then_serve(root)
    finally:
        stop_dcp_background_process()


def _fail_then_serve(root: str) -> dict[str, Any]:
    state = {"w": torch.arange(8.0), "h": torch.ones(3, dtype=torch.bfloat16)}
    failing = dcp.async_save(
        state,
        storage_writer=StorageWriter(root, 1, filesystem=_NoSpace()),
        async_checkpointer_type=AsyncCheckpointerType.PROCESS,
    )
    try:
        failing.result()
        failure = ""
    except BaseException as exc:
        failure = repr(exc)
    stager = DefaultStager(StagingOptions(False, True, False, False))  # shared memory
    try:
        response = dcp.async_save(
            state,
            storage_writer=StorageWriter(root, 2),
            async_checkpointer_type=AsyncCheckpointerType.PROCESS,
            async_stager=stager,
        )
        getattr(response, "upload_completion", response).result()
    finally:
        stager.close()
    target = {"w": torch.zeros(8), "h": torch.zeros(3, dtype=torch.bfloat16)}
    load(target, Path(root))
    return {"failure": failure, "loaded": all(torch.equal(target[k], state[k]) for k in state)}


@pytest.mark.slow
def test_process_executor_reports_a_failed_save_and_serves_the_next(tmp_path: Path) -> None:
    root = tmp_path / "run"
    (got,) = values(run_ranks(_process_executor_fails_then_serves, 1, tmp_path, str(root)))
    assert "No space left" in got["failure"] and got["loaded"]
    assert not (root / "step_1").exists() and tracked(root) == 2


def _save_without_collectives(rank: int, world: int, root: str) -> str:
    # No barrier here: without collectives nothing keeps the ranks in step, so this
    # runs in a group of its own and the parent looks at the root afterwards.
    try:
        save({"w": torch.full((3,), float(rank))}, Path(root), 1, use_collectives=False)
    except asyncsave.CheckpointError as exc:
        return str(exc)
    return ""


@pytest.mark.slow
def test_two_ranks_save_without_collectives_is_refused(tmp_path: Path) -> None:
    """``use_collectives=False`` has every rank plan, write and finish alone; DCP's
    writer then writes per-rank metadata. asyncsave's commit is one for all ranks,
    so the writer refuses (before it creates anything) instead of letting the first
    rank publish a step that holds only its own items."""
    root = tmp_path / "run"
    errors = values(run_ranks(_save_without_collectives, 2, tmp_path, str(root)))
    assert all("use_collectives" in e and "several ranks" in e for e in errors), errors
    assert not root.exists() or sorted(p.name for p in root.iterdir()) == []


# =================================================== two gloo ranks, one run

TWO_RANK_CASES: dict[str, Callable[[int, Path], Any]] = {}


def two_rank_case(fn: Callable[[int, Path], Any]) -> Callable[[int, Path], Any]:
    TWO_RANK_CASES[fn.__name__] = fn
    return fn


def _gather_full(st: Any) -> torch.Tensor | None:
    """A ShardedTensor's full value on rank 0 (``None`` elsewhere)."""
    out = torch.zeros(st.size()) if dist.get_rank() == 0 else None
    st.gather(out=out)
    return out


def _shard_specs() -> list[Any]:
    from torch.distributed._shard.sharding_spec import (
        ChunkShardingSpec,
        EnumerableShardingSpec,
        ShardMetadata,
    )

    return [
        ChunkShardingSpec(dim=0, placements=["rank:0", "rank:1"]),
        ChunkShardingSpec(dim=0, placements=["rank:0", "rank:1", "rank:1", "rank:0"]),
        EnumerableShardingSpec(
            [
                ShardMetadata([0, 0], [3, 20], "rank:1"),
                ShardMetadata([3, 0], [4, 20], "rank:0"),
                ShardMetadata([7, 0], [3, 20], "rank:1"),
            ]
        ),
        EnumerableShardingSpec(
            [ShardMetadata([0, 0], [8, 20], "rank:1"), ShardMetadata([8, 0], [2, 20], "rank:0")]
        ),
    ]


@two_rank_case
def sharded_tensor_round_trip(rank: int, root: Path) -> bool:
    from torch.distributed._shard import sharded_tensor

    spec = _shard_specs()[0]
    torch.manual_seed(10 + rank)
    saved = {"st": sharded_tensor.rand(spec, 10, 20), "rep": torch.arange(4.0)}
    save(saved, root, 1)
    target = {"st": sharded_tensor.zeros(spec, 10, 20), "rep": torch.zeros(4)}
    load(target, root)
    shards = zip(saved["st"].local_shards(), target["st"].local_shards(), strict=True)
    return all(torch.equal(a.tensor, b.tensor) for a, b in shards) and torch.equal(
        target["rep"], saved["rep"]
    )


@two_rank_case
def sharded_tensor_reshards_between_shard_plans(rank: int, root: Path) -> list[bool]:
    from torch.distributed._shard import sharded_tensor

    specs, equal, step = _shard_specs(), [], 0
    for i, s_save in enumerate(specs):
        for j, s_load in enumerate(specs):
            if i == j:
                continue
            step += 1
            torch.manual_seed(step)
            saved = sharded_tensor.rand(s_save, 10, 20)
            save({"st": saved}, root, step)
            target = sharded_tensor.zeros(s_load, 10, 20)
            load({"st": target}, root / f"step_{step}")
            full_saved, full_loaded = _gather_full(saved), _gather_full(target)
            if rank == 0:
                assert full_saved is not None and full_loaded is not None
                equal.append(torch.equal(full_saved, full_loaded))
    return equal


@two_rank_case
def sharded_tensor_rowwise_to_colwise(rank: int, root: Path) -> bool | None:
    from torch.distributed._shard import sharded_tensor
    from torch.distributed._shard.sharding_spec import ChunkShardingSpec

    rows = ChunkShardingSpec(dim=0, placements=["rank:0", "rank:1"])
    cols = ChunkShardingSpec(dim=1, placements=["rank:0", "rank:1"])
    saved = sharded_tensor.rand(rows, 10, 20)
    save({"st": saved}, root, 1)
    target = sharded_tensor.zeros(cols, 10, 20)
    load({"st": target}, root)
    a, b = _gather_full(saved), _gather_full(target)
    return None if rank else bool(a is not None and b is not None and torch.equal(a, b))


@two_rank_case
def byte_items_round_trip(rank: int, root: Path) -> Any:
    save({"bytes0": [1], "bytes1": "string", "raw": io.BytesIO(b"\x00\x01" * 50)}, root, 1)
    target: dict[str, Any] = {"bytes0": [2], "bytes1": "other", "raw": io.BytesIO()}
    load(target, root)
    return target["bytes0"], target["bytes1"], target["raw"].getvalue() == b"\x00\x01" * 50


@two_rank_case
def sharded_tensor_and_plain_tensor_swap_on_load(rank: int, root: Path) -> list[bool]:
    from torch.distributed._shard import sharded_tensor
    from torch.distributed._shard.sharding_spec import (
        ChunkShardingSpec,
        EnumerableShardingSpec,
        ShardMetadata,
    )

    n = 32
    specs = [
        ChunkShardingSpec(dim=0, placements=["rank:0", "rank:1"]),
        EnumerableShardingSpec(
            [ShardMetadata([0], [8], "rank:1"), ShardMetadata([8], [24], "rank:0")]
        ),
        EnumerableShardingSpec(
            [ShardMetadata([0], [10], "rank:0"), ShardMetadata([10], [22], "rank:1")]
        ),
    ]
    equal, step = [], 0
    for s_save in specs:
        for s_load in specs:
            step += 1
            saved = {"sharded": sharded_tensor.rand(s_save, n), "replicated": torch.rand(n)}
            dist.broadcast(saved["replicated"], src=0)
            save(saved, root, step)
            target = {"sharded": torch.zeros(n), "replicated": sharded_tensor.zeros(s_load, n)}
            load(target, root / f"step_{step}")
            full_sharded, full_replicated = (
                _gather_full(saved["sharded"]),
                _gather_full(target["replicated"]),
            )
            if rank == 0:
                assert full_sharded is not None and full_replicated is not None
                equal.append(torch.equal(full_sharded, target["sharded"]))
                equal.append(torch.equal(saved["replicated"], full_replicated))
    return equal


@two_rank_case
def keys_in_another_order_on_each_rank(rank: int, root: Path) -> bool:
    class Collective:
        """load_state_dict runs a collective: ranks must call it in one order."""

        def __init__(self, name: str) -> None:
            self.name = name
            self.total = 0.0

        def state_dict(self) -> dict[str, Any]:
            return {"v": torch.full((2,), float(len(self.name)))}

        def load_state_dict(self, state: dict[str, Any]) -> None:
            t = state["v"].clone()
            dist.all_reduce(t)
            self.total = float(t[0])

    a, b = Collective("A"), Collective("BB")
    state = {"A": a, "B": b} if rank == 0 else {"B": b, "A": a}
    save(state, root, 1)
    load(state, root)
    return (a.total, b.total) == (2.0, 4.0)


@two_rank_case
def dtensor_module_with_extra_state(rank: int, root: Path) -> bool:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (2,))

    class WithExtra(nn.Module):
        def __init__(self, scale: float) -> None:
            super().__init__()
            self.sdt = nn.Parameter(distribute_tensor(torch.arange(4.0) * scale, mesh, [Shard(0)]))
            self.rdt = nn.Parameter(
                distribute_tensor(torch.arange(4.0, 8.0) * scale, mesh, [Replicate()])
            )
            self.extra = {"count": int(scale), "t": torch.full((1,), scale)}

        def get_extra_state(self) -> Any:
            return self.extra

        def set_extra_state(self, state: Any) -> None:
            self.extra = state

    saved = WithExtra(1.0)
    save(saved.state_dict(), root, 1)
    fresh = WithExtra(10.0)
    sd = fresh.state_dict()
    load(sd, root)
    fresh.load_state_dict(sd)
    return (
        torch.equal(fresh.sdt.to_local(), saved.sdt.to_local())
        and torch.equal(fresh.rdt.to_local(), saved.rdt.to_local())
        and fresh.extra["count"] == 1
        and torch.equal(fresh.extra["t"], torch.ones(1))
    )


@two_rank_case
def dtensor_reshards_across_placements_and_meshes(rank: int, root: Path) -> list[bool]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor, zeros

    one_d = init_device_mesh("cpu", (2,))
    two_d = init_device_mesh("cpu", (2, 1))
    full = torch.arange(35, dtype=torch.float32).view(5, 7)  # uneven on 2 ranks
    pairs = [
        ((one_d, [Shard(0)]), (one_d, [Replicate()])),
        ((one_d, [Replicate()]), (one_d, [Shard(0)])),
        ((one_d, [Shard(1)]), (one_d, [Shard(0)])),
        ((two_d, [Shard(0), Replicate()]), (two_d, [Replicate(), Shard(1)])),
        ((two_d, [Replicate(), Replicate()]), (one_d, [Shard(1)])),
        ((one_d, [Shard(0)]), (two_d, [Shard(1), Replicate()])),
    ]
    equal = []
    for step, ((mesh_s, place_s), (mesh_l, place_l)) in enumerate(pairs, start=1):
        save({"d": distribute_tensor(full, mesh_s, place_s)}, root, step)
        target = {"d": zeros([5, 7], device_mesh=mesh_l, placements=place_l)}
        load(target, root / f"step_{step}")
        equal.append(torch.equal(target["d"].full_tensor(), full))
    return equal


@two_rank_case
def write_failure_on_one_rank_fails_every_rank(rank: int, root: Path) -> Any:
    fs = _NoSpace() if rank == 1 else LocalFileSystem()
    try:
        # A key of each rank's own: DCP's de-duplication decides which rank writes a
        # replicated item, so only a rank-local item makes rank 1 write for sure.
        state = {"w": torch.ones(4), f"own{rank}": torch.ones(2)}
        dcp.save(state, storage_writer=StorageWriter(root, 1, filesystem=fs))
    except CheckpointException as exc:
        failed = sorted(exc.failures)
    else:
        failed = []
    dist.barrier()
    return failed, (root / "step_1").exists(), (root / TRACKER).exists()


@two_rank_case
def coordinator_on_rank_one(rank: int, root: Path) -> Any:
    from torch.distributed.checkpoint import save_state_dict

    save_state_dict({"w": torch.full((4,), 5.0)}, StorageWriter(root, 1), coordinator_rank=1)
    target = {"w": torch.zeros(4)}
    load(target, root)
    return torch.equal(target["w"], torch.full((4,), 5.0)), tracked(root)


@two_rank_case
def saved_step_is_refused_on_every_rank(rank: int, root: Path) -> Any:
    save({"w": torch.ones(4)}, root, 1)
    try:
        save({"w": torch.zeros(4)}, root, 1)
        refused = False
    except CheckpointException:
        refused = True
    dist.barrier()
    target = {"w": torch.zeros(4)}
    load(target, root)
    return refused, temp_dirs(root), torch.equal(target["w"], torch.ones(4))


@two_rank_case
def plan_caching_on_two_ranks(rank: int, root: Path) -> list[bool]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (2,))
    planner = caching_planner()

    def state(step: int, rows: int) -> dict[str, Any]:
        full = torch.arange(rows * 3, dtype=torch.float32).view(rows, 3) + 100 * step
        return {"d": distribute_tensor(full, mesh, [Shard(0)]), "r": torch.full((rows,), step)}

    shapes = {1: 4, 2: 4, 3: 6, 4: 6}  # new plan, cached, changed, cached
    for step, rows in shapes.items():
        save(state(step, rows), root, step, planner=planner)
    ok = []
    for step, rows in shapes.items():
        want = state(step, rows)
        target = {"d": torch.zeros(rows, 3), "r": torch.zeros(rows, dtype=torch.int64)}
        load(target, root / f"step_{step}")
        ok.append(
            torch.equal(target["d"], want["d"].full_tensor())
            and torch.equal(target["r"], want["r"])
        )
    return ok


@two_rank_case
def overlapping_saves_in_two_processes(rank: int, root: Path) -> int:
    """S20 across processes: two processes save into one root (``no_dist``); the
    one saving step 2 reads the tracker, then the other commits step 3."""
    flags = root.parent / f"{root.name}-flags"
    if rank == 0:
        flags.mkdir()
        save({"w": torch.zeros(2)}, root, 1, no_dist=True)
    dist.barrier()

    def wait_for(*names: str) -> None:
        deadline = time.monotonic() + HOLD_S
        while not any((flags / n).exists() for n in names) and time.monotonic() < deadline:
            time.sleep(0.01)

    if rank == 0:

        def hold() -> None:
            (flags / "step2-in-window").touch()
            wait_for("step3-done")

        writer = StorageWriter(root, 2, filesystem=_HoldAfterTrackerRead(hold))
        dcp.save({"w": torch.full((2,), 2.0)}, storage_writer=writer, no_dist=True)
        (flags / "step2-done").touch()
    else:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not any(
            (flags / n).exists() for n in ("step2-in-window", "step2-done")
        ):
            time.sleep(0.01)
        save({"w": torch.full((2,), 3.0)}, root, 3, no_dist=True)
        (flags / "step3-done").touch()
    dist.barrier()
    return tracked(root)


def _run_two_rank_cases(rank: int, world: int, base: str) -> dict[str, tuple[str, Any]]:
    out: dict[str, tuple[str, Any]] = {}
    for name, case in TWO_RANK_CASES.items():
        root = Path(base) / name
        try:
            out[name] = ("ok", case(rank, root))
        except BaseException:
            out[name] = ("error", traceback.format_exc())
        dist.barrier()
    return out


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    tmp = tmp_path_factory.mktemp("dcp-two-ranks")
    per_rank = values(run_ranks(_run_two_rank_cases, 2, tmp, str(tmp), timeout_s=240))
    yield {"roots": tmp, "ranks": per_rank}


def case_values(two_ranks: dict[str, Any], name: str) -> list[Any]:
    """Both ranks' values of one case; fails with the ranks' tracebacks."""
    outcomes = [r[name] for r in two_ranks["ranks"]]
    errors = [f"--- rank {i}\n{o[1]}" for i, o in enumerate(outcomes) if o[0] != "ok"]
    assert not errors, "\n".join(errors)
    return [o[1] for o in outcomes]


@pytest.mark.slow
def test_two_ranks_sharded_tensor_round_trips(two_ranks: dict[str, Any]) -> None:
    assert case_values(two_ranks, "sharded_tensor_round_trip") == [True, True]


@pytest.mark.slow
def test_two_ranks_sharded_tensor_reshards_between_shard_plans(two_ranks: dict[str, Any]) -> None:
    on_rank0, _ = case_values(two_ranks, "sharded_tensor_reshards_between_shard_plans")
    assert on_rank0 == [True] * 12


@pytest.mark.slow
def test_two_ranks_sharded_tensor_rowwise_to_colwise(two_ranks: dict[str, Any]) -> None:
    assert case_values(two_ranks, "sharded_tensor_rowwise_to_colwise") == [True, None]


@pytest.mark.slow
def test_two_ranks_byte_items_round_trip(two_ranks: dict[str, Any]) -> None:
    assert case_values(two_ranks, "byte_items_round_trip") == [([1], "string", True)] * 2


@pytest.mark.slow
def test_two_ranks_sharded_and_plain_tensors_swap_on_load(two_ranks: dict[str, Any]) -> None:
    on_rank0, _ = case_values(two_ranks, "sharded_tensor_and_plain_tensor_swap_on_load")
    assert on_rank0 == [True] * 18


@pytest.mark.slow
def test_two_ranks_keys_in_another_order(two_ranks: dict[str, Any]) -> None:
    assert case_values(two_ranks, "keys_in_another_order_on_each_rank") == [True, True]


@pytest.mark.slow
def test_two_ranks_dtensor_module_with_extra_state(two_ranks: dict[str, Any]) -> None:
    assert case_values(two_ranks, "dtensor_module_with_extra_state") == [True, True]


@pytest.mark.slow
def test_two_ranks_dtensor_reshards_across_placements_and_meshes(
    two_ranks: dict[str, Any],
) -> None:
    assert (
        case_values(two_ranks, "dtensor_reshards_across_placements_and_meshes") == [[True] * 6] * 2
    )


@pytest.mark.slow
def test_two_ranks_write_failure_on_one_rank_fails_every_rank(two_ranks: dict[str, Any]) -> None:
    # Every rank raises, naming rank 1; nothing is committed, no tracker.
    expected = ([1], False, False)
    assert case_values(two_ranks, "write_failure_on_one_rank_fails_every_rank") == [expected] * 2


@pytest.mark.slow
def test_two_ranks_coordinator_on_rank_one(two_ranks: dict[str, Any]) -> None:
    assert case_values(two_ranks, "coordinator_on_rank_one") == [(True, 1)] * 2


@pytest.mark.slow
def test_two_ranks_saved_step_is_refused_without_leftovers(two_ranks: dict[str, Any]) -> None:
    assert case_values(two_ranks, "saved_step_is_refused_on_every_rank") == [(True, [], True)] * 2


@pytest.mark.slow
def test_two_ranks_plan_caching_commits_every_step(two_ranks: dict[str, Any]) -> None:
    assert case_values(two_ranks, "plan_caching_on_two_ranks") == [[True] * 4] * 2


@pytest.mark.slow
def test_two_processes_overlapping_saves_never_move_the_tracker_back(
    two_ranks: dict[str, Any],
) -> None:
    assert case_values(two_ranks, "overlapping_saves_in_two_processes") == [3, 3]
    root = two_ranks["roots"] / "overlapping_saves_in_two_processes"
    assert asyncsave.latest(root).step == 3  # type: ignore[union-attr]
