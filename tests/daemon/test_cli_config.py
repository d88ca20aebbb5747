"""``--config`` on ``gc`` and ``stats``: the daemon config's root, limits and grace period."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from daemon_support import populate, write_config

from adstore.daemon.cli import main
from adstore.store import Store

KIB = 1024


def run_json(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, dict]:
    code = main([*argv, "--json"])
    out, err = capsys.readouterr()
    assert "Traceback" not in err, err
    return code, json.loads(out) if out else {}


@pytest.fixture
def configured(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Path, Path, list[str]]:
    """A store named only by a config file (relative root); $ADSTORE_ROOT points elsewhere."""
    root = tmp_path / "etc" / "store"
    keys = populate(root, count=3, size=70 * KIB, prefix="g")
    cfg = write_config(tmp_path / "etc" / "adstore.toml", root="store", max_size="100K", grace_period="0s")
    monkeypatch.setenv("ADSTORE_ROOT", str(tmp_path / "other"))
    return root, cfg, keys


def test_gc_config_uses_the_configs_root_limits_and_grace_period(capsys, configured) -> None:
    root, cfg, keys = configured
    code, data = run_json(capsys, "gc", "--config", str(cfg), "--dry-run")
    assert code == 0 and len(data["eviction"]["victims"]) == 2  # 210K down to 100K, grace 0s
    assert not (root.parent.parent / "other").exists()
    code, data = run_json(capsys, "gc", "--config", str(cfg))
    assert code == 0 and data["bytes_freed"] == 2 * 70 * KIB
    with Store.open(root) as store:
        assert [e.key for e in store.entries()] == [keys[2]]


def test_a_root_flag_wins_over_the_configs_root(capsys, configured, tmp_path: Path) -> None:
    _, cfg, _ = configured
    elsewhere = tmp_path / "elsewhere"
    Store.open(elsewhere).close()
    code, data = run_json(capsys, "gc", "--config", str(cfg), "--root", str(elsewhere), "--dry-run")
    assert code == 0 and data["eviction"]["victims"] == []
    code, data = run_json(capsys, "stats", "--config", str(cfg), "--root", str(elsewhere))
    assert data["root"] == str(elsewhere) and data["entries"] == 0


def test_stats_config_uses_the_configs_root(capsys, configured) -> None:
    root, cfg, _ = configured
    code, data = run_json(capsys, "stats", "--config", str(cfg))
    assert code == 0 and data["root"] == str(root) and data["entries"] == 3
    assert data["budget"]["max_size"] == 100 * KIB and data["budget"]["source"] == str(cfg)


def test_an_invalid_config_is_a_usage_error(capsys, tmp_path: Path) -> None:
    bad = write_config(tmp_path / "bad.toml", max_size="lots")
    for command in ("gc", "stats"):
        assert main([command, "--config", str(bad), "--root", str(tmp_path / "s")]) == 2
        err = capsys.readouterr().err
        assert "'max_size'" in err and err.count("\n") == 1


def test_the_daemon_persists_its_budget_and_stats_shows_it(capsys, tmp_path: Path) -> None:
    root = tmp_path / "s"
    Store.open(root).close()
    code, data = run_json(capsys, "stats", "--root", str(root))
    assert data["budget"] is None
    assert main(["stats", "--root", str(root)]) == 0
    assert "none recorded" in capsys.readouterr().out
    assert (
        main(["daemon", "--root", str(root), "--once", "--max-size", "2G", "--min-free", "5%", "--grace-period", "90s"])
        == 0
    )
    with Store.open(root) as store:  # a writer without a daemon enforces the same hard limit
        budget = store.budget()
    assert budget is not None and budget.max_size == 2 * 1024**3 and budget.min_free.percent == 5.0
    assert budget.grace_period == 90.0
    code, data = run_json(capsys, "stats", "--root", str(root))
    assert data["budget"]["max_size"] == 2 * 1024**3 and data["budget"]["source"] == "index"
    assert main(["stats", "--root", str(root)]) == 0
    assert "max 2.0 GiB" in capsys.readouterr().out
