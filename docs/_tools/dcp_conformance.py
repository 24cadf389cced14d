"""Run PyTorch's own DCP tests against asyncsave.dcp's writer and reader.

Not part of the test suite: PyTorch's test files are not ours to copy in. Check
them out yourself (from the PyTorch repository, ``test/distributed/checkpoint/``
of the tag of your torch) into a directory OUTSIDE this repository, then::

    python docs/_tools/dcp_conformance.py /tmp/dcpconf/torch_tests [test files...]

The script writes a ``conftest.py`` into that directory and runs pytest there
twice: once with DCP's own ``FileSystemWriter`` / ``FileSystemReader``
(``ASYNCSAVE_DCP_CONFORMANCE=off``), once with them replaced, for the whole
session, by ``asyncsave.dcp.StorageWriter`` / ``StorageReader``. Each prints
its counts; ``docs/dcp_conformance.md`` records them and says what each
failure means.

The substitution keeps every option the tests pass, as a user moving to
asyncsave would write it:

- ``FileSystemWriter(path, *args, **kwargs)`` becomes
  ``StorageWriter(path, <step>, **kwargs)``: ``path`` is the root (asyncsave
  commits ``<path>/step_<N>`` and moves the root's tracker), and each writer made
  for a root commits the step after the highest one there, so that a test saving
  twice to one path makes two checkpoints and a reader of the root reads the
  newest (asyncsave's idiom: a new save is a new step). A writer given
  ``overwrite`` explicitly commits the highest step there instead (the test means
  that checkpoint): ``overwrite=True`` replaces it, ``overwrite=False`` is refused
  as DCP refuses. DCP's positional options are bound to their
  names first, by ``FileSystemWriter``'s own signature, so they arrive as keywords.
- ``FileSystemReader(path, _extension_registry=...)`` becomes
  ``StorageReader(path, _extension_registry=...)`` (a root resolves to its latest
  checkpoint; a directory ``FileSystemWriter`` wrote is read as DCP reads it).
- ``validate_checkpoint_id`` answers as DCP's, so ``dcp.save(checkpoint_id=path)``
  without a writer picks asyncsave's, as it would pick DCP's.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

SHIM = '''\
"""Written by asyncsave's docs/_tools/dcp_conformance.py: FileSystemWriter and
FileSystemReader replaced by asyncsave.dcp's, unless ASYNCSAVE_DCP_CONFORMANCE=off.
Imported by conftest.py and by sitecustomize.py (the ranks of PyTorch's
multi-process tests are spawned interpreters that never read conftest.py)."""
import inspect
import os
import re

import torch.distributed.checkpoint as dcp_pkg
import torch.distributed.checkpoint._storage_utils as storage_utils
import torch.distributed.checkpoint.filesystem as fsmod

from asyncsave.dcp import StorageReader, StorageWriter

_FSW = inspect.signature(fsmod.FileSystemWriter.__init__)
_STEP = re.compile(r"step_(\\d+)")


def _latest_step(root):
    if not os.path.isdir(root):
        return 0
    steps = [int(m.group(1)) for n in os.listdir(root) if (m := _STEP.fullmatch(n))]
    return max(steps, default=0)


def _step_for(root, overwrite_given):
    # overwrite passed: the test means this path's checkpoint (replace or refuse
    # it); otherwise a new save is a new step.
    latest = _latest_step(root)
    return latest if overwrite_given and latest else latest + 1


class AsyncsaveWriter(StorageWriter):
    def __init__(self, path, *args, **kwargs):
        bound = _FSW.bind(None, path, *args, **kwargs).arguments
        bound.pop("self")
        root = os.fspath(bound.pop("path"))
        super().__init__(root, _step_for(root, "overwrite" in bound), **bound)
        log = os.environ.get("ASYNCSAVE_DCP_CONFORMANCE_LOG")
        if log:
            with open(log, "a") as f:
                f.write(f"{os.getpid()} writer {root} {self.step} {sorted(bound)}\\n")

    def reset(self, checkpoint_id=None):
        if checkpoint_id is not None and not _STEP.fullmatch(os.path.basename(checkpoint_id)):
            self.step = _step_for(os.fspath(checkpoint_id), False)
        super().reset(checkpoint_id)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id):
        return fsmod.FileSystem.validate_checkpoint_id(checkpoint_id)


class AsyncsaveReader(StorageReader):
    def __init__(self, path, _extension_registry=None):
        super().__init__(os.fspath(path), _extension_registry=_extension_registry)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id):
        return fsmod.FileSystem.validate_checkpoint_id(checkpoint_id)


if os.environ.get("ASYNCSAVE_DCP_CONFORMANCE", "on") != "off":
    for module in (dcp_pkg, fsmod, storage_utils):
        module.FileSystemWriter = AsyncsaveWriter
        module.FileSystemReader = AsyncsaveReader
'''


def run(test_dir: Path, files: list[str], backend: str) -> int:
    """Run pytest on ``files`` in ``test_dir`` with ``backend`` ("dcp" or
    "asyncsave"); returns pytest's exit status."""
    env = dict(os.environ, ASYNCSAVE_DCP_CONFORMANCE="off" if backend == "dcp" else "on")
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(test_dir), os.environ.get("PYTHONPATH", "")) if p
    )
    log = test_dir / f"constructed-{backend}.log"
    log.unlink(missing_ok=True)
    env["ASYNCSAVE_DCP_CONFORMANCE_LOG"] = str(log)
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:randomly", "-p", "no:cacheprovider"]
    cmd += ["-o", "addopts=", "--rootdir", str(test_dir), "-rfE", *files]
    print(f"== {backend}: {' '.join(cmd)}", flush=True)
    status = subprocess.call(cmd, cwd=test_dir, env=env)
    made = log.read_text().splitlines() if log.exists() else []
    print(
        f"== {backend}: asyncsave writers constructed: {len(made)} in "
        f"{len({line.split()[0] for line in made})} processes",
        flush=True,
    )
    return status


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__)
        return 2
    test_dir = Path(argv[0]).resolve()
    here = Path(__file__).resolve().parents[2]
    if test_dir == here or here in test_dir.parents:
        print(f"{test_dir} is inside this repository: check PyTorch's tests out elsewhere")
        return 2
    files = argv[1:] or sorted(p.name for p in test_dir.glob("test_*.py"))
    (test_dir / "asyncsave_dcp_shim.py").write_text(SHIM)
    (test_dir / "conftest.py").write_text("import asyncsave_dcp_shim  # noqa: F401\n")
    (test_dir / "sitecustomize.py").write_text("import asyncsave_dcp_shim  # noqa: F401\n")
    status = [run(test_dir, files, backend) for backend in ("dcp", "asyncsave")]
    return max(status)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
