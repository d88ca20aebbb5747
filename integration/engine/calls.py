"""A compiled module's call, bound the way the module it replaced binds it: by name, through its input spec.

What the compile stage and the engine cache return runs flat positional
inputs (a standalone artifact's placeholders, an AOTInductor package's
tensors).  The module it replaces binds a call by Python's rules: keyword
arguments by name, in any order, defaults filled, and an exported graph then
flattens them through its input spec.  Flattening ``*args, **kwargs`` in
call order instead sends ``m(y=y, x=x)`` to the wrong inputs, and dropping
non-tensor values lets another Python scalar reach code that specialised the
example's (docs/engine-cache.md, "How a compiled stage is called").

:class:`CallBinding` does the module's binding: a call that module would
refuse raises its ``TypeError``; one it accepts yields the flat inputs, in
the order the compiled code takes them.  :class:`CompiledInput` is what one flat
input was compiled for (a tensor's dtype, device, sizes and strides; any
other value by type and value); :func:`first_difference` names the first
input that differs.  What to do then is the caller's: the compile stage's
module hands the call to ``torch.compile`` of its graph, an engine raises
:class:`~adstore.integration.errors.InputMismatch`.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import fx

__all__ = ["CallBinding", "CompiledInput", "first_difference"]

_PLAIN = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)


def _args_kwargs(spec: Any) -> tuple[int, list[str]] | None:
    """``(number of positional arguments, keyword names)`` when ``spec`` is export's ``(args, kwargs)`` form."""
    if spec is None or spec.type is not tuple or spec.num_children != 2:
        return None
    args, kwargs = spec.child(0), spec.child(1)
    if args.type is not tuple or kwargs.type is not dict:
        return None
    return args.num_children, list(kwargs.context)


@dataclass(frozen=True)
class CallBinding:
    """How a call of the replaced module reaches the compiled code's flat inputs.

    ``signature``: the replaced module's ``forward`` (Python binds the call
    with it); ``names``: the parameters whose values fill ``in_spec``, in
    order (an exported graph's original argument names); ``in_spec``: the
    exported input spec, or None for a graph whose placeholders are its
    parameters.  A parameter outside ``names`` was fixed at its default when
    the code was compiled: a call that passes another value does not match.
    """

    signature: inspect.Signature
    names: tuple[str, ...]
    in_spec: Any = None

    @classmethod
    def of_graph(cls, gm: fx.GraphModule) -> CallBinding:
        """The binding of ``gm``'s own ``forward`` (its codegen's ``orig_args`` and ``in_spec``, if it has them).

        A lazy GraphModule (a restored snapshot, a graph recompiled by the
        pipeline) has a ``forward(*args, **kwargs)`` stand-in until its code
        is generated: it is generated here, as its first call would.
        """
        signature = inspect.signature(_generated(gm).forward)
        info = getattr(gm.graph._codegen, "pytree_info", None)
        if info is not None and info.in_spec is not None:
            return cls(signature, tuple(info.orig_args), info.in_spec)
        return cls(signature, tuple(signature.parameters), None)

    @classmethod
    def of_model(cls, model: Any, in_spec: Any) -> CallBinding | None:
        """The binding of ``model`` (what was exported: a module, or an ExportedProgram) for the ``in_spec``.

        Export binds its example arguments to the first parameters of
        ``model.forward`` and its keywords by name; so does a call.  None when
        the signature cannot say (``*args``, ``**kwargs``): then only export's
        own form binds (:meth:`positional`).
        """
        module = model
        if isinstance(model, torch.export.ExportedProgram):
            try:
                module = model.module()  # its forward has the exported arguments' names
            except Exception:  # noqa: BLE001 - no signature: calls bind as export's spec says
                return None
        form = _args_kwargs(in_spec)
        forward = getattr(_generated(module), "forward", None)
        if form is None or forward is None:
            return None
        try:
            signature = inspect.signature(forward)
        except (TypeError, ValueError):
            return None
        if any(p.kind not in _PLAIN for p in signature.parameters.values()):
            return None
        count, keywords = form
        names = [*list(signature.parameters)[:count], *keywords]
        if len(set(names)) != len(names) or not set(names) <= set(signature.parameters):
            return None
        return cls(signature, tuple(names), in_spec)

    @staticmethod
    def positional(in_spec: Any, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> list[Any]:
        """Export's own binding (no signature known): positional arguments, keywords by the spec's names."""
        form = _args_kwargs(in_spec)
        if form is None:
            raise TypeError("the compiled module's input spec is not export's (args, kwargs)")
        count, keywords = form
        if len(args) != count or set(kwargs) != set(keywords):
            raise TypeError(
                f"the compiled module takes {count} positional argument(s) and the keywords {keywords}; "
                f"got {len(args)} and {sorted(kwargs)}"
            )
        flat, received = pytree.tree_flatten((tuple(args), {k: kwargs[k] for k in keywords}))
        if received != in_spec:
            raise TypeError(f"the arguments have the structure {received}, the compiled module takes {in_spec}")
        return flat

    def flatten(self, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> list[Any]:
        """The flat inputs of the call ``(*args, **kwargs)``, in the compiled code's order.

        Raises ``TypeError`` where the replaced module would (an unknown or
        missing argument), and for a call whose structure is not the one
        compiled (another pytree spec, a defaulted parameter given another value).
        """
        bound = self.signature.bind(*args, **kwargs)
        bound.apply_defaults()
        values = bound.arguments
        for name, param in self.signature.parameters.items():
            if name not in self.names and not _same_value(values.get(name, param.default), param.default):
                raise TypeError(f"argument {name!r} was compiled at its default {param.default!r}")
        ordered = [values[n] for n in self.names]
        if self.in_spec is None:
            return ordered
        from torch.fx._pytree import tree_flatten_spec

        form = _args_kwargs(self.in_spec)
        if form is None:
            tree: Any = ordered
        else:
            count, keywords = form
            tree = (ordered[:count], dict(zip(keywords, ordered[count:], strict=True)))
        try:
            return list(tree_flatten_spec(tree, self.in_spec))
        except (KeyError, IndexError, RuntimeError, TypeError, ValueError) as exc:
            raise TypeError(f"the arguments do not have the compiled input structure: {exc}") from None


@dataclass(frozen=True)
class CompiledInput:
    """What one flat input was compiled for.

    A tensor: ``dtype``, ``device``, ``shape`` (None for a dynamic
    dimension) and ``stride`` (None when any dimension is dynamic).  Any
    other value: its type and the value itself, compared by ``==``.
    """

    kind: str
    dtype: Any = None
    device: Any = None
    shape: tuple[int | None, ...] = ()
    stride: tuple[int, ...] | None = None
    value: Any = None

    @classmethod
    def of(cls, value: Any, dynamic: Sequence[bool] | None = None) -> CompiledInput:
        """The spec of the example input ``value``; ``dynamic``: which of its dimensions may vary."""
        if isinstance(value, torch.Tensor):
            dyn = list(dynamic) if dynamic is not None and len(dynamic) == value.dim() else [False] * value.dim()
            shape = tuple(None if d else int(n) for n, d in zip(value.shape, dyn, strict=True))
            stride = None if any(dyn) else tuple(value.stride())
            return cls("tensor", value.dtype, value.device, shape, stride)
        return cls("value", value=value)

    def differs(self, value: Any) -> str | None:
        """None when ``value`` fits this spec, else what differs (for a log line or an error)."""
        if self.kind == "tensor":
            if not isinstance(value, torch.Tensor):
                return f"a tensor was compiled, got {type(value).__name__}"
            if value.dtype != self.dtype or value.device != self.device or value.dim() != len(self.shape):
                return f"compiled for {self.dtype} {len(self.shape)}-d on {self.device}, got {_tensor(value)}"
            if any(want is not None and want != got for want, got in zip(self.shape, value.shape, strict=True)):
                return f"compiled for sizes {list(self.shape)}, got {list(value.shape)}"
            if self.stride is not None and any(  # a dimension of size 1 is never stepped over
                n > 1 and got != want for n, got, want in zip(value.shape, value.stride(), self.stride, strict=True)
            ):
                return f"compiled for strides {list(self.stride)}, got {list(value.stride())}"
            return None
        if isinstance(value, torch.Tensor) or not _same_value(value, self.value):
            return f"compiled for the value {_shown(self.value)}, got {_shown(value)}"
        return None


def first_difference(specs: Sequence[CompiledInput], values: Sequence[Any]) -> str | None:
    """None when every value fits its spec, else which input differs first and how."""
    if len(specs) != len(values):
        return f"{len(specs)} inputs were compiled, the call has {len(values)}"
    for i, (spec, value) in enumerate(zip(specs, values, strict=True)):
        why = spec.differs(value)
        if why is not None:
            return f"input {i}: {why}"
    return None


def _generated(module: Any) -> Any:
    """``module``, its code generated first if it is a lazy GraphModule (whose ``forward`` is a stand-in)."""
    needs, generate = getattr(module, "_needs_recompile", None), getattr(module, "real_recompile", None)
    if callable(needs) and callable(generate) and needs():
        generate()
    return module


def _same_value(a: Any, b: Any) -> bool:
    """Same type and equal (``2`` is not ``2.0``, nor ``True``); anything that cannot say is not the same."""
    if a is b:
        return True
    if type(a) is not type(b):
        return False
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001 - a value whose == raises or is ambiguous is another value
        return False


def _tensor(t: torch.Tensor) -> str:
    return f"{t.dtype} {t.dim()}-d on {t.device}"


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:60] + "..."
