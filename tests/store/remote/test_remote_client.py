"""The public layer on the memory backend: mode, breaker, outcomes, transfers, config.

Read-only mode is enforced in one place, so every write path is checked
here against the memory backend's log of operations; the circuit breaker
runs on a fake clock; pulls go into a real Store.
"""

from __future__ import annotations

import hashlib
import os

import pytest

from adstore.store import ConfigError, Store
from adstore.store.remote import (
    BreakerState,
    CircuitBreaker,
    Kind,
    MemoryBackend,
    Mode,
    Remote,
    RemoteConfig,
    RemoteTimeout,
    RemoteUnavailable,
    SingleFlight,
    open_remote,
    record_address,
    register_scheme,
)


def digest_of(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


# -- read-only mode -----------------------------------------------------------
def test_read_only_client_never_writes(memory, signer, trusted, tmp_path):
    r = Remote(memory, mode="read", signer=signer, trusted=trusted)
    data = os.urandom(5000)
    d = digest_of(data)
    (tmp_path / "blob").write_bytes(data)
    outs = [
        r.put(Kind.CAS, d, data),
        r.put_if_absent(Kind.AC, d, b"x"),
        r.delete(Kind.AC, d),
        r.push_blob(d, len(data), data),
        r.push_blob(d, len(data), tmp_path / "blob"),
        r.push_record("k", 0, {"blobs": []}),
    ]
    assert {o.reason for o in outs} == {"remote_read_only"}
    flight = SingleFlight(r, settle=0).acquire("k")
    assert flight.role == "solo" and flight.reason == "remote_read_only"
    assert memory.writes() == [] and memory.objects == {}
    assert r.counters["errors.remote_read_only"] == 6


def test_outcomes_never_raise(memory):
    memory.fail = RemoteUnavailable("connection refused")
    r = Remote(memory, mode="read-write", breaker=CircuitBreaker(cooldown=0))
    d = digest_of(b"x")
    for out in (
        r.get(Kind.CAS, d),
        r.head(Kind.AC, d),
        r.put(Kind.AC, d, b"x"),
        r.fetch_record("k", 0),
        r.push_blob(d, 1, b"x"),
        r.probe(),
    ):
        assert not out.ok and out.reason == "remote_unavailable" and out.value is None


# -- circuit breaker ----------------------------------------------------------
def test_breaker_opens_fails_fast_half_opens_and_closes(memory):
    clock = Clock()
    r = Remote(memory, breaker=CircuitBreaker(cooldown=30, max_cooldown=100, clock=clock))
    d = digest_of(b"x")
    memory.fail = RemoteTimeout("read timed out")
    assert r.head(Kind.CAS, d).reason == "remote_timeout"
    assert r.breaker.state is BreakerState.OPEN and r.counters["breaker_opened"] == 1
    calls = len(memory.ops)
    fast = r.head(Kind.CAS, d)
    assert fast.reason == "remote_timeout" and fast.error.retry_after == pytest.approx(30)
    assert len(memory.ops) == calls  # the server was not asked
    clock.now += 30
    assert r.breaker.state is BreakerState.HALF_OPEN
    assert r.head(Kind.CAS, d).reason == "remote_timeout"  # the probe fails: open for twice as long
    clock.now += 59
    assert r.head(Kind.CAS, d).error.retry_after == pytest.approx(1)
    clock.now += 1
    memory.fail = None
    assert r.head(Kind.CAS, d).ok and r.breaker.state is BreakerState.CLOSED
    assert r.counters["fast_fails"] == 2


def test_open_breaker_answers_without_calling_the_backend(memory):
    r = Remote(memory, breaker=CircuitBreaker(cooldown=60))
    memory.fail = RemoteUnavailable("connection refused")
    d = digest_of(b"x")
    r.head(Kind.CAS, d)
    calls = memory.calls if hasattr(memory, "calls") else None
    for _ in range(200):
        out = r.fetch_record("k", 0)
        assert out.reason == "remote_unavailable"
    # The open breaker answers without calling the backend (its latency is a bench_remote row).
    assert r.counters["fast_fails"] >= 200
    if calls is not None:
        assert memory.calls == calls


def test_answers_that_are_errors_do_not_open_the_breaker(memory):
    from adstore.store.remote import RemoteRejected

    r = Remote(memory)
    memory.fail = RemoteRejected("HTTP 403 Forbidden", status=403)
    assert r.head(Kind.CAS, digest_of(b"x")).reason == "remote_error"
    assert r.breaker.state is BreakerState.CLOSED


def test_half_open_lets_one_probe_through():
    clock = Clock()
    b = CircuitBreaker(cooldown=5, clock=clock)
    b.failure(RemoteUnavailable("refused"))
    clock.now += 5
    b.before()  # the probe
    with pytest.raises(RemoteUnavailable):
        b.before()  # everyone else still fails fast
    b.success()
    b.before()


# -- transfers -----------------------------------------------------------------
def test_fetch_blob_rejects_overwritten_and_resized_blobs(memory, tmp_path):
    r = Remote(memory, mode="read-write")
    data = os.urandom(10_000)
    d = digest_of(data)
    memory.put(Kind.CAS, d, os.urandom(10_000))  # same size, other bytes
    out = r.fetch_blob(d, len(data), dest=tmp_path / "a")
    assert out.reason == "remote_checksum" and out.error.got_digest != d and not (tmp_path / "a").exists()
    memory.put(Kind.CAS, d, data + b"more")
    out = r.fetch_blob(d, len(data), dest=tmp_path / "b")
    assert out.reason == "remote_checksum" and not (tmp_path / "b").exists()
    memory.put(Kind.CAS, d, data[:-1])
    assert r.fetch_blob(d, len(data), dest=tmp_path / "c").reason == "remote_checksum"
    memory.put(Kind.CAS, d, data)
    out = r.fetch_blob(d, len(data), dest=tmp_path / "d")
    assert out.ok and out.value.read_bytes() == data and out.nbytes == len(data)
    assert r.counters["checksum_rejected"] == 3


def test_fetch_blob_never_follows_or_replaces_a_file(memory, tmp_path):
    r = Remote(memory)
    data = b"x" * 100
    memory.put(Kind.CAS, digest_of(data), data)
    (tmp_path / "target").write_bytes(b"precious")
    os.symlink(tmp_path / "target", tmp_path / "link")
    for dest in (tmp_path / "target", tmp_path / "link"):
        out = r.fetch_blob(digest_of(data), 100, dest=dest)
        assert not out.ok
    assert (tmp_path / "target").read_bytes() == b"precious"


def test_push_dedups_by_head_and_counts_bytes(memory):
    r = Remote(memory, mode="read-write")
    data = os.urandom(4096)
    d = digest_of(data)
    assert r.push_blob(d, len(data), data).nbytes == 4096
    again = r.push_blob(d, len(data), data)
    assert again.ok and again.value == 0 and again.nbytes == 0
    assert r.counters["bytes_skipped"] == 4096 and r.counters["bytes_up"] == 4096


def test_pull_into_a_store_and_publish_from_it(tmp_path, signer, trusted):
    """Host A publishes from its store; host B (empty store) pulls the same bytes."""
    memory = MemoryBackend()
    a = Store.open(tmp_path / "a", grace_period=0.0)
    b = Store.open(tmp_path / "b", grace_period=0.0)
    try:
        refs = [a.put_bytes(os.urandom(n)) for n in (10, 100_000, 3 << 20)]  # inline and file blobs
        pairs = [(ref.digest, ref.size) for ref in refs]
        writer = Remote(memory, mode="read-write", signer=signer)
        assert writer.publish("key1", 0, {"blobs": pairs}, pairs, source=a).ok
        record_op = ("put", f"ac/{record_address('key1', 0)}")
        assert memory.ops.index(record_op) > max(i for i, op in enumerate(memory.ops) if op[1].startswith("cas/"))
        again = writer.publish("key1", 0, {"blobs": pairs}, pairs, source=a)
        assert again.ok and again.value == 0  # re-push: 0 blob bytes

        reader = Remote(memory, trusted=trusted)
        record = reader.fetch_record("key1", 0)
        assert record.ok
        got = [(dg, sz) for dg, sz in record.value.payload["blobs"]]
        pulled = reader.pull_blobs(got, sink=b)
        assert pulled.ok and pulled.value == sum(ref.size for ref in refs)
        for ref in refs:
            assert b.get_bytes(ref) == a.get_bytes(ref)
        assert reader.pull_blobs(got, sink=b).value == 0  # nothing left to fetch
        assert not list((tmp_path / "b" / "tmp").iterdir())
    finally:
        a.close()
        b.close()


def test_pull_stops_at_a_missing_blob(tmp_path):
    memory = MemoryBackend()
    store = Store.open(tmp_path / "s", grace_period=0.0)
    try:
        data = os.urandom(100_000)
        out = Remote(memory).pull_blobs([(digest_of(data), len(data))], sink=store)
        assert out.reason == "remote_blob_missing" and not store.has_blob(digest_of(data))
    finally:
        store.close()


# -- configuration --------------------------------------------------------------
def test_config_from_env(tmp_path):
    assert not RemoteConfig.from_env({}).enabled and RemoteConfig.from_env({}).open() is None
    cfg = RemoteConfig.from_env(
        {
            "ADSTORE_REMOTE": "memory://cfg",
            "ADSTORE_REMOTE_MODE": "read-write",
            "ADSTORE_REMOTE_TIMEOUT": "3s",
            "ADSTORE_REMOTE_CONNECT_TIMEOUT": "500ms",
            "ADSTORE_REMOTE_COOLDOWN": "1m",
        }
    )
    assert (cfg.mode, cfg.timeout, cfg.connect_timeout, cfg.cooldown) == (Mode.READ_WRITE, 3.0, 0.5, 60.0)
    r = cfg.open()
    assert r.writable and r.url == "memory://cfg" and r.breaker.base_cooldown == 60.0
    assert RemoteConfig.from_env({"ADSTORE_REMOTE": "memory://x"}).mode is Mode.READ
    with pytest.raises(ConfigError):
        RemoteConfig.from_env({"ADSTORE_REMOTE_MODE": "write-only"})
    with pytest.raises(ConfigError):
        RemoteConfig.from_env({"ADSTORE_REMOTE_TIMEOUT": "soon"})


def test_config_loads_keys(tmp_path, keypair):
    from adstore.store.remote import write_keypair

    private, public = write_keypair(tmp_path / "keys")
    assert private.stat().st_mode & 0o777 == 0o600
    r = RemoteConfig.from_env(
        {
            "ADSTORE_REMOTE": "memory://keys",
            "ADSTORE_SIGNING_KEY": str(private),
            "ADSTORE_TRUSTED_KEYS": str(tmp_path / "keys"),
        }
    ).open()
    assert r.signer.key_id in r.trusted and r.status()["trusted_keys"] == [r.signer.key_id]
    with pytest.raises(ConfigError):
        RemoteConfig(url="memory://k", signing_key=public).open()  # a public key is no signing key
    with pytest.raises(ConfigError):
        RemoteConfig(url="memory://k", trusted_keys=tmp_path / "missing").open()


def test_open_remote_schemes():
    with pytest.raises(ConfigError):
        open_remote("ftp://host/x")
    with pytest.raises(ConfigError):
        open_remote("s3:///no-bucket")
    with pytest.raises(ConfigError):
        open_remote("http:///no-host")
    seen = {}

    def factory(url, **options):
        seen.update(options, url=url)
        return MemoryBackend(url=url)

    register_scheme("custom", factory)
    r = open_remote("custom://svc/p", timeout=4, connect_timeout=1, extra=True)
    assert seen == {"url": "custom://svc/p", "connect_timeout": 1, "read_timeout": 4, "extra": True}
    assert r.mode is Mode.READ and r.status()["conditional_writes"] == "atomic"


def test_importing_the_tier_imports_neither_boto3_nor_cryptography():
    import subprocess
    import sys

    code = (
        "import sys, adstore.store.remote as r; r.open_remote('memory://x'); "
        "print(sorted(m for m in ('boto3', 'botocore', 'cryptography') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "[]"


def test_large_downloads_hash_in_a_helper_thread(memory, tmp_path):
    from adstore.store.remote.transfer import BACKGROUND_HASH_BYTES

    r = Remote(memory)
    data = os.urandom(BACKGROUND_HASH_BYTES + 12345)
    d = digest_of(data)
    memory.put(Kind.CAS, d, data)
    out = r.fetch_blob(d, len(data), dest=tmp_path / "big")
    assert out.ok and out.value.read_bytes() == data
    memory.put(Kind.CAS, d, data[:-1] + b"!")
    assert r.fetch_blob(d, len(data), dest=tmp_path / "bad").reason == "remote_checksum"
    assert not (tmp_path / "bad").exists()


def test_a_full_local_disk_is_a_store_error_not_a_remote_failure(memory, tmp_path, monkeypatch):
    import errno

    from adstore.store.remote.transfer import BACKGROUND_HASH_BYTES, HashingWriter

    def full(self, data):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(HashingWriter, "_consume", full)
    r = Remote(memory)
    for size in (1000, BACKGROUND_HASH_BYTES):  # written inline, and from the helper thread
        data = os.urandom(size)
        memory.put(Kind.CAS, digest_of(data), data)
        out = r.fetch_blob(digest_of(data), size, dest=tmp_path / f"b{size}")
        assert out.reason == "disk_full" and not (tmp_path / f"b{size}").exists()
    assert r.breaker.state is BreakerState.CLOSED
