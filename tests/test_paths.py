"""Pure naming functions and options: no disk needed."""

from __future__ import annotations

import re

import pytest

import asyncsave
from asyncsave._paths import LAYOUTS, data_file_name, is_temp_name, temp_dir_name, temp_file_name

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
