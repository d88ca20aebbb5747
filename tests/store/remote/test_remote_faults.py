"""Faults against real servers: killed, stopped, 5xx, resets, lying and evicting remotes.

Every fault is a miss with a reason within the configured timeout, after
which the open circuit answers in under a millisecond; damaged blobs are
never handed back; a read-only client never sends a write.
"""

from __future__ import annotations

import hashlib
import os
import signal
import time
import uuid

import pytest
from remote_faultproxy import FaultProxy
from remote_servers import BUCKET

from adstore.store import ManualClock, Store
from adstore.store.remote import BreakerState, CircuitBreaker, Kind, Remote, SingleFlight, open_remote, record_address

BACKENDS = ["s3", "http"]


def digest_of(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def open_at(kind: str, endpoint: str, prefix: str, **kw) -> Remote:
    """A remote on the server (or proxy) at ``endpoint``."""
    if kind == "s3":
        return open_remote(f"s3://{BUCKET}/{prefix}", endpoint_url=endpoint, **kw)
    return open_remote(f"{endpoint}/{prefix}", **kw)


def server_of(kind: str, request):
    return request.getfixturevalue("s3_env" if kind == "s3" else "dav_server")


@pytest.fixture(params=BACKENDS)
def hosts(request, signer, trusted):
    """(kind, writer, reader): two hosts sharing a fresh prefix on a real server."""
    url = request.getfixturevalue(f"{request.param}_url")
    return request.param, open_remote(url, mode="read-write", signer=signer), open_remote(url, trusted=trusted)


def fast_fail_times(remote: Remote, n: int = 50) -> list[float]:
    d = digest_of(b"anything")
    out = []
    for _ in range(n):
        t = time.perf_counter()
        res = remote.head(Kind.CAS, d)
        out.append(time.perf_counter() - t)
        assert res.reason in ("remote_unavailable", "remote_timeout")
    return out


@pytest.mark.parametrize("kind", BACKENDS)
def test_killed_server_refuses_then_the_circuit_answers_at_once(kind, private_server):
    server = private_server(kind)
    r = open_at(kind, server.endpoint, "kill", mode="read-write", timeout=2, connect_timeout=1, cooldown=60)
    data = os.urandom(1000)
    assert r.put(Kind.CAS, digest_of(data), data).ok
    server.proc.kill()
    server.proc.wait(5)
    out = r.get(Kind.CAS, digest_of(data))
    assert out.reason == "remote_unavailable"  # refused: no timeout was waited for
    assert r.breaker.state is BreakerState.OPEN
    times = fast_fail_times(r)
    assert r.counters["breaker_opened"] == 1 and r.counters["fast_fails"] == len(times)


@pytest.mark.parametrize("kind", BACKENDS)
def test_stopped_server_costs_one_timeout_then_recovers(kind, private_server):
    server = private_server(kind)
    timeout = 0.5
    r = open_at(kind, server.endpoint, "stop", mode="read-write", timeout=timeout, connect_timeout=timeout)
    clock = ManualClock()
    r.breaker = CircuitBreaker(cooldown=60, clock=clock)
    data = os.urandom(1000)
    assert r.put(Kind.CAS, digest_of(data), data).ok
    os.kill(server.proc.pid, signal.SIGSTOP)
    try:
        out = r.get(Kind.CAS, digest_of(data))
        assert out.reason == "remote_timeout", out  # the read timeout, not a hang (how long: bench_remote.py)
        n = len(fast_fail_times(r))
        assert r.counters["fast_fails"] >= n  # answered by the open circuit, not the server
    finally:
        os.kill(server.proc.pid, signal.SIGCONT)
    clock.advance(61)  # past the cool-down: the next call is the probe
    assert r.get(Kind.CAS, digest_of(data)).value == data
    assert r.breaker.state is BreakerState.CLOSED


@pytest.mark.parametrize("mode", ["503", "reset", "stall"])
@pytest.mark.parametrize("kind", BACKENDS)
def test_5xx_resets_and_hangs_through_a_proxy(kind, mode, request):
    server = server_of(kind, request)
    proxy = FaultProxy(server.port, mode=mode)
    try:
        r = open_at(
            kind, proxy.endpoint, f"proxy-{uuid.uuid4().hex[:8]}", mode="read-write", timeout=0.5, connect_timeout=0.5
        )
        clock = ManualClock()
        r.breaker = CircuitBreaker(cooldown=60, clock=clock)
        data = os.urandom(2000)
        out = r.put(Kind.CAS, digest_of(data), data)
        expected = "remote_timeout" if mode == "stall" else "remote_unavailable"
        assert out.reason == expected, out
        assert r.breaker.state is BreakerState.OPEN
        proxy.set_mode("pass")
        clock.advance(61)
        assert r.put(Kind.CAS, digest_of(data), data).ok
        assert r.get(Kind.CAS, digest_of(data)).value == data
    finally:
        proxy.close()


def _fetch_through_proxy(kind, request, tmp_path, mode: str):
    """A 1 MiB blob put on a fresh server, fetched back through a :class:`FaultProxy` in ``mode``."""
    server = server_of(kind, request)
    prefix = f"{mode}-{uuid.uuid4().hex[:8]}"
    data = os.urandom(1 << 20)
    d = digest_of(data)
    writer = open_at(kind, server.endpoint, prefix, mode="read-write")
    if kind == "s3":
        writer.backend.send_checksums = False  # botocore then stores its default CRC32 with the object
    assert writer.put(Kind.CAS, d, data).ok
    proxy = FaultProxy(server.port, mode=mode)
    try:
        r = open_at(kind, proxy.endpoint, prefix, timeout=2, connect_timeout=1)
        return r, r.fetch_blob(d, len(data), dest=tmp_path / "blob"), d, len(data)
    finally:
        proxy.close()


@pytest.mark.parametrize("kind", BACKENDS)
def test_a_download_cut_short_is_unavailable_not_a_blob(kind, request, tmp_path):
    _, out, _, _ = _fetch_through_proxy(kind, request, tmp_path, "cut")
    assert out.reason == "remote_unavailable", out
    assert not (tmp_path / "blob").exists()


@pytest.mark.parametrize("kind", BACKENDS)
def test_a_download_damaged_in_transit_is_rejected_by_its_digest(kind, request, tmp_path):
    """One byte flipped on the wire, length unchanged: SHA-256 refuses it (for S3 too, not botocore's CRC32)."""
    r, out, d, size = _fetch_through_proxy(kind, request, tmp_path, "flip")
    assert out.reason == "remote_checksum" and out.error.got_digest not in (None, d), out
    assert out.error.got_size == size and not (tmp_path / "blob").exists()
    assert r.counters["checksum_rejected"] == 1


def test_an_overwritten_remote_blob_is_rejected(hosts, tmp_path):
    kind, writer, reader = hosts
    data = os.urandom(200_000)
    d = digest_of(data)
    assert writer.push_blob(d, len(data), data).ok
    if kind == "s3":
        writer.backend.send_checksums = False  # a server that does not check (or another writer) replaced it
    writer.backend.put(Kind.CAS, d, os.urandom(len(data)))
    out = reader.fetch_blob(d, len(data), dest=tmp_path / "blob")
    assert out.reason == "remote_checksum" and out.value is None and not (tmp_path / "blob").exists()
    assert reader.get(Kind.CAS, d).reason == "remote_checksum"
    with Store.open(tmp_path / "store", grace_period=0.0) as store:
        assert reader.pull_blobs([(d, len(data))], sink=store).reason == "remote_checksum"
        assert not store.has_blob(d)


def test_a_record_whose_blob_was_evicted_is_a_miss(hosts, tmp_path):
    _, writer, reader = hosts
    with Store.open(tmp_path / "a", grace_period=0.0) as a:
        refs = [a.put_bytes(os.urandom(n)) for n in (100_000, 150_000)]
        pairs = [(ref.digest, ref.size) for ref in refs]
        assert writer.publish("key", 0, {"blobs": pairs}, pairs, source=a).ok
    writer.backend.delete(Kind.CAS, pairs[1][0])  # the server's LRU evicted one blob
    record = reader.fetch_record("key", 0)
    assert record.ok
    with Store.open(tmp_path / "b", grace_period=0.0) as b:
        out = reader.pull_blobs([tuple(p) for p in record.value.payload["blobs"]], sink=b)
        assert out.reason == "remote_blob_missing"
        assert not b.has_blob(pairs[1][0])


def test_poisoned_records_on_a_real_server_are_untrusted(hosts):
    from adstore.store.remote import Signer, generate_keypair

    _, writer, reader = hosts
    payload = {"blobs": [["ab" * 32, 1]]}
    assert writer.push_record("key", 0, payload).ok and reader.fetch_record("key", 0).ok
    mallory = Signer.from_pem(generate_keypair().private_pem)
    writer.backend.put(Kind.AC, record_address("key", 0), mallory.seal({**payload, "key": "key", "rank": 0}))
    assert reader.fetch_record("key", 0).reason == "untrusted_remote"
    writer.backend.put(Kind.AC, record_address("key", 0), b'{"format":"adstore.record","version":1}')
    assert reader.fetch_record("key", 0).reason == "untrusted_remote"


@pytest.mark.parametrize("kind", BACKENDS)
def test_a_read_only_client_never_sends_a_write(kind, request, tmp_path, signer, trusted):
    server = server_of(kind, request)
    proxy = FaultProxy(server.port)
    prefix = f"ro-{uuid.uuid4().hex[:8]}"
    try:
        reader = open_at(kind, proxy.endpoint, prefix, mode="read", signer=signer, trusted=trusted)
        data = os.urandom(5000)
        d = digest_of(data)
        with Store.open(tmp_path / "s", grace_period=0.0) as store:
            ref = store.put_bytes(data)
            outs = [
                reader.put(Kind.CAS, d, data),
                reader.put_if_absent(Kind.AC, d, b"x"),
                reader.delete(Kind.CAS, d),
                reader.push_blob(d, len(data), data),
                reader.push_record("k", 0, {}),
                reader.publish("k", 0, {}, [(ref.digest, ref.size)], source=store),
            ]
        assert {o.reason for o in outs} == {"remote_read_only"}
        assert SingleFlight(reader, settle=0).acquire("k").role == "solo"
        assert reader.fetch_record("k", 0).reason == "absent" and reader.head(Kind.CAS, d).value is None
        assert proxy.saw(b"HEAD ") or proxy.saw(b"GET ")  # the reads did go through the proxy
        for verb in (b"PUT ", b"POST ", b"DELETE ", b"MKCOL "):
            assert not proxy.saw(verb), verb
    finally:
        proxy.close()
    if kind == "http":
        assert not (server.root / prefix).exists()
    else:
        import boto3

        listing = boto3.session.Session().client("s3").list_objects_v2(Bucket=BUCKET, Prefix=prefix)
        assert listing.get("KeyCount", 0) == 0
