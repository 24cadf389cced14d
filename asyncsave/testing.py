"""Helpers for testing code that saves with asyncsave, and for asyncsave's own tests.

A test that needs a disk to fail, a save to stop half-way, or a small save to take
the path of a large one uses these instead of patching asyncsave's private
modules: the helpers live next to the code they reach into, so a restructuring of
the library moves them with it and leaves the tests alone (the idea of httpx's
``MockTransport``: a backend seam plus a mock shipped in the library).

- :class:`FaultyFileSystem` is a :class:`~asyncsave.LocalFileSystem` that runs an
  action (:func:`raise_errno`, :func:`block`, :func:`pause`, :func:`kill`) instead
  of the ``n``-th call of one operation; pass it as ``Checkpointer(root,
  filesystem=fs)`` (or ``Tier(..., filesystem=fs)``).
- :func:`pause_at` stops one save at a named phase (:data:`PHASES`) until the test
  releases it; :func:`fail_staging` makes the copy into host buffers fail.
- Callbacks at one named point of a save, for the duration of a ``with`` block
  (nothing is called, and nothing costs, outside it): :func:`on_early_copy` and
  :func:`early_copy_made` around a lazy save's copy of what forward may change;
  :func:`staging_steps` after each step of a copy that the writers follow;
  :func:`snapshot_taken` as a snapshot is whole; :func:`stream_rounds` as a
  streamed save cuts its files into rounds; :func:`staging_released` as a
  save gives its staging memory back; :func:`background_tasks` as its early
  writes start; :func:`planning` at each walk of a state tree and each grouping
  of its tensors; :func:`incremental_steps` around an incremental save's base
  lookup, hashing in place and writes; :func:`gloo_collectives` before each collective of a gloo group;
  :func:`listing_reads` around each manifest read of a listing.
- :func:`thresholds` lowers the sizes above which a save changes its strategy
  (written while staged, a file per tensor, several files), so that a few KiB of
  test state exercise the same code as GiBs.
- :func:`leftover_temp_names` lists the temporary entries a save left in a root;
  :func:`cli` runs the ``asyncsave`` command in this process;
  :func:`encode_manifest` writes a manifest a test edited;
  :func:`checkpoint_dir_name`, :func:`checkpoint_step` and
  :func:`tracker_file_name` name a layout preset's directories and tracker.

Everything here is for tests: the patching helpers change module-level settings
of the process while their ``with`` block runs, so they are not thread-safe
against a second test running in the same process at the same time.

- :class:`FakeGroup` runs N ranks in one process: each rank's checkpointer gets
  ``coordinator=group.rank(r)``, the collectives meet in memory, and a rank can
  be made to die or hang at a named collective (no gloo, no second process).

Example (a full disk at the first data write)::

    fs = FaultyFileSystem("write", raise_errno(errno.ENOSPC))
    async with asyncsave.Checkpointer(root, filesystem=fs) as ckpt:
        handle = await ckpt.save(1, state)
        with pytest.raises(asyncsave.SaveFailedError):
            await handle
    assert leftover_temp_names(root) == []
"""

from __future__ import annotations

import errno
import importlib
import os
import signal
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TextIO

import anyio
import anyio.to_thread

from ._coord import Coordinator, Turns
from ._errors import RankFailedError
from ._fs import LocalFileSystem
from ._manifest import READ_VERSION
from ._paths import LAYOUTS, is_retired_name, is_temp_name
from ._replan import INLINE_PLAN_MAX_NODES as _INLINE_PLAN_MAX_NODES

__all__ = [
    "FILE_OPS",
    "INCREMENTAL_STEPS",
    "INLINE_PLAN_MAX_NODES",
    "LAYOUT_NAMES",
    "NEWEST_FORMAT_VERSION",
    "PHASES",
    "PROCEED",
    "StreamPiece",
    "FakeGroup",
    "FakeRank",
    "FaultyFileSystem",
    "Pause",
    "background_tasks",
    "block",
    "checkpoint_dir_name",
    "checkpoint_step",
    "cli",
    "early_copy_made",
    "encode_manifest",
    "fail_staging",
    "gloo_collectives",
    "incremental_steps",
    "is_temp_name",
    "kill",
    "leftover_temp_names",
    "listing_reads",
    "on_early_copy",
    "pause",
    "pause_at",
    "planning",
    "raise_errno",
    "snapshot_taken",
    "staging_released",
    "staging_steps",
    "stream_rounds",
    "thresholds",
    "tracker_file_name",
]

#: Returned by an action of :class:`FaultyFileSystem`: the real call goes ahead.
PROCEED: Any = object()

#: The operations of :class:`FaultyFileSystem` an action can replace.
FILE_OPS = (
    "create",
    "write",
    "fsync",
    "close",
    "makedirs",
    "mkdir",
    "fsync_dir",
    "rename",
    "replace",
    "exchange",
    "remove_tree",
    "link",
    "unlink",
    "read_bytes",
)


class FaultyFileSystem(LocalFileSystem):
    """A local file system that runs ``action`` instead of the ``n``-th call
    (1-based) of ``op`` whose path satisfies ``where``; every other call goes
    through unchanged.

    ``read_bytes`` is the read of a small file whole (a manifest, a tracker; data
    files are read around the I/O layer). The path ``where`` sees is the file's for
    ``create``, ``write``, ``fsync`` and ``close`` (descriptors are mapped back to the path they were opened with), the
    destination for ``rename``, ``replace``, ``link`` and ``exchange`` (its second
    argument), and the argument otherwise. The action runs in the worker thread of
    the call: it raises (the call fails), blocks, or returns :data:`PROCEED` (the
    real call then goes ahead); anything else it returns is what the call returns.

    :param op: one of :data:`FILE_OPS`.
    :param action: called with no argument at the chosen call.
    :param n: which matching call (1 = the first).
    :param where: which paths count (default: all).
    :raises ValueError: ``op`` is not one of :data:`FILE_OPS`, or ``n < 1``.

    ``fired`` is set once the action has been called; ``seen`` counts the matching
    calls so far.
    """

    def __init__(
        self,
        op: str,
        action: Callable[[], Any],
        *,
        n: int = 1,
        where: Callable[[str], bool] = lambda path: True,
    ) -> None:
        if op not in FILE_OPS:
            raise ValueError(f"op={op!r} is not one of {FILE_OPS}")
        if n < 1:
            raise ValueError(f"n={n} counts calls from 1")
        self.op, self.action, self.n, self.where = op, action, n, where
        self.seen = 0
        self.fired = threading.Event()
        self._fd_paths: dict[int, str] = {}
        self._lock = threading.Lock()

    def _hit(self, op: str, path: Any) -> bool:
        """Whether this call of ``op`` on ``path`` is the chosen one."""
        if op != self.op or not self.where(str(path)):
            return False
        with self._lock:
            self.seen += 1
            if self.seen != self.n:
                return False
        self.fired.set()
        return True

    def _run(self, op: str, path: Any, real: Callable[..., Any], *args: Any) -> Any:
        """The action instead of ``real(*args)`` if this is the chosen call."""
        if self._hit(op, path):
            result = self.action()
            if result is not PROCEED:
                return result
        return real(*args)

    # -- files -------------------------------------------------------------------
    def create(self, path: Path) -> int:
        fd: int = self._run("create", path, super().create, path)
        self._fd_paths[fd] = str(path)
        return fd

    def open_direct(self, path: Path) -> int | None:
        fd = super().open_direct(path)
        if fd is not None:
            self._fd_paths[fd] = str(path)
        return fd

    def write(self, fd: int, data: memoryview) -> int:
        path = self._fd_paths.get(fd, "")
        written: int = self._run("write", path, super().write, fd, data)
        return written

    def fsync(self, fd: int) -> None:
        self._run("fsync", self._fd_paths.get(fd, ""), super().fsync, fd)

    def close(self, fd: int) -> None:
        path = self._fd_paths.pop(fd, "")
        if self._hit("close", path):
            result = self.action()
            if result is not PROCEED:
                os.close(fd)  # the descriptor is never leaked, whatever the action
                return
        super().close(fd)

    # -- directories and names ---------------------------------------------------
    def makedirs(self, path: Path) -> None:
        self._run("makedirs", path, super().makedirs, path)

    def mkdir(self, path: Path) -> None:
        self._run("mkdir", path, super().mkdir, path)

    def fsync_dir(self, path: Path) -> None:
        self._run("fsync_dir", path, super().fsync_dir, path)

    def rename(self, src: Path, dst: Path) -> None:
        self._run("rename", dst, super().rename, src, dst)

    def replace(self, src: Path, dst: Path) -> None:
        self._run("replace", dst, super().replace, src, dst)

    def exchange(self, a: Path, b: Path) -> None:
        self._run("exchange", b, super().exchange, a, b)

    def remove_tree(self, path: Path) -> None:
        self._run("remove_tree", path, super().remove_tree, path)

    def link(self, src: Path, dst: Path) -> None:
        self._run("link", dst, super().link, src, dst)

    def unlink(self, path: Path) -> None:
        self._run("unlink", path, super().unlink, path)

    # -- reads of small files (manifests, trackers) -------------------------------
    def read_bytes(self, path: Path) -> bytes:
        data: bytes = self._run("read_bytes", path, super().read_bytes, path)
        return data


# -- actions -------------------------------------------------------------------------


def raise_errno(code: int) -> Callable[[], Any]:
    """An action that raises ``OSError(code)`` (e.g. ``errno.ENOSPC``, ``errno.EIO``)."""

    def action() -> Any:
        raise OSError(code, os.strerror(code))

    return action


def block(event: threading.Event) -> Callable[[], Any]:
    """An action that waits until ``event`` is set, then raises ``OSError(EIO)``:
    a call that hangs (a stuck NFS server) and fails once it is let go."""

    def action() -> Any:
        event.wait()
        raise OSError(errno.EIO, "released after blocking")

    return action


def pause(event: threading.Event, timeout_s: float = 60.0) -> Callable[[], Any]:
    """An action that waits until ``event`` is set (or ``timeout_s`` seconds have
    passed), then lets the call go ahead."""

    def action() -> Any:
        event.wait(timeout_s)
        return PROCEED

    return action


def kill() -> Callable[[], Any]:
    """An action that SIGKILLs this process (for crash tests run in a child)."""

    def action() -> Any:
        os.kill(os.getpid(), signal.SIGKILL)

    return action


# -- leftovers -----------------------------------------------------------------------


def leftover_temp_names(root: str | os.PathLike[str]) -> list[str]:
    """The names directly under ``root`` that are asyncsave's temporary entries (a
    save in flight, or one that failed and was not cleaned up), sorted; ``[]``
    when there are none or ``root`` does not exist."""
    try:
        names = os.listdir(root)
    except FileNotFoundError:
        return []
    return sorted(n for n in names if is_temp_name(n))


#: The names of the layout presets (``CheckpointOptions(layout=...)``), sorted.
LAYOUT_NAMES: tuple[str, ...] = tuple(sorted(LAYOUTS))


#: The newest manifest ``format_version`` this asyncsave reads; a checkpoint of a
#: higher one raises :class:`~asyncsave.UnsupportedFormatError` (never read as
#: damaged, never moved aside).
NEWEST_FORMAT_VERSION: int = READ_VERSION


def checkpoint_dir_name(layout: str, step: int) -> str:
    """The final directory name of ``step`` under the layout preset ``layout``
    (``"asyncsave"``: ``step_7``; ``"megatron"``: ``iter_0000007``).

    :raises ValueError: ``layout`` is not one of :data:`LAYOUT_NAMES`.
    """
    if layout not in LAYOUTS:
        raise ValueError(f"layout={layout!r} is not one of {LAYOUT_NAMES}")
    return LAYOUTS[layout].dir_name(step)


def checkpoint_step(layout: str, name: str) -> int | None:
    """The step a final directory name stands for under the layout preset
    ``layout`` (``"step_7"`` -> ``7``), or ``None`` when ``name`` is not one (a
    temporary or retired entry, a stray file, another preset's name): the
    inverse of :func:`checkpoint_dir_name`.

    :raises ValueError: ``layout`` is not one of :data:`LAYOUT_NAMES`.
    """
    if layout not in LAYOUTS:
        raise ValueError(f"layout={layout!r} is not one of {LAYOUT_NAMES}")
    return LAYOUTS[layout].parse_dir_name(name)


def tracker_file_name(layout: str) -> str | None:
    """The name of the tracker file in the root under the layout preset
    ``layout`` (``"latest_checkpointed_iteration.txt"`` for ``"asyncsave"``,
    ``"megatron"`` and ``"verl"``), or ``None`` for a preset that keeps none
    (``"nemo_rl"``).

    :raises ValueError: ``layout`` is not one of :data:`LAYOUT_NAMES`.
    """
    if layout not in LAYOUTS:
        raise ValueError(f"layout={layout!r} is not one of {LAYOUT_NAMES}")
    return LAYOUTS[layout].tracker_name


def cli(argv: list[str], out: TextIO | None = None) -> int:
    """Run the ``asyncsave`` command (``asyncsave ls ROOT``, ``verify``,
    ``inspect``, ``prune``...) in this process, as ``python -m asyncsave`` would,
    without a second interpreter: its exit status (0 ok, 1 a finding such as a
    damaged checkpoint or a missing root).

    :param argv: the arguments after ``asyncsave``.
    :param out: where its report goes (default: ``sys.stdout``); errors go to
        ``sys.stderr``.
    :raises SystemExit: a usage error (code 2: an unknown option, a missing
        subcommand), as argparse reports it; ``--help`` and ``--version`` (code 0).
    """
    from ._cli import main  # the command's parser: only when a test runs it

    return main(list(argv), out=out)


def encode_manifest(doc: dict[str, Any]) -> bytes:
    """The bytes of a ``manifest.json`` holding ``doc``, as a save writes them
    (compact JSON whose last field is the XXH3-64 of the rest): for a test that
    edits a field of a committed manifest (``json.loads`` of its bytes, minus
    that checksum field) and wants the edit itself checked, not the checksum.

    :raises TypeError: ``doc`` holds a value JSON cannot encode.
    """
    from ._manifest import encode_manifest as encode

    return encode(doc)


# -- thresholds ----------------------------------------------------------------------

# Each setting of :func:`thresholds`: the module-level constants it sets.
_THRESHOLDS: dict[str, tuple[tuple[str, str], ...]] = {
    "follow_min_bytes": (("asyncsave._jobs", "FOLLOW_MIN_BYTES"),),
    "follow_piece_bytes": (("asyncsave._stage", "FOLLOW_PIECE_BYTES"),),
    "own_file_bytes": (("asyncsave._incremental", "OWN_FILE_BYTES"),),
    "min_file_bytes": (("asyncsave._format", "MIN_FILE_BYTES"),),
    "chunk_bytes": (("asyncsave._write", "CHUNK_BYTES"), ("asyncsave._stream", "CHUNK_BYTES")),
    "heartbeat_window_s": (("asyncsave._coord", "HEARTBEAT_WINDOW_MAX_S"),),
    "hash_apart_bytes": (("asyncsave._write", "HASH_APART_BYTES"),),
}
# The least value of a setting (0 where not named): a step or chunk of at least
# a byte; ten heartbeats per window, a beat every 10 ms at most.
_LEAST: dict[str, float] = {
    "follow_piece_bytes": 1,
    "chunk_bytes": 1,
    "min_file_bytes": 1,
    "heartbeat_window_s": 0.1,
}


class _Patches:
    """Attributes set for a while, each put back by :meth:`undo` (last first)."""

    def __init__(self) -> None:
        self._old: list[tuple[Any, str, Any]] = []

    def set(self, owner: Any, name: str, value: Any) -> None:
        self._old.append((owner, name, getattr(owner, name)))
        setattr(owner, name, value)

    def undo(self) -> None:
        while self._old:
            owner, name, value = self._old.pop()
            setattr(owner, name, value)


@contextmanager
def thresholds(
    *,
    follow_min_bytes: int | None = None,
    follow_piece_bytes: int | None = None,
    own_file_bytes: int | None = None,
    min_file_bytes: int | None = None,
    chunk_bytes: int | None = None,
    heartbeat_window_s: float | None = None,
    hash_apart_bytes: int | None = None,
) -> Iterator[None]:
    """Lower asyncsave's size thresholds while the block runs (``None``: unchanged).

    :param follow_min_bytes: staging bytes from which a save of host tensors is
        written while it is staged (``overlap_writes``); ``0``: every such save.
    :param follow_piece_bytes: bytes of one step of that copy (the writers follow
        it step by step).
    :param own_file_bytes: an incremental save gives a tensor of at least this
        many bytes a file of its own.
    :param min_file_bytes: bytes per data file below which a save writes fewer
        files than it has writer threads.
    :param chunk_bytes: bytes of one ``write`` call of a data file.
    :param heartbeat_window_s: the longest (seconds) a rank's heartbeat through
        the process group's store may stand still before the other ranks name it
        dead (10 s; the window is half of ``dist_timeout_s`` up to this). Set it
        in each rank's process before its checkpointer opens: a test of a dead
        rank then waits this long instead of 10 s, with ``dist_timeout_s`` kept
        far beyond it.
    :param hash_apart_bytes: bytes of a data file written with ``O_DIRECT``
        (``direct_io``) from which its checksums are computed by a helper thread
        while it is written, not inline (32 MiB).
    :raises ValueError: a value is negative (or not above 0 for the step and
        chunk sizes).
    """
    given = {
        "follow_min_bytes": follow_min_bytes,
        "follow_piece_bytes": follow_piece_bytes,
        "own_file_bytes": own_file_bytes,
        "min_file_bytes": min_file_bytes,
        "chunk_bytes": chunk_bytes,
        "heartbeat_window_s": heartbeat_window_s,
        "hash_apart_bytes": hash_apart_bytes,
    }
    patches = _Patches()
    try:
        for setting, value in given.items():
            if value is None:
                continue
            least = _LEAST.get(setting, 0)
            if value < least:
                raise ValueError(f"thresholds({setting}={value}): must be at least {least}")
            for module, name in _THRESHOLDS[setting]:
                patches.set(importlib.import_module(module), name, value)
        yield
    finally:
        patches.undo()


# -- pausing a save at a phase ------------------------------------------------------

#: The phases :func:`pause_at` can stop a save at, in the order a save meets them:
#: ``"staging"`` (before the copy of its tensors into host buffers),
#: ``"following"`` (after the first step of a copy whose files are written while
#: it runs; the save needs ``pause.options``), ``"writing"`` (at its first data
#: file write), ``"committing"`` (at the rename that publishes it on a local
#: root), ``"tracking"`` (at the replace of the tracker file), ``"retiring"`` (at
#: the rename by which retention retires an older checkpoint).
PHASES = ("staging", "following", "writing", "committing", "tracking", "retiring")


class Pause:
    """One stop of a save: the first time a save reaches the point while the pause
    is armed, the save's worker waits there until :meth:`release` (or
    ``timeout_s`` seconds, after which it goes on).

    ``reached`` (a :class:`threading.Event`) is set when a save stops;
    ``filesystem`` is the :class:`FaultyFileSystem` to pass to the checkpointer
    for the phases met in the file layer (``None`` otherwise); ``options`` are the
    checkpointer options the phase needs (e.g. ``{"overlap_writes": True}``).
    """

    def __init__(self, *, armed: bool = True, timeout_s: float = 60.0) -> None:
        self.armed, self.reached = threading.Event(), threading.Event()
        self._released = threading.Event()
        self.timeout_s = timeout_s
        self.filesystem: FaultyFileSystem | None = None
        self.options: dict[str, Any] = {}
        if armed:
            self.armed.set()

    def arm(self) -> None:
        """From now on, the next save that reaches the point stops there."""
        self.armed.set()

    def release(self) -> None:
        """Let the stopped save (and any later one) go on."""
        self._released.set()

    @property
    def released(self) -> bool:
        return self._released.is_set()

    async def wait_reached(self, timeout_s: float | None = None) -> bool:
        """Wait (in a worker thread, the event loop free) until a save stopped;
        ``False`` if none did within ``timeout_s`` (default: ``self.timeout_s``)."""
        limit = self.timeout_s if timeout_s is None else timeout_s
        return await anyio.to_thread.run_sync(self.reached.wait, limit)

    def hold(self) -> Any:
        """Called at the point, in a worker thread: stop there if this is the
        first arrival since :meth:`arm`; returns :data:`PROCEED` (usable as an
        action of :class:`FaultyFileSystem`)."""
        if self.armed.is_set() and not self.reached.is_set():
            self.reached.set()
            self._released.wait(self.timeout_s)
        return PROCEED

    def _when_armed(self, where: Callable[[Path], bool]) -> Callable[[str], bool]:
        return lambda path: self.armed.is_set() and where(Path(path))


def _tracker_names() -> set[str]:
    return {layout.tracker_name for layout in LAYOUTS.values() if layout.tracker_name}


def _is_data_write(path: Path) -> bool:
    return path.suffix == ".safetensors" and is_temp_name(path.parent.name)


def _is_publish(path: Path) -> bool:
    """A rename whose destination is a final name: not a temporary, retired or
    moved-aside entry, nor a file inside a save in flight."""
    names = (path.name, path.parent.name)
    return not any(is_temp_name(n) or n.startswith(".asyncsave-") for n in names)


# phase -> (operation of the file layer, which of its paths)
_FILE_PHASES: dict[str, tuple[str, Callable[[Path], bool]]] = {
    "writing": ("write", _is_data_write),
    "committing": ("rename", _is_publish),
    "tracking": ("replace", lambda path: path.name in _tracker_names()),
    "retiring": ("rename", lambda path: is_retired_name(path.name)),
}


def _hold_staging(p: Pause, patches: _Patches) -> None:
    jobs = importlib.import_module("asyncsave._jobs")
    real = jobs.stage_entries

    async def stage_entries(*args: Any, **kwargs: Any) -> Any:
        await anyio.to_thread.run_sync(p.hold)
        return await real(*args, **kwargs)

    patches.set(jobs, "stage_entries", stage_entries)


def _hold_following(p: Pause, patches: _Patches) -> None:
    mark = importlib.import_module("asyncsave._stage").StagedMark
    real = mark.advance

    def advance(self: Any, index: int, upto: int) -> None:
        real(self, index, upto)
        p.hold()

    patches.set(mark, "advance", advance)
    patches.set(importlib.import_module("asyncsave._jobs"), "FOLLOW_MIN_BYTES", 0)
    p.options = {"overlap_writes": True}


@contextmanager
def fail_staging(error: Exception) -> Iterator[None]:
    """Every save's staging (the copy of its tensors into host buffers) raises
    ``error`` while the block runs, as a device copy that failed would: for tests
    of what a save, lazy ones above all (whose staging runs after ``save()``
    returned), does with a failure of its snapshot. Saves started after the block
    stage normally.

    :raises TypeError: ``error`` is not an ``Exception``.
    """
    if not isinstance(error, Exception):
        raise TypeError(f"error={error!r} must be an Exception instance")
    jobs = importlib.import_module("asyncsave._jobs")
    patches = _Patches()

    async def stage_entries(*args: Any, **kwargs: Any) -> Any:
        raise error

    patches.set(jobs, "stage_entries", stage_entries)
    try:
        yield
    finally:
        patches.undo()


@contextmanager
def on_early_copy(fn: Callable[[int], None]) -> Iterator[None]:
    """Call ``fn(num_tensors)`` as each lazy save begins its early copy while the
    block runs: the copy, inside ``save(..., lazy=True)`` before it returns, of
    what forward may change (module buffers, tensors of at most 64 KiB);
    ``num_tensors`` is the save's number of tensors. A lazy save with nothing to
    copy early makes no call. ``fn`` runs on the caller's event loop before the
    copy starts: what it raises fails that ``save()`` call as a failed copy would
    (the checkpointer takes later saves), and a cancellation of the caller's scope
    it requests is delivered before the copy, inside ``save()``.

    :raises TypeError: ``fn`` is not callable.
    """
    if not callable(fn):
        raise TypeError(f"fn={fn!r} must be callable")
    jobs = importlib.import_module("asyncsave._jobs")
    patches = _Patches()
    for cls in (jobs.Job, jobs.PlainJob):  # every job class inherits one of the two
        real = cls.__dict__["eager_copies"]

        def eager_copies(self: Any, real: Callable[[Any], str] = real) -> str:
            where = real(self)
            if where != "none":
                fn(self.num_tensors)
            return where

        patches.set(cls, "eager_copies", eager_copies)
    try:
        yield
    finally:
        patches.undo()


@contextmanager
def listing_reads(
    *,
    before: Callable[[Path], None] | None = None,
    after: Callable[[Path], None] | None = None,
) -> Iterator[None]:
    """Run ``before(path)`` just before, and ``after(path)`` just after, each read
    of a checkpoint's manifest by :func:`asyncsave.checkpoints` while the block
    runs (``path``: the checkpoint's directory; ``after`` also when the read
    raised, before the listing sees the error). Listing takes no lock, so retention or ``prune`` in another process
    may remove a checkpoint at either point: a test places that race here.

    :raises TypeError: ``before`` or ``after`` is given and not callable.
    """
    for name, fn in (("before", before), ("after", after)):
        if fn is not None and not callable(fn):
            raise TypeError(f"{name}={fn!r} must be callable")
    listing = importlib.import_module("asyncsave._listing")
    real = listing.read_checkpoint
    patches = _Patches()

    def read_checkpoint(fs: Any, path: Any, **kwargs: Any) -> Any:
        if before is not None:
            before(Path(path))
        try:
            return real(fs, path, **kwargs)
        finally:
            if after is not None:
                after(Path(path))

    patches.set(listing, "read_checkpoint", read_checkpoint)
    try:
        yield
    finally:
        patches.undo()


#: The most nodes (containers, tensors and plain leaves) a state tree may have for
#: a save of the last save's structure to be bound to that save's plan on the
#: event loop (a microseconds-long walk) instead of planned in a worker thread.
INLINE_PLAN_MAX_NODES: int = _INLINE_PLAN_MAX_NODES


@contextmanager
def planning(fn: Callable[[str], None]) -> Iterator[None]:
    """Call ``fn(what)`` in the thread that does it, as each save plans its state,
    while the block runs: ``what`` is ``"flatten"`` (a walk of the state tree into
    its leaves, made at every save: in a worker thread, or on the event loop for a
    small plain tree of the last save's structure, see
    :data:`INLINE_PLAN_MAX_NODES`; a save matched against the last plan's tree
    walks it once, one that does not match walks it twice: the match, then the
    flatten) or ``"group"`` (the grouping of the tensors
    into entries and files, the costly part of a plan, skipped when the last
    save's plan is reused), called before the step runs. What ``fn`` raises
    fails that ``save()``.

    :raises TypeError: ``fn`` is not callable.
    """
    if not callable(fn):
        raise TypeError(f"fn={fn!r} must be callable")
    replan = importlib.import_module("asyncsave._replan")
    plan = importlib.import_module("asyncsave._plan")
    skeleton = importlib.import_module("asyncsave._skeleton")
    real_flatten, real_group = replan.flatten, plan._group
    real_match = skeleton.Skeleton.match
    patches = _Patches()

    def flatten(*args: Any, **kwargs: Any) -> Any:
        fn("flatten")
        return real_flatten(*args, **kwargs)

    def match(*args: Any, **kwargs: Any) -> Any:
        fn("flatten")
        return real_match(*args, **kwargs)

    def group(*args: Any, **kwargs: Any) -> Any:
        fn("group")
        return real_group(*args, **kwargs)

    patches.set(replan, "flatten", flatten)
    patches.set(skeleton.Skeleton, "match", match)
    patches.set(plan, "_group", group)
    try:
        yield
    finally:
        patches.undo()


@contextmanager
def early_copy_made(fn: Callable[[], None]) -> Iterator[None]:
    """Call ``fn()`` in the thread that made it, right after each lazy save's
    early copy (see :func:`on_early_copy`: what forward may change, copied
    inside ``save()``), while the block runs: a worker thread for host state,
    the event loop's for CUDA state (the copy is only enqueued there).

    :raises TypeError: ``fn`` is not callable.
    """
    if not callable(fn):
        raise TypeError(f"fn={fn!r} must be callable")
    jobs = importlib.import_module("asyncsave._jobs")
    real = jobs.snapshot_eager_entries
    patches = _Patches()

    def snapshot(*args: Any, **kwargs: Any) -> Any:
        copied = real(*args, **kwargs)
        fn()
        return copied

    patches.set(jobs, "snapshot_eager_entries", snapshot)
    try:
        yield
    finally:
        patches.undo()


#: The steps of an incremental save :func:`incremental_steps` reports.
INCREMENTAL_STEPS = ("base", "hash", "write")


@contextmanager
def incremental_steps(
    *,
    before: Callable[[str, str, int], None] | None = None,
    after: Callable[[str, str, int], None] | None = None,
) -> Iterator[None]:
    """Run ``before(what, name, nbytes)`` just before, and ``after(what, name,
    nbytes)`` just after, each step of an incremental save (``incremental=True``)
    that reads or writes its files, in the thread that does it, while the block
    runs (``after`` also when the step raised, before the save sees the error):

    - ``"base"``: the base checkpoint (the newest committed one) is looked up and
      its manifest read (``name`` ``""``, ``nbytes`` 0);
    - ``"hash"``: a data file that did not change at the last save is hashed in
      place and linked into the new checkpoint while the save stages (``name``
      the data file, ``nbytes`` its bytes);
    - ``"write"``: a data file is written (or shared from the base, if found
      unchanged): after the staging, or, for a file that changed at its last
      save, while the others are hashed.

    What ``before`` raises is raised by that step, as its own failure would be
    (a ``BaseException`` that is not an ``Exception`` ends the worker thread);
    either may block, to hold the step.

    :raises TypeError: ``before`` or ``after`` is given and not callable.
    """
    for arg, fn in (("before", before), ("after", after)):
        if fn is not None and not callable(fn):
            raise TypeError(f"{arg}={fn!r} must be callable")
    reuse = importlib.import_module("asyncsave._incremental").Reuse
    patches = _Patches()

    def around(what: str, real: Callable[..., Any], name_of: Callable[..., tuple[str, int]]) -> Any:
        def step(self: Any, *args: Any, **kwargs: Any) -> Any:
            name, nbytes = name_of(*args)
            if before is not None:
                before(what, name, nbytes)
            try:
                return real(self, *args, **kwargs)
            finally:
                if after is not None:
                    after(what, name, nbytes)

        return step

    def layout_at(i: int) -> Callable[..., tuple[str, int]]:
        return lambda *args: (args[i].name, int(args[i].nbytes))

    patches.set(reuse, "find_base", around("base", reuse.find_base, lambda *a: ("", 0)))
    patches.set(reuse, "prelink", around("hash", reuse.prelink, layout_at(2)))
    patches.set(reuse, "write_file", around("write", reuse.write_file, layout_at(4)))
    try:
        yield
    finally:
        patches.undo()


@contextmanager
def snapshot_taken(fn: Callable[[], None]) -> Iterator[None]:
    """Call ``fn()`` as each save's snapshot is whole (every file staged into
    host buffers) and the save lets go of the caller's tensors, in the worker
    thread that does it, while the block runs. What ``fn`` raises fails the save
    as a failure of that last step of its staging would (after every file was
    staged: files already being written while it staged are waited for).

    :raises TypeError: ``fn`` is not callable.
    """
    if not callable(fn):
        raise TypeError(f"fn={fn!r} must be callable")
    plan = importlib.import_module("asyncsave._plan").Plan
    real = plan.release_sources
    patches = _Patches()

    def release_sources(self: Any) -> None:
        fn()
        real(self)

    patches.set(plan, "release_sources", release_sources)
    try:
        yield
    finally:
        patches.undo()


@contextmanager
def background_tasks(fn: Callable[[], None]) -> Iterator[None]:
    """Call ``fn()`` on the event loop just before the background part of a save
    (its early writes: the files written while it stages or hashes) is started
    as a task of the checkpointer's task group, while the block runs. What
    ``fn`` raises is raised as the task group's refusal would be (a group that
    is closing): that save fails at once, with nothing to wait for.

    :raises TypeError: ``fn`` is not callable.
    """
    if not callable(fn):
        raise TypeError(f"fn={fn!r} must be callable")
    saver = importlib.import_module("asyncsave._pipeline").Saver
    real = saver.start_soon
    patches = _Patches()

    def start_soon(self: Any, func: Any, *args: Any) -> None:
        fn()
        real(self, func, *args)

    patches.set(saver, "start_soon", start_soon)
    try:
        yield
    finally:
        patches.undo()


#: A piece of a streamed round (:func:`stream_rounds`): ``(file, entry, start,
#: end, arena_offset)``, bytes ``[start, end)`` of entry ``entry`` (an index into
#: the manifest's ``entries``) of data file ``file``, staged at ``arena_offset``
#: (bytes) of the staging memory in its round.
StreamPiece = tuple[int, int, int, int, int]


@contextmanager
def stream_rounds(fn: Callable[[int, list[list[StreamPiece]]], None]) -> Iterator[None]:
    """Call ``fn(budget_bytes, rounds)`` as a streamed save (a state larger than
    its ``budget_bytes``, staged and written in rounds through that much memory)
    cuts its files into rounds, in the thread that plans them, while the block
    runs: ``rounds`` lists each round's pieces (:data:`StreamPiece`). A save of
    the same structure and budget reuses its rounds: no second call.

    :raises TypeError: ``fn`` is not callable.
    """
    if not callable(fn):
        raise TypeError(f"fn={fn!r} must be callable")
    replan = importlib.import_module("asyncsave._replan")
    real = replan.plan_rounds
    patches = _Patches()

    def plan_rounds(entries: Any, layouts: Any, budget: int) -> Any:
        rounds = real(entries, layouts, budget)
        fn(
            budget,
            [[(q.file, q.entry, q.start, q.end, q.arena_offset) for q in r] for r in rounds],
        )
        return rounds

    patches.set(replan, "plan_rounds", plan_rounds)
    try:
        yield
    finally:
        patches.undo()


@contextmanager
def staging_steps(fn: Callable[[int], None]) -> Iterator[None]:
    """Call ``fn(file_index)`` after each step of a copy into host buffers that
    the save's writers follow (a save written while it is staged:
    ``overlap_writes``, see :func:`thresholds` for the sizes), in the copying
    thread, while the block runs. ``file_index`` is the data file (0-based, in
    the save's file order) whose bytes that step staged; the writers may write
    them from then on. A save that is staged, then written, makes no call. What
    ``fn`` raises fails the copy, as a source tensor that could not be read
    would; ``fn`` may block, to slow the copy (the writers must wait for it).

    :raises TypeError: ``fn`` is not callable.
    """
    if not callable(fn):
        raise TypeError(f"fn={fn!r} must be callable")
    stage = importlib.import_module("asyncsave._stage")
    real = stage.StagedMark.advance
    patches = _Patches()

    def advance(self: Any, index: int, upto: int) -> None:
        real(self, index, upto)
        fn(index)

    patches.set(stage.StagedMark, "advance", advance)
    try:
        yield
    finally:
        patches.undo()


@contextmanager
def staging_released(fn: Callable[[], None]) -> Iterator[None]:
    """Call ``fn()`` as each save gives its staging memory (the host buffers its
    snapshot was copied into) back to the pool, once per save, just before the
    memory may be handed to the next save, while the block runs: a test checks
    there that nothing still reads it (no write of the save's files in
    progress). ``fn`` runs in the thread that releases the memory (the event
    loop's, or a worker's).

    :raises TypeError: ``fn`` is not callable.
    """
    if not callable(fn):
        raise TypeError(f"fn={fn!r} must be callable")
    stage = importlib.import_module("asyncsave._stage")
    real = stage.Lease.release
    patches = _Patches()

    def release(self: Any) -> None:
        if self._pool is not None:  # the first release of this lease
            fn()
        real(self)

    patches.set(stage.Lease, "release", release)
    try:
        yield
    finally:
        patches.undo()


@contextmanager
def gloo_collectives(fn: Callable[[str], None]) -> Iterator[None]:
    """Call ``fn(kind)`` just before each collective of a save's gloo group in
    this process while the block runs: ``kind`` is ``"broadcast"`` or
    ``"all_gather"``, and ``fn`` runs in the worker thread that is about to make
    the collective (where the save's peers wait for it). What ``fn`` raises
    fails that collective as a failed exchange would; ``os.kill`` of the own
    process from ``fn`` is a rank that died at that collective (for crash tests
    of several processes). The coordinator of a :class:`FakeGroup` makes no
    gloo collectives: ``fn`` is not called for it.

    :raises TypeError: ``fn`` is not callable.
    """
    if not callable(fn):
        raise TypeError(f"fn={fn!r} must be callable")
    coord = importlib.import_module("asyncsave._coord")
    patches = _Patches()
    for kind in ("broadcast", "all_gather"):
        real = getattr(coord.GlooGroup, f"_{kind}")

        def collective(self: Any, obj: Any, _real: Any = real, _kind: str = kind) -> Any:
            fn(_kind)
            return _real(self, obj)

        patches.set(coord.GlooGroup, f"_{kind}", collective)
    try:
        yield
    finally:
        patches.undo()


@contextmanager
def pause_at(phase: str, *, armed: bool = True, timeout_s: float = 60.0) -> Iterator[Pause]:
    """Stop the first save that reaches ``phase`` (one of :data:`PHASES`) while
    the returned :class:`Pause` is armed, until the test calls ``release()``.

    Pass ``pause.filesystem`` (when not ``None``) and ``pause.options`` to the
    checkpointer. ``armed=False`` lets earlier saves through until ``arm()``.
    Leaving the block releases the pause and undoes what it changed.

    :raises ValueError: ``phase`` is not one of :data:`PHASES`.
    """
    if phase not in PHASES:
        raise ValueError(f"phase={phase!r} is not one of {PHASES}")
    p = Pause(armed=armed, timeout_s=timeout_s)
    patches = _Patches()
    try:
        if phase in _FILE_PHASES:
            op, where = _FILE_PHASES[phase]
            p.filesystem = FaultyFileSystem(op, p.hold, where=p._when_armed(where))
        elif phase == "staging":
            _hold_staging(p, patches)
        else:
            _hold_following(p, patches)
        yield p
    finally:
        p.release()
        patches.undo()


# -- several ranks in one process ---------------------------------------------------


class _Round:
    """One collective of the group: the k-th collective of every rank."""

    def __init__(self, gen: int, op: str, what: str, step: int | None) -> None:
        self.gen, self.op, self.what, self.step = gen, op, what, step
        self.first: int | None = None  # the rank that opened the round
        self.values: dict[int, Any] = {}
        self.error: tuple[str, int | None, str] | None = None  # (kind, rank, detail)
        self.done = threading.Event()


class FakeGroup:
    """``world_size`` ranks of one save in one process: the coordinator of each
    rank (:meth:`rank`) is passed as ``Checkpointer(root,
    coordinator=group.rank(r))``, and the ranks' collectives meet in memory
    instead of on a gloo group, so a test of what ranks agree on needs no
    ``torch.distributed``, no second process and no private import::

        group = FakeGroup(2)

        async def rank(r: int) -> None:
            async with asyncsave.Checkpointer(root, coordinator=group.rank(r)) as ckpt:
                await (await ckpt.save(1, {"w": torch.full((4,), float(r))}))

        async with anyio.create_task_group() as tg:
            for r in range(2):
                tg.start_soon(rank, r)

    The ranks may run as tasks of one event loop or in threads of their own (a
    :class:`~asyncsave.SyncCheckpointer` each); ``Checkpointer.agree`` exchanges
    its answers from the training thread, blocking, so it needs the ranks in
    threads of their own. The k-th collective of every rank is one round, as on a
    gloo group: a rank whose k-th collective is another one (another name or
    kind) fails the round on every rank with :class:`~asyncsave.RankFailedError`
    naming both, where gloo would exchange garbage or hang.

    Faults, armed before or during a run: :meth:`fail` (a rank dies at a
    collective: the others' collective raises ``RankFailedError`` naming it, at
    once, as the heartbeats of a gloo group tell them) and :meth:`hang` (a rank
    never reaches a collective: the others raise ``RankFailedError`` after
    ``timeout_s``, as gloo's timeout does). A rank whose checkpointer closed is
    named as gone at the next collective that needs it. Not provided: the state
    of DTensors (DCP's collectives need a process group), Megatron's
    integration, a persistent :class:`~asyncsave.Tier` on several ranks.

    :param world_size: the number of ranks (at least 1).
    :param timeout_s: seconds a rank waits at one collective for the others
        (``dist_timeout_s`` of a gloo group).
    :raises ValueError: ``world_size < 1`` or ``timeout_s <= 0``.

    ``log`` lists every collective as it is entered: ``(rank, what, step)``.
    """

    def __init__(self, world_size: int, *, timeout_s: float = 30.0) -> None:
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"world_size={world_size!r} must be an int of at least 1")
        if not timeout_s > 0:
            raise ValueError(f"timeout_s={timeout_s!r} must be above 0")
        self.world_size, self.timeout_s = world_size, timeout_s
        self.log: list[tuple[int, str, int | None]] = []
        self._lock = threading.Lock()
        # A round is the k-th collective of one checkpointer's life on every rank
        # (each rank's ``n``-th checkpointer meets the others' ``n``-th): keyed by
        # (generation, k). A rank's generation moves on when its checkpointer closes.
        self._rounds: dict[tuple[int, int], _Round] = {}
        self._gen = [0] * world_size
        self._seq = [0] * world_size
        self._dead: dict[int, str] = {}  # rank -> how it died (every generation)
        self._closed: dict[tuple[int, int], str] = {}  # (rank, generation) -> left
        self._faults: dict[int, tuple[str, str | None]] = {}  # rank -> (fault, at)
        self._ranks: dict[int, FakeRank] = {}

    def rank(self, rank: int) -> FakeRank:
        """The coordinator of ``rank`` (the same object every call).

        :raises ValueError: ``rank`` is not in ``range(world_size)``.
        """
        self._check_rank("rank", rank)
        with self._lock:
            if rank not in self._ranks:
                self._ranks[rank] = FakeRank(self, rank)
            return self._ranks[rank]

    def fail(self, rank: int, at: str | None = None) -> None:
        """Rank ``rank`` dies at its next collective named ``at`` (any collective
        when ``None``; the names are the engine's, as ``log`` shows them: ``open``,
        ``files-durable``, ``commit``...): that call and every later one of the
        rank raise :class:`~asyncsave.RankFailedError`, and so do the other ranks'
        collectives that need it, naming it in ``ranks``.

        :raises ValueError: ``rank`` is not in ``range(world_size)``.
        """
        self._arm("fail", rank, at)

    def hang(self, rank: int, at: str | None = None) -> None:
        """Rank ``rank`` never reaches its next collective named ``at`` (any when
        ``None``): the other ranks raise :class:`~asyncsave.RankFailedError` (no
        rank named) after ``timeout_s``, and so does the hung call itself then.

        :raises ValueError: ``rank`` is not in ``range(world_size)``.
        """
        self._arm("hang", rank, at)

    def _arm(self, fault: str, rank: int, at: str | None) -> None:
        self._check_rank(fault, rank)
        with self._lock:
            self._faults[rank] = (fault, at)

    def _check_rank(self, name: str, rank: int) -> None:
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < self.world_size:
            raise ValueError(f"{name}: rank={rank!r} is not in range({self.world_size})")

    # -- the rounds (under the lock, never waiting) -------------------------------
    def _fault_for(self, rank: int, what: str) -> str | None:
        fault = self._faults.get(rank)
        if fault is None or fault[1] not in (None, what):
            return None
        del self._faults[rank]
        return fault[0]

    def _enter(self, rank: int, op: str, what: str, obj: Any, step: int | None) -> _Round:
        """Rank ``rank``'s next collective: its round, with ``obj`` added (or the
        round failed, if this rank or a rank it needs is gone)."""
        with self._lock:
            self.log.append((rank, what, step))
            gen, seq = self._gen[rank], self._seq[rank]
            self._seq[rank] += 1
            rnd = self._rounds.setdefault((gen, seq), _Round(gen, op, what, step))
            if rnd.first is None:
                rnd.first = rank
            fault = self._fault_for(rank, what)
            if fault == "fail":
                self._dead[rank] = f"rank {rank} died at the {what} collective (FakeGroup.fail)"
            if rnd.error is None and (rnd.op, rnd.what) != (op, what):
                detail = (
                    f"rank {rank} called {op} {what!r} where rank {rnd.first} called "
                    f"{rnd.op} {rnd.what!r}"
                )
                rnd.error = ("mismatch", None, detail)
            elif fault != "hang" and rank not in self._dead:
                rnd.values[rank] = obj
            self._settle(rnd)
            return rnd

    def _gone(self, gen: int) -> dict[int, str]:
        """The ranks that cannot take part in a round of generation ``gen``."""
        gone = {r: why for (r, g), why in self._closed.items() if g == gen}
        gone.update(self._dead)
        return gone

    def _settle(self, rnd: _Round) -> None:
        """Complete ``rnd`` when every rank is in, or fail it when a rank it still
        needs is gone."""
        missing = [r for r in range(self.world_size) if r not in rnd.values]
        if rnd.error is None and not missing:
            rnd.done.set()
            return
        gone = self._gone(rnd.gen)
        if rnd.error is None and any(r in gone for r in missing):
            rnd.error = ("gone", None, "; ".join(gone[r] for r in missing if r in gone))
        if rnd.error is not None:
            rnd.done.set()

    def _leave(self, rank: int) -> None:
        """Rank ``rank`` closed its checkpointer: the rounds of its generation
        that need it fail; its next checkpointer meets the others' next."""
        with self._lock:
            gen = self._gen[rank]
            self._closed[(rank, gen)] = f"rank {rank} closed its Checkpointer (left the group)"
            self._gen[rank], self._seq[rank] = gen + 1, 0
            for (g, _), rnd in self._rounds.items():
                if g == gen and not rnd.done.is_set():
                    self._settle(rnd)

    def _outcome(self, rank: int, rnd: _Round, timed_out: bool) -> list[Any]:
        """Every rank's object of a completed round, or the round's failure."""
        with self._lock:
            if timed_out and not rnd.done.is_set():
                detail = f"a rank did not reach it within timeout_s={self.timeout_s}"
                rnd.error = ("timeout", None, detail)
                rnd.done.set()
            error = rnd.error
            if rank in self._dead:  # this rank died at it (or before)
                error = ("dead", None, self._dead[rank])
            gone = self._dead if error is None or error[0] == "dead" else self._gone(rnd.gen)
            named = {r: why for r, why in gone.items() if r not in rnd.values}
        if error is None:
            return [rnd.values[r] for r in range(self.world_size)]
        at = f" of step {rnd.step}" if rnd.step is not None else ""
        raise RankFailedError(
            f"rank {rank}: the {rnd.what} collective{at} on the FakeGroup failed: {error[2]}",
            step=rnd.step,
            rank=min(named) if named and error[0] in ("gone", "dead") else None,
            ranks=named if error[0] in ("gone", "dead") else {},
        )


class FakeRank(Coordinator):
    """The coordinator of one rank of a :class:`FakeGroup` (``group.rank(r)``):
    collectives meet the other ranks' in memory, ordered by the save turns of the
    checkpointer using it. Pass it as ``Checkpointer(root, coordinator=...)``; one
    checkpointer at a time per rank."""

    def __init__(self, group: FakeGroup, rank: int) -> None:
        self.fake_group, self.rank, self.world_size = group, rank, group.world_size
        self.timeout_s = group.timeout_s
        self._turns: Turns | None = None  # the collective order of saves

    def __repr__(self) -> str:
        return f"<FakeRank {self.rank} of {self.world_size}>"

    async def _exchange(self, op: str, what: str, obj: Any, step: int | None) -> list[Any]:
        rnd = self.fake_group._enter(self.rank, op, what, obj, step)
        delay = 0.0005
        with anyio.move_on_after(self.timeout_s):
            while not rnd.done.is_set():  # polled: the ranks may run in other threads
                await anyio.sleep(delay)
                delay = min(delay * 2, 0.01)
        return self.fake_group._outcome(self.rank, rnd, not rnd.done.is_set())

    async def broadcast(self, what: str, obj: Any, step: int | None = None) -> Any:
        return (await self._exchange("broadcast", what, obj, step))[0]

    async def all_gather(self, what: str, obj: Any, step: int | None = None) -> list[Any]:
        return await self._exchange("all_gather", what, obj, step)

    def vote(self, values: list[int]) -> list[list[int]]:
        """Blocking (the caller's thread): needs the ranks in threads of their own."""
        step = values[-1] if values else None
        rnd = self.fake_group._enter(self.rank, "vote", "save-policy", list(values), step)
        rnd.done.wait(self.timeout_s)
        return [list(v) for v in self.fake_group._outcome(self.rank, rnd, not rnd.done.is_set())]

    # -- ordering of saves (a rank's collectives in dispatch order) ----------------
    def _order(self) -> Turns:
        if self._turns is None:  # made in the event loop of the rank's checkpointer
            self._turns = Turns()
        return self._turns

    def take_ticket(self) -> int:
        return self._order().take()

    async def wait_turn(self, ticket: int) -> None:
        await self._order().wait(ticket)

    def end_turn(self, ticket: int) -> None:
        self._order().end(ticket)

    def close(self) -> None:
        """This rank's checkpointer closed: the peers' collectives that need it
        fail naming it; the next checkpointer of the rank starts afresh."""
        self._turns = None
        self.fake_group._leave(self.rank)
