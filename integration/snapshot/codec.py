"""Structural snapshots of pre-weight-loading modules: ``dump_module`` / ``load_module`` / ``summarize``.

The snapshot is two artifacts (bytes; the pipeline cache stores them):

``module.pt``
    ``torch.save`` of a plain dict: ``format``, ``version``, ``structure`` (one
    JSON string: the module tree, graphs, symbols) and ``tensors`` (a list of
    real buffer/constant tensors).  No class, function or GraphModule is
    pickled, so it loads with ``torch.load(weights_only=True)`` and no extra
    safe globals.  Keeping the structure as one JSON string is also what makes
    decoding fast: the C JSON parser replaces thousands of pickle opcodes run
    by the pure-Python weights-only unpickler.
``hooks.json``
    UTF-8 JSON list of load-hook specs (:mod:`adstore.integration.snapshot.hooks`).

Saving never mutates the module for longer than the call: load hooks are
cleared while the payload is written and put back afterwards, also on error.
Any reason not to cache raises a :class:`~adstore.integration.errors.SnapshotError`
subclass with a named ``reason``; nothing partial is returned.
"""

from __future__ import annotations

import contextlib
import gc
import io
import json
import logging
import pickle
import re
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from adstore.integration.errors import CorruptSnapshot, SnapshotError, UnsupportedModule, UntrustedTarget
from adstore.integration.snapshot.hooks import clear_load_hooks, collect_hook_specs, reattach_hooks, restore_load_hooks
from adstore.integration.snapshot.targets import check_prefix
from adstore.integration.snapshot.tensor_meta import SymDecoder
from adstore.integration.snapshot.tree import TreeDecoder, TreeEncoder
from adstore.integration.snapshot.wire import (
    FORMAT,
    HOOKS_ARTIFACT,
    MODULE_ARTIFACT,
    VERSION,
    check_structure,
    iter_modules,
    new_structure,
    param_of,
    unpack_node,
)

__all__ = ["FORMAT", "VERSION", "MODULE_ARTIFACT", "HOOKS_ARTIFACT", "dump_module", "load_module", "summarize"]

logger = logging.getLogger(__name__)

_GLOBAL_RE = re.compile(r"GLOBAL ([\w.]+)")


def dump_module(module: torch.nn.Module) -> dict[str, bytes]:
    """Snapshot ``module`` into ``{"module.pt": bytes, "hooks.json": bytes}``.

    Raises ``UnsupportedModule``, ``UnsupportedHook``, ``ForwardHookPresent`` or
    ``MaterializedParameters`` when the module cannot be cached; the module is
    left exactly as it was either way.
    """
    if not isinstance(module, torch.nn.Module):
        raise UnsupportedModule(f"cannot snapshot a {type(module).__qualname__}: not a torch.nn.Module")
    specs = collect_hook_specs(module)
    saved = clear_load_hooks(module)
    try:
        enc = TreeEncoder()
        tree = enc.encode(module)
        structure = new_structure(
            torch_version=torch.__version__,
            graph_modules=enc.graph_count,
            symbols=enc.values.symbols.symbols,
            meta_table=enc.meta_table.values,
            tree=tree,
        )
        text = json.dumps(structure, allow_nan=False, separators=(",", ":"))
        buf = io.BytesIO()
        torch.save({"format": FORMAT, "version": VERSION, "structure": text, "tensors": enc.values.tensors}, buf)
    except SnapshotError:
        raise
    except (TypeError, ValueError, RuntimeError, AttributeError) as exc:
        raise UnsupportedModule(f"module cannot be encoded: {exc}") from exc
    finally:
        restore_load_hooks(saved)
    hooks = json.dumps(specs, allow_nan=False, separators=(",", ":")).encode("utf-8")
    logger.debug(
        "snapshot: %d graph modules, %d tensors, %d hook specs, %d bytes",
        enc.graph_count,
        len(enc.values.tensors),
        len(specs),
        buf.getbuffer().nbytes,
    )
    return {MODULE_ARTIFACT: buf.getvalue(), HOOKS_ARTIFACT: hooks}


def _read_payload(artifacts: Mapping[str, bytes]) -> tuple[dict[str, Any], list[torch.Tensor]]:
    data = artifacts.get(MODULE_ARTIFACT) if isinstance(artifacts, Mapping) else None
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise CorruptSnapshot(f"snapshot has no {MODULE_ARTIFACT} bytes")
    try:
        payload = torch.load(io.BytesIO(bytes(data)), weights_only=True, map_location="cpu")
    except pickle.UnpicklingError as exc:
        # weights_only names the global it refused; that is an untrusted target, not noise.
        match = _GLOBAL_RE.search(str(exc))
        if match:
            raise UntrustedTarget(match.group(1)) from None
        raise CorruptSnapshot(f"{MODULE_ARTIFACT} is not a weights-only payload: {str(exc)[:200]}") from None
    except Exception as exc:  # zip/format errors of every kind
        raise CorruptSnapshot(f"{MODULE_ARTIFACT} does not load: {type(exc).__name__}: {str(exc)[:200]}") from None
    if not isinstance(payload, dict) or payload.get("format") != FORMAT:
        raise CorruptSnapshot(f"{MODULE_ARTIFACT} is not an adstore snapshot")
    if payload.get("version") != VERSION:
        raise CorruptSnapshot(f"unsupported snapshot version {payload.get('version')!r}")
    tensors = payload.get("tensors")
    if not isinstance(tensors, list) or not all(isinstance(t, torch.Tensor) for t in tensors):
        raise CorruptSnapshot("snapshot tensors are not a list of tensors")
    text = payload.get("structure")
    if not isinstance(text, str):
        raise CorruptSnapshot("snapshot structure is missing")
    try:
        structure = json.loads(text)
    except (ValueError, RecursionError) as exc:
        raise CorruptSnapshot(f"snapshot structure is not JSON: {exc}") from None
    return check_structure(structure), tensors


@contextlib.contextmanager
def _gc_paused():
    """Pause the cyclic GC while thousands of nodes/fake tensors are allocated.

    A restore allocates many small container objects; with a large heap (a
    model, a ShapeEnv) every generation-2 collection they trigger walks all of
    it, which made decode time swing by 2-4x.  The collector is re-enabled (if
    it was on) on exit, errors included; no garbage is lost, only deferred.
    """
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def _read_hooks(artifacts: Mapping[str, bytes]) -> list[Any]:
    data = artifacts.get(HOOKS_ARTIFACT)
    if data is None:
        raise CorruptSnapshot(f"snapshot has no {HOOKS_ARTIFACT}")
    try:
        specs = json.loads(bytes(data).decode("utf-8"))
    except (UnicodeDecodeError, ValueError, TypeError, RecursionError) as exc:
        raise CorruptSnapshot(f"{HOOKS_ARTIFACT} is not UTF-8 JSON: {exc}") from None
    if not isinstance(specs, list):
        raise CorruptSnapshot(f"{HOOKS_ARTIFACT} is not a list")
    return specs


def load_module(artifacts: Mapping[str, bytes], *, allowed_prefixes: Sequence[str] = ()) -> torch.nn.Module:
    """Rebuild the module from :func:`dump_module`'s artifacts and reattach its load hooks.

    Raises ``UntrustedTarget`` if the payload names anything outside the allow-list
    (built-in prefixes, :func:`~adstore.integration.snapshot.targets.allow_prefix`, and
    ``allowed_prefixes``) and ``CorruptSnapshot`` for anything malformed; in both
    cases nothing named by the payload has been called.
    """
    extra = tuple(check_prefix(p) for p in allowed_prefixes)
    with _gc_paused():
        return _load(artifacts, extra)


def _load(artifacts: Mapping[str, bytes], extra: tuple[str, ...]) -> torch.nn.Module:
    structure, tensors = _read_payload(artifacts)
    specs = _read_hooks(artifacts)
    try:
        syms = SymDecoder(structure.get("symbols") or {})
        table = structure.get("meta_table") or []
        if not isinstance(table, list):
            raise CorruptSnapshot("meta table is not a list")
        decoder = TreeDecoder(tensors=tensors, syms=syms, extra_prefixes=extra, meta_table=table)
        module = decoder.module(structure["tree"], "")
        reattach_hooks(module, specs, allowed_prefixes=extra)
    except SnapshotError:
        raise
    except Exception as exc:  # malformed records surface as arbitrary Python errors
        raise CorruptSnapshot(f"snapshot does not rebuild: {type(exc).__name__}: {str(exc)[:300]}") from exc
    return module


def summarize(artifacts: Mapping[str, bytes]) -> dict[str, Any]:
    """A JSON-safe summary of a snapshot, without rebuilding or resolving anything it names."""
    structure, tensors = _read_payload(artifacts)
    try:
        specs = _read_hooks(artifacts)
    except CorruptSnapshot:
        specs = []
    graphs: list[dict[str, Any]] = []
    ops: Counter[str] = Counter()
    by_op: Counter[str] = Counter()
    classes: Counter[str] = Counter()
    counts = {"modules": 0, "parameters": 0, "parameter_numel": 0, "buffers": 0}
    try:
        for path, node in iter_modules(structure["tree"]):
            counts["modules"] += 1
            classes[str(node.get("class"))] += 1
            for _, spec in node.get("params", ()):
                param = param_of(spec)
                if param is None:  # absent, or an alias of a parameter counted already
                    continue
                counts["parameters"] += 1
                n = 1
                for s in param.shape:
                    n *= int(s)
                counts["parameter_numel"] += n
            counts["buffers"] += sum(1 for b in node.get("buffers", ()) if b[1] is not None)
            g = node.get("graph")
            if isinstance(g, dict):
                targets = g.get("targets", [])
                nodes = g.get("nodes", [])
                for rec in nodes:
                    op, target = unpack_node(rec)[1:3]
                    by_op[str(op)] += 1
                    if op == "call_function" and isinstance(target, int) and 0 <= target < len(targets):
                        ops[str(targets[target])] += 1
                    elif op == "call_method":
                        ops[f"method:{target}"] += 1
                graphs.append({"path": path, "class": g.get("gm_class"), "nodes": len(nodes)})
    except (TypeError, ValueError, IndexError, KeyError, AttributeError) as exc:
        raise CorruptSnapshot(f"snapshot structure is malformed: {exc}") from None
    hook_types = Counter(str(s.get("type")) if isinstance(s, dict) else "<invalid>" for s in specs)
    return {
        "format": structure.get("format"),
        "version": structure.get("version"),
        "torch": structure.get("torch"),
        "graph_modules": len(graphs),
        "graphs": graphs,
        "nodes": sum(g["nodes"] for g in graphs),
        "nodes_by_op": dict(by_op),
        "op_histogram": dict(ops.most_common()),
        "module_classes": dict(classes.most_common()),
        **counts,
        "tensors": len(tensors),
        "tensor_bytes": sum(t.numel() * t.element_size() for t in tensors if t.device.type != "meta"),
        "symbols": sorted((structure.get("symbols") or {}).keys()),
        "hooks": {"total": len(specs), "by_type": dict(hook_types)},
        "artifact_bytes": {k: len(v) for k, v in artifacts.items() if isinstance(v, (bytes, bytearray))},
    }
