"""The engine cache with a remote tier: two spawned "hosts" with separate roots share one real server
(S3; the Bazel HTTP protocol on WebDAV in the slow run).

Host A (read-write, signing) compiles a real AOTInductor package and pushes
it; host B (read-only, an empty root, trusting A's key) restores it from the
remote and runs it with A's outputs without compiling; host C, trusting
another key, misses ``untrusted_remote`` and compiles its own: an engine is
native code and is never loaded from an untrusted record (docs/remote.md, "Trust and keys").
"""

from __future__ import annotations

import pytest
from remote_engine_hosts import engine_host
from remote_tier_hosts import on_host

from adstore.store.remote import write_keypair

pytest.importorskip("torch")


@pytest.mark.parametrize("backend", ["s3", pytest.param("http", marks=pytest.mark.slow)])
def test_host_b_runs_host_a_engine_from_the_remote_and_an_untrusted_one_is_rebuilt(backend, request, tmp_path):
    url = request.getfixturevalue(f"{backend}_url")
    private, public = write_keypair(tmp_path / "keys")
    _, other_public = write_keypair(tmp_path / "other")
    a = on_host(
        engine_host,
        str(tmp_path / "a"),
        {"ADSTORE_REMOTE": url, "ADSTORE_REMOTE_MODE": "read-write", "ADSTORE_SIGNING_KEY": str(private)},
    )
    assert (a["kind"], a["reason"], a["source"], a["compiles"]) == ("miss", "absent", "compiled", 1), a
    assert a["matches_eager"] and a["counters"]["remote.records_up"] == 1 and a["counters"]["remote.bytes_up"] > 0
    b = on_host(engine_host, str(tmp_path / "b"), {"ADSTORE_REMOTE": url, "ADSTORE_TRUSTED_KEYS": str(public)})
    assert (b["kind"], b["source"], b["compiles"]) == ("hit", "remote", 0), b
    assert b["transferred"] == b["counters"]["remote.bytes_down"] > 0
    assert b["hash"] == a["hash"] and b["output"] == a["output"]
    assert b["counters"]["remote.hits"] == 1 and b["counters"]["remote.bytes_down"] > 0
    assert "remote.bytes_up" not in b["counters"]
    c = on_host(engine_host, str(tmp_path / "c"), {"ADSTORE_REMOTE": url, "ADSTORE_TRUSTED_KEYS": str(other_public)})
    assert (c["kind"], c["reason"], c["compiles"]) == ("miss", "untrusted_remote", 1), c
    assert c["output"] == a["output"] and c["counters"]["remote.misses.untrusted_remote"] == 1
    assert "remote.hits" not in c["counters"] and "remote.blobs_down" not in c["counters"]
