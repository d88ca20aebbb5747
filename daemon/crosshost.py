"""``adstore explain`` across hosts: a missed key against its nearest entry, and ``--host`` (docs/cli.md).

A key that is not in the store has no components here, but the host that
missed it journalled them (:mod:`adstore.integration.inductor.hostview`);
:func:`nearest` finds the stored entry of the same namespace sharing most
components with it and :func:`one_line` names what differs, in one line.
When the store holds no entry to compare with (a new host's miss: the builder's
entry is on the remote), :class:`RemoteEntries` lists the remote's trusted
records once and compares with their components.
``--host`` prints this host's key components and, when the store holds this
toolchain's Inductor entry, whether its headers were built under this
host's install paths.  Only ``--host`` imports torch.
"""

from __future__ import annotations

import json
import textwrap
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

from adstore.daemon.commands import _flatten, _short
from adstore.store import AdstoreError, Store
from adstore.store.remote import RemoteConfig

__all__ = [
    "CAUSES",
    "DIGESTS",
    "HOST_WIDTH",
    "SCAN_LIMIT",
    "cause_rank",
    "RemoteEntries",
    "describe_difference",
    "host_view",
    "nearest",
    "one_line",
]

#: Entries of the namespace a miss compares with (most recently used first).
SCAN_LIMIT = 512

#: ``--host`` wraps a word list longer than this; nothing it prints is cut short.
HOST_WIDTH = 100

_MISSING = object()


def describe_difference(path: str, stored: Any, here: Any) -> str:
    """One field's difference; word lists (instruction-set flags) as the words only one side has."""
    if isinstance(stored, str) and isinstance(here, str) and " " in stored + here:
        a, b = set(stored.split()), set(here.split())
        parts = []
        if a - b:
            parts.append("missing here: " + " ".join(sorted(a - b)[:12]))
        if b - a:
            parts.append("only here: " + " ".join(sorted(b - a)[:12]))
        return f"{path} ({'; '.join(parts)})"
    return f"{path} (entry {_short(stored, 48)}, here {_short(here, 48)})"


#: Components that say where an entry was built (toolchain, CPU, torch build): a difference there is a cause.
CAUSES = ("toolchain", "env", "torch_key")
#: Components that are digests of what the caller compiled, the environment included (Inductor hashes the
#: ISA it compiles for into its own key, vLLM its configuration): when a cause differs too, they follow from it.
DIGESTS = ("inductor_key", "vllm_hash")


def cause_rank(path: str) -> int:
    """0 for a cause (:data:`CAUSES`), 2 for a digest that follows (:data:`DIGESTS`), 1 for the rest."""
    top = path.split(".", 1)[0]
    return 0 if top in CAUSES else 2 if top in DIGESTS else 1


def _differences(a: Mapping[str, Any], b: Mapping[str, Any]) -> list[tuple[str, Any, Any]]:
    """The differing leaf paths, causes first (the environment), digests that follow from them last."""
    fa, fb = _flatten(dict(a)), _flatten(dict(b))
    return [
        (p, fa.get(p, "<absent>"), fb.get(p, "<absent>"))
        for p in sorted(set(fa) | set(fb), key=lambda p: (cause_rank(p), p))
        if fa.get(p, _MISSING) != fb.get(p, _MISSING)
    ]


def _named(diffs: list[tuple[str, Any, Any]]) -> list[str]:
    """The first three differences as words; a digest after a cause is said to follow from it, not blamed."""
    caused = any(cause_rank(p) == 0 for p, _, _ in diffs)
    return [
        f"{p.split('.', 1)[0]} (a digest that differs with them)"
        if caused and cause_rank(p) == 2
        else describe_difference(p, a, b)
        for p, a, b in diffs[:3]
    ]


def nearest(
    store: Store, components: Mapping[str, Any], namespace: str | None, *, exclude: str | None = None
) -> tuple[str, dict[str, Any]] | None:
    """The stored entry (of ``namespace``, not ``exclude``) sharing most with ``components``, and its components."""
    entries = sorted(store.entries(namespace=namespace), key=lambda e: getattr(e, "last_access", 0.0), reverse=True)

    def stored() -> Iterator[tuple[str, dict[str, Any]]]:
        for entry in [e for e in entries if e.key != exclude][:SCAN_LIMIT]:
            full = store.entry(entry.key)
            yield entry.key, dict(full.components) if full is not None and full.components else {}

    return _best(stored(), components)


def _best(
    candidates: Iterable[tuple[str, dict[str, Any]]], components: Mapping[str, Any]
) -> tuple[str, dict[str, Any]] | None:
    """The candidate (key, components) sharing most components with ``components``, then differing in fewest fields."""
    best: tuple[tuple[int, int], str, dict[str, Any]] | None = None
    for key, theirs in candidates:
        if not theirs:
            continue
        shared = sum(1 for k in components if k in theirs and theirs[k] == components[k])
        leaves = -len(_differences(theirs, components))
        score = (shared, leaves)
        if best is None or score > best[0]:
            best = (score, key, theirs)
    return None if best is None else (best[1], best[2])


class RemoteEntries:
    """The remote's trusted records, listed once and only when a miss has no local entry to compare with.

    ``ADSTORE_REMOTE`` and ``ADSTORE_TRUSTED_KEYS`` as for ``adstore pull --all``: a WebDAV or S3 remote
    lists its records, each is verified, and only its components are kept (nothing is downloaded into the
    store).  ``reason`` says why a configured remote could not be asked (``remote_unsupported``, …).
    """

    def __init__(self) -> None:
        self._listed: list[tuple[str, str | None, dict[str, Any]]] | None = None
        self.reason: str | None = None
        self.configured = True

    def _list(self) -> list[tuple[str, str | None, dict[str, Any]]]:
        if self._listed is not None:
            return self._listed
        self._listed = []
        try:
            remote = RemoteConfig.from_env().open()
        except AdstoreError as exc:
            self.reason = exc.reason
            return self._listed
        if remote is None:
            self.configured = False
            return self._listed
        try:
            listed = remote.list_records()
        finally:
            remote.close()
        if not listed.ok or listed.value is None:
            self.reason = str(listed.reason)
            return self._listed
        for record in listed.value:
            payload = record.payload
            comps = payload.get("components")
            ns = payload.get("namespace")
            if isinstance(comps, dict):
                self._listed.append((str(payload.get("key")), ns if isinstance(ns, str) else None, comps))
        return self._listed

    def nearest(
        self, components: Mapping[str, Any], namespace: str | None, *, exclude: str | None = None
    ) -> tuple[str, dict[str, Any]] | None:
        """As :func:`nearest`, over the remote's records (of ``namespace``, not ``exclude``)."""
        listed = self._list()
        return _best(((k, c) for k, ns, c in listed if k != exclude and ns in (namespace, None)), components)


def one_line(
    key: str, components: Mapping[str, Any], store: Store, *, stored: bool = False, remote: RemoteEntries | None = None
) -> tuple[str, dict[str, Any]]:
    """The line naming why ``key`` (``components`` journalled) missed, and its data.

    ``stored``: the store holds ``key`` now (this host compiled and saved it after the miss), so the
    comparison is with the nearest *other* entry.  When the store has none, ``remote``'s records are
    asked (the builder's entries a new host missed are there, not here).
    """
    namespace = components.get("namespace") if isinstance(components.get("namespace"), str) else None
    exclude = key if stored else None
    found = nearest(store, components, namespace, exclude=exclude)
    where_found = ""
    if found is None and remote is not None:
        found = remote.nearest(components, namespace, exclude=exclude)
        where_found = " on the remote"
    state = "missed, stored here since" if stored else "not in the store"
    if found is None:
        where = f"namespace {namespace}" if namespace else "the store"
        other_entry = "other entry" if stored else "entry"
        asked = ""
        if remote is not None and remote.configured:
            asked = f" (remote not listed: {remote.reason})" if remote.reason else " (nor does the remote)"
        return f"{key[:12]}: {state}, and {where} holds no {other_entry} to compare with{asked}", {"nearest": None}
    other, theirs = found
    diffs = _differences(theirs, components)
    named = _named(diffs)
    more = f" and {len(diffs) - 3} more" if len(diffs) > 3 else ""
    text = (
        f"{key[:12]}: {state}; nearest entry {other[:12]}{where_found} differs in {', '.join(named)}{more}"
        if diffs
        else f"{key[:12]}: {state}; entry {other[:12]}{where_found} has the same components (stored under another key)"
    )
    data = {
        "nearest": other,
        "nearest_on_remote": bool(where_found),
        "differences": [{"path": p, "entry": a, "here": b} for p, a, b in diffs],
    }
    return text, data


def _field_lines(path: str, value: Any) -> list[str]:
    """``path = value`` in full, a long word list (instruction-set flags) wrapped, so two hosts diff by line."""
    text = json.dumps(value, default=str, sort_keys=True)
    if not (isinstance(value, str) and " " in value and len(text) > HOST_WIDTH):
        return [f"  {path} = {text}"]
    return textwrap.wrap(
        value, HOST_WIDTH, initial_indent=f"  {path} = ", subsequent_indent="      ", break_on_hyphens=False
    )


def host_view(store: Store | None) -> tuple[str, dict[str, Any]]:
    """``adstore explain --host``: this host's key components, and its toolchain entry's install paths."""
    from adstore.integration.inductor.entries import host_report
    from adstore.integration.inductor.toolchain_entry import choose, path_differences

    report = host_report()
    lines = ["this host's key components:"]
    for path, value in _flatten({k: report[k] for k in ("toolchain", "torch_key", "user")}).items():
        lines.extend(_field_lines(path, value))
    lines.append("install paths (Inductor's precompiled header name holds those marked *):")
    for name, value in report["paths"].items():
        lines.append(f"  {'*' if name in report['keyed_paths'] else ' '} {name} = {value}")
    lines.append("install roots (kernel names hold ${name}, not the path):")
    lines.extend(f"    {name} = {value}" for name, value in report.get("roots", {}).items())
    report["toolchain_entry_paths"] = None
    key = report["toolchain_entry"]
    if store is None:
        lines.append("toolchain entry: no store to look in")
    else:
        manifests = store.manifests(key) if store.entry(key) is not None else []
        if not manifests:
            lines.append(f"toolchain entry {key[:12]}: not in the store (this toolchain compiled nothing here yet)")
        else:
            meta, artifacts = manifests[0].meta, manifests[0].artifacts
            chosen, differs = choose(artifacts, meta, report["paths"])
            headers = [h for h in meta.get("headers", []) if isinstance(h, dict)]
            report["toolchain_entry_paths"] = [h.get("paths") for h in headers]
            if differs:
                lines.append(
                    f"toolchain entry {key[:12]}: no header built under this host's paths: " + "; ".join(differs)
                )
            elif headers:
                fits = sum(1 for h in headers if not path_differences(h.get("paths") or {}, report["paths"]))
                lines.append(f"toolchain entry {key[:12]}: {fits} of {len(headers)} header(s) built under these paths")
            else:
                lines.append(f"toolchain entry {key[:12]}: {len(chosen)} file(s), built before headers recorded paths")
    return "\n".join(lines), report
