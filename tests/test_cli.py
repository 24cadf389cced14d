"""The asyncsave command: ls, verify, inspect."""

from __future__ import annotations

import importlib.metadata
import io
import os
import subprocess
import sys
from pathlib import Path

import anyio
import pytest
import torch

import asyncsave
from asyncsave.testing import cli as main


def make_root(root: Path) -> None:
    async def go() -> None:
        async with asyncsave.Checkpointer(root) as ckpt:
            model = torch.nn.Linear(4, 2)
            for step in (1, 2):
                await (await ckpt.save(step, {"model": model, "trainer": {"step": step}}))

    anyio.run(go)


def run(*argv: str) -> tuple[int, str]:
    out = io.StringIO()
    rc = main(list(argv), out=out)
    return rc, out.getvalue()


def test_ls_lists_steps_the_tracked_one_and_stray_temp_dirs(tmp_path: Path) -> None:
    make_root(tmp_path)
    (tmp_path / ".asyncsave-tmp-3-0123456789ab").mkdir()
    rc, text = run("ls", str(tmp_path))
    assert rc == 0
    assert "tracker -> step 2" in text
    assert " * step_2" in text and "   step_1" in text
    assert ".asyncsave-tmp-3-0123456789ab" in text and "temporary" in text


def test_verify_passes_then_fails_on_a_flipped_byte(tmp_path: Path) -> None:
    make_root(tmp_path)
    rc, text = run("verify", str(tmp_path / "step_2"))
    assert rc == 0 and text.startswith("ok")
    rc, text = run("verify", str(tmp_path))
    assert rc == 0 and text.count("ok ") == 2
    data = sorted((tmp_path / "step_2").glob("*.safetensors"))[0]
    raw = bytearray(data.read_bytes())
    raw[-1] ^= 0xFF
    data.write_bytes(bytes(raw))
    rc, text = run("verify", str(tmp_path / "step_2"))
    assert rc == 1 and "FAIL" in text and "checksum" in text


def test_inspect_prints_the_tree_with_dtype_shape_and_bytes(tmp_path: Path) -> None:
    make_root(tmp_path)
    rc, text = run("inspect", str(tmp_path / "step_1"))
    assert rc == 0
    assert "'weight': float32 [2, 4] 32 B" in text
    assert "state_dict of torch.nn.modules.linear.Linear" in text
    assert "'step': int 1" in text


def test_inspect_of_a_non_checkpoint_fails_cleanly(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rc, _ = run("inspect", str(tmp_path))
    assert rc == 1
    assert "no manifest.json" in capsys.readouterr().err


@pytest.mark.slow
def test_the_installed_command_runs(tmp_path: Path) -> None:
    make_root(tmp_path)
    proc = subprocess.run(
        [sys.executable, "-m", "asyncsave", "ls", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    assert "step_2" in proc.stdout


# -- through the installed console script and `python -m asyncsave` -------------------

ENTRY_POINTS = {
    "console-script": [os.path.join(os.path.dirname(sys.executable), "asyncsave")],
    "python-m": [sys.executable, "-m", "asyncsave"],
}


@pytest.fixture(params=sorted(ENTRY_POINTS))
def command(request: pytest.FixtureRequest) -> list[str]:
    argv = ENTRY_POINTS[request.param]
    assert os.path.exists(argv[0]), f"{argv[0]} missing: pip install -e . puts it there"
    return argv


def cli(command: list[str], *argv: str | Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*command, *map(str, argv)], capture_output=True, text=True, timeout=120)


def test_version_prints_the_installed_distributions_version(command: list[str]) -> None:
    proc = cli(command, "--version")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == f"asyncsave {importlib.metadata.version('asyncsave')}"
    assert importlib.metadata.version("asyncsave") == asyncsave.__version__


@pytest.mark.slow
@pytest.mark.parametrize("target", ["step_2", "step_2/manifest.json"])
def test_ls_of_one_checkpoint_names_inspect_verify_and_the_root(
    tmp_path: Path, command: list[str], target: str
) -> None:
    make_root(tmp_path)
    proc = cli(command, "ls", tmp_path / target)
    assert proc.returncode == 2, proc.stdout
    assert "is one checkpoint, not a root" in proc.stderr
    assert f"asyncsave inspect {tmp_path / 'step_2'}" in proc.stderr
    assert f"asyncsave verify {tmp_path / 'step_2'}" in proc.stderr
    assert f"asyncsave ls {tmp_path}`" in proc.stderr


@pytest.mark.slow
def test_inspect_of_a_root_names_ls_and_its_newest_checkpoint(
    tmp_path: Path, command: list[str]
) -> None:
    make_root(tmp_path)
    proc = cli(command, "inspect", tmp_path)
    assert proc.returncode == 2, proc.stdout
    assert f"{tmp_path} is a root of checkpoints (steps 1, 2)" in proc.stderr
    assert f"asyncsave ls {tmp_path}`" in proc.stderr
    assert f"asyncsave inspect {tmp_path / 'step_2'}`" in proc.stderr


@pytest.mark.parametrize("layout", ["verl", "megatron", "skyrl"])
def test_a_root_of_another_layout_gets_the_layout_named(tmp_path: Path, layout: str) -> None:
    async def go() -> None:
        async with asyncsave.Checkpointer(tmp_path, layout=layout) as ckpt:
            await (await ckpt.save(3, {"w": torch.ones(2)}))

    anyio.run(go)
    final = asyncsave.latest(tmp_path, layout=layout).path  # type: ignore[union-attr]
    rc, text = run("ls", str(tmp_path))
    assert f"pass --layout {layout}" in text and "--layout asyncsave" not in text
    rc, _ = run("ls", str(tmp_path), "--layout", layout)
    assert rc == 0
    err = io.StringIO()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(sys, "stderr", err)
        assert run("verify", str(tmp_path))[0] == 1
        assert run("inspect", str(tmp_path))[0] == 2
    assert f"pass --layout {layout}" in err.getvalue()
    assert f"asyncsave ls {tmp_path} --layout {layout}`" in err.getvalue()
    assert f"asyncsave inspect {final}`" in err.getvalue()


@pytest.mark.parametrize("layout", ["verl", "megatron"])
def test_ls_of_one_checkpoint_of_another_layout_names_its_layout(
    tmp_path: Path, layout: str
) -> None:
    async def go() -> None:
        async with asyncsave.Checkpointer(tmp_path, layout=layout) as ckpt:
            await (await ckpt.save(40, {"w": torch.ones(2)}))

    anyio.run(go)
    final = asyncsave.latest(tmp_path, layout=layout).path  # type: ignore[union-attr]
    err = io.StringIO()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(sys, "stderr", err)
        assert run("ls", str(final))[0] == 2
    assert f"asyncsave ls {tmp_path} --layout {layout}`" in err.getvalue()


# What each subcommand does, in the words of the top-level description.
VERBS = {
    "ls": "list",
    "verify": "verify",
    "inspect": "inspect",
    "adopt": "adopt",
    "export": "export",
    "prune": "prune",
}


def test_the_top_level_help_names_every_subcommand(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["--help"])
    assert exited.value.code == 0
    text = capsys.readouterr().out
    usage, description = text.split("\n\n")[:2]
    listed = usage[usage.index("{") + 1 : usage.index("}")].split(",")
    assert sorted(listed) == sorted(VERBS)  # a new subcommand gets its verb here
    assert [v for v in VERBS.values() if v not in description.lower()] == []


@pytest.mark.parametrize("command", sorted(VERBS))
def test_every_subcommand_is_one_line_and_status_1_on_a_missing_path(
    tmp_path: Path, command: str, capsys: pytest.CaptureFixture[str]
) -> None:
    rule = ["--keep-last", "1"] if command == "prune" else []
    if command == "export":
        rule = [str(tmp_path / "out")]  # its second positional: where to write
    rc, text = run(command, str(tmp_path / "nothing"), *rule)
    err = capsys.readouterr().err
    assert rc == 1 and text == ""
    assert err.count("\n") == 1 and "nothing" in err


def test_a_directory_dcps_own_writer_wrote_is_named_with_what_reads_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """ls, verify and inspect of a FileSystemWriter directory (no manifest)
    say what it is and what reads it, not only that no checkpoint is here."""
    import warnings

    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():  # DCP's "no process group: one process"
        warnings.simplefilter("ignore", UserWarning)
        dcp.save({"w": torch.ones(3)}, storage_writer=dcp.FileSystemWriter(tmp_path))
    rc, text = run("ls", str(tmp_path))
    assert rc == 1 and "written by torch.distributed.checkpoint's FileSystemWriter" in text
    assert "asyncsave.dcp.StorageReader(path)" in text
    for command in ("verify", "inspect"):
        assert run(command, str(tmp_path))[0] == 1
        err = capsys.readouterr().err
        assert "FileSystemWriter (.metadata, no manifest.json)" in err, command
