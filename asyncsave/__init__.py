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
    MissingItemError,
    ProtectedCheckpointError,
    RankFailedError,
    RootInUseError,
    SaveFailedError,
    StagingBudgetError,
    StagingPendingError,
    UnsafeLoadError,
    UnsupportedFormatError,
    UnsupportedTensorError,
    UnsupportedTypeError,
    WaitTimeoutError,
)
from ._fs import LocalFileSystem
from ._fsspec import FsspecFileSystem
from ._lazy import stage_before_step
from ._listing import checkpoints, load_step
from ._load import latest, load, load_tensors, verify
from ._options import CheckpointOptions, Tier
from ._policy import (
    AgreedPolicy,
    SaveAtStep,
    SaveBeforeDeadline,
    SaveEvery,
    SaveOnSignal,
    SavePolicy,
)
from ._retention import KeepBest, KeepEvery, KeepLast, Retention
from ._rng import RNGState
from ._sync import SyncCheckpointer, SyncSaveHandle
from ._types import CheckpointInfo, Restored, SaveProgress, Tagged

__version__ = "0.1.0"

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
    "KeepEvery",
    "KeepLast",
    "KindMismatchError",
    "LocalFileSystem",
    "MissingItemError",
    "ProtectedCheckpointError",
    "RNGState",
    "RankFailedError",
    "Restored",
    "Retention",
    "RootInUseError",
    "SaveFailedError",
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
    "Tier",
    "UnsafeLoadError",
    "UnsupportedFormatError",
    "UnsupportedTensorError",
    "UnsupportedTypeError",
    "WaitTimeoutError",
    "__version__",
    "checkpoints",
    "latest",
    "load",
    "load_step",
    "load_tensors",
    "stage_before_step",
    "verify",
]
