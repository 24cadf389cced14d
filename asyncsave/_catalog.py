"""The catalog of a root: what is committed there, which is latest, and what a
committed checkpoint's manifest says.

One home, below both the write side (commit, recovery at open, retention,
incremental saves, tiers, ``update()``) and the read side (``load``, resume, the
listing, the DCP reader, the CLI): "is this step committed?", "which step is
latest?" and "what is in it?" are answered here and nowhere else. Whether a
final-named entry passed its commit point is the root's commit protocol's answer
(``_atomicity``); this module builds every other answer on it. Reading only:
nothing here writes (recovery, which moves things aside, is ``_commit``).
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from ._atomicity import strategy_for
from ._errors import (
    CheckpointNotFoundError,
    CorruptCheckpointError,
    UncommittedCheckpointError,
)
from ._fs import LocalFileSystem
from ._fsspec import open_root
from ._manifest import FORMAT, Manifest, parse_manifest, stored_files
from ._paths import COMMIT_MARKER_NAME, LAYOUTS, MANIFEST_NAME, Layout, aside_dir_step
from ._track import read_tracker
from ._types import CheckpointInfo

__all__ = [
    "check_not_one_checkpoint",
    "committed_steps",
    "info_of",
    "latest",
    "layout_hint",
    "moved_aside",
    "older_committed",
    "read_checkpoint",
    "resolve",
    "scan_steps",
    "step_of_name",
    "stored_info",
]

logger = logging.getLogger(__name__)

_MAX_MANIFEST_BYTES = 1 << 30


def read_checkpoint(
    fs: LocalFileSystem,
    path: Path,
    *,
    expect_step: int | None = None,
    progress: Callable[[int, int], None] | None = None,
    uncommitted: bool = False,
) -> Manifest:
    """Read and validate the manifest of the checkpoint at ``path`` and check that
    every file it names (:func:`stored_files`) has the size it says (no data is read).

    :param expect_step: the step the directory's name says; a manifest of another
        step (a copied or renamed directory) is refused.
    :param progress: called with ``(files checked, data files in all)`` after each
        data file's size is checked (one request each on an object store).
    :param uncommitted: read it even without its commit marker (object stores):
        to decide whether it can be adopted (``_commit.adopt_checkpoint``).
    :raises UncommittedCheckpointError: (object stores) no commit marker, unless
        ``uncommitted``.
    :raises CheckpointNotFoundError: ``path`` has no ``manifest.json`` (the message
        says where it went if it was moved aside at open).
    :raises CorruptCheckpointError: the manifest is damaged or a file is missing,
        truncated or too long.
    """
    if not uncommitted and not strategy_for(fs).passed_commit(fs, path):
        if not fs.exists(path):
            raise _no_manifest_error(fs, path)
        raise _uncommitted_error(fs, path)
    mpath = path / MANIFEST_NAME
    try:
        size = fs.size(mpath)
        if size > _MAX_MANIFEST_BYTES:
            raise CorruptCheckpointError(f"manifest {mpath} is {size} bytes", path=mpath)
        raw = fs.read_bytes(mpath)
    except (FileNotFoundError, NotADirectoryError) as exc:
        raise _no_manifest_error(fs, path) from exc
    except IsADirectoryError as exc:
        raise CorruptCheckpointError(f"{mpath} is a directory", path=mpath) from exc
    manifest = parse_manifest(raw, mpath)
    if expect_step is not None and manifest.step != expect_step:
        raise CorruptCheckpointError(
            f"{path} holds the manifest of step {manifest.step}, not {expect_step} "
            "(a copied or renamed directory?)",
            path=path,
            step=manifest.step,
        )
    stored = stored_files(manifest)
    for done, f in enumerate(stored, 1):
        fpath = path / f.name
        try:
            actual = fs.size(fpath)
        except FileNotFoundError as exc:
            raise CorruptCheckpointError(
                f"data file {fpath} is missing", path=fpath, step=manifest.step
            ) from exc
        if actual != f.nbytes:
            raise CorruptCheckpointError(
                f"data file {fpath} is {actual} bytes, the manifest says {f.nbytes} "
                "(truncated or altered)",
                path=fpath,
                step=manifest.step,
            )
        if progress is not None:
            progress(done, len(stored))
    return manifest


def _uncommitted_error(fs: LocalFileSystem, path: Path) -> UncommittedCheckpointError:
    """Why a final-named prefix without its commit marker is not counted, and how to
    adopt it (object stores)."""
    there = fs.exists(path / MANIFEST_NAME)
    found = "its files and manifest are there" if there else "it has no manifest either"
    return UncommittedCheckpointError(
        f"{path} is not a committed checkpoint: it has no {COMMIT_MARKER_NAME} ({found}): "
        "a save in flight or one that never committed, or a checkpoint copied there by "
        "a sync tool (aws s3 sync, gsutil rsync, rclone copy no commit marker). Nothing "
        f"was deleted. Once no one writes there, `asyncsave adopt {path}` (or "
        "asyncsave.adopt(path)) verifies every byte and commits it; a Checkpointer "
        "opened on the root adopts it the same way, or moves it aside if it does not "
        "verify",
        path=path,
        step=step_of_name(path),
    )


def _no_manifest_error(fs: LocalFileSystem, path: Path) -> CheckpointNotFoundError:
    """``path`` holds no manifest: say where it went if it was moved aside at open
    (a damaged or incomplete checkpoint keeps its bytes under an aside name)."""
    step = step_of_name(path)
    if step is not None and not fs.lexists(path):
        asides = moved_aside(fs, path.parent, step)
        if asides:
            shown = ", ".join(str(a) for a in asides)
            return CheckpointNotFoundError(
                f"{path} does not exist: it was moved aside at open to {shown} by a "
                f"Checkpointer opened on {path.parent} (it did not check out: a file "
                "missing or of the wrong size, a damaged manifest, or no manifest; the "
                "WARNING of that open says which), its bytes kept for inspection; "
                f"`asyncsave verify {asides[-1]}` says what is wrong with it",
                path=path,
                step=step,
            )
    if not fs.lexists(path):
        return CheckpointNotFoundError(
            f"{path} is not a checkpoint: it does not exist", path=path, step=step
        )
    if _holds_checkpoints(fs, path):
        return CheckpointNotFoundError(
            f"{path} is not a checkpoint but a root of checkpoints (it has no "
            f"{MANIFEST_NAME}; its entries are named by step): "
            f"asyncsave.latest({str(path)!r}).path names its newest committed "
            "checkpoint (a Checkpointer's load_latest() reads it)",
            path=path,
            step=step,
        )
    return CheckpointNotFoundError(
        f"{path} is not a checkpoint: it has no {MANIFEST_NAME}", path=path, step=step
    )


def _holds_checkpoints(fs: LocalFileSystem, path: Path) -> bool:
    """Whether ``path`` is a directory with an entry named like a checkpoint of
    some layout (``step_40``, ``iter_0000040``): a root passed as a checkpoint."""
    try:
        names = fs.listdir(path) if fs.is_dir(path) else []
    except OSError:
        return False
    return any(step_of_name(path / n) is not None for n in names)


def moved_aside(fs: LocalFileSystem, root: Path, step: int) -> list[Path]:
    """The entries under ``root`` that recovery moved aside for ``step``
    (``.asyncsave-damaged-<step>-*``, ``.asyncsave-incomplete-<step>-*``)."""
    try:
        names = fs.listdir(root) if fs.is_dir(root) else []
    except OSError:
        return []
    return [root / n for n in sorted(names) if aside_dir_step(n) == step]


def check_not_one_checkpoint(fs: LocalFileSystem, root: Path) -> None:
    """Refuse a root of checkpoints that is itself one checkpoint (it holds an
    asyncsave ``manifest.json``: ``latest(root).path`` passed back as a root). A saver
    there would resume nothing and nest a root inside a committed checkpoint; a
    reader would find no step.

    :raises CheckpointNotFoundError: naming the checkpoint and its root.
    """
    if not (fs.is_dir(root) and fs.exists(root / MANIFEST_NAME)):
        return
    try:  # asyncsave's own manifest only: another tool's manifest.json is no checkpoint
        with fs.open_read(root / MANIFEST_NAME) as f:
            head = f.read(64)
    except OSError:
        return
    if head.startswith(b'{"format":"%s"' % FORMAT.encode()):
        raise CheckpointNotFoundError(
            f"{root} is one checkpoint (it holds {MANIFEST_NAME}), not a root of "
            f"checkpoints: its root is {root.parent}; asyncsave.load({str(root)!r}) "
            "reads it",
            path=root,
        )


def scan_steps(fs: LocalFileSystem, root: Path, layout: Layout) -> dict[int, Path]:
    """Final-named directories under ``root`` by step (not checked for content)."""
    found: dict[int, Path] = {}
    for name in fs.listdir(root):
        step = layout.parse_dir_name(name)
        if step is not None and fs.is_dir(root / name):
            found[step] = root / name
    return found


def stored_info(fs: LocalFileSystem, path: Path, manifest: Manifest) -> CheckpointInfo:
    """:func:`info_of` plus what the checkpoint takes in storage: ``size_bytes``
    (every file the manifest names, the manifest, plus a layout's info file such
    as the ``nemo-rl`` ``training_info.json`` and an object store's commit marker,
    where present) and
    ``saved_unix_s`` (when its manifest was written). One home for every reader
    (:func:`latest`, :func:`verify`, :func:`asyncsave.checkpoints`).

    :raises FileNotFoundError: a file went away meanwhile (retention, prune).
    """
    size = sum(f.nbytes for f in stored_files(manifest)) + fs.size(path / MANIFEST_NAME)
    extras = {lay.info_name for lay in LAYOUTS.values() if lay.info_name is not None}
    extras.update(strategy_for(fs).protocol_files)
    for extra in sorted(extras):
        if fs.exists(path / extra):
            size += fs.size(path / extra)
    return dataclasses.replace(
        info_of(path, manifest), size_bytes=size, saved_unix_s=manifest.created_unix_s
    )


def info_of(path: Path, manifest: Manifest) -> CheckpointInfo:
    costs = manifest.costs
    return CheckpointInfo(
        step=manifest.step,
        path=path,
        nbytes=manifest.nbytes,
        num_tensors=len(manifest.tensors),
        world_size=manifest.world_size,
        blocked_s=costs.get("blocked_s"),
        staged_s=costs.get("staged_s"),
        written_s=costs.get("written_s"),
        training_info=manifest.training_info,
    )


def step_of_name(path: Path) -> int | None:
    """The step a directory's name claims under any layout preset (``step_40``,
    ``global_step_40``, ``iter_0000040``): a copied or swapped directory must not
    load as another step silently."""
    for layout in LAYOUTS.values():
        step = layout.parse_dir_name(path.name)
        if step is not None:
            return step
    return None


def resolve(
    fs: LocalFileSystem, root: Path, layout: Layout, *, fallback: bool, reader: bool = False
) -> CheckpointInfo | None:
    """The checkpoint to resume from: the one the tracker names, or a newer
    committed one.

    The rename is the commit, the tracker follows it: a committed checkpoint newer
    than the tracker (a crash between the two) wins, with a warning, which is also
    what the next :class:`~asyncsave.Checkpointer` open writes into the tracker. A
    missing or unreadable tracker falls back to the newest committed checkpoint,
    with a warning. A tracker naming a checkpoint that is missing or damaged is an
    error unless ``fallback`` (then: warning, newest committed checkpoint). Never
    ``None`` when a tracker names a step, nor when the only checkpoints there are
    uncommitted copies with a manifest (object stores: see
    :class:`UncommittedCheckpointError`): that would restart a trained run from
    scratch. Every final-named entry passed over is logged with the reason.

    ``reader``: called by a reader (:func:`latest`), which may run while a saver
    is between its rename and its tracker write: a committed step newer than the
    tracker (one step ahead of it), or no tracker beside the only committed step,
    is then logged at INFO (the saver's next open repairs a real crash and warns
    there); anything more is a warning, as for a saver.
    """
    if not fs.exists(root):
        return None
    if not fs.is_dir(root):
        raise CheckpointNotFoundError(f"{root} is not a directory", path=root)
    check_not_one_checkpoint(fs, root)
    tracked: int | None = None
    if layout.tracker_name is not None:
        tracker = root / layout.tracker_name
        try:
            tracked = read_tracker(fs, tracker)
        except CorruptCheckpointError as exc:
            logger.warning("%s; scanning for committed checkpoints instead", exc)
    found = scan_steps(fs, root, layout)
    if tracked is not None:
        info = _resolve_tracked(fs, root, layout, found, tracked, fallback=fallback, reader=reader)
        if info is not None:
            return info
    info = _newest_counted(fs, root, layout, found, reader=reader)
    if info is not None:
        return info
    if tracked is not None:
        raise CheckpointNotFoundError(
            f"the tracker in {root} names step {tracked} but no checkpoint there is "
            "loadable (damaged ones are moved aside to .asyncsave-damaged-*); not "
            f"starting from scratch{layout_hint(fs, root, layout)} (to start from scratch "
            f"on purpose, remove {root / str(layout.tracker_name)})",
            path=root,
            step=tracked,
        )
    hint = layout_hint(fs, root, layout)
    if hint:
        # Another preset's checkpoints are here: None would restart a trained run.
        raise CheckpointNotFoundError(
            f"no {layout.name!r}-layout checkpoint in {root}{hint}", path=root
        )
    _refuse_uncommitted_copies(fs, root, found)
    return None


def _counted(fs: LocalFileSystem, path: Path, step: int) -> CheckpointInfo:
    """The info of the committed checkpoint of ``step`` at ``path``.

    :raises CheckpointNotFoundError: (or :class:`UncommittedCheckpointError`) it is
        not one.
    :raises CorruptCheckpointError: it is damaged.
    """
    return stored_info(fs, path, read_checkpoint(fs, path, expect_step=step))


def _resolve_tracked(
    fs: LocalFileSystem,
    root: Path,
    layout: Layout,
    found: dict[int, Path],
    tracked: int,
    *,
    fallback: bool,
    reader: bool,
) -> CheckpointInfo | None:
    """A committed step newer than the tracker, else the tracked one; ``None`` to
    fall back to the newest (``fallback``, with a warning).

    :raises CheckpointNotFoundError: the tracked checkpoint is not loadable and not
        ``fallback``.
    """
    newer = sorted((s for s in found if s > tracked), reverse=True)
    # A saver commits, then moves the tracker: one step ahead of it may be a save
    # in flight; more cannot (saves commit and track one at a time).
    in_flight = reader and len(newer) == 1
    for step in newer:
        try:
            info = _counted(fs, found[step], step)
        except (CheckpointNotFoundError, CorruptCheckpointError) as exc:
            # One step ahead of the tracker without its marker: a save in flight.
            quiet = in_flight and isinstance(exc, UncommittedCheckpointError)
            logger.log(logging.INFO if quiet else logging.WARNING, "not counting %s", exc)
            continue
        logger.log(
            logging.INFO if in_flight else logging.WARNING,
            "the tracker in %s names step %d but step %d is committed (%s); resuming from %d",
            root,
            tracked,
            step,
            "a save moving the tracker now, or a crash between its commit and its tracker update"
            if in_flight
            else "a crash between commit and tracker update?",
            step,
        )
        return info
    path = root / layout.dir_name(tracked)
    try:
        return _counted(fs, path, tracked)
    except (CheckpointNotFoundError, CorruptCheckpointError) as exc:
        if not fallback:
            # Another preset's directories here (the tracker name is shared by
            # several presets): the layout is the fix, not the fallback.
            hint = layout_hint(fs, root, layout)
            uncommitted = isinstance(exc, UncommittedCheckpointError)
            advice = hint or (
                ""  # its message says how to adopt it
                if uncommitted
                else _fallback_advice(root, layout, found, tracked)
            )
            error = UncommittedCheckpointError if uncommitted else CheckpointNotFoundError
            raise error(
                f"the tracker in {root} names step {tracked}, but {path} is not a "
                f"loadable checkpoint ({exc}){advice}",
                path=path,
                step=tracked,
            ) from exc
        logger.warning("%s; falling back to the newest committed checkpoint", exc)
    return None


def _fallback_advice(root: Path, layout: Layout, found: dict[int, Path], tracked: int) -> str:
    """What to do when the tracked step is not loadable: fall back where another
    step is here; otherwise say how to start from scratch on purpose."""
    if any(step != tracked for step in found):
        return "; pass fallback=True to resume from the newest committed checkpoint instead"
    return (
        "; no other checkpoint is here to fall back to (to start from scratch on "
        f"purpose, remove {root / str(layout.tracker_name)})"
    )


def _newest_counted(
    fs: LocalFileSystem, root: Path, layout: Layout, found: dict[int, Path], *, reader: bool
) -> CheckpointInfo | None:
    """The newest committed checkpoint of ``found`` (logging each one passed over
    and why), or ``None``."""
    for step in sorted(found, reverse=True):
        try:
            info = _counted(fs, found[step], step)
        except (CheckpointNotFoundError, CorruptCheckpointError) as exc:
            logger.warning("not counting %s", exc)
            continue
        if layout.tracker_name is not None:
            # A first save between its rename and its first tracker write: one
            # committed step, no tracker yet. A lost tracker beside more is a warning.
            missing = reader and len(found) == 1 and not fs.lexists(root / layout.tracker_name)
            logger.log(
                logging.INFO if missing else logging.WARNING,
                "no usable tracker in %s%s; resuming from the newest committed step %d",
                root,
                " (none yet: a first save moving it now, or a crash before it)" if missing else "",
                step,
            )
        return info
    return None


def _refuse_uncommitted_copies(fs: LocalFileSystem, root: Path, found: dict[int, Path]) -> None:
    """Nothing committed under ``root``: refuse rather than answer "nothing here"
    when final-named prefixes with a manifest lack only their commit marker (a run
    copied by a sync tool): a resume would start the trained run from scratch.

    :raises UncommittedCheckpointError: naming them and how to adopt them.
    """
    copies = [p for _, p in sorted(found.items()) if fs.exists(p / MANIFEST_NAME)]
    if not strategy_for(fs).writes_in_place or not copies:
        return
    shown = ", ".join(p.name for p in copies)
    raise UncommittedCheckpointError(
        f"no committed checkpoint in {root}, but {shown} hold files and a manifest "
        f"without their {COMMIT_MARKER_NAME} (copied by a sync tool, or saves that "
        f"stopped before their commit marker); nothing was deleted. `asyncsave adopt "
        f"{copies[-1]}` (or asyncsave.adopt) verifies every byte and commits one; a "
        "Checkpointer opened on the root adopts every one that verifies",
        path=copies[-1],
        step=step_of_name(copies[-1]),
    )


def layout_hint(fs: LocalFileSystem, root: Path, layout: Layout) -> str:
    """A hint naming the other layout presets whose directories ``root`` holds
    (a root written with ``layout="verl"`` opened with the default), or ``""``."""
    others = [
        other.name
        for other in LAYOUTS.values()
        if other.dir_format != layout.dir_format and scan_steps(fs, root, other)
    ]
    if not others:
        return ""
    names = " or ".join(repr(n) for n in others)
    return f"; it holds checkpoints of the {names} layout: pass layout={others[0]!r}"


def older_committed(
    fs: LocalFileSystem, root: Path, layout: Layout, below: int
) -> CheckpointInfo | None:
    """The newest checkpoint under ``root`` older than step ``below`` whose manifest
    and file sizes check out, or ``None``."""
    found = scan_steps(fs, root, layout)
    for step in sorted((s for s in found if s < below), reverse=True):
        try:
            return info_of(found[step], read_checkpoint(fs, found[step], expect_step=step))
        except (CheckpointNotFoundError, CorruptCheckpointError) as exc:
            logger.warning("skipping %s: %s", found[step], exc)
    return None


def latest(
    root: str | os.PathLike[str],
    *,
    layout: str = "asyncsave",
    fallback: bool = False,
    filesystem: LocalFileSystem | None = None,
    storage_options: Mapping[str, Any] | None = None,
) -> CheckpointInfo | None:
    """The latest committed checkpoint under ``root``, or ``None`` if there is none.

    Reads the tracker; checks the manifest and file sizes of the checkpoint it names
    (not the checksums: :func:`verify` does that). ``root`` may be a URL
    (``s3://bucket/exp1``); ``filesystem`` and ``storage_options`` as for :func:`load`.

    :raises CheckpointNotFoundError: the tracker names a checkpoint that is missing
        or damaged and ``fallback`` is false, or ``root`` is itself one checkpoint.
    """
    fs, path = open_root(root, filesystem=filesystem, storage_options=storage_options)
    return resolve(fs, path, LAYOUTS[layout], fallback=fallback, reader=True)


def committed_steps(fs: LocalFileSystem, root: Path, layout: Layout) -> dict[int, Path]:
    """The committed checkpoints under ``root`` by step (under a final name, and
    on object stores with their commit marker); their bytes are not checked."""
    if not fs.exists(root):
        return {}
    strategy = strategy_for(fs)
    return {s: p for s, p in scan_steps(fs, root, layout).items() if strategy.passed_commit(fs, p)}
