"""Load-hook specs: every type round-trips through JSON and transforms a state dict like the original."""

from __future__ import annotations

import copy
import functools
import json

import pytest
import torch
from test_snapshot_support import to_meta

from adstore.integration.errors import ConfigError, UnsupportedHook, UntrustedTarget
from adstore.integration.snapshot import dump_module, load_module
from adstore.integration.snapshot.hooks import (
    AliasHook,
    DedupHook,
    TPShardHook,
    clear_load_hooks,
    collect_hook_specs,
    hook_types,
    reattach_hooks,
    register_hook_type,
    restore_load_hooks,
)

HERE = __name__.split(".")[0] + "."
CALLS: list[str] = []


# ----------------------------------------------------------------------------- importable hooks
def scale_pre_hook(state_dict, prefix, local_metadata, strict, missing, unexpected, errors, factor=1.0):
    key = prefix + "weight"
    if key in state_dict:
        state_dict[key] = state_dict[key] * factor


def rename_with_module(module, state_dict, prefix, local_metadata, strict, missing, unexpected, errors):
    if prefix + "w_old" in state_dict:
        state_dict[prefix + "weight"] = state_dict.pop(prefix + "w_old")
    CALLS.append(f"with_module:{type(module).__name__}")


def record_post_hook(module, incompatible_keys):
    CALLS.append(f"post:{type(module).__name__}:{len(incompatible_keys.missing_keys)}")


class Scaler:
    """A hook owner whose whole state is public plain data."""

    def __init__(self, factor: float, keys: tuple[str, ...]) -> None:
        self.factor = factor
        self.keys = keys

    def pre(self, state_dict, prefix, *rest):
        for k in self.keys:
            if prefix + k in state_dict:
                state_dict[prefix + k] = state_dict[prefix + k] * self.factor

    def __call__(self, state_dict, prefix, *rest):
        self.pre(state_dict, prefix, *rest)


class Private:
    def __init__(self) -> None:
        self._secret = 1

    def pre(self, *args):
        pass


class Layer(torch.nn.Module):
    def __init__(self, fan_in: int = 8, fan_out: int = 8) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(fan_out, fan_in))
        self.bias = torch.nn.Parameter(torch.randn(fan_out))

    def own_hook(self, state_dict, prefix, *rest):
        if prefix + "bias" in state_dict:
            state_dict[prefix + "bias"] = state_dict[prefix + "bias"] + self.weight.shape[0]

    def forward(self, x):
        return torch.nn.functional.linear(x, self.weight, self.bias)


class Model(torch.nn.Module):
    def __init__(self, a: tuple[int, int] = (8, 8), b: tuple[int, int] = (8, 8)) -> None:
        super().__init__()
        self.a = Layer(*a)
        self.b = Layer(*b)

    def forward(self, x):
        return self.b(self.a(x))


def _full_sd(seed=0):
    g = torch.Generator().manual_seed(seed)
    return {k: torch.randn(v.shape, generator=g) for k, v in Model().state_dict().items()}


def _restore(model):
    to_meta(model)
    art = dump_module(model)
    json.loads(art["hooks.json"])
    return load_module(art, allowed_prefixes=(HERE,)), art


def _apply(model, sd):
    """Run every load hook via load_state_dict(assign=True) and return the resulting tensors."""
    model.load_state_dict(copy.deepcopy(sd), assign=True, strict=False)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def _roundtrip_and_compare(register, sd=None, factory=Model):
    """Register hooks on a fresh model via ``register``; compare original vs restored load results."""
    torch.manual_seed(0)
    orig = factory()
    register(orig)
    clone = copy.deepcopy(orig)
    restored, art = _restore(clone)
    sd = sd if sd is not None else _full_sd()
    _same(_apply(orig, sd), _apply(restored, sd))
    return orig, restored, json.loads(art["hooks.json"])


# ----------------------------------------------------------------------------- built-in spec types
def test_tp_shard_owner_scope_and_root_scope():
    def register(m):
        m.a._register_load_state_dict_pre_hook(TPShardHook("weight", (8, 8), 0, 1, 2))
        m._register_load_state_dict_pre_hook(TPShardHook("b.weight", (8, 8), 1, 0, 4, min_local_shape=2))

    # the module already has the local (sharded) shapes; the checkpoint is full size
    sharded = functools.partial(Model, a=(8, 4), b=(2, 8))
    sd = _full_sd()
    sd["a.bias"] = sd["a.bias"][:4]
    orig, restored, specs = _roundtrip_and_compare(register, sd=sd, factory=sharded)
    assert torch.equal(restored.a.weight, sd["a.weight"][4:]) and torch.equal(restored.b.weight, sd["b.weight"][:, :2])
    assert [(s["type"], s["scope"], s["phase"], s["with_module"]) for s in specs] == [
        ("shard_tp", "", "pre", False),
        ("shard_tp", "a", "pre", False),
    ]
    assert restored.a.weight.shape == (4, 8) and restored.b.weight.shape == (8, 2)
    rebuilt = restored.a._load_state_dict_pre_hooks
    assert [h.hook for h in rebuilt.values()] == [TPShardHook("weight", (8, 8), 0, 1, 2)]


def test_tp_shard_fused_blocks_pick_each_block():
    full = torch.arange(12 * 2.0).reshape(12, 2)  # q(4) | k(4) | v(4)
    hook = TPShardHook("w", (12, 2), 0, rank=1, world_size=2, min_local_shape=2, fused_dims=(4, 4, 4))
    sd = {"p.w": full.clone()}
    hook(sd, "p.", {}, True, [], [], [])
    expected = torch.cat([full[2:4], full[6:8], full[10:12]])
    assert torch.equal(sd["p.w"], expected)
    plain = TPShardHook("w", (12, 2), 0, rank=1, world_size=3)
    sd = {"w": full.clone()}
    plain(sd, "", {}, True, [], [], [])
    assert torch.equal(sd["w"], full[4:8]) and sd["w"].is_contiguous()
    assert sd["w"].untyped_storage().nbytes() == 4 * 2 * 4  # a copy, not a view of the checkpoint
    # already-local or unrelated shapes pass through untouched
    sd = {"p.w": expected.clone()}
    hook(sd, "p.", {}, True, [], [], [])
    assert torch.equal(sd["p.w"], expected)
    rebuilt = TPShardHook.from_spec(json.loads(json.dumps(hook.to_spec())))
    assert rebuilt == hook and rebuilt.local_shape == (6, 2)


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(shape=(10, 4), dim=0, rank=0, world_size=4), "shape"),
        (dict(shape=(8, 4), dim=0, rank=0, world_size=2, min_local_shape=3), "min_local_shape"),
        (dict(shape=(12, 4), dim=0, rank=0, world_size=2, fused_dims=(4, 4)), "fused_dims"),
        (dict(shape=(8, 4), dim=0, rank=2, world_size=2), "rank"),
        (dict(shape=(8, 4), dim=2, rank=0, world_size=2), "dim"),
    ],
)
def test_tp_shard_bad_divisibility_is_a_clear_error(kwargs, field):
    with pytest.raises(ConfigError) as exc:
        TPShardHook("w", **kwargs)
    assert exc.value.field == field


def test_dedup_and_alias_roundtrip_and_transform():
    def register(m):
        m._register_load_state_dict_pre_hook(DedupHook("a.weight", ["b.weight"], mode="copy"))
        m.b._register_load_state_dict_pre_hook(AliasHook({"w_old": "weight", "b_old": "bias"}))

    sd = _full_sd()
    sd["b.w_old"] = sd.pop("b.weight")
    sd["b.b_old"] = sd.pop("b.bias")
    orig, restored, specs = _roundtrip_and_compare(register, sd=sd)
    assert [s["type"] for s in specs] == ["dedup", "alias"]
    assert torch.equal(restored.b.weight, sd["a.weight"])  # copy mode ties after load
    assert torch.equal(restored.b.bias, sd["b.b_old"])


def test_dedup_drop_fills_kept_from_twin():
    hook = DedupHook("emb.weight", ["lm_head.weight"])
    sd = {"lm_head.weight": torch.ones(2)}
    hook(sd, "", {}, True, [], [], [])
    assert list(sd) == ["emb.weight"] and torch.equal(sd["emb.weight"], torch.ones(2))
    assert DedupHook.from_spec(hook.to_spec()) == hook
    with pytest.raises(ConfigError):
        DedupHook("a", [], mode="drop")
    with pytest.raises(ConfigError):
        DedupHook("a", ["b"], mode="merge")


# ----------------------------------------------------------------------------- importable types
def test_importable_function_partial_and_methods():
    def register(m):
        m.a._register_load_state_dict_pre_hook(scale_pre_hook)
        m.a._register_load_state_dict_pre_hook(functools.partial(scale_pre_hook, factor=3.0))
        m.b._register_load_state_dict_pre_hook(m.b.own_hook)
        m.b._register_load_state_dict_pre_hook(Scaler(0.5, ("bias",)).pre)
        m._register_load_state_dict_pre_hook(Scaler(2.0, ("a.bias", "b.weight")))

    orig, restored, specs = _roundtrip_and_compare(register)
    kinds = [s["params"]["kind"] for s in specs]
    assert kinds == ["instance", "function", "partial", "method", "method"]
    assert [s["params"].get("bound") for s in specs if s["params"]["kind"] == "method"] == ["module", "owner"]
    owner_hook = list(restored.b._load_state_dict_pre_hooks.values())[1].hook
    assert isinstance(owner_hook.__self__, Scaler) and owner_hook.__self__.keys == ("bias",)
    assert list(restored.b._load_state_dict_pre_hooks.values())[0].hook.__self__ is restored.b


def test_post_hooks_and_with_module_pre_hooks():
    def register(m):
        m.a.register_load_state_dict_pre_hook(rename_with_module)  # public API: with_module=True
        m.register_load_state_dict_post_hook(record_post_hook)

    sd = _full_sd()
    sd["a.w_old"] = sd.pop("a.weight")
    CALLS.clear()
    orig, restored, specs = _roundtrip_and_compare(register, sd=sd)
    assert [(s["scope"], s["phase"], s["with_module"]) for s in specs] == [("", "post", True), ("a", "pre", True)]
    assert CALLS == ["with_module:Layer", "post:Model:0", "with_module:Layer", "post:Model:0"]


def test_registration_order_is_preserved():
    torch.manual_seed(0)
    m = Model()
    m.a._register_load_state_dict_pre_hook(functools.partial(scale_pre_hook, factor=2.0))
    m.a._register_load_state_dict_pre_hook(TPShardHook("weight", (8, 8), 0, 0, 2))
    specs = collect_hook_specs(m)
    restored, _ = _restore(m)
    assert collect_hook_specs(restored) == specs


# ----------------------------------------------------------------------------- unsupported hooks
@pytest.mark.parametrize(
    "make",
    [
        lambda m: lambda *a: None,
        lambda m: functools.partial(scale_pre_hook, {}),
        lambda m: Private().pre,
        lambda m: Scaler(1.0, (object(),)).pre,
    ],
)
def test_closures_and_unrepresentable_hooks_skip(make):
    m = Model()
    to_meta(m)
    m.b._register_load_state_dict_pre_hook(make(m))
    with pytest.raises(UnsupportedHook) as exc:
        dump_module(m)
    assert exc.value.reason == "unsupported_hook" and "b" in str(exc.value)
    assert len(m.b._load_state_dict_pre_hooks) == 1


def test_builtin_type_as_post_hook_is_refused():
    m = Model()
    m.a.register_load_state_dict_post_hook(TPShardHook("weight", (8, 8), 0, 0, 2))
    with pytest.raises(UnsupportedHook, match="shard_tp"):
        collect_hook_specs(m)


def test_clear_and_restore_keep_handles_working():
    m = Model()
    handle = m.a._register_load_state_dict_pre_hook(scale_pre_hook)
    saved = clear_load_hooks(m)
    assert not m.a._load_state_dict_pre_hooks
    restore_load_hooks(saved)
    assert len(m.a._load_state_dict_pre_hooks) == 1
    handle.remove()
    assert not m.a._load_state_dict_pre_hooks


# ----------------------------------------------------------------------------- registry
class Transpose:
    """A hook kind the built-in types do not know (private state), added through the registry."""

    def __init__(self, key: str) -> None:
        self._key = key

    def __call__(self, state_dict, prefix, *rest):
        if prefix + self._key in state_dict:
            state_dict[prefix + self._key] = state_dict[prefix + self._key].t().contiguous()


def test_registry_extension_roundtrip_and_unknown_type():
    m = Model()
    m.a._register_load_state_dict_pre_hook(Transpose("weight"))
    with pytest.raises(UnsupportedHook):
        collect_hook_specs(m)
    register_hook_type(
        "transpose_test",
        match=lambda h: isinstance(h, Transpose),
        encode=lambda h, mod: {"key": h._key},
        rebuild=lambda p, mod: Transpose(p["key"]),
        phases=("pre",),
        replace=True,
    )
    assert "transpose_test" in hook_types()
    orig, restored, specs = _roundtrip_and_compare(
        lambda mm: mm.a._register_load_state_dict_pre_hook(Transpose("weight"))
    )
    assert specs == [
        {"type": "transpose_test", "scope": "a", "phase": "pre", "with_module": False, "params": {"key": "weight"}}
    ]
    with pytest.raises(UnsupportedHook):
        reattach_hooks(Model(), [dict(specs[0], type="no_such_type")])
    with pytest.raises(ValueError):
        register_hook_type("transpose_test", match=bool, encode=dict, rebuild=dict)


def test_reattach_refuses_untrusted_callables_before_registering_any():
    m = Model()
    specs = [
        {
            "type": "importable",
            "scope": "a",
            "phase": "pre",
            "with_module": False,
            "params": {"kind": "function", "qualname": HERE + "scale_pre_hook"},
        },
        {
            "type": "importable",
            "scope": "b",
            "phase": "pre",
            "with_module": False,
            "params": {"kind": "function", "qualname": "os.system"},
        },
    ]
    with pytest.raises(UntrustedTarget):
        reattach_hooks(m, specs, allowed_prefixes=(HERE,))
    assert not m.a._load_state_dict_pre_hooks
    # without the allow-list entry even the test's own function is refused
    with pytest.raises(UntrustedTarget):
        reattach_hooks(m, specs[:1])


def test_hooks_are_cleared_while_the_payload_is_written(monkeypatch):
    m = Model()
    to_meta(m)
    m.a._register_load_state_dict_pre_hook(scale_pre_hook)
    m.register_load_state_dict_post_hook(record_post_hook)
    seen = []
    real_save = torch.save

    def spying_save(obj, f, *args, **kwargs):
        seen.append([len(x._load_state_dict_pre_hooks) + len(x._load_state_dict_post_hooks) for x in m.modules()])
        return real_save(obj, f, *args, **kwargs)

    monkeypatch.setattr(torch, "save", spying_save)
    art = dump_module(m)
    assert seen == [[0, 0, 0]]
    assert len(m.a._load_state_dict_pre_hooks) == 1 and len(m._load_state_dict_post_hooks) == 1
    assert len(json.loads(art["hooks.json"])) == 2
