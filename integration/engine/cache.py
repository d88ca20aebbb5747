"""Engine cache (the front end): compile once per architecture, refit the current weights on every hit.

``compile(model, example_inputs)`` exports the model, hashes its architecture
(:mod:`adstore.integration.engine.hashing`), and then

* on a hit loads the cached AOTInductor package (milliseconds) and swaps the
  model's weights in with ``load_constants``;
* on a miss compiles the package with the weights left out (tens of seconds),
  stores it through the backend, and refits it the same way.

Both paths end in the same refit, so a hit and a fresh compile run identical
code with identical weights. Anything wrong with a cached engine — truncated,
bit-flipped, written by another toolchain, expecting other constants — is a
miss with a named reason and a recompile, never an exception or a wrong answer.

An in-process layer keeps the packages of recently used engines (bounded LRU,
in a private temp directory deleted with the cache), so repeated compiles in
one process do not go back to the backend; a copy is re-checked against its
record's checksum before each load, and a changed one is refused. Every returned engine gets its own
loaded runner: refitting one engine never changes another's weights.
"""

from __future__ import annotations

import logging
import tempfile
import threading
import time
import weakref
from collections import Counter
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from adstore.integration.coordination.events import CacheEvent, EventKind, Source
from adstore.integration.engine.packages import PackageLRU
from adstore.integration.engine.record import EngineRecord, check_package_file
from adstore.integration.engine.request import Request, prepare
from adstore.integration.engine.runtime import (
    CompiledEngine,
    aoti_compile,
    build_meta,
    load_runner,
    record_components,
    refit,
    validate_meta,
    validate_runner,
)
from adstore.integration.engine.storage import EngineStorage, StoreEngineStorage
from adstore.integration.errors import ConfigError, EngineCacheError, EngineMismatch, UnsafeCacheDir, failure_reason
from adstore.integration.validity.envcheck import find_mismatch
from adstore.integration.validity.toolchain import STORAGE_SETTINGS
from adstore.store import AdstoreError, Reason

__all__ = ["CompiledEngine", "EngineCache", "compile", "default_engine_cache", "set_default_engine_cache"]

logger = logging.getLogger(__name__)

# --------------------------------------------------------------------------- front


class EngineCache:
    """Backend + in-process layer + the hit/miss/refit logic. Thread-safe; one per backend."""

    def __init__(
        self,
        backend: EngineStorage | None = None,
        *,
        memory_entries: int = 8,
        memory_bytes: int = 1 << 30,
        tmp_dir: str | None = None,
    ) -> None:
        if memory_entries < 0 or memory_bytes < 0:
            raise ConfigError("memory_entries", "in-process cache bounds must be >= 0")
        self._backend = backend
        #: Why the cache steps aside in this process (None while it works): no private directory, no store.
        self._off: tuple[Reason, str] | None = None
        # Packages are native code: they are written and loaded only in a private directory.  Where the system
        # temp directory cannot hold one (world-writable without the sticky bit), the cache steps aside and
        # every compile is AOTInductor's own, uncached (``bypasses.unsafe_root``), as plain torch would run there.
        self._memory: PackageLRU | None = None
        try:
            self._memory = PackageLRU(max_entries=memory_entries, max_bytes=memory_bytes, tmp_root=tmp_dir)
        except UnsafeCacheDir as exc:
            self._step_aside(Reason.UNSAFE_ROOT, f"no private directory: {exc}")
        self.counters: Counter[str] = Counter()
        self._lock = threading.Lock()

    @classmethod
    def from_config(cls, config: Mapping[str, Any], backend: EngineStorage | None = None) -> EngineCache:
        known = {"memory_entries", "memory_bytes", "tmp_dir"}
        unknown = set(config) - known
        if unknown:
            raise ConfigError(",".join(sorted(unknown)), "unknown engine cache option")
        return cls(backend, **{k: config[k] for k in known if k in config})

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> EngineCache:
        """Store backend from ``ADSTORE_ROOT``/``ADSTORE_ENGINE_MAX_SIZE``; read at call time."""
        return cls(StoreEngineStorage.from_env(environ))

    @property
    def backend(self) -> EngineStorage:
        with self._lock:
            if self._backend is None:
                self._backend = StoreEngineStorage.from_env()
            return self._backend

    def clear_memory(self) -> None:
        if self._memory is not None:
            self._memory.clear()

    def close(self) -> None:
        if self._memory is not None:
            self._memory.close()

    def _step_aside(self, reason: Reason, detail: str) -> None:
        self._off = (reason, detail)
        logger.warning("engine cache off in this process (%s), engines compile uncached: %s", reason, detail)

    def _why_off(self) -> tuple[Reason, str] | None:
        """Why this cache cannot serve or store here (it then steps aside for good), or None.

        The default store is opened here, on first use: a root that cannot be a
        store (a file, a disk that cannot hold one, ...) turns the cache off in
        this process, where a backend the caller gave is never second-guessed.
        """
        if self._off is None and self._backend is None:
            try:
                _ = self.backend  # opens the default store
            except Exception as exc:  # noqa: BLE001 - fail open: no store, compiled as without adstore
                self._step_aside(Reason(failure_reason(exc, Reason.STORE_ERROR)), f"no store: {exc}")
        return self._off

    @property
    def _packages(self) -> PackageLRU:
        """The in-process layer; :meth:`compile` and :meth:`lookup` step aside before a hit or a miss without it."""
        assert self._memory is not None, "no private directory: the engine cache is off in this process"
        return self._memory

    def _count(self, key: str) -> None:
        with self._lock:
            self.counters[key] += 1

    # -- the API -----------------------------------------------------------
    def compile(
        self,
        model: Any,
        example_inputs: Any,
        *,
        ignore_engine_cache: bool = False,
        dynamic_shapes: Any = None,
        **settings: Any,
    ) -> CompiledEngine:
        """See :func:`compile`."""
        req = prepare(model, example_inputs, dynamic_shapes, settings)
        off = self._why_off()
        if off is not None:
            return self._compile_uncached(req, *off)
        if req.hash is None:
            miss_reason, detail = Reason.BYPASS, "unhashable graph"
        else:
            miss_reason, detail = Reason.IGNORED, "ignore_engine_cache=True"
        if req.hash is not None and not ignore_engine_cache:
            engine, miss_reason, detail = self._try_hit(req)
            if engine is not None:
                engine.timings["total"] = time.perf_counter() - req.start
                return engine
        return self._compile_miss(req, miss_reason, detail)

    def lookup(
        self, model: Any, example_inputs: Any, *, dynamic_shapes: Any = None, **settings: Any
    ) -> tuple[CompiledEngine | None, CacheEvent]:
        """A refit engine from the cache, or None and the miss event; never compiles."""
        req = prepare(model, example_inputs, dynamic_shapes, settings)
        if req.hash is None:
            return None, CacheEvent(EventKind.BYPASS, reason=Reason.BYPASS, detail="unhashable graph")
        off = self._why_off()
        if off is not None:
            return None, CacheEvent(EventKind.BYPASS, reason=off[0], detail=off[1])
        engine, reason, detail = self._try_hit(req)
        if engine is not None:
            return engine, engine.event
        self._count(f"misses.{reason}")
        self.backend.record_event(EventKind.MISS, reason)
        return None, CacheEvent(EventKind.MISS, reason=reason, key=req.hash, detail=detail)

    # -- hit ---------------------------------------------------------------
    def _try_hit(self, req: Request) -> tuple[CompiledEngine | None, Reason | None, str]:
        h = req.hash
        assert h is not None
        ep, weights, spec, timings = req.ep, req.weights, req.spec, req.timings
        inductor_configs = req.inductor_configs
        t0 = time.perf_counter()
        source = Source.MEMORY
        cached = self._packages.get(h)
        record: EngineRecord | None = None
        backend = self.backend
        if cached is None:
            source = Source.BACKEND
            try:
                record = backend.load_record(h)
            except (EngineCacheError, AdstoreError) as exc:
                return self._miss(h, exc.reason, str(exc))
            except Exception as exc:  # noqa: BLE001 - a user backend's bug is a miss, not a crash
                logger.exception("engine backend %r failed to load %s", backend, h)
                return self._miss(h, Reason.BACKEND_ERROR, f"{type(exc).__name__}: {exc}")
            if record is None:
                return self._miss(h, *self._why_absent(req))
            if record.transferred is not None:  # the backend's store restored it from the remote tier just now
                source = Source.REMOTE
            meta = record.meta
        else:
            meta = cached[0]
            backend.touch(h)
        timings["fetch"] = time.perf_counter() - t0
        try:
            validate_meta(meta, h, ep, spec, inductor_configs, req.components)
            if record is not None:
                backend.check_loadable(record)  # native code: only from trusted writers
                path = record.payload_path if record.payload_path is not None else None
                if path is None:
                    path = self._packages.new_path()
                    path.write_bytes(record.payload_bytes())
                record.owns_path = False  # the in-process layer adopts the file
                path = self._packages.put(h, meta, path)
            else:
                path = cached[1]  # type: ignore[index]
                check_package_file(path, meta)  # native code: re-checked before every load of the copy
            t1 = time.perf_counter()
            runner = load_runner(path)
            timings["load"] = time.perf_counter() - t1
            validate_runner(runner, meta)
            timings["refit"] = refit(runner, weights, spec)
        except Exception as exc:  # noqa: BLE001 - a package the loader rejects is a miss
            self._packages.discard(h)
            why = exc.reason if isinstance(exc, EngineCacheError) else Reason.LOAD_FAILED
            if source == Source.MEMORY:
                # The private copy went bad (changed, removed by a tmp cleaner, ...): refused, ask the backend.
                logger.warning("in-process engine copy of %s refused (%s: %s); reading the backend", h[:12], why, exc)
                self._count(f"memory_refused.{why}")
                engine, reason, detail = self._try_hit(req)
                if engine is None and reason == Reason.ABSENT:  # the backend no longer has it: say why
                    return self._miss(h, why, f"in-process copy refused: {exc}")
                return engine, reason, detail
            if isinstance(exc, EngineCacheError):
                return self._miss(h, why, str(exc))
            return self._miss(h, Reason.LOAD_FAILED, f"{type(exc).__name__}: {exc}")
        finally:
            if record is not None:
                record.release()
        elapsed = time.perf_counter() - t0
        saved = max(0.0, float(meta.get("compile_seconds") or 0.0) - elapsed)
        self._count(f"hits.{source}")
        backend.record_event(EventKind.HIT, seconds_saved=saved)
        event = CacheEvent(
            EventKind.HIT,
            key=h,
            source=source,
            seconds=elapsed,
            seconds_saved=saved,
            transferred=(record.transferred or 0) if record is not None else 0,
        )
        logger.info("engine cache hit %s from %s (%.3fs, ~%.1fs saved)", h[:12], source, elapsed, saved)
        engine = req.engine(runner, hash=h, meta=meta, event=event, timings=timings)
        return engine, None, ""

    def _why_absent(self, req: Request) -> tuple[Reason, str]:
        """``incompatible_env`` naming the fields when the back end holds this request built elsewhere.

        The engine found has another hash and is never loaded; the diagnosis only
        names the reason (docs/pipeline-cache.md, "Environment checks").
        """
        try:
            found = find_mismatch(
                self.backend.stored_components(exclude=req.hash),
                record_components(req.components),
                env=("toolchain",),
                derived=("settings.inductor_config",),
            )
        except Exception as exc:  # noqa: BLE001 - a diagnosis never fails the lookup
            logger.debug("no environment diagnosis for %s: %s", req.hash, exc)
            return Reason.ABSENT, ""
        return (Reason.ABSENT, "") if found is None else (Reason.INCOMPATIBLE_ENV, found.message())

    def _miss(self, h: str, reason: Reason, detail: str) -> tuple[None, Reason, str]:
        if reason != Reason.ABSENT:
            logger.warning("engine cache miss for %s (%s): %s", h[:12], reason, detail)
        return None, reason, detail

    # -- miss --------------------------------------------------------------
    def _compile_and_load(
        self, ep: Any, path: Path, inductor_configs: dict[str, Any], timings: dict[str, float]
    ) -> Any:
        """AOTInductor-compile ``ep`` into ``path`` and load it, compiling once more if it is unreadable.

        Processes compiling the same graph share Inductor's on-disk cache, and
        not every file there is written atomically: a package packed while
        another process rewrote one of them does not load.  The race is
        transient, so a second compile is the remedy; a second failure raises.
        """
        for attempt in (1, 2):
            t0 = time.perf_counter()
            # A copy: the compiler writes into the dict it is given.
            aoti_compile(ep, path, dict(inductor_configs))
            timings["compile"] = time.perf_counter() - t0
            self._count("compiles")
            t1 = time.perf_counter()
            try:
                runner = load_runner(path)
            except RuntimeError as exc:
                if attempt == 2:
                    raise
                logger.warning("compiled engine package did not load (%s); compiling again", exc)
                continue
            timings["load"] = time.perf_counter() - t1
            return runner
        raise AssertionError("unreachable")

    def _compile_miss(self, req: Request, reason: Reason | None, detail: str) -> CompiledEngine:
        h, ep, weights, spec, timings = req.hash, req.ep, req.weights, req.spec, req.timings
        inductor_configs, components = req.inductor_configs, req.components
        backend = self.backend
        path = self._packages.new_path()
        try:
            runner = self._compile_and_load(ep, path, inductor_configs, timings)
            compile_seconds = timings["compile"]
            timings["refit"] = refit(runner, weights, spec)
        except EngineMismatch as exc:
            path.unlink(missing_ok=True)
            logger.warning("engine %s cannot be refit (%s); compiling with weights, not cached", req.hash, exc)
            return self._compile_uncached(req, Reason.UNREFITTABLE, str(exc))
        except BaseException:
            path.unlink(missing_ok=True)
            raise
        meta = build_meta(h, ep, spec, inductor_configs, components, runner, compile_seconds)
        saved = False
        if h is not None:
            record = EngineRecord.create(h, meta, path.read_bytes())
            meta = record.meta
            t2 = time.perf_counter()
            try:
                backend.save_record(record)
                saved = True
                self._count("saves")
            except Exception as exc:  # noqa: BLE001 - a failed save costs the next run a compile, nothing else
                self._count("save_failures")
                why = getattr(exc, "reason", None) or Reason.SAVE_FAILED
                logger.warning("could not save engine %s (%s): %s", h[:12], why, exc)
                backend.record_event(EventKind.BYPASS, why)
            timings["save"] = time.perf_counter() - t2
            self._packages.put(h, meta, path)
            self._count(f"misses.{reason}")
            backend.record_event(EventKind.MISS, reason)
            kind = EventKind.MISS
        else:
            path.unlink(missing_ok=True)  # the runner has extracted what it needs
            self._count(f"bypasses.{reason}")
            kind = EventKind.BYPASS
        event = CacheEvent(
            kind, reason=reason, key=h, source=Source.COMPILED, detail=detail, seconds=compile_seconds, saved=saved
        )
        logger.info("engine cache %s (%s): compiled %s in %.1fs", kind, reason, h and h[:12], compile_seconds)
        engine = req.engine(runner, hash=h, meta=meta, event=event, timings=timings)
        engine.timings["total"] = time.perf_counter() - req.start
        return engine

    def _compile_uncached(self, req: Request, reason: Reason, detail: str) -> CompiledEngine:
        """Fail-open path: AOTInductor's own package, weights inside, cached nowhere; a bypass counted by ``reason``.

        Taken for a graph whose compiled constants the weights cannot fill
        (``unrefittable``: a weight-free package would be unusable) and where
        no private directory exists for the cache's packages (``unsafe_root``:
        the package is then written where plain torch writes its own).
        """
        options = {k: v for k, v in req.inductor_configs.items() if k not in STORAGE_SETTINGS}
        with tempfile.TemporaryDirectory(dir=self._memory.dir if self._memory is not None else None) as tmp:
            pkg = Path(tmp) / "engine.pt2"
            t0 = time.perf_counter()
            aoti_compile(req.ep, pkg, options)
            seconds = time.perf_counter() - t0
            runner = load_runner(pkg)
        self._count(f"bypasses.{reason}")
        if self._backend is not None:  # none when the default store could not be opened
            self._backend.record_event(EventKind.BYPASS, reason)
        event = CacheEvent(
            EventKind.BYPASS, reason=reason, key=req.hash, source=Source.COMPILED, detail=detail, seconds=seconds
        )
        meta = {"constants": req.spec, "payload": {"weights_included": True}}
        return req.engine(runner, hash=None, meta=meta, event=event, timings={**req.timings, "compile": seconds})


# --------------------------------------------------------------------------- module API

_default_cache: EngineCache | None = None
_default_lock = threading.Lock()
_fronts: weakref.WeakKeyDictionary[EngineStorage, EngineCache] = weakref.WeakKeyDictionary()


def default_engine_cache() -> EngineCache:
    """The process-wide cache on the default store (opened on first use, from the environment)."""
    global _default_cache
    with _default_lock:
        if _default_cache is None:
            _default_cache = EngineCache()
        return _default_cache


def set_default_engine_cache(cache: EngineCache | EngineStorage | None) -> None:
    """Replace the process-wide cache (a backend is wrapped in a new EngineCache)."""
    global _default_cache
    with _default_lock:
        _default_cache = cache if cache is None or isinstance(cache, EngineCache) else EngineCache(cache)


def _front_for(engine_cache: EngineCache | EngineStorage | None) -> EngineCache:
    if engine_cache is None:
        return default_engine_cache()
    if isinstance(engine_cache, EngineCache):
        return engine_cache
    if not isinstance(engine_cache, EngineStorage):
        raise TypeError(f"engine_cache must be an EngineCache or EngineStorage, got {type(engine_cache).__name__}")
    with _default_lock:
        front = _fronts.get(engine_cache)
        if front is None:
            front = EngineCache(engine_cache)
            _fronts[engine_cache] = front
        return front


def compile(
    model_or_exported_program: Any,
    example_inputs: Any,
    *,
    ignore_engine_cache: bool = False,
    engine_cache: EngineCache | EngineStorage | None = None,
    dynamic_shapes: Any = None,
    **settings: Any,
) -> CompiledEngine:
    """Compile to an AOTInductor engine, reusing a cached engine of the same architecture.

    ``settings`` are inductor options (dotted names via ``**{"cpp.simdlen": 8}``);
    they are part of the hash. ``ignore_engine_cache=True`` compiles anyway and
    overwrites the stored engine. ``engine_cache`` is an :class:`EngineCache`, a
    backend (wrapped in one in-process layer per backend object), or None for the
    default store. The caller's model and weights are never modified.
    """
    front = _front_for(engine_cache)
    return front.compile(
        model_or_exported_program,
        example_inputs,
        ignore_engine_cache=ignore_engine_cache,
        dynamic_shapes=dynamic_shapes,
        **settings,
    )
