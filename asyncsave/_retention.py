"""Retention: which committed checkpoints to keep, decided from what is on disk.

A rule looks only at the committed checkpoints found under the root (their steps
and the ``training_info`` in their manifests), never at a list kept in memory, so a
restarted process keeps enforcing it (Source: verl-project/verl #7395, where the
prune list lived in memory and nothing old was deleted after a restart). The engine
applies it only after a commit and the tracker update (https://github.com/verl-project/verl/issues/4667, https://github.com/NovaSky-AI/SkyRL/pull/2145), and never deletes
the tracked checkpoint, the newest committed one, one in flight, or the one this
run resumed from.

Rules combine with ``|``: a checkpoint is kept if any rule keeps it::

    retention = asyncsave.KeepLast(2) | asyncsave.KeepEvery(1000)
    retention = asyncsave.KeepLast(1) | asyncsave.KeepBest(3, metric="eval/reward")
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path

from ._atomicity import discard, strategy_for
from ._catalog import read_checkpoint, scan_steps
from ._fs import LocalFileSystem
from ._paths import Layout, is_retired_name, retired_dir_name

__all__ = [
    "Candidate",
    "KeepBest",
    "KeepBytes",
    "KeepEvery",
    "KeepLast",
    "Retention",
    "apply_retention",
    "retention_plan",
]

logger = logging.getLogger("asyncsave")

_RETRY = "retried by the next pass"


@dataclasses.dataclass(frozen=True)
class Candidate:
    """A committed checkpoint as retention sees it.

    :param step: its step.
    :param training_info: the flat ``training_info`` saved with it (counters and
        metrics), empty when none was given.
    :param nbytes: its tensor bytes (this rank's part).
    """

    step: int
    training_info: Mapping[str, object]
    nbytes: int = 0


class Retention:
    """Base of the retention rules; combine rules with ``|``."""

    def keep(self, candidates: list[Candidate]) -> set[int]:
        """The steps of ``candidates`` (sorted by step) this rule keeps."""
        raise NotImplementedError

    def __or__(self, other: Retention) -> Retention:
        if not isinstance(other, Retention):
            return NotImplemented
        return _AnyOf((*_rules(self), *_rules(other)))


def _rules(rule: Retention) -> tuple[Retention, ...]:
    return rule.rules if isinstance(rule, _AnyOf) else (rule,)


def _positive_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return value


@dataclasses.dataclass(frozen=True)
class _AnyOf(Retention):
    rules: tuple[Retention, ...]

    def keep(self, candidates: list[Candidate]) -> set[int]:
        kept: set[int] = set()
        for rule in self.rules:
            kept |= rule.keep(candidates)
        return kept

    def __repr__(self) -> str:
        return " | ".join(repr(r) for r in self.rules)


@dataclasses.dataclass(frozen=True)
class KeepLast(Retention):
    """Keep the ``k`` committed checkpoints with the highest steps.

    :param k: how many (a positive int).
    :raises ValueError: ``k`` is not a positive int.
    """

    k: int

    def __post_init__(self) -> None:
        _positive_int("KeepLast.k", self.k)

    def keep(self, candidates: list[Candidate]) -> set[int]:
        return {c.step for c in candidates[-self.k :]}


@dataclasses.dataclass(frozen=True)
class KeepBytes(Retention):
    """Keep the newest checkpoints whose tensor bytes add up to at most
    ``budget_bytes`` (the newest is kept whatever its size, as by every rule):
    the byte budget of the memory tier's snapshots (:class:`MemoryTier`).

    :param budget_bytes: bytes (a positive int) of tensor data to keep.
    :raises ValueError: ``budget_bytes`` is not a positive int.
    """

    budget_bytes: int

    def __post_init__(self) -> None:
        _positive_int("KeepBytes.budget_bytes", self.budget_bytes)

    def keep(self, candidates: list[Candidate]) -> set[int]:
        kept: set[int] = set()
        total = 0
        for c in reversed(candidates):
            total += c.nbytes
            if total > self.budget_bytes:
                break
            kept.add(c.step)
        return kept


@dataclasses.dataclass(frozen=True)
class KeepEvery(Retention):
    """Keep every checkpoint whose step is a multiple of ``n`` (step 1000, 2000, ...
    for ``n=1000``), for long-term evaluation.

    :param n: the period in steps (a positive int).
    :raises ValueError: ``n`` is not a positive int.
    """

    n: int

    def __post_init__(self) -> None:
        _positive_int("KeepEvery.n", self.n)

    def keep(self, candidates: list[Candidate]) -> set[int]:
        return {c.step for c in candidates if c.step % self.n == 0}


@dataclasses.dataclass(frozen=True)
class KeepBest(Retention):
    """Keep the ``k`` checkpoints with the best value of a metric in their
    ``training_info`` (``save(..., training_info={"eval/reward": 0.71})``).

    Ties go to the newer step. A checkpoint whose ``training_info`` lacks the
    metric, or holds a non-number or NaN there, is not ranked: this rule does not
    keep it (combine with :class:`KeepLast` to keep recent unevaluated ones).

    :param k: how many (a positive int).
    :param metric: key in ``training_info``.
    :param mode: ``"max"`` (higher is better) or ``"min"``.
    :raises ValueError: a bad ``k``, an empty ``metric`` or an unknown ``mode``.
    """

    k: int
    metric: str
    mode: str = "max"

    def __post_init__(self) -> None:
        _positive_int("KeepBest.k", self.k)
        if not isinstance(self.metric, str) or not self.metric:
            raise ValueError(f"KeepBest.metric must be a non-empty str, got {self.metric!r}")
        if self.mode not in ("max", "min"):
            raise ValueError(f"KeepBest.mode must be 'max' or 'min', got {self.mode!r}")

    def keep(self, candidates: list[Candidate]) -> set[int]:
        ranked: list[tuple[float, int]] = []
        for c in candidates:
            value = c.training_info.get(self.metric)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                continue
            if math.isnan(value):
                continue
            ranked.append((value if self.mode == "max" else -value, c.step))
        ranked.sort(reverse=True)
        return {step for _, step in ranked[: self.k]}


def as_retention(value: object) -> Retention | None:
    """Normalise the ``retention`` option: a rule, an iterable of rules (any of
    them keeps), or ``None`` (keep everything)."""
    if value is None or isinstance(value, Retention):
        return value
    if isinstance(value, Iterable) and not isinstance(value, (str, bytes)):
        rules = list(value)
        if rules and all(isinstance(r, Retention) for r in rules):
            combined = rules[0]
            for r in rules[1:]:
                combined = combined | r
            return combined
    raise ValueError(
        f"retention={value!r} must be a KeepLast/KeepEvery/KeepBest rule, several "
        "combined with |, a list of them, or None"
    )


def retention_plan(
    fs: LocalFileSystem,
    root: Path,
    layout: Layout,
    rule: Retention,
    protected: Iterable[int] | Callable[[], Iterable[int]],
) -> list[int]:
    """The committed steps under ``root`` that :func:`apply_retention` would
    delete now, ascending; nothing is changed (``asyncsave prune --dry-run``).

    Kept whatever ``rule`` says: a step in ``protected`` (a callable is evaluated
    once the candidates are listed) and the newest committed step. Directories whose
    manifest does not read are not candidates.

    :raises OSError: the root cannot be listed.
    """
    candidates: list[Candidate] = []
    for step, path in sorted(scan_steps(fs, root, layout).items()):
        try:
            manifest = read_checkpoint(fs, path, expect_step=step)
        except Exception as exc:  # damaged or foreign: not ours to delete
            logger.debug("retention skips %s: %s", path, exc)
            continue
        candidates.append(Candidate(step, manifest.training_info, manifest.nbytes))
    if not candidates:
        return []
    guard = protected() if callable(protected) else protected
    keep = rule.keep(candidates) | set(guard) | {candidates[-1].step}
    return [c.step for c in candidates if c.step not in keep]


def apply_retention(
    fs: LocalFileSystem,
    root: Path,
    layout: Layout,
    rule: Retention,
    protected: Iterable[int] | Callable[[], Iterable[int]],
) -> list[int]:
    """Delete the committed checkpoints under ``root`` that ``rule`` does not keep.

    Never deletes a step in ``protected`` (the caller passes the step just
    committed, the tracked step and steps in flight; a callable is evaluated once
    the candidates are listed) nor the newest committed step (what a
    tracker-less resolver resumes from). Directories whose manifest does not read
    are left alone (recovery moves them aside at the next open). Each retired
    checkpoint is first renamed to a temporary name and the root fsynced, so a
    crash mid-delete leaves either the whole checkpoint under its final name or a
    temporary directory that the next open removes, never a partial checkpoint
    under a final name. On object stores (no atomic rename) its commit marker is
    deleted first instead, with the same effect (``_marker``).

    A checkpoint that is a symlink (to another run's checkpoint, https://github.com/facebookresearch/PyTorch-BigGraph/pull/24) is retired by
    renaming and unlinking the link; its target is never touched, and a symlink
    inside a checkpoint is removed as a link (``fs.remove_tree``).

    Each deletion is independent: one whose rename or removal fails is logged at
    WARNING and retried by the next pass (a leftover under a retired name) or
    stays under its final name (a failed rename); the others go on. Leftovers of
    an earlier pass are removed first.

    :returns: the steps retired (no longer under their final names), ascending.
    :raises OSError: the root cannot be listed, or a checkpoint not read.
    """
    leftovers = [root / name for name in fs.listdir(root) if is_retired_name(name)]
    if leftovers:
        fs.fsync_dir(root)  # their renames are durable before their files go
    for path in leftovers:
        if discard(fs, path, _RETRY, by="retention"):
            logger.info("retention removed the leftover %s", path.name)
    doomed_steps = retention_plan(fs, root, layout, rule, protected)
    retired: list[int] = []
    moves = strategy_for(fs).can_move_files
    for step in doomed_steps:
        final = root / layout.dir_name(step)
        if not moves:
            # Object stores (``_marker``): a rename would copy every object; deleting
            # the commit marker first (remove_tree does) uncommits it in one request.
            if discard(fs, final, _RETRY, by="retention"):
                retired.append(step)
                logger.info("retention removed %s", final)
            continue
        doomed = root / retired_dir_name(step)
        try:
            fs.rename(final, doomed)
        except OSError as exc:
            logger.warning(
                "retention failed to retire %s (retried by the next pass): %r", final, exc
            )
            continue
        retired.append(step)
        try:
            fs.fsync_dir(root)  # the rename is durable before any file goes
        except OSError as exc:
            logger.warning("retention left %s for the next pass: %r", doomed, exc)
            continue
        if discard(fs, doomed, _RETRY, by="retention"):
            logger.info("retention removed %s", final)
    return retired
