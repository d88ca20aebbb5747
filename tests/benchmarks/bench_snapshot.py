"""Snapshot codec benchmark: encode/decode time and payload size on an exported 24-layer transformer.

Side by side, in one run, on the same graph:

* adstore    ``dump_module`` / ``load_module`` (structural payload, weights-only load)
* export     ``torch.export.save`` / ``torch.export.load`` on the ExportedProgram
             (decode also reported with ``.module()``, which is what a restore needs;
             its payload includes the weights, the snapshot's does not)
* pickler    ``torch.fx._graph_pickler.GraphPickler`` on the ``.module()`` GraphModule
             and on ``ep.graph_module`` (where it works; failures are reported)
* floor      rebuilding the same graph and module tree from an in-memory node list that
             is already decoded (targets are objects, args hold node indices, tensor
             specs are tuples): module tree with meta parameters, nodes with the same
             meta, FakeTensor ``meta["val"]`` + ``tensor_meta``, then ``recompile()`` —
             everything a restore does except decoding bytes.

Run: ``python tests/benchmarks/bench_snapshot.py [--layers 24] [--repeat 5]``.
Figures go to stdout and ``bench-results/bench_snapshot.json``.
"""

from __future__ import annotations

import argparse
import io
import json
import statistics
import sys
import time
import warnings

import torch
import torch.fx
from bench_results import results_dir

from adstore.integration.snapshot import dump_module, load_module

warnings.filterwarnings("ignore")


def build(layers: int, hidden: int):
    import transformers as tf

    cfg = tf.LlamaConfig(
        vocab_size=256,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        use_cache=False,
    )
    torch.manual_seed(0)
    model = tf.LlamaForCausalLM(cfg).eval()
    ids = torch.randint(0, 256, (1, 16))
    t0 = time.perf_counter()
    ep = torch.export.export(model, (), {"input_ids": ids})
    return ep, ids, time.perf_counter() - t0


def to_meta(module: torch.nn.Module) -> None:
    seen: dict[int, torch.nn.Parameter] = {}
    for mod in module.modules():
        for name, p in list(mod._parameters.items()):
            if p is not None:
                if id(p) not in seen:
                    seen[id(p)] = torch.nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=p.requires_grad)
                mod._parameters[name] = seen[id(p)]


def timed(fn, repeat: int):
    """(median CPU seconds, min CPU seconds, last result) over ``repeat`` runs (GC paused, see race)."""
    r = race({"x": fn}, repeat)["x"]
    return r


def race(fns: dict, repeat: int) -> dict:
    """Interleaved runs (A, B, A, B, ...) so CPU contention hits every contender alike.

    Timed in process CPU time (the machine is shared; wall time mostly measures the
    neighbours) with the cyclic GC paused for every contender, as ``load_module``
    does internally.  Returns name -> (median s, min s, last result).
    """
    import gc

    times: dict = {k: [] for k in fns}
    outs: dict = {}
    for _ in range(repeat):
        for name, fn in fns.items():
            gc.collect()
            gc.disable()
            try:
                t0 = time.process_time()
                outs[name] = fn()
                times[name].append(time.process_time() - t0)
            finally:
                gc.enable()
    race.last_times = times  # type: ignore[attr-defined]  (raw samples, for paired ratios)
    return {k: (statistics.median(v), min(v), outs[k]) for k, v in times.items()}


# ----------------------------------------------------------------------------- the floor
class _Ref:
    __slots__ = ("i",)

    def __init__(self, i: int) -> None:
        self.i = i


def _prepare_floor(gm: torch.fx.GraphModule):
    """Decoded, in-memory form of ``gm``: what a restore would have after parsing bytes."""
    from torch.fx.node import map_aggregate

    index = {n: i for i, n in enumerate(gm.graph.nodes)}
    nodes = []
    for n in gm.graph.nodes:
        ref = lambda a: _Ref(index[a]) if isinstance(a, torch.fx.Node) else a  # noqa: E731
        meta = {k: v for k, v in n.meta.items() if k not in ("val", "tensor_meta", "from_node")}
        val = n.meta.get("val")
        spec = None
        if isinstance(val, torch.Tensor):
            tm = n.meta.get("tensor_meta")
            spec = (
                tuple(val.shape),
                tuple(val.stride()),
                val.dtype,
                val.device,
                val.requires_grad,
                tm is not None,
                getattr(tm, "memory_format", None),
                getattr(tm, "requires_grad", False),
            )
        nodes.append(
            (n.op, n.name, n.target, map_aggregate(n.args, ref), map_aggregate(n.kwargs, ref), n.type, meta, spec)
        )
    tree = []
    for path, m in gm.named_modules():
        if m is gm:
            continue
        tree.append((path, [(k, tuple(p.shape), p.dtype) for k, p in m._parameters.items()], list(m._buffers.items())))
    return nodes, tree, gm.graph._codegen, [(k, b) for k, b in gm._buffers.items()]


def _floor_rebuild(prepared):
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
    from torch.export._unlift import _StatefulGraphModule
    from torch.fx.experimental.symbolic_shapes import ShapeEnv
    from torch.fx.node import map_aggregate
    from torch.fx.passes.shape_prop import TensorMetadata

    nodes, tree, codegen, root_buffers = prepared
    fake_mode = FakeTensorMode(shape_env=ShapeEnv(), allow_non_fake_inputs=True)  # a restore needs one too
    gm = _StatefulGraphModule._create(torch.nn.Module(), torch.fx.Graph())
    for path, params, buffers in tree:
        parent, _, name = path.rpartition(".")
        mod = torch.nn.Module()
        for k, shape, dtype in params:
            mod._parameters[k] = torch.nn.Parameter(torch.empty(shape, dtype=dtype, device="meta"))
        for k, b in buffers:
            mod._buffers[k] = b
        (gm.get_submodule(parent) if parent else gm)._modules[name] = mod
    for k, b in root_buffers:
        gm._buffers[k] = b
    graph = torch.fx.Graph()
    built: list[torch.fx.Node] = []
    deref = lambda a: built[a.i] if isinstance(a, _Ref) else a  # noqa: E731
    for op, name, target, args, kwargs, type_, meta, spec in nodes:
        node = graph.create_node(
            op, target, map_aggregate(args, deref), map_aggregate(kwargs, deref), name=name, type_expr=type_
        )
        node.meta = dict(meta)
        if spec is not None:
            shape, stride, dtype, device, grad, has_tm, memory_format, tm_grad = spec
            val = FakeTensor(fake_mode, torch.empty_strided(shape, stride, dtype=dtype, device="meta"), device)
            if grad:
                val.requires_grad_(True)
            node.meta["val"] = val
            if has_tm:  # built directly, like the restore does (memory format known)
                node.meta["tensor_meta"] = TensorMetadata(
                    val.shape, val.dtype, tm_grad, val.stride(), memory_format, False, {}
                )
        built.append(node)
    graph._codegen = codegen
    gm.graph = graph  # recompile()
    return gm


# ----------------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=7)
    args = ap.parse_args(argv)

    ep, ids, export_s = build(args.layers, args.hidden)
    gm = ep.module()
    ref_code = gm.code
    weights = {k: v.detach().clone() for k, v in gm.state_dict().items()}
    ref_out = gm(input_ids=ids).logits
    to_meta(gm)
    n_nodes = len(gm.graph.nodes)
    prefixes = ("transformers.",)
    results: dict = {
        "layers": args.layers,
        "hidden": args.hidden,
        "nodes": n_nodes,
        "export_s": export_s,
        "repeat": args.repeat,
    }

    # adstore
    load_module(dump_module(gm), allowed_prefixes=prefixes)  # warm imports / caches for every contender
    enc_s, enc_min, art = timed(lambda: dump_module(gm), args.repeat)
    # floor, prepared from a restored module (same graph, same meta)
    prepared = _prepare_floor(load_module(art, allowed_prefixes=prefixes))
    _floor_rebuild(prepared)
    raced = race(
        {"adstore": lambda: load_module(art, allowed_prefixes=prefixes), "floor": lambda: _floor_rebuild(prepared)},
        args.repeat,
    )
    samples = race.last_times  # type: ignore[attr-defined]
    # each decode sample divided by the floor sample run right after it: contention on a shared
    # machine comes and goes, and adjacent runs see the same neighbours
    paired = statistics.median(a / f for a, f in zip(samples["adstore"], samples["floor"], strict=True))
    dec_s, dec_min, restored = raced["adstore"]
    floor_s, floor_min, floor_gm = raced["floor"]
    assert restored.code == ref_code and floor_gm.code == ref_code
    restored.load_state_dict(weights, assign=True)
    assert torch.equal(restored(input_ids=ids).logits, ref_out)
    results["adstore"] = {
        "encode_s": enc_s,
        "decode_s": dec_s,
        "decode_min_s": dec_min,
        "bytes": sum(len(v) for v in art.values()),
    }
    results["floor"] = {"decode_s": floor_s, "decode_min_s": floor_min}
    results["samples_ms"] = {k: [round(t * 1e3, 1) for t in v] for k, v in samples.items()}

    # torch.export.save / load
    def export_save():
        buf = io.BytesIO()
        torch.export.save(ep, buf)
        return buf.getvalue()

    try:
        esave_s, _, blob = timed(export_save, args.repeat)
        eload_s, _, ep2 = timed(lambda: torch.export.load(io.BytesIO(blob)), args.repeat)
        emod_s, _, _ = timed(lambda: torch.export.load(io.BytesIO(blob)).module(), args.repeat)
        results["export"] = {
            "encode_s": esave_s,
            "decode_s": eload_s,
            "decode_module_s": emod_s,
            "bytes": len(blob),
            "weight_bytes": sum(v.numel() * v.element_size() for v in weights.values()),
        }
    except Exception as exc:  # report, do not hide
        results["export"] = {"error": f"{type(exc).__name__}: {exc}"[:300]}

    # GraphPickler
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx._graph_pickler import GraphPickler
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    for label, target in (("pickler_module", gm), ("pickler_graph_module", ep.graph_module)):
        try:
            pmode = FakeTensorMode(shape_env=ShapeEnv(), allow_non_fake_inputs=True)
            penc_s, _, pblob = timed(lambda target=target: GraphPickler.dumps(target), args.repeat)
            pdec_s, _, _ = timed(lambda pblob=pblob, pmode=pmode: GraphPickler.loads(pblob, pmode), args.repeat)
            results[label] = {"encode_s": penc_s, "decode_s": pdec_s, "bytes": len(pblob)}
        except Exception as exc:
            results[label] = {"error": f"{type(exc).__name__}: {exc}"[:300]}

    # report
    a, f = results["adstore"], results["floor"]
    ratios = {
        "decode_vs_floor": a["decode_s"] / f["decode_s"],
        "decode_vs_floor_min": a["decode_min_s"] / f["decode_min_s"],
        "decode_vs_floor_paired": paired,
    }
    for name in ("export", "pickler_module", "pickler_graph_module"):
        other = results.get(name, {})
        if "decode_s" in other:
            ratios[f"{name}_decode_vs_adstore"] = other["decode_s"] / a["decode_s"]
            ratios[f"{name}_encode_vs_adstore"] = other["encode_s"] / a["encode_s"]
            ratios[f"{name}_bytes_vs_adstore"] = other["bytes"] / a["bytes"]
        if "decode_module_s" in other:
            ratios[f"{name}_decode_module_vs_adstore"] = other["decode_module_s"] / a["decode_s"]
    results["ratios"] = ratios

    print("decode samples ms:", results["samples_ms"])
    print(f"graph: {args.layers} layers, hidden {args.hidden}, {n_nodes} nodes (export took {export_s:.1f}s)")
    print(f"{'contender':<22}{'encode ms':>11}{'decode ms':>11}{'bytes':>12}")
    for name in ("adstore", "floor", "export", "pickler_module", "pickler_graph_module"):
        r = results.get(name, {})
        if "error" in r:
            print(f"{name:<22}  failed: {r['error'][:90]}")
            continue
        enc = f"{r['encode_s'] * 1e3:11.1f}" if "encode_s" in r else f"{'-':>11}"
        byt = f"{r['bytes']:12d}" if "bytes" in r else f"{'-':>12}"
        print(f"{name:<22}{enc}{r['decode_s'] * 1e3:11.1f}{byt}")
        if "decode_module_s" in r:
            print(f"{'  + .module()':<22}{'':>11}{r['decode_module_s'] * 1e3:11.1f}")
    for k, v in ratios.items():
        print(f"ratio {k:<40} {v:6.2f}x")
    (results_dir() / "bench_snapshot.json").write_text(json.dumps(results, indent=2))
    return results


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
