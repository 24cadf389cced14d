"""A tensor's bytes move as bits, never as values: one implementation of "the
bytes of this tensor" (``asyncsave._bits``) for the CUDA gather, the streamed
rounds, hashing and the DCP writer, tested on CPU tensors of every layout
(one element of any stride, zero elements, transposed, strided, overlapping,
offset into their storage) and every dtype, ``bool`` whose bytes are not 0/1
included; and saved and loaded bit for bit."""

# Private imports: unit tests of the private staging helpers (byte views, gathers,
# the staging pool's poisoning, which no public call reaches on demand).
from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import anyio
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import asyncsave
from asyncsave._bits import clone_bits, flat_bytes
from asyncsave._format import layout_files
from asyncsave._plan import make_plan
from asyncsave._stage import (
    GATHER_BYTES,
    GATHER_MAX_ENTRY,
    StagingPool,
    gather_batches,
    gather_into,
)

pytestmark = pytest.mark.anyio

_DTYPES = [
    torch.bool,
    torch.uint8,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.float16,
    torch.bfloat16,
    torch.float32,
    torch.float64,
    torch.complex64,
    torch.complex128,
    torch.float8_e4m3fn,
]


def _expected_bytes(t: torch.Tensor) -> list[int]:
    """``t``'s bytes in row-major order, read element by element from its storage
    in plain Python (the oracle: no torch copy, which may change bits)."""
    size = t.element_size()
    storage = list(torch.empty(0, dtype=torch.uint8).set_(t.untyped_storage()).tolist())
    out: list[int] = []
    for index in itertools.product(*(range(n) for n in t.shape)):
        at = (
            t.storage_offset() + sum(i * s for i, s in zip(index, t.stride(), strict=True))
        ) * size
        out += storage[at : at + size]
    return out


@st.composite
def tensors(draw: st.DrawFn, max_elements: int = 24) -> torch.Tensor:
    """A CPU tensor of any dtype over random bytes (a ``bool`` tensor holds bytes
    other than 0/1), of any shape, strides (0, transposed, gaps) and offset."""
    dtype = draw(st.sampled_from(_DTYPES))
    shape = draw(st.lists(st.integers(0, 4), max_size=3))
    strides = [draw(st.integers(0, 6)) for _ in shape]
    offset = draw(st.integers(0, 5))
    size = torch.empty(0, dtype=dtype).element_size()
    span = offset + 1 + sum((n - 1) * s for n, s in zip(shape, strides, strict=True) if n)
    seed = draw(st.integers(0, 2**31 - 1))
    g = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (span * size,), dtype=torch.uint8, generator=g)
    base = raw.view(dtype)
    return base.as_strided(shape, strides, offset)


@settings(max_examples=300, deadline=None)
@given(t=tensors())
def test_flat_bytes_are_the_tensors_bytes_in_row_major_order(t: torch.Tensor) -> None:
    """Every layout and dtype: the bytes in row-major order, bit for bit; a view
    of the storage (no copy) whenever the tensor is contiguous."""
    out = flat_bytes(t)
    assert out.dtype == torch.uint8 and out.dim() == 1
    assert out.tolist() == _expected_bytes(t)
    if t.is_contiguous() and t.numel():
        assert out.untyped_storage().data_ptr() == t.untyped_storage().data_ptr()


@settings(max_examples=200, deadline=None)
@given(t=tensors())
def test_clone_bits_keeps_every_bit(t: torch.Tensor) -> None:
    """A copy of any dtype and layout keeps every bit (``clone()`` of a ``bool``
    tensor normalises its bytes to 0/1)."""
    out = clone_bits(t)
    assert out.dtype == t.dtype and out.shape == t.shape
    assert flat_bytes(out).tolist() == _expected_bytes(t)


def test_conjugate_and_negative_views_give_their_values_bytes() -> None:
    """A conjugate or negative view's bytes are those of its values (its
    storage holds the values before the sign flip)."""
    z = torch.complex(torch.arange(4.0), torch.arange(4.0) + 1)
    for view in (z.conj(), z.conj().imag, z.conj()[::2]):
        resolved = view.resolve_conj().resolve_neg()
        assert flat_bytes(view).tolist() == _expected_bytes(resolved)
        assert flat_bytes(clone_bits(view)).tolist() == _expected_bytes(resolved)


def _gathered(state: dict[str, Any]) -> tuple[list[list[Any]], list[bytes], list[bytes]]:
    """The gather batches of ``state``'s plan, each batch's gathered bytes and its
    sources' bytes by the oracle."""
    plan = make_plan(state, allow_pickle=False)
    layout_files(plan.entries, rank=0, max_files=1)
    batches, _ = gather_batches(plan.entries)
    got, want = [], []
    for batch in batches:
        out = torch.empty(sum(e.nbytes for e in batch), dtype=torch.uint8)
        gather_into(out, batch)
        got.append(bytes(out.tolist()))
        want.append(
            bytes(b for e in batch if e.source is not None for b in _expected_bytes(e.source))
        )
    return batches, got, want


def test_one_element_tensors_of_any_stride_are_gathered() -> None:
    """One element of stride 2 and one of stride 4 in one batch (the device
    gather refused them, so such a CUDA save failed), with a bool of bytes other
    than 0/1 and tensors whose size-1 dimensions have odd strides."""
    flags = torch.tensor([0, 1, 2, 255, 7, 0, 128, 3], dtype=torch.uint8).view(torch.bool)
    state = {
        "a": torch.arange(2.0)[::2],
        "b": torch.arange(4.0)[::4],
        "c": torch.arange(12.0).reshape(3, 4)[1:2, :],  # (1, 4), stride (4, 1)
        "d": torch.arange(12.0).reshape(4, 3)[:, 1:2].t()[:, :1],  # (1, 1), stride (1, 3)
        "flags": flags,
    }
    batches, got, want = _gathered(state)
    assert {e.name for b in batches for e in b} >= {"a", "b", "flags"}
    assert got == want


@st.composite
def states(draw: st.DrawFn) -> dict[str, torch.Tensor]:
    """A state of 2..8 tensors, each on its own storage (contiguous ones are the
    gather's candidates; the rest are left out of its batches)."""
    n = draw(st.integers(2, 8))
    out = {}
    for i in range(n):
        t = draw(tensors())
        out[f"t{i}"] = t.contiguous() if draw(st.booleans()) else t
    return out


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(state=states())
def test_the_gather_moves_every_batchs_bytes_bit_for_bit(state: dict[str, torch.Tensor]) -> None:
    """Any mix of dtypes and layouts: every batch the gather makes holds its
    sources' bytes, back to back, bit for bit."""
    batches, got, want = _gathered(state)
    assert got == want
    assert all(len(batch) >= 2 for batch in batches)


def _odd_bools(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g).view(torch.bool)


def _bool_state() -> dict[str, torch.Tensor]:
    """``bool`` tensors whose bytes are not 0/1, of every size class and layout
    (small ones are copied early by a lazy save, large ones streamed in rounds)."""
    big = _odd_bools(4 << 20, 1)
    return {
        "small": _odd_bools(64, 2),
        "one": _odd_bools(8, 3)[::8],
        "strided": _odd_bools(4096, 4)[::3],
        "grid": _odd_bools(64 * 48, 5).view(64, 48).t(),
        "big": big,
        "big_strided": _odd_bools(1 << 20, 6).view(1024, 1024).t(),
        "empty": _odd_bools(0, 7),
        "floats": torch.randn(1000),
        "complex": torch.randn(33, dtype=torch.complex64)[::2],
    }


@pytest.mark.parametrize("mode", ["eager", "lazy", "streamed", "incremental"])
async def test_bool_bytes_round_trip_bit_for_bit(tmp_path: Path, mode: str) -> None:
    """``bool`` tensors made by ``.view(torch.bool)`` of arbitrary bytes come back
    with the same bytes (``.view(torch.uint8)``), saved eager, lazy, streamed
    through a small staging budget, or incrementally."""
    state = _bool_state()
    expected = {k: flat_bytes(v).clone() for k, v in state.items()}
    by_mode: dict[str, dict[str, Any]] = {
        "streamed": {"budget_bytes": 2 << 20},  # the 4 MiB tensor in rounds
        "incremental": {"incremental": True},
    }
    options = by_mode.get(mode, {})
    async with asyncsave.Checkpointer(tmp_path, **options) as ckpt:
        for step in (1, 2):  # a plan made, then one reused
            await (await ckpt.save(step, state, lazy=mode == "lazy"))
    for step in (1, 2):
        out = asyncsave.load(tmp_path / f"step_{step}")
        for k, v in state.items():
            assert out[k].dtype == v.dtype and out[k].shape == v.shape, k
            assert torch.equal(flat_bytes(out[k]), expected[k]), (step, k)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
async def test_cuda_one_element_tensors_of_any_stride_and_odd_bools_round_trip(
    tmp_path: Path,
) -> None:
    """On the device: one-element tensors of strides 2 and 4, gathered into one
    batch, and a ``bool`` tensor of bytes other than 0/1 are saved bit for bit."""
    flags = _odd_bools(64, 8).cuda()
    state = {
        "a": torch.arange(2.0, device="cuda")[::2],
        "b": torch.arange(4.0, device="cuda")[::4],
        "flags": flags,
        "flags_strided": _odd_bools(256, 9).cuda()[::4],
    }
    expected = {k: flat_bytes(v).cpu() for k, v in state.items()}
    async with asyncsave.Checkpointer(tmp_path) as ckpt:
        await (await ckpt.save(1, state))
    out = asyncsave.load(tmp_path / "step_1")
    for k in state:
        assert torch.equal(flat_bytes(out[k]), expected[k]), k


async def test_a_poisoned_pool_wakes_waiters_with_an_error() -> None:
    pool = StagingPool(None)
    lease = await pool.acquire(1024, pin=False)
    errors: list[BaseException] = []

    async def waiter() -> None:
        try:
            await pool.acquire(1024, pin=False)
        except asyncsave.SaveFailedError as exc:
            errors.append(exc)

    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            tg.start_soon(waiter)
            tg.start_soon(waiter)
            await anyio.sleep(0.05)
            lease.poison()  # device copies into it never finished
    assert len(errors) == 2
    await pool.aclose()


def test_small_device_tensors_are_gathered_in_bounded_back_to_back_batches() -> None:
    """The CUDA coalescing plan (computed on any device): small contiguous entries
    of plain dtypes that lie back to back in the arena form batches of at most
    ``GATHER_BYTES``; blobs, large, empty, exotic or non-contiguous entries are
    copied one by one; every entry is in exactly one of the two."""
    g = torch.Generator().manual_seed(3)
    state: dict[str, Any] = {
        f"experts.{i}.w": torch.randn(16 * (1 + i % 300), generator=g) for i in range(400)
    }
    state["big"] = torch.randn(GATHER_MAX_ENTRY // 4 + 1, generator=g)
    state["empty"] = torch.empty(0)
    state["f8"] = torch.zeros(8, dtype=torch.float8_e4m3fn)
    state["t"] = torch.randn(8, 8, generator=g).t()
    shared = torch.randn(64, generator=g)
    state["tied.a"], state["tied.b"] = shared[:40], shared[20:]
    plan = make_plan(state, allow_pickle=False)
    layout_files(plan.entries, rank=0, max_files=2)
    batches, rest = gather_batches(plan.entries)
    ids = [id(e) for b in batches for e in b] + [id(e) for e in rest]
    assert sorted(ids) == sorted(id(e) for e in plan.entries)
    assert len(batches) >= 2 and len(rest) < len(plan.entries) // 4
    for batch in batches:
        assert len(batch) > 1 and sum(e.nbytes for e in batch) <= GATHER_BYTES
        for a, b in itertools.pairwise(batch):
            assert b.staging_offset == a.staging_offset + a.nbytes
        assert all(not e.is_blob and e.source.is_contiguous() for e in batch)
    names = {e.name for e in rest}
    assert {"big", "empty", "f8", "t"} <= names
    assert any(e.is_blob for e in rest)
