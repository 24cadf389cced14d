"""asyncsave.dcp.StorageWriter with FileSystemWriter's keywords, and the reader on
checkpoints in DCP's own format.

- every keyword of torch 2.13's ``FileSystemWriter`` is taken (by keyword; a
  ``bool`` after the root is a typed error that says so), and honoured:
  ``thread_count`` files written by as many threads at once,
  ``single_file_per_rank=False`` one file per item, ``overwrite`` a committed step
  replaced atomically (the tracker never moved back), ``_extensions`` DCP's stream
  transforms (``ZStandard``, a transform of the test's own) with a checksum over
  every stored file;
- ``save_id`` is public and the one in ``Metadata.storage_meta``;
- ``Metadata.version`` is DCP's, as ``FileSystemWriter`` records it;
- the refusal of an existing step says what DCP says;
- ``StorageReader`` reads a directory that ``FileSystemWriter`` wrote, compressed
  or not.
"""

from __future__ import annotations

import io
import sys
import threading
from pathlib import Path
from typing import IO, Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint._extension import (
    ExtensionRegistry,
    StreamTransformExtension,
    ZStandard,
)
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import SerializationFormat

import asyncsave
from asyncsave import LocalFileSystem
from asyncsave.dcp import StorageReader, StorageWriter

sys.path.insert(0, str(Path(__file__).parent))
from distributed import run_ranks, values

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")

TRACKER = "latest_checkpointed_iteration.txt"
MIB = 1 << 20


def state(value: float = 1.0) -> dict[str, Any]:
    return {
        "a": torch.full((64 * 1024,), value),
        "b": torch.arange(1000, dtype=torch.int64),
        "c": torch.full((3, 5), value, dtype=torch.bfloat16),
        "meta": {"step": int(value), "name": "run"},
    }


def blank() -> dict[str, Any]:
    return {
        "a": torch.zeros(64 * 1024),
        "b": torch.zeros(1000, dtype=torch.int64),
        "c": torch.zeros(3, 5, dtype=torch.bfloat16),
        "meta": {"step": -1, "name": ""},
    }


def assert_same(got: dict[str, Any], want: dict[str, Any]) -> None:
    for k in ("a", "b", "c"):
        assert torch.equal(got[k], want[k]), k
    assert got["meta"] == want["meta"]


def load_with(reader: Any) -> dict[str, Any]:
    out = blank()
    dcp.load(out, storage_reader=reader, no_dist=True)
    return out


def leftovers(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir() if p.name.startswith(".asyncsave-tmp-"))


def data_files(path: Path) -> list[str]:
    return sorted(p.name for p in path.iterdir() if p.name not in {".metadata", "manifest.json"})


# -- keywords ---------------------------------------------------------------------


def test_every_filesystem_writer_keyword_is_taken_and_the_save_round_trips(
    tmp_path: Path,
) -> None:
    writer = StorageWriter(
        tmp_path,
        3,
        single_file_per_rank=True,
        sync_files=False,
        thread_count=2,
        per_thread_copy_ahead=0,
        cache_staged_state_dict=True,
        overwrite=False,
        _extensions=None,
        serialization_format=SerializationFormat.SAFETENSORS,
    )
    dcp.save(state(3.0), storage_writer=writer, no_dist=True)
    assert_same(load_with(StorageReader(tmp_path)), state(3.0))
    assert asyncsave.verify(tmp_path / "step_3").step == 3


def test_a_bool_after_the_root_is_an_invalid_step_naming_the_keyword(tmp_path: Path) -> None:
    # FileSystemWriter(path, False) is single_file_per_rank=False; here the
    # argument after the root is the step.
    with pytest.raises(asyncsave.InvalidStepError, match="single_file_per_rank=False"):
        StorageWriter(tmp_path, False)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("keyword", "value", "error"),
    [
        ("thread_count", 0, ValueError),
        ("thread_count", 2.0, TypeError),
        ("per_thread_copy_ahead", -1, ValueError),
        ("overwrite", "yes", TypeError),
        ("sync_files", 1, TypeError),
        ("single_file_per_rank", None, TypeError),
        ("cache_staged_state_dict", 0, TypeError),
        ("serialization_format", "torch_save", TypeError),
        ("_extensions", [object()], TypeError),
        ("_extensions", "zstd", TypeError),
    ],
)
def test_a_bad_keyword_is_a_typed_error_naming_it(
    tmp_path: Path, keyword: str, value: Any, error: type[Exception]
) -> None:
    with pytest.raises(error, match=keyword):
        StorageWriter(tmp_path, 1, **{keyword: value})


class _ThreadsMeeting(LocalFileSystem):
    """The first write of each of the first ``n`` threads that write waits until
    all ``n`` are in flight at once: sequential writes break the barrier
    (``BrokenBarrierError`` after its bound), parallel ones pass it."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.n = n
        self.barrier = threading.Barrier(n, timeout=30.0)
        self.threads: set[int] = set()
        self.first: set[int] = set()
        self.guard = threading.Lock()

    def write(self, fd: int, data: memoryview) -> int:
        me = threading.get_ident()
        with self.guard:
            first = me not in self.first and len(self.first) < self.n
            if first:
                self.first.add(me)
            self.threads.add(me)
        if first:
            self.barrier.wait()
        return super().write(fd, data)


def test_thread_count_writes_that_many_files_on_that_many_threads_at_once(
    tmp_path: Path,
) -> None:
    fs = _ThreadsMeeting(3)
    big = {f"t{i}": torch.full((MIB // 4,), float(i)) for i in range(6)}
    dcp.save(big, storage_writer=StorageWriter(tmp_path, 1, filesystem=fs, thread_count=3))
    assert len(fs.threads) == 4  # three writers, then the commit's thread
    files = data_files(tmp_path / "step_1")
    assert len(files) == 3 and all(f.endswith(".safetensors") for f in files)
    out = {k: torch.zeros_like(v) for k, v in big.items()}
    dcp.load(out, storage_reader=StorageReader(tmp_path), no_dist=True)
    assert all(torch.equal(out[k], big[k]) for k in big)


def test_one_file_per_item_without_single_file_per_rank(tmp_path: Path) -> None:
    saved = state(2.0)
    dcp.save(
        saved, storage_writer=StorageWriter(tmp_path, 2, single_file_per_rank=False), no_dist=True
    )
    # a, b, c and the one byte item DCP makes of "meta"'s two plain values
    assert len(data_files(tmp_path / "step_2")) == 5
    assert_same(load_with(StorageReader(tmp_path)), saved)


# -- overwrite and the refusal --------------------------------------------------------


def test_without_overwrite_an_existing_step_is_refused_in_dcps_words(tmp_path: Path) -> None:
    dcp.save(state(1.0), storage_writer=StorageWriter(tmp_path, 1), no_dist=True)
    with pytest.raises(
        CheckpointException, match=r"Checkpoint already exists and self\.overwrite=False"
    ):
        dcp.save(state(9.0), storage_writer=StorageWriter(tmp_path, 1), no_dist=True)
    assert_same(load_with(StorageReader(tmp_path)), state(1.0))
    assert leftovers(tmp_path) == []


class _SeesExchange(LocalFileSystem):
    def __init__(self) -> None:
        super().__init__()
        self.exchanged: list[tuple[str, str]] = []

    def exchange(self, a: Path, b: Path) -> None:
        self.exchanged.append((Path(a).name, Path(b).name))
        super().exchange(a, b)


def test_overwrite_replaces_a_committed_step_by_an_atomic_exchange(tmp_path: Path) -> None:
    dcp.save(state(1.0), storage_writer=StorageWriter(tmp_path, 1), no_dist=True)
    dcp.save(state(2.0), storage_writer=StorageWriter(tmp_path, 2), no_dist=True)
    fs = _SeesExchange()
    writer = StorageWriter(tmp_path, 1, overwrite=True, filesystem=fs)
    dcp.save(state(7.0), storage_writer=writer, no_dist=True)
    # the root's commit protocol swapped the new directory in (RENAME_EXCHANGE)
    assert [b for _, b in fs.exchanged] == ["step_1"]
    assert_same(load_with(StorageReader(tmp_path / "step_1")), state(7.0))
    assert (tmp_path / TRACKER).read_text().strip() == "2"  # never moved back
    assert leftovers(tmp_path) == []
    assert asyncsave.verify(tmp_path / "step_1").step == 1


def test_overwrite_of_a_step_that_does_not_exist_commits_it(tmp_path: Path) -> None:
    dcp.save(state(4.0), storage_writer=StorageWriter(tmp_path, 4, overwrite=True), no_dist=True)
    assert_same(load_with(StorageReader(tmp_path)), state(4.0))


# -- save_id ----------------------------------------------------------------------------


def test_save_id_is_public_recorded_in_storage_meta_and_fresh_per_save(tmp_path: Path) -> None:
    writer = StorageWriter(tmp_path, 1)
    first = writer.save_id
    assert first == writer.save_id  # fixed for the save about to begin
    dcp.save(state(1.0), storage_writer=writer, no_dist=True)
    assert writer.save_id == first  # after the save: the save's (as FileSystemWriter)
    meta = StorageReader(tmp_path).read_metadata()
    assert meta.storage_meta is not None
    assert meta.storage_meta.save_id == first
    assert meta.storage_meta.checkpoint_id == str(tmp_path / "step_1")
    writer.step = 2
    dcp.save(state(2.0), storage_writer=writer, no_dist=True)
    second = StorageReader(tmp_path).read_metadata().storage_meta
    assert second is not None and second.save_id == writer.save_id != first


def test_metadata_records_dcps_version_as_filesystem_writer_does(tmp_path: Path) -> None:
    """``Metadata.version`` (DCP's format version, "1.0.0" on torch 2.13) is what a
    load planner sees, with asyncsave's commit as with ``FileSystemWriter``, for
    plain saves and saves through DCP's stream transforms."""
    dcp.save(state(1.0), storage_writer=FileSystemWriter(tmp_path / "dcp"), no_dist=True)
    expected = FileSystemReader(tmp_path / "dcp").read_metadata().version
    assert expected is not None
    dcp.save(state(1.0), storage_writer=StorageWriter(tmp_path / "plain", 1), no_dist=True)
    zstd = StorageWriter(tmp_path / "zstd", 1, _extensions=[ZStandard()])
    dcp.save(state(1.0), storage_writer=zstd, no_dist=True)
    for root in (tmp_path / "plain", tmp_path / "zstd"):
        planner = dcp.DefaultLoadPlanner()
        dcp.load(blank(), storage_reader=StorageReader(root), planner=planner, no_dist=True)
        assert planner.metadata is not None and planner.metadata.version == expected, root


# -- stream transforms (_extensions) -----------------------------------------------------


def test_zstandard_compresses_commits_and_loads_with_both_readers(tmp_path: Path) -> None:
    zeros = {"z": torch.zeros(MIB), "meta": {"k": 1}}  # 4 MiB of zeros
    writer = StorageWriter(tmp_path, 5, _extensions=[ZStandard()])
    dcp.save(zeros, storage_writer=writer, no_dist=True)
    final = tmp_path / "step_5"
    files = data_files(final)
    assert files and all(f.endswith(".distcp") for f in files)
    assert sum((final / f).stat().st_size for f in files) < 64 * 1024
    assert (tmp_path / TRACKER).read_text().strip() == "5"
    assert asyncsave.verify(final).step == 5  # the manifest and .metadata
    for reader in (StorageReader(tmp_path), FileSystemReader(final)):
        out = {"z": torch.ones(MIB), "meta": {"k": 0}}
        dcp.load(out, storage_reader=reader, no_dist=True)
        assert torch.equal(out["z"], zeros["z"]) and out["meta"] == {"k": 1}


def test_dcps_reader_cannot_read_asyncsaves_own_files_as_the_guide_says(tmp_path: Path) -> None:
    """Without _extensions the files are asyncsave's safetensors files: DCP's
    FileSystemReader stops on them (the several-ranks guide quotes the error),
    and StorageReader reads them. Fails once torch reads them, so the guide is
    rewritten then."""
    dcp.save(state(2.0), storage_writer=StorageWriter(tmp_path, 3), no_dist=True)
    with pytest.raises(CheckpointException, match="relative_path"):
        dcp.load(blank(), storage_reader=FileSystemReader(tmp_path / "step_3"), no_dist=True)
    out = blank()
    dcp.load(out, storage_reader=StorageReader(tmp_path), no_dist=True)
    assert torch.equal(out["a"], state(2.0)["a"])


def test_inspect_of_a_dcp_save_of_plain_tensors_does_not_call_them_dtensors(
    tmp_path: Path,
) -> None:
    from asyncsave.testing import cli

    dcp.save(state(), storage_writer=StorageWriter(tmp_path, 4), no_dist=True)
    out = io.StringIO()
    assert cli(["inspect", str(tmp_path / "step_4")], out=out) == 0
    assert "written through torch.distributed.checkpoint" in out.getvalue()
    assert "DTensor" not in out.getvalue()


def test_safetensors_serialization_with_a_stream_transform_is_refused(tmp_path: Path) -> None:
    # DCP's FileSystemWriter writes such files, and its reader cannot read them.
    with pytest.raises(ValueError, match="serialization_format=SAFETENSORS with _extensions"):
        StorageWriter(
            tmp_path,
            1,
            _extensions=[ZStandard()],
            serialization_format=SerializationFormat.SAFETENSORS,
        )
    StorageWriter(tmp_path, 1, serialization_format=SerializationFormat.SAFETENSORS)


def test_a_changed_byte_of_a_compressed_file_is_a_checksum_error(tmp_path: Path) -> None:
    dcp.save(
        state(1.0),
        storage_writer=StorageWriter(tmp_path, 1, _extensions=[ZStandard()]),
        no_dist=True,
    )
    final = tmp_path / "step_1"
    target = final / data_files(final)[0]
    raw = bytearray(target.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    target.write_bytes(bytes(raw))
    with pytest.raises(CheckpointException, match="do not match their checksum"):
        load_with(StorageReader(tmp_path))


class _Xor(StreamTransformExtension):
    """A stream transform of the test's own: every byte XOR 0x5A."""

    @staticmethod
    def registry_name() -> str:
        return "test.xor"

    @staticmethod
    def from_descriptor(version: str) -> _Xor:
        return _Xor()

    def get_descriptor(self) -> str:
        return f"{self.registry_name()}/1"

    def transform_to(self, output: IO[bytes]) -> IO[bytes]:
        class Writer(io.RawIOBase):
            def writable(self) -> bool:
                return True

            def write(self, b: Any) -> int:
                data = bytes(x ^ 0x5A for x in bytes(b))
                output.write(data)
                return len(data)

        return Writer()  # type: ignore[return-value]

    def transform_from(self, input: IO[bytes]) -> IO[bytes]:
        return io.BytesIO(bytes(x ^ 0x5A for x in input.read()))


def test_a_stream_transform_of_ones_own_applies_and_its_registry_reads_it(
    tmp_path: Path,
) -> None:
    saved = {"w": torch.arange(16.0), "blob": {"x": [1, 2]}}
    dcp.save(saved, storage_writer=StorageWriter(tmp_path, 1, _extensions=[_Xor()]), no_dist=True)
    final = tmp_path / "step_1"
    stored = b"".join((final / f).read_bytes() for f in data_files(final))
    assert torch.arange(16.0).numpy().tobytes() not in stored  # transformed on disk
    registry = ExtensionRegistry()
    registry.register(_Xor)
    out = {"w": torch.zeros(16), "blob": {"x": []}}
    dcp.load(
        out, storage_reader=StorageReader(tmp_path, _extension_registry=registry), no_dist=True
    )
    assert torch.equal(out["w"], saved["w"]) and out["blob"] == {"x": [1, 2]}


def test_zstandard_without_collectives_on_one_process_commits(tmp_path: Path) -> None:
    # Each rank plans alone then (DCP still asks the writer for the global plan
    # of this rank's one plan, which carries DCP's file prefix).
    saved = state(6.0)
    writer = StorageWriter(tmp_path, 6, _extensions=[ZStandard()])
    dcp.save(saved, storage_writer=writer, use_collectives=False, no_dist=True)
    assert_same(load_with(StorageReader(tmp_path)), saved)


class _DiskFullOnWrite(_Xor):
    """A transform whose output stream fails as a full disk does."""

    def transform_to(self, output: IO[bytes]) -> IO[bytes]:
        class Writer(io.RawIOBase):
            def writable(self) -> bool:
                return True

            def write(self, b: Any) -> int:
                raise OSError(28, "No space left on device (injected)")

        return Writer()  # type: ignore[return-value]


def test_a_failed_compressed_write_leaves_no_directory_and_keeps_the_last_step(
    tmp_path: Path,
) -> None:
    dcp.save(state(1.0), storage_writer=StorageWriter(tmp_path, 1), no_dist=True)
    writer = StorageWriter(tmp_path, 2, _extensions=[_DiskFullOnWrite()])
    with pytest.raises(CheckpointException, match="No space left on device"):
        dcp.save(state(2.0), storage_writer=writer, no_dist=True)
    assert not (tmp_path / "step_2").exists()
    assert leftovers(tmp_path) == []
    assert (tmp_path / TRACKER).read_text().strip() == "1"
    assert_same(load_with(StorageReader(tmp_path)), state(1.0))


class _DiskFullOffMainThread(_Xor):
    """A transform whose output fails as a full disk does, in DCP's extra writer
    threads only (``thread_count > 1``): torch's ``FileSystemWriter`` loses such a
    thread's exception and returns the results of the other threads."""

    def transform_to(self, output: IO[bytes]) -> IO[bytes]:
        inner = super().transform_to(output)
        if threading.current_thread() is threading.main_thread():
            return inner

        class Writer(io.RawIOBase):
            def writable(self) -> bool:
                return True

            def write(self, b: Any) -> int:
                raise OSError(28, "No space left on device (injected, writer thread)")

        return Writer()  # type: ignore[return-value]


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_a_compressed_write_failing_in_a_writer_thread_commits_nothing(tmp_path: Path) -> None:
    # Before: the failed thread's items had no write result, and the save
    # committed a checkpoint without them (its load failed on a missing item).
    dcp.save(state(1.0), storage_writer=StorageWriter(tmp_path, 1), no_dist=True)
    writer = StorageWriter(tmp_path, 2, _extensions=[_DiskFullOffMainThread()], thread_count=2)
    with pytest.raises(CheckpointException, match="no write result"):
        dcp.save(state(2.0), storage_writer=writer, no_dist=True)
    assert not (tmp_path / "step_2").exists()
    assert leftovers(tmp_path) == []
    assert (tmp_path / TRACKER).read_text().strip() == "1"


def _zstd_on_two_ranks(rank: int, world: int, root: str) -> bool:
    dcp.save(
        {f"w{rank}": torch.full((1000,), float(rank + 1)), "shared": torch.ones(4)},
        storage_writer=StorageWriter(root, 1, _extensions=[ZStandard()], thread_count=2),
    )
    return True


@pytest.mark.slow
def test_two_ranks_zstandard_save_commits_one_directory_both_readers_load(
    tmp_path: Path,
) -> None:
    root = tmp_path / "run"
    assert values(run_ranks(_zstd_on_two_ranks, 2, tmp_path, str(root))) == [True, True]
    final = root / "step_1"
    assert {f.split("_")[2] for f in data_files(final)} == {"0", "1"}  # __<rank>_<n>
    for reader in (StorageReader(root), FileSystemReader(final)):
        out = {"w0": torch.zeros(1000), "w1": torch.zeros(1000), "shared": torch.zeros(4)}
        dcp.load(out, storage_reader=reader, no_dist=True)
        assert torch.equal(out["w1"], torch.full((1000,), 2.0))
        assert torch.equal(out["w0"], torch.ones(1000))
    assert leftovers(root) == []


# -- reading what FileSystemWriter wrote ---------------------------------------------------


@pytest.mark.parametrize("extensions", [None, [ZStandard()]], ids=["plain", "zstd"])
def test_reader_reads_a_directory_filesystem_writer_wrote(tmp_path: Path, extensions: Any) -> None:
    saved = state(5.0)
    dcp.save(
        saved,
        storage_writer=FileSystemWriter(tmp_path / "fsw", _extensions=extensions),
        no_dist=True,
    )
    reader = StorageReader(tmp_path / "fsw")
    assert_same(load_with(reader), saved)
    meta = reader.read_metadata()
    assert meta.storage_meta is not None and meta.storage_meta.load_id == reader.load_id


def test_a_root_holding_only_filesystem_writer_directories_is_not_resolved(
    tmp_path: Path,
) -> None:
    dcp.save(state(1.0), storage_writer=FileSystemWriter(tmp_path / "fsw"), no_dist=True)
    with pytest.raises(asyncsave.CheckpointNotFoundError, match="no committed checkpoint"):
        StorageReader(tmp_path).read_metadata()
