"""Poisoned snapshots are rejected as misses and nothing they name runs.

Every payload here is crafted by hand to run ``touch <sentinel>`` if any part
of it were executed (a pickle REDUCE, a graph target, a hook, a class, code
injected into generated source); the sentinel file must never appear.
"""

from __future__ import annotations

import copy
import io
import json
import os
import pickle
import subprocess

import pytest
import torch
import torch.fx
from test_snapshot_support import to_meta

from adstore.integration.errors import SnapshotError, UntrustedTarget
from adstore.integration.snapshot import FORMAT, VERSION, dump_module, load_module, summarize
from adstore.integration.snapshot.targets import allow_prefix, resolve_target

REJECT = ("untrusted_target", "corrupt_snapshot")


class Small(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x):
        return self.lin(x) + x.shape[0]


@pytest.fixture
def sentinel(tmp_path):
    path = tmp_path / "pwned"
    yield path
    assert not path.exists(), "a poisoned snapshot executed code"


@pytest.fixture(scope="module")
def fx_art():
    gm = torch.fx.symbolic_trace(Small())
    to_meta(gm)
    return dump_module(gm)


@pytest.fixture(scope="module")
def export_art():
    gm = torch.export.export(Small(), (torch.randn(2, 4),)).module()
    to_meta(gm)
    return dump_module(gm)


def _open(art):
    payload = torch.load(io.BytesIO(art["module.pt"]), weights_only=True)
    return json.loads(payload["structure"]), payload["tensors"]


def _craft(structure, tensors=(), hooks=b"[]"):
    buf = io.BytesIO()
    torch.save(
        {"format": FORMAT, "version": VERSION, "structure": json.dumps(structure), "tensors": list(tensors)}, buf
    )
    return {"module.pt": buf.getvalue(), "hooks.json": hooks}


def _rejected(art, reason=None, **kw) -> SnapshotError:
    with pytest.raises(SnapshotError) as exc:
        load_module(art, **kw)
    assert exc.value.reason in ((reason,) if reason else REJECT), exc.value
    return exc.value


def _touch(sentinel):
    return f"touch {sentinel}"


# ----------------------------------------------------------------------------- pickles
def test_plain_torch_save_of_graph_module_rejected(sentinel):
    gm = torch.fx.symbolic_trace(Small())
    buf = io.BytesIO()
    torch.save(gm, buf)
    _rejected({"module.pt": buf.getvalue(), "hooks.json": b"[]"})


class _Evil:
    def __init__(self, cmd):
        self.cmd = cmd

    def __reduce__(self):
        return (os.system, (self.cmd,))


class _EvilPopen:
    def __init__(self, cmd):
        self.cmd = cmd

    def __reduce__(self):
        return (subprocess.Popen, (["sh", "-c", self.cmd],))


@pytest.mark.parametrize("evil", [_Evil, _EvilPopen])
@pytest.mark.parametrize("protocol", [2, pickle.HIGHEST_PROTOCOL])
@pytest.mark.filterwarnings("ignore:Detected pickle protocol")
def test_raw_pickle_with_global_opcodes_rejected(sentinel, evil, protocol):
    raw = pickle.dumps({"format": FORMAT, "x": evil(_touch(sentinel))}, protocol=protocol)
    assert b"system" in raw or b"Popen" in raw
    err = _rejected({"module.pt": raw, "hooks.json": b"[]"})
    if isinstance(err, UntrustedTarget):
        assert "system" in err.qualname or "Popen" in err.qualname


def test_torch_save_zip_with_pickled_object_rejected(sentinel):
    buf = io.BytesIO()
    torch.save({"format": FORMAT, "version": VERSION, "structure": _Evil(_touch(sentinel)), "tensors": []}, buf)
    err = _rejected({"module.pt": buf.getvalue(), "hooks.json": b"[]"}, "untrusted_target")
    assert err.qualname == "posix.system"


@pytest.mark.parametrize("blob", [b"", b"garbage", b"PK\x03\x04broken zip"])
def test_garbage_is_corrupt(blob):
    _rejected({"module.pt": blob, "hooks.json": b"[]"}, "corrupt_snapshot")


def test_missing_or_bad_artifacts_are_corrupt(fx_art):
    _rejected({"hooks.json": b"[]"}, "corrupt_snapshot")
    _rejected({"module.pt": fx_art["module.pt"]}, "corrupt_snapshot")
    _rejected({**fx_art, "hooks.json": b"\xff\xfe"}, "corrupt_snapshot")
    _rejected({**fx_art, "hooks.json": b"{}"}, "corrupt_snapshot")
    _rejected({**fx_art, "hooks.json": b"[" * 100000}, "corrupt_snapshot")


def test_deeply_nested_structure_is_corrupt(fx_art):
    structure, tensors = _open(fx_art)
    structure["tree"]["graph"]["nodes"][1][3] = "DEEP"
    deep = '["t",' + '["l",' * 50000 + '["l"]' + "]" * 50001
    text = json.dumps(structure).replace('"DEEP"', deep)
    buf = io.BytesIO()
    torch.save({"format": FORMAT, "version": VERSION, "structure": text, "tensors": list(tensors)}, buf)
    _rejected({"module.pt": buf.getvalue(), "hooks.json": b"[]"}, "corrupt_snapshot")


# ----------------------------------------------------------------------------- graph targets
@pytest.mark.parametrize(
    "qualname",
    [
        "os.system",
        "posix.system",
        "subprocess.Popen",
        "subprocess.run",
        "builtins.eval",
        "builtins.exec",
        "builtins.__import__",
        "builtins.open",
        "torch.os.system",
        "torch.hub.load",
        "torch.load",
        "torch.serialization.pickle.loads",
        "torch.utils.cpp_extension.load_inline",
        "nosuch.module.fn",
    ],
)
def test_untrusted_call_function_target_rejected(fx_art, sentinel, qualname):
    structure, tensors = _open(fx_art)
    graph = structure["tree"]["graph"]
    graph["targets"][0] = qualname
    graph["nodes"].insert(1, ["pwn", "call_function", 0, ["t", _touch(sentinel)], ["d"], None, {}])
    err = _rejected(_craft(structure, tensors), "untrusted_target")
    assert err.qualname == qualname
    # summarize reads the same payload without resolving anything
    assert qualname in summarize(_craft(structure, tensors))["op_histogram"]


# Python functions that torch ships and that run code or touch files: the old deny-list
# ("anything under torch. but loaders") accepted every one of them.
_DANGEROUS = {
    "torch.utils.collect_env.run": lambda s: ["t", f"touch {s}"],
    "torch.fx.graph_module._exec_with_source": lambda s: ["t", f"import os; os.system('touch {s}')", ["d"]],
    "torch.from_file": lambda s: ["t", str(s), True, 4],
}


def _poison(art, qualname, sentinel, wired):
    """The graph of ``art`` with one more node calling ``qualname``, unused or returned."""
    import torch.utils.collect_env  # noqa: F401  (imported, so only the allow-list stands between)

    structure, tensors = _open(art)
    graph = structure["tree"]["graph"]
    graph["targets"].append(qualname)
    nodes = graph["nodes"]
    nodes.insert(
        len(nodes) - 1,
        ["pwn", "call_function", len(graph["targets"]) - 1, _DANGEROUS[qualname](sentinel), ["d"], None, {}],
    )
    if wired:
        nodes[-1][3] = ["t", ["t", nodes[-1][3][1], ["n", len(nodes) - 2]]]
    return _craft(structure, tensors)


@pytest.mark.parametrize("wired", [False, True], ids=["unused", "in_output"])
@pytest.mark.parametrize("qualname", sorted(_DANGEROUS))
def test_torch_functions_that_run_code_are_not_allow_listed(sentinel, tmp_path, monkeypatch, qualname, wired):
    from adstore.integration.snapshot import targets

    class Plain(torch.nn.Module):
        def forward(self, x):
            return x + 1

    plain_art = dump_module(torch.fx.symbolic_trace(Plain()))
    _rejected(_poison(plain_art, qualname, sentinel, wired), "untrusted_target")
    # Control: the same payload under an allow-list that accepts everything does run.
    control = tmp_path / "control"
    monkeypatch.setattr(targets, "_is_reviewed", lambda obj: True)
    monkeypatch.setattr(targets, "_cache", {})
    gm = load_module(_poison(plain_art, qualname, control, wired))
    gm(torch.randn(2, 4))
    assert control.exists(), "the control payload did not run: the test would prove nothing"


@pytest.mark.parametrize(
    "qualname",
    [
        "torch.ops.aten.add.Tensor",
        "torch.add",
        "torch.Tensor.add",
        "torch.nn.functional.silu",
        "torch._C._nn.linear",
        "torch.sym_int",
        "operator.getitem",
        "math.sqrt",
        "builtins.len",
        "torch.nn.modules.linear.Linear",
        "torch.fx.graph_module.GraphModule",
        "torch.Size",
    ],
)
def test_positive_list_accepts_what_graphs_contain(qualname):
    assert resolve_target(qualname) is not None


@pytest.mark.parametrize(
    "qualname",
    [
        "torch.save",
        "torch.jit.CompilationUnit",
        "torch.autograd.Function",
        "torch.Tensor.untyped_storage",
        "torch.ops.load_library",
        "torch.ops.aten.__class__",
        "adstore.store.fsutil.atomic_write",
        "torch.utils.data.DataLoader",
        "torch.nn.Module.load_state_dict",
    ],
)
def test_positive_list_refuses_the_rest_of_torch(qualname):
    with pytest.raises(UntrustedTarget):
        resolve_target(qualname)


@pytest.mark.parametrize(
    "cls",
    [
        "subprocess.Popen",
        "os._wrap_close",
        "collections.OrderedDict",
        "torch.Tensor",
        "nosuch.Module",
        "builtins.object",
    ],
)
def test_untrusted_module_class_rejected(fx_art, sentinel, cls):
    structure, tensors = _open(fx_art)
    structure["tree"]["children"][0][1]["class"] = cls
    _rejected(_craft(structure, tensors), "untrusted_target")


def test_unknown_graph_module_class_rejected(fx_art):
    structure, tensors = _open(fx_art)
    structure["tree"]["graph"]["gm_class"] = "subprocess.Popen"
    _rejected(_craft(structure, tensors), "untrusted_target")


def test_module_attribute_naming_untrusted_callable(fx_art, sentinel):
    structure, tensors = _open(fx_art)
    structure["tree"]["children"][0][1]["attrs"]["forward"] = ["fn", "os.system"]
    _rejected(_craft(structure, tensors), "untrusted_target")
    structure["tree"]["children"][0][1]["attrs"] = {"__class__": ["fn", "torch.nn.Linear"]}
    _rejected(_craft(structure, tensors))
    structure, tensors = _open(fx_art)
    for key in ("_forward_hooks", "_graph", "range_constraints"):  # module / GraphModule internals
        structure["tree"]["attrs"] = {key: ["d"]}
        _rejected(_craft(structure, tensors), "corrupt_snapshot")


def test_untrusted_pytree_type_and_type_annotation(export_art, fx_art):
    structure, tensors = _open(export_art)
    spec = json.loads(structure["tree"]["graph"]["codegen"]["out_spec"])
    spec[1]["type"] = "subprocess.Popen"
    structure["tree"]["graph"]["codegen"]["out_spec"] = json.dumps(spec)
    _rejected(_craft(structure, tensors), "untrusted_target")
    structure, tensors = _open(fx_art)
    structure["tree"]["graph"]["nodes"][0][5] = "os.system"
    _rejected(_craft(structure, tensors), "untrusted_target")


def test_untrusted_callable_in_meta_val_rejected(export_art):
    structure, tensors = _open(export_art)
    node = next(n for n in structure["tree"]["graph"]["nodes"] if "val" in n[6])
    node[6]["val"] = ["fn", "os.system"]
    _rejected(_craft(structure, tensors), "untrusted_target")
    # in other meta keys it is dropped (never resolved into a call) and the load succeeds
    structure, tensors = _open(export_art)
    node = next(n for n in structure["tree"]["graph"]["nodes"] if "val" in n[6])
    structure["meta_table"].append(["l", ["t", "x", ["fn", "os.system"]]])
    node[6]["source_fn_stack"] = len(structure["meta_table"]) - 1
    restored = load_module(_craft(structure, tensors))
    assert all("source_fn_stack" not in n.meta for n in restored.graph.nodes)


# ----------------------------------------------------------------------------- code injection into generated source
@pytest.mark.parametrize(
    "field, value",
    [
        ("name", "x = __import__('os').system('touch {s}')"),
        ("placeholder", "x=__import__('os').system('touch {s}')"),
        ("get_attr", "__class__.__init__.__globals__"),
        ("call_method", "__reduce_ex__"),
        ("call_module", "lin.__class__"),
        ("orig_args", "x=__import__('os').system('touch {s}')"),
    ],
)
def test_injection_into_generated_code_rejected(fx_art, export_art, sentinel, field, value):
    value = value.format(s=sentinel)
    structure, tensors = _open(export_art if field == "orig_args" else fx_art)
    nodes = structure["tree"]["graph"]["nodes"]
    if field == "name":
        nodes[0][0] = value
    elif field == "placeholder":
        nodes[0][2] = value
    elif field == "orig_args":
        structure["tree"]["graph"]["codegen"]["orig_args"] = [value]
    else:
        nodes.insert(1, ["pwn", field, value, ["t", ["n", 0]], ["d"], None, {}])
    _rejected(_craft(structure, tensors))


def test_bad_structure_records_are_corrupt(fx_art):
    structure, tensors = _open(fx_art)
    bad = copy.deepcopy(structure)
    bad["tree"]["graph"]["nodes"][1][3] = ["n", 999]
    _rejected(_craft(bad, tensors), "corrupt_snapshot")
    bad = copy.deepcopy(structure)
    bad["tree"]["graph"]["nodes"][1][1] = "call_anything"
    _rejected(_craft(bad, tensors), "corrupt_snapshot")
    bad = copy.deepcopy(structure)
    bad["tree"]["graph"]["nodes"][1][3] = ["zz", 1]
    _rejected(_craft(bad, tensors), "corrupt_snapshot")
    bad = copy.deepcopy(structure)
    bad["tree"]["children"][0][1]["params"][0][1] = ["P", [4, 4], [4, 1], "no_dtype", True]
    _rejected(_craft(bad, tensors), "corrupt_snapshot")
    bad = copy.deepcopy(structure)
    bad["version"] = 99
    _rejected(_craft(bad, tensors), "corrupt_snapshot")


# ----------------------------------------------------------------------------- hooks.json
@pytest.mark.parametrize(
    "params",
    [
        {"kind": "function", "qualname": "os.system"},
        {"kind": "partial", "target": {"kind": "function", "qualname": "builtins.exec"}, "keywords": {}},
        {"kind": "instance", "owner_class": "subprocess.Popen", "owner_state": {"args": "touch x"}},
        {"kind": "method", "bound": "owner", "owner_class": "torch.nn.Linear", "owner_state": {}, "func": "forward"},
        {"kind": "method", "bound": "module", "func": "os.system"},
    ],
)
def test_poisoned_hook_specs_rejected(fx_art, sentinel, params):
    hooks = json.dumps(
        [{"type": "importable", "scope": "", "phase": "pre", "with_module": False, "params": params}]
    ).encode()
    _rejected({**fx_art, "hooks.json": hooks}, "untrusted_target")


def test_unknown_hook_type_is_unsupported(fx_art):
    hooks = json.dumps([{"type": "pickle", "scope": "", "phase": "pre", "with_module": False, "params": {}}]).encode()
    _rejected({**fx_art, "hooks.json": hooks}, "unsupported_hook")


# ----------------------------------------------------------------------------- the allow-list itself
def test_allow_prefix_registry_is_narrow(monkeypatch):
    from adstore.integration.snapshot import targets

    monkeypatch.setattr(targets, "_user_prefixes", [])  # keep the process-wide registry clean
    monkeypatch.setattr(targets, "_cache", {})
    with pytest.raises(ValueError):
        allow_prefix("os.")
    with pytest.raises(ValueError):
        allow_prefix("builtins.")
    with pytest.raises(ValueError):
        allow_prefix("torch.")  # widening torch is what the positive list exists to prevent
    with pytest.raises(ValueError):
        load_module({}, allowed_prefixes=("subprocess",))
    with pytest.raises(UntrustedTarget):
        resolve_target("json.loads")
    allow_prefix("json.")
    assert resolve_target("json.loads") is json.loads
    with pytest.raises(UntrustedTarget):
        resolve_target("jsonevil.x")
    # re-exports are judged by where the object lives, not by the name used
    with pytest.raises(UntrustedTarget):
        resolve_target("json.decoder.re.compile")


# -- attribute walks at forward time -------------------------------------------------------------


def _graph_with(build) -> dict[str, bytes]:
    import builtins  # noqa: F401  (the graph names builtins.getattr)

    g = torch.fx.Graph()
    x = g.placeholder("x")
    g.output(build(g, x))
    return dump_module(torch.fx.GraphModule(torch.nn.Module(), g))


def test_getattr_to_a_dunder_is_rejected():
    """x.__class__.__init__.__globals__ would reach any module at forward time."""
    art = _graph_with(lambda g, x: g.call_function(getattr, (x, "__class__")))
    with pytest.raises(UntrustedTarget):
        load_module(art)


def test_getattr_with_a_computed_name_is_rejected():
    import operator

    art = _graph_with(lambda g, x: g.call_function(getattr, (x, g.call_function(operator.add, ("__cl", "ass__")))))
    with pytest.raises(UntrustedTarget):
        load_module(art)


def test_plain_getattr_and_methods_still_restore():
    art = _graph_with(lambda g, x: g.call_method("reshape", (g.call_function(getattr, (x, "T")), -1)))
    gm = load_module(art)
    t = torch.arange(6.0).reshape(2, 3)
    assert torch.equal(gm(t), t.T.reshape(-1))


@pytest.mark.parametrize(
    "qualname",
    [
        "torch",
        "torch.nn",
        "builtins.getattr",
        "builtins.hasattr",
        "operator.attrgetter",
        "operator.methodcaller",
        "operator.call",
    ],
)
def test_modules_and_attribute_getters_are_not_values(qualname):
    from adstore.integration.snapshot.values import ValueDecoder

    with pytest.raises(UntrustedTarget):
        ValueDecoder().decode(["fn", qualname])
