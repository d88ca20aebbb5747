"""Engine cache: compile once per architecture, refit the current weights on every hit.

``compile(model, example_inputs)`` exports the model, hashes its architecture
(:mod:`adstore.integration.engine_hash`), and then

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
one process do not go back to the backend. Every returned engine gets its own
loaded runner: refitting one engine never changes another's weights.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import os
import shutil
import tempfile
import threading
import time
import weakref
from collections import Counter, OrderedDict
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch.export.graph_signature import ExportGraphSignature, InputKind, InputSpec

from adstore.integration.engine_backends import AdstoreEngineCache, BaseEngineCache, EngineRecord
from adstore.integration.engine_hash import (
    _call_spec,
    canonical_json,
    effective_inductor_configs,
    hash_components,
    toolchain_identity,
)
from adstore.integration.errors import CacheKeyError, ConfigError, EngineCacheError, EngineMismatch
from adstore.store.errors import AdstoreError

__all__ = ["CompiledEngine", "EngineCache", "EngineEvent", "compile", "default_engine_cache", "set_default_engine_cache"]

logger = logging.getLogger(__name__)

ENGINE_KIND = "aoti_package"


@dataclasses.dataclass(frozen=True)
class EngineEvent:
    """What the cache did for one compile() call (also counted in the backend's stats)."""

    kind: str  # "hit" | "miss" | "bypass"
    hash: str | None
    source: str  # "memory" | "backend" | "compiled"
    reason: str | None = None
    detail: str = ""
    seconds: float = 0.0
    saved: bool = False


def _as_tuple(x: Any) -> tuple[Any, ...]:
    if isinstance(x, tuple):
        return x
    if isinstance(x, list):
        return tuple(x)
    return (x,)


# --------------------------------------------------------------------------- weights


def _constants_as_buffers(ep: torch.export.ExportedProgram) -> torch.export.ExportedProgram:
    """Lifted tensor constants become non-persistent buffers (same fqn, same value).

    AOTInductor renames plain tensor constants (``_tensor_constant0``) but keeps
    buffer fqns, so after this every constant of the package has a name the refit
    can supply. The caller's program is not modified.
    """
    specs = ep.graph_signature.input_specs
    if not any(s.kind == InputKind.CONSTANT_TENSOR for s in specs):
        return ep
    new_specs = [
        InputSpec(kind=InputKind.BUFFER, arg=s.arg, target=s.target, persistent=False)
        if s.kind == InputKind.CONSTANT_TENSOR
        else s
        for s in specs
    ]
    sig = ExportGraphSignature(input_specs=new_specs, output_specs=list(ep.graph_signature.output_specs))
    return ep._update(ep.graph_module, sig)


def _weights_of(ep: torch.export.ExportedProgram) -> dict[str, torch.Tensor]:
    """fqn -> tensor for every parameter, buffer and tensor constant the graph reads."""
    out: dict[str, torch.Tensor] = {}
    for spec in ep.graph_signature.input_specs:
        if spec.kind in (InputKind.PARAMETER, InputKind.BUFFER, InputKind.CONSTANT_TENSOR):
            value = ep.state_dict.get(spec.target)
            if value is None:
                value = ep.constants.get(spec.target)
            if isinstance(value, torch.Tensor):
                out[str(spec.target)] = value
    return out


def _code_constant_names(ep: torch.export.ExportedProgram) -> list[str]:
    return [str(s.target) for s in ep.graph_signature.input_specs if s.kind == InputKind.CONSTANT_TENSOR]


def _constants_spec(weights: Mapping[str, torch.Tensor]) -> list[dict[str, Any]]:
    return [
        {"fqn": k, "shape": list(t.shape), "dtype": str(t.dtype), "stride": list(t.stride()), "device": t.device.type}
        for k, t in sorted(weights.items())
    ]


def _weights_from(source: Any) -> dict[str, torch.Tensor]:
    if isinstance(source, torch.export.ExportedProgram):
        return _weights_of(source)
    if isinstance(source, torch.nn.Module):
        return dict(source.state_dict(keep_vars=True))
    if isinstance(source, Mapping):
        return {str(k): v for k, v in source.items()}
    raise TypeError(f"cannot take weights from {type(source).__name__}")


def _refit(runner: Any, weights: Mapping[str, torch.Tensor], spec: list[dict[str, Any]]) -> float:
    """Load ``weights`` into ``runner``, in the exact layout the engine was compiled for."""
    by_name = {c["fqn"]: c for c in spec}
    fqns = list(runner.get_constant_fqns())
    cmap: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        for fqn in fqns:
            want = by_name.get(fqn)
            t = weights.get(fqn)
            if want is None or t is None:
                raise EngineMismatch("constants", f"engine needs {fqn!r}, which the model does not have")
            t = t.detach()
            if list(t.shape) != want["shape"] or str(t.dtype) != want["dtype"]:
                raise EngineMismatch(
                    "constants",
                    f"{fqn}: engine expects {want['dtype']}{want['shape']}, got {t.dtype}{list(t.shape)}",
                )
            if list(t.stride()) != want["stride"]:
                # The kernels index constants with the compiled strides; load_constants
                # clones with the source's strides, so re-lay the data out first.
                t = torch.empty_strided(want["shape"], want["stride"], dtype=t.dtype, device=t.device).copy_(t)
            cmap[fqn] = t
    start = time.perf_counter()
    runner.load_constants(cmap, check_full_update=True)
    return time.perf_counter() - start


def _load_runner(path: Path) -> Any:
    return torch._inductor.aoti_load_package(str(path))


# --------------------------------------------------------------------------- engine


class CompiledEngine:
    """A loaded, refit engine; call it like the model. ``event`` says how it was obtained."""

    def __init__(
        self,
        runner: Any,
        *,
        hash: str | None,
        meta: Mapping[str, Any],
        event: EngineEvent,
        code_constants: Mapping[str, torch.Tensor],
        timings: Mapping[str, float],
    ) -> None:
        self._runner = runner
        self.hash = hash
        self.meta = dict(meta)
        self.event = event
        self._code_constants = dict(code_constants)
        self.timings = dict(timings)

    @property
    def source(self) -> str:
        return self.event.source

    @property
    def constant_names(self) -> list[str]:
        return sorted(self._runner.get_constant_fqns())

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._runner(*args, **kwargs)

    def refit(self, weights: Any) -> float:
        """Swap in new weights (an nn.Module, ExportedProgram or fqn->tensor mapping); returns seconds.

        Tensor constants written in ``forward`` are part of the architecture and are
        kept; every other constant must be given. Raises EngineMismatch on a missing
        name, shape or dtype (nothing is loaded then).
        """
        merged = {**self._code_constants, **_weights_from(weights)}
        return _refit(self._runner, merged, self.meta["constants"])

    def __repr__(self) -> str:
        return f"CompiledEngine(hash={self.hash and self.hash[:12]}, source={self.source})"


# --------------------------------------------------------------------------- in-process layer


class _PackageLRU:
    """Recently used packages (metadata + a private temp file), bounded by count and bytes."""

    def __init__(self, *, max_entries: int, max_bytes: int, tmp_root: str | None = None) -> None:
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self.dir = Path(tempfile.mkdtemp(prefix="adstore-engines-", dir=tmp_root))
        self._finalizer = weakref.finalize(self, shutil.rmtree, str(self.dir), True)
        self._items: OrderedDict[str, tuple[dict[str, Any], Path, int]] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, h: str) -> tuple[dict[str, Any], Path] | None:
        with self._lock:
            item = self._items.get(h)
            if item is None:
                return None
            if not item[1].exists():  # removed behind our back: forget it
                del self._items[h]
                return None
            self._items.move_to_end(h)
            return item[0], item[1]

    def new_path(self, suffix: str = ".pt2") -> Path:
        fd, name = tempfile.mkstemp(suffix=suffix, dir=self.dir)
        os.close(fd)
        return Path(name)

    def put(self, h: str, meta: dict[str, Any], path: Path) -> Path:
        """Adopt ``path`` (moved into the private directory) as the package of ``h``."""
        if path.parent != self.dir:
            dest = self.new_path()
            shutil.move(str(path), dest)
            path = dest
        size = path.stat().st_size
        with self._lock:
            old = self._items.pop(h, None)
            if old is not None and old[1] != path:
                old[1].unlink(missing_ok=True)
            self._items[h] = (meta, path, size)
            self._evict_locked()
        return path

    def discard(self, h: str) -> None:
        with self._lock:
            item = self._items.pop(h, None)
        if item is not None:
            item[1].unlink(missing_ok=True)

    def _evict_locked(self) -> None:
        while self._items and (
            len(self._items) > self.max_entries or sum(i[2] for i in self._items.values()) > self.max_bytes
        ):
            _h, (_m, path, _s) = self._items.popitem(last=False)
            path.unlink(missing_ok=True)

    def __contains__(self, h: object) -> bool:
        return h in self._items

    def __len__(self) -> int:
        return len(self._items)

    def close(self) -> None:
        with self._lock:
            self._items.clear()
        self._finalizer()


# --------------------------------------------------------------------------- front


class EngineCache:
    """Backend + in-process layer + the hit/miss/refit logic. Thread-safe; one per backend."""

    def __init__(
        self,
        backend: BaseEngineCache | None = None,
        *,
        memory_entries: int = 8,
        memory_bytes: int = 1 << 30,
        tmp_dir: str | None = None,
    ) -> None:
        if memory_entries < 0 or memory_bytes < 0:
            raise ConfigError("memory_entries", "in-process cache bounds must be >= 0")
        self._backend = backend
        self._memory = _PackageLRU(max_entries=memory_entries, max_bytes=memory_bytes, tmp_root=tmp_dir)
        self.counters: Counter[str] = Counter()
        self._lock = threading.Lock()

    @classmethod
    def from_config(cls, config: Mapping[str, Any], backend: BaseEngineCache | None = None) -> EngineCache:
        known = {"memory_entries", "memory_bytes", "tmp_dir"}
        unknown = set(config) - known
        if unknown:
            raise ConfigError(",".join(sorted(unknown)), "unknown engine cache option")
        return cls(backend, **{k: config[k] for k in known if k in config})

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> EngineCache:
        """Store backend from ``ADSTORE_ROOT``/``ADSTORE_ENGINE_MAX_SIZE``; read at call time."""
        return cls(AdstoreEngineCache.from_env(environ))

    @property
    def backend(self) -> BaseEngineCache:
        with self._lock:
            if self._backend is None:
                self._backend = AdstoreEngineCache.from_env()
            return self._backend

    def memory_contains(self, h: str) -> bool:
        return h in self._memory

    def clear_memory(self) -> None:
        for h in list(self._memory._items):
            self._memory.discard(h)

    def close(self) -> None:
        self._memory.close()

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
        start = time.perf_counter()
        example_inputs = _as_tuple(example_inputs)
        inductor_configs = effective_inductor_configs(settings)  # bad settings: a clear ConfigError
        if isinstance(model, torch.export.ExportedProgram):
            ep = model
        elif isinstance(model, torch.nn.Module):
            ep = torch.export.export(model, example_inputs, dynamic_shapes=dynamic_shapes)
        else:
            raise TypeError(f"compile() takes an nn.Module or ExportedProgram, got {type(model).__name__}")
        export_seconds = time.perf_counter() - start
        try:
            components = hash_components(ep, example_inputs, settings=settings, dynamic_shapes=dynamic_shapes)
            h: str | None = hashlib.sha256(canonical_json(components).encode()).hexdigest()
        except CacheKeyError as exc:
            logger.warning("engine cache bypass (%s): %s", exc.reason, exc)
            h, components = None, {}
        code_consts = {k: v for k, v in _weights_of(ep).items() if k in set(_code_constant_names(ep))}
        ep = _constants_as_buffers(ep)
        weights = _weights_of(ep)
        spec = _constants_spec(weights)
        timings = {"export": export_seconds}

        miss_reason, detail = ("bypass", "unhashable graph") if h is None else ("ignored", "ignore_engine_cache=True")
        if h is not None and not ignore_engine_cache:
            engine, miss_reason, detail = self._try_hit(h, ep, weights, spec, inductor_configs, code_consts, timings)
            if engine is not None:
                engine.timings["total"] = time.perf_counter() - start
                return engine
        return self._compile_miss(
            h, ep, weights, spec, inductor_configs, code_consts, components, timings, miss_reason, detail, start
        )

    # -- hit ---------------------------------------------------------------
    def _try_hit(
        self,
        h: str,
        ep: torch.export.ExportedProgram,
        weights: dict[str, torch.Tensor],
        spec: list[dict[str, Any]],
        inductor_configs: dict[str, Any],
        code_consts: dict[str, torch.Tensor],
        timings: dict[str, float],
    ) -> tuple[CompiledEngine | None, str, str]:
        t0 = time.perf_counter()
        source = "memory"
        cached = self._memory.get(h)
        record: EngineRecord | None = None
        backend = self.backend
        if cached is None:
            source = "backend"
            try:
                record = backend.load_record(h)
            except (EngineCacheError, AdstoreError) as exc:
                return self._miss(h, exc.reason, str(exc))
            except Exception as exc:  # noqa: BLE001 - a user backend's bug is a miss, not a crash
                logger.exception("engine backend %r failed to load %s", backend, h)
                return self._miss(h, "backend_error", f"{type(exc).__name__}: {exc}")
            if record is None:
                return self._miss(h, "absent", "")
            meta = record.meta
        else:
            meta = cached[0]
            backend.touch(h)
        timings["fetch"] = time.perf_counter() - t0
        try:
            _validate_meta(meta, h, ep, spec, inductor_configs)
            if record is not None:
                path = record.payload_path if record.payload_path is not None else None
                if path is None:
                    path = self._memory.new_path()
                    path.write_bytes(record.payload_bytes())
                record.owns_path = False  # the in-process layer adopts the file
                path = self._memory.put(h, meta, path)
            else:
                path = cached[1]  # type: ignore[index]
            t1 = time.perf_counter()
            runner = _load_runner(path)
            timings["load"] = time.perf_counter() - t1
            _validate_runner(runner, meta)
            timings["refit"] = _refit(runner, weights, spec)
        except EngineCacheError as exc:
            self._memory.discard(h)
            return self._miss(h, exc.reason, str(exc))
        except Exception as exc:  # noqa: BLE001 - a package the loader rejects is a miss
            self._memory.discard(h)
            return self._miss(h, "load_failed", f"{type(exc).__name__}: {exc}")
        finally:
            if record is not None:
                record.release()
        elapsed = time.perf_counter() - t0
        saved = max(0.0, float(meta.get("compile_seconds") or 0.0) - elapsed)
        self._count(f"hits.{source}")
        backend.record_event("hit", seconds_saved=saved)
        event = EngineEvent("hit", h, source, seconds=elapsed)
        logger.info("engine cache hit %s from %s (%.3fs, ~%.1fs saved)", h[:12], source, elapsed, saved)
        engine = CompiledEngine(runner, hash=h, meta=meta, event=event, code_constants=code_consts, timings=timings)
        return engine, "", ""

    def _miss(self, h: str, reason: str, detail: str) -> tuple[None, str, str]:
        if reason != "absent":
            logger.warning("engine cache miss for %s (%s): %s", h[:12], reason, detail)
        return None, reason, detail

    # -- miss --------------------------------------------------------------
    def _compile_miss(
        self,
        h: str | None,
        ep: torch.export.ExportedProgram,
        weights: dict[str, torch.Tensor],
        spec: list[dict[str, Any]],
        inductor_configs: dict[str, Any],
        code_consts: dict[str, torch.Tensor],
        components: Mapping[str, Any],
        timings: dict[str, float],
        reason: str,
        detail: str,
        start: float,
    ) -> CompiledEngine:
        backend = self.backend
        path = self._memory.new_path()
        t0 = time.perf_counter()
        # A copy: the compiler writes into the dict it is given.
        torch._inductor.aoti_compile_and_package(ep, package_path=str(path), inductor_configs=dict(inductor_configs))
        compile_seconds = time.perf_counter() - t0
        timings["compile"] = compile_seconds
        self._count("compiles")
        runner = _load_runner(path)
        timings["refit"] = _refit(runner, weights, spec)
        meta = _build_meta(h, ep, spec, inductor_configs, components, runner, compile_seconds)
        saved = False
        if h is not None:
            record = EngineRecord.create(h, meta, path.read_bytes())
            meta = record.meta
            try:
                backend.save_record(record)
                saved = True
                self._count("saves")
            except Exception as exc:  # noqa: BLE001 - a failed save costs the next run a compile, nothing else
                self._count("save_failures")
                logger.warning("could not save engine %s (%s): %s", h[:12], getattr(exc, "reason", "error"), exc)
                backend.record_event("bypass", getattr(exc, "reason", "save_failed"))
            self._memory.put(h, meta, path)
            self._count(f"misses.{reason}")
            backend.record_event("miss", reason)
            kind = "miss"
        else:
            self._count(f"bypasses.{reason}")
            kind = "bypass"
        event = EngineEvent(kind, h, "compiled", reason=reason, detail=detail, seconds=compile_seconds, saved=saved)
        logger.info("engine cache %s (%s): compiled %s in %.1fs", kind, reason, h and h[:12], compile_seconds)
        engine = CompiledEngine(runner, hash=h, meta=meta, event=event, code_constants=code_consts, timings=timings)
        engine.timings["total"] = time.perf_counter() - start
        return engine


def _io_meta(ep: torch.export.ExportedProgram) -> tuple[list[Any], list[Any]]:
    def render(node: Any) -> dict[str, Any]:
        val = node.meta.get("val")
        if isinstance(val, torch.Tensor):
            return {"name": node.name, "shape": [str(d) for d in val.shape], "dtype": str(val.dtype)}
        return {"name": node.name, "type": type(val).__name__}

    users = set(ep.graph_signature.user_inputs)
    inputs = [render(n) for n in ep.graph.nodes if n.op == "placeholder" and n.name in users]
    out_node = next(n for n in ep.graph.nodes if n.op == "output")
    outs = [render(a) for a in out_node.args[0] if isinstance(a, torch.fx.Node)]
    return inputs, outs


def _build_meta(
    h: str | None,
    ep: torch.export.ExportedProgram,
    spec: list[dict[str, Any]],
    inductor_configs: dict[str, Any],
    components: Mapping[str, Any],
    runner: Any,
    compile_seconds: float,
) -> dict[str, Any]:
    inputs, outputs = _io_meta(ep)
    return {
        "kind": ENGINE_KIND,
        "created": time.time(),
        "compile_seconds": compile_seconds,
        "inputs": inputs,
        "outputs": outputs,
        "call_spec": _call_spec(ep),
        "runner_call_spec": list(runner.loader.get_call_spec()),
        "runner_metadata": dict(runner.get_metadata()),
        "settings": inductor_configs,
        "constants": spec,
        "toolchain": toolchain_identity(),
        "components": {k: (v if k in ("version", "toolchain") else _digest(v)) for k, v in components.items()},
        "payload": {"weights_included": False},
    }


def _digest(obj: Any) -> str:
    return hashlib.sha256(canonical_json(obj).encode()).hexdigest()


def _json_roundtrip(obj: Any) -> Any:
    import json

    return json.loads(json.dumps(obj, sort_keys=True))


def _validate_meta(
    meta: Mapping[str, Any],
    h: str,
    ep: torch.export.ExportedProgram,
    spec: list[dict[str, Any]],
    inductor_configs: dict[str, Any],
) -> None:
    """A stored engine must be exactly what this request would compile; else EngineMismatch."""
    if meta.get("kind") != ENGINE_KIND:
        raise EngineMismatch("kind", f"record holds {meta.get('kind')!r}")
    if meta.get("hash") != h:
        raise EngineMismatch("hash", f"record says {meta.get('hash')!r}")
    if meta.get("payload", {}).get("weights_included"):
        raise EngineMismatch("payload", "record carries weights; this cache stores architecture only")
    checks = {
        "toolchain": toolchain_identity(),
        "constants": spec,
        "call_spec": _call_spec(ep),
        "settings": inductor_configs,
    }
    for what, want in checks.items():
        if _json_roundtrip(meta.get(what)) != _json_roundtrip(want):
            raise EngineMismatch(what, "stored engine was built for different " + what)


def _validate_runner(runner: Any, meta: Mapping[str, Any]) -> None:
    if list(runner.loader.get_call_spec()) != list(meta.get("runner_call_spec") or []):
        raise EngineMismatch("call_spec", "loaded package has a different call spec")
    if dict(runner.get_metadata()) != dict(meta.get("runner_metadata") or {}):
        raise EngineMismatch("runner_metadata", "loaded package reports a different device or ISA")
    expected = {c["fqn"] for c in meta.get("constants") or ()}
    extra = set(runner.get_constant_fqns()) - expected
    if extra:
        raise EngineMismatch("constants", f"package wants constants the record does not list: {sorted(extra)[:5]}")


# --------------------------------------------------------------------------- module API

_default_cache: EngineCache | None = None
_default_lock = threading.Lock()
_fronts: weakref.WeakKeyDictionary[BaseEngineCache, EngineCache] = weakref.WeakKeyDictionary()


def default_engine_cache() -> EngineCache:
    """The process-wide cache on the default store (opened on first use, from the environment)."""
    global _default_cache
    with _default_lock:
        if _default_cache is None:
            _default_cache = EngineCache()
        return _default_cache


def set_default_engine_cache(cache: EngineCache | BaseEngineCache | None) -> None:
    """Replace the process-wide cache (a backend is wrapped in a new EngineCache)."""
    global _default_cache
    with _default_lock:
        _default_cache = cache if cache is None or isinstance(cache, EngineCache) else EngineCache(cache)


def _front_for(engine_cache: EngineCache | BaseEngineCache | None) -> EngineCache:
    if engine_cache is None:
        return default_engine_cache()
    if isinstance(engine_cache, EngineCache):
        return engine_cache
    if not isinstance(engine_cache, BaseEngineCache):
        raise TypeError(f"engine_cache must be an EngineCache or BaseEngineCache, got {type(engine_cache).__name__}")
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
    engine_cache: EngineCache | BaseEngineCache | None = None,
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
