"""The session-level process check (tests/leakcheck.py), run on generated test
files in a pytest subprocess: a session that leaves a process behind fails, names
it, and kills it; a session that cleans up passes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import psutil
import pytest

pytestmark = pytest.mark.slow

HERE = Path(__file__).parent

SLEEPER = "import sys, time; time.sleep(300)  # leakcheck-sleeper"

# Each body runs inside a test of the inner session and writes the pid of the
# process it leaves behind to PIDFILE.
CASES = {
    # a grandchild that exec'd, reparented once its parent exited
    "orphan-exec": f"""
        starter = (
            "import subprocess, sys; "
            "p = subprocess.Popen([sys.executable, '-c', {SLEEPER!r}]); "
            "open(sys.argv[1], 'w').write(str(p.pid))"
        )
        subprocess.run([sys.executable, "-c", starter, PIDFILE], check=True)
    """,
    # a grandchild forked without exec (the session's environment as at exec time,
    # without the token), reparented once its parent exited
    "orphan-fork": """
        r, w = os.pipe()
        child = os.fork()
        if child == 0:
            grandchild = os.fork()
            if grandchild == 0:
                os.close(r)
                os.close(w)
                time.sleep(300)
                os._exit(0)
            os.write(w, str(grandchild).encode())
            os._exit(0)
        os.close(w)
        os.waitpid(child, 0)
        open(PIDFILE, "w").write(os.read(r, 64).decode())
        os.close(r)
    """,
    # a child still attached to the session, started with an empty environment
    "child-no-env": f"""
        KEEP.append(subprocess.Popen([sys.executable, "-c", {SLEEPER!r}], env={{}}))
        open(PIDFILE, "w").write(str(KEEP[-1].pid))
    """,
}

CLEAN = f"""
    p = subprocess.Popen([sys.executable, "-c", {SLEEPER!r}])
    p.kill()
    p.wait()
    child = os.fork()
    if child == 0:
        os._exit(0)
    os.waitpid(child, 0)
"""


def _run_session(tmp_path: Path, body: str) -> tuple[subprocess.CompletedProcess[str], Path]:
    pidfile = tmp_path / "leaked.pid"
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    (tmp_path / "test_generated.py").write_text(
        "import os, subprocess, sys, time\n"
        f"PIDFILE = {str(pidfile)!r}\n"
        "KEEP = []\n\n"
        "def test_body():\n" + textwrap.indent(textwrap.dedent(body), "    ")
    )
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]),
    }
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-p",
            "leakcheck",
            "-p",
            "no:cacheprovider",
            "-q",
            "test_generated.py",
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    return proc, pidfile


def _kill_if_alive(pidfile: Path) -> bool:
    """Kill the leaked process if it is still running; True if it was."""
    if not pidfile.exists():
        return False
    pid = int(pidfile.read_text())
    try:
        p = psutil.Process(pid)
        if p.status() == psutil.STATUS_ZOMBIE:
            return False
        os.kill(pid, signal.SIGKILL)
        return True
    except (psutil.NoSuchProcess, ProcessLookupError):
        return False


@pytest.mark.parametrize(
    ("case", "found_by"),
    [
        ("orphan-exec", "environment ASYNCSAVE_TEST_SESSIONS"),
        ("orphan-fork", "inherited the session's descriptor"),
        ("child-no-env", "descendant"),
    ],
)
def test_a_session_that_leaves_a_process_behind_fails_names_and_kills_it(
    tmp_path: Path, case: str, found_by: str
) -> None:
    proc, pidfile = _run_session(tmp_path, CASES[case])
    try:
        out = proc.stdout + proc.stderr
        assert "1 passed" in out, out  # the test itself passed: the check failed the run
        assert proc.returncode == 1, out
        pid = int(pidfile.read_text())
        assert "processes left running" in out
        (line,) = [ln for ln in out.splitlines() if ln.startswith(f"pid {pid} ")]
        assert found_by in line and "test_generated.py::test_body" in line
        assert not _kill_if_alive(pidfile), "the check reported the process but left it running"
    finally:
        _kill_if_alive(pidfile)


def test_a_session_whose_processes_all_ended_passes(tmp_path: Path) -> None:
    proc, _ = _run_session(tmp_path, CLEAN)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert "1 passed" in out and "processes left running" not in out
