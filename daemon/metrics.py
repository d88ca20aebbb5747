"""Prometheus metrics of a store, in the text format node-exporter's textfile collector reads.

The daemon writes them to ``metrics_path`` after every enforcement pass and
``adstore stats --prometheus`` prints the same text (docs/cli.md, "Metrics").  Every
number comes from the store itself (its counters, totals and persisted
budget), so both show the same values whichever process renders them.  Names
follow the Prometheus conventions: ``adstore_`` prefix, base units
(``_bytes``, ``_seconds``), ``_total`` on counters, ``# HELP`` and ``# TYPE``
for every family, one ``reason`` label for misses and bypasses.

The exposition format is written here rather than with ``prometheus_client``:
its registry and metric objects serve a process that updates metrics in
memory and serves them over HTTP, while we render one snapshot of counters
kept in LMDB; a custom collector would still be needed, and the daemon would
import a dependency for a dozen lines of text.  The tests parse the output
with ``prometheus_client``'s reference parser.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
from collections.abc import Iterable, Mapping
from pathlib import Path

import psutil

from adstore.store import Budget, Store, StoreStats, atomic_write

__all__ = ["Family", "collect", "render", "store_metrics", "write_metrics", "COUNTERS", "GAUGES"]

log = logging.getLogger(__name__)

#: Store counter -> (metric name, help, scale).  Only counters present in the store are shown,
#: except the first five, which are 0 until the first event.
COUNTERS: tuple[tuple[str, str, str, float], ...] = (
    ("hits", "adstore_hits_total", "Lookups that were hits.", 1),
    ("saves", "adstore_saves_total", "Entries saved.", 1),
    ("evictions", "adstore_evictions_total", "Entries evicted (budget, age or adstore rm).", 1),
    ("bytes_evicted", "adstore_evicted_bytes_total", "Blob bytes freed by eviction.", 1),
    ("ms_saved", "adstore_time_saved_seconds_total", "Pipeline time that hits saved, as the caches measured it.", 1e-3),
    ("bytes_written", "adstore_written_bytes_total", "Blob bytes written (new content only).", 1),
    (
        "bytes_deduplicated",
        "adstore_deduplicated_bytes_total",
        "Blob bytes not written because the content was stored already.",
        1,
    ),
    (
        "unsealed_entry",
        "adstore_unsealed_entries_total",
        "Lookups of code entries refused: index rows that disagree with the record, or a record no trusted user wrote.",
        1,
    ),
    (
        "untrusted_dedup",
        "adstore_untrusted_dedup_total",
        "Saves of code entries skipped: a deduplicated blob file belongs to a user the saver does not trust.",
        1,
    ),
    ("remote.bytes_down", "adstore_remote_downloaded_bytes_total", "Blob bytes fetched from the remote tier.", 1),
    ("remote.bytes_up", "adstore_remote_uploaded_bytes_total", "Blob bytes uploaded to the remote tier.", 1),
    ("remote.blobs_down", "adstore_remote_downloaded_blobs_total", "Blobs fetched from the remote tier.", 1),
    (
        "remote.records_down",
        "adstore_remote_downloaded_records_total",
        "Entry records fetched from the remote tier.",
        1,
    ),
    ("remote.records_up", "adstore_remote_uploaded_records_total", "Entry records uploaded to the remote tier.", 1),
)
_ALWAYS = 5  # hits, saves, evictions, bytes evicted, time saved: shown even before the first event

#: Counters split by reason: store counter prefix -> (metric name, help).
BY_REASON: tuple[tuple[str, str, str], ...] = (
    ("misses", "adstore_misses_total", "Lookups that missed, by reason."),
    ("bypasses", "adstore_bypasses_total", "Cache points bypassed (neither restored nor saved), by reason."),
    ("remote.errors", "adstore_remote_errors_total", "Failed calls to the remote tier, by reason."),
)

#: StoreStats field -> (metric name, help).
GAUGES: tuple[tuple[str, str, str], ...] = (
    ("physical_bytes", "adstore_stored_bytes", "Bytes the store's blobs take (what the budget limits)."),
    ("logical_bytes", "adstore_logical_bytes", "Bytes the entries reference, before deduplication."),
    (
        "content_bytes",
        "adstore_content_bytes",
        "Bytes of distinct blob content: after deduplication, before compression.",
    ),
    ("pinned_bytes", "adstore_pinned_bytes", "Bytes of pinned entries (never evicted)."),
    ("entries", "adstore_entries", "Entries in the store."),
    ("blobs", "adstore_blobs", "Blobs in the store."),
    ("leases", "adstore_leases", "Leases held on entries."),
    ("index_bytes", "adstore_index_bytes", "Bytes of the LMDB index files."),
)
_UNSPECIFIED = "unspecified"  # events recorded without a reason


@dataclasses.dataclass(frozen=True)
class Family:
    """One metric family: its name, type, help and samples (labels, value)."""

    name: str
    kind: str  # "counter" or "gauge"
    help: str
    samples: tuple[tuple[tuple[tuple[str, str], ...], float], ...]


def _by_reason(counters: Mapping[str, int], prefix: str) -> list[tuple[tuple[tuple[str, str], ...], float]]:
    """``misses.absent`` … as ``(("reason", "absent"),)`` samples; a total above their sum is ``unspecified``."""
    head = prefix + "."
    reasons = {
        name[len(head) :]: value
        for name, value in counters.items()
        if name.startswith(head) and "." not in name[len(head) :]
    }
    rest = counters.get(prefix, 0) - sum(reasons.values())
    if rest > 0:
        reasons[_UNSPECIFIED] = reasons.get(_UNSPECIFIED, 0) + rest
    return [((("reason", reason),), float(value)) for reason, value in sorted(reasons.items())]


def collect(stats: StoreStats, *, budget_bytes: int | None) -> list[Family]:
    """The metric families of a store's stats and its current budget (None: no budget)."""
    counters = stats.counters
    families: list[Family] = []
    for i, (counter, name, help_, scale) in enumerate(COUNTERS):
        if counter in counters or i < _ALWAYS:
            families.append(Family(name, "counter", help_, (((), counters.get(counter, 0) * scale),)))
    for prefix, name, help_ in BY_REASON:
        samples = _by_reason(counters, prefix)
        if samples or not prefix.startswith("remote."):
            families.append(Family(name, "counter", help_, tuple(samples)))
    for attr, name, help_ in GAUGES:
        families.append(Family(name, "gauge", help_, (((), float(getattr(stats, attr))),)))
    if budget_bytes is not None:
        families.append(
            Family(
                "adstore_budget_bytes",
                "gauge",
                "Bytes the store may use now: max_size, capped so the filesystem keeps min_free.",
                (((), float(budget_bytes)),),
            )
        )
    return families


def _escape(text: str, *, label: bool) -> str:
    text = text.replace("\\", "\\\\").replace("\n", "\\n")
    return text.replace('"', '\\"') if label else text


def _value(v: float) -> str:
    v = float(v)
    if math.isnan(v):
        return "NaN"
    if math.isinf(v):
        return "+Inf" if v > 0 else "-Inf"
    return str(int(v)) if v.is_integer() and abs(v) < 2**63 else repr(v)


def render(families: Iterable[Family]) -> str:
    """The text exposition format (version 0.0.4): HELP, TYPE, then one line per sample."""
    lines: list[str] = []
    for f in families:
        lines.append(f"# HELP {f.name} {_escape(f.help, label=False)}")
        lines.append(f"# TYPE {f.name} {f.kind}")
        for labels, value in f.samples:
            text = ",".join(f'{k}="{_escape(v, label=True)}"' for k, v in labels)
            lines.append(f"{f.name}{{{text}}} {_value(value)}" if text else f"{f.name} {_value(value)}")
    return "\n".join(lines) + "\n"


def store_metrics(store: Store, budget: Budget | None) -> str:
    """The metrics text of ``store`` under ``budget`` (the daemon's, the persisted one or a config's)."""
    stats = store.stats()
    limit = None
    if budget is not None:
        disk = psutil.disk_usage(str(store.root))
        limit = budget.limit(size=stats.physical_bytes, fs_total=disk.total, fs_free=disk.free)
    return render(collect(stats, budget_bytes=limit))


def write_metrics(path: str | os.PathLike[str], text: str) -> bool:
    """Publish ``text`` at ``path`` atomically (a ``.tmp`` beside it, then a rename); never raises.

    The temp name ends in ``.tmp``, which the textfile collector ignores, and
    the rename replaces whatever sits at ``path`` (a planted symlink too)
    without following it.  A full disk or a missing directory is logged: the
    daemon's eviction must not depend on its metrics.
    """
    try:
        atomic_write(Path(path), text.encode(), mode=0o644)
    except Exception as exc:  # noqa: BLE001 - advisory output
        log.warning("cannot write metrics to %s: %s", path, exc)
        return False
    return True
