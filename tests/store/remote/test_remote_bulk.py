"""``adstore push --all/--namespace`` and ``pull --all/--namespace`` through real servers (WebDAV, S3 on moto).

push uploads entries built before a remote was set; pull fills a store at
image build time from what the remote lists, trusting only records signed
by a trusted key and found at their own address.
"""

from __future__ import annotations

import hashlib
import json
import os

import pytest

from adstore.daemon.cli import main
from adstore.store import Store
from adstore.store.remote import Kind, RemoteConfig, Signer, generate_keypair, write_keypair


def run(capsys, *argv):
    code = main(list(argv))
    out = capsys.readouterr()
    return code, (json.loads(out.out) if out.out.strip().startswith("{") else out.out), out.err


@pytest.fixture(params=["http", "s3"])
def remote(request, tmp_path, monkeypatch):
    url = request.getfixturevalue(f"{request.param}_url")
    private, public = write_keypair(tmp_path / "keys")
    monkeypatch.setenv("ADSTORE_REMOTE", url)
    monkeypatch.setenv("ADSTORE_SIGNING_KEY", str(private))
    monkeypatch.setenv("ADSTORE_TRUSTED_KEYS", str(public))
    monkeypatch.delenv("ADSTORE_REMOTE_MODE", raising=False)
    return url


def build(root):
    """Entries of two namespaces, one of two ranks, saved with no remote set: {key: {rank: sha256 of 'w'}}."""
    want = {}
    with Store.open(root) as store:
        for key, namespace, world in (("k-alpha-1", "alpha", 1), ("k-alpha-2", "alpha", 2), ("k-beta-1", "beta", 1)):
            gen = store.new_generation()
            want[key] = {}
            for rank in range(world):
                data = os.urandom(50_000 + rank)
                want[key][rank] = hashlib.sha256(data).hexdigest()
                store.save(
                    key,
                    {"w": store.put_bytes(data), "s": store.put_bytes(b"small")},
                    rank=rank,
                    world_size=world,
                    generation=gen,
                    namespace=namespace,
                )
    return want


def holds(root, want):
    with Store.open(root, create=False) as store:
        for key, ranks in want.items():
            found = store.lookup(key)
            assert found.hit, (key, found.reason)
            for rank, digest in ranks.items():
                got = hashlib.sha256(store.read_artifact(found.manifests[rank], "w")).hexdigest()
                assert got == digest
        return {e.key for e in store.entries()}


def test_push_all_then_pull_namespace_and_pull_all_round_trip(remote, tmp_path, capsys):
    a, b, c = tmp_path / "a", tmp_path / "b", tmp_path / "c"
    want = build(a)
    code, data, err = run(capsys, "--root", str(a), "push", "--all", "--mode", "read-write", "--json")
    assert code == 0, err
    assert sorted((r["key"], r["rank"]) for r in data["results"]) == [
        ("k-alpha-1", 0),
        ("k-alpha-2", 0),
        ("k-alpha-2", 1),
        ("k-beta-1", 0),
    ]
    assert all(r["reason"] is None for r in data["results"])

    # A stranger in ac/: a record signed by a key nobody trusts, at a real record's address.
    other = Signer.from_pem(generate_keypair().private_pem)
    foreign = RemoteConfig.from_env(url=remote, mode="read-write").open()
    assert foreign is not None
    foreign.signer = other
    assert foreign.push_record("k-forged", 0, {"format": 2}).ok
    foreign.close()

    code, data, err = run(capsys, "--root", str(b), "pull", "--namespace", "alpha", "--json")
    assert code == 0, err
    assert sorted((r["key"], r["rank"]) for r in data["results"]) == [
        ("k-alpha-1", 0),
        ("k-alpha-2", 0),
        ("k-alpha-2", 1),
    ]
    assert holds(b, {k: v for k, v in want.items() if k.startswith("k-alpha")}) == {"k-alpha-1", "k-alpha-2"}

    code, data, err = run(capsys, "--root", str(c), "pull", "--all", "--json")
    assert code == 0, err
    assert len(data["results"]) == 4 and data["counters"]["records_skipped"] >= 1
    assert holds(c, want) == set(want)

    code, data, _ = run(capsys, "--root", str(c), "pull", "--all", "--json")  # everything is local already
    assert code == 0 and {r["source"] for r in data["results"]} == {"local"}

    code, data, _ = run(capsys, "--root", str(a), "push", "--namespace", "beta", "--mode", "read-write", "--json")
    assert code == 0 and [r["key"] for r in data["results"]] == ["k-beta-1"]


def test_dry_run_plans_push_and_pull_and_moves_nothing(remote, tmp_path, capsys):
    """``--dry-run``: what would move, in blobs and bytes, asked of the remote with HEADs and records only."""
    a, b = tmp_path / "a", tmp_path / "b"
    build(a)
    with Store.open(a) as store:  # the distinct blobs: four of 50 kB, one "small" that every rank shares
        sizes = {r.digest: r.size for m in _manifests(store) for r in m.artifacts.values()}
    code, plan, err = run(capsys, "--root", str(a), "push", "--all", "--mode", "read-write", "--dry-run", "--json")
    assert code == 0 and plan["dry_run"] is True, err
    assert len(plan["plan"]) == 4 and plan["blobs"] == len(sizes) == 5, plan
    assert sum(sizes.values()) - 1024 <= plan["bytes"] <= sum(sizes.values()) + 1024, (plan, sizes)
    code, empty, err = run(capsys, "--root", str(b), "pull", "--all", "--dry-run", "--json")
    assert code == 0 and empty["plan"] == [] and empty["blobs"] == 0, err  # nothing was pushed: nothing listed
    assert not b.exists()

    code, data, err = run(capsys, "--root", str(a), "push", "--all", "--mode", "read-write", "--json")
    assert code == 0, err
    assert sum(r["bytes"] for r in data["results"]) >= plan["bytes"]  # the records on top of the blobs
    code, again, _ = run(capsys, "--root", str(a), "push", "--all", "--mode", "read-write", "--dry-run", "--json")
    assert again["blobs"] == 0 and again["bytes"] == 0 and all(r["blobs_there"] == 2 for r in again["plan"])

    code, pulled, err = run(capsys, "--root", str(b), "pull", "--all", "--dry-run")
    assert code == 0 and "dry run: would receive 5 blob(s)" in pulled and "4 record(s); nothing moved" in pulled, err
    assert not b.exists()  # a dry run creates no store


def _manifests(store):
    return [m for e in store.entries() for m in store.manifests(e.key)]


def test_keys_and_all_together_or_neither_is_a_usage_error(remote, tmp_path, capsys):
    a = tmp_path / "a"
    build(a)
    for argv in (["push", "k-alpha-1", "--all"], ["push"], ["pull"], ["pull", "x", "--namespace", "alpha"]):
        code, data, _ = run(capsys, "--root", str(a), "--json", *argv, "--mode", "read-write")
        assert code == 2 and data["error"]["reason"] == "usage", argv


def test_pull_all_without_trusted_keys_fails_whole(remote, tmp_path, capsys, monkeypatch):
    build(tmp_path / "a")
    assert run(capsys, "--root", str(tmp_path / "a"), "push", "--all", "--mode", "read-write")[0] == 0
    monkeypatch.delenv("ADSTORE_TRUSTED_KEYS")
    code, data, err = run(capsys, "--root", str(tmp_path / "b"), "pull", "--all", "--json")
    assert code == 14 and data["error"]["reason"] == "untrusted_remote"
    # One line that says what failed and what to set (a new user read "(listing) rank -" and nothing more).
    assert err.count("\n") == 1 and "failed to list the remote: untrusted_remote" in err, err
    assert "ADSTORE_TRUSTED_KEYS" in err and "adstore keygen" in err, err


def test_a_backend_without_listing_is_remote_unsupported():
    from adstore.store.remote import RemoteBackend

    class Bazel(RemoteBackend):  # the Bazel HTTP protocol has no listing
        def get_to(self, kind, digest, fileobj, max_bytes):
            return None

        def put(self, kind, digest, data):
            return 0

        def head(self, kind, digest):
            return None

        def delete(self, kind, digest):
            return None

    from adstore.store.remote import Remote, TrustedKeys

    remote = Remote(Bazel(), trusted=TrustedKeys.from_pem(generate_keypair().public_pem))
    out = remote.list_records()
    assert not out.ok and out.reason == "remote_unsupported"
    assert Kind.AC.value == "ac"


def test_every_listing_backend_lists_the_digests_of_one_kind(remote_url):
    from adstore.store.remote import open_remote

    r = open_remote(remote_url, mode="read-write", timeout=5)
    b = r.backend
    assert b.list_digests(Kind.AC) == []  # nothing yet (WebDAV: no collection yet)
    records = sorted(hashlib.sha256(n).hexdigest() for n in (b"one", b"two"))
    blob = hashlib.sha256(b"blob").hexdigest()
    for d in records:
        b.put(Kind.AC, d, b"record")
    b.put(Kind.CAS, blob, b"blob")
    assert b.list_digests(Kind.AC) == records and b.list_digests(Kind.CAS) == [blob]
    r.close()
