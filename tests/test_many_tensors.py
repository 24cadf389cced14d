"""States of many tensors (issue 12): the plan is made once and reused while the
structure holds; anything that changes what the plan depends on makes a new one;
planning runs off the event loop's thread.

What the plan depends on: the tensor leaves' keys,
kinds, ``requires_grad``, dtypes, shapes, strides, devices, and where their bytes
and storages are (a storage re-allocated by offloading, S5, or a view that now
aliases another tensor changes how tensors share memory). Every trigger below
must replan and round-trip exactly; same structure with new values must reuse
the plan and still save the new values (no stale bytes). Plans and the threads
they run on are seen through ``asyncsave.testing.planning``.
"""

from __future__ import annotations

import copy
import gc
import itertools
import json
import tempfile
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import xxhash
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_aliasing import assert_round_trip

import asyncsave
from asyncsave.testing import (
    INLINE_PLAN_MAX_NODES,
    early_copy_made,
    encode_manifest,
    planning,
)

pytestmark = pytest.mark.anyio


class _Counter:
    """Counts the groupings of tensors into entries (the costly part of a plan,
    skipped when a plan is reused) and the threads they ran on; records the
    thread of every walk of a state tree (``flatten``), in order."""

    def __init__(self) -> None:
        self.calls = 0
        self.threads: set[int] = set()
        self.flattens: list[int] = []

    def __call__(self, what: str) -> None:
        if what == "group":
            self.calls += 1
            self.threads.add(threading.get_ident())
        else:
            self.flattens.append(threading.get_ident())


@pytest.fixture
def counter() -> Iterator[_Counter]:
    seen = _Counter()
    with planning(seen):
        yield seen


@pytest.fixture
def groupings(counter: _Counter) -> _Counter:
    return counter


def _base() -> dict[str, Any]:
    g = torch.Generator().manual_seed(1)
    shared = torch.randn(64, generator=g)
    return {
        "experts.0.w0": torch.randn(4, 6, generator=g),
        "experts.0.w1": torch.randn(16, generator=g).to(torch.bfloat16),
        "experts.1.w0": torch.randn(4, 6, generator=g),
        "tied.a": shared[:32],
        "tied.b": shared[16:48],
        "step": torch.tensor(3),
    }


def _new_key(s: dict[str, Any]) -> None:
    s["experts.2.w0"] = torch.randn(5)


def _removed_key(s: dict[str, Any]) -> None:
    del s["experts.1.w0"]


def _shape(s: dict[str, Any]) -> None:
    s["experts.0.w0"] = torch.randn(6, 4)


def _dtype(s: dict[str, Any]) -> None:
    s["experts.0.w0"] = s["experts.0.w0"].to(torch.float64)


def _stride(s: dict[str, Any]) -> None:
    x = s["experts.0.w0"]
    s["experts.0.w0"] = torch.empty_strided(x.shape, (1, x.shape[0])).copy_(x + 1)


def _reallocated(s: dict[str, Any]) -> None:
    # Offloading (S5): same shape, new storage.
    s["experts.1.w0"] = s["experts.1.w0"].clone() * 2


def _now_aliases(s: dict[str, Any]) -> None:
    # A view that now shares memory with another tensor.
    s["experts.1.w0"] = s["experts.0.w0"].view(-1)[:24].view(4, 6)


def _sharing_broken(s: dict[str, Any]) -> None:
    s["tied.b"] = s["tied.b"].clone()


def _sharing_moved(s: dict[str, Any]) -> None:
    # Same shapes, one storage re-allocated: the overlap is now elsewhere.
    shared = torch.randn(80)
    s["tied.a"], s["tied.b"] = shared[8:40], shared[30:62]


def _kind_parameter(s: dict[str, Any]) -> None:
    s["experts.0.w0"] = torch.nn.Parameter(s["experts.0.w0"], requires_grad=False)


def _kind_ndarray(s: dict[str, Any]) -> None:
    s["experts.1.w0"] = s["experts.1.w0"].numpy()


def _requires_grad(s: dict[str, Any]) -> None:
    s["experts.0.w0"] = torch.nn.Parameter(s["experts.0.w0"].clone())
    s["experts.0.w0"].requires_grad_(True)


def _empty(s: dict[str, Any]) -> None:
    s["experts.0.w1"] = torch.empty(0, dtype=torch.bfloat16)


def _set_other_storage(s: dict[str, Any]) -> None:
    # The same tensor object, moved in place onto memory of its own (no new key,
    # shape or object: only its addresses say so).
    x = s["experts.0.w0"]
    x.set_(torch.randn(24).untyped_storage(), 0, (4, 6), (6, 1))


def _offset_moved(s: dict[str, Any]) -> None:
    # The same tensor object, moved in place within its storage: it now overlaps
    # "tied.b" differently (same storage, same shape, another offset).
    x = s["tied.a"]
    x.set_(x.untyped_storage(), 8, (32,), (1,))


def _requires_grad_in_place(s: dict[str, Any]) -> None:
    s["experts.0.w0"].requires_grad_(True)


TRIGGERS: dict[str, Callable[[dict[str, Any]], None]] = {
    "new key": _new_key,
    "removed key": _removed_key,
    "shape": _shape,
    "dtype": _dtype,
    "stride": _stride,
    "storage re-allocated (S5)": _reallocated,
    "view now aliases": _now_aliases,
    "sharing broken": _sharing_broken,
    "sharing moved": _sharing_moved,
    "kind: parameter": _kind_parameter,
    "kind: ndarray": _kind_ndarray,
    "requires_grad": _requires_grad,
    "emptied": _empty,
    "in place: set_ onto other memory": _set_other_storage,
    "in place: offset moved in its storage": _offset_moved,
    "in place: requires_grad_": _requires_grad_in_place,
}


def _snapshot(state: dict[str, Any]) -> dict[str, Any]:
    """A deep copy keeping leaf types and the sharing between tensors (for
    comparing later; NumPy leaves here never share memory with another leaf)."""
    return copy.deepcopy(state)


def _assert_loads(path: Path, expected: dict[str, Any]) -> None:
    out = asyncsave.load(path)
    assert_round_trip(expected, out)


async def test_same_structure_reuses_the_plan_and_saves_the_new_values(
    tmp_path: Path, groupings: _Counter
) -> None:
    """Three saves of one structure, values changed in place between them: one
    plan, and each checkpoint holds the values of its own save (no stale bytes
    from a reused plan)."""
    state = _base()
    expected = []
    async with asyncsave.Checkpointer(tmp_path) as ckpt:
        for step in (1, 2, 3):
            for v in state.values():
                v.add_(1)
            expected.append(_snapshot(state))
            await (await ckpt.save(step, state))
    assert groupings.calls == 1
    for step, exp in zip((1, 2, 3), expected, strict=True):
        _assert_loads(tmp_path / f"step_{step}", exp)


@pytest.mark.parametrize("trigger", list(TRIGGERS))
async def test_every_structure_change_replans_and_round_trips(
    tmp_path: Path, groupings: _Counter, trigger: str
) -> None:
    state = _base()
    first = _snapshot(state)
    async with asyncsave.Checkpointer(tmp_path) as ckpt:
        await (await ckpt.save(1, state))
        TRIGGERS[trigger](state)
        second = _snapshot(state)
        await (await ckpt.save(2, state))
        # and the new structure is reused in turn
        third = _snapshot(state)
        await (await ckpt.save(3, state))
    assert groupings.calls == 2
    _assert_loads(tmp_path / "step_1", first)
    _assert_loads(tmp_path / "step_2", second)
    _assert_loads(tmp_path / "step_3", third)


async def test_offloaded_parameters_each_checkpoint_holds_its_own_bytes(tmp_path: Path) -> None:
    """S5 (NVIDIA-NeMo/RL #3312): parameter storages replaced between saves (as
    offloading does), a module and its optimizer saved three times: every
    checkpoint's bytes match the state at its own save."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    saved = []
    async with asyncsave.Checkpointer(tmp_path) as ckpt:
        for step in (1, 2, 3):
            with torch.no_grad():
                for p in model.parameters():
                    p.data = torch.empty_like(p).copy_(p + step)  # a new storage
            saved.append({k: v.clone() for k, v in model.state_dict().items()})
            await (await ckpt.save(step, {"model": model}))
    for step, exp in zip((1, 2, 3), saved, strict=True):
        out = asyncsave.load(tmp_path / f"step_{step}")["model"]
        assert set(out) == set(exp)
        for k, v in exp.items():
            assert torch.equal(out[k], v), (step, k)


async def test_planning_runs_off_the_event_loop_and_state_dict_on_it(
    tmp_path: Path, groupings: _Counter
) -> None:
    """The plan is made in a worker thread (the loop keeps ticking); a Stateful
    object's ``state_dict()`` still runs on the event loop's thread."""
    loop_thread = threading.get_ident()
    called_on: list[int] = []

    class Counter:
        def __init__(self) -> None:
            self.n = torch.arange(4)

        def state_dict(self) -> dict[str, Any]:
            called_on.append(threading.get_ident())
            return {"n": self.n}

        def load_state_dict(self, sd: dict[str, Any]) -> None:
            self.n = sd["n"]

    async with asyncsave.Checkpointer(tmp_path) as ckpt:
        await (await ckpt.save(1, {"c": Counter(), **_base()}))
    assert groupings.calls == 1 and loop_thread not in groupings.threads
    assert called_on == [loop_thread]


async def test_a_failed_plan_leaves_no_template_behind(tmp_path: Path) -> None:
    """A state refused while planning (overlapping views no storage can hold)
    raises its typed error; the next save of the earlier structure still saves
    its own values."""
    state = _base()
    async with asyncsave.Checkpointer(tmp_path) as ckpt:
        await (await ckpt.save(1, state))
        buf = bytearray(64)
        bad = {
            **state,
            "x": torch.frombuffer(buf, dtype=torch.float32, offset=1, count=4),
            "y": torch.frombuffer(buf, dtype=torch.float32, offset=2, count=4),
        }
        with pytest.raises(asyncsave.UnsupportedTensorError):
            await ckpt.save(2, bad)
        state["step"].add_(5)
        exp = _snapshot(state)
        await (await ckpt.save(3, state))
    _assert_loads(tmp_path / "step_3", exp)


async def test_many_small_tensors_round_trip_through_a_reused_plan(tmp_path: Path) -> None:
    """2,000 small tensors of mixed dtypes (the batched staging path: plain dtypes
    by one foreach copy, others one by one), NaN payloads and all, saved twice
    with new bits: both checkpoints exact."""
    g = torch.Generator().manual_seed(2)
    dtypes = [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.complex64]
    dtypes += [torch.float8_e4m3fn, torch.bool]
    state: dict[str, Any] = {}
    for i in range(2000):
        dt = dtypes[i % len(dtypes)]
        bits = torch.randint(0, 256, (16 * (1 + i % 5),), dtype=torch.uint8, generator=g)
        t = bits.view(dt) if dt is not torch.bool else bits % 2 == 1
        state[f"experts.{i // 4}.w{i % 4}"] = t.reshape(2, -1) if i % 3 == 0 else t
    expected = []
    async with asyncsave.Checkpointer(tmp_path) as ckpt:
        for step in (1, 2):
            for v in state.values():
                if v.dtype is torch.bool:
                    v.logical_not_()
                else:
                    v.view(torch.uint8).add_(step)
            expected.append(_snapshot(state))
            await (await ckpt.save(step, state))
    for step, exp in zip((1, 2), expected, strict=True):
        out = asyncsave.load(tmp_path / f"step_{step}")
        assert list(out) == list(exp)
        for k, v in exp.items():
            assert out[k].dtype == v.dtype and out[k].shape == v.shape, k
            assert torch.equal(out[k].view(torch.uint8), v.view(torch.uint8)), k


# --- random sequences of mutations on one checkpointer ---------------------------

_OPS = ["values", "realloc", "alias", "unalias", "add", "remove", "reshape", "dtype", "kind"]


def _apply(state: dict[str, Any], op: str, key: str, n: int) -> None:
    keys = list(state)
    if op == "values":
        for v in state.values():
            if isinstance(v, np.ndarray):
                v += 1
            else:
                v.add_(1)
    elif op == "realloc" and key in state:
        state[key] = state[key].copy() if isinstance(state[key], np.ndarray) else state[key] * 1
    elif op == "alias" and len(keys) >= 2:
        src = state[keys[0]]
        if isinstance(src, torch.Tensor) and src.dtype == torch.float32 and src.numel() >= 2:
            state[key] = src.view(-1)[1:]
    elif op == "unalias" and key in state:
        v = state[key]
        state[key] = v.copy() if isinstance(v, np.ndarray) else v.clone()
    elif op == "add":
        state[f"k{n}"] = torch.randn(1 + n % 7)
    elif op == "remove" and len(keys) > 1 and key in state:
        del state[key]
    elif op == "reshape" and key in state:
        state[key] = torch.randn(2 + n % 5, 2)
    elif op == "dtype" and key in state and not isinstance(state[key], np.ndarray):
        state[key] = state[key].to(torch.float64)
    elif op == "kind" and key in state and not isinstance(state[key], np.ndarray):
        v = state[key]
        ptr = v.untyped_storage().data_ptr()
        alone = not any(
            isinstance(w, torch.Tensor) and w.untyped_storage().data_ptr() == ptr
            for k, w in state.items()
            if k != key
        )
        if alone and v.dtype == torch.float32 and v.is_contiguous():
            state[key] = v.numpy()


@settings(
    max_examples=25,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(
    ops=st.lists(
        st.tuples(st.sampled_from(_OPS), st.integers(0, 5), st.integers(0, 1000)),
        min_size=1,
        max_size=6,
    )
)
def test_random_mutations_between_saves_round_trip(ops: list[tuple[str, int, int]]) -> None:
    """Random sequences of value changes and structure changes between saves of
    one checkpointer: every checkpoint is exact (values and sharing), and a save
    after a change of values only reuses the plan."""
    counter = _Counter()
    state: dict[str, Any] = {f"k{i}": torch.randn(3 + i) for i in range(4)}
    expected = []
    with planning(counter), tempfile.TemporaryDirectory() as tmp:
        with asyncsave.SyncCheckpointer(Path(tmp)) as ckpt:
            ckpt.save(1, state).result()
            expected.append(_snapshot(state))
            for step, (op, k, n) in enumerate(ops, start=2):
                before = counter.calls
                _apply(state, op, f"k{k}", n)
                expected.append(_snapshot(state))
                ckpt.save(step, state).result()
                if op == "values":
                    assert counter.calls == before, "a change of values only replanned"
        for step, exp in enumerate(expected, start=1):
            _assert_loads(Path(tmp) / f"step_{step}", exp)


def test_manifest_self_checksum_holds_for_written_and_respelled_manifests(tmp_path: Path) -> None:
    """The manifest's own checksum is checked on its bytes as written (no
    re-encoding of every entry), and still on the canonical encoding for any other
    spelling: a re-indented manifest loads, an edited one is refused."""
    state = {f"experts.{i}.w0": torch.randn(3) for i in range(50)}
    with asyncsave.SyncCheckpointer(tmp_path) as ckpt:
        ckpt.save(1, state).result()
    mpath = tmp_path / "step_1" / "manifest.json"
    raw = mpath.read_bytes()
    doc = json.loads(raw)
    mpath.write_bytes(json.dumps(doc, indent=2).encode())  # same content, respelled
    out = asyncsave.load(tmp_path / "step_1")
    assert all(torch.equal(out[k], v) for k, v in state.items())
    doc["entries"][3]["offset"] += 4  # edited, checksum field kept
    mpath.write_bytes(json.dumps(doc, separators=(",", ":")).encode())
    with pytest.raises(asyncsave.CorruptCheckpointError, match="own checksum"):
        asyncsave.load(tmp_path / "step_1")
    edited = raw.replace(b'"step":1', b'"step":7', 1)
    assert edited != raw
    mpath.write_bytes(edited)
    with pytest.raises(asyncsave.CorruptCheckpointError):
        asyncsave.load(tmp_path / "step_1")


_json = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**63 - 1)
    | st.text(max_size=4)
    | st.floats(allow_nan=False, allow_infinity=False),
    lambda inner: st.lists(inner, max_size=600) | st.dictionaries(st.text(max_size=3), inner),
    max_leaves=300,
)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(doc=st.dictionaries(st.text(max_size=3), _json, max_size=4))
def test_manifest_encoding_in_pieces_is_byte_identical(doc: dict[str, Any]) -> None:
    """The manifest is encoded in pieces (so a worker thread never holds the GIL
    for the whole document): the bytes are exactly one ``json.dumps``'s, its
    own checksum field appended."""
    whole = json.dumps(doc, separators=(",", ":")).encode()
    digest = xxhash.xxh3_64_hexdigest(whole)
    assert encode_manifest(doc) == whole[:-1] + f',"manifest_xxh3_64":"{digest}"}}'.encode()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
async def test_many_small_cuda_tensors_gathered_round_trip_within_s12(tmp_path: Path) -> None:
    """4,000 small CUDA tensors (plus a large one, a non-contiguous view and a
    shared storage) are staged through the device gather: bit-exact round trip,
    device memory peak within S12's 1 MiB."""
    g = torch.Generator().manual_seed(4)
    state: dict[str, Any] = {}
    for i in range(4000):
        dt = torch.float32 if i % 2 else torch.bfloat16
        state[f"experts.{i // 4}.w{i % 4}"] = torch.randn(32 * (1 + i % 64), generator=g).to(dt)
    state["big"] = torch.randn(1 << 18, generator=g)
    state["t"] = torch.randn(16, 16, generator=g).t()
    shared = torch.randn(256, generator=g)
    state["tied.a"], state["tied.b"] = shared[:128], shared[64:]
    cuda = {k: v.cuda() for k, v in state.items() if k not in ("tied.a", "tied.b")}
    shared_cuda = shared.cuda()
    cuda["tied.a"], cuda["tied.b"] = shared_cuda[:128], shared_cuda[64:]
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.max_memory_allocated()
    async with asyncsave.Checkpointer(tmp_path) as ckpt:
        await (await ckpt.save(1, cuda))
        for v in cuda.values():
            v.add_(1)  # after an eager save: not in the checkpoint
    assert torch.cuda.max_memory_allocated() - before <= 1 << 20
    out = asyncsave.load(tmp_path / "step_1")
    for k, v in state.items():
        assert out[k].dtype == v.dtype and out[k].shape == v.shape, k
        assert torch.equal(
            out[k].contiguous().view(-1).view(torch.uint8),
            v.contiguous().view(-1).view(torch.uint8),
        ), k


async def test_lazy_host_snapshot_runs_off_the_event_loop(tmp_path: Path) -> None:
    """A lazy save's copies taken before ``save()`` returns (small entries, module
    buffers: 1,000s of clones for a many-tensor state) run in a worker thread for
    host state, and the checkpoint holds the values at ``save()``."""
    loop_thread = threading.get_ident()
    threads: list[int] = []
    state = _base()
    exp = _snapshot(state)
    with early_copy_made(lambda: threads.append(threading.get_ident())):
        await _lazy_save_then_change(tmp_path, state)
    assert threads and loop_thread not in threads
    _assert_loads(tmp_path / "step_1", exp)


async def _lazy_save_then_change(tmp_path: Path, state: dict[str, Any]) -> None:
    async with asyncsave.Checkpointer(tmp_path) as ckpt:
        handle = await ckpt.save(1, state, lazy=True)
        for v in state.values():
            v.add_(1)  # small entries were copied before save() returned
        await handle


async def test_the_collector_comes_back_when_a_many_tensor_save_fails(tmp_path: Path) -> None:
    """A save of many tensors refused after its plan (a tensor that cannot be cut,
    larger than the budget): the collector is on again although the error, kept
    here, holds the plan through its traceback; and after the next save."""
    state: dict[str, Any] = {f"k{i}": torch.randn(3) for i in range(1500)}
    state["w"] = torch.zeros(64, 64).t()
    assert gc.isenabled()
    async with asyncsave.Checkpointer(tmp_path, budget_bytes=1024) as ckpt:
        with pytest.raises(asyncsave.StagingBudgetError) as info:
            await ckpt.save(1, state)
        assert gc.isenabled()
        del state["w"]
        await (await ckpt.save(2, state))
        assert gc.isenabled()
    assert info.value.key == "w"
    assert gc.isenabled()


# -- small plain trees: bound to the template on the event loop (issue 11) -------


@pytest.fixture
def flatten_threads(counter: _Counter) -> list[int]:
    """The thread of every walk of a state tree in the test, in call order."""
    return counter.flattens


async def test_a_small_plain_tree_of_the_last_structure_is_bound_on_the_event_loop(
    tmp_path: Path, groupings: _Counter, flatten_threads: list[int]
) -> None:
    """The first save plans in a worker thread; the next saves of the same small
    plain structure are bound to its template on the loop (no thread hop), each
    checkpoint with its own values; lazy saves too."""
    loop_thread = threading.get_ident()
    state = _base()
    expected = []
    async with asyncsave.Checkpointer(tmp_path) as ckpt:
        for step in (1, 2, 3):
            for v in state.values():
                v.add_(1)
            expected.append(_snapshot(state))
            handle = await ckpt.save(step, state, lazy=step == 3)
            await ckpt.staged()
            await handle
    assert groupings.calls == 1 and loop_thread not in groupings.threads
    assert flatten_threads[0] != loop_thread
    assert flatten_threads[1:] == [loop_thread, loop_thread]
    for step, exp in zip((1, 2, 3), expected, strict=True):
        _assert_loads(tmp_path / f"step_{step}", exp)


class _Stat:
    def __init__(self) -> None:
        self.n = torch.arange(4)
        self.calls: list[int] = []

    def state_dict(self) -> dict[str, Any]:
        self.calls.append(threading.get_ident())
        return {"n": self.n}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.n = sd["n"]


def _many_nodes(s: dict[str, Any]) -> None:
    s["many"] = [torch.full((2,), float(i)) for i in range(INLINE_PLAN_MAX_NODES)]


def _many_scalars(s: dict[str, Any]) -> None:
    s["counters"] = {f"c{i}": i for i in range(INLINE_PLAN_MAX_NODES)}


def _stateful(s: dict[str, Any]) -> None:
    s["stat"] = _Stat()


def _module(s: dict[str, Any]) -> None:
    s["module"] = torch.nn.Linear(3, 2)


def _ndarray(s: dict[str, Any]) -> None:
    s["array"] = np.arange(5, dtype=np.float32)


def _conjugated(s: dict[str, Any]) -> None:
    s["z"] = torch.randn(8, dtype=torch.complex64).conj()  # resolved (copied) when flattened


def _tagged(s: dict[str, Any]) -> None:
    s["tagged"] = asyncsave.Tagged(torch.arange(3), "rng")


_NOT_INLINE: dict[str, Callable[[dict[str, Any]], None]] = {
    "more nodes than the limit": _many_nodes,
    "more scalars than the limit": _many_scalars,
    "a Stateful object": _stateful,
    "an nn.Module": _module,
    "a NumPy array": _ndarray,
    "a Tagged leaf": _tagged,
    "a conjugated view (from a fresh user)": _conjugated,
}


@pytest.mark.parametrize("member", list(_NOT_INLINE))
async def test_what_is_not_small_and_plain_is_always_planned_in_a_worker(
    tmp_path: Path, flatten_threads: list[int], member: str
) -> None:
    """A tree past the node limit, or holding anything whose flattening may run
    the caller's code (``state_dict()``) or is not a plain leaf, is flattened
    in a worker thread at every save, the plan reused all the same (but for a
    conjugated view, which flattening copies into new memory every time); a
    ``Stateful``'s ``state_dict()`` runs once per save, on the loop's thread."""
    loop_thread = threading.get_ident()
    state = _base()
    _NOT_INLINE[member](state)
    expected = []
    async with asyncsave.Checkpointer(tmp_path) as ckpt:
        for step in (1, 2, 3):
            state["step"].add_(1)
            expected.append(_snapshot(state))
            await (await ckpt.save(step, state, lazy=step == 2))
        # A conjugated view is resolved into new memory at every flatten, after
        # a walk that found it unlike the last plan's (two walks a save); the
        # plan is made again unless the allocator handed the copy the last
        # one's address (then its signature is the last plan's: reused).
        conj = member.startswith("a conjugated")
        assert ckpt._planner.made + ckpt._planner.reused == 3
        if not conj:
            assert ckpt._planner.reused == 2
    assert len(flatten_threads) == (5 if conj else 3) and loop_thread not in flatten_threads
    if isinstance(state.get("stat"), _Stat):
        assert state["stat"].calls == [loop_thread] * 3
    for step, exp in zip((1, 2, 3), expected, strict=True):
        out = asyncsave.load(tmp_path / f"step_{step}", allow_pickle=False)
        assert torch.equal(out["step"], exp["step"])
        assert set(out) == set(exp)


@pytest.mark.parametrize("trigger", list(TRIGGERS))
async def test_a_small_plain_tree_whose_structure_changed_is_planned_in_a_worker(
    tmp_path: Path, groupings: _Counter, flatten_threads: list[int], trigger: str
) -> None:
    """The loop only binds an unchanged structure: a changed one is grouped
    again in a worker thread, and both checkpoints are exact."""
    loop_thread = threading.get_ident()
    state = _base()
    first = _snapshot(state)
    async with asyncsave.Checkpointer(tmp_path) as ckpt:
        await (await ckpt.save(1, state))
        TRIGGERS[trigger](state)
        second = _snapshot(state)
        await (await ckpt.save(2, state))
    assert groupings.calls == 2 and loop_thread not in groupings.threads
    assert flatten_threads[-1] != loop_thread
    _assert_loads(tmp_path / "step_1", first)
    _assert_loads(tmp_path / "step_2", second)


@pytest.mark.parametrize("container", ["list", "dict"])
async def test_a_small_tree_that_contains_itself_is_refused_by_name(
    tmp_path: Path, container: str
) -> None:
    """A recursive tree after a save of a small plain one: the node limit stops
    the loop's walk, and the worker's plan refuses it, naming the key; the
    checkpointer goes on."""
    state = _base()
    async with asyncsave.Checkpointer(tmp_path) as ckpt:
        await (await ckpt.save(1, state))
        loop: Any = [] if container == "list" else {}
        if container == "list":
            loop.append(loop)
        else:
            loop["again"] = loop
        with pytest.raises(asyncsave.InvalidStateError, match="recursive") as info:
            await ckpt.save(2, {**state, "loop": loop})
        assert info.value.key is not None and info.value.key.startswith("loop")
        await (await ckpt.save(3, state))
    assert sorted(p.name for p in tmp_path.glob("step_*")) == ["step_1", "step_3"]


def _self_list(n: int) -> list[Any]:
    loop: list[Any] = []
    loop.extend([loop] * n)
    return loop


@pytest.mark.parametrize(
    "make",
    [
        lambda: list(range(100_000)),
        lambda: dict.fromkeys(range(100_000), 0),
        lambda: {"w": torch.zeros(2), "inner": [list(range(100_000))]},
        lambda: _self_list(100_000),
        lambda: OrderedDict((f"k{i}", torch.zeros(1)) for i in range(100_000)),
    ],
    ids=["list", "dict", "nested", "list holding itself", "OrderedDict"],
)
def test_the_loops_walk_of_a_tree_stays_within_the_node_limit(tmp_path: Path, make: Any) -> None:
    """The walk that decides whether a tree is planned on the loop looks at no
    more than the node limit, however large one container is: it allocates
    nothing in proportion to the tree (from a review: it pushed each container
    whole, 237 ms on the loop for a list holding itself 200,000 times). Measured
    from ``save()`` to the start of the worker's walk (the loop's walk and what
    a save does before it), after a save of a small plain tree."""
    import tracemalloc

    peaks: list[int] = []

    def at(what: str) -> None:
        if what == "flatten" and tracemalloc.is_tracing() and not peaks:
            peaks.append(tracemalloc.get_traced_memory()[1])

    tree = make()
    with asyncsave.SyncCheckpointer(tmp_path) as ckpt:
        ckpt.save(1, {"w": torch.zeros(2)}).result()
        with planning(at):
            tracemalloc.start()
            try:
                ckpt.save(2, {"w": torch.zeros(2), "big": tree}).result()
            except asyncsave.CheckpointError:
                pass  # the list holding itself: refused by the worker's plan
            finally:
                tracemalloc.stop()
    assert peaks and peaks[0] < 64 << 10, peaks


_plain_leaf = st.one_of(
    st.integers(-5, 5).map(lambda n: torch.arange(abs(n) + 1, dtype=torch.float32) * n),
    st.integers(-(2**40), 2**40),
    st.floats(allow_nan=False),
    st.text(max_size=3),
    st.booleans(),
    st.none(),
)
_any_leaf = st.one_of(
    _plain_leaf,
    st.builds(_Stat),
    st.integers(1, 4).map(lambda n: np.arange(n, dtype=np.int64)),
)


def _tree(leaf: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    return st.recursive(
        leaf,
        lambda kids: st.one_of(
            st.lists(kids, max_size=6),
            st.lists(kids, max_size=6).map(tuple),
            st.dictionaries(st.text("abc", min_size=1, max_size=3), kids, max_size=6),
        ),
        max_leaves=60,
    )


def _nodes_and_plain(tree: Any) -> tuple[int, bool]:
    if isinstance(tree, dict):
        counts = [_nodes_and_plain(v) for v in tree.values()]
    elif isinstance(tree, (list, tuple)):
        counts = [_nodes_and_plain(v) for v in tree]
    else:
        return 1, isinstance(tree, (torch.Tensor, int, float, str, bool, type(None)))
    return 1 + sum(n for n, _ in counts), all(p for _, p in counts)


@settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(tree=_tree(_any_leaf))
def test_random_trees_are_bound_on_the_loop_only_when_small_and_plain(tree: Any) -> None:
    """Random trees of containers, tensors, scalars, ``Stateful`` objects and
    arrays, saved twice (values changed in between): the second save is bound
    on the loop exactly when the tree is plain and within the node limit, every
    ``state_dict()`` runs once per save, and both checkpoints load back equal."""
    counter = _Counter()
    threads = counter.flattens
    state = {"tree": tree, "x": torch.zeros(3)}
    nodes, plain = _nodes_and_plain(state)
    stats = [leaf for leaf in _leaves(tree) if isinstance(leaf, _Stat)]
    with planning(counter), tempfile.TemporaryDirectory() as tmp:
        with asyncsave.SyncCheckpointer(Path(tmp), allow_pickle=False) as ckpt:
            ckpt.save(1, state).result()
            first = copy.deepcopy(asyncsave.load(Path(tmp) / "step_1"))
            state["x"].add_(1)
            ckpt.save(2, state).result()
            loop_thread = ckpt.checkpointer._loop_thread
        second = asyncsave.load(Path(tmp) / "step_2")
    assert (threads[-1] == loop_thread) == (plain and nodes <= INLINE_PLAN_MAX_NODES)
    assert all(s.calls == [loop_thread] * 2 for s in stats)
    assert torch.equal(first["x"], torch.zeros(3)) and torch.equal(second["x"], torch.ones(3))
    _assert_same_tree(tree, first["tree"])
    _assert_same_tree(tree, second["tree"])


def _assert_same_tree(saved: Any, loaded: Any) -> None:
    """``loaded`` is ``saved`` as ``load`` gives it back (a ``Stateful`` as its
    state dict), with exact types, values and float bits."""
    if isinstance(saved, _Stat):
        saved = {"n": saved.n}
    assert type(loaded) is type(saved), (type(saved), type(loaded))
    if isinstance(saved, dict):
        assert list(loaded) == list(saved)
        for k in saved:
            _assert_same_tree(saved[k], loaded[k])
    elif isinstance(saved, (list, tuple)):
        assert len(loaded) == len(saved)
        for a, b in zip(saved, loaded, strict=True):
            _assert_same_tree(a, b)
    elif isinstance(saved, torch.Tensor):
        assert saved.dtype == loaded.dtype and torch.equal(saved, loaded)
    elif isinstance(saved, np.ndarray):
        assert saved.dtype == loaded.dtype and np.array_equal(saved, loaded)
    elif isinstance(saved, float):
        assert saved.hex() == loaded.hex()
    else:
        assert saved == loaded


def _leaves(tree: Any) -> Iterator[Any]:
    if isinstance(tree, dict):
        for v in tree.values():
            yield from _leaves(v)
    elif isinstance(tree, (list, tuple)):
        for v in tree:
            yield from _leaves(v)
    else:
        yield tree


# -- the reuse path of a many-tensor state: no per-tensor work on the loop -------


def _loop_lines(n: int, tmp_path: Path) -> int:
    """Python line events on the event loop's thread during the third save (a
    reused plan) of ``n`` small tensors, its commit included."""
    import sys

    import anyio

    state = {f"experts.{i}.w": torch.full((4,), float(i)) for i in range(n)}
    counted = [0]

    def tracer(frame: Any, event: str, arg: Any) -> Any:
        counted[0] += event == "line"
        return tracer

    async def main() -> None:
        async with asyncsave.Checkpointer(tmp_path / str(n)) as ckpt:
            await (await ckpt.save(1, state))
            await (await ckpt.save(2, state))
            sys.settrace(tracer)  # this thread only: the loop's
            try:
                await (await ckpt.save(3, state))
            finally:
                sys.settrace(None)

    anyio.run(main)
    return counted[0]


def test_a_reused_save_runs_no_per_tensor_python_on_the_event_loop(tmp_path: Path) -> None:
    """A save whose plan is reused does its per-tensor passes in worker threads
    (flatten, bind, sorting the entries by device, summing their bytes, freeing
    the manifest's rows): the Python lines run on the loop's thread do not grow
    with the number of tensors (8x the tensors: under 1 more line per 16
    tensors, where one pass over them on the loop is at least a line each)."""
    small, large = _loop_lines(512, tmp_path), _loop_lines(4096, tmp_path)
    assert large - small < (4096 - 512) // 16, (small, large)


def test_any_difference_in_a_long_signature_replans() -> None:
    """The signatures of two saves are compared in slices of 4,096 tensors (the
    loop gets the GIL between them): a change of one tensor (its dtype) in the
    first slice, at either edge of a slice, or the last, or one tensor fewer,
    replans; the same structure again does not."""
    chunk = 4096
    n = 3 * chunk + 5
    counter = _Counter()
    with tempfile.TemporaryDirectory() as tmp, planning(counter):
        with asyncsave.SyncCheckpointer(Path(tmp), writer_threads=1) as ckpt:
            step = itertools.count(1)
            base = {f"t{i:05d}": torch.zeros(1) for i in range(n)}
            ckpt.save(next(step), base).result()
            ckpt.save(next(step), base).result()
            assert counter.calls == 1  # the same structure: reused
            for i in (0, chunk - 1, chunk, 2 * chunk + 1, n - 1):
                other = dict(base)
                other[f"t{i:05d}"] = torch.zeros(1, dtype=torch.float64)
                before = counter.calls
                ckpt.save(next(step), other).result()
                ckpt.save(next(step), base).result()
                assert counter.calls == before + 2, i
            fewer = dict(base)
            fewer.pop(f"t{n - 1:05d}")
            before = counter.calls
            ckpt.save(next(step), fewer).result()
            assert counter.calls == before + 1


def test_a_reused_plan_keeps_at_most_four_tracked_objects_per_tensor(tmp_path: Path) -> None:
    """What a save of a reused plan leaves young per tensor is what the
    collector's young pass scans, with the GIL held, when the plan's pause ends
    (the largest event-loop gap of a save of 100,000 tensors): a leaf, a bound
    entry, a tree item and its key; the bound entries' ``__dict__`` (one more
    object each) is not made. Counted around ``save()`` itself, which returns once
    the state is planned and staged."""
    n = 5000
    state = {f"e{i}": torch.full((2,), float(i)) for i in range(n)}
    with asyncsave.SyncCheckpointer(tmp_path) as ckpt:
        ckpt.save(1, state).result()
        gc.collect()
        gc.disable()
        try:
            before = len(gc.get_objects(generation=0))
            handle = ckpt.save(2, state)
            young = len(gc.get_objects(generation=0)) - before
        finally:
            gc.enable()
        handle.result()
    assert young <= 4 * n + 500, young
