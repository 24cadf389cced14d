"""asyncsave.lightning (issue 13, item 1): a real Lightning ``Trainer`` on CPU
saves through asyncsave (commit, tracker, retention, no pickle), ModelCheckpoint's
top-k removal deletes through asyncsave's retention, ``fit(ckpt_path=...)``
resumes, and a run SIGKILLed during a save resumes to the weights of an
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

import asyncsave
from asyncsave.lightning import AsyncsaveCheckpointIO, read_pointer

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


def test_fit_saves_through_asyncsave(tmp_path: Path, reference: dict[str, torch.Tensor]) -> None:
    model = app.fit(tmp_path, EPOCHS)
    assert _same(_weights(model), reference)  # saving changes nothing of training
    # ModelCheckpoint(save_top_k=2) removed steps 4 and 8 through asyncsave.
    assert [c.step for c in asyncsave.checkpoints(tmp_path)] == [12, 16]
    assert (tmp_path / "latest_checkpointed_iteration.txt").read_text() == "16"
    pointers = sorted(p.name for p in tmp_path.glob("*.ckpt"))
    assert pointers == ["epoch=2-step=12.ckpt", "epoch=3-step=16.ckpt", "last.ckpt"]
    assert read_pointer(tmp_path / "last.ckpt") == (tmp_path.resolve(), 16, "asyncsave")
    assert json.loads((tmp_path / "epoch=2-step=12.ckpt").read_text())["step"] == 12
    # No pickle anywhere: loads with allow_pickle=False; Lightning's entries as saved.
    ckpt = asyncsave.load_step(tmp_path, 16)
    assert ckpt["global_step"] == 16 and ckpt["epoch"] == EPOCHS - 1
    assert _same({k: v for k, v in ckpt["state_dict"].items()}, _weights(model))
    assert ckpt["hyper_parameters"] == {"lr": 0.05, "extra": None}
    assert isinstance(ckpt["optimizer_states"][0]["state"][0]["exp_avg"], torch.Tensor)
    assert any(k.startswith("ModelCheckpoint") for k in ckpt["callbacks"])
    assert "fit_loop" in ckpt["loops"]


def test_sigkill_during_a_save_resumes_to_the_uninterrupted_weights(
    tmp_path: Path, reference: dict[str, torch.Tensor]
) -> None:
    root, out = tmp_path / "ckpts", tmp_path / "crashed.pt"
    script = Path(app.__file__)
    cmd = [sys.executable, str(script), str(root), str(EPOCHS), str(out), "--kill-at", "12"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, cwd=script.parent)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-3000:]
    assert not out.exists()
    committed = [c.step for c in asyncsave.checkpoints(root)]
    assert 12 not in committed and committed[-1] == 8
    # The previous step's pointer was written before step 12 was staged; the
    # save in flight is named by no pointer.
    assert read_pointer(root / "last.ckpt")[1] == 8
    assert any(p.name.startswith(".asyncsave-tmp-12-") for p in root.iterdir())

    model = app.fit(root, EPOCHS, ckpt_path="last")
    assert _same(_weights(model), reference)
    assert [c.step for c in asyncsave.checkpoints(root)] == [12, 16]
    assert not any(p.name.startswith(".asyncsave-tmp-") for p in root.iterdir())


@pytest.mark.parametrize("where", ["root", "step_dir", "pointer"])
def test_fit_resumes_from_a_root_a_step_or_a_pointer(
    tmp_path: Path, reference: dict[str, torch.Tensor], where: str
) -> None:
    root = tmp_path / "ckpts"
    app.fit(root, 2)  # steps 4 and 8 committed
    path = {"root": root, "step_dir": root / "step_8", "pointer": root / "epoch=1-step=8.ckpt"}
    model = app.fit(root, EPOCHS, ckpt_path=str(path[where]))
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
    with pytest.raises(asyncsave.UnsafeLoadError):
        AsyncsaveCheckpointIO().load_checkpoint(root / "last.ckpt")


def test_load_checkpoint_refuses_what_it_did_not_write(tmp_path: Path) -> None:
    io = AsyncsaveCheckpointIO()
    torch.save({"state_dict": {}}, tmp_path / "torch.ckpt")
    with pytest.raises(asyncsave.UnsupportedFormatError, match="TorchCheckpointIO"):
        io.load_checkpoint(tmp_path / "torch.ckpt")
    with pytest.raises(FileNotFoundError):
        io.load_checkpoint(tmp_path / "missing.ckpt")
    (tmp_path / "empty").mkdir()
    with pytest.raises(asyncsave.CheckpointNotFoundError, match="no committed checkpoint"):
        io.load_checkpoint(tmp_path / "empty")
    with pytest.raises(TypeError, match="storage_options"):
        io.save_checkpoint({"global_step": 1}, tmp_path / "x.ckpt", storage_options={})


def test_pointers_of_the_last_run_keep_their_steps(tmp_path: Path) -> None:
    """Retention decides from the pointer files on disk too: a new run (a new
    plugin) that saves more never deletes what the last run's pointers name."""
    app.fit(tmp_path, 2, save_top_k=-1, monitor=None, save_last=False)
    assert [c.step for c in asyncsave.checkpoints(tmp_path)] == [4, 8]
    app.fit(tmp_path, 3, ckpt_path=str(tmp_path), save_top_k=1)
    steps = [c.step for c in asyncsave.checkpoints(tmp_path)]
    assert steps == [4, 8, 12], steps
    loaded: Any = AsyncsaveCheckpointIO().load_checkpoint(tmp_path / "epoch=0-step=4.ckpt")
    assert loaded["global_step"] == 4


def test_remove_checkpoint_follows_asyncsaves_deletion_rules(tmp_path: Path) -> None:
    """Without a Trainer: a removed pointer's step goes once nothing names it,
    never while it is the tracked (newest) step or another pointer names it."""
    io = AsyncsaveCheckpointIO()
    p = {name: tmp_path / f"{name}.ckpt" for name in ("a1", "b1", "a2", "a3")}

    def save(step: int, path: Path) -> None:
        io.save_checkpoint({"global_step": step, "w": torch.full((4,), float(step))}, path)

    save(1, p["a1"])
    save(1, p["b1"])  # a second pointer to step 1: saved once
    save(2, p["a2"])
    io.teardown()  # flushes: every pointer written
    assert [c.step for c in asyncsave.checkpoints(tmp_path)] == [1, 2]
    io.remove_checkpoint(p["a2"])  # step 2 is tracked: kept even with no pointer
    io.remove_checkpoint(p["a1"])  # step 1 still named by b1: kept
    assert not p["a2"].exists() and not p["a1"].exists()
    save(3, p["a3"])
    io.teardown()
    assert [c.step for c in asyncsave.checkpoints(tmp_path)] == [1, 3]  # 2 went after 3
    io.remove_checkpoint(p["b1"])
    io.teardown()
    assert [c.step for c in asyncsave.checkpoints(tmp_path)] == [3]
    assert io.load_checkpoint(p["a3"])["global_step"] == 3


class Color(enum.Enum):
    RED = 1


@pytest.mark.parametrize(
    ("entry", "value"),
    [
        (("callbacks", "MyCallback", "args"), argparse.Namespace(depth=3)),
        (("hyper_parameters", "colour"), Color.RED),
        (("hyper_parameters", "tags"), {"a", "b"}),
        (("callbacks", "MyCallback", "state"), Opaque(1)),
        (("loops", "fit_loop", "custom"), lambda: 0),
    ],
    ids=["namespace", "enum", "set", "callback-object", "loop-lambda"],
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
    assert info.value.key == "/".join(entry)
    assert asyncsave.checkpoints(tmp_path) == [] and not (tmp_path / "x.ckpt").exists()


def test_lightnings_dict_subclasses_are_stored_as_plain_dicts(tmp_path: Path) -> None:
    from lightning.fabric.utilities.data import AttributeDict

    io = AsyncsaveCheckpointIO()
    hparams = AttributeDict(lr=0.1, sizes=[1, 2], nested=AttributeDict(k="v"))
    io.save_checkpoint({"global_step": 1, "hyper_parameters": hparams}, tmp_path / "a.ckpt")
    io.teardown()
    loaded = io.load_checkpoint(tmp_path / "a.ckpt")
    assert loaded["hyper_parameters"] == {"lr": 0.1, "sizes": [1, 2], "nested": {"k": "v"}}


def test_no_path_points_at_a_step_whose_save_failed(tmp_path: Path) -> None:
    """The top-k path and ``last.ckpt`` of a step whose commit failed: neither is
    written; the failure is raised by ``teardown`` (and the next save)."""
    fs = FaultyFS("rename", raise_errno(errno.EIO), where=lambda p: p.endswith("step_2"))
    io = AsyncsaveCheckpointIO(filesystem=fs)
    for step, name in ((1, "a"), (2, "b"), (2, "last")):
        io.save_checkpoint({"global_step": step, "w": torch.ones(2)}, tmp_path / f"{name}.ckpt")
    with pytest.raises(asyncsave.SaveFailedError):
        io.teardown()
    assert read_pointer(tmp_path / "a.ckpt")[1] == 1
    assert not (tmp_path / "b.ckpt").exists() and not (tmp_path / "last.ckpt").exists()
    assert [c.step for c in asyncsave.checkpoints(tmp_path)] == [1]


def test_a_root_apart_from_the_pointers(tmp_path: Path, reference: dict[str, torch.Tensor]) -> None:
    """``root`` given: the checkpoints live there, ModelCheckpoint's ``.ckpt``
    pointers in its ``dirpath`` name them by a relative path."""
    store, ptrs = tmp_path / "store", tmp_path / "ptrs"
    app.fit(ptrs, 2, plugin=AsyncsaveCheckpointIO(store))
    assert [c.step for c in asyncsave.checkpoints(store)] == [4, 8]
    assert not list(ptrs.glob("step_*"))
    assert json.loads((ptrs / "last.ckpt").read_text())["root"] == "../store"
    model = app.fit(ptrs, EPOCHS, plugin=AsyncsaveCheckpointIO(store), ckpt_path="last")
    assert _same(_weights(model), reference)
    assert [c.step for c in asyncsave.checkpoints(store)] == [12, 16]


def test_a_second_run_into_the_same_directory_saves_its_own_state(tmp_path: Path) -> None:
    """A fit run again into the same dirpath without ckpt_path: its checkpoints
    hold its own weights (replacing the earlier run's at the same steps, with a
    CheckpointWarning), never pointers at the earlier run's data."""
    app.fit(tmp_path, EPOCHS)
    with pytest.warns(asyncsave.CheckpointWarning, match="did not resume from"):
        second = app.fit(tmp_path, EPOCHS, model=app.Tiny(lr=0.2))
    last = app.AsyncsaveCheckpointIO().load_checkpoint(tmp_path / "last.ckpt")
    assert _same({k: v for k, v in last["state_dict"].items()}, _weights(second))


def test_a_failed_open_leaves_the_plugin_closed_and_typed_next_time(tmp_path: Path) -> None:
    """The plugin's first save fails to open (``layout="verl"`` on a root of
    asyncsave-layout steps: a typed error naming the layout). Before (found in
    review), the checkpointer stayed half-open: the next save started a save and
    then raised a bare AssertionError. Now every try raises the same typed error,
    starts no save, and leaves the root unlocked."""
    with asyncsave.SyncCheckpointer(tmp_path) as ckpt:
        ckpt.save(1, {"w": torch.ones(8)}).result()
    io = AsyncsaveCheckpointIO(layout="verl")
    try:
        for _ in range(2):
            with pytest.raises(asyncsave.CheckpointNotFoundError, match="layout"):
                io.save_checkpoint({"global_step": 3, "w": torch.ones(3)}, tmp_path / "last.ckpt")
    finally:
        io.teardown()
    saved = [p.name for p in tmp_path.iterdir() if p.name.startswith(("step_", "global_step_"))]
    assert saved == ["step_1"]
    with asyncsave.SyncCheckpointer(tmp_path):  # the root's lock was released
        pass


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


@pytest.mark.parametrize("fails", ["listing the directory", "reading a pointer"])
def test_a_pointer_that_cannot_be_read_keeps_every_step(
    tmp_path: Path, pointer_fs: type[_PointerFS], fails: str
) -> None:
    """A pointer directory that cannot be listed, or a pointer file that cannot be
    read (EACCES, EIO), may name any step: that retention pass deletes nothing
    (before: it was skipped as if it named none, and its steps were deleted)."""
    io = AsyncsaveCheckpointIO()
    for step in (1, 2):
        io.save_checkpoint({"global_step": step, "w": torch.ones(4)}, tmp_path / f"s{step}.ckpt")
    io.teardown()
    error = (
        OSError(errno.EACCES, "Permission denied")
        if fails == "listing the directory"
        else OSError(errno.EIO, "Input/output error")
    )
    op = "listdir" if fails == "listing the directory" else "open_read"

    def deny(path: Path, what: str) -> None:
        if what == op and (Path(path) == tmp_path or Path(path).parent == tmp_path):
            raise error

    pointer_fs.deny = staticmethod(deny)
    io.remove_checkpoint(tmp_path / "s1.ckpt")  # step 1 is named by nothing now...
    io.save_checkpoint({"global_step": 3, "w": torch.ones(4)}, tmp_path / "s3.ckpt")
    io.teardown()
    assert [c.step for c in asyncsave.checkpoints(tmp_path)] == [1, 2, 3]  # ...but kept
    pointer_fs.deny = staticmethod(lambda path, what: None)
    io.save_checkpoint({"global_step": 4, "w": torch.ones(4)}, tmp_path / "s4.ckpt")
    io.teardown()
    assert [c.step for c in asyncsave.checkpoints(tmp_path)] == [2, 3, 4]  # readable again


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


def test_another_users_unreadable_file_beside_the_pointers_does_not_stop_retention(
    tmp_path: Path, pointer_fs: type[_PointerFS]
) -> None:
    """Review: a PermissionError on one foreign ``*.ckpt`` (another user's 0600
    torch.save file) must not make every retention pass keep everything."""
    (tmp_path / "theirs.ckpt").write_bytes(b"\x80\x02")

    def deny(path: Path, what: str) -> None:
        if what == "open_read" and Path(path).name == "theirs.ckpt":
            raise PermissionError(errno.EACCES, "Permission denied", str(path))

    pointer_fs.deny = staticmethod(deny)
    io = AsyncsaveCheckpointIO()
    for step in (1, 2):
        io.save_checkpoint({"global_step": step, "w": torch.ones(4)}, tmp_path / "s.ckpt")
        io.teardown()
    assert [c.step for c in asyncsave.checkpoints(tmp_path)] == [2]
