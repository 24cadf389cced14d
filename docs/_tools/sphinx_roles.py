"""A griffe extension for the documentation build: asyncsave's docstrings use
Sphinx roles (``:class:`~asyncsave.Checkpointer```, ``:meth:`save```) and ``::``
before literal blocks; the site renders Markdown.

A role naming a public object by its full path (``asyncsave.X``, no private part)
becomes a cross-reference, so ``mkdocs build --strict`` fails when the name goes
stale; any other role (a private helper, a name relative to its class) becomes
code. A line ending in ``::`` ends in ``:`` (the indented block after it is code in
Markdown too)."""

from __future__ import annotations

import re
from typing import Any

import griffe

_ROLE = re.compile(r":(?:py:)?(?:class|meth|func|attr|exc|mod|data|obj):`(~?)([\w.]+)`")
_LITERAL = re.compile(r"(\S)::$", re.M)
_BARE_LITERAL = re.compile(r"^(\s*)::$", re.M)


def _role(match: re.Match[str]) -> str:
    short, target = match.group(1), match.group(2)
    shown = target.rsplit(".", 1)[-1] if short else target
    public = target.startswith("asyncsave.") and "._" not in target
    return f"[`{shown}`][{target}]" if public else f"`{shown}`"


def markdown_of(text: str) -> str:
    """The docstring ``text`` with Sphinx roles and ``::`` turned into Markdown."""
    text = _ROLE.sub(_role, text)
    text = _BARE_LITERAL.sub("", text)
    return _LITERAL.sub(r"\1:", text)


class SphinxRoles(griffe.Extension):
    """Rewrites every docstring as it is loaded."""

    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = markdown_of(obj.docstring.value)
