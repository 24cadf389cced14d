"""Options of a :class:`~asyncsave.Checkpointer`, as one frozen dataclass."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from ._fs import LocalFileSystem, check_lock_mode
from ._fsspec import check_root
from ._paths import LAYOUTS
from ._policy import SavePolicy
from ._retention import Retention, as_retention

if TYPE_CHECKING:
    from ._coord import Coordinator

__all__ = ["CheckpointOptions", "MemoryTier", "Tier"]


@dataclasses.dataclass(frozen=True)
class Tier:
    """The persistent tier behind a checkpointer's (local) root.

    ::

        ckpt = asyncsave.Checkpointer(
            "/local_nvme/run1",                       # every save commits here first
            retention=asyncsave.KeepLast(2),          # local: keep the last 2
            persistent=asyncsave.Tier(
                "s3://bucket/run1",                   # or a shared file system path
                policy=asyncsave.SaveEvery(500),      # persist every 500th step
                retention=asyncsave.KeepBest(3, metric="eval/loss", mode="min"),
            ),
        )

    :param root: the persistent root: a local or shared file-system path, or an
        fsspec URL (``s3://bucket/prefix``). Same layout as the local root.
    :param policy: which saves are persisted: asked once per accepted ``save()``
        (with that save's step, not once per trained step), before its snapshot.
        ``None``: every save. On several ranks it must answer the same on every
        rank (step-based policies do).
    :param retention: which persistent checkpoints to keep (as the ``retention``
        option); ``None`` keeps all. Never retires the newest, the tracked, the
        resumed-from or an in-flight persistent checkpoint.
    :param queue_size: how many saves may be due to persist and not yet persisted
        (a positive int); one more ``save()`` due to persist waits (back-pressure,
        counted in its ``blocked_s``). Each holds only its local directory, no
        host memory.
    :param filesystem: the I/O layer of ``root`` (see ``CheckpointOptions``).
    :param storage_options: fsspec options of a URL ``root`` (see
        ``CheckpointOptions``).
    :param timeout_s: seconds one copy may take (its local commit excluded)
        before it fails with :class:`CheckpointTimeoutError`.
    :param local_scope: who sees the checkpointer's (local) root. ``"shared"``
        (default): every rank sees the same root (as without tiers); a local
        checkpoint is one N-rank checkpoint, and rank 0 copies it. ``"rank"``: the
        root is private to each node (a node-local NVMe, ``/dev/shm``): rank ``r``
        commits its own part as a checkpoint of one rank under ``root/rank{r}/``,
        ``await handle`` returns once every rank has committed its part, and every
        rank copies its own files to the persistent tier, where rank 0 commits
        them as one ordinary N-rank checkpoint (loadable by :func:`asyncsave.load`
        without tiers). Plain state trees only (no DTensor, no Megatron request).
    :raises ValueError: a field is invalid (named), or ``root`` is empty.
    :raises TypeError: ``root`` is not a path or a URL.
    """

    root: Any
    policy: SavePolicy | None = None
    retention: Retention | None = None
    queue_size: int = 2
    filesystem: LocalFileSystem | None = None
    storage_options: Mapping[str, Any] | None = None
    timeout_s: float = 3600.0
    local_scope: str = "shared"

    def __post_init__(self) -> None:
        check_root(self.root, "Tier.root")
        if self.local_scope not in ("shared", "rank"):
            raise ValueError(f"Tier.local_scope={self.local_scope!r} must be 'shared' or 'rank'")
        if self.policy is not None and not isinstance(self.policy, SavePolicy):
            raise ValueError(f"Tier.policy={self.policy!r} must be a SavePolicy or None")
        object.__setattr__(self, "retention", as_retention(self.retention))
        q = self.queue_size
        if isinstance(q, bool) or not isinstance(q, int) or q < 1:
            raise ValueError(f"Tier.queue_size={q!r} must be a positive int")
        t = self.timeout_s
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t <= 0:
            raise ValueError(f"Tier.timeout_s={t!r} must be a positive finite number")


@dataclasses.dataclass(frozen=True)
class MemoryTier:
    """A tier in shared memory, in front of the checkpointer's root: the save
    survives the death of the training process once ``save()`` has returned.

    ::

        ckpt = asyncsave.Checkpointer(
            "/shared/run1",                               # where saves persist
            memory=asyncsave.MemoryTier(persist=asyncsave.SaveEvery(10)),
        )

    With it, ``save()`` copies the snapshot into shared memory (a slot file in
    ``shm_dir``, pinned on CUDA hosts) owned by a saver process that the
    checkpointer starts on entry (one per rank: see ``asyncsave._memtier``), and
    returns once the saver holds it. The saver commits every save to a
    checkpoint in ``shm_dir`` (the memory tier: a restart on this node resumes
    from it without reading the disk), copies the saves ``persist`` picks to the
    root behind it (commit, tracker, the checkpointer's ``retention``), and keeps
    the newest ``budget_bytes`` of snapshots in memory. If the trainer dies, the
    saver still commits every save whose ``save()`` returned, persists the newest
    one, and exits; if the saver dies, the trainer's next call raises
    :class:`SaverDiedError`. Sources: DLRover's Flash Checkpoint (snapshot in
    shared memory, an agent persists it), Gemini (SOSP'23, checkpoints in CPU
    memory).

    :param persist: which saves are copied to the root (a :class:`SavePolicy`
        asked once per accepted save; ``None``: every save). Whatever it says,
        close and the trainer's death persist the newest save.
    :param budget_bytes: tensor bytes of committed snapshots kept in shared
        memory (:class:`KeepBytes`; the newest is always kept, and a snapshot
        not yet persisted is never dropped). ``None``: the newest two.
    :param shm_dir: a tmpfs directory (default ``/dev/shm``); the tier lives in
        ``shm_dir/asyncsave-<uid>-<hash of the root>``, so a restarted trainer
        of the same root finds it.
    :param start_timeout_s: seconds to wait for the saver to start, including
        for the saver of a dead trainer to finish its commits (it holds the
        root) before a restarted one takes over.
    :raises ValueError: a field is invalid (named).
    """

    persist: SavePolicy | None = None
    budget_bytes: int | None = None
    shm_dir: str = "/dev/shm"
    start_timeout_s: float = 300.0

    def __post_init__(self) -> None:
        if self.persist is not None and not isinstance(self.persist, SavePolicy):
            raise ValueError(f"MemoryTier.persist={self.persist!r} must be a SavePolicy or None")
        b = self.budget_bytes
        if b is not None and (isinstance(b, bool) or not isinstance(b, int) or b < 1):
            raise ValueError(f"MemoryTier.budget_bytes={b!r} must be a positive int or None")
        if not isinstance(self.shm_dir, str) or not self.shm_dir:
            raise ValueError(f"MemoryTier.shm_dir={self.shm_dir!r} must be a directory path")
        t = self.start_timeout_s
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t <= 0:
            raise ValueError(f"MemoryTier.start_timeout_s={t!r} must be a positive finite number")


@dataclasses.dataclass(frozen=True)
class CheckpointOptions:
    """How a :class:`~asyncsave.Checkpointer` stages, writes and waits.

    Every field is validated on construction; a bad value raises ``ValueError``
    naming the field.

    :param layout: naming preset of the final directories and the tracker file, so
        a framework's own resume logic finds the checkpoints unchanged:
        ``"asyncsave"`` (``step_<N>/``, ``latest_checkpointed_iteration.txt``),
        ``"verl"`` (``global_step_<N>/``, ``latest_checkpointed_iteration.txt``),
        ``"megatron"`` (``iter_<N:07d>/``, ``latest_checkpointed_iteration.txt``),
        ``"skyrl"`` (``global_step_<N>/``, ``latest_ckpt_global_step.txt``),
        ``"nemo-rl"`` (``step_<N>/`` with ``training_info.json`` inside, no tracker).
    :param retention: which committed checkpoints to keep (``KeepLast(k)``,
        ``KeepEvery(n)``, ``KeepBest(k, metric=...)``, combined with ``|`` or given
        as a list); ``None`` keeps everything. Decided from what is on disk after
        each commit; see :mod:`asyncsave._retention`.
    :param budget_bytes: bytes of host staging memory, allocated once and reused
        for every save. ``None`` (default): the size of the first state saved,
        grown (once, while idle) if a later state is larger. A state larger than
        an explicit budget streams through it in rounds (stage, write, reuse; https://github.com/meta-pytorch/torchsnapshot/issues/112),
        so an eager ``save()`` blocks longer but does not fail. Two exceptions raise
        :class:`~asyncsave.StagingBudgetError` before anything is written: a
        non-contiguous CPU tensor (copied whole) larger than its data file's share
        of the budget, and a rank's state larger than the budget in a save of
        several ranks that does not stream: DTensor state (DCP's planner),
        :class:`~asyncsave.megatron.MegatronSaver`'s requests, and any state on an
        object-store root (the other ranks' saves fail with
        :class:`~asyncsave.RankFailedError`). A plain state tree streams on
        several ranks too. While the budget is in use by an
        earlier save that is still writing, ``save()`` waits (backpressure).
    :param writer_threads: worker threads that write data files of one save in
        parallel; the tensors of a save are spread over this many files. An
        incremental save (one file per large tensor) hashes with this many and
        writes its files with ``max(writer_threads, 8)``
        (``_jobs.EARLY_WRITE_THREADS``: more fsyncs in flight are committed
        together).
    :param save_timeout_s: seconds one save may take from dispatch to commit
        before it fails with :class:`~asyncsave.CheckpointTimeoutError` (a stuck
        writer thread is abandoned, never waited on).
    :param close_timeout_s: seconds closing the checkpointer waits for pending
        saves before it cancels them and raises
        :class:`~asyncsave.CheckpointTimeoutError`.
    :param save_step_zero: allow saves at step 0. Off by default: a checkpoint at
        step 0 holds an untrained model and is almost always an off-by-one.
    :param allow_pickle: store leaves asyncsave has no format for by pickling them.
        Loading such a checkpoint needs ``allow_pickle=True`` too.
    :param poll_interval_s: how often the event loop polls CUDA events of a copy
        in flight (never a blocking synchronize).
    :param direct_io: write the bulk of each data file with ``O_DIRECT`` from the
        staging buffer (measured 2.1 against 0.9 to 1.6 GB/s buffered on the
        development machine, ``bench/odirect.py``); the file system may refuse it
        (tmpfs), in which case writes are buffered. Streamed saves (a state larger
        than ``budget_bytes``) are always buffered. Files are fsynced either way.
    :param overlap_writes: write a save's data files while its snapshot is still
        copied into the staging memory: each file's writer follows the copy
        (``_jobs.FollowingJob``), so the time to durable no longer
        includes the whole copy. Whole (not streamed, not incremental) saves of
        host tensors of 16 MiB or more into a local root, when no save
        dispatched before is unresolved; other saves are staged, then written.
        ``None`` (default): lazy saves only. ``True``: eager saves too: the copy
        then shares the CPU with the writers, so an eager ``save()`` blocks
        longer (2 cores, 128 MiB: 25-29 instead of 19-20 ms) while its time to
        durable is shorter (109-123 instead of 125-130 ms): worth it where the
        host has cores to spare. ``False``: never. ``True`` for a save of CUDA
        tensors, or into a root that commits by marker (an object store), is
        refused by ``save()`` (``UnsupportedCombinationError``): the writers
        follow host copies only, and move their files in by rename; ``None``
        never refuses. See docs/guides/combinations.md and docs/decisions.md
        ("Writing while staging").
    :param filesystem: the I/O layer. ``None`` (default): chosen from the root:
        :class:`~asyncsave.LocalFileSystem` for a local path,
        :class:`~asyncsave.FsspecFileSystem` for a URL (``s3://bucket/prefix``).
        Pass an ``FsspecFileSystem`` wrapping an fsspec file system you configured
        yourself, or a subclass that injects faults (tests).
    :param storage_options: for a URL root: keyword arguments of its fsspec file
        system, as fsspec and pandas take them (for s3fs: ``endpoint_url``, ``key``,
        ``secret``, ``client_kwargs``, ``default_block_size``...). Credentials may also
        come from the environment (``AWS_ACCESS_KEY_ID``, ``AWS_ENDPOINT_URL``...).
        ``ValueError`` with a local root.
    :param distributed: save as one rank of many (see ``asyncsave._dist``): every
        rank calls ``save()`` with the same steps in the same order, writes its own
        files into one shared temporary directory, and rank 0 commits after every
        rank's files are durable. ``None`` (default): on when ``torch.distributed``
        is initialised with a world size above 1.
    :param dist_timeout_s: seconds a rank waits at one collective on asyncsave's
        own gloo group (creating it, the open, and each save's three collectives)
        for the other ranks. It includes waiting for the slowest rank's writes, so
        it must exceed the spread of write times between ranks. A rank that dies
        makes the others' collective fail at once (gloo sees the connection close)
        or, at the latest, after this timeout.
    :param persistent: a :class:`Tier`: ``root`` becomes the fast local tier
        (node-local disk, ``/dev/shm``) where every save commits first, and the
        saves its policy picks are copied, in the background, from the committed
        local directory to the tier's root with the same commit protocol;
        ``handle.persisted()`` waits for that copy, ``load_latest()`` resumes from
        the nearest valid tier. See ``asyncsave._tiers``. ``None``: one tier.
    :param incremental: share every data file whose bytes equal a file of the
        previous committed checkpoint of the root instead of writing it again (a
        hard link locally, a server-side copy on an object store), decided from
        XXH3-64 checksums of the bytes saved, never from object identity; each
        tensor of 1 MiB or more then gets a data file of its own, and a tensor
        that grew along dim 0 (a replay buffer) is stored as row chunks, so only
        its new rows are written (after Check-N-Run, NSDI'22, which wrote only
        the changed rows of recommendation models). Every checkpoint stays whole
        (retention may delete any of them); a checkpoint with row chunks has
        manifest ``format_version`` 2 (older asyncsave raises
        ``UnsupportedFormatError`` on it). One process, whole (not streamed)
        plain saves; other saves write in full (logged once). Off by default.
        See ``asyncsave._incremental`` and docs/decisions.md.
    :param lock: how a saver keeps others out of the root (and of a persistent
        tier's root). ``"flock"`` (default): an exclusive advisory ``flock(2)`` on
        ``<root>/.asyncsave.lock`` for the checkpointer's life (a second saver gets
        :class:`~asyncsave.RootInUseError` naming the holder; a crashed holder's
        lock is gone with its process); a file system that refuses it raises
        :class:`~asyncsave.LockUnavailableError` at open. ``"none"``: no lock, for
        file systems without ``flock`` (Lustre mounted without ``-o flock``, some
        NFS and FUSE mounts; google/tensorstore#183). **Risk:** nothing then keeps
        a second saver out: two checkpointers on one root (two jobs, a restarted
        job whose old processes still run) remove each other's in-flight saves at
        open and may both move the tracker, and a ``Checkpointer`` opened while a
        standalone ``asyncsave.dcp.StorageWriter`` writes into the root may remove
        that save's temporary files. Use it only where one process at a time saves
        into the root (your launcher guarantees it); commits stay atomic and the
        tracker still moves only forward within one saver.
    :param coordinator: the ranks this checkpointer saves with, given instead of
        chosen from ``torch.distributed``: one rank of an
        :class:`asyncsave.testing.FakeGroup` (``FakeGroup(2).rank(1)``), so that
        tests run N ranks in one process without gloo. ``None`` (default): the
        coordinator is chosen from ``distributed``. ``ValueError`` with
        ``distributed=False``, or with ``persistent`` on more than one rank (the
        tier's copier creates a gloo group of its own).
    :param memory: a :class:`MemoryTier`: saves go through shared memory owned
        by a saver process, and survive the trainer's death once ``save()``
        returned; ``root`` is where they persist. What combines with it:
        ``asyncsave._memtier.ROWS`` (``docs/guides/tiers.md``).
    """

    layout: str = "asyncsave"
    retention: Retention | None = None
    budget_bytes: int | None = None
    writer_threads: int = 2
    save_timeout_s: float = 3600.0
    close_timeout_s: float = 600.0
    save_step_zero: bool = False
    allow_pickle: bool = False
    poll_interval_s: float = 0.0005
    direct_io: bool = True
    overlap_writes: bool | None = None
    filesystem: LocalFileSystem | None = None
    storage_options: Mapping[str, Any] | None = None
    distributed: bool | None = None
    dist_timeout_s: float = 1800.0
    persistent: Tier | None = None
    incremental: bool = False
    lock: str = "flock"
    coordinator: Coordinator | None = None
    memory: MemoryTier | None = None

    def __post_init__(self) -> None:
        check_lock_mode(self.lock)
        if self.coordinator is not None:
            self._check_coordinator()
        if self.layout not in LAYOUTS:
            raise ValueError(f"layout={self.layout!r} is not one of {sorted(LAYOUTS)}")
        object.__setattr__(self, "retention", as_retention(self.retention))
        if self.budget_bytes is not None and (
            isinstance(self.budget_bytes, bool)
            or not isinstance(self.budget_bytes, int)
            or self.budget_bytes <= 0
        ):
            raise ValueError(f"budget_bytes={self.budget_bytes!r} must be a positive int or None")
        if (
            isinstance(self.writer_threads, bool)
            or not isinstance(self.writer_threads, int)
            or not 1 <= self.writer_threads <= 64
        ):
            raise ValueError(f"writer_threads={self.writer_threads!r} must be an int in 1..64")
        if self.storage_options is not None and not isinstance(self.storage_options, Mapping):
            raise ValueError(
                f"storage_options={self.storage_options!r} must be a mapping of keyword arguments"
            )
        if self.persistent is not None and not isinstance(self.persistent, Tier):
            raise ValueError(f"persistent={self.persistent!r} must be an asyncsave.Tier or None")
        if self.memory is not None and not isinstance(self.memory, MemoryTier):
            raise ValueError(f"memory={self.memory!r} must be an asyncsave.MemoryTier or None")
        if self.incremental not in (True, False):
            raise ValueError(f"incremental={self.incremental!r} must be True or False")
        if self.overlap_writes not in (None, True, False):
            raise ValueError(f"overlap_writes={self.overlap_writes!r} must be None, True or False")
        if self.distributed not in (None, True, False):
            raise ValueError(f"distributed={self.distributed!r} must be None, True or False")
        for name in ("save_timeout_s", "close_timeout_s", "poll_interval_s", "dist_timeout_s"):
            value = getattr(self, name)
            if (
                isinstance(value, bool)
                or not isinstance(value, (int, float))
                or not math.isfinite(value)
                or value <= 0
            ):
                raise ValueError(f"{name}={value!r} must be a positive finite number")

    def _check_coordinator(self) -> None:
        from ._coord import Coordinator  # torch.distributed: only once one is given

        coord = self.coordinator
        if not isinstance(coord, Coordinator):
            raise ValueError(
                f"coordinator={coord!r} must be a rank of asyncsave.testing.FakeGroup or None"
            )
        if self.distributed is False:
            raise ValueError(f"coordinator={coord!r} with distributed=False: pass one of them")
        if self.persistent is not None and coord.world_size > 1:
            raise ValueError(
                f"coordinator={coord!r} of {coord.world_size} ranks with persistent=: the "
                "persistent tier's copier creates a gloo group of its own"
            )
