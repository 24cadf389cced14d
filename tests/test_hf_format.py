"""Data files that Hugging Face tools read by name: every dtype safetensors knows
stored as that dtype, tied weights stored as a tensor under a name, and older
checkpoints (those dtypes as ``U8`` bytes, tied weights as ``<key>#storage`` blobs)
still loading."""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

import anyio
import pytest
import safetensors.torch
import torch
from safetensors import safe_open

import asyncsave
from asyncsave.testing import FakeGroup, encode_manifest

pytestmark = pytest.mark.anyio

_QUANTIZED = {torch.qint8, torch.quint8, torch.qint32, torch.quint4x2, torch.quint2x4}
#: Every torch dtype that holds bytes asyncsave can store (quantized ones are refused).
EVERY_DTYPE = sorted(
    {v for v in vars(torch).values() if isinstance(v, torch.dtype) and v not in _QUANTIZED},
    key=str,
)
#: The dtypes the installed safetensors writes and reads under their own name.
SAFETENSORS_KNOWS = {d for d in safetensors.torch._SIZE if d is not None}


def random_bits(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    t = torch.empty(shape, dtype=dtype)
    raw = torch.randint(0, 256, (t.numel() * t.element_size(),), dtype=torch.uint8)
    if dtype == torch.bool:
        raw = raw % 2
    if t.numel():
        t.view(-1).view(torch.uint8).copy_(raw)
    return t


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def manifest(path: Path) -> dict[str, Any]:
    doc = json.loads((path / "manifest.json").read_bytes())
    doc.pop("manifest_xxh3_64")
    return doc


def by_name(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the step's data files, read with ``safetensors`` alone."""
    out: dict[str, torch.Tensor] = {}
    for f in sorted(path.glob("*.safetensors")):
        out.update(safetensors.torch.load_file(f))
    return out


async def save(root: Path, state: Any, step: int = 1) -> Path:
    async with asyncsave.Checkpointer(root) as ckpt:
        info = await (await ckpt.save(step, state))
    return info.path


def test_the_dtype_list_covers_what_the_issue_counted() -> None:
    # 41 storable torch dtypes; the installed safetensors names 20 of them.
    assert len(EVERY_DTYPE) >= 41
    assert {torch.float8_e8m0fnu, torch.float4_e2m1fn_x2} <= SAFETENSORS_KNOWS


@pytest.mark.parametrize("dtype", EVERY_DTYPE, ids=str)
async def test_every_dtype_round_trips_and_safetensors_reads_it_as_that_dtype(
    tmp_path: Path, dtype: torch.dtype
) -> None:
    state = {"m": random_bits((5, 6), dtype), "empty": torch.empty((0, 4), dtype=dtype)}
    path = await save(tmp_path, state)
    out = asyncsave.load(path)
    for key, value in state.items():
        assert out[key].dtype == dtype and out[key].shape == value.shape, key
        assert torch.equal(bits(out[key]), bits(value)), key
    seen = by_name(path)
    if dtype in SAFETENSORS_KNOWS:
        assert seen["m"].dtype == dtype and seen["m"].shape == (5, 6)
        assert torch.equal(bits(seen["m"]), bits(state["m"]))
        assert seen["empty"].dtype == dtype and seen["empty"].shape == (0, 4)
    else:  # no safetensors name: its bytes, the dtype in the manifest
        assert seen["m"].dtype == torch.uint8
        assert torch.equal(seen["m"], bits(state["m"]))


async def test_a_0d_float4_is_stored_as_bytes(tmp_path: Path) -> None:
    # F4 counts 4-bit values: a 0-d float4_e2m1fn_x2 (two of them) has no F4 shape.
    t = random_bits((), torch.float4_e2m1fn_x2)
    path = await save(tmp_path, {"s": t})
    assert by_name(path)["s"].dtype == torch.uint8
    out = asyncsave.load(path)["s"]
    assert out.dtype == t.dtype and out.shape == () and torch.equal(bits(out), bits(t))


async def test_the_manifest_says_format_3_only_for_the_dtypes_named_later(
    tmp_path: Path,
) -> None:
    plain = await save(
        tmp_path / "a", {"w": torch.randn(3), "c": torch.randn(2).to(torch.complex128)}
    )
    assert manifest(plain)["format_version"] == 1
    for dtype in (torch.float8_e8m0fnu, torch.float4_e2m1fn_x2):
        path = await save(tmp_path / str(dtype), {"w": random_bits((4, 2), dtype)})
        assert manifest(path)["format_version"] == 3, dtype


async def test_a_save_of_two_ranks_says_format_3_when_any_rank_needs_it(tmp_path: Path) -> None:
    # Only rank 1 holds an F8_E8M0 tensor: the merged manifest must still say 3.
    group = FakeGroup(2)

    async def rank(r: int) -> None:
        w = random_bits((4,), torch.float8_e8m0fnu) if r else torch.randn(4)
        async with asyncsave.Checkpointer(tmp_path, coordinator=group.rank(r)) as ckpt:
            await (await ckpt.save(1, {"w": w}))

    async with anyio.create_task_group() as tg:
        for r in range(2):
            tg.start_soon(rank, r)
    doc = manifest(tmp_path / "step_1")
    assert doc["world_size"] == 2 and doc["format_version"] == 3
    assert asyncsave.load(tmp_path / "step_1")[1]["w"].dtype == torch.float8_e8m0fnu


async def test_update_with_an_f4_item_says_format_3(tmp_path: Path) -> None:
    async with asyncsave.Checkpointer(tmp_path) as ckpt:
        await (await ckpt.save(1, {"model": {"w": torch.randn(3)}, "scales": torch.ones(2)}))
        assert manifest(tmp_path / "step_1")["format_version"] == 1
        fp4 = random_bits((2, 3), torch.float4_e2m1fn_x2)
        await ckpt.update(1, "scales", fp4)
    assert manifest(tmp_path / "step_1")["format_version"] == 3
    out = asyncsave.load(tmp_path / "step_1")
    assert out["scales"].dtype == fp4.dtype and torch.equal(bits(out["scales"]), bits(fp4))


def _rewrite_header(fpath: Path, edit: Any) -> None:
    """Edit a data file's safetensors header in place, its length kept (spaces)."""
    raw = bytearray(fpath.read_bytes())
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    edit(header)
    new = json.dumps(header, separators=(",", ":")).encode()
    assert len(new) <= n
    raw[8 : 8 + n] = new + b" " * (n - len(new))
    fpath.write_bytes(bytes(raw))


async def test_an_older_checkpoint_with_those_dtypes_as_bytes_still_loads(tmp_path: Path) -> None:
    # What asyncsave wrote before F8_E8M0 and F4 were named: U8 headers, format 1.
    state = {
        "scale": random_bits((4, 3), torch.float8_e8m0fnu),
        "fp4": random_bits((2, 5), torch.float4_e2m1fn_x2),
    }
    path = await save(tmp_path, state)

    def as_bytes(header: dict[str, Any]) -> None:
        for name, h in header.items():
            if name != "__metadata__" and h["dtype"] in ("F8_E8M0", "F4"):
                h["dtype"], h["shape"] = "U8", [h["data_offsets"][1] - h["data_offsets"][0]]

    for f in path.glob("*.safetensors"):
        _rewrite_header(f, as_bytes)
    assert all(t.dtype == torch.uint8 for t in by_name(path).values())
    (path / "manifest.json").write_bytes(encode_manifest({**manifest(path), "format_version": 1}))
    out = asyncsave.load(path)
    asyncsave.verify(path)
    for key, value in state.items():
        assert out[key].dtype == value.dtype and torch.equal(bits(out[key]), bits(value)), key


async def test_a_header_whose_byte_range_does_not_fit_its_f4_shape_is_refused(
    tmp_path: Path,
) -> None:
    path = await save(tmp_path, {"fp4": random_bits((2, 5), torch.float4_e2m1fn_x2)})

    def halve(header: dict[str, Any]) -> None:
        header["fp4"]["shape"] = [2, 5]  # F4 counts 4-bit values: [2, 10] fits

    (f,) = path.glob("*.safetensors")
    _rewrite_header(f, halve)
    with pytest.raises(asyncsave.CorruptCheckpointError, match="fp4"):
        asyncsave.load(path)


async def test_safe_open_reads_every_named_tensor_by_name(tmp_path: Path) -> None:
    state = {"e8m0": random_bits((3,), torch.float8_e8m0fnu), "bf16": torch.randn(4).bfloat16()}
    path = await save(tmp_path, state)
    (f,) = path.glob("*.safetensors")
    with safe_open(str(f), framework="pt") as sf:
        for key, value in state.items():
            got = sf.get_tensor(key)
            assert got.dtype == value.dtype and torch.equal(bits(got), bits(value))


def header_metadata(path: Path) -> dict[str, str]:
    out: dict[str, str] = {}
    for f in sorted(path.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as sf:
            out.update(sf.metadata() or {})
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.complex128], ids=str)
async def test_tied_weights_are_read_by_name_and_come_back_tied(
    tmp_path: Path, dtype: torch.dtype
) -> None:
    w = torch.randn(10, 4).to(dtype)
    state = {"model": {"transformer.wte.weight": w, "lm_head.weight": w, "ln.bias": torch.randn(4)}}
    path = await save(tmp_path, state)
    seen = by_name(path)
    # One copy, under the first key (sorted), as safetensors.torch.save_model keeps.
    assert "model/transformer.wte.weight" not in seen
    assert not any(k.endswith("#storage") for k in seen)
    kept = seen["model/lm_head.weight"]
    if dtype in SAFETENSORS_KNOWS:
        assert kept.dtype == dtype and torch.equal(kept, w)
    else:  # complex128: one tensor's bytes, named by the key all the same
        assert torch.equal(kept, bits(w))
    assert header_metadata(path)["model/transformer.wte.weight"] == "model/lm_head.weight"
    out = asyncsave.load(path)["model"]
    assert torch.equal(out["lm_head.weight"], w) and out["lm_head.weight"].dtype == dtype
    assert out["lm_head.weight"].data_ptr() == out["transformer.wte.weight"].data_ptr()
    out["lm_head.weight"][0, 0] = 7  # still tied: a write through one shows in the other
    assert out["transformer.wte.weight"][0, 0] == 7
    assert manifest(path)["format_version"] == 1  # older readers load it as a view


async def test_the_alias_metadata_never_maps_a_name_to_itself(tmp_path: Path) -> None:
    # Two leaves with one key path ("a/b" as a key, and "b" under "a"): a reader
    # that follows the metadata's aliases must not meet "a/b" -> "a/b" (a loop).
    w = torch.randn(3)
    path = await save(tmp_path, {"a/b": w, "a": {"b": w}, "c": w})
    meta = header_metadata(path)
    assert {k: v for k, v in meta.items() if k not in ("format", "writer")} == {"c": "a/b"}
    out = asyncsave.load(path)
    assert out["a"]["b"].data_ptr() == out["a/b"].data_ptr() == out["c"].data_ptr()


async def test_parameters_tied_in_a_module_stay_tied_across_reused_plans(tmp_path: Path) -> None:
    emb = torch.nn.Embedding(6, 3)
    head = torch.nn.Linear(3, 6, bias=False)
    head.weight = emb.weight
    model = torch.nn.Sequential(emb, head)
    async with asyncsave.Checkpointer(tmp_path) as ckpt:
        for step in (1, 2):  # the second save reuses the first one's plan
            with torch.no_grad():
                emb.weight.add_(1.0)
            await (await ckpt.save(step, {"model": model}))
    seen = by_name(tmp_path / "step_2")
    assert torch.equal(seen["model/0.weight"], emb.weight.detach())
    assert "model/1.weight" not in seen
    out = asyncsave.load(tmp_path / "step_2")["model"]
    assert isinstance(out["0.weight"], torch.Tensor) and torch.equal(out["1.weight"], emb.weight)
    assert out["0.weight"].data_ptr() == out["1.weight"].data_ptr()


async def test_tied_weights_stream_through_a_budget_smaller_than_them(tmp_path: Path) -> None:
    w = torch.randn(64, 128)  # 32 KiB
    state = {"a": w, "b": w, "c": torch.randn(100)}
    async with asyncsave.Checkpointer(tmp_path, budget_bytes=3 * 4096) as ckpt:
        await (await ckpt.save(1, state))
    asyncsave.verify(tmp_path / "step_1")
    assert torch.equal(by_name(tmp_path / "step_1")["a"], w)
    out = asyncsave.load(tmp_path / "step_1")
    assert torch.equal(out["b"], w) and out["a"].data_ptr() == out["b"].data_ptr()


@pytest.mark.parametrize(
    "views",
    [
        lambda w: {"w": w, "row": w[3]},  # a part of it
        lambda w: {"w": w, "t": w.t()},  # same bytes, other strides
        lambda w: {"w": w, "u8": w.view(torch.uint8)},  # same bytes, other dtype
        lambda w: {"a": w[1::2], "b": w[1::2]},  # identical, but not contiguous
    ],
    ids=["part", "transposed", "reinterpreted", "strided"],
)
async def test_tensors_sharing_memory_otherwise_keep_the_blob(tmp_path: Path, views: Any) -> None:
    w = torch.randn(8, 4)
    state = views(w)
    path = await save(tmp_path, state)
    assert [k for k in by_name(path) if k.endswith("#storage")]
    out = asyncsave.load(path)
    ptrs = {v.untyped_storage().data_ptr() for v in out.values()}
    assert len(ptrs) == 1
    for k, v in state.items():
        assert torch.equal(bits(out[k]), bits(v)) and out[k].stride() == v.stride(), k


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("lazy", [False, True], ids=["eager", "lazy"])
async def test_cuda_tied_weights_are_read_by_name_and_come_back_tied(
    tmp_path: Path, lazy: bool
) -> None:
    w = torch.randn(64, 32, device="cuda").bfloat16()
    state = {"model": {"embed.weight": w, "head.weight": w}}
    async with asyncsave.Checkpointer(tmp_path) as ckpt:
        handle = await ckpt.save(1, state, lazy=lazy)
        await handle.staged()
        info = await handle
    seen = by_name(info.path)
    assert seen["model/embed.weight"].dtype == torch.bfloat16
    assert torch.equal(seen["model/embed.weight"], w.cpu())
    on_device = asyncsave.load(info.path, device="cuda")["model"]
    assert on_device["head.weight"].data_ptr() == on_device["embed.weight"].data_ptr()
    assert torch.equal(on_device["head.weight"], w)
