"""DaemonConfig: TOML + flags into one validated, frozen value; errors name the field."""

from __future__ import annotations

import dataclasses
import tomllib
from pathlib import Path

import pytest

from adstore.daemon.config import SETTINGS, DaemonConfig
from adstore.store import DEFAULT_GRACE_PERIOD
from adstore.store.errors import ConfigError

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "systemd" / "adstore.toml"


def test_example_config_is_valid_and_documented() -> None:
    cfg = DaemonConfig.from_config(EXAMPLE)
    assert cfg.max_size == 20 * 1024**3
    assert cfg.min_free_percent == 10.0 and cfg.min_free_bytes is None
    assert (cfg.high_watermark, cfg.low_watermark) == (0.95, 0.85)
    assert cfg.grace_period == 3600.0 and cfg.max_age is None
    text = EXAMPLE.read_text()
    for key in DaemonConfig.KEYS:  # every setting appears in the example, at least commented
        assert key in text, key
    # and the commented-out ones are valid too
    commented = [
        line[2:]
        for line in text.splitlines()
        if line.startswith("# ") and line[2:].split(" = ")[0] in DaemonConfig.KEYS
    ]
    assert commented and DaemonConfig.parse_settings(tomllib.loads("\n".join(commented)))


def test_flags_override_file_and_reload_keeps_them(tmp_path: Path) -> None:
    path = tmp_path / "a.toml"
    path.write_text('max_size = "1G"\nbatch_size = 10\nlog_level = "debug"\n')
    cfg = DaemonConfig.from_config(path, max_size="512MiB", root=str(tmp_path / "r"))
    assert cfg.max_size == 512 * 1024**2 and cfg.batch_size == 10 and cfg.log_level == "debug"
    assert cfg.root == tmp_path / "r"
    path.write_text('max_size = "2G"\nbatch_size = 20\n')
    new = cfg.reload()
    assert new.max_size == 512 * 1024**2 and new.batch_size == 20 and new.log_level == "info"
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.max_size = 1  # type: ignore[misc]


def test_daemon_table_and_relative_root(tmp_path: Path) -> None:
    path = tmp_path / "a.toml"
    path.write_text('[daemon]\nroot = "store"\nmin_free = "1G"\n')
    cfg = DaemonConfig.from_config(path)
    assert cfg.root == tmp_path / "store" and cfg.min_free_bytes == 1024**3


@pytest.mark.parametrize(
    "settings, field",
    [
        ({"max_size": "ten gigs"}, "max_size"),
        ({"max_size": -1}, "max_size"),
        ({"min_free": "101%"}, "min_free"),
        ({"min_free": "abc%"}, "min_free"),
        ({"high_watermark": 1.5}, "high_watermark"),
        ({"low_watermark": "0%"}, "low_watermark"),
        ({"high_watermark": 0.5, "low_watermark": 0.6}, "low_watermark"),
        ({"grace_period": "soon"}, "grace_period"),
        ({"max_age": [1]}, "max_age"),
        ({"batch_size": 0}, "batch_size"),
        ({"batch_size": 2.5}, "batch_size"),
        ({"log_level": "loud"}, "log_level"),
        ({"fallback_interval": 0}, "fallback_interval"),
        ({"debounce": "2s", "max_delay": "1s"}, "max_delay"),
        ({"root": ""}, "root"),
        ({"max_sise": "1G"}, "max_sise"),
    ],
)
def test_invalid_settings_name_the_field(settings: dict, field: str) -> None:
    with pytest.raises(ConfigError) as info:
        DaemonConfig.from_mapping(settings)
    assert info.value.field == field and info.value.reason == "config"
    assert field in str(info.value)


def test_file_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        DaemonConfig.from_config(tmp_path / "missing.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("max_size = \n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        DaemonConfig.from_config(bad)


def test_budget_takes_the_smaller_of_max_size_and_free_space() -> None:
    cfg = DaemonConfig.from_mapping({"max_size": "10G", "min_free": "10%"})
    total = 100 * 1024**3
    # plenty of free space: max_size rules
    assert cfg.budget(size=1024**3, fs_total=total, fs_free=50 * 1024**3) == 10 * 1024**3
    # 12 GiB free, 10 GiB must stay free: the store may grow by 2 GiB only
    assert cfg.budget(size=5 * 1024**3, fs_total=total, fs_free=12 * 1024**3) == 7 * 1024**3
    # disk filled by others: never negative
    assert cfg.budget(size=0, fs_total=total, fs_free=0) == 0
    only_free = DaemonConfig.from_mapping({"min_free": 1000})
    assert only_free.budget(size=10, fs_total=10**6, fs_free=5000) == 4010
    assert DaemonConfig.from_mapping({}).budget(size=1, fs_total=2, fs_free=1) is None


def test_from_env(tmp_path: Path) -> None:
    path = tmp_path / "a.toml"
    path.write_text('max_size = "1M"\n')
    cfg = DaemonConfig.from_env({"ADSTORE_CONFIG": str(path), "ADSTORE_ROOT": str(tmp_path)})
    assert cfg.max_size == 1024**2 and cfg.root == tmp_path


# ---------------------------------------------------------------- the one table
def test_the_table_declares_every_setting_once() -> None:
    names = [row.name for row in SETTINGS]
    assert tuple(names) == DaemonConfig.KEYS and len(set(names)) == len(names)
    for row in SETTINGS:
        assert row.help and row.kind.metavar and row.flag == "--" + row.name.replace("_", "-")
        # the default is a value the setting's own parser reads back from its TOML text
        if row.shown_default is None:
            text = row.kind.show(row.default)
            assert row.parse(text.strip('"')) == row.default, row.name
    cfg = DaemonConfig()
    assert set(cfg.describe()) == set(DaemonConfig.KEYS) | {"source"}
    assert all(getattr(cfg, row.name) == row.default for row in SETTINGS)


def test_daemon_and_store_share_the_default_grace_period() -> None:
    assert DaemonConfig().grace_period == DEFAULT_GRACE_PERIOD
    assert DaemonConfig.from_mapping({}).grace_period == DEFAULT_GRACE_PERIOD


def test_invalid_file_value_is_reported_even_when_a_flag_overrides_it(tmp_path: Path) -> None:
    path = tmp_path / "a.toml"
    path.write_text('max_size = "ten gigs"\nbatch_size = 0\n')
    with pytest.raises(ConfigError) as info:
        DaemonConfig.from_config(path, max_size="1G", batch_size="5")
    assert info.value.field == "max_size"
    path.write_text('max_size = "1G"\nbatch_size = 0\n')
    with pytest.raises(ConfigError) as info:
        DaemonConfig.from_config(path, batch_size="5")
    assert info.value.field == "batch_size"
    # cross-field rules apply to the merged result: the flag may fix the pair
    path.write_text("high_watermark = 0.5\n")
    cfg = DaemonConfig.from_config(path, low_watermark="0.4")
    assert (cfg.high_watermark, cfg.low_watermark) == (0.5, 0.4)


def test_relative_root_from_a_flag_is_not_moved_under_the_config_folder(tmp_path: Path) -> None:
    path = tmp_path / "etc" / "a.toml"
    path.parent.mkdir()
    path.write_text('root = "store"\n')
    assert DaemonConfig.from_config(path).root == path.parent / "store"
    assert DaemonConfig.from_config(path, root="elsewhere").root == Path("elsewhere")


@pytest.mark.parametrize(
    "settings, expected",
    [
        ({"max_size": "none"}, {"max_size": None}),
        ({"max_size": 0}, {"max_size": None}),
        ({"max_size": "5GB"}, {"max_size": 5 * 10**9}),
        ({"max_age": "0"}, {"max_age": None}),
        ({"max_age": "2w"}, {"max_age": 14 * 86400.0}),
        ({"min_free": "none"}, {"min_free": None}),
        ({"min_free": 0}, {"min_free_bytes": 0}),
        ({"watch": "off"}, {"watch": False}),
        ({"log_level": " DEBUG "}, {"log_level": "debug"}),
    ],
)
def test_values(settings: dict, expected: dict) -> None:
    cfg = DaemonConfig.from_mapping(settings)
    assert {k: getattr(cfg, k) for k in expected} == expected


def test_direct_construction_checks_every_field() -> None:
    for kwargs, field in (
        ({"max_size": 0}, "max_size"),
        ({"high_watermark": 2.0}, "high_watermark"),
        ({"batch_size": 0}, "batch_size"),
        ({"log_level": "x"}, "log_level"),
        ({"sweep_interval": 0.0}, "sweep_interval"),
    ):
        with pytest.raises(ConfigError) as info:
            DaemonConfig(**kwargs)
        assert info.value.field == field


def test_the_remote_keys_take_a_url_and_a_mode() -> None:
    cfg = DaemonConfig.from_mapping({"remote": " s3://bucket/fleet ", "remote_mode": "READ_WRITE"})
    assert (cfg.remote, cfg.remote_mode) == ("s3://bucket/fleet", "read-write")
    assert DaemonConfig.from_mapping({}).remote is None and DaemonConfig.from_mapping({}).remote_mode == "read"
    assert DaemonConfig.from_mapping({"remote": "none"}).remote is None
    for bad in ("bucket/fleet", "s3://", "://x", "http://a b/c", 7):
        with pytest.raises(ConfigError, match="remote"):
            DaemonConfig.from_mapping({"remote": bad})
    with pytest.raises(ConfigError, match="remote_mode"):
        DaemonConfig.from_mapping({"remote_mode": "write"})
