"""The ``asyncsave`` command: list, verify, inspect and prune checkpoints.

::

    asyncsave ls ROOT          committed steps, sizes, the tracked one, stray temp dirs
    asyncsave verify PATH      every checksum of one checkpoint (or of every one in ROOT)
    asyncsave inspect PATH     the state tree with dtype, shape and bytes per tensor
    asyncsave prune ROOT --keep-last N [--keep-every K] [--keep-best METRIC N] [--dry-run]
    asyncsave adopt PATH       commit a checkpoint copied without its commit marker
    asyncsave export --format hf PATH OUT   the model's weights as a Hugging Face directory

ROOT and PATH may be URLs (``s3://bucket/prefix``, any fsspec URL). Credentials
and endpoint come from the environment as the fsspec implementation reads them
(``AWS_ACCESS_KEY_ID``, ``AWS_ENDPOINT_URL``...) or from ``--storage-options JSON``.

Only ``prune`` deletes, through the engine's own retention pass (``_retention``:
rename aside, fsync, remove; never the tracked step, the newest committed one or a
step with a save in flight), holding the root's saver lock (a live
``Checkpointer`` on the root makes it refuse). ``adopt`` writes one file, the commit
marker of a checkpoint a sync tool copied without it, after a full verify. A root
that cannot be locked, written or listed is one line on stderr and exit status 1.
``verify`` shows a progress bar of
the bytes hashed and ``inspect`` one of the data files checked (tqdm, on stderr:
on a terminal when it lasts over half a second; ``--progress`` forces it,
``--no-progress`` hides it). Torch is imported only by the commands that read
checkpoints: ``--help`` and ``--version`` answer without it.

Exit status 0 on success, 1 when a
checkpoint fails verification or cannot be read, 2 on bad usage, which includes
``ls`` of one checkpoint and ``inspect`` of a root: the message names the command
that fits (and ``ls``/``verify`` of a root holding only another layout's
directories name the ``--layout`` that finds them). ``asyncsave --version`` prints
the installed distribution's version.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib.metadata
import json
import os
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

# Torch-free imports only at module level (``--help`` must not load torch): the
# modules that read checkpoints (``_load`` and what needs it) are imported by the
# commands that use them.
from ._errors import CheckpointError
from ._fs import LOCK_MODES, LocalFileSystem
from ._fsspec import open_root
from ._paths import LAYOUTS, MANIFEST_NAME, Layout, is_temp_name, temp_dir_step

if TYPE_CHECKING:
    from ._manifest import Manifest

__all__ = ["main"]


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError


def _checkpoint_dir(fs: LocalFileSystem, path: Path) -> Path | None:
    """``path`` (or its directory, for a ``manifest.json``) if it is one checkpoint."""
    if path.name == MANIFEST_NAME and not fs.is_dir(path):
        return path.parent
    if fs.is_dir(path) and fs.exists(path / MANIFEST_NAME):
        return path
    return None


def _steps_by_layout(fs: LocalFileSystem, root: Path) -> dict[str, dict[int, Path]]:
    """The final-named directories under ``root`` of the layouts that have some;
    where layouts share a directory pattern (``global_step_N``: verl and skyrl),
    only those whose tracker file is there too, if any is."""
    from ._catalog import scan_steps

    found = {name: scan_steps(fs, root, layout) for name, layout in sorted(LAYOUTS.items())}
    found = {name: steps for name, steps in found.items() if steps}
    tracked = {
        name: steps
        for name, steps in found.items()
        if (t := LAYOUTS[name].tracker_name) is not None and fs.exists(root / t)
    }
    return tracked or found


def _foreign_dcp_hint(fs: LocalFileSystem, path: Path) -> str | None:
    """When ``path`` is a directory DCP's own ``FileSystemWriter`` wrote (its
    ``.metadata``, no manifest): say so, and what reads it."""
    if fs.exists(path / MANIFEST_NAME) or not fs.exists(path / DCP_METADATA_FILE):
        return None
    return (
        f"{path} was written by torch.distributed.checkpoint's FileSystemWriter "
        f"({DCP_METADATA_FILE}, no {MANIFEST_NAME}), not committed by asyncsave: it has "
        "no checksums to verify or list; dcp.load with asyncsave.dcp.StorageReader(path) "
        "or DCP's FileSystemReader(path) reads it"
    )


def _layout_hint(fs: LocalFileSystem, root: Path, layout_name: str) -> str | None:
    """When ``root`` holds no directory of ``layout_name`` but some of others: say
    which ``--layout`` finds them; when it is a directory DCP's own writer wrote,
    say that."""
    foreign = _foreign_dcp_hint(fs, root)
    if foreign is not None:
        return foreign
    others = [n for n in _steps_by_layout(fs, root) if n != layout_name]
    if not others:
        return None
    options = " or ".join(f"--layout {n}" for n in others)
    return (
        f"no checkpoint of layout {layout_name!r} here, but directories of {others}: pass {options}"
    )


def _layout_option(dir_name: str) -> str:
    """`` --layout NAME`` for a checkpoint directory named by another preset than
    the default (``iter_0000040``: megatron), else ``""``."""
    if LAYOUTS["asyncsave"].parse_dir_name(dir_name) is not None:
        return ""
    for name, layout in LAYOUTS.items():
        if layout.parse_dir_name(dir_name) is not None:
            return f" --layout {name}"
    return ""


def _uncommitted(fs: LocalFileSystem, path: Path) -> str:
    """What ``ls`` says of a final-named prefix without its commit marker (object
    stores), and what the next open will do with it: nothing is deleted."""
    from ._catalog import read_checkpoint

    try:
        read_checkpoint(fs, path, expect_step=_step_of(path), uncommitted=True)
    except CheckpointError as exc:
        return (
            f"not counted: no commit marker, and not a whole checkpoint ({exc}): a save "
            "that stopped, or a copy still under way or cut short; the next open moves it "
            "aside (bytes kept)"
        )
    return (
        "not counted: no commit marker, but its manifest and file sizes check out (a "
        "copy by a sync tool, or a save just before its marker): "
        f"`asyncsave adopt {path}` verifies every byte and commits it (the next open "
        "adopts it too)"
    )


def _step_of(path: Path) -> int | None:
    from ._catalog import step_of_name

    return step_of_name(path)


def _missing(fs: LocalFileSystem, root: Path, step: int) -> str:
    """The end of ``ls``'s line for a tracked step that is not there."""
    from ._catalog import moved_aside

    asides = moved_aside(fs, root, step)
    if asides:
        return (
            f"which was moved aside at open to {asides[-1].name} (not loadable; its "
            f"bytes are kept: `asyncsave verify {asides[-1]}` says why)"
        )
    return "which is missing"


def cmd_adopt(fs: LocalFileSystem, path: Path, args: argparse.Namespace, out: TextIO) -> int:
    """``asyncsave adopt PATH``: verify one checkpoint copied without its commit
    marker, then commit it."""
    from ._atomicity import strategy_for
    from ._commit import adopt

    if path.name == MANIFEST_NAME:
        path = path.parent
    if not fs.exists(path):
        print(f"asyncsave: {path}: no such file or directory", file=sys.stderr)
        return 1
    was = fs.is_dir(path) and strategy_for(fs).passed_commit(fs, path)
    try:
        info = adopt(path, filesystem=fs)
    except CheckpointError as exc:
        print(f"asyncsave: not adopted, nothing written: {exc}", file=sys.stderr)
        return 1
    done = "already committed; verified" if was else "verified, commit marker written"
    print(f"ok   {path}: step {info.step}, {_size(info.nbytes)}: {done}", file=out)
    return 0


def cmd_export(fs: LocalFileSystem, path: Path, args: argparse.Namespace, out: TextIO) -> int:
    """``asyncsave export --format hf PATH OUT``: the model's weights of one
    checkpoint as ``model.safetensors`` (or shards and their index) in OUT."""
    import torch

    from ._export import export_hf

    if path.name == MANIFEST_NAME:
        path = path.parent
    try:
        written = export_hf(
            path,
            args.out,
            key=args.key,
            config=args.config,
            max_shard_bytes=args.max_shard_size,
            dtype=None if args.dtype is None else getattr(torch, args.dtype),
            filesystem=fs,
        )
    except CheckpointError:
        raise  # a finding about the checkpoint: status 1 (see _run)
    except (ValueError, TypeError) as exc:
        # A request that cannot be met (OUT in a checkpoint or a URL, a --config
        # file that is not a JSON object): one line and status 2, as a usage error.
        print(f"asyncsave export: {exc}", file=sys.stderr)
        return 2
    for f in written:
        print(f"wrote {f} ({_size(f.stat().st_size)})", file=out)
    return 0


def _check_root(fs: LocalFileSystem, root: Path, instead: Callable[[Path], str]) -> int | None:
    """The exit status for a ROOT argument that is not a root of checkpoints, after
    one line on stderr: 1 when it is missing or not a directory, 2 when it is one
    checkpoint (``instead(checkpoint)`` names the command that fits); None for a root."""
    if not fs.exists(root):
        print(f"asyncsave: {root}: no such file or directory", file=sys.stderr)
        return 1
    one = _checkpoint_dir(fs, root)
    if one is not None:
        print(
            f"asyncsave: {root} is one checkpoint, not a root of checkpoints: {instead(one)}",
            file=sys.stderr,
        )
        return 2
    if not fs.is_dir(root):
        print(f"asyncsave: {root} is not a directory", file=sys.stderr)
        return 1
    return None


def _tracker_note(fs: LocalFileSystem, root: Path, layout: Layout) -> tuple[int | None, str]:
    """The step the tracker names (None: no tracker, or a damaged one) and what
    ``ls`` says of it."""
    from ._track import read_tracker

    if layout.tracker_name is None:
        return None, "no tracker"
    try:
        tracked = read_tracker(fs, root / layout.tracker_name)
    except CheckpointError as exc:
        return None, f"tracker damaged: {exc}"
    return tracked, "no tracker" if tracked is None else f"tracker -> step {tracked}"


def _ls_steps(fs: LocalFileSystem, steps: dict[int, Path], tracked: int | None, out: TextIO) -> int:
    """One line per final-named directory (``*``: the tracked one); 1 if one of
    them is committed but does not load."""
    from ._atomicity import strategy_for
    from ._catalog import read_checkpoint

    rc = 0
    strategy = strategy_for(fs)
    for step in sorted(steps):
        path = steps[step]
        head = f" {'*' if step == tracked else ' '} {path.name:<20} step {step:>10}  "
        if not strategy.passed_commit(fs, path):
            print(f"{head}{_uncommitted(fs, path)}", file=out)
            continue
        try:
            m = read_checkpoint(fs, path, expect_step=step)
            count = _num_tensors(fs, path, m)
        except CheckpointError as exc:
            rc = 1
            print(f"{head}NOT LOADABLE: {exc}", file=out)
            continue
        print(f"{head}{_shown_size(m):>10}  {count:>6} tensors{_format_note(m)}", file=out)
    return rc


def _ls_instead(one: Path) -> str:
    return (
        f"`asyncsave inspect {one}` prints its state tree, `asyncsave verify {one}` "
        f"checks it, `asyncsave ls {one.parent}{_layout_option(one.name)}` lists the "
        "root it is in"
    )


def cmd_ls(fs: LocalFileSystem, root: Path, args: argparse.Namespace, out: TextIO) -> int:
    """``asyncsave ls ROOT``: committed steps, sizes, the tracked one, stray temp dirs."""
    from ._catalog import scan_steps

    rc = _check_root(fs, root, _ls_instead)
    if rc is not None:
        return rc
    layout = LAYOUTS[args.layout]
    tracked, tracker_note = _tracker_note(fs, root, layout)
    print(f"{root}  ({tracker_note})", file=out)
    steps = scan_steps(fs, root, layout)
    rc = _ls_steps(fs, steps, tracked, out)
    hint = None if steps else _layout_hint(fs, root, args.layout)
    if hint is not None:
        # Another preset's root: its tracker names a step of that layout, not a
        # missing one of this layout.
        print(f"   {hint}", file=out)
        return 1
    if tracked is not None and tracked not in steps:
        rc = 1
        print(f"   tracker names step {tracked}, {_missing(fs, root, tracked)}", file=out)
    if not steps:
        print("   no checkpoint here", file=out)
    _ls_strays(fs, root, out)
    return rc


def _ls_strays(fs: LocalFileSystem, root: Path, out: TextIO) -> None:
    """The temporary and moved-aside directories under ``root``."""
    for name in fs.listdir(root):
        if is_temp_name(name):
            print(
                f"   {name}  (temporary: an uncommitted save; removed at the next open)", file=out
            )
        elif name.startswith((".asyncsave-damaged-", ".asyncsave-incomplete-")):
            print(f"   {name}  (moved aside at open: not a loadable checkpoint)", file=out)


class _Bar:
    """A tqdm progress bar on stderr, fed from reading threads (``update`` takes a
    lock: several files are hashed at once); lines printed while it shows go
    through ``write`` so they do not tear it."""

    def __init__(self, enabled: bool | None, total: int, desc: str, unit: str) -> None:
        from tqdm import tqdm

        self._tqdm = tqdm
        self._lock = threading.Lock()
        self.bar = tqdm(
            total=total,
            desc=desc,
            unit=unit,
            unit_scale=unit == "B",
            unit_divisor=1024,
            # None: shown only on a terminal (tqdm's own test), after half a second.
            disable=None if enabled is None else not enabled,
            delay=0.5 if enabled is None else 0,
            file=sys.stderr,
            dynamic_ncols=True,
        )

    def update(self, n: int) -> None:
        with self._lock:
            self.bar.update(n)

    def set(self, done: int, total: int) -> None:
        with self._lock:
            self.bar.total = total
            self.bar.update(done - self.bar.n)

    def write(self, line: str, out: TextIO) -> None:
        with self._lock:
            self._tqdm.write(line, file=out)

    def close(self) -> None:
        self.bar.close()


@contextlib.contextmanager
def _bar(enabled: bool | None, total: int, desc: str, unit: str = "B") -> Iterator[_Bar]:
    bar = _Bar(enabled, total, desc, unit)
    try:
        yield bar
    finally:
        bar.close()


def cmd_verify(fs: LocalFileSystem, path: Path, args: argparse.Namespace, out: TextIO) -> int:
    """``asyncsave verify PATH``: every checksum of one checkpoint, or of each in a root."""
    from ._catalog import read_checkpoint, scan_steps
    from ._decode import verify

    if not fs.exists(path):
        print(f"asyncsave: {path}: no such file or directory", file=sys.stderr)
        return 1
    if path.name == MANIFEST_NAME:
        path = path.parent
    if fs.exists(path / MANIFEST_NAME) or not fs.is_dir(path):
        targets = [path]
    else:
        targets = [p for _, p in sorted(scan_steps(fs, path, LAYOUTS[args.layout]).items())]
        if not targets:
            hint = _layout_hint(fs, path, args.layout)
            print(
                f"asyncsave: no checkpoint in {path}{f': {hint}' if hint else ''}", file=sys.stderr
            )
            return 1
    # The bar's total: the bytes to hash, from the manifests (one that does not
    # read fails below, in its turn, and adds nothing).
    total = 0
    for target in targets:
        with contextlib.suppress(CheckpointError, OSError):
            m = read_checkpoint(fs, target)
            total += m.nbytes + m.whole_nbytes
    desc = "verify" if len(targets) == 1 else f"verify {len(targets)} checkpoints"
    rc = 0
    with _bar(args.progress, total, desc) as bar:
        for target in targets:
            try:
                info = verify(target, filesystem=fs, progress=bar.update)
                m = read_checkpoint(fs, target)
                count = _num_tensors(fs, target, m)
            except CheckpointError as exc:
                rc = 1
                bar.write(f"FAIL {target}: {exc}", out)
                continue
            bar.write(
                f"ok   {target}: step {info.step}, {count} tensors, "
                f"{_size(info.nbytes + m.whole_nbytes)} verified",
                out,
            )
    return rc


def _describe(node: Any, m: Manifest, indent: int, label: str, out: TextIO) -> None:
    pad = "  " * indent
    kind = node.get("type") if isinstance(node, dict) else None
    if kind in ("tensor", "pickle"):
        rec = m.tensors[node["index"]]
        entry = m.entries[rec["entry"]]
        size = f"{entry['nbytes']} B" if rec["stride"] is None else "(shares a storage)"
        if "chunks" in rec:
            nbytes = sum(m.entries[j]["nbytes"] for j in rec["chunks"])
            size = f"{nbytes} B in {len(rec['chunks'])} row chunks"
        extra = f" {rec['kind']}" if rec["kind"] not in ("tensor",) else ""
        print(f"{pad}{label}: {rec['dtype']} {rec['shape']} {size}{extra}", file=out)
    elif kind == "dict":
        print(f"{pad}{label}: {'OrderedDict' if node.get('ordered') else 'dict'}", file=out)
        for (_, key), sub in node["items"]:
            _describe(sub, m, indent + 1, repr(key), out)
    elif (
        kind in ("list", "tuple")
        and len(node["items"]) > 6
        and all(
            isinstance(i, dict) and i.get("type") in ("int", "bool", "str") for i in node["items"]
        )
    ):
        values = [i["v"] for i in node["items"]]
        print(f"{pad}{label}: {kind}[{len(values)}] {values[:3]} ... {values[-1]!r}", file=out)
    elif kind in ("list", "tuple"):
        print(f"{pad}{label}: {kind}[{len(node['items'])}]", file=out)
        for i, sub in enumerate(node["items"]):
            _describe(sub, m, indent + 1, f"[{i}]", out)
    elif kind == "tensordict":
        print(f"{pad}{label}: TensorDict batch_size={node['batch_size']}", file=out)
        for key, sub in node["items"]:
            _describe(
                sub.get("value", sub) if sub.get("type") == "nontensor" else sub,
                m,
                indent + 1,
                repr(key),
                out,
            )
    elif kind == "stateful":
        print(f"{pad}{label}: state_dict of {node['class']}", file=out)
        _describe(node["state"], m, indent + 1, "state", out)
    elif kind == "foreign":
        print(f"{pad}{label}: files of {node.get('format')!r}, committed by asyncsave", file=out)
    elif kind == "tagged":
        print(f"{pad}{label}: kind {node['kind']!r}", file=out)
        _describe(node["value"], m, indent + 1, "value", out)
    else:
        value = node.get("v") if isinstance(node, dict) else node
        if kind == "float" and isinstance(value, str):
            value = float.fromhex(value)
        print(f"{pad}{label}: {kind} {value!r}"[:200], file=out)


def _num_tensors(fs: LocalFileSystem, path: Path, m: Manifest) -> int:
    """Tensors in the checkpoint at ``path``: the manifest's records, or for one
    written through DCP (DTensor state), the tensors of DCP's metadata (each
    counted once, however many ranks hold shards of it)."""
    if m.tree.get("type") != "dcp":
        return len(m.tensors)
    from ._dcp_read import dcp_items

    return sum(1 for _, dtype, _ in dcp_items(fs, path) if dtype is not None)


DCP_METADATA_FILE = ".metadata"  # torch.distributed.checkpoint's (no torch import here)


def _compressed_nbytes(m: Manifest) -> int | None:
    """Stored bytes of the files of DCP's own format (a save with stream transforms,
    ``_extensions``), or ``None`` for any other checkpoint."""
    sizes = [f.nbytes for f in m.whole_files if f.name != DCP_METADATA_FILE]
    return sum(sizes) if sizes else None


def _shown_size(m: Manifest) -> str:
    """The size ``ls`` and ``inspect`` show: tensor bytes, or for a save in DCP's
    own (compressed) files, whose tensors have no entries, the bytes stored."""
    stored = _compressed_nbytes(m)
    return _size(m.nbytes) if stored is None else _size(stored)


def _format_note(m: Manifest) -> str:
    if m.tree.get("type") != "dcp":
        return ""
    if _compressed_nbytes(m) is not None:
        return " (torch.distributed.checkpoint, DCP's own files: size as stored)"
    return " (torch.distributed.checkpoint)"


def _describe_dcp(fs: LocalFileSystem, path: Path, out: TextIO) -> None:
    """Every key of a DCP checkpoint with its dtype and global shape."""
    from ._dcp_read import dcp_items

    print(
        "state: written through torch.distributed.checkpoint: "
        "Checkpointer.load_latest(template) resumes it, as does dcp.load with "
        "asyncsave.dcp.StorageReader",
        file=out,
    )
    for key, dtype, shape in dcp_items(fs, path):
        what = "plain value" if dtype is None else f"{dtype} {list(shape)}"
        print(f"  {key}: {what}", file=out)


def cmd_inspect(fs: LocalFileSystem, path: Path, args: argparse.Namespace, out: TextIO) -> int:
    """``asyncsave inspect PATH``: the state tree of one checkpoint."""
    from ._catalog import read_checkpoint

    if not fs.exists(path):
        print(f"asyncsave: {path}: no such file or directory", file=sys.stderr)
        return 1
    if path.name == MANIFEST_NAME:
        path = path.parent
    if fs.is_dir(path) and not fs.exists(path / MANIFEST_NAME):
        found = _steps_by_layout(fs, path)
        if found:
            steps = sorted(set().union(*found.values()))
            name, by_step = next(iter(found.items()))
            shown = ", ".join(map(str, steps[:5])) + (", ..." if len(steps) > 5 else "")
            print(
                f"asyncsave: {path} is a root of checkpoints (steps {shown}), not one "
                f"checkpoint: `asyncsave ls {path}{'' if name == 'asyncsave' else f' --layout {name}'}` "
                f"lists them, `asyncsave inspect {by_step[max(by_step)]}` prints one",
                file=sys.stderr,
            )
            return 2
        foreign = _foreign_dcp_hint(fs, path)
        if foreign is not None:
            print(f"asyncsave: {foreign}", file=sys.stderr)
            return 1
    try:
        # The bar counts data files whose size is checked (a request each on an
        # object store); the tree is printed after it closes.
        with _bar(args.progress, 0, "check files", unit="file") as bar:
            m = read_checkpoint(
                fs,
                path,
                expect_step=LAYOUTS["asyncsave"].parse_dir_name(path.name),
                progress=bar.set,
            )
        count = _num_tensors(fs, path, m)
    except CheckpointError as exc:
        print(f"asyncsave: {exc}", file=sys.stderr)
        return 1
    print(
        f"{path}: step {m.step}, world size {m.world_size}, "
        f"{count} tensors, {_shown_size(m)}{_format_note(m)}",
        file=out,
    )
    try:
        if m.tree.get("type") == "dcp":
            _describe_dcp(fs, path, out)
        else:
            _describe(m.tree, m, 0, "state", out)
    except (KeyError, IndexError, TypeError, ValueError, AttributeError) as exc:
        # The manifest passed its own checksum but its tree is malformed.
        print(f"asyncsave: damaged state tree in {path}: {exc!r}", file=sys.stderr)
        return 1
    return 0


def _rule(args: argparse.Namespace) -> Any:
    """The retention rule of ``prune``'s options (combined with ``|``: any keeps)."""
    from ._retention import KeepBest, KeepEvery, KeepLast

    rules = [
        *(KeepLast(n) for n in args.keep_last or ()),
        *(KeepEvery(n) for n in args.keep_every or ()),
        *(KeepBest(int(n), metric=m, mode=args.mode) for m, n in args.keep_best or ()),
    ]
    combined = rules[0]
    for r in rules[1:]:
        combined = combined | r
    return combined


def _unrecorded_metric(fs: LocalFileSystem, root: Path, args: argparse.Namespace) -> str | None:
    """The refusal for a ``--keep-best`` metric that no checkpoint of ``root``
    records (a typo, another name): it would rank nothing, and the rule would keep
    only what other rules keep. None when every metric is recorded somewhere."""
    from ._listing import checkpoints

    infos = checkpoints(root, layout=args.layout, filesystem=fs)
    seen = {k for c in infos for k in (c.training_info or {})}
    for metric, _ in args.keep_best or ():
        if infos and metric not in seen:
            return (
                f"no checkpoint in {root} records {metric!r} in its training_info "
                f"(recorded: {', '.join(sorted(seen)) or 'nothing'}); nothing deleted"
            )
    return None


def _protected(fs: LocalFileSystem, root: Path, layout: Layout) -> Callable[[], set[int]]:
    """What ``prune`` never deletes, asked again by each pass: the tracked step
    (what resume loads) and every step with a save in flight (a temporary
    directory: a standalone DCP writer writes one without the root's lock). The
    newest committed step is kept by the rule's pass."""
    from ._track import read_tracker

    def protected() -> set[int]:
        steps = {s for name in fs.listdir(root) if (s := temp_dir_step(name)) is not None}
        if layout.tracker_name is not None:
            with contextlib.suppress(CheckpointError):  # damaged: newest is kept anyway
                tracked = read_tracker(fs, root / layout.tracker_name)
                if tracked is not None:
                    steps.add(tracked)
        return steps

    return protected


def _prune_instead(one: Path) -> str:
    return f"`asyncsave prune {one.parent}{_layout_option(one.name)} ...` prunes the root it is in"


def cmd_prune(fs: LocalFileSystem, root: Path, args: argparse.Namespace, out: TextIO) -> int:
    """``asyncsave prune ROOT``: apply a retention rule to ``root`` once, as a
    ``Checkpointer`` does after each commit (``_retention.apply_retention``), under
    the root's saver lock (``--dry-run``: without it, deleting nothing)."""
    from ._retention import retention_plan

    rc = _check_root(fs, root, _prune_instead)
    if rc is not None:
        return rc
    rule = _rule(args)
    refusal = _unrecorded_metric(fs, root, args) if args.keep_best else None
    if refusal is not None:
        print(f"asyncsave: {refusal}", file=sys.stderr)
        return 2
    layout = LAYOUTS[args.layout]
    protected = _protected(fs, root, layout)
    print(f"{root}: prune with {rule!r}", file=out)
    if not args.dry_run:
        return _prune_locked(fs, root, layout, rule, protected, args, out)
    # No lock: a preview, which a running Checkpointer does not block.
    doomed = retention_plan(fs, root, layout, rule, protected)
    for step in doomed:
        print(f"  would delete {layout.dir_name(step)}", file=out)
    print(f"{len(doomed)} would be deleted (dry run: nothing changed)", file=out)
    return 0


def _prune_locked(
    fs: LocalFileSystem,
    root: Path,
    layout: Layout,
    rule: Any,
    protected: Callable[[], set[int]],
    args: argparse.Namespace,
    out: TextIO,
) -> int:
    """``prune``'s deleting pass under the root's saver lock: 1 when the lock is
    held or unavailable (nothing deleted) or when a planned step stayed."""
    from ._commit import hold_root
    from ._errors import LockUnavailableError, RootInUseError
    from ._retention import apply_retention, retention_plan

    try:
        with hold_root(fs, root, timeout_s=args.lock_timeout, lock=args.lock):
            planned = retention_plan(fs, root, layout, rule, protected)
            retired = apply_retention(fs, root, layout, rule, protected)
    except RootInUseError as exc:
        print(
            f"asyncsave: {exc}; nothing deleted. Pass retention= to that Checkpointer "
            "instead (it prunes after each commit), or prune once it is closed",
            file=sys.stderr,
        )
        return 1
    except LockUnavailableError as exc:
        print(f"asyncsave: {exc}; nothing deleted", file=sys.stderr)
        return 1
    for step in retired:
        print(f"  deleted {layout.dir_name(step)}", file=out)
    failed = [layout.dir_name(s) for s in planned if s not in retired]
    print(f"{len(retired)} deleted", file=out)
    if failed:
        print(
            f"asyncsave: could not delete {', '.join(failed)} (see the warnings above); "
            "the next prune or commit retries",
            file=sys.stderr,
        )
        return 1
    return 0


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}")
    return value


def _version() -> str:
    """The installed distribution's version (a source tree run without installing
    it falls back to ``asyncsave.__version__``)."""
    try:
        return importlib.metadata.version("asyncsave")
    except importlib.metadata.PackageNotFoundError:
        from . import __version__

        return f"{__version__} (not installed)"


def _json_object(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not JSON: {exc}") from exc
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("must be a JSON object")
    return value


Handler = Callable[[LocalFileSystem, Path, argparse.Namespace, TextIO], int]


def _layout_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--layout", default="asyncsave", choices=sorted(LAYOUTS))


def _progress_options(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--progress",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="show a progress bar on stderr (default: on a terminal, after 0.5 s)",
    )


def _storage_options(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--storage-options",
        type=_json_object,
        default=None,
        metavar="JSON",
        help='for URLs: fsspec keyword arguments, e.g. \'{"endpoint_url": "http://127.0.0.1:9000"}\'',
    )


def _prune_options(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--keep-last", type=_positive, action="append", metavar="N", help="keep the N newest"
    )
    p.add_argument(
        "--keep-every",
        type=_positive,
        action="append",
        metavar="K",
        help="keep every step that is a multiple of K",
    )
    p.add_argument(
        "--keep-best",
        nargs=2,
        action="append",
        metavar=("METRIC", "N"),
        help="keep the N best by METRIC in training_info",
    )
    p.add_argument(
        "--mode", choices=("max", "min"), default="max", help="for --keep-best (default max)"
    )
    p.add_argument(
        "--dry-run", action="store_true", help="print what would be deleted; delete nothing"
    )
    p.add_argument(
        "--lock-timeout",
        type=float,
        default=10.0,
        metavar="S",
        help="seconds to wait for the root's lock (default 10)",
    )
    p.add_argument(
        "--lock",
        choices=LOCK_MODES,
        default="flock",
        help="'none': take no lock, for file systems without flock (Lustre without "
        "-o flock); only while no Checkpointer or writer uses ROOT (default flock)",
    )


def _export_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("out", help="the directory to write (created; must hold no weights yet)")
    p.add_argument(
        "--format", choices=("hf",), default="hf", help="hf: Hugging Face safetensors (default)"
    )
    p.add_argument(
        "--key",
        default=None,
        help="key path of the model's state dict in the saved tree (default: 'model' if "
        "present, else the whole state when it holds only tensors)",
    )
    p.add_argument("--config", default=None, metavar="FILE", help="a config.json to copy")
    p.add_argument(
        "--max-shard-size",
        type=_size_arg,
        default="5GB",
        metavar="SIZE",
        help="bytes per shard, e.g. 5GB (default), 500MB; past it: shards and an index",
    )
    p.add_argument(
        "--dtype",
        choices=("float32", "float16", "bfloat16"),
        default=None,
        help=(
            "cast float16/bfloat16/float32/float64 weights to this dtype, and say it in "
            "config.json (8- and 4-bit floats and integers: as saved; default: all as saved)"
        ),
    )


def _size_arg(text: str) -> str:
    # Imports torch: only when `export` parses its options (it loads torch anyway).
    from ._export import parse_size

    try:
        parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc
    return text


def _check_prune(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """What argparse cannot say of ``prune``'s options: a rule is given, and each
    ``--keep-best`` N is a positive integer (``parser.error``: exit status 2)."""
    if not (args.keep_last or args.keep_every or args.keep_best):
        parser.error("give a rule: --keep-last N, --keep-every K or --keep-best METRIC N")
    for _, n in args.keep_best or ():
        try:
            _positive(n)
        except argparse.ArgumentTypeError as exc:
            parser.error(f"--keep-best N: {exc}")


@dataclasses.dataclass(frozen=True)
class _Command:
    """One subcommand: its name, its handler, its one positional argument (a root
    of checkpoints or one checkpoint), its help, and the options it takes beyond
    ``--storage-options`` (which every subcommand takes, last)."""

    name: str
    run: Handler
    target: str
    help: str
    description: str | None = None
    options: tuple[Callable[[argparse.ArgumentParser], None], ...] = ()
    check: Callable[[argparse.ArgumentParser, argparse.Namespace], None] | None = None


# The table of subcommands, in the order ``asyncsave --help`` lists them.
COMMANDS = (
    _Command(
        "ls", cmd_ls, "root", "list committed checkpoints under ROOT", None, (_layout_options,)
    ),
    _Command(
        "verify",
        cmd_verify,
        "path",
        "check every checksum of a checkpoint (or of all in a ROOT)",
        None,
        (_layout_options, _progress_options),
    ),
    _Command(
        "inspect",
        cmd_inspect,
        "path",
        "print the state tree of a checkpoint",
        None,
        (_progress_options,),
    ),
    _Command(
        "adopt",
        cmd_adopt,
        "path",
        "commit a checkpoint copied without its commit marker, after a full verify",
        "A checkpoint copied into an object store file by file (aws s3 sync, "
        "gsutil rsync, rclone) has no commit_success.txt, and readers do not count it. "
        "This verifies every byte of PATH (as verify does), then writes its marker. "
        "Nothing is deleted; run it once the copy is complete.",
    ),
    _Command(
        "export",
        cmd_export,
        "path",
        "write a checkpoint's model weights as a Hugging Face model directory",
        "Write the model's weights of the checkpoint PATH into OUT as model.safetensors "
        "(model-0000i-of-0000n.safetensors and model.safetensors.index.json past "
        "--max-shard-size), which transformers' from_pretrained loads (with --config). "
        "DTensor (FSDP2) checkpoints of N ranks are consolidated into full tensors.",
        (_export_options,),
    ),
    _Command(
        "prune",
        cmd_prune,
        "root",
        "delete the committed checkpoints of ROOT that a retention rule does not keep",
        "Delete the committed checkpoints under ROOT that no rule keeps "
        "(rules combine: a checkpoint any rule keeps stays). Never deleted: the tracked "
        "step, the newest committed step, a step with a save in flight. Takes the root's "
        "saver lock: refused while a Checkpointer has ROOT open.",
        (_prune_options, _layout_options),
        _check_prune,
    ),
)


def _parser() -> argparse.ArgumentParser:
    """The ``asyncsave`` parser, one subparser per row of :data:`COMMANDS`."""
    parser = argparse.ArgumentParser(
        prog="asyncsave",
        description="List, verify, inspect, adopt, export and prune asyncsave checkpoints.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    sub = parser.add_subparsers(dest="command", required=True)
    for command in COMMANDS:
        p = sub.add_parser(command.name, help=command.help, description=command.description)
        p.add_argument(command.target)
        for add in command.options:
            add(p)
        _storage_options(p)
        p.set_defaults(spec=command, subparser=p)
    return parser


def main(argv: Sequence[str] | None = None, out: TextIO | None = None) -> int:
    """Entry point of the ``asyncsave`` command; returns the exit status."""
    args = _parser().parse_args(argv)
    command: _Command = args.spec
    if command.check is not None:
        command.check(args.subparser, args)
    return _run(command, args, out or sys.stdout)


def _run(command: _Command, args: argparse.Namespace, out: TextIO) -> int:
    """Open the root of ``command``'s argument and run its handler: the one error
    boundary, where a bad URL is exit status 2 and a CheckpointError or OSError
    (a root that cannot be locked, written or listed) one line on stderr and 1."""
    try:
        fs, path = open_root(getattr(args, command.target), storage_options=args.storage_options)
    except (ValueError, ImportError) as exc:
        print(f"asyncsave: {exc}", file=sys.stderr)
        return 2
    try:
        return command.run(fs, path, args, out)
    except BrokenPipeError:
        # `asyncsave inspect PATH | head`: the reader left; not an error of ours.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except (CheckpointError, OSError) as exc:
        # A root that cannot be locked or written (read-only, not ours), or listed:
        # one line that says what and where, never a traceback.
        print(f"asyncsave {command.name}: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
