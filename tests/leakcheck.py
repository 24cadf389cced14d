"""A pytest plugin: the run fails when a process it started is still alive at its end.

A test that starts a process (a subprocess, a ``multiprocessing`` child, a forked
rank, a server, or a process one of those starts) must see it end before the
session ends. The plugin finds the session's processes at the end in three ways,
since a process whose parent exited is reparented (to init, or the nearest
subreaper) and no longer looks like a descendant:

* **descendants**: children of the pytest process, recursively, while the chain of
  parents is unbroken;
* **environment**: every process exec'd by the session inherits
  ``ASYNCSAVE_TEST_SESSIONS``, a ``:``-separated list of session tokens set at
  configure time (a nested pytest session appends its own), read back from
  ``/proc/PID/environ`` (``subprocess``, ``multiprocessing`` spawn and forkserver
  children, and what they start, unless a caller replaced the environment);
* **descriptor**: a process forked without exec shows its parent's environment
  as it was at exec time, without the token, but inherits every open descriptor:
  the session keeps one end of a pipe open (close-on-exec), and a process holding
  that pipe was forked from the session.

Processes that existed when the session started are never counted. A process
that is exiting gets ``GRACE_S`` seconds to finish. Two helpers of the pytest
process itself are allowed, since they end when it ends: ``multiprocessing``'s
resource tracker and forkserver as its direct children.

What remains is reported (pid, command line, how it was found, the test that was
running when it started), killed with ``SIGKILL``, and the session's exit status
becomes 1. A process that both clears its environment and closes inherited
descriptors before its parent exits escapes all three (none of the suite's do).

Under pytest-xdist the controller alone checks, once its workers have exited:
the workers were started with the token in their environment, so whatever a test
starts on a worker, exec'd or forked, carries it.

Enabled for the suite by ``tests/conftest.py`` (``pytest_plugins``); any other
session loads it with ``-p leakcheck`` (``tests`` on ``sys.path``).
"""

from __future__ import annotations

import bisect
import os
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import psutil
import pytest

ENV = "ASYNCSAVE_TEST_SESSIONS"
GRACE_S = 3.0
_ALLOWED_HELPERS = ("multiprocessing.resource_tracker", "multiprocessing.forkserver")


@dataclass
class _Session:
    token: str
    beacon_fd: int
    beacon: str  # readlink of the pipe: "pipe:[inode]"
    before: set[tuple[int, float]]
    previous_env: str | None
    tests: list[tuple[float, str]] = field(default_factory=list)  # (start, nodeid)
    leaks: list[str] = field(default_factory=list)


_SESSION: _Session | None = None


def _snapshot() -> set[tuple[int, float]]:
    procs = set()
    for p in psutil.process_iter(["create_time"]):
        procs.add((p.pid, p.info["create_time"] or 0.0))
    return procs


def pytest_configure(config: pytest.Config) -> None:
    global _SESSION
    if _SESSION is not None or hasattr(config, "workerinput"):  # once; not in xdist workers
        return
    token = f"{os.getpid()}-{uuid.uuid4().hex[:12]}"
    previous = os.environ.get(ENV)
    os.environ[ENV] = f"{previous}:{token}" if previous else token
    r, w = os.pipe()  # both close-on-exec (PEP 446): only forks inherit it
    os.close(r)
    _SESSION = _Session(
        token=token,
        beacon_fd=w,
        beacon=os.readlink(f"/proc/self/fd/{w}"),
        before=_snapshot(),
        previous_env=previous,
    )


def _since_boot(pid: int) -> float:
    """When ``pid`` started, in seconds of ``CLOCK_BOOTTIME`` (``/proc/PID/stat``
    field 22), the clock :func:`pytest_runtest_logstart` reads: wall-clock
    ``create_time`` can be off by a second."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return int(fields[19]) / os.sysconf("SC_CLK_TCK")


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_logstart(nodeid: str, location: Any) -> None:
    if _SESSION is not None:
        _SESSION.tests.append((time.clock_gettime(time.CLOCK_BOOTTIME), nodeid))


def _how_found(p: psutil.Process, s: _Session, descendants: set[int]) -> str | None:
    """Why ``p`` is this session's, or None."""
    if p.pid in descendants:
        return "descendant"
    try:
        if s.token in p.environ().get(ENV, "").split(":"):
            return f"environment {ENV}"
    except (psutil.Error, OSError):
        pass
    try:
        for fd in os.listdir(f"/proc/{p.pid}/fd"):
            try:
                if os.readlink(f"/proc/{p.pid}/fd/{fd}") == s.beacon:
                    return "inherited the session's descriptor (forked)"
            except OSError:
                continue
    except OSError:
        pass
    return None


def _is_allowed_helper(p: psutil.Process) -> bool:
    try:
        cmd = " ".join(p.cmdline())
        return p.ppid() == os.getpid() and any(h in cmd for h in _ALLOWED_HELPERS)
    except psutil.Error:
        return True  # gone


def _started_during(s: _Session, pid: int) -> str:
    try:
        created = _since_boot(pid)
    except (OSError, IndexError, ValueError):
        return "(unknown)"
    starts = [t for t, _ in s.tests]
    # the start time is truncated to a clock tick: round it up
    i = bisect.bisect_right(starts, created + 1 / os.sysconf("SC_CLK_TCK")) - 1
    return s.tests[i][1] if i >= 0 else "(before the first test)"


def find_leaks(s: _Session) -> list[tuple[psutil.Process, str]]:
    """The session's processes alive now, except the allowed helpers."""
    me = psutil.Process()
    descendants = {c.pid for c in me.children(recursive=True)}
    found = []
    for p in psutil.process_iter(["create_time", "status"]):
        if p.pid == me.pid or (p.pid, p.info["create_time"] or 0.0) in s.before:
            continue
        if p.info["status"] == psutil.STATUS_ZOMBIE:
            continue  # exited; its parent has not reaped it yet
        how = _how_found(p, s, descendants)
        if how is not None and not _is_allowed_helper(p):
            found.append((p, how))
    return found


@pytest.hookimpl(trylast=True)  # after xdist's controller has stopped its workers
def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    s = _SESSION
    if s is None:
        return
    leaks = find_leaks(s)
    if leaks:
        _, alive = psutil.wait_procs([p for p, _ in leaks], timeout=GRACE_S)
        still = {p.pid for p in alive}
        leaks = [(p, how) for p, how in leaks if p.pid in still]
    for p, how in leaks:
        try:
            cmd = " ".join(p.cmdline())[:300]
            line = (
                f"pid {p.pid} (parent {p.ppid()}, {how}), started during "
                f"{_started_during(s, p.pid)}: {cmd}"
            )
            p.kill()
        except psutil.Error as exc:
            line = f"pid {p.pid} ({how}): {exc!r}"
        s.leaks.append(line)
    if s.leaks and session.exitstatus == 0:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter: Any) -> None:
    s = _SESSION
    if s is None or not s.leaks:
        return
    terminalreporter.section("processes left running", red=True)
    for line in s.leaks:
        terminalreporter.write_line(line)
    terminalreporter.write_line(
        f"{len(s.leaks)} process(es) started by this session outlived it; they were "
        "killed and the run fails"
    )


def pytest_unconfigure(config: pytest.Config) -> None:
    global _SESSION
    s = _SESSION
    if s is None or hasattr(config, "workerinput"):
        return
    _SESSION = None
    os.close(s.beacon_fd)
    if s.previous_env is None:
        os.environ.pop(ENV, None)
    else:
        os.environ[ENV] = s.previous_env
