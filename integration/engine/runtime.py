"""Runtime side of the engine cache: weights, refit, engine metadata and its checks.

A cached AOTInductor package holds code, no weights. This module collects the
weights a graph reads (parameters, buffers, tensor constants), writes them into
a loaded runner in the exact layout the engine was compiled for, describes an
engine in the metadata stored with it, and checks that metadata (and the loaded
runner) against a request before an engine is used.
"""

from __future__ import annotations

import contextlib
import json
import time
import warnings
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch.export.graph_signature import ExportGraphSignature, InputKind, InputSpec

from adstore.integration.coordination.events import CacheEvent, Source
from adstore.integration.engine.calls import CallBinding, CompiledInput, first_difference
from adstore.integration.engine.hashing import call_spec
from adstore.integration.errors import EngineMismatch, InputMismatch
from adstore.integration.validity.envcheck import env_differences
from adstore.integration.validity.keys import json_digest
from adstore.integration.validity.toolchain import toolchain_identity

__all__ = [
    "ENGINE_KIND",
    "aoti_compile",
    "CompiledEngine",
    "PackageRunner",
    "build_meta",
    "code_constant_names",
    "constants_as_buffers",
    "constants_spec",
    "load_runner",
    "module_weights",
    "record_components",
    "refit",
    "runner_in_spec",
    "validate_meta",
    "validate_record",
    "validate_runner",
    "weights_of",
]

ENGINE_KIND = "aoti_package"


# --------------------------------------------------------------------------- weights


def constants_as_buffers(ep: torch.export.ExportedProgram) -> torch.export.ExportedProgram:
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
    with torch_leafspec_quiet():
        return ep._update(ep.graph_module, sig)


def weights_of(ep: torch.export.ExportedProgram) -> dict[str, torch.Tensor]:
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


def code_constant_names(ep: torch.export.ExportedProgram) -> list[str]:
    return [str(s.target) for s in ep.graph_signature.input_specs if s.kind == InputKind.CONSTANT_TENSOR]


def constants_spec(weights: Mapping[str, torch.Tensor]) -> list[dict[str, Any]]:
    return [
        {"fqn": k, "shape": list(t.shape), "dtype": str(t.dtype), "stride": list(t.stride()), "device": t.device.type}
        for k, t in sorted(weights.items())
    ]


def _weights_from(source: Any) -> dict[str, torch.Tensor]:
    if isinstance(source, torch.export.ExportedProgram):
        return weights_of(source)
    if isinstance(source, torch.nn.Module):
        return dict(source.state_dict(keep_vars=True))
    if isinstance(source, Mapping):
        return {str(k): v for k, v in source.items()}
    raise TypeError(f"cannot take weights from {type(source).__name__}")


def refit(runner: Any, weights: Mapping[str, torch.Tensor], spec: list[dict[str, Any]]) -> float:
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
                    "constants", f"{fqn}: engine expects {want['dtype']}{want['shape']}, got {t.dtype}{list(t.shape)}"
                )
            if list(t.stride()) != want["stride"]:
                # The kernels index constants with the compiled strides; load_constants
                # clones with the source's strides, so re-lay the data out first.
                t = torch.empty_strided(want["shape"], want["stride"], dtype=t.dtype, device=t.device).copy_(t)
            cmap[fqn] = t
    start = time.perf_counter()
    runner.load_constants(cmap, check_full_update=True)
    return time.perf_counter() - start


class PackageRunner:
    """A loaded AOTInductor package: torch's C++ loader, called the way torch's own wrapper calls it.

    torch's Python wrapper (``AOTICompiledModel``) lives in a module that
    imports all of Inductor, and with it dynamo: most of a second of a
    restart that only runs a finished engine.  This wrapper does what it
    does (flatten the call's arguments with the package's input spec, run,
    unflatten with its output spec) with ``torch.utils._pytree`` alone.
    """

    def __init__(self, loader: Any) -> None:
        self.loader = loader
        in_spec, out_spec = loader.get_call_spec()
        self._in_spec = pytree.treespec_loads(in_spec)
        self._out_spec = pytree.treespec_loads(out_spec)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if kwargs:
            from torch.export._tree_utils import reorder_kwargs

            kwargs = reorder_kwargs(kwargs, self._in_spec)
        flat = [x for x in pytree.tree_flatten((args, kwargs))[0] if isinstance(x, torch.Tensor)]
        return pytree.tree_unflatten(self.loader.boxed_run(flat), self._out_spec)

    def get_metadata(self) -> dict[str, str]:
        return dict(self.loader.get_metadata())

    def get_constant_fqns(self) -> list[str]:
        return list(self.loader.get_constant_fqns())

    def load_constants(self, constants_map: dict[str, torch.Tensor], *, check_full_update: bool) -> None:
        # (map, use_inactive, check_full_update, user_managed, allow_h2d_copy), as torch's wrapper passes them
        self.loader.load_constants(constants_map, False, check_full_update, False, False)


@contextlib.contextmanager
def torch_leafspec_quiet() -> Iterator[None]:
    """Silence the ``FutureWarning`` torch 2.13 raises at itself when it deep-copies a pytree spec.

    torch deprecated instantiating ``LeafSpec``, and its own deep copies of
    graphs and call specs (``ExportedProgram._update``, Inductor's
    ``repro.after_aot``) instantiate one, so every engine compile printed a
    warning about ``isinstance(treespec, LeafSpec)`` that no caller can act on.
    It is filtered around those torch calls only, nowhere else.
    """
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\)", category=FutureWarning)
        yield


def aoti_compile(ep: Any, path: Path, inductor_configs: dict[str, Any]) -> None:
    """``aoti_compile_and_package`` of ``ep`` into ``path`` (torch's LeafSpec warning filtered)."""
    with torch_leafspec_quiet():
        torch._inductor.aoti_compile_and_package(ep, package_path=str(path), inductor_configs=inductor_configs)


def load_runner(path: Path) -> Any:
    """Load an AOTInductor package with torch's C++ loader, minus the Python wrapper's imports and ISA probe.

    ``torch._inductor.aoti_load_package`` first asks Inductor for this host's
    device information, which picks the CPU vector ISA by compiling and
    running test programs (about 1.2 s of a next-process hit here), only to
    log a warning when the package was built for another ISA; and its
    wrapper imports Inductor and dynamo.  The engine's key already pins the
    CPU capability, platform and toolchain (``toolchain.py``), so a package
    built for another ISA is never looked up here: the package is opened by
    the C++ loader directly (:class:`PackageRunner`).  Another torch without
    that loader takes the public path.
    """
    loader_cls = getattr(getattr(torch._C, "_aoti", None), "AOTIModelPackageLoader", None)
    if loader_cls is None:
        return torch._inductor.aoti_load_package(str(path))
    return PackageRunner(loader_cls(str(path), "model", False, 1, -1))


def module_weights(module: torch.nn.Module, spec: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
    """fqn -> tensor of ``module`` for every constant of ``spec``, found by attribute path.

    An engine's constants are named by the fqns ``torch.export`` gave the
    module's parameters, buffers (persistent or not) and tensor attributes,
    which are their attribute paths; resolving them on the module needs no
    export.  A name the module does not have is left out (the refit then
    raises :class:`EngineMismatch` naming it).
    """
    out: dict[str, torch.Tensor] = {}
    for item in spec:
        fqn = str(item.get("fqn", ""))
        obj: Any = module
        for part in fqn.split("."):
            obj = getattr(obj, part, None)
            if obj is None:
                break
        if isinstance(obj, torch.Tensor):
            out[fqn] = obj
    return out


# --------------------------------------------------------------------------- engine


class CompiledEngine:
    """A loaded, refit engine; call it like the model. ``event`` says how it was obtained."""

    def __init__(
        self,
        runner: Any,
        *,
        hash: str | None,
        meta: Mapping[str, Any],
        event: CacheEvent,
        code_constants: Mapping[str, torch.Tensor],
        timings: Mapping[str, float],
        binding: CallBinding | None = None,
        example_inputs: Sequence[Any] | None = None,
    ) -> None:
        self._runner = runner
        self.hash = hash
        self.meta = dict(meta)
        self.event = event
        self._code_constants = dict(code_constants)
        self.timings = dict(timings)
        self._in_spec = runner_in_spec(runner)
        self._binding = binding
        self._inputs = _input_specs(example_inputs, self._in_spec, self.meta)

    @property
    def source(self) -> Source:
        return self.event.source

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Run the engine on a call bound as the model binds it; InputMismatch for inputs it was not compiled for.

        The package takes its tensors flat and reads them as the compiled
        ones, whatever they are: keyword arguments are bound by name (the
        model's signature, then the exported input spec) and every input is
        checked against the example it was compiled for before it runs.  An
        engine made without its example inputs runs the call as given.
        """
        if self._inputs is None:
            return self._runner(*args, **kwargs)
        if self._binding is not None:
            flat = self._binding.flatten(args, kwargs)
        else:
            flat = CallBinding.positional(self._in_spec, args, kwargs)
        why = first_difference(self._inputs, flat)
        if why is not None:
            raise InputMismatch(f"engine {self.hash and self.hash[:12]}: {why}")
        call_args, call_kwargs = pytree.tree_unflatten(flat, self._in_spec)
        return self._runner(*call_args, **call_kwargs)

    def refit(self, weights: Any) -> float:
        """Swap in new weights (an nn.Module, ExportedProgram or fqn->tensor mapping); returns seconds.

        Tensor constants written in ``forward`` are part of the architecture and are
        kept; every other constant must be given. Raises EngineMismatch on a missing
        name, shape or dtype (nothing is loaded then).
        """
        merged = {**self._code_constants, **_weights_from(weights)}
        return refit(self._runner, merged, self.meta["constants"])

    def __repr__(self) -> str:
        return f"CompiledEngine(hash={self.hash and self.hash[:12]}, source={self.source})"


def runner_in_spec(runner: Any) -> Any:
    """The exported input spec of a loaded package (None if its loader does not say)."""
    try:
        return pytree.treespec_loads(runner.loader.get_call_spec()[0])
    except Exception:  # noqa: BLE001 - a runner without torch's loader: calls go through as given
        return None


def _input_specs(
    example_inputs: Sequence[Any] | None, in_spec: Any, meta: Mapping[str, Any]
) -> list[CompiledInput] | None:
    """What each flat input was compiled for: the example's leaves, a tensor's symbolic sizes left free.

    None (no check) without example inputs, or when they do not flatten to the package's input spec.
    """
    if example_inputs is None or in_spec is None:
        return None
    leaves, spec = pytree.tree_flatten((tuple(example_inputs), {}))
    if spec != in_spec:
        return None
    shapes = [i.get("shape") for i in meta.get("inputs") or () if isinstance(i, Mapping) and "shape" in i]
    tensors = [leaf for leaf in leaves if isinstance(leaf, torch.Tensor)]
    dims = iter(shapes if len(shapes) == len(tensors) else [None] * len(tensors))
    out = []
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor):
            shape = next(dims)
            out.append(CompiledInput.of(leaf, dynamic=[not str(d).isdigit() for d in shape] if shape else None))
        else:
            out.append(CompiledInput.of(leaf))
    return out


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


def build_meta(
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
        "call_spec": call_spec(ep),
        "runner_call_spec": list(runner.loader.get_call_spec()),
        "runner_metadata": dict(runner.get_metadata()),
        "settings": inductor_configs,
        "constants": spec,
        "toolchain": toolchain_identity(),
        "components": record_components(components),
        "payload": {"weights_included": False},
    }


#: Hash components stored as they are (small; ``adstore explain`` shows their fields); the rest as digests.
_STORED_AS_IS = ("version", "toolchain", "settings")


def record_components(components: Mapping[str, Any]) -> dict[str, Any]:
    """The form of the hash components stored in a record and as the store entry's components.

    The graph and the input specs are stored as their SHA-256 digests (the
    graph digest is what a record relabelled under another hash betrays).
    """
    return {k: (_json_roundtrip(v) if k in _STORED_AS_IS else json_digest(v)) for k, v in components.items()}


def _json_roundtrip(obj: Any) -> Any:
    return json.loads(json.dumps(obj, sort_keys=True))


def validate_record(meta: Mapping[str, Any], h: str) -> None:
    """The checks of a stored engine that need no request: kind, hash, no weights, this toolchain.

    The hash covers the toolchain, so a record under this hash that names
    another toolchain (the fields are named) was forged or relabelled.
    """
    if meta.get("kind") != ENGINE_KIND:
        raise EngineMismatch("kind", f"record holds {meta.get('kind')!r}")
    if meta.get("hash") != h:
        raise EngineMismatch("hash", f"record says {meta.get('hash')!r}")
    if meta.get("payload", {}).get("weights_included"):
        raise EngineMismatch("payload", "record carries weights; this cache stores architecture only")
    here = {"toolchain": toolchain_identity()}
    diffs = env_differences({"toolchain": meta.get("toolchain")}, here, env=("toolchain",))
    if diffs:
        raise EngineMismatch("toolchain", "record names another toolchain: " + "; ".join(str(d) for d in diffs[:4]))


def validate_meta(
    meta: Mapping[str, Any],
    h: str,
    ep: torch.export.ExportedProgram,
    spec: list[dict[str, Any]],
    inductor_configs: dict[str, Any],
    components: Mapping[str, Any],
) -> None:
    """A stored engine must be exactly what this request would compile, here; else EngineMismatch.

    The hash covers the toolchain and the graph, so a record under this hash
    that names another toolchain (the fields are named) or stores another
    graph digest was forged or relabelled: a miss, never a load.  A genuine
    engine from another environment has another hash (``incompatible_env``
    comes from the miss diagnosis, :mod:`~adstore.integration.validity.envcheck`).
    """
    validate_record(meta, h)
    stored, wanted = meta.get("components"), record_components(components)
    if not isinstance(stored, Mapping):
        raise EngineMismatch("components", "record stores no hash components")
    for name in sorted(set(stored) | set(wanted)):
        if _json_roundtrip(stored.get(name)) != wanted.get(name):
            raise EngineMismatch(
                name,
                f"record was built for another {name} "
                f"({str(stored.get(name))[:16]}, asked for {str(wanted.get(name))[:16]})",
            )
    checks = {"constants": spec, "call_spec": call_spec(ep), "settings": inductor_configs}
    for what, want in checks.items():
        if _json_roundtrip(meta.get(what)) != _json_roundtrip(want):
            raise EngineMismatch(what, "stored engine was built for different " + what)


def validate_runner(runner: Any, meta: Mapping[str, Any]) -> None:
    if list(runner.loader.get_call_spec()) != list(meta.get("runner_call_spec") or []):
        raise EngineMismatch("call_spec", "loaded package has a different call spec")
    if dict(runner.get_metadata()) != dict(meta.get("runner_metadata") or {}):
        raise EngineMismatch("runner_metadata", "loaded package reports a different device or ISA")
    expected = {c["fqn"] for c in meta.get("constants") or ()}
    extra = set(runner.get_constant_fqns()) - expected
    if extra:
        raise EngineMismatch("constants", f"package wants constants the record does not list: {sorted(extra)[:5]}")
