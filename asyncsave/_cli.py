"""The ``asyncsave`` command: list, verify and inspect checkpoints.

::

    asyncsave ls ROOT          committed steps, sizes, the tracked one, stray temp dirs
    asyncsave verify PATH      every checksum of one checkpoint (or of every one in ROOT)
    asyncsave inspect PATH     the state tree with dtype, shape and bytes per tensor

ROOT and PATH may be URLs (``s3://bucket/prefix``, any fsspec URL). Credentials
and endpoint come from the environment as the fsspec implementation reads them
(``AWS_ACCESS_KEY_ID``, ``AWS_ENDPOINT_URL``...) or from ``--storage-options JSON``.

Read-only: nothing here deletes or moves files. Exit status 0 on success, 1 when a
checkpoint fails verification or cannot be read, 2 on bad usage, which includes
``ls`` of one checkpoint and ``inspect`` of a root: the message names the command
that fits (and ``ls``/``verify`` of a root holding only another layout's
directories name the ``--layout`` that finds them). ``asyncsave --version`` prints
the installed distribution's version.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TextIO

from ._errors import CheckpointError
from ._fs import LocalFileSystem
from ._fsspec import open_root
from ._load import read_checkpoint, scan_steps, verify
from ._manifest import Manifest
from ._marker import is_committed
from ._paths import LAYOUTS, MANIFEST_NAME, is_temp_name
from ._track import read_tracker

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
    found = {name: scan_steps(fs, root, layout) for name, layout in sorted(LAYOUTS.items())}
    found = {name: steps for name, steps in found.items() if steps}
    tracked = {
        name: steps
        for name, steps in found.items()
        if (t := LAYOUTS[name].tracker_name) is not None and fs.exists(root / t)
    }
    return tracked or found


def _layout_hint(fs: LocalFileSystem, root: Path, layout_name: str) -> str | None:
    """When ``root`` holds no directory of ``layout_name`` but some of others: say
    which ``--layout`` finds them."""
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


def _ls(fs: LocalFileSystem, root: Path, layout_name: str, out: TextIO) -> int:
    layout = LAYOUTS[layout_name]
    if not fs.exists(root):
        print(f"asyncsave: {root}: no such file or directory", file=sys.stderr)
        return 1
    one = _checkpoint_dir(fs, root)
    if one is not None:
        print(
            f"asyncsave: {root} is one checkpoint, not a root of checkpoints: "
            f"`asyncsave inspect {one}` prints its state tree, `asyncsave verify {one}` "
            f"checks it, `asyncsave ls {one.parent}{_layout_option(one.name)}` lists the "
            "root it is in",
            file=sys.stderr,
        )
        return 2
    if not fs.is_dir(root):
        print(f"asyncsave: {root} is not a directory", file=sys.stderr)
        return 1
    tracked: int | None = None
    tracker_note = "no tracker"
    if layout.tracker_name is not None:
        try:
            tracked = read_tracker(fs, root / layout.tracker_name)
            tracker_note = "no tracker" if tracked is None else f"tracker -> step {tracked}"
        except CheckpointError as exc:
            tracker_note = f"tracker damaged: {exc}"
    print(f"{root}  ({tracker_note})", file=out)
    rc = 0
    steps = scan_steps(fs, root, layout)
    for step in sorted(steps):
        path = steps[step]
        mark = "*" if step == tracked else " "
        if not is_committed(fs, path):
            print(
                f" {mark} {path.name:<20} step {step:>10}  uncommitted: no commit marker (a save "
                "in flight, or one that never committed; removed at the next open)",
                file=out,
            )
            continue
        try:
            m = read_checkpoint(fs, path, expect_step=step)
            size = m.nbytes
            print(
                f" {mark} {path.name:<20} step {step:>10}  {_size(size):>10}  {len(m.tensors):>6} tensors",
                file=out,
            )
        except CheckpointError as exc:
            rc = 1
            print(f" {mark} {path.name:<20} step {step:>10}  NOT LOADABLE: {exc}", file=out)
    if tracked is not None and tracked not in steps:
        rc = 1
        print(f"   tracker names step {tracked}, which is missing", file=out)
    if not steps:
        print(f"   {_layout_hint(fs, root, layout_name) or 'no checkpoint here'}", file=out)
    for name in fs.listdir(root):
        if is_temp_name(name):
            print(
                f"   {name}  (temporary: an uncommitted save; removed at the next open)", file=out
            )
        elif name.startswith((".asyncsave-damaged-", ".asyncsave-incomplete-")):
            print(f"   {name}  (moved aside at open: not a loadable checkpoint)", file=out)
    return rc


def _verify(fs: LocalFileSystem, path: Path, layout_name: str, out: TextIO) -> int:
    if not fs.exists(path):
        print(f"asyncsave: {path}: no such file or directory", file=sys.stderr)
        return 1
    if path.name == MANIFEST_NAME:
        path = path.parent
    if fs.exists(path / MANIFEST_NAME) or not fs.is_dir(path):
        targets = [path]
    else:
        targets = [p for _, p in sorted(scan_steps(fs, path, LAYOUTS[layout_name]).items())]
        if not targets:
            hint = _layout_hint(fs, path, layout_name)
            print(
                f"asyncsave: no checkpoint in {path}{f': {hint}' if hint else ''}", file=sys.stderr
            )
            return 1
    rc = 0
    for target in targets:
        try:
            info = verify(target, filesystem=fs)
        except CheckpointError as exc:
            rc = 1
            print(f"FAIL {target}: {exc}", file=out)
            continue
        print(
            f"ok   {target}: step {info.step}, {info.num_tensors} tensors, {_size(info.nbytes)} verified",
            file=out,
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
    elif kind == "dcp":
        print(
            f"{pad}{label}: written through torch.distributed.checkpoint: read it with "
            "dcp.load and asyncsave.dcp.StorageReader",
            file=out,
        )
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


def _inspect(fs: LocalFileSystem, path: Path, out: TextIO) -> int:
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
    try:
        m = read_checkpoint(fs, path, expect_step=LAYOUTS["asyncsave"].parse_dir_name(path.name))
    except CheckpointError as exc:
        print(f"asyncsave: {exc}", file=sys.stderr)
        return 1
    print(
        f"{path}: step {m.step}, world size {m.world_size}, {len(m.tensors)} tensors, {_size(m.nbytes)}",
        file=out,
    )
    try:
        _describe(m.tree, m, 0, "state", out)
    except (KeyError, IndexError, TypeError, ValueError, AttributeError) as exc:
        # The manifest passed its own checksum but its tree is malformed.
        print(f"asyncsave: damaged state tree in {path}: {exc!r}", file=sys.stderr)
        return 1
    return 0


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


def main(argv: Sequence[str] | None = None, out: TextIO | None = None) -> int:
    """Entry point of the ``asyncsave`` command; returns the exit status."""
    out = out or sys.stdout
    parser = argparse.ArgumentParser(
        prog="asyncsave", description="List, verify and inspect asyncsave checkpoints."
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    sub = parser.add_subparsers(dest="command", required=True)
    p_ls = sub.add_parser("ls", help="list committed checkpoints under ROOT")
    p_ls.add_argument("root")
    p_ver = sub.add_parser(
        "verify", help="check every checksum of a checkpoint (or of all in a ROOT)"
    )
    p_ver.add_argument("path")
    p_ins = sub.add_parser("inspect", help="print the state tree of a checkpoint")
    p_ins.add_argument("path")
    for p in (p_ls, p_ver):
        p.add_argument("--layout", default="asyncsave", choices=sorted(LAYOUTS))
    for p in (p_ls, p_ver, p_ins):
        p.add_argument(
            "--storage-options",
            type=_json_object,
            default=None,
            metavar="JSON",
            help='for URLs: fsspec keyword arguments, e.g. \'{"endpoint_url": "http://127.0.0.1:9000"}\'',
        )
    args = parser.parse_args(argv)
    where = args.root if args.command == "ls" else args.path
    try:
        fs, path = open_root(where, storage_options=args.storage_options)
    except (ValueError, ImportError) as exc:
        print(f"asyncsave: {exc}", file=sys.stderr)
        return 2
    try:
        if args.command == "ls":
            return _ls(fs, path, args.layout, out)
        if args.command == "verify":
            return _verify(fs, path, args.layout, out)
        return _inspect(fs, path, out)
    except BrokenPipeError:
        # `asyncsave inspect PATH | head`: the reader left; not an error of ours.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


if __name__ == "__main__":
    sys.exit(main())
