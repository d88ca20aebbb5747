"""``aot_compile(module, args, kwargs)``: a compiled module whose restart loads torch's artifact, never traces.

``torch.compile`` traces the module with Dynamo in every new process before
any cache can answer; :func:`~adstore.integration.inductor.enable` makes the
compile that follows cheap, not the trace.  :func:`aot_compile` stores
torch's own AOT artifact (``torch.compile(...).aot_compile`` and
``torch.compiler.load_compiled_function``, :mod:`.aotartifact`) with the
shared objects of its kernels, under a key of the module's code and
structure, the inputs, the settings, torch's build and the toolchain
(:mod:`.aotkey`).  On a hit it loads them: no trace, no kernel compile, no
ISA probe.

* The module's live parameters run: they are inputs of the artifact, read
  from the module on every call (a weight changed in place is used).
* A call whose guards fail (another shape, dtype, scalar, grad mode), a
  module that grew forward hooks, or a module adstore could not compile
  this way goes to ``torch.compile(module)``, logged once: never a wrong result.
* The key is canonical data (the same under any ``PYTHONHASHSEED``) and
  holds what Dynamo's unstorable guards checked: function-valued attributes,
  closure cells and the globals the model's own code reads, by value
  (:mod:`.aotkey`, :mod:`.aotcode`).  In the process, a global or attribute
  rebound after the key was built sends every later call to ``torch.compile``.
* Files that become code follow the store's trust rule: the artifact (a
  pickle) is read from a verified copy whose writer was judged on its
  descriptor, the kernels are placed into a private directory the same way.
* An artifact torch cannot write (``unstorable_module``) runs where it was
  compiled; the entry keeps a note of it, and later processes serve the module
  with ``torch.compile`` through ``enable()``'s caches (said once at the call).
* A store or remote problem, a damaged, untrusted or unsealed entry: a compile as
  without adstore, the reason counted (``aot.failopen.<reason>``) and logged once.
  No store, no private directory (an unsafe ``TMPDIR``), no key: ``torch.compile``
  serves the module; nothing raises into the program.

The store is ``Store.from_env()`` (its remote tier, budget and trusted keys
included) unless one is given.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from adstore.integration.errors import IntegrationError, failure_reason
from adstore.integration.inductor import aotartifact
from adstore.integration.inductor.aotcode import Watch
from adstore.integration.inductor.aotkey import NAMESPACE, aot_components
from adstore.integration.inductor.entries import InductorEntries, note_failure
from adstore.integration.inductor.hostview import note_miss
from adstore.integration.placement.dirs import private_dir
from adstore.integration.placement.place import read_trusted
from adstore.integration.placement.rule import trusted_uids
from adstore.store import Reason

__all__ = ["AOTModule", "aot_compile", "ARTIFACT", "NAMESPACE"]

logger = logging.getLogger(__name__)

#: The artifact holding torch's serialized function (with what a load acts on: :func:`.aotartifact.pack`).
ARTIFACT = "artifact"
#: The artifact of an entry that says torch could not write this module's artifact (a JSON note, no code):
#: later processes serve the module through ``enable()``'s caches instead of compiling it this way again.
UNSTORABLE = "unstorable"
_UNSTORABLE_REASON = "unstorable_module"
_SCOPE = "aot"
_FALLBACK = "torch.compile serves this module"


class AOTModule:
    """What :func:`aot_compile` returns: called like the module (``compiled(*args, **kwargs)``).

    ``outcome``: ``"hit"`` (loaded from the store), ``"compiled"`` (compiled
    here, stored unless ``reason`` says why not) or ``"torch.compile"``
    (every call goes to ``torch.compile``; ``reason`` says why).
    ``fallbacks`` counts the calls ``torch.compile`` served.
    """

    def __init__(
        self,
        module: nn.Module,
        compiled: aotartifact.Artifact | None,
        *,
        outcome: str,
        reason: str | None = None,
        key: str | None = None,
        seconds: float = 0.0,
        detail: str = "",
        watch: Watch | None = None,
    ) -> None:
        self.module = module
        self.outcome = outcome
        self.reason = reason
        self.key = key
        self.seconds = seconds
        self.detail = detail
        self.fallbacks = 0
        self._compiled = compiled
        self._watch = watch
        self._grad = torch.is_grad_enabled()
        self._fallback: Any = None

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        compiled = self._compiled
        if (
            compiled is not None
            and torch.is_grad_enabled() == self._grad
            and not _call_hooks(self.module)
            and not self._rebound()
        ):
            try:
                ok = compiled.guard_check(self.module, args, kwargs)
            except TypeError:  # arguments forward does not take: torch.compile raises the user's error
                ok = False
            if ok:
                return compiled(self.module, args, kwargs)
        return self._other_call(*args, **kwargs)

    def _rebound(self) -> bool:
        """Whether a global or function-valued attribute the key holds was rebound since (then never again).

        Dynamo's guards on them cannot be stored in the artifact; torch.compile, which keeps them, serves
        every later call of this module.
        """
        if self._watch is None:
            return False
        name = self._watch.changed()
        if name is None:
            return False
        self._compiled = None
        note_failure(
            "global_changed",
            f"{type(self.module).__name__}: {name!r} is not what the artifact was keyed with",
            scope=_SCOPE,
            fallback="torch.compile serves this module from now on",
        )
        return True

    def _other_call(self, *args: Any, **kwargs: Any) -> Any:
        self.fallbacks += 1
        if self._fallback is None:
            if self._compiled is not None:
                note_failure(
                    "guard_failed",
                    f"a call of {type(self.module).__name__} outside the compiled inputs' guards",
                    scope=_SCOPE,
                    fallback="torch.compile serves such calls",
                )
            self._fallback = torch.compile(self.module)
        return self._fallback(*args, **kwargs)

    def __repr__(self) -> str:
        return f"AOTModule({type(self.module).__name__}, outcome={self.outcome!r}, reason={self.reason!r})"


def aot_compile(
    module: nn.Module, args: tuple[Any, ...] = (), kwargs: Mapping[str, Any] | None = None, *, store: Any = None
) -> AOTModule:
    """``module`` compiled for ``module(*args, **kwargs)``: loaded from the store, or compiled and stored.

    ``store``: a :class:`~adstore.store.Store` (kept open), else the one
    ``ADSTORE_ROOT`` and ``ADSTORE_REMOTE*`` name.  Raises ``TypeError`` for
    a ``module`` that is not an ``nn.Module``; never for the store, the
    remote or an entry (the module is then compiled as without adstore).
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"aot_compile needs an nn.Module, got {type(module).__name__}")
    t0 = time.perf_counter()
    args, kw = tuple(args), dict(kwargs or {})
    if _call_hooks(module):
        hooked = f"{type(module).__name__} has forward hooks"
        note_failure(str(Reason.FORWARD_HOOK), hooked, scope=_SCOPE, fallback=_FALLBACK)
        return AOTModule(module, None, outcome="torch.compile", reason=str(Reason.FORWARD_HOOK))
    entries, owned, why = _entries(store)
    try:
        if entries is None:  # no store: nothing to load or keep, and torch.compile keeps every guard
            return AOTModule(module, None, outcome="torch.compile", reason=why)
        return _serve(module, args, kw, entries, t0)
    except Exception as exc:  # noqa: BLE001 - fail open: anything unforeseen, torch.compile serves the module
        reason = failure_reason(exc)
        note_failure(
            reason,
            f"aot_compile of {type(module).__name__}: {exc}",
            entries and entries.store,
            scope=_SCOPE,
            fallback=_FALLBACK,
        )
        return AOTModule(module, None, outcome="torch.compile", reason=reason, detail=str(exc))
    finally:
        if owned and entries is not None:
            try:
                entries.store.close()
            except Exception as exc:  # noqa: BLE001 - closing is best effort
                logger.debug("closing the store: %s", exc)


def _serve(
    module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], entries: InductorEntries, t0: float
) -> AOTModule:
    """Look the module up, load it on a hit; compile (and store) it on a miss.

    A module whose key cannot be built (a function-valued attribute or a
    global with no canonical form) is not served from the store at all:
    torch.compile, which keeps every guard, serves it.  A miss may wait for
    another host compiling the same entry (single-flight) and look again.
    """
    store = entries.store
    _prime_torch_key()
    watch = Watch()
    try:
        key, components = aot_components(module, args, kwargs, entries.identity, watch)
    except Exception as exc:  # noqa: BLE001 - no key: torch.compile serves it
        unkeyed = str(Reason.KEY_ERROR)
        note_failure(unkeyed, f"{type(module).__name__}: {exc}", store, scope=_SCOPE, fallback=_FALLBACK)
        return AOTModule(module, None, outcome="torch.compile", reason=unkeyed, detail=str(exc))
    loaded, why = _load(entries, key, components, module)
    if loaded is None and why == Reason.ABSENT and entries.flights.after_miss(key, NAMESPACE):
        loaded, why = _load(entries, key, components, module)  # another host (or process) compiled it meanwhile
    if loaded is not None:
        seconds = time.perf_counter() - t0
        return AOTModule(module, loaded, outcome="hit", key=key, seconds=seconds, watch=watch)
    if why == _UNSTORABLE_REASON:
        return _through_enable(module, entries, key)
    try:
        workdir = Path(tempfile.mkdtemp(prefix="adstore-aot-", dir=private_dir()))  # code: no other user may rename
    except Exception as exc:  # noqa: BLE001 - no private place for the kernels (an unsafe TMPDIR): torch.compile
        entries.flights.built(key, NAMESPACE)  # nothing will be built here: a lease this process holds goes now
        reason = failure_reason(exc)
        note_failure(reason, f"no private directory: {exc}", store, scope=_SCOPE, fallback=_FALLBACK)
        return AOTModule(module, None, outcome="torch.compile", reason=reason, key=key, detail=str(exc))
    try:
        try:
            compiled, probes, dropped = aotartifact.capture(module, args, kwargs, workdir)
            artifact = aotartifact.Artifact(compiled, aotartifact.calling(compiled, module))
        except Exception as exc:  # noqa: BLE001 - torch could not compile it this way: torch.compile serves it
            reason = str(Reason.INTEGRATION_ERROR)
            why = f"aot_compile of {type(module).__name__}: {type(exc).__name__}: {exc}"
            note_failure(reason, why, store, scope=_SCOPE, fallback=_FALLBACK)
            return AOTModule(module, None, outcome="torch.compile", reason=reason, key=key, detail=str(exc))
        saved = _save(entries, key, components, module, compiled, workdir, probes, dropped)
        why = why if saved is None else saved
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
        entries.flights.built(key, NAMESPACE)  # saved or not: a lease this process compiled under goes now
    seconds = time.perf_counter() - t0
    return AOTModule(module, artifact, outcome="compiled", reason=why, key=key, seconds=seconds, watch=watch)


@functools.cache
def _prime_torch_key() -> None:
    """torch's source key from this host's record, once per process, before the key asks for it.

    Every ``aot_compile`` key holds ``torch_key``: hashing torch's ~2,300
    files costs about 0.6 s of CPU, more than the rest of a warm restart's
    load; ``enable()`` primes it the same way (:mod:`~adstore.integration.validity.torchkey`;
    never raises, a stale or foreign record is no record).
    """
    from adstore.integration.validity import torchkey

    primed = torchkey.prime()
    logger.debug("adstore: torch_key %s for aot_compile (pid %d)", primed.status, os.getpid())


def _entries(store: Any) -> tuple[InductorEntries | None, bool, str | None]:
    """The store to use (opened from the environment unless given), whether it is ours to close, or why none."""
    try:
        if store is not None:
            return InductorEntries(store, trusted=trusted_uids(), owns_store=False), False, None
        from adstore.store import Store

        return InductorEntries(Store.from_env(), trusted=trusted_uids(), owns_store=True), True, None
    except Exception as exc:  # noqa: BLE001 - fail open: no store, compiled as without adstore
        reason = failure_reason(exc)
        note_failure(reason, f"no store ({type(exc).__name__}: {exc})", scope=_SCOPE, fallback=_FALLBACK)
        return None, False, reason


def _load(
    entries: InductorEntries, key: str, components: dict[str, Any], module: nn.Module
) -> tuple[aotartifact.Artifact | None, str | None]:
    """The stored artifact loaded (kernels placed first), or None and why not (``absent`` on a plain miss).

    The artifact becomes code: its rows must agree with a record a trusted
    user sealed (``trusted=``), or the lookup is a miss ``unsealed_entry``.
    A miss is journalled with its components (``adstore explain --misses``).
    """
    store = entries.store
    try:
        res = store.lookup(key, trusted=entries.trusted)
        if not res.hit or res.manifest is None:
            reason = str(res.reason)
            if res.reason != Reason.ABSENT:
                why = f"{NAMESPACE} entry {key[:12]} not served"
                note_failure(reason, why, store, scope=_SCOPE, fallback="compiled")
            note_miss(key, components)  # for `adstore explain`: the nearest entry and the component that differs
            return None, reason
        manifest = res.manifest
        if manifest.namespace == NAMESPACE and set(manifest.artifacts) == {UNSTORABLE}:
            return None, _UNSTORABLE_REASON  # a process before found torch cannot write its artifact
        if manifest.namespace != NAMESPACE or ARTIFACT not in manifest.artifacts:
            raise IntegrationError(f"{key[:12]} is not an {NAMESPACE} entry")
        workdir = Path(tempfile.mkdtemp(prefix="adstore-aot-", dir=private_dir()))
        try:
            entries.materialize(manifest.artifacts, workdir, None)  # trusted writers, verified copies
            meta, data = aotartifact.unpack(read_trusted(store, manifest.artifacts[ARTIFACT], entries.trusted))
            loaded = aotartifact.load(data, module, meta, workdir)
        finally:
            shutil.rmtree(workdir, ignore_errors=True)
        store.count({"aot.hits": 1})
        return loaded, None
    except Exception as exc:  # noqa: BLE001 - fail open: a damaged, untrusted or foreign entry is a miss
        reason = failure_reason(exc)
        if reason in (str(Reason.INTEGRATION_ERROR), str(Reason.ERROR)):
            reason = str(Reason.LOAD_FAILED)  # torch refused the artifact (another build), or the module changed
        why = f"{NAMESPACE} entry {key[:12]}: {type(exc).__name__}: {exc}"
        note_failure(reason, why, store, scope=_SCOPE, fallback="compiled")
        return None, reason


def _save(
    entries: InductorEntries,
    key: str,
    components: dict[str, Any],
    module: nn.Module,
    compiled: Any,
    workdir: Path,
    probes: dict[str, bool],
    dropped: dict[str, int],
) -> str | None:
    """Store the artifact and its kernels as one entry; None, or the reason it was not stored (counted)."""
    store = entries.store
    try:
        data, meta = aotartifact.serialize(compiled, module)
        blob = aotartifact.pack({**meta, "isa_probes": probes}, data)
        files = sorted(str(p) for p in workdir.glob("*/*.so") if p.is_file() and not p.is_symlink())
        artifacts = {ARTIFACT: store.put_bytes(blob), **entries.file_refs(files, workdir, None)}
        info = {"files": len(files), "guards_dropped": dropped, "bytes": len(blob)}
        if store.save(key, artifacts, namespace=NAMESPACE, components=components, meta=info, trusted=entries.trusted):
            store.count_event("save")
            return None
        return "untrusted_dedup"  # a blob another user owns: readers would refuse the entry (counted by the store)
    except Exception as exc:  # noqa: BLE001 - the compiled module is used, not kept
        reason = failure_reason(exc)  # the store's own (over_budget, disk_full, ...) where it has one
        if reason in (str(Reason.INTEGRATION_ERROR), str(Reason.ERROR)):
            # torch cannot write an object the artifact holds: said apart, every process would compile it
            reason = _UNSTORABLE_REASON if "Failed to serialize" in str(exc) else str(Reason.SAVE_FAILED)
        why = f"{NAMESPACE} entry {key[:12]}: {type(exc).__name__}: {exc}"
        if reason == _UNSTORABLE_REASON:
            _mark_unstorable(entries, key, components, f"{type(exc).__name__}: {exc}")
            fallback = "the compiled module runs here; later processes go through enable()'s caches, it is"
        else:
            fallback = "the compiled module runs, not stored,"
        note_failure(reason, why, store, scope=_SCOPE, fallback=fallback)
        return reason


def _mark_unstorable(entries: InductorEntries, key: str, components: dict[str, Any], detail: str) -> None:
    """Keep, under ``key``, that torch cannot write this module's artifact (a note, never code).

    The next process finds it and serves the module through ``enable()``'s
    caches (:func:`_through_enable`) instead of tracing and compiling it for
    an artifact it cannot keep either.  Best effort: without it, the next
    process compiles and finds out again.
    """
    store = entries.store
    try:
        note = json.dumps({"reason": _UNSTORABLE_REASON, "detail": detail[:2000]}, sort_keys=True).encode()
        artifacts = {UNSTORABLE: store.put_bytes(note)}
        meta = {"unstorable": True}
        store.save(key, artifacts, namespace=NAMESPACE, components=components, meta=meta, trusted=entries.trusted)
    except Exception as exc:  # noqa: BLE001 - the note is an optimisation; its absence costs a compile
        logger.debug("adstore: the unstorable note of %s was not kept: %s", key[:12], exc)


def _through_enable(module: nn.Module, entries: InductorEntries, key: str) -> AOTModule:
    """A module whose artifact torch cannot write: ``torch.compile`` with ``enable()``'s caches serves it.

    Said once at the call (``aot.failopen.unstorable_module``).  ``enable()``
    is switched on for the process unless it is already (with the store
    given to ``aot_compile``, else the one the environment names): Inductor's
    graphs and kernels then come from the store, so a restart traces the
    module but compiles no kernel another process built.
    """
    from adstore.integration.inductor import plug

    given = None if entries.owns_store else entries.store  # ours is closed when aot_compile returns
    on = plug.active() is not None or plug.enable(given)
    fallback = "torch.compile with enable()'s caches serves this module" if on else _FALLBACK
    why = f"torch cannot write the artifact of {type(module).__name__} (entry {key[:12]})"
    note_failure(_UNSTORABLE_REASON, why, entries.store, scope=_SCOPE, fallback=fallback)
    return AOTModule(module, None, outcome="torch.compile", reason=_UNSTORABLE_REASON, key=key)


def _call_hooks(module: nn.Module) -> bool:
    """Whether calling ``module`` runs hooks around ``forward`` (the artifact is of ``forward`` alone)."""
    from torch.nn.modules import module as base

    return bool(
        module._forward_hooks
        or module._forward_pre_hooks
        or base._global_forward_hooks
        or base._global_forward_pre_hooks
        or type(module).__call__ is not nn.Module.__call__
    )
