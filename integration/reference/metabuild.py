"""Build a ``transformers`` model on the meta device without materialising a parameter.

The model is constructed under ``torch.device("meta")``, the way
``from_pretrained`` constructs it: no parameter, however large, is ever
allocated (DeepSeek-V3's fused experts are one 30 GB tensor per layer in
float32).  What the
constructor computed into meta tensors and the graph needs as values are the
non-persistent buffers (rotary ``inv_freq`` tables, embedding scales); those
are rebuilt on the CPU by the model's own ``_init_weights``, which is how
``from_pretrained`` gives them values after a meta construction.

The rebuild is checked, not assumed: each buffer is rebuilt twice from two
different fills, and a buffer whose value depends on the fill (the model's
``_init_weights`` does not write all of it), or a plain tensor attribute left
on the meta device, means the meta construction lost a value.  Such a model,
and one whose constructor cannot run on the meta device at all, is built the
previous way instead (:func:`meta_parameters`: constructed on the CPU with
every parameter moved to meta as it is registered), with the reason logged.
"""

from __future__ import annotations

import contextlib
import copy
import logging
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

__all__ = ["build_on_meta", "meta_parameters", "rebuild_buffers"]

log = logging.getLogger(__name__)


@contextlib.contextmanager
def meta_parameters() -> Iterator[None]:
    """Register every new parameter on the meta device (buffers stay real).

    The fallback of :func:`build_on_meta`: each parameter is still created on
    the CPU before it moves, so the largest one must fit in memory.
    """
    original = nn.Module.register_parameter

    def register(self: nn.Module, name: str, param: nn.Parameter | None) -> None:
        if param is not None and param.device.type != "meta":
            param = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
        original(self, name, param)

    nn.Module.register_parameter = register  # type: ignore[method-assign]
    try:
        yield
    finally:
        nn.Module.register_parameter = original  # type: ignore[method-assign]


def _init_owners(model: nn.Module) -> dict[str, Any]:
    """Module path -> the ``PreTrainedModel`` whose ``_init_weights`` covers it (the nearest one above)."""
    owners: dict[str, Any] = {"": model}
    for path, mod in model.named_modules():
        if not path:
            continue
        parent = owners[path.rpartition(".")[0]]
        owners[path] = mod if callable(getattr(mod, "_init_weights", None)) else parent
    return owners


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.is_floating_point() or a.is_complex():
        return bool(torch.equal(a, b) or ((a == b) | (a.isnan() & b.isnan())).all())
    return bool(torch.equal(a, b))


def rebuild_buffers(model: nn.Module) -> list[str]:
    """Give every non-persistent meta buffer of ``model`` its value on the CPU; the names it could not rebuild.

    A name in the result is a buffer the model's ``_init_weights`` leaves
    (partly) unwritten, or a plain tensor attribute the meta construction left
    without values.
    """
    owners = _init_owners(model)
    todo = [
        (path, mod, name)
        for path, mod in model.named_modules()
        for name, buf in mod._buffers.items()
        if buf is not None and buf.device.type == "meta" and name in mod._non_persistent_buffers_set
    ]
    lost = [
        f"{path}.{name}" if path else name
        for path, mod in model.named_modules()
        for name, value in vars(mod).items()
        if isinstance(value, torch.Tensor) and not isinstance(value, nn.Parameter) and value.is_meta
    ]
    if not todo:
        return lost
    shapes = {(path, name): (mod._buffers[name].shape, mod._buffers[name].dtype) for path, mod, name in todo}
    modules = {path: mod for path, mod, _ in todo}
    rebuilt: list[dict[tuple[str, str], torch.Tensor]] = []
    for fill in (0, 1):
        for path, mod, name in todo:
            shape, dtype = shapes[(path, name)]
            mod._buffers[name] = torch.full(shape, fill, dtype=dtype)
        with torch.no_grad():
            for path, mod in modules.items():
                owners[path]._init_weights(mod)
        rebuilt.append({(path, name): mod._buffers[name] for path, mod, name in todo})
    first, second = rebuilt
    lost += [
        f"{path}.{name}" if path else name
        for (path, name), value in second.items()
        if value is None or first[(path, name)] is None or value.is_meta or not _same(first[(path, name)], value)
    ]
    return lost


def _params_to_meta(model: nn.Module) -> None:
    """Move the parameters the device context missed to meta (``torch.normal(mean, std, size)`` ignores it)."""
    moved: dict[int, nn.Parameter] = {}  # a tied parameter stays one parameter
    for mod in model.modules():
        for name, p in list(mod._parameters.items()):
            if p is not None and not p.is_meta:
                if id(p) not in moved:
                    moved[id(p)] = nn.Parameter(p.to("meta"), requires_grad=p.requires_grad)
                mod._parameters[name] = moved[id(p)]


def build_on_meta(cls: type, config: Any) -> nn.Module:
    """``cls(config)`` with every parameter on the meta device and the non-persistent buffers on the CPU."""
    try:
        with torch.device("meta"):
            model = cls(copy.deepcopy(config))
        _params_to_meta(model)
        lost = rebuild_buffers(model)
        why = f"its _init_weights does not rebuild {lost[:3]}" if lost else ""
    except Exception as exc:  # noqa: BLE001 - any constructor that needs real tensors: build the previous way
        why = f"its constructor does not run on the meta device ({type(exc).__name__}: {str(exc)[:120]})"
    if not why:
        return model
    log.info("%s built on the CPU with meta parameters: %s", cls.__name__, why)
    with meta_parameters():
        return cls(copy.deepcopy(config))
