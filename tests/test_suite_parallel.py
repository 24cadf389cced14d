"""How the suite runs (``tests/conftest.py``), checked on generated test files in a
pytest subprocess that loads the suite's conftest as a plugin: under pytest-xdist a
module fixture is set up once and its tests run on one worker, the reliability
counts of every worker reach the controller's summary, modules with a slow test
are handed out first, a leak on a worker fails the run; and conftest itself
imports neither torch nor hypothesis, while the fuzz profile holds for settings a
test module makes as it is imported."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

HERE = Path(__file__).parent


def _session(
    tmp_path: Path, files: dict[str, str], *args: str, ini: str = "[pytest]\n"
) -> subprocess.CompletedProcess[str]:
    """Run pytest on ``files`` (name -> source) in ``tmp_path`` with the suite's
    conftest as a plugin."""
    (tmp_path / "pytest.ini").write_text(ini)
    for name, source in files.items():
        (tmp_path / name).write_text(textwrap.dedent(source))
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]),
    }
    env.pop("ASYNCSAVE_FUZZ_PROFILE", None)
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "conftest", "-p", "no:cacheprovider", *args],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )


def _passed(proc: subprocess.CompletedProcess[str]) -> str:
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return proc.stdout


SHARED = """
    import os
    import pytest

    LOG = os.path.join(os.path.dirname(__file__), "setups.log")

    @pytest.fixture(scope="module")
    def shared():
        with open(LOG, "a") as f:
            f.write(os.environ["PYTEST_XDIST_WORKER"] + "\\n")
        return os.environ["PYTEST_XDIST_WORKER"]

    @pytest.mark.parametrize("i", range(8))
    def test_uses_it(shared, i):
        assert os.environ["PYTEST_XDIST_WORKER"] == shared
"""

OTHERS = """
    import time
    import pytest

    @pytest.mark.parametrize("i", range(8))
    def test_other(i):
        time.sleep(0.05)
"""


def test_a_module_fixture_is_set_up_once_and_its_tests_share_a_worker(tmp_path: Path) -> None:
    files = {"test_a_others.py": OTHERS, "test_b_shared.py": SHARED}
    out = _passed(_session(tmp_path, files, "-n", "2", "--dist", "loadgroup"))
    assert "16 passed" in out, out
    assert len((tmp_path / "setups.log").read_text().split()) == 1


COUNTING = """
    import pytest
    from reliability import record

    @pytest.mark.parametrize("i", range(6))
    def test_counts(i):
        record("things checked", 10 + i)
"""


@pytest.mark.parametrize("workers", ["0", "2"])
def test_every_workers_reliability_counts_reach_the_summary(tmp_path: Path, workers: str) -> None:
    out = _passed(_session(tmp_path, {"test_counting.py": COUNTING}, "-n", workers))
    assert re.search(r"^things checked +75$", out, re.M), out


def test_modules_with_a_slow_test_come_first_each_in_one_piece(tmp_path: Path) -> None:
    files = {
        "test_a.py": "def test_a1(): pass\ndef test_a2(): pass\n",
        "test_b.py": (
            "import pytest\ndef test_b1(): pass\n"
            "@pytest.mark.slow\ndef test_b2(): pass\ndef test_b3(): pass\n"
        ),
        "test_c.py": "def test_c1(): pass\n",
    }
    ini = "[pytest]\nmarkers =\n    slow: slow\n"
    out = _passed(_session(tmp_path, files, "--co", "-q", ini=ini))
    names = [line.partition("::")[2] for line in out.splitlines() if "::" in line]
    assert names == ["test_b1", "test_b2", "test_b3", "test_a1", "test_a2", "test_c1"], out


LEAKS = """
    import os, time

    def test_forks_and_leaves():
        if os.fork() == 0:
            if os.fork() == 0:
                time.sleep(300)
                os._exit(0)
            os._exit(0)
"""


def test_a_process_left_by_a_test_on_a_worker_fails_the_run(tmp_path: Path) -> None:
    proc = _session(tmp_path, {"test_leaks.py": LEAKS}, "-n", "2")
    assert proc.returncode == 1, proc.stdout[-4000:]
    assert "processes left running" in proc.stdout
    assert "1 process(es) started by this session outlived it" in proc.stdout


def test_conftest_imports_neither_torch_nor_hypothesis(tmp_path: Path) -> None:
    plain = """
        import sys

        def test_no_torch():
            assert "torch" not in sys.modules and "hypothesis" not in sys.modules
    """
    _passed(_session(tmp_path, {"test_plain.py": plain}, "-n", "0"))


def test_the_fuzz_profile_holds_for_settings_made_as_a_module_is_imported(
    tmp_path: Path,
) -> None:
    fuzz = """
        from hypothesis import given, settings, strategies as st

        APPLIED_AT_IMPORT = settings()

        def test_the_suites_profile():
            assert settings.get_current_profile_name() == "ci"
            assert APPLIED_AT_IMPORT.max_examples == 200
            assert APPLIED_AT_IMPORT.deadline is None

        @settings(deadline=1000)
        @given(st.integers())
        def test_given(n):
            pass
    """
    out = _passed(_session(tmp_path, {"test_fuzz.py": fuzz}, "-n", "0"))
    assert "2 passed" in out, out


def test_the_fast_tier_does_not_import_a_module_whose_every_test_is_slow(tmp_path: Path) -> None:
    files = {
        "test_all_slow.py": (
            "import pytest\npytestmark = pytest.mark.slow\n"
            "raise RuntimeError('imported')\ndef test_x(): pass\n"
        ),
        "test_fast.py": "def test_y(): pass\n",
    }
    ini = "[pytest]\nmarkers =\n    slow: slow\n"
    out = _passed(_session(tmp_path, files, "-m", "not slow", "-n", "0", ini=ini))
    assert "1 passed" in out, out
    assert _session(tmp_path, files, "-n", "0", ini=ini).returncode != 0  # imported otherwise
