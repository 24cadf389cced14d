"""Incremental saves (issue 14): bytes equal to the previous commit's are shared,
never written again, and a changed byte is never shared.

What is shared is decided from checksums of the staged bytes (never Python
identity): every test here changes tensors *in place* (the same objects), so
identity could not tell, and checks the result on disk (inode numbers, the
manifest's ``incremental`` report) and by loading bit-exact.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import anyio
import pytest
import torch
from hypothesis import given
from hypothesis import settings as hsettings
from hypothesis import strategies as st

import asyncsave

OWN = 1 << 20  # asyncsave._incremental.OWN_FILE_BYTES: a tensor this large has its own file


def lora_state(seed: int = 0) -> dict[str, Any]:
    """A small LoRA-shaped state: frozen base weights (own files), adapters and
    their optimizer moments (small, packed), a plain step."""
    g = torch.Generator().manual_seed(seed)
    return {
        "model": {
            "base.0": torch.randn(OWN // 4, generator=g),
            "base.1": torch.randn(OWN // 2, generator=g).to(torch.bfloat16).view(-1, 64),
            "base.2": torch.randint(0, 255, (OWN + 7,), generator=g, dtype=torch.uint8),
            "lora_A": torch.randn(16, 64, generator=g),
            "lora_B": torch.zeros(64, 16),
            "norm": torch.ones(64),
        },
        "optim": {"exp_avg": torch.zeros(16, 64), "step": torch.tensor(0.0)},
        "trainer": {"step": 0},
    }


def manifest(path: Path) -> dict[str, Any]:
    return json.loads((path / "manifest.json").read_bytes())


def inode_of(path: Path, key: str) -> int:
    """The inode of the data file holding the tensor ``key``."""
    m = manifest(path)
    rec = next(t for t in m["tensors"] if t["key"] == key)
    name = m["files"][m["entries"][rec["entry"]]["file"]]["name"]
    return os.stat(path / name).st_ino


def keys(state: dict[str, Any]) -> list[str]:
    return [f"model/{k}" for k in state["model"]] + [
        f"optim/{k}" for k in state["optim"] if isinstance(state["optim"][k], torch.Tensor)
    ]


def assert_equal_tree(a: Any, b: Any) -> None:
    if isinstance(b, dict):
        assert a.keys() == b.keys()
        for k in b:
            assert_equal_tree(a[k], b[k])
    elif isinstance(b, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
    else:
        assert a == b


@pytest.mark.anyio
async def test_unchanged_tensors_are_hard_linked_and_changed_ones_written(tmp_path: Path) -> None:
    state = lora_state()
    async with asyncsave.Checkpointer(tmp_path, incremental=True) as ckpt:
        await (await ckpt.save(1, state))
        # In place: the same tensor objects, new bytes in the adapters only.
        state["model"]["lora_A"].add_(1.0)
        state["optim"]["exp_avg"].add_(0.5)
        state["trainer"]["step"] = 2
        await (await ckpt.save(2, state))
        # One byte of one frozen weight flips: its file is written, not shared.
        state["model"]["base.2"][OWN // 2] ^= 1
        await (await ckpt.save(3, state))
    s1, s2, s3 = (tmp_path / f"step_{s}" for s in (1, 2, 3))
    for k in ("model/base.0", "model/base.1", "model/base.2"):
        assert inode_of(s1, k) == inode_of(s2, k)
    assert inode_of(s1, "model/lora_A") != inode_of(s2, "model/lora_A")
    assert inode_of(s2, "model/base.2") != inode_of(s3, "model/base.2")
    assert inode_of(s2, "model/base.0") == inode_of(s3, "model/base.0")
    report = manifest(s2)["incremental"]
    assert report["base"] == "step_1" and report["files_shared"] == 3
    total = sum(f["nbytes"] for f in manifest(s2)["files"])
    assert report["bytes_written"] + report["bytes_shared"] == total
    assert report["bytes_written"] < 0.02 * total
    for s in (s1, s2, s3):
        asyncsave.verify(s)
    assert_equal_tree(asyncsave.load(s3), state)


@pytest.mark.anyio
async def test_off_by_default_every_file_is_written(tmp_path: Path) -> None:
    state = lora_state()
    async with asyncsave.Checkpointer(tmp_path) as ckpt:
        await (await ckpt.save(1, state))
        await (await ckpt.save(2, state))
    assert "incremental" not in manifest(tmp_path / "step_2")
    assert inode_of(tmp_path / "step_1", "model/base.0") != inode_of(
        tmp_path / "step_2", "model/base.0"
    )


@pytest.mark.anyio
async def test_retention_deletes_the_base_and_the_later_checkpoint_loads_bit_exact(
    tmp_path: Path,
) -> None:
    state = lora_state()
    async with asyncsave.Checkpointer(
        tmp_path, incremental=True, retention=asyncsave.KeepLast(1)
    ) as ckpt:
        for step in (1, 2, 3):
            state["model"]["lora_B"].add_(1.0)
            await (await ckpt.save(step, state))
            assert sorted(p.name for p in tmp_path.glob("step_*")) == [f"step_{step}"]
    assert manifest(tmp_path / "step_3")["incremental"]["files_shared"] == 3
    asyncsave.verify(tmp_path / "step_3")
    assert_equal_tree(asyncsave.load(tmp_path / "step_3"), state)
    # A fresh process (nothing remembered) shares from it too, after reading it back.
    async with asyncsave.Checkpointer(tmp_path, incremental=True) as ckpt:
        assert (await ckpt.load_latest()) is not None
        await (await ckpt.save(4, state))
    report = manifest(tmp_path / "step_4")["incremental"]
    assert report["files_shared"] == 4 and report["bytes_verified"] > 3 * OWN
    assert_equal_tree(asyncsave.load(tmp_path / "step_4"), state)


def flip_byte(path: Path, offset: int, *, keep_mtime: bool) -> None:
    st = os.stat(path)
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x10]))
    if keep_mtime:  # a damage the file's identity does not show
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


@pytest.mark.anyio
@pytest.mark.parametrize("fresh", [False, True], ids=["same-checkpointer", "fresh-checkpointer"])
async def test_a_damaged_base_file_is_never_shared(tmp_path: Path, fresh: bool) -> None:
    state = lora_state()
    ckpt = asyncsave.Checkpointer(tmp_path, incremental=True)
    async with ckpt:
        await (await ckpt.save(1, state))
        m = manifest(tmp_path / "step_1")
        rec = next(t for t in m["tensors"] if t["key"] == "model/base.0")
        entry = m["entries"][rec["entry"]]
        damaged = tmp_path / "step_1" / m["files"][entry["file"]]["name"]
        flip_byte(damaged, entry["offset"] + 1000, keep_mtime=fresh)
        if not fresh:
            await (await ckpt.save(2, state))
    if fresh:
        async with asyncsave.Checkpointer(tmp_path, incremental=True) as ckpt:
            await (await ckpt.save(2, state))
    s2 = tmp_path / "step_2"
    assert os.stat(damaged).st_ino != inode_of(s2, "model/base.0")
    assert inode_of(tmp_path / "step_1", "model/base.1") == inode_of(s2, "model/base.1")
    asyncsave.verify(s2)  # the damage did not propagate
    assert_equal_tree(asyncsave.load(s2), state)
    with pytest.raises(asyncsave.CorruptCheckpointError):
        asyncsave.verify(tmp_path / "step_1")


@pytest.mark.anyio
async def test_new_removed_and_reshaped_tensors_are_written(tmp_path: Path) -> None:
    state = lora_state()
    async with asyncsave.Checkpointer(tmp_path, incremental=True) as ckpt:
        await (await ckpt.save(1, state))
        # Same bytes, another shape: its safetensors header differs, so a new file.
        state["model"]["base.1"] = state["model"]["base.1"].view(-1, 32)
        state["model"]["extra"] = torch.randn(OWN // 4)
        del state["model"]["base.2"]
        await (await ckpt.save(2, state))
    s1, s2 = tmp_path / "step_1", tmp_path / "step_2"
    assert inode_of(s1, "model/base.0") == inode_of(s2, "model/base.0")
    assert inode_of(s1, "model/base.1") != inode_of(s2, "model/base.1")
    assert inode_of(s1, "model/lora_A") == inode_of(s2, "model/lora_A")  # the small ones' pack
    assert manifest(s2)["incremental"]["files_shared"] == 2
    assert_equal_tree(asyncsave.load(s2), state)


@hsettings(max_examples=12, deadline=None)
@given(
    changes=st.lists(
        st.lists(
            st.tuples(st.integers(0, 6), st.integers(0, OWN - 1), st.integers(1, 255)),
            max_size=4,
        ),
        min_size=1,
        max_size=3,
    ),
    backend=st.sampled_from(["asyncio", "trio"]),
)
def test_a_changed_tensor_is_never_shared(
    tmp_path_factory: pytest.TempPathFactory,
    changes: list[list[tuple[int, int, int]]],
    backend: str,
) -> None:
    """Random subsets of tensors change between saves, down to one byte (XOR
    with a non-zero value, so the byte always differs); every tensor's file is
    shared exactly when its bytes did not change, and every save loads bit-exact.
    """
    root = tmp_path_factory.mktemp("incr")
    state = lora_state()
    names = keys(state)

    def tensor_at(key: str) -> torch.Tensor:
        group, name = key.split("/")
        t: torch.Tensor = state[group][name]
        return t

    def raw_of(key: str) -> torch.Tensor:
        return tensor_at(key).view(-1).view(torch.uint8)  # bytes: NaN compares equal

    async def run() -> None:
        async with asyncsave.Checkpointer(root, incremental=True) as ckpt:
            await (await ckpt.save(1, state))
            for step, round_ in enumerate(changes, start=2):
                before = {k: raw_of(k).clone() for k in names}
                for which, at, xor in round_:
                    raw = raw_of(names[which % len(names)])
                    raw[at % raw.numel()] ^= xor
                # Two flips of one byte undo each other: compare the bytes.
                changed = {k for k in names if not torch.equal(before[k], raw_of(k))}
                await (await ckpt.save(step, state))
                prev, new = root / f"step_{step - 1}", root / f"step_{step}"
                for key in names:
                    if key in changed:
                        assert inode_of(prev, key) != inode_of(new, key), key
                    elif tensor_at(key).nbytes >= OWN:
                        assert inode_of(prev, key) == inode_of(new, key), key
                assert_equal_tree(asyncsave.load(new), state)

    anyio.run(run, backend=backend)


# -- growing (append-only) tensors ---------------------------------------------------
ROW = 1024  # float32 columns: 4 KiB rows


def entries_of(path: Path, key: str) -> list[dict[str, Any]]:
    m = manifest(path)
    rec = next(t for t in m["tensors"] if t["key"] == key)
    return [m["entries"][j] for j in rec.get("chunks", [rec["entry"]])]


@pytest.mark.anyio
async def test_a_growing_tensordict_writes_only_its_new_rows(tmp_path: Path) -> None:
    """A TensorDict replay buffer grows by 1 % per save: each save writes the new
    rows (and the small columns) only; every checkpoint loads whole with load,
    load_tensors, verify and the CLI, and safetensors readers see its rows."""
    from safetensors import safe_open
    from tensordict import TensorDict

    from asyncsave.testing import cli as cli_main

    n0, grow = 1000, 10
    rb = TensorDict({"obs": torch.randn(n0, ROW), "reward": torch.randn(n0)}, batch_size=[n0])
    async with asyncsave.Checkpointer(tmp_path, incremental=True) as ckpt:
        await (await ckpt.save(1, {"rb": rb}))
        for step in range(2, 6):
            new = TensorDict(
                {"obs": torch.randn(grow, ROW), "reward": torch.randn(grow)}, batch_size=[grow]
            )
            rb = torch.cat([rb, new])  # a new TensorDict: identity tells nothing
            await (await ckpt.save(step, {"rb": rb}))
            report = manifest(tmp_path / f"step_{step}")["incremental"]
            total = report["bytes_written"] + report["bytes_shared"]
            assert report["bytes_written"] <= 0.02 * total, report
    last = tmp_path / "step_5"
    obs_entries = entries_of(last, "rb/obs")
    # One chunk per save of new rows, each a file of its own (shared from then on).
    assert [e["nbytes"] // (4 * ROW) for e in obs_entries] == [n0] + [grow] * 4
    assert manifest(last)["format_version"] == 2
    out = asyncsave.load(last)["rb"]
    assert torch.equal(out["obs"], rb["obs"]) and torch.equal(out["reward"], rb["reward"])
    assert torch.equal(asyncsave.load_tensors(last, ["rb/obs"])["rb/obs"], rb["obs"])
    asyncsave.verify(last)
    assert cli_main(["verify", str(last)], out=open(os.devnull, "w")) == 0
    m = manifest(last)
    pieces = []
    for f in m["files"]:
        with safe_open(str(last / f["name"]), "pt") as st_file:
            pieces += [(k, st_file.get_tensor(k)) for k in st_file.keys() if k.startswith("rb/obs")]
    pieces.sort(
        key=lambda kv: 0 if "#rows=" not in kv[0] else int(kv[0].split("=")[1].split(":")[0])
    )
    assert torch.equal(torch.cat([t for _, t in pieces]), rb["obs"])


@pytest.mark.anyio
async def test_rewritten_shrunk_and_reordered_rows_are_written(tmp_path: Path) -> None:
    big = (2 * OWN) // (4 * ROW)  # rows per 2 MiB: every chunk is a file of its own
    buf = torch.randn(big, ROW)
    async with asyncsave.Checkpointer(tmp_path, incremental=True) as ckpt:
        await (await ckpt.save(1, {"rb": buf}))
        buf = torch.cat([buf, torch.randn(big, ROW)])
        await (await ckpt.save(2, {"rb": buf}))  # chunks [0, big), [big, 2 big)
        buf = torch.cat([buf, torch.randn(big, ROW)])
        buf[big + 3, 7] += 1.0  # a row of the second chunk is rewritten
        await (await ckpt.save(3, {"rb": buf}))
        s3 = tmp_path / "step_3"
        m3 = manifest(s3)
        assert m3["incremental"]["bytes_shared"] >= 2 * OWN  # the first chunk only
        assert [e["nbytes"] // (4 * ROW) for e in entries_of(s3, "rb")] == [big, big, big]
        assert_equal_tree(asyncsave.load(s3), {"rb": buf})
        buf = buf[torch.randperm(buf.shape[0])]  # reordered: every chunk changes
        await (await ckpt.save(4, {"rb": buf}))
        assert manifest(tmp_path / "step_4")["incremental"]["bytes_shared"] < OWN
        assert_equal_tree(asyncsave.load(tmp_path / "step_4"), {"rb": buf})
        buf = buf[: big // 2].clone()  # shrunk: one chunk, written whole
        await (await ckpt.save(5, {"rb": buf}))
    m5 = manifest(tmp_path / "step_5")
    assert m5["format_version"] == 1 and len(m5["entries"]) == 1
    assert m5["incremental"]["files_shared"] == 0
    assert_equal_tree(asyncsave.load(tmp_path / "step_5"), {"rb": buf})


@pytest.mark.anyio
async def test_retention_deletes_the_base_of_a_chunked_tensor(tmp_path: Path) -> None:
    rows = (2 * OWN) // (4 * ROW)
    buf = torch.randn(rows, ROW)
    async with asyncsave.Checkpointer(
        tmp_path, incremental=True, retention=asyncsave.KeepLast(1)
    ) as ckpt:
        for step in range(1, 5):
            buf = torch.cat([buf, torch.randn(rows, ROW)])
            await (await ckpt.save(step, {"rb": buf, "step": step}))
        assert await ckpt.update(4, "step", 40)  # update() keeps the chunks
    assert [p.name for p in tmp_path.glob("step_*")] == ["step_4"]
    assert len(entries_of(tmp_path / "step_4", "rb")) == 4
    asyncsave.verify(tmp_path / "step_4")
    assert_equal_tree(asyncsave.load(tmp_path / "step_4"), {"rb": buf, "step": 40})


@hsettings(max_examples=10, deadline=None)
@given(
    ops=st.lists(
        st.one_of(
            st.tuples(st.just("append"), st.integers(1, 300)),
            st.tuples(st.just("rewrite"), st.integers(0, 10**6)),
            st.tuples(st.just("shrink"), st.integers(1, 300)),
            st.tuples(st.just("same"), st.just(0)),
        ),
        min_size=1,
        max_size=5,
    ),
    backend=st.sampled_from(["asyncio", "trio"]),
)
def test_any_sequence_of_growth_and_edits_loads_bit_exact(
    tmp_path_factory: pytest.TempPathFactory, ops: list[tuple[str, int]], backend: str
) -> None:
    """Appends (of any size, so chunks over and under 1 MiB), single-byte
    rewrites anywhere, shrinks and unchanged saves: every checkpoint loads
    bit-exact (a changed chunk that were shared would load its old bytes)."""
    root = tmp_path_factory.mktemp("grow")
    buf = torch.randint(0, 255, (300, 4 * ROW), dtype=torch.uint8)

    async def run() -> None:
        nonlocal buf
        async with asyncsave.Checkpointer(root, incremental=True) as ckpt:
            await (await ckpt.save(1, {"rb": buf}))
            for step, (op, n) in enumerate(ops, start=2):
                if op == "append":
                    buf = torch.cat([buf, torch.randint(0, 255, (n, 4 * ROW), dtype=torch.uint8)])
                elif op == "rewrite":
                    buf.view(-1)[n % buf.numel()] ^= 0x5A
                elif op == "shrink":
                    buf = buf[: max(1, buf.shape[0] - n)].clone()
                await (await ckpt.save(step, {"rb": buf}))
                assert torch.equal(asyncsave.load(root / f"step_{step}")["rb"], buf)

    anyio.run(run, backend=backend)


@pytest.mark.parametrize(
    "edit",
    [
        lambda rec: {**rec, "chunks": [rec["entry"]]},  # one chunk is no chunking
        lambda rec: {**rec, "chunks": [rec["entry"], rec["entry"]]},
        lambda rec: {**rec, "chunks": [rec["chunks"][1], rec["chunks"][0]]},
        lambda rec: {**rec, "chunks": [*rec["chunks"][:1], 10**6]},
        lambda rec: {**rec, "shape": [rec["shape"][0] + 1, *rec["shape"][1:]]},
    ],
    ids=["single", "repeated", "reordered", "out-of-range", "wrong-size"],
)
def test_a_damaged_chunk_list_is_a_corrupt_checkpoint(tmp_path: Path, edit: Any) -> None:
    from asyncsave.testing import encode_manifest

    async def make() -> None:
        buf = torch.randn(OWN // (4 * ROW), ROW)
        async with asyncsave.Checkpointer(tmp_path, incremental=True) as ckpt:
            await (await ckpt.save(1, {"rb": buf}))
            await (await ckpt.save(2, {"rb": torch.cat([buf, buf])}))

    anyio.run(make)
    path = tmp_path / "step_2"
    doc = manifest(path)
    doc.pop("manifest_xxh3_64")
    doc["tensors"][0] = edit(doc["tensors"][0])
    (path / "manifest.json").write_bytes(encode_manifest(doc))
    with pytest.raises(asyncsave.CorruptCheckpointError):
        asyncsave.load(path)
    doc["tensors"][0] = manifest(tmp_path / "step_1")["tensors"][0] | {"chunks": [0, 1]}
    doc["format_version"] = 1  # chunks need format 2
    (path / "manifest.json").write_bytes(encode_manifest(doc))
    with pytest.raises(asyncsave.CorruptCheckpointError, match="chunks"):
        asyncsave.verify(path)


@pytest.mark.anyio
async def test_after_a_restart_a_growing_tensor_continues_its_chunks(tmp_path: Path) -> None:
    rows = (2 * OWN) // (4 * ROW)
    buf = torch.randn(rows, ROW)
    async with asyncsave.Checkpointer(tmp_path, incremental=True) as ckpt:
        await (await ckpt.save(1, {"rb": buf}))
        buf = torch.cat([buf, torch.randn(rows, ROW)])
        await (await ckpt.save(2, {"rb": buf}))
    async with asyncsave.Checkpointer(tmp_path, incremental=True) as ckpt:
        restored = await ckpt.load_latest()
        assert restored is not None
        buf = torch.cat([restored.state["rb"], torch.randn(rows // 2, ROW)])
        await (await ckpt.save(3, {"rb": buf}))
    s2, s3 = tmp_path / "step_2", tmp_path / "step_3"
    assert [e["nbytes"] for e in entries_of(s3, "rb")] == [2 * OWN, 2 * OWN, OWN]
    assert inode_of(s2, "rb") == inode_of(s3, "rb")  # the first chunk's file
    assert manifest(s3)["incremental"]["bytes_shared"] > 4 * OWN
    assert_equal_tree(asyncsave.load(s3), {"rb": buf})


@pytest.mark.anyio
@pytest.mark.parametrize("lazy", [False, True], ids=["eager", "lazy"])
async def test_files_equal_to_earlier_writes_are_linked_while_staging(
    tmp_path: Path, lazy: bool
) -> None:
    """From the second save on, unchanged files are linked before staging (their
    sources hashed in place); a tensor changed right after the snapshot (lazy:
    once ``staged()`` returned) never leaks into it. Retention deletes each base:
    the next save links from where the last one linked them."""
    state = lora_state()
    async with asyncsave.Checkpointer(
        tmp_path, incremental=True, retention=asyncsave.KeepLast(1)
    ) as ckpt:
        await (await ckpt.save(1, state, lazy=lazy))
        for step in (2, 3, 4):
            state["model"]["lora_A"].add_(1.0)
            handle = await ckpt.save(step, state, lazy=lazy)
            await handle.staged()
            expected = {k: v.clone() for k, v in state["model"].items()}
            state["model"]["base.2"][5] ^= 1  # after the snapshot: not in this step
            await handle
            state["model"]["base.2"][5] ^= 1  # back, bit-exact
            path = tmp_path / f"step_{step}"
            report = manifest(path)["incremental"]
            assert report["files_shared_at_staging"] == 3, report  # base.0, base.1, base.2
            assert_equal_tree(asyncsave.load(path)["model"], expected)
            asyncsave.verify(path)


@pytest.mark.anyio
async def test_a_streamed_save_is_written_in_full_and_says_so(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    state = lora_state()
    async with asyncsave.Checkpointer(tmp_path, incremental=True, budget_bytes=2 * OWN) as ckpt:
        for step in (1, 2):
            await (await ckpt.save(step, state))
    assert "incremental" not in manifest(tmp_path / "step_2")
    assert sum("streamed through budget_bytes" in r.getMessage() for r in caplog.records) == 1
    assert_equal_tree(asyncsave.load(tmp_path / "step_2"), state)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.anyio
async def test_cuda_tensors_are_shared_from_their_staged_bytes(tmp_path: Path) -> None:
    """CUDA tensors are hashed after the device-to-host copy (their bytes are not
    on the host before it): unchanged ones are shared at write time."""
    state = {"model": {k: v.cuda() for k, v in lora_state()["model"].items()}}
    async with asyncsave.Checkpointer(tmp_path, incremental=True) as ckpt:
        await (await ckpt.save(1, state))
        state["model"]["lora_A"].add_(1.0)
        await (await ckpt.save(2, state))
    s1, s2 = tmp_path / "step_1", tmp_path / "step_2"
    assert inode_of(s1, "model/base.0") == inode_of(s2, "model/base.0")
    assert manifest(s2)["incremental"]["files_shared"] == 3
    assert manifest(s2)["incremental"]["files_shared_at_staging"] == 0
    out = asyncsave.load(s2)["model"]
    assert_equal_tree(out, {k: v.cpu() for k, v in state["model"].items()})


@pytest.mark.anyio
async def test_what_is_remembered_stays_bounded_over_many_saves(tmp_path: Path) -> None:
    """A growing tensor has a new chunk (a new file header) at every save, and so
    has a small packed tensor that grows: the checkpointer remembers the files of
    the last save only, not one more per save."""
    buf, small = torch.randn(OWN // 4096, 1024), torch.zeros(1)
    async with asyncsave.Checkpointer(
        tmp_path, incremental=True, retention=asyncsave.KeepLast(1)
    ) as ckpt:
        for step in range(1, 13):
            buf, small = torch.cat([buf, torch.randn(4, 1024)]), torch.cat([small, small[:1]])
            await (await ckpt.save(step, {"rb": buf, "small": small}))
            files = len(manifest(tmp_path / f"step_{step}")["files"])
            remembered = ckpt._reuse.files._by_header, ckpt._reuse.files._known
            assert max(len(r) for r in remembered) <= files, (step, files)
    assert_equal_tree(asyncsave.load(tmp_path / "step_12"), {"rb": buf, "small": small})


@pytest.mark.anyio
@pytest.mark.parametrize("await_each", [False, True], ids=["overlapping", "awaited"])
async def test_reused_plans_keep_every_tensor_after_a_chunked_one(
    tmp_path: Path, await_each: bool
) -> None:
    """A grown tensor split into row chunks, then saves of the same structure
    (a reused plan), some still writing when the next one plans: every tensor
    after the chunked one keeps its own bytes (the records of a reused plan are
    shared with its template and with a save still writing its manifest; they
    must never be rewritten in place). Two trailing tensors of one size would
    load each other's bytes if their entries were shifted."""
    g = torch.Generator().manual_seed(3)
    big = torch.randint(0, 255, (OWN // 256, 256), generator=g, dtype=torch.uint8)
    state: dict[str, Any] = {
        "a_big": big,
        "b": torch.randn(10, generator=g),
        "c": torch.randn(10, generator=g),
        "d": torch.randn(20, generator=g),
    }
    expected: dict[int, dict[str, torch.Tensor]] = {}
    handles = []
    async with asyncsave.Checkpointer(tmp_path, incremental=True, retention=None) as ckpt:
        for step in range(1, 7):
            if step in (2, 5):  # grow: chunks from here on
                extra = torch.randint(0, 255, (7, 256), generator=g, dtype=torch.uint8)
                state["a_big"] = torch.cat([state["a_big"], extra])
            for k in ("b", "c", "d"):
                state[k].add_(step)
            expected[step] = {k: v.clone() for k, v in state.items()}
            handle = await ckpt.save(step, state)
            if await_each:
                await handle
            handles.append(handle)
        for handle in handles:
            await handle
    for step, want in expected.items():
        got = asyncsave.load(tmp_path / f"step_{step}")
        assert_equal_tree(got, want)
    assert any("chunks" in t for t in manifest(tmp_path / "step_6")["tensors"])


@pytest.mark.parametrize(
    ("options", "lazy"),
    [
        ({"incremental": True}, False),
        ({"incremental": True, "overlap_writes": True}, False),
        ({"incremental": True}, True),
        ({}, False),
        ({}, True),
        ({"overlap_writes": True}, False),
        ({"budget_bytes": 4096}, False),
    ],
)
def test_saves_leave_the_callers_storages_resizable(
    tmp_path: Path, options: dict[str, Any], lazy: bool
) -> None:
    """A save only reads the caller's tensors: afterwards every storage is as
    resizable as before, and ``resize_()`` works. (Incremental saves hashed the
    caller's bytes through ``.numpy()``, which marks a storage non-resizable for
    good: ``resize_()`` then failed and left the tensor with a shape its
    storage does not hold.)"""
    base = torch.randn(64)
    state = {
        "plain": torch.randn(300),
        "view": base[8:40],
        "param": torch.nn.Parameter(torch.randn(16)),
        "bf16": torch.randn(50).to(torch.bfloat16),
        "rows": torch.randn(40, 8),
    }
    with asyncsave.SyncCheckpointer(tmp_path, **options) as ckpt:
        for step in (1, 2, 3):
            state["plain"][0] = step  # one entry changed, the others linked
            ckpt.save(step, state, lazy=lazy).result()
    for key, t in state.items():
        assert t.untyped_storage().resizable(), key
    state["plain"].resize_(600)
    base.resize_(128)
    assert state["plain"].shape == (600,) and base.untyped_storage().nbytes() == 512
