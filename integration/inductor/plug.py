"""Plugging adstore into torch: one RemoteCacheBackend for all of Inductor's remote caches, and the flags.

Inductor finds its remote caches by class name in ``torch._inductor.remote_cache``
and builds each one's backend with ``backend_override_cls()`` when that is set.
:func:`enable` sets it on every cache class this torch has, switches the
matching configuration flags on (``fx_graph_remote_cache``,
``autotune_remote_cache``, ``bundled_autotune_remote_cache``,
``enable_remote_autograd_cache``, ``automatic_dynamic_remote_pgo``) and
installs the kernel-file watch; :func:`disable` puts back exactly what was
there.  Inductor reads its local caches first and asks a remote only on a
local miss, so a local hit costs what it did.

A backend holds no store: it asks the one enabled when it is called (torch
caches some cache objects for the whole process, such as AOTAutograd's), and
does nothing while adstore is disabled.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from torch._inductor.remote_cache import RemoteCacheBackend

from adstore.integration.errors import failure_reason
from adstore.integration.inductor.entries import NAMESPACES, InductorEntries, note_failure
from adstore.integration.inductor.kernels import RECORDER
from adstore.integration.inductor.toolchain import Toolchain
from adstore.integration.placement.probes import PROBES
from adstore.integration.placement.rule import trusted_uids
from adstore.integration.validity import roots
from adstore.store import Reason

__all__ = ["AdstoreBackend", "enable", "disable", "active"]

logger = logging.getLogger(__name__)

#: (module, flag): the configuration switch of each remote cache.
FLAGS = (
    ("torch._inductor.config", "fx_graph_remote_cache"),
    ("torch._functorch.config", "enable_remote_autograd_cache"),
    ("torch._dynamo.config", "automatic_dynamic_remote_pgo"),
)
#: The autotuning caches hold Triton (GPU) kernels' configurations.  On a host without a GPU
#: torch 2.13's bundled autotune cache fails every compile (``AutotuneCacheBundler.begin_compile``
#: asserts a Triton backend hash), so these are switched on only where Triton can run.
GPU_FLAGS = (
    ("torch._inductor.config", "autotune_remote_cache"),
    ("torch._inductor.config", "bundled_autotune_remote_cache"),
)
_FX = "inductor_fx_graph"


@dataclass
class _State:
    entries: InductorEntries
    saved_flags: dict[tuple[str, str], Any] = field(default_factory=dict)
    saved_backends: dict[str, Any] = field(default_factory=dict)
    toolchain_stored: set[str] = field(default_factory=set)
    toolchain: Toolchain | None = None
    probes_installed: bool = False
    relocated: bool = False
    local_hits_before: int = 0


_lock = threading.Lock()
_state: _State | None = None


def active() -> InductorEntries | None:
    """The entries of the store enabled now (None when adstore is disabled)."""
    state = _state
    return None if state is None else state.entries


class AdstoreBackend(RemoteCacheBackend[bytes]):
    """Inductor's remote-cache backend over the enabled store (one instance per cache object torch builds)."""

    def __init__(self, namespace: str) -> None:
        super().__init__()
        self.namespace = namespace
        # An FX-graph cache object lives for one compile: the kernels loaded from here to its put are its own.
        self._mark = RECORDER.mark()
        self._asked = time.monotonic()  # a put's compile time runs from the lookup that missed

    def _get(self, key: str) -> bytes | None:
        entries = active()
        if entries is None:
            return None
        if self.namespace == _FX:
            self._mark = RECORDER.mark()
        self._asked = time.monotonic()
        return entries.get(self.namespace, key)

    def _put(self, key: str, data: bytes) -> None:
        entries = active()
        if entries is None:
            return
        if not isinstance(data, bytes | bytearray):
            note_failure(str(Reason.INTEGRATION_ERROR), f"{self.namespace}: a value of type {type(data).__name__}")
            return
        files = RECORDER.since(self._mark) if self.namespace == _FX else []
        try:
            entries.put(self.namespace, key, bytes(data), files, seconds=time.monotonic() - self._asked)
            if self.namespace == _FX:
                _save_toolchain()
        finally:  # followers wake to the graph and the toolchain's answers both on the remote
            entries.built(self.namespace, key)


def _factory(namespace: str) -> Any:
    def make() -> AdstoreBackend:
        return AdstoreBackend(namespace)

    make.__qualname__ = f"AdstoreBackend[{namespace}]"
    return make


def _save_toolchain() -> None:
    state = _state
    if state is None:
        return
    state.entries.save_toolchain(RECORDER.toolchain_files(), PROBES.recorded(), state.toolchain_stored)


def enable(store: Any = None, *, remote: Any = None) -> bool:
    """Make every ``torch.compile`` of this process read and write Inductor's caches through adstore.

    ``store``: a :class:`~adstore.store.Store` (kept open; the caller closes
    it), else the store ``ADSTORE_ROOT`` and ``ADSTORE_REMOTE*`` name
    (``Store.from_env``), or, with ``remote=`` (a URL, ``RemoteConfig`` or
    ``Remote``), that store with this remote tier.  Enabling again replaces
    the store.  Returns False, after one log line and with nothing changed,
    when no store can be opened or any step fails (every flag and backend
    switched before it is put back): Inductor then compiles as it would
    without adstore.
    """
    global _state
    from adstore.integration.validity import torchkey
    from adstore.store import Store

    disable()
    # torch's source key from this host's record while torch is unchanged: about 0.6 s of CPU otherwise,
    # asked for by every Inductor key and adstore's own (never raises; a stale or foreign record is no record).
    primed = torchkey.prime()
    logger.debug("adstore: torch_key %s (pid %d)", primed.status, os.getpid())
    try:
        if store is not None:
            if remote is not None:
                raise ValueError("give either store= or remote=, not both")
            entries = InductorEntries(store, trusted=trusted_uids(), owns_store=False)
        else:
            opened = Store.from_env(**({"remote": remote} if remote is not None else {}))
            entries = InductorEntries(opened, trusted=trusted_uids(), owns_store=True)
    except Exception as exc:  # noqa: BLE001 - fail open: no store, no adstore
        note_failure(failure_reason(exc, Reason.ERROR), f"no store ({type(exc).__name__}: {exc})")
        return False
    state = _State(entries, local_hits_before=_fx_hits())
    try:
        _plug(state)
        assert state.toolchain is not None
        state.toolchain.start()
    except Exception as exc:  # noqa: BLE001 - fail open all the way: torch as it was
        _unplug(state)
        note_failure(failure_reason(exc), f"enable failed ({type(exc).__name__}: {exc}); torch left as it was")
        return False
    with _lock:
        _state = state
    _at_exit_once()
    logger.info("adstore: Inductor's caches go through %s (pid %d)", entries.store, os.getpid())
    return True


def _plug(state: _State) -> None:
    """Switch torch to adstore, one step at a time; each step recorded in ``state`` before it is taken."""
    import torch
    import torch._inductor.remote_cache as remote_cache

    for cls_name, namespace in NAMESPACES.items():
        cls = getattr(remote_cache, cls_name, None)
        if cls is None:
            logger.debug("this torch has no %s; skipped", cls_name)
            continue
        state.saved_backends[cls_name] = cls.__dict__.get("backend_override_cls", _ABSENT)
        cls.backend_override_cls = _factory(namespace)
    for module_name, flag in FLAGS + (GPU_FLAGS if torch.cuda.is_available() else ()):
        module = _module(module_name)
        if module is not None and hasattr(module, flag):
            state.saved_flags[(module_name, flag)] = getattr(module, flag)
            setattr(module, flag, True)
    # Kernel names relative to the install roots: the same venv at another path finds the kernels placed.
    state.relocated = roots.install()
    # The toolchain entry (ISA answers, the ~150 MB precompiled header) is restored while Dynamo traces:
    # Inductor needs it only at its first ISA probe or header step, which wait for it (one deadline).
    state.toolchain = Toolchain(state.entries, wait=TOOLCHAIN_WAIT)
    RECORDER.before_toolchain = state.toolchain.wait_done
    RECORDER.install()
    PROBES.before_unknown = state.toolchain.wait_answers
    state.probes_installed = PROBES.install()


#: How long, in all, a process waits for the toolchain restore before Inductor builds what it lacks itself:
#: one deadline from ``enable()``, however many ISA probes and header steps ask (a slow or stuck remote).
TOOLCHAIN_WAIT = 30.0


def _await_toolchain() -> None:
    """Wait for the whole toolchain restore until the process's deadline (over: returns at once); never raises."""
    state = _state
    if state is not None and state.toolchain is not None:
        state.toolchain.wait_done()


def disable() -> None:
    """Undo :func:`enable`: torch's flags and backends as they were; an owned store is closed."""
    global _state
    _save_toolchain()  # headers and answers a process met after its last save (a rebuilt header among them)
    with _lock:
        state, _state = _state, None
    if state is None:
        return
    if state.toolchain is not None:
        state.toolchain.join()  # it uses the store closed below
    state.entries.flights.release_all()  # a compile that never saved: its waiters need not wait for expiry
    _unplug(state)


def _unplug(state: _State) -> None:
    """Put back everything ``state`` recorded as switched (all of it, or what a failed enable got to)."""
    import torch._inductor.remote_cache as remote_cache

    if state.probes_installed:
        PROBES.uninstall()
        state.probes_installed = False
    PROBES.before_unknown = None
    RECORDER.before_toolchain = None
    RECORDER.uninstall()
    if state.relocated:
        roots.uninstall()
        state.relocated = False
    _count_local_hits(state)
    for (module_name, flag), value in state.saved_flags.items():
        module = _module(module_name)
        if module is not None:
            setattr(module, flag, value)
    for cls_name, value in state.saved_backends.items():
        cls = getattr(remote_cache, cls_name)
        if value is not _ABSENT:
            cls.backend_override_cls = value
        elif "backend_override_cls" in cls.__dict__:
            del cls.backend_override_cls
    state.saved_flags.clear()
    state.saved_backends.clear()
    if state.entries.owns_store:
        try:
            state.entries.store.close()
        except Exception as exc:  # noqa: BLE001 - closing is best effort at this point
            logger.debug("closing the store: %s", exc)


def _fx_hits() -> int:
    """Inductor's own count of FX-graph cache hits in this process (local and adstore's); 0 before Dynamo loads."""
    utils = sys.modules.get("torch._dynamo.utils")  # never imported here: Dynamo costs ~1 s
    return 0 if utils is None else int(utils.counters["inductor"]["fxgraph_cache_hit"])


def _count_local_hits(state: _State) -> None:
    """Count ``inductor.local_hits``: FX-graph hits Inductor served from its own directory while enabled."""
    try:
        local = _fx_hits() - state.local_hits_before - state.entries.served[_FX]
        if local > 0:
            state.entries.store.count({"inductor.local_hits": local})
    except Exception as exc:  # noqa: BLE001 - counting is best effort
        logger.debug("counting Inductor's local hits: %s", exc)


_ABSENT = object()
_exit_hook: list[bool] = []


def _at_exit_once() -> None:
    """At exit, keep what the process built and close an owned store (once per process)."""
    if not _exit_hook:
        import atexit

        _exit_hook.append(True)
        atexit.register(disable)


def _module(name: str) -> Any:
    import importlib

    try:
        return importlib.import_module(name)
    except ImportError:
        return None
