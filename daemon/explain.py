"""``adstore explain KEY [KEY]``: an entry's key components, or how two entries differ (docs/cli.md, "adstore explain").

A single key that is not in the store but that this user's processes missed
is compared with the nearest stored entry (:mod:`adstore.daemon.crosshost`);
``--host`` prints this host's key components.

Two entries that differ only in their environment (torch, Python ABI, CPU,
GPU: the ``env`` component of pipeline entries, ``toolchain`` of engines)
are the same request built in two environments, the case a lookup reports
as ``incompatible_env``; the environment difference is therefore shown on
its own line (and as ``environment`` in ``--json``), field by field.
"""

from __future__ import annotations

import argparse
from typing import Any

from adstore.daemon.commands import Context, _flatten, _short, resolve_key
from adstore.daemon.crosshost import RemoteEntries, cause_rank, host_view, one_line
from adstore.daemon.errors import UnknownKey, UsageError
from adstore.daemon.format import table
from adstore.store import AdstoreError, Store

__all__ = ["ENV_COMPONENTS", "cmd_explain", "compare_components", "environment_differences"]

#: Components that record the environment an entry was built in (the names
#: ``adstore.integration.validity.envcheck`` uses; the daemon does not import torch).
ENV_COMPONENTS = ("env", "toolchain")

_MISSING = object()


def compare_components(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    """Per top-level component: same or not, and the differing leaf paths; causes (the environment) first."""
    result: dict[str, Any] = {}
    for name in sorted(set(a) | set(b), key=lambda n: (cause_rank(str(n)), str(n))):
        if name not in a or name not in b:
            result[name] = {"same": False, "only_in": "a" if name in a else "b", "differences": []}
            continue
        fa, fb = _flatten(a[name]), _flatten(b[name])
        diffs = [
            {"path": f"{name}.{p}" if p else name, "a": fa.get(p, "<absent>"), "b": fb.get(p, "<absent>")}
            for p in sorted(set(fa) | set(fb))
            if fa.get(p, _MISSING) != fb.get(p, _MISSING)
        ]
        result[name] = {"same": not diffs, "differences": diffs}
    return result


def environment_differences(a: dict[str, Any], b: dict[str, Any], cmp: dict[str, Any]) -> dict[str, Any]:
    """The environment part of :func:`compare_components`: recorded or not, same or not, the fields."""
    names = [n for n in ENV_COMPONENTS if n in cmp]
    diffs: list[dict[str, Any]] = []
    for name in names:
        if "only_in" in cmp[name]:  # one entry recorded no environment under this name
            diffs.append({"path": name, "a": a.get(name, "<absent>"), "b": b.get(name, "<absent>")})
        diffs.extend(cmp[name]["differences"])
    return {"recorded": bool(names), "same": not diffs, "differences": diffs}


def cmd_explain(args: argparse.Namespace, ctx: Context) -> int:
    if getattr(args, "host", False) or getattr(args, "misses", None):
        if args.keys or (args.host and args.misses):
            raise UsageError("--host and --misses take no KEY, and not each other", prog="adstore explain")
        return _explain_host(ctx) if args.host else _explain_misses(ctx, args.misses)
    if not args.keys:
        raise UsageError("give one or two keys, --host or --misses", prog="adstore explain")
    store = ctx.store(create=False)
    if len(args.keys) == 1:
        missed = _missed(store, args.keys[0])
        if missed is not None:
            text, data = one_line(missed["key"], missed["components"], store, remote=RemoteEntries())
            ctx.emit({"key": missed["key"], "in_store": False, "components": missed["components"], **data}, text)
            return 0
    keys = [resolve_key(store, k) for k in args.keys]
    entries = []
    for key in keys:
        entry = store.entry(key)
        if entry is None:
            raise UnknownKey(key)
        entries.append(entry)
    if len(entries) == 1:
        comps = entries[0].components
        data = {"key": keys[0], "components": comps}
        lines = [f"key {keys[0]}"]
        if not comps:
            lines.append("  (no key components were stored with this entry)")
        for name in sorted(comps, key=str):
            lines.append(f"  {name}:")
            for path, value in _flatten(comps[name]).items():
                lines.append(f"    {path or name} = {_short(value, 100)}")
        built = _built_under(store, keys[0])
        if built:  # not key components, but Inductor's names for the entry's files hold them
            data["built_under"] = built
            lines.append(
                "  built under (Inductor's names hold these paths; `adstore explain --host` shows this host's):"
            )
            lines.extend(f"    {p}" for p in built)
        ctx.emit(data, "\n".join(lines))
        return 0
    a, b = entries
    cmp = compare_components(a.components, b.components)
    differing = [name for name, c in cmp.items() if not c["same"]]
    env = environment_differences(a.components, b.components, cmp)
    data = {
        "a": a.key,
        "b": b.key,
        "components": cmp,
        "differing": differing,
        "identical": a.key == b.key,
        "environment": env,
    }
    lines = [f"A {a.key}", f"B {b.key}", ""]
    rows = []
    for name, c in cmp.items():
        state = "same" if c["same"] else (f"only in {c['only_in'].upper()}" if "only_in" in c else "DIFFERS")
        rows.append((name, state))
    lines.append(table(rows, ("COMPONENT", "A vs B")))
    for name in differing:
        for d in cmp[name]["differences"][:20]:
            lines.append(f"  {d['path']}: A={_short(d['a'])}  B={_short(d['b'])}")
        extra = len(cmp[name]["differences"]) - 20
        if extra > 0:
            lines.append(f"  … {extra} more differences in {name}")
    if env["recorded"]:
        lines.append(
            "\nenvironment: "
            + (
                "same"
                if env["same"]
                else "built in different environments: " + ", ".join(d["path"] for d in env["differences"])
            )
        )
    if not differing:
        lines.append(
            "\nall stored components are equal"
            + ("" if a.key == b.key else " (the keys differ by something not stored as a component)")
        )
    else:
        lines.append(f"\ndiffering: {', '.join(differing)}")
    ctx.emit(data, "\n".join(lines))
    return 0


def _missed(store: Store, text: str) -> dict[str, Any] | None:
    """A key this user's processes missed (journalled with its components) that the store does not hold."""
    try:
        resolve_key(store, text)
        return None  # in the store: explained as an entry
    except UnknownKey:
        pass
    from adstore.integration.inductor.hostview import missed_components  # no torch

    found = missed_components(text)
    if found is None:
        raise UnknownKey(text)
    return found


def _explain_host(ctx: Context) -> int:
    try:
        store: Store | None = ctx.store(create=False)
    except AdstoreError:  # no store here: the host's components are still worth printing
        store = None
    text, data = host_view(store)
    ctx.emit(data, text)
    return 0


def _explain_misses(ctx: Context, limit: int) -> int:
    """The last ``limit`` keys this user's processes missed, each against its nearest entry (one line each)."""
    from adstore.integration.inductor.hostview import recent_misses  # no torch

    store = ctx.store(create=False)
    lines, data = [], []
    remote = RemoteEntries()  # listed at most once, when a miss has nothing local to compare with
    for record in recent_misses(limit):
        in_store = store.entry(record["key"]) is not None
        text, found = one_line(record["key"], record["components"], store, stored=in_store, remote=remote)
        lines.append(text)
        data.append({"key": record["key"], "in_store": in_store, **found})
    ctx.emit({"misses": data}, "\n".join(lines) or "no missed keys journalled")
    return 0


def _built_under(store: Store, key: str) -> list[str]:
    """The install paths an Inductor entry's files were built under (an FX graph's kernels, each stored header)."""
    out: list[str] = []
    for manifest in store.manifests(key)[:1]:
        meta = manifest.meta if isinstance(manifest.meta, dict) else {}
        sets = [("kernels", meta.get("paths"))]
        sets += [(f"header {h.get('name')}", h.get("paths")) for h in meta.get("headers", []) if isinstance(h, dict)]
        for label, paths in sets:
            if isinstance(paths, dict):
                out.extend(f"{label}: {k} = {v}" for k, v in sorted(paths.items()))
    return out
