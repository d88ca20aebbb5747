"""Engine cache on a real AOTInductor package and a real store.

Real compiles are expensive (tens of seconds on 2 cores), so the default run
makes three: the first ``compile()`` of the MLP (a miss, shared by the module
fixture), one plain ``aoti_compile_and_package`` with the weights baked in (the
oracle a refit must match), and one ``ignore_engine_cache=True`` recompile.
Every other test reuses the stored record: corrupt copies of it, renamed
copies, copies in other backends. Heavier cases are marked slow.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import textwrap

import pytest
import torch

from adstore.integration.engine import storage
from adstore.integration.engine.record import EngineRecord
from adstore.integration.engine.storage import EngineStorage, MemoryEngineStorage, StoreEngineStorage
from adstore.integration.engine.cache import EngineCache, compile
from adstore.integration.engine.hashing import get_hash, hash_components
from adstore.integration.errors import ConfigError, CorruptEngine, EngineMismatch, TruncatedEngine
from adstore.store import Store


class MLP(torch.nn.Module):
    """Linear/ReLU/Linear with a buffer and a constant written in forward()."""

    def __init__(self, hidden: int = 32) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(16, hidden)
        self.fc2 = torch.nn.Linear(hidden, 8)
        self.register_buffer("scale", torch.ones(8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        offset = torch.tensor([0.5, -0.5, 1.0, -1.0, 2.0, -2.0, 0.25, -0.25])
        return self.fc2(torch.relu(self.fc1(x))) * self.scale + offset


class MLPRenamed(MLP):
    def forward(self, inp: torch.Tensor) -> torch.Tensor:  # same graph, other input name
        offset = torch.tensor([0.5, -0.5, 1.0, -1.0, 2.0, -2.0, 0.25, -0.25])
        return self.fc2(torch.relu(self.fc1(inp))) * self.scale + offset


def make_model(seed: int) -> MLP:
    torch.manual_seed(seed)
    m = MLP().eval()
    with torch.no_grad():
        m.scale.uniform_(0.5, 2.0)
    return m


def digests(model: torch.nn.Module) -> dict[str, str]:
    return {k: hashlib.sha256(v.detach().contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()
            for k, v in model.state_dict().items()}


X = torch.randn(4, 16, generator=torch.Generator().manual_seed(0))


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    """One store, one backend, and the one shared first compile (a miss)."""
    root = tmp_path_factory.mktemp("engine-store")
    store = Store.open(root, grace_period=0.0)
    backend = StoreEngineStorage(store)
    model = make_model(1)
    before = digests(model)
    front = EngineCache(backend)
    engine = front.compile(model, (X,))
    yield {
        "store": store,
        "backend": backend,
        "front": front,
        "model": model,
        "before": before,
        "engine": engine,
        "hash": engine.hash,
        "blob": backend.load(engine.hash),
    }
    front.close()
    store.close()


def lookup_in(backend: EngineStorage, model: torch.nn.Module):
    front = EngineCache(backend)
    try:
        return front.lookup(model, (X,))
    finally:
        front.close()


# --------------------------------------------------------------------------- hit / miss / refit


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
        assert store.lookup(h, record=False).hit
        hit = front.compile(make_model(8), (X,))
        assert hit.event.kind == "hit" and front.counters["compiles"] == 1
    finally:
        front.close()


# --------------------------------------------------------------------------- hashing


def test_hash_equal_on_reexport_and_matches_compile(env):
    a = get_hash(torch.export.export(make_model(1), (X,)), (X,))
    b = get_hash(torch.export.export(make_model(9), (X,)), (X,))
    assert a == b == env["hash"]


def test_hash_differs_on_shape_setting_and_arguments():
    base_ep = torch.export.export(make_model(1), (X,))
    base = get_hash(base_ep, (X,))
    x8 = torch.randn(8, 16)
    assert get_hash(torch.export.export(make_model(1), (x8,)), (x8,)) != base
    assert get_hash(base_ep, (X,), settings={"cpp.simdlen": 8}) != base
    assert get_hash(base_ep, (X,), settings={"max_autotune": True}) != base
    assert MLP(hidden=64) is not None and get_hash(torch.export.export(MLP(hidden=64).eval(), (X,)), (X,)) != base

    class Leaky(torch.nn.Module):
        def __init__(self, slope: float, dim: int) -> None:
            super().__init__()
            self.slope, self.dim = slope, dim

        def forward(self, x):
            return torch.nn.functional.leaky_relu(x, self.slope).sum(self.dim)

    def h(slope, dim):
        ep = torch.export.export(Leaky(slope, dim), (X,))
        return get_hash(ep, (X,)), [str(n.target) for n in ep.graph.nodes]

    (h1, ops1), (h2, ops2), (h3, ops3) = h(0.1, 0), h(0.2, 0), h(0.1, 1)
    assert ops1 == ops2 == ops3, "the test needs graphs with the same op sequence"
    assert len({h1, h2, h3}) == 3


def test_isomorphic_graphs_with_renamed_inputs_share():
    a = torch.export.export(make_model(1), (X,))
    b = torch.export.export(MLPRenamed().eval(), (X,))
    assert [n.name for n in a.graph.nodes if n.op == "placeholder"][-1] == "x"
    assert [n.name for n in b.graph.nodes if n.op == "placeholder"][-1] == "inp"
    assert get_hash(a, (X,)) == get_hash(b, (X,))


def test_dynamic_shapes_are_in_the_hash_and_renaming_still_shares():
    batch = torch.export.Dim("batch", min=2, max=64)
    x8 = torch.randn(8, 16)
    a = get_hash(torch.export.export(make_model(1), (X,), dynamic_shapes=({0: batch},)), (X,),
                 dynamic_shapes=({0: batch},))
    b = get_hash(torch.export.export(MLPRenamed().eval(), (x8,), dynamic_shapes=({0: batch},)), (x8,),
                 dynamic_shapes=({0: batch},))
    narrow = torch.export.Dim("batch", min=2, max=16)
    c = get_hash(torch.export.export(make_model(1), (X,), dynamic_shapes=({0: narrow},)), (X,),
                 dynamic_shapes=({0: narrow},))
    static = get_hash(torch.export.export(make_model(1), (X,)), (X,))
    assert a == b and a != c and a != static


def test_hashing_and_compiling_never_touch_parameters(env):
    assert digests(env["model"]) == env["before"]  # after the fixture's compile
    model = make_model(11)
    before = digests(model)
    ep = torch.export.export(model, (X,))
    ep_before = {k: v.clone() for k, v in ep.state_dict.items()}
    get_hash(ep, (X,))
    get_hash(model, (X,))
    hash_components(ep.graph_module, (X,))
    assert digests(model) == before
    assert all(torch.equal(ep.state_dict[k], v) for k, v in ep_before.items())
    assert all(t.abs().sum() > 0 for t in model.state_dict().values())


def test_bad_settings_are_clear_errors_before_any_compile(env):
    with pytest.raises(ConfigError):
        compile(env["model"], (X,), engine_cache=MemoryEngineStorage(), freezing=True)
    with pytest.raises(ConfigError):
        compile(env["model"], (X,), engine_cache=MemoryEngineStorage(), **{"not.an_option": 1})
    with pytest.raises(ConfigError):
        compile(env["model"], (X,), engine_cache=MemoryEngineStorage(), always_keep_tensor_constants=False)


# --------------------------------------------------------------------------- eviction


def fake_record(meta: dict, nbytes: int, tag: int) -> EngineRecord:
    h = hashlib.sha256(f"fake-engine-{tag}".encode()).hexdigest()
    return EngineRecord.create(h, dict(meta), os.urandom(nbytes))


def test_store_budget_evicts_least_recently_used_engines(env, tmp_path):
    meta = EngineRecord.from_bytes(env["blob"], expected_hash=env["hash"]).meta
    with Store.open(tmp_path / "s", grace_period=0.0) as store:
        cache = StoreEngineStorage(store)
        a, b, c = (fake_record(meta, 300_000, i) for i in range(3))
        cache.save_record(a)
        cache.save_record(b)
        with cache.load_record(a.hash) as read:  # a is now more recent than b
            assert read.payload_path is not None and read.payload_path.exists()
        assert not read.payload_path.exists(), "the temp copy outlived the read"
        limited = StoreEngineStorage(store, max_size=store.size() + 150_000)
        limited.save_record(c)  # c's 300 KB put the store ~150 KB over budget: the LRU engine (b) goes
        assert sorted(cache.keys()) == sorted([a.hash, c.hash])
        assert cache.load_record(b.hash) is None
        plan = cache.plan_eviction(max_size=0)
        assert [e.key for e in plan.victims][:1] == [a.hash]  # a was read before c was written
        assert not list((store.root / "tmp").iterdir())


def test_in_memory_backend_is_a_bounded_lru():
    cache = MemoryEngineStorage(max_entries=2)
    cache.save("a" * 64, b"1")
    cache.save("b" * 64, b"2")
    assert cache.load("a" * 64) == b"1"
    cache.save("c" * 64, b"3")
    assert cache.keys() == ["a" * 64, "c" * 64] and cache.evictions == 1
    by_bytes = MemoryEngineStorage(max_bytes=5)
    by_bytes.save("a" * 64, b"123")
    by_bytes.save("b" * 64, b"456")
    assert "a" * 64 not in by_bytes and by_bytes.load("b" * 64) == b"456"


# --------------------------------------------------------------------------- corruption and mismatch


def test_truncated_and_bitflipped_records_are_misses(env):
    blob, h = env["blob"], env["hash"]
    with pytest.raises(TruncatedEngine):
        EngineRecord.from_bytes(blob[: len(blob) // 2], expected_hash=h)
    cases = {
        "truncated_engine": blob[:-100],
        "truncated_engine ": blob[:20],
        "corrupt_engine": blob[:5000] + bytes([blob[5000] ^ 0x01]) + blob[5001:],
        "corrupt_engine ": blob[:-3] + bytes([blob[-3] ^ 0x80]) + blob[-2:],
    }
    for reason, bad in cases.items():
        mem = MemoryEngineStorage()
        mem.save(h, bad)
        engine, event = lookup_in(mem, make_model(2))
        assert engine is None and event.kind == "miss" and event.reason == reason.strip(), (reason, event)
    mem = MemoryEngineStorage()
    mem.save(h, blob)
    engine, event = lookup_in(mem, make_model(2))  # the intact copy is a hit
    assert engine is not None and event.source == "backend"
    torch.testing.assert_close(engine(X), make_model(2)(X), rtol=1e-6, atol=1e-6)


def test_corrupt_or_truncated_store_blobs_are_misses(env, tmp_path):
    h = env["hash"]
    for damage in ("flip", "truncate"):
        with Store.open(tmp_path / damage, grace_period=0.0) as store:
            cache = StoreEngineStorage(store)
            cache.save(h, env["blob"])
            pkg = store.manifests(h)[0].artifacts[StoreEngineStorage.PACKAGE_ARTIFACT]
            path = store.blob_path(pkg.digest)
            os.chmod(path, 0o600)
            data = bytearray(path.read_bytes())
            if damage == "flip":
                data[len(data) // 2] ^= 0x10
            else:
                data = data[: len(data) - 1000]
            path.write_bytes(bytes(data))
            engine, event = lookup_in(cache, make_model(2))
            assert engine is None and event.kind == "miss"
            assert event.reason == ("corrupt_engine" if damage == "flip" else "engine_unavailable"), event
            assert not list((store.root / "tmp").iterdir())


def rewrite(blob: bytes, h: str, edit) -> bytes:
    rec = EngineRecord.from_bytes(blob, expected_hash=h)
    meta = json.loads(json.dumps(rec.meta))
    payload = rec.payload
    out = edit(meta, payload)
    if out is not None:
        meta, payload = out
    new = EngineRecord.create(meta["hash"], meta, payload)
    new.meta["format_version"] = meta["format_version"]
    return new.to_bytes()


def test_mismatched_metadata_is_a_miss(env):
    blob, h = env["blob"], env["hash"]

    def constants_shape(meta, payload):
        for c in meta["constants"]:
            if c["fqn"] == "fc1.weight":
                c["shape"], c["stride"] = [16, 32], [32, 1]

    def constants_missing(meta, payload):
        meta["constants"] = [c for c in meta["constants"] if c["fqn"] != "fc2.bias"]

    def toolchain(meta, payload):
        meta["toolchain"]["torch"] = "1.0.0"

    def settings(meta, payload):
        meta["settings"]["cpp.simdlen"] = 4

    def version(meta, payload):
        meta["format_version"] = 999

    def other_hash(meta, payload):
        meta["hash"] = "0" * 64

    def garbage_package(meta, payload):
        return meta, os.urandom(len(payload))

    cases = {
        constants_shape: "engine_mismatch",
        constants_missing: "engine_mismatch",
        toolchain: "engine_mismatch",
        settings: "engine_mismatch",
        version: "engine_mismatch",
        other_hash: "engine_mismatch",
        garbage_package: "load_failed",
    }
    for edit, reason in cases.items():
        mem = MemoryEngineStorage()
        mem.save(h, rewrite(blob, h, edit))
        engine, event = lookup_in(mem, make_model(2))
        assert engine is None and event.reason == reason, (edit.__name__, event)
    with pytest.raises(EngineMismatch):
        EngineRecord.from_bytes(rewrite(blob, h, other_hash), expected_hash=h)
    with pytest.raises(CorruptEngine):
        EngineRecord.from_bytes(b"NOTANENG" + blob[8:], expected_hash=h)


class ExplodingBackend(EngineStorage):
    def save(self, hash, blob):
        raise OSError("disk on fire")

    def load(self, hash):
        raise RuntimeError("remote cache down")


def test_backend_errors_are_misses_not_crashes():
    engine, event = lookup_in(ExplodingBackend(), make_model(2))
    assert engine is None and event.reason == "backend_error" and "remote cache down" in event.detail


def test_documented_directory_backend_round_trips(env, tmp_path):
    cache = directory_backend(tmp_path)
    assert cache.load(env["hash"]) is None
    cache.save(env["hash"], env["blob"])
    engine, event = lookup_in(cache, make_model(2))
    assert engine is not None and event.source == "backend"
    torch.testing.assert_close(engine(X), make_model(2)(X), rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError):
        cache.save("../../etc/passwd", b"x")


def compile_source(code: str):
    import builtins

    return builtins.compile(code, "<engine storage docstring>", "exec")


# --------------------------------------------------------------------------- slow


@pytest.mark.slow
def test_corrupt_stored_engine_is_recompiled_and_overwritten(env, tmp_path):
    h = env["hash"]
    with Store.open(tmp_path / "s", grace_period=0.0) as store:
        cache = StoreEngineStorage(store)
        cache.save(h, rewrite(env["blob"], h, lambda m, p: (m, os.urandom(len(p)))))
        front = EngineCache(cache)
        model = make_model(12)
        engine = front.compile(model, (X,))
        assert engine.event.kind == "miss" and engine.event.reason == "load_failed" and engine.event.saved
        torch.testing.assert_close(engine(X), model(X), rtol=1e-6, atol=1e-6)
        front.close()
        engine2, event = lookup_in(cache, make_model(13))
        assert engine2 is not None and event.kind == "hit"


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


# --------------------------------------------------------------------------- backend contract and layers


def directory_backend(tmp_path):
    doc = storage.__doc__
    code = textwrap.dedent(re.search(r"\.\. code-block:: python\n(.*?)\nPass it", doc, re.S).group(1))
    namespace: dict = {}
    exec(compile_source(code), namespace)  # noqa: S102 - our own docstring
    return namespace["DirectoryEngineStorage"](tmp_path / "engines")


@pytest.fixture(params=["memory", "adstore", "directory"])
def any_backend(request, tmp_path):
    if request.param == "memory":
        yield MemoryEngineStorage()
    elif request.param == "adstore":
        with Store.open(tmp_path / "store", grace_period=0.0) as store:
            yield StoreEngineStorage(store)
    else:
        yield directory_backend(tmp_path)


def test_backend_contract(any_backend, env):
    """Every backend: absent is None, save/load round-trips, save overwrites, records verify."""
    h, blob = env["hash"], env["blob"]
    other = "f" * 64
    assert any_backend.load(h) is None and any_backend.load_record(other) is None
    any_backend.save(h, blob)
    assert any_backend.load(h) == blob
    with any_backend.load_record(h) as rec:
        assert rec.meta == EngineRecord.from_bytes(blob, expected_hash=h).meta
        assert rec.payload_bytes() == EngineRecord.from_bytes(blob, expected_hash=h).payload
    meta = EngineRecord.from_bytes(blob, expected_hash=h).meta
    replacement = EngineRecord.create(h, {**meta, "compile_seconds": 1.5}, b"new package").to_bytes()
    any_backend.save(h, replacement)
    assert any_backend.load(h) == replacement
    assert any_backend.load(other) is None


def test_in_process_layer_does_not_reread_the_backend(env):
    class CountingBackend(MemoryEngineStorage):
        loads = 0
        touches = 0

        def load(self, hash):
            CountingBackend.loads += 1
            return super().load(hash)

        def touch(self, hash):
            CountingBackend.touches += 1
            super().touch(hash)

    backend = CountingBackend()
    backend.save(env["hash"], env["blob"])
    front = EngineCache(backend, memory_entries=2)
    try:
        first, _ = front.lookup(make_model(2), (X,))
        assert first is not None and first.event.source == "backend" and CountingBackend.loads == 1
        for seed in (3, 4, 5):
            engine, event = front.lookup(make_model(seed), (X,))
            assert event.source == "memory"
            torch.testing.assert_close(engine(X), make_model(seed)(X), rtol=1e-6, atol=1e-6)
        assert CountingBackend.loads == 1 and CountingBackend.touches == 3
        assert front.counters["hits.memory"] == 3 and front.counters["hits.backend"] == 1
    finally:
        front.close()


def test_hash_is_stable_across_processes(env):
    import subprocess
    import sys

    code = textwrap.dedent(
        f"""
        import sys, torch
        sys.path.insert(0, {os.path.dirname(__file__)!r})
        from test_engine_cache import MLPRenamed, X
        from adstore.integration.engine.hashing import get_hash
        print(get_hash(torch.export.export(MLPRenamed().eval(), (X,)), (X,)))
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True)
    assert out.stdout.strip().splitlines()[-1] == env["hash"]


def test_record_round_trip_property():
    from hypothesis import given, settings
    from hypothesis import strategies as st

    json_values = st.recursive(
        st.none() | st.booleans() | st.integers(-2**53, 2**53) | st.text(max_size=20),
        lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
        max_leaves=20,
    )

    @settings(max_examples=60, deadline=None)
    @given(meta=st.dictionaries(st.text(min_size=1, max_size=10), json_values, max_size=6),
           payload=st.binary(max_size=2048), cut=st.integers(min_value=0))
    def check(meta, payload, cut):
        h = hashlib.sha256(payload).hexdigest()
        rec = EngineRecord.create(h, meta, payload)
        blob = rec.to_bytes()
        back = EngineRecord.from_bytes(blob, expected_hash=h)
        assert back.payload == payload and back.meta == rec.meta
        short = blob[: cut % len(blob)]
        with pytest.raises((TruncatedEngine, CorruptEngine)):
            EngineRecord.from_bytes(short, expected_hash=h)

    check()


def _compile_in_child(root: str, seed: int) -> tuple[str, str, float]:
    """Spawned worker: compile through a store another process is writing too."""
    with Store.open(root, grace_period=0.0) as store:
        front = EngineCache(StoreEngineStorage(store))
        model = make_model(seed)
        engine = front.compile(model, (X,))
        err = (engine(X) - model(X)).abs().max().item()
        front.close()
        return engine.event.kind, engine.hash, err


def _hit_in_child(root: str) -> tuple[str, float, int]:
    """Spawned worker: a next-process hit; did loading the package probe the CPU's vector ISA?"""
    from torch._inductor import cpu_vec_isa

    with Store.open(root, grace_period=0.0) as store:
        front = EngineCache(StoreEngineStorage(store))
        model = make_model(1)
        engine = front.compile(model, (X,))
        err = (engine(X) - model(X)).abs().max().item()
        front.close()
    return engine.event.kind, err, cpu_vec_isa.valid_vec_isa_list.cache_info().currsize


def test_a_next_process_hit_loads_the_package_without_probing_the_cpu(env):
    """torch's package loader probes the vector ISA (compiling test programs, ~1 s) only to warn;
    the key pins the CPU capability, so the hit skips it and still computes the right outputs."""
    import multiprocessing as mp

    with mp.get_context("spawn").Pool(1) as pool:
        kind, err, probed = pool.apply(_hit_in_child, (str(env["store"].root),))
    assert kind == "hit" and err < 1e-5
    assert probed == 0


@pytest.mark.slow
def test_concurrent_processes_compile_and_share_one_store(tmp_path, env):
    import multiprocessing as mp

    root = str(tmp_path / "shared")
    Store.open(root, grace_period=0.0).close()
    with mp.get_context("spawn").Pool(2) as pool:
        results = pool.starmap(_compile_in_child, [(root, 21), (root, 22)])
    assert {r[1] for r in results} == {env["hash"]}
    assert all(r[2] < 1e-5 for r in results), results
    with Store.open(root, grace_period=0.0) as store:
        assert store.verify().ok
        assert [e.key for e in store.entries(namespace="engine")] == [env["hash"]]
        engine, event = lookup_in(StoreEngineStorage(store), make_model(23))
        assert engine is not None and event.kind == "hit"


def test_damaged_in_process_copy_falls_back_to_the_backend(env):
    backend = MemoryEngineStorage()
    backend.save(env["hash"], env["blob"])
    front = EngineCache(backend)
    try:
        assert front.lookup(make_model(2), (X,))[1].source == "backend"
        _meta, path = front._memory.get(env["hash"])
        path.write_bytes(b"not a zip any more")  # e.g. a tmp cleaner or a full disk got to it
        engine, event = front.lookup(make_model(3), (X,))
        assert engine is not None and event.source == "backend"
        torch.testing.assert_close(engine(X), make_model(3)(X), rtol=1e-6, atol=1e-6)
    finally:
        front.close()


@pytest.mark.slow
def test_transformers_encoder_hit_refits_other_checkpoint(tmp_path):
    """A real architecture from a config (random weights): one compile, then a hit per 'checkpoint'."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                  intermediate_size=64, max_position_embeddings=64)

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


def test_default_cache_comes_from_the_environment(env, store_root, monkeypatch):
    from adstore.integration.engine import cache as ec

    monkeypatch.setenv("ADSTORE_ENGINE_MAX_SIZE", "64M")
    ec.set_default_engine_cache(None)
    try:
        front = ec.default_engine_cache()
        backend = front.backend
        assert isinstance(backend, StoreEngineStorage) and backend.max_size == 64 << 20
        assert backend.store.root == store_root.absolute()
        backend.save(env["hash"], env["blob"])
        engine, event = front.lookup(make_model(2), (X,))
        assert engine is not None and event.source == "backend"
        assert ec.default_engine_cache() is front
        assert store_root.joinpath("CACHEDIR.TAG").exists()
        assert backend.store.stats().counters.get("hits", 0) >= 1
    finally:
        front.close()
        ec.set_default_engine_cache(None)
        backend.close()


def test_plain_graph_modules_hash_by_structure_not_weights():
    class Net(torch.nn.Module):
        def __init__(self, out: int) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(16, out)

        def forward(self, x):
            return torch.relu(self.lin(x)) * 2.0

    a = torch.fx.symbolic_trace(Net(8))
    b = torch.fx.symbolic_trace(Net(8))
    c = torch.fx.symbolic_trace(Net(4))
    before = {k: v.clone() for k, v in a.state_dict().items()}
    assert not torch.equal(a.lin.weight, b.lin.weight)
    assert get_hash(a, (X,)) == get_hash(b, (X,)) != get_hash(c, (X,))
    assert get_hash(a, (X,)) != get_hash(a, (torch.randn(2, 16),))  # no graph meta: example shapes count
    assert all(torch.equal(a.state_dict()[k], v) for k, v in before.items())


def test_engines_written_by_untrusted_users_are_not_loaded(env, tmp_path, monkeypatch):
    """An engine is native code: only packages owned by this user, root or a trusted uid load."""
    h, stranger = env["hash"], 54321
    with Store.open(tmp_path / "shared", grace_period=0.0) as store:
        StoreEngineStorage(store).save(h, env["blob"])
        digest = store.manifests(h)[0].artifacts[StoreEngineStorage.PACKAGE_ARTIFACT].digest
        assert lookup_in(StoreEngineStorage(store), make_model(2))[0] is not None  # own engine: loads
        if os.geteuid() != 0:
            pytest.xfail("needs root to create a blob owned by another uid")  # CI runs as root
        os.chown(store.blob_path(digest), stranger, -1)  # as if another group member had written it
        engine, event = lookup_in(StoreEngineStorage(store), make_model(2))
        assert engine is None and event.reason == "untrusted_engine", event
        monkeypatch.setenv("ADSTORE_ROOT", str(tmp_path / "shared"))
        monkeypatch.setenv("ADSTORE_TRUSTED_UIDS", f"777, {stranger}")
        trusting = StoreEngineStorage.from_env()
        assert stranger in trusting.trusted_uids
        engine, event = lookup_in(trusting, make_model(2))
        assert engine is not None and event.source == "backend"
        trusting.close()
    with Store.open(tmp_path / "inline", grace_period=0.0, inline_threshold=1 << 24) as store:
        StoreEngineStorage(store).save(h, env["blob"])  # package inside the shared index: writer unknown
        engine, event = lookup_in(StoreEngineStorage(store), make_model(2))
        assert engine is None and event.reason == "untrusted_engine", event
    monkeypatch.setenv("ADSTORE_TRUSTED_UIDS", "alice")
    with pytest.raises(ConfigError):
        StoreEngineStorage.from_env()


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


# --------------------------------------------------------------------------- environment (README, "Environment checks")


class MLPLeaky(MLP):
    """Same weights, same call spec, another graph: leaky_relu where MLP has relu."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        offset = torch.tensor([0.5, -0.5, 1.0, -1.0, 2.0, -2.0, 0.25, -0.25])
        return self.fc2(torch.nn.functional.leaky_relu(self.fc1(x), 0.1)) * self.scale + offset


def test_a_record_relabelled_under_another_hash_is_a_miss(env):
    """Everything a hit checks besides the graph matches; the stored graph digest betrays the relabel."""
    leaky = MLPLeaky().eval()
    leaky.load_state_dict(make_model(2).state_dict())
    other = get_hash(torch.export.export(leaky, (X,)), (X,))
    assert other != env["hash"]

    def relabel(meta, payload):
        meta["hash"] = other

    mem = MemoryEngineStorage()
    mem.save(other, rewrite(env["blob"], env["hash"], relabel))  # a record that claims the other hash
    engine, event = lookup_in(mem, leaky)
    assert engine is None and event.reason == "engine_mismatch" and "graph" in event.detail, event


def _lookup_in_child(root: str, *, env: dict[str, str] | None = None, cwd: str | None = None,
                     prefix: tuple[str, ...] = ()) -> dict:
    """A fresh interpreter looks the fixture's MLP up in ``root``; its event as a dict."""
    import subprocess
    import sys

    code = textwrap.dedent(
        f"""
        import json, os, socket, sys
        sys.path.insert(0, {os.path.dirname(__file__)!r})
        from test_engine_cache import X, make_model
        from adstore.integration.engine.cache import EngineCache
        from adstore.integration.engine.storage import StoreEngineStorage
        from adstore.store import Store
        with Store.open({root!r}) as store:
            front = EngineCache(StoreEngineStorage(store))
            engine, event = front.lookup(make_model(7), (X,))
            ok = engine is not None and bool((engine(X) - make_model(7)(X)).abs().max() < 1e-5)
            front.close()
        print(json.dumps({{**event.to_dict(), "ok": ok, "host": socket.gethostname(), "cwd": os.getcwd()}}))
        """
    )
    out = subprocess.run([*prefix, sys.executable, "-c", code], capture_output=True, text=True, timeout=600,
                         check=False, env={**os.environ, **(env or {})}, cwd=cwd)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_another_cpu_capability_is_an_incompatible_env_miss(env):
    """A real environment difference, no simulation: ATEN_CPU_CAPABILITY=default makes torch
    dispatch (and AOTInductor compile) for the baseline ISA. The next process's lookup misses
    with the field named; the engine stored for the other ISA is not loaded."""
    if str(torch.backends.cpu.get_cpu_capability()) == "DEFAULT":
        pytest.skip("this CPU has no vector ISA beyond the default")
    event = _lookup_in_child(str(env["store"].root), env={"ATEN_CPU_CAPABILITY": "default"})
    assert event["kind"] == "miss" and event["reason"] == "incompatible_env", event
    assert "toolchain.cpu.capability" in event["detail"] and env["hash"][:16] in event["detail"], event
    assert not event["ok"]


def test_simulated_gpu_fields_are_an_incompatible_env_miss(env):
    """No GPU here: ADSTORE_ENV_OVERRIDES simulates a GPU host (names, compute capability), the
    path a CUDA host takes; the miss names the field. The real GPU probe is not exercised."""
    event = _lookup_in_child(str(env["store"].root), env={
        "ADSTORE_ENV_OVERRIDES": json.dumps({"toolchain.gpus": [["NVIDIA H100 80GB HBM3", [9, 0]]]})})
    assert event["reason"] == "incompatible_env" and "toolchain.gpus" in event["detail"], event


def test_volatile_facts_do_not_change_the_engine_hash(env, tmp_path):
    """Another pid, working directory and (when user namespaces allow it) host name: a hit."""
    import shutil
    import subprocess

    prefix: tuple[str, ...] = ()
    unshare = shutil.which("unshare")
    if unshare and subprocess.run([unshare, "--uts", "--map-root-user", "hostname", "other-host"],
                                  capture_output=True, check=False).returncode == 0:
        prefix = (unshare, "--uts", "--map-root-user", "sh", "-c", 'hostname other-host && exec "$0" "$@"')
    event = _lookup_in_child(str(env["store"].root), cwd=str(tmp_path), prefix=prefix)
    assert event["kind"] == "hit" and event["ok"] and event["cwd"] == str(tmp_path), event
    if prefix:
        assert event["host"] == "other-host"


def test_a_changed_in_process_copy_is_refused_before_loading(env):
    """The in-process package copy is re-checked against the record's checksum on every load."""

    class Forgetful(MemoryEngineStorage):
        gone = False

        def load(self, hash):
            return None if self.gone else super().load(hash)

    backend = Forgetful()
    backend.save(env["hash"], env["blob"])
    front = EngineCache(backend)
    try:
        assert front.lookup(make_model(2), (X,))[1].source == "backend"

        def tamper():
            _meta, path = front._memory.get(env["hash"])
            data = bytearray(path.read_bytes())
            data[len(data) // 3] ^= 0x01  # one bit: the zip may well still open
            path.write_bytes(bytes(data))

        tamper()
        engine, event = front.lookup(make_model(3), (X,))  # refused, then read again from the backend
        assert engine is not None and event.source == "backend"
        assert front.counters["memory_refused.corrupt_engine"] == 1
        torch.testing.assert_close(engine(X), make_model(3)(X), rtol=1e-6, atol=1e-6)
        tamper()
        backend.gone = True  # nothing to fall back on: a miss with the copy's reason (compile() rebuilds)
        engine, event = front.lookup(make_model(4), (X,))
        assert engine is None and event.reason == "corrupt_engine" and "in-process copy" in event.detail, event
        assert front.counters["memory_refused.corrupt_engine"] == 2 and env["hash"] not in front._memory
    finally:
        front.close()
