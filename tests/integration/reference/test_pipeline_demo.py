"""`adstore demo`'s engine: cold then warm in fresh processes against a real store."""

from __future__ import annotations

import json

import pytest
from adstore.integration.reference.demo import format_demo, run_demo
from adstore.store import Store
from adstore.store.errors import ConfigError


def test_run_demo_cold_miss_then_warm_hit(tmp_path):
    root = tmp_path / "store"
    result = run_demo(arch="llama", layers=1, hidden=64, root=root)
    json.dumps(result)  # JSON-safe
    assert result["cold_events"] == ["miss", "save"]
    assert result["warm_events"] == ["hit"] and result["warm_hit"]
    assert result["outputs_match"] is True
    assert result["bytes_stored"] > 0 and result["dedup_ratio"] >= 1.0
    assert result["cold_s"] > 0 and result["warm_s"] > 0 and result["speedup"] == pytest.approx(
        result["cold_s"] / result["warm_s"], rel=0.01)
    assert result["replaced_previous_entry"] is False
    # The restart: fresh processes from start to first output, above the bare-torch floor.
    floor = result["restart_floor_s"]
    assert 0 < floor < result["restart_warm_s"] and floor < result["restart_cold_s"]
    assert result["restart_speedup"] == pytest.approx(result["restart_cold_s"] / result["restart_warm_s"], rel=0.01)
    store = Store.open(root)
    assert store.lookup(result["key"], record=False).hit
    table = format_demo(result)
    for label in ("restart, cold", "restart, warm", "restart floor", "in-process call", "bytes stored",
                  "dedup", "outputs match"):
        assert label in table


@pytest.mark.slow
def test_run_demo_again_replaces_its_entry_and_runs_two_ranks(tmp_path):
    root = tmp_path / "store"
    first = run_demo(arch="llama", layers=1, hidden=128, world_size=2, root=root)
    again = run_demo(arch="llama", layers=1, hidden=128, world_size=2, root=root)
    for r in (first, again):
        assert r["cold_events"] == ["miss", "save"] and r["warm_hit"] and r["outputs_match"]
    assert again["replaced_previous_entry"] is True and again["key"] == first["key"]


def test_run_demo_rejects_bad_options(tmp_path):
    with pytest.raises(ConfigError):
        run_demo(arch="nope", root=tmp_path)
    with pytest.raises(ConfigError):
        run_demo(world_size=0, root=tmp_path)
    with pytest.raises(ConfigError, match="KV heads"):
        run_demo(layers=1, hidden=64, world_size=4, root=tmp_path)
