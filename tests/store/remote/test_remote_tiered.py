"""The two tiers end to end (``adstore.store.tiered``) against real servers.

Host A (its own root and process) saves and pushes; host B (another empty
root, another process) restores bit-identical bytes and then hits locally.
Untrusted records, overwritten or missing remote blobs are misses that
commit nothing; read-only clients never write; a down remote costs the
timeout once, then almost nothing (docs/remote.md, "Failure costs").
"""

from __future__ import annotations

import hashlib
import json
import os
import time
import uuid

import pytest
from remote_faultproxy import FaultProxy
from remote_servers import BUCKET
from remote_tier_hosts import ARTIFACTS, on_host, restore, save_and_push

from adstore.store import Store
from adstore.store.records.format import RAW_FORMAT
from adstore.store.remote import BackgroundUploader, Kind, Signer, generate_keypair, open_remote, record_address
from adstore.store.tiered import record_payload, remote_restore, remote_save

BACKENDS = ["s3", "http"]


@pytest.fixture(params=BACKENDS)
def url(request):
    return request.getfixturevalue(f"{request.param}_url")


def commit_entry(store: Store, key: str, data: dict[str, bytes]) -> int:
    refs = {name: store.put_bytes(b) for name, b in data.items()}
    gen = store.new_generation()
    store.publish(key, generation=gen, artifacts=refs, components={"k": key})
    store.commit(key, generation=gen, components={"k": key})
    return gen


def sample() -> dict[str, bytes]:
    return {"big.bin": os.urandom(200_000), "small.txt": b"hello"}


def nothing_committed(store: Store, key: str) -> None:
    assert store.entry(key) is None
    assert store.lookup(key, count=False).reason == "absent"


def test_host_b_restores_host_a_bit_identical(url, keypair, tmp_path):
    key = f"k-{uuid.uuid4().hex[:8]}"
    a = on_host(save_and_push, str(tmp_path / "a"), url, keypair.private_pem, key, 7)
    assert a["reason"] is None and a["sent"] >= sum(ARTIFACTS.values())
    assert a["again_sent"] == 0  # re-push: 0 blob bytes
    assert a["counters"]["remote.records_up"] == 2 and a["counters"]["remote.bytes_up"] > 3 << 20
    b = on_host(restore, str(tmp_path / "b"), url, keypair.public_pem, key)
    assert b["before"] == "absent"
    assert b["reason"] is None and b["hit"], b
    assert b["digests"] == a["digests"] and b["generation"] == a["generation"]
    assert b["components"] == {"seed": 7}
    assert b["nbytes"] >= sum(ARTIFACTS.values())
    c = b["counters"]
    assert c["remote.hits"] == 1 and c["remote.records_down"] == 1 and c["remote.blobs_down"] == 2
    assert c["remote.bytes_down"] == b["nbytes"]
    assert c["hits"] == 1 and c["misses.absent"] == 1  # after the restore, an ordinary local hit


def test_record_payload_is_versioned_and_complete(tmp_path):
    store = Store.open(tmp_path / "s")
    data = sample()
    gen = commit_entry(store, "key1", data)
    p = record_payload(store, "key1", 0)
    assert p["format"] == RAW_FORMAT and p["generation"] == gen and p["world_size"] == 1
    assert p["components"] == {"k": "key1"} and p["namespace"] == "default"
    assert p["artifacts"] == {n: [hashlib.sha256(b).hexdigest(), len(b)] for n, b in sorted(data.items())}
    json.dumps(p)


def test_background_save_then_restore(url, signer, trusted, tmp_path):
    a, b = Store.open(tmp_path / "a"), Store.open(tmp_path / "b")
    data = sample()
    commit_entry(a, "bg", data)
    up = BackgroundUploader(open_remote(url, mode="read-write", signer=signer), exit_flush=None)
    assert remote_save(a, up, "bg").ok
    assert up.flush(30)
    assert a.stats().counters["remote.records_up"] == 1
    out = remote_restore(b, open_remote(url, trusted=trusted), "bg")
    assert out.ok, out
    hit = b.lookup("bg")
    assert hit.hit and {n: b.read_artifact(hit.manifest, n) for n in data} == data


def test_untrusted_and_unsigned_records_are_misses_that_commit_nothing(url, trusted, tmp_path):
    a, b = Store.open(tmp_path / "a"), Store.open(tmp_path / "b")
    commit_entry(a, "evil", sample())
    stranger = Signer.from_pem(generate_keypair().private_pem)
    assert remote_save(a, open_remote(url, mode="read-write", signer=stranger), "evil").ok
    reader = open_remote(url, trusted=trusted)
    out = remote_restore(b, reader, "evil")
    assert out.reason == "untrusted_remote"
    nothing_committed(b, "evil")
    # an unsigned record (plain JSON of the right shape) at the right address
    writer = open_remote(url, mode="read-write")
    payload = json.dumps(record_payload(a, "evil", 0)).encode()
    assert writer.put(Kind.AC, record_address("evil", 0), payload).ok
    assert remote_restore(b, reader, "evil").reason == "untrusted_remote"
    nothing_committed(b, "evil")
    assert b.stats().counters["remote.misses.untrusted_remote"] == 2


@pytest.mark.parametrize("damage", ["overwritten", "missing"])
def test_a_damaged_remote_blob_is_a_miss_that_commits_nothing(url, signer, trusted, tmp_path, damage):
    a, b = Store.open(tmp_path / "a"), Store.open(tmp_path / "b")
    data = sample()
    commit_entry(a, "dmg", data)
    writer = open_remote(url, mode="read-write", signer=signer)
    assert remote_save(a, writer, "dmg").ok
    digest = hashlib.sha256(data["big.bin"]).hexdigest()
    if damage == "overwritten":
        assert writer.put(Kind.CAS, digest, os.urandom(len(data["big.bin"]))).ok
    else:
        assert writer.delete(Kind.CAS, digest).ok
    out = remote_restore(b, open_remote(url, trusted=trusted), "dmg")
    assert out.reason == ("remote_checksum" if damage == "overwritten" else "remote_blob_missing"), out
    nothing_committed(b, "dmg")
    assert not b.has_blob(digest)


def test_a_record_of_another_world_size_is_a_miss(url, signer, trusted, tmp_path):
    a, b = Store.open(tmp_path / "a"), Store.open(tmp_path / "b")
    commit_entry(a, "ws", sample())
    assert remote_save(a, open_remote(url, mode="read-write", signer=signer), "ws").ok
    assert remote_restore(b, open_remote(url, trusted=trusted), "ws", 0, 2).reason == "topology_mismatch"
    nothing_committed(b, "ws")


def test_read_only_clients_never_write(signer, trusted, tmp_path, dav_server):
    a = Store.open(tmp_path / "a")
    commit_entry(a, "ro", sample())
    proxy = FaultProxy(dav_server.port)
    try:
        reader = open_remote(f"{proxy.endpoint}/ro-{uuid.uuid4().hex[:8]}", signer=signer, trusted=trusted)
        assert remote_save(a, reader, "ro").reason == "remote_read_only"
        up = BackgroundUploader(reader, exit_flush=None)
        assert remote_save(a, up, "ro").reason == "remote_read_only"
        assert remote_restore(a, reader, "nothing-here").reason == "absent"
        for verb in (b"PUT ", b"DELETE ", b"MKCOL ", b"POST "):
            assert not proxy.saw(verb), verb
        assert "calls.put" not in reader.counters
    finally:
        proxy.close()


@pytest.mark.parametrize("kind", BACKENDS)
def test_a_down_remote_costs_the_timeout_once_then_the_circuit_answers(kind, request, trusted, tmp_path):
    server = request.getfixturevalue("s3_env" if kind == "s3" else "dav_server")
    proxy = FaultProxy(server.port, mode="stall")
    store = Store.open(tmp_path / "s")
    try:
        prefix = f"down-{uuid.uuid4().hex[:8]}"
        opts = dict(timeout=0.5, connect_timeout=0.5, cooldown=30, trusted=trusted)
        if kind == "s3":
            r = open_remote(f"s3://{BUCKET}/{prefix}", endpoint_url=proxy.endpoint, **opts)
        else:
            r = open_remote(f"{proxy.endpoint}/{prefix}", **opts)
        first = remote_restore(store, r, "cold")
        assert first.reason == "remote_timeout", first
        # The open circuit answers without asking the server (the latency itself is
        # measured in bench_remote.py, not asserted by a clock here).
        before = r.counters.get("fast_fails", 0)
        for _ in range(50):
            out = remote_restore(store, r, "cold")
            assert out.reason in ("remote_timeout", "remote_unavailable")
        assert r.counters.get("fast_fails", 0) - before >= 50, r.counters
        nothing_committed(store, "cold")
        assert store.stats().counters["remote.misses"] == 51
    finally:
        proxy.close()


def commit_rank(store: Store, key: str, rank: int, generation: int, data: bytes) -> None:
    ref = store.put_bytes(data)
    store.publish(key, rank=rank, world_size=2, generation=generation, artifacts={"module.pt": ref})
    store.commit(key, rank=rank, generation=generation)


def test_ranks_arriving_one_by_one_are_restored_once_all_are_there(url, signer, trusted, tmp_path):
    """A reader that looked while only rank 0 was up is mended by its next lookup once rank 1 arrives."""
    key = f"k-{uuid.uuid4().hex[:8]}"
    writer = open_remote(url, mode="read-write", signer=signer)
    with Store(tmp_path / "writer") as w, Store(tmp_path / "reader", remote=open_remote(url, trusted=trusted)) as r:
        gen = w.new_generation()
        commit_rank(w, key, 0, gen, b"rank zero" * 10_000)
        commit_rank(w, key, 1, gen, b"rank one" * 10_000)
        assert remote_save(w, writer, key, 0).ok
        first = r.lookup(key)
        assert not first.hit and first.reason in ("absent", "incomplete")  # never a partial hit
        assert r.lookup(key, count=False).reason == "incomplete"  # rank 0 came over, rank 1 is not there yet
        assert remote_save(w, writer, key, 1).ok
        res = r.lookup(key)
        assert res.hit and res.generation == gen and sorted(res.manifests) == [0, 1]
        assert r.read_artifact(res.manifests[1], "module.pt") == b"rank one" * 10_000
        # a newer generation on the remote replaces both ranks of an older one held here
        gen2 = w.new_generation()
        commit_rank(w, key, 0, gen2, b"zero, again")
        commit_rank(w, key, 1, gen2, b"one, again")
        assert remote_save(w, writer, key, 1).ok
        assert remote_save(w, writer, key, 0).ok
        with Store(tmp_path / "other", remote=open_remote(url, trusted=trusted)) as other:
            commit_rank(other, key, 0, gen, b"stale")  # rank 0 of the old generation only: incomplete
            res = other.lookup(key)
            assert res.hit and res.generation == gen2, res
            assert other.read_artifact(res.manifests[0], "module.pt") == b"zero, again"
    writer.close()


def _restore_in_child(root: str, url: str, public_pem: bytes, key: str) -> None:
    from adstore.store.remote import TrustedKeys

    with Store(root) as store:
        remote_restore(store, open_remote(url, trusted=TrustedKeys.from_pem(public_pem), deadline=600), key, 0, 1)


def test_sigkill_during_a_streamed_restore_leaves_nothing_committed(keypair, tmp_path):
    """The reader is killed while a blob streams in: no entry, no blob, only a temp file gc sweeps."""
    import multiprocessing
    import signal

    from remote_faultserver import FaultServer

    server = FaultServer()
    key = "k-sigkill"
    try:
        with Store(tmp_path / "writer") as w:
            data = os.urandom(1 << 20)
            commit_entry(w, key, {"big.bin": data})
            assert remote_save(
                w, open_remote(server.url, mode="read-write", signer=Signer.from_pem(keypair.private_pem)), key
            ).ok
        server.fault(f"cas/{hashlib.sha256(data).hexdigest()}", "drip", interval=0.01, head=512 << 10)
        root = tmp_path / "reader"
        Store(root).close()
        child = multiprocessing.get_context("spawn").Process(
            target=_restore_in_child, args=(str(root), server.url, keypair.public_pem, key)
        )
        child.start()
        tmp = root / "tmp"
        for _ in range(6000):  # until the blob's temp file exists and has bytes in it
            parts = [p for p in tmp.iterdir() if p.stat().st_size > 0]
            if parts or not child.is_alive():
                break
            time.sleep(0.01)
        assert parts, "the restore never started streaming"
        os.kill(child.pid, signal.SIGKILL)
        child.join(10)
        with Store(root, grace_period=0) as store:
            nothing_committed(store, key)
            assert not store.has_blob(hashlib.sha256(data).hexdigest())
            plan = store.plan_sweep()
            assert plan.execute() is not None
            assert list(tmp.iterdir()) == []
            assert store.verify().ok
    finally:
        server.close()


def test_a_restore_another_process_committed_first_is_a_hit(url, signer, trusted, tmp_path):
    """Two processes of one store (``torchrun``'s ranks on a new host) restore the same record at once.

    Replayed in order: this process checked the store (nothing), and while it
    pulled the blobs the other process restored and committed the same
    record.  This process's commit then finds that generation committed
    (``already committed``); the store holds what it restored, so it is a
    hit, not a miss ``store_error``.
    """
    a, b = Store.open(tmp_path / "a"), Store.open(tmp_path / "b")
    data = sample()
    commit_entry(a, "race", data)
    assert remote_save(a, open_remote(url, mode="read-write", signer=signer), "race").ok
    reader = open_remote(url, trusted=trusted)
    pull = reader.pull_blobs

    def pull_while_another_process_restores(*args, **kwargs):
        out = pull(*args, **kwargs)
        other = remote_restore(b, open_remote(url, trusted=trusted), "race")  # the other process, to its end
        assert other.ok, other
        return out

    reader.pull_blobs = pull_while_another_process_restores
    out = remote_restore(b, reader, "race")
    assert out.ok and out.value is not None, out
    hit = b.lookup("race")
    assert hit.hit and {n: b.read_artifact(hit.manifest, n) for n in data} == data
    assert not any(name.startswith("remote.misses") for name in b.stats().counters), b.stats().counters
