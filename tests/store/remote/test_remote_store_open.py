"""``Store.open(root, remote=...)``: a store whose lookups fall back to the remote and whose commits are pushed.

Two roots share one real server: a commit on A's store is pushed as it
happens; a lookup on B's empty store restores it and is an ordinary hit.
The explicit argument wins over ``ADSTORE_REMOTE``; ``Store.from_env`` reads
it; untrusted records and a read-only store behave as in the tier itself
(docs/remote.md, "Where the remote comes from").
"""

from __future__ import annotations

import os
import uuid

import pytest

from adstore.store import Store
from adstore.store.remote import RemoteConfig, Signer, generate_keypair, open_remote, write_keypair


def commit(store: Store, key: str, data: dict[str, bytes], world_size: int = 1) -> int:
    gen = store.new_generation()
    for rank in range(world_size):
        refs = {name: store.put_bytes(b + bytes([rank])) for name, b in data.items()}
        store.publish(key, rank=rank, world_size=world_size, generation=gen, artifacts=refs, components={"k": key})
    for rank in range(world_size):
        store.commit(key, rank=rank, generation=gen, components={"k": key})
    return gen


@pytest.fixture
def keys(tmp_path, monkeypatch):
    private, public = write_keypair(tmp_path / "keys")
    monkeypatch.setenv("ADSTORE_SIGNING_KEY", str(private))
    monkeypatch.setenv("ADSTORE_TRUSTED_KEYS", str(public))
    monkeypatch.delenv("ADSTORE_REMOTE", raising=False)
    return private, public


@pytest.mark.parametrize("backend", ["s3", "http"])
def test_a_commit_is_pushed_and_a_lookup_on_an_empty_store_restores_it(backend, request, keys, tmp_path, monkeypatch):
    url = request.getfixturevalue(f"{backend}_url")
    data = {"big.bin": os.urandom(100_000), "small": b"x"}
    monkeypatch.setenv("ADSTORE_REMOTE_MODE", "read-write")
    with Store.open(tmp_path / "a", remote=url) as a:
        gen = commit(a, "k1", data, world_size=2)
        assert a.stats().counters["remote.records_up"] == 2
    monkeypatch.setenv("ADSTORE_REMOTE_MODE", "read")
    with Store.open(tmp_path / "b", remote=url) as b:
        assert b.tier is not None and not b.tier.remote.writable
        hit = b.lookup("k1")  # rank None: every rank of the record
        assert hit.hit and hit.generation == gen and sorted(hit.manifests) == [0, 1]
        assert b.read_artifact(hit.manifests[1], "big.bin") == data["big.bin"] + b"\x01"
        c = b.stats().counters
        assert c["remote.hits"] == 2 and c["hits"] == 1 and "misses" not in c
        assert "remote.bytes_up" not in c  # a restore is never pushed back
        assert not b.lookup("nothing").hit and b.lookup("nothing").reason == "absent"


def test_an_untrusted_record_is_a_miss_with_its_reason(http_url, keys, tmp_path, monkeypatch):
    stranger = open_remote(http_url, mode="read-write", signer=Signer.from_pem(generate_keypair().private_pem))
    with Store.open(tmp_path / "a", remote=stranger) as a:
        commit(a, "evil", {"x": b"payload"})
    assert a.tier is not None and a.tier.remote.counters["records_up"] == 1
    with Store.open(tmp_path / "b", remote=http_url) as b:
        miss = b.lookup("evil")
        assert not miss.hit and miss.reason == "untrusted_remote"
        assert b.entry("evil") is None


def test_the_argument_wins_over_the_environment_and_from_env_reads_it(http_url, keys, tmp_path, monkeypatch):
    monkeypatch.setenv("ADSTORE_REMOTE", f"memory://env-{uuid.uuid4().hex[:8]}")
    with Store.open(tmp_path / "s", remote=http_url) as s:
        assert s.tier is not None and s.tier.remote.url.startswith(http_url)
    with Store.open(tmp_path / "s") as s:
        assert s.tier is None  # Store.open never reads the environment for a remote
    monkeypatch.setenv("ADSTORE_ROOT", str(tmp_path / "s"))
    with Store.from_env() as s:
        assert s.tier is not None and s.tier.remote.url.startswith("memory://env-")
    with Store.from_env(remote=RemoteConfig(url=http_url)) as s:
        assert s.tier is not None and s.tier.remote.url.startswith(http_url)


def test_a_down_remote_never_fails_a_lookup_or_a_commit(keys, tmp_path, monkeypatch):
    from remote_servers import free_port

    monkeypatch.setenv("ADSTORE_REMOTE_MODE", "read-write")
    cfg = RemoteConfig.from_env(url=f"http://127.0.0.1:{free_port()}/x", timeout=0.5, connect_timeout=0.5)
    with Store.open(tmp_path / "s", remote=cfg) as s:
        commit(s, "k", {"x": b"1"})
        assert s.lookup("k").hit
        miss = s.lookup("cold")
        assert not miss.hit and miss.reason == "remote_unavailable"


def test_a_bad_remote_environment_is_logged_and_the_store_runs_alone(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("ADSTORE_ROOT", str(tmp_path / "s"))
    monkeypatch.setenv("ADSTORE_REMOTE", "memory://x")
    monkeypatch.setenv("ADSTORE_TRUSTED_KEYS", str(tmp_path / "no-such-key.pub"))
    with Store.from_env() as s:
        assert s.tier is None
        commit(s, "k", {"x": b"1"})
        assert s.lookup("k").hit
    assert "remote tier disabled" in caplog.text
    from adstore.store.errors import AdstoreError

    with pytest.raises(AdstoreError):  # an explicit argument is a programming error: raised at once
        Store.open(tmp_path / "t", remote=RemoteConfig.from_env(url="memory://x"))


_LAZY_CHILD = """
import sys
from adstore.store import Store

with Store.from_env() as store:
    gen = store.new_generation()
    ref = store.put_bytes(b"weights")
    store.publish("k", rank=0, world_size=1, generation=gen, artifacts={"a": ref}, components={"k": "k"})
    store.commit("k", rank=0, generation=gen, components={"k": "k"})
    assert store.tier is not None and store.lookup("k").hit
    print("after a local hit:", "boto3" in sys.modules)
    print("miss:", store.lookup("absent-here").reason)
    print("after a miss:", "boto3" in sys.modules)
"""


def test_a_process_whose_lookups_hit_locally_never_loads_boto3(s3_url, tmp_path):
    """A warm restart with an s3:// remote configured pays nothing for it: boto3 is imported on the
    first request (a local miss), not when the store is opened."""
    import subprocess
    import sys

    env = {**os.environ, "ADSTORE_ROOT": str(tmp_path / "r"), "ADSTORE_REMOTE": s3_url, "ADSTORE_REMOTE_MODE": "read"}
    env.pop("ADSTORE_SIGNING_KEY", None)
    out = subprocess.run([sys.executable, "-c", _LAZY_CHILD], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == ["after a local hit: False", "miss: absent", "after a miss: True"], out.stdout
