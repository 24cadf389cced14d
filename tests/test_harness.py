"""The benchmark harness's own logic on a tiny state: every figure is filled in,
targets are computed from the run's own limits, and the README table is rendered
from the JSON (and re-rendered in place)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import anyio
import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
import harness


@pytest.mark.slow
def test_bench_workload_measures_every_figure(tmp_path: Path) -> None:
    state = {"a": torch.randn(1 << 16), "b": {"c": torch.arange(100)}}
    peers = ["asyncsave eager", "asyncsave lazy", "torch.save", "safetensors"]

    async def main() -> dict[str, Any]:
        hb = harness.Heartbeat()
        async with anyio.create_task_group() as tg:
            tg.start_soon(hb.run)
            row = await harness.bench_workload(
                "tiny", state, tmp_path, 2, peers, hb=hb, writer_threads=2, loads=True
            )
            tg.cancel_scope.cancel()
        return row

    row = anyio.run(main)
    assert row["nbytes"] == (1 << 16) * 4 + 100 * 8 and row["num_tensors"] == 2
    assert row["raw_write_fsync_s"] > 0 and row["raw_read_s"] > 0
    for peer in peers:
        f = row["peers"][peer]
        assert f["samples"] == 2, peer
        assert 0 < f["blocked_s"] <= f["durable_s"], peer
        assert f["load_s"] > 0 and f["gbps"] > 0, peer
    assert row["peers"]["asyncsave eager"]["hb_ticks"] >= 0
    assert "first_blocked_s" in row["peers"]["asyncsave eager"]
    assert list(tmp_path.iterdir()) == [] or all(
        not p.name.startswith("asyncsave") for p in tmp_path.iterdir()
    )


def synthetic_result() -> dict[str, Any]:
    def peer(blocked: float, durable: float, **extra: float) -> dict[str, float]:
        return {
            "blocked_s": blocked,
            "durable_s": durable,
            "gbps": 1.5 / durable,
            "peak_rss_extra_bytes": 0,
            "load_s": 1.0,
            **extra,
        }

    return {
        "mode": "quick",
        "machine": {"cpus": 2, "device": "cpu", "torch": "x"},
        "repeats": 1,
        "memcpy_gbps": 10.0,
        "cold_read_method": "fadvise",
        "wall_s": 100.0,
        "workloads": [
            {
                "workload": "gpt2-small + AdamW",
                "nbytes": 1_500_000_000,
                "num_tensors": 600,
                "raw_write_fsync_s": 1.0,
                "raw_read_s": 1.0,
                "peers": {
                    "asyncsave eager": peer(0.15, 1.1, hb_max_ms=1.0, hb_p99_ms=0.5),
                    "asyncsave lazy": peer(0.01, 1.1),
                    "torch.save": peer(2.0, 2.0),
                    "dcp.async_save + DefaultStager": peer(0.05, 3.0, staged_s=0.3),
                },
            }
        ],
        "s14_heartbeat_2gib": {"hb_max_ms": 12.0, "hb_p99_ms": 1.0},
        "s9_rss": {"saves": 200, "ratio": 1.01, "arena_allocations": 1},
    }


def test_targets_are_ratios_from_the_run_and_misses_are_reported() -> None:
    result = synthetic_result()
    rows = {t["figure"]: t for t in harness.targets(result)}
    eager = rows["eager save() blocking, 1.5 GB"]
    assert eager["measured"] == pytest.approx(0.15 / 0.15) and eager["met"]
    assert rows["time to durable, 1.5 GB"]["measured"] == pytest.approx(1.1)
    assert rows["time to durable, 1.5 GB"]["met"]
    assert not rows["largest heartbeat gap, 2 GiB save"]["met"]  # 12 ms > 10 ms
    assert rows["lazy save() blocking"]["measured"] == pytest.approx(0.01 / 0.15)
    assert rows["eager blocking vs DefaultStager staged time"]["measured"] == pytest.approx(0.5)


def test_readme_table_is_rendered_from_the_json_and_rerendered_in_place(tmp_path: Path) -> None:
    result = synthetic_result()
    result["targets"] = harness.targets(result)
    js = tmp_path / "harness.json"
    js.write_text(json.dumps(result))
    readme = tmp_path / "README.md"
    readme.write_text(f"intro\n\n{harness.BEGIN}\nold table\n{harness.END}\n\nafter\n")
    harness.render_readme(js, readme)
    text = readme.read_text()
    assert "old table" not in text and text.startswith("intro") and text.endswith("after\n")
    assert "| asyncsave eager | 150 ms |" in text
    assert "| largest heartbeat gap, 2 GiB save | <= 10 ms | 12 | no |" in text
    harness.render_readme(js, readme)
    assert readme.read_text() == text
    assert "asyncsave eager" in harness.markdown(result)
