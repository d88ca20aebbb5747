"""Make vLLM restore its compile directories from adstore before it looks, and capture them after it writes.

:func:`install` wraps these functions of vLLM 0.32.0 (each replaced on its
module or class, the original kept and put back by :func:`uninstall`; each
wrapper calls the original exactly once with the arguments it was given,
and any adstore problem is logged and counted, never raised):

``vllm.compilation.decorators._try_load_aot_compiled_fn(model, aot_compilation_path)``
    The AOT path (``VLLM_USE_AOT_COMPILE``, on by default with torch 2.13).
    ``__call__`` of every ``@support_torch_compile`` class calls it by its
    module-global name, right after making
    ``<VLLM_CACHE_ROOT>/torch_compile_cache/torch_aot_compile/<hash>/inductor_cache``
    (empty) and before anything is loaded or compiled.  From
    ``aot_compilation_path`` = ``.../torch_aot_compile/<hash>/rank_<i>_<j>/model``
    the wrapper takes vLLM's hash (``<hash>``), the rank (``rank_<i>_<j>``)
    and the directories; it restores tree ``aot_inductor`` (rank ``shared``:
    ranks of a host share it) into ``<hash>/inductor_cache`` and tree ``aot``
    into ``<hash>/rank_<i>_<j>``, then calls the original, which loads what
    is there.  When that returns None (vLLM compiles next), the wrapper wraps
    ``save_aot_compiled_function`` of ``type(model)`` (on the class in its MRO
    that defines it: ``_support_torch_compile`` sets it per decorated class,
    so there is no module-level function to wrap; recorded, and put back
    by :func:`uninstall`).

``<decorated class>.save_aot_compiled_function(self)``
    After the original wrote ``self._aot_compilation_path`` (unless
    ``self.was_aot_compile_fn_loaded_from_disk``), captures the two trees
    from ``os.path.dirname(self._aot_compilation_path)`` and its parent's
    ``inductor_cache`` (what Inductor wrote so far).

``vllm.compilation.backends.CompilerManager.initialize_cache(self, cache_dir, disable_cache=False, prefix="")``
    The piecewise path (VllmBackend, where vLLM's own backend compiles; on
    CPU vLLM 0.32 uses plain Inductor instead).  ``VllmBackend.__call__``
    calls it with ``cache_dir`` = ``<VLLM_CACHE_ROOT>/torch_compile_cache/<hash>/rank_<i>_<j>/<prefix>``,
    just made, before it reads ``vllm_compile_cache.py`` there.  Unless
    ``disable_cache``, the wrapper restores tree ``piecewise`` (part
    ``prefix``) into ``cache_dir``.

``vllm.compilation.backends.CompilerManager.save_to_file(self)``
    Called once compilation is done; when ``self.is_cache_updated`` and not
    ``self.disable_cache`` (the original writes ``vllm_compile_cache.py``),
    the wrapper captures ``self.cache_dir`` as tree ``piecewise``, part
    ``self.prefix``.  (``computation_graph.py``, a debugging copy vLLM
    writes after it, is captured only by a later save.)

``vllm.model_executor.models.registry._LazyRegisteredModel._load_modelinfo_from_cache(self, module_hash)``
    ``inspect_model_cls`` calls it before it inspects a model class in a
    subprocess (seconds).  When ``<VLLM_CACHE_ROOT>/modelinfos/<file>``
    (``self._get_cache_dir()``, ``self._get_cache_filename()``) is absent,
    the wrapper restores that class's file (:mod:`adstore.integration.vllm.modelinfos`),
    then calls the original, which reads it.

``..._LazyRegisteredModel._save_modelinfo_to_cache(self, mi, module_hash)``
    After the original wrote the file, captures it.

vLLM 0.32.0's AOT load on CPU: ``_try_load_aot_compiled_fn`` ends with
``loaded_fn._artifacts.compiled_fn.finalize_loading(vllm_config)``, a method
only vLLM's own backend's artifact has.  On CPU vLLM compiles with the stock
``inductor`` backend, whose artifact is torch's
``BundledAOTAutogradSerializableCallable``: no such method, so every load
fails (``'function' object has no attribute 'finalize_loading'``) and vLLM
compiles again.  When vLLM imports ``vllm.compilation.decorators`` and its
load calls ``finalize_loading``, :func:`install` gives torch's class a
``finalize_loading`` that does nothing (:func:`_finalize_loading`: torch
loads that artifact whole when it unpickles it, there is nothing left to
finish), recorded and removed by :func:`uninstall` like the wrappers.  A
torch without that class, or one whose class has the method already, is
left alone (the first with one log line); a vLLM whose load does not call
it needs nothing.

Each function is wrapped when vLLM imports its module
(:func:`~adstore.integration.onimport.when_imported`; at once if it
already has): the ``LLM`` caller and the engine core never import
``vllm.compilation``, and importing it for them would cost each about 0.3 s.
A module that lacks what the hooks know leaves that hook out, with one log line.

Only directories in vLLM's own layout under ``VLLM_CACHE_ROOT`` are handled
(a user-chosen ``compilation_config.cache_dir`` is left alone); the hash is
vLLM's directory name, never computed again here.  The anchors are the
cache root, the vLLM package directory and ``sys.prefix``.

vLLM is imported only inside :func:`install` (``vllm`` and ``vllm.envs``,
which vLLM imported already): importing this module needs no vLLM.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import inspect
import logging
import os
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from adstore.integration import onimport
from adstore.integration.errors import failure_reason
from adstore.integration.inductor.entries import note_failure
from adstore.integration.placement.rule import trusted_uids
from adstore.integration.vllm import modelinfos, trees
from adstore.integration.vllm.layout import aot_layout, piecewise_layout, tighten

__all__ = ["install", "uninstall", "status"]

logger = logging.getLogger(__name__)

_ABSENT = object()
_WRAPPED = "__adstore_original__"


@dataclass
class _State:
    store: Any
    owns_store: bool
    envs: Any
    vllm_dir: str
    trusted: frozenset[int]
    patched: list[tuple[Any, str, Any]] = field(default_factory=list)
    cancels: list[Callable[[], None]] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def anchors(self) -> dict[str, str]:
        return {"cache_root": str(self.envs.VLLM_CACHE_ROOT), "vllm": self.vllm_dir, "sys_prefix": sys.prefix}

    def patch(self, owner: Any, name: str, make: Callable[[Any], Any]) -> None:
        """Replace ``owner.name`` by ``make(original)``, once; remembered for :func:`uninstall`."""
        with self.lock:
            current = getattr(owner, name)
            if getattr(current, _WRAPPED, None) is not None:
                return
            self.patched.append((owner, name, owner.__dict__.get(name, _ABSENT)))
            wrapper = make(current)
            setattr(wrapper, _WRAPPED, current)
            setattr(owner, name, wrapper)

    def add(self, owner: Any, name: str, value: Any) -> bool:
        """Give ``owner`` the attribute ``name`` it lacks, once; removed by :func:`uninstall`."""
        with self.lock:
            if any(name in c.__dict__ for c in getattr(owner, "__mro__", (owner,))):
                return False
            self.patched.append((owner, name, _ABSENT))
            setattr(owner, name, value)
            return True

    # -- the AOT path ---------------------------------------------------------------
    def restore_aot(self, path: str) -> None:
        layout = aot_layout(path, str(self.envs.VLLM_CACHE_ROOT))
        if layout is None or layout.shared_dir is None:
            return
        tighten(str(self.envs.VLLM_CACHE_ROOT), layout.rank_dir.parent, self.trusted)  # umask 002's, above the trees
        anchors = self.anchors()
        common = {"vllm_hash": layout.vllm_hash, "anchors": anchors, "trusted": self.trusted}
        shared = trees.restore(self.store, kind="aot_inductor", rank="shared", target=layout.shared_dir, **common)
        mine = trees.restore(self.store, kind="aot", rank=layout.rank, target=layout.rank_dir, **common)
        if mine.hit and shared.reason == "absent":  # it arrived while this rank waited for another host's build
            shared = trees.restore(self.store, kind="aot_inductor", rank="shared", target=layout.shared_dir, **common)
        logger.debug("adstore: vLLM AOT %s %s: inductor_cache %s, %s", layout.vllm_hash[:12], layout.rank, shared, mine)

    def capture_aot(self, model: Any) -> None:
        path = getattr(model, "_aot_compilation_path", None)
        if getattr(model, "was_aot_compile_fn_loaded_from_disk", False) or not path or not os.path.isfile(path):
            return
        layout = aot_layout(str(path), str(self.envs.VLLM_CACHE_ROOT))
        if layout is None or layout.shared_dir is None:
            return
        for tree in (layout.rank_dir, layout.shared_dir):  # vLLM's directories, made with the user's umask
            tighten(str(self.envs.VLLM_CACHE_ROOT), tree, self.trusted, inside=True)
        anchors = self.anchors()
        trees.capture(
            self.store,
            kind="aot",
            vllm_hash=layout.vllm_hash,
            rank=layout.rank,
            source=layout.rank_dir,
            anchors=anchors,
        )
        if layout.shared_dir.is_dir():
            trees.capture(
                self.store,
                kind="aot_inductor",
                vllm_hash=layout.vllm_hash,
                rank="shared",
                source=layout.shared_dir,
                anchors=anchors,
            )

    # -- model-class facts --------------------------------------------------------
    def modelinfo_file(self, model: Any) -> tuple[Path, str] | None:
        """vLLM's (directory, file name) of a lazily registered model's facts, in vLLM's layout only."""
        directory = Path(os.path.abspath(model._get_cache_dir()))
        if directory != Path(os.path.abspath(str(self.envs.VLLM_CACHE_ROOT))) / "modelinfos":
            return None
        return directory, str(model._get_cache_filename())

    def restore_modelinfo(self, model: Any, module_hash: Any) -> None:
        found = self.modelinfo_file(model)
        if found is None or not isinstance(module_hash, str) or os.path.lexists(found[0] / found[1]):
            return
        directory, filename = found
        anchors = self.anchors()
        got = modelinfos.restore(
            self.store,
            directory=directory,
            filename=filename,
            module_hash=module_hash,
            anchors=anchors,
            trusted=self.trusted,
        )
        logger.debug("adstore: vLLM modelinfo %s: %s", filename, got)

    def capture_modelinfo(self, model: Any, module_hash: Any) -> None:
        found = self.modelinfo_file(model)
        if found is not None and isinstance(module_hash, str):
            directory, filename = found
            modelinfos.capture(
                self.store, directory=directory, filename=filename, module_hash=module_hash, anchors=self.anchors()
            )

    # -- the piecewise path ---------------------------------------------------------
    def restore_piecewise(self, cache_dir: str, prefix: str) -> None:
        layout = piecewise_layout(cache_dir, prefix, str(self.envs.VLLM_CACHE_ROOT))
        if layout is not None:
            target = layout.rank_dir / prefix if prefix else layout.rank_dir
            tighten(str(self.envs.VLLM_CACHE_ROOT), target.parent, self.trusted)
            trees.restore(
                self.store,
                kind="piecewise",
                vllm_hash=layout.vllm_hash,
                rank=layout.rank,
                part=prefix,
                target=target,
                anchors=self.anchors(),
                trusted=self.trusted,
            )

    def capture_piecewise(self, cache_dir: str, prefix: str) -> None:
        layout = piecewise_layout(cache_dir, prefix, str(self.envs.VLLM_CACHE_ROOT))
        if layout is not None:
            source = layout.rank_dir / prefix if prefix else layout.rank_dir
            tighten(str(self.envs.VLLM_CACHE_ROOT), source, self.trusted, inside=True)
            trees.capture(
                self.store,
                kind="piecewise",
                vllm_hash=layout.vllm_hash,
                rank=layout.rank,
                part=prefix,
                source=source,
                anchors=self.anchors(),
            )


_lock = threading.Lock()
_state: _State | None = None
_status = "not installed"


def _note(exc: BaseException, what: str) -> None:
    state = _state
    note_failure(failure_reason(exc), f"{what}: {exc}", None if state is None else state.store, scope="vllm")


def _guarded(what: str, fn: Callable[[_State], None]) -> None:
    """Run an adstore step if the hooks are installed; any exception is a counted fail-open, never vLLM's."""
    state = _state
    if state is None:
        return
    try:
        fn(state)
    except Exception as exc:  # noqa: BLE001 - fail open: vLLM goes on as without adstore
        _note(exc, what)


def _wrap_aot_load(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def _try_load_aot_compiled_fn(model: Any, aot_compilation_path: Any, *args: Any, **kwargs: Any) -> Any:
        _guarded("AOT restore", lambda s: s.restore_aot(str(aot_compilation_path)))
        loaded = original(model, aot_compilation_path, *args, **kwargs)
        if loaded is None:
            _guarded("AOT save hook", lambda s: _watch_save(s, type(model)))
        return loaded

    return _try_load_aot_compiled_fn


def _watch_save(state: _State, cls: type) -> None:
    owner = next((c for c in cls.__mro__ if "save_aot_compiled_function" in c.__dict__), None)
    if owner is not None:
        state.patch(owner, "save_aot_compiled_function", _wrap_aot_save)


def _wrap_aot_save(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def save_aot_compiled_function(self: Any, *args: Any, **kwargs: Any) -> Any:
        result = original(self, *args, **kwargs)
        _guarded("AOT capture", lambda s: s.capture_aot(self))
        return result

    return save_aot_compiled_function


def _wrap_initialize_cache(original: Callable[..., Any]) -> Callable[..., Any]:
    signature = inspect.signature(original)

    @functools.wraps(original)
    def initialize_cache(self: Any, *args: Any, **kwargs: Any) -> Any:
        def restore(state: _State) -> None:
            bound = signature.bind(self, *args, **kwargs)
            bound.apply_defaults()
            if not bound.arguments["disable_cache"]:
                state.restore_piecewise(str(bound.arguments["cache_dir"]), str(bound.arguments["prefix"] or ""))

        _guarded("piecewise restore", restore)
        return original(self, *args, **kwargs)

    return initialize_cache


def _wrap_save_to_file(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def save_to_file(self: Any, *args: Any, **kwargs: Any) -> Any:
        updated = getattr(self, "is_cache_updated", False) is True and getattr(self, "disable_cache", True) is False
        result = original(self, *args, **kwargs)
        if updated:
            _guarded("piecewise capture", lambda s: s.capture_piecewise(str(self.cache_dir), str(self.prefix or "")))
        return result

    return save_to_file


def _wrap_modelinfo_load(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def _load_modelinfo_from_cache(self: Any, module_hash: Any, *args: Any, **kwargs: Any) -> Any:
        _guarded("modelinfo restore", lambda s: s.restore_modelinfo(self, module_hash))
        return original(self, module_hash, *args, **kwargs)

    return _load_modelinfo_from_cache


def _wrap_modelinfo_save(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def _save_modelinfo_to_cache(self: Any, mi: Any, module_hash: Any, *args: Any, **kwargs: Any) -> Any:
        result = original(self, mi, module_hash, *args, **kwargs)
        _guarded("modelinfo capture", lambda s: s.capture_modelinfo(self, module_hash))
        return result

    return _save_modelinfo_to_cache


#: (module, owner in it ("" for the module itself), function, wrapper maker): what is wrapped, per module.
HOOKS: tuple[tuple[str, str, str, Callable[[Callable[..., Any]], Callable[..., Any]]], ...] = (
    ("vllm.compilation.decorators", "", "_try_load_aot_compiled_fn", _wrap_aot_load),
    ("vllm.compilation.backends", "CompilerManager", "initialize_cache", _wrap_initialize_cache),
    ("vllm.compilation.backends", "CompilerManager", "save_to_file", _wrap_save_to_file),
    ("vllm.model_executor.models.registry", "_LazyRegisteredModel", "_load_modelinfo_from_cache", _wrap_modelinfo_load),
    ("vllm.model_executor.models.registry", "_LazyRegisteredModel", "_save_modelinfo_to_cache", _wrap_modelinfo_save),
)


def _finalize_loading(self: Any, *args: Any, **kwargs: Any) -> None:
    """Nothing to finish: torch's bundled AOTAutograd artifact is loaded whole when it is unpickled.

    (``BundledAOTAutogradSerializableCallable.deserialize_compile_artifacts``
    deserializes the entry and returns a callable ready to run; vLLM's own
    artifact builds its backend lazily, hence vLLM's call.)
    """


def _supply_finalize_loading(state: _State, module: Any) -> None:
    """Let vLLM's AOT load finish on CPU: torch's artifact class gets the no-op ``finalize_loading`` vLLM calls."""
    load = getattr(module, "_try_load_aot_compiled_fn", None)
    code = getattr(getattr(load, _WRAPPED, load), "__code__", None)
    if code is None or "finalize_loading" not in code.co_names:
        return  # this vLLM's load does not call it
    try:
        from torch._dynamo.aot_compile_types import BundledAOTAutogradSerializableCallable
    except ImportError as exc:
        note_failure(
            "incompatible_vllm",
            f"vLLM's AOT load calls finalize_loading, and torch's artifact class is not where adstore looks ({exc})",
            state.store,
            scope="vllm",
            fallback="vLLM's AOT load behaves as without adstore",
        )
        return
    if state.add(BundledAOTAutogradSerializableCallable, "finalize_loading", _finalize_loading):
        logger.info("adstore: torch's AOT artifact got the finalize_loading vLLM's AOT load calls (a no-op)")


def _vllm() -> tuple[Any, str]:
    """vLLM's ``envs`` module and package directory, or an ImportError naming what is missing (nothing else)."""
    if "vllm" not in sys.modules and importlib.util.find_spec("vllm") is None:
        raise ImportError("No module named 'vllm'")
    vllm = importlib.import_module("vllm")
    envs = importlib.import_module("vllm.envs")
    where = getattr(vllm, "__file__", None)
    if not isinstance(where, str):
        raise ImportError("vllm is a namespace package here, not an installed vLLM")
    return envs, os.path.dirname(os.path.abspath(where))


def _hook_module(state: _State, module: Any) -> None:
    """Wrap what :data:`HOOKS` names in ``module``, now that vLLM imported it; a missing piece is logged."""
    if _state is not state:
        return  # uninstalled (or installed again) since this waited
    for module_name, owner_name, name, make in HOOKS:
        if module_name != module.__name__:
            continue
        owner = getattr(module, owner_name, None) if owner_name else module
        if owner is None or not callable(getattr(owner, name, None)):
            where = f"{module_name}.{owner_name + '.' if owner_name else ''}{name}"
            note_failure(
                "incompatible_vllm",
                f"{where} is missing: this vLLM is not the one the hooks know",
                state.store,
                scope="vllm",
                fallback="vLLM works without this hook",
            )
            continue
        state.patch(owner, name, make)
    if module.__name__ == "vllm.compilation.decorators":
        try:
            _supply_finalize_loading(state, module)
        except Exception as exc:  # noqa: BLE001 - fail open: vLLM's load as without adstore
            _note(exc, "AOT finalize_loading")


def install(store: Any = None) -> bool:
    """Wrap vLLM's functions (see the module docstring) so its compile directories go through ``store``.

    The functions of a module vLLM has not imported yet are wrapped when it does.

    ``store``: a :class:`~adstore.store.Store` (kept open; the caller closes
    it), else the one ``ADSTORE_ROOT`` names (``Store.from_env``, closed by
    :func:`uninstall`).  Returns False, with one log line and nothing
    changed, when vLLM cannot be imported or no store can be opened;
    :func:`status` says why.
    """
    global _state, _status
    uninstall()
    try:
        envs, vllm_dir = _vllm()
    except Exception as exc:  # noqa: BLE001 - no vLLM (or another one): nothing to hook
        _status = f"vLLM not hooked: {type(exc).__name__}: {exc}"
        logger.info("adstore: %s", _status)
        return False
    try:
        from adstore.store import Store

        owns = store is None
        opened = Store.from_env() if store is None else store
        state = _State(opened, owns, envs, vllm_dir, trusted_uids())
    except Exception as exc:  # noqa: BLE001 - fail open: no store, no hooks
        _status = f"vLLM not hooked: no store ({type(exc).__name__}: {exc})"
        note_failure(failure_reason(exc), _status, scope="vllm", fallback="vLLM compiles")
        return False
    with _lock:
        _state = state
        _status = f"installed: vLLM's compile directories go through {opened}"
    for module_name in dict.fromkeys(hook[0] for hook in HOOKS):
        state.cancels.append(onimport.when_imported(module_name, functools.partial(_hook_module, state)))
    logger.info("adstore: %s", _status)
    return True


def uninstall() -> bool:
    """Put back every function :func:`install` (or a later compile) replaced; whether anything was installed."""
    global _state, _status
    with _lock:
        state, _state = _state, None
    if state is None:
        return False
    for cancel in state.cancels:
        cancel()
    with state.lock:
        for owner, name, original in reversed(state.patched):
            if original is _ABSENT:
                delattr(owner, name)
            else:
                setattr(owner, name, original)
        state.patched.clear()
    if state.owns_store:
        try:
            state.store.close()
        except Exception as exc:  # noqa: BLE001 - closing is best effort
            logger.debug("adstore: closing the store: %s", exc)
    _status = "not installed"
    return True


def status() -> str:
    """Whether the hooks are installed, or why :func:`install` left vLLM alone."""
    return _status
