"""Read-only CLI commands: ``stats``, ``ls``, ``inspect`` (``explain`` is :mod:`adstore.daemon.explain`).

Each command takes the parsed arguments and a :class:`Context` and returns an
exit code; it prints either a human view or, with ``--json``, the raw data
(bytes as ints, times as epoch seconds).  Errors are raised, never printed:
:mod:`adstore.daemon.cli` turns them into one line and an exit code.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, TextIO

from adstore.daemon.config import DaemonConfig
from adstore.daemon.errors import UsageError
from adstore.daemon.format import (
    Progress,
    human_age,
    human_duration,
    human_size,
    kv_block,
    remote_stats_rows,
    short_key,
    table,
)
from adstore.daemon.lock import read_status
from adstore.daemon.metrics import store_metrics
from adstore.store import AdstoreError, Store, StoreStats

__all__ = [
    "Context",
    "resolve_key",
    "entry_dict",
    "manifest_dict",
    "cmd_stats",
    "cmd_ls",
    "cmd_inspect",
    "SNAPSHOT_ARTIFACTS",
]

# Artifacts whose content the torch-side summarizer understands.
SNAPSHOT_ARTIFACTS = ("module.pt", "hooks.json")


@dataclasses.dataclass
class Context:
    """What every command needs: where the store is, how to print."""

    root: Path | None
    json: bool = False
    out: TextIO = dataclasses.field(default_factory=lambda: sys.stdout)
    err: TextIO = dataclasses.field(default_factory=lambda: sys.stderr)
    grace_period: float | None = None
    _store: Store | None = None

    def use_config(self, path: Path) -> DaemonConfig:
        """Load a daemon config for ``--config``: its root and grace period apply unless given as flags."""
        if self._store is not None:
            raise AssertionError("use_config() must come before the store is opened")
        cfg = DaemonConfig.from_config(path)
        self.root = self.root if self.root is not None else cfg.root
        self.grace_period = self.grace_period if self.grace_period is not None else cfg.grace_period
        return cfg

    def store(self, *, create: bool = True) -> Store:
        """The store at ``root``; read-only commands pass ``create=False`` (no store: ``NoStore``)."""
        if self._store is None:
            kwargs: dict[str, Any] = {"create": create}
            if self.grace_period is not None:
                kwargs["grace_period"] = self.grace_period
            self._store = Store.open(self.root, **kwargs)
        return self._store

    def close(self) -> None:
        if self._store is not None:
            self._store.close()
            self._store = None

    def emit(self, data: Any, text: str) -> None:
        if self.json:
            self.out.write(json.dumps(data, indent=2, sort_keys=True, default=_json_default) + "\n")
        elif text:
            self.out.write(text.rstrip("\n") + "\n")


def _json_default(obj: Any) -> Any:
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return dataclasses.asdict(obj)
    if isinstance(obj, (set, frozenset)):
        return sorted(obj)
    if isinstance(obj, Path):
        return str(obj)
    return repr(obj)


# ---------------------------------------------------------------- keys
def resolve_key(store: Store, text: str) -> str:
    """The full key for an exact key or an unambiguous prefix (like git).

    The store raises :class:`UnknownKey` or :class:`AmbiguousKey` (with the
    candidates), and InvalidKey for text no key can start with: a key with a
    stray newline or space is refused as typed, never quietly trimmed into
    another key (``rm`` must act on exactly what it was given).
    """
    return store.resolve_key(text)


def _scan(store: Store, namespace: str | None = None, *, label: str = "scanning") -> Iterator[Any]:
    """Iterate entries, with a progress counter on stderr if it takes a while."""
    with Progress(label, delay=0.5) as progress:
        for i, entry in enumerate(store.entries(namespace=namespace), 1):
            if i % 256 == 0:
                progress(i)
            yield entry


def entry_dict(entry: Any) -> dict[str, Any]:
    """An entry as JSON data; shallow (``asdict`` would recurse through deeply nested components)."""
    d = {f.name: getattr(entry, f.name) for f in dataclasses.fields(entry)}
    d["ranks"] = {str(r): g for r, g in entry.ranks.items()}
    return d


def manifest_dict(m: Any) -> dict[str, Any]:
    return {
        "key": m.key,
        "rank": m.rank,
        "world_size": m.world_size,
        "generation": m.generation,
        "committed": m.committed,
        "namespace": m.namespace,
        "producer": m.producer,
        "created": m.created,
        "meta": m.meta,
        "artifacts": {n: {"digest": r.digest, "size": r.size} for n, r in m.artifacts.items()},
        "bytes": sum(r.size for r in m.artifacts.values()),
    }


# ---------------------------------------------------------------- stats
def _grouped_counters(counters: dict[str, int]) -> list[tuple[str, int | None, list[tuple[str, int]]]]:
    """``misses``, ``misses.absent`` … → [(misses, n, [(absent, k), …]), …].

    A group's number is its own counter; the store's outcome counters (hits, misses, …) without one show
    the sum of their reasons.  An integration's group (``inductor.hits.…``, ``inductor.files_placed``,
    ``seed.misses`` with ``seed.misses.unsafe_root``) holds unlike counters: it shows no sum (None).
    """
    order = ["hits", "misses", "bypasses", "saves", "evictions"]
    groups: dict[str, list[tuple[str, int]]] = {}
    totals: dict[str, int] = {}
    for name, value in counters.items():
        head, _, reason = name.partition(".")
        if reason:
            groups.setdefault(head, []).append((reason, value))
        else:
            totals[head] = value
    names = order + sorted((set(totals) | set(groups)) - set(order))
    out = []
    for name in names:
        subs = sorted(groups.get(name, []), key=lambda kv: (-kv[1], kv[0]))
        total = totals.get(name, sum(v for _, v in subs) if name in order else None)
        out.append((name, total, subs))
    return out


def cmd_stats(args: argparse.Namespace, ctx: Context) -> int:
    cfg = ctx.use_config(args.config) if args.config else None
    store = ctx.store(create=False)
    if args.prometheus:
        if ctx.json:
            raise UsageError("--prometheus and --json are two formats: pick one", prog="adstore stats")
        # The daemon's metrics file, from the same numbers: the --config's budget, else the persisted one.
        ctx.out.write(store_metrics(store, cfg.store_budget() if cfg is not None else store.budget()))
        return 0
    if args.zero:
        if args.prometheus:
            raise UsageError("--zero and --prometheus: zero first, then print", prog="adstore stats")
        store.zero_stats()
        ctx.emit({"root": str(store.root), "zeroed": True}, "Statistics zeroed")
        return 0
    st = store.stats(unreferenced=True)
    data = st.to_dict()
    data["root"] = str(store.root)
    daemon = read_status(store.root)
    data["daemon"] = daemon
    # A --config's budget, else the one the daemon persisted in the index (at start and on reload).
    budget = None
    if cfg is not None:
        budget = {**cfg.store_budget().to_dict(), "source": str(cfg.source)}
    elif st.budget is not None:
        budget = {**st.budget.to_dict(), "source": "index"}
        if daemon and daemon.get("running"):
            budget["current_limit"] = daemon.get("budget")
    data["budget"] = budget
    if ctx.json:
        ctx.emit(data, "")
        return 0
    counters = dict(st.counters)
    rows: list[tuple[str, Any]] = [
        ("Store root", store.root),
        ("Entries", st.entries),
        ("Blobs", f"{st.blobs} ({st.inline_blobs} inline)"),
        ("Logical size", human_size(st.logical_bytes)),
        ("Content size", f"{human_size(st.referenced_content_bytes)} referenced (dedup {st.dedup_ratio:.2f}x)"),
        ("Unreferenced", _unreferenced_text(st)),
        ("Physical size", f"{human_size(st.physical_bytes)} (compression {st.compression_ratio:.2f}x)"),
        ("Pinned", human_size(st.pinned_bytes)),
        ("Leases", st.leases),
        ("Index size", human_size(st.index_bytes)),
    ]
    rows.append(("Budget", _budget_text(budget, st.physical_bytes)))
    if daemon is None:
        rows.append(("Daemon", "not running"))
    else:
        state = "running" if daemon.get("running") else "not running (stale status)"
        rows.append(("Daemon", f"{state}, pid {daemon.get('pid')}, status from {human_age(daemon.get('updated'))}"))
    lines = [kv_block(rows), ""]
    counter_rows: list[tuple[str, Any]] = []
    ms_saved = counters.pop("ms_saved", 0)
    remote_rows = remote_stats_rows(counters)
    counters = {k: v for k, v in counters.items() if not k.startswith("remote.")}
    for name, total, subs in _grouped_counters(counters):
        if name.startswith("bytes_"):
            counter_rows.append((name.replace("_", " ").capitalize(), human_size(total or 0)))
            continue
        counter_rows.append((name.capitalize(), "" if total is None else total))
        counter_rows.extend((f"  {reason}", value) for reason, value in subs)
    hits, misses = counters.get("hits", 0), counters.get("misses", 0)
    if hits + misses:
        counter_rows.insert(0, ("Hit rate", f"{100.0 * hits / (hits + misses):.1f}%"))
    counter_rows.append(("Time saved", human_duration(ms_saved / 1000.0)))
    if st.counters_zeroed:
        counter_rows.append(("Counted since", f"zeroed {human_age(st.counters_zeroed)} (adstore stats --zero)"))
    counter_rows += remote_rows
    lines.append(kv_block(counter_rows))
    ctx.emit(data, "\n".join(lines))
    return 0


def _unreferenced_text(st: StoreStats) -> str:
    """Blobs no entry holds any more: their bytes, and the command that reclaims them now."""
    if not st.unreferenced_blobs:
        return "none"
    return (
        f"{st.unreferenced_blobs} blob(s), {human_size(st.unreferenced_bytes or 0)} on disk "
        "(swept by `adstore gc` after the grace period; `adstore gc --grace-period 0` now)"
    )


def _budget_text(budget: dict[str, Any] | None, size: int) -> str:
    if not budget:
        return "none recorded (no daemon has run on this store; --config shows a configured one)"
    parts = []
    if budget.get("max_size"):
        pct = 100.0 * size / budget["max_size"]
        parts.append(f"max {human_size(budget['max_size'])} ({pct:.0f}% used)")
    if budget.get("min_free_percent"):
        parts.append(f"min free {budget['min_free_percent']:g}%")
    elif budget.get("min_free_bytes"):
        parts.append(f"min free {human_size(budget['min_free_bytes'])}")
    if budget.get("current_limit") is not None:
        parts.append(f"effective {human_size(budget['current_limit'])}")
    if budget.get("high_watermark"):
        parts.append(f"watermarks {budget['high_watermark']:.0%}/{budget['low_watermark']:.0%}")
    return ", ".join(parts) or "none"


# ---------------------------------------------------------------- ls
_SORTS = {
    "last_access": lambda e: e.last_access,
    "created": lambda e: e.created,
    "size": lambda e: e.bytes,
    "hits": lambda e: e.hits,
    "key": lambda e: e.key,
    "namespace": lambda e: (e.namespace, e.key),
}
SORT_CHOICES = tuple(_SORTS)


def cmd_ls(args: argparse.Namespace, ctx: Context) -> int:
    store = ctx.store(create=False)
    now = time.time()
    selected = []
    for e in _scan(store, args.namespace, label="listing"):
        if args.match and not e.key.startswith(args.match):
            continue
        if args.pinned and not e.pinned:
            continue
        if args.unused_for is not None and now - e.last_access < args.unused_for:
            continue
        if args.min_size is not None and e.bytes < args.min_size:
            continue
        selected.append(e)
    # Default: most recently used / largest / newest first; keys alphabetically.
    descending = args.sort not in ("key", "namespace")
    selected.sort(key=_SORTS[args.sort], reverse=descending != args.reverse)
    total = len(selected)
    if args.limit is not None:
        selected = selected[: args.limit]
    stored = store.stored_bytes(e.key for e in selected)
    data = {"total": total, "entries": [{**entry_dict(e), "stored_bytes": stored[e.key]} for e in selected]}
    if ctx.json:
        ctx.emit(data, "")
        return 0
    if not selected:
        ctx.emit(data, "no entries" if total == 0 else f"{total} entries (none shown)")
        return 0
    rows = []
    for e in selected:
        committed = len(e.ranks)
        ratio = f"{e.bytes / stored[e.key]:.1f}x" if stored[e.key] else "-"
        rows.append(
            (
                short_key(e.key),
                e.namespace,
                f"{committed}/{e.world_size}",
                human_size(e.bytes),
                human_size(stored[e.key]),
                ratio,
                e.hits,
                human_age(e.last_access, now=now),
                human_age(e.created, now=now),
                "yes" if e.pinned else "",
            )
        )
    text = table(
        rows,
        ("KEY", "NAMESPACE", "RANKS", "SIZE", "STORED", "RATIO", "HITS", "LAST USED", "CREATED", "PINNED"),
        align="llrrrrrllll",
    )
    footer = f"\n{len(selected)} of {total} entries" if len(selected) < total else f"\n{total} entries"
    ctx.emit(data, text + footer)
    return 0


# ---------------------------------------------------------------- inspect
def _summarize_snapshot(store: Store, manifest: Any) -> dict[str, Any] | None:
    """Torch-side summary of a snapshot's artifacts, or a note why there is none."""
    names = [n for n in SNAPSHOT_ARTIFACTS if n in manifest.artifacts]
    if not names:
        return None
    try:
        from adstore.integration.snapshot import summarize  # lazy: imports torch
    except Exception as exc:  # ImportError, or a broken optional dependency
        return {"unavailable": f"snapshot summary unavailable ({type(exc).__name__}: {exc})"}
    artifacts: dict[str, bytes] = {}
    for name in names:
        try:
            artifacts[name] = store.read_artifact(manifest, name)
        except AdstoreError as exc:
            return {"error": f"cannot read {name}: {exc}"}
    try:
        summary = summarize(artifacts)
    except Exception as exc:  # a damaged snapshot is shown, not fatal
        return {"error": f"cannot summarize snapshot ({type(exc).__name__}: {exc})"}
    return summary if isinstance(summary, dict) else {"summary": summary}


def _render_summary(summary: dict[str, Any], indent: int = 4) -> list[str]:
    pad = " " * indent
    lines = []
    for name, value in summary.items():
        if isinstance(value, (dict, list)) and not value:
            lines.append(f"{pad}{name}: none")
        elif isinstance(value, list) and all(isinstance(v, dict) for v in value):
            lines.append(f"{pad}{name}: {len(value)}")
            for item in value[:10]:
                lines.append(f"{pad}  - " + ", ".join(f"{k}={v}" for k, v in item.items()))
            if len(value) > 10:
                lines.append(f"{pad}  … {len(value) - 10} more")
        elif isinstance(value, dict) and all(isinstance(v, (int, float)) for v in value.values()):
            lines.append(f"{pad}{name}:")
            ranked = sorted(value.items(), key=lambda kv: (-kv[1], str(kv[0])))
            shown = ranked[:20]
            rows = [(f"{pad}  {k}", v) for k, v in shown]
            lines.append(kv_block(rows))
            if len(ranked) > len(shown):
                lines.append(f"{pad}  … {len(ranked) - len(shown)} more")
        elif isinstance(value, dict):
            lines.append(f"{pad}{name}:")
            lines.extend(_render_summary(value, indent + 2))
        else:
            text = json.dumps(value, default=str) if not isinstance(value, str) else value
            lines.append(f"{pad}{name}: {text[:200]}")
    return lines


def cmd_inspect(args: argparse.Namespace, ctx: Context) -> int:
    store = ctx.store(create=False)
    key = resolve_key(store, args.key)
    entry = store.entry(key)
    manifests = sorted(store.manifests(key), key=lambda m: (m.rank, m.generation))
    summaries: dict[str, Any] = {}
    if not args.no_summary:
        for m in manifests:
            if m.committed:
                s = _summarize_snapshot(store, m)
                if s is not None:
                    summaries[f"{m.rank}:{m.generation}"] = s
    data = {
        "entry": entry_dict(entry) if entry is not None else None,
        "manifests": [manifest_dict(m) for m in manifests],
        "snapshots": summaries,
    }
    if ctx.json:
        ctx.emit(data, "")
        return 0
    lines = [f"key {key}"]
    if entry is not None:
        lines.append(
            kv_block(
                [
                    ("namespace", entry.namespace),
                    ("world size", entry.world_size),
                    ("committed ranks", f"{len(entry.ranks)}/{entry.world_size}"),
                    ("size", human_size(entry.bytes)),
                    ("hits", entry.hits),
                    ("created", human_age(entry.created)),
                    ("last used", human_age(entry.last_access)),
                    ("pinned", "yes" if entry.pinned else "no"),
                ],
                indent=2,
            )
        )
    for m in manifests:
        state = "committed" if m.committed else "UNCOMMITTED"
        producer = ", ".join(f"{k}={v}" for k, v in sorted(m.producer.items()))
        lines.append("")
        lines.append(
            f"rank {m.rank}/{m.world_size}  generation {m.generation}  {state}  "
            f"{human_size(sum(r.size for r in m.artifacts.values()))}  "
            f"created {human_age(m.created)}" + (f"  ({producer})" if producer else "")
        )
        rows = [(f"  {name}", human_size(ref.size), ref.digest[:16]) for name, ref in sorted(m.artifacts.items())]
        if rows:
            lines.append(table(rows, ("  ARTIFACT", "SIZE", "DIGEST"), align="lrl"))
        summary = summaries.get(f"{m.rank}:{m.generation}")
        if summary:
            lines.append("  snapshot:")
            lines.extend(_render_summary(summary))
    if not manifests:
        lines.append("  (no manifests)")
    ctx.emit(data, "\n".join(lines))
    return 0


# ---------------------------------------------------------------- component views (explain)
def _flatten(value: Any, prefix: str = "") -> dict[str, Any]:
    """Leaf paths (``a.b[2].c``) to values, in key order; iterative, so any nesting depth is shown."""
    out: dict[str, Any] = {}
    stack: list[tuple[str, Any]] = [(prefix, value)]
    while stack:
        path, item = stack.pop()
        if isinstance(item, dict) and item:
            stack.extend((f"{path}.{k}" if path else str(k), item[k]) for k in sorted(item, key=str, reverse=True))
        elif isinstance(item, list) and item:
            stack.extend((f"{path}[{i}]", item[i]) for i in reversed(range(len(item))))
        else:
            out[path] = item
    return out


def _short(value: Any, width: int = 60) -> str:
    text = json.dumps(value, default=str, sort_keys=True)
    return text if len(text) <= width else text[: width - 1] + "…"
