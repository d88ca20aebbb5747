"""``adstore push``, ``adstore pull`` and ``adstore remote``: the remote tier from the command line.

``push`` uploads committed entries (blobs the remote lacks, HEAD first, then
each rank's signed record); ``pull`` prefetches entries into the local store
(e.g. while a node boots) so the first pipeline run is a local hit;
``remote`` shows the configuration, whether the server answers, the keys and
the counters; ``keygen`` writes the key pair that signs and checks records.
The remote comes from ``--remote``/``--mode``, else the ``ADSTORE_REMOTE*``
variables, else the ``remote``/``remote_mode`` keys of the TOML file
(``--config``, else ``$ADSTORE_CONFIG``) (docs/remote.md, "Where the remote comes from").
A transfer that fails for any key is :class:`RemoteFailed` (exit 14) after every key was tried;
errors go through the CLI's one table (``cli.report_error``).
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

from adstore.daemon.commands import Context
from adstore.daemon.config import DaemonConfig
from adstore.daemon.errors import LISTING, RemoteFailed, UsageError
from adstore.daemon.format import ByteProgress, human_size, kv_block, remote_counters, remote_stats_rows, table
from adstore.store import (
    ConfigError,
    NoStore,
    RootNotADirectory,
    Store,
    plan_remote_restore,
    plan_remote_save,
    remote_restore,
    remote_save,
    validate_namespace,
)
from adstore.store.remote import Remote, RemoteConfig, TrustedKeys, write_keypair

__all__ = ["cmd_push", "cmd_pull", "cmd_remote", "cmd_keygen", "add_remote_arguments", "add_selection_arguments"]


def add_remote_arguments(p: argparse.ArgumentParser) -> None:
    """The flags every remote command takes."""
    p.add_argument(
        "--remote", metavar="URL", help="s3://BUCKET/PREFIX or http(s)://HOST:PORT/PREFIX (default: $ADSTORE_REMOTE)"
    )
    p.add_argument(
        "--mode",
        choices=["read", "read-write"],
        help="read or read-write (default: $ADSTORE_REMOTE_MODE, else the config's remote_mode, else read)",
    )
    p.add_argument(
        "--config",
        type=Path,
        metavar="FILE",
        help="TOML configuration whose remote and remote_mode apply when neither the flags nor "
        "$ADSTORE_REMOTE* give them (default: $ADSTORE_CONFIG)",
    )


def add_selection_arguments(p: argparse.ArgumentParser, verb: str, every: str) -> None:
    """``--all`` and ``--namespace``: what ``push``/``pull`` transfer when no KEY is given."""
    p.add_argument("--all", action="store_true", help=f"{verb} {every} (instead of KEYs)")
    p.add_argument("--namespace", metavar="NS", help=f"{verb} only the entries of namespace NS (with --all, or alone)")
    p.add_argument(
        "--dry-run", action="store_true", help="print what would be moved (entries, blobs, bytes), move nothing"
    )


def _selection(args: argparse.Namespace, verb: str) -> str | None:
    """Check KEYs against ``--all``/``--namespace``; the namespace to select (None: all, or the KEYs)."""
    whole = bool(args.all) or args.namespace is not None
    if args.keys and whole:
        raise UsageError("give KEYs, or --all / --namespace NS, not both", prog=f"adstore {verb}")
    if not args.keys and not whole:
        raise UsageError("give KEYs, or --all / --namespace NS", prog=f"adstore {verb}")
    if args.namespace is not None:
        validate_namespace(args.namespace)
    return args.namespace


def _config(args: argparse.Namespace) -> RemoteConfig:
    """Flags win, then ``ADSTORE_REMOTE``/``ADSTORE_REMOTE_MODE``, then the TOML file's keys."""
    overrides: dict[str, Any] = {}
    path = getattr(args, "config", None) or os.environ.get("ADSTORE_CONFIG") or None
    if path is not None:
        file = DaemonConfig.from_config(path)
        if file.remote and not os.environ.get("ADSTORE_REMOTE", "").strip():
            overrides["url"] = file.remote
        if not os.environ.get("ADSTORE_REMOTE_MODE", "").strip():
            overrides["mode"] = file.remote_mode
    if getattr(args, "remote", None):
        overrides["url"] = args.remote
    if getattr(args, "mode", None):
        overrides["mode"] = args.mode
    return RemoteConfig.from_env(**overrides)


def _open(args: argparse.Namespace) -> tuple[RemoteConfig, Remote]:
    cfg = _config(args)
    remote = cfg.open()
    if remote is None:
        raise ConfigError("ADSTORE_REMOTE", "no remote configured (set ADSTORE_REMOTE or pass --remote URL)")
    return cfg, remote


def _finish(ctx: Context, rows: list[dict[str, Any]], remote: Remote, verb: str) -> int:
    data = {"remote": remote.url, "results": rows, "counters": remote.counters}
    failed = [r for r in rows if r["reason"] is not None]
    text = table(
        ([r["key"][:16], r["rank"], human_size(r["bytes"]), r["reason"] or "ok"] for r in rows),
        ["KEY", "RANK", verb.upper(), "RESULT"],
    )
    if failed:
        raise RemoteFailed(verb, failed, details=data)
    ctx.emit(data, text)
    return 0


def cmd_push(args: argparse.Namespace, ctx: Context) -> int:
    """Upload every committed rank of each KEY, or of every entry (``--all``, ``--namespace``), read-write only.

    ``--all`` uploads what was built before a remote was set: entries the remote holds already cost a HEAD
    per blob and a record each (records are small; blobs are never sent twice).  ``--dry-run`` asks the
    same HEADs and prints the plan.
    """
    namespace = _selection(args, "push")
    _cfg, remote = _open(args)
    if not remote.writable:
        raise ConfigError("ADSTORE_REMOTE_MODE", "push writes the remote: use --mode read-write")
    store = ctx.store(create=False)
    texts = args.keys or [e.key for e in store.entries(namespace)]
    wanted = []
    for text in texts:
        key = store.resolve_key(text)
        entry = store.entry(key)
        wanted += [(key, rank) for rank in (sorted(entry.ranks) if entry is not None else [0])]
    rows: list[dict[str, Any]] = []
    try:
        if args.dry_run:
            for key, rank in wanted:
                rows.append(_planned(key, rank, plan_remote_save(store, remote, key, rank)))
            return _finish_plan(ctx, rows, remote, "push")
        moved = lambda: remote.counters.get("bytes_up", 0)  # noqa: E731 - read by the progress thread
        with ByteProgress("pushing", moved, total=len(wanted), stream=ctx.err) as progress:
            for i, (key, rank) in enumerate(wanted):
                out = remote_save(store, remote, key, rank)
                rows.append({"key": key, "rank": rank, "bytes": out.nbytes, "reason": out.reason})
                progress.step(i + 1)
    finally:
        remote.close()
    return _finish(ctx, rows, remote, "sent")


def cmd_pull(args: argparse.Namespace, ctx: Context) -> int:
    """Restore each KEY's ranks from the remote into the local store (full keys: the store may not have them).

    ``--all`` / ``--namespace NS`` (filling a store at image build time): every record the remote lists that a
    trusted key signed (``Remote.list_records``), each rank at the record's world size.  ``--dry-run``
    fetches the records only and prints the plan.
    """
    namespace = _selection(args, "pull")
    _cfg, remote = _open(args)
    store = _plan_store(ctx) if args.dry_run else ctx.store()
    rows: list[dict[str, Any]] = []
    try:
        if args.keys:
            ranks = [args.rank] if args.rank is not None else list(range(args.world_size))
            wanted = [(key, rank, args.world_size) for key in args.keys for rank in ranks]
        else:
            wanted = _listed(remote, namespace, args.rank)
        if args.dry_run:
            for key, rank, world_size in wanted:
                if store is not None and store.lookup(key, rank=rank, count=False).hit:
                    rows.append({"key": key, "rank": rank, "blobs": 0, "bytes": 0, "reason": None, "local": True})
                    continue
                rows.append(_planned(key, rank, plan_remote_restore(store, remote, key, rank, world_size)))
            return _finish_plan(ctx, rows, remote, "pull")
        assert store is not None
        with ByteProgress("pulling", lambda: _received(remote, store), total=len(wanted), stream=ctx.err) as progress:
            for i, (key, rank, world_size) in enumerate(wanted):
                progress.step(i)
                if store.lookup(key, rank=rank, count=False).hit:
                    rows.append({"key": key, "rank": rank, "bytes": 0, "reason": None, "source": "local"})
                    continue
                out = remote_restore(store, remote, key, rank, world_size)
                rows.append({"key": key, "rank": rank, "bytes": out.nbytes, "reason": out.reason, "source": "remote"})
            progress.step(len(wanted))
    finally:
        remote.close()
    return _finish(ctx, rows, remote, "received")


def _plan_store(ctx: Context) -> Store | None:
    """The local store a ``pull --dry-run`` compares with, never created (None: there is none yet)."""
    try:
        return ctx.store(create=False)
    except RootNotADirectory:
        raise
    except NoStore:
        return None


def _received(remote: Remote, store: Store) -> int:
    """Bytes pulled so far: the blobs done (the remote's count) and those arriving (the store's temp files)."""
    arriving = 0
    try:
        with os.scandir(store.root / "tmp") as it:
            for item in it:
                try:
                    arriving += item.stat(follow_symlinks=False).st_size if item.is_file(follow_symlinks=False) else 0
                except OSError:
                    continue
    except OSError:
        pass
    return remote.counters.get("bytes_down", 0) + arriving


def _planned(key: str, rank: int, out: Any) -> dict[str, Any]:
    """One row of a ``--dry-run`` plan: the blobs and bytes that would move (those already there left out)."""
    plan = out.value or []
    moving = [(digest, n) for digest, n, there in plan if not there]
    return {
        "key": key,
        "rank": rank,
        "blobs": len(moving),
        "blobs_there": len(plan) - len(moving),
        "bytes": sum(n for _, n in moving),
        "reason": out.reason,
        "local": False,
        "moving": dict(moving),
    }


def _finish_plan(ctx: Context, rows: list[dict[str, Any]], remote: Remote, verb: str) -> int:
    """Print a ``--dry-run`` plan: per rank what would move, then the totals; nothing was moved."""
    ready = [r for r in rows if r["reason"] is None]
    unique: dict[str, int] = {}  # a blob two ranks share moves once
    for r in ready:
        unique.update(r.pop("moving", {}))
    for r in rows:
        r.pop("moving", None)
    total, blobs = sum(unique.values()), len(unique)
    data = {"dry_run": True, "remote": remote.url, "plan": rows, "bytes": total, "blobs": blobs}
    where = "the remote" if verb == "push" else "this store"
    text = table(
        (
            [
                r["key"][:16],
                r["rank"],
                r["blobs"],
                human_size(r["bytes"]),
                "here already" if r.get("local") else (r["reason"] or f"{r.get('blobs_there', 0)} on {where}"),
            ]
            for r in rows
        ),
        ["KEY", "RANK", "BLOBS", "BYTES", "NOTE"],
    )
    records = len([r for r in ready if not r.get("local")])
    what = "send" if verb == "push" else "receive"
    text += f"\ndry run: would {what} {blobs} blob(s), {human_size(total)}, and {records} record(s); nothing moved"
    failed = [r for r in rows if r["reason"] is not None]
    if failed:
        text += f"; {len(failed)} rank(s) could not be planned"
    ctx.emit(data, text)
    return 0


def _listed(remote: Remote, namespace: str | None, rank: int | None) -> list[tuple[str, int, int | None]]:
    """(key, rank, world size) of every trusted record on the remote, of ``namespace`` and ``rank`` if given."""
    listed = remote.list_records()
    if not listed.ok or listed.value is None:
        failure = {"key": LISTING, "rank": "-", "bytes": listed.nbytes, "reason": listed.reason}
        raise RemoteFailed("pull --all", [failure])
    wanted = []
    for record in listed.value:
        payload = record.payload
        if namespace is not None and payload.get("namespace") != namespace:
            continue
        if rank is not None and payload["rank"] != rank:
            continue
        world = payload.get("world_size")
        wanted.append((str(payload["key"]), int(payload["rank"]), world if type(world) is int else None))
    return sorted(wanted)


def cmd_remote(args: argparse.Namespace, ctx: Context) -> int:
    """Show the remote's URL, mode, reachability, keys, breaker and counters."""
    cfg = _config(args)
    data: dict[str, Any] = {"config": cfg.describe(), "reachable": None}
    try:
        stored = remote_counters(ctx.store(create=False).stats().counters)
    except Exception:  # no local store yet: nothing counted
        stored = {}
    data["store_counters"] = stored
    if not cfg.enabled:
        ctx.emit(data, "Remote: none configured (ADSTORE_REMOTE)")
        return 0
    remote = cfg.open()
    assert remote is not None
    try:
        if not args.no_probe:
            probe = remote.probe()
            data["reachable"] = probe.ok
            data["round_trip_seconds"] = probe.value
            data["probe_reason"] = probe.reason
        data["status"] = remote.status()
    finally:
        remote.close()
    status = data["status"]
    reach = (
        "not probed"
        if data["reachable"] is None
        else f"yes ({1000 * data['round_trip_seconds']:.1f} ms)"
        if data["reachable"]
        else f"no ({data['probe_reason']})"
    )
    rows = [
        ("Remote", status["url"]),
        ("Mode", status["mode"]),
        ("Reachable", reach),
        ("Conditional writes", status["conditional_writes"]),
        (
            "Blob transfer",
            "zstd frames as stored (zcas/), raw otherwise"
            if status["transfer"] == "zstd"
            else "raw (cas/, as Bazel clients expect)",
        ),
        ("Signing key", status["signing_key"] or "none"),
        ("Trusted keys", ", ".join(status["trusted_keys"]) or "none"),
        ("Timeouts", f"connect {cfg.connect_timeout:g}s, read {cfg.timeout:g}s, cool-down {cfg.cooldown:g}s"),
        ("Deadline", f"{cfg.deadline:g}s a call, blobs + size at {human_size(int(cfg.min_throughput))}/s"),
    ]
    rows += remote_stats_rows({f"remote.{k}": v for k, v in stored.items()})
    ctx.emit(data, kv_block(rows))
    return 1 if data["reachable"] is False else 0  # like verify: a check that failed, not an error


def cmd_keygen(args: argparse.Namespace, ctx: Context) -> int:
    """Write ``NAME.key`` (0600, builders' ``ADSTORE_SIGNING_KEY``) and ``NAME.pub`` (``ADSTORE_TRUSTED_KEYS``).

    Through the CLI, a missing ``cryptography`` (the ``remote`` extra) is the one-line error that names the extra.
    """
    private, public = write_keypair(args.directory, name=args.name)
    key_ids = TrustedKeys.load(public).key_ids
    data = {"private_key": str(private), "public_key": str(public), "key_id": key_ids[0] if key_ids else None}
    text = kv_block(
        [
            ("Private key", f"{private} (builders: ADSTORE_SIGNING_KEY)"),
            ("Public key", f"{public} (every host: ADSTORE_TRUSTED_KEYS)"),
            ("Key id", data["key_id"] or "-"),
        ]
    )
    ctx.emit(data, text)
    return 0
