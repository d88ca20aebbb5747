"""The key of an ``aot_compile`` entry: the module's code and structure, the inputs, the settings, the build.

:func:`adstore.integration.inductor.aot_compile` stores torch's own AOT
artifact of ``module.forward``.  What that artifact computes is decided by

* the module's **code**: the source of every class in its module tree (their
  whole defining modules, :func:`~adstore.integration.validity.keys.code_fingerprint`,
  through the pipeline cache's ``env`` component, which adds the versions of
  torch, Python and transformers), and what their methods run
  (:func:`class_code`: code objects encoded canonically, closure cells and
  defaults by value, and the globals the model's own modules' methods read
  by value, :mod:`.aotcode`; a class defined where there is no source file
  still keys what it runs);
* its **structure**, not its weights: per submodule its class, the names,
  shapes, dtypes and ``requires_grad`` of its parameters and buffers, its
  plain attributes (numbers, strings, ``training``) by value, function-valued
  attributes by what they run, any other object by type, and its hooks;
* the **inputs**: the pytree of ``args``/``kwargs`` (its layout as canonical
  data), tensors by shape, stride,
  dtype, device and ``requires_grad``, every other leaf by value (a value
  with no canonical form cannot be keyed: :class:`CacheKeyError`);
* the **settings** that change the code Inductor writes or the graph Dynamo
  captures (their configurations without the ones that name places, grad
  mode, matmul precision);
* torch's build key and the toolchain (``InductorEntries.identity``).

Weights are not in the key and not in the artifact: the module's parameters
are inputs of the compiled graph, read from the module on every call.
"""

from __future__ import annotations

import hashlib
import json
import os
import types
from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import nn

from adstore.integration.errors import CacheKeyError
from adstore.integration.inductor.aotcode import Watch, code_digest, function_form, is_torch_code, opaque, value_form
from adstore.integration.validity import roots
from adstore.integration.validity.keys import canonical, environment_fingerprint, json_digest

__all__ = ["NAMESPACE", "aot_components", "class_code", "input_spec", "module_structure", "settings"]

#: The store namespace of ``aot_compile`` entries.
NAMESPACE = "inductor_aot"

#: A module's own bookkeeping, keyed apart (tensors, children, hooks) or not at all; ``_is_torch_compile``
#: is the mark torch.compile leaves on a module it compiled (a fallback must not change the key).
_SKIPPED_ATTRIBUTES = frozenset(
    {"_parameters", "_buffers", "_modules", "_non_persistent_buffers_set", "_is_torch_compile"}
)
_HOOKS = (
    "_forward_hooks",
    "_forward_pre_hooks",
    "_backward_hooks",
    "_backward_pre_hooks",
    "_state_dict_hooks",
    "_load_state_dict_pre_hooks",
)
_PLAIN = (bool, int, float, str, type(None))


def class_code(classes: Iterable[type], watch: Watch | None = None) -> dict[str, Any]:
    """Per class (and the classes it inherits from, below ``nn.Module``): a digest of what its methods run.

    The source files are hashed too (``code``), but a class whose module has
    no file (a notebook, ``exec``) would have no source to hash, and a
    method's closure cells, defaults and the globals it reads are not in any
    source: :func:`~.aotcode.function_form` keys each of them by value
    (torch's own classes by their code alone: torch's build is in the key).
    ``watch`` collects the globals read, for the per-call check of the process.
    """
    out: dict[str, Any] = {}
    for cls in classes:
        for klass in cls.__mro__:
            if klass in (nn.Module, object):
                break
            name = f"{klass.__module__}.{klass.__qualname__}"
            if name in out:
                continue
            methods: dict[str, Any] = {}
            for attr, value in sorted(vars(klass).items()):
                fn = value.fget if isinstance(value, property) else getattr(value, "__func__", value)
                if not isinstance(fn, types.FunctionType):
                    continue
                if is_torch_code(klass):
                    methods[attr] = code_digest(fn.__code__)
                else:
                    methods[attr] = function_form(fn, watch)
            out[name] = json_digest(methods)
    return out


def _tensor(t: torch.Tensor) -> dict[str, Any]:
    return {
        "shape": list(t.shape),
        "stride": list(t.stride()),
        "dtype": str(t.dtype),
        "device": t.device.type,
        "requires_grad": bool(t.requires_grad),
    }


def _attribute(owner: dict[str, Any], name: str, value: Any, watch: Watch | None) -> Any:
    """An attribute by what it is: plain values (and containers of them) by value, a function by what it
    runs (:func:`~.aotcode.value_form`; :class:`CacheKeyError` when it has no canonical form), any
    other object by its type.

    Dynamo's guards on a function-valued attribute (``ID_MATCH``) cannot be stored: the key holds the
    function instead, and ``watch`` the attribute, for the per-call check of the process.
    """
    if isinstance(value, _PLAIN):
        return canonical(value)
    if isinstance(value, (tuple, list)) and all(isinstance(v, _PLAIN) for v in value):
        return canonical(list(value))
    if isinstance(value, types.FunctionType) and not is_torch_code(value):
        form: Any = function_form(value, watch, reads=True)  # its globals too, wherever it was defined
    else:
        form = value_form(value, watch)
    if opaque(form):  # a callable known only by its type would be a key by name alone
        raise CacheKeyError(
            f"attribute {name!r} is a {type(value).__name__} with no canonical form: it cannot be keyed"
        )
    if watch is not None and callable(value):
        watch.add(owner, name, value, form)
    return form


def _hooks(module: nn.Module) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for name in _HOOKS:
        hooks = getattr(module, name, None) or {}
        if hooks:
            out[name] = [getattr(h, "__qualname__", type(h).__qualname__) for h in hooks.values()]
    return out


def module_structure(module: nn.Module, watch: Watch | None = None) -> list[dict[str, Any]]:
    """Per submodule (in ``named_modules`` order): class, parameters, buffers, attributes, hooks; no weights."""
    out: list[dict[str, Any]] = []
    for name, sub in module.named_modules(remove_duplicate=False):
        cls = type(sub)
        own = vars(sub)
        attributes = {
            k: _attribute(own, k, v, watch)
            for k, v in sorted(own.items())
            if k not in _SKIPPED_ATTRIBUTES and "hook" not in k
        }
        out.append(
            {
                "name": name,
                "class": f"{cls.__module__}.{cls.__qualname__}",
                "parameters": {k: None if p is None else _tensor(p) for k, p in sub._parameters.items()},
                "buffers": {k: None if b is None else _tensor(b) for k, b in sub._buffers.items()},
                "attributes": attributes,
                "hooks": _hooks(sub),
            }
        )
    return out


def input_spec(args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """The call's inputs: the pytree's layout, tensors by spec, other leaves by value."""
    import torch.utils._pytree as pytree

    leaves, spec = pytree.tree_flatten((tuple(args), dict(kwargs)))
    specs: list[Any] = []
    for i, leaf in enumerate(leaves):
        if isinstance(leaf, torch.Tensor):
            specs.append({"tensor": _tensor(leaf)})
            continue
        try:
            specs.append({"value": canonical(leaf, f"input[{i}]"), "type": type(leaf).__qualname__})
        except CacheKeyError:
            raise CacheKeyError(
                f"input {i} is a {type(leaf).__name__} ({leaf!r:.60}) with no canonical form: it cannot be keyed"
            ) from None
    return {"tree": _tree(spec), "leaves": specs}


def _tree(spec: Any) -> Any:
    """The pytree's layout as canonical data: node types by import name, contexts by value (never ``str(spec)``)."""
    if spec.is_leaf():
        return None
    kind = spec.type
    return {
        "type": f"{kind.__module__}.{kind.__qualname__}" if isinstance(kind, type) else value_form(kind),
        "context": value_form(spec.context),
        "children": [_tree(child) for child in spec.children()],
    }


def settings() -> dict[str, Any]:
    """What else decides the artifact: Inductor's, Dynamo's and AOTAutograd's configurations, global torch state."""
    import torch._dynamo.config as dynamo_config
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config

    out: dict[str, Any] = {
        "grad_enabled": torch.is_grad_enabled(),
        "float32_matmul_precision": torch.get_float32_matmul_precision(),
        "deterministic": torch.are_deterministic_algorithms_enabled(),
        "default_dtype": str(torch.get_default_dtype()),
    }
    for name, config in (("inductor", inductor_config), ("dynamo", dynamo_config), ("functorch", functorch_config)):
        try:
            portable = {k: v for k, v in config.save_config_portable().items() if not _path_setting(k, v)}
            text = json.dumps(_stable(portable), sort_keys=True)
        except Exception as exc:  # noqa: BLE001 - another torch's internals: the error stands in (a miss at worst)
            text = f"error: {type(exc).__name__}"
        out[name] = hashlib.sha256(text.encode()).hexdigest()
    return out


def _path_setting(name: str, value: Any) -> bool:
    """A setting that names a place, not code (Dynamo's ``debug_dir_root`` follows the working directory)."""
    last = name.rsplit(".", 1)[-1]
    return last.endswith(("_dir", "_root", "_path")) or (isinstance(value, str) and os.path.isabs(value))


def _stable(value: Any) -> Any:
    """``value`` as JSON that is the same in every process: sets sorted (their order follows string hashing)."""
    if isinstance(value, _PLAIN):
        return value
    if isinstance(value, Mapping):
        return {str(k): _stable(v) for k, v in value.items()}
    if isinstance(value, (set, frozenset)):
        return sorted((_stable(v) for v in value), key=lambda v: json.dumps(v, sort_keys=True))
    if isinstance(value, (list, tuple)):
        return [_stable(v) for v in value]
    return f"<{type(value).__module__}.{type(value).__qualname__}>"


def aot_components(
    module: nn.Module,
    args: tuple[Any, ...],
    kwargs: Mapping[str, Any],
    identity: Mapping[str, str],
    watch: Watch | None = None,
) -> tuple[str, dict[str, Any]]:
    """The store key of ``module`` called with ``args``/``kwargs``, and its components (``adstore explain``).

    ``watch`` collects what the key holds that the program can rebind (globals, function-valued
    attributes): :class:`~.aotcode.Watch`.  Every part is canonical data (the same under any
    ``PYTHONHASHSEED``); a part with no canonical form is a :class:`CacheKeyError`.
    """
    classes = sorted({type(m) for m in module.modules()}, key=lambda c: f"{c.__module__}.{c.__qualname__}")
    watch = Watch() if watch is None else watch
    watch.home = frozenset(c.__module__ for c in classes if not is_torch_code(c))
    cls = type(module)
    components: dict[str, Any] = {
        "namespace": NAMESPACE,
        "module": f"{cls.__module__}.{cls.__qualname__}",
        "code": json_digest(environment_fingerprint(classes)),
        "classes": json_digest(class_code(classes, watch)),
        "structure": json_digest(module_structure(module, watch)),
        "inputs": input_spec(args, kwargs),
        "settings": settings(),
        # how the artifact's kernels are named: relative to the install roots (any venv path), or by path
        "kernel_names": roots.RELOCATION if roots.supported() else "paths",
        **identity,
    }
    return json_digest(components), components
