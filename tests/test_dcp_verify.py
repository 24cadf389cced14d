"""Checkpoints written by ``asyncsave.dcp.StorageWriter`` with DCP's stream
transforms (``_extensions=[ZStandard()]``): their data files are DCP's own
(``dcp_files`` in the manifest, a checksum over the stored bytes), and every
reader of the manifest's file list (verify, sizes, listings, tier copies, adopt,
retention) treats them as the checkpoint's files.
"""

from __future__ import annotations

import contextlib
import io
import json
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import fsspec
import pytest
import torch
import torch.distributed.checkpoint as dcp
from distributed import run_ranks, values
from torch.distributed.checkpoint._extension import ZStandard

import asyncsave
from asyncsave import ChecksumMismatchError, CorruptCheckpointError
from asyncsave.dcp import StorageReader, StorageWriter
from asyncsave.testing import cli, encode_manifest

TRACKER = "latest_checkpointed_iteration.txt"
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


def state(value: float) -> dict[str, Any]:
    return {
        "a": torch.full((64 * 1024,), value),
        "b": torch.arange(1000, dtype=torch.int64),
        "meta": {"step": int(value)},
    }


def compressed_save(root: Path, step: int, value: float = 1.0, **kw: Any) -> Path:
    writer = StorageWriter(root, step, _extensions=[ZStandard()], **kw)
    dcp.save(state(value), storage_writer=writer, no_dist=True)
    return root / f"step_{step}"


def dcp_files(path: Path) -> list[str]:
    doc = json.loads((path / "manifest.json").read_bytes())
    return [f["name"] for f in doc["dcp_files"]]


def stored_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.iterdir())


def loads_back(root: Path, value: float) -> None:
    out = {
        "a": torch.zeros(64 * 1024),
        "b": torch.zeros(1000, dtype=torch.int64),
        "meta": {"step": -1},
    }
    dcp.load(out, storage_reader=StorageReader(root), no_dist=True)
    assert torch.equal(out["a"], state(value)["a"]) and out["meta"] == {"step": int(value)}


def flip(path: Path) -> None:
    raw = bytearray(path.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    path.write_bytes(bytes(raw))


# -- verify -------------------------------------------------------------------------


def test_verify_hashes_every_compressed_file_and_reports_their_bytes(tmp_path: Path) -> None:
    final = compressed_save(tmp_path, 1)
    names = dcp_files(final)
    assert names and all(n.endswith(".distcp") for n in names)
    seen: list[int] = []
    info = asyncsave.verify(final, progress=seen.append)
    assert info.step == 1
    # Every stored byte beside the manifest is hashed once: the compressed files
    # and .metadata.
    assert sum(seen) == stored_bytes(final) - (final / "manifest.json").stat().st_size


def test_a_flipped_byte_of_a_compressed_file_fails_verify_naming_it(tmp_path: Path) -> None:
    final = compressed_save(tmp_path, 1)
    target = final / dcp_files(final)[0]
    flip(target)  # same size: only the checksum finds it
    with pytest.raises(ChecksumMismatchError, match="do not match their checksum") as err:
        asyncsave.verify(final)
    assert err.value.path == str(target)


def test_a_missing_compressed_file_fails_verify_naming_it(tmp_path: Path) -> None:
    final = compressed_save(tmp_path, 1)
    target = final / dcp_files(final)[0]
    target.unlink()
    with pytest.raises(CorruptCheckpointError, match="is missing") as err:
        asyncsave.verify(final)
    assert err.value.path == str(target)


def test_a_truncated_compressed_file_fails_verify_naming_it(tmp_path: Path) -> None:
    final = compressed_save(tmp_path, 1)
    target = final / dcp_files(final)[0]
    target.write_bytes(target.read_bytes()[:-1])
    with pytest.raises(CorruptCheckpointError, match="truncated or altered") as err:
        asyncsave.verify(final)
    assert err.value.path == str(target)


def test_a_flipped_byte_of_dot_metadata_fails_verify(tmp_path: Path) -> None:
    final = compressed_save(tmp_path, 1)
    flip(final / ".metadata")
    with pytest.raises(ChecksumMismatchError) as err:
        asyncsave.verify(final)
    assert err.value.path == str(final / ".metadata")


@pytest.mark.parametrize(
    "edit, field",
    [
        (lambda d: d["dcp_files"][0].update(name="../x.distcp"), "dcp_files[0]"),
        (lambda d: d["dcp_files"][0].update(nbytes=-1), "dcp_files[0].nbytes"),
        (lambda d: d["dcp_files"][0].update(xxh3_64="zz"), "dcp_files[0].xxh3_64"),
        (lambda d: d.update(dcp_files={}), "dcp_files is not a list"),
        (lambda d: d["dcp_metadata"].update(name="m"), "dcp_metadata"),
        (lambda d: d["dcp_files"].append(dict(d["dcp_files"][0])), "repeats"),
    ],
    ids=["unsafe-name", "size", "digest", "not-a-list", "metadata-name", "repeated"],
)
def test_a_damaged_dcp_files_record_is_a_corrupt_manifest_naming_the_field(
    tmp_path: Path, edit: Any, field: str
) -> None:
    final = compressed_save(tmp_path, 1)
    doc = json.loads((final / "manifest.json").read_bytes())
    doc.pop("manifest_xxh3_64")
    edit(doc)
    (final / "manifest.json").write_bytes(encode_manifest(doc))  # re-signed: only the field
    with pytest.raises(CorruptCheckpointError, match="damaged manifest") as err:
        asyncsave.verify(final)
    assert field in str(err.value)


# -- sizes and the command line -----------------------------------------------------


def test_listing_size_counts_the_compressed_files_and_metadata(tmp_path: Path) -> None:
    final = compressed_save(tmp_path, 1)
    (info,) = asyncsave.checkpoints(tmp_path)
    assert info.size_bytes == stored_bytes(final)
    assert asyncsave.verify(final).size_bytes == stored_bytes(final)
    latest = asyncsave.latest(tmp_path)
    assert latest is not None and latest.size_bytes == stored_bytes(final)


def test_cli_verify_inspect_and_ls_on_a_compressed_save(tmp_path: Path) -> None:
    final = compressed_save(tmp_path, 1)
    out = io.StringIO()
    assert cli(["verify", "--no-progress", str(final)], out=out) == 0
    assert "ok" in out.getvalue() and " 0 B verified" not in out.getvalue()
    out = io.StringIO()
    assert cli(["inspect", str(final)], out=out) == 0
    assert "torch.distributed.checkpoint" in out.getvalue() and "a" in out.getvalue()
    assert "0 B" not in out.getvalue()  # no entries: the size shown is as stored
    out = io.StringIO()
    assert cli(["ls", str(tmp_path)], out=out) == 0
    assert "step_1" in out.getvalue() and "NOT LOADABLE" not in out.getvalue()
    assert " 0 B" not in out.getvalue() and "size as stored" in out.getvalue()
    flip(final / dcp_files(final)[0])
    out = io.StringIO()
    assert cli(["verify", "--no-progress", str(final)], out=out) == 1
    assert "FAIL" in out.getvalue() and dcp_files(final)[0] in out.getvalue()


# -- tiers, retention, prune, adopt -------------------------------------------------


def same_files(a: Path, b: Path) -> None:
    names = sorted(p.name for p in a.iterdir())
    assert names == sorted(p.name for p in b.iterdir() if p.name != "commit_success.txt")
    for n in names:
        assert (a / n).read_bytes() == (b / n).read_bytes(), n


def test_a_compressed_save_left_locally_is_persisted_whole_and_verifies_there(
    tmp_path: Path,
) -> None:
    local, remote = tmp_path / "local", tmp_path / "remote"
    compressed_save(local, 1, 1.0)
    with asyncsave.SyncCheckpointer(local, persistent=asyncsave.Tier(remote)):
        pass  # opening persists the committed local step an earlier run left
    same_files(local / "step_1", remote / "step_1")
    info = asyncsave.verify(remote / "step_1")
    assert info.size_bytes == stored_bytes(remote / "step_1")
    assert (remote / TRACKER).read_text().strip() == "1"
    loads_back(remote, 1.0)


def test_a_damaged_compressed_save_left_locally_is_not_persisted(tmp_path: Path) -> None:
    local, remote = tmp_path / "local", tmp_path / "remote"
    final = compressed_save(local, 1, 1.0)
    flip(final / dcp_files(final)[0])
    with asyncsave.SyncCheckpointer(local, persistent=asyncsave.Tier(remote)):
        pass
    assert not (remote / "step_1").exists()


def test_retention_removes_compressed_saves_whole(tmp_path: Path) -> None:
    for step in (1, 2, 3):
        compressed_save(tmp_path, step, float(step))
    with asyncsave.SyncCheckpointer(tmp_path, retention=asyncsave.KeepLast(2)) as ckpt:
        ckpt.save(4, {"x": torch.ones(3)}).result()
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("step_")) == [
        "step_3",
        "step_4",
    ]
    asyncsave.verify(tmp_path / "step_3")
    loads_back(tmp_path / "step_3", 3.0)


def test_prune_removes_compressed_saves_whole_and_keeps_the_rest_verifying(
    tmp_path: Path,
) -> None:
    for step in (1, 2, 3):
        compressed_save(tmp_path, step, float(step))
    out = io.StringIO()
    assert cli(["prune", str(tmp_path), "--keep-last", "1"], out=out) == 0
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("step_")) == ["step_3"]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".asyncsave-")]
    asyncsave.verify(tmp_path / "step_3")
    loads_back(tmp_path, 3.0)


def test_adopt_verifies_the_compressed_files(tmp_path: Path) -> None:
    final = compressed_save(tmp_path, 1)
    assert asyncsave.adopt(final).size_bytes == stored_bytes(final)
    flip(final / dcp_files(final)[0])
    with pytest.raises(ChecksumMismatchError):
        asyncsave.adopt(final)


# -- object-store roots (fsspec memory://) -------------------------------------------


@pytest.fixture
def memory_root() -> Iterator[tuple[Any, str]]:
    mem = fsspec.filesystem("memory")
    name = f"/asyncsave-dcpv-{uuid.uuid4().hex[:12]}"
    yield mem, name
    with contextlib.suppress(FileNotFoundError):
        mem.rm(name, recursive=True)


def test_a_compressed_save_persisted_to_an_object_store_verifies_and_sizes_there(
    tmp_path: Path, memory_root: tuple[Any, str]
) -> None:
    mem, name = memory_root
    local = tmp_path / "local"
    final = compressed_save(local, 1, 1.0)
    with asyncsave.SyncCheckpointer(local, persistent=asyncsave.Tier(f"memory://{name}")):
        pass
    for n in [*dcp_files(final), ".metadata"]:
        assert mem.cat_file(f"{name}/step_1/{n}") == (final / n).read_bytes(), n
    info = asyncsave.verify(f"memory://{name}/step_1")
    assert info.size_bytes == sum(mem.size(p) for p in mem.find(f"{name}/step_1"))
    (listed,) = asyncsave.checkpoints(f"memory://{name}")
    assert listed.size_bytes == info.size_bytes
    target = f"{name}/step_1/{dcp_files(final)[0]}"
    raw = bytearray(mem.cat_file(target))
    raw[len(raw) // 2] ^= 0xFF
    mem.pipe_file(target, bytes(raw))
    with pytest.raises(ChecksumMismatchError, match=dcp_files(final)[0]):
        asyncsave.verify(f"memory://{name}/step_1")
    mem.rm_file(target)
    with pytest.raises(CorruptCheckpointError, match="is missing"):
        asyncsave.verify(f"memory://{name}/step_1")


def test_adopt_on_an_object_store_checks_every_compressed_file(
    tmp_path: Path, memory_root: tuple[Any, str]
) -> None:
    mem, name = memory_root
    final = compressed_save(tmp_path, 1)
    for p in final.iterdir():  # copied file by file, as a sync tool does: no marker
        mem.pipe_file(f"{name}/step_1/{p.name}", p.read_bytes())
    target = f"{name}/step_1/{dcp_files(final)[0]}"
    good = mem.cat_file(target)
    mem.pipe_file(target, good[:-1] + bytes([good[-1] ^ 1]))
    with pytest.raises(ChecksumMismatchError):
        asyncsave.adopt(f"memory://{name}/step_1")
    assert not mem.exists(f"{name}/step_1/commit_success.txt")
    mem.pipe_file(target, good)
    info = asyncsave.adopt(f"memory://{name}/step_1")
    assert info.step == 1 and mem.exists(f"{name}/step_1/commit_success.txt")
    assert info.size_bytes == sum(mem.size(p) for p in mem.find(f"{name}/step_1"))


@pytest.mark.parametrize("url", ["memory://dcpv/run", "s3://bucket/run"])
@pytest.mark.parametrize("extensions", [None, [ZStandard()]], ids=["plain", "zstd"])
def test_a_url_root_of_the_dcp_writer_is_refused_and_nothing_is_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, url: str, extensions: Any
) -> None:
    # It was written, tracker and all, to a local directory named "memory:".
    monkeypatch.chdir(tmp_path)
    with pytest.raises(asyncsave.CheckpointError, match="is a URL") as err:
        StorageWriter(url, 1, _extensions=extensions)
    assert url in str(err.value)
    assert list(tmp_path.iterdir()) == []


def test_a_file_url_root_of_the_dcp_writer_is_the_local_path(tmp_path: Path) -> None:
    writer = StorageWriter(f"file://{tmp_path}", 2, _extensions=[ZStandard()])
    dcp.save(state(2.0), storage_writer=writer, no_dist=True)
    asyncsave.verify(tmp_path / "step_2")
    loads_back(tmp_path, 2.0)


# -- incremental saves and update() ---------------------------------------------------


def test_an_incremental_save_after_a_compressed_one_is_written_whole(tmp_path: Path) -> None:
    # Nothing is shared with DCP's files (they are no safetensors files): the
    # incremental save stands alone once the compressed step is gone.
    compressed_save(tmp_path, 1, 1.0)
    options = asyncsave.CheckpointOptions(incremental=True, retention=asyncsave.KeepLast(1))
    with asyncsave.SyncCheckpointer(tmp_path, options=options) as ckpt:
        ckpt.save(2, state(1.0)).result()
    assert not (tmp_path / "step_1").exists()
    final = tmp_path / "step_2"
    assert all(p.stat().st_nlink == 1 for p in final.iterdir())
    assert asyncsave.verify(final).nbytes == 64 * 1024 * 4 + 1000 * 8
    assert torch.equal(asyncsave.load(final)["a"], state(1.0)["a"])


def test_update_of_a_compressed_save_this_run_did_not_write_is_refused(tmp_path: Path) -> None:
    final = compressed_save(tmp_path, 1, 1.0)
    before = {p.name: p.read_bytes() for p in final.iterdir()}

    async def go() -> None:
        async with asyncsave.Checkpointer(tmp_path) as ckpt:
            with pytest.raises(asyncsave.ProtectedCheckpointError):
                await ckpt.update(1, "a", torch.zeros(3))

    anyio.run(go)
    assert {p.name: p.read_bytes() for p in final.iterdir()} == before


def _update_a_dcp_save(rank: int, world: int, root: str) -> str:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    w = distribute_tensor(torch.arange(8.0), mesh, [Shard(0)])

    async def go() -> str:
        async with asyncsave.Checkpointer(root) as ckpt:
            await (await ckpt.save(1, {"w": w}))
            try:
                await ckpt.update(1, "w", torch.zeros(8))
            except asyncsave.UnsupportedFormatError as exc:
                return str(exc)
            return "updated"

    return anyio.run(go)


@pytest.mark.slow
def test_update_of_a_dcp_save_is_refused_naming_why(tmp_path: Path) -> None:
    root = tmp_path / "run"
    (said,) = values(run_ranks(_update_a_dcp_save, 1, tmp_path, str(root), timeout_s=300))
    assert "torch.distributed.checkpoint" in said and "overwrite=True" in said
    asyncsave.verify(root / "step_1")
