"""``adstore push``, ``pull``, ``remote`` and the remote rows of ``stats`` against a real WebDAV server."""

from __future__ import annotations

import json
import os
import re

import pytest

from adstore.daemon.cli import main
from adstore.store import Store
from adstore.store.remote import write_keypair


@pytest.fixture
def setup(http_url, tmp_path, monkeypatch):
    private, public = write_keypair(tmp_path / "keys")
    monkeypatch.setenv("ADSTORE_REMOTE", http_url)
    monkeypatch.setenv("ADSTORE_SIGNING_KEY", str(private))
    monkeypatch.setenv("ADSTORE_TRUSTED_KEYS", str(public))
    monkeypatch.delenv("ADSTORE_REMOTE_MODE", raising=False)
    a = tmp_path / "a"
    with Store.open(a) as store:
        refs = {"w": store.put_bytes(os.urandom(100_000))}
        gen = store.new_generation()
        store.publish("cli-key-1", generation=gen, artifacts=refs)
        store.commit("cli-key-1", generation=gen)
    return a, tmp_path / "b"


def run(capsys, *argv):
    code = main(list(argv))
    out = capsys.readouterr()
    return code, (json.loads(out.out) if "--json" in argv and out.out.strip() else out.out), out.err


def test_push_then_pull_on_another_root(setup, capsys):
    a, b = setup
    code, data, err = run(capsys, "--root", str(a), "push", "cli-key", "--mode", "read-write", "--json")
    assert code == 0, err
    assert data["results"][0]["key"] == "cli-key-1" and data["results"][0]["bytes"] > 100_000
    code, data, err = run(capsys, "--root", str(b), "pull", "cli-key-1", "--json")
    assert code == 0, err
    assert data["results"][0]["reason"] is None and data["results"][0]["source"] == "remote"
    with Store.open(b) as store:
        assert store.lookup("cli-key-1").hit
    code, data, _ = run(capsys, "--root", str(b), "pull", "cli-key-1", "--json")  # already local: no transfer
    assert code == 0 and data["results"][0] == {
        "key": "cli-key-1",
        "rank": 0,
        "bytes": 0,
        "reason": None,
        "source": "local",
    }
    code, text, _ = run(capsys, "--root", str(b), "stats")
    assert code == 0 and "Remote hits" in text and "Remote downloaded" in text
    code, data, _ = run(capsys, "--root", str(b), "remote", "--json")
    assert code == 0 and data["reachable"] is True and data["store_counters"]["hits"] == 1
    assert data["status"]["mode"] == "read" and len(data["status"]["trusted_keys"]) == 1


def test_errors_go_through_the_table(setup, capsys, monkeypatch):
    a, b = setup
    code, data, err = run(capsys, "--root", str(b), "pull", "no-such-key", "--json")
    assert code == 14 and data["error"]["reason"] == "absent", (data, err)
    code, data, _ = run(capsys, "--root", str(a), "push", "cli-key-1", "--json")  # read mode by default
    assert code == 2 and data["error"]["reason"] == "config"
    monkeypatch.delenv("ADSTORE_REMOTE")
    code, data, _ = run(capsys, "--root", str(a), "pull", "x", "--json")
    assert code == 2 and data["error"]["reason"] == "config"
    code, text, _ = run(capsys, "--root", str(a), "remote")
    assert code == 0 and "none configured" in text


def test_an_unreachable_remote_is_a_failed_check(setup, capsys):
    a, _b = setup
    code, data, _ = run(capsys, "--root", str(a), "remote", "--remote", "http://127.0.0.1:9/x", "--json")
    assert code == 1 and data["reachable"] is False and data["probe_reason"] == "remote_unavailable"


def test_the_config_file_names_the_remote_unless_the_environment_or_a_flag_does(
    setup, capsys, tmp_path, monkeypatch, http_url
):
    a, b = setup
    toml = tmp_path / "adstore.toml"
    toml.write_text(f'remote = "{http_url}"\nremote_mode = "read-write"\n')
    monkeypatch.delenv("ADSTORE_REMOTE")
    code, data, err = run(capsys, "--root", str(a), "push", "cli-key", "--config", str(toml), "--json")
    assert code == 0 and data["results"][0]["reason"] is None, err
    monkeypatch.setenv("ADSTORE_CONFIG", str(toml))
    code, data, _ = run(capsys, "--root", str(b), "remote", "--json", "--no-probe")
    assert data["config"]["url"] == http_url and data["config"]["mode"] == "read-write"
    monkeypatch.setenv("ADSTORE_REMOTE", "memory://from-env")
    monkeypatch.setenv("ADSTORE_REMOTE_MODE", "read")
    code, data, _ = run(capsys, "--root", str(b), "remote", "--json", "--no-probe")
    assert data["config"]["url"] == "memory://from-env" and data["config"]["mode"] == "read"
    code, data, _ = run(capsys, "--root", str(b), "remote", "--json", "--no-probe", "--remote", http_url)
    assert data["config"]["url"] == http_url


def test_stats_show_waits_for_another_host_takeovers_and_waits_that_ran_out(tmp_path, capsys):
    with Store.open(tmp_path / "s") as store:
        store.count(
            {
                "remote.hits": 2,
                "remote.flight.follower": 3,
                "remote.flight.waits": 3,
                "remote.flight.waited_ms": 95_000,
                "remote.flight.ready": 1,
                "remote.flight.takeovers": 1,
                "remote.flight.single_flight_timeout": 1,
            }
        )
    code, text, _ = run(capsys, "--root", str(tmp_path / "s"), "stats")
    rows = [re.split(r"\s{2,}", ln.strip(), maxsplit=1) for ln in text.splitlines()]
    lines = {row[0]: row[1] for row in rows if len(row) == 2}
    assert code == 0 and lines["Waited for another host"] == "3 (1m35s)", text
    assert (lines["then hit"], lines["Leases taken over"], lines["Waits that ran out"]) == ("1", "1", "1"), text
