"""Prometheus metrics: the daemon's ``metrics_path`` file and ``adstore stats --prometheus``.

The text is parsed with ``prometheus_client``'s reference parser and checked
line by line against the exposition format; names follow the conventions
(``adstore_`` prefix, ``_total`` counters, base units), the values are the
store's own counters and totals, and both outputs are the same text.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from daemon_support import populate, run_cli, write_config

from adstore.daemon.cli import main
from adstore.daemon.metrics import collect, render
from adstore.store import Store, StoreStats

parser = pytest.importorskip("prometheus_client.parser")

KIB = 1024
_NAME = r"[a-zA-Z_:][a-zA-Z0-9_:]*"
_LINE = re.compile(
    rf"^(# HELP {_NAME} .*|# TYPE {_NAME} (counter|gauge)"
    rf'|{_NAME}(\{{{_NAME}="([^"\\\n]|\\[\\"n])*"(,{_NAME}="([^"\\\n]|\\[\\"n])*")*\}})? '
    r"(-?[0-9]+(\.[0-9]+)?(e[+-]?[0-9]+)?|NaN|[+-]Inf))$"
)


def families(text: str) -> dict[str, object]:
    for line in text.splitlines():
        assert _LINE.match(line), line
    assert text.endswith("\n")
    parsed = {f.name: f for f in parser.text_string_to_metric_families(text)}
    for f in parsed.values():
        assert f.name.startswith("adstore_")
        unit_ok = f.name.endswith(
            (
                "_bytes",
                "_seconds",
                "_entries",
                "_blobs",
                "_leases",
                "_hits",
                "_saves",
                "_misses",
                "_bypasses",
                "_evictions",
                "_errors",
                "_blobs",
                "_records",
            )
        )
        assert unit_ok or f.name in ("adstore_entries", "adstore_blobs", "adstore_leases"), f.name
    return parsed


def sample(fams: dict, name: str, **labels: str) -> float:
    family = fams[name.removesuffix("_total")]
    values = [s.value for s in family.samples if s.labels == labels and s.name == name]
    assert len(values) == 1, (name, labels, family.samples)
    return values[0]


@pytest.fixture
def root(tmp_path: Path) -> Path:
    root = tmp_path / "store"
    keys = populate(root, count=3, size=70 * KIB, prefix="m")
    with Store.open(root, grace_period=0.0) as store:
        for _ in range(2):
            store.lookup(keys[0])
        store.lookup("absent-key")
        store.count_event("miss", "untrusted_target")
        store.count_event("bypass", "forward_hook")
        store.count_event("save", seconds_saved=0)
        store.count_event("hit", seconds_saved=1.5)
        store.plan_remove([keys[2]]).execute()
        store.pin(keys[0])
    return root


def test_stats_prometheus_is_valid_and_counts_what_happened(capsys, root, tmp_path):
    config = write_config(tmp_path / "a.toml", max_size="1M", root=str(root))
    assert main(["stats", "--prometheus", "--config", str(config)]) == 0
    fams = families(capsys.readouterr().out)
    assert sample(fams, "adstore_hits_total") == 3
    assert sample(fams, "adstore_misses_total", reason="absent") == 1
    assert sample(fams, "adstore_misses_total", reason="untrusted_target") == 1
    assert sample(fams, "adstore_bypasses_total", reason="forward_hook") == 1
    assert sample(fams, "adstore_saves_total") == 1
    assert sample(fams, "adstore_evictions_total") == 1
    assert sample(fams, "adstore_evicted_bytes_total") == 70 * KIB
    assert sample(fams, "adstore_time_saved_seconds_total") == 1.5
    assert sample(fams, "adstore_stored_bytes") == 2 * 70 * KIB
    assert sample(fams, "adstore_pinned_bytes") == 70 * KIB
    assert sample(fams, "adstore_entries") == 2
    assert sample(fams, "adstore_budget_bytes") == 1 << 20
    assert fams["adstore_hits"].type == "counter" and fams["adstore_stored_bytes"].type == "gauge"
    assert not [name for name in fams if name.startswith("adstore_remote")]  # no remote counters, no placeholders


def test_daemon_writes_the_same_text_at_metrics_path(capsys, root, tmp_path):
    metrics = tmp_path / "textfile" / "adstore.prom"
    metrics.parent.mkdir()
    config = write_config(tmp_path / "a.toml", max_size="1G", root=str(root), metrics_path="textfile/adstore.prom")
    out = run_cli("daemon", "--once", "--config", str(config))
    assert out.returncode == 0, out.stderr
    written = metrics.read_text()
    assert not [p for p in metrics.parent.iterdir() if p.name != "adstore.prom"]  # no temp left behind
    assert main(["stats", "--prometheus", "--root", str(root)]) == 0  # the budget the daemon persisted
    printed = capsys.readouterr().out

    def stable(text: str) -> str:  # the index file grows as counters are flushed
        return re.sub(r"(?m)^adstore_index_bytes .*$", "", text)

    assert stable(written) == stable(printed)
    assert sample(families(written), "adstore_budget_bytes") > 0


def test_labels_are_escaped_and_remote_counters_appear_once_counted():
    stats = StoreStats(
        counters={
            "misses": 3,
            'misses.we"ird\\reason\n': 1,
            "bypasses": 2,
            "remote.bytes_down": 4096,
            "remote.errors.remote_timeout": 2,
        }
    )
    fams = families(render(collect(stats, budget_bytes=None)))
    assert sample(fams, "adstore_misses_total", reason='we"ird\\reason\n') == 1
    assert sample(fams, "adstore_misses_total", reason="unspecified") == 2  # counted without a reason
    assert sample(fams, "adstore_bypasses_total", reason="unspecified") == 2
    assert sample(fams, "adstore_remote_downloaded_bytes_total") == 4096
    assert sample(fams, "adstore_remote_errors_total", reason="remote_timeout") == 2
    assert "adstore_remote_uploaded_bytes" not in fams and "adstore_budget_bytes" not in fams


def test_prometheus_and_json_are_one_format_at_a_time(capsys, root):
    assert main(["--json", "stats", "--prometheus", "--root", str(root)]) == 2
