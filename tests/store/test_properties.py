"""Hypothesis round trips: put/get and publish/lookup keep content and identity."""

from __future__ import annotations

import hashlib

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from adstore.store import BlobRef, Store

_settings = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])

# Small blobs live inline in LMDB; large ones (built from a short seed to keep
# generation cheap) are files.
blobs = st.one_of(
    st.binary(max_size=2000),
    st.tuples(st.binary(min_size=1, max_size=32), st.integers(65_536, 70_000)).map(
        lambda t: (t[0] * (t[1] // len(t[0]) + 1))[: t[1]]
    ),
)
keys = st.from_regex(r"[A-Za-z0-9][A-Za-z0-9._:+=@-]{0,40}", fullmatch=True)
names = st.from_regex(r"[A-Za-z0-9][A-Za-z0-9._+-]{0,20}", fullmatch=True)


@_settings
@given(data=blobs)
def test_put_get_roundtrip(tmp_path_factory, data):
    with Store.open(tmp_path_factory.mktemp("s"), grace_period=0.0) as store:
        ref = store.put_bytes(data)
        assert ref == BlobRef(hashlib.sha256(data).hexdigest(), len(data))
        assert store.get_bytes(ref) == data
        assert store.put_bytes(data) == ref


@_settings
@given(
    entries=st.dictionaries(
        keys,
        st.tuples(st.integers(1, 3), st.dictionaries(names, blobs, min_size=1, max_size=3)),
        min_size=1,
        max_size=4,
    )
)
def test_publish_lookup_roundtrip(tmp_path_factory, entries):
    with Store.open(tmp_path_factory.mktemp("s"), grace_period=0.0) as store:
        for key, (world_size, artifacts) in entries.items():
            gen = store.new_generation()
            for rank in range(world_size):
                refs = {n: store.put_bytes(d + bytes([rank])) for n, d in artifacts.items()}
                store.publish(
                    key, rank=rank, world_size=world_size, generation=gen, artifacts=refs, components={"k": key}
                )
            assert store.lookup(key).reason == "uncommitted"
            for rank in range(world_size):
                store.commit(key, rank=rank, generation=gen)
        for key, (world_size, artifacts) in entries.items():
            res = store.lookup(key)
            assert res.hit and sorted(res.manifests) == list(range(world_size))
            for rank, m in res.manifests.items():
                assert {n: store.read_artifact(m, n) for n in m.artifacts} == {
                    n: d + bytes([rank]) for n, d in artifacts.items()
                }
            assert store.entry(key).components == {"k": key}
        assert store.verify().ok


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    entries=st.dictionaries(
        keys,
        st.tuples(st.integers(1, 2), st.dictionaries(names, blobs, min_size=1, max_size=3), st.booleans()),
        min_size=1,
        max_size=4,
    )
)
def test_rebuild_from_records_roundtrip(tmp_path_factory, entries):
    """Any keys (dots, colons...), ranks, artifacts and pins come back whole when the index is lost."""
    root = tmp_path_factory.mktemp("s")
    with Store.open(root, grace_period=0.0) as store:
        for key, (world_size, artifacts, pinned) in entries.items():
            gen = store.new_generation()
            for rank in range(world_size):
                refs = {n: store.put_bytes(d + bytes([rank])) for n, d in artifacts.items()}
                store.publish(
                    key, rank=rank, world_size=world_size, generation=gen, artifacts=refs, components={"k": key}
                )
            for rank in range(world_size):
                store.commit(key, rank=rank, generation=gen)
            if pinned:
                store.pin(key)
    (root / "index" / "data.mdb").write_bytes(b"not an index" * 100)
    _, report = Store.repair_index(root)
    assert report.entries == len(entries) and not report.skipped, report
    with Store.open(root, grace_period=0.0) as store:
        for key, (world_size, artifacts, pinned) in entries.items():
            res = store.lookup(key)
            assert res.hit and sorted(res.manifests) == list(range(world_size)), (key, res.reason)
            for rank, m in res.manifests.items():
                assert {n: store.read_artifact(m, n) for n in m.artifacts} == {
                    n: d + bytes([rank]) for n, d in artifacts.items()
                }
            entry = store.entry(key)
            assert entry.components == {"k": key} and entry.pinned == pinned
        assert store.verify().ok
