"""bench/tiers.py's own logic: the failure-cost model and a tiny end-to-end run."""

from __future__ import annotations

import sys
from pathlib import Path

import anyio
import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
import tiers


def test_the_model_of_training_lost_per_failure() -> None:
    one = {"blocked_s": 1.0, "durable_s": 100.0}
    two = {"blocked_s": 1.0, "local_durable_s": 10.0, "persistent_durable_s": 130.0}
    m = tiers.model(one, two, interval_s=60.0, node_loss=0.25)
    # One tier: saves queue behind 100 s commits: interval 100, lost 100/2 + 100.
    assert m["one_tier_lost_s"] == pytest.approx(150.0)
    # Two tiers: copies take 120 s, so every 2nd save persists.
    assert m["persist_every_kth_save"] == 2
    assert m["two_tiers_lost_s_node_survives"] == pytest.approx(30.0 + 10.0)
    assert m["two_tiers_lost_s_node_lost"] == pytest.approx(60.0 + 130.0)
    assert m["two_tiers_lost_s_mean"] == pytest.approx(0.75 * 40.0 + 0.25 * 190.0)
    scaled = tiers.model(one, two, interval_s=60.0, node_loss=0.25, scale=2.0)
    assert scaled["one_tier_lost_s"] == pytest.approx(300.0)


def test_a_tiny_run_measures_both_rows(tmp_path: Path) -> None:
    state = {"a": torch.randn(1 << 14)}
    one = anyio.run(tiers._one_tier, state, tmp_path / "one", 1000.0, 2)
    two = anyio.run(tiers._two_tiers, state, tmp_path / "l", tmp_path / "two", 1000.0, 2)
    assert 0 < one["blocked_s"] <= one["durable_s"]
    assert 0 < two["blocked_s"] <= two["local_durable_s"] <= two["persistent_durable_s"]
