"""State trees come back exactly: structure, leaf types, dtypes, shapes, sharing."""

from __future__ import annotations

import math
from collections import OrderedDict
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from safetensors import safe_open
from tensordict import TensorDict

import asyncsave

pytestmark = pytest.mark.anyio

ALL_DTYPES = [
    torch.float64,
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.float8_e4m3fn,
    torch.float8_e5m2,
    torch.float8_e4m3fnuz,
    torch.float8_e5m2fnuz,
    torch.float8_e8m0fnu,
    torch.float4_e2m1fn_x2,
    torch.complex32,
    torch.complex64,
    torch.complex128,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.uint8,
    torch.uint16,
    torch.uint32,
    torch.uint64,
    torch.bool,
    torch.bits8,
    torch.bits16,
]


def random_bits(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A tensor of ``dtype`` filled with random bit patterns (NaNs included)."""
    t = torch.empty(shape, dtype=dtype)
    nbytes = t.numel() * t.element_size()
    raw = torch.randint(0, 256, (nbytes,), dtype=torch.uint8)
    if dtype == torch.bool:
        raw = raw % 2
    t.view(-1).view(torch.uint8).copy_(raw) if t.numel() else None
    return t


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return bool(
        torch.equal(
            a.contiguous().reshape(-1).view(torch.uint8),
            b.contiguous().reshape(-1).view(torch.uint8),
        )
    )


async def save_and_load(tmp_path: Path, state: Any, **load_kw: Any) -> Any:
    async with asyncsave.Checkpointer(tmp_path / "ckpt") as ckpt:
        info = await (await ckpt.save(1, state))
    assert info is not None
    return asyncsave.load(info.path, **load_kw)


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
async def test_every_dtype_round_trips_bit_exactly(tmp_path: Path, dtype: torch.dtype) -> None:
    state = {
        "m": random_bits((5, 7), dtype),
        "scalar": random_bits((), dtype),
        "empty": torch.empty((0, 3), dtype=dtype),
        "view": random_bits((6, 8), dtype)[1::2, ::3],  # non-contiguous view
    }
    out = await save_and_load(tmp_path, state)
    for key, value in state.items():
        assert same_bits(out[key], value), key


async def test_shapes_and_contiguity_of_views(tmp_path: Path) -> None:
    base = torch.arange(60.0).view(3, 4, 5)
    state = {"t": base.transpose(0, 2), "expand": torch.tensor([1.0, 2.0]).expand(3, 2)}
    out = await save_and_load(tmp_path, state)
    assert torch.equal(out["t"], state["t"]) and out["t"].shape == (5, 4, 3)
    assert torch.equal(out["expand"], state["expand"])


async def test_tensors_sharing_storage_come_back_sharing(tmp_path: Path) -> None:
    w = torch.randn(8, 4)
    state = {"embed": w, "lm_head": w, "w_t": w.t(), "row": w[3], "other": torch.randn(3)}
    out = await save_and_load(tmp_path, state)
    for k in ("embed", "lm_head", "w_t", "row"):
        assert torch.equal(out[k], state[k])
    ptr = out["embed"].untyped_storage().data_ptr()
    assert all(out[k].untyped_storage().data_ptr() == ptr for k in ("lm_head", "w_t", "row"))
    out["embed"][0, 0] = 1234.0  # tied: a write through one is seen by the others
    assert out["lm_head"][0, 0] == 1234.0 and out["w_t"][0, 0] == 1234.0
    assert out["other"].untyped_storage().data_ptr() != ptr


async def test_tied_weights_of_a_model_stay_tied(tmp_path: Path) -> None:
    class Tied(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = torch.nn.Embedding(10, 4)
            self.head = torch.nn.Linear(4, 10, bias=False)
            self.head.weight = self.embed.weight

    model = Tied()
    out = await save_and_load(tmp_path, {"model": model.state_dict()})
    sd = out["model"]
    assert (
        sd["embed.weight"].untyped_storage().data_ptr()
        == sd["head.weight"].untyped_storage().data_ptr()
    )
    fresh = Tied()
    fresh.load_state_dict(sd)
    assert torch.equal(fresh.head.weight, model.head.weight)


async def test_plain_leaves_and_containers_keep_their_types(tmp_path: Path) -> None:
    state = {
        "ints": [0, -1, 2**80, True, False],
        "floats": (0.1, -0.0, math.inf, -math.inf, 1e-310),
        "nan": math.nan,
        "str": "héllo\x00world",
        "bytes": b"\x00\xff" * 10,
        "none": None,
        3: "int key",
        "nested": {"a": [{"b": (1, [2, {"c": None}])}]},
        "empty": {"d": {}, "l": [], "t": ()},
        "dtype": torch.bfloat16,
        "device": torch.device("cpu"),
        "size": torch.Size([2, 3]),
        "od": OrderedDict([("z", 1), ("a", 2)]),
    }
    out = await save_and_load(tmp_path, state)
    assert math.isnan(out.pop("nan"))
    expected = dict(state)
    expected.pop("nan")
    assert out == expected
    assert list(out.keys()) == list(expected.keys())
    assert type(out["floats"]) is tuple and type(out["ints"]) is list
    assert type(out["od"]) is OrderedDict and list(out["od"]) == ["z", "a"]
    assert type(out["size"]) is torch.Size
    assert math.copysign(1.0, out["floats"][1]) == -1.0
    assert out["ints"][3] is True and type(out["ints"][3]) is bool


async def test_numpy_arrays_and_scalars_come_back_as_numpy(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    state = {
        "arr": rng.random((3, 4)),
        "u32": np.arange(5, dtype=np.uint32),
        "scalar": np.float32(1.5),
        "i": np.int64(-7),
    }
    out = await save_and_load(tmp_path, state)
    assert type(out["arr"]) is np.ndarray and np.array_equal(out["arr"], state["arr"])
    assert out["u32"].dtype == np.uint32 and np.array_equal(out["u32"], state["u32"])
    assert type(out["scalar"]) is np.float32 and out["scalar"] == np.float32(1.5)
    assert type(out["i"]) is np.int64 and out["i"] == -7


async def test_parameters_and_requires_grad_are_kept(tmp_path: Path) -> None:
    p = torch.nn.Parameter(torch.randn(3))
    frozen = torch.nn.Parameter(torch.randn(2), requires_grad=False)
    g = torch.randn(2, requires_grad=True)
    out = await save_and_load(tmp_path, {"p": p, "frozen": frozen, "g": g})
    assert type(out["p"]) is torch.nn.Parameter and out["p"].requires_grad
    assert type(out["frozen"]) is torch.nn.Parameter and not out["frozen"].requires_grad
    assert type(out["g"]) is torch.Tensor and out["g"].requires_grad
    assert torch.equal(out["p"].detach(), p.detach())


async def test_tensordict_round_trips_nested_with_batch_size_and_names(tmp_path: Path) -> None:
    inner = TensorDict(
        {"b": torch.randn(4, 2).t().contiguous().t(), "ids": torch.arange(4)}, batch_size=[4]
    )
    td = TensorDict(
        {
            "obs": torch.randn(4, 3, dtype=torch.float64),
            "mask": torch.ones(4, dtype=torch.bool),
            "bf": torch.randn(4, 5).to(torch.bfloat16)[:, ::2],  # non-contiguous member
            "inner": inner,
        },
        batch_size=[4],
    )
    td.set_non_tensor("tag", "rollout-7")
    td.names = ["env"]
    out = await save_and_load(tmp_path, {"buffer": td})
    back = out["buffer"]
    assert type(back) is TensorDict and back.batch_size == torch.Size([4])
    assert back.names == ["env"]
    assert set(back.keys()) == set(td.keys())
    for key in ("obs", "mask", "bf", ("inner", "b"), ("inner", "ids")):
        assert same_bits(back.get(key), td.get(key)), key
    assert back["tag"] == "rollout-7"
    assert type(back.get("inner")) is TensorDict and back.get("inner").batch_size == torch.Size([4])


async def test_real_optimizer_state_dict_loads_back(tmp_path: Path) -> None:
    model = torch.nn.Sequential(
        torch.nn.Linear(6, 5), torch.nn.BatchNorm1d(5), torch.nn.Linear(5, 2)
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95))
    for _ in range(3):
        model(torch.randn(8, 6)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    out = await save_and_load(tmp_path, {"model": model.state_dict(), "optim": opt.state_dict()})
    assert out["model"]._metadata == model.state_dict()._metadata
    model2 = torch.nn.Sequential(
        torch.nn.Linear(6, 5), torch.nn.BatchNorm1d(5), torch.nn.Linear(5, 2)
    )
    opt2 = torch.optim.AdamW(model2.parameters(), lr=1.0)
    model2.load_state_dict(out["model"])
    opt2.load_state_dict(out["optim"])
    assert opt2.param_groups[0]["lr"] == 1e-3 and opt2.param_groups[0]["betas"] == (0.9, 0.95)
    # One more identical step on both gives identical parameters.
    x = torch.randn(8, 6)
    for m, o in ((model, opt), (model2, opt2)):
        m(x).pow(2).mean().backward()
        o.step()
    for a, b in zip(model.parameters(), model2.parameters(), strict=True):
        assert torch.equal(a, b)


async def test_stateful_objects_are_captured_and_restored_in_place(tmp_path: Path) -> None:
    model = torch.nn.Linear(3, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(2, 3)).sum().backward()
    opt.step()
    async with asyncsave.Checkpointer(tmp_path) as ckpt:
        await (await ckpt.save(5, {"model": model, "optim": opt}))
    model2 = torch.nn.Linear(3, 3)
    opt2 = torch.optim.SGD(model2.parameters(), lr=0.5, momentum=0.9)
    async with asyncsave.Checkpointer(tmp_path) as ckpt:
        restored = await ckpt.load_latest({"model": model2, "optim": opt2})
    assert restored is not None and restored.info.step == 5
    assert restored.state["model"] is model2 and restored.state["optim"] is opt2
    assert torch.equal(model2.weight, model.weight)
    assert torch.equal(
        opt2.state[model2.weight]["momentum_buffer"], opt.state[model.weight]["momentum_buffer"]
    )


async def test_data_files_open_with_safetensors(tmp_path: Path) -> None:
    state = {
        "w": torch.randn(4, 4),
        "c": torch.randn(3, dtype=torch.complex128),
        "h": torch.randn(5).half(),
    }
    async with asyncsave.Checkpointer(tmp_path) as ckpt:
        info = await (await ckpt.save(1, state))
    assert info is not None
    files = sorted(info.path.glob("*.safetensors"))
    assert files
    seen = {}
    for f in files:
        with safe_open(str(f), framework="pt") as sf:
            for k in sf.keys():
                seen[k] = sf.get_tensor(k)
    assert torch.equal(seen["w"], state["w"]) and torch.equal(seen["h"], state["h"])
    # complex128 has no safetensors dtype: stored as its bytes, dtype in the manifest
    assert torch.equal(seen["c"].view(torch.complex128), state["c"])


async def test_load_to_another_device_name_keeps_values(tmp_path: Path) -> None:
    state = {"w": torch.randn(3, 3)}
    out = await save_and_load(tmp_path, state, device="cpu")
    assert out["w"].device.type == "cpu" and torch.equal(out["w"], state["w"])


async def test_conjugate_and_negative_views_keep_their_values(tmp_path: Path) -> None:
    c = torch.randn(3, 4, dtype=torch.complex64)
    state = {
        "c": c,
        "cc": c.conj(),
        "imag": c.conj().imag,
        "mh": c.mH,
        "lone": torch.randn(2, dtype=torch.complex128).conj(),
    }
    out = await save_and_load(tmp_path, state)
    for k, v in state.items():
        assert torch.equal(out[k], v.resolve_conj().resolve_neg()), k
        assert not out[k].is_conj() and not out[k].is_neg()


async def test_big_ints_round_trip(tmp_path: Path) -> None:
    state = {
        "huge": 10**5000,
        "neg": -(2**100),
        "edge": [2**63 - 1, -(2**63), 2**64 - 1, 2**64],
        "keys": {10**5000: "big key", -(2**70): "negative big key", 5: "small"},
    }
    out = await save_and_load(tmp_path, state)
    assert out == state
