"""CLI commands that change the store or run things: ``verify``, ``gc``,
``rm``, ``pin``/``unpin``, ``daemon``, ``demo``.

Destructive commands build the store's plan first, print it (victims and the
bytes it will free) and only then execute it; ``--dry-run`` stops after the
plan.  The torch-side ``demo`` is imported lazily so the rest of the CLI and
the daemon never load torch.
"""

from __future__ import annotations

import argparse
from typing import Any

import psutil

from adstore.daemon.commands import Context, entry_dict, resolve_key
from adstore.daemon.config import SETTINGS, DaemonConfig
from adstore.daemon.errors import FeatureUnavailable, StillOverBudget
from adstore.daemon.format import Progress, human_age, human_size, kv_block, short_key, table
from adstore.store import EvictionPlan, KeyNotFound, Store, parse_min_free, plan_dead_temps

__all__ = ["cmd_verify", "cmd_gc", "cmd_rm", "cmd_pin", "cmd_unpin", "cmd_freeze", "cmd_daemon", "cmd_demo"]


# ---------------------------------------------------------------- verify
def cmd_verify(args: argparse.Namespace, ctx: Context) -> int:
    # A repair first replaces an index that cannot even be opened (docs/operations.md, "Damage and repair").
    rebuilt = Store.repair_index(ctx.root) if args.fix else None
    store = ctx.store(create=args.fix)  # only a repair may create what is missing
    with Progress("verifying blobs", stream=ctx.err, delay=0.3) as progress:
        report = store.verify(fix=args.fix, progress=progress)
    if rebuilt is not None:
        report.add_rebuild(*rebuilt)
    data = report.to_dict()
    lines = [
        kv_block(
            [
                ("Blobs checked", f"{report.blobs_checked} ({human_size(getattr(report, 'bytes_checked', 0))})"),
                ("Manifests checked", report.manifests_checked),
                ("Entries checked", getattr(report, "entries_checked", "-")),
                ("Records checked", getattr(report, "records_checked", "-")),
                ("Problems", len(report.problems)),
                ("Warnings", len(report.warnings)),
                ("Fixed", len(report.fixed)),
            ]
        )
    ]
    for title, items in (("problem", report.problems), ("warning", report.warnings), ("fixed", report.fixed)):
        shown = items[:50]
        lines.extend(f"  {title}: {item}" for item in shown)
        if len(items) > len(shown):
            lines.append(f"  … {len(items) - len(shown)} more {title}s (use --json for all)")
    if report.ok:
        lines.append("store is consistent" if not report.fixed else "store repaired")
    else:
        lines.append("store has problems; run `adstore verify --fix` to repair")
    ctx.emit(data, "\n".join(lines))
    return 0 if report.ok else 1


# ---------------------------------------------------------------- gc / rm
def _plan_text(plan: EvictionPlan, *, verb: str) -> list[str]:
    lines = []
    if plan.victims:
        rows = [
            (short_key(e.key), e.namespace, human_size(e.bytes), human_age(e.last_access)) for e in plan.victims[:50]
        ]
        lines.append(table(rows, ("KEY", "NAMESPACE", "SIZE", "LAST USED"), align="llrl"))
        if len(plan.victims) > 50:
            lines.append(f"… {len(plan.victims) - 50} more entries")
    skipped = plan.skipped
    if skipped:
        shown = ", ".join(short_key(s) for s in skipped[:10])
        more = f" and {len(skipped) - 10} more" if len(skipped) > 10 else ""
        lines.append(f"skipped {len(skipped)} entries (leased, pinned or younger than the grace period): {shown}{more}")
    lines.append(
        f"{verb}: {len(plan.victims)} entries, {len(plan.blobs)} blobs, "
        f"{human_size(plan.bytes_to_free)} to free ({plan.why})"
    )
    if plan.victims and len(plan.blobs) == 0:
        lines.append("(their blobs are shared or younger than the grace period; the sweep frees them later)")
    return lines


def cmd_gc(args: argparse.Namespace, ctx: Context) -> int:
    max_size, min_free, older_than = args.max_size, args.min_free, args.older_than
    if args.config:
        cfg = ctx.use_config(args.config)
        max_size = max_size if max_size is not None else cfg.max_size
        if min_free is None and cfg.min_free_percent is not None:
            min_free = f"{cfg.min_free_percent:g}%"
        elif min_free is None:
            min_free = cfg.min_free_bytes
        older_than = older_than if older_than is not None else cfg.max_age
    store = ctx.store()
    if not args.dry_run:
        store.require_writable("gc")  # a read-only store: refused before planning, not half-way
    evict = None
    if max_size is not None or min_free is not None or older_than is not None:
        evict = store.plan_eviction(max_size=max_size, min_free=min_free, older_than=older_than)
    sweep = store.plan_sweep() if not args.no_sweep else None
    # What killed processes left outside the store (Inductor's and vLLM's directories, private code dirs).
    temps = plan_dead_temps(**({"grace": ctx.grace_period} if ctx.grace_period is not None else {}))
    temps = temps if not args.no_sweep else None
    data: dict[str, Any] = {
        "dry_run": args.dry_run,
        "eviction": evict.to_dict() if evict is not None else None,
        "sweep": sweep.to_dict() if sweep is not None else None,
        "dead_temps": temps.to_dict() if temps is not None else None,
        "bytes_to_free": (evict.bytes_to_free if evict else 0) + (sweep.bytes_to_free if sweep else 0),
        "bytes_freed": 0,
    }
    lines: list[str] = []
    if evict is not None:
        lines.extend(_plan_text(evict, verb="evict"))
    else:
        lines.append("no size or age limit given (--max-size, --min-free, --older-than): only sweeping orphans")
    if sweep is not None:
        sd = sweep.to_dict()
        parts = [f"{v} {k.replace('_', ' ')}" for k, v in sd.items() if k != "bytes_to_free" and v]
        lines.append(f"sweep: {', '.join(parts) or 'nothing'}; {human_size(sweep.bytes_to_free)} to free")
    if temps is not None and temps.victims:
        lines.append(
            f"dead processes' temporary files: {len(temps.victims)}; {human_size(temps.bytes_to_free)} to free"
        )
    if args.dry_run:
        lines.append(f"dry run: nothing removed (would free {human_size(data['bytes_to_free'])})")
    else:
        freed = 0
        if evict is not None:  # bounded transactions, like the daemon: writers never wait long
            freed += evict.execute(batch_size=args.batch_size)
        if sweep is not None:
            freed += sweep.execute()
        if temps is not None:
            data["dead_temps"]["bytes_freed"] = temps.execute()
        data["bytes_freed"] = freed
        lines.append(f"freed {human_size(freed)}")
    if evict is not None:
        _check_budget(
            store,
            evict,
            max_size=max_size,
            min_free=min_free,
            pending=data["bytes_to_free"] if args.dry_run else 0,
            data=data,
            ctx=ctx,
            lines=lines,
        )
    ctx.emit(data, "\n".join(lines))
    return 0


def _over(store: Store, *, max_size: int | None, min_free: str | int | None) -> tuple[int, str]:
    """Bytes by which the store misses its tightest limit now (0: within), and that limit as text."""
    over, limit = 0, ""
    if max_size is not None:
        size = store.size()
        over, limit = size - max_size, f"max_size {human_size(max_size)}"
    if min_free is not None:
        disk = psutil.disk_usage(str(store.root))
        want = parse_min_free(min_free, field="min_free").of(disk.total)
        if want - disk.free > over:
            over, limit = want - disk.free, f"min_free {human_size(want)}"
    return max(0, over), limit


def _blockers(store: Store, skipped: list[str]) -> dict[str, list[str]]:
    """Why the plan skipped each entry: pinned, leased by a live process, else inside the grace period.

    A removal plan skips exactly the leased entries, so it tells them apart.
    """
    pinned: dict[str, bool] = {e.key: e.pinned for e in store.entries()}
    keys = [k for k in skipped if k in pinned]  # evicted or removed since the plan: gone
    free = [k for k in keys if not pinned[k]]
    try:
        leased = set(store.plan_remove(free).skipped) if free else set()
    except KeyNotFound:  # removed in between: count nothing as leased rather than fail
        leased = set()
    blocked = {
        "pinned": [k for k in keys if pinned[k]],
        "leased": [k for k in free if k in leased],
        "grace_period": [k for k in free if k not in leased],
    }
    return {why: ks for why, ks in blocked.items() if ks}


def _check_budget(
    store: Store,
    plan: EvictionPlan,
    *,
    max_size: int | None,
    min_free: str | int | None,
    pending: int,
    data: dict[str, Any],
    ctx: Context,
    lines: list[str],
) -> None:
    """Raise :class:`StillOverBudget` (exit 8) when gc did not (or, dry, would not) meet its limit.

    ``pending`` is what a dry run would have freed.  The human output is
    printed first; with ``--json`` the plan goes into the error's details.
    """
    over, limit = _over(store, max_size=max_size, min_free=min_free)
    over -= pending
    if over <= 0:
        return
    # Eviction stopped for a reason the plan names: the entries it had to skip.
    skipped = plan.skipped if pending else store.plan_eviction(max_size=max_size, min_free=min_free).skipped
    exc = StillOverBudget(
        over=over, limit=limit, blocked=_blockers(store, skipped), store_bytes=store.size(), details=data
    )
    if not ctx.json:
        ctx.emit(data, "\n".join(lines))
    raise exc


def cmd_rm(args: argparse.Namespace, ctx: Context) -> int:
    store = ctx.store(create=False)
    if not args.dry_run:
        store.require_writable("rm")
    keys = list(dict.fromkeys(resolve_key(store, k) for k in args.keys))
    plan = store.plan_remove(keys)
    data: dict[str, Any] = {"dry_run": args.dry_run, "plan": plan.to_dict(), "bytes_freed": 0}
    lines = _plan_text(plan, verb="remove")
    if args.dry_run:
        lines.append("dry run: nothing removed")
    else:
        removed: list[str] = []
        freed = plan.execute(on_batch=lambda batch: removed.extend(batch.keys))
        data["bytes_freed"] = freed
        lines.append(f"removed {len(removed)} entries, freed {human_size(freed)}")
    ctx.emit(data, "\n".join(lines))
    # Entries the store refused (leased by a live process) make the command fail.
    return 0 if len(plan.victims) == len(keys) or args.dry_run else 1


def _set_pin(args: argparse.Namespace, ctx: Context, pinned: bool) -> int:
    store = ctx.store(create=False)
    keys = list(dict.fromkeys(resolve_key(store, k) for k in args.keys))
    for key in keys:
        (store.pin if pinned else store.unpin)(key)
    entries = [store.entry(k) for k in keys]
    verb = "pinned" if pinned else "unpinned"
    ctx.emit(
        {verb: keys, "entries": [entry_dict(e) for e in entries if e is not None]},
        "\n".join(f"{verb} {k}" for k in keys),
    )
    return 0


def cmd_pin(args: argparse.Namespace, ctx: Context) -> int:
    return _set_pin(args, ctx, True)


def cmd_unpin(args: argparse.Namespace, ctx: Context) -> int:
    return _set_pin(args, ctx, False)


def cmd_freeze(args: argparse.Namespace, ctx: Context) -> int:
    """Mark the store frozen where it is built (``Store.freeze``): read-only everywhere from now on, and read
    without LMDB's lock from a read-only mount (docs/operations.md, "A read-only store")."""
    store = ctx.store(create=False)
    store.freeze()
    ctx.emit({"frozen": str(store.root)}, f"froze {store.root}: it opens read-only from now on")
    return 0


# ---------------------------------------------------------------- daemon / demo
def cmd_daemon(args: argparse.Namespace, ctx: Context) -> int:
    from adstore.daemon.daemon import Daemon  # lazy: watchdog is only needed here

    overrides = {row.name: getattr(args, row.name) for row in SETTINGS if row.name != "root"}
    overrides["root"] = str(ctx.root) if ctx.root is not None else None
    config = DaemonConfig.from_config(args.config, **overrides)
    return Daemon(config).run(once=args.once)


def cmd_demo(args: argparse.Namespace, ctx: Context) -> int:
    try:
        from adstore.integration.reference.demo import format_demo, run_demo  # lazy: imports torch
    except Exception as exc:
        raise FeatureUnavailable(
            "the demo (adstore.integration.reference.demo)", f"{type(exc).__name__}: {exc}"
        ) from None
    result = run_demo(
        arch=args.arch,
        layers=args.layers,
        hidden=args.hidden,
        world_size=args.world_size,
        root=str(ctx.root) if ctx.root is not None else None,
        compile=args.compile,
    )
    ctx.emit(result, "" if ctx.json else format_demo(result))
    return 0
