"""The documentation: the README and every page under ``docs/`` (but
``docs/decisions_new/``, notes not yet merged).

- A Python block marked ``<!-- runnable -->`` runs as it is, in a fresh interpreter
  and an empty directory, and prints what its comments say (``print(x)  # value``,
  or a ``# value`` line right after the print). Every other Python block is marked
  ``<!-- fragment -->``, so no block that looks runnable is silently left unrun.
- The API reference names every public name of ``asyncsave``, ``asyncsave.dcp``,
  ``asyncsave.megatron``, ``asyncsave.lightning`` and ``asyncsave.testing``; ``mkdocs build --strict`` (in
  ``.ci/run``) fails on a name that no longer exists.
- No internal tracking number (a scenario id such as ``S13``, an ``issue 11``) is
  left in the library, the examples, the benchmarks, the README or the docs.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
UNMERGED = DOCS / "decisions_new"


def pages() -> list[Path]:
    """The README and every Markdown page of the site."""
    found = sorted(p for p in DOCS.rglob("*.md") if UNMERGED not in p.parents)
    return [ROOT / "README.md", *found]


_FENCE = re.compile(r"^([ \t]*)```python\n(.*?)^\1```", re.S | re.M)
_MARK = re.compile(r"<!-- (runnable|fragment) -->\s*$")


def python_blocks(text: str) -> list[tuple[str | None, str, int]]:
    """``(marker, code, line)`` of every fenced Python block: the marker is the HTML
    comment on the last non-blank line before the fence (``None`` if there is none);
    the code is dedented by the fence's own indentation."""
    blocks = []
    for m in _FENCE.finditer(text):
        before = [line for line in text[: m.start()].splitlines() if line.strip()]
        mark = _MARK.search(before[-1]) if before else None
        indent = len(m.group(1))
        code = "\n".join(line[indent:] for line in m.group(2).splitlines()) + "\n"
        blocks.append((mark.group(1) if mark else None, code, text.count("\n", 0, m.start()) + 1))
    return blocks


def expected_output(code: str) -> list[str]:
    """The ``print(...)  # value`` comments and ``# value`` lines right after a print."""
    out, lines = [], code.splitlines()
    for i, line in enumerate(lines):
        if "print(" not in line:
            continue
        m = re.search(r"\)\s+#\s*(.+)$", line)
        if m:
            out.append(m.group(1).split(" (")[0].strip())
        elif i + 1 < len(lines) and lines[i + 1].strip().startswith("# "):
            out.append(lines[i + 1].strip()[2:])
    return out


def _runnable() -> list[tuple[str, str]]:
    found = []
    for page in pages():
        for mark, code, line in python_blocks(page.read_text(encoding="utf-8")):
            if mark == "runnable":
                found.append((f"{page.relative_to(ROOT)}:{line}", code))
    return found


RUNNABLE = _runnable()


def test_python_blocks_parse_with_their_markers() -> None:
    text = (
        "x\n<!-- runnable -->\n```python\nprint(1)  # 1\n```\n\n"
        "- item\n\n  <!-- fragment -->\n  ```python\n  a = 1\n  ```\n"
        "```python\nb = 2\n```\n"
    )
    assert python_blocks(text) == [
        ("runnable", "print(1)  # 1\n", 3),
        ("fragment", "a = 1\n", 10),
        (None, "b = 2\n", 13),
    ]


def test_expected_output_reads_both_comment_forms() -> None:
    code = "print(a)  # 17 (saved at the boundary)\nprint(b)\n# ['x', 'y']\nprint(c)\n"
    assert expected_output(code) == ["17", "['x', 'y']"]


def test_every_python_block_is_marked_runnable_or_fragment() -> None:
    unmarked = [
        f"{page.relative_to(ROOT)}:{line}"
        for page in pages()
        for mark, _, line in python_blocks(page.read_text(encoding="utf-8"))
        if mark is None
    ]
    assert not unmarked, f"mark these blocks <!-- runnable --> or <!-- fragment -->: {unmarked}"


def test_the_docs_have_runnable_blocks_and_each_prints_something_checked() -> None:
    assert len(RUNNABLE) >= 10
    silent = [where for where, code in RUNNABLE if not expected_output(code)]
    assert not silent, f"runnable blocks that check no output: {silent}"


@pytest.mark.slow
@pytest.mark.parametrize("code", [c for _, c in RUNNABLE], ids=[w for w, _ in RUNNABLE])
def test_runnable_block_runs_and_prints_what_it_says(tmp_path: Path, code: str) -> None:
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=180
    )
    assert proc.returncode == 0, proc.stderr
    for expected in expected_output(code):
        assert expected in proc.stdout, (expected, proc.stdout)


def test_the_readme_is_a_front_page_linking_every_guide() -> None:
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert len(readme.splitlines()) <= 250
    guides = sorted(p.relative_to(ROOT).as_posix() for p in (DOCS / "guides").glob("*.md"))
    assert len(guides) >= 12
    missing = [g for g in guides if f"]({g}" not in readme]
    assert not missing, f"the README links no guide {missing}"


def test_every_page_is_in_the_site_navigation() -> None:
    nav = (ROOT / "mkdocs.yml").read_text(encoding="utf-8")
    site = [p for p in pages()[1:] if "_tools" not in p.parts]
    names = [p.relative_to(DOCS).as_posix() for p in site]
    missing = [name for name in names if f": {name}\n" not in nav]
    assert not missing, f"pages not in mkdocs.yml's nav: {missing}"


def _all_of(module: str) -> list[str]:
    """``module.__all__`` read from its source (importing would need its optional
    dependencies: megatron-core, lightning)."""
    path = ROOT / (module.replace(".", "/") + ".py")
    if not path.exists():
        path = ROOT / module.replace(".", "/") / "__init__.py"
    for node in ast.parse(path.read_text(encoding="utf-8")).body:
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets
        ):
            return list(ast.literal_eval(node.value))
    raise AssertionError(f"{path} has no __all__")


_DIRECTIVE = re.compile(r"^::: ([\w.]+)", re.M)
PUBLIC_MODULES = (
    "asyncsave",
    "asyncsave.dcp",
    "asyncsave.megatron",
    "asyncsave.lightning",
    "asyncsave.testing",
)


@pytest.mark.parametrize("module", PUBLIC_MODULES)
def test_the_api_reference_names_every_public_name(module: str) -> None:
    directives = set()
    for page in (DOCS / "api").glob("*.md"):
        directives |= set(_DIRECTIVE.findall(page.read_text(encoding="utf-8")))
    public = _all_of(module)
    if module in directives:  # the whole module rendered: its __all__ with it
        return
    missing = [n for n in public if n != "__version__" and f"{module}.{n}" not in directives]
    assert not missing, f"docs/api/ renders no {missing} of {module}"


# A scenario id (S1..S99) or an issue number used as an internal reference. Amazon
# S3 is a word here, not an id: "S3" counts only where ids are written, in a list of
# ids or in brackets ("(S3)", "S2, S3", "S3's" is the store).
_IDS = re.compile(
    r"\bS(?!3\b)\d{1,2}\b"  # S1, S13 ... but not S3
    r"|[(,]\s*S3\s*[),]"  # (S3), (S2, S3), S3, ...
    r"|\b(?i:issues?) #?\d+\b"  # issue 11, Issue 12, issues 10, issue #4
)


def _id_sources() -> list[Path]:
    files: list[Path] = []
    for folder, pattern in (("asyncsave", "*.py"), ("examples", "*.py"), ("bench", "*.py")):
        files += sorted((ROOT / folder).rglob(pattern))
    files += sorted((ROOT / "bench").glob("*.sh"))
    return files + pages()


def internal_ids(text: str) -> list[str]:
    """The internal ids in ``text``: matches of ``_IDS`` outside a link's address."""
    text = re.sub(r"\]\([^)]*\)", "]()", text)  # a link's URL may hold anything
    return [m.group(0) for m in _IDS.finditer(text)]


def test_internal_ids_are_found_and_public_sources_are_not() -> None:
    found = internal_ids("see (S13) and Issue 11, (S2, S3) or S20 and issue #4")
    assert found == ["S13", "Issue 11", "S2", ", S3)", "S20", "issue #4"]
    clean = "an S3 bucket, s3://x, S3's copy, [pytorch #94238](https://github.com/pytorch/pytorch/issues/94238)"
    assert internal_ids(clean) == []


def test_no_internal_ids_in_the_library_the_docs_or_the_readme() -> None:
    found = {}
    for path in _id_sources():
        ids = internal_ids(path.read_text(encoding="utf-8"))
        if ids:
            found[str(path.relative_to(ROOT))] = sorted(set(ids))
    assert not found, f"name the public source (a link) or say it in words instead of: {found}"
