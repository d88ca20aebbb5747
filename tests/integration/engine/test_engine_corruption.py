"""Damaged, mismatched and untrusted engine records: misses with a reason, never a wrong engine.

Truncated and bit-flipped records and store blobs, edited metadata
(constants, toolchain, settings, format, hash, package), a record relabelled
under another graph's hash, damaged or changed in-process copies and
packages written by untrusted users are all misses (a corrupt stored engine
is compiled again and overwritten); records round-trip and any truncation
is detected.
"""

from __future__ import annotations

import hashlib
import json
import os

import pytest
import torch
from engine_support import MLP, X, lookup_in, make_model

from adstore.integration.engine.cache import EngineCache
from adstore.integration.engine.hashing import get_hash
from adstore.integration.engine.record import EngineRecord
from adstore.integration.engine.storage import MemoryEngineStorage, StoreEngineStorage
from adstore.integration.errors import ConfigError, CorruptEngine, EngineMismatch, TruncatedEngine
from adstore.store import Store


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


def test_record_round_trip_property():
    from hypothesis import given, settings
    from hypothesis import strategies as st

    json_values = st.recursive(
        st.none() | st.booleans() | st.integers(-(2**53), 2**53) | st.text(max_size=20),
        lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
        max_leaves=20,
    )

    @settings(max_examples=60, deadline=None)
    @given(
        meta=st.dictionaries(st.text(min_size=1, max_size=10), json_values, max_size=6),
        payload=st.binary(max_size=2048),
        cut=st.integers(min_value=0),
    )
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
        StoreEngineStorage(store).save(h, env["blob"])  # a package inside the index: as trusted as the index
        engine, event = lookup_in(StoreEngineStorage(store), make_model(2))
        assert engine is not None, event  # an index only this user writes: its writer is this user
        os.chown(store.root / "index", -1, 65534)  # a group with other members (nogroup: nobody, sync, _apt)
        os.chmod(store.root / "index", 0o2775)  # a group-shared store: any member writes the index
        engine, event = lookup_in(StoreEngineStorage(store), make_model(2))
        assert engine is None and event.reason == "untrusted_engine", event
    monkeypatch.setenv("ADSTORE_TRUSTED_UIDS", "alice")
    with pytest.raises(ConfigError):
        StoreEngineStorage.from_env()


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
