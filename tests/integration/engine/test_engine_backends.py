"""Engine storage backends and the in-process layer: the contract, eviction, errors, the default cache.

Every backend (in memory, adstore, the directory backend documented in
``storage``'s docstring) passes one contract; the store backend evicts the
least recently used engines within its budget and the in-memory one is a
bounded LRU; a backend that raises is a miss; the in-process layer does not
read the backend again; the default cache comes from the environment.
"""

from __future__ import annotations

import hashlib
import os
import re
import textwrap

import pytest
import torch
from engine_support import X, lookup_in, make_model

from adstore.integration.engine import storage
from adstore.integration.engine.cache import EngineCache
from adstore.integration.engine.record import EngineRecord
from adstore.integration.engine.storage import EngineStorage, MemoryEngineStorage, StoreEngineStorage
from adstore.store import Store


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


def test_a_root_that_cannot_be_a_store_compiles_uncached_with_the_reason(tmp_path, monkeypatch):
    """The default store where ``ADSTORE_ROOT`` names a file: the engine is AOTInductor's own, the
    bypass says why, once per process, and nothing is raised into the program."""
    from adstore.integration.engine import cache as ec

    not_a_dir = tmp_path / "root-is-a-file"
    not_a_dir.write_text("not a store")
    monkeypatch.setenv("ADSTORE_ROOT", str(not_a_dir))
    front = ec.EngineCache()
    try:
        engine = front.compile(make_model(2), (X,))
        assert engine.event.kind == "bypass" and engine.event.reason == "no_store", engine.event
        assert "not a directory" in engine.event.detail and engine.hash is None
        assert torch.allclose(engine(X), make_model(2)(X), atol=1e-5)
        _, event = front.lookup(make_model(2), (X,))
        assert event.kind == "bypass" and event.reason == "no_store", event
        assert front.counters["bypasses.no_store"] == 1, front.counters
    finally:
        front.close()
