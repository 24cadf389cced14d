"""asyncsave.lightning: a real Lightning ``Trainer`` on CPU writes ``.ckpt``
files that Lightning's ``load_from_checkpoint`` and ``torch.load(weights_only=True)``
read without the plugin, ``fit(ckpt_path=...)`` resumes (also from what the
previous release wrote: pointers, step directories, roots), a damaged file is a
checksum error, and a run SIGKILLed while writing resumes to the weights of an
uninterrupted run, bit for bit."""

from __future__ import annotations

import argparse
import enum
import errno
import json
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any, ClassVar

# lightning is in the dev extra: a missing install fails here, loudly, not skipped.
import lightning_app as app
import pytest
import torch
from faults import FaultyFS, raise_errno
from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import ModelCheckpoint

import asyncsave
from asyncsave.lightning import POINTER_FORMAT, AsyncsaveCheckpointIO, read_pointer, verify_ckpt

pytestmark = pytest.mark.slow
EPOCHS = 4
STEPS = EPOCHS * app.BATCHES_PER_EPOCH


class Opaque:
    """Not plain data: a hyper-parameter only pickle can store."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Opaque) and other.n == self.n


def _weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[str, torch.Tensor]:
    """The weights of an uninterrupted run of EPOCHS epochs."""
    return _weights(app.fit(tmp_path_factory.mktemp("reference"), EPOCHS))


def _files(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


def test_fit_writes_ckpt_files_that_lightning_and_torch_load(
    tmp_path: Path, reference: dict[str, torch.Tensor]
) -> None:
    model = app.fit(tmp_path, EPOCHS)
    assert _same(_weights(model), reference)  # saving changes nothing of training
    # The .ckpt files are the checkpoints: nothing else beside them (no step
    # directories, no tracker, no temporary file); top-k removed steps 4 and 8.
    assert _files(tmp_path) == ["epoch=2-step=12.ckpt", "epoch=3-step=16.ckpt", "last.ckpt"]
    ckpt = torch.load(tmp_path / "last.ckpt", weights_only=True)
    assert ckpt["global_step"] == 16 and ckpt["epoch"] == EPOCHS - 1
    assert _same(dict(ckpt["state_dict"]), _weights(model))
    assert ckpt["hyper_parameters"] == {"lr": 0.05, "extra": None}
    assert isinstance(ckpt["optimizer_states"][0]["state"][0]["exp_avg"], torch.Tensor)
    assert any(k.startswith("ModelCheckpoint") for k in ckpt["callbacks"])
    assert "fit_loop" in ckpt["loops"]
    assert torch.load(tmp_path / "epoch=2-step=12.ckpt", weights_only=True)["global_step"] == 12
    # Lightning's own loader, without the plugin, and a copy elsewhere.
    loaded = app.Tiny.load_from_checkpoint(tmp_path / "last.ckpt")
    assert _same(_weights(loaded), _weights(model)) and loaded.hparams.lr == 0.05
    copied = tmp_path.parent / "copied.ckpt"
    copied.write_bytes((tmp_path / "last.ckpt").read_bytes())
    assert _same(_weights(app.Tiny.load_from_checkpoint(copied)), _weights(model))
    verify_ckpt(tmp_path / "last.ckpt")  # every record matches its CRC-32


def test_sigkill_during_a_save_resumes_to_the_uninterrupted_weights(
    tmp_path: Path, reference: dict[str, torch.Tensor]
) -> None:
    root, out = tmp_path / "ckpts", tmp_path / "crashed.pt"
    script = Path(app.__file__)
    cmd = [sys.executable, str(script), str(root), str(EPOCHS), str(out), "--kill-at", "12"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, cwd=script.parent)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-3000:]
    assert not out.exists()
    # Killed half-way through writing step 12's file: last.ckpt still holds
    # step 8, whole; step 12's new path is its pending placeholder.
    assert torch.load(root / "last.ckpt", weights_only=True)["global_step"] == 8
    verify_ckpt(root / "last.ckpt")
    with pytest.raises(asyncsave.CheckpointNotFoundError, match="had not committed") as info:
        AsyncsaveCheckpointIO().load_checkpoint(root / "epoch=2-step=12.ckpt")
    assert info.value.step == 12
    assert any(p.name.startswith(".asyncsave-tmp-epoch=2-step=12.ckpt-") for p in root.iterdir())

    model = app.fit(root, EPOCHS, ckpt_path="last")
    assert _same(_weights(model), reference)
    assert torch.load(root / "last.ckpt", weights_only=True)["global_step"] == 16


def test_two_callbacks_and_a_prune_leave_every_ckpt_whole(tmp_path: Path) -> None:
    """The user report: with two ``ModelCheckpoint`` callbacks the "best" folder
    held pointers into the other's, and ``asyncsave prune --keep-last 1`` on the
    root deleted what the best pointer named. Now each folder holds its own
    files, and a prune of either deletes none of them."""
    import io as text

    from asyncsave.testing import cli

    torch.manual_seed(0)
    trainer = Trainer(
        max_epochs=3,
        accelerator="cpu",
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        plugins=[AsyncsaveCheckpointIO()],
        callbacks=[
            ModelCheckpoint(dirpath=tmp_path / "all", save_top_k=-1, monitor=None),
            ModelCheckpoint(dirpath=tmp_path / "best", monitor="train_loss", save_top_k=1),
        ],
    )
    trainer.fit(app.Tiny())
    assert _files(tmp_path / "all") == [f"epoch={e}-step={4 * e + 4}.ckpt" for e in range(3)]
    (best,) = _files(tmp_path / "best")
    for folder in ("all", "best"):
        assert cli(["prune", str(tmp_path / folder), "--keep-last", "1"], out=text.StringIO()) == 0
    for path in [*(tmp_path / "all").glob("*.ckpt"), tmp_path / "best" / best]:
        verify_ckpt(path)
        assert "state_dict" in torch.load(path, weights_only=True)


def _legacy_root(root: Path, state: dict[str, Any]) -> None:
    """What the previous release left: ``state`` as the asyncsave checkpoint of
    its global step under ``root`` and a JSON pointer ``last.ckpt`` naming it."""
    with asyncsave.SyncCheckpointer(root, save_step_zero=True) as ckpt:
        ckpt.save(state["global_step"], state).result()
    doc = {"format": POINTER_FORMAT, "root": ".", "layout": "asyncsave"}
    (root / "last.ckpt").write_text(json.dumps({**doc, "step": state["global_step"]}))


@pytest.mark.parametrize("where", ["ckpt", "legacy-pointer", "legacy-step-dir", "legacy-root"])
def test_fit_resumes_from_a_ckpt_and_from_what_the_previous_release_wrote(
    tmp_path: Path, reference: dict[str, torch.Tensor], where: str
) -> None:
    root = tmp_path / "ckpts"
    app.fit(root, 2)  # steps 4 and 8
    path = root / "epoch=1-step=8.ckpt"
    if where != "ckpt":
        legacy = tmp_path / "legacy"
        _legacy_root(legacy, torch.load(path, weights_only=True))
        path = {
            "legacy-pointer": legacy / "last.ckpt",
            "legacy-step-dir": legacy / "step_8",
            "legacy-root": legacy,
        }[where]
    model = app.fit(tmp_path / "resumed", EPOCHS, ckpt_path=str(path))
    assert _same(_weights(model), reference)


def test_an_entry_that_is_not_plain_data_is_named(tmp_path: Path) -> None:
    with pytest.raises(asyncsave.UnsupportedTypeError, match="allow_pickle") as info:
        app.fit(tmp_path / "a", 1, model=app.Tiny(extra=Opaque(3)))
    assert info.value.key == "hyper_parameters/extra"
    assert "hyper_parameters/extra" in str(info.value)

    root = tmp_path / "b"
    app.fit(
        root, 1, plugin=AsyncsaveCheckpointIO(allow_pickle=True), model=app.Tiny(extra=Opaque(3))
    )
    loaded = AsyncsaveCheckpointIO(allow_pickle=True).load_checkpoint(root / "last.ckpt")
    assert loaded["hyper_parameters"]["extra"] == Opaque(3)
    with pytest.raises(asyncsave.UnsafeLoadError, match="allow_pickle"):
        AsyncsaveCheckpointIO().load_checkpoint(root / "last.ckpt")


def test_load_checkpoint_reads_torch_files_and_refuses_others(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Lightning's own ``TorchCheckpointIO`` writes the same format: it loads
    (the previous release refused it; its own files were pointers then)."""
    io = AsyncsaveCheckpointIO()
    torch.save({"state_dict": {"w": torch.ones(2)}}, tmp_path / "torch.ckpt")
    assert torch.equal(
        io.load_checkpoint(tmp_path / "torch.ckpt")["state_dict"]["w"], torch.ones(2)
    )
    (tmp_path / "notes.ckpt").write_text("not a checkpoint")
    with pytest.raises(asyncsave.UnsupportedFormatError, match="not a checkpoint pointer"):
        io.load_checkpoint(tmp_path / "notes.ckpt")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(FileNotFoundError, match=r"Checkpoint file not found: missing\.ckpt$"):
        io.load_checkpoint("missing.ckpt")  # named as given, as Lightning's own IO
    (tmp_path / "empty").mkdir()
    with pytest.raises(asyncsave.CheckpointNotFoundError, match="no committed checkpoint"):
        io.load_checkpoint(tmp_path / "empty")
    with pytest.raises(TypeError, match="storage_options"):
        io.save_checkpoint({"global_step": 1}, tmp_path / "x.ckpt", storage_options={})


def test_a_damaged_ckpt_is_a_checksum_error_naming_the_record(tmp_path: Path) -> None:
    """torch.load does not check the CRC-32s its writer records; the plugin
    does: one flipped byte in a tensor's record is named, never loaded."""
    io = AsyncsaveCheckpointIO()
    path = tmp_path / "a.ckpt"
    io.save_checkpoint({"global_step": 1, "w": torch.arange(4096.0)}, path)
    io.teardown()
    raw = bytearray(path.read_bytes())
    at = raw.index(torch.arange(4096.0)[1000:1002].numpy().tobytes())
    raw[at] ^= 0xFF
    path.write_bytes(bytes(raw))
    with pytest.raises(asyncsave.ChecksumMismatchError) as info:
        io.load_checkpoint(path)
    assert info.value.key is not None and info.value.key.endswith("data/0")
    assert torch.load(path, weights_only=True)["w"][1000] != 1000.0  # torch alone loads it


class Color(enum.Enum):
    RED = 1


@pytest.mark.parametrize(
    ("entry", "value"),
    [
        (("callbacks", "MyCallback", "args"), argparse.Namespace(depth=3)),
        (("hyper_parameters", "colour"), Color.RED),
        (("hyper_parameters", "span"), slice(1, 2)),
        (("callbacks", "MyCallback", "state"), Opaque(1)),
        (("loops", "fit_loop", "custom"), lambda: 0),
    ],
    ids=["namespace", "enum", "slice", "callback-object", "loop-lambda"],
)
def test_each_entry_that_is_not_plain_data_is_named(
    tmp_path: Path, entry: tuple[str, ...], value: Any
) -> None:
    checkpoint: dict[str, Any] = {"global_step": 2, "state_dict": {"w": torch.ones(2)}}
    node = checkpoint
    for key in entry[:-1]:
        node = node.setdefault(key, {})
    node[entry[-1]] = value
    io = AsyncsaveCheckpointIO()
    try:
        with pytest.raises(asyncsave.UnsupportedTypeError, match="allow_pickle") as info:
            io.save_checkpoint(checkpoint, tmp_path / "x.ckpt")
    finally:
        io.teardown()
    assert info.value.key == "/".join(entry) and info.value.step == 2
    assert list(tmp_path.iterdir()) == []  # refused while staging: nothing written


def test_lightnings_dict_subclasses_are_stored_as_plain_dicts(tmp_path: Path) -> None:
    from lightning.fabric.utilities.data import AttributeDict

    io = AsyncsaveCheckpointIO()
    hparams = AttributeDict(lr=0.1, sizes=[1, 2], nested=AttributeDict(k="v"))
    io.save_checkpoint({"global_step": 1, "hyper_parameters": hparams}, tmp_path / "a.ckpt")
    io.teardown()
    loaded = io.load_checkpoint(tmp_path / "a.ckpt")
    assert loaded["hyper_parameters"] == {"lr": 0.1, "sizes": [1, 2], "nested": {"k": "v"}}


def test_a_failed_write_leaves_the_previous_file_and_no_new_one(tmp_path: Path) -> None:
    """A write that fails at its rename: an existing path keeps its previous
    checkpoint whole, a new path's placeholder goes, no temporary file stays;
    the failure is raised by ``teardown`` (and would be by the next save)."""
    # The 2nd replace onto b.ckpt: the 1st creates its placeholder.
    fs = FaultyFS("replace", raise_errno(errno.EIO), n=2, where=lambda p: Path(p).name == "b.ckpt")
    io = AsyncsaveCheckpointIO(filesystem=fs)
    io.save_checkpoint({"global_step": 1, "w": torch.ones(2)}, tmp_path / "a.ckpt")
    io.wait()
    io.save_checkpoint({"global_step": 2, "w": torch.zeros(2)}, tmp_path / "b.ckpt")
    with pytest.raises(asyncsave.SaveFailedError, match=r"b\.ckpt") as info:
        io.teardown()
    assert isinstance(info.value.__cause__, OSError) and info.value.step == 2
    assert _files(tmp_path) == ["a.ckpt"]

    fs2 = FaultyFS("replace", raise_errno(errno.EIO), where=lambda p: Path(p).name == "a.ckpt")
    io2 = AsyncsaveCheckpointIO(filesystem=fs2)
    io2.save_checkpoint({"global_step": 3, "w": torch.zeros(2)}, tmp_path / "a.ckpt")
    with pytest.raises(asyncsave.SaveFailedError):
        io2.wait()
    io2.teardown()
    assert _files(tmp_path) == ["a.ckpt"]
    assert torch.equal(io2.load_checkpoint(tmp_path / "a.ckpt")["w"], torch.ones(2))


def test_root_is_accepted_and_unused_with_a_warning(tmp_path: Path) -> None:
    """The previous release kept its step directories under ``root``; now each
    ``.ckpt`` is the checkpoint, so ``root`` only warns."""
    with pytest.warns(asyncsave.CheckpointWarning, match="unused"):
        io = AsyncsaveCheckpointIO(tmp_path / "store")
    io.save_checkpoint({"global_step": 1, "w": torch.ones(2)}, tmp_path / "ptrs" / "a.ckpt")
    io.teardown()
    assert _files(tmp_path) == ["ptrs"] and _files(tmp_path / "ptrs") == ["a.ckpt"]


def test_a_second_run_into_the_same_directory_saves_its_own_state(
    tmp_path: Path, reference: dict[str, torch.Tensor]
) -> None:
    """A fit run again into the same dirpath without ckpt_path: as with
    Lightning's own IO, ModelCheckpoint versions the names it finds taken
    (``last-v1.ckpt``), which hold the second run's weights; the first run's
    files keep its own (the previous release replaced its step directories)."""
    app.fit(tmp_path, EPOCHS)
    second = app.fit(tmp_path, EPOCHS, model=app.Tiny(lr=0.2))
    io = AsyncsaveCheckpointIO()
    assert _same(
        dict(io.load_checkpoint(tmp_path / "last-v1.ckpt")["state_dict"]), _weights(second)
    )
    assert _same(dict(io.load_checkpoint(tmp_path / "last.ckpt")["state_dict"]), reference)


def test_a_refused_save_leaves_the_plugin_usable(tmp_path: Path) -> None:
    """A save refused while staging (an entry that is not plain data) writes
    nothing and leaves nothing half-done: the next save of the same step works."""
    io = AsyncsaveCheckpointIO()
    try:
        with pytest.raises(asyncsave.UnsupportedTypeError):
            io.save_checkpoint(
                {"global_step": 3, "w": torch.ones(3), "x": Opaque(1)}, tmp_path / "a.ckpt"
            )
        io.save_checkpoint({"global_step": 3, "w": torch.ones(3)}, tmp_path / "a.ckpt")
    finally:
        io.teardown()
    assert torch.equal(io.load_checkpoint(tmp_path / "a.ckpt")["w"], torch.ones(3))


class _PointerFS(asyncsave.LocalFileSystem):
    """The I/O layer the plugin reads its pointer directories through, with one
    fault: ``deny(path, op)`` raises for the paths it picks (``op``: "listdir" or
    "open_read"); reads counted per path."""

    deny: Any = staticmethod(lambda path, op: None)
    reads: ClassVar[dict[str, list[int]]] = {}

    def listdir(self, path: Path) -> list[str]:
        self.deny(path, "listdir")
        return super().listdir(path)

    def open_read(self, path: Path) -> Any:
        self.deny(path, "open_read")
        f = super().open_read(path)
        counts = self.reads.setdefault(Path(path).name, [])

        class Counting:
            def __enter__(self) -> Any:
                return self

            def __exit__(self, *exc: Any) -> None:
                f.close()

            def read(self, n: int = -1) -> bytes:
                data = f.read(n)
                counts.append(len(data or b""))
                return data or b""

        return Counting()


@pytest.fixture
def pointer_fs(monkeypatch: pytest.MonkeyPatch) -> type[_PointerFS]:
    """The plugin's pointer I/O (only the plugin's: asyncsave's own recovery
    lists the root too) through :class:`_PointerFS`."""
    import asyncsave.lightning as plugin

    class FS(_PointerFS):
        reads: ClassVar[dict[str, list[int]]] = {}

    monkeypatch.setattr(plugin, "LocalFileSystem", FS)
    return FS


def test_a_large_foreign_ckpt_beside_the_pointers_is_not_read_whole(
    tmp_path: Path, pointer_fs: type[_PointerFS]
) -> None:
    import asyncsave.lightning as plugin

    big = tmp_path / "lightning-own.ckpt"
    big.write_bytes(b"\x80\x02" + b"\0" * (8 << 20))  # a torch.save-like file, 8 MiB
    with pytest.raises(asyncsave.UnsupportedFormatError):
        read_pointer(big)
    reads = pointer_fs.reads[big.name]
    assert reads and sum(reads) <= plugin._MAX_POINTER_BYTES + 1 < big.stat().st_size, reads
