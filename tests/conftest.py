"""Shared fixtures, and how the suite runs.

Async tests run on asyncio; the modules whose subject is the event loop itself
(the engine, close and its flush, cancellation and hangs, ordering of saves, lazy
staging, writing while staging) run on asyncio, asyncio+uvloop and trio, where a
backend difference could change the outcome (the uvloop and trio runs are marked
``slow``: the fast tier runs them on asyncio only). ``ASYNCSAVE_ALL_BACKENDS=1``
runs every async test on all three.

Parallel runs (pytest-xdist, ``python -m pytest -n 2``; ``--dist loadgroup`` is
in the suite's addopts):

* tests that use a fixture of module or class scope defined in the suite (two
  ranks that run every case of a module at once, a reference training run, a
  module's tally of power-loss states) are put in one ``xdist_group`` per
  defining module or class, so that one worker runs them and the fixture is set
  up once; a session fixture (the moto S3 server) is set up once per worker;
* tests marked ``slow`` are handed out first, so that a long one does not end the
  run on one worker while the other idles;
* each worker's reliability counts go to the controller (xdist's ``workeroutput``),
  which prints the totals.

torch and hypothesis are imported only by the test modules that use them, so a
run of one module that needs neither starts in a fraction of a second; the
hypothesis profile is loaded before the first test module that imports it.

The ``leakcheck`` plugin fails the run when a process the suite started is still
alive at its end (see ``tests/leakcheck.py``).
"""

from __future__ import annotations

import http.client
import importlib.abc
import importlib.machinery
import importlib.util
import json
import os
import re
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

pytest_plugins = ["leakcheck"]


# uvloop and trio are marked slow: the fast tier (``-m "not slow"``) runs every
# async test once, on asyncio; the full suite runs the backend matrix.
_BACKENDS = [
    pytest.param(("asyncio", {}), id="asyncio"),
    pytest.param(("asyncio", {"use_uvloop": True}), id="uvloop", marks=pytest.mark.slow),
    pytest.param(("trio", {}), id="trio", marks=pytest.mark.slow),
]
# Test modules about the event loop: the engine, close, cancellation and hangs.
_ALL_BACKEND_MODULES = frozenset(
    {
        "test_engine",
        "test_close_flush",
        "test_hangs",
        "test_ordering",
        "test_lazy",
        "test_overlap_writes",
        "test_policy",
        "test_sync",
    }
)


@pytest.fixture
def anyio_backend() -> tuple[str, dict[str, object]]:
    """Overridden by the parametrization below (anyio's own fixture runs every backend)."""
    return ("asyncio", {})


def _parametrized_by_the_test(metafunc: pytest.Metafunc) -> bool:
    for mark in metafunc.definition.iter_markers("parametrize"):
        names = mark.args[0]
        if isinstance(names, str):
            names = [n.strip() for n in names.split(",")]
        if "anyio_backend" in names:
            return True
    return False


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "anyio_backend" not in metafunc.fixturenames or _parametrized_by_the_test(metafunc):
        return
    module = metafunc.module.__name__.rpartition(".")[2]
    every = module in _ALL_BACKEND_MODULES or os.environ.get("ASYNCSAVE_ALL_BACKENDS") == "1"
    metafunc.parametrize("anyio_backend", _BACKENDS if every else _BACKENDS[:1])


@pytest.fixture(autouse=True)
def _deterministic() -> None:
    """torch's generator seeded for every test, once a test module imported torch
    (a test that imports torch itself gets torch's fixed default seed)."""
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.manual_seed(0)


def cuda_available() -> bool:
    import torch

    return bool(torch.cuda.is_available())


# -- hypothesis ---------------------------------------------------------------------
# Bounded in CI; ASYNCSAVE_FUZZ_PROFILE=long for a longer local run. The profile must
# be loaded before a test module applies @settings (which copies the default then),
# so it is loaded as hypothesis is first imported, by whichever module imports it.


def _load_fuzz_profile(hypothesis: ModuleType) -> None:
    settings = hypothesis.settings
    settings.register_profile("ci", max_examples=200, deadline=None)
    settings.register_profile("long", max_examples=20_000, deadline=None)
    settings.load_profile(os.environ.get("ASYNCSAVE_FUZZ_PROFILE", "ci"))


class _AfterImport(importlib.abc.MetaPathFinder):
    """Calls ``then(module)`` right after the module ``name`` is first executed.

    It finds nothing itself: it asks the finders after it for the spec, and wraps
    that spec's loader for this one module (a loader may serve many modules, as
    pytest's assertion rewriter does)."""

    def __init__(self, name: str, then: Callable[[ModuleType], None]) -> None:
        self.name = name
        self.then = then

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname != self.name:
            return None
        sys.meta_path.remove(self)  # once
        spec = importlib.util.find_spec(fullname)
        loader = spec.loader if spec is not None else None
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        execute = loader.exec_module

        def exec_module(module: ModuleType) -> None:
            if module.__name__ != fullname:
                execute(module)
                return
            loader.exec_module = execute  # type: ignore[method-assign]
            execute(module)
            self.then(module)

        loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


if "hypothesis" in sys.modules:
    _load_fuzz_profile(sys.modules["hypothesis"])
else:
    sys.meta_path.insert(0, _AfterImport("hypothesis", _load_fuzz_profile))


# -- the S3 server ---------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait_until_it_answers(proc: subprocess.Popen[bytes], port: int, log: Any) -> None:
    deadline = time.monotonic() + 60
    while True:
        if proc.poll() is not None:
            pytest.fail(f"moto server exited with {proc.returncode}: {log.read_text()}")
        try:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=1)
            conn.request("GET", "/")
            conn.getresponse().read()
            conn.close()
            return
        except OSError:
            if time.monotonic() > deadline:
                pytest.fail(f"moto server did not answer within 60 s: {log.read_text()}")
            time.sleep(0.1)


@pytest.fixture(scope="session")
def moto_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """One moto S3 server process on 127.0.0.1 (its endpoint URL) for every test of
    the session that needs S3 (one per xdist worker); each test makes a bucket of
    its own, so they share it without seeing each other's objects."""
    port = _free_port()
    log = tmp_path_factory.mktemp("moto") / "server.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        _wait_until_it_answers(proc, port, log)
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


# -- xdist: groups, order, reliability counts -----------------------------------------
_SHARED_SCOPES = {"package": 0, "module": 1, "class": 2}


def _shared_fixture_home(item: pytest.Item) -> str | None:
    """Where the widest suite-defined fixture of package, module or class scope that
    ``item`` uses is defined (its node id), or None. A plugin's fixtures (empty base
    id) and session fixtures (set up once per worker anyway) do not count."""
    info = getattr(item, "_fixtureinfo", None)
    if info is None:
        return None
    homes = [
        (_SHARED_SCOPES[d.scope], d.baseid)
        for defs in info.name2fixturedefs.values()
        for d in defs[-1:]
        if d.scope in _SHARED_SCOPES and d.baseid
    ]
    return min(homes)[1] if homes else None


@pytest.hookimpl(tryfirst=True)  # before xdist's worker reads the groups
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if config.pluginmanager.hasplugin("xdist"):
        for item in items:
            home = _shared_fixture_home(item)
            if home is not None:
                item.add_marker(pytest.mark.xdist_group(home))
    # Modules with a slow test first, each module kept in one piece (stable order).
    slow = {_module_of(item) for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: _module_of(item) not in slow)


def _module_of(item: pytest.Item) -> str:
    return item.nodeid.partition("::")[0]


_ALL_SLOW = re.compile(r"^pytestmark = .*\bpytest\.mark\.slow\b", re.M)


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    """The fast tier (``-m "not slow"``) does not even import a test module whose
    every test is slow (a module-level ``pytestmark = pytest.mark.slow``): it would
    select none of them, and importing some (lightning, megatron-core) takes seconds
    in every worker."""
    if not collection_path.name.startswith("test_") or collection_path.suffix != ".py":
        return None
    if "".join(str(config.getoption("markexpr")).split()) != "notslow":
        return None
    return True if _ALL_SLOW.search(collection_path.read_text(encoding="utf-8")) else None


_COUNTS_KEY = "asyncsave_reliability_counts"


class _CountsFromWorkers:
    """On the xdist controller: adds each worker's reliability counts to its own."""

    def pytest_testnodedown(self, node: Any, error: object) -> None:
        from reliability import record

        for name, n in getattr(node, "workeroutput", {}).get(_COUNTS_KEY, {}).items():
            record(name, n)


def pytest_configure(config: pytest.Config) -> None:
    if config.pluginmanager.hasplugin("xdist") and not hasattr(config, "workerinput"):
        config.pluginmanager.register(_CountsFromWorkers(), "asyncsave-counts-from-workers")


def pytest_sessionfinish(session: pytest.Session) -> None:
    workeroutput = getattr(session.config, "workeroutput", None)
    if workeroutput is not None:  # an xdist worker: the controller prints the counts
        from reliability import COUNTS

        workeroutput[_COUNTS_KEY] = dict(COUNTS)


def pytest_terminal_summary(terminalreporter: Any) -> None:
    from reliability import COUNTS

    if not COUNTS:
        return
    terminalreporter.section("reliability counts")
    for name, n in sorted(COUNTS.items()):
        terminalreporter.write_line(f"{name:28s} {n}")
    out = os.environ.get("ASYNCSAVE_RELIABILITY_JSON")
    if out:
        with open(out, "w") as f:
            json.dump(COUNTS, f, indent=1, sort_keys=True)


@pytest.fixture
def small_fs(tmp_path: Path) -> Any:
    """A real 4 MiB tmpfs mounted for the test (root only; skips elsewhere, as a
    disk-full test cannot run without it), unmounted afterwards."""
    mnt = tmp_path / "small"
    mnt.mkdir()
    proc = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(mnt)],
        capture_output=True,
        text=True,
    )
    if proc.returncode != 0:
        if os.geteuid() != 0 or "permission" in proc.stderr.lower():
            pytest.skip(f"cannot mount a tmpfs here: {proc.stderr.strip()}")
        raise AssertionError(proc.stderr)
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=True)
