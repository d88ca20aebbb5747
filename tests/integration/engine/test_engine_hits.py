"""Engine cache on a real AOTInductor package and a real store: hits, misses and refits.

The default run makes three real compiles: the first ``compile()`` of the
MLP (a miss, shared by the ``env`` fixture of conftest.py), one plain
``aoti_compile_and_package`` with the weights baked in (the oracle a refit
must match), and one ``ignore_engine_cache=True`` recompile.  Heavier cases
(dynamic batch, a transformers encoder, a package that does not load) are
marked slow.
"""

from __future__ import annotations

import os

import pytest
import torch
from engine_support import X, make_model

from adstore.integration.engine.cache import EngineCache, compile
from adstore.integration.engine.hashing import get_hash
from adstore.integration.engine.record import EngineRecord
from adstore.integration.engine.storage import MemoryEngineStorage, StoreEngineStorage
from adstore.integration.errors import EngineMismatch
from adstore.store import Store


def test_first_compile_is_a_miss_and_is_stored(env):
    engine = env["engine"]
    assert engine.event.kind == "miss" and engine.event.reason == "absent" and engine.event.saved
    torch.testing.assert_close(engine(X), env["model"](X), rtol=0, atol=0)
    entry = env["store"].entry(env["hash"])
    assert entry is not None and entry.namespace == "engine"
    assert set(entry.components) >= {"graph", "inputs", "settings", "toolchain"}
    record = EngineRecord.from_bytes(env["blob"], expected_hash=env["hash"])
    assert record.meta["payload"]["weights_included"] is False
    names = {c["fqn"] for c in record.meta["constants"]}
    assert {"fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias", "scale"} <= names
    assert [i["name"] for i in record.meta["inputs"]] == ["x"] and record.meta["outputs"]
    assert not list((env["store"].root / "tmp").iterdir()), "hit/miss left temp copies in the store"
    # torch's own LeafSpec FutureWarning (Inductor deep-copies the graph) is not shown to the user
    assert not [w for w in env["warnings"] if "LeafSpec" in w], env["warnings"]


def test_hit_refits_new_weights_from_store_then_memory(env):
    other = make_model(2)
    front = EngineCache(env["backend"])  # empty in-process layer: must read the store
    try:
        hit = front.compile(other, (X,))
        assert hit.event.kind == "hit" and hit.event.source == "backend"
        assert front.counters["compiles"] == 0
        torch.testing.assert_close(hit(X), other(X), rtol=1e-6, atol=1e-6)
        again = front.compile(make_model(3), (X,))
        assert again.event.source == "memory"
        torch.testing.assert_close(again(X), make_model(3)(X), rtol=1e-6, atol=1e-6)
        # engines do not share weights: the first one still computes with model 2
        torch.testing.assert_close(hit(X), other(X), rtol=1e-6, atol=1e-6)
    finally:
        front.close()
    assert not list((env["store"].root / "tmp").iterdir())


def test_refit_matches_a_fresh_compile_with_those_weights(env, tmp_path):
    new = make_model(4)
    hit = env["front"].compile(new, (X,))
    assert hit.event.kind == "hit"
    pkg = torch._inductor.aoti_compile_and_package(
        torch.export.export(new, (X,)), package_path=str(tmp_path / "fresh.pt2")
    )  # plain AOTInductor defaults: weights baked into the package
    fresh = torch._inductor.aoti_load_package(pkg)
    for batch in (X, torch.randn(4, 16), torch.randn(4, 16) * 10):
        torch.testing.assert_close(hit(batch), fresh(batch), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(hit(batch), new(batch), rtol=1e-5, atol=1e-5)
    env["fresh_with_weights_bytes"] = os.path.getsize(pkg)
    assert os.path.getsize(pkg) > 0


def test_engine_refit_method_handles_layout_and_rejects_wrong_shapes(env):
    engine = env["front"].compile(make_model(5), (X,))
    target = make_model(6)
    with torch.no_grad():  # same values, transposed storage: must be re-laid out, not reinterpreted
        target.fc1.weight = torch.nn.Parameter(target.fc1.weight.detach().t().contiguous().t())
    assert not target.fc1.weight.is_contiguous()
    engine.refit(target)
    torch.testing.assert_close(engine(X), target(X), rtol=1e-6, atol=1e-6)
    bad = dict(target.state_dict())
    bad["fc2.weight"] = torch.zeros(3, 3)
    with pytest.raises(EngineMismatch):
        engine.refit(bad)
    torch.testing.assert_close(engine(X), target(X), rtol=1e-6, atol=1e-6)  # old weights kept


def test_ignore_engine_cache_recompiles_and_overwrites(env):
    store, h = env["store"], env["hash"]
    gen_before = {m.generation for m in store.manifests(h) if m.committed}
    front = EngineCache(env["backend"])
    try:
        model = make_model(7)
        ep = torch.export.export(model, (X,))  # an ExportedProgram this time: compile must not change it
        graph_before, sig_before = str(ep.graph), str(ep.graph_signature)
        engine = front.compile(ep, (X,), ignore_engine_cache=True)
        assert str(ep.graph) == graph_before and str(ep.graph_signature) == sig_before
        assert get_hash(ep, (X,)) == h
        assert engine.event.kind == "miss" and engine.event.reason == "ignored" and engine.event.saved
        assert front.counters["compiles"] == 1
        torch.testing.assert_close(engine(X), model(X), rtol=1e-6, atol=1e-6)
        gen_after = {m.generation for m in store.manifests(h) if m.committed}
        assert gen_after and gen_after.isdisjoint(gen_before), "the stored engine was not overwritten"
        assert store.lookup(h, count=False).hit
        hit = front.compile(make_model(8), (X,))
        assert hit.event.kind == "hit" and front.counters["compiles"] == 1
    finally:
        front.close()


@pytest.mark.slow
def test_dynamic_batch_engine_serves_every_batch_in_range(tmp_path):
    batch = torch.export.Dim("batch", min=2, max=64)
    mem = MemoryEngineStorage()
    engine = compile(make_model(1), (X,), engine_cache=mem, dynamic_shapes=({0: batch},))
    other = make_model(2)
    hit = compile(other, (torch.randn(9, 16),), engine_cache=mem, dynamic_shapes=({0: batch},))
    assert engine.event.kind == "miss" and hit.event.kind == "hit"
    for n in (2, 5, 64):
        xb = torch.randn(n, 16)
        torch.testing.assert_close(hit(xb), other(xb), rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_transformers_encoder_hit_refits_other_checkpoint(tmp_path):
    """A real architecture from a config (random weights): one compile, then a hit per 'checkpoint'."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.BertConfig(
        vocab_size=100,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=64,
    )

    def bert(seed):
        torch.manual_seed(seed)
        return transformers.BertModel(cfg).eval()

    ids = torch.randint(0, 100, (2, 16), generator=torch.Generator().manual_seed(0))
    with Store.open(tmp_path / "s", grace_period=0.0) as store:
        front = EngineCache(StoreEngineStorage(store))
        first = front.compile(bert(1), (ids,))
        front.clear_memory()
        second_model = bert(2)
        second = front.compile(second_model, (ids,))
        assert first.event.kind == "miss" and second.event.kind == "hit" and second.event.source == "backend"
        with torch.no_grad():
            want = second_model(ids)
        got = second(ids)
        torch.testing.assert_close(got.last_hidden_state, want.last_hidden_state, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(got.pooler_output, want.pooler_output, rtol=1e-4, atol=1e-4)
        front.close()


@pytest.mark.slow
def test_a_package_that_does_not_load_is_compiled_once_more(tmp_path, monkeypatch):
    """Processes compiling one graph share Inductor's disk cache, whose files are not all written
    atomically: a package packed mid-rewrite does not load. The first load fails here as it did
    in that race; the engine cache compiles once more and serves a working engine."""
    from adstore.integration.engine import cache as cache_mod

    real, calls = cache_mod.load_runner, []

    def flaky(path):
        calls.append(path)
        if len(calls) == 1:
            raise RuntimeError("[json.exception.parse_error.101] attempting to parse an empty input")
        return real(path)

    monkeypatch.setattr(cache_mod, "load_runner", flaky)
    with Store.open(tmp_path / "store", grace_period=0.0) as store:
        front = EngineCache(StoreEngineStorage(store))
        model = make_model(31)
        engine = front.compile(model, (X,))
        assert len(calls) == 2 and engine.event.kind == "miss"
        torch.testing.assert_close(engine(X), model(X))
        front.close()
