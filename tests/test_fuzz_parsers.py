"""Fuzzing the parsers of untrusted bytes (issue 4, item 7): the tracker, the
manifest, and every byte of a committed checkpoint.

Property: whatever the bytes, the outcome is a value or a typed
:class:`asyncsave.CheckpointError`, never another exception and never a wrong
result. The parsers are reached as a user reaches them: a tracker through
:func:`asyncsave.latest` on a root that holds only that tracker (a step it names
is reported missing, with that step; a damaged one is skipped, the root
scanned), a manifest through :func:`asyncsave.load` and :func:`asyncsave.verify`. Hypothesis profiles (``tests/conftest.py``): ``ci`` (default, bounded) and
``long``; a longer local run::

    ASYNCSAVE_FUZZ_PROFILE=long python -m pytest tests/test_fuzz_parsers.py
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path
from typing import Any

import anyio
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from reliability import record

import asyncsave
from asyncsave.testing import encode_manifest, tracker_file_name

MAX_STEP = 2**63 - 1
MAX_TRACKER_BYTES = 64  # a longer tracker file is damaged, whatever it holds
TRACKER = tracker_file_name("asyncsave")
assert TRACKER is not None


# -- tracker ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def tracker_root() -> Any:
    """A root that holds a tracker and no checkpoint (the tracker is rewritten per
    example)."""
    tmp = Path(tempfile.mkdtemp(prefix="asyncsave-fuzz-tracker-"))
    yield tmp
    shutil.rmtree(tmp)


def parse_tracker(raw: bytes, root: Path) -> int:
    """The step a tracker holding ``raw`` names, read by :func:`asyncsave.latest`:
    it reports that step missing (nothing is committed here); a damaged tracker
    raises :class:`asyncsave.CorruptCheckpointError` here, as the library's
    parser does, after :func:`asyncsave.latest` skipped it (nothing found)."""
    (root / TRACKER).write_bytes(raw)
    try:
        info = asyncsave.latest(root)
    except asyncsave.CheckpointNotFoundError as exc:
        assert f"names step {exc.step}," in str(exc), exc
        assert type(exc.step) is int
        return exc.step
    assert info is None
    raise asyncsave.CorruptCheckpointError(f"tracker {raw!r} skipped as damaged")


@settings(suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.binary(max_size=80))
def test_any_tracker_bytes_parse_to_a_step_or_a_typed_error(tracker_root: Path, raw: bytes) -> None:
    try:
        step = parse_tracker(raw, tracker_root)
    except asyncsave.CorruptCheckpointError:
        return
    assert type(step) is int and 0 <= step <= MAX_STEP
    # what Megatron and verl read: int(f.read().strip()) (str whitespace)
    text = raw.decode("ascii").strip()
    assert text.isdigit() and int(text) == step


@settings(suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    st.integers(0, MAX_STEP),
    st.sampled_from(["", " ", "\n", "\r\n", "\t", "  \n"]),
    st.sampled_from(["", " ", "\n", "\t"]),
)
def test_every_step_written_as_megatron_and_verl_do_reads_back(
    tracker_root: Path, step: int, tail: str, head: str
) -> None:
    raw = f"{head}{step}{tail}".encode()
    if len(raw) <= MAX_TRACKER_BYTES:
        assert parse_tracker(raw, tracker_root) == step


@settings(suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.text(max_size=30))
def test_any_text_tracker_never_parses_to_a_wrong_step(tracker_root: Path, text: str) -> None:
    raw = text.encode("utf-8")
    try:
        step = parse_tracker(raw, tracker_root)
    except asyncsave.CorruptCheckpointError:
        return
    assert str(step) == text.strip().lstrip("0") or (step == 0 and set(text.strip()) == {"0"})


number_like = st.from_regex(
    r"\A\s{0,2}[-+]?[0-9]{0,22}([._eExX][0-9a-f]{0,3})?\s{0,2}\Z", fullmatch=True
) | st.builds(
    lambda d, s: s + d,
    st.integers(0, 10**25).map(str),
    st.sampled_from(["-", "+", "٣", "\x00", " "]),
)


@settings(suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(number_like)
def test_number_like_trackers_parse_only_when_they_are_a_plain_decimal(
    tracker_root: Path, text: str
) -> None:
    """Signs, floats, hex, underscores, non-ASCII digits, steps past 2**63-1: a
    typed error, never a step (Megatron's int() would take some of these)."""
    try:
        step = parse_tracker(text.encode("utf-8"), tracker_root)
    except asyncsave.CorruptCheckpointError:
        return
    plain = text.strip()
    assert plain.isascii() and plain.isdigit() and int(plain) == step <= MAX_STEP, text


# -- manifest ---------------------------------------------------------------------


def _saved(root: Path) -> Path:
    state = {
        "model": {"w": torch.randn(4, 4), "b": torch.arange(3, dtype=torch.int16)},
        "tied": (t := torch.randn(6)),
        "view": t[1:4],
        "meta": {"step": 3, "lr": 0.5, "name": "x", "none": None, "big": 2**70},
    }

    async def go() -> Path:
        async with asyncsave.Checkpointer(root) as ckpt:
            info = await (await ckpt.save(3, state))
            assert info is not None
            return info.path

    return anyio.run(go)


@pytest.fixture(scope="module")
def good_checkpoint() -> Any:
    tmp = Path(tempfile.mkdtemp(prefix="asyncsave-fuzz-"))
    path = _saved(tmp / "root")
    doc = json.loads((path / "manifest.json").read_text())
    doc.pop("manifest_xxh3_64")
    yield path, doc
    shutil.rmtree(tmp)


@settings(suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(raw=st.binary(max_size=400))
def test_any_manifest_bytes_are_a_manifest_or_a_typed_error(
    good_checkpoint: Any, scratch: Path, raw: bytes
) -> None:
    """A checkpoint whose manifest is any bytes: load() and verify() raise a
    damaged- or unsupported-checkpoint error, never another exception."""
    path, _ = good_checkpoint
    copy = scratch / "step_3"
    if not copy.exists():
        shutil.copytree(path, copy)
    (copy / "manifest.json").write_bytes(raw)
    for call in (asyncsave.load, asyncsave.verify):
        try:
            call(copy)
        except (asyncsave.CorruptCheckpointError, asyncsave.UnsupportedFormatError):
            pass


@pytest.fixture(scope="module")
def scratch() -> Any:
    tmp = Path(tempfile.mkdtemp(prefix="asyncsave-fuzz-scratch-"))
    yield tmp
    shutil.rmtree(tmp)


json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=False)
    | st.text(max_size=12),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4)
    ),
    max_leaves=12,
)


def _paths(node: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    out = [prefix]
    if isinstance(node, dict):
        for k, v in node.items():
            out += _paths(v, (*prefix, k))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            out += _paths(v, (*prefix, i))
    return out


@st.composite
def mutated_manifests(draw: Any, doc: dict[str, Any]) -> dict[str, Any]:
    """A valid manifest with 1-3 fields replaced by arbitrary JSON, deleted, or
    nudged by one (sealed again, so the field checks behind the checksum run)."""
    doc = json.loads(json.dumps(doc))
    for _ in range(draw(st.integers(1, 3))):
        paths = [p for p in _paths(doc) if p]
        path = draw(st.sampled_from(paths))
        parent: Any = doc
        for k in path[:-1]:
            parent = parent[k]
        key = path[-1]
        how = draw(st.sampled_from(["replace", "delete", "nudge"]))
        if how == "delete" and isinstance(parent, dict):
            del parent[key]
        elif how == "nudge" and type(parent[key]) is int:
            parent[key] += draw(st.sampled_from([-1, 1, 8, -8, 2**40]))
        else:
            parent[key] = draw(json_values)
    return doc


@settings(suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(data=st.data())
def test_a_mutated_resealed_manifest_is_a_typed_error_or_loads(
    good_checkpoint: Any, data: Any
) -> None:
    """Sealed again (a valid self-checksum), a mutated manifest reaches every field
    check: the outcome is a typed error or a load, never another exception, and
    load() and verify() agree on which. (A resealed manifest that describes other
    valid views of the same bytes is a different checkpoint, not damage: checksums
    cannot tell; the unsealed test below is the one about damage.)"""
    path, doc = good_checkpoint
    with tempfile.TemporaryDirectory() as tmp:
        copy = Path(tmp) / "step_3"
        shutil.copytree(path, copy)
        mutated = data.draw(mutated_manifests(doc))
        (copy / "manifest.json").write_bytes(encode_manifest(mutated))
        outcomes = []
        for call in (asyncsave.load, asyncsave.verify):
            try:
                call(copy)
                outcomes.append("ok")
            except asyncsave.CheckpointError as exc:
                outcomes.append(type(exc).__name__)
        assert (outcomes[0] == "ok") == (outcomes[1] == "ok"), (outcomes, mutated)


_ODD_VALUES = [None, True, 0, -1, 1.5, "x", [], [None], {}, {"entry": 0}]


@pytest.mark.parametrize("version", [1, 2])
def test_every_field_set_to_every_odd_type_is_a_typed_error_or_loads(
    good_checkpoint: Any, version: int
) -> None:
    """The exhaustive companion of the test above, for the kind hypothesis found
    once (CI, 2026-11: a ``tensors`` element set to null reached ``"chunks" in t``
    and raised TypeError): every field of the manifest, at every depth, replaced by
    each value of another JSON type, in a version-1 and a version-2 manifest."""
    path, doc = good_checkpoint
    doc = {**json.loads(json.dumps(doc)), "format_version": version}
    # (field path, value): every field at every depth set to each odd value; and
    # ``chunks`` (version 2's one addition, absent from the fixture) inserted into
    # each tensor record, odd values and lists of wrong entries alike.
    cases = [(where, value) for where in _paths(doc) if where for value in _ODD_VALUES]
    chunk_values = [*_ODD_VALUES, [0, 0], [0, 1], [1, 0], [0, 99], [0, -1], [0, 1, 2]]
    cases += [
        (("tensors", i, "chunks"), value)
        for i in range(len(doc["tensors"]))
        for value in chunk_values
    ]
    with tempfile.TemporaryDirectory() as tmp:
        copy = Path(tmp) / "step_3"
        shutil.copytree(path, copy)
        for where, value in cases:
            mutated = json.loads(json.dumps(doc))
            parent: Any = mutated
            for k in where[:-1]:
                parent = parent[k]
            parent[where[-1]] = value
            (copy / "manifest.json").write_bytes(encode_manifest(mutated))
            try:
                asyncsave.load(copy)
            except asyncsave.CheckpointError:
                pass
    assert len(cases) >= 100 * len(_ODD_VALUES) // 2


@settings(suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(data=st.data())
def test_a_mutated_manifest_that_was_not_resealed_is_always_refused(
    good_checkpoint: Any, data: Any
) -> None:
    """Damage (not a deliberate edit): the old self-checksum stays, so any change
    to the content is a CorruptCheckpointError, never a different checkpoint."""
    path, doc = good_checkpoint
    expected = asyncsave.load(path)
    sealed = (path / "manifest.json").read_bytes()
    seal = sealed[sealed.rindex(b',"manifest_xxh3_64"') :]
    with tempfile.TemporaryDirectory() as tmp:
        copy = Path(tmp) / "step_3"
        shutil.copytree(path, copy)
        mutated = data.draw(mutated_manifests(doc))
        body = json.dumps(mutated, separators=(",", ":")).encode()
        (copy / "manifest.json").write_bytes(body[:-1] + seal)
        try:
            got = asyncsave.load(copy)
        except asyncsave.CheckpointError:
            return
        assert _same(got, expected), mutated  # only a no-op mutation may pass


def _same_json(a: bytes, b: bytes) -> bool:
    try:
        return bool(json.loads(a) == json.loads(b))
    except ValueError:
        return False


def _same(a: Any, b: Any) -> bool:
    if isinstance(b, torch.Tensor):
        return (
            isinstance(a, torch.Tensor)
            and a.dtype == b.dtype
            and a.shape == b.shape
            and a.stride() == b.stride()
            and torch.equal(a, b)
        )
    if isinstance(b, dict):
        return type(a) is type(b) and list(a) == list(b) and all(_same(a[k], b[k]) for k in b)
    if isinstance(b, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(_same, a, b))
    return type(a) is type(b) and a == b


# -- every bit of a checkpoint ------------------------------------------------------


@pytest.mark.parametrize("which", ["data file", "manifest"])
def test_every_single_bit_flip_is_detected_or_harmless(good_checkpoint: Any, which: str) -> None:
    """Exhaustive, not sampled: each byte of the file flipped at one bit (rotating
    through the 8 bits), then verify() and load(): a typed error, or exactly the
    saved state (a flip in free-form metadata), never anything else."""
    path, _ = good_checkpoint
    expected = asyncsave.load(path)
    name = "manifest.json" if which == "manifest" else sorted(path.glob("*.safetensors"))[0].name
    original = (path / name).read_bytes()
    undetected: list[int] = []
    # The one free-form span: safetensors' __metadata__ (strings nobody interprets).
    start = original.find(b'"__metadata__":{') if which == "data file" else -1
    free = range(start, original.find(b"}", start) + 1) if start >= 0 else range(0)
    with tempfile.TemporaryDirectory() as tmp:
        copy = Path(tmp) / "step_3"
        shutil.copytree(path, copy)
        for pos in range(len(original)):
            raw = bytearray(original)
            raw[pos] ^= 1 << (pos % 8)
            (copy / name).write_bytes(bytes(raw))
            try:
                asyncsave.verify(copy)
                got = asyncsave.load(copy)
            except asyncsave.CheckpointError:
                continue
            assert _same(got, expected), f"byte {pos} flipped: a wrong result was loaded"
            if which == "manifest" and _same_json(bytes(raw), original):
                continue  # a spelling of the same document ("1e3" and "1E3")
            undetected.append(pos)
    record("bit flips checked", len(original))
    assert all(pos in free for pos in undetected), undetected
