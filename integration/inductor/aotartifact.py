"""torch's own AOT artifact of a module's ``forward``: capture, serialize, load (torch 2.13's precompile path).

``torch.compile(module.forward, fullgraph=True).aot_compile((args, kwargs))``
traces once with Dynamo, compiles with Inductor and returns an
``AOTCompiledFunction``: the guards, the bytecode Dynamo wrote around the
graph, and AOTAutograd's bundled entry (Inductor's Python wrapper and the
C++ source of each kernel).  ``AOTCompiledFunction.serialize`` turns it into
bytes that ``torch.compiler.load_compiled_function`` loads in another
process without tracing.  The artifact's signature is ``forward``'s: the
module is its first argument, so its parameters and buffers are graph inputs
read from the module on every call; the artifact holds no weight.

Three things the bytes alone do not carry, handled here:

* **guards torch cannot serialize** (``ID_MATCH``, ``CLOSURE_MATCH``, types
  defined in a local scope, guards on the values a decorator's closure
  holds) are left out by :func:`guard_filter`: each guards code, not data,
  and the code is in the entry's key (:mod:`.aotkey`);
* **objects of the forward's closure** (a decorator's wrapped function) are
  passed by reference (``external_data``) and taken from the live module on
  load.  A module whose ``forward`` torch itself defines (``nn.Sequential``,
  ``nn.Linear``) is traced through a wrapper torch makes around the bound
  ``module.forward``: that wrapper's one closure object is the bound method,
  carried the same way (``"calls": "forward"``): the artifact is then called
  without the module, which it reaches through the live ``module.forward``;
* **globals Dynamo installed** while tracing (a module it aliased) are
  recorded by their import name and imported on load.

The kernels' shared objects are not in the artifact either: a load compiles
each kernel whose ``.so`` is not in Inductor's cache directory, so the
caller captures them (:func:`capture` compiles into a directory of its own)
and places them before :func:`load`, which then needs no precompiled header.  The ISA probes' answers are recorded
on capture and given back on load (:mod:`~adstore.integration.placement.probes`).
"""

from __future__ import annotations

import importlib
import io
import json
import re
import types
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import torch
from torch import nn

from adstore.integration.errors import IntegrationError
from adstore.integration.validity import roots

__all__ = [
    "Artifact",
    "calling",
    "capture",
    "external_data",
    "guard_filter",
    "load",
    "pack",
    "serialize",
    "traced_function",
    "unpack",
]

#: The first bytes of a stored artifact: this header, then the length of a JSON object, it, torch's bytes.
MAGIC = b"adstore-aot-compile/1\n"

#: Guard kinds torch 2.13 cannot write into an artifact (its ``UNSUPPORTED_SERIALIZATION_GUARD_TYPES``).
_FALLBACK_UNSERIALIZABLE = (
    "DICT_VERSION",
    "NN_MODULE",
    "ID_MATCH",
    "FUNCTION_MATCH",
    "CLASS_MATCH",
    "MODULE_MATCH",
    "CLOSURE_MATCH",
    "WEAKREF_ALIVE",
)
_LEADING_NAME = re.compile(r"(?:L\['(\w+)'\]|(\w+))")
_PLAIN = (bool, int, float, str, bytes, type(None))


def traced_function(module: nn.Module) -> types.FunctionType:
    """The function Dynamo traces for ``module.forward`` (its ``self`` is the artifact's first argument)."""
    from torch._dynamo.convert_frame import get_traced_fn

    fn, _ = get_traced_fn(module.forward)
    if not isinstance(fn, types.FunctionType):
        raise IntegrationError(f"{type(module).__name__}.forward is not a Python function")
    return fn


def guard_filter(fn: types.FunctionType, dropped: Counter[str]) -> Callable[[Sequence[Any]], list[bool]]:
    """The guards kept in the artifact: torch's default for ``aot_compile``, and none it cannot serialize.

    Dropped (counted in ``dropped`` by kind): global guards and the kinds
    torch cannot serialize (its own default), guards whose derived kinds
    include one of those, type checks of classes defined in a local scope,
    and guards on ``fn``'s closure variables or any function's
    ``__closure__``: all of them check code, which the entry's key holds.
    """
    try:
        from torch._dynamo.guards import CheckFunctionManager

        unserializable = tuple(CheckFunctionManager.UNSUPPORTED_SERIALIZATION_GUARD_TYPES)
    except (ImportError, AttributeError):
        unserializable = _FALLBACK_UNSERIALIZABLE
    freevars = set(fn.__code__.co_freevars)

    def keep(entries: Sequence[Any]) -> list[bool]:
        out: list[bool] = []
        for g in entries:
            why = None
            if g.is_global:
                why = "global"
            elif g.guard_type in unserializable or any(d in unserializable for d in g.derived_guard_types):
                why = "unserializable"
            elif g.has_value and "<locals>" in type(g.value).__qualname__ and g.guard_type.endswith("_MATCH"):
                why = "local_type"
            else:
                m = _LEADING_NAME.match(g.name)
                if (m is not None and (m.group(1) or m.group(2)) in freevars) or "__closure__" in g.name:
                    why = "closure"
            if why is not None:
                dropped[why] += 1
            out.append(why is None)
        return out

    return keep


def external_data(fn: types.FunctionType) -> dict[str, Any]:
    """The objects of ``fn``'s closure that travel by reference: taken from the live module on load.

    Plain values (numbers, strings, None) are pickled by value instead: the
    pickler maps objects by identity, and a shared constant must never stand
    for another.
    """
    cells = fn.__closure__ or ()
    return {f"closure.{i}": c.cell_contents for i, c in enumerate(cells) if not isinstance(c.cell_contents, _PLAIN)}


class Artifact:
    """A loaded or compiled artifact and how it is called: with the module first (``"module"``), or without
    (``"forward"``: it reaches the module through the live ``module.forward`` in its closure)."""

    def __init__(self, compiled: Any, calls: str) -> None:
        if calls not in ("module", "forward"):
            raise IntegrationError(f"an artifact called {calls!r}")
        self.compiled = compiled
        self.calls = calls

    def guard_check(self, module: nn.Module, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> bool:
        """Whether the artifact's (stored) guards hold for this call."""
        if self.calls == "module":
            return bool(self.compiled.guard_check(module, *args, **kwargs))
        return bool(self.compiled.guard_check(*args, **kwargs))

    def __call__(self, module: nn.Module, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> Any:
        if self.calls == "module":
            return self.compiled.fn(module, *args, **kwargs)
        return self.compiled.fn(*args, **kwargs)


def calling(compiled: Any, module: nn.Module) -> str:
    """How torch's ``compiled`` artifact of ``module`` is called (:class:`Artifact`); IntegrationError otherwise."""
    fn = traced_function(module)
    artifacts = compiled._artifacts
    if artifacts.original_code is fn.__code__:
        return "module"
    closure = artifacts.runtime_env.closure or ()
    bound = closure[0].cell_contents if len(closure) == 1 else None
    if getattr(bound, "__self__", None) is module and getattr(bound, "__func__", None) is fn:
        return "forward"  # torch traced a wrapper of the bound ``module.forward`` (a torch-defined forward)
    raise IntegrationError(f"torch traced {artifacts.original_code.co_name!r}, not {type(module).__name__}.forward")


def _closure_data(compiled: Any, module: nn.Module, calls: str) -> dict[str, Any]:
    """The objects the artifact's closure holds that travel by reference (see :func:`external_data`)."""
    if calls == "forward":
        return {"forward": compiled._artifacts.runtime_env.closure[0].cell_contents}
    return external_data(traced_function(module))


def capture(
    module: nn.Module, args: tuple[Any, ...], kwargs: Mapping[str, Any], workdir: Path
) -> tuple[Any, dict[str, bool], dict[str, int]]:
    """Compile ``module.forward`` for these inputs with ``workdir`` as Inductor's cache directory.

    Returns torch's ``AOTCompiledFunction``, the ISA probes' answers seen and
    the guards left out by kind.  Kernels build in this process
    (``compile_threads=1``), so every ``.so`` the artifact needs lands in
    ``workdir``; the ISA probes run again for the same reason.  ``freezing``
    stays off and Dynamo inlines the module (parameters are graph inputs):
    otherwise the weights could be folded into the code or pickled with it.
    """
    import torch._inductor.compile_fx  # noqa: F401 - the compile's imports, outside the timed trace
    from torch._inductor.runtime.cache_dir_utils import temporary_cache_dir

    from adstore.integration.placement import probes as isa

    fn = traced_function(module)
    dropped: Counter[str] = Counter()
    isa.forget()
    with ExitStack() as stack:
        stack.enter_context(temporary_cache_dir(str(workdir)))
        stack.enter_context(roots.relocated())  # kernels named relative to the install roots: any venv path finds them
        stack.enter_context(torch._inductor.config.patch(compile_threads=1, freezing=False))
        # Parameters and buffers as graph inputs read from the module (not attributes baked into the graph).
        stack.enter_context(torch._dynamo.config.patch(enable_aot_compile=True, **_inline_modules()))
        probes = stack.enter_context(isa.PROBES.scope({}))
        compiled = torch.compile(module.forward, fullgraph=True, options={"guard_filter_fn": guard_filter(fn, dropped)})
        aot = compiled.aot_compile((tuple(args), dict(kwargs)))
    return aot, dict(probes), dict(dropped)


def _inline_modules() -> dict[str, bool]:
    """``inline_inbuilt_nn_modules=True`` where it is a setting of this torch; nothing where it is always on.

    torch 2.13 deprecated it (always True): setting it there would print a
    ``FutureWarning`` into the user's program on every compile.
    """
    import torch._dynamo.config as dynamo_config

    entry = getattr(dynamo_config, "_config", {}).get("inline_inbuilt_nn_modules")
    if entry is None or getattr(entry, "deprecated", False):
        return {}
    return {"inline_inbuilt_nn_modules": True}


def serialize(compiled: Any, module: nn.Module) -> tuple[bytes, dict[str, Any]]:
    """The artifact's bytes, and what a load needs besides them (the meta: closure keys, globals to import).

    Raises :class:`IntegrationError` when the artifact names a global that is
    not a module or an importable name (it could not be rebuilt elsewhere).
    """
    calls = calling(compiled, module)
    closure = _closure_data(compiled, module, calls)
    env = compiled._artifacts.runtime_env
    scope = compiled._extra_globals or {}
    known = set(env.used_globals) | set(env.import_sources) | {compiled._artifacts.backend_id}
    imports: dict[str, list[str]] = {}
    for ref in sorted(env.external_refs):
        if ref in known:
            continue
        value = scope.get(ref)
        if isinstance(value, types.ModuleType):
            imports[ref] = [value.__name__]
        elif _importable(value):
            imports[ref] = [value.__module__, value.__qualname__]
        else:
            raise IntegrationError(f"the artifact refers to a global {ref!r} ({type(value).__name__}) it cannot carry")
    data = type(compiled).serialize(compiled, closure).serialized_data
    return data, {"closure": sorted(closure), "imports": imports, "calls": calls}


def _importable(value: Any) -> bool:
    name = getattr(value, "__qualname__", None)
    module = getattr(value, "__module__", None)
    if not isinstance(name, str) or not isinstance(module, str) or "<locals>" in name:
        return False
    try:
        return _resolve([module, name]) is value
    except Exception:  # noqa: BLE001 - not importable by name: not carried
        return False


def _resolve(spec: Sequence[str]) -> Any:
    obj: Any = importlib.import_module(spec[0])
    for part in spec[1].split(".") if len(spec) > 1 else ():
        obj = getattr(obj, part)
    return obj


def pack(meta: Mapping[str, Any], data: bytes) -> bytes:
    """One blob of what a load acts on (``meta``: closure keys, globals, ISA answers) and torch's artifact.

    Kept together so that all of it is judged by the one check of the blob's
    writer; nothing a load acts on comes from the index alone.
    """
    head = json.dumps(dict(meta), sort_keys=True).encode()
    return MAGIC + len(head).to_bytes(8, "big") + head + data


def unpack(blob: bytes) -> tuple[dict[str, Any], bytes]:
    """``(meta, torch's bytes)`` of :func:`pack`; :class:`IntegrationError` for anything else."""
    if not blob.startswith(MAGIC) or len(blob) < len(MAGIC) + 8:
        raise IntegrationError("not an aot_compile artifact of this adstore")
    size = int.from_bytes(blob[len(MAGIC) : len(MAGIC) + 8], "big")
    start = len(MAGIC) + 8
    try:
        meta = json.loads(blob[start : start + size])
    except ValueError as exc:
        raise IntegrationError(f"the artifact's header does not decode: {exc}") from None
    if not isinstance(meta, dict):
        raise IntegrationError("the artifact's header is not an object")
    return meta, blob[start + size :]


def load(data: bytes, module: nn.Module, meta: Mapping[str, Any], workdir: Path) -> Artifact:
    """The artifact ``data`` (verified, from a trusted writer), loaded for ``module`` by torch's loader; no tracing.

    ``workdir`` (Inductor's cache directory for the load) holds the kernels
    placed from the entry; ``meta["isa_probes"]``: the ISA probes' recorded answers.
    Raises :class:`IntegrationError` when the live module's closure does not
    have the objects the artifact refers to, and whatever torch raises on an
    artifact it rejects (another torch, Python or device).
    """
    from torch._inductor.runtime.cache_dir_utils import temporary_cache_dir

    from adstore.integration.placement import probes as isa

    calls = meta.get("calls", "module")
    closure = {"forward": module.forward} if calls == "forward" else external_data(traced_function(module))
    wanted = meta.get("closure")
    if not isinstance(wanted, list) or sorted(closure) != wanted:
        raise IntegrationError(f"the module's forward closes over {sorted(closure)}, the artifact over {wanted}")
    imports = meta.get("imports")
    if not isinstance(imports, dict):
        raise IntegrationError("the entry records no globals to import")
    scope = {ref: _resolve(spec) for ref, spec in imports.items()}
    with ExitStack() as stack:
        stack.enter_context(temporary_cache_dir(str(workdir)))
        stack.enter_context(roots.relocated())  # the names capture gave the kernels placed from the entry
        stack.enter_context(torch._inductor.config.patch(compile_threads=1))
        stack.enter_context(torch._dynamo.config.patch(enable_aot_compile=True))
        stack.enter_context(isa.PROBES.scope(meta.get("isa_probes")))
        _without_header(stack, workdir)
        compiled = torch.compiler.load_compiled_function(io.BytesIO(data), f_globals=scope, external_data=closure)
    return Artifact(compiled, str(calls))


def _without_header(stack: ExitStack, workdir: Path) -> None:
    """In this block Inductor neither preprocesses nor builds its precompiled header.

    Loading a kernel whose ``.so`` is there needs no header, yet Inductor
    settles the header (``g++ -E`` of it in every process, and a ~150 MB
    build on a host without it) before it looks for the ``.so``.  The
    kernels are all placed from the entry, so the header's path is never
    used; should one be missing after all, its build names a header that is
    not there and fails, and the load is a miss (a compile), never a wrong kernel.
    """
    from torch._inductor import codecache

    original = getattr(codecache, "_precompile_header", None)
    if not callable(original):
        return
    absent = str(workdir / "adstore-no-precompiled-header.h")

    def settled(*args: Any, **kwargs: Any) -> str:
        return absent

    codecache._precompile_header = settled  # type: ignore[assignment]
    stack.callback(setattr, codecache, "_precompile_header", original)
