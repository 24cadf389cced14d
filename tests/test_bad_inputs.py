"""The bad-input corpus (DESIGN invariant 9; issue 4, item 6): one registry of named
cases, each a state given to ``save()`` or a damage done to a committed checkpoint
or tracker. Every case ends in exactly one of two ways: a typed error (a subclass of
:class:`asyncsave.CheckpointError`, naming the key or the path) or an exact round
trip. Any other exception is a failure ("a raw traceback"), and so is a load that
returns something other than what was saved ("a silent wrong result").

Several of these kinds are also tested, with more detail, in test_safe_load.py,
test_roundtrip.py and test_resume.py; this registry makes the count mechanical.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from reliability import record

import asyncsave
from asyncsave.testing import encode_manifest

pytestmark = pytest.mark.anyio

TRACKER = "latest_checkpointed_iteration.txt"
ROUND_TRIP = "round trip"
FALLS_BACK = "falls back to the newest committed checkpoint"
SAVER_REFUSES = "readers fall back; a saver refuses to open (typed)"


@dataclass(frozen=True)
class SaveCase:
    """A state (and step) given to ``save()``; ``expect`` is an error type or
    :data:`ROUND_TRIP`; ``key`` is the key path the error must name."""

    name: str
    state: Callable[[], Any]
    expect: Any
    key: str | None = None
    step: Any = 1


@dataclass(frozen=True)
class DiskCase:
    """Damage done to a root holding committed steps 1 and 2 (tracker: 2).
    ``expect``: the typed error ``asyncsave.load(step_2)`` raises, or
    :data:`FALLS_BACK` for tracker damage resume must survive."""

    name: str
    damage: Callable[[Path], None]
    expect: Any


class Opaque:
    pass


class Broken:
    def state_dict(self) -> dict[str, Any]:
        raise RuntimeError("no snapshot now")

    def load_state_dict(self, state: Any) -> None:
        pass


class MyTensor(torch.Tensor):
    pass


def recursive_dict() -> Any:
    d: dict[str, Any] = {"a": 1}
    d["self"] = d
    return {"x": d}


def recursive_list() -> Any:
    lst: list[Any] = [1]
    lst.append(lst)
    return {"x": lst}


def grad_tensor() -> Any:
    return {"w": torch.randn(3, 3, requires_grad=True)}


def non_leaf() -> Any:
    x = torch.randn(3, requires_grad=True)
    return {"y": x * 2}


SAVE_CASES = [
    # unsupported leaf types
    SaveCase("set leaf", lambda: {"s": {1, 2}}, asyncsave.UnsupportedTypeError, "s"),
    SaveCase("function leaf", lambda: {"f": lambda: 0}, asyncsave.UnsupportedTypeError, "f"),
    SaveCase("opaque object", lambda: {"o": Opaque()}, asyncsave.UnsupportedTypeError, "o"),
    SaveCase("complex number", lambda: {"c": 1 + 2j}, asyncsave.UnsupportedTypeError, "c"),
    SaveCase(
        "numpy object array",
        lambda: {"a": np.array([Opaque()], dtype=object)},
        asyncsave.CheckpointError,
        "a",
    ),
    SaveCase("deep nesting", lambda: {"d": _deep(400)}, asyncsave.InvalidStateError, None),
    # unsupported tensors and dtypes
    SaveCase(
        "sparse COO",
        lambda: {"s": torch.ones(3).to_sparse()},
        asyncsave.UnsupportedTensorError,
        "s",
    ),
    SaveCase(
        "sparse CSR",
        lambda: {"s": torch.eye(3).to_sparse_csr()},
        asyncsave.UnsupportedTensorError,
        "s",
    ),
    SaveCase(
        "quantized tensor",
        lambda: {"q": torch.quantize_per_tensor(torch.ones(3), 0.1, 0, torch.quint8)},
        asyncsave.UnsupportedTensorError,
        "q",
    ),
    SaveCase(
        "quantized dtype view",
        lambda: {"q": torch.zeros(4, dtype=torch.uint8).view(torch.qint8)},
        asyncsave.UnsupportedTensorError,
        "q",
    ),
    SaveCase(
        "meta tensor",
        lambda: {"m": torch.empty(3, device="meta")},
        asyncsave.UnsupportedTensorError,
        "m",
    ),
    SaveCase(
        "nested tensor",
        lambda: {"n": torch.nested.nested_tensor([torch.ones(2), torch.ones(3)])},
        asyncsave.UnsupportedTensorError,
        "n",
    ),
    SaveCase(
        "tensor subclass",
        lambda: {"t": torch.ones(2).as_subclass(MyTensor)},
        asyncsave.UnsupportedTensorError,
        "t",
    ),
    SaveCase("tensor requiring grad", grad_tensor, ROUND_TRIP),
    SaveCase("non-leaf tensor with grad_fn", non_leaf, ROUND_TRIP),
    SaveCase(
        "every exotic dtype",
        lambda: {
            str(d): torch.zeros(4, dtype=torch.uint8).view(d)
            for d in (torch.float8_e4m3fn, torch.float8_e5m2, torch.uint16, torch.bits8)
        },
        ROUND_TRIP,
    ),
    SaveCase(
        "NaN payloads, -0.0 and infinities",
        lambda: {
            "t": torch.tensor([math.nan, -0.0, math.inf, -math.inf]),
            "f": -0.0,
            "n": math.nan,
        },
        ROUND_TRIP,
    ),
    # keys
    SaveCase("key with slash", lambda: {"a/b": torch.ones(2)}, ROUND_TRIP),
    SaveCase("key '..'", lambda: {"..": torch.ones(2)}, ROUND_TRIP),
    SaveCase("key escaping upwards", lambda: {"../../etc/passwd": torch.ones(2)}, ROUND_TRIP),
    SaveCase("absolute path key", lambda: {"/etc/passwd": torch.ones(2)}, ROUND_TRIP),
    SaveCase("key with NUL", lambda: {"a\x00b": torch.ones(2)}, ROUND_TRIP),
    SaveCase("very long key", lambda: {"k" * 100_000: torch.ones(2)}, ROUND_TRIP),
    SaveCase("empty key", lambda: {"": torch.ones(2)}, ROUND_TRIP),
    SaveCase("unicode and control keys", lambda: {"é\u202e\n\t🙂": torch.ones(2)}, ROUND_TRIP),
    SaveCase(
        "duplicate flattened keys",
        lambda: {"a/b": torch.zeros(2), "a": {"b": torch.ones(2)}},
        ROUND_TRIP,
    ),
    SaveCase("int and str keys alike", lambda: {1: torch.zeros(2), "1": torch.ones(2)}, ROUND_TRIP),
    SaveCase("tuple key", lambda: {(1, 2): 3}, asyncsave.InvalidKeyError, "(1, 2)"),
    SaveCase("bool key", lambda: {True: 3}, asyncsave.InvalidKeyError, "True"),
    SaveCase("float key", lambda: {"a": {1.5: 2}}, asyncsave.InvalidKeyError, "a/1.5"),
    SaveCase("None key", lambda: {None: 2}, asyncsave.InvalidKeyError, "None"),
    SaveCase("tensor key", lambda: {"a": {torch.ones(()): 2}}, asyncsave.InvalidKeyError, None),
    # structures
    SaveCase("recursive dict", recursive_dict, asyncsave.InvalidStateError, "x/self"),
    SaveCase("recursive list", recursive_list, asyncsave.InvalidStateError, "x/1"),
    SaveCase(
        "state_dict() that raises",
        lambda: {"sampler": Broken()},
        asyncsave.InvalidStateError,
        "sampler",
    ),
    SaveCase("huge int leaf", lambda: {"i": 2**200, "j": -(2**70)}, ROUND_TRIP),
    SaveCase("list and tuple top level", lambda: [torch.ones(2), (1, "a")], ROUND_TRIP),
    # steps
    SaveCase("negative step", lambda: {"w": torch.ones(2)}, asyncsave.InvalidStepError, step=-1),
    SaveCase("bool step", lambda: {"w": torch.ones(2)}, asyncsave.InvalidStepError, step=True),
    SaveCase("float step", lambda: {"w": torch.ones(2)}, asyncsave.InvalidStepError, step=2.0),
    SaveCase("huge step", lambda: {"w": torch.ones(2)}, asyncsave.InvalidStepError, step=2**63),
]


def _deep(n: int) -> Any:
    node: Any = 1
    for _ in range(n):
        node = {"d": node}
    return node


# -- damage to a committed checkpoint -----------------------------------------------


def _data(path: Path) -> Path:
    return sorted(path.glob("*.safetensors"))[0]


def _doc(path: Path) -> dict[str, Any]:
    doc = json.loads((path / "manifest.json").read_text())
    doc.pop("manifest_xxh3_64")
    return doc


def _reseal(path: Path, edit: Callable[[dict[str, Any]], None]) -> None:
    doc = _doc(path)
    edit(doc)
    (path / "manifest.json").write_bytes(encode_manifest(doc))


def _flip(f: Path, pos: int) -> None:
    raw = bytearray(f.read_bytes())
    raw[pos % len(raw)] ^= 0x10
    f.write_bytes(bytes(raw))


def _entry_pos(path: Path) -> int:
    return int(_doc(path)["entries"][0]["offset"]) + 3


def _set(d: dict[str, Any], key: str, value: Any) -> None:
    d[key] = value


S2 = "step_2"
DISK_CASES = [
    DiskCase(
        "truncated data file",
        lambda r: _data(r / S2).write_bytes(_data(r / S2).read_bytes()[:-9]),
        asyncsave.CorruptCheckpointError,
    ),
    DiskCase(
        "data file grown",
        lambda r: _data(r / S2).write_bytes(_data(r / S2).read_bytes() + b"x"),
        asyncsave.CorruptCheckpointError,
    ),
    DiskCase(
        "flipped bit in tensor data",
        lambda r: _flip(_data(r / S2), _entry_pos(r / S2)),
        asyncsave.ChecksumMismatchError,
    ),
    DiskCase(
        "flipped bit in safetensors header",
        lambda r: _flip(_data(r / S2), 12),
        asyncsave.CorruptCheckpointError,
    ),
    DiskCase(
        "flipped bit in manifest",
        lambda r: _flip(r / S2 / "manifest.json", 40),
        asyncsave.CorruptCheckpointError,
    ),
    DiskCase(
        "manifest missing",
        lambda r: (r / S2 / "manifest.json").unlink(),
        asyncsave.CheckpointNotFoundError,
    ),
    DiskCase(
        "manifest empty",
        lambda r: (r / S2 / "manifest.json").write_bytes(b""),
        asyncsave.CorruptCheckpointError,
    ),
    DiskCase(
        "manifest not JSON",
        lambda r: (r / S2 / "manifest.json").write_bytes(b"{not json"),
        asyncsave.CorruptCheckpointError,
    ),
    DiskCase(
        "manifest binary garbage",
        lambda r: (r / S2 / "manifest.json").write_bytes(bytes(range(256))),
        asyncsave.CorruptCheckpointError,
    ),
    DiskCase(
        "manifest is a directory",
        lambda r: ((r / S2 / "manifest.json").unlink(), (r / S2 / "manifest.json").mkdir()),
        asyncsave.CorruptCheckpointError,
    ),
    DiskCase(
        "manifest pointing outside",
        lambda r: _reseal(
            r / S2, lambda d: d["files"][0].update(name="../step_1/" + d["files"][0]["name"])
        ),
        asyncsave.CorruptCheckpointError,
    ),
    DiskCase(
        "manifest naming an absolute path",
        lambda r: _reseal(r / S2, lambda d: d["files"][0].update(name="/etc/passwd")),
        asyncsave.CorruptCheckpointError,
    ),
    DiskCase(
        "manifest with wrong file size",
        lambda r: _reseal(
            r / S2, lambda d: d["files"][0].update(nbytes=d["files"][0]["nbytes"] + 8)
        ),
        asyncsave.CorruptCheckpointError,
    ),
    DiskCase(
        "manifest entry past end",
        lambda r: _reseal(r / S2, lambda d: d["entries"][0].update(nbytes=10**9)),
        asyncsave.CorruptCheckpointError,
    ),
    DiskCase(
        "manifest tensor bigger than entry",
        lambda r: _reseal(r / S2, lambda d: d["tensors"][0].update(shape=[10**6])),
        asyncsave.CorruptCheckpointError,
    ),
    # found by the hypothesis fuzzer (tests/test_fuzz_parsers.py): raw TypeError / KeyError
    DiskCase(
        "manifest tensor kind not a string",
        lambda r: _reseal(r / S2, lambda d: d["tensors"][0].update(kind=["tensor"])),
        asyncsave.CorruptCheckpointError,
    ),
    DiskCase(
        "manifest tensor without stride",
        lambda r: _reseal(r / S2, lambda d: d["tensors"][0].pop("stride")),
        asyncsave.CorruptCheckpointError,
    ),
    DiskCase(
        "manifest of another step",
        lambda r: _reseal(r / S2, lambda d: _set(d, "step", 7)),
        asyncsave.CorruptCheckpointError,
    ),
    DiskCase(
        "manifest with negative step",
        lambda r: _reseal(r / S2, lambda d: _set(d, "step", -2)),
        asyncsave.CorruptCheckpointError,
    ),
    DiskCase(
        "newer format version",
        lambda r: _reseal(r / S2, lambda d: _set(d, "format_version", 99)),
        asyncsave.UnsupportedFormatError,
    ),
    DiskCase(
        "data file missing", lambda r: _data(r / S2).unlink(), asyncsave.CorruptCheckpointError
    ),
    DiskCase(
        "data file is a symlink outside",
        lambda r: (_data(r / S2).unlink(), _data_link(r)),
        asyncsave.CorruptCheckpointError,
    ),
    # trackers
    DiskCase("tracker garbage", lambda r: (r / TRACKER).write_text("garbage"), FALLS_BACK),
    DiskCase("tracker empty", lambda r: (r / TRACKER).write_text(""), FALLS_BACK),
    DiskCase("tracker negative step", lambda r: (r / TRACKER).write_text("-5"), FALLS_BACK),
    DiskCase("tracker huge step", lambda r: (r / TRACKER).write_text("9" * 40), FALLS_BACK),
    DiskCase("tracker binary", lambda r: (r / TRACKER).write_bytes(b"\xff\x00\x01"), FALLS_BACK),
    DiskCase("tracker missing", lambda r: (r / TRACKER).unlink(), FALLS_BACK),
    DiskCase(
        "tracker naming a missing directory",
        lambda r: (r / TRACKER).write_text("5"),
        asyncsave.CheckpointNotFoundError,
    ),
    DiskCase(
        "tracker is a directory",
        lambda r: ((r / TRACKER).unlink(), (r / TRACKER).mkdir()),
        SAVER_REFUSES,
    ),
]


def _data_link(root: Path) -> None:
    outside = root.parent / "outside.bin"
    outside.write_bytes(b"\0" * 4096)
    (root / S2 / "data-r00000-000.safetensors").symlink_to(outside)


def state_of(step: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(step)
    return {
        "w": torch.randn(8, 8, generator=g),
        "i": torch.arange(5) * step,
        "meta": {"step": step},
    }


def same(a: Any, b: Any) -> bool:
    """Exact equality: types, dtypes, shapes, bits, requires_grad, NaN payloads."""
    if isinstance(b, torch.Tensor):
        return (
            type(a) is type(b)
            and a.dtype == b.dtype
            and a.shape == b.shape
            and a.requires_grad == b.requires_grad
            and torch.equal(
                a.detach().reshape(-1).view(torch.uint8), b.detach().reshape(-1).view(torch.uint8)
            )
        )
    if isinstance(b, float):
        return type(a) is float and struct.pack("<d", a) == struct.pack("<d", b)
    if isinstance(b, dict):
        return type(a) is type(b) and list(a) == list(b) and all(same(a[k], b[k]) for k in b)
    if isinstance(b, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(same, a, b))
    return type(a) is type(b) and a == b


def test_the_corpus_has_at_least_forty_kinds() -> None:
    n = len(SAVE_CASES) + len(DISK_CASES)
    names = [c.name for c in SAVE_CASES + DISK_CASES]
    assert len(set(names)) == n  # no duplicates padding the count
    record("bad-input kinds", n)
    assert n >= 40


@pytest.mark.parametrize("case", SAVE_CASES, ids=[c.name for c in SAVE_CASES])
async def test_a_bad_state_is_a_typed_error_or_an_exact_round_trip(
    tmp_path: Path, case: SaveCase
) -> None:
    state = case.state()
    async with asyncsave.Checkpointer(tmp_path) as ckpt:
        if case.expect is ROUND_TRIP:
            info = await (await ckpt.save(case.step, state))
            assert info is not None
            assert same(asyncsave.load(info.path), state)
            assert asyncsave.verify(info.path).step == case.step
        else:
            try:
                await ckpt.save(case.step, state)
            except Exception as exc:  # a typed error, never a raw one
                assert isinstance(exc, asyncsave.CheckpointError), repr(exc)
                assert isinstance(exc, case.expect), repr(exc)
                if case.key is not None:
                    assert exc.key == case.key, (exc.key, str(exc))
            else:
                pytest.fail(f"{case.name}: save() accepted it")
            assert not list(tmp_path.glob("step_*"))  # nothing written
            # the checkpointer is still usable: bad input is not a failed save
            assert await (await ckpt.save(5, state_of(5))) is not None


@pytest.mark.parametrize("case", DISK_CASES, ids=[c.name for c in DISK_CASES])
async def test_a_damaged_checkpoint_or_tracker_is_a_typed_error_never_a_wrong_result(
    tmp_path: Path, case: DiskCase, caplog: pytest.LogCaptureFixture
) -> None:
    root = tmp_path / "root"
    async with asyncsave.Checkpointer(root) as ckpt:
        for step in (1, 2):
            await (await ckpt.save(step, state_of(step)))
    case.damage(root)

    def typed(call: Callable[[], Any]) -> Any:
        try:
            return call()
        except Exception as exc:
            assert isinstance(exc, asyncsave.CheckpointError), f"raw {exc!r}"
            return exc

    if case.expect is SAVER_REFUSES:
        info = typed(lambda: asyncsave.latest(root))
        assert isinstance(info, asyncsave.CheckpointInfo) and info.step == 2, info
        with pytest.raises(asyncsave.CorruptCheckpointError):
            async with asyncsave.Checkpointer(root):
                pass
        return
    if case.expect is FALLS_BACK:
        info = typed(lambda: asyncsave.latest(root))
        assert isinstance(info, asyncsave.CheckpointInfo) and info.step == 2, info
        async with asyncsave.Checkpointer(root) as ckpt:
            restored = await ckpt.load_latest()
            assert restored is not None and same(restored.state, state_of(2))
        assert (root / TRACKER).read_text() == "2"  # rewritten at open
        return
    if "tracker" in case.name:
        err = typed(lambda: asyncsave.latest(root))
        assert isinstance(err, case.expect), repr(err)
    else:
        for call in (asyncsave.load, asyncsave.verify):
            err = typed(lambda call=call: call(root / S2))
            assert isinstance(err, case.expect), f"{call.__name__}: {err!r}"
            assert err.path is not None and str(root / S2) in err.path, err.path
        # latest() either refuses or names step 2, whose load is then refused
        got = typed(lambda: asyncsave.latest(root))
        if isinstance(got, asyncsave.CheckpointInfo):
            assert got.step == 2 and isinstance(
                typed(lambda: asyncsave.load(got.path)), asyncsave.CheckpointError
            )
    # Resuming: a typed error, or with fallback the last good checkpoint, exactly.
    try:
        async with asyncsave.Checkpointer(root) as ckpt:
            plain = await _typed_async(ckpt.load_latest)
            assert isinstance(plain, asyncsave.CheckpointError) or same(plain.state, state_of(2)), (
                plain
            )
            restored = await _typed_async(lambda: ckpt.load_latest(fallback=True))
            assert not isinstance(restored, asyncsave.CheckpointError), repr(restored)
            good = 2 if "tracker" in case.name else 1  # the newest undamaged one
            assert restored is not None and restored.info.step == good
            assert same(restored.state, state_of(good))
    except asyncsave.CheckpointError as exc:
        # refusing to open at all is allowed only for what must not be touched
        assert isinstance(
            exc, (asyncsave.UnsupportedFormatError, asyncsave.CorruptCheckpointError)
        ), repr(exc)
        assert case.expect in (asyncsave.UnsupportedFormatError, asyncsave.CorruptCheckpointError)
        assert "tracker" in case.name or case.expect is asyncsave.UnsupportedFormatError, repr(exc)


async def _typed_async(call: Callable[[], Any]) -> Any:
    try:
        return await call()
    except Exception as exc:
        assert isinstance(exc, asyncsave.CheckpointError), f"raw {exc!r}"
        return exc


# -- roots and paths that name nothing -------------------------------------------------

_NOT_PATHS = [5, None, b"runs/x", 1.5, ["runs/x"]]
_EMPTY_PATHS = ["", "   ", "file://"]


def _root_takers() -> dict[str, Callable[[Any], Any]]:
    """Every public entry point that takes a root or a checkpoint path."""
    takers: dict[str, Callable[[Any], Any]] = {
        "Checkpointer": asyncsave.Checkpointer,
        "Tier": asyncsave.Tier,
        "load": asyncsave.load,
        "verify": asyncsave.verify,
        "load_tensors": lambda p: asyncsave.load_tensors(p, ["w"]),
        "latest": asyncsave.latest,
        "checkpoints": asyncsave.checkpoints,
        "load_step": lambda p: asyncsave.load_step(p, 1),
    }
    try:
        from asyncsave.lightning import AsyncsaveCheckpointIO
    except ImportError:  # lightning is an optional extra
        pass
    else:
        takers["AsyncsaveCheckpointIO"] = AsyncsaveCheckpointIO
    return takers


@pytest.mark.parametrize("name", sorted(_root_takers()))
def test_a_root_that_is_not_a_path_is_refused_by_name(name: str) -> None:
    """Before: ``Checkpointer(5)`` raised pathlib's TypeError naming no argument,
    ``Tier(5)`` was accepted until its first save, and ``Checkpointer("")`` saved
    into the current directory."""
    take = _root_takers()[name]
    for bad in _NOT_PATHS:
        if bad is None and name == "AsyncsaveCheckpointIO":
            continue  # documented: the directory of Lightning's first save path
        with pytest.raises(TypeError, match=r"(root|path)=.*must be a path"):
            take(bad)
    for empty in _EMPTY_PATHS:
        with pytest.raises(ValueError, match=r"(root|path)=.* is empty"):
            take(empty)


def test_the_cli_refuses_an_empty_root(capsys: pytest.CaptureFixture[str]) -> None:
    from asyncsave.testing import cli as main

    for argv in (["ls", ""], ["verify", " "], ["inspect", ""], ["prune", "", "--keep-last", "1"]):
        assert main(argv) == 2, argv
        assert "is empty" in capsys.readouterr().err, argv


async def test_a_checkpoint_passed_as_a_root_is_refused_everywhere(tmp_path: Path) -> None:
    """``latest(root).path`` fed back as a root (found by a new user): before, a
    Checkpointer there resumed nothing (a fresh start) and nested a root inside
    the committed checkpoint; readers listed nothing. Now every root entry point
    says it is one checkpoint and names its root, and the checkpoint is unchanged."""
    async with asyncsave.Checkpointer(tmp_path) as ckpt:
        await (await ckpt.save(3, {"w": torch.full((2,), 3.0)}))
    one = tmp_path / "step_3"
    before = sorted(p.name for p in one.iterdir())
    calls: dict[str, Callable[[], Any]] = {
        "latest": lambda: asyncsave.latest(one),
        "checkpoints": lambda: asyncsave.checkpoints(one),
        "load_step": lambda: asyncsave.load_step(one, 3),
        "SyncCheckpointer": lambda: asyncsave.SyncCheckpointer(one).__enter__(),
        "persistent Tier": lambda: asyncsave.SyncCheckpointer(
            tmp_path / "local", persistent=asyncsave.Tier(one)
        ).__enter__(),
    }
    for name, call in calls.items():
        with pytest.raises(asyncsave.CheckpointNotFoundError, match="is one checkpoint") as err:
            call()
        assert str(tmp_path) in str(err.value) and err.value.path == str(one), name
    with pytest.raises(asyncsave.CheckpointNotFoundError, match="is one checkpoint"):
        async with asyncsave.Checkpointer(one):
            pass
    assert sorted(p.name for p in one.iterdir()) == before
    assert torch.equal(asyncsave.load(one)["w"], torch.full((2,), 3.0))


async def test_a_root_holding_another_tools_manifest_json_is_a_root(tmp_path: Path) -> None:
    """Only asyncsave's own manifest makes a directory one checkpoint (review: a
    run directory with a dataset index named manifest.json was refused)."""
    (tmp_path / "manifest.json").write_text('{"files": ["train-000.parquet"]}')
    async with asyncsave.Checkpointer(tmp_path) as ckpt:
        await (await ckpt.save(1, {"w": torch.ones(2)}))
    assert [c.step for c in asyncsave.checkpoints(tmp_path)] == [1]
    assert asyncsave.latest(tmp_path).step == 1  # type: ignore[union-attr]


def test_the_dcp_writer_and_reader_refuse_roots_that_name_nothing() -> None:
    """Review: ``StorageWriter(root="")`` was the current directory, as
    ``Checkpointer("")`` was."""
    import asyncsave.dcp

    for make in (
        lambda r: asyncsave.dcp.StorageWriter(r, 1),
        lambda r: asyncsave.dcp.StorageReader(r),
        lambda r: asyncsave.dcp.StorageWriter("runs/x", 1).reset(checkpoint_id=r),
        lambda r: asyncsave.dcp.StorageReader("runs/x").reset(checkpoint_id=r),
    ):
        with pytest.raises(ValueError, match="is empty"):
            make("")
        with pytest.raises(TypeError, match="must be a path"):
            make(5)


@pytest.mark.parametrize("layout", ["asyncsave", "megatron", "verl"])
def test_loading_a_missing_path_or_a_root_says_which_it_is(tmp_path: Path, layout: str) -> None:
    """``load()`` of a path that does not exist says so; of a root of
    checkpoints (a directory of step directories) says it is a root and names
    ``asyncsave.latest``; of any other directory without a manifest, that it
    has none. All :class:`CheckpointNotFoundError` with the path, nothing
    changed on disk."""
    root = tmp_path / "run"
    with asyncsave.SyncCheckpointer(root, layout=layout) as ckpt:
        ckpt.save(3, {"w": torch.ones(2)}).result()
    before = sorted(p.name for p in root.iterdir())
    cases = {
        tmp_path / "typo": "it does not exist",
        tmp_path / "typo" / "step_3": "it does not exist",
        root: "a root of checkpoints",
        tmp_path: "it has no manifest.json",  # a directory above a root
    }
    (tmp_path / "empty").mkdir()
    cases[tmp_path / "empty"] = "it has no manifest.json"
    for path, words in cases.items():
        with pytest.raises(asyncsave.CheckpointNotFoundError, match=words) as err:
            asyncsave.load(path)
        assert err.value.path == str(path)
        if words == "a root of checkpoints" and path == root:
            assert "asyncsave.latest(" in str(err.value)
    assert sorted(p.name for p in root.iterdir()) == before
    info = asyncsave.latest(root, layout=layout)
    assert info is not None and torch.equal(asyncsave.load(info.path)["w"], torch.ones(2))
