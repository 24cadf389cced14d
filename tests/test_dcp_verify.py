"""Checkpoints written by ``asyncsave.dcp.StorageWriter`` with DCP's stream
transforms (``_extensions=[ZStandard()]``): their data files are DCP's own
(``dcp_files`` in the manifest, a checksum over the stored bytes), and every
reader of the manifest's file list (verify, sizes, listings, tier copies, adopt,
retention) treats them as the checkpoint's files.
"""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
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
    out = {"a": torch.zeros(64 * 1024), "b": torch.zeros(1000, dtype=torch.int64), "meta": {}}
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
    out = io.StringIO()
    assert cli(["ls", str(tmp_path)], out=out) == 0
    assert "step_1" in out.getvalue() and "NOT LOADABLE" not in out.getvalue()
    flip(final / dcp_files(final)[0])
    out = io.StringIO()
    assert cli(["verify", "--no-progress", str(final)], out=out) == 1
    assert "FAIL" in out.getvalue() and dcp_files(final)[0] in out.getvalue()
