"""An entry's build environment, and the miss ``incompatible_env`` (docs/pipeline-cache.md, "Environment checks").

An entry's key hashes the environment fields that decide whether it can be
loaded here (the pipeline cache's ``env`` component, the engine cache's
``toolchain``), and those fields are stored with the entry as key components.
A process in another environment therefore computes another key: it can
never load the entry, whatever the diagnosis below finds.

The diagnosis only names *why* a lookup missed.  On a miss ``absent`` the
caller hands :func:`find_mismatch` the stored components of other entries of
its namespace (:func:`store_candidates`: most recently used first, at most
:data:`SCAN_LIMIT`, read only on a miss, where a build follows anyway).  An
entry whose request fields all equal this lookup's but whose environment
differs turns the miss into ``incompatible_env`` with the differing fields
(``env.torch``, ``toolchain.cpu.capability``) and both values.  Fields that
are part of the request although they sit in an environment component (the
source fingerprint of the prefix code) must be equal too; fields that follow
from the environment (inductor's global config digest) are ignored.

Volatile facts (host name, pid, paths, clocks) are never environment fields:
they are not in the key, so a host that differs only in them hits.

Simulating another environment: ``ADSTORE_ENV_OVERRIDES`` (read at call
time) is a JSON object from dotted field names to values, e.g.
``{"env.torch": "2.99.0"}`` or ``{"toolchain.gpus": [["NVIDIA H100", [9, 0]]]}``;
the process then fingerprints itself with those values.  It exists for tests
and for asking what another host would see.  The fingerprint then carries a
``simulated`` list of the overridden names, so a simulating process never
shares a key with a real one: it can neither load a real host's entry nor
write one a real host would load.
"""

from __future__ import annotations

import copy
import json
import logging
import os
from collections.abc import Collection, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from adstore.integration.errors import CacheKeyError, IncompatibleEnv

__all__ = [
    "ENV_COMPONENTS",
    "OVERRIDES_VAR",
    "SCAN_LIMIT",
    "SIMULATED",
    "EnvDifference",
    "EnvMismatch",
    "apply_overrides",
    "env_differences",
    "find_mismatch",
    "store_candidates",
]

log = logging.getLogger(__name__)

#: Key components that hold an environment record (pipeline entries, engine entries).
#: ``adstore explain`` (``adstore.daemon.commands``) lists the same names: the daemon does not import torch.
ENV_COMPONENTS = ("env", "toolchain")
#: The environment variable of simulated environment fields (see module doc).
OVERRIDES_VAR = "ADSTORE_ENV_OVERRIDES"
#: The field naming the overridden fields of a simulated environment.
SIMULATED = "simulated"
#: Entries a miss reads to find one built in another environment.
SCAN_LIMIT = 256

_ABSENT = "<absent>"
_warned: set[tuple[str, ...]] = set()


def _overrides(environ: Mapping[str, str] | None) -> dict[str, Any]:
    raw = (os.environ if environ is None else environ).get(OVERRIDES_VAR, "")
    if not raw.strip():
        return {}
    try:
        parsed = json.loads(raw)
    except ValueError as exc:
        raise CacheKeyError(f"{OVERRIDES_VAR} is not JSON: {exc}") from exc
    if not isinstance(parsed, dict):
        raise CacheKeyError(f"{OVERRIDES_VAR} must be a JSON object of field names to values")
    for name in parsed:
        if name.partition(".")[0] not in ENV_COMPONENTS or not name.partition(".")[2]:
            raise CacheKeyError(
                f"{OVERRIDES_VAR}: {name!r} is not an environment field ({', '.join(ENV_COMPONENTS)}.*)"
            )
    return parsed


def apply_overrides(
    record: Mapping[str, Any], component: str, environ: Mapping[str, str] | None = None
) -> dict[str, Any]:
    """``record`` (the ``component`` environment record) with :data:`OVERRIDES_VAR`'s fields replaced.

    Only fields the record has may be overridden (a typo must not silently
    simulate nothing); the result names them under :data:`SIMULATED`.
    Raises :class:`CacheKeyError` for a malformed variable (the caches fail open).
    """
    wanted = {name: value for name, value in _overrides(environ).items() if name.partition(".")[0] == component}
    if not wanted:
        return dict(record)
    out = copy.deepcopy(dict(record))
    for name, value in sorted(wanted.items()):
        *parents, last = name.split(".")[1:]
        target: Any = out
        for part in parents:
            target = target.get(part) if isinstance(target, dict) else None
        if not isinstance(target, dict) or last not in target:
            raise CacheKeyError(f"{OVERRIDES_VAR}: the {component} record has no field {name!r}")
        target[last] = value
    out[SIMULATED] = sorted(wanted)
    if tuple(out[SIMULATED]) not in _warned:  # once per process and set of fields, not per key
        _warned.add(tuple(out[SIMULATED]))
        log.warning("simulated environment (%s): %s", OVERRIDES_VAR, ", ".join(out[SIMULATED]))
    return out


# --------------------------------------------------------------------------- differences


@dataclass(frozen=True)
class EnvDifference:
    """One environment field that differs: its dotted name, the entry's value and this process's."""

    field: str
    entry: Any
    here: Any

    def __str__(self) -> str:
        return f"{self.field} {_show(self.entry)} (here {_show(self.here)})"


@dataclass(frozen=True)
class EnvMismatch:
    """An entry for the same request, built in another environment."""

    key: str
    differences: tuple[EnvDifference, ...]

    @property
    def fields(self) -> list[str]:
        return [d.field for d in self.differences]

    def message(self) -> str:
        shown = "; ".join(str(d) for d in self.differences[:6])
        more = len(self.differences) - 6
        return f"entry {self.key[:16]} was built for this request in another environment: {shown}" + (
            f"; {more} more" if more > 0 else ""
        )

    def error(self) -> IncompatibleEnv:
        return IncompatibleEnv(self.fields, self.message())


def _show(value: Any, width: int = 48) -> str:
    text = json.dumps(value, sort_keys=True, default=str)
    return text if len(text) <= width else text[: width - 1] + "…"


def _leaves(value: Any, path: str) -> dict[str, Any]:
    """Dotted paths to values; mappings are walked, everything else (lists too) is one leaf."""
    if isinstance(value, Mapping) and value:
        out: dict[str, Any] = {}
        for k in sorted(value, key=str):
            out.update(_leaves(value[k], f"{path}.{k}"))
        return out
    return {path: value}


def _under(path: str, prefixes: Collection[str]) -> bool:
    return any(path == p or path.startswith(p + ".") for p in prefixes)


def _split(
    components: Mapping[str, Any], env: Collection[str], request: Collection[str], derived: Collection[str]
) -> tuple[dict[str, Any], dict[str, Any]]:
    """(request leaves, environment leaves) of a components mapping; derived leaves dropped."""
    req: dict[str, Any] = {}
    envs: dict[str, Any] = {}
    for name in components:
        for path, value in _leaves(components[name], str(name)).items():
            if _under(path, derived):
                continue
            if str(name) in env and not _under(path, request):
                envs[path] = value
            else:
                req[path] = value
    return req, envs


def _canon(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), default=str)


def env_differences(
    stored: Mapping[str, Any],
    current: Mapping[str, Any],
    *,
    env: Collection[str] = ENV_COMPONENTS,
    request: Collection[str] = (),
    derived: Collection[str] = (),
) -> list[EnvDifference]:
    """The environment fields in which ``stored`` (an entry's components) and ``current`` differ.

    The :data:`SIMULATED` marker comes last, so the first field named is a real one.
    """
    _, a = _split(stored, env, request, derived)
    _, b = _split(current, env, request, derived)
    paths = sorted(set(a) | set(b), key=lambda p: (p.rsplit(".", 1)[-1] == SIMULATED, p))
    return [
        EnvDifference(p, a.get(p, _ABSENT), b.get(p, _ABSENT))
        for p in paths
        if _canon(a.get(p, _ABSENT)) != _canon(b.get(p, _ABSENT))
    ]


def find_mismatch(
    candidates: Iterable[tuple[str, Mapping[str, Any]]],
    wanted: Mapping[str, Any],
    *,
    env: Collection[str] = ENV_COMPONENTS,
    request: Collection[str] = (),
    derived: Collection[str] = (),
) -> EnvMismatch | None:
    """The first candidate ``(key, components)`` that is ``wanted``'s request in another environment.

    ``request``: dotted fields inside an environment component that belong to
    the request (they must be equal); ``derived``: fields outside it that
    follow from the environment (ignored).
    """
    want_req, _ = _split(wanted, env, request, derived)
    want = _canon(want_req)
    for key, components in candidates:
        req, _ = _split(components, env, request, derived)
        if _canon(req) != want:
            continue
        diffs = env_differences(components, wanted, env=env, request=request, derived=derived)
        if diffs:
            return EnvMismatch(key, tuple(diffs))
    return None


def store_candidates(
    store: Any, namespace: str, *, exclude: str | None = None, limit: int = SCAN_LIMIT
) -> Iterator[tuple[str, dict[str, Any]]]:
    """``(key, components)`` of the namespace's entries, most recently used first, at most ``limit``."""
    entries = sorted(
        (e for e in store.entries(namespace=namespace) if e.key != exclude), key=lambda e: e.last_access, reverse=True
    )
    for listed in entries[:limit]:
        entry = store.entry(listed.key)
        if entry is not None and entry.components:
            yield listed.key, entry.components
