"""The asyncsave command, issue 13 item 4: ``--help`` without torch, progress bars on
``verify`` and ``inspect`` (tqdm), ``prune`` with the engine's retention rules.

Most of these run the installed console script (``.venv/bin/asyncsave``) in a
subprocess, as a user does; the ``memory://`` root and the hypothesis sweep call
``main`` in-process (an in-memory file system lives in one process only).
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import anyio
import fsspec
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tqdm import tqdm

import asyncsave
from asyncsave.testing import cli as main

SCRIPT = os.path.join(os.path.dirname(sys.executable), "asyncsave")


def cli(*argv: str | Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    assert os.path.exists(SCRIPT), f"{SCRIPT} missing: pip install -e . puts it there"
    return subprocess.run(
        [SCRIPT, *map(str, argv)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **(env or {})},
    )


def make_root(
    root: Path | str, steps: list[int], *, numel: int = 64, info: dict[int, float] | None = None
) -> None:
    async def go() -> None:
        async with asyncsave.Checkpointer(root) as ckpt:
            for step in steps:
                state = {"w": torch.full((numel,), float(step)), "b": torch.arange(step + 1)}
                extra = {"loss": info[step]} if info else None
                await (await ckpt.save(step, state, training_info=extra))

    anyio.run(go)


def final_steps(root: Path) -> list[int]:
    return sorted(int(p.name.removeprefix("step_")) for p in root.glob("step_*"))


# -- --help, --version: no torch ---------------------------------------------------


@pytest.mark.parametrize(
    "argv", [["--help"], ["--version"], ["prune", "--help"], ["verify", "--help"]]
)
@pytest.mark.parametrize("how", ["console-script", "python-m"])
def test_help_and_version_do_not_import_torch(argv: list[str], how: str) -> None:
    """``-X importtime`` (PYTHONPROFILEIMPORTTIME) lists every module the command
    imports: torch is not among them."""
    command = [SCRIPT] if how == "console-script" else [sys.executable, "-m", "asyncsave"]
    proc = subprocess.run(
        [*command, *argv],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPROFILEIMPORTTIME": "1"},
    )
    assert proc.returncode == 0, proc.stderr
    imported = re.findall(r"^import time:.*\|\s+(\S+)$", proc.stderr, re.M)
    assert "asyncsave._cli" in imported  # the profile is there
    assert not [m for m in imported if m == "torch" or m.startswith("torch.")]
    assert "asyncsave" in proc.stdout


@pytest.mark.slow
def test_import_asyncsave_loads_torch_only_on_first_use() -> None:
    code = (
        "import sys, asyncsave; assert 'torch' not in sys.modules; "
        "asyncsave.Checkpointer; assert 'torch' in sys.modules; "
        "from asyncsave import *; print(len(asyncsave.__all__))"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == str(len(asyncsave.__all__))


# -- progress bars -------------------------------------------------------------------


def bar_total(stderr: str) -> str:
    """The last frame of a tqdm bar: ``done/total``."""
    frames = re.findall(r"(\S+)/(\S+) \[", stderr)
    assert frames, stderr
    return "/".join(frames[-1])


@pytest.mark.slow
def test_verify_of_a_root_shows_the_bytes_hashed_of_the_total(tmp_path: Path) -> None:
    make_root(tmp_path, [1, 2, 3], numel=4096)
    total = sum(asyncsave.verify(tmp_path / f"step_{s}").nbytes for s in (1, 2, 3))
    size = tqdm.format_sizeof(total, divisor=1024)
    proc = cli("verify", tmp_path, "--progress")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count("ok   ") == 3
    assert "verify 3 checkpoints" in proc.stderr and "100%" in proc.stderr
    assert bar_total(proc.stderr) == f"{size}/{size}"
    # Off a terminal the bar is hidden by default, and --no-progress hides it.
    for extra in ([], ["--no-progress"]):
        quiet = cli("verify", tmp_path / "step_2", *extra)
        assert quiet.returncode == 0 and quiet.stderr == "", quiet.stderr


@pytest.mark.slow
def test_verify_with_a_bar_still_reports_each_failure(tmp_path: Path) -> None:
    make_root(tmp_path, [1, 2], numel=4096)
    data = sorted((tmp_path / "step_1").glob("*.safetensors"))[0]
    raw = bytearray(data.read_bytes())
    raw[-1] ^= 0xFF
    data.write_bytes(bytes(raw))
    proc = cli("verify", tmp_path, "--progress")
    assert proc.returncode == 1
    assert re.findall(r"^(FAIL|ok  ) \S+/(step_\d)", proc.stdout, re.M) == [
        ("FAIL", "step_1"),
        ("ok  ", "step_2"),
    ]
    assert "checksum" in proc.stdout and "100%" in proc.stderr  # every byte was hashed


@pytest.mark.slow
def test_inspect_shows_the_data_files_checked(tmp_path: Path) -> None:
    make_root(tmp_path, [1])
    m = asyncsave.verify(tmp_path / "step_1")
    files = len(list((tmp_path / "step_1").glob("*.safetensors")))
    assert m.num_tensors == 2 and files >= 1
    proc = cli("inspect", tmp_path / "step_1", "--progress")
    assert proc.returncode == 0, proc.stderr
    assert "check files" in proc.stderr and f"{files}/{files} [" in proc.stderr
    assert "'w': float32 [64] 256 B" in proc.stdout


@pytest.mark.parametrize("where", ["local", "memory"])
def test_verify_progress_adds_up_to_the_checkpoints_bytes(tmp_path: Path, where: str) -> None:
    """The library hook the bar uses: chunks of at most 8 MiB, summing to nbytes,
    through the memory-mapped reader and the streamed (object store) one."""
    root: Path | str = tmp_path if where == "local" else f"memory:///cli-{uuid.uuid4().hex}"
    try:
        make_root(root, [1], numel=(9 << 20) // 4)  # one tensor over the 8 MiB chunk
        seen: list[int] = []
        info = asyncsave.verify(f"{root}/step_1", progress=seen.append)
        assert sum(seen) == info.nbytes and len(seen) >= 3
        assert max(seen) <= 8 << 20
    finally:
        if where == "memory":
            with contextlib.suppress(FileNotFoundError):
                fsspec.filesystem("memory").rm(str(root).removeprefix("memory://"), recursive=True)


# -- prune ---------------------------------------------------------------------------


@pytest.mark.slow
def test_prune_dry_run_changes_nothing_then_prune_deletes_the_same(tmp_path: Path) -> None:
    losses = {1: 0.5, 2: 0.9, 3: 0.1, 4: 0.8, 5: 0.7, 6: 0.6}
    make_root(tmp_path, list(losses), info=losses)
    rule = ["--keep-last", "2", "--keep-best", "loss", "1", "--mode", "min"]
    dry = cli("prune", tmp_path, *rule, "--dry-run")
    assert dry.returncode == 0, dry.stderr
    assert re.findall(r"would delete (step_\d+)", dry.stdout) == ["step_1", "step_2", "step_4"]
    assert final_steps(tmp_path) == [1, 2, 3, 4, 5, 6]
    real = cli("prune", tmp_path, *rule)
    assert real.returncode == 0, real.stderr
    assert re.findall(r"deleted (step_\d+)", real.stdout) == ["step_1", "step_2", "step_4"]
    assert final_steps(tmp_path) == [3, 5, 6]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".asyncsave-tmp-")]
    for step in (3, 5, 6):
        asyncsave.verify(tmp_path / f"step_{step}")
    assert asyncsave.latest(tmp_path).step == 6  # type: ignore[union-attr]


@pytest.mark.slow
def test_prune_never_deletes_the_tracked_step_or_one_in_flight(tmp_path: Path) -> None:
    make_root(tmp_path, [1, 2, 3, 4, 5])
    # The tracker behind the newest commit (a crash between commit and tracker
    # update), and a save of step 2 in flight (a standalone DCP writer's temp dir).
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("3")
    in_flight = tmp_path / ".asyncsave-tmp-2-0123456789ab"
    in_flight.mkdir()
    (in_flight / "data-r00000-000.safetensors").write_bytes(b"partial")
    proc = cli("prune", tmp_path, "--keep-last", "1")
    assert proc.returncode == 0, proc.stderr
    assert final_steps(tmp_path) == [2, 3, 5]
    assert (in_flight / "data-r00000-000.safetensors").read_bytes() == b"partial"


@pytest.mark.slow
def test_prune_respects_the_root_lock_but_dry_run_does_not_need_it(tmp_path: Path) -> None:
    make_root(tmp_path, [1, 2, 3])
    with asyncsave.SyncCheckpointer(tmp_path):
        proc = cli("prune", tmp_path, "--keep-last", "1", "--lock-timeout", "0.2")
        assert proc.returncode == 1
        assert "in use" in proc.stderr or "stayed locked" in proc.stderr
        assert "nothing deleted" in proc.stderr
        assert final_steps(tmp_path) == [1, 2, 3]
        dry = cli("prune", tmp_path, "--keep-last", "1", "--dry-run")
        assert dry.returncode == 0 and "2 would be deleted" in dry.stdout
    assert final_steps(tmp_path) == [1, 2, 3]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["prune", "ROOT"], "give a rule"),
        (["prune", "ROOT", "--keep-last", "0"], "positive integer"),
        (["prune", "ROOT", "--keep-best", "loss", "x"], "positive integer"),
        (["prune", "ROOT/step_1", "--keep-last", "1"], "is one checkpoint"),
        (["prune", "ROOT", "--keep-best", "lsos", "1"], "records 'lsos'"),
        (["prune", "ROOT", "--keep-best", "lsos", "1", "--dry-run"], "records 'lsos'"),
    ],
)
def test_prune_bad_usage_exits_2_and_deletes_nothing(
    tmp_path: Path, argv: list[str], message: str
) -> None:
    make_root(tmp_path, [1, 2], info={1: 0.5, 2: 0.4})
    proc = cli(*(a.replace("ROOT", str(tmp_path)) for a in argv))
    assert proc.returncode == 2, proc.stdout
    assert message in proc.stderr
    assert final_steps(tmp_path) == [1, 2]


@pytest.fixture
def mem_root() -> Iterator[str]:
    name = f"/asyncsave-cli-{uuid.uuid4().hex[:12]}"
    yield f"memory://{name}"
    with contextlib.suppress(FileNotFoundError):
        fsspec.filesystem("memory").rm(name, recursive=True)


def test_prune_an_object_store_root(mem_root: str) -> None:
    """No rename there: retention deletes the commit marker first (``_marker``)."""
    make_root(mem_root, [1, 2, 3, 4])
    out = io.StringIO()
    assert main(["prune", mem_root, "--keep-every", "2"], out=out) == 0
    assert re.findall(r"deleted (step_\d+)", out.getvalue()) == ["step_1", "step_3"]
    mem = fsspec.filesystem("memory")
    left = sorted(
        p.rsplit("/", 1)[-1] for p in mem.ls(mem_root.removeprefix("memory://"), detail=False)
    )
    assert [n for n in left if n.startswith("step_")] == ["step_2", "step_4"]


@settings(
    max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    steps=st.lists(st.integers(1, 9), min_size=1, max_size=6, unique=True).map(sorted),
    last=st.none() | st.integers(1, 3),
    every=st.none() | st.integers(1, 4),
)
def test_prune_deletes_exactly_what_no_rule_keeps(
    tmp_path_factory: pytest.TempPathFactory,
    steps: list[int],
    last: int | None,
    every: int | None,
) -> None:
    if last is None and every is None:
        last = 1
    root = tmp_path_factory.mktemp("prune")
    make_root(root, steps)
    argv = ["prune", str(root)]
    keep = {steps[-1]}  # the newest (and tracked) step stays whatever the rule
    if last is not None:
        argv += ["--keep-last", str(last)]
        keep |= set(steps[-last:])
    if every is not None:
        argv += ["--keep-every", str(every)]
        keep |= {s for s in steps if s % every == 0}
    dry = io.StringIO()
    assert main([*argv, "--dry-run"], out=dry) == 0
    doomed = [s for s in steps if s not in keep]
    assert re.findall(r"would delete step_(\d+)", dry.getvalue()) == [str(s) for s in doomed]
    assert main(argv, out=io.StringIO()) == 0
    assert final_steps(root) == sorted(keep)
