"""Pure naming functions of the commit protocol: no I/O here.

Final names come from a layout preset; temporary names are chosen so that no
resolver of any preset (nor a ``glob("*step_*")`` of a hand-written one) can take
them for a checkpoint: they start with a dot and hold no ``step_`` / ``iter_``
substring.
"""

from __future__ import annotations

import dataclasses
import re
import uuid

__all__ = [
    "COMMIT_MARKER_NAME",
    "LAYOUTS",
    "LOCK_NAME",
    "MANIFEST_NAME",
    "Layout",
    "aside_dir_name",
    "data_file_name",
    "is_retired_name",
    "is_temp_name",
    "retired_dir_name",
    "temp_dir_name",
    "temp_dir_step",
    "temp_file_name",
]

MANIFEST_NAME = "manifest.json"
# Written last into a checkpoint on storage without atomic rename (object stores):
# the commit point there. Orbax's name for the same thing on cloud storage.
COMMIT_MARKER_NAME = "commit_success.txt"
LOCK_NAME = ".asyncsave.lock"
_TEMP_PREFIX = ".asyncsave-tmp-"
_TEMP_RE = re.compile(r"^\.asyncsave-tmp-")
_TEMP_DIR_RE = re.compile(r"^\.asyncsave-tmp-(\d+)-[0-9a-f]{12}$")


@dataclasses.dataclass(frozen=True)
class Layout:
    """Where a checkpoint of step ``N`` lives and which file tracks the latest one.

    :param name: the preset's name.
    :param dir_format: ``str.format`` pattern of a final directory name, with the
        step as the only field.
    :param dir_regex: the regex that recognises a final directory name; group 1 is
        the step in decimal.
    :param tracker_name: file in the root holding the latest committed step as a
        bare decimal (Megatron/verl convention), or ``None`` for no tracker (the
        resolver then takes the highest committed directory).
    :param info_name: a flat JSON file written inside each checkpoint directory
        before its commit, holding ``{"step": N, **info}`` (NeMo-RL's
        ``training_info.json``), or ``None``.
    """

    name: str
    dir_format: str
    dir_regex: str
    tracker_name: str | None
    info_name: str | None = None

    def dir_name(self, step: int) -> str:
        """Final directory name of ``step``; e.g. ``step_40``."""
        return self.dir_format.format(step)

    def parse_dir_name(self, name: str) -> int | None:
        """The step a final directory name stands for, or ``None`` if ``name`` is
        not one (temp directories, stray files, other layouts)."""
        match = re.fullmatch(self.dir_regex, name)
        if match is None:
            return None
        return int(match.group(1))


_DECIMAL = r"(0|[1-9][0-9]{0,18})"
_MEGATRON_TRACKER = "latest_checkpointed_iteration.txt"

LAYOUTS: dict[str, Layout] = {
    "asyncsave": Layout(
        name="asyncsave",
        dir_format="step_{}",
        dir_regex=rf"step_{_DECIMAL}",
        tracker_name=_MEGATRON_TRACKER,
    ),
    # verl: trainer/ppo/ray_trainer.py saves global_step_{N}/ and its
    # find_latest_ckpt_path reads latest_checkpointed_iteration.txt.
    "verl": Layout(
        name="verl",
        dir_format="global_step_{}",
        dir_regex=rf"global_step_{_DECIMAL}",
        tracker_name=_MEGATRON_TRACKER,
    ),
    # Megatron-LM: get_checkpoint_name pads the iteration to 7 digits (more digits
    # past 9,999,999, never a leading zero then); read_metadata reads the tracker.
    "megatron": Layout(
        name="megatron",
        dir_format="iter_{:07d}",
        dir_regex=r"iter_([0-9]{7}|[1-9][0-9]{7,18})",
        tracker_name=_MEGATRON_TRACKER,
    ),
    # SkyRL: global_step_{N}/ and latest_ckpt_global_step.txt.
    "skyrl": Layout(
        name="skyrl",
        dir_format="global_step_{}",
        dir_regex=rf"global_step_{_DECIMAL}",
        tracker_name="latest_ckpt_global_step.txt",
    ),
    # NeMo-RL: step_{N}/ published by rename, no tracker (the CheckpointManager
    # takes the highest step_* directory), training_info.json inside.
    "nemo-rl": Layout(
        name="nemo-rl",
        dir_format="step_{}",
        dir_regex=rf"step_{_DECIMAL}",
        tracker_name=None,
        info_name="training_info.json",
    ),
}


def temp_dir_name(step: int) -> str:
    """A fresh temporary directory name for an in-flight save of ``step``.

    >>> temp_dir_name(40).startswith(".asyncsave-tmp-40-")
    True
    """
    return f"{_TEMP_PREFIX}{step}-{uuid.uuid4().hex[:12]}"


def temp_file_name(final_name: str) -> str:
    """A fresh temporary name for a file about to be replaced atomically."""
    return f"{_TEMP_PREFIX}{final_name}-{uuid.uuid4().hex[:12]}"


_RETIRED_PREFIX = f"{_TEMP_PREFIX}retired-"


def retired_dir_name(step: int) -> str:
    """Where retention moves a checkpoint it deletes, just before removing it: a
    temporary name (removed at the next open too) that no in-flight save uses."""
    return f"{_RETIRED_PREFIX}{step}-{uuid.uuid4().hex[:12]}"


def is_retired_name(name: str) -> bool:
    """Whether ``name`` is a checkpoint retention was removing."""
    return name.startswith(_RETIRED_PREFIX)


def aside_dir_name(why: str, step: int) -> str:
    """Where a final-named directory that is not a loadable checkpoint of ``step``
    is moved at open (``why``: ``"damaged"``, ``"incomplete"``, or ``"partial"``:
    a local part of a step not every rank has, ``asyncsave._tiers``): kept for
    inspection, out of every resolver's way (no ``step_`` substring)."""
    return f".asyncsave-{why}-{step}-{uuid.uuid4().hex[:12]}"


_ASIDE_RE = re.compile(r"^\.asyncsave-(damaged|incomplete|partial)-(\d+)-[0-9a-f]{12}$")


def aside_dir_step(name: str) -> int | None:
    """The step of an entry moved aside at open (:func:`aside_dir_name`), or
    ``None`` for any other name.

    >>> aside_dir_step(aside_dir_name("damaged", 40)), aside_dir_step("step_40")
    (40, None)
    """
    m = _ASIDE_RE.match(name)
    return int(m.group(2)) if m else None


def temp_dir_step(name: str) -> int | None:
    """The step of the save writing into temporary directory ``name``
    (:func:`temp_dir_name`), or ``None`` for any other name (retention's retired
    directories included).

    >>> temp_dir_step(temp_dir_name(40)), temp_dir_step(retired_dir_name(40))
    (40, None)
    """
    m = _TEMP_DIR_RE.match(name)
    return int(m.group(1)) if m else None


def is_temp_name(name: str) -> bool:
    """Whether ``name`` is a temporary file or directory asyncsave left behind."""
    return _TEMP_RE.match(name) is not None


def data_file_name(rank: int, index: int) -> str:
    """Name of a data file: one rank may write several, one per writer thread."""
    return f"data-r{rank:05d}-{index:03d}.safetensors"
