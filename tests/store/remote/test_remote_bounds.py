"""A remote costs bounded time and bounded disk: deadlines, sizes checked before any download, records parsed first.

Against the misbehaving server of ``remote_faultserver`` (a real HTTP
server on 127.0.0.1): a dripping server ends in ``remote_timeout`` at the
deadline, a record that declares more than the store may hold is refused
with no blob asked for, a malformed signed record is a one-line miss before
any blob request, and a streamed restore leaves nothing behind when it fails.
"""

from __future__ import annotations

import hashlib
import logging
import os

import pytest
from remote_faultserver import FaultServer

from adstore.store import Budget, Store
from adstore.store.remote import open_remote, record_address
from adstore.store.tiered import remote_restore, remote_save

KEY = "k" * 64


@pytest.fixture
def server():
    s = FaultServer()
    yield s
    s.close()


def writer_store(tmp_path, server, signer, sizes=(3 << 20, 300), key=KEY, seed=0):
    """Commit ``key`` (blobs of ``sizes``) in a writer's store and push it to ``server``; the refs."""
    rnd = __import__("random").Random(seed)
    with Store(tmp_path / "writer") as store:
        refs = {f"a{i}": store.put_bytes(rnd.randbytes(n)) for i, n in enumerate(sizes)}
        gen = store.new_generation()
        store.publish(key, generation=gen, artifacts=refs)
        store.commit(key, generation=gen)
        remote = open_remote(server.url, mode="read-write", signer=signer)
        assert remote_save(store, remote, key).ok
        remote.close()
    return refs


def reader(server, trusted, **kw):
    kw.setdefault("deadline", 1.0)
    return open_remote(server.url, trusted=trusted, timeout=5, cooldown=60, **kw)


def temps(store: Store) -> list[str]:
    return sorted(p.name for p in (store.root / "tmp").iterdir())


@pytest.mark.parametrize("mode", ["drip", "drip_headers"])
def test_a_dripping_record_is_a_timeout_miss_and_opens_the_circuit(mode, server, signer, trusted, tmp_path):
    writer_store(tmp_path, server, signer)
    server.fault(f"ac/{record_address(KEY, 0)}", mode, interval=0.5)  # a 1 KB record: ~10 minutes unbounded
    r = reader(server, trusted)
    with Store(tmp_path / "reader") as store:
        out = remote_restore(store, r, KEY, 0, 1)
        assert out.reason == "remote_timeout"
        assert r.refusal() == "remote_timeout"  # the next lookup does not wait again
        assert not store.lookup(KEY, count=False).hit
    assert server.asked("cas") == 0


def test_a_dripping_blob_is_a_timeout_miss_that_leaves_nothing(server, signer, trusted, tmp_path):
    refs = writer_store(tmp_path, server, signer)
    big = refs["a0"]
    server.fault(f"cas/{big.digest}", "drip", interval=0.05)  # 3 MiB at 20 B/s: days unbounded
    r = reader(server, trusted, min_throughput=1 << 30)  # the blob gets the deadline and ~0 s for its size
    with Store(tmp_path / "reader") as store:
        out = remote_restore(store, r, KEY, 0, 1)
        assert out.reason == "remote_timeout"
        assert not store.has_blob(big) and store.manifests(KEY) == []
        r.close()
        assert store.plan_sweep().execute() is not None  # a temp of a worker still draining is swept by gc
        assert store.verify().ok


@pytest.mark.parametrize("mode", ["long_length", "short_length", "endless"])
def test_a_lying_content_length_is_a_miss_that_commits_nothing(mode, server, signer, trusted, tmp_path):
    refs = writer_store(tmp_path, server, signer)
    server.fault(f"cas/{refs['a0'].digest}", mode)
    with Store(tmp_path / "reader") as store:
        out = remote_restore(store, reader(server, trusted, deadline=10), KEY, 0, 1)
        assert out.reason == "remote_checksum"
        assert out.nbytes < (4 << 20)  # never read past the declared size
        assert store.manifests(KEY) == [] and not store.has_blob(refs["a0"])
        assert temps(store) == []


def seal_record(server, signer, payload: dict, key: str = KEY, rank: int = 0) -> None:
    server.objects[f"ac/{record_address(key, rank)}"] = signer.seal({"key": key, "rank": rank, **payload})


def payload(**fields) -> dict:
    digest = hashlib.sha256(b"x").hexdigest()
    base = {
        "format": 1,
        "namespace": "default",
        "world_size": 1,
        "generation": 7,
        "components": {},
        "meta": {},
        "created": 1.7e9,
        "artifacts": {"big": [digest, 1]},
    }
    base.update(fields)
    return {k: v for k, v in base.items() if v is not ...}


def test_a_signed_record_declaring_100_gb_is_refused_before_any_download(server, signer, trusted, tmp_path):
    digest = hashlib.sha256(b"never sent").hexdigest()
    seal_record(server, signer, payload(artifacts={"huge": [digest, 100 * 10**9]}))
    server.objects[f"cas/{digest}"] = b"never sent"
    server.fault(f"cas/{digest}", "endless")
    with Store(tmp_path / "reader") as store:
        out = remote_restore(store, reader(server, trusted), KEY, 0, 1)
        assert out.reason == "disk_full"
        assert temps(store) == []
    assert server.asked("cas") == 0


@pytest.mark.parametrize("limit, reason", [(1 << 20, "over_budget"), (64 << 20, None)])
def test_the_persisted_budget_is_applied_before_the_download(limit, reason, server, signer, trusted, tmp_path):
    writer_store(tmp_path, server, signer, sizes=(8 << 20, 300))
    with Store(tmp_path / "reader") as store:
        store.set_budget(Budget(max_size=limit, min_free=None, high_watermark=0.9, low_watermark=0.8))
        out = remote_restore(store, reader(server, trusted, deadline=10), KEY, 0, 1)
        assert out.reason == reason
        assert server.asked("cas") == (0 if reason else 2)
        assert store.lookup(KEY, count=False).hit is (reason is None)


def nested(depth: int) -> dict:
    value: dict = {}
    for _ in range(depth):
        value = {"x": value}
    return value


@pytest.mark.parametrize(
    "fields",
    [
        {"generation": "abc"},
        {"generation": ...},
        {"artifacts": {"a": [hashlib.sha256(b"x").hexdigest()]}},
        {"artifacts": {"a": [hashlib.sha256(b"x").hexdigest(), "many"]}},
        {"components": ["a", "list"]},
        {"components": nested(500)},
        {"artifacts": {"../../etc": [hashlib.sha256(b"x").hexdigest(), 1]}},
        {"world_size": 0},
        {"namespace": "a\nb"},
    ],
    ids=[
        "generation-text",
        "no-generation",
        "no-size",
        "size-text",
        "components-list",
        "nesting-500",
        "artifact-path",
        "world-size-0",
        "namespace-newline",
    ],
)
def test_a_malformed_signed_record_is_a_one_line_miss_before_any_blob(
    fields, server, signer, trusted, tmp_path, caplog, capfd
):
    seal_record(server, signer, payload(**fields))
    server.objects[f"cas/{hashlib.sha256(b'x').hexdigest()}"] = b"x"
    with (
        caplog.at_level(logging.DEBUG, logger="adstore"),
        Store(tmp_path / "reader", remote=reader(server, trusted)) as store,
    ):
        res = store.lookup(KEY)
        assert not res.hit and res.reason == "corrupt_record"
    assert server.asked("cas") == 0
    assert not any(rec.exc_info for rec in caplog.records)
    assert "Traceback" not in capfd.readouterr().err


def test_a_newer_record_format_is_remote_unsupported(server, signer, trusted, tmp_path):
    seal_record(server, signer, payload(format=99))
    with Store(tmp_path / "reader") as store:
        assert remote_restore(store, reader(server, trusted), KEY, 0, 1).reason == "remote_unsupported"
    assert server.asked("cas") == 0


def test_a_restore_streams_each_blob_into_place_once(server, signer, trusted, tmp_path):
    refs = writer_store(tmp_path, server, signer, sizes=(9 << 20, 3 << 20, 300))
    with Store(tmp_path / "reader") as store:
        out = remote_restore(store, reader(server, trusted, deadline=10), KEY, 0, 1)
        assert out.ok, out
        for name, ref in refs.items():
            assert store.read_artifact(out.value, name) == store.get_bytes(ref)
        assert temps(store) == [] and store.verify().ok
        assert store.stats().counters.get("bytes_written") == sum(r.size for r in refs.values())


def test_a_lookup_that_restores_counts_one_hit(server, signer, trusted, tmp_path):
    writer_store(tmp_path, server, signer)
    with Store(tmp_path / "reader", remote=reader(server, trusted)) as store:
        assert store.lookup(KEY).hit
        store.flush()
        (entry,) = store.entries()
        assert entry.hits == 1
        assert store.stats().counters["hits"] == 1


@pytest.mark.parametrize("kind", ["s3", "http"])
def test_a_server_dripping_every_answer_is_a_timeout_on_both_backends(kind, request, signer, trusted, tmp_path):
    """Every byte from the real server (moto or WebDAV) trickles through a proxy: bounded all the same."""
    from remote_faultproxy import FaultProxy
    from remote_servers import BUCKET

    server = request.getfixturevalue("s3_env" if kind == "s3" else "dav_server")
    proxy = FaultProxy(server.port)
    prefix = f"drip-{os.urandom(4).hex()}"

    def at(endpoint: str, **kw):
        if kind == "s3":
            return open_remote(f"s3://{BUCKET}/{prefix}", endpoint_url=endpoint, **kw)
        return open_remote(f"{endpoint}/{prefix}", **kw)

    try:
        with Store(tmp_path / "writer") as w:
            ref = w.put_bytes(os.urandom(100_000))
            gen = w.new_generation()
            w.publish(KEY, generation=gen, artifacts={"a": ref})
            w.commit(KEY, generation=gen)
            assert remote_save(w, at(server.endpoint, mode="read-write", signer=signer), KEY).ok
        proxy.set_mode("drip")
        with Store(tmp_path / "reader") as store:
            out = remote_restore(store, at(proxy.endpoint, trusted=trusted, deadline=1.0, cooldown=60), KEY, 0, 1)
            assert out.reason == "remote_timeout"
            assert store.manifests(KEY) == []
    finally:
        proxy.close()
