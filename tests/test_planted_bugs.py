"""The planted bugs of ``tests/planted_bugs.sh`` still apply to the engine.

The script plants each bug by a literal text replacement in an engine file and
refuses to go on when the text is gone; the engine changes under it, so this
checks (cheaply, in every run of the suite) that each bug's text is found exactly
once in its file and that its suite selection names test files that exist. Two
bugs went stale once when the code they targeted was rewritten.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "tests" / "planted_bugs.sh"


def planted() -> list[tuple[str, str, str, str]]:
    """(id, file, text to find, suite) of every bug in the script's BUGS array."""
    bugs = []
    for line in SCRIPT.read_text().splitlines():
        m = re.fullmatch(r'"([0-9]+r?)\|([^|]+)\|(.+)\|(.*)\|([^|]+)"', line)
        if m:
            bug_id, path, find, _replace, suite = m.groups()
            bugs.append((bug_id, path, find.replace("\\n", "\n").replace('\\"', '"'), suite))
    return bugs


def test_the_script_lists_its_bugs() -> None:
    ids = [b[0] for b in planted()]
    assert len(ids) >= 19 and len(set(ids)) == len(ids), ids


@pytest.mark.parametrize("bug", planted(), ids=lambda b: f"bug-{b[0]}")
def test_each_planted_bug_still_applies(bug: tuple[str, str, str, str]) -> None:
    bug_id, path, find, suite = bug
    text = (ROOT / path).read_text()
    assert text.count(find) == 1, f"bug {bug_id}: its text is not found once in {path}"
    for test_file in suite.split()[:1]:
        assert (ROOT / test_file).is_file(), f"bug {bug_id}: no {test_file}"
