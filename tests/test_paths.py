"""Pure naming functions and options: no disk needed."""

# Private imports: unit tests of the pure, private naming functions.
from __future__ import annotations

import re
from pathlib import Path

import pytest

import asyncsave
from asyncsave._paths import (
    LAYOUTS,
    aside_dir_name,
    data_file_name,
    is_temp_name,
    retired_dir_name,
    temp_dir_name,
    temp_file_name,
)

# Resolvers of the trainers asyncsave serves, as they match checkpoint directories.
RESOLVER_PATTERNS = [r"step_(\d+)", r"iter_(\d+)", r"global_step_(\d+)", r"checkpoint-(\d+)"]


def test_final_names_of_the_default_layout() -> None:
    layout = LAYOUTS["asyncsave"]
    assert layout.dir_name(40) == "step_40"
    assert layout.parse_dir_name("step_40") == 40
    assert layout.parse_dir_name("step_0") == 0
    for name in (
        "step_",
        "step_-1",
        "step_04",
        "step_4x",
        "xstep_4",
        ".asyncsave-tmp-4-abc",
        "step_1" + "0" * 30,
    ):
        assert layout.parse_dir_name(name) is None, name
    assert layout.tracker_name == "latest_checkpointed_iteration.txt"


@pytest.mark.parametrize("step", [0, 7, 40, 2**40])
def test_temp_names_match_no_resolver_pattern(step: int) -> None:
    for name in (temp_dir_name(step), temp_file_name("latest_checkpointed_iteration.txt")):
        assert is_temp_name(name)
        for pattern in RESOLVER_PATTERNS:
            assert re.search(pattern, name) is None, (pattern, name)
        assert name.startswith(".")
        assert LAYOUTS["asyncsave"].parse_dir_name(name) is None
    assert temp_dir_name(step) != temp_dir_name(step)


def test_data_file_names_are_plain_and_ordered() -> None:
    assert data_file_name(0, 0) == "data-r00000-000.safetensors"
    assert data_file_name(3, 12) < data_file_name(3, 13) < data_file_name(4, 0)
    assert not is_temp_name(data_file_name(0, 0))


@pytest.mark.parametrize(
    "field",
    [
        {"layout": "nope"},
        {"budget_bytes": 0},
        {"budget_bytes": True},
        {"writer_threads": 0},
        {"save_timeout_s": float("inf")},
        {"close_timeout_s": -1},
        {"poll_interval_s": "1"},
    ],
)
def test_bad_options_are_refused_naming_the_field(field: dict[str, object]) -> None:
    with pytest.raises(ValueError, match=next(iter(field))):
        asyncsave.CheckpointOptions(**field)  # type: ignore[arg-type]


def test_checkpointer_keyword_overrides_replace_fields() -> None:
    base = asyncsave.CheckpointOptions(writer_threads=3)
    ckpt = asyncsave.Checkpointer("/tmp/never-opened", base, save_timeout_s=5.0)
    assert ckpt.options.writer_threads == 3 and ckpt.options.save_timeout_s == 5.0


def test_temp_and_retired_names_match_no_preset() -> None:
    for name in (temp_dir_name(5), retired_dir_name(5), aside_dir_name("damaged", 5)):
        for layout in LAYOUTS.values():
            assert layout.parse_dir_name(name) is None
        assert not re.fullmatch(r"(global_)?step_\d+|iter_\d+", name)
        assert not Path(name).match("step_*") and not Path(name).match("global_step_*")


def test_megatron_names_pad_to_seven_digits_and_parse_back() -> None:
    mega = LAYOUTS["megatron"]
    assert mega.dir_name(40) == "iter_0000040"
    assert mega.dir_name(123456789) == "iter_123456789"
    assert mega.parse_dir_name("iter_0000040") == 40
    assert mega.parse_dir_name("iter_123456789") == 123456789
    for bad in ("iter_40", "iter_01234567", "iter_-000001", "iter_000004a"):
        assert mega.parse_dir_name(bad) is None
