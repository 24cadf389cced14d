"""The one exception hierarchy of asyncsave.

Every error asyncsave raises on purpose derives from :class:`CheckpointError`,
which derives from :class:`Exception` (never ``BaseException``), and also from the
builtin that fits, so ``except ValueError`` keeps working for callers who do not
know asyncsave::

    CheckpointError(Exception)
    ├── InvalidStateError(ValueError)        the state tree given to save() is bad
    │   ├── UnsupportedTypeError(TypeError)  a leaf type asyncsave cannot store
    │   ├── UnsupportedTensorError           sparse, quantized, meta, subclass tensors,
    │   │                                    overlapping views no storage can hold
    │   ├── InvalidKeyError                  a dict key that is not str or int
    │   └── TemplateMismatchError            a checkpoint that does not fit the template
    │                                        given to load (unexpected items, a tensor
    │                                        of another shape or dtype)
    ├── InvalidStepError(ValueError)         negative, bool or non-int step
    ├── StagingBudgetError(ValueError)       a tensor that cannot be cut is larger
    │                                        than its share of an explicit budget
    ├── UnsupportedCombinationError(ValueError)  options that do not combine (see the
    │                                        table of what combines)
    ├── StagingPendingError(RuntimeError)    optimizer.step() on the event loop's
    │                                        thread while a lazy save is staging
    ├── SaveFailedError                      "it broke": a background save failed;
    │   │                                    the original error is ``__cause__``
    │   ├── CheckpointTimeoutError(TimeoutError)  a save or close ran past its bound
    │   ├── RankFailedError                  a multi-rank save failed on some rank(s);
    │   │                                    ``ranks`` maps each to its cause
    │   └── SaverDiedError                   the memory tier's saver process died
    ├── WaitTimeoutError(TimeoutError)       a wait with a timeout ran out; the save
    │                                        goes on (not a failure)
    ├── CheckpointerClosedError(RuntimeError)    "you closed it": used after close
    ├── RootInUseError(RuntimeError)         another checkpointer saves into this root
    ├── LockUnavailableError(OSError)        the file system refused the root's advisory
    │                                        lock (no flock: Lustre, FUSE, some NFS)
    ├── ProtectedCheckpointError(PermissionError) overwrite of the resumed checkpoint
    ├── CheckpointNotFoundError(LookupError) nothing at a path, or the tracker names
    │   │                                    a checkpoint that does not exist
    │   ├── MissingItemError                 a required item is not in the checkpoint
    │   └── UncommittedCheckpointError       files under a final name without the
    │                                        commit marker (object stores): adopt it
    ├── UnsupportedFormatError(ValueError)   written by a newer asyncsave: left alone
    ├── CorruptCheckpointError(ValueError)   damaged manifest, truncated file, tracker
    │   └── ChecksumMismatchError            garbage; bytes differ from the manifest
    ├── KindMismatchError(TypeError)         an item's kind tag differs from the one
    │                                        the loader expects
    └── UnsafeLoadError(PermissionError)     a pickled leaf and pickle not allowed

One warning category, issued with ``warnings.warn`` where asyncsave carries out a
call whose intent is probably wrong (never raised unless a filter makes it an
error)::

    CheckpointWarning(UserWarning)           save() below the tracked step, of a step
                                             already committed or in flight, of step 0;
                                             a load(strict=False) that left items out

The difference between :class:`CheckpointerClosedError` and
:class:`SaveFailedError` is the one trio teaches: the first means *you* closed the
checkpointer and then used it; the second means a save *broke* in the background,
and is raised at the handle, at the next ``save()``/``wait()`` and at close.

Every error carries ``step``, ``path``, ``rank`` and ``key`` attributes (``None``
where they do not apply) so that logs and callers can act on them.
"""

from __future__ import annotations

import os
from typing import Any

__all__ = [
    "CheckpointError",
    "CheckpointNotFoundError",
    "CheckpointTimeoutError",
    "CheckpointWarning",
    "CheckpointerClosedError",
    "ChecksumMismatchError",
    "CorruptCheckpointError",
    "InvalidKeyError",
    "InvalidStateError",
    "InvalidStepError",
    "KindMismatchError",
    "LockUnavailableError",
    "MissingItemError",
    "ProtectedCheckpointError",
    "RankFailedError",
    "SaverDiedError",
    "RootInUseError",
    "SaveFailedError",
    "StagingBudgetError",
    "StagingPendingError",
    "TemplateMismatchError",
    "UncommittedCheckpointError",
    "UnsafeLoadError",
    "UnsupportedCombinationError",
    "UnsupportedFormatError",
    "UnsupportedTensorError",
    "UnsupportedTypeError",
    "WaitTimeoutError",
]


def _path_str(path: Any) -> str | None:
    """The ``path`` attribute of errors and warnings: a str, or ``None``. A URL
    path (``upath.UPath`` of an object store) is not os.PathLike: its ``str``."""
    if path is None:
        return None
    return os.fspath(path) if isinstance(path, (str, os.PathLike)) else str(path)


class CheckpointError(Exception):
    """Base of every error asyncsave raises on purpose.

    :param message: what went wrong and, where there is one, the fix.
    :param step: the training step of the checkpoint concerned, if any.
    :param path: the file or directory concerned, if any.
    :param rank: the rank concerned (multi-rank saves), if any.
    :param key: the key path in the state tree (``"optim/state/0/exp_avg"``), if any.
    """

    def __init__(
        self,
        message: str,
        *,
        step: int | None = None,
        path: str | os.PathLike[str] | None = None,
        rank: int | None = None,
        key: str | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.step = step
        self.path = _path_str(path)
        self.rank = rank
        self.key = key

    def __str__(self) -> str:
        return self.message

    def __reduce__(self) -> tuple[Any, ...]:
        # Keep the keyword attributes when the error crosses a process boundary.
        return (
            _rebuild,
            (type(self), self.message, self.step, self.path, self.rank, self.key),
        )


def _rebuild(
    cls: type[CheckpointError],
    message: str,
    step: int | None,
    path: str | None,
    rank: int | None,
    key: str | None,
) -> CheckpointError:
    return cls(message, step=step, path=path, rank=rank, key=key)


class InvalidStateError(CheckpointError, ValueError):
    """The state tree passed to ``save()`` cannot be stored; ``key`` names where."""


class UnsupportedTypeError(InvalidStateError, TypeError):
    """A leaf of a type asyncsave does not store without pickle.

    Supported leaves: tensors, TensorDicts, NumPy arrays and scalars, ``int``,
    ``float``, ``str``, ``bool``, ``None``, ``bytes``, ``torch.dtype``,
    ``torch.device``, ``torch.Size``, and objects with ``state_dict()`` /
    ``load_state_dict()``. Anything else needs ``allow_pickle=True`` on both save and
    load.
    """


class UnsupportedTensorError(InvalidStateError):
    """A tensor whose bytes cannot be captured as-is: sparse, quantized, meta,
    nested, or a tensor subclass other than ``nn.Parameter``; or two tensors that
    overlap in memory at a distance that is not a multiple of an element size (two
    ``float32`` views one byte apart: no torch storage holds both as views; https://github.com/huggingface/safetensors/pull/264)."""


class InvalidKeyError(InvalidStateError):
    """A dict key that is not ``str`` or ``int`` (``bool`` keys are refused too,
    since JSON cannot tell ``True`` from ``1`` apart once stored); or, for
    :func:`asyncsave.export_hf`, two key paths that would be written under one
    name (``a/b`` and ``a.b``)."""


class TemplateMismatchError(InvalidStateError):
    """The checkpoint does not fit the template passed to ``load()`` or
    ``load_latest()``: items the template lacks (``unexpected``), items the checkpoint
    lacks (``missing``), tensors of another shape or dtype than the template's, or
    optimizer state of another shape than its parameter (``mismatched``); each a
    tuple of key paths (``"model/fc.weight"``). Raised before anything is changed in
    place. When every problem is a missing item, :class:`MissingItemError` is raised
    instead. ``strict=False`` loads what matches and warns about missing and
    unexpected items; a mismatched tensor is always an error. Source:
    pytorch/pytorch#148252 (https://github.com/pytorch/pytorch/issues/148252)."""

    def __init__(
        self,
        message: str,
        *,
        missing: tuple[str, ...] | list[str] = (),
        unexpected: tuple[str, ...] | list[str] = (),
        mismatched: tuple[str, ...] | list[str] = (),
        **where: Any,
    ) -> None:
        super().__init__(message, **where)
        self.missing = tuple(missing)
        self.unexpected = tuple(unexpected)
        self.mismatched = tuple(mismatched)

    def __reduce__(self) -> tuple[Any, ...]:
        where = {"step": self.step, "path": self.path, "rank": self.rank, "key": self.key}
        keys = {"missing": self.missing, "unexpected": self.unexpected}
        return (_rebuild_mismatch, (self.message, where, keys, self.mismatched))


def _rebuild_mismatch(
    message: str, where: dict[str, Any], keys: dict[str, Any], mismatched: tuple[str, ...]
) -> TemplateMismatchError:
    return TemplateMismatchError(message, mismatched=mismatched, **keys, **where)


class InvalidStepError(CheckpointError, ValueError):
    """A step that is not a non-negative ``int``."""


class StagingBudgetError(CheckpointError, ValueError):
    """A save cannot stream through the explicit ``budget_bytes``: a tensor that is
    copied whole (a non-contiguous CPU tensor) is larger than its data file's
    share of the budget, or the budget cannot be split between the data files.

    Raised by ``save()`` before anything is written; the engine stays usable.
    """


class UnsupportedCombinationError(CheckpointError, ValueError):
    """Options of a save that do not combine in its context (its number of
    ranks, a root that commits by rename or by marker, CPU or CUDA tensors): the
    message names the option, the context and the way forward. The table of what
    combines is ``docs/guides/combinations.md``.

    Raised by ``save()`` before anything is staged or written; the engine stays
    usable.
    """


class StagingPendingError(CheckpointError, RuntimeError):
    """``optimizer.step()`` ran on the event loop's own thread while a lazy save was
    still staging (see :func:`asyncsave.stage_before_step`).

    Waiting there would deadlock: the loop that finishes the staging is the one
    that would be blocked. ``await ckpt.staged()`` before ``optimizer.step()`` in
    an async pump, or run the training step in a worker thread.
    """


class SaveFailedError(CheckpointError):
    """A save broke in the background ("it broke", not "you closed it").

    ``__cause__`` holds the original exception (an ``OSError`` with its errno for
    disk faults). Raised by ``await handle`` of the failed save, by every later
    ``save()`` and ``wait()``, and by closing the checkpointer: after a failure the
    checkpointer refuses further saves, so that a trainer never goes on believing it
    is checkpointing. Open a new :class:`~asyncsave.Checkpointer` to go on; it
    cleans the failed save's temporary directory. Source: NVIDIA/Megatron-LM #6970
    and deepspeedai/DeepSpeed #7741, where a dead writer was waited on forever.
    """


class CheckpointTimeoutError(SaveFailedError, TimeoutError):
    """A save, a flush at close or a wait ran past its documented bound."""


class RankFailedError(SaveFailedError):
    """A save of several ranks failed on one or more ranks, so no rank committed it.

    Raised on *every* rank (by ``await handle``, the next ``save()`` and close).
    ``ranks`` maps each failing rank to its cause as text; ``None`` for a rank that
    could not be heard from (killed, hung past ``dist_timeout_s``) when the
    collective itself broke. ``rank`` is the lowest failing rank when known.
    """

    def __init__(self, message: str, *, ranks: dict[int, str] | None = None, **kw: Any) -> None:
        super().__init__(message, **kw)
        self.ranks: dict[int, str] = dict(ranks or {})

    def __reduce__(self) -> tuple[Any, ...]:
        return (_rebuild_rank_failed, (self.message, self.step, self.path, self.rank, self.ranks))


def _rebuild_rank_failed(
    message: str, step: int | None, path: str | None, rank: int | None, ranks: dict[int, str]
) -> RankFailedError:
    return RankFailedError(message, step=step, path=path, rank=rank, ranks=ranks)


class SaverDiedError(SaveFailedError):
    """The memory tier's saver process died (``MemoryTier``): raised by the
    trainer's next call (``save()``, ``wait()``, ``await handle``, close), never
    a hang. Saves it had not committed are lost; the committed ones stay
    loadable, and a new :class:`~asyncsave.Checkpointer` starts a new saver (its
    open recovers what the dead one left). The message names the process and how
    it ended (exit code or signal).
    """


class WaitTimeoutError(CheckpointError, TimeoutError):
    """``handle.wait(timeout_s=...)`` ran out before the commit. The save goes on and
    the checkpointer stays usable: wait again, or let close flush it."""


class CheckpointerClosedError(CheckpointError, RuntimeError):
    """The checkpointer was used after it was closed ("you closed it")."""


class RootInUseError(CheckpointError, RuntimeError):
    """Another :class:`~asyncsave.Checkpointer` (in this process or another) holds
    the root. Opening one removes the temporary directories of uncommitted saves, so
    two savers on one root would destroy each other's in-flight saves. Readers use
    :func:`asyncsave.latest` and :func:`asyncsave.load`, which take no lock."""


class LockUnavailableError(CheckpointError, OSError):
    """The file system refused the advisory lock (``flock(2)``) asyncsave takes on a
    root (its saver lock) or on a temporary directory of a save in flight: ``ENOSYS``
    on Lustre mounted without ``-o flock``, ``ENOLCK`` on NFS without a lock
    manager, ``EOPNOTSUPP`` or ``EINVAL`` on some FUSE file systems. Nothing was
    written: what the refused call had created is removed.

    ``path`` is the root; ``errno`` is the refusal's. The way forward is a mount
    with lock support, or ``lock="none"`` (:class:`~asyncsave.CheckpointOptions`,
    :class:`asyncsave.dcp.StorageWriter`, ``asyncsave prune --lock none``) where one
    process at a time saves into the root (see the option for the risk). Source:
    google/tensorstore#183 (https://github.com/google/tensorstore/issues/183)."""


class ProtectedCheckpointError(CheckpointError, PermissionError):
    """An overwrite or update aimed at the checkpoint this run resumed from.

    A checkpoint that was loaded at resume is never rewritten (DESIGN invariant 7):
    if the new run crashed half-way through rewriting it, nothing would be left to
    resume from.
    """


class CheckpointNotFoundError(CheckpointError, LookupError):
    """No checkpoint where one was expected: a path without a manifest, or a
    tracker naming a step whose directory is missing (pass ``fallback=True`` to
    scan for the newest committed checkpoint instead)."""


class MissingItemError(CheckpointNotFoundError):
    """A required item (a key path such as ``"dataloader"``) is absent from the
    checkpoint. Source: the NeMo-RL single-controller checkpointing change, where a
    checkpoint missing its dataloader state resumed silently from a fresh position.
    """


class UncommittedCheckpointError(CheckpointNotFoundError):
    """Files under a checkpoint's final name on an object store, without its commit
    marker (``commit_success.txt``): a save still being written, one that stopped
    before its marker, or a checkpoint copied there file by file by a sync tool
    (``aws s3 sync``, ``gsutil rsync``, ``rclone``), which copy no marker of a
    local run. Readers do not count it; nothing is deleted. Once nothing writes
    there, :func:`asyncsave.adopt` (``asyncsave adopt PATH``) verifies every byte
    and writes its marker; a :class:`~asyncsave.Checkpointer` opened on the root
    does the same. Source: allenai/open-instruct #1299 and google/orbax #394
    (copied checkpoints deleted for lack of the marker)."""


class UnsupportedFormatError(CheckpointError, ValueError):
    """A checkpoint written in a newer format than this asyncsave reads. It is never
    treated as damaged (never moved aside, never skipped silently): upgrade
    asyncsave, or move it away yourself."""


class CorruptCheckpointError(CheckpointError, ValueError):
    """A checkpoint, or the tracker, is damaged: the manifest is missing fields or
    is not JSON, a file is truncated or has the wrong size, an entry points outside
    the checkpoint directory. ``path`` names the file."""


class ChecksumMismatchError(CorruptCheckpointError):
    """The bytes of a tensor differ from the checksum in the manifest."""


class KindMismatchError(CheckpointError, TypeError):
    """An item was saved with one kind tag and the loader expects another (for
    example a replay buffer saved by a prioritized sampler loaded into a uniform
    one)."""


class UnsafeLoadError(CheckpointError, PermissionError):
    """The checkpoint holds pickled leaves and ``allow_pickle`` was not given to
    ``load()``. Unpickling runs arbitrary code; asyncsave never does it silently."""


class CheckpointWarning(UserWarning):
    """A call asyncsave carries out although the caller probably meant something
    else. Issued with :func:`warnings.warn` (so Python's default filter prints it
    on stderr whatever the logging setup, pytest lists it, and
    ``-W error::asyncsave.CheckpointWarning`` turns it into an error) by
    ``save()`` when:

    * ``step`` is below the tracked step: the checkpoint commits, but the tracker
      only moves forward, so resume loads the tracked (newer) step, not this one:
      usually a run that did not call ``load_latest()`` over an existing root, or a
      step counter that went back;
    * ``step`` is already committed or in flight and ``overwrite`` is not set: the
      call is a no-op that returns the first save's handle, so the state passed now
      is not written (a step counter that does not advance between saves, such as
      an epoch number saved every N iterations). A save of the step this run
      resumed from is the exception: logged at INFO, since trainers commonly save
      right after resuming;
    * ``step`` is 0 and ``save_step_zero`` is off: nothing is saved.

    And by ``load()``, ``load_step()`` and ``load_latest()`` with ``strict=False``
    when the checkpoint did not fit the template: the message names the items that
    were not loaded (missing and unexpected key paths).

    Mistakes of this kind used to be logged (or not reported at all) and went
    unseen under a default logging setup. ``step`` and ``path``
    are set as on :class:`CheckpointError`.
    """

    def __init__(self, message: str, *, step: int | None = None, path: Any = None) -> None:
        super().__init__(message)
        self.message = message
        self.step = step
        self.path = _path_str(path)

    def __str__(self) -> str:
        return self.message
