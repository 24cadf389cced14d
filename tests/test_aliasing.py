"""Tensors aliasing one memory region round-trip exactly, sharing kept (S19).

The rule (docs/decisions.md, "Shared memory"): tensors whose bytes overlap in
memory, or that sit on one storage object, are stored once as the union of their
byte ranges and come back as views of one storage, at the same distances from
each other, with their strides. Tensors that shared no byte and no storage come
back apart. Overlapping views that no single torch storage can hold (two views
whose distance is not a multiple of an element size) are an
``UnsupportedTensorError`` naming the key.

Source: huggingface/safetensors PR #264 and transformers PR #23871 (two tensors
whose storages start at one address but differ in length).
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import asyncsave

pytestmark = pytest.mark.anyio

_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_NP_INT_OF_SIZE = {1: np.uint8, 2: np.int16, 4: np.int32, 8: np.int64}


# --- what sharing means, computed from the tensors themselves ------------------


def _as_tensor(x: Any) -> torch.Tensor:
    return torch.from_numpy(x) if isinstance(x, np.ndarray) else x


def _span(x: Any) -> tuple[int, int]:
    """[first, last + 1) byte addresses of ``x``'s elements."""
    t = _as_tensor(x)
    last = sum((n - 1) * s for n, s in zip(t.shape, t.stride(), strict=True))
    return t.data_ptr(), t.data_ptr() + (last + 1) * t.element_size()


def _storage(x: Any) -> tuple[int, int]:
    s = _as_tensor(x).untyped_storage()
    return s.data_ptr(), s.nbytes()


def _regions(state: dict[str, Any]) -> list[list[str]]:
    """Keys grouped by shared memory: connected by overlapping bytes or by one
    storage object (a reference implementation, quadratic on purpose)."""
    keys = [k for k, v in state.items() if _as_tensor(v).numel() > 0]
    parent = {k: k for k in keys}

    def find(k: str) -> str:
        while parent[k] != k:
            k = parent[k]
        return k

    for i, a in enumerate(keys):
        for b in keys[i + 1 :]:
            (a0, a1), (b0, b1) = _span(state[a]), _span(state[b])
            if (a0 < b1 and b0 < a1) or _storage(state[a]) == _storage(state[b]):
                parent[find(a)] = find(b)
    groups: dict[str, list[str]] = {}
    for k in keys:
        groups.setdefault(find(k), []).append(k)
    return list(groups.values())


def _bits(x: Any) -> torch.Tensor:
    t = _as_tensor(x)
    flat = torch.empty(t.numel(), dtype=t.dtype).copy_(t.reshape(-1))
    return flat.view(torch.uint8)


def assert_round_trip(state: dict[str, Any], out: dict[str, Any]) -> None:
    """Exact values, dtypes, shapes and leaf types; tensors that shared memory
    share it again at the same distances (with their strides); tensors that did
    not, do not."""
    assert list(out) == list(state)
    for k, v in state.items():
        assert type(out[k]) is type(v), k
        assert out[k].dtype == v.dtype and tuple(out[k].shape) == tuple(v.shape), k
        assert torch.equal(_bits(out[k]), _bits(v)), k
    regions = _regions(state)
    for region in regions:
        first = region[0]
        for k in region[1:]:
            # Same distance between the first elements, in one loaded storage.
            assert _span(out[k])[0] - _span(out[first])[0] == (
                _span(state[k])[0] - _span(state[first])[0]
            ), (first, k)
            if not isinstance(out[k], np.ndarray) and not isinstance(out[first], np.ndarray):
                assert _storage(out[k])[0] == _storage(out[first])[0], (first, k)
        if len(region) > 1:
            for k in region:
                assert _as_tensor(out[k]).stride() == _as_tensor(state[k]).stride(), k
    for i, a in enumerate(regions):
        for b in regions[i + 1 :]:
            for ka in a:
                for kb in b:
                    (a0, a1), (b0, b1) = _span(out[ka]), _span(out[kb])
                    assert a1 <= b0 or b1 <= a0, (ka, kb)  # still apart


def _write_one(x: Any, index: int, value: int) -> None:
    """Write ``value`` (as raw bits) into element ``index`` of ``x`` (flat order)."""
    t = _as_tensor(x)
    if t.numel() == 0:
        return
    idx = np.unravel_index(index % t.numel(), tuple(t.shape))
    bits = t.view(_INT_OF_SIZE[t.element_size()])
    info = torch.iinfo(bits.dtype)
    bits[tuple(int(i) for i in idx)] = value % (info.max - info.min + 1) + info.min


def _overlaps_itself(x: Any) -> bool:
    """Whether two elements of ``x`` are one memory location (``expand``,
    overlapping ``as_strided`` windows)."""
    t = _as_tensor(x)
    offsets = np.zeros((), dtype=np.int64)
    for n, s in zip(t.shape, t.stride(), strict=True):
        offsets = np.add.outer(offsets, np.arange(n) * s)
    return bool(np.unique(offsets).size < t.numel())


def assert_writes_propagate_alike(
    state: dict[str, Any], out: dict[str, Any], writes: list[tuple[str, int, int]]
) -> None:
    """The same element writes, made through the same keys of the saved and the
    loaded tree, leave both trees with the same bits: a write through one tensor
    shows through exactly the tensors it showed through before the save.

    Writes through a tensor that overlaps itself and shares memory with no other
    leaf are skipped: such a tensor is stored gathered and comes back contiguous
    (docs/decisions.md, "Shared memory"), with its values, not its self-overlap."""
    alone = {r[0] for r in _regions(state) if len(r) == 1}
    for key, index, value in writes:
        if key in alone and _overlaps_itself(state[key]):
            continue
        _write_one(state[key], index, value)
        _write_one(out[key], index, value)
    for k in state:
        assert torch.equal(_bits(out[k]), _bits(state[k])), k


async def save_and_load(root: Path, state: Any, **save_kw: Any) -> Any:
    async with asyncsave.Checkpointer(root, **save_kw) as ckpt:
        info = await (await ckpt.save(1, state))
    assert info is not None
    return asyncsave.load(info.path)


# --- the input -------------------------------------------------------


@pytest.mark.parametrize("head_first", [True, False], ids=["head-first", "params-first"])
async def test_storages_starting_at_one_address_with_different_lengths_round_trip(
    tmp_path: Path, head_first: bool
) -> None:
    t = torch.arange(100.0)
    head = torch.from_numpy(t.numpy()[:10])  # its own storage: 40 bytes at t's address
    assert head.untyped_storage().data_ptr() == t.untyped_storage().data_ptr()
    state = {"head": head, "params": t} if head_first else {"params": t, "head": head}
    out = await save_and_load(tmp_path, state)
    assert torch.equal(out["head"], t[:10]) and torch.equal(out["params"], t)
    assert out["head"].data_ptr() == out["params"].data_ptr()
    assert_round_trip(state, out)
    out["params"][3] = -7.0  # one memory: a write through one shows through the other
    assert out["head"][3] == -7.0


# --- members of the kind -------------------------------------------------------


def _numpy_middle() -> dict[str, Any]:
    t = torch.arange(100.0)
    return {"mid": torch.from_numpy(t.numpy()[10:20]), "params": t}


def _numpy_slices_overlapping_partly() -> dict[str, Any]:
    n = np.arange(100, dtype=np.float32)
    # Neither slice holds the other, and no leaf covers both.
    return {"a": torch.from_numpy(n[0:60]), "b": torch.from_numpy(n[40:100])}


def _numpy_strided_and_ndarray_leaf() -> dict[str, Any]:
    t = torch.arange(48, dtype=torch.int32)
    n = t.numpy()
    return {"every3": torch.from_numpy(n[1::3]), "arr": n[5:29].reshape(4, 6), "t": t[2:40]}


def _frombuffer_same_start() -> dict[str, Any]:
    buf = bytearray(range(256)) * 2
    return {
        "short": torch.frombuffer(buf, dtype=torch.int16, count=10),
        "long": torch.frombuffer(buf, dtype=torch.int16),
    }


def _frombuffer_other_dtype_unaligned() -> dict[str, Any]:
    buf = bytearray(range(64))
    # A float32 view one byte into the buffer: only a uint8 storage that starts
    # three bytes before the buffer can hold both views.
    return {
        "bytes": torch.frombuffer(buf, dtype=torch.uint8),
        "f32": torch.frombuffer(buf, dtype=torch.float32, offset=1, count=8),
    }


def _dlpack() -> dict[str, Any]:
    t = torch.arange(60.0).view(6, 10)
    n = np.arange(30, dtype=np.int64)
    return {
        "rows": torch.from_dlpack(t[1:4]),
        "t": t,
        "np_dl": torch.from_dlpack(n[3:9]),
        "np_all": torch.from_numpy(n),
    }


def _as_strided_windows() -> dict[str, Any]:
    t = torch.arange(50.0)
    return {
        "windows": t.as_strided((9, 10), (5, 1)),  # overlapping windows
        "bcast": t.as_strided((4, 3), (0, 2), 7),
        "tail": torch.from_numpy(t.numpy()[40:]),
    }


def _dtype_views() -> dict[str, Any]:
    t = torch.randn(32)
    return {
        "half": t[4:20].view(torch.float16)[3:17],
        "bytes": t.view(torch.uint8)[5:61],
        "f64": torch.from_numpy(t.numpy()[10:30].view(np.float64)),
        "i32": t.view(torch.int32),
    }


def _storages_chained() -> dict[str, Any]:
    # a overlaps b, b overlaps c, a and c share nothing: one region.
    n = np.arange(90, dtype=np.float64)
    return {
        "c": torch.from_numpy(n[60:90]),
        "a": torch.from_numpy(n[0:35]),
        "b": torch.from_numpy(n[30:65]),
        "apart": torch.from_numpy(np.arange(5.0)),
    }


def _views_of_one_storage_apart() -> dict[str, Any]:
    # One storage object, no common byte: still one storage after load (as before).
    t = torch.arange(40.0)
    return {"lo": t[:10], "hi": t[30:], "numpy_hi": torch.from_numpy(t.numpy()[30:])}


def _adjacent_numpy_slices() -> dict[str, Any]:
    # Neighbours in memory that share no byte and no storage: they come back apart.
    n = np.arange(20, dtype=np.float32)
    return {"left": torch.from_numpy(n[:10]), "right": torch.from_numpy(n[10:])}


KINDS: dict[str, Callable[[], dict[str, Any]]] = {
    "numpy-middle": _numpy_middle,
    "numpy-partial-overlap": _numpy_slices_overlapping_partly,
    "numpy-strided-ndarray": _numpy_strided_and_ndarray_leaf,
    "frombuffer-same-start": _frombuffer_same_start,
    "frombuffer-unaligned": _frombuffer_other_dtype_unaligned,
    "dlpack": _dlpack,
    "as-strided": _as_strided_windows,
    "dtype-views": _dtype_views,
    "chained": _storages_chained,
    "one-storage-apart": _views_of_one_storage_apart,
    "adjacent": _adjacent_numpy_slices,
}


@pytest.mark.parametrize("reverse", [False, True], ids=["order", "reversed"])
@pytest.mark.parametrize("kind", list(KINDS))
async def test_aliasing_tensors_round_trip_with_sharing(
    tmp_path: Path, kind: str, reverse: bool
) -> None:
    state = KINDS[kind]()
    if reverse:
        state = dict(reversed(state.items()))
    out = await save_and_load(tmp_path, state)
    assert_round_trip(state, out)
    writes = [(k, i * 7 + 3, 1000 + i) for i, k in enumerate(state)]
    assert_writes_propagate_alike(state, out, writes)


@pytest.mark.parametrize("kind", ["numpy-partial-overlap", "chained", "dtype-views"])
async def test_aliasing_round_trips_through_a_streamed_and_a_lazy_save(
    tmp_path: Path, kind: str
) -> None:
    """The streamed path (a budget smaller than the state: a region cut between
    rounds) and a lazy save (small regions copied before save() returns) keep the
    same rule."""
    state = KINDS[kind]()
    out = await save_and_load(tmp_path / "streamed", state, budget_bytes=128)
    assert_round_trip(state, out)
    async with asyncsave.Checkpointer(tmp_path / "lazy") as ckpt:
        handle = await ckpt.save(1, state, lazy=True)
        await handle.staged()
        info = await handle
    assert info is not None
    assert_round_trip(state, asyncsave.load(info.path))


async def test_tied_views_of_distinct_storage_objects_stay_tied_in_a_model(
    tmp_path: Path,
) -> None:
    """A model whose two parameters alias one buffer through two storage objects
    (one made by NumPy): loaded into a fresh model, they stay tied."""
    t = torch.randn(10, 4)
    model = torch.nn.Module()
    model.head = torch.nn.Parameter(torch.from_numpy(t.numpy()[:5]))  # the shorter first
    model.embed = torch.nn.Parameter(t)
    out = await save_and_load(tmp_path, {"model": model.state_dict()})
    sd = out["model"]
    assert torch.equal(sd["embed"], t) and torch.equal(sd["head"], t[:5])
    sd["embed"][2, 1] = 99.0
    assert sd["head"][2, 1] == 99.0


async def test_overlapping_views_no_storage_can_hold_are_a_typed_error(tmp_path: Path) -> None:
    """Two float32 views one byte apart overlap, but torch has no storage that
    holds both as views: refused, naming the key, nothing committed."""
    buf = bytearray(64)
    state = {
        "a": torch.frombuffer(buf, dtype=torch.float32, offset=1, count=4),
        "b": torch.frombuffer(buf, dtype=torch.float32, offset=2, count=4),
    }
    async with asyncsave.Checkpointer(tmp_path) as ckpt:
        with pytest.raises(asyncsave.UnsupportedTensorError, match="'b'") as info:
            await ckpt.save(1, state)
        assert info.value.key == "b"
        await ckpt.save(2, {"a": state["a"].clone()})
    assert asyncsave.latest(tmp_path).step == 2  # type: ignore[union-attr]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("lazy", [False, True], ids=["eager", "lazy"])
async def test_cuda_storages_over_one_memory_round_trip_with_sharing(
    tmp_path: Path, lazy: bool
) -> None:
    """CUDA: a DLPack view is a distinct storage over the same device memory; the
    region is copied part by part on the side stream, then loads shared (on the
    CPU and on the device)."""
    t = torch.arange(4096.0, device="cuda")
    state = {"head": torch.from_dlpack(t[100:300]), "params": t, "tail": t[4000:]}
    assert state["head"].untyped_storage().data_ptr() != t.untyped_storage().data_ptr()
    async with asyncsave.Checkpointer(tmp_path) as ckpt:
        handle = await ckpt.save(1, state, lazy=lazy)
        await handle.staged()
        info = await handle
    assert info is not None
    cpu_state = {k: v.cpu() for k, v in state.items()}
    out = asyncsave.load(info.path)
    assert all(torch.equal(out[k], cpu_state[k]) for k in state)
    assert out["head"].data_ptr() - out["params"].data_ptr() == 400
    on_device = asyncsave.load(info.path, device="cuda")
    assert on_device["head"].data_ptr() - on_device["params"].data_ptr() == 400
    on_device["params"][150] = -1.0
    assert on_device["head"][50].item() == -1.0


# --- random aliasing layouts ---------------------------------------------------

# dtype, matching NumPy dtype (None: reinterpret through the same-size integer)
_DTYPES: list[tuple[torch.dtype, Any]] = [
    (torch.uint8, np.uint8),
    (torch.int16, np.int16),
    (torch.float16, np.float16),
    (torch.bfloat16, None),
    (torch.float32, np.float32),
    (torch.int32, np.int32),
    (torch.float64, np.float64),
    (torch.int64, np.int64),
]
_HOW = ["torch", "numpy", "ndarray", "frombuffer", "dlpack", "clone", "base"]
_POST = ["none", "step", "as_strided", "transpose"]


def _leaf(
    raw: torch.Tensor, how: str, dtype_i: int, start: int, count: int, post: str, k: int
) -> Any:
    """A tensor (or NumPy array) of ``count`` elements over ``raw`` at element
    ``start`` of the chosen dtype, made the chosen way, then reshaped."""
    dtype, np_dtype = _DTYPES[dtype_i]
    size = dtype.itemsize
    lo, hi = start * size, (start + count) * size
    n = raw.numpy()
    if how == "base":
        x: Any = raw.view(dtype)
    elif how in ("numpy", "ndarray"):
        arr = n[lo:hi].view(np_dtype or _NP_INT_OF_SIZE[size])
        if how == "ndarray":
            return arr[:: max(1, k)] if post == "step" else arr
        x = torch.from_numpy(arr)
        if np_dtype is None:
            x = x.view(dtype)
    elif how == "frombuffer":
        x = torch.frombuffer(n, dtype=dtype, offset=lo, count=count)
    elif how == "dlpack":
        x = torch.from_dlpack(raw[lo:hi].view(dtype))
    elif how == "clone":
        x = raw[lo:hi].view(dtype).clone()
    else:
        x = raw[lo:hi].view(dtype)
    m = x.numel()
    if post == "step":
        x = x[:: max(1, k)]
    elif post == "as_strided" and m >= 2:
        rows = max(1, min(k, m - 1))
        win = m - rows + 1  # rows overlapping windows of win elements, 1 apart
        x = x.as_strided((rows, win), (1, 1))
    elif post == "transpose" and m % 2 == 0:
        x = x.view(2, m // 2).t()
    return x


@st.composite
def aliasing_layouts(draw: st.DrawFn) -> tuple[dict[str, Any], dict[str, Any]]:
    nbytes = draw(st.integers(1, 32)) * 8
    seed = draw(st.integers(0, 2**31 - 1))
    g = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g)
    keys = draw(
        st.lists(
            st.text("abcxyz_/.0123", min_size=1, max_size=6), min_size=1, max_size=6, unique=True
        )
    )
    state: dict[str, Any] = {}
    for key in keys:
        dtype_i = draw(st.integers(0, len(_DTYPES) - 1))
        size = _DTYPES[dtype_i][0].itemsize
        if nbytes < size:
            dtype_i, size = 0, 1
        n_elems = nbytes // size
        start = draw(st.integers(0, n_elems - 1))
        count = draw(st.integers(1, n_elems - start))
        how = draw(st.sampled_from(_HOW))
        post = draw(st.sampled_from(_POST))
        k = draw(st.integers(1, 4))
        state[key] = _leaf(raw, how, dtype_i, start, count, post, k)
    # A budget: a streamed save (regions cut between rounds), big enough for the
    # largest tensor that is gathered whole (4 overlapping windows of the buffer);
    # lazy: small regions copied before save() returns.
    budget = draw(st.sampled_from([None, -(-4 * nbytes // 64) * 64]))
    return state, {"budget_bytes": budget, "lazy": draw(st.booleans())}


@settings(
    # 100 in CI (about 7 s); ASYNCSAVE_FUZZ_PROFILE=long scales it (tests/conftest.py)
    max_examples=max(100, settings.default.max_examples // 2),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(layout=aliasing_layouts(), data=st.data())
def test_random_aliasing_layouts_round_trip_with_sharing(
    layout: tuple[dict[str, Any], dict[str, Any]], data: st.DataObject
) -> None:
    """Random layouts over one random buffer: torch slices and strides, NumPy
    slices (as tensors and as arrays), ``frombuffer``, DLPack, dtype
    reinterpretations, clones, in random order under random keys, saved eagerly
    or lazily, whole or streamed through a small budget."""
    state, how = layout
    with tempfile.TemporaryDirectory() as tmp:
        with asyncsave.SyncCheckpointer(Path(tmp), budget_bytes=how["budget_bytes"]) as ckpt:
            info = ckpt.save(1, state, lazy=how["lazy"]).result()
        assert info is not None
        out = asyncsave.load(info.path)
        assert_round_trip(state, out)
        writes = data.draw(
            st.lists(
                st.tuples(st.sampled_from(list(state)), st.integers(0, 255), st.integers(0, 2**16)),
                max_size=6,
            )
        )
        assert_writes_propagate_alike(state, out, writes)
