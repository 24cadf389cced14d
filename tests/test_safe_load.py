"""Loading runs no foreign code and trusts no byte (invariant 9)."""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

import pytest
import torch

import asyncsave
from asyncsave.testing import NEWEST_FORMAT_VERSION, encode_manifest

pytestmark = pytest.mark.anyio


class Opaque:
    def __init__(self, x: int) -> None:
        self.x = x

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Opaque) and other.x == self.x


async def make(tmp_path: Path, state: Any | None = None, **kw: Any) -> Path:
    state = (
        state
        if state is not None
        else {"w": torch.randn(32, 32), "b": torch.arange(10), "meta": {"k": 1}}
    )
    async with asyncsave.Checkpointer(tmp_path, **kw) as ckpt:
        info = await (await ckpt.save(1, state))
    assert info is not None
    return info.path


def data_file(path: Path) -> Path:
    return sorted(path.glob("*.safetensors"))[0]


def manifest(path: Path) -> dict[str, Any]:
    doc = json.loads((path / "manifest.json").read_text())
    doc.pop("manifest_xxh3_64")
    return doc


def write_manifest(path: Path, doc: Any) -> None:
    """A hostile manifest: edited, then sealed again with a valid self-checksum, so
    every field check behind the checksum is exercised."""
    raw = encode_manifest(doc) if isinstance(doc, dict) else json.dumps(doc).encode()
    (path / "manifest.json").write_bytes(raw)


async def test_pickle_needs_opt_in_on_save(tmp_path: Path) -> None:
    async with asyncsave.Checkpointer(tmp_path) as ckpt:
        with pytest.raises(asyncsave.UnsupportedTypeError) as err:
            await ckpt.save(1, {"obj": Opaque(3)})
    assert err.value.key == "obj" and "allow_pickle" in str(err.value)


async def test_pickle_needs_opt_in_on_load_too(tmp_path: Path) -> None:
    path = await make(tmp_path, {"obj": Opaque(3), "w": torch.ones(2)}, allow_pickle=True)
    with pytest.raises(asyncsave.UnsafeLoadError) as err:
        asyncsave.load(path)
    assert err.value.key == "obj"
    assert asyncsave.load(path, allow_pickle=True)["obj"] == Opaque(3)
    async with asyncsave.Checkpointer(tmp_path) as ckpt:  # options without pickle
        with pytest.raises(asyncsave.UnsafeLoadError):
            await ckpt.load_latest()


async def test_truncated_data_file_is_a_corrupt_checkpoint_error(tmp_path: Path) -> None:
    path = await make(tmp_path)
    f = data_file(path)
    f.write_bytes(f.read_bytes()[:-17])
    for call in (asyncsave.load, asyncsave.verify):
        with pytest.raises(asyncsave.CorruptCheckpointError) as err:
            call(path)
        assert err.value.path == str(f) and "truncated" in str(err.value)


async def test_flipped_bit_is_a_checksum_mismatch_naming_the_tensor(tmp_path: Path) -> None:
    path = await make(tmp_path)
    entry = next(e for e in manifest(path)["entries"] if e["name"] == "w")
    f = path / manifest(path)["files"][entry["file"]]["name"]
    raw = bytearray(f.read_bytes())
    raw[entry["offset"] + 100] ^= 0x04
    f.write_bytes(bytes(raw))
    with pytest.raises(asyncsave.ChecksumMismatchError) as err:
        asyncsave.verify(path)
    assert err.value.key == "w"
    with pytest.raises(asyncsave.ChecksumMismatchError):
        asyncsave.load(path)
    # verify=False reads without checking: the caller asked for it explicitly
    assert asyncsave.load(path, verify=False)["w"].shape == (32, 32)


async def test_missing_manifest_is_not_a_checkpoint(tmp_path: Path) -> None:
    path = await make(tmp_path)
    (path / "manifest.json").unlink()
    with pytest.raises(asyncsave.CheckpointNotFoundError):
        asyncsave.load(path)


@pytest.mark.parametrize(
    ("mutate", "words"),
    [
        (lambda d: "not json at all", "not JSON"),
        (lambda d: [1, 2], "top level"),
        (lambda d: {**d, "format": "torch"}, "format"),
        (lambda d: {**d, "format_version": 0}, "format_version"),
        (lambda d: {**d, "step": -3}, "step"),
        (
            lambda d: {**d, "files": [{"name": "../../etc/passwd", "nbytes": 1}]},
            "safe plain file name",
        ),
        (lambda d: {**d, "files": [{"name": "/etc/passwd", "nbytes": 1}]}, "safe plain file name"),
        (lambda d: {**d, "entries": [{**d["entries"][0], "offset": 10**12}]}, "past the end"),
        (lambda d: {**d, "entries": [{**d["entries"][0], "xxh3_64": "zz"}]}, "checksum"),
        (lambda d: {**d, "tensors": [{**d["tensors"][0], "dtype": "qint8"}]}, "dtype"),
        (lambda d: {**d, "tensors": [{**d["tensors"][0], "dtype": "__class__"}]}, "dtype"),
        (lambda d: {**d, "tensors": [{**d["tensors"][0], "shape": [1000, 1000]}]}, "needs"),
        (lambda d: {**d, "tensors": [{**d["tensors"][0], "entry": 99}]}, "out of range"),
        (lambda d: {**d, "tree": {"type": "tensor", "index": 7}}, "out of range"),
        (lambda d: {**d, "tree": {"type": "evil"}}, "unknown node type"),
        (lambda d: {**d, "tree": {"type": "float", "v": "x"}}, "bad float"),
    ],
)
async def test_damaged_manifest_is_a_typed_error(tmp_path: Path, mutate: Any, words: str) -> None:
    path = await make(tmp_path, {"w": torch.randn(4, 4)})
    doc = mutate(manifest(path))
    if isinstance(doc, str):
        (path / "manifest.json").write_text(doc)
    else:
        write_manifest(path, doc)
    with pytest.raises(asyncsave.CorruptCheckpointError) as err:
        asyncsave.load(path)
    assert words in str(err.value)


@pytest.mark.parametrize(
    ("old", "new"),
    [(b'"step":1', b'"step":7'), (b'"v":"0x1.0000000000000p+0"', b'"v":"0x1.0000000000001p+0"')],
)
async def test_an_edited_manifest_fails_its_own_checksum(
    tmp_path: Path, old: bytes, new: bytes
) -> None:
    """Plain leaves (a step, a dataloader position) live only in the manifest: a
    changed byte there is caught like a changed tensor byte."""
    path = await make(tmp_path, {"w": torch.ones(2), "pos": 1.0})
    raw = (path / "manifest.json").read_bytes()
    assert old in raw
    (path / "manifest.json").write_bytes(raw.replace(old, new, 1))
    for call in (asyncsave.load, asyncsave.verify):
        with pytest.raises(asyncsave.CorruptCheckpointError, match="own checksum"):
            call(path)


async def test_header_disagreeing_with_manifest_is_detected(tmp_path: Path) -> None:
    path = await make(tmp_path, {"w": torch.randn(4, 4)})
    f = data_file(path)
    raw = f.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    header["w"]["data_offsets"] = [0, 8]
    new = json.dumps(header, separators=(",", ":")).encode().ljust(n)
    assert len(new) == n
    f.write_bytes(raw[:8] + new + raw[8 + n :])
    with pytest.raises(asyncsave.CorruptCheckpointError) as err:
        asyncsave.verify(path)
    assert "disagree" in str(err.value)


async def test_wrong_file_size_in_manifest_is_detected_without_reading(tmp_path: Path) -> None:
    path = await make(tmp_path)
    doc = manifest(path)
    doc["files"][0]["nbytes"] += 1
    write_manifest(path, doc)
    with pytest.raises(asyncsave.CorruptCheckpointError) as err:
        asyncsave.load(path)
    assert "manifest says" in str(err.value)
    # Resume takes the tracker's word only for a loadable checkpoint (invariant 8).
    with pytest.raises(asyncsave.CheckpointNotFoundError) as err2:
        asyncsave.latest(tmp_path)
    assert isinstance(err2.value.__cause__, asyncsave.CorruptCheckpointError)


@pytest.mark.parametrize("content", ["garbage", "-5", "1.5", "", "9" * 30, "\x00\x01"])
async def test_tracker_garbage_never_resumes_from_scratch(tmp_path: Path, content: str) -> None:
    await make(tmp_path)
    (tmp_path / "latest_checkpointed_iteration.txt").write_text(content)
    info = asyncsave.latest(tmp_path)
    assert info is not None and info.step == 1


async def test_keys_with_slashes_dots_and_nul_round_trip_inside_the_directory(
    tmp_path: Path,
) -> None:
    state = {
        "../../escape": torch.ones(2),
        "a/b": torch.zeros(2),
        "nul\x00key": 3,
        "x" * 5000: torch.arange(3),
    }
    path = await make(tmp_path, state)
    assert sorted(p.name for p in path.iterdir()) == [
        "data-r00000-000.safetensors",
        "manifest.json",
    ]
    out = asyncsave.load(path)
    assert list(out) == list(state)
    assert torch.equal(out["../../escape"], torch.ones(2)) and out["nul\x00key"] == 3


@pytest.mark.parametrize(
    ("state", "error", "key"),
    [
        ({"s": torch.ones(3).to_sparse()}, asyncsave.UnsupportedTensorError, "s"),
        (
            {"q": torch.quantize_per_tensor(torch.ones(3), 0.1, 0, torch.quint8)},
            asyncsave.UnsupportedTensorError,
            "q",
        ),
        ({"m": torch.empty(3, device="meta")}, asyncsave.UnsupportedTensorError, "m"),
        (
            {"qv": torch.zeros(4, dtype=torch.uint8).view(torch.qint8)},
            asyncsave.UnsupportedTensorError,
            "qv",
        ),
        ({(1, 2): 3}, asyncsave.InvalidKeyError, "(1, 2)"),
        ({True: 3}, asyncsave.InvalidKeyError, "True"),
        ({"a": {1.5: 2}}, asyncsave.InvalidKeyError, "a/1.5"),
        ({"set": {1, 2}}, asyncsave.UnsupportedTypeError, "set"),
        ({"f": lambda: 0}, asyncsave.UnsupportedTypeError, "f"),
    ],
)
async def test_bad_leaves_and_keys_are_typed_errors_naming_the_key(
    tmp_path: Path, state: Any, error: type, key: str
) -> None:
    async with asyncsave.Checkpointer(tmp_path) as ckpt:
        with pytest.raises(error) as err:
            await ckpt.save(1, state)
    assert err.value.key == key
    assert not list(tmp_path.glob("step_*"))


async def test_recursive_state_is_refused(tmp_path: Path) -> None:
    loop: dict[str, Any] = {"a": 1}
    loop["self"] = loop
    async with asyncsave.Checkpointer(tmp_path) as ckpt:
        with pytest.raises(asyncsave.InvalidStateError) as err:
            await ckpt.save(1, {"x": loop})
    assert err.value.key == "x/self" and "recursive" in str(err.value)


@pytest.mark.parametrize(
    ("mutate", "words"),
    [
        (
            lambda d: {**d, "entries": [{k: v for k, v in d["entries"][0].items() if k != "name"}]},
            "no name",
        ),
        (lambda d: {**d, "tree": {"type": "device", "v": "garbage"}}, "bad device"),
        (
            lambda d: {**d, "tree": {"type": "dict", "items": [], "metadata": {"type": "none"}}},
            "metadata",
        ),
        (
            lambda d: {
                **d,
                "tensors": [
                    {**d["tensors"][0], "kind": "ndarray", "dtype": "bfloat16", "shape": [32]}
                ],
            },
            "cannot rebuild",
        ),
        (
            lambda d: {
                **d,
                "tensors": [{**d["tensors"][0], "dtype": "int32", "requires_grad": True}],
            },
            "requires grad",
        ),
        (lambda d: {**d, "tree": {"type": "bigint", "v": "zz"}}, "bad bigint"),
    ],
)
async def test_more_damaged_manifests_are_typed_errors(
    tmp_path: Path, mutate: Any, words: str
) -> None:
    path = await make(tmp_path, {"w": torch.randn(4, 4)})
    write_manifest(path, mutate(manifest(path)))
    for call in (asyncsave.load, asyncsave.verify):
        with pytest.raises(asyncsave.CorruptCheckpointError, match=words):
            call(path)


async def test_load_to_cuda_without_cuda_is_a_clear_error(tmp_path: Path) -> None:
    path = await make(tmp_path)
    if torch.cuda.is_available():
        assert asyncsave.load(path, device="cuda")["w"].is_cuda
    else:
        with pytest.raises(ValueError, match="CUDA is not available"):
            asyncsave.load(path, device="cuda")
    with pytest.raises(ValueError, match="not a torch device"):
        asyncsave.load(path, device="garbage")


async def test_a_manifest_that_is_a_directory_is_a_typed_error(tmp_path: Path) -> None:
    path = await make(tmp_path)
    (path / "manifest.json").unlink()
    (path / "manifest.json").mkdir()
    with pytest.raises(asyncsave.CorruptCheckpointError, match="is a directory"):
        asyncsave.verify(path)


async def test_a_newer_format_is_left_alone_not_called_damaged(tmp_path: Path) -> None:
    path = await make(tmp_path, {"w": torch.ones(2)})
    write_manifest(path, {**manifest(path), "format_version": NEWEST_FORMAT_VERSION + 1})
    with pytest.raises(asyncsave.UnsupportedFormatError, match="upgrade"):
        asyncsave.load(path)
    with pytest.raises(asyncsave.UnsupportedFormatError):
        asyncsave.latest(tmp_path, fallback=True)
    with pytest.raises(asyncsave.UnsupportedFormatError):
        async with asyncsave.Checkpointer(tmp_path):
            pass
    assert path.exists()  # never moved aside


async def test_pathological_json_is_a_typed_error(tmp_path: Path) -> None:
    path = await make(tmp_path, {"w": torch.ones(2)})
    raw = (path / "manifest.json").read_bytes()
    (path / "manifest.json").write_bytes(raw.replace(b'"step":1', b'"step":' + b"9" * 5000, 1))
    with pytest.raises(asyncsave.CorruptCheckpointError, match="not JSON"):
        asyncsave.load(path)
    path2 = await make(tmp_path / "b", {"w": torch.ones(2)})
    f = data_file(path2)
    raw = f.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    f.write_bytes(raw[:8] + (b"[" * n) + raw[8 + n :])
    with pytest.raises(asyncsave.CorruptCheckpointError, match="header is not JSON"):
        asyncsave.verify(path2)


class Broken:
    def state_dict(self) -> dict[str, Any]:
        raise RuntimeError("cannot snapshot while a collective is running")

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


async def test_a_state_dict_that_raises_is_named_by_key(tmp_path: Path) -> None:
    async with asyncsave.Checkpointer(tmp_path) as ckpt:
        with pytest.raises(asyncsave.InvalidStateError) as err:
            await ckpt.save(1, {"sampler": Broken()})
        assert err.value.key == "sampler" and isinstance(err.value.__cause__, RuntimeError)
        assert await (await ckpt.save(2, {"w": torch.ones(2)})) is not None


async def test_a_root_under_a_file_is_a_typed_error(tmp_path: Path) -> None:
    (tmp_path / "f").write_text("x")
    with pytest.raises(asyncsave.CheckpointError, match="cannot use"):
        async with asyncsave.Checkpointer(tmp_path / "f" / "sub"):
            pass
