"""Which staging options combine: one table, data in the code.

Each row says, for one option in one context (how many ranks, how the root
commits, where the tensors live), either which staging mode the option asks for
or that the combination is refused, and why. The job factory
(``asyncsave._jobs.plain_job``) looks every option of a save up here once,
raises the refusals, and picks the mode by :data:`PRECEDENCE`; nothing else
decides a staging mode. ``docs/guides/combinations.md`` is this table, rendered
by :func:`markdown` (``tests/test_combine.py`` checks the page against it).

Pure: no I/O, no torch.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

__all__ = [
    "MODES",
    "OPTIONS",
    "PRECEDENCE",
    "ROWS",
    "Context",
    "Row",
    "contexts",
    "lookup",
    "markdown",
]

#: The staging modes, each one job class of ``asyncsave._jobs``:
#: ``whole`` (staged whole, then written), ``following`` (written while staged),
#: ``streamed`` (rounds of at most ``budget_bytes``, each written while the next
#: is staged), ``incremental`` (files equal to the previous checkpoint's shared).
MODES = ("whole", "following", "streamed", "incremental")

#: When several options of one save ask for a mode, the first mode of this list
#: wins (a streamed save's rounds are already written while staged; an
#: incremental save writes its changed files while the others are hashed).
PRECEDENCE = ("streamed", "incremental", "following")

#: The options of the table (the value that asks for them).
OPTIONS = (
    "plain",  # no staging option: the default
    "overlap_writes=True",
    "overlap_writes=None, lazy save",
    "state over budget_bytes",
    "incremental=True",
    "direct_io=True",
)

RANKS = ("one", "several")
STORAGE = ("rename", "marker")  # the root commits by atomic rename, or by a commit marker
DEVICES = ("cpu", "cuda")


@dataclasses.dataclass(frozen=True)
class Context:
    """Where one save runs: ``ranks`` (``"one"``/``"several"``), ``storage``
    (``"rename"``: a POSIX root; ``"marker"``: an object store), ``device``
    (``"cpu"``; ``"cuda"`` when any tensor of the state is on a GPU)."""

    ranks: str
    storage: str
    device: str


@dataclasses.dataclass(frozen=True)
class Row:
    """One cell of the table: ``option`` in the contexts it matches (``"*"``
    matches any value). ``mode`` is the mode the option asks for; ``None`` when
    the option does not choose a mode there (``note`` says what happens), and
    ``refused`` holds the reason (with the way forward) when the combination is
    refused. ``warned``: the note is also logged once per checkpointer."""

    option: str
    ranks: str
    storage: str
    device: str
    mode: str | None
    note: str
    refused: str | None = None
    warned: bool = False

    def matches(self, option: str, ctx: Context) -> bool:
        return (
            self.option == option
            and self.ranks in ("*", ctx.ranks)
            and self.storage in ("*", ctx.storage)
            and self.device in ("*", ctx.device)
        )

    @property
    def supported(self) -> bool:
        return self.refused is None


_OWN_DIR = (
    "files written while staged go into a directory of the rank's own, moved into "
    "the save's by rename"
)

#: The table. The first row that matches an option and a context answers.
ROWS: tuple[Row, ...] = (
    Row("plain", "*", "*", "*", "whole", "staged whole into the pool, then written"),
    Row(
        "overlap_writes=True",
        "*",
        "marker",
        "*",
        None,
        "",
        refused=(
            f"{_OWN_DIR}, which a root that commits by marker cannot do (every byte "
            "would be uploaded twice): leave overlap_writes=None (the default) or False"
        ),
    ),
    Row(
        "overlap_writes=True",
        "*",
        "rename",
        "cuda",
        None,
        "",
        refused=(
            "CUDA tensors are copied on a CUDA stream and their completion is seen "
            "through events; the writers follow host copies only: leave "
            "overlap_writes=None (the default) or False for CUDA state"
        ),
    ),
    Row(
        "overlap_writes=True",
        "*",
        "rename",
        "cpu",
        "following",
        "written while staged, eager saves too (a state under 16 MiB, or one "
        "saved while an earlier save is unresolved, is staged, then written)",
    ),
    Row(
        "overlap_writes=None, lazy save",
        "*",
        "rename",
        "cpu",
        "following",
        "written while staged (a state under 16 MiB, or one saved while an "
        "earlier save is unresolved, is staged, then written)",
    ),
    Row(
        "overlap_writes=None, lazy save",
        "*",
        "*",
        "*",
        None,
        "staged, then written (the default never refuses: it follows where "
        "overlap_writes=True would be supported)",
    ),
    Row(
        "state over budget_bytes",
        "several",
        "marker",
        "*",
        None,
        "",
        refused=(
            "on several ranks a state larger than the budget streams through a "
            "directory of the rank's own, moved into the save's by rename, which a "
            "root that commits by marker cannot do (it would upload every byte "
            "twice): give each rank a budget its state fits"
        ),
    ),
    Row(
        "state over budget_bytes",
        "*",
        "*",
        "*",
        "streamed",
        "streamed in rounds of at most budget_bytes, each written while the next "
        "is staged; buffered writes",
    ),
    Row(
        "incremental=True",
        "several",
        "*",
        "*",
        None,
        "every byte written (sharing files across ranks is not supported yet)",
        warned=True,
    ),
    Row(
        "incremental=True",
        "one",
        "rename",
        "*",
        "incremental",
        "equal files hard-linked; files written before are hashed in place while "
        "the rest is staged, changed ones written at once",
    ),
    Row(
        "incremental=True",
        "one",
        "marker",
        "*",
        "incremental",
        "equal files shared by a server-side copy, compared after staging",
    ),
    Row(
        "direct_io=True",
        "*",
        "rename",
        "*",
        None,
        "O_DIRECT for the bulk of whole and incremental saves' files where the "
        "file system accepts it (tmpfs does not: buffered); streamed rounds are "
        "buffered",
    ),
    Row("direct_io=True", "*", "marker", "*", None, "not applicable (buffered uploads)"),
)


def contexts() -> Iterable[Context]:
    """Every context of the table (ranks x storage x device)."""
    for ranks in RANKS:
        for storage in STORAGE:
            for device in DEVICES:
                yield Context(ranks, storage, device)


def lookup(option: str, ctx: Context) -> Row:
    """The row that answers ``option`` in ``ctx`` (the first that matches).

    :raises LookupError: no row matches (a gap in the table: a bug).
    """
    for row in ROWS:
        if row.matches(option, ctx):
            return row
    raise LookupError(f"no row of the table of what combines for {option!r} in {ctx}")


def markdown() -> str:
    """The table as a Markdown page (``docs/guides/combinations.md``)."""
    lines = [
        "# Which options combine",
        "",
        "<!-- Generated from asyncsave/_combine.py by docs/_tools/combinations.py; "
        "a test checks it. -->",
        "",
        "Each staging option of a save, on one rank or several, on a root that",
        "commits by rename (a POSIX file system) or by a commit marker (an object",
        "store), with the state on the CPU or on a GPU: supported (the staging",
        "mode it selects, and what happens) or refused by `save()`, before",
        "anything is staged or written, with an error that says why and what to",
        "do: `UnsupportedCombinationError`, or `StagingBudgetError` for a state",
        "over the budget (both a `CheckpointError` and a `ValueError`); the",
        "checkpointer stays usable. `*` matches any value; the first matching row",
        "answers. When several options ask for a mode, the first of",
        f"{', '.join(PRECEDENCE)} wins.",
        "",
        "<!-- fragment -->",
        "```python",
        'async with asyncsave.Checkpointer("s3://bucket/run", overlap_writes=True) as ckpt:',
        "    await ckpt.save(10, state)   # UnsupportedCombinationError: leave",
        "                                 # overlap_writes=None (the default) or False",
        "```",
        "",
        "| option | ranks | storage | device | mode | what happens |",
        "|---|---|---|---|---|---|",
    ]
    for row in ROWS:
        what = f"**refused**: {row.refused}" if row.refused else row.note
        if row.warned:
            what += " (logged once)"
        lines.append(
            f"| `{row.option}` | {row.ranks} | {row.storage} | {row.device} "
            f"| {row.mode or '-'} | {what} |"
        )
    return "\n".join(lines) + "\n"
