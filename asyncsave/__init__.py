"""asyncsave: asynchronous, crash-safe checkpoints of PyTorch training state.

Save from an async train pump, keep training while the snapshot is written in the
background, commit atomically, move the tracker only after the commit, and resume
from exactly the last committed step::

    async with asyncsave.Checkpointer("runs/exp1") as ckpt:
        restored = await ckpt.load_latest({"model": model, "optim": opt})
        ...
        handle = await ckpt.save(step, {"model": model, "optim": opt})
        ...
        info = await handle

docs/decisions.md records the design decisions; the README lists the guarantees.
"""

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the names below are imported on first use (PEP 562)
    from ._catalog import latest
    from ._commit import adopt
    from ._decode import verify
    from ._engine import Checkpointer, SaveHandle
    from ._errors import (
        CheckpointerClosedError,
        CheckpointError,
        CheckpointNotFoundError,
        CheckpointTimeoutError,
        CheckpointWarning,
        ChecksumMismatchError,
        CorruptCheckpointError,
        InvalidKeyError,
        InvalidStateError,
        InvalidStepError,
        KindMismatchError,
        LockUnavailableError,
        MissingItemError,
        ProtectedCheckpointError,
        RankFailedError,
        RootInUseError,
        SaveFailedError,
        SaverDiedError,
        StagingBudgetError,
        StagingPendingError,
        TemplateMismatchError,
        UncommittedCheckpointError,
        UnsafeLoadError,
        UnsupportedCombinationError,
        UnsupportedFormatError,
        UnsupportedTensorError,
        UnsupportedTypeError,
        WaitTimeoutError,
    )
    from ._export import export_hf
    from ._fs import LocalFileSystem
    from ._fsspec import FsspecFileSystem
    from ._lazy import stage_before_step
    from ._listing import checkpoints, load_step
    from ._load import load, load_tensors
    from ._options import CheckpointOptions, MemoryTier, Tier
    from ._policy import (
        AgreedPolicy,
        SaveAtStep,
        SaveBeforeDeadline,
        SaveEvery,
        SaveOnSignal,
        SavePolicy,
    )
    from ._retention import KeepBest, KeepBytes, KeepEvery, KeepLast, Retention
    from ._rng import RNGState
    from ._sync import SyncCheckpointer, SyncSaveHandle
    from ._types import CheckpointInfo, Restored, SaveProgress, Tagged

__version__ = "0.1.0"

# Public name -> the module that defines it. ``import asyncsave`` imports none of
# them (nor torch): the first use of a name imports its module, so the ``asyncsave``
# command answers ``--help`` and ``--version`` without loading torch.
_LAZY = {
    "Checkpointer": "._engine",
    "SaveHandle": "._engine",
    "CheckpointerClosedError": "._errors",
    "CheckpointError": "._errors",
    "SaverDiedError": "._errors",
    "CheckpointNotFoundError": "._errors",
    "CheckpointTimeoutError": "._errors",
    "CheckpointWarning": "._errors",
    "ChecksumMismatchError": "._errors",
    "CorruptCheckpointError": "._errors",
    "InvalidKeyError": "._errors",
    "InvalidStateError": "._errors",
    "InvalidStepError": "._errors",
    "KindMismatchError": "._errors",
    "LockUnavailableError": "._errors",
    "UnsupportedCombinationError": "._errors",
    "MissingItemError": "._errors",
    "ProtectedCheckpointError": "._errors",
    "RankFailedError": "._errors",
    "RootInUseError": "._errors",
    "SaveFailedError": "._errors",
    "StagingBudgetError": "._errors",
    "StagingPendingError": "._errors",
    "TemplateMismatchError": "._errors",
    "UncommittedCheckpointError": "._errors",
    "UnsafeLoadError": "._errors",
    "UnsupportedFormatError": "._errors",
    "UnsupportedTensorError": "._errors",
    "UnsupportedTypeError": "._errors",
    "WaitTimeoutError": "._errors",
    "LocalFileSystem": "._fs",
    "export_hf": "._export",
    "adopt": "._commit",
    "FsspecFileSystem": "._fsspec",
    "stage_before_step": "._lazy",
    "checkpoints": "._listing",
    "load_step": "._listing",
    "latest": "._catalog",
    "load": "._load",
    "load_tensors": "._load",
    "verify": "._decode",
    "CheckpointOptions": "._options",
    "Tier": "._options",
    "MemoryTier": "._options",
    "AgreedPolicy": "._policy",
    "SaveAtStep": "._policy",
    "SaveBeforeDeadline": "._policy",
    "SaveEvery": "._policy",
    "SaveOnSignal": "._policy",
    "SavePolicy": "._policy",
    "KeepBest": "._retention",
    "KeepBytes": "._retention",
    "KeepEvery": "._retention",
    "KeepLast": "._retention",
    "Retention": "._retention",
    "RNGState": "._rng",
    "SyncCheckpointer": "._sync",
    "SyncSaveHandle": "._sync",
    "CheckpointInfo": "._types",
    "Restored": "._types",
    "SaveProgress": "._types",
    "Tagged": "._types",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is not None:
        value = getattr(importlib.import_module(module, __name__), name)
        globals()[name] = value  # later lookups skip this function
        return value
    if name.startswith("_") and not name.startswith("__"):
        # A private submodule (``asyncsave._load``), as an eager package would
        # have bound it.
        try:
            return importlib.import_module(f".{name}", __name__)
        except ModuleNotFoundError as exc:
            if exc.name != f"{__name__}.{name}":
                raise
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})


__all__ = [
    "AgreedPolicy",
    "CheckpointError",
    "CheckpointInfo",
    "CheckpointNotFoundError",
    "CheckpointOptions",
    "CheckpointTimeoutError",
    "CheckpointWarning",
    "Checkpointer",
    "CheckpointerClosedError",
    "ChecksumMismatchError",
    "CorruptCheckpointError",
    "FsspecFileSystem",
    "InvalidKeyError",
    "InvalidStateError",
    "InvalidStepError",
    "KeepBest",
    "KeepBytes",
    "KeepEvery",
    "KeepLast",
    "KindMismatchError",
    "LocalFileSystem",
    "LockUnavailableError",
    "MemoryTier",
    "MissingItemError",
    "ProtectedCheckpointError",
    "RNGState",
    "RankFailedError",
    "Restored",
    "Retention",
    "RootInUseError",
    "SaveFailedError",
    "SaverDiedError",
    "SaveAtStep",
    "SaveBeforeDeadline",
    "SaveEvery",
    "SaveHandle",
    "SaveOnSignal",
    "SavePolicy",
    "SaveProgress",
    "StagingBudgetError",
    "StagingPendingError",
    "SyncCheckpointer",
    "SyncSaveHandle",
    "Tagged",
    "TemplateMismatchError",
    "Tier",
    "UncommittedCheckpointError",
    "UnsafeLoadError",
    "UnsupportedCombinationError",
    "UnsupportedFormatError",
    "UnsupportedTensorError",
    "UnsupportedTypeError",
    "WaitTimeoutError",
    "__version__",
    "adopt",
    "checkpoints",
    "export_hf",
    "latest",
    "load",
    "load_step",
    "load_tensors",
    "stage_before_step",
    "verify",
]
