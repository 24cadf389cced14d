"""The shape of the package (issue 11, item 1): imports between asyncsave's modules
run one way; the core imports no integration; the public surface is pinned.

The import graph is read from the source with ``ast`` (every ``import`` anywhere
in a module, function-level ones included), so a cycle hidden in a function body
counts. Models: trio's ``_tests/test_exports.py`` (a test that pins the public
surface); anyio's backends, named by a string and imported lazily.
"""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest

import asyncsave

PKG = Path(asyncsave.__file__).parent
INTEGRATIONS = {"asyncsave.dcp", "asyncsave.lightning", "asyncsave.megatron"}
# Entry points that may import anything (they are not imported by the library).
TOP = {"asyncsave", "asyncsave.__main__", "asyncsave._cli"}


def _module_name(path: Path) -> str:
    rel = path.relative_to(path.parent.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports(path: Path, modules: set[str]) -> set[str]:
    """The asyncsave modules ``path`` imports (``from . import x`` resolved)."""
    me = _module_name(path)
    package = me if path.name == "__init__.py" else me.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{base}.{node.module}" if node.module else base
            else:
                base = node.module or ""
            # ``from . import x`` imports the module ``x``; ``from .m import y``
            # imports ``m`` (``y`` is a name in it).
            names = [
                f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names
            ]
        else:
            continue
        for name in names:
            while name and name not in modules:
                name = name.rpartition(".")[0]
            if name and name != me:
                found.add(name)
    return found


def import_graph(pkg: Path = PKG) -> dict[str, set[str]]:
    files = sorted(pkg.glob("*.py"))
    modules = {_module_name(f) for f in files}
    return {_module_name(f): _imports(f, modules) for f in files}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every cycle found by a depth-first walk (each reported once per back edge)."""
    found: list[list[str]] = []
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for n in sorted(graph.get(m, ())):
            if state.get(n) == 1:
                found.append([*stack[stack.index(n) :], n])
            elif n not in state:
                visit(n)
        stack.pop()
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m)
    return found


def test_imports_between_modules_run_one_way() -> None:
    graph = import_graph()
    assert "asyncsave._engine" in graph and "asyncsave._pipeline" in graph
    assert cycles(graph) == []


def test_the_core_imports_no_integration() -> None:
    graph = import_graph()
    core = {m for m in graph if m not in INTEGRATIONS | TOP}
    offenders = {m: sorted(graph[m] & INTEGRATIONS) for m in core if graph[m] & INTEGRATIONS}
    assert offenders == {}
    # The engine and the N-rank module do not import each other any more.
    assert "asyncsave._dist" not in _reachable(graph, "asyncsave._pipeline")
    assert "asyncsave._engine" not in graph["asyncsave._dist"]


def _reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    seen: set[str] = set()
    todo = [start]
    while todo:
        for n in graph[todo.pop()]:
            if n not in seen:
                seen.add(n)
                todo.append(n)
    return seen


def test_integrations_are_named_only_in_the_job_registry() -> None:
    """The one way the core reaches an integration: a job named by string in
    ``_jobs`` and imported when such state is saved (anyio's backends)."""
    users = [
        _module_name(f)
        for f in sorted(PKG.glob("*.py"))
        if "import_module" in f.read_text() and _module_name(f) not in TOP | INTEGRATIONS
    ]
    assert users == ["asyncsave._jobs"]
    from asyncsave import _jobs

    assert _jobs.dtensor_job_class() is __import__("asyncsave.dcp").dcp.DTensorJob


def _write(pkg: Path, name: str, text: str) -> None:
    (pkg / name).write_text(text)


def test_the_checks_see_a_cycle_and_a_core_importing_an_integration(tmp_path: Path) -> None:
    """The checks above can fail: on a planted package they find both faults,
    including an import hidden in a function body."""
    pkg = tmp_path / "asyncsave"
    pkg.mkdir()
    _write(pkg, "__init__.py", "from ._engine import X\n")
    _write(pkg, "_engine.py", "from ._dist import Y\nX = 1\n")
    _write(pkg, "_dist.py", "Y = 2\ndef f():\n    from ._engine import X\n    from . import dcp\n")
    _write(pkg, "dcp.py", "from ._dist import Y\n")
    graph = import_graph(pkg)
    assert graph["asyncsave._dist"] == {"asyncsave._engine", "asyncsave.dcp"}
    found = cycles(graph)
    assert any({"asyncsave._dist", "asyncsave._engine"} <= set(c) for c in found)
    core = {m for m in graph if m not in INTEGRATIONS | TOP}
    assert {m for m in core if graph[m] & INTEGRATIONS} == {"asyncsave._dist"}


PUBLIC = [
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
    "LockUnavailableError",
    "MissingItemError",
    "ProtectedCheckpointError",
    "RNGState",
    "RankFailedError",
    "Restored",
    "Retention",
    "RootInUseError",
    "SaveAtStep",
    "SaveBeforeDeadline",
    "SaveEvery",
    "SaveFailedError",
    "SaveHandle",
    "SaveOnSignal",
    "SavePolicy",
    "SaveProgress",
    "StagingBudgetError",
    "StagingPendingError",
    "SyncCheckpointer",
    "SyncSaveHandle",
    "Tagged",
    "TemplateMismatchError",
    "Tier",
    "UncommittedCheckpointError",
    "UnsafeLoadError",
    "UnsupportedFormatError",
    "UnsupportedTensorError",
    "UnsupportedTypeError",
    "WaitTimeoutError",
    "__version__",
    "adopt",
    "checkpoints",
    "latest",
    "load",
    "load_step",
    "load_tensors",
    "stage_before_step",
    "verify",
]


def test_public_surface_is_pinned() -> None:
    assert sorted(asyncsave.__all__) == PUBLIC
    for name in asyncsave.__all__:
        assert hasattr(asyncsave, name), name
    assert set(dir(asyncsave)) >= set(asyncsave.__all__)


@pytest.mark.parametrize(
    ("cls", "methods"),
    [
        (
            asyncsave.Checkpointer,
            [
                "aclose",
                "agree",
                "load_latest",
                "pending_steps",
                "resumed_step",
                "save",
                "staged",
                "staging_pool",
                "tracked_step",
                "update",
                "wait",
            ],
        ),
        (
            asyncsave.SaveHandle,
            ["done", "is_staged", "persisted", "progress", "resolved", "result", "staged", "wait"],
        ),
    ],
)
def test_public_methods_are_pinned(cls: type, methods: list[str]) -> None:
    assert sorted(n for n in vars(cls) if not n.startswith("_")) == methods


def test_checkpointer_orchestrates_only() -> None:
    """The checkpointer admits saves and owns the lifecycle; the pipeline is
    elsewhere. Its code (docstrings aside) stays a few hundred lines."""
    source = inspect.getsource(asyncsave.Checkpointer)
    tree = ast.parse(source)
    docstrings = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                doc = body[0]
                docstrings.update(range(doc.lineno, (doc.end_lineno or doc.lineno) + 1))
    code = [
        line
        for i, line in enumerate(source.splitlines(), 1)
        if i not in docstrings and line.strip() and not line.strip().startswith("#")
    ]
    assert len(code) <= 400, len(code)
    assert not any(name.startswith("_pipeline") for name in vars(asyncsave.Checkpointer))
