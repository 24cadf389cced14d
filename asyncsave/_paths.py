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
    "is_temp_name",
    "temp_dir_name",
    "temp_file_name",
]

MANIFEST_NAME = "manifest.json"
# Written last into a checkpoint on storage without atomic rename (object stores):
# the commit point there. Orbax's name for the same thing on cloud storage.
COMMIT_MARKER_NAME = "commit_success.txt"
LOCK_NAME = ".asyncsave.lock"
_TEMP_PREFIX = ".asyncsave-tmp-"
_TEMP_RE = re.compile(r"^\.asyncsave-tmp-")


@dataclasses.dataclass(frozen=True)
class Layout:
    """Where a checkpoint of step ``N`` lives and which file tracks the latest one.

    :param name: the preset's name.
    :param dir_format: ``str.format`` pattern of a final directory name, with the
        step as the only field.
    :param dir_regex: the regex that recognises a final directory name; group 1 is
        the step in decimal.
    :param tracker_name: file in the root holding the latest committed step as a
        bare decimal (Megatron/verl convention), or ``None`` for no tracker.
    """

    name: str
    dir_format: str
    dir_regex: str
    tracker_name: str | None

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


LAYOUTS: dict[str, Layout] = {
    "asyncsave": Layout(
        name="asyncsave",
        dir_format="step_{}",
        dir_regex=r"step_(0|[1-9][0-9]{0,18})",
        tracker_name="latest_checkpointed_iteration.txt",
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


def aside_dir_name(why: str, step: int) -> str:
    """Where a final-named directory that is not a loadable checkpoint of ``step``
    is moved at open (``why``: ``"damaged"`` or ``"incomplete"``): kept for
    inspection, out of every resolver's way (no ``step_`` substring)."""
    return f".asyncsave-{why}-{step}-{uuid.uuid4().hex[:12]}"


def is_temp_name(name: str) -> bool:
    """Whether ``name`` is a temporary file or directory asyncsave left behind."""
    return _TEMP_RE.match(name) is not None


def data_file_name(rank: int, index: int) -> str:
    """Name of a data file: one rank may write several, one per writer thread."""
    return f"data-r{rank:05d}-{index:03d}.safetensors"
