"""asyncsave.lightning from a user's report: names never shared by two saves, one
merge rule for ``options=`` and keywords (and nothing written for a save that did
not happen), URL dirpaths, Hydra-style hyper-parameters, staging (a save returns
before its write and training may change the tensors), and the plugin's lifecycle
(pickling, ``wait()``, nothing left open after ``teardown``). A real ``Trainer``
on CPU; the two-process runs are marked slow."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import errno
import json
import pickle
import threading
import time
import uuid
import warnings
from collections.abc import Iterator
from io import BytesIO
from pathlib import Path
from typing import Any

import lightning_app as app
import pytest
import torch
from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import ModelCheckpoint

import asyncsave
from asyncsave.lightning import (
    PENDING_FORMAT,
    AsyncsaveCheckpointIO,
    plugin_options,
    verify_ckpt,
)
from asyncsave.testing import FaultyFileSystem, block, pause


def _trainer(dirpath: Any, epochs: int, plugin: AsyncsaveCheckpointIO, **kw: Any) -> Trainer:
    return Trainer(
        max_epochs=epochs,
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=True,
        plugins=[plugin],
        callbacks=[ModelCheckpoint(dirpath=dirpath, **kw)],
    )


def _threads() -> set[threading.Thread]:
    return set(threading.enumerate())


def _no_new_threads(before: set[threading.Thread], timeout_s: float = 10.0) -> bool:
    """Whether every thread started since ``before`` is gone (anyio's idle worker
    threads leave shortly after their event loop stops: polled, bounded)."""
    deadline = time.monotonic() + timeout_s
    while not _threads() <= before:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def _named(name: str) -> Any:
    return lambda path: Path(path).name == name


def _step(path: Any) -> int:
    """The global step of the ``.ckpt`` at ``path`` (torch alone, weights only)."""
    if "://" in str(path):
        import fsspec

        with fsspec.open(str(path), "rb") as f:
            return int(torch.load(f, weights_only=True)["global_step"])
    return int(torch.load(path, weights_only=True)["global_step"])


# -- names ---------------------------------------------------------------------
def test_no_two_saves_share_a_name(tmp_path: Path) -> None:
    """A filename without the step (``"model"``): Lightning versions it
    (``model-v1.ckpt``) when the name is taken. A new path is created (pending)
    before ``save_checkpoint`` returns, so the second save gets its own name and
    neither checkpoint is lost (before the pending mark: both saves were named
    ``model.ckpt``). Step 4's commit (the 2nd replace onto ``model.ckpt``; the
    1st is its placeholder) is held for 2 s, so that step 8 is named while step
    4's write is still in flight."""
    torch.manual_seed(0)
    held = FaultyFileSystem(
        "replace", pause(threading.Event(), 2.0), n=2, where=_named("model.ckpt")
    )
    trainer = _trainer(
        tmp_path,
        2,
        AsyncsaveCheckpointIO(filesystem=held),
        filename="model",
        save_top_k=-1,
        monitor="step",
        mode="max",
    )
    trainer.fit(app.Tiny())
    assert held.fired.is_set()
    assert _step(tmp_path / "model.ckpt") == 4
    assert _step(tmp_path / "model-v1.ckpt") == 8


def test_a_new_path_exists_when_save_returns_and_wait_makes_it_loadable(tmp_path: Path) -> None:
    io = AsyncsaveCheckpointIO()
    try:
        io.save_checkpoint({"global_step": 3, "w": torch.ones(4)}, tmp_path / "a.ckpt")
        assert (tmp_path / "a.ckpt").exists()  # ModelCheckpoint.file_exists sees it
        io.wait()
        assert torch.equal(torch.load(tmp_path / "a.ckpt", weights_only=True)["w"], torch.ones(4))
        assert torch.equal(io.load_checkpoint(tmp_path / "a.ckpt")["w"], torch.ones(4))
    finally:
        io.teardown()


def test_a_pending_file_whose_save_never_committed_is_a_typed_error(tmp_path: Path) -> None:
    """What a run stopped mid-save leaves at a new path: loading it names the
    step instead of loading something else."""
    (tmp_path / "x.ckpt").write_text(json.dumps({"format": PENDING_FORMAT, "global_step": 7}))
    with pytest.raises(asyncsave.CheckpointNotFoundError, match="had not committed") as info:
        AsyncsaveCheckpointIO().load_checkpoint(tmp_path / "x.ckpt")
    assert info.value.step == 7


def test_verify_ckpt_of_a_pending_file_names_its_step(tmp_path: Path) -> None:
    """verify_ckpt of a placeholder (a save not yet whole, or one a killed run
    left) says so and names the step, as loading it does, instead of calling the
    file no torch checkpoint."""
    (tmp_path / "x.ckpt").write_text(json.dumps({"format": PENDING_FORMAT, "global_step": 9}))
    with pytest.raises(asyncsave.CheckpointNotFoundError, match="had not committed") as info:
        verify_ckpt(tmp_path / "x.ckpt")
    assert info.value.step == 9
    assert "wait() returns once it is whole" in str(info.value)  # read before wait()
    (tmp_path / "y.ckpt").write_text("{}")
    with pytest.raises(asyncsave.UnsupportedFormatError, match="not a torch zip"):
        verify_ckpt(tmp_path / "y.ckpt")


def test_a_pending_pointer_of_the_previous_release_is_a_typed_error(tmp_path: Path) -> None:
    doc = {"format": "asyncsave-lightning-pointer", "root": ".", "layout": "asyncsave"}
    (tmp_path / "x.ckpt").write_text(json.dumps({**doc, "step": 7, "pending": True}))
    with pytest.raises(asyncsave.CheckpointNotFoundError, match="had not committed") as info:
        AsyncsaveCheckpointIO().load_checkpoint(tmp_path / "x.ckpt")
    assert info.value.step == 7


def test_a_failed_save_removes_the_pending_pointer_it_created(tmp_path: Path) -> None:
    from faults import FaultyFS, raise_errno

    # The 2nd replace onto b.ckpt (its commit; the 1st creates the placeholder).
    fs = FaultyFS("replace", raise_errno(5), n=2, where=_named("b.ckpt"))
    io = AsyncsaveCheckpointIO(filesystem=fs)
    io.save_checkpoint({"global_step": 2, "w": torch.ones(2)}, tmp_path / "b.ckpt")
    assert (tmp_path / "b.ckpt").exists()
    with pytest.raises(asyncsave.SaveFailedError):
        io.teardown()
    assert list(tmp_path.iterdir()) == []  # nor its temporary file


# -- staging -------------------------------------------------------------------
def _held(name: str) -> tuple[FaultyFileSystem, threading.Event]:
    """An I/O layer that holds the write of the checkpoint into ``name``'s
    temporary file until the returned event is set (the 2nd write there: the
    1st is the pending placeholder of a new path, written before the save
    returns)."""
    go = threading.Event()
    fs = FaultyFileSystem(
        "write", pause(go, 30.0), n=2, where=lambda p: f".asyncsave-tmp-{name}-" in Path(p).name
    )
    return fs, go


def _pending(path: Path) -> bool:
    """Whether ``path`` holds the placeholder of a save not yet written (read
    directly: ``load_checkpoint`` would wait for the write)."""
    try:
        return bool(json.loads(path.read_bytes()).get("format") == PENDING_FORMAT)
    except (ValueError, UnicodeDecodeError):
        return False


def test_a_save_returns_once_staged_and_keeps_the_values_of_that_moment(tmp_path: Path) -> None:
    """``save_checkpoint`` returns while its write is held (the path is still
    the pending placeholder); the caller then changes the tensor in place, as
    ``optimizer.step()`` does; the file holds the values of the save."""
    fs, go = _held("a.ckpt")
    io = AsyncsaveCheckpointIO(filesystem=fs)
    w = torch.arange(1000.0)
    try:
        io.save_checkpoint({"global_step": 1, "w": w}, tmp_path / "a.ckpt")
        assert _pending(tmp_path / "a.ckpt")
        w.mul_(-1)
        go.set()
        io.wait()
    finally:
        go.set()
        io.teardown()
    assert fs.fired.is_set()
    assert torch.equal(
        torch.load(tmp_path / "a.ckpt", weights_only=True)["w"], torch.arange(1000.0)
    )


def test_paths_saved_at_one_step_share_unchanged_tensors_and_keep_their_own_entries(
    tmp_path: Path,
) -> None:
    """The top-k file and ``last.ckpt`` at one global step: the second save,
    made while the first write is held, has its own plain entries; a tensor
    unchanged since the first save is the same staged copy, one changed in
    place in between is staged anew (the first file keeps the old values)."""
    fs, go = _held("a.ckpt")
    io = AsyncsaveCheckpointIO(filesystem=fs)
    same, changed = torch.ones(64), torch.zeros(64)
    try:
        io.save_checkpoint(
            {"global_step": 5, "same": same, "changed": changed, "who": "a"}, tmp_path / "a.ckpt"
        )
        changed.add_(7)
        io.save_checkpoint(
            {"global_step": 5, "same": same, "changed": changed, "who": "b"}, tmp_path / "b.ckpt"
        )
        go.set()
        io.wait()
    finally:
        go.set()
        io.teardown()
    a = torch.load(tmp_path / "a.ckpt", weights_only=True)
    b = torch.load(tmp_path / "b.ckpt", weights_only=True)
    assert (a["who"], b["who"]) == ("a", "b")
    assert torch.equal(a["same"], same) and torch.equal(b["same"], same)
    assert torch.equal(a["changed"], torch.zeros(64))
    assert torch.equal(b["changed"], torch.full((64,), 7.0))


def test_a_save_of_a_later_step_waits_for_the_earlier_write(tmp_path: Path) -> None:
    """One global step in flight: the save of step 2 returns only once step 1's
    file is whole, so a crash mid-save never leaves two files half-written."""
    fs, go = _held("a.ckpt")
    io = AsyncsaveCheckpointIO(filesystem=fs)
    release = threading.Thread(target=lambda: (fs.fired.wait(30.0), go.set()))
    try:
        io.save_checkpoint({"global_step": 1, "w": torch.ones(4)}, tmp_path / "a.ckpt")
        release.start()  # lets step 1's write go once it is held
        io.save_checkpoint({"global_step": 2, "w": torch.ones(4)}, tmp_path / "b.ckpt")
        assert fs.fired.is_set() and not _pending(tmp_path / "a.ckpt")
    finally:
        go.set()
        io.teardown()
        release.join()
    assert _step(tmp_path / "b.ckpt") == 2


def test_a_path_removed_while_its_write_is_held_is_not_left_behind(tmp_path: Path) -> None:
    """ModelCheckpoint drops a top-k file whose write is still in flight: the
    file does not reappear once the write completes."""
    fs, go = _held("a.ckpt")
    io = AsyncsaveCheckpointIO(filesystem=fs)
    try:
        io.save_checkpoint({"global_step": 1, "w": torch.ones(4)}, tmp_path / "a.ckpt")
        io.remove_checkpoint(tmp_path / "a.ckpt")
        go.set()
        io.wait()
    finally:
        go.set()
        io.teardown()
    assert list(tmp_path.iterdir()) == []


def test_loading_a_path_this_process_is_writing_waits_for_the_write(tmp_path: Path) -> None:
    """``trainer.save_checkpoint(p)`` then ``fit(ckpt_path=p)`` on another
    trainer (another plugin): the load waits for the write instead of reading
    the placeholder (found running Lightning's own resume tests)."""
    fs, go = _held("a.ckpt")
    io = AsyncsaveCheckpointIO(filesystem=fs)
    release = threading.Thread(target=lambda: (fs.fired.wait(30.0), go.set()))
    try:
        io.save_checkpoint({"global_step": 4, "w": torch.ones(4)}, tmp_path / "a.ckpt")
        assert _pending(tmp_path / "a.ckpt")
        release.start()
        loaded = AsyncsaveCheckpointIO().load_checkpoint(tmp_path / "a.ckpt")
    finally:
        go.set()
        io.teardown()
        release.join()
    assert loaded["global_step"] == 4 and torch.equal(loaded["w"], torch.ones(4))


def test_a_save_calls_torch_save_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """One ``torch.save`` per ``save_checkpoint``, new path or not, as Lightning's
    own IO (its frequency tests count them; the placeholder is JSON)."""
    calls: list[object] = []
    real = torch.save

    def counting(obj: Any, f: Any, *args: Any, **kwargs: Any) -> None:
        calls.append(f)
        real(obj, f, *args, **kwargs)

    monkeypatch.setattr(torch, "save", counting)
    io = AsyncsaveCheckpointIO()
    try:
        for step, name in ((1, "a"), (2, "a"), (2, "b")):
            io.save_checkpoint({"global_step": step, "w": torch.ones(2)}, tmp_path / f"{name}.ckpt")
        io.wait()
    finally:
        io.teardown()
    assert len(calls) == 3


def test_no_thread_of_the_plugin_runs_between_saves(tmp_path: Path) -> None:
    """The writer thread starts with a write and leaves once none is queued:
    after ``wait()`` nothing of the plugin runs, before any ``teardown``
    (Lightning's own tests fail a test that leaves a thread behind)."""
    io = AsyncsaveCheckpointIO()
    for step in (1, 2):
        io.save_checkpoint({"global_step": step, "w": torch.ones(4)}, tmp_path / f"{step}.ckpt")
        io.wait()
        assert not [t for t in threading.enumerate() if t.name == "asyncsave-lightning"]
    io.teardown()


def test_a_stuck_write_is_a_timeout_and_teardown_does_not_wait_for_it(tmp_path: Path) -> None:
    """A write that hangs (a stuck NFS server): ``wait()`` raises
    ``CheckpointTimeoutError`` after ``save_timeout_s``, and so does
    ``teardown()``, which returns instead of joining the stuck thread."""
    go = threading.Event()
    fs = FaultyFileSystem(
        "write", block(go), n=2, where=lambda p: ".asyncsave-tmp-a.ckpt-" in Path(p).name
    )
    io = AsyncsaveCheckpointIO(filesystem=fs, save_timeout_s=0.5)
    before = _threads()
    try:
        io.save_checkpoint({"global_step": 1, "w": torch.ones(4)}, tmp_path / "a.ckpt")
        with pytest.raises(asyncsave.CheckpointTimeoutError, match="save_timeout_s") as info:
            io.wait()
        assert info.value.step == 1
        with pytest.raises(asyncsave.CheckpointTimeoutError):
            io.teardown()
    finally:
        go.set()  # the stuck write fails now and its thread ends
    assert _no_new_threads(before), _threads() - before


def test_a_write_a_timed_out_teardown_drops_leaves_no_placeholder(tmp_path: Path) -> None:
    """Two paths of one step (top-k and ``last``), the first write stuck: the
    teardown that times out drops the second, queued write, and the placeholder
    of its new path goes with it (else Lightning sees the name taken for good)."""
    go = threading.Event()
    fs = FaultyFileSystem(
        "write", block(go), n=2, where=lambda p: ".asyncsave-tmp-a.ckpt-" in Path(p).name
    )
    io = AsyncsaveCheckpointIO(filesystem=fs, save_timeout_s=0.5)
    before = _threads()
    try:
        io.save_checkpoint({"global_step": 5, "w": torch.ones(4)}, tmp_path / "a.ckpt")
        io.save_checkpoint({"global_step": 5, "w": torch.ones(4)}, tmp_path / "b.ckpt")
        assert _pending(tmp_path / "b.ckpt")
        with pytest.raises(asyncsave.CheckpointTimeoutError):
            io.teardown()
        assert not (tmp_path / "b.ckpt").exists()
    finally:
        go.set()  # the stuck write fails now and its thread ends
    assert _no_new_threads(before), _threads() - before
    assert not (tmp_path / "a.ckpt").exists()  # its failure removed its placeholder too


# -- options -------------------------------------------------------------------
@pytest.mark.parametrize("route", ["options", "keywords"])
def test_options_and_keywords_mean_the_same(route: str) -> None:
    fields = {"budget_bytes": 1 << 20, "writer_threads": 3}
    io = (
        AsyncsaveCheckpointIO(options=asyncsave.CheckpointOptions(**fields))
        if route == "options"
        else AsyncsaveCheckpointIO(**fields)
    )
    assert io.options.distributed is False  # before, options= left it None: a DDP hang
    assert io.options.save_step_zero is True  # before, options= turned it off
    assert (io.options.budget_bytes, io.options.writer_threads) == (1 << 20, 3)
    both = plugin_options(asyncsave.CheckpointOptions(budget_bytes=1 << 20), writer_threads=3)
    assert dataclasses.replace(io.options, retention=None) == both


@pytest.mark.parametrize("route", ["options", "keywords"])
def test_distributed_true_is_refused_by_both_routes(route: str) -> None:
    with pytest.raises(asyncsave.UnsupportedCombinationError, match="distributed"):
        if route == "options":
            AsyncsaveCheckpointIO(options=asyncsave.CheckpointOptions(distributed=True))
        else:
            AsyncsaveCheckpointIO(distributed=True)
    with pytest.raises(TypeError, match="budget"):
        AsyncsaveCheckpointIO(budget=1)


def test_step_zero_is_saved_with_options_as_with_keywords(tmp_path: Path) -> None:
    io = AsyncsaveCheckpointIO(options=asyncsave.CheckpointOptions(budget_bytes=1 << 20))
    trainer = _trainer(tmp_path, 1, io)
    trainer.strategy.connect(app.Tiny())
    trainer.save_checkpoint(tmp_path / "init.ckpt")
    io.teardown()
    assert _step(tmp_path / "init.ckpt") == 0


def test_a_save_that_did_not_happen_writes_no_pointer(tmp_path: Path) -> None:
    """``save_step_zero=False``: the save at step 0 is skipped (with asyncsave's
    warning) and no path names it (before: ``init.ckpt`` pointed at a step that
    does not exist)."""
    io = AsyncsaveCheckpointIO(save_step_zero=False)
    try:
        with pytest.warns(asyncsave.CheckpointWarning, match="step 0"):
            io.save_checkpoint({"global_step": 0, "w": torch.ones(2)}, tmp_path / "init.ckpt")
        io.wait()
    finally:
        io.teardown()
    assert list(tmp_path.iterdir()) == []


# -- URL roots -----------------------------------------------------------------
@pytest.fixture
def memory_url() -> Iterator[str]:
    import fsspec

    url = f"memory://lightning-{uuid.uuid4().hex}"
    yield url
    fs = fsspec.filesystem("memory")
    if fs.exists(url):
        fs.rm(url, recursive=True)


def test_a_url_dirpath_stays_a_url(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, memory_url: str
) -> None:
    """``ModelCheckpoint(dirpath="memory://...")``: the ``.ckpt`` files are on
    that file system (not in a local ``./memory:`` folder), torch reads them
    there, and a fit resumes from them."""
    import fsspec

    monkeypatch.chdir(tmp_path)
    torch.manual_seed(0)
    _trainer(memory_url, 2, AsyncsaveCheckpointIO(), save_last=True).fit(app.Tiny())
    assert list(tmp_path.iterdir()) == []
    names = sorted(Path(p).name for p in fsspec.filesystem("memory").ls(memory_url, detail=False))
    assert names == ["epoch=1-step=8.ckpt", "last.ckpt"]
    assert _step(f"{memory_url}/last.ckpt") == 8
    verify_ckpt(f"{memory_url}/last.ckpt")
    loaded = AsyncsaveCheckpointIO().load_checkpoint(f"{memory_url}/last.ckpt")
    assert loaded["global_step"] == 8
    trainer = _trainer(memory_url, 3, AsyncsaveCheckpointIO(), save_last=True)
    trainer.fit(app.Tiny(), ckpt_path=f"{memory_url}/last.ckpt")
    assert trainer.global_step == 12
    assert _step(f"{memory_url}/last.ckpt") == 12
    assert list(tmp_path.iterdir()) == []


def test_an_s3_dirpath_keeps_everything_on_the_object_store(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, moto_server: str
) -> None:
    """The moto S3 server: Lightning's ModelCheckpoint and the plugin both reach it
    through the environment's endpoint and credentials (botocore reads them)."""
    import s3fs

    for name, value in {
        "AWS_ENDPOINT_URL": moto_server,
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
    }.items():
        monkeypatch.setenv(name, value)
    s3fs.S3FileSystem.clear_instance_cache()
    bucket = f"lightning-{uuid.uuid4().hex[:12]}"
    s3fs.S3FileSystem().mkdir(bucket)
    url = f"s3://{bucket}/run1"
    monkeypatch.chdir(tmp_path)
    torch.manual_seed(0)
    _trainer(url, 2, AsyncsaveCheckpointIO(), filename="model", save_last=True).fit(app.Tiny())
    s3fs.S3FileSystem.clear_instance_cache()
    assert list(tmp_path.iterdir()) == []
    assert _step(f"{url}/last.ckpt") == 8
    loaded = AsyncsaveCheckpointIO().load_checkpoint(f"{url}/model.ckpt")
    assert loaded["global_step"] == 8


# -- hyper-parameters ----------------------------------------------------------
@dataclasses.dataclass
class Config:
    depth: int = 3
    name: str = "tiny"


class Hydra(app.Tiny):
    """A module saving one structured config, as Hydra users do."""

    def __init__(self, cfg: Any) -> None:
        super().__init__()
        self.save_hyperparameters()


class WholeConfig(app.Tiny):
    """``save_hyperparameters(cfg)``: Lightning stores the config itself and
    its class under ``hparams_type``."""

    def __init__(self, cfg: Any) -> None:
        super().__init__()
        self.save_hyperparameters(cfg)


def _configs() -> dict[str, Any]:
    from omegaconf import OmegaConf

    return {
        "dictconfig": OmegaConf.create({"depth": 3, "name": "${sub.name}", "sub": {"name": "t"}}),
        "dataclass": Config(),
        "namespace": argparse.Namespace(depth=3, name="tiny"),
    }


@pytest.mark.parametrize("kind", ["dictconfig", "dataclass", "namespace"])
def test_hyperparameters_lightning_can_save_are_saved_without_pickle(
    tmp_path: Path, kind: str
) -> None:
    cfg = _configs()[kind]
    torch.manual_seed(0)
    _trainer(tmp_path, 1, AsyncsaveCheckpointIO(), save_last=True).fit(Hydra(cfg))
    hp = AsyncsaveCheckpointIO().load_checkpoint(tmp_path / "last.ckpt")["hyper_parameters"]
    expected = {
        "dictconfig": {"depth": 3, "name": "t", "sub": {"name": "t"}},  # resolved, as hparams.yaml
        "dataclass": {"depth": 3, "name": "tiny"},
        "namespace": {"depth": 3, "name": "tiny"},
    }[kind]
    assert hp["cfg"] == expected


def test_a_dictconfig_as_the_whole_hparams_is_saved(tmp_path: Path) -> None:
    from omegaconf import OmegaConf

    cfg = OmegaConf.create({"lr": 0.05, "name": "${sub.name}", "sub": {"name": "t"}})
    torch.manual_seed(0)
    _trainer(tmp_path, 1, AsyncsaveCheckpointIO(), save_last=True).fit(WholeConfig(cfg))
    ckpt = AsyncsaveCheckpointIO().load_checkpoint(tmp_path / "last.ckpt")
    assert ckpt["hyper_parameters"] == {"lr": 0.05, "name": "t", "sub": {"name": "t"}}
    assert ckpt["hparams_type"] == "omegaconf.dictconfig.DictConfig"


# -- lifecycle -----------------------------------------------------------------
def test_the_plugin_pickles_open_or_closed(tmp_path: Path) -> None:
    io = AsyncsaveCheckpointIO(budget_bytes=1 << 20)
    io.save_checkpoint({"global_step": 1, "w": torch.ones(2)}, tmp_path / "a.ckpt")
    try:
        copy = pickle.loads(pickle.dumps(io))  # open: its checkpointer stays behind
    finally:
        io.teardown()
    assert copy.options.budget_bytes == 1 << 20 and copy.options.distributed is False
    copy.save_checkpoint({"global_step": 2, "w": torch.ones(2)}, tmp_path / "b.ckpt")
    copy.teardown()
    assert (_step(tmp_path / "a.ckpt"), _step(tmp_path / "b.ckpt")) == (1, 2)
    pickle.loads(pickle.dumps(copy)).teardown()  # closed


def test_torch_save_of_a_trainer_holding_the_plugin(tmp_path: Path) -> None:
    torch.manual_seed(0)
    trainer = _trainer(tmp_path, 1, AsyncsaveCheckpointIO())
    trainer.fit(app.Tiny())
    buffer = BytesIO()
    torch.save(trainer, buffer)
    buffer.seek(0)
    copy = torch.load(buffer, weights_only=False)
    assert isinstance(copy.strategy.checkpoint_io, AsyncsaveCheckpointIO)
    assert copy.strategy.checkpoint_io.options == trainer.strategy.checkpoint_io.options


def test_saves_and_removals_after_fit_leave_nothing_open(tmp_path: Path) -> None:
    """After ``fit`` (the trainer's teardown closed the checkpointer):
    ``remove_checkpoint`` opens and closes one for that call;
    ``trainer.save_checkpoint(p)`` returns with ``p`` there, ``wait()`` makes
    it loadable, ``teardown()`` leaves no thread behind."""
    torch.manual_seed(0)
    io = AsyncsaveCheckpointIO()
    trainer = _trainer(tmp_path, 2, io, save_top_k=-1, monitor=None)
    trainer.fit(app.Tiny())
    before = _threads()
    trainer.strategy.remove_checkpoint(tmp_path / "epoch=0-step=4.ckpt")
    assert _no_new_threads(before), _threads() - before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["epoch=1-step=8.ckpt"]
    with warnings.catch_warnings():
        warnings.simplefilter("error", asyncsave.CheckpointWarning)
        trainer.save_checkpoint(tmp_path / "final.ckpt")
    assert (tmp_path / "final.ckpt").exists()
    io.wait()
    assert io.load_checkpoint(tmp_path / "final.ckpt")["global_step"] == 8
    io.teardown()
    assert _no_new_threads(before), _threads() - before


def test_a_dict_without_a_global_step_is_saved_whole_at_its_path(tmp_path: Path) -> None:
    """What ``ddp_spawn``'s rank 0 hands back (its weights, no ``global_step``):
    committed at its path on return, loaded and removed by another plugin (the
    launching process's); a directory the plugin did not save stays."""
    weights = {"net.w": torch.arange(4.0)}
    AsyncsaveCheckpointIO().save_checkpoint(weights, tmp_path / "t" / ".temp.ckpt")
    parent = AsyncsaveCheckpointIO()
    assert torch.equal(
        parent.load_checkpoint(tmp_path / "t" / ".temp.ckpt")["net.w"], weights["net.w"]
    )
    parent.remove_checkpoint(tmp_path / "t" / ".temp.ckpt")
    assert list((tmp_path / "t").iterdir()) == []
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "x.bin").write_bytes(b"x")
    parent.remove_checkpoint(tmp_path / "other")
    assert (tmp_path / "other" / "x.bin").exists()


def test_a_whole_save_at_a_path_left_by_an_earlier_run_replaces_it(tmp_path: Path) -> None:
    """An earlier run crashed before ``remove_checkpoint``: its root is still at
    ``.temp.ckpt``. The next save there is what loads (it was silently skipped,
    and the earlier run's weights came back)."""
    path = tmp_path / "t" / ".temp.ckpt"
    AsyncsaveCheckpointIO().save_checkpoint({"net.w": torch.zeros(2)}, path)
    AsyncsaveCheckpointIO().save_checkpoint({"net.w": torch.ones(2)}, path)
    assert torch.equal(AsyncsaveCheckpointIO().load_checkpoint(path)["net.w"], torch.ones(2))


def test_remove_checkpoint_leaves_an_asyncsave_root_the_plugin_did_not_save_whole(
    tmp_path: Path,
) -> None:
    """A user's own root with only its step 0 looks like a whole save; it is not
    one (its manifest says so) and stays."""
    import asyncsave

    root = tmp_path / "mine"
    with asyncsave.SyncCheckpointer(root, save_step_zero=True) as ckpt:
        ckpt.save(0, {"w": torch.ones(2)}).result()
    AsyncsaveCheckpointIO().remove_checkpoint(root)
    assert torch.equal(asyncsave.load(root / "step_0")["w"], torch.ones(2))


# -- two processes -------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize("route", ["options", "keywords"])
def test_ddp_spawn_on_two_ranks_saves_with_options_as_with_keywords(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, route: str
) -> None:
    """``strategy="ddp_spawn"`` on 2 CPU processes: the plugin pickles to both
    ranks and rank 0 saves alone (before: the plugin did not pickle; with
    ``options=`` under DDP, rank 0 waited in a collective rank 1 never joined)."""
    # Rank 0 hands its weights back through a tempfile.mkdtemp() directory: the
    # spawned processes make it under this test's directory.
    (tmp_path / "tmp").mkdir()
    monkeypatch.setenv("TMPDIR", str(tmp_path / "tmp"))
    io = (
        AsyncsaveCheckpointIO(options=asyncsave.CheckpointOptions(budget_bytes=1 << 20))
        if route == "options"
        else AsyncsaveCheckpointIO(budget_bytes=1 << 20)
    )
    trainer = Trainer(
        max_epochs=1,
        accelerator="cpu",
        devices=2,
        strategy="ddp_spawn",
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        plugins=[io],
        callbacks=[ModelCheckpoint(dirpath=tmp_path / "ckpts", save_last=True)],
    )
    trainer.fit(app.Tiny())
    names = sorted(p.name for p in (tmp_path / "ckpts").iterdir())
    assert names == ["epoch=0-step=2.ckpt", "last.ckpt"]
    assert _step(tmp_path / "ckpts" / "last.ckpt") == 2
    # The weights came back through the plugin and their directory went.
    assert [list(d.iterdir()) for d in (tmp_path / "tmp").iterdir()] == [[]]


@pytest.mark.parametrize("where", ["local", "memory"])
@pytest.mark.parametrize("fail_after_bytes", [0, 1, 600, 10_000])
def test_a_save_that_fails_mid_write_leaves_the_previous_file_whole(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    memory_url: str,
    where: str,
    fail_after_bytes: int,
) -> None:
    """A write that fails after any number of bytes leaves the path's previous
    ``.ckpt`` as it was, on a local directory and on an fsspec store whose files
    appear as they are opened (``memory://``): the new bytes go under a temporary
    name first, never straight into the final one."""
    import fsspec

    root = str(tmp_path / "ckpts") if where == "local" else memory_url
    path = f"{root}/last.ckpt"
    fs, target = fsspec.core.url_to_fs(path)
    io = AsyncsaveCheckpointIO()
    try:
        io.save_checkpoint({"global_step": 1, "w": torch.arange(64.0)}, path)
        io.wait()
        before = fs.cat_file(target)
        real_save = torch.save

        def failing_save(obj: Any, f: Any, *args: Any, **kwargs: Any) -> None:
            if fail_after_bytes:
                f.write(b"\0" * fail_after_bytes)
            raise OSError(errno.ENOSPC, "No space left on device (injected)")

        monkeypatch.setattr(torch, "save", failing_save)
        io.save_checkpoint({"global_step": 2, "w": torch.arange(64.0) + 1}, path)
        with pytest.raises(Exception) as failure:
            io.wait()
        assert "No space left" in repr(failure.value) + repr(failure.value.__cause__)
        monkeypatch.setattr(torch, "save", real_save)
        assert fs.cat_file(target) == before
        assert io.load_checkpoint(path)["global_step"] == 1
        assert [n for n in fs.ls(fs._parent(target), detail=False) if ".asyncsave-tmp" in n] == []
    finally:
        monkeypatch.undo()
        with contextlib.suppress(Exception):
            io.teardown()
