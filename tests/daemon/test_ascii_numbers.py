"""Numbers from a user are ASCII digits: the CLI's counts and ranks, the configuration's, systemd's watchdog.

``int()`` reads every Unicode decimal digit (``int("２") == 2``), so a count
typed or pasted with fullwidth digits passed as a number.  Every one now goes
through ``adstore.store.parse_count``.
"""

from __future__ import annotations

import pytest
from daemon_support import run_cli

from adstore.daemon.config import DaemonConfig
from adstore.daemon.notify import watchdog_interval
from adstore.store import ConfigError


@pytest.mark.parametrize(
    "argv",
    [("ls", "--limit", "２"), ("pull", "k" * 64, "--rank", "١", "--remote", "memory://x")],
    ids=["limit-fullwidth", "rank-arabic-indic"],
)
def test_the_cli_takes_counts_in_ascii_digits_only(argv, tmp_path, monkeypatch):
    monkeypatch.setenv("ADSTORE_ROOT", str(tmp_path / "store"))
    done = run_cli(*argv)
    assert done.returncode == 2, (done.stdout, done.stderr)  # a usage error
    assert "whole number" in done.stderr


def test_a_count_in_the_configuration_is_ascii_digits():
    assert DaemonConfig.from_mapping({"batch_size": "10"}).batch_size == 10
    with pytest.raises(ConfigError) as info:
        DaemonConfig.from_mapping({"batch_size": "１０"})
    assert info.value.field == "batch_size"


def test_the_watchdog_interval_is_ascii_digits():
    assert watchdog_interval({"WATCHDOG_USEC": "60000000"}) == 30.0
    assert watchdog_interval({"WATCHDOG_USEC": "６0000000"}) is None
